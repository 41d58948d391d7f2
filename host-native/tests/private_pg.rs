//! The private Postgres helper's crash stop: `pg_ctl stop -m immediate` (no shutdown
//! checkpoint), then a start on the same data directory and port, which recovers from the WAL.

use highwater_host::private_pg::{PgOptions, PrivatePg};

#[tokio::test]
async fn a_crash_stop_keeps_committed_rows_and_the_server_starts_again_on_its_port() {
    let mut pg = PrivatePg::start(PgOptions::default())
        .await
        .expect("start a private Postgres");
    let port = pg.port();
    let db = pg.connect().await.expect("connect");
    db.batch_execute("CREATE TABLE t (x int); INSERT INTO t VALUES (1), (2)")
        .await
        .expect("write");
    pg.crash_server().await.expect("immediate stop");
    assert!(
        db.simple_query("SELECT 1").await.is_err(),
        "expected the old session to be gone after the crash"
    );
    pg.start_server().await.expect("start again");
    assert_eq!(pg.port(), port);
    let db = pg.connect().await.expect("reconnect");
    let count: i64 = db
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .expect("read")
        .get(0);
    assert_eq!(count, 2);
    let recovered = std::fs::read_to_string(pg.data_dir().join("../postgres.log"))
        .unwrap_or_default()
        .contains("was interrupted");
    assert!(
        recovered,
        "expected the start to recover from an interrupted shutdown"
    );
}
