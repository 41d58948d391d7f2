//! A table rewrite is not MVCC-safe in Postgres: a snapshot taken before `ALTER TABLE … ADD
//! COLUMN … serial` (or `DEFAULT now()`, or `ALTER COLUMN … TYPE`) committed sees the rewritten
//! table as empty. A backfill read in such a snapshot completed with no rows, and subscribers
//! kept NULL in the new column for good. `lock_unless_rewritten` tells such a snapshot apart.

use highwater_host::replication::backfill::lock_unless_rewritten;

use crate::scratch_support;

async fn count(client: &tokio_postgres::Client) -> Result<i64, tokio_postgres::Error> {
    client
        .query_one("SELECT count(*) FROM issue", &[])
        .await?
        .try_get(0)
}

#[tokio::test]
async fn a_snapshot_taken_before_a_table_rewrite_is_told_apart() {
    let pg = scratch_support::start_pg().await;
    let reader = pg.connect().await.unwrap();
    let writer = pg.connect().await.unwrap();
    writer
        .batch_execute(
            "CREATE TABLE issue (id int PRIMARY KEY, title text);
             INSERT INTO issue SELECT g, 'i' || g FROM generate_series(1, 5) g;",
        )
        .await
        .unwrap();

    // The snapshot is taken, then the table is rewritten and the rewrite commits.
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SELECT 1;")
        .await
        .unwrap();
    writer
        .batch_execute("ALTER TABLE issue ADD COLUMN serial_no serial")
        .await
        .unwrap();
    assert!(!lock_unless_rewritten(&reader, "public", "issue")
        .await
        .unwrap());
    assert_eq!(
        count(&reader).await.unwrap(),
        0,
        "what a backfill in this snapshot would read"
    );
    reader.batch_execute("ROLLBACK").await.unwrap();

    // A snapshot after the rewrite shows the rows, and the lock holds off the next rewrite.
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; SELECT 1;")
        .await
        .unwrap();
    assert!(lock_unless_rewritten(&reader, "public", "issue")
        .await
        .unwrap());
    assert_eq!(count(&reader).await.unwrap(), 5);
    let blocked = writer
        .batch_execute(
            "SET lock_timeout = '200ms'; ALTER TABLE issue ALTER COLUMN title TYPE varchar(10)",
        )
        .await;
    assert!(blocked.is_err(), "a rewrite waits for the backfill's lock");
    reader.batch_execute("ROLLBACK").await.unwrap();

    // A table that is gone has nothing to lock.
    reader
        .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;")
        .await
        .unwrap();
    assert!(lock_unless_rewritten(&reader, "public", "nope")
        .await
        .unwrap());
    reader.batch_execute("ROLLBACK").await.unwrap();
}
