//! The initial load: the replica's side of an initial sync. The sync (`replication/initial_sync.rs`)
//! reads upstream's snapshot and converts its rows; a [`Load`] writes them.
//!
//! A load begins on an empty replica ([`Load::begin`]): its marker, its settings and its first
//! transaction. It creates the published tables ([`Load::create_table`]), leaves each table's key
//! index out while its rows go in ([`Load::defer_key_index`]), writes rows a [`RowBlock`] at a
//! time with a table's multi-row INSERTs ([`Load::write`], committing every `batch_rows` rows),
//! builds a table's indexes once its rows are in ([`Load::finish_table`]), and makes every row
//! durable before the state that says they are there ([`Load::finish`]). A load dropped before
//! it finished rolls back its open transaction and restores the replica's settings; its marker
//! stays, so the next [`Replica::open`] removes the replica and the sync starts over.
//!
//! Rows are stored with `_hw_version` = the replica version and `_hw_seq` counting up from 1 in
//! the order they are written.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use highwater_engine::change_stream::{IndexSpec, TableMetadata, TableSpec};
use highwater_engine::upstream::is_key_index;
use highwater_engine::watermark::Watermark;
use rusqlite::{CachedStatement, Connection};

use super::apply::create_replica_table;
use super::load_marker::{marker_path, LoadMarker};
use super::schema::{create_index_sql, quote_ident, record_index, ReplicaTable};
use super::value::SqlScalar;
use super::{Replica, ReplicaError, ReplicaState};

/// Settings during the load. `synchronous = OFF` skips the fsync of each load transaction, and
/// a replica in a file also loads with `journal_mode = OFF` (each page written once, to the
/// database file, instead of to the WAL and again by a checkpoint). Both are safe because
/// nothing marks the replica as synced before its rows are durable, and because the load runs
/// under its marker ([`LoadMarker`]), removed only after the state that says the rows are there
/// is durable and a checkpoint under `synchronous = FULL` fsynced the database file (an fsync
/// covers every page of the file, also those written without one). A crash or power loss
/// before that leaves the marker, and the next [`Replica::open`] removes the replica unopened,
/// whatever state its file is in, so it is synced again from nothing. A replica kept in WAL
/// mode makes its rows durable before its state instead ([`make_load_durable`]). A somewhat
/// larger page cache (8 MiB) serves the index builds after each table.
const LOAD_PRAGMAS: &str = "PRAGMA synchronous = OFF; PRAGMA cache_size = -8192;";
/// The settings [`Replica::open`] uses, back after the load.
const LOAD_PRAGMAS_END: &str = "PRAGMA synchronous = FULL; PRAGMA cache_size = -2000;";

/// An initial load in progress on a replica.
pub(crate) struct Load<'r> {
    replica: &'r mut Replica,
    /// The replica's file and the marker of the load in it; none for a replica in memory.
    marker: Option<(PathBuf, LoadMarker)>,
    /// Loading without a journal (see [`LOAD_PRAGMAS`]).
    unjournaled: bool,
    /// `_hw_version` of every row: the replica version.
    version: String,
    /// Rows per transaction.
    batch_rows: usize,
    /// Rows written in the open transaction.
    in_txn: usize,
    /// The `_hw_seq` of the next row.
    next_seq: i64,
    /// The state is recorded and durable: nothing to roll back when dropped.
    finished: bool,
}

impl<'r> Load<'r> {
    /// Begins loading `replica` (empty), whose rows get `_hw_version` = `version`, committing
    /// every `batch_rows` rows. A replica in a file loads without a journal, under a marker that
    /// makes an interrupted load start over instead of being opened (see [`super::load_marker`]).
    /// An in-memory one, or one SQLite keeps in WAL mode (another connection is open), loads
    /// through its WAL.
    pub(crate) fn begin(
        replica: &'r mut Replica,
        version: &Watermark,
        batch_rows: usize,
    ) -> Result<Load<'r>, ReplicaError> {
        let db_path = replica
            .conn
            .path()
            .filter(|p| !p.is_empty())
            .map(PathBuf::from);
        let marker = match db_path {
            Some(db) => {
                let marker = LoadMarker::create(&db).map_err(|source| marker_error(&db, source))?;
                Some((db, marker))
            }
            None => None,
        };
        let mut load = Load {
            replica,
            marker,
            unjournaled: false,
            version: version.as_str().to_owned(),
            batch_rows,
            in_txn: 0,
            next_seq: 1,
            finished: false,
        };
        let conn = &load.replica.conn;
        conn.execute_batch(LOAD_PRAGMAS)?;
        load.unjournaled = match load.marker {
            // Another connection reading the WAL keeps it: SQLite refuses the switch as busy.
            Some(_) => match journal_mode(conn, "OFF") {
                Ok(mode) => mode == "off",
                Err(e) if is_busy(&e) => false,
                Err(e) => return Err(e.into()),
            },
            None => false,
        };
        conn.execute_batch("BEGIN IMMEDIATE")?;
        Ok(load)
    }

    /// Creates a table of `spec` with its metadata, replacing one of the same name.
    pub(crate) fn create_table(
        &mut self,
        spec: &TableSpec,
        metadata: Option<TableMetadata>,
    ) -> Result<(), ReplicaError> {
        let mut table = ReplicaTable::from_spec(spec);
        table.metadata = metadata;
        create_replica_table(&self.replica.conn, &mut self.replica.tables, table)
    }

    /// A table of the replica, by replica name.
    pub(crate) fn table(&self, name: &str) -> Option<&ReplicaTable> {
        self.replica.table(name)
    }

    /// Drops `table`'s key index until [`Load::finish_table`] builds it again, once the table is
    /// loaded: one sort instead of an insert per row at a random place in it. The seq index
    /// stays: seqs grow row after row, so each insert appends at its right edge, which costs
    /// less than sorting it afterwards (at 5,000,000 rows building it took 2.7 s, keeping it no
    /// measurable time).
    pub(crate) fn defer_key_index(&mut self, table: &ReplicaTable) -> Result<(), ReplicaError> {
        self.replica.conn.execute_batch(&format!(
            "DROP INDEX IF EXISTS {}",
            quote_ident(&table.key_index_name())
        ))?;
        Ok(())
    }

    /// Writes `rows` of the table `insert` is for, the next seqs in order; commits once
    /// `batch_rows` rows are in the transaction and begins the next.
    pub(crate) fn write(&mut self, insert: &Insert, rows: &RowBlock) -> Result<(), ReplicaError> {
        let conn = &self.replica.conn;
        insert.insert(conn, rows, &self.version, &mut self.next_seq)?;
        self.in_txn += rows.len();
        if self.in_txn >= self.batch_rows {
            conn.execute_batch("COMMIT; BEGIN IMMEDIATE")?;
            self.in_txn = 0;
        }
        Ok(())
    }

    /// Builds `table`'s indexes once all its rows are in: its key index, as
    /// `create_replica_table` made it (the seq index was kept), and `indexes`, upstream's, each
    /// recorded, built unless it is the key's.
    pub(crate) fn finish_table(
        &mut self,
        table: &ReplicaTable,
        indexes: &[IndexSpec],
    ) -> Result<(), ReplicaError> {
        let conn = &self.replica.conn;
        if let Some(sql) = table.create_key_index_sql() {
            conn.execute_batch(&sql)?;
        }
        for spec in indexes {
            let is_key = is_key_index(spec);
            record_index(conn, spec, is_key)?;
            if !is_key {
                conn.execute_batch(&create_index_sql(spec))?;
            }
        }
        Ok(())
    }

    /// The `_hw_seq` the next row would get: above every row's, as the state records it.
    pub(crate) fn next_seq(&self) -> i64 {
        self.next_seq
    }

    /// Ends the load: makes every loaded row durable, then records `state` (its `next_seq`
    /// from [`Load::next_seq`]) durably, and removes the marker.
    pub(crate) fn finish(mut self, state: &ReplicaState) -> Result<(), ReplicaError> {
        let conn = &self.replica.conn;
        if self.unjournaled {
            // Back in WAL mode for streaming; the checkpoint after the state below makes the
            // rows written without a journal durable, and only then does the marker go.
            conn.execute_batch("COMMIT")?;
            back_to_wal(conn)?;
            conn.execute_batch(LOAD_PRAGMAS_END)?;
        } else {
            // Make every loaded row durable before the state that says they are there (see
            // `LOAD_PRAGMAS`).
            make_load_durable(conn)?;
        }
        conn.execute_batch("BEGIN IMMEDIATE")?;
        self.replica.store_initial_state(state)?;
        let conn = &self.replica.conn;
        conn.execute_batch("COMMIT")?;
        if self.unjournaled {
            checkpoint_durably(conn)?;
        }
        if let Some((db, marker)) = self.marker.take() {
            marker
                .remove()
                .map_err(|source| marker_error(&db, source))?;
        }
        self.finished = true;
        Ok(())
    }
}

impl Drop for Load<'_> {
    /// Aborts an unfinished load: rolls back its open transaction and restores the settings.
    /// The marker stays on disk, so the replica is discarded when next opened.
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.replica.conn.execute_batch("ROLLBACK");
            let _ = self.replica.conn.execute_batch(LOAD_PRAGMAS_END);
        }
    }
}

fn marker_error(db: &std::path::Path, source: std::io::Error) -> ReplicaError {
    ReplicaError::LoadMarker {
        path: marker_path(db).display().to_string(),
        source,
    }
}

/// Commits the load's last transaction and makes every loaded page durable: with automatic
/// checkpoints off, that transaction's frames stay in the WAL, so the checkpoint under
/// `synchronous = FULL` that follows has frames to copy and therefore fsyncs the WAL and then the
/// database file,
/// which covers every page of it, also those the unsynced checkpoints during the load wrote.
/// (A checkpoint with nothing left to copy skips its fsync, hence the care.) The database file
/// is not opened outside SQLite: closing another descriptor of it would drop SQLite's locks.
fn make_load_durable(conn: &Connection) -> Result<(), ReplicaError> {
    conn.execute_batch("PRAGMA wal_autocheckpoint = 0; COMMIT;")?;
    conn.execute_batch(LOAD_PRAGMAS_END)?;
    checkpoint_durably(conn)
}

/// Sets the journal mode and returns the one SQLite took.
fn journal_mode(conn: &Connection, mode: &str) -> rusqlite::Result<String> {
    let taken: String =
        conn.query_row(&format!("PRAGMA journal_mode = {mode}"), [], |r| r.get(0))?;
    Ok(taken.to_ascii_lowercase())
}

fn is_busy(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// How long the switch back to WAL after an unjournaled load waits for readers to let go.
const BACK_TO_WAL_WAIT: Duration = Duration::from_secs(30);

/// Switches back to WAL after an unjournaled load. The switch needs the database to itself,
/// and SQLite refuses it as busy rather than wait while another connection reads (a monitor
/// polling the replica's state, say): it is tried again until [`BACK_TO_WAL_WAIT`] has passed.
fn back_to_wal(conn: &Connection) -> Result<(), ReplicaError> {
    let started = Instant::now();
    loop {
        match journal_mode(conn, "WAL") {
            Ok(mode) if mode == "wal" => return Ok(()),
            Ok(mode) => return Err(ReplicaError::LoadJournalMode { mode }),
            Err(e) if is_busy(&e) && started.elapsed() < BACK_TO_WAL_WAIT => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Copies every WAL frame into the database file under `synchronous = FULL`, which fsyncs the
/// WAL and then the file: all of it, also the pages written earlier without an fsync. Expects
/// frames to copy (a checkpoint with none skips its fsync).
fn checkpoint_durably(conn: &Connection) -> Result<(), ReplicaError> {
    let (busy, frames, copied): (i64, i64, i64) =
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?;
    // The default, as `Replica::open` leaves it.
    conn.execute_batch("PRAGMA wal_autocheckpoint = 1000")?;
    // An in-memory database has no WAL: -1 frames.
    if busy != 0 || frames != copied {
        return Err(ReplicaError::LoadDurability { frames, copied });
    }
    Ok(())
}

/// Rows on their way into the replica, as SQLite values in column order: every value in one
/// vector and every text in one string, so a row costs no allocation of its own.
#[derive(Debug, Default)]
pub(crate) struct RowBlock {
    text: String,
    cells: Vec<Cell>,
    rows: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Cell {
    Null,
    Integer(i64),
    Real(f64),
    /// `text[start..end]` of the block.
    Text(usize, usize),
}

/// Where a [`RowBlock`] was: [`RowBlock::truncate`] goes back to it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockMark {
    text: usize,
    cells: usize,
}

impl RowBlock {
    /// Appends the next value of the row being added.
    #[inline]
    pub(crate) fn push(&mut self, value: SqlScalar<'_>) {
        let cell = match value {
            SqlScalar::Null => Cell::Null,
            SqlScalar::Integer(i) => Cell::Integer(i),
            SqlScalar::Real(f) => Cell::Real(f),
            SqlScalar::Text(text) => {
                let start = self.text.len();
                self.text.push_str(&text);
                Cell::Text(start, self.text.len())
            }
        };
        self.cells.push(cell);
    }

    /// Ends the row being added: its values are the ones pushed since the last row ended.
    #[inline]
    pub(crate) fn end_row(&mut self) {
        self.rows += 1;
    }

    #[inline]
    pub(crate) fn mark(&self) -> BlockMark {
        BlockMark {
            text: self.text.len(),
            cells: self.cells.len(),
        }
    }

    /// Drops the values pushed since `mark` (of a row that did not end).
    #[inline]
    pub(crate) fn truncate(&mut self, mark: BlockMark) {
        self.text.truncate(mark.text);
        self.cells.truncate(mark.cells);
    }

    /// Rows in the block.
    pub(crate) fn len(&self) -> usize {
        self.rows
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// The rows, each its `columns` cells (none for a zero-column table).
    fn rows(&self, columns: usize) -> impl Iterator<Item = &[Cell]> {
        (0..self.rows).map(move |row| {
            self.cells
                .get(row * columns..(row + 1) * columns)
                .unwrap_or_default()
        })
    }

    fn bind(
        &self,
        statement: &mut CachedStatement<'_>,
        index: usize,
        cell: Cell,
    ) -> rusqlite::Result<()> {
        match cell {
            Cell::Null => statement.raw_bind_parameter(index, rusqlite::types::Null),
            Cell::Integer(i) => statement.raw_bind_parameter(index, i),
            Cell::Real(f) => statement.raw_bind_parameter(index, f),
            Cell::Text(start, end) => {
                statement.raw_bind_parameter(index, self.text.get(start..end).unwrap_or_default())
            }
        }
    }

    /// The values of each row of `columns` cells.
    #[cfg(test)]
    pub(crate) fn values(&self, columns: usize) -> Vec<Vec<SqlScalar<'_>>> {
        self.rows(columns)
            .map(|row| {
                row.iter()
                    .map(|&cell| match cell {
                        Cell::Null => SqlScalar::Null,
                        Cell::Integer(i) => SqlScalar::Integer(i),
                        Cell::Real(f) => SqlScalar::Real(f),
                        Cell::Text(start, end) => SqlScalar::Text(self.text[start..end].into()),
                    })
                    .collect()
            })
            .collect()
    }
}

/// A table's INSERT statements: one for many rows at a time (fewer statement executions),
/// and one for the rest.
pub(crate) struct Insert {
    /// Rows of the multi-row statement.
    rows: usize,
    /// The table's columns (cells per row).
    columns: usize,
    multi: String,
    single: String,
}

/// Rows per multi-row INSERT, and SQLite's bound-parameter limit that can lower it.
const ROWS_PER_INSERT: usize = 32;
const MAX_PARAMETERS: usize = 32_766;

impl Insert {
    /// The statements that write rows of `table`, its columns in order.
    pub(crate) fn new(table: &ReplicaTable) -> Insert {
        let mut cols: Vec<String> = table.columns.iter().map(|c| quote_ident(&c.name)).collect();
        cols.push("\"_hw_version\"".into());
        cols.push("\"_hw_seq\"".into());
        let rows = ROWS_PER_INSERT.min(MAX_PARAMETERS / cols.len()).max(1);
        let sql = |rows: usize| {
            let row = format!("({})", vec!["?"; cols.len()].join(", "));
            format!(
                "INSERT INTO {} ({}) VALUES {}",
                quote_ident(&table.name),
                cols.join(", "),
                vec![row; rows].join(", ")
            )
        };
        Insert {
            rows,
            columns: table.columns.len(),
            multi: sql(rows),
            single: sql(1),
        }
    }

    /// Inserts `rows` with `_hw_version` = `version` and `_hw_seq` counting up from `seq`.
    fn insert(
        &self,
        conn: &Connection,
        rows: &RowBlock,
        version: &str,
        seq: &mut i64,
    ) -> Result<(), ReplicaError> {
        let mut multi = conn.prepare_cached(&self.multi)?;
        let mut single = conn.prepare_cached(&self.single)?;
        let mut all = rows.rows(self.columns);
        let full = rows.len() / self.rows;
        for _ in 0..full {
            bind_rows(&mut multi, rows, all.by_ref().take(self.rows), version, seq)?;
            multi.raw_execute()?;
        }
        for row in all {
            bind_rows(&mut single, rows, std::iter::once(row), version, seq)?;
            single.raw_execute()?;
        }
        Ok(())
    }
}

fn bind_rows<'a>(
    statement: &mut CachedStatement<'_>,
    block: &RowBlock,
    rows: impl Iterator<Item = &'a [Cell]>,
    version: &str,
    seq: &mut i64,
) -> rusqlite::Result<()> {
    let mut index = 1;
    for row in rows {
        for &cell in row {
            block.bind(statement, index, cell)?;
            index += 1;
        }
        statement.raw_bind_parameter(index, version)?;
        statement.raw_bind_parameter(index + 1, *seq)?;
        index += 2;
        *seq += 1;
    }
    Ok(())
}

/// What the initial sync's tests compare a load with, and read a loaded replica with.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::Path;

    use highwater_engine::change_stream::{IndexSpec, JsonFormat, Row, TableMetadata, TableSpec};
    use highwater_engine::upstream::is_key_index;
    use highwater_engine::watermark::Watermark;
    use rusqlite::types::{Value as SqlValue, ValueRef};

    use super::super::apply::create_replica_table;
    use super::super::schema::{create_index_sql, quote_ident, record_index, ReplicaTable};
    use super::super::value::to_sql;
    use super::super::{Replica, ReplicaError, ReplicaState};
    use super::Insert;

    /// The load as it was before rows came in blocks: each row a change-stream row stored with
    /// `to_sql`, one INSERT per row, every table in one transaction with its key index kept
    /// throughout. Kept as the reference a [`super::Load`] must equal.
    pub(crate) struct ReferenceLoad<'r> {
        replica: &'r mut Replica,
        version: String,
        next_seq: i64,
    }

    impl<'r> ReferenceLoad<'r> {
        pub(crate) fn begin(
            replica: &'r mut Replica,
            version: &Watermark,
        ) -> Result<ReferenceLoad<'r>, ReplicaError> {
            replica.conn.execute_batch("BEGIN IMMEDIATE")?;
            Ok(ReferenceLoad {
                replica,
                version: version.as_str().to_owned(),
                next_seq: 1,
            })
        }

        pub(crate) fn create_table(
            &mut self,
            spec: &TableSpec,
            metadata: Option<TableMetadata>,
        ) -> Result<(), ReplicaError> {
            let mut table = ReplicaTable::from_spec(spec);
            table.metadata = metadata;
            create_replica_table(&self.replica.conn, &mut self.replica.tables, table)
        }

        pub(crate) fn table(&self, name: &str) -> Option<&ReplicaTable> {
            self.replica.table(name)
        }

        pub(crate) fn insert(
            &mut self,
            table: &ReplicaTable,
            row: &Row,
        ) -> Result<(), ReplicaError> {
            let values = table
                .columns
                .iter()
                .map(|c| {
                    row.get(&c.name)
                        .map_or(SqlValue::Null, |v| to_sql(c, v, JsonFormat::Stringified))
                })
                .chain([
                    SqlValue::Text(self.version.clone()),
                    SqlValue::Integer(self.next_seq),
                ]);
            self.replica
                .conn
                .prepare_cached(&Insert::new(table).single)?
                .execute(rusqlite::params_from_iter(values))?;
            self.next_seq += 1;
            Ok(())
        }

        pub(crate) fn finish_table(&mut self, indexes: &[IndexSpec]) -> Result<(), ReplicaError> {
            for spec in indexes {
                let is_key = is_key_index(spec);
                record_index(&self.replica.conn, spec, is_key)?;
                if !is_key {
                    self.replica.conn.execute_batch(&create_index_sql(spec))?;
                }
            }
            Ok(())
        }

        pub(crate) fn next_seq(&self) -> i64 {
            self.next_seq
        }

        pub(crate) fn finish(self, state: &ReplicaState) -> Result<(), ReplicaError> {
            self.replica.store_initial_state(state)?;
            self.replica.conn.execute_batch("COMMIT")?;
            Ok(())
        }
    }

    /// Every table of the SQLite database at `path` with all its rows (sorted), each value as
    /// SQLite stored it; columns named in `skip` are left out.
    pub(crate) fn dump(path: &Path, skip: &[&str]) -> Vec<(String, Vec<String>)> {
        let conn = rusqlite::Connection::open(path).unwrap();
        let mut names: Vec<(String, String)> = conn
            .prepare("SELECT name, sql FROM sqlite_master ORDER BY type, name")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get::<_, Option<String>>(1)?)))
            .unwrap()
            .map(|r| {
                let (name, sql) = r.unwrap();
                (name, sql.unwrap_or_default())
            })
            .collect();
        let mut out = vec![(
            "sqlite_master".to_owned(),
            names.iter().map(|(n, s)| format!("{n}: {s}")).collect(),
        )];
        names.retain(|(_, sql)| sql.starts_with("CREATE TABLE"));
        for (table, _) in names {
            let mut statement = conn
                .prepare(&format!("SELECT * FROM {}", quote_ident(&table)))
                .unwrap();
            let columns: Vec<String> = statement
                .column_names()
                .iter()
                .map(|c| (*c).to_owned())
                .collect();
            let mut rows: Vec<String> = statement
                .query_map([], |r| {
                    let mut row = Vec::new();
                    for (i, name) in columns.iter().enumerate() {
                        if !skip.contains(&name.as_str()) {
                            let value: ValueRef<'_> = r.get_ref(i)?;
                            row.push(format!("{name}={value:?}"));
                        }
                    }
                    Ok(row.join(" "))
                })
                .unwrap()
                .map(Result::unwrap)
                .collect();
            rows.sort();
            out.push((table, rows));
        }
        out
    }

    /// The `_hw_seq` of every row of `tables` in the replica at `path`, and its state's
    /// `next_seq`.
    pub(crate) fn seqs(path: &Path, tables: &[&str]) -> (Vec<i64>, i64) {
        let conn = rusqlite::Connection::open(path).unwrap();
        let mut seqs = Vec::new();
        for table in tables {
            let mut statement = conn
                .prepare(&format!("SELECT \"_hw_seq\" FROM {}", quote_ident(table)))
                .unwrap();
            seqs.extend(
                statement
                    .query_map([], |r| r.get::<_, i64>(0))
                    .unwrap()
                    .map(Result::unwrap),
            );
        }
        let next_seq: i64 = conn
            .query_row("SELECT next_seq FROM \"_hw_state\"", [], |r| r.get(0))
            .unwrap();
        (seqs, next_seq)
    }

    /// `PRAGMA synchronous` of a new connection to `path`'s replica, and its journal mode.
    pub(crate) fn settings(path: &Path) -> (i64, String) {
        let conn = rusqlite::Connection::open(path).unwrap();
        let synchronous = conn
            .query_row("PRAGMA synchronous", [], |r| r.get(0))
            .unwrap();
        let journal = conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        (synchronous, journal)
    }

    /// Reads the replica's state once on a connection of its own, as a monitor polling it
    /// would; whether the read succeeded (it fails while the load holds the database).
    pub(crate) fn read_state_once(path: &Path) -> bool {
        let Ok(conn) =
            rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
        else {
            return false;
        };
        let read: rusqlite::Result<i64> =
            conn.query_row(r#"SELECT count(*) FROM "_hw_state""#, [], |r| r.get(0));
        read.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use highwater_engine::change_stream::{ColumnSpec, IndexDirection, JsonFormat};
    use highwater_engine::watermark::Lsn;
    use serde_json::{json, Number};

    fn spec(name: &str, key: &[&str], columns: &[(&str, &str)]) -> TableSpec {
        TableSpec {
            schema: "public".into(),
            name: name.into(),
            columns: columns
                .iter()
                .zip(1..)
                .map(|(&(c, t), pos)| (c.to_owned(), ColumnSpec::new(Number::from(pos), t)))
                .collect(),
            primary_key: (!key.is_empty()).then(|| key.iter().map(|k| (*k).to_owned()).collect()),
            extra: Default::default(),
        }
    }

    fn index(name: &str, column: &str, primary_key: bool) -> IndexSpec {
        let mut extra = serde_json::Map::new();
        extra.insert("isPrimaryKey".into(), json!(primary_key));
        extra.insert("isReplicaIdentity".into(), json!(false));
        IndexSpec {
            schema: "public".into(),
            name: name.into(),
            table_name: "item".into(),
            unique: primary_key,
            columns: [(column.to_owned(), IndexDirection::Asc)]
                .into_iter()
                .collect(),
            predicate: None,
            extra,
        }
    }

    fn state(next_seq: i64) -> ReplicaState {
        ReplicaState {
            replica_version: Lsn(0x10).to_watermark(),
            watermark: Lsn(0x10).to_watermark(),
            lsn: Lsn(0x10),
            publications: vec!["p".into()],
            slot: "s".into(),
            app_id: "a".into(),
            next_seq,
        }
    }

    fn temp_db(name: &str) -> (PathBuf, PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("highwater-load-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let db = dir.join("replica.db");
        (dir, db)
    }

    /// `rows` rows of `item (id, name, score)` from `first` on.
    fn items(first: i64, rows: i64) -> RowBlock {
        let mut block = RowBlock::default();
        for id in first..first + rows {
            block.push(SqlScalar::Integer(id));
            block.push(SqlScalar::Text(format!("n{id}").into()));
            block.push(if id % 2 == 0 {
                SqlScalar::Real(0.5)
            } else {
                SqlScalar::Null
            });
            block.end_row();
        }
        block
    }

    #[test]
    fn a_load_stores_every_row_once_and_ends_durable_in_wal() {
        let (dir, db) = temp_db("done");
        let mut replica = Replica::open(&db).unwrap();
        let version = Lsn(0x10).to_watermark();
        // Commits every 50 rows; blocks of 45 take both the 32-row and the one-row INSERT.
        let mut load = Load::begin(&mut replica, &version, 50).unwrap();
        assert!(marker_path(&db).exists());
        let columns = [("id", "int8"), ("name", "text"), ("score", "float8")];
        load.create_table(&spec("item", &["id"], &columns), None)
            .unwrap();
        load.create_table(&spec("log", &[], &[("msg", "text")]), None)
            .unwrap();
        let item = load.table("item").cloned().unwrap();
        let log = load.table("log").cloned().unwrap();
        load.defer_key_index(&item).unwrap();
        let (item_insert, log_insert) = (Insert::new(&item), Insert::new(&log));
        for part in 0..3 {
            load.write(&item_insert, &items(part * 45, 45)).unwrap();
            let mut message = RowBlock::default();
            message.push(SqlScalar::Text(format!("part {part}").into()));
            message.end_row();
            load.write(&log_insert, &message).unwrap();
        }
        let indexes = [
            index("item_pkey", "id", true),
            index("item_name", "name", false),
        ];
        load.finish_table(&item, &indexes).unwrap();
        load.finish_table(&log, &[]).unwrap();
        assert_eq!(load.next_seq(), 3 * 45 + 3 + 1);
        load.finish(&state(3 * 45 + 3 + 1)).unwrap();

        assert!(
            !marker_path(&db).exists(),
            "the marker goes once all is durable"
        );
        assert_eq!(replica.state(), Some(&state(139)));
        let rows = replica.rows("item", JsonFormat::Stringified).unwrap();
        assert_eq!(rows.len(), 135);
        assert_eq!(rows[8]["name"], json!("n8"));
        assert_eq!(rows[8]["score"], json!(0.5));
        assert_eq!(rows[9]["score"], json!(null));
        // The load's settings are gone from its connection.
        let synchronous: i64 = replica
            .conn
            .query_row("PRAGMA synchronous", [], |r| r.get(0))
            .unwrap();
        assert_eq!(synchronous, 2);
        drop(replica);
        let (mut seqs, next_seq) = testing::seqs(&db, &["item", "log"]);
        seqs.sort_unstable();
        assert_eq!(seqs, (1..next_seq).collect::<Vec<_>>());
        assert_eq!(testing::settings(&db).1, "wal");
        let schema = testing::dump(&db, &[]);
        let names = &schema[0].1;
        for name in ["item_hw_key", "item_hw_seq", "item_name"] {
            assert!(
                names
                    .iter()
                    .any(|n| n.starts_with(&format!("{name}: CREATE"))),
                "{name} in {names:?}"
            );
        }
        // The key's upstream index is recorded, not built twice.
        assert!(!names.iter().any(|n| n.starts_with("item_pkey:")));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_load_dropped_unfinished_rolls_back_and_the_replica_starts_over() {
        let (dir, db) = temp_db("dropped");
        let mut replica = Replica::open(&db).unwrap();
        let version = Lsn(0x10).to_watermark();
        let mut load = Load::begin(&mut replica, &version, 1_000).unwrap();
        let columns = [("id", "int8"), ("name", "text"), ("score", "float8")];
        load.create_table(&spec("item", &["id"], &columns), None)
            .unwrap();
        let item = load.table("item").cloned().unwrap();
        load.write(&Insert::new(&item), &items(0, 10)).unwrap();
        drop(load);
        assert!(replica.state().is_none());
        drop(replica);
        assert!(marker_path(&db).exists(), "the marker outlives the load");
        let replica = Replica::open(&db).unwrap();
        assert!(replica.state().is_none() && replica.table_names().is_empty());
        assert!(!marker_path(&db).exists());
        drop(replica);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_row_block_gives_back_its_rows_also_of_no_columns() {
        let mut block = RowBlock::default();
        for (i, text) in [(1, "a"), (2, "bé")] {
            block.push(SqlScalar::Integer(i));
            block.push(SqlScalar::Text(text.into()));
            block.end_row();
        }
        let rows: Vec<&[Cell]> = block.rows(2).collect();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1][0], Cell::Integer(2));
        let Cell::Text(start, end) = rows[1][1] else {
            panic!("expected text, got {:?}", rows[1][1]);
        };
        assert_eq!(&block.text[start..end], "bé");
        // A row that did not end goes back to the mark.
        let mark = block.mark();
        block.push(SqlScalar::Text("half".into()));
        block.truncate(mark);
        assert_eq!(
            block.values(2),
            [
                [SqlScalar::Integer(1), SqlScalar::Text("a".into())],
                [SqlScalar::Integer(2), SqlScalar::Text("bé".into())]
            ]
        );
        let mut empty = RowBlock::default();
        for _ in 0..3 {
            empty.end_row();
        }
        assert_eq!(
            empty.rows(0).map(<[Cell]>::len).collect::<Vec<_>>(),
            [0, 0, 0]
        );
    }
}
