//! `highwater-bench ingest`: how fast committed Postgres changes become durable in the SQLite
//! replica, measured against `pg_recvlogical` streaming the same changes.
//!
//! Setup: a table of ~170-byte order rows and a publication for it; Highwater's replicator
//! (the real `replicate` code path, in this process: replication stream → `engine::pgoutput`
//! mapper → replica apply → durable SQLite commits, grouped while more is queued) does its
//! initial sync, which creates its slot; then a second pgoutput slot on the same publication is
//! created for `pg_recvlogical`. Both slots exist before the workload, so both see the same WAL.
//!
//! Phases: A is one transaction inserting `--rows` rows (`INSERT … SELECT generate_series`);
//! B is `--txns` single-row transactions sent from `--clients` connections with `--pipeline`
//! statements in flight each. Each phase ends with a transaction committed alone (see
//! `workload`), whose position tells when a consumer is through the phase.
//!
//! Modes:
//! - `catch-up` (default): after each phase has committed, `pg_recvlogical --endpos` runs over
//!   the phase's WAL until it exits (it fsyncs its file before exiting), then the replicator
//!   runs until the replica's stored position (`_hw_state`) covers the phase. The consumers
//!   never compete with each other or with the workload for CPU: this is pure decode and apply
//!   throughput on identical input. Times include each consumer's start-up.
//! - `live`: one consumer at a time streams while the workload runs, each on the same fresh
//!   database (table, publication and slot made anew, a checkpoint before the run):
//!   `pg_recvlogical` first, then Highwater. Each phase is timed from its start and from its
//!   last commit until the replica covers it, or until `pg_recvlogical`'s file ends with the
//!   phase's last commit (written, not yet fsynced: it fsyncs every 10 s).
//! - `live-shared`: both consumers stream the same run at once, so they also compete with
//!   each other (and with two WAL senders) for the machine's cores.
//!
//! MiB/s counts pgoutput payload bytes, the messages both consumers receive, as found in
//! `pg_recvlogical`'s output.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use highwater_engine::pgoutput::PgoutputMapper;
use highwater_engine::watermark::Lsn;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Config};

use super::common::{
    cpu_time, drop_bench_objects, peak_rss_kib, replica_row_count, reset_peak_rss, thousands,
    WorkDir,
};
use super::recvlogical::{self, last_commit, summarize, OutputSummary, RecvLogical};
use super::workload::{self, PhaseCommit, PUBLICATION};
use highwater_host::private_pg::{newest_bin_dir, PgOptions, PrivatePg};
use highwater_host::replicate::{replicate, ReplicateArgs, ReplicateError};
use highwater_host::replication::setup::ReplicationNames;
use highwater_host::replication::ConnectParams;

/// Names Highwater's slot (`hwbench_slot`), schema and DDL trigger.
const APP_ID: &str = "hwbench";
/// How often positions are polled; the timing resolution.
const POLL: Duration = Duration::from_millis(1);
/// Longest wait for a consumer to get through one phase, or to start.
const CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);
const START_TIMEOUT: Duration = Duration::from_secs(60);
const MIB: f64 = 1024.0 * 1024.0;

/// Settings of the private server: no autovacuum or checkpoints in the middle of a phase.
const SERVER_SETTINGS: &[(&str, &str)] = &[
    ("autovacuum", "off"),
    ("max_wal_size", "8GB"),
    ("checkpoint_timeout", "1h"),
    ("shared_buffers", "256MB"),
];

/// Command-line arguments of `highwater-bench ingest`.
#[derive(Debug, Clone, clap::Args)]
pub struct IngestArgs {
    /// Rows inserted by phase A's single transaction (0 skips the phase).
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    /// Single-row transactions of phase B (0 skips the phase).
    #[arg(long, default_value_t = 100_000)]
    pub txns: u64,
    /// Upstream Postgres URL (a superuser; wal_level=logical). By default a private server is
    /// started. The benchmark creates and finally drops its own table, publication, slots and
    /// `hwbench` schema there.
    #[arg(long)]
    pub upstream: Option<String>,
    /// `catch-up`: consumers run one after the other over each phase's committed WAL.
    /// `live`: each consumer streams while the workload runs, one run per consumer on the
    /// same fresh database. `live-shared`: both stream one run at once.
    #[arg(long, value_enum, default_value_t = Mode::CatchUp)]
    pub mode: Mode,
    /// Connections sending phase B's transactions.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Statements in flight per connection in phase B.
    #[arg(long, default_value_t = 16)]
    pub pipeline: usize,
    /// `live` only: runs of both consumers, alternating which goes first (pg_recvlogical in
    /// odd rounds), each pair reported on its own.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub rounds: u32,
    /// Directory for the replica and pg_recvlogical's output; by default a temporary one,
    /// removed afterwards.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    CatchUp,
    Live,
    LiveShared,
}

/// Runs the benchmark and prints its tables.
pub fn run(args: IngestArgs) -> anyhow::Result<()> {
    highwater_host::runtime::init_tracing("warn");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = runtime.block_on(ingest(&args))?;
    print!("{}", report.render());
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// A: one transaction, many rows.
    Bulk,
    /// B: many single-row transactions.
    SingleRow,
}

impl Phase {
    fn key(self) -> &'static str {
        match self {
            Phase::Bulk => "A",
            Phase::SingleRow => "B",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Consumer {
    Highwater,
    PgRecvlogical,
}

impl Consumer {
    fn name(self) -> &'static str {
        match self {
            Consumer::Highwater => "highwater",
            Consumer::PgRecvlogical => "pg_recvlogical",
        }
    }
}

#[derive(Debug, Clone)]
struct ConsumerResult {
    consumer: Consumer,
    /// Catch-up: from the consumer's start; live: from the phase start; until durable.
    elapsed: Duration,
    /// Live only: from the last commit returning to the client until durable.
    after_commit: Option<Duration>,
    /// Highwater only: this process's peak RSS over the phase (catch-up) or the run (live).
    peak_rss_kib: Option<u64>,
    /// Highwater in catch-up mode only: CPU time this process used meanwhile.
    cpu: Option<Duration>,
    /// Live modes only: when the phase's last commit returned, from the phase start, in the
    /// run this consumer streamed.
    committed: Option<Duration>,
}

#[derive(Debug, Clone)]
struct PhaseReport {
    phase: Phase,
    commit: PhaseCommit,
    /// What `pg_recvlogical` received for the phase.
    stream: OutputSummary,
    consumers: [ConsumerResult; 2],
    /// `live` only: the round, and the consumer that ran first in it.
    round: Option<(u32, Consumer)>,
}

#[derive(Debug, Clone)]
struct IngestReport {
    mode: Mode,
    server_version: String,
    clients: usize,
    pipeline: usize,
    phases: Vec<PhaseReport>,
    upstream_rows: u64,
    replica_rows: u64,
}

/// Everything a run needs to reach the upstream.
struct Upstream {
    url: String,
    config: Config,
    bin_dir: PathBuf,
}

async fn ingest(args: &IngestArgs) -> anyhow::Result<IngestReport> {
    // Kept until the end: dropping it stops the private server.
    let (_private, url) = match &args.upstream {
        Some(url) => (None, url.clone()),
        None => {
            let options = PgOptions {
                settings: SERVER_SETTINGS
                    .iter()
                    .map(|&(k, v)| (k.to_owned(), v.to_owned()))
                    .collect(),
                ..PgOptions::default()
            };
            let pg = PrivatePg::start(options).await?;
            let url = pg.url();
            (Some(pg), url)
        }
    };
    let params: ConnectParams = url.parse()?;
    let upstream = Upstream {
        config: params.query_config().clone(),
        url,
        bin_dir: newest_bin_dir()?,
    };
    let work = WorkDir::new(args.work_dir.as_deref(), "highwater-bench")?;
    let mut client = workload::connect(&upstream.config).await?;
    drop_objects(&client).await?;
    let result = tokio::select! {
        result = run_phases(args, &upstream, &mut client, &work) => result,
        // Dropping the run stops the consumers; the clean-up below still runs.
        _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted")),
    };
    // Slots left behind would retain WAL upstream forever: drop them whatever happened.
    let cleanup = drop_objects(&client).await;
    let report = result?;
    cleanup?;
    Ok(report)
}

async fn run_phases(
    args: &IngestArgs,
    upstream: &Upstream,
    client: &mut Client,
    work: &WorkDir,
) -> anyhow::Result<IngestReport> {
    // Live mode makes the table anew before each consumer's run.
    if args.mode != Mode::Live {
        workload::create_schema(client).await?;
    }
    let server_version: String = client
        .query_one("SHOW server_version", &[])
        .await?
        .try_get(0)?;
    let replicate_args = ReplicateArgs {
        upstream: upstream.url.clone(),
        data: work.replica_dir(),
        app_id: APP_ID.to_owned(),
        publications: vec![PUBLICATION.to_owned()],
        auto_reset: false,
        sync_workers: 2,
    };
    let mut phases = Vec::new();
    if args.rows > 0 {
        phases.push(Phase::Bulk);
    }
    if args.txns > 0 {
        phases.push(Phase::SingleRow);
    }
    if args.rounds > 1 && args.mode != Mode::Live {
        bail!("--rounds applies to --mode live only");
    }
    let mut checked_rows = None;
    let reports = match args.mode {
        Mode::CatchUp => {
            // Both slots before the workload, so both consumers read the same WAL.
            start_replicator(&replicate_args).await?.stop().await?;
            create_recvlogical_slot(client).await?;
            catch_up(args, upstream, client, work, &replicate_args, &phases).await?
        }
        Mode::LiveShared => {
            let highwater = start_replicator(&replicate_args).await?;
            create_recvlogical_slot(client).await?;
            let output = work.recvlogical_output("live")?;
            let run = stream_phases(
                args,
                upstream,
                client,
                Some(highwater),
                Some(&output),
                &phases,
            )
            .await?;
            let mut mapper = replicate_mapper();
            run.into_iter()
                .map(|phase| phase.report(&output, &mut mapper))
                .collect::<anyhow::Result<_>>()?
        }
        Mode::Live => {
            let (reports, rows) =
                live(args, upstream, client, work, &replicate_args, &phases).await?;
            checked_rows = Some(rows);
            reports
        }
    };
    // A live run checked each replica before the next run dropped the table.
    let (upstream_rows, replica_rows) = match checked_rows {
        Some(rows) => rows,
        None => check_rows(args, client, work).await?,
    };
    for report in &reports {
        let (rows, txns) = (report.commit.rows, report.commit.txns);
        // Other activity upstream may add empty transactions, never inserts.
        if report.stream.inserts != rows || report.stream.commits < txns {
            bail!(
                "expected pg_recvlogical to receive {rows} inserts in {txns} transactions in \
                 phase {}, got {} inserts in {} transactions",
                report.phase.key(),
                report.stream.inserts,
                report.stream.commits
            );
        }
    }
    Ok(IngestReport {
        mode: args.mode,
        server_version,
        clients: args.clients,
        pipeline: args.pipeline,
        phases: reports,
        upstream_rows,
        replica_rows,
    })
}

/// The rows upstream and in the replica, which must both be every row the phases wrote.
async fn check_rows(
    args: &IngestArgs,
    client: &Client,
    work: &WorkDir,
) -> anyhow::Result<(u64, u64)> {
    let upstream_rows = workload::row_count(client).await?;
    let replica_rows = replica_row_count(&work.replica_dir())?;
    if replica_rows != upstream_rows || upstream_rows != args.rows + args.txns {
        bail!(
            "expected {} rows upstream and in the replica, got {upstream_rows} upstream and \
             {replica_rows} in the replica",
            args.rows + args.txns
        );
    }
    Ok((upstream_rows, replica_rows))
}

/// Rounds of one live run per consumer, each on the same fresh database: `pg_recvlogical`
/// first in odd rounds, Highwater first in even ones. Every Highwater run's replica is checked
/// against the upstream before the next run drops the table; the last check's counts are
/// returned with the reports.
async fn live(
    args: &IngestArgs,
    upstream: &Upstream,
    client: &mut Client,
    work: &WorkDir,
    replicate_args: &ReplicateArgs,
    phases: &[Phase],
) -> anyhow::Result<(Vec<PhaseReport>, (u64, u64))> {
    let mut reports = Vec::new();
    let mut rows = (0, 0);
    for round in 1..=args.rounds {
        let output = work.recvlogical_output("live")?;
        let recvlogical_first = round % 2 == 1;
        let mut recv_run = None;
        let mut highwater_run = None;
        for recvlogical_turn in [recvlogical_first, !recvlogical_first] {
            fresh_database(client).await?;
            if recvlogical_turn {
                create_recvlogical_slot(client).await?;
                recv_run =
                    Some(stream_phases(args, upstream, client, None, Some(&output), phases).await?);
            } else {
                let replica = work.replica_dir();
                if replica.exists() {
                    std::fs::remove_dir_all(&replica)
                        .with_context(|| format!("cannot remove {}", replica.display()))?;
                }
                let highwater = start_replicator(replicate_args).await?;
                highwater_run = Some(
                    stream_phases(args, upstream, client, Some(highwater), None, phases).await?,
                );
                rows = check_rows(args, client, work).await?;
            }
        }
        let (Some(recv_run), Some(highwater_run)) = (recv_run, highwater_run) else {
            bail!("expected a run of each consumer in round {round}");
        };
        let first = if recvlogical_first {
            Consumer::PgRecvlogical
        } else {
            Consumer::Highwater
        };
        let mut mapper = replicate_mapper();
        for (mut phase, highwater) in recv_run.into_iter().zip(highwater_run) {
            phase.highwater = highwater.highwater;
            let mut report = phase.report(&output, &mut mapper)?;
            report.round = Some((round, first));
            reports.push(report);
        }
    }
    Ok((reports, rows))
}

async fn commit_phase(
    phase: Phase,
    args: &IngestArgs,
    upstream: &Upstream,
    client: &mut Client,
) -> anyhow::Result<PhaseCommit> {
    let first_bulk_id = 1;
    let first_single_id = i64::try_from(args.rows)? + 1;
    match phase {
        Phase::Bulk => workload::bulk_insert(client, first_bulk_id, args.rows).await,
        Phase::SingleRow => {
            workload::single_row_txns(
                &upstream.config,
                client,
                first_single_id,
                args.txns,
                args.clients,
                args.pipeline,
            )
            .await
        }
    }
}

/// Each phase: commit it, then `pg_recvlogical` through it, then the replicator through it.
async fn catch_up(
    args: &IngestArgs,
    upstream: &Upstream,
    client: &mut Client,
    work: &WorkDir,
    replicate_args: &ReplicateArgs,
    phases: &[Phase],
) -> anyhow::Result<Vec<PhaseReport>> {
    let mut reports = Vec::new();
    for &phase in phases {
        let commit = commit_phase(phase, args, upstream, client).await?;

        let output = work.recvlogical_output(phase.key())?;
        let started = Instant::now();
        RecvLogical::spawn(
            &upstream.bin_dir,
            &upstream.url,
            PUBLICATION,
            &output,
            Some(commit.wal_end),
        )?
        .wait()
        .await?;
        let recvlogical = ConsumerResult {
            consumer: Consumer::PgRecvlogical,
            elapsed: started.elapsed(),
            after_commit: None,
            peak_rss_kib: None,
            cpu: None,
            committed: None,
        };

        let rss_reset = reset_peak_rss();
        let cpu_before = cpu_time();
        let started = Instant::now();
        let mut replicator = Replicator::spawn(replicate_args);
        replicator
            .wait_for(commit.last_commit_floor, CONSUMER_TIMEOUT)
            .await?;
        let elapsed = started.elapsed();
        let cpu = match (cpu_before, cpu_time()) {
            (Some(before), Some(after)) => after.checked_sub(before),
            _ => None,
        };
        let highwater = ConsumerResult {
            consumer: Consumer::Highwater,
            elapsed,
            after_commit: None,
            peak_rss_kib: peak_rss_kib().filter(|_| rss_reset),
            cpu,
            committed: None,
        };
        replicator.stop().await?;

        let len = std::fs::metadata(&output)?.len();
        reports.push(PhaseReport {
            phase,
            commit,
            stream: summarize(&output, 0..len, &mut replicate_mapper())?,
            consumers: [highwater, recvlogical],
            round: None,
        });
    }
    Ok(reports)
}

/// Starts Highwater's replicator and waits for its initial sync, which creates its slot.
async fn start_replicator(args: &ReplicateArgs) -> anyhow::Result<Replicator> {
    let mut highwater = Replicator::spawn(args);
    let deadline = Instant::now() + START_TIMEOUT;
    while highwater.position().is_none() {
        highwater.check_running().await?;
        if Instant::now() > deadline {
            bail!("the replicator did not finish its initial sync in {START_TIMEOUT:?}");
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(highwater)
}

async fn create_recvlogical_slot(client: &Client) -> anyhow::Result<()> {
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&recvlogical::SLOT],
        )
        .await
        .context("cannot create the pg_recvlogical slot")?;
    Ok(())
}

/// The bench objects dropped and made anew, and a checkpoint, so that a run does not pay for
/// writing back the one before it.
async fn fresh_database(client: &Client) -> anyhow::Result<()> {
    drop_objects(client).await?;
    workload::create_schema(client).await?;
    client
        .batch_execute("CHECKPOINT")
        .await
        .context("cannot checkpoint the upstream (the benchmark needs a superuser)")?;
    Ok(())
}

/// One phase of a live run, for the consumers that streamed it.
struct LivePhase {
    phase: Phase,
    commit: PhaseCommit,
    highwater: Option<ConsumerResult>,
    /// `pg_recvlogical`'s result and the phase's bytes of its output.
    recvlogical: Option<(ConsumerResult, std::ops::Range<u64>)>,
}

impl LivePhase {
    /// The phase's report, once both consumers have a result; `mapper` has read the output's
    /// earlier phases, whose relation messages later ones do not repeat.
    fn report(
        self,
        output: &std::path::Path,
        mapper: &mut PgoutputMapper,
    ) -> anyhow::Result<PhaseReport> {
        let (Some(highwater), Some((recvlogical, bytes))) = (self.highwater, self.recvlogical)
        else {
            bail!("expected both consumers through phase {}", self.phase.key());
        };
        Ok(PhaseReport {
            phase: self.phase,
            stream: summarize(output, bytes, mapper)?,
            commit: self.commit,
            consumers: [highwater, recvlogical],
            round: None,
        })
    }
}

/// The given consumers stream throughout the phases (each already has its slot); each phase
/// is timed until every one of them is through it.
async fn stream_phases(
    args: &IngestArgs,
    upstream: &Upstream,
    client: &mut Client,
    mut highwater: Option<Replicator>,
    output: Option<&std::path::Path>,
    phases: &[Phase],
) -> anyhow::Result<Vec<LivePhase>> {
    let mut recv = output
        .map(|output| {
            RecvLogical::spawn(&upstream.bin_dir, &upstream.url, PUBLICATION, output, None)
        })
        .transpose()?;
    let mut slots = Vec::new();
    if highwater.is_some() {
        slots.push(ReplicationNames::for_app(APP_ID)?.slot);
    }
    if recv.is_some() {
        slots.push(recvlogical::SLOT.to_owned());
    }
    let consumers = i64::try_from(slots.len())?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let active: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = ANY($1) AND active",
                &[&slots],
            )
            .await?
            .try_get(0)?;
        if active == consumers {
            break;
        }
        check_consumers(&mut highwater, &mut recv).await?;
        if Instant::now() > deadline {
            bail!("the consumers did not start streaming in {START_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let rss_reset = highwater.is_some() && reset_peak_rss();
    let mut offset = 0;
    let mut run = Vec::new();
    for &phase in phases {
        let started = Instant::now();
        let commit = commit_phase(phase, args, upstream, client).await?;
        let floor = commit.last_commit_floor;
        let deadline = Instant::now() + CONSUMER_TIMEOUT;
        let mut highwater_done = None;
        let mut recv_done = None;
        while (highwater.is_some() && highwater_done.is_none())
            || (recv.is_some() && recv_done.is_none())
        {
            if highwater_done.is_none()
                && highwater
                    .as_mut()
                    .and_then(Replicator::position)
                    .is_some_and(|p| p >= floor)
            {
                highwater_done = Some(Instant::now());
            }
            if let (None, Some(output)) = (recv_done, output) {
                let (commit_lsn, len) = last_commit(output)?;
                if commit_lsn.is_some_and(|lsn| lsn >= floor) {
                    recv_done = Some((Instant::now(), len));
                }
            }
            check_consumers(&mut highwater, &mut recv).await?;
            if Instant::now() > deadline {
                bail!(
                    "the consumers did not get through phase {} in {CONSUMER_TIMEOUT:?}",
                    phase.key()
                );
            }
            tokio::time::sleep(POLL).await;
        }
        let result = |consumer, at: Instant| ConsumerResult {
            consumer,
            elapsed: at - started,
            after_commit: Some(at.saturating_duration_since(commit.committed_at)),
            peak_rss_kib: None,
            cpu: None,
            committed: Some(commit.elapsed),
        };
        let recvlogical = recv_done.map(|(at, end)| {
            let bytes = offset..end;
            offset = end;
            (result(Consumer::PgRecvlogical, at), bytes)
        });
        run.push(LivePhase {
            phase,
            highwater: highwater_done.map(|at| result(Consumer::Highwater, at)),
            recvlogical,
            commit,
        });
    }
    let peak = peak_rss_kib().filter(|_| rss_reset);
    for phase in &mut run {
        if let Some(highwater) = &mut phase.highwater {
            highwater.peak_rss_kib = peak;
        }
    }
    if let Some(recv) = recv {
        recv.stop().await?;
    }
    if let Some(highwater) = highwater {
        highwater.stop().await?;
    }
    Ok(run)
}

/// Fails if a consumer has stopped.
async fn check_consumers(
    highwater: &mut Option<Replicator>,
    recv: &mut Option<RecvLogical>,
) -> anyhow::Result<()> {
    if let Some(highwater) = highwater {
        highwater.check_running().await?;
    }
    if let Some(exit) = recv.as_mut().and_then(RecvLogical::exited) {
        bail!("{exit}");
    }
    Ok(())
}

/// Highwater's replicator running in this process on a blocking thread.
struct Replicator {
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), ReplicateError>>,
    db_path: PathBuf,
    db: Option<rusqlite::Connection>,
}

impl Replicator {
    fn spawn(args: &ReplicateArgs) -> Replicator {
        let (stop, stop_rx) = watch::channel(false);
        let handle = tokio::runtime::Handle::current();
        let args = args.clone();
        let db_path = args.data.join("replica.db");
        let task = tokio::task::spawn_blocking(move || replicate(&handle, &args, stop_rx));
        Replicator {
            stop,
            task,
            db_path,
            db: None,
        }
    }

    /// The replica's stored position, once the initial sync has stored one.
    fn position(&mut self) -> Option<Lsn> {
        if self.db.is_none() {
            if !self.db_path.exists() {
                return None;
            }
            self.db = rusqlite::Connection::open_with_flags(
                &self.db_path,
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY
                    | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .ok();
        }
        let text: Result<String, _> = self
            .db
            .as_ref()?
            .prepare_cached(r#"SELECT "lsn" FROM "_hw_state" WHERE "lock" = 1"#)
            .and_then(|mut statement| statement.query_row([], |row| row.get(0)));
        match text {
            Ok(text) => text.parse().ok(),
            Err(_) => {
                // The initial sync may replace the file: look again with a new connection.
                self.db = None;
                None
            }
        }
    }

    /// Fails if the replicator has stopped.
    async fn check_running(&mut self) -> anyhow::Result<()> {
        if !self.task.is_finished() {
            return Ok(());
        }
        match (&mut self.task).await {
            Ok(Ok(())) => Err(anyhow!("the replicator stopped unexpectedly")),
            Ok(Err(error)) => Err(anyhow::Error::new(error).context("the replicator failed")),
            Err(error) => Err(anyhow!("the replicator thread panicked: {error}")),
        }
    }

    /// Waits until the replica's stored position reaches `floor`.
    async fn wait_for(&mut self, floor: Lsn, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.position().is_some_and(|p| p >= floor) {
                return Ok(());
            }
            self.check_running().await?;
            if Instant::now() > deadline {
                bail!(
                    "the replica did not reach {floor} in {timeout:?} (it is at {:?})",
                    self.position()
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        drop(self.db);
        Ok(self
            .task
            .await
            .context("the replicator thread panicked")??)
    }
}

/// Drops the slots, the DDL trigger's schema, the table and the publication, if present.
async fn drop_objects(client: &Client) -> anyhow::Result<()> {
    drop_bench_objects(client, APP_ID, &[recvlogical::SLOT]).await
}

impl IngestReport {
    fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let method = match self.mode {
            Mode::CatchUp => {
                "catch-up: after each phase committed, pg_recvlogical then highwater read its \
                 retained WAL, one after the other; seconds from consumer start until durable"
            }
            Mode::Live => {
                "live: each consumer streams while the workload runs, one run each on the same \
                 fresh database; seconds from phase start until durable (pg_recvlogical: \
                 written to its file)"
            }
            Mode::LiveShared => {
                "live-shared: both consumers stream one run while the workload runs; seconds \
                 from phase start until durable (pg_recvlogical: written to its file)"
            }
        };
        let _ = writeln!(out, "highwater-bench ingest ({method})");
        let _ = writeln!(
            out,
            "Postgres {}; phase B from {} connections x {} pipelined statements\n",
            self.server_version, self.clients, self.pipeline
        );
        let _ = writeln!(
            out,
            "| Phase | Workload | Postgres commit time | WAL | pgoutput payload | Messages |"
        );
        let _ = writeln!(out, "|---|---|---:|---:|---:|---:|");
        for p in &self.phases {
            let _ = writeln!(
                out,
                "| {} | {} | {:.2} s | {:.1} MiB | {:.1} MiB | {} |",
                p.label(),
                workload_text(p),
                p.commit.elapsed.as_secs_f64(),
                p.commit.wal_bytes as f64 / MIB,
                p.stream.payload_bytes as f64 / MIB,
                thousands(p.stream.messages as f64),
            );
        }
        let _ = writeln!(
            out,
            "\n| Phase | Consumer | Rows | Txns | Seconds | Rows/s | MiB/s | Committed at \
             | After last commit | CPU | Peak RSS |"
        );
        let _ = writeln!(
            out,
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        let optional = |value: Option<String>| value.unwrap_or_else(|| "-".to_owned());
        for p in &self.phases {
            let rows = |name: &str, elapsed: Duration, c: Option<&ConsumerResult>| {
                let seconds = elapsed.as_secs_f64().max(1e-9);
                format!(
                    "| {} | {name} | {} | {} | {seconds:.3} | {} | {:.1} | {} | {} | {} | {} |\n",
                    p.label(),
                    thousands(p.commit.rows as f64),
                    thousands(p.commit.txns as f64),
                    thousands(p.commit.rows as f64 / seconds),
                    p.stream.payload_bytes as f64 / MIB / seconds,
                    optional(
                        c.and_then(|c| c.committed)
                            .map(|d| format!("{:.3} s", d.as_secs_f64()))
                    ),
                    optional(c.and_then(|c| c.after_commit).map(|d| {
                        if d < POLL {
                            // Already there at the first look: below the poll resolution.
                            format!("< {:.3} s", POLL.as_secs_f64())
                        } else {
                            format!("{:.3} s", d.as_secs_f64())
                        }
                    })),
                    optional(
                        c.and_then(|c| c.cpu)
                            .map(|d| format!("{:.2} s", d.as_secs_f64()))
                    ),
                    optional(
                        c.and_then(|c| c.peak_rss_kib)
                            .map(|kib| format!("{:.0} MiB", kib as f64 / 1024.0))
                    ),
                )
            };
            for c in &p.consumers {
                out.push_str(&rows(c.consumer.name(), c.elapsed, Some(c)));
            }
            out.push_str(&rows(
                "(pgoutput mapping alone, in memory)",
                p.stream.mapping,
                None,
            ));
        }
        let ratios: Vec<String> = self
            .phases
            .iter()
            .filter_map(|p| Some(format!("{} {:.2}", p.label(), p.throughput_ratio()?)))
            .collect();
        let _ = writeln!(
            out,
            "\nhighwater / pg_recvlogical throughput: {}\nrows: {} upstream, {} in the replica",
            ratios.join(", "),
            self.upstream_rows,
            self.replica_rows
        );
        out
    }
}

impl PhaseReport {
    /// The phase's key, with its live round and the consumer that ran first in it.
    fn label(&self) -> String {
        match self.round {
            Some((round, first)) => {
                format!(
                    "{} (round {round}, {} first)",
                    self.phase.key(),
                    first.name()
                )
            }
            None => self.phase.key().to_owned(),
        }
    }

    /// Highwater's rows/s over `pg_recvlogical`'s.
    fn throughput_ratio(&self) -> Option<f64> {
        let [highwater, recvlogical] = &self.consumers;
        let highwater = highwater.elapsed.as_secs_f64();
        (highwater > 0.0).then(|| recvlogical.elapsed.as_secs_f64() / highwater)
    }
}

/// The mapper as `replicate`'s session runs it: row values kept as text.
fn replicate_mapper() -> PgoutputMapper {
    let mut mapper = PgoutputMapper::new();
    mapper.keep_row_text();
    mapper
}

fn workload_text(p: &PhaseReport) -> String {
    match p.phase {
        Phase::Bulk => format!("1 txn x {} rows", thousands(p.commit.rows as f64)),
        Phase::SingleRow => format!("{} txns x 1 row", thousands(p.commit.txns as f64)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(mode: Mode, upstream: Option<String>) -> IngestArgs {
        IngestArgs {
            rows: 2_000,
            txns: 200,
            upstream,
            mode,
            clients: 2,
            pipeline: 8,
            rounds: 1,
            work_dir: None,
        }
    }

    /// Every round's two phases delivered every row to both consumers.
    fn assert_complete(report: &IngestReport, rounds: usize) {
        assert_eq!(report.replica_rows, 2_200);
        assert_eq!(report.upstream_rows, 2_200);
        let phases: Vec<_> = report.phases.iter().map(|p| p.phase).collect();
        assert_eq!(phases, [Phase::Bulk, Phase::SingleRow].repeat(rounds));
        for round in report.phases.chunks(2) {
            let [bulk, single] = round else {
                panic!("two phases expected");
            };
            assert_eq!((bulk.stream.inserts, bulk.stream.commits), (2_000, 1));
            assert_eq!((single.stream.inserts, single.stream.commits), (200, 200));
            assert!(bulk.stream.last_commit >= Some(bulk.commit.last_commit_floor));
            assert!(single.stream.last_commit >= Some(single.commit.last_commit_floor));
        }
        let table = report.render();
        assert_eq!(
            table.matches("| highwater |").count(),
            2 * rounds,
            "{table}"
        );
        assert_eq!(
            table.matches("| pg_recvlogical |").count(),
            2 * rounds,
            "{table}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tiny_catch_up_run_replicates_every_row_to_both_consumers() {
        let report = ingest(&tiny(Mode::CatchUp, None)).await.unwrap();
        assert_complete(&report, 1);
        assert!(report.phases[0].consumers[0].peak_rss_kib.is_some());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tiny_live_runs_on_an_upstream_leave_no_slots_behind() {
        let pg = PrivatePg::start(PgOptions::default()).await.unwrap();
        let client = pg.connect().await.unwrap();
        for (mode, rounds) in [(Mode::Live, 2), (Mode::LiveShared, 1)] {
            let args = IngestArgs {
                rounds,
                ..tiny(mode, Some(pg.url()))
            };
            let report = ingest(&args).await.unwrap();
            assert_complete(&report, rounds as usize);
            let firsts: Vec<_> = report.phases.iter().map(|p| p.round).collect();
            if mode == Mode::Live {
                use Consumer::{Highwater, PgRecvlogical};
                let expected = [
                    (1, PgRecvlogical),
                    (1, PgRecvlogical),
                    (2, Highwater),
                    (2, Highwater),
                ];
                assert_eq!(firsts, expected.map(Some));
            } else {
                assert_eq!(firsts, [None, None]);
            }
            for phase in &report.phases {
                for consumer in &phase.consumers {
                    assert!(consumer.after_commit.is_some(), "{mode:?}");
                    // A consumer may be through just before the commit returns to the client.
                    let committed = consumer.committed.expect("a live run's commit time");
                    assert!(committed > Duration::ZERO, "{mode:?}: {consumer:?}");
                }
            }
            let slots: i64 = client
                .query_one("SELECT count(*) FROM pg_replication_slots", &[])
                .await
                .unwrap()
                .get(0);
            assert_eq!(slots, 0, "{mode:?}");
            let tables: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_tables WHERE tablename = $1",
                    &[&workload::TABLE],
                )
                .await
                .unwrap()
                .get(0);
            assert_eq!(tables, 0, "{mode:?}");
        }
    }

    #[test]
    fn thousands_groups_digits() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1_000.0), "1,000");
        assert_eq!(thousands(1_234_567.8), "1,234,568");
    }
}
