//! The ingest thread: feeds upstream events to the engine's upstream session and carries out
//! what it says — messages into the streamer, confirmations back to the source, schema
//! changes computed against the replica, backfills when one may start — and carries out the
//! storage queue in order: each upstream transaction applied to the replica and appended to the
//! change log in one SQLite transaction, then reported durable to the streamer and the session
//! (which releases the upstream confirmation); catch-up reads start once every store before
//! them is committed.
//!
//! Group commit (the engine's `upstream::GroupCommit` holds the rule; on unless `serve
//! --no-group-commit`, which stores one transaction per SQLite commit): while more upstream
//! transactions are queued, the next ones are applied into the same SQLite transaction: a
//! small one held whole until its commit and applied then with no savepoint (it is never
//! rolled back alone), a large one in a savepoint of its own. The group is committed when the
//! engine says it is full, when its deadline passes with nothing more to apply (the thread
//! never waits for input past it), and before anything that must see the store committed: a
//! catch-up read (one asked for in the middle of a transaction waits for that transaction's
//! commit, which then closes the group), a purge, a stop.
//!
//! The commit does not wait for the disk: the WAL is synced, and checkpointed, on another
//! thread (`replica::wal_sync`), one sync at a time, and a group is durable once a sync that
//! started after its commit returned (the engine's rule again; while a sync runs the open
//! group has no deadline and grows, since its own sync could not start sooner). Only then
//! are its commits reported stored (the streamer, and the session, which releases the
//! upstream confirmation of the last one; a backfill starts only with everything stored) and
//! their scope-feed entries routed. Meanwhile the thread goes on decoding, forwarding and
//! applying: a disk that stalls for tens of milliseconds holds back the acknowledgement to
//! Postgres, not the subscribers, who see every upstream transaction as its own
//! `begin … commit` as it arrives.
//!
//! Backfills (`replica::backfill`) are a second source of transactions. When the session says
//! one may start (between upstream transactions, everything before stored) the thread starts
//! the backfill the replica waits for and takes its messages instead of upstream's until its
//! commit: forwarded, stored and (being `skipAck`) never confirmed upstream.
//!
//! A relay's follower takes the same path: its primary's frames are upstream events as
//! pgoutput's are, so its transactions are grouped the same way. A `RestartUpstream` the
//! streamer asks for (a v8 subscriber needs backfills the running stream does not cover) is
//! only logged: Postgres takes no backfill requests, the replica runs its own backfills.
//!
//! Group commit was first merged and then reverted, because the client end-to-end suite
//! (`npm run test:client-serve`) failed more often with it, and its port onto this one ingest
//! loop waited for the same reason. The cause was in the browser client: a timer that fired a
//! few milliseconds early (Node counts a timer from its event loop's cached clock) left a
//! reconnect unarmed for good, and bursts made that likelier by keeping the client's loop
//! busier. The engine's `scope_sync::client` now arms such a deadline again (its handling of
//! `ClientInput::Tick`), and the suite passes with group commit on.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

use futures::FutureExt as _;
use highwater_engine::change_stream::{Change, DownstreamMessage, Rollback};
use highwater_engine::pgoutput::Relation;
use highwater_engine::streamer::{ConnId, LogOp, StoredChange};
use highwater_engine::upstream::{
    DurableGroup, Ending, GroupCommit, GroupDecision, GroupLimits, Hold, HoldError, Input, Listen,
    SyncDecision, TxnCommit, TxnEnd, UpstreamSession, Wake,
};
use highwater_engine::watermark::{Lsn, Watermark};
use rusqlite::Connection;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, watch};

use super::hub::{Hub, StorageOp};
use super::source::{Confirm, SourceEvent};
use super::ServeError;
use crate::change_log::{self, CatchupLimits, CatchupReader};
use crate::pause_point::{self, Point};
use crate::replica::feed::CommittedChanges;
use crate::replica::wal_sync::WalSync;
use crate::replica::{Applied, Replica, ReplicaWriter};
use crate::replication::backfill::BackfillItem;
use crate::replication::initial_sync::SyncError;
use crate::upstream::{
    backfill_item, backfill_retry_in, feed, micros_ceil, reconcile_relation, retry_backfills,
    stored_at_stop, Backfills, Catalog, EffectError, EffectHost,
};

pub(crate) struct Ingest {
    hub: Arc<Hub>,
    writer: ReplicaWriter,
    db_path: PathBuf,
    publications: Vec<String>,
    handle: Handle,
    /// Every rule of the upstream stream.
    session: UpstreamSession,
    /// Where the session's confirmations go.
    confirm: Confirm,
    /// The source's sessions so far (numbers the relay's connections).
    source_sessions: u64,
    /// A purge that came in mid-transaction, run at the next commit.
    pending_purge: Option<Watermark>,
    catchup_limits: CatchupLimits,
    /// Backfills read from Postgres; `None` when the source streams its own (a relay).
    backfills: Option<Backfills>,
    /// Upstream's catalog, for Relation messages that show what the replica lacks; `None`
    /// for a relay.
    catalog: Option<Catalog>,
    /// Scope sync: where committed feed entries go; `None` when `/sync` is off.
    sync: Option<SyncFeed>,
    /// The storage queue the streamer fills, carried out here in order.
    ops: mpsc::UnboundedReceiver<StorageOp>,
    /// The open group of applied, not yet durable commits, and the committed ones waiting for
    /// their sync.
    group: GroupCommit<Watermark>,
    /// The open group's scope-feed entries.
    grouped: Vec<CommittedChanges>,
    /// Committed groups' scope-feed entries (by the group's last commit, with its upstream
    /// commit time for the lag metrics), routed once a sync made the group durable.
    unsynced_feed: VecDeque<(Watermark, Option<i64>, Vec<CommittedChanges>)>,
    /// Syncs the replica's WAL apart from its commits; `None` when the replica's commits sync
    /// themselves (a database not in WAL mode), each then durable at its commit.
    wal_sync: Option<WalSync>,
    /// Commits made durable and not yet reported stored to the session.
    stored: Vec<Watermark>,
    /// Catch-up reads asked for while a transaction was half applied inside an open group:
    /// started once that transaction's commit made the group durable.
    deferred_catchups: Vec<(ConnId, Watermark, Watermark)>,
    /// The transaction being stored, held whole until its commit while it is small (then
    /// applied with no savepoint of its own and its log rows written a few to a statement),
    /// measured in bytes of stored change text.
    hold: Hold<StoredChange>,
    /// The commit watermark of the upstream transaction handed on last (its `begin`).
    handed_on: Option<Watermark>,
    /// Sync clients' mutations confirmed by transactions handed on and not stored yet: the
    /// transaction's commit watermark, the client, the mutation.
    confirms: Vec<(Watermark, String, u64)>,
    /// Fences passed whose waiters are released once everything before them is committed.
    fences: Vec<String>,
    epoch: std::time::Instant,
}

/// Scope sync's side of the ingest thread: route each commit's feed entries after the commit,
/// and prune exits older than the retention window now and then.
pub(crate) struct SyncFeed {
    hub: Arc<super::sync::SyncHub>,
    retention: std::time::Duration,
    last_prune: Option<std::time::Instant>,
}

/// How often exits are pruned.
const PRUNE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

impl SyncFeed {
    pub fn new(hub: Arc<super::sync::SyncHub>, retention: std::time::Duration) -> SyncFeed {
        SyncFeed {
            hub,
            retention,
            last_prune: None,
        }
    }
}

/// Source events taken from the channel at a time at most.
const EVENTS_PER_TAKE: usize = 256;

// Lives for one loop step; boxing the common message variant would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Next {
    Stop,
    Op(StorageOp),
    Source(SourceEvent),
    /// The next of the events already taken from the source's channel.
    Taken,
    Backfill(Option<Result<BackfillItem, SyncError>>),
    Resumed,
    /// The open group's deadline passed with nothing more to apply.
    Flush,
    /// The running WAL sync returned.
    Synced(std::io::Result<()>),
    /// A failed backfill's retry delay passed.
    RetryBackfills,
}

impl From<HoldError> for ServeError {
    fn from(error: HoldError) -> Self {
        ServeError::Invariant {
            expected: "a store the hold takes".to_owned(),
            found: error.to_string(),
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

impl Ingest {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        hub: Arc<Hub>,
        mut writer: ReplicaWriter,
        db_path: PathBuf,
        publications: Vec<String>,
        handle: Handle,
        session: UpstreamSession,
        confirm: Confirm,
        backfills: Option<(Backfills, crate::replication::PgConfig)>,
        sync: Option<SyncFeed>,
        group: GroupLimits,
        ops: mpsc::UnboundedReceiver<StorageOp>,
    ) -> Ingest {
        let catalog = backfills
            .as_ref()
            .map(|(_, upstream)| Catalog::new(upstream.clone()));
        let backfills = backfills.map(|(backfills, _)| backfills);
        writer.set_group_commit(true);
        let wal_sync = match WalSync::take_over(writer.replica().connection()) {
            Ok(sync) => Some(sync),
            Err(error) => {
                tracing::warn!(%error, "the replica's commits sync on the ingest thread");
                None
            }
        };
        Ingest {
            hub,
            writer,
            db_path,
            publications,
            handle,
            session,
            confirm,
            source_sessions: 0,
            pending_purge: None,
            catchup_limits: CatchupLimits::default(),
            backfills,
            catalog,
            sync,
            ops,
            group: GroupCommit::new(group),
            grouped: Vec::new(),
            unsynced_feed: VecDeque::new(),
            wal_sync,
            stored: Vec::new(),
            deferred_catchups: Vec::new(),
            hold: Hold::new(),
            handed_on: None,
            confirms: Vec::new(),
            fences: Vec::new(),
            epoch: std::time::Instant::now(),
        }
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Commits the open group (between transactions only) and starts its sync, or the sync
    /// waits for the one running; starts what waited for the commit (catch-up reads and a
    /// purge see every store before them). Nothing is reported stored here: that waits for
    /// the group's sync ([`Ingest::synced`]).
    fn commit_group(&mut self) -> Result<(), ServeError> {
        if self.in_transaction() {
            return Err(ServeError::Invariant {
                expected: "a group committed between transactions".to_owned(),
                found: "one with a transaction half applied".to_owned(),
            });
        }
        if let Some(last) = self.group.last().cloned() {
            let transactions = self.group.transactions();
            // The change log's position, once per group (the replica's likewise, by the
            // writer).
            let started = std::time::Instant::now();
            change_log::commit(self.conn(), &last)?;
            pause_point::reach(Point::BeforeGroupCommit, transactions);
            self.writer.commit_group()?;
            pause_point::reach(Point::AfterGroupCommit, transactions);
            self.hub
                .recorded()
                .group_committed(transactions, started.elapsed().as_secs_f64());
            // Pruning is a transaction of its own: here, with none open (a sync returns with
            // the next group's open).
            self.prune_exits()?;
            self.unsynced_feed.push_back((
                last,
                self.writer.last_commit_ms(),
                std::mem::take(&mut self.grouped),
            ));
            if self.group.committed() == SyncDecision::Start {
                self.start_sync()?;
            }
        }
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

    /// The sync clients' mutations the transaction committed at `watermark` confirmed; those
    /// of transactions before it (rolled back, never committed) are dropped.
    fn take_confirms(&mut self, watermark: &Watermark) -> Vec<(String, u64)> {
        let mut taken = Vec::new();
        self.confirms.retain(|(at, client_id, mutation_id)| {
            if at == watermark {
                taken.push((client_id.clone(), *mutation_id));
            }
            at > watermark
        });
        taken
    }

    /// Starts the sync the group commit asked for: on its own thread, or (a replica whose
    /// commits sync themselves) done already.
    fn start_sync(&mut self) -> Result<(), ServeError> {
        let handle = self.handle.clone();
        match self.wal_sync.as_mut() {
            Some(sync) => {
                // The transactions the sync covers, for the crash tests' pause point.
                let transactions = self.group.syncing().map_or(0, |d| d.transactions);
                sync.start(&handle, transactions);
                Ok(())
            }
            None => self.synced(Ok(())),
        }
    }

    /// The running sync returned: the groups it covers are durable. Tells the streamer,
    /// routes their scope-feed entries, and keeps the last commit to report stored to the
    /// session.
    fn synced(&mut self, result: std::io::Result<()>) -> Result<(), ServeError> {
        result.map_err(ServeError::WalSync)?;
        let (durable, next) = self.group.synced();
        pause_point::reach(
            Point::AfterGroupSync,
            durable.as_ref().map_or(0, |d| d.transactions),
        );
        if let Some(durable) = durable {
            let watermark = self.durable(durable)?;
            self.stored.push(watermark);
        }
        if next == SyncDecision::Start {
            self.start_sync()?;
        }
        Ok(())
    }

    fn durable(&mut self, durable: DurableGroup<Watermark>) -> Result<Watermark, ServeError> {
        self.hub.note_durable(durable.transactions);
        // Only now, durable, may the seqs reach scope subscribers.
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
        let watermark = durable.last;
        self.hub.set_last_watermark(watermark.clone());
        // A held backfill commit goes to the subscribers now, and the upstream resumes.
        self.hub.try_call(|s| s.on_stored(watermark.clone()))?;
        Ok(watermark)
    }

    /// Takes the sync's result if it returned since the last look.
    fn poll_sync(&mut self) -> Result<(), ServeError> {
        match self.wal_sync.as_mut().and_then(WalSync::poll) {
            Some(result) => self.synced(result),
            None => Ok(()),
        }
    }

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

    /// A transaction is being stored: held, or streaming into SQLite.
    fn in_transaction(&self) -> bool {
        self.hold.in_transaction() || self.writer.in_transaction()
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

    /// Stores rows of a transaction that streams into SQLite: a spill (its `begin` opening a
    /// savepoint inside a group), or one row after it.
    fn stream(&mut self, rows: Vec<StoredChange>) -> Result<(), ServeError> {
        for row in rows {
            self.store(&row)?;
        }
        Ok(())
    }

    /// Stores the held transaction, now that its commit is here: the replica and its log rows
    /// in the open SQLite transaction, with no savepoint.
    fn store_whole(&mut self, held: Vec<StoredChange>) -> Result<Applied, ServeError> {
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
        Ok(applied)
    }

    /// Runs until `shutdown`, the source failing, or a storage error. Blocking.
    pub fn run(
        mut self,
        mut events: mpsc::Receiver<SourceEvent>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), ServeError> {
        let mut paused = self.hub.upstream_paused();
        // Source events taken from the channel together and not yet handled: leaving it
        // together, they wake a source waiting for room once, not once per event.
        let mut taken: VecDeque<SourceEvent> = VecDeque::new();
        let mut take = Vec::with_capacity(EVENTS_PER_TAKE);
        let result = loop {
            // The storage queue and a returned sync are taken first, without a wait.
            if let Err(e) = self.settle_and_report() {
                break Err(e);
            }
            let now = self.now_us();
            let flush_in = self.group.flush_in_us(now, self.in_transaction());
            let is_paused = *paused.borrow_and_update();
            // The session says what it takes: a running backfill is the only source until its
            // commit.
            let backfilling = self.session.backfill_running();
            // A failed backfill is tried again after its delay even if no commit comes.
            let retry_in = if backfilling {
                None
            } else {
                backfill_retry_in(self.backfills.as_ref())
            };
            let listen = Listen {
                paused: is_paused,
                backfill_running: backfilling,
                accepts_upstream: self.session.accepts_upstream(),
                sync_running: self.wal_sync.as_ref().is_some_and(WalSync::running),
                flush_in_us: flush_in,
                retry_in_us: retry_in.map(micros_ceil),
            };
            // What is ready now, in the engine's order: events already queued are taken
            // without a trip through the runtime (only an empty queue costs a wait).
            let ready = listen.first(|wake| match wake {
                Wake::Stop => *shutdown.borrow(),
                Wake::Flush => flush_in == Some(0),
                Wake::RetryBackfills => retry_in.is_some_and(|retry| retry.is_zero()),
                Wake::Upstream => {
                    if taken.is_empty()
                        && events
                            .recv_many(&mut take, EVENTS_PER_TAKE)
                            .now_or_never()
                            .is_some()
                    {
                        taken.extend(take.drain(..));
                    }
                    !taken.is_empty()
                }
                // Taken just above; a resume and a backfill's next item need a wait.
                Wake::Synced | Wake::Storage | Wake::Resumed | Wake::Backfill => false,
            });
            let next = match ready {
                Some(Wake::Stop) => Next::Stop,
                Some(Wake::Flush) => Next::Flush,
                Some(Wake::RetryBackfills) => Next::RetryBackfills,
                Some(Wake::Upstream) => Next::Taken,
                _ => {
                    // Nothing queued that this loop could take now: the burst is over, and
                    // what the streamer held back for it goes out as one batch per subscriber.
                    self.hub.call(|s, _| s.on_upstream_drained());
                    let flush_in = std::time::Duration::from_micros(flush_in.unwrap_or_default());
                    let retry_in = retry_in.unwrap_or_default();
                    let handle = self.handle.clone();
                    let (ops, backfills) = (&mut self.ops, &mut self.backfills);
                    let wal_sync = &mut self.wal_sync;
                    // The branches in the engine's order (`Wake::ORDER`), each taken only while
                    // the loop waits for it.
                    handle.block_on(async {
                        tokio::select! {
                            biased;
                            _ = shutdown.wait_for(|s| *s) => Next::Stop,
                            synced = async {
                                match wal_sync {
                                    Some(sync) => sync.done().await,
                                    None => std::future::pending().await,
                                }
                            }, if listen.waits_for(Wake::Synced) => Next::Synced(synced),
                            op = ops.recv() => op.map_or(Next::Stop, Next::Op),
                            _ = tokio::time::sleep(flush_in), if listen.waits_for(Wake::Flush) => {
                                Next::Flush
                            }
                            _ = tokio::time::sleep(retry_in),
                                if listen.waits_for(Wake::RetryBackfills) => Next::RetryBackfills,
                            _ = paused.changed(), if listen.waits_for(Wake::Resumed) => {
                                Next::Resumed
                            }
                            item = async {
                                match backfills {
                                    Some(b) => b.next().await,
                                    None => std::future::pending().await,
                                }
                            }, if listen.waits_for(Wake::Backfill) => Next::Backfill(item),
                            // Events taken earlier come before the channel's.
                            () = std::future::ready(()),
                                if listen.waits_for(Wake::Upstream) && !taken.is_empty() => {
                                Next::Taken
                            }
                            // A source that fails says so; one that just ends was stopped.
                            event = events.recv(),
                                if listen.waits_for(Wake::Upstream) && taken.is_empty() => {
                                event.map_or(Next::Stop, Next::Source)
                            }
                        }
                    })
                }
            };
            let step = match next {
                Next::Stop => break Ok(()),
                Next::Resumed => Ok(()),
                Next::Synced(result) => self.synced(result),
                Next::Flush => self.commit_group(),
                Next::RetryBackfills => retry_backfills(&mut self),
                Next::Op(op) => self.execute(op),
                Next::Source(event) => self.on_source(event),
                Next::Taken => match taken.pop_front() {
                    Some(event) => self.on_source(event),
                    None => Ok(()),
                },
                Next::Backfill(item) => self.on_backfill(item),
            };
            if let Err(e) = step {
                break Err(e);
            }
        };
        let result = self.end(result);
        if let Err(error) = &result {
            tracing::error!(%error, "replication stopped");
        }
        result
    }

    /// The loop ended (`result`): the engine's stop plan. Whatever was in flight upstream is
    /// not stored; the source sends it again next time. At a stop the stores of transactions
    /// already forwarded still happen and the group's whole transactions are committed (their
    /// confirmation waits for the next start, where the session finds them stored); after a
    /// failure nothing more is written. Either way the syncs of what was committed run to
    /// their end, so that everything committed is durable when the thread ends.
    fn end(&mut self, result: Result<(), ServeError>) -> Result<(), ServeError> {
        let mut result = result;
        let mut ending = if result.is_ok() {
            Ending::Stopped
        } else {
            Ending::Failed
        };
        self.hub.call(|s, _| s.upstream_ended());
        if ending.plan().store_handed_on {
            while let Ok(op) = self.ops.try_recv() {
                if !matches!(op, StorageOp::Store(_)) {
                    continue;
                }
                if let Err(error) = self.execute(op) {
                    // The store's state is not to be trusted from here: nothing more is
                    // written.
                    result = Err(error);
                    ending = Ending::Failed;
                    break;
                }
            }
        }
        if self.hold.stop() == TxnEnd::RollBack || self.writer.in_transaction() {
            let _ = self
                .writer
                .apply(&DownstreamMessage::Rollback(Rollback::default()));
        }
        let committed = if ending.plan().commit_group {
            match self.commit_group() {
                Ok(()) => true,
                Err(error) => {
                    result = result.and(Err(error));
                    false
                }
            }
        } else {
            false
        };
        if !committed {
            self.group.discarded();
            self.grouped.clear();
            self.deferred_catchups.clear();
            let _ = self.writer.discard_group();
        }
        self.finish_syncs();
        // What is durable now is confirmed, if the source still takes confirmations.
        for watermark in std::mem::take(&mut self.stored) {
            if let Err(error) = stored_at_stop(self, watermark) {
                result = result.and(Err(error));
            }
        }
        result
    }

    /// Waits for the running sync and those it leads to, at a stop: what was committed is
    /// durable when the thread ends (reported stored at the next start, where the session
    /// finds it stored and confirms it).
    fn finish_syncs(&mut self) {
        while self.wal_sync.as_ref().is_some_and(WalSync::running) {
            let handle = self.handle.clone();
            let Some(sync) = self.wal_sync.as_mut() else {
                break;
            };
            let result = handle.block_on(sync.done());
            if let Err(error) = self.synced(result) {
                tracing::error!(%error, "the replica's last commits may not be durable");
                break;
            }
        }
    }

    /// Carries out every queued storage op.
    fn drain(&mut self) -> Result<(), ServeError> {
        while let Ok(op) = self.ops.try_recv() {
            self.execute(op)?;
        }
        Ok(())
    }

    /// Carries out the queued storage ops, takes a returned sync and reports what is durable.
    fn settle_and_report(&mut self) -> Result<(), ServeError> {
        self.drain()?;
        self.poll_sync()?;
        for watermark in std::mem::take(&mut self.stored) {
            feed(self, Input::Stored { watermark })?;
        }
        Ok(())
    }

    fn on_source(&mut self, event: SourceEvent) -> Result<(), ServeError> {
        match event {
            SourceEvent::Started => {
                self.source_sessions += 1;
                feed(self, Input::Started)
            }
            SourceEvent::Wal(bytes) => feed(self, Input::WalData(&bytes)),
            SourceEvent::Frame { id, messages } => feed(self, Input::RelayFrame { id, messages }),
            SourceEvent::Failed(reason) => Err(ServeError::Source(reason)),
        }
    }

    fn on_backfill(
        &mut self,
        item: Option<Result<BackfillItem, SyncError>>,
    ) -> Result<(), ServeError> {
        backfill_item(self, item)
    }

    /// Carries out one storage op.
    fn execute(&mut self, op: StorageOp) -> Result<(), ServeError> {
        match op {
            StorageOp::Store(LogOp::Begin(row)) => {
                typed(&row)?;
                if self.in_transaction() {
                    return Err(ServeError::Invariant {
                        expected: "a `begin` between transactions".to_owned(),
                        found: format!("the `begin` of {} inside one", row.watermark()),
                    });
                }
                // A group never holds its first transaction back past its delay for one yet to
                // come.
                if self.group.flush_in_us(self.now_us(), false) == Some(0) {
                    self.commit_group()?;
                }
                // Held until its commit or until it outgrows the hold. Replica and log commit
                // together, so the replica is never ahead of the log; the writer refuses a
                // transaction not after its position.
                let bytes = row.change_json().len();
                self.hold.begin(row, bytes)?;
            }
            StorageOp::Store(LogOp::Append(row)) => {
                let bytes = row.change_json().len();
                let rows = self.hold.item(row, bytes);
                self.stream(rows)?;
            }
            StorageOp::Store(LogOp::Commit(row)) => {
                let watermark = row.watermark().clone();
                let confirms = self.take_confirms(&watermark);
                self.writer.confirm_with_next_commit(confirms);
                let bytes = row.change_json().len();
                let (commit, bytes) = self.hold.commit(row, bytes);
                let applied = match commit {
                    TxnCommit::Whole(held) => self.store_whole(held)?,
                    TxnCommit::Streamed(row) => {
                        let message = typed(&row)?;
                        self.append(&row)?;
                        self.writer.apply(message)?
                    }
                };
                match applied {
                    Applied::Grouped { .. } => {}
                    other => {
                        return Err(ServeError::Invariant {
                            expected: format!("the commit of {watermark} to be applied"),
                            found: format!("{other:?}"),
                        })
                    }
                }
                if let Some(changes) = self.writer.take_committed() {
                    self.grouped.push(changes);
                }
                let decision = self.group.applied(watermark, bytes, self.now_us());
                // A catch-up read waiting for this commit closes the group here too.
                if decision == GroupDecision::Flush || !self.deferred_catchups.is_empty() {
                    self.commit_group()?;
                }
            }
            StorageOp::Store(LogOp::Abort) => {
                // A held transaction never reached SQLite.
                if self.hold.rollback() == TxnEnd::RollBack {
                    self.writer
                        .apply(&DownstreamMessage::Rollback(Rollback::default()))?;
                }
                if !self.deferred_catchups.is_empty() {
                    self.commit_group()?;
                }
            }
            StorageOp::FetchCatchup {
                conn,
                from,
                through,
            } => {
                // The read runs on its own connection: it must find every store before it.
                if !self.group.is_open() {
                    self.spawn_catchup(conn, from, through);
                } else if self.in_transaction() {
                    self.deferred_catchups.push((conn, from, through));
                } else {
                    self.commit_group()?;
                    self.spawn_catchup(conn, from, through);
                }
            }
            StorageOp::Purge { below } => {
                if self.in_transaction() || self.group.is_open() {
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

impl EffectHost for Ingest {
    type Error = ServeError;

    fn session(&mut self) -> &mut UpstreamSession {
        &mut self.session
    }

    /// Hands a message the session let through to the streamer, which forwards it and asks
    /// for its storing (carried out from the storage queue).
    fn apply(&mut self, message: DownstreamMessage) -> Result<Vec<Watermark>, ServeError> {
        if let DownstreamMessage::Begin(begin) = &message {
            if let Some(backfills) = self.backfills.as_mut() {
                backfills.note(begin);
            }
            // Sent again from its beginning after a restart: what it confirmed comes again.
            let watermark = &begin.commit_watermark;
            self.confirms.retain(|(at, _, _)| at != watermark);
            self.handed_on = Some(watermark.clone());
        }
        self.hub.try_call(|s| s.on_upstream(message))?;
        Ok(Vec::new())
    }

    fn settle(&mut self) -> Result<Vec<Watermark>, ServeError> {
        self.drain()?;
        self.poll_sync()?;
        let stored = std::mem::take(&mut self.stored);
        // The replica as of every message handed on, as schema changes are computed against
        // it: a transaction held whole (one whose DDL came earlier, say) goes into SQLite now.
        let rows = self.hold.settle();
        self.stream(rows)?;
        Ok(stored)
    }

    fn confirm(&mut self, lsn: Lsn) {
        self.confirm.ack(lsn);
    }

    fn ack_frames(&mut self, ids: Vec<u64>) {
        if let Confirm::Primary(feedback) = &self.confirm {
            feedback.ack(self.source_sessions, ids);
        }
    }

    fn reconnect(&mut self, reason: String, restore: bool, acks: Vec<u64>) {
        if let Confirm::Primary(feedback) = &self.confirm {
            feedback.reconnect(self.source_sessions, acks, reason, restore);
        }
    }

    fn replica(&self) -> &Replica {
        self.writer.replica()
    }

    fn publications(&self) -> &[String] {
        &self.publications
    }

    fn reconcile(&mut self, relation: &Relation) -> Result<Vec<Change>, ServeError> {
        Ok(reconcile_relation(
            &self.handle,
            self.catalog.as_mut(),
            self.writer.replica(),
            relation,
        )?)
    }

    fn idle(&mut self) {
        self.hub.call(|s, _| s.on_idle());
    }

    fn confirmed(&mut self, client_id: String, mutation_id: u64) -> Result<(), ServeError> {
        if let Some(watermark) = &self.handed_on {
            self.confirms
                .push((watermark.clone(), client_id, mutation_id));
        }
        Ok(())
    }

    /// Every transaction before the fence was handed on: once they are stored and their group
    /// committed, the waiter reads them in the replica.
    fn fence(&mut self, nonce: String) -> Result<(), ServeError> {
        if self.sync.is_none() {
            return Ok(());
        }
        self.drain()?;
        self.fences.push(nonce);
        if !self.in_transaction() {
            self.commit_group()?;
        }
        Ok(())
    }

    fn backfills(&mut self) -> Option<(&mut Backfills, &Replica)> {
        let replica = self.writer.replica();
        self.backfills.as_mut().map(|b| (b, replica))
    }

    fn handle(&self) -> &Handle {
        &self.handle
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
