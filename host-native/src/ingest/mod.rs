//! The ingest loop of `highwater replicate`, `highwater serve` and a relay (`serve --from`): one
//! loop that feeds a change source to the engine's upstream session, carries out what it says
//! (the effect loop of `crate::upstream`) and stores what it hands on in groups, several upstream
//! transactions to one storage commit, made durable before the source hears of them. Two things
//! differ between the commands, each behind a trait:
//!
//! * where a group is stored, a [`GroupStore`]: `replicate` stores into the replica alone, each
//!   message as the session hands it on, with commits that sync themselves
//!   (`crate::replicate`); `serve` and relays store into the replica and the change log in one
//!   SQLite transaction, from the storage queue of the streamer (which forwards each message as
//!   it is handed on), with the WAL synced apart on another thread (`crate::serve::ingest`);
//! * where input comes from and confirmations go, a [`Source`]: the replication stream itself
//!   (`replicate`), or the channel of `serve`'s source task (a Postgres stream, or a relay's
//!   primary).
//!
//! Everything else is written once, here and in [`Storing`], and every rule is the engine's
//! (`highwater_engine::upstream`):
//!
//! * **Which input first** (`Wake`, `Listen`). Before each input the loop carries out what the
//!   store's queue holds and takes a sync that returned, reporting what became durable to the
//!   session; then it takes the first input that is ready in the engine's order: the stop, the
//!   group's deadline, a failed backfill's retry, upstream input (already queued input is taken
//!   without a trip through the runtime, several events at a time). Only when nothing is ready
//!   does it wait, for everything it listens to at once, in the same order: the stop, a sync's
//!   return, the store's queue, the deadline, the retry, the resume of a paused store, the
//!   running backfill, upstream input. A running backfill is the only source until its commit.
//! * **Deadlines** (`GroupCommit::flush_in_us`). The deadline is asked before each input and at
//!   each transaction's beginning, and a wait for input never outlasts it: an open group is made
//!   durable within its linger once input runs dry, within its delay while input keeps coming,
//!   and at the commit of a transaction that was half applied when it passed. While a sync runs
//!   the group has no deadline: it grows until the sync returns.
//! * **Hold or spill** (`Hold`): a small transaction is held whole until its commit and stored
//!   in one piece with no savepoint; one that outgrows the hold streams into storage. Before a
//!   schema change is computed or a backfill planned, a held transaction is spilled, so the
//!   replica is as of every message handed on.
//! * **The stop** (`StopPlan`): at a stop the stores already handed on are carried out, a
//!   transaction in progress is dropped (the source sends it again), the open group's whole
//!   transactions are committed; after a failure nothing more is written and the group is
//!   discarded. The syncs of what was committed run to their end, and what is durable is
//!   confirmed to the source if it still listens.
//!
//! Durability: a group is reported stored to the session (which then confirms it upstream and
//! may start a backfill) only once durable: at its commit for a store whose commits sync
//! themselves, once a sync that started after its commit returned for one that syncs apart
//! (`GroupCommit::committed`, `GroupCommit::synced`). Nothing is confirmed that a crash could
//! lose; what was not confirmed the source sends again, and the session skips what is stored.

mod storing;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use highwater_engine::change_stream::{Change, DownstreamMessage};
use highwater_engine::pgoutput::{Relation, TextRowChange};
use highwater_engine::upstream::{
    DurableGroup, Ending, GroupLimits, Input, Listen, SessionError, TxnEnd, UpstreamSession, Wake,
};
use highwater_engine::watermark::{Lsn, Watermark};
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::replica::Replica;
use crate::replication::backfill::BackfillItem;
use crate::replication::initial_sync::SyncError;
use crate::upstream::{
    backfill_item, backfill_retry_in, feed, micros_ceil, reconcile_relation, retry_backfills,
    stored_at_stop, Backfills, Catalog, EffectError, EffectHost,
};

pub(crate) use storing::Storing;

/// Source events taken at a time at most: leaving the source's queue together, they wake a
/// source waiting for room once, not once per event.
const EVENTS_PER_TAKE: usize = 256;

/// Something the loop relies on did not hold.
#[derive(Debug, thiserror::Error)]
#[error("expected {expected}, found {found}")]
pub(crate) struct Invariant {
    pub expected: String,
    pub found: String,
}

/// Where the ingest loop's groups are stored, and what the command does with what the session
/// hands on. The loop and [`Storing`] decide when to write, hold, commit and sync; the store
/// only does it.
pub(crate) trait GroupStore: Sized {
    /// One item of an upstream transaction as this store takes it.
    type Item;
    /// A request of the store's own queue (`serve`: the streamer's storage ops).
    type Op;
    type Error: From<SessionError> + From<EffectError> + From<Invariant> + std::fmt::Display;

    /// Whether a transaction's size (for the hold and the group's byte budget) is the bytes of
    /// the source's frames, counted by the loop; otherwise the store passes each item's bytes.
    const SIZE_FROM_SOURCE: bool = false;

    /// The replica, as of every message written.
    fn replica(&self) -> &Replica;

    // ---- What the session hands on ----

    /// A message the session let through: stored now (through `storing`), or handed on, its
    /// storing to come back through the store's queue.
    fn hand_on(
        &mut self,
        storing: &mut Storing<Self>,
        message: DownstreamMessage,
    ) -> Result<(), Self::Error>;

    /// A row change whose values kept their text (a session told to keep row text).
    fn hand_on_text(
        &mut self,
        storing: &mut Storing<Self>,
        change: TextRowChange,
    ) -> Result<(), Self::Error> {
        self.hand_on(storing, DownstreamMessage::Data(change.to_change()))
    }

    /// The source is between transactions with nothing new.
    fn idle(&mut self) {}

    /// The open transaction applies a sync client's mutation.
    fn confirmed(&mut self, _client_id: String, _mutation_id: u64) -> Result<(), Self::Error> {
        Ok(())
    }

    /// A fence passed: release its waiter once everything before it is committed.
    fn fence(&mut self, _storing: &mut Storing<Self>, _nonce: String) -> Result<(), Self::Error> {
        Ok(())
    }

    // ---- The store's own queue ----

    /// The queue's next request, if one is there.
    fn try_next_op(&mut self) -> Option<Self::Op>;

    /// Carries out one request of the queue.
    fn execute(&mut self, storing: &mut Storing<Self>, op: Self::Op) -> Result<(), Self::Error>;

    /// Whether `op` stores something handed on (carried out at a stop; the rest is dropped).
    fn stores(op: &Self::Op) -> bool;

    /// Waits for the running sync to return (when `sync`) or for the queue's next request,
    /// the sync first; [`StoreWake::Ended`] once the queue is closed.
    fn wait(&mut self, sync: bool) -> impl Future<Output = StoreWake<Self::Op, Self::Error>>;

    /// What holds upstream input back while `true`; `None` when nothing does.
    fn pause(&self) -> Option<watch::Receiver<bool>> {
        None
    }

    /// Nothing is queued that the loop could take now: it is about to wait.
    fn drained(&mut self) {}

    /// The loop ended: nothing more is handed on.
    fn ended(&mut self) {}

    // ---- Writing (between `Storing`'s decisions) ----

    /// Writes one item into the open storage transaction (its `begin` opens one).
    fn write(&mut self, item: Self::Item) -> Result<(), Self::Error>;

    /// Writes a whole transaction, `begin` to `commit`, into the open group in one piece;
    /// returns its commit's position.
    fn write_whole(&mut self, items: Vec<Self::Item>) -> Result<Watermark, Self::Error>;

    /// Writes the commit of the transaction streaming in; returns its position.
    fn write_commit(&mut self, commit: Self::Item) -> Result<Watermark, Self::Error>;

    /// Rolls back the transaction open in storage, if one is.
    fn roll_back(&mut self) -> Result<(), Self::Error>;

    /// Whether a transaction is open in storage.
    fn in_transaction(&self) -> bool;

    /// Whether something waits for the open group to be committed as soon as the transaction
    /// in progress ends (`serve`: a catch-up read asked for in the middle of it).
    fn closes_group_now(&self) -> bool {
        false
    }

    /// Commits the open group's storage transaction; `last` is its newest commit.
    fn commit_group(&mut self, last: &Watermark, transactions: usize) -> Result<(), Self::Error>;

    /// Whatever waited for the store to be committed may go on (asked after each request to
    /// commit the group, whether one was open or not).
    fn group_committed(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    /// Discards the open group (and a transaction still open in storage).
    fn discard_group(&mut self);

    // ---- Durability ----

    /// Whether commits are made durable by a sync apart from them; otherwise each commit is
    /// durable when it returns.
    fn syncs_apart(&self) -> bool;

    /// Starts a sync of everything committed so far (`transactions`: those it covers).
    fn start_sync(&mut self, transactions: usize);

    fn sync_running(&self) -> bool;

    /// The running sync's result if it returned.
    fn poll_sync(&mut self) -> Option<Result<(), Self::Error>>;

    /// Waits for the running sync's result (pending forever with none running).
    fn sync_done(&mut self) -> impl Future<Output = Result<(), Self::Error>>;

    /// `group` is durable: what waited for it may have it (it is reported stored to the session
    /// after this).
    fn durable(&mut self, group: &DurableGroup<Watermark>) -> Result<(), Self::Error>;
}

/// What a store's wait woke to.
pub(crate) enum StoreWake<Op, E> {
    /// The running sync returned.
    Synced(Result<(), E>),
    /// A request of the queue.
    Op(Op),
    /// The queue is closed: the loop stops.
    Ended,
}

/// Where upstream input comes from, and where the session's confirmations go.
pub(crate) trait Source {
    type Event;
    type Error;

    /// Moves events already queued (at most `max`) into `into`, without waiting.
    fn try_take(&mut self, into: &mut Vec<Self::Event>, max: usize);

    /// Waits for events and moves them (at most `max`) into `into`; 0 once the source ended.
    fn take(&mut self, into: &mut Vec<Self::Event>, max: usize) -> impl Future<Output = usize>;

    /// What an event is for the session; an error when it says the source failed.
    fn input(&mut self, event: Self::Event) -> Result<UpstreamEvent, Self::Error>;

    /// The source ended without an error event: a stop (`Ok`), or a failure.
    fn ended(&self) -> Result<(), Self::Error>;

    /// Confirms `lsn` to Postgres.
    fn confirm(&mut self, lsn: Lsn);

    /// Acknowledges frames of the primary (a relay).
    fn ack_frames(&mut self, ids: Vec<u64>);

    /// Ends the connection to the primary once `acks` are sent (a relay).
    fn reconnect(&mut self, reason: String, restore: bool, acks: Vec<u64>);
}

/// One upstream event as the session takes it.
pub(crate) enum UpstreamEvent {
    /// A new session: the replication stream (re)started, or a new connection to the primary.
    Started,
    /// One CopyData payload of the replication stream.
    Wal(Bytes),
    /// One frame of the primary.
    Frame {
        id: u64,
        messages: Vec<DownstreamMessage>,
    },
}

/// What the loop takes next.
// Lives for one loop step; boxing the larger variants would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Next<Op, E> {
    Stop,
    Synced(Result<(), E>),
    Op(Op),
    Flush,
    RetryBackfills,
    Resumed,
    Backfill(Option<Result<BackfillItem, SyncError>>),
    /// The next of the events already taken from the source.
    Taken,
    /// Events were taken from the source (how many; 0: it ended).
    Upstream(usize),
}

/// The ingest loop over a store `S` and a source `U`.
pub(crate) struct Ingest<S: GroupStore, U: Source> {
    /// Every rule of the upstream stream.
    session: UpstreamSession,
    /// The open group and the transaction being stored.
    storing: Storing<S>,
    store: S,
    source: U,
    publications: Vec<String>,
    handle: Handle,
    /// Backfills read from Postgres; `None` when the source streams its own (a relay).
    backfills: Option<Backfills>,
    /// Upstream's catalog, for Relation messages that show what the replica lacks; `None` for
    /// a relay.
    catalog: Option<Catalog>,
}

/// What an ingest loop is made of besides its store and source.
pub(crate) struct Setup {
    pub session: UpstreamSession,
    pub group: GroupLimits,
    pub publications: Vec<String>,
    pub handle: Handle,
    pub backfills: Option<Backfills>,
    pub catalog: Option<Catalog>,
}

impl<S, U> Ingest<S, U>
where
    S: GroupStore,
    U: Source,
    S::Error: From<U::Error>,
{
    pub(crate) fn new(setup: Setup, store: S, source: U) -> Self {
        Ingest {
            session: setup.session,
            storing: Storing::new(setup.group),
            store,
            source,
            publications: setup.publications,
            handle: setup.handle,
            backfills: setup.backfills,
            catalog: setup.catalog,
        }
    }

    /// Runs until `stop`, the source ending or failing, or a storage error; then ends as the
    /// engine's stop plan says. Blocking: run it on a thread of the runtime that may block.
    pub(crate) fn run(mut self, mut stop: watch::Receiver<bool>) -> Result<(), S::Error> {
        let mut pause = self.store.pause();
        // Source events taken together and not yet handled.
        let mut taken: VecDeque<U::Event> = VecDeque::new();
        let mut take: Vec<U::Event> = Vec::with_capacity(EVENTS_PER_TAKE);
        let result = loop {
            // The store's queue and a returned sync come first, without a wait: the store is
            // as the session has it, and what became durable is reported.
            if let Err(error) = self.settle_and_report() {
                break Err(error);
            }
            let flush_in = self.storing.flush_in_us(&self.store);
            let paused = pause
                .as_mut()
                .is_some_and(|pause| *pause.borrow_and_update());
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
                paused,
                backfill_running: backfilling,
                accepts_upstream: self.session.accepts_upstream(),
                sync_running: self.store.sync_running(),
                flush_in_us: flush_in,
                retry_in_us: retry_in.map(micros_ceil),
            };
            let source = &mut self.source;
            let ready = listen.first(|wake| match wake {
                Wake::Stop => *stop.borrow(),
                Wake::Flush => flush_in == Some(0),
                Wake::RetryBackfills => retry_in.is_some_and(|retry| retry.is_zero()),
                Wake::Upstream => {
                    if taken.is_empty() {
                        source.try_take(&mut take, EVENTS_PER_TAKE);
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
                    // Nothing that could be taken now: the burst is over.
                    self.store.drained();
                    let waits = Waits {
                        listen,
                        flush_in: Duration::from_micros(flush_in.unwrap_or_default()),
                        retry_in: retry_in.unwrap_or_default(),
                    };
                    self.wait(waits, &mut stop, pause.as_mut(), &mut take)
                }
            };
            let step = match next {
                Next::Stop => break Ok(()),
                Next::Resumed => Ok(()),
                Next::Synced(result) => self.storing.synced(&mut self.store, result),
                Next::Op(op) => self.store.execute(&mut self.storing, op),
                Next::Flush => self.storing.commit_group(&mut self.store),
                Next::RetryBackfills => retry_backfills(&mut self),
                Next::Backfill(item) => backfill_item(&mut self, item),
                Next::Taken => match taken.pop_front() {
                    Some(event) => self.on_event(event),
                    None => Ok(()),
                },
                Next::Upstream(0) => match self.source.ended() {
                    Ok(()) => break Ok(()),
                    Err(error) => break Err(error.into()),
                },
                Next::Upstream(_) => {
                    taken.extend(take.drain(..));
                    match taken.pop_front() {
                        Some(event) => self.on_event(event),
                        None => Ok(()),
                    }
                }
            };
            if let Err(error) = step {
                break Err(error);
            }
        };
        self.end(result)
    }

    /// Waits for the first of what the loop listens to, in the engine's order (`Wake::ORDER`):
    /// the branches of this biased select follow it, each taken only while the loop waits for
    /// it.
    fn wait(
        &mut self,
        waits: Waits,
        stop: &mut watch::Receiver<bool>,
        pause: Option<&mut watch::Receiver<bool>>,
        take: &mut Vec<U::Event>,
    ) -> Next<S::Op, S::Error> {
        let Waits {
            listen,
            flush_in,
            retry_in,
        } = waits;
        let handle = self.handle.clone();
        let (store, source, backfills) = (&mut self.store, &mut self.source, &mut self.backfills);
        handle.block_on(async {
            tokio::select! {
                biased;
                _ = stop.wait_for(|stopped| *stopped) => Next::Stop,
                // A sync's return before the queue's next request (the store's wait keeps that
                // order between the two).
                wake = store.wait(listen.waits_for(Wake::Synced)) => match wake {
                    StoreWake::Synced(result) => Next::Synced(result),
                    StoreWake::Op(op) => Next::Op(op),
                    StoreWake::Ended => Next::Stop,
                },
                _ = tokio::time::sleep(flush_in), if listen.waits_for(Wake::Flush) => Next::Flush,
                _ = tokio::time::sleep(retry_in), if listen.waits_for(Wake::RetryBackfills) => {
                    Next::RetryBackfills
                }
                () = resumed(pause), if listen.waits_for(Wake::Resumed) => Next::Resumed,
                item = next_backfill(backfills), if listen.waits_for(Wake::Backfill) => {
                    Next::Backfill(item)
                }
                taken = source.take(take, EVENTS_PER_TAKE), if listen.waits_for(Wake::Upstream) => {
                    Next::Upstream(taken)
                }
            }
        })
    }

    fn on_event(&mut self, event: U::Event) -> Result<(), S::Error> {
        match self.source.input(event)? {
            UpstreamEvent::Started => feed(self, Input::Started),
            UpstreamEvent::Wal(bytes) => {
                if S::SIZE_FROM_SOURCE {
                    self.storing.count(bytes.len());
                }
                feed(self, Input::WalData(&bytes))
            }
            UpstreamEvent::Frame { id, messages } => feed(self, Input::RelayFrame { id, messages }),
        }
    }

    /// Carries out the store's queue, takes a returned sync and reports what is durable.
    fn settle_and_report(&mut self) -> Result<(), S::Error> {
        self.drain()?;
        self.storing.poll_sync(&mut self.store)?;
        for watermark in self.storing.take_stored() {
            feed(self, Input::Stored { watermark })?;
        }
        Ok(())
    }

    /// Carries out every request queued in the store.
    fn drain(&mut self) -> Result<(), S::Error> {
        while let Some(op) = self.store.try_next_op() {
            self.store.execute(&mut self.storing, op)?;
        }
        Ok(())
    }

    /// The loop ended (`result`): the engine's stop plan (`upstream::StopPlan`), step by step.
    fn end(&mut self, result: Result<(), S::Error>) -> Result<(), S::Error> {
        let mut result = result;
        let mut ending = if result.is_ok() {
            Ending::Stopped
        } else {
            Ending::Failed
        };
        // Whatever was in flight upstream is not stored; the source sends it again next time.
        self.store.ended();
        // 1. Stores of transactions already handed on (forwarded) still happen; their
        // confirmation waits for the next start, where the session finds them stored.
        if ending.plan().store_handed_on {
            while let Some(op) = self.store.try_next_op() {
                if !S::stores(&op) {
                    continue;
                }
                if let Err(error) = self.store.execute(&mut self.storing, op) {
                    // The store's state is not to be trusted from here: nothing more is
                    // written.
                    result = Err(error);
                    ending = Ending::Failed;
                    break;
                }
            }
        }
        // 2. A transaction in progress: not committed, so never confirmed.
        if self.storing.stop() == TxnEnd::RollBack || self.store.in_transaction() {
            let _ = self.store.roll_back();
        }
        // 3. The group's transactions are whole: committed at a stop, sent again after a
        // failure.
        let committed = ending.plan().commit_group
            && match self.storing.commit_group(&mut self.store) {
                Ok(()) => true,
                Err(error) => {
                    result = result.and(Err(error));
                    false
                }
            };
        if !committed {
            self.storing.discard();
            self.store.discard_group();
        }
        // 4. What was committed is durable when the loop returns.
        self.finish_syncs();
        // 5. What is durable is confirmed, if the source still takes confirmations.
        for watermark in self.storing.take_stored() {
            if let Err(error) = stored_at_stop(self, watermark) {
                result = result.and(Err(error));
            }
        }
        result
    }

    /// Waits for the running sync and those it leads to.
    fn finish_syncs(&mut self) {
        while self.store.sync_running() {
            let handle = self.handle.clone();
            let result = handle.block_on(self.store.sync_done());
            if let Err(error) = self.storing.synced(&mut self.store, result) {
                tracing::error!(%error, "the replica's last commits may not be durable");
                break;
            }
        }
    }
}

/// The timers of one wait, with what the loop listens to.
struct Waits {
    listen: Listen,
    flush_in: Duration,
    retry_in: Duration,
}

/// Resolves when the pause changes (pending forever without one, or once its sender is gone).
async fn resumed(pause: Option<&mut watch::Receiver<bool>>) {
    if let Some(pause) = pause {
        if pause.changed().await.is_ok() {
            return;
        }
    }
    std::future::pending().await
}

/// The running backfill's next item (pending forever without backfills).
async fn next_backfill(
    backfills: &mut Option<Backfills>,
) -> Option<Result<BackfillItem, SyncError>> {
    match backfills {
        Some(backfills) => backfills.next().await,
        None => std::future::pending().await,
    }
}

impl<S, U> EffectHost for Ingest<S, U>
where
    S: GroupStore,
    U: Source,
    S::Error: From<U::Error>,
{
    type Error = S::Error;

    fn session(&mut self) -> &mut UpstreamSession {
        &mut self.session
    }

    fn apply(&mut self, message: DownstreamMessage) -> Result<Vec<Watermark>, S::Error> {
        if let DownstreamMessage::Begin(begin) = &message {
            if let Some(backfills) = self.backfills.as_mut() {
                backfills.note(begin);
            }
        }
        self.store.hand_on(&mut self.storing, message)?;
        Ok(self.storing.take_stored())
    }

    fn apply_text(&mut self, change: TextRowChange) -> Result<Vec<Watermark>, S::Error> {
        self.store.hand_on_text(&mut self.storing, change)?;
        Ok(self.storing.take_stored())
    }

    fn settle(&mut self) -> Result<Vec<Watermark>, S::Error> {
        self.drain()?;
        self.storing.poll_sync(&mut self.store)?;
        // The replica as of every message handed on, as schema changes are computed against
        // it: a transaction held whole (one whose DDL came earlier, say) goes into it now.
        self.storing.settle(&mut self.store)?;
        Ok(self.storing.take_stored())
    }

    fn confirm(&mut self, lsn: Lsn) {
        self.source.confirm(lsn);
    }

    fn ack_frames(&mut self, ids: Vec<u64>) {
        self.source.ack_frames(ids);
    }

    fn reconnect(&mut self, reason: String, restore: bool, acks: Vec<u64>) {
        self.source.reconnect(reason, restore, acks);
    }

    fn replica(&self) -> &Replica {
        self.store.replica()
    }

    fn publications(&self) -> &[String] {
        &self.publications
    }

    fn reconcile(&mut self, relation: &Relation) -> Result<Vec<Change>, S::Error> {
        Ok(reconcile_relation(
            &self.handle,
            self.catalog.as_mut(),
            self.store.replica(),
            relation,
        )?)
    }

    fn idle(&mut self) {
        self.store.idle();
    }

    fn confirmed(&mut self, client_id: String, mutation_id: u64) -> Result<(), S::Error> {
        self.store.confirmed(client_id, mutation_id)
    }

    fn fence(&mut self, nonce: String) -> Result<(), S::Error> {
        self.store.fence(&mut self.storing, nonce)
    }

    fn backfills(&mut self) -> Option<(&mut Backfills, &Replica)> {
        let replica = self.store.replica();
        self.backfills
            .as_mut()
            .map(|backfills| (backfills, replica))
    }

    fn handle(&self) -> &Handle {
        &self.handle
    }
}
