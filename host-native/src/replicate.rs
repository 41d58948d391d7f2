//! `highwater replicate`: keeps `<data>/replica.db` equal to the upstream publications.
//!
//! An empty (or never completed) replica is synced from a fresh slot's exported snapshot; a
//! synced one resumes from its stored position. Upstream transactions are applied in SQLite
//! transactions — several queued ones in one, as the engine's group-commit rule
//! (`upstream::GroupCommit`) says, a small one held whole until its commit, a large one in a
//! savepoint — and acknowledged upstream only once committed, so a
//! crash at any point loses nothing and applies nothing twice. An open group is made durable
//! when it is full, when its deadline passes (checked before each input: queued input does not
//! push it back), and at a stop (a backfill starts only with everything durable, by the
//! session's rule). Ctrl-C / SIGTERM stop at the next message, as the engine's
//! `upstream::StopPlan` says: a transaction in progress is discarded (Postgres sends it again on
//! the next start), the group's whole transactions are made durable and confirmed.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use highwater_engine::change_stream::{Change, DownstreamMessage};
use highwater_engine::pgoutput::{Relation, TextRowChange};
use highwater_engine::upstream::{
    Ending, GroupCommit, GroupDecision, GroupLimits, Hold, Input, Listen, TxnCommit, TxnEnd,
    UpstreamSession, Wake,
};
use highwater_engine::watermark::{Lsn, Watermark};
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::data_lock::DataDirLock;
use crate::pause_point::{self, Point};
use crate::upstream::{
    backfill_item, backfill_retry_in, feed, micros_ceil, reconcile_relation, retry_backfills,
    stored_at_stop, Backfills, Catalog, EffectHost,
};

use crate::replica::{Applied, Replica, ReplicaWriter, TxnItem};
use crate::replication::backfill::BackfillItem;
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
    /// The transaction being applied, held whole until its commit while it is small (then
    /// applied with no savepoint of its own), measured in bytes of replication data.
    hold: Hold<Held>,
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

    /// The loop ended (`result`): the engine's stop plan. A transaction in progress is
    /// dropped (held, it never reached SQLite; streaming, it is rolled back): not committed,
    /// so not acknowledged, and Postgres sends it again next time. At a stop the group's whole
    /// transactions are made durable and confirmed; after a failure nothing more is written.
    fn end(&mut self, result: anyhow::Result<()>) -> anyhow::Result<()> {
        let ending = if result.is_ok() {
            Ending::Stopped
        } else {
            Ending::Failed
        };
        // Nothing waits in a queue here: every store is carried out as it is handed on.
        if self.hold.stop() == TxnEnd::RollBack || self.writer.in_transaction() {
            let _ = self
                .writer
                .apply(&DownstreamMessage::Rollback(Default::default()));
        }
        let mut result = result;
        // `Some`: committed (and durable: the replica's commits sync themselves), with the
        // group's last commit if one was open.
        let committed = if ending.plan().commit_group {
            match self.make_durable() {
                Ok(durable) => Some(durable),
                Err(error) => {
                    result = result.and(Err(error));
                    None
                }
            }
        } else {
            None
        };
        match committed {
            Some(Some(watermark)) => {
                if let Err(error) = stored_at_stop(self, watermark) {
                    result = result.and(Err(error));
                }
            }
            Some(None) => {}
            None => {
                // Nothing of the group was acknowledged: Postgres sends it again next time.
                self.group.discarded();
                let _ = self.writer.discard_group();
            }
        }
        result
    }

    /// A transaction is being applied: held, or streaming into SQLite.
    fn in_transaction(&self) -> bool {
        self.hold.in_transaction() || self.writer.in_transaction()
    }

    /// Applies items of the transaction that streams into SQLite (a spill, with its `begin`
    /// opening a savepoint inside a group, or one item after it); the last one's result.
    fn stream(&mut self, items: Vec<Held>) -> anyhow::Result<Applied> {
        let mut applied = Applied::Pending;
        for item in items {
            applied = match item {
                Held::Message(message) => self.writer.apply(&message)?,
                Held::Text(change) => self.writer.apply_text(&change)?,
            };
        }
        Ok(applied)
    }

    /// What a commit applied means for the group: the commits it made durable, if any.
    fn committed(&mut self, applied: Applied, bytes: usize) -> anyhow::Result<Vec<Watermark>> {
        Ok(match applied {
            Applied::Grouped { watermark, .. } => {
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
}

/// What a wait for input woke to.
// Lives for one loop step; boxing the backfill's item would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Woke {
    Stop,
    /// The open group's deadline passed.
    Flush,
    /// A failed backfill's retry delay passed.
    RetryBackfills,
    Backfill(Option<Result<BackfillItem, SyncError>>),
    /// Events of the replication stream (how many).
    Upstream(usize),
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
        hold: Hold::new(),
        epoch: Instant::now(),
    };
    replicator.writer.set_group_commit(true);
    // The replica takes row values as Postgres wrote them: no JSON row per change.
    replicator.session.keep_row_text();
    let result = replicator.run(stop);
    replicator.end(result)
}

impl Replicator<'_> {
    /// Feeds the replication stream and the backfills to the session until `stop`, taking
    /// input in the engine's order (`upstream::Wake`).
    fn run(&mut self, stop: &mut watch::Receiver<bool>) -> anyhow::Result<()> {
        let handle = self.handle;
        let mut last_report = Instant::now();
        let mut batch = Vec::with_capacity(BATCH_EVENTS);
        let mut queued = VecDeque::new();
        loop {
            // What is ready now, without a wait.
            let now = self.now_us();
            let flush_in = self.group.flush_in_us(now, self.in_transaction());
            let backfilling = self.session.backfill_running();
            let retry_in = if backfilling {
                None
            } else {
                backfill_retry_in(Some(&*self.backfills))
            };
            let listen = Listen {
                paused: false,
                backfill_running: backfilling,
                accepts_upstream: self.session.accepts_upstream(),
                sync_running: false,
                flush_in_us: flush_in,
                retry_in_us: retry_in.map(micros_ceil),
            };
            let stream = &mut *self.stream;
            let ready = listen.first(|wake| match wake {
                Wake::Stop => *stop.borrow(),
                Wake::Flush => flush_in == Some(0),
                Wake::RetryBackfills => retry_in.is_some_and(|retry| retry.is_zero()),
                Wake::Upstream => {
                    if queued.is_empty() {
                        // Whatever is queued is taken in one wake-up.
                        stream.try_recv_many(&mut batch, BATCH_EVENTS);
                        queued.extend(batch.drain(..));
                    }
                    !queued.is_empty()
                }
                // Every store is carried out as it is handed on, commits sync themselves, and
                // nothing pauses the stream; a backfill's next item needs a wait.
                Wake::Synced | Wake::Storage | Wake::Resumed | Wake::Backfill => false,
            });
            let woke = match ready {
                Some(Wake::Stop) => Woke::Stop,
                Some(Wake::Flush) => Woke::Flush,
                Some(Wake::RetryBackfills) => Woke::RetryBackfills,
                Some(Wake::Upstream) => Woke::Upstream(queued.len()),
                _ => {
                    // Nothing ready: wait for the first of what the loop waits for, in the
                    // engine's order.
                    let flush_in = Duration::from_micros(flush_in.unwrap_or_default());
                    let retry_in = retry_in.unwrap_or_default();
                    let backfills = &mut *self.backfills;
                    let stream = &mut *self.stream;
                    handle.block_on(async {
                        tokio::select! {
                            biased;
                            _ = stop.wait_for(|s| *s) => Woke::Stop,
                            _ = tokio::time::sleep(flush_in), if listen.waits_for(Wake::Flush) => {
                                Woke::Flush
                            }
                            _ = tokio::time::sleep(retry_in),
                                if listen.waits_for(Wake::RetryBackfills) => Woke::RetryBackfills,
                            item = backfills.next(), if listen.waits_for(Wake::Backfill) => {
                                Woke::Backfill(item)
                            }
                            taken = stream.recv_many(&mut batch, BATCH_EVENTS),
                                if listen.waits_for(Wake::Upstream) => Woke::Upstream(taken),
                        }
                    })
                }
            };
            match woke {
                Woke::Stop => return Ok(()),
                Woke::Flush => self.flush()?,
                Woke::RetryBackfills => retry_backfills(self)?,
                Woke::Backfill(item) => backfill_item(self, item)?,
                Woke::Upstream(0) => bail!("the replication stream ended"),
                Woke::Upstream(_) => {
                    queued.extend(batch.drain(..));
                    let Some(event) = queued.pop_front() else {
                        continue;
                    };
                    match event? {
                        WalEvent::Started { start, .. } => {
                            tracing::debug!(%start, "replication session started");
                            feed(self, Input::Started)?;
                        }
                        WalEvent::CopyData(bytes) => {
                            self.hold.count(bytes.len());
                            feed(self, Input::WalData(&bytes))?
                        }
                    }
                }
            }
            if last_report.elapsed() >= PROGRESS_EVERY {
                if let Some(state) = self.writer.replica().state() {
                    tracing::info!(
                        transactions = self.committed,
                        position = %state.lsn,
                        "replicating"
                    );
                }
                last_report = Instant::now();
            }
        }
    }
}

impl EffectHost for Replicator<'_> {
    type Error = anyhow::Error;

    fn session(&mut self) -> &mut UpstreamSession {
        &mut self.session
    }

    fn apply(&mut self, message: DownstreamMessage) -> anyhow::Result<Vec<Watermark>> {
        match message {
            DownstreamMessage::Begin(begin) => {
                self.backfills.note(&begin);
                // A group never holds its first transaction back past its delay for one yet to
                // come.
                let now = self.now_us();
                let durable = if self.group.flush_in_us(now, self.in_transaction()) == Some(0) {
                    self.make_durable()?.into_iter().collect()
                } else {
                    Vec::new()
                };
                // Held until its commit, or until it outgrows the hold.
                let begin = Held::Message(Box::new(DownstreamMessage::Begin(begin)));
                self.hold.begin(begin, 0)?;
                Ok(durable)
            }
            commit @ DownstreamMessage::Commit(_) => {
                let (commit, bytes) = self.hold.commit(Held::Message(Box::new(commit)), 0);
                let applied = match commit {
                    TxnCommit::Whole(held) => self.writer.apply_whole(&held)?,
                    TxnCommit::Streamed(commit) => self.stream(vec![commit])?,
                };
                self.committed(applied, bytes)
            }
            DownstreamMessage::Rollback(rollback) => {
                // A held transaction never reached SQLite.
                if self.hold.rollback() == TxnEnd::RollBack {
                    self.writer.apply(&DownstreamMessage::Rollback(rollback))?;
                }
                Ok(Vec::new())
            }
            other => {
                let items = self.hold.item(Held::Message(Box::new(other)), 0);
                self.stream(items)?;
                Ok(Vec::new())
            }
        }
    }

    fn apply_text(&mut self, change: TextRowChange) -> anyhow::Result<Vec<Watermark>> {
        // A row change is never a commit: nothing becomes durable here.
        let items = self.hold.item(Held::Text(change), 0);
        self.stream(items)?;
        Ok(Vec::new())
    }

    fn settle(&mut self) -> anyhow::Result<Vec<Watermark>> {
        // The replica as of every message, as schema changes are computed against it: a held
        // transaction (one whose DDL came earlier, say) goes into SQLite now. Everything else
        // is applied as it comes.
        let items = self.hold.settle();
        self.stream(items)?;
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
