//! Slow subscribers against the real `highwater serve` binary and a real Postgres
//! (`docs/protocol/change-stream.md`, "Acks and back-pressure"): a subscriber that stops reading
//! its socket and acking holds up the stream only within bounds — the upstream is paused (the
//! slot's confirmed position stops) and the server's memory stays bounded — and after the
//! full-backlog timeout it is closed with 1013, even if it never reads again, after which the
//! stream resumes for everyone else, gap-free. Both while the slow subscriber catches up from
//! the change log and once it is live.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use highwater_engine::change_stream::decode_downstream_frame;
use tokio::net::{TcpSocket, TcpStream};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::serve_support::*;

const MIB: usize = 1024 * 1024;
/// The subscriber backlog limit the server runs with: small, so the test is quick.
const HIGH_WATER: usize = 4 * MIB;
/// How long a subscriber may hold up the stream before it is dropped.
const FULL_TIMEOUT: Duration = Duration::from_secs(4);
/// Text per row: large, so a handful of transactions fill a backlog.
const ROW_BYTES: usize = 32 * 1024;
/// Transactions in the change log before the slow subscriber connects.
const LOGGED_TXNS: i64 = 200;
/// The bound on the server's peak resident memory asked for: the backlog limit plus a generous
/// allowance for the runtime, SQLite, buffers and a catch-up batch.
const MEMORY_BOUND: usize = HIGH_WATER + 64 * MIB;

/// `highwater serve` as a child process with the back-pressure limits of this test.
async fn start_server(url: &str, data: &Path, port: u16) -> Binary {
    let child = Command::new(env!("CARGO_BIN_EXE_highwater"))
        .arg("serve")
        .args(["--upstream", url])
        .arg("--data")
        .arg(data)
        .args(["--port", &port.to_string(), "--host", "127.0.0.1"])
        .args(["--backlog-high-water-bytes", &HIGH_WATER.to_string()])
        .args([
            "--backlog-full-timeout-ms",
            &FULL_TIMEOUT.as_millis().to_string(),
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn highwater serve");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let binary = Binary { child, addr };
    wait_ready(addr).await;
    binary
}

/// A `/proc/<pid>/status` field in bytes (`VmRSS`, `VmHWM`).
fn memory_of(pid: u32, field: &str) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kib: usize = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unreadable {line:?}"));
    kib * 1024
}

async fn insert_large_row(client: &tokio_postgres::Client, id: i64) {
    // md5 text repeated: cheap for Postgres (TOAST compresses it), full size on the wire.
    let repeats = ROW_BYTES / 32;
    client
        .execute(
            "INSERT INTO items VALUES ($1::int8, repeat(md5($1::int8::text), $2))",
            &[&id, &i32::try_from(repeats).unwrap()],
        )
        .await
        .unwrap();
}

/// The slot's confirmed position: what the server acknowledged as durably stored.
async fn confirmed_flush(client: &tokio_postgres::Client) -> String {
    client
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_type = 'logical'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

async fn current_wal(client: &tokio_postgres::Client) -> String {
    client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0)
}

async fn paused(addr: SocketAddr) -> bool {
    health(addr).await["upstreamPaused"]
        .as_bool()
        .expect("upstreamPaused in /health")
}

/// A change-stream client whose socket has a small receive buffer, so that once it stops
/// reading the server's writes to it block instead of vanishing into kernel buffers.
async fn connect_small_buffer(addr: SocketAddr, path: &str) -> WebSocketStream<TcpStream> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    let stream = socket.connect(addr).await.unwrap();
    let (ws, _) = tokio_tungstenite::client_async(format!("ws://{addr}{path}"), stream)
        .await
        .expect("websocket handshake");
    ws
}

/// Progress of a subscriber that follows the stream in the background.
#[derive(Default)]
struct Progress {
    commits: AtomicUsize,
    stop: AtomicBool,
}

/// Where the slow subscribers start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// At the replica version: catching up from the change log, live changes in a backlog.
    ReplicaVersion,
    /// At the last commit: live from the first frame.
    LastCommit,
}

/// Reads what the server wrote to a subscriber that had stopped reading, up to the close.
async fn read_to_close(
    socket: &mut WebSocketStream<TcpStream>,
) -> (
    usize,
    Option<tokio_tungstenite::tungstenite::protocol::CloseFrame>,
) {
    tokio::time::timeout(PROMPT, async {
        let mut frames = 0usize;
        loop {
            match socket.next().await {
                Some(Ok(Message::Text(text))) => {
                    decode_downstream_frame(text.as_str())
                        .unwrap_or_else(|e| panic!("invalid frame {text}: {e}"));
                    frames += 1;
                }
                Some(Ok(Message::Close(frame))) => return (frames, frame),
                Some(Ok(_)) => {}
                Some(Err(e)) => panic!("the connection broke without a close frame: {e}"),
                None => panic!("the connection ended without a close frame"),
            }
        }
    })
    .await
    .expect("the close arrives")
}

/// Two subscribers stop reading and acking while large transactions stream in; a third
/// follows everything. `slow` stops for good; `late` reads again once the stream resumed.
async fn slow_subscribers_are_held_then_dropped(start: Start) {
    let pg = start_pg().await;
    let client = Arc::new(pg.connect().await.unwrap());
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new("backpressure");
    let server = start_server(&pg.url(), data.path(), free_port()).await;
    let addr = server.addr;
    let pid = server.child.id();
    let rv = replica_version(addr).await;

    // A change log to catch up on: LOGGED_TXNS × ROW_BYTES, well above the high-water mark.
    for id in 1..=LOGGED_TXNS {
        insert_large_row(&client, id).await;
    }
    let logged = pg_items(&client).await;
    let mut healthy = Subscriber::connect(addr, &changes_path(6, &rv, &rv)).await;
    assert!(
        healthy
            .follow(tokio::time::Instant::now() + PROMPT, |m| m.rows == logged)
            .await
    );

    // The slow subscribers never read or ack from here on.
    let from = match start {
        Start::ReplicaVersion => rv.clone(),
        Start::LastCommit => healthy.model.watermark().unwrap().clone(),
    };
    let slow = connect_small_buffer(addr, &changes_path(6, &rv, &from)).await;
    let mut late = connect_small_buffer(addr, &changes_path(6, &rv, &from)).await;

    // The healthy one follows everything in the background, acking each frame.
    let progress = Arc::new(Progress::default());
    let follower = {
        let progress = progress.clone();
        tokio::spawn(async move {
            while !progress.stop.load(Ordering::Relaxed) {
                let deadline = tokio::time::Instant::now() + Duration::from_millis(200);
                let followed = healthy
                    .follow_until(deadline, |m| {
                        progress.commits.store(m.commits.len(), Ordering::Relaxed);
                        progress.stop.load(Ordering::Relaxed)
                    })
                    .await;
                // A closed stream answers at once: looping on it would never yield.
                if followed == Followed::Closed {
                    break;
                }
            }
            healthy
        })
    };

    // A steady stream of large transactions upstream.
    let writing = Arc::new(AtomicBool::new(true));
    let written = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (client, writing, written) = (client.clone(), writing.clone(), written.clone());
        tokio::spawn(async move {
            let mut id = LOGGED_TXNS;
            while writing.load(Ordering::Relaxed) {
                id += 1;
                insert_large_row(&client, id).await;
                written.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };

    // The server's memory, sampled throughout.
    let peak_rss = Arc::new(AtomicUsize::new(0));
    let sampler = {
        let (peak_rss, writing) = (peak_rss.clone(), writing.clone());
        tokio::spawn(async move {
            while writing.load(Ordering::Relaxed) {
                peak_rss.fetch_max(memory_of(pid, "VmRSS"), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    // (1) Back-pressure: the slow subscribers fill up and the upstream is paused.
    let deadline = tokio::time::Instant::now() + PROMPT;
    while !paused(addr).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the upstream was never paused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Commits already forwarded are still stored and acknowledged; then nothing moves, while
    // Postgres keeps taking writes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sample = || async {
        (
            confirmed_flush(&client).await,
            health(addr).await["lastWatermark"].clone(),
            progress.commits.load(Ordering::Relaxed),
            current_wal(&client).await,
            written.load(Ordering::Relaxed),
        )
    };
    assert!(paused(addr).await, "the pause ended too early");
    let before = sample().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(paused(addr).await, "the pause ended too early");
    let after = sample().await;
    assert!(
        after.4 > before.4,
        "the writer stalled: {before:?} {after:?}"
    );
    assert_ne!(after.3, before.3, "Postgres WAL did not grow");
    assert_eq!(
        (&after.0, &after.1, after.2),
        (&before.0, &before.1, before.2),
        "replication moved while paused"
    );

    // (2) After the full-backlog timeout both are dropped and the stream resumes.
    let deadline = tokio::time::Instant::now() + FULL_TIMEOUT + PROMPT;
    while paused(addr).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stuck subscribers were never dropped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // `late` reads again: what was written to it, then the close.
    let (frames, close) = read_to_close(&mut late).await;
    let close = close.expect("a close frame with a code");
    assert_eq!(close.code, CloseCode::Again, "{close:?}");
    assert!(close.reason.contains("backlog"), "{close:?}");
    assert!(frames > 0);
    drop(late);
    // `slow` never reads again: the server lets go of its socket all the same.
    let deadline = tokio::time::Instant::now() + PROMPT;
    while health(addr).await["connections"] != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server still holds the connection of a peer that stopped reading"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(slow);

    let deadline = tokio::time::Instant::now() + PROMPT;
    let resumed_from = after.2;
    while progress.commits.load(Ordering::Relaxed) <= resumed_from {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the healthy subscriber got nothing after the drop"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    writing.store(false, Ordering::Relaxed);
    writer.await.unwrap();
    sampler.await.unwrap();

    // The healthy subscriber received every transaction once, in order, and equals Postgres.
    let expected = pg_items(&client).await;
    let total = usize::try_from(LOGGED_TXNS).unwrap() + written.load(Ordering::Relaxed);
    assert_eq!(expected.len(), total);
    let deadline = tokio::time::Instant::now() + PROMPT;
    while progress.commits.load(Ordering::Relaxed) < total {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the healthy subscriber did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    progress.stop.store(true, Ordering::Relaxed);
    let healthy = follower.await.unwrap();
    let model = healthy.close().await;
    // `Model` checks each begin comes after the last commit: no repeats, no reordering.
    assert_eq!(model.commits.len(), total, "a transaction was lost");
    assert_eq!(model.rollbacks, 0);
    assert_eq!(model.rows, expected);

    // Memory stayed bounded the whole time.
    let peak = memory_of(pid, "VmHWM").max(peak_rss.load(Ordering::Relaxed));
    eprintln!(
        "{start:?}: serve peak RSS {:.1} MiB (bound {:.1} MiB), {} transactions written",
        peak as f64 / MIB as f64,
        MEMORY_BOUND as f64 / MIB as f64,
        written.load(Ordering::Relaxed)
    );
    assert!(
        peak < MEMORY_BOUND,
        "serve's peak RSS {peak} bytes exceeds {MEMORY_BOUND}"
    );
    assert!(server.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catching_up_subscribers_that_stop_reading_pause_upstream_with_bounded_memory_then_get_1013(
) {
    slow_subscribers_are_held_then_dropped(Start::ReplicaVersion).await;
}

/// A live subscriber that stopped reading used to have every later frame queued for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_subscribers_that_stop_reading_pause_upstream_with_bounded_memory_then_get_1013() {
    slow_subscribers_are_held_then_dropped(Start::LastCommit).await;
}
