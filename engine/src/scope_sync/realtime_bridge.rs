//! The client side of scope sync: subscriptions per scope, one serial apply queue, and
//! monotonic per-scope cursors, as velocious' realtime bridge keeps them.
//!
//! [`ScopeBridge`] is a sans-IO state machine. The host (the WASM `ScopeBridge` class driven by
//! a browser client, or a native client) turns WebSocket frames and its own results into
//! [`BridgeInput`]s and carries out the returned [`BridgeEffect`]s in order: send a frame, apply
//! a batch to the local store, persist a cursor, report an error.
//!
//! Lifecycle: `Subscribe` sends one `channel-subscribe` per scope with the scope's persisted
//! cursor as `after*` params; the server replays what the scope missed, then confirms with
//! `channel-subscribed`; `Ready` is emitted once every scope is confirmed and its replay applied.
//! `Unsubscribe` bumps the generation: everything still queued from before is dropped.
//!
//! Apply queue: every channel message, from every scope, joins one FIFO queue. At most one
//! [`BridgeEffect::ApplyBatch`] is outstanding; the next is emitted only after the host answers
//! with [`BridgeInput::Applied`], so batches apply strictly in arrival order. A message that
//! fails (invalid envelope, unknown type, or a failed apply) is reported and the queue goes on.
//!
//! Cursors: after a batch applies, the scope's in-memory watermark moves to the batch's highest
//! entry cursor if that is later (`docs/protocol/scope-sync.md`, "Comparing cursors"), and
//! [`BridgeEffect::SaveCursor`] is emitted only when the persisted cursor actually changes, so a
//! persisted cursor never moves backwards.
//!
//! Hazards designed out (`docs/protocol/scope-sync.md`, "Hazards"):
//! - P3: live rows interleave with replay pages, so a live row can be applied before lower
//!   replay rows arrive. No cursor is persisted for a subscription until its `channel-subscribed`
//!   has passed through the apply queue (that is, until every replay page before it was
//!   applied); the advancement is buffered in memory and persisted then.
//! - P19: a failing message never stalls or poisons the queue.
//! - P10: an `Unsubscribe` retires the attempt in flight; a following `Subscribe` starts afresh.
//! - P1/P2: on `session-resumed` (optionally) and on `session-gone`, each scope re-subscribes
//!   from its persisted cursor with a fresh subscription id, so frames lost on a dead socket are
//!   replayed and frames for retired ids are ignored. Duplicates never regress the cursor.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::scope_sync::cursor::{is_cursor_after, SyncCursor};
use crate::scope_sync::replay::is_reset;
use crate::scope_sync::scope::ScopeDigest;
use crate::scope_sync::{
    ClientFrame, Echo, EnvelopeError, EnvelopeWithRows, RowText, ServerFrame, SubscribeParams,
    SyncEntry, SyncEnvelope, SYNC_CHANNEL_TYPE,
};

/// How a bridge behaves; fixed for its lifetime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BridgeConfig {
    /// This device's origin. Envelopes whose `echoOrigin` equals it are the device's own
    /// changes coming back and are dropped (without moving the cursor). `None` drops nothing.
    pub local_origin: Option<String>,
    /// The resource types the local store can apply. An entry of any other type fails its
    /// message loudly; a scope of any other type cannot be subscribed.
    pub resource_types: BTreeSet<String>,
    /// Prefix of the subscription ids the bridge generates (`<prefix><n>`), so they cannot
    /// collide with other channels on a shared socket.
    pub subscription_id_prefix: String,
    /// Re-subscribe every scope from its persisted cursor after `session-resumed`. The server's
    /// resume replay starts from what it *sent*, so frames lost on a half-open socket or dropped
    /// from its paused queue would be skipped (`scope-sync.md`, hazard P1); re-subscribing
    /// trades them for duplicates. It also gives the resume replay a `channel-subscribed` end
    /// marker, which the guard against hazard P3 needs. Default: true.
    pub reopen_on_resume: bool,
}

impl Default for BridgeConfig {
    fn default() -> Self {
        Self {
            local_origin: None,
            resource_types: BTreeSet::new(),
            subscription_id_prefix: "sync-".to_owned(),
            reopen_on_resume: true,
        }
    }
}

/// One scope to subscribe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeChannel {
    /// Identifies the scope in effects (and the host's scope row).
    pub scope: ScopeDigest,
    /// The subscribe params: attribute-named conditions, `resourceType`, `resourceTypes` for the
    /// all-types scope, the injected token, the request context. `after` is the scope's
    /// persisted cursor (`None` if never synced); the bridge keeps it current on re-subscribes.
    pub params: SubscribeParams,
}

/// The bridge's lifecycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum BridgeState {
    Unsubscribed,
    /// Subscriptions are out and not all confirmed and caught up (also after a re-subscribe).
    Subscribing,
    /// Every scope is confirmed and its replay applied; messages are live.
    Subscribed,
}

/// What the host tells the bridge.
#[derive(Debug, Clone, PartialEq)]
pub enum BridgeInput {
    /// Subscribe these scopes. Idempotent and single-flight: ignored unless `Unsubscribed`
    /// (wait for [`BridgeEffect::Ready`]). Each channel's `params.after` is its persisted cursor.
    Subscribe { channels: Vec<ScopeChannel> },
    /// A `channel-subscribed` frame: that subscription's replay is complete on the server.
    ChannelSubscribed { subscription_id: String },
    /// A `channel-message` frame with its raw body.
    ChannelMessage {
        subscription_id: String,
        body: MessageBody,
    },
    /// A `channel-error` frame: the server refused or dropped that subscription.
    ChannelError {
        subscription_id: String,
        message: String,
    },
    /// The host finished the [`BridgeEffect::ApplyBatch`] with this ticket: `Ok` if the batch
    /// (and, for a reset batch, the clearing) committed, `Err` with a description if it did not.
    Applied {
        ticket: u64,
        result: Result<(), String>,
    },
    /// Tear everything down: bump the generation, close every subscription, drop what is
    /// queued. A batch already handed to the host still gets its `Applied`.
    Unsubscribe,
    /// A `session-resumed` frame: the previous session was re-bound on a new socket.
    SessionResumed,
    /// A `session-gone` frame: the server forgot the session and its subscriptions.
    SessionGone,
    /// A fresh token before the old one expires: every open subscription is opened again with
    /// it (fresh ids, from the persisted cursor) and the old ones unsubscribed.
    Renew {
        authentication_token: Option<String>,
    },
}

impl BridgeInput {
    /// The input a server frame stands for; `None` for frames the bridge does not use.
    pub fn from_server_frame(frame: ServerFrame) -> Option<Self> {
        match frame {
            ServerFrame::ChannelMessage {
                subscription_id,
                body,
                ..
            } => Some(BridgeInput::ChannelMessage {
                subscription_id,
                body: MessageBody::Value(body),
            }),
            ServerFrame::ChannelSubscribed { subscription_id } => {
                Some(BridgeInput::ChannelSubscribed { subscription_id })
            }
            ServerFrame::ChannelError {
                subscription_id,
                message,
                ..
            } => Some(BridgeInput::ChannelError {
                subscription_id,
                message,
            }),
            ServerFrame::SessionResumed { .. } => Some(BridgeInput::SessionResumed),
            ServerFrame::SessionGone => Some(BridgeInput::SessionGone),
            ServerFrame::SessionEstablished { .. }
            | ServerFrame::Error { .. }
            | ServerFrame::Pong
            | ServerFrame::MutationResult { .. }
            | ServerFrame::ChannelUnsubscribed { .. }
            | ServerFrame::ChannelReplayGap { .. } => None,
        }
    }
}

/// A `channel-message` body: decoded, its text, or read with the frame
/// ([`KeptBody`](crate::scope_sync::KeptBody), whose entries come without their other keys); in
/// the last two, rows are kept as text (see [`RowText`]).
#[derive(Debug, Clone)]
pub enum MessageBody {
    Value(Value),
    Text(Box<RawValue>),
    Kept(Box<EnvelopeWithRows>),
}

impl PartialEq for MessageBody {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (MessageBody::Value(a), MessageBody::Value(b)) => a == b,
            (MessageBody::Text(a), MessageBody::Text(b)) => a.get() == b.get(),
            (MessageBody::Kept(a), MessageBody::Kept(b)) => {
                a.0 == b.0
                    && a.1.len() == b.1.len()
                    && a.1.iter().zip(&b.1).all(|(x, y)| {
                        x.as_deref().map(RawValue::get) == y.as_deref().map(RawValue::get)
                    })
            }
            _ => false,
        }
    }
}

impl From<Value> for MessageBody {
    fn from(value: Value) -> Self {
        MessageBody::Value(value)
    }
}

impl std::fmt::Display for MessageBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MessageBody::Value(value) => write!(f, "{value}"),
            MessageBody::Text(text) => f.write_str(text.get()),
            MessageBody::Kept(kept) => {
                // The body as it came: each row back in its entry.
                let (envelope, rows) = kept.as_ref();
                let mut whole = envelope.clone();
                for (entry, row) in whole.syncs.iter_mut().zip(rows) {
                    if let Some(row) = row {
                        entry.data = serde_json::from_str(row.get()).ok();
                    }
                }
                write!(f, "{}", whole.to_json())
            }
        }
    }
}

/// `progress: {done, total}` of a replay page envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReplayProgress {
    pub done: u64,
    pub total: u64,
}

/// One entry of a batch, validated and with its type resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteChange {
    /// The entry's own type, or the channel's default when the entry has no `resourceType` key.
    pub resource_type: String,
    /// The row (`data`, parsed when it came as a JSON string); `None` for null or absent data.
    pub data: Option<RowText>,
    /// The entry as received, with scope attributes and unknown keys (none when the body was
    /// read with its frame, [`MessageBody::Kept`]), but for a `data` object:
    /// that is moved to [`RemoteChange::data`] rather than held twice (a replay page is mostly
    /// rows). [`RemoteChange::received`] gives the whole entry back.
    pub entry: SyncEntry,
}

impl RemoteChange {
    /// Whether the entry removes the resource (`"delete"`; anything else upserts it).
    pub fn is_delete(&self) -> bool {
        self.entry.is_delete()
    }

    /// The resource the entry changes (its `resourceId`).
    pub fn resource_id(&self) -> Option<&str> {
        self.entry.resource_id.as_deref()
    }

    /// The entry's change-feed position, if it has one.
    pub fn cursor(&self) -> Option<SyncCursor> {
        self.entry.cursor()
    }

    /// The entry as received, `data` included.
    pub fn received(&self) -> SyncEntry {
        let mut entry = self.entry.clone();
        if entry.data.is_none() {
            entry.data = self.data.as_ref().map(|row| Value::Object(row.to_map()));
        }
        entry
    }
}

/// Rows of a scope an envelope takes out as access changed: every row whose `column` equals
/// one of `values` (compared as conditions compare for equality).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct MovedOut {
    pub column: String,
    pub values: Vec<Value>,
}

/// The envelope's moves (its [`MOVES_KEY`](crate::scope_sync::MOVES_KEY)), if any.
fn moved_out(envelope: &SyncEnvelope) -> Result<Vec<MovedOut>, MessageError> {
    let Some(moves) = envelope.extra.get(crate::scope_sync::MOVES_KEY) else {
        return Ok(Vec::new());
    };
    let bad = || MessageError::BadMoves {
        found: crate::scope_sync::coercion::describe(moves).to_string(),
    };
    let out = match moves.get("out") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(out) => out,
    };
    // Read in place as `Vec<MovedOut>`'s `Deserialize` reads objects (other keys ignored),
    // without a serde deserializer over `Value` in the client's module.
    let read = |item: &Value| {
        let item = item.as_object()?;
        Some(MovedOut {
            column: item.get("column")?.as_str()?.to_owned(),
            values: item.get("values")?.as_array()?.clone(),
        })
    };
    out.as_array()
        .and_then(|items| items.iter().map(read).collect())
        .ok_or_else(bad)
}

/// Serialized with the whole entry as received ([`RemoteChange::received`]).
impl Serialize for RemoteChange {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Wire<'a> {
            resource_type: &'a str,
            resource_id: &'a Option<String>,
            sync_type: &'a str,
            data: &'a Option<RowText>,
            cursor: &'a Option<SyncCursor>,
            entry: SyncEntry,
        }
        Wire {
            resource_type: &self.resource_type,
            resource_id: &self.entry.resource_id,
            sync_type: &self.entry.sync_type,
            data: &self.data,
            cursor: &self.cursor(),
            entry: self.received(),
        }
        .serialize(serializer)
    }
}

/// Why a message was dropped without being applied (not an error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum DropReason {
    /// Its `echoOrigin` is this device: the change is already local.
    Echo,
    /// Its subscription was retired (unsubscribe, re-subscribe, failure) before it was applied.
    StaleSubscription,
    /// The subscription id is not one this bridge has open.
    UnknownSubscription,
}

/// Something the host must do or know, in the order given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum BridgeEffect {
    /// Send `channel-subscribe` (channel type `velocious-sync`) with these params; see
    /// [`BridgeEffect::client_frame`].
    #[serde(rename_all = "camelCase")]
    SendSubscribe {
        subscription_id: String,
        scope: ScopeDigest,
        params: Map<String, Value>,
    },
    /// Send `channel-unsubscribe`, if the socket is open. Never close a shared socket for it.
    #[serde(rename_all = "camelCase")]
    SendUnsubscribe { subscription_id: String },
    /// Apply one whole message as ONE store batch (one change notification), then answer with
    /// [`BridgeInput::Applied`] and this ticket. With `reset`, first delete the scope's local
    /// rows and its persisted cursor, in the same transaction: the server found the cursor
    /// older than its retention window and a full-scope replay follows.
    #[serde(rename_all = "camelCase")]
    ApplyBatch {
        ticket: u64,
        generation: u64,
        scope: ScopeDigest,
        subscription_id: String,
        reset: bool,
        changes: Vec<RemoteChange>,
        /// A replay page's `progress`, to report once the batch is applied.
        progress: Option<ReplayProgress>,
        /// The writing client's mutations the batch's upstream transaction applied (the
        /// envelope's `echoOrigin` in its object form).
        #[serde(skip_serializing_if = "Option::is_none")]
        echo: Option<Echo>,
        /// Rows to take out of the scope first, as access changed (the envelope's moves); the
        /// changes then apply.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        moved_out: Vec<MovedOut>,
    },
    /// Persist `cursor` as the scope's cursor (its JSON text in `cursor_json`). Emitted only
    /// when the cursor moves forwards, and only for confirmed, caught-up subscriptions.
    #[serde(rename_all = "camelCase")]
    SaveCursor {
        scope: ScopeDigest,
        cursor: SyncCursor,
    },
    /// Every scope is subscribed and caught up (again, after a re-subscribe).
    #[serde(rename_all = "camelCase")]
    Ready { generation: u64 },
    /// A message was invalid and nothing of it was applied; the queue goes on.
    #[serde(rename_all = "camelCase")]
    MessageRejected {
        scope: ScopeDigest,
        subscription_id: String,
        error: MessageError,
    },
    /// The host could not apply the batch with this ticket; the cursor did not move.
    #[serde(rename_all = "camelCase")]
    ApplyFailed {
        ticket: u64,
        scope: ScopeDigest,
        message: String,
    },
    /// A message was dropped without applying; nothing is wrong.
    #[serde(rename_all = "camelCase")]
    Dropped {
        subscription_id: String,
        reason: DropReason,
    },
    /// The server sent `channel-error` for this subscription; it is closed.
    #[serde(rename_all = "camelCase")]
    ChannelFailed {
        scope: ScopeDigest,
        subscription_id: String,
        message: String,
    },
    /// The subscribe attempt failed before it was ever ready (or lost its last channel) and
    /// was torn down; the bridge is `Unsubscribed` and may be subscribed again.
    #[serde(rename_all = "camelCase")]
    SubscribeFailed { generation: u64, message: String },
}

impl BridgeEffect {
    /// The frame to send for `SendSubscribe` and `SendUnsubscribe`.
    pub fn client_frame(&self) -> Option<ClientFrame> {
        match self {
            BridgeEffect::SendSubscribe {
                subscription_id,
                params,
                ..
            } => Some(ClientFrame::ChannelSubscribe {
                subscription_id: subscription_id.clone(),
                channel_type: SYNC_CHANNEL_TYPE.to_owned(),
                params: params.clone(),
                last_event_id: None,
            }),
            BridgeEffect::SendUnsubscribe { subscription_id } => {
                Some(ClientFrame::ChannelUnsubscribe {
                    subscription_id: subscription_id.clone(),
                })
            }
            _ => None,
        }
    }
}

/// Why a message was rejected. The whole message is skipped and no cursor moves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// Not an envelope object, or an entry of the wrong shape.
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    #[error("expected sync entry {index} to name its resourceType, got {found}")]
    MissingResourceType { index: usize, found: &'static str },
    #[error("expected sync entry {index} to be of a resource type this client applies, got {resource_type:?}")]
    UnknownResourceType { index: usize, resource_type: String },
    #[error("sync entry {index} has unusable data: {source}")]
    BadData { index: usize, source: EnvelopeError },
    #[error("expected the envelope's moves to be {{\"out\": [{{\"column\": name, \"values\": [...]}}]}}, got {found}")]
    BadMoves { found: String },
}

impl MessageError {
    /// A stable code for bindings.
    pub fn code(&self) -> &'static str {
        match self {
            MessageError::Envelope(_) => "invalid-envelope",
            MessageError::MissingResourceType { .. } => "missing-resource-type",
            MessageError::UnknownResourceType { .. } => "unknown-resource-type",
            MessageError::BadData { .. } => "bad-data",
            MessageError::BadMoves { .. } => "bad-moves",
        }
    }
}

impl Serialize for MessageError {
    /// `{code, message}`, the shape bindings turn into an error object.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut object = Map::new();
        object.insert("code".to_owned(), Value::from(self.code()));
        object.insert("message".to_owned(), Value::from(self.to_string()));
        object.serialize(serializer)
    }
}

/// Why the bridge refused an input: the host broke the contract.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BridgeError {
    #[error("expected at least one scope channel to subscribe, got none")]
    NothingToSubscribe,
    #[error("expected each scope once per subscribe, got {scope} twice")]
    DuplicateScope { scope: ScopeDigest },
    #[error("expected scope {scope} to be of a resource type this client applies, got {resource_type:?}")]
    UnknownScopeType {
        scope: ScopeDigest,
        resource_type: String,
    },
    #[error("expected an apply result for batch {expected}, got one for batch {got}")]
    UnexpectedTicket { expected: String, got: u64 },
}

impl BridgeError {
    /// A stable code for bindings.
    pub fn code(&self) -> &'static str {
        match self {
            BridgeError::NothingToSubscribe => "nothing-to-subscribe",
            BridgeError::DuplicateScope { .. } => "duplicate-scope",
            BridgeError::UnknownScopeType { .. } => "unknown-scope-type",
            BridgeError::UnexpectedTicket { .. } => "unexpected-ticket",
        }
    }
}

/// One scope channel's status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ChannelStatus {
    pub scope: ScopeDigest,
    /// The open subscription, `None` after a `channel-error`.
    pub subscription_id: Option<String>,
    pub resource_type: Option<String>,
    /// Confirmed and caught up.
    pub ready: bool,
    /// The last cursor persisted (or loaded) for the scope.
    pub persisted_cursor: Option<SyncCursor>,
    /// The highest cursor applied, possibly not yet persisted.
    pub watermark: Option<SyncCursor>,
}

/// A snapshot of the bridge for status displays.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BridgeStatus {
    pub state: BridgeState,
    pub generation: u64,
    pub channels: Vec<ChannelStatus>,
    /// Messages and confirmations waiting in the apply queue.
    pub queued: usize,
    /// The ticket of the batch the host is applying.
    pub applying: Option<u64>,
}

/// A scope of the current generation.
#[derive(Debug, Clone)]
struct ScopeTrack {
    channel: ScopeChannel,
    /// The open subscription; `None` once the server failed it.
    subscription_id: Option<String>,
    /// What the host has stored. Only ever moves forwards, except through a reset batch.
    persisted: Option<SyncCursor>,
    /// The highest entry cursor applied; at or after `persisted`.
    watermark: Option<SyncCursor>,
    /// The open subscription's `channel-subscribed` has passed through the apply queue.
    caught_up: bool,
}

/// An open subscription id.
#[derive(Debug, Clone, Copy)]
struct Subscription {
    scope: ScopeDigest,
    generation: u64,
}

/// An apply-queue item. Both kinds carry their generation so a stale one is never applied.
#[derive(Debug, Clone)]
enum Queued {
    Message {
        generation: u64,
        subscription_id: String,
        body: MessageBody,
    },
    Confirmed {
        generation: u64,
        subscription_id: String,
    },
}

/// The batch the host is applying.
#[derive(Debug, Clone)]
struct InFlight {
    ticket: u64,
    generation: u64,
    scope: ScopeDigest,
    subscription_id: String,
    reset: bool,
    /// The batch's highest entry cursor.
    cursor: Option<SyncCursor>,
}

/// A message that passed validation.
enum Prepared {
    Echo,
    Batch {
        reset: bool,
        changes: Vec<RemoteChange>,
        cursor: Option<SyncCursor>,
        progress: Option<ReplayProgress>,
        echo: Option<Echo>,
        moved_out: Vec<MovedOut>,
    },
}

/// The client realtime bridge. See the module docs.
#[derive(Debug, Clone)]
pub struct ScopeBridge {
    config: BridgeConfig,
    state: BridgeState,
    /// Bumped by `Unsubscribe` and by a torn-down attempt; items of older generations drop.
    generation: u64,
    /// Whether this generation has been `Ready` once; before that a channel error fails the
    /// whole attempt, after it only that channel.
    ready_once: bool,
    scopes: Vec<ScopeTrack>,
    subscriptions: BTreeMap<String, Subscription>,
    queue: VecDeque<Queued>,
    in_flight: Option<InFlight>,
    tickets_issued: u64,
    subscriptions_issued: u64,
}

impl ScopeBridge {
    pub fn new(config: BridgeConfig) -> Self {
        Self {
            config,
            state: BridgeState::Unsubscribed,
            generation: 0,
            ready_once: false,
            scopes: Vec::new(),
            subscriptions: BTreeMap::new(),
            queue: VecDeque::new(),
            in_flight: None,
            tickets_issued: 0,
            subscriptions_issued: 0,
        }
    }

    pub fn state(&self) -> BridgeState {
        self.state
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The last cursor persisted (or loaded) for a scope of the current generation.
    pub fn persisted_cursor(&self, scope: &ScopeDigest) -> Option<&SyncCursor> {
        self.track(scope).and_then(|track| track.persisted.as_ref())
    }

    pub fn status(&self) -> BridgeStatus {
        BridgeStatus {
            state: self.state,
            generation: self.generation,
            channels: self
                .scopes
                .iter()
                .map(|track| ChannelStatus {
                    scope: track.channel.scope,
                    subscription_id: track.subscription_id.clone(),
                    resource_type: track.channel.params.scope.resource_type.clone(),
                    ready: track.subscription_id.is_some() && track.caught_up,
                    persisted_cursor: track.persisted.clone(),
                    watermark: track.watermark.clone(),
                })
                .collect(),
            queued: self.queue.len(),
            applying: self.in_flight.as_ref().map(|batch| batch.ticket),
        }
    }

    /// Feeds one input; returns the effects to carry out, in order.
    pub fn handle(&mut self, input: BridgeInput) -> Result<Vec<BridgeEffect>, BridgeError> {
        let mut effects = Vec::new();
        match input {
            BridgeInput::Subscribe { channels } => self.subscribe(channels, &mut effects)?,
            BridgeInput::ChannelSubscribed { subscription_id } => {
                if let Some(subscription) = self.subscriptions.get(&subscription_id) {
                    self.queue.push_back(Queued::Confirmed {
                        generation: subscription.generation,
                        subscription_id,
                    });
                }
            }
            BridgeInput::ChannelMessage {
                subscription_id,
                body,
            } => match self.subscriptions.get(&subscription_id) {
                Some(subscription) => self.queue.push_back(Queued::Message {
                    generation: subscription.generation,
                    subscription_id,
                    body,
                }),
                None => effects.push(BridgeEffect::Dropped {
                    subscription_id,
                    reason: DropReason::UnknownSubscription,
                }),
            },
            BridgeInput::ChannelError {
                subscription_id,
                message,
            } => self.channel_error(subscription_id, message, &mut effects),
            BridgeInput::Applied { ticket, result } => {
                self.applied(ticket, result, &mut effects)?
            }
            BridgeInput::Unsubscribe => self.unsubscribe(&mut effects),
            BridgeInput::SessionResumed => {
                if self.config.reopen_on_resume {
                    self.resubscribe_all(true, &mut effects);
                }
            }
            BridgeInput::SessionGone => self.resubscribe_all(false, &mut effects),
            BridgeInput::Renew {
                authentication_token,
            } => {
                for track in &mut self.scopes {
                    track.channel.params.authentication_token = authentication_token.clone();
                }
                self.resubscribe_all(true, &mut effects);
            }
        }
        self.pump(&mut effects);
        Ok(effects)
    }

    fn track(&self, scope: &ScopeDigest) -> Option<&ScopeTrack> {
        self.scopes
            .iter()
            .find(|track| &track.channel.scope == scope)
    }

    fn track_mut(&mut self, scope: &ScopeDigest) -> Option<&mut ScopeTrack> {
        self.scopes
            .iter_mut()
            .find(|track| &track.channel.scope == scope)
    }

    fn next_subscription_id(&mut self) -> String {
        self.subscriptions_issued += 1;
        format!(
            "{}{}",
            self.config.subscription_id_prefix, self.subscriptions_issued
        )
    }

    fn subscribe(
        &mut self,
        channels: Vec<ScopeChannel>,
        effects: &mut Vec<BridgeEffect>,
    ) -> Result<(), BridgeError> {
        if self.state != BridgeState::Unsubscribed {
            return Ok(());
        }
        if channels.is_empty() {
            return Err(BridgeError::NothingToSubscribe);
        }
        let mut seen = BTreeSet::new();
        for channel in &channels {
            if !seen.insert(channel.scope) {
                return Err(BridgeError::DuplicateScope {
                    scope: channel.scope,
                });
            }
            if let Some(resource_type) = &channel.params.scope.resource_type {
                if !self.config.resource_types.contains(resource_type) {
                    return Err(BridgeError::UnknownScopeType {
                        scope: channel.scope,
                        resource_type: resource_type.clone(),
                    });
                }
            }
        }
        self.state = BridgeState::Subscribing;
        self.ready_once = false;
        self.scopes = channels
            .into_iter()
            .map(|channel| ScopeTrack {
                persisted: channel.params.after.clone(),
                watermark: channel.params.after.clone(),
                channel,
                subscription_id: None,
                caught_up: false,
            })
            .collect();
        for index in 0..self.scopes.len() {
            self.open_subscription(index, effects);
        }
        Ok(())
    }

    /// Opens a fresh subscription for `scopes[index]` from its persisted cursor.
    fn open_subscription(&mut self, index: usize, effects: &mut Vec<BridgeEffect>) {
        let subscription_id = self.next_subscription_id();
        let generation = self.generation;
        let Some(track) = self.scopes.get_mut(index) else {
            return;
        };
        // From what is stored, not the watermark: an unconfirmed watermark may sit above rows
        // the interrupted replay never delivered.
        track.channel.params.after = track.persisted.clone();
        track.subscription_id = Some(subscription_id.clone());
        track.caught_up = false;
        let scope = track.channel.scope;
        effects.push(BridgeEffect::SendSubscribe {
            subscription_id: subscription_id.clone(),
            scope,
            params: track.channel.params.to_params(),
        });
        self.subscriptions
            .insert(subscription_id, Subscription { scope, generation });
    }

    /// Re-opens every open subscription; `unsubscribe_old` when the server still has them.
    fn resubscribe_all(&mut self, unsubscribe_old: bool, effects: &mut Vec<BridgeEffect>) {
        if self.state == BridgeState::Unsubscribed {
            return;
        }
        for index in 0..self.scopes.len() {
            let Some(old) = self.scopes[index].subscription_id.take() else {
                continue;
            };
            self.subscriptions.remove(&old);
            if unsubscribe_old {
                effects.push(BridgeEffect::SendUnsubscribe {
                    subscription_id: old,
                });
            }
            self.open_subscription(index, effects);
        }
        self.state = BridgeState::Subscribing;
    }

    fn unsubscribe(&mut self, effects: &mut Vec<BridgeEffect>) {
        self.generation += 1;
        for track in &mut self.scopes {
            if let Some(subscription_id) = track.subscription_id.take() {
                effects.push(BridgeEffect::SendUnsubscribe { subscription_id });
            }
        }
        self.subscriptions.clear();
        self.scopes.clear();
        self.state = BridgeState::Unsubscribed;
        self.ready_once = false;
    }

    fn channel_error(
        &mut self,
        subscription_id: String,
        message: String,
        effects: &mut Vec<BridgeEffect>,
    ) {
        let Some(subscription) = self.subscriptions.remove(&subscription_id) else {
            return;
        };
        if let Some(track) = self.track_mut(&subscription.scope) {
            track.subscription_id = None;
            track.caught_up = false;
        }
        effects.push(BridgeEffect::ChannelFailed {
            scope: subscription.scope,
            subscription_id,
            message: message.clone(),
        });
        let any_open = self
            .scopes
            .iter()
            .any(|track| track.subscription_id.is_some());
        if !self.ready_once || !any_open {
            // Like a failed subscribe call: tear the attempt down, retire its generation.
            let generation = self.generation;
            self.unsubscribe(effects);
            effects.push(BridgeEffect::SubscribeFailed {
                generation,
                message,
            });
        } else {
            self.check_ready(effects);
        }
    }

    fn applied(
        &mut self,
        ticket: u64,
        result: Result<(), String>,
        effects: &mut Vec<BridgeEffect>,
    ) -> Result<(), BridgeError> {
        let batch = match self.in_flight.take() {
            Some(batch) if batch.ticket == ticket => batch,
            other => {
                let expected = other
                    .as_ref()
                    .map_or_else(|| "none".to_owned(), |batch| batch.ticket.to_string());
                self.in_flight = other;
                return Err(BridgeError::UnexpectedTicket {
                    expected,
                    got: ticket,
                });
            }
        };
        if let Err(message) = result {
            effects.push(BridgeEffect::ApplyFailed {
                ticket,
                scope: batch.scope,
                message,
            });
            return Ok(());
        }
        if batch.reset {
            self.forget_cursor(&batch, effects);
        }
        if batch.generation != self.generation {
            // Applied for a torn-down generation: a later subscribe replays from the stored
            // cursor, costing duplicates only.
            return Ok(());
        }
        let Some(track) = self.track_mut(&batch.scope) else {
            return Ok(());
        };
        if is_cursor_after(batch.cursor.as_ref(), track.watermark.as_ref()) {
            track.watermark = batch.cursor;
        }
        if track.caught_up {
            persist_if_advanced(track, effects);
        }
        Ok(())
    }

    /// A reset batch committed: the host dropped the scope's rows and stored cursor. A
    /// subscription opened for the scope since the batch was handed out asked the server to
    /// resume from the dropped cursor, and would leave the cleared rows missing; it is reopened
    /// from the whole scope. So is a subscription already caught up: its replay must again end
    /// with `channel-subscribed` before cursors are persisted.
    fn forget_cursor(&mut self, batch: &InFlight, effects: &mut Vec<BridgeEffect>) {
        let Some(index) = self
            .scopes
            .iter()
            .position(|track| track.channel.scope == batch.scope)
        else {
            return;
        };
        let track = &mut self.scopes[index];
        track.persisted = None;
        track.watermark = None;
        let Some(open) = track.subscription_id.clone() else {
            return;
        };
        // A reset on a subscription already confirmed would replay with no
        // `channel-subscribed` to end it (and no guard against hazard P3): reopen it too, so it
        // ends with one.
        if open != batch.subscription_id || track.caught_up {
            self.subscriptions.remove(&open);
            effects.push(BridgeEffect::SendUnsubscribe {
                subscription_id: open,
            });
            self.open_subscription(index, effects);
            self.state = BridgeState::Subscribing;
        }
    }

    /// Works through the queue until a batch is handed to the host or the queue is empty.
    fn pump(&mut self, effects: &mut Vec<BridgeEffect>) {
        while self.in_flight.is_none() {
            let Some(item) = self.queue.pop_front() else {
                break;
            };
            match item {
                Queued::Confirmed {
                    generation,
                    subscription_id,
                } => {
                    let Some(scope) = self.live_scope(&subscription_id, generation) else {
                        continue;
                    };
                    if let Some(track) = self.track_mut(&scope) {
                        track.caught_up = true;
                        persist_if_advanced(track, effects);
                    }
                    self.check_ready(effects);
                }
                Queued::Message {
                    generation,
                    subscription_id,
                    body,
                } => {
                    let Some(scope) = self.live_scope(&subscription_id, generation) else {
                        effects.push(BridgeEffect::Dropped {
                            subscription_id,
                            reason: DropReason::StaleSubscription,
                        });
                        continue;
                    };
                    let default_type = self
                        .track(&scope)
                        .and_then(|track| track.channel.params.scope.resource_type.clone());
                    match self.prepare(body, default_type.as_deref()) {
                        Err(error) => effects.push(BridgeEffect::MessageRejected {
                            scope,
                            subscription_id,
                            error,
                        }),
                        Ok(Prepared::Echo) => effects.push(BridgeEffect::Dropped {
                            subscription_id,
                            reason: DropReason::Echo,
                        }),
                        Ok(Prepared::Batch {
                            reset,
                            changes,
                            cursor,
                            progress,
                            echo,
                            moved_out,
                        }) => {
                            self.tickets_issued += 1;
                            let ticket = self.tickets_issued;
                            self.in_flight = Some(InFlight {
                                ticket,
                                generation,
                                scope,
                                subscription_id: subscription_id.clone(),
                                reset,
                                cursor,
                            });
                            effects.push(BridgeEffect::ApplyBatch {
                                ticket,
                                generation,
                                scope,
                                subscription_id,
                                reset,
                                changes,
                                progress,
                                echo,
                                moved_out,
                            });
                        }
                    }
                }
            }
        }
    }

    /// The scope of a subscription that is still open and of the current generation.
    fn live_scope(&self, subscription_id: &str, generation: u64) -> Option<ScopeDigest> {
        if generation != self.generation {
            return None;
        }
        self.subscriptions
            .get(subscription_id)
            .filter(|subscription| subscription.generation == generation)
            .map(|subscription| subscription.scope)
    }

    fn check_ready(&mut self, effects: &mut Vec<BridgeEffect>) {
        if self.state != BridgeState::Subscribing {
            return;
        }
        let mut open = self
            .scopes
            .iter()
            .filter(|track| track.subscription_id.is_some())
            .peekable();
        if open.peek().is_some() && open.all(|track| track.caught_up) {
            self.state = BridgeState::Subscribed;
            self.ready_once = true;
            effects.push(BridgeEffect::Ready {
                generation: self.generation,
            });
        }
    }

    /// Validates a message body (`scope-sync.md`, "Envelopes") and resolves its entries; the
    /// whole message or nothing.
    fn prepare(
        &self,
        body: MessageBody,
        default_type: Option<&str>,
    ) -> Result<Prepared, MessageError> {
        let (envelope, rows) = match body {
            MessageBody::Value(body) => {
                let envelope = SyncEnvelope::from_owned(body)?;
                let rows = vec![None; envelope.syncs.len()];
                (envelope, rows)
            }
            MessageBody::Text(text) => SyncEnvelope::from_text_keeping_rows(text.get())?,
            MessageBody::Kept(kept) => *kept,
        };
        if let (Some(local), Some(origin)) = (&self.config.local_origin, &envelope.echo_origin) {
            if local == origin {
                return Ok(Prepared::Echo);
            }
        }
        let reset = is_reset(&envelope);
        let cursor = envelope.advanced_cursor(None);
        let progress = replay_progress(&envelope);
        let moved_out = moved_out(&envelope)?;
        let changes = envelope
            .syncs
            .into_iter()
            .zip(rows)
            .enumerate()
            .map(|(index, (entry, row))| self.resolve(index, entry, row, default_type))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Prepared::Batch {
            reset,
            changes,
            cursor,
            progress,
            echo: envelope.echo,
            moved_out,
        })
    }

    /// Resolves one entry; `row` is its `data` text when the body was decoded keeping rows as
    /// text (else `data` is in the entry).
    fn resolve(
        &self,
        index: usize,
        mut entry: SyncEntry,
        row: Option<Box<RawValue>>,
        default_type: Option<&str>,
    ) -> Result<RemoteChange, MessageError> {
        let resource_type = entry.resolved_resource_type(default_type).ok_or(
            MessageError::MissingResourceType {
                index,
                found: if entry.resource_type.is_some() {
                    "null"
                } else {
                    "nothing (and the channel has no default type)"
                },
            },
        )?;
        if !self.config.resource_types.contains(&resource_type) {
            return Err(MessageError::UnknownResourceType {
                index,
                resource_type,
            });
        }
        let data = match row.map(RowText::from_raw) {
            Some(Ok(row)) => Some(row),
            other => {
                // `null`, or a JSON string holding the row (the legacy form): decoded.
                if let Some(Err(raw)) = other {
                    entry.data = serde_json::from_str(raw.get()).ok();
                }
                entry
                    .take_data_object()
                    .map_err(|source| MessageError::BadData { index, source })?
                    .map(RowText::from)
            }
        };
        Ok(RemoteChange {
            resource_type,
            data,
            entry,
        })
    }
}

/// `progress: {done, total}` of a replay page envelope.
fn replay_progress(envelope: &SyncEnvelope) -> Option<ReplayProgress> {
    let progress = envelope.extra.get("progress")?;
    Some(ReplayProgress {
        done: progress.get("done")?.as_u64()?,
        total: progress.get("total")?.as_u64()?,
    })
}

/// Persists the watermark if it is after what is stored.
fn persist_if_advanced(track: &mut ScopeTrack, effects: &mut Vec<BridgeEffect>) {
    if let Some(watermark) = &track.watermark {
        if is_cursor_after(Some(watermark), track.persisted.as_ref()) {
            track.persisted = Some(watermark.clone());
            effects.push(BridgeEffect::SaveCursor {
                scope: track.channel.scope,
                cursor: watermark.clone(),
            });
        }
    }
}

#[cfg(test)]
mod tests;
