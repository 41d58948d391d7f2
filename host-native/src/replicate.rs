//! `highwater replicate`: keeps `<data>/replica.db` equal to the upstream publications.
//!
//! An empty (or never completed) replica is synced from a fresh slot's exported snapshot; a
//! synced one resumes from its stored position. Upstream transactions are applied in SQLite
//! transactions — several queued ones in one, as the engine's group-commit rule
//! (`upstream::GroupCommit`) says, a small one held whole until its commit, a large one in a
//! savepoint — and acknowledged upstream only once committed, so a
//! crash at any point loses nothing and applies nothing twice. An open group is made durable
//! when it is full, when its deadline passes with nothing more to apply, and at a stop (a
//! backfill starts only with everything durable, by the session's rule). Ctrl-C / SIGTERM stop
//! at the next message: a transaction in progress is discarded (Postgres sends it again on the
//! next start).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use highwater_engine::change_stream::{Change, DownstreamMessage};
use highwater_engine::pgoutput::{Relation, TextRowChange};
use highwater_engine::upstream::{GroupCommit, GroupDecision, GroupLimits, Input, UpstreamSession};
use highwater_engine::watermark::{Lsn, Watermark};
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::data_lock::DataDirLock;
use crate::pause_point::{self, Point};
use crate::upstream::{
    backfill_item, backfill_retry_in, feed, reconcile_relation, retry_backfills, Backfills,
    Catalog, EffectHost,
};

use crate::replica::{outgrows_hold, Applied, Replica, ReplicaWriter, TxnItem};
use crate::replication::bootstrap::{BootstrapError, Upstream};
use crate::replication::initial_sync::{SyncError, SyncOptions, DEFAULT_SYNC_WORKERS};
use crate::replication::setup::DEFAULT_APP_ID;
use crate::replication::{WalEvent, WalStream};

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

/// Runs the command until Ctrl-C or SIGTERM.
pub fn run(args: ReplicateArgs) -> anyhow::Result<()> {
    crate::runtime::init_tracing("info");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (stop_tx, stop) = watch::channel(false);
    runtime.spawn(async move {
        crate::runtime::wait_for_signal().await;
        tracing::info!("stopping: finishing the current message");
        let _ = stop_tx.send(true);
    });
    let handle = runtime.handle().clone();
    runtime.block_on(async move {
        tokio::task::spawn_blocking(move || replicate(&handle, &args, stop))
            .await
            .context("the replicator thread panicked")?
    })
}

/// Replicates until `stop` turns true. Blocking: run it on a blocking thread of `handle`'s
/// runtime.
pub fn replicate(
    handle: &Handle,
    args: &ReplicateArgs,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    // Held until this returns: a second process on the same directory is refused at start.
    let _data_lock = DataDirLock::acquire(&args.data)?;
    // Postgres going away half-way through startup (a restart, a cut connection) starts it
    // again, as `serve` does; any other error is returned at once.
    let started = crate::startup_retry::retrying(
        &stop,
        || start(handle, args, &stop),
        |error: &anyhow::Error| {
            let replication = error
                .downcast_ref::<BootstrapError>()
                .and_then(crate::startup_retry::bootstrap_replication_error)
                .or_else(|| error.downcast_ref::<crate::replication::ReplicationError>());
            crate::startup_retry::connection_lost(error.as_ref(), replication)
        },
        |error: &anyhow::Error| crate::startup_retry::connection_refused(error.as_ref()),
    )?;
    let Some(Some((upstream, replica))) = started else {
        return Ok(());
    };

    let mut writer = ReplicaWriter::new(replica);
    let mut catalog = Catalog::new(upstream.params.upstream());
    // Backfills pending since before a crash or a stop (recorded with the schema change that
    // asked) start when the session first says one may.
    let mut backfills = Backfills::new(upstream.params.upstream());
    let state = writer
        .replica()
        .state()
        .context("the replica has no replication state after its initial sync")?
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
    let result = stream_changes(
        handle,
        &mut catalog,
        &mut backfills,
        &mut writer,
        &mut stream,
        &publications,
        &args.app_id,
        &mut stop,
    );
    if writer.in_transaction() {
        // Not committed, so not acknowledged: Postgres sends it again next time.
        let _ = writer.apply(&DownstreamMessage::Rollback(Default::default()));
    }
    if result.is_err() {
        // Nothing of an open group was acknowledged: Postgres sends it again next time.
        let _ = writer.discard_group();
    }
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
) -> anyhow::Result<Option<(Upstream, Replica)>> {
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

/// What the replicator's loop carries effects out with: the upstream session's effect loop
/// without a hub, storing into the replica directly.
struct Replicator<'a> {
    session: UpstreamSession,
    handle: &'a Handle,
    catalog: &'a mut Catalog,
    backfills: &'a mut Backfills,
    writer: &'a mut ReplicaWriter,
    stream: &'a mut WalStream,
    publications: &'a [String],
    committed: u64,
    /// The open group of applied, not yet durable commits.
    group: GroupCommit<Watermark>,
    /// Bytes of replication data since the last commit applied.
    txn_bytes: usize,
    /// The transaction being applied, held whole until its commit while it is small (then
    /// applied with no savepoint of its own); `None` between transactions and once one
    /// outgrew the hold and streams into SQLite.
    held: Option<Vec<Held>>,
    epoch: Instant,
}

/// A message of a held transaction (row changes are text rows; the boxed messages are
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

/// Events taken from the replication socket's queue in one wake-up.
const BATCH_EVENTS: usize = 256;

impl Replicator<'_> {
    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Commits the open group durably (between transactions only); returns its last commit,
    /// for the session.
    fn make_durable(&mut self) -> anyhow::Result<Option<Watermark>> {
        if !self.group.is_open() {
            return Ok(None);
        }
        let transactions = self.group.transactions();
        pause_point::reach(Point::BeforeGroupCommit, transactions);
        self.writer.commit_group()?;
        pause_point::reach(Point::AfterGroupCommit, transactions);
        Ok(self.group.durable().map(|durable| {
            self.committed += u64::try_from(durable.transactions).unwrap_or(u64::MAX);
            durable.last
        }))
    }

    /// At a stop: what is applied between transactions is whole, so it is made durable (and
    /// acknowledged); a transaction half applied is rolled back by the caller, and one held
    /// never reached SQLite.
    fn stop(&mut self) -> anyhow::Result<()> {
        self.held = None;
        if !self.writer.in_transaction() {
            self.flush()?;
        }
        Ok(())
    }

    /// A transaction is being applied: held, or streaming into SQLite.
    fn in_transaction(&self) -> bool {
        self.held.is_some() || self.writer.in_transaction()
    }

    /// Adds `item` to the held transaction, spilling it once it outgrows the hold (the bytes
    /// are the replication data since the last commit).
    fn hold(&mut self, item: Held) -> anyhow::Result<()> {
        if let Some(held) = self.held.as_mut() {
            held.push(item);
            if outgrows_hold(held.len(), self.txn_bytes) {
                self.spill()?;
            }
        }
        Ok(())
    }

    /// The held transaction goes into SQLite as it came (its `begin` opening a savepoint
    /// inside a group), and the rest streams after it.
    fn spill(&mut self) -> anyhow::Result<()> {
        for item in self.held.take().unwrap_or_default() {
            match item {
                Held::Message(message) => self.writer.apply(&message)?,
                Held::Text(change) => self.writer.apply_text(&change)?,
            };
        }
        Ok(())
    }

    /// What a commit applied means for the group: the commits it made durable, if any.
    fn committed(&mut self, applied: Applied) -> anyhow::Result<Vec<Watermark>> {
        Ok(match applied {
            Applied::Grouped { watermark, .. } => {
                let bytes = std::mem::take(&mut self.txn_bytes);
                let now = self.now_us();
                if self.group.applied(watermark, bytes, now) == GroupDecision::Flush {
                    self.make_durable()?.into_iter().collect()
                } else {
                    Vec::new()
                }
            }
            Applied::Committed { watermark, .. } => {
                self.committed += 1;
                vec![watermark]
            }
            Applied::Pending | Applied::RolledBack => Vec::new(),
        })
    }

    /// Makes the open group durable and reports it to the session (acknowledging it).
    fn flush(&mut self) -> anyhow::Result<()> {
        match self.make_durable()? {
            Some(watermark) => feed(self, Input::Stored { watermark }),
            None => Ok(()),
        }
    }

    /// When an open group with no transaction half applied must be flushed if nothing more
    /// arrives; flushes it now if that has passed. `None`: wait for input without a deadline.
    fn flush_deadline(&mut self) -> anyhow::Result<Option<Duration>> {
        let now = self.now_us();
        let in_transaction = self.in_transaction();
        if self.group.flush_due(now, in_transaction) {
            self.flush()?;
        }
        Ok(match self.group.deadline_us() {
            Some(deadline) if !self.in_transaction() => {
                Some(Duration::from_micros(deadline.saturating_sub(now)))
            }
            _ => None,
        })
    }
}

/// What woke a wait for the replication stream other than input.
enum Woke {
    /// The open group's deadline passed.
    Flush,
    /// A failed backfill's retry delay passed.
    RetryBackfills,
}

// The replicator's whole state, passed down from `replicate`.
#[allow(clippy::too_many_arguments)]
fn stream_changes(
    handle: &Handle,
    catalog: &mut Catalog,
    backfills: &mut Backfills,
    writer: &mut ReplicaWriter,
    stream: &mut WalStream,
    publications: &[String],
    app_id: &str,
    stop: &mut watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let state = writer
        .replica()
        .state()
        .context("the replica has no replication state")?
        .clone();
    let mut replicator = Replicator {
        session: crate::upstream::session(app_id, state.watermark, state.lsn),
        handle,
        catalog,
        backfills,
        writer,
        stream,
        publications,
        committed: 0,
        group: GroupCommit::new(GroupLimits::default()),
        txn_bytes: 0,
        held: None,
        epoch: Instant::now(),
    };
    replicator.writer.set_group_commit(true);
    // The replica takes row values as Postgres wrote them: no JSON row per change.
    replicator.session.keep_row_text();
    let mut last_report = Instant::now();
    let mut batch = Vec::with_capacity(BATCH_EVENTS);
    let mut queued = VecDeque::new();
    loop {
        if *stop.borrow() {
            return replicator.stop();
        }
        // The session says what it takes: a running backfill is the only source until its
        // commit.
        if replicator.session.backfill_running() {
            // About to wait for input: an open group waits no longer than its deadline.
            let flush_in = replicator.flush_deadline()?;
            let backfills = &mut *replicator.backfills;
            let item = handle.block_on(async {
                tokio::select! {
                    _ = stop.changed() => None,
                    item = backfills.next() => Some(Some(item)),
                    _ = tokio::time::sleep(flush_in.unwrap_or_default()),
                        if flush_in.is_some() => Some(None),
                }
            });
            match item {
                None => return replicator.stop(),
                Some(None) => replicator.flush()?,
                Some(Some(item)) => backfill_item(&mut replicator, item)?,
            }
            continue;
        }
        if queued.is_empty() {
            // Whatever is queued is taken in one wake-up.
            replicator.stream.try_recv_many(&mut batch, BATCH_EVENTS);
            queued.extend(batch.drain(..));
        }
        if queued.is_empty() {
            // About to wait for input: an open group waits no longer than its deadline.
            let flush_in = replicator.flush_deadline()?;
            if replicator.session.backfill_running() {
                // That flush made a backfill's predecessors durable and the session started
                // it: from now on the backfill is the only source, until its commit.
                continue;
            }
            // A failed backfill is tried again after its delay even if no commit comes.
            let retry_in = backfill_retry_in(Some(&*replicator.backfills));
            let stream = &mut *replicator.stream;
            let taken = handle.block_on(async {
                tokio::select! {
                    _ = stop.changed() => None,
                    taken = stream.recv_many(&mut batch, BATCH_EVENTS) => Some(Ok(taken)),
                    _ = tokio::time::sleep(flush_in.unwrap_or_default()),
                        if flush_in.is_some() => Some(Err(Woke::Flush)),
                    _ = tokio::time::sleep(retry_in.unwrap_or_default()),
                        if retry_in.is_some() => Some(Err(Woke::RetryBackfills)),
                }
            });
            match taken {
                None => return replicator.stop(),
                Some(Err(Woke::Flush)) => {
                    replicator.flush()?;
                    continue;
                }
                Some(Err(Woke::RetryBackfills)) => {
                    retry_backfills(&mut replicator)?;
                    continue;
                }
                Some(Ok(0)) => bail!("the replication stream ended"),
                Some(Ok(_)) => queued.extend(batch.drain(..)),
            }
        }
        let Some(event) = queued.pop_front() else {
            continue;
        };
        match event? {
            WalEvent::Started { start, .. } => {
                tracing::debug!(%start, "replication session started");
                feed(&mut replicator, Input::Started)?;
            }
            WalEvent::CopyData(bytes) => {
                replicator.txn_bytes = replicator.txn_bytes.saturating_add(bytes.len());
                feed(&mut replicator, Input::WalData(&bytes))?
            }
        }
        if last_report.elapsed() >= PROGRESS_EVERY {
            if let Some(state) = replicator.writer.replica().state() {
                tracing::info!(
                    transactions = replicator.committed,
                    position = %state.lsn,
                    "replicating"
                );
            }
            last_report = Instant::now();
        }
    }
}

impl EffectHost for Replicator<'_> {
    type Error = anyhow::Error;

    fn session(&mut self) -> &mut UpstreamSession {
        &mut self.session
    }

    fn apply(&mut self, message: DownstreamMessage) -> anyhow::Result<Vec<Watermark>> {
        let message = match message {
            DownstreamMessage::Begin(begin) if !self.in_transaction() => {
                self.backfills.note(&begin);
                // Held until its commit, or until it outgrows the hold.
                self.held = Some(vec![Held::Message(Box::new(DownstreamMessage::Begin(
                    begin,
                )))]);
                return Ok(Vec::new());
            }
            commit @ DownstreamMessage::Commit(_) => match self.held.take() {
                Some(mut held) => {
                    held.push(Held::Message(Box::new(commit)));
                    let applied = self.writer.apply_whole(&held)?;
                    return self.committed(applied);
                }
                None => commit,
            },
            DownstreamMessage::Rollback(rollback) => {
                // A held transaction never reached SQLite.
                if self.held.take().is_some() {
                    return Ok(Vec::new());
                }
                DownstreamMessage::Rollback(rollback)
            }
            // The writer refuses a `begin` inside a transaction.
            begin @ DownstreamMessage::Begin(_) => {
                self.spill()?;
                begin
            }
            other if self.held.is_some() => {
                self.hold(Held::Message(Box::new(other)))?;
                return Ok(Vec::new());
            }
            other => other,
        };
        let applied = self.writer.apply(&message)?;
        self.committed(applied)
    }

    fn apply_text(&mut self, change: TextRowChange) -> anyhow::Result<Vec<Watermark>> {
        // A row change is never a commit: nothing becomes durable here.
        if self.held.is_some() {
            self.hold(Held::Text(change))?;
        } else {
            self.writer.apply_text(&change)?;
        }
        Ok(Vec::new())
    }

    fn settle(&mut self) -> anyhow::Result<Vec<Watermark>> {
        // The replica as of every message, as schema changes are computed against it: a held
        // transaction (one whose DDL came earlier, say) goes into SQLite now. Everything else
        // is applied as it comes.
        if self.held.is_some() {
            self.spill()?;
        }
        Ok(Vec::new())
    }

    fn confirm(&mut self, lsn: Lsn) {
        self.stream.ack(lsn);
    }

    fn ack_frames(&mut self, _ids: Vec<u64>) {
        tracing::warn!("a Postgres source has no frames to acknowledge");
    }

    fn reconnect(&mut self, reason: String, _restore: bool, _acks: Vec<u64>) {
        tracing::warn!(%reason, "a Postgres source has no primary to reconnect to");
    }

    fn replica(&self) -> &Replica {
        self.writer.replica()
    }

    fn publications(&self) -> &[String] {
        self.publications
    }

    fn reconcile(&mut self, relation: &Relation) -> anyhow::Result<Vec<Change>> {
        Ok(reconcile_relation(
            self.handle,
            Some(&mut *self.catalog),
            self.writer.replica(),
            relation,
        )?)
    }

    fn idle(&mut self) {}

    fn backfills(&mut self) -> Option<(&mut Backfills, &Replica)> {
        Some((&mut *self.backfills, self.writer.replica()))
    }

    fn handle(&self) -> &Handle {
        self.handle
    }
}
