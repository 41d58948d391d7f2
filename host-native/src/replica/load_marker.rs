//! The marker of an initial load in progress: `<replica>.loading`, made durable before the load
//! writes its first row and removed once the loaded rows and the state that says they are there
//! are durable.
//!
//! The load writes without a journal and without fsyncs (that is most of its speed), so a crash
//! or a power loss in the middle of it can leave the database file in any state, one SQLite
//! cannot open included. A replica found next to its marker is therefore removed unopened, and
//! the next start syncs again from nothing.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// The marker of the replica at `db`.
pub fn marker_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push(".loading");
    PathBuf::from(name)
}

/// A load in progress, marked durably on disk.
#[derive(Debug)]
pub struct LoadMarker {
    path: PathBuf,
}

impl LoadMarker {
    /// Marks the replica at `db` as loading; the marker and its directory entry are on disk
    /// when this returns.
    pub fn create(db: &Path) -> io::Result<LoadMarker> {
        let path = marker_path(db);
        File::create(&path)?.sync_all()?;
        sync_dir(&path)?;
        Ok(LoadMarker { path })
    }

    /// The load is complete and durable: removes the marker, durably.
    pub fn remove(self) -> io::Result<()> {
        std::fs::remove_file(&self.path)?;
        sync_dir(&self.path)
    }
}

/// Removes the replica at `db` if its load never finished (its marker is there): the database
/// and its WAL and shared-memory files first, the marker last, so that an interruption here
/// leaves the marker to try again. Returns whether there was one.
pub fn discard_unfinished(db: &Path) -> io::Result<bool> {
    let marker = marker_path(db);
    if !marker.try_exists()? {
        return Ok(false);
    }
    for suffix in ["", "-wal", "-shm"] {
        let mut name = db.as_os_str().to_owned();
        name.push(suffix);
        match std::fs::remove_file(PathBuf::from(name)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    sync_dir(db)?;
    std::fs::remove_file(&marker)?;
    sync_dir(&marker)?;
    Ok(true)
}

/// Makes the directory entries of `path`'s directory durable.
fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_replica_is_removed_marker_last_and_an_unmarked_one_is_kept() {
        let dir = std::env::temp_dir().join(format!("hw-marker-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let db = dir.join("replica.db");
        std::fs::write(&db, b"not a database").unwrap();
        std::fs::write(dir.join("replica.db-wal"), b"").unwrap();
        assert!(!discard_unfinished(&db).unwrap());
        assert!(db.exists());

        let marker = LoadMarker::create(&db).unwrap();
        assert!(marker_path(&db).exists());
        assert!(discard_unfinished(&db).unwrap());
        assert!(!db.exists() && !dir.join("replica.db-wal").exists());
        assert!(!marker_path(&db).exists());
        // Already gone: removing it again is an error, not a silent success.
        assert!(marker.remove().is_err());

        std::fs::write(&db, b"done").unwrap();
        LoadMarker::create(&db).unwrap().remove().unwrap();
        assert!(!discard_unfinished(&db).unwrap());
        assert!(db.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
