//! The replica against a real Postgres: initial sync, then every kind of row change, value type
//! and replica identity, each compared row for row with Postgres.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use serde_json::json;

use crate::replica_support::*;

const SCHEMA: &str = r#"
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE issue (
    id int8 PRIMARY KEY,
    title text NOT NULL,
    body text,
    small int2, medium int4, big int8,
    amount numeric, ratio float8, done bool,
    meta json, data jsonb,
    created timestamptz, local_time timestamp, day date,
    uid uuid, feeling mood, tags text[], scores int4[], moods mood[],
    code varchar(10)
);
CREATE TABLE audit (id int PRIMARY KEY, note text, n int);
-- Stored out of line uncompressed, so a 5000-byte body is TOASTed.
ALTER TABLE issue ALTER COLUMN body SET STORAGE EXTERNAL;
ALTER TABLE audit REPLICA IDENTITY FULL;
CREATE TABLE pair (a int NOT NULL, b text NOT NULL, v text, PRIMARY KEY (a, b));
-- No key at all: rows are matched on every column of the old row.
CREATE TABLE log (msg text, n int);
ALTER TABLE log REPLICA IDENTITY FULL;
"#;

const FIRST_ROWS: &str = r#"
INSERT INTO issue VALUES
  (1, 'first', repeat('x', 5000), 1, 2, 9007199254740993, 12345678901234567890.5, 1.5, true,
   '{"a": [1, 2]}', '{"b": {"c": null}}', '2024-03-01 12:34:56.789123+02', '2024-03-01 12:34:56',
   '2024-03-01', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 'happy', '{"x","y z"}', '{1,NULL,3}',
   '{sad,ok}', 'abc'),
  (2, 'nulls', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
   NULL, NULL, NULL, NULL),
  (3, 'edge', '', -32768, -2147483648, -9223372036854775808, -0.000001, -1e300, false,
   '"s"', '[1, "two", 3.5]', '1970-01-01 00:00:00+00', '1969-12-31 23:59:59.999',
   '1900-01-01', '00000000-0000-0000-0000-000000000000', 'sad', '{}', '{}', '{}', 'tab	here');
INSERT INTO audit SELECT g, 'note ' || g, g FROM generate_series(1, 5) g;
INSERT INTO pair VALUES (1, 'a', 'one'), (1, 'b', 'two'), (2, 'a', 'three');
INSERT INTO log VALUES ('same', 1), ('same', 1), ('other', NULL), ('third', 3);
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_sync_and_every_kind_of_change_match_postgres() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(MARKER_DDL).await.unwrap();
    client.batch_execute(SCHEMA).await.unwrap();
    client.batch_execute(FIRST_ROWS).await.unwrap();
    let data = DataDir::new("kinds");
    let replicator = InProcess::spawn(args(&pg.url(), data.path(), &[]));
    catch_up(&client, data.path()).await;
    // Initial sync.
    assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
    let version: String = replica_scalar(data.path(), "SELECT replica_version FROM _hw_state");
    let row_versions: i64 = replica_scalar(
        data.path(),
        &format!("SELECT count(*) FROM issue WHERE _hw_version = '{version}'"),
    );
    assert_eq!(row_versions, 3, "copied rows carry the replica version");

    // Inserts, updates (one of a TOASTed row leaving the big body untouched), a key change, a
    // delete, NULLs over values and values over NULLs, in several transactions.
    client
        .batch_execute(
            r#"
            INSERT INTO issue (id, title, big, amount, data, created, tags, feeling)
              VALUES (4, 'new', 9223372036854775807, 0.1, '{"k": "v"}', now(), '{"q"}', 'ok');
            UPDATE issue SET title = 'first!', small = small + 1 WHERE id = 1;
            BEGIN;
              UPDATE issue SET id = 10, title = 'moved' WHERE id = 3;
              UPDATE issue SET body = 'now has a body', meta = '[]', uid = NULL WHERE id = 2;
              DELETE FROM issue WHERE id = 4;
              INSERT INTO issue (id, title) VALUES (4, 'again');
            COMMIT;
            UPDATE audit SET note = 'changed' WHERE id = 2;
            UPDATE audit SET id = 20 WHERE id = 3;
            DELETE FROM audit WHERE id = 4;
            UPDATE pair SET b = 'c' WHERE a = 1 AND b = 'b';
            DELETE FROM pair WHERE a = 2;
            DELETE FROM log WHERE ctid = (SELECT min(ctid) FROM log WHERE msg = 'same');
            UPDATE log SET n = 2 WHERE msg = 'other';
            UPDATE log SET msg = 'renamed' WHERE n = 3;
            "#,
        )
        .await
        .unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
    let rows = replica_rows(data.path());
    let names: Vec<&str> = rows.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["audit", "hw_marker", "issue", "log", "pair"]);
    let issues = &rows[2].1;
    assert_eq!(rows[3].1.len(), 3, "one of two equal keyless rows deleted");
    let ids: Vec<&serde_json::Value> = issues.iter().map(|r| &r["id"]).collect();
    assert_eq!(ids, [&json!(1), &json!(2), &json!(4), &json!(10)]);
    let mut first = issues[0].clone();
    first.remove("body");
    eprintln!("replicated issue 1: {}", serde_json::Value::Object(first));
    let body_len: i64 = replica_scalar(data.path(), "SELECT length(body) FROM issue WHERE id = 1");
    assert_eq!(
        body_len, 5000,
        "an unchanged TOASTed value keeps the replica's copy"
    );
    let big: String = replica_scalar(
        data.path(),
        "SELECT CAST(big AS TEXT) FROM issue WHERE id = 1",
    );
    assert_eq!(big, "9007199254740993");
    let tombstones: Vec<(String, String)> = {
        let conn = rusqlite::Connection::open(data.path().join("replica.db")).unwrap();
        let mut stmt = conn
            .prepare("SELECT table_name, row_key FROM _hw_tombstones ORDER BY seq")
            .unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    };
    let expected = [
        ("issue", json!({"id": 3})),
        ("issue", json!({"id": 4})),
        ("audit", json!({"id": 3})),
        ("audit", json!({"id": 4})),
        ("pair", json!({"a": 1, "b": "b"})),
        ("pair", json!({"a": 2, "b": "a"})),
    ];
    assert_eq!(tombstones.len(), expected.len(), "{tombstones:?}");
    for ((table, key), (want_table, want_key)) in tombstones.iter().zip(expected) {
        assert_eq!(table, want_table);
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(key).unwrap(),
            want_key
        );
    }

    // Truncate leaves one marker and no rows.
    client.batch_execute("TRUNCATE pair").await.unwrap();
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
    let markers: i64 = replica_scalar(
        data.path(),
        "SELECT count(*) FROM _hw_tombstones WHERE table_name = 'pair' AND row_key IS NULL",
    );
    assert_eq!(markers, 1);

    // Sequences only grow, and every row has its own.
    let distinct: i64 = replica_scalar(
        data.path(),
        "SELECT count(DISTINCT _hw_seq) - count(*) FROM (SELECT _hw_seq FROM issue UNION ALL SELECT _hw_seq FROM audit)",
    );
    assert_eq!(distinct, 0);
    replicator.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_replicator_resumes_from_its_position_without_resyncing() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(MARKER_DDL).await.unwrap();
    client.batch_execute(SCHEMA).await.unwrap();
    client.batch_execute(FIRST_ROWS).await.unwrap();
    let data = DataDir::new("resume");
    let replicator = InProcess::spawn(args(&pg.url(), data.path(), &[]));
    catch_up(&client, data.path()).await;
    replicator.stop().await.expect("clean stop");
    let version: String = replica_scalar(data.path(), "SELECT replica_version FROM _hw_state");

    // Changes while the replicator is down arrive when it is back.
    client
        .batch_execute(
            "INSERT INTO audit VALUES (100, 'while down', 1); DELETE FROM issue WHERE id = 2;",
        )
        .await
        .unwrap();
    let replicator = InProcess::spawn(args(&pg.url(), data.path(), &[]));
    catch_up(&client, data.path()).await;
    assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
    let after: String = replica_scalar(data.path(), "SELECT replica_version FROM _hw_state");
    assert_eq!(
        after, version,
        "resuming keeps the replica version (no resync)"
    );
    replicator.stop().await.expect("clean stop");
}
