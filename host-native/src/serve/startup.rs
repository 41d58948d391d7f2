//! Getting the replica and its change log ready before serving: upstream checks, the
//! publication and DDL trigger, and an initial sync when the replica is missing, stale, or its
//! change log cannot serve it.

use std::path::Path;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio_postgres::{Client, NoTls};

use super::{ServeArgs, ServeError};
use crate::change_log::{self, ChangeLogConfig, ChangeLogError, ChangeLogStatus};
use crate::replica::ddl::event_trigger_sql;
use crate::replica::initial_sync::{initial_sync, SyncSource, DEFAULT_BATCH_ROWS};
use crate::replica::{Replica, ReplicaWriter};
use crate::replication::setup::{check_upstream, ensure_publication, slot_state, ReplicationNames};
use crate::replication::{ConnectParams, ReplicationConnection, StreamConfig};

/// A replica ready to stream into.
pub(crate) struct Prepared {
    pub writer: ReplicaWriter,
    pub log: ChangeLogStatus,
    pub stream: StreamConfig,
    pub publications: Vec<String>,
}

/// Blocking: run on a blocking thread of `handle`'s runtime.
pub(crate) fn prepare(handle: &Handle, args: &ServeArgs) -> Result<Prepared, ServeError> {
    let params: ConnectParams = args.upstream.parse()?;
    let names = ReplicationNames::for_app(&args.app_id)?;
    let (client, connection) = handle.block_on(params.query_config().connect(NoTls))?;
    handle.spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "upstream query connection ended");
        }
    });
    let settings = handle.block_on(check_upstream(&client))?;
    let publications = if args.publications.is_empty() {
        handle.block_on(ensure_publication(&client, &names.publication, None))?;
        vec![names.publication.clone()]
    } else {
        args.publications.clone()
    };
    install_ddl_trigger(handle, &client, &args.app_id)?;

    let mut replica = Replica::open_in_dir(&args.data)?;
    let mut log = None;
    if !needs_resync(handle, &client, &replica, &publications)? {
        match ensure_log(&replica, &publications) {
            Ok(status) => log = Some(status),
            Err(ChangeLogError::ResetRequired { reason }) => {
                tracing::warn!(%reason, "resyncing");
            }
            Err(error) => return Err(error.into()),
        }
    }
    let log = match log {
        Some(log) => log,
        None => {
            drop(replica);
            remove_replica(&args.data)?;
            replica = Replica::open_in_dir(&args.data)?;
            drop_slot(handle, &client, &names.slot)?;
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
            let report = initial_sync(handle, &client, &mut replica, &source, DEFAULT_BATCH_ROWS)?;
            let _ = handle.block_on(conn.close());
            tracing::info!(
                tables = report.tables,
                rows = report.rows,
                replica_version = %report.replica_version,
                elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                "initial sync complete"
            );
            ensure_log(&replica, &publications)?
        }
    };
    let writer = ReplicaWriter::new(replica);
    let state = writer
        .replica()
        .state()
        .ok_or(crate::replica::ReplicaError::NotInitialized)?
        .clone();
    if !writer.pending_backfills().is_empty() {
        tracing::warn!(
            "the replica waits for backfills; serve does not stream backfills yet, so the \
             existing rows of those tables or columns stay hidden"
        );
    }
    let mut stream = StreamConfig::new(params, &state.slot, &publications, state.lsn);
    stream.wal_sender_timeout = settings.wal_sender_timeout;
    tracing::info!(
        slot = %state.slot,
        replica_version = %log.replica_version,
        watermark = %log.last_watermark,
        min_watermark = %log.min_watermark,
        "replica and change log ready"
    );
    Ok(Prepared {
        writer,
        log,
        stream,
        publications,
    })
}

/// The change log of a synced replica, reseeded if the replica is fresh.
fn ensure_log(
    replica: &Replica,
    publications: &[String],
) -> Result<ChangeLogStatus, ChangeLogError> {
    let Some(state) = replica.state() else {
        return Err(ChangeLogError::ResetRequired {
            reason: "the replica has not been synced".to_owned(),
        });
    };
    let config = ChangeLogConfig {
        replica_version: state.replica_version.clone(),
        publications: publications.to_vec(),
    };
    change_log::ensure(replica.connection(), &config, &state.watermark)
}

fn needs_resync(
    handle: &Handle,
    client: &Client,
    replica: &Replica,
    publications: &[String],
) -> Result<bool, ServeError> {
    let Some(state) = replica.state() else {
        return Ok(true);
    };
    match handle.block_on(slot_state(client, &state.slot))? {
        Some(slot) if !slot.is_invalidated() => {
            if state.publications != publications {
                tracing::warn!(
                    replica = ?state.publications,
                    requested = ?publications,
                    "the replica was synced from other publications; resyncing"
                );
                return Ok(true);
            }
            Ok(false)
        }
        _ => {
            tracing::warn!(slot = %state.slot, "replication slot is missing or invalidated; resyncing");
            Ok(true)
        }
    }
}

/// Removes the replica files so a new initial sync starts from nothing.
fn remove_replica(data: &Path) -> Result<(), ServeError> {
    for name in ["replica.db", "replica.db-wal", "replica.db-shm"] {
        let path = data.join(name);
        if path.exists() {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}

fn install_ddl_trigger(handle: &Handle, client: &Client, app_id: &str) -> Result<(), ServeError> {
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
    handle.block_on(client.batch_execute(&event_trigger_sql(app_id)))?;
    Ok(())
}

fn drop_slot(handle: &Handle, client: &Client, slot: &str) -> Result<(), ServeError> {
    let Some(state) = handle.block_on(slot_state(client, slot))? else {
        return Ok(());
    };
    if let Some(pid) = state.active_pid {
        handle.block_on(client.execute("SELECT pg_terminate_backend($1)", &[&pid]))?;
    }
    let mut attempt = 0;
    loop {
        match handle.block_on(client.execute("SELECT pg_drop_replication_slot($1)", &[&slot])) {
            Ok(_) => return Ok(()),
            // The terminated walsender may hold the slot for a moment longer.
            Err(_) if attempt < 49 => std::thread::sleep(Duration::from_millis(100)),
            Err(error) => return Err(error.into()),
        }
        attempt += 1;
    }
}
