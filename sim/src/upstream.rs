//! The simulated upstream Postgres: tables with primary keys, a write-ahead log of committed
//! transactions, one logical replication slot, and a replication session that sends the log as
//! real pgoutput CopyData frames (the engine's own encoder).
//!
//! As Postgres does, a new session starts at the slot's confirmed position and re-sends every
//! transaction whose commit LSN is at or after it; it sends a table's Relation message before
//! the first change of that table in the session and again after the table's schema changed.
//! Schema changes (a column added, a table created) happen between transactions, like DDL that
//! commits on its own, and show only through later Relation messages (no event trigger).

use std::collections::{BTreeMap, HashMap, VecDeque};

use highwater_engine::pgoutput::test_encoder::{keepalive_frame, xlog};
use highwater_engine::pgoutput::{
    Begin, Commit, Delete, Insert, LogicalMessage, OldTuple, PgTimestamp, PgoutputMessage,
    PrimaryKeepalive, Relation, RelationColumn, ReplicaIdentity, Truncate, Tuple, TupleValue,
    Update,
};
use highwater_engine::scope_sync::CONFIRM_MESSAGE_PREFIX;
use highwater_engine::watermark::{Lsn, Watermark};
use serde_json::{Map, Value};

use crate::rng::Rng;

pub const SCHEMA: &str = "public";
pub const INT4: u32 = 23;
pub const TEXT: u32 = 25;
/// The scope column of every table that scope clients subscribe to.
pub const OWNER: &str = "owner";
pub const OWNERS: [&str; 3] = ["ada", "bob", "cy"];
/// Tables that exist from the start and are open to scope sync.
pub const SCOPED_TABLES: [&str; 2] = ["todos", "items"];
/// Who is in which project: `members(id, project_id, user_id)`. The row filters' subqueries
/// read it; nobody subscribes to it.
pub const MEMBERS: &str = "members";
/// The project column of the scoped tables and of `members`.
pub const PROJECT: &str = "project_id";
pub const PROJECTS: [i64; 5] = [1, 2, 3, 4, 5];
/// The user column of `members`; users are the owners' names.
pub const USER: &str = "user_id";
/// `items.todo_id`: the todo an item belongs to (a nested filter reaches items through it).
pub const TODO: &str = "todo_id";
/// Commit times start here (2026-12-01T12:00:00Z).
pub const EPOCH_UNIX_MS: i64 = 1_796_126_400_000;
/// The slot's position when the replica was made; its watermark is the replica version.
pub const START_LSN: u64 = 0x1000;

/// The columns the scope feed journals in a table's exits (its conditions' and the row
/// filters' columns, as the host derives them from the rules); empty: the feed does not follow
/// the table.
pub fn feed_columns(table: &str) -> Vec<String> {
    let columns: &[&str] = match table {
        "todos" => &[OWNER, PROJECT, "id"],
        "items" => &[OWNER, PROJECT, TODO],
        MEMBERS => &[PROJECT, USER],
        _ => &[],
    };
    columns.iter().map(|c| (*c).to_owned()).collect()
}

/// One table: its schema history (one Relation per version) and its rows, as text values in
/// column order (`None` is NULL).
#[derive(Debug, Clone)]
pub struct Table {
    pub versions: Vec<Relation>,
    pub rows: BTreeMap<i64, Vec<Option<String>>>,
    next_id: i64,
}

impl Table {
    pub fn relation(&self) -> &Relation {
        self.versions.last().expect("a table has a schema")
    }

    /// A row as the replica stores it: JSON numbers for int4, strings for text.
    pub fn row_json(&self, values: &[Option<String>]) -> Map<String, Value> {
        row_json(self.relation(), values)
    }
}

pub fn row_json(relation: &Relation, values: &[Option<String>]) -> Map<String, Value> {
    let mut out = Map::new();
    for (col, value) in relation.columns.iter().zip(values) {
        let v = match value {
            None => Value::Null,
            Some(text) if col.type_oid == INT4 => text
                .parse::<i64>()
                .map(Value::from)
                .unwrap_or(Value::String(text.clone())),
            Some(text) => Value::String(text.clone()),
        };
        out.insert(col.name.clone(), v);
    }
    out
}

#[derive(Debug, Clone)]
pub enum WalOp {
    Insert {
        oid: u32,
        version: usize,
        values: Vec<Option<String>>,
    },
    Update {
        oid: u32,
        version: usize,
        /// The old key, when the update changed it.
        old_id: Option<i64>,
        values: Vec<Option<String>>,
    },
    Delete {
        oid: u32,
        version: usize,
        id: i64,
    },
    Truncate {
        oid: u32,
        version: usize,
    },
    /// A transactional logical decoding message (`pg_logical_emit_message(true, …)`).
    Message {
        prefix: String,
        content: String,
    },
}

/// A committed upstream transaction.
#[derive(Debug, Clone)]
pub struct WalTx {
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub xid: u32,
    pub commit_time_ms: i64,
    pub ops: Vec<WalOp>,
    /// What a change-stream subscriber must see of it: `tag table id` per row change.
    pub digest: Vec<String>,
}

impl WalTx {
    pub fn watermark(&self) -> Watermark {
        self.commit_lsn.to_watermark()
    }
}

/// The replication session currently streaming.
#[derive(Debug)]
struct Session {
    /// Index into the WAL of the next transaction to send.
    next_tx: usize,
    frames: VecDeque<Vec<u8>>,
    /// Relation version sent per OID.
    sent: HashMap<u32, usize>,
}

/// The simulated Postgres. See the module docs.
#[derive(Debug)]
pub struct SimPg {
    pub tables: BTreeMap<String, Table>,
    oids: BTreeMap<u32, String>,
    pub wal: Vec<WalTx>,
    /// The slot's `confirmed_flush_lsn`.
    pub confirmed: Lsn,
    next_lsn: u64,
    next_xid: u32,
    session: Option<Session>,
    /// Writes of sync clients, exactly once: per client, the last mutation id applied (the
    /// host writes it in the same transaction as the mutation).
    pub last_applied: BTreeMap<String, u64>,
    /// Every mutation ever applied, in order: (client id, mutation id).
    pub applied: Vec<(String, u64)>,
}

/// What became of a mutation handed to [`SimPg::apply_mutation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// Applied now, in its own transaction.
    Now,
    /// Applied before (its id is at or below the client's last applied id): not again.
    Before,
}

fn column(name: &str, type_oid: u32, key: bool) -> RelationColumn {
    RelationColumn {
        flags: u8::from(key),
        name: name.to_owned(),
        type_oid,
        type_modifier: -1,
    }
}

impl SimPg {
    /// Two scoped tables and the membership table, with a few rows each (the replica's
    /// initial copy).
    pub fn new(rng: &mut Rng) -> Self {
        let mut pg = SimPg {
            tables: BTreeMap::new(),
            oids: BTreeMap::new(),
            wal: Vec::new(),
            confirmed: Lsn(START_LSN),
            next_lsn: START_LSN + 0x100,
            next_xid: 700,
            session: None,
            last_applied: BTreeMap::new(),
            applied: Vec::new(),
        };
        pg.create_table(
            MEMBERS,
            vec![
                column("id", INT4, true),
                column(PROJECT, INT4, false),
                column(USER, TEXT, false),
            ],
        );
        for name in SCOPED_TABLES {
            let mut columns = vec![
                column("id", INT4, true),
                column(OWNER, TEXT, false),
                column("title", TEXT, false),
                column("n", INT4, false),
                column(PROJECT, INT4, false),
            ];
            if name == "items" {
                columns.push(column(TODO, INT4, false));
            }
            pg.create_table(name, columns);
        }
        // Todos first: items point at them.
        for name in ["todos", "items", MEMBERS] {
            for _ in 0..rng.range(2, 6) {
                let values = pg.new_row(name, rng);
                let id = values[0]
                    .as_deref()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                pg.tables
                    .get_mut(name)
                    .expect("table")
                    .rows
                    .insert(id, values);
            }
        }
        pg
    }

    /// The replica version: the slot position the initial copy was taken at.
    pub fn replica_version() -> Watermark {
        Lsn(START_LSN).to_watermark()
    }

    fn create_table(&mut self, name: &str, columns: Vec<RelationColumn>) {
        let oid = 16_384 + self.oids.len() as u32;
        let relation = Relation {
            oid,
            namespace: SCHEMA.to_owned(),
            name: name.to_owned(),
            replica_identity: ReplicaIdentity::Default,
            columns,
        };
        self.oids.insert(oid, name.to_owned());
        self.tables.insert(
            name.to_owned(),
            Table {
                versions: vec![relation],
                rows: BTreeMap::new(),
                next_id: 1,
            },
        );
    }

    fn new_row(&mut self, table: &str, rng: &mut Rng) -> Vec<Option<String>> {
        let todos = self.todo_ids();
        let t = self.tables.get_mut(table).expect("table");
        let id = t.next_id;
        t.next_id += 1;
        let relation = t.relation().clone();
        relation
            .columns
            .iter()
            .map(|c| match c.name.as_str() {
                "id" => Some(id.to_string()),
                _ => column_value(c, &todos, rng),
            })
            .collect()
    }

    /// The ids of the todos now (what `items.todo_id` points at).
    fn todo_ids(&self) -> Vec<i64> {
        self.tables
            .get("todos")
            .map(|t| t.rows.keys().copied().collect())
            .unwrap_or_default()
    }

    /// Adds a nullable column to `table` (existing rows read NULL, as in Postgres).
    pub fn add_column(&mut self, table: &str, name: &str, type_oid: u32) {
        let Some(t) = self.tables.get_mut(table) else {
            return;
        };
        if t.relation().columns.iter().any(|c| c.name == name) {
            return;
        }
        let mut relation = t.relation().clone();
        relation.columns.push(column(name, type_oid, false));
        t.versions.push(relation);
        for row in t.rows.values_mut() {
            row.push(None);
        }
    }

    /// Adds a column whose existing rows get values only upstream knows (`ADD COLUMN …
    /// DEFAULT now()`: a table rewrite the stream does not carry; only a backfill brings them).
    pub fn add_column_with_values(&mut self, table: &str, name: &str, rng: &mut Rng) {
        let Some(t) = self.tables.get_mut(table) else {
            return;
        };
        if t.relation().columns.iter().any(|c| c.name == name) {
            return;
        }
        let mut relation = t.relation().clone();
        let col = column(name, TEXT, false);
        for row in t.rows.values_mut() {
            row.push(Some(format!("t{}", rng.below(100_000))));
        }
        relation.columns.push(col);
        t.versions.push(relation);
    }

    /// A table that already holds rows joins the publication (`ALTER PUBLICATION … ADD
    /// TABLE`): the stream shows it from its next change on; its rows come by backfill.
    pub fn publish_table_with_rows(&mut self, name: &str, rng: &mut Rng) {
        if self.tables.contains_key(name) {
            return;
        }
        self.create_table(
            name,
            vec![column("id", INT4, true), column("body", TEXT, false)],
        );
        for _ in 0..rng.range(1, 8) {
            let values = self.new_row(name, rng);
            let id = key_of(&values);
            self.tables
                .get_mut(name)
                .expect("table")
                .rows
                .insert(id, values);
        }
    }

    /// Creates an unscoped table `name(id, body)`.
    pub fn create_unscoped_table(&mut self, name: &str) {
        if !self.tables.contains_key(name) {
            self.create_table(
                name,
                vec![column("id", INT4, true), column("body", TEXT, false)],
            );
        }
    }

    /// Runs one random transaction of `size` row changes and appends it to the WAL.
    pub fn transaction(&mut self, rng: &mut Rng, size: usize, commit_time_ms: i64) -> &WalTx {
        self.transaction_with(rng, size, false, commit_time_ms)
    }

    /// `TRUNCATE` of one random table, in a transaction of its own.
    pub fn truncate(&mut self, rng: &mut Rng, commit_time_ms: i64) -> &WalTx {
        self.transaction_with(rng, 0, true, commit_time_ms)
    }

    fn transaction_with(
        &mut self,
        rng: &mut Rng,
        size: usize,
        truncate: bool,
        commit_time_ms: i64,
    ) -> &WalTx {
        let names: Vec<String> = self.tables.keys().cloned().collect();
        let mut ops = Vec::new();
        let mut digest = Vec::new();
        if truncate {
            let name = rng.pick(&names).expect("tables").clone();
            let t = self.tables.get_mut(&name).expect("table");
            t.rows.clear();
            digest.push(format!("truncate {name}"));
            ops.push(WalOp::Truncate {
                oid: t.relation().oid,
                version: t.versions.len() - 1,
            });
        }
        for _ in 0..size {
            let name = rng.pick(&names).expect("tables").clone();
            let existing: Vec<i64> = self.tables[&name].rows.keys().copied().collect();
            // Memberships are added less often the more there are (about five), and moved or
            // removed otherwise, so each user's projects keep changing instead of filling up.
            let kind = match (existing.is_empty(), name == MEMBERS) {
                (true, _) => 0,
                (false, false) => rng.below(10),
                (false, true) if rng.below(8) >= existing.len() as u64 => 0,
                (false, true) => *rng.pick(&[5, 9]).expect("kinds"),
            };
            let t_oid = self.tables[&name].relation().oid;
            let version = self.tables[&name].versions.len() - 1;
            match kind {
                // Insert.
                0..=4 => {
                    let values = self.new_row(&name, rng);
                    let id = key_of(&values);
                    self.tables
                        .get_mut(&name)
                        .expect("table")
                        .rows
                        .insert(id, values.clone());
                    digest.push(format!("insert {name} {id}"));
                    ops.push(WalOp::Insert {
                        oid: t_oid,
                        version,
                        values,
                    });
                }
                // Update: some other columns, sometimes the owner or the project (a row
                // moving scopes), a membership's user or project (access changing).
                5..=8 => {
                    let id = *rng.pick(&existing).expect("rows");
                    let todos = self.todo_ids();
                    let t = self.tables.get_mut(&name).expect("table");
                    let relation = t.relation().clone();
                    let row = t.rows.get_mut(&id).expect("row");
                    for (i, c) in relation.columns.iter().enumerate() {
                        if i == 0 || !rng.chance(500) {
                            continue;
                        }
                        row[i] = column_value(c, &todos, rng);
                    }
                    let mut values = row.clone();
                    // Now and then the key changes too.
                    let old_id = if rng.chance(100) {
                        let new_id = t.next_id;
                        t.next_id += 1;
                        values[0] = Some(new_id.to_string());
                        t.rows.remove(&id);
                        t.rows.insert(new_id, values.clone());
                        Some(id)
                    } else {
                        None
                    };
                    let shown = key_of(&values);
                    digest.push(format!("update {name} {shown}"));
                    ops.push(WalOp::Update {
                        oid: t_oid,
                        version,
                        old_id,
                        values,
                    });
                }
                _ => {
                    let id = *rng.pick(&existing).expect("rows");
                    self.tables.get_mut(&name).expect("table").rows.remove(&id);
                    digest.push(format!("delete {name} {id}"));
                    ops.push(WalOp::Delete {
                        oid: t_oid,
                        version,
                        id,
                    });
                }
            }
        }
        self.commit(ops, digest, commit_time_ms);
        self.wal.last().expect("just pushed")
    }

    /// Applies one sync-client insert of `row` (JSON: `id`, `owner`, other columns) into
    /// `table` as its own transaction, with the `highwater.confirm` message in it, exactly once
    /// per (client, mutation id): an id at or below the client's last applied one is not
    /// applied again. `Err` when the write cannot apply (unknown table, taken key).
    pub fn apply_mutation(
        &mut self,
        client_id: &str,
        mutation_id: u64,
        table: &str,
        row: &Map<String, Value>,
        commit_time_ms: i64,
    ) -> Result<Applied, String> {
        if self
            .last_applied
            .get(client_id)
            .is_some_and(|last| mutation_id <= *last)
        {
            return Ok(Applied::Before);
        }
        let Some(t) = self.tables.get_mut(table) else {
            return Err(format!("no table {table}"));
        };
        let relation = t.relation().clone();
        let values: Vec<Option<String>> = relation
            .columns
            .iter()
            .map(|c| match row.get(&c.name) {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(v) => Some(v.to_string()),
            })
            .collect();
        let id = key_of(&values);
        if t.rows.contains_key(&id) {
            return Err(format!("{table} {id} exists"));
        }
        t.rows.insert(id, values.clone());
        let content = serde_json::json!({"clientId": client_id, "mutationId": mutation_id});
        let ops = vec![
            WalOp::Insert {
                oid: relation.oid,
                version: t.versions.len() - 1,
                values,
            },
            WalOp::Message {
                prefix: CONFIRM_MESSAGE_PREFIX.to_owned(),
                content: content.to_string(),
            },
        ];
        self.last_applied.insert(client_id.to_owned(), mutation_id);
        self.applied.push((client_id.to_owned(), mutation_id));
        let digest = vec![format!("insert {table} {id}")];
        self.commit(ops, digest, commit_time_ms);
        Ok(Applied::Now)
    }

    fn commit(&mut self, ops: Vec<WalOp>, digest: Vec<String>, commit_time_ms: i64) {
        let commit_lsn = Lsn(self.next_lsn + 0x28 * ops.len() as u64 + 0x18);
        let end_lsn = Lsn(commit_lsn.0 + 0x30);
        self.next_lsn = end_lsn.0 + 0x08;
        self.next_xid += 1;
        self.wal.push(WalTx {
            commit_lsn,
            end_lsn,
            xid: self.next_xid,
            commit_time_ms,
            ops,
            digest,
        });
    }

    /// The end of WAL: where a keepalive says the server is.
    pub fn wal_end(&self) -> Lsn {
        Lsn(self.next_lsn)
    }

    // ---- replication ----

    /// Starts a replication session at the slot's confirmed position (a new connection).
    pub fn start_replication(&mut self) {
        let next_tx = self
            .wal
            .iter()
            .position(|tx| tx.commit_lsn >= self.confirmed)
            .unwrap_or(self.wal.len());
        self.session = Some(Session {
            next_tx,
            frames: VecDeque::new(),
            sent: HashMap::new(),
        });
    }

    /// The connection dropped.
    pub fn end_replication(&mut self) {
        self.session = None;
    }

    pub fn replicating(&self) -> bool {
        self.session.is_some()
    }

    /// Whether the session has a frame to send now.
    pub fn has_frame(&self) -> bool {
        self.session
            .as_ref()
            .is_some_and(|s| !s.frames.is_empty() || s.next_tx < self.wal.len())
    }

    /// The next CopyData frame of the session, if any.
    pub fn next_frame(&mut self) -> Option<Vec<u8>> {
        let session = self.session.as_mut()?;
        if session.frames.is_empty() {
            let tx = self.wal.get(session.next_tx)?;
            session.next_tx += 1;
            let frames = encode_tx(&self.tables, &self.oids, tx, &mut session.sent);
            session.frames.extend(frames);
        }
        session.frames.pop_front()
    }

    /// A primary keepalive at the end of WAL.
    pub fn keepalive(&self, reply_requested: bool, now_unix_ms: i64) -> Vec<u8> {
        keepalive_frame(&PrimaryKeepalive {
            wal_end: self.wal_end(),
            send_time: PgTimestamp::from_unix_ms(now_unix_ms),
            reply_requested,
        })
    }

    /// A standby status update from the client: returns the flushed position it confirms.
    /// Postgres never moves the slot backwards.
    pub fn standby_status(&mut self, bytes: &[u8]) -> Option<Lsn> {
        if bytes.len() < 17 || bytes[0] != b'r' {
            return None;
        }
        let mut flush = [0u8; 8];
        flush.copy_from_slice(&bytes[9..17]);
        let lsn = Lsn(u64::from_be_bytes(flush));
        if lsn > self.confirmed {
            self.confirmed = lsn;
        }
        Some(lsn)
    }

    /// Current rows of `table` as the replica would hold them, by id.
    pub fn rows_json(&self, table: &str) -> BTreeMap<i64, Map<String, Value>> {
        let Some(t) = self.tables.get(table) else {
            return BTreeMap::new();
        };
        t.rows
            .iter()
            .map(|(id, values)| (*id, t.row_json(values)))
            .collect()
    }
}

fn key_of(values: &[Option<String>]) -> i64 {
    values
        .first()
        .and_then(|v| v.as_deref())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A value for column `c` of a new or updated row: owners, projects, users and todos from
/// their small domains (now and then NULL), random values elsewhere.
fn column_value(c: &RelationColumn, todos: &[i64], rng: &mut Rng) -> Option<String> {
    match c.name.as_str() {
        OWNER => rng.pick(&OWNERS).map(|o| (*o).to_owned()),
        USER if rng.chance(30) => None,
        USER => rng.pick(&OWNERS).map(|o| (*o).to_owned()),
        PROJECT if rng.chance(60) => None,
        PROJECT => rng.pick(&PROJECTS).map(i64::to_string),
        TODO => match rng.pick(todos) {
            Some(id) if !rng.chance(100) => Some(id.to_string()),
            _ => Some(rng.range(1, 40).to_string()),
        },
        _ => random_value(c, rng),
    }
}

fn random_value(c: &RelationColumn, rng: &mut Rng) -> Option<String> {
    if rng.chance(80) {
        return None;
    }
    Some(if c.type_oid == INT4 {
        (rng.below(2000) as i64 - 1000).to_string()
    } else {
        // Now and then a long value, so some transactions are large in bytes too.
        let len = if rng.chance(30) {
            600
        } else {
            rng.range(1, 12)
        };
        (0..len)
            .map(|_| char::from(b'a' + rng.below(26) as u8))
            .collect()
    })
}

fn text_tuple(values: &[Option<String>]) -> Tuple<'_> {
    Tuple(
        values
            .iter()
            .map(|v| match v {
                None => TupleValue::Null,
                Some(text) => TupleValue::Text(text.as_bytes()),
            })
            .collect(),
    )
}

/// The frames of one transaction in a session, Relation messages included where due.
fn encode_tx(
    tables: &BTreeMap<String, Table>,
    oids: &BTreeMap<u32, String>,
    tx: &WalTx,
    sent: &mut HashMap<u32, usize>,
) -> Vec<Vec<u8>> {
    let time = PgTimestamp::from_unix_ms(tx.commit_time_ms);
    let mut frames = vec![xlog(&PgoutputMessage::Begin(Begin {
        final_lsn: tx.commit_lsn,
        commit_time: time,
        xid: tx.xid,
    }))];
    for op in &tx.ops {
        let (oid, version) = match op {
            WalOp::Insert { oid, version, .. }
            | WalOp::Update { oid, version, .. }
            | WalOp::Delete { oid, version, .. }
            | WalOp::Truncate { oid, version } => (*oid, *version),
            WalOp::Message { prefix, content } => {
                frames.push(xlog(&PgoutputMessage::Message(LogicalMessage {
                    transactional: true,
                    lsn: tx.commit_lsn,
                    prefix,
                    content: content.as_bytes(),
                })));
                continue;
            }
        };
        let table = &tables[&oids[&oid]];
        let relation = &table.versions[version];
        if sent.get(&oid) != Some(&version) {
            sent.insert(oid, version);
            frames.push(xlog(&PgoutputMessage::Relation(relation.clone())));
        }
        let width = relation.columns.len();
        let frame = match op {
            WalOp::Insert { values, .. } => xlog(&PgoutputMessage::Insert(Insert {
                relation_oid: oid,
                new: text_tuple(&values[..width.min(values.len())]),
            })),
            WalOp::Update { values, old_id, .. } => {
                let old_key = old_id.map(|id| {
                    let mut key = vec![Some(id.to_string())];
                    key.resize(width, None);
                    key
                });
                xlog(&PgoutputMessage::Update(Update {
                    relation_oid: oid,
                    old: old_key.as_deref().map(|k| OldTuple::Key(text_tuple(k))),
                    new: text_tuple(&values[..width.min(values.len())]),
                }))
            }
            WalOp::Truncate { .. } => xlog(&PgoutputMessage::Truncate(Truncate {
                options: 0,
                relation_oids: vec![oid],
            })),
            WalOp::Message { .. } => unreachable!("sent above"),
            WalOp::Delete { id, .. } => {
                let mut key = vec![Some(id.to_string())];
                key.resize(width, None);
                xlog(&PgoutputMessage::Delete(Delete {
                    relation_oid: oid,
                    old: OldTuple::Key(text_tuple(&key)),
                }))
            }
        };
        frames.push(frame);
    }
    frames.push(xlog(&PgoutputMessage::Commit(Commit {
        flags: 0,
        commit_lsn: tx.commit_lsn,
        end_lsn: tx.end_lsn,
        commit_time: time,
    })));
    frames
}

#[cfg(test)]
mod tests {
    use super::*;
    use highwater_engine::pgoutput::{PgoutputEvent, PgoutputMapper};

    #[test]
    fn a_session_resends_from_the_confirmed_position_with_relations_first() {
        let mut rng = Rng::new(3);
        let mut pg = SimPg::new(&mut rng);
        let first = pg.transaction(&mut rng, 2, EPOCH_UNIX_MS).commit_lsn;
        let second = pg.transaction(&mut rng, 1, EPOCH_UNIX_MS + 5).commit_lsn;
        assert!(second > first);
        pg.start_replication();
        let mut mapper = PgoutputMapper::new();
        let mut begins = Vec::new();
        let mut relations = 0;
        while let Some(frame) = pg.next_frame() {
            match mapper.map_frame(&frame).expect("valid frame") {
                Some(PgoutputEvent::Relation { .. }) => relations += 1,
                Some(PgoutputEvent::Downstream(
                    highwater_engine::change_stream::DownstreamMessage::Begin(b),
                )) => begins.push(b.commit_watermark),
                _ => {}
            }
        }
        assert_eq!(begins, [first.to_watermark(), second.to_watermark()]);
        assert!(relations >= 1);
        // Confirming the first commit's position re-sends it (commit LSN >= confirmed), as
        // Postgres does; confirming its end skips it.
        pg.confirmed = first;
        pg.start_replication();
        let mut mapper = PgoutputMapper::new();
        let mut again = Vec::new();
        while let Some(frame) = pg.next_frame() {
            if let Some(PgoutputEvent::Downstream(
                highwater_engine::change_stream::DownstreamMessage::Begin(b),
            )) = mapper.map_frame(&frame).expect("valid frame")
            {
                again.push(b.commit_watermark);
            }
        }
        assert_eq!(again, [first.to_watermark(), second.to_watermark()]);
        let end = pg.wal[0].end_lsn;
        pg.confirmed = end;
        pg.start_replication();
        let mut n = 0;
        let mut mapper = PgoutputMapper::new();
        while let Some(frame) = pg.next_frame() {
            if let Some(PgoutputEvent::Downstream(
                highwater_engine::change_stream::DownstreamMessage::Begin(_),
            )) = mapper.map_frame(&frame).expect("valid frame")
            {
                n += 1;
            }
        }
        assert_eq!(n, 1);
    }

    #[test]
    fn the_slot_never_moves_backwards() {
        let mut rng = Rng::new(1);
        let mut pg = SimPg::new(&mut rng);
        let ack = |lsn: u64| {
            highwater_engine::pgoutput::StandbyStatusUpdate::acknowledging(Lsn(lsn), 0).encode()
        };
        assert_eq!(pg.standby_status(&ack(0x2000)), Some(Lsn(0x2000)));
        pg.standby_status(&ack(0x1800));
        assert_eq!(pg.confirmed, Lsn(0x2000));
    }
}
