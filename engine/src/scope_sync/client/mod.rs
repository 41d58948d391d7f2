//! The scope-sync client: one socket for every scope, reconnects, heartbeats, tokens, and each
//! scope's rows and cursor (the client side of the velocious-compatible scope channel).
//!
//! [`SyncClient`] is sans-IO. The host (the WASM `HighwaterClient`) feeds it [`ClientInput`]s
//! with the current time and carries out the returned [`ClientEffect`]s, in order:
//!
//! - [`ClientEffect::RequestToken`]: call the app's token source, answer [`ClientInput::Token`]
//!   with the same `request`. Asked on every connect and when a subscription's token expired.
//! - [`ClientEffect::OpenSocket`]: open a WebSocket to the sync URL; report its life with
//!   `SocketOpened`, `SocketFrame` and `SocketClosed` (an error without a close is a close),
//!   all naming this `socket`. Events of other sockets are ignored, so a late event of an old
//!   socket is harmless.
//! - [`ClientEffect::Send`]: send the text frame on that socket if it is still open.
//! - [`ClientEffect::CloseSocket`]: close it and forget it; its later events change nothing.
//! - [`ClientEffect::SetTimer`]: keep one timer; replace it; fire [`ClientInput::Tick`] at
//!   `at_ms` (none: cancel). A tick that comes early is answered with the same timer again;
//!   a tick that comes twice does no harm.
//! - [`ClientEffect::Changed`]: the scope's rows changed by one server transaction (or by a
//!   restore or reset); tell the app, once.
//! - [`ClientEffect::Persist`]: write this to the scope's store in ONE storage transaction, in
//!   the order given (rows, deletions and the cursor together; `forget_cursor` first drops the
//!   stored cursor).
//! - [`ClientEffect::Progress`], [`ClientEffect::Ready`], [`ClientEffect::ScopeFailed`],
//!   [`ClientEffect::Error`], [`ClientEffect::Status`]: report to the app.
//!
//! Rules held here and nowhere else:
//! - One connect in flight at a time; a lost socket waits a capped exponential delay with full
//!   jitter ([`crate::backoff`]), at least the server's `retryAfterMs`; the window resets once a
//!   subscription on the socket is confirmed and caught up, or the socket stayed up
//!   `healthy_after_ms` (a server that accepts and drops at once keeps the window growing). The browser's `online` event retries at once; while
//!   the browser says offline, no reconnect is started.
//! - Heartbeat: an app-level `ping` every `ping_interval_ms`; a socket silent for
//!   `silence_limit_ms` is half-open and is closed and replaced. A client that was held back
//!   (its timer fired more than `wake_gap_ms` late, or the host reports [`ClientInput::Woke`]
//!   for a page shown again) does not count that silence against the server: it pings at once
//!   and replaces the socket only if nothing answers within `wake_probe_ms`; a reconnect
//!   waiting out its backoff starts at once.
//! - Every new socket re-subscribes every scope from its persisted cursor: the server keeps no
//!   session state, so a fresh connect, `session-gone` and `session-resumed` end the same way.
//! - A scope's cursor is persisted only after its rows were applied and its subscription was
//!   confirmed (`channel-subscribed` passed through the apply queue;
//!   `docs/protocol/scope-sync.md`, hazard P3), and never moves backwards; it also moves with
//!   an envelope's `cursor` checkpoint (the feed position its scope is complete up to). A reset
//!   marker drops the cursor but keeps the rows: the full replay that follows overwrites them,
//!   and once it is confirmed the rows it did not deliver are removed, so a reset never empties
//!   a page.
//! - Each envelope is applied at once: one [`ClientEffect::Changed`] with the net change per
//!   row; an entry older than the row held (by `serverSequence`) is skipped, a repeated entry
//!   changes nothing.
//! - A JWT token stating `iat` and `exp` is renewed `token_renew_margin_ms` before it expires
//!   (at the latest halfway): a fresh token is asked for and every subscription opened again
//!   with it from its persisted cursor, so none runs into `auth-expired`; if the token source
//!   fails, the subscriptions go on with the old token (reported as `token-renewal-failed`).
//! - `auth-expired` fetches a fresh token and re-subscribes that scope once; a second auth
//!   rejection in a row, `auth-invalid`, `auth-required` and every other `channel-error` code
//!   fail the scope, reported once and never retried; other scopes go on.
//!
//! The per-scope subscription rules (apply queue, the cursor guard against hazard P3, fresh ids
//! on re-subscribe) are [`crate::scope_sync::realtime_bridge::ScopeBridge`]'s: each scope drives one bridge.
//!
//! A subscription id is never reused on one client (`s{key}.{n}.` with a client-wide count of
//! subscribes): a scope unsubscribed while its replay was still coming and subscribed again on
//! the same socket would otherwise take the old replay's last page and `channel-subscribed` for
//! its own, and confirm a cursor past rows it never applied. The property tests found that
//! history; it is kept in `engine/proptest-regressions/scope_sync/client/tests.txt` and as
//! `late_frames_of_an_unsubscribed_replay_do_not_confirm_its_resubscription`.
//!
//! A token that is not a JWT stating `iat` and `exp` (an opaque one) is not renewed ahead of
//! time: only the server's `auth-expired` asks for a fresh one.

use crate::scope_sync::server::routing_form;
use crate::scope_sync::{KeptBody, SyncEntry};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::backoff::{Backoff, BackoffPolicy};
use crate::scope_sync::cursor::{is_cursor_after, SyncCursor};
use crate::scope_sync::realtime_bridge::{
    BridgeConfig, BridgeEffect, BridgeError, BridgeInput, MessageBody, MovedOut, RemoteChange,
    ReplayProgress, ScopeBridge, ScopeChannel,
};
use crate::scope_sync::scope::{Scope, ScopeDigest};
use crate::scope_sync::{
    ClientFrame, Mutation, MutationOp, MutationResult, RowText, ServerFrame, SubscribeParams,
};

mod outbox;
#[cfg(test)]
mod tests;

pub use outbox::{resource_id, MutateError, OutboxWrite};

/// The host's name for one subscription of the app (a handle), chosen by the host.
pub type ScopeKey = u32;
/// Names one socket the client asked for.
pub type SocketId = u32;

/// Channel-error codes that mean the token was refused.
const AUTH_CODES: [&str; 3] = ["auth-invalid", "auth-required", "auth-expired"];

/// Timings and limits; fixed for the client's lifetime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    pub backoff: BackoffPolicy,
    /// How often an open socket sends `ping`.
    pub ping_interval_ms: u64,
    /// An open socket that heard nothing for this long is closed as half-open.
    pub silence_limit_ms: u64,
    /// How long a token request or a socket open may take before the attempt counts as failed.
    pub connect_timeout_ms: u64,
    /// A socket up this long resets the backoff window.
    pub healthy_after_ms: u64,
    /// A timer that fires this much later than it was set for means the page or the machine
    /// was held back (a sleeping laptop, a throttled background tab): the client woke.
    pub wake_gap_ms: u64,
    /// On waking with a socket open, the client pings at once and closes the socket as
    /// half-open if nothing arrives within this long.
    pub wake_probe_ms: u64,
    /// A token that is a JWT with `iat` and `exp` is renewed this long before it expires (at
    /// the latest halfway through its life): a fresh one is asked for and every subscription
    /// is opened again with it, so no subscription reaches `auth-expired`.
    pub token_renew_margin_ms: u64,
    /// Replay page size sent as `limit`; `None` leaves it to the server.
    pub page_limit: Option<u32>,
    /// Writes are applied by the app's own backend: batches go to [`ClientEffect::Upload`]
    /// instead of `mutate` frames.
    pub upload: bool,
    /// Key columns per table, for laying mutations over rows (`id` where not listed).
    pub keys: BTreeMap<String, Vec<String>>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            backoff: BackoffPolicy::default(),
            ping_interval_ms: 4_000,
            silence_limit_ms: 9_000,
            connect_timeout_ms: 10_000,
            healthy_after_ms: 30_000,
            wake_gap_ms: 2_000,
            wake_probe_ms: 3_000,
            token_renew_margin_ms: 60_000,
            page_limit: None,
            upload: false,
            keys: BTreeMap::new(),
        }
    }
}

/// The connection's state as the app sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ConnectionState {
    Connecting,
    Open,
    Reconnecting,
    Offline,
    Closed,
}

/// The state with why it is so (the last disconnect, for example).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionStatus {
    pub state: ConnectionState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A row's replicated columns. Shared: the client's rows, the change reported and the write
/// to persist hold the same row, not three copies of it.
pub type RowData = Arc<RowText>;

/// One row of a scope as held and stored: the entry's `resourceId`, its `serverSequence` and
/// the replicated columns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredRow {
    pub id: String,
    pub server_sequence: Option<i64>,
    pub data: RowData,
}

/// What a store held for a scope when the app subscribed it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoredScope {
    pub rows: Vec<StoredRow>,
    pub cursor: Option<SyncCursor>,
}

/// One storage transaction for a scope.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PersistWrite {
    /// Drop the scope's stored cursor first: the server reset the scope. Its rows stay (the
    /// page is never emptied by a reset); the full replay that follows overwrites them, and
    /// the ones it does not deliver are deleted by a later write, once it is confirmed.
    pub forget_cursor: bool,
    pub upserts: Vec<StoredRow>,
    /// `resourceId`s to delete.
    pub deletes: Vec<String>,
    /// The new cursor; `None` keeps the stored one (or none, after `forget_cursor`).
    pub cursor: Option<SyncCursor>,
    /// Ids of `upserts` whose row is shown with a pending mutation laid over it: the row
    /// stored is the server's (`upserts`' data), not the one shown.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shadowed: Vec<String>,
}

impl PersistWrite {
    fn is_empty(&self) -> bool {
        !self.forget_cursor
            && self.upserts.is_empty()
            && self.deletes.is_empty()
            && self.cursor.is_none()
    }
}

/// One row of a [`RowChange`]: its `resourceId` and its replicated columns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChangedRow {
    pub id: String,
    pub data: RowData,
}

impl ChangedRow {
    fn new(id: &str, data: &RowData) -> Self {
        ChangedRow {
            id: id.to_owned(),
            data: Arc::clone(data),
        }
    }
}

/// The net change of one applied envelope, as rows (`data` objects) with their ids.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RowChange {
    pub inserted: Vec<ChangedRow>,
    pub updated: Vec<ChangedRow>,
    /// The rows as they were before removal.
    pub removed: Vec<ChangedRow>,
}

impl RowChange {
    fn is_empty(&self) -> bool {
        self.inserted.is_empty() && self.updated.is_empty() && self.removed.is_empty()
    }
}

/// What the host tells the client. Every input comes with `now_ms` (see [`SyncClient::handle`]).
#[derive(Debug, Clone, PartialEq)]
pub enum ClientInput {
    /// Begin connecting.
    Start,
    /// The app subscribed a scope: `params` carry `resourceType` and `conditions` (no cursor or
    /// token; the client adds those), `stored` what the store held for it.
    Subscribe {
        scope: ScopeKey,
        params: Box<SubscribeParams>,
        stored: StoredScope,
    },
    Unsubscribe {
        scope: ScopeKey,
    },
    SocketOpened {
        socket: SocketId,
    },
    SocketFrame {
        socket: SocketId,
        text: String,
    },
    /// The socket closed or failed.
    SocketClosed {
        socket: SocketId,
        reason: String,
    },
    /// The answer to [`ClientEffect::RequestToken`]: a token, none (no auth), or why it failed.
    Token {
        request: u64,
        result: Result<Option<String>, String>,
    },
    /// The timer set by [`ClientEffect::SetTimer`] fired (maybe a little early).
    Tick,
    /// The browser's `online` event.
    BrowserOnline,
    /// The browser's `offline` event.
    BrowserOffline,
    /// The page became visible again or was restored from the back/forward cache: the socket
    /// may have died while it was away. (A timer that fires late says the same, see
    /// [`ClientConfig::wake_gap_ms`]; the host need not detect that itself.)
    Woke,
    /// The app asked to go offline: close the socket and stay disconnected.
    GoOffline,
    /// The app asked to reconnect now.
    GoOnline,
    /// Close for good.
    Close,
    /// The outbox as the store kept it: the client's id, the last mutation id it gave out,
    /// and the mutations not settled, in any order. Nothing is sent or laid over before it.
    RestoreOutbox {
        client_id: String,
        last_id: u64,
        pending: Vec<Mutation>,
    },
    /// The app's `upload` of these mutations (a [`ClientEffect::Upload`]) finished: `Ok` with
    /// the ones it refused for good (each a rejected result), or `Err` why it failed (tried
    /// again later).
    Uploaded {
        ids: Vec<u64>,
        result: Result<Vec<MutationResult>, String>,
    },
}

/// Something the host must do or report, in order. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum ClientEffect {
    #[serde(rename_all = "camelCase")]
    RequestToken {
        request: u64,
    },
    #[serde(rename_all = "camelCase")]
    OpenSocket {
        socket: SocketId,
    },
    #[serde(rename_all = "camelCase")]
    Send {
        socket: SocketId,
        text: String,
    },
    #[serde(rename_all = "camelCase")]
    CloseSocket {
        socket: SocketId,
        code: u16,
        reason: String,
    },
    #[serde(rename_all = "camelCase")]
    SetTimer {
        at_ms: Option<u64>,
    },
    /// `reset`: the server reset the scope; its rows stay until the full replay that follows
    /// is confirmed, when the ones it did not deliver are removed (reported by a later change).
    #[serde(rename_all = "camelCase")]
    Changed {
        scope: ScopeKey,
        reset: bool,
        change: RowChange,
    },
    #[serde(rename_all = "camelCase")]
    Persist {
        scope: ScopeKey,
        write: PersistWrite,
    },
    /// Catch-up replay progress: `done` of `total` rows after the cursor.
    #[serde(rename_all = "camelCase")]
    Progress {
        scope: ScopeKey,
        done: u64,
        total: u64,
    },
    /// The scope is caught up (again); `replayed` rows came by this catch-up replay.
    #[serde(rename_all = "camelCase")]
    Ready {
        scope: ScopeKey,
        replayed: u64,
    },
    /// The server refused or ended the scope's subscription for good (`code` as sent).
    #[serde(rename_all = "camelCase")]
    ScopeFailed {
        scope: ScopeKey,
        code: String,
        message: String,
    },
    /// Something went wrong that the client survives: a server `error` frame, a frame or
    /// message it could not read (skipped).
    #[serde(rename_all = "camelCase")]
    Error {
        scope: Option<ScopeKey>,
        code: String,
        message: String,
    },
    Status(ConnectionStatus),
    /// Write this to the outbox's store in ONE storage transaction, in order.
    #[serde(rename_all = "camelCase")]
    PersistOutbox {
        write: OutboxWrite,
    },
    /// A mutation is settled: `confirmed` (applied, and its change is in the rows) or
    /// `rejected` (dropped; `code` says why).
    #[serde(rename_all = "camelCase")]
    Settled {
        result: MutationResult,
    },
    /// Hand these mutations to the app's `upload` and report [`ClientInput::Uploaded`].
    #[serde(rename_all = "camelCase")]
    Upload {
        mutations: Vec<Mutation>,
    },
}

/// Where the one connection stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// Not connecting: not started, offline by request, or closed.
    Idle,
    Token {
        request: u64,
        since_ms: u64,
    },
    Opening {
        socket: SocketId,
        since_ms: u64,
    },
    Open {
        socket: SocketId,
        opened_ms: u64,
        heard_ms: u64,
        pinged_ms: u64,
        /// When the ping sent on waking went out, until anything arrives.
        probe_ms: Option<u64>,
    },
    /// Waiting out a backoff delay.
    Waiting {
        until_ms: u64,
    },
}

/// Where one scope's subscription stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Not subscribed on the current socket (there may be none).
    Idle,
    Subscribing,
    Live,
    /// Its token expired; waiting for a fresh one to re-subscribe.
    AwaitingToken,
    /// Refused for good.
    Failed,
}

/// A map keyed by row id, hashed with [`IdHasher`].
type IdMap<V> = HashMap<String, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Hashes the row ids of the maps a replay looks up once per row or more: FxHash's word
/// mixing, then murmur3's finalizer so every bit of the id reaches the bits a table indexes
/// by. Several times cheaper than the default SipHash, in WebAssembly above all; the ids come
/// from the server the client trusts, so resisting chosen collisions buys nothing here.
#[derive(Debug, Default, Clone, Copy)]
struct IdHasher(u64);

impl IdHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

impl std::hash::Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Byte by byte into each word: ids are short, and a slice copy is a call in wasm.
        for word in bytes.chunks(8) {
            let mut value = 0u64;
            for (at, &byte) in word.iter().enumerate() {
                value |= u64::from(byte) << (8 * at);
            }
            self.add(value);
        }
    }

    fn write_u8(&mut self, byte: u8) {
        self.add(u64::from(byte));
    }

    fn finish(&self) -> u64 {
        let mut hash = self.0;
        hash ^= hash >> 33;
        hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
        hash ^ (hash >> 33)
    }
}

#[derive(Debug, Clone)]
struct HeldRow {
    server_sequence: Option<i64>,
    data: RowData,
    /// The last batch that touched it, and its place in that batch's list of touched rows.
    touched: (u64, usize),
}

#[derive(Debug, Clone)]
struct ScopeSlot {
    params: SubscribeParams,
    digest: ScopeDigest,
    bridge: ScopeBridge,
    /// Hashed, not ordered: a replay looks up every row it brings (a hundred thousand, say).
    rows: IdMap<HeldRow>,
    /// The persisted cursor.
    cursor: Option<SyncCursor>,
    phase: Phase,
    /// Entries applied by the current catch-up replay.
    replaying: u64,
    /// Batches applied so far (each numbers the rows it touches, see `HeldRow::touched`).
    batches: u64,
    /// Entries applied by the last finished catch-up replay.
    replayed: u64,
    /// `auth-expired` answers since the scope was last live.
    expired_in_a_row: u32,
    /// While a replay from no cursor runs over rows already held: the ids it delivered. The
    /// rest are gone on the server and are removed when it is confirmed.
    sweep: Option<BTreeSet<String>>,
    /// Rows shown other than the server's, by pending mutations: the row shown, or `None`
    /// for one hidden (see `outbox`).
    overlay: HashMap<String, Option<RowData>>,
}

/// The client state machine. See the module docs.
#[derive(Debug, Clone)]
pub struct SyncClient {
    config: ClientConfig,
    backoff: Backoff,
    link: Link,
    started: bool,
    closed: bool,
    user_offline: bool,
    browser_offline: bool,
    /// Whether any socket ever opened (so the state says reconnecting, not connecting).
    ever_opened: bool,
    /// The least delay before the next reconnect, from the server's `retryAfterMs`.
    retry_floor_ms: u64,
    reason: Option<String>,
    /// The token of the current connection.
    token: Option<String>,
    /// A token request for expired subscriptions, or to renew the token, on the open socket.
    refresh: Option<u64>,
    /// Whether `refresh` renews the token before it expires.
    renewing: bool,
    /// When to renew the current token (from its own `iat` and `exp`).
    renew_at_ms: Option<u64>,
    sockets_issued: SocketId,
    requests_issued: u64,
    /// Every `Subscribe` the app made on this client; part of each scope's subscription ids.
    subscribes_made: u64,
    scopes: BTreeMap<ScopeKey, ScopeSlot>,
    /// Subscription id → scope, for every subscription out on the socket.
    routes: BTreeMap<String, ScopeKey>,
    status: ConnectionStatus,
    timer: Option<u64>,
    outbox: outbox::Outbox,
}

impl SyncClient {
    /// `seed` drives the backoff jitter; hosts pass fresh randomness.
    pub fn new(config: ClientConfig, seed: u64) -> Self {
        Self {
            backoff: Backoff::new(config.backoff, seed),
            config,
            link: Link::Idle,
            started: false,
            closed: false,
            user_offline: false,
            browser_offline: false,
            ever_opened: false,
            retry_floor_ms: 0,
            reason: None,
            token: None,
            refresh: None,
            renewing: false,
            renew_at_ms: None,
            sockets_issued: 0,
            requests_issued: 0,
            subscribes_made: 0,
            scopes: BTreeMap::new(),
            routes: BTreeMap::new(),
            status: ConnectionStatus {
                state: ConnectionState::Connecting,
                reason: None,
            },
            timer: None,
            outbox: outbox::Outbox::default(),
        }
    }

    pub fn status(&self) -> &ConnectionStatus {
        &self.status
    }

    /// The scope's rows as shown (pending mutations laid over the server's), in `resourceId`
    /// order, decoded (the client keeps each as its text).
    pub fn rows(&self, scope: ScopeKey) -> Vec<Map<String, Value>> {
        self.shown_rows(scope)
            .into_iter()
            .map(|(_, row)| row.to_map())
            .collect()
    }

    /// The `serverSequence` of the server's row `id` in the scope (for `ifVersion`).
    pub fn version(&self, scope: ScopeKey, id: &str) -> Option<i64> {
        self.scopes
            .get(&scope)?
            .rows
            .get(id)
            .and_then(|row| row.server_sequence)
    }

    /// Queues a mutation at `now_ms`: its id, or why it was refused (nothing queued). The
    /// effects persist it, lay it over the scopes of its table and send it when the socket
    /// is open.
    pub fn mutate(
        &mut self,
        now_ms: u64,
        table: String,
        op: MutationOp,
        row: Map<String, Value>,
        if_version: Option<i64>,
    ) -> (Result<u64, MutateError>, Vec<ClientEffect>) {
        let mut out = Vec::new();
        if self.closed {
            return (Err(MutateError::Invalid("an open client".to_owned())), out);
        }
        let queued = self.queue(table, op, row, if_version, &mut out);
        self.pump(now_ms, &mut out);
        self.report(now_ms, &mut out);
        (queued, out)
    }

    /// The scope's persisted cursor.
    pub fn cursor(&self, scope: ScopeKey) -> Option<&SyncCursor> {
        self.scopes
            .get(&scope)
            .and_then(|slot| slot.cursor.as_ref())
    }

    /// Rows applied by the scope's last finished catch-up replay.
    pub fn replayed(&self, scope: ScopeKey) -> u64 {
        self.scopes.get(&scope).map_or(0, |slot| slot.replayed)
    }

    /// Whether the scope is caught up and live.
    pub fn is_live(&self, scope: ScopeKey) -> bool {
        self.scopes
            .get(&scope)
            .is_some_and(|slot| slot.phase == Phase::Live)
    }

    /// Feeds one input at `now_ms` (any monotonic clock in milliseconds); returns the effects.
    pub fn handle(&mut self, now_ms: u64, input: ClientInput) -> Vec<ClientEffect> {
        let mut out = Vec::new();
        if self.closed {
            return out;
        }
        match input {
            ClientInput::Start => {
                self.started = true;
                if self.link == Link::Idle && !self.user_offline {
                    self.connect(now_ms, &mut out);
                }
            }
            ClientInput::Subscribe {
                scope,
                params,
                stored,
            } => self.subscribe(scope, *params, stored, &mut out),
            ClientInput::Unsubscribe { scope } => self.unsubscribe(scope, &mut out),
            ClientInput::SocketOpened { socket } => self.opened(now_ms, socket, &mut out),
            ClientInput::SocketFrame { socket, text } => match self.link {
                Link::Open {
                    socket: open,
                    opened_ms,
                    pinged_ms,
                    ..
                } if open == socket => {
                    self.link = Link::Open {
                        socket,
                        opened_ms,
                        heard_ms: now_ms,
                        pinged_ms,
                        probe_ms: None,
                    };
                    self.frame(&text, &mut out);
                }
                _ => {}
            },
            ClientInput::SocketClosed { socket, reason } => match self.link {
                Link::Opening {
                    socket: current, ..
                }
                | Link::Open {
                    socket: current, ..
                } if current == socket => self.lost(now_ms, reason, &mut out),
                _ => {}
            },
            ClientInput::Token { request, result } => self.token(now_ms, request, result, &mut out),
            ClientInput::Tick => {
                // The host's timer fired, so none is armed any more, whatever the time: a
                // deadline still ahead (a timer that fired early) or equal to the one that just
                // passed is set again by `report` instead of being taken for the armed one.
                // Node's timers fire early by as long as the event loop was busy when they were
                // set (they count from the loop's cached clock), and a deadline left unarmed
                // would wait forever.
                let armed = self.timer.take();
                self.renew_if_due(now_ms, &mut out);
                // Fired much later than set for: the client was held back, and what it knew of
                // the socket is old.
                if armed.is_some_and(|at| now_ms > at.saturating_add(self.config.wake_gap_ms)) {
                    self.woke(now_ms, &mut out)
                } else {
                    self.tick(now_ms, &mut out)
                }
            }
            ClientInput::Woke => self.woke(now_ms, &mut out),
            ClientInput::BrowserOnline => {
                self.browser_offline = false;
                if matches!(self.link, Link::Waiting { .. }) {
                    self.connect(now_ms, &mut out);
                }
            }
            ClientInput::BrowserOffline => self.browser_offline = true,
            ClientInput::GoOffline => {
                self.user_offline = true;
                self.drop_link(1000, "going offline", &mut out);
                self.reason = Some("offline by request".to_owned());
            }
            ClientInput::GoOnline => {
                self.user_offline = false;
                if self.started && matches!(self.link, Link::Idle | Link::Waiting { .. }) {
                    self.backoff.reset();
                    self.connect(now_ms, &mut out);
                }
            }
            ClientInput::Close => {
                self.drop_link(1000, "client closed", &mut out);
                self.closed = true;
                self.reason = None;
                // Nothing is reported after close: the rows go now, not with the host.
                self.scopes.clear();
            }
            ClientInput::RestoreOutbox {
                client_id,
                last_id,
                pending,
            } => self.restore_outbox(client_id, last_id, pending, &mut out),
            ClientInput::Uploaded { ids, result } => self.uploaded(&ids, result, &mut out),
        }
        if !self.closed {
            self.pump(now_ms, &mut out);
        }
        self.report(now_ms, &mut out);
        out
    }

    fn connect(&mut self, now_ms: u64, out: &mut Vec<ClientEffect>) {
        debug_assert!(matches!(self.link, Link::Idle | Link::Waiting { .. }));
        self.requests_issued += 1;
        let request = self.requests_issued;
        // A refresh in flight belongs to the socket being replaced.
        self.refresh = None;
        self.renewing = false;
        self.link = Link::Token {
            request,
            since_ms: now_ms,
        };
        out.push(ClientEffect::RequestToken { request });
    }

    fn token(
        &mut self,
        now_ms: u64,
        request: u64,
        result: Result<Option<String>, String>,
        out: &mut Vec<ClientEffect>,
    ) {
        if let Link::Token {
            request: wanted, ..
        } = self.link
        {
            if wanted == request {
                match result {
                    Ok(token) => {
                        self.token = token;
                        self.plan_renewal(now_ms);
                        self.sockets_issued += 1;
                        let socket = self.sockets_issued;
                        self.link = Link::Opening {
                            socket,
                            since_ms: now_ms,
                        };
                        out.push(ClientEffect::OpenSocket { socket });
                    }
                    Err(message) => {
                        self.lost(now_ms, format!("the token source failed: {message}"), out)
                    }
                }
                return;
            }
        }
        if self.refresh != Some(request) {
            return;
        }
        self.refresh = None;
        let renewing = std::mem::take(&mut self.renewing);
        let waiting: Vec<ScopeKey> = self
            .scopes
            .iter()
            .filter(|(_, slot)| slot.phase == Phase::AwaitingToken)
            .map(|(key, _)| *key)
            .collect();
        match result {
            Ok(token) => {
                self.token = token;
                self.plan_renewal(now_ms);
                // The open ones first: the waiting ones are then subscribed once, with it.
                if renewing {
                    self.renew_subscriptions(out);
                }
                for key in waiting {
                    self.subscribe_scope(key, out);
                }
            }
            Err(message) => {
                if renewing {
                    // The subscriptions keep the old token until the server says it expired;
                    // that path asks again.
                    out.push(ClientEffect::Error {
                        scope: None,
                        code: "token-renewal-failed".to_owned(),
                        message: format!("the token source failed: {message}"),
                    });
                }
                for key in waiting {
                    self.fail_scope(
                        key,
                        "auth-expired",
                        format!("the token expired and the token source failed: {message}"),
                        out,
                    );
                }
            }
        }
    }

    fn opened(&mut self, now_ms: u64, socket: SocketId, out: &mut Vec<ClientEffect>) {
        let Link::Opening {
            socket: opening, ..
        } = self.link
        else {
            return;
        };
        if opening != socket {
            return;
        }
        self.link = Link::Open {
            socket,
            opened_ms: now_ms,
            heard_ms: now_ms,
            pinged_ms: now_ms,
            probe_ms: None,
        };
        self.ever_opened = true;
        self.reason = None;
        let keys: Vec<ScopeKey> = self.scopes.keys().copied().collect();
        for key in keys {
            if self
                .scopes
                .get(&key)
                .is_some_and(|slot| slot.phase == Phase::Idle)
            {
                self.subscribe_scope(key, out);
            }
        }
    }

    /// The socket is gone (or never came up): retire every subscription and wait to retry.
    fn lost(&mut self, now_ms: u64, reason: String, out: &mut Vec<ClientEffect>) {
        if let Link::Open { opened_ms, .. } = self.link {
            if now_ms.saturating_sub(opened_ms) >= self.config.healthy_after_ms {
                self.backoff.reset();
            }
        }
        self.retire_subscriptions(out);
        let delay = self.backoff.next_delay_ms(self.retry_floor_ms);
        self.retry_floor_ms = 0;
        self.link = Link::Waiting {
            until_ms: now_ms.saturating_add(delay),
        };
        self.reason = Some(reason);
    }

    /// Closes the socket, if any, and stops connecting.
    fn drop_link(&mut self, code: u16, reason: &str, out: &mut Vec<ClientEffect>) {
        if let Link::Opening { socket, .. } | Link::Open { socket, .. } = self.link {
            out.push(ClientEffect::CloseSocket {
                socket,
                code,
                reason: reason.to_owned(),
            });
        }
        self.retire_subscriptions(out);
        self.refresh = None;
        self.link = Link::Idle;
    }

    /// Every subscription on the socket is gone with it; scopes not failed wait for the next.
    fn retire_subscriptions(&mut self, out: &mut Vec<ClientEffect>) {
        self.routes.clear();
        let keys: Vec<ScopeKey> = self.scopes.keys().copied().collect();
        for key in keys {
            let Some(slot) = self.scopes.get_mut(&key) else {
                continue;
            };
            if slot.phase != Phase::Failed {
                slot.phase = Phase::Idle;
            }
            // The bridge's unsubscribe frames would go to a dead socket: dropped.
            let effects = slot
                .bridge
                .handle(BridgeInput::Unsubscribe)
                .unwrap_or_else(|error| refused(error, &mut *out));
            let kept = effects
                .into_iter()
                .filter(|effect| !matches!(effect, BridgeEffect::SendUnsubscribe { .. }))
                .collect();
            self.drive(key, kept, out);
        }
    }

    fn tick(&mut self, now_ms: u64, out: &mut Vec<ClientEffect>) {
        match self.link {
            Link::Idle => {}
            Link::Waiting { until_ms } => {
                if now_ms >= until_ms && !self.browser_offline {
                    self.connect(now_ms, out);
                }
            }
            Link::Token { since_ms, .. } => {
                if now_ms.saturating_sub(since_ms) >= self.config.connect_timeout_ms {
                    self.lost(
                        now_ms,
                        "the token source did not answer in time".to_owned(),
                        out,
                    );
                }
            }
            Link::Opening { socket, since_ms } => {
                if now_ms.saturating_sub(since_ms) >= self.config.connect_timeout_ms {
                    out.push(ClientEffect::CloseSocket {
                        socket,
                        code: 4000,
                        reason: "connect timeout".to_owned(),
                    });
                    self.lost(now_ms, "the socket did not open in time".to_owned(), out);
                }
            }
            Link::Open {
                socket,
                heard_ms,
                pinged_ms,
                probe_ms,
                ..
            } => {
                if now_ms >= self.silence_deadline(heard_ms, probe_ms) {
                    out.push(ClientEffect::CloseSocket {
                        socket,
                        code: 4000,
                        reason: "heartbeat timeout".to_owned(),
                    });
                    let reason = match probe_ms {
                        Some(sent) => format!(
                            "the server did not answer a ping in {} ms after the client woke",
                            now_ms.saturating_sub(sent)
                        ),
                        None => format!(
                            "the server was silent for {} ms",
                            now_ms.saturating_sub(heard_ms)
                        ),
                    };
                    self.lost(now_ms, reason, out);
                } else if now_ms.saturating_sub(pinged_ms) >= self.config.ping_interval_ms {
                    self.ping(now_ms, probe_ms, out);
                }
            }
        }
    }

    /// Sends a `ping` on the open socket at `now_ms`; `probe_ms` is the wake probe that is out
    /// afterwards, if any.
    fn ping(&mut self, now_ms: u64, probe_ms: Option<u64>, out: &mut Vec<ClientEffect>) {
        if let Link::Open {
            socket,
            opened_ms,
            heard_ms,
            ..
        } = self.link
        {
            out.push(ClientEffect::Send {
                socket,
                text: ClientFrame::Ping.to_json(),
            });
            self.link = Link::Open {
                socket,
                opened_ms,
                heard_ms,
                pinged_ms: now_ms,
                probe_ms,
            };
        }
    }

    /// Plans the current token's renewal from its own lifetime, if it states one.
    fn plan_renewal(&mut self, now_ms: u64) {
        self.renew_at_ms = self
            .token
            .as_deref()
            .and_then(jwt_lifetime_ms)
            .map(|lifetime| {
                let wait = lifetime
                    .saturating_sub(self.config.token_renew_margin_ms)
                    .max(lifetime / 2);
                now_ms.saturating_add(wait)
            });
    }

    /// Asks for a fresh token once the current one is due for renewal, on an open socket.
    fn renew_if_due(&mut self, now_ms: u64, out: &mut Vec<ClientEffect>) {
        let due = self.renew_at_ms.is_some_and(|at| now_ms >= at);
        if due && self.refresh.is_none() && matches!(self.link, Link::Open { .. }) {
            self.renew_at_ms = None;
            self.renewing = true;
            self.requests_issued += 1;
            self.refresh = Some(self.requests_issued);
            out.push(ClientEffect::RequestToken {
                request: self.requests_issued,
            });
        }
    }

    /// Opens every subscribed scope's subscription again with the current token (the bridge
    /// unsubscribes the old one and replays from the persisted cursor).
    fn renew_subscriptions(&mut self, out: &mut Vec<ClientEffect>) {
        let token = self.token.clone();
        let keys: Vec<ScopeKey> = self.scopes.keys().copied().collect();
        for key in keys {
            let Some(slot) = self.scopes.get_mut(&key) else {
                continue;
            };
            if !matches!(slot.phase, Phase::Subscribing | Phase::Live) {
                continue;
            }
            slot.phase = Phase::Subscribing;
            slot.replaying = 0;
            let effects = slot
                .bridge
                .handle(BridgeInput::Renew {
                    authentication_token: token.clone(),
                })
                .unwrap_or_else(|error| refused(error, &mut *out));
            self.drive(key, effects, out);
        }
    }

    /// When an open socket that heard nothing since `heard_ms` counts as half-open: the
    /// silence limit, or the probe's shorter wait after waking (the silence before it was the
    /// client's own: its timers did not run).
    fn silence_deadline(&self, heard_ms: u64, probe_ms: Option<u64>) -> u64 {
        match probe_ms {
            Some(sent) => sent.saturating_add(self.config.wake_probe_ms),
            None => heard_ms.saturating_add(self.config.silence_limit_ms),
        }
    }

    /// The page or the machine was held back (hidden, asleep, throttled). An open socket is
    /// asked at once whether it still lives (a ping, answered within
    /// [`ClientConfig::wake_probe_ms`] or the socket is replaced), rather than judged by a
    /// silence the client itself caused; a reconnect waiting out its backoff starts now.
    fn woke(&mut self, now_ms: u64, out: &mut Vec<ClientEffect>) {
        match self.link {
            Link::Open { probe_ms: None, .. } => self.ping(now_ms, Some(now_ms), out),
            Link::Waiting { .. } if !self.browser_offline => self.connect(now_ms, out),
            _ => self.tick(now_ms, out),
        }
    }

    fn subscribe(
        &mut self,
        key: ScopeKey,
        params: SubscribeParams,
        stored: StoredScope,
        out: &mut Vec<ClientEffect>,
    ) {
        if self.scopes.contains_key(&key) {
            self.unsubscribe(key, out);
        }
        let resource_type = params.scope.resource_type.clone().unwrap_or_default();
        let digest =
            Scope::of_type(resource_type.clone(), params.scope.conditions.clone()).digest();
        // A key unsubscribed and subscribed again must not reuse an id: the server may still
        // be sending the old subscription's replay, and its pages and `channel-subscribed`
        // would be taken for the new one's, leaving rows out under a confirmed cursor.
        self.subscribes_made += 1;
        let bridge = ScopeBridge::new(BridgeConfig {
            local_origin: None,
            resource_types: set_of([resource_type]),
            subscription_id_prefix: format!("s{key}.{}.", self.subscribes_made),
            reopen_on_resume: true,
        });
        let mut rows = IdMap::with_capacity_and_hasher(stored.rows.len(), Default::default());
        let mut inserted = Vec::new();
        for row in stored.rows {
            inserted.push(ChangedRow::new(&row.id, &row.data));
            rows.insert(
                row.id,
                HeldRow {
                    server_sequence: row.server_sequence,
                    data: row.data,
                    touched: (0, 0),
                },
            );
        }
        self.scopes.insert(
            key,
            ScopeSlot {
                params,
                digest,
                bridge,
                rows,
                cursor: stored.cursor,
                phase: Phase::Idle,
                replaying: 0,
                batches: 0,
                replayed: 0,
                expired_in_a_row: 0,
                sweep: None,
                overlay: HashMap::new(),
            },
        );
        let restored = RowChange {
            inserted,
            ..RowChange::default()
        };
        let overlaid = self.overlaid_rows(key);
        self.emit_change(key, false, restored, &overlaid, out);
        if matches!(self.link, Link::Open { .. }) {
            self.subscribe_scope(key, out);
        }
    }

    fn unsubscribe(&mut self, key: ScopeKey, out: &mut Vec<ClientEffect>) {
        let Some(mut slot) = self.scopes.remove(&key) else {
            return;
        };
        self.stop_lingering(key);
        let effects = slot
            .bridge
            .handle(BridgeInput::Unsubscribe)
            .unwrap_or_else(|error| refused(error, &mut *out));
        for effect in effects {
            if let (BridgeEffect::SendUnsubscribe { subscription_id }, Some(frame)) =
                (&effect, effect.client_frame())
            {
                self.routes.remove(subscription_id);
                self.send(frame, out);
            }
        }
    }

    /// Subscribes a scope on the open socket from its persisted cursor, with the current token.
    fn subscribe_scope(&mut self, key: ScopeKey, out: &mut Vec<ClientEffect>) {
        let token = self.token.clone();
        let limit = self.config.page_limit;
        let Some(slot) = self.scopes.get_mut(&key) else {
            return;
        };
        let mut params = slot.params.clone();
        params.after = slot.cursor.clone();
        params.authentication_token = token;
        if limit.is_some() {
            params.limit = limit;
        }
        slot.phase = Phase::Subscribing;
        slot.replaying = 0;
        if slot.cursor.is_none() && !slot.rows.is_empty() {
            // A full replay follows, possibly of another epoch: the rows held are replaced by
            // it, and their sequences say nothing about its entries.
            for row in slot.rows.values_mut() {
                row.server_sequence = None;
            }
            slot.sweep = Some(BTreeSet::new());
        }
        let channel = ScopeChannel {
            scope: slot.digest,
            params,
        };
        let effects = slot
            .bridge
            .handle(BridgeInput::Subscribe {
                channels: vec![channel],
            })
            .unwrap_or_else(|error| refused(error, &mut *out));
        self.drive(key, effects, out);
    }

    fn send(&self, frame: ClientFrame, out: &mut Vec<ClientEffect>) {
        if let Link::Open { socket, .. } = self.link {
            out.push(ClientEffect::Send {
                socket,
                text: frame.to_json(),
            });
        }
    }

    fn frame(&mut self, text: &str, out: &mut Vec<ClientEffect>) {
        // The common frame, a channel message, is read in one pass with its body, whose rows
        // are kept as text and handed on as they came (see `RowText`). A body of another form
        // (or with an error) is read again below, the ordinary way.
        if let Ok(message) = serde_json::from_str::<MessageText>(text) {
            if message.kind == "channel-message" {
                if let (Some(subscription_id), Some(kept)) = (
                    message.subscription_id,
                    message.body.and_then(KeptBody::into_envelope),
                ) {
                    if let Some(&key) = self.routes.get(&subscription_id) {
                        self.feed(
                            key,
                            BridgeInput::ChannelMessage {
                                subscription_id,
                                body: MessageBody::Kept(Box::new(kept)),
                            },
                            out,
                        );
                    }
                    return;
                }
            }
        }
        let frame = match ServerFrame::from_json(text) {
            Ok(frame) => frame,
            Err(error) => {
                out.push(ClientEffect::Error {
                    scope: None,
                    code: "bad-server-frame".to_owned(),
                    message: error.to_string(),
                });
                return;
            }
        };
        match frame {
            ServerFrame::SessionEstablished { .. }
            | ServerFrame::Pong
            | ServerFrame::ChannelUnsubscribed { .. }
            | ServerFrame::ChannelReplayGap { .. } => {}
            ServerFrame::SessionGone | ServerFrame::SessionResumed { .. } => {
                let keys: Vec<ScopeKey> = self.scopes.keys().copied().collect();
                for key in keys {
                    if let Some(slot) = self.scopes.get_mut(&key) {
                        if matches!(slot.phase, Phase::Subscribing | Phase::Live) {
                            slot.phase = Phase::Subscribing;
                            slot.replaying = 0;
                            let effects = slot
                                .bridge
                                .handle(BridgeInput::SessionGone)
                                .unwrap_or_else(|error| refused(error, &mut *out));
                            self.drive(key, effects, out);
                        }
                    }
                }
            }
            ServerFrame::Error {
                error,
                code,
                retry_after_ms,
            } => {
                if let Some(hint) = retry_after_ms {
                    self.retry_floor_ms = self.retry_floor_ms.max(hint);
                }
                out.push(ClientEffect::Error {
                    scope: None,
                    code: code.unwrap_or_else(|| "server-error".to_owned()),
                    message: error,
                });
            }
            ServerFrame::ChannelError {
                subscription_id,
                message,
                code,
            } => self.channel_error(subscription_id, message, code, out),
            ServerFrame::ChannelMessage {
                subscription_id,
                body,
                ..
            } => {
                let Some(&key) = self.routes.get(&subscription_id) else {
                    return;
                };
                self.feed(
                    key,
                    BridgeInput::ChannelMessage {
                        subscription_id,
                        body: MessageBody::Value(body),
                    },
                    out,
                );
            }
            ServerFrame::ChannelSubscribed { subscription_id } => {
                if let Some(&key) = self.routes.get(&subscription_id) {
                    self.feed(key, BridgeInput::ChannelSubscribed { subscription_id }, out);
                }
            }
            ServerFrame::MutationResult { client_id, results } => {
                self.mutation_results(&client_id, results, out)
            }
        }
    }

    fn channel_error(
        &mut self,
        subscription_id: String,
        message: String,
        code: Option<String>,
        out: &mut Vec<ClientEffect>,
    ) {
        let Some(key) = self.routes.remove(&subscription_id) else {
            return;
        };
        self.feed(
            key,
            BridgeInput::ChannelError {
                subscription_id,
                message: message.clone(),
            },
            out,
        );
        let code = code.unwrap_or_else(|| "channel-error".to_owned());
        let Some(slot) = self.scopes.get_mut(&key) else {
            return;
        };
        if code == "auth-expired" && slot.expired_in_a_row == 0 {
            slot.expired_in_a_row = 1;
            slot.phase = Phase::AwaitingToken;
            if self.refresh.is_none() {
                self.requests_issued += 1;
                self.refresh = Some(self.requests_issued);
                out.push(ClientEffect::RequestToken {
                    request: self.requests_issued,
                });
            }
        } else {
            let message = if AUTH_CODES.contains(&code.as_str()) && slot.expired_in_a_row > 0 {
                format!("{message} (again, after a fresh token)")
            } else {
                message
            };
            self.fail_scope(key, &code, message, out);
        }
    }

    fn fail_scope(
        &mut self,
        key: ScopeKey,
        code: &str,
        message: String,
        out: &mut Vec<ClientEffect>,
    ) {
        if let Some(slot) = self.scopes.get_mut(&key) {
            slot.phase = Phase::Failed;
            out.push(ClientEffect::ScopeFailed {
                scope: key,
                code: code.to_owned(),
                message,
            });
            // It will not be live again: nothing waits for its catch-up.
            self.stop_lingering(key);
        }
    }

    fn feed(&mut self, key: ScopeKey, input: BridgeInput, out: &mut Vec<ClientEffect>) {
        let Some(slot) = self.scopes.get_mut(&key) else {
            return;
        };
        let effects = slot
            .bridge
            .handle(input)
            .unwrap_or_else(|error| refused(error, &mut *out));
        self.drive(key, effects, out);
    }

    /// Carries out a scope bridge's effects: rows are applied here at once, so each batch is
    /// answered before the next is taken, and the rows and cursor it yields go out as one write.
    fn drive(&mut self, key: ScopeKey, effects: Vec<BridgeEffect>, out: &mut Vec<ClientEffect>) {
        let mut queue: VecDeque<BridgeEffect> = effects.into();
        let mut pending: Option<PersistWrite> = None;
        while let Some(effect) = queue.pop_front() {
            match effect {
                BridgeEffect::SendSubscribe { .. } | BridgeEffect::SendUnsubscribe { .. } => {
                    match &effect {
                        BridgeEffect::SendSubscribe {
                            subscription_id, ..
                        } => {
                            self.routes.insert(subscription_id.clone(), key);
                        }
                        BridgeEffect::SendUnsubscribe { subscription_id } => {
                            self.routes.remove(subscription_id);
                        }
                        _ => {}
                    }
                    if let Some(frame) = effect.client_frame() {
                        self.send(frame, out);
                    }
                }
                BridgeEffect::ApplyBatch {
                    ticket,
                    reset,
                    changes,
                    progress,
                    echo,
                    moved_out,
                    ..
                } => {
                    flush(key, pending.take(), out);
                    let echoed = self.echoed(key, echo);
                    let Some(slot) = self.scopes.get_mut(&key) else {
                        return;
                    };
                    if slot.phase == Phase::Subscribing {
                        slot.replaying += changes.len() as u64;
                    }
                    let (change, mut write) = slot.apply(reset, &moved_out, changes);
                    self.emit_change(key, reset, change, &echoed, out);
                    let Some(slot) = self.scopes.get_mut(&key) else {
                        return;
                    };
                    write.shadowed = slot.shadowed(write.upserts.iter().map(|row| row.id.as_str()));
                    pending = Some(write);
                    let more = slot
                        .bridge
                        .handle(BridgeInput::Applied {
                            ticket,
                            result: Ok(()),
                        })
                        .unwrap_or_else(|error| refused(error, &mut *out));
                    if let Some(ReplayProgress { done, total }) = progress {
                        flush(key, pending.take(), out);
                        out.push(ClientEffect::Progress {
                            scope: key,
                            done,
                            total,
                        });
                    }
                    queue.extend(more);
                }
                BridgeEffect::SaveCursor { cursor, .. } => {
                    let Some(slot) = self.scopes.get_mut(&key) else {
                        return;
                    };
                    if is_cursor_after(Some(&cursor), slot.cursor.as_ref()) {
                        if let Some((change, write)) = slot.sweep() {
                            flush(key, pending.take(), out);
                            self.emit_change(key, false, change, &[], out);
                            pending = Some(write);
                        }
                        let Some(slot) = self.scopes.get_mut(&key) else {
                            return;
                        };
                        slot.cursor = Some(cursor.clone());
                        pending.get_or_insert_with(PersistWrite::default).cursor = Some(cursor);
                        flush(key, pending.take(), out);
                    }
                }
                BridgeEffect::Ready { .. } => {
                    let Some(slot) = self.scopes.get_mut(&key) else {
                        return;
                    };
                    if slot.phase == Phase::Subscribing {
                        if let Some((change, write)) = slot.sweep() {
                            flush(key, pending.take(), out);
                            self.emit_change(key, false, change, &[], out);
                            pending = Some(write);
                        }
                        let Some(slot) = self.scopes.get_mut(&key) else {
                            return;
                        };
                        slot.phase = Phase::Live;
                        slot.expired_in_a_row = 0;
                        slot.replayed = slot.replaying;
                        let replayed = slot.replayed;
                        // The server answered a subscription in full: this connection works.
                        self.backoff.reset();
                        // Its catch-up brought the changes of writes confirmed meanwhile.
                        self.scope_live(key, out);
                        out.push(ClientEffect::Ready {
                            scope: key,
                            replayed,
                        });
                    }
                }
                BridgeEffect::MessageRejected { error, .. } => out.push(ClientEffect::Error {
                    scope: Some(key),
                    code: error.code().to_owned(),
                    message: error.to_string(),
                }),
                // Rows are applied in memory and cannot fail; the other two are reported by
                // `channel_error` with the server's code.
                BridgeEffect::ApplyFailed { .. }
                | BridgeEffect::Dropped { .. }
                | BridgeEffect::ChannelFailed { .. }
                | BridgeEffect::SubscribeFailed { .. } => {}
            }
        }
        flush(key, pending, out);
    }

    /// Emits the status and the timer when they changed.
    fn report(&mut self, _now_ms: u64, out: &mut Vec<ClientEffect>) {
        let state = if self.closed {
            ConnectionState::Closed
        } else if self.user_offline {
            ConnectionState::Offline
        } else {
            match self.link {
                Link::Open { .. } => ConnectionState::Open,
                _ if self.browser_offline => ConnectionState::Offline,
                Link::Waiting { .. } => ConnectionState::Reconnecting,
                _ if self.ever_opened || self.backoff.failures() > 0 => {
                    ConnectionState::Reconnecting
                }
                _ => ConnectionState::Connecting,
            }
        };
        let status = ConnectionStatus {
            state,
            reason: if state == ConnectionState::Open {
                None
            } else {
                self.reason.clone()
            },
        };
        if status != self.status {
            self.status = status.clone();
            out.push(ClientEffect::Status(status));
        }
        let timer = match self.link {
            Link::Idle => None,
            Link::Waiting { until_ms } => (!self.browser_offline).then_some(until_ms),
            Link::Token { since_ms, .. } | Link::Opening { since_ms, .. } => {
                Some(since_ms.saturating_add(self.config.connect_timeout_ms))
            }
            Link::Open {
                heard_ms,
                pinged_ms,
                probe_ms,
                ..
            } => {
                let renew = self.renew_at_ms.filter(|_| self.refresh.is_none());
                Some(
                    self.silence_deadline(heard_ms, probe_ms)
                        .min(pinged_ms.saturating_add(self.config.ping_interval_ms))
                        .min(renew.unwrap_or(u64::MAX))
                        .min(self.outbox_deadline().unwrap_or(u64::MAX)),
                )
            }
        };
        if timer != self.timer {
            self.timer = timer;
            out.push(ClientEffect::SetTimer { at_ms: timer });
        }
    }
}

impl ScopeSlot {
    /// Applies one batch to the rows: the net change per row and the write that stores it.
    fn apply(
        &mut self,
        reset: bool,
        moved_out: &[MovedOut],
        mut changes: Vec<RemoteChange>,
    ) -> (RowChange, PersistWrite) {
        if !moved_out.is_empty() {
            // Rows that left as access changed go first, as removals without a seq (their
            // version says nothing about the move); the envelope's rows then apply.
            let mut gone: Vec<RemoteChange> = Vec::new();
            for moved in moved_out {
                let forms = set_of(moved.values.iter().map(routing_form));
                for (id, row) in &self.rows {
                    let hit = row.data.get(&moved.column).is_some_and(|value| {
                        !value.is_null() && forms.contains(&routing_form(&value))
                    });
                    if hit && !gone.iter().any(|g| g.resource_id() == Some(id)) {
                        gone.push(moved_out_change(id));
                    }
                }
            }
            gone.extend(changes);
            changes = gone;
        }
        let mut change = RowChange::default();
        let mut write = PersistWrite {
            forget_cursor: reset,
            ..PersistWrite::default()
        };
        if reset {
            // The rows stay: the full replay that follows overwrites them, and the ones it
            // does not deliver are removed once it is confirmed (the sweep). Their sequences
            // may be of another epoch, so they say nothing about its entries.
            for row in self.rows.values_mut() {
                row.server_sequence = None;
            }
            self.cursor = None;
            self.sweep = Some(BTreeSet::new());
        }
        // Each touched row in first-touch order: its id, its data before the batch and after.
        // A row held points at its entry here through `touched`; a row removed by the batch
        // through `removed` (rare: most batches remove nothing, so it is seldom allocated).
        self.batches += 1;
        let batch = self.batches;
        let mut touched: Vec<Touched> = Vec::with_capacity(changes.len());
        let mut removed: IdMap<usize> = IdMap::default();
        for remote in changes {
            let delete = remote.is_delete();
            let Some(id) = remote.entry.resource_id else {
                continue;
            };
            let sequence = remote.entry.server_sequence;
            if let Some(held) = self.rows.get_mut(&id) {
                if let (Some(old), Some(new)) = (held.server_sequence, sequence) {
                    if new < old {
                        continue;
                    }
                }
                if let Some(swept) = &mut self.sweep {
                    swept.insert(id.clone());
                }
                let at = if held.touched.0 == batch {
                    held.touched.1
                } else {
                    touched.push((id.clone(), Some(Arc::clone(&held.data)), None));
                    touched.len() - 1
                };
                if delete {
                    self.rows.remove(&id);
                    touched[at].2 = None;
                    removed.insert(id, at);
                } else {
                    let data = Arc::new(remote.data.unwrap_or_default());
                    held.server_sequence = sequence;
                    held.data = Arc::clone(&data);
                    held.touched = (batch, at);
                    touched[at].2 = Some((sequence, data));
                }
                continue;
            }
            if let Some(swept) = &mut self.sweep {
                swept.insert(id.clone());
            }
            let at = match removed.remove(&id) {
                Some(at) => at,
                None => {
                    touched.push((id.clone(), None, None));
                    touched.len() - 1
                }
            };
            if delete {
                touched[at].2 = None;
                removed.insert(id, at);
            } else {
                let data = Arc::new(remote.data.unwrap_or_default());
                touched[at].2 = Some((sequence, Arc::clone(&data)));
                self.rows.insert(
                    id,
                    HeldRow {
                        server_sequence: sequence,
                        data,
                        touched: (batch, at),
                    },
                );
            }
        }
        for (id, was, now) in touched {
            match (was, &now) {
                (None, Some((_, now))) => change.inserted.push(ChangedRow::new(&id, now)),
                (Some(was), Some((_, now))) if was != *now => {
                    change.updated.push(ChangedRow::new(&id, now))
                }
                (Some(was), None) => change.removed.push(ChangedRow {
                    id: id.clone(),
                    data: was,
                }),
                _ => {}
            }
            match now {
                Some((server_sequence, data)) => write.upserts.push(StoredRow {
                    id,
                    server_sequence,
                    data,
                }),
                None => write.deletes.push(id),
            }
        }
        (change, write)
    }
}

/// A row one batch touched: its id, its data before the batch, and after it (with its seq).
type Touched = (String, Option<RowData>, Option<(Option<i64>, RowData)>);

impl ScopeSlot {
    /// Ends a sweep: removes the held rows the replay did not deliver.
    fn sweep(&mut self) -> Option<(RowChange, PersistWrite)> {
        let touched = self.sweep.take()?;
        let mut gone: Vec<String> = self
            .rows
            .keys()
            .filter(|id| !touched.contains(*id))
            .cloned()
            .collect();
        gone.sort_unstable();
        if gone.is_empty() {
            return None;
        }
        let mut change = RowChange::default();
        for id in &gone {
            if let Some(row) = self.rows.remove(id) {
                change.removed.push(ChangedRow {
                    id: id.clone(),
                    data: row.data,
                });
            }
        }
        Some((
            change,
            PersistWrite {
                deletes: gone,
                ..PersistWrite::default()
            },
        ))
    }
}

/// The fields of a server frame that tell a channel message and its body apart, the body read
/// in place (other keys are ignored, as [`ServerFrame`] ignores them).
#[derive(serde::Deserialize)]
struct MessageText {
    #[serde(rename = "type")]
    kind: String,
    #[serde(rename = "subscriptionId", default)]
    subscription_id: Option<String>,
    #[serde(default)]
    body: Option<KeptBody>,
}

/// The set of `items`, inserted one by one. `collect()` builds a `BTreeSet` by sorting its
/// items first, which puts a stable sort and a bulk build for each element type into the
/// client's module (kilobytes of wasm each); the sets here hold a batch's ids, a change's
/// rows, one resource type or a move's values, where inserting costs the same.
fn set_of<T: Ord>(items: impl IntoIterator<Item = T>) -> BTreeSet<T> {
    let mut set = BTreeSet::new();
    set.extend(items);
    set
}

/// A bridge refused an input: a broken rule inside this client, reported rather than hidden.
fn refused(error: BridgeError, out: &mut Vec<ClientEffect>) -> Vec<BridgeEffect> {
    out.push(ClientEffect::Error {
        scope: None,
        code: error.code().to_owned(),
        message: error.to_string(),
    });
    Vec::new()
}

fn flush(key: ScopeKey, write: Option<PersistWrite>, out: &mut Vec<ClientEffect>) {
    if let Some(write) = write.filter(|write| !write.is_empty()) {
        out.push(ClientEffect::Persist { scope: key, write });
    }
}

/// The lifetime a JWT gives itself (`exp` − `iat`, in ms), read without verifying it: the
/// server verifies, the client only plans when to ask for the next one. `None` for a token
/// that is not a JWT or lacks either claim. No clock is needed, so any clock may drive the
/// client; a token source that hands out a token issued long before makes the renewal late,
/// and the server's `auth-expired` then asks for one as before.
fn jwt_lifetime_ms(token: &str) -> Option<u64> {
    use base64::Engine as _;
    let mut parts = token.split('.');
    let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    // From text, as every other frame: the byte reader would add its own copy of the parser
    // to the browser package.
    let claims: Value = serde_json::from_str(std::str::from_utf8(&bytes).ok()?).ok()?;
    let lifetime = claims
        .get("exp")?
        .as_i64()?
        .checked_sub(claims.get("iat")?.as_i64()?)?;
    u64::try_from(lifetime)
        .ok()
        .filter(|seconds| *seconds > 0)?
        .checked_mul(1000)
}

/// A removal of a row that left its scope as access changed: no seq, so no version of the row
/// held can outrank it.
fn moved_out_change(id: &str) -> RemoteChange {
    let entry = SyncEntry {
        id: None,
        resource_id: Some(id.to_owned()),
        resource_type: None,
        sync_type: "delete".to_owned(),
        server_sequence: None,
        updated_at: None,
        data: None,
        extra: Map::new(),
    };
    RemoteChange {
        resource_type: String::new(),
        data: None,
        entry,
    }
}
