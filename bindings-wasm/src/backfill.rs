//! `BackfillTracker`: one party's pending backfills, folded over the change stream.
//!
//! Wraps `highwater_engine::backfill::BackfillState`: seed it with backfill requests (a v8
//! `start-subscription.backfills`), apply every downstream message, read the committed
//! requests back.

use highwater_engine::backfill::BackfillState;
use highwater_engine::change_stream::{
    decode_backfill_request_value, decode_downstream, decode_downstream_value, BackfillRequest,
};
use serde_json::Value;
use wasm_bindgen::prelude::*;

use crate::error::{ErrorCode, Failure};
use crate::json::{from_js, to_js};

#[wasm_bindgen(typescript_custom_section)]
const BACKFILL_TS: &str = r#"
/**
 * A pending backfill in its wire shape (element of `start-subscription.backfills`, v8):
 * `{table: {schema, name, metadata}, columns: {[column]: {id, progress?}}}`; the engine
 * validates it and keeps unknown keys.
 */
export type BackfillRequest = { [key: string]: JsonValue };
"#;

/// Tracks which backfill columns are pending and how far each got, applying Zero's continuity
/// policy to `backfill` / `backfill-completed` messages and folding schema changes. Changes
/// inside `begin`…`commit` count only once committed.
#[wasm_bindgen]
pub struct BackfillTracker {
    state: BackfillState,
}

#[wasm_bindgen]
impl BackfillTracker {
    /// Seeds the tracker with backfill requests (none when omitted). Throws
    /// `HW_INVALID_MESSAGE` (with `path`) for a malformed request, `HW_INVALID_BACKFILL` for two
    /// requests of one table.
    #[wasm_bindgen(constructor)]
    pub fn new(
        #[wasm_bindgen(unchecked_optional_param_type = "BackfillRequest[] | null")]
        backfills: JsValue,
    ) -> Result<BackfillTracker, Failure> {
        let requests = if backfills.is_null() || backfills.is_undefined() {
            Vec::new()
        } else {
            requests_from(from_js(&backfills)?)?
        };
        Ok(BackfillTracker {
            state: BackfillState::try_from_requests(requests)?,
        })
    }

    /// Applies one downstream message (a wire tuple, or its JSON text). Returns the columns, as
    /// `schema.table.column`, for which a backfill message was ignored by the continuity policy.
    pub fn apply(
        &mut self,
        #[wasm_bindgen(unchecked_param_type = "ChangeStreamMessage | string")] message: JsValue,
    ) -> Result<Vec<String>, Failure> {
        let message = match message.as_string() {
            Some(text) => decode_downstream(&text)?,
            None => decode_downstream_value(from_js(&message)?)?,
        };
        Ok(self.state.apply_message(&message))
    }

    /// The committed pending backfills, one request per table.
    #[wasm_bindgen(unchecked_return_type = "BackfillRequest[]")]
    pub fn requests(&self) -> Result<JsValue, JsValue> {
        let requests = serde_json::to_value(self.state.requests())
            .map_err(|e| Failure::new(ErrorCode::InvalidBackfill, e))?;
        to_js(&requests)
    }

    /// The committed pending columns (`schema.table.column`) that `stream`'s progress will not
    /// deliver: the stream lacks them with the same backfill ID, or is past this party's mark.
    pub fn uncovered(&self, stream: &BackfillTracker) -> Vec<String> {
        self.state.uncovered(&stream.state)
    }

    /// Whether nothing is pending (as committed).
    #[wasm_bindgen(getter, js_name = isEmpty)]
    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    /// Whether a transaction is open (a `begin` without its `commit` or `rollback` yet).
    #[wasm_bindgen(getter, js_name = inTransaction)]
    pub fn in_transaction(&self) -> bool {
        self.state.in_transaction()
    }
}

/// Decodes an array of requests; error paths point into the array (`$[1].table.schema`).
fn requests_from(value: Value) -> Result<Vec<BackfillRequest>, Failure> {
    let Value::Array(items) = value else {
        return Err(Failure::new(
            ErrorCode::InvalidMessage,
            "at $: expected an array of backfill requests",
        )
        .at("$"));
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| {
            decode_backfill_request_value(item).map_err(|e| {
                let failure = Failure::from(e);
                let path = failure.path.as_deref().unwrap_or("$");
                let path = format!("$[{i}]{}", path.strip_prefix('$').unwrap_or(path));
                Failure {
                    message: failure.message.replacen("at $", &format!("at $[{i}]"), 1),
                    ..failure
                }
                .at(path)
            })
        })
        .collect()
}
