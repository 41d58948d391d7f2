//! `highwater replicate`: keeps `<data>/replica.db` equal to the upstream publications.
//!
//! An empty (or never completed) replica is synced from a fresh slot's exported snapshot; a
//! synced one resumes from its stored position. Upstream transactions are applied in SQLite
//! transactions — several queued ones in one, each in a savepoint, as the engine's group-commit
//! rule (`upstream::GroupCommit`) says — and acknowledged upstream only once committed, so a
//! crash at any point loses nothing and applies nothing twice. An open group is made durable
//! when it is full, when its deadline passes with nothing more to apply, before a backfill and
//! at a stop. Ctrl-C / SIGTERM stop at the next message: a
//! transaction in progress is discarded (Postgres sends it again on the next start).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use highwater_engine::change_stream::DownstreamMessage;
use highwater_engine::upstream::{
    Effect, GroupCommit, GroupDecision, GroupLimits, Input, UpstreamSession,
};
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::pause_point::{self, Point};
use crate::replication::PgConfig;
use crate::upstream::{reconcile_relation, resolve_ddl, Catalog};

use crate::replica::backfill::{run_backfills, BackfillPlanner, RecentXids};
use crate::replica::bootstrap::{BootstrapError, Upstream};
use crate::replica::initial_sync::SyncError;
use crate::replica::{Applied, Replica, ReplicaWriter};
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

/// Backfills between upstream transactions: what to run next, and the transactions the next
/// backfill's snapshot must see.
struct Backfills {
    upstream: PgConfig,
    planner: BackfillPlanner,
    recent_xids: RecentXids,
}

impl Backfills {
    /// Runs the backfills the replica waits for, each committed on its own (no group is open
    /// when one may start).
    fn run(&mut self, handle: &Handle, writer: &mut ReplicaWriter) -> Result<(), SyncError> {
        let xids = self.recent_xids.to_vec();
        writer.set_group_commit(false);
        let result = run_backfills(handle, &self.upstream, writer, &mut self.planner, &xids);
        writer.set_group_commit(true);
        result?;
        Ok(())
    }
}

/// Replicates until `stop` turns true. Blocking: run it on a blocking thread of `handle`'s
/// runtime.
pub fn replicate(
    handle: &Handle,
    args: &ReplicateArgs,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let upstream = Upstream::prepare(handle, &args.upstream, &args.app_id, &args.publications)?;
    let mut replica = Replica::open_in_dir(&args.data)?;
    upstream.check_slot(handle, &replica, &args.data, args.auto_reset)?;
    if let Some(reason) = upstream.resync_reason(handle, &replica)? {
        tracing::warn!(%reason, "resyncing");
        let stopped = stop.clone();
        replica = match upstream.resync(handle, replica, &args.data, &|| *stopped.borrow()) {
            Err(BootstrapError::Sync(SyncError::Stopped)) => {
                tracing::info!("stopped during the initial sync; the next start syncs again");
                return Ok(());
            }
            other => other?.0,
        };
    }

    let mut writer = ReplicaWriter::new(replica);
    let mut catalog = Catalog::new(upstream.params.upstream());
    let mut backfills = Backfills {
        upstream: upstream.params.upstream(),
        planner: BackfillPlanner::new(),
        recent_xids: RecentXids::default(),
    };
    // Pending since before a crash or a stop: recorded with the schema change that asked.
    backfills.run(handle, &mut writer)?;
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

/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What the replicator's loop carries effects out with.
struct Replicator<'a> {
    handle: &'a Handle,
    catalog: &'a mut Catalog,
    backfills: &'a mut Backfills,
    writer: &'a mut ReplicaWriter,
    stream: &'a WalStream,
    publications: &'a [String],
    committed: u64,
    group: &'a mut GroupCommit<highwater_engine::watermark::Watermark>,
    /// Bytes of replication data since the last commit applied.
    txn_bytes: &'a mut usize,
    epoch: Instant,
}

/// Events taken from the replication socket's queue in one wake-up.
const BATCH_EVENTS: usize = 256;

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
    let mut session = crate::upstream::session(app_id, state.watermark, state.lsn);
    let mut last_report = Instant::now();
    let mut committed = 0;
    let mut group = GroupCommit::new(GroupLimits::default());
    let mut txn_bytes = 0;
    let epoch = Instant::now();
    writer.set_group_commit(true);
    let mut batch = Vec::with_capacity(BATCH_EVENTS);
    let mut queued: VecDeque<_> = VecDeque::new();
    // The carrier of effects, over the loop's state; rebuilt where the stream is waited on.
    macro_rules! replicator {
        () => {
            Replicator {
                handle,
                catalog: &mut *catalog,
                backfills: &mut *backfills,
                writer: &mut *writer,
                stream: &*stream,
                publications,
                committed: 0,
                group: &mut group,
                txn_bytes: &mut txn_bytes,
                epoch,
            }
        };
    }
    loop {
        if *stop.borrow() {
            // What is applied between transactions is whole: durable, then acknowledged.
            if !writer.in_transaction() {
                replicator!().make_durable(&mut session)?;
            }
            return Ok(());
        }
        if queued.is_empty() {
            stream.try_recv_many(&mut batch, BATCH_EVENTS);
            queued.extend(batch.drain(..));
        }
        if queued.is_empty() {
            // About to wait for input: an open group waits no longer than its deadline.
            let now = u64::try_from(epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
            let in_transaction = writer.in_transaction();
            if group.flush_due(now, in_transaction) {
                let mut replicator = replicator!();
                replicator.make_durable(&mut session)?;
                committed += replicator.committed;
                continue;
            }
            let flush_in = match group.deadline_us() {
                Some(deadline) if !in_transaction => {
                    Some(Duration::from_micros(deadline.saturating_sub(now)))
                }
                _ => None,
            };
            let taken = handle.block_on(async {
                tokio::select! {
                    _ = stop.changed() => None,
                    taken = stream.recv_many(&mut batch, BATCH_EVENTS) => Some(Some(taken)),
                    _ = tokio::time::sleep(flush_in.unwrap_or_default()),
                        if flush_in.is_some() => Some(None),
                }
            });
            match taken {
                None => continue,
                Some(None) => {
                    let mut replicator = replicator!();
                    replicator.make_durable(&mut session)?;
                    committed += replicator.committed;
                    continue;
                }
                Some(Some(0)) => bail!("the replication stream ended"),
                Some(Some(_)) => queued.extend(batch.drain(..)),
            }
        }
        let Some(event) = queued.pop_front() else {
            continue;
        };
        let effects = match event? {
            WalEvent::Started { start, .. } => {
                tracing::debug!(%start, "replication session started");
                session.handle(Input::Started)?
            }
            WalEvent::CopyData(bytes) => {
                txn_bytes = txn_bytes.saturating_add(bytes.len());
                session.handle(Input::WalData(&bytes))?
            }
        };
        let mut replicator = replicator!();
        replicator.carry(&mut session, effects)?;
        committed += replicator.committed;
        if last_report.elapsed() >= PROGRESS_EVERY {
            if let Some(state) = writer.replica().state() {
                tracing::info!(
                    transactions = committed,
                    position = %state.lsn,
                    "replicating"
                );
            }
            last_report = Instant::now();
        }
    }
}

impl Replicator<'_> {
    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Commits the open group durably (between transactions only) and reports its last
    /// commit stored, carrying out the acknowledgement that follows.
    fn make_durable(&mut self, session: &mut UpstreamSession) -> anyhow::Result<()> {
        if !self.group.is_open() {
            return Ok(());
        }
        let transactions = self.group.transactions();
        pause_point::reach(Point::BeforeGroupCommit, transactions);
        self.writer.commit_group()?;
        pause_point::reach(Point::AfterGroupCommit, transactions);
        let Some(durable) = self.group.durable() else {
            return Ok(());
        };
        self.committed += u64::try_from(durable.transactions).unwrap_or(u64::MAX);
        let effects = session.handle(Input::Stored {
            watermark: durable.last,
        })?;
        self.carry(session, effects)
    }

    /// Carries out `effects` in order, each follow-up's effects before the rest.
    fn carry(&mut self, session: &mut UpstreamSession, effects: Vec<Effect>) -> anyhow::Result<()> {
        let mut queue: VecDeque<Effect> = effects.into();
        while let Some(effect) = queue.pop_front() {
            let more = match effect {
                Effect::Apply(message) => {
                    if let DownstreamMessage::Begin(begin) = &message {
                        self.backfills.recent_xids.note(begin);
                    }
                    match self.writer.apply(&message)? {
                        Applied::Grouped { watermark, .. } => {
                            let bytes = std::mem::take(self.txn_bytes);
                            let now = self.now_us();
                            if self.group.applied(watermark, bytes, now) == GroupDecision::Flush {
                                self.make_durable(session)?;
                            }
                            Vec::new()
                        }
                        Applied::Committed { watermark, .. } => {
                            self.committed += 1;
                            session.handle(Input::Stored { watermark })?
                        }
                        Applied::Pending | Applied::RolledBack => Vec::new(),
                    }
                }
                Effect::Ack(lsn) => {
                    self.stream.ack(lsn);
                    Vec::new()
                }
                Effect::ResolveDdl { content } => {
                    let changes = resolve_ddl(self.writer.replica(), self.publications, &content)?;
                    session.handle(Input::SchemaChanges(changes))?
                }
                Effect::ReconcileRelation(relation) => {
                    let changes = reconcile_relation(
                        self.handle,
                        Some(&mut *self.catalog),
                        self.writer.replica(),
                        &relation,
                    )?;
                    session.handle(Input::SchemaChanges(changes))?
                }
                Effect::BackfillDue => {
                    // Backfills run here to their end, written straight to the replica.
                    if self.writer.replica().has_pending_backfills() {
                        self.backfills.run(self.handle, self.writer)?;
                    }
                    Vec::new()
                }
                Effect::Idle { .. } => Vec::new(),
                Effect::Warn(message) => {
                    tracing::warn!("{message}");
                    Vec::new()
                }
                Effect::AckFrames(_) | Effect::Reconnect { .. } => {
                    bail!("expected effects of a Postgres source, found one of a relay's")
                }
            };
            for effect in more.into_iter().rev() {
                queue.push_front(effect);
            }
        }
        Ok(())
    }
}
