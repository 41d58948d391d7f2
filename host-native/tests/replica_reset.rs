//! An invalidated replication slot: without `--auto-reset` the replicator stops with an error
//! that says what happened and how to recover; with it, the replica is synced again.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use highwater_host::private_pg::{PgOptions, PrivatePg};
use highwater_host::replication::setup;

use crate::replica_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_stops_the_replicator_unless_auto_reset_resyncs() {
    let pg = PrivatePg::start(PgOptions {
        settings: vec![("max_slot_wal_keep_size".into(), "1MB".into())],
        ..PgOptions::default()
    })
    .await
    .unwrap();
    let client = pg.connect().await.unwrap();
    client.batch_execute(MARKER_DDL).await.unwrap();
    client
        .batch_execute(
            "CREATE TABLE items (id int PRIMARY KEY, note text);
             INSERT INTO items SELECT g, 'before ' || g FROM generate_series(1, 10) g;",
        )
        .await
        .unwrap();
    let data = DataDir::new("reset");
    let replicator = InProcess::spawn(args(&pg.url(), data.path(), &[]));
    catch_up(&client, data.path()).await;
    replicator.stop().await.unwrap();

    // While the replicator is away, push the slot's WAL past max_slot_wal_keep_size.
    for i in 0..3 {
        client
            .batch_execute(&format!(
                "INSERT INTO items SELECT 10000 * ({i} + 1) + g, 'away' FROM generate_series(1, 2000) g;
                 SELECT pg_switch_wal();"
            ))
            .await
            .unwrap();
    }
    client.batch_execute("CHECKPOINT").await.unwrap();
    let slot = setup::slot_state(&client, "highwater_slot")
        .await
        .unwrap()
        .unwrap();
    assert!(slot.is_invalidated(), "{slot:?}");

    let error = InProcess::spawn(args(&pg.url(), data.path(), &[]))
        .stop()
        .await
        .expect_err("an invalidated slot stops the replicator");
    let message = format!("{error:#}");
    assert!(
        message.contains("highwater_slot") && message.contains("--auto-reset"),
        "{message}"
    );
    // Nothing was discarded without being asked.
    assert_eq!(
        replica_scalar::<i64>(data.path(), r#"SELECT count(*) FROM "items""#),
        10
    );

    let mut reset = args(&pg.url(), data.path(), &[]);
    reset.auto_reset = true;
    let replicator = InProcess::spawn(reset);
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
    replicator.stop().await.unwrap();
}
