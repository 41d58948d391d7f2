//! Change-log purging (`docs/protocol/change-stream.md`, "Purging"): how far the log may be
//! cut, and when.

use std::collections::VecDeque;

use crate::watermark::Watermark;

/// Zero's purge delay after a new backup watermark: three times the subscribers' longest
/// reconnect backoff, so a subscriber that just dropped can reappear with its ack.
pub const DEFAULT_PURGE_DELAY_MS: u64 = 30_000;

/// The watermark below which change-log rows may be deleted: the minimum of the backup
/// watermark, every subscriber's acked watermark and every confirmed reservation, capped at the
/// newest stored transaction so that one is always kept.
pub fn purge_floor<'a>(
    backup: &'a Watermark,
    acks: impl IntoIterator<Item = &'a Watermark>,
    reserved: impl IntoIterator<Item = &'a Watermark>,
    newest_stored: &'a Watermark,
) -> &'a Watermark {
    acks.into_iter()
        .chain(reserved)
        .chain([backup, newest_stored])
        .min()
        .unwrap_or(newest_stored)
}

/// Backup watermarks waiting out the purge delay.
#[derive(Debug, Clone, Default)]
pub struct PurgeSchedule {
    /// The newest backup watermark seen.
    backup: Option<Watermark>,
    /// `(due_ms, backup watermark)`, oldest first.
    pending: VecDeque<(u64, Watermark)>,
    /// The last `below` handed out, so a purge is only asked for when it deletes more.
    purged_below: Option<Watermark>,
}

impl PurgeSchedule {
    /// The newest backup watermark seen.
    pub fn backup(&self) -> Option<&Watermark> {
        self.backup.as_ref()
    }

    /// Records a backup watermark; earlier or repeated ones are ignored. Returns whether it
    /// was new.
    pub fn on_backup(&mut self, watermark: Watermark, now_ms: u64, delay_ms: u64) -> bool {
        if self.backup.as_ref().is_some_and(|b| *b >= watermark) {
            return false;
        }
        self.backup = Some(watermark.clone());
        self.pending
            .push_back((now_ms.saturating_add(delay_ms), watermark));
        true
    }

    /// The newest backup watermark whose delay has passed, if any (taking it out).
    pub fn take_due(&mut self, now_ms: u64) -> Option<Watermark> {
        let mut due = None;
        while self.pending.front().is_some_and(|(at, _)| *at <= now_ms) {
            due = self.pending.pop_front().map(|(_, w)| w);
        }
        due
    }

    /// When the next backup watermark becomes usable.
    pub fn next_due(&self) -> Option<u64> {
        self.pending.front().map(|(at, _)| *at)
    }

    /// Whether purging below `below` would delete anything not already asked for; records it.
    pub fn advance(&mut self, below: &Watermark) -> bool {
        if self.purged_below.as_ref().is_some_and(|p| p >= below) {
            return false;
        }
        self.purged_below = Some(below.clone());
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(text: &str) -> Watermark {
        Watermark::parse(text).expect("watermark")
    }

    #[test]
    fn purge_floor_is_the_minimum_of_backup_acks_and_reservations() {
        let (b, newest) = (w("0m"), w("0z"));
        let acks = [w("0p"), w("0k")];
        assert_eq!(purge_floor(&b, &acks, [], &newest), &w("0k"));
        let reserved = [w("0c")];
        assert_eq!(purge_floor(&b, &acks, &reserved, &newest), &w("0c"));
        // No subscribers and no reservations: the backup alone decides.
        assert_eq!(purge_floor(&b, [], [], &newest), &b);
    }

    #[test]
    fn newest_transaction_is_always_kept() {
        // Everyone is past the newest stored transaction; deleting below it keeps it.
        let newest = w("0f");
        assert_eq!(purge_floor(&w("0z"), &[w("0z")], [], &newest), &newest);
    }

    #[test]
    fn purge_waits_out_the_delay_after_a_new_backup_watermark() {
        let mut schedule = PurgeSchedule::default();
        assert!(schedule.on_backup(w("0a"), 1_000, DEFAULT_PURGE_DELAY_MS));
        assert!(!schedule.on_backup(w("0a"), 2_000, DEFAULT_PURGE_DELAY_MS));
        assert!(!schedule.on_backup(w("09"), 2_000, DEFAULT_PURGE_DELAY_MS));
        assert!(schedule.on_backup(w("0b"), 5_000, DEFAULT_PURGE_DELAY_MS));
        assert_eq!(schedule.backup(), Some(&w("0b")));
        assert_eq!(schedule.next_due(), Some(31_000));
        assert_eq!(schedule.take_due(30_999), None);
        assert_eq!(schedule.take_due(31_000), Some(w("0a")));
        assert_eq!(schedule.take_due(40_000), Some(w("0b")));
        assert_eq!(schedule.next_due(), None);
    }

    #[test]
    fn a_purge_is_only_asked_for_when_it_deletes_more() {
        let mut schedule = PurgeSchedule::default();
        assert!(schedule.advance(&w("0a")));
        assert!(!schedule.advance(&w("0a")));
        assert!(!schedule.advance(&w("09")));
        assert!(schedule.advance(&w("0b")));
    }
}
