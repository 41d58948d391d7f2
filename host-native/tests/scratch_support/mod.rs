//! Fixtures every Postgres-backed test shares: a private server and a scratch data directory.
//! `replica_support` and `serve_support` re-export them.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use highwater_host::private_pg::{PgOptions, PrivatePg};

pub async fn start_pg() -> PrivatePg {
    PrivatePg::start(PgOptions::default())
        .await
        .expect("start a private Postgres")
}

/// A fresh data directory under the temp dir, removed on drop.
pub struct DataDir(pub PathBuf);

impl DataDir {
    pub fn new(name: &str) -> DataDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "highwater-test-{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create data dir");
        DataDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
