//! Group commit: which applied upstream transactions share one durable store commit, and which
//! position may be acknowledged upstream once that commit is durable.
//!
//! A store that makes every upstream transaction durable on its own pays one fsync per
//! transaction. When more transactions are already waiting, the host may apply them into the
//! same store transaction and make them durable together. The rules, sans-IO:
//!
//! * A group opens with the first transaction applied after the last durable commit and
//!   closes when it holds [`GroupLimits::max_transactions`] transactions or
//!   [`GroupLimits::max_bytes`] bytes, or when its first transaction has waited
//!   [`GroupLimits::max_delay_us`]. [`GroupCommit::applied`] says which.
//! * With a group open and nothing queued, the host waits for more input at most until
//!   [`GroupCommit::deadline_us`], then makes the group durable; when something other than an
//!   upstream transaction needs the store durable first (a read of the store by another
//!   connection, a backfill, a stop), it makes the group durable at once.
//! * A group is made durable only between transactions, never with one half applied.
//! * The acknowledgement follows the durable commit: [`GroupCommit::durable`] returns the
//!   newest position of the group (the last commit's end). A position that needs no store of
//!   its own (a keepalive, a replayed transaction) is acknowledged at once when no group is
//!   open, and with the group otherwise ([`GroupCommit::position`]).
//!
//! What the host does with each answer:
//!
//! * [`Decision::Hold`]: take the next queued transaction into the same store transaction.
//! * [`Decision::Flush`]: commit the store transaction durably, then call
//!   [`GroupCommit::durable`] and acknowledge the position it returns.
//!
//! Time (`now_us`) comes from the host.

/// Bounds of one group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLimits {
    /// Transactions in one group; `1` turns group commit off.
    pub max_transactions: usize,
    /// Bytes (as the host measures a transaction, e.g. its pgoutput payload) in one group.
    pub max_bytes: usize,
    /// How long the first transaction of a group may wait for its durable commit, in µs.
    pub max_delay_us: u64,
}

impl Default for GroupLimits {
    fn default() -> Self {
        GroupLimits {
            max_transactions: 1000,
            max_bytes: 16 * 1024 * 1024,
            max_delay_us: 5_000,
        }
    }
}

/// What to do after a transaction was applied into the open group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Apply the next queued transaction into the same store transaction (if one is queued).
    Hold,
    /// Make the group durable now.
    Flush,
}

/// A group made durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durable<P> {
    /// Upstream transactions in the group.
    pub transactions: usize,
    /// Bytes of those transactions.
    pub bytes: usize,
    /// The position to acknowledge upstream: the newest of the group.
    pub ack: Option<P>,
}

#[derive(Debug, Clone)]
struct Open<P> {
    transactions: usize,
    bytes: usize,
    opened_at_us: u64,
    ack: Option<P>,
}

/// The open group of applied, not yet durable upstream transactions. `P` is the upstream
/// position (an LSN or a watermark); acknowledgements never move backwards within a group.
#[derive(Debug, Clone)]
pub struct GroupCommit<P> {
    limits: GroupLimits,
    open: Option<Open<P>>,
}

impl<P: Ord + Clone> GroupCommit<P> {
    pub fn new(limits: GroupLimits) -> Self {
        GroupCommit { limits, open: None }
    }

    pub fn limits(&self) -> GroupLimits {
        self.limits
    }

    /// Whether applied transactions wait for a durable commit.
    pub fn is_open(&self) -> bool {
        self.open.is_some()
    }

    /// Transactions in the open group.
    pub fn transactions(&self) -> usize {
        self.open.as_ref().map_or(0, |open| open.transactions)
    }

    /// An upstream transaction of `bytes` was applied into the store transaction; once durable,
    /// upstream may be acknowledged up to `ack` (`None` for one that is never acknowledged,
    /// such as a backfill).
    pub fn applied(&mut self, ack: Option<P>, bytes: usize, now_us: u64) -> Decision {
        let open = self.open.get_or_insert(Open {
            transactions: 0,
            bytes: 0,
            opened_at_us: now_us,
            ack: None,
        });
        open.transactions += 1;
        open.bytes = open.bytes.saturating_add(bytes);
        open.ack = open.ack.take().max(ack);
        let full = open.transactions >= self.limits.max_transactions
            || open.bytes >= self.limits.max_bytes
            || now_us.saturating_sub(open.opened_at_us) >= self.limits.max_delay_us;
        if full {
            Decision::Flush
        } else {
            Decision::Hold
        }
    }

    /// Whether the open group has waited long enough that it is made durable before the next
    /// transaction starts (asked at a transaction's beginning).
    pub fn due(&self, now_us: u64) -> bool {
        self.open.as_ref().is_some_and(|open| {
            now_us.saturating_sub(open.opened_at_us) >= self.limits.max_delay_us
        })
    }

    /// When the open group must be made durable even if nothing more arrives (µs).
    pub fn deadline_us(&self) -> Option<u64> {
        self.open
            .as_ref()
            .map(|open| open.opened_at_us.saturating_add(self.limits.max_delay_us))
    }

    /// A position that needs no store of its own (a keepalive between transactions, a
    /// transaction the store already has): returned when it may be acknowledged now; with a
    /// group open it is acknowledged with the group instead.
    pub fn position(&mut self, ack: P) -> Option<P> {
        match self.open.as_mut() {
            Some(open) => {
                open.ack = open.ack.take().max(Some(ack));
                None
            }
            None => Some(ack),
        }
    }

    /// The store transaction of the open group committed durably: what to acknowledge.
    /// `None` when no group was open.
    pub fn durable(&mut self) -> Option<Durable<P>> {
        self.open.take().map(|open| Durable {
            transactions: open.transactions,
            bytes: open.bytes,
            ack: open.ack,
        })
    }

    /// The store transaction of the open group was rolled back (or never committed, after a
    /// failure): nothing of it may be acknowledged.
    pub fn discarded(&mut self) {
        self.open = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_transactions: usize, max_bytes: usize, max_delay_us: u64) -> GroupLimits {
        GroupLimits {
            max_transactions,
            max_bytes,
            max_delay_us,
        }
    }

    #[test]
    fn a_group_closes_at_its_transaction_count_and_acks_its_newest_position() {
        let mut group = GroupCommit::new(limits(3, usize::MAX, u64::MAX));
        assert_eq!(group.applied(Some(10u64), 1, 0), Decision::Hold);
        assert_eq!(group.applied(Some(20), 1, 0), Decision::Hold);
        assert_eq!(group.transactions(), 2);
        assert_eq!(group.applied(Some(30), 1, 0), Decision::Flush);
        assert_eq!(
            group.durable(),
            Some(Durable {
                transactions: 3,
                bytes: 3,
                ack: Some(30)
            })
        );
        assert!(!group.is_open());
        assert_eq!(group.durable(), None);
    }

    #[test]
    fn a_group_closes_at_its_byte_budget_and_at_its_delay() {
        let mut group = GroupCommit::new(limits(100, 1000, 5_000));
        assert_eq!(group.applied(Some(1u64), 600, 0), Decision::Hold);
        assert_eq!(group.applied(Some(2), 400, 10), Decision::Flush);
        group.durable();
        assert_eq!(group.applied(Some(3), 1, 100), Decision::Hold);
        assert!(!group.due(5_099));
        assert_eq!(group.deadline_us(), Some(5_100));
        assert!(group.due(5_100));
        assert_eq!(group.applied(Some(4), 1, 5_100), Decision::Flush);
    }

    #[test]
    fn one_transaction_per_group_turns_grouping_off() {
        let mut group = GroupCommit::new(limits(1, usize::MAX, u64::MAX));
        assert_eq!(group.applied(Some(1u64), 0, 0), Decision::Flush);
    }

    #[test]
    fn unacknowledged_transactions_never_lower_the_group_position() {
        let mut group = GroupCommit::new(GroupLimits::default());
        group.applied(Some(20u64), 1, 0);
        // A backfill in the group is stored but never acknowledged.
        group.applied(None, 1, 0);
        assert_eq!(group.durable().and_then(|d| d.ack), Some(20));
        group.applied(None, 1, 0);
        assert_eq!(group.durable().and_then(|d| d.ack), None);
    }

    #[test]
    fn positions_without_a_store_wait_for_an_open_group() {
        let mut group = GroupCommit::new(GroupLimits::default());
        assert_eq!(group.position(5u64), Some(5));
        group.applied(Some(10), 1, 0);
        assert_eq!(group.position(40), None);
        // Acks never move backwards.
        assert_eq!(group.position(7), None);
        assert_eq!(group.durable().and_then(|d| d.ack), Some(40));
        group.applied(Some(50), 1, 0);
        group.discarded();
        assert_eq!(group.durable(), None);
        assert_eq!(group.position(60), Some(60));
    }
}
