//! `highwater replicate`: keeps `<data>/replica.db` equal to the upstream publications.
//!
//! An empty (or never completed) replica is synced from a fresh slot's exported snapshot; a
//! synced one resumes from its stored position. Each upstream transaction is applied in one
//! SQLite transaction and acknowledged upstream only once committed, so a crash at any point
//! loses nothing and applies nothing twice. Ctrl-C / SIGTERM stop at the next message: a
//! transaction in progress is discarded (Postgres sends it again on the next start).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use highwater_engine::change_stream::{Change, DownstreamMessage};
use highwater_engine::pgoutput::{PgoutputEvent, PgoutputMapper};
use highwater_engine::watermark::Lsn;
use tokio::runtime::Handle;
use tokio::sync::watch;
use tokio_postgres::{Client, Config, NoTls};

use crate::replica::ddl::{
    ddl_prefix, event_trigger_sql, in_publications, parse_ddl_event, relation_changes,
    schema_changes, RelationType, PRIMARY_KEY_SQL, RELATION_TYPES_SQL,
};
use crate::replica::initial_sync::{
    initial_sync_until, run_backfills, SyncError, SyncSource, DEFAULT_BATCH_ROWS,
};
use crate::replica::{Applied, Replica, ReplicaWriter};
use crate::replication::setup::{
    check_upstream, ensure_publication, slot_state, ReplicationNames, DEFAULT_APP_ID,
};
use crate::replication::{ConnectParams, ReplicationConnection, StreamConfig, WalEvent, WalStream};

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
}

/// Runs the command until Ctrl-C or SIGTERM.
pub fn run(args: ReplicateArgs) -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (stop_tx, stop) = watch::channel(false);
    runtime.spawn(async move {
        wait_for_signal().await;
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

async fn wait_for_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

/// An ordinary connection for catalog queries, COPY and backfills, reopened after upstream
/// restarts.
struct Upstream {
    config: Config,
    client: Option<Client>,
}

impl Upstream {
    fn client(&mut self, handle: &Handle) -> anyhow::Result<&Client> {
        if self.client.as_ref().is_none_or(Client::is_closed) {
            let (client, connection) = handle
                .block_on(self.config.connect(NoTls))
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

/// Removes the replica files so a new initial sync starts from nothing.
fn remove_replica(data: &Path) -> anyhow::Result<()> {
    for name in ["replica.db", "replica.db-wal", "replica.db-shm"] {
        let path = data.join(name);
        if path.exists() {
            std::fs::remove_file(&path)
                .with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
}

/// Replicates until `stop` turns true. Blocking: run it on a blocking thread of `handle`'s
/// runtime.
pub fn replicate(
    handle: &Handle,
    args: &ReplicateArgs,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let params: ConnectParams = args.upstream.parse()?;
    let names = ReplicationNames::for_app(&args.app_id)?;
    let mut upstream = Upstream {
        config: params.query_config().clone(),
        client: None,
    };
    let client = upstream.client(handle)?;
    let settings = handle.block_on(check_upstream(client))?;
    let publications = if args.publications.is_empty() {
        handle.block_on(ensure_publication(client, &names.publication, None))?;
        vec![names.publication.clone()]
    } else {
        args.publications.clone()
    };
    install_ddl_trigger(handle, client, &args.app_id)?;

    let mut replica = Replica::open_in_dir(&args.data)?;
    let resync = match replica.state() {
        None => true,
        Some(state) => {
            let slot = handle.block_on(slot_state(client, &state.slot))?;
            match slot {
                Some(slot) if !slot.is_invalidated() => {
                    if state.publications != publications {
                        tracing::warn!(
                            replica = ?state.publications,
                            requested = ?publications,
                            "the replica was synced from other publications; resyncing"
                        );
                        true
                    } else {
                        false
                    }
                }
                _ => {
                    tracing::warn!(slot = %state.slot, "replication slot is missing or invalidated; resyncing");
                    true
                }
            }
        }
    };
    if resync {
        drop(replica);
        remove_replica(&args.data)?;
        replica = Replica::open_in_dir(&args.data)?;
        drop_slot(handle, client, &names.slot)?;
        let mut conn = handle.block_on(ReplicationConnection::connect(&params))?;
        let created = handle.block_on(conn.create_slot_with_snapshot(&names.slot))?;
        let source = SyncSource {
            publications: publications.clone(),
            slot: names.slot.clone(),
            app_id: args.app_id.clone(),
            consistent_point: created.consistent_point,
            snapshot_name: created.snapshot_name.clone(),
        };
        let started = Instant::now();
        let stopped = stop.clone();
        let report = match initial_sync_until(
            handle,
            client,
            &mut replica,
            &source,
            DEFAULT_BATCH_ROWS,
            &|| *stopped.borrow(),
        ) {
            Err(SyncError::Stopped) => {
                tracing::info!("stopped during the initial sync; the next start syncs again");
                return Ok(());
            }
            other => other?,
        };
        let _ = handle.block_on(conn.close());
        tracing::info!(
            tables = report.tables,
            rows = report.rows,
            replica_version = %report.replica_version,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "initial sync complete"
        );
    }

    let mut writer = ReplicaWriter::new(replica);
    run_backfills(
        handle,
        upstream.client(handle)?,
        &mut writer,
        DEFAULT_BATCH_ROWS,
        None,
    )?;
    let state = writer
        .replica()
        .state()
        .context("the replica has no replication state after its initial sync")?
        .clone();
    let mut config = StreamConfig::new(params.clone(), &state.slot, &publications, state.lsn);
    config.wal_sender_timeout = settings.wal_sender_timeout;
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
        &mut upstream,
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

fn install_ddl_trigger(handle: &Handle, client: &Client, app_id: &str) -> anyhow::Result<()> {
    let superuser: bool = handle
        .block_on(client.query_one(
            "SELECT rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        ))?
        .try_get(0)?;
    if !superuser {
        tracing::warn!(
            "the upstream user is not a superuser: no DDL event trigger, so schema changes \
             are not followed (a changed table stops replication until a resync)"
        );
        return Ok(());
    }
    handle
        .block_on(client.batch_execute(&event_trigger_sql(app_id)))
        .context("cannot install the DDL event trigger")?;
    Ok(())
}

fn drop_slot(handle: &Handle, client: &Client, slot: &str) -> anyhow::Result<()> {
    let Some(state) = handle.block_on(slot_state(client, slot))? else {
        return Ok(());
    };
    if let Some(pid) = state.active_pid {
        handle.block_on(client.execute("SELECT pg_terminate_backend($1)", &[&pid]))?;
    }
    for attempt in 0..50 {
        match handle.block_on(client.execute("SELECT pg_drop_replication_slot($1)", &[&slot])) {
            Ok(_) => return Ok(()),
            // The terminated walsender may hold the slot for a moment longer.
            Err(_) if attempt < 49 => std::thread::sleep(Duration::from_millis(100)),
            Err(error) => return Err(error).context("cannot drop the old replication slot"),
        }
    }
    Ok(())
}

/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

fn stream_changes(
    handle: &Handle,
    upstream: &mut Upstream,
    writer: &mut ReplicaWriter,
    stream: &mut WalStream,
    publications: &[String],
    app_id: &str,
    stop: &mut watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let prefix = ddl_prefix(app_id);
    let mut mapper = PgoutputMapper::new();
    let mut commit_end: Option<Lsn> = None;
    let mut xid: Option<u32> = None;
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
        match event {
            PgoutputEvent::Downstream(message) => {
                if let DownstreamMessage::Begin(begin) = &message {
                    xid = begin
                        .extra
                        .get("xid")
                        .and_then(serde_json::Value::as_u64)
                        .and_then(|x| u32::try_from(x).ok());
                }
                if let DownstreamMessage::Commit(commit) = &message {
                    commit_end = commit
                        .extra
                        .get("commitEndLsn")
                        .and_then(serde_json::Value::as_str)
                        .and_then(|text| text.parse().ok());
                }
                match writer.apply(&message)? {
                    Applied::Committed { lsn, .. } | Applied::Skipped { lsn, .. } => {
                        stream.ack(commit_end.take().unwrap_or(lsn).max(lsn));
                        committed += 1;
                        if !writer.pending_backfills().is_empty() {
                            let client = upstream.client(handle)?;
                            run_backfills(handle, client, writer, DEFAULT_BATCH_ROWS, xid)?;
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
                reconcile_relation(handle, upstream, writer, &relation)?
            }
            PgoutputEvent::Relation { .. } => {}
            PgoutputEvent::LogicalMessage(_) => {}
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
    upstream: &mut Upstream,
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
    let client = upstream.client(handle)?;
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
