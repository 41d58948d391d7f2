//! `SyncClientCore`: the engine's scope-sync client driven over gloo-net's WebSocket and
//! `setTimeout`. The TypeScript `HighwaterClient` wraps it with handles and stores.
//!
//! This module only carries out effects and converts types: every connect, retry, heartbeat,
//! token and cursor rule is `highwater_engine::scope_sync::client`'s. The effects it does not carry out
//! itself (rows changed, what to persist, progress, ready, failures, status) go to the `emit`
//! callback as plain objects tagged by `type` (`ClientEvent`).

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::pin::pin;
use std::rc::Rc;

use futures::channel::mpsc::{unbounded, UnboundedReceiver, UnboundedSender};
use futures::future::{poll_fn, select, Either};
use futures::{SinkExt, StreamExt};
use gloo_net::websocket::futures::WebSocket;
use gloo_net::websocket::{Message, State, WebSocketError};
use gloo_timers::callback::Timeout;
use highwater_engine::scope_sync::client::{
    ChangedRow, ClientConfig, ClientEffect, ClientInput, SocketId, StoredRow as EngineRow,
    StoredScope, SyncClient,
};
use highwater_engine::scope_sync::cursor::SyncCursor as EngineCursor;
use highwater_engine::scope_sync::SubscribeParams;
use highwater_engine::scope_sync::{Mutation as EngineMutation, MutationOp, MutationResult};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tsify::Tsify;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::{spawn_local, JsFuture};

use crate::cursor::{cursor_arg, cursor_to_js, SyncCursor};
use crate::error::{ErrorCode, Failure};
use crate::json::{from_js, to_js, to_js_bulk};

/// One row as a store keeps it.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct StoredRow {
    /// The entry's `resourceId`.
    id: String,
    #[tsify(type = "number | bigint | null")]
    server_sequence: Option<i64>,
    /// The replicated columns.
    #[tsify(type = "Record<string, JsonValue>")]
    data: Map<String, Value>,
}

/// What a store holds for a scope.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct StoredScopeData {
    rows: Vec<StoredRow>,
    #[tsify(type = "SyncCursor | null")]
    cursor: Option<SyncCursor>,
}

/// One storage transaction for a scope: apply all of it or none.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct PersistWrite {
    /// Drop the scope's stored cursor first (the server reset the scope). Its rows stay: the
    /// full replay that follows overwrites them, and a later write deletes the ones it did not
    /// deliver once it is confirmed, so a reset never empties a page.
    forget_cursor: bool,
    upserts: Vec<StoredRow>,
    /// `resourceId`s to delete.
    deletes: Vec<String>,
    /// The new cursor; `null` keeps the stored one.
    #[tsify(type = "SyncCursor | null")]
    cursor: Option<SyncCursor>,
}

/// The net change of one applied server transaction, as the core hands it over: each row
/// crosses into JS once, here; `HighwaterClient` keeps them (so `rows()` and the store writes
/// take the same objects) and builds its public `change` event from them. Rows come as arrays
/// of their columns with their `resourceId`s in a parallel array (one object per row for
/// `JSON.parse` to build, and `inserted` is the public event's array as it is).
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct CoreRowChange {
    /// The `resourceId`s of the rows in `inserted`, in the same order.
    inserted_ids: Vec<String>,
    #[tsify(type = "Record<string, JsonValue>[]")]
    inserted: Vec<Map<String, Value>>,
    /// The `resourceId`s of the rows in `updated`, in the same order.
    updated_ids: Vec<String>,
    #[tsify(type = "Record<string, JsonValue>[]")]
    updated: Vec<Map<String, Value>>,
    /// `resourceId`s of the rows removed.
    removed: Vec<String>,
}

/// A row of a [`CoreWrite`] shown with a pending mutation laid over it: the store keeps the
/// server's row, `data`, not the row the client shows; `at` is its place in `upserts`.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct CoreShadowedRow {
    at: u32,
    #[tsify(type = "Record<string, JsonValue>")]
    data: Map<String, Value>,
}

/// A write to a table (`HighwaterClient.mutate`), as the outbox keeps it.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct MutationRecord {
    /// The client's number for it, growing with each mutation.
    id: u64,
    table: String,
    #[tsify(type = "\"insert\" | \"update\" | \"delete\"")]
    op: String,
    #[tsify(type = "Record<string, JsonValue>")]
    row: Map<String, Value>,
    #[tsify(optional)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    if_version: Option<i64>,
}

/// What became of a mutation: `confirmed`, `rejected` (with a `code`: `forbidden`, `invalid`,
/// `constraint`, `conflict`), or `retry` (sent again later).
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct MutationOutcome {
    id: u64,
    #[tsify(type = "\"confirmed\" | \"rejected\" | \"retry\"")]
    status: String,
    #[tsify(optional)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    code: Option<String>,
    #[tsify(optional)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    message: Option<String>,
    /// For `conflict`: the row as it is now (`null` if gone).
    #[tsify(optional, type = "Record<string, JsonValue> | null")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    row: Option<Value>,
}

/// One write of the outbox to its store: apply all of it or none.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct OutboxWrite {
    client_id: String,
    /// The last mutation id given out.
    last_id: u64,
    put: Vec<MutationRecord>,
    /// Ids to delete.
    remove: Vec<u64>,
}

/// A [`PersistWrite`] as the core hands it over: `HighwaterClient` fills each upsert's data
/// from the rows it holds (changed just before, by the same apply), but for the rows in
/// `shadowed`.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct CoreWrite {
    forget_cursor: bool,
    /// The `resourceId`s of the rows to store.
    upserts: Vec<String>,
    /// Each upsert's `serverSequence`, in the order of `upserts`.
    #[tsify(type = "(number | bigint | null)[]")]
    server_sequences: Vec<Option<i64>>,
    shadowed: Vec<CoreShadowedRow>,
    deletes: Vec<String>,
    #[tsify(type = "SyncCursor | null")]
    cursor: Option<SyncCursor>,
}

#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
enum ConnectionState {
    Connecting,
    Open,
    Reconnecting,
    Offline,
    Closed,
}

/// The connection's state, with why (the last disconnect, for example).
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct ConnectionStatus {
    state: ConnectionState,
    #[tsify(optional)]
    reason: Option<String>,
}

/// What the client reports, in order. `scope` is the key given to `subscribe`.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
enum ClientEvent {
    /// The scope's rows changed by one server transaction, a restore, or a reset (`reset`).
    #[serde(rename_all = "camelCase")]
    Changed {
        scope: u32,
        reset: bool,
        change: CoreRowChange,
    },
    /// Write this to the scope's store in one transaction, in order.
    #[serde(rename_all = "camelCase")]
    Persist { scope: u32, write: CoreWrite },
    /// Catch-up replay progress.
    #[serde(rename_all = "camelCase")]
    Progress { scope: u32, done: u32, total: u32 },
    /// The scope is caught up; `replayed` rows came by this catch-up.
    #[serde(rename_all = "camelCase")]
    Ready { scope: u32, replayed: u32 },
    /// The server refused the scope for good, with its stable `code`.
    #[serde(rename_all = "camelCase")]
    ScopeFailed {
        scope: u32,
        code: String,
        message: String,
    },
    /// A survivable problem: a server `error` frame or a frame the client could not read.
    #[serde(rename_all = "camelCase")]
    Error {
        #[tsify(type = "number | null")]
        scope: Option<u32>,
        code: String,
        message: String,
    },
    /// The connection state changed.
    #[serde(rename_all = "camelCase")]
    Status {
        state: ConnectionState,
        #[tsify(optional)]
        reason: Option<String>,
    },
    /// Write this to the outbox's store in one transaction, in order.
    #[serde(rename_all = "camelCase")]
    PersistOutbox { write: OutboxWrite },
    /// A mutation is settled (confirmed, and its change is in the rows; or rejected).
    #[serde(rename_all = "camelCase")]
    Settled { result: MutationOutcome },
    /// Hand these to the app's `upload`, then call `uploaded`.
    #[serde(rename_all = "camelCase")]
    Upload { mutations: Vec<MutationRecord> },
}

/// How the core writes: through the server (`mutate` frames) or the app's `upload`; and the
/// key columns of tables whose key is not `id`.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct CoreOptions {
    #[serde(default)]
    upload: bool,
    #[serde(default)]
    keys: BTreeMap<String, Vec<String>>,
}

/// What the socket task is told to do.
enum Outbound {
    Text(String),
    Close(u16, String),
}

/// Everything the callbacks share.
struct Host {
    machine: RefCell<SyncClient>,
    url: String,
    token: js_sys::Function,
    emit: js_sys::Function,
    sockets: RefCell<BTreeMap<SocketId, UnboundedSender<Outbound>>>,
    timer: RefCell<Option<Timeout>>,
    /// Inputs that arrived while effects were being carried out (a callback re-entered).
    queue: RefCell<VecDeque<ClientInput>>,
    busy: Cell<bool>,
}

/// The scope-sync client core: one socket for every scope, reconnecting and resuming on its
/// own. Use `HighwaterClient`, which wraps it.
#[wasm_bindgen]
pub struct SyncClientCore {
    host: Rc<Host>,
}

#[wasm_bindgen]
impl SyncClientCore {
    /// `token` is called on every connect (and when a token expired) and resolves to a token
    /// or `null`; `emit` receives every `ClientEvent`.
    #[wasm_bindgen(constructor)]
    pub fn new(
        url: String,
        #[wasm_bindgen(unchecked_param_type = "() => Promise<string | null>")]
        token: js_sys::Function,
        #[wasm_bindgen(unchecked_param_type = "(event: ClientEvent) => void")]
        emit: js_sys::Function,
        #[wasm_bindgen(
            unchecked_param_type = "{ upload?: boolean; keys?: Record<string, string[]> } | undefined"
        )]
        options: JsValue,
    ) -> Result<SyncClientCore, Failure> {
        let seed = (js_sys::Math::random() * 9_007_199_254_740_991.0) as u64;
        let options: CoreOptions = if options.is_null() || options.is_undefined() {
            CoreOptions::default()
        } else {
            serde_json::from_value(from_js(&options)?).map_err(|error| {
                Failure::new(
                    ErrorCode::InvalidArgument,
                    format!("expected client options {{upload?, keys?}}: {error}"),
                )
            })?
        };
        let config = ClientConfig {
            upload: options.upload,
            keys: options.keys,
            ..ClientConfig::default()
        };
        Ok(SyncClientCore {
            host: Rc::new(Host {
                machine: RefCell::new(SyncClient::new(config, seed)),
                url,
                token,
                emit,
                sockets: RefCell::new(BTreeMap::new()),
                timer: RefCell::new(None),
                queue: RefCell::new(VecDeque::new()),
                busy: Cell::new(false),
            }),
        })
    }

    /// Gives the core its outbox from the store: the client id, the last mutation id given
    /// out, and the mutations not settled.
    #[wasm_bindgen(js_name = restoreOutbox)]
    pub fn restore_outbox(
        &self,
        client_id: String,
        last_id: f64,
        #[wasm_bindgen(unchecked_param_type = "MutationRecord[]")] pending: JsValue,
    ) -> Result<(), Failure> {
        let pending = match from_js(&pending)? {
            Value::Array(items) => items
                .iter()
                .map(|item| match EngineMutation::parse(item) {
                    Ok(Ok(mutation)) => Ok(mutation),
                    Ok(Err(invalid)) => Err(invalid.to_string()),
                    Err(error) => Err(error.to_string()),
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|error| {
                    Failure::new(
                        ErrorCode::InvalidMutation,
                        format!("the stored outbox holds a mutation that cannot be read: {error}"),
                    )
                })?,
            Value::Null => Vec::new(),
            _ => {
                return Err(Failure::new(
                    ErrorCode::InvalidArgument,
                    "expected the stored mutations as an array",
                ))
            }
        };
        dispatch(
            &self.host,
            ClientInput::RestoreOutbox {
                client_id,
                last_id: last_id.max(0.0) as u64,
                pending,
            },
        );
        Ok(())
    }

    /// Queues a mutation; returns its id. Throws `HW_INVALID_MUTATION` for one the server
    /// would refuse as malformed (or before `restoreOutbox`).
    pub fn mutate(
        &self,
        table: String,
        op: String,
        #[wasm_bindgen(unchecked_param_type = "Record<string, JsonValue>")] row: JsValue,
        if_version: Option<f64>,
    ) -> Result<f64, Failure> {
        let invalid = |message: String| Failure::new(ErrorCode::InvalidMutation, message);
        let op = match op.as_str() {
            "insert" => MutationOp::Insert,
            "update" => MutationOp::Update,
            "delete" => MutationOp::Delete,
            other => {
                return Err(invalid(format!(
                    "expected op \"insert\", \"update\" or \"delete\", got {other:?}"
                )))
            }
        };
        let Value::Object(row) = from_js(&row)? else {
            return Err(invalid(
                "expected the row to be an object of columns".to_owned(),
            ));
        };
        let (queued, effects) = self.host.machine.borrow_mut().mutate(
            now_ms(),
            table,
            op,
            row,
            if_version.map(|v| v as i64),
        );
        for effect in effects {
            carry_out(&self.host, effect);
        }
        queued
            .map(|id| id as f64)
            .map_err(|error| invalid(error.to_string()))
    }

    /// The app's `upload` of `ids` finished: `rejected` lists the ones it refused for good;
    /// `error` says why it failed (the batch is tried again later).
    pub fn uploaded(
        &self,
        ids: Vec<f64>,
        #[wasm_bindgen(unchecked_param_type = "{ id: number; code: string; message: string }[]")]
        rejected: JsValue,
        error: Option<String>,
    ) -> Result<(), Failure> {
        let ids = ids.into_iter().map(|id| id as u64).collect();
        let result = match error {
            Some(error) => Err(error),
            None => {
                let rejected = match from_js(&rejected)? {
                    Value::Array(items) => items
                        .iter()
                        .map(|item| {
                            let mut item = item.clone();
                            if let Some(object) = item.as_object_mut() {
                                object
                                    .entry("status")
                                    .or_insert_with(|| Value::String("rejected".into()));
                            }
                            MutationResult::from_value(&item)
                        })
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| {
                            Failure::new(
                                ErrorCode::InvalidArgument,
                                "expected rejections as [{id, code, message}]",
                            )
                        })?,
                    _ => Vec::new(),
                };
                Ok(rejected)
            }
        };
        dispatch(&self.host, ClientInput::Uploaded { ids, result });
        Ok(())
    }

    /// The `serverSequence` of the server's row `id` in the scope (for `ifVersion`).
    pub fn version(&self, key: u32, id: &str) -> Option<f64> {
        self.host
            .machine
            .borrow()
            .version(key, id)
            .map(|v| v as f64)
    }

    /// The mutations not settled yet, oldest first.
    #[wasm_bindgen(js_name = pendingMutations, unchecked_return_type = "MutationRecord[]")]
    pub fn pending_mutations(&self) -> Result<JsValue, JsValue> {
        let pending: Vec<Value> = self
            .host
            .machine
            .borrow()
            .pending_mutations()
            .iter()
            .map(EngineMutation::to_value)
            .collect();
        to_js(&Value::Array(pending))
    }

    /// Starts connecting.
    pub fn start(&self) {
        dispatch(&self.host, ClientInput::Start);
    }

    /// Subscribes a scope under `key` (`{resourceType, conditions}`), starting from what the
    /// store held. Throws `HW_INVALID_SCOPE` or `HW_INVALID_ARGUMENT` for malformed params,
    /// `HW_INVALID_CURSOR` for a malformed stored cursor.
    pub fn subscribe(
        &self,
        key: u32,
        #[wasm_bindgen(
            unchecked_param_type = "{ resourceType: string; conditions?: Record<string, ScopeCondition> }"
        )]
        params: JsValue,
        #[wasm_bindgen(unchecked_param_type = "StoredScopeData | null")] stored: JsValue,
    ) -> Result<(), Failure> {
        let mut params = match from_js(&params)? {
            Value::Object(params) => params,
            _ => {
                return Err(Failure::new(
                    ErrorCode::InvalidArgument,
                    "expected subscribe params to be an object",
                ))
            }
        };
        params
            .entry("conditions")
            .or_insert_with(|| Value::Object(Map::new()));
        let params = SubscribeParams::from_params(&params)?;
        if params.scope.resource_type.is_none() {
            return Err(Failure::new(
                ErrorCode::InvalidScope,
                "expected a resourceType to subscribe, got none",
            ));
        }
        let stored = stored_scope(&stored)?;
        dispatch(
            &self.host,
            ClientInput::Subscribe {
                scope: key,
                params: Box::new(params),
                stored,
            },
        );
        Ok(())
    }

    pub fn unsubscribe(&self, key: u32) {
        dispatch(&self.host, ClientInput::Unsubscribe { scope: key });
    }

    /// The scope's persisted cursor.
    #[wasm_bindgen(unchecked_return_type = "SyncCursor | null")]
    pub fn cursor(&self, key: u32) -> Result<JsValue, JsValue> {
        cursor_to_js(self.host.machine.borrow().cursor(key))
    }

    /// Rows applied by the scope's last finished catch-up replay.
    pub fn replayed(&self, key: u32) -> f64 {
        self.host.machine.borrow().replayed(key) as f64
    }

    #[wasm_bindgen(unchecked_return_type = "ConnectionStatus")]
    pub fn status(&self) -> Result<JsValue, JsValue> {
        let status = serde_json::to_value(self.host.machine.borrow().status())
            .map_err(|e| Failure::new(ErrorCode::InvalidArgument, e))?;
        to_js(&status)
    }

    #[wasm_bindgen(js_name = browserOnline)]
    pub fn browser_online(&self) {
        dispatch(&self.host, ClientInput::BrowserOnline);
    }

    #[wasm_bindgen(js_name = browserOffline)]
    pub fn browser_offline(&self) {
        dispatch(&self.host, ClientInput::BrowserOffline);
    }

    /// The page became visible again or came back from the back/forward cache: the socket is
    /// probed at once (a ping that must be answered within 3 s) and a backoff wait ends.
    pub fn woke(&self) {
        dispatch(&self.host, ClientInput::Woke);
    }

    #[wasm_bindgen(js_name = goOffline)]
    pub fn go_offline(&self) {
        dispatch(&self.host, ClientInput::GoOffline);
    }

    #[wasm_bindgen(js_name = goOnline)]
    pub fn go_online(&self) {
        dispatch(&self.host, ClientInput::GoOnline);
    }

    /// Closes the socket for good; nothing is reported after the `closed` status.
    pub fn close(&self) {
        dispatch(&self.host, ClientInput::Close);
    }
}

/// `{rows, cursor}` from a store, or nothing.
fn stored_scope(value: &JsValue) -> Result<StoredScope, Failure> {
    if value.is_null() || value.is_undefined() {
        return Ok(StoredScope::default());
    }
    let invalid = |what: &str| {
        Failure::new(
            ErrorCode::InvalidArgument,
            format!("expected stored scope data {{rows, cursor}}, got {what}"),
        )
    };
    let cursor = js_sys::Reflect::get(value, &"cursor".into()).map_err(|_| invalid("no object"))?;
    let cursor: Option<EngineCursor> = cursor_arg(&cursor)?;
    let rows = match from_js(
        &js_sys::Reflect::get(value, &"rows".into()).map_err(|_| invalid("no object"))?,
    )? {
        Value::Array(rows) => rows,
        Value::Null => Vec::new(),
        _ => return Err(invalid("rows that are not an array")),
    };
    let rows = rows
        .into_iter()
        .map(|row| {
            let Value::Object(mut row) = row else {
                return Err(invalid("a row that is not an object"));
            };
            let id = match row.remove("id") {
                Some(Value::String(id)) => id,
                _ => return Err(invalid("a row without a string id")),
            };
            let server_sequence = row.get("serverSequence").and_then(Value::as_i64);
            let data = match row.remove("data") {
                Some(Value::Object(data)) => data,
                _ => return Err(invalid("a row without a data object")),
            };
            Ok(EngineRow {
                id,
                server_sequence,
                data: std::sync::Arc::new(data.into()),
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(StoredScope { rows, cursor })
}

fn now_ms() -> u64 {
    js_sys::Date::now() as u64
}

/// Feeds an input and carries out its effects; inputs from re-entrant callbacks wait their turn.
fn dispatch(host: &Rc<Host>, input: ClientInput) {
    host.queue.borrow_mut().push_back(input);
    if host.busy.replace(true) {
        return;
    }
    loop {
        let next = host.queue.borrow_mut().pop_front();
        let Some(input) = next else {
            break;
        };
        let effects = host.machine.borrow_mut().handle(now_ms(), input);
        for effect in effects {
            carry_out(host, effect);
        }
    }
    host.busy.set(false);
}

fn carry_out(host: &Rc<Host>, effect: ClientEffect) {
    match effect {
        ClientEffect::RequestToken { request } => {
            let called = host.token.call0(&JsValue::NULL);
            let host = Rc::clone(host);
            spawn_local(async move {
                let answer = match called {
                    Ok(value) => JsFuture::from(js_sys::Promise::resolve(&value)).await,
                    Err(error) => Err(error),
                };
                let result = match answer {
                    Ok(value) if value.is_null() || value.is_undefined() => Ok(None),
                    Ok(value) => value.as_string().map(Some).ok_or_else(|| {
                        "expected the token source to give a string or null".to_owned()
                    }),
                    Err(error) => Err(error_text(&error)),
                };
                dispatch(&host, ClientInput::Token { request, result });
            });
        }
        ClientEffect::OpenSocket { socket } => match web_sys::WebSocket::new(&host.url) {
            Ok(raw) => {
                let (sender, receiver) = unbounded();
                host.sockets.borrow_mut().insert(socket, sender);
                spawn_local(run_socket(Rc::clone(host), socket, raw, receiver));
            }
            Err(error) => host
                .queue
                .borrow_mut()
                .push_back(ClientInput::SocketClosed {
                    socket,
                    reason: format!("could not open the socket: {}", error_text(&error)),
                }),
        },
        ClientEffect::Send { socket, text } => {
            if let Some(sender) = host.sockets.borrow().get(&socket) {
                let _ = sender.unbounded_send(Outbound::Text(text));
            }
        }
        ClientEffect::CloseSocket {
            socket,
            code,
            reason,
        } => {
            if let Some(sender) = host.sockets.borrow_mut().remove(&socket) {
                let _ = sender.unbounded_send(Outbound::Close(code, reason));
            }
        }
        ClientEffect::SetTimer { at_ms } => {
            // Dropping a gloo timeout cancels it.
            let replaced = host.timer.borrow_mut().take();
            drop(replaced);
            if let Some(at_ms) = at_ms {
                let delay = at_ms.saturating_sub(now_ms()).min(u32::MAX as u64) as u32;
                let weak = Rc::downgrade(host);
                let timeout = Timeout::new(delay, move || {
                    if let Some(host) = weak.upgrade() {
                        dispatch(&host, ClientInput::Tick);
                    }
                });
                *host.timer.borrow_mut() = Some(timeout);
            }
        }
        report => {
            if let Ok(event) = to_js_bulk(&Emitted(&report)) {
                // A throwing listener must not stop the client.
                let _ = host.emit.call1(&JsValue::NULL, &event);
            }
        }
    }
}

/// An effect as `emit` receives it (the declared [`ClientEvent`]): the engine's own JSON, but
/// for row changes and store writes, whose rows cross once, in the change, with their ids.
struct Emitted<'a>(&'a ClientEffect);

impl Serialize for Emitted<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        match self.0 {
            ClientEffect::Changed {
                scope,
                reset,
                change,
            } => {
                let mut event = serializer.serialize_struct("Changed", 4)?;
                event.serialize_field("type", "changed")?;
                event.serialize_field("scope", scope)?;
                event.serialize_field("reset", reset)?;
                event.serialize_field(
                    "change",
                    &ChangeOut {
                        inserted_ids: Ids(&change.inserted),
                        inserted: Datas(&change.inserted),
                        updated_ids: Ids(&change.updated),
                        updated: Datas(&change.updated),
                        removed: Ids(&change.removed),
                    },
                )?;
                event.end()
            }
            ClientEffect::Persist { scope, write } => {
                let mut event = serializer.serialize_struct("Persist", 3)?;
                event.serialize_field("type", "persist")?;
                event.serialize_field("scope", scope)?;
                event.serialize_field(
                    "write",
                    &WriteOut {
                        forget_cursor: write.forget_cursor,
                        upserts: StoredIds(&write.upserts),
                        server_sequences: Sequences(&write.upserts),
                        shadowed: write
                            .upserts
                            .iter()
                            .enumerate()
                            .filter(|(_, row)| write.shadowed.contains(&row.id))
                            .map(|(at, row)| ShadowedOut {
                                at: at as u32,
                                data: &row.data,
                            })
                            .collect(),
                        deletes: &write.deletes,
                        cursor: write.cursor.as_ref(),
                    },
                )?;
                event.end()
            }
            other => other.serialize(serializer),
        }
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ChangeOut<'a> {
    inserted_ids: Ids<'a>,
    inserted: Datas<'a>,
    updated_ids: Ids<'a>,
    updated: Datas<'a>,
    removed: Ids<'a>,
}

/// The `resourceId`s of changed rows, as an array.
struct Ids<'a>(&'a [ChangedRow]);

impl Serialize for Ids<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|row| row.id.as_str()))
    }
}

/// The columns of changed rows, as an array.
struct Datas<'a>(&'a [ChangedRow]);

impl Serialize for Datas<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|row| &row.data))
    }
}

/// The `resourceId`s of rows to store, as an array.
struct StoredIds<'a>(&'a [EngineRow]);

impl Serialize for StoredIds<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|row| row.id.as_str()))
    }
}

/// The `serverSequence`s of rows to store, as an array.
struct Sequences<'a>(&'a [EngineRow]);

impl Serialize for Sequences<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|row| row.server_sequence))
    }
}

#[derive(Serialize)]
struct ShadowedOut<'a> {
    at: u32,
    data: &'a highwater_engine::scope_sync::client::RowData,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct WriteOut<'a> {
    forget_cursor: bool,
    upserts: StoredIds<'a>,
    server_sequences: Sequences<'a>,
    shadowed: Vec<ShadowedOut<'a>>,
    deletes: &'a [String],
    cursor: Option<&'a EngineCursor>,
}

/// How a socket's connect ended.
enum Opened {
    /// Open, and wrapped in gloo's socket inside the `open` event itself, so no message can
    /// come before its listeners.
    Open(WebSocket),
    /// An `error` or `close` event came first, or gloo refused the socket.
    Failed(String),
}

/// Watches a socket while it connects, with listeners of its own that it removes when dropped.
///
/// Node's WebSocket (undici) fires `error` but never `close` when a connect fails and stays
/// `CONNECTING`, so waiting for gloo's readiness or close would last until the connect timeout.
/// Here `error` while connecting is a failed attempt, in Node and in browsers alike; and as
/// these listeners are removed, no event of the dead socket can reach a dropped closure.
struct Opening {
    raw: web_sys::WebSocket,
    outcome: Rc<RefCell<(Option<Opened>, Option<std::task::Waker>)>>,
    on_open: Closure<dyn FnMut()>,
    on_error: Closure<dyn FnMut()>,
    on_close: Closure<dyn FnMut()>,
}

impl Opening {
    fn watch(raw: &web_sys::WebSocket) -> Opening {
        let outcome: Rc<RefCell<(Option<Opened>, Option<std::task::Waker>)>> =
            Rc::new(RefCell::new((None, None)));
        let settle = |outcome: &Rc<RefCell<(Option<Opened>, Option<std::task::Waker>)>>,
                      result: Opened| {
            let mut cell = outcome.borrow_mut();
            if cell.0.is_none() {
                cell.0 = Some(result);
                if let Some(waker) = cell.1.take() {
                    waker.wake();
                }
            }
        };
        let on_open = {
            let outcome = Rc::clone(&outcome);
            let raw = raw.clone();
            Closure::<dyn FnMut()>::new(move || {
                let result = match WebSocket::try_from(raw.clone()) {
                    Ok(ws) => Opened::Open(ws),
                    Err(error) => Opened::Failed(format!("could not use the socket: {error}")),
                };
                settle(&outcome, result);
            })
        };
        let failed = |reason: &'static str| {
            let outcome = Rc::clone(&outcome);
            Closure::<dyn FnMut()>::new(move || {
                settle(&outcome, Opened::Failed(reason.to_owned()));
            })
        };
        let on_error = failed("could not connect (the socket reported an error)");
        let on_close = failed("could not connect (the socket closed)");
        for (name, listener) in [
            ("open", &on_open),
            ("error", &on_error),
            ("close", &on_close),
        ] {
            let _ = raw.add_event_listener_with_callback(name, listener.as_ref().unchecked_ref());
        }
        Opening {
            raw: raw.clone(),
            outcome,
            on_open,
            on_error,
            on_close,
        }
    }

    /// Waits for the `open` event or a failure.
    async fn done(&self) -> Opened {
        poll_fn(|cx| {
            let mut cell = self.outcome.borrow_mut();
            match cell.0.take() {
                Some(result) => std::task::Poll::Ready(result),
                None => {
                    cell.1 = Some(cx.waker().clone());
                    std::task::Poll::Pending
                }
            }
        })
        .await
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        for (name, listener) in [
            ("open", &self.on_open),
            ("error", &self.on_error),
            ("close", &self.on_close),
        ] {
            let _ = self
                .raw
                .remove_event_listener_with_callback(name, listener.as_ref().unchecked_ref());
        }
    }
}

/// One socket's life: wait for it to open (an `error` while connecting is a failed attempt),
/// then pass frames both ways until it closes or the client closes it. Once open, the gloo
/// socket is dropped only after its close event, so none of its listeners outlives it.
async fn run_socket(
    host: Rc<Host>,
    socket: SocketId,
    raw: web_sys::WebSocket,
    mut outbound: UnboundedReceiver<Outbound>,
) {
    let opening = Opening::watch(&raw);
    let opened = {
        let done = pin!(opening.done());
        match select(done, outbound.next()).await {
            Either::Left((opened, _)) => Ok(opened),
            Either::Right((request, _)) => Err(request),
        }
    };
    drop(opening);
    let mut ws = match opened {
        Err(request) => {
            // The client gave up on this socket while it was connecting.
            close_raw(&raw, request);
            return;
        }
        Ok(Opened::Open(ws)) => ws,
        Ok(Opened::Failed(reason)) => {
            // Closing a socket that failed to connect fires nothing we still listen to.
            let _ = raw.close();
            host.sockets.borrow_mut().remove(&socket);
            dispatch(&host, ClientInput::SocketClosed { socket, reason });
            return;
        }
    };
    if !matches!(ws.state(), State::Open) {
        drain(&mut ws).await;
        host.sockets.borrow_mut().remove(&socket);
        dispatch(
            &host,
            ClientInput::SocketClosed {
                socket,
                reason: "could not connect".to_owned(),
            },
        );
        return;
    }
    dispatch(&host, ClientInput::SocketOpened { socket });
    loop {
        match select(ws.next(), outbound.next()).await {
            Either::Left((Some(Ok(Message::Text(text))), _)) => {
                dispatch(&host, ClientInput::SocketFrame { socket, text })
            }
            Either::Left((Some(Ok(Message::Bytes(_))), _))
            | Either::Left((Some(Err(WebSocketError::ConnectionError)), _)) => {}
            Either::Left((Some(Err(WebSocketError::ConnectionClose(event))), _)) => {
                drain(&mut ws).await;
                host.sockets.borrow_mut().remove(&socket);
                let reason = if event.reason.is_empty() {
                    format!("the socket closed (code {})", event.code)
                } else {
                    format!("the socket closed (code {}: {})", event.code, event.reason)
                };
                dispatch(&host, ClientInput::SocketClosed { socket, reason });
                return;
            }
            Either::Left((Some(Err(_)), _)) => {}
            Either::Left((None, _)) => {
                host.sockets.borrow_mut().remove(&socket);
                dispatch(
                    &host,
                    ClientInput::SocketClosed {
                        socket,
                        reason: "the socket closed".to_owned(),
                    },
                );
                return;
            }
            Either::Right((Some(Outbound::Text(text)), _)) => {
                // A failed send means the socket is closing; its close event follows.
                let _ = ws.send(Message::Text(text)).await;
            }
            Either::Right((request, _)) => {
                close_raw(&raw, request);
                drain(&mut ws).await;
                return;
            }
        }
    }
}

fn close_raw(raw: &web_sys::WebSocket, request: Option<Outbound>) {
    let _ = match request {
        Some(Outbound::Close(code, reason)) => raw.close_with_code_and_reason(code, &reason),
        _ => raw.close(),
    };
}

/// Reads the socket until its close event has passed.
async fn drain(ws: &mut WebSocket) {
    while ws.next().await.is_some() {}
}

fn error_text(error: &JsValue) -> String {
    if let Some(error) = error.dyn_ref::<js_sys::Error>() {
        return String::from(error.message());
    }
    error
        .as_string()
        .unwrap_or_else(|| "an unknown error".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use highwater_engine::scope_sync::client::{
        ConnectionState as EngineState, ConnectionStatus as EngineStatus, PersistWrite as Write,
        RowChange as Change,
    };
    use serde_json::json;

    /// The declared `ClientEvent` type reads every event the engine reports, key for key.
    #[test]
    fn the_declared_events_match_the_engine_json() {
        let Value::Object(data) = json!({"id": "1", "owner": "ada"}) else {
            panic!("an object");
        };
        let cursor = EngineCursor::new(
            Some("1:2".into()),
            Some(2),
            "2026-12-01T12:00:00.000Z".into(),
        );
        let events = [
            ClientEffect::Changed {
                scope: 1,
                reset: true,
                change: Change {
                    inserted: vec![ChangedRow {
                        id: "1".into(),
                        data: std::sync::Arc::new(data.clone().into()),
                    }],
                    updated: vec![],
                    removed: vec![ChangedRow {
                        id: "1".into(),
                        data: std::sync::Arc::new(data.clone().into()),
                    }],
                },
            },
            ClientEffect::Persist {
                scope: 1,
                write: Write {
                    forget_cursor: false,
                    upserts: vec![EngineRow {
                        id: "1".into(),
                        server_sequence: Some(2),
                        data: std::sync::Arc::new(data.clone().into()),
                    }],
                    deletes: vec!["2".into()],
                    cursor: Some(cursor),
                    shadowed: vec!["1".into()],
                },
            },
            ClientEffect::PersistOutbox {
                write: highwater_engine::scope_sync::client::OutboxWrite {
                    client_id: "c1".into(),
                    last_id: 3,
                    put: vec![highwater_engine::scope_sync::Mutation {
                        id: 3,
                        table: "todos".into(),
                        op: MutationOp::Update,
                        row: data.clone(),
                        if_version: Some(9),
                    }],
                    remove: vec![1, 2],
                },
            },
            ClientEffect::Settled {
                result: MutationResult {
                    id: 2,
                    status: highwater_engine::scope_sync::MutationStatus::Rejected,
                    code: Some("conflict".into()),
                    message: Some("changed since".into()),
                    row: Some(Value::Object(data.clone())),
                },
            },
            ClientEffect::Settled {
                result: MutationResult::confirmed(1),
            },
            ClientEffect::Upload {
                mutations: vec![highwater_engine::scope_sync::Mutation {
                    id: 4,
                    table: "todos".into(),
                    op: MutationOp::Delete,
                    row: data.clone(),
                    if_version: None,
                }],
            },
            ClientEffect::Progress {
                scope: 1,
                done: 1,
                total: 2,
            },
            ClientEffect::Ready {
                scope: 1,
                replayed: 3,
            },
            ClientEffect::ScopeFailed {
                scope: 1,
                code: "forbidden".into(),
                message: "no".into(),
            },
            ClientEffect::Error {
                scope: None,
                code: "bad-server-frame".into(),
                message: "x".into(),
            },
            ClientEffect::Status(EngineStatus {
                state: EngineState::Reconnecting,
                reason: Some("cut".into()),
            }),
        ];
        for event in events {
            let value = serde_json::to_value(Emitted(&event)).unwrap();
            let declared: ClientEvent = serde_json::from_value(value.clone())
                .unwrap_or_else(|e| panic!("{value} does not match ClientEvent: {e}"));
            assert_eq!(serde_json::to_value(declared).unwrap(), value);
        }
    }
}
