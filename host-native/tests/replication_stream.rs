//! The Postgres side of replication against real private servers: authentication, slot creation
//! with an exported snapshot, streaming, acks, slot conflicts, invalidation and restarts.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::str::FromStr;
use std::time::Duration;

use highwater_engine::watermark::Lsn;
use highwater_host::private_pg::{PgOptions, PrivatePg};
use highwater_host::replication::setup::{self, ReplicationNames};
use highwater_host::replication::{
    ConnectParams, ReplicationConnection, ReplicationError, StreamConfig, WalStream,
};

use crate::support::{self, eventually, next_seen, next_transaction, within, Seen, PROMPT};

async fn server(options: PgOptions) -> PrivatePg {
    PrivatePg::start(options).await.expect("a private postgres")
}

fn params(url: &str) -> ConnectParams {
    ConnectParams::from_str(url).expect("a valid URL")
}

/// Table `items (name text primary key)`, the app's publication and slot; returns the names.
async fn prepare(pg: &PrivatePg, app: &str) -> ReplicationNames {
    let client = pg.connect().await.unwrap();
    client
        .batch_execute("CREATE TABLE IF NOT EXISTS items (name text PRIMARY KEY)")
        .await
        .unwrap();
    let names = ReplicationNames::for_app(app).unwrap();
    setup::check_upstream(&client).await.unwrap();
    assert!(setup::ensure_publication(&client, &names.publication, None)
        .await
        .unwrap());
    assert!(
        !setup::ensure_publication(&client, &names.publication, None)
            .await
            .unwrap()
    );
    setup::ensure_slot(&client, &names.slot).await.unwrap();
    names
}

async fn insert(pg: &PrivatePg, name: &str) {
    let client = pg.connect().await.unwrap();
    client
        .execute("INSERT INTO items VALUES ($1)", &[&name])
        .await
        .unwrap();
}

async fn confirmed_flush(pg: &PrivatePg, slot: &str) -> Option<Lsn> {
    let client = pg.connect().await.ok()?;
    setup::slot_state(&client, slot)
        .await
        .ok()
        .flatten()?
        .confirmed_flush_lsn
}

fn stream_config(pg: &PrivatePg, names: &ReplicationNames, start: Lsn) -> StreamConfig {
    StreamConfig::new(
        params(&pg.url()),
        &names.slot,
        std::slice::from_ref(&names.publication),
        start,
    )
}

#[tokio::test]
async fn trust_scram_and_md5_users_connect_in_replication_mode_and_identify_the_system() {
    let hba = ["all", "replication"]
        .iter()
        .flat_map(|db| {
            [
                format!("host {db} scram_user 127.0.0.1/32 scram-sha-256"),
                format!("host {db} md5_user 127.0.0.1/32 md5"),
            ]
        })
        .collect();
    let pg = server(PgOptions {
        hba_lines: hba,
        settings: vec![],
    })
    .await;
    let admin = pg.connect().await.unwrap();
    admin
        .batch_execute(
            "SET password_encryption = 'scram-sha-256';
             CREATE ROLE scram_user LOGIN REPLICATION PASSWORD 'scram secret';
             SET password_encryption = 'md5';
             CREATE ROLE md5_user LOGIN REPLICATION PASSWORD 'md5:secret@';",
        )
        .await
        .unwrap();
    let stored: Vec<String> = admin
        .query(
            "SELECT left(rolpassword, 5) FROM pg_authid \
             WHERE rolname IN ('md5_user', 'scram_user') ORDER BY rolname",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    // md5_user sorts first: its hash is "md5…", scram_user's is "SCRAM-SHA-256$…".
    assert!(stored[0].starts_with("md5"), "{stored:?}");
    assert_eq!(stored[1], "SCRAM", "{stored:?}");

    let expected_lsn_floor = Lsn::from_str("0/1000000").unwrap();
    for url in [
        pg.url(),
        pg.url_for("scram_user", "scram secret"),
        pg.url_for("md5_user", "md5:secret@"),
    ] {
        let mut conn = ReplicationConnection::connect(&params(&url))
            .await
            .unwrap_or_else(|e| panic!("connect {url}: {e}"));
        let identity = conn.identify_system().await.unwrap();
        assert_eq!(identity.timeline, 1);
        assert_eq!(identity.dbname.as_deref(), Some("postgres"));
        assert!(identity.xlog_pos > expected_lsn_floor, "{identity:?}");
        assert!(identity.system_id.parse::<u64>().is_ok(), "{identity:?}");
        assert!(conn.backend_pid() > 0);
        conn.close().await.unwrap();
    }

    for (user, wrong) in [("scram_user", "nope"), ("md5_user", "md5:secret")] {
        let error = ReplicationConnection::connect(&params(&pg.url_for(user, wrong)))
            .await
            .unwrap_err();
        assert!(
            matches!(error, ReplicationError::Auth { user: ref u, .. } if u == user),
            "{error:?}"
        );
    }
    let no_password = format!("postgres://scram_user@127.0.0.1:{}/postgres", pg.port());
    let error = ReplicationConnection::connect(&params(&no_password))
        .await
        .unwrap_err();
    assert!(error.to_string().contains("has none"), "{error}");
}

#[tokio::test]
async fn exported_snapshot_shows_the_data_up_to_the_slot_and_streaming_starts_after_it() {
    let pg = server(PgOptions::default()).await;
    let admin = pg.connect().await.unwrap();
    admin
        .batch_execute(
            "CREATE TABLE items (name text PRIMARY KEY);
             INSERT INTO items VALUES ('before');
             CREATE PUBLICATION snap_pub FOR ALL TABLES;",
        )
        .await
        .unwrap();

    let mut conn = ReplicationConnection::connect(&params(&pg.url()))
        .await
        .unwrap();
    let created = conn.create_slot_with_snapshot("snap_slot").await.unwrap();
    assert_eq!(created.slot_name, "snap_slot");
    assert_eq!(
        confirmed_flush(&pg, "snap_slot").await,
        Some(created.consistent_point)
    );

    insert(&pg, "after").await;

    // While the slot's connection sits idle, another session reads inside the snapshot.
    let mut reader = pg.connect().await.unwrap();
    let tx = reader
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .unwrap();
    tx.batch_execute(&format!(
        "SET TRANSACTION SNAPSHOT '{}'",
        created.snapshot_name
    ))
    .await
    .unwrap();
    let in_snapshot: Vec<String> = tx
        .query("SELECT name FROM items ORDER BY name", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    tx.commit().await.unwrap();
    assert_eq!(in_snapshot, vec!["before"]);
    let now: i64 = admin
        .query_one("SELECT count(*) FROM items", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        now, 2,
        "the concurrent insert is committed, just not in the snapshot"
    );

    // Streaming from the consistent point yields exactly what the snapshot did not show.
    let mut stream = conn
        .start_replication(
            "snap_slot",
            created.consistent_point,
            &["snap_pub".to_owned()],
        )
        .await
        .unwrap();
    let mut inserted = Vec::new();
    within(PROMPT, async {
        while inserted.is_empty() {
            let payload = stream.next_copy_data().await.unwrap().expect("stream open");
            let event = highwater_host::replication::WalEvent::CopyData(payload);
            if let Seen::Insert { first_column, .. } = support::decode(&event) {
                inserted.push(first_column.unwrap());
            }
        }
    })
    .await;
    assert_eq!(inserted, vec!["after"]);
    stream.close().await;
}

#[tokio::test]
async fn stream_delivers_inserts_under_back_pressure_and_acks_advance_confirmed_flush_lsn() {
    let pg = server(PgOptions::default()).await;
    let names = prepare(&pg, "acks").await;
    let mut config = stream_config(&pg, &names, Lsn(0));
    config.capacity = 2;
    let mut stream = WalStream::spawn(config);
    assert!(matches!(next_seen(&mut stream).await, Seen::Started { .. }));

    let before = confirmed_flush(&pg, &names.slot).await.unwrap();
    for i in 0..20 {
        insert(&pg, &format!("row{i:02}")).await;
    }
    // Let the server fill the two-slot channel and the socket before the consumer reads.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut received = Vec::new();
    let mut last_end = Lsn(0);
    while received.len() < 20 {
        let (values, end) = next_transaction(&mut stream).await;
        assert!(end > last_end, "commit LSNs increase");
        last_end = end;
        received.extend(values);
    }
    let expected: Vec<String> = (0..20).map(|i| format!("row{i:02}")).collect();
    assert_eq!(received, expected);
    assert!(last_end > before);

    stream.ack(last_end);
    let confirmed = eventually("confirmed_flush_lsn to reach the ack", || async {
        confirmed_flush(&pg, &names.slot)
            .await
            .filter(|&lsn| lsn >= last_end)
    })
    .await;
    assert_eq!(confirmed, last_end);
    stream.shutdown().await;
}

/// A stop right after the last acknowledgement still confirms it: found by the ingest
/// benchmark, where `replicate` stopped after a 1,000,000-row transaction and the next run
/// received all of it again.
#[tokio::test]
async fn an_ack_followed_at_once_by_a_shutdown_is_confirmed_to_the_slot() {
    let pg = server(PgOptions::default()).await;
    let names = prepare(&pg, "lastack").await;
    let mut stream = WalStream::spawn(stream_config(&pg, &names, Lsn(0)));
    assert!(matches!(next_seen(&mut stream).await, Seen::Started { .. }));
    insert(&pg, "last").await;
    let (values, end) = next_transaction(&mut stream).await;
    assert_eq!(values, vec!["last"]);
    stream.ack(end);
    stream.shutdown().await;
    let confirmed = eventually("confirmed_flush_lsn to reach the last ack", || async {
        confirmed_flush(&pg, &names.slot)
            .await
            .filter(|&lsn| lsn >= end)
    })
    .await;
    assert_eq!(confirmed, end);
}

#[tokio::test]
async fn a_slot_held_by_another_connection_is_a_slot_in_use_error() {
    let pg = server(PgOptions::default()).await;
    let names = prepare(&pg, "busy").await;
    let holder = ReplicationConnection::connect(&params(&pg.url()))
        .await
        .unwrap()
        .start_replication(
            &names.slot,
            Lsn(0),
            std::slice::from_ref(&names.publication),
        )
        .await
        .unwrap();

    let direct = ReplicationConnection::connect(&params(&pg.url()))
        .await
        .unwrap()
        .start_replication(
            &names.slot,
            Lsn(0),
            std::slice::from_ref(&names.publication),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(direct, ReplicationError::SlotInUse { ref slot, .. } if *slot == names.slot),
        "{direct:?}"
    );

    let mut config = stream_config(&pg, &names, Lsn(0));
    config.slot_in_use_attempts = 3;
    let mut stream = WalStream::spawn(config);
    let error = within(PROMPT, stream.recv())
        .await
        .expect("an event")
        .expect_err("the slot is busy");
    match &error {
        ReplicationError::SlotInUse { slot, attempts, .. } => {
            assert_eq!((slot.as_str(), *attempts), (names.slot.as_str(), 3));
        }
        other => panic!("expected SlotInUse, got {other:?}"),
    }
    assert!(error.to_string().contains("pg_terminate_backend"));
    assert!(
        within(PROMPT, stream.recv()).await.is_none(),
        "the task gave up"
    );
    holder.close().await;
}

#[tokio::test]
async fn an_invalidated_slot_is_reported_with_how_to_reset_it() {
    let pg = server(PgOptions {
        hba_lines: vec![],
        settings: vec![("max_slot_wal_keep_size".into(), "1MB".into())],
    })
    .await;
    let names = prepare(&pg, "lost").await;
    let admin = pg.connect().await.unwrap();
    // Push the slot's WAL past max_slot_wal_keep_size, then let a checkpoint invalidate it.
    for i in 0..3 {
        admin
            .batch_execute(&format!(
                "INSERT INTO items SELECT 'w{i}_' || g FROM generate_series(1, 2000) g;
                 SELECT pg_switch_wal();"
            ))
            .await
            .unwrap();
    }
    admin.batch_execute("CHECKPOINT").await.unwrap();
    let state = setup::slot_state(&admin, &names.slot)
        .await
        .unwrap()
        .unwrap();
    assert!(state.is_invalidated(), "{state:?}");

    let error = setup::ensure_slot(&admin, &names.slot).await.unwrap_err();
    assert!(
        matches!(error, ReplicationError::SlotInvalidated { .. }),
        "{error:?}"
    );

    let mut stream = WalStream::spawn(stream_config(&pg, &names, Lsn(0)));
    let error = within(PROMPT, stream.recv())
        .await
        .expect("an event")
        .expect_err("the slot is invalidated");
    assert!(
        matches!(error, ReplicationError::SlotInvalidated { ref slot, .. } if *slot == names.slot),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains(&format!("pg_drop_replication_slot('{}')", names.slot)),
        "{error}"
    );
}

#[tokio::test]
async fn setup_refuses_a_server_without_logical_wal_level() {
    let pg = server(PgOptions {
        hba_lines: vec![],
        settings: vec![("wal_level".into(), "replica".into())],
    })
    .await;
    let client = pg.connect().await.unwrap();
    let error = setup::check_upstream(&client).await.unwrap_err();
    assert!(
        matches!(error, ReplicationError::WalLevelNotLogical { ref actual } if actual == "replica"),
        "{error:?}"
    );
    assert!(error.to_string().contains("wal_level = logical"));
}

#[tokio::test]
async fn an_idle_stream_answers_keepalives_and_outlives_wal_sender_timeout() {
    let pg = server(PgOptions {
        hba_lines: vec![],
        settings: vec![("wal_sender_timeout".into(), "1s".into())],
    })
    .await;
    let names = prepare(&pg, "idle").await;
    let client = pg.connect().await.unwrap();
    let settings = setup::check_upstream(&client).await.unwrap();
    assert_eq!(settings.wal_sender_timeout, Some(Duration::from_secs(1)));

    let mut config = stream_config(&pg, &names, Lsn(0));
    config.wal_sender_timeout = settings.wal_sender_timeout;
    let mut stream = WalStream::spawn(config);
    let Seen::Started { backend_pid, .. } = next_seen(&mut stream).await else {
        panic!("expected the stream to start");
    };
    // Three timeouts of silence: without replies the server would have dropped us.
    let mut reply_requests = 0;
    let quiet_until = tokio::time::Instant::now() + Duration::from_secs(3);
    while let Ok(event) = tokio::time::timeout_at(quiet_until, stream.recv()).await {
        match support::decode(&event.unwrap().unwrap()) {
            Seen::Keepalive { reply_requested } => reply_requests += usize::from(reply_requested),
            other => panic!("unexpected event on an idle stream: {other:?}"),
        }
    }
    assert!(reply_requests > 0, "the server asked for replies");
    let active: Option<i32> = client
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
            &[&names.slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(active, Some(backend_pid), "still the first walsender");
    insert(&pg, "late").await;
    let (values, _) = next_transaction(&mut stream).await;
    assert_eq!(values, vec!["late"]);
    stream.shutdown().await;
}

#[tokio::test]
async fn stream_resumes_from_the_acked_position_after_a_postgres_restart() {
    let mut pg = server(PgOptions::default()).await;
    let names = prepare(&pg, "restart").await;
    let mut stream = WalStream::spawn(stream_config(&pg, &names, Lsn(0)));
    let Seen::Started { backend_pid, .. } = next_seen(&mut stream).await else {
        panic!("expected the stream to start");
    };

    insert(&pg, "first").await;
    let (values, first_end) = next_transaction(&mut stream).await;
    assert_eq!(values, vec!["first"]);
    stream.ack(first_end);
    eventually("the ack to reach the server", || async {
        confirmed_flush(&pg, &names.slot)
            .await
            .filter(|&lsn| lsn >= first_end)
    })
    .await;

    pg.restart().await.unwrap();
    insert(&pg, "second").await;

    let Seen::Started {
        start,
        backend_pid: new_pid,
    } = next_seen(&mut stream).await
    else {
        panic!("expected a restart before more data");
    };
    assert_eq!(start, first_end, "resumes from the acked LSN");
    assert_ne!(new_pid, backend_pid, "a new walsender");
    let (values, second_end) = next_transaction(&mut stream).await;
    assert_eq!(
        values,
        vec!["second"],
        "the acked transaction is not sent again"
    );
    assert!(second_end > first_end);
    stream.shutdown().await;
}

/// Sends SIGCONT on drop, so a failing test never leaves our server's walsender stopped.
struct Paused(i32);

impl Paused {
    fn stop(pid: i32) -> Paused {
        signal("-STOP", pid);
        Paused(pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(which: &str, pid: i32) {
    let status = std::process::Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {which} {pid}");
}

#[tokio::test]
async fn a_silent_server_is_taken_for_dead_and_the_stream_reconnects() {
    // The server keeps its 60 s timeout, so only our own watchdog (set to 2 × 1 s) can notice
    // the silence and drop the connection.
    let pg = server(PgOptions::default()).await;
    let names = prepare(&pg, "silent").await;
    let mut config = stream_config(&pg, &names, Lsn(0));
    config.wal_sender_timeout = Some(Duration::from_secs(1));
    let mut stream = WalStream::spawn(config);
    let Seen::Started { backend_pid, .. } = next_seen(&mut stream).await else {
        panic!("expected the stream to start");
    };
    insert(&pg, "before").await;
    let (_, acked) = next_transaction(&mut stream).await;
    stream.ack(acked);

    // A frozen walsender sends nothing, not even keepalives: after 2 × 1 s we must give up on it.
    let paused = Paused::stop(backend_pid);
    tokio::time::sleep(Duration::from_secs(3)).await;
    drop(paused);
    insert(&pg, "after").await;

    let Seen::Started {
        start,
        backend_pid: new_pid,
    } = next_seen(&mut stream).await
    else {
        panic!("expected a reconnect");
    };
    assert_ne!(new_pid, backend_pid);
    assert_eq!(start, acked);
    let (values, _) = next_transaction(&mut stream).await;
    assert_eq!(values, vec!["after"]);
    stream.shutdown().await;
}

#[tokio::test]
async fn values_are_read_in_iso_formats_whatever_the_server_datestyle() {
    use highwater_engine::change_stream::{Change, DownstreamMessage};
    use highwater_engine::pgoutput::{PgoutputEvent, PgoutputMapper};

    // A server whose defaults print dates as `SQL, DMY` in a non-UTC zone: the replication
    // session must still hand the mapper ISO text it can parse.
    let pg = server(PgOptions {
        settings: vec![
            ("datestyle".into(), "SQL, DMY".into()),
            ("timezone".into(), "America/New_York".into()),
        ],
        ..PgOptions::default()
    })
    .await;
    let admin = pg.connect().await.unwrap();
    admin
        .batch_execute(
            "CREATE TABLE stamps (id int PRIMARY KEY, at timestamptz, day date, x float8);
             CREATE PUBLICATION stamps_pub FOR ALL TABLES;",
        )
        .await
        .unwrap();
    let mut conn = ReplicationConnection::connect(&params(&pg.url()))
        .await
        .unwrap();
    let created = conn.create_slot_with_snapshot("stamps_slot").await.unwrap();
    admin
        .batch_execute(
            "INSERT INTO stamps VALUES
               (1, '2024-03-05 06:07:08.5+00', '2024-03-05', 0.1)",
        )
        .await
        .unwrap();
    let mut stream = conn
        .start_replication(
            "stamps_slot",
            created.consistent_point,
            &["stamps_pub".to_owned()],
        )
        .await
        .unwrap();
    let mut mapper = PgoutputMapper::new();
    let row = within(PROMPT, async {
        loop {
            let payload = stream.next_copy_data().await.unwrap().expect("stream open");
            let event = mapper.map_frame(&payload).expect("maps");
            if let Some(PgoutputEvent::Downstream(DownstreamMessage::Data(Change::Insert(
                insert,
            )))) = event
            {
                return insert.new;
            }
        }
    })
    .await;
    // 2024-03-05T06:07:08.5Z and 2024-03-05T00:00:00Z in Unix milliseconds.
    assert_eq!(row["at"].as_f64(), Some(1_709_618_828_500.0));
    assert_eq!(row["day"].as_f64(), Some(1_709_596_800_000.0));
    assert_eq!(row["x"].as_f64(), Some(0.1));
    stream.close().await;
}
