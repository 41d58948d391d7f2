//! `highwater replicate`: keeps `<data>/replica.db` equal to the upstream publications.
//!
//! An empty (or never completed) replica is synced from a fresh slot's exported snapshot; a
//! synced one resumes from its stored position. Each upstream transaction is applied in one
//! SQLite transaction and acknowledged upstream only once committed, so a crash at any point
//! loses nothing and applies nothing twice. Ctrl-C / SIGTERM stop at the next message: a
//! transaction in progress is discarded (Postgres sends it again on the next start).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use highwater_engine::change_stream::{Change, DownstreamMessage};
use highwater_engine::pgoutput::{PgoutputEvent, PgoutputMapper};
use highwater_engine::watermark::Lsn;
use tokio::runtime::Handle;
use tokio::sync::watch;
use tokio_postgres::Client;

use crate::replication::PgConfig;

use crate::replica::backfill::{run_backfills, BackfillPlanner, RecentXids};
use crate::replica::bootstrap::{BootstrapError, Upstream};
use crate::replica::ddl::{
    ddl_prefix, in_publications, parse_ddl_event, relation_changes, schema_changes, RelationType,
    PRIMARY_KEY_SQL, RELATION_TYPES_SQL,
};
use crate::replica::initial_sync::SyncError;
use crate::replica::{Applied, Replica, ReplicaWriter};
use crate::replication::setup::DEFAULT_APP_ID;
use crate::replication::{WalEvent, WalStream};

/// Command-line arguments of `highwater replicate`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReplicateArgs {
    /// Upstream Postgres URL (`postgres://user[:password]@host:port/db`); the user needs the
    /// REPLICATION attribute, and a superuser to follow schema changes (event triggers).
    #[arg(long)]
    pub upstream: String,
    /// Directory of the replica (`<data>/replica.db`).
    #[arg(long)]
    pub data: PathBuf,
    /// Names the slot (`<app>_slot`), the default publication (`<app>_pub`) and the DDL trigger.
    #[arg(long, default_value = DEFAULT_APP_ID)]
    pub app_id: String,
    /// Publications to replicate; by default `<app>_pub`, created FOR ALL TABLES if missing.
    #[arg(long = "publication")]
    pub publications: Vec<String>,
    /// When the replication slot is missing or invalidated, discard the replica and sync again
    /// instead of stopping with an error.
    #[arg(long)]
    pub auto_reset: bool,
}

/// Runs the command until Ctrl-C or SIGTERM.
pub fn run(args: ReplicateArgs) -> anyhow::Result<()> {
    crate::runtime::init_tracing("info");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (stop_tx, stop) = watch::channel(false);
    runtime.spawn(async move {
        crate::runtime::wait_for_signal().await;
        tracing::info!("stopping: finishing the current message");
        let _ = stop_tx.send(true);
    });
    let handle = runtime.handle().clone();
    runtime.block_on(async move {
        tokio::task::spawn_blocking(move || replicate(&handle, &args, stop))
            .await
            .context("the replicator thread panicked")?
    })
}

/// An ordinary connection for catalog queries, reopened after upstream restarts.
struct Catalog {
    config: PgConfig,
    client: Option<Client>,
}

impl Catalog {
    fn client(&mut self, handle: &Handle) -> anyhow::Result<&Client> {
        if self.client.as_ref().is_none_or(Client::is_closed) {
            let (client, connection) = handle
                .block_on(self.config.connect())
                .context("cannot connect to the upstream Postgres")?;
            handle.spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "upstream query connection ended");
                }
            });
            self.client = Some(client);
        }
        self.client
            .as_ref()
            .context("the upstream connection is missing")
    }
}

/// Backfills between upstream transactions: what to run next, and the transactions the next
/// backfill's snapshot must see.
struct Backfills {
    upstream: PgConfig,
    planner: BackfillPlanner,
    recent_xids: RecentXids,
}

impl Backfills {
    fn run(&mut self, handle: &Handle, writer: &mut ReplicaWriter) -> Result<(), SyncError> {
        let xids = self.recent_xids.to_vec();
        run_backfills(handle, &self.upstream, writer, &mut self.planner, &xids)?;
        Ok(())
    }
}

/// Replicates until `stop` turns true. Blocking: run it on a blocking thread of `handle`'s
/// runtime.
pub fn replicate(
    handle: &Handle,
    args: &ReplicateArgs,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let upstream = Upstream::prepare(handle, &args.upstream, &args.app_id, &args.publications)?;
    let mut replica = Replica::open_in_dir(&args.data)?;
    upstream.check_slot(handle, &replica, &args.data, args.auto_reset)?;
    if let Some(reason) = upstream.resync_reason(handle, &replica)? {
        tracing::warn!(%reason, "resyncing");
        let stopped = stop.clone();
        replica = match upstream.resync(handle, replica, &args.data, &|| *stopped.borrow()) {
            Err(BootstrapError::Sync(SyncError::Stopped)) => {
                tracing::info!("stopped during the initial sync; the next start syncs again");
                return Ok(());
            }
            other => other?.0,
        };
    }

    let mut writer = ReplicaWriter::new(replica);
    let mut catalog = Catalog {
        config: upstream.params.upstream(),
        client: None,
    };
    let mut backfills = Backfills {
        upstream: upstream.params.upstream(),
        planner: BackfillPlanner::new(),
        recent_xids: RecentXids::default(),
    };
    // Pending since before a crash or a stop: recorded with the schema change that asked.
    backfills.run(handle, &mut writer)?;
    let state = writer
        .replica()
        .state()
        .context("the replica has no replication state after its initial sync")?
        .clone();
    let config = upstream.stream_config(&state);
    let publications = upstream.publications.clone();
    drop(upstream);
    let mut stream = {
        let _runtime = handle.enter();
        WalStream::spawn(config)
    };
    tracing::info!(
        slot = %state.slot,
        position = %state.lsn,
        watermark = %state.watermark,
        "streaming changes"
    );
    let result = stream_changes(
        handle,
        &mut catalog,
        &mut backfills,
        &mut writer,
        &mut stream,
        &publications,
        &args.app_id,
        &mut stop,
    );
    if writer.in_transaction() {
        // Not committed, so not acknowledged: Postgres sends it again next time.
        let _ = writer.apply(&DownstreamMessage::Rollback(Default::default()));
    }
    handle.block_on(stream.shutdown());
    if let Some(state) = writer.replica().state() {
        tracing::info!(position = %state.lsn, watermark = %state.watermark, "replicator stopped");
    }
    result
}

/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

// The replicator's whole state, passed down from `replicate`.
#[allow(clippy::too_many_arguments)]
fn stream_changes(
    handle: &Handle,
    catalog: &mut Catalog,
    backfills: &mut Backfills,
    writer: &mut ReplicaWriter,
    stream: &mut WalStream,
    publications: &[String],
    app_id: &str,
    stop: &mut watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let prefix = ddl_prefix(app_id);
    let mut mapper = PgoutputMapper::new();
    let mut commit_end: Option<Lsn> = None;
    let mut committed: u64 = 0;
    let mut last_report = Instant::now();
    loop {
        if *stop.borrow() {
            return Ok(());
        }
        let event = handle.block_on(async {
            tokio::select! {
                _ = stop.changed() => None,
                event = stream.recv() => Some(event),
            }
        });
        let Some(event) = event else {
            return Ok(());
        };
        let Some(event) = event else {
            bail!("the replication stream ended");
        };
        let bytes = match event? {
            WalEvent::Started { start, .. } => {
                tracing::debug!(%start, "replication session started");
                // Relation messages are sent again in a new session, and a partial
                // transaction will be sent again from its beginning.
                mapper = PgoutputMapper::new();
                if writer.in_transaction() {
                    writer.apply(&DownstreamMessage::Rollback(Default::default()))?;
                }
                continue;
            }
            WalEvent::CopyData(bytes) => bytes,
        };
        let Some(event) = mapper.map_frame(&bytes)? else {
            continue;
        };
        let event = match event {
            PgoutputEvent::Commit { commit, end_lsn } => {
                commit_end = Some(end_lsn);
                PgoutputEvent::Downstream(DownstreamMessage::Commit(commit))
            }
            other => other,
        };
        match event {
            PgoutputEvent::Downstream(message) => {
                if let DownstreamMessage::Begin(begin) = &message {
                    backfills.recent_xids.note(begin);
                }
                match writer.apply(&message)? {
                    Applied::Committed { lsn, .. } | Applied::Skipped { lsn, .. } => {
                        stream.ack(commit_end.take().unwrap_or(lsn).max(lsn));
                        committed += 1;
                        if writer.replica().has_pending_backfills() {
                            backfills.run(handle, writer)?;
                        }
                    }
                    Applied::Pending | Applied::RolledBack => {}
                }
            }
            PgoutputEvent::LogicalMessage(message) if message.prefix == prefix => {
                if !writer.in_transaction() {
                    continue;
                }
                let ddl = parse_ddl_event(&message.content)
                    .context("cannot parse a DDL event message")?;
                let tables = in_publications(ddl.schema, publications);
                let changes = schema_changes(writer.replica(), &tables, &ddl.tag)?;
                for change in changes {
                    log_schema_change(&change);
                    writer.apply(&DownstreamMessage::Data(change))?;
                }
            }
            PgoutputEvent::Keepalive(keepalive) => {
                // Between transactions everything received is durable: let the slot advance
                // over WAL that holds nothing for us.
                if !writer.in_transaction() && !mapper.in_transaction() {
                    stream.ack(keepalive.wal_end);
                }
            }
            // A replayed transaction shows the schema of its time, older than the replica's.
            PgoutputEvent::Relation { relation, .. } if !writer.replaying() => {
                reconcile_relation(handle, catalog, writer, &relation)?
            }
            PgoutputEvent::Relation { .. }
            | PgoutputEvent::LogicalMessage(_)
            | PgoutputEvent::Commit { .. } => {}
        }
        if last_report.elapsed() >= PROGRESS_EVERY {
            if let Some(state) = writer.replica().state() {
                tracing::info!(
                    transactions = committed,
                    position = %state.lsn,
                    "replicating"
                );
            }
            last_report = Instant::now();
        }
    }
}

fn log_schema_change(change: &Change) {
    tracing::info!(change = change.tag(), "applying schema change");
}

/// Creates what a Relation message shows but the replica lacks (see
/// `replica::ddl::relation_changes`), inside the open transaction, before its rows.
fn reconcile_relation(
    handle: &Handle,
    catalog: &mut Catalog,
    writer: &mut ReplicaWriter,
    relation: &highwater_engine::pgoutput::Relation,
) -> anyhow::Result<()> {
    let name = crate::replica::schema::replica_table_name(&relation.namespace, &relation.name);
    let known = writer.replica().table(&name).is_some_and(|table| {
        relation
            .columns
            .iter()
            .all(|c| table.column(&c.name).is_some())
    });
    if known || !writer.in_transaction() {
        return Ok(());
    }
    let client = catalog.client(handle)?;
    let oids: Vec<u32> = relation.columns.iter().map(|c| c.type_oid).collect();
    let types = handle
        .block_on(client.query(RELATION_TYPES_SQL, &[&oids]))?
        .iter()
        .map(|row| {
            Ok((
                row.try_get::<_, u32>(0)?,
                RelationType {
                    data_type: row.try_get(1)?,
                    typtype: row.try_get(2)?,
                    elem_typtype: row.try_get(3)?,
                },
            ))
        })
        .collect::<Result<HashMap<_, _>, tokio_postgres::Error>>()?;
    let key = if relation.replica_identity == highwater_engine::pgoutput::ReplicaIdentity::Full {
        let rows = handle.block_on(client.query(PRIMARY_KEY_SQL, &[&relation.oid]))?;
        Some(
            rows.iter()
                .map(|r| r.try_get(0))
                .collect::<Result<Vec<String>, _>>()?,
        )
    } else {
        None
    };
    for change in relation_changes(writer.replica(), relation, &types, key) {
        tracing::warn!(
            table = %name,
            change = change.tag(),
            "the replica learns of a table or column from the stream rather than from a DDL \
             event; it is backfilled"
        );
        writer.apply(&DownstreamMessage::Data(change))?;
    }
    Ok(())
}
