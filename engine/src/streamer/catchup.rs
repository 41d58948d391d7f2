//! Catch-up from the change log (`docs/protocol/change-stream.md`, "Catch-up"): the rows a
//! subscriber is sent before it goes live, and whether its watermark can be served at all.

use crate::watermark::Watermark;

/// One change-log row, in `(watermark, pos)` order, as the host reads it for a catch-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatchupRow {
    /// The commit watermark of the row's transaction.
    pub watermark: Watermark,
    /// The inner `tag` of the stored change (`"begin"`, `"insert"`, …, `"commit"`).
    pub tag: String,
    /// The stored change: the second element of the downstream tuple, as JSON text.
    pub change: String,
}

impl CatchupRow {
    pub fn new(watermark: Watermark, tag: impl Into<String>, change: impl Into<String>) -> Self {
        CatchupRow {
            watermark,
            tag: tag.into(),
            change: change.into(),
        }
    }
}

/// What the first catch-up row says about a subscriber's watermark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FirstRow {
    /// The log holds the subscriber's own transaction: everything after it can be sent.
    Continuous,
    /// The log starts after the subscriber's watermark: the subscriber gets `WatermarkTooOld`,
    /// whatever its mode.
    TooOld { earliest: Watermark },
}

/// Judges the first row a catch-up from `requested` read (`change-stream.md`, "Catch-up",
/// step 4). The row must be the subscriber's own, already applied transaction.
///
/// Zero also accepts `replicaVersion` whatever the first row is. Highwater does not: a log seeded
/// at `replicaVersion` still holds its seed rows there (so the rule above accepts it), and a log
/// that no longer does — purged past them, or a relay's log seeded at its restored snapshot —
/// lacks changes such a subscriber needs, so accepting it would lose them silently.
///
/// Zero answers a `mode=backup` subscriber with this gap by marking its change log
/// reset-required and stopping, because there the backup replicator is the one copy a
/// restart restores from. Highwater's backup is its own replica (the server reports its
/// durable position itself and `/replica/snapshot` serves it), so a backup-mode subscriber
/// from the network is never the source of truth, and anyone who can reach the port could
/// otherwise wipe the server with `mode=backup&watermark=00`. The gap is therefore the
/// subscriber's error in every mode; a reset needs an operator (`--auto-reset`, a new data
/// directory).
pub fn check_first_row(first: &Watermark, requested: &Watermark) -> FirstRow {
    if first <= requested {
        return FirstRow::Continuous;
    }
    FirstRow::TooOld {
        earliest: first.clone(),
    }
}

/// `WatermarkTooOld`'s message (`change-stream.md`, "Errors and close codes").
pub fn too_old_message(earliest: &Watermark, requested: &Watermark) -> String {
    format!("earliest supported watermark is {earliest} (requested {requested})")
}

/// `WrongReplicaVersion`'s message (`change-stream.md`, "Errors and close codes").
pub fn wrong_replica_version_message(current: &Watermark, requested: &Watermark) -> String {
    format!("current replica version is {current} (requested {requested})")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(text: &str) -> Watermark {
        Watermark::parse(text).expect("watermark")
    }

    #[test]
    fn first_row_at_the_subscriber_watermark_is_continuous() {
        assert_eq!(check_first_row(&w("0a"), &w("0a")), FirstRow::Continuous);
    }

    #[test]
    fn replica_version_needs_its_seed_rows_like_any_watermark() {
        // Seed rows at the replica version 01: continuous.
        assert_eq!(check_first_row(&w("01"), &w("01")), FirstRow::Continuous);
        // Purged past them (or a relay's log seeded at its snapshot 0f): the changes between
        // are gone, so the subscriber is told instead of silently missing them.
        assert_eq!(
            check_first_row(&w("0f"), &w("01")),
            FirstRow::TooOld { earliest: w("0f") }
        );
    }

    #[test]
    fn watermark_too_old_is_the_same_answer_in_every_mode() {
        assert_eq!(
            check_first_row(&w("0f"), &w("0a")),
            FirstRow::TooOld { earliest: w("0f") }
        );
        assert_eq!(
            too_old_message(&w("0f"), &w("0a")),
            "earliest supported watermark is 0f (requested 0a)"
        );
        assert_eq!(
            wrong_replica_version_message(&w("01"), &w("02")),
            "current replica version is 01 (requested 02)"
        );
    }
}
