//! Schema changes in Postgres reach the replica through the DDL event trigger, in the
//! transaction of the rows that follow them, with backfills for existing values.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::replica_support::*;

fn index_names(data: &std::path::Path) -> Vec<String> {
    let conn = rusqlite::Connection::open(data.join("replica.db")).unwrap();
    let mut stmt = conn
        .prepare(
            "SELECT name FROM sqlite_schema WHERE type = 'index' AND sql IS NOT NULL \
             AND name NOT LIKE '%\\_hw\\_%' ESCAPE '\\' ORDER BY name",
        )
        .unwrap();
    stmt.query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn declared_type(data: &std::path::Path, table: &str, column: &str) -> Option<String> {
    let conn = rusqlite::Connection::open(data.join("replica.db")).unwrap();
    conn.query_row(
        "SELECT type FROM pragma_table_info(?1) WHERE name = ?2",
        [table, column],
        |r| r.get(0),
    )
    .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_column_and_index_changes_follow_postgres() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(MARKER_DDL).await.unwrap();
    client
        .batch_execute(
            "CREATE TABLE item (id int PRIMARY KEY, name text);
             INSERT INTO item SELECT g, 'item ' || g FROM generate_series(1, 50) g;",
        )
        .await
        .unwrap();
    let data = DataDir::new("ddl");
    let replicator = InProcess::spawn(args(&pg.url(), data.path(), &[]));
    catch_up(&client, data.path()).await;
    let publ = ["highwater_pub"];

    // A new table with rows in the creating transaction; a plain added column; a column added
    // with a default (existing rows get it upstream without row events: backfilled).
    client
        .batch_execute(
            "BEGIN;
               CREATE TABLE label (id int PRIMARY KEY, item_id int, text text);
               INSERT INTO label SELECT g, g % 7, 'label ' || g FROM generate_series(1, 20) g;
             COMMIT;
             ALTER TABLE item ADD COLUMN note text;
             UPDATE item SET note = 'noted' WHERE id <= 3;
             ALTER TABLE item ADD COLUMN rank int NOT NULL DEFAULT 7;
             ALTER TABLE item ADD COLUMN serial_no bigserial;
             UPDATE item SET rank = 1 WHERE id = 2;",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &publ).await;
    assert_eq!(
        declared_type(data.path(), "item", "rank").as_deref(),
        Some("int4|NOT_NULL")
    );
    let pending: i64 = replica_scalar(
        data.path(),
        "SELECT count(*) FROM _hw_columns WHERE backfill IS NOT NULL",
    );
    assert_eq!(pending, 0, "backfills completed");

    // Renames, a type change (values rewritten upstream: backfilled), a drop, indexes.
    client
        .batch_execute(
            "ALTER TABLE item RENAME COLUMN name TO title;
             ALTER TABLE item ALTER COLUMN rank TYPE text;
             UPDATE item SET rank = 'top' WHERE id = 1;
             ALTER TABLE item DROP COLUMN note;
             ALTER TABLE label RENAME TO tag;
             CREATE INDEX tag_item ON tag (item_id DESC);
             CREATE UNIQUE INDEX item_title ON item (title);
             INSERT INTO tag VALUES (100, 1, 'after rename');",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &publ).await;
    assert_eq!(
        declared_type(data.path(), "item", "rank").as_deref(),
        Some("text|NOT_NULL")
    );
    assert_eq!(index_names(data.path()), ["item_title", "tag_item"]);

    client
        .batch_execute(
            "DROP INDEX item_title;
             ALTER TABLE tag DROP COLUMN text;
             DROP TABLE tag;
             CREATE TABLE later (k text PRIMARY KEY, v jsonb);
             INSERT INTO later VALUES ('a', '{\"x\": 1}');",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &publ).await;
    assert_eq!(index_names(data.path()), Vec::<String>::new());

    // CREATE TABLE AS writes its rows before its DDL event: the Relation message of those rows
    // creates the table, and a backfill confirms its rows.
    client
        .batch_execute(
            "CREATE TABLE item_copy AS SELECT id, title, rank FROM item WHERE id <= 5;
             INSERT INTO item_copy VALUES (99, 'later', 'x');",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &publ).await;

    // A schema change rolled back upstream never reaches the replica.
    client
        .batch_execute("BEGIN; ALTER TABLE item ADD COLUMN ghost int; ROLLBACK;")
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_eq!(declared_type(data.path(), "item", "ghost"), None);
    replicator.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_added_to_the_publication_is_backfilled() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{MARKER_DDL}
             CREATE SCHEMA app;
             CREATE TABLE app.doc (id int PRIMARY KEY, body text);
             INSERT INTO app.doc SELECT g, 'doc ' || g FROM generate_series(1, 2500) g;
             CREATE PUBLICATION hw_test FOR TABLE hw_marker;"
        ))
        .await
        .unwrap();
    let data = DataDir::new("addpub");
    let publ = ["hw_test"];
    let replicator = InProcess::spawn(args(&pg.url(), data.path(), &publ));
    catch_up(&client, data.path()).await;
    assert_eq!(
        replica_rows(data.path()).len(),
        1,
        "only the marker is published"
    );

    client
        .batch_execute(
            "ALTER PUBLICATION hw_test ADD TABLE app.doc;
             UPDATE app.doc SET body = 'changed after' WHERE id = 7;
             DELETE FROM app.doc WHERE id = 8;",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &publ).await;
    let rows = replica_rows(data.path());
    assert_eq!(rows[0].0, "app.doc");
    assert_eq!(rows[0].1.len(), 2499);

    client
        .batch_execute("ALTER PUBLICATION hw_test DROP TABLE app.doc;")
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &publ).await;
    replicator.stop().await.expect("clean stop");
}

/// A backfill that fails is tried again after its retry delay with nothing more committed
/// upstream: a quiet database still gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_backfill_is_retried_in_a_quiet_database() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!("{MARKER_DDL}{QUIET_TABLE_SQL}"))
        .await
        .unwrap();
    let data = DataDir::new("backfill-retry");
    let publ = ["highwater_pub"];
    let replicator = InProcess::spawn(args(&pg.url(), data.path(), &[]));
    catch_up(&client, data.path()).await;
    alter_so_the_backfill_fails_once(&pg, &client, "quiet", QUIET_ADD_COLUMN).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while replica_scalar::<i64>(
        data.path(),
        "SELECT count(*) FROM _hw_columns WHERE backfill IS NOT NULL",
    ) > 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the failed backfill was not retried"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    reset_lock_timeout(&client).await;
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &publ).await;
    replicator.stop().await.expect("clean stop");
}

/// Without a superuser there is no DDL event trigger: tables and columns are learned from the
/// stream's Relation messages and backfilled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_superuser_new_tables_and_columns_are_learned_from_the_stream() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{MARKER_DDL}
             CREATE TABLE item (id int PRIMARY KEY, name text);
             INSERT INTO item SELECT g, 'item ' || g FROM generate_series(1, 40) g;
             CREATE ROLE repl LOGIN REPLICATION;
             GRANT SELECT ON ALL TABLES IN SCHEMA public TO repl;
             ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO repl;
             CREATE PUBLICATION hw_all FOR ALL TABLES;"
        ))
        .await
        .unwrap();
    let data = DataDir::new("nosuper");
    let publ = ["hw_all"];
    let url = format!("postgres://repl@127.0.0.1:{}/postgres", pg.port());
    let replicator = InProcess::spawn(args(&url, data.path(), &publ));
    catch_up(&client, data.path()).await;
    let triggers: i64 = client
        .query_one("SELECT count(*) FROM pg_event_trigger", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(triggers, 0);

    client
        .batch_execute(
            "ALTER TABLE item ADD COLUMN rank int DEFAULT 5;
             UPDATE item SET rank = 1 WHERE id = 3;
             CREATE TABLE label (id int PRIMARY KEY, text text);
             INSERT INTO label VALUES (1, 'one');
             INSERT INTO label SELECT g, 'bulk ' || g FROM generate_series(2, 30) g;",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &publ).await;
    replicator.stop().await.expect("clean stop");
}

/// A column added with a volatile default and renamed right after: whichever name the backfill
/// snapshot finds, the values end up under the new name (none is completed empty while a
/// rename is still on its way through the stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_renamed_right_after_its_backfill_was_requested_keeps_its_values() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{MARKER_DDL}
             CREATE TABLE item (id int PRIMARY KEY, name text);
             INSERT INTO item SELECT g, 'item ' || g FROM generate_series(1, 500) g;"
        ))
        .await
        .unwrap();
    let data = DataDir::new("rename-backfill");
    let replicator = InProcess::spawn(args(&pg.url(), data.path(), &[]));
    catch_up(&client, data.path()).await;
    client
        .batch_execute(
            "ALTER TABLE item ADD COLUMN r float8 DEFAULT random();
             ALTER TABLE item RENAME COLUMN r TO score;
             UPDATE item SET score = -1 WHERE id = 9;",
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
    let pending: i64 = replica_scalar(
        data.path(),
        "SELECT count(*) FROM _hw_columns WHERE backfill IS NOT NULL",
    );
    assert_eq!(pending, 0, "backfills completed");
    replicator.stop().await.expect("clean stop");
}
