//! `kill -9` of the real `highwater serve` binary in the middle of a write load, then a restart:
//! subscribers resume from their last applied commit and end equal to Postgres, and the change
//! log that survived the crash still serves the whole history.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use highwater_engine::watermark::Watermark;
use serde_json::Value;
use tokio::sync::watch;

use crate::serve_support::*;

/// Follows the stream from the replica version, reconnecting from its last applied commit
/// whenever the socket drops, until its rows equal `expected`. Returns the model and the
/// number of connections it took.
async fn follow_with_reconnects(
    addr: SocketAddr,
    rv: Watermark,
    expected: watch::Receiver<Option<BTreeMap<i64, Value>>>,
) -> (Model, usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(25);
    let mut model = Model::default();
    let mut connections = 0;
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscriber did not converge: {} rows, last commit {:?}",
            model.rows.len(),
            model.watermark()
        );
        let watermark = model.watermark().unwrap_or(&rv).clone();
        let Ok(mut s) = Subscriber::try_connect(addr, &changes_path(6, &rv, &watermark)).await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        connections += 1;
        s.model = std::mem::take(&mut model);
        loop {
            let target = expected.borrow().clone();
            let step = tokio::time::Instant::now() + Duration::from_millis(200);
            let ended = s
                .follow_until(step, |m| target.as_ref().is_some_and(|t| &m.rows == t))
                .await;
            match ended {
                Followed::Done => return (s.close().await, connections),
                Followed::TimedOut if tokio::time::Instant::now() < deadline => {}
                Followed::TimedOut | Followed::Closed => break,
            }
        }
        model = s.close().await;
        model.disconnected();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_and_restart_lose_nothing_and_subscribers_resume() {
    let pg = start_pg().await;
    let client = Arc::new(pg.connect().await.unwrap());
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new("restart");
    let port = free_port();
    let server = Binary::start(&pg.url(), data.path(), port).await;
    let addr = server.addr;
    let rv = replica_version(addr).await;

    let (expected_tx, expected) = watch::channel(None);
    let follower = tokio::spawn(follow_with_reconnects(addr, rv.clone(), expected));
    let writer = {
        let client = client.clone();
        tokio::spawn(async move {
            for i in 0..150i64 {
                client
                    .batch_execute(&format!(
                        "BEGIN; INSERT INTO items VALUES ({i}, 'new'); \
                         UPDATE items SET v = 'touched {i}' WHERE id = {i} / 2; \
                         DELETE FROM items WHERE id = {i} - 10 AND {i} % 3 = 0; COMMIT"
                    ))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        })
    };
    // Kill it once it has stored part of the load, with more still arriving.
    while health(addr).await["lastWatermark"] == rv.as_str() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.kill9();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let server = Binary::start(&pg.url(), data.path(), port).await;
    // Same replica, same history: no resync happened.
    assert_eq!(replica_version(addr).await, rv);
    writer.await.unwrap();
    let rows = pg_items(&client).await;
    expected_tx.send_replace(Some(rows.clone()));
    let (model, connections) = follower.await.unwrap();
    assert_eq!(model.rows, rows);
    assert!(connections >= 2, "the subscriber never saw the crash");

    // A subscriber from the replica version gets every transaction again, from the log.
    let mut fresh = Subscriber::connect(addr, &changes_path(6, &rv, &rv)).await;
    let deadline = tokio::time::Instant::now() + PROMPT;
    assert!(fresh.follow(deadline, |m| m.rows == rows).await);
    assert_eq!(fresh.model.commits, model.commits);
    assert_eq!(fresh.model.commits.len(), 150);
    fresh.close().await;

    // SIGTERM stops it cleanly, with the replica equal to Postgres.
    assert!(server.terminate().await.success());
    let replica = rusqlite::Connection::open(data.path().join("replica.db")).unwrap();
    let mut stmt = replica
        .prepare("SELECT id, v FROM items ORDER BY id")
        .unwrap();
    let replica_rows: BTreeMap<i64, Value> = stmt
        .query_map([], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, Option<String>>(1)?))
        })
        .unwrap()
        .map(|r| {
            let (id, v) = r.unwrap();
            (id, serde_json::json!({"id": id, "v": v}))
        })
        .collect();
    assert_eq!(replica_rows, rows);
}

/// `items` as the replica file holds it (read while the server runs: WAL readers see the last
/// commit), as [`pg_items`] gives Postgres's.
fn replica_items(data: &std::path::Path) -> BTreeMap<i64, Value> {
    let replica = rusqlite::Connection::open(data.join("replica.db")).unwrap();
    let mut stmt = replica
        .prepare("SELECT id, v FROM items ORDER BY id")
        .unwrap();
    stmt.query_map([], |r| {
        Ok((r.get::<_, i64>(0)?, r.get::<_, Option<String>>(1)?))
    })
    .unwrap()
    .map(|r| {
        let (id, v) = r.unwrap();
        (id, serde_json::json!({"id": id, "v": v}))
    })
    .collect()
}

fn replica_scalar(data: &std::path::Path, sql: &str) -> i64 {
    rusqlite::Connection::open(data.join("replica.db"))
        .unwrap()
        .query_row(sql, [], |r| r.get(0))
        .unwrap()
}

/// The replica's committed position and the slot's acknowledged one.
async fn positions(client: &tokio_postgres::Client, data: &std::path::Path) -> (u64, u64) {
    let stored: String = rusqlite::Connection::open(data.join("replica.db"))
        .unwrap()
        .query_row(r#"SELECT "lsn" FROM "_hw_state""#, [], |r| r.get(0))
        .unwrap();
    let acked: String = client
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots \
             WHERE slot_name = 'highwater_slot'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let lsn = |text: &str| text.parse::<highwater_engine::watermark::Lsn>().unwrap().0;
    (lsn(&stored), lsn(&acked))
}

/// Commits `count` single-row insert transactions in one round trip, ids from `first`.
async fn burst(client: &tokio_postgres::Client, first: i64, count: i64) {
    let sql: String = (first..first + count)
        .map(|id| format!("BEGIN; INSERT INTO items VALUES ({id}, 'x'); COMMIT;"))
        .collect();
    client.batch_execute(&sql).await.unwrap();
}

/// `kill -9` of `serve` paused at `point` of a group of several transactions: the replica's
/// commits may be ahead of what was synced and acknowledged, never the acknowledgement ahead
/// of the disk. After a restart nothing is missing and nothing was applied twice.
async fn sigkill_at(point: &str) {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new(&format!("serve-{point}"));
    let marker = data.path().join("paused");
    let pause = format!("{point}:{}", marker.display());
    let port = free_port();
    let server = Binary::start_with_env(
        &pg.url(),
        data.path(),
        port,
        &[("HIGHWATER_PAUSE_AT", pause.as_str())],
    )
    .await;
    let rv = replica_version(server.addr).await;
    let mut live = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;

    // Thousands of small transactions committed at once: the server groups them.
    burst(&client, 1, 3000).await;
    let deadline = tokio::time::Instant::now() + PROMPT;
    while !marker.exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no group of two or more transactions reached {point}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    if point == "before-group-sync" {
        // Only the sync's thread is held: the ingest thread goes on committing, and
        // subscribers get every transaction, none of it yet acknowledged to Postgres.
        let deadline = tokio::time::Instant::now() + PROMPT;
        assert!(
            live.follow(deadline, |m| m.rows.len() == 3000).await,
            "the subscriber got {} of 3000 rows while a sync was held",
            live.model.rows.len()
        );
    }
    let (stored, acked) = positions(&client, data.path()).await;
    assert!(
        stored > acked,
        "a group not reported durable was acknowledged ({stored} <= {acked})"
    );
    server.kill9();
    drop(live);

    // More arrives while it is down; the restart gets the unacknowledged rest again. Had an
    // acknowledgement gone beyond the synced commits, rows would be missing below.
    burst(&client, 3001, 500).await;
    let server = Binary::start(&pg.url(), data.path(), port).await;
    assert_eq!(replica_version(server.addr).await, rv, "no resync");
    let rows = pg_items(&client).await;
    let deadline = tokio::time::Instant::now() + PROMPT;
    while replica_items(data.path()) != rows {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica did not catch up after {point}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every insert took exactly one seq, in one unbroken run: none was applied twice.
    let gaps = replica_scalar(
        data.path(),
        "SELECT max(_hw_seq) - min(_hw_seq) + 1 - count(*) FROM items",
    );
    assert_eq!(gaps, 0, "a transaction was applied more than once");
    assert_eq!(rows.len(), 3500);
    // A subscriber from the replica version gets all of it from the change log.
    let mut fresh = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let deadline = tokio::time::Instant::now() + PROMPT;
    assert!(fresh.follow(deadline, |m| m.rows == rows).await);
    fresh.close().await;
    assert!(server.terminate().await.success(), "clean exit on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_a_group_commit_and_its_sync_loses_and_duplicates_nothing() {
    sigkill_at("after-group-commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_while_a_sync_is_held_forwards_everything_and_loses_nothing() {
    sigkill_at("before-group-sync").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_a_sync_and_its_ack_loses_and_duplicates_nothing() {
    sigkill_at("after-group-sync").await;
}
