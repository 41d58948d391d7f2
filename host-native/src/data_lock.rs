//! One process per data directory: `serve`, a relay and `replicate` hold a lock on
//! `<data>/highwater.lock` for as long as they run.
//!
//! Two processes on one directory would both write the replica and the change log, each
//! believing its own position, and acknowledge to Postgres what the other had not stored. The
//! second one is refused at start instead, with the first one's process id. The lock is an
//! advisory `flock` the kernel drops however the holder ends (a crash or `kill -9` included),
//! so a stale lock file never keeps a restart out.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::path::{Path, PathBuf};

/// The lock file's name inside the data directory.
pub(crate) const LOCK_FILE: &str = "highwater.lock";

/// The data directory is in use while this lives.
#[derive(Debug)]
pub struct DataDirLock {
    /// The open lock file, holding its lock.
    _file: File,
}

#[derive(Debug, thiserror::Error)]
pub enum DataLockError {
    #[error(
        "another highwater process{} is using the data directory {path}: stop it first, or give \
         this one a data directory of its own",
        .holder.map(|pid| format!(" (pid {pid})")).unwrap_or_default()
    )]
    InUse { path: String, holder: Option<u32> },
    #[error("cannot lock the data directory {path}: {source}")]
    Io { path: String, source: io::Error },
}

impl DataDirLock {
    /// Creates `data` if needed and takes its lock, or says which process holds it.
    pub fn acquire(data: &Path) -> Result<DataDirLock, DataLockError> {
        let io_error = |source| DataLockError::Io {
            path: data.display().to_string(),
            source,
        };
        std::fs::create_dir_all(data).map_err(io_error)?;
        let path: PathBuf = data.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io_error)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(DataLockError::InUse {
                    path: data.display().to_string(),
                    holder: text.trim().parse().ok(),
                });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io_error(e)),
        }
        // The holder's pid, for the message a second process gets (a hint: not synced).
        file.set_len(0).map_err(io_error)?;
        file.rewind().map_err(io_error)?;
        writeln!(file, "{}", std::process::id()).map_err(io_error)?;
        Ok(DataDirLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid_until_it_lets_go() {
        let dir = std::env::temp_dir().join(format!("highwater-data-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = DataDirLock::acquire(&dir.join("data")).unwrap();
        // A lock is per open file, so a second open in this process is refused like another
        // process would be.
        let refused = DataDirLock::acquire(&dir.join("data")).unwrap_err();
        match &refused {
            DataLockError::InUse { holder, .. } => {
                assert_eq!(*holder, Some(std::process::id()), "{refused}")
            }
            other => panic!("expected InUse, got {other}"),
        }
        assert!(
            refused.to_string().contains("another highwater process"),
            "{refused}"
        );
        drop(first);
        // Released (as the kernel releases it when a process dies): the next one gets it.
        let again = DataDirLock::acquire(&dir.join("data")).unwrap();
        drop(again);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
