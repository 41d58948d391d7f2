//! Snapshot reservations (`docs/protocol/change-stream.md`, "Reservations and snapshots"): a
//! task restoring a backup pins the change log until it subscribes.

use indexmap::IndexMap;

use super::ConnId;
use crate::change_stream::Reserved;
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

/// Why a snapshot downloaded for a reservation cannot seed a replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotMismatch {
    pub expected: String,
    pub found: String,
}

/// Whether a snapshot downloaded for `reserved` may seed the client's replica
/// (`docs/protocol/change-stream.md`, "Reservations and snapshots", step 3): it holds the
/// reserved replica version, a watermark at or after `minWatermark`, and what its headers
/// claimed (`claimed_watermark`, `claimed_version`, when sent) is what it holds.
pub fn check_restored_snapshot(
    reserved: &Reserved,
    replica_version: &Watermark,
    watermark: &Watermark,
    claimed_watermark: Option<&str>,
    claimed_version: Option<&str>,
) -> Result<(), SnapshotMismatch> {
    if *replica_version != reserved.replica_version {
        return Err(SnapshotMismatch {
            expected: format!("replica version {}", reserved.replica_version),
            found: format!("a snapshot of replica version {replica_version}"),
        });
    }
    if *watermark < reserved.min_watermark {
        return Err(SnapshotMismatch {
            expected: format!("a snapshot at or after {}", reserved.min_watermark),
            found: format!("a snapshot at {watermark}"),
        });
    }
    let claimed = [
        (claimed_watermark, watermark),
        (claimed_version, replica_version),
    ];
    for (header, actual) in claimed {
        if let Some(header) = header.filter(|h| *h != actual.as_str()) {
            return Err(SnapshotMismatch {
                expected: format!("the snapshot's content at {header}, as its headers say"),
                found: format!("content at {actual}"),
            });
        }
    }
    Ok(())
}

/// Where the change log of a replica restored from a snapshot at `watermark` starts: `Some`
/// when the snapshot is past its replica version, and the log must then hold an empty
/// transaction at `watermark` and nothing before it. A log seeded at the replica version would
/// claim to serve the changes between the two, which it does not hold; the snapshot's watermark
/// is the only point from which it can catch its own subscribers up.
pub fn restored_log_start(replica_version: &Watermark, watermark: &Watermark) -> Option<Watermark> {
    (watermark > replica_version).then(|| watermark.clone())
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

    fn reserved(version: &str, min: &str) -> Reserved {
        Reserved {
            backup_url: "http://primary/replica/snapshot".to_owned(),
            replica_version: w(version),
            min_watermark: w(min),
            replica_size: None,
            extra: Default::default(),
        }
    }

    #[test]
    fn a_snapshot_seeds_a_replica_only_at_the_reserved_version_and_not_before_the_backup() {
        let r = reserved("0a", "0c");
        assert_eq!(
            check_restored_snapshot(&r, &w("0a"), &w("0c"), None, None),
            Ok(())
        );
        assert_eq!(
            check_restored_snapshot(&r, &w("0a"), &w("0d"), Some("0d"), Some("0a")),
            Ok(())
        );
        let other_version = check_restored_snapshot(&r, &w("0b"), &w("0d"), None, None);
        assert_eq!(
            other_version.expect_err("another replica version").expected,
            "replica version 0a"
        );
        let too_old = check_restored_snapshot(&r, &w("0a"), &w("0b"), None, None);
        assert_eq!(
            too_old.expect_err("before the backup").found,
            "a snapshot at 0b"
        );
    }

    #[test]
    fn a_snapshot_whose_headers_claim_other_content_is_refused() {
        let r = reserved("0a", "0c");
        let watermark = check_restored_snapshot(&r, &w("0a"), &w("0d"), Some("0e"), None);
        assert_eq!(
            watermark.expect_err("another watermark").found,
            "content at 0d"
        );
        let version = check_restored_snapshot(&r, &w("0a"), &w("0d"), None, Some("0b"));
        assert_eq!(version.expect_err("another version").found, "content at 0a");
    }

    #[test]
    fn a_restored_log_starts_at_the_snapshot_when_it_is_past_the_replica_version() {
        assert_eq!(restored_log_start(&w("0a"), &w("0a")), None);
        assert_eq!(restored_log_start(&w("0a"), &w("0d")), Some(w("0d")));
    }
}
