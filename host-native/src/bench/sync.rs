//! `highwater bench sync`: scope sync as a browser sees it.
//!
//! Setup: a private Postgres and `highwater serve --sync-rules` in this process on its own
//! runtime; the clients are real WebSocket clients on `/sync` on another runtime, each
//! subscribed with a signed token.
//!
//! - Replay: `--replay-rows` rows of one scope are committed and stored; one client subscribes
//!   with no cursor (pages of 1,000) and is timed from the subscribe until `channel-subscribed`.
//! - Latency, for each level N of `--connections`: N sockets, each subscribed to a scope of its
//!   own; then single-row INSERTs are committed at `--rate` tx/s for `--warmup-seconds` (not
//!   measured) and then `--seconds`, round-robin over the N scopes. Latency per received row: the wall clock when the client read it minus
//!   its `updatedAt` (the Postgres commit time, ms resolution). p50 / p99 / max.
//! - The change log is not purged during the run (as in `bench fanout`), and the private
//!   Postgres runs without autovacuum or checkpoints.
//! - Memory: the process's resident set before and after `--idle-subscriptions` idle
//!   subscriptions (100 per socket) are open, divided by their count. Clients and server share
//!   the process, so this is an upper bound for the server's cost.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::common::rss_kib;
use crate::private_pg::{PgOptions, PrivatePg};
use crate::serve::{serve, ServeArgs};
use crate::sync_auth::{mint_token, SyncSecret};

const TABLE: &str = "highwater_bench_sync";
const WAIT: Duration = Duration::from_secs(10 * 60);
const SECRET: &str = "a benchmark secret that is long enough for HS256";
const SUBSCRIPTIONS_PER_SOCKET: usize = 100;

/// Command-line arguments of `highwater bench sync`.
#[derive(Debug, Clone, clap::Args)]
pub struct SyncArgs {
    /// Connection levels of the latency run, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 100, 1000])]
    pub connections: Vec<usize>,
    /// Transactions per second during the latency run.
    #[arg(long, default_value_t = 500)]
    pub rate: u64,
    /// Seconds of load per latency level.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Seconds of the same load before each level's measured seconds (not measured).
    #[arg(long, default_value_t = 2)]
    pub warmup_seconds: u64,
    /// Rows of the scope replayed to one client (0 skips the replay run).
    #[arg(long, default_value_t = 200_000)]
    pub replay_rows: u64,
    /// Idle subscriptions of the memory run (0 skips it).
    #[arg(long, default_value_t = 10_000)]
    pub idle_subscriptions: usize,
    /// Where the server keeps its replica during the run; by default the temporary directory.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

/// Runs the benchmark and prints its table.
pub fn run(args: SyncArgs) -> anyhow::Result<()> {
    crate::runtime::init_tracing("warn");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let out = runtime.block_on(bench(&args))?;
    print!("{out}");
    Ok(())
}

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(0))
}

fn token(owner: &str) -> anyhow::Result<String> {
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

async fn connect(addr: SocketAddr) -> anyhow::Result<Socket> {
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

/// Reads frames until `count` `channel-subscribed` frames arrived; returns the rows received.
async fn until_subscribed(socket: &mut Socket, mut count: usize) -> anyhow::Result<u64> {
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

fn percentile(sorted: &[i64], p: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((sorted.len() as f64) * p).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

async fn bench(args: &SyncArgs) -> anyhow::Result<String> {
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
        "CREATE TABLE public.{TABLE} (id bigint PRIMARY KEY, owner text NOT NULL, payload text NOT NULL)"
    ))
    .await?;
    let work = args
        .work_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("highwater-bench-sync-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let result = with_server(args, &pg, &db, &work).await;
    let _ = std::fs::remove_dir_all(&work);
    result
}

async fn with_server(
    args: &SyncArgs,
    pg: &PrivatePg,
    db: &tokio_postgres::Client,
    work: &Path,
) -> anyhow::Result<String> {
    let rules = work.join("rules.json");
    let secret = work.join("secret");
    std::fs::write(
        &rules,
        format!(
            r#"{{"tables":{{"{TABLE}":{{"filterColumns":["owner"],"require":{{"owner":"sub"}}}}}}}}"#
        ),
    )?;
    std::fs::write(&secret, SECRET)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut serve_args = ServeArgs::new(pg.url(), work.join("data"));
    serve_args.port = port;
    serve_args.host = "127.0.0.1".to_owned();
    // As in `bench fanout`: the change log is not purged during the run (a purge of the replay
    // load would stall ingest mid-level; that cost is the change log's, not scope sync's).
    serve_args.purge_delay_ms = 24 * 60 * 60 * 1000;
    serve_args.sync_rules = Some(rules);
    serve_args.sync_secret.sync_secret_file = Some(secret);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("serve")
        .enable_all()
        .build()?;
    let (stop, stop_rx) = watch::channel(false);
    let task = runtime.spawn(serve(serve_args, stop_rx));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let deadline = Instant::now() + WAIT;
    while TcpStream::connect(addr).await.is_err() {
        if task.is_finished() || Instant::now() > deadline {
            bail!("highwater serve did not start");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let result = measure(args, pg, db, addr).await;
    let _ = stop.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
    runtime.shutdown_background();
    result
}

async fn measure(
    args: &SyncArgs,
    pg: &PrivatePg,
    db: &tokio_postgres::Client,
    addr: SocketAddr,
) -> anyhow::Result<String> {
    let mut out = String::new();
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
            "Replay: one client, fresh subscribe, pages of 1000\n{:>10} {:>10} {:>12}\n{:>10} {:>10} {:>12.0}\n\n",
            "rows", "seconds", "rows/s",
            received,
            format!("{:.2}", elapsed.as_secs_f64()),
            received as f64 / elapsed.as_secs_f64().max(1e-9)
        ));
    }

    out.push_str(&format!(
        "Latency: commit -> client, {} tx/s for {} s per level, one scope per connection\n{:>11} {:>9} {:>9} {:>8} {:>8} {:>8}\n",
        args.rate, args.seconds, "connections", "sent", "received", "p50", "p99", "max"
    ));
    for &n in &args.connections {
        let mut sockets = Vec::with_capacity(n);
        for i in 0..n {
            let mut socket = connect(addr).await?;
            subscribe(&mut socket, "s", &format!("c{n}-{i}")).await?;
            sockets.push(socket);
        }
        for socket in &mut sockets {
            until_subscribed(socket, 1).await?;
        }
        let total = args.rate * args.seconds;
        let warmup = args.rate * args.warmup_seconds;
        let readers: Vec<_> = sockets
            .into_iter()
            .map(|socket| {
                tokio::spawn(async move {
                    let mut latencies = Vec::new();
                    // Pings as `HighwaterClient` sends them (every 4 s): a client that sends
                    // makes Linux delay its ACKs (40 ms), which is what a server that waits
                    // for ACKs before sending more small frames (Nagle) then waits on.
                    let (mut sink, mut stream) = socket.split();
                    let mut ping = tokio::time::interval(Duration::from_secs(4));
                    // Done once no row arrived for 5 s (pongs do not count).
                    let mut quiet_until = tokio::time::Instant::now() + Duration::from_secs(5);
                    loop {
                        let message = tokio::select! {
                            message = tokio::time::timeout_at(quiet_until, stream.next()) => message,
                            _ = ping.tick() => {
                                let _ = sink.send(Message::Text(r#"{"type":"ping"}"#.into())).await;
                                continue;
                            }
                        };
                        let Ok(Some(Ok(message))) = message else {
                            break;
                        };
                        if matches!(&message, Message::Text(text) if text.as_str().contains("\"syncs\"")) {
                            quiet_until = tokio::time::Instant::now() + Duration::from_secs(5);
                        }
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
            let first = next_id;
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
                    let payload = if (k as u64) < warm { "warm-up" } else { "live" };
                    conn.execute(
                        &format!("INSERT INTO public.{TABLE} VALUES ($1, $2, $3)"),
                        &[&id, &owner, &payload],
                    )
                    .await?;
                }
                Ok::<_, tokio_postgres::Error>(())
            }));
        }
        for task in tasks {
            task.await??;
        }
        next_id += i64::try_from(warmup + total)? + 4;
        let mut latencies = Vec::new();
        for reader in readers {
            latencies.extend(reader.await?);
        }
        latencies.sort_unstable();
        let ms = |v: Option<i64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v} ms"));
        out.push_str(&format!(
            "{:>11} {:>9} {:>9} {:>8} {:>8} {:>8}\n",
            n,
            total - total % 4,
            latencies.len(),
            ms(percentile(&latencies, 0.50)),
            ms(percentile(&latencies, 0.99)),
            ms(latencies.last().copied()),
        ));
    }
    out.push('\n');

    if args.idle_subscriptions > 0 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let before = rss_kib().unwrap_or(0);
        let sockets_needed = args.idle_subscriptions.div_ceil(SUBSCRIPTIONS_PER_SOCKET);
        let mut sockets = Vec::with_capacity(sockets_needed);
        let mut opened = 0;
        for s in 0..sockets_needed {
            let mut socket = connect(addr).await?;
            let here = SUBSCRIPTIONS_PER_SOCKET.min(args.idle_subscriptions - opened);
            for k in 0..here {
                subscribe(&mut socket, &format!("i{k}"), &format!("idle-{s}-{k}")).await?;
            }
            until_subscribed(&mut socket, here).await?;
            opened += here;
            sockets.push(socket);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = rss_kib().unwrap_or(0);
        out.push_str(&format!(
            "Memory: {} idle subscriptions on {} sockets (clients in the same process)\n{:>14} {:>14} {:>18}\n{:>14} {:>14} {:>18}\n",
            opened,
            sockets.len(),
            "RSS before",
            "RSS after",
            "per subscription",
            format!("{} MiB", before / 1024),
            format!("{} MiB", after / 1024),
            format!("{:.1} KiB", after.saturating_sub(before) as f64 / opened.max(1) as f64),
        ));
        drop(sockets);
    }
    Ok(out)
}

/// `2026-12-01T12:00:00.123Z` as Unix milliseconds.
fn parse_iso_ms(text: &str) -> Option<i64> {
    let cursor = highwater_engine::cursor::SyncCursor::legacy(text.to_owned());
    cursor.updated_at_ms()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_times_parse_back_to_milliseconds() {
        let ms = 1_796_126_400_123;
        assert_eq!(
            parse_iso_ms(&crate::replica::feed::iso_from_ms(ms)),
            Some(ms)
        );
        assert_eq!(percentile(&[1, 2, 3, 4], 0.5), Some(2));
    }
}
