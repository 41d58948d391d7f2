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
//!
//! Checkpoints (copying the WAL into the database file, which syncs the WAL first and the
//! database file after) run here too, on a connection of their own, after a sync that found
//! the WAL past [`CHECKPOINT_FRAMES`]: SQLite's automatic ones would run inside a commit on
//! the ingest thread, two fsyncs long. A checkpoint is `PASSIVE` (it waits for no reader or
//! writer), never delays a sync's result, and at most one runs at a time. What stays on the
//! ingest thread is SQLite's sync of the WAL header when the next commit starts the log over
//! after a checkpoint, once per [`CHECKPOINT_FRAMES`] frames.
//!
//! Written by hand: SQLite has no call that syncs a commit already made, and `synchronous` is
//! a setting of the connection that syncs on the committing thread.
//!
//! What the sync apart costs is CPU. Each group pays a hand-off to the blocking thread and a
//! wake-up back, on top of the wake-ups every transaction already pays (the replication socket
//! task, the ingest thread, the group's linger timer, each connection's writer task, the reader
//! of its acks, the acknowledgement to Postgres); at a low rate every transaction is a group of
//! its own and pays all of them. Fewer wake-ups per transaction at low rates is not built. At
//! a high rate the ingest thread, no longer stopping for the disk, forwards smaller frames,
//! each with its own write and ack. `replicate` keeps commits that sync themselves
//! (`synchronous = FULL`): it has no subscribers to keep waiting, and its group commit already
//! spreads one fsync over the transactions queued. `BENCHMARKS.md`, section "Fan-out: one
//! change stream to many subscribers, and catch-up from the log", measures both.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rusqlite::hooks::Wal;
use rusqlite::{Connection, OpenFlags};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::pause_point::{self, Point};

/// WAL frames past which a sync is followed by a checkpoint: SQLite's own default for its
/// automatic checkpoints (about 4 MiB of 4 KiB pages).
pub(crate) const CHECKPOINT_FRAMES: i32 = 1000;

thread_local! {
    /// Frames in the WAL after the last commit on this thread, from the connection's WAL hook
    /// (a plain `fn`, so the count travels through the thread that commits, which is the one
    /// that starts the syncs).
    static WAL_FRAMES: Cell<i32> = const { Cell::new(0) };
}

fn note_wal_frames(_: &Wal, frames: std::ffi::c_int) -> rusqlite::Result<()> {
    WAL_FRAMES.with(|f| f.set(frames));
    Ok(())
}

/// Syncs one database's WAL file, one sync at a time, and checkpoints it.
pub(crate) struct WalSync {
    wal: PathBuf,
    running: Option<oneshot::Receiver<std::io::Result<()>>>,
    /// The checkpoints' connection; held by the one running.
    checkpointer: Arc<Mutex<Connection>>,
    /// Checkpoints that completed (every frame copied), for the tests.
    checkpoints: Arc<AtomicU64>,
}

/// Why a connection's commits cannot be synced apart.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WalSyncError {
    #[error("the replica is not in WAL mode (journal mode {0}); its commits sync themselves")]
    NotWal(String),
    #[error("the replica has no file (an in-memory database); its commits sync themselves")]
    NoFile,
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
}

impl WalSync {
    /// Switches `conn` (a database in WAL mode, in a file) to commits that do not sync and
    /// do not checkpoint, and returns what syncs and checkpoints them. Until
    /// [`WalSync::start`]'s sync returns, nothing committed on `conn` since the last one is
    /// durable.
    pub(crate) fn take_over(conn: &Connection) -> Result<WalSync, WalSyncError> {
        let mode: String = conn.query_row("PRAGMA journal_mode", [], |row| row.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(WalSyncError::NotWal(mode));
        }
        let path = conn
            .path()
            .filter(|path| !path.is_empty())
            .ok_or(WalSyncError::NoFile)?;
        let checkpointer = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        let wal = wal_path(Path::new(path));
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        // Replaces the automatic checkpoints (themselves a WAL hook) with the frame count.
        conn.wal_hook(Some(note_wal_frames));
        Ok(WalSync {
            wal,
            running: None,
            checkpointer: Arc::new(Mutex::new(checkpointer)),
            checkpoints: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Checkpoints that completed so far.
    #[cfg(test)]
    pub(crate) fn checkpoints(&self) -> u64 {
        self.checkpoints.load(Ordering::Relaxed)
    }

    /// Whether a sync is running.
    pub(crate) fn running(&self) -> bool {
        self.running.is_some()
    }

    /// Starts a sync of everything committed so far, on a blocking thread (`transactions`:
    /// those it makes durable, for the crash tests' pause point), then a checkpoint if the
    /// last commit on this thread left the WAL past [`CHECKPOINT_FRAMES`].
    pub(crate) fn start(&mut self, handle: &Handle, transactions: usize) {
        let (done, running) = oneshot::channel();
        let wal = self.wal.clone();
        let checkpoint = WAL_FRAMES.with(Cell::get) >= CHECKPOINT_FRAMES;
        let (checkpointer, checkpoints) = (self.checkpointer.clone(), self.checkpoints.clone());
        handle.spawn_blocking(move || {
            pause_point::reach(Point::BeforeGroupSync, transactions);
            let synced = sync_file(&wal);
            let ok = synced.is_ok();
            let _ = done.send(synced);
            if ok && checkpoint {
                run_checkpoint(&checkpointer, &checkpoints);
            }
        });
        self.running = Some(running);
    }

    /// The running sync's result if it returned; `None` while it runs, or with none running.
    pub(crate) fn poll(&mut self) -> Option<std::io::Result<()>> {
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
    pub(crate) async fn done(&mut self) -> std::io::Result<()> {
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

/// A `PASSIVE` checkpoint, unless one is running. A checkpoint that fails or cannot copy
/// everything (a reader still needs old frames) is tried again after a later sync; the WAL
/// only grows meanwhile, as it would with SQLite's own checkpoints.
fn run_checkpoint(checkpointer: &Mutex<Connection>, checkpoints: &AtomicU64) {
    let Ok(conn) = checkpointer.try_lock() else {
        return;
    };
    let result = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
        Ok((
            row.get::<_, i64>(0)?,
            row.get::<_, i64>(1)?,
            row.get::<_, i64>(2)?,
        ))
    });
    match result {
        Ok((0, log, copied)) if log == copied => {
            checkpoints.fetch_add(1, Ordering::Relaxed);
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "a checkpoint of the replica failed"),
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
    fn checkpoints_run_after_a_sync_not_in_the_commits() {
        let (dir, conn) = temp_db("wal-checkpoint");
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        let mut sync = WalSync::take_over(&conn).unwrap();
        conn.execute_batch("CREATE TABLE t (a BLOB)").unwrap();
        // Well past the frames at which SQLite would have checkpointed (and started the log
        // over) inside one of these commits.
        for _ in 0..400 {
            conn.execute_batch("INSERT INTO t VALUES (randomblob(16000))")
                .unwrap();
        }
        let frames = WAL_FRAMES.with(Cell::get);
        assert!(
            frames >= 2 * CHECKPOINT_FRAMES,
            "no checkpoint ran inside a commit: {frames} frames"
        );
        assert_eq!(sync.checkpoints(), 0);

        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        sync.start(runtime.handle(), 1);
        runtime.block_on(sync.done()).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while sync.checkpoints() == 0 {
            assert!(std::time::Instant::now() < deadline, "no checkpoint ran");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Everything was copied: the next commit starts the log over.
        conn.execute_batch("INSERT INTO t VALUES (1)").unwrap();
        let frames = WAL_FRAMES.with(Cell::get);
        assert!(frames < 10, "the log did not start over: {frames} frames");
        let count: i64 = conn
            .query_row("SELECT count(*) FROM t", [], |row| row.get(0))
            .unwrap();
        assert_eq!(count, 401);

        // Below the threshold a sync runs no checkpoint.
        sync.start(runtime.handle(), 1);
        runtime.block_on(sync.done()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(sync.checkpoints(), 1);
        drop(conn);
        drop(sync);
        let _ = std::fs::remove_dir_all(&dir);
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
