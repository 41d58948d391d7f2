//! The scope feed: what the replica keeps so scope-sync subscribers can catch up and be routed
//! live (catch-up after a cursor, then live delivery, as velocious' sync server does).
//!
//! The feed's rules are the engine's (`highwater_engine::scope_sync::feed`, which the
//! simulation's storage calls too); this module does the replica's reading and writing around
//! them. For the tables a rules file opens to scope sync, the writer records, per upstream
//! transaction:
//! - the rows it wrote, with their `_hw_seq` and the transaction's commit time in
//!   `_hw_updated_at` (the entries' `updatedAt`);
//! - an **exit** for every row that left some scope: [`Capture`] reads a changed row's key and
//!   scope-column values before the change and after it, and [`exits`] says which exits that
//!   records (deleted, its key changed, or updated so a scope column changed), at the seq of the
//!   write that caused it, and which are journalled in `_hw_exits` for catch-up. Rows removed
//!   by a truncate are routed live; in catch-up the table's truncate marker answers an older
//!   cursor with a reset.
//!
//! Seqs stay exactly those the writer assigns without a rules file: exits never take one, so a
//! relay with other rules (or none) assigns the same seqs as its primary.
//!
//! [`read_scope_page`] answers one replay page in one read transaction: rows of a scope after a
//! cursor up to a high-water, by index range scans (`(column, _hw_seq)` for every filter
//! column, an expression index on `_hw_exits` for old values), merged by [`page_entries`]. The
//! exits a page carries are those [`exit_leaves`](highwater_engine::scope_sync::feed::exit_leaves)
//! says left the scope; the read renders that rule in SQL, so the exits' index narrows it, its
//! LIMIT counts only exits the page carries, and each subquery's set is read once (the tests
//! hold the SQL to the engine's rule). [`prune_exits`] drops exits older than the retention
//! window and raises the retention floor.
//!
//! A transaction's entries ([`commit_entries`]) are built in memory at its commit
//! ([`CommittedChanges`]) and held there until they are routed, once the commit is durable: a
//! very large transaction on a followed table needs that memory. The feed does not follow a
//! followed table's rename or drop: nothing is recorded for it, and the table's subscribers
//! keep their rows until they subscribe again.

use std::collections::{BTreeMap, HashMap};

use highwater_engine::change_stream::{Change, JsonFormat};
use highwater_engine::scope_sync::feed::{
    commit_entries, exits, page_entries, Exit, RowChange, ScopedRow,
};
use highwater_engine::scope_sync::rules::row_filter::{RowFilter, SetQuery};
use highwater_engine::scope_sync::server::{FeedChange, FeedEntry};
use highwater_engine::scope_sync::{
    js_string_form, operand_bool, operand_number, operand_text, Conditions, Test,
};
use highwater_engine::watermark::Watermark;
use rusqlite::types::Value as SqlValue;
use rusqlite::{params, params_from_iter, Connection, OptionalExtension};
use serde_json::{Map, Value};

use super::schema::{quote_ident, replica_table_name, ReplicaColumn, ReplicaTable, ValueKind};
use super::value::from_sql;
use super::ReplicaError;

/// Internal tables of the scope feed.
pub(super) const FEED_TABLES_SQL: &str = r#"
-- Rows that left a scope: old (and, for an update, new) scope-column values, at the seq of the
-- write that moved or removed them.
CREATE TABLE IF NOT EXISTS "_hw_exits" (
    "table_name" TEXT NOT NULL,
    "resource_id" TEXT NOT NULL,
    "seq" INTEGER NOT NULL,
    "old_values" TEXT NOT NULL,
    "new_values" TEXT,
    "updated_at" TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS "_hw_exits_seq" ON "_hw_exits" ("table_name", "seq");
CREATE INDEX IF NOT EXISTS "_hw_exits_age" ON "_hw_exits" ("updated_at");
-- Single row: seqs at or below `floor` may have lost their exits (to retention, or because
-- they happened before the feed followed the tables and columns in `config`).
CREATE TABLE IF NOT EXISTS "_hw_feed_state" (
    "lock" INTEGER PRIMARY KEY CHECK ("lock" = 1),
    "floor" INTEGER NOT NULL,
    "config" TEXT
);
"#;

/// The `updatedAt` of rows written before the feed knew their commit time (initial sync).
pub(crate) const UNKNOWN_COMMIT_TIME: &str = "1970-01-01T00:00:00.000Z";

/// Tables open to scope sync, with the columns a scope may filter on.
pub(crate) type FeedTables = HashMap<String, Vec<String>>;

/// One entry of the scope feed: a row as written, or a row leaving scopes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FeedRow {
    /// Replica table name.
    pub table: String,
    /// The key as text: the value for a one-column key, else the JSON array of key values.
    pub resource_id: String,
    pub seq: i64,
    /// The upstream commit time, ISO-8601 with milliseconds.
    pub updated_at: String,
    pub kind: FeedKind,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum FeedKind {
    /// The row as it now is (every column).
    Upsert { data: Map<String, Value> },
    /// The row left every scope matching `old` but not `new` (`new` is `None` when the row is
    /// gone under this key).
    Exit {
        old: Map<String, Value>,
        new: Option<Map<String, Value>>,
    },
}

impl From<FeedEntry> for FeedRow {
    fn from(entry: FeedEntry) -> Self {
        FeedRow {
            table: entry.table,
            resource_id: entry.resource_id,
            seq: entry.seq,
            updated_at: entry.updated_at,
            kind: match entry.change {
                FeedChange::Upsert { data } => FeedKind::Upsert { data },
                FeedChange::Exit { old, new } => FeedKind::Exit { old, new },
            },
        }
    }
}

impl FeedRow {}

/// The feed entries of one committed upstream transaction, ascending by seq.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct CommittedChanges {
    pub rows: Vec<FeedRow>,
    /// The upstream commit time (Unix ms), when known.
    pub(crate) commit_ms: Option<i64>,
    /// The sync clients' mutations the transaction applied (client id, mutation id).
    pub confirms: Vec<(String, u64)>,
}

/// What the writer captures for the feed.
#[derive(Debug, Default)]
pub(super) struct Capture {
    tables: FeedTables,
    /// Per table written in the open transaction: the first seq it took.
    touched: BTreeMap<String, i64>,
    /// The open transaction's exits, as the engine's rules record them.
    exits: Vec<Exit>,
}

/// What a change needs remembered from before it is applied.
#[derive(Debug)]
pub(super) enum Pre {
    None,
    Touch(String),
    Update {
        table: String,
        before: Option<ScopedRow>,
        new_key: Vec<(String, SqlValue)>,
    },
    Delete {
        table: String,
        before: Option<ScopedRow>,
    },
    Truncate(Vec<(String, Vec<ScopedRow>)>),
}

impl Capture {
    pub(super) fn new(tables: FeedTables) -> Capture {
        Capture {
            tables,
            ..Capture::default()
        }
    }

    fn scope_columns(&self, table: &str) -> Option<&[String]> {
        self.tables.get(table).map(Vec::as_slice)
    }

    /// Reads what `change` will overwrite, for the tables the feed follows.
    pub(super) fn before(
        &self,
        conn: &Connection,
        tables: &HashMap<String, ReplicaTable>,
        change: &Change,
        json: JsonFormat,
    ) -> Result<Pre, ReplicaError> {
        let followed = |schema: &str, name: &str| {
            let name = replica_table_name(schema, name);
            self.tables
                .contains_key(&name)
                .then(|| tables.get(&name))
                .flatten()
        };
        Ok(match change {
            Change::Insert(insert) => {
                match followed(&insert.relation.schema, &insert.relation.name) {
                    Some(table) => Pre::Touch(table.name.clone()),
                    None => Pre::None,
                }
            }
            Change::Backfill(backfill) => {
                match followed(&backfill.relation.schema, &backfill.relation.name) {
                    Some(table) => Pre::Touch(table.name.clone()),
                    None => Pre::None,
                }
            }
            // A column added with a default the replica applies gives every row a new value
            // (and seq): live subscribers must get those rows too, not only catch-up replays.
            Change::AddColumn(add) => match followed(&add.table.schema, &add.table.name) {
                Some(table) => Pre::Touch(table.name.clone()),
                None => Pre::None,
            },
            Change::Update(update) => {
                let Some(table) = followed(&update.relation.schema, &update.relation.name) else {
                    return Ok(Pre::None);
                };
                let scope = self.scope_columns(&table.name).unwrap_or_default();
                let new_key = key_of(table, &update.new, json);
                let old_key = update.key.as_ref().map(|k| key_of(table, k, json));
                let target = match (&old_key, &new_key) {
                    (Some(Some(old)), _) => Some(old.clone()),
                    (_, Some(new)) => Some(new.clone()),
                    _ => None,
                };
                let before = match &target {
                    Some(key) => read_before(conn, table, scope, key)?,
                    None => None,
                };
                let new_key = new_key.or_else(|| old_key.flatten()).unwrap_or_default();
                Pre::Update {
                    table: table.name.clone(),
                    before,
                    new_key,
                }
            }
            Change::Delete(delete) => {
                let Some(table) = followed(&delete.relation.schema, &delete.relation.name) else {
                    return Ok(Pre::None);
                };
                let scope = self.scope_columns(&table.name).unwrap_or_default();
                let before = match key_of(table, &delete.key, json) {
                    Some(key) => read_before(conn, table, scope, &key)?,
                    None => None,
                };
                Pre::Delete {
                    table: table.name.clone(),
                    before,
                }
            }
            Change::Truncate(truncate) => {
                let mut all = Vec::new();
                for relation in &truncate.relations {
                    if let Some(table) = followed(&relation.schema, &relation.name) {
                        let scope = self.scope_columns(&table.name).unwrap_or_default();
                        all.push((table.name.clone(), read_all(conn, table, scope)?));
                    }
                }
                if all.is_empty() {
                    Pre::None
                } else {
                    Pre::Truncate(all)
                }
            }
            _ => Pre::None,
        })
    }

    /// Records what `change` did, given what was read before it and the seqs it took
    /// (`seq_before..seq_after`): the tables it wrote, and the exits the engine's rules
    /// ([`exits`]) find in what the replica held before and holds now.
    pub(super) fn after(
        &mut self,
        conn: &Connection,
        tables: &HashMap<String, ReplicaTable>,
        pre: Pre,
        seq_before: i64,
        seq_after: i64,
    ) -> Result<(), ReplicaError> {
        if seq_after == seq_before {
            return Ok(());
        }
        match pre {
            Pre::None => {}
            Pre::Touch(table) => self.touch(table, seq_before),
            Pre::Update {
                table,
                before,
                new_key,
            } => {
                self.touch(table.clone(), seq_before);
                // A row the replica did not hold leaves no scope: nothing to read back.
                let (Some(before), Some(replica_table)) = (before, tables.get(&table)) else {
                    return Ok(());
                };
                let scope = self.scope_columns(&table).unwrap_or_default().to_vec();
                let now = read_before(conn, replica_table, &scope, &new_key)?;
                let now_seq = read_seq(conn, replica_table, &new_key)?;
                let change = RowChange::Updated {
                    before: Some(before),
                    after: now.zip(now_seq),
                    seqs: seq_before..seq_after,
                };
                self.exits.extend(exits(&table, change));
            }
            Pre::Delete { table, before } => {
                let change = RowChange::Deleted {
                    before,
                    seqs: seq_before..seq_after,
                };
                self.exits.extend(exits(&table, change));
            }
            Pre::Truncate(all) => {
                // Each truncated table takes one seq, in order (`apply_truncate`); unfollowed
                // tables in the same message take theirs too, so the marker seq is read back.
                for (table, rows) in all {
                    let marker = truncate_seq(conn, &table)?.unwrap_or(seq_after - 1);
                    self.touch(table.clone(), marker);
                    self.exits
                        .extend(exits(&table, RowChange::Truncated { rows, marker }));
                }
            }
        }
        Ok(())
    }

    fn touch(&mut self, table: String, seq: i64) {
        self.touched.entry(table).or_insert(seq);
    }

    /// Forgets the open transaction (rolled back).
    pub(super) fn discard(&mut self) {
        self.touched.clear();
        self.exits.clear();
    }

    /// Inside the transaction, just before its COMMIT: stamps the commit time on the rows it
    /// wrote, journals its exits, and returns its feed entries ([`commit_entries`]).
    pub(super) fn commit(
        &mut self,
        conn: &Connection,
        tables: &HashMap<String, ReplicaTable>,
        updated_at: &str,
    ) -> Result<CommittedChanges, ReplicaError> {
        let mut rows = Vec::new();
        for (name, first_seq) in std::mem::take(&mut self.touched) {
            let Some(table) = tables.get(&name) else {
                continue;
            };
            let cols = select_list(table);
            let sql = format!(
                r#"UPDATE {} SET "_hw_updated_at" = ?1 WHERE "_hw_seq" >= ?2 RETURNING {cols}, "_hw_seq""#,
                quote_ident(&table.name)
            );
            let mut stmt = conn.prepare_cached(&sql)?;
            let mut result = stmt.query(params![updated_at, first_seq])?;
            while let Some(r) = result.next()? {
                let data = row_data(table, r)?;
                let seq: i64 = r.get(table.columns.len())?;
                rows.push(FeedEntry {
                    table: table.name.clone(),
                    resource_id: resource_id(table, &data),
                    seq,
                    updated_at: updated_at.to_owned(),
                    change: FeedChange::Upsert { data },
                });
            }
        }
        let exits = std::mem::take(&mut self.exits);
        let mut journal = conn.prepare_cached(
            r#"INSERT INTO "_hw_exits"
                 ("table_name","resource_id","seq","old_values","new_values","updated_at")
               VALUES (?1, ?2, ?3, ?4, ?5, ?6)"#,
        )?;
        for exit in exits.iter().filter(|exit| exit.journal) {
            journal.execute(params![
                exit.table,
                exit.resource_id,
                exit.seq,
                serde_json::to_string(&exit.old)?,
                exit.new.as_ref().map(serde_json::to_string).transpose()?,
                updated_at,
            ])?;
        }
        Ok(CommittedChanges {
            rows: commit_entries(rows, exits, updated_at)
                .into_iter()
                .map(FeedRow::from)
                .collect(),
            commit_ms: None,
            confirms: Vec::new(),
        })
    }
}

/// Records, in the open transaction committed at `watermark`, the sync clients' mutations
/// it applies: each client's last mutation id only grows.
pub(super) fn record_confirms(
    conn: &Connection,
    confirms: &[(String, u64)],
    watermark: &Watermark,
) -> Result<(), ReplicaError> {
    let mut stmt = conn.prepare_cached(
        r#"INSERT INTO "_hw_client_mutations" ("client_id", "last_mutation_id", "watermark")
           VALUES (?1, ?2, ?3)
           ON CONFLICT ("client_id") DO UPDATE
           SET "last_mutation_id" = excluded."last_mutation_id", "watermark" = excluded."watermark"
           WHERE excluded."last_mutation_id" > "last_mutation_id""#,
    )?;
    for (client_id, mutation_id) in confirms {
        // Postgres numbers them as bigint: one past i64 cannot come from `highwater.confirm`.
        let Ok(mutation_id) = i64::try_from(*mutation_id) else {
            continue;
        };
        stmt.execute(params![client_id, mutation_id, watermark.as_str()])?;
    }
    Ok(())
}

/// A sync client's last mutation the replica holds, and the commit watermark of the
/// transaction that applied it.
pub(crate) fn client_mutation(
    conn: &Connection,
    client_id: &str,
) -> Result<Option<(u64, Watermark)>, ReplicaError> {
    let row: Option<(i64, String)> = conn
        .prepare_cached(
            r#"SELECT "last_mutation_id", "watermark" FROM "_hw_client_mutations"
               WHERE "client_id" = ?1"#,
        )?
        .query_row([client_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    match row {
        None => Ok(None),
        Some((id, watermark)) => Ok(Some((
            u64::try_from(id).unwrap_or(0),
            Watermark::parse(&watermark)?,
        ))),
    }
}

/// A replica row and its `_hw_seq` (a sync entry's `serverSequence`).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct VersionedRow {
    pub data: Map<String, Value>,
    pub seq: i64,
}

/// The row of `table` whose key `key_row` names (as the change stream's JSON), with its
/// `_hw_seq`; `None` when the replica has no such row (or `key_row` lacks a key column).
pub(crate) fn row_with_seq(
    conn: &Connection,
    table: &ReplicaTable,
    key_row: &Map<String, Value>,
) -> Result<Option<VersionedRow>, ReplicaError> {
    let Some(key) = key_of(table, key_row, JsonFormat::Parsed) else {
        return Ok(None);
    };
    let sql = format!(
        "SELECT {}, \"_hw_seq\" FROM {} WHERE {} LIMIT 1",
        select_list(table),
        quote_ident(&table.name),
        where_key(&key, 1)
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let mut rows = stmt.query(params_from_iter(key.iter().map(|(_, v)| v)))?;
    let Some(r) = rows.next()? else {
        return Ok(None);
    };
    let data = row_data(table, r)?;
    let seq: i64 = r.get(table.columns.len())?;
    Ok(Some(VersionedRow { data, seq }))
}

/// Creates the feed's tables, the commit-time column and the scope indexes of `tables`.
pub(super) fn prepare(
    conn: &Connection,
    replica_tables: &HashMap<String, ReplicaTable>,
    tables: &FeedTables,
) -> Result<(), ReplicaError> {
    conn.execute_batch(FEED_TABLES_SQL)?;
    // Exits were only journalled for what the feed followed: a table or filter column newly
    // followed has no exits before now, so older cursors must reset.
    let config = serde_json::to_string(&tables.iter().collect::<BTreeMap<_, _>>())?;
    let stored: Option<Option<String>> = conn
        .query_row(
            r#"SELECT "config" FROM "_hw_feed_state" WHERE "lock" = 1"#,
            [],
            |r| r.get(0),
        )
        .optional()?;
    if stored.flatten().as_deref() != Some(config.as_str()) {
        let last_seq: i64 = conn
            .query_row(
                r#"SELECT "next_seq" - 1 FROM "_hw_state" WHERE "lock" = 1"#,
                [],
                |r| r.get(0),
            )
            .optional()?
            .unwrap_or(0);
        conn.execute(
            r#"INSERT INTO "_hw_feed_state" ("lock","floor","config") VALUES (1, ?1, ?2)
               ON CONFLICT ("lock") DO UPDATE
               SET "floor" = max("floor", excluded."floor"), "config" = excluded."config""#,
            params![last_seq, config],
        )?;
    }
    for (name, columns) in tables {
        let Some(table) = replica_tables.get(name) else {
            continue;
        };
        ensure_updated_at(conn, &table.name)?;
        for column in columns {
            if table.column(column).is_none() {
                continue;
            }
            conn.execute_batch(&format!(
                "CREATE INDEX IF NOT EXISTS {} ON {} ({}, \"_hw_seq\");
                 CREATE INDEX IF NOT EXISTS {} ON \"_hw_exits\" (\"table_name\", {}, \"seq\");",
                quote_ident(&format!("{}_hw_scope_{}", table.name, column)),
                quote_ident(&table.name),
                quote_ident(column),
                quote_ident(&format!("_hw_exits_{}_{}", table.name, column)),
                json_path_expr("old_values", column),
            ))?;
        }
    }
    Ok(())
}

/// Adds `_hw_updated_at` to a replica table created before the column existed.
pub(super) fn ensure_updated_at(conn: &Connection, table: &str) -> Result<(), ReplicaError> {
    let has: bool = conn
        .prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM pragma_table_info(?1) WHERE name = '_hw_updated_at')",
        )?
        .query_row([table], |r| r.get(0))?;
    if !has {
        conn.execute_batch(&format!(
            "ALTER TABLE {} ADD COLUMN \"_hw_updated_at\" TEXT",
            quote_ident(table)
        ))?;
    }
    Ok(())
}

/// `json_extract(<col>, '$."<column>"')`, written the same way everywhere so the expression
/// indexes are usable.
fn json_path_expr(json_col: &str, column: &str) -> String {
    json_extract(&quote_ident(json_col), column)
}

/// `json_extract(<json>, '$."<column>"')`, `json` an SQL expression.
fn json_extract(json: &str, column: &str) -> String {
    let path = format!("$.\"{}\"", column.replace('"', "\\\""));
    format!("json_extract({json}, '{}')", path.replace('\'', "''"))
}

fn select_list(table: &ReplicaTable) -> String {
    if table.columns.is_empty() {
        return "NULL".to_owned();
    }
    table
        .columns
        .iter()
        .map(|c| quote_ident(&c.name))
        .collect::<Vec<_>>()
        .join(", ")
}

fn row_data(
    table: &ReplicaTable,
    r: &rusqlite::Row<'_>,
) -> Result<Map<String, Value>, ReplicaError> {
    let mut data = Map::new();
    for (i, col) in table.columns.iter().enumerate() {
        data.insert(
            col.name.clone(),
            from_sql(col, r.get_ref(i)?, JsonFormat::Parsed),
        );
    }
    Ok(data)
}

/// The key of a row as text: the value of a one-column key, else the JSON array of the values.
pub fn resource_id(table: &ReplicaTable, data: &Map<String, Value>) -> String {
    let key = table.match_columns();
    if key.len() == 1 {
        return js_string_form(data.get(&key[0]).unwrap_or(&Value::Null));
    }
    Value::Array(
        key.iter()
            .map(|k| data.get(k).cloned().unwrap_or(Value::Null))
            .collect(),
    )
    .to_string()
}

/// The key values of a change row, bound for SQLite; `None` when a key column is missing.
fn key_of(
    table: &ReplicaTable,
    row: &highwater_engine::change_stream::Row,
    json: JsonFormat,
) -> Option<Vec<(String, SqlValue)>> {
    table
        .match_columns()
        .iter()
        .map(|name| {
            let col = table.column(name)?;
            let value = row.get(name)?;
            Some((name.clone(), super::value::to_sql(col, value, json)))
        })
        .collect()
}

fn where_key(key: &[(String, SqlValue)], first: usize) -> String {
    if key.is_empty() {
        return "0".to_owned();
    }
    key.iter()
        .enumerate()
        .map(|(i, (name, _))| format!("{} = ?{}", quote_ident(name), first + i))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// `"a", "b", …`: the quoted names of `cols`, for a SELECT list.
fn column_list(cols: &[&ReplicaColumn]) -> String {
    cols.iter()
        .map(|c| quote_ident(&c.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Key and scope values of the row at `key`, if it exists.
fn read_before(
    conn: &Connection,
    table: &ReplicaTable,
    scope: &[String],
    key: &[(String, SqlValue)],
) -> Result<Option<ScopedRow>, ReplicaError> {
    let cols = feed_columns(table, scope);
    let sql = format!(
        "SELECT {} FROM {} WHERE {} LIMIT 1",
        column_list(&cols),
        quote_ident(&table.name),
        where_key(key, 1)
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let mut rows = stmt.query(params_from_iter(key.iter().map(|(_, v)| v)))?;
    let Some(r) = rows.next()? else {
        return Ok(None);
    };
    Ok(Some(before_of(table, scope, &cols, r)?))
}

fn read_seq(
    conn: &Connection,
    table: &ReplicaTable,
    key: &[(String, SqlValue)],
) -> Result<Option<i64>, ReplicaError> {
    let sql = format!(
        "SELECT \"_hw_seq\" FROM {} WHERE {} LIMIT 1",
        quote_ident(&table.name),
        where_key(key, 1)
    );
    Ok(conn
        .prepare_cached(&sql)?
        .query_row(params_from_iter(key.iter().map(|(_, v)| v)), |r| r.get(0))
        .optional()?)
}

fn read_all(
    conn: &Connection,
    table: &ReplicaTable,
    scope: &[String],
) -> Result<Vec<ScopedRow>, ReplicaError> {
    let cols = feed_columns(table, scope);
    let sql = format!(
        "SELECT {} FROM {}",
        column_list(&cols),
        quote_ident(&table.name),
    );
    let mut stmt = conn.prepare(&sql)?;
    let mut rows = stmt.query([])?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        out.push(before_of(table, scope, &cols, r)?);
    }
    Ok(out)
}

fn truncate_seq(conn: &Connection, table: &str) -> Result<Option<i64>, ReplicaError> {
    Ok(conn
        .prepare_cached(
            r#"SELECT max("seq") FROM "_hw_tombstones" WHERE "table_name" = ?1 AND "row_key" IS NULL"#,
        )?
        .query_row([table], |r| r.get(0))?)
}

/// Key columns, then scope columns (each once).
fn feed_columns<'t>(table: &'t ReplicaTable, scope: &[String]) -> Vec<&'t ReplicaColumn> {
    let mut cols: Vec<&ReplicaColumn> = Vec::new();
    for name in table.match_columns().iter().chain(scope) {
        if let Some(col) = table.column(name) {
            if !cols.iter().any(|c| c.name == col.name) {
                cols.push(col);
            }
        }
    }
    cols
}

fn before_of(
    table: &ReplicaTable,
    scope: &[String],
    cols: &[&ReplicaColumn],
    r: &rusqlite::Row<'_>,
) -> Result<ScopedRow, ReplicaError> {
    let mut values = Map::new();
    for (i, col) in cols.iter().enumerate() {
        values.insert(
            col.name.clone(),
            from_sql(col, r.get_ref(i)?, JsonFormat::Parsed),
        );
    }
    let resource_id = resource_id(table, &values);
    values.retain(|name, _| scope.contains(name));
    Ok(ScopedRow {
        resource_id,
        values,
    })
}

/// One replay page of a scope.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ScopeQuery<'a> {
    pub table: &'a str,
    /// The scope's conditions on filter columns.
    pub conditions: &'a Conditions,
    /// The table's row filter for the subscriber, if the rules give one.
    pub row_filter: Option<&'a RowFilter>,
    /// Rows strictly after this seq; `None` replays the whole scope (no exits needed).
    pub after: Option<i64>,
    /// The pinned high-water; `None` on the first page (then read in the same transaction).
    pub up_to: Option<i64>,
    pub limit: u32,
    /// Count the scope's rows in `(after, up_to]` (the first page's progress total).
    pub(crate) count_total: bool,
    /// Sets (a row filter's subqueries) to answer for: whether any may have changed in
    /// `(after, up_to]` ([`ScopePage::Rows::access_changed`]).
    pub access: &'a [SetQuery],
}

/// The answer to a [`ScopeQuery`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ScopePage {
    Rows {
        /// The high-water the page used: the last seq assigned when it was read.
        up_to: i64,
        rows: Vec<FeedRow>,
        total: Option<u64>,
        /// The retention floor in the same read transaction as the rows.
        floor: Option<i64>,
        /// Whether a set of [`ScopeQuery::access`] may have changed after the cursor: a row
        /// of its table that passes its filter now, or passed it before an exit, written in
        /// `(after, up_to]`, a truncate of its table since, or the same of a set below it.
        access_changed: bool,
    },
    /// The cursor cannot be resumed: the table was truncated after it.
    Truncated,
    /// The table is not in the replica.
    UnknownTable,
    /// A condition names a column the table does not have.
    UnknownColumn(String),
    /// A condition compares a JSON or array column, which has no order or equality a
    /// condition can state (only `isNull` may test it).
    Incomparable(String),
}

/// Reads one replay page in one read transaction (ended before returning, so no read
/// transaction outlives the call while a socket is slow).
pub(crate) fn read_scope_page(
    conn: &Connection,
    tables: &HashMap<String, ReplicaTable>,
    query: &ScopeQuery<'_>,
) -> Result<ScopePage, ReplicaError> {
    let Some(table) = tables.get(query.table) else {
        return Ok(ScopePage::UnknownTable);
    };
    // Placeholders ?1-?3 are the seq range and the limit.
    let bound = match BoundConditions::new(tables, table, query.conditions, query.row_filter, 4) {
        Ok(bound) => bound,
        Err(refused) => return Ok(refused),
    };
    conn.execute_batch("BEGIN DEFERRED")?;
    let result = read_in_transaction(conn, tables, table, &bound, query);
    let end = conn.execute_batch("COMMIT");
    let page = result?;
    end?;
    Ok(page)
}

fn read_in_transaction(
    conn: &Connection,
    tables: &HashMap<String, ReplicaTable>,
    table: &ReplicaTable,
    bound: &BoundConditions<'_>,
    query: &ScopeQuery<'_>,
) -> Result<ScopePage, ReplicaError> {
    let up_to = match query.up_to {
        Some(up_to) => up_to,
        None => {
            let next: i64 = conn.query_row(
                r#"SELECT "next_seq" FROM "_hw_state" WHERE "lock" = 1"#,
                [],
                |r| r.get(0),
            )?;
            next - 1
        }
    };
    let after = query.after.unwrap_or(0);
    if query.after.is_some() {
        if let Some(truncated) = truncate_seq(conn, &table.name)? {
            if truncated > after {
                return Ok(ScopePage::Truncated);
            }
        }
    }
    let conds = bound.render(|col| quote_ident(&col.name));
    let where_conds = if conds.is_empty() {
        String::new()
    } else {
        format!(" AND {}", conds.join(" AND "))
    };
    let sql = format!(
        r#"SELECT {}, "_hw_seq", "_hw_updated_at" FROM {} WHERE "_hw_seq" > ?1 AND "_hw_seq" <= ?2{where_conds} ORDER BY "_hw_seq" LIMIT ?3"#,
        select_list(table),
        quote_ident(&table.name),
    );
    let params_of = |limit: i64| {
        let mut p: Vec<SqlValue> = vec![
            SqlValue::Integer(after),
            SqlValue::Integer(up_to),
            SqlValue::Integer(limit),
        ];
        p.extend(bound.values.iter().cloned());
        p
    };
    let mut rows = Vec::new();
    {
        let mut stmt = conn.prepare_cached(&sql)?;
        let mut result = stmt.query(params_from_iter(params_of(i64::from(query.limit))))?;
        let n = table.columns.len();
        while let Some(r) = result.next()? {
            let data = row_data(table, r)?;
            rows.push(FeedEntry {
                table: table.name.clone(),
                resource_id: resource_id(table, &data),
                seq: r.get(n)?,
                updated_at: r
                    .get::<_, Option<String>>(n + 1)?
                    .unwrap_or_else(|| UNKNOWN_COMMIT_TIME.to_owned()),
                change: FeedChange::Upsert { data },
            });
        }
    }
    let mut exits = Vec::new();
    if query.after.is_some() {
        // The exits that left the scope ([`exit_leaves`]), selected by the rule rendered in
        // SQL: old values that pass the scope (through the exits' expression indexes) and new
        // values, if any, that do not. A test on a NULL new value is unknown, not false: the
        // row did not stay in, and the exit is the scope's (coalesce, or NOT would leave the
        // unknown unknown). Selected here, its LIMIT counts only exits the page carries.
        let old = bound.render(|col| json_path_expr("old_values", &col.name));
        let new = bound.render(|col| json_path_expr("new_values", &col.name));
        let (old, still_in) = if old.is_empty() {
            // A scope of the whole table: only rows gone under their key left it.
            (String::new(), r#" AND "new_values" IS NULL"#.to_owned())
        } else {
            (
                format!(" AND {}", old.join(" AND ")),
                format!(
                    r#" AND NOT coalesce("new_values" IS NOT NULL AND {}, 0)"#,
                    new.join(" AND ")
                ),
            )
        };
        let table_param = bound.values.len() + 4;
        let sql = format!(
            r#"SELECT "resource_id", "seq", "old_values", "new_values", "updated_at" FROM "_hw_exits"
               WHERE "table_name" = ?{table_param} AND "seq" > ?1 AND "seq" <= ?2{old}{still_in}
               ORDER BY "seq" LIMIT ?3"#
        );
        let mut params = params_of(i64::from(query.limit));
        params.push(SqlValue::Text(table.name.clone()));
        let mut stmt = conn.prepare_cached(&sql)?;
        let mut result = stmt.query(params_from_iter(params))?;
        while let Some(r) = result.next()? {
            let old: String = r.get(2)?;
            let new: Option<String> = r.get(3)?;
            exits.push(FeedEntry {
                table: table.name.clone(),
                resource_id: r.get(0)?,
                seq: r.get(1)?,
                updated_at: r.get(4)?,
                change: FeedChange::Exit {
                    old: object(&old)?,
                    new: new.as_deref().map(object).transpose()?,
                },
            });
        }
    }
    let rows: Vec<FeedRow> = page_entries(rows, exits, query.limit)
        .into_iter()
        .map(FeedRow::from)
        .collect();
    let total = if query.count_total {
        let sql = format!(
            r#"SELECT count(*) FROM {} WHERE "_hw_seq" > ?1 AND "_hw_seq" <= ?2 AND ?3 >= 0{where_conds}"#,
            quote_ident(&table.name),
        );
        let count: i64 = conn
            .prepare_cached(&sql)?
            .query_row(params_from_iter(params_of(0)), |r| r.get(0))?;
        Some(u64::try_from(count).unwrap_or(0))
    } else {
        None
    };
    // In the same transaction as the rows: a prune is the exits' deletion and the floor's
    // rise in one commit, so the page sees both or neither.
    let floor = retention_floor(conn)?;
    let access_changed = match query.after {
        Some(after) if !query.access.is_empty() => {
            match sets_changed(conn, tables, query.access, after, up_to)? {
                Ok(changed) => changed,
                Err(refused) => return Ok(refused),
            }
        }
        _ => false,
    };
    Ok(ScopePage::Rows {
        up_to,
        rows,
        total,
        floor,
        access_changed,
    })
}

/// Whether any of these sets may have changed in `(after, up_to]`: a row of its table written
/// then that passes its filter now, an exit then whose old values passed it, a truncate of its
/// table after `after`, or the same of a set its filter reads. It may say so of a set that did
/// not change (a row that stayed in it), never the other way.
fn sets_changed(
    conn: &Connection,
    tables: &HashMap<String, ReplicaTable>,
    sets: &[SetQuery],
    after: i64,
    up_to: i64,
) -> Result<Result<bool, ScopePage>, ReplicaError> {
    for set in sets {
        let Some(table) = tables.get(&set.table) else {
            return Ok(Err(ScopePage::UnknownTable));
        };
        if truncate_seq(conn, &table.name)?.is_some_and(|truncated| truncated > after) {
            return Ok(Ok(true));
        }
        // Placeholders ?1-?3: the seq range and the table's name.
        let bound =
            match BoundConditions::new(tables, table, &Conditions::default(), Some(&set.filter), 4)
            {
                Ok(bound) => bound,
                Err(refused) => return Ok(Err(refused)),
            };
        let mut params: Vec<SqlValue> = vec![
            SqlValue::Integer(after),
            SqlValue::Integer(up_to),
            SqlValue::Text(table.name.clone()),
        ];
        params.extend(bound.values.iter().cloned());
        let now = bound.render(|col| quote_ident(&col.name)).join(" AND ");
        let old = bound
            .render(|col| json_path_expr("old_values", &col.name))
            .join(" AND ");
        let sql = format!(
            r#"SELECT EXISTS (SELECT 1 FROM {} WHERE "_hw_seq" > ?1 AND "_hw_seq" <= ?2 AND ?3 IS NOT NULL AND ({now}))
                OR EXISTS (SELECT 1 FROM "_hw_exits" WHERE "table_name" = ?3 AND "seq" > ?1 AND "seq" <= ?2 AND ({old}))"#,
            quote_ident(&table.name),
        );
        let changed: bool = conn
            .prepare_cached(&sql)?
            .query_row(params_from_iter(params), |r| r.get(0))?;
        if changed {
            return Ok(Ok(true));
        }
        let below: Vec<SetQuery> = set
            .filter
            .sets()
            .into_iter()
            .map(|(_, set, _)| set.clone())
            .collect();
        if !below.is_empty() {
            match sets_changed(conn, tables, &below, after, up_to)? {
                Ok(false) => {}
                other => return Ok(other),
            }
        }
    }
    Ok(Ok(false))
}

/// Whether `filter` is true for one row of `table`, given as its column values (a missing
/// column is NULL) in the form the replica reads them back in ([`from_sql`]): `None` is
/// unknown. The filter is rendered as for a replay page, over the row's JSON (bound as a
/// parameter, as an exit's old values are read) rather than a stored row, so its tests compare
/// as a read's do and its subqueries read the replica's tables as they are now. A table or
/// column the replica lacks, or a comparison of a JSON column, is an error.
pub(crate) fn row_passes(
    conn: &Connection,
    tables: &HashMap<String, ReplicaTable>,
    table: &str,
    filter: &RowFilter,
    row: &Map<String, Value>,
) -> Result<Option<bool>, ReplicaError> {
    let unanswerable = |reason: String| ReplicaError::UnanswerableFilter {
        table: table.to_owned(),
        reason,
    };
    let Some(replica_table) = tables.get(table) else {
        return Err(unanswerable(
            "of a table the replica does not have".to_owned(),
        ));
    };
    // Placeholder ?1 is the row.
    let bound = match BoundConditions::new(
        tables,
        replica_table,
        &Conditions::default(),
        Some(filter),
        2,
    ) {
        Ok(bound) => bound,
        Err(ScopePage::UnknownColumn(column)) => {
            return Err(unanswerable(format!(
                "reading column {column:?}, which the replica does not have"
            )))
        }
        Err(ScopePage::Incomparable(column)) => {
            return Err(unanswerable(format!(
                "comparing JSON or array column {column:?}"
            )))
        }
        // A subquery's table is missing.
        Err(_) => {
            return Err(unanswerable(
                "reading a table the replica does not have".to_owned(),
            ))
        }
    };
    let test = bound
        .render(|col| json_extract("?1", &col.name))
        .join(" AND ");
    let mut params = vec![SqlValue::Text(Value::Object(row.clone()).to_string())];
    params.extend(bound.values.iter().cloned());
    let answer: Option<i64> = conn
        .prepare_cached(&format!("SELECT ({test})"))?
        .query_row(params_from_iter(params), |r| r.get(0))?;
    Ok(answer.map(|answer| answer != 0))
}

fn object(text: &str) -> Result<Map<String, Value>, ReplicaError> {
    match serde_json::from_str(text)? {
        Value::Object(map) => Ok(map),
        _ => Ok(Map::new()),
    }
}

/// A scope's conditions as SQL over a replica table's columns (or over the JSON of an exit's
/// values), with operands bound as the column stores its values. Each test reads exactly as
/// [`Conditions`] matches a row: an operand the column's type cannot hold matches nothing,
/// NULL passes only `isNull`, text compares by code point (SQLite's `BINARY`).
struct BoundConditions<'a> {
    tables: &'a HashMap<String, ReplicaTable>,
    tests: Vec<(&'a ReplicaColumn, SqlTest)>,
    /// The row filter, ANDed with the tests.
    filter: Option<SqlFilter<'a>>,
    /// The operands, bound from the first placeholder on.
    values: Vec<SqlValue>,
}

/// A row filter's tree with its tests bound.
enum SqlFilter<'a> {
    And(Vec<SqlFilter<'a>>),
    Or(Vec<SqlFilter<'a>>),
    Not(Box<SqlFilter<'a>>),
    Test(&'a ReplicaColumn, SqlTest),
    /// `column IN (SELECT …)`: the subquery's table, selected column and filter.
    InSet(&'a ReplicaColumn, Box<SqlSubquery<'a>>),
}

struct SqlSubquery<'a> {
    table: &'a ReplicaTable,
    column: &'a ReplicaColumn,
    filter: SqlFilter<'a>,
}

/// One test, its operands as placeholder numbers.
enum SqlTest {
    /// No value can pass it.
    Never,
    Compare(&'static str, usize),
    In(Vec<usize>),
    NotIn(Vec<usize>),
    IsNull(bool),
}

impl<'a> BoundConditions<'a> {
    /// Binds `conditions` and the row filter from placeholder `?first` on; `Err` is the
    /// page's answer when a column is missing or cannot be compared.
    fn new(
        tables: &'a HashMap<String, ReplicaTable>,
        table: &'a ReplicaTable,
        conditions: &Conditions,
        row_filter: Option<&RowFilter>,
        first: usize,
    ) -> Result<Self, ScopePage> {
        let mut bound = Self {
            tables,
            tests: Vec::new(),
            filter: None,
            values: Vec::new(),
        };
        for (name, test) in conditions.tests() {
            let leaf = bound.bind_test(table, name, test, first)?;
            bound.tests.push(leaf);
        }
        if let Some(filter) = row_filter {
            bound.filter = Some(bound.bind_filter(table, filter, first)?);
        }
        Ok(bound)
    }

    fn bind_filter(
        &mut self,
        table: &'a ReplicaTable,
        filter: &RowFilter,
        first: usize,
    ) -> Result<SqlFilter<'a>, ScopePage> {
        let all = |items: &[RowFilter], this: &mut Self| {
            items
                .iter()
                .map(|item| this.bind_filter(table, item, first))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(match filter {
            RowFilter::And(items) => SqlFilter::And(all(items, self)?),
            RowFilter::Or(items) => SqlFilter::Or(all(items, self)?),
            RowFilter::Not(item) => SqlFilter::Not(Box::new(self.bind_filter(table, item, first)?)),
            RowFilter::Test(name, test) => {
                let (column, test) = self.bind_test(table, name, test, first)?;
                SqlFilter::Test(column, test)
            }
            RowFilter::InSet(name, set) => {
                let Some(column) = table.column(name) else {
                    return Err(ScopePage::UnknownColumn(name.to_owned()));
                };
                let Some(inner) = self.tables.get(&set.table) else {
                    return Err(ScopePage::UnknownTable);
                };
                let Some(selected) = inner.column(&set.column) else {
                    return Err(ScopePage::UnknownColumn(set.column.clone()));
                };
                let filter = self.bind_filter(inner, &set.filter, first)?;
                SqlFilter::InSet(
                    column,
                    Box::new(SqlSubquery {
                        table: inner,
                        column: selected,
                        filter,
                    }),
                )
            }
        })
    }

    /// One test of column `name`, its operands bound.
    fn bind_test(
        &mut self,
        table: &'a ReplicaTable,
        name: &str,
        test: &Test,
        first: usize,
    ) -> Result<(&'a ReplicaColumn, SqlTest), ScopePage> {
        let Some(column) = table.column(name) else {
            return Err(ScopePage::UnknownColumn(name.to_owned()));
        };
        if matches!(column.kind, ValueKind::Json | ValueKind::Array)
            && !matches!(test, Test::IsNull(_))
        {
            return Err(ScopePage::Incomparable(name.to_owned()));
        }
        let values = &mut self.values;
        let mut bind = |operand: &Value| -> Option<usize> {
            let value = stored_operand(column, operand)?;
            values.push(value);
            Some(first + values.len() - 1)
        };
        let compare = |op, placeholder: Option<usize>| {
            placeholder.map_or(SqlTest::Never, |at| SqlTest::Compare(op, at))
        };
        let sql = match test {
            Test::Eq(operand) => compare("=", bind(operand)),
            Test::Ne(operand) => compare("<>", bind(operand)),
            Test::Lt(operand) => compare("<", bind(operand)),
            Test::Lte(operand) => compare("<=", bind(operand)),
            Test::Gt(operand) => compare(">", bind(operand)),
            Test::Gte(operand) => compare(">=", bind(operand)),
            // Operands the column cannot hold equal nothing: left out.
            Test::In(operands) => {
                let at: Vec<usize> = operands.iter().filter_map(&mut bind).collect();
                if at.is_empty() {
                    SqlTest::Never
                } else {
                    SqlTest::In(at)
                }
            }
            // One operand the column cannot hold makes the test unknown, as a NULL in SQL's
            // NOT IN does.
            Test::NotIn(operands) => {
                let at: Option<Vec<usize>> = operands.iter().map(&mut bind).collect();
                at.map_or(SqlTest::Never, SqlTest::NotIn)
            }
            Test::IsNull(null) => SqlTest::IsNull(*null),
        };
        Ok((column, sql))
    }

    /// Each test, then the row filter, as a SQL boolean over `expr(column)`.
    fn render(&self, expr: impl Fn(&ReplicaColumn) -> String) -> Vec<String> {
        let mut out: Vec<String> = self
            .tests
            .iter()
            .map(|(column, test)| render_test(&expr(column), test))
            .collect();
        if let Some(filter) = &self.filter {
            out.push(render_filter(filter, &expr, 0));
        }
        out
    }
}

/// A filter as SQL over `expr(column)`; a subquery's own columns are read through an alias of
/// its table (`_hw_s1`, `_hw_s2`, … by depth), so a name never resolves to an outer table's
/// column and a table may read itself.
fn render_filter(
    filter: &SqlFilter<'_>,
    expr: &dyn Fn(&ReplicaColumn) -> String,
    depth: usize,
) -> String {
    let join = |items: &[SqlFilter<'_>], op: &str, empty: &str| {
        if items.is_empty() {
            return empty.to_owned();
        }
        let parts: Vec<String> = items
            .iter()
            .map(|item| render_filter(item, expr, depth))
            .collect();
        format!("({})", parts.join(op))
    };
    match filter {
        SqlFilter::And(items) => join(items, " AND ", "1"),
        SqlFilter::Or(items) => join(items, " OR ", "0"),
        SqlFilter::Not(item) => format!("(NOT {})", render_filter(item, expr, depth)),
        SqlFilter::Test(column, test) => format!("({})", render_test(&expr(column), test)),
        SqlFilter::InSet(column, set) => {
            let alias = format!("_hw_s{}", depth + 1);
            let inner_alias = alias.clone();
            let inner = move |col: &ReplicaColumn| {
                format!("{}.{}", quote_ident(&inner_alias), quote_ident(&col.name))
            };
            format!(
                "({} IN (SELECT {}.{} FROM {} AS {} WHERE {}))",
                expr(column),
                quote_ident(&alias),
                quote_ident(&set.column.name),
                quote_ident(&set.table.name),
                quote_ident(&alias),
                render_filter(&set.filter, &inner, depth + 1),
            )
        }
    }
}

fn render_test(expr: &str, test: &SqlTest) -> String {
    let list = |at: &[usize]| {
        at.iter()
            .map(|at| format!("?{at}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    // As a comparison would, a test of a NULL value is unknown (NULL), not false: under NOT
    // the two differ.
    match test {
        SqlTest::Never => format!("CASE WHEN {expr} IS NULL THEN NULL ELSE 0 END"),
        SqlTest::Compare(op, at) => format!("{expr} {op} ?{at}"),
        SqlTest::In(at) => format!("{expr} IN ({})", list(at)),
        SqlTest::NotIn(at) if at.is_empty() => {
            format!("CASE WHEN {expr} IS NULL THEN NULL ELSE 1 END")
        }
        SqlTest::NotIn(at) => format!("{expr} NOT IN ({})", list(at)),
        SqlTest::IsNull(true) => format!("{expr} IS NULL"),
        SqlTest::IsNull(false) => format!("{expr} IS NOT NULL"),
    }
}

/// An operand as `column` stores its values, read by the same rules as
/// [`highwater_engine::scope_sync::compare`]; `None` when the column's type cannot hold it.
fn stored_operand(column: &ReplicaColumn, operand: &Value) -> Option<SqlValue> {
    match column.kind {
        ValueKind::Number => {
            let number = operand_number(operand)?;
            Some(match number.as_i64() {
                Some(integer) => SqlValue::Integer(integer),
                None => SqlValue::Real(number.as_f64()?),
            })
        }
        ValueKind::Bool => operand_bool(operand).map(|flag| SqlValue::Integer(i64::from(flag))),
        ValueKind::Text => operand_text(operand).map(SqlValue::Text),
        // Refused before binding (`ScopePage::Incomparable`).
        ValueKind::Json | ValueKind::Array => None,
    }
}

/// Drops exits journalled before `older_than` (ISO-8601, same format as `updated_at`) and
/// raises the retention floor to the highest seq dropped. Returns the floor.
pub(crate) fn prune_exits(
    conn: &Connection,
    older_than: &str,
) -> Result<Option<i64>, ReplicaError> {
    // One transaction: the floor is never below an exit already gone.
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let result = prune_in_transaction(conn, older_than);
    match result {
        Ok(()) => conn.execute_batch("COMMIT")?,
        Err(error) => {
            let _ = conn.execute_batch("ROLLBACK");
            return Err(error);
        }
    }
    retention_floor(conn)
}

fn prune_in_transaction(conn: &Connection, older_than: &str) -> Result<(), ReplicaError> {
    let pruned: Option<i64> = conn
        .prepare_cached(r#"SELECT max("seq") FROM "_hw_exits" WHERE "updated_at" < ?1"#)?
        .query_row([older_than], |r| r.get(0))?;
    if let Some(seq) = pruned {
        conn.execute(
            r#"DELETE FROM "_hw_exits" WHERE "updated_at" < ?1"#,
            [older_than],
        )?;
        conn.execute(
            r#"INSERT INTO "_hw_feed_state" ("lock","floor") VALUES (1, ?1)
               ON CONFLICT ("lock") DO UPDATE SET "floor" = max("floor", excluded."floor")"#,
            [seq],
        )?;
    }
    Ok(())
}

/// Seqs at or below the floor may have lost their exits; `None` when nothing was pruned.
pub(crate) fn retention_floor(conn: &Connection) -> Result<Option<i64>, ReplicaError> {
    let exists: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_schema WHERE name = '_hw_feed_state')",
        [],
        |r| r.get(0),
    )?;
    if !exists {
        return Ok(None);
    }
    Ok(conn
        .query_row(
            r#"SELECT "floor" FROM "_hw_feed_state" WHERE "lock" = 1"#,
            [],
            |r| r.get(0),
        )
        .optional()?)
}

/// Milliseconds since the Unix epoch as ISO-8601 UTC with milliseconds
/// (`2026-12-01T12:00:00.123Z`), the form of `updatedAt`.
pub fn iso_from_ms(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    let rem = ms.rem_euclid(86_400_000);
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3_600_000,
        rem / 60_000 % 60,
        rem / 1000 % 60,
        rem % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::super::schema::INTERNAL_TABLES_SQL;
    use super::*;
    use highwater_engine::change_stream::ColumnSpec;
    use highwater_engine::scope_sync::feed::exit_leaves;
    use highwater_engine::scope_sync::rules::row_filter::{RuleFilter, Sets};
    use highwater_engine::scope_sync::server::routing_form;
    use serde_json::{json, Number};

    fn replica_table(name: &str, columns: &[(&str, &str)]) -> ReplicaTable {
        ReplicaTable {
            name: name.to_owned(),
            schema: "public".to_owned(),
            table: name.to_owned(),
            oid: None,
            replica_identity: None,
            columns: columns
                .iter()
                .zip(1..)
                .map(|((column, data_type), pos)| {
                    ReplicaColumn::from_spec(
                        column,
                        &ColumnSpec::new(Number::from(pos), *data_type),
                    )
                })
                .collect(),
            key: vec!["id".to_owned()],
            metadata: None,
        }
    }

    /// `todos` reached through `members` and `projects`, as the replica stores them.
    fn membership_replica() -> (Connection, HashMap<String, ReplicaTable>) {
        let conn = Connection::open_in_memory().unwrap();
        let tables: HashMap<String, ReplicaTable> = [
            replica_table(
                "todos",
                &[
                    ("id", "int8"),
                    ("project_id", "int8"),
                    ("owner", "text"),
                    ("done", "bool"),
                    ("meta", "jsonb"),
                ],
            ),
            replica_table(
                "members",
                &[("id", "int8"), ("project_id", "int8"), ("user_id", "text")],
            ),
            replica_table(
                "projects",
                &[("id", "int8"), ("org", "int4"), ("archived", "bool")],
            ),
        ]
        .into_iter()
        .map(|table| (table.name.clone(), table))
        .collect();
        for table in tables.values() {
            conn.execute_batch(&table.create_table_sql()).unwrap();
        }
        conn.execute_batch(
            r#"INSERT INTO "members" VALUES (1, 1, 'ada', 'v', 1, NULL), (2, 2, 'ada', 'v', 2, NULL),
                 (3, 3, 'bob', 'v', 3, NULL), (4, 3, '42', 'v', 4, NULL);
               INSERT INTO "projects" VALUES (1, 7, 0, 'v', 5, NULL), (2, 7, 1, 'v', 6, NULL),
                 (3, 7, 0, 'v', 7, NULL);"#,
        )
        .unwrap();
        (conn, tables)
    }

    fn bound(text: &str, claims: Value) -> RowFilter {
        let Value::Object(claims) = claims else {
            panic!("claims are an object")
        };
        RuleFilter::parse(text).unwrap().bind(&claims).unwrap()
    }

    fn row(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(row) => row,
            other => panic!("expected a row, got {other}"),
        }
    }

    #[test]
    fn a_row_passes_a_filter_whose_subqueries_read_the_replica() {
        let (conn, tables) = membership_replica();
        // Ada's projects of org 7 that are not archived; the claim `org` comes as text.
        let filter = bound(
            "project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub AND \
             project_id IN (SELECT id FROM projects WHERE org = auth.org AND NOT archived)) \
             AND done = false",
            json!({"sub": "ada", "org": "7"}),
        );
        let passes =
            |value: Value| row_passes(&conn, &tables, "todos", &filter, &row(value)).unwrap();
        assert_eq!(passes(json!({"project_id": 1, "done": false})), Some(true));
        assert_eq!(
            passes(json!({"project_id": 2, "done": false})),
            Some(false),
            "her project, archived"
        );
        assert_eq!(
            passes(json!({"project_id": 3, "done": false})),
            Some(false),
            "bob's project"
        );
        assert_eq!(
            passes(json!({"project_id": 1, "done": true})),
            Some(false),
            "a boolean compares as the replica stores it"
        );
        assert_eq!(passes(json!({"project_id": null, "done": false})), None);
        assert_eq!(
            passes(json!({"done": false})),
            None,
            "a missing column is NULL"
        );

        // A number claim against a text column, a text claim against a number column, and
        // a test outside the subquery deciding where the subquery is unknown.
        let numeric = bound(
            "owner = auth.sub OR project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)",
            json!({"sub": 42}),
        );
        let passes =
            |value: Value| row_passes(&conn, &tables, "todos", &numeric, &row(value)).unwrap();
        assert_eq!(passes(json!({"project_id": 3, "owner": "x"})), Some(true));
        assert_eq!(passes(json!({"project_id": 1, "owner": "x"})), Some(false));
        assert_eq!(
            passes(json!({"project_id": null, "owner": "42"})),
            Some(true)
        );
        assert_eq!(passes(json!({"project_id": null, "owner": "x"})), None);
        let text_id = bound(
            "project_id IN (SELECT id FROM projects WHERE id = auth.p)",
            json!({"p": "3"}),
        );
        assert_eq!(
            row_passes(
                &conn,
                &tables,
                "todos",
                &text_id,
                &row(json!({"project_id": 3}))
            )
            .unwrap(),
            Some(true)
        );

        // What the replica cannot answer is an error naming it.
        for (table, text, reason) in [
            (
                "nope",
                "project_id IN (SELECT id FROM projects)",
                "a table the replica does not have",
            ),
            (
                "todos",
                "project_id IN (SELECT id FROM nope)",
                "a table the replica does not have",
            ),
            (
                "todos",
                "project_id IN (SELECT pid FROM members)",
                "column \"pid\"",
            ),
            (
                "todos",
                "project_id IN (SELECT project_id FROM members WHERE colour = 'red')",
                "column \"colour\"",
            ),
            (
                "todos",
                "meta = 'x' AND project_id IN (SELECT id FROM projects)",
                "JSON or array column \"meta\"",
            ),
        ] {
            let error = row_passes(
                &conn,
                &tables,
                table,
                &bound(text, json!({})),
                &row(json!({})),
            )
            .unwrap_err()
            .to_string();
            assert!(error.contains(reason), "{text}: {error}");
        }
    }

    /// A subquery's set as the replica's rows hold it now, matched in memory.
    struct ReplicaSets<'a> {
        conn: &'a Connection,
        tables: &'a HashMap<String, ReplicaTable>,
    }

    impl Sets for ReplicaSets<'_> {
        fn contains(&self, set: &SetQuery, value: &Value) -> Option<bool> {
            let table = self.tables.get(&set.table)?;
            let sql = format!(
                "SELECT {} FROM {}",
                select_list(table),
                quote_ident(&table.name)
            );
            let mut stmt = self.conn.prepare(&sql).ok()?;
            let mut rows = stmt.query([]).ok()?;
            let mut found = false;
            while let Some(r) = rows.next().ok()? {
                let data = row_data(table, r).ok()?;
                if set.filter.eval_with(&data, self) == Some(true) {
                    found |= data
                        .get(&set.column)
                        .is_some_and(|v| !v.is_null() && routing_form(v) == routing_form(value));
                }
            }
            Some(found)
        }
    }

    #[test]
    fn a_pages_exits_are_those_the_engines_rule_says_left_the_scope() {
        let (conn, tables) = membership_replica();
        conn.execute_batch(INTERNAL_TABLES_SQL).unwrap();
        let feed: FeedTables = [(
            "todos".to_owned(),
            vec![
                "project_id".to_owned(),
                "owner".to_owned(),
                "done".to_owned(),
            ],
        )]
        .into_iter()
        .collect();
        prepare(&conn, &tables, &feed).unwrap();
        // Exits at seqs 1..=400, their old and new values from a few each (a missing column
        // and null among them), a quarter of them gone under their key.
        fn values(pick: &mut dyn FnMut(usize) -> usize) -> Map<String, Value> {
            let projects = [json!(1), json!(2), json!(3), Value::Null];
            let owners = [json!("ada"), json!("bob"), Value::Null];
            let dones = [json!(false), json!(true), Value::Null];
            let mut values = Map::new();
            values.insert("project_id".into(), projects[pick(4)].clone());
            values.insert("owner".into(), owners[pick(3)].clone());
            if pick(5) > 0 {
                values.insert("done".into(), dones[pick(3)].clone());
            }
            values
        }
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut pick = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            usize::try_from(state % n as u64).unwrap()
        };
        let mut journalled = Vec::new();
        for seq in 1..=400_i64 {
            let old = values(&mut pick);
            let new = (pick(4) > 0).then(|| values(&mut pick));
            conn.execute(
                r#"INSERT INTO "_hw_exits" VALUES ('todos', ?1, ?2, ?3, ?4, 'x')"#,
                params![
                    seq.to_string(),
                    seq,
                    Value::Object(old.clone()).to_string(),
                    new.clone().map(|n| Value::Object(n).to_string()),
                ],
            )
            .unwrap();
            journalled.push((seq, old, new));
        }
        let sets = ReplicaSets {
            conn: &conn,
            tables: &tables,
        };
        let scopes = [
            (json!({}), None),
            (json!({"owner": "ada"}), None),
            (json!({"project_id": [1, 2], "done": false}), None),
            (json!({"done": {"isNull": true}}), None),
            (json!({}), Some("done = false OR owner = 'bob'")),
            (json!({}), Some("NOT (project_id = 2)")),
            (
                json!({"done": false}),
                Some("project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)"),
            ),
        ];
        for (conditions, filter) in scopes {
            let conditions = Conditions::parse(&row(conditions)).unwrap();
            let filter = filter.map(|text| bound(text, json!({"sub": "ada"})));
            let scope = |values: &Map<String, Value>| {
                if !conditions.matches(values) {
                    return Some(false);
                }
                filter
                    .as_ref()
                    .map_or(Some(true), |f| f.eval_with(values, &sets))
            };
            let (mut stayed, mut never) = (0, 0);
            let mut left = Vec::new();
            for (seq, old, new) in &journalled {
                if exit_leaves(old, new.as_ref(), scope) {
                    left.push(*seq);
                } else if scope(old) == Some(true) {
                    stayed += 1;
                } else {
                    never += 1;
                }
            }
            let page = read_scope_page(
                &conn,
                &tables,
                &ScopeQuery {
                    table: "todos",
                    conditions: &conditions,
                    row_filter: filter.as_ref(),
                    after: Some(0),
                    up_to: Some(400),
                    limit: 1000,
                    count_total: false,
                    access: &[],
                },
            )
            .unwrap();
            let ScopePage::Rows { rows, .. } = page else {
                panic!("rows expected, got {page:?}");
            };
            let read: Vec<i64> = rows.iter().map(|row| row.seq).collect();
            assert_eq!(read, left, "{conditions:?} {filter:?}");
            assert!(
                !left.is_empty() && stayed + never > 0,
                "{conditions:?} {filter:?}: {} left, {stayed} stayed in, {never} never in",
                left.len()
            );
        }
    }

    #[test]
    fn iso_from_ms_formats_utc_with_milliseconds() {
        assert_eq!(iso_from_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(iso_from_ms(1_796_126_400_123), "2026-12-01T12:00:00.123Z");
        assert_eq!(iso_from_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }
}
