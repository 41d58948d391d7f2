//! A hook for crash tests: with `HIGHWATER_PAUSE_AT=<point>:<marker file>` in the environment,
//! the thread that reaches the named point (with a group of at least two upstream
//! transactions, see `engine::group_commit`) creates the marker file and waits there for
//! good, so a test can SIGKILL the process at exactly that point. Without the variable,
//! [`reach`] costs one look at a value read once.
//!
//! Points: `before-group-commit` (transactions applied, the SQLite commit not made) and
//! `after-group-commit` (the SQLite commit made, upstream not yet acknowledged; durable for
//! `replicate`, whose commits sync themselves, not yet synced for `serve`). `serve` syncs its
//! WAL apart (`replica::wal_sync`): `before-group-sync` pauses the thread that syncs, before
//! the fsync (the ingest thread goes on), `after-group-sync` the ingest thread once the sync
//! returned, before the group is reported durable and acknowledged.

use std::path::PathBuf;
use std::sync::OnceLock;

/// The environment variable naming the point and the marker file.
pub(crate) const PAUSE_AT_ENV: &str = "HIGHWATER_PAUSE_AT";

/// A point of the group commit the process may be paused at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Point {
    BeforeGroupCommit,
    AfterGroupCommit,
    BeforeGroupSync,
    AfterGroupSync,
}

impl Point {
    fn name(self) -> &'static str {
        match self {
            Point::BeforeGroupCommit => "before-group-commit",
            Point::AfterGroupCommit => "after-group-commit",
            Point::BeforeGroupSync => "before-group-sync",
            Point::AfterGroupSync => "after-group-sync",
        }
    }
}

fn configured() -> Option<&'static (String, PathBuf)> {
    static PAUSE_AT: OnceLock<Option<(String, PathBuf)>> = OnceLock::new();
    PAUSE_AT
        .get_or_init(|| {
            let value = std::env::var(PAUSE_AT_ENV).ok()?;
            let (point, marker) = value.split_once(':')?;
            Some((point.to_owned(), PathBuf::from(marker)))
        })
        .as_ref()
}

/// Pauses for good if the environment asks for `point` and the group holds `transactions`
/// of at least two.
pub(crate) fn reach(point: Point, transactions: usize) {
    let Some((wanted, marker)) = configured() else {
        return;
    };
    if wanted != point.name() || transactions < 2 {
        return;
    }
    tracing::warn!(
        point = point.name(),
        transactions,
        "paused for a crash test"
    );
    if let Err(error) = std::fs::write(marker, point.name()) {
        tracing::error!(%error, "cannot write the pause marker");
    }
    loop {
        std::thread::park();
    }
}
