//! Replica snapshots for new servers: `VACUUM INTO` a temporary file (a consistent copy at one
//! commit, taken beside the running writer), drop the change log from the copy, and stream it.
//!
//! [`Snapshots`] bounds what that costs: one build at a time, one file shared by every request
//! for the same watermark (requests that arrive during a build wait for it and are served its
//! file), and a build refused up front when the disk lacks room for a copy of the replica.

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
pub const REPLICA_VERSION_HEADER: &str = "x-highwater-replica-version";

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
    pub async fn open(&self) -> std::io::Result<tokio::fs::File> {
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
    pub fn new(replica_path: PathBuf, dir: PathBuf) -> Snapshots {
        Snapshots {
            replica_path,
            dir,
            latest: tokio::sync::Mutex::new(None),
            built: AtomicU64::new(0),
        }
    }

    /// Snapshots built so far (each request is served one of them).
    pub fn built(&self) -> u64 {
        self.built.load(Ordering::Relaxed)
    }

    /// A snapshot at `current` (the replica's last commit): the kept one when it is at that
    /// watermark, else a new one, built once however many requests ask at the same time.
    pub async fn get(&self, current: &Watermark) -> Result<Arc<Snapshot>, SnapshotError> {
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

/// What a copy of the replica at `replica_path` may take: the file and its WAL.
fn copy_size(replica_path: &Path) -> u64 {
    let size = |path: &Path| std::fs::metadata(path).map_or(0, |m| m.len());
    let mut wal = replica_path.as_os_str().to_owned();
    wal.push("-wal");
    size(replica_path) + size(Path::new(&wal))
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

/// Copies the replica at `replica_path` into a new file in `dir`. Blocking.
pub(crate) fn create(replica_path: &Path, dir: &Path) -> Result<Snapshot, ServeError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!(
        "snapshot-{}-{}.db",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let source = Connection::open(replica_path).map_err(ReplicaError::from)?;
    source
        .busy_timeout(std::time::Duration::from_secs(30))
        .map_err(ReplicaError::from)?;
    source
        .execute("VACUUM INTO ?1", [path.to_string_lossy().as_ref()])
        .map_err(ReplicaError::from)?;
    drop(source);
    // Owns the file from here on: removed on any error below.
    let mut snapshot = Snapshot {
        path,
        watermark: Watermark::parse("00").map_err(ReplicaError::from)?,
        replica_version: Watermark::parse("00").map_err(ReplicaError::from)?,
        size: 0,
    };
    let state = Replica::open(&snapshot.path)?
        .state()
        .cloned()
        .ok_or(ReplicaError::NotInitialized)?;
    snapshot.watermark = state.watermark;
    snapshot.replica_version = state.replica_version;
    let copy = Connection::open(&snapshot.path).map_err(ReplicaError::from)?;
    strip_change_log(&copy).map_err(ReplicaError::from)?;
    drop(copy);
    snapshot.size = std::fs::metadata(&snapshot.path)?.len();
    Ok(snapshot)
}

/// Drops the change-log tables (a restored replica starts its own), compacts the file when
/// they took a good part of it, and leaves it as one self-contained file (no WAL).
fn strip_change_log(copy: &Connection) -> rusqlite::Result<()> {
    for table in change_log::TABLES {
        copy.execute_batch(&format!(r#"DROP TABLE IF EXISTS "{table}""#))?;
    }
    let free: i64 = copy.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
    let pages: i64 = copy.query_row("PRAGMA page_count", [], |r| r.get(0))?;
    if free * 4 > pages {
        copy.execute_batch("VACUUM")?;
    }
    copy.pragma_update(None, "journal_mode", "DELETE")?;
    Ok(())
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
}
