//! The scope feed's rules: which changes record an exit, at which seq and with which values;
//! how a commit's rows and exits become its feed entries; which exits a replay page carries
//! (`docs/protocol/scope-sync.md`, "Exits", "Replay then live"). The replica that keeps the
//! feed does the reading and writing (the host in SQLite, the simulation in memory) and asks
//! these functions what the feed holds.
//!
//! **Exits** ([`exits`]). A followed table is one a rules file opens to scope sync; its *scope
//! columns* are every column a scope may filter on. A row of it exits the scopes its old values
//! matched when
//! - an update changes one of its scope columns: the exit keeps the old and the new values, at
//!   the seq the update gave the row;
//! - its key changes: the exit keeps the old values under the old key and no new ones, at the
//!   seq the old key's tombstone took (the last the change took);
//! - it is deleted: the same, at the delete's tombstone seq;
//! - its table is truncated: every row it held, at the table's truncate marker seq.
//!
//! An exit takes no seq of its own: it shares the seq of the write that caused it, so a relay
//! with other rules (or none) assigns the same seqs as its primary. Exits are journalled for
//! catch-up, except a truncate's: a cursor from before the marker is reset, so those rows are
//! only routed live. A change that took no seq wrote nothing and records no exit; neither does
//! a change to a row the replica did not hold.
//!
//! **A commit's entries** ([`commit_entries`]). The rows a commit wrote, as they now are, and
//! its exits, all stamped with its commit time, in feed order ([`sort_entries`]): ascending by
//! seq, a row write before an exit of the same seq, entries otherwise in the order given.
//!
//! **A replay page's exits** ([`exit_leaves`], [`page_entries`]). A replay from a cursor
//! carries, besides the scope's rows, the exits in `(after, up_to]` whose row left the
//! subscriber's scope: its old values passed the scope (conditions and row filter) and its new
//! values, if any, do not. An unknown answer (SQL's NULL) does not pass, so an exit whose new
//! values the scope cannot judge is the scope's. Rows and exits merge in feed order, at most
//! `limit` of them. A replay from no cursor reads no exits: the rows are the whole scope.
//! Live routing matches exits against each subscription the same way.

use std::ops::Range;

use serde_json::{Map, Value};

use super::server::{FeedChange, FeedEntry};

#[cfg(test)]
mod tests;

/// A row of a followed table as the feed keeps it: its key as text (a one-column key's value in
/// JavaScript's string form, else the JSON array of the key values) and its values in the
/// table's scope columns.
#[derive(Debug, Clone, PartialEq)]
pub struct ScopedRow {
    pub resource_id: String,
    pub values: Map<String, Value>,
}

/// What one change did to a followed table, as the replica read it before and after.
#[derive(Debug, Clone, PartialEq)]
pub enum RowChange {
    /// An update. `before`: the row it named (at its old key when it carries one) as it was,
    /// `None` when the replica did not hold it. `after`: the row at its new key as it now is,
    /// with its seq. `seqs`: the seqs the change took.
    Updated {
        before: Option<ScopedRow>,
        after: Option<(ScopedRow, i64)>,
        seqs: Range<i64>,
    },
    /// A delete of the row `before` (`None`: the replica did not hold it); `seqs`: the seqs the
    /// change took (its tombstone's last).
    Deleted {
        before: Option<ScopedRow>,
        seqs: Range<i64>,
    },
    /// A truncate of a table that held `rows`, its marker at seq `marker`.
    Truncated { rows: Vec<ScopedRow>, marker: i64 },
}

/// A row leaving the scopes its old values matched and its new values do not.
#[derive(Debug, Clone, PartialEq)]
pub struct Exit {
    pub table: String,
    pub resource_id: String,
    /// The seq of the write that caused it.
    pub seq: i64,
    /// The row's values in the scope columns before the change.
    pub old: Map<String, Value>,
    /// The values after, for a row still held under the same key; `None` when it is gone.
    pub new: Option<Map<String, Value>>,
    /// Journalled for catch-up (not a truncate's: its marker resets older cursors).
    pub journal: bool,
}

impl Exit {
    /// The feed entry of this exit, for a commit at `updated_at`.
    pub fn into_entry(self, updated_at: &str) -> FeedEntry {
        FeedEntry {
            table: self.table,
            resource_id: self.resource_id,
            seq: self.seq,
            updated_at: updated_at.to_owned(),
            change: FeedChange::Exit {
                old: self.old,
                new: self.new,
            },
        }
    }
}

/// The exits `change` to `table` records (see the module doc).
pub fn exits(table: &str, change: RowChange) -> Vec<Exit> {
    let exit = |row: ScopedRow, seq: i64, new: Option<Map<String, Value>>, journal: bool| Exit {
        table: table.to_owned(),
        resource_id: row.resource_id,
        seq,
        old: row.values,
        new,
        journal,
    };
    match change {
        RowChange::Updated {
            before: Some(before),
            after,
            seqs,
        } if !seqs.is_empty() => match after {
            Some((now, seq)) if now.resource_id == before.resource_id => {
                if now.values == before.values {
                    Vec::new()
                } else {
                    vec![exit(before, seq, Some(now.values), true)]
                }
            }
            // The key changed (or the row is not under its new key): the old key's tombstone
            // took the last seq.
            _ => vec![exit(before, seqs.end - 1, None, true)],
        },
        RowChange::Deleted {
            before: Some(before),
            seqs,
        } if !seqs.is_empty() => vec![exit(before, seqs.end - 1, None, true)],
        RowChange::Truncated { rows, marker } => rows
            .into_iter()
            .map(|row| exit(row, marker, None, false))
            .collect(),
        RowChange::Updated { .. } | RowChange::Deleted { .. } => Vec::new(),
    }
}

/// Puts feed entries in feed order: ascending by seq, a row write before an exit of the same
/// seq, entries otherwise in the order given.
pub fn sort_entries(entries: &mut [FeedEntry]) {
    entries.sort_by_key(|entry| (entry.seq, matches!(entry.change, FeedChange::Exit { .. })));
}

/// A commit's feed entries: `rows`, the rows it wrote as they now are (upserts), and its
/// `exits`, stamped with its commit time `updated_at`, in feed order.
pub fn commit_entries(rows: Vec<FeedEntry>, exits: Vec<Exit>, updated_at: &str) -> Vec<FeedEntry> {
    let mut entries = rows;
    entries.reserve(exits.len());
    entries.extend(exits.into_iter().map(|exit| exit.into_entry(updated_at)));
    for entry in &mut entries {
        if entry.updated_at != updated_at {
            updated_at.clone_into(&mut entry.updated_at);
        }
    }
    sort_entries(&mut entries);
    entries
}

/// Whether an exit leaves a subscriber's scope: `scope` answers for the exit's old values, and
/// then, if they pass and there are new values, for the new ones, in SQL's three-valued logic
/// (`None` is unknown, which does not pass). It leaves when the old values pass and the new
/// values, if any, do not. `V` is whatever the reader has for a set of values: the values
/// themselves, or the answers a database computed for them.
pub fn exit_leaves<V>(old: V, new: Option<V>, mut scope: impl FnMut(V) -> Option<bool>) -> bool {
    scope(old) == Some(true) && new.is_none_or(|new| scope(new) != Some(true))
}

/// A replay page: the scope's `rows` and the `exits` that left it, merged in feed order and cut
/// to `limit` entries. A reader may read each list up to `limit` long: no entry beyond it can
/// be on the page.
pub fn page_entries(rows: Vec<FeedEntry>, exits: Vec<FeedEntry>, limit: u32) -> Vec<FeedEntry> {
    let mut entries = rows;
    entries.extend(exits);
    sort_entries(&mut entries);
    entries.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    entries
}
