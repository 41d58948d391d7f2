//! Getting the replica and its change log ready before serving: upstream and an initial sync
//! when needed come from `replica::bootstrap` (shared with `highwater replicate`); what is
//! serve's own is the change log, whose loss or reset also means a resync.

use tokio::runtime::Handle;
use tokio::sync::watch;

use super::{ServeArgs, ServeError};
use crate::change_log::{self, ChangeLogConfig, ChangeLogError, ChangeLogStatus};
use crate::replica::{Replica, ReplicaError, ReplicaWriter};
use crate::replication::bootstrap::Upstream;
use crate::replication::initial_sync::SyncError;
use crate::replication::{ReplicationError, StreamConfig};
use crate::startup_retry;

/// A replica ready to stream into.
pub(crate) struct Prepared {
    pub writer: ReplicaWriter,
    pub log: ChangeLogStatus,
    pub stream: StreamConfig,
    pub publications: Vec<String>,
    /// Where the replica's pending backfills are read.
    pub(crate) backfill_from: crate::replication::PgConfig,
}

/// [`prepare`], started again when Postgres went away half-way (`startup_retry`'s rule). `None`
/// when `stop` turned true meanwhile. Blocking: run on a blocking thread of `handle`'s runtime.
pub(crate) fn prepare_retrying(
    handle: &Handle,
    args: &ServeArgs,
    writes: WriteSetup,
    stop: &watch::Receiver<bool>,
) -> Result<Option<Prepared>, ServeError> {
    startup_retry::retrying(
        stop,
        || prepare(handle, args, writes),
        |error| startup_retry::connection_lost(error, replication_error(error)),
        |error| startup_retry::connection_refused(error),
    )
}

/// The replication error inside `error`, if any. (Wrapped `transparent`ly, so the source
/// chain skips it.)
fn replication_error(error: &ServeError) -> Option<&ReplicationError> {
    match error {
        ServeError::Replication(r) => Some(r),
        ServeError::Sync(SyncError::Connect(r)) => Some(r),
        ServeError::Bootstrap(bootstrap) => startup_retry::bootstrap_replication_error(bootstrap),
        _ => None,
    }
}

/// Whether `serve` installs the write functions (schema `highwater`) upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteSetup {
    /// No scope sync, or a relay.
    None,
    /// The rules allow writes: serve applies them, so the functions must be there.
    Required,
    /// Scope sync without write rules: installed for apps whose backend confirms its own
    /// writes, and a failure (no CREATE on the database, say) is a warning.
    Tried,
}

/// Blocking: run on a blocking thread of `handle`'s runtime. The write functions are
/// installed upstream as `writes` says (before an initial sync, which then copies their
/// tables).
pub(crate) fn prepare(
    handle: &Handle,
    args: &ServeArgs,
    writes: WriteSetup,
) -> Result<Prepared, ServeError> {
    let upstream = Upstream::prepare(handle, &args.upstream, &args.app_id, &args.publications)?;
    match writes {
        WriteSetup::None => {}
        WriteSetup::Required => {
            handle.block_on(super::scope_sync::writes::install(
                &upstream.params.upstream(),
            ))?;
        }
        WriteSetup::Tried => {
            if let Err(error) = handle.block_on(super::scope_sync::writes::install(
                &upstream.params.upstream(),
            )) {
                tracing::warn!(
                    %error,
                    "highwater.confirm is not installed upstream: writes an app's backend applies cannot be confirmed (the rules allow no writes through serve, so it goes on)"
                );
            }
        }
    }
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
            let options = crate::replication::initial_sync::SyncOptions {
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
