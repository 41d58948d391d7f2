//! Startup survives losing Postgres half-way: the first upstream connection of `serve` (and of
//! `replicate`) is cut at its first query (as a Postgres restart or a dropped link would), and
//! the command starts again by itself instead of exiting; a URL that reaches nothing still fails
//! at once. And `highwater doctor`, which checks that Postgres is ready before the first start.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::replica_support;
use crate::serve_support::*;

/// A TCP proxy to `target` that cuts its first connection when the client sends its first
/// query (a simple `Q` or extended-protocol `P` message), and relays every later one whole.
/// Returns its port and how many connections it cut.
async fn cutting_proxy(target: u16) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let cut = Arc::new(AtomicUsize::new(0));
    let counter = cut.clone();
    tokio::spawn(async move {
        let mut first = true;
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                continue;
            };
            let cut_this = std::mem::take(&mut first);
            let counter = counter.clone();
            tokio::spawn(relay(client, server, cut_this, counter));
        }
    });
    (port, cut)
}

/// `pg`'s URL through a [`cutting_proxy`], and the proxy's count of cut connections.
async fn through_cutting_proxy(
    pg: &highwater_host::private_pg::PrivatePg,
) -> (String, Arc<AtomicUsize>) {
    let (proxy, cut) = cutting_proxy(pg.port()).await;
    let url = pg
        .url()
        .replace(&format!(":{}/", pg.port()), &format!(":{proxy}/"));
    assert_ne!(url, pg.url(), "the URL goes through the proxy");
    (url, cut)
}

async fn relay(client: TcpStream, server: TcpStream, cut: bool, counter: Arc<AtomicUsize>) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let upstream = async {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let n = match client_rx.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            // After the startup packets (which begin with their length, so a zero byte),
            // protocol messages begin with their type.
            if cut && matches!(buffer[0], b'Q' | b'P') {
                counter.fetch_add(1, Ordering::SeqCst);
                return;
            }
            if server_tx.write_all(&buffer[..n]).await.is_err() {
                return;
            }
        }
    };
    let downstream = tokio::io::copy(&mut server_rx, &mut client_tx);
    // Either direction ending ends both: dropping the halves closes the sockets.
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_starts_again_when_postgres_goes_away_during_startup() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    client
        .batch_execute("INSERT INTO items VALUES (1, 'before')")
        .await
        .unwrap();
    let (url, cut) = through_cutting_proxy(&pg).await;

    let data = DataDir::new("startup-retry");
    let port = free_port();
    let server = tokio::time::timeout(
        Duration::from_secs(60),
        InProcess::start(serve_args(&url, data.path(), port)),
    )
    .await
    .expect("serve came up after its first upstream connection was cut");
    assert_eq!(
        cut.load(Ordering::SeqCst),
        1,
        "the first connection was cut"
    );

    // And it serves: the row from before and one written now reach a subscriber.
    let rv = replica_version(server.addr).await;
    client
        .batch_execute("INSERT INTO items VALUES (2, 'after')")
        .await
        .unwrap();
    let mut subscriber = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let deadline = tokio::time::Instant::now() + PROMPT;
    let followed = subscriber
        .follow_until(deadline, |m| m.rows.len() == 1 && m.rows.contains_key(&2))
        .await;
    assert!(
        matches!(followed, Followed::Done),
        "the subscriber got the row written after startup"
    );
    drop(subscriber);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_url_that_reaches_nothing_still_fails_at_once() {
    let data = DataDir::new("startup-refused");
    let nothing = free_port();
    let url = format!("postgres://postgres@127.0.0.1:{nothing}/postgres");
    let args = serve_args(&url, data.path(), free_port());
    let (_stop, stop_rx) = tokio::sync::watch::channel(false);
    let started = tokio::time::Instant::now();
    let result = tokio::time::timeout(
        Duration::from_secs(20),
        highwater_host::serve::serve(args, stop_rx),
    )
    .await
    .expect("serve gave up in time");
    let error = result.expect_err("nothing listens there");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}: a refused first connection is not retried",
        started.elapsed()
    );
    assert!(
        error.to_string().contains("Could not connect to Postgres"),
        "a clear error: {error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicate_starts_again_when_postgres_goes_away_during_startup() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client
        .batch_execute(replica_support::MARKER_DDL)
        .await
        .unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    client
        .batch_execute("INSERT INTO items VALUES (1, 'before')")
        .await
        .unwrap();
    let (url, cut) = through_cutting_proxy(&pg).await;
    let data = DataDir::new("replicate-startup-retry");
    let replicator =
        replica_support::InProcess::spawn(replica_support::args(&url, data.path(), &[]));
    // It syncs and follows the stream although its first connection was cut.
    replica_support::catch_up(&client, data.path()).await;
    assert_eq!(
        cut.load(Ordering::SeqCst),
        1,
        "the first connection was cut"
    );
    assert!(!replicator.is_finished(), "replicate is still running");
    client
        .batch_execute("INSERT INTO items VALUES (2, 'after')")
        .await
        .unwrap();
    replica_support::catch_up(&client, data.path()).await;
    let rows: i64 = replica_support::replica_scalar(data.path(), "SELECT count(*) FROM items");
    assert_eq!(rows, 2);
    replicator.stop().await.expect("clean stop");
}

/// `highwater doctor` against `url`: its exit success and its report.
fn doctor(url: &str, extra: &[&str]) -> (bool, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_highwater"))
        .args(["doctor", "--upstream", url])
        .args(extra)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run highwater doctor");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

/// The report's line for `check`, with its fix (the indented lines under it).
fn line_of(report: &str, outcome: &str, check: &str) -> Option<String> {
    let mut lines = report.lines();
    while let Some(line) = lines.next() {
        if line.starts_with(outcome) && line[6..].starts_with(check) {
            let fix: Vec<&str> = lines
                .clone()
                .take_while(|l| l.starts_with("      "))
                .collect();
            return Some(format!("{line}\n{}", fix.join("\n")));
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_passes_a_ready_postgres_and_names_each_missing_prerequisite_with_its_fix() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute("CREATE TABLE todos (id int8 PRIMARY KEY, title text)")
        .await
        .unwrap();
    let (ok, report) = doctor(&pg.url(), &[]);
    assert!(ok, "a ready Postgres passes:\n{report}");
    for check in ["wal_level", "role", "publication", "replication connection"] {
        assert!(
            line_of(&report, "ok", check).is_some(),
            "{check}:\n{report}"
        );
    }

    // A table without a key in the publication to be made FOR ALL TABLES.
    db.batch_execute("CREATE TABLE notes (body text)")
        .await
        .unwrap();
    let (ok, report) = doctor(&pg.url(), &[]);
    assert!(!ok, "{report}");
    let miss = line_of(&report, "FAIL", "replica identity").expect(&report);
    assert!(
        miss.contains("public.notes") && miss.contains("REPLICA IDENTITY FULL"),
        "{miss}"
    );
    db.batch_execute("ALTER TABLE notes REPLICA IDENTITY FULL")
        .await
        .unwrap();
    assert!(doctor(&pg.url(), &[]).0, "fixed as it said");

    // A publication that does not exist.
    let (ok, report) = doctor(&pg.url(), &["--publication", "app_pub"]);
    assert!(!ok);
    let miss = line_of(&report, "FAIL", "publication").expect(&report);
    assert!(
        miss.contains("app_pub") && miss.contains("CREATE PUBLICATION"),
        "{miss}"
    );
    db.batch_execute("CREATE PUBLICATION app_pub FOR TABLE todos")
        .await
        .unwrap();
    assert!(doctor(&pg.url(), &["--publication", "app_pub"]).0);

    // A role without REPLICATION that cannot read the published table.
    db.batch_execute("CREATE ROLE app LOGIN PASSWORD 'app-password'")
        .await
        .unwrap();
    let url = pg.url_for("app", "app-password");
    let (ok, report) = doctor(&url, &["--publication", "app_pub"]);
    assert!(!ok);
    let role = line_of(&report, "FAIL", "role").expect(&report);
    assert!(role.contains("ALTER ROLE app REPLICATION"), "{role}");
    let grant = line_of(&report, "FAIL", "table privilege").expect(&report);
    assert!(
        grant.contains("GRANT SELECT ON public.todos TO app"),
        "{grant}"
    );
    assert!(
        line_of(&report, "FAIL", "replication connection").is_some(),
        "{report}"
    );
    assert!(
        !report.contains("app-password"),
        "the password is never shown"
    );
    db.batch_execute("ALTER ROLE app REPLICATION; GRANT SELECT ON todos TO app")
        .await
        .unwrap();
    let (ok, report) = doctor(&url, &["--publication", "app_pub"]);
    assert!(ok, "fixed as it said:\n{report}");
    assert!(
        line_of(&report, "WARN", "schema changes").is_some(),
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_serve_option_can_come_from_the_environment_and_print_config_shows_where_each_came_from(
) {
    let pg = start_pg().await;
    let data = DataDir::new("serve-env");
    let port = free_port();
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_highwater"))
        .arg("serve")
        .env("HIGHWATER_UPSTREAM", pg.url())
        .env("HIGHWATER_DATA", data.path())
        .env("HIGHWATER_PORT", port.to_string())
        .env("HIGHWATER_HOST", "127.0.0.1")
        .env("HIGHWATER_APP_ID", "fromenv")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn highwater serve");
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let server = Binary { child, addr };
    wait_ready(addr).await;
    let db = pg.connect().await.unwrap();
    let slot = db
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = 'fromenv_slot'",
            &[],
        )
        .await
        .unwrap();
    assert!(slot.is_some(), "the app id came from HIGHWATER_APP_ID");
    assert!(server.terminate().await.success());

    let help = std::process::Command::new(env!("CARGO_BIN_EXE_highwater"))
        .args(["serve", "--help"])
        .env("HIGHWATER_UPSTREAM", "postgres://app:hunter2@db/app")
        .output()
        .expect("run highwater serve --help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("HIGHWATER_UPSTREAM") && help.contains("HIGHWATER_SYNC_RULES"),
        "{help}"
    );
    assert!(
        !help.contains("hunter2"),
        "the URL's password stays out of --help"
    );

    // The effective configuration, each value with its source, the password masked.
    let config = std::process::Command::new(env!("CARGO_BIN_EXE_highwater"))
        .args(["serve", "--data", "/srv/highwater", "--print-config"])
        .env("HIGHWATER_UPSTREAM", "postgres://app:hunter2@db/app")
        .env("HIGHWATER_PORT", "5000")
        .output()
        .expect("run highwater serve --print-config");
    assert!(config.status.success());
    let config = String::from_utf8_lossy(&config.stdout);
    for line in [
        "upstream = postgres://app:***@db/app  # environment HIGHWATER_UPSTREAM",
        "data = /srv/highwater  # command line",
        "port = 5000  # environment HIGHWATER_PORT",
        "host = 127.0.0.1  # default",
        "sync-rules = -  # not set",
    ] {
        assert!(config.lines().any(|l| l == line), "{line:?} in:\n{config}");
    }
    assert!(!config.contains("hunter2"), "{config}");

    // A config file: below the environment and the command line; an unknown option refused.
    let dir = DataDir::new("serve-config-file");
    let file = dir.path().join("highwater.toml");
    std::fs::write(
        &file,
        "upstream = \"postgres://app:hunter2@db/app\"\nport = 4900\nhost = \"0.0.0.0\"\n\
         publication = [\"a\", \"b\"]\nauto-reset = true\nsync_workers = 3\n",
    )
    .unwrap();
    let config = std::process::Command::new(env!("CARGO_BIN_EXE_highwater"))
        .args([
            "serve",
            "--data",
            "/srv/highwater",
            "--host",
            "127.0.0.1",
            "--print-config",
        ])
        .env("HIGHWATER_CONFIG", &file)
        .env("HIGHWATER_PORT", "5000")
        .output()
        .expect("run highwater serve --print-config");
    assert!(config.status.success(), "{config:?}");
    let config = String::from_utf8_lossy(&config.stdout);
    let from_file = format!("# config {}", file.display());
    for line in [
        format!("upstream = postgres://app:***@db/app  {from_file}"),
        "port = 5000  # environment HIGHWATER_PORT".to_owned(),
        "host = 127.0.0.1  # command line".to_owned(),
        format!("publication = a,b  {from_file}"),
        format!("auto-reset = true  {from_file}"),
        format!("sync-workers = 3  {from_file}"),
    ] {
        assert!(config.lines().any(|l| l == line), "{line:?} in:\n{config}");
    }
    assert!(!config.contains("hunter2"), "{config}");
    std::fs::write(&file, "max_conections = 5\n").unwrap();
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_highwater"))
        .args(["serve", "--data", "/srv/highwater", "--config"])
        .arg(&file)
        .output()
        .expect("run highwater serve --config");
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("unknown option \"max_conections\""),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_keeps_up_while_only_unpublished_tables_are_written() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(
        "CREATE TABLE synced (id int PRIMARY KEY); CREATE TABLE other (id serial PRIMARY KEY, v text);
         CREATE PUBLICATION only_synced FOR TABLE synced;",
    )
    .await
    .unwrap();
    let data = DataDir::new("serve-unpublished");
    let server = Binary::start_with(
        &pg.url(),
        data.path(),
        free_port(),
        &["--publication", "only_synced"],
        &[],
    )
    .await;
    // About 8 MB of WAL that no published table is in: Postgres may only recycle it once the
    // slot has confirmed past it, which takes the server acknowledging the stream's keepalives.
    for _ in 0..4 {
        db.batch_execute(
            "INSERT INTO other (v) SELECT repeat('x', 1000) FROM generate_series(1, 2000)",
        )
        .await
        .unwrap();
    }
    let written: String = db
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let behind: i64 = db
            .query_one(
                "SELECT ($1::text::pg_lsn - confirmed_flush_lsn)::int8 FROM pg_replication_slots \
                 WHERE slot_name = 'highwater_slot'",
                &[&written],
            )
            .await
            .unwrap()
            .get(0);
        if behind <= 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slot is still {behind} bytes behind the unpublished writes"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(server.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_degraded_with_the_reason_once_the_slot_keeps_more_wal_than_the_warning() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute("CREATE TABLE t (id int PRIMARY KEY)")
        .await
        .unwrap();
    let data = DataDir::new("serve-wal-warn");
    // Any WAL at all is over the warning; checked five times a second.
    let server = Binary::start_with(
        &pg.url(),
        data.path(),
        free_port(),
        &["--wal-warn-bytes", "1", "--wal-check-ms", "200"],
        &[],
    )
    .await;
    let addr = server.addr;
    db.batch_execute("INSERT INTO t SELECT g FROM generate_series(1, 1000) g")
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let health = loop {
        let (_, _, body) = http_get(addr, "/health").await.unwrap();
        let health: serde_json::Value = serde_json::from_slice(&body).unwrap();
        if health["status"] == "degraded" {
            break health;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never degraded: {health}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let reason = health["degraded"][0].as_str().unwrap_or_default();
    assert!(
        reason.contains("highwater_slot") && reason.contains("MiB of WAL"),
        "{health}"
    );
    assert!(server.terminate().await.success());
}
