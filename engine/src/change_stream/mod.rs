//! Zero's change-streamer protocol: typed messages, their exact JSON tuple shapes, framing and
//! per-version gating.
//!
//! Decoding follows Zero's schemas in passthrough mode: unknown keys are kept at every level,
//! tuples have exact arity, tag literals must match, `number` fields reject integers beyond
//! 2^53 while row values keep them exactly. Encoding writes the same tuple shapes back, so a
//! decode → encode relay preserves every field. Deliberate differences from Zero's schemas:
//! watermark fields (`commitWatermark`, `watermark`, `replicaVersion`, `minWatermark`) must be
//! canonical LexiVersions / StateVersions (Zero would crash on them later), frame ids must be
//! integers, and `create-index.spec.predicate` is kept as opaque JSON.

mod column_default;
mod decode;
mod encode;
mod frame;
mod message;
mod traffic;
mod version;

pub use column_default::{exact_lite_default, lite_default, UnsupportedDefault};
pub use decode::{
    decode_backfill_request_value, decode_change_value, decode_downstream, decode_downstream_value,
    decode_message, decode_message_value, decode_upstream, decode_upstream_value, parse_json,
    DecodeError,
};
pub use encode::{
    encode_change, encode_downstream, encode_downstream_value, encode_message, encode_upstream,
    encode_upstream_value, header_end,
};
pub use frame::{
    ack_frame, decode_downstream_frame, decode_downstream_frame_value, decode_envelope,
    decode_envelope_value, decode_frame, decode_upstream_frame, decode_upstream_frame_value,
    message_frame, write_ack_frame, write_message_frame, AckError, AckQueue, BatchPayload,
    Envelope, Frame,
};
pub use message::*;
pub use traffic::{check_traffic, Direction, TrafficError};
pub use version::{
    adapt_for_version, batch_frames_allowed, check_protocol_version, close_reason, may_receive,
    unsupported_version_reason, Endpoint, UnsupportedVersion, MAX_CLOSE_REASON_BYTES,
    MAX_PROTOCOL_VERSION, MIN_PROTOCOL_VERSION, MIN_SUBSCRIBE_PROTOCOL_VERSION,
    PROTOCOL_ERROR_CLOSE_CODE,
};
