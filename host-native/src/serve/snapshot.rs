//! Replica snapshots for new servers: the replica's tables copied into a new file inside one
//! read transaction (a consistent copy at one commit, taken beside the running writer), the
//! change log left out — a restored relay starts its own — and the file streamed.
//!
//! [`Snapshots`] bounds what that costs: one build at a time, one file shared by every request
//! for the same watermark (requests that arrive during a build wait for it and are served its
//! file), and a build refused up front when the disk lacks room for the copy (the replica less
//! its change log).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::Stream;
use highwater_engine::watermark::Watermark;
use rusqlite::Connection;
use tokio::io::AsyncReadExt;

use super::ServeError;
use crate::change_log;
use crate::replica::{Replica, ReplicaError};

/// Response header naming the commit watermark the snapshot holds.
pub const WATERMARK_HEADER: &str = "x-highwater-watermark";
/// Response header naming the snapshot's replica version.
pub(crate) const REPLICA_VERSION_HEADER: &str = "x-highwater-replica-version";

/// Bytes read from the snapshot file per body chunk.
const CHUNK_BYTES: usize = 256 * 1024;

/// A snapshot file ready to be sent.
#[derive(Debug)]
pub(crate) struct Snapshot {
    path: PathBuf,
    pub watermark: Watermark,
    pub replica_version: Watermark,
    pub size: u64,
}

impl Snapshot {
    /// Opens the file for one response; it stays readable through the open handle after the
    /// snapshot is replaced and its file removed.
    pub(crate) async fn open(&self) -> std::io::Result<tokio::fs::File> {
        tokio::fs::File::open(&self.path).await
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Why no snapshot is served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SnapshotError {
    #[error("expected {needed} bytes free in {dir} for a copy of the replica, found {available}")]
    NoRoom {
        dir: String,
        needed: u64,
        available: u64,
    },
    #[error(transparent)]
    Build(Box<ServeError>),
    #[error("the snapshot task failed: {0}")]
    Task(String),
}

/// The snapshots of one server: at most one build at a time, the last one kept and shared by
/// every request while the replica is still at its watermark.
#[derive(Debug)]
pub(crate) struct Snapshots {
    replica_path: PathBuf,
    dir: PathBuf,
    /// Held for the whole build: a second request waits, then shares the result.
    latest: tokio::sync::Mutex<Option<Arc<Snapshot>>>,
    built: AtomicU64,
}

impl Snapshots {
    pub(crate) fn new(replica_path: PathBuf, dir: PathBuf) -> Snapshots {
        Snapshots {
            replica_path,
            dir,
            latest: tokio::sync::Mutex::new(None),
            built: AtomicU64::new(0),
        }
    }

    /// Snapshots built so far (each request is served one of them).
    pub(crate) fn built(&self) -> u64 {
        self.built.load(Ordering::Relaxed)
    }

    /// A snapshot at `current` (the replica's last commit): the kept one when it is at that
    /// watermark, else a new one, built once however many requests ask at the same time.
    pub(crate) async fn get(&self, current: &Watermark) -> Result<Arc<Snapshot>, SnapshotError> {
        let mut latest = self.latest.lock().await;
        if let Some(snapshot) = latest.as_ref().filter(|s| &s.watermark == current) {
            return Ok(snapshot.clone());
        }
        // The old file goes before the new one is made: the disk holds one at a time.
        *latest = None;
        let (replica_path, dir) = (self.replica_path.clone(), self.dir.clone());
        let snapshot = tokio::task::spawn_blocking(move || {
            check_room(copy_size(&replica_path), &dir)?;
            create(&replica_path, &dir).map_err(|e| SnapshotError::Build(Box::new(e)))
        })
        .await
        .map_err(|e| SnapshotError::Task(e.to_string()))??;
        self.built.fetch_add(1, Ordering::Relaxed);
        let snapshot = Arc::new(snapshot);
        *latest = Some(snapshot.clone());
        Ok(snapshot)
    }
}

/// What a copy of the replica at `replica_path` may take: the file and its WAL, less the pages
/// of the change log, which the copy leaves out.
fn copy_size(replica_path: &Path) -> u64 {
    let size = |path: &Path| std::fs::metadata(path).map_or(0, |m| m.len());
    let mut wal = replica_path.as_os_str().to_owned();
    wal.push("-wal");
    let whole = size(replica_path) + size(Path::new(&wal));
    whole.saturating_sub(change_log_bytes(replica_path).unwrap_or(0))
}

/// Bytes of the pages holding the change-log tables and their indexes (SQLite's `dbstat`,
/// which walks only the b-trees asked for).
fn change_log_bytes(replica_path: &Path) -> rusqlite::Result<u64> {
    let conn = Connection::open_with_flags(
        replica_path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(std::time::Duration::from_secs(30))?;
    let mut names = conn.prepare("SELECT name FROM sqlite_schema WHERE tbl_name = ?1")?;
    let mut pages = conn.prepare("SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name = ?1")?;
    let mut total = 0u64;
    for table in change_log::TABLES {
        let btrees = names
            .query_map([table], |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        for btree in btrees {
            let bytes: i64 = pages.query_row([&btree], |r| r.get(0))?;
            total = total.saturating_add(u64::try_from(bytes).unwrap_or(0));
        }
    }
    Ok(total)
}

/// Refuses a build when `dir`'s file system has less room than `copy` bytes and a tenth more
/// (kept free for everything else).
fn check_room(copy: u64, dir: &Path) -> Result<(), SnapshotError> {
    let needed = copy.saturating_add(copy / 10);
    std::fs::create_dir_all(dir).map_err(|e| SnapshotError::Build(Box::new(e.into())))?;
    let stats = rustix::fs::statvfs(dir)
        .map_err(|e| SnapshotError::Build(Box::new(std::io::Error::from(e).into())))?;
    let available = stats.f_bavail.saturating_mul(stats.f_frsize);
    if available < needed {
        return Err(SnapshotError::NoRoom {
            dir: dir.display().to_string(),
            needed,
            available,
        });
    }
    Ok(())
}

/// Removes snapshot files a previous run left behind, and makes sure the directory exists.
pub(crate) fn clear_dir(dir: &Path) -> Result<(), ServeError> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)?;
    Ok(())
}

/// Copies the replica at `replica_path`, without its change log, into a new file in `dir`.
/// Blocking.
pub(crate) fn create(replica_path: &Path, dir: &Path) -> Result<Snapshot, ServeError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!(
        "snapshot-{}-{}.db",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    // Owns the file from here on: removed on any error below.
    let mut snapshot = Snapshot {
        path,
        watermark: Watermark::parse("00").map_err(ReplicaError::from)?,
        replica_version: Watermark::parse("00").map_err(ReplicaError::from)?,
        size: 0,
    };
    copy_without_change_log(replica_path, &snapshot.path).map_err(ReplicaError::from)?;
    std::fs::File::open(&snapshot.path)?.sync_all()?;
    let state = Replica::open_read_only(&snapshot.path)?
        .state()
        .cloned()
        .ok_or(ReplicaError::NotInitialized)?;
    snapshot.watermark = state.watermark;
    snapshot.replica_version = state.replica_version;
    snapshot.size = std::fs::metadata(&snapshot.path)?.len();
    Ok(snapshot)
}

/// Writes every table, index, view and trigger of the replica except the change log's into
/// the new file `copy`, rows with their rowids, all read in one read transaction (one commit's
/// state). The copy is a single file (rollback journal, no WAL), synced.
fn copy_without_change_log(replica: &Path, copy: &Path) -> rusqlite::Result<()> {
    let conn = Connection::open(copy)?;
    conn.busy_timeout(std::time::Duration::from_secs(30))?;
    // A half-built copy is deleted, never used: no journal needed while building.
    // For the copy only (`main`); the replica attached below keeps its WAL.
    conn.execute_batch("PRAGMA main.journal_mode = OFF; PRAGMA main.synchronous = OFF;")?;
    conn.execute(
        "ATTACH DATABASE ?1 AS source",
        [replica.to_string_lossy().as_ref()],
    )?;
    let tx = conn.unchecked_transaction()?;
    let skipped = |table: &str| change_log::TABLES.contains(&table) || table.starts_with("sqlite_");
    let objects: Vec<(String, String, String, Option<String>)> = {
        let mut query = tx.prepare(
            "SELECT type, name, tbl_name, sql FROM source.sqlite_schema
             ORDER BY CASE type WHEN 'table' THEN 0 WHEN 'index' THEN 1 ELSE 2 END, rowid",
        )?;
        let rows = query.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    let without_rowid: Vec<String> = {
        let mut query =
            tx.prepare("SELECT name FROM pragma_table_list WHERE schema = 'source' AND wr")?;
        let rows = query.query_map([], |r| r.get(0))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    let mut progress = crate::runtime::Progress::new();
    let tables = objects.iter().filter(|(kind, ..)| kind == "table").count();
    let mut copied = 0;
    for (kind, name, table, sql) in &objects {
        let Some(sql) = sql.as_deref().filter(|_| !skipped(table)) else {
            // Automatic indexes (no SQL) come with their tables.
            continue;
        };
        tx.execute_batch(sql)?;
        if kind == "table" {
            copy_rows(&tx, name, without_rowid.contains(name))?;
            copied += 1;
        }
        if progress.due() {
            tracing::info!(
                tables_copied = copied,
                tables,
                last = %name,
                elapsed_s = progress.elapsed_s(),
                "snapshot build in progress"
            );
        }
    }
    let has_sequence: bool = tx.query_row(
        "SELECT count(*) > 0 FROM sqlite_schema WHERE name = 'sqlite_sequence'",
        [],
        |r| r.get(0),
    )?;
    if has_sequence {
        tx.execute_batch(
            "INSERT INTO main.sqlite_sequence SELECT * FROM source.sqlite_sequence
             WHERE name IN (SELECT name FROM main.sqlite_schema)",
        )?;
    }
    let user_version: i64 = tx.query_row("PRAGMA source.user_version", [], |r| r.get(0))?;
    tx.pragma_update(Some("main"), "user_version", user_version)?;
    tx.commit()?;
    conn.execute_batch("DETACH DATABASE source; PRAGMA main.journal_mode = DELETE;")?;
    if progress.logged() {
        tracing::info!(tables, elapsed_s = progress.elapsed_s(), "snapshot built");
    }
    Ok(())
}

/// `INSERT INTO main.t SELECT … FROM source.t`, keeping rowids (the replica orders by them)
/// unless the table has none or every name for the rowid is a column.
fn copy_rows(
    tx: &rusqlite::Transaction<'_>,
    table: &str,
    without_rowid: bool,
) -> rusqlite::Result<()> {
    let columns: Vec<String> = {
        let mut query = tx.prepare(
            "SELECT name FROM pragma_table_xinfo WHERE schema = 'source' AND arg = ?1 AND hidden = 0",
        )?;
        let rows = query.query_map([table], |r| r.get(0))?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    let mut list: Vec<String> = columns.iter().map(|c| quote(c)).collect();
    if !without_rowid {
        let taken = |alias: &str| columns.iter().any(|c| c.eq_ignore_ascii_case(alias));
        if let Some(alias) = ["rowid", "_rowid_", "oid"].into_iter().find(|a| !taken(a)) {
            list.insert(0, alias.to_owned());
        }
    }
    let list = list.join(", ");
    let table = quote(table);
    tx.execute_batch(&format!(
        "INSERT INTO main.{table} ({list}) SELECT {list} FROM source.{table}"
    ))
}

fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The file's bytes as a body stream; it keeps `snapshot` alive until the last byte is read.
pub(crate) fn chunks(
    file: tokio::fs::File,
    snapshot: Arc<Snapshot>,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    futures::stream::unfold(Some((file, snapshot)), |state| async move {
        let (mut file, snapshot) = state?;
        let mut buf = vec![0u8; CHUNK_BYTES];
        match file.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(Bytes::from(buf)), Some((file, snapshot))))
            }
            Err(e) => Some((Err(e), None)),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_disk_without_room_for_the_copy_refuses_the_build() {
        let dir = std::env::temp_dir().join(format!("highwater-room-{}", std::process::id()));
        let replica = dir.join("replica.db");
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(&replica, b"x").expect("write");
        assert_eq!(copy_size(&replica), 1);
        assert!(
            check_room(copy_size(&replica), &dir).is_ok(),
            "one byte fits"
        );
        // A copy larger than any disk here.
        let error = check_room(u64::MAX / 2, &dir).expect_err("no room");
        let message = error.to_string();
        assert!(matches!(error, SnapshotError::NoRoom { .. }), "{message}");
        assert!(message.starts_with("expected "), "{message}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn the_copy_leaves_the_change_log_out_and_keeps_rows_rowids_and_indexes() {
        let dir = std::env::temp_dir().join(format!("highwater-copy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let replica = dir.join("replica.db");
        let conn = Connection::open(&replica).expect("open");
        conn.pragma_update(None, "journal_mode", "WAL")
            .expect("wal");
        conn.execute_batch(
            r#"CREATE TABLE items (name TEXT, "rowid" INTEGER);
               CREATE TABLE plain (v TEXT);
               CREATE TABLE keyed (k TEXT PRIMARY KEY, v TEXT) WITHOUT ROWID;
               CREATE INDEX plain_v ON plain (v);
               CREATE TABLE "_hw_change_log" (watermark TEXT, pos INTEGER, json TEXT);
               CREATE INDEX change_log_by_watermark ON "_hw_change_log" (watermark);
               CREATE TABLE "_hw_change_log_state" (last_watermark TEXT);
               INSERT INTO plain (rowid, v) VALUES (7, 'seven'), (3, 'three');
               INSERT INTO items VALUES ('a', 42);
               INSERT INTO keyed VALUES ('k', 'v');
               PRAGMA user_version = 5;"#,
        )
        .expect("schema");
        let tx = conn.unchecked_transaction().expect("tx");
        for i in 0..2000 {
            tx.execute(
                r#"INSERT INTO "_hw_change_log" VALUES (?1, ?2, ?3)"#,
                rusqlite::params![format!("{i:08}"), i, "x".repeat(1000)],
            )
            .expect("log row");
        }
        tx.commit().expect("commit");
        let whole = std::fs::metadata(&replica).expect("db").len()
            + std::fs::metadata(dir.join("replica.db-wal")).map_or(0, |m| m.len());
        // The disk check asks for the replica's own pages only, not the 2 MB log.
        let needed = copy_size(&replica);
        assert!(whole > 2_000_000, "{whole}");
        assert!(
            needed < 200_000,
            "expected a small copy, sized {needed} of {whole}"
        );

        let copy = dir.join("copy.db");
        copy_without_change_log(&replica, &copy).expect("copy");
        assert!(std::fs::metadata(&copy).expect("copy").len() < 200_000);
        assert!(!dir.join("copy.db-wal").exists());
        let copied = Connection::open(&copy).expect("open copy");
        let names: Vec<String> = copied
            .prepare("SELECT name FROM sqlite_schema ORDER BY name")
            .and_then(|mut q| q.query_map([], |r| r.get(0))?.collect())
            .expect("schema");
        assert_eq!(names, ["items", "keyed", "plain", "plain_v"]);
        let plain: Vec<(i64, String)> = copied
            .prepare("SELECT rowid, v FROM plain ORDER BY rowid")
            .and_then(|mut q| q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
            .expect("plain");
        assert_eq!(plain, [(3, "three".to_owned()), (7, "seven".to_owned())]);
        let item: (String, i64) = copied
            .query_row(r#"SELECT name, "rowid" FROM items"#, [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .expect("items");
        assert_eq!(item, ("a".to_owned(), 42));
        let keyed: String = copied
            .query_row("SELECT v FROM keyed WHERE k = 'k'", [], |r| r.get(0))
            .expect("keyed");
        assert_eq!(keyed, "v");
        let version: i64 = copied
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .expect("version");
        assert_eq!(version, 5);
        drop(copied);
        // The replica itself is untouched: still in WAL mode, its log still there.
        let mode: String = conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .expect("mode");
        assert_eq!(mode, "wal");
        let logged: i64 = conn
            .query_row(r#"SELECT count(*) FROM "_hw_change_log""#, [], |r| r.get(0))
            .expect("log");
        assert_eq!(logged, 2000);
        drop(conn);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
