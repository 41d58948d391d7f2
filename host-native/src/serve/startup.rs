//! Getting the replica and its change log ready before serving: upstream and an initial sync
//! when needed come from `replica::bootstrap` (shared with `highwater replicate`); what is
//! serve's own is the change log, whose loss or reset also means a resync.

use std::error::Error as StdError;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::watch;

use super::{ServeArgs, ServeError};
use crate::change_log::{self, ChangeLogConfig, ChangeLogError, ChangeLogStatus};
use crate::replica::bootstrap::Upstream;
use crate::replica::initial_sync::SyncError;
use crate::replica::{Replica, ReplicaError, ReplicaWriter};
use crate::replication::{ReplicationError, StreamConfig};

/// A replica ready to stream into.
pub(crate) struct Prepared {
    pub writer: ReplicaWriter,
    pub log: ChangeLogStatus,
    pub stream: StreamConfig,
    pub publications: Vec<String>,
    /// Where the replica's pending backfills are read.
    pub backfill_from: crate::replication::PgConfig,
}

/// How long startup keeps retrying after its Postgres connection was lost.
const LOST_CONNECTION_RETRY_FOR: Duration = Duration::from_secs(60);

/// [`prepare`], started again when Postgres went away half-way (a restart, a cut connection):
/// every step of it is safe to repeat, as a restart of the process would. A first attempt that
/// cannot reach Postgres at all, a refused login or any other error is returned at once, so a
/// wrong URL still fails fast with its own message. `None` when `stop` turned true meanwhile.
/// Blocking: run on a blocking thread of `handle`'s runtime.
pub(crate) fn prepare_retrying(
    handle: &Handle,
    args: &ServeArgs,
    stop: &watch::Receiver<bool>,
) -> Result<Option<Prepared>, ServeError> {
    let mut backoff = crate::runtime::backoff(Duration::from_millis(500), Duration::from_secs(30));
    let mut retrying_since: Option<Instant> = None;
    loop {
        let error = match prepare(handle, args) {
            Ok(prepared) => return Ok(Some(prepared)),
            Err(error) => error,
        };
        let transient = match retrying_since {
            None => connection_lost(&error),
            // While Postgres restarts, its port refuses connections for a moment.
            Some(_) => connection_lost(&error) || connection_refused(&error),
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

/// Whether `error` comes from a Postgres connection that was open and then went away.
fn connection_lost(error: &ServeError) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    // 57P01–57P03: the server is shutting down, crashed, or not yet accepting connections.
    let restarting = |code: &str| code.starts_with("57P");
    let replication = replication_error(error).is_some_and(|r| match r {
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

/// The replication error inside `error`, if any. (Wrapped `transparent`ly, so the source
/// chain skips it.)
fn replication_error(error: &ServeError) -> Option<&ReplicationError> {
    use crate::replica::bootstrap::BootstrapError;
    match error {
        ServeError::Replication(r) | ServeError::Bootstrap(BootstrapError::Replication(r)) => {
            Some(r)
        }
        ServeError::Sync(SyncError::Connect(r))
        | ServeError::Bootstrap(BootstrapError::Sync(SyncError::Connect(r))) => Some(r),
        _ => None,
    }
}

/// Whether `error` comes from a connection Postgres's port refused.
fn connection_refused(error: &ServeError) -> bool {
    chain(error).any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

/// Blocking: run on a blocking thread of `handle`'s runtime.
pub(crate) fn prepare(handle: &Handle, args: &ServeArgs) -> Result<Prepared, ServeError> {
    let upstream = Upstream::prepare(handle, &args.upstream, &args.app_id, &args.publications)?;
    let mut replica = Replica::open_in_dir(&args.data)?;
    upstream.check_slot(handle, &replica, &args.data, args.auto_reset)?;
    let mut log = None;
    match upstream.resync_reason(handle, &replica)? {
        Some(reason) => tracing::warn!(%reason, "resyncing"),
        None => match ensure_log(&replica, &upstream.publications) {
            Ok(status) => log = Some(status),
            Err(ChangeLogError::ResetRequired { reason }) => {
                tracing::warn!(%reason, "resyncing");
            }
            Err(error) => return Err(error.into()),
        },
    }
    let log = match log {
        Some(log) => log,
        None => {
            let options = crate::replica::initial_sync::SyncOptions {
                workers: args.sync_workers,
                ..Default::default()
            };
            replica = upstream
                .resync(handle, replica, &args.data, &options, &|| false)?
                .0;
            ensure_log(&replica, &upstream.publications)?
        }
    };
    let writer = ReplicaWriter::new(replica);
    let state = writer
        .replica()
        .state()
        .ok_or(ReplicaError::NotInitialized)?
        .clone();
    let pending = writer.pending_backfills();
    if !pending.is_empty() {
        // Recorded with the schema change that asked for them; the ingest thread runs them.
        tracing::info!(tables = pending.len(), "backfills pending");
    }
    tracing::info!(
        slot = %state.slot,
        replica_version = %log.replica_version,
        watermark = %log.last_watermark,
        min_watermark = %log.min_watermark,
        "replica and change log ready"
    );
    Ok(Prepared {
        writer,
        log,
        stream: upstream.stream_config(&state),
        publications: upstream.publications.clone(),
        backfill_from: upstream.params.upstream(),
    })
}

/// The change log of a synced replica, reseeded if the replica is fresh.
fn ensure_log(
    replica: &Replica,
    publications: &[String],
) -> Result<ChangeLogStatus, ChangeLogError> {
    let Some(state) = replica.state() else {
        return Err(ChangeLogError::ResetRequired {
            reason: "the replica has not been synced".to_owned(),
        });
    };
    let config = ChangeLogConfig {
        replica_version: state.replica_version.clone(),
        publications: publications.to_vec(),
    };
    change_log::ensure(replica.connection(), &config, &state.watermark)
}
