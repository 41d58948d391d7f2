//! Initial sync: copying upstream rows into the replica in a snapshot
//! (`reference/zero-protocol.md` §11.2). Backfills read their snapshots with the same COPY
//! conversion (`replica::backfill`).
//!
//! Rows are streamed with `COPY (SELECT …) TO STDOUT` in text format and converted by the same
//! per-type-OID conversion as the replication stream (`engine::pgoutput`'s mapper is fed the
//! COPY fields as pgoutput text tuples), so a value reads the same whichever path brought it.
//! Only one partial COPY row and one batch are in memory at a time, whatever the table size.
//!
//! These functions block: run them on a blocking thread. Postgres I/O goes through
//! `handle.block_on`, SQLite is written directly.

use futures::StreamExt;
use highwater_engine::change_stream::{Change, DownstreamMessage, JsonFormat, Row};
use highwater_engine::pgoutput::{
    self, MappingError, PgTimestamp, PgType, PgoutputEvent, PgoutputMapper, PgoutputMessage,
    RelationColumn, Tuple, TupleValue,
};
use highwater_engine::watermark::{Lsn, Watermark};
use rusqlite::params_from_iter;
use rusqlite::types::Value as SqlValue;
use serde_json::Value;
use tokio::runtime::Handle;
use tokio_postgres::Client;

use super::apply::create_replica_table;
use super::copy_text::{CopyRows, CopyTextError};
use super::ddl::{parse_published_schema, PublishedTable, PUBLISHED_SCHEMA_SQL};
use super::schema::{create_index_sql, quote_ident, ReplicaColumn, ReplicaTable, ValueKind};
use super::value::to_sql;
use super::{Replica, ReplicaError, ReplicaState};

/// Rows per SQLite transaction during the copy.
pub const DEFAULT_BATCH_ROWS: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("upstream query failed: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// Boxed: the connection error is large, and this one travels in many results.
    #[error(transparent)]
    Connect(Box<crate::replication::ReplicationError>),
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error("malformed COPY data: {0}")]
    Copy(#[from] CopyTextError),
    #[error("could not convert a copied value: {0}")]
    Value(#[from] MappingError),
    #[error("expected the published schema as JSON, got: {0}")]
    Schema(#[from] serde_json::Error),
    #[error("the initial sync was stopped before it completed")]
    Stopped,
    #[error("expected the converter to return an insert, got {got}")]
    Converter { got: String },
    #[error(
        "expected a snapshot of {table} taken after its last rewrite, but it was rewritten \
         after every snapshot taken"
    )]
    Rewritten { table: String },
}

impl From<crate::replication::ReplicationError> for SyncError {
    fn from(e: crate::replication::ReplicationError) -> Self {
        SyncError::Connect(Box::new(e))
    }
}

impl From<rusqlite::Error> for SyncError {
    fn from(e: rusqlite::Error) -> Self {
        SyncError::Replica(e.into())
    }
}

/// Where the copy comes from and what the replica records about it.
#[derive(Debug, Clone)]
pub struct SyncSource {
    pub publications: Vec<String>,
    pub slot: String,
    pub app_id: String,
    /// The slot's consistent point: the snapshot shows the data up to it.
    pub consistent_point: Lsn,
    /// The exported snapshot (`CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')`).
    pub snapshot_name: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncReport {
    pub replica_version: Watermark,
    pub tables: usize,
    pub rows: u64,
}

/// Converts COPY text fields of a table's columns with the replication stream's conversion.
pub(super) struct TextRowConverter {
    mapper: PgoutputMapper,
    oid: u32,
}

impl TextRowConverter {
    const OID: u32 = 1;

    pub(super) fn new(table: &ReplicaTable, columns: &[&ReplicaColumn]) -> Result<Self, SyncError> {
        let mut mapper = PgoutputMapper::new();
        for col in columns {
            if let (ValueKind::Array, Some(oid)) = (col.kind, col.type_oid) {
                // Arrays of custom types (enums) are announced by Type messages named `_elem`.
                mapper.map_message(PgoutputMessage::Type(PgType {
                    oid,
                    namespace: String::new(),
                    name: format!("_{}", col.data_type.trim_end_matches("[]")),
                }))?;
            }
        }
        let relation = pgoutput::Relation {
            oid: Self::OID,
            namespace: table.schema.clone(),
            name: table.table.clone(),
            replica_identity: pgoutput::ReplicaIdentity::Default,
            columns: columns
                .iter()
                .map(|c| RelationColumn {
                    flags: u8::from(table.key.contains(&c.name)),
                    name: c.name.clone(),
                    type_oid: c.type_oid.unwrap_or(25),
                    type_modifier: -1,
                })
                .collect(),
        };
        mapper.map_message(PgoutputMessage::Relation(relation))?;
        mapper.map_message(PgoutputMessage::Begin(pgoutput::Begin {
            final_lsn: Lsn(1),
            commit_time: PgTimestamp(0),
            xid: 0,
        }))?;
        Ok(TextRowConverter {
            mapper,
            oid: Self::OID,
        })
    }

    pub(super) fn convert(&mut self, fields: &[Option<String>]) -> Result<Row, SyncError> {
        let tuple = Tuple(
            fields
                .iter()
                .map(|f| match f {
                    None => TupleValue::Null,
                    Some(text) => TupleValue::Text(text.as_bytes()),
                })
                .collect(),
        );
        let event = self
            .mapper
            .map_message(PgoutputMessage::Insert(pgoutput::Insert {
                relation_oid: self.oid,
                new: tuple,
            }))?;
        match event {
            Some(PgoutputEvent::Downstream(DownstreamMessage::Data(Change::Insert(insert)))) => {
                Ok(insert.new)
            }
            other => Err(SyncError::Converter {
                got: format!("{other:?}"),
            }),
        }
    }
}

fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// `COPY (SELECT cols FROM table) TO STDOUT`.
pub(super) fn copy_sql(table: &ReplicaTable, columns: &[&ReplicaColumn]) -> String {
    let cols: Vec<String> = columns.iter().map(|c| quote_ident(&c.name)).collect();
    format!(
        "COPY (SELECT {} FROM {}.{}) TO STDOUT",
        if cols.is_empty() {
            "".to_owned()
        } else {
            cols.join(", ")
        },
        quote_ident(&table.schema),
        quote_ident(&table.table)
    )
}

/// Streams `COPY` rows of `columns` to `on_row`, converted.
fn copy_rows(
    handle: &Handle,
    client: &Client,
    table: &ReplicaTable,
    columns: &[&ReplicaColumn],
    mut on_row: impl FnMut(Row) -> Result<(), SyncError>,
) -> Result<u64, SyncError> {
    let mut converter = TextRowConverter::new(table, columns)?;
    let stream = handle.block_on(client.copy_out(&copy_sql(table, columns)))?;
    let mut stream = Box::pin(stream);
    let mut rows = CopyRows::new(columns.len());
    while let Some(chunk) = handle.block_on(stream.next()) {
        let chunk = chunk?;
        rows.push(&chunk, |fields| on_row(converter.convert(&fields)?))?;
    }
    rows.finish()?;
    Ok(rows.rows())
}

/// Opens the snapshot transaction on `client` with the settings the value conversion expects.
fn begin_snapshot(
    handle: &Handle,
    client: &Client,
    snapshot: Option<&str>,
) -> Result<(), SyncError> {
    handle.block_on(open_snapshot(client, snapshot))
}

/// [`begin_snapshot`] for async callers: a repeatable-read transaction, at the exported
/// `snapshot` if one is given.
pub(super) async fn open_snapshot(
    client: &Client,
    snapshot: Option<&str>,
) -> Result<(), SyncError> {
    let mut sql = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;".to_owned();
    if let Some(name) = snapshot {
        sql.push_str(&format!(
            "SET TRANSACTION SNAPSHOT {};",
            quote_literal(name)
        ));
    }
    sql.push_str("SET LOCAL datestyle = 'ISO, MDY'; SET LOCAL intervalstyle = 'postgres';");
    client.batch_execute(&sql).await?;
    Ok(())
}

/// Reads the published schema of `publications` in the current transaction.
pub fn published_schema(
    handle: &Handle,
    client: &Client,
    publications: &[String],
) -> Result<Vec<PublishedTable>, SyncError> {
    let row = handle.block_on(client.query_one(PUBLISHED_SCHEMA_SQL, &[&publications]))?;
    let text: String = row.try_get(0)?;
    Ok(parse_published_schema(&text)?)
}

/// Copies every published table into an empty replica at the slot's snapshot, and records
/// `replicaVersion` = the consistent point. Nothing marks the replica as synced until the last
/// row is in: an interrupted sync leaves a replica without state, which is started over.
pub fn initial_sync(
    handle: &Handle,
    client: &Client,
    replica: &mut Replica,
    source: &SyncSource,
    batch_rows: usize,
) -> Result<SyncReport, SyncError> {
    initial_sync_until(handle, client, replica, source, batch_rows, &|| false)
}

/// [`initial_sync`] that gives up with [`SyncError::Stopped`] once `stop` returns true (polled
/// between batches).
pub fn initial_sync_until(
    handle: &Handle,
    client: &Client,
    replica: &mut Replica,
    source: &SyncSource,
    batch_rows: usize,
    stop: &dyn Fn() -> bool,
) -> Result<SyncReport, SyncError> {
    let result = copy_snapshot(handle, client, replica, source, batch_rows.max(1), stop);
    if result.is_err() {
        let _ = replica.conn.execute_batch("ROLLBACK");
    }
    // Ends the read-only snapshot transaction either way.
    let _ = handle.block_on(client.batch_execute("ROLLBACK"));
    result
}

fn copy_snapshot(
    handle: &Handle,
    client: &Client,
    replica: &mut Replica,
    source: &SyncSource,
    batch_rows: usize,
    stop: &dyn Fn() -> bool,
) -> Result<SyncReport, SyncError> {
    let replica_version = source.consistent_point.to_watermark();
    begin_snapshot(handle, client, Some(&source.snapshot_name))?;
    let published = published_schema(handle, client, &source.publications)?;
    tracing::info!(
        tables = published.len(),
        %replica_version,
        "initial sync: copying published tables"
    );

    replica.conn.execute_batch("BEGIN IMMEDIATE")?;
    for table in &published {
        let mut spec = ReplicaTable::from_spec(&table.to_spec());
        spec.metadata = table.metadata();
        create_replica_table(&replica.conn, &mut replica.tables, spec)?;
    }
    let mut seq: i64 = 1;
    let mut total: u64 = 0;
    for published_table in &published {
        let Some(table) = replica.tables.get(&published_table.replica_name()).cloned() else {
            continue;
        };
        let columns: Vec<&ReplicaColumn> = table.columns.iter().collect();
        let mut cols: Vec<String> = columns.iter().map(|c| quote_ident(&c.name)).collect();
        cols.push("\"_hw_version\"".into());
        cols.push("\"_hw_seq\"".into());
        let placeholders: Vec<String> = (1..=cols.len()).map(|i| format!("?{i}")).collect();
        let insert = format!(
            "INSERT INTO {} ({}) VALUES ({})",
            quote_ident(&table.name),
            cols.join(", "),
            placeholders.join(", ")
        );
        let conn = &replica.conn;
        let mut in_batch = 0usize;
        let copied = copy_rows(handle, client, &table, &columns, |row| {
            let values = columns
                .iter()
                .map(|c| {
                    row.get(&c.name)
                        .map_or(SqlValue::Null, |v| to_sql(c, v, JsonFormat::Stringified))
                })
                .chain([
                    SqlValue::Text(replica_version.as_str().to_owned()),
                    SqlValue::Integer(seq),
                ]);
            conn.prepare_cached(&insert)?
                .execute(params_from_iter(values))?;
            seq += 1;
            in_batch += 1;
            if in_batch >= batch_rows {
                if stop() {
                    return Err(SyncError::Stopped);
                }
                conn.execute_batch("COMMIT; BEGIN IMMEDIATE")?;
                in_batch = 0;
            }
            Ok(())
        })?;
        total += copied;
        tracing::info!(table = %table.name, rows = copied, "initial sync: table copied");
        for spec in published_table.index_specs() {
            let flag = |k: &str| spec.extra.get(k).and_then(Value::as_bool) == Some(true);
            let is_key = flag("isPrimaryKey") || flag("isReplicaIdentity");
            super::schema::record_index(&replica.conn, &spec, is_key)?;
            if !is_key {
                replica.conn.execute_batch(&create_index_sql(&spec))?;
            }
        }
    }
    let state = ReplicaState {
        replica_version: replica_version.clone(),
        watermark: replica_version.clone(),
        lsn: source.consistent_point,
        publications: source.publications.clone(),
        slot: source.slot.clone(),
        app_id: source.app_id.clone(),
        next_seq: seq,
    };
    replica.store_initial_state(&state)?;
    replica.conn.execute_batch("COMMIT")?;
    Ok(SyncReport {
        replica_version,
        tables: published.len(),
        rows: total,
    })
}
