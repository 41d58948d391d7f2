//! Real-process fault runs: a private Postgres, `highwater serve` with scope sync, a relay
//! (`serve --from` the primary), change-stream subscribers and scope-sync clients, with an
//! in-process TCP proxy in front of Postgres, the primary and the relay. While writers commit
//! a workload (with a column added and an index created along the way), faults drawn from one
//! seed hit at random points: `kill -9` of the primary, the relay or both (restarted on the
//! same data directories; also during the initial sync and the snapshot restore, and just after
//! a large commit), a Postgres restart (immediate, as a crash, or fast), every connection
//! through a proxy cut, every connection through a proxy stalled for up to 15 s (silent, not
//! reset), and a scope client restarted from its store. Then the run waits for
//! quiet and compares every subscriber and client with Postgres. `RELIABILITY.md` says what
//! is checked and how lost and duplicated transactions are counted.
//!
//! - `cluster.rs`: the server processes, started and killed by pid;
//! - `proxy.rs`: the cutting TCP proxy;
//! - `stream_sub.rs`: the change-stream subscriber and the duplicate rule;
//! - `scope_client.rs`: the engine's `SyncClient` over tokio-tungstenite;
//! - `workload.rs`: the writers, the ledger, the schema changes, Postgres's state;
//! - `rng.rs`: the seeded generator.
//!
//! Output: TAP lines (`ok N - …` / `not ok N - …`), one line starting `fault run:` with the
//! counts, then `# pass P` and `# fail F`. Exits non-zero on any loss, duplicate or mismatch.
//! `scripts/faults [--seed S] [--seconds N]` builds and runs it.
//!
//! Counting: `transactions` are the workload transactions Postgres holds at the end (its
//! `ledger` table, so a COMMIT whose answer was lost counts by what Postgres decided). `lost`
//! and `duplicated` are summed over change-stream subscribers: a transaction missing from one
//! subscriber's durable state is lost once for it; a duplicate is defined in `stream_sub.rs`.
//! Scope clients are compared row by row (their protocol carries rows, not transactions).

mod cluster;
mod proxy;
mod rng;
mod scope_client;
mod stream_sub;
mod workload;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::Parser;
use highwater_engine::watermark::Watermark;
use highwater_host::private_pg::{PgOptions, PrivatePg};
use highwater_host::sync_auth::SyncSecret;
use tokio::sync::watch;

use cluster::{tail, write_secret, Server};
use proxy::Proxy;
use rng::Rng;
use scope_client::ScopeClient;
use stream_sub::StreamSub;
use workload::{pg_state, Tally, OWNERS};

/// Time a server gets to answer `/health` after a start.
const READY: Duration = Duration::from_secs(120);

#[derive(Debug, Parser)]
#[command(about = "Seeded real-process fault run against highwater serve and a relay")]
struct Args {
    /// The seed of the fault schedule and the workload; random when absent (and printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Seconds of workload under faults.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Seconds to wait, after the workload, for every subscriber and client to equal Postgres.
    #[arg(long, default_value_t = 60)]
    quiet_seconds: u64,
    /// Rows in `items` before the servers start (their initial sync and the relay's snapshot
    /// restore carry them).
    #[arg(long, default_value_t = 3000)]
    initial_rows: i64,
    /// Concurrent writers.
    #[arg(long, default_value_t = 3)]
    writers: i64,
    /// The `highwater` binary; by default the one built next to this program.
    #[arg(long)]
    highwater: Option<PathBuf>,
    /// Keep the work directory (data directories, logs) even when every check passes.
    #[arg(long)]
    keep: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(|| {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        (nanos as u64) ^ u64::from(std::process::id()).rotate_left(32)
    });
    println!(
        "# seed {seed}: replay with scripts/faults --seed {seed} --seconds {}",
        args.seconds
    );
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            println!("Bail out! cannot start a runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    // On Ctrl-C or SIGTERM the run is dropped: every server it started is killed by its pid
    // and the private Postgres stopped, before the exit.
    let outcome = runtime.block_on(async {
        tokio::select! {
            outcome = run(&args, seed) => Some(outcome),
            () = highwater_host::runtime::wait_for_signal() => None,
        }
    });
    let Some(outcome) = outcome else {
        println!("Bail out! interrupted; replay with --seed {seed}");
        println!("# work directory kept: {}", work_dir().display());
        println!("fault run: seed {seed} was interrupted");
        println!("# pass 0");
        println!("# fail 1");
        return ExitCode::FAILURE;
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            println!("Bail out! {error:#}");
            println!("fault run: seed {seed} did not finish");
            println!("# pass 0");
            println!("# fail 1");
            ExitCode::FAILURE
        }
    }
}

/// Fault counts, by kind.
#[derive(Debug, Default)]
struct Faults {
    kill_serve: u64,
    kill_relay: u64,
    pg_restarts: u64,
    cuts: u64,
    /// Connections the cuts ended.
    connections_cut: u64,
    /// Proxies stalled: nothing passed for a while, the connections stayed up.
    stalls: u64,
    /// Scope clients restarted from their stores (client-side, not in the total).
    client_restarts: u64,
}

impl Faults {
    fn total(&self) -> u64 {
        self.kill_serve + self.kill_relay + self.pg_restarts + self.cuts + self.stalls
    }
}

/// TAP results.
#[derive(Default)]
struct Checks {
    n: u32,
    passed: u32,
    failed: u32,
}

impl Checks {
    fn check(&mut self, ok: bool, what: impl AsRef<str>, detail: impl FnOnce() -> String) {
        self.n += 1;
        if ok {
            self.passed += 1;
            println!("ok {} - {}", self.n, what.as_ref());
        } else {
            self.failed += 1;
            println!("not ok {} - {}", self.n, what.as_ref());
            for line in detail().lines() {
                println!("#   {line}");
            }
        }
    }
}

fn binary(args: &Args) -> anyhow::Result<PathBuf> {
    let path = match &args.highwater {
        Some(path) => path.clone(),
        None => {
            // target/<profile>/examples/faults → target/<profile>/highwater
            let me = std::env::current_exe()?;
            me.parent()
                .and_then(Path::parent)
                .map(|dir| dir.join("highwater"))
                .context("cannot locate the highwater binary; pass --highwater")?
        }
    };
    if !path.exists() {
        bail!(
            "expected the highwater binary at {}, found nothing (cargo build -p highwater-host --bin highwater)",
            path.display()
        );
    }
    Ok(path)
}

fn os(args: &[&str]) -> Vec<OsString> {
    args.iter().map(OsString::from).collect()
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Data directories, logs, tokens and rules of this run.
fn work_dir() -> PathBuf {
    std::env::temp_dir().join(format!("highwater-faults-{}", std::process::id()))
}

async fn run(args: &Args, seed: u64) -> anyhow::Result<bool> {
    let highwater = binary(args)?;
    let mut rng = Rng::new(seed);
    let work = work_dir();
    std::fs::create_dir_all(&work)?;
    let result = with_work_dir(args, seed, &highwater, &mut rng, &work).await;
    match &result {
        Ok(true) if !args.keep => {
            let _ = std::fs::remove_dir_all(&work);
        }
        _ => println!("# work directory kept: {}", work.display()),
    }
    result
}

async fn with_work_dir(
    args: &Args,
    seed: u64,
    highwater: &Path,
    rng: &mut Rng,
    work: &Path,
) -> anyhow::Result<bool> {
    let mut pg = PrivatePg::start(PgOptions::default()).await?;
    let db = pg.connect().await?;
    db.batch_execute(workload::SCHEMA).await?;
    db.execute(
        "INSERT INTO items (id, owner, v) SELECT g, (ARRAY['ada','grace','linus'])[g % 3 + 1], \
         'initial' FROM generate_series(1, $1::int8) AS g",
        &[&args.initial_rows],
    )
    .await?;
    let initial = pg_state(&db).await?.rows;
    drop(db);
    let pg_addr = std::net::SocketAddr::from(([127, 0, 0, 1], pg.port()));
    let pg_proxy = Proxy::start("postgres", pg_addr).await?;

    // Secrets as a user sets them: files only the owner reads, never command-line values.
    // Drawn apart from the seed, which is printed.
    let mut entropy = Rng::new(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()),
    );
    let mut secret = |n: usize| {
        (0..n)
            .map(|_| format!("{:016x}", entropy.next_u64()))
            .collect::<String>()
    };
    let token = secret(2);
    let relay_token = secret(2);
    let secret_text = secret(3);
    write_secret(&work.join("replication.token"), &token)?;
    write_secret(&work.join("relay.token"), &relay_token)?;
    write_secret(&work.join("sync.secret"), &secret_text)?;
    std::fs::write(
        work.join("rules.json"),
        r#"{"tables":{"items":{"filterColumns":["owner"],"require":{"owner":"sub"}}}}"#,
    )?;
    let secret = SyncSecret::from_bytes(&secret_text)?;
    let path = |name: &str| work.join(name).into_os_string();

    let primary_port = free_port()?;
    let mut primary_args = os(&[
        "--upstream",
        &format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            pg_proxy.addr.port()
        ),
        "--data",
    ]);
    primary_args.push(path("primary"));
    primary_args.extend([
        OsString::from("--sync-rules"),
        path("rules.json"),
        OsString::from("--sync-secret-file"),
        path("sync.secret"),
        OsString::from("--replication-token-file"),
        path("replication.token"),
    ]);
    let mut primary = Server::new(
        "serve",
        highwater,
        primary_port,
        primary_args,
        work.join("primary.log"),
    );
    let mut faults = Faults::default();
    primary.spawn()?;
    // Sometimes a kill -9 during the initial sync, then a start on the same data directory.
    if rng.chance(50) {
        tokio::time::sleep(Duration::from_millis(rng.range(50, 1_500))).await;
        let phase = startup_phase(primary.addr, "its initial sync").await;
        if primary.kill9() {
            faults.kill_serve += 1;
            println!("# kill -9 serve {phase}");
        }
        primary.spawn()?;
    }
    let health = primary.wait_ready(READY).await?;
    let replica_version = health["replicaVersion"]
        .as_str()
        .and_then(|w| Watermark::parse(w).ok())
        .context("expected a replicaVersion in /health")?;
    let primary_proxy = Proxy::start("serve", primary.addr).await?;

    let relay_port = free_port()?;
    let mut relay_args = os(&["--from", &format!("ws://{}", primary_proxy.addr), "--data"]);
    relay_args.push(path("relay"));
    relay_args.extend([
        OsString::from("--sync-rules"),
        path("rules.json"),
        OsString::from("--sync-secret-file"),
        path("sync.secret"),
        OsString::from("--replication-token-file"),
        path("relay.token"),
        OsString::from("--upstream-token-file"),
        path("replication.token"),
    ]);
    let mut relay = Server::new(
        "relay",
        highwater,
        relay_port,
        relay_args,
        work.join("relay.log"),
    );
    relay.spawn()?;
    // Sometimes a kill -9 while the relay restores the primary's snapshot.
    if rng.chance(50) {
        tokio::time::sleep(Duration::from_millis(rng.range(50, 1_500))).await;
        let phase = startup_phase(relay.addr, "its snapshot restore").await;
        if relay.kill9() {
            faults.kill_relay += 1;
            println!("# kill -9 relay {phase}");
        }
        relay.spawn()?;
    }
    relay.wait_ready(READY).await?;
    let relay_proxy = Proxy::start("relay", relay.addr).await?;

    let (stop_clients, stop_rx) = watch::channel(false);
    let subscribers = vec![
        StreamSub::start(
            "primary-1".into(),
            primary_proxy.addr,
            token.clone(),
            replica_version.clone(),
            initial.clone(),
            rng.fork(),
            stop_rx.clone(),
        ),
        StreamSub::start(
            "primary-2".into(),
            primary_proxy.addr,
            token.clone(),
            replica_version.clone(),
            initial.clone(),
            rng.fork(),
            stop_rx.clone(),
        ),
        StreamSub::start(
            "relay-1".into(),
            relay_proxy.addr,
            relay_token.clone(),
            replica_version.clone(),
            initial.clone(),
            rng.fork(),
            stop_rx.clone(),
        ),
    ];
    let mut scopes = Vec::new();
    for (name, addr, owner) in [
        ("primary-ada", primary_proxy.addr, OWNERS[0]),
        ("primary-grace", primary_proxy.addr, OWNERS[1]),
        ("relay-linus", relay_proxy.addr, OWNERS[2]),
        ("relay-ada", relay_proxy.addr, OWNERS[0]),
    ] {
        scopes.push(ScopeClient::start(
            name.into(),
            addr,
            owner,
            secret.clone(),
            rng.fork(),
            stop_rx.clone(),
        )?);
    }

    // The workload, straight to Postgres (its writers reconnect after a restart).
    let tally = Arc::new(Tally::default());
    let (stop_writers, writers_rx) = watch::channel(false);
    let note = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 1..=args.writers {
        writers.push(tokio::spawn(workload::writer(
            w,
            pg.url(),
            rng.fork(),
            tally.clone(),
            note.clone(),
            writers_rx.clone(),
        )));
    }
    // Schema changes at seeded points of the run, under the same faults.
    let ms = args.seconds * 1000;
    let ddl_at = [
        Duration::from_millis(rng.range(ms / 5, ms * 2 / 5)),
        Duration::from_millis(rng.range(ms / 2, ms * 4 / 5)),
    ];
    let ddl = tokio::spawn(workload::schema_changes(pg.url(), ddl_at, note.clone()));

    // Faults at random points until the workload's time is up.
    let started = Instant::now();
    let end = started + Duration::from_secs(args.seconds);
    loop {
        let gap = Duration::from_millis(rng.range(1_000, 4_000));
        if Instant::now() + gap + Duration::from_secs(1) > end {
            break;
        }
        supervise(&mut [&mut primary, &mut relay], gap).await?;
        let at = started.elapsed().as_secs_f64();
        match rng.range(0, 100) {
            0..=24 => {
                let large = rng.chance(40);
                if large {
                    // Aimed inside the store of a large transaction: just after one commits.
                    let committed = tally.large_committed.notified();
                    let _ = tokio::time::timeout(Duration::from_secs(3), committed).await;
                    tokio::time::sleep(Duration::from_millis(rng.range(0, 60))).await;
                }
                let at = started.elapsed().as_secs_f64();
                if primary.kill9() {
                    faults.kill_serve += 1;
                    let when = if large { " after a large commit" } else { "" };
                    println!("# {at:6.1}s kill -9 serve{when}");
                }
                tokio::time::sleep(Duration::from_millis(rng.range(0, 1_500))).await;
                primary.spawn()?;
            }
            25..=42 => {
                if relay.kill9() {
                    faults.kill_relay += 1;
                    println!("# {at:6.1}s kill -9 relay");
                }
                tokio::time::sleep(Duration::from_millis(rng.range(0, 1_500))).await;
                relay.spawn()?;
            }
            43..=60 => {
                let immediate = rng.chance(60);
                if immediate {
                    pg.crash_server().await?;
                } else {
                    pg.stop_server().await?;
                }
                tokio::time::sleep(Duration::from_millis(rng.range(0, 1_500))).await;
                pg.start_server().await?;
                faults.pg_restarts += 1;
                let mode = if immediate { "immediate" } else { "fast" };
                println!("# {at:6.1}s postgres restart (-m {mode})");
            }
            61..=65 => {
                // Both servers at once, restarted in a random order.
                let killed = (primary.kill9(), relay.kill9());
                faults.kill_serve += u64::from(killed.0);
                faults.kill_relay += u64::from(killed.1);
                println!("# {at:6.1}s kill -9 serve and relay together");
                tokio::time::sleep(Duration::from_millis(rng.range(0, 1_500))).await;
                if rng.chance(50) {
                    relay.spawn()?;
                    primary.spawn()?;
                } else {
                    primary.spawn()?;
                    relay.spawn()?;
                }
            }
            66..=73 => {
                let i = rng.range(0, scopes.len() as u64) as usize;
                let client = &mut scopes[i];
                client.restart(rng.fork()).await?;
                faults.client_restarts += 1;
                let name = client
                    .state
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .name
                    .clone();
                println!("# {at:6.1}s scope client {name} restarts from its store");
            }
            74..=87 => {
                // Silence, not a reset: peers must find out by their heartbeats and timeouts.
                let proxies = [&pg_proxy, &primary_proxy, &relay_proxy];
                let proxy = proxies[rng.range(0, 3) as usize];
                let millis = rng.range(500, 15_000);
                let stalled = proxy.stall(true);
                faults.stalls += 1;
                println!(
                    "# {at:6.1}s stall {stalled} connections through the {} proxy for {:.1}s",
                    proxy.name,
                    millis as f64 / 1000.0
                );
                supervise(
                    &mut [&mut primary, &mut relay],
                    Duration::from_millis(millis),
                )
                .await?;
                proxy.stall(false);
            }
            _ => {
                let proxies = [&pg_proxy, &primary_proxy, &relay_proxy];
                let chosen: Vec<&Proxy> = if rng.chance(20) {
                    proxies.to_vec()
                } else {
                    vec![proxies[rng.range(0, 3) as usize]]
                };
                let cut: u64 = chosen.iter().map(|p| p.cut_all()).sum();
                let names: Vec<&str> = chosen.iter().map(|p| p.name).collect();
                faults.cuts += 1;
                faults.connections_cut += cut;
                println!(
                    "# {at:6.1}s cut {cut} connections through the {} proxy",
                    names.join(" + ")
                );
            }
        }
    }
    supervise(
        &mut [&mut primary, &mut relay],
        end.saturating_duration_since(Instant::now()),
    )
    .await?;
    let _ = stop_writers.send(true);
    let stopped = Instant::now();
    for writer in writers {
        let _ = writer.await;
    }
    let ddl = match ddl.await {
        Ok(result) => result,
        Err(error) => Err(error.into()),
    };
    println!(
        "# workload stopped after {:.1}s: {} commits acknowledged, {} with unknown outcome, {} failed",
        started.elapsed().as_secs_f64(),
        tally.committed.load(Ordering::Relaxed),
        tally.unknown.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed)
    );

    // Quiet: every process up, then wait for every subscriber and client to equal Postgres.
    for server in [&mut primary, &mut relay] {
        server.reap();
        server.spawn()?;
        server.wait_ready(READY).await?;
    }
    let db = pg.connect().await?;
    let truth = pg_state(&db).await?;
    let quiet_deadline = Instant::now() + Duration::from_secs(args.quiet_seconds);
    loop {
        let subs_equal = subscribers.iter().all(|s| {
            let state = s.state.lock().unwrap_or_else(|p| p.into_inner());
            state.durable.rows == truth.rows
                && state
                    .durable
                    .tags
                    .keys()
                    .copied()
                    .eq(truth.tags.iter().copied())
        });
        let scopes_equal = scopes.iter().all(|c| {
            let state = c.state.lock().unwrap_or_else(|p| p.into_inner());
            state.stored == scope_rows(&truth, &state.owner) && state.live
        });
        if (subs_equal && scopes_equal) || Instant::now() > quiet_deadline {
            break;
        }
        supervise(&mut [&mut primary, &mut relay], Duration::from_millis(250)).await?;
    }
    let quiet_after = stopped.elapsed().as_secs_f64();
    let _ = stop_clients.send(true);
    for s in &subscribers {
        s.task.abort();
    }
    for c in &scopes {
        c.task.abort();
    }

    // The checks.
    let mut checks = Checks::default();
    let acknowledged = tally
        .acknowledged
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let forgotten: Vec<i64> = acknowledged.difference(&truth.tags).copied().collect();
    checks.check(
        forgotten.is_empty(),
        format!(
            "Postgres holds all {} transactions whose COMMIT it acknowledged",
            acknowledged.len()
        ),
        || format!("missing tags: {:?}", &forgotten[..forgotten.len().min(20)]),
    );
    checks.check(
        ddl.as_ref()
            .is_ok_and(|n| *n == workload::SCHEMA_CHANGES.len()),
        format!(
            "the schema changes ran: {}",
            workload::SCHEMA_CHANGES.join("; ")
        ),
        || format!("{ddl:?}"),
    );
    let mut lost_total = 0_u64;
    let mut duplicated_total = 0_u64;
    for s in &subscribers {
        let state = s.state.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let held: std::collections::BTreeSet<i64> = state.durable.tags.keys().copied().collect();
        let lost: Vec<i64> = truth.tags.difference(&held).copied().collect();
        let phantom: Vec<i64> = held.difference(&truth.tags).copied().collect();
        let dup_tags = stream_sub::duplicated_tags(&state.durable);
        let duplicated = dup_tags.len() as u64 + state.duplicate_commits;
        lost_total += lost.len() as u64;
        duplicated_total += duplicated;
        let name = &state.name;
        println!(
            "# subscriber {name}: {} transactions durable, {} connections, {} un-acked resent",
            state.durable.commits, state.connects, state.resent
        );
        checks.check(
            lost.is_empty(),
            format!("subscriber {name}: no transaction lost"),
            || {
                format!(
                    "{} lost, first: {:?}",
                    lost.len(),
                    &lost[..lost.len().min(20)]
                )
            },
        );
        checks.check(
            duplicated == 0,
            format!("subscriber {name}: no transaction received twice after it was acked"),
            || format!("{duplicated} duplicated; tags {dup_tags:?}"),
        );
        checks.check(
            phantom.is_empty(),
            format!("subscriber {name}: no transaction Postgres does not hold"),
            || format!("{phantom:?}"),
        );
        checks.check(
            state.durable.rows == truth.rows,
            format!(
                "subscriber {name}: its {} rows equal Postgres's {} by key",
                state.durable.rows.len(),
                truth.rows.len()
            ),
            || diff(&state.durable.rows, &truth.rows),
        );
        checks.check(
            state.errors.is_empty(),
            format!("subscriber {name}: the stream kept its framing and order"),
            || {
                state
                    .errors
                    .iter()
                    .take(10)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join("\n")
            },
        );
    }
    for c in &scopes {
        let state = c.state.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let expected = scope_rows(&truth, &state.owner);
        let name = &state.name;
        println!(
            "# scope client {name} (owner = {}): {} sockets opened, {} restarts, {} resets, {} errors survived",
            state.owner,
            state.sockets_opened,
            state.restarts,
            state.resets,
            state.errors.len()
        );
        checks.check(
            state.failed.is_empty() && state.live,
            format!("scope client {name}: subscribed and live at the end"),
            || format!("failed: {:?}, live: {}", state.failed, state.live),
        );
        checks.check(
            state.stored == expected,
            format!(
                "scope client {name}: its {} stored rows equal Postgres's {} for owner = {}",
                state.stored.len(),
                expected.len(),
                state.owner
            ),
            || diff_str(&state.stored, &expected),
        );
        checks.check(
            state.held == state.stored,
            format!("scope client {name}: the client's rows equal its store"),
            || diff_str(&state.held, &state.stored),
        );
        checks.check(
            state.cursor_regressions == 0,
            format!("scope client {name}: its persisted cursor never moved backwards"),
            || format!("{} regressions", state.cursor_regressions),
        );
        // Kills, Postgres restarts, cut connections and relay switches are no reason to start
        // a scope over: every resume replays from the client's cursor.
        checks.check(
            state.resets == 0,
            format!("scope client {name}: never reset"),
            || format!("{} resets", state.resets),
        );
    }
    for server in [&primary, &relay] {
        let log = std::fs::read_to_string(server.log()).unwrap_or_default();
        let panics: Vec<&str> = log.lines().filter(|l| l.contains("panicked")).collect();
        checks.check(
            panics.is_empty(),
            format!("{}: no panic in its log", server.name),
            || {
                panics
                    .iter()
                    .take(5)
                    .copied()
                    .collect::<Vec<_>>()
                    .join("\n")
            },
        );
        let errors = log.lines().filter(|l| l.contains(" ERROR ")).count();
        println!(
            "# {}: {errors} ERROR lines in {}",
            server.name,
            server.log().display()
        );
    }
    let exits: Vec<String> = [&primary, &relay]
        .iter()
        .flat_map(|s| s.unexpected_exits.clone())
        .collect();
    let startup_exits: Vec<String> = [&primary, &relay]
        .iter()
        .flat_map(|s| s.startup_exits.clone())
        .collect();
    // Reported, not failed: a server that cannot finish starting (its Postgres connection cut
    // during startup) ends with an error and is started again, as by a supervisor.
    println!(
        "# {} exits while starting (restarted){}",
        startup_exits.len(),
        if startup_exits.is_empty() {
            String::new()
        } else {
            format!(": {}", startup_exits.join("; "))
        }
    );
    checks.check(
        exits.is_empty(),
        "no server process exited, once serving, unless killed",
        || {
            format!(
                "{}\nlast lines of {}:\n{}\nlast lines of {}:\n{}",
                exits.join("\n"),
                primary.log().display(),
                tail(primary.log(), 15),
                relay.log().display(),
                tail(relay.log(), 15)
            )
        },
    );
    println!(
        "# quiet {quiet_after:.1}s after the workload stopped; {} connections cut in all; {} \
         scope-client restarts from their stores",
        faults.connections_cut, faults.client_restarts
    );
    println!(
        "fault run: seed {seed}, {} faults injected ({} kill -9 serve, {} kill -9 relay, {} pg restarts, {} connections cut, {} stalls), {} transactions, {lost_total} lost, {duplicated_total} duplicated",
        faults.total(),
        faults.kill_serve,
        faults.kill_relay,
        faults.pg_restarts,
        faults.cuts,
        faults.stalls,
        truth.tags.len(),
    );
    println!("# pass {}", checks.passed);
    println!("# fail {}", checks.failed);
    drop((pg_proxy, primary_proxy, relay_proxy));
    primary.kill9();
    relay.kill9();
    pg.stop_server().await?;
    Ok(checks.failed == 0)
}

/// Where a starting server stands, for the log of a kill: still in `work`, or serving.
async fn startup_phase(addr: std::net::SocketAddr, work: &str) -> String {
    if cluster::health(addr).await.is_ok() {
        "just after it started serving".to_owned()
    } else {
        format!("during {work}")
    }
}

/// Sleeps `duration` while restarting, as a supervisor would, a server that exited on its own.
async fn supervise(servers: &mut [&mut Server], duration: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + duration;
    loop {
        for server in servers.iter_mut() {
            server.poll_serving().await;
            if let Some(exit) = server.reap() {
                println!("# {exit}: restarting it; last lines of its log:");
                for line in tail(server.log(), 5).lines() {
                    println!("#   {line}");
                }
                server.spawn()?;
            }
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Ok(());
        }
        tokio::time::sleep((deadline - now).min(Duration::from_millis(200))).await;
    }
}

/// The rows of one owner's scope, keyed as scope sync keys them (`resourceId`).
fn scope_rows(
    truth: &workload::PgState,
    owner: &str,
) -> std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>> {
    truth
        .rows
        .iter()
        .filter(|(_, row)| row.get("owner").map(String::as_str) == Some(owner))
        .map(|(id, row)| (id.to_string(), row.clone()))
        .collect()
}

fn diff<K: Ord + std::fmt::Debug, V: PartialEq + std::fmt::Debug>(
    got: &std::collections::BTreeMap<K, V>,
    want: &std::collections::BTreeMap<K, V>,
) -> String {
    let mut out = Vec::new();
    for (k, v) in want {
        match got.get(k) {
            None => out.push(format!("missing {k:?}: {v:?}")),
            Some(g) if g != v => out.push(format!("differs {k:?}: got {g:?}, want {v:?}")),
            _ => {}
        }
    }
    for (k, v) in got {
        if !want.contains_key(k) {
            out.push(format!("extra {k:?}: {v:?}"));
        }
    }
    let n = out.len();
    out.truncate(10);
    format!("{n} differences; first:\n{}", out.join("\n"))
}

fn diff_str(
    got: &std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>,
    want: &std::collections::BTreeMap<String, std::collections::BTreeMap<String, String>>,
) -> String {
    diff(got, want)
}
