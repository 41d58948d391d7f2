//! The ingest thread: takes upstream events into the streamer and carries out the storage
//! queue in order — each upstream transaction applied to the replica and appended to the change
//! log in one SQLite transaction, then reported durable (which releases the upstream ack) — and
//! starts catch-up reads once every store before them is committed.
//!
//! Backfills (`replica::backfill`) are a second source of transactions. Between upstream
//! transactions, once everything before is stored, the thread starts the backfill the replica
//! waits for and takes its messages instead of upstream's until its commit: forwarded, stored
//! and (being `skipAck`) never acknowledged upstream, like any other transaction.

use std::path::PathBuf;
use std::sync::Arc;

use highwater_engine::change_stream::{DownstreamMessage, Rollback};
use highwater_engine::streamer::{ConnId, LogOp, StoredChange};
use highwater_engine::watermark::{Lsn, Watermark};
use rusqlite::Connection;
use tokio::runtime::Handle;
use tokio::sync::{mpsc, watch};

use super::hub::{Hub, StorageOp};
use super::source::SourceEvent;
use super::ServeError;
use crate::change_log::{self, CatchupLimits, CatchupReader};
use crate::replica::backfill::{
    BackfillItem, BackfillPlanner, BackfillStream, RecentXids, BACKFILL_BATCH_ROWS,
};
use crate::replica::ddl::{in_publications, parse_ddl_event, schema_changes};
use crate::replica::initial_sync::SyncError;
use crate::replica::{Applied, ReplicaWriter};

pub(crate) struct Ingest {
    hub: Arc<Hub>,
    writer: ReplicaWriter,
    db_path: PathBuf,
    publications: Vec<String>,
    handle: Handle,
    /// Inside an upstream transaction that is already stored (sent again after a restart).
    skipping: bool,
    /// A purge that came in mid-transaction, run at the next commit.
    pending_purge: Option<Watermark>,
    catchup_limits: CatchupLimits,
    /// Backfills read from Postgres; `None` when the source streams its own (a relay).
    backfills: Option<Backfills>,
    /// Scope sync: where committed feed entries go; `None` when `/sync` is off.
    sync: Option<SyncFeed>,
}

/// Scope sync's side of the ingest thread: route each commit's feed entries after the commit,
/// and prune exits older than the retention window now and then.
pub(crate) struct SyncFeed {
    hub: Arc<super::sync::SyncHub>,
    retention: std::time::Duration,
    last_prune: Option<std::time::Instant>,
}

/// How often exits are pruned.
const PRUNE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

impl SyncFeed {
    pub fn new(hub: Arc<super::sync::SyncHub>, retention: std::time::Duration) -> SyncFeed {
        SyncFeed {
            hub,
            retention,
            last_prune: None,
        }
    }
}

/// The backfills this server reads itself.
pub(crate) struct Backfills {
    upstream: crate::replication::PgConfig,
    planner: BackfillPlanner,
    /// The one running, and its table.
    running: Option<(BackfillStream, String)>,
    /// Whether a backfill may be waiting: at startup and after every commit.
    due: bool,
    recent_xids: RecentXids,
}

impl Backfills {
    pub fn new(upstream: crate::replication::PgConfig) -> Backfills {
        Backfills {
            upstream,
            planner: BackfillPlanner::new(),
            running: None,
            due: true,
            recent_xids: RecentXids::default(),
        }
    }

    async fn next(&mut self) -> Option<Result<BackfillItem, SyncError>> {
        match &mut self.running {
            Some((stream, _)) => stream.next().await,
            None => std::future::pending().await,
        }
    }
}

// Lives for one loop step; boxing the common message variant would only add an allocation.
#[allow(clippy::large_enum_variant)]
enum Next {
    Stop,
    Op(StorageOp),
    Source(SourceEvent),
    Backfill(Option<Result<BackfillItem, SyncError>>),
    Resumed,
}

impl Ingest {
    pub fn new(
        hub: Arc<Hub>,
        writer: ReplicaWriter,
        db_path: PathBuf,
        publications: Vec<String>,
        handle: Handle,
        backfills: Option<Backfills>,
        sync: Option<SyncFeed>,
    ) -> Ingest {
        Ingest {
            hub,
            writer,
            db_path,
            publications,
            handle,
            skipping: false,
            pending_purge: None,
            catchup_limits: CatchupLimits::default(),
            backfills,
            sync,
        }
    }

    /// Hands the committed transaction's feed entries to scope sync, and prunes when due.
    fn route_committed(&mut self) -> Result<(), ServeError> {
        let changes = self.writer.take_committed();
        let Some(sync) = self.sync.as_mut() else {
            return Ok(());
        };
        if let Some(changes) = changes {
            sync.hub.committed(changes);
        }
        if sync
            .last_prune
            .is_none_or(|at| at.elapsed() >= PRUNE_INTERVAL)
        {
            sync.last_prune = Some(std::time::Instant::now());
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default();
            let cutoff = now.saturating_sub(sync.retention);
            let cutoff =
                crate::replica::feed::iso_from_ms(i64::try_from(cutoff.as_millis()).unwrap_or(0));
            let floor =
                crate::replica::feed::prune_exits(self.writer.replica().connection(), &cutoff)?;
            sync.hub.set_retention_floor(floor);
        }
        Ok(())
    }

    fn conn(&self) -> &Connection {
        self.writer.replica().connection()
    }

    /// Runs until `shutdown`, the source failing, or a storage error. Blocking.
    pub fn run(
        mut self,
        mut ops: mpsc::UnboundedReceiver<StorageOp>,
        mut events: mpsc::Receiver<SourceEvent>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), ServeError> {
        let mut paused = self.hub.upstream_paused();
        let result = loop {
            if let Err(e) = self.drain(&mut ops) {
                break Err(e);
            }
            if let Err(e) = self.start_backfill(&mut ops) {
                break Err(e);
            }
            let is_paused = *paused.borrow_and_update();
            let backfilling = self.backfills.as_ref().is_some_and(|b| b.running.is_some());
            let handle = self.handle.clone();
            let backfills = &mut self.backfills;
            let next = handle.block_on(async {
                tokio::select! {
                    biased;
                    _ = shutdown.wait_for(|s| *s) => Next::Stop,
                    op = ops.recv() => op.map_or(Next::Stop, Next::Op),
                    _ = paused.changed(), if is_paused => Next::Resumed,
                    // A running backfill is the only source until its commit.
                    item = async {
                        match backfills {
                            Some(b) => b.next().await,
                            None => std::future::pending().await,
                        }
                    }, if !is_paused && backfilling => Next::Backfill(item),
                    // A source that fails says so; one that just ends was stopped.
                    event = events.recv(), if !is_paused && !backfilling => {
                        event.map_or(Next::Stop, Next::Source)
                    }
                }
            });
            let step = match next {
                Next::Stop => break Ok(()),
                Next::Resumed => Ok(()),
                Next::Op(op) => self.execute(op),
                Next::Source(event) => self.on_source(event, &mut ops),
                Next::Backfill(item) => self.on_backfill(item),
            };
            if let Err(e) = step {
                break Err(e);
            }
        };
        // Whatever was in flight upstream is not stored; Postgres sends it again next time.
        self.hub.call(|s, _| s.upstream_ended());
        while let Ok(op) = ops.try_recv() {
            if matches!(op, StorageOp::Store(_)) {
                let _ = self.execute(op);
            }
        }
        if self.writer.in_transaction() {
            let _ = self
                .writer
                .apply(&DownstreamMessage::Rollback(Rollback::default()));
        }
        if let Err(error) = &result {
            tracing::error!(%error, "replication stopped");
        }
        result
    }

    /// Carries out every queued storage op.
    fn drain(&mut self, ops: &mut mpsc::UnboundedReceiver<StorageOp>) -> Result<(), ServeError> {
        while let Ok(op) = ops.try_recv() {
            self.execute(op)?;
        }
        Ok(())
    }

    fn on_source(
        &mut self,
        event: SourceEvent,
        ops: &mut mpsc::UnboundedReceiver<StorageOp>,
    ) -> Result<(), ServeError> {
        match event {
            SourceEvent::Message(message) => self.on_message(message),
            SourceEvent::Ddl(content) => {
                // Schema changes are computed against the replica as of the messages before.
                self.drain(ops)?;
                self.on_ddl(&content)
            }
            SourceEvent::Keepalive(watermark) => {
                if !self.skipping {
                    self.hub.call(|s, _| s.on_keepalive(watermark, true));
                }
                Ok(())
            }
            SourceEvent::Restarted => {
                self.skipping = false;
                if self.hub.inspect(|s| s.in_transaction()) {
                    self.hub.call(|s, _| s.upstream_ended());
                }
                Ok(())
            }
            SourceEvent::Failed(reason) => Err(ServeError::Source(reason)),
        }
    }

    /// Starts the next backfill the replica waits for, if one may run now: between
    /// transactions, with everything before it stored.
    fn start_backfill(
        &mut self,
        ops: &mut mpsc::UnboundedReceiver<StorageOp>,
    ) -> Result<(), ServeError> {
        let ready = self
            .backfills
            .as_ref()
            .is_some_and(|b| b.due && b.running.is_none());
        if !ready || self.skipping || self.hub.inspect(|s| s.in_transaction()) {
            return Ok(());
        }
        // The replica's schema and pending columns as of the last commit forwarded.
        self.drain(ops)?;
        let Some(backfills) = self.backfills.as_mut() else {
            return Ok(());
        };
        backfills.due = false;
        if !self.writer.replica().has_pending_backfills() {
            return Ok(());
        }
        let position = self.hub.inspect(|s| s.last_commit().clone());
        let xids = backfills.recent_xids.to_vec();
        let Some(job) = backfills.planner.next_job(
            self.writer.replica(),
            &position,
            &xids,
            BACKFILL_BATCH_ROWS,
        ) else {
            return Ok(());
        };
        tracing::info!(
            table = %job.table.name,
            columns = ?job.pending.columns,
            watermark = %job.commit_watermark,
            "backfilling"
        );
        let table = job.table.name.clone();
        let stream = BackfillStream::spawn(&self.handle, &backfills.upstream, job);
        backfills.running = Some((stream, table));
        Ok(())
    }

    fn on_backfill(
        &mut self,
        item: Option<Result<BackfillItem, SyncError>>,
    ) -> Result<(), ServeError> {
        let Some(backfills) = self.backfills.as_mut() else {
            return Ok(());
        };
        let table = backfills
            .running
            .as_ref()
            .map(|(_, table)| table.clone())
            .unwrap_or_default();
        let failure = match item {
            Some(Ok(BackfillItem::Message(message))) => {
                let commit = matches!(message, DownstreamMessage::Commit(_));
                self.on_message(message)?;
                if commit {
                    self.end_backfill();
                }
                return Ok(());
            }
            Some(Ok(BackfillItem::Missing { columns, snapshot })) => {
                tracing::info!(%table, ?columns, "columns to backfill are not upstream yet");
                backfills.planner.on_missing(&table, &columns, &snapshot);
                return Ok(());
            }
            Some(Err(error)) => Some(error.to_string()),
            None if self.hub.inspect(|s| s.in_transaction()) => {
                Some("the backfill ended before its commit".to_owned())
            }
            None => None,
        };
        if let Some(error) = failure {
            // Subscribers that saw its beginning get a rollback; nothing of it is stored.
            if self.hub.inspect(|s| s.in_transaction()) {
                self.on_message(DownstreamMessage::Rollback(Rollback::default()))?;
            }
            let position = self.hub.inspect(|s| s.last_commit().clone());
            tracing::warn!(%table, %error, "backfill failed; retrying after the next transaction");
            if let Some(backfills) = self.backfills.as_mut() {
                backfills.planner.on_failed(&table, &position);
            }
        }
        self.end_backfill();
        Ok(())
    }

    fn end_backfill(&mut self) {
        if let Some(backfills) = self.backfills.as_mut() {
            backfills.running = None;
            backfills.due = true;
        }
    }

    fn on_message(&mut self, message: DownstreamMessage) -> Result<(), ServeError> {
        if self.skipping {
            if matches!(
                message,
                DownstreamMessage::Commit(_) | DownstreamMessage::Rollback(_)
            ) {
                self.skipping = false;
            }
            return Ok(());
        }
        match &message {
            DownstreamMessage::Begin(begin) => {
                if let Some(backfills) = self.backfills.as_mut() {
                    backfills.recent_xids.note(begin);
                }
                let last = self.hub.inspect(|s| s.last_commit().clone());
                if begin.commit_watermark <= last {
                    // Stored before the stream restarted (acknowledged too late to be skipped
                    // by Postgres): nothing to forward or store.
                    tracing::debug!(watermark = %begin.commit_watermark, "skipping a transaction already stored");
                    self.skipping = true;
                    return Ok(());
                }
            }
            DownstreamMessage::Commit(commit) => {
                let end = commit
                    .extra
                    .get("commitEndLsn")
                    .and_then(serde_json::Value::as_str)
                    .and_then(|text| text.parse::<Lsn>().ok());
                if let Some(end) = end {
                    self.hub.note_commit_end(commit.watermark.clone(), end);
                }
                if let Some(backfills) = self.backfills.as_mut() {
                    backfills.due = true;
                }
            }
            _ => {}
        }
        let mut rejected = None;
        self.hub.call(|s, _| match s.on_upstream(message) {
            Ok(effects) => effects,
            Err(e) => {
                rejected = Some(e);
                Vec::new()
            }
        });
        match rejected {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    fn on_ddl(&mut self, content: &[u8]) -> Result<(), ServeError> {
        if !self.writer.in_transaction() {
            return Ok(());
        }
        let ddl = parse_ddl_event(content).map_err(|e| ServeError::Invariant {
            expected: "a DDL event as JSON".to_owned(),
            found: e.to_string(),
        })?;
        let tables = in_publications(ddl.schema, &self.publications);
        let changes = schema_changes(self.writer.replica(), &tables, &ddl.tag)?;
        for change in changes {
            tracing::info!(change = change.tag(), "schema change");
            self.on_message(DownstreamMessage::Data(change))?;
        }
        Ok(())
    }

    fn execute(&mut self, op: StorageOp) -> Result<(), ServeError> {
        match op {
            StorageOp::Store(LogOp::Begin(row)) => {
                let message = typed(&row)?;
                // Replica and log commit together, so the replica is never ahead of the log.
                if let Some(state) = self.writer.replica().state() {
                    if state.watermark >= *row.watermark() {
                        return Err(ServeError::Invariant {
                            expected: format!(
                                "a transaction after the replica's {}",
                                state.watermark
                            ),
                            found: format!("a transaction at {}", row.watermark()),
                        });
                    }
                }
                self.writer.apply(message)?;
                self.append(&row)?;
            }
            StorageOp::Store(LogOp::Append(row)) => {
                let message = typed(&row)?;
                self.writer.apply(message)?;
                self.append(&row)?;
                if let DownstreamMessage::Data(change) = message {
                    if !change.is_row_change() {
                        change_log::apply_cookie_ops(self.conn(), change)?;
                    }
                }
            }
            StorageOp::Store(LogOp::Commit(row)) => {
                let message = typed(&row)?;
                self.append(&row)?;
                change_log::commit(self.conn(), row.watermark())?;
                match self.writer.apply(message)? {
                    Applied::Committed { .. } => {}
                    other => {
                        return Err(ServeError::Invariant {
                            expected: format!("the commit of {} to be applied", row.watermark()),
                            found: format!("{other:?}"),
                        })
                    }
                }
                // Only now, durable, may the seqs reach scope subscribers.
                self.route_committed()?;
                let watermark = row.watermark().clone();
                self.hub.set_last_watermark(watermark.clone());
                self.hub.call(|s, _| s.on_stored(watermark));
                if let Some(below) = self.pending_purge.take() {
                    self.purge(&below)?;
                }
            }
            StorageOp::Store(LogOp::Abort) => {
                self.writer
                    .apply(&DownstreamMessage::Rollback(Rollback::default()))?;
            }
            StorageOp::FetchCatchup {
                conn,
                from,
                through,
            } => self.spawn_catchup(conn, from, through),
            StorageOp::Purge { below } => {
                if self.writer.in_transaction() {
                    self.pending_purge = Some(match self.pending_purge.take() {
                        Some(pending) if pending > below => pending,
                        _ => below,
                    });
                } else {
                    self.purge(&below)?;
                }
            }
            StorageOp::RestartUpstream { reason } => {
                // Postgres takes no backfill requests: the replica runs its own backfills, so a
                // restart could not re-request anything.
                tracing::warn!(%reason, "a subscriber needs backfills the Postgres source cannot re-request");
            }
        }
        Ok(())
    }

    fn append(&self, row: &StoredChange) -> Result<(), ServeError> {
        change_log::append(
            self.conn(),
            row.watermark(),
            row.pos(),
            row.tag(),
            row.change_json(),
        )?;
        Ok(())
    }

    fn purge(&mut self, below: &Watermark) -> Result<(), ServeError> {
        let report = change_log::purge(self.conn(), below)?;
        tracing::info!(
            %below,
            deleted = report.deleted,
            min_watermark = %report.min_watermark,
            "change log purged"
        );
        let min = report.min_watermark;
        self.hub.set_min_watermark(min.clone());
        self.hub.with(|s| s.on_purged(min));
        Ok(())
    }

    fn spawn_catchup(&self, conn: ConnId, from: Watermark, through: Watermark) {
        let Some(gate) = self.hub.catchup_gate(conn) else {
            return;
        };
        let job = Catchup {
            conn,
            from,
            through,
            gate,
        };
        self.handle.spawn(catch_up(
            self.hub.clone(),
            job,
            self.db_path.clone(),
            self.catchup_limits,
        ));
    }
}

/// The typed message of a row the streamer asked to store (always there for live messages).
fn typed(row: &StoredChange) -> Result<&DownstreamMessage, ServeError> {
    row.message().ok_or_else(|| ServeError::Invariant {
        expected: "a typed message to apply to the replica".to_owned(),
        found: format!(
            "only the stored text of {} at {}",
            row.tag(),
            row.watermark()
        ),
    })
}

struct Catchup {
    conn: ConnId,
    from: Watermark,
    through: Watermark,
    /// `true` while the streamer wants the read paused.
    gate: watch::Receiver<bool>,
}

/// Reads the change log for one subscriber and feeds it to the streamer, a batch at a time.
/// While the streamer holds the read paused (the subscriber's backlog, catch-up rows
/// included, is full) it waits as a task: no blocking thread and no SQLite read transaction
/// is held, each batch is read in a transaction of its own on a blocking thread.
async fn catch_up(hub: Arc<Hub>, mut job: Catchup, path: PathBuf, limits: CatchupLimits) {
    let conn = job.conn;
    let wanted =
        |hub: &Hub| hub.is_connected(conn) && hub.inspect(|s| s.subscriber(conn).is_some());
    let opened = tokio::task::spawn_blocking(move || CatchupReader::open(&path)).await;
    let mut reader = match opened {
        Ok(Ok(reader)) => reader,
        Ok(Err(error)) => {
            let reason = error.to_string();
            hub.call(|s, _| s.catchup_failed(conn, &reason));
            return;
        }
        Err(error) => {
            let reason = format!("the catch-up task failed: {error}");
            hub.call(|s, _| s.catchup_failed(conn, &reason));
            return;
        }
    };
    let mut after = None;
    loop {
        // Wait out a pause, holding nothing.
        loop {
            if !wanted(&hub) {
                return;
            }
            if !*job.gate.borrow_and_update() {
                break;
            }
            if job.gate.changed().await.is_err() {
                return;
            }
        }
        let (from, through) = (job.from.clone(), job.through.clone());
        let read = tokio::task::spawn_blocking(move || {
            let batch = reader.read_batch(&from, &through, after.as_ref(), limits);
            (reader, batch)
        })
        .await;
        let batch = match read {
            Ok((back, Ok(batch))) => {
                reader = back;
                batch
            }
            Ok((_, Err(error))) => {
                let reason = error.to_string();
                hub.call(|s, _| s.catchup_failed(conn, &reason));
                return;
            }
            Err(error) => {
                let reason = format!("the catch-up task failed: {error}");
                hub.call(|s, _| s.catchup_failed(conn, &reason));
                return;
            }
        };
        if !wanted(&hub) {
            return;
        }
        if !batch.rows.is_empty() {
            hub.call(|s, _| s.catchup_rows(conn, batch.rows));
        }
        match batch.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    if wanted(&hub) {
        hub.call(|s, _| s.catchup_done(conn));
    }
}
