//! The initial sync through the real resync path (`Upstream::prepare` + `Upstream::resync`:
//! new slot, exported snapshot, parallel COPY readers): stopped in the middle it leaves nothing
//! marked synced, the next open removes what the load left, and the next start completes; a reader that cannot read a value fails the
//! sync with a typed error.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};

use highwater_host::replica::load_marker::marker_path;
use highwater_host::replica::Replica;
use highwater_host::replication::bootstrap::{BootstrapError, Upstream};
use highwater_host::replication::initial_sync::{SyncError, SyncOptions};

use crate::replica_support::*;

const ROWS: i64 = 30_000;

fn options() -> SyncOptions {
    SyncOptions {
        batch_rows: 1_000,
        workers: 2,
        ..SyncOptions::default()
    }
}

fn count(data: &std::path::Path, table: &str) -> i64 {
    replica_scalar(data, &format!("SELECT count(*) FROM \"{table}\""))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_stopped_mid_copy_leaves_no_synced_state_and_a_restart_completes() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "CREATE TABLE big (id int8 PRIMARY KEY, note text);
             INSERT INTO big SELECT g, 'note ' || g FROM generate_series(1, {ROWS}) g;
             CREATE TABLE small (id int PRIMARY KEY);
             INSERT INTO small SELECT generate_series(1, 10);"
        ))
        .await
        .unwrap();
    let data = DataDir::new("sync-stop");
    let (url, dir) = (pg.url(), data.path().to_owned());
    let handle = tokio::runtime::Handle::current();
    let (stopped, polls) = tokio::task::spawn_blocking(move || {
        let upstream = Upstream::prepare(&handle, &url, "highwater", &[]).unwrap();
        let replica = Replica::open_in_dir(&dir).unwrap();
        let polls = AtomicUsize::new(0);
        // Polled once per batch from a reader: stop after a few, with rows committed.
        let stop = || polls.fetch_add(1, Ordering::Relaxed) >= 8;
        let stopped = upstream.resync(&handle, replica, &dir, &options(), &stop);
        (stopped.map(|_| ()), polls.into_inner())
    })
    .await
    .unwrap();
    assert!(
        matches!(stopped, Err(BootstrapError::Sync(SyncError::Stopped))),
        "expected the sync to stop, got {stopped:?}"
    );
    assert!(polls > 8);
    // The load was marked: the next open removes what it left, unopened.
    let db = data.path().join("replica.db");
    assert!(marker_path(&db).exists(), "a stopped load keeps its marker");
    let replica = Replica::open_in_dir(data.path()).unwrap();
    assert!(replica.state().is_none(), "a stopped sync is not synced");
    assert!(
        replica.table_names().is_empty(),
        "{:?} left by the stopped load",
        replica.table_names()
    );
    assert!(!marker_path(&db).exists());
    drop(replica);

    let (url, dir) = (pg.url(), data.path().to_owned());
    let handle = tokio::runtime::Handle::current();
    let report = tokio::task::spawn_blocking(move || {
        let upstream = Upstream::prepare(&handle, &url, "highwater", &[]).unwrap();
        let replica = Replica::open_in_dir(&dir).unwrap();
        assert!(upstream.resync_reason(&handle, &replica).unwrap().is_some());
        upstream
            .resync(&handle, replica, &dir, &options(), &|| false)
            .unwrap()
            .1
    })
    .await
    .unwrap();
    assert_eq!((report.tables, report.rows), (2, 30_010));
    assert_eq!(count(data.path(), "big"), ROWS);
    assert_eq!(count(data.path(), "small"), 10);
    assert!(!marker_path(&data.path().join("replica.db")).exists());
    let mode: String = replica_scalar(data.path(), "PRAGMA journal_mode");
    assert_eq!(mode, "wal", "back in WAL mode after the load");
    let next_seq: i64 = replica_scalar(data.path(), "SELECT next_seq FROM \"_hw_state\"");
    assert_eq!(next_seq, ROWS + 11);
    assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_a_reader_cannot_read_fails_the_sync_and_marks_nothing_synced() {
    let pg = start_pg().await;
    // SQL_ASCII stores any bytes, so upstream can hold text it cannot send as UTF-8.
    pg.connect()
        .await
        .unwrap()
        .batch_execute("CREATE DATABASE raw ENCODING 'SQL_ASCII' TEMPLATE template0 LOCALE 'C'")
        .await
        .unwrap();
    let url = format!("postgres://postgres@127.0.0.1:{}/raw", pg.port());
    let params: highwater_host::replication::ConnectParams = url.parse().unwrap();
    let (client, connection) = params.upstream().connect().await.unwrap();
    tokio::spawn(connection);
    client
        .batch_execute(
            "CREATE TABLE first (id int8 PRIMARY KEY, note text);
             INSERT INTO first SELECT g, 'note ' || g FROM generate_series(1, 5000) g;
             CREATE TABLE second (id int PRIMARY KEY, note text);
             INSERT INTO second VALUES (1, 'fine'), (2, E'caf\\xe9');",
        )
        .await
        .unwrap();
    let data = DataDir::new("sync-bad-value");
    let dir = data.path().to_owned();
    let handle = tokio::runtime::Handle::current();
    let result = tokio::task::spawn_blocking(move || {
        let upstream = Upstream::prepare(&handle, &url, "highwater", &[]).unwrap();
        let replica = Replica::open_in_dir(&dir).unwrap();
        upstream
            .resync(&handle, replica, &dir, &options(), &|| false)
            .map(|_| ())
    })
    .await
    .unwrap();
    // The reader's COPY fails when the server converts the value to the connection's UTF-8.
    match &result {
        Err(BootstrapError::Sync(SyncError::Postgres(error))) => assert_eq!(
            error.code(),
            Some(&tokio_postgres::error::SqlState::CHARACTER_NOT_IN_REPERTOIRE),
            "{error}"
        ),
        other => panic!("expected the reader's COPY to fail, got {other:?}"),
    }
    // What the log shows says what Postgres said, not only "db error".
    let text = result.unwrap_err().to_string();
    assert!(
        text.contains("22021") && text.contains("invalid byte sequence"),
        "{text}"
    );
    let replica = Replica::open_in_dir(data.path()).unwrap();
    assert!(replica.state().is_none(), "a failed sync is not synced");
}
