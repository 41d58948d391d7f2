//! WebSocket application framing: `{"id":n,"msg":M}`, `{"id":n,"batch":[…]}` and `{"ack":n}`
//! (`docs/protocol/change-stream.md`, "Framing"), the shared pre-serialized batch payload, and
//! the sender's ack-order check.

use std::collections::VecDeque;
use std::fmt;

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::{Map, Value};

use super::decode::{self, unexpected, DecodeError, Path, Result};
use super::encode::to_text;
use super::message::{DownstreamMessage, Message, UpstreamMessage};

/// Frame ids must be exact in JavaScript, like every `number` on this protocol.
const MAX_FRAME_ID: u64 = (1 << 53) - 1;

/// One WebSocket text frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame<M> {
    /// `{"id":n,"msg":M}`.
    Message { id: u64, msg: M },
    /// `{"id":n,"batch":[M…]}` (v7+, or legacy `wsBatched`); may be empty.
    Batch { id: u64, batch: Vec<M> },
    /// `{"ack":n}`: frame `n` was consumed.
    Ack { ack: u64 },
}

impl<M> Frame<M> {
    /// The id of an application frame (`None` for an ack).
    pub fn id(&self) -> Option<u64> {
        match self {
            Frame::Message { id, .. } | Frame::Batch { id, .. } => Some(*id),
            Frame::Ack { .. } => None,
        }
    }

    /// The messages this frame carries, in order (none for an ack).
    pub fn messages(&self) -> &[M] {
        match self {
            Frame::Message { msg, .. } => std::slice::from_ref(msg),
            Frame::Batch { batch, .. } => batch,
            Frame::Ack { .. } => &[],
        }
    }

    /// The messages, taken out of the frame.
    pub fn into_messages(self) -> Vec<M> {
        match self {
            Frame::Message { msg, .. } => vec![msg],
            Frame::Batch { batch, .. } => batch,
            Frame::Ack { .. } => Vec::new(),
        }
    }
}

impl<M: Serialize> Frame<M> {
    /// JSON text of this frame.
    pub fn encode(&self) -> String {
        to_text(self)
    }
}

impl<M: Serialize> Serialize for Frame<M> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        match self {
            Frame::Message { id, msg } => {
                map.serialize_entry("id", id)?;
                map.serialize_entry("msg", msg)?;
            }
            Frame::Batch { id, batch } => {
                map.serialize_entry("id", id)?;
                map.serialize_entry("batch", batch)?;
            }
            Frame::Ack { ack } => map.serialize_entry("ack", ack)?,
        }
        map.end()
    }
}

/// A line of a captured stream: a frame, or a bare message tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Envelope {
    Frame(Frame<Message>),
    Bare(Message),
}

impl Envelope {
    /// The messages carried (one for a bare message, none for an ack).
    pub fn messages(&self) -> &[Message] {
        match self {
            Envelope::Frame(frame) => frame.messages(),
            Envelope::Bare(message) => std::slice::from_ref(message),
        }
    }

    /// JSON text: the frame, or the bare message.
    pub fn encode(&self) -> String {
        match self {
            Envelope::Frame(frame) => frame.encode(),
            Envelope::Bare(message) => to_text(message),
        }
    }
}

fn frame_id(value: Value, path: &Path) -> Result<u64> {
    match value.as_u64() {
        Some(id) if id <= MAX_FRAME_ID => Ok(id),
        _ => Err(unexpected(
            path,
            "a frame id (an integer from 0 to 2^53 − 1)",
            &value,
        )),
    }
}

fn frame_at<M>(value: Value, decode_message: fn(Value, &Path) -> Result<M>) -> Result<Frame<M>> {
    let root = Path::Root;
    let mut map: Map<String, Value> = match value {
        Value::Object(map) => map,
        other => {
            return Err(unexpected(
                &root,
                r#"a frame object ({"id","msg"}, {"id","batch"} or {"ack"})"#,
                &other,
            ))
        }
    };
    // Only an object that is exactly `{ack}` is an ack; anything else is an application frame.
    if map.len() == 1 {
        if let Some(ack) = map.shift_remove("ack") {
            return Ok(Frame::Ack {
                ack: frame_id(ack, &root.key("ack"))?,
            });
        }
    }
    let id = match map.shift_remove("id") {
        Some(id) => frame_id(id, &root.key("id"))?,
        None => {
            return Err(DecodeError::Missing {
                path: root.key("id").to_string(),
                expected: "a frame id".to_owned(),
            })
        }
    };
    match (map.shift_remove("msg"), map.shift_remove("batch")) {
        (Some(msg), None) => Ok(Frame::Message {
            id,
            msg: decode_message(msg, &root.key("msg"))?,
        }),
        (None, Some(batch)) => {
            let at = root.key("batch");
            let items = match batch {
                Value::Array(items) => items,
                other => return Err(unexpected(&at, "an array of messages", &other)),
            };
            let batch = items
                .into_iter()
                .enumerate()
                .map(|(i, item)| decode_message(item, &at.index(i)))
                .collect::<Result<_>>()?;
            Ok(Frame::Batch { id, batch })
        }
        (Some(_), Some(_)) => Err(DecodeError::Unexpected {
            path: root.to_string(),
            expected: r#"exactly one of "msg" or "batch""#.to_owned(),
            found: "both".to_owned(),
        }),
        (None, None) => Err(DecodeError::Missing {
            path: root.key("msg").to_string(),
            expected: r#"a message ("msg") or a batch ("batch")"#.to_owned(),
        }),
    }
}

/// Decodes a server → client frame.
pub fn decode_downstream_frame(text: &str) -> Result<Frame<DownstreamMessage>> {
    frame_at(decode::parse_json(text)?, decode::downstream_at)
}

/// Decodes a server → client frame from a parsed value.
pub fn decode_downstream_frame_value(value: Value) -> Result<Frame<DownstreamMessage>> {
    frame_at(value, decode::downstream_at)
}

/// Decodes a client → server frame (`/subscribe`, v7+; acks on every version).
pub fn decode_upstream_frame(text: &str) -> Result<Frame<UpstreamMessage>> {
    frame_at(decode::parse_json(text)?, decode::upstream_at)
}

/// Decodes a client → server frame from a parsed value.
pub fn decode_upstream_frame_value(value: Value) -> Result<Frame<UpstreamMessage>> {
    frame_at(value, decode::upstream_at)
}

/// Decodes a frame whose messages may go either way (captures, tools).
pub fn decode_frame(text: &str) -> Result<Frame<Message>> {
    frame_at(decode::parse_json(text)?, decode::message_at)
}

/// Decodes a captured line: a JSON array is a bare message, anything else a frame.
pub fn decode_envelope(text: &str) -> Result<Envelope> {
    decode_envelope_value(decode::parse_json(text)?)
}

/// [`decode_envelope`] on a parsed value.
pub fn decode_envelope_value(value: Value) -> Result<Envelope> {
    if value.is_array() {
        decode::message_at(value, &Path::Root).map(Envelope::Bare)
    } else {
        frame_at(value, decode::message_at).map(Envelope::Frame)
    }
}

/// The tail of a batch frame, `,"batch":[…]}`, serialized once and shared by every subscriber
/// that receives the same batch; each adds only its own `{"id":n` prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPayload {
    text: String,
    len: usize,
}

impl BatchPayload {
    /// Serializes `messages` into a shared payload.
    pub fn new<'a, M: Serialize + 'a>(messages: impl IntoIterator<Item = &'a M>) -> Self {
        Self::from_encoded(messages.into_iter().map(to_text))
    }

    /// Builds a payload from messages already encoded as JSON text (trusted to be valid JSON,
    /// e.g. the stored bytes of a change log).
    pub fn from_encoded<T: AsRef<str>>(encoded: impl IntoIterator<Item = T>) -> Self {
        Self::from_slice(&encoded.into_iter().collect::<Vec<_>>())
    }

    /// [`BatchPayload::from_encoded`] on a slice, sized in one allocation (a burst's payload
    /// is up to a few hundred KiB, which growing by doubling would copy several times).
    pub fn from_slice<T: AsRef<str>>(encoded: &[T]) -> Self {
        let bytes: usize = encoded.iter().map(|m| m.as_ref().len() + 1).sum();
        let mut text = String::with_capacity(bytes + r#","batch":[]}"#.len());
        text.push_str(r#","batch":["#);
        for (i, message) in encoded.iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            text.push_str(message.as_ref());
        }
        text.push_str("]}");
        BatchPayload {
            text,
            len: encoded.len(),
        }
    }

    /// The shared bytes, `,"batch":[…]}`.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Number of messages in the batch.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The complete frame for one subscriber: `{"id":<id>` followed by the shared payload.
    pub fn frame(&self, id: u64) -> String {
        let mut out = String::with_capacity(self.text.len() + 24);
        // Writing to a String cannot fail.
        let _ = self.write_frame(id, &mut out);
        out
    }

    /// Appends the complete frame to `out` (a buffer the caller reuses, say).
    pub fn write_frame(&self, id: u64, out: &mut impl fmt::Write) -> fmt::Result {
        write!(out, r#"{{"id":{id}"#)?;
        out.write_str(&self.text)
    }
}

/// `{"id":<id>,"msg":<encoded>}` around an already encoded message.
pub fn message_frame(id: u64, encoded: &str) -> String {
    let mut out = String::with_capacity(encoded.len() + 24);
    // Writing to a String cannot fail.
    let _ = write_message_frame(id, encoded, &mut out);
    out
}

/// Appends [`message_frame`]'s text to `out`.
pub fn write_message_frame(id: u64, encoded: &str, out: &mut impl fmt::Write) -> fmt::Result {
    write!(out, r#"{{"id":{id},"msg":"#)?;
    out.write_str(encoded)?;
    out.write_char('}')
}

/// `{"ack":<id>}`.
pub fn ack_frame(id: u64) -> String {
    let mut out = String::with_capacity(24);
    // Writing to a String cannot fail.
    let _ = write_ack_frame(id, &mut out);
    out
}

/// Appends [`ack_frame`]'s text to `out`.
pub fn write_ack_frame(id: u64, out: &mut impl fmt::Write) -> fmt::Result {
    write!(out, r#"{{"ack":{id}}}"#)
}

/// A received ack that breaks the exactly-once, in-order rule (fatal for the connection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    #[error("expected an ack of frame {expected}, found an ack of frame {found}")]
    OutOfOrder { expected: u64, found: u64 },
    #[error("expected no ack (no frame is outstanding), found an ack of frame {found}")]
    NothingOutstanding { found: u64 },
}

/// The sender side of one direction: assigns frame ids (from 1) and checks that acks arrive
/// exactly once and in id order, as a FIFO of outstanding ids.
#[derive(Debug, Clone, Default)]
pub struct AckQueue {
    last_id: u64,
    outstanding: VecDeque<u64>,
}

impl AckQueue {
    pub fn new() -> Self {
        Self::default()
    }

    /// The id of the next frame to send, recorded as outstanding.
    pub fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.outstanding.push_back(self.last_id);
        self.last_id
    }

    /// Records a received ack; it must be for the oldest outstanding frame.
    pub fn ack(&mut self, id: u64) -> std::result::Result<(), AckError> {
        match self.outstanding.front() {
            Some(&expected) if expected == id => {
                self.outstanding.pop_front();
                Ok(())
            }
            Some(&expected) => Err(AckError::OutOfOrder {
                expected,
                found: id,
            }),
            None => Err(AckError::NothingOutstanding { found: id }),
        }
    }

    /// Frames sent but not yet acked.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// The id the next ack must carry.
    pub fn expected(&self) -> Option<u64> {
        self.outstanding.front().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change_stream::{encode_downstream, Rollback, Status};

    const BEGIN: &str = r#"["begin",{"tag":"begin"},{"commitWatermark":"0a"}]"#;
    const COMMIT: &str = r#"["commit",{"tag":"commit"},{"watermark":"0a"}]"#;

    fn path_of(text: &str) -> String {
        match decode_downstream_frame(text) {
            Ok(f) => panic!("expected {text} to be rejected, decoded {f:?}"),
            Err(e) => e.path().to_owned(),
        }
    }

    #[test]
    fn message_batch_and_ack_frames_round_trip() {
        for text in [
            format!(r#"{{"id":1,"msg":{BEGIN}}}"#),
            format!(r#"{{"id":2,"batch":[{BEGIN},{COMMIT}]}}"#),
            r#"{"id":3,"batch":[]}"#.to_owned(),
            r#"{"ack":3}"#.to_owned(),
        ] {
            let frame = decode_downstream_frame(&text).expect(&text);
            assert_eq!(frame.encode(), text);
        }
        let frame = decode_downstream_frame(&format!(r#"{{"id":2,"batch":[{BEGIN},{COMMIT}]}}"#));
        assert_eq!(
            frame.map(|f| (f.id(), f.messages().len())),
            Ok((Some(2), 2))
        );
    }

    #[test]
    fn frame_shape_rule_11() {
        // Exactly one of msg / batch.
        let both = format!(r#"{{"id":1,"msg":{BEGIN},"batch":[]}}"#);
        let e = decode_downstream_frame(&both).expect_err("both");
        assert_eq!(
            e.to_string(),
            r#"at $: expected exactly one of "msg" or "batch", found both"#
        );
        assert_eq!(path_of(r#"{"id":1}"#), "$.msg");
        // Ids are numbers.
        assert_eq!(path_of(&format!(r#"{{"id":"1","msg":{BEGIN}}}"#)), "$.id");
        assert_eq!(path_of(&format!(r#"{{"id":1.5,"msg":{BEGIN}}}"#)), "$.id");
        assert_eq!(path_of(&format!(r#"{{"id":-1,"msg":{BEGIN}}}"#)), "$.id");
        assert_eq!(path_of(&format!(r#"{{"msg":{BEGIN}}}"#)), "$.id");
        assert_eq!(path_of(r#"{"id":1,"batch":{}}"#), "$.batch");
        // Errors inside a batch name the element.
        let bad = format!(r#"{{"id":1,"batch":[{BEGIN},["commit",{{"tag":"commit"}},{{}}]]}}"#);
        assert_eq!(path_of(&bad), "$.batch[1][2].watermark");
        assert_eq!(
            path_of(r#"{"id":1,"msg":["commit",{"tag":"comit"},{"watermark":"00"}]}"#),
            "$.msg[1].tag"
        );
        assert_eq!(path_of("[1]"), "$");
    }

    #[test]
    fn ack_frames_are_exact_objects() {
        assert_eq!(
            decode_upstream_frame(r#"{"ack":7}"#),
            Ok(Frame::Ack { ack: 7 })
        );
        assert_eq!(
            decode_upstream_frame(r#"{"ack":"7"}"#).map_err(|e| e.path().to_owned()),
            Err("$.ack".to_owned())
        );
        // With any other key it is not an ack but an application frame (and this one lacks an id).
        assert_eq!(
            decode_upstream_frame(r#"{"ack":7,"x":1}"#).map_err(|e| e.path().to_owned()),
            Err("$.id".to_owned())
        );
    }

    #[test]
    fn envelopes_are_frames_or_bare_messages() {
        let bare = decode_envelope(BEGIN).expect("bare");
        assert!(matches!(bare, Envelope::Bare(Message::Downstream(_))));
        assert_eq!(bare.encode(), BEGIN);
        let up = decode_envelope(r#"{"id":1,"msg":["reserve-snapshot",{"taskID":"t"}]}"#)
            .expect("frame");
        assert!(matches!(up.messages(), [Message::Upstream(_)]));
        assert!(decode_envelope(r#"{"ack":1}"#)
            .expect("ack")
            .messages()
            .is_empty());
    }

    #[test]
    fn shared_payload_is_prefixed_per_subscriber() {
        let batch = [
            DownstreamMessage::Status(Status::default()),
            DownstreamMessage::Rollback(Rollback::default()),
        ];
        let payload = BatchPayload::new(&batch);
        assert_eq!(
            payload.as_str(),
            r#","batch":[["status",{"tag":"status"}],["rollback",{"tag":"rollback"}]]}"#
        );
        assert_eq!(payload.len(), 2);
        for id in [1, 42] {
            let frame = decode_downstream_frame(&payload.frame(id)).expect("valid frame");
            assert_eq!(
                frame,
                Frame::Batch {
                    id,
                    batch: batch.to_vec()
                }
            );
        }
        let encoded = BatchPayload::from_encoded(batch.iter().map(encode_downstream));
        assert_eq!(encoded, payload);
        let empty = BatchPayload::from_encoded(Vec::<String>::new());
        assert_eq!(empty.frame(9), r#"{"id":9,"batch":[]}"#);
        assert!(empty.is_empty());
        let single = message_frame(5, BEGIN);
        assert_eq!(
            decode_downstream_frame(&single).map(|f| f.id()),
            Ok(Some(5))
        );
        assert_eq!(
            decode_upstream_frame(&ack_frame(5)),
            Ok(Frame::Ack { ack: 5 })
        );
    }

    #[test]
    fn acks_must_come_once_and_in_order() {
        let mut queue = AckQueue::new();
        let ids: Vec<u64> = (0..3).map(|_| queue.next_id()).collect();
        assert_eq!(ids, [1, 2, 3]);
        assert_eq!(
            queue.ack(2),
            Err(AckError::OutOfOrder {
                expected: 1,
                found: 2
            })
        );
        assert_eq!(queue.ack(1), Ok(()));
        assert_eq!(
            queue.ack(1),
            Err(AckError::OutOfOrder {
                expected: 2,
                found: 1
            })
        );
        assert_eq!(queue.expected(), Some(2));
        assert_eq!((queue.ack(2), queue.ack(3)), (Ok(()), Ok(())));
        assert_eq!(queue.ack(4), Err(AckError::NothingOutstanding { found: 4 }));
        assert_eq!(queue.outstanding(), 0);
        assert_eq!(
            AckError::OutOfOrder {
                expected: 1,
                found: 2
            }
            .to_string(),
            "expected an ack of frame 1, found an ack of frame 2"
        );
    }
}
