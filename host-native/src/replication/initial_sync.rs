//! Initial sync: copying upstream rows into the replica in the snapshot exported when the
//! replication slot is created, as Zero's initial sync does. Backfills read their snapshots
//! with the same COPY conversion ([`super::backfill`]).
//!
//! Rows are streamed with `COPY (SELECT …) TO STDOUT` in text format and converted by the same
//! per-type-OID conversion as the replication stream (`engine::pgoutput::TextColumn`, the
//! mapper's own; backfills feed the mapper the COPY fields as pgoutput text tuples), so a value
//! reads the same whichever path brought it.
//!
//! The initial sync runs COPY readers on threads of their own, each on its own connection in
//! the exported snapshot, taking one table (or one page range of a large table) at a time, and
//! one writer on the calling thread, which hands the rows to the replica's load
//! (`replica::load`: the SQLite side, its settings, transactions, indexes and durability).
//! Readers convert rows to the replica's SQLite values in blocks (`RowBlock`) and hand the
//! writer batches over a bounded channel, so what is in memory is a few batches per reader,
//! whatever the table size.
//!
//! These functions block: run them on a blocking thread. Postgres I/O goes through
//! `handle.block_on`; the load writes SQLite directly.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use futures::{FutureExt as _, StreamExt};
use highwater_engine::change_stream::{Change, DownstreamMessage, JsonFormat, Row};
use highwater_engine::pgoutput::{
    self, MappingError, PgTimestamp, PgType, PgoutputEvent, PgoutputMapper, PgoutputMessage,
    RelationColumn, TextColumn, TextRead, Tuple, TupleValue,
};
use highwater_engine::watermark::{Lsn, Watermark};
use tokio::runtime::Handle;
use tokio_postgres::Client;

use super::copy_text::{CopyRow, CopyRows, CopyTextError};
use super::published_schema::{parse_published_schema, PublishedTable, PUBLISHED_SCHEMA_SQL};
use super::PgConfig;
use crate::replica::load::{Insert, Load, RowBlock};
use crate::replica::schema::{quote_ident, ReplicaColumn, ReplicaTable, ValueKind};
use crate::replica::value::{into_sql, scalar_to_sql, SqlScalar};
use crate::replica::{Replica, ReplicaError, ReplicaState};

/// Rows per SQLite transaction during the copy.
pub(crate) const DEFAULT_BATCH_ROWS: usize = 100_000;
/// COPY readers by default (`--sync-workers`).
pub const DEFAULT_SYNC_WORKERS: usize = 2;
/// Tables of at least this many 8 KiB pages (128 MiB) are read by several readers at once.
pub(crate) const SPLIT_MIN_PAGES: u32 = 16_384;
/// How often the copy's progress is logged.
pub(crate) const PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("upstream query failed: {}", crate::replication::PgErrorText(.0))]
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
    #[error("cannot start an initial sync reader thread: {0}")]
    Thread(std::io::Error),
    #[error("expected every COPY reader to finish its tables, but one ended without a result")]
    ReaderGone,
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

/// Converts COPY text fields of a table's columns straight to the replica's SQLite values:
/// each field goes through the replication stream's per-column conversion
/// ([`TextColumn`], the one the mapper applies to tuple values) and the replica's
/// [`into_sql`], so it is stored as [`TextRowConverter`] followed by `to_sql` would store it.
/// Scalars take the borrowed path of both ([`TextColumn::read`], [`scalar_to_sql`]): no JSON
/// value, no allocation per field.
struct CopyRowConverter {
    table: String,
    columns: Vec<(ReplicaColumn, TextColumn)>,
}

impl CopyRowConverter {
    fn new(table: &ReplicaTable, columns: &[&ReplicaColumn]) -> CopyRowConverter {
        CopyRowConverter {
            table: format!("{}.{}", table.schema, table.table),
            columns: columns
                .iter()
                .map(|c| {
                    // As `TextRowConverter`: arrays of custom types are announced as arrays,
                    // columns of unknown type are text.
                    let announced_array = c.kind == ValueKind::Array && c.type_oid.is_some();
                    let text = TextColumn::new(c.type_oid.unwrap_or(25), announced_array);
                    ((*c).clone(), text)
                })
                .collect(),
        }
    }

    /// Appends the SQLite values of one COPY row, in column order, to `block`; on an error
    /// nothing of the row stays in it.
    fn convert(&self, row: CopyRow<'_>, block: &mut RowBlock) -> Result<(), SyncError> {
        let mark = block.mark();
        let converted = self.convert_into(row, block);
        if converted.is_err() {
            block.truncate(mark);
        }
        converted
    }

    fn convert_into(&self, row: CopyRow<'_>, block: &mut RowBlock) -> Result<(), SyncError> {
        for (i, (column, text_column)) in self.columns.iter().enumerate() {
            let Some(text) = row.get(i) else {
                block.push(SqlScalar::Null);
                continue;
            };
            let invalid = |expected| MappingError::InvalidValue {
                table: self.table.clone(),
                column: column.name.clone(),
                type_oid: column.type_oid.unwrap_or(25),
                expected,
                len: text.len(),
            };
            match text_column.read(text).map_err(invalid)? {
                TextRead::Scalar(value) => block.push(scalar_to_sql(column, value)),
                // Arrays and rare spellings: through the JSON value.
                TextRead::Json(value) => {
                    block.push(into_sql(column, value, JsonFormat::Stringified).into());
                }
            }
        }
        block.end_row();
        Ok(())
    }
}

fn quote_literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// `COPY (SELECT cols FROM table [WHERE row_filter]) TO STDOUT`: the rows the publications
/// publish (`row_filter` as [`PublishedTable::row_filter`] gives it), as Postgres' own table
/// sync copies them.
pub(super) fn copy_sql(
    table: &ReplicaTable,
    columns: &[&ReplicaColumn],
    row_filter: Option<&str>,
) -> String {
    copy_pages_sql(table, columns, PageRange::ALL, row_filter)
}

/// [`copy_sql`] of the rows in `pages`.
fn copy_pages_sql(
    table: &ReplicaTable,
    columns: &[&ReplicaColumn],
    pages: PageRange,
    row_filter: Option<&str>,
) -> String {
    let cols: Vec<String> = columns.iter().map(|c| quote_ident(&c.name)).collect();
    let conditions: Vec<String> = pages
        .condition()
        .into_iter()
        .chain(row_filter.map(|filter| format!("({filter})")))
        .collect();
    format!(
        "COPY (SELECT {} FROM {}.{}{}) TO STDOUT",
        if cols.is_empty() {
            "".to_owned()
        } else {
            cols.join(", ")
        },
        quote_ident(&table.schema),
        quote_ident(&table.table),
        if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        }
    )
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
pub(crate) fn published_schema(
    handle: &Handle,
    client: &Client,
    publications: &[String],
) -> Result<Vec<PublishedTable>, SyncError> {
    let row = handle.block_on(client.query_one(PUBLISHED_SCHEMA_SQL, &[&publications]))?;
    let text: String = row.try_get(0)?;
    let mut tables = parse_published_schema(&text)?;
    for table in &mut tables {
        table.restrict_to(publications);
    }
    Ok(tables)
}

/// How an initial sync copies.
#[derive(Debug, Clone)]
pub struct SyncOptions {
    /// Rows per SQLite transaction during the load.
    pub batch_rows: usize,
    /// COPY readers, each on its own upstream connection in the exported snapshot; at most one
    /// per table is used. Readers beyond the first need the connection settings.
    pub workers: usize,
    /// How often progress is logged.
    pub progress_interval: Duration,
    /// A table of at least this many pages (`pg_class.relpages`) is split into one page range
    /// per reader, read in parallel (Postgres 14 and later, which scan TID ranges).
    pub split_min_pages: u32,
}

impl Default for SyncOptions {
    fn default() -> Self {
        SyncOptions {
            batch_rows: DEFAULT_BATCH_ROWS,
            workers: DEFAULT_SYNC_WORKERS,
            progress_interval: PROGRESS_INTERVAL,
            split_min_pages: SPLIT_MIN_PAGES,
        }
    }
}

/// Copies every published table into an empty replica at the slot's snapshot with one reader
/// (`client`), and records `replicaVersion` = the consistent point. Nothing marks the replica as
/// synced until the last row is in: an interrupted sync leaves a replica without state, which
/// is started over.
pub fn initial_sync(
    handle: &Handle,
    client: &Client,
    replica: &mut Replica,
    source: &SyncSource,
    batch_rows: usize,
) -> Result<SyncReport, SyncError> {
    let options = SyncOptions {
        batch_rows,
        workers: 1,
        ..SyncOptions::default()
    };
    initial_sync_with(handle, client, None, replica, source, &options, &|| false)
}

/// [`initial_sync`] with `options.workers` COPY readers: `client` and up to `workers - 1` more
/// connections opened with `readers` (none without it), each in the exported snapshot. It gives
/// up with [`SyncError::Stopped`] once `stop` returns true (polled between batches).
pub(crate) fn initial_sync_with(
    handle: &Handle,
    client: &Client,
    readers: Option<&PgConfig>,
    replica: &mut Replica,
    source: &SyncSource,
    options: &SyncOptions,
    stop: &dyn Fn() -> bool,
) -> Result<SyncReport, SyncError> {
    // An unfinished load rolls back and restores the replica's settings when dropped.
    let result = copy_snapshot(handle, client, readers, replica, source, options, stop);
    // Ends the read-only snapshot transaction either way.
    let _ = handle.block_on(client.batch_execute("ROLLBACK"));
    result
}

/// One published table to copy.
struct Job {
    table: ReplicaTable,
    /// The publications' row filter: only the rows it passes are copied.
    row_filter: Option<String>,
    /// Upstream's row estimate (`pg_class.reltuples`), when it has one.
    estimated_rows: Option<u64>,
    /// Upstream's page count estimate (`pg_class.relpages`).
    pages: u32,
    /// Page ranges it is read in, by as many readers.
    parts: u32,
}

/// What one reader copies at a time: a table, or a range of its pages.
struct Part<'a> {
    job: usize,
    table: &'a ReplicaTable,
    row_filter: Option<&'a str>,
    pages: PageRange,
}

/// Pages `start..end` of a table; `None` ends are open, so the first and last ranges also
/// cover pages the (estimated) page count missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PageRange {
    start: Option<u32>,
    end: Option<u32>,
}

impl PageRange {
    const ALL: PageRange = PageRange {
        start: None,
        end: None,
    };

    /// `parts` ranges covering every page of a table of about `pages` pages.
    fn split(pages: u32, parts: u32) -> Vec<PageRange> {
        let step = (pages / parts.max(1)).max(1);
        let bounds: Vec<u32> = (1..parts).map(|i| i * step).collect();
        (0..parts as usize)
            .map(|i| PageRange {
                start: i.checked_sub(1).map(|j| bounds[j]),
                end: bounds.get(i).copied(),
            })
            .collect()
    }

    /// The `WHERE` condition selecting these pages' rows.
    fn condition(self) -> Option<String> {
        let bound = |op: &str, page: u32| format!("ctid {op} '({page},0)'::tid");
        match (self.start, self.end) {
            (None, None) => None,
            (Some(start), None) => Some(bound(">=", start)),
            (None, Some(end)) => Some(bound("<", end)),
            (Some(start), Some(end)) => {
                Some(format!("{} AND {}", bound(">=", start), bound("<", end)))
            }
        }
    }
}

/// What a reader hands the writer.
enum Batch {
    Rows {
        job: usize,
        rows: RowBlock,
        /// COPY text bytes of these rows.
        bytes: u64,
    },
    Done {
        job: usize,
        /// How long the reader waited for upstream's COPY data, and for room in the channel
        /// (the writer being behind).
        upstream_wait: Duration,
        writer_wait: Duration,
    },
}

/// Rows per batch from a reader, and the COPY bytes that close a batch early.
const READER_BATCH_ROWS: usize = 1_000;
const READER_BATCH_BYTES: u64 = 256 << 10;
/// Batches queued per reader before it waits for the writer: enough that the writer, the
/// slowest stage, does not wait for a reader between bursts (with 2 it waited 1.4 s of an
/// 11 s load of 5,000,000 rows, with 8 it waits 0.5–0.9 s), at most 8 × 256 KiB per reader.
const QUEUED_BATCHES_PER_READER: usize = 8;

fn copy_snapshot(
    handle: &Handle,
    client: &Client,
    readers: Option<&PgConfig>,
    replica: &mut Replica,
    source: &SyncSource,
    options: &SyncOptions,
    stop: &dyn Fn() -> bool,
) -> Result<SyncReport, SyncError> {
    let replica_version = source.consistent_point.to_watermark();
    begin_snapshot(handle, client, Some(&source.snapshot_name))?;
    let published = published_schema(handle, client, &source.publications)?;

    // Dropped unfinished (an error below), the load rolls back.
    let mut load = Load::begin(replica, &replica_version, options.batch_rows)?;
    for table in &published {
        load.create_table(&table.to_spec(), table.metadata())?;
    }
    let mut jobs = Vec::new();
    for (index, published_table) in published.iter().enumerate() {
        let Some(table) = load.table(&published_table.replica_name()).cloned() else {
            continue;
        };
        let (estimated_rows, pages) = handle.block_on(estimate_size(client, &table))?;
        // The key index is built once the table is loaded (see `Load::defer_key_index`).
        load.defer_key_index(&table)?;
        jobs.push((
            index,
            Job {
                table,
                row_filter: published_table.row_filter.clone(),
                estimated_rows,
                pages,
                parts: 1,
            },
        ));
    }
    let workers = if readers.is_some() {
        options.workers.max(1)
    } else {
        1
    };
    // Large tables split into a page range per reader where upstream scans TID ranges.
    let server_version: i32 = handle
        .block_on(client.query_one("SELECT current_setting('server_version_num')::int", &[]))?
        .try_get(0)?;
    if workers > 1 && server_version >= 140_000 {
        for (_, job) in &mut jobs {
            if job.pages >= options.split_min_pages.max(1) {
                job.parts = u32::try_from(workers).unwrap_or(u32::MAX);
            }
        }
    }
    let parts: Vec<Part<'_>> = jobs
        .iter()
        .enumerate()
        .flat_map(|(job, (_, j))| {
            let ranges = if j.parts > 1 {
                PageRange::split(j.pages, j.parts)
            } else {
                vec![PageRange::ALL]
            };
            ranges.into_iter().map(move |pages| Part {
                job,
                table: &j.table,
                row_filter: j.row_filter.as_deref(),
                pages,
            })
        })
        .collect();
    let workers = workers.min(parts.len().max(1));
    tracing::info!(
        tables = published.len(),
        workers,
        estimated_rows = jobs.iter().filter_map(|(_, j)| j.estimated_rows).sum::<u64>(),
        %replica_version,
        "initial sync: copying published tables (estimated rows from pg_class.reltuples)"
    );

    // The other readers: their own connections, in the same exported snapshot.
    let mut extra = Vec::new();
    if let Some(config) = readers {
        for _ in 1..workers {
            let (reader, connection) = handle.block_on(config.connect())?;
            handle.spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "initial sync reader connection ended");
                }
            });
            handle.block_on(open_snapshot(&reader, Some(&source.snapshot_name)))?;
            extra.push(reader);
        }
    }
    let clients: Vec<&Client> = std::iter::once(client).chain(extra.iter()).collect();
    let next_job = AtomicUsize::new(0);
    let abort = AtomicBool::new(false);

    let written = std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel(workers * QUEUED_BATCHES_PER_READER);
        for reader in &clients {
            let tx = tx.clone();
            let (parts, next_job, abort) = (&parts, &next_job, &abort);
            std::thread::Builder::new()
                .name("hw-sync-reader".into())
                .spawn_scoped(scope, move || {
                    if let Err(error) = read_jobs(handle, reader, parts, next_job, abort, &tx) {
                        // The writer may be gone already (it failed or stopped first).
                        let _ = tx.send(Err(error));
                    }
                })
                .map_err(SyncError::Thread)?;
        }
        drop(tx);
        let result = write_batches(&mut load, &published, &jobs, &rx, options, stop);
        // Readers blocked on a full channel see it closed, and stop at their next batch.
        abort.store(true, Ordering::Relaxed);
        drop(rx);
        result
    });
    // After a failure a reader's COPY may still be streaming: closing its connection ends the
    // snapshot transaction without waiting for the rest of the table (ROLLBACK would).
    if written.is_ok() {
        for reader in &extra {
            let _ = handle.block_on(reader.batch_execute("ROLLBACK"));
        }
    }
    drop(extra);
    let total = written?;

    let state = ReplicaState {
        replica_version: replica_version.clone(),
        watermark: replica_version.clone(),
        lsn: source.consistent_point,
        publications: source.publications.clone(),
        slot: source.slot.clone(),
        app_id: source.app_id.clone(),
        next_seq: load.next_seq(),
    };
    // Every row durable, then the state that says they are there.
    load.finish(&state)?;
    Ok(SyncReport {
        replica_version,
        tables: published.len(),
        rows: total,
    })
}

/// Upstream's row estimate of `table` (`None` for a table never vacuumed or analyzed) and its
/// page count estimate.
async fn estimate_size(
    client: &Client,
    table: &ReplicaTable,
) -> Result<(Option<u64>, u32), SyncError> {
    let name = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&table.table)
    );
    let row = client
        .query_one(
            "SELECT reltuples::float8, relpages::int8 FROM pg_class WHERE oid = to_regclass($1)",
            &[&name],
        )
        .await;
    Ok(match row {
        Ok(row) => {
            let tuples: Option<f64> = row.try_get(0)?;
            let pages: Option<i64> = row.try_get(1)?;
            // Rounded estimate; negative means "never counted".
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let tuples = tuples.filter(|t| *t >= 0.0).map(|t| t as u64);
            let pages = pages.and_then(|p| u32::try_from(p).ok()).unwrap_or(0);
            (tuples, pages)
        }
        // Not found by name (it has just been dropped): the COPY reports it.
        Err(_) => (None, 0),
    })
}

/// A reader: takes the next table not yet taken, streams its COPY rows converted to SQLite
/// values in bounded batches, until no table is left or the writer gave up.
fn read_jobs(
    handle: &Handle,
    client: &Client,
    parts: &[Part<'_>],
    next_part: &AtomicUsize,
    abort: &AtomicBool,
    tx: &SyncSender<Result<Batch, SyncError>>,
) -> Result<(), SyncError> {
    loop {
        let Some(part) = parts.get(next_part.fetch_add(1, Ordering::Relaxed)) else {
            return Ok(());
        };
        // One `block_on` per part: COPY sends a message per row, and entering the runtime
        // and parking for each would cost more than converting the row.
        handle.block_on(read_table(client, part, abort, tx))?;
    }
}

/// Streams one table's COPY rows to the writer. Blocks this (reader) thread when the channel
/// is full, which is what bounds the rows in memory.
async fn read_table(
    client: &Client,
    part: &Part<'_>,
    abort: &AtomicBool,
    tx: &SyncSender<Result<Batch, SyncError>>,
) -> Result<(), SyncError> {
    let (job, table) = (part.job, part.table);
    let columns: Vec<&ReplicaColumn> = table.columns.iter().collect();
    let converter = CopyRowConverter::new(table, &columns);
    let sql = copy_pages_sql(table, &columns, part.pages, part.row_filter);
    let stream = client.copy_out(&sql).await?;
    let mut stream = std::pin::pin!(stream);
    let mut rows = CopyRows::new(columns.len());
    let mut batch = RowBlock::default();
    let mut bytes = 0u64;
    let (mut upstream_wait, mut writer_wait) = (Duration::ZERO, Duration::ZERO);
    loop {
        // Timed only when nothing is buffered yet: a clock read per row would show.
        let chunk = match stream.next().now_or_never() {
            Some(chunk) => chunk,
            None => {
                let started = Instant::now();
                let chunk = stream.next().await;
                upstream_wait += started.elapsed();
                chunk
            }
        };
        let Some(chunk) = chunk else {
            break;
        };
        let chunk = chunk?;
        bytes += chunk.len() as u64;
        rows.push_rows(&chunk, |row| converter.convert(row, &mut batch))?;
        if batch.len() >= READER_BATCH_ROWS || bytes >= READER_BATCH_BYTES {
            if abort.load(Ordering::Relaxed) {
                return Err(SyncError::Stopped);
            }
            let rows = std::mem::take(&mut batch);
            send(tx, &mut writer_wait, Batch::Rows { job, rows, bytes })?;
            bytes = 0;
        }
    }
    rows.finish()?;
    if !batch.is_empty() || bytes > 0 {
        let rows = batch;
        send(tx, &mut writer_wait, Batch::Rows { job, rows, bytes })?;
    }
    let done = Batch::Done {
        job,
        upstream_wait,
        writer_wait,
    };
    send(tx, &mut writer_wait, done)
}

/// Hands `batch` to the writer, counting a wait for room in `waited`; the writer gone means it
/// stopped. Blocks the calling thread while the channel is full.
fn send(
    tx: &SyncSender<Result<Batch, SyncError>>,
    waited: &mut Duration,
    batch: Batch,
) -> Result<(), SyncError> {
    match tx.try_send(Ok(batch)) {
        Ok(()) => Ok(()),
        Err(TrySendError::Disconnected(_)) => Err(SyncError::Stopped),
        Err(TrySendError::Full(batch)) => {
            let started = Instant::now();
            let sent = tx.send(batch).map_err(|_| SyncError::Stopped);
            *waited += started.elapsed();
            sent
        }
    }
}

/// The writer: hands every batch to the replica's load (which writes it with the table's
/// prepared statements in large transactions), has a table's indexes built once every part of
/// it is in, and logs progress. Returns the rows written.
///
/// `_hw_seq` numbers rows in the order they reach the writer: with one reader that is table
/// after table in COPY order; with several, tables and page ranges interleave. Either way each
/// seq is unique and increasing in the order rows were stored, and `next_seq` is above all of
/// them, which is all the change log and scope sync rely on (scope sync pages a table's rows by
/// seq up to a high-water; nothing reads an order across tables or along a table's key in it).
fn write_batches(
    load: &mut Load<'_>,
    published: &[PublishedTable],
    jobs: &[(usize, Job)],
    rx: &Receiver<Result<Batch, SyncError>>,
    options: &SyncOptions,
    stop: &dyn Fn() -> bool,
) -> Result<u64, SyncError> {
    let inserts: Vec<Insert> = jobs
        .iter()
        .map(|(_, job)| Insert::new(&job.table))
        .collect();
    let mut progress = Progress::new(jobs, options.progress_interval);
    let mut parts_left: Vec<u32> = jobs.iter().map(|(_, job)| job.parts).collect();
    let mut done = 0usize;
    while done < jobs.len() {
        if stop() {
            return Err(SyncError::Stopped);
        }
        let started = Instant::now();
        let received = rx.recv();
        progress.writer_wait += started.elapsed();
        let Ok(batch) = received else {
            return Err(SyncError::ReaderGone);
        };
        match batch? {
            Batch::Rows { job, rows, bytes } => {
                load.write(&inserts[job], &rows)?;
                progress.add(job, rows.len() as u64, bytes);
            }
            Batch::Done {
                job,
                upstream_wait,
                writer_wait,
            } => {
                let table_progress = &mut progress.tables[job];
                table_progress.upstream_wait += upstream_wait;
                table_progress.writer_wait += writer_wait;
                parts_left[job] -= 1;
                if parts_left[job] > 0 {
                    continue;
                }
                let (upstream_wait, writer_wait) =
                    (table_progress.upstream_wait, table_progress.writer_wait);
                let (index, Job { table, .. }) = &jobs[job];
                let elapsed = progress.tables[job]
                    .started
                    .map_or(Duration::ZERO, |started| started.elapsed());
                tracing::info!(
                    table = %table.name,
                    rows = progress.tables[job].rows,
                    bytes = progress.tables[job].bytes,
                    elapsed_ms = millis(elapsed),
                    reader_upstream_wait_ms = millis(upstream_wait),
                    reader_writer_wait_ms = millis(writer_wait),
                    "initial sync: table copied"
                );
                progress.finish(job);
                load.finish_table(table, &published[*index].index_specs())?;
                done += 1;
            }
        }
        progress.tick();
    }
    progress.close();
    Ok(progress.total_rows())
}

/// Rows and bytes copied per table, logged every interval with rates and an ETA from the
/// upstream row estimate; a progress bar on stderr when it is a terminal.
struct Progress {
    tables: Vec<TableProgress>,
    interval: Duration,
    started: Instant,
    last_log: Instant,
    /// How long the writer waited for readers.
    writer_wait: Duration,
    bar: Option<indicatif::ProgressBar>,
}

struct TableProgress {
    name: String,
    estimated_rows: Option<u64>,
    rows: u64,
    bytes: u64,
    started: Option<Instant>,
    done: bool,
    /// Summed over the table's readers.
    upstream_wait: Duration,
    writer_wait: Duration,
}

impl Progress {
    fn new(jobs: &[(usize, Job)], interval: Duration) -> Progress {
        use std::io::IsTerminal as _;
        let now = Instant::now();
        let tables: Vec<TableProgress> = jobs
            .iter()
            .map(|(_, job)| TableProgress {
                name: job.table.name.clone(),
                estimated_rows: job.estimated_rows,
                rows: 0,
                bytes: 0,
                started: None,
                done: false,
                upstream_wait: Duration::ZERO,
                writer_wait: Duration::ZERO,
            })
            .collect();
        let bar = std::io::stderr().is_terminal().then(|| {
            let total: u64 = tables.iter().filter_map(|t| t.estimated_rows).sum();
            let bar = indicatif::ProgressBar::with_draw_target(
                Some(total.max(1)),
                indicatif::ProgressDrawTarget::stderr(),
            );
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "initial sync {bar:30} {human_pos}/~{human_len} rows, ETA {eta} {msg}",
            ) {
                bar.set_style(style);
            }
            bar
        });
        Progress {
            tables,
            interval,
            started: now,
            last_log: now,
            writer_wait: Duration::ZERO,
            bar,
        }
    }

    fn add(&mut self, job: usize, rows: u64, bytes: u64) {
        let table = &mut self.tables[job];
        table.started.get_or_insert_with(Instant::now);
        table.rows += rows;
        table.bytes += bytes;
        if let Some(bar) = &self.bar {
            bar.inc(rows);
        }
    }

    fn finish(&mut self, job: usize) {
        self.tables[job].done = true;
    }

    fn total_rows(&self) -> u64 {
        self.tables.iter().map(|t| t.rows).sum()
    }

    /// Logs every table being copied, once per interval.
    fn tick(&mut self) {
        if self.last_log.elapsed() < self.interval {
            return;
        }
        self.last_log = Instant::now();
        let log = || {
            for table in &self.tables {
                let Some(started) = table.started.filter(|_| !table.done) else {
                    continue;
                };
                let seconds = started.elapsed().as_secs_f64().max(1e-3);
                let rate = table.rows as f64 / seconds;
                let eta = table
                    .estimated_rows
                    .filter(|_| rate > 0.0)
                    .map(|estimate| (estimate.saturating_sub(table.rows) as f64 / rate).ceil());
                tracing::info!(
                    table = %table.name,
                    rows = table.rows,
                    bytes = table.bytes,
                    rows_per_s = rate.round(),
                    estimated_rows = table.estimated_rows,
                    eta_s = eta,
                    "initial sync: copying (estimated rows and ETA from pg_class.reltuples)"
                );
            }
        };
        match &self.bar {
            Some(bar) => bar.suspend(log),
            None => log(),
        }
    }

    fn close(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        tracing::info!(
            rows = self.total_rows(),
            elapsed_ms = millis(self.started.elapsed()),
            writer_wait_ms = millis(self.writer_wait),
            "initial sync: every table copied"
        );
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::private_pg::{PgOptions, PrivatePg};
    use crate::replica::load::testing::{dump, read_state_once, seqs, settings, ReferenceLoad};
    use crate::replication::ConnectParams;

    const SCHEMA: &str = r#"
        CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
        CREATE TABLE issue (
            id int8 PRIMARY KEY, title text NOT NULL, body text,
            small int2, medium int4, big int8, amount numeric, ratio float8, done bool,
            meta json, data jsonb, created timestamptz, local_time timestamp, day date,
            uid uuid, feeling mood, tags text[], scores int4[], moods mood[], code varchar(10),
            at time, at_tz timetz, raw bytea
        );
        CREATE INDEX issue_title ON issue (title);
        CREATE TABLE pair (a int NOT NULL, b text NOT NULL, v text, PRIMARY KEY (a, b));
        CREATE TABLE log (msg text, n int);
        CREATE TABLE empty (id int PRIMARY KEY);
        INSERT INTO issue VALUES
          (1, 'first', repeat('x', 5000), 1, 2, 9007199254740993, 12345678901234567890.5, 1.5,
           true, '{"a": [1, 2]}', '{"b": {"c": null}}', '2024-03-01 12:34:56.789123+02',
           '2024-03-01 12:34:56', '2024-03-01', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 'happy',
           '{"x","y z"}', '{1,NULL,3}', '{sad,ok}', 'abc', '12:34:56.5', '12:00:00+02',
           '\xdeadbeef'),
          (2, 'nulls', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
           NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
          (3, E'tab\there, newline\nand back\\slash', '', -32768, -2147483648,
           -9223372036854775808, 'NaN', 'Infinity', false, '"s"', '[1, "two", 3.5]',
           'infinity', '1969-12-31 23:59:59.999', '1900-01-01',
           '00000000-0000-0000-0000-000000000000', 'sad', '{}', '{}', '{}', 'é ✓', '00:00',
           '23:59:59-11', '\x');
        -- More rows than a reader batch and than the SQLite transactions below.
        INSERT INTO issue (id, title, amount, created, data)
          SELECT g, 'row ' || g, g / 7.0, timestamptz '2024-01-01' + g * interval '1 minute',
                 jsonb_build_object('g', g)
          FROM generate_series(10, 4509) g;
        INSERT INTO pair SELECT g % 50, 'k' || g, NULL FROM generate_series(1, 2100) g;
        INSERT INTO log VALUES ('same', 1), ('same', 1), ('other', NULL);
        CREATE PUBLICATION everything FOR ALL TABLES;
        -- Page counts, so that three readers split the tables into page ranges.
        ANALYZE;
    "#;

    /// The copy as it was before readers ran in parallel: one connection, rows converted to a
    /// change-stream row by the stream's mapper, then stored one INSERT per row by the
    /// reference load, tables one after the other. Kept here as the reference the copy must
    /// equal.
    fn reference_sync(
        handle: &Handle,
        client: &Client,
        replica: &mut Replica,
        source: &SyncSource,
    ) -> Result<(), SyncError> {
        let version = source.consistent_point.to_watermark();
        begin_snapshot(handle, client, Some(&source.snapshot_name))?;
        let published = published_schema(handle, client, &source.publications)?;
        let mut load = ReferenceLoad::begin(replica, &version)?;
        for table in &published {
            load.create_table(&table.to_spec(), table.metadata())?;
        }
        for published_table in &published {
            let table = load
                .table(&published_table.replica_name())
                .cloned()
                .expect("every published table was created");
            let columns: Vec<&ReplicaColumn> = table.columns.iter().collect();
            let mut converter = TextRowConverter::new(&table, &columns)?;
            let sql = copy_sql(&table, &columns, published_table.row_filter.as_deref());
            let stream = handle.block_on(client.copy_out(&sql))?;
            let mut stream = Box::pin(stream);
            let mut rows = CopyRows::new(columns.len());
            while let Some(chunk) = handle.block_on(stream.next()) {
                rows.push(&chunk?, |fields| {
                    let row = converter.convert(&fields)?;
                    load.insert(&table, &row)?;
                    Ok::<_, SyncError>(())
                })?;
            }
            rows.finish()?;
            load.finish_table(&published_table.index_specs())?;
        }
        let next_seq = load.next_seq();
        load.finish(&ReplicaState {
            replica_version: version.clone(),
            watermark: version,
            lsn: source.consistent_point,
            publications: source.publications.clone(),
            slot: source.slot.clone(),
            app_id: source.app_id.clone(),
            next_seq,
        })?;
        handle.block_on(client.batch_execute("ROLLBACK"))?;
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn several_readers_store_the_replica_one_reader_and_the_old_copy_store() {
        let pg = PrivatePg::start(PgOptions::default()).await.unwrap();
        let setup = pg.connect().await.unwrap();
        setup.batch_execute(SCHEMA).await.unwrap();
        // Held open so every copy reads the same snapshot.
        setup
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            .await
            .unwrap();
        let snapshot: String = setup
            .query_one("SELECT pg_export_snapshot()", &[])
            .await
            .unwrap()
            .get(0);
        let source = SyncSource {
            publications: vec!["everything".into()],
            slot: "none".into(),
            app_id: "highwater".into(),
            consistent_point: Lsn(0x1234),
            snapshot_name: snapshot,
        };
        let params: ConnectParams = pg.url().parse().unwrap();
        let dir =
            std::env::temp_dir().join(format!("highwater-sync-readers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let handle = Handle::current();
        let mut paths = Vec::new();
        // "watched": another connection reads the replica all through the load, as a monitor
        // polling its state would (the bench's did, and the switches of journal mode around
        // the load failed as busy).
        for (name, workers) in [("reference", 0), ("one", 1), ("three", 3), ("watched", 2)] {
            let path = dir.join(name).join("replica.db");
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let client = pg.connect().await.unwrap();
            let (handle, source, config) = (handle.clone(), source.clone(), params.upstream());
            let path_for_sync = path.clone();
            let watching = std::sync::Arc::new(AtomicBool::new(name == "watched"));
            let watcher = {
                let (watching, path) = (watching.clone(), path.clone());
                std::thread::spawn(move || {
                    let mut reads = 0u32;
                    while watching.load(Ordering::Relaxed) {
                        reads += u32::from(read_state_once(&path));
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    reads
                })
            };
            let report = tokio::task::spawn_blocking(move || {
                let mut replica = Replica::open(&path_for_sync).unwrap();
                if workers == 0 {
                    reference_sync(&handle, &client, &mut replica, &source).map(|()| None)
                } else {
                    let options = SyncOptions {
                        batch_rows: 700,
                        workers,
                        // Every table of a page or more is read as three page ranges at once.
                        split_min_pages: 1,
                        ..SyncOptions::default()
                    };
                    let stop = || false;
                    initial_sync_with(
                        &handle,
                        &client,
                        Some(&config),
                        &mut replica,
                        &source,
                        &options,
                        &stop,
                    )
                    .map(Some)
                }
            })
            .await
            .unwrap()
            .unwrap();
            watching.store(false, Ordering::Relaxed);
            let reads = watcher.join().unwrap();
            if name == "watched" {
                assert!(reads > 0, "the watcher never read the replica");
            }
            if let Some(report) = report {
                assert_eq!((report.tables, report.rows), (4, 3 + 4500 + 2100 + 3));
            }
            paths.push(path);
        }
        assert_eq!(
            dump(&paths[3], &["_hw_seq", "next_seq"]),
            dump(&paths[0], &["_hw_seq", "next_seq"]),
            "two readers, watched, against the old copy"
        );
        let reference = dump(&paths[0], &[]);
        assert_eq!(
            dump(&paths[1], &[]),
            reference,
            "one reader against the old copy"
        );
        // Several readers interleave tables, so only the seqs differ.
        assert_eq!(
            dump(&paths[2], &["_hw_seq", "next_seq"]),
            dump(&paths[0], &["_hw_seq", "next_seq"]),
            "three readers against the old copy"
        );
        let (mut seqs, next_seq) = seqs(&paths[2], &["issue", "pair", "log", "empty"]);
        seqs.sort_unstable();
        let count = seqs.len();
        seqs.dedup();
        assert_eq!(seqs.len(), count, "every seq is unique");
        assert_eq!(next_seq, i64::try_from(count).unwrap() + 1);
        assert!(seqs.iter().all(|&s| (1..next_seq).contains(&s)));
        // The load settings did not outlive the load.
        assert_eq!(settings(&paths[2]), (2, "wal".to_owned()));
        setup.batch_execute("COMMIT").await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn page_ranges_cover_every_page_once() {
        assert_eq!(PageRange::split(100, 1), [PageRange::ALL]);
        let ranges = PageRange::split(100, 3);
        let bounds: Vec<_> = ranges.iter().map(|r| (r.start, r.end)).collect();
        assert_eq!(
            bounds,
            [(None, Some(33)), (Some(33), Some(66)), (Some(66), None)]
        );
        // Fewer pages than ranges: empty middle ranges, still no gap.
        let bounds: Vec<_> = PageRange::split(1, 3)
            .iter()
            .map(|r| (r.start, r.end))
            .collect();
        assert_eq!(
            bounds,
            [(None, Some(1)), (Some(1), Some(2)), (Some(2), None)]
        );
        assert_eq!(PageRange::ALL.condition(), None);
        assert_eq!(
            ranges[1].condition().as_deref(),
            Some("ctid >= '(33,0)'::tid AND ctid < '(66,0)'::tid")
        );
        assert_eq!(
            ranges[2].condition().as_deref(),
            Some("ctid >= '(66,0)'::tid")
        );
    }

    #[test]
    fn a_value_that_does_not_convert_is_a_typed_error() {
        use highwater_engine::change_stream::{ColumnSpec, TableSpec};
        let mut column = ColumnSpec::new(serde_json::Number::from(1), "int4");
        column.extra.insert("typeOID".into(), serde_json::json!(23));
        let spec = TableSpec {
            schema: "public".into(),
            name: "t".into(),
            columns: [("id".to_owned(), column)].into_iter().collect(),
            primary_key: Some(vec!["id".into()]),
            extra: Default::default(),
        };
        let table = ReplicaTable::from_spec(&spec);
        let columns: Vec<&ReplicaColumn> = table.columns.iter().collect();
        let converter = CopyRowConverter::new(&table, &columns);
        let mut block = RowBlock::default();
        let mut parser = CopyRows::new(1);
        let mut convert = |line: &[u8], block: &mut RowBlock| {
            let mut result = Ok(());
            parser
                .push_rows(line, |row| {
                    result = converter.convert(row, block);
                    Ok::<_, SyncError>(())
                })
                .unwrap();
            result
        };
        convert(b"12\n", &mut block).unwrap();
        assert_eq!(block.values(1), [[SqlScalar::Integer(12)]]);
        let converted = convert(b"twelve\n", &mut block);
        // Nothing of the bad row stays in the block.
        assert_eq!(block.values(1), [[SqlScalar::Integer(12)]]);
        match converted {
            Err(SyncError::Value(MappingError::InvalidValue {
                table, column, len, ..
            })) => assert_eq!(
                (table.as_str(), column.as_str(), len),
                ("public.t", "id", 6)
            ),
            other => panic!("expected an invalid value error, got {other:?}"),
        }
    }
}
