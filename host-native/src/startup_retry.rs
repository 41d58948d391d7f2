//! Starting again when Postgres went away half-way through startup (a restart, a cut
//! connection), shared by `serve` and `replicate`: every startup step is safe to repeat, as a
//! restart of the process would be. A first attempt that cannot reach Postgres at all, a
//! refused login or any other error is returned at once, so a wrong URL still fails fast with
//! its own message.

use std::error::Error as StdError;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::replication::bootstrap::BootstrapError;
use crate::replication::initial_sync::SyncError;
use crate::replication::ReplicationError;

/// How long startup keeps retrying after its Postgres connection was lost.
pub(crate) const LOST_CONNECTION_RETRY_FOR: Duration = Duration::from_secs(60);

/// Runs `attempt` until it succeeds, fails for a reason other than a lost Postgres connection,
/// or has been failing for [`LOST_CONNECTION_RETRY_FOR`]. `lost` says whether an error is a
/// lost connection; once retrying, a refused connection (Postgres' port while it restarts)
/// counts too (`refused`). `None` when `stop` turned true meanwhile. Blocking.
pub(crate) fn retrying<T, E: std::fmt::Display>(
    stop: &watch::Receiver<bool>,
    mut attempt: impl FnMut() -> Result<T, E>,
    lost: impl Fn(&E) -> bool,
    refused: impl Fn(&E) -> bool,
) -> Result<Option<T>, E> {
    let mut backoff = crate::runtime::backoff(Duration::from_millis(500), Duration::from_secs(30));
    let mut retrying_since: Option<Instant> = None;
    loop {
        let error = match attempt() {
            Ok(done) => return Ok(Some(done)),
            Err(error) => error,
        };
        let transient = match retrying_since {
            None => lost(&error),
            Some(_) => lost(&error) || refused(&error),
        };
        let since = *retrying_since.get_or_insert_with(Instant::now);
        if !transient || since.elapsed() >= LOST_CONNECTION_RETRY_FOR {
            return Err(error);
        }
        let delay = Duration::from_millis(backoff.next_delay_ms(100));
        tracing::warn!(%error, retry_in_ms = delay.as_millis() as u64, "lost Postgres while starting; starting again");
        let until = Instant::now() + delay;
        while Instant::now() < until {
            if *stop.borrow() {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(50).min(until - Instant::now()));
        }
    }
}

/// The errors of `error`'s chain, itself first.
fn chain<'a>(
    error: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(error), |&e| e.source())
}

/// The replication error inside a bootstrap error, if any (wrapped `transparent`ly, so the
/// source chain skips it).
pub(crate) fn bootstrap_replication_error(error: &BootstrapError) -> Option<&ReplicationError> {
    match error {
        BootstrapError::Replication(r) => Some(r),
        BootstrapError::Sync(SyncError::Connect(r)) => Some(r),
        _ => None,
    }
}

/// Whether `error` (or `replication`, the replication error it wraps) comes from a Postgres
/// connection that was open and then went away.
pub(crate) fn connection_lost(
    error: &(dyn StdError + 'static),
    replication: Option<&ReplicationError>,
) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    // 57P01–57P03: the server is shutting down, crashed, or not yet accepting connections.
    let restarting = |code: &str| code.starts_with("57P");
    let replication = replication.is_some_and(|r| match r {
        ReplicationError::Closed => true,
        ReplicationError::Server(server) => restarting(&server.code),
        _ => false,
    });
    replication
        || chain(error).any(|e| {
            e.downcast_ref::<tokio_postgres::Error>().is_some_and(|pg| {
                pg.is_closed() || pg.code().is_some_and(|code| restarting(code.code()))
            }) || e.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
                )
            })
        })
}

/// Whether `error` comes from a connection Postgres's port refused.
pub(crate) fn connection_refused(error: &(dyn StdError + 'static)) -> bool {
    chain(error).any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}
