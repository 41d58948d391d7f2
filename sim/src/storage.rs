//! Simulated storage: the change log and the replica (rows with per-row seqs, the scope feed's
//! exits), kept as the host keeps them in one SQLite database: each upstream transaction is
//! applied to the replica and appended to the log in ONE store transaction that commits
//! atomically. A crash drops the open store transaction; what committed survives.
//!
//! The replica keeps the scope feed by the engine's rules (`scope_sync::feed`), which the host's
//! `replica/feed.rs` calls too: every row write takes the next seq, and a delete one for its
//! tombstone; what a change did to a followed table's rows, as read before and after it, goes
//! to `feed::exits`, which says which exits it records (at the seq of the write that caused
//! them, journalled or, for a truncate, only routed live); a commit's feed entries are the rows
//! its touched tables now hold at or above the first seq it took, and its exits, in the order
//! `feed::commit_entries` puts them. A replay page is the scope's rows in `(after, up_to]` and,
//! after a cursor, the journalled exits there that `feed::exit_leaves` says left the scope,
//! merged by `feed::page_entries`.
//!
//! Row filters are evaluated in memory over the durable replica ([`TableSets`]): a page's rows
//! and exits pass the subscriber's filter as the replica holds its subqueries' tables when the
//! page is read, as do the reads of a set or of a move; a resumed subscription's first page
//! also says whether its access may have changed since its cursor (the host's `sets_changed`).

use std::collections::{BTreeMap, BTreeSet};

use highwater_engine::backfill::{BackfillMerge, BackfilledValue, RowMerge};
use highwater_engine::change_stream::{Change, DownstreamMessage, Row};
use highwater_engine::scope_sync::feed::{self, RowChange, ScopedRow};
use highwater_engine::scope_sync::rules::row_filter::{RowFilter, SetQuery};
use highwater_engine::scope_sync::server::{FeedChange, FeedEntry, PageResult};
use highwater_engine::scope_sync::{js_string_form, Conditions};
use highwater_engine::streamer::{CatchupRow, LogOp, StoredChange};
use highwater_engine::watermark::Watermark;
use serde_json::{Map, Value};

use crate::access::TableSets;

/// `updatedAt` of rows from the initial copy.
pub const UNKNOWN_COMMIT_TIME: &str = "1970-01-01T00:00:00.000Z";

#[derive(Debug, Clone, PartialEq)]
pub struct LogRow {
    pub watermark: Watermark,
    pub pos: u64,
    pub tag: String,
    pub change: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaRow {
    pub data: Map<String, Value>,
    pub seq: i64,
    pub updated_at: String,
}

/// A journalled exit.
#[derive(Debug, Clone, PartialEq)]
pub struct Exit {
    pub resource_id: String,
    pub seq: i64,
    pub old: Map<String, Value>,
    pub new: Option<Map<String, Value>>,
    pub updated_at: String,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReplicaTable {
    pub columns: Vec<String>,
    pub key: String,
    /// The columns the scope feed journals in its exits; empty: the feed does not follow it.
    pub feed: Vec<String>,
    pub rows: BTreeMap<String, ReplicaRow>,
    pub exits: Vec<Exit>,
    /// The seq of the newest truncate: a replay from an older cursor starts over.
    pub truncated: Option<i64>,
    /// Columns (the key too, for a table new to the replica) whose existing values only
    /// upstream knows: a backfill brings them (the replica's pending backfills).
    pub pending: BTreeSet<String>,
}

/// What survives a crash.
#[derive(Debug, Clone, PartialEq)]
pub struct Durable {
    pub log: Vec<LogRow>,
    pub last_watermark: Watermark,
    pub tables: BTreeMap<String, ReplicaTable>,
    /// The next seq to assign.
    pub next_seq: i64,
    /// Seqs at or below this may have lost their exits to retention.
    pub exit_floor: Option<i64>,
    /// Per sync client: the last mutation id whose transaction the replica holds (its
    /// `highwater.confirm` messages, stored with the transaction).
    pub confirmed: BTreeMap<String, u64>,
}

/// The open store transaction.
#[derive(Debug, Clone)]
struct Open {
    watermark: Watermark,
    log: Vec<LogRow>,
    tables: BTreeMap<String, ReplicaTable>,
    next_seq: i64,
    /// Per touched table: the first seq the transaction took in it.
    touched: BTreeMap<String, i64>,
    /// The exits its changes recorded ([`feed::exits`]).
    exits: Vec<feed::Exit>,
    updated_at: String,
    confirms: Vec<(String, u64)>,
}

/// A storage defect to plant, so tests can show that the simulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageBug {
    /// A commit is reported durable while it sits in a write-back cache until the next
    /// commit: a crash loses the newest one.
    LosesLastCommit,
}

#[derive(Debug)]
pub struct Storage {
    durable: Durable,
    /// With [`StorageBug::LosesLastCommit`]: the state a crash falls back to.
    flushed: Option<Durable>,
    open: Option<Open>,
    bug: Option<StorageBug>,
    pub commits: u64,
}

impl Storage {
    /// A replica copied at `replica_version`, with a change log seeded there.
    pub fn new(
        replica_version: Watermark,
        tables: BTreeMap<String, ReplicaTable>,
        next_seq: i64,
        bug: Option<StorageBug>,
    ) -> Self {
        let log = vec![
            LogRow {
                watermark: replica_version.clone(),
                pos: 0,
                tag: "begin".to_owned(),
                change: r#"{"tag":"begin"}"#.to_owned(),
            },
            LogRow {
                watermark: replica_version.clone(),
                pos: 1,
                tag: "commit".to_owned(),
                change: r#"{"tag":"commit"}"#.to_owned(),
            },
        ];
        Storage {
            durable: Durable {
                log,
                last_watermark: replica_version,
                tables,
                next_seq,
                exit_floor: None,
                confirmed: BTreeMap::new(),
            },
            flushed: None,
            open: None,
            bug,
            commits: 0,
        }
    }

    pub fn durable(&self) -> &Durable {
        &self.durable
    }

    pub fn last_watermark(&self) -> &Watermark {
        &self.durable.last_watermark
    }

    /// The replica's pending backfills, durable: table → columns (key included for a table
    /// new to the replica).
    pub fn pending_backfills(&self) -> BTreeMap<String, BTreeSet<String>> {
        self.durable
            .tables
            .iter()
            .filter(|(_, t)| !t.pending.is_empty())
            .map(|(n, t)| (n.clone(), t.pending.clone()))
            .collect()
    }

    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    /// The process died: the open transaction is gone.
    pub fn crash(&mut self) {
        self.open = None;
        if let Some(flushed) = self.flushed.take() {
            self.durable = flushed;
        }
    }

    /// Carries out one change-log write. A commit returns the feed entries of the
    /// transaction, to route only now that they are durable.
    pub fn apply(&mut self, op: &LogOp) -> Result<Option<Vec<FeedEntry>>, String> {
        match op {
            LogOp::Begin(row) => {
                if let Some(open) = &self.open {
                    return Err(format!(
                        "expected no open store transaction at a begin for {}, found one for {}",
                        row.watermark(),
                        open.watermark
                    ));
                }
                if *row.watermark() <= self.durable.last_watermark {
                    return Err(format!(
                        "expected a transaction after the stored {}, got a begin for {}",
                        self.durable.last_watermark,
                        row.watermark()
                    ));
                }
                self.open = Some(Open {
                    watermark: row.watermark().clone(),
                    log: vec![log_row(row)],
                    tables: self.durable.tables.clone(),
                    next_seq: self.durable.next_seq,
                    touched: BTreeMap::new(),
                    exits: Vec::new(),
                    updated_at: UNKNOWN_COMMIT_TIME.to_owned(),
                    confirms: Vec::new(),
                });
                Ok(None)
            }
            LogOp::Append(row) => {
                let open = self.open_for(row)?;
                open.log.push(log_row(row));
                if let Some(DownstreamMessage::Data(change)) = row.message() {
                    open.apply(change)?;
                }
                Ok(None)
            }
            LogOp::Commit(row) => {
                let open = self.open_for(row)?;
                open.log.push(log_row(row));
                if let Some(DownstreamMessage::Commit(commit)) = row.message() {
                    if let Some(ms) = commit.commit_time_ms.as_ref().and_then(|n| n.as_i64()) {
                        open.updated_at = iso_from_ms(ms);
                    }
                }
                let mut open = self.open.take().expect("checked above");
                let entries = open.finish();
                if self.bug == Some(StorageBug::LosesLastCommit) {
                    // The copy a crash falls back to: everything before this commit.
                    self.flushed = Some(self.durable.clone());
                }
                let mut confirmed = std::mem::take(&mut self.durable.confirmed);
                for (client, id) in open.confirms {
                    let last = confirmed.entry(client).or_default();
                    *last = (*last).max(id);
                }
                let mut next = Durable {
                    log: std::mem::take(&mut self.durable.log),
                    last_watermark: open.watermark.clone(),
                    tables: open.tables,
                    next_seq: open.next_seq,
                    exit_floor: self.durable.exit_floor,
                    confirmed,
                };
                next.log.extend(open.log);
                self.durable = next;
                self.commits += 1;
                Ok(Some(entries))
            }
            LogOp::Abort => {
                self.open = None;
                Ok(None)
            }
        }
    }

    /// The open transaction applied these sync-client mutations: recorded with it.
    pub fn confirm(&mut self, confirms: &[(String, u64)]) -> Result<(), String> {
        match self.open.as_mut() {
            Some(open) => {
                open.confirms.extend_from_slice(confirms);
                Ok(())
            }
            None => Err("expected an open store transaction for confirms".to_owned()),
        }
    }

    /// The client's last mutation id the replica holds.
    pub fn confirmed(&self, client_id: &str) -> Option<u64> {
        self.durable.confirmed.get(client_id).copied()
    }

    fn open_for(&mut self, row: &StoredChange) -> Result<&mut Open, String> {
        let found = self.open.as_ref().map(|o| o.watermark.clone());
        match (found, self.open.as_mut()) {
            (Some(w), Some(open)) if w == *row.watermark() => Ok(open),
            (Some(w), _) => Err(format!(
                "expected a row of the open transaction {w}, got one of {}",
                row.watermark()
            )),
            _ => Err(format!(
                "expected an open store transaction for a {} row of {}",
                row.tag(),
                row.watermark()
            )),
        }
    }

    /// Drops exits journalled before `older_than` (ISO-8601) and raises the retention floor to
    /// the highest seq dropped, in one store transaction between upstream transactions.
    /// Returns the floor.
    pub fn prune_exits(&mut self, older_than: &str) -> Option<i64> {
        let mut pruned = None;
        for t in self.durable.tables.values_mut() {
            t.exits.retain(|e| {
                let old = e.updated_at.as_str() < older_than;
                if old {
                    pruned = pruned.max(Some(e.seq));
                }
                !old
            });
        }
        if pruned > self.durable.exit_floor {
            self.durable.exit_floor = pruned;
        }
        self.durable.exit_floor
    }

    /// Change-log rows with `from <= watermark <= through`, in `(watermark, pos)` order.
    pub fn catchup(&self, from: &Watermark, through: &Watermark) -> Vec<CatchupRow> {
        self.durable
            .log
            .iter()
            .filter(|r| r.watermark >= *from && r.watermark <= *through)
            .map(|r| CatchupRow::new(r.watermark.clone(), r.tag.clone(), r.change.clone()))
            .collect()
    }

    /// One replay page, read from what is durable.
    pub fn page(&self, read: &PageRead<'_>) -> PageResult {
        let table = read.table;
        let Some(t) = self.durable.tables.get(table) else {
            return PageResult::Failed {
                message: format!("expected a replica table {table}, found none"),
            };
        };
        let up_to = read.up_to.unwrap_or(self.durable.next_seq - 1);
        if let (Some(after), Some(truncated)) = (read.after, t.truncated) {
            if truncated > after {
                return PageResult::Truncated;
            }
        }
        let sets = self.durable.sets(read.row_filter);
        let passes = |values: &Map<String, Value>| {
            read.conditions.matches(values)
                && read.row_filter.is_none_or(|f| sets.passes(f, values))
        };
        let lo = read.after.unwrap_or(0);
        let in_range = |seq: i64| seq > lo && seq <= up_to;
        let rows: Vec<FeedEntry> = t
            .rows
            .iter()
            .filter(|(_, r)| in_range(r.seq) && passes(&r.data))
            .map(|(id, r)| upsert(table, id, r))
            .collect();
        let total = read.count_total.then_some(rows.len() as u64);
        let exits: Vec<FeedEntry> = match read.after {
            Some(_) => t
                .exits
                .iter()
                .filter(|exit| {
                    in_range(exit.seq)
                        && feed::exit_leaves(&exit.old, exit.new.as_ref(), |values| {
                            Some(passes(values))
                        })
                })
                .map(|exit| FeedEntry {
                    table: table.to_owned(),
                    resource_id: exit.resource_id.clone(),
                    seq: exit.seq,
                    updated_at: exit.updated_at.clone(),
                    change: FeedChange::Exit {
                        old: exit.old.clone(),
                        new: exit.new.clone(),
                    },
                })
                .collect(),
            None => Vec::new(),
        };
        let rows = feed::page_entries(rows, exits, read.limit);
        let access_changed = match read.after {
            Some(after) => self.access_changed(read.access, after, up_to),
            None => false,
        };
        PageResult::Rows {
            up_to,
            rows,
            total,
            floor: self.durable.exit_floor,
            access_changed,
        }
    }

    /// Every row of `table` matching `conditions` and `row_filter` now, at most `limit`, as
    /// upserts at the replica's high-water: the answer to a set's read and to a move's.
    pub fn read_rows(
        &self,
        table: &str,
        conditions: &Conditions,
        row_filter: &RowFilter,
        limit: u32,
    ) -> PageResult {
        let Some(t) = self.durable.tables.get(table) else {
            return PageResult::Failed {
                message: format!("expected a replica table {table}, found none"),
            };
        };
        let sets = self.durable.sets(Some(row_filter));
        let mut rows: Vec<FeedEntry> = t
            .rows
            .iter()
            .filter(|(_, r)| conditions.matches(&r.data) && sets.passes(row_filter, &r.data))
            .map(|(id, r)| upsert(table, id, r))
            .collect();
        rows.sort_by_key(|r| r.seq);
        rows.truncate(limit as usize);
        PageResult::Rows {
            up_to: self.durable.next_seq - 1,
            rows,
            total: None,
            floor: self.durable.exit_floor,
            access_changed: false,
        }
    }

    /// Whether any of these sets may have changed in `(after, up_to]`: a row of its table
    /// written there that passes its filter now, an exit there whose old values passed it, a
    /// truncate of its table after `after`, or the same of a set in its own filter.
    fn access_changed(&self, sets: &[SetQuery], after: i64, up_to: i64) -> bool {
        let in_range = |seq: i64| seq > after && seq <= up_to;
        sets.iter().any(|set| {
            let Some(t) = self.durable.tables.get(&set.table) else {
                return false;
            };
            if t.truncated.is_some_and(|truncated| truncated > after) {
                return true;
            }
            let inner = self.durable.sets(Some(&set.filter));
            let below: Vec<SetQuery> = set
                .filter
                .sets()
                .into_iter()
                .map(|(_, set, _)| set.clone())
                .collect();
            t.rows
                .values()
                .any(|r| in_range(r.seq) && inner.passes(&set.filter, &r.data))
                || t.exits
                    .iter()
                    .any(|e| in_range(e.seq) && inner.passes(&set.filter, &e.old))
                || self.access_changed(&below, after, up_to)
        })
    }
}

/// One replay page to read ([`ServerEffect::FetchPage`](highwater_engine::scope_sync::server::ServerEffect::FetchPage)).
#[derive(Debug, Clone, Copy)]
pub struct PageRead<'a> {
    pub table: &'a str,
    pub conditions: &'a Conditions,
    pub row_filter: Option<&'a RowFilter>,
    pub after: Option<i64>,
    pub up_to: Option<i64>,
    pub limit: u32,
    pub count_total: bool,
    /// The sets whose change since `after` the page must report.
    pub access: &'a [SetQuery],
}

impl Durable {
    /// The sets of `filter`'s subqueries over the replica's rows now.
    fn sets(&self, filter: Option<&RowFilter>) -> TableSets<'_> {
        let names = filter.map(RowFilter::set_tables).unwrap_or_default();
        TableSets::new(names.iter().filter_map(|name| {
            let (name, t) = self.tables.get_key_value(name)?;
            Some((name.as_str(), t.rows.values().map(|r| &r.data).collect()))
        }))
    }
}

fn upsert(table: &str, id: &str, row: &ReplicaRow) -> FeedEntry {
    FeedEntry {
        table: table.to_owned(),
        resource_id: id.to_owned(),
        seq: row.seq,
        updated_at: row.updated_at.clone(),
        change: FeedChange::Upsert {
            data: row.data.clone(),
        },
    }
}

fn log_row(row: &StoredChange) -> LogRow {
    LogRow {
        watermark: row.watermark().clone(),
        pos: row.pos(),
        tag: row.tag().to_owned(),
        change: row.change_json().to_owned(),
    }
}

fn id_text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::Null => None,
        v => Some(js_string_form(v)),
    }
}

/// A row's key and values in the feed's columns: what its exits keep.
fn scoped(id: &str, data: &Map<String, Value>, columns: &[String]) -> ScopedRow {
    ScopedRow {
        resource_id: id.to_owned(),
        values: columns
            .iter()
            .map(|c| (c.clone(), data.get(c).cloned().unwrap_or(Value::Null)))
            .collect(),
    }
}

impl Open {
    fn table(&mut self, name: &str) -> Result<&mut ReplicaTable, String> {
        self.tables
            .get_mut(name)
            .ok_or_else(|| format!("expected replica table {name} to exist, found none"))
    }

    fn take_seq(&mut self, table: &str) -> i64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.touched.entry(table.to_owned()).or_insert(seq);
        seq
    }

    fn checked(table: &ReplicaTable, name: &str, row: &Row) -> Result<(), String> {
        match row.keys().find(|c| !table.columns.contains(c)) {
            Some(column) => Err(format!(
                "expected the columns of replica table {name}, got unknown column {column}"
            )),
            None => Ok(()),
        }
    }

    fn apply(&mut self, change: &Change) -> Result<(), String> {
        match change {
            Change::CreateTable(create) => {
                let name = create.spec.name.clone();
                if self.tables.contains_key(&name) {
                    return Err(format!("expected table {name} not to exist, found it"));
                }
                let key = create
                    .spec
                    .primary_key
                    .as_ref()
                    .and_then(|k| k.first().cloned())
                    .unwrap_or_else(|| "id".to_owned());
                let pending = create
                    .backfill
                    .as_ref()
                    .map(|b| b.keys().cloned().collect())
                    .unwrap_or_default();
                self.tables.insert(
                    name,
                    ReplicaTable {
                        columns: create.spec.columns.keys().cloned().collect(),
                        key,
                        feed: Vec::new(),
                        pending,
                        ..ReplicaTable::default()
                    },
                );
            }
            Change::AddColumn(add) => {
                let t = self.table(&add.table.name)?;
                if !t.columns.contains(&add.column.name) {
                    t.columns.push(add.column.name.clone());
                    if add.backfill.is_some() {
                        t.pending.insert(add.column.name.clone());
                    }
                }
            }
            Change::Insert(insert) => {
                let name = insert.relation.name.clone();
                let seq = self.take_seq(&name);
                let t = self.table(&name)?;
                Self::checked(t, &name, &insert.new)?;
                let id = id_text(insert.new.get(&t.key))
                    .ok_or_else(|| format!("expected a key in an insert into {name}"))?;
                t.rows.insert(
                    id,
                    ReplicaRow {
                        data: insert.new.clone(),
                        seq,
                        updated_at: UNKNOWN_COMMIT_TIME.to_owned(),
                    },
                );
            }
            Change::Update(update) => {
                let name = update.relation.name.clone();
                let first = self.next_seq;
                let seq = self.take_seq(&name);
                let t = self.table(&name)?;
                Self::checked(t, &name, &update.new)?;
                let id = id_text(update.new.get(&t.key))
                    .ok_or_else(|| format!("expected a key in an update of {name}"))?;
                let old_id = update
                    .key
                    .as_ref()
                    .and_then(|k| id_text(k.get(&t.key)))
                    .filter(|old| *old != id);
                let columns = t.feed.clone();
                // A key change: the row moves to its new key, and the old key's tombstone takes
                // the next seq.
                let moved = old_id.as_ref().and_then(|old| t.rows.remove(old));
                // What the update named, as the host reads it: the row at its old key when it
                // carries one.
                let before = match &old_id {
                    Some(old) => moved.as_ref().map(|r| scoped(old, &r.data, &columns)),
                    None => t.rows.get(&id).map(|r| scoped(&id, &r.data, &columns)),
                };
                let source = moved.as_ref().or_else(|| t.rows.get(&id));
                let mut data = source.map(|r| r.data.clone()).unwrap_or_default();
                for (k, v) in &update.new {
                    data.insert(k.clone(), v.clone());
                }
                let now = scoped(&id, &data, &columns);
                t.rows.insert(
                    id,
                    ReplicaRow {
                        data,
                        seq,
                        updated_at: UNKNOWN_COMMIT_TIME.to_owned(),
                    },
                );
                if moved.is_some() {
                    self.take_seq(&name);
                }
                if !columns.is_empty() {
                    let change = RowChange::Updated {
                        before,
                        after: Some((now, seq)),
                        seqs: first..self.next_seq,
                    };
                    self.exits.extend(feed::exits(&name, change));
                }
            }
            Change::Delete(delete) => {
                let name = delete.relation.name.clone();
                let t = self.table(&name)?;
                let id = id_text(delete.key.get(&t.key))
                    .ok_or_else(|| format!("expected a key in a delete from {name}"))?;
                let Some(gone) = t.rows.remove(&id) else {
                    return Ok(());
                };
                let columns = t.feed.clone();
                let seq = self.take_seq(&name);
                if !columns.is_empty() {
                    let change = RowChange::Deleted {
                        before: Some(scoped(&id, &gone.data, &columns)),
                        seqs: seq..seq + 1,
                    };
                    self.exits.extend(feed::exits(&name, change));
                }
            }
            Change::Truncate(truncate) => {
                for relation in &truncate.relations {
                    let name = relation.name.clone();
                    let marker = self.take_seq(&name);
                    let t = self.table(&name)?;
                    let gone = std::mem::take(&mut t.rows);
                    t.truncated = Some(marker);
                    let columns = t.feed.clone();
                    if columns.is_empty() {
                        continue;
                    }
                    let rows = gone
                        .iter()
                        .map(|(id, row)| scoped(id, &row.data, &columns))
                        .collect();
                    self.exits
                        .extend(feed::exits(&name, RowChange::Truncated { rows, marker }));
                }
            }
            Change::Backfill(backfill) => {
                // The engine's merge decides, as it does for the host's replica. The simulated
                // replica keeps no versions and needs none: a backfill is read at upstream's WAL
                // end when it starts, and the session holds upstream input back until the
                // backfill ends, so no write, delete or truncate the replica holds is newer than
                // the snapshot, and every row meets the same answer.
                let name = backfill.relation.name.clone();
                let t = self.table(&name)?;
                let names: Vec<String> = backfill
                    .relation
                    .row_key
                    .columns
                    .iter()
                    .chain(&backfill.columns)
                    .cloned()
                    .collect();
                if let Some(c) = names
                    .iter()
                    .find(|c| !t.pending.contains(*c) && **c != t.key)
                {
                    return Err(format!(
                        "expected a backfill of pending columns of {name}, got one of {c} (applied twice?)"
                    ));
                }
                let key = t.key.clone();
                let whole = t.pending.contains(&key);
                let backfilled: Vec<BackfilledValue<'_>> = names
                    .iter()
                    .map(|c| BackfilledValue {
                        column: c,
                        in_key: *c == key,
                        awaits_backfill: t.pending.contains(c),
                    })
                    .collect();
                let answer = BackfillMerge::new(&backfill.watermark, whole, None)
                    .map(|merge| merge.row(&backfilled, None, &[]));
                // The row's version (the later of its own and the backfill's) has no model here.
                let Some(RowMerge::Merge { update, insert, .. }) = answer else {
                    return Ok(());
                };
                for values in &backfill.row_values {
                    let row: Map<String, Value> =
                        names.iter().cloned().zip(values.iter().cloned()).collect();
                    let id = id_text(row.get(&key))
                        .ok_or_else(|| format!("expected a key in a backfill row of {name}"))?;
                    let t = self.table(&name)?;
                    if !t.rows.contains_key(&id) && insert.is_none() {
                        continue;
                    }
                    let seq = self.take_seq(&name);
                    let t = self.table(&name)?;
                    match t.rows.get_mut(&id) {
                        Some(held) => {
                            for &i in &update {
                                if let (Some(c), Some(v)) = (names.get(i), values.get(i)) {
                                    held.data.insert(c.clone(), v.clone());
                                }
                            }
                            held.seq = seq;
                        }
                        None => {
                            t.rows.insert(
                                id,
                                ReplicaRow {
                                    data: row,
                                    seq,
                                    updated_at: UNKNOWN_COMMIT_TIME.to_owned(),
                                },
                            );
                        }
                    }
                }
            }
            Change::BackfillCompleted(done) => {
                let t = self.table(&done.relation.name)?;
                for c in done.relation.row_key.columns.iter().chain(&done.columns) {
                    t.pending.remove(c);
                }
            }
            other => {
                return Err(format!(
                    "expected a change the simulated replica models, got {}",
                    other.tag()
                ))
            }
        }
        Ok(())
    }

    /// Stamps the commit time on the rows written, journals the exits, and returns the feed
    /// entries of the transaction ([`feed::commit_entries`]).
    fn finish(&mut self) -> Vec<FeedEntry> {
        let mut rows = Vec::new();
        for (name, first) in &self.touched {
            let Some(t) = self.tables.get_mut(name) else {
                continue;
            };
            let followed = !t.feed.is_empty();
            for (id, row) in t.rows.iter_mut().filter(|(_, r)| r.seq >= *first) {
                row.updated_at = self.updated_at.clone();
                if followed {
                    rows.push(upsert(name, id, row));
                }
            }
        }
        let exits = std::mem::take(&mut self.exits);
        for exit in exits.iter().filter(|exit| exit.journal) {
            if let Some(t) = self.tables.get_mut(&exit.table) {
                t.exits.push(Exit {
                    resource_id: exit.resource_id.clone(),
                    seq: exit.seq,
                    old: exit.old.clone(),
                    new: exit.new.clone(),
                    updated_at: self.updated_at.clone(),
                });
            }
        }
        feed::commit_entries(rows, exits, &self.updated_at)
    }
}

/// ISO-8601 UTC with milliseconds.
pub fn iso_from_ms(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_dates_are_civil_utc() {
        assert_eq!(iso_from_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso_from_ms(1_796_126_400_123), "2026-12-01T12:00:00.123Z");
    }
}

#[cfg(test)]
mod store_tests {
    use super::*;
    use highwater_engine::change_stream::{decode_downstream, Begin, Commit};
    use highwater_engine::streamer::{ChangeLogState, Effect, Streamer, StreamerConfig};
    use serde_json::json;

    fn w(text: &str) -> Watermark {
        Watermark::parse(text).expect("watermark")
    }

    fn data(tag: &str, row: Value) -> DownstreamMessage {
        let key = if tag == "delete" { "key" } else { "new" };
        let extra = if tag == "update" {
            r#","key":null"#
        } else {
            ""
        };
        decode_downstream(&format!(
            r#"["data",{{"tag":"{tag}","relation":{{"schema":"public","name":"todos","rowKey":{{"columns":["id"]}}}},"{key}":{row}{extra}}}]"#
        ))
        .expect("message")
    }

    /// The change-log writes the streamer asks for, for one transaction.
    fn writes(streamer: &mut Streamer, wm: &str, changes: Vec<DownstreamMessage>) -> Vec<LogOp> {
        let mut messages = vec![DownstreamMessage::Begin(Begin::new(w(wm)))];
        messages.extend(changes);
        messages.push(DownstreamMessage::Commit(Commit::new(w(wm))));
        let mut ops = Vec::new();
        for m in messages {
            for e in streamer.on_upstream(m).expect("accepted") {
                if let Effect::Store(op) = e {
                    ops.push(op);
                }
            }
        }
        ops
    }

    fn storage() -> (Storage, Streamer) {
        let mut t = ReplicaTable {
            columns: vec!["id".into(), "owner".into()],
            key: "id".into(),
            feed: vec!["owner".into()],
            ..ReplicaTable::default()
        };
        t.rows.insert(
            "1".into(),
            ReplicaRow {
                data: json!({"id": 1, "owner": "ada"})
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
                seq: 1,
                updated_at: UNKNOWN_COMMIT_TIME.into(),
            },
        );
        let tables = BTreeMap::from([("todos".to_owned(), t)]);
        let streamer = Streamer::new(
            StreamerConfig::new(w("01")),
            ChangeLogState {
                last_watermark: w("01"),
                min_watermark: w("01"),
            },
        );
        (Storage::new(w("01"), tables, 2, None), streamer)
    }

    fn ada() -> Conditions {
        let conditions = json!({"owner": "ada"})
            .as_object()
            .cloned()
            .unwrap_or_default();
        Conditions::parse(&conditions).expect("valid")
    }

    fn page_of(conditions: &Conditions, after: Option<i64>) -> PageRead<'_> {
        PageRead {
            table: "todos",
            conditions,
            row_filter: None,
            after,
            up_to: None,
            limit: 10,
            count_total: true,
            access: &[],
        }
    }

    #[test]
    fn a_crash_loses_the_open_transaction_and_keeps_the_committed_one() {
        let (mut storage, mut streamer) = storage();
        let ops = writes(
            &mut streamer,
            "0a",
            vec![data("insert", json!({"id": 2, "owner": "ada"}))],
        );
        for op in &ops {
            storage.apply(op).expect("stored");
        }
        let ops = writes(
            &mut streamer,
            "0b",
            vec![data("insert", json!({"id": 3, "owner": "bob"}))],
        );
        for op in &ops[..ops.len() - 1] {
            storage.apply(op).expect("stored");
        }
        storage.crash();
        assert_eq!(storage.last_watermark(), &w("0a"));
        let rows = &storage.durable().tables["todos"].rows;
        assert!(rows.contains_key("2") && !rows.contains_key("3"));
        assert_eq!(storage.catchup(&w("0b"), &w("0b")), Vec::new());
    }

    #[test]
    fn moves_and_deletes_leave_exits_that_replays_after_a_cursor_carry() {
        let (mut storage, mut streamer) = storage();
        let ops = writes(
            &mut streamer,
            "0a",
            vec![
                data("update", json!({"id": 1, "owner": "bob"})),
                data("insert", json!({"id": 2, "owner": "ada"})),
                data("delete", json!({"id": 2})),
            ],
        );
        let mut entries = Vec::new();
        for op in &ops {
            entries.extend(storage.apply(op).expect("stored").unwrap_or_default());
        }
        // Row 1 moved to bob at seq 2 (an upsert and an exit from ada); row 2's tombstone is
        // seq 4 (its insert took 3).
        let kinds: Vec<(String, i64, bool)> = entries
            .iter()
            .map(|e| {
                (
                    e.resource_id.clone(),
                    e.seq,
                    matches!(e.change, FeedChange::Exit { .. }),
                )
            })
            .collect();
        assert_eq!(
            kinds,
            [
                ("1".into(), 2, false),
                ("1".into(), 2, true),
                ("2".into(), 4, true)
            ]
        );
        let PageResult::Rows { rows, up_to, .. } = storage.page(&page_of(&ada(), Some(1))) else {
            panic!("rows expected");
        };
        assert_eq!(up_to, 4);
        let exits: Vec<&str> = rows.iter().map(|r| r.resource_id.as_str()).collect();
        assert_eq!(exits, ["1", "2"], "both left ada's scope after the cursor");
        // From no cursor: only rows, and ada has none now.
        let PageResult::Rows { rows, .. } = storage.page(&page_of(&ada(), None)) else {
            panic!("rows expected");
        };
        assert!(rows.is_empty());
    }

    fn raw(text: &str) -> DownstreamMessage {
        decode_downstream(text).expect("message")
    }

    #[test]
    fn a_backfill_fills_pending_columns_of_held_rows_once_and_new_seqs_reach_the_feed() {
        let (mut storage, mut streamer) = storage();
        let add = raw(
            r#"["data",{"tag":"add-column","table":{"schema":"public","name":"todos"},"column":{"name":"stamp","spec":{"pos":3,"dataType":"text"}},"backfill":{"attNum":3}}]"#,
        );
        for op in &writes(&mut streamer, "0a", vec![add]) {
            storage.apply(op).expect("stored");
        }
        assert_eq!(
            storage.pending_backfills()["todos"],
            BTreeSet::from(["stamp".to_owned()])
        );
        let rel = r#""relation":{"schema":"public","name":"todos","rowKey":{"columns":["id"]}},"columns":["stamp"],"watermark":"0c""#;
        let backfill = || {
            vec![
                // Row 9 is not in the replica (inserted upstream after the position): skipped.
                raw(&format!(
                    r#"["data",{{"tag":"backfill",{rel},"rowValues":[[1,"t1"],[9,"t9"]]}}]"#
                )),
                raw(&format!(r#"["data",{{"tag":"backfill-completed",{rel}}}]"#)),
            ]
        };
        let mut entries = None;
        for op in &writes(&mut streamer, "0a.01", backfill()) {
            if let Some(e) = storage.apply(op).expect("stored") {
                entries = Some(e);
            }
        }
        let row = &storage.durable().tables["todos"].rows["1"];
        assert_eq!(row.data.get("stamp"), Some(&json!("t1")));
        assert!(!storage.durable().tables["todos"].rows.contains_key("9"));
        assert!(storage.pending_backfills().is_empty());
        // The row took a new seq, so the scope feed carries its new value.
        let entries = entries.expect("committed");
        assert!(
            entries
                .iter()
                .any(|e| e.resource_id == "1" && e.seq == row.seq),
            "{entries:?}"
        );
        // Applied again, it is refused: its columns are no longer pending.
        let again = writes(&mut streamer, "0a.02", backfill());
        let refused = again
            .iter()
            .map(|op| storage.apply(op))
            .find(Result::is_err);
        let why = refused.expect("refused").expect_err("an error");
        assert!(why.contains("applied twice"), "{why}");
    }
}

#[cfg(test)]
mod access_tests {
    use super::*;
    use crate::access::MEMBER_OF;
    use highwater_engine::change_stream::{decode_downstream, Begin, Commit};
    use highwater_engine::scope_sync::rules::row_filter::RuleFilter;
    use highwater_engine::streamer::{ChangeLogState, Effect, Streamer, StreamerConfig};
    use serde_json::json;

    fn w(text: &str) -> Watermark {
        Watermark::parse(text).expect("watermark")
    }

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => panic!("not an object"),
        }
    }

    fn table(columns: &[&str], feed: &[&str]) -> ReplicaTable {
        ReplicaTable {
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            key: "id".into(),
            feed: feed.iter().map(|c| (*c).to_owned()).collect(),
            ..ReplicaTable::default()
        }
    }

    /// Todo 1 of project 1 and todo 2 of project 2 (seqs 1 and 2); no memberships.
    fn storage() -> (Storage, Streamer) {
        let mut todos = table(&["id", "project_id"], &["project_id", "id"]);
        for (id, project) in [(1, 1), (2, 2)] {
            todos.rows.insert(
                id.to_string(),
                ReplicaRow {
                    data: object(json!({"id": id, "project_id": project})),
                    seq: id,
                    updated_at: UNKNOWN_COMMIT_TIME.into(),
                },
            );
        }
        let members = table(&["id", "project_id", "user_id"], &["project_id", "user_id"]);
        let tables = BTreeMap::from([("todos".to_owned(), todos), ("members".to_owned(), members)]);
        let streamer = Streamer::new(
            StreamerConfig::new(w("01")),
            ChangeLogState {
                last_watermark: w("01"),
                min_watermark: w("01"),
            },
        );
        (Storage::new(w("01"), tables, 3, None), streamer)
    }

    /// Stores one transaction of `changes` (`["data", …]` texts) at `wm`.
    fn commit(storage: &mut Storage, streamer: &mut Streamer, wm: &str, changes: &[String]) {
        let mut messages = vec![DownstreamMessage::Begin(Begin::new(w(wm)))];
        messages.extend(
            changes
                .iter()
                .map(|c| decode_downstream(c).expect("message")),
        );
        messages.push(DownstreamMessage::Commit(Commit::new(w(wm))));
        for m in messages {
            for e in streamer.on_upstream(m).expect("accepted") {
                if let Effect::Store(op) = e {
                    storage.apply(&op).expect("stored");
                }
            }
        }
    }

    fn member(tag: &str, key: &str, row: Value) -> String {
        format!(
            r#"["data",{{"tag":"{tag}","relation":{{"schema":"public","name":"members","rowKey":{{"columns":["id"]}}}},"{key}":{row}}}]"#
        )
    }

    fn ids(result: &PageResult) -> (Vec<String>, bool) {
        let PageResult::Rows {
            rows,
            access_changed,
            ..
        } = result
        else {
            panic!("rows expected, got {result:?}");
        };
        (
            rows.iter().map(|r| r.resource_id.clone()).collect(),
            *access_changed,
        )
    }

    #[test]
    fn pages_and_reads_pass_the_filter_and_a_resume_learns_its_access_changed() {
        let (mut storage, mut streamer) = storage();
        let filter = RuleFilter::parse(MEMBER_OF)
            .expect("parses")
            .bind(&object(json!({"sub": "ada"})))
            .expect("binds");
        let access: Vec<SetQuery> = filter
            .sets()
            .into_iter()
            .map(|(_, s, _)| s.clone())
            .collect();
        let all = Conditions::default();
        let page = |storage: &Storage, after: Option<i64>| {
            storage.page(&PageRead {
                table: "todos",
                conditions: &all,
                row_filter: Some(&filter),
                after,
                up_to: None,
                limit: 10,
                count_total: false,
                access: &access,
            })
        };
        assert_eq!(ids(&page(&storage, None)), (vec![], false));
        // Ada joins project 1 (seq 3): todo 1 is hers, though nothing after the cursor wrote it.
        let joined = member(
            "insert",
            "new",
            json!({"id": 7, "project_id": 1, "user_id": "ada"}),
        );
        commit(&mut storage, &mut streamer, "0a", &[joined]);
        assert_eq!(ids(&page(&storage, Some(2))), (vec![], true));
        assert_eq!(ids(&page(&storage, Some(3))), (vec![], false));
        assert_eq!(ids(&page(&storage, None)), (vec!["1".to_owned()], false));
        let set = &access[0];
        let read = storage.read_rows(&set.table, &all, &set.filter, 10);
        assert_eq!(ids(&read), (vec!["7".to_owned()], false));
        // She leaves (seq 4): the exit's old values passed the set's filter.
        let left = member("delete", "key", json!({"id": 7}));
        commit(&mut storage, &mut streamer, "0b", &[left]);
        assert_eq!(ids(&page(&storage, Some(3))), (vec![], true));
        assert_eq!(ids(&page(&storage, Some(4))), (vec![], false));
        assert_eq!(ids(&page(&storage, None)), (vec![], false));
    }
}
