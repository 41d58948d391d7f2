//! The workload and its ledger: a few writers commit small transactions of inserts, updates
//! (some moving a row to another owner, some changing its key) and deletes on `items`. Every
//! transaction first inserts one row into `ledger` with a tag unique to it, so the set of
//! committed transactions is read back from Postgres itself at the end, whatever the writers
//! could not learn (a connection lost during COMMIT leaves its outcome unknown to them).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value};
use tokio::sync::watch;

use crate::rng::Rng;

pub const ITEMS: &str = "items";
pub const LEDGER: &str = "ledger";
pub const OWNERS: [&str; 3] = ["ada", "grace", "linus"];

pub const SCHEMA: &str = "CREATE TABLE items (id int8 PRIMARY KEY, owner text NOT NULL, v text);
     CREATE TABLE ledger (tag int8 PRIMARY KEY, writer int4 NOT NULL)";

/// Tags and ids of writer `w` are `w * ID_SPACE + k`.
const ID_SPACE: i64 = 1_000_000_000;
/// A writer deletes more once it holds this many rows.
const LIVE_ROWS: usize = 150;

/// What the writers learnt about their own transactions.
#[derive(Debug, Default)]
pub struct Tally {
    /// COMMIT answered OK.
    pub committed: AtomicU64,
    /// The connection failed during COMMIT: it may or may not have committed.
    pub unknown: AtomicU64,
    /// Failed before COMMIT (rolled back).
    pub failed: AtomicU64,
    /// Tags whose COMMIT answered OK, for the check that Postgres kept them.
    pub acknowledged: std::sync::Mutex<BTreeSet<i64>>,
    /// Woken whenever a large transaction commits, for a kill aimed at its store.
    pub large_committed: tokio::sync::Notify,
}

/// A column value as text, the same for a change-stream row, a scope row and a Postgres row.
pub fn text_of(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "<null>".to_owned(),
        Value::Number(n) => n.to_string(),
        other => other.to_string(),
    }
}

pub fn int_of(value: &Value) -> Option<i64> {
    match value {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

pub fn row_key(row: &Map<String, Value>) -> Option<i64> {
    int_of(row.get("id")?)
}

/// A row's columns as text. A null column is left out, so a column added (with no default)
/// after a row was sent compares equal to the same column present and null.
pub fn row_values(row: &Map<String, Value>) -> BTreeMap<String, String> {
    row.iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), text_of(v)))
        .collect()
}

/// Applies an update's new values to a held row (columns absent from it keep their value).
pub fn merge_values(row: &mut BTreeMap<String, String>, new: &Map<String, Value>) {
    for (k, v) in new {
        if v.is_null() {
            row.remove(k);
        } else {
            row.insert(k.clone(), text_of(v));
        }
    }
}

/// `items` as Postgres has it now, and the ledger's tags.
pub struct PgState {
    pub rows: BTreeMap<i64, BTreeMap<String, String>>,
    pub tags: BTreeSet<i64>,
}

pub async fn pg_state(client: &tokio_postgres::Client) -> anyhow::Result<PgState> {
    let mut rows = BTreeMap::new();
    for row in client
        .query("SELECT row_to_json(i)::text FROM items AS i", &[])
        .await?
    {
        let text: String = row.get(0);
        let Value::Object(object) = serde_json::from_str(&text)? else {
            anyhow::bail!("expected a JSON object for a row, got {text}");
        };
        let id = row_key(&object).ok_or_else(|| anyhow::anyhow!("a row without an id: {text}"))?;
        rows.insert(id, row_values(&object));
    }
    let tags = client
        .query("SELECT tag FROM ledger", &[])
        .await?
        .iter()
        .map(|r| r.get::<_, i64>(0))
        .collect();
    Ok(PgState { rows, tags })
}

/// Schema changes made once each during the run, in order, at seeded times: a column added
/// (no default: existing rows hold null), then an index.
pub const SCHEMA_CHANGES: [&str; 2] = [
    "ALTER TABLE items ADD COLUMN note text",
    "CREATE INDEX items_owner ON items (owner)",
];

fn already_exists(error: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    error.code().is_some_and(|code| {
        *code == SqlState::DUPLICATE_COLUMN || *code == SqlState::DUPLICATE_TABLE
    })
}

/// Runs `SCHEMA_CHANGES[i]` at `at[i]` after the start, retrying while Postgres restarts; the
/// column exists for the writers once `note` is set.
pub async fn schema_changes(
    url: String,
    at: [Duration; 2],
    note: Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<usize> {
    let started = tokio::time::Instant::now();
    let mut done = 0;
    for (ddl, at) in SCHEMA_CHANGES.iter().zip(at) {
        tokio::time::sleep_until(started + at).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let attempt = async {
                let (client, connection) =
                    tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
                let connection = tokio::spawn(connection);
                let result = client.batch_execute(ddl).await;
                connection.abort();
                result
            };
            match tokio::time::timeout(Duration::from_secs(10), attempt).await {
                Ok(Ok(())) => break,
                // Lost with the connection: it may have committed (then it fails as a repeat).
                Ok(Err(error)) if already_exists(&error) => break,
                _ if tokio::time::Instant::now() > deadline => {
                    anyhow::bail!("could not run `{ddl}` within a minute")
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        if ddl.contains("ADD COLUMN note") {
            note.store(true, Ordering::Relaxed);
        }
        done += 1;
    }
    Ok(done)
}

/// One writer until `stop`, reconnecting (directly to Postgres) after every failure.
pub async fn writer(
    w: i64,
    url: String,
    mut rng: Rng,
    tally: Arc<Tally>,
    note: Arc<std::sync::atomic::AtomicBool>,
    stop: watch::Receiver<bool>,
) {
    let mut next = w * ID_SPACE;
    let mut live: Vec<i64> = Vec::new();
    while !*stop.borrow() {
        let Ok((mut client, connection)) =
            tokio_postgres::connect(&url, tokio_postgres::NoTls).await
        else {
            tokio::time::sleep(Duration::from_millis(rng.range(100, 300))).await;
            continue;
        };
        let connection = tokio::spawn(connection);
        while !*stop.borrow() {
            next += 1;
            let tag = next;
            let plan = plan(&mut rng, &mut next, &live, w);
            let note = note.load(Ordering::Relaxed);
            match transaction(&mut client, w, tag, &plan, note).await {
                Outcome::Committed => {
                    tally.committed.fetch_add(1, Ordering::Relaxed);
                    tally
                        .acknowledged
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(tag);
                    for op in &plan {
                        op.learn(&mut live);
                    }
                    if plan.iter().any(Op::is_large) {
                        tally.large_committed.notify_waiters();
                    }
                }
                Outcome::Unknown => {
                    tally.unknown.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Outcome::Failed => {
                    tally.failed.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(rng.range(5, 40))).await;
        }
        connection.abort();
        tokio::time::sleep(Duration::from_millis(rng.range(50, 200))).await;
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert {
        id: i64,
        owner: &'static str,
        v: String,
    },
    Update {
        id: i64,
        v: String,
    },
    Move {
        id: i64,
        owner: &'static str,
    },
    Rekey {
        id: i64,
        to: i64,
    },
    Delete {
        id: i64,
    },
    /// Many rows in one statement: a large transaction, so that a kill lands inside its store.
    InsertMany {
        first: i64,
        count: i64,
        owner: &'static str,
    },
    /// Every row of this writer.
    UpdateAll {
        lo: i64,
        hi: i64,
        v: String,
    },
    DeleteMany {
        ids: Vec<i64>,
    },
}

impl Op {
    fn is_large(&self) -> bool {
        matches!(
            self,
            Op::InsertMany { .. } | Op::UpdateAll { .. } | Op::DeleteMany { .. }
        )
    }

    fn learn(&self, live: &mut Vec<i64>) {
        match self {
            Op::Insert { id, .. } => live.push(*id),
            Op::Rekey { id, to } => {
                live.retain(|x| x != id);
                live.push(*to);
            }
            Op::Delete { id } => live.retain(|x| x != id),
            Op::InsertMany { first, count, .. } => live.extend(*first..*first + *count),
            Op::DeleteMany { ids } => live.retain(|x| !ids.contains(x)),
            Op::Update { .. } | Op::Move { .. } | Op::UpdateAll { .. } => {}
        }
    }
}

fn plan(rng: &mut Rng, next: &mut i64, live: &[i64], w: i64) -> Vec<Op> {
    let mut ops = Vec::new();
    let mut mine: Vec<i64> = live.to_vec();
    // One transaction in 50 is large.
    match rng.range(0, 150) {
        0 => {
            let count = rng.range(100, 400) as i64;
            let first = *next + 1;
            *next += count;
            let owner = OWNERS[rng.range(0, OWNERS.len() as u64) as usize];
            ops.push(Op::InsertMany {
                first,
                count,
                owner,
            });
        }
        1 => ops.push(Op::UpdateAll {
            lo: w * ID_SPACE,
            hi: (w + 1) * ID_SPACE,
            v: format!("all{}", rng.next_u64() % 1_000_000),
        }),
        2 if mine.len() > LIVE_ROWS => {
            let keep = mine.len() - LIVE_ROWS / 2;
            ops.push(Op::DeleteMany {
                ids: mine[..keep].to_vec(),
            })
        }
        _ => {}
    }
    for op in &ops {
        op.learn(&mut mine);
    }
    for _ in 0..rng.range(1, 4) {
        let roll = rng.range(0, 100);
        let delete_bias = if mine.len() > LIVE_ROWS { 40 } else { 0 };
        let target = rng.pick(&mine).copied();
        let owner = OWNERS[rng.range(0, OWNERS.len() as u64) as usize];
        let op = match target {
            Some(id) if roll < 15 + delete_bias => Op::Delete { id },
            Some(id) if roll < 45 + delete_bias => Op::Update {
                id,
                v: format!("v{}", rng.next_u64() % 1_000_000),
            },
            Some(id) if roll < 60 + delete_bias => Op::Move { id, owner },
            Some(id) if roll < 65 + delete_bias => {
                *next += 1;
                Op::Rekey { id, to: *next }
            }
            _ => {
                *next += 1;
                Op::Insert {
                    id: *next,
                    owner,
                    v: format!("v{}", rng.next_u64() % 1_000_000),
                }
            }
        };
        op.learn(&mut mine);
        ops.push(op);
    }
    ops
}

enum Outcome {
    Committed,
    Unknown,
    Failed,
}

async fn transaction(
    client: &mut tokio_postgres::Client,
    w: i64,
    tag: i64,
    plan: &[Op],
    note: bool,
) -> Outcome {
    let writer = i32::try_from(w).unwrap_or(i32::MAX);
    let body = async {
        let tx = client.transaction().await?;
        tx.execute(
            "INSERT INTO ledger (tag, writer) VALUES ($1, $2)",
            &[&tag, &writer],
        )
        .await?;
        for op in plan {
            match op {
                Op::Insert { id, owner, v } => {
                    tx.execute(
                        "INSERT INTO items (id, owner, v) VALUES ($1, $2, $3)",
                        &[id, owner, v],
                    )
                    .await?
                }
                // Once the column exists, updates set it too (null now and then).
                Op::Update { id, v } if note => {
                    let note = (!v.ends_with('7')).then(|| format!("note {v}"));
                    tx.execute(
                        "UPDATE items SET v = $2, note = $3 WHERE id = $1",
                        &[id, v, &note],
                    )
                    .await?
                }
                Op::Update { id, v } => {
                    tx.execute("UPDATE items SET v = $2 WHERE id = $1", &[id, v])
                        .await?
                }
                Op::Move { id, owner } => {
                    tx.execute("UPDATE items SET owner = $2 WHERE id = $1", &[id, owner])
                        .await?
                }
                Op::Rekey { id, to } => {
                    tx.execute("UPDATE items SET id = $2 WHERE id = $1", &[id, to])
                        .await?
                }
                Op::Delete { id } => tx.execute("DELETE FROM items WHERE id = $1", &[id]).await?,
                Op::InsertMany {
                    first,
                    count,
                    owner,
                } => {
                    tx.execute(
                        "INSERT INTO items (id, owner, v) \
                         SELECT g, $3, 'bulk' || g FROM generate_series($1::int8, $2::int8) AS g",
                        &[first, &(first + count - 1), owner],
                    )
                    .await?
                }
                Op::UpdateAll { lo, hi, v } => {
                    tx.execute(
                        "UPDATE items SET v = $3 WHERE id > $1 AND id < $2",
                        &[lo, hi, v],
                    )
                    .await?
                }
                Op::DeleteMany { ids } => {
                    tx.execute("DELETE FROM items WHERE id = ANY($1)", &[ids])
                        .await?
                }
            };
        }
        Ok::<_, tokio_postgres::Error>(tx)
    };
    let tx = match tokio::time::timeout(Duration::from_secs(10), body).await {
        Ok(Ok(tx)) => tx,
        _ => return Outcome::Failed,
    };
    match tokio::time::timeout(Duration::from_secs(10), tx.commit()).await {
        Ok(Ok(())) => Outcome::Committed,
        _ => Outcome::Unknown,
    }
}
