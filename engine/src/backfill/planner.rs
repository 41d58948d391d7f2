//! Which backfill a change source runs next, with which columns, and when a failed one is
//! tried again.
//!
//! A change source that reads backfills from upstream itself (the server's
//! `replication/backfill.rs`) runs one at a time, between upstream transactions, as a
//! synthetic transaction at the next minor version after the consumer's position
//! (`docs/protocol/change-stream.md`, "Watermarks"). [`BackfillPlanner`] chooses it from the
//! replica's pending backfills and remembers what the runs reported:
//!
//! * columns upstream lacked at a snapshot ([`BackfillPlanner::on_missing`]) wait until the
//!   consumer passes that snapshot (a schema change in between may still rename or drop
//!   them); past it, they are settled: completed without values if upstream still lacks them;
//! * without its key no row can be matched: a table whose key column waits, waits as a whole;
//! * the same plan at the same position is not handed out twice (a run that changed nothing
//!   would only be repeated);
//! * a failed table ([`BackfillPlanner::on_failed`]) is held until the consumer's next
//!   transaction or until its retry delay passed (a quiet database has no next transaction);
//!   the delays grow while backfills keep failing and start over after one that committed
//!   ([`BackfillPlanner::on_completed`]).
//!
//! It is a pure state machine: the pending backfills and the consumer's position come in as
//! values, time as `now_ms` on the caller's clock. The server adds what only it has (the
//! table's schema, the transactions the snapshot must see, publications) to run a plan; the
//! simulation (`sim/`) drives the same planner on its virtual clock.

use std::collections::BTreeMap;

use crate::backoff::{Backoff, BackoffPolicy};
use crate::watermark::Watermark;

/// Retry delays of failed backfills: at least a second, at most a minute (full jitter above
/// the floor, so servers that lost the same Postgres do not retry together).
pub const BACKFILL_RETRY: BackoffPolicy = BackoffPolicy {
    initial_ms: 1_000,
    max_ms: 60_000,
};

/// The shortest delay before a failed backfill is tried again without a transaction between.
pub const BACKFILL_RETRY_FLOOR_MS: u64 = 1_000;

/// One table's pending backfill, as the replica records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingBackfill {
    /// The replica's name of the table.
    pub table: String,
    /// The table's key columns.
    pub key: Vec<String>,
    /// Non-key columns to backfill; every non-key column for a whole-table backfill.
    pub columns: Vec<String>,
    /// Whether the table itself is new to the replica (its rows must be inserted).
    pub whole_table: bool,
    /// Whether a key column itself awaits a backfill (a retyped key): completing the backfill
    /// clears it, so the table has something to run even when no other column does.
    pub key_backfilling: bool,
}

/// The backfill to run next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackfillPlan {
    /// The table's pending backfill, less the columns that wait (upstream lacked them at a
    /// snapshot the consumer has not passed yet); `pending.table` is the table.
    pub pending: PendingBackfill,
    /// Columns (of `pending`, key included) to complete without values if upstream no longer
    /// has them: the consumer has passed the snapshot where they were first found missing, so
    /// no schema change in the stream will rename or drop them.
    pub settle: Vec<String>,
    /// The synthetic transaction's watermark: the next minor version after the consumer's
    /// position.
    pub commit_watermark: Watermark,
}

/// A backfill that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failed {
    /// The consumer's last commit when it failed.
    position: Watermark,
    /// When (caller's ms) it may be tried again at that position.
    retry_at_ms: u64,
}

/// What was handed out for a table: the position, the columns to run and those to settle.
type HandedOut = (Watermark, Vec<String>, Vec<String>);

/// Chooses the next backfill to run and remembers what upstream cannot serve yet.
#[derive(Debug, Clone)]
pub struct BackfillPlanner {
    /// `(table, column)` → the snapshot where upstream first lacked the column.
    missing: BTreeMap<(String, String), Watermark>,
    /// Table → where and when its backfill failed: tried again after the next transaction, or
    /// once its retry delay passed.
    failed: BTreeMap<String, Failed>,
    /// Table → the last plan handed out for it: the same plan at the same position again would
    /// only repeat a run that changed nothing.
    handed_out: BTreeMap<String, HandedOut>,
    /// Delays between attempts while backfills keep failing; reset by one that commits.
    retries: Backoff,
}

impl BackfillPlanner {
    /// A planner whose retry delays are drawn from `seed` (the jitter only needs to differ
    /// between servers).
    pub fn new(seed: u64) -> Self {
        BackfillPlanner {
            missing: BTreeMap::new(),
            failed: BTreeMap::new(),
            handed_out: BTreeMap::new(),
            retries: Backoff::new(BACKFILL_RETRY, seed),
        }
    }

    /// The next of `pending` (the replica's pending backfills, in the order to try them) to
    /// run as a transaction after `position` (the consumer's last commit), or `None` when
    /// there is nothing to run now. With nothing pending, everything remembered is forgotten.
    pub fn next(
        &mut self,
        pending: &[PendingBackfill],
        position: &Watermark,
    ) -> Option<BackfillPlan> {
        if pending.is_empty() {
            self.missing.clear();
            self.failed.clear();
            self.handed_out.clear();
            return None;
        }
        let is_pending = |table: &str, column: &str| {
            pending
                .iter()
                .any(|p| p.table == table && p.key.iter().chain(&p.columns).any(|c| c == column))
        };
        self.missing
            .retain(|(table, column), _| is_pending(table, column));
        self.failed.retain(|table, failed| {
            pending.iter().any(|p| p.table == *table) && failed.position >= *position
        });
        for p in pending {
            if self.failed.contains_key(&p.table) {
                continue;
            }
            let missing_since =
                |column: &String| self.missing.get(&(p.table.clone(), column.clone()));
            // Missing at a snapshot the consumer has not passed yet: a schema change in between
            // may still rename or drop it.
            let waiting = |c: &String| missing_since(c).is_some_and(|at| at > position);
            let settle: Vec<String> = p
                .key
                .iter()
                .chain(&p.columns)
                .filter(|c| missing_since(c).is_some_and(|at| at <= position))
                .cloned()
                .collect();
            // Without its key no row can be matched: the table waits as a whole.
            let runnable = !p.key.iter().any(waiting)
                && (p.columns.iter().any(|c| !waiting(c)) || p.whole_table || p.key_backfilling);
            if !runnable {
                continue;
            }
            let mut plan_pending = p.clone();
            plan_pending.columns.retain(|c| !waiting(c));
            let handed = (
                position.clone(),
                plan_pending.columns.clone(),
                settle.clone(),
            );
            if self.handed_out.get(&p.table) == Some(&handed) {
                continue;
            }
            self.handed_out.insert(p.table.clone(), handed);
            return Some(BackfillPlan {
                pending: plan_pending,
                settle,
                commit_watermark: next_minor(position),
            });
        }
        None
    }

    /// Upstream lacked `columns` of `table` at `snapshot`; a later snapshot that also lacks
    /// one does not push its settling back.
    pub fn on_missing(&mut self, table: &str, columns: &[String], snapshot: &Watermark) {
        for column in columns {
            self.missing
                .entry((table.to_owned(), column.clone()))
                .or_insert_with(|| snapshot.clone());
        }
    }

    /// The backfill of `table` failed at `position` (the consumer's last commit), at `now_ms`:
    /// not tried again before the next transaction or its retry delay
    /// ([`BackfillPlanner::retry_at_ms`]).
    pub fn on_failed(&mut self, table: &str, position: &Watermark, now_ms: u64) {
        let delay = self.retries.next_delay_ms(BACKFILL_RETRY_FLOOR_MS);
        self.failed.insert(
            table.to_owned(),
            Failed {
                position: position.clone(),
                retry_at_ms: now_ms.saturating_add(delay),
            },
        );
        // The failed run changed nothing, and the same plan at the same position is what the
        // retry runs.
        self.handed_out.remove(table);
    }

    /// A backfill committed: the next failure waits the shortest delay again.
    pub fn on_completed(&mut self) {
        self.retries.reset();
    }

    /// When (caller's ms) the next failed backfill may be tried again without a transaction
    /// in between; `None` when none waits.
    pub fn retry_at_ms(&self) -> Option<u64> {
        self.failed.values().map(|failed| failed.retry_at_ms).min()
    }

    /// Releases the failed backfills whose delay has passed at `now_ms`, for the next
    /// [`BackfillPlanner::next`]; `true` if it released any.
    pub fn release_due(&mut self, now_ms: u64) -> bool {
        let before = self.failed.len();
        self.failed.retain(|_, failed| failed.retry_at_ms > now_ms);
        self.failed.len() < before
    }
}

/// `position.minor + 1` (`change-stream.md`, "Watermarks").
fn next_minor(position: &Watermark) -> Watermark {
    position
        .state_version()
        .next_minor()
        .to_watermark()
        // Only a minor of 36 base-36 digits could overflow.
        .unwrap_or_else(|| position.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::watermark::Lsn;

    fn w(n: u64) -> Watermark {
        Lsn(n).to_watermark()
    }

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    /// `item (id, name)` with a column `c` added with a backfill.
    fn item_waiting_for(columns: &[&str]) -> PendingBackfill {
        PendingBackfill {
            table: "item".into(),
            key: names(&["id"]),
            columns: names(columns),
            whole_table: false,
            key_backfilling: false,
        }
    }

    fn item_waiting_for_c() -> Vec<PendingBackfill> {
        vec![item_waiting_for(&["c"])]
    }

    #[test]
    fn a_plan_is_a_transaction_at_the_next_minor_version_of_the_position() {
        let mut planner = BackfillPlanner::new(1);
        let plan = planner.next(&item_waiting_for_c(), &w(0x200)).unwrap();
        assert_eq!(
            plan.commit_watermark,
            w(0x200)
                .state_version()
                .next_minor()
                .to_watermark()
                .unwrap()
        );
        assert!(w(0x200) < plan.commit_watermark && plan.commit_watermark < w(0x201));
        assert_eq!(plan.pending, item_waiting_for(&["c"]));
        assert!(plan.settle.is_empty());
        // A second backfill at the same position sorts after the first.
        let next = planner
            .next(&[item_waiting_for(&["d"])], &plan.commit_watermark)
            .unwrap();
        assert!(plan.commit_watermark < next.commit_watermark && next.commit_watermark < w(0x201));
    }

    /// A column upstream no longer has waits for the stream to pass the snapshot where it was
    /// missing (a rename or drop in between would reach the replica); past it, it is settled.
    #[test]
    fn a_missing_column_waits_until_the_stream_passes_its_snapshot_then_is_settled() {
        let pending = item_waiting_for_c();
        let mut planner = BackfillPlanner::new(1);
        assert!(planner.next(&pending, &w(0x200)).is_some());
        planner.on_missing("item", &names(&["c"]), &w(0x500));
        assert_eq!(planner.next(&pending, &w(0x200)), None);
        assert_eq!(planner.next(&pending, &w(0x4ff)), None);
        // A later snapshot that also misses it does not push the settling back.
        planner.on_missing("item", &names(&["c"]), &w(0x600));
        let plan = planner.next(&pending, &w(0x500)).unwrap();
        assert_eq!(plan.pending.columns, names(&["c"]));
        assert_eq!(plan.settle, names(&["c"]));
    }

    /// Add a column, then rename it: the first backfill finds it missing upstream; the rename
    /// reaches the replica before the stream passes that snapshot, and the renamed column is
    /// backfilled at once rather than lost.
    #[test]
    fn a_renamed_missing_column_is_backfilled_under_its_new_name() {
        let mut planner = BackfillPlanner::new(1);
        planner.on_missing("item", &names(&["c"]), &w(0x500));
        let plan = planner
            .next(&[item_waiting_for(&["d"])], &w(0x300))
            .unwrap();
        assert_eq!(plan.pending.columns, names(&["d"]));
        assert!(plan.settle.is_empty());
        // `c` was forgotten with the rename: pending again (added anew), it runs at once.
        let plan = planner
            .next(&[item_waiting_for(&["c"])], &w(0x300))
            .unwrap();
        assert_eq!(plan.pending.columns, names(&["c"]));
    }

    /// The columns that wait are left out of the plan; the others of the table run.
    #[test]
    fn a_waiting_column_is_left_out_while_the_others_run() {
        let pending = vec![item_waiting_for(&["c", "d"])];
        let mut planner = BackfillPlanner::new(1);
        planner.on_missing("item", &names(&["c"]), &w(0x500));
        let plan = planner.next(&pending, &w(0x200)).unwrap();
        assert_eq!(plan.pending.columns, names(&["d"]));
        assert!(plan.settle.is_empty());
        // Past the snapshot both run, `c` to be settled.
        let plan = planner.next(&pending, &w(0x500)).unwrap();
        assert_eq!(plan.pending.columns, names(&["c", "d"]));
        assert_eq!(plan.settle, names(&["c"]));
    }

    /// Without its key no row can be matched: a table whose key waits waits as a whole, even
    /// with columns that could run; past the snapshot the key is settled with them.
    #[test]
    fn a_missing_key_holds_the_whole_table() {
        let pending = vec![item_waiting_for(&["c"])];
        let mut planner = BackfillPlanner::new(1);
        planner.on_missing("item", &names(&["id"]), &w(0x500));
        assert_eq!(planner.next(&pending, &w(0x200)), None);
        let plan = planner.next(&pending, &w(0x500)).unwrap();
        assert_eq!(plan.pending.columns, names(&["c"]));
        assert_eq!(plan.settle, names(&["id"]));
    }

    /// A table whose every non-key column waits still runs when it is new to the replica (its
    /// rows must be inserted) or when its key itself awaits a backfill; otherwise it waits.
    #[test]
    fn a_table_with_every_column_waiting_runs_only_for_its_rows_or_its_key() {
        let at = w(0x200);
        let with = |whole_table, key_backfilling| PendingBackfill {
            whole_table,
            key_backfilling,
            ..item_waiting_for(&["c"])
        };
        for (whole_table, key_backfilling, runs) in [
            (false, false, false),
            (true, false, true),
            (false, true, true),
            (true, true, true),
        ] {
            let mut planner = BackfillPlanner::new(1);
            planner.on_missing("item", &names(&["c"]), &w(0x500));
            let plan = planner.next(&[with(whole_table, key_backfilling)], &at);
            assert_eq!(plan.is_some(), runs, "{whole_table} {key_backfilling}");
            if let Some(plan) = plan {
                assert!(plan.pending.columns.is_empty());
                assert!(plan.settle.is_empty());
            }
        }
    }

    /// A run that changed nothing (its producer found nothing to do) is not repeated at the
    /// same position: no loop of snapshots.
    #[test]
    fn the_same_plan_is_not_handed_out_twice_at_one_position() {
        let pending = item_waiting_for_c();
        let mut planner = BackfillPlanner::new(1);
        assert!(planner.next(&pending, &w(0x200)).is_some());
        assert_eq!(planner.next(&pending, &w(0x200)), None);
        assert!(planner.next(&pending, &w(0x300)).is_some());
    }

    /// At one position, a run that learnt something (a column missing at a snapshot the
    /// consumer passed) is followed by the different plan that settles it.
    #[test]
    fn a_different_plan_at_the_same_position_is_handed_out() {
        let pending = item_waiting_for_c();
        let mut planner = BackfillPlanner::new(1);
        assert!(planner.next(&pending, &w(0x300)).unwrap().settle.is_empty());
        planner.on_missing("item", &names(&["c"]), &w(0x200));
        let plan = planner.next(&pending, &w(0x300)).unwrap();
        assert_eq!(plan.settle, names(&["c"]));
        assert_eq!(planner.next(&pending, &w(0x300)), None);
    }

    /// A table that waits or is held does not hold the others back: the next one runs.
    #[test]
    fn a_held_table_lets_the_next_one_run() {
        let other = PendingBackfill {
            table: "other".into(),
            ..item_waiting_for(&["x"])
        };
        let pending = vec![item_waiting_for(&["c"]), other];
        let mut planner = BackfillPlanner::new(1);
        assert_eq!(
            planner.next(&pending, &w(0x200)).unwrap().pending.table,
            "item"
        );
        planner.on_failed("item", &w(0x200), 0);
        assert_eq!(
            planner.next(&pending, &w(0x200)).unwrap().pending.table,
            "other"
        );
        assert_eq!(planner.next(&pending, &w(0x200)), None);
    }

    #[test]
    fn a_failed_backfill_is_retried_after_the_next_transaction() {
        let pending = item_waiting_for_c();
        let mut planner = BackfillPlanner::new(1);
        assert!(planner.next(&pending, &w(0x200)).is_some());
        planner.on_failed("item", &w(0x200), 0);
        assert!(planner.retry_at_ms().is_some());
        assert_eq!(planner.next(&pending, &w(0x200)), None);
        assert!(planner.next(&pending, &w(0x300)).is_some());
        assert_eq!(
            planner.retry_at_ms(),
            None,
            "nothing waits once it ran again"
        );
    }

    /// With no transaction after it (a quiet database), a failed backfill runs again once its
    /// delay passed, at the same position, and the delays grow while it keeps failing.
    #[test]
    fn a_failed_backfill_is_retried_after_its_delay_without_a_transaction() {
        let pending = item_waiting_for_c();
        let mut planner = BackfillPlanner::new(7);
        let mut now = 1_000_000;
        let mut delays = Vec::new();
        for _ in 0..8 {
            assert!(planner.next(&pending, &w(0x200)).is_some());
            planner.on_failed("item", &w(0x200), now);
            let retry_at = planner.retry_at_ms().unwrap();
            let delay = retry_at - now;
            assert!((1_000..=60_000).contains(&delay), "{delay}");
            delays.push(delay);
            assert!(!planner.release_due(retry_at - 1));
            assert_eq!(planner.next(&pending, &w(0x200)), None);
            assert!(planner.release_due(retry_at));
            assert_eq!(planner.retry_at_ms(), None);
            now = retry_at;
        }
        // Full jitter above the floor: the later windows are wider than the first.
        assert!(delays[4..].iter().any(|d| *d > 2_000), "{delays:?}");
        // One that commits resets the delays.
        planner.on_completed();
        assert!(planner.next(&pending, &w(0x200)).is_some());
        planner.on_failed("item", &w(0x200), now);
        assert!(planner.retry_at_ms().unwrap() - now <= 2_000);
    }

    /// Several failed tables: the earliest delay is the one to wait for, and each is released
    /// only once its own delay passed.
    #[test]
    fn each_failed_table_is_released_at_its_own_time() {
        let other = PendingBackfill {
            table: "other".into(),
            ..item_waiting_for(&["x"])
        };
        let pending = vec![item_waiting_for(&["c"]), other];
        let mut planner = BackfillPlanner::new(3);
        planner.next(&pending, &w(0x200)).unwrap();
        planner.on_failed("item", &w(0x200), 0);
        let first = planner.retry_at_ms().unwrap();
        planner.next(&pending, &w(0x200)).unwrap();
        planner.on_failed("other", &w(0x200), first);
        assert_eq!(planner.retry_at_ms(), Some(first));
        assert!(planner.release_due(first));
        let second = planner.retry_at_ms().unwrap();
        assert!(second > first);
        assert_eq!(
            planner.next(&pending, &w(0x200)).unwrap().pending.table,
            "item"
        );
        assert_eq!(
            planner.next(&pending, &w(0x200)),
            None,
            "`other` is still held"
        );
        assert!(planner.release_due(second));
        assert_eq!(
            planner.next(&pending, &w(0x200)).unwrap().pending.table,
            "other"
        );
    }

    /// A failed table that is no longer pending (dropped, or completed by another run) holds
    /// nothing; with nothing pending at all, every note is forgotten.
    #[test]
    fn what_is_no_longer_pending_is_forgotten() {
        let other = PendingBackfill {
            table: "other".into(),
            ..item_waiting_for(&["x"])
        };
        let mut planner = BackfillPlanner::new(1);
        planner.next(&item_waiting_for_c(), &w(0x200)).unwrap();
        planner.on_failed("item", &w(0x200), 0);
        assert!(planner
            .next(std::slice::from_ref(&other), &w(0x200))
            .is_some());
        assert_eq!(planner.retry_at_ms(), None);

        planner.on_missing("item", &names(&["c"]), &w(0x500));
        planner.on_failed("other", &w(0x200), 0);
        assert_eq!(planner.next(&[], &w(0x200)), None);
        assert_eq!(planner.retry_at_ms(), None);
        // `c` pending again (added anew) and `other` both run at once.
        let pending = vec![item_waiting_for(&["c"]), other];
        assert_eq!(
            planner.next(&pending, &w(0x200)).unwrap().pending.table,
            "item"
        );
        assert_eq!(
            planner.next(&pending, &w(0x200)).unwrap().pending.table,
            "other"
        );
    }
}
