//! The replicator behind `highwater replicate` (`crate::commands::replicate`): keeps `<data>/replica.db` equal to the upstream publications.
//!
//! An empty (or never completed) replica is synced from a fresh slot's exported snapshot; a
//! synced one resumes from its stored position. From there the ingest loop (`crate::ingest`)
//! streams changes into the replica alone ([`ReplicaOnly`]), reading the replication stream
//! itself ([`ReplicationStream`]): upstream transactions are applied in SQLite transactions —
//! several queued ones in one (group commit), a small one held whole until its commit, a large
//! one in a savepoint — with commits that sync themselves (`synchronous = FULL`), and
//! acknowledged upstream only once committed, so a crash at any point loses nothing and applies
//! nothing twice. Row values are bound from the pgoutput text, with no JSON row in between (the
//! session keeps row text). Ctrl-C / SIGTERM stop at the next message, as the engine's stop plan
//! says: a transaction in progress is discarded (Postgres sends it again on the next start), the
//! group's whole transactions are made durable and confirmed.

use std::convert::Infallible;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use highwater_engine::change_stream::DownstreamMessage;
use highwater_engine::pgoutput::TextRowChange;
use highwater_engine::upstream::{DurableGroup, GroupLimits, SessionError};
use highwater_engine::watermark::{Lsn, Watermark};
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::data_lock::{DataDirLock, DataLockError};
use crate::ingest::{
    GroupStore, Ingest, Invariant, Setup, Source, StoreWake, Storing, UpstreamEvent,
};
use crate::replica::{Applied, Replica, ReplicaError, ReplicaWriter, TxnItem};
use crate::replication::bootstrap::{BootstrapError, Upstream};
use crate::replication::initial_sync::{SyncError, SyncOptions, DEFAULT_SYNC_WORKERS};
use crate::replication::setup::DEFAULT_APP_ID;
use crate::replication::{ReplicationError, WalEvent, WalStream};
use crate::upstream::{Backfills, Catalog, EffectError};

/// Command-line arguments of `highwater replicate`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplicateArgs {
    /// Upstream Postgres URL (`postgres://user[:password]@host:port/db`); the user needs the
    /// REPLICATION attribute, and a superuser to follow schema changes (event triggers).
    #[arg(long)]
    pub upstream: String,
    /// Directory of the replica (`<data>/replica.db`).
    #[arg(long)]
    pub data: PathBuf,
    /// Names the slot (`<app>_slot`), the default publication (`<app>_pub`) and the DDL trigger.
    #[arg(long, default_value = DEFAULT_APP_ID)]
    pub app_id: String,
    /// Publications to replicate; by default `<app>_pub`, created FOR ALL TABLES if missing.
    #[arg(long = "publication")]
    pub publications: Vec<String>,
    /// When the replication slot is missing or invalidated, discard the replica and sync again
    /// instead of stopping with an error.
    #[arg(long)]
    pub auto_reset: bool,
    /// COPY readers of an initial sync, each on its own upstream connection in the slot's
    /// snapshot: tables are copied in parallel, and a table of 128 MiB or more is split into
    /// a page range per reader (Postgres 14+).
    #[arg(long, default_value_t = DEFAULT_SYNC_WORKERS)]
    pub sync_workers: usize,
}

/// Why `replicate` stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ReplicateError {
    #[error(transparent)]
    DataLock(#[from] DataLockError),
    #[error(transparent)]
    Bootstrap(Box<BootstrapError>),
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error("the replication stream failed: {0}")]
    Replication(#[from] ReplicationError),
    #[error("the replication stream ended")]
    StreamEnded,
    #[error("the change source cannot continue: {0}")]
    Session(#[from] SessionError),
    #[error(transparent)]
    Effect(#[from] EffectError),
    #[error("the replica has no replication state after its initial sync")]
    NoState,
    #[error("expected {expected}, found {found}")]
    Invariant { expected: String, found: String },
}

impl From<BootstrapError> for ReplicateError {
    fn from(error: BootstrapError) -> Self {
        ReplicateError::Bootstrap(Box::new(error))
    }
}

impl From<Invariant> for ReplicateError {
    fn from(Invariant { expected, found }: Invariant) -> Self {
        ReplicateError::Invariant { expected, found }
    }
}

/// Replicates until `stop` turns true. Blocking: run it on a blocking thread of `handle`'s
/// runtime.
pub fn replicate(
    handle: &Handle,
    args: &ReplicateArgs,
    stop: watch::Receiver<bool>,
) -> Result<(), ReplicateError> {
    // Held until this returns: a second process on the same directory is refused at start.
    let _data_lock = DataDirLock::acquire(&args.data)?;
    // Postgres going away half-way through startup (a restart, a cut connection) starts it
    // again, as `serve` does; any other error is returned at once.
    let started = crate::startup_retry::retrying(
        &stop,
        || start(handle, args, &stop),
        |error: &BootstrapError| {
            let replication = crate::startup_retry::bootstrap_replication_error(error);
            crate::startup_retry::connection_lost(error, replication)
        },
        |error: &BootstrapError| crate::startup_retry::connection_refused(error),
    )?;
    let Some(Some((upstream, replica))) = started else {
        return Ok(());
    };

    let mut writer = ReplicaWriter::new(replica);
    let catalog = Catalog::new(upstream.params.upstream());
    // Backfills pending since before a crash or a stop (recorded with the schema change that
    // asked) start when the session first says one may.
    let backfills = Backfills::new(upstream.params.upstream());
    let state = writer
        .replica()
        .state()
        .ok_or(ReplicateError::NoState)?
        .clone();
    let config = upstream.stream_config(&state);
    let publications = upstream.publications.clone();
    drop(upstream);
    let mut stream = {
        let _runtime = handle.enter();
        WalStream::spawn(config)
    };
    tracing::info!(
        slot = %state.slot,
        position = %state.lsn,
        watermark = %state.watermark,
        "streaming changes"
    );
    let mut session = crate::upstream::session(&args.app_id, state.watermark, state.lsn);
    // The replica takes row values as Postgres wrote them: no JSON row per change.
    session.keep_row_text();
    writer.set_group_commit(true);
    let setup = Setup {
        session,
        group: GroupLimits::default(),
        publications,
        handle: handle.clone(),
        backfills: Some(backfills),
        catalog: Some(catalog),
    };
    let store = ReplicaOnly {
        writer: &mut writer,
        committed: 0,
        last_report: Instant::now(),
    };
    let result = Ingest::new(setup, store, ReplicationStream(&mut stream)).run(stop);
    // The stream confirms the last acknowledgement (the stop's included) as it ends.
    handle.block_on(stream.shutdown());
    if let Some(state) = writer.replica().state() {
        tracing::info!(position = %state.lsn, watermark = %state.watermark, "replicator stopped");
    }
    result
}

/// Connects upstream, checks the slot and brings the replica up to date with an initial sync
/// if it needs one. `None` when stopped during that sync (the next start syncs again).
fn start(
    handle: &Handle,
    args: &ReplicateArgs,
    stop: &watch::Receiver<bool>,
) -> Result<Option<(Upstream, Replica)>, BootstrapError> {
    let upstream = Upstream::prepare(handle, &args.upstream, &args.app_id, &args.publications)?;
    let mut replica = Replica::open_in_dir(&args.data)?;
    upstream.check_slot(handle, &replica, &args.data, args.auto_reset)?;
    if let Some(reason) = upstream.resync_reason(handle, &replica)? {
        tracing::warn!(%reason, "resyncing");
        let stopped = stop.clone();
        let options = SyncOptions {
            workers: args.sync_workers,
            ..SyncOptions::default()
        };
        replica =
            match upstream.resync(handle, replica, &args.data, &options, &|| *stopped.borrow()) {
                Err(BootstrapError::Sync(SyncError::Stopped)) => {
                    tracing::info!("stopped during the initial sync; the next start syncs again");
                    return Ok(None);
                }
                other => other?.0,
            };
    }
    Ok(Some((upstream, replica)))
}

/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// `replicate`'s group store: the replica alone. Each message is stored as the session hands
/// it on, and the replica's commits sync themselves: a group is durable once committed.
struct ReplicaOnly<'a> {
    writer: &'a mut ReplicaWriter,
    /// Upstream transactions made durable, for the progress line.
    committed: u64,
    last_report: Instant,
}

/// A message of a transaction being stored (row changes are text rows; the boxed messages are
/// mostly its `begin` and `commit`).
enum Held {
    Message(Box<DownstreamMessage>),
    Text(TextRowChange),
}

impl<'a> From<&'a Held> for TxnItem<'a> {
    fn from(held: &'a Held) -> Self {
        match held {
            Held::Message(message) => TxnItem::Message(message),
            Held::Text(change) => TxnItem::Text(change),
        }
    }
}

/// The position of a commit the writer applied into the open group.
fn grouped(applied: Applied) -> Result<Watermark, Invariant> {
    match applied {
        Applied::Grouped { watermark, .. } => Ok(watermark),
        other => Err(Invariant {
            expected: "a commit applied into the open group".to_owned(),
            found: format!("{other:?}"),
        }),
    }
}

impl GroupStore for ReplicaOnly<'_> {
    type Item = Held;
    /// Nothing is queued: every message is stored as it is handed on.
    type Op = Infallible;
    type Error = ReplicateError;

    /// A transaction is measured in bytes of replication data.
    const SIZE_FROM_SOURCE: bool = true;

    fn replica(&self) -> &Replica {
        self.writer.replica()
    }

    fn hand_on(
        &mut self,
        storing: &mut Storing<Self>,
        message: DownstreamMessage,
    ) -> Result<(), ReplicateError> {
        match message {
            begin @ DownstreamMessage::Begin(_) => {
                storing.begin(self, Held::Message(Box::new(begin)), 0)
            }
            commit @ DownstreamMessage::Commit(_) => {
                storing.commit(self, Held::Message(Box::new(commit)), 0)
            }
            DownstreamMessage::Rollback(_) => storing.rollback(self),
            other => storing.item(self, Held::Message(Box::new(other)), 0),
        }
    }

    fn hand_on_text(
        &mut self,
        storing: &mut Storing<Self>,
        change: TextRowChange,
    ) -> Result<(), ReplicateError> {
        storing.item(self, Held::Text(change), 0)
    }

    fn try_next_op(&mut self) -> Option<Infallible> {
        None
    }

    fn execute(
        &mut self,
        _storing: &mut Storing<Self>,
        op: Infallible,
    ) -> Result<(), ReplicateError> {
        match op {}
    }

    fn stores(op: &Infallible) -> bool {
        match *op {}
    }

    async fn wait(&mut self, _sync: bool) -> StoreWake<Infallible, ReplicateError> {
        std::future::pending().await
    }

    fn write(&mut self, item: Held) -> Result<(), ReplicateError> {
        match item {
            Held::Message(message) => self.writer.apply(&message)?,
            Held::Text(change) => self.writer.apply_text(&change)?,
        };
        Ok(())
    }

    fn write_whole(&mut self, items: Vec<Held>) -> Result<Watermark, ReplicateError> {
        Ok(grouped(self.writer.apply_whole(&items)?)?)
    }

    fn write_commit(&mut self, commit: Held) -> Result<Watermark, ReplicateError> {
        let applied = match commit {
            Held::Message(message) => self.writer.apply(&message)?,
            Held::Text(change) => self.writer.apply_text(&change)?,
        };
        Ok(grouped(applied)?)
    }

    fn roll_back(&mut self) -> Result<(), ReplicateError> {
        self.writer
            .apply(&DownstreamMessage::Rollback(Default::default()))?;
        Ok(())
    }

    fn in_transaction(&self) -> bool {
        self.writer.in_transaction()
    }

    fn commit_group(
        &mut self,
        _last: &Watermark,
        _transactions: usize,
    ) -> Result<(), ReplicateError> {
        self.writer.commit_group()?;
        Ok(())
    }

    fn discard_group(&mut self) {
        let _ = self.writer.discard_group();
    }

    fn syncs_apart(&self) -> bool {
        false
    }

    fn start_sync(&mut self, _transactions: usize) {}

    fn sync_running(&self) -> bool {
        false
    }

    fn poll_sync(&mut self) -> Option<Result<(), ReplicateError>> {
        None
    }

    async fn sync_done(&mut self) -> Result<(), ReplicateError> {
        std::future::pending().await
    }

    fn durable(&mut self, group: &DurableGroup<Watermark>) -> Result<(), ReplicateError> {
        self.committed += u64::try_from(group.transactions).unwrap_or(u64::MAX);
        if self.last_report.elapsed() >= PROGRESS_EVERY {
            tracing::info!(
                transactions = self.committed,
                position = %group.last,
                "replicating"
            );
            self.last_report = Instant::now();
        }
        Ok(())
    }
}

/// `replicate`'s source: the replication stream itself, no task between.
struct ReplicationStream<'a>(&'a mut WalStream);

impl Source for ReplicationStream<'_> {
    type Event = Result<WalEvent, ReplicationError>;
    type Error = ReplicateError;

    fn try_take(&mut self, into: &mut Vec<Self::Event>, max: usize) {
        self.0.try_recv_many(into, max);
    }

    async fn take(&mut self, into: &mut Vec<Self::Event>, max: usize) -> usize {
        self.0.recv_many(into, max).await
    }

    fn input(&mut self, event: Self::Event) -> Result<UpstreamEvent, ReplicateError> {
        Ok(match event? {
            WalEvent::Started { start, .. } => {
                tracing::debug!(%start, "replication session started");
                UpstreamEvent::Started
            }
            WalEvent::CopyData(bytes) => UpstreamEvent::Wal(bytes),
        })
    }

    fn ended(&self) -> Result<(), ReplicateError> {
        Err(ReplicateError::StreamEnded)
    }

    fn confirm(&mut self, lsn: Lsn) {
        self.0.ack(lsn);
    }

    fn ack_frames(&mut self, _ids: Vec<u64>) {
        tracing::warn!("a Postgres source has no frames to acknowledge");
    }

    fn reconnect(&mut self, reason: String, _restore: bool, _acks: Vec<u64>) {
        tracing::warn!(%reason, "a Postgres source has no primary to reconnect to");
    }
}
