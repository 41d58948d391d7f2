//! The rules of an ingest loop: the host's loop that feeds a change source to an
//! [`UpstreamSession`](super::UpstreamSession) and stores what the session hands on, several
//! upstream transactions to one storage commit ([`GroupCommit`](super::GroupCommit)). What such
//! a loop decides itself is here, sans-IO, so that every loop decides it alike:
//!
//! * **Which input first.** [`Wake`] lists what a loop waits for in the order it takes them
//!   when several are ready; [`Listen`] says which of them it waits for at all, given its
//!   state (paused, a backfill running, a sync running, a deadline).
//! * **When the open group's deadline forces a flush, and how long to wait:**
//!   [`GroupCommit::flush_in_us`](super::GroupCommit::flush_in_us), asked before each input is
//!   taken, before each wait and at each transaction's beginning.
//! * **Hold or spill** ([`Hold`]): a small transaction is held whole until its commit and
//!   stored in one piece; one that outgrows the hold streams into storage as it comes.
//! * **The stop** ([`Ending`], [`StopPlan`], [`carried_at_stop`]): what becomes of the open
//!   group and transaction when the loop ends.
//!
//! The host owns the sockets, the storage and the clock; it asks these rules and carries out
//! the answers.

use super::group::outgrows_hold;
use super::Effect;

/// What an ingest loop waits for. When several are ready it takes the first in
/// [`Wake::ORDER`], the order of the variants:
///
/// 1. [`Wake::Stop`]: a stop is never held up by input.
/// 2. [`Wake::Synced`]: a returned sync makes groups durable; what waited for them (the
///    upstream confirmation, readers of the durable store) is released before more is stored.
/// 3. [`Wake::Storage`]: the store's own queue of requests handed on earlier (`serve`'s
///    streamer asks for its stores, catch-up reads and purges there), carried out in order
///    before new input adds to it.
/// 4. [`Wake::Flush`]: the open group's deadline is a bound; input ready at the same moment
///    would keep the group open past it.
/// 5. [`Wake::RetryBackfills`]: a timer too, so steady input never starves a failed backfill's
///    retry.
/// 6. [`Wake::Resumed`]: the store let upstream input through again.
/// 7. [`Wake::Backfill`], then 8. [`Wake::Upstream`]: new input last. The two never compete:
///    a running backfill is the only source until its commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Wake {
    Stop,
    Synced,
    Storage,
    Flush,
    RetryBackfills,
    Resumed,
    Backfill,
    Upstream,
}

impl Wake {
    /// Every wake, in the order a loop takes them.
    pub const ORDER: [Wake; 8] = [
        Wake::Stop,
        Wake::Synced,
        Wake::Storage,
        Wake::Flush,
        Wake::RetryBackfills,
        Wake::Resumed,
        Wake::Backfill,
        Wake::Upstream,
    ];
}

/// The state an ingest loop decides what to wait for by, taken fresh before each input.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Listen {
    /// The store holds upstream input back (`serve`: its subscribers' backlogs are full).
    pub paused: bool,
    /// A backfill runs ([`UpstreamSession::backfill_running`](super::UpstreamSession::backfill_running)).
    pub backfill_running: bool,
    /// The session takes upstream input
    /// ([`UpstreamSession::accepts_upstream`](super::UpstreamSession::accepts_upstream)).
    pub accepts_upstream: bool,
    /// A sync of the store's commits runs.
    pub sync_running: bool,
    /// [`GroupCommit::flush_in_us`](super::GroupCommit::flush_in_us): µs until the open group
    /// must be flushed.
    pub flush_in_us: Option<u64>,
    /// µs until a failed backfill may be tried again; `None` when none waits.
    pub retry_in_us: Option<u64>,
}

impl Listen {
    /// Whether the loop waits for `wake` now.
    ///
    /// * The stop and the store's queue, always.
    /// * A sync's return, while one runs.
    /// * The flush deadline, while there is one.
    /// * A backfill's retry, while one waits and no backfill runs (a running one is retried
    ///   by its own end).
    /// * The resume, while paused; a pause holds back upstream input and backfills alike
    ///   (both are forwarded), never storage, syncs or the deadline.
    /// * The running backfill's next item, while one runs.
    /// * Upstream input, while the session takes it (never beside a running backfill).
    pub fn waits_for(&self, wake: Wake) -> bool {
        match wake {
            Wake::Stop | Wake::Storage => true,
            Wake::Synced => self.sync_running,
            Wake::Flush => self.flush_in_us.is_some(),
            Wake::RetryBackfills => !self.backfill_running && self.retry_in_us.is_some(),
            Wake::Resumed => self.paused,
            Wake::Backfill => !self.paused && self.backfill_running,
            Wake::Upstream => !self.paused && self.accepts_upstream && !self.backfill_running,
        }
    }

    /// The wake to take: the first in [`Wake::ORDER`] that the loop waits for and `ready`
    /// says is ready. `ready` is asked in that order and not past the first yes, so it may
    /// take input as it looks (a host taking queued upstream events does).
    pub fn first(&self, mut ready: impl FnMut(Wake) -> bool) -> Option<Wake> {
        Wake::ORDER
            .into_iter()
            .find(|&wake| self.waits_for(wake) && ready(wake))
    }
}

/// The upstream transaction being stored, and the hold rule. A transaction is held whole until
/// its commit while it stays within [`HOLD_MESSAGES`](super::HOLD_MESSAGES) and
/// [`HOLD_BYTES`](super::HOLD_BYTES) (the host then stores it in one piece, with no savepoint
/// of its own: a transaction whose commit is here is never rolled back alone); one that
/// outgrows the hold is spilled (what it held goes into storage, its `begin` opening a
/// savepoint inside an open group) and the rest streams in as it comes, so a held transaction
/// takes bounded memory. `T` is the host's item (a message, a stored change); bytes are as the
/// host measures a transaction, and a host may count bytes that come between items
/// ([`Hold::count`]).
#[derive(Debug, Clone)]
pub struct Hold<T> {
    state: HoldState<T>,
    bytes: usize,
}

#[derive(Debug, Clone)]
enum HoldState<T> {
    Between,
    Held(Vec<T>),
    Streaming,
}

/// How a transaction's commit is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnCommit<T> {
    /// The whole transaction, `begin` to this `commit`, in one piece: it was held.
    Whole(Vec<T>),
    /// The `commit` alone, after what streamed in before it (or outside any transaction: the
    /// store refuses it).
    Streamed(T),
}

/// What the end of a transaction without its commit (a rollback, a stop) leaves to storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnEnd {
    /// Nothing: what there was of it was held and never reached storage.
    NothingStored,
    /// Roll back the transaction open in storage (if one is).
    RollBack,
}

/// An item the hold cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HoldError {
    #[error("expected a `begin` between transactions, found one inside a transaction")]
    BeginInside,
}

impl<T> Default for Hold<T> {
    fn default() -> Self {
        Hold::new()
    }
}

impl<T> Hold<T> {
    pub fn new() -> Self {
        Hold {
            state: HoldState::Between,
            bytes: 0,
        }
    }

    /// Whether a transaction is being stored (held, or streaming into storage).
    pub fn in_transaction(&self) -> bool {
        !matches!(self.state, HoldState::Between)
    }

    /// Whether a transaction is held (none of it in storage yet).
    pub fn is_held(&self) -> bool {
        matches!(self.state, HoldState::Held(_))
    }

    /// Bytes of the transaction so far (with what was counted since the last one ended).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Counts `bytes` towards the transaction being stored, or the next one.
    pub fn count(&mut self, bytes: usize) {
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// A transaction's `begin`: held. Before it, the host asks the group's deadline
    /// ([`GroupCommit::flush_in_us`](super::GroupCommit::flush_in_us)): a group never holds
    /// its first transaction back past its delay for a transaction yet to come.
    pub fn begin(&mut self, begin: T, bytes: usize) -> Result<(), HoldError> {
        if self.in_transaction() {
            return Err(HoldError::BeginInside);
        }
        self.count(bytes);
        self.state = HoldState::Held(vec![begin]);
        Ok(())
    }

    /// An item of the transaction: the items to stream into storage now, in order. None while
    /// the transaction is held; when this one makes it outgrow the hold, everything held (its
    /// `begin` first) and this one; this one alone once it streams, or outside any transaction
    /// (the store refuses what it must).
    pub fn item(&mut self, item: T, bytes: usize) -> Vec<T> {
        self.count(bytes);
        match &mut self.state {
            HoldState::Held(held) => {
                held.push(item);
                if outgrows_hold(held.len(), self.bytes) {
                    self.spill()
                } else {
                    Vec::new()
                }
            }
            HoldState::Streaming | HoldState::Between => vec![item],
        }
    }

    /// The transaction's `commit`: how to store it, and the transaction's bytes (for
    /// [`GroupCommit::applied`](super::GroupCommit::applied)). Between transactions again.
    pub fn commit(&mut self, commit: T, bytes: usize) -> (TxnCommit<T>, usize) {
        self.count(bytes);
        let stored = match std::mem::replace(&mut self.state, HoldState::Between) {
            HoldState::Held(mut held) => {
                held.push(commit);
                TxnCommit::Whole(held)
            }
            HoldState::Streaming | HoldState::Between => TxnCommit::Streamed(commit),
        };
        (stored, std::mem::take(&mut self.bytes))
    }

    /// The transaction was rolled back: what that leaves to storage. Between transactions
    /// again.
    pub fn rollback(&mut self) -> TxnEnd {
        self.bytes = 0;
        match std::mem::replace(&mut self.state, HoldState::Between) {
            HoldState::Held(_) => TxnEnd::NothingStored,
            HoldState::Streaming | HoldState::Between => TxnEnd::RollBack,
        }
    }

    /// Storage must be as of every item so far (a schema change is computed against it, a
    /// backfill planned on it): a held transaction is spilled, its items returned to stream
    /// into storage, its `begin` first.
    pub fn settle(&mut self) -> Vec<T> {
        self.spill()
    }

    /// The loop ends with the transaction unfinished: what that leaves to storage (as a
    /// rollback: the source sends the transaction again from its beginning).
    pub fn stop(&mut self) -> TxnEnd {
        self.rollback()
    }

    fn spill(&mut self) -> Vec<T> {
        if !self.is_held() {
            return Vec::new();
        }
        match std::mem::replace(&mut self.state, HoldState::Streaming) {
            HoldState::Held(held) => held,
            HoldState::Streaming | HoldState::Between => Vec::new(),
        }
    }
}

/// How an ingest loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Asked to stop, or the source ended as a stopped one does.
    Stopped,
    /// An error: the source's, the session's or the store's own.
    Failed,
}

/// What an ingest loop does when it ends, in this order:
///
/// 1. With [`StopPlan::store_handed_on`], it carries out the stores it handed on and has not
///    carried out yet (a store that takes them from a queue): transactions already forwarded.
///    A store failing here makes the ending a failure from then on ([`Ending::Failed`]'s plan).
/// 2. The transaction in progress is dropped ([`Hold::stop`]): held, it never reached storage;
///    streaming, it is rolled back. Not committed, it is not confirmed: the source sends it
///    again from its beginning at the next start.
/// 3. With [`StopPlan::commit_group`], the open group is committed: its transactions are
///    whole. Without, it is discarded ([`GroupCommit::discarded`](super::GroupCommit::discarded)):
///    nothing of it was confirmed, the source sends it again.
/// 4. The syncs of what was committed run to their end (a store whose commits do not sync
///    themselves), so that everything committed is durable when the loop returns.
/// 5. What is durable is reported stored to the session, and of what that brings only the
///    confirmations are carried out ([`carried_at_stop`]): nothing new starts.
///
/// After a failure nothing more is written (steps 1 and 3 are skipped): the failure may be the
/// store's own, after which the host's view of what its open storage transaction holds is not
/// to be trusted; a commit then could record a position past transactions that were rolled
/// back with a failed one, and the source would never send them again. A stop commits what is
/// whole, so the next start has less to receive again; it finds it stored either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopPlan {
    /// Carry out the stores already handed on.
    pub store_handed_on: bool,
    /// Commit the open group (else discard it).
    pub commit_group: bool,
}

impl Ending {
    pub fn plan(self) -> StopPlan {
        match self {
            Ending::Stopped => StopPlan {
                store_handed_on: true,
                commit_group: true,
            },
            Ending::Failed => StopPlan {
                store_handed_on: false,
                commit_group: false,
            },
        }
    }
}

/// Whether an effect of the session is carried out once the loop has ended (step 5 of
/// [`StopPlan`]): confirming to the source what is durable, nothing else.
pub fn carried_at_stop(effect: &Effect) -> bool {
    matches!(effect, Effect::Ack(_) | Effect::AckFrames(_))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::{HOLD_BYTES, HOLD_MESSAGES};
    use crate::watermark::Lsn;

    fn quiet() -> Listen {
        Listen {
            accepts_upstream: true,
            ..Listen::default()
        }
    }

    #[test]
    fn the_order_is_the_documented_one() {
        let mut sorted = Wake::ORDER;
        sorted.sort();
        assert_eq!(sorted, Wake::ORDER, "ORDER follows the variants");
        assert_eq!(Wake::ORDER.first(), Some(&Wake::Stop));
        assert_eq!(Wake::ORDER.last(), Some(&Wake::Upstream));
        assert!(Wake::Synced < Wake::Storage && Wake::Storage < Wake::Flush);
        assert!(Wake::Flush < Wake::Upstream && Wake::RetryBackfills < Wake::Backfill);
    }

    #[test]
    fn the_first_ready_wake_is_taken_and_nothing_after_it_is_asked() {
        let listen = Listen {
            sync_running: true,
            flush_in_us: Some(0),
            ..quiet()
        };
        let mut asked = Vec::new();
        let taken = listen.first(|wake| {
            asked.push(wake);
            matches!(wake, Wake::Flush | Wake::Upstream)
        });
        assert_eq!(taken, Some(Wake::Flush), "a due flush before queued input");
        assert_eq!(
            asked,
            [Wake::Stop, Wake::Synced, Wake::Storage, Wake::Flush]
        );
        assert_eq!(listen.first(|_| true), Some(Wake::Stop));
        assert_eq!(listen.first(|_| false), None);
    }

    #[test]
    fn what_is_not_waited_for_is_never_taken_or_asked() {
        // No sync, no deadline, no retry, not paused, no backfill.
        let listen = quiet();
        let mut asked = Vec::new();
        let taken = listen.first(|wake| {
            asked.push(wake);
            wake != Wake::Stop && wake != Wake::Storage
        });
        assert_eq!(taken, Some(Wake::Upstream));
        assert_eq!(asked, [Wake::Stop, Wake::Storage, Wake::Upstream]);
    }

    #[test]
    fn a_pause_holds_back_upstream_input_and_backfills_but_not_storage_syncs_or_deadlines() {
        let paused = Listen {
            paused: true,
            sync_running: true,
            flush_in_us: Some(5),
            retry_in_us: Some(5),
            ..quiet()
        };
        for wake in [
            Wake::Stop,
            Wake::Synced,
            Wake::Storage,
            Wake::Flush,
            Wake::RetryBackfills,
            Wake::Resumed,
        ] {
            assert!(paused.waits_for(wake), "{wake:?}");
        }
        assert!(!paused.waits_for(Wake::Upstream));
        let backfilling = Listen {
            backfill_running: true,
            ..paused
        };
        assert!(!backfilling.waits_for(Wake::Backfill));
        assert!(Listen {
            paused: false,
            ..backfilling
        }
        .waits_for(Wake::Backfill));
        assert!(!Listen::default().waits_for(Wake::Resumed));
    }

    #[test]
    fn a_running_backfill_is_the_only_source_and_is_not_retried_beside_itself() {
        let listen = Listen {
            backfill_running: true,
            accepts_upstream: false,
            retry_in_us: Some(0),
            ..Listen::default()
        };
        assert!(listen.waits_for(Wake::Backfill));
        assert!(!listen.waits_for(Wake::Upstream));
        assert!(!listen.waits_for(Wake::RetryBackfills));
        // Even a session that would take upstream input: a backfill runs.
        assert!(!Listen {
            accepts_upstream: true,
            ..listen
        }
        .waits_for(Wake::Upstream));
        assert_eq!(
            listen.first(|wake| matches!(wake, Wake::Backfill | Wake::RetryBackfills)),
            Some(Wake::Backfill)
        );
        // Schema changes outstanding: no upstream input either.
        assert!(!Listen {
            accepts_upstream: false,
            ..quiet()
        }
        .waits_for(Wake::Upstream));
    }

    #[test]
    fn a_small_transaction_is_held_until_its_commit_and_written_whole() {
        let mut hold = Hold::new();
        assert!(!hold.in_transaction());
        hold.begin("begin", 10).unwrap();
        assert!(hold.in_transaction() && hold.is_held());
        assert!(hold.item("insert", 100).is_empty());
        assert!(hold.item("update", 100).is_empty());
        let (commit, bytes) = hold.commit("commit", 10);
        assert_eq!(
            commit,
            TxnCommit::Whole(vec!["begin", "insert", "update", "commit"])
        );
        assert_eq!(bytes, 220);
        assert!(!hold.in_transaction());
        assert_eq!(hold.bytes(), 0, "the next transaction counts from nothing");
    }

    #[test]
    fn a_transaction_spills_at_its_256th_message_and_then_streams() {
        let mut hold = Hold::new();
        hold.begin(0usize, 0).unwrap();
        for n in 1..HOLD_MESSAGES - 1 {
            assert!(hold.item(n, 1).is_empty());
        }
        assert!(hold.is_held());
        let spilled = hold.item(HOLD_MESSAGES - 1, 1);
        assert_eq!(
            spilled,
            (0..HOLD_MESSAGES).collect::<Vec<_>>(),
            "begin first"
        );
        assert!(hold.in_transaction() && !hold.is_held());
        assert_eq!(hold.item(1000, 1), vec![1000]);
        let (commit, bytes) = hold.commit(2000, 1);
        assert_eq!(commit, TxnCommit::Streamed(2000));
        assert_eq!(bytes, HOLD_MESSAGES + 1);
        assert!(!hold.in_transaction());
    }

    #[test]
    fn a_transaction_spills_at_its_256th_kib_counted_with_what_came_between() {
        let mut hold = Hold::new();
        // Bytes the host counts apart from items (a source's frames) go to the next one.
        hold.count(HOLD_BYTES / 2);
        hold.begin('b', 0).unwrap();
        assert!(hold.item('x', HOLD_BYTES / 2 - 1).is_empty());
        hold.count(1);
        assert_eq!(hold.item('y', 0), vec!['b', 'x', 'y']);
    }

    #[test]
    fn a_rollback_stores_nothing_of_a_held_transaction_and_rolls_back_a_streaming_one() {
        let mut hold = Hold::new();
        hold.begin(1, 5).unwrap();
        hold.item(2, 5);
        assert_eq!(hold.rollback(), TxnEnd::NothingStored);
        assert!(!hold.in_transaction());
        assert_eq!(hold.bytes(), 0);
        hold.begin(3, 0).unwrap();
        assert_eq!(hold.settle(), vec![3]);
        assert_eq!(hold.rollback(), TxnEnd::RollBack);
        // Outside any transaction the store is asked to roll back what it may have open.
        assert_eq!(hold.rollback(), TxnEnd::RollBack);
        // A stop is a rollback.
        hold.begin(4, 0).unwrap();
        assert_eq!(hold.stop(), TxnEnd::NothingStored);
        hold.begin(5, 0).unwrap();
        hold.settle();
        assert_eq!(hold.stop(), TxnEnd::RollBack);
    }

    #[test]
    fn settling_spills_a_held_transaction_once_and_nothing_else() {
        let mut hold: Hold<u8> = Hold::new();
        assert!(hold.settle().is_empty());
        hold.begin(1, 0).unwrap();
        hold.item(2, 0);
        assert_eq!(hold.settle(), vec![1, 2]);
        assert!(hold.settle().is_empty());
        assert_eq!(hold.item(3, 0), vec![3]);
        assert_eq!(hold.commit(4, 0).0, TxnCommit::Streamed(4));
    }

    #[test]
    fn a_begin_inside_a_transaction_is_refused_and_anything_outside_one_streams() {
        let mut hold = Hold::new();
        assert_eq!(hold.item("status", 0), vec!["status"]);
        assert_eq!(hold.commit("stray", 0).0, TxnCommit::Streamed("stray"));
        hold.begin("a", 0).unwrap();
        assert_eq!(hold.begin("b", 0), Err(HoldError::BeginInside));
        assert!(hold.is_held(), "the held transaction is kept");
        hold.settle();
        assert_eq!(hold.begin("c", 0), Err(HoldError::BeginInside));
    }

    #[test]
    fn a_stop_commits_what_is_whole_and_a_failure_writes_nothing_more() {
        assert_eq!(
            Ending::Stopped.plan(),
            StopPlan {
                store_handed_on: true,
                commit_group: true
            }
        );
        assert_eq!(
            Ending::Failed.plan(),
            StopPlan {
                store_handed_on: false,
                commit_group: false
            }
        );
    }

    #[test]
    fn once_stopped_only_confirmations_are_carried_out() {
        assert!(carried_at_stop(&Effect::Ack(Lsn(7))));
        assert!(carried_at_stop(&Effect::AckFrames(vec![1, 2])));
        assert!(!carried_at_stop(&Effect::BackfillDue));
        assert!(!carried_at_stop(&Effect::Warn("w".to_owned())));
    }
}
