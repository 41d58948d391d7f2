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
//! Backfills follow Zero's rules for backfill data, which the engine's
//! [`BackfillMerge`] holds: rows are upserted by key,
//! except rows deleted (or truncated) after the backfill's snapshot; a backfilling column keeps
//! a value the stream wrote after that snapshot (tracked per row in `_hw_backfill_versions`
//! while the column is backfilling); rows new to the replica get the snapshot's watermark as
//! their version. How each write sets a row's version is the engine's
//! [`RowVersion`].
//!
//! What a transaction costs is kept small. A row statement's SQL is built once per table and
//! column set and prepared through the connection's statement cache, as are the per-transaction
//! `BEGIN`, `SAVEPOINT`, `RELEASE` and `COMMIT`; values are bound borrowed from the change
//! ([`to_sql_ref`] for JSON rows, [`scalar_to_sql`] for text rows). A small transaction is held
//! whole by the caller until its commit (until the engine's `upstream::outgrows_hold`) and applied by
//! [`ReplicaWriter::apply_whole`] with no savepoint of its own; one that outgrows the hold
//! streams in inside a savepoint. In a group the position row (`_hw_state`) is written once,
//! by [`ReplicaWriter::commit_group`]. The property test `text_rows_store_what_json_rows_store`
//! checks that a text row and its JSON row leave the same replica, bit for bit.

use highwater_engine::backfill::{BackfillMerge, BackfilledValue, RowMerge, RowVersion};
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

/// One part of a whole transaction for [`ReplicaWriter::apply_whole`]: a message, or a row
/// change that kept its text.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TxnItem<'a> {
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
pub(crate) struct PendingBackfill {
    /// Replica table name.
    pub table: String,
    pub schema: String,
    pub name: String,
    pub key: Vec<String>,
    /// Non-key columns to backfill; every column of the table for a whole-table backfill.
    pub columns: Vec<String>,
    /// Whether the table itself is new to the replica (its rows must be inserted).
    pub(crate) whole_table: bool,
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
    pub(crate) fn set_group_commit(&mut self, on: bool) {
        self.grouping = on;
    }

    /// Whether grouped transactions wait for [`ReplicaWriter::commit_group`].
    #[cfg(test)]
    pub(crate) fn group_open(&self) -> bool {
        self.group_open
    }

    /// Commits the SQLite transaction of the open group durably (between upstream
    /// transactions only). Returns whether there was one.
    pub(crate) fn commit_group(&mut self) -> Result<bool, ReplicaError> {
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
    pub(crate) fn discard_group(&mut self) -> Result<(), ReplicaError> {
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
    pub(crate) fn enable_scope_feed(&mut self, tables: FeedTables) -> Result<(), ReplicaError> {
        feed::prepare(&self.replica.conn, &self.replica.tables, &tables)?;
        self.feed = Some(Capture::new(tables));
        Ok(())
    }

    /// Records that the transaction committed next (the open one, or the next one applied
    /// whole) applies these sync clients' mutations: its commit writes them to
    /// `_hw_client_mutations` in the same SQLite transaction and hands them on in its
    /// [`CommittedChanges::confirms`]. A rollback forgets them.
    pub(crate) fn confirm_with_next_commit(&mut self, confirms: Vec<(String, u64)>) {
        self.confirms.extend(confirms);
    }

    /// The scope-feed entries of the transaction committed last (empty when the feed is off or
    /// it touched no followed table). Route them to scope subscribers only now, after the
    /// commit: their seqs are durable.
    pub(crate) fn take_committed(&mut self) -> Option<CommittedChanges> {
        self.committed.take()
    }

    /// The upstream commit time of the last transaction committed (Unix ms), when the change
    /// source gave one.
    pub(crate) fn last_commit_ms(&self) -> Option<i64> {
        self.last_commit_ms
    }

    pub fn replica(&self) -> &Replica {
        &self.replica
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
    pub(crate) fn apply_whole<'a, I>(&mut self, items: I) -> Result<Applied, ReplicaError>
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
    pub(crate) fn pending_backfills(&self) -> Vec<PendingBackfill> {
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
    /// This context writing at the version `rule` names: the transaction's, or `snapshot`
    /// (the backfill's) for [`RowVersion::Snapshot`].
    fn at<'b>(&'b mut self, rule: RowVersion, snapshot: &'b str) -> RowContext<'b> {
        RowContext {
            conn: self.conn,
            json: self.json,
            version: match rule {
                RowVersion::Commit | RowVersion::Later => self.version,
                RowVersion::Snapshot => snapshot,
            },
            next_seq: &mut *self.next_seq,
            sql: &mut *self.sql,
        }
    }

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

/// Updates the row matched by `key` to `values`, its version set as `version` says (the
/// engine's rule for the write) to the context's version; returns how many rows changed.
fn update_row(
    ctx: &mut RowContext<'_>,
    table: &ReplicaTable,
    values: &[(&ReplicaColumn, SqlScalar<'_>)],
    key: &[(&ReplicaColumn, SqlScalar<'_>)],
    version: RowVersion,
) -> Result<usize, ReplicaError> {
    let code = match version {
        RowVersion::Commit | RowVersion::Snapshot => SQL_UPDATE_SET,
        RowVersion::Later => SQL_UPDATE_KEEP,
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
    version: RowVersion,
) -> String {
    let mut set: Vec<String> = values
        .iter()
        .enumerate()
        .map(|(i, (c, _))| format!("{} = ?{}", quote_ident(&c.name), i + 1))
        .collect();
    let n = values.len();
    set.push(match version {
        RowVersion::Commit | RowVersion::Snapshot => format!("\"_hw_version\" = ?{}", n + 1),
        RowVersion::Later => format!("\"_hw_version\" = max(\"_hw_version\", ?{})", n + 1),
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
    if update_row(ctx, table, &values, target, RowVersion::Commit)? == 0 {
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

/// Backfilled values (`docs/protocol/change-stream.md`, "Backfills") meet the replica's rows
/// as the engine's [`BackfillMerge`] decides: this reads what the replica knows of the table
/// and of each row (the versions of its truncate, of the row's tombstone, of the stream's
/// writes to its backfilling columns) and runs the statement the answer names: an update of
/// the held row (or, with nothing to write, a look for it), then an insert if it was missing.
fn apply_backfill(
    ctx: &mut RowContext<'_>,
    tables: &Tables,
    backfill: &Backfill,
) -> Result<(), ReplicaError> {
    let table = table_for(tables, &backfill.relation.schema, &backfill.relation.name)?;
    let snapshot = &backfill.watermark;
    // The table itself is new to the replica: its rows come from the backfill.
    let whole_table = table.columns.iter().all(|c| c.backfill.is_some());
    let truncated = newest_truncate(ctx.conn, &table.name)?;
    let Some(merge) = BackfillMerge::new(snapshot, whole_table, truncated.as_ref()) else {
        return Ok(());
    };
    let names: Vec<&String> = backfill
        .relation
        .row_key
        .columns
        .iter()
        .chain(&backfill.columns)
        .collect();
    let keyed = !table.key.is_empty();
    // The stream's writes to backfilling columns are read per row only when one of them came
    // after the snapshot.
    let tracked = keyed
        && newest_backfill_write(ctx.conn, &table.name)?
            .is_some_and(|version| merge.yields_to(&version));
    for values in &backfill.row_values {
        let mut row = Row::new();
        for (name, value) in names.iter().zip(values) {
            // Columns dropped since the backfill's snapshot are no longer in the replica.
            if table.column(name).is_some() {
                row.insert((*name).clone(), value.clone());
            }
        }
        let key = key_values(table, &row, ctx.json, "backfill row")?;
        let mut deleted = None;
        let mut written = Vec::new();
        if keyed {
            let key_json = row_key_json(&key);
            deleted = tombstone_version(ctx.conn, &table.name, &key_json)?;
            if tracked {
                written = backfill_writes(ctx.conn, &table.name, &key_json)?;
            }
        }
        let backfilled: Vec<BackfilledValue<'_>> = row
            .keys()
            .map(|name| BackfilledValue {
                column: name,
                in_key: table.key.contains(name),
                awaits_backfill: table.column(name).is_some_and(|c| c.backfill.is_some()),
            })
            .collect();
        let RowMerge::Merge {
            update,
            version,
            insert,
        } = merge.row(&backfilled, deleted.as_ref(), &written)
        else {
            continue;
        };
        let set: Row = row
            .iter()
            .enumerate()
            .filter(|(i, _)| update.contains(i))
            .map(|(_, (n, v))| (n.clone(), v.clone()))
            .collect();
        let set_values = set.bound(table, ctx.json)?;
        let exists = if set_values.is_empty() {
            row_exists(ctx.conn, table, &key)?
        } else {
            let mut at = ctx.at(version, snapshot.as_str());
            update_row(&mut at, table, &set_values, &key, version)? > 0
        };
        if let (false, Some(version)) = (exists, insert) {
            let values = row.bound(table, ctx.json)?;
            upsert(&mut ctx.at(version, snapshot.as_str()), table, values)?;
        }
    }
    Ok(())
}

/// The version of the table's newest truncate.
fn newest_truncate(conn: &Connection, table: &str) -> Result<Option<Watermark>, ReplicaError> {
    let version: Option<String> = conn
        .prepare_cached(
            r#"SELECT max("version") FROM "_hw_tombstones"
               WHERE "table_name" = ?1 AND "row_key" IS NULL"#,
        )?
        .query_row(params![table], |r| r.get(0))?;
    Ok(version.as_deref().map(Watermark::parse).transpose()?)
}

/// The version of the tombstone of the row at `key` (deleted, or moved to another key).
fn tombstone_version(
    conn: &Connection,
    table: &str,
    key: &str,
) -> Result<Option<Watermark>, ReplicaError> {
    let version: Option<String> = conn
        .prepare_cached(
            r#"SELECT max("version") FROM "_hw_tombstones"
               WHERE "table_name" = ?1 AND "row_key" = ?2"#,
        )?
        .query_row(params![table, key], |r| r.get(0))?;
    Ok(version.as_deref().map(Watermark::parse).transpose()?)
}

/// The version of the stream's newest write to a backfilling column of the table.
fn newest_backfill_write(
    conn: &Connection,
    table: &str,
) -> Result<Option<Watermark>, ReplicaError> {
    let version: Option<String> = conn
        .prepare_cached(
            r#"SELECT max("version") FROM "_hw_backfill_versions" WHERE "table_name" = ?1"#,
        )?
        .query_row(params![table], |r| r.get(0))?;
    Ok(version.as_deref().map(Watermark::parse).transpose()?)
}

/// The backfilling columns of the row at `key` the stream wrote, each with the version of its
/// latest write.
fn backfill_writes(
    conn: &Connection,
    table: &str,
    key: &str,
) -> Result<Vec<(String, Watermark)>, ReplicaError> {
    let mut stmt = conn.prepare_cached(
        r#"SELECT "column_name", "version" FROM "_hw_backfill_versions"
           WHERE "table_name" = ?1 AND "row_key" = ?2"#,
    )?;
    let rows = stmt.query_map(params![table, key], |r| {
        Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
    })?;
    let mut writes = Vec::new();
    for row in rows {
        let (column, version) = row?;
        writes.push((column, Watermark::parse(&version)?));
    }
    Ok(writes)
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

/// Creates a table in the replica, replacing one of the same name (used by the initial load
/// too).
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
mod tests;
