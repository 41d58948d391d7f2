//! Snapshot reservations (`docs/protocol/change-stream.md`, "Reservations and snapshots"): a
//! task restoring a backup pins the change log until it subscribes.

use indexmap::IndexMap;

use super::ConnId;
use crate::watermark::Watermark;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Reservation {
    /// The connection that asked, and gets the confirmation.
    holder: ConnId,
    /// The watermark advertised as `minWatermark` once confirmed; pins the log from then on.
    confirmed: Option<Watermark>,
}

/// The open reservations, one per task.
#[derive(Debug, Clone, Default)]
pub struct Reservations {
    by_task: IndexMap<String, Reservation>,
}

impl Reservations {
    /// Opens a reservation for `task_id`, replacing any older one of the same task. Returns the
    /// holder of the replaced reservation.
    pub fn open(&mut self, task_id: &str, holder: ConnId) -> Option<ConnId> {
        let reservation = Reservation {
            holder,
            confirmed: None,
        };
        self.by_task
            .insert(task_id.to_owned(), reservation)
            .map(|old| old.holder)
    }

    /// Confirms every unconfirmed reservation when the change log covers the backup at
    /// `backup` (its earliest entry is not after it); the advertised `minWatermark` is the
    /// backup's. Returns `(task, holder)` of the newly confirmed ones; confirmed ones are never
    /// confirmed again.
    pub fn confirm(&mut self, backup: &Watermark, log_min: &Watermark) -> Vec<(String, ConnId)> {
        if log_min > backup {
            return Vec::new();
        }
        self.by_task
            .iter_mut()
            .filter(|(_, r)| r.confirmed.is_none())
            .map(|(task, r)| {
                r.confirmed = Some(backup.clone());
                (task.clone(), r.holder)
            })
            .collect()
    }

    /// Ends the reservation of `task_id` (its subscriber is registered). Returns its holder.
    pub fn release(&mut self, task_id: &str) -> Option<ConnId> {
        self.by_task.shift_remove(task_id).map(|r| r.holder)
    }

    /// Cancels the reservations held by a closed connection.
    pub fn cancel_held_by(&mut self, holder: ConnId) {
        self.by_task.retain(|_, r| r.holder != holder);
    }

    /// Whether `holder` holds a reservation.
    #[cfg(test)]
    pub fn is_held_by(&self, holder: ConnId) -> bool {
        self.by_task.values().any(|r| r.holder == holder)
    }

    /// Watermarks pinned by confirmed reservations.
    pub fn reserved_watermarks(&self) -> impl Iterator<Item = &Watermark> {
        self.by_task.values().filter_map(|r| r.confirmed.as_ref())
    }

    pub fn len(&self) -> usize {
        self.by_task.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_task.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(text: &str) -> Watermark {
        Watermark::parse(text).expect("watermark")
    }

    #[test]
    fn open_replaces_an_older_reservation_of_the_same_task() {
        let mut r = Reservations::default();
        assert_eq!(r.open("t1", ConnId(1)), None);
        assert_eq!(r.open("t2", ConnId(2)), None);
        assert_eq!(r.open("t1", ConnId(3)), Some(ConnId(1)));
        assert_eq!(r.len(), 2);
        assert!(!r.is_held_by(ConnId(1)));
        assert!(r.is_held_by(ConnId(3)));
    }

    #[test]
    fn confirm_waits_until_the_log_covers_the_backup() {
        let mut r = Reservations::default();
        r.open("t1", ConnId(1));
        // The log starts after the backup: keep waiting for a later backup.
        assert!(r.confirm(&w("0a"), &w("0c")).is_empty());
        assert_eq!(r.reserved_watermarks().count(), 0);
        assert_eq!(
            r.confirm(&w("0d"), &w("0c")),
            [("t1".to_owned(), ConnId(1))]
        );
        assert_eq!(r.reserved_watermarks().collect::<Vec<_>>(), [&w("0d")]);
    }

    #[test]
    fn confirm_is_idempotent() {
        let mut r = Reservations::default();
        r.open("t1", ConnId(1));
        assert_eq!(r.confirm(&w("0d"), &w("0c")).len(), 1);
        assert!(r.confirm(&w("0e"), &w("0c")).is_empty());
        // The advertised watermark stays the one confirmed.
        assert_eq!(r.reserved_watermarks().collect::<Vec<_>>(), [&w("0d")]);
        r.open("t2", ConnId(2));
        assert_eq!(
            r.confirm(&w("0e"), &w("0c")),
            [("t2".to_owned(), ConnId(2))]
        );
    }

    #[test]
    fn release_and_cancel_end_reservations() {
        let mut r = Reservations::default();
        r.open("t1", ConnId(1));
        r.open("t2", ConnId(2));
        assert_eq!(r.release("t1"), Some(ConnId(1)));
        assert_eq!(r.release("t1"), None);
        r.cancel_held_by(ConnId(2));
        assert!(r.is_empty());
    }
}
