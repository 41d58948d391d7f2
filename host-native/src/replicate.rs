//! `highwater replicate`: keeps `<data>/replica.db` equal to the upstream publications.
//!
//! An empty (or never completed) replica is synced from a fresh slot's exported snapshot; a
//! synced one resumes from its stored position. Each upstream transaction is applied in one
//! SQLite transaction and acknowledged upstream only once committed, so a crash at any point
//! loses nothing and applies nothing twice. Ctrl-C / SIGTERM stop at the next message: a
//! transaction in progress is discarded (Postgres sends it again on the next start).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use highwater_engine::change_stream::{Change, DownstreamMessage};
use highwater_engine::pgoutput::Relation;
use highwater_engine::upstream::{Input, UpstreamSession};
use highwater_engine::watermark::{Lsn, Watermark};
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::upstream::{backfill_item, feed, reconcile_relation, Backfills, Catalog, EffectHost};

use crate::replica::bootstrap::{BootstrapError, Upstream};
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
    let mut catalog = Catalog::new(upstream.params.upstream());
    // Backfills pending since before a crash or a stop (recorded with the schema change that
    // asked) start when the session first says one may.
    let mut backfills = Backfills::new(upstream.params.upstream());
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

/// What the replicator's loop carries effects out with: the upstream session's effect loop
/// without a hub, storing into the replica directly.
struct Replicator<'a> {
    session: UpstreamSession,
    handle: &'a Handle,
    catalog: &'a mut Catalog,
    backfills: &'a mut Backfills,
    writer: &'a mut ReplicaWriter,
    stream: &'a mut WalStream,
    publications: &'a [String],
    committed: u64,
}

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
    let state = writer
        .replica()
        .state()
        .context("the replica has no replication state")?
        .clone();
    let mut replicator = Replicator {
        session: crate::upstream::session(app_id, state.watermark, state.lsn),
        handle,
        catalog,
        backfills,
        writer,
        stream,
        publications,
        committed: 0,
    };
    let mut last_report = Instant::now();
    loop {
        if *stop.borrow() {
            return Ok(());
        }
        // The session says what it takes: a running backfill is the only source until its
        // commit.
        if replicator.session.backfill_running() {
            let item = handle.block_on(async {
                tokio::select! {
                    _ = stop.changed() => None,
                    item = replicator.backfills.next() => Some(item),
                }
            });
            let Some(item) = item else {
                return Ok(());
            };
            backfill_item(&mut replicator, item)?;
            continue;
        }
        let event = handle.block_on(async {
            tokio::select! {
                _ = stop.changed() => None,
                event = replicator.stream.recv() => Some(event),
            }
        });
        let Some(event) = event else {
            return Ok(());
        };
        let Some(event) = event else {
            bail!("the replication stream ended");
        };
        match event? {
            WalEvent::Started { start, .. } => {
                tracing::debug!(%start, "replication session started");
                feed(&mut replicator, Input::Started)?;
            }
            WalEvent::CopyData(bytes) => feed(&mut replicator, Input::WalData(&bytes))?,
        }
        if last_report.elapsed() >= PROGRESS_EVERY {
            if let Some(state) = replicator.writer.replica().state() {
                tracing::info!(
                    transactions = replicator.committed,
                    position = %state.lsn,
                    "replicating"
                );
            }
            last_report = Instant::now();
        }
    }
}

impl EffectHost for Replicator<'_> {
    type Error = anyhow::Error;

    fn session(&mut self) -> &mut UpstreamSession {
        &mut self.session
    }

    fn apply(&mut self, message: DownstreamMessage) -> anyhow::Result<Vec<Watermark>> {
        if let DownstreamMessage::Begin(begin) = &message {
            self.backfills.note(begin);
        }
        Ok(match self.writer.apply(&message)? {
            Applied::Committed { watermark, .. } => {
                self.committed += 1;
                vec![watermark]
            }
            Applied::Pending | Applied::RolledBack => Vec::new(),
        })
    }

    fn settle(&mut self) -> anyhow::Result<Vec<Watermark>> {
        // Every message is applied as it comes.
        Ok(Vec::new())
    }

    fn confirm(&mut self, lsn: Lsn) {
        self.stream.ack(lsn);
    }

    fn ack_frames(&mut self, _ids: Vec<u64>) {
        tracing::warn!("a Postgres source has no frames to acknowledge");
    }

    fn reconnect(&mut self, reason: String, _restore: bool, _acks: Vec<u64>) {
        tracing::warn!(%reason, "a Postgres source has no primary to reconnect to");
    }

    fn replica(&self) -> &Replica {
        self.writer.replica()
    }

    fn publications(&self) -> &[String] {
        self.publications
    }

    fn reconcile(&mut self, relation: &Relation) -> anyhow::Result<Vec<Change>> {
        Ok(reconcile_relation(
            self.handle,
            Some(&mut *self.catalog),
            self.writer.replica(),
            relation,
        )?)
    }

    fn idle(&mut self) {}

    fn backfills(&mut self) -> Option<(&mut Backfills, &Replica)> {
        Some((&mut *self.backfills, self.writer.replica()))
    }

    fn handle(&self) -> &Handle {
        self.handle
    }
}
