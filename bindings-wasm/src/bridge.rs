//! `ScopeBridge`: the client side of scope sync. Frames and apply results go in, effects come
//! out: frames to send, batches to apply, cursors to persist, errors to report.
//!
//! Wraps `highwater_engine::scope_sync::realtime_bridge::ScopeBridge`; effects are plain objects tagged by
//! `type`, and the two send effects carry the ready-to-send frame text in `frame`.

use highwater_engine::scope_sync::cursor::SyncCursor as EngineCursor;
use highwater_engine::scope_sync::realtime_bridge::{
    BridgeConfig, BridgeEffect as EngineEffect, BridgeInput, ScopeBridge as EngineBridge,
    ScopeChannel as EngineChannel,
};
use highwater_engine::scope_sync::scope::ScopeDigest;
use highwater_engine::scope_sync::{ServerFrame, SubscribeParams};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tsify::Tsify;
use wasm_bindgen::prelude::*;

use crate::cursor::{cursor_to_js, SyncCursor};
use crate::error::{ErrorCode, Failure};
use crate::json::{from_js, to_js};

/// How a bridge behaves; fixed for its lifetime.
#[derive(Tsify, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ScopeBridgeConfig {
    /// The resource types the local store can apply.
    resource_types: Vec<String>,
    /// This device's origin: envelopes echoing it are dropped (default: none).
    #[tsify(optional, type = "string | null")]
    #[serde(default)]
    local_origin: Option<String>,
    /// Prefix of generated subscription ids (default `"sync-"`).
    #[tsify(optional)]
    #[serde(default)]
    subscription_id_prefix: Option<String>,
    /// Re-subscribe every scope from its persisted cursor after `session-resumed` (default true).
    #[tsify(optional)]
    #[serde(default)]
    reopen_on_resume: Option<bool>,
}

/// One scope to subscribe.
#[derive(Tsify, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ScopeChannel {
    /// The scope's digest (see `scopeDigest`), which names it in effects.
    scope: String,
    /// The `channel-subscribe` params: `resourceType`, attribute-named `conditions`,
    /// `resourceTypes` for the all-types scope, `authenticationToken`, and any other keys.
    #[tsify(type = "Record<string, JsonValue>")]
    params: Map<String, Value>,
    /// The scope's persisted cursor; when given it replaces any `after*` params.
    #[tsify(optional, type = "SyncCursor | null")]
    #[serde(default)]
    after: Option<EngineCursor>,
}

/// How far a replay has come: `done` of `total` entries.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplayProgress {
    #[tsify(type = "number")]
    done: u64,
    #[tsify(type = "number")]
    total: u64,
}

/// An effect for the host to carry out, in order.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
enum BridgeEffect {
    /// Send `frame` (a `channel-subscribe`).
    #[serde(rename_all = "camelCase")]
    SendSubscribe {
        subscription_id: String,
        scope: String,
        #[tsify(type = "Record<string, JsonValue>")]
        params: Map<String, Value>,
        frame: String,
    },
    /// Send `frame` (a `channel-unsubscribe`) if the socket is open.
    #[serde(rename_all = "camelCase")]
    SendUnsubscribe {
        subscription_id: String,
        frame: String,
    },
    /// Apply the changes as one store batch (after clearing the scope when `reset`), then call
    /// `applied(ticket)`.
    #[serde(rename_all = "camelCase")]
    ApplyBatch {
        #[tsify(type = "number")]
        ticket: u64,
        #[tsify(type = "number")]
        generation: u64,
        scope: String,
        subscription_id: String,
        reset: bool,
        changes: Vec<RemoteChange>,
        /// A replay page's `{done, total}` entries; `null` outside a replay.
        #[tsify(type = "ReplayProgress | null")]
        progress: Option<ReplayProgress>,
        /// Rows to take out of the scope before the changes apply, as access changed (a
        /// membership removed): each row whose `column` equals one of `values`. Absent when
        /// none.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        #[tsify(optional)]
        moved_out: Vec<MovedOut>,
    },
    /// Persist `cursor` as the scope's cursor.
    #[serde(rename_all = "camelCase")]
    SaveCursor { scope: String, cursor: SyncCursor },
    /// Every scope is subscribed and caught up.
    #[serde(rename_all = "camelCase")]
    Ready {
        #[tsify(type = "number")]
        generation: u64,
    },
    /// A message was invalid and skipped; `error.code` is stable.
    #[serde(rename_all = "camelCase")]
    MessageRejected {
        scope: String,
        subscription_id: String,
        error: MessageRejection,
    },
    /// The batch with this ticket failed to apply; the cursor did not move.
    #[serde(rename_all = "camelCase")]
    ApplyFailed {
        #[tsify(type = "number")]
        ticket: u64,
        scope: String,
        message: String,
    },
    /// A message was dropped without applying; nothing is wrong.
    #[serde(rename_all = "camelCase")]
    Dropped {
        subscription_id: String,
        reason: DropReason,
    },
    /// The server refused or dropped this subscription.
    #[serde(rename_all = "camelCase")]
    ChannelFailed {
        scope: String,
        subscription_id: String,
        message: String,
    },
    /// The subscribe attempt failed and was torn down; subscribe again to retry.
    #[serde(rename_all = "camelCase")]
    SubscribeFailed {
        #[tsify(type = "number")]
        generation: u64,
        message: String,
    },
}

/// One change of a batch.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct RemoteChange {
    resource_type: String,
    #[tsify(type = "string | null")]
    resource_id: Option<String>,
    /// `"delete"` removes the resource; anything else upserts it.
    sync_type: String,
    /// The row, or `null` when the entry carries none.
    #[tsify(type = "Record<string, JsonValue> | null")]
    data: Option<Map<String, Value>>,
    #[tsify(type = "SyncCursor | null")]
    cursor: Option<SyncCursor>,
    /// The entry as received, scope attributes and unknown keys included.
    #[tsify(type = "Record<string, JsonValue>")]
    entry: Map<String, Value>,
}

/// Rows an envelope takes out of its scope as access changed.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct MovedOut {
    column: String,
    #[tsify(type = "JsonValue[]")]
    values: Vec<Value>,
}

/// Why a message was rejected.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
struct MessageRejection {
    #[tsify(
        type = r#""invalid-envelope" | "missing-resource-type" | "unknown-resource-type" | "bad-data" | "bad-moves""#
    )]
    code: String,
    message: String,
}

#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
enum DropReason {
    Echo,
    StaleSubscription,
    UnknownSubscription,
}

/// A snapshot of the bridge for status displays.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct BridgeStatus {
    state: BridgeState,
    #[tsify(type = "number")]
    generation: u64,
    channels: Vec<ChannelStatus>,
    /// Messages and confirmations waiting in the apply queue.
    queued: usize,
    /// The ticket of the batch being applied.
    #[tsify(type = "number | null")]
    applying: Option<u64>,
}

#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct ChannelStatus {
    scope: String,
    #[tsify(type = "string | null")]
    subscription_id: Option<String>,
    #[tsify(type = "string | null")]
    resource_type: Option<String>,
    /// Confirmed and caught up.
    ready: bool,
    #[tsify(type = "SyncCursor | null")]
    persisted_cursor: Option<SyncCursor>,
    /// The highest cursor applied, possibly not yet persisted.
    #[tsify(type = "SyncCursor | null")]
    watermark: Option<SyncCursor>,
}

#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
enum BridgeState {
    Unsubscribed,
    Subscribing,
    Subscribed,
}

/// The client realtime bridge: one serial apply queue for every scope, monotonic per-scope
/// cursors persisted only once a subscription is confirmed and caught up. Carry out the
/// returned effects in order.
#[wasm_bindgen]
pub struct ScopeBridge {
    bridge: EngineBridge,
}

#[wasm_bindgen]
impl ScopeBridge {
    /// Throws `HW_INVALID_ARGUMENT` for a malformed config.
    #[wasm_bindgen(constructor)]
    pub fn new(
        #[wasm_bindgen(unchecked_param_type = "ScopeBridgeConfig")] config: JsValue,
    ) -> Result<ScopeBridge, Failure> {
        let config: ScopeBridgeConfig = argument(from_js(&config)?, "bridge config")?;
        let defaults = BridgeConfig::default();
        Ok(ScopeBridge {
            bridge: EngineBridge::new(BridgeConfig {
                local_origin: config.local_origin,
                resource_types: config.resource_types.into_iter().collect(),
                subscription_id_prefix: config
                    .subscription_id_prefix
                    .unwrap_or(defaults.subscription_id_prefix),
                reopen_on_resume: config.reopen_on_resume.unwrap_or(defaults.reopen_on_resume),
            }),
        })
    }

    /// Subscribes these scopes (ignored unless unsubscribed). Throws `HW_INVALID_SCOPE` or
    /// `HW_INVALID_ARGUMENT` for a malformed channel, `HW_INVALID_BRIDGE_INPUT` for none, a
    /// repeated scope or a type the store cannot apply.
    #[wasm_bindgen(unchecked_return_type = "BridgeEffect[]")]
    pub fn subscribe(
        &mut self,
        #[wasm_bindgen(unchecked_param_type = "ScopeChannel[]")] channels: JsValue,
    ) -> Result<JsValue, JsValue> {
        let channels: Vec<ScopeChannel> = argument(from_js(&channels)?, "scope channels")?;
        let channels = channels
            .into_iter()
            .map(engine_channel)
            .collect::<Result<_, _>>()?;
        self.handle(BridgeInput::Subscribe { channels })
    }

    /// Feeds one server frame (its text or its parsed object). Frames the bridge does not use
    /// give no effects. Throws `HW_INVALID_FRAME` for a malformed frame.
    #[wasm_bindgen(js_name = handleFrame, unchecked_return_type = "BridgeEffect[]")]
    pub fn handle_frame(
        &mut self,
        #[wasm_bindgen(unchecked_param_type = "string | Record<string, JsonValue>")] frame: JsValue,
    ) -> Result<JsValue, JsValue> {
        let frame = match frame.as_string() {
            Some(text) => ServerFrame::from_json(&text),
            None => ServerFrame::from_value(&from_js(&frame)?),
        }
        .map_err(Failure::from)?;
        match BridgeInput::from_server_frame(frame) {
            Some(input) => self.handle(input),
            None => Ok(js_sys::Array::new().into()),
        }
    }

    /// Reports the outcome of the `applyBatch` effect with this ticket: no `error` if the batch
    /// committed. Throws `HW_INVALID_BRIDGE_INPUT` if it is not the batch in flight.
    #[wasm_bindgen(unchecked_return_type = "BridgeEffect[]")]
    pub fn applied(&mut self, ticket: f64, error: Option<String>) -> Result<JsValue, JsValue> {
        if !(ticket >= 0.0 && ticket.fract() == 0.0 && ticket <= 9_007_199_254_740_991.0) {
            return Err(Failure::new(
                ErrorCode::InvalidArgument,
                format!("expected a batch ticket (a non-negative integer), got {ticket}"),
            )
            .into());
        }
        self.handle(BridgeInput::Applied {
            ticket: ticket as u64,
            result: error.map_or(Ok(()), Err),
        })
    }

    /// Tears everything down: unsubscribes every scope and drops what is queued.
    #[wasm_bindgen(unchecked_return_type = "BridgeEffect[]")]
    pub fn unsubscribe(&mut self) -> Result<JsValue, JsValue> {
        self.handle(BridgeInput::Unsubscribe)
    }

    #[wasm_bindgen(getter, unchecked_return_type = "BridgeState")]
    pub fn state(&self) -> Result<JsValue, JsValue> {
        to_js(&serde_json::to_value(self.bridge.state()).map_err(unserializable)?)
    }

    /// Bumped by every unsubscribe or torn-down attempt.
    #[wasm_bindgen(getter)]
    pub fn generation(&self) -> f64 {
        self.bridge.generation() as f64
    }

    /// The last cursor persisted (or loaded) for a scope of the current subscription.
    #[wasm_bindgen(js_name = persistedCursor, unchecked_return_type = "SyncCursor | null")]
    pub fn persisted_cursor(&self, scope: &str) -> Result<JsValue, JsValue> {
        let scope: ScopeDigest = scope.parse().map_err(Failure::from)?;
        cursor_to_js(self.bridge.persisted_cursor(&scope))
    }

    #[wasm_bindgen(unchecked_return_type = "BridgeStatus")]
    pub fn status(&self) -> Result<JsValue, JsValue> {
        to_js(&serde_json::to_value(self.bridge.status()).map_err(unserializable)?)
    }
}

impl ScopeBridge {
    fn handle(&mut self, input: BridgeInput) -> Result<JsValue, JsValue> {
        let effects = self.bridge.handle(input).map_err(Failure::from)?;
        let effects = effects
            .iter()
            .map(effect_value)
            .collect::<Result<Vec<_>, _>>()?;
        to_js(&Value::Array(effects))
    }
}

/// An effect as JS receives it: the engine's JSON plus, for sends, the frame text.
fn effect_value(effect: &EngineEffect) -> Result<Value, Failure> {
    let mut value = serde_json::to_value(effect).map_err(unserializable)?;
    if let (Some(frame), Value::Object(object)) = (effect.client_frame(), &mut value) {
        object.insert("frame".to_owned(), Value::String(frame.to_json()));
    }
    Ok(value)
}

fn engine_channel(channel: ScopeChannel) -> Result<EngineChannel, Failure> {
    let mut params = SubscribeParams::from_params(&channel.params)?;
    if channel.after.is_some() {
        params.after = channel.after;
    }
    Ok(EngineChannel {
        scope: channel.scope.parse()?,
        params,
    })
}

fn argument<T: serde::de::DeserializeOwned>(value: Value, what: &str) -> Result<T, Failure> {
    serde_json::from_value(value)
        .map_err(|e| Failure::new(ErrorCode::InvalidArgument, format!("invalid {what}: {e}")))
}

/// Engine values always serialize; this only names the impossible case.
fn unserializable(error: serde_json::Error) -> Failure {
    Failure::new(
        ErrorCode::InvalidArgument,
        format!("unserializable bridge value: {error}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use highwater_engine::scope_sync::scope::Scope;
    use serde_json::json;

    fn config() -> BridgeConfig {
        BridgeConfig {
            local_origin: Some("device-1".to_owned()),
            resource_types: ["Task".to_owned()].into_iter().collect(),
            ..BridgeConfig::default()
        }
    }

    fn channel(project: &str, after: Option<EngineCursor>) -> ScopeChannel {
        let Value::Object(conditions) = json!({"project_id": project}) else {
            panic!("an object");
        };
        let Value::Object(params) =
            json!({"resourceType": "Task", "conditions": {"projectId": project}})
        else {
            panic!("an object");
        };
        ScopeChannel {
            scope: Scope::of_type("Task", conditions).digest().to_string(),
            params,
            after,
        }
    }

    fn message(subscription_id: &str, body: Value) -> BridgeInput {
        BridgeInput::ChannelMessage {
            subscription_id: subscription_id.to_owned(),
            body: body.into(),
        }
    }

    fn entry(sequence: i64) -> Value {
        json!({"id": sequence.to_string(), "resourceId": format!("t{sequence}"), "resourceType": "Task",
               "serverSequence": sequence, "syncType": "update", "updatedAt": "2026-07-01T10:00:00.000Z",
               "data": {"id": format!("t{sequence}")}, "projectId": "p1"})
    }

    /// Drives an engine bridge through every kind of effect.
    fn every_kind_of_effect() -> (Vec<EngineEffect>, Vec<Value>) {
        let mut bridge = EngineBridge::new(config());
        let mut effects = Vec::new();
        let mut statuses = Vec::new();
        let after = EngineCursor::new(Some("2".into()), Some(2), "2026-07-01T09:00:00.000Z".into());
        let channels = vec![
            engine_channel(channel("p1", Some(after))).expect("valid"),
            engine_channel(channel("p2", None)).expect("valid"),
        ];
        let mut feed = |bridge: &mut EngineBridge, input: BridgeInput| {
            let out = bridge.handle(input).expect("valid input");
            effects.extend(out);
            statuses.push(serde_json::to_value(bridge.status()).expect("serializes"));
        };
        feed(&mut bridge, BridgeInput::Subscribe { channels });
        feed(
            &mut bridge,
            message("sync-1", json!({"echoOrigin": null, "syncs": [entry(3)]})),
        );
        feed(
            &mut bridge,
            BridgeInput::ChannelSubscribed {
                subscription_id: "sync-1".into(),
            },
        );
        feed(
            &mut bridge,
            BridgeInput::Applied {
                ticket: 1,
                result: Ok(()),
            },
        );
        feed(
            &mut bridge,
            BridgeInput::ChannelSubscribed {
                subscription_id: "sync-2".into(),
            },
        );
        feed(
            &mut bridge,
            message(
                "sync-1",
                json!({"echoOrigin": "device-1", "syncs": [entry(4)]}),
            ),
        );
        feed(&mut bridge, message("sync-1", json!(["not an envelope"])));
        feed(
            &mut bridge,
            message(
                "sync-1",
                json!({"syncs": [{"id": "5", "resourceType": "Task", "data": null}]}),
            ),
        );
        feed(
            &mut bridge,
            BridgeInput::Applied {
                ticket: 2,
                result: Err("disk full".into()),
            },
        );
        feed(
            &mut bridge,
            BridgeInput::ChannelError {
                subscription_id: "sync-2".into(),
                message: "denied".into(),
            },
        );
        feed(&mut bridge, BridgeInput::Unsubscribe);
        feed(
            &mut bridge,
            BridgeInput::Subscribe {
                channels: vec![engine_channel(channel("p3", None)).expect("valid")],
            },
        );
        feed(
            &mut bridge,
            BridgeInput::ChannelError {
                subscription_id: "sync-3".into(),
                message: "denied".into(),
            },
        );
        (effects, statuses)
    }

    #[test]
    fn declared_effects_match_the_engine_json() {
        let (effects, _) = every_kind_of_effect();
        let mut kinds: Vec<String> = Vec::new();
        for effect in &effects {
            let value = effect_value(effect).expect("serializes");
            let declared: BridgeEffect = serde_json::from_value(value.clone())
                .unwrap_or_else(|e| panic!("{value} fits the declaration: {e}"));
            assert_eq!(serde_json::to_value(&declared).expect("serializes"), value);
            kinds.push(value["type"].as_str().unwrap_or_default().to_owned());
        }
        kinds.sort();
        kinds.dedup();
        // The comparison is strict: a key the declaration lacks would fail it.
        assert!(serde_json::from_value::<BridgeEffect>(
            json!({"type": "ready", "generation": 0, "more": 1})
        )
        .is_err());
        assert_eq!(
            kinds,
            [
                "applyBatch",
                "applyFailed",
                "channelFailed",
                "dropped",
                "messageRejected",
                "ready",
                "saveCursor",
                "sendSubscribe",
                "sendUnsubscribe",
                "subscribeFailed"
            ]
        );
    }

    #[test]
    fn declared_status_matches_the_engine_json() {
        let (_, statuses) = every_kind_of_effect();
        for value in statuses {
            let declared: BridgeStatus = serde_json::from_value(value.clone())
                .unwrap_or_else(|e| panic!("{value} fits the declaration: {e}"));
            assert_eq!(serde_json::to_value(&declared).expect("serializes"), value);
        }
    }

    #[test]
    fn send_effects_carry_their_frame() {
        let (effects, _) = every_kind_of_effect();
        let subscribe = effect_value(&effects[0]).expect("serializes");
        let frame: Value =
            serde_json::from_str(subscribe["frame"].as_str().expect("text")).expect("json");
        assert_eq!(frame["type"], json!("channel-subscribe"));
        assert_eq!(frame["subscriptionId"], subscribe["subscriptionId"]);
        assert_eq!(frame["params"], subscribe["params"]);
        assert_eq!(subscribe["params"]["afterServerSequence"], json!(2));
    }

    #[test]
    fn a_given_cursor_replaces_after_params() {
        let mut with_params = channel("p1", None);
        with_params
            .params
            .insert("afterUpdatedAt".into(), json!("2026-07-01T09:00:00.000Z"));
        with_params
            .params
            .insert("afterServerSequence".into(), json!(7));
        assert_eq!(
            engine_channel(with_params)
                .expect("valid")
                .params
                .after
                .and_then(|c| c.server_sequence),
            Some(7)
        );
        let mut both = channel(
            "p1",
            Some(EngineCursor::legacy("2026-07-01T09:00:00.000Z".into())),
        );
        both.params.insert("afterServerSequence".into(), json!(7));
        both.params
            .insert("afterUpdatedAt".into(), json!("2026-07-01T08:00:00.000Z"));
        assert_eq!(
            engine_channel(both).expect("valid").params.after,
            Some(EngineCursor::legacy("2026-07-01T09:00:00.000Z".into()))
        );
    }
}
