//! `highwater-bench fanout`: how fast `highwater serve` delivers committed Postgres changes to
//! many change-stream subscribers at once, and how fast a subscriber far behind catches up
//! from the change log.
//!
//! Setup: a private Postgres and `highwater serve` in this process, on its own runtime and
//! threads, listening on a free port; the subscribers are real WebSocket clients on another
//! runtime, speaking `/replication/v8/subscribe` (or v6 `/changes` with `--protocol 6`). Every
//! subscriber acks every frame as soon as it has read it, and counts what it received: the
//! first subscriber of each level parses every frame in full, the others find the messages in
//! a frame by their tags and parse only the commits (the run fails unless each of them counts
//! every transaction and row, in order). They share the machine with the server and Postgres,
//! and a full parse by all of them was the largest use of CPU in a 100-subscriber run.
//!
//! Catch-up (first, so the change log holds exactly its load): `--catchup-rows` rows are
//! committed as transactions of `--catchup-txn-rows` rows each (by default 10,000 transactions
//! × 100 rows of ~100 bytes), and the server stores them all. Then one subscriber connects at
//! the replica version — that many changes behind — and is timed from the connect until it
//! has received the last transaction's commit: rows/s, and MiB/s of frame text.
//!
//! Fan-out, for each level N of `--subscribers`: N subscribers connect at the server's last
//! watermark, so they are live at once; once each has its first frame, `--txns` single-row
//! transactions (one ~100-byte INSERT each, autocommit) are sent from `--clients` connections,
//! each waiting for its commit before sending the next.
//! - delivered tx/s: transactions ÷ the time from the first INSERT sent until the last of the
//!   N subscribers has received the last commit;
//! - commit→subscriber latency, per (subscriber, transaction): the wall-clock time at which
//!   the subscriber read the frame carrying the commit, minus the transaction's commit
//!   timestamp as Postgres recorded it (`commitTime`, µs, from pgoutput). Both clocks are this
//!   machine's. p50 / p99 / max over all pairs;
//! - sent tx/s: transactions ÷ the time until Postgres' WAL sender had sent the server all the
//!   workload wrote (its `sent_lsn` in `pg_stat_replication` at the flush position read once the
//!   last commit returned, polled every 2 ms): what any consumer of the slot could have had, so
//!   the gap to delivered tx/s is the server's own;
//! - server µs/tx: CPU time of the server's threads over the level (Linux `schedstat`), per
//!   transaction;
//! - bench µs/tx: the same for the benchmark's own threads (the subscribers and the workload's
//!   Postgres clients). What Postgres used is the rest of the machine's.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context};
use futures::{FutureExt, SinkExt, StreamExt};
use highwater_engine::watermark::{Lsn, Watermark};
use serde::de::{IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch};
use tokio_postgres::Client;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use highwater_host::private_pg::{PgOptions, PrivatePg};
use highwater_host::serve::{serve, ServeArgs};

/// The benchmark table (schema `public`).
const TABLE: &str = "highwater_bench_fanout";
/// Longest wait for the server to start, store a load, or deliver a level.
const WAIT: Duration = Duration::from_secs(30 * 60);
/// Longest a subscriber waits for its next frame: a stalled stream fails the run.
const SILENCE: Duration = Duration::from_secs(120);
const MIB: f64 = 1024.0 * 1024.0;

/// Settings of the private server: no autovacuum or checkpoints in the middle of a run.
const SERVER_SETTINGS: &[(&str, &str)] = &[
    ("autovacuum", "off"),
    ("max_wal_size", "8GB"),
    ("checkpoint_timeout", "1h"),
    ("shared_buffers", "256MB"),
];

/// A ~100-byte row as a function of its id.
const ROW_SELECT: &str = "i, 'event ' || i || ' ' || md5(i::text) || ' ' || md5((i + 1)::text)";

/// Command-line arguments of `highwater-bench fanout`.
#[derive(Debug, Clone, clap::Args)]
pub struct FanoutArgs {
    /// Single-row transactions per fan-out level.
    #[arg(long, default_value_t = 20_000)]
    pub txns: u64,
    /// Fan-out levels: how many subscribers follow the stream at once, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 10, 100])]
    pub subscribers: Vec<usize>,
    /// Connections sending the fan-out transactions.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Pace the fan-out transactions at this many per second in total (0: as fast as the
    /// connections commit). Below the server's store rate, latency shows the pipeline rather
    /// than a queue.
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Rows the catch-up subscriber is behind (0 skips the catch-up run).
    #[arg(long, default_value_t = 1_000_000)]
    pub catchup_rows: u64,
    /// Rows per transaction of the catch-up load.
    #[arg(long, default_value_t = 100)]
    pub catchup_txn_rows: u64,
    /// Change-stream protocol of the subscribers: 8 (`/subscribe`, batch frames) or 6
    /// (`/changes`, one frame per message).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(6..=8))]
    pub protocol: u32,
    /// Where the server keeps its replica and change log during the run (in a subdirectory,
    /// removed afterwards); by default the system's temporary directory.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

impl FanoutArgs {
    fn catchup_txns(&self) -> u64 {
        self.catchup_rows.div_ceil(self.catchup_txn_rows.max(1))
    }
}

/// Runs the benchmark and prints its tables.
pub fn run(args: FanoutArgs) -> anyhow::Result<()> {
    highwater_host::runtime::init_tracing("warn");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(BENCH_THREADS)
        .enable_all()
        .build()?;
    let report = runtime.block_on(fanout(&args))?;
    print!("{}", report.render());
    Ok(())
}

/// What one fan-out level measured.
#[derive(Debug, Clone)]
pub struct LevelReport {
    pub subscribers: usize,
    pub txns: u64,
    /// From the first INSERT sent until the last commit returned.
    pub commit_elapsed: Duration,
    /// From the first INSERT sent until every subscriber had the last commit.
    pub delivered_elapsed: Duration,
    /// From the first INSERT sent until Postgres' WAL sender had sent the server everything
    /// the workload wrote (`pg_stat_replication.sent_lsn`, polled every 2 ms once the last
    /// commit returned); `None` if it did not get there within the wait.
    pub sent_elapsed: Option<Duration>,
    /// CPU time the server's threads used from just before the first INSERT until every
    /// subscriber had the last commit (Linux only: `None` elsewhere).
    pub server_cpu: Option<Duration>,
    /// CPU time the benchmark's own threads (`bench`: the subscribers and the workload's
    /// Postgres clients) used over the same span; `None` where it is not measured (Linux
    /// only, and only under `run`'s runtime).
    pub bench_cpu: Option<Duration>,
    /// Commits and rows each subscriber received, in subscriber order.
    pub received: Vec<(u64, u64)>,
    /// Commits received out of watermark order, over all subscribers (must be 0).
    pub out_of_order: u64,
    /// Message frames (single or batch) all subscribers received, and the messages in them.
    pub frames: u64,
    pub messages: u64,
    /// Commit→subscriber latencies in µs, sorted.
    pub latencies_us: Vec<u64>,
}

/// What the catch-up run measured.
#[derive(Debug, Clone)]
pub struct CatchupReport {
    pub rows: u64,
    pub txns: u64,
    pub received_rows: u64,
    pub received_commits: u64,
    pub out_of_order: u64,
    pub frame_bytes: u64,
    /// From the connect until the first row arrived.
    pub first_row: Duration,
    /// From the connect until the last commit arrived.
    pub elapsed: Duration,
}

/// Everything the benchmark measured.
#[derive(Debug, Clone)]
pub struct FanoutReport {
    pub protocol: u32,
    pub clients: usize,
    pub rate: u64,
    pub catchup_txn_rows: u64,
    pub catchup: Option<CatchupReport>,
    pub levels: Vec<LevelReport>,
}

/// Runs the whole benchmark: private Postgres, in-process server, catch-up, fan-out levels.
pub async fn fanout(args: &FanoutArgs) -> anyhow::Result<FanoutReport> {
    if args.subscribers.contains(&0) {
        bail!("expected subscriber counts of at least 1, found 0 in --subscribers");
    }
    let options = PgOptions {
        settings: SERVER_SETTINGS
            .iter()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        ..PgOptions::default()
    };
    let pg = PrivatePg::start(options).await?;
    let mut client = pg.connect().await?;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.{TABLE} (id bigint PRIMARY KEY, payload text NOT NULL) \
             WITH (autovacuum_enabled = false)"
        ))
        .await
        .context("cannot create the benchmark table")?;

    // A directory of its own per run: runs in one process (tests) must not share a replica.
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let work_dir = args
        .work_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!(
            "highwater-bench-fanout-{}-{run}",
            std::process::id()
        ));
    std::fs::create_dir_all(&work_dir)
        .with_context(|| format!("cannot create {}", work_dir.display()))?;
    let server = Server::start(&pg.url(), &work_dir).await;
    let result = match server {
        Ok(server) => {
            let result = measure(args, &pg, &mut client, &server).await;
            server.stop().await;
            result
        }
        Err(error) => Err(error),
    };
    let _ = std::fs::remove_dir_all(&work_dir);
    result
}

async fn measure(
    args: &FanoutArgs,
    pg: &PrivatePg,
    client: &mut Client,
    server: &Server,
) -> anyhow::Result<FanoutReport> {
    let replica_version = server.replica_version().await?;
    let mut next_id = 1i64;
    let catchup = if args.catchup_rows > 0 {
        let floor = catchup_load(pg, client, args, &mut next_id).await?;
        server.wait_stored(floor).await?;
        Some(catch_up(args, server.addr, &replica_version).await?)
    } else {
        None
    };
    let mut levels = Vec::with_capacity(args.subscribers.len());
    let mut last_commit = None;
    for &subscribers in &args.subscribers {
        // Each level starts where the last one's commits are all stored: a group the server
        // has not yet made durable would otherwise reach the new subscribers as extra
        // transactions.
        if let Some(last) = &last_commit {
            server.wait_stored(Watermark::to_lsn(last)?).await?;
        }
        let (level, last) =
            fan_out(args, pg, server, &replica_version, subscribers, next_id).await?;
        next_id += i64::try_from(args.txns)?;
        last_commit = last;
        levels.push(level);
    }
    Ok(FanoutReport {
        protocol: args.protocol,
        clients: args.clients.max(1),
        rate: args.rate,
        catchup_txn_rows: args.catchup_txn_rows.max(1),
        catchup,
        levels,
    })
}

// ---- the server ----

/// `highwater serve` on its own runtime.
struct Server {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    /// Taken on drop: a runtime may not be dropped (blocking) inside another one.
    runtime: Option<tokio::runtime::Runtime>,
    task: Option<tokio::task::JoinHandle<Result<(), highwater_host::serve::ServeError>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Server {
    async fn start(url: &str, data: &std::path::Path) -> anyhow::Result<Server> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut args = ServeArgs::new(url, data);
        args.port = port;
        args.host = "127.0.0.1".to_owned();
        // The catch-up subscriber connects after the server stored its load: keep the log.
        args.purge_delay_ms = 24 * 60 * 60 * 1000;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(SERVER_THREADS)
            .enable_all()
            .build()?;
        let (stop, stop_rx) = watch::channel(false);
        let task = runtime.spawn(serve(args, stop_rx));
        let mut server = Server {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            stop,
            runtime: Some(runtime),
            task: Some(task),
        };
        let deadline = Instant::now() + WAIT;
        while server.health().await.is_err() {
            if let Some(task) = server.task.take_if(|t| t.is_finished()) {
                let outcome = task.await;
                bail!("highwater serve stopped while starting: {outcome:?}");
            }
            if Instant::now() > deadline {
                bail!("highwater serve did not start within {WAIT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(server)
    }

    async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            match tokio::time::timeout(Duration::from_secs(30), task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(error))) => tracing::warn!(%error, "highwater serve failed"),
                Ok(Err(error)) => tracing::warn!(%error, "the server task failed"),
                Err(_) => tracing::warn!("highwater serve did not stop within 30 s"),
            }
        }
    }

    /// `GET /health` as JSON.
    async fn health(&self) -> anyhow::Result<serde_json::Value> {
        let mut stream = TcpStream::connect(self.addr).await?;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            .await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| anyhow!("expected an HTTP response, found no end of headers"))?;
        if !raw.starts_with(b"HTTP/1.1 200") {
            bail!(
                "expected 200 from /health, found {}",
                String::from_utf8_lossy(&raw[..split])
            );
        }
        Ok(serde_json::from_slice(&raw[split + 4..])?)
    }

    async fn watermark(&self, field: &str) -> anyhow::Result<Watermark> {
        let health = self.health().await?;
        let text = health[field]
            .as_str()
            .ok_or_else(|| anyhow!("expected {field} in /health, found {health}"))?;
        Ok(Watermark::parse(text)?)
    }

    async fn replica_version(&self) -> anyhow::Result<Watermark> {
        self.watermark("replicaVersion").await
    }

    /// Waits until the server stored every commit at or after `floor`.
    async fn wait_stored(&self, floor: Lsn) -> anyhow::Result<()> {
        let deadline = Instant::now() + WAIT;
        loop {
            if self.watermark("lastWatermark").await?.to_lsn()? >= floor {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the server did not store the load within {WAIT:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

// ---- workloads ----

/// Commits the catch-up load: `catchup_rows` rows in transactions of `catchup_txn_rows`, from
/// `clients` connections; the last transaction alone, after all others. Returns a position at
/// or below the last commit and above every earlier one.
async fn catchup_load(
    pg: &PrivatePg,
    client: &mut Client,
    args: &FanoutArgs,
    next_id: &mut i64,
) -> anyhow::Result<Lsn> {
    let per_txn = i64::try_from(args.catchup_txn_rows.max(1))?;
    let first = *next_id;
    let end = first + i64::try_from(args.catchup_rows)?;
    *next_id = end;
    let insert = format!(
        "INSERT INTO public.{TABLE} SELECT {ROW_SELECT} \
         FROM generate_series($1::int8, $2::int8) AS i"
    );
    let chunks: Vec<(i64, i64)> = (first..end)
        .step_by(usize::try_from(per_txn)?)
        .map(|start| (start, (start + per_txn).min(end) - 1))
        .collect();
    let Some((&last, rest)) = chunks.split_last() else {
        bail!("expected catch-up rows, found none");
    };
    let clients = args.clients.max(1);
    let mut connections = Vec::with_capacity(clients);
    for _ in 0..clients {
        let connection = pg.connect().await?;
        let statement = connection.prepare(&insert).await?;
        connections.push((connection, statement));
    }
    let workers = connections
        .iter()
        .enumerate()
        .map(|(n, (connection, statement))| {
            let mine: Vec<(i64, i64)> = rest.iter().skip(n).step_by(clients).copied().collect();
            async move {
                for (from, to) in mine {
                    connection.execute(statement, &[&from, &to]).await?;
                }
                Ok::<_, tokio_postgres::Error>(())
            }
        });
    futures::future::try_join_all(workers)
        .await
        .context("a catch-up insert failed")?;
    let txn = client.transaction().await?;
    txn.execute(&insert, &[&last.0, &last.1]).await?;
    let floor: String = txn
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .try_get(0)?;
    txn.commit().await?;
    Ok(floor.parse()?)
}

// ---- runs ----

async fn catch_up(
    args: &FanoutArgs,
    addr: SocketAddr,
    replica_version: &Watermark,
) -> anyhow::Result<CatchupReport> {
    let expected = Expected {
        commits: args.catchup_txns(),
        rows: args.catchup_rows,
    };
    let started = Instant::now();
    let (ready, _) = oneshot::channel();
    let received = follow(
        addr,
        args.protocol,
        "catchup".to_owned(),
        replica_version.clone(),
        replica_version.clone(),
        Received::reading(expected, Reading::Parse),
        ready,
    )
    .await?;
    let done = received
        .done
        .ok_or_else(|| anyhow!("the catch-up subscriber did not finish"))?;
    received.check(expected, "the catch-up subscriber")?;
    Ok(CatchupReport {
        rows: args.catchup_rows,
        txns: args.catchup_txns(),
        received_rows: received.rows,
        received_commits: received.commits,
        out_of_order: received.out_of_order,
        frame_bytes: received.frame_bytes,
        first_row: received.first_row.map_or(Duration::ZERO, |t| t - started),
        elapsed: done - started,
    })
}

async fn fan_out(
    args: &FanoutArgs,
    pg: &PrivatePg,
    server: &Server,
    replica_version: &Watermark,
    subscribers: usize,
    first_id: i64,
) -> anyhow::Result<(LevelReport, Option<Watermark>)> {
    let start = server.watermark("lastWatermark").await?;
    let expected = Expected {
        commits: args.txns,
        rows: args.txns,
    };
    let mut followers = Vec::with_capacity(subscribers);
    let mut readiness = Vec::with_capacity(subscribers);
    for n in 0..subscribers {
        let (ready, is_ready) = oneshot::channel();
        readiness.push(is_ready);
        followers.push(tokio::spawn(follow(
            server.addr,
            args.protocol,
            format!("fanout-{subscribers}-{n}"),
            replica_version.clone(),
            start.clone(),
            // One subscriber of the level parses every frame in full; the others scan.
            Received::reading(
                expected,
                if n == 0 {
                    Reading::Parse
                } else {
                    Reading::Scan
                },
            ),
            ready,
        )));
    }
    for is_ready in readiness {
        is_ready
            .await
            .map_err(|_| anyhow!("a subscriber ended before its first frame"))?;
    }
    let (go, go_rx) = watch::channel(false);
    let writer = tokio::spawn({
        let pg_url = pg.url();
        let clients = args.clients.max(1);
        let (txns, rate) = (args.txns, args.rate);
        async move { write_with(&pg_url, first_id, txns, clients, rate, go_rx).await }
    });
    let monitor = pg.connect().await?;
    // The writers are connected and prepared once they wait on `go`.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cpu_before = thread_cpu(SERVER_THREADS);
    let bench_before = thread_cpu(BENCH_THREADS);
    let started = Instant::now();
    go.send_replace(true);
    let committed = writer.await??;
    let sent = tokio::spawn(async move { wal_sent(&monitor).await });
    let mut received = Vec::with_capacity(subscribers);
    let mut latencies = Vec::new();
    let mut out_of_order = 0;
    let mut delivered = started;
    let mut last_commit = None;
    let (mut frames, mut messages) = (0, 0);
    for follower in followers {
        let r = follower.await??;
        let done = r
            .done
            .ok_or_else(|| anyhow!("a subscriber did not receive every transaction"))?;
        r.check(expected, "a fan-out subscriber")?;
        delivered = delivered.max(done);
        out_of_order += r.out_of_order;
        if let Some(commit) = &r.last_commit {
            last_commit = Some(Watermark::parse(commit)?);
        }
        received.push((r.commits, r.rows));
        frames += r.frames;
        messages += r.messages;
        latencies.extend(r.latencies_us);
    }
    let cpu_after = thread_cpu(SERVER_THREADS);
    let bench_after = thread_cpu(BENCH_THREADS);
    latencies.sort_unstable();
    let sent = sent.await??;
    let report = LevelReport {
        subscribers,
        txns: args.txns,
        commit_elapsed: committed.saturating_duration_since(started),
        delivered_elapsed: delivered.saturating_duration_since(started),
        sent_elapsed: sent.map(|sent| sent.saturating_duration_since(started)),
        server_cpu: cpu_before
            .zip(cpu_after)
            .map(|(before, after)| cpu_used(&before, &after)),
        bench_cpu: bench_before
            .zip(bench_after)
            .filter(|(_, after)| !after.is_empty())
            .map(|(before, after)| cpu_used(&before, &after)),
        received,
        out_of_order,
        frames,
        messages,
        latencies_us: latencies,
    };
    Ok((report, last_commit))
}

/// The name of the server's threads (its runtime, whose blocking threads include the ingest
/// thread).
const SERVER_THREADS: &str = "serve";
/// The name of the benchmark's own runtime's threads.
const BENCH_THREADS: &str = "bench";

/// CPU time so far of each of this process's threads named `name`, by thread id, from each
/// thread's `schedstat` (ns on CPU). The followers finish on another runtime, so this is read
/// once they are all done; a thread that ended in between is not counted.
fn thread_cpu(name: &str) -> Option<std::collections::HashMap<String, u64>> {
    let mut threads = std::collections::HashMap::new();
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path();
        let Ok(comm) = std::fs::read_to_string(path.join("comm")) else {
            continue; // ended since the listing
        };
        if comm.trim_end() != name {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(path.join("schedstat")) else {
            continue;
        };
        let ns = stat.split_whitespace().next()?.parse::<u64>().ok()?;
        threads.insert(path.file_name()?.to_string_lossy().into_owned(), ns);
    }
    Some(threads)
}

/// CPU the threads of `after` used since `before`, thread by thread: a thread that ended in
/// between (another server's, in a test process) takes nothing away, and one that started
/// counts in full.
fn cpu_used(
    before: &std::collections::HashMap<String, u64>,
    after: &std::collections::HashMap<String, u64>,
) -> Duration {
    let ns = after
        .iter()
        .map(|(tid, ns)| ns.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum();
    Duration::from_nanos(ns)
}

/// When Postgres' WAL sender had sent everything flushed so far: polls the server's
/// walsender's `sent_lsn` (the end of the last record it decoded and sent) every 2 ms until it
/// reaches the current flush position; `None` after 30 s without (the bench's server is the
/// only walsender). What the sender has sent is what any consumer of this slot could have by
/// now, so it tells the sender's lag from the server's own.
async fn wal_sent(monitor: &Client) -> anyhow::Result<Option<Instant>> {
    let flushed: String = monitor
        .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
        .await?
        .get(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    let poll = monitor
        .prepare(
            "SELECT coalesce(bool_or(sent_lsn >= $1::text::pg_lsn), false) \
             FROM pg_stat_replication",
        )
        .await?;
    while Instant::now() < deadline {
        let reached: bool = monitor.query_one(&poll, &[&flushed]).await?.get(0);
        if reached {
            return Ok(Some(Instant::now()));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(None)
}

/// Sends `txns` single-row transactions, ids `first ..`, from `clients` connections, each
/// waiting for its commit before the next (paced at `rate` per second in total, if not 0),
/// once `go` turns true. Returns when the last commit returned.
async fn write_with(
    url: &str,
    first: i64,
    txns: u64,
    clients: usize,
    rate: u64,
    go: watch::Receiver<bool>,
) -> anyhow::Result<Instant> {
    let connect = || async {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok::<_, tokio_postgres::Error>(client)
    };
    let insert =
        format!("INSERT INTO public.{TABLE} SELECT {ROW_SELECT} FROM (SELECT $1::int8 AS i) AS r");
    let mut connections = Vec::with_capacity(clients);
    for _ in 0..clients {
        let connection = connect().await?;
        let statement = connection.prepare(&insert).await?;
        connections.push((connection, statement));
    }
    let end = first + i64::try_from(txns)?;
    let mut go = go;
    go.wait_for(|g| *g).await?;
    let started = tokio::time::Instant::now();
    let workers = connections
        .iter()
        .enumerate()
        .map(|(n, (connection, statement))| async move {
            for id in (first..end).skip(n).step_by(clients) {
                if rate > 0 {
                    // Transaction k of the run is due at k / rate seconds.
                    let k = u64::try_from(id - first).unwrap_or_default();
                    let due = started + Duration::from_secs_f64(k as f64 / rate as f64);
                    tokio::time::sleep_until(due).await;
                }
                connection.execute(statement, &[&id]).await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        });
    futures::future::try_join_all(workers)
        .await
        .context("a single-row insert failed")?;
    Ok(Instant::now())
}

// ---- the subscriber ----

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// What a subscriber is done after.
#[derive(Debug, Clone, Copy)]
struct Expected {
    commits: u64,
    rows: u64,
}

/// What a subscriber received.
#[derive(Debug)]
struct Received {
    expected: Expected,
    reading: Reading,
    commits: u64,
    rows: u64,
    out_of_order: u64,
    frame_bytes: u64,
    /// Message frames (not acks) and the messages they carried.
    frames: u64,
    messages: u64,
    last_commit: Option<String>,
    latencies_us: Vec<u64>,
    first_row: Option<Instant>,
    /// When the expected commits and rows were all in.
    done: Option<Instant>,
}

impl Received {
    fn reading(expected: Expected, reading: Reading) -> Self {
        Received {
            expected,
            reading,
            commits: 0,
            rows: 0,
            out_of_order: 0,
            frame_bytes: 0,
            frames: 0,
            messages: 0,
            last_commit: None,
            latencies_us: Vec::new(),
            first_row: None,
            done: None,
        }
    }

    fn is_done(&self) -> bool {
        self.done.is_some()
    }

    /// Fails unless exactly the expected transactions and rows arrived, in order.
    fn check(&self, expected: Expected, who: &str) -> anyhow::Result<()> {
        if (self.commits, self.rows, self.out_of_order) != (expected.commits, expected.rows, 0) {
            bail!(
                "expected {who} to receive {} transactions with {} rows in order, found {} \
                 transactions with {} rows, {} out of order",
                expected.commits,
                expected.rows,
                self.commits,
                self.rows,
                self.out_of_order
            );
        }
        Ok(())
    }

    /// Takes one frame's text; returns the id to ack, if it has one.
    fn frame(&mut self, text: &str, now: Instant) -> anyhow::Result<Option<u64>> {
        self.frame_bytes += text.len() as u64;
        let frame: FrameLite = serde_json::from_str(text)
            .with_context(|| format!("expected a change-stream frame, found {text:.200}"))?;
        if frame.ack.is_some() {
            return Ok(None);
        }
        let received_us = unix_micros();
        self.frames += 1;
        for message in frame
            .msg
            .into_iter()
            .chain(frame.batch.into_iter().flatten())
        {
            self.messages += 1;
            match &*message.tag {
                "data" if message.inner_tag == "insert" => {
                    self.rows += 1;
                    self.first_row.get_or_insert(now);
                }
                "commit" => self.commit(message, received_us),
                "error" => bail!("the server sent an error: {text:.300}"),
                _ => {}
            }
        }
        self.finish(now);
        Ok(frame.id)
    }

    /// Counts a commit read at `received_us`: its latency, and whether it came in order.
    fn commit(&mut self, message: MessageLite, received_us: u64) {
        self.commits += 1;
        if let Some(commit_us) = message.commit_time_us {
            self.latencies_us
                .push(received_us.saturating_sub(commit_us));
        }
        if let Some(watermark) = message.watermark {
            match &mut self.last_commit {
                Some(last) => {
                    if **last >= *watermark {
                        self.out_of_order += 1;
                    }
                    // One buffer for the whole run.
                    last.clear();
                    last.push_str(&watermark);
                }
                None => self.last_commit = Some(watermark.into_owned()),
            }
        }
    }

    /// Notes when the expected commits and rows were all in.
    fn finish(&mut self, now: Instant) {
        let expected = self.expected;
        if self.done.is_none() && self.commits >= expected.commits && self.rows >= expected.rows {
            self.done = Some(now);
        }
    }
}

/// How a subscriber reads its frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// Parses every frame in full ([`Received::frame`]).
    Parse,
    /// Scans every frame for its messages' tags ([`Received::scan`]).
    Scan,
}

/// Message tags a scan counts, each as it opens a message tuple: `["<tag>",`.
const SCANNED_TAGS: [&str; 5] = ["begin", "data", "commit", "rollback", "status"];

impl Received {
    /// Takes one frame's text as [`Received::frame`] does, but finds its messages by their
    /// tags instead of parsing it: only commits are parsed (for their time and watermark).
    ///
    /// A hundred subscribers share the cores the server and Postgres run on, and a full parse
    /// of every frame made them the largest user of CPU in the run. A scan counts the same:
    /// `["` cannot occur inside a JSON string (a quote in one is escaped), so each match opens
    /// a JSON array, and an array of the benchmark's stream that starts with one of the tags
    /// and a comma is a message tuple (the table's columns are `id` and `payload`, so no key
    /// column list holds such a string). One subscriber per level parses in full, and the
    /// run fails unless every subscriber counts every transaction.
    fn scan(&mut self, text: &str, now: Instant) -> anyhow::Result<Option<u64>> {
        self.frame_bytes += text.len() as u64;
        if text.starts_with(r#"{"ack":"#) {
            return Ok(None);
        }
        let rest = text
            .strip_prefix(r#"{"id":"#)
            .with_context(|| format!("expected a frame starting with its id, found {text:.200}"))?;
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let id: u64 = rest[..digits]
            .parse()
            .with_context(|| format!("expected a frame id, found {text:.200}"))?;
        let body = &rest[digits..];
        let received_us = unix_micros();
        self.frames += 1;
        for at in memchr::memmem::find_iter(body.as_bytes(), br#"[""#) {
            let tuple = &body[at..];
            let Some(tag) = SCANNED_TAGS.iter().find(|tag| {
                tuple[2..].starts_with(*tag) && tuple[2 + tag.len()..].starts_with(r#"","#)
            }) else {
                if tuple.starts_with(r#"["error","#) {
                    bail!("the server sent an error: {text:.300}");
                }
                continue;
            };
            self.messages += 1;
            match *tag {
                "data" if tuple.starts_with(r#"["data",{"tag":"insert""#) => {
                    self.rows += 1;
                    self.first_row.get_or_insert(now);
                }
                "commit" => {
                    let commit = serde_json::Deserializer::from_str(tuple)
                        .into_iter::<MessageLite>()
                        .next()
                        .with_context(|| format!("expected a commit, found {tuple:.200}"))?
                        .with_context(|| format!("expected a commit, found {tuple:.200}"))?;
                    self.commit(commit, received_us);
                }
                _ => {}
            }
        }
        self.finish(now);
        Ok(Some(id))
    }

    /// Takes a frame the way this subscriber reads them.
    fn read(&mut self, text: &str, now: Instant) -> anyhow::Result<Option<u64>> {
        match self.reading {
            Reading::Parse => self.frame(text, now),
            Reading::Scan => self.scan(text, now),
        }
    }
}

fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// Subscribes at `watermark`, acks every frame, and follows until `expected` is in (or the
/// stream ends). `ready` fires at the first frame of the stream (the initial status).
async fn follow(
    addr: SocketAddr,
    protocol: u32,
    id: String,
    replica_version: Watermark,
    watermark: Watermark,
    mut received: Received,
    ready: oneshot::Sender<()>,
) -> anyhow::Result<Received> {
    let path = if protocol >= 7 {
        format!("/replication/v{protocol}/subscribe?taskID={id}")
    } else {
        format!(
            "/replication/v{protocol}/changes?id={id}&taskID={id}\
             &replicaVersion={replica_version}&watermark={watermark}"
        )
    };
    let (mut socket, _) = tokio::time::timeout(
        Duration::from_secs(30),
        tokio_tungstenite::connect_async_with_config(
            format!("ws://{addr}{path}"),
            // The subscribers share the server's 2 cores: a smaller read buffer spares them
            // tungstenite's zero-fill of 128 KiB before every read of a small frame.
            Some(WebSocketConfig::default().read_buffer_size(16 * 1024)),
            true,
        ),
    )
    .await
    .context("the WebSocket handshake timed out")?
    .context("the WebSocket handshake failed")?;
    if protocol >= 7 {
        let start = serde_json::json!({
            "id": 1,
            "msg": ["start-subscription", {
                "taskID": id, "id": id, "mode": "serving",
                "replicaVersion": replica_version.as_str(), "watermark": watermark.as_str(),
            }],
        });
        socket.send(Message::text(start.to_string())).await?;
    }
    let mut ready = Some(ready);
    let deadline = tokio::time::Instant::now() + WAIT;
    while !received.is_done() {
        let next = tokio::time::timeout_at(deadline, socket.next());
        let next = tokio::time::timeout(SILENCE, next)
            .await
            .with_context(|| format!("the subscriber got no frame for {SILENCE:?}"))?
            .context("the subscriber waited too long")?;
        let mut open = take(&mut socket, &mut received, &mut ready, next).await?;
        if !open {
            break;
        }
        // Take what already arrived before flushing the acks.
        while !received.is_done() {
            let Some(next) = socket.next().now_or_never() else {
                break;
            };
            open = take(&mut socket, &mut received, &mut ready, next).await?;
            if !open {
                break;
            }
        }
        socket.flush().await?;
        if !open {
            break;
        }
    }
    let _ = socket.close(None).await;
    Ok(received)
}

/// Takes one read from the socket, feeding the ack of a frame (flushed by the caller). Returns
/// whether the stream is still open.
async fn take(
    socket: &mut Socket,
    received: &mut Received,
    ready: &mut Option<oneshot::Sender<()>>,
    next: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>,
) -> anyhow::Result<bool> {
    let now = Instant::now();
    match next {
        Some(Ok(Message::Text(text))) => {
            if let Some(id) = received.read(text.as_str(), now)? {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(());
                }
                socket
                    .feed(Message::text(format!(r#"{{"ack":{id}}}"#)))
                    .await?;
            }
            Ok(true)
        }
        Some(Ok(Message::Close(frame))) => {
            tracing::warn!(?frame, "the server closed a benchmark subscriber");
            Ok(false)
        }
        Some(Ok(_)) => Ok(true),
        Some(Err(error)) => Err(error.into()),
        None => Ok(false),
    }
}

// ---- frame parsing ----

/// A frame, parsed only as far as the benchmark looks: the id, and per message its tags, the
/// commit's `commitTime` and watermark. Everything else is skipped without being kept, and the
/// strings kept are borrowed from the frame: a hundred subscribers parse every frame on the
/// cores the server and Postgres run on, so what they allocate is taken from what is measured.
#[derive(Deserialize)]
struct FrameLite<'a> {
    id: Option<u64>,
    ack: Option<u64>,
    #[serde(borrow)]
    msg: Option<MessageLite<'a>>,
    #[serde(borrow)]
    batch: Option<Vec<MessageLite<'a>>>,
}

struct MessageLite<'a> {
    tag: Cow<'a, str>,
    inner_tag: Cow<'a, str>,
    commit_time_us: Option<u64>,
    watermark: Option<Cow<'a, str>>,
}

/// A string borrowed from the frame when it has no escapes (tags and watermarks never do).
#[derive(Deserialize)]
struct Str<'a>(#[serde(borrow)] Cow<'a, str>);

#[derive(Deserialize)]
struct InnerLite<'a> {
    #[serde(default, borrow)]
    tag: Option<Str<'a>>,
    #[serde(rename = "commitTime")]
    commit_time: Option<u64>,
}

#[derive(Deserialize)]
struct WatermarkLite<'a> {
    #[serde(borrow)]
    watermark: Option<Str<'a>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for MessageLite<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Tuple;
        impl<'de> Visitor<'de> for Tuple {
            type Value = MessageLite<'de>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a change-stream message tuple [tag, object, …]")
            }

            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<MessageLite<'de>, A::Error> {
                let Str(tag) = seq
                    .next_element()?
                    .ok_or_else(|| serde::de::Error::invalid_length(0, &self))?;
                let inner: InnerLite = seq
                    .next_element()?
                    .ok_or_else(|| serde::de::Error::invalid_length(1, &self))?;
                let watermark = if tag == "commit" {
                    seq.next_element::<WatermarkLite>()?
                        .and_then(|w| w.watermark)
                        .map(|Str(w)| w)
                } else {
                    None
                };
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(MessageLite {
                    tag,
                    inner_tag: inner.tag.map_or(Cow::Borrowed(""), |Str(t)| t),
                    commit_time_us: inner.commit_time,
                    watermark,
                })
            }
        }
        deserializer.deserialize_seq(Tuple)
    }
}

// ---- the table ----

fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

fn millis(us: Option<u64>) -> String {
    us.map_or_else(
        || "-".to_owned(),
        |us| format!("{:.1} ms", us as f64 / 1000.0),
    )
}

/// CPU per transaction in µs, or `-` where it was not measured.
fn micros_per_tx(cpu: Option<Duration>, txns: u64) -> String {
    cpu.map_or_else(
        || "-".to_owned(),
        |cpu| format!("{:.1}", cpu.as_secs_f64() * 1e6 / txns.max(1) as f64),
    )
}

fn per_second(count: u64, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64().max(1e-9)
}

impl FanoutReport {
    /// The results as plain-text tables.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Some(c) = &self.catchup {
            out.push_str(&format!(
                "Catch-up: one v{} subscriber at the replica version, {} rows behind \
                 ({} transactions of {} rows)\n",
                self.protocol, c.rows, c.txns, self.catchup_txn_rows
            ));
            out.push_str(&format!(
                "{:>10} {:>8} {:>9} {:>12} {:>12} {:>11} {:>8}\n",
                "rows", "txns", "MiB", "first row", "caught up", "rows/s", "MiB/s"
            ));
            out.push_str(&format!(
                "{:>10} {:>8} {:>9.1} {:>12} {:>12} {:>11.0} {:>8.1}\n\n",
                c.received_rows,
                c.received_commits,
                c.frame_bytes as f64 / MIB,
                format!("{:.2} s", c.first_row.as_secs_f64()),
                format!("{:.2} s", c.elapsed.as_secs_f64()),
                per_second(c.received_rows, c.elapsed),
                c.frame_bytes as f64 / MIB / c.elapsed.as_secs_f64().max(1e-9),
            ));
        }
        if let Some(first) = self.levels.first() {
            let pace = if self.rate > 0 {
                format!(", paced at {} tx/s", self.rate)
            } else {
                String::new()
            };
            out.push_str(&format!(
                "Fan-out: v{} subscribers, each level {} single-row transactions from {} \
                 connections{pace}\n",
                self.protocol, first.txns, self.clients
            ));
            out.push_str(&format!(
                "{:>11} {:>11} {:>11} {:>14} {:>13} {:>10} {:>12} {:>11} {:>11} {:>11} {:>11}\n",
                "subscribers",
                "commit tx/s",
                "sent tx/s",
                "delivered tx/s",
                "msgs out/s",
                "msgs/frame",
                "server µs/tx",
                "bench µs/tx",
                "p50",
                "p99",
                "max"
            ));
        }
        for level in &self.levels {
            let delivered = per_second(level.txns, level.delivered_elapsed);
            // begin, insert, commit to every subscriber.
            let messages = delivered * 3.0 * level.subscribers as f64;
            out.push_str(&format!(
                "{:>11} {:>11.0} {:>11} {:>14.0} {:>13.0} {:>10.1} {:>12} {:>11} {:>11} {:>11} {:>11}\n",
                level.subscribers,
                per_second(level.txns, level.commit_elapsed),
                level.sent_elapsed.map_or_else(
                    || "-".to_owned(),
                    |sent| format!("{:.0}", per_second(level.txns, sent))
                ),
                delivered,
                messages,
                level.messages as f64 / level.frames.max(1) as f64,
                micros_per_tx(level.server_cpu, level.txns),
                micros_per_tx(level.bench_cpu, level.txns),
                millis(percentile(&level.latencies_us, 0.50)),
                millis(percentile(&level.latencies_us, 0.99)),
                millis(level.latencies_us.last().copied()),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_counted_by_message_with_commit_times_and_order() {
        let mut r = Received::reading(
            Expected {
                commits: 2,
                rows: 2,
            },
            Reading::Parse,
        );
        let now = Instant::now();
        let v6 = [
            r#"{"id":1,"msg":["status",{"tag":"status"}]}"#,
            r#"{"id":2,"msg":["begin",{"tag":"begin","commitTime":1},{"commitWatermark":"0b"}]}"#,
            r#"{"id":3,"msg":["data",{"tag":"insert","relation":{"schema":"public","name":"t"},"new":{"id":1,"payload":"[\"commit\"]"}}]}"#,
            r#"{"id":4,"msg":["commit",{"tag":"commit","commitTime":1000},{"watermark":"0b"}]}"#,
        ];
        let ids: Vec<Option<u64>> = v6.iter().map(|t| r.frame(t, now).unwrap()).collect();
        assert_eq!(ids, [Some(1), Some(2), Some(3), Some(4)]);
        assert_eq!((r.commits, r.rows, r.out_of_order), (1, 1, 0));
        assert!(!r.is_done());
        assert_eq!(r.latencies_us.len(), 1);
        assert!(r.latencies_us[0] > 1_000_000, "microseconds since 1970");
        // A v8 batch, and the ack of our own control frame.
        assert_eq!(r.frame(r#"{"ack":1}"#, now).unwrap(), None);
        let batch = r#"{"id":5,"batch":[["begin",{"tag":"begin"},{"commitWatermark":"0a"}],["data",{"tag":"insert"}],["data",{"tag":"update"}],["commit",{"tag":"commit"},{"watermark":"0a"}]]}"#;
        assert_eq!(r.frame(batch, now).unwrap(), Some(5));
        assert_eq!((r.commits, r.rows, r.out_of_order), (2, 2, 1));
        assert!(r.is_done());
        // Strings are borrowed from the frame unless they hold escapes.
        let escaped = r#"{"id":6,"msg":["com\u006dit",{"tag":"commit","commitTime":1},{"watermark":"0\u0063"}]}"#;
        assert_eq!(r.frame(escaped, now).unwrap(), Some(6));
        assert_eq!((r.commits, r.out_of_order), (3, 1));
        assert_eq!(r.last_commit.as_deref(), Some("0c"));
        r.commits = 2;
        // Complete but out of order: the run fails.
        let expected = Expected {
            commits: 2,
            rows: 2,
        };
        assert!(r.check(expected, "s").is_err());
        r.out_of_order = 0;
        assert!(r.check(expected, "s").is_ok());
        r.rows += 1;
        assert!(r.check(expected, "s").is_err());
        assert!(r
            .frame(r#"{"id":7,"msg":["error",{"type":1}]}"#, now)
            .is_err());
        assert!(r.frame("[1]", now).is_err());
    }

    /// A scan counts what a full parse counts, frame by frame, and fails where it fails.
    #[test]
    fn a_scan_counts_what_a_parse_counts() {
        let expected = Expected {
            commits: 3,
            rows: 3,
        };
        let frames = [
            r#"{"id":1,"msg":["status",{"tag":"status"}]}"#,
            r#"{"ack":1}"#,
            r#"{"id":2,"msg":["begin",{"tag":"begin","commitTime":1},{"commitWatermark":"0b"}]}"#,
            // A quoted tuple in a value is no message: its quotes are escaped.
            r#"{"id":3,"msg":["data",{"tag":"insert","relation":{"schema":"public","name":"t","keyColumns":["id"]},"new":{"id":1,"payload":"[\"commit\",[\"data\","}}]}"#,
            r#"{"id":4,"msg":["commit",{"tag":"commit","commitTime":1000},{"watermark":"0b"}]}"#,
            r#"{"id":17,"batch":[["begin",{"tag":"begin"},{"commitWatermark":"0c"}],["data",{"tag":"insert","new":{"id":2}}],["data",{"tag":"update"}],["commit",{"tag":"commit","commitTime":2000},{"watermark":"0c"}],["begin",{"tag":"begin"},{"commitWatermark":"0a"}],["data",{"tag":"insert"}],["rollback",{"tag":"rollback"}],["commit",{"tag":"commit"},{"watermark":"0a"}]]}"#,
        ];
        let now = Instant::now();
        let mut parsed = Received::reading(expected, Reading::Parse);
        let mut scanned = Received::reading(expected, Reading::Scan);
        for frame in frames {
            let ids = (
                parsed.read(frame, now).unwrap(),
                scanned.read(frame, now).unwrap(),
            );
            assert_eq!(ids.0, ids.1, "{frame}");
            let counts = |r: &Received| {
                (
                    r.commits,
                    r.rows,
                    r.out_of_order,
                    r.frames,
                    r.messages,
                    r.latencies_us.len(),
                    r.last_commit.clone(),
                    r.is_done(),
                )
            };
            assert_eq!(counts(&parsed), counts(&scanned), "after {frame}");
        }
        assert_eq!(
            (scanned.commits, scanned.rows, scanned.out_of_order),
            (3, 3, 1)
        );
        assert_eq!(scanned.messages, 12);
        assert!(scanned.is_done());
        for bad in [
            r#"{"id":9,"msg":["error",{"type":1}]}"#,
            r#"{"id":9,"batch":[["commit",{"tag":"commit"}"#,
            r#"{"msg":["status",{"tag":"status"}],"id":9}"#,
            r#"{"id":x}"#,
        ] {
            assert!(scanned.read(bad, now).is_err(), "{bad}");
        }
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let sorted: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&sorted, 0.5), Some(50));
        assert_eq!(percentile(&sorted, 0.99), Some(99));
        assert_eq!(percentile(&[7], 0.99), Some(7));
        assert_eq!(percentile(&[], 0.5), None);
    }

    /// Found in the lib test process, where other tests' servers come and go: summed over
    /// the threads alive at each end, a thread that ended in between made the level's CPU
    /// come out zero.
    #[test]
    fn cpu_is_counted_per_thread_so_ended_threads_take_nothing_away() {
        let map = |pairs: &[(&str, u64)]| {
            pairs
                .iter()
                .map(|(tid, ns)| ((*tid).to_owned(), *ns))
                .collect::<std::collections::HashMap<_, _>>()
        };
        let before = map(&[("1", 100), ("2", 5_000_000)]);
        let after = map(&[("1", 400), ("3", 50)]);
        assert_eq!(cpu_used(&before, &after), Duration::from_nanos(350));
    }

    /// The whole benchmark, tiny: every subscriber gets every transaction, in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tiny_run_delivers_everything_to_every_subscriber() {
        let args = FanoutArgs {
            txns: 40,
            subscribers: vec![1, 3],
            clients: 2,
            rate: 0,
            catchup_rows: 250,
            catchup_txn_rows: 100,
            protocol: 8,
            work_dir: None,
        };
        let report = fanout(&args).await.unwrap();
        let catchup = report.catchup.as_ref().expect("a catch-up run");
        assert_eq!(
            (
                catchup.received_rows,
                catchup.received_commits,
                catchup.txns
            ),
            (250, 3, 3)
        );
        assert_eq!(catchup.out_of_order, 0);
        assert_eq!(report.levels.len(), 2);
        for (level, subscribers) in report.levels.iter().zip([1, 3]) {
            assert_eq!(level.subscribers, subscribers);
            assert_eq!(level.received, vec![(40, 40); subscribers]);
            assert_eq!(level.out_of_order, 0);
            assert_eq!(level.latencies_us.len(), 40 * subscribers);
            // The server's WAL sender was seen to have sent everything.
            assert!(level.sent_elapsed.is_some(), "{level:?}");
            // The server did the work on its own threads.
            if cfg!(target_os = "linux") {
                assert!(level.server_cpu.is_some_and(|cpu| cpu > Duration::ZERO));
            }
        }
        let table = report.render();
        assert_eq!(table.lines().count(), 3 + 1 + 2 + 2, "{table}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn v6_subscribers_get_everything_too() {
        let args = FanoutArgs {
            txns: 20,
            subscribers: vec![2],
            clients: 1,
            rate: 500,
            catchup_rows: 30,
            catchup_txn_rows: 7,
            protocol: 6,
            work_dir: None,
        };
        let report = fanout(&args).await.unwrap();
        let catchup = report.catchup.as_ref().expect("a catch-up run");
        assert_eq!((catchup.received_rows, catchup.received_commits), (30, 5));
        assert_eq!(report.levels[0].received, vec![(20, 20); 2]);
    }
}
