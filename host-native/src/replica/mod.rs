//! The SQLite replica: every replicated table with a per-row version and server sequence,
//! tombstones for deleted rows, and the replication position, in Zero's replica layout.
//!
//! Durability: WAL journal with `synchronous=FULL`. `replicate` acknowledges a transaction
//! upstream as soon as [`ReplicaWriter`] has committed it, and Postgres then may discard its
//! WAL; with `NORMAL` a power loss could roll back commits that were already acknowledged,
//! losing them for good. `FULL` costs one WAL fsync per commit (a commit holds a group of
//! upstream transactions when more are queued), which is what makes the acknowledgement
//! honest. `serve` commits with `NORMAL` and syncs (and checkpoints) the WAL on another thread
//! ([`wal_sync`]), acknowledging a group once a sync that started after its commit returned:
//! the same promise, without the thread that forwards to subscribers waiting for the disk.
//!
//! This is storage only: nothing here talks to upstream Postgres. The transport
//! (`replication/`) reads upstream and hands the replica what it read: rows of the initial
//! sync to `load` (the bulk load, with its own settings, transactions and durability), a
//! DDL event's published tables to [`ddl`] (schema changes against the replica), changes and
//! backfills to [`ReplicaWriter`].

mod apply;
pub(crate) mod ddl;
pub mod feed;
pub(crate) mod load;
pub mod load_marker;
pub mod schema;
pub(crate) mod value;
pub(crate) mod wal_sync;

use std::collections::HashMap;
use std::path::Path;

#[cfg(any(test, feature = "test-support"))]
use highwater_engine::change_stream::{JsonFormat, Row};
use highwater_engine::scope_sync::rules::row_filter::RowFilter;
use highwater_engine::watermark::{Lsn, Watermark, WatermarkError};
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::{Map, Value};

pub use apply::ReplicaWriter;
pub(crate) use apply::{Applied, PendingBackfill, TxnItem};
#[cfg(any(test, feature = "test-support"))]
use schema::quote_ident;
use schema::ReplicaTable;

/// Anything that stops the replica from reading or applying.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("replica database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("replica metadata is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("replica watermark is invalid: {0}")]
    Watermark(#[from] WatermarkError),
    #[error("could not create the replica directory {path}: {source}")]
    Directory {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot remove the unfinished initial load in {path}: {source}")]
    DiscardLoad {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot remove {path}: {source}")]
    Remove {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot mark or unmark the initial load at {path}: {source}")]
    LoadMarker {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "expected the checkpoint after the load to copy all {frames} WAL frames into the \
         database file, it copied {copied}"
    )]
    LoadDurability { frames: i64, copied: i64 },
    #[error("expected the replica to return to journal mode wal after the load, it is in {mode}")]
    LoadJournalMode { mode: String },
    #[error("expected a replicated table, got a change for unknown table {table:?}")]
    UnknownTable { table: String },
    #[error("expected a column of table {table:?}, got unknown column {column:?}")]
    UnknownColumn { table: String, column: String },
    #[error("expected key column {column:?} in the {what} of a change to {table:?}")]
    MissingKey {
        table: String,
        column: String,
        what: &'static str,
    },
    #[error("expected `begin` before {what}, got it outside a transaction")]
    NotInTransaction { what: &'static str },
    #[error("expected a whole transaction, `begin` to `commit`, got {found}")]
    IncompleteTransaction { found: &'static str },
    #[error("expected `commit` or `rollback` of transaction {open}, got `begin` of {next}")]
    NestedTransaction { open: Watermark, next: Watermark },
    #[error("expected a transaction after the replica's position {position}, got one at {found}")]
    NotAfterPosition {
        position: Watermark,
        found: Watermark,
    },
    #[error("expected commit watermark {begin} (from `begin`), got {commit}")]
    WatermarkMismatch { begin: Watermark, commit: Watermark },
    #[error("the replica has no replication state yet: it needs an initial sync")]
    NotInitialized,
    #[error("expected a table to rename, got unknown table {table:?}")]
    UnknownRenameSource { table: String },
    #[error("expected a row filter of {table:?} the replica can answer, got one {reason}")]
    UnanswerableFilter { table: String, reason: String },
}

/// The replica's replication position and configuration (`_hw_state`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaState {
    /// Watermark of the initial sync (the slot's consistent point).
    pub replica_version: Watermark,
    /// Commit watermark of the last applied transaction.
    pub watermark: Watermark,
    /// Upstream position to resume streaming after (the major part of `watermark`).
    pub lsn: Lsn,
    pub publications: Vec<String>,
    pub slot: String,
    pub app_id: String,
    /// The `_hw_seq` the next row change gets.
    pub next_seq: i64,
}

/// An open replica database.
pub struct Replica {
    conn: Connection,
    tables: HashMap<String, ReplicaTable>,
    state: Option<ReplicaState>,
}

impl Replica {
    /// Opens (creating if needed) `<data_dir>/replica.db`.
    pub fn open_in_dir(data_dir: &Path) -> Result<Replica, ReplicaError> {
        std::fs::create_dir_all(data_dir).map_err(|source| ReplicaError::Directory {
            path: data_dir.display().to_string(),
            source,
        })?;
        Replica::open(&data_dir.join("replica.db"))
    }

    /// Removes the replica in `data_dir` (`replica.db` and its WAL and shared-memory files), so
    /// that a new initial sync starts from nothing. The database goes first: a WAL left beside
    /// a new file would be replayed into it. Open it nowhere while this runs.
    pub(crate) fn remove_in_dir(data_dir: &Path) -> Result<(), ReplicaError> {
        for name in ["replica.db", "replica.db-wal", "replica.db-shm"] {
            let path = data_dir.join(name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(ReplicaError::Remove {
                        path: path.display().to_string(),
                        source,
                    })
                }
            }
        }
        Ok(())
    }

    /// Opens (creating if needed) the replica at `path`. A replica whose initial load never
    /// finished (see [`load_marker`]) is removed first, unopened: its file may be damaged, and
    /// it was not synced.
    pub fn open(path: &Path) -> Result<Replica, ReplicaError> {
        let discarded =
            load_marker::discard_unfinished(path).map_err(|source| ReplicaError::DiscardLoad {
                path: path.display().to_string(),
                source,
            })?;
        if discarded {
            tracing::warn!(
                path = %path.display(),
                "the replica's initial sync did not finish: removed it, to sync again"
            );
        }
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        Replica::with_connection(conn)
    }

    /// Opens an existing replica for reading only, next to a running writer (WAL lets readers
    /// and the writer work at the same time). Call [`Replica::refresh`] to see later changes.
    pub fn open_read_only(path: &Path) -> Result<Replica, ReplicaError> {
        let conn = Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(std::time::Duration::from_secs(30))?;
        let mut replica = Replica {
            conn,
            tables: HashMap::new(),
            state: None,
        };
        replica.reload()?;
        Ok(replica)
    }

    /// Re-reads the schema and replication state (after the writer committed more).
    pub(crate) fn refresh(&mut self) -> Result<(), ReplicaError> {
        self.reload()
    }

    #[cfg(any(test, feature = "test-support"))]
    pub fn open_in_memory() -> Result<Replica, ReplicaError> {
        Replica::with_connection(Connection::open_in_memory()?)
    }

    fn with_connection(conn: Connection) -> Result<Replica, ReplicaError> {
        conn.busy_timeout(std::time::Duration::from_secs(30))?;
        conn.set_prepared_statement_cache_capacity(256);
        conn.execute_batch(schema::INTERNAL_TABLES_SQL)?;
        schema::upgrade_internal_tables(&conn)?;
        let mut replica = Replica {
            conn,
            tables: HashMap::new(),
            state: None,
        };
        replica.reload()?;
        Ok(replica)
    }

    /// Re-reads tables and state from the database (after a rollback).
    fn reload(&mut self) -> Result<(), ReplicaError> {
        self.tables = schema::load_tables(&self.conn)?
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        self.state = read_state(&self.conn)?;
        Ok(())
    }

    /// `None` until an initial sync has completed.
    pub fn state(&self) -> Option<&ReplicaState> {
        self.state.as_ref()
    }

    pub fn table(&self, name: &str) -> Option<&ReplicaTable> {
        self.tables.get(name)
    }

    /// Replicated tables, by replica name.
    pub fn table_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.tables.keys().cloned().collect();
        names.sort();
        names
    }

    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Every row of a table as change-stream JSON (internal columns left out), ordered by key.
    #[cfg(any(test, feature = "test-support"))]
    pub fn rows(&self, table_name: &str, json: JsonFormat) -> Result<Vec<Row>, ReplicaError> {
        let table = self
            .tables
            .get(table_name)
            .ok_or_else(|| ReplicaError::UnknownTable {
                table: table_name.to_owned(),
            })?;
        let cols: Vec<String> = table.columns.iter().map(|c| quote_ident(&c.name)).collect();
        let order: Vec<String> = table
            .match_columns()
            .iter()
            .map(|c| quote_ident(c))
            .collect();
        let sql = format!(
            "SELECT {} FROM {} ORDER BY {}",
            if cols.is_empty() {
                "1".to_owned()
            } else {
                cols.join(", ")
            },
            quote_ident(&table.name),
            if order.is_empty() {
                "rowid".to_owned()
            } else {
                order.join(", ")
            }
        );
        let mut stmt = self.conn.prepare(&sql)?;
        let mut rows = stmt.query([])?;
        let mut out = Vec::new();
        while let Some(r) = rows.next()? {
            let mut row = Row::new();
            for (i, col) in table.columns.iter().enumerate() {
                row.insert(col.name.clone(), value::from_sql(col, r.get_ref(i)?, json));
            }
            out.push(row);
        }
        Ok(out)
    }

    /// One scope-sync replay page, read in one read transaction (see [`feed::read_scope_page`]).
    pub(crate) fn read_scope_page(
        &self,
        query: &feed::ScopeQuery<'_>,
    ) -> Result<feed::ScopePage, ReplicaError> {
        feed::read_scope_page(&self.conn, &self.tables, query)
    }

    /// Whether `filter` is true for one row of `table` (see [`feed::row_passes`]).
    pub(crate) fn row_passes(
        &self,
        table: &str,
        filter: &RowFilter,
        row: &Map<String, Value>,
    ) -> Result<Option<bool>, ReplicaError> {
        feed::row_passes(&self.conn, &self.tables, table, filter, row)
    }

    /// Whether any column waits for a backfill (cheap: no allocation).
    pub(crate) fn has_pending_backfills(&self) -> bool {
        self.tables
            .values()
            .any(|t| t.columns.iter().any(|c| c.backfill.is_some()))
    }

    /// Columns waiting for a backfill, grouped by table (recorded with the schema change that
    /// asked for them, so they survive a crash).
    pub(crate) fn pending_backfills(&self) -> Vec<PendingBackfill> {
        let mut out = Vec::new();
        for name in self.table_names() {
            let Some(table) = self.table(&name) else {
                continue;
            };
            let columns: Vec<String> = table
                .columns
                .iter()
                .filter(|c| c.backfill.is_some())
                .map(|c| c.name.clone())
                .collect();
            if columns.is_empty() {
                continue;
            }
            out.push(PendingBackfill {
                table: table.name.clone(),
                schema: table.schema.clone(),
                name: table.table.clone(),
                key: table.key.clone(),
                whole_table: columns.len() == table.columns.len(),
                columns: columns
                    .into_iter()
                    .filter(|c| !table.key.contains(c))
                    .collect(),
            });
        }
        out
    }

    /// Records the replication state of a completed initial sync.
    pub fn store_initial_state(&mut self, state: &ReplicaState) -> Result<(), ReplicaError> {
        self.conn.execute(
            r#"INSERT OR REPLACE INTO "_hw_state"
                 ("lock","replica_version","watermark","lsn","publications","slot","app_id","next_seq")
               VALUES (1, ?1, ?2, ?3, ?4, ?5, ?6, ?7)"#,
            params![
                state.replica_version.as_str(),
                state.watermark.as_str(),
                state.lsn.to_string(),
                serde_json::to_string(&state.publications)?,
                state.slot,
                state.app_id,
                state.next_seq,
            ],
        )?;
        self.state = Some(state.clone());
        Ok(())
    }
}

fn read_state(conn: &Connection) -> Result<Option<ReplicaState>, ReplicaError> {
    let row = conn
        .query_row(
            r#"SELECT "replica_version","watermark","lsn","publications","slot","app_id","next_seq"
               FROM "_hw_state" WHERE "lock" = 1"#,
            [],
            |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, String>(4)?,
                    r.get::<_, String>(5)?,
                    r.get::<_, i64>(6)?,
                ))
            },
        )
        .optional()?;
    let Some((version, watermark, lsn, publications, slot, app_id, next_seq)) = row else {
        return Ok(None);
    };
    Ok(Some(ReplicaState {
        replica_version: Watermark::parse(&version)?,
        watermark: Watermark::parse(&watermark)?,
        lsn: lsn.parse()?,
        publications: serde_json::from_str(&publications)?,
        slot,
        app_id,
        next_seq,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ack rule (acknowledge upstream once the replica commit returns) holds only if that
    /// commit is on disk: WAL with `synchronous=FULL`. The change log shares this connection.
    #[test]
    fn the_replica_and_change_log_connection_syncs_every_commit() {
        let dir =
            std::env::temp_dir().join(format!("highwater-replica-sync-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let replica = Replica::open_in_dir(&dir).expect("replica opens");
        let synchronous: i64 = replica
            .conn
            .query_row("PRAGMA synchronous", [], |row| row.get(0))
            .expect("pragma");
        let journal: String = replica
            .conn
            .query_row("PRAGMA journal_mode", [], |row| row.get(0))
            .expect("pragma");
        // SQLite's numbering: 0 OFF, 1 NORMAL, 2 FULL, 3 EXTRA.
        assert_eq!(synchronous, 2, "expected synchronous=FULL");
        assert_eq!(journal, "wal");
        drop(replica);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A power loss in the middle of the load (which writes without journal or fsync) can leave
    /// a file SQLite cannot open; its marker makes the next open start over instead of failing.
    #[test]
    fn a_damaged_replica_left_by_an_unfinished_load_is_removed_on_open() {
        let dir =
            std::env::temp_dir().join(format!("highwater-replica-torn-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let db = dir.join("replica.db");
        let mut torn = b"SQLite format 3\0".to_vec();
        torn.resize(8192, 0xA5);
        std::fs::write(&db, &torn).unwrap();
        assert!(
            Replica::open_in_dir(&dir).is_err(),
            "SQLite refuses the torn file by itself"
        );
        load_marker::LoadMarker::create(&db).unwrap();
        let replica = Replica::open_in_dir(&dir).expect("the marked replica starts over");
        assert!(replica.state().is_none() && replica.table_names().is_empty());
        assert!(!load_marker::marker_path(&db).exists());
        drop(replica);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
