//! The replica under load and faults: a 100,000-row transaction in bounded memory, Postgres
//! restarted mid-stream, the real `highwater replicate` killed with SIGKILL mid-transaction and
//! inside a group commit (before its SQLite commit, and between that commit and the upstream
//! acknowledgement). Each ends with the replica equal to Postgres, nothing lost or applied
//! twice.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use crate::replica_support::*;

const PUBLICATION: [&str; 1] = ["highwater_pub"];

fn replica_count(data: &Path, table: &str) -> i64 {
    let conn = rusqlite::Connection::open_with_flags(
        data.join("replica.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    conn.query_row(&format!("SELECT count(*) FROM \"{table}\""), [], |r| {
        r.get(0)
    })
    .unwrap_or(-1)
}

fn wal_size(data: &Path) -> u64 {
    std::fs::metadata(data.join("replica.db-wal")).map_or(0, |m| m.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100k_row_transaction_replicates_in_bounded_memory() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{MARKER_DDL} CREATE TABLE big (id int PRIMARY KEY, payload text NOT NULL);
             CREATE TABLE seeded (id int PRIMARY KEY, payload text NOT NULL);
             INSERT INTO seeded SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 50000) g;"
        ))
        .await
        .unwrap();
    let data = DataDir::new("big");
    let binary = Binary::spawn(&pg.url(), data.path(), &[]);
    // The initial sync streams the 50,000 seeded rows.
    catch_up(&client, data.path()).await;
    let synced_kib = binary.peak_rss_kib();
    assert_eq!(replica_count(data.path(), "seeded"), 50_000);

    // ~27 MB of row data in one upstream transaction.
    client
        .batch_execute(
            "INSERT INTO big SELECT g, repeat(md5(g::text), 8) FROM generate_series(1, 100000) g",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    let peak_kib = binary.peak_rss_kib();
    println!(
        "highwater replicate peak RSS (VmHWM): {synced_kib} KiB after the initial sync of \
         50,000 rows (~14 MB), {peak_kib} KiB after a 100,000-row transaction of ~27 MB"
    );
    assert_eq!(replica_count(data.path(), "big"), 100_000);
    // The process's own floor (a debug build, jemalloc's arenas, SQLite's page caches) is
    // 38-45 MB here; holding the seeded table in memory would add well over its 14 MB of text,
    // and holding the transaction would add well over its 27 MB.
    assert!(
        synced_kib < 52 * 1024,
        "peak RSS {synced_kib} KiB after the initial sync"
    );
    assert!(
        peak_kib < synced_kib + 8 * 1024,
        "peak RSS {peak_kib} KiB after the transaction, {synced_kib} KiB before it"
    );
    assert!(binary.terminate().success(), "clean exit on SIGTERM");
    assert_replica_matches(&pg, data.path(), &PUBLICATION).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_mid_stream_loses_nothing() {
    let mut pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{MARKER_DDL} CREATE TABLE ev (id int PRIMARY KEY, n int NOT NULL);"
        ))
        .await
        .unwrap();
    let data = DataDir::new("pgrestart");
    let replicator = InProcess::spawn(args(&pg.url(), data.path(), &[]));
    catch_up(&client, data.path()).await;

    client
        .batch_execute(
            "INSERT INTO ev SELECT g, g FROM generate_series(1, 30000) g;
             UPDATE ev SET n = n + 1 WHERE id % 3 = 0;",
        )
        .await
        .unwrap();
    // Restart while the replicator is still streaming what was just written.
    pg.restart().await.expect("restart postgres");
    let client = pg.connect().await.unwrap();
    client
        .batch_execute("DELETE FROM ev WHERE id % 5 = 0; INSERT INTO ev VALUES (100000, 1);")
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert!(
        !replicator.is_finished(),
        "the replicator survived the restart"
    );
    assert_replica_matches(&pg, data.path(), &PUBLICATION).await;
    replicator.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_transaction_then_restart_applies_everything_exactly_once() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{MARKER_DDL}
             CREATE TABLE acct (id int PRIMARY KEY, balance int8 NOT NULL, note text);
             INSERT INTO acct SELECT g, 100, NULL FROM generate_series(1, 1000) g;"
        ))
        .await
        .unwrap();
    let data = DataDir::new("sigkill");
    let binary = Binary::spawn(&pg.url(), data.path(), &[]);
    catch_up(&client, data.path()).await;
    let wal_before = wal_size(data.path());

    client
        .batch_execute(
            "INSERT INTO acct SELECT g, g, repeat('n', 200) FROM generate_series(1001, 60000) g;",
        )
        .await
        .unwrap();
    let after_big: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    client
        .batch_execute(
            "UPDATE acct SET balance = balance - 10 WHERE id <= 500;
             UPDATE acct SET id = id + 100000 WHERE id BETWEEN 501 AND 600;
             DELETE FROM acct WHERE id BETWEEN 601 AND 700;",
        )
        .await
        .unwrap();

    // Kill once the big transaction is being written but is not committed yet.
    let deadline = Instant::now() + CATCH_UP;
    while wal_size(data.path()) < wal_before + 2 * 1024 * 1024 {
        assert!(
            Instant::now() < deadline,
            "the big transaction never started"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let committed_before_kill = replica_count(data.path(), "acct");
    binary.kill9();
    assert_eq!(
        committed_before_kill, 1000,
        "killed inside the big transaction"
    );
    assert_eq!(
        replica_count(data.path(), "acct"),
        1000,
        "nothing half-applied"
    );
    let acked: bool = client
        .query_one(
            "SELECT confirmed_flush_lsn < $1::text::pg_lsn FROM pg_replication_slots \
             WHERE slot_name = 'highwater_slot'",
            &[&after_big],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        acked,
        "the unapplied transaction was not acknowledged upstream"
    );

    let binary = Binary::spawn(&pg.url(), data.path(), &[]);
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &PUBLICATION).await;
    let duplicates: i64 = replica_scalar(
        data.path(),
        "SELECT count(*) - count(DISTINCT _hw_seq) FROM acct",
    );
    assert_eq!(duplicates, 0);
    assert!(binary.terminate().success(), "clean exit on SIGTERM");
}

/// The replica's stored position and the slot's acknowledged one.
async fn positions(client: &tokio_postgres::Client, data: &Path) -> (u64, u64) {
    let stored: String = replica_scalar(data, r#"SELECT "lsn" FROM "_hw_state""#);
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
        .map(|id| format!("BEGIN; INSERT INTO ev VALUES ({id}, {id}); COMMIT;"))
        .collect();
    client.batch_execute(&sql).await.unwrap();
}

async fn sigkill_at(point: &str) {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{MARKER_DDL} CREATE TABLE ev (id int8 PRIMARY KEY, n int8 NOT NULL);"
        ))
        .await
        .unwrap();
    let data = DataDir::new(&format!("group-{point}"));
    let marker = data.path().join("paused");
    let pause = format!("{point}:{}", marker.display());
    let binary = Binary::spawn_with_env(
        &pg.url(),
        data.path(),
        &[],
        &[("HIGHWATER_PAUSE_AT", pause.as_str())],
    );
    catch_up(&client, data.path()).await;

    // Thousands of small transactions committed at once: the replicator groups them.
    burst(&client, 1, 3000).await;
    let deadline = Instant::now() + CATCH_UP;
    while !marker.exists() {
        assert!(
            Instant::now() < deadline,
            "no group of two or more transactions reached {point}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    binary.kill9();
    let (stored, acked) = positions(&client, data.path()).await;
    if point == "before-group-commit" {
        // The group in progress was not committed: the burst is not all there.
        assert!(replica_count(data.path(), "ev") < 3000);
    }
    if point == "after-group-commit" {
        assert!(
            stored > acked,
            "the durable group was acknowledged before the kill"
        );
    }

    // More arrives while it is down; the restart gets the unacknowledged rest again. Had an
    // acknowledgement gone beyond the durable commits, rows would be missing below.
    burst(&client, 3001, 500).await;
    let binary = Binary::spawn(&pg.url(), data.path(), &[]);
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &PUBLICATION).await;
    // Every insert took exactly one seq, in one unbroken run: none was applied twice.
    let gaps: i64 = replica_scalar(
        data.path(),
        "SELECT max(_hw_seq) - min(_hw_seq) + 1 - count(*) FROM ev",
    );
    assert_eq!(gaps, 0, "a transaction was applied more than once");
    assert_eq!(replica_count(data.path(), "ev"), 3500);
    assert!(binary.terminate().success(), "clean exit on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_before_a_group_commit_loses_and_duplicates_nothing() {
    sigkill_at("before-group-commit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_a_group_commit_and_its_ack_loses_and_duplicates_nothing() {
    sigkill_at("after-group-commit").await;
}
