//! Backfills as a source of change-stream messages (Zero's `backfill` and `backfill-completed`).
//!
//! A table or column whose existing values only upstream knows (a table added to a publication,
//! a column added with a default, a retyped column) is read in a fresh snapshot of upstream and
//! becomes one synthetic transaction:
//!
//! ```text
//! ["begin",{"tag":"begin","json":"s","skipAck":true},{"commitWatermark":<position.minor+1>}]
//! ["data",{"tag":"backfill","relation":…,"columns":…,"watermark":<snapshot>,"rowValues":…}]  (batches)
//! ["data",{"tag":"backfill-completed",…}]
//! ["commit",{"tag":"commit"},{"watermark":<position.minor+1>}]
//! ```
//!
//! It goes where upstream transactions go: the upstream session (`crate::upstream`) takes its
//! messages like any transaction's, `replicate` applies them to the replica and `serve` forwards
//! and stores them, and `skipAck` keeps it from being confirmed upstream.
//!
//! Ordering: a consumer starts a backfill only between upstream transactions, and takes nothing
//! else until its commit. The snapshot waits until the upstream transactions the consumer took
//! last are visible, so it holds everything the replica has; upstream transactions after the
//! consumer's position come after the backfill and carry whole rows, so every row ends at its
//! upstream value. Rows are streamed from `COPY` in batches; a backfill never holds a table.
//!
//! Which backfill runs next, with which columns, and when a failed one is tried again is the
//! engine's rule (`highwater_engine::backfill::BackfillPlanner`); [`BackfillPlanner`] here
//! only hands it the replica's pending backfills, turns its plans into [`BackfillJob`]s and
//! `Instant`s into its milliseconds.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use futures::StreamExt;
use highwater_engine::backfill as planner;
use highwater_engine::change_stream::{
    Backfill, BackfillCompleted, Begin, Change, Commit, DownloadStatus, DownstreamMessage,
    JsonFormat, NewRelation, RowKey,
};
use highwater_engine::watermark::{Lsn, Watermark};
use serde_json::{Number, Value};
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::Client;

use super::copy_text::CopyRows;
use super::initial_sync::{copy_sql, open_snapshot, SyncError, TextRowConverter};
use super::published_schema::combine_row_filters;
use super::PgConfig;
use crate::replica::schema::{quote_ident, ReplicaColumn, ReplicaTable};
use crate::replica::{PendingBackfill, Replica};

/// Rows per `backfill` message.
pub(crate) const BACKFILL_BATCH_ROWS: usize = 2_000;

/// Messages produced ahead of the consumer: with [`BACKFILL_BATCH_ROWS`], a few thousand rows.
const AHEAD: usize = 2;

/// How long a backfill waits for the transactions before it to become visible.
const VISIBILITY_WAIT: Duration = Duration::from_secs(30);

/// How many of the consumer's latest upstream transactions a snapshot is checked against.
const VISIBLE_XIDS: usize = 64;

/// The consumer's latest upstream transactions (their 32-bit xids): the next backfill's
/// snapshot must see them, or it would overwrite their rows with older values.
#[derive(Debug, Default)]
pub(crate) struct RecentXids(VecDeque<u32>);

impl RecentXids {
    /// Notes the transaction `begin` opens (pgoutput's `xid`; other sources have none).
    pub(crate) fn note(&mut self, begin: &Begin) {
        let xid = begin
            .extra
            .get("xid")
            .and_then(Value::as_u64)
            .and_then(|x| u32::try_from(x).ok());
        if let Some(xid) = xid {
            if self.0.len() == VISIBLE_XIDS {
                self.0.pop_front();
            }
            self.0.push_back(xid);
        }
    }

    pub(crate) fn to_vec(&self) -> Vec<u32> {
        self.0.iter().copied().collect()
    }
}

/// One backfill to run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BackfillJob {
    /// The replica's table, for column types.
    pub table: ReplicaTable,
    pub pending: PendingBackfill,
    /// Columns (of `pending`, key included) to complete without values if upstream no longer
    /// has them: the consumer has passed the snapshot where they were first found missing, so
    /// no schema change in the stream will rename or drop them.
    pub settle: Vec<String>,
    /// The synthetic transaction's watermark: the next minor version after the consumer's
    /// position (`docs/protocol/change-stream.md`, "Watermarks").
    pub commit_watermark: Watermark,
    /// Upstream transactions (32-bit xids) the snapshot must see: the consumer's latest.
    pub(crate) visible_xids: Vec<u32>,
    pub batch_rows: usize,
    /// The replica's publications: only rows their row filters publish are read.
    pub publications: Vec<String>,
}

/// What a running backfill yields.
// Messages are the common variant; boxing them would add an allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum BackfillItem {
    /// The next message of the synthetic transaction.
    Message(DownstreamMessage),
    /// Pending columns (key included) that upstream lacks at `snapshot`: left pending, since a
    /// schema change after the consumer's position may still rename or drop them.
    Missing {
        columns: Vec<String>,
        snapshot: Watermark,
    },
}

/// A backfill being read from upstream, message by message. Dropping it stops the read.
pub(crate) struct BackfillStream {
    items: mpsc::Receiver<Result<BackfillItem, SyncError>>,
    task: JoinHandle<()>,
}

impl BackfillStream {
    /// Starts reading `job` on a new connection made with `upstream`.
    pub(crate) fn spawn(handle: &Handle, upstream: &PgConfig, job: BackfillJob) -> BackfillStream {
        let (tx, items) = mpsc::channel(AHEAD);
        let upstream = upstream.clone();
        let task = handle.spawn(async move {
            if let Err(error) = produce(&upstream, job, &tx).await {
                let _ = tx.send(Err(error)).await;
            }
        });
        BackfillStream { items, task }
    }

    /// The next item; `None` once the backfill is over.
    pub(crate) async fn next(&mut self) -> Option<Result<BackfillItem, SyncError>> {
        self.items.recv().await
    }
}

impl Drop for BackfillStream {
    fn drop(&mut self) {
        // Ends the snapshot transaction with its connection.
        self.task.abort();
    }
}

/// Whether every xid (32-bit, as pgoutput sends it) is visible in the current transaction's
/// snapshot; the 64-bit id takes its epoch from the snapshot's xmax.
const XIDS_VISIBLE_SQL: &str = "
SELECT coalesce(bool_and(pg_visible_in_snapshot(
  ((((pg_snapshot_xmax(s)::text::int8 >> 32)
     - CASE WHEN x > (pg_snapshot_xmax(s)::text::int8 & 4294967295) THEN 1 ELSE 0 END)
    << 32) | x)::text::xid8, s)), true)
FROM pg_current_snapshot() s, unnest($1::int8[]) x";

/// Opens a snapshot transaction that sees `xids`. A commit is streamed as soon as its WAL is
/// flushed, a moment before other sessions see it; a snapshot taken in that moment would miss
/// the very transaction that asked for the backfill.
async fn open_snapshot_seeing(client: &Client, xids: &[u32]) -> Result<(), SyncError> {
    let xids: Vec<i64> = xids.iter().map(|x| i64::from(*x)).collect();
    let deadline = Instant::now() + VISIBILITY_WAIT;
    loop {
        open_snapshot(client, None).await?;
        if xids.is_empty() {
            return Ok(());
        }
        let visible: bool = client
            .query_one(XIDS_VISIBLE_SQL, &[&xids])
            .await?
            .try_get(0)?;
        if visible {
            return Ok(());
        }
        if Instant::now() > deadline {
            tracing::warn!("a backfill snapshot still misses recent transactions; reading anyway");
            return Ok(());
        }
        client.batch_execute("ROLLBACK").await?;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Locks `schema.name` for reading in the open snapshot's transaction and tells whether the
/// snapshot still shows its rows: true when no rewrite committed between the snapshot and the
/// lock (or the table is gone), false when one did.
///
/// A table rewrite (`ADD COLUMN` with a volatile default such as `now()` or `serial`,
/// `ALTER COLUMN … TYPE`) is not MVCC-safe in Postgres: a snapshot taken before the rewrite
/// committed sees the rewritten table as empty, and a backfill read in it would complete with
/// no rows. The lock keeps any later rewrite from committing while the backfill reads; one that
/// committed earlier shows as a storage file (`pg_relation_filenode`, from the current catalog)
/// other than the one the snapshot's `pg_class` row names.
pub async fn lock_unless_rewritten(
    client: &Client,
    schema: &str,
    name: &str,
) -> Result<bool, SyncError> {
    let qualified = format!("{}.{}", quote_ident(schema), quote_ident(name));
    let exists = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&qualified])
        .await?
        .try_get::<_, bool>(0)?;
    if !exists {
        return Ok(true);
    }
    client
        .batch_execute(&format!("LOCK TABLE ONLY {qualified} IN ACCESS SHARE MODE"))
        .await?;
    let stable: Option<bool> = client
        .query_opt(
            "SELECT c.relfilenode = pg_relation_filenode(c.oid) FROM pg_class c \
             WHERE c.oid = to_regclass($1)",
            &[&qualified],
        )
        .await?
        .map(|r| r.try_get(0))
        .transpose()?;
    Ok(stable.unwrap_or(true))
}

/// The watermark of the snapshot: the backfill's `watermark` (`change-stream.md`, "Backfills").
async fn snapshot_watermark(client: &Client) -> Result<Watermark, SyncError> {
    let lsn: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .try_get(0)?;
    lsn.parse::<Lsn>()
        .map(Lsn::to_watermark)
        .map_err(|e| SyncError::Converter {
            got: format!("the WAL position {lsn:?} ({e})"),
        })
}

/// The table's columns upstream in the snapshot; empty when the table is gone.
async fn upstream_columns(client: &Client, table: &ReplicaTable) -> Result<Vec<String>, SyncError> {
    let name = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&table.table)
    );
    client
        .query(
            "SELECT attname::text FROM pg_attribute \
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
            &[&name],
        )
        .await?
        .iter()
        .map(|r| r.try_get(0).map_err(SyncError::from))
        .collect()
}

/// The row filter the replica's publications publish the table with, in the snapshot (see
/// [`combine_row_filters`]); `None`: every row. Read through `to_jsonb`, so Postgres before 15
/// (no row filters) answers `None`.
async fn upstream_row_filter(
    client: &Client,
    table: &ReplicaTable,
    publications: &[String],
) -> Result<Option<String>, SyncError> {
    let rows = client
        .query(
            "SELECT to_jsonb(pt) ->> 'rowfilter' FROM pg_publication_tables pt \
             WHERE pt.schemaname = $1 AND pt.tablename = $2 AND pt.pubname::text = ANY($3::text[])",
            &[&table.schema, &table.table, &publications],
        )
        .await?;
    let filters: Vec<Option<String>> = rows
        .iter()
        .map(|r| r.try_get(0))
        .collect::<Result<_, _>>()?;
    Ok(combine_row_filters(filters.iter().map(Option::as_deref)))
}

/// The planner's estimate of the table's rows, for `status` (display only).
async fn estimated_rows(client: &Client, table: &ReplicaTable) -> Result<u64, SyncError> {
    let name = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&table.table)
    );
    let estimate: Option<f32> = client
        .query_opt(
            "SELECT reltuples FROM pg_class WHERE oid = to_regclass($1)",
            &[&name],
        )
        .await?
        .map(|r| r.try_get(0))
        .transpose()?;
    // Never-analyzed tables say -1.
    Ok(estimate.map_or(0, |n| n.max(0.0) as u64))
}

/// What a backfill reads and completes, given the table's columns upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ReadPlan {
    /// Pending columns upstream lacks that may still be renamed or dropped by the stream.
    waiting: Vec<String>,
    /// Non-key columns read from the snapshot (after the key).
    read: Vec<String>,
    /// Whether rows are read at all (a whole-table backfill reads even without `read`).
    copy: bool,
    /// Non-key columns the `backfill-completed` clears (the key's are cleared with it).
    completed: Vec<String>,
    /// Whether there is a transaction to produce.
    emit: bool,
}

fn plan_read(job: &BackfillJob, upstream_columns: &[String]) -> ReadPlan {
    let pending = &job.pending;
    let present = |c: &String| upstream_columns.contains(c);
    let key_present = !upstream_columns.is_empty() && pending.key.iter().all(present);
    // Without its key (or the table) upstream, no row can be matched.
    let missing: Vec<&String> = if key_present {
        pending.columns.iter().filter(|c| !present(c)).collect()
    } else {
        pending.key.iter().chain(&pending.columns).collect()
    };
    let (settled, waiting): (Vec<&String>, Vec<&String>) =
        missing.into_iter().partition(|c| job.settle.contains(c));
    let key_settled = !key_present && pending.key.iter().all(|k| settled.contains(&k));
    // A keyless table's rows are matched on every column: only a whole-table backfill can
    // read them.
    let matchable = !pending.key.is_empty() || pending.whole_table;
    let readable = key_present && matchable;
    let read: Vec<String> = pending
        .columns
        .iter()
        .filter(|c| readable && present(c))
        .cloned()
        .collect();
    let copy = readable && (pending.whole_table || !read.is_empty());
    // Columns that cannot be read are completed too: their values cannot be had.
    let completed: Vec<String> = pending
        .columns
        .iter()
        .filter(|c| read.contains(c) || settled.contains(c) || (key_present && !matchable))
        .cloned()
        .collect();
    let emit = (key_present || key_settled)
        && (copy || !completed.is_empty() || key_settled || key_backfilling(&job.table, pending));
    ReadPlan {
        waiting: waiting.into_iter().cloned().collect(),
        read,
        copy,
        completed,
        emit,
    }
}

async fn produce(
    upstream: &PgConfig,
    job: BackfillJob,
    tx: &mpsc::Sender<Result<BackfillItem, SyncError>>,
) -> Result<(), SyncError> {
    let (client, connection) = upstream.connect().await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "backfill connection ended");
        }
    });
    let deadline = Instant::now() + VISIBILITY_WAIT;
    loop {
        open_snapshot_seeing(&client, &job.visible_xids).await?;
        if lock_unless_rewritten(&client, &job.table.schema, &job.table.table).await? {
            break;
        }
        client.batch_execute("ROLLBACK").await?;
        if Instant::now() > deadline {
            return Err(SyncError::Rewritten {
                table: job.table.name.clone(),
            });
        }
        tracing::debug!(table = %job.table.name, "table rewritten after the backfill's snapshot; taking another");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let snapshot = snapshot_watermark(&client).await?;
    let plan = plan_read(&job, &upstream_columns(&client, &job.table).await?);
    // A closed channel means the consumer stopped listening: nothing more to do.
    if !plan.waiting.is_empty() {
        let item = BackfillItem::Missing {
            columns: plan.waiting.clone(),
            snapshot: snapshot.clone(),
        };
        if tx.send(Ok(item)).await.is_err() {
            return Ok(());
        }
    }
    if !plan.emit {
        return Ok(());
    }
    if job.pending.key.is_empty() && !job.pending.whole_table {
        tracing::warn!(
            table = %job.table.name,
            columns = ?job.pending.columns,
            "a table without a key cannot take a column backfill: its existing rows keep NULL"
        );
    }
    let relation = NewRelation {
        schema: job.table.schema.clone(),
        name: job.table.table.clone(),
        row_key: RowKey::new(job.pending.key.clone(), None),
        extra: Default::default(),
    };
    let mut begin = Begin::new(job.commit_watermark.clone());
    begin.json = Some(JsonFormat::Stringified);
    begin.skip_ack = Some(true);
    if !send(tx, DownstreamMessage::Begin(begin)).await {
        return Ok(());
    }
    let rows = if plan.copy {
        let read = RowsRead {
            relation: &relation,
            columns: &plan.read,
            snapshot: &snapshot,
        };
        match read_rows(&client, &job, read, tx).await? {
            Some(rows) => rows,
            None => return Ok(()),
        }
    } else {
        0
    };
    let done = BackfillCompleted {
        relation,
        columns: plan.completed.clone(),
        watermark: snapshot,
        progress_marks: None,
        status: None,
        extra: Default::default(),
    };
    if !send(tx, DownstreamMessage::Data(Change::BackfillCompleted(done))).await {
        return Ok(());
    }
    tracing::info!(
        table = %job.table.name,
        columns = ?plan.completed,
        rows,
        "backfill read"
    );
    send(
        tx,
        DownstreamMessage::Commit(Commit::new(job.commit_watermark)),
    )
    .await;
    Ok(())
}

/// Sends one message; `false` once the consumer stopped listening.
async fn send(
    tx: &mpsc::Sender<Result<BackfillItem, SyncError>>,
    message: DownstreamMessage,
) -> bool {
    tx.send(Ok(BackfillItem::Message(message))).await.is_ok()
}

/// What the `backfill` messages of one read say besides their rows.
struct RowsRead<'a> {
    relation: &'a NewRelation,
    columns: &'a [String],
    snapshot: &'a Watermark,
}

/// Streams the key and `read.columns` of every row as `backfill` messages of at most
/// `job.batch_rows` rows; the number of rows, or `None` once the consumer stopped listening.
async fn read_rows(
    client: &Client,
    job: &BackfillJob,
    read: RowsRead<'_>,
    tx: &mpsc::Sender<Result<BackfillItem, SyncError>>,
) -> Result<Option<u64>, SyncError> {
    let copy_columns: Vec<&ReplicaColumn> = job
        .pending
        .key
        .iter()
        .chain(read.columns)
        .filter_map(|name| job.table.column(name))
        .collect();
    let total = estimated_rows(client, &job.table).await?;
    let mut converter = TextRowConverter::new(&job.table, &copy_columns)?;
    let row_filter = upstream_row_filter(client, &job.table, &job.publications).await?;
    let stream = client
        .copy_out(&copy_sql(&job.table, &copy_columns, row_filter.as_deref()))
        .await?;
    let mut stream = Box::pin(stream);
    let mut parser = CopyRows::new(copy_columns.len());
    let mut batch: Vec<Vec<Value>> = Vec::new();
    let mut rows = 0u64;
    let batch_rows = job.batch_rows.max(1);
    let mut progress = crate::runtime::Progress::new();
    loop {
        let chunk = stream.next().await.transpose()?;
        let last = chunk.is_none();
        match chunk {
            Some(chunk) => parser.push(&chunk, |fields| {
                let mut row = converter.convert(&fields)?;
                batch.push(
                    copy_columns
                        .iter()
                        .map(|c| row.remove(&c.name).unwrap_or(Value::Null))
                        .collect(),
                );
                Ok::<_, SyncError>(())
            })?,
            None => parser.finish()?,
        }
        // One COPY chunk completes a bounded number of rows: the batch stays near its size.
        while batch.len() >= batch_rows || (last && !batch.is_empty()) {
            let rest = batch.split_off(batch.len().min(batch_rows));
            let row_values = std::mem::replace(&mut batch, rest);
            rows += row_values.len() as u64;
            let message = Backfill {
                relation: read.relation.clone(),
                columns: read.columns.to_vec(),
                watermark: read.snapshot.clone(),
                row_values,
                progress_marks: None,
                status: Some(DownloadStatus {
                    rows: Number::from(rows),
                    total_rows: Number::from(total.max(rows)),
                    total_bytes: None,
                    extra: Default::default(),
                }),
                extra: Default::default(),
            };
            if !send(tx, DownstreamMessage::Data(Change::Backfill(message))).await {
                return Ok(None);
            }
            if progress.due() {
                tracing::info!(
                    table = %job.table.name,
                    rows,
                    estimated_total = total.max(rows),
                    elapsed_s = progress.elapsed_s(),
                    "backfill in progress"
                );
            }
        }
        if last {
            return Ok(Some(rows));
        }
    }
}

/// The engine's backfill planner ([`planner::BackfillPlanner`]: which backfill runs next, with
/// which columns, when a failed one is tried again) over the replica: its pending backfills
/// become the planner's input, a plan becomes a [`BackfillJob`] with what only the server has,
/// and `Instant`s are milliseconds since the planner was made.
#[derive(Debug)]
pub(crate) struct BackfillPlanner {
    rule: planner::BackfillPlanner,
    /// Where the planner's milliseconds count from.
    epoch: Instant,
}

impl Default for BackfillPlanner {
    fn default() -> Self {
        // Jitter only needs to differ between servers.
        Self::with_seed(std::process::id().into())
    }
}

impl BackfillPlanner {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A planner whose retry delays are drawn from `seed`.
    pub(crate) fn with_seed(seed: u64) -> Self {
        BackfillPlanner {
            rule: planner::BackfillPlanner::new(seed),
            epoch: Instant::now(),
        }
    }

    /// The next backfill the replica waits for, as a transaction after `position` (the
    /// consumer's last commit), or `None` when there is nothing to run now.
    pub(crate) fn next_job(
        &mut self,
        replica: &Replica,
        position: &Watermark,
        visible_xids: &[u32],
        batch_rows: usize,
    ) -> Option<BackfillJob> {
        let pending = replica.pending_backfills();
        let input: Vec<planner::PendingBackfill> = pending
            .iter()
            .filter_map(|p| {
                let table = replica.table(&p.table)?;
                Some(planner::PendingBackfill {
                    table: p.table.clone(),
                    key: p.key.clone(),
                    columns: p.columns.clone(),
                    whole_table: p.whole_table,
                    key_backfilling: key_backfilling(table, p),
                })
            })
            .collect();
        let plan = self.rule.next(&input, position)?;
        let p = pending
            .into_iter()
            .find(|p| p.table == plan.pending.table)?;
        let table = replica.table(&p.table)?.clone();
        Some(BackfillJob {
            table,
            pending: PendingBackfill {
                columns: plan.pending.columns,
                ..p
            },
            settle: plan.settle,
            commit_watermark: plan.commit_watermark,
            visible_xids: visible_xids.to_vec(),
            batch_rows,
            publications: replica
                .state()
                .map(|state| state.publications.clone())
                .unwrap_or_default(),
        })
    }

    /// Upstream lacked `columns` of `table` at `snapshot`.
    pub(crate) fn on_missing(&mut self, table: &str, columns: &[String], snapshot: &Watermark) {
        self.rule.on_missing(table, columns, snapshot);
    }

    /// The backfill of `table` failed at `position`, at `now`: not retried before the next
    /// transaction or its retry delay ([`BackfillPlanner::retry_at`]).
    pub(crate) fn on_failed(&mut self, table: &str, position: &Watermark, now: Instant) {
        // Rounded up: the retry never comes before its delay.
        let elapsed = now.saturating_duration_since(self.epoch);
        let now_ms = u64::try_from(elapsed.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX);
        self.rule.on_failed(table, position, now_ms);
    }

    /// A backfill committed: the next failure waits the shortest delay again.
    pub(crate) fn on_completed(&mut self) {
        self.rule.on_completed();
    }

    /// When the next failed backfill may be tried again without a transaction in between;
    /// `None` when none waits.
    pub(crate) fn retry_at(&self) -> Option<Instant> {
        let ms = self.rule.retry_at_ms()?;
        Some(self.epoch + Duration::from_millis(ms))
    }

    /// Releases the failed backfills whose delay has passed at `now`, for the next
    /// [`BackfillPlanner::next_job`]; `true` if it released any.
    pub(crate) fn release_due(&mut self, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.epoch);
        let now_ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX);
        self.rule.release_due(now_ms)
    }
}

/// Whether a key column itself awaits a backfill (a retyped key): completing the backfill
/// clears it.
fn key_backfilling(table: &ReplicaTable, pending: &PendingBackfill) -> bool {
    table
        .columns
        .iter()
        .any(|c| pending.key.contains(&c.name) && c.backfill.is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::{ReplicaState, ReplicaWriter};
    use highwater_engine::change_stream::{
        AddColumn, ColumnDef, ColumnSpec, CreateTable, Identifier, PgTypeClass, TableSpec,
        UpdateColumn,
    };
    use indexmap::IndexMap;
    use serde_json::json;

    fn w(n: u64) -> Watermark {
        Lsn(n).to_watermark()
    }

    fn column(pos: i64, data_type: &str) -> ColumnSpec {
        let mut spec = ColumnSpec::new(Number::from(pos), data_type);
        spec.pg_type_class = Some(PgTypeClass::Base);
        spec
    }

    fn txn(writer: &mut ReplicaWriter, lsn: u64, changes: Vec<Change>) {
        writer
            .apply(&DownstreamMessage::Begin(Begin::new(w(lsn))))
            .unwrap();
        for change in changes {
            writer.apply(&DownstreamMessage::Data(change)).unwrap();
        }
        writer
            .apply(&DownstreamMessage::Commit(Commit::new(w(lsn))))
            .unwrap();
    }

    /// A replica with `item (id, name)` and a column `c` added with a backfill at 0x200.
    fn writer_waiting_for_c() -> ReplicaWriter {
        let mut replica = Replica::open_in_memory().unwrap();
        replica
            .store_initial_state(&ReplicaState {
                replica_version: w(0x100),
                watermark: w(0x100),
                lsn: Lsn(0x100),
                publications: vec!["pub".into()],
                slot: "slot".into(),
                app_id: "highwater".into(),
                next_seq: 1,
            })
            .unwrap();
        let mut writer = ReplicaWriter::new(replica);
        let create = Change::CreateTable(CreateTable {
            spec: TableSpec {
                schema: "public".into(),
                name: "item".into(),
                columns: IndexMap::from([
                    ("id".to_owned(), column(1, "int4")),
                    ("name".to_owned(), column(2, "text")),
                ]),
                primary_key: Some(vec!["id".into()]),
                extra: Default::default(),
            },
            metadata: None,
            backfill: None,
            extra: Default::default(),
        });
        let add = Change::AddColumn(AddColumn {
            table: Identifier::new("public", "item"),
            column: ColumnDef {
                name: "c".into(),
                spec: column(3, "float8"),
                extra: Default::default(),
            },
            table_metadata: None,
            backfill: Some(json!({"attNum": 3})),
            extra: Default::default(),
        });
        txn(&mut writer, 0x200, vec![create, add]);
        writer
    }

    /// A plan of the engine's planner becomes a job with the replica's table, its
    /// publications and the transactions the snapshot must see.
    #[test]
    fn a_job_is_a_skip_ack_transaction_at_the_next_minor_version() {
        let writer = writer_waiting_for_c();
        let mut planner = BackfillPlanner::new();
        let job = planner
            .next_job(writer.replica(), &w(0x200), &[7], 10)
            .unwrap();
        assert_eq!(
            job.commit_watermark,
            w(0x200)
                .state_version()
                .next_minor()
                .to_watermark()
                .unwrap()
        );
        assert!(w(0x200) < job.commit_watermark && job.commit_watermark < w(0x201));
        assert_eq!(job.table.name, "item");
        assert_eq!(job.pending.columns, vec!["c".to_owned()]);
        assert_eq!(job.pending.key, vec!["id".to_owned()]);
        assert_eq!(
            (job.pending.schema.as_str(), job.pending.name.as_str()),
            ("public", "item")
        );
        assert!(!job.pending.whole_table);
        assert!(job.settle.is_empty());
        assert_eq!(job.visible_xids, vec![7]);
        assert_eq!(job.batch_rows, 10);
        assert_eq!(job.publications, vec!["pub".to_owned()]);
        // Nothing new at the same position: the same job is not handed out again.
        assert_eq!(
            planner.next_job(writer.replica(), &w(0x200), &[7], 10),
            None
        );
    }

    /// Add a column, then rename it: the first backfill finds it missing upstream; the rename
    /// reaches the replica before the stream passes that snapshot, and the renamed column is
    /// backfilled at once rather than lost.
    #[test]
    fn a_renamed_missing_column_is_backfilled_under_its_new_name() {
        let mut writer = writer_waiting_for_c();
        let mut planner = BackfillPlanner::new();
        planner.on_missing("item", &["c".to_owned()], &w(0x500));
        assert_eq!(planner.next_job(writer.replica(), &w(0x200), &[], 10), None);
        let rename = Change::UpdateColumn(UpdateColumn {
            table: Identifier::new("public", "item"),
            old: ColumnDef {
                name: "c".into(),
                spec: column(3, "float8"),
                extra: Default::default(),
            },
            new: ColumnDef {
                name: "d".into(),
                spec: column(3, "float8"),
                extra: Default::default(),
            },
            extra: Default::default(),
        });
        txn(&mut writer, 0x300, vec![rename]);
        let job = planner
            .next_job(writer.replica(), &w(0x300), &[], 10)
            .unwrap();
        assert_eq!(job.pending.columns, vec!["d".to_owned()]);
        assert!(job.settle.is_empty());
    }

    /// A retyped key awaits a backfill itself: the table runs even while its only other
    /// pending column waits for a snapshot the consumer has not passed.
    #[test]
    fn a_retyped_key_runs_while_the_other_columns_wait() {
        let mut writer = writer_waiting_for_c();
        let mut planner = BackfillPlanner::new();
        planner.on_missing("item", &["c".to_owned()], &w(0x500));
        assert_eq!(planner.next_job(writer.replica(), &w(0x300), &[], 10), None);
        let retype = Change::UpdateColumn(UpdateColumn {
            table: Identifier::new("public", "item"),
            old: ColumnDef {
                name: "id".into(),
                spec: column(1, "int4"),
                extra: Default::default(),
            },
            new: ColumnDef {
                name: "id".into(),
                spec: column(1, "int8"),
                extra: Default::default(),
            },
            extra: Default::default(),
        });
        txn(&mut writer, 0x300, vec![retype]);
        let table = writer.replica().table("item").unwrap();
        assert!(table.column("id").unwrap().backfill.is_some());
        let job = planner
            .next_job(writer.replica(), &w(0x300), &[], 10)
            .unwrap();
        assert!(job.pending.columns.is_empty());
        assert_eq!(job.pending.key, vec!["id".to_owned()]);
    }

    /// Times are the planner's milliseconds since it was made: a failed backfill is released
    /// at its retry time and not a millisecond before, never earlier than the shortest delay.
    #[test]
    fn a_failed_backfill_is_released_at_its_retry_instant() {
        let writer = writer_waiting_for_c();
        let mut planner = BackfillPlanner::with_seed(7);
        let now = Instant::now() + Duration::from_nanos(1_234_567);
        assert!(planner
            .next_job(writer.replica(), &w(0x200), &[], 10)
            .is_some());
        assert_eq!(planner.retry_at(), None);
        planner.on_failed("item", &w(0x200), now);
        let retry_at = planner.retry_at().unwrap();
        let delay = retry_at - now;
        assert!(delay >= Duration::from_secs(1), "{delay:?}");
        assert!(delay <= Duration::from_secs(2), "{delay:?}");
        assert_eq!(planner.next_job(writer.replica(), &w(0x200), &[], 10), None);
        assert!(!planner.release_due(retry_at - Duration::from_millis(1)));
        assert!(planner.release_due(retry_at));
        assert_eq!(planner.retry_at(), None);
        assert!(planner
            .next_job(writer.replica(), &w(0x200), &[], 10)
            .is_some());
    }

    fn job(writer: &ReplicaWriter, settle: &[&str]) -> BackfillJob {
        let mut job = BackfillPlanner::new()
            .next_job(writer.replica(), &w(0x200), &[], 10)
            .unwrap();
        job.settle = settle.iter().map(|c| (*c).to_owned()).collect();
        job
    }

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn a_column_present_upstream_is_read_and_completed() {
        let writer = writer_waiting_for_c();
        let plan = plan_read(&job(&writer, &[]), &names(&["id", "name", "c"]));
        assert_eq!(
            plan,
            ReadPlan {
                waiting: vec![],
                read: names(&["c"]),
                copy: true,
                completed: names(&["c"]),
                emit: true,
            }
        );
    }

    #[test]
    fn a_missing_column_waits_and_a_settled_one_completes_without_values() {
        let writer = writer_waiting_for_c();
        let plan = plan_read(&job(&writer, &[]), &names(&["id", "name"]));
        assert_eq!(plan.waiting, names(&["c"]));
        assert!(!plan.emit, "nothing to produce while it waits");
        let plan = plan_read(&job(&writer, &["c"]), &names(&["id", "name"]));
        assert!(plan.waiting.is_empty());
        assert!(!plan.copy);
        assert_eq!(plan.completed, names(&["c"]));
        assert!(plan.emit);
    }

    #[test]
    fn without_the_table_upstream_nothing_can_be_matched_and_everything_waits() {
        let writer = writer_waiting_for_c();
        let plan = plan_read(&job(&writer, &[]), &[]);
        assert_eq!(plan.waiting, names(&["id", "c"]));
        assert!(!plan.emit);
        let plan = plan_read(&job(&writer, &["id", "c"]), &[]);
        assert_eq!(plan.completed, names(&["c"]));
        assert!(plan.emit && !plan.copy);
    }
}
