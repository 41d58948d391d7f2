//! `highwater serve` follows schema changes however the upstream announces them: with the DDL
//! event trigger (a superuser upstream) and, without one, from the stream's Relation messages.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use crate::replica_support::{assert_replica_matches, catch_up, MARKER_DDL};
use crate::serve_support::*;

/// Regression: `serve` used to ignore Relation messages, so against a user that may not
/// create the event trigger it missed every added column and table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_against_a_non_superuser_upstream_learns_added_columns_and_tables() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{MARKER_DDL}
             CREATE TABLE items (id int8 PRIMARY KEY, v text);
             INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 40) g;
             CREATE ROLE repl LOGIN REPLICATION;
             GRANT SELECT ON ALL TABLES IN SCHEMA public TO repl;
             ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO repl;
             CREATE PUBLICATION hw_all FOR ALL TABLES;"
        ))
        .await
        .unwrap();
    let data = DataDir::new("serve-nosuper");
    let url = format!("postgres://repl@127.0.0.1:{}/postgres", pg.port());
    let mut args = serve_args(&url, data.path(), free_port());
    args.publications = vec!["hw_all".to_owned()];
    let server = InProcess::start(args).await;
    let rv = replica_version(server.addr).await;
    catch_up(&client, data.path()).await;
    let triggers: i64 = client
        .query_one("SELECT count(*) FROM pg_event_trigger", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(triggers, 0, "a non-superuser cannot create the DDL trigger");
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;

    client
        .batch_execute(
            "ALTER TABLE items ADD COLUMN rank int DEFAULT 5;
             UPDATE items SET rank = 1 WHERE id = 3;
             CREATE TABLE label (id int PRIMARY KEY, text text);
             INSERT INTO label VALUES (1, 'one');
             INSERT INTO label SELECT g, 'bulk ' || g FROM generate_series(2, 30) g;",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    // The replica has the new column (backfilled for the rows no change touched) and table.
    assert_replica_matches(&pg, data.path(), &["hw_all"]).await;
    // Subscribers get the schema changes before the rows that use them.
    let deadline = tokio::time::Instant::now() + PROMPT;
    let reached = s
        .follow(deadline, |m| {
            m.schema_changes.iter().any(|c| c == "add-column")
                && m.schema_changes.iter().any(|c| c == "create-table")
                && m.rows.get(&3).is_some_and(|row| row["rank"] == 1)
        })
        .await;
    assert!(reached, "{:?}", s.model.schema_changes);
    s.close().await;
    server.stop().await;
}

/// Regression: `serve` holds a small transaction whole until its commit before storing it,
/// but a schema change is computed against the replica as of every message before it. A
/// second DDL in the same transaction must see the first one applied, or it announces that
/// one again (a second `add-column` of the same column stops the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_schema_changes_in_one_transaction_are_each_applied_once() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{MARKER_DDL}
             CREATE TABLE items (id int8 PRIMARY KEY, v text);
             INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 10) g;"
        ))
        .await
        .unwrap();
    let data = DataDir::new("serve-ddl-txn");
    let server = InProcess::start(serve_args(&pg.url(), data.path(), free_port())).await;
    let rv = replica_version(server.addr).await;
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    client
        .batch_execute(
            "BEGIN;
             ALTER TABLE items ADD COLUMN rank int;
             UPDATE items SET rank = 1 WHERE id = 3;
             ALTER TABLE items ADD COLUMN note text;
             CREATE TABLE label (id int PRIMARY KEY, text text);
             INSERT INTO label VALUES (1, 'one');
             UPDATE items SET note = 'noted' WHERE id = 4;
             COMMIT;",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
    let deadline = tokio::time::Instant::now() + PROMPT;
    let reached = s
        .follow(deadline, |m| {
            m.rows.get(&4).is_some_and(|row| row["note"] == "noted")
        })
        .await;
    assert!(reached, "{:?}", s.model.schema_changes);
    let added = s
        .model
        .schema_changes
        .iter()
        .filter(|c| *c == "add-column")
        .count();
    assert_eq!(added, 2, "{:?}", s.model.schema_changes);
    assert_eq!(s.model.rows[&3]["rank"], 1);
    s.close().await;
    server.stop().await;
}
