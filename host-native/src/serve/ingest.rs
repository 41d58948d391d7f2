//! `serve`'s side of the ingest loop (`crate::ingest`, which holds the loop, its input order,
//! deadlines, hold and stop): the group store of `serve` and relays, [`ReplicaAndLog`], and
//! their source, [`SourceEvents`] (the channel of the source task, a Postgres stream or a
//! relay's primary).
//!
//! What the session hands on goes to the streamer, which forwards it to live subscribers at
//! once and asks for its storing through the storage queue; the loop carries that queue out in
//! order: each upstream transaction applied to the replica and appended to the change log in
//! one SQLite transaction, several to a group (group commit: on unless `serve
//! --no-group-commit`, which stores one transaction per SQLite commit). Besides stores the queue
//! asks for catch-up reads, which start once every store before them is committed (one asked
//! for in the middle of a transaction waits for that transaction's commit, which then closes the
//! group), and purges of the change log, which wait for the open group's commit.
//!
//! The commit does not wait for the disk: the WAL is synced, and checkpointed, on another
//! thread (`replica::wal_sync`), one sync at a time, and a group is durable once a sync that
//! started after its commit returned (the engine's rule; while a sync runs the open group has
//! no deadline and grows, since its own sync could not start sooner). Only then are its commits
//! reported stored (the streamer, and the session, which releases the upstream confirmation of
//! the last one; a backfill starts only with everything stored) and their scope-feed entries
//! routed. Meanwhile the loop goes on decoding, forwarding and applying: a disk that stalls for
//! tens of milliseconds holds back the acknowledgement to Postgres, not the subscribers, who see
//! every upstream transaction as its own `begin … commit` as it arrives.
//!
//! Backfills (`replication::backfill`) are a second source of transactions: forwarded, stored
//! and (being `skipAck`) never confirmed upstream. A relay's follower takes the same path: its
//! primary's frames are upstream events as pgoutput's are, so its transactions are grouped the
//! same way. A `RestartUpstream` the streamer asks for (a v8 subscriber needs backfills the
//! running stream does not cover) is only logged: Postgres takes no backfill requests, the
//! replica runs its own backfills.
//!
//! Group commit was first merged and then reverted, because the client end-to-end suite
//! (`npm run test:client-serve`) failed more often with it, and its port onto this ingest loop
//! waited for the same reason. The cause was in the browser client: a timer that fired a few
//! milliseconds early (Node counts a timer from its event loop's cached clock) left a reconnect
//! unarmed for good, and bursts made that likelier by keeping the client's loop busier. The
//! engine's `scope_sync::client` now arms such a deadline again (its handling of
//! `ClientInput::Tick`), and the suite passes with group commit on.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

use futures::FutureExt as _;
use highwater_engine::change_stream::{DownstreamMessage, Rollback};
use highwater_engine::streamer::{ConnId, LogOp, StoredChange};
use highwater_engine::upstream::{DurableGroup, GroupLimits, MutationConfirms, UpstreamSession};
use highwater_engine::watermark::{Lsn, Watermark};
use rusqlite::Connection;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, watch};

use super::change_stream::{Hub, StorageOp};
use super::source::{Confirm, SourceEvent};
use super::ServeError;
use crate::change_log::{self, CatchupLimits, CatchupReader};
use crate::ingest::{
    GroupStore, Ingest, Invariant, Setup, Source, StoreWake, Storing, UpstreamEvent,
};
use crate::replica::feed::CommittedChanges;
use crate::replica::wal_sync::WalSync;
use crate::replica::{Applied, Replica, ReplicaWriter};
use crate::replication::PgConfig;
use crate::upstream::{Backfills, Catalog, EffectError};

/// `serve`'s ingest loop.
pub(crate) type ServeIngest = Ingest<ReplicaAndLog, SourceEvents>;

/// What `serve` builds its ingest loop from.
pub(crate) struct IngestParts {
    pub(crate) hub: Arc<Hub>,
    pub writer: ReplicaWriter,
    pub db_path: PathBuf,
    pub publications: Vec<String>,
    pub handle: Handle,
    pub session: UpstreamSession,
    /// The source's events, and where the session's confirmations go.
    pub events: mpsc::Receiver<SourceEvent>,
    pub confirm: Confirm,
    /// Backfills read from Postgres, and its catalog; `None` when the source streams its own
    /// (a relay).
    pub(crate) backfill_from: Option<PgConfig>,
    pub sync: Option<SyncFeed>,
    pub group: GroupLimits,
    pub ops: mpsc::UnboundedReceiver<StorageOp>,
}

/// The ingest loop over the replica and change log, fed by the source's events.
pub(crate) fn ingest(parts: IngestParts) -> ServeIngest {
    let IngestParts {
        hub,
        mut writer,
        db_path,
        publications,
        handle,
        session,
        events,
        confirm,
        backfill_from,
        sync,
        group,
        ops,
    } = parts;
    writer.set_group_commit(true);
    let wal_sync = match WalSync::take_over(writer.replica().connection()) {
        Ok(sync) => Some(sync),
        Err(error) => {
            tracing::warn!(%error, "the replica's commits sync on the ingest thread");
            None
        }
    };
    let setup = Setup {
        session,
        group,
        publications,
        handle: handle.clone(),
        backfills: backfill_from.clone().map(Backfills::new),
        catalog: backfill_from.map(Catalog::new),
    };
    let store = ReplicaAndLog {
        hub,
        writer,
        db_path,
        handle,
        pending_purge: None,
        catchup_limits: CatchupLimits::default(),
        sync,
        ops,
        grouped: Vec::new(),
        unsynced_feed: VecDeque::new(),
        wal_sync,
        deferred_catchups: Vec::new(),
        confirms: MutationConfirms::default(),
        fences: Vec::new(),
    };
    let source = SourceEvents {
        events,
        confirm,
        sessions: 0,
    };
    Ingest::new(setup, store, source)
}

/// Runs `serve`'s ingest loop until `shutdown`, the source failing, or a storage error.
/// Blocking.
pub(crate) fn run(ingest: ServeIngest, shutdown: watch::Receiver<bool>) -> Result<(), ServeError> {
    let result = ingest.run(shutdown);
    if let Err(error) = &result {
        tracing::error!(%error, "replication stopped");
    }
    result
}

/// `serve`'s group store: the replica and the change log in one SQLite transaction, stored from
/// the streamer's storage queue, the WAL synced apart.
pub(crate) struct ReplicaAndLog {
    hub: Arc<Hub>,
    writer: ReplicaWriter,
    db_path: PathBuf,
    handle: Handle,
    /// A purge that came in while a group was open, run at its commit.
    pending_purge: Option<Watermark>,
    catchup_limits: CatchupLimits,
    /// Scope sync: where committed feed entries go; `None` when `/sync` is off.
    sync: Option<SyncFeed>,
    /// The storage queue the streamer fills, carried out in order.
    ops: mpsc::UnboundedReceiver<StorageOp>,
    /// The open group's scope-feed entries.
    grouped: Vec<CommittedChanges>,
    /// Committed groups' scope-feed entries (by the group's last commit, with its upstream
    /// commit time for the lag metrics), routed once a sync made the group durable.
    unsynced_feed: VecDeque<(Watermark, Option<i64>, Vec<CommittedChanges>)>,
    /// Syncs the replica's WAL apart from its commits; `None` when the replica's commits sync
    /// themselves (a database not in WAL mode), each then durable at its commit.
    wal_sync: Option<WalSync>,
    /// Catch-up reads asked for while a transaction was half applied inside an open group:
    /// started once that transaction's commit closed the group.
    deferred_catchups: Vec<(ConnId, Watermark, Watermark)>,
    /// Sync clients' mutations confirmed by transactions handed on and not stored yet (the
    /// engine's rule of which commit confirms them).
    confirms: MutationConfirms,
    /// Fences passed whose waiters are released once everything before them is committed.
    fences: Vec<String>,
}

/// Scope sync's side of the ingest thread: route each commit's feed entries after the commit,
/// and prune exits older than the retention window now and then.
pub(crate) struct SyncFeed {
    hub: Arc<super::scope_sync::SyncHub>,
    retention: std::time::Duration,
    last_prune: Option<std::time::Instant>,
}

/// How often exits are pruned.
const PRUNE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

impl SyncFeed {
    pub(super) fn new(
        hub: Arc<super::scope_sync::SyncHub>,
        retention: std::time::Duration,
    ) -> SyncFeed {
        SyncFeed {
            hub,
            retention,
            last_prune: None,
        }
    }
}

impl From<Invariant> for ServeError {
    fn from(error: Invariant) -> Self {
        ServeError::Invariant {
            expected: error.expected,
            found: error.found,
        }
    }
}

impl From<EffectError> for ServeError {
    fn from(error: EffectError) -> Self {
        match error {
            EffectError::Replica(error) => ServeError::Replica(error),
            EffectError::Catalog(error) => ServeError::Postgres(error),
            other => ServeError::Invariant {
                expected: "schema changes for the upstream session".to_owned(),
                found: other.to_string(),
            },
        }
    }
}

impl ReplicaAndLog {
    /// Prunes exits older than the retention window, when due.
    fn prune_exits(&mut self) -> Result<(), ServeError> {
        let Some(sync) = self.sync.as_mut() else {
            return Ok(());
        };
        if sync
            .last_prune
            .is_none_or(|at| at.elapsed() >= PRUNE_INTERVAL)
        {
            sync.last_prune = Some(std::time::Instant::now());
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            let cutoff = now.saturating_sub(sync.retention);
            let cutoff =
                crate::replica::feed::iso_from_ms(i64::try_from(cutoff.as_millis()).unwrap_or(0));
            let floor =
                crate::replica::feed::prune_exits(self.writer.replica().connection(), &cutoff)?;
            sync.hub.set_retention_floor(floor);
        }
        Ok(())
    }

    fn conn(&self) -> &Connection {
        self.writer.replica().connection()
    }

    /// Stores one message of a transaction that streams into SQLite.
    fn store(&mut self, row: &StoredChange) -> Result<(), ServeError> {
        let message = typed(row)?;
        self.writer.apply(message)?;
        self.append(row)?;
        if let DownstreamMessage::Data(change) = message {
            if !change.is_row_change() {
                change_log::apply_cookie_ops(self.conn(), change)?;
            }
        }
        Ok(())
    }

    /// A commit applied into the open group: its scope-feed entries wait for the group.
    fn grouped(&mut self, applied: Applied, row: &StoredChange) -> Result<Watermark, ServeError> {
        match applied {
            Applied::Grouped { watermark, .. } => {
                if let Some(changes) = self.writer.take_committed() {
                    self.grouped.push(changes);
                }
                Ok(watermark)
            }
            other => Err(ServeError::Invariant {
                expected: format!("the commit of {} to be applied", row.watermark()),
                found: format!("{other:?}"),
            }),
        }
    }

    fn append(&self, row: &StoredChange) -> Result<(), ServeError> {
        change_log::append(
            self.conn(),
            row.watermark(),
            row.pos(),
            row.tag(),
            row.change_json(),
        )?;
        Ok(())
    }

    fn purge(&mut self, below: &Watermark) -> Result<(), ServeError> {
        let report = change_log::purge(self.conn(), below)?;
        tracing::info!(
            %below,
            deleted = report.deleted,
            min_watermark = %report.min_watermark,
            "change log purged"
        );
        let min = report.min_watermark;
        self.hub.set_min_watermark(min.clone());
        self.hub.with(|s| s.on_purged(min));
        Ok(())
    }

    fn spawn_catchup(&self, conn: ConnId, from: Watermark, through: Watermark) {
        let Some(gate) = self.hub.catchup_gate(conn) else {
            return;
        };
        let job = Catchup {
            conn,
            from,
            through,
            gate,
        };
        self.handle.spawn(catch_up(
            self.hub.clone(),
            job,
            self.db_path.clone(),
            self.catchup_limits,
        ));
    }
}

impl GroupStore for ReplicaAndLog {
    /// A row the streamer asked to store: its message and its change-log text.
    type Item = StoredChange;
    type Op = StorageOp;
    type Error = ServeError;

    fn replica(&self) -> &Replica {
        self.writer.replica()
    }

    /// Hands a message the session let through to the streamer, which forwards it and asks
    /// for its storing (carried out from the storage queue).
    fn hand_on(
        &mut self,
        _storing: &mut Storing<Self>,
        message: DownstreamMessage,
    ) -> Result<(), ServeError> {
        if let DownstreamMessage::Begin(begin) = &message {
            self.confirms.begin(&begin.commit_watermark);
        }
        self.hub.try_call(|s| s.on_upstream(message))?;
        Ok(())
    }

    fn idle(&mut self) {
        self.hub.call(|s, _| s.on_idle());
    }

    fn confirmed(&mut self, client_id: String, mutation_id: u64) -> Result<(), ServeError> {
        self.confirms.confirmed(client_id, mutation_id);
        Ok(())
    }

    /// Every transaction before the fence was handed on: once they are stored and their group
    /// committed, the waiter reads them in the replica.
    fn fence(&mut self, storing: &mut Storing<Self>, nonce: String) -> Result<(), ServeError> {
        if self.sync.is_none() {
            return Ok(());
        }
        while let Some(op) = self.try_next_op() {
            self.execute(storing, op)?;
        }
        self.fences.push(nonce);
        if !storing.in_transaction(self) {
            storing.commit_group(self)?;
        }
        Ok(())
    }

    fn try_next_op(&mut self) -> Option<StorageOp> {
        self.ops.try_recv().ok()
    }

    fn execute(&mut self, storing: &mut Storing<Self>, op: StorageOp) -> Result<(), ServeError> {
        match op {
            StorageOp::Store(LogOp::Begin(row)) => {
                typed(&row)?;
                if storing.in_transaction(self) {
                    return Err(ServeError::Invariant {
                        expected: "a `begin` between transactions".to_owned(),
                        found: format!("the `begin` of {} inside one", row.watermark()),
                    });
                }
                // Held until its commit or until it outgrows the hold. Replica and log commit
                // together, so the replica is never ahead of the log; the writer refuses a
                // transaction not after its position.
                let bytes = row.change_json().len();
                storing.begin(self, row, bytes)?;
            }
            StorageOp::Store(LogOp::Append(row)) => {
                let bytes = row.change_json().len();
                storing.item(self, row, bytes)?;
            }
            StorageOp::Store(LogOp::Commit(row)) => {
                let confirms = self.confirms.take(row.watermark());
                self.writer.confirm_with_next_commit(confirms);
                let bytes = row.change_json().len();
                storing.commit(self, row, bytes)?;
            }
            StorageOp::Store(LogOp::Abort) => storing.rollback(self)?,
            StorageOp::FetchCatchup {
                conn,
                from,
                through,
            } => {
                // The read runs on its own connection: it must find every store before it.
                if !storing.group_open() {
                    self.spawn_catchup(conn, from, through);
                } else if storing.in_transaction(self) {
                    self.deferred_catchups.push((conn, from, through));
                } else {
                    storing.commit_group(self)?;
                    self.spawn_catchup(conn, from, through);
                }
            }
            StorageOp::Purge { below } => {
                if storing.in_transaction(self) || storing.group_open() {
                    self.pending_purge = Some(match self.pending_purge.take() {
                        Some(pending) if pending > below => pending,
                        _ => below,
                    });
                } else {
                    self.purge(&below)?;
                }
            }
            StorageOp::RestartUpstream { reason } => {
                // Postgres takes no backfill requests: the replica runs its own backfills, so a
                // restart could not re-request anything.
                tracing::warn!(%reason, "a subscriber needs backfills the Postgres source cannot re-request");
            }
        }
        Ok(())
    }

    fn stores(op: &StorageOp) -> bool {
        matches!(op, StorageOp::Store(_))
    }

    async fn wait(&mut self, sync: bool) -> StoreWake<StorageOp, ServeError> {
        let (wal_sync, ops) = (&mut self.wal_sync, &mut self.ops);
        tokio::select! {
            biased;
            synced = async {
                match wal_sync {
                    Some(wal_sync) => wal_sync.done().await,
                    None => std::future::pending().await,
                }
            }, if sync => StoreWake::Synced(synced.map_err(ServeError::WalSync)),
            op = ops.recv() => op.map_or(StoreWake::Ended, StoreWake::Op),
        }
    }

    fn pause(&self) -> Option<watch::Receiver<bool>> {
        Some(self.hub.upstream_paused())
    }

    /// What the streamer held back for a burst goes out as one batch per subscriber.
    fn drained(&mut self) {
        self.hub.call(|s, _| s.on_upstream_drained());
    }

    fn ended(&mut self) {
        self.hub.call(|s, _| s.upstream_ended());
    }

    fn write(&mut self, row: StoredChange) -> Result<(), ServeError> {
        self.store(&row)
    }

    /// Stores a held transaction, now that its commit is here: the replica and its log rows
    /// in the open SQLite transaction, with no savepoint, the rows a few to a statement.
    fn write_whole(&mut self, held: Vec<StoredChange>) -> Result<Watermark, ServeError> {
        let messages = held.iter().map(typed).collect::<Result<Vec<_>, _>>()?;
        let applied = self.writer.apply_whole(messages.iter().copied())?;
        for message in &messages {
            if let DownstreamMessage::Data(change) = message {
                if !change.is_row_change() {
                    change_log::apply_cookie_ops(self.conn(), change)?;
                }
            }
        }
        let rows = held
            .iter()
            .map(|row| change_log::LogRow {
                watermark: row.watermark(),
                pos: row.pos(),
                tag: row.tag(),
                change: row.change_json(),
            })
            .collect::<Vec<_>>();
        change_log::append_rows(self.conn(), &rows)?;
        let commit = held.last().ok_or_else(|| ServeError::Invariant {
            expected: "a whole transaction to store".to_owned(),
            found: "none".to_owned(),
        })?;
        self.grouped(applied, commit)
    }

    fn write_commit(&mut self, row: StoredChange) -> Result<Watermark, ServeError> {
        let message = typed(&row)?;
        self.append(&row)?;
        let applied = self.writer.apply(message)?;
        self.grouped(applied, &row)
    }

    fn roll_back(&mut self) -> Result<(), ServeError> {
        self.writer
            .apply(&DownstreamMessage::Rollback(Rollback::default()))?;
        Ok(())
    }

    fn in_transaction(&self) -> bool {
        self.writer.in_transaction()
    }

    fn closes_group_now(&self) -> bool {
        !self.deferred_catchups.is_empty()
    }

    /// Commits the replica and the change log together, with the log's position written once
    /// per group (the replica's likewise, by the writer).
    fn commit_group(&mut self, last: &Watermark, transactions: usize) -> Result<(), ServeError> {
        let started = std::time::Instant::now();
        change_log::commit(self.conn(), last)?;
        self.writer.commit_group()?;
        self.hub
            .recorded()
            .group_committed(transactions, started.elapsed().as_secs_f64());
        // Pruning is a transaction of its own: here, with none open (a sync returns with the
        // next group's open).
        self.prune_exits()?;
        self.unsynced_feed.push_back((
            last.clone(),
            self.writer.last_commit_ms(),
            std::mem::take(&mut self.grouped),
        ));
        Ok(())
    }

    /// Catch-up reads and a purge see every store before them; fences pass.
    fn group_committed(&mut self) -> Result<(), ServeError> {
        for (conn, from, through) in std::mem::take(&mut self.deferred_catchups) {
            self.spawn_catchup(conn, from, through);
        }
        if let Some(below) = self.pending_purge.take() {
            self.purge(&below)?;
        }
        // Everything before the fences is committed: readers of the replica see it.
        if let Some(sync) = self.sync.as_ref() {
            for nonce in self.fences.drain(..) {
                sync.hub.fence_passed(&nonce);
            }
        }
        Ok(())
    }

    fn discard_group(&mut self) {
        self.grouped.clear();
        self.deferred_catchups.clear();
        let _ = self.writer.discard_group();
    }

    fn syncs_apart(&self) -> bool {
        self.wal_sync.is_some()
    }

    fn start_sync(&mut self, transactions: usize) {
        if let Some(sync) = self.wal_sync.as_mut() {
            sync.start(&self.handle, transactions);
        }
    }

    fn sync_running(&self) -> bool {
        self.wal_sync.as_ref().is_some_and(WalSync::running)
    }

    fn poll_sync(&mut self) -> Option<Result<(), ServeError>> {
        self.wal_sync
            .as_mut()
            .and_then(WalSync::poll)
            .map(|result| result.map_err(ServeError::WalSync))
    }

    async fn sync_done(&mut self) -> Result<(), ServeError> {
        match self.wal_sync.as_mut() {
            Some(sync) => sync.done().await.map_err(ServeError::WalSync),
            None => std::future::pending().await,
        }
    }

    /// Tells the streamer, and routes the groups' scope-feed entries: only now, durable, may
    /// their seqs reach scope subscribers.
    fn durable(&mut self, durable: &DurableGroup<Watermark>) -> Result<(), ServeError> {
        self.hub.note_durable(durable.transactions);
        let recorded = self.hub.recorded().clone();
        while self
            .unsynced_feed
            .front()
            .is_some_and(|(last, _, _)| *last <= durable.last)
        {
            let Some((_, commit_ms, entries)) = self.unsynced_feed.pop_front() else {
                break;
            };
            if let Some(commit_ms) = commit_ms {
                recorded.durable(commit_ms);
            }
            if let Some(sync) = self.sync.as_ref() {
                for changes in entries {
                    let commit_ms = changes.commit_ms;
                    sync.hub.committed(changes);
                    if let Some(commit_ms) = commit_ms {
                        recorded.routed(commit_ms);
                    }
                }
            }
        }
        if let Some(sync) = self.sync.as_ref() {
            sync.hub.routed_through(&durable.last);
        }
        let watermark = durable.last.clone();
        self.hub.set_last_watermark(watermark.clone());
        // A held backfill commit goes to the subscribers now, and the upstream resumes.
        self.hub.try_call(|s| s.on_stored(watermark))?;
        Ok(())
    }
}

/// `serve`'s source: the events of the source task, and where its confirmations go.
pub(crate) struct SourceEvents {
    events: mpsc::Receiver<SourceEvent>,
    confirm: Confirm,
    /// The source's sessions so far (numbers the relay's connections).
    sessions: u64,
}

impl Source for SourceEvents {
    type Event = SourceEvent;
    type Error = ServeError;

    fn try_take(&mut self, into: &mut Vec<SourceEvent>, max: usize) {
        let _ = self.events.recv_many(into, max).now_or_never();
    }

    async fn take(&mut self, into: &mut Vec<SourceEvent>, max: usize) -> usize {
        self.events.recv_many(into, max).await
    }

    fn input(&mut self, event: SourceEvent) -> Result<UpstreamEvent, ServeError> {
        match event {
            SourceEvent::Started => {
                self.sessions += 1;
                Ok(UpstreamEvent::Started)
            }
            SourceEvent::Wal(bytes) => Ok(UpstreamEvent::Wal(bytes)),
            SourceEvent::Frame { id, messages } => Ok(UpstreamEvent::Frame { id, messages }),
            SourceEvent::Failed(reason) => Err(ServeError::Source(reason)),
        }
    }

    /// A source that fails says so; one that just ends was stopped.
    fn ended(&self) -> Result<(), ServeError> {
        Ok(())
    }

    fn confirm(&mut self, lsn: Lsn) {
        self.confirm.ack(lsn);
    }

    fn ack_frames(&mut self, ids: Vec<u64>) {
        if let Confirm::Primary(feedback) = &self.confirm {
            feedback.ack(self.sessions, ids);
        }
    }

    fn reconnect(&mut self, reason: String, restore: bool, acks: Vec<u64>) {
        if let Confirm::Primary(feedback) = &self.confirm {
            feedback.reconnect(self.sessions, acks, reason, restore);
        }
    }
}

/// The typed message of a row the streamer asked to store (always there for live messages).
fn typed(row: &StoredChange) -> Result<&DownstreamMessage, ServeError> {
    row.message().ok_or_else(|| ServeError::Invariant {
        expected: "a typed message to apply to the replica".to_owned(),
        found: format!(
            "only the stored text of {} at {}",
            row.tag(),
            row.watermark()
        ),
    })
}

struct Catchup {
    conn: ConnId,
    from: Watermark,
    through: Watermark,
    /// `true` while the streamer wants the read paused.
    gate: watch::Receiver<bool>,
}

/// Reads the change log for one subscriber and feeds it to the streamer, a batch at a time.
/// While the streamer holds the read paused (the subscriber's backlog, catch-up rows
/// included, is full) it waits as a task: no blocking thread and no SQLite read transaction
/// is held, each batch is read in a transaction of its own on a blocking thread.
async fn catch_up(hub: Arc<Hub>, mut job: Catchup, path: PathBuf, limits: CatchupLimits) {
    let conn = job.conn;
    let wanted =
        |hub: &Hub| hub.is_connected(conn) && hub.inspect(|s| s.subscriber(conn).is_some());
    let opened = tokio::task::spawn_blocking(move || CatchupReader::open(&path)).await;
    let mut reader = match opened {
        Ok(Ok(reader)) => reader,
        Ok(Err(error)) => {
            let reason = error.to_string();
            hub.call(|s, _| s.catchup_failed(conn, &reason));
            return;
        }
        Err(error) => {
            let reason = format!("the catch-up task failed: {error}");
            hub.call(|s, _| s.catchup_failed(conn, &reason));
            return;
        }
    };
    let mut after = None;
    let mut progress = crate::runtime::Progress::new();
    let mut rows = 0usize;
    loop {
        // Wait out a pause, holding nothing.
        loop {
            if !wanted(&hub) {
                return;
            }
            if !*job.gate.borrow_and_update() {
                break;
            }
            if job.gate.changed().await.is_err() {
                return;
            }
        }
        let (from, through) = (job.from.clone(), job.through.clone());
        let read = tokio::task::spawn_blocking(move || {
            let batch = reader.read_batch(&from, &through, after.as_ref(), limits);
            (reader, batch)
        })
        .await;
        let batch = match read {
            Ok((back, Ok(batch))) => {
                reader = back;
                batch
            }
            Ok((_, Err(error))) => {
                let reason = error.to_string();
                hub.call(|s, _| s.catchup_failed(conn, &reason));
                return;
            }
            Err(error) => {
                let reason = format!("the catch-up task failed: {error}");
                hub.call(|s, _| s.catchup_failed(conn, &reason));
                return;
            }
        };
        if !wanted(&hub) {
            return;
        }
        rows += batch.rows.len();
        if progress.due() {
            tracing::info!(
                conn = conn.0,
                rows,
                reached = %batch.rows.last().map_or(&job.from, |row| &row.watermark),
                through = %job.through,
                elapsed_s = progress.elapsed_s(),
                "subscriber catch-up in progress"
            );
        }
        if !batch.rows.is_empty() {
            hub.call(|s, _| s.catchup_rows(conn, batch.rows));
        }
        match batch.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    if progress.logged() {
        tracing::info!(
            conn = conn.0,
            rows,
            elapsed_s = progress.elapsed_s(),
            "subscriber catch-up read"
        );
    }
    if wanted(&hub) {
        hub.call(|s, _| s.catchup_done(conn));
    }
}
