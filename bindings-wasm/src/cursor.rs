//! Scope-sync cursors: read them from payloads, order them, write them as request params.
//!
//! A cursor is `null` (never synced) or `{id, serverSequence, updatedAt}`; `undefined` is read
//! as `null`. Every rule is `highwater_engine::scope_sync::cursor`'s.

use std::cmp::Ordering;

use highwater_engine::scope_sync::cursor::{self as engine, CursorParamsForm, CursorPrefix};
use serde::{Deserialize, Serialize};
use tsify::Tsify;
use wasm_bindgen::prelude::*;

use crate::error::{ErrorCode, Failure};
use crate::json::{from_js, to_js};

/// A cursor as JS sees it: the position of one change-feed row. Not used at run time: its
/// derive writes the TypeScript declaration, and a test keeps it equal to the engine's JSON.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct SyncCursor {
    /// Id of the change-feed row, as a string.
    #[tsify(type = "string | null")]
    id: Option<String>,
    /// The row's server sequence; `null` for a legacy cursor ordered by `updatedAt`.
    #[tsify(type = "number | bigint | null")]
    server_sequence: Option<i64>,
    /// The row's `updatedAt` (ISO-8601 text), never empty.
    updated_at: String,
}

/// Which cursor request params describe: `after` (exclusive start) or `upTo` (inclusive end).
#[derive(Tsify, Serialize, Deserialize)]
#[allow(dead_code)]
enum CursorParamPrefix {
    #[serde(rename = "after")]
    After,
    #[serde(rename = "upTo")]
    UpTo,
}

/// `client` omits a zero sequence (pulls, subscribe params); `server` writes any sequence.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
enum CursorParamsFormName {
    Client,
    Server,
}

/// Orders two cursors: -1, 0 or 1. `null` is lowest; sequenced cursors compare by sequence,
/// others by `updatedAt` instant then id. Throws `HW_INVALID_CURSOR`.
#[wasm_bindgen(js_name = compareCursors)]
pub fn compare_cursors(
    #[wasm_bindgen(unchecked_param_type = "SyncCursor | null | undefined")] a: JsValue,
    #[wasm_bindgen(unchecked_param_type = "SyncCursor | null | undefined")] b: JsValue,
) -> Result<i32, Failure> {
    let (a, b) = (cursor_arg(&a)?, cursor_arg(&b)?);
    Ok(match engine::compare_cursors(a.as_ref(), b.as_ref()) {
        Ordering::Less => -1,
        Ordering::Equal => 0,
        Ordering::Greater => 1,
    })
}

/// Whether `candidate` is strictly after `current`; equal cursors are not, `null` never is.
#[wasm_bindgen(js_name = isCursorAfter)]
pub fn is_cursor_after(
    #[wasm_bindgen(unchecked_param_type = "SyncCursor | null | undefined")] candidate: JsValue,
    #[wasm_bindgen(unchecked_param_type = "SyncCursor | null | undefined")] current: JsValue,
) -> Result<bool, Failure> {
    let (candidate, current) = (cursor_arg(&candidate)?, cursor_arg(&current)?);
    Ok(engine::is_cursor_after(
        candidate.as_ref(),
        current.as_ref(),
    ))
}

/// Reads a persisted or response cursor payload: an object, a JSON string, a raw timestamp
/// (a legacy cursor) or anything falsy (`null`). Throws `HW_INVALID_CURSOR` for an object with
/// an unusable `id` or `serverSequence`.
#[wasm_bindgen(js_name = cursorFromPayload, unchecked_return_type = "SyncCursor | null")]
pub fn cursor_from_payload(
    #[wasm_bindgen(unchecked_optional_param_type = "JsonValue")] payload: JsValue,
) -> Result<JsValue, JsValue> {
    let payload = if payload.is_undefined() {
        serde_json::Value::Null
    } else {
        from_js(&payload)?
    };
    let cursor = engine::parse_cursor_payload(&payload).map_err(Failure::from)?;
    cursor_to_js(cursor.as_ref())
}

/// The request params of a cursor, e.g. `{afterId, afterServerSequence, afterUpdatedAt}`; none
/// for `null`. Throws `HW_INVALID_ARGUMENT` for an unknown prefix or form.
#[wasm_bindgen(
    js_name = cursorToParams,
    unchecked_return_type = "Record<string, string | number | bigint | null>"
)]
pub fn cursor_to_params(
    #[wasm_bindgen(unchecked_param_type = "CursorParamPrefix")] prefix: &str,
    #[wasm_bindgen(unchecked_param_type = "SyncCursor | null | undefined")] cursor: JsValue,
    #[wasm_bindgen(unchecked_param_type = "CursorParamsFormName")] form: &str,
) -> Result<JsValue, JsValue> {
    let prefix: CursorPrefix = prefix.parse().map_err(Failure::from)?;
    let form: CursorParamsForm = form.parse().map_err(Failure::from)?;
    let cursor = cursor_arg(&cursor)?;
    to_js(&serde_json::Value::Object(engine::cursor_to_params(
        prefix,
        cursor.as_ref(),
        form,
    )))
}

/// A cursor argument: `null`/`undefined`, or a cursor object (validated by the engine).
pub(crate) fn cursor_arg(value: &JsValue) -> Result<Option<engine::SyncCursor>, Failure> {
    if value.is_null() || value.is_undefined() {
        return Ok(None);
    }
    serde_json::from_value(from_js(value)?)
        .map(Some)
        .map_err(|e| Failure::new(ErrorCode::InvalidCursor, e))
}

pub(crate) fn cursor_to_js(cursor: Option<&engine::SyncCursor>) -> Result<JsValue, JsValue> {
    match cursor {
        None => Ok(JsValue::NULL),
        Some(cursor) => to_js(
            &serde_json::to_value(cursor).map_err(|e| Failure::new(ErrorCode::InvalidCursor, e))?,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn declared_shape_matches_the_engine_json() {
        for cursor in [
            engine::SyncCursor::new(
                Some("42".into()),
                Some(1234),
                "2026-07-01T10:00:00.000Z".into(),
            ),
            engine::SyncCursor::legacy("2026-07-01T10:00:00Z".into()),
        ] {
            let engine_json = serde_json::to_value(&cursor).expect("serializes");
            let declared: SyncCursor = serde_json::from_value(engine_json.clone())
                .expect("engine JSON fits the declaration");
            assert_eq!(
                serde_json::to_value(&declared).expect("serializes"),
                engine_json
            );
        }
    }

    #[test]
    fn declared_prefixes_and_forms_are_the_engine_ones() {
        for (declared, engine_prefix) in [
            (CursorParamPrefix::After, CursorPrefix::After),
            (CursorParamPrefix::UpTo, CursorPrefix::UpTo),
        ] {
            let text = serde_json::to_value(&declared).expect("serializes");
            assert_eq!(text, json!(engine_prefix.as_str()));
            assert_eq!(
                text.as_str().map(str::parse::<CursorPrefix>),
                Some(Ok(engine_prefix))
            );
        }
        for (declared, engine_form) in [
            (CursorParamsFormName::Client, CursorParamsForm::Client),
            (CursorParamsFormName::Server, CursorParamsForm::Server),
        ] {
            let text = serde_json::to_value(&declared).expect("serializes");
            assert_eq!(text, serde_json::to_value(engine_form).expect("serializes"));
            assert_eq!(
                text.as_str().map(str::parse::<CursorParamsForm>),
                Some(Ok(engine_form))
            );
        }
    }
}
