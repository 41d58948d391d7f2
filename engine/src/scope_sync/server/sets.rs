//! The sets of row filters' subqueries (`col IN (SELECT c FROM t WHERE …)`), kept in memory
//! for live routing, and what changes them.
//!
//! A set is the values of `c` over the rows of `t` its filter holds for. Subscriptions whose
//! bound subqueries print alike share one set (a user's projects are one set for all their
//! tabs and tables). A set is read whole from the replica when it is first needed
//! ([`SetStore::acquire`] asks for the read), a set's children (the subqueries in its own
//! filter) first; from then on its table's feed entries keep it ([`SetStore::apply`]), and a
//! change of a child makes it and every set above it be read whole again, because which of
//! its table's rows pass changed without one of them being written. Each read is taken at a
//! high-water, and entries at or below it are already in it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde_json::Value;

use super::{routing_form, FeedChange, FeedEntry};
use crate::scope_sync::rules::row_filter::{RowFilter, SetQuery};

/// A set, as the server numbers them.
pub type SetId = u64;

/// The most rows one set (or one move) may read; a larger one fails its subscriptions.
pub const MAX_SET_ROWS: u32 = 100_000;

/// Values a set took in and let go over one step, by routing form.
#[derive(Debug, Default, Clone, PartialEq)]
pub(super) struct SetDiff {
    pub gained: BTreeMap<String, Value>,
    pub lost: BTreeMap<String, Value>,
}

impl SetDiff {
    fn gain(&mut self, form: String, value: Value) {
        if self.lost.remove(&form).is_none() {
            self.gained.insert(form, value);
        }
    }

    fn lose(&mut self, form: String, value: Value) {
        if self.gained.remove(&form).is_none() {
            self.lost.insert(form, value);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.gained.is_empty() && self.lost.is_empty()
    }

    /// Adds a later step's diff.
    pub fn then(&mut self, later: SetDiff) {
        for (form, value) in later.lost {
            self.lose(form, value);
        }
        for (form, value) in later.gained {
            self.gain(form, value);
        }
    }
}

#[derive(Debug)]
struct SetState {
    query: SetQuery,
    key: String,
    /// The sets of the filter's own subqueries, in the order its leaves are evaluated.
    children: Vec<SetId>,
    parents: BTreeSet<SetId>,
    /// 0 for a set without subqueries; one more than its deepest child otherwise.
    depth: u32,
    /// Subscriptions and parent sets holding it.
    refs: usize,
    /// Rows that pass: resource id → routing form of their value.
    rows: HashMap<String, String>,
    /// Routing form → (a value of that form, rows giving it).
    values: HashMap<String, (Value, usize)>,
    /// The high-water of the last whole read; `None` before the first answer.
    read_at: Option<i64>,
    /// A read is out.
    reading: bool,
    /// A child changed while a first read was out: that read may have missed it.
    stale: bool,
    /// Its table's entries routed while its first read was out.
    pending: Vec<FeedEntry>,
}

/// Every set the server's subscriptions need.
#[derive(Debug, Default)]
pub(super) struct SetStore {
    sets: HashMap<SetId, SetState>,
    by_key: HashMap<String, SetId>,
    by_table: HashMap<String, BTreeSet<SetId>>,
    next: SetId,
}

/// A whole read of a set the server asks for.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SetRead {
    pub set: SetId,
    pub table: String,
    pub filter: RowFilter,
}

/// The subqueries a filter holds directly, in the order [`RowFilter::eval_leaves`] asks them.
pub(super) fn set_leaves(filter: &RowFilter) -> Vec<&SetQuery> {
    fn walk<'a>(filter: &'a RowFilter, out: &mut Vec<&'a SetQuery>) {
        match filter {
            RowFilter::And(items) | RowFilter::Or(items) => {
                items.iter().for_each(|item| walk(item, out))
            }
            RowFilter::Not(item) => walk(item, out),
            RowFilter::Test(..) => {}
            RowFilter::InSet(_, set) => out.push(set),
        }
    }
    let mut out = Vec::new();
    walk(filter, &mut out);
    out
}

impl SetStore {
    /// The set of `query`, made (with its children) if new; new sets whose children are all
    /// known are pushed to `reads`.
    pub fn acquire(&mut self, query: &SetQuery, reads: &mut Vec<SetRead>) -> SetId {
        let key = query.to_string();
        if let Some(id) = self.by_key.get(&key) {
            let id = *id;
            if let Some(set) = self.sets.get_mut(&id) {
                set.refs += 1;
            }
            return id;
        }
        let children: Vec<SetId> = set_leaves(&query.filter)
            .into_iter()
            .map(|child| self.acquire(child, reads))
            .collect();
        self.next += 1;
        let id = self.next;
        let depth = children
            .iter()
            .filter_map(|child| self.sets.get(child))
            .map(|child| child.depth + 1)
            .max()
            .unwrap_or(0);
        for child in &children {
            if let Some(child) = self.sets.get_mut(child) {
                child.parents.insert(id);
            }
        }
        self.sets.insert(
            id,
            SetState {
                query: query.clone(),
                key: key.clone(),
                children,
                parents: BTreeSet::new(),
                depth,
                refs: 1,
                rows: HashMap::new(),
                values: HashMap::new(),
                read_at: None,
                reading: false,
                stale: false,
                pending: Vec::new(),
            },
        );
        self.by_key.insert(key, id);
        self.by_table
            .entry(query.table.clone())
            .or_default()
            .insert(id);
        self.read_if_ready(id, reads);
        id
    }

    /// Lets go of one hold on a set; a set nobody holds is dropped with its holds on its
    /// children.
    pub fn release(&mut self, id: SetId) {
        let Some(set) = self.sets.get_mut(&id) else {
            return;
        };
        set.refs -= 1;
        if set.refs > 0 {
            return;
        }
        let Some(set) = self.sets.remove(&id) else {
            return;
        };
        self.by_key.remove(&set.key);
        if let Some(ids) = self.by_table.get_mut(&set.query.table) {
            ids.remove(&id);
            if ids.is_empty() {
                self.by_table.remove(&set.query.table);
            }
        }
        for child in set.children {
            if let Some(state) = self.sets.get_mut(&child) {
                state.parents.remove(&id);
            }
            self.release(child);
        }
    }

    /// Whether the set and every set below it have been read.
    pub fn ready(&self, id: SetId) -> bool {
        self.sets.get(&id).is_some_and(|set| {
            set.read_at.is_some() && set.children.iter().all(|child| self.ready(*child))
        })
    }

    /// Whether a value is in the set.
    pub fn contains(&self, id: SetId, value: &Value) -> bool {
        self.sets
            .get(&id)
            .is_some_and(|set| set.values.contains_key(&routing_form(value)))
    }

    /// The set's values now, in routing form.
    pub fn forms(&self, id: SetId) -> Vec<String> {
        self.sets
            .get(&id)
            .map_or_else(Vec::new, |set| set.values.keys().cloned().collect())
    }

    /// Whether `filter` (whose direct subqueries are `ids`, in leaf order) is true for a row.
    pub fn matches(
        &self,
        filter: &RowFilter,
        ids: &[SetId],
        row: &serde_json::Map<String, Value>,
    ) -> bool {
        let mut next = ids.iter();
        filter.eval_leaves(&mut |leaf| match leaf {
            RowFilter::InSet(column, _) => {
                let id = next.next().copied();
                match row.get(column) {
                    None | Some(Value::Null) => None,
                    Some(value) => Some(id.is_some_and(|id| self.contains(id, value))),
                }
            }
            RowFilter::Test(..) => RowFilter::eval(leaf, row),
            _ => None,
        }) == Some(true)
    }

    /// Applies one committed transaction's entries to the sets over their tables, children
    /// before parents; returns what each set that changed took in and let go.
    pub fn apply(&mut self, entries: &[FeedEntry]) -> BTreeMap<SetId, SetDiff> {
        let mut touched: Vec<(u32, SetId)> = Vec::new();
        for entry in entries {
            for id in self.by_table.get(&entry.table).into_iter().flatten() {
                let depth = self.sets.get(id).map_or(0, |set| set.depth);
                if !touched.contains(&(depth, *id)) {
                    touched.push((depth, *id));
                }
            }
        }
        touched.sort_unstable();
        let mut diffs: BTreeMap<SetId, SetDiff> = BTreeMap::new();
        for (_, id) in touched {
            let Some(table) = self.sets.get(&id).map(|set| set.query.table.clone()) else {
                continue;
            };
            let mut diff = SetDiff::default();
            for entry in entries.iter().filter(|entry| entry.table == table) {
                self.apply_entry(id, entry, &mut diff);
            }
            if !diff.is_empty() {
                diffs.insert(id, diff);
            }
        }
        diffs
    }

    fn apply_entry(&mut self, id: SetId, entry: &FeedEntry, diff: &mut SetDiff) {
        let Some(set) = self.sets.get(&id) else {
            return;
        };
        let Some(read_at) = set.read_at else {
            if let Some(set) = self.sets.get_mut(&id) {
                set.pending.push(entry.clone());
            }
            return;
        };
        if entry.seq <= read_at {
            return;
        }
        let value = match &entry.change {
            FeedChange::Upsert { data } => {
                if self.matches(&set.query.filter, &set.children, data) {
                    data.get(&set.query.column)
                        .filter(|value| !value.is_null())
                        .cloned()
                } else {
                    None
                }
            }
            // Gone under this key; an exit with a new row comes with that row's upsert.
            FeedChange::Exit { new: None, .. } => None,
            FeedChange::Exit { new: Some(_), .. } => return,
        };
        self.put(id, &entry.resource_id, value, diff);
    }

    /// Sets (or, with `None`, removes) one row's value.
    fn put(&mut self, id: SetId, resource_id: &str, value: Option<Value>, diff: &mut SetDiff) {
        let Some(set) = self.sets.get_mut(&id) else {
            return;
        };
        let form = value.as_ref().map(routing_form);
        let old = match &form {
            Some(form) => set.rows.insert(resource_id.to_owned(), form.clone()),
            None => set.rows.remove(resource_id),
        };
        if old == form {
            return;
        }
        if let Some(old) = old {
            if let Some((value, count)) = set.values.get_mut(&old) {
                *count -= 1;
                if *count == 0 {
                    let value = value.clone();
                    set.values.remove(&old);
                    diff.lose(old, value);
                }
            }
        }
        if let (Some(form), Some(value)) = (form, value) {
            let slot = set.values.entry(form.clone()).or_insert((value.clone(), 0));
            slot.1 += 1;
            if slot.1 == 1 {
                diff.gain(form, value);
            }
        }
    }

    /// Every set above these (parents, their parents, …), which must be read again.
    pub fn ancestors(&self, ids: impl IntoIterator<Item = SetId>) -> BTreeSet<SetId> {
        let mut out = BTreeSet::new();
        let mut todo: Vec<SetId> = ids.into_iter().collect();
        while let Some(id) = todo.pop() {
            for parent in self
                .sets
                .get(&id)
                .map(|set| &set.parents)
                .into_iter()
                .flatten()
            {
                if out.insert(*parent) {
                    todo.push(*parent);
                }
            }
        }
        out
    }

    /// Asks to read a set again (its child changed). A set whose first read is out is read
    /// again once it answers; `false` when no read is needed now.
    pub fn reread(&mut self, id: SetId, reads: &mut Vec<SetRead>) -> bool {
        let Some(set) = self.sets.get_mut(&id) else {
            return false;
        };
        if set.reading {
            set.stale = true;
            return false;
        }
        if set.read_at.is_none() {
            // Waiting for its children's first reads: it is read after them.
            return false;
        }
        set.reading = true;
        reads.push(SetRead {
            set: id,
            table: set.query.table.clone(),
            filter: set.query.filter.clone(),
        });
        true
    }

    /// Reads a new set whose children have all been read.
    fn read_if_ready(&mut self, id: SetId, reads: &mut Vec<SetRead>) {
        let ready = self.sets.get(&id).is_some_and(|set| {
            !set.reading
                && set.read_at.is_none()
                && set
                    .children
                    .iter()
                    .all(|child| self.sets.get(child).is_some_and(|c| c.read_at.is_some()))
        });
        if !ready {
            return;
        }
        if let Some(set) = self.sets.get_mut(&id) {
            set.reading = true;
            reads.push(SetRead {
                set: id,
                table: set.query.table.clone(),
                filter: set.query.filter.clone(),
            });
        }
    }

    /// A whole read came back: `rows` are the rows that pass at high-water `up_to`. Returns
    /// what the set took in and let go since its last read, and whether this was its first
    /// read, and
    /// pushes the reads that follow (its parents', once their children are all read; its own
    /// again, if a child changed while it was read). `None` for a set no longer held.
    pub fn read(
        &mut self,
        id: SetId,
        up_to: i64,
        rows: &[FeedEntry],
        reads: &mut Vec<SetRead>,
    ) -> Option<(SetDiff, bool)> {
        let set = self.sets.get_mut(&id)?;
        set.reading = false;
        let first = set.read_at.is_none();
        if std::mem::take(&mut set.stale) && first {
            // Its children changed while it was read: the read may predate a change.
            set.reading = true;
            reads.push(SetRead {
                set: id,
                table: set.query.table.clone(),
                filter: set.query.filter.clone(),
            });
            return Some((SetDiff::default(), true));
        }
        let column = set.query.column.clone();
        let mut diff = SetDiff::default();
        let fresh: HashMap<&str, Value> = rows
            .iter()
            .filter_map(|row| match &row.change {
                FeedChange::Upsert { data } => data
                    .get(&column)
                    .filter(|value| !value.is_null())
                    .map(|value| (row.resource_id.as_str(), value.clone())),
                FeedChange::Exit { .. } => None,
            })
            .collect();
        let held: Vec<String> = set.rows.keys().cloned().collect();
        for resource_id in held {
            if !fresh.contains_key(resource_id.as_str()) {
                self.put(id, &resource_id, None, &mut diff);
            }
        }
        for (resource_id, value) in fresh {
            self.put(id, resource_id, Some(value), &mut diff);
        }
        let set = self.sets.get_mut(&id)?;
        set.read_at = Some(up_to);
        let pending = std::mem::take(&mut set.pending);
        let parents: Vec<SetId> = set.parents.iter().copied().collect();
        for entry in &pending {
            self.apply_entry(id, entry, &mut diff);
        }
        if first {
            for parent in parents {
                self.read_if_ready(parent, reads);
            }
        }
        Some((diff, first))
    }

    /// Sets held now.
    pub fn len(&self) -> usize {
        self.sets.len()
    }
}
