//! One simulated run: the upstream, the server (ingest adapter, [`Streamer`], storage queue,
//! [`ScopeServer`]), change-stream subscribers and scope clients over a simulated network,
//! driven by one event queue and one [`Rng`]. Invariants are checked after every step.
//!
//! The server process holds everything that a crash loses: the streamer, the scope server,
//! the storage queue, catch-up reads and the server ends of every socket. [`Storage`] is what
//! survives. After a crash the server restarts from storage and the upstream re-sends from
//! the slot's confirmed position.
//!
//! The network keeps order within a connection (a WebSocket never reorders); different
//! connections are independent. A connection can be dropped (both ends learn it after a
//! delay) or go half-open (one end learns it, the other keeps sending into the void until its
//! heartbeat or silence limit catches it).
//!
//! Access through memberships: the run's [`Rules`] give each scoped table a row filter with a
//! subquery over `members` (nested through `todos` for items, now and then). A client with a
//! user holds a token naming it, and its subscriptions are granted that filter bound to it;
//! the workload adds, moves and removes memberships and moves rows between projects. The
//! server's set and move reads are answered from durable storage after a delay, as its pages
//! are. Every row the server sends such a client must pass its filter as the replica stood at
//! some point since the routing it came with began; once quiet, each scope equals its
//! conditions and its filter evaluated on upstream.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;

use highwater_engine::backfill::{BackfillPlanner, PendingBackfill};
use highwater_engine::change_stream::{
    decode_downstream_frame, Backfill, BackfillCompleted, Begin, Change, Commit, DownstreamMessage,
    Extra, NewRelation, RowKey, SubscribeContext, SubscriberMode,
};
use highwater_engine::pgoutput::StandbyStatusUpdate;
use highwater_engine::scope_sync::client::{
    ClientConfig, ClientEffect, ClientInput, ScopeKey, SocketId, StoredRow, StoredScope, SyncClient,
};
use highwater_engine::scope_sync::rules::row_filter::{RowFilter, SetQuery};
use highwater_engine::scope_sync::scope::ChangesScope;
use highwater_engine::scope_sync::server::{
    Decision, Grant, PageResult, ScopeServer, ServerConfig, ServerEffect, ServerInput, SetId,
};
use highwater_engine::scope_sync::{
    Conditions, InvalidMutation, Mutation, MutationOp, MutationResult, MutationStatus, ServerFrame,
    SubscribeParams,
};
use highwater_engine::streamer::{
    CatchupRow, ChangeLogState, ConnId, Effect, LogOp, Streamer, StreamerConfig,
};
use highwater_engine::watermark::{Lsn, Watermark};
use serde_json::{json, Map, Value};

use crate::access::{Rules, TableSets};
use crate::ingest::{Ingest, IngestBug, Ingested};
use crate::rng::Rng;
use crate::storage::{
    PageRead, ReplicaRow, ReplicaTable, Storage, StorageBug, UNKNOWN_COMMIT_TIME,
};
use crate::upstream::{
    feed_columns, Applied, SimPg, EPOCH_UNIX_MS, MEMBERS, OWNER, OWNERS, PROJECT, PROJECTS,
    SCOPED_TABLES, START_LSN, TODO, USER,
};

/// How one run is set up.
#[derive(Debug, Clone)]
pub struct Options {
    pub seed: u64,
    /// Upstream transactions to run before going quiet.
    pub transactions: usize,
    pub storage_bug: Option<StorageBug>,
    pub ingest_bug: Option<IngestBug>,
    pub backfill_bug: Option<BackfillBug>,
    pub access_bug: Option<AccessBug>,
    /// Keep every trace line (not only the last ones).
    pub full_trace: bool,
}

impl Options {
    pub fn new(seed: u64) -> Self {
        Options {
            seed,
            transactions: 120,
            storage_bug: None,
            ingest_bug: None,
            backfill_bug: None,
            access_bug: None,
            full_trace: false,
        }
    }
}

/// A defect to plant in the host's reads for row filters, so tests can show the simulation
/// catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessBug {
    /// A move's read ignores the row filter: every row of the scope's conditions comes in.
    MovesIgnoreFilter,
    /// A resumed page never says its access changed.
    AccessNeverChanges,
}

/// A defect to plant in the host's backfill reader, so tests can show the simulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackfillBug {
    /// The backfill sends no rows, yet completes (the replica keeps NULL in its columns).
    DropsRows,
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub seed: u64,
    pub failure: Option<String>,
    pub steps: u64,
    pub crashes: u64,
    pub disconnects: u64,
    pub transactions: u64,
    /// Backfill transactions stored, and backfill streams that failed before their commit.
    pub backfills: u64,
    pub backfill_failures: u64,
    /// Crashes while a backfill ran.
    pub backfill_crashes: u64,
    /// Client mutations made, confirmed, and sent again after being applied (answered from
    /// the exactly-once record).
    pub mutations: u64,
    pub confirmed: u64,
    pub applied_before: u64,
    /// Reads of subqueries' sets and of rows moved in, answered; live envelopes that moved
    /// rows in or out; resumed pages that found their access changed.
    pub set_reads: u64,
    pub move_reads: u64,
    pub move_envelopes: u64,
    pub access_changed: u64,
    /// The event list (the last [`TRACE_TAIL`] lines unless a full trace was asked for).
    pub trace: Vec<String>,
}

pub const TRACE_TAIL: usize = 300;
const MAX_STEPS: u64 = 400_000;
/// Simulated time the run stays quiet (no faults, no writes) before the final comparison.
const QUIET_MS: u64 = 120_000;
/// A server closes a scope socket it has heard nothing on for this long (its protocol pings
/// went unanswered).
const SERVER_SILENCE_MS: u64 = 15_000;
/// Tables the rules' subqueries read.
const SET_TABLES: [&str; 2] = [MEMBERS, "todos"];

/// [`SET_TABLES`]' rows in their feed columns, at one point of durable storage.
type AccessState = BTreeMap<String, Vec<Map<String, Value>>>;

#[derive(Debug, Clone)]
enum Msg {
    /// Connection request; for a change-stream subscriber, the watermark it resumes from.
    Open(Option<Watermark>),
    /// The server accepted the connection.
    Accepted,
    Text(String),
    Close(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peer {
    Cs(usize),
    Scope(usize, SocketId),
}

#[derive(Debug)]
struct Link {
    peer: Peer,
    /// The server generation that accepted it; `None` until accepted.
    gen: Option<u64>,
    conn: Option<u64>,
    client_open: bool,
    server_open: bool,
    /// Half-open: everything sent from now on is lost.
    broken: bool,
    to_server: VecDeque<(u64, Msg)>,
    to_client: VecDeque<(u64, Msg)>,
}

#[derive(Debug, Clone)]
enum SOp {
    Store(LogOp),
    Fetch {
        conn: ConnId,
        from: Watermark,
        through: Watermark,
    },
    RestartUpstream,
}

struct CatchupJob {
    rows: VecDeque<CatchupRow>,
    paused: bool,
}

/// The backfill the host is reading from upstream's snapshot and feeding to the session.
struct RunningBackfill {
    table: String,
    /// Messages still to feed; when they run out before the commit, the stream failed.
    messages: VecDeque<DownstreamMessage>,
}

/// A backfill transaction as it was built from upstream's snapshot, for the subscribers' check.
#[derive(Debug, Clone)]
struct BackfillRec {
    /// The commit it follows (the session's position when it started).
    after: Watermark,
    digest: Vec<String>,
}

/// The server process: all of it is lost in a crash.
struct Server {
    backfill: Option<RunningBackfill>,
    /// The engine's backfill planner, as the host's: which pending backfill runs next, and
    /// failed tables held until a later commit or their retry delay (on the simulated clock).
    planner: BackfillPlanner,
    gen: u64,
    streamer: Streamer,
    scope: ScopeServer,
    ingest: Ingest,
    ops: VecDeque<SOp>,
    catchups: BTreeMap<ConnId, CatchupJob>,
    upstream_paused: bool,
    /// Server conn id → link.
    conns: BTreeMap<u64, u64>,
    /// Confirms of transactions handed to the streamer, by commit watermark, until stored.
    confirms: BTreeMap<Watermark, Vec<(String, u64)>>,
    heard: BTreeMap<u64, u64>,
    next_conn: u64,
    /// The last seq durable when it started: its sets were read at or after it.
    started_seq: i64,
}

struct CsSub {
    id: String,
    link: Option<u64>,
    /// The last commit received whole.
    last: Watermark,
    open: Option<(Watermark, Vec<String>)>,
    slow: bool,
    connecting: bool,
    /// When the last ack queued goes out: acks leave in frame order.
    ack_at: u64,
    /// Protocol version (v7+: `start-subscription` on the socket) and the legacy batched flag.
    version: u32,
    batched: bool,
}

/// A client's scope: its table and its conditions.
type ClientScope = (String, Map<String, Value>);

struct Client {
    client: SyncClient,
    /// The user its token names (`sub`): its scopes are granted the rules' row filters for
    /// it, with the filters bound here by table. No user: it reads its tables whole.
    user: Option<&'static str>,
    filters: BTreeMap<String, RowFilter>,
    /// Scope key → (table, conditions on its owner column); no conditions: the whole table.
    scopes: BTreeMap<ScopeKey, ClientScope>,
    store: BTreeMap<ScopeKey, StoredScope>,
    sockets: BTreeMap<SocketId, u64>,
    timer_gen: u64,
    /// Reads its socket slowly: frames to it take seconds (the server's outbound budget fills).
    slow: bool,
    /// Per (link, subscription id): entries received, each with whether a move envelope sent
    /// it, for the no-repeat check.
    seen: BTreeMap<(u64, String), BTreeMap<(String, i64), bool>>,
    /// The page's outbox store (what `PersistOutbox` wrote); survives reloads.
    outbox: OutboxStore,
    /// Whether the running page has been given its outbox (it may mutate).
    restored: bool,
}

/// A client's outbox as its store keeps it.
#[derive(Debug, Clone, Default)]
struct OutboxStore {
    client_id: String,
    last_id: u64,
    pending: BTreeMap<u64, Mutation>,
}

/// A mutation a client made: its table, row, and the WAL index of the transaction that
/// applied it (once applied).
#[derive(Debug, Clone)]
struct MadeWrite {
    table: String,
    row: Map<String, Value>,
    tx: Option<usize>,
}

#[derive(Debug, Clone)]
struct PageReq {
    conn: u64,
    ticket: u64,
    pass: u64,
    table: String,
    conditions: Conditions,
    after: Option<i64>,
    up_to: Option<i64>,
    limit: u32,
    count_total: bool,
    row_filter: Option<RowFilter>,
    access: Vec<SetQuery>,
}

/// A read of whole rows the scope server asked for: a set's, or a move's.
#[derive(Debug, Clone)]
struct RowsReq {
    answer: RowsFor,
    table: String,
    conditions: Conditions,
    row_filter: RowFilter,
    limit: u32,
}

#[derive(Debug, Clone, Copy)]
enum RowsFor {
    Set(SetId),
    Moves(u64),
}

#[derive(Debug, Clone)]
enum Ev {
    Workload,
    PgSend,
    PgKeepalive,
    StorageStep,
    CatchupStep,
    ServerTick,
    Crash,
    Restart,
    ReplDrop,
    ReplConnect,
    Net {
        link: u64,
        to_server: bool,
    },
    CsConnect(usize),
    CsAck {
        sub: usize,
        link: u64,
        id: u64,
    },
    CsFlip(usize),
    ClientTimer {
        client: usize,
        gen: u64,
    },
    ClientReload(usize),
    Fault,
    Page {
        gen: u64,
        req: Box<PageReq>,
    },
    /// A set's or a move's read runs.
    Rows {
        gen: u64,
        req: Box<RowsReq>,
    },
    /// The retention floor reaches the scope server (after the prune that raised it).
    Floor {
        gen: u64,
        floor: Option<i64>,
    },
    /// The running backfill's next message.
    BackfillStep {
        gen: u64,
    },
    /// The planner's earliest retry time of a failed backfill (the host's wait for
    /// `backfill_retry_in`): failed backfills whose delay passed may run again without a
    /// commit in between.
    BackfillRetry {
        gen: u64,
    },
    /// A client writes.
    ClientMutate(usize),
    /// The host applies a socket's batch of mutations upstream.
    ApplyMutations {
        gen: u64,
        conn: u64,
        ticket: u64,
        client_id: String,
        mutations: Vec<Result<Mutation, InvalidMutation>>,
    },
    /// The host's answer to a batch reaches the scope server.
    MutationsApplied {
        gen: u64,
        conn: u64,
        ticket: u64,
        client_id: String,
        results: Vec<MutationResult>,
    },
    /// The host looked up a client's replicated writes.
    Replicated {
        gen: u64,
        client_id: String,
    },
    Quiet,
}

struct World {
    rng: Rng,
    opts: Options,
    now: u64,
    queue: BTreeMap<(u64, u64), Ev>,
    next_ev: u64,
    pg: SimPg,
    storage: Storage,
    server: Option<Server>,
    gens: u64,
    links: BTreeMap<u64, Link>,
    next_link: u64,
    cs: Vec<CsSub>,
    clients: Vec<Client>,
    /// Commit watermark → WAL index.
    wal_index: BTreeMap<Watermark, usize>,
    /// (table, resource id, seq) → the row data the replica gave that seq.
    history: BTreeMap<(String, String, i64), Map<String, Value>>,
    last_ack: Option<Lsn>,
    /// Backfill transactions built so far, by commit watermark (a retry replaces its record).
    backfills: BTreeMap<Watermark, BackfillRec>,
    /// Columns that were ever backfilled, per table: compared even when NULL.
    backfilled: BTreeMap<String, BTreeSet<String>>,
    /// Inputs of a backfill are being fed: no ack may move past its position.
    feeding_backfill: Option<Lsn>,
    stored_high: Watermark,
    /// Exits older than this (simulated ms) are pruned.
    retention_ms: u64,
    /// Scope-sync tokens live this long; `None`: they never expire.
    token_ttl_ms: Option<u64>,
    next_prune: u64,
    pg_send_due: bool,
    /// The frame being ingested has another queued behind it: the streamer's held messages
    /// wait for the end of the burst.
    burst_continues: bool,
    storage_due: bool,
    catchup_due: bool,
    quiet: bool,
    done: bool,
    /// Row ids of client inserts (globally unique, apart from upstream's own).
    next_write_id: i64,
    /// Every mutation a client made, by (client id, mutation id).
    writes: BTreeMap<(String, u64), MadeWrite>,
    rules: Rules,
    /// Per (client id, mutation id): the seq its row took in the replica.
    confirm_seqs: BTreeMap<(String, u64), i64>,
    /// Sockets sent `channel-subscribed` by the scope input being carried out.
    subscribed: Vec<u64>,
    /// The tables the rules' subqueries read (their feed columns), as durable storage held
    /// them from each commit that changed them on, keyed by the first seq of that commit:
    /// what a row sent to a filtered scope is checked against.
    access_states: BTreeMap<i64, AccessState>,
    out: Outcome,
    trace: VecDeque<String>,
}

/// Runs one seed to the end.
pub fn run(opts: Options) -> Outcome {
    let mut world = World::new(opts);
    world.run();
    let mut out = std::mem::take(&mut world.out);
    out.trace = world.trace.into_iter().collect();
    out
}

fn rv() -> Watermark {
    SimPg::replica_version()
}

fn without_nulls(data: &Map<String, Value>) -> Map<String, Value> {
    data.iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// A row as the quiet-state comparison sees it: NULLs left out (a column added after a row
/// was written has no value in the replica), except in columns that were backfilled, whose
/// every row must hold upstream's value, NULL included.
fn compared(data: &Map<String, Value>, strict: Option<&BTreeSet<String>>) -> Map<String, Value> {
    data.iter()
        .filter(|(k, v)| !v.is_null() || strict.is_some_and(|s| s.contains(*k)))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

impl World {
    fn new(opts: Options) -> Self {
        let mut rng = Rng::new(opts.seed);
        let pg = SimPg::new(&mut rng);
        // The replica's initial copy.
        let mut tables = BTreeMap::new();
        let mut history = BTreeMap::new();
        let mut seq = 1;
        for (name, t) in &pg.tables {
            let mut rt = ReplicaTable {
                columns: t
                    .relation()
                    .columns
                    .iter()
                    .map(|c| c.name.clone())
                    .collect(),
                key: "id".to_owned(),
                feed: feed_columns(name),
                ..ReplicaTable::default()
            };
            for (id, values) in &t.rows {
                let data = t.row_json(values);
                history.insert((name.clone(), id.to_string(), seq), data.clone());
                rt.rows.insert(
                    id.to_string(),
                    ReplicaRow {
                        data,
                        seq,
                        updated_at: UNKNOWN_COMMIT_TIME.to_owned(),
                    },
                );
                seq += 1;
            }
            tables.insert(name.clone(), rt);
        }
        let storage = Storage::new(rv(), tables, seq, opts.storage_bug);
        let access_states = BTreeMap::from([(0, Self::access_state(&storage))]);
        let n_cs = rng.range(1, 3) as usize;
        let versions: Vec<(u32, bool)> = (0..n_cs)
            .map(|_| match rng.below(4) {
                0 => (5, true),
                1 => (6, false),
                2 => (7, false),
                _ => (8, false),
            })
            .collect();
        let cs = (0..n_cs)
            .map(|i| CsSub {
                version: versions[i].0,
                batched: versions[i].1,
                id: format!("cs{i}"),
                link: None,
                last: rv(),
                open: None,
                slow: false,
                connecting: false,
                ack_at: 0,
            })
            .collect();
        let rules = Rules::random(&mut rng);
        let n_clients = rng.range(1, 4) as usize;
        let mut clients = Vec::new();
        for c in 0..n_clients {
            // About half the clients are users whose rows come through their memberships.
            let user = if rng.chance(500) {
                rng.pick(&OWNERS).copied()
            } else {
                None
            };
            let mut scopes = BTreeMap::new();
            for key in 0..rng.range(1, 3) as u32 {
                let table = rng.pick(&SCOPED_TABLES).expect("tables");
                // A user's scope is often its whole filter, without conditions of its own.
                let conditions = if user.is_some() && rng.chance(400) {
                    Map::new()
                } else {
                    Self::owner_conditions(&mut rng)
                };
                scopes.insert(key, ((*table).to_owned(), conditions));
            }
            let filters = user
                .map(|user| {
                    SCOPED_TABLES
                        .iter()
                        .filter_map(|t| Some(((*t).to_owned(), rules.filter(t, user)?)))
                        .collect()
                })
                .unwrap_or_default();
            let client = SyncClient::new(Self::client_config(&mut rng), rng.next_u64());
            clients.push(Client {
                client,
                user,
                filters,
                scopes,
                store: BTreeMap::new(),
                sockets: BTreeMap::new(),
                timer_gen: 0,
                slow: false,
                seen: BTreeMap::new(),
                outbox: OutboxStore {
                    client_id: format!("client{c}"),
                    ..OutboxStore::default()
                },
                restored: false,
            });
        }
        World {
            rng,
            now: 0,
            queue: BTreeMap::new(),
            next_ev: 0,
            pg,
            storage,
            server: None,
            gens: 0,
            links: BTreeMap::new(),
            next_link: 1,
            cs,
            clients,
            wal_index: BTreeMap::new(),
            history,
            last_ack: None,
            backfills: BTreeMap::new(),
            backfilled: BTreeMap::new(),
            feeding_backfill: None,
            stored_high: rv(),
            retention_ms: 0,
            next_prune: 0,
            token_ttl_ms: None,
            pg_send_due: false,
            burst_continues: false,
            storage_due: false,
            catchup_due: false,
            quiet: false,
            done: false,
            next_write_id: 1_000_000,
            writes: BTreeMap::new(),
            rules,
            confirm_seqs: BTreeMap::new(),
            subscribed: Vec::new(),
            access_states,
            out: Outcome {
                seed: opts.seed,
                ..Outcome::default()
            },
            opts,
            trace: VecDeque::new(),
        }
    }

    /// [`SET_TABLES`] as durable storage holds them, in their feed columns.
    fn access_state(storage: &Storage) -> AccessState {
        SET_TABLES
            .iter()
            .filter_map(|name| {
                let t = storage.durable().tables.get(*name)?;
                let rows = t
                    .rows
                    .values()
                    .map(|r| {
                        t.feed
                            .iter()
                            .map(|c| (c.clone(), r.data.get(c).cloned().unwrap_or(Value::Null)))
                            .collect()
                    })
                    .collect();
                Some(((*name).to_owned(), rows))
            })
            .collect()
    }

    /// A scope's conditions on the owner column: mostly one owner, sometimes a list, a
    /// negation, a range or NULL (which reach rows through the table-wide route, and lose
    /// rows whose owner changes to or from NULL), rarely the whole table.
    fn owner_conditions(rng: &mut Rng) -> Map<String, Value> {
        let owner = (*rng.pick(&OWNERS).expect("owners")).to_owned();
        let other = (*rng.pick(&OWNERS).expect("owners")).to_owned();
        let condition = match rng.below(1000) {
            0..=4 => return Map::new(),
            5..=99 => json!({ "ne": owner }),
            100..=199 => json!([owner, other]),
            200..=249 => json!({ "gte": owner, "notIn": [other] }),
            250..=279 => json!({ "isNull": true }),
            _ => Value::String(owner),
        };
        Map::from_iter([(OWNER.to_owned(), condition)])
    }

    fn client_config(rng: &mut Rng) -> ClientConfig {
        ClientConfig {
            page_limit: Some(rng.range(2, 20) as u32),
            ..ClientConfig::default()
        }
    }

    // ---- plumbing ----

    fn at(&mut self, delay: u64, ev: Ev) {
        self.next_ev += 1;
        self.queue.insert((self.now + delay, self.next_ev), ev);
    }

    fn log(&mut self, line: String) {
        let text = format!("{:>8} {}", self.now, line);
        self.trace.push_back(text);
        if !self.opts.full_trace && self.trace.len() > TRACE_TAIL {
            self.trace.pop_front();
        }
    }

    fn fail(&mut self, why: String) {
        if self.out.failure.is_none() {
            self.log(format!("FAILED: {why}"));
            self.out.failure = Some(why);
        }
    }

    fn run(&mut self) {
        self.retention_ms = self.rng.range(3_000, 30_000);
        self.token_ttl_ms = self.rng.chance(500).then(|| self.rng.range(5_000, 40_000));
        self.next_prune = self.rng.range(1_000, 5_000);
        self.log(format!("rules: {}", self.rules.describe()));
        for c in 0..self.clients.len() {
            if let Some(user) = self.clients[c].user {
                self.log(format!("client{c} is {user}"));
            }
        }
        self.at(0, Ev::Restart);
        self.at(1, Ev::Workload);
        self.at(500, Ev::ServerTick);
        self.at(700, Ev::PgKeepalive);
        let d = self.rng.range(500, 3000);
        self.at(d, Ev::Fault);
        for i in 0..self.cs.len() {
            let d = self.rng.range(1, 400);
            self.at(d, Ev::CsConnect(i));
            let d = self.rng.range(1000, 8000);
            self.at(d, Ev::CsFlip(i));
        }
        for i in 0..self.clients.len() {
            let d = self.rng.range(1, 400);
            self.at(d, Ev::ClientReload(i));
            let d = self.rng.range(200, 4000);
            self.at(d, Ev::ClientMutate(i));
        }
        // Crashes at random points of the workload.
        for _ in 0..self.rng.range(0, 5) {
            let t = self.rng.range(200, 12_000);
            self.at(t, Ev::Crash);
        }
        if self.rng.chance(600) {
            let t = self.rng.range(200, 10_000);
            self.at(t, Ev::ReplDrop);
        }
        while !self.done && self.out.failure.is_none() {
            let Some(((time, _), ev)) = self.queue.pop_first() else {
                self.fail("the event queue ran dry before the run ended".to_owned());
                break;
            };
            self.now = time;
            self.out.steps += 1;
            if self.out.steps > MAX_STEPS {
                self.fail(format!("no end after {MAX_STEPS} steps"));
                break;
            }
            self.step(ev);
            self.check_continuous();
        }
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::Workload => self.workload(),
            Ev::PgSend => self.pg_send(),
            Ev::PgKeepalive => self.pg_keepalive(),
            Ev::StorageStep => self.storage_step(),
            Ev::CatchupStep => self.catchup_step(),
            Ev::ServerTick => self.server_tick(),
            Ev::Crash => self.crash(),
            Ev::Restart => self.restart(),
            Ev::ReplDrop => self.repl_drop(),
            Ev::ReplConnect => self.repl_connect(),
            Ev::Net { link, to_server } => self.deliver(link, to_server),
            Ev::CsConnect(i) => self.cs_connect(i),
            Ev::CsAck { sub, link, id } => self.cs_ack(sub, link, id),
            Ev::CsFlip(i) => self.cs_flip(i),
            Ev::ClientTimer { client, gen } => {
                if self.clients[client].timer_gen == gen {
                    self.client_input(client, ClientInput::Tick);
                }
            }
            Ev::ClientReload(i) => self.client_reload(i),
            Ev::Fault => self.fault(),
            Ev::Page { gen, req } => {
                if self.server.as_ref().is_some_and(|s| s.gen == gen) {
                    let mut result = self.storage.page(&PageRead {
                        table: &req.table,
                        conditions: &req.conditions,
                        row_filter: req.row_filter.as_ref(),
                        after: req.after,
                        up_to: req.up_to,
                        limit: req.limit,
                        count_total: req.count_total,
                        access: &req.access,
                    });
                    if let PageResult::Rows { access_changed, .. } = &mut result {
                        if self.opts.access_bug == Some(AccessBug::AccessNeverChanges) {
                            *access_changed = false;
                        }
                    }
                    if let PageResult::Rows {
                        access_changed: true,
                        ..
                    } = &result
                    {
                        self.out.access_changed += 1;
                        self.log(format!(
                            "page for conn {} ticket {}: access changed since {:?}",
                            req.conn, req.ticket, req.after
                        ));
                    }
                    // A full page is never a replay's last (the planner asks for the next).
                    let full = match &result {
                        PageResult::Rows {
                            rows,
                            access_changed,
                            ..
                        } => !access_changed && rows.len() == req.limit as usize,
                        _ => false,
                    };
                    self.subscribed.clear();
                    self.scope_input(ServerInput::PageFetched {
                        conn: req.conn,
                        ticket: req.ticket,
                        pass: req.pass,
                        result,
                    });
                    if full && self.subscribed.contains(&req.conn) {
                        self.replay_cut_short(&req);
                    }
                }
            }
            Ev::Rows { gen, req } => {
                if self.server.as_ref().is_some_and(|s| s.gen == gen) {
                    let everything = RowFilter::And(Vec::new());
                    let filter = match (req.answer, self.opts.access_bug) {
                        (RowsFor::Moves(_), Some(AccessBug::MovesIgnoreFilter)) => &everything,
                        _ => &req.row_filter,
                    };
                    let result =
                        self.storage
                            .read_rows(&req.table, &req.conditions, filter, req.limit);
                    if let PageResult::Rows { rows, up_to, .. } = &result {
                        self.log(format!(
                            "read {:?} of {} at {up_to}: {} rows",
                            req.answer,
                            req.table,
                            rows.len()
                        ));
                    }
                    let input = match req.answer {
                        RowsFor::Set(set) => {
                            self.out.set_reads += 1;
                            ServerInput::SetRead { set, result }
                        }
                        RowsFor::Moves(read) => {
                            self.out.move_reads += 1;
                            ServerInput::MovesRead { read, result }
                        }
                    };
                    self.scope_input(input);
                }
            }
            Ev::Floor { gen, floor } => {
                if self.server.as_ref().is_some_and(|s| s.gen == gen) {
                    self.scope_input(ServerInput::RetentionFloor(floor));
                }
            }
            Ev::BackfillStep { gen } => self.backfill_step(gen),
            Ev::BackfillRetry { gen } => self.backfill_retry(gen),
            Ev::ClientMutate(c) => self.client_mutate(c),
            Ev::ApplyMutations {
                gen,
                conn,
                ticket,
                client_id,
                mutations,
            } => self.apply_mutations(gen, conn, ticket, client_id, mutations),
            Ev::MutationsApplied {
                gen,
                conn,
                ticket,
                client_id,
                results,
            } => {
                if self.server.as_ref().is_some_and(|s| s.gen == gen) {
                    let replicated = self.storage.confirmed(&client_id);
                    self.log(format!(
                        "host answers conn {conn} ticket {ticket}: {} results, {client_id} replicated through {replicated:?}",
                        results.len()
                    ));
                    self.scope_input(ServerInput::MutationsApplied {
                        conn,
                        ticket,
                        results,
                        replicated,
                    });
                } else {
                    self.log(format!(
                        "the answer for conn {conn} ticket {ticket} is lost with its server"
                    ));
                }
            }
            Ev::Replicated { gen, client_id } => {
                if self.server.as_ref().is_some_and(|s| s.gen == gen) {
                    let last = self.storage.confirmed(&client_id);
                    self.scope_input(ServerInput::Replicated { client_id, last });
                }
            }
            Ev::Quiet => self.final_check(),
        }
    }

    // ---- upstream ----

    fn workload(&mut self) {
        let done = self.out.transactions as usize;
        if done >= self.opts.transactions {
            self.quiet = true;
            for client in &mut self.clients {
                client.slow = false;
            }
            self.log("workload done; quiet from here".to_owned());
            self.at(QUIET_MS, Ev::Quiet);
            return;
        }
        // DDL between transactions, once each, at a random point.
        if done == self.opts.transactions / 3 && self.rng.chance(700) {
            self.pg.add_column("todos", "extra", crate::upstream::TEXT);
            self.log("pg: ALTER TABLE todos ADD COLUMN extra text".to_owned());
        }
        if done == self.opts.transactions / 2 && self.rng.chance(700) {
            self.pg.create_unscoped_table("events");
            self.log("pg: CREATE TABLE events".to_owned());
        }
        // DDL whose values the stream cannot carry: only a backfill brings them.
        if done == self.opts.transactions / 4 && self.rng.chance(600) {
            let table = *self.rng.pick(&SCOPED_TABLES).expect("tables");
            self.pg
                .add_column_with_values(table, "stamp", &mut self.rng);
            self.log(format!(
                "pg: ALTER TABLE {table} ADD COLUMN stamp text DEFAULT now() (existing rows get values)"
            ));
        }
        if done == self.opts.transactions * 2 / 3 && self.rng.chance(500) {
            self.pg.publish_table_with_rows("archive", &mut self.rng);
            self.log("pg: ALTER PUBLICATION ADD TABLE archive (a table with rows)".to_owned());
        }
        let size = if self.rng.chance(50) {
            self.rng.range(20, 60) as usize
        } else {
            self.rng.range(1, 4) as usize
        };
        let time = EPOCH_UNIX_MS + self.now as i64;
        let tx = if self.rng.chance(15) {
            self.pg.truncate(&mut self.rng, time)
        } else {
            self.pg.transaction(&mut self.rng, size, time)
        };
        let (w, digest) = (tx.watermark(), tx.digest.join(", "));
        self.wal_index.insert(w.clone(), self.pg.wal.len() - 1);
        self.out.transactions += 1;
        self.log(format!("pg: commit {w}: {digest}"));
        self.kick_pg();
        let d = self.rng.range(5, 150);
        self.at(d, Ev::Workload);
    }

    fn kick_pg(&mut self) {
        if !self.pg_send_due {
            self.pg_send_due = true;
            let d = self.rng.range(1, 5);
            self.at(d, Ev::PgSend);
        }
    }

    fn pg_send(&mut self) {
        self.pg_send_due = false;
        let Some(server) = &self.server else { return };
        if server.upstream_paused || !self.pg.replicating() || !server.ingest.accepts_upstream() {
            return self.upstream_drained();
        }
        let Some(frame) = self.pg.next_frame() else {
            return self.upstream_drained();
        };
        // As serve's ingest loop: the burst ends when nothing more is queued, or (now and then)
        // when the next frame has not reached the host's queue yet.
        self.burst_continues = self.pg.has_frame() && !self.rng.chance(250);
        self.ingest_frame(&frame);
        self.burst_continues = false;
        if self.pg.has_frame() {
            self.kick_pg();
        }
    }

    /// The host's upstream queue is empty: the streamer's held live messages go out.
    fn upstream_drained(&mut self) {
        let Some(server) = self.server.as_mut() else {
            return;
        };
        let effects = server.streamer.on_upstream_drained();
        self.streamer_effects(effects);
    }

    fn pg_keepalive(&mut self) {
        let d = self.rng.range(1000, 3000);
        self.at(d, Ev::PgKeepalive);
        if self.server.is_none() || !self.pg.replicating() {
            return;
        }
        if self
            .server
            .as_ref()
            .is_some_and(|s| !s.ingest.accepts_upstream())
        {
            return;
        }
        // A keepalive is sent in order with the data: only once the session sent everything.
        if self.pg.has_frame() {
            return;
        }
        let reply = self.rng.chance(500);
        let frame = self.pg.keepalive(reply, EPOCH_UNIX_MS + self.now as i64);
        self.ingest_frame(&frame);
    }

    fn ingest_frame(&mut self, frame: &[u8]) {
        let Some(server) = self.server.as_mut() else {
            return;
        };
        let items = server.ingest.frame(frame);
        self.ingested(items);
    }

    /// Carries out what the upstream session asked for.
    fn ingested(&mut self, items: Result<Vec<Ingested>, String>) {
        let items = match items {
            Ok(items) => items,
            Err(e) => return self.fail(format!("the upstream session rejected its input: {e}")),
        };
        let mut backfill_due = false;
        for item in items {
            if self.server.is_none() || self.out.failure.is_some() {
                return;
            }
            match item {
                Ingested::BackfillDue => backfill_due = true,
                Ingested::Forward(message) => {
                    let text = highwater_engine::change_stream::encode_downstream(&message);
                    self.log(format!("upstream -> streamer {}", short(&text)));
                    let server = self.server.as_mut().expect("checked");
                    match server.streamer.on_upstream(message) {
                        Ok(effects) => self.streamer_effects(effects),
                        Err(e) => return self.fail(format!("the streamer rejected {text}: {e}")),
                    }
                }
                Ingested::Ack(lsn) => self.ack(lsn),
                Ingested::Idle(watermark) => {
                    self.log(format!("upstream idle at {watermark}"));
                    let server = self.server.as_mut().expect("checked");
                    let effects = server.streamer.on_idle();
                    self.streamer_effects(effects);
                }
                Ingested::Warn(message) => self.log(format!("upstream session: {message}")),
                Ingested::Confirms(watermark, confirms) => {
                    self.log(format!("upstream {watermark} confirms {confirms:?}"));
                    let server = self.server.as_mut().expect("checked");
                    server.confirms.insert(watermark, confirms);
                }
            }
        }
        if !self.burst_continues {
            self.upstream_drained();
        }
        if backfill_due {
            self.start_backfill();
        }
    }

    // ---- backfills (the host's `replica::backfill`, as `serve` drives it) ----

    /// The upstream commit a watermark stands at: a backfill's is the commit it follows.
    fn upstream_at(&self, mut w: Watermark) -> Watermark {
        while let Some(rec) = self.backfills.get(&w) {
            w = rec.after.clone();
        }
        w
    }

    /// The session allows a backfill now: start the next one the replica waits for, read from
    /// upstream's committed state at this moment (the snapshot).
    fn start_backfill(&mut self) {
        let pending = pending_backfills(&self.storage);
        let Some(server) = self.server.as_mut() else {
            return;
        };
        if server.backfill.is_some() || server.ingest.backfill_running() {
            return;
        }
        let position = server.ingest.last_commit();
        let Some(plan) = server.planner.next(&pending, &position) else {
            return;
        };
        let table = plan.pending.table;
        let Some(t) = self.pg.tables.get(&table) else {
            return self.fail(format!(
                "the replica waits for a backfill of {table}, which upstream never had"
            ));
        };
        let relation = t.relation().clone();
        let [key] = plan.pending.key.as_slice() else {
            return self.fail(format!(
                "expected one key column of {table}, got {:?}",
                plan.pending.key
            ));
        };
        let key = key.clone();
        let whole = plan.pending.whole_table;
        // Upstream's columns in its order: every non-key column for a table new to the
        // replica, else the pending ones. (No column is dropped or renamed upstream, so none
        // is ever missing and none waits or is settled.)
        let cols: Vec<String> = relation
            .columns
            .iter()
            .map(|c| c.name.clone())
            .filter(|c| *c != key && (whole || plan.pending.columns.contains(c)))
            .collect();
        let snapshot = self.pg.wal_end().to_watermark();
        let watermark = plan.commit_watermark;
        let new_relation = NewRelation {
            schema: crate::upstream::SCHEMA.to_owned(),
            name: table.clone(),
            row_key: RowKey::new(vec![key.clone()], None),
            extra: Default::default(),
        };
        let mut rows: Vec<Vec<Value>> = self
            .pg
            .rows_json(&table)
            .into_values()
            .map(|r| {
                std::iter::once(&key)
                    .chain(&cols)
                    .map(|c| r.get(c).cloned().unwrap_or(Value::Null))
                    .collect()
            })
            .collect();
        if self.opts.backfill_bug == Some(BackfillBug::DropsRows) {
            rows.clear();
        }
        let mut begin = Begin::new(watermark.clone());
        begin.skip_ack = Some(true);
        let mut messages = VecDeque::new();
        let mut digest = Vec::new();
        messages.push_back(DownstreamMessage::Begin(begin));
        let mut rest = rows.as_slice();
        while !rest.is_empty() {
            let n = (self.rng.range(1, 5) as usize).min(rest.len());
            let (batch, tail) = rest.split_at(n);
            rest = tail;
            digest.push(format!("backfill {table} {}", batch.len()));
            messages.push_back(DownstreamMessage::Data(Change::Backfill(Backfill {
                relation: new_relation.clone(),
                columns: cols.clone(),
                watermark: snapshot.clone(),
                row_values: batch.to_vec(),
                progress_marks: None,
                status: None,
                extra: Default::default(),
            })));
        }
        digest.push(format!("backfill-completed {table}"));
        messages.push_back(DownstreamMessage::Data(Change::BackfillCompleted(
            BackfillCompleted {
                relation: new_relation,
                columns: cols.clone(),
                watermark: snapshot.clone(),
                progress_marks: None,
                status: None,
                extra: Default::default(),
            },
        )));
        messages.push_back(DownstreamMessage::Commit(Commit::new(watermark.clone())));
        // Now and then the snapshot's connection fails before the commit; it is retried after
        // the next commit or after a delay (as the host), also once the workload is over.
        let failing = self.rng.chance(250);
        if failing {
            let keep = self.rng.below(messages.len() as u64 - 1) as usize;
            messages.truncate(keep);
        }
        self.backfilled
            .entry(table.clone())
            .or_default()
            .extend(cols.iter().cloned());
        self.backfills.insert(
            watermark.clone(),
            BackfillRec {
                after: position.clone(),
                digest,
            },
        );
        self.log(format!(
            "backfill {table} {cols:?} at {watermark} from snapshot {snapshot}: {} rows{}",
            rows.len(),
            if failing {
                " (its stream will fail)"
            } else {
                ""
            }
        ));
        let server = self.server.as_mut().expect("checked");
        server.backfill = Some(RunningBackfill { table, messages });
        let gen = server.gen;
        let items = server.ingest.backfill_started();
        self.feed_backfill(items);
        let d = self.rng.range(1, 20);
        self.at(d, Ev::BackfillStep { gen });
    }

    /// Carries out the session's answer to a backfill input, with the no-ack check armed.
    fn feed_backfill(&mut self, items: Result<Vec<Ingested>, String>) {
        let position = self
            .server
            .as_ref()
            .map(|s| s.ingest.last_commit())
            .unwrap_or_else(rv);
        let upstream = self.upstream_at(position);
        let limit = self
            .wal_index
            .get(&upstream)
            .map_or(Lsn(START_LSN), |&i| self.pg.wal[i].end_lsn);
        self.feeding_backfill = Some(limit);
        self.ingested(items);
        self.feeding_backfill = None;
    }

    fn backfill_step(&mut self, gen: u64) {
        let Some(server) = self.server.as_mut().filter(|s| s.gen == gen) else {
            return;
        };
        let Some(running) = server.backfill.as_mut() else {
            return;
        };
        if server.upstream_paused {
            let d = self.rng.range(10, 50);
            self.at(d, Ev::BackfillStep { gen });
            return;
        }
        match running.messages.pop_front() {
            Some(message) => {
                let commit = matches!(message, DownstreamMessage::Commit(_));
                let items = server.ingest.backfill(message);
                self.feed_backfill(items);
                if commit {
                    self.end_backfill(None);
                } else {
                    let d = self.rng.range(1, 20);
                    self.at(d, Ev::BackfillStep { gen });
                }
            }
            None => {
                let table = running.table.clone();
                self.end_backfill(Some(table));
            }
        }
    }

    /// The backfill's stream ended: after its commit, or (`failed`: its table) before it.
    fn end_backfill(&mut self, failed: Option<String>) {
        let Some(server) = self.server.as_mut() else {
            return;
        };
        server.backfill = None;
        match failed {
            Some(table) => {
                let at = server.ingest.last_commit();
                server.planner.on_failed(&table, &at, self.now);
                let retry_at = server.planner.retry_at_ms().unwrap_or(self.now);
                self.log(format!(
                    "backfill of {table} failed before its commit; retried after the next commit or at {retry_at} ms"
                ));
                self.out.backfill_failures += 1;
                self.schedule_backfill_retry();
            }
            None => server.planner.on_completed(),
        }
        let server = self.server.as_mut().expect("checked");
        let items = server.ingest.backfill_ended();
        self.feed_backfill(items);
        self.kick_pg();
    }

    /// Wakes the host at the planner's earliest retry time, if a failed backfill waits (the
    /// host waits for input at most `backfill_retry_in`).
    fn schedule_backfill_retry(&mut self) {
        let Some(server) = self.server.as_ref() else {
            return;
        };
        if let Some(at) = server.planner.retry_at_ms() {
            let gen = server.gen;
            self.at(at.saturating_sub(self.now), Ev::BackfillRetry { gen });
        }
    }

    /// A retry time of a failed backfill came: the planner releases those whose delay passed
    /// and, if it released any, the session is told, which lets one start once nothing is in
    /// between (the host's `retry_backfills`).
    fn backfill_retry(&mut self, gen: u64) {
        let Some(server) = self.server.as_mut().filter(|s| s.gen == gen) else {
            return;
        };
        let released = server.planner.release_due(self.now);
        self.schedule_backfill_retry();
        if !released {
            return;
        }
        let server = self.server.as_mut().expect("checked");
        let items = server.ingest.retry_backfills();
        self.log("failed backfills may run again".to_owned());
        self.ingested(items);
    }

    fn ack(&mut self, lsn: Lsn) {
        if let Some(last) = self.last_ack {
            if lsn < last {
                return self.fail(format!("upstream ack moved backwards: {last} then {lsn}"));
            }
        }
        if let Some(limit) = self.feeding_backfill {
            if lsn > limit.max(self.last_ack.unwrap_or(Lsn(0))) {
                return self.fail(format!(
                    "a backfill confirmed {lsn} upstream, past its position's end {limit}"
                ));
            }
        }
        self.last_ack = Some(lsn);
        self.log(format!("ack upstream {lsn}"));
        let bytes =
            StandbyStatusUpdate::acknowledging(lsn, EPOCH_UNIX_MS + self.now as i64).encode();
        self.pg.standby_status(&bytes);
        self.check_slot();
    }

    /// Postgres drops every transaction whose commit is before the confirmed position: each
    /// must be durable here.
    fn check_slot(&mut self) {
        let stored = self.storage.last_watermark().clone();
        let confirmed = self.pg.confirmed;
        // The WAL ascends by commit LSN, and so by watermark: the first transaction not
        // stored is the only one to look at.
        let first = self.pg.wal.partition_point(|tx| tx.watermark() <= stored);
        if let Some(tx) = self
            .pg
            .wal
            .get(first)
            .filter(|tx| tx.commit_lsn < confirmed)
        {
            let w = tx.watermark();
            self.fail(format!(
                "upstream acknowledged past durable storage: slot at {confirmed}, transaction {w} not stored (stored through {stored})"
            ));
        }
    }

    fn repl_drop(&mut self) {
        if self.server.is_none() || !self.pg.replicating() {
            return;
        }
        if self
            .server
            .as_ref()
            .is_some_and(|s| s.ingest.backfill_running())
        {
            // The session takes a new replication session only between the host's
            // transactions: the host ends it once the backfill is over.
            self.at(50, Ev::ReplDrop);
            return;
        }
        self.log("replication connection lost".to_owned());
        self.pg.end_replication();
        let server = self.server.as_mut().expect("checked");
        let items = server.ingest.started();
        self.ingested(items);
        let d = self.rng.range(100, 2000);
        self.at(d, Ev::ReplConnect);
        if !self.quiet && self.rng.chance(400) {
            let d = self.rng.range(2000, 8000);
            self.at(d, Ev::ReplDrop);
        }
    }

    fn repl_connect(&mut self) {
        let Some(server) = self.server.as_mut() else {
            return;
        };
        if self.pg.replicating() {
            return;
        }
        if !server.ingest.accepts_upstream() {
            // The host takes nothing from the replication source while a backfill runs.
            self.at(50, Ev::ReplConnect);
            return;
        }
        let _ = server.streamer.start_upstream(Vec::new());
        self.pg.start_replication();
        self.log(format!("replication started at {}", self.pg.confirmed));
        // As the host: every replication session starts with `Input::Started` (which is
        // where a backfill waiting since before a restart may start, before any frame).
        let items = self.server.as_mut().expect("checked").ingest.started();
        self.ingested(items);
        self.kick_pg();
    }

    // ---- the server process ----

    fn restart(&mut self) {
        self.gens += 1;
        let gen = self.gens;
        let durable = self.storage.durable();
        let schema = durable
            .tables
            .iter()
            .map(|(n, t)| (n.clone(), t.columns.clone()))
            .collect();
        let mut config = StreamerConfig::new(rv());
        config.backlog_high_water_bytes = 6 * 1024;
        config.backlog_full_timeout_ms = Some(20_000);
        let streamer = Streamer::new(
            config,
            ChangeLogState {
                last_watermark: durable.last_watermark.clone(),
                min_watermark: rv(),
            },
        );
        let mut scope_config = ServerConfig::new(rv().to_string());
        scope_config.outbound_budget_bytes = 8 * 1024;
        scope_config.takes_writes = true;
        // The retry delays' jitter only needs to differ between servers; derived, not drawn,
        // so the world's random stream is not moved by it.
        let planner_seed = self.opts.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ gen;
        self.server = Some(Server {
            gen,
            streamer,
            scope: ScopeServer::new(scope_config),
            backfill: None,
            planner: BackfillPlanner::new(planner_seed),
            ingest: Ingest::new(
                schema,
                durable.last_watermark.clone(),
                self.pg.confirmed,
                self.opts.ingest_bug,
            ),
            ops: VecDeque::new(),
            catchups: BTreeMap::new(),
            upstream_paused: false,
            conns: BTreeMap::new(),
            confirms: BTreeMap::new(),
            heard: BTreeMap::new(),
            next_conn: 1,
            started_seq: durable.next_seq - 1,
        });
        let floor = self.storage.durable().exit_floor;
        self.scope_input(ServerInput::RetentionFloor(floor));
        self.log(format!(
            "server started (generation {gen}) at {}",
            self.storage.last_watermark()
        ));
        self.pg.end_replication();
        let d = self.rng.range(10, 300);
        self.at(d, Ev::ReplConnect);
    }

    fn crash(&mut self) {
        if self.server.is_none() || self.quiet {
            return;
        }
        self.out.crashes += 1;
        if self.server.as_ref().is_some_and(|s| s.backfill.is_some()) {
            self.out.backfill_crashes += 1;
        }
        self.log("CRASH: the server process dies".to_owned());
        self.server = None;
        self.storage.crash();
        let next = self.storage.durable().next_seq;
        self.access_states.retain(|first, _| *first < next);
        self.pg.end_replication();
        // Every socket's server end is gone. Most peers learn it (the kernel resets the
        // connections); some do not (the machine vanished): those are half-open.
        let ids: Vec<u64> = self.links.keys().copied().collect();
        for id in ids {
            let half_open = self.rng.chance(250);
            let d = self.rng.range(5, 200);
            let link = self.links.get_mut(&id).expect("link");
            if !link.server_open && link.gen.is_some() {
                continue;
            }
            link.server_open = false;
            link.to_server.clear();
            link.to_client.clear();
            link.broken = true;
            if !half_open || matches!(link.peer, Peer::Cs(_)) {
                let at = self.now + d;
                link.to_client
                    .push_back((at, Msg::Close("server crashed".to_owned())));
                self.at(
                    d,
                    Ev::Net {
                        link: id,
                        to_server: false,
                    },
                );
            }
        }
        self.pg_send_due = false;
        self.storage_due = false;
        self.catchup_due = false;
        let d = self.rng.range(50, 3000);
        self.at(d, Ev::Restart);
    }

    fn kick_storage(&mut self) {
        if !self.storage_due {
            self.storage_due = true;
            // Now and then the disk stalls.
            let d = if self.rng.chance(20) {
                self.rng.range(100, 600)
            } else {
                self.rng.range(1, 8)
            };
            self.at(d, Ev::StorageStep);
        }
    }

    fn storage_step(&mut self) {
        self.storage_due = false;
        let Some(server) = self.server.as_mut() else {
            return;
        };
        let Some(op) = server.ops.pop_front() else {
            return;
        };
        let more = !server.ops.is_empty();
        match op {
            SOp::Store(op) => {
                let line = match &op {
                    LogOp::Begin(r) => format!("store begin {}", r.watermark()),
                    LogOp::Append(r) => format!("store append {}/{}", r.watermark(), r.pos()),
                    LogOp::Commit(r) => format!("store commit {}", r.watermark()),
                    LogOp::Abort => "store abort".to_owned(),
                };
                self.log(line);
                let mut confirms = Vec::new();
                if let LogOp::Commit(row) = &op {
                    let server = self.server.as_mut().expect("checked");
                    confirms = server.confirms.remove(row.watermark()).unwrap_or_default();
                    if let Err(e) = self.storage.confirm(&confirms) {
                        return self.fail(format!("storage refused confirms: {e}"));
                    }
                }
                let first_seq = self.storage.durable().next_seq;
                match self.storage.apply(&op) {
                    Err(e) => return self.fail(format!("storage refused a write: {e}")),
                    Ok(Some(entries)) => {
                        if entries
                            .iter()
                            .any(|e| SET_TABLES.contains(&e.table.as_str()))
                        {
                            let state = Self::access_state(&self.storage);
                            self.access_states.insert(first_seq, state);
                        }
                        if let Some(last) = entries.iter().map(|e| e.seq).max() {
                            for confirm in &confirms {
                                self.confirm_seqs.insert(confirm.clone(), last);
                            }
                        }
                        let LogOp::Commit(row) = &op else {
                            unreachable!("only a commit returns entries")
                        };
                        let w = row.watermark().clone();
                        if self.backfills.contains_key(&w) {
                            self.out.backfills += 1;
                        }
                        for e in &entries {
                            if let highwater_engine::scope_sync::server::FeedChange::Upsert {
                                data,
                            } = &e.change
                            {
                                self.history.insert(
                                    (e.table.clone(), e.resource_id.clone(), e.seq),
                                    data.clone(),
                                );
                            }
                        }
                        let server = self.server.as_mut().expect("checked");
                        match server.streamer.on_stored(w.clone()) {
                            Ok(effects) => self.streamer_effects(effects),
                            Err(e) => {
                                return self.fail(format!("the streamer rejected a message: {e}"))
                            }
                        }
                        if let Some(server) = self.server.as_mut() {
                            let items = server.ingest.stored(w);
                            self.ingested(items);
                        }
                        self.scope_input(ServerInput::Committed { entries, confirms });
                        self.maybe_prune();
                    }
                    Ok(None) => {}
                }
            }
            SOp::Fetch {
                conn,
                from,
                through,
            } => {
                let rows = self.storage.catchup(&from, &through);
                self.log(format!(
                    "catch-up read {conn} {from}..={through}: {} rows",
                    rows.len()
                ));
                let server = self.server.as_mut().expect("checked");
                server.catchups.insert(
                    conn,
                    CatchupJob {
                        rows: rows.into(),
                        paused: false,
                    },
                );
                self.kick_catchup();
            }
            SOp::RestartUpstream
                if self
                    .server
                    .as_ref()
                    .is_some_and(|s| s.ingest.backfill_running()) =>
            {
                // Restarted once the backfill is over (the session takes a new session only
                // between the host's transactions).
                let server = self.server.as_mut().expect("checked");
                server.ops.push_back(SOp::RestartUpstream);
                let d = self.rng.range(10, 50);
                self.storage_due = true;
                self.at(d, Ev::StorageStep);
                return;
            }
            SOp::RestartUpstream => {
                self.log("restarting upstream".to_owned());
                self.pg.end_replication();
                let server = self.server.as_mut().expect("checked");
                let items = server.ingest.started();
                self.ingested(items);
                self.at(1, Ev::ReplConnect);
            }
        }
        if more {
            self.kick_storage();
        }
    }

    /// After a commit, now and then: prune exits older than the retention window, then hand
    /// the new floor to the scope server.
    fn maybe_prune(&mut self) {
        if self.now < self.next_prune || self.storage.in_transaction() {
            return;
        }
        self.next_prune = self.now + self.rng.range(1_000, 5_000);
        let cutoff = EPOCH_UNIX_MS + self.now.saturating_sub(self.retention_ms) as i64;
        let floor = self
            .storage
            .prune_exits(&crate::storage::iso_from_ms(cutoff));
        self.log(format!("pruned exits before {cutoff}: floor {floor:?}"));
        if let Some(gen) = self.server.as_ref().map(|s| s.gen) {
            let d = self.rng.range(0, 5);
            self.at(d, Ev::Floor { gen, floor });
        }
    }

    fn kick_catchup(&mut self) {
        if !self.catchup_due {
            self.catchup_due = true;
            let d = self.rng.range(1, 10);
            self.at(d, Ev::CatchupStep);
        }
    }

    fn catchup_step(&mut self) {
        self.catchup_due = false;
        let Some(server) = self.server.as_mut() else {
            return;
        };
        let Some((&conn, _)) = server.catchups.iter().find(|(_, j)| !j.paused) else {
            return;
        };
        let n = self.rng.range(1, 12) as usize;
        let job = server.catchups.get_mut(&conn).expect("found");
        let chunk: Vec<CatchupRow> = (0..n).filter_map(|_| job.rows.pop_front()).collect();
        let finished = job.rows.is_empty();
        let effects = server.streamer.catchup_rows(conn, chunk);
        self.streamer_effects(effects);
        if finished {
            if let Some(server) = self.server.as_mut() {
                server.catchups.remove(&conn);
                let effects = server.streamer.catchup_done(conn);
                self.streamer_effects(effects);
            }
        }
        if self
            .server
            .as_ref()
            .is_some_and(|s| s.catchups.values().any(|j| !j.paused))
        {
            self.kick_catchup();
        }
    }

    fn server_tick(&mut self) {
        self.at(500, Ev::ServerTick);
        let now = self.now;
        let Some(server) = self.server.as_mut() else {
            return;
        };
        let effects = server.streamer.tick(now);
        self.streamer_effects(effects);
        self.scope_input(ServerInput::Tick);
        // The host's protocol pings: a scope socket silent too long is closed.
        let Some(server) = self.server.as_mut() else {
            return;
        };
        let silent: Vec<u64> = server
            .heard
            .iter()
            .filter(|(_, &t)| now.saturating_sub(t) > SERVER_SILENCE_MS)
            .map(|(&c, _)| c)
            .collect();
        for conn in silent {
            self.log(format!("server: scope socket {conn} silent, closing"));
            self.server_close(conn, "ping timeout".to_owned());
            self.scope_input(ServerInput::Closed { conn });
        }
    }

    fn streamer_effects(&mut self, effects: Vec<Effect>) {
        for effect in effects {
            let Some(server) = self.server.as_mut() else {
                return;
            };
            match effect {
                Effect::Send { conn, frame } => {
                    let text = frame.to_text();
                    if let Some(&link) = server.conns.get(&conn.0) {
                        self.send_to_client(link, text);
                    }
                }
                Effect::Close { conn, code, reason } => {
                    self.log(format!("streamer closes {conn}: {code} {reason}"));
                    self.server_close(conn.0, reason);
                }
                Effect::Store(op) => {
                    server.ops.push_back(SOp::Store(op));
                    self.kick_storage();
                }
                Effect::FetchCatchup {
                    conn,
                    from,
                    through,
                } => {
                    server.ops.push_back(SOp::Fetch {
                        conn,
                        from,
                        through,
                    });
                    self.kick_storage();
                }
                Effect::PauseCatchup { conn } => {
                    if let Some(job) = server.catchups.get_mut(&conn) {
                        job.paused = true;
                    }
                }
                Effect::ResumeCatchup { conn } => {
                    if let Some(job) = server.catchups.get_mut(&conn) {
                        job.paused = false;
                    }
                    self.kick_catchup();
                }
                Effect::PauseUpstream => {
                    server.upstream_paused = true;
                    self.log("pause upstream".to_owned());
                }
                Effect::ResumeUpstream => {
                    server.upstream_paused = false;
                    self.log("resume upstream".to_owned());
                    self.kick_pg();
                }
                Effect::RestartUpstream { reason } => {
                    server.ops.push_back(SOp::RestartUpstream);
                    self.log(format!("restart upstream asked: {reason}"));
                    self.kick_storage();
                }
                Effect::Purge { below } => {
                    self.fail(format!("a purge below {below} with no backup configured"));
                }
                Effect::Warn { conn, message } => {
                    self.log(format!("warn {conn:?}: {message}"));
                }
            }
        }
    }

    fn scope_input(&mut self, input: ServerInput) {
        let now = self.now;
        let Some(server) = self.server.as_mut() else {
            return;
        };
        // Where the server's routing stood: what it sends now follows the replica from here.
        let routed = server
            .scope
            .metrics()
            .routed_seq
            .unwrap_or(server.started_seq);
        let dbg = std::env::var_os("SIM_DEBUG_SERVER").is_some();
        if dbg {
            eprintln!("{now} server <- {input:?}");
        }
        let mut effects = server.scope.handle(input, now);
        if dbg {
            for e in &effects {
                eprintln!("{now} server -> {e:?}");
            }
        }
        let routed_after = server
            .scope
            .metrics()
            .routed_seq
            .unwrap_or(server.started_seq);
        // Effects for different sockets are independent; keep one order for replays.
        effects.sort_by_key(|e| match e {
            ServerEffect::Send { conn, .. }
            | ServerEffect::Authorize { conn, .. }
            | ServerEffect::FetchPage { conn, .. }
            | ServerEffect::ApplyMutations { conn, .. }
            | ServerEffect::Close { conn, .. } => *conn,
            ServerEffect::LookUpReplicated { .. }
            | ServerEffect::ReadSet { .. }
            | ServerEffect::ReadMoves { .. } => u64::MAX,
        });
        for effect in effects {
            let Some(server) = self.server.as_mut() else {
                return;
            };
            match effect {
                ServerEffect::Send { conn, text } => {
                    if let Some(&link) = server.conns.get(&conn) {
                        if text.starts_with(r#"{"type":"channel-subscribed""#) {
                            self.subscribed.push(conn);
                        }
                        if text.starts_with(r#"{"type":"mutation-result""#) {
                            self.check_confirms(conn, routed_after, &text);
                        }
                        self.check_allowed(link, routed, &text);
                        self.send_to_client(link, text);
                    }
                }
                ServerEffect::Authorize {
                    conn,
                    ticket,
                    resource_type,
                    token,
                    ..
                } => {
                    // A token is `exp:<ms>|never[;sub:<user>]`.
                    let claim = |prefix: &str| {
                        token
                            .as_deref()
                            .into_iter()
                            .flat_map(|t| t.split(';'))
                            .find_map(|part| part.strip_prefix(prefix))
                    };
                    let expires = claim("exp:").and_then(|t| t.parse::<u64>().ok());
                    let row_filter =
                        claim("sub:").and_then(|user| self.rules.filter(&resource_type, user));
                    let decision = match expires {
                        Some(at) if at <= self.now => Decision::Denied {
                            code: highwater_engine::scope_sync::server::codes::AUTH_EXPIRED
                                .to_owned(),
                            message: "the token expired".to_owned(),
                        },
                        _ => Decision::Granted(Grant {
                            table: resource_type,
                            omit_columns: Vec::new(),
                            expires_at_ms: expires,
                            row_filter,
                        }),
                    };
                    self.scope_input(ServerInput::Authorized {
                        conn,
                        ticket,
                        decision,
                    });
                }
                ServerEffect::FetchPage {
                    conn,
                    ticket,
                    pass,
                    table,
                    conditions,
                    row_filter,
                    after,
                    up_to,
                    limit,
                    count_total,
                    access,
                } => {
                    // Read when the page is due, from what is durable then.
                    let gen = server.gen;
                    let d = self.rng.range(1, 30);
                    let req = Box::new(PageReq {
                        conn,
                        ticket,
                        pass,
                        table,
                        conditions,
                        after,
                        up_to,
                        limit,
                        count_total,
                        row_filter,
                        access,
                    });
                    self.at(d, Ev::Page { gen, req });
                }
                // Read when due, from what is durable then, as pages are.
                ServerEffect::ReadSet {
                    set,
                    table,
                    row_filter,
                    limit,
                } => {
                    let gen = server.gen;
                    let d = self.rng.range(1, 30);
                    let req = Box::new(RowsReq {
                        answer: RowsFor::Set(set),
                        table,
                        conditions: Conditions::default(),
                        row_filter,
                        limit,
                    });
                    self.at(d, Ev::Rows { gen, req });
                }
                ServerEffect::ReadMoves {
                    read,
                    table,
                    conditions,
                    row_filter,
                    limit,
                } => {
                    let gen = server.gen;
                    let d = self.rng.range(1, 30);
                    let req = Box::new(RowsReq {
                        answer: RowsFor::Moves(read),
                        table,
                        conditions,
                        row_filter,
                        limit,
                    });
                    self.at(d, Ev::Rows { gen, req });
                }
                ServerEffect::Close { conn, code, reason } => {
                    self.log(format!("scope server closes {conn}: {code} {reason}"));
                    self.server_close(conn, reason);
                    self.scope_input(ServerInput::Closed { conn });
                }
                // The host checks nothing (the simulation's rules allow every write) and
                // applies the batch a little later.
                ServerEffect::ApplyMutations {
                    conn,
                    ticket,
                    client_id,
                    mutations,
                    ..
                } => {
                    let gen = server.gen;
                    self.log(format!(
                        "scope server asks {conn}'s {} writes of {client_id} to be applied (ticket {ticket})",
                        mutations.len()
                    ));
                    let d = self.rng.range(1, 40);
                    self.at(
                        d,
                        Ev::ApplyMutations {
                            gen,
                            conn,
                            ticket,
                            client_id,
                            mutations,
                        },
                    );
                }
                ServerEffect::LookUpReplicated { client_id } => {
                    let gen = server.gen;
                    self.log(format!(
                        "scope server asks for {client_id}'s replicated writes"
                    ));
                    let d = self.rng.range(1, 20);
                    self.at(d, Ev::Replicated { gen, client_id });
                }
            }
        }
    }
}

/// The replica's durable pending backfills as the planner takes them, in table order: the key
/// of a table new to the replica is pending with every column (a whole-table backfill, whose
/// key awaits it too).
fn pending_backfills(storage: &Storage) -> Vec<PendingBackfill> {
    storage
        .durable()
        .tables
        .iter()
        .filter(|(_, t)| !t.pending.is_empty())
        .map(|(name, t)| {
            let whole = t.pending.contains(&t.key);
            PendingBackfill {
                table: name.clone(),
                key: vec![t.key.clone()],
                columns: t.pending.iter().filter(|c| **c != t.key).cloned().collect(),
                whole_table: whole,
                key_backfilling: whole,
            }
        })
        .collect()
}

fn short(text: &str) -> String {
    if text.len() > 160 {
        let mut end = 160;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &text[..end])
    } else {
        text.to_owned()
    }
}

// ---- the network ----
impl World {
    fn new_link(&mut self, peer: Peer) -> u64 {
        let id = self.next_link;
        self.next_link += 1;
        self.links.insert(
            id,
            Link {
                peer,
                gen: None,
                conn: None,
                client_open: true,
                server_open: false,
                broken: false,
                to_server: VecDeque::new(),
                to_client: VecDeque::new(),
            },
        );
        id
    }

    /// Queues `msg` on one direction of `link`, after the frames already in flight there.
    fn push(&mut self, link: u64, to_server: bool, msg: Msg) {
        let slow_reader = match self.links.get(&link).map(|l| l.peer) {
            Some(Peer::Scope(c, _)) => !to_server && self.clients[c].slow,
            _ => false,
        };
        let delay = if slow_reader {
            self.rng.range(300, 2500)
        } else if self.rng.chance(30) {
            self.rng.range(100, 800)
        } else {
            self.rng.range(1, 40)
        };
        let now = self.now;
        let Some(l) = self.links.get_mut(&link) else {
            return;
        };
        if l.broken {
            return;
        }
        let queue = if to_server {
            &mut l.to_server
        } else {
            &mut l.to_client
        };
        let at = queue
            .back()
            .map_or(now + delay, |(t, _)| (*t).max(now + delay));
        queue.push_back((at, msg));
        self.at(at - now, Ev::Net { link, to_server });
    }

    fn send_to_client(&mut self, link: u64, text: String) {
        if self.links.get(&link).is_some_and(|l| l.server_open) {
            self.push(link, false, Msg::Text(text));
        }
    }

    /// The server closes its end of `conn`'s socket.
    fn server_close(&mut self, conn: u64, reason: String) {
        let Some(server) = self.server.as_mut() else {
            return;
        };
        server.heard.remove(&conn);
        server.catchups.remove(&ConnId(conn));
        let Some(link) = server.conns.remove(&conn) else {
            return;
        };
        if let Some(l) = self.links.get_mut(&link) {
            if l.server_open {
                l.server_open = false;
                self.push(link, false, Msg::Close(reason));
            }
        }
    }

    fn deliver(&mut self, link: u64, to_server: bool) {
        let now = self.now;
        let Some(l) = self.links.get_mut(&link) else {
            return;
        };
        let queue = if to_server {
            &mut l.to_server
        } else {
            &mut l.to_client
        };
        if queue.front().is_none_or(|(t, _)| *t > now) {
            return;
        }
        let (_, msg) = queue.pop_front().expect("checked");
        if to_server {
            self.at_server(link, msg);
        } else {
            self.at_client(link, msg);
        }
    }

    fn at_server(&mut self, link: u64, msg: Msg) {
        let l = &self.links[&link];
        let (peer, gen, conn) = (l.peer, l.gen, l.conn);
        let server_gen = self.server.as_ref().map(|s| s.gen);
        if let Msg::Open(watermark) = msg {
            let Some(gen) = server_gen else {
                // Nobody listening: connection refused.
                let l = self.links.get_mut(&link).expect("link");
                l.server_open = true;
                self.push(link, false, Msg::Close("connection refused".to_owned()));
                if let Some(l) = self.links.get_mut(&link) {
                    l.server_open = false;
                }
                return;
            };
            let server = self.server.as_mut().expect("checked");
            let conn = server.next_conn;
            server.next_conn += 1;
            server.conns.insert(conn, link);
            let l = self.links.get_mut(&link).expect("link");
            l.gen = Some(gen);
            l.conn = Some(conn);
            l.server_open = true;
            self.push(link, false, Msg::Accepted);
            match peer {
                Peer::Cs(i) => {
                    let server = self.server.as_mut().expect("checked");
                    let (version, batched) = (self.cs[i].version, self.cs[i].batched);
                    server.streamer.open(ConnId(conn), version, batched);
                    if version >= 7 {
                        // The subscription comes as a frame on the socket.
                        return;
                    }
                    let ctx = SubscribeContext {
                        task_id: format!("task-{i}"),
                        id: self.cs[i].id.clone(),
                        mode: SubscriberMode::Serving,
                        replica_version: rv(),
                        watermark: watermark.unwrap_or_else(rv),
                        backfills: None,
                        extra: Extra::new(),
                    };
                    let line = format!(
                        "streamer: {} subscribes at {} on #{conn}",
                        ctx.id, ctx.watermark
                    );
                    let effects = server.streamer.subscribe(ConnId(conn), ctx, self.now);
                    self.log(line);
                    self.streamer_effects(effects);
                }
                Peer::Scope(..) => {
                    let server = self.server.as_mut().expect("checked");
                    server.heard.insert(conn, self.now);
                    self.scope_input(ServerInput::Opened {
                        conn,
                        session_id: format!("session-{conn}"),
                    });
                }
            }
            return;
        }
        // Frames for a server that is gone (crashed since) reach nobody.
        if gen.is_none() || gen != server_gen || !self.links[&link].server_open {
            return;
        }
        let conn = conn.expect("accepted links have a conn");
        match (peer, msg) {
            (Peer::Cs(_), Msg::Text(text)) => {
                let server = self.server.as_mut().expect("checked");
                let effects = server
                    .streamer
                    .on_client_frame(ConnId(conn), &text, self.now);
                self.streamer_effects(effects);
            }
            (Peer::Cs(_), Msg::Close(_)) => {
                let server = self.server.as_mut().expect("checked");
                server.conns.remove(&conn);
                server.catchups.remove(&ConnId(conn));
                if let Some(l) = self.links.get_mut(&link) {
                    l.server_open = false;
                }
                let server = self.server.as_mut().expect("checked");
                let effects = server.streamer.on_close(ConnId(conn));
                self.streamer_effects(effects);
            }
            (Peer::Scope(..), Msg::Text(text)) => {
                let server = self.server.as_mut().expect("checked");
                server.heard.insert(conn, self.now);
                self.scope_input(ServerInput::Frame { conn, text });
            }
            (Peer::Scope(..), Msg::Close(_)) => {
                let server = self.server.as_mut().expect("checked");
                server.conns.remove(&conn);
                server.heard.remove(&conn);
                if let Some(l) = self.links.get_mut(&link) {
                    l.server_open = false;
                }
                self.scope_input(ServerInput::Closed { conn });
            }
            _ => {}
        }
    }

    fn at_client(&mut self, link: u64, msg: Msg) {
        let l = &self.links[&link];
        if !l.client_open {
            return;
        }
        let (peer, gen, conn) = (l.peer, l.gen, l.conn);
        match (peer, msg) {
            (Peer::Cs(i), Msg::Text(text)) => self.cs_receive(i, link, &text),
            (Peer::Cs(i), Msg::Close(reason)) => {
                self.links.get_mut(&link).expect("link").client_open = false;
                self.log(format!("{} disconnected: {reason}", self.cs[i].id));
                self.cs_lost(i, link);
            }
            (Peer::Cs(i), Msg::Accepted) => {
                if self.cs[i].version >= 7 && self.cs[i].link == Some(link) {
                    let sub = &self.cs[i];
                    let text = format!(
                        r#"{{"id":1,"msg":["start-subscription",{{"taskID":"task-{i}","id":"{}","mode":"serving","replicaVersion":"{}","watermark":"{}"}}]}}"#,
                        sub.id,
                        rv(),
                        sub.last
                    );
                    self.log(format!(
                        "{} sends start-subscription at {}",
                        sub.id, sub.last
                    ));
                    self.push(link, true, Msg::Text(text));
                }
            }
            (Peer::Cs(_), _) => {}
            (Peer::Scope(c, socket), Msg::Text(text)) => {
                // The frame is flushed: the server's outbound budget frees.
                if gen.is_some() && gen == self.server.as_ref().map(|s| s.gen) {
                    if let Some(conn) = conn {
                        let bytes = text.len();
                        self.scope_input(ServerInput::Written { conn, bytes });
                    }
                }
                self.sniff(c, link, &text);
                self.client_input(c, ClientInput::SocketFrame { socket, text });
            }
            (Peer::Scope(c, socket), Msg::Accepted) => {
                self.client_input(c, ClientInput::SocketOpened { socket });
            }
            (Peer::Scope(c, socket), Msg::Close(reason)) => {
                self.links.get_mut(&link).expect("link").client_open = false;
                self.clients[c].sockets.remove(&socket);
                self.client_input(c, ClientInput::SocketClosed { socket, reason });
            }
            (Peer::Scope(..), Msg::Open(_)) => {}
        }
    }

    fn fault(&mut self) {
        if self.quiet {
            return;
        }
        let d = self.rng.range(300, 4000);
        self.at(d, Ev::Fault);
        let live: Vec<u64> = self
            .links
            .iter()
            .filter(|(_, l)| l.client_open && l.server_open && !l.broken)
            .map(|(&id, _)| id)
            .collect();
        let Some(&id) = self.rng.pick(&live) else {
            return;
        };
        self.out.disconnects += 1;
        let half_open = self.rng.chance(400);
        let server_side_learns = self.rng.chance(500);
        let l = self.links.get_mut(&id).expect("link");
        l.to_server.clear();
        l.to_client.clear();
        let is_cs = matches!(l.peer, Peer::Cs(_));
        // Change-stream links have no heartbeat in this model: they are only dropped.
        let half_open = half_open && !is_cs;
        self.log(format!(
            "network: link {id} {}",
            if half_open { "goes half-open" } else { "drops" }
        ));
        let now = self.now;
        let (d1, d2) = (self.rng.range(1, 300), self.rng.range(1, 300));
        let l = self.links.get_mut(&id).expect("link");
        l.broken = true;
        if !half_open || !server_side_learns {
            l.to_client
                .push_back((now + d1, Msg::Close("connection lost".to_owned())));
            self.at(
                d1,
                Ev::Net {
                    link: id,
                    to_server: false,
                },
            );
        }
        let l = self.links.get_mut(&id).expect("link");
        if !half_open || server_side_learns {
            l.to_server
                .push_back((now + d2, Msg::Close("connection lost".to_owned())));
            self.at(
                d2,
                Ev::Net {
                    link: id,
                    to_server: true,
                },
            );
        }
    }
}

// ---- change-stream subscribers ----
impl World {
    fn cs_connect(&mut self, i: usize) {
        if self.cs[i].link.is_some() {
            return;
        }
        let link = self.new_link(Peer::Cs(i));
        self.cs[i].link = Some(link);
        self.cs[i].connecting = true;
        let at = self.cs[i].last.clone();
        self.log(format!("cs{i} connects at {at}"));
        self.push(link, true, Msg::Open(Some(at)));
    }

    fn cs_lost(&mut self, i: usize, link: u64) {
        let sub = &mut self.cs[i];
        if sub.link != Some(link) {
            return;
        }
        sub.link = None;
        sub.open = None;
        let d = self.rng.range(50, 2000);
        self.at(d, Ev::CsConnect(i));
    }

    fn cs_flip(&mut self, i: usize) {
        if self.quiet {
            self.cs[i].slow = false;
            return;
        }
        let d = self.rng.range(1000, 8000);
        self.at(d, Ev::CsFlip(i));
        match self.rng.below(10) {
            0..=2 => {
                self.cs[i].slow = !self.cs[i].slow;
                let slow = self.cs[i].slow;
                self.log(format!("cs{i} goes {}", if slow { "slow" } else { "fast" }));
            }
            3 => {
                // The subscriber disconnects on its own.
                if let Some(link) = self.cs[i].link {
                    self.log(format!("cs{i} disconnects"));
                    self.out.disconnects += 1;
                    self.links.get_mut(&link).expect("link").client_open = false;
                    self.push(link, true, Msg::Close("bye".to_owned()));
                    self.cs_lost(i, link);
                }
            }
            _ => {}
        }
    }

    fn cs_ack(&mut self, i: usize, link: u64, id: u64) {
        if self.cs[i].link == Some(link) && self.links[&link].client_open {
            self.push(link, true, Msg::Text(format!(r#"{{"ack":{id}}}"#)));
        }
    }

    fn cs_receive(&mut self, i: usize, link: u64, text: &str) {
        if self.cs[i].link != Some(link) {
            return;
        }
        // The server's ack of the subscriber's own frame (v7+).
        if text.starts_with(r#"{"ack":"#) {
            return;
        }
        let frame = match decode_downstream_frame(text) {
            Ok(f) => f,
            Err(e) => return self.fail(format!("cs{i} got a frame it cannot read ({e}): {text}")),
        };
        for message in frame.messages() {
            self.cs_message(i, message);
            if self.out.failure.is_some() {
                return;
            }
        }
        if let Some(id) = frame.id() {
            let d = if self.cs[i].slow {
                self.rng.range(300, 3000)
            } else {
                self.rng.range(1, 30)
            };
            let at = (self.now + d).max(self.cs[i].ack_at);
            self.cs[i].ack_at = at;
            self.at(at - self.now, Ev::CsAck { sub: i, link, id });
        }
    }

    fn cs_message(&mut self, i: usize, message: &DownstreamMessage) {
        let name = self.cs[i].id.clone();
        match message {
            DownstreamMessage::Begin(b) => {
                if let Some((open, _)) = &self.cs[i].open {
                    let open = open.clone();
                    return self.fail(format!(
                        "{name} got a begin for {} inside the open transaction {open}",
                        b.commit_watermark
                    ));
                }
                self.cs[i].open = Some((b.commit_watermark.clone(), Vec::new()));
            }
            DownstreamMessage::Data(change) => {
                let Some((_, changes)) = self.cs[i].open.as_mut() else {
                    return self.fail(format!(
                        "{name} got a {} outside a transaction",
                        change.tag()
                    ));
                };
                let item = match change {
                    Change::Insert(c) => Some(("insert", &c.relation.name, c.new.get("id"))),
                    Change::Update(c) => Some(("update", &c.relation.name, c.new.get("id"))),
                    Change::Delete(c) => Some(("delete", &c.relation.name, c.key.get("id"))),
                    _ => None,
                };
                if let Change::Truncate(t) = change {
                    for r in &t.relations {
                        changes.push(format!("truncate {}", r.name));
                    }
                }
                match change {
                    Change::Backfill(b) => changes.push(format!(
                        "backfill {} {}",
                        b.relation.name,
                        b.row_values.len()
                    )),
                    Change::BackfillCompleted(b) => {
                        changes.push(format!("backfill-completed {}", b.relation.name))
                    }
                    _ => {}
                }
                if let Some((tag, table, id)) = item {
                    let id = id.map(|v| v.to_string()).unwrap_or_default();
                    changes.push(format!("{tag} {table} {id}"));
                }
            }
            DownstreamMessage::Commit(c) => {
                let Some((open, changes)) = self.cs[i].open.take() else {
                    return self.fail(format!(
                        "{name} got a commit {} outside a transaction",
                        c.watermark
                    ));
                };
                if open != c.watermark {
                    return self.fail(format!(
                        "{name}: begin {open} ended by commit {}",
                        c.watermark
                    ));
                }
                let last = self.cs[i].last.clone();
                if c.watermark <= last {
                    return self.fail(format!(
                        "{name} got transaction {} again (it holds everything through {last})",
                        c.watermark
                    ));
                }
                if let Some(rec) = self.backfills.get(&c.watermark) {
                    if rec.after != last {
                        return self.fail(format!(
                            "{name} got backfill {} that follows {}, holding {last}",
                            c.watermark, rec.after
                        ));
                    }
                    if rec.digest != changes {
                        return self.fail(format!(
                            "{name} got backfill {} with [{}], its snapshot gave [{}]",
                            c.watermark,
                            changes.join(", "),
                            rec.digest.join(", ")
                        ));
                    }
                    self.cs[i].last = c.watermark.clone();
                    return;
                }
                let Some(&idx) = self.wal_index.get(&c.watermark) else {
                    return self.fail(format!(
                        "{name} got a transaction {} that upstream never committed",
                        c.watermark
                    ));
                };
                let before = if idx == 0 {
                    rv()
                } else {
                    self.pg.wal[idx - 1].watermark()
                };
                if before != self.upstream_at(last.clone()) {
                    return self.fail(format!(
                        "{name} missed transaction {before}: it holds {last} and got {}",
                        c.watermark
                    ));
                }
                let expected = &self.pg.wal[idx].digest;
                if *expected != changes {
                    let expected = expected.join(", ");
                    return self.fail(format!(
                        "{name} got transaction {} with [{}], upstream committed [{expected}]",
                        c.watermark,
                        changes.join(", ")
                    ));
                }
                self.cs[i].last = c.watermark.clone();
            }
            DownstreamMessage::Rollback(_) => {
                self.cs[i].open = None;
            }
            DownstreamMessage::Status(_) => {}
            DownstreamMessage::Error(e) => {
                let e = format!("{e:?}");
                self.fail(format!("{name} got an error from the streamer: {e}"));
            }
            DownstreamMessage::Reserved(_) => {}
        }
    }
}

// ---- scope clients ----
impl World {
    /// The client app (re)loads: a new client from what its store holds.
    fn client_reload(&mut self, c: usize) {
        if self.quiet {
            return;
        }
        let d = self.rng.range(5000, 30_000);
        self.at(d, Ev::ClientReload(c));
        if self.rng.chance(150) {
            self.clients[c].slow = !self.clients[c].slow;
            let slow = self.clients[c].slow;
            self.log(format!(
                "client{c} reads {}",
                if slow { "slowly" } else { "promptly" }
            ));
        }
        let first = self.clients[c].sockets.is_empty() && self.clients[c].store.is_empty();
        if !first && !self.rng.chance(300) {
            return;
        }
        // The page goes away: its socket closes (or, a killed tab, just goes silent).
        let sockets: Vec<u64> = self.clients[c].sockets.values().copied().collect();
        for link in sockets {
            if let Some(l) = self.links.get_mut(&link) {
                l.client_open = false;
            }
            if self.rng.chance(700) {
                self.push(link, true, Msg::Close("page unloaded".to_owned()));
            } else if let Some(l) = self.links.get_mut(&link) {
                l.broken = true;
            }
        }
        self.log(format!("client{c} (re)loads from its store"));
        let config = Self::client_config(&mut self.rng);
        let seed = self.rng.next_u64();
        let client = &mut self.clients[c];
        client.client = SyncClient::new(config, seed);
        client.sockets.clear();
        client.timer_gen += 1;
        client.restored = true;
        let outbox = client.outbox.clone();
        let scopes: Vec<(ScopeKey, ClientScope)> =
            client.scopes.iter().map(|(k, v)| (*k, v.clone())).collect();
        self.client_input(
            c,
            ClientInput::RestoreOutbox {
                client_id: outbox.client_id,
                last_id: outbox.last_id,
                pending: outbox.pending.into_values().collect(),
            },
        );
        for (key, (table, conditions)) in scopes {
            let stored = self.clients[c].store.get(&key).cloned().unwrap_or_default();
            let params = SubscribeParams {
                scope: ChangesScope {
                    resource_type: Some(table),
                    conditions,
                    resource_types: None,
                },
                after: None,
                limit: None,
                authentication_token: None,
                extra: Map::new(),
            };
            self.client_input(
                c,
                ClientInput::Subscribe {
                    scope: key,
                    params: Box::new(params),
                    stored,
                },
            );
        }
        self.client_input(c, ClientInput::Start);
    }

    fn client_input(&mut self, c: usize, input: ClientInput) {
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            let now = self.now;
            let dbg = std::env::var_os("SIM_DEBUG_CLIENT").is_some();
            if dbg {
                eprintln!("{now} client{c} <- {input:?}");
            }
            let effects = self.clients[c].client.handle(now, input);
            if dbg {
                eprintln!("{now} client{c} -> {effects:?}");
            }
            for effect in effects {
                self.client_effect(c, effect, &mut inputs);
                if self.out.failure.is_some() {
                    return;
                }
            }
        }
    }

    fn client_effect(
        &mut self,
        c: usize,
        effect: ClientEffect,
        inputs: &mut VecDeque<ClientInput>,
    ) {
        match effect {
            // A token names its expiry; the server's authorization reads it back.
            ClientEffect::RequestToken { request } => {
                // Tokens issued once the run is quiet never expire, so it can settle.
                let mut token = match self.token_ttl_ms.filter(|_| !self.quiet) {
                    Some(ttl) => format!("exp:{}", self.now + ttl),
                    None => "exp:never".to_owned(),
                };
                if let Some(user) = self.clients[c].user {
                    token.push_str(&format!(";sub:{user}"));
                }
                inputs.push_back(ClientInput::Token {
                    request,
                    result: Ok(Some(token)),
                });
            }
            ClientEffect::OpenSocket { socket } => {
                let link = self.new_link(Peer::Scope(c, socket));
                self.clients[c].sockets.insert(socket, link);
                self.log(format!("client{c} opens socket {socket} (link {link})"));
                self.push(link, true, Msg::Open(None));
            }
            ClientEffect::Send { socket, text } => {
                if let Some(&link) = self.clients[c].sockets.get(&socket) {
                    if self.links[&link].client_open {
                        self.push(link, true, Msg::Text(text));
                    }
                }
            }
            ClientEffect::CloseSocket { socket, reason, .. } => {
                self.log(format!("client{c} closes socket {socket}: {reason}"));
                if let Some(link) = self.clients[c].sockets.remove(&socket) {
                    if let Some(l) = self.links.get_mut(&link) {
                        l.client_open = false;
                    }
                    self.push(link, true, Msg::Close(reason));
                }
            }
            ClientEffect::SetTimer { at_ms } => {
                let client = &mut self.clients[c];
                client.timer_gen += 1;
                if let Some(at) = at_ms {
                    let gen = client.timer_gen;
                    // Node's timers count from the event loop's cached clock, so they can fire
                    // a few milliseconds before the deadline by `Date.now()`. The amount comes
                    // from a hash, not the world's random stream, so seeds replay as before.
                    let early = (gen.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ c as u64) >> 62;
                    self.at(
                        at.saturating_sub(self.now).saturating_sub(early),
                        Ev::ClientTimer { client: c, gen },
                    );
                }
            }
            ClientEffect::Persist { scope, write } => self.persist(c, scope, write),
            ClientEffect::ScopeFailed {
                scope,
                code,
                message,
            } => {
                self.fail(format!("client{c} scope {scope} failed: {code}: {message}"));
            }
            ClientEffect::Error {
                scope,
                code,
                message,
            } => {
                self.log(format!("client{c} error {scope:?} {code}: {message}"));
            }
            ClientEffect::Ready { scope, replayed } => {
                self.log(format!(
                    "client{c} scope {scope} ready ({replayed} replayed)"
                ));
            }
            ClientEffect::Status(status) => {
                self.log(format!(
                    "client{c} status {:?} {:?}",
                    status.state, status.reason
                ));
            }
            ClientEffect::Changed { .. } | ClientEffect::Progress { .. } => {}
            ClientEffect::PersistOutbox { write } => {
                let store = &mut self.clients[c].outbox;
                if write.client_id != store.client_id || write.last_id < store.last_id {
                    let why = format!(
                        "client{c} persisted outbox {}/{} over {}/{}",
                        write.client_id, write.last_id, store.client_id, store.last_id
                    );
                    return self.fail(why);
                }
                store.last_id = write.last_id;
                for id in &write.remove {
                    store.pending.remove(id);
                }
                for m in write.put {
                    store.pending.insert(m.id, m);
                }
            }
            ClientEffect::Settled { result } => self.settled(c, result),
            // Writes go over the socket (`mutate`), never through the app's upload.
            ClientEffect::Upload { .. } => {
                self.fail(format!("client{c}: an upload effect without upload mode"));
            }
        }
    }

    /// Now and then (online or not) a client inserts a row into one of its scopes' tables,
    /// with that scope's owner and a globally unique id.
    fn client_mutate(&mut self, c: usize) {
        if self.quiet {
            return;
        }
        let d = self.rng.range(100, 2500);
        self.at(d, Ev::ClientMutate(c));
        if !self.clients[c].restored {
            return;
        }
        let scopes: Vec<ClientScope> = self.clients[c].scopes.values().cloned().collect();
        let (table, conditions) = self.rng.pick(&scopes).expect("scopes").clone();
        let owner = match conditions.get(OWNER) {
            Some(Value::String(o)) => o.clone(),
            Some(Value::Array(list)) => list
                .first()
                .and_then(Value::as_str)
                .unwrap_or(OWNERS[0])
                .to_owned(),
            _ => (*self.rng.pick(&OWNERS).expect("owners")).to_owned(),
        };
        let id = self.next_write_id;
        self.next_write_id += 1;
        let mut row = Map::new();
        row.insert("id".to_owned(), json!(id));
        row.insert(OWNER.to_owned(), json!(owner));
        row.insert("title".to_owned(), json!(format!("w{c}")));
        // Into a project: mostly one of the user's own (as upstream has it now), so the write
        // shows in its scopes; a todo of that project for an item.
        let mine: Vec<i64> = match self.clients[c].user {
            Some(user) => self
                .pg
                .rows_json(MEMBERS)
                .values()
                .filter(|m| m.get(USER).and_then(Value::as_str) == Some(user))
                .filter_map(|m| m.get(PROJECT).and_then(Value::as_i64))
                .collect(),
            None => Vec::new(),
        };
        let project = match self.rng.pick(&mine) {
            Some(p) if !self.rng.chance(200) => *p,
            _ => *self.rng.pick(&PROJECTS).expect("projects"),
        };
        row.insert(PROJECT.to_owned(), json!(project));
        if table == "items" {
            let todos: Vec<i64> = self
                .pg
                .rows_json("todos")
                .into_iter()
                .filter(|(_, t)| t.get(PROJECT).and_then(Value::as_i64) == Some(project))
                .map(|(id, _)| id)
                .collect();
            let todo = match self.rng.pick(&todos) {
                Some(t) => *t,
                None => self.rng.range(1, 40) as i64,
            };
            row.insert(TODO.to_owned(), json!(todo));
        }
        let client_id = self.clients[c].outbox.client_id.clone();
        let (result, effects) = self.clients[c].client.mutate(
            self.now,
            table.clone(),
            MutationOp::Insert,
            row.clone(),
            None,
        );
        let mid = match result {
            Ok(mid) => mid,
            Err(e) => return self.fail(format!("client{c} could not mutate: {e}")),
        };
        self.out.mutations += 1;
        self.log(format!(
            "client{c} mutation {mid}: insert {table} {id} owner {owner} project {project}"
        ));
        self.writes.insert(
            (client_id, mid),
            MadeWrite {
                table,
                row,
                tx: None,
            },
        );
        let mut inputs = VecDeque::new();
        for effect in effects {
            self.client_effect(c, effect, &mut inputs);
            if self.out.failure.is_some() {
                return;
            }
        }
        while let Some(input) = inputs.pop_front() {
            self.client_input(c, input);
        }
    }

    /// The host applies a batch upstream, each mutation in its own transaction and at most
    /// once, then answers (unless its process died meanwhile).
    fn apply_mutations(
        &mut self,
        gen: u64,
        conn: u64,
        ticket: u64,
        client_id: String,
        mutations: Vec<Result<Mutation, InvalidMutation>>,
    ) {
        if self.server.as_ref().is_none_or(|s| s.gen != gen) {
            self.log(format!(
                "the batch of conn {conn} ticket {ticket} dies with its server"
            ));
            return;
        }
        let mut results = Vec::new();
        for m in mutations {
            let m = match m {
                Ok(m) => m,
                Err(e) => {
                    return self.fail(format!("{client_id} sent an unreadable mutation: {e}"))
                }
            };
            let time = EPOCH_UNIX_MS + self.now as i64;
            match self
                .pg
                .apply_mutation(&client_id, m.id, &m.table, &m.row, time)
            {
                Ok(Applied::Now) => {
                    let idx = self.pg.wal.len() - 1;
                    let w = self.pg.wal[idx].watermark();
                    self.wal_index.insert(w.clone(), idx);
                    let n = self
                        .pg
                        .applied
                        .iter()
                        .filter(|(cl, id)| *cl == client_id && *id == m.id)
                        .count();
                    if n != 1 {
                        return self.fail(format!(
                            "{client_id} mutation {} applied {n} times upstream",
                            m.id
                        ));
                    }
                    match self.writes.get_mut(&(client_id.clone(), m.id)) {
                        Some(made) if made.tx.is_none() && made.row == m.row => {
                            made.tx = Some(idx);
                        }
                        other => {
                            let why = format!(
                                "{client_id} mutation {} applied as {:?}, the client made {other:?}",
                                m.id, m.row
                            );
                            return self.fail(why);
                        }
                    }
                    self.log(format!(
                        "pg: commit {w}: {client_id} mutation {} (insert {} {})",
                        m.id,
                        m.table,
                        m.row.get("id").cloned().unwrap_or(Value::Null)
                    ));
                    self.kick_pg();
                }
                Ok(Applied::Before) => {
                    self.out.applied_before += 1;
                    self.log(format!(
                        "pg: {client_id} mutation {} was applied before",
                        m.id
                    ));
                }
                Err(e) => return self.fail(format!("{client_id} mutation {} failed: {e}", m.id)),
            }
            results.push(MutationResult::confirmed(m.id));
        }
        let d = self.rng.range(1, 40);
        self.at(
            d,
            Ev::MutationsApplied {
                gen,
                conn,
                ticket,
                client_id,
                results,
            },
        );
    }

    /// A client's mutation settled: confirmed ones were applied upstream exactly once, and
    /// the client shows the row (read-your-writes) unless upstream changed it since.
    fn settled(&mut self, c: usize, result: MutationResult) {
        let client_id = self.clients[c].outbox.client_id.clone();
        self.log(format!(
            "client{c} mutation {} settled {:?}",
            result.id, result.status
        ));
        if result.status != MutationStatus::Confirmed {
            return self.fail(format!(
                "client{c} mutation {} settled {:?} ({:?}: {:?}); the simulation refuses no write",
                result.id, result.status, result.code, result.message
            ));
        }
        self.out.confirmed += 1;
        let n = self
            .pg
            .applied
            .iter()
            .filter(|(cl, id)| *cl == client_id && *id == result.id)
            .count();
        if n != 1 {
            return self.fail(format!(
                "client{c} mutation {} confirmed, applied upstream {n} times",
                result.id
            ));
        }
        let Some(made) = self.writes.get(&(client_id, result.id)).cloned() else {
            return self.fail(format!(
                "client{c} mutation {} confirmed, never made",
                result.id
            ));
        };
        let Some(tx) = made.tx else {
            return self.fail(format!(
                "client{c} mutation {} confirmed, its transaction unknown",
                result.id
            ));
        };
        let id = made.row.get("id").and_then(Value::as_i64).unwrap_or(0);
        let table = made.table;
        let touched = self.pg.wal[tx + 1..].iter().any(|later| {
            later.digest.iter().any(|d| {
                *d == format!("update {table} {id}")
                    || *d == format!("delete {table} {id}")
                    || *d == format!("truncate {table}")
            })
        });
        // A user's access may have changed since, too.
        let filter = self.clients[c].filters.get(&table);
        let access_moved = filter.is_some()
            && self.pg.wal[tx + 1..].iter().any(|later| {
                later
                    .digest
                    .iter()
                    .any(|d| d.split(' ').nth(1).is_some_and(|t| SET_TABLES.contains(&t)))
            });
        if touched || access_moved {
            return;
        }
        let Some(upstream) = self.pg.rows_json(&table).remove(&id) else {
            return;
        };
        let set_rows = self.upstream_set_rows();
        let sets = Self::sets_of(&set_rows);
        let allowed = filter.is_none_or(|f| sets.passes(f, &upstream));
        let mut missing = Vec::new();
        for (key, (t, conditions)) in &self.clients[c].scopes {
            let query = Conditions::parse(conditions).expect("the simulation's conditions");
            if *t != table || !query.matches(&upstream) || !allowed {
                continue;
            }
            let shown = self.clients[c]
                .client
                .rows(*key)
                .into_iter()
                .any(|r| r.get("id").and_then(Value::as_i64) == Some(id));
            if !shown {
                let live = self.clients[c].client.is_live(*key);
                missing.push(format!(
                    "{key} ({})",
                    if live { "live" } else { "not live" }
                ));
            }
        }
        if !missing.is_empty() {
            self.fail(format!(
                "client{c} mutation {} confirmed, yet scopes {missing:?} do not show {table} {id}",
                result.id
            ));
        }
    }

    /// Upstream's rows of the tables the rules' subqueries read.
    fn upstream_set_rows(&self) -> Vec<(&'static str, Vec<Map<String, Value>>)> {
        SET_TABLES
            .iter()
            .map(|t| (*t, self.pg.rows_json(t).into_values().collect()))
            .collect()
    }

    /// The sets of the rules' subqueries over `rows` (see [`World::upstream_set_rows`]).
    fn sets_of<'a>(rows: &'a [(&'static str, Vec<Map<String, Value>>)]) -> TableSets<'a> {
        TableSets::new(rows.iter().map(|(t, rows)| (*t, rows.iter().collect())))
    }

    fn persist(
        &mut self,
        c: usize,
        scope: ScopeKey,
        write: highwater_engine::scope_sync::client::PersistWrite,
    ) {
        let table = self.clients[c].scopes[&scope].0.clone();
        let store = self.clients[c].store.entry(scope).or_default();
        let old_seq = store.cursor.as_ref().and_then(|k| k.server_sequence);
        if write.forget_cursor {
            store.cursor = None;
        }
        for id in &write.deletes {
            store.rows.retain(|r| r.id != *id);
        }
        let mut bad = None;
        for row in &write.upserts {
            store.rows.retain(|r| r.id != row.id);
            store.rows.push(row.clone());
            if let Some(seq) = row.server_sequence {
                match self.history.get(&(table.clone(), row.id.clone(), seq)) {
                    Some(data) if without_nulls(data) == without_nulls(&row.data.to_map()) => {}
                    other => {
                        bad = Some(format!(
                            "client{c} stored {table} {} at seq {seq} as {}, the replica gave that seq {}",
                            row.id,
                            Value::Object(row.data.to_map()),
                            other.map_or("nothing".to_owned(), |d| Value::Object(d.clone()).to_string())
                        ));
                    }
                }
            }
        }
        if let Some(cursor) = &write.cursor {
            if let (Some(old), Some(new), false) =
                (old_seq, cursor.server_sequence, write.forget_cursor)
            {
                if new < old {
                    bad = Some(format!(
                        "client{c} scope {scope} cursor moved backwards: {old} then {new}"
                    ));
                }
            }
            store.cursor = Some(cursor.clone());
        }
        store.rows.sort_by(|a, b| a.id.cmp(&b.id));
        if let Some(why) = bad {
            self.fail(why);
        }
    }

    /// The scope server ended a replay on a full page: the scope's later rows would never
    /// reach the client (its sets, lagging the page's read, must not shorten the last page).
    fn replay_cut_short(&mut self, req: &PageReq) {
        let link = self
            .server
            .as_ref()
            .and_then(|s| s.conns.get(&req.conn).copied());
        let Some(Peer::Scope(c, _)) = link.and_then(|l| self.links.get(&l)).map(|l| l.peer) else {
            return;
        };
        let keys: Vec<ScopeKey> = self.clients[c]
            .scopes
            .iter()
            .filter(|(_, (table, conditions))| {
                *table == req.table
                    && Conditions::parse(conditions).is_ok_and(|parsed| parsed == req.conditions)
            })
            .map(|(key, _)| *key)
            .collect();
        let detail = format!(
            "client{c}'s replay of {} (scopes {keys:?}) ended on a full page of {} rows after {:?}",
            req.table, req.limit, req.after
        );
        self.fail(detail);
    }

    /// A `confirmed` result goes out only once the server routed its row's commit.
    fn check_confirms(&mut self, conn: u64, routed: i64, text: &str) {
        let Ok(ServerFrame::MutationResult { client_id, results }) = ServerFrame::from_json(text)
        else {
            return;
        };
        for result in results {
            if result.status != MutationStatus::Confirmed {
                continue;
            }
            let key = (client_id.clone(), result.id);
            let Some(&seq) = self.confirm_seqs.get(&key) else {
                continue;
            };
            if seq > routed {
                return self.fail(format!(
                    "{client_id} mutation {} confirmed on conn {conn} with its row at seq {seq}, routed through {routed}",
                    result.id
                ));
            }
        }
    }

    /// A row the server sends a user's scope passes the user's filter as the replica stood at
    /// some point from where the server's routing stood (`routed`, a seq) to now: the server
    /// judges live rows by its sets, which follow the commits it routed, and reads rows (pages,
    /// moves) from durable storage.
    fn check_allowed(&mut self, link: u64, routed: i64, text: &str) {
        let Some(Peer::Scope(c, _)) = self.links.get(&link).map(|l| l.peer) else {
            return;
        };
        if self.clients[c].filters.is_empty() || !text.contains("\"syncs\"") {
            return;
        }
        let Ok(ServerFrame::ChannelMessage { body, .. }) = ServerFrame::from_json(text) else {
            return;
        };
        let Some(syncs) = body.get("syncs").and_then(Value::as_array) else {
            return;
        };
        let start = self
            .access_states
            .range(..=routed)
            .next_back()
            .map_or(0, |(first, _)| *first);
        let states: Vec<TableSets<'_>> = self
            .access_states
            .range(start..)
            .map(|(_, state)| {
                TableSets::new(
                    state
                        .iter()
                        .map(|(name, rows)| (name.as_str(), rows.iter().collect())),
                )
            })
            .collect();
        let mut refused = None;
        for entry in syncs {
            if entry.get("syncType").and_then(Value::as_str) == Some("delete") {
                continue;
            }
            let (Some(table), Some(Value::Object(data))) = (
                entry.get("resourceType").and_then(Value::as_str),
                entry.get("data"),
            ) else {
                continue;
            };
            let Some(filter) = self.clients[c].filters.get(table) else {
                continue;
            };
            if !states.iter().any(|sets| sets.passes(filter, data)) {
                refused = Some(format!(
                    "the server sent client{c} ({}) {table} {} at seq {}, which its filter {filter} allowed at no point since seq {routed} ({} states)",
                    self.clients[c].user.unwrap_or_default(),
                    Value::Object(data.clone()),
                    entry.get("serverSequence").unwrap_or(&Value::Null),
                    states.len()
                ));
                break;
            }
        }
        if let Some(why) = refused {
            self.fail(why);
        }
    }

    /// Watches what the server sends a client: no entry twice within one subscription.
    fn sniff(&mut self, c: usize, link: u64, text: &str) {
        let Ok(ServerFrame::ChannelMessage {
            subscription_id,
            body,
            ..
        }) = ServerFrame::from_json(text)
        else {
            return;
        };
        let key = (link, subscription_id.clone());
        if body.get("reset").is_some() {
            self.clients[c].seen.remove(&key);
        }
        let Some(syncs) = body.get("syncs").and_then(Value::as_array) else {
            return;
        };
        // Rows a change of access lets in come with the seqs they have, which the client may
        // have been sent before they moved out.
        let moved = body.get("moves").is_some();
        self.out.move_envelopes += u64::from(moved);
        let mut dup = None;
        let seen = self.clients[c].seen.entry(key).or_default();
        for entry in syncs {
            let id = entry
                .get("resourceId")
                .map(|v| v.to_string())
                .unwrap_or_default();
            let seq = entry
                .get("serverSequence")
                .and_then(Value::as_i64)
                .unwrap_or(-1);
            match seen.insert((id.clone(), seq), moved) {
                None => {}
                Some(_) if moved => {}
                Some(after_move) => {
                    dup = Some((id, seq, after_move));
                    break;
                }
            }
        }
        if let Some((id, seq, after_move)) = dup {
            let why = if after_move {
                format!("client{c} got {id} at seq {seq} again on subscription {subscription_id} (link {link}), after a move sent it")
            } else {
                format!("client{c} got {id} at seq {seq} twice on subscription {subscription_id} (link {link})")
            };
            self.fail(why);
        }
    }
}

// ---- invariants ----
impl World {
    fn check_continuous(&mut self) {
        if self.out.failure.is_some() {
            return;
        }
        let stored = self.storage.last_watermark().clone();
        if stored < self.stored_high {
            let high = self.stored_high.clone();
            return self.fail(format!(
                "durable storage moved backwards: {high} then {stored}"
            ));
        }
        self.stored_high = stored;
        self.check_slot();
    }

    fn final_check(&mut self) {
        self.done = true;
        let last = self.pg.wal.last().map_or_else(rv, |tx| tx.watermark());
        let mut problems = Vec::new();
        let stored = self.storage.last_watermark().clone();
        let pending = self.storage.pending_backfills();
        if !pending.is_empty() {
            problems.push(format!(
                "the replica still waits for backfills: {pending:?}"
            ));
        }
        if self.upstream_at(stored.clone()) != last {
            problems.push(format!(
                "storage holds through {}, upstream committed through {last}",
                self.storage.last_watermark()
            ));
        }
        if let Some(tx) = self.pg.wal.last() {
            if self.pg.confirmed < tx.commit_lsn {
                problems.push(format!(
                    "the slot is at {}, short of the last commit {}",
                    self.pg.confirmed, tx.commit_lsn
                ));
            }
        }
        for sub in &self.cs {
            if sub.last != stored {
                problems.push(format!(
                    "{} holds through {}, not {stored} (upstream {last})",
                    sub.id, sub.last
                ));
            }
        }
        // The replica holds upstream's rows, backfilled columns included.
        for (name, table) in &self.storage.durable().tables {
            let strict = self.backfilled.get(name);
            let want: BTreeMap<String, Map<String, Value>> = self
                .pg
                .rows_json(name)
                .into_iter()
                .map(|(id, r)| (id.to_string(), compared(&r, strict)))
                .collect();
            let held: BTreeMap<String, Map<String, Value>> = table
                .rows
                .iter()
                .map(|(id, r)| (id.clone(), compared(&r.data, strict)))
                .collect();
            if let Some(diff) = row_diff(&held, &want) {
                problems.push(format!("replica table {name}: {diff}"));
            }
        }
        let set_rows = self.upstream_set_rows();
        let sets = Self::sets_of(&set_rows);
        for (c, client) in self.clients.iter().enumerate() {
            let unsettled = client.client.pending_mutations();
            if !unsettled.is_empty() || !client.outbox.pending.is_empty() {
                problems.push(format!(
                    "client{c} has unsettled mutations: {:?} (stored {:?})",
                    unsettled.iter().map(|m| m.id).collect::<Vec<_>>(),
                    client.outbox.pending.keys().collect::<Vec<_>>()
                ));
            }
            for (key, (table, conditions)) in &client.scopes {
                let strict = self.backfilled.get(table);
                // The scope's query, evaluated on what Postgres holds: its conditions, and the
                // user's row filter with the user's memberships now.
                let query = Conditions::parse(conditions).expect("the simulation's conditions");
                let filter = client.filters.get(table);
                let want: BTreeMap<String, Map<String, Value>> = self
                    .pg
                    .rows_json(table)
                    .into_iter()
                    .filter(|(_, r)| query.matches(r) && filter.is_none_or(|f| sets.passes(f, r)))
                    .map(|(id, r)| (id.to_string(), compared(&r, strict)))
                    .collect();
                let held: BTreeMap<String, Map<String, Value>> = client
                    .client
                    .rows(*key)
                    .into_iter()
                    .map(|r| {
                        (
                            r.get("id").map(|v| v.to_string()).unwrap_or_default(),
                            compared(&r, strict),
                        )
                    })
                    .collect();
                let stored: BTreeMap<String, Map<String, Value>> = client
                    .store
                    .get(key)
                    .map(|s| {
                        s.rows
                            .iter()
                            .map(|r: &StoredRow| (r.id.clone(), compared(&r.data.to_map(), strict)))
                            .collect()
                    })
                    .unwrap_or_default();
                for (what, rows) in [("holds", &held), ("stored", &stored)] {
                    if let Some(diff) = row_diff(rows, &want) {
                        let filter = filter.map_or(String::new(), |f| format!(" and {f}"));
                        problems.push(format!(
                            "client{c} scope {table} where {}{filter} {what}: {diff}",
                            Value::Object(conditions.clone())
                        ));
                    }
                }
            }
        }
        if !problems.is_empty() {
            self.fail(format!(
                "after {} ms quiet: {}",
                QUIET_MS,
                problems.join("; ")
            ));
        } else {
            self.log("quiet: every subscriber and client matches upstream".to_owned());
        }
    }
}

/// Which rows are missing, extra or different, by id; `None` when equal.
fn row_diff(
    got: &BTreeMap<String, Map<String, Value>>,
    want: &BTreeMap<String, Map<String, Value>>,
) -> Option<String> {
    let missing: Vec<&str> = want
        .keys()
        .filter(|k| !got.contains_key(*k))
        .map(String::as_str)
        .collect();
    let extra: Vec<&str> = got
        .keys()
        .filter(|k| !want.contains_key(*k))
        .map(String::as_str)
        .collect();
    let differ: Vec<String> = want
        .iter()
        .filter_map(|(k, w)| {
            let g = got.get(k)?;
            (g != w).then(|| {
                format!(
                    "{k} (has {}, upstream {})",
                    Value::Object(g.clone()),
                    Value::Object(w.clone())
                )
            })
        })
        .take(3)
        .collect();
    if missing.is_empty() && extra.is_empty() && differ.is_empty() {
        return None;
    }
    Some(format!(
        "{} rows, upstream {}; missing {missing:?}, extra {extra:?}, different {differ:?}",
        got.len(),
        want.len()
    ))
}

/// A short summary line for a trace header.
pub fn describe(outcome: &Outcome) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "seed {}: {} steps, {} crashes, {} disconnects, {} transactions",
        outcome.seed, outcome.steps, outcome.crashes, outcome.disconnects, outcome.transactions
    );
    s
}
