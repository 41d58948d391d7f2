//! How a backfilled row meets the replica (`docs/protocol/change-stream.md`, "Backfills",
//! "Applying"): which of its values the replica takes, whether a row it lacks is inserted, and
//! at which version each write leaves the row.
//!
//! A replica reads what it knows of the table and of each row (the versions of its truncate,
//! of the row's tombstone, of the stream's writes to its backfilling columns) and carries out
//! the [`RowMerge`] it gets back; which statement it runs follows from that answer alone.

use crate::watermark::Watermark;

/// How a write sets the version of the replica row it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowVersion {
    /// The writing transaction's commit watermark: every change of the replication stream.
    Commit,
    /// The later of the row's own version and the writing transaction's: backfilled values
    /// merged into a row the replica holds never move it backwards.
    Later,
    /// The backfill's snapshot watermark: a row the replica lacked, inserted whole from a
    /// backfill, is as of the snapshot it was read at.
    Snapshot,
}

/// One value of a backfilled row, as the replica's table has its column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackfilledValue<'a> {
    pub column: &'a str,
    /// The column is part of the table's key: the row is found by it.
    pub in_key: bool,
    /// The column awaits its backfill.
    pub awaits_backfill: bool,
}

/// What the replica does with one backfilled row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowMerge {
    /// Nothing: the row was deleted after the snapshot, and stays deleted.
    Skip,
    /// Merge the row into the one the replica holds under its key, or insert it.
    Merge {
        /// The values the held row takes, as positions in the backfilled row, ascending; when
        /// there are none, the replica only needs to know whether it holds the row.
        update: Vec<usize>,
        /// How the held row's version moves when it takes them.
        version: RowVersion,
        /// When the replica does not hold the row: insert it whole, versioned so; `None`: leave
        /// it out (it was deleted, or the stream brings it whole).
        insert: Option<RowVersion>,
    },
}

/// The rows of one `backfill` message against one table of the replica.
#[derive(Debug, Clone, Copy)]
pub struct BackfillMerge<'a> {
    snapshot: &'a Watermark,
    whole_table: bool,
}

impl<'a> BackfillMerge<'a> {
    /// Rows read at `snapshot` (the message's `watermark`) for a table of which every column,
    /// its key among them, awaits its backfill (`whole_table`: the table is new to the replica),
    /// or only some. `truncated` is the version of the table's newest truncate, if any.
    ///
    /// `None` when the table takes nothing of the message: it was truncated after the snapshot,
    /// and every row the snapshot holds is gone.
    pub fn new(
        snapshot: &'a Watermark,
        whole_table: bool,
        truncated: Option<&Watermark>,
    ) -> Option<Self> {
        let merge = BackfillMerge {
            snapshot,
            whole_table,
        };
        match truncated {
            Some(version) if merge.yields_to(version) => None,
            _ => Some(merge),
        }
    }

    /// Whether the stream's write at `version` came after the snapshot: what it wrote stands,
    /// and the backfill yields to it. A replica may leave out the stream's writes of a table
    /// whose newest write this backfill does not yield to.
    pub fn yields_to(&self, version: &Watermark) -> bool {
        version > self.snapshot
    }

    /// One backfilled row whose values are `values`. `deleted` is the version of the tombstone
    /// the replica keeps for the row's key (deleted, or moved to another key), if any;
    /// `written` holds the backfilling columns of the row the stream wrote, each with the
    /// version of its latest write.
    ///
    /// A row deleted after the snapshot stays deleted. Otherwise a row the replica holds takes
    /// the values of its backfilling columns (its key aside), except those the stream wrote
    /// after the snapshot, and keeps the later version; a row the replica lacks is inserted
    /// whole, at the snapshot's version, only while the whole table awaits its backfill.
    pub fn row(
        &self,
        values: &[BackfilledValue<'_>],
        deleted: Option<&Watermark>,
        written: &[(String, Watermark)],
    ) -> RowMerge {
        if deleted.is_some_and(|version| self.yields_to(version)) {
            return RowMerge::Skip;
        }
        let stream_wrote = |column: &str| {
            written
                .iter()
                .any(|(c, version)| c == column && self.yields_to(version))
        };
        let update = values
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.in_key && v.awaits_backfill && !stream_wrote(v.column))
            .map(|(i, _)| i)
            .collect();
        RowMerge::Merge {
            update,
            version: RowVersion::Later,
            insert: self.whole_table.then_some(RowVersion::Snapshot),
        }
    }
}

#[cfg(test)]
mod tests;
