//! `highwater-bench sync`: scope sync as a browser sees it.
//!
//! Setup: a private Postgres and `highwater serve --sync-rules` as a process of its own (the
//! `highwater` binary, see `--server-binary`), so its resident memory is its own; the clients
//! are real WebSocket clients on `/sync` in this process, each subscribed with a signed token,
//! and (for the client replay) `HighwaterClient`s in Node processes.
//!
//! - Replay: `--replay-rows` rows of one scope are committed and stored; one WebSocket client
//!   subscribes with no cursor (pages of 1,000) and is timed from the subscribe until
//!   `channel-subscribed` (the server's side). Then `HighwaterClient` in Node
//!   (`bindings-wasm/bench/replay.mjs`, the package built by `scripts/build-wasm`) takes the same
//!   scope: three fresh processes and three warm replays, without a listener and with a
//!   `change` listener that reads `rows()` on every change, as a page re-rendering does.
//! - Latency, for each level N of `--connections`: N sockets, each subscribed to a scope of its
//!   own and sending a `ping` every 4 s as `HighwaterClient` does; then single-row INSERTs are
//!   committed at `--rate` tx/s for `--warmup-seconds` (not measured) and then `--seconds`,
//!   round-robin over the N scopes. Latency per received row: the wall clock when the client
//!   read it minus its `updatedAt` (the Postgres commit time, ms resolution). p50 / p99 / max.
//! - Memory: the server's resident set before `--idle-connections` sockets open, with each
//!   subscribed to one scope of its own (the browser case: one socket per page), with a second
//!   subscription on each, and a few seconds after they all closed.
//! - The change log is not purged during the run (as in `bench fanout`), and the private
//!   Postgres runs without autovacuum or checkpoints.
//!
//! With `--membership`, the scopes are reached through a membership table instead of an owner
//! column: the rules give the table `where: project_id IN (SELECT project_id FROM <members>
//! WHERE user_id = auth.sub)`, and each connection subscribes to the whole table with its
//! user's token (a project of its own). The latency levels run the same way, each row written
//! into one user's project. Then:
//! - Move-in: `--move-in-rows` rows are committed into a project nobody is in; one client
//!   subscribes, then its user is made a member. Timed from that membership's commit (its
//!   `updatedAt`) to the last of the project's rows read by the client (the wall clock).
//! - Routing: the engine's scope server alone, in this process: `--routing-subscriptions`
//!   subscriptions over `--routing-projects` projects (one user each, in one project), then
//!   single-row commits into the projects in turn; the time per commit routed, with the
//!   subscriptions it reached, for a filter routed by its set, one routed by both branches of
//!   an OR, and one whose OR has a range (matched subscription by subscription).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::common::rss_kib_of;
use highwater_host::private_pg::{PgOptions, PrivatePg};
use highwater_host::sync_auth::{mint_token, SyncSecret};

const TABLE: &str = "highwater_bench_sync";
const MEMBERS: &str = "highwater_bench_members";
/// Projects of the latency level with `n` connections start at `n * LEVEL_PROJECTS`.
const LEVEL_PROJECTS: i64 = 1_000_000;
const WAIT: Duration = Duration::from_secs(10 * 60);
const SECRET: &str = "a benchmark secret that is long enough for HS256";

/// Command-line arguments of `highwater-bench sync`.
#[derive(Debug, Clone, clap::Args)]
pub struct SyncArgs {
    /// Connection levels of the latency run, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 10, 100, 1000])]
    pub connections: Vec<usize>,
    /// Transactions per second during the latency run.
    #[arg(long, default_value_t = 200)]
    pub rate: u64,
    /// Seconds of load per latency level.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Seconds of the same load before each level's measured seconds (not measured).
    #[arg(long, default_value_t = 2)]
    pub warmup_seconds: u64,
    /// Rows of the scope replayed (0 skips the replay runs).
    #[arg(long, default_value_t = 100_000)]
    pub replay_rows: u64,
    /// Skip the replay into `HighwaterClient` in Node.
    #[arg(long)]
    pub no_client_replay: bool,
    /// Idle connections of the memory run, one subscription each (0 skips it).
    #[arg(long, default_value_t = 1000)]
    pub idle_connections: usize,
    /// Where the server keeps its replica during the run; by default the temporary directory.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// The `highwater` binary to serve with (default: the one beside this binary, as
    /// `cargo build --release -p highwater-host --bin highwater` leaves it), to compare two
    /// builds' servers under the same clients in one sitting.
    #[arg(long)]
    pub server_binary: Option<PathBuf>,
    /// Scopes reached through a membership table (see the module docs): latency levels, a
    /// move-in and the routing cost, instead of the owner scopes' runs.
    #[arg(long)]
    pub membership: bool,
    /// Rows of the project moved into one client's scope (with `--membership`).
    #[arg(long, default_value_t = 10_000)]
    pub move_in_rows: u64,
    /// Subscriptions of the routing run (with `--membership`).
    #[arg(long, default_value_t = 10_000)]
    pub routing_subscriptions: usize,
    /// Projects the routing run's subscriptions are spread over.
    #[arg(long, default_value_t = 1_000)]
    pub routing_projects: usize,
}

/// Runs the benchmark and prints its table.
pub fn run(args: SyncArgs) -> anyhow::Result<()> {
    highwater_host::runtime::init_tracing("warn");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let out = runtime.block_on(bench(&args))?;
    print!("{out}");
    Ok(())
}

pub(super) type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(0))
}

pub(super) fn token(owner: &str) -> anyhow::Result<String> {
    let secret = SyncSecret::from_bytes(SECRET)?;
    let now = u64::try_from(now_ms())?;
    Ok(mint_token(
        &secret,
        owner,
        Duration::from_secs(24 * 3600),
        &[],
        now,
    )?)
}

pub(super) async fn connect(addr: SocketAddr) -> anyhow::Result<Socket> {
    let (socket, _) =
        tokio_tungstenite::connect_async_with_config(format!("ws://{addr}/sync"), None, true)
            .await?;
    Ok(socket)
}

async fn subscribe(socket: &mut Socket, id: &str, owner: &str) -> anyhow::Result<()> {
    let frame = json!({"type": "channel-subscribe", "subscriptionId": id,
        "channelType": "velocious-sync",
        "params": {"resourceType": TABLE, "conditions": {"owner": owner},
                   "authenticationToken": token(owner)?}});
    socket.send(Message::Text(frame.to_string().into())).await?;
    Ok(())
}

/// Subscribes to every row of the table `user`'s memberships let in.
async fn subscribe_member(socket: &mut Socket, id: &str, user: &str) -> anyhow::Result<()> {
    let frame = json!({"type": "channel-subscribe", "subscriptionId": id,
        "channelType": "velocious-sync",
        "params": {"resourceType": TABLE, "conditions": {},
                   "authenticationToken": token(user)?}});
    socket.send(Message::Text(frame.to_string().into())).await?;
    Ok(())
}

/// Reads frames until `count` `channel-subscribed` frames arrived; returns the rows received.
pub(super) async fn until_subscribed(socket: &mut Socket, mut count: usize) -> anyhow::Result<u64> {
    let mut rows = 0;
    while count > 0 {
        let message = tokio::time::timeout(WAIT, socket.next())
            .await
            .context("no frame in time")?
            .context("the socket ended")??;
        let Message::Text(text) = message else {
            continue;
        };
        let frame: Value = serde_json::from_str(text.as_str())?;
        match frame["type"].as_str() {
            Some("channel-subscribed") => count -= 1,
            Some("channel-message") => {
                rows += frame["body"]["syncs"].as_array().map_or(0, Vec::len) as u64;
            }
            Some("channel-error") => bail!("subscription refused: {frame}"),
            _ => {}
        }
    }
    Ok(rows)
}

pub(super) fn percentile(sorted: &[i64], p: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

async fn bench(args: &SyncArgs) -> anyhow::Result<String> {
    let binary = super::server_binary(args.server_binary.as_ref())?;
    // As in `bench fanout`: no autovacuum or checkpoint in the middle of a run.
    let settings = [
        ("autovacuum", "off"),
        ("max_wal_size", "8GB"),
        ("checkpoint_timeout", "1h"),
        ("shared_buffers", "256MB"),
    ];
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
        "CREATE TABLE public.{TABLE} (id bigint PRIMARY KEY, owner text NOT NULL, payload text NOT NULL, project_id bigint);
         CREATE TABLE public.{MEMBERS} (id bigint PRIMARY KEY, project_id bigint NOT NULL, user_id text NOT NULL)"
    ))
    .await?;
    let work = args
        .work_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("highwater-bench-sync-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = with_server(args, &binary, &pg, &db, &work).await;
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// `highwater serve` as a child process; killed when dropped.
pub(super) struct Server {
    child: tokio::process::Child,
    pid: u32,
    pub(super) addr: SocketAddr,
}

impl Server {
    async fn start(
        pg: &PrivatePg,
        work: &Path,
        binary: &Path,
        membership: bool,
    ) -> anyhow::Result<Server> {
        let rules = if membership {
            format!(
                r#"{{"tables":{{"{TABLE}":{{"where":"project_id IN (SELECT project_id FROM {MEMBERS} WHERE user_id = auth.sub)"}}}}}}"#
            )
        } else {
            format!(
                r#"{{"tables":{{"{TABLE}":{{"filterColumns":["owner"],"require":{{"owner":"sub"}}}}}}}}"#
            )
        };
        Server::start_with_rules(pg, work, binary, &rules).await
    }

    /// `highwater serve` with these sync rules (JSON text).
    pub(super) async fn start_with_rules(
        pg: &PrivatePg,
        work: &Path,
        binary: &Path,
        rules_text: &str,
    ) -> anyhow::Result<Server> {
        let rules = work.join("rules.json");
        let secret = work.join("secret");
        std::fs::write(&rules, rules_text)?;
        std::fs::write(&secret, SECRET)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = std::fs::File::create(work.join("serve.log"))?;
        // As in `bench fanout`: the change log is not purged during the run (a purge of the
        // replay load would stall ingest mid-level; that cost is the change log's).
        let child = tokio::process::Command::new(binary)
            .arg("serve")
            .args(["--upstream", &pg.url()])
            .arg("--data")
            .arg(work.join("data"))
            .args(["--port", &port.to_string(), "--host", "127.0.0.1"])
            .args(["--purge-delay-ms", &(24 * 60 * 60 * 1000u64).to_string()])
            .arg("--sync-rules")
            .arg(&rules)
            .arg("--sync-secret-file")
            .arg(&secret)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("cannot start highwater serve")?;
        let pid = child.id().context("highwater serve exited at once")?;
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut server = Server { child, pid, addr };
        let deadline = Instant::now() + WAIT;
        while TcpStream::connect(addr).await.is_err() {
            if server.child.try_wait()?.is_some() || Instant::now() > deadline {
                bail!(
                    "highwater serve did not start; its log: {}",
                    work.join("serve.log").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(server)
    }

    fn rss_kib(&self) -> u64 {
        rss_kib_of(self.pid).unwrap_or(0)
    }

    pub(super) async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

async fn with_server(
    args: &SyncArgs,
    binary: &Path,
    pg: &PrivatePg,
    db: &tokio_postgres::Client,
    work: &Path,
) -> anyhow::Result<String> {
    let server = Server::start(pg, work, binary, args.membership).await?;
    let result = if args.membership {
        measure_membership(args, pg, db, &server).await
    } else {
        measure(args, pg, db, &server).await
    };
    server.stop().await;
    result
}

/// One line of the memory table.
fn memory_line(label: &str, kib: u64) -> String {
    format!("{label:>44} {:>9.1} MiB\n", kib as f64 / 1024.0)
}

async fn measure(
    args: &SyncArgs,
    pg: &PrivatePg,
    db: &tokio_postgres::Client,
    server: &Server,
) -> anyhow::Result<String> {
    let addr = server.addr;
    let started_kib = server.rss_kib();
    let mut out = String::new();
    if let Some(binary) = &args.server_binary {
        out.push_str(&format!("Server: {}\n", binary.display()));
    }
    // Memory first, on a server that has done nothing else yet: what a connection costs,
    // not what it reuses of memory an earlier run left behind.
    if args.idle_connections > 0 {
        out.push_str(&memory(args.idle_connections, server, started_kib).await?);
    }
    let mut next_id: i64 = 1;
    if args.replay_rows > 0 {
        let rows = i64::try_from(args.replay_rows)?;
        db.execute(
            &format!(
                "INSERT INTO public.{TABLE} SELECT i, 'replay', md5(i::text) || md5((i + 1)::text) \
                 FROM generate_series($1::int8, $2::int8) AS i"
            ),
            &[&next_id, &(next_id + rows - 1)],
        )
        .await?;
        next_id += rows;
        // Stored once a marker committed after the load is seen live.
        let mut probe = connect(addr).await?;
        subscribe(&mut probe, "probe", "probe").await?;
        until_subscribed(&mut probe, 1).await?;
        db.execute(
            &format!("INSERT INTO public.{TABLE} VALUES ($1, 'probe', 'x')"),
            &[&next_id],
        )
        .await?;
        next_id += 1;
        tokio::time::timeout(WAIT, probe.next())
            .await
            .context("the load was not stored in time")?;
        let mut socket = connect(addr).await?;
        let started = Instant::now();
        subscribe(&mut socket, "replay", "replay").await?;
        let received = until_subscribed(&mut socket, 1).await?;
        let elapsed = started.elapsed();
        if received != args.replay_rows {
            bail!(
                "expected {} replayed rows, received {received}",
                args.replay_rows
            );
        }
        out.push_str(&format!(
            "Replay: one WebSocket client, fresh subscribe, pages of 1000\n{:>10} {:>10} {:>12}\n{:>10} {:>10} {:>12.0}\n\n",
            "rows", "seconds", "rows/s",
            received,
            format!("{:.2}", elapsed.as_secs_f64()),
            received as f64 / elapsed.as_secs_f64().max(1e-9)
        ));
        if !args.no_client_replay {
            out.push_str(&client_replay(addr, args.replay_rows).await?);
        }
    }

    out.push_str(&format!(
        "Latency: commit -> client, {} tx/s for {} s per level, one scope per connection\n{:>11} {:>9} {:>9} {:>8} {:>8} {:>8}\n",
        args.rate, args.seconds, "connections", "sent", "received", "p50", "p99", "max"
    ));
    for &n in &args.connections {
        out.push_str(&latency_level(args, pg, addr, n, &mut next_id, false).await?);
    }
    // What the server kept of the replay and the latency levels once every client left.
    tokio::time::sleep(Duration::from_secs(10)).await;
    out.push_str(&format!(
        "\nMemory after every run, 10 s after the last client left: {:.1} MiB (it started at {:.1} MiB)\n",
        server.rss_kib() as f64 / 1024.0,
        started_kib as f64 / 1024.0
    ));
    Ok(out)
}

/// The `--membership` runs: latency levels, a move-in, and the routing cost.
async fn measure_membership(
    args: &SyncArgs,
    pg: &PrivatePg,
    db: &tokio_postgres::Client,
    server: &Server,
) -> anyhow::Result<String> {
    let addr = server.addr;
    let mut out = String::new();
    if let Some(binary) = &args.server_binary {
        out.push_str(&format!("Server: {}\n", binary.display()));
    }
    let mut next_id: i64 = 1;
    out.push_str(&format!(
        "Latency: commit -> client through a membership row filter, {} tx/s for {} s per level, one user (one project) per connection\n{:>11} {:>9} {:>9} {:>8} {:>8} {:>8}\n",
        args.rate, args.seconds, "connections", "sent", "received", "p50", "p99", "max"
    ));
    for &n in &args.connections {
        out.push_str(&latency_level(args, pg, addr, n, &mut next_id, true).await?);
    }
    if args.move_in_rows > 0 {
        out.push('\n');
        out.push_str(&move_in(db, addr, args.move_in_rows, &mut next_id).await?);
    }
    if args.routing_subscriptions > 0 {
        out.push('\n');
        out.push_str(&routing(
            args.routing_subscriptions,
            args.routing_projects.max(1),
        ));
    }
    Ok(out)
}

/// A project of `rows` rows moved into one client's scope by a membership.
async fn move_in(
    db: &tokio_postgres::Client,
    addr: SocketAddr,
    rows: u64,
    next_id: &mut i64,
) -> anyhow::Result<String> {
    let project: i64 = -1;
    let rows_i = i64::try_from(rows)?;
    db.execute(
        &format!(
            "INSERT INTO public.{TABLE} SELECT i, 'mover', md5(i::text) || md5((i + 1)::text), $3::int8 \
             FROM generate_series($1::int8, $2::int8) AS i"
        ),
        &[&*next_id, &(*next_id + rows_i - 1), &project],
    )
    .await?;
    *next_id += rows_i;
    let mut socket = connect(addr).await?;
    subscribe_member(&mut socket, "m", "mover").await?;
    until_subscribed(&mut socket, 1).await?;
    let started = Instant::now();
    db.execute(
        &format!("INSERT INTO public.{MEMBERS} VALUES (-1, $1, 'mover')"),
        &[&project],
    )
    .await?;
    let mut received = 0_u64;
    let mut envelopes = 0_u64;
    while received < rows {
        let message = tokio::time::timeout(WAIT, socket.next())
            .await
            .context("the move-in did not arrive in time")?
            .context("the socket closed")??;
        let Message::Text(text) = message else {
            continue;
        };
        let frame: Value = serde_json::from_str(text.as_str())?;
        if let Some(syncs) = frame["body"]["syncs"].as_array() {
            received += syncs.len() as u64;
            envelopes += 1;
        }
    }
    let elapsed = started.elapsed();
    Ok(format!(
        "Move-in: a membership lets a project of {rows} rows into one client's scope\n{:>10} {:>10} {:>14}\n{:>10} {:>10} {:>14}\n",
        "rows", "envelopes", "to last row",
        received,
        envelopes,
        format!("{} ms", elapsed.as_millis()),
    ))
}

/// The engine's routing alone: `subscriptions` users over `projects` projects, each routed by
/// its set or, for comparison, matched one by one.
fn routing(subscriptions: usize, projects: usize) -> String {
    use highwater_engine::scope_sync::rules::row_filter::RuleFilter;
    use highwater_engine::scope_sync::server::{
        Decision, FeedChange, FeedEntry, Grant, PageResult, ScopeServer, ServerConfig,
        ServerEffect, ServerInput,
    };
    let run = |filter_text: &str| -> (f64, f64) {
        let mut server = ScopeServer::new(ServerConfig::new("v1"));
        let rule = RuleFilter::parse(filter_text).expect("the benchmark's filter parses");
        let entry = |table: &str, seq: i64, id: i64, data: Value| FeedEntry {
            table: table.to_owned(),
            resource_id: id.to_string(),
            seq,
            updated_at: "2026-12-01T12:00:00.000Z".to_owned(),
            change: FeedChange::Upsert {
                data: data.as_object().cloned().unwrap_or_default(),
            },
        };
        let rows = |up_to: i64, rows: Vec<FeedEntry>| PageResult::Rows {
            up_to,
            rows,
            total: Some(0),
            floor: None,
            access_changed: false,
        };
        for i in 0..subscriptions {
            let conn = i as u64;
            let user = format!("u{i}");
            let project = (i % projects) as i64;
            let mut effects = server.handle(
                ServerInput::Opened {
                    conn,
                    session_id: user.clone(),
                },
                0,
            );
            let text = json!({"type": "channel-subscribe", "subscriptionId": "s",
                "channelType": "velocious-sync", "params": {"resourceType": "items", "conditions": {}}})
            .to_string();
            effects.extend(server.handle(ServerInput::Frame { conn, text }, 0));
            let claims = json!({"sub": user});
            let filter = rule
                .bind(claims.as_object().expect("an object"))
                .expect("binds");
            let mut pending: Vec<ServerEffect> = effects;
            let mut authorized = false;
            while !pending.is_empty() {
                let mut next = Vec::new();
                for effect in pending {
                    let input = match effect {
                        ServerEffect::Authorize { ticket, .. } if !authorized => {
                            authorized = true;
                            ServerInput::Authorized {
                                conn,
                                ticket,
                                decision: Decision::Granted(Grant {
                                    table: "items".to_owned(),
                                    omit_columns: Vec::new(),
                                    expires_at_ms: None,
                                    row_filter: Some(filter.clone()),
                                }),
                            }
                        }
                        ServerEffect::ReadSet { set, .. } => ServerInput::SetRead {
                            set,
                            result: rows(
                                1,
                                vec![entry(
                                    "members",
                                    1,
                                    i as i64,
                                    json!({"user_id": user, "project_id": project}),
                                )],
                            ),
                        },
                        ServerEffect::FetchPage { ticket, pass, .. } => ServerInput::PageFetched {
                            conn,
                            ticket,
                            pass,
                            result: rows(1, Vec::new()),
                        },
                        _ => continue,
                    };
                    next.extend(server.handle(input, 0));
                }
                pending = next;
            }
        }
        let commits = 2_000_i64;
        let mut reached = 0_u64;
        let started = Instant::now();
        for k in 0..commits {
            let project = (k * 7919) % projects as i64;
            let effects = server.handle(
                ServerInput::Committed {
                    entries: vec![entry(
                        "items",
                        10 + k,
                        k,
                        json!({"id": k, "project_id": project, "owner": "x"}),
                    )],
                    confirms: Vec::new(),
                },
                0,
            );
            reached += effects
                .iter()
                .filter(|e| matches!(e, ServerEffect::Send { .. }))
                .count() as u64;
        }
        let per_commit = started.elapsed().as_secs_f64() * 1e6 / commits as f64;
        (per_commit, reached as f64 / commits as f64)
    };
    let routed = run("project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)");
    let either =
        run("project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub) OR owner = auth.sub");
    let matched =
        run("project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub) OR id < 0");
    format!(
        "Routing: the scope server alone, {subscriptions} subscriptions over {projects} projects, single-row commits\n{:>52} {:>14} {:>18}\n{:>52} {:>11.1} us {:>18.1}\n{:>52} {:>11.1} us {:>18.1}\n{:>52} {:>11.1} us {:>18.1}\n",
        "filter", "per commit", "subscriptions sent",
        "set test alone (routed by the set)", routed.0, routed.1,
        "set test OR owner = auth.sub (routed by both)", either.0, either.1,
        "set test OR id < 0 (a range: matched one by one)", matched.0, matched.1,
    )
}

/// One latency level: `n` sockets, a paced writer, the latency of every row received. With
/// `membership`, user `c{n}-{i}` is made a member of project `n * LEVEL_PROJECTS + i` first and
/// subscribes to the whole table, and each row goes to one of those projects.
async fn latency_level(
    args: &SyncArgs,
    pg: &PrivatePg,
    addr: SocketAddr,
    n: usize,
    next_id: &mut i64,
    membership: bool,
) -> anyhow::Result<String> {
    let level = n as i64 * LEVEL_PROJECTS;
    if membership {
        pg.connect()
            .await?
            .execute(
                &format!(
                    "INSERT INTO public.{MEMBERS} SELECT $1::int8 + i, $1::int8 + i, 'c' || $2::int8 || '-' || i \
                     FROM generate_series(0, $2::int8 - 1) AS i"
                ),
                &[&level, &(n as i64)],
            )
            .await?;
    }
    let mut sockets = Vec::with_capacity(n);
    for i in 0..n {
        let mut socket = connect(addr).await?;
        if membership {
            subscribe_member(&mut socket, "s", &format!("c{n}-{i}")).await?;
        } else {
            subscribe(&mut socket, "s", &format!("c{n}-{i}")).await?;
        }
        sockets.push(socket);
    }
    for socket in &mut sockets {
        until_subscribed(socket, 1).await?;
    }
    let total = args.rate * args.seconds;
    let warmup = args.rate * args.warmup_seconds;
    // The readers read until 5 s after the last write (a scope of 1,000 gets a row every 5 s).
    let (done_tx, done_rx) = tokio::sync::watch::channel(None::<tokio::time::Instant>);
    let readers: Vec<_> = sockets
        .into_iter()
        .map(|socket| {
            let mut done = done_rx.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                // Pings as `HighwaterClient` sends them (every 4 s): a client that sends
                // makes Linux delay its ACKs (40 ms), which is what a server that waits
                // for ACKs before sending more small frames (Nagle) then waits on.
                let (mut sink, mut stream) = socket.split();
                let mut ping = tokio::time::interval(Duration::from_secs(4));
                let mut until = None;
                loop {
                    let end = until.unwrap_or_else(|| tokio::time::Instant::now() + WAIT);
                    let message = tokio::select! {
                        message = tokio::time::timeout_at(end, stream.next()) => message,
                        _ = ping.tick() => {
                            let _ = sink.send(Message::Text(r#"{"type":"ping"}"#.into())).await;
                            continue;
                        }
                        changed = done.changed(), if until.is_none() => {
                            if changed.is_err() {
                                break;
                            }
                            until = *done.borrow();
                            continue;
                        }
                    };
                    let Ok(Some(Ok(message))) = message else {
                        break;
                    };
                    let Message::Text(text) = message else {
                        continue;
                    };
                    let read_at = now_ms();
                    let Ok(frame) = serde_json::from_str::<Value>(text.as_str()) else {
                        continue;
                    };
                    for entry in frame["body"]["syncs"].as_array().into_iter().flatten() {
                        if entry["data"]["payload"] == "warm-up" {
                            continue;
                        }
                        let at = entry["updatedAt"].as_str().and_then(parse_iso_ms);
                        if let Some(at) = at {
                            latencies.push(read_at - at);
                        }
                    }
                }
                latencies
            })
        })
        .collect();
    // Four connections, each pacing its share of the rate.
    let writers = 4_u64;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let conn = pg.connect().await?;
        let first = *next_id;
        let n = n as i64;
        let per = (warmup + total) / writers;
        let warm = warmup / writers;
        let period = Duration::from_secs_f64(writers as f64 / args.rate.max(1) as f64);
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            for k in 0..per as i64 {
                tick.tick().await;
                let id = first + k * writers as i64 + w as i64;
                let owner = format!("c{n}-{}", id % n);
                let project = level + id % n;
                let payload = if (k as u64) < warm { "warm-up" } else { "live" };
                conn.execute(
                    &format!("INSERT INTO public.{TABLE} VALUES ($1, $2, $3, $4)"),
                    &[&id, &owner, &payload, &project],
                )
                .await?;
            }
            Ok::<_, tokio_postgres::Error>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    done_tx.send_replace(Some(tokio::time::Instant::now() + Duration::from_secs(5)));
    *next_id += i64::try_from(warmup + total)? + 4;
    let mut latencies = Vec::new();
    for reader in readers {
        latencies.extend(reader.await?);
    }
    latencies.sort_unstable();
    let ms = |v: Option<i64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v} ms"));
    Ok(format!(
        "{:>11} {:>9} {:>9} {:>8} {:>8} {:>8}\n",
        n,
        total - total % 4,
        latencies.len(),
        ms(percentile(&latencies, 0.50)),
        ms(percentile(&latencies, 0.99)),
        ms(latencies.last().copied()),
    ))
}

/// The server's memory with `n` idle sockets of one subscription each, with a second
/// subscription on each, and after they closed.
async fn memory(n: usize, server: &Server, started_kib: u64) -> anyhow::Result<String> {
    let settle = || tokio::time::sleep(Duration::from_secs(3));
    // A few clients come and go first: the replica readers' page caches and the runtime's
    // structures are sized once, whatever the number of clients; what is left after that is
    // the baseline clients are measured against.
    let mut warm = Vec::new();
    for i in 0..8 {
        let mut socket = connect(server.addr).await?;
        subscribe(&mut socket, "w", &format!("warm-{i}")).await?;
        warm.push(socket);
    }
    for socket in &mut warm {
        until_subscribed(socket, 1).await?;
    }
    for mut socket in warm {
        let _ = socket.close(None).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let before = server.rss_kib();
    let mut sockets = Vec::with_capacity(n);
    for i in 0..n {
        let mut socket = connect(server.addr).await?;
        subscribe(&mut socket, "a", &format!("idle-{i}")).await?;
        sockets.push(socket);
    }
    for socket in &mut sockets {
        until_subscribed(socket, 1).await?;
    }
    settle().await;
    let one = server.rss_kib();
    for (i, socket) in sockets.iter_mut().enumerate() {
        subscribe(socket, "b", &format!("idle-{i}-b")).await?;
    }
    for socket in &mut sockets {
        until_subscribed(socket, 1).await?;
    }
    settle().await;
    let two = server.rss_kib();
    for mut socket in sockets {
        let _ = socket.close(None).await;
    }
    // Long enough for the server to see every close and its allocator to give memory back.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let after = server.rss_kib();
    let per = |from: u64, to: u64| to.saturating_sub(from) as f64 / n.max(1) as f64;
    let mut out = format!("Memory: the server's resident set, {n} idle sockets\n");
    out.push_str(&memory_line("at start", started_kib));
    out.push_str(&memory_line(
        "after 8 clients came and went (baseline)",
        before,
    ));
    out.push_str(&memory_line(
        &format!("{n} sockets, one subscription each"),
        one,
    ));
    out.push_str(&memory_line("a second subscription on each", two));
    out.push_str(&memory_line("10 s after they closed", after));
    out.push_str(&format!(
        "{:>44} {:>9.1} KiB\n{:>44} {:>9.1} KiB\n{:>44} {:>9.0} %\n",
        "per connection (one subscription)",
        per(before, one),
        "per extra subscription",
        per(one, two),
        "after they closed, of the baseline",
        after as f64 * 100.0 / before.max(1) as f64
    ));
    Ok(out)
}

/// The replay into `HighwaterClient` in Node, fresh and warm, with and without a listener, by
/// `bindings-wasm/bench/replay.mjs` against this server's replay scope.
async fn client_replay(addr: SocketAddr, rows: u64) -> anyhow::Result<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bindings-wasm/bench/replay.mjs");
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bindings-wasm/dist/node.js");
    if !script.exists() || !package.exists() {
        return Ok(format!(
            "Replay into HighwaterClient: skipped (no {} or {}: build the package with scripts/build-wasm)\n\n",
            script.display(),
            package.display()
        ));
    }
    let token = token("replay")?;
    let url = format!("ws://{addr}/sync");
    let mut out = format!(
        "Replay into HighwaterClient in Node: subscribe to ready with every row in rows(), rows/s\n{:>32} {:>30} {:>30}\n",
        "change listener", "fresh process (3 runs)", "warm (3 runs)"
    );
    for listener in ["none", "page"] {
        let mut fresh = Vec::new();
        for _ in 0..3 {
            fresh.extend(node_replays(&script, &url, &token, rows, listener, 1).await?);
        }
        let warm = node_replays(&script, &url, &token, rows, listener, 4).await?;
        let rates = |runs: &[f64]| {
            runs.iter()
                .map(|ms| format!("{:.0}", rows as f64 * 1000.0 / ms))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let label = if listener == "page" {
            "reads rows() on each change"
        } else {
            "none"
        };
        out.push_str(&format!(
            "{label:>32} {:>30} {:>30}\n",
            rates(&fresh),
            rates(warm.get(1..).unwrap_or_default())
        ));
    }
    out.push('\n');
    Ok(out)
}

/// `runs` replays in one new Node process; their milliseconds.
async fn node_replays(
    script: &Path,
    url: &str,
    token: &str,
    rows: u64,
    listener: &str,
    runs: usize,
) -> anyhow::Result<Vec<f64>> {
    let major: u32 = std::process::Command::new("node")
        .arg("-p")
        .arg("process.versions.node.split('.')[0]")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(22);
    let mut command = tokio::process::Command::new("node");
    if major < 22 {
        command.args([
            "--experimental-websocket",
            "--no-warnings=ExperimentalWarning",
        ]);
    }
    let output = command
        .arg(script)
        .args(["--replay", url, token, &rows.to_string(), listener])
        .arg(runs.to_string())
        .args([TABLE, "replay"])
        .stderr(Stdio::inherit())
        .output()
        .await
        .context("cannot run node")?;
    if !output.status.success() {
        bail!("the client replay failed ({})", output.status);
    }
    serde_json::from_slice(&output.stdout).context("the client replay's times")
}

/// `2026-12-01T12:00:00.123Z` as Unix milliseconds.
fn parse_iso_ms(text: &str) -> Option<i64> {
    let cursor = highwater_engine::scope_sync::cursor::SyncCursor::legacy(text.to_owned());
    cursor.updated_at_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_times_parse_back_to_milliseconds() {
        let ms = 1_796_126_400_123;
        assert_eq!(
            parse_iso_ms(&highwater_host::replica::feed::iso_from_ms(ms)),
            Some(ms)
        );
        assert_eq!(percentile(&[1, 2, 3, 4], 0.5), Some(2));
    }
}
