//! Syncing the replica's write-ahead log apart from its commits.
//!
//! `serve`'s ingest thread commits each group with `synchronous = NORMAL`: the commit writes its
//! WAL frames (into the page cache) and returns without an fsync. The fsync is made here, on a
//! blocking thread of the runtime, while the ingest thread goes on decoding, forwarding and
//! applying the next transactions; a group is reported durable (and confirmed upstream) only
//! once an fsync of the WAL file that started after its commit returned has returned (the
//! engine's `upstream::GroupCommit` holds that rule). A slow fsync, tens of milliseconds on a
//! busy disk, then delays the acknowledgement to Postgres, not the subscribers.
//!
//! Why this keeps the promise that nothing acknowledged is lost: in WAL mode a commit is its
//! frames in the `-wal` file, the last one marked as a commit, and recovery after a power loss
//! replays the frames up to the last valid commit frame (their checksums chain from the WAL
//! header, which SQLite syncs itself whenever it starts the log over, at every `synchronous`
//! level but `OFF`). `fdatasync` of that file after the commit returned puts every frame of the
//! commit on disk. Frames of later commits, written and not yet synced, may be lost, and their
//! commits with them: none of those was reported durable, so Postgres sends them again.
//! Checkpoints (SQLite's own, on the committing connection) sync the WAL before they copy it
//! into the database file, as they do at `FULL`.
//!
//! Written by hand: SQLite has no call that syncs a commit already made, and `synchronous` is
//! a setting of the connection that syncs on the committing thread.

use std::path::{Path, PathBuf};

use rusqlite::Connection;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::pause_point::{self, Point};

/// Syncs one database's WAL file, one sync at a time.
pub struct WalSync {
    wal: PathBuf,
    running: Option<oneshot::Receiver<std::io::Result<()>>>,
}

/// Why a connection's commits cannot be synced apart.
#[derive(Debug, thiserror::Error)]
pub enum WalSyncError {
    #[error("the replica is not in WAL mode (journal mode {0}); its commits sync themselves")]
    NotWal(String),
    #[error("the replica has no file (an in-memory database); its commits sync themselves")]
    NoFile,
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
}

impl WalSync {
    /// Switches `conn` (a database in WAL mode, in a file) to commits that do not sync, and
    /// returns what syncs them. Until [`WalSync::start`]'s sync returns, nothing committed on
    /// `conn` since the last one is durable.
    pub fn take_over(conn: &Connection) -> Result<WalSync, WalSyncError> {
        let mode: String = conn.query_row("PRAGMA journal_mode", [], |row| row.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(WalSyncError::NotWal(mode));
        }
        let path = conn
            .path()
            .filter(|path| !path.is_empty())
            .ok_or(WalSyncError::NoFile)?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        Ok(WalSync {
            wal: wal_path(Path::new(path)),
            running: None,
        })
    }

    /// Whether a sync is running.
    pub fn running(&self) -> bool {
        self.running.is_some()
    }

    /// Starts a sync of everything committed so far, on a blocking thread (`transactions`:
    /// those it makes durable, for the crash tests' pause point).
    pub fn start(&mut self, handle: &Handle, transactions: usize) {
        let (done, running) = oneshot::channel();
        let wal = self.wal.clone();
        handle.spawn_blocking(move || {
            pause_point::reach(Point::BeforeGroupSync, transactions);
            let _ = done.send(sync_file(&wal));
        });
        self.running = Some(running);
    }

    /// The running sync's result if it returned; `None` while it runs, or with none running.
    pub fn poll(&mut self) -> Option<std::io::Result<()>> {
        let running = self.running.as_mut()?;
        match running.try_recv() {
            Ok(result) => {
                self.running = None;
                Some(result)
            }
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => {
                self.running = None;
                Some(Err(std::io::Error::other("the WAL sync's thread ended")))
            }
        }
    }

    /// Waits for the running sync; never returns with none running (for a `select!` branch
    /// guarded by [`WalSync::running`]).
    pub async fn done(&mut self) -> std::io::Result<()> {
        let Some(running) = self.running.as_mut() else {
            return std::future::pending().await;
        };
        let result = running
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("the WAL sync's thread ended")));
        self.running = None;
        result
    }
}

/// SQLite's name for a database's write-ahead log: the database's path and `-wal`.
fn wal_path(db: &Path) -> PathBuf {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    PathBuf::from(wal)
}

/// `fdatasync` of the file (opened anew each time: SQLite may delete and create the WAL when
/// the last connection closes, and a sync through any descriptor of the file syncs its data).
fn sync_file(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_data()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_db(name: &str) -> (PathBuf, Connection) {
        let dir = std::env::temp_dir().join(format!("highwater-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("replica.db");
        let conn = Connection::open(&path).unwrap();
        (dir, conn)
    }

    #[test]
    fn a_wal_database_commits_without_syncing_and_its_wal_file_syncs_apart() {
        let (dir, conn) = temp_db("wal-sync");
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.pragma_update(None, "synchronous", "FULL").unwrap();
        let mut sync = WalSync::take_over(&conn).unwrap();
        let level: i64 = conn
            .query_row("PRAGMA synchronous", [], |row| row.get(0))
            .unwrap();
        assert_eq!(
            level, 1,
            "commits on the connection no longer sync (NORMAL)"
        );
        assert_eq!(sync.wal, dir.join("replica.db-wal"));
        conn.execute_batch("CREATE TABLE t (a); INSERT INTO t VALUES (1);")
            .unwrap();
        assert!(sync.wal.exists(), "the commit is in the WAL file");

        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        assert!(sync.poll().is_none(), "nothing running");
        sync.start(runtime.handle(), 1);
        assert!(sync.running());
        runtime.block_on(sync.done()).unwrap();
        assert!(!sync.running());

        // A WAL file that is gone (its database deleted under it) is an error, not a success.
        drop(conn);
        std::fs::remove_dir_all(&dir).unwrap();
        sync.start(runtime.handle(), 1);
        let error = runtime.block_on(sync.done()).unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::NotFound);
    }

    #[test]
    fn a_database_not_in_wal_mode_or_in_memory_keeps_syncing_its_commits() {
        let (dir, conn) = temp_db("wal-sync-delete");
        conn.pragma_update(None, "journal_mode", "DELETE").unwrap();
        conn.pragma_update(None, "synchronous", "FULL").unwrap();
        assert!(matches!(
            WalSync::take_over(&conn),
            Err(WalSyncError::NotWal(mode)) if mode == "delete"
        ));
        let level: i64 = conn
            .query_row("PRAGMA synchronous", [], |row| row.get(0))
            .unwrap();
        assert_eq!(level, 2, "left at FULL");
        let memory = Connection::open_in_memory().unwrap();
        assert!(WalSync::take_over(&memory).is_err());
        drop(conn);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
