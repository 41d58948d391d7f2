//! Relay mode (`highwater serve --from ws://…`) against a real Postgres: a relay restores its
//! primary's snapshot, follows its change stream and ends equal to Postgres; its subscribers
//! get the primary's transactions gap-free; it survives `kill -9` without restoring again; relays
//! chain; and a primary that changed its replica version makes it restore anew.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use highwater_engine::watermark::{Lsn, Watermark};
use highwater_host::serve::{ServeArgs, WATERMARK_HEADER};
use serde_json::Value;

use crate::serve_support::*;

/// A relay of `primary`, in this process.
async fn start_relay(primary: SocketAddr, data: &Path, port: u16) -> InProcess {
    let mut args = ServeArgs::relay(format!("ws://{primary}"), data);
    args.port = port;
    args.host = "127.0.0.1".to_owned();
    InProcess::start(args).await
}

/// The `highwater` binary as a relay of `primary`.
async fn spawn_relay_binary(primary: SocketAddr, data: &Path, port: u16) -> Binary {
    let child = Command::new(env!("CARGO_BIN_EXE_highwater"))
        .arg("serve")
        .args(["--from", &format!("ws://{primary}")])
        .arg("--data")
        .arg(data)
        .args(["--port", &port.to_string(), "--host", "127.0.0.1"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn highwater serve --from");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let binary = Binary { child, addr };
    wait_ready(addr).await;
    binary
}

/// `items` as a SQLite replica file holds it.
fn sqlite_items(path: &Path) -> BTreeMap<i64, Value> {
    let db =
        rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    let mut stmt = db.prepare("SELECT id, v FROM items ORDER BY id").unwrap();
    let rows = stmt
        .query_map([], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, Option<String>>(1)?))
        })
        .unwrap()
        .map(|r| {
            let (id, v) = r.unwrap();
            (id, serde_json::json!({"id": id, "v": v}))
        })
        .collect();
    rows
}

/// Waits until the replica in `data` holds exactly `expected`.
/// Waits until every server's `lastWatermark` is the same, and returns it. `lastWatermark` is
/// the newest durable commit: a replica shows a commit's rows as soon as it is applied, before
/// the WAL sync that makes it durable returns, so a server whose rows are all there may still
/// report the commit before. With nothing more written, the servers must meet.
async fn durable_everywhere(servers: &[SocketAddr]) -> Value {
    let deadline = tokio::time::Instant::now() + PROMPT;
    loop {
        let mut seen = Vec::new();
        for addr in servers {
            seen.push(health(*addr).await["lastWatermark"].clone());
        }
        if seen.windows(2).all(|pair| pair[0] == pair[1]) {
            return seen.swap_remove(0);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the servers' durable watermarks did not meet: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn replica_reaches(data: &Path, expected: &BTreeMap<i64, Value>) {
    let deadline = tokio::time::Instant::now() + PROMPT;
    loop {
        let rows = sqlite_items(&data.join("replica.db"));
        if &rows == expected {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica in {} did not converge: {} rows, expected {}",
            data.display(),
            rows.len(),
            expected.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn watermark_of(health: &Value, key: &str) -> Watermark {
    Watermark::parse(health[key].as_str().expect(key)).unwrap()
}

/// Inserts `ids`, updates every other one, deletes every third, in one transaction per id.
async fn churn(client: &tokio_postgres::Client, ids: std::ops::Range<i64>) {
    for i in ids {
        client
            .batch_execute(&format!(
                "BEGIN; INSERT INTO items VALUES ({i}, 'new {i}'); \
                 UPDATE items SET v = 'touched {i}' WHERE id = {i} / 2; \
                 DELETE FROM items WHERE id = {i} - 7 AND {i} % 3 = 0; COMMIT"
            ))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_chained_to_a_primary_ends_equal_to_postgres() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    churn(&client, 0..20).await;
    let primary_data = DataDir::new("relay-primary");
    // Quick backups and purges: the primary's log then shrinks only as far as the relay acked.
    let mut primary_args = serve_args(&pg.url(), primary_data.path(), free_port());
    primary_args.backup_interval_ms = 100;
    primary_args.purge_delay_ms = 100;
    let primary = InProcess::start(primary_args).await;
    // Changes the primary streams, before the relay exists.
    churn(&client, 20..40).await;
    client
        .batch_execute("UPDATE items SET v = NULL WHERE id % 5 = 0")
        .await
        .unwrap();
    replica_reaches(primary_data.path(), &pg_items(&client).await).await;

    let relay_data = DataDir::new("relay");
    let relay = start_relay(primary.addr, relay_data.path(), free_port()).await;
    let primary_health = health(primary.addr).await;
    let relay_health = health(relay.addr).await;
    assert_eq!(
        relay_health["replicaVersion"], primary_health["replicaVersion"],
        "a relay serves the primary's replica version"
    );
    // The relay's log starts at the restored snapshot, after the primary's initial sync:
    // it does not claim transactions it never had.
    let relay_min = watermark_of(&relay_health, "minWatermark");
    assert!(relay_min > watermark_of(&relay_health, "replicaVersion"));
    assert_eq!(relay_min, watermark_of(&relay_health, "lastWatermark"));

    // Changes after the relay started.
    churn(&client, 40..70).await;
    client
        .batch_execute("DELETE FROM items WHERE id BETWEEN 10 AND 15; UPDATE items SET v = 'last'")
        .await
        .unwrap();
    let rows = pg_items(&client).await;
    replica_reaches(relay_data.path(), &rows).await;
    let last = durable_everywhere(&[primary.addr, relay.addr]).await;
    // The relay acked every frame once stored: the primary's purge floor (the least of its
    // backup and its subscribers' acks) reaches the newest transaction.
    let deadline = tokio::time::Instant::now() + PROMPT;
    while health(primary.addr).await["minWatermark"] != last {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the primary's change log was not purged up to {last}: the relay's acks lag"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    relay.stop().await;
    primary.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_of_a_relay_get_the_primarys_transactions_gap_free() {
    let pg = start_pg().await;
    let client = Arc::new(pg.connect().await.unwrap());
    client.batch_execute(ITEMS_DDL).await.unwrap();
    churn(&client, 0..10).await;
    let primary_data = DataDir::new("gapfree-primary");
    let primary = InProcess::start(serve_args(&pg.url(), primary_data.path(), free_port())).await;
    churn(&client, 10..20).await;
    replica_reaches(primary_data.path(), &pg_items(&client).await).await;
    let relay_data = DataDir::new("gapfree-relay");
    let relay = start_relay(primary.addr, relay_data.path(), free_port()).await;
    churn(&client, 20..30).await;
    replica_reaches(relay_data.path(), &pg_items(&client).await).await;

    // A new replica of the relay: its snapshot, then its change stream from there.
    let (status, headers, body) = http_get(relay.addr, "/replica/snapshot").await.unwrap();
    assert!(status.contains("200"), "{status}");
    let snapshot_at = headers
        .iter()
        .find(|(k, _)| k == WATERMARK_HEADER)
        .map(|(_, v)| Watermark::parse(v).unwrap())
        .expect("the snapshot names its watermark");
    let snapshot_dir = DataDir::new("gapfree-snapshot");
    let snapshot_path = snapshot_dir.path().join("snapshot.db");
    std::fs::write(&snapshot_path, body).unwrap();
    let rv = replica_version(relay.addr).await;

    let writer = {
        let client = client.clone();
        tokio::spawn(async move { churn(&client, 30..90).await })
    };
    let mut from_relay = Subscriber::connect(relay.addr, &changes_path(6, &rv, &snapshot_at)).await;
    from_relay.model.rows = sqlite_items(&snapshot_path);
    let mut from_primary =
        Subscriber::connect(primary.addr, &changes_path(6, &rv, &snapshot_at)).await;
    from_primary.model.rows = sqlite_items(&snapshot_path);
    writer.await.unwrap();
    let rows = pg_items(&client).await;
    let deadline = tokio::time::Instant::now() + PROMPT;
    // Every frame decodes with the engine's decoders and commits strictly increase (checked
    // as they are applied); ending equal to Postgres from the snapshot means no gap.
    assert!(from_relay.follow(deadline, |m| m.rows == rows).await);
    assert!(from_primary.follow(deadline, |m| m.rows == rows).await);
    let through_relay = from_relay.close().await;
    let direct = from_primary.close().await;
    assert_eq!(through_relay.commits, direct.commits);
    assert_eq!(through_relay.commits.len(), 60);
    assert!(through_relay
        .commits
        .first()
        .is_some_and(|c| *c > snapshot_at));
    assert_eq!(through_relay.rollbacks, 0);

    // A subscriber older than the relay's log is refused, not silently served from the middle.
    let primary_min = watermark_of(&health(primary.addr).await, "minWatermark");
    let relay_min = watermark_of(&health(relay.addr).await, "minWatermark");
    assert!(primary_min < relay_min);
    let before_log = Lsn(relay_min.to_lsn().unwrap().0 - 1).to_watermark();
    let mut stale = Subscriber::connect(relay.addr, &changes_path(6, &rv, &before_log)).await;
    let error = stale.error().await;
    assert_eq!(error.error_type.as_u64(), Some(2), "{error:?}");
    relay.stop().await;
    primary.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_stream_resumes_without_restoring() {
    let pg = start_pg().await;
    let client = Arc::new(pg.connect().await.unwrap());
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let primary_data = DataDir::new("kill-primary");
    let primary = InProcess::start(serve_args(&pg.url(), primary_data.path(), free_port())).await;
    churn(&client, 0..10).await;
    replica_reaches(primary_data.path(), &pg_items(&client).await).await;
    let relay_data = DataDir::new("kill-relay");
    let port = free_port();
    let relay = spawn_relay_binary(primary.addr, relay_data.path(), port).await;
    let restored = health(relay.addr).await;
    let restored_at = watermark_of(&restored, "minWatermark");

    let writer = {
        let client = client.clone();
        tokio::spawn(async move {
            for chunk in 0..15i64 {
                churn(&client, 10 + chunk * 10..20 + chunk * 10).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // Kill it once it has stored part of the load, with more still arriving.
    while watermark_of(&health(relay.addr).await, "lastWatermark") <= restored_at {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    relay.kill9();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let relay = spawn_relay_binary(primary.addr, relay_data.path(), port).await;
    // Same change log, seeded at the same point: no second restore.
    let resumed = health(relay.addr).await;
    assert_eq!(watermark_of(&resumed, "minWatermark"), restored_at);
    assert_eq!(resumed["replicaVersion"], restored["replicaVersion"]);
    assert!(watermark_of(&resumed, "lastWatermark") > restored_at);
    writer.await.unwrap();
    let rows = pg_items(&client).await;
    replica_reaches(relay_data.path(), &rows).await;
    assert_eq!(
        watermark_of(&health(relay.addr).await, "minWatermark"),
        restored_at
    );
    // Its change log serves every transaction since the restore, once each.
    let rv = replica_version(relay.addr).await;
    let mut replay = Subscriber::connect(relay.addr, &changes_path(6, &rv, &restored_at)).await;
    replay.model.rows = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + PROMPT;
    let last = watermark_of(&health(primary.addr).await, "lastWatermark");
    assert!(
        replay
            .follow(deadline, |m| m.watermark() == Some(&last))
            .await
    );
    assert_eq!(replay.model.commits.len(), 150);
    replay.close().await;
    assert!(relay.terminate().await.success());
    primary.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_of_a_relay_ends_equal_to_postgres() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    churn(&client, 0..10).await;
    let primary_data = DataDir::new("chain-primary");
    let primary = InProcess::start(serve_args(&pg.url(), primary_data.path(), free_port())).await;
    churn(&client, 10..20).await;
    let first_data = DataDir::new("chain-first");
    let first = start_relay(primary.addr, first_data.path(), free_port()).await;
    churn(&client, 20..30).await;
    replica_reaches(first_data.path(), &pg_items(&client).await).await;
    let second_data = DataDir::new("chain-second");
    let second = start_relay(first.addr, second_data.path(), free_port()).await;
    churn(&client, 30..60).await;
    client
        .batch_execute(
            "DELETE FROM items WHERE id < 25; UPDATE items SET v = 'end' WHERE id % 2 = 0",
        )
        .await
        .unwrap();
    // A schema change travels down the chain like any transaction.
    client
        .batch_execute(
            "CREATE TABLE notes (id int8 PRIMARY KEY, body text); \
             INSERT INTO notes SELECT g, 'note ' || g FROM generate_series(1, 5) g",
        )
        .await
        .unwrap();
    client
        .batch_execute("DELETE FROM items WHERE id = 59")
        .await
        .unwrap();
    let rows = pg_items(&client).await;
    replica_reaches(second_data.path(), &rows).await;
    let notes: Vec<(i64, String)> =
        rusqlite::Connection::open(second_data.path().join("replica.db"))
            .unwrap()
            .prepare("SELECT id, body FROM notes ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
    let expected: Vec<(i64, String)> = (1..=5).map(|g| (g, format!("note {g}"))).collect();
    assert_eq!(notes, expected);
    durable_everywhere(&[primary.addr, first.addr, second.addr]).await;
    assert_eq!(
        health(second.addr).await["replicaVersion"],
        health(primary.addr).await["replicaVersion"]
    );
    second.stop().await;
    first.stop().await;
    primary.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_restores_again_when_the_primary_changes_replica_version() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    churn(&client, 0..10).await;
    let port = free_port();
    let old_data = DataDir::new("resync-primary-old");
    let primary = InProcess::start(serve_args(&pg.url(), old_data.path(), port)).await;
    let relay_data = DataDir::new("resync-relay");
    let relay = start_relay(primary.addr, relay_data.path(), free_port()).await;
    churn(&client, 10..20).await;
    replica_reaches(relay_data.path(), &pg_items(&client).await).await;
    let old_version = replica_version(relay.addr).await;

    // The primary starts over from a new initial sync: a new replica version.
    primary.stop().await;
    churn(&client, 20..30).await;
    let new_data = DataDir::new("resync-primary-new");
    let primary = InProcess::start(serve_args(&pg.url(), new_data.path(), port)).await;
    let new_version = replica_version(primary.addr).await;
    assert_ne!(new_version, old_version);
    churn(&client, 30..40).await;
    let rows = pg_items(&client).await;

    // The relay is told WrongReplicaVersion, wipes its replica and restores the new one.
    let deadline = tokio::time::Instant::now() + PROMPT;
    loop {
        let ready = match http_get(relay.addr, "/health").await {
            Ok((status, _, body)) if status.contains("200") => {
                let health: Value = serde_json::from_slice(&body).unwrap();
                health["replicaVersion"] == new_version.as_str()
            }
            _ => false,
        };
        if ready {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay did not restore the new replica version"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    replica_reaches(relay_data.path(), &rows).await;
    relay.stop().await;
    primary.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_chain_with_replication_tokens_ends_equal_to_postgres() {
    use highwater_host::serve::{ReplicationToken, SNAPSHOT_PATH};
    let token = |text: &str| Some(ReplicationToken::new(text).unwrap());
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    churn(&client, 0..20).await;
    let primary_data = DataDir::new("relay-token-primary");
    let mut primary_args = serve_args(&pg.url(), primary_data.path(), free_port());
    primary_args.security.replication_token = token("primary-token-0123456789");
    let primary = InProcess::start(primary_args).await;
    // The first relay sends the primary's token and requires its own.
    let first_data = DataDir::new("relay-token-first");
    let mut first_args = ServeArgs::relay(format!("ws://{}", primary.addr), first_data.path());
    first_args.port = free_port();
    first_args.security.replication_token = token("first-relay-token-0123456789");
    first_args.security.upstream_token = token("primary-token-0123456789");
    let first = InProcess::start(first_args).await;
    // The second relay follows the first with the first relay's token.
    let second_data = DataDir::new("relay-token-second");
    let mut second_args = ServeArgs::relay(format!("ws://{}", first.addr), second_data.path());
    second_args.port = free_port();
    second_args.security.upstream_token = token("first-relay-token-0123456789");
    let second = InProcess::start(second_args).await;

    churn(&client, 20..50).await;
    let rows = pg_items(&client).await;
    replica_reaches(first_data.path(), &rows).await;
    replica_reaches(second_data.path(), &rows).await;
    // Each node guards its own endpoints; the second relay has no token configured.
    for (addr, status) in [
        (primary.addr, "401"),
        (first.addr, "401"),
        (second.addr, "200"),
    ] {
        let (line, _, _) = http_get(addr, SNAPSHOT_PATH).await.unwrap();
        assert!(
            line.contains(status),
            "{addr}: expected {status}, got {line}"
        );
    }
    second.stop().await;
    first.stop().await;
    primary.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_sends_the_replication_token_from_the_environment() {
    use highwater_host::serve::{ReplicationToken, REPLICATION_TOKEN_ENV};
    const TOKEN: &str = "watch-token-0123456789";
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new("watch-token");
    let mut args = serve_args(&pg.url(), data.path(), free_port());
    args.security.replication_token = Some(ReplicationToken::new(TOKEN).unwrap());
    let primary = InProcess::start(args).await;
    // Transactions after the initial sync, so the change log holds commits to watch.
    churn(&client, 0..5).await;
    replica_reaches(data.path(), &pg_items(&client).await).await;
    let url = format!("ws://{}", primary.addr);
    let watch = move |token: Option<&'static str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_highwater"));
        command
            .args(["watch", &url, "--from-start", "--commits", "1"])
            .env_remove(REPLICATION_TOKEN_ENV);
        if let Some(token) = token {
            command.env(REPLICATION_TOKEN_ENV, token);
        }
        command.output().unwrap()
    };
    let (refused, watched) = tokio::task::spawn_blocking(move || (watch(None), watch(Some(TOKEN))))
        .await
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("401"));
    assert!(
        watched.status.success(),
        "{}",
        String::from_utf8_lossy(&watched.stderr)
    );
    assert!(String::from_utf8_lossy(&watched.stdout).contains("\"commit\""));
    primary.stop().await;
}
