//! Getting upstream and the replica ready to stream, for `highwater replicate` and `highwater
//! serve` alike: upstream checks, the publication and the DDL event trigger, and a fresh initial
//! sync from a new slot when the replica is missing, stale, or its slot is gone.

use std::path::Path;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio_postgres::Client;

use super::initial_sync::{initial_sync_with, SyncError, SyncOptions, SyncReport, SyncSource};
use super::published_schema::event_trigger_sql;
use super::setup::{
    check_upstream, ensure_publication, slot_state, ReplicationNames, UpstreamSettings,
};
use super::{ConnectParams, ReplicationConnection, ReplicationError, StreamConfig};
use crate::replica::{Replica, ReplicaError, ReplicaState};

/// Why upstream or the replica could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(transparent)]
    Replication(#[from] ReplicationError),
    #[error("upstream query failed: {}", crate::replication::PgErrorText(.0))]
    Postgres(#[from] tokio_postgres::Error),
    #[error("cannot install the DDL event trigger: {}", crate::replication::PgErrorText(.0))]
    DdlTrigger(tokio_postgres::Error),
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error("initial sync failed: {0}")]
    Sync(#[from] SyncError),
    #[error(
        "Replication slot {slot} is missing or invalidated, so upstream no longer holds the changes \
         after the replica's position {position}. Restart with --auto-reset to discard the replica \
         in {data} and sync again from a new slot (subscribers then resync too)."
    )]
    SlotLost {
        slot: String,
        position: String,
        data: String,
    },
}

/// Upstream, checked and set up for one app: its names, publications and a query connection.
pub struct Upstream {
    pub params: ConnectParams,
    pub names: ReplicationNames,
    pub app_id: String,
    pub publications: Vec<String>,
    pub settings: UpstreamSettings,
    client: Client,
}

impl Upstream {
    /// Connects to `url`, checks the server, creates the default publication (`<app>_pub`, FOR
    /// ALL TABLES) when `publications` is empty, and installs the DDL event trigger (a
    /// superuser only).
    pub fn prepare(
        handle: &Handle,
        url: &str,
        app_id: &str,
        publications: &[String],
    ) -> Result<Upstream, BootstrapError> {
        let params: ConnectParams = url.parse()?;
        let names = ReplicationNames::for_app(app_id)?;
        let (client, connection) = handle.block_on(params.upstream().connect())?;
        handle.spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "upstream query connection ended");
            }
        });
        let settings = handle.block_on(check_upstream(&client))?;
        let publications = if publications.is_empty() {
            handle.block_on(ensure_publication(&client, &names.publication, None))?;
            vec![names.publication.clone()]
        } else {
            publications.to_vec()
        };
        install_ddl_trigger(handle, &client, app_id)?;
        Ok(Upstream {
            params,
            names,
            app_id: app_id.to_owned(),
            publications,
            settings,
            client,
        })
    }

    /// Why `replica` must be synced again, or `None` when it can resume streaming.
    pub fn resync_reason(
        &self,
        handle: &Handle,
        replica: &Replica,
    ) -> Result<Option<String>, BootstrapError> {
        let Some(state) = replica.state() else {
            return Ok(Some("the replica has not been synced".to_owned()));
        };
        Ok(
            match handle.block_on(slot_state(&self.client, &state.slot))? {
                Some(slot) if !slot.is_invalidated() => (state.publications != self.publications)
                    .then(|| {
                        format!(
                            "the replica was synced from publications {:?}, not {:?}",
                            state.publications, self.publications
                        )
                    }),
                _ => Some(format!(
                    "replication slot {} is missing or invalidated",
                    state.slot
                )),
            },
        )
    }

    /// Refuses to go on when `replica` was synced but its slot is gone, unless `auto_reset`:
    /// resyncing then discards the replica, which an operator must opt into.
    pub(crate) fn check_slot(
        &self,
        handle: &Handle,
        replica: &Replica,
        data: &Path,
        auto_reset: bool,
    ) -> Result<(), BootstrapError> {
        let Some(state) = replica.state() else {
            return Ok(());
        };
        let lost = match handle.block_on(slot_state(&self.client, &state.slot))? {
            Some(slot) => slot.is_invalidated(),
            None => true,
        };
        if !lost {
            return Ok(());
        }
        if auto_reset {
            tracing::warn!(slot = %state.slot, "slot missing or invalidated; --auto-reset resyncs");
            return Ok(());
        }
        Err(BootstrapError::SlotLost {
            slot: state.slot.clone(),
            position: state.lsn.to_string(),
            data: data.display().to_string(),
        })
    }

    /// Replaces the replica in `data` (closing `replica` first) with an initial sync from a new
    /// slot's snapshot, copied by `options.workers` readers. `stop` is polled between batches
    /// ([`SyncError::Stopped`]).
    pub fn resync(
        &self,
        handle: &Handle,
        replica: Replica,
        data: &Path,
        options: &SyncOptions,
        stop: &dyn Fn() -> bool,
    ) -> Result<(Replica, SyncReport), BootstrapError> {
        drop(replica);
        Replica::remove_in_dir(data)?;
        let mut replica = Replica::open_in_dir(data)?;
        drop_slot(handle, &self.client, &self.names.slot)?;
        let mut conn = handle.block_on(ReplicationConnection::connect(&self.params))?;
        let created = handle.block_on(conn.create_slot_with_snapshot(&self.names.slot))?;
        let source = SyncSource {
            publications: self.publications.clone(),
            slot: self.names.slot.clone(),
            app_id: self.app_id.clone(),
            consistent_point: created.consistent_point,
            snapshot_name: created.snapshot_name.clone(),
        };
        let started = Instant::now();
        let report = initial_sync_with(
            handle,
            &self.client,
            Some(&self.params.upstream()),
            &mut replica,
            &source,
            options,
            stop,
        )?;
        // The snapshot was only needed for the copy.
        let _ = handle.block_on(conn.close());
        tracing::info!(
            tables = report.tables,
            rows = report.rows,
            replica_version = %report.replica_version,
            elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            "initial sync complete"
        );
        Ok((replica, report))
    }

    /// Streaming from the replica's position.
    pub fn stream_config(&self, state: &ReplicaState) -> StreamConfig {
        let mut config = StreamConfig::new(
            self.params.clone(),
            &state.slot,
            &self.publications,
            state.lsn,
        );
        config.wal_sender_timeout = self.settings.wal_sender_timeout;
        config
    }
}

fn install_ddl_trigger(
    handle: &Handle,
    client: &Client,
    app_id: &str,
) -> Result<(), BootstrapError> {
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
        .map_err(BootstrapError::DdlTrigger)
}

/// Drops `slot`, ending the walsender that holds it.
fn drop_slot(handle: &Handle, client: &Client, slot: &str) -> Result<(), BootstrapError> {
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
