//! What the benchmarks share: their work directory, this process's CPU time and peak RSS,
//! the replica's row count, dropping a slot, and number formatting.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use tokio_postgres::Client;

use super::workload::TABLE;
use highwater_host::replica::schema::{quote_ident, replica_table_name};

/// A run's files: the replica (and `bench ingest`'s `pg_recvlogical` output); a temporary
/// directory, removed afterwards, unless the user named one.
pub(super) struct WorkDir {
    pub(super) path: PathBuf,
    temporary: bool,
}

impl WorkDir {
    pub(super) fn new(dir: Option<&Path>, prefix: &str) -> anyhow::Result<WorkDir> {
        let (path, temporary) = match dir {
            Some(dir) => (dir.to_owned(), false),
            None => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.subsec_nanos());
                let name = format!("{prefix}-{}-{nanos:x}", std::process::id());
                (std::env::temp_dir().join(name), true)
            }
        };
        let replica = path.join("replica");
        if replica.exists() {
            std::fs::remove_dir_all(&replica)
                .with_context(|| format!("cannot remove the old {}", replica.display()))?;
        }
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(WorkDir { path, temporary })
    }

    pub(super) fn replica_dir(&self) -> PathBuf {
        self.path.join("replica")
    }

    /// A fresh (removed if present) `pg_recvlogical` output file.
    pub(super) fn recvlogical_output(&self, name: &str) -> anyhow::Result<PathBuf> {
        let path = self.path.join(format!("recvlogical-{name}.bin"));
        if path.exists() {
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove the old {}", path.display()))?;
        }
        Ok(path)
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if self.temporary {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

pub(super) async fn drop_slot(client: &Client, slot: &str) -> anyhow::Result<()> {
    const ATTEMPTS: usize = 100;
    for attempt in 1..=ATTEMPTS {
        let Some(row) = client
            .query_opt(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await?
        else {
            return Ok(());
        };
        if let Some(pid) = row.try_get::<_, Option<i32>>(0)? {
            client
                .execute("SELECT pg_terminate_backend($1)", &[&pid])
                .await?;
        } else {
            match client
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
            {
                Ok(_) => return Ok(()),
                // A consumer may take the slot again between the check and the drop.
                Err(_) if attempt < ATTEMPTS => {}
                Err(error) => return Err(error).context(format!("cannot drop slot {slot}")),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("slot {slot} stayed in use")
}

/// Drops what a bench's replicator with `app_id` leaves upstream: its slot and `other_slots`,
/// its DDL event trigger and schema, and the workload's table and publication.
pub(super) async fn drop_bench_objects(
    client: &Client,
    app_id: &str,
    other_slots: &[&str],
) -> anyhow::Result<()> {
    let slot = highwater_host::replication::setup::ReplicationNames::for_app(app_id)?.slot;
    for slot in std::iter::once(slot.as_str()).chain(other_slots.iter().copied()) {
        drop_slot(client, slot).await?;
    }
    client
        .batch_execute(&format!(
            "DROP EVENT TRIGGER IF EXISTS {app_id}_ddl; DROP SCHEMA IF EXISTS {app_id} CASCADE;"
        ))
        .await
        .context("cannot drop the replicator's DDL trigger")?;
    super::workload::drop_schema(client).await
}

/// Resets this process's peak RSS (`VmHWM`); false where the kernel does not allow it.
pub(super) fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// User plus system CPU time of this process (all threads).
pub(super) fn cpu_time() -> Option<Duration> {
    // Linux reports these in USER_HZ ticks, 100 per second on every architecture it runs on.
    const TICKS_PER_SECOND: u64 = 100;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis(
        (user + system) * 1000 / TICKS_PER_SECOND,
    ))
}

/// This process's peak resident set size (`VmHWM`).
pub(super) fn peak_rss_kib() -> Option<u64> {
    status_kib("VmHWM:")
}

/// Another process's resident set size (`VmRSS` of `/proc/<pid>/status`).
pub(super) fn rss_kib_of(pid: u32) -> Option<u64> {
    status_kib_of(&format!("/proc/{pid}/status"), "VmRSS:")
}

/// A `kB` field of `/proc/self/status`.
fn status_kib(field: &str) -> Option<u64> {
    status_kib_of("/proc/self/status", field)
}

/// A `kB` field of a `status` file of `/proc`.
fn status_kib_of(path: &str, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(path).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

pub(super) fn replica_row_count(replica_dir: &Path) -> anyhow::Result<u64> {
    let db = rusqlite::Connection::open_with_flags(
        replica_dir.join("replica.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )?;
    let table = quote_ident(&replica_table_name("public", TABLE));
    let count: i64 = db.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))?;
    Ok(u64::try_from(count)?)
}

/// `1234567.8` → `1,234,568`.
pub(super) fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}
