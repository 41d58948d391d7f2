//! `highwater-bench writes`: writes through the scope-sync socket, end to end: the client's
//! `mutate` frame → `highwater serve` → one Postgres transaction per mutation → logical
//! replication → the server's replica (committed and synced) → the change routed back to the
//! writer's scope (the envelope echoing it) → the `confirmed` result.
//!
//! Setup as in `bench sync` ([`super::sync`]): a private Postgres and `highwater serve
//! --sync-rules` (write rules on the bench's table) as a process of its own; the clients are
//! real WebSocket clients on `/sync` in this process, each subscribed to its own scope
//! (`owner` = its token's `sub`), and `HighwaterClient` in Node.
//!
//! - Latency, for each level N of `--writers`: N sockets, each its own user, client id and
//!   scope, each sending one insert at a time (a `mutate` frame of one mutation, then its
//!   `mutation-result`), for `--warmup-seconds` (not measured) and then `--seconds`. Per
//!   mutation: from sending the frame to reading `confirmed`. p50 / p99 / max and the
//!   mutations/s of all N together.
//! - Flush: one client with `--flush-mutations` inserts queued (an outbox after an offline
//!   period), sent as the client sends them: frames of 100, one in flight. Timed from the first
//!   frame to the last `confirmed`. With Postgres' commit timestamps
//!   (`track_commit_timestamp`), each frame's time is split into: until its first mutation
//!   committed upstream, the rest of its mutations committed, and from its last commit until
//!   its results were read (replication, the replica's commit, routing, the answer).
//! - Node (`bindings-wasm/bench/writes.mjs`, the package built by `scripts/build-wasm`): a
//!   `HighwaterClient` goes offline, queues `--client-mutations` inserts, goes online, and is
//!   timed until `pendingCount` is 0; then `--client-latency-mutations` single inserts, each
//!   timed from `mutate()` until `confirmed` resolves.
//!
//! Every run checks that each mutation was confirmed and that the envelope echoing it
//! (`body.echoOrigin`) reached the writer's socket before its result, and fails otherwise.
//! The private Postgres runs as every bench's does (`fsync=off`, so a commit is not flushed
//! to disk; `synchronous_commit` at its default, on) unless `--upstream-fsync`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

use super::sync::{connect, percentile, token, until_subscribed, Server, Socket};
use highwater_host::private_pg::{PgOptions, PrivatePg};

const TABLE: &str = "highwater_bench_writes";
/// How long a frame may take to come before the run is called stuck.
const WAIT: Duration = Duration::from_secs(60);
/// Mutations per `mutate` frame in the flush: the most a frame may carry, as the client sends.
const FRAME: usize = highwater_engine::scope_sync::MAX_MUTATIONS_PER_FRAME;

/// Command-line arguments of `highwater-bench writes`.
#[derive(Debug, Clone, clap::Args)]
pub struct WritesArgs {
    /// Writer levels of the latency run, comma-separated: sockets writing at once, one
    /// mutation in flight each.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 100])]
    pub writers: Vec<usize>,
    /// Seconds of writing per latency level.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Seconds of the same writing before each level's measured seconds (not measured).
    #[arg(long, default_value_t = 2)]
    pub warmup_seconds: u64,
    /// Mutations queued by one client and flushed at once (0 skips the flush runs).
    #[arg(long, default_value_t = 10_000)]
    pub flush_mutations: usize,
    /// Mutations the Node client queues offline and then flushes (0 skips that run).
    #[arg(long, default_value_t = 10_000)]
    pub client_mutations: usize,
    /// Single mutations the Node client times from `mutate()` to `confirmed`.
    #[arg(long, default_value_t = 200)]
    pub client_latency_mutations: usize,
    /// Skip the runs of `HighwaterClient` in Node.
    #[arg(long)]
    pub no_client: bool,
    /// Run the private Postgres with `fsync=on` and `full_page_writes=on`: every commit
    /// flushed to disk, as a production server does (the default is `fsync=off`).
    #[arg(long)]
    pub upstream_fsync: bool,
    /// Load `pg_stat_statements` into the private Postgres and print what the flush's
    /// statements cost inside Postgres (needs the contrib module; adds a little to each).
    #[arg(long)]
    pub statement_stats: bool,
    /// Where the server keeps its replica during the run; by default the temporary directory.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// The `highwater` binary to serve with (default: the one beside this binary, as
    /// `cargo build --release -p highwater-host --bin highwater` leaves it).
    #[arg(long)]
    pub server_binary: Option<PathBuf>,
}

/// Runs the benchmark and prints its table.
pub fn run(args: WritesArgs) -> anyhow::Result<()> {
    highwater_host::runtime::init_tracing("warn");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let out = runtime.block_on(bench(&args))?;
    print!("{out}");
    Ok(())
}

async fn bench(args: &WritesArgs) -> anyhow::Result<String> {
    let binary = super::server_binary(args.server_binary.as_ref())?;
    // As in `bench sync`: no autovacuum or checkpoint in the middle of a run; commit
    // timestamps for the flush's breakdown.
    let mut settings = vec![
        ("autovacuum", "off"),
        ("max_wal_size", "8GB"),
        ("checkpoint_timeout", "1h"),
        ("shared_buffers", "256MB"),
        ("track_commit_timestamp", "on"),
    ];
    if args.upstream_fsync {
        settings.extend([("fsync", "on"), ("full_page_writes", "on")]);
    }
    if args.statement_stats {
        settings.push(("shared_preload_libraries", "pg_stat_statements"));
    }
    let pg = PrivatePg::start(PgOptions {
        settings: settings
            .iter()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        ..PgOptions::default()
    })
    .await?;
    let db = pg.connect().await?;
    db.batch_execute(&format!(
        "CREATE TABLE public.{TABLE} (id bigint PRIMARY KEY, owner text NOT NULL, payload text NOT NULL)"
    ))
    .await?;
    if args.statement_stats {
        db.batch_execute("CREATE EXTENSION pg_stat_statements")
            .await
            .context("--statement-stats needs pg_stat_statements (postgresql-contrib)")?;
    }
    let work = args
        .work_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("highwater-bench-writes-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let rules = format!(
        r#"{{"tables":{{"{TABLE}":{{"filterColumns":["owner"],"require":{{"owner":"sub"}},"write":{{"insert":true,"update":true,"delete":true}}}}}}}}"#
    );
    let result = match Server::start_with_rules(&pg, &work, &binary, &rules).await {
        Ok(server) => {
            let result = measure(args, &db, server.addr).await;
            server.stop().await;
            result
        }
        Err(error) => Err(error),
    };
    let _ = std::fs::remove_dir_all(&work);
    let settings = if args.upstream_fsync {
        "fsync=on, synchronous_commit=on"
    } else {
        "fsync=off, synchronous_commit=on"
    };
    result.map(|out| format!("Upstream: private Postgres, {settings}\n\n{out}"))
}

async fn measure(
    args: &WritesArgs,
    db: &tokio_postgres::Client,
    addr: SocketAddr,
) -> anyhow::Result<String> {
    // Every inserted row gets the next id; every level its own users and client ids.
    let next_row = Arc::new(AtomicI64::new(1));
    let mut out = format!(
        "Latency: mutate frame of one insert -> confirmed, one in flight per socket, {} s per level\n\
         (split at the Postgres commit: frame sent -> committed upstream, committed -> confirmed read)\n\
         {:>8} {:>10} {:>12} {:>22} {:>20} {:>20}\n",
        args.seconds,
        "writers",
        "mutations",
        "mutations/s",
        "p50 / p99 / max",
        "to commit p50 / p99",
        "commit->confirmed"
    );
    for (level, &n) in args.writers.iter().enumerate() {
        out.push_str(&latency_level(args, db, addr, level, n, &next_row).await?);
    }
    if args.flush_mutations > 0 {
        out.push('\n');
        out.push_str(&flush(args, db, addr, &next_row).await?);
    }
    if !args.no_client {
        out.push('\n');
        out.push_str(&client_writes(args, addr, &next_row).await?);
    }
    Ok(out)
}

/// Subscribes `socket` to `owner`'s scope of the bench table.
async fn subscribe(socket: &mut Socket, owner: &str, token: &str) -> anyhow::Result<()> {
    let frame = json!({"type": "channel-subscribe", "subscriptionId": "w",
        "channelType": "velocious-sync",
        "params": {"resourceType": TABLE, "conditions": {"owner": owner},
                   "authenticationToken": token}});
    socket.send(Message::Text(frame.to_string().into())).await?;
    until_subscribed(socket, 1).await?;
    Ok(())
}

/// One writer: a socket subscribed to its own scope, with its client id and token.
struct Writer {
    socket: Socket,
    client_id: String,
    owner: String,
    token: String,
    next_mutation: u64,
}

impl Writer {
    async fn open(addr: SocketAddr, name: String) -> anyhow::Result<Writer> {
        let token = token(&name)?;
        let mut socket = connect(addr).await?;
        subscribe(&mut socket, &name, &token).await?;
        Ok(Writer {
            socket,
            client_id: name.clone(),
            owner: name,
            token,
            next_mutation: 1,
        })
    }

    /// `count` inserts of new rows of this writer's scope, numbered as the client numbers them.
    fn inserts(&mut self, count: usize, next_row: &AtomicI64) -> Vec<Value> {
        (0..count)
            .map(|_| {
                let id = self.next_mutation;
                self.next_mutation += 1;
                let row = next_row.fetch_add(1, Ordering::Relaxed);
                json!({"id": id, "table": TABLE, "op": "insert",
                       "row": {"id": row, "owner": self.owner, "payload": format!("write {row}")}})
            })
            .collect()
    }

    /// Sends one `mutate` frame and reads until each of its mutations has a result. Fails
    /// unless every one is `confirmed`, after an envelope echoing it arrived on this socket.
    async fn send(&mut self, mutations: &[Value]) -> anyhow::Result<()> {
        let frame = json!({"type": "mutate", "clientId": self.client_id, "token": self.token,
                           "mutations": mutations});
        self.socket
            .send(Message::Text(frame.to_string().into()))
            .await?;
        let mut echoed = HashSet::new();
        let mut waiting = mutations.len();
        while waiting > 0 {
            let message = tokio::time::timeout(WAIT, self.socket.next())
                .await
                .context("no frame in time")?
                .context("the socket ended")??;
            let Message::Text(text) = message else {
                continue;
            };
            let frame: Value = serde_json::from_str(text.as_str())?;
            match frame["type"].as_str() {
                Some("channel-message") => {
                    let echo = &frame["body"]["echoOrigin"];
                    if echo["clientId"] == self.client_id.as_str() {
                        let ids = echo["mutationIds"].as_array().into_iter().flatten();
                        echoed.extend(ids.filter_map(Value::as_u64));
                    }
                }
                Some("mutation-result") => {
                    for result in frame["results"].as_array().into_iter().flatten() {
                        let id = result["id"].as_u64().context("a result without an id")?;
                        if result["status"] != "confirmed" {
                            bail!("expected mutation {id} to be confirmed, got {result}");
                        }
                        if !echoed.contains(&id) {
                            bail!(
                                "expected the envelope echoing mutation {id} before its result, \
                                 got the result first"
                            );
                        }
                        waiting = waiting.saturating_sub(1);
                    }
                }
                Some("error" | "channel-error" | "channel-closed") => {
                    bail!("expected mutation results, got {frame}")
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// One latency level: `n` writers, one insert in flight each, for the warm-up and the
/// measured seconds.
async fn latency_level(
    args: &WritesArgs,
    db: &tokio_postgres::Client,
    addr: SocketAddr,
    level: usize,
    n: usize,
    next_row: &Arc<AtomicI64>,
) -> anyhow::Result<String> {
    let mut writers = Vec::with_capacity(n);
    for i in 0..n {
        writers.push(Writer::open(addr, format!("l{level}-w{i}")).await?);
    }
    let start = Instant::now();
    let measured_from = start + Duration::from_secs(args.warmup_seconds);
    let until = measured_from + Duration::from_secs(args.seconds);
    let tasks: Vec<_> = writers
        .into_iter()
        .map(|mut writer| {
            let next_row = Arc::clone(next_row);
            tokio::spawn(async move {
                // Per measured mutation: its row, sent and confirmed (Unix microseconds).
                let mut timed = Vec::new();
                loop {
                    let sent = Instant::now();
                    if sent >= until {
                        break;
                    }
                    let insert = writer.inserts(1, &next_row);
                    let sent_us = unix_us();
                    writer.send(&insert).await?;
                    if sent >= measured_from {
                        let row = insert[0]["row"]["id"].as_i64().unwrap_or(0);
                        timed.push((row, sent_us, unix_us()));
                    }
                }
                let _ = writer.socket.close(None).await;
                anyhow::Ok(timed)
            })
        })
        .collect();
    let mut timed = Vec::new();
    for task in tasks {
        timed.extend(task.await??);
    }
    let commits = commit_times(db, &format!("l{level}-%")).await?;
    let (mut total, mut to_commit, mut back) = (Vec::new(), Vec::new(), Vec::new());
    for (row, sent, confirmed) in &timed {
        total.push(confirmed - sent);
        let committed = commits
            .get(row)
            .with_context(|| format!("expected row {row} upstream, found none"))?;
        to_commit.push(committed - sent);
        back.push(confirmed - committed);
    }
    for list in [&mut total, &mut to_commit, &mut back] {
        list.sort_unstable();
    }
    let ms = |list: &[i64], p: f64| {
        percentile(list, p).map_or_else(|| "-".to_owned(), |v| format!("{:.1}", v as f64 / 1000.0))
    };
    Ok(format!(
        "{:>8} {:>10} {:>12.0} {:>22} {:>20} {:>20}\n",
        n,
        total.len(),
        total.len() as f64 / args.seconds.max(1) as f64,
        format!(
            "{} / {} / {} ms",
            ms(&total, 0.5),
            ms(&total, 0.99),
            ms(&total, 1.0)
        ),
        format!("{} / {} ms", ms(&to_commit, 0.5), ms(&to_commit, 0.99)),
        format!("{} / {} ms", ms(&back, 0.5), ms(&back, 0.99)),
    ))
}

/// Postgres' commit time (Unix microseconds) of each row whose owner is `like`, by row id.
async fn commit_times(
    db: &tokio_postgres::Client,
    like: &str,
) -> anyhow::Result<HashMap<i64, i64>> {
    let rows = db
        .query(
            &format!(
                "SELECT id, (extract(epoch FROM pg_xact_commit_timestamp(xmin)) * 1000000)::int8 \
                 FROM public.{TABLE} WHERE owner LIKE $1"
            ),
            &[&like],
        )
        .await?;
    Ok(rows.iter().map(|row| (row.get(0), row.get(1))).collect())
}

/// One client flushes `--flush-mutations` queued inserts in frames of [`FRAME`], one in
/// flight; then the time of each frame is split by the upstream commit times of its rows.
async fn flush(
    args: &WritesArgs,
    db: &tokio_postgres::Client,
    addr: SocketAddr,
    next_row: &Arc<AtomicI64>,
) -> anyhow::Result<String> {
    let total = args.flush_mutations;
    if args.statement_stats {
        db.batch_execute("SELECT pg_stat_statements_reset()")
            .await?;
    }
    let mut writer = Writer::open(addr, "flush".to_owned()).await?;
    let queued = writer.inserts(total, next_row);
    // Per frame: sent and answered, Unix microseconds (Postgres' commit timestamps use the
    // same clock).
    let mut frames = Vec::new();
    let started = Instant::now();
    for batch in queued.chunks(FRAME) {
        let sent = unix_us();
        writer.send(batch).await?;
        frames.push((sent, unix_us()));
    }
    let elapsed = started.elapsed();
    let _ = writer.socket.close(None).await;
    let statements = if args.statement_stats {
        statement_stats(db, total).await?
    } else {
        String::new()
    };
    let mut committed: Vec<(i64, i64)> = commit_times(db, "flush").await?.into_iter().collect();
    if committed.len() != total {
        bail!(
            "expected {total} flushed rows upstream, found {}",
            committed.len()
        );
    }
    committed.sort_unstable();
    let committed: Vec<i64> = committed.into_iter().map(|(_, at)| at).collect();
    let (mut to_first, mut applying, mut back) = (0_i64, 0_i64, 0_i64);
    for ((sent, answered), commits) in frames.iter().zip(committed.chunks(FRAME)) {
        let first = commits.iter().copied().min().unwrap_or(*sent);
        let last = commits.iter().copied().max().unwrap_or(*answered);
        to_first += first - sent;
        applying += last - first;
        back += answered - last;
    }
    let between = i64::try_from(elapsed.as_micros())? - to_first - applying - back;
    let seconds = elapsed.as_secs_f64();
    let share = |us: i64| {
        format!(
            "{:>9.0} ms {:>5.1} %",
            us as f64 / 1000.0,
            us as f64 * 100.0 / (seconds * 1e6).max(1.0)
        )
    };
    let later = (total - frames.len()).max(1) as f64;
    Ok(format!(
        "Flush: {total} queued inserts from one client, frames of {FRAME}, one in flight\n\
         {:>10} {:>10} {:>12}\n{:>10} {:>10.2} {:>12.0}\n\
         Where the time went (summed over the {} frames; commit times from Postgres):\n\
         {:>62} {}\n{:>62} {}   ({:.0} us per mutation)\n{:>62} {}\n{:>62} {}\n{statements}",
        "mutations",
        "seconds",
        "mutations/s",
        total,
        seconds,
        total as f64 / seconds.max(1e-9),
        frames.len(),
        "frame sent -> its first mutation committed upstream",
        share(to_first),
        "first -> last commit of the frame (one transaction each)",
        share(applying),
        applying as f64 / later,
        "last commit -> results read (replication, replica, routing)",
        share(back),
        "the client between frames",
        share(between),
    ))
}

/// What the flush's statements cost inside Postgres: each statement run about once per
/// mutation or more, with its calls and time per mutation.
async fn statement_stats(db: &tokio_postgres::Client, total: usize) -> anyhow::Result<String> {
    let rows = db
        .query(
            "SELECT regexp_replace(query, '\\s+', ' ', 'g'), calls, \
             total_exec_time + total_plan_time \
             FROM pg_stat_statements WHERE calls >= $1 ORDER BY 3 DESC",
            &[&i64::try_from(total)?],
        )
        .await?;
    let per = total.max(1) as f64;
    let mut out =
        "Inside Postgres (pg_stat_statements: planning and execution, per mutation):\n".to_owned();
    let mut sum = 0.0;
    for row in rows {
        let query: String = row.get(0);
        let calls: i64 = row.get(1);
        let ms: f64 = row.get(2);
        sum += ms;
        let query: String = query.chars().take(70).collect();
        out.push_str(&format!(
            "{:>8.0} us {:>5.1} calls  {query}\n",
            ms * 1000.0 / per,
            calls as f64 / per
        ));
    }
    out.push_str(&format!("{:>8.0} us in all\n", sum * 1000.0 / per));
    Ok(out)
}

fn unix_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(0))
}

/// The Node runs, by `bindings-wasm/bench/writes.mjs` against this server.
async fn client_writes(
    args: &WritesArgs,
    addr: SocketAddr,
    next_row: &Arc<AtomicI64>,
) -> anyhow::Result<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bindings-wasm/bench/writes.mjs");
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bindings-wasm/dist/node.js");
    let major = std::process::Command::new("node")
        .arg("-p")
        .arg("process.versions.node.split('.')[0]")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| v.trim().parse::<u32>().ok());
    let Some(major) = major else {
        return Ok("HighwaterClient in Node: skipped (no `node` on the PATH)\n".to_owned());
    };
    if !script.exists() || !package.exists() {
        return Ok(format!(
            "HighwaterClient in Node: skipped (no {} or {}: build the package with scripts/build-wasm)\n",
            script.display(),
            package.display()
        ));
    }
    let owner = "node";
    let flush = args.client_mutations;
    let single = args.client_latency_mutations;
    let first_row = next_row.fetch_add(i64::try_from(flush + single)?, Ordering::Relaxed);
    let mut command = tokio::process::Command::new("node");
    if major < 22 {
        command.args([
            "--experimental-websocket",
            "--no-warnings=ExperimentalWarning",
        ]);
    }
    let output = command
        .arg(&script)
        .arg("--json")
        .arg(format!("ws://{addr}/sync"))
        .arg(token(owner)?)
        .args([TABLE, owner])
        .args([flush.to_string(), single.to_string(), first_row.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .await
        .context("cannot run node")?;
    if !output.status.success() {
        bail!("the Node client's writes failed ({})", output.status);
    }
    let result: Value =
        serde_json::from_slice(&output.stdout).context("the Node client's results")?;
    let number = |key: &str| result[key].as_f64().unwrap_or(f64::NAN);
    let mut latencies: Vec<f64> = result["latencies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_f64)
        .collect();
    latencies.sort_by(f64::total_cmp);
    let at = |p: f64| {
        let rank = ((latencies.len() as f64) * p).ceil() as usize;
        latencies
            .get(rank.clamp(1, latencies.len().max(1)) - 1)
            .map_or_else(|| "-".to_owned(), |v| format!("{v:.1} ms"))
    };
    let mut out = "HighwaterClient in Node (MemoryStore), one scope\n".to_owned();
    if flush > 0 {
        out.push_str(&format!(
            "{:>56} {:>10.0} ms\n{:>56} {:>10.0} ms\n{:>56} {:>10.0}\n",
            format!("{flush} mutate() calls while offline"),
            number("queueMs"),
            "goOnline() -> pendingCount 0",
            number("flushMs"),
            "flush, mutations/s",
            flush as f64 * 1000.0 / number("flushMs"),
        ));
    }
    out.push_str(&format!(
        "{:>56} {} / {} / {}\n",
        format!(
            "{} single mutations, mutate() -> confirmed: p50 / p99 / max",
            latencies.len()
        ),
        at(0.50),
        at(0.99),
        at(1.0),
    ));
    Ok(out)
}
