//! Shared pieces of the replica integration tests: running the replicator (in-process or as the
//! real binary), waiting for it to catch up, and comparing the replica with Postgres.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use highwater_engine::change_stream::{JsonFormat, Row};
use highwater_engine::watermark::Lsn;
use highwater_host::private_pg::PrivatePg;
use highwater_host::replica::Replica;
use highwater_host::replicate::{replicate, ReplicateArgs, ReplicateError};
use highwater_host::replication::initial_sync::{initial_sync, SyncSource};
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::Client;

/// How long a local replicator may take to catch up.
pub const CATCH_UP: Duration = Duration::from_secs(20);

pub use crate::scratch_support::{start_pg, DataDir};

pub fn args(url: &str, data: &Path, publications: &[&str]) -> ReplicateArgs {
    ReplicateArgs {
        upstream: url.to_owned(),
        data: data.to_owned(),
        app_id: "highwater".to_owned(),
        publications: publications.iter().map(|p| (*p).to_owned()).collect(),
        auto_reset: false,
        sync_workers: 2,
    }
}

/// The replicator running in this process on a blocking thread.
pub struct InProcess {
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), ReplicateError>>,
}

impl InProcess {
    pub fn spawn(args: ReplicateArgs) -> InProcess {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    // Shown only for a failing test: what the replicator and its backfills
                    // did before it.
                    .unwrap_or_else(|_| {
                        tracing_subscriber::EnvFilter::new("warn,highwater_host=info")
                    }),
            )
            .with_test_writer()
            .try_init();
        let (stop, stop_rx) = watch::channel(false);
        let handle = tokio::runtime::Handle::current();
        let task = tokio::task::spawn_blocking(move || {
            let result = replicate(&handle, &args, stop_rx);
            if let Err(error) = &result {
                // Otherwise only seen when the test stops it, after its own assertions.
                tracing::error!("replicate failed: {error:#}");
            }
            result
        });
        InProcess { stop, task }
    }

    /// Stops it and returns how it ended.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        Ok(self.task.await.expect("replicator thread")?)
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// The `highwater replicate` binary.
pub struct Binary {
    pub child: Child,
}

impl Binary {
    pub fn spawn(url: &str, data: &Path, publications: &[&str]) -> Binary {
        Binary::spawn_with_env(url, data, publications, &[])
    }

    /// As [`Binary::spawn`], with extra environment variables.
    pub fn spawn_with_env(
        url: &str,
        data: &Path,
        publications: &[&str],
        env: &[(&str, &str)],
    ) -> Binary {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_highwater"));
        cmd.envs(env.iter().copied());
        cmd.arg("replicate")
            .arg("--upstream")
            .arg(url)
            .arg("--data")
            .arg(data);
        for p in publications {
            cmd.arg("--publication").arg(p);
        }
        let child = cmd
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn highwater replicate");
        Binary { child }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Peak resident set size (VmHWM) in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("read /proc/<pid>/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc/<pid>/status")
    }

    pub fn kill9(mut self) {
        signal(self.pid(), "KILL");
        let _ = self.child.wait();
    }

    /// SIGTERM, then the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        signal(self.pid(), "TERM");
        let deadline = Instant::now() + CATCH_UP;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > deadline {
                signal(self.pid(), "KILL");
                panic!("highwater replicate did not stop on SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn signal(pid: u32, name: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status();
}

/// The marker table tests bump after their changes: once the replica shows the bump, every
/// earlier transaction is applied too.
pub const MARKER_DDL: &str =
    "CREATE TABLE hw_marker (id int PRIMARY KEY, n int NOT NULL); INSERT INTO hw_marker VALUES (1, 0);";

pub async fn bump_marker(client: &Client) -> i32 {
    client
        .query_one(
            "UPDATE hw_marker SET n = n + 1 WHERE id = 1 RETURNING n",
            &[],
        )
        .await
        .expect("bump marker")
        .get(0)
}

/// The replica's marker value, if the replica is readable yet.
fn replica_marker(data: &Path) -> Option<i64> {
    let path = data.join("replica.db");
    if !path.exists() {
        return None;
    }
    let conn = rusqlite::Connection::open_with_flags(
        &path,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .ok()?;
    // Before `_hw_state` exists the initial sync is still copying.
    conn.query_row(
        r#"SELECT "n" FROM "hw_marker" WHERE "id" = 1 AND EXISTS (SELECT 1 FROM "_hw_state")"#,
        [],
        |r| r.get(0),
    )
    .ok()
}

/// Waits until the replica has applied the marker bump `n`.
pub async fn wait_for_marker(data: &Path, n: i32) {
    let deadline = Instant::now() + CATCH_UP;
    loop {
        if replica_marker(data) == Some(i64::from(n)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the replica did not reach marker {n} in {CATCH_UP:?} (at {:?})",
            replica_marker(data)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The table of the failed-backfill tests (`serve` and `replicate`): 500 rows, and the
/// column added with a volatile default whose backfill is made to fail once.
pub const QUIET_TABLE_SQL: &str = "CREATE TABLE quiet (id int PRIMARY KEY, body text);
     INSERT INTO quiet SELECT g, 'row ' || g FROM generate_series(1, 500) g;";
pub const QUIET_ADD_COLUMN: &str = "ALTER TABLE quiet ADD COLUMN r float8 DEFAULT random()";

/// Runs `alter` (a DDL on `table` that asks for a backfill) so that the backfill's first run
/// fails: a second client queues for the table's lock behind the DDL and holds the table from
/// its commit on, and the backfill's new connection gives up on the lock after 200 ms
/// (`lock_timeout`, set for the database). Returns once that attempt gave up and the lock is
/// released again, with nothing committed after the DDL.
pub async fn alter_so_the_backfill_fails_once(
    pg: &PrivatePg,
    client: &Client,
    table: &str,
    alter: &str,
) {
    let database: String = client
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    client
        .batch_execute(&format!(
            "ALTER DATABASE \"{database}\" SET lock_timeout = '200ms'"
        ))
        .await
        .unwrap();
    let holder = pg.connect().await.unwrap();
    holder.batch_execute("SET lock_timeout = 0").await.unwrap();
    client
        .batch_execute(&format!("BEGIN; {alter}"))
        .await
        .unwrap();
    let lock = format!("BEGIN; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE");
    let locking = tokio::spawn(async move {
        holder.batch_execute(&lock).await.unwrap();
        holder
    });
    let count =
        |sql: String| async move { client.query_one(&sql, &[]).await.unwrap().get::<_, i64>(0) };
    let deadline = Instant::now() + CATCH_UP;
    let queued = format!(
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = '{table}'::regclass"
    );
    while count(queued.clone()).await == 0 {
        assert!(Instant::now() < deadline, "the holder never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    client.batch_execute("COMMIT").await.unwrap();
    let holder = locking.await.unwrap();
    // The backfill waits behind the holder, then gives up.
    let waiting = format!(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE wait_event_type = 'Lock' AND query LIKE 'LOCK TABLE ONLY %{table}%'"
    );
    while count(waiting.clone()).await == 0 {
        assert!(Instant::now() < deadline, "no backfill waited");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while count(waiting.clone()).await > 0 {
        assert!(Instant::now() < deadline, "the backfill never gave up");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Released without a commit: nothing reaches the stream after the DDL.
    holder.batch_execute("ROLLBACK").await.unwrap();
}

/// Undoes [`alter_so_the_backfill_fails_once`]'s setting (a commit upstream).
pub async fn reset_lock_timeout(client: &Client) {
    client
        .batch_execute(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I RESET lock_timeout', current_database()); END $$",
        )
        .await
        .unwrap();
}

/// Makes the replica catch up with everything committed so far, backfills included. A backfill
/// starts once everything before it is durable, and with group commit the marker's transaction
/// may share a group with the change that asked for the backfill: the marker can be stored
/// before the backfill ran, so the pending backfills are waited for as well.
pub async fn catch_up(client: &Client, data: &Path) {
    let n = bump_marker(client).await;
    wait_for_marker(data, n).await;
    let deadline = Instant::now() + CATCH_UP;
    loop {
        let pending: i64 = replica_scalar(
            data,
            "SELECT count(*) FROM _hw_columns WHERE backfill IS NOT NULL",
        );
        if pending == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{pending} backfilled columns still pending after {CATCH_UP:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every table of the replica as JSON rows, by replica table name.
pub fn replica_rows(data: &Path) -> Vec<(String, Vec<Row>)> {
    let replica = Replica::open_read_only(&data.join("replica.db")).expect("open replica");
    rows_of(&replica)
}

fn rows_of(replica: &Replica) -> Vec<(String, Vec<Row>)> {
    replica
        .table_names()
        .into_iter()
        .map(|t| {
            let rows = replica.rows(&t, JsonFormat::Parsed).expect("replica rows");
            (t, rows.into_iter().map(canonical_row).collect())
        })
        .collect()
}

/// Numbers compared by value (`1.50` = `1.5`), as REAL storage keeps them.
fn canonical(value: Value) -> Value {
    match value {
        Value::Number(n) => match n.as_i64() {
            Some(i) => Value::from(i),
            None => n
                .as_f64()
                .and_then(serde_json::Number::from_f64)
                .map_or(Value::Null, Value::Number),
        },
        Value::Array(items) => Value::Array(items.into_iter().map(canonical).collect()),
        Value::Object(map) => {
            Value::Object(map.into_iter().map(|(k, v)| (k, canonical(v))).collect())
        }
        other => other,
    }
}

fn canonical_row(row: Row) -> Row {
    row.into_iter().map(|(k, v)| (k, canonical(v))).collect()
}

/// Postgres now, as a fresh copy of `publications` in an exported snapshot, through the
/// initial-sync path into an in-memory replica.
pub async fn postgres_rows(pg: &PrivatePg, publications: &[&str]) -> Vec<(String, Vec<Row>)> {
    let exporter = pg.connect().await.expect("connect");
    exporter
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .await
        .unwrap();
    let snapshot: String = exporter
        .query_one("SELECT pg_export_snapshot()", &[])
        .await
        .unwrap()
        .get(0);
    let reader = pg.connect().await.expect("connect");
    let source = SyncSource {
        publications: publications.iter().map(|p| (*p).to_owned()).collect(),
        slot: "none".into(),
        app_id: "highwater".into(),
        consistent_point: Lsn(1),
        snapshot_name: snapshot,
    };
    let handle = tokio::runtime::Handle::current();
    let rows = tokio::task::spawn_blocking(move || {
        let mut replica = Replica::open_in_memory().unwrap();
        initial_sync(&handle, &reader, &mut replica, &source, 1000).expect("snapshot copy");
        rows_of(&replica)
    })
    .await
    .unwrap();
    exporter.batch_execute("COMMIT").await.unwrap();
    rows
}

/// Asserts the replica holds exactly Postgres's rows, table by table.
pub async fn assert_replica_matches(pg: &PrivatePg, data: &Path, publications: &[&str]) {
    let expected = postgres_rows(pg, publications).await;
    let actual = replica_rows(data);
    let names = |v: &Vec<(String, Vec<Row>)>| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&actual), names(&expected), "replicated tables");
    for ((table, want), (_, got)) in expected.iter().zip(&actual) {
        assert_eq!(got.len(), want.len(), "row count of {table}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g, w, "row {i} of {table}");
        }
    }
}

/// Reads an SQL scalar from the replica.
pub fn replica_scalar<T: rusqlite::types::FromSql>(data: &Path, sql: &str) -> T {
    let conn = rusqlite::Connection::open(data.join("replica.db")).expect("open replica");
    conn.query_row(sql, [], |r| r.get(0)).expect(sql)
}
