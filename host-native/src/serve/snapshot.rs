//! Replica snapshots for new servers: `VACUUM INTO` a temporary file (a consistent copy at one
//! commit, taken beside the running writer), drop the change log from the copy, and stream it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// Opens the file and unlinks it: it lives as long as the response reads it.
    pub async fn open(&self) -> std::io::Result<tokio::fs::File> {
        let file = tokio::fs::File::open(&self.path).await;
        let _ = tokio::fs::remove_file(&self.path).await;
        file
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        // Already gone once opened; this covers snapshots that were never sent.
        let _ = std::fs::remove_file(&self.path);
    }
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

/// The file's bytes as a body stream.
pub(crate) fn chunks(
    file: tokio::fs::File,
) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    futures::stream::unfold(Some(file), |file| async move {
        let mut file = file?;
        let mut buf = vec![0u8; CHUNK_BYTES];
        match file.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok(Bytes::from(buf)), Some(file)))
            }
            Err(e) => Some((Err(e), None)),
        }
    })
}
