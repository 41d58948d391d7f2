//! The ingest workload: a table of realistic order rows (~170 bytes of text per row), its
//! publication, and the two phases that fill it: one bulk `INSERT … SELECT generate_series`
//! transaction, then many single-row transactions from pipelined clients.
//!
//! Each phase ends with a transaction committed alone, inside which the WAL insert position
//! is read: that position is at or below the commit LSN of the phase's last transaction and
//! above every earlier commit, so "a consumer's position ≥ it" means "the phase is through".

use std::time::{Duration, Instant};

use anyhow::Context;
use futures::stream::{self, StreamExt, TryStreamExt};
use highwater_engine::watermark::Lsn;
use tokio_postgres::{Client, Config, NoTls};

/// The benchmark table (schema `public`).
pub const TABLE: &str = "highwater_bench_orders";
/// The publication both consumers stream.
pub const PUBLICATION: &str = "hwbench_pub";

/// One row as a function of its id, so both phases produce the same shape of data.
const ROW_SELECT: &str = "i, \
     (i % 1000)::int, \
     (ARRAY['new','paid','shipped','returned'])[1 + (i % 4)::int], \
     'order ' || i || ' for customer ' || md5(i::text), \
     round(((i * 37) % 100000) / 100.0, 2)::numeric(12,2), \
     timestamptz '2024-01-01 00:00:00+00' + i * interval '1 second', \
     jsonb_build_object('sku', 'SKU-' || (i % 5000), 'qty', i % 7 + 1, \
                        'tags', jsonb_build_array('retail', 'eu'), 'gift', i % 2 = 0)";

/// How a phase's workload went on the Postgres side.
#[derive(Debug, Clone)]
pub struct PhaseCommit {
    pub rows: u64,
    pub txns: u64,
    /// From the phase start until the last commit returned to the client.
    pub elapsed: Duration,
    /// When the last commit returned.
    pub committed_at: Instant,
    /// At or below the last transaction's commit LSN, above every earlier commit.
    pub last_commit_floor: Lsn,
    /// The WAL write position after the last commit (at or past its end).
    pub wal_end: Lsn,
    /// WAL written by the phase.
    pub wal_bytes: u64,
}

/// An ordinary connection whose connection task runs on the current runtime.
pub async fn connect(config: &Config) -> anyhow::Result<Client> {
    let (client, connection) = config
        .connect(NoTls)
        .await
        .context("cannot connect to the upstream Postgres")?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "benchmark connection ended");
        }
    });
    Ok(client)
}

/// Creates the table and its publication (dropping leftovers of an interrupted run first).
pub async fn create_schema(client: &Client) -> anyhow::Result<()> {
    drop_schema(client).await?;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.{TABLE} (
               id bigint PRIMARY KEY,
               account_id int NOT NULL,
               status text NOT NULL,
               title text NOT NULL,
               amount numeric(12,2) NOT NULL,
               created_at timestamptz NOT NULL,
               attributes jsonb NOT NULL
             ) WITH (autovacuum_enabled = false);
             CREATE PUBLICATION {PUBLICATION} FOR TABLE public.{TABLE};"
        ))
        .await
        .context("cannot create the benchmark table and publication")
}

pub async fn drop_schema(client: &Client) -> anyhow::Result<()> {
    client
        .batch_execute(&format!(
            "DROP PUBLICATION IF EXISTS {PUBLICATION};
             DROP TABLE IF EXISTS public.{TABLE};"
        ))
        .await
        .context("cannot drop the benchmark table and publication")
}

pub async fn wal_position(client: &Client) -> anyhow::Result<Lsn> {
    let text: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .try_get(0)?;
    Ok(text.parse()?)
}

/// Phase A: rows `first_id ..` inserted by one `INSERT … SELECT generate_series` transaction.
pub async fn bulk_insert(
    client: &mut Client,
    first_id: i64,
    rows: u64,
) -> anyhow::Result<PhaseCommit> {
    let wal_start = wal_position(client).await?;
    let started = Instant::now();
    let last_id = first_id + i64::try_from(rows)? - 1;
    let txn = client.transaction().await?;
    txn.execute(
        &format!("INSERT INTO public.{TABLE} SELECT {ROW_SELECT} FROM generate_series($1::int8, $2::int8) AS i"),
        &[&first_id, &last_id],
    )
    .await
    .context("the bulk insert failed")?;
    let floor = insert_position(&txn).await?;
    txn.commit().await?;
    finish(client, started, wal_start, floor, rows, 1).await
}

/// Phase B: rows `first_id ..`, one transaction each, from `clients` connections with up to
/// `depth` statements in flight on each (tokio-postgres pipelines them; every statement is its
/// own implicit transaction). The last row is committed alone, after all others.
pub async fn single_row_txns(
    config: &Config,
    client: &mut Client,
    first_id: i64,
    txns: u64,
    clients: usize,
    depth: usize,
) -> anyhow::Result<PhaseCommit> {
    let insert =
        format!("INSERT INTO public.{TABLE} SELECT {ROW_SELECT} FROM (SELECT $1::int8 AS i) AS r");
    let wal_start = wal_position(client).await?;
    let clients = clients.max(1);
    let mut connections = Vec::with_capacity(clients);
    for _ in 0..clients {
        let connection = connect(config).await?;
        let statement = connection.prepare(&insert).await?;
        connections.push((connection, statement));
    }
    let last_id = first_id + i64::try_from(txns)? - 1;
    let started = Instant::now();
    let workers = connections
        .iter()
        .enumerate()
        .map(|(n, (connection, statement))| {
            let ids = (first_id..last_id).skip(n).step_by(clients);
            stream::iter(ids)
                .map(move |id| async move { connection.execute(statement, &[&id]).await })
                .buffer_unordered(depth.max(1))
                .try_for_each(|_| async { Ok(()) })
        });
    futures::future::try_join_all(workers)
        .await
        .context("a single-row insert failed")?;
    let txn = client.transaction().await?;
    txn.execute(&insert, &[&last_id]).await?;
    let floor = insert_position(&txn).await?;
    txn.commit().await?;
    finish(client, started, wal_start, floor, txns, txns).await
}

async fn insert_position(txn: &tokio_postgres::Transaction<'_>) -> anyhow::Result<Lsn> {
    let text: String = txn
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await?
        .try_get(0)?;
    Ok(text.parse()?)
}

async fn finish(
    client: &Client,
    started: Instant,
    wal_start: Lsn,
    floor: Lsn,
    rows: u64,
    txns: u64,
) -> anyhow::Result<PhaseCommit> {
    let committed_at = Instant::now();
    let wal_end = wal_position(client).await?;
    Ok(PhaseCommit {
        rows,
        txns,
        elapsed: committed_at - started,
        committed_at,
        last_commit_floor: floor,
        wal_end,
        wal_bytes: wal_end.0.saturating_sub(wal_start.0),
    })
}

/// Rows of the benchmark table upstream.
pub async fn row_count(client: &Client) -> anyhow::Result<u64> {
    let count: i64 = client
        .query_one(&format!("SELECT count(*) FROM public.{TABLE}"), &[])
        .await?
        .try_get(0)?;
    Ok(u64::try_from(count)?)
}
