//! Session and channel frames (`docs/protocol/scope-sync.md`, "Endpoint and session",
//! "Frames"): one JSON object per WebSocket text frame.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::mutation::{valid_client_id, MutationResult, MAX_MUTATIONS_PER_FRAME};
use crate::scope_sync::coercion::{describe, integer_from_number, IntegerText};

/// The channel type of scope sync.
pub const SYNC_CHANNEL_TYPE: &str = "velocious-sync";

/// A frame the client sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", try_from = "Value")]
pub enum ClientFrame {
    /// Sent right after the socket opens when the client holds a previous session id.
    #[serde(rename_all = "camelCase")]
    SessionResume { session_id: String },
    /// Optional client metadata.
    Metadata { data: Value },
    /// Subscribes `subscription_id` (client-chosen, unique per session) to a channel.
    #[serde(rename_all = "camelCase")]
    ChannelSubscribe {
        subscription_id: String,
        channel_type: String,
        params: Map<String, Value>,
        /// Event-log replay; not used by scope sync.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last_event_id: Option<String>,
    },
    #[serde(rename_all = "camelCase")]
    ChannelUnsubscribe { subscription_id: String },
    /// Application-level heartbeat; the server answers [`ServerFrame::Pong`]. Browsers cannot
    /// see WebSocket protocol pings, so a client detects a half-open socket with this.
    Ping,
    /// Highwater: writes to apply upstream, in order (each read with
    /// [`super::Mutation::parse`]; at most [`MAX_MUTATIONS_PER_FRAME`]). The server answers
    /// [`ServerFrame::MutationResult`].
    #[serde(rename_all = "camelCase")]
    Mutate {
        client_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
        mutations: Vec<Value>,
    },
    /// Highwater: mutations the app's own backend applied (with `highwater.confirm`): answer
    /// each with [`ServerFrame::MutationResult`] once its change has reached this node.
    #[serde(rename_all = "camelCase")]
    AwaitMutations { client_id: String, ids: Vec<u64> },
}

/// A frame the server sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case", try_from = "Value")]
pub enum ServerFrame {
    /// Sent on every new socket.
    #[serde(rename_all = "camelCase")]
    SessionEstablished {
        session_id: String,
        grace_seconds: u64,
    },
    /// The previous session was re-bound; its paused-queue frames follow.
    #[serde(rename_all = "camelCase")]
    SessionResumed { session_id: String },
    /// The session to resume is unknown, expired, or belongs to another identity.
    SessionGone,
    /// A protocol error not tied to a subscription. Highwater adds a stable `code` and, when the
    /// server is about to close for overload or shutdown, `retryAfterMs`: the least delay
    /// before the client reconnects. Velocious peers ignore both keys.
    #[serde(rename_all = "camelCase")]
    Error {
        error: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        retry_after_ms: Option<u64>,
    },
    /// A channel message; for scope sync the body is a [`super::SyncEnvelope`].
    #[serde(rename_all = "camelCase")]
    ChannelMessage {
        subscription_id: String,
        body: Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_id: Option<String>,
    },
    /// Sent after the catch-up replay: from here on, messages are live.
    #[serde(rename_all = "camelCase")]
    ChannelSubscribed { subscription_id: String },
    #[serde(rename_all = "camelCase")]
    ChannelUnsubscribed { subscription_id: String },
    /// The subscription is refused or ended. Highwater adds a stable `code` (for example
    /// `auth-expired`) that a client can act on; velocious peers ignore it.
    #[serde(rename_all = "camelCase")]
    ChannelError {
        subscription_id: String,
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<String>,
    },
    /// The answer to [`ClientFrame::Ping`].
    Pong,
    /// Highwater: what became of mutations of `client_id`, in the order they were applied.
    #[serde(rename_all = "camelCase")]
    MutationResult {
        client_id: String,
        results: Vec<MutationResult>,
    },
    /// Event-log replay could not cover the gap; not used by scope sync.
    #[serde(rename_all = "camelCase")]
    ChannelReplayGap {
        subscription_id: String,
        last_event_id: String,
    },
}

/// Why a frame was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("expected a JSON frame, got invalid JSON ({reason})")]
    NotJson { reason: String },
    #[error("expected a frame object, got {found}")]
    NotObject { found: String },
    #[error("expected a frame with a string `type`, got {found}")]
    MissingType { found: String },
    #[error("expected a known {direction} frame type, got {found:?}")]
    UnknownType {
        direction: &'static str,
        found: String,
    },
    #[error("expected `{field}` in the {frame} frame, got nothing")]
    MissingField {
        frame: &'static str,
        field: &'static str,
    },
    #[error("expected `{field}` in the {frame} frame to be {expected}, got {found}")]
    WrongField {
        frame: &'static str,
        field: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("expected at most {max} items in `{field}` of the {frame} frame, got {found}")]
    TooMany {
        frame: &'static str,
        field: &'static str,
        max: usize,
        found: usize,
    },
}

impl ClientFrame {
    /// Decodes a frame from its text.
    pub fn from_json(text: &str) -> Result<Self, FrameError> {
        Self::from_value(&parse_json(text)?)
    }

    /// Decodes a frame; unknown keys are ignored.
    pub fn from_value(value: &Value) -> Result<Self, FrameError> {
        let (kind, fields) = frame_fields(value, CLIENT_TYPES, "client")?;
        Ok(match kind {
            "session-resume" => ClientFrame::SessionResume {
                session_id: fields.id("sessionId")?,
            },
            "metadata" => ClientFrame::Metadata {
                data: fields.required("data")?.clone(),
            },
            "channel-subscribe" => ClientFrame::ChannelSubscribe {
                subscription_id: fields.id("subscriptionId")?,
                channel_type: fields.id("channelType")?,
                params: fields.object_or_empty("params")?,
                last_event_id: fields.optional_string("lastEventId")?,
            },
            "ping" => ClientFrame::Ping,
            "mutate" => ClientFrame::Mutate {
                client_id: fields.client_id()?,
                token: fields.optional_string("token")?,
                mutations: fields.list("mutations", MAX_MUTATIONS_PER_FRAME)?,
            },
            "await-mutations" => ClientFrame::AwaitMutations {
                client_id: fields.client_id()?,
                ids: fields
                    .list("ids", MAX_MUTATIONS_PER_FRAME)?
                    .iter()
                    .map(|id| id.as_u64().filter(|id| *id > 0))
                    .collect::<Option<Vec<u64>>>()
                    .ok_or_else(|| {
                        fields.wrong(
                            "ids",
                            "an array of positive integers",
                            fields.object.get("ids").unwrap_or(&Value::Null),
                        )
                    })?,
            },
            _ => ClientFrame::ChannelUnsubscribe {
                subscription_id: fields.id("subscriptionId")?,
            },
        })
    }

    /// The frame's text.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The subscription a channel frame concerns.
    pub fn subscription_id(&self) -> Option<&str> {
        match self {
            ClientFrame::ChannelSubscribe {
                subscription_id, ..
            }
            | ClientFrame::ChannelUnsubscribe { subscription_id } => Some(subscription_id),
            ClientFrame::SessionResume { .. }
            | ClientFrame::Metadata { .. }
            | ClientFrame::Ping
            | ClientFrame::Mutate { .. }
            | ClientFrame::AwaitMutations { .. } => None,
        }
    }
}

impl ServerFrame {
    /// Decodes a frame from its text.
    pub fn from_json(text: &str) -> Result<Self, FrameError> {
        let mut value = parse_json(text)?;
        // A channel message's body is nearly all of the frame (a replay page of rows): it is
        // moved into the frame, not copied. `from_value` reads the `Null` left in its place.
        let body = match value.as_object_mut() {
            Some(object)
                if object.get("type").and_then(Value::as_str) == Some("channel-message") =>
            {
                object.get_mut("body").map(std::mem::take)
            }
            _ => None,
        };
        let mut frame = Self::from_value(&value)?;
        if let (ServerFrame::ChannelMessage { body: slot, .. }, Some(body)) = (&mut frame, body) {
            *slot = body;
        }
        Ok(frame)
    }

    /// Decodes a frame; unknown keys are ignored.
    pub fn from_value(value: &Value) -> Result<Self, FrameError> {
        let (kind, fields) = frame_fields(value, SERVER_TYPES, "server")?;
        Ok(match kind {
            "session-established" => ServerFrame::SessionEstablished {
                session_id: fields.id("sessionId")?,
                grace_seconds: fields.count("graceSeconds")?,
            },
            "session-resumed" => ServerFrame::SessionResumed {
                session_id: fields.id("sessionId")?,
            },
            "session-gone" => ServerFrame::SessionGone,
            "error" => ServerFrame::Error {
                error: fields.string("error")?,
                code: fields.optional_string("code")?,
                retry_after_ms: fields.optional_count("retryAfterMs")?,
            },
            "pong" => ServerFrame::Pong,
            "mutation-result" => ServerFrame::MutationResult {
                client_id: fields.client_id()?,
                results: fields
                    .list("results", usize::MAX)?
                    .iter()
                    .map(MutationResult::from_value)
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        fields.wrong(
                            "results",
                            "an array of {id, status, code?, message?, row?}",
                            fields.object.get("results").unwrap_or(&Value::Null),
                        )
                    })?,
            },
            "channel-message" => ServerFrame::ChannelMessage {
                subscription_id: fields.id("subscriptionId")?,
                body: fields.required("body")?.clone(),
                event_id: fields.optional_string("eventId")?,
            },
            "channel-subscribed" => ServerFrame::ChannelSubscribed {
                subscription_id: fields.id("subscriptionId")?,
            },
            "channel-unsubscribed" => ServerFrame::ChannelUnsubscribed {
                subscription_id: fields.id("subscriptionId")?,
            },
            "channel-error" => ServerFrame::ChannelError {
                subscription_id: fields.id("subscriptionId")?,
                message: fields.string("message")?,
                code: fields.optional_string("code")?,
            },
            _ => ServerFrame::ChannelReplayGap {
                subscription_id: fields.id("subscriptionId")?,
                last_event_id: fields.string("lastEventId")?,
            },
        })
    }

    /// The frame's text.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The subscription a channel frame concerns.
    pub fn subscription_id(&self) -> Option<&str> {
        match self {
            ServerFrame::ChannelMessage {
                subscription_id, ..
            }
            | ServerFrame::ChannelSubscribed { subscription_id }
            | ServerFrame::ChannelUnsubscribed { subscription_id }
            | ServerFrame::ChannelError {
                subscription_id, ..
            }
            | ServerFrame::ChannelReplayGap {
                subscription_id, ..
            } => Some(subscription_id),
            ServerFrame::SessionEstablished { .. }
            | ServerFrame::SessionResumed { .. }
            | ServerFrame::SessionGone
            | ServerFrame::Error { .. }
            | ServerFrame::Pong
            | ServerFrame::MutationResult { .. } => None,
        }
    }
}

impl TryFrom<Value> for ClientFrame {
    type Error = FrameError;

    fn try_from(value: Value) -> Result<Self, Self::Error> {
        Self::from_value(&value)
    }
}

impl TryFrom<Value> for ServerFrame {
    type Error = FrameError;

    fn try_from(value: Value) -> Result<Self, FrameError> {
        Self::from_value(&value)
    }
}

const CLIENT_TYPES: &[&str] = &[
    "session-resume",
    "metadata",
    "channel-subscribe",
    "channel-unsubscribe",
    "ping",
    "mutate",
    "await-mutations",
];

const SERVER_TYPES: &[&str] = &[
    "session-established",
    "session-resumed",
    "session-gone",
    "error",
    "channel-message",
    "channel-subscribed",
    "channel-unsubscribed",
    "channel-error",
    "channel-replay-gap",
    "pong",
    "mutation-result",
];

fn parse_json(text: &str) -> Result<Value, FrameError> {
    serde_json::from_str(text).map_err(|error| FrameError::NotJson {
        reason: error.to_string(),
    })
}

/// Finds the frame's `type` among `known` and returns it with a field reader.
fn frame_fields<'a>(
    value: &'a Value,
    known: &[&'static str],
    direction: &'static str,
) -> Result<(&'static str, Fields<'a>), FrameError> {
    let object = value.as_object().ok_or_else(|| FrameError::NotObject {
        found: describe(value),
    })?;
    let kind = match object.get("type") {
        Some(Value::String(kind)) => kind,
        other => {
            return Err(FrameError::MissingType {
                found: other.map_or_else(|| "no type".to_owned(), describe),
            })
        }
    };
    let kind = known
        .iter()
        .copied()
        .find(|known| *known == kind)
        .ok_or_else(|| FrameError::UnknownType {
            direction,
            found: kind.clone(),
        })?;
    Ok((
        kind,
        Fields {
            frame: kind,
            object,
        },
    ))
}

/// Reads one frame's fields, naming the frame and field in every error.
struct Fields<'a> {
    frame: &'static str,
    object: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn required(&self, field: &'static str) -> Result<&'a Value, FrameError> {
        self.object.get(field).ok_or(FrameError::MissingField {
            frame: self.frame,
            field,
        })
    }

    fn wrong(&self, field: &'static str, expected: &'static str, found: &Value) -> FrameError {
        FrameError::WrongField {
            frame: self.frame,
            field,
            expected,
            found: describe(found),
        }
    }

    fn string(&self, field: &'static str) -> Result<String, FrameError> {
        match self.required(field)? {
            Value::String(text) => Ok(text.clone()),
            other => Err(self.wrong(field, "a string", other)),
        }
    }

    /// A non-empty string: session, subscription and channel-type ids.
    fn id(&self, field: &'static str) -> Result<String, FrameError> {
        match self.required(field)? {
            Value::String(text) if !text.is_empty() => Ok(text.clone()),
            other => Err(self.wrong(field, "a non-empty string", other)),
        }
    }

    fn optional_string(&self, field: &'static str) -> Result<Option<String>, FrameError> {
        match self.object.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(other) => Err(self.wrong(field, "a string or null", other)),
        }
    }

    fn object_or_empty(&self, field: &'static str) -> Result<Map<String, Value>, FrameError> {
        match self.object.get(field) {
            None | Some(Value::Null) => Ok(Map::new()),
            Some(Value::Object(object)) => Ok(object.clone()),
            Some(other) => Err(self.wrong(field, "an object", other)),
        }
    }

    fn client_id(&self) -> Result<String, FrameError> {
        match self.required("clientId")? {
            Value::String(id) if valid_client_id(id) => Ok(id.clone()),
            other => Err(self.wrong("clientId", "1 to 64 letters, digits, '-' or '_'", other)),
        }
    }

    /// An array of at most `max` items.
    fn list(&self, field: &'static str, max: usize) -> Result<Vec<Value>, FrameError> {
        match self.required(field)? {
            Value::Array(items) if items.len() <= max => Ok(items.clone()),
            Value::Array(items) => Err(FrameError::TooMany {
                frame: self.frame,
                field,
                max,
                found: items.len(),
            }),
            other => Err(self.wrong(field, "an array", other)),
        }
    }

    fn optional_count(&self, field: &'static str) -> Result<Option<u64>, FrameError> {
        match self.object.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.count(field).map(Some),
        }
    }

    fn count(&self, field: &'static str) -> Result<u64, FrameError> {
        let value = self.required(field)?;
        match value {
            Value::Number(number) => match integer_from_number(number) {
                IntegerText::Integer(count) => u64::try_from(count).ok(),
                IntegerText::NotInteger | IntegerText::OutOfRange => None,
            },
            _ => None,
        }
        .ok_or_else(|| self.wrong(field, "a non-negative integer", value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn session_frames_decode_from_their_wire_text() {
        assert_eq!(
            ServerFrame::from_json(
                r#"{"type":"session-established","sessionId":"abc","graceSeconds":300}"#
            ),
            Ok(ServerFrame::SessionEstablished {
                session_id: "abc".to_owned(),
                grace_seconds: 300
            })
        );
        assert_eq!(
            ServerFrame::from_json(r#"{"type":"session-gone"}"#),
            Ok(ServerFrame::SessionGone)
        );
        assert_eq!(
            ClientFrame::from_json(r#"{"type":"session-resume","sessionId":"old"}"#),
            Ok(ClientFrame::SessionResume {
                session_id: "old".to_owned()
            })
        );
        assert_eq!(
            ServerFrame::from_json(r#"{"type":"error","error":"missing subscriptionId"}"#),
            Ok(ServerFrame::Error {
                error: "missing subscriptionId".to_owned(),
                code: None,
                retry_after_ms: None,
            })
        );
        assert_eq!(
            ServerFrame::from_json(
                r#"{"type":"error","error":"shutting down","code":"shutdown","retryAfterMs":2500}"#
            ),
            Ok(ServerFrame::Error {
                error: "shutting down".to_owned(),
                code: Some("shutdown".to_owned()),
                retry_after_ms: Some(2500),
            })
        );
        assert_eq!(
            ClientFrame::from_json(r#"{"type":"ping"}"#),
            Ok(ClientFrame::Ping)
        );
        assert_eq!(ServerFrame::Pong.to_json(), r#"{"type":"pong"}"#);
        assert_eq!(
            ServerFrame::from_json(r#"{"type":"error","error":"x","retryAfterMs":-5}"#)
                .unwrap_err()
                .to_string(),
            "expected `retryAfterMs` in the error frame to be a non-negative integer, got number -5"
        );
    }

    #[test]
    fn channel_frames_encode_with_their_exact_field_names() {
        let subscribe = ClientFrame::ChannelSubscribe {
            subscription_id: "s1".to_owned(),
            channel_type: SYNC_CHANNEL_TYPE.to_owned(),
            params: Map::new(),
            last_event_id: None,
        };
        assert_eq!(
            subscribe.to_json(),
            r#"{"type":"channel-subscribe","subscriptionId":"s1","channelType":"velocious-sync","params":{}}"#
        );
        let error = ServerFrame::ChannelError {
            subscription_id: "s1".to_owned(),
            message: "Subscription not authorized".to_owned(),
            code: None,
        };
        assert_eq!(
            error.to_json(),
            r#"{"type":"channel-error","subscriptionId":"s1","message":"Subscription not authorized"}"#
        );
        let coded = ServerFrame::ChannelError {
            subscription_id: "s1".to_owned(),
            message: "The token has expired".to_owned(),
            code: Some("auth-expired".to_owned()),
        };
        assert_eq!(
            coded.to_json(),
            r#"{"type":"channel-error","subscriptionId":"s1","message":"The token has expired","code":"auth-expired"}"#
        );
        let gap = ServerFrame::ChannelReplayGap {
            subscription_id: "s2".to_owned(),
            last_event_id: "e9".to_owned(),
        };
        assert_eq!(
            gap.to_json(),
            r#"{"type":"channel-replay-gap","subscriptionId":"s2","lastEventId":"e9"}"#
        );
        assert_eq!(
            ServerFrame::SessionEstablished {
                session_id: "x".to_owned(),
                grace_seconds: 300
            }
            .to_json(),
            r#"{"type":"session-established","sessionId":"x","graceSeconds":300}"#
        );
    }

    #[test]
    fn channel_messages_keep_their_body_and_optional_event_id() {
        let text = r#"{"type":"channel-message","subscriptionId":"s1","body":{"echoOrigin":null,"syncs":[]},"eventId":"e1"}"#;
        let frame = ServerFrame::from_json(text).unwrap();
        assert_eq!(frame.subscription_id(), Some("s1"));
        assert_eq!(frame.to_json(), text);
        let without_event = ServerFrame::from_json(
            r#"{"type":"channel-message","subscriptionId":"s1","body":null}"#,
        )
        .unwrap();
        assert_eq!(
            without_event,
            ServerFrame::ChannelMessage {
                subscription_id: "s1".to_owned(),
                body: Value::Null,
                event_id: None
            }
        );
    }

    /// `from_json` moves a channel message's body instead of copying it: the same frame, or
    /// the same error, as decoding the parsed value.
    #[test]
    fn a_channel_message_from_text_equals_one_from_its_value() {
        for text in [
            r#"{"body":{"syncs":[{"id":1,"data":{"a":[1,{"b":null}]}}],"x":2},"type":"channel-message","subscriptionId":"s1"}"#,
            r#"{"type":"channel-message","subscriptionId":7,"body":{"syncs":[]}}"#,
            r#"{"type":"channel-message","subscriptionId":"s1"}"#,
            r#"{"type":"pong","body":{"kept":"out"}}"#,
        ] {
            let value: Value = serde_json::from_str(text).unwrap();
            assert_eq!(
                ServerFrame::from_json(text),
                ServerFrame::from_value(&value),
                "{text}"
            );
        }
    }

    #[test]
    fn subscribe_params_default_to_empty_and_unknown_keys_are_ignored() {
        let frame = ClientFrame::from_json(
            r#"{"type":"channel-subscribe","subscriptionId":"s1","channelType":"velocious-sync","future":1}"#,
        )
        .unwrap();
        assert_eq!(
            frame,
            ClientFrame::ChannelSubscribe {
                subscription_id: "s1".to_owned(),
                channel_type: "velocious-sync".to_owned(),
                params: Map::new(),
                last_event_id: None
            }
        );
    }

    #[test]
    fn malformed_frames_name_the_field_and_what_arrived() {
        let cases = [
            ("[1]", "expected a frame object, got an array of 1 items"),
            (r#"{"kind":"x"}"#, "expected a frame with a string `type`, got no type"),
            (r#"{"type":7}"#, "expected a frame with a string `type`, got number 7"),
            (r#"{"type":"subscribe"}"#, "expected a known client frame type, got \"subscribe\""),
            (
                r#"{"type":"channel-subscribe","subscriptionId":"s1"}"#,
                "expected `channelType` in the channel-subscribe frame, got nothing",
            ),
            (
                r#"{"type":"channel-subscribe","subscriptionId":1,"channelType":"velocious-sync"}"#,
                "expected `subscriptionId` in the channel-subscribe frame to be a non-empty string, got number 1",
            ),
            (
                r#"{"type":"channel-subscribe","subscriptionId":"s1","channelType":"velocious-sync","params":[]}"#,
                "expected `params` in the channel-subscribe frame to be an object, got an array of 0 items",
            ),
            (
                r#"{"type":"channel-unsubscribe","subscriptionId":""}"#,
                "expected `subscriptionId` in the channel-unsubscribe frame to be a non-empty string, got string \"\"",
            ),
        ];
        for (text, message) in cases {
            assert_eq!(
                ClientFrame::from_json(text).unwrap_err().to_string(),
                message,
                "{text}"
            );
        }
        let grace = ServerFrame::from_json(
            r#"{"type":"session-established","sessionId":"a","graceSeconds":-1}"#,
        );
        assert_eq!(
            grace.unwrap_err().to_string(),
            "expected `graceSeconds` in the session-established frame to be a non-negative integer, got number -1"
        );
        assert!(matches!(
            ClientFrame::from_json("{"),
            Err(FrameError::NotJson { .. })
        ));
        assert!(matches!(
            ServerFrame::from_json(r#"{"type":"channel-subscribe"}"#),
            Err(FrameError::UnknownType {
                direction: "server",
                ..
            })
        ));
    }

    #[test]
    fn frames_deserialize_through_serde_with_the_same_validation() {
        let frame: ClientFrame =
            serde_json::from_value(json!({"type": "channel-unsubscribe", "subscriptionId": "s3"}))
                .unwrap();
        assert_eq!(frame.subscription_id(), Some("s3"));
        assert!(
            serde_json::from_value::<ServerFrame>(json!({"type": "channel-subscribed"})).is_err()
        );
    }

    fn id() -> impl Strategy<Value = String> {
        "[a-z0-9-]{1,8}"
    }

    fn server_frame() -> impl Strategy<Value = ServerFrame> {
        prop_oneof![
            (id(), any::<u32>()).prop_map(|(session_id, grace)| ServerFrame::SessionEstablished {
                session_id,
                grace_seconds: u64::from(grace)
            }),
            id().prop_map(|session_id| ServerFrame::SessionResumed { session_id }),
            Just(ServerFrame::SessionGone),
            (".*", prop::option::of(id()), prop::option::of(any::<u32>())).prop_map(
                |(error, code, retry)| ServerFrame::Error {
                    error,
                    code,
                    retry_after_ms: retry.map(u64::from),
                }
            ),
            Just(ServerFrame::Pong),
            (id(), prop::option::of(id()), any::<i64>()).prop_map(
                |(subscription_id, event_id, n)| {
                    ServerFrame::ChannelMessage {
                        subscription_id,
                        body: json!({"echoOrigin": null, "syncs": [{"serverSequence": n}]}),
                        event_id,
                    }
                }
            ),
            id().prop_map(|subscription_id| ServerFrame::ChannelSubscribed { subscription_id }),
            id().prop_map(|subscription_id| ServerFrame::ChannelUnsubscribed { subscription_id }),
            (id(), ".*", prop::option::of(id())).prop_map(|(subscription_id, message, code)| {
                ServerFrame::ChannelError {
                    subscription_id,
                    message,
                    code,
                }
            }),
            (id(), id()).prop_map(|(subscription_id, last_event_id)| {
                ServerFrame::ChannelReplayGap {
                    subscription_id,
                    last_event_id,
                }
            }),
        ]
    }

    fn client_frame() -> impl Strategy<Value = ClientFrame> {
        prop_oneof![
            id().prop_map(|session_id| ClientFrame::SessionResume { session_id }),
            any::<i64>().prop_map(|n| ClientFrame::Metadata {
                data: json!({"n": n})
            }),
            (id(), id(), prop::option::of(id()), any::<i64>()).prop_map(
                |(subscription_id, channel_type, last_event_id, n)| ClientFrame::ChannelSubscribe {
                    subscription_id,
                    channel_type,
                    params: Map::from_iter([("afterServerSequence".to_owned(), json!(n))]),
                    last_event_id,
                }
            ),
            id().prop_map(|subscription_id| ClientFrame::ChannelUnsubscribe { subscription_id }),
            Just(ClientFrame::Ping),
        ]
    }

    proptest! {
        #[test]
        fn server_frames_round_trip_through_their_text(frame in server_frame()) {
            prop_assert_eq!(ServerFrame::from_json(&frame.to_json()), Ok(frame));
        }

        #[test]
        fn client_frames_round_trip_through_their_text(frame in client_frame()) {
            prop_assert_eq!(ClientFrame::from_json(&frame.to_json()), Ok(frame));
        }
    }
}
