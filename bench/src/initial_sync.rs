//! `highwater-bench initial-sync`: how fast an initial sync copies a table into the replica,
//! measured against `psql -c "\copy (SELECT …) to /dev/null"` on the same table.
//!
//! Setup: the `bench ingest` table (~170-byte order rows) filled with `--rows` rows by one
//! `INSERT … SELECT generate_series`, then `VACUUM (ANALYZE)` so that neither reader pays for
//! setting hint bits and the row estimate is current. `psql`, from the Postgres installation
//! the private server runs (or the newest one found), copies the table to `/dev/null` once
//! before and once after Highwater; the faster of the two is the yardstick. Highwater runs the
//! real resync path (`Upstream::prepare` + `Upstream::resync`: new slot, exported snapshot,
//! parallel COPY readers, one SQLite writer, durable final commit) into a fresh replica.
//!
//! The run fails unless the replica ends with the upstream row count. Peak RSS is this
//! process's `VmHWM` reset just before the sync (the upstream server is another process).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use tokio_postgres::{Client, Config};

use super::common::{
    cpu_time, drop_bench_objects, peak_rss_kib, replica_row_count, reset_peak_rss, thousands,
    WorkDir,
};
use super::workload::{self, TABLE};
use highwater_host::private_pg::{newest_bin_dir, PgOptions, PrivatePg};
use highwater_host::replica::Replica;
use highwater_host::replication::bootstrap::Upstream;
use highwater_host::replication::initial_sync::SyncOptions;
use highwater_host::replication::ConnectParams;

/// Names Highwater's slot, schema and DDL trigger (not `bench ingest`'s, so both can share
/// an upstream).
const APP_ID: &str = "hwbenchsync";
const MIB: f64 = 1024.0 * 1024.0;
/// The columns of the benchmark table, in table order.
const COLUMNS: &str = "id, account_id, status, title, amount, created_at, attributes";

/// Settings of the private server: no autovacuum or checkpoints in the middle of the copy.
const SERVER_SETTINGS: &[(&str, &str)] = &[
    ("autovacuum", "off"),
    ("max_wal_size", "8GB"),
    ("checkpoint_timeout", "1h"),
    ("shared_buffers", "256MB"),
];

/// Command-line arguments of `highwater-bench initial-sync`.
#[derive(Debug, Clone, clap::Args)]
pub struct InitialSyncArgs {
    /// Rows in the copied table.
    #[arg(long, default_value_t = 5_000_000)]
    pub rows: u64,
    /// Upstream Postgres URL (a superuser; wal_level=logical). By default a private server is
    /// started. The benchmark creates and finally drops its own table, publication, slot and
    /// `hwbenchsync` schema there.
    #[arg(long)]
    pub upstream: Option<String>,
    /// COPY readers of the initial sync (`--sync-workers` of `replicate` and `serve`).
    #[arg(long, default_value_t = highwater_host::replication::initial_sync::DEFAULT_SYNC_WORKERS)]
    pub sync_workers: usize,
    /// Directory for the replica; by default a temporary one, removed afterwards.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

/// What one run measured.
#[derive(Debug, Clone)]
pub struct InitialSyncReport {
    pub server_version: String,
    pub rows: u64,
    pub table_bytes: u64,
    /// The faster of the two `\copy` runs.
    pub psql: Duration,
    pub highwater: Duration,
    pub workers: usize,
    /// User plus system CPU time of this process during the sync (readers, writer and the
    /// connection tasks; not the upstream server's).
    pub cpu: Option<Duration>,
    pub peak_rss_kib: Option<u64>,
    pub replica_rows: u64,
}

/// Runs the benchmark and prints its table.
pub fn run(args: InitialSyncArgs) -> anyhow::Result<()> {
    highwater_host::runtime::init_tracing("warn");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = runtime.block_on(bench(&args))?;
    print!("{}", report.render());
    Ok(())
}

async fn bench(args: &InitialSyncArgs) -> anyhow::Result<InitialSyncReport> {
    // Kept until the end: dropping it stops the private server.
    let (_private, url) = match &args.upstream {
        Some(url) => (None, url.clone()),
        None => {
            let options = PgOptions {
                settings: SERVER_SETTINGS
                    .iter()
                    .map(|&(k, v)| (k.to_owned(), v.to_owned()))
                    .collect(),
                ..PgOptions::default()
            };
            let pg = PrivatePg::start(options).await?;
            let url = pg.url();
            (Some(pg), url)
        }
    };
    let params: ConnectParams = url.parse()?;
    let config = params.query_config().clone();
    let work = WorkDir::new(args.work_dir.as_deref(), "highwater-bench-sync")?;
    let mut client = workload::connect(&config).await?;
    drop_objects(&client).await?;
    let result = tokio::select! {
        result = measure(args, &url, &config, &mut client, &work) => result,
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    // A slot left behind would retain WAL upstream forever: drop it whatever happened.
    let cleanup = drop_objects(&client).await;
    let report = result?;
    cleanup?;
    Ok(report)
}

async fn measure(
    args: &InitialSyncArgs,
    url: &str,
    config: &Config,
    client: &mut Client,
    work: &WorkDir,
) -> anyhow::Result<InitialSyncReport> {
    workload::create_schema(client).await?;
    let server_version: String = client
        .query_one("SHOW server_version", &[])
        .await?
        .try_get(0)?;
    if args.rows > 0 {
        workload::bulk_insert(client, 1, args.rows).await?;
    }
    client
        .batch_execute(&format!("VACUUM (ANALYZE) public.{TABLE}"))
        .await?;
    let table_bytes: i64 = client
        .query_one(
            &format!("SELECT pg_table_size('public.{TABLE}'::regclass)"),
            &[],
        )
        .await?
        .try_get(0)?;
    let upstream_rows = workload::row_count(client).await?;

    let psql_bin = psql_bin(client).await?;
    let first = psql_copy(&psql_bin, config).await?;

    let replica_dir = work.replica_dir();
    let workers = args.sync_workers.max(1);
    let handle = tokio::runtime::Handle::current();
    let url_owned = url.to_owned();
    let dir = replica_dir.clone();
    let (highwater, cpu, peak_rss_kib) = tokio::task::spawn_blocking(move || {
        let upstream = Upstream::prepare(&handle, &url_owned, APP_ID, &[])?;
        let replica = Replica::open_in_dir(&dir)?;
        let measured = reset_peak_rss();
        let cpu_before = cpu_time();
        let started = Instant::now();
        let options = SyncOptions {
            workers,
            ..SyncOptions::default()
        };
        let (replica, _) = upstream.resync(&handle, replica, &dir, &options, &|| false)?;
        let elapsed = started.elapsed();
        let cpu = cpu_time()
            .zip(cpu_before)
            .map(|(after, before)| after - before);
        let peak = measured.then(peak_rss_kib).flatten();
        drop(replica);
        anyhow::Ok((elapsed, cpu, peak))
    })
    .await
    .context("the initial sync thread panicked")??;

    let second = psql_copy(&psql_bin, config).await?;
    let replica_rows = replica_row_count(&replica_dir)?;
    if replica_rows != upstream_rows {
        bail!(
            "expected the replica to hold the {upstream_rows} upstream rows after the initial \
             sync, found {replica_rows}"
        );
    }
    Ok(InitialSyncReport {
        server_version,
        rows: upstream_rows,
        table_bytes: u64::try_from(table_bytes)?,
        psql: first.min(second),
        highwater,
        workers,
        cpu,
        peak_rss_kib,
        replica_rows,
    })
}

/// `psql` of the upstream's own installation when it is local (`pg_config` of the running
/// server is not reachable over SQL, so: the installation whose major version matches), else
/// the newest installed.
async fn psql_bin(client: &Client) -> anyhow::Result<PathBuf> {
    let major: String = client
        .query_one("SELECT current_setting('server_version_num')", &[])
        .await?
        .try_get(0)?;
    let major = major.get(..major.len().saturating_sub(4)).unwrap_or("");
    let candidate = PathBuf::from(format!("/usr/lib/postgresql/{major}/bin/psql"));
    if candidate.exists() {
        return Ok(candidate);
    }
    Ok(newest_bin_dir()?.join("psql"))
}

/// Times `psql -c "\copy (SELECT …) to /dev/null"`. The connection settings go through the
/// environment, so a password never appears on a command line.
async fn psql_copy(psql: &Path, config: &Config) -> anyhow::Result<Duration> {
    let mut command = tokio::process::Command::new(psql);
    command
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-c"])
        .arg(format!(
            "\\copy (SELECT {COLUMNS} FROM public.{TABLE}) to /dev/null"
        ))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    if let Some(host) = config.get_hosts().first() {
        match host {
            tokio_postgres::config::Host::Tcp(name) => {
                command.env("PGHOST", name);
            }
            tokio_postgres::config::Host::Unix(path) => {
                command.env("PGHOST", path);
            }
        }
    }
    if let Some(port) = config.get_ports().first() {
        command.env("PGPORT", port.to_string());
    }
    if let Some(user) = config.get_user() {
        command.env("PGUSER", user);
    }
    if let Some(db) = config.get_dbname() {
        command.env("PGDATABASE", db);
    }
    if let Some(password) = config.get_password() {
        command.env("PGPASSWORD", String::from_utf8_lossy(password).as_ref());
    }
    let started = Instant::now();
    let output = command
        .output()
        .await
        .with_context(|| format!("cannot run {}", psql.display()))?;
    let elapsed = started.elapsed();
    if !output.status.success() {
        bail!(
            "expected psql \\copy to succeed, it exited with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(elapsed)
}

/// Drops the slot, the DDL trigger's schema, the table and the publication, if present.
async fn drop_objects(client: &Client) -> anyhow::Result<()> {
    drop_bench_objects(client, APP_ID, &[]).await
}

impl InitialSyncReport {
    /// Highwater's rows/s over `\copy`'s.
    pub fn ratio(&self) -> Option<f64> {
        let highwater = self.highwater.as_secs_f64();
        (highwater > 0.0).then(|| self.psql.as_secs_f64() / highwater)
    }

    fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "highwater-bench initial-sync (Postgres {}; --sync-workers {}; psql \\copy to \
             /dev/null: faster of a run before and one after)\n",
            self.server_version, self.workers
        );
        let _ = writeln!(
            out,
            "| Rows | Table size | Reader | Seconds | Rows/s | MiB/s | CPU | Peak RSS |"
        );
        let _ = writeln!(out, "|---:|---:|---|---:|---:|---:|---:|---:|");
        let line = |name: &str, elapsed: Duration, cpu: Option<Duration>, rss: Option<u64>| {
            let seconds = elapsed.as_secs_f64().max(1e-9);
            let cpu = cpu.map_or("-".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()));
            let rss = rss.map_or("-".to_owned(), |kib| {
                format!("{:.0} MiB", kib as f64 / 1024.0)
            });
            format!(
                "| {} | {:.1} MiB | {name} | {seconds:.2} | {} | {:.1} | {cpu} | {rss} |\n",
                thousands(self.rows as f64),
                self.table_bytes as f64 / MIB,
                thousands(self.rows as f64 / seconds),
                self.table_bytes as f64 / MIB / seconds,
            )
        };
        out.push_str(&line("psql \\copy to /dev/null", self.psql, None, None));
        out.push_str(&line(
            "highwater initial sync",
            self.highwater,
            self.cpu,
            self.peak_rss_kib,
        ));
        let _ = writeln!(
            out,
            "\nhighwater / psql \\copy speed: {}\nrows: {} upstream, {} in the replica",
            self.ratio().map_or("-".to_owned(), |r| format!("{r:.2}")),
            self.rows,
            self.replica_rows
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tiny_run_copies_every_row_and_leaves_no_slot_behind() {
        let pg = PrivatePg::start(PgOptions::default()).await.unwrap();
        let args = InitialSyncArgs {
            rows: 3_000,
            upstream: Some(pg.url()),
            sync_workers: 2,
            work_dir: None,
        };
        let report = bench(&args).await.unwrap();
        assert_eq!((report.rows, report.replica_rows), (3_000, 3_000));
        assert!(report.table_bytes > 3_000 * 100, "{report:?}");
        let table = report.render();
        assert!(table.contains("| highwater initial sync |"), "{table}");
        assert!(table.contains("| psql \\copy to /dev/null |"), "{table}");
        let client = pg.connect().await.unwrap();
        let slots: i64 = client
            .query_one("SELECT count(*) FROM pg_replication_slots", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(slots, 0);
    }
}
