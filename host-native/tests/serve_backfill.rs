//! Backfills through `highwater serve` (Zero's backfill messages and how a replica applies
//! them): a table added to the publication and a column added with a volatile default reach
//! change-stream subscribers as a schema change, then a `skipAck` transaction at a minor
//! watermark carrying the existing rows, then `backfill-completed`; the replica ends equal to
//! Postgres, also after a `kill -9` in the middle of a backfill.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use highwater_engine::change_stream::{Change, DownstreamMessage, Frame, Row};
use highwater_engine::watermark::Watermark;
use highwater_host::replica::schema::replica_table_name;
use serde_json::Value;

use crate::replica_support;
use crate::serve_support::{
    changes_path, free_port, replica_version, serve_args, Binary, DataDir, InProcess, Received,
    Subscriber,
};

/// How long a backfill of a few hundred thousand rows may take in a debug build.
const BACKFILL_WAIT: Duration = Duration::from_secs(120);

/// Every table the stream built, as a subscriber applying committed transactions sees it:
/// replica table name → row key → row.
#[derive(Debug, Default)]
struct StreamModel {
    tables: BTreeMap<String, BTreeMap<String, Row>>,
    keys: BTreeMap<String, Vec<String>>,
    open: Option<Vec<DownstreamMessage>>,
    /// Committed transactions, in order.
    transactions: Vec<Vec<DownstreamMessage>>,
}

/// Numbers compared by value (`1` = `1.0`: the replica reads float columns back as REAL).
fn canonical(value: &Value) -> Value {
    match value {
        Value::Number(n) => n
            .as_f64()
            .and_then(serde_json::Number::from_f64)
            .map_or(Value::Null, Value::Number),
        other => other.clone(),
    }
}

fn canonical_row(row: &Row) -> Row {
    row.iter().map(|(k, v)| (k.clone(), canonical(v))).collect()
}

impl StreamModel {
    fn key_of(&self, table: &str, row: &Row) -> String {
        let key: Vec<Value> = self.keys[table]
            .iter()
            .map(|k| canonical(&row[k.as_str()]))
            .collect();
        Value::Array(key).to_string()
    }

    fn apply(&mut self, message: DownstreamMessage) {
        match message {
            DownstreamMessage::Begin(_) => {
                assert!(self.open.is_none(), "begin inside a transaction");
                self.open = Some(vec![message]);
            }
            DownstreamMessage::Data(_) => self
                .open
                .as_mut()
                .expect("data inside a transaction")
                .push(message),
            DownstreamMessage::Commit(_) => {
                let mut transaction = self.open.take().expect("commit of an open transaction");
                for message in &transaction {
                    if let DownstreamMessage::Data(change) = message {
                        self.change(change);
                    }
                }
                transaction.push(message);
                self.transactions.push(transaction);
            }
            DownstreamMessage::Rollback(_) => self.open = None,
            DownstreamMessage::Error(error) => panic!("unexpected stream error {error:?}"),
            DownstreamMessage::Status(_) | DownstreamMessage::Reserved(_) => {}
        }
    }

    /// The socket dropped: a transaction received in part is discarded.
    fn disconnected(&mut self) {
        self.open = None;
    }

    fn change(&mut self, change: &Change) {
        match change {
            Change::CreateTable(create) => {
                let name = replica_table_name(&create.spec.schema, &create.spec.name);
                self.keys.insert(
                    name.clone(),
                    create.spec.primary_key.clone().unwrap_or_default(),
                );
                self.tables.insert(name, BTreeMap::new());
            }
            Change::AddColumn(add) => {
                let name = replica_table_name(&add.table.schema, &add.table.name);
                if let Some(rows) = self.tables.get_mut(&name) {
                    for row in rows.values_mut() {
                        row.insert(add.column.name.clone(), Value::Null);
                    }
                }
            }
            Change::Insert(insert) => {
                let name = replica_table_name(&insert.relation.schema, &insert.relation.name);
                if self.tables.contains_key(&name) {
                    let key = self.key_of(&name, &insert.new);
                    self.tables
                        .get_mut(&name)
                        .unwrap()
                        .insert(key, canonical_row(&insert.new));
                }
            }
            Change::Update(update) => {
                let name = replica_table_name(&update.relation.schema, &update.relation.name);
                if self.tables.contains_key(&name) {
                    let old = self.key_of(&name, update.key.as_ref().unwrap_or(&update.new));
                    let key = self.key_of(&name, &update.new);
                    let rows = self.tables.get_mut(&name).unwrap();
                    let mut row = rows.remove(&old).unwrap_or_default();
                    row.extend(canonical_row(&update.new));
                    rows.insert(key, row);
                }
            }
            Change::Delete(delete) => {
                let name = replica_table_name(&delete.relation.schema, &delete.relation.name);
                if self.tables.contains_key(&name) {
                    let key = self.key_of(&name, &delete.key);
                    self.tables.get_mut(&name).unwrap().remove(&key);
                }
            }
            Change::Backfill(backfill) => {
                let name = replica_table_name(&backfill.relation.schema, &backfill.relation.name);
                if !self.tables.contains_key(&name) {
                    return;
                }
                let names: Vec<&String> = backfill
                    .relation
                    .row_key
                    .columns
                    .iter()
                    .chain(&backfill.columns)
                    .collect();
                for values in &backfill.row_values {
                    let row: Row = names
                        .iter()
                        .zip(values)
                        .map(|(n, v)| ((*n).clone(), canonical(v)))
                        .collect();
                    let key = self.key_of(&name, &row);
                    self.tables
                        .get_mut(&name)
                        .unwrap()
                        .entry(key)
                        .or_default()
                        .extend(row);
                }
            }
            _ => {}
        }
    }

    /// A table's rows in key order, as `postgres_rows` lists them.
    fn rows(&self, table: &str) -> Vec<Row> {
        let mut rows: Vec<&Row> = self.tables[table].values().collect();
        let keys = &self.keys[table];
        rows.sort_by(|a, b| {
            let key = |r: &Row| {
                keys.iter()
                    .map(|k| r[k.as_str()].to_string())
                    .collect::<Vec<_>>()
            };
            let (ka, kb) = (key(a), key(b));
            ka.iter()
                .zip(&kb)
                .map(|(x, y)| match (x.parse::<f64>(), y.parse::<f64>()) {
                    (Ok(x), Ok(y)) => x.total_cmp(&y),
                    _ => x.cmp(y),
                })
                .find(|o| o.is_ne())
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        rows.into_iter().cloned().collect()
    }
}

/// Applies frames (acking each) until `done`, failing after `wait`. `false` if the socket
/// closed first.
async fn follow(
    s: &mut Subscriber,
    model: &mut StreamModel,
    wait: Duration,
    done: impl Fn(&StreamModel) -> bool,
) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    while !done(model) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match s.next_within(left).await {
            None => panic!(
                "the stream did not get there in {wait:?}: schema changes {:?}, rows {:?}, open {:?}",
                schema_tags(model),
                model
                    .tables
                    .iter()
                    .map(|(t, rows)| (t.clone(), rows.len()))
                    .collect::<Vec<_>>(),
                model.open.as_ref().map(Vec::len)
            ),
            Some(Received::Closed(_)) => return false,
            Some(Received::Frame(Frame::Ack { .. })) => {}
            Some(Received::Frame(frame)) => {
                let id = frame.id();
                for message in frame.into_messages() {
                    model.apply(message);
                }
                if let Some(id) = id {
                    s.ack(id).await;
                }
            }
        }
    }
    true
}

/// The committed transaction holding a `backfill-completed` of `table`, if any.
fn backfill_transaction<'m>(
    model: &'m StreamModel,
    table: &str,
) -> Option<&'m Vec<DownstreamMessage>> {
    model.transactions.iter().find(|t| {
        t.iter().any(|m| match m {
            DownstreamMessage::Data(Change::BackfillCompleted(done)) => {
                replica_table_name(&done.relation.schema, &done.relation.name) == table
            }
            _ => false,
        })
    })
}

/// Checks the shape of a backfill transaction (`docs/protocol/change-stream.md`, "Backfills")
/// and returns the backfilled columns and the number of rows it carried.
fn check_backfill_transaction(transaction: &[DownstreamMessage]) -> (Vec<String>, usize) {
    let DownstreamMessage::Begin(begin) = &transaction[0] else {
        panic!("a transaction starts with begin: {transaction:?}");
    };
    assert_eq!(
        begin.skip_ack,
        Some(true),
        "backfills are never acked upstream"
    );
    let version = begin.commit_watermark.state_version();
    assert!(
        version.minor.is_some(),
        "a minor watermark: {}",
        begin.commit_watermark
    );
    let DownstreamMessage::Commit(commit) = transaction.last().unwrap() else {
        panic!("a transaction ends with commit");
    };
    assert_eq!(commit.watermark, begin.commit_watermark);
    let data: Vec<&Change> = transaction[1..transaction.len() - 1]
        .iter()
        .map(|m| match m {
            DownstreamMessage::Data(change) => change,
            other => panic!("only data inside: {other:?}"),
        })
        .collect();
    let Some((Change::BackfillCompleted(done), rows)) = data.split_last() else {
        panic!("backfill-completed ends the transaction: {data:?}");
    };
    let mut count = 0;
    for change in rows {
        let Change::Backfill(backfill) = change else {
            panic!("only backfill rows before the completion: {change:?}");
        };
        assert_eq!(
            backfill.relation.row_key.columns,
            done.relation.row_key.columns
        );
        assert_eq!(backfill.columns, done.columns);
        assert!(backfill.watermark <= done.watermark);
        assert!(backfill.row_values.len() <= 5_000, "bounded batches");
        for values in &backfill.row_values {
            assert_eq!(
                values.len(),
                backfill.relation.row_key.columns.len() + backfill.columns.len()
            );
        }
        count += backfill.row_values.len();
    }
    (done.columns.clone(), count)
}

/// Tags of the schema changes among `model`'s transactions, in order.
fn schema_tags(model: &StreamModel) -> Vec<String> {
    model
        .transactions
        .iter()
        .flatten()
        .filter_map(|m| match m {
            DownstreamMessage::Data(change) if !change.is_row_change() => {
                Some(change.tag().to_owned())
            }
            _ => None,
        })
        .collect()
}

fn postgres_table(rows: &[(String, Vec<Row>)], table: &str) -> Vec<Row> {
    rows.iter()
        .find(|(name, _)| name == table)
        .map(|(_, rows)| rows.iter().map(canonical_row).collect())
        .unwrap_or_else(|| panic!("{table} is published"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribers_see_backfills_of_a_new_published_table_and_of_a_volatile_default() {
    let pg = replica_support::start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{}
             CREATE TABLE items (id int8 PRIMARY KEY, v text);
             CREATE SCHEMA app;
             CREATE TABLE app.doc (id int PRIMARY KEY, body text, n float8);
             INSERT INTO app.doc SELECT g, 'doc ' || g, g / 7.0 FROM generate_series(1, 4500) g;
             CREATE PUBLICATION hw_test FOR TABLE hw_marker, items;",
            replica_support::MARKER_DDL
        ))
        .await
        .unwrap();
    let publ = ["hw_test"];
    let data = DataDir::new("backfill");
    let mut args = serve_args(&pg.url(), data.path(), free_port());
    args.publications = vec!["hw_test".to_owned()];
    let server = InProcess::start(args).await;
    let rv = replica_version(server.addr).await;
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let mut model = StreamModel::default();

    // A table added to the publication with rows it had all along, changed right after.
    client
        .batch_execute(
            "ALTER PUBLICATION hw_test ADD TABLE app.doc;
             UPDATE app.doc SET body = 'changed after' WHERE id = 7;
             DELETE FROM app.doc WHERE id = 8;
             INSERT INTO app.doc VALUES (5000, 'new', 1.5);",
        )
        .await
        .unwrap();
    let expected = replica_support::postgres_rows(&pg, &publ).await;
    let doc = postgres_table(&expected, "app.doc");
    assert_eq!(doc.len(), 4500);
    assert!(
        follow(&mut s, &mut model, replica_support::CATCH_UP, |m| {
            m.tables.contains_key("app.doc") && m.rows("app.doc") == doc
        })
        .await
    );
    let tags = schema_tags(&model);
    // The key index follows the table, as Zero's replicator needs for its backfill upserts.
    assert_eq!(tags, ["create-table", "create-index", "backfill-completed"]);
    let backfill = backfill_transaction(&model, "app.doc").unwrap();
    let (columns, rows) = check_backfill_transaction(backfill);
    assert_eq!(columns, ["body", "n"]);
    // Read in a snapshot after the change that added it: the later changes come after.
    assert!(rows == 4499 || rows == 4500, "{rows} rows backfilled");

    // A column added with a volatile default: every existing row has its own value upstream.
    client
        .batch_execute(
            "INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 300) g;
             ALTER TABLE items ADD COLUMN r float8 DEFAULT random();
             UPDATE items SET v = 'touched' WHERE id = 3;",
        )
        .await
        .unwrap();
    let expected = replica_support::postgres_rows(&pg, &publ).await;
    let items = postgres_table(&expected, "items");
    assert!(items.iter().all(|r| r["r"].is_number()));
    // items was synced before the subscription: its rows come from the stream, so model them.
    model.keys.insert("items".to_owned(), vec!["id".to_owned()]);
    model.tables.insert("items".to_owned(), BTreeMap::new());
    assert!(
        follow(&mut s, &mut model, replica_support::CATCH_UP, |m| {
            m.rows("items") == items
        })
        .await
    );
    let tags = schema_tags(&model);
    assert_eq!(
        tags,
        [
            "create-table",
            "create-index",
            "backfill-completed",
            "add-column",
            "backfill-completed"
        ]
    );
    let backfill = backfill_transaction(&model, "items").unwrap();
    let (columns, rows) = check_backfill_transaction(backfill);
    assert_eq!(columns, ["r"]);
    assert_eq!(rows, 300);

    // The replica equals Postgres, with nothing left pending.
    replica_support::catch_up(&client, data.path()).await;
    replica_support::assert_replica_matches(&pg, data.path(), &publ).await;
    let pending: i64 = replica_support::replica_scalar(
        data.path(),
        "SELECT count(*) FROM _hw_columns WHERE backfill IS NOT NULL",
    );
    assert_eq!(pending, 0);
    // Backfills are stored in the change log like any transaction: a new subscriber gets them.
    let mut late = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let mut replayed = StreamModel::default();
    let transactions = model.transactions.len();
    assert!(
        follow(&mut late, &mut replayed, replica_support::CATCH_UP, |m| {
            m.transactions.len() >= transactions
        })
        .await
    );
    assert_eq!(
        replayed.transactions[..transactions],
        model.transactions[..]
    );
    late.close().await;
    s.close().await;
    server.stop().await;
}

/// `kill -9` while a backfill is being read and stored: nothing of it is kept, the restarted
/// server runs it again, subscribers get it whole, and the replica ends equal to Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_backfill_then_restart_completes_it() {
    let pg = replica_support::start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{}
             CREATE TABLE big (id int PRIMARY KEY, body text);
             INSERT INTO big SELECT g, repeat('x', 40) || g FROM generate_series(1, 100000) g;",
            replica_support::MARKER_DDL
        ))
        .await
        .unwrap();
    let data = DataDir::new("backfill-crash");
    let port = free_port();
    let server = Binary::start(&pg.url(), data.path(), port).await;
    let rv = replica_version(server.addr).await;
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let mut model = StreamModel::default();
    model.keys.insert("big".to_owned(), vec!["id".to_owned()]);

    client
        .batch_execute("ALTER TABLE big ADD COLUMN r float8 DEFAULT random()")
        .await
        .unwrap();
    // The first rows of the backfill are out: it is in progress.
    let in_progress = |m: &StreamModel| {
        m.open.as_ref().is_some_and(|t| {
            t.iter()
                .any(|m| matches!(m, DownstreamMessage::Data(Change::Backfill(_))))
        })
    };
    assert!(follow(&mut s, &mut model, BACKFILL_WAIT, in_progress).await);
    server.kill9();
    model.disconnected();
    let before: Watermark = model
        .transactions
        .last()
        .and_then(|t| match t.last() {
            Some(DownstreamMessage::Commit(commit)) => Some(commit.watermark.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(schema_tags(&model), ["add-column"]);
    let pending: i64 = replica_support::replica_scalar(
        data.path(),
        "SELECT count(*) FROM _hw_columns WHERE backfill IS NOT NULL",
    );
    assert_eq!(pending, 1, "the crash came before the backfill was stored");

    let server = Binary::start(&pg.url(), data.path(), port).await;
    assert_eq!(replica_version(server.addr).await, rv, "no resync");
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &before)).await;
    let done = |m: &StreamModel| backfill_transaction(m, "big").is_some();
    assert!(follow(&mut s, &mut model, BACKFILL_WAIT, done).await);
    let (columns, rows) = check_backfill_transaction(backfill_transaction(&model, "big").unwrap());
    assert_eq!(columns, ["r"]);
    assert_eq!(rows, 100_000);

    let deadline = tokio::time::Instant::now() + BACKFILL_WAIT;
    loop {
        let pending: i64 = replica_support::replica_scalar(
            data.path(),
            "SELECT count(*) FROM _hw_columns WHERE backfill IS NOT NULL",
        );
        if pending == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the backfill did not complete"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    replica_support::catch_up(&client, data.path()).await;
    replica_support::assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
    s.close().await;
    assert!(server.terminate().await.success());
}

/// A backfill that fails (its snapshot's lock waits behind a client's lock and hits
/// `lock_timeout`) is tried again after its retry delay even though nothing more is committed
/// upstream: a quiet database still gets its backfill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_backfill_is_retried_in_a_quiet_database() {
    let pg = replica_support::start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{}{}",
            replica_support::MARKER_DDL,
            replica_support::QUIET_TABLE_SQL
        ))
        .await
        .unwrap();
    let data = DataDir::new("backfill-retry");
    let server = InProcess::start(serve_args(&pg.url(), data.path(), free_port())).await;
    let rv = replica_version(server.addr).await;
    let mut s = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let mut model = StreamModel::default();
    model.keys.insert("quiet".to_owned(), vec!["id".to_owned()]);

    replica_support::alter_so_the_backfill_fails_once(
        &pg,
        &client,
        "quiet",
        replica_support::QUIET_ADD_COLUMN,
    )
    .await;
    let done = |m: &StreamModel| backfill_transaction(m, "quiet").is_some();
    assert!(follow(&mut s, &mut model, Duration::from_secs(30), done).await);
    let (columns, rows) =
        check_backfill_transaction(backfill_transaction(&model, "quiet").unwrap());
    assert_eq!(columns, ["r"]);
    assert_eq!(rows, 500);
    replica_support::reset_lock_timeout(&client).await;
    replica_support::catch_up(&client, data.path()).await;
    replica_support::assert_replica_matches(&pg, data.path(), &["highwater_pub"]).await;
    s.close().await;
    server.stop().await;
}

/// A replica table's rows, each with only `columns` (numbers canonical), ordered by `id`.
fn replica_projection(data: &std::path::Path, table: &str, columns: &[&str]) -> Vec<Value> {
    let mut rows: Vec<Value> = replica_support::replica_rows(data)
        .into_iter()
        .find(|(name, _)| name == table)
        .unwrap_or_else(|| panic!("{table} is in the replica"))
        .1
        .into_iter()
        .map(|row| {
            let object: serde_json::Map<String, Value> = columns
                .iter()
                .map(|c| ((*c).to_owned(), canonical(&row[*c])))
                .collect();
            Value::Object(object)
        })
        .collect();
    rows.sort_by_key(|r| r["id"].as_i64());
    rows
}

/// `SELECT columns FROM table WHERE filter ORDER BY id` in Postgres, the same shape.
async fn postgres_projection(
    client: &tokio_postgres::Client,
    table: &str,
    columns: &[&str],
    filter: &str,
) -> Vec<Value> {
    let sql = format!(
        "SELECT coalesce(json_agg(json_build_object({}) ORDER BY id), '[]')::text FROM {table} WHERE {filter}",
        columns
            .iter()
            .map(|c| format!("'{c}', {c}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let text: String = client.query_one(&sql, &[]).await.unwrap().get(0);
    let rows: Vec<Value> = serde_json::from_str(&text).unwrap();
    rows.iter()
        .map(|row| {
            Value::Object(
                row.as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), canonical(v)))
                    .collect(),
            )
        })
        .collect()
}

/// A publication with a row filter and a column list: the initial sync, the live stream
/// (updates moving rows into and out of the filter) and backfills (a column with a volatile
/// default, a table added to the publication with rows of its own) leave the replica holding
/// exactly what the publication publishes, as `SELECT … WHERE <filter>` gives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_publication_replicates_only_its_rows_and_columns() {
    let pg = replica_support::start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(&format!(
            "{}
             CREATE TABLE t (id int PRIMARY KEY, tenant int NOT NULL, v text);
             ALTER TABLE t REPLICA IDENTITY FULL;
             INSERT INTO t SELECT g, g % 2 + 1, 'v' || g FROM generate_series(1, 40) g;
             CREATE TABLE u (id int PRIMARY KEY, v text, secret text);
             INSERT INTO u SELECT g, 'u' || g, 'hidden' FROM generate_series(1, 10) g;
             CREATE TABLE w (id int PRIMARY KEY, tenant int NOT NULL);
             ALTER TABLE w REPLICA IDENTITY FULL;
             INSERT INTO w SELECT g, g % 2 + 1 FROM generate_series(1, 30) g;
             CREATE PUBLICATION hwpub FOR TABLE hw_marker, t WHERE (tenant = 1), u (id, v);",
            replica_support::MARKER_DDL
        ))
        .await
        .unwrap();
    let data = DataDir::new("filtered-publication");
    let mut args = serve_args(&pg.url(), data.path(), free_port());
    args.publications = vec!["hwpub".to_owned()];
    let server = InProcess::start(args).await;
    replica_support::catch_up(&client, data.path()).await;

    // The initial sync: tenant 1's rows only; u without its unpublished column.
    let t_cols = ["id", "tenant", "v"];
    let want = postgres_projection(&client, "t", &t_cols, "tenant = 1").await;
    assert_eq!(want.len(), 20);
    assert_eq!(replica_projection(data.path(), "t", &t_cols), want);
    let u_rows = replica_support::replica_rows(data.path())
        .into_iter()
        .find(|(name, _)| name == "u")
        .unwrap()
        .1;
    assert_eq!(u_rows.len(), 10);
    assert!(
        u_rows.iter().all(|r| !r.contains_key("secret")),
        "{u_rows:?}"
    );

    // Live: rows moving into and out of the filter, rows outside it written.
    client
        .batch_execute(
            "UPDATE t SET tenant = 1 WHERE id = 1;
             UPDATE t SET tenant = 2 WHERE id = 2;
             INSERT INTO t VALUES (100, 2, 'outside'), (101, 1, 'inside');
             UPDATE t SET v = 'changed outside' WHERE id = 3;
             UPDATE t SET v = 'changed inside' WHERE id = 4;
             DELETE FROM t WHERE id = 6;
             UPDATE u SET secret = 'still hidden', v = 'u changed' WHERE id = 1;",
        )
        .await
        .unwrap();
    // Backfills: a column whose existing values only upstream knows, and a table added to
    // the publication with a filter of its own.
    client
        .batch_execute(
            "ALTER TABLE t ADD COLUMN r float8 DEFAULT random();
             ALTER PUBLICATION hwpub ADD TABLE w WHERE (tenant = 1);",
        )
        .await
        .unwrap();
    replica_support::catch_up(&client, data.path()).await;
    let t_cols = ["id", "tenant", "v", "r"];
    assert_eq!(
        replica_projection(data.path(), "t", &t_cols),
        postgres_projection(&client, "t", &t_cols, "tenant = 1").await
    );
    assert_eq!(
        replica_projection(data.path(), "w", &["id", "tenant"]),
        postgres_projection(&client, "w", &["id", "tenant"], "tenant = 1").await
    );
    assert_eq!(
        replica_projection(data.path(), "u", &["id", "v"]),
        postgres_projection(&client, "u", &["id", "v"], "true").await
    );
    server.stop().await;
}
