//! `highwater serve` against a real Postgres with real WebSocket subscribers: catch-up from any
//! stored watermark, live changes, errors and protocol violations, reservations and purging.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use highwater_engine::change_stream::{DownstreamMessage, ErrorKind};
use highwater_engine::watermark::Watermark;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;

use crate::serve_support::*;

fn deadline() -> tokio::time::Instant {
    tokio::time::Instant::now() + PROMPT
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_catch_up_from_any_watermark_and_follow_live_changes() {
    let pg = start_pg().await;
    let client = Arc::new(pg.connect().await.unwrap());
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new("stream");
    let server = InProcess::start(serve_args(&pg.url(), data.path(), free_port())).await;
    let rv = replica_version(server.addr).await;
    for i in 1..=5 {
        client
            .batch_execute(&format!(
                "BEGIN; INSERT INTO items VALUES ({i}, 'v{i}'), ({i} + 100, 'x');
                 UPDATE items SET v = 'u{i}' WHERE id = {i}; DELETE FROM items WHERE id = {i} + 100;
                 COMMIT"
            ))
            .await
            .unwrap();
    }
    let history = pg_items(&client).await;

    // A fresh subscriber at the replica version receives the full history.
    let mut a = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    assert!(a.follow(deadline(), |m| m.rows == history).await);
    assert_eq!(a.model.commits.len(), 5);
    assert!(a.model.statuses >= 1);

    // One at a middle watermark gets only the transactions after it.
    let middle = a.model.commits[2].clone();
    let mut b = Subscriber::connect(server.addr, &changes_path(5, &rv, &middle)).await;
    assert!(b.follow(deadline(), |m| m.commits.len() == 2).await);
    assert_eq!(b.model.commits, a.model.commits[3..]);

    // Live traffic while another subscriber (v7, merged socket) joins from the beginning.
    let writer = {
        let client = client.clone();
        tokio::spawn(async move {
            for i in 0..60i64 {
                let id = 1000 + i;
                client
                    .batch_execute(&format!(
                        "BEGIN; INSERT INTO items VALUES ({id}, 'live'); UPDATE items SET v = 'n{i}' WHERE id = 1; COMMIT"
                    ))
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut c = Subscriber::connect(server.addr, "/replication/v7/subscribe?taskID=c").await;
    c.send(&format!(
        r#"{{"id":1,"msg":["start-subscription",{{"taskID":"c","id":"c","mode":"serving","replicaVersion":"{rv}","watermark":"{rv}"}}]}}"#
    ))
    .await;
    writer.await.unwrap();
    let expected = pg_items(&client).await;
    assert_eq!(expected.len(), 5 + 60);
    assert!(a.follow(deadline(), |m| m.rows == expected).await);
    assert!(c.follow(deadline(), |m| m.rows == expected).await);
    let total = a.model.commits.len();
    assert_eq!(total, 5 + 60);
    assert!(b.follow(deadline(), |m| m.commits.len() == total - 3).await);
    // Catch-up and live met without a gap or a duplicate, in strictly increasing order.
    assert_eq!(c.model.commits, a.model.commits);
    assert_eq!(b.model.commits, a.model.commits[3..]);
    for s in [a, b, c] {
        s.close().await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_subscriptions_get_errors_and_protocol_violations_close_the_socket() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new("errors");
    let server = InProcess::start(serve_args(&pg.url(), data.path(), free_port())).await;
    let rv = replica_version(server.addr).await;
    client
        .batch_execute("INSERT INTO items VALUES (1, 'one')")
        .await
        .unwrap();

    // Wrong replica version: ["error",{"type":1,…}], then the close.
    let other = Watermark::parse("0a").unwrap();
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &other, &other)).await;
    let error = s.error().await;
    assert_eq!(error.kind(), Some(ErrorKind::WrongReplicaVersion));
    assert_eq!(
        error.message.unwrap(),
        format!("current replica version is {rv} (requested 0a)")
    );
    assert!(s.closed().await.is_some());

    // Unsupported versions and missing parameters: close 1002 with the exact reason.
    let cases = [
        (
            "/replication/v9/changes?id=a".to_owned(),
            "Error: Cannot service client at protocol v9. Supported protocols: [v1 ... v8]",
        ),
        (
            "/replication/v6/subscribe".to_owned(),
            "Error: Cannot service client at protocol v6. Supported protocols: [v7 ... v8]",
        ),
        (
            format!("/replication/v6/changes?id=a&replicaVersion={rv}"),
            "Error: invalid querystring - missing watermark",
        ),
        (
            "/replication/v4/snapshot".to_owned(),
            "Error: Missing taskID in snapshot request",
        ),
    ];
    for (path, reason) in cases {
        let mut s = Subscriber::connect(server.addr, &path).await;
        assert_eq!(
            s.closed().await,
            Some((CloseCode::Protocol, reason.to_owned())),
            "{path}"
        );
    }
    let (status, _, _) = http_get(server.addr, "/replication/v6/elsewhere")
        .await
        .unwrap();
    assert!(status.contains("404"), "{status}");

    // An out-of-order ack closes the socket.
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let first = s.frame().await.id().unwrap();
    let second = s.frame().await.id().unwrap();
    assert_eq!((first, second), (1, 2));
    s.ack(second).await;
    let (code, reason) = s.closed().await.expect("a close frame");
    assert_eq!(code, CloseCode::Protocol);
    assert!(reason.contains("expected an ack of frame 1"), "{reason}");

    // A frame that is not JSON too; the server goes on serving others.
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    s.send("not json").await;
    assert!(matches!(s.closed().await, Some((CloseCode::Protocol, _))));
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let expected = pg_items(&client).await;
    assert!(s.follow(deadline(), |m| m.rows == expected).await);
    s.close().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_server_restores_the_snapshot_its_reservation_pins_through_purges() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new("reserve");
    let port = free_port();
    let mut args = serve_args(&pg.url(), data.path(), port);
    args.purge_delay_ms = 200;
    args.backup_interval_ms = 50;
    let server = InProcess::start(args).await;
    let rv = replica_version(server.addr).await;
    let insert = |range: std::ops::Range<i64>| {
        range
            .map(|i| format!("INSERT INTO items VALUES ({i}, 'v{i}');"))
            .collect::<String>()
    };
    client.batch_execute(&insert(1..4)).await.unwrap();
    // Until the server has stored them, and reported them as its backup position.
    let stored = |h: &serde_json::Value| h["lastWatermark"] != rv.as_str();
    while !stored(&health(server.addr).await) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    // The legacy reservation: one status naming the backup.
    let mut reservation =
        Subscriber::connect(server.addr, "/replication/v6/snapshot?taskID=new").await;
    let frame = reservation.frame().await;
    let [DownstreamMessage::Status(status)] = frame.messages() else {
        panic!("expected the reservation status, got {frame:?}");
    };
    let backup_url = status.extra["backupURL"].as_str().unwrap().to_owned();
    assert_eq!(
        backup_url,
        format!("http://127.0.0.1:{port}/replica/snapshot")
    );
    assert_eq!(status.extra["replicaVersion"], rv.as_str());
    let pinned = Watermark::parse(status.extra["minWatermark"].as_str().unwrap()).unwrap();
    assert!(pinned > rv);
    reservation.ack(frame.id().unwrap()).await;

    // The new server downloads the backup: a replica at a known watermark.
    let (status, headers, body) = http_get(server.addr, "/replica/snapshot").await.unwrap();
    assert!(status.contains("200"), "{status}");
    let at = headers
        .iter()
        .find(|(k, _)| k == "x-highwater-watermark")
        .map(|(_, v)| Watermark::parse(v).unwrap())
        .expect("the watermark header");
    assert!(at >= pinned);
    let restored = DataDir::new("restored");
    let file = restored.path().join("replica.db");
    std::fs::write(&file, &body).unwrap();
    let mut model = Model::default();
    {
        let db = rusqlite::Connection::open(&file).unwrap();
        let mut stmt = db.prepare("SELECT id, v FROM items").unwrap();
        let rows = stmt
            .query_map([], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, Option<String>>(1)?))
            })
            .unwrap();
        for row in rows {
            let (id, v) = row.unwrap();
            model.rows.insert(id, serde_json::json!({"id": id, "v": v}));
        }
    }
    assert_eq!(model.rows, pg_items(&client).await);

    // Meanwhile more transactions, and purges — which stop at the reservation.
    for i in 4..9 {
        client.batch_execute(&insert(i..i + 1)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(health(server.addr).await["minWatermark"], pinned.as_str());

    // It subscribes from the snapshot's watermark; that ends the reservation.
    let path =
        format!("{}&initial=true", changes_path(6, &rv, &at)).replace("taskID=it", "taskID=new");
    let mut s = Subscriber::connect(server.addr, &path).await;
    s.model = model;
    let expected = pg_items(&client).await;
    assert!(s.follow(deadline(), |m| m.rows == expected).await);
    assert!(reservation.closed().await.is_some());
    s.close().await;
    while health(server.addr).await["connections"] != 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Unpinned, the next purge cuts the log to its newest transaction...
    client.batch_execute(&insert(9..10)).await.unwrap();
    let cut = tokio::time::Instant::now() + PROMPT;
    let newest = loop {
        let h = health(server.addr).await;
        if h["minWatermark"] == h["lastWatermark"] && h["minWatermark"] != pinned.as_str() {
            break h["minWatermark"].as_str().unwrap().to_owned();
        }
        assert!(tokio::time::Instant::now() < cut, "no purge: {h}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // ...and a subscriber still at the old position is told its watermark is too old.
    let mut late = Subscriber::connect(server.addr, &changes_path(6, &rv, &pinned)).await;
    let error = late.error().await;
    assert_eq!(error.kind(), Some(ErrorKind::WatermarkTooOld));
    assert_eq!(
        error.message.unwrap(),
        format!("earliest supported watermark is {newest} (requested {pinned})")
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_changes_reach_subscribers_and_the_replica_in_order() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new("ddl");
    let server = InProcess::start(serve_args(&pg.url(), data.path(), free_port())).await;
    let rv = replica_version(server.addr).await;
    client
        .batch_execute(
            "BEGIN; CREATE TABLE later (id int8 PRIMARY KEY, note text);
             INSERT INTO later VALUES (1, 'in the same transaction'); COMMIT;
             ALTER TABLE items ADD COLUMN extra int4;
             INSERT INTO items VALUES (1, 'one', 7);",
        )
        .await
        .unwrap();
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let expected = pg_items(&client).await;
    // One multi-statement query is one implicit transaction: two transactions in all.
    let reached = s.follow(deadline(), |m| m.commits.len() == 2).await;
    assert!(reached, "{:?}", s.model);
    // A new table's key index follows it (Zero's replicator keys rows by that index).
    assert_eq!(
        s.model.schema_changes,
        ["create-table", "create-index", "add-column"]
    );
    // The inserted row carries the new column; the model keeps what the stream sent.
    assert_eq!(s.model.rows[&1]["extra"], 7);
    assert_eq!(s.model.rows.len(), expected.len());
    s.close().await;
    server.stop().await;
    let replica = rusqlite::Connection::open(data.path().join("replica.db")).unwrap();
    let note: String = replica
        .query_row("SELECT note FROM later WHERE id = 1", [], |r| r.get(0))
        .unwrap();
    assert_eq!(note, "in the same transaction");
}

/// Group commit: a subscriber that connects while a burst is being stored catches up from the
/// change log on another connection, so that read must wait until every transaction handed on
/// before it is durable — including a group still open, and one whose next transaction is
/// half applied. Each subscriber must end with every transaction once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_catching_up_while_groups_are_stored_miss_no_transaction() {
    let pg = start_pg().await;
    let client = Arc::new(pg.connect().await.unwrap());
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new("grouped-catchup");
    let mut args = serve_args(&pg.url(), data.path(), free_port());
    args.group_commit = true;
    let server = InProcess::start(args).await;
    let rv = replica_version(server.addr).await;
    let total = 3000;
    let sql: String = (1..=total)
        .map(|i| format!("BEGIN; INSERT INTO items VALUES ({i}, 'v{i}'); COMMIT;"))
        .collect();
    let writer = client.clone();
    let burst = tokio::spawn(async move { writer.batch_execute(&sql).await.unwrap() });
    let mut subscribers = Vec::new();
    for _ in 0..12 {
        subscribers.push(Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await);
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    burst.await.unwrap();
    let expected = pg_items(&client).await;
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    for (n, subscriber) in subscribers.iter_mut().enumerate() {
        let done = subscriber.follow(until, |m| m.commits.len() >= total).await;
        assert!(
            done && subscriber.model.rows == expected,
            "subscriber {n} has {} of {total} transactions and {} of {} rows",
            subscriber.model.commits.len(),
            subscriber.model.rows.len(),
            expected.len()
        );
        assert_eq!(subscriber.model.commits.len(), total, "subscriber {n}");
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_stored_in_one_group_reach_subscribers_each_as_its_own_transaction() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    let data = DataDir::new("grouped");
    let mut args = serve_args(&pg.url(), data.path(), free_port());
    args.group_commit = true;
    let server = InProcess::start(args).await;
    let rv = replica_version(server.addr).await;
    let mut live = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;

    // 2,000 single-row transactions committed in one round trip: they queue up, and the
    // server stores several of them per SQLite commit.
    let sql: String = (1..=2000)
        .map(|i| format!("BEGIN; INSERT INTO items VALUES ({i}, 'v{i}'); COMMIT;"))
        .collect();
    client.batch_execute(&sql).await.unwrap();
    let expected = pg_items(&client).await;
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    assert!(live.follow(until, |m| m.rows == expected).await);
    // The model checks that every begin is followed by its own commit, in increasing order.
    assert_eq!(live.model.commits.len(), 2000);
    assert_eq!(live.model.rollbacks, 0);

    let stored_by = tokio::time::Instant::now() + Duration::from_secs(5);
    let health = loop {
        let health = health(server.addr).await;
        if health["storedTransactions"].as_u64().unwrap() >= 2000 {
            break health;
        }
        assert!(
            tokio::time::Instant::now() < stored_by,
            "not stored: {health}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let commits = health["storeCommits"].as_u64().unwrap();
    let transactions = health["storedTransactions"].as_u64().unwrap();
    assert!(
        commits < transactions,
        "no two transactions shared a commit: {health}"
    );

    // A subscriber catching up from the change log sees the same transactions.
    let mut later = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    assert!(later.follow(until, |m| m.rows == expected).await);
    assert_eq!(later.model.commits, live.model.commits);
    server.stop().await;
}
