//! Applies change-stream transactions to the replica, one SQLite transaction per upstream
//! transaction, or one per group of them with group commit (each upstream transaction then a
//! savepoint), as Zero's replicator applies the change stream.
//!
//! Every row written gets `_hw_version` = the transaction's commit watermark and a fresh
//! `_hw_seq`; deletes and key changes leave a tombstone, truncates a table-wide marker
//! (a tombstone whose `row_key` is NULL). The replication position is stored in the same SQLite
//! transaction as the rows, so a transaction is either fully applied with its position or not
//! at all; a transaction at or below the stored position is refused (the upstream session skips
//! what is stored), which makes a replay after a crash exactly-once.
//!
//! `replicate`'s row changes arrive with their values still as pgoutput text
//! ([`ReplicaWriter::apply_text`]) and are stored exactly as their change-stream `data` message
//! would be: both forms go through the same insert, update and delete code, read through
//! [`RowValues`].
//!
//! Backfills follow Zero's rules for backfill data: rows are upserted by key, except rows
//! deleted (or truncated) after the backfill's snapshot; a backfilling column keeps a value the
//! stream wrote after that snapshot (tracked per row in `_hw_backfill_versions` while the column
//! is backfilling); rows new to the replica get the snapshot's watermark as their version.
//!
//! What a transaction costs is kept small. A row statement's SQL is built once per table and
//! column set and prepared through the connection's statement cache, as are the per-transaction
//! `BEGIN`, `SAVEPOINT`, `RELEASE` and `COMMIT`; values are bound borrowed from the change
//! ([`to_sql_ref`] for JSON rows, [`scalar_to_sql`] for text rows). A small transaction is held
//! whole by the caller until its commit (until [`outgrows_hold`]) and applied by
//! [`ReplicaWriter::apply_whole`] with no savepoint of its own; one that outgrows the hold
//! streams in inside a savepoint. In a group the position row (`_hw_state`) is written once,
//! by [`ReplicaWriter::commit_group`]. The property test `text_rows_store_what_json_rows_store`
//! checks that a text row and its JSON row leave the same replica, bit for bit.

use highwater_engine::change_stream::{
    lite_default, AddColumn, Backfill, BackfillCompleted, Begin, Change, Commit, CreateIndex,
    CreateTable, DownstreamMessage, DropColumn, DropTable, Identifier, JsonFormat, Relation,
    RenameTable, Row, Truncate, UpdateColumn,
};
use highwater_engine::pgoutput::{TextRow, TextRowChange, TextRowKind, TextValue};
use highwater_engine::watermark::{Lsn, Watermark};
use std::sync::Arc;

use rusqlite::{params, params_from_iter, Connection};
use serde_json::Value;

use super::feed::{self, Capture, CommittedChanges, FeedTables, Pre};
use super::schema::{
    self, create_index_sql, quote_ident, replica_index_name, replica_table_name, ReplicaColumn,
    ReplicaTable,
};
use super::value::{into_sql, row_key_json, scalar_to_sql, to_sql_ref, SqlScalar};
use super::{Replica, ReplicaError, ReplicaState};

/// The engine's hold rule: a transaction is held whole until its commit (then applied with
/// [`ReplicaWriter::apply_whole`]) while it is small; a larger one streams into SQLite inside
/// a savepoint.
pub use highwater_engine::upstream::outgrows_hold;

/// One part of a whole transaction for [`ReplicaWriter::apply_whole`]: a message, or a row
/// change that kept its text.
#[derive(Debug, Clone, Copy)]
pub enum TxnItem<'a> {
    Message(&'a DownstreamMessage),
    Text(&'a TextRowChange),
}

impl<'a> From<&'a DownstreamMessage> for TxnItem<'a> {
    fn from(message: &'a DownstreamMessage) -> Self {
        TxnItem::Message(message)
    }
}

/// What applying one message did, as far as acknowledging upstream is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Nothing durable changed yet (a message inside a transaction, or a status).
    Pending,
    /// The transaction is committed durably (report it to the upstream session).
    Committed { watermark: Watermark, lsn: Lsn },
    /// The open transaction was discarded.
    RolledBack,
    /// The transaction is applied inside the open group (see
    /// [`ReplicaWriter::set_group_commit`]); it becomes durable with
    /// [`ReplicaWriter::commit_group`], and only then may upstream be acknowledged.
    Grouped { watermark: Watermark, lsn: Lsn },
}

/// A backfill the replica is waiting for: columns whose existing values only upstream knows.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingBackfill {
    /// Replica table name.
    pub table: String,
    pub schema: String,
    pub name: String,
    pub key: Vec<String>,
    /// Non-key columns to backfill; every column of the table for a whole-table backfill.
    pub columns: Vec<String>,
    /// Whether the table itself is new to the replica (its rows must be inserted).
    pub whole_table: bool,
}

struct Txn {
    watermark: Watermark,
    json: JsonFormat,
    schema_changed: bool,
    /// Zero's `commitTime` of the `begin` (Unix microseconds), if the source sent it.
    begin_time_us: Option<i64>,
    /// Opened as a savepoint inside a group's SQLite transaction.
    savepoint: bool,
}

/// Applies change-stream messages to a [`Replica`].
pub struct ReplicaWriter {
    replica: Replica,
    txn: Option<Txn>,
    next_seq: i64,
    /// Scope-feed capture, when scope sync follows some tables.
    feed: Option<Capture>,
    /// The feed entries of the last committed transaction, until taken.
    committed: Option<CommittedChanges>,
    /// The upstream commit time of the last transaction committed, in Unix ms.
    last_commit_ms: Option<i64>,
    /// Whether a commit leaves the SQLite transaction open for the next upstream transaction.
    grouping: bool,
    /// A SQLite transaction holding grouped, not yet durable upstream transactions.
    group_open: bool,
    /// The position in memory is ahead of the one in `_hw_state`: a grouped commit leaves
    /// the row to the group's commit, which writes it once for all of its transactions.
    state_unwritten: bool,
    /// Row statements' SQL text, built once per table and column set.
    row_sql: RowSql,
    /// Sync clients' mutations the next commit applies (client id, mutation id).
    confirms: Vec<(String, u64)>,
}

impl ReplicaWriter {
    pub fn new(replica: Replica) -> ReplicaWriter {
        let next_seq = replica.state().map_or(1, |s| s.next_seq);
        ReplicaWriter {
            replica,
            txn: None,
            next_seq,
            feed: None,
            committed: None,
            last_commit_ms: None,
            grouping: false,
            group_open: false,
            state_unwritten: false,
            row_sql: RowSql::default(),
            confirms: Vec::new(),
        }
    }

    /// With `on`, a commit applies the transaction (its rows and position) but leaves the
    /// SQLite transaction open, returning [`Applied::Grouped`]; the next upstream transaction
    /// then runs in a savepoint of the same SQLite transaction, and [`commit_group`] makes all
    /// of them durable at once. A rollback discards only the open upstream transaction.
    ///
    /// [`commit_group`]: ReplicaWriter::commit_group
    pub fn set_group_commit(&mut self, on: bool) {
        self.grouping = on;
    }

    /// Whether grouped transactions wait for [`ReplicaWriter::commit_group`].
    pub fn group_open(&self) -> bool {
        self.group_open
    }

    /// Commits the SQLite transaction of the open group durably (between upstream
    /// transactions only). Returns whether there was one.
    pub fn commit_group(&mut self) -> Result<bool, ReplicaError> {
        if let Some(open) = &self.txn {
            return Err(ReplicaError::NestedTransaction {
                open: open.watermark.clone(),
                next: open.watermark.clone(),
            });
        }
        if !self.group_open {
            return Ok(false);
        }
        if self.state_unwritten {
            let state = self.state()?;
            write_state(
                &self.replica.conn,
                &state.watermark,
                state.lsn,
                state.next_seq,
            )?;
            self.state_unwritten = false;
        }
        run_cached(&self.replica.conn, "COMMIT")?;
        self.group_open = false;
        Ok(true)
    }

    /// Discards the open group and the transaction in progress: nothing of either was
    /// acknowledged, so upstream sends them again.
    pub fn discard_group(&mut self) -> Result<(), ReplicaError> {
        self.confirms.clear();
        if self.txn.is_some() {
            self.rollback()?;
        }
        if self.group_open {
            self.replica.conn.execute_batch("ROLLBACK")?;
            self.forget_group()?;
        }
        Ok(())
    }

    /// After the group's SQLite transaction was rolled back: the schema and positions in
    /// memory were those of the discarded commits, so they are read again from the replica.
    fn forget_group(&mut self) -> Result<(), ReplicaError> {
        self.group_open = false;
        self.state_unwritten = false;
        self.replica.reload()?;
        self.row_sql.clear();
        self.next_seq = self.state()?.next_seq;
        Ok(())
    }

    /// Follows `tables` (replica name → filter columns) for scope sync: from now on every
    /// commit records their feed entries (see [`feed`]), taken with
    /// [`ReplicaWriter::take_committed`]. Creates the feed's tables and indexes.
    pub fn enable_scope_feed(&mut self, tables: FeedTables) -> Result<(), ReplicaError> {
        feed::prepare(&self.replica.conn, &self.replica.tables, &tables)?;
        self.feed = Some(Capture::new(tables));
        Ok(())
    }

    /// Records that the transaction committed next (the open one, or the next one applied
    /// whole) applies these sync clients' mutations: its commit writes them to
    /// `_hw_client_mutations` in the same SQLite transaction and hands them on in its
    /// [`CommittedChanges::confirms`]. A rollback forgets them.
    pub fn confirm_with_next_commit(&mut self, confirms: Vec<(String, u64)>) {
        self.confirms.extend(confirms);
    }

    /// The scope-feed entries of the transaction committed last (empty when the feed is off or
    /// it touched no followed table). Route them to scope subscribers only now, after the
    /// commit: their seqs are durable.
    pub fn take_committed(&mut self) -> Option<CommittedChanges> {
        self.committed.take()
    }

    /// The upstream commit time of the last transaction committed (Unix ms), when the change
    /// source gave one.
    pub fn last_commit_ms(&self) -> Option<i64> {
        self.last_commit_ms
    }

    pub fn replica(&self) -> &Replica {
        &self.replica
    }

    pub fn into_replica(self) -> Replica {
        self.replica
    }

    pub fn in_transaction(&self) -> bool {
        self.txn.is_some()
    }

    /// Applies one message. On an error inside a transaction the transaction is rolled back.
    pub fn apply(&mut self, message: &DownstreamMessage) -> Result<Applied, ReplicaError> {
        let result = match message {
            DownstreamMessage::Begin(begin) => self.begin(begin, false),
            DownstreamMessage::Data(change) => self.data(change).map(|()| Applied::Pending),
            DownstreamMessage::Commit(commit) => self.commit(commit),
            DownstreamMessage::Rollback(_) => self.rollback(),
            DownstreamMessage::Status(_)
            | DownstreamMessage::Error(_)
            | DownstreamMessage::Reserved(_) => Ok(Applied::Pending),
        };
        if result.is_err() && self.txn.is_some() {
            // The error is what the caller needs to see; a failed rollback adds nothing to it.
            let _ = self.rollback();
        }
        result
    }

    /// Applies a whole upstream transaction, `begin` to `commit`, that the caller held until
    /// its commit arrived. Inside an open group it opens no savepoint of its own (the
    /// savepoint and its journal of the pages the transaction touches are much of what a
    /// small transaction costs): a transaction whose commit is here is never rolled back
    /// alone. So an error discards the open group with it; nothing in the group was
    /// acknowledged, so upstream sends all of it again.
    pub fn apply_whole<'a, I>(&mut self, items: I) -> Result<Applied, ReplicaError>
    where
        I: IntoIterator,
        I::Item: Into<TxnItem<'a>>,
    {
        let mut items = items.into_iter().map(Into::into);
        let Some(TxnItem::Message(DownstreamMessage::Begin(begin))) = items.next() else {
            return Err(ReplicaError::IncompleteTransaction {
                found: "one without its `begin`",
            });
        };
        let mut applied = self.begin(begin, true);
        for item in items {
            if applied.is_err() {
                break;
            }
            applied = match item {
                TxnItem::Message(message) => self.apply(message),
                TxnItem::Text(change) => self.apply_text(change),
            };
        }
        match applied {
            Ok(Applied::Pending) => {
                let _ = self.discard_group();
                Err(ReplicaError::IncompleteTransaction {
                    found: "one without its `commit`",
                })
            }
            Ok(applied) => Ok(applied),
            Err(error) => {
                // `apply` rolled the transaction back, and the group with it; this clears
                // what is left.
                let _ = self.discard_group();
                Err(error)
            }
        }
    }

    /// Applies a row change whose values kept their text, inside the open transaction: what
    /// applying its `data` message ([`TextRowChange::to_change`]) does, binding the values from
    /// their text instead of from JSON. On an error the transaction is rolled back.
    pub fn apply_text(&mut self, change: &TextRowChange) -> Result<Applied, ReplicaError> {
        let result = self.text_data(change).map(|()| Applied::Pending);
        if result.is_err() && self.txn.is_some() {
            let _ = self.rollback();
        }
        result
    }

    fn text_data(&mut self, change: &TextRowChange) -> Result<(), ReplicaError> {
        if self.feed.is_some() {
            // The scope feed reads rows as JSON, before and after the change.
            return self.data(&change.to_change());
        }
        let txn = self
            .txn
            .as_ref()
            .ok_or(ReplicaError::NotInTransaction { what: "`data`" })?;
        let mut ctx = RowContext {
            conn: &self.replica.conn,
            json: txn.json,
            version: txn.watermark.as_str(),
            next_seq: &mut self.next_seq,
            sql: &mut self.row_sql,
        };
        let tables = &self.replica.tables;
        let columns = &change.columns;
        let row = |row| TextRowValues { row, columns };
        match &change.kind {
            TextRowKind::Insert { new } => {
                apply_insert(&mut ctx, tables, &change.relation, &row(new))
            }
            TextRowKind::Update { key, new } => apply_update(
                &mut ctx,
                tables,
                &change.relation,
                key.as_ref().map(row).as_ref(),
                &row(new),
            ),
            TextRowKind::Delete { key } => {
                apply_delete(&mut ctx, tables, &change.relation, &row(key))
            }
        }
    }

    fn state(&self) -> Result<&ReplicaState, ReplicaError> {
        self.replica.state().ok_or(ReplicaError::NotInitialized)
    }

    /// Begins a transaction; `whole`: one the caller holds whole ([`ReplicaWriter::apply_whole`]).
    fn begin(&mut self, begin: &Begin, whole: bool) -> Result<Applied, ReplicaError> {
        if let Some(open) = &self.txn {
            return Err(ReplicaError::NestedTransaction {
                open: open.watermark.clone(),
                next: begin.commit_watermark.clone(),
            });
        }
        // What is already stored is the upstream session's to skip: one reaching here would
        // be applied twice.
        let position = &self.state()?.watermark;
        if begin.commit_watermark <= *position {
            return Err(ReplicaError::NotAfterPosition {
                position: position.clone(),
                found: begin.commit_watermark.clone(),
            });
        }
        // Inside an open group, a savepoint: a rollback then undoes this transaction alone.
        // A whole transaction needs none: it is never rolled back alone.
        let savepoint = self.group_open && !whole;
        if savepoint {
            run_cached(&self.replica.conn, "SAVEPOINT hw_txn")?;
        } else if !self.group_open {
            run_cached(&self.replica.conn, "BEGIN IMMEDIATE")?;
        }
        self.committed = None;
        self.txn = Some(Txn {
            watermark: begin.commit_watermark.clone(),
            json: begin.json.unwrap_or(JsonFormat::Parsed),
            schema_changed: false,
            begin_time_us: begin.extra.get("commitTime").and_then(Value::as_i64),
            savepoint,
        });
        Ok(Applied::Pending)
    }

    fn commit(&mut self, commit: &Commit) -> Result<Applied, ReplicaError> {
        let txn = self
            .txn
            .as_ref()
            .ok_or(ReplicaError::NotInTransaction { what: "`commit`" })?;
        if commit.watermark != txn.watermark {
            return Err(ReplicaError::WatermarkMismatch {
                begin: txn.watermark.clone(),
                commit: commit.watermark.clone(),
            });
        }
        let watermark = txn.watermark.clone();
        let lsn = watermark.to_lsn()?;
        let savepoint = txn.savepoint;
        // Deterministic: the upstream commit time, the same on the primary and relays.
        let ms = commit
            .commit_time_ms
            .as_ref()
            .and_then(serde_json::Number::as_f64)
            .map(|ms| ms as i64)
            .or(txn.begin_time_us.map(|us| us.div_euclid(1000)));
        self.last_commit_ms = ms;
        if let Some(capture) = self.feed.as_mut() {
            let updated_at =
                ms.map_or_else(|| feed::UNKNOWN_COMMIT_TIME.to_owned(), feed::iso_from_ms);
            let mut changes =
                capture.commit(&self.replica.conn, &self.replica.tables, &updated_at)?;
            changes.commit_ms = ms;
            self.committed = Some(changes);
        }
        let confirms = std::mem::take(&mut self.confirms);
        if !confirms.is_empty() {
            feed::record_confirms(&self.replica.conn, &confirms, &watermark)?;
            if let Some(changes) = self.committed.as_mut() {
                changes.confirms = confirms;
            }
        }
        if self.grouping {
            // The group's commit writes the position of its last transaction: one write of
            // the row per group, not per transaction.
            if savepoint {
                run_cached(&self.replica.conn, "RELEASE hw_txn")?;
            }
            self.state_unwritten = true;
            self.group_open = true;
        } else {
            write_state(&self.replica.conn, &watermark, lsn, self.next_seq)?;
            run_cached(&self.replica.conn, "COMMIT")?;
        }
        self.txn = None;
        if let Some(state) = self.replica.state.as_mut() {
            state.watermark = watermark.clone();
            state.lsn = lsn;
            state.next_seq = self.next_seq;
        }
        if self.grouping {
            return Ok(Applied::Grouped { watermark, lsn });
        }
        Ok(Applied::Committed { watermark, lsn })
    }

    fn rollback(&mut self) -> Result<Applied, ReplicaError> {
        self.confirms.clear();
        let Some(txn) = self.txn.take() else {
            return Ok(Applied::RolledBack);
        };
        if let Some(capture) = self.feed.as_mut() {
            capture.discard();
        }
        self.committed = None;
        if txn.schema_changed {
            self.row_sql.clear();
        }
        if txn.savepoint {
            // The group's earlier transactions stay.
            self.replica
                .conn
                .execute_batch("ROLLBACK TO hw_txn; RELEASE hw_txn")?;
        } else {
            self.replica.conn.execute_batch("ROLLBACK")?;
            if self.group_open {
                // A whole transaction inside a group: the group goes with it.
                self.forget_group()?;
                return Ok(Applied::RolledBack);
            }
        }
        if txn.schema_changed {
            // The schema as the rollback left it; the position stays the one in memory (that
            // of the last commit), which `_hw_state` may not hold yet inside a group.
            let state = self.replica.state.take();
            self.replica.reload()?;
            self.replica.state = state;
        }
        self.next_seq = self.state()?.next_seq;
        Ok(Applied::RolledBack)
    }

    /// Columns waiting for a backfill, grouped by table.
    pub fn pending_backfills(&self) -> Vec<PendingBackfill> {
        self.replica.pending_backfills()
    }

    fn data(&mut self, change: &Change) -> Result<(), ReplicaError> {
        let txn = self
            .txn
            .as_mut()
            .ok_or(ReplicaError::NotInTransaction { what: "`data`" })?;
        if !change.is_row_change() {
            txn.schema_changed = true;
            // Statements are rebuilt for the new schema.
            self.row_sql.clear();
        }
        let json = txn.json;
        let version = txn.watermark.as_str().to_owned();
        let pre = match &self.feed {
            Some(capture) => {
                capture.before(&self.replica.conn, &self.replica.tables, change, json)?
            }
            None => Pre::None,
        };
        let seq_before = self.next_seq;
        self.apply_change(change, json, &version)?;
        if let Some(capture) = self.feed.as_mut() {
            capture.after(
                &self.replica.conn,
                &self.replica.tables,
                pre,
                seq_before,
                self.next_seq,
            )?;
        }
        Ok(())
    }

    fn apply_change(
        &mut self,
        change: &Change,
        json: JsonFormat,
        version: &str,
    ) -> Result<(), ReplicaError> {
        let mut ctx = RowContext {
            conn: &self.replica.conn,
            json,
            version,
            next_seq: &mut self.next_seq,
            sql: &mut self.row_sql,
        };
        let tables = &mut self.replica.tables;
        match change {
            Change::Insert(insert) => apply_insert(&mut ctx, tables, &insert.relation, &insert.new),
            Change::Update(update) => apply_update(
                &mut ctx,
                tables,
                &update.relation,
                update.key.as_ref(),
                &update.new,
            ),
            Change::Delete(delete) => apply_delete(&mut ctx, tables, &delete.relation, &delete.key),
            Change::Truncate(truncate) => apply_truncate(&mut ctx, tables, truncate),
            Change::Backfill(backfill) => apply_backfill(&mut ctx, tables, backfill),
            Change::BackfillCompleted(done) => apply_backfill_completed(ctx.conn, tables, done),
            Change::CreateTable(create) => apply_create_table(ctx.conn, tables, create),
            Change::RenameTable(rename) => apply_rename_table(ctx.conn, tables, rename),
            Change::DropTable(drop) => apply_drop_table(ctx.conn, tables, drop),
            Change::AddColumn(add) => apply_add_column(&mut ctx, tables, add),
            Change::UpdateColumn(update) => apply_update_column(ctx.conn, tables, update),
            Change::DropColumn(drop) => apply_drop_column(ctx.conn, tables, drop),
            Change::CreateIndex(create) => apply_create_index(ctx.conn, tables, create),
            Change::DropIndex(drop) => {
                let name = replica_index_name(&drop.id.schema, &drop.id.name);
                ctx.conn
                    .execute_batch(&format!("DROP INDEX IF EXISTS {}", quote_ident(&name)))?;
                schema::forget_index(ctx.conn, &name)
            }
            // Opaque to the replica (the key and columns it needs arrive with the other
            // changes), but kept so that the next schema diff can tell it changed.
            Change::UpdateTableMetadata(update) => {
                let table = table_for_mut(tables, &update.table)?;
                table.metadata = Some(update.new.clone());
                schema::store_table(ctx.conn, table)
            }
        }
    }
}

type Tables = std::collections::HashMap<String, ReplicaTable>;

/// Writes the replica's position to `_hw_state`, in the open SQLite transaction.
fn write_state(
    conn: &Connection,
    watermark: &Watermark,
    lsn: Lsn,
    next_seq: i64,
) -> Result<(), ReplicaError> {
    conn.prepare_cached(
        r#"UPDATE "_hw_state" SET "watermark" = ?1, "lsn" = ?2, "next_seq" = ?3 WHERE "lock" = 1"#,
    )?
    .execute(params![watermark.as_str(), lsn.to_string(), next_seq])?;
    Ok(())
}

/// Runs a statement without parameters through the connection's statement cache: the
/// per-transaction `SAVEPOINT`, `RELEASE`, `BEGIN` and `COMMIT` are parsed once, not once per
/// upstream transaction.
fn run_cached(conn: &Connection, sql: &str) -> Result<(), ReplicaError> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}

struct RowContext<'a> {
    conn: &'a Connection,
    json: JsonFormat,
    version: &'a str,
    next_seq: &'a mut i64,
    sql: &'a mut RowSql,
}

/// The SQL text of row statements, built once per table, statement and column set instead of
/// per row, and dropped on every schema change. The prepared statements themselves live in
/// the connection's statement cache, keyed by this text.
#[derive(Debug, Default)]
struct RowSql {
    /// Per replica table: [statement code, column positions…] → SQL.
    by_table: std::collections::HashMap<String, std::collections::HashMap<Vec<u16>, Arc<str>>>,
}

const SQL_UPSERT: u16 = 0;
const SQL_UPDATE_SET: u16 = 1;
const SQL_UPDATE_KEEP: u16 = 2;
const SQL_DELETE: u16 = 3;

impl RowSql {
    fn clear(&mut self) {
        self.by_table.clear();
    }

    /// The SQL of statement `code` on `table` for `columns`, built by `build` the first time.
    fn get(
        &mut self,
        table: &ReplicaTable,
        code: u16,
        columns: &[(&ReplicaColumn, SqlScalar<'_>)],
        build: impl FnOnce() -> String,
    ) -> Arc<str> {
        let mut key = Vec::with_capacity(columns.len() + 1);
        key.push(code);
        key.extend(columns.iter().map(|(col, _)| {
            let pos = table.columns.iter().position(|c| std::ptr::eq(c, *col));
            pos.and_then(|p| u16::try_from(p).ok()).unwrap_or(u16::MAX)
        }));
        let statements = match self.by_table.get_mut(table.name.as_str()) {
            Some(statements) => statements,
            None => self.by_table.entry(table.name.clone()).or_default(),
        };
        if let Some(sql) = statements.get(key.as_slice()) {
            return sql.clone();
        }
        let sql: Arc<str> = build().into();
        statements.insert(key, sql.clone());
        sql
    }
}

impl RowContext<'_> {
    fn seq(&mut self) -> i64 {
        let seq = *self.next_seq;
        *self.next_seq += 1;
        seq
    }

    fn tombstone(&mut self, table: &str, key: &str) -> Result<(), ReplicaError> {
        let seq = self.seq();
        self.conn
            .prepare_cached(
                r#"INSERT INTO "_hw_tombstones" ("table_name","row_key","seq","version")
                   VALUES (?1, ?2, ?3, ?4)
                   ON CONFLICT ("table_name","row_key") DO UPDATE
                   SET "seq" = excluded."seq", "version" = excluded."version""#,
            )?
            .execute(params![table, key, seq, self.version])?;
        Ok(())
    }

    /// Records that this transaction wrote `columns` of the row at `key` while they await a
    /// backfill, so an older backfill snapshot does not overwrite them.
    fn note_backfilling_writes<'c>(
        &mut self,
        table: &ReplicaTable,
        key: &str,
        columns: impl Iterator<Item = &'c str>,
    ) -> Result<(), ReplicaError> {
        let mut stmt = self.conn.prepare_cached(
            r#"INSERT INTO "_hw_backfill_versions" ("table_name","row_key","column_name","version")
               VALUES (?1, ?2, ?3, ?4)
               ON CONFLICT DO UPDATE SET "version" = excluded."version""#,
        )?;
        for column in columns {
            if table.column(column).is_some_and(|c| c.backfill.is_some()) {
                stmt.execute(params![table.name, key, column, self.version])?;
            }
        }
        Ok(())
    }
}

/// Whether any column of `table` awaits a backfill (streamed writes to it are then tracked).
fn is_backfilling(table: &ReplicaTable) -> bool {
    !table.key.is_empty() && table.columns.iter().any(|c| c.backfill.is_some())
}

fn table_for<'t>(
    tables: &'t Tables,
    schema: &str,
    name: &str,
) -> Result<&'t ReplicaTable, ReplicaError> {
    // A `public` table goes by its own name: looked up without building one per row.
    let found = if schema == "public" {
        tables.get(name)
    } else {
        tables.get(&replica_table_name(schema, name))
    };
    found.ok_or_else(|| ReplicaError::UnknownTable {
        table: replica_table_name(schema, name),
    })
}

fn table_for_mut<'t>(
    tables: &'t mut Tables,
    id: &Identifier,
) -> Result<&'t mut ReplicaTable, ReplicaError> {
    let replica_name = replica_table_name(&id.schema, &id.name);
    tables
        .get_mut(&replica_name)
        .ok_or(ReplicaError::UnknownTable {
            table: replica_name,
        })
}

/// One row as the apply reads it: a change-stream row (JSON values), or a row of a pgoutput
/// change whose values kept their text ([`TextRowValues`]). Both bind the same SQLite values.
trait RowValues {
    /// The row's values bound for SQLite, in the row's column order.
    fn bound<'t>(
        &self,
        table: &'t ReplicaTable,
        json: JsonFormat,
    ) -> Result<Vec<(&'t ReplicaColumn, SqlScalar<'_>)>, ReplicaError>;

    /// The value of column `column`, if the row has it.
    fn value(&self, column: &ReplicaColumn, json: JsonFormat) -> Option<SqlScalar<'_>>;

    /// The names of the columns the row has.
    fn names(&self) -> impl Iterator<Item = &str>;
}

fn unknown_column(table: &ReplicaTable, column: &str) -> ReplicaError {
    ReplicaError::UnknownColumn {
        table: table.name.clone(),
        column: column.to_owned(),
    }
}

impl RowValues for Row {
    fn bound<'t>(
        &self,
        table: &'t ReplicaTable,
        json: JsonFormat,
    ) -> Result<Vec<(&'t ReplicaColumn, SqlScalar<'_>)>, ReplicaError> {
        self.iter()
            .map(|(name, value)| {
                let col = table
                    .column(name)
                    .ok_or_else(|| unknown_column(table, name))?;
                Ok((col, to_sql_ref(col, value, json)))
            })
            .collect()
    }

    fn value(&self, column: &ReplicaColumn, json: JsonFormat) -> Option<SqlScalar<'_>> {
        self.get(&column.name)
            .map(|value| to_sql_ref(column, value, json))
    }

    fn names(&self) -> impl Iterator<Item = &str> {
        self.keys().map(String::as_str)
    }
}

/// A row of a [`TextRowChange`], with its relation's column names.
struct TextRowValues<'a> {
    row: &'a TextRow,
    columns: &'a [String],
}

impl TextRowValues<'_> {
    fn name(&self, position: usize) -> &str {
        self.columns.get(position).map_or("", String::as_str)
    }
}

impl RowValues for TextRowValues<'_> {
    fn bound<'t>(
        &self,
        table: &'t ReplicaTable,
        json: JsonFormat,
    ) -> Result<Vec<(&'t ReplicaColumn, SqlScalar<'_>)>, ReplicaError> {
        self.row
            .iter()
            .map(|(position, value)| {
                let name = self.name(position);
                let col = table
                    .column(name)
                    .ok_or_else(|| unknown_column(table, name))?;
                Ok((col, text_to_sql(col, value, json)))
            })
            .collect()
    }

    fn value(&self, column: &ReplicaColumn, json: JsonFormat) -> Option<SqlScalar<'_>> {
        let position = self.columns.iter().position(|c| *c == column.name)?;
        self.row
            .get(position)
            .map(|value| text_to_sql(column, value, json))
    }

    fn names(&self) -> impl Iterator<Item = &str> {
        self.row.iter().map(|(position, _)| self.name(position))
    }
}

/// The SQLite value of a text row's value: what its JSON value binds ([`to_sql_ref`]), made
/// from the text without building that value.
fn text_to_sql<'v>(
    column: &ReplicaColumn,
    value: TextValue<'v>,
    json: JsonFormat,
) -> SqlScalar<'v> {
    match value {
        // Text rows come from pgoutput, whose JSON is stringified, as `scalar_to_sql` takes it.
        TextValue::Scalar(scalar) if json == JsonFormat::Stringified => {
            scalar_to_sql(column, scalar)
        }
        TextValue::Scalar(scalar) => SqlScalar::from(into_sql(column, scalar.to_value(), json)),
        TextValue::Json(value) => to_sql_ref(column, value, json),
    }
}

/// The values of the columns rows are matched on, taken from `row`.
fn key_values<'t, 'r>(
    table: &'t ReplicaTable,
    row: &'r impl RowValues,
    json: JsonFormat,
    what: &'static str,
) -> Result<Vec<(&'t ReplicaColumn, SqlScalar<'r>)>, ReplicaError> {
    table
        .match_columns()
        .iter()
        .map(|name| {
            let missing = || ReplicaError::MissingKey {
                table: table.name.clone(),
                column: name.clone(),
                what,
            };
            let col = table.column(name).ok_or_else(missing)?;
            let value = row.value(col, json).ok_or_else(missing)?;
            Ok((col, value))
        })
        .collect()
}

/// `WHERE …` matching one row by key (or, for a keyless table, the first row equal on all
/// columns), with parameters numbered from `first`.
fn where_key(
    table: &ReplicaTable,
    key: &[(&ReplicaColumn, SqlScalar<'_>)],
    first: usize,
) -> String {
    let conds: Vec<String> = key
        .iter()
        .enumerate()
        .map(|(i, (col, _))| {
            let op = if table.key.is_empty() { "IS" } else { "=" };
            format!("{} {op} ?{}", quote_ident(&col.name), first + i)
        })
        .collect();
    let conds = if conds.is_empty() {
        "1".to_owned()
    } else {
        conds.join(" AND ")
    };
    if table.key.is_empty() {
        format!(
            "rowid = (SELECT rowid FROM {} WHERE {conds} LIMIT 1)",
            quote_ident(&table.name)
        )
    } else {
        conds
    }
}

fn upsert(
    ctx: &mut RowContext<'_>,
    table: &ReplicaTable,
    values: Vec<(&ReplicaColumn, SqlScalar<'_>)>,
) -> Result<(), ReplicaError> {
    let sql = ctx
        .sql
        .get(table, SQL_UPSERT, &values, || upsert_sql(table, &values));
    let seq = ctx.seq();
    let params = values
        .into_iter()
        .map(|(_, v)| v)
        .chain([SqlScalar::Text(ctx.version.into()), SqlScalar::Integer(seq)]);
    ctx.conn
        .prepare_cached(&sql)?
        .execute(params_from_iter(params))?;
    Ok(())
}

fn upsert_sql(table: &ReplicaTable, values: &[(&ReplicaColumn, SqlScalar<'_>)]) -> String {
    let mut cols: Vec<String> = values.iter().map(|(c, _)| quote_ident(&c.name)).collect();
    cols.push("\"_hw_version\"".into());
    cols.push("\"_hw_seq\"".into());
    let placeholders: Vec<String> = (1..=cols.len()).map(|i| format!("?{i}")).collect();
    let mut sql = format!(
        "INSERT INTO {} ({}) VALUES ({})",
        quote_ident(&table.name),
        cols.join(", "),
        placeholders.join(", ")
    );
    if !table.key.is_empty() {
        let key: Vec<String> = table.key.iter().map(|c| quote_ident(c)).collect();
        let set: Vec<String> = cols.iter().map(|c| format!("{c} = excluded.{c}")).collect();
        sql.push_str(&format!(
            " ON CONFLICT ({}) DO UPDATE SET {}",
            key.join(", "),
            set.join(", ")
        ));
    }
    sql
}

/// How an update sets the row version.
#[derive(Clone, Copy)]
enum VersionRule {
    /// To this transaction's version (a streamed change).
    Set,
    /// To the later of the row's and this version: a backfill never moves a row backwards (a
    /// row the stream wrote later keeps its later version).
    Keep,
}

/// Updates the row matched by `key` to `values`; returns how many rows changed.
fn update_row(
    ctx: &mut RowContext<'_>,
    table: &ReplicaTable,
    values: &[(&ReplicaColumn, SqlScalar<'_>)],
    key: &[(&ReplicaColumn, SqlScalar<'_>)],
    version: VersionRule,
) -> Result<usize, ReplicaError> {
    let code = match version {
        VersionRule::Set => SQL_UPDATE_SET,
        VersionRule::Keep => SQL_UPDATE_KEEP,
    };
    let sql = ctx.sql.get(table, code, values, || {
        update_sql(table, values, key, version)
    });
    let seq = ctx.seq();
    let params = values
        .iter()
        .map(|(_, v)| v.clone())
        .chain([SqlScalar::Text(ctx.version.into()), SqlScalar::Integer(seq)])
        .chain(key.iter().map(|(_, v)| v.clone()));
    Ok(ctx
        .conn
        .prepare_cached(&sql)?
        .execute(params_from_iter(params))?)
}

fn update_sql(
    table: &ReplicaTable,
    values: &[(&ReplicaColumn, SqlScalar<'_>)],
    key: &[(&ReplicaColumn, SqlScalar<'_>)],
    version: VersionRule,
) -> String {
    let mut set: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, (c, _))| format!("{} = ?{}", quote_ident(&c.name), i + 1))
        .collect();
    let n = values.len();
    set.push(match version {
        VersionRule::Set => format!("\"_hw_version\" = ?{}", n + 1),
        VersionRule::Keep => format!("\"_hw_version\" = max(\"_hw_version\", ?{})", n + 1),
    });
    set.push(format!("\"_hw_seq\" = ?{}", n + 2));
    format!(
        "UPDATE {} SET {} WHERE {}",
        quote_ident(&table.name),
        set.join(", "),
        where_key(table, key, n + 3)
    )
}

fn apply_insert(
    ctx: &mut RowContext<'_>,
    tables: &Tables,
    relation: &Relation,
    new: &impl RowValues,
) -> Result<(), ReplicaError> {
    let table = table_for(tables, &relation.schema, &relation.name)?;
    let values = new.bound(table, ctx.json)?;
    upsert(ctx, table, values)?;
    if is_backfilling(table) {
        let key = row_key_json(&key_values(table, new, ctx.json, "new row")?);
        ctx.note_backfilling_writes(table, &key, new.names())?;
    }
    Ok(())
}

fn apply_update<R: RowValues>(
    ctx: &mut RowContext<'_>,
    tables: &Tables,
    relation: &Relation,
    key: Option<&R>,
    new: &R,
) -> Result<(), ReplicaError> {
    let table = table_for(tables, &relation.schema, &relation.name)?;
    let values = new.bound(table, ctx.json)?;
    let old_key = match key {
        Some(key) => Some(key_values(table, key, ctx.json, "old key")?),
        None => None,
    };
    // A key column left out of `new` (unchanged TOAST) keeps its old value.
    let new_key = match (&old_key, key_values(table, new, ctx.json, "new row")) {
        (_, Ok(key)) => key,
        (Some(old), Err(_)) => old.clone(),
        (None, Err(e)) => return Err(e),
    };
    let target = old_key.as_ref().unwrap_or(&new_key);
    if update_row(ctx, table, &values, target, VersionRule::Set)? == 0 {
        upsert(ctx, table, values)?;
    }
    if is_backfilling(table) {
        ctx.note_backfilling_writes(table, &row_key_json(&new_key), new.names())?;
    }
    if let Some(old) = &old_key {
        if !table.key.is_empty() && old != &new_key {
            let old_json = row_key_json(old);
            ctx.tombstone(&table.name, &old_json)?;
        }
    }
    Ok(())
}

fn apply_delete(
    ctx: &mut RowContext<'_>,
    tables: &Tables,
    relation: &Relation,
    key: &impl RowValues,
) -> Result<(), ReplicaError> {
    let table = table_for(tables, &relation.schema, &relation.name)?;
    let key = key_values(table, key, ctx.json, "key")?;
    let sql = ctx.sql.get(table, SQL_DELETE, &[], || {
        format!(
            "DELETE FROM {} WHERE {}",
            quote_ident(&table.name),
            where_key(table, &key, 1)
        )
    });
    let deleted = ctx
        .conn
        .prepare_cached(&sql)?
        .execute(params_from_iter(key.iter().map(|(_, v)| v)))?;
    if deleted > 0 && !table.key.is_empty() {
        ctx.tombstone(&table.name, &row_key_json(&key))?;
    }
    Ok(())
}

fn apply_truncate(
    ctx: &mut RowContext<'_>,
    tables: &Tables,
    truncate: &Truncate,
) -> Result<(), ReplicaError> {
    for relation in &truncate.relations {
        let table = table_for(tables, &relation.schema, &relation.name)?;
        ctx.conn
            .execute(&format!("DELETE FROM {}", quote_ident(&table.name)), [])?;
        // One marker stands for every row: older tombstones of the table say nothing more.
        ctx.conn.execute(
            r#"DELETE FROM "_hw_tombstones" WHERE "table_name" = ?1"#,
            [&table.name],
        )?;
        forget_backfill_versions(ctx.conn, &table.name, None)?;
        let seq = ctx.seq();
        ctx.conn.execute(
            r#"INSERT INTO "_hw_tombstones" ("table_name","row_key","seq","version")
               VALUES (?1, NULL, ?2, ?3)"#,
            params![table.name, seq, ctx.version],
        )?;
    }
    Ok(())
}

/// Backfilled values (`docs/protocol/change-stream.md`, "Backfills") overwrite only the
/// backfilling columns of existing rows, and of those only the ones the stream has not written
/// since the backfill's snapshot. A row deleted or truncated after the snapshot stays deleted.
/// A row the replica lacks is inserted, with the snapshot's watermark as its version, only
/// while the whole table awaits its backfill (for a column backfill it was deleted, or will
/// arrive with all its values from the stream).
fn apply_backfill(
    ctx: &mut RowContext<'_>,
    tables: &Tables,
    backfill: &Backfill,
) -> Result<(), ReplicaError> {
    let table = table_for(tables, &backfill.relation.schema, &backfill.relation.name)?;
    let snapshot = backfill.watermark.as_str();
    if truncated_after(ctx.conn, &table.name, snapshot)? {
        return Ok(());
    }
    let names: Vec<&String> = backfill
        .relation
        .row_key
        .columns
        .iter()
        .chain(&backfill.columns)
        .collect();
    // The table itself is new to the replica: its rows come from the backfill.
    let whole_table = table.columns.iter().all(|c| c.backfill.is_some());
    let keyed = !table.key.is_empty();
    let tracked = keyed && has_backfill_versions_after(ctx.conn, &table.name, snapshot)?;
    for values in &backfill.row_values {
        let mut row = Row::new();
        for (name, value) in names.iter().zip(values) {
            // Columns dropped since the backfill's snapshot are no longer in the replica.
            if table.column(name).is_some() {
                row.insert((*name).clone(), value.clone());
            }
        }
        let key = key_values(table, &row, ctx.json, "backfill row")?;
        let mut written_after = Vec::new();
        if keyed {
            let key_json = row_key_json(&key);
            if deleted_after(ctx.conn, &table.name, &key_json, snapshot)? {
                continue;
            }
            if tracked {
                written_after = columns_written_after(ctx.conn, &table.name, &key_json, snapshot)?;
            }
        }
        let set: Row = row
            .iter()
            .filter(|(name, _)| {
                !table.key.contains(name)
                    && table.column(name).is_some_and(|c| c.backfill.is_some())
                    && !written_after.contains(name)
            })
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        let set_values = set.bound(table, ctx.json)?;
        let exists = if set_values.is_empty() {
            row_exists(ctx.conn, table, &key)?
        } else {
            update_row(ctx, table, &set_values, &key, VersionRule::Keep)? > 0
        };
        if !exists && whole_table {
            let values = row.bound(table, ctx.json)?;
            let mut at_snapshot = RowContext {
                conn: ctx.conn,
                json: ctx.json,
                version: snapshot,
                next_seq: &mut *ctx.next_seq,
                sql: &mut *ctx.sql,
            };
            upsert(&mut at_snapshot, table, values)?;
        }
    }
    Ok(())
}

/// Whether the table was truncated after `snapshot`.
fn truncated_after(conn: &Connection, table: &str, snapshot: &str) -> Result<bool, ReplicaError> {
    Ok(conn
        .prepare_cached(
            r#"SELECT EXISTS (SELECT 1 FROM "_hw_tombstones"
               WHERE "table_name" = ?1 AND "row_key" IS NULL AND "version" > ?2)"#,
        )?
        .query_row(params![table, snapshot], |r| r.get(0))?)
}

/// Whether the row at `key` was deleted after `snapshot`.
fn deleted_after(
    conn: &Connection,
    table: &str,
    key: &str,
    snapshot: &str,
) -> Result<bool, ReplicaError> {
    Ok(conn
        .prepare_cached(
            r#"SELECT EXISTS (SELECT 1 FROM "_hw_tombstones"
               WHERE "table_name" = ?1 AND "row_key" = ?2 AND "version" > ?3)"#,
        )?
        .query_row(params![table, key, snapshot], |r| r.get(0))?)
}

fn has_backfill_versions_after(
    conn: &Connection,
    table: &str,
    snapshot: &str,
) -> Result<bool, ReplicaError> {
    Ok(conn
        .prepare_cached(
            r#"SELECT EXISTS (SELECT 1 FROM "_hw_backfill_versions"
               WHERE "table_name" = ?1 AND "version" > ?2)"#,
        )?
        .query_row(params![table, snapshot], |r| r.get(0))?)
}

/// The backfilling columns of the row at `key` that the stream wrote after `snapshot`.
fn columns_written_after(
    conn: &Connection,
    table: &str,
    key: &str,
    snapshot: &str,
) -> Result<Vec<String>, ReplicaError> {
    let mut stmt = conn.prepare_cached(
        r#"SELECT "column_name" FROM "_hw_backfill_versions"
           WHERE "table_name" = ?1 AND "row_key" = ?2 AND "version" > ?3"#,
    )?;
    let columns = stmt.query_map(params![table, key, snapshot], |r| r.get(0))?;
    Ok(columns.collect::<Result<_, _>>()?)
}

/// Forgets the write versions of `column` (every column when `None`) of `table`.
fn forget_backfill_versions(
    conn: &Connection,
    table: &str,
    column: Option<&str>,
) -> Result<(), ReplicaError> {
    conn.prepare_cached(
        r#"DELETE FROM "_hw_backfill_versions"
           WHERE "table_name" = ?1 AND (?2 IS NULL OR "column_name" = ?2)"#,
    )?
    .execute(params![table, column])?;
    Ok(())
}

fn row_exists(
    conn: &Connection,
    table: &ReplicaTable,
    key: &[(&ReplicaColumn, SqlScalar<'_>)],
) -> Result<bool, ReplicaError> {
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE {})",
        quote_ident(&table.name),
        where_key(table, key, 1)
    );
    Ok(conn
        .prepare_cached(&sql)?
        .query_row(params_from_iter(key.iter().map(|(_, v)| v)), |r| r.get(0))?)
}

fn apply_backfill_completed(
    conn: &Connection,
    tables: &mut Tables,
    done: &BackfillCompleted,
) -> Result<(), ReplicaError> {
    let id = Identifier::new(done.relation.schema.clone(), done.relation.name.clone());
    let table = table_for_mut(tables, &id)?;
    for name in done.relation.row_key.columns.iter().chain(&done.columns) {
        if let Some(col) = table.column_mut(name) {
            col.backfill = None;
            forget_backfill_versions(conn, &table.name, Some(name))?;
        }
    }
    schema::store_table(conn, table)
}

fn create_table(conn: &Connection, table: &ReplicaTable) -> Result<(), ReplicaError> {
    conn.execute_batch(&format!(
        "DROP TABLE IF EXISTS {}",
        quote_ident(&table.name)
    ))?;
    conn.execute_batch(&table.create_table_sql())?;
    if let Some(sql) = table.create_key_index_sql() {
        conn.execute_batch(&sql)?;
    }
    conn.execute_batch(&table.create_seq_index_sql())?;
    schema::forget_table_indexes(conn, &table.name)?;
    conn.execute(
        r#"DELETE FROM "_hw_tombstones" WHERE "table_name" = ?1"#,
        [&table.name],
    )?;
    forget_backfill_versions(conn, &table.name, None)?;
    schema::store_table(conn, table)
}

/// Creates a table in the replica, replacing one of the same name (used by initial sync too).
pub(super) fn create_replica_table(
    conn: &Connection,
    tables: &mut Tables,
    table: ReplicaTable,
) -> Result<(), ReplicaError> {
    create_table(conn, &table)?;
    tables.insert(table.name.clone(), table);
    Ok(())
}

fn apply_create_table(
    conn: &Connection,
    tables: &mut Tables,
    create: &CreateTable,
) -> Result<(), ReplicaError> {
    let mut table = ReplicaTable::from_spec(&create.spec);
    table.metadata = create.metadata.clone();
    if let Some(backfill) = &create.backfill {
        for (name, id) in backfill {
            if let Some(col) = table.column_mut(name) {
                col.backfill = Some(id.clone());
            }
        }
    }
    create_replica_table(conn, tables, table)
}

/// Recreates the internal indexes under the table's current name.
fn rebuild_internal_indexes(
    conn: &Connection,
    table: &ReplicaTable,
    old_name: &str,
) -> Result<(), ReplicaError> {
    for suffix in ["_hw_key", "_hw_seq"] {
        conn.execute_batch(&format!(
            "DROP INDEX IF EXISTS {}",
            quote_ident(&format!("{old_name}{suffix}"))
        ))?;
    }
    if let Some(sql) = table.create_key_index_sql() {
        conn.execute_batch(&sql)?;
    }
    conn.execute_batch(&table.create_seq_index_sql())?;
    Ok(())
}

fn apply_rename_table(
    conn: &Connection,
    tables: &mut Tables,
    rename: &RenameTable,
) -> Result<(), ReplicaError> {
    let old_name = replica_table_name(&rename.old.schema, &rename.old.name);
    let mut table = tables
        .remove(&old_name)
        .ok_or_else(|| ReplicaError::UnknownRenameSource {
            table: old_name.clone(),
        })?;
    table.name = replica_table_name(&rename.new.schema, &rename.new.name);
    table.schema = rename.new.schema.clone();
    table.table = rename.new.name.clone();
    conn.execute_batch(&format!(
        "ALTER TABLE {} RENAME TO {}",
        quote_ident(&old_name),
        quote_ident(&table.name)
    ))?;
    rebuild_internal_indexes(conn, &table, &old_name)?;
    schema::rename_table_indexes(conn, &old_name, &table.name)?;
    schema::forget_table(conn, &old_name)?;
    schema::store_table(conn, &table)?;
    for internal in ["_hw_tombstones", "_hw_backfill_versions"] {
        conn.execute(
            &format!(r#"UPDATE "{internal}" SET "table_name" = ?1 WHERE "table_name" = ?2"#),
            params![table.name, old_name],
        )?;
    }
    tables.insert(table.name.clone(), table);
    Ok(())
}

fn apply_drop_table(
    conn: &Connection,
    tables: &mut Tables,
    drop: &DropTable,
) -> Result<(), ReplicaError> {
    let name = replica_table_name(&drop.id.schema, &drop.id.name);
    conn.execute_batch(&format!("DROP TABLE IF EXISTS {}", quote_ident(&name)))?;
    schema::forget_table(conn, &name)?;
    schema::forget_table_indexes(conn, &name)?;
    conn.execute(
        r#"DELETE FROM "_hw_tombstones" WHERE "table_name" = ?1"#,
        [&name],
    )?;
    forget_backfill_versions(conn, &name, None)?;
    tables.remove(&name);
    Ok(())
}

/// Adds a column. Without a backfill, existing rows take the column's `dflt` the way Zero's
/// replicator maps it to a SQLite default, and count as changed by this transaction (new
/// version and sequence) so that subscribers catching up by sequence see the new values. A
/// default it cannot map leaves them NULL: Zero's replicator would stop there, and a change
/// source sends such a column with a backfill instead.
fn apply_add_column(
    ctx: &mut RowContext<'_>,
    tables: &mut Tables,
    add: &AddColumn,
) -> Result<(), ReplicaError> {
    let conn = ctx.conn;
    let table = table_for_mut(tables, &add.table)?;
    let mut col = ReplicaColumn::from_spec(&add.column.name, &add.column.spec);
    col.backfill = add.backfill.clone();
    if let Some(metadata) = &add.table_metadata {
        table.metadata = Some(metadata.clone());
    }
    if table.column(&col.name).is_none() {
        let default = match (&add.backfill, &col.dflt) {
            (None, Some(dflt)) => lite_default(dflt).ok(),
            _ => None,
        };
        let default_sql = default
            .as_ref()
            .map_or_else(String::new, |d| format!(" DEFAULT {d}"));
        conn.execute_batch(&format!(
            "ALTER TABLE {} ADD COLUMN {} {}{default_sql}",
            quote_ident(&table.name),
            quote_ident(&col.name),
            quote_ident(&col.declared_type())
        ))?;
        table.columns.push(col);
        if default.is_some() {
            touch_all_rows(ctx, &table.name)?;
        }
    } else if let Some(existing) = table.column_mut(&col.name) {
        *existing = col;
    }
    table.columns.sort_by_key(|c| c.pos);
    schema::store_table(conn, table)
}

/// Gives every row of `table` this transaction's version and a fresh sequence, in rowid order.
fn touch_all_rows(ctx: &mut RowContext<'_>, table: &str) -> Result<(), ReplicaError> {
    let quoted = quote_ident(table);
    let rowids: Vec<i64> = {
        let mut stmt = ctx
            .conn
            .prepare(&format!("SELECT rowid FROM {quoted} ORDER BY rowid"))?;
        let rows = stmt.query_map([], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()?
    };
    let mut update = ctx.conn.prepare(&format!(
        r#"UPDATE {quoted} SET "_hw_version" = ?1, "_hw_seq" = ?2 WHERE rowid = ?3"#
    ))?;
    for rowid in rowids {
        let seq = ctx.seq();
        update.execute(params![ctx.version, seq, rowid])?;
    }
    Ok(())
}

/// The SQL of the indexes of `table` that include `column` (SQLite cannot drop or retype an
/// indexed column).
fn indexes_on(
    conn: &Connection,
    table: &str,
    column: &str,
) -> Result<Vec<(String, String)>, ReplicaError> {
    let mut stmt = conn.prepare(
        "SELECT s.name, s.sql FROM sqlite_schema s
         WHERE s.type = 'index' AND s.tbl_name = ?1 AND s.sql IS NOT NULL
           AND EXISTS (SELECT 1 FROM pragma_index_info(s.name) i WHERE i.name = ?2)",
    )?;
    let rows = stmt.query_map(params![table, column], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

fn drop_indexes(conn: &Connection, indexes: &[(String, String)]) -> Result<(), ReplicaError> {
    for (name, _) in indexes {
        conn.execute_batch(&format!("DROP INDEX IF EXISTS {}", quote_ident(name)))?;
    }
    Ok(())
}

fn apply_update_column(
    conn: &Connection,
    tables: &mut Tables,
    update: &UpdateColumn,
) -> Result<(), ReplicaError> {
    let table = table_for_mut(tables, &update.table)?;
    let old =
        table
            .column(&update.old.name)
            .cloned()
            .ok_or_else(|| ReplicaError::UnknownColumn {
                table: table.name.clone(),
                column: update.old.name.clone(),
            })?;
    let mut new = ReplicaColumn::from_spec(&update.new.name, &update.new.spec);
    new.backfill = old.backfill.clone();
    let quoted_table = quote_ident(&table.name);
    if old.name != new.name {
        conn.execute_batch(&format!(
            "ALTER TABLE {quoted_table} RENAME COLUMN {} TO {}",
            quote_ident(&old.name),
            quote_ident(&new.name)
        ))?;
        for key in table.key.iter_mut().filter(|k| **k == old.name) {
            *key = new.name.clone();
        }
        schema::rename_index_column(conn, &table.name, &old.name, &new.name)?;
        conn.execute(
            r#"UPDATE "_hw_backfill_versions" SET "column_name" = ?1
               WHERE "table_name" = ?2 AND "column_name" = ?3"#,
            params![new.name, table.name, old.name],
        )?;
    }
    if old.declared_type() != new.declared_type() {
        // SQLite has no ALTER COLUMN TYPE: copy through a new column, keeping its indexes.
        let indexes = indexes_on(conn, &table.name, &new.name)?;
        drop_indexes(conn, &indexes)?;
        let tmp = quote_ident(&format!("_hw_retype_{}", new.name));
        let quoted = quote_ident(&new.name);
        conn.execute_batch(&format!(
            "ALTER TABLE {quoted_table} ADD COLUMN {tmp} {};
             UPDATE {quoted_table} SET {tmp} = {quoted};
             ALTER TABLE {quoted_table} DROP COLUMN {quoted};
             ALTER TABLE {quoted_table} RENAME COLUMN {tmp} TO {quoted};",
            quote_ident(&new.declared_type())
        ))?;
        for (_, sql) in &indexes {
            conn.execute_batch(sql)?;
        }
        if old.data_type != new.data_type {
            // Upstream rewrote the values without row events; only a backfill brings them.
            new.backfill = Some(serde_json::json!({"retype": old.data_type}));
        }
    }
    if let Some(col) = table.column_mut(&old.name) {
        *col = new;
    }
    table.columns.sort_by_key(|c| c.pos);
    schema::store_table(conn, table)
}

fn apply_drop_column(
    conn: &Connection,
    tables: &mut Tables,
    drop: &DropColumn,
) -> Result<(), ReplicaError> {
    let table = table_for_mut(tables, &drop.table)?;
    if table.column(&drop.column).is_none() {
        return Ok(());
    }
    let indexes = indexes_on(conn, &table.name, &drop.column)?;
    drop_indexes(conn, &indexes)?;
    if table.key.contains(&drop.column) {
        // Upstream dropped the key with the column; rows are matched on all columns until a
        // new key arrives.
        table.key.clear();
    }
    conn.execute_batch(&format!(
        "ALTER TABLE {} DROP COLUMN {}",
        quote_ident(&table.name),
        quote_ident(&drop.column)
    ))?;
    table.columns.retain(|c| c.name != drop.column);
    forget_backfill_versions(conn, &table.name, Some(&drop.column))?;
    schema::store_table(conn, table)
}

fn apply_create_index(
    conn: &Connection,
    tables: &mut Tables,
    create: &CreateIndex,
) -> Result<(), ReplicaError> {
    let spec = &create.spec;
    let id = Identifier::new(spec.schema.clone(), spec.table_name.clone());
    let table = table_for_mut(tables, &id)?;
    let flag = |key: &str| spec.extra.get(key).and_then(Value::as_bool) == Some(true);
    schema::record_index(
        conn,
        spec,
        flag("isReplicaIdentity") || flag("isPrimaryKey"),
    )?;
    if flag("isReplicaIdentity") || (flag("isPrimaryKey") && table.key.is_empty()) {
        let key: Vec<String> = spec.columns.keys().cloned().collect();
        if key != table.key {
            table.key = key;
            let name = table.name.clone();
            rebuild_internal_indexes(conn, table, &name)?;
            schema::store_table(conn, table)?;
        }
        return Ok(());
    }
    if flag("isPrimaryKey") {
        return Ok(());
    }
    conn.execute_batch(&create_index_sql(spec))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use highwater_engine::change_stream::{
        ColumnDef, ColumnSpec, Delete, IndexDirection, IndexSpec, Insert, NewRelation, PgTypeClass,
        ReplicaIdentity, RowKey, TableMetadata, TableSpec, Update,
    };
    use highwater_engine::watermark::Lsn;
    use indexmap::IndexMap;
    use serde_json::{json, Number};

    fn spec(schema: &str, name: &str, cols: &[(&str, &str)], key: &[&str]) -> TableSpec {
        let mut columns = IndexMap::new();
        for (i, (c, t)) in cols.iter().enumerate() {
            let mut s = ColumnSpec::new(Number::from(i as i64 + 1), *t);
            s.pg_type_class = Some(PgTypeClass::Base);
            columns.insert((*c).to_owned(), s);
        }
        TableSpec {
            schema: schema.into(),
            name: name.into(),
            columns,
            primary_key: Some(key.iter().map(|k| (*k).to_owned()).collect()),
            extra: serde_json::Map::new(),
        }
    }

    fn writer() -> ReplicaWriter {
        let mut replica = Replica::open_in_memory().unwrap();
        let version = Lsn(0x100).to_watermark();
        replica
            .store_initial_state(&ReplicaState {
                replica_version: version.clone(),
                watermark: version,
                lsn: Lsn(0x100),
                publications: vec!["pub".into()],
                slot: "slot".into(),
                app_id: "highwater".into(),
                next_seq: 1,
            })
            .unwrap();
        let mut writer = ReplicaWriter::new(replica);
        let mut tables = std::mem::take(&mut writer.replica.tables);
        let issue = spec(
            "public",
            "issue",
            &[("id", "int8"), ("title", "text"), ("meta", "jsonb")],
            &["id"],
        );
        create_replica_table(
            &writer.replica.conn,
            &mut tables,
            ReplicaTable::from_spec(&issue),
        )
        .unwrap();
        writer.replica.tables = tables;
        writer
    }

    fn rel(name: &str, key: &[&str], identity: ReplicaIdentity) -> Relation {
        Relation::new(
            "public",
            name,
            RowKey::new(
                key.iter().map(|k| (*k).to_owned()).collect(),
                Some(identity),
            ),
        )
    }

    fn row(v: Value) -> Row {
        match v {
            Value::Object(map) => map,
            _ => panic!("not an object"),
        }
    }

    fn insert(id: i64, title: &str) -> Change {
        Change::Insert(Insert {
            relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
            new: row(json!({"id": id, "title": title, "meta": null})),
            extra: Default::default(),
        })
    }

    fn txn(writer: &mut ReplicaWriter, lsn: u64, changes: Vec<Change>) -> Applied {
        let wm = Lsn(lsn).to_watermark();
        writer
            .apply(&DownstreamMessage::Begin(Begin::new(wm.clone())))
            .unwrap();
        for c in changes {
            writer.apply(&DownstreamMessage::Data(c)).unwrap();
        }
        writer
            .apply(&DownstreamMessage::Commit(Commit::new(wm)))
            .unwrap()
    }

    fn add_column(name: &str, data_type: &str, dflt: &str, backfill: bool) -> Change {
        let mut spec = ColumnSpec::new(Number::from(9), data_type);
        spec.pg_type_class = Some(PgTypeClass::Base);
        spec.dflt = Some(Some(dflt.to_owned()));
        Change::AddColumn(AddColumn {
            table: Identifier::new("public", "issue"),
            column: ColumnDef {
                name: name.into(),
                spec,
                extra: Default::default(),
            },
            table_metadata: Some(TableMetadata {
                row_key: json!({"id": {"attNum": 1}}).as_object().unwrap().clone(),
                extra: json!({"relationOID": 7}).as_object().unwrap().clone(),
            }),
            backfill: backfill.then(|| json!({"attNum": 9})),
            extra: Default::default(),
        })
    }

    /// A constant default without a backfill is what existing rows hold upstream (Zero's
    /// change source sends `DEFAULT 5` this way): the replica must not leave them NULL, and
    /// subscribers catching up by sequence must see them change.
    #[test]
    fn an_added_column_without_backfill_takes_its_default_on_existing_rows() {
        let mut w = writer();
        txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
        let seq_before: i64 = w
            .replica()
            .connection()
            .query_row(r#"SELECT max("_hw_seq") FROM "issue""#, [], |r| r.get(0))
            .unwrap();
        txn(
            &mut w,
            0x300,
            vec![
                add_column("points", "int4", "5", false),
                add_column("done", "bool", "false", false),
                add_column("state", "text", "'open'::text", false),
                // A default only upstream can compute comes with a backfill: NULL until then.
                add_column("updated", "timestamptz", "now()", true),
                // One Zero's replicator cannot map and no backfill: NULL, not a failure.
                add_column("odd", "int8", "nextval('s'::regclass)", false),
            ],
        );
        let got = rows(&w, "issue");
        assert_eq!(
            got[0],
            json!({"id": 1, "title": "a", "meta": null, "points": 5, "done": false,
                   "state": "open", "updated": null, "odd": null})
        );
        let (versions, min_seq): (i64, i64) = w
            .replica()
            .connection()
            .query_row(
                r#"SELECT count(DISTINCT "_hw_version"), min("_hw_seq") FROM "issue""#,
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(versions, 1);
        assert!(min_seq > seq_before, "{min_seq} > {seq_before}");
        let table = w.replica().table("issue").unwrap();
        assert_eq!(
            table.metadata.as_ref().unwrap().extra["relationOID"],
            json!(7)
        );
    }

    fn rows(writer: &ReplicaWriter, table: &str) -> Vec<Value> {
        writer
            .replica()
            .rows(table, JsonFormat::Parsed)
            .unwrap()
            .into_iter()
            .map(Value::Object)
            .collect()
    }

    fn tombstones(writer: &ReplicaWriter) -> Vec<(String, Option<String>, i64)> {
        let conn = &writer.replica().conn;
        let mut stmt = conn
            .prepare(r#"SELECT "table_name","row_key","seq" FROM "_hw_tombstones" ORDER BY "seq""#)
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    #[test]
    fn a_committed_transaction_stores_rows_versions_sequences_and_position() {
        let mut w = writer();
        let applied = txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
        assert_eq!(
            applied,
            Applied::Committed {
                watermark: Lsn(0x200).to_watermark(),
                lsn: Lsn(0x200)
            }
        );
        assert_eq!(
            rows(&w, "issue"),
            vec![
                json!({"id": 1, "title": "a", "meta": null}),
                json!({"id": 2, "title": "b", "meta": null})
            ]
        );
        let (version, seq): (String, i64) = w
            .replica()
            .conn
            .query_row(
                r#"SELECT "_hw_version", "_hw_seq" FROM "issue" WHERE "id" = 2"#,
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(version, Lsn(0x200).to_watermark().as_str());
        assert_eq!(seq, 2);
        let state = w.replica().state().unwrap();
        assert_eq!(state.lsn, Lsn(0x200));
        assert_eq!(state.next_seq, 3);
    }

    #[test]
    fn a_transaction_at_or_below_the_position_is_refused_not_applied_twice() {
        let mut w = writer();
        txn(&mut w, 0x200, vec![insert(1, "a")]);
        let replay = w.apply(&DownstreamMessage::Begin(Begin::new(
            Lsn(0x200).to_watermark(),
        )));
        assert!(matches!(replay, Err(ReplicaError::NotAfterPosition { .. })));
        assert!(!w.in_transaction());
        assert_eq!(
            rows(&w, "issue"),
            vec![json!({"id": 1, "title": "a", "meta": null})]
        );
    }

    fn stored_state(w: &ReplicaWriter) -> (String, i64) {
        w.replica()
            .conn
            .query_row(
                r#"SELECT "watermark", "next_seq" FROM "_hw_state" WHERE "lock" = 1"#,
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
    }

    #[test]
    fn grouped_transactions_share_one_commit_and_a_rollback_keeps_the_group() {
        let mut w = writer();
        w.set_group_commit(true);
        assert_eq!(
            txn(&mut w, 0x200, vec![insert(1, "a")]),
            Applied::Grouped {
                watermark: Lsn(0x200).to_watermark(),
                lsn: Lsn(0x200)
            }
        );
        assert!(matches!(
            txn(&mut w, 0x300, vec![insert(2, "b")]),
            Applied::Grouped { .. }
        ));
        // The third is rolled back: only its savepoint goes.
        let wm = Lsn(0x400).to_watermark();
        w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
        w.apply(&DownstreamMessage::Data(insert(3, "c"))).unwrap();
        assert_eq!(
            w.apply(&DownstreamMessage::Rollback(Default::default()))
                .unwrap(),
            Applied::RolledBack
        );
        assert!(w.group_open());
        assert!(!w.replica().conn.is_autocommit(), "nothing committed yet");
        assert!(w.commit_group().unwrap());
        assert!(w.replica().conn.is_autocommit());
        assert_eq!(
            stored_state(&w),
            (Lsn(0x300).to_watermark().as_str().to_owned(), 3)
        );
        assert_eq!(
            rows(&w, "issue"),
            vec![
                json!({"id": 1, "title": "a", "meta": null}),
                json!({"id": 2, "title": "b", "meta": null})
            ]
        );
        // A transaction not after the group's position is refused; the next one's seq
        // follows on.
        let replay = w.apply(&DownstreamMessage::Begin(Begin::new(
            Lsn(0x300).to_watermark(),
        )));
        assert!(matches!(replay, Err(ReplicaError::NotAfterPosition { .. })));
        assert!(matches!(
            txn(&mut w, 0x500, vec![insert(4, "d")]),
            Applied::Grouped { .. }
        ));
        // A discarded group leaves the durable state, in memory too.
        w.discard_group().unwrap();
        assert_eq!(
            w.replica().state().unwrap().watermark,
            Lsn(0x300).to_watermark()
        );
        assert_eq!(rows(&w, "issue").len(), 2);
        assert!(matches!(
            txn(&mut w, 0x500, vec![insert(4, "d")]),
            Applied::Grouped { .. }
        ));
        w.commit_group().unwrap();
        assert_eq!(
            stored_state(&w),
            (Lsn(0x500).to_watermark().as_str().to_owned(), 4)
        );
    }

    fn whole(lsn: u64, changes: Vec<Change>) -> Vec<DownstreamMessage> {
        let wm = Lsn(lsn).to_watermark();
        std::iter::once(DownstreamMessage::Begin(Begin::new(wm.clone())))
            .chain(changes.into_iter().map(DownstreamMessage::Data))
            .chain(std::iter::once(DownstreamMessage::Commit(Commit::new(wm))))
            .collect()
    }

    fn unknown_table_insert() -> Change {
        Change::Insert(Insert {
            relation: rel("nope", &["id"], ReplicaIdentity::Default).into(),
            new: row(json!({"id": 1})),
            extra: Default::default(),
        })
    }

    #[test]
    fn whole_transactions_join_a_group_and_an_error_in_one_discards_the_group() {
        let mut w = writer();
        w.set_group_commit(true);
        // The first of a group opens the SQLite transaction; later ones join it.
        assert!(matches!(
            w.apply_whole(&whole(0x200, vec![insert(1, "a")])).unwrap(),
            Applied::Grouped { .. }
        ));
        txn(&mut w, 0x300, vec![insert(2, "b")]);
        assert_eq!(
            w.apply_whole(&whole(0x400, vec![insert(3, "c"), insert(4, "d")]))
                .unwrap(),
            Applied::Grouped {
                watermark: Lsn(0x400).to_watermark(),
                lsn: Lsn(0x400)
            }
        );
        assert!(!w.in_transaction());
        // One write of the position, by the group's commit.
        assert_eq!(
            stored_state(&w),
            (Lsn(0x100).to_watermark().as_str().to_owned(), 1)
        );
        assert!(w.commit_group().unwrap());
        assert_eq!(
            stored_state(&w),
            (Lsn(0x400).to_watermark().as_str().to_owned(), 5)
        );
        // Inside the next group, a failing whole transaction takes the group's undurable
        // transactions with it: the replica is back at the durable position, in memory too.
        txn(&mut w, 0x500, vec![insert(5, "e")]);
        let failed = w.apply_whole(&whole(0x600, vec![insert(6, "f"), unknown_table_insert()]));
        assert!(
            matches!(failed, Err(ReplicaError::UnknownTable { .. })),
            "{failed:?}"
        );
        assert!(!w.group_open());
        assert!(!w.in_transaction());
        assert!(w.replica().conn.is_autocommit());
        assert_eq!(rows(&w, "issue").len(), 4);
        let state = w.replica().state().unwrap();
        assert_eq!(
            (state.watermark.clone(), state.next_seq),
            (Lsn(0x400).to_watermark(), 5)
        );
        // Sent again, they apply.
        txn(&mut w, 0x500, vec![insert(5, "e")]);
        w.apply_whole(&whole(0x600, vec![insert(6, "f")])).unwrap();
        w.commit_group().unwrap();
        assert_eq!(rows(&w, "issue").len(), 6);
        assert_eq!(
            stored_state(&w),
            (Lsn(0x600).to_watermark().as_str().to_owned(), 7)
        );
    }

    #[test]
    fn a_whole_transaction_must_run_from_begin_to_commit() {
        let mut w = writer();
        w.set_group_commit(true);
        txn(&mut w, 0x200, vec![insert(1, "a")]);
        let mut headless = whole(0x300, vec![insert(2, "b")]);
        headless.remove(0);
        assert!(matches!(
            w.apply_whole(&headless),
            Err(ReplicaError::IncompleteTransaction { .. })
        ));
        // Refused before anything was applied: the group stays.
        assert!(w.group_open());
        let mut endless = whole(0x300, vec![insert(2, "b")]);
        endless.pop();
        assert!(matches!(
            w.apply_whole(&endless),
            Err(ReplicaError::IncompleteTransaction { .. })
        ));
        assert!(!w.group_open() && !w.in_transaction());
        assert!(rows(&w, "issue").is_empty());
        assert_eq!(
            w.replica().state().unwrap().watermark,
            Lsn(0x100).to_watermark()
        );
    }

    /// The position of a group's commits is written only by the group's commit: a schema
    /// change rolled back inside the group reloads the schema, not that older position.
    #[test]
    fn a_schema_change_rolled_back_inside_a_group_keeps_the_groups_position() {
        let mut w = writer();
        w.set_group_commit(true);
        txn(&mut w, 0x200, vec![insert(1, "a")]);
        let wm = Lsn(0x300).to_watermark();
        w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
        w.apply(&DownstreamMessage::Data(add_column(
            "extra", "int4", "5", false,
        )))
        .unwrap();
        w.apply(&DownstreamMessage::Rollback(Default::default()))
            .unwrap();
        let state = w.replica().state().unwrap();
        assert_eq!(
            (state.watermark.clone(), state.next_seq),
            (Lsn(0x200).to_watermark(), 2)
        );
        assert!(w
            .replica()
            .table("issue")
            .unwrap()
            .column("extra")
            .is_none());
        // Not applied again, and the group's commit writes it.
        let replay = w.apply(&DownstreamMessage::Begin(Begin::new(
            Lsn(0x200).to_watermark(),
        )));
        assert!(matches!(replay, Err(ReplicaError::NotAfterPosition { .. })));
        w.commit_group().unwrap();
        assert_eq!(
            stored_state(&w),
            (Lsn(0x200).to_watermark().as_str().to_owned(), 2)
        );
    }

    #[test]
    fn rollback_discards_rows_and_sequence_numbers() {
        let mut w = writer();
        let wm = Lsn(0x300).to_watermark();
        w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
        w.apply(&DownstreamMessage::Data(insert(1, "a"))).unwrap();
        let applied = w
            .apply(&DownstreamMessage::Rollback(Default::default()))
            .unwrap();
        assert_eq!(applied, Applied::RolledBack);
        assert!(rows(&w, "issue").is_empty());
        txn(&mut w, 0x400, vec![insert(2, "b")]);
        assert_eq!(w.replica().state().unwrap().next_seq, 2);
    }

    #[test]
    fn a_commit_watermark_other_than_begin_is_rejected_and_nothing_is_stored() {
        let mut w = writer();
        w.apply(&DownstreamMessage::Begin(Begin::new(
            Lsn(0x300).to_watermark(),
        )))
        .unwrap();
        w.apply(&DownstreamMessage::Data(insert(1, "a"))).unwrap();
        let err = w
            .apply(&DownstreamMessage::Commit(Commit::new(
                Lsn(0x301).to_watermark(),
            )))
            .unwrap_err();
        assert!(
            matches!(err, ReplicaError::WatermarkMismatch { .. }),
            "{err}"
        );
        assert!(!w.in_transaction());
        assert!(rows(&w, "issue").is_empty());
        assert_eq!(w.replica().state().unwrap().lsn, Lsn(0x100));
    }

    #[test]
    fn updates_keep_absent_columns_and_follow_key_changes_with_a_tombstone() {
        let mut w = writer();
        txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
        let relation = rel("issue", &["id"], ReplicaIdentity::Default);
        // `title` is an unchanged TOAST value: absent from `new`.
        let keep_title = Change::Update(Update {
            relation: relation.clone().into(),
            key: None,
            new: row(json!({"id": 1, "meta": {"x": 1}})),
            extra: Default::default(),
        });
        let move_key = Change::Update(Update {
            relation: relation.into(),
            key: Some(row(json!({"id": 2}))),
            new: row(json!({"id": 3, "title": "b2", "meta": null})),
            extra: Default::default(),
        });
        txn(&mut w, 0x300, vec![keep_title, move_key]);
        assert_eq!(
            rows(&w, "issue"),
            vec![
                json!({"id": 1, "title": "a", "meta": {"x": 1}}),
                json!({"id": 3, "title": "b2", "meta": null})
            ]
        );
        assert_eq!(
            tombstones(&w),
            vec![("issue".to_owned(), Some(r#"{"id":2}"#.to_owned()), 5)]
        );
    }

    #[test]
    fn an_update_of_a_missing_row_becomes_an_insert() {
        let mut w = writer();
        let update = Change::Update(Update {
            relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
            key: None,
            new: row(json!({"id": 5, "title": "e", "meta": null})),
            extra: Default::default(),
        });
        txn(&mut w, 0x200, vec![update]);
        assert_eq!(
            rows(&w, "issue"),
            vec![json!({"id": 5, "title": "e", "meta": null})]
        );
    }

    #[test]
    fn replica_identity_full_is_keyed_by_the_table_key_not_all_columns() {
        let mut w = writer();
        txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
        let relation = rel("issue", &["id", "title", "meta"], ReplicaIdentity::Full);
        let update = Change::Update(Update {
            relation: relation.clone().into(),
            key: Some(row(json!({"id": 1, "title": "a", "meta": null}))),
            new: row(json!({"id": 1, "title": "a2", "meta": null})),
            extra: Default::default(),
        });
        let delete = Change::Delete(Delete {
            relation: relation.into(),
            key: row(json!({"id": 2, "title": "b", "meta": null})),
            extra: Default::default(),
        });
        txn(&mut w, 0x300, vec![update, delete]);
        assert_eq!(
            rows(&w, "issue"),
            vec![json!({"id": 1, "title": "a2", "meta": null})]
        );
        // The update kept its key: only the delete left a tombstone.
        assert_eq!(
            tombstones(&w).into_iter().map(|t| t.1).collect::<Vec<_>>(),
            vec![Some(r#"{"id":2}"#.to_owned())]
        );
    }

    #[test]
    fn truncate_empties_the_table_and_leaves_one_marker() {
        let mut w = writer();
        txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
        let delete = Change::Delete(Delete {
            relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
            key: row(json!({"id": 1})),
            extra: Default::default(),
        });
        txn(&mut w, 0x300, vec![delete]);
        let truncate = Change::Truncate(Truncate {
            relations: vec![rel("issue", &["id"], ReplicaIdentity::Default)],
            extra: Default::default(),
        });
        txn(&mut w, 0x400, vec![truncate]);
        assert!(rows(&w, "issue").is_empty());
        assert_eq!(tombstones(&w), vec![("issue".to_owned(), None, 4)]);
    }

    #[test]
    fn schema_changes_apply_in_the_transaction_of_the_rows_that_follow_them() {
        let mut w = writer();
        let create = Change::CreateTable(CreateTable {
            spec: spec("app", "label", &[("id", "int4"), ("name", "text")], &["id"]),
            metadata: None,
            backfill: None,
            extra: Default::default(),
        });
        let label = |v: Value| {
            Change::Insert(Insert {
                relation: Relation::new(
                    "app",
                    "tag",
                    RowKey::new(vec!["id".into()], Some(ReplicaIdentity::Default)),
                )
                .into(),
                new: row(v),
                extra: Default::default(),
            })
        };
        let rename = Change::RenameTable(RenameTable {
            old: Identifier::new("app", "label"),
            new: Identifier::new("app", "tag"),
            extra: Default::default(),
        });
        let mut color = ColumnSpec::new(Number::from(3), "text");
        color.not_null = Some(Some(false));
        let add = Change::AddColumn(AddColumn {
            table: Identifier::new("app", "tag"),
            column: ColumnDef {
                name: "color".into(),
                spec: color,
                extra: Default::default(),
            },
            table_metadata: None,
            backfill: None,
            extra: Default::default(),
        });
        let index = Change::CreateIndex(CreateIndex {
            spec: IndexSpec {
                schema: "app".into(),
                name: "tag_name".into(),
                table_name: "tag".into(),
                unique: true,
                columns: IndexMap::from([("name".to_owned(), IndexDirection::Asc)]),
                predicate: None,
                extra: Default::default(),
            },
            extra: Default::default(),
        });
        txn(
            &mut w,
            0x200,
            vec![
                create,
                rename,
                add,
                index,
                label(json!({"id": 1, "name": "bug", "color": "red"})),
            ],
        );
        assert_eq!(
            rows(&w, "app.tag"),
            vec![json!({"id": 1, "name": "bug", "color": "red"})]
        );
        let rename_col = Change::UpdateColumn(UpdateColumn {
            table: Identifier::new("app", "tag"),
            old: ColumnDef {
                name: "name".into(),
                spec: ColumnSpec::new(Number::from(2), "text"),
                extra: Default::default(),
            },
            new: ColumnDef {
                name: "title".into(),
                spec: ColumnSpec::new(Number::from(2), "varchar"),
                extra: Default::default(),
            },
            extra: Default::default(),
        });
        let drop_col = Change::DropColumn(DropColumn {
            table: Identifier::new("app", "tag"),
            column: "color".into(),
            extra: Default::default(),
        });
        txn(&mut w, 0x300, vec![rename_col, drop_col]);
        assert_eq!(rows(&w, "app.tag"), vec![json!({"id": 1, "title": "bug"})]);
        let reopened = Replica::with_connection(std::mem::replace(
            &mut w.replica.conn,
            rusqlite::Connection::open_in_memory().unwrap(),
        ))
        .unwrap();
        let tag = reopened.table("app.tag").unwrap();
        assert_eq!(tag.column("title").unwrap().data_type, "varchar");
        // The retyped column waits for upstream's converted values.
        assert!(tag.column("title").unwrap().backfill.is_some());
        assert!(reopened.table("app.label").is_none());
        let drop = Change::DropTable(DropTable {
            id: Identifier::new("app", "tag"),
            extra: Default::default(),
        });
        let mut w = ReplicaWriter::new(reopened);
        txn(&mut w, 0x400, vec![drop]);
        assert!(w.replica().table("app.tag").is_none());
    }

    #[test]
    fn a_rolled_back_schema_change_leaves_the_schema_as_it_was() {
        let mut w = writer();
        let wm = Lsn(0x300).to_watermark();
        w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
        w.apply(&DownstreamMessage::Data(Change::DropTable(DropTable {
            id: Identifier::new("public", "issue"),
            extra: Default::default(),
        })))
        .unwrap();
        assert!(w.replica().table("issue").is_none());
        w.apply(&DownstreamMessage::Rollback(Default::default()))
            .unwrap();
        assert!(w.replica().table("issue").is_some());
        txn(&mut w, 0x400, vec![insert(1, "a")]);
        assert_eq!(rows(&w, "issue").len(), 1);
    }

    #[test]
    fn backfills_fill_existing_rows_and_complete_the_pending_columns() {
        let mut w = writer();
        txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
        let mut prio = ColumnSpec::new(Number::from(4), "int4");
        prio.not_null = Some(Some(false));
        let add = Change::AddColumn(AddColumn {
            table: Identifier::new("public", "issue"),
            column: ColumnDef {
                name: "prio".into(),
                spec: prio,
                extra: Default::default(),
            },
            table_metadata: None,
            backfill: Some(json!({"attNum": 4})),
            extra: Default::default(),
        });
        txn(&mut w, 0x300, vec![add]);
        let pending = w.pending_backfills();
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].columns, vec!["prio".to_owned()]);
        assert!(!pending[0].whole_table);
        let relation = NewRelation {
            schema: "public".into(),
            name: "issue".into(),
            row_key: RowKey::new(vec!["id".into()], None),
            extra: Default::default(),
        };
        let backfill = Change::Backfill(Backfill {
            relation: relation.clone(),
            columns: vec!["prio".into()],
            watermark: Lsn(0x300).to_watermark(),
            // Row 7 is not in the replica: a column backfill does not create it.
            row_values: vec![vec![json!(1), json!(10)], vec![json!(7), json!(70)]],
            progress_marks: None,
            status: None,
            extra: Default::default(),
        });
        let done = Change::BackfillCompleted(BackfillCompleted {
            relation,
            columns: vec!["prio".into()],
            watermark: Lsn(0x300).to_watermark(),
            progress_marks: None,
            status: None,
            extra: Default::default(),
        });
        let wm = Lsn(0x300).to_watermark().state_version().next_minor();
        let wm = wm.to_watermark().unwrap();
        let mut begin = Begin::new(wm.clone());
        begin.skip_ack = Some(true);
        w.apply(&DownstreamMessage::Begin(begin)).unwrap();
        w.apply(&DownstreamMessage::Data(backfill)).unwrap();
        w.apply(&DownstreamMessage::Data(done)).unwrap();
        w.apply(&DownstreamMessage::Commit(Commit::new(wm)))
            .unwrap();
        assert_eq!(
            rows(&w, "issue"),
            vec![
                json!({"id": 1, "title": "a", "meta": null, "prio": 10}),
                json!({"id": 2, "title": "b", "meta": null, "prio": null})
            ]
        );
        assert!(w.pending_backfills().is_empty());
        // The next upstream transaction (a larger major) is not mistaken for a replay.
        let applied = txn(&mut w, 0x301, vec![insert(3, "c")]);
        assert!(matches!(applied, Applied::Committed { .. }));
    }

    fn add_prio_with_backfill(w: &mut ReplicaWriter, lsn: u64) {
        let mut prio = ColumnSpec::new(Number::from(4), "int4");
        prio.not_null = Some(Some(false));
        let add = Change::AddColumn(AddColumn {
            table: Identifier::new("public", "issue"),
            column: ColumnDef {
                name: "prio".into(),
                spec: prio,
                extra: Default::default(),
            },
            table_metadata: None,
            backfill: Some(json!({"attNum": 4})),
            extra: Default::default(),
        });
        txn(w, lsn, vec![add]);
    }

    fn issue_relation() -> NewRelation {
        NewRelation {
            schema: "public".into(),
            name: "issue".into(),
            row_key: RowKey::new(vec!["id".into()], None),
            extra: Default::default(),
        }
    }

    /// One synthetic backfill transaction after `after` (a skipAck transaction at its next
    /// minor version), read at the snapshot `snapshot`.
    fn backfill_txn(
        w: &mut ReplicaWriter,
        after: u64,
        snapshot: u64,
        columns: &[&str],
        row_values: Vec<Vec<Value>>,
        complete: bool,
    ) -> Applied {
        let wm = Lsn(after).to_watermark().state_version().next_minor();
        let wm = wm.to_watermark().unwrap();
        let columns: Vec<String> = columns.iter().map(|c| (*c).to_owned()).collect();
        let mut begin = Begin::new(wm.clone());
        begin.skip_ack = Some(true);
        w.apply(&DownstreamMessage::Begin(begin)).unwrap();
        w.apply(&DownstreamMessage::Data(Change::Backfill(Backfill {
            relation: issue_relation(),
            columns: columns.clone(),
            watermark: Lsn(snapshot).to_watermark(),
            row_values,
            progress_marks: None,
            status: None,
            extra: Default::default(),
        })))
        .unwrap();
        if complete {
            w.apply(&DownstreamMessage::Data(Change::BackfillCompleted(
                BackfillCompleted {
                    relation: issue_relation(),
                    columns,
                    watermark: Lsn(snapshot).to_watermark(),
                    progress_marks: None,
                    status: None,
                    extra: Default::default(),
                },
            )))
            .unwrap();
        }
        w.apply(&DownstreamMessage::Commit(Commit::new(wm)))
            .unwrap()
    }

    fn versions(w: &ReplicaWriter) -> Vec<(i64, String)> {
        let mut stmt = w
            .replica()
            .conn
            .prepare(r#"SELECT "id", "_hw_version" FROM "issue" ORDER BY "id""#)
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    fn tracked_versions(w: &ReplicaWriter) -> i64 {
        w.replica()
            .conn
            .query_row(r#"SELECT count(*) FROM "_hw_backfill_versions""#, [], |r| {
                r.get(0)
            })
            .unwrap()
    }

    /// A backfill read at a snapshot older than later streamed changes skips the rows deleted
    /// after it and keeps the backfilling values the stream wrote after it
    /// (`change-stream.md`, "Backfills").
    #[test]
    fn backfill_skips_rows_deleted_after_its_snapshot_and_keeps_later_streamed_values() {
        let mut w = writer();
        txn(
            &mut w,
            0x200,
            vec![insert(1, "a"), insert(2, "b"), insert(3, "c")],
        );
        add_prio_with_backfill(&mut w, 0x300);
        let update = Change::Update(Update {
            relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
            key: None,
            new: row(json!({"id": 1, "title": "a2", "meta": null, "prio": 11})),
            extra: Default::default(),
        });
        let delete = Change::Delete(Delete {
            relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
            key: row(json!({"id": 2})),
            extra: Default::default(),
        });
        // Only the title of row 3 changes (its prio left out, like an unchanged TOAST value).
        let title_only = Change::Update(Update {
            relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
            key: None,
            new: row(json!({"id": 3, "title": "c2", "meta": null})),
            extra: Default::default(),
        });
        txn(&mut w, 0x400, vec![update, delete, title_only]);
        assert_eq!(tracked_versions(&w), 1, "only row 1's prio was written");
        let applied = backfill_txn(
            &mut w,
            0x400,
            0x350,
            &["prio"],
            vec![
                vec![json!(1), json!(10)],
                vec![json!(2), json!(20)],
                vec![json!(3), json!(30)],
            ],
            true,
        );
        assert!(matches!(applied, Applied::Committed { .. }));
        assert_eq!(
            rows(&w, "issue"),
            vec![
                json!({"id": 1, "title": "a2", "meta": null, "prio": 11}),
                json!({"id": 3, "title": "c2", "meta": null, "prio": 30})
            ]
        );
        assert!(w.pending_backfills().is_empty());
        assert_eq!(
            tracked_versions(&w),
            0,
            "completion forgets the write versions"
        );
    }

    /// A table new to the replica gets the rows it lacks, versioned at the backfill's snapshot;
    /// rows the stream wrote after the snapshot keep their values, and a truncate after the
    /// snapshot drops the whole backfill (`change-stream.md`, "Backfills").
    #[test]
    fn whole_table_backfill_inserts_missing_rows_at_the_snapshot_version() {
        let mut w = writer();
        let drop = Change::DropTable(DropTable {
            id: Identifier::new("public", "issue"),
            extra: Default::default(),
        });
        let create = Change::CreateTable(CreateTable {
            spec: spec(
                "public",
                "issue",
                &[("id", "int8"), ("title", "text"), ("meta", "jsonb")],
                &["id"],
            ),
            metadata: None,
            backfill: Some(
                ["id", "title", "meta"]
                    .iter()
                    .map(|c| ((*c).to_owned(), json!({"attNum": 1})))
                    .collect(),
            ),
            extra: Default::default(),
        });
        txn(&mut w, 0x200, vec![drop, create]);
        assert!(w.pending_backfills()[0].whole_table);
        txn(&mut w, 0x300, vec![insert(1, "streamed")]);
        let rows_read = vec![
            vec![json!(1), json!("old"), json!(null)],
            vec![json!(2), json!("b"), json!(null)],
        ];
        backfill_txn(
            &mut w,
            0x300,
            0x280,
            &["title", "meta"],
            rows_read.clone(),
            false,
        );
        assert_eq!(
            rows(&w, "issue"),
            vec![
                json!({"id": 1, "title": "streamed", "meta": null}),
                json!({"id": 2, "title": "b", "meta": null})
            ]
        );
        assert_eq!(
            versions(&w),
            vec![
                (1, Lsn(0x300).to_watermark().as_str().to_owned()),
                (2, Lsn(0x280).to_watermark().as_str().to_owned())
            ]
        );
        // A truncate after the snapshot: nothing read before it comes back.
        let truncate = Change::Truncate(Truncate {
            relations: vec![rel("issue", &["id"], ReplicaIdentity::Default)],
            extra: Default::default(),
        });
        txn(&mut w, 0x500, vec![truncate]);
        backfill_txn(&mut w, 0x500, 0x450, &["title", "meta"], rows_read, true);
        assert!(rows(&w, "issue").is_empty());
        assert!(w.pending_backfills().is_empty());
    }

    /// Once a column's backfill completed, the stream owns its values: a backfill delivered
    /// again (a relay's source restarting) changes nothing.
    #[test]
    fn a_backfill_of_a_completed_column_changes_nothing() {
        let mut w = writer();
        txn(&mut w, 0x200, vec![insert(1, "a")]);
        add_prio_with_backfill(&mut w, 0x300);
        backfill_txn(
            &mut w,
            0x300,
            0x310,
            &["prio"],
            vec![vec![json!(1), json!(5)]],
            true,
        );
        let update = Change::Update(Update {
            relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
            key: None,
            new: row(json!({"id": 1, "title": "a", "meta": null, "prio": 6})),
            extra: Default::default(),
        });
        txn(&mut w, 0x400, vec![update]);
        backfill_txn(
            &mut w,
            0x400,
            0x310,
            &["prio"],
            vec![vec![json!(1), json!(5)]],
            true,
        );
        assert_eq!(
            rows(&w, "issue"),
            vec![json!({"id": 1, "title": "a", "meta": null, "prio": 6})]
        );
    }

    #[test]
    fn changes_to_unknown_tables_or_columns_are_typed_errors() {
        let mut w = writer();
        let wm = Lsn(0x200).to_watermark();
        w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
        let err = w
            .apply(&DownstreamMessage::Data(Change::Insert(Insert {
                relation: rel("nope", &["id"], ReplicaIdentity::Default).into(),
                new: row(json!({"id": 1})),
                extra: Default::default(),
            })))
            .unwrap_err();
        assert!(matches!(err, ReplicaError::UnknownTable { .. }), "{err}");
        let err = w
            .apply(&DownstreamMessage::Data(insert(1, "a")))
            .unwrap_err();
        assert!(
            matches!(err, ReplicaError::NotInTransaction { .. }),
            "{err}"
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Upsert(i64, String),
        Update { from: i64, to: i64, title: String },
        Delete(i64),
        Truncate,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (0i64..8, "[a-z]{0,3}").prop_map(|(id, t)| Op::Upsert(id, t)),
            (0i64..8, 0i64..8, "[a-z]{0,3}").prop_map(|(from, to, title)| Op::Update {
                from,
                to,
                title
            }),
            (0i64..8).prop_map(Op::Delete),
            Just(Op::Truncate),
        ]
    }

    /// What Postgres would hold after `op` (updates and deletes of missing rows do nothing).
    fn model_apply(model: &mut std::collections::BTreeMap<i64, String>, op: &Op) {
        match op {
            Op::Upsert(id, t) => {
                model.insert(*id, t.clone());
            }
            Op::Update { from, to, title } => {
                if model.remove(from).is_some() {
                    model.insert(*to, title.clone());
                }
            }
            Op::Delete(id) => {
                model.remove(id);
            }
            Op::Truncate => model.clear(),
        }
    }

    fn change_of(op: &Op, model: &std::collections::BTreeMap<i64, String>) -> Option<Change> {
        let relation = rel("issue", &["id"], ReplicaIdentity::Default);
        Some(match op {
            Op::Upsert(id, t) if model.contains_key(id) => Change::Update(Update {
                relation: relation.into(),
                key: None,
                new: row(json!({"id": id, "title": t, "meta": null})),
                extra: Default::default(),
            }),
            Op::Upsert(id, t) => Change::Insert(Insert {
                relation: relation.into(),
                new: row(json!({"id": id, "title": t, "meta": null})),
                extra: Default::default(),
            }),
            Op::Update { from, to, title } => {
                if !model.contains_key(from) || (from != to && model.contains_key(to)) {
                    return None;
                }
                Change::Update(Update {
                    relation: relation.into(),
                    key: (from != to).then(|| row(json!({"id": from}))),
                    // The title is left out when unchanged, like an unchanged TOAST value.
                    new: if model.get(from) == Some(title) {
                        row(json!({"id": to, "meta": null}))
                    } else {
                        row(json!({"id": to, "title": title, "meta": null}))
                    },
                    extra: Default::default(),
                })
            }
            Op::Delete(id) if model.contains_key(id) => Change::Delete(Delete {
                relation: relation.into(),
                key: row(json!({"id": id})),
                extra: Default::default(),
            }),
            Op::Delete(_) => return None,
            Op::Truncate => Change::Truncate(Truncate {
                relations: vec![relation],
                extra: Default::default(),
            }),
        })
    }

    // ---- text rows: the same replica as JSON rows ----

    mod text_rows {
        use super::*;
        use highwater_engine::pgoutput::{
            self as pg, OldTuple, PgoutputEvent, PgoutputMapper, PgoutputMessage, RelationColumn,
            Tuple, TupleValue,
        };
        use proptest::prelude::*;

        const ORDERS: u32 = 16500;
        /// The columns of `public.orders`: name, type OID, replica data type.
        const COLUMNS: &[(&str, u32, &str)] = &[
            ("id", 20, "int8"),
            ("account", 23, "int4"),
            ("title", 25, "text"),
            ("amount", 1700, "numeric"),
            ("at", 1184, "timestamptz"),
            ("attrs", 3802, "jsonb"),
            ("ok", 16, "bool"),
            ("ratio", 701, "float8"),
            ("tags", 1009, "text[]"),
            ("day", 1082, "date"),
        ];

        fn orders_writer() -> ReplicaWriter {
            let mut w = writer();
            let cols: Vec<(&str, &str)> = COLUMNS.iter().map(|(n, _, t)| (*n, *t)).collect();
            let mut tables = std::mem::take(&mut w.replica.tables);
            let orders = spec("public", "orders", &cols, &["id"]);
            create_replica_table(
                &w.replica.conn,
                &mut tables,
                ReplicaTable::from_spec(&orders),
            )
            .unwrap();
            w.replica.tables = tables;
            w
        }

        fn relation() -> pg::Relation {
            pg::Relation {
                oid: ORDERS,
                namespace: "public".into(),
                name: "orders".into(),
                replica_identity: pg::ReplicaIdentity::Default,
                columns: COLUMNS
                    .iter()
                    .map(|(name, oid, _)| RelationColumn {
                        flags: u8::from(*name == "id"),
                        name: (*name).into(),
                        type_oid: *oid,
                        type_modifier: -1,
                    })
                    .collect(),
            }
        }

        /// Values for every column but the key, drawn per column.
        fn values() -> impl Strategy<Value = Vec<TupleValue<'static>>> {
            let pool: [&'static [&'static str]; 9] = [
                &["1", "-7", "2147483647"],
                &["", "plain", "é ☃", "a\"quote"],
                &["12.50", "-0.01", "1e+20", "1E5", "NaN", "Infinity"],
                &[
                    "2024-01-02 03:04:05.123456+00",
                    "1999-12-31 23:59:59-07:30",
                    "infinity",
                ],
                &["{}", "{\"k\": [1, 2.5e3]}", "null", "\"s\""],
                &["t", "f"],
                &[
                    "3.14",
                    "-0",
                    "1e-7",
                    "1E5",
                    "NaN",
                    "-Infinity",
                    "9007199254740993",
                ],
                &["{}", "{a,\"b c\",NULL}", "{{x,y},{z,w}}"],
                &["2024-01-02", "infinity", "0044-03-15 BC"],
            ];
            let columns: Vec<_> = pool
                .into_iter()
                .map(|texts| {
                    prop_oneof![
                        8 => proptest::sample::select(texts).prop_map(|t| TupleValue::Text(t.as_bytes())),
                        1 => Just(TupleValue::Null),
                        1 => Just(TupleValue::UnchangedToast),
                    ]
                })
                .collect();
            columns
        }

        #[derive(Debug, Clone)]
        enum Op {
            Insert(u8, Vec<TupleValue<'static>>),
            /// From one id to another (the same for no key change).
            Update(u8, u8, Vec<TupleValue<'static>>),
            Delete(u8),
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0u8..6, values()).prop_map(|(id, v)| Op::Insert(id, v)),
                (0u8..6, 0u8..6, values()).prop_map(|(a, b, v)| Op::Update(a, b, v)),
                (0u8..6).prop_map(Op::Delete),
            ]
        }

        fn id(n: u8) -> TupleValue<'static> {
            TupleValue::Text(String::leak(n.to_string()).as_bytes())
        }

        fn tuple(key: u8, values: &[TupleValue<'static>]) -> Tuple<'static> {
            Tuple(
                std::iter::once(id(key))
                    .chain(values.iter().cloned())
                    .collect(),
            )
        }

        /// The key tuple of the row at `key`: the key column, the others null.
        fn key_tuple(key: u8) -> OldTuple<'static> {
            OldTuple::Key(Tuple(
                std::iter::once(id(key))
                    .chain((1..COLUMNS.len()).map(|_| TupleValue::Null))
                    .collect(),
            ))
        }

        fn message(op: &Op) -> PgoutputMessage<'static> {
            match op {
                Op::Insert(key, values) => {
                    // An insert never has unchanged TOAST values.
                    let values: Vec<_> = values
                        .iter()
                        .map(|v| match v {
                            TupleValue::UnchangedToast => TupleValue::Null,
                            v => *v,
                        })
                        .collect();
                    PgoutputMessage::Insert(pg::Insert {
                        relation_oid: ORDERS,
                        new: tuple(*key, &values),
                    })
                }
                Op::Update(from, to, values) => PgoutputMessage::Update(pg::Update {
                    relation_oid: ORDERS,
                    old: (from != to).then(|| key_tuple(*from)),
                    new: tuple(*to, values),
                }),
                Op::Delete(key) => PgoutputMessage::Delete(pg::Delete {
                    relation_oid: ORDERS,
                    old: key_tuple(*key),
                }),
            }
        }

        /// Maps `message` and applies what it maps to: `text` rows with `apply_text`, others
        /// with `apply`.
        fn apply(
            writer: &mut ReplicaWriter,
            mapper: &mut PgoutputMapper,
            message: PgoutputMessage<'_>,
        ) {
            match mapper.map_message(message).unwrap() {
                Some(PgoutputEvent::Downstream(message)) => {
                    writer.apply(&message).unwrap();
                }
                Some(PgoutputEvent::Commit { commit, .. }) => {
                    writer.apply(&DownstreamMessage::Commit(commit)).unwrap();
                }
                Some(PgoutputEvent::RowText(change)) => {
                    writer.apply_text(&change).unwrap();
                }
                Some(PgoutputEvent::Relation { .. }) | None => {}
                Some(other) => panic!("unexpected {other:?}"),
            }
        }

        /// Everything a transaction leaves in the replica: rows with their versions and seqs,
        /// and tombstones.
        type Contents = (Vec<Vec<String>>, Vec<(String, Option<String>, i64)>);

        fn contents(w: &ReplicaWriter) -> Contents {
            let conn = &w.replica().conn;
            let mut stmt = conn
                .prepare(r#"SELECT *, typeof("amount"), typeof("ratio"), typeof("at") FROM "orders" ORDER BY "id""#)
                .unwrap();
            let n = stmt.column_count();
            let rows = stmt
                .query_map([], |r| {
                    (0..n)
                        .map(|i| {
                            r.get_ref(i).map(|v| match v {
                                rusqlite::types::ValueRef::Real(f) => {
                                    format!("real {:?}", f.to_bits())
                                }
                                other => format!("{other:?}"),
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()
                })
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            (rows, tombstones(w))
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            /// Any history of inserts, updates (key changes and unchanged TOAST included) and
            /// deletes leaves the same replica, bit for bit, whether the rows are applied from
            /// their text or from the JSON rows of the same messages.
            #[test]
            fn text_rows_store_what_json_rows_store(
                txns in proptest::collection::vec(proptest::collection::vec(op(), 1..6), 1..5),
            ) {
                let mut json = (orders_writer(), PgoutputMapper::new());
                let mut text = (orders_writer(), PgoutputMapper::new());
                text.1.keep_row_text();
                let mut lsn = 0x200;
                let mut present = std::collections::BTreeSet::new();
                for ops in &txns {
                    let mut messages = vec![
                        PgoutputMessage::Relation(relation()),
                        PgoutputMessage::Begin(pg::Begin {
                            final_lsn: Lsn(lsn),
                            commit_time: pg::PgTimestamp(0),
                            xid: 9,
                        }),
                    ];
                    // Upstream's key is unique: no key changes onto another row.
                    for op in ops {
                        match op {
                            Op::Update(from, to, _) if from != to && present.contains(to) => continue,
                            Op::Insert(key, _) => { present.insert(*key); }
                            Op::Update(from, to, _) => { present.remove(from); present.insert(*to); }
                            Op::Delete(key) => { present.remove(key); }
                        }
                        messages.push(message(op));
                    }
                    messages.push(PgoutputMessage::Commit(pg::Commit {
                        flags: 0,
                        commit_lsn: Lsn(lsn),
                        end_lsn: Lsn(lsn + 8),
                        commit_time: pg::PgTimestamp(0),
                    }));
                    for (writer, mapper) in [&mut json, &mut text] {
                        for m in &messages {
                            apply(writer, mapper, m.clone());
                        }
                    }
                    lsn += 0x100;
                }
                prop_assert_eq!(contents(&json.0), contents(&text.0));
            }
        }
    }

    proptest::proptest! {
        /// Any history of transactions, some rolled back and some delivered twice (a replay
        /// after a reconnect: a committed one is refused, a rolled-back one applies again),
        /// leaves the replica equal to the upstream table.
        #[test]
        fn replica_equals_upstream_after_any_history_with_rollbacks_and_replays(
            txns in proptest::collection::vec(
                (proptest::collection::vec(op(), 1..6), proptest::bool::ANY, proptest::bool::ANY),
                1..12,
            )
        ) {
            let mut w = writer();
            let mut model = std::collections::BTreeMap::new();
            for (i, (ops, rolled_back, replayed)) in txns.iter().enumerate() {
                let wm = Lsn(0x1000 + i as u64 * 0x10).to_watermark();
                let mut after = model.clone();
                let mut changes = Vec::new();
                for op in ops {
                    if let Some(change) = change_of(op, &after) {
                        changes.push(change);
                        model_apply(&mut after, op);
                    }
                }
                let deliveries = if *replayed { 2 } else { 1 };
                for delivery in 0..deliveries {
                    let begin = w.apply(&DownstreamMessage::Begin(Begin::new(wm.clone())));
                    if delivery > 0 && !rolled_back {
                        proptest::prop_assert!(
                            matches!(begin, Err(ReplicaError::NotAfterPosition { .. })),
                            "a committed transaction delivered again: {:?}",
                            begin
                        );
                        continue;
                    }
                    begin.unwrap();
                    for change in &changes {
                        w.apply(&DownstreamMessage::Data(change.clone())).unwrap();
                    }
                    if *rolled_back {
                        w.apply(&DownstreamMessage::Rollback(Default::default())).unwrap();
                    } else {
                        w.apply(&DownstreamMessage::Commit(Commit::new(wm.clone()))).unwrap();
                    }
                }
                if !rolled_back {
                    model = after;
                }
            }
            let expected: Vec<Value> = model
                .iter()
                .map(|(id, t)| json!({"id": id, "title": t, "meta": null}))
                .collect();
            proptest::prop_assert_eq!(rows(&w, "issue"), expected);
            // Every live row has its own sequence number, below the next one to hand out.
            let (distinct, max): (i64, Option<i64>) = w
                .replica()
                .conn
                .query_row(r#"SELECT count(DISTINCT "_hw_seq"), max("_hw_seq") FROM "issue""#, [], |r| {
                    Ok((r.get(0)?, r.get(1)?))
                })
                .unwrap();
            proptest::prop_assert_eq!(distinct as usize, model.len());
            proptest::prop_assert!(max.unwrap_or(0) < w.replica().state().unwrap().next_seq);
        }
    }

    fn feed_writer() -> ReplicaWriter {
        let mut w = writer();
        w.enable_scope_feed(
            [("issue".to_owned(), vec!["title".to_owned()])]
                .into_iter()
                .collect(),
        )
        .unwrap();
        w
    }

    /// Row seqs by id, tombstones, and the next seq.
    type Seqs = (Vec<(i64, i64)>, Vec<(String, Option<String>, i64)>, i64);

    fn seqs(w: &ReplicaWriter) -> Seqs {
        let conn = &w.replica().conn;
        let mut stmt = conn
            .prepare(r#"SELECT "id", "_hw_seq" FROM "issue" ORDER BY "id""#)
            .unwrap();
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        (rows, tombstones(w), w.replica().state().unwrap().next_seq)
    }

    /// The scope `title = t` as a client rebuilds it: from `start` (its rows at a cursor),
    /// replaying pages of `limit` from `after`, starting over on a truncate reset.
    fn replay_scope(
        w: &ReplicaWriter,
        title: &str,
        start: std::collections::BTreeMap<i64, String>,
        after: Option<i64>,
        limit: u32,
    ) -> std::collections::BTreeMap<i64, String> {
        use super::feed::{read_scope_page, FeedKind, ScopePage, ScopeQuery};
        let conditions =
            highwater_engine::scope_sync::Conditions::parse(&row(json!({ "title": title })))
                .unwrap();
        let mut client = start;
        let mut after = after;
        let mut up_to = None;
        loop {
            let page = read_scope_page(
                &w.replica().conn,
                &w.replica().tables,
                &ScopeQuery {
                    table: "issue",
                    conditions: &conditions,
                    row_filter: None,
                    after,
                    up_to,
                    limit,
                    count_total: up_to.is_none(),
                    access: &[],
                },
            )
            .unwrap();
            let (pinned, rows) = match page {
                ScopePage::Rows { up_to, rows, .. } => (up_to, rows),
                ScopePage::Truncated => {
                    client.clear();
                    after = None;
                    up_to = None;
                    continue;
                }
                other => panic!("unexpected page {other:?}"),
            };
            up_to = Some(pinned);
            let mut last = after;
            for feed_row in &rows {
                assert!(Some(feed_row.seq) > last, "rows ascend strictly");
                assert!(
                    feed_row.seq <= pinned,
                    "rows stay at or below the high-water"
                );
                last = Some(feed_row.seq);
                let id: i64 = feed_row.resource_id.parse().unwrap();
                match &feed_row.kind {
                    FeedKind::Upsert { data } => {
                        assert_eq!(data["title"], json!(title));
                        client.insert(id, title.to_owned());
                    }
                    FeedKind::Exit { .. } => {
                        client.remove(&id);
                    }
                }
            }
            after = last.or(Some(after.unwrap_or(0)));
            if rows.len() < limit as usize {
                return client;
            }
        }
    }

    #[test]
    fn a_row_moved_out_of_a_scope_is_an_exit_there_and_a_write_in_the_new_scope() {
        let mut w = feed_writer();
        let mut commit_time = Commit::new(Lsn(0x200).to_watermark());
        commit_time.commit_time_ms = Some(Number::from(1_796_126_400_123_i64));
        let wm = Lsn(0x200).to_watermark();
        w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
        w.apply(&DownstreamMessage::Data(insert(1, "ada"))).unwrap();
        w.apply(&DownstreamMessage::Commit(commit_time)).unwrap();
        let first = w.take_committed().unwrap();
        assert_eq!(first.rows.len(), 1);
        assert_eq!(first.rows[0].updated_at, "2026-12-01T12:00:00.123Z");
        let moved = Change::Update(Update {
            relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
            key: None,
            new: row(json!({"id": 1, "title": "grace", "meta": null})),
            extra: Default::default(),
        });
        txn(&mut w, 0x300, vec![moved]);
        let second = w.take_committed().unwrap();
        use super::feed::FeedKind;
        assert_eq!(second.rows.len(), 2, "{second:?}");
        assert!(
            matches!(&second.rows[0].kind, FeedKind::Upsert { data } if data["title"] == "grace")
        );
        assert!(matches!(
            &second.rows[1].kind,
            FeedKind::Exit { old, new: Some(new) } if old["title"] == "ada" && new["title"] == "grace"
        ));
        assert_eq!(second.rows[0].seq, second.rows[1].seq);
        let ada = replay_scope(&w, "ada", [(1, "ada".to_owned())].into(), Some(1), 10);
        assert!(ada.is_empty(), "{ada:?}");
        let grace = replay_scope(&w, "grace", Default::default(), Some(1), 10);
        assert_eq!(grace, [(1, "grace".to_owned())].into());
    }

    /// Regression: a column added with a default the replica applies changed every row, but
    /// the transaction's feed entries were empty, so live scope subscribers never saw the new
    /// column until each row changed again.
    #[test]
    fn an_added_column_with_a_default_reaches_live_scope_subscribers() {
        let mut w = feed_writer();
        txn(&mut w, 0x200, vec![insert(1, "ada"), insert(2, "grace")]);
        w.take_committed();
        txn(
            &mut w,
            0x300,
            vec![add_column("points", "int4", "5", false)],
        );
        let committed = w.take_committed().unwrap();
        use super::feed::FeedKind;
        let mut points: Vec<_> = committed
            .rows
            .iter()
            .map(|r| match &r.kind {
                FeedKind::Upsert { data } => (data["id"].clone(), data["points"].clone()),
                other => panic!("expected upserts, found {other:?}"),
            })
            .collect();
        points.sort_by_key(|(id, _)| id.as_i64());
        assert_eq!(points, vec![(json!(1), json!(5)), (json!(2), json!(5))]);
        // A column that waits for its backfill changes no row now: nothing to send yet.
        txn(
            &mut w,
            0x400,
            vec![add_column("later", "timestamptz", "now()", true)],
        );
        assert!(w.take_committed().is_none_or(|c| c.rows.is_empty()));
    }

    #[test]
    fn pruning_exits_raises_the_retention_floor() {
        let mut w = feed_writer();
        txn(&mut w, 0x200, vec![insert(1, "ada"), insert(2, "ada")]);
        let delete = Change::Delete(Delete {
            relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
            key: row(json!({"id": 1})),
            extra: Default::default(),
        });
        txn(&mut w, 0x300, vec![delete]);
        let conn = &w.replica().conn;
        assert_eq!(
            super::feed::retention_floor(conn).unwrap(),
            Some(0),
            "followed from the start"
        );
        assert_eq!(
            super::feed::prune_exits(conn, "1970-01-01T00:00:00.000Z").unwrap(),
            Some(0),
            "nothing is older than the epoch"
        );
        assert_eq!(
            super::feed::prune_exits(conn, "2100-01-01T00:00:00.000Z").unwrap(),
            Some(3)
        );
        // A page carries the floor its own read saw, with its rows.
        use super::feed::{read_scope_page, ScopePage, ScopeQuery};
        let conditions = highwater_engine::scope_sync::Conditions::default();
        let page = read_scope_page(
            conn,
            &w.replica().tables,
            &ScopeQuery {
                table: "issue",
                conditions: &conditions,
                row_filter: None,
                after: Some(1),
                up_to: None,
                limit: 10,
                count_total: false,
                access: &[],
            },
        )
        .unwrap();
        assert!(
            matches!(page, ScopePage::Rows { floor: Some(3), .. }),
            "{page:?}"
        );
    }

    #[test]
    fn following_a_new_filter_column_raises_the_floor_to_now() {
        let mut w = feed_writer();
        txn(&mut w, 0x200, vec![insert(1, "ada"), insert(2, "ada")]);
        let same = [("issue".to_owned(), vec!["title".to_owned()])];
        w.enable_scope_feed(same.into_iter().collect()).unwrap();
        assert_eq!(
            super::feed::retention_floor(&w.replica().conn).unwrap(),
            Some(0)
        );
        let more = [(
            "issue".to_owned(),
            vec!["title".to_owned(), "meta".to_owned()],
        )];
        w.enable_scope_feed(more.into_iter().collect()).unwrap();
        assert_eq!(
            super::feed::retention_floor(&w.replica().conn).unwrap(),
            Some(2),
            "moves on `meta` before now were never journalled"
        );
    }

    proptest::proptest! {
        /// With the scope feed on, seqs are exactly those without it (a relay with other rules
        /// assigns the same), and every scope replayed from any cursor of the history lands on
        /// the upstream rows of that scope.
        #[test]
        fn the_scope_feed_keeps_seqs_and_replays_every_scope_from_any_cursor(
            txns in proptest::collection::vec(proptest::collection::vec(op(), 1..6), 1..10),
            cut in 0usize..10,
            limit in 1u32..4,
        ) {
            let mut plain = writer();
            let mut fed = feed_writer();
            let mut model = std::collections::BTreeMap::new();
            let mut history = vec![(None, model.clone())];
            let mut titles = std::collections::BTreeSet::new();
            for (i, ops) in txns.iter().enumerate() {
                let mut changes = Vec::new();
                for op in ops {
                    if let Some(change) = change_of(op, &model) {
                        changes.push(change);
                        model_apply(&mut model, op);
                    }
                }
                titles.extend(model.values().cloned());
                let lsn = 0x1000 + i as u64 * 0x10;
                txn(&mut plain, lsn, changes.clone());
                txn(&mut fed, lsn, changes);
                let seq = fed.replica().state().unwrap().next_seq - 1;
                history.push((Some(seq), model.clone()));
            }
            proptest::prop_assert_eq!(seqs(&plain), seqs(&fed));
            let (after, at_cursor) = history[cut % history.len()].clone();
            for title in &titles {
                let start = at_cursor
                    .iter()
                    .filter(|(_, t)| *t == title)
                    .map(|(id, t)| (*id, t.clone()))
                    .collect();
                let want: std::collections::BTreeMap<i64, String> = model
                    .iter()
                    .filter(|(_, t)| *t == title)
                    .map(|(id, t)| (*id, t.clone()))
                    .collect();
                let got = replay_scope(&fed, title, start, after, limit);
                proptest::prop_assert_eq!(got, want, "scope title = {:?} after {:?}", title, after);
            }
        }
    }
}
