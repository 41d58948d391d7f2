//! Zero's change-stream protocol: parse, validate and encode messages and frames.
//!
//! Messages travel as plain JS values in their wire (tuple) shape; every check is the engine's.

use highwater_engine::change_stream::{
    decode_envelope_value, decode_frame, decode_message, decode_message_value, encode_message,
    Envelope,
};
use serde::Serialize;
use wasm_bindgen::prelude::*;

use crate::error::{ErrorCode, Failure};
use crate::json::{from_js, to_js};

#[wasm_bindgen(typescript_custom_section)]
const CHANGE_STREAM_TS: &str = r#"
/** A change-stream message in its wire shape, e.g. `["begin", {...}, {commitWatermark}]`. */
export type ChangeStreamMessage = [tag: string, ...body: JsonValue[]];

/** A WebSocket frame of the change stream. */
export type ChangeStreamFrame =
  | { id: number; msg: ChangeStreamMessage }
  | { id: number; batch: ChangeStreamMessage[] }
  | { ack: number };
"#;

/// Parses and validates one message (either direction) from JSON text. Throws `HW_INVALID_JSON`
/// or `HW_INVALID_MESSAGE` with a `path`.
#[wasm_bindgen(js_name = parseChangeStreamMessage, unchecked_return_type = "ChangeStreamMessage")]
pub fn parse_change_stream_message(json: &str) -> Result<JsValue, JsValue> {
    let message = decode_message(json).map_err(Failure::from)?;
    to_js(&wire_value(&message)?)
}

/// Validates a message and returns its JSON text. Throws `HW_INVALID_MESSAGE` (or
/// `HW_INVALID_VALUE` for values JSON cannot hold) with a `path`.
#[wasm_bindgen(js_name = encodeChangeStreamMessage)]
pub fn encode_change_stream_message(
    #[wasm_bindgen(unchecked_param_type = "ChangeStreamMessage")] message: JsValue,
) -> Result<String, Failure> {
    Ok(encode_message(&decode_message_value(from_js(&message)?)?))
}

/// Parses and validates one frame (`{id,msg}`, `{id,batch}` or `{ack}`) from JSON text.
#[wasm_bindgen(js_name = parseChangeStreamFrame, unchecked_return_type = "ChangeStreamFrame")]
pub fn parse_change_stream_frame(json: &str) -> Result<JsValue, JsValue> {
    let frame = decode_frame(json).map_err(Failure::from)?;
    to_js(&wire_value(&frame)?)
}

/// Validates a frame and returns its JSON text.
#[wasm_bindgen(js_name = encodeChangeStreamFrame)]
pub fn encode_change_stream_frame(
    #[wasm_bindgen(unchecked_param_type = "ChangeStreamFrame")] frame: JsValue,
) -> Result<String, Failure> {
    match decode_envelope_value(from_js(&frame)?)? {
        Envelope::Frame(frame) => Ok(frame.encode()),
        Envelope::Bare(_) => Err(Failure::new(
            ErrorCode::InvalidMessage,
            "at $: expected a frame object ({id,msg}, {id,batch} or {ack}), found an array",
        )
        .at("$")),
    }
}

fn wire_value<T: Serialize>(value: &T) -> Result<serde_json::Value, Failure> {
    serde_json::to_value(value).map_err(|e| Failure::new(ErrorCode::InvalidMessage, e))
}
