//! Group commit: which applied upstream transactions share one durable storage commit, and
//! when that commit must happen.
//!
//! A store that makes every upstream transaction durable on its own pays one fsync per
//! transaction. When more transactions are already waiting, the host applies them into the same
//! storage transaction and makes them durable together; the session is then told
//! [`Input::Stored`](super::Input::Stored) once, for the group's last commit, and confirms that
//! commit's end LSN. The rules, sans-IO:
//!
//! * A group opens with the first transaction applied after the last durable commit and is
//!   full when it holds [`GroupLimits::max_transactions`] transactions or
//!   [`GroupLimits::max_bytes`] bytes, or when its first transaction has waited
//!   [`GroupLimits::max_delay_us`]; [`GroupCommit::applied`] says [`GroupDecision::Flush`]
//!   then.
//! * A group is made durable only between transactions, never with one half applied.
//! * **A group never waits for input that may not come.** Whenever the host is about to wait
//!   for input with a group open and no transaction half applied, it waits at most until
//!   [`GroupCommit::deadline_us`] and then flushes ([`GroupCommit::flush_due`] says so). The
//!   deadline is the earlier of the group's delay and its *linger*: a short wait
//!   ([`GroupLimits::linger_us`]) after the last transaction applied. While transactions keep
//!   arriving (a burst, or a catch-up) the group grows until it is full or its delay is up,
//!   so one fsync serves many; once the input runs dry the group is made durable within the
//!   linger, so a lone transaction waits for its fsync no longer than that. With a
//!   transaction half applied the host waits for the rest of that transaction: its commit is
//!   the next point the group may close, and `applied` says `Flush` there if the delay has
//!   passed.
//! * Before anything that needs the store durable — a read of it on another connection (a
//!   catch-up read), a backfill, a purge, a stop — the host flushes at once (between
//!   transactions).
//! * Nothing of a group is confirmed upstream, reported stored, or handed to readers of the
//!   durable store (scope-sync routing) before its commit is durable:
//!   [`GroupCommit::durable`] returns the newest position of the group, to report as stored.
//!   A group whose storage transaction failed or was rolled back is
//!   [`GroupCommit::discarded`]: nothing of it is reported, the source sends it again.
//!
//! What the host does with each answer:
//!
//! * [`GroupDecision::Hold`]: take the next queued transaction into the same storage
//!   transaction.
//! * [`GroupDecision::Flush`]: commit the storage transaction durably, then call
//!   [`GroupCommit::durable`] and report its position stored.
//!
//! **A sync apart from the commit.** A host whose storage commit does not itself reach the
//! disk (a write-ahead log written at commit and synced by another thread, so that the thread
//! applying and forwarding never waits for the disk) reports the two steps apart:
//!
//! * [`GroupCommit::committed`] once the group's storage transaction committed. The group is
//!   visible to readers of the store from then on (a catch-up read, a purge may run), but not
//!   durable. It answers [`SyncDecision::Start`] when no sync is running: the host starts one,
//!   which covers this commit and every one before it. [`SyncDecision::Wait`]: a sync started
//!   before this commit is still running, so it does not cover it; the host waits for it.
//! * [`GroupCommit::synced`] once the sync the host started returned: the groups committed
//!   before it started are durable, and it returns them as one [`DurableGroup`] to report
//!   stored, with [`SyncDecision::Start`] when groups committed since wait for a sync of
//!   their own.
//! * One sync at a time: a sync that starts covers every commit before it, so commits made
//!   while one runs share the next.
//! * **While a sync runs, the open group has no deadline.** A group committed now would wait
//!   for the running sync before its own could start, so committing it earlier makes nothing
//!   durable sooner; it keeps growing instead (up to its limits: [`GroupCommit::applied`]
//!   still says `Flush` when it is full) and its deadline comes back when the sync returns.
//!   A slow disk then makes groups larger, as it does for a host whose commit syncs itself,
//!   rather than making more, smaller commits whose syncs queue.
//!
//! Time (`now_us`, any monotonic microsecond clock) comes from the host.

/// Bounds of one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLimits {
    /// Transactions in one group; `1` turns group commit off.
    pub max_transactions: usize,
    /// Bytes (as the host measures a transaction, e.g. its stored change text) in one group.
    pub max_bytes: usize,
    /// How long the first transaction of a group may wait for its durable commit while more
    /// keep arriving, in µs.
    pub max_delay_us: u64,
    /// How long an open group waits for more input once none is queued, in µs, counted from
    /// its last transaction applied.
    pub linger_us: u64,
}

impl Default for GroupLimits {
    fn default() -> Self {
        GroupLimits {
            max_transactions: 1000,
            max_bytes: 16 * 1024 * 1024,
            max_delay_us: 50_000,
            linger_us: 1_000,
        }
    }
}

impl GroupLimits {
    /// One transaction per storage commit: group commit off.
    pub fn off() -> Self {
        GroupLimits {
            max_transactions: 1,
            ..GroupLimits::default()
        }
    }
}

/// What to do after a transaction was applied into the open group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupDecision {
    /// Apply the next queued transaction into the same storage transaction (if one is
    /// queued; if none is, wait at most until [`GroupCommit::deadline_us`]).
    Hold,
    /// Make the group durable now.
    Flush,
}

/// What to do after a group's storage transaction committed, or a sync returned, when the
/// commit does not sync itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncDecision {
    /// Start a sync now: it covers every commit made so far.
    Start,
    /// Start nothing: a sync is running (and the commit waits for the one after it), or
    /// nothing waits for one.
    Wait,
}

/// A group made durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurableGroup<P> {
    /// Upstream transactions in the group.
    pub transactions: usize,
    /// Bytes of those transactions.
    pub bytes: usize,
    /// The newest commit of the group: report it stored.
    pub last: P,
}

#[derive(Debug, Clone)]
struct Open<P> {
    transactions: usize,
    bytes: usize,
    opened_at_us: u64,
    applied_at_us: u64,
    last: P,
}

/// The open group of applied, not yet durable upstream transactions. `P` is the upstream
/// position (a watermark); the group's position never moves backwards.
#[derive(Debug, Clone)]
pub struct GroupCommit<P> {
    limits: GroupLimits,
    open: Option<Open<P>>,
    /// Committed groups the running sync covers (it started after their commit); `Some`
    /// exactly while a sync runs.
    syncing: Option<DurableGroup<P>>,
    /// Committed groups the running sync does not cover (committed after it started).
    unsynced: Option<DurableGroup<P>>,
}

impl<P: Ord + Clone> GroupCommit<P> {
    pub fn new(limits: GroupLimits) -> Self {
        GroupCommit {
            limits,
            open: None,
            syncing: None,
            unsynced: None,
        }
    }

    pub fn limits(&self) -> GroupLimits {
        self.limits
    }

    /// Whether applied transactions wait for a durable commit.
    pub fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// The position of the open group's last transaction; `None` with no group open.
    pub fn last(&self) -> Option<&P> {
        self.open.as_ref().map(|open| &open.last)
    }

    /// Transactions in the open group.
    pub fn transactions(&self) -> usize {
        self.open.as_ref().map_or(0, |open| open.transactions)
    }

    /// An upstream transaction committed at `position`, of `bytes`, was applied into the
    /// storage transaction.
    pub fn applied(&mut self, position: P, bytes: usize, now_us: u64) -> GroupDecision {
        let open = self.open.get_or_insert_with(|| Open {
            transactions: 0,
            bytes: 0,
            opened_at_us: now_us,
            applied_at_us: now_us,
            last: position.clone(),
        });
        open.applied_at_us = open.applied_at_us.max(now_us);
        open.transactions += 1;
        open.bytes = open.bytes.saturating_add(bytes);
        if position > open.last {
            open.last = position;
        }
        let full = open.transactions >= self.limits.max_transactions
            || open.bytes >= self.limits.max_bytes
            || now_us.saturating_sub(open.opened_at_us) >= self.limits.max_delay_us;
        if full {
            GroupDecision::Flush
        } else {
            GroupDecision::Hold
        }
    }

    /// When the open group must be made durable even if nothing more arrives (µs): the
    /// earlier of its delay and its linger after the last transaction applied; `None` with no
    /// group open, or while a sync runs (it waits for the sync's return instead). A host
    /// about to wait for input waits at most until then.
    pub fn deadline_us(&self) -> Option<u64> {
        if self.syncing.is_some() {
            return None;
        }
        self.open.as_ref().map(|open| {
            let delay = open.opened_at_us.saturating_add(self.limits.max_delay_us);
            let linger = open.applied_at_us.saturating_add(self.limits.linger_us);
            delay.min(linger)
        })
    }

    /// Whether to make the open group durable now, before waiting for (or taking) more
    /// input: its deadline has passed and no transaction is half applied
    /// (`in_transaction`). A transaction's beginning asks it too: a group never holds its
    /// first transaction back longer than its delay.
    pub fn flush_due(&self, now_us: u64, in_transaction: bool) -> bool {
        self.flush_in_us(now_us, in_transaction) == Some(0)
    }

    /// How long a host may go on without making the open group durable, in µs from
    /// `now_us`; the one answer to every question an ingest loop asks of the deadline:
    ///
    /// * `Some(0)`: flush now ([`GroupCommit::flush_due`]). Asked before taking each input
    ///   (queued input does not push a deadline back: only a transaction half applied does)
    ///   and at each transaction's beginning.
    /// * `Some(n)`: about to wait for input, wait at most `n` µs, then flush.
    /// * `None`: no bound. No group is open, a sync runs (see "A sync apart from the commit"
    ///   above), or a transaction is half applied (`in_transaction`): its commit is the next
    ///   point the group may close, and [`GroupCommit::applied`] says `Flush` there if the
    ///   delay has passed.
    pub fn flush_in_us(&self, now_us: u64, in_transaction: bool) -> Option<u64> {
        if in_transaction {
            return None;
        }
        self.deadline_us()
            .map(|deadline| deadline.saturating_sub(now_us))
    }

    /// The storage transaction of the open group committed durably: what to report stored.
    /// `None` when no group was open.
    pub fn durable(&mut self) -> Option<DurableGroup<P>> {
        self.open.take().map(|open| DurableGroup {
            transactions: open.transactions,
            bytes: open.bytes,
            last: open.last,
        })
    }

    /// The storage transaction of the open group was rolled back (or never committed, after a
    /// failure): nothing of it may be reported stored.
    pub fn discarded(&mut self) {
        self.open = None;
    }

    /// The storage transaction of the open group committed, not yet synced (see "A sync apart
    /// from the commit" above). Nothing of it is reported stored until [`GroupCommit::synced`]
    /// says so.
    pub fn committed(&mut self) -> SyncDecision {
        if let Some(open) = self.open.take() {
            let group = DurableGroup {
                transactions: open.transactions,
                bytes: open.bytes,
                last: open.last,
            };
            self.unsynced = Some(merge(self.unsynced.take(), group));
        }
        self.start_if_due()
    }

    /// The sync the host started last returned: the groups committed before it started are
    /// durable, returned as one to report stored (`None` when it covered none). The decision
    /// says whether groups committed since wait for a sync of their own.
    pub fn synced(&mut self) -> (Option<DurableGroup<P>>, SyncDecision) {
        let durable = self.syncing.take();
        (durable, self.start_if_due())
    }

    /// Whether committed groups wait for a sync (running or yet to start): nothing may stop or
    /// start that needs them durable until [`GroupCommit::synced`] reported them.
    pub fn sync_pending(&self) -> bool {
        self.syncing.is_some() || self.unsynced.is_some()
    }

    /// Whether a sync the host started is running.
    pub fn sync_running(&self) -> bool {
        self.syncing.is_some()
    }

    /// The committed groups the running sync covers, as one.
    pub fn syncing(&self) -> Option<&DurableGroup<P>> {
        self.syncing.as_ref()
    }

    fn start_if_due(&mut self) -> SyncDecision {
        if self.syncing.is_some() || self.unsynced.is_none() {
            return SyncDecision::Wait;
        }
        self.syncing = self.unsynced.take();
        SyncDecision::Start
    }
}

/// Two runs of committed groups as one, the newer `next` after `earlier`.
fn merge<P: Ord>(earlier: Option<DurableGroup<P>>, next: DurableGroup<P>) -> DurableGroup<P> {
    match earlier {
        None => next,
        Some(earlier) => DurableGroup {
            transactions: earlier.transactions + next.transactions,
            bytes: earlier.bytes.saturating_add(next.bytes),
            last: if next.last > earlier.last {
                next.last
            } else {
                earlier.last
            },
        },
    }
}

/// A transaction is held whole until its commit (the host then applies it in one piece, with
/// no savepoint of its own) up to this many messages and bytes (as the host measures them, e.g.
/// its stored change text); a larger one streams into storage as it arrives, so the memory a
/// held transaction takes stays bounded.
pub const HOLD_MESSAGES: usize = 256;
pub const HOLD_BYTES: usize = 256 * 1024;

/// Whether a held transaction of `messages` and `bytes` must stream into storage from now on.
pub fn outgrows_hold(messages: usize, bytes: usize) -> bool {
    messages >= HOLD_MESSAGES || bytes >= HOLD_BYTES
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_held_transaction_streams_from_its_256th_message_or_256th_kib() {
        assert!(!super::outgrows_hold(255, 256 * 1024 - 1));
        assert!(super::outgrows_hold(256, 0));
        assert!(super::outgrows_hold(1, 256 * 1024));
    }

    use super::*;

    /// Limits without a linger: only the delay bounds the wait.
    fn limits(max_transactions: usize, max_bytes: usize, max_delay_us: u64) -> GroupLimits {
        GroupLimits {
            max_transactions,
            max_bytes,
            max_delay_us,
            linger_us: u64::MAX,
        }
    }

    #[test]
    fn a_group_closes_at_its_transaction_count_and_reports_its_newest_commit() {
        let mut group = GroupCommit::new(limits(3, usize::MAX, u64::MAX));
        assert_eq!(group.applied(10u64, 1, 0), GroupDecision::Hold);
        assert_eq!(group.applied(20, 1, 0), GroupDecision::Hold);
        assert_eq!(group.transactions(), 2);
        assert_eq!(group.applied(30, 1, 0), GroupDecision::Flush);
        assert_eq!(
            group.durable(),
            Some(DurableGroup {
                transactions: 3,
                bytes: 3,
                last: 30
            })
        );
        assert!(!group.is_open());
        assert_eq!(group.durable(), None);
    }

    #[test]
    fn a_group_closes_at_its_byte_budget_and_at_its_delay() {
        let mut group = GroupCommit::new(limits(100, 1000, 5_000));
        assert_eq!(group.applied(1u64, 600, 0), GroupDecision::Hold);
        assert_eq!(group.applied(2, 400, 10), GroupDecision::Flush);
        group.durable();
        assert_eq!(group.applied(3, 1, 100), GroupDecision::Hold);
        assert_eq!(group.deadline_us(), Some(5_100));
        assert_eq!(group.applied(4, 1, 5_100), GroupDecision::Flush);
    }

    #[test]
    fn one_transaction_per_group_turns_grouping_off() {
        let mut group = GroupCommit::new(GroupLimits::off());
        assert_eq!(group.applied(1u64, 0, 0), GroupDecision::Flush);
    }

    #[test]
    fn an_open_group_with_nothing_more_arriving_is_flushed_at_its_deadline() {
        let mut group = GroupCommit::new(limits(100, usize::MAX, 5_000));
        assert!(!group.flush_due(1_000_000, false), "no group, nothing due");
        assert_eq!(group.deadline_us(), None);
        assert_eq!(group.applied(7u64, 1, 1_000), GroupDecision::Hold);
        // Nothing queued: the host waits until the deadline, not for the next input.
        assert_eq!(group.deadline_us(), Some(6_000));
        assert!(!group.flush_due(5_999, false));
        assert!(group.flush_due(6_000, false));
        assert!(group.flush_due(60_000_000, false));
        // With a transaction half applied the group waits for its commit, which closes it.
        assert!(!group.flush_due(60_000_000, true));
        assert_eq!(group.applied(8, 1, 60_000_000), GroupDecision::Flush);
        assert_eq!(group.durable().map(|d| d.last), Some(8));
        assert!(!group.flush_due(u64::MAX, false));
    }

    #[test]
    fn the_wait_before_a_flush_counts_down_to_the_deadline_and_is_unbounded_mid_transaction() {
        let mut group = GroupCommit::new(GroupLimits {
            linger_us: 1_000,
            ..limits(100, usize::MAX, 50_000)
        });
        assert_eq!(group.flush_in_us(0, false), None, "no group, no bound");
        group.applied(1u64, 1, 10_000);
        assert_eq!(group.flush_in_us(10_000, false), Some(1_000));
        assert_eq!(group.flush_in_us(10_400, false), Some(600));
        assert_eq!(group.flush_in_us(11_000, false), Some(0));
        assert!(group.flush_due(11_000, false));
        assert_eq!(group.flush_in_us(99_000, false), Some(0), "never negative");
        // Half a transaction applied: its commit closes the group, however late.
        assert_eq!(group.flush_in_us(99_000, true), None);
        assert!(!group.flush_due(99_000, true));
        // A sync running: no deadline until it returns.
        assert_eq!(group.committed(), SyncDecision::Start);
        group.applied(2, 1, 99_000);
        assert_eq!(group.flush_in_us(200_000, false), None);
        group.synced();
        assert_eq!(group.flush_in_us(99_500, false), Some(500));
    }

    #[test]
    fn a_group_grows_while_input_keeps_coming_and_is_flushed_a_linger_after_it_stops() {
        let mut group = GroupCommit::new(GroupLimits {
            linger_us: 1_000,
            ..limits(100, usize::MAX, 50_000)
        });
        // A lone transaction waits one linger for company, not the whole delay.
        assert_eq!(group.applied(1u64, 1, 0), GroupDecision::Hold);
        assert_eq!(group.deadline_us(), Some(1_000));
        assert!(!group.flush_due(999, false));
        assert!(group.flush_due(1_000, false));
        // Transactions arriving within a linger of each other keep the group open...
        assert_eq!(group.applied(2, 1, 900), GroupDecision::Hold);
        assert_eq!(group.deadline_us(), Some(1_900));
        let mut now = 900;
        let mut position = 2;
        while group.deadline_us() != Some(50_000) {
            now += 900;
            position += 1;
            if group.applied(position, 1, now) == GroupDecision::Flush {
                break;
            }
        }
        // ...up to the delay, counted from the first: the wait never passes it.
        assert_eq!(group.deadline_us(), Some(50_000));
        assert!(group.flush_due(50_000, false));
        now += 900;
        position += 1;
        assert_eq!(group.applied(position, 1, now), GroupDecision::Flush);
        assert_eq!(
            group.durable().map(|d| d.transactions),
            Some(position as usize)
        );
    }

    #[test]
    fn while_a_sync_runs_the_open_group_grows_past_its_deadline_until_full() {
        let mut group = GroupCommit::new(GroupLimits {
            linger_us: 1_000,
            ..limits(4, usize::MAX, 50_000)
        });
        assert_eq!(group.applied(1u64, 1, 0), GroupDecision::Hold);
        assert!(group.flush_due(1_000, false));
        assert_eq!(group.committed(), SyncDecision::Start);
        // The next group opens while that sync runs: no deadline, however long it runs.
        assert_eq!(group.applied(2, 1, 1_100), GroupDecision::Hold);
        assert_eq!(group.deadline_us(), None);
        assert!(!group.flush_due(40_000, false));
        assert_eq!(group.applied(3, 1, 40_000), GroupDecision::Hold);
        // The sync returns: the deadline is back (passed), and the group is committed and
        // synced at once.
        assert_eq!(group.synced().1, SyncDecision::Wait);
        assert_eq!(group.deadline_us(), Some(41_000));
        assert!(group.flush_due(45_000, false));
        assert_eq!(group.committed(), SyncDecision::Start);
        // Full while a sync runs: committed anyway, its sync waiting for the running one.
        for position in 4..7 {
            assert_eq!(group.applied(position, 1, 50_000), GroupDecision::Hold);
        }
        assert_eq!(group.applied(7, 1, 50_000), GroupDecision::Flush);
        assert_eq!(group.committed(), SyncDecision::Wait);
        assert_eq!(group.synced().0.map(|d| d.last), Some(3));
        assert_eq!(
            group.synced().0.map(|d| (d.transactions, d.last)),
            Some((4, 7))
        );
    }

    #[test]
    fn the_group_position_never_moves_backwards_and_a_discarded_group_reports_nothing() {
        let mut group = GroupCommit::new(GroupLimits::default());
        group.applied(20u64, 1, 0);
        group.applied(10, 1, 0);
        assert_eq!(group.durable().map(|d| d.last), Some(20));
        group.applied(50, 1, 0);
        group.discarded();
        assert!(!group.is_open());
        assert_eq!(group.durable(), None);
    }

    #[test]
    fn a_commit_that_does_not_sync_itself_is_reported_durable_only_by_a_sync_started_after_it() {
        let mut group = GroupCommit::new(limits(2, usize::MAX, u64::MAX));
        assert_eq!(group.applied(1u64, 10, 0), GroupDecision::Hold);
        assert_eq!(group.applied(2, 10, 0), GroupDecision::Flush);
        // Committed, not synced: nothing to report, and the host starts a sync.
        assert_eq!(group.committed(), SyncDecision::Start);
        assert!(!group.is_open());
        assert!(group.sync_pending() && group.sync_running());
        assert_eq!(group.syncing().map(|d| d.transactions), Some(2));
        // The next group commits while that sync runs: the running sync does not cover it.
        assert_eq!(group.applied(3, 10, 0), GroupDecision::Hold);
        assert_eq!(group.committed(), SyncDecision::Wait);
        assert_eq!(group.applied(4, 10, 0), GroupDecision::Hold);
        assert_eq!(group.committed(), SyncDecision::Wait);
        // The first sync returns: only what it covered is durable, and a second sync starts
        // for the two groups committed meanwhile.
        assert_eq!(
            group.synced(),
            (
                Some(DurableGroup {
                    transactions: 2,
                    bytes: 20,
                    last: 2
                }),
                SyncDecision::Start
            )
        );
        assert!(group.sync_running());
        assert_eq!(
            group.synced(),
            (
                Some(DurableGroup {
                    transactions: 2,
                    bytes: 20,
                    last: 4
                }),
                SyncDecision::Wait
            )
        );
        assert!(!group.sync_pending());
        // A sync that returns with nothing started reports nothing.
        assert_eq!(group.synced(), (None, SyncDecision::Wait));
        // No group open: a commit starts nothing.
        assert_eq!(group.committed(), SyncDecision::Wait);
    }

    #[test]
    fn an_open_group_is_not_part_of_the_sync_running_beside_it() {
        let mut group = GroupCommit::new(limits(100, usize::MAX, u64::MAX));
        group.applied(1u64, 1, 0);
        assert_eq!(group.committed(), SyncDecision::Start);
        // Applied while the sync runs, not committed when it returns.
        group.applied(2, 1, 0);
        let (durable, next) = group.synced();
        assert_eq!(durable.map(|d| d.last), Some(1));
        assert_eq!(next, SyncDecision::Wait);
        assert!(group.is_open());
        assert!(!group.sync_pending());
        assert_eq!(group.committed(), SyncDecision::Start);
        assert_eq!(group.synced().0.map(|d| d.last), Some(2));
    }
}
