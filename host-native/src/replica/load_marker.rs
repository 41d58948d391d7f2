//! The marker of an initial load in progress: `<replica>.loading`, made durable before the load
//! writes its first row and removed once the loaded rows and the state that says they are there
//! are durable.
//!
//! The load writes without a journal and without fsyncs (that is most of its speed), so a crash
//! or a power loss in the middle of it can leave the database file in any state, one SQLite
//! cannot open included. A replica found next to its marker is therefore removed unopened, and
//! the next start syncs again from nothing. The loading process holds a lock on its marker
//! (released by the kernel however the process ends), so a second process opening the same
//! replica during the load is refused instead of removing it under the first.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// The marker of the replica at `db`.
pub fn marker_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push(".loading");
    PathBuf::from(name)
}

/// A load in progress, marked durably on disk, its marker locked while this lives.
#[derive(Debug)]
pub(crate) struct LoadMarker {
    path: PathBuf,
    /// The open marker, holding its lock.
    file: File,
}

impl LoadMarker {
    /// Marks the replica at `db` as loading; the marker and its directory entry are on disk
    /// when this returns. Fails if another load holds the marker.
    pub(crate) fn create(db: &Path) -> io::Result<LoadMarker> {
        let path = marker_path(db);
        let file = File::create(&path)?;
        lock(&file)?;
        file.sync_all()?;
        sync_dir(&path)?;
        Ok(LoadMarker { path, file })
    }

    /// The load is complete and durable: removes the marker, durably.
    pub(crate) fn remove(self) -> io::Result<()> {
        std::fs::remove_file(&self.path)?;
        sync_dir(&self.path)?;
        drop(self.file);
        Ok(())
    }
}

/// Takes the marker's lock, or says that a load in another process holds it.
fn lock(marker: &File) -> io::Result<()> {
    marker.try_lock().map_err(|e| match e {
        std::fs::TryLockError::WouldBlock => io::Error::new(
            io::ErrorKind::WouldBlock,
            "an initial sync is loading this replica right now (its marker is locked)",
        ),
        std::fs::TryLockError::Error(e) => e,
    })
}

/// Removes the replica at `db` if its load never finished (its marker is there): the database
/// and its WAL and shared-memory files first, the marker last, so that an interruption here
/// leaves the marker to try again. Returns whether there was one.
pub(crate) fn discard_unfinished(db: &Path) -> io::Result<bool> {
    let marker = marker_path(db);
    if !marker.try_exists()? {
        return Ok(false);
    }
    // Held until the marker is gone: a load that is still running is not ours to remove.
    let held = File::open(&marker)?;
    lock(&held)?;
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
        // While the load holds its marker, nobody removes the replica under it.
        let refused = discard_unfinished(&db).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::WouldBlock, "{refused}");
        assert!(db.exists() && marker_path(&db).exists());
        // The loading process ends without removing its marker (a crash): the lock goes.
        let LoadMarker { file, .. } = marker;
        drop(file);
        assert!(discard_unfinished(&db).unwrap());
        assert!(!db.exists() && !dir.join("replica.db-wal").exists());
        assert!(!marker_path(&db).exists());

        std::fs::write(&db, b"done").unwrap();
        LoadMarker::create(&db).unwrap().remove().unwrap();
        assert!(!discard_unfinished(&db).unwrap());
        assert!(db.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
