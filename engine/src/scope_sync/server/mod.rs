//! The server side of the scope-sync channel (subscribe, replay, live delivery), sans-IO.
//!
//! [`ScopeServer`] holds every scope-sync socket of a serving node: its subscriptions, their
//! catch-up replays (each driven by a [`ReplayPlanner`]), and a live routing index keyed by
//! `(table, column, value)`. The host turns socket events, authorization results, replica reads
//! and replica commits into [`ServerInput`]s and carries out the returned [`ServerEffect`]s in
//! order:
//!
//! - [`ServerEffect::Send`]: write the text frame to that socket, then report
//!   [`ServerInput::Written`] with its length once it is flushed (the outbound budget).
//! - [`ServerEffect::Authorize`]: check the token against the rules, answer
//!   [`ServerInput::Authorized`] with the decision as a value.
//! - [`ServerEffect::FetchPage`]: read one replay page from the replica in one read transaction
//!   and answer [`ServerInput::PageFetched`]. Never hold the read open while a socket is slow:
//!   the page is read, then handed over.
//! - [`ServerEffect::Close`]: close the socket with that code and reason, then report
//!   [`ServerInput::Closed`].
//!
//! Feed [`ServerInput::Committed`] with the feed entries of every upstream transaction, in
//! commit order and only after the replica commit that gave them their seqs (a client must
//! never hold a seq a crash could reassign). Feed [`ServerInput::RetentionFloor`] after every
//! prune of exits; each page also carries the floor its own read saw
//! ([`PageResult::Rows`]), so a page read after a prune is judged by it even when the host's
//! hand-off of the new floor comes later.
//!
//! Rules carried here (`docs/protocol/scope-sync.md`, "Replay then live", "Flow control",
//! "Resets and retention"): a subscription replays rows up to a high-water pinned on its first
//! page and gets rows above it live, each once (live entries at or below the pin, or at or below
//! its start cursor, are dropped: the replay has them); a replay page is only requested while
//! the socket's unflushed bytes are under its budget (hazard P15), and a socket whose budget
//! stays full longer than a bound is closed 1013 "slow consumer"; a cursor of another epoch,
//! without an epoch, below the retention floor (at subscribe, or raised past it while its replay
//! runs), or before a truncate of its table gets a reset marker and a full replay; delivered
//! cursors only move forwards; a subscription whose token expires is ended with `auth-expired`.
//!
//! Checkpoints: a client's cursor must follow the feed, not only its scope's rows, or a scope
//! nobody writes would keep a cursor below the retention floor (raised to the initial sync's
//! last seq on a first start, and by every prune) and reset on each resume. So the end of a
//! replay sends a checkpoint envelope (`"cursor"`, see
//! [`CURSOR_KEY`](crate::scope_sync::CURSOR_KEY)) at the pinned high-water or the newest entry
//! routed since, whichever is higher, and [`ServerInput::Tick`] sends one to every live
//! subscription that has not heard of the feed's newest routed entry for
//! [`ServerConfig::checkpoint_interval_ms`]. Both are exact: every change of the scope up to
//! that position has been sent on the socket before them.
//!
//! Live routing finds a subscription through its routes (`routes`): its equality condition
//! ([`Conditions::routing_key`](crate::scope_sync::Conditions::routing_key)), else its row
//! filter's equalities, short `IN` lists and subquery sets (by the set's values), through
//! every branch of an `OR`. A scope without routes (only ranges, `isNull`, `NOT`) is kept in
//! its table's table-wide list, and every change to that table is matched against each scope
//! in that list; there is no index for ranges.
//!
//! Row filters with subqueries (`col IN (SELECT …)`): [`ServerEffect::ReadSet`] reads a set,
//! [`ServerEffect::ReadMoves`] the rows a commit let into a scope, and a resumed page answers
//! whether the scope's sets changed since its cursor (`access` / `access_changed`). A commit
//! that changes sets is routed once those reads are answered, with the moves it caused; later
//! commits wait (`docs/protocol/scope-sync.md`, "Access that follows the data").

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use serde_json::{json, Map, Value};

use crate::scope_sync::cursor::SyncCursor;
use crate::scope_sync::feed;
use crate::scope_sync::replay::{
    reset_envelope, FetchedPage, PageRequest, ReplayEffect, ReplayInput, ReplayKind, ReplayPlanner,
    RESET_KEY,
};
use crate::scope_sync::rules::row_filter::{RowFilter, SetQuery};
use crate::scope_sync::{
    js_string_form, operand_number, ClientFrame, Conditions, Echo, InvalidMutation, Mutation,
    MutationResult, ServerFrame, SubscribeParams, SyncEntry, SyncEnvelope, CURSOR_KEY, MOVES_KEY,
    SYNC_CHANNEL_TYPE,
};

#[cfg(test)]
mod membership_tests;
mod sets;
#[cfg(test)]
mod tests;
mod writes;

use sets::{SetDiff, SetRead, SetStore};
pub use sets::{SetId, MAX_SET_ROWS};

pub use writes::{write_codes, MAX_AWAITED};

/// One socket, as the host numbers them.
pub type ConnId = u64;

/// Stable `channel-error` codes.
pub mod codes {
    pub const AUTH_REQUIRED: &str = "auth-required";
    pub const AUTH_INVALID: &str = "auth-invalid";
    pub const AUTH_EXPIRED: &str = "auth-expired";
    pub const FORBIDDEN: &str = "forbidden";
    pub const INVALID_PARAMS: &str = "invalid-params";
    pub const SUBSCRIPTION_IN_USE: &str = "subscription-in-use";
    pub const UNKNOWN_CHANNEL: &str = "unknown-channel";
    pub const TOO_MANY_SUBSCRIPTIONS: &str = "too-many-subscriptions";
    /// `error` frame code of a frame that could not be decoded.
    pub const BAD_FRAME: &str = "bad-frame";
    /// `error` frame code of a replay the server could not read.
    pub const INTERNAL: &str = "internal";
}

/// WebSocket close code for a client that does not keep up (try again later).
pub const SLOW_CONSUMER_CLOSE_CODE: u16 = 1013;
/// Close reason of a slow consumer.
pub const SLOW_CONSUMER_REASON: &str = "slow consumer";

/// How a [`ScopeServer`] behaves; fixed for its lifetime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// The replica version: every entry id and cursor carries it (`"<epoch>:<seq>"`).
    pub epoch: String,
    pub max_subscriptions_per_connection: usize,
    /// Unflushed bytes a socket may hold before replay pauses.
    pub outbound_budget_bytes: usize,
    /// How long a socket may stay over its budget before it is closed.
    pub slow_consumer_timeout_ms: u64,
    /// Unflushed bytes beyond which a socket is closed at once.
    pub outbound_hard_limit_bytes: usize,
    /// Live envelopes kept for a subscription whose high-water is not pinned yet.
    pub max_buffered_live: usize,
    /// How often a live subscription whose scope is quiet while the feed moves on is told the
    /// feed position it is complete up to (a [`CURSOR_KEY`](crate::scope_sync::CURSOR_KEY) checkpoint), so its client's cursor
    /// keeps up with the feed and stays above the retention floor.
    pub checkpoint_interval_ms: u64,
    /// Whether `mutate` frames are applied here (a primary with an upstream to write to); a
    /// node that takes no writes answers each mutation `retry` with `unavailable`.
    pub takes_writes: bool,
}

impl ServerConfig {
    pub fn new(epoch: impl Into<String>) -> Self {
        Self {
            epoch: epoch.into(),
            max_subscriptions_per_connection: 256,
            outbound_budget_bytes: 1 << 20,
            slow_consumer_timeout_ms: 10_000,
            outbound_hard_limit_bytes: 16 << 20,
            max_buffered_live: 10_000,
            checkpoint_interval_ms: 30_000,
            takes_writes: false,
        }
    }
}

pub use crate::scope_sync::rules::Grant;

/// The authorization decision for one subscribe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Granted(Grant),
    Denied { code: String, message: String },
}

/// One scope-feed entry: a row as written, or a row leaving the scopes it matched.
#[derive(Debug, Clone, PartialEq)]
pub struct FeedEntry {
    pub table: String,
    pub resource_id: String,
    pub seq: i64,
    /// ISO-8601 commit time.
    pub updated_at: String,
    pub change: FeedChange,
}

#[derive(Debug, Clone, PartialEq)]
pub enum FeedChange {
    /// The row as it now is.
    Upsert { data: Map<String, Value> },
    /// The row left every scope matching `old` and not `new` (`None`: gone under this key).
    Exit {
        old: Map<String, Value>,
        new: Option<Map<String, Value>>,
    },
}

/// The replica's answer to a [`ServerEffect::FetchPage`].
#[derive(Debug, Clone, PartialEq)]
pub enum PageResult {
    Rows {
        /// The high-water used (the last seq assigned when the page was read).
        up_to: i64,
        rows: Vec<FeedEntry>,
        /// The scope's row count in the replay range, when asked for.
        total: Option<u64>,
        /// The retention floor as the page's read transaction saw it (seqs at or below it
        /// may have lost their exits): read with the rows, so a prune committed before the
        /// read is known here even if [`ServerInput::RetentionFloor`] has not arrived yet.
        floor: Option<i64>,
        /// Whether a set the page was asked about ([`ServerEffect::FetchPage`]'s `access`)
        /// may have changed after its `after`, up to the page's high-water.
        access_changed: bool,
    },
    /// The table was truncated after the cursor: the scope starts over.
    Truncated,
    /// The read failed; the subscription ends with this message.
    Failed { message: String },
}

/// What the host tells the server.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerInput {
    /// A socket opened; `session_id` is the host's (random) id for it.
    Opened { conn: ConnId, session_id: String },
    /// A text frame arrived.
    Frame { conn: ConnId, text: String },
    /// The answer to [`ServerEffect::Authorize`].
    Authorized {
        conn: ConnId,
        ticket: u64,
        decision: Decision,
    },
    /// The answer to [`ServerEffect::FetchPage`].
    PageFetched {
        conn: ConnId,
        ticket: u64,
        pass: u64,
        result: PageResult,
    },
    /// The feed entries of one committed upstream transaction, ascending by seq, and the
    /// client mutations it confirmed (`highwater.confirm` messages: client id, mutation id).
    Committed {
        entries: Vec<FeedEntry>,
        confirms: Vec<(String, u64)>,
    },
    /// The answer to [`ServerEffect::LookUpReplicated`]: the client's last mutation id the
    /// replica holds (and whose transaction was routed), if any.
    Replicated {
        client_id: String,
        last: Option<u64>,
    },
    /// The answer to [`ServerEffect::ApplyMutations`]: a result per mutation, in order
    /// (`confirmed` for one applied upstream, now or by an earlier send), and the client's
    /// last mutation id the replica held when the host looked, after applying them.
    MutationsApplied {
        conn: ConnId,
        ticket: u64,
        results: Vec<MutationResult>,
        replicated: Option<u64>,
    },
    /// The answer to [`ServerEffect::ReadSet`].
    SetRead { set: SetId, result: PageResult },
    /// The answer to [`ServerEffect::ReadMoves`].
    MovesRead { read: u64, result: PageResult },
    /// `bytes` of frames sent to `conn` were flushed to its socket.
    Written { conn: ConnId, bytes: usize },
    /// The socket is gone.
    Closed { conn: ConnId },
    /// Time passed (expiry and slow-consumer checks).
    Tick,
    /// Seqs at or below this may have lost their exits to retention.
    RetentionFloor(Option<i64>),
}

/// Something the host must do, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEffect {
    Send {
        conn: ConnId,
        text: String,
    },
    Authorize {
        conn: ConnId,
        ticket: u64,
        token: Option<String>,
        resource_type: String,
        conditions: Map<String, Value>,
    },
    FetchPage {
        conn: ConnId,
        ticket: u64,
        pass: u64,
        table: String,
        conditions: Conditions,
        /// The table's row filter for the subscriber; rows must pass it too.
        row_filter: Option<RowFilter>,
        after: Option<i64>,
        up_to: Option<i64>,
        limit: u32,
        count_total: bool,
        /// On a resumed subscription's first page: the sets of its row filter's subqueries.
        /// Answer whether any may have changed after `after` (a row of its table that passes
        /// its filter now, or passed it before an exit, written since; or one of its own
        /// subqueries' sets so changed), in the page's read transaction.
        access: Vec<SetQuery>,
    },
    /// Read every row of `table` that `row_filter` holds for (a subquery's set), at most
    /// `limit`, in one read transaction, and answer [`ServerInput::SetRead`] with the rows
    /// (as upserts) and the transaction's high-water.
    ReadSet {
        set: SetId,
        table: String,
        row_filter: RowFilter,
        limit: u32,
    },
    /// Read the rows a change of access let into a live subscription's scope: every row of
    /// `table` matching `conditions` and `row_filter` (narrowed to the values that moved), at
    /// most `limit`; answer [`ServerInput::MovesRead`]. Read it before routing the next
    /// commit if you can: the server holds later commits until it has the answer.
    ReadMoves {
        read: u64,
        table: String,
        conditions: Conditions,
        row_filter: RowFilter,
        limit: u32,
    },
    /// Check the token and the write rules and apply these mutations upstream, in order, each
    /// in its own transaction and at most once (see the module docs); answer
    /// [`ServerInput::MutationsApplied`]. An `Err` is a mutation that could not be read: it is
    /// rejected `invalid` with its reason, and the ones after it still apply.
    ApplyMutations {
        conn: ConnId,
        ticket: u64,
        client_id: String,
        token: Option<String>,
        mutations: Vec<Result<Mutation, InvalidMutation>>,
    },
    /// Read the client's last mutation id the replica holds (once the transaction that
    /// confirmed it was routed) and answer [`ServerInput::Replicated`].
    LookUpReplicated {
        client_id: String,
    },
    Close {
        conn: ConnId,
        code: u16,
        reason: String,
    },
}

/// Where a subscription stands.
#[derive(Debug)]
enum Stage {
    /// Waiting for the authorization decision.
    Authorizing {
        after: Option<SyncCursor>,
        limit: u32,
    },
    /// Replaying; live entries wait in `buffered` until the high-water is pinned.
    Replaying,
    /// Caught up: entries arrive live.
    Live,
}

#[derive(Debug)]
struct Subscription {
    /// Unique across the server: late answers for a retired subscription are ignored.
    ticket: u64,
    resource_type: String,
    conditions: Conditions,
    /// The table's row filter for this subscriber's claims (set by the grant).
    row_filter: Option<RowFilter>,
    table: String,
    omit_columns: Vec<String>,
    expires_at_ms: Option<u64>,
    stage: Stage,
    planner: ReplayPlanner,
    /// The start cursor's seq: live entries at or below it are not sent.
    start_seq: Option<i64>,
    /// The pinned high-water, once the first page came back.
    pinned: Option<i64>,
    /// Live envelopes that arrived before the pin.
    buffered: Vec<Vec<FeedEntry>>,
    /// While replaying: the newest seq sent live per resource id. A replay entry of the same
    /// resource with a lower seq is older than what the client already holds (a row that left
    /// the scope at or below the pin and came back above it), so it is not sent: the client
    /// would otherwise apply the stale removal after the live row.
    sent_live: HashMap<String, i64>,
    /// A page request waiting for room in the outbound budget.
    waiting: Option<PageRequest>,
    done: u64,
    total: Option<u64>,
    indexed: bool,
    /// The highest feed seq the client has been sent, as an entry or a checkpoint.
    told: i64,
    /// When a live checkpoint was last due (set on the first tick after the replay).
    checkpointed_ms: Option<u64>,
    /// The sets of the row filter's own subqueries, in the order its leaves are evaluated.
    sets: Vec<SetId>,
    /// How the subscription is found by a change ([`routes`]); empty: with every change to
    /// its table.
    routes: Vec<Route>,
    /// Waiting for its sets' first reads before its replay starts.
    waiting_sets: bool,
    /// A set changed while it replayed: the replay starts over at its next page.
    restart: bool,
    /// Rows a move sent newer than the commit that moved them: live entries of them at or
    /// below these seqs are older than what the client has.
    newer: HashMap<String, i64>,
}

#[derive(Debug, Default)]
struct Connection {
    subscriptions: BTreeMap<String, Subscription>,
    unflushed: usize,
    over_budget_since: Option<u64>,
    closing: bool,
    writes: writes::ConnWrites,
}

type SubRef = (ConnId, String);

/// Every scope-sync socket of a serving node. See the module docs.
#[derive(Debug)]
pub struct ScopeServer {
    config: ServerConfig,
    connections: HashMap<ConnId, Connection>,
    /// `(table, column, value)` → subscriptions indexed under that condition (or under that
    /// value of a set they are routed by).
    index: RoutingIndex,
    /// Per table: subscriptions without conditions.
    whole_table: HashMap<String, HashSet<SubRef>>,
    /// Per table: the columns subscriptions are indexed under, with counts of entries.
    indexed_columns: IndexedColumns,
    retention_floor: Option<i64>,
    /// The newest feed entry routed (seq, commit time): every live subscription has each
    /// change of its scope up to it.
    routed: Option<(i64, String)>,
    tickets: u64,
    counted: ServerCounts,
    /// Per client with an open socket that writes: its last mutation id the replica holds.
    replicated: HashMap<String, u64>,
    /// The sets of row filters' subqueries.
    sets: SetStore,
    /// Per set: the subscriptions testing it directly, the column tested, and whether the
    /// test is a top-level conjunct of their filter.
    set_subs: HashMap<SetId, Vec<(SubRef, String, bool)>>,
    /// Subscriptions waiting for their sets' first reads.
    waiting: BTreeSet<SubRef>,
    /// The commit being resolved: its sets re-read and its subscriptions' moves read before
    /// it is routed.
    resolving: Option<Resolving>,
    /// Commits that came while one was being resolved, in order.
    queued: VecDeque<Commit>,
}

/// One commit's feed entries and the mutations it confirmed (client id, mutation id).
type Commit = (Vec<FeedEntry>, Vec<(String, u64)>);

/// A commit whose routing waits for reads: the sets above the ones it changed, then the
/// rows it moved into subscriptions' scopes.
#[derive(Debug)]
struct Resolving {
    entries: Vec<FeedEntry>,
    confirms: Vec<(String, u64)>,
    diffs: BTreeMap<SetId, SetDiff>,
    set_reads: BTreeSet<SetId>,
    move_reads: HashMap<u64, SubRef>,
    planned: bool,
    moves: BTreeMap<SubRef, Moves>,
}

/// What a change of access does to one live subscription, sent with the commit that caused
/// it.
#[derive(Debug, Default)]
struct Moves {
    /// Column → values: the client drops its rows of the scope with these values.
    out: Vec<(String, Vec<Value>)>,
    /// Rows let in (or kept in by another path), read after the commit.
    rows: Vec<FeedEntry>,
    /// A read failed or was too large: the subscription replays instead.
    failed: bool,
}

/// What the scope server has counted since it started: the values behind the host's metrics
/// (the host names and renders them; what counts as what is decided here).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerCounts {
    /// Subscriptions granted by the rules.
    pub granted: u64,
    /// Subscriptions refused, by error code (`unauthorized`, `forbidden`, …).
    pub denied: BTreeMap<String, u64>,
    /// Replay pages read and rows sent from them.
    pub replay_pages: u64,
    pub replay_rows: u64,
    /// Live envelopes sent, and the row changes (upserts and removals) they carried.
    pub live_envelopes: u64,
    pub live_rows: u64,
    /// Of `live_rows`, rows that left a scope (deleted, or changed out of its conditions).
    pub live_removals: u64,
    /// Reset markers sent (a cursor that could not be resumed, a truncate).
    pub resets: u64,
    /// Checkpoints sent to quiet live subscriptions.
    pub checkpoints: u64,
    /// Live envelopes that moved rows in or out of a scope as access changed.
    pub moves: u64,
    /// Mutations received in `mutate` frames, and what became of them.
    pub mutations_received: u64,
    pub mutations_applied: u64,
    pub mutations_rejected: u64,
    pub mutations_retried: u64,
}

/// The scope server's counts and what it holds now, for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerMetrics {
    pub counts: ServerCounts,
    pub connections: usize,
    /// Subscriptions by stage: `authorizing`, `replaying`, `live`.
    pub subscriptions: BTreeMap<&'static str, usize>,
    /// The newest feed seq routed to live subscriptions.
    pub routed_seq: Option<i64>,
    /// Sets of row filters' subqueries held for subscriptions.
    pub sets: usize,
}

impl ScopeServer {
    pub fn new(config: ServerConfig) -> Self {
        Self {
            config,
            connections: HashMap::new(),
            index: HashMap::new(),
            whole_table: HashMap::new(),
            indexed_columns: HashMap::new(),
            retention_floor: None,
            routed: None,
            tickets: 0,
            counted: ServerCounts::default(),
            replicated: HashMap::new(),
            sets: SetStore::default(),
            set_subs: HashMap::new(),
            waiting: BTreeSet::new(),
            resolving: None,
            queued: VecDeque::new(),
        }
    }

    /// Counts since the start and the state held now.
    pub fn metrics(&self) -> ServerMetrics {
        let mut subscriptions = BTreeMap::new();
        for connection in self.connections.values() {
            for sub in connection.subscriptions.values() {
                let stage = match sub.stage {
                    Stage::Authorizing { .. } => "authorizing",
                    Stage::Replaying => "replaying",
                    Stage::Live => "live",
                };
                *subscriptions.entry(stage).or_default() += 1;
            }
        }
        ServerMetrics {
            counts: self.counted.clone(),
            connections: self.connections.len(),
            subscriptions,
            routed_seq: self.routed.as_ref().map(|(seq, _)| *seq),
            sets: self.sets.len(),
        }
    }

    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// Open sockets.
    pub fn connections(&self) -> usize {
        self.connections.len()
    }

    /// Subscriptions over all sockets.
    pub fn subscriptions(&self) -> usize {
        self.connections
            .values()
            .map(|c| c.subscriptions.len())
            .sum()
    }

    /// The highest cursor sent to a subscription, if any.
    pub fn delivered_cursor(&self, conn: ConnId, subscription_id: &str) -> Option<&SyncCursor> {
        self.connections
            .get(&conn)?
            .subscriptions
            .get(subscription_id)?
            .planner
            .delivered_cursor()
    }

    /// Feeds one input; returns the effects to carry out, in order.
    pub fn handle(&mut self, input: ServerInput, now_ms: u64) -> Vec<ServerEffect> {
        let mut out = Vec::new();
        match input {
            ServerInput::Opened { conn, session_id } => {
                self.connections.insert(conn, Connection::default());
                self.send(
                    conn,
                    &ServerFrame::SessionEstablished {
                        session_id,
                        grace_seconds: 0,
                    },
                    &mut out,
                );
            }
            ServerInput::Frame { conn, text } => self.frame(conn, &text, &mut out),
            ServerInput::Authorized {
                conn,
                ticket,
                decision,
            } => self.authorized(conn, ticket, decision, &mut out),
            ServerInput::PageFetched {
                conn,
                ticket,
                pass,
                result,
            } => self.page_fetched(conn, ticket, pass, result, &mut out),
            ServerInput::Committed { entries, confirms } => {
                self.committed(entries, confirms, &mut out)
            }
            ServerInput::SetRead { set, result } => self.set_read(set, result, &mut out),
            ServerInput::MovesRead { read, result } => self.moves_read(read, result, &mut out),
            ServerInput::MutationsApplied {
                conn,
                ticket,
                results,
                replicated,
            } => self.mutations_applied(conn, ticket, results, replicated, &mut out),
            ServerInput::Replicated { client_id, last } => {
                self.replicated_up_to(&client_id, last, &mut out)
            }
            ServerInput::Written { conn, bytes } => {
                if let Some(c) = self.connections.get_mut(&conn) {
                    c.unflushed = c.unflushed.saturating_sub(bytes);
                    if c.unflushed < self.config.outbound_budget_bytes {
                        c.over_budget_since = None;
                    }
                }
                self.resume_waiting(conn, &mut out);
            }
            ServerInput::Closed { conn } => self.drop_connection(conn),
            ServerInput::Tick => self.tick(now_ms, &mut out),
            ServerInput::RetentionFloor(floor) => self.retention_floor = floor,
        }
        self.check_budgets(now_ms, &mut out);
        out
    }

    fn frame(&mut self, conn: ConnId, text: &str, out: &mut Vec<ServerEffect>) {
        if !self.connections.contains_key(&conn) {
            return;
        }
        let frame = match ClientFrame::from_json(text) {
            Ok(frame) => frame,
            Err(error) => {
                let frame = ServerFrame::Error {
                    error: error.to_string(),
                    code: Some(codes::BAD_FRAME.to_owned()),
                    retry_after_ms: None,
                };
                self.send(conn, &frame, out);
                return;
            }
        };
        match frame {
            ClientFrame::Ping => self.send(conn, &ServerFrame::Pong, out),
            // No state survives a socket: the client re-subscribes with its own cursors.
            ClientFrame::SessionResume { .. } => self.send(conn, &ServerFrame::SessionGone, out),
            ClientFrame::Metadata { .. } => {}
            ClientFrame::ChannelUnsubscribe { subscription_id } => {
                self.remove_subscription(conn, &subscription_id);
                self.send(
                    conn,
                    &ServerFrame::ChannelUnsubscribed { subscription_id },
                    out,
                );
            }
            ClientFrame::ChannelSubscribe {
                subscription_id,
                channel_type,
                params,
                ..
            } => self.subscribe(conn, subscription_id, &channel_type, &params, out),
            ClientFrame::Mutate {
                client_id,
                token,
                mutations,
            } => self.write_frame(
                conn,
                writes::WriteFrame::Mutate {
                    client_id,
                    token,
                    mutations,
                },
                out,
            ),
            ClientFrame::AwaitMutations { client_id, ids } => {
                self.write_frame(conn, writes::WriteFrame::Await { client_id, ids }, out)
            }
        }
    }

    fn subscribe(
        &mut self,
        conn: ConnId,
        subscription_id: String,
        channel_type: &str,
        params: &Map<String, Value>,
        out: &mut Vec<ServerEffect>,
    ) {
        let refuse = |this: &mut Self, out: &mut Vec<ServerEffect>, code: &str, message: String| {
            this.send(
                conn,
                &ServerFrame::ChannelError {
                    subscription_id: subscription_id.clone(),
                    message,
                    code: Some(code.to_owned()),
                },
                out,
            );
        };
        if channel_type != SYNC_CHANNEL_TYPE {
            let message =
                format!("expected channelType {SYNC_CHANNEL_TYPE:?}, got {channel_type:?}");
            return refuse(self, out, codes::UNKNOWN_CHANNEL, message);
        }
        let Some(connection) = self.connections.get(&conn) else {
            return;
        };
        if connection.subscriptions.contains_key(&subscription_id) {
            let message = format!(
                "expected a subscriptionId not in use on this socket, got {subscription_id:?} again"
            );
            return refuse(self, out, codes::SUBSCRIPTION_IN_USE, message);
        }
        if connection.subscriptions.len() >= self.config.max_subscriptions_per_connection {
            let message = format!(
                "expected at most {} subscriptions on one socket, got one more",
                self.config.max_subscriptions_per_connection
            );
            return refuse(self, out, codes::TOO_MANY_SUBSCRIPTIONS, message);
        }
        let params = match SubscribeParams::from_params(params) {
            Ok(params) => params,
            Err(error) => return refuse(self, out, codes::INVALID_PARAMS, error.to_string()),
        };
        let Some(resource_type) = params.scope.resource_type.clone() else {
            let message = "expected a resourceType (a table name), got none".to_owned();
            return refuse(self, out, codes::INVALID_PARAMS, message);
        };
        // Validated by `SubscribeParams` already.
        let parsed = match Conditions::parse(&params.scope.conditions) {
            Ok(parsed) => parsed,
            Err(error) => return refuse(self, out, codes::INVALID_PARAMS, error.to_string()),
        };
        self.tickets += 1;
        let ticket = self.tickets;
        let limit = params.page_limit();
        out.push(ServerEffect::Authorize {
            conn,
            ticket,
            token: params.authentication_token.clone(),
            resource_type: resource_type.clone(),
            conditions: params.scope.conditions.clone(),
        });
        let subscription = Subscription {
            ticket,
            resource_type,
            conditions: parsed,
            row_filter: None,
            table: String::new(),
            omit_columns: Vec::new(),
            expires_at_ms: None,
            stage: Stage::Authorizing {
                after: params.after.clone(),
                limit,
            },
            planner: ReplayPlanner::new(None, limit),
            start_seq: None,
            pinned: None,
            buffered: Vec::new(),
            sent_live: HashMap::new(),
            waiting: None,
            done: 0,
            total: None,
            indexed: false,
            told: 0,
            checkpointed_ms: None,
            sets: Vec::new(),
            routes: Vec::new(),
            waiting_sets: false,
            restart: false,
            newer: HashMap::new(),
        };
        if let Some(connection) = self.connections.get_mut(&conn) {
            connection
                .subscriptions
                .insert(subscription_id, subscription);
        }
    }

    fn find(&self, conn: ConnId, ticket: u64) -> Option<String> {
        self.connections
            .get(&conn)?
            .subscriptions
            .iter()
            .find(|(_, s)| s.ticket == ticket)
            .map(|(id, _)| id.clone())
    }

    fn authorized(
        &mut self,
        conn: ConnId,
        ticket: u64,
        decision: Decision,
        out: &mut Vec<ServerEffect>,
    ) {
        let Some(id) = self.find(conn, ticket) else {
            return;
        };
        let grant = match decision {
            Decision::Granted(grant) => {
                self.counted.granted += 1;
                grant
            }
            Decision::Denied { code, message } => {
                *self.counted.denied.entry(code.clone()).or_default() += 1;
                self.remove_subscription(conn, &id);
                self.send(
                    conn,
                    &ServerFrame::ChannelError {
                        subscription_id: id,
                        message,
                        code: Some(code),
                    },
                    out,
                );
                return;
            }
        };
        let epoch = self.config.epoch.clone();
        let floor = self
            .retention_floor
            .map(|seq| feed_cursor(&epoch, seq, None));
        let Some(sub) = self.subscription_mut(conn, &id) else {
            return;
        };
        let Stage::Authorizing { after, limit } =
            std::mem::replace(&mut sub.stage, Stage::Replaying)
        else {
            return;
        };
        sub.table = grant.table;
        sub.omit_columns = grant.omit_columns;
        sub.row_filter = grant.row_filter;
        sub.expires_at_ms = grant.expires_at_ms;
        let mut reset = None;
        let start = match after {
            None => None,
            Some(cursor) => match cursor_seq(&epoch, &cursor) {
                Ok(seq) => Some(feed_cursor(&epoch, seq, Some(cursor.updated_at.clone()))),
                Err(reason) => {
                    reset = Some(reason);
                    None
                }
            },
        };
        sub.start_seq = start.as_ref().and_then(|c| c.server_sequence);
        sub.planner = ReplayPlanner::new(start, limit);
        let filter = sub.row_filter.clone();
        let waiting = self.acquire_sets(conn, &id, filter.as_ref(), out);
        self.index_subscription(conn, &id);
        if let Some(reason) = reset {
            self.send_reset(conn, &id, reason, None, out);
        }
        if waiting {
            // The replay starts once its sets are read (`set_read`).
            self.waiting.insert((conn, id));
            return;
        }
        self.begin_pass(conn, &id, floor, out);
    }

    /// Holds the sets of a subscription's row filter (reading new ones); returns whether it
    /// must wait for some to be read.
    fn acquire_sets(
        &mut self,
        conn: ConnId,
        id: &str,
        filter: Option<&RowFilter>,
        out: &mut Vec<ServerEffect>,
    ) -> bool {
        let Some(filter) = filter.filter(|filter| filter.has_sets()) else {
            return false;
        };
        let mut reads = Vec::new();
        let mut held = Vec::new();
        for (column, query, top) in filter.sets() {
            let set = self.sets.acquire(query, &mut reads);
            held.push(set);
            self.set_subs.entry(set).or_default().push((
                (conn, id.to_owned()),
                column.to_owned(),
                top,
            ));
        }
        self.push_set_reads(reads, out);
        let waiting = !held.iter().all(|set| self.sets.ready(*set));
        if let Some(sub) = self.subscription_mut(conn, id) {
            sub.sets = held;
            sub.waiting_sets = waiting;
        }
        waiting
    }

    fn push_set_reads(&mut self, reads: Vec<SetRead>, out: &mut Vec<ServerEffect>) {
        for read in reads {
            out.push(ServerEffect::ReadSet {
                set: read.set,
                table: read.table,
                row_filter: read.filter,
                limit: MAX_SET_ROWS + 1,
            });
        }
    }

    /// A set's whole read came back.
    fn set_read(&mut self, set: SetId, result: PageResult, out: &mut Vec<ServerEffect>) {
        if let Some(resolving) = &mut self.resolving {
            resolving.set_reads.remove(&set);
        }
        let rows = match result {
            PageResult::Rows { up_to, rows, .. } if rows.len() <= MAX_SET_ROWS as usize => {
                Some((up_to, rows))
            }
            PageResult::Rows { .. } => {
                let message = format!(
                    "a subquery of the sync rules selects over {MAX_SET_ROWS} rows for this \
                     token; narrow its WHERE"
                );
                self.fail_holders(set, message, out);
                None
            }
            PageResult::Failed { message } => {
                self.fail_holders(set, message, out);
                None
            }
            PageResult::Truncated => None,
        };
        if let Some((up_to, rows)) = rows {
            let mut reads = Vec::new();
            if let Some((diff, first)) = self.sets.read(set, up_to, &rows, &mut reads) {
                self.route_set_values(set, &diff);
                if !first {
                    if let Some(resolving) = &mut self.resolving {
                        resolving.diffs.entry(set).or_default().then(diff);
                    }
                }
            }
            self.push_set_reads(reads, out);
            self.start_waiting(out);
        }
        self.advance(out);
    }

    /// Ends every subscription that holds a set, directly or through the sets above it.
    fn fail_holders(&mut self, set: SetId, message: String, out: &mut Vec<ServerEffect>) {
        let mut sets = self.sets.ancestors([set]);
        sets.insert(set);
        let holders: BTreeSet<SubRef> = sets
            .iter()
            .flat_map(|set| self.set_subs.get(set).into_iter().flatten())
            .map(|(sub, _, _)| sub.clone())
            .collect();
        for (conn, id) in holders {
            self.fail(conn, &id, codes::INTERNAL, message.clone(), out);
        }
    }

    /// Starts the replays of waiting subscriptions whose sets are all read.
    fn start_waiting(&mut self, out: &mut Vec<ServerEffect>) {
        let ready: Vec<SubRef> = self
            .waiting
            .iter()
            .filter(|(conn, id)| {
                self.connections
                    .get(conn)
                    .and_then(|c| c.subscriptions.get(id))
                    .is_none_or(|sub| sub.sets.iter().all(|set| self.sets.ready(*set)))
            })
            .cloned()
            .collect();
        for (conn, id) in ready {
            self.waiting.remove(&(conn, id.clone()));
            let floor = self
                .retention_floor
                .map(|seq| feed_cursor(&self.config.epoch, seq, None));
            let Some(sub) = self.subscription_mut(conn, &id) else {
                continue;
            };
            sub.waiting_sets = false;
            self.begin_pass(conn, &id, floor, out);
        }
    }

    /// Keeps the routing index of subscriptions routed by a set in step with its values.
    fn route_set_values(&mut self, set: SetId, diff: &SetDiff) {
        if diff.is_empty() {
            return;
        }
        let Some(holders) = self.set_subs.get(&set) else {
            return;
        };
        for ((conn, id), column, _) in holders {
            let Some(sub) = self
                .connections
                .get(conn)
                .and_then(|c| c.subscriptions.get(id))
            else {
                continue;
            };
            let routed = sub
                .routes
                .iter()
                .any(|route| matches!(route, Route::Set(s, c) if *s == set && c == column));
            if !sub.indexed || !routed {
                continue;
            }
            let target = (*conn, id.clone());
            for form in diff.gained.keys() {
                index_add(
                    &mut self.index,
                    &mut self.indexed_columns,
                    &sub.table,
                    column,
                    form.clone(),
                    target.clone(),
                );
            }
            for form in diff.lost.keys() {
                index_remove(
                    &mut self.index,
                    &mut self.indexed_columns,
                    &sub.table,
                    column,
                    form.clone(),
                    &target,
                );
            }
        }
    }

    /// Starts the subscribe pass and carries out its first effects.
    fn begin_pass(
        &mut self,
        conn: ConnId,
        id: &str,
        floor: Option<SyncCursor>,
        out: &mut Vec<ServerEffect>,
    ) {
        let Some(sub) = self.subscription_mut(conn, id) else {
            return;
        };
        let effects = sub.planner.handle(ReplayInput::Begin {
            kind: ReplayKind::Subscribe,
            retention_floor: floor,
        });
        self.replay_effects(conn, id, effects, out);
    }

    fn replay_effects(
        &mut self,
        conn: ConnId,
        id: &str,
        effects: Result<Vec<ReplayEffect>, crate::scope_sync::replay::ReplayError>,
        out: &mut Vec<ServerEffect>,
    ) {
        let effects = match effects {
            Ok(effects) => effects,
            Err(error) => return self.fail(conn, id, codes::INTERNAL, error.to_string(), out),
        };
        for effect in effects {
            match effect {
                ReplayEffect::Reset { envelope, .. } => {
                    self.counted.resets += 1;
                    if let Some(sub) = self.subscription_mut(conn, id) {
                        sub.start_seq = None;
                        sub.sent_live.clear();
                    }
                    let text = message_text(id, &envelope);
                    self.send_text(conn, text, out);
                }
                ReplayEffect::FetchPage(request) => {
                    if let Some(sub) = self.subscription_mut(conn, id) {
                        sub.waiting = Some(request);
                    }
                    self.resume_waiting(conn, out);
                }
                ReplayEffect::SendEnvelope { mut envelope, .. } => {
                    self.counted.replay_rows += envelope.syncs.len() as u64;
                    let Some(sub) = self.subscription_mut(conn, id) else {
                        return;
                    };
                    sub.done += envelope.syncs.len() as u64;
                    if let Some(seq) = envelope
                        .syncs
                        .iter()
                        .filter_map(|e| e.server_sequence)
                        .max()
                    {
                        sub.told = sub.told.max(seq);
                    }
                    if !sub.sent_live.is_empty() {
                        let sent_live = &sub.sent_live;
                        envelope.syncs.retain(|entry| {
                            let newer_live = entry
                                .resource_id
                                .as_ref()
                                .and_then(|key| sent_live.get(key));
                            match (newer_live, entry.server_sequence) {
                                (Some(live), Some(seq)) => seq > *live,
                                _ => true,
                            }
                        });
                    }
                    envelope.extra.insert(
                        "progress".to_owned(),
                        // Removals are not in the first page's count: never report more done than total.
                        json!({"done": sub.done, "total": sub.total.unwrap_or(0).max(sub.done)}),
                    );
                    let text = message_text(id, &envelope);
                    self.send_text(conn, text, out);
                }
                ReplayEffect::Finished { .. } => {
                    let routed = self.routed.clone();
                    let epoch = self.config.epoch.clone();
                    let mut checkpoint = None;
                    if let Some(sub) = self.subscription_mut(conn, id) {
                        sub.stage = Stage::Live;
                        sub.sent_live = HashMap::new();
                        // Caught up to the pin, and to every entry routed since (live ones
                        // above the pin were sent): the client's cursor may stand there.
                        let pinned = sub.pinned.unwrap_or(0);
                        let through = match &routed {
                            Some((seq, at)) if *seq >= pinned => Some((*seq, Some(at.clone()))),
                            _ if pinned > 0 => Some((pinned, None)),
                            _ => None,
                        };
                        if let Some((seq, at)) = through.filter(|(seq, _)| *seq > sub.told) {
                            sub.told = seq;
                            checkpoint =
                                Some(SyncEnvelope::checkpoint(&feed_cursor(&epoch, seq, at)));
                        }
                    }
                    if let Some(envelope) = checkpoint {
                        self.send_checkpoint(conn, id, envelope, out);
                    }
                    self.send(
                        conn,
                        &ServerFrame::ChannelSubscribed {
                            subscription_id: id.to_owned(),
                        },
                        out,
                    );
                    // Results held back for this replay may go now.
                    self.flush_results(conn, out);
                }
            }
        }
    }

    /// Requests the waiting replay pages of `conn` while its socket has room.
    fn resume_waiting(&mut self, conn: ConnId, out: &mut Vec<ServerEffect>) {
        let budget = self.config.outbound_budget_bytes;
        let Some(connection) = self.connections.get_mut(&conn) else {
            return;
        };
        if connection.closing || connection.unflushed >= budget {
            return;
        }
        for sub in connection.subscriptions.values_mut() {
            let Some(request) = sub.waiting.take() else {
                continue;
            };
            out.push(ServerEffect::FetchPage {
                conn,
                ticket: sub.ticket,
                pass: request.pass,
                table: sub.table.clone(),
                conditions: sub.conditions.clone(),
                row_filter: sub.row_filter.clone(),
                after: request.after.as_ref().and_then(|c| c.server_sequence),
                up_to: request.up_to.as_ref().and_then(|c| c.server_sequence),
                limit: request.limit,
                count_total: request.up_to.is_none() && sub.pinned.is_none(),
                access: match (&sub.row_filter, sub.start_seq, sub.pinned) {
                    (Some(filter), Some(_), None) => filter
                        .sets()
                        .into_iter()
                        .map(|(_, set, _)| set.clone())
                        .collect(),
                    _ => Vec::new(),
                },
            });
        }
    }

    fn page_fetched(
        &mut self,
        conn: ConnId,
        ticket: u64,
        pass: u64,
        result: PageResult,
        out: &mut Vec<ServerEffect>,
    ) {
        let Some(id) = self.find(conn, ticket) else {
            return;
        };
        let epoch = self.config.epoch.clone();
        // Exits after the cursor were pruned while the replay ran: this page (and earlier
        // ones) may lack removals the client needs. Start over, as for a cursor below the
        // floor at subscribe time.
        // The floor the page's own read saw counts too: the host hands a new floor over after
        // the prune commits, and a page read in between would otherwise pass a cursor whose
        // exits are gone.
        if let PageResult::Rows { floor, .. } = &result {
            self.counted.replay_pages += 1;
            if let Some(seen) = floor {
                self.retention_floor = self.retention_floor.max(Some(*seen));
            }
        }
        let floor = self.retention_floor;
        let past_floor = self.subscription_mut(conn, &id).is_some_and(|sub| {
            matches!(sub.stage, Stage::Replaying)
                && sub
                    .start_seq
                    .zip(floor)
                    .is_some_and(|(start, floor)| floor > start)
        });
        if past_floor && matches!(result, PageResult::Rows { .. }) {
            return self.replay_from_scratch(conn, &id, "cursor-before-retention", out);
        }
        // Which rows the token may see changed since the cursor (a membership, a moved
        // parent row), or while this replay ran: rows that moved in have older seqs than the
        // cursor, and rows that moved out left no exit. The replay starts over, and the
        // client keeps its rows until it ends.
        let access_changed = matches!(
            result,
            PageResult::Rows {
                access_changed: true,
                ..
            }
        );
        let restart = self
            .subscription_mut(conn, &id)
            .is_some_and(|sub| std::mem::take(&mut sub.restart));
        if (access_changed || restart) && matches!(result, PageResult::Rows { .. }) {
            return self.replay_from_scratch(conn, &id, "access-changed", out);
        }
        match result {
            PageResult::Failed { message } => self.fail(conn, &id, codes::INTERNAL, message, out),
            PageResult::Truncated => self.replay_from_scratch(conn, &id, "table-truncated", out),
            PageResult::Rows {
                up_to, rows, total, ..
            } => {
                let sets = &self.sets;
                let Some(sub) = self
                    .connections
                    .get_mut(&conn)
                    .and_then(|c| c.subscriptions.get_mut(&id))
                else {
                    return;
                };
                let first = sub.pinned.is_none();
                if first {
                    sub.pinned = Some(up_to);
                    sub.total = total;
                }
                let entries = rows
                    .into_iter()
                    .filter_map(|row| replay_entry_for(&epoch, sub, sets, row))
                    .collect();
                let page = FetchedPage {
                    pass,
                    up_to: (up_to > 0).then(|| feed_cursor(&epoch, up_to, None)),
                    rows: entries,
                };
                let effects = sub.planner.handle(ReplayInput::PageFetched(page));
                let buffered = if first {
                    std::mem::take(&mut sub.buffered)
                } else {
                    Vec::new()
                };
                self.replay_effects(conn, &id, effects, out);
                for entries in buffered {
                    self.deliver_live(conn, &id, &entries, None, None, out);
                }
            }
        }
    }

    /// Sends a reset marker and replays the whole scope, with the page just answered consumed
    /// (so no page of the old pass is in flight).
    fn replay_from_scratch(
        &mut self,
        conn: ConnId,
        id: &str,
        reason: &str,
        out: &mut Vec<ServerEffect>,
    ) {
        let Some(sub) = self.subscription_mut(conn, id) else {
            return;
        };
        let limit = sub.planner.limit();
        sub.planner = ReplayPlanner::new(None, limit);
        sub.start_seq = None;
        sub.pinned = None;
        sub.done = 0;
        sub.total = None;
        // The client drops every row of the scope at the reset marker, the ones sent live
        // too: the full replay must not leave them out as already sent.
        sub.sent_live.clear();
        self.send_reset(conn, id, reason, None, out);
        self.begin_pass(conn, id, None, out);
    }

    /// Routes one committed transaction to the subscriptions it reaches, once the sets it
    /// changed and the rows it moved have been read; a commit that comes meanwhile waits its
    /// turn.
    fn committed(
        &mut self,
        entries: Vec<FeedEntry>,
        confirms: Vec<(String, u64)>,
        out: &mut Vec<ServerEffect>,
    ) {
        if self.resolving.is_some() || !self.queued.is_empty() {
            self.queued.push_back((entries, confirms));
            return;
        }
        self.resolve(entries, confirms, out);
        self.advance(out);
    }

    /// Applies a commit to the sets and asks to read the sets above the ones it changed.
    fn resolve(
        &mut self,
        entries: Vec<FeedEntry>,
        confirms: Vec<(String, u64)>,
        out: &mut Vec<ServerEffect>,
    ) {
        let diffs = self.sets.apply(&entries);
        for (set, diff) in &diffs {
            self.route_set_values(*set, diff);
        }
        let mut reads = Vec::new();
        let mut set_reads = BTreeSet::new();
        for set in self.sets.ancestors(diffs.keys().copied()) {
            if self.sets.reread(set, &mut reads) {
                set_reads.insert(set);
            }
        }
        self.push_set_reads(reads, out);
        self.resolving = Some(Resolving {
            entries,
            confirms,
            diffs,
            set_reads,
            move_reads: HashMap::new(),
            planned: false,
            moves: BTreeMap::new(),
        });
    }

    /// Moves the commit being resolved on as far as its answers allow: plans its moves once
    /// its sets are read, routes it once its moves are read, then takes the next commit.
    fn advance(&mut self, out: &mut Vec<ServerEffect>) {
        loop {
            let Some(resolving) = &mut self.resolving else {
                return;
            };
            if !resolving.set_reads.is_empty() || !resolving.move_reads.is_empty() {
                return;
            }
            if !resolving.planned {
                resolving.planned = true;
                self.plan_moves(out);
                continue;
            }
            let Some(resolving) = self.resolving.take() else {
                return;
            };
            self.route(
                &resolving.entries,
                &resolving.confirms,
                resolving.moves,
                out,
            );
            match self.queued.pop_front() {
                Some((entries, confirms)) => self.resolve(entries, confirms, out),
                None => return,
            }
        }
    }

    /// What the commit's set changes do to each subscription testing those sets: a live one
    /// drops the rows of values that left (and is sent the rows of values that came, read
    /// now); a replaying one starts its replay over.
    fn plan_moves(&mut self, out: &mut Vec<ServerEffect>) {
        let Some(resolving) = &self.resolving else {
            return;
        };
        let mut wanted: BTreeMap<SubRef, Vec<(String, Vec<Value>)>> = BTreeMap::new();
        let mut outs: BTreeMap<SubRef, Vec<(String, Vec<Value>)>> = BTreeMap::new();
        for (set, diff) in &resolving.diffs {
            for (sub, column, top) in self.set_subs.get(set).into_iter().flatten() {
                let lost: Vec<Value> = diff.lost.values().cloned().collect();
                let mut read: Vec<Value> = diff.gained.values().cloned().collect();
                if !top {
                    // Another path of the filter may keep a row of a lost value in.
                    read.extend(lost.iter().cloned());
                }
                if !lost.is_empty() {
                    outs.entry(sub.clone())
                        .or_default()
                        .push((column.clone(), lost));
                }
                if !read.is_empty() {
                    wanted
                        .entry(sub.clone())
                        .or_default()
                        .push((column.clone(), read));
                }
            }
        }
        let subs: BTreeSet<SubRef> = wanted.keys().chain(outs.keys()).cloned().collect();
        for (conn, id) in subs {
            let Some(sub) = self
                .connections
                .get_mut(&conn)
                .and_then(|c| c.subscriptions.get_mut(&id))
            else {
                continue;
            };
            match sub.stage {
                Stage::Live => {}
                Stage::Replaying if !sub.waiting_sets => {
                    sub.restart = true;
                    continue;
                }
                // Its replay has not started: it reads the sets as they are now.
                _ => continue,
            }
            let moves = Moves {
                out: outs.remove(&(conn, id.clone())).unwrap_or_default(),
                ..Moves::default()
            };
            let mut reads = Vec::new();
            for (column, values) in wanted.remove(&(conn, id.clone())).unwrap_or_default() {
                let Some(filter) = &sub.row_filter else {
                    continue;
                };
                reads.push(ServerEffect::ReadMoves {
                    read: 0,
                    table: sub.table.clone(),
                    conditions: sub.conditions.clone(),
                    row_filter: filter.and_in(&column, values),
                    limit: MAX_SET_ROWS + 1,
                });
            }
            if reads.is_empty() && moves.out.is_empty() {
                continue;
            }
            let Some(resolving) = &mut self.resolving else {
                return;
            };
            for mut read in reads {
                self.tickets += 1;
                if let ServerEffect::ReadMoves { read: ticket, .. } = &mut read {
                    *ticket = self.tickets;
                }
                resolving
                    .move_reads
                    .insert(self.tickets, (conn, id.clone()));
                out.push(read);
            }
            resolving.moves.insert((conn, id), moves);
        }
    }

    /// A move's read came back.
    fn moves_read(&mut self, read: u64, result: PageResult, out: &mut Vec<ServerEffect>) {
        let Some(resolving) = &mut self.resolving else {
            return;
        };
        let Some(sub) = resolving.move_reads.remove(&read) else {
            return;
        };
        if let Some(moves) = resolving.moves.get_mut(&sub) {
            match result {
                PageResult::Rows { rows, .. } if rows.len() <= MAX_SET_ROWS as usize => {
                    moves.rows.extend(rows);
                }
                _ => moves.failed = true,
            }
        }
        self.advance(out);
    }

    /// Sends a resolved commit: its entries to the subscriptions they reach, with each
    /// subscription's moves.
    fn route(
        &mut self,
        entries: &[FeedEntry],
        confirms: &[(String, u64)],
        mut moves: BTreeMap<SubRef, Moves>,
        out: &mut Vec<ServerEffect>,
    ) {
        let echoes = self.note_confirms(confirms);
        if let Some(last) = entries.iter().max_by_key(|entry| entry.seq) {
            if self.routed.as_ref().is_none_or(|(seq, _)| last.seq > *seq) {
                self.routed = Some((last.seq, last.updated_at.clone()));
            }
        }
        let mut reached: BTreeMap<SubRef, Vec<FeedEntry>> = BTreeMap::new();
        for entry in entries {
            for target in self.candidates(entry) {
                reached.entry(target).or_default().push(entry.clone());
            }
        }
        for target in moves.keys() {
            reached.entry(target.clone()).or_default();
        }
        for ((conn, id), entries) in reached {
            let echo = echoes
                .iter()
                .find(|(c, _)| *c == conn)
                .map(|(_, echo)| echo.clone());
            let moved = moves.remove(&(conn, id.clone()));
            if moved.as_ref().is_some_and(|moved| moved.failed) {
                self.deliver_live(conn, &id, &entries, echo, None, out);
                self.replay_live_again(conn, &id, out);
                continue;
            }
            self.deliver_live(conn, &id, &entries, echo, moved, out);
        }
        for (conn, _) in echoes {
            self.flush_results(conn, out);
        }
    }

    /// The lowest mutation id of `client` confirmed by a commit not routed yet (being resolved,
    /// or waiting its turn).
    fn confirm_held(&self, client: &str) -> Option<u64> {
        self.resolving
            .iter()
            .map(|resolving| &resolving.confirms)
            .chain(self.queued.iter().map(|(_, confirms)| confirms))
            .flatten()
            .filter(|(held_by, _)| held_by == client)
            .map(|(_, id)| *id)
            .min()
    }

    /// A live subscription whose move could not be read replays its scope from scratch.
    fn replay_live_again(&mut self, conn: ConnId, id: &str, out: &mut Vec<ServerEffect>) {
        let Some(sub) = self.subscription_mut(conn, id) else {
            return;
        };
        sub.stage = Stage::Replaying;
        self.replay_from_scratch(conn, id, "access-changed", out);
    }

    /// Subscriptions an entry may reach: looked up by its routing values, one index probe per
    /// indexed column of its table; each once.
    fn candidates(&self, entry: &FeedEntry) -> Vec<SubRef> {
        let values = match &entry.change {
            FeedChange::Upsert { data } => data,
            FeedChange::Exit { old, .. } => old,
        };
        let mut found: Vec<SubRef> = Vec::new();
        if let Some(subs) = self.whole_table.get(&entry.table) {
            found.extend(subs.iter().cloned());
        }
        if let Some(columns) = self.indexed_columns.get(&entry.table) {
            for column in columns.keys() {
                let Some(value) = values.get(column) else {
                    continue;
                };
                let key = (entry.table.clone(), column.clone(), routing_form(value));
                if let Some(subs) = self.index.get(&key) {
                    found.extend(subs.iter().cloned());
                }
            }
        }
        // A subscription with several routes (a filter's OR) may be found by more than one.
        if found.len() > 1 {
            found.sort_unstable();
            found.dedup();
        }
        found
    }

    /// Sends the entries of one transaction that belong to a subscription's scope as one live
    /// envelope, unless its replay covers them; with its moves, if the transaction moved rows
    /// in or out of the scope.
    fn deliver_live(
        &mut self,
        conn: ConnId,
        id: &str,
        entries: &[FeedEntry],
        echo: Option<Echo>,
        moves: Option<Moves>,
        out: &mut Vec<ServerEffect>,
    ) {
        let epoch = self.config.epoch.clone();
        let max_buffered = self.config.max_buffered_live;
        let routed = self.routed.clone();
        let sets = &self.sets;
        let Some(sub) = self
            .connections
            .get_mut(&conn)
            .and_then(|c| c.subscriptions.get_mut(id))
        else {
            return;
        };
        if matches!(sub.stage, Stage::Authorizing { .. }) {
            return;
        }
        let Some(pinned) = sub.pinned else {
            if entries.is_empty() {
                return;
            }
            if sub.buffered.len() >= max_buffered {
                return self.close(conn, SLOW_CONSUMER_CLOSE_CODE, SLOW_CONSUMER_REASON, out);
            }
            sub.buffered.push(entries.to_vec());
            return;
        };
        let floor = pinned.max(sub.start_seq.unwrap_or(0));
        let newer = &sub.newer;
        let mut syncs: Vec<SyncEntry> = entries
            .iter()
            .filter(|entry| entry.seq > floor)
            .filter(|entry| {
                newer
                    .get(&entry.resource_id)
                    .is_none_or(|newer| entry.seq > *newer)
            })
            .filter_map(|entry| entry_for(&epoch, sub, sets, entry))
            .collect();
        // This commit's entries have been checked against what moves sent: those of rows at
        // or below it are older than any later entry.
        if let Some((seq, _)) = &routed {
            sub.newer.retain(|_, newer| *newer > *seq);
        }
        let mut extra = Map::new();
        if let Some(moves) = moves {
            // Rows let in carry their own seqs, which may be older or newer than the commit:
            // the envelope's cursor is the commit's, and the client's cursor moves to it.
            let sent: HashMap<String, i64> = syncs
                .iter()
                .filter_map(|entry| Some((entry.resource_id.clone()?, entry.server_sequence?)))
                .collect();
            for row in &moves.rows {
                // The commit's own entry of the row is as new (the read came after it).
                if sent
                    .get(&row.resource_id)
                    .is_some_and(|seq| *seq >= row.seq)
                {
                    continue;
                }
                if let FeedChange::Upsert { data } = &row.change {
                    if let Some(entry) = upsert_entry(&epoch, sub, row, data) {
                        syncs.push(entry);
                    }
                }
                if let Some((seq, _)) = &routed {
                    if row.seq > *seq {
                        sub.newer.insert(row.resource_id.clone(), row.seq);
                    }
                }
            }
            let out_list: Vec<Value> = moves
                .out
                .iter()
                .map(|(column, values)| json!({"column": column, "values": values}))
                .collect();
            if syncs.is_empty() && out_list.is_empty() {
                return;
            }
            extra.insert(MOVES_KEY.to_owned(), json!({"out": out_list}));
            if let Some((seq, at)) = &routed {
                let cursor = feed_cursor(&epoch, *seq, Some(at.clone()));
                extra.insert(CURSOR_KEY.to_owned(), json!(cursor));
                sub.told = sub.told.max(*seq);
            }
            self.counted.moves += 1;
        }
        if syncs.is_empty() && extra.is_empty() {
            return;
        }
        if matches!(sub.stage, Stage::Replaying) {
            for entry in &syncs {
                if let (Some(key), Some(seq)) = (&entry.resource_id, entry.server_sequence) {
                    let newest = sub.sent_live.entry(key.clone()).or_insert(seq);
                    *newest = (*newest).max(seq);
                }
            }
        }
        if extra.is_empty() {
            if let Some(seq) = syncs.iter().filter_map(|e| e.server_sequence).max() {
                sub.told = sub.told.max(seq);
            }
        }
        let removals = syncs.iter().filter(|entry| entry.is_delete()).count() as u64;
        let rows = syncs.len() as u64;
        let mut envelope = SyncEnvelope::new(None, syncs).with_echo(echo);
        envelope.extra.extend(extra);
        let _ = sub.planner.handle(ReplayInput::Delivered {
            envelope: envelope.clone(),
        });
        self.counted.live_envelopes += 1;
        self.counted.live_rows += rows;
        self.counted.live_removals += removals;
        let text = message_text(id, &envelope);
        self.send_text(conn, text, out);
    }

    /// Sends a [`CURSOR_KEY`](crate::scope_sync::CURSOR_KEY) checkpoint envelope, counted as delivered.
    fn send_checkpoint(
        &mut self,
        conn: ConnId,
        id: &str,
        envelope: SyncEnvelope,
        out: &mut Vec<ServerEffect>,
    ) {
        self.counted.checkpoints += 1;
        let Some(sub) = self.subscription_mut(conn, id) else {
            return;
        };
        let _ = sub.planner.handle(ReplayInput::Delivered {
            envelope: envelope.clone(),
        });
        let text = message_text(id, &envelope);
        self.send_text(conn, text, out);
    }

    /// Tells live subscriptions that have not heard of the feed for a checkpoint interval how
    /// far it has moved (their scopes were quiet meanwhile).
    fn checkpoints(&mut self, now_ms: u64, out: &mut Vec<ServerEffect>) {
        let Some((routed, at)) = self.routed.clone() else {
            return;
        };
        let interval = self.config.checkpoint_interval_ms;
        let budget = self.config.outbound_budget_bytes;
        let epoch = self.config.epoch.clone();
        let mut due = Vec::new();
        for (conn, connection) in &mut self.connections {
            if connection.closing || connection.unflushed >= budget {
                continue;
            }
            for (id, sub) in &mut connection.subscriptions {
                if !matches!(sub.stage, Stage::Live) {
                    continue;
                }
                let since = *sub.checkpointed_ms.get_or_insert(now_ms);
                if sub.told < routed && now_ms.saturating_sub(since) >= interval {
                    sub.told = routed;
                    sub.checkpointed_ms = Some(now_ms);
                    due.push((*conn, id.clone()));
                }
            }
        }
        for (conn, id) in due {
            let cursor = feed_cursor(&epoch, routed, Some(at.clone()));
            self.send_checkpoint(conn, &id, SyncEnvelope::checkpoint(&cursor), out);
        }
    }

    fn send_reset(
        &mut self,
        conn: ConnId,
        id: &str,
        reason: &str,
        floor: Option<i64>,
        out: &mut Vec<ServerEffect>,
    ) {
        self.counted.resets += 1;
        let epoch = self.config.epoch.clone();
        let mut envelope = reset_envelope(&feed_cursor(&epoch, floor.unwrap_or(0), None));
        envelope.extra.insert(
            RESET_KEY.to_owned(),
            json!({"reason": reason, "epoch": epoch}),
        );
        let text = message_text(id, &envelope);
        self.send_text(conn, text, out);
    }

    fn fail(
        &mut self,
        conn: ConnId,
        id: &str,
        code: &str,
        message: String,
        out: &mut Vec<ServerEffect>,
    ) {
        self.remove_subscription(conn, id);
        self.send(
            conn,
            &ServerFrame::ChannelError {
                subscription_id: id.to_owned(),
                message,
                code: Some(code.to_owned()),
            },
            out,
        );
    }

    fn tick(&mut self, now_ms: u64, out: &mut Vec<ServerEffect>) {
        let mut expired = Vec::new();
        for (conn, connection) in &self.connections {
            for (id, sub) in &connection.subscriptions {
                if sub.expires_at_ms.is_some_and(|at| at <= now_ms) {
                    expired.push((*conn, id.clone()));
                }
            }
        }
        for (conn, id) in expired {
            let message = "expected a token valid now, got one that expired".to_owned();
            self.fail(conn, &id, codes::AUTH_EXPIRED, message, out);
        }
        self.checkpoints(now_ms, out);
    }

    /// Closes sockets over their hard limit, or over their budget for too long.
    fn check_budgets(&mut self, now_ms: u64, out: &mut Vec<ServerEffect>) {
        let mut slow = Vec::new();
        for (conn, c) in &mut self.connections {
            if c.closing {
                continue;
            }
            if c.unflushed >= self.config.outbound_budget_bytes {
                let since = *c.over_budget_since.get_or_insert(now_ms);
                if c.unflushed >= self.config.outbound_hard_limit_bytes
                    || now_ms.saturating_sub(since) >= self.config.slow_consumer_timeout_ms
                {
                    slow.push(*conn);
                }
            }
        }
        for conn in slow {
            self.close(conn, SLOW_CONSUMER_CLOSE_CODE, SLOW_CONSUMER_REASON, out);
        }
    }

    fn close(&mut self, conn: ConnId, code: u16, reason: &str, out: &mut Vec<ServerEffect>) {
        let Some(c) = self.connections.get_mut(&conn) else {
            return;
        };
        if c.closing {
            return;
        }
        c.closing = true;
        out.push(ServerEffect::Close {
            conn,
            code,
            reason: reason.to_owned(),
        });
        self.drop_connection(conn);
    }

    fn drop_connection(&mut self, conn: ConnId) {
        let ids: Vec<String> = self
            .connections
            .get(&conn)
            .map(|c| c.subscriptions.keys().cloned().collect())
            .unwrap_or_default();
        for id in ids {
            self.remove_subscription(conn, &id);
        }
        let writer = self
            .connections
            .remove(&conn)
            .and_then(|c| c.writes.client_id().map(str::to_owned));
        self.forget_writer(writer);
        // Tables sized for a burst of connections give their memory back once it is over.
        shrink_when_sparse(&mut self.connections);
        shrink_when_sparse(&mut self.index);
        shrink_when_sparse(&mut self.whole_table);
    }

    fn subscription_mut(&mut self, conn: ConnId, id: &str) -> Option<&mut Subscription> {
        self.connections.get_mut(&conn)?.subscriptions.get_mut(id)
    }

    /// Indexes a subscription under its routes ([`routes`]), or in its table's table-wide
    /// list when it has none.
    fn index_subscription(&mut self, conn: ConnId, id: &str) {
        let Some(sub) = self
            .connections
            .get_mut(&conn)
            .and_then(|c| c.subscriptions.get_mut(id))
        else {
            return;
        };
        sub.indexed = true;
        sub.routes = routes(&sub.conditions, sub.row_filter.as_ref(), &sub.sets);
        let table = sub.table.clone();
        let target = (conn, id.to_owned());
        if sub.routes.is_empty() {
            self.whole_table.entry(table).or_default().insert(target);
            return;
        }
        for route in sub.routes.clone() {
            let (column, forms) = match route {
                Route::Value(column, form) => (column, vec![form]),
                Route::Set(set, column) => (column, self.sets.forms(set)),
            };
            for form in forms {
                index_add(
                    &mut self.index,
                    &mut self.indexed_columns,
                    &table,
                    &column,
                    form,
                    target.clone(),
                );
            }
        }
    }

    fn remove_subscription(&mut self, conn: ConnId, id: &str) {
        let Some(sub) = self
            .connections
            .get_mut(&conn)
            .and_then(|c| c.subscriptions.remove(id))
        else {
            return;
        };
        let target = (conn, id.to_owned());
        self.waiting.remove(&target);
        if sub.indexed && sub.routes.is_empty() {
            if let Some(set) = self.whole_table.get_mut(&sub.table) {
                set.remove(&target);
                shrink_set_when_sparse(set);
                if set.is_empty() {
                    self.whole_table.remove(&sub.table);
                }
            }
        }
        if sub.indexed {
            for route in &sub.routes {
                let (column, forms) = match route {
                    Route::Value(column, form) => (column, vec![form.clone()]),
                    Route::Set(set, column) => (column, self.sets.forms(*set)),
                };
                for form in forms {
                    index_remove(
                        &mut self.index,
                        &mut self.indexed_columns,
                        &sub.table,
                        column,
                        form,
                        &target,
                    );
                }
            }
        }
        for set in &sub.sets {
            if let Some(holders) = self.set_subs.get_mut(set) {
                holders.retain(|(held_by, _, _)| *held_by != target);
                if holders.is_empty() {
                    self.set_subs.remove(set);
                }
            }
            self.sets.release(*set);
        }
    }

    fn send(&mut self, conn: ConnId, frame: &ServerFrame, out: &mut Vec<ServerEffect>) {
        self.send_text(conn, frame.to_json(), out);
    }

    fn send_text(&mut self, conn: ConnId, text: String, out: &mut Vec<ServerEffect>) {
        let Some(c) = self.connections.get_mut(&conn) else {
            return;
        };
        if c.closing {
            return;
        }
        c.unflushed += text.len();
        out.push(ServerEffect::Send { conn, text });
    }
}

/// The `channel-message` text of an envelope: [`ServerFrame::ChannelMessage`]'s, with the
/// envelope written straight into it rather than copied into a [`Value`] first (a replay page
/// holds a thousand rows).
fn message_text(id: &str, envelope: &SyncEnvelope) -> String {
    #[derive(serde::Serialize)]
    struct Message<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        #[serde(rename = "subscriptionId")]
        subscription_id: &'a str,
        body: &'a SyncEnvelope,
    }
    serde_json::to_string(&Message {
        kind: "channel-message",
        subscription_id: id,
        body: envelope,
    })
    .unwrap_or_default()
}

/// A feed position as a cursor: id `"<epoch>:<seq>"`.
fn feed_cursor(epoch: &str, seq: i64, updated_at: Option<String>) -> SyncCursor {
    SyncCursor::new(
        Some(format!("{epoch}:{seq}")),
        Some(seq),
        updated_at.unwrap_or_else(|| "1970-01-01T00:00:00.000Z".to_owned()),
    )
}

/// The seq a client cursor resumes after, or why it cannot be resumed (a reset reason).
fn cursor_seq(epoch: &str, cursor: &SyncCursor) -> Result<i64, &'static str> {
    let Some((cursor_epoch, seq)) = cursor.id.as_deref().and_then(|id| id.rsplit_once(':')) else {
        return Err("cursor-without-epoch");
    };
    if cursor_epoch != epoch {
        return Err("replica-version-changed");
    }
    let seq: i64 = seq.parse().map_err(|_| "cursor-without-epoch")?;
    match cursor.server_sequence {
        Some(sequence) if sequence != seq => Err("cursor-without-epoch"),
        _ if seq < 0 => Err("cursor-without-epoch"),
        _ => Ok(seq),
    }
}

/// The text a routing value is indexed and looked up by (`scope-sync.md`, "Conditions"). Values that [`Conditions`] finds
/// equal have equal forms (`5`, `5.0` and `"5"`; an ISO timestamp and its milliseconds), so
/// the index never misses a subscription; the few it finds in excess are matched away.
pub fn routing_form(value: &Value) -> String {
    match value {
        Value::String(text) => operand_number(value).map_or_else(
            || text.clone(),
            |number| js_string_form(&Value::Number(number)),
        ),
        other => js_string_form(other),
    }
}

/// The wire entry of a feed entry for one subscription, if it belongs to its scope: an upsert
/// matching the conditions, or an exit from them. Omitted columns are left out of `data`.
fn entry_for(
    epoch: &str,
    sub: &Subscription,
    sets: &SetStore,
    entry: &FeedEntry,
) -> Option<SyncEntry> {
    if entry.table != sub.table {
        return None;
    }
    match &entry.change {
        FeedChange::Upsert { data } => {
            if !sub.belongs(data, sets) {
                return None;
            }
            upsert_entry(epoch, sub, entry, data)
        }
        FeedChange::Exit { old, new } => {
            let leaves =
                feed::exit_leaves(old, new.as_ref(), |values| Some(sub.belongs(values, sets)));
            if !leaves {
                return None;
            }
            wire_entry(epoch, sub, entry, "delete", Value::Null, old)
        }
    }
}

/// The wire entry of a replayed row or exit, taking the row it reads (a page's rows are
/// sent once, so the row moves into the entry instead of being copied). The replica's read
/// is the judge of a row filter with subqueries: it read the sets in the same transaction as
/// the rows, while the server's sets may trail it (one being read again). Matching such rows
/// again here would drop rows the read rightly found, and a page with fewer rows than asked
/// for ends the replay. The conditions, which need no set, are still matched again.
fn replay_entry_for(
    epoch: &str,
    sub: &Subscription,
    sets: &SetStore,
    entry: FeedEntry,
) -> Option<SyncEntry> {
    if entry.table != sub.table {
        return None;
    }
    let read_judged = !sub.sets.is_empty();
    let FeedEntry {
        resource_id,
        seq,
        updated_at,
        change,
        ..
    } = entry;
    let head = EntryHead {
        resource_id: &resource_id,
        seq,
        updated_at: &updated_at,
    };
    match change {
        FeedChange::Upsert { mut data } => {
            let held = if read_judged {
                sub.conditions.matches(&data)
            } else {
                sub.belongs(&data, sets)
            };
            if !held {
                return None;
            }
            let extra = scope_attributes(sub, &data);
            data.retain(|key, _| !sub.omit_columns.contains(key));
            Some(head.entry(epoch, sub, "update", Value::Object(data), extra))
        }
        FeedChange::Exit { old, new } => {
            let leaves = if read_judged {
                sub.conditions.matches(&old)
            } else {
                feed::exit_leaves(&old, new.as_ref(), |values| Some(sub.belongs(values, sets)))
            };
            if !leaves {
                return None;
            }
            let extra = scope_attributes(sub, &old);
            Some(head.entry(epoch, sub, "delete", Value::Null, extra))
        }
    }
}

/// The wire entry of a row as it now is, omitted columns left out.
fn upsert_entry(
    epoch: &str,
    sub: &Subscription,
    entry: &FeedEntry,
    data: &Map<String, Value>,
) -> Option<SyncEntry> {
    let mut sent = data.clone();
    sent.retain(|key, _| !sub.omit_columns.contains(key));
    wire_entry(epoch, sub, entry, "update", Value::Object(sent), data)
}

/// What an entry says of its feed row besides the row: its key, position and commit time.
struct EntryHead<'a> {
    resource_id: &'a str,
    seq: i64,
    updated_at: &'a str,
}

impl EntryHead<'_> {
    fn entry(
        &self,
        epoch: &str,
        sub: &Subscription,
        sync_type: &str,
        data: Value,
        extra: Map<String, Value>,
    ) -> SyncEntry {
        SyncEntry {
            id: Some(format!("{epoch}:{}", self.seq)),
            resource_id: Some(self.resource_id.to_owned()),
            resource_type: Some(Some(sub.resource_type.clone())),
            sync_type: sync_type.to_owned(),
            server_sequence: Some(self.seq),
            updated_at: Some(self.updated_at.to_owned()),
            data: Some(data),
            extra,
        }
    }
}

/// The scope's columns of `values`, sent beside an entry's known keys; one named like a
/// known key stays in `data` only.
fn scope_attributes(sub: &Subscription, values: &Map<String, Value>) -> Map<String, Value> {
    let mut extra = Map::new();
    for key in sub.conditions.columns() {
        if let Some(value) = values.get(key) {
            if !SyncEntry::is_known_key(key) && !extra.contains_key(key) {
                extra.insert(key.to_owned(), value.clone());
            }
        }
    }
    extra
}

fn wire_entry(
    epoch: &str,
    sub: &Subscription,
    entry: &FeedEntry,
    sync_type: &str,
    data: Value,
    scope_values: &Map<String, Value>,
) -> Option<SyncEntry> {
    let head = EntryHead {
        resource_id: &entry.resource_id,
        seq: entry.seq,
        updated_at: &entry.updated_at,
    };
    Some(head.entry(
        epoch,
        sub,
        sync_type,
        data,
        scope_attributes(sub, scope_values),
    ))
}

impl Subscription {
    /// Whether a row (or an exit's scope values) belongs to the subscription: its conditions
    /// and the table's row filter (its subqueries answered by their sets) both hold.
    fn belongs(&self, values: &Map<String, Value>, sets: &SetStore) -> bool {
        self.conditions.matches(values)
            && self.row_filter.as_ref().is_none_or(|filter| {
                if self.sets.is_empty() {
                    filter.matches(values)
                } else {
                    sets.matches(filter, &self.sets, values)
                }
            })
    }
}

/// Shrinks `map` to twice its length once it holds under a quarter of its capacity: a map
/// keeps its largest capacity otherwise, and the ones keyed by connection grow with every
/// burst of clients. Shrinking at a quarter keeps the cost amortized (each shrink follows at
/// least as many removals as the entries it moves).
fn shrink_when_sparse<K: Eq + std::hash::Hash, V>(map: &mut HashMap<K, V>) {
    if map.capacity() > 64 && map.len() * 4 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
}

/// [`shrink_when_sparse`] for a set.
fn shrink_set_when_sparse<T: Eq + std::hash::Hash>(set: &mut HashSet<T>) {
    if set.capacity() > 64 && set.len() * 4 < set.capacity() {
        set.shrink_to(set.len() * 2);
    }
}

type RoutingIndex = HashMap<(String, String, String), HashSet<SubRef>>;
type IndexedColumns = HashMap<String, BTreeMap<String, usize>>;

/// Indexes a subscription under one value of a column.
fn index_add(
    index: &mut RoutingIndex,
    columns: &mut IndexedColumns,
    table: &str,
    column: &str,
    form: String,
    target: SubRef,
) {
    let added = index
        .entry((table.to_owned(), column.to_owned(), form))
        .or_default()
        .insert(target);
    if added {
        *columns
            .entry(table.to_owned())
            .or_default()
            .entry(column.to_owned())
            .or_default() += 1;
    }
}

/// Takes a subscription out of the index under one value of a column.
fn index_remove(
    index: &mut RoutingIndex,
    columns: &mut IndexedColumns,
    table: &str,
    column: &str,
    form: String,
    target: &SubRef,
) {
    let key = (table.to_owned(), column.to_owned(), form);
    let Some(set) = index.get_mut(&key) else {
        return;
    };
    if !set.remove(target) {
        return;
    }
    shrink_set_when_sparse(set);
    if set.is_empty() {
        index.remove(&key);
    }
    if let Some(counts) = columns.get_mut(table) {
        if let Some(count) = counts.get_mut(column) {
            *count -= 1;
            if *count == 0 {
                counts.remove(column);
            }
        }
        if counts.is_empty() {
            columns.remove(table);
        }
    }
}

/// One way a change finds a subscription: a value of a column, or any value in a set of a
/// column.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Value(String, String),
    Set(SetId, String),
}

/// The routes of a subscription: every row it may receive (or whose exit it may receive)
/// matches at least one. Its equality condition if it has one (every row must pass it);
/// else what its row filter says: a conjunct's routes (an equality, a list of at most
/// [`MAX_ROUTE_VALUES`] values, a set test), or the union of every branch's under `OR` when each
/// branch has some. None: the subscription is matched against every change to its table.
fn routes(conditions: &Conditions, filter: Option<&RowFilter>, sets: &[SetId]) -> Vec<Route> {
    if let Some((column, value)) = conditions.routing_key() {
        return vec![Route::Value(column.to_owned(), routing_form(value))];
    }
    let Some(filter) = filter else {
        return Vec::new();
    };
    // `sets` holds the filter's set tests' sets in leaf order: each leaf takes the next.
    filter_routes(filter, &mut sets.iter()).unwrap_or_default()
}

/// A list test routes by each of its values up to this many; a longer one is not routed by.
const MAX_ROUTE_VALUES: usize = 64;

/// Every item is visited (no early return), so set tests meet their sets in leaf order.
fn filter_routes(filter: &RowFilter, sets: &mut std::slice::Iter<'_, SetId>) -> Option<Vec<Route>> {
    use crate::scope_sync::Test;
    match filter {
        RowFilter::And(items) => {
            // The conjunct with the fewest routes (a set test counts as one).
            let all: Vec<Option<Vec<Route>>> =
                items.iter().map(|item| filter_routes(item, sets)).collect();
            all.into_iter().flatten().min_by_key(Vec::len)
        }
        RowFilter::Or(items) if !items.is_empty() => {
            let all: Vec<Option<Vec<Route>>> =
                items.iter().map(|item| filter_routes(item, sets)).collect();
            let mut union = Vec::new();
            for route in all
                .into_iter()
                .collect::<Option<Vec<_>>>()?
                .into_iter()
                .flatten()
            {
                if !union.contains(&route) {
                    union.push(route);
                }
            }
            Some(union)
        }
        RowFilter::Or(_) => None,
        RowFilter::Not(item) => {
            // Its set tests still take their sets.
            let _ = filter_routes(item, sets);
            None
        }
        RowFilter::Test(column, Test::Eq(value)) => {
            Some(vec![Route::Value(column.clone(), routing_form(value))])
        }
        RowFilter::Test(column, Test::In(values)) if values.len() <= MAX_ROUTE_VALUES => Some(
            values
                .iter()
                .map(|value| Route::Value(column.clone(), routing_form(value)))
                .collect(),
        ),
        RowFilter::Test(..) => None,
        RowFilter::InSet(column, _) => sets
            .next()
            .map(|set| vec![Route::Set(*set, column.clone())]),
    }
}
