//! `channel-subscribe` params of the scope-sync channel (`docs/protocol/scope-sync.md`,
//! "Subscribe params"): scope, after-cursor, page limit.

use serde_json::{Map, Value};

use crate::scope_sync::coercion::{
    describe, integer_from_number, integer_from_text, json_number_text, IntegerText,
};
use crate::scope_sync::cursor::{cursor_to_params, CursorParamsForm, CursorPrefix, SyncCursor};
use crate::scope_sync::scope::{ChangesScope, ScopeError};

/// Replay page size when `limit` is not given.
pub const DEFAULT_PAGE_LIMIT: u32 = 1000;
/// Larger `limit` values are clamped to this.
pub const MAX_PAGE_LIMIT: u32 = 1000;
/// `Number.MAX_SAFE_INTEGER`: peers reject larger limits rather than clamping them.
const MAX_SAFE_INTEGER: i64 = (1 << 53) - 1;

/// The params of a scope-sync subscription, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeParams {
    /// `conditions`, `resourceType`, `resourceTypes`.
    pub scope: ChangesScope,
    /// Where the catch-up replay starts; `None` replays the whole scope.
    pub after: Option<SyncCursor>,
    /// The page size as sent (already clamped); `None` when absent. See [`Self::page_limit`].
    pub limit: Option<u32>,
    pub authentication_token: Option<String>,
    /// Every other param (such as the client's request context), passed on to authorization.
    pub extra: Map<String, Value>,
}

/// Why subscribe params were rejected; each fails the subscription with `channel-error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscribeError {
    #[error("expected limit to be a positive integer, got {found}")]
    BadLimit { found: String },
    #[error("expected afterServerSequence to be a positive integer, got {found}")]
    BadAfterSequence { found: String },
    #[error("expected afterUpdatedAt to be an ISO timestamp string or null, got {found}")]
    BadAfterUpdatedAt { found: String },
    #[error("expected afterId to be a string, a number or null, got {found}")]
    BadAfterId { found: String },
    #[error("expected authenticationToken to be a string or null, got {found}")]
    BadAuthenticationToken { found: String },
    #[error(transparent)]
    Scope(#[from] ScopeError),
}

/// The param keys [`SubscribeParams`] reads itself; the rest land in `extra`.
const KNOWN_KEYS: [&str; 8] = [
    "conditions",
    "resourceType",
    "resourceTypes",
    "afterId",
    "afterServerSequence",
    "afterUpdatedAt",
    "limit",
    "authenticationToken",
];

impl SubscribeParams {
    /// Decodes and validates subscribe params, as the server does before authorizing.
    pub fn from_params(params: &Map<String, Value>) -> Result<Self, SubscribeError> {
        let scope = ChangesScope::from_params(params)?;
        let after = after_cursor(params)?;
        let limit = match params.get("limit") {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) if text.is_empty() => None,
            Some(value) => Some(page_limit(Some(value))?),
        };
        let authentication_token = match params.get("authenticationToken") {
            None | Some(Value::Null) => None,
            Some(Value::String(token)) => Some(token.clone()),
            Some(other) => {
                return Err(SubscribeError::BadAuthenticationToken {
                    found: describe(other),
                })
            }
        };
        let extra = params
            .iter()
            .filter(|(key, _)| !KNOWN_KEYS.contains(&key.as_str()))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        Ok(Self {
            scope,
            after,
            limit,
            authentication_token,
            extra,
        })
    }

    /// The replay page size: `limit`, or the default.
    pub fn page_limit(&self) -> u32 {
        self.limit.unwrap_or(DEFAULT_PAGE_LIMIT)
    }

    /// The params a client sends: scope keys, `resourceTypes` only for the all-types scope, the
    /// after-cursor in client form (no zero sequence), then `limit`, token and the rest.
    pub fn to_params(&self) -> Map<String, Value> {
        let mut params = Map::new();
        params.insert(
            "conditions".to_owned(),
            Value::Object(self.scope.conditions.clone()),
        );
        params.insert(
            "resourceType".to_owned(),
            self.scope
                .resource_type
                .clone()
                .map_or(Value::Null, Value::String),
        );
        if let (None, Some(types)) = (&self.scope.resource_type, &self.scope.resource_types) {
            params.insert(
                "resourceTypes".to_owned(),
                Value::Array(types.iter().cloned().map(Value::String).collect()),
            );
        }
        params.extend(cursor_to_params(
            CursorPrefix::After,
            self.after.as_ref(),
            CursorParamsForm::Client,
        ));
        if let Some(limit) = self.limit {
            params.insert("limit".to_owned(), Value::from(limit));
        }
        if let Some(token) = &self.authentication_token {
            params.insert(
                "authenticationToken".to_owned(),
                Value::String(token.clone()),
            );
        }
        params.extend(self.extra.clone());
        params
    }
}

/// The replay page size for a `limit` param (`scope-sync.md`, "Subscribe params"): absent, null
/// or `""` give the default; any other value must be a positive integer no larger than
/// 2^53 − 1 (a number or a numeric string), and is clamped to [`MAX_PAGE_LIMIT`]. So `0`, `-1`,
/// `1.5` and `"abc"` fail. Booleans fail too, although `Number(true)` would give 1.
pub fn page_limit(value: Option<&Value>) -> Result<u32, SubscribeError> {
    let verdict = match value {
        None | Some(Value::Null) => return Ok(DEFAULT_PAGE_LIMIT),
        Some(Value::String(text)) if text.is_empty() => return Ok(DEFAULT_PAGE_LIMIT),
        Some(Value::String(text)) => integer_from_text(text),
        Some(Value::Number(number)) => integer_from_number(number),
        Some(_) => IntegerText::NotInteger,
    };
    match verdict {
        IntegerText::Integer(limit) if (1..=MAX_SAFE_INTEGER).contains(&limit) => {
            Ok(u32::try_from(limit).map_or(MAX_PAGE_LIMIT, |limit| limit.min(MAX_PAGE_LIMIT)))
        }
        _ => Err(SubscribeError::BadLimit {
            found: value.map_or_else(|| "nothing".to_owned(), describe),
        }),
    }
}

/// An `afterServerSequence` / `upToServerSequence` request bound: a positive integer, given as
/// a number or an integer string. `""`, words, fractions, 0 and negatives fail.
pub fn request_sequence(value: &Value) -> Result<i64, SubscribeError> {
    let verdict = match value {
        Value::Number(number) => integer_from_number(number),
        Value::String(text) => integer_from_text(text),
        _ => IntegerText::NotInteger,
    };
    match verdict {
        IntegerText::Integer(sequence) if sequence > 0 => Ok(sequence),
        _ => Err(SubscribeError::BadAfterSequence {
            found: describe(value),
        }),
    }
}

/// The start cursor of a subscription (velocious' `cursorFromParams`; `scope-sync.md`,
/// "Subscribe params"), validated strictly.
///
/// Without a non-empty `afterUpdatedAt` there is no cursor (a full replay), but a present
/// `afterServerSequence` or `afterId` must still be well-formed.
fn after_cursor(params: &Map<String, Value>) -> Result<Option<SyncCursor>, SubscribeError> {
    let server_sequence = match params.get("afterServerSequence") {
        None | Some(Value::Null) => None,
        Some(value) => Some(request_sequence(value)?),
    };
    let id = match params.get("afterId") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(id.clone()),
        Some(Value::Number(id)) => Some(json_number_text(id)),
        Some(other) => {
            return Err(SubscribeError::BadAfterId {
                found: describe(other),
            })
        }
    };
    match params.get("afterUpdatedAt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(text)) if text.is_empty() => Ok(None),
        Some(Value::String(text)) => Ok(Some(SyncCursor::new(id, server_sequence, text.clone()))),
        Some(other) => Err(SubscribeError::BadAfterUpdatedAt {
            found: describe(other),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const T0: &str = "2026-07-01T10:00:00.000Z";

    fn params(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(object) => object,
            other => panic!("expected an object, got {other}"),
        }
    }

    fn decode(value: Value) -> Result<SubscribeParams, SubscribeError> {
        SubscribeParams::from_params(&params(value))
    }

    #[test]
    fn subscribe_params_decode_scope_cursor_token_and_context() {
        let decoded = decode(json!({
            "conditions": {"projectId": "p1"}, "resourceType": "Task",
            "afterId": 42, "afterServerSequence": "1234", "afterUpdatedAt": T0,
            "authenticationToken": "tok", "locale": "da"
        }))
        .unwrap();
        assert_eq!(decoded.scope.resource_type.as_deref(), Some("Task"));
        assert_eq!(
            decoded.after,
            Some(SyncCursor::new(
                Some("42".to_owned()),
                Some(1234),
                T0.to_owned()
            ))
        );
        assert_eq!(decoded.authentication_token.as_deref(), Some("tok"));
        assert_eq!(decoded.extra, params(json!({"locale": "da"})));
        assert_eq!(decoded.page_limit(), DEFAULT_PAGE_LIMIT);
    }

    #[test]
    fn without_after_updated_at_the_whole_scope_is_replayed() {
        let decoded = decode(json!({"conditions": {}, "afterServerSequence": 9})).unwrap();
        assert_eq!(decoded.after, None);
        let empty =
            decode(json!({"conditions": {}, "afterUpdatedAt": "", "afterId": "x"})).unwrap();
        assert_eq!(empty.after, None);
    }

    #[test]
    fn a_cursor_without_a_sequence_is_a_legacy_start() {
        let decoded = decode(json!({"conditions": {}, "afterUpdatedAt": T0})).unwrap();
        assert_eq!(decoded.after, Some(SyncCursor::legacy(T0.to_owned())));
    }

    // Scenario 13: invalid limits and cursors fail the subscription; big limits clamp.

    #[test]
    fn scenario_13_invalid_limits_are_rejected() {
        for limit in [
            json!(0),
            json!(-1),
            json!(1.5),
            json!("abc"),
            json!(true),
            json!([5]),
            json!(9_007_199_254_740_992_i64),
        ] {
            let error = decode(json!({"conditions": {}, "limit": limit})).unwrap_err();
            assert!(matches!(error, SubscribeError::BadLimit { .. }), "{limit}");
        }
        assert_eq!(
            page_limit(Some(&json!(1.5))).unwrap_err().to_string(),
            "expected limit to be a positive integer, got number 1.5"
        );
    }

    #[test]
    fn scenario_13_limits_default_to_and_clamp_at_one_thousand() {
        assert_eq!(page_limit(None), Ok(1000));
        assert_eq!(page_limit(Some(&Value::Null)), Ok(1000));
        assert_eq!(page_limit(Some(&json!(""))), Ok(1000));
        assert_eq!(page_limit(Some(&json!(2))), Ok(2));
        assert_eq!(page_limit(Some(&json!("25"))), Ok(25));
        assert_eq!(page_limit(Some(&json!(1000))), Ok(1000));
        assert_eq!(page_limit(Some(&json!(1001))), Ok(1000));
        assert_eq!(
            page_limit(Some(&json!(9_007_199_254_740_991_i64))),
            Ok(1000)
        );
        let decoded = decode(json!({"conditions": {}, "limit": 5000})).unwrap();
        assert_eq!((decoded.limit, decoded.page_limit()), (Some(1000), 1000));
    }

    #[test]
    fn scenario_13_invalid_after_sequences_are_rejected() {
        for sequence in [
            json!("abc"),
            json!(""),
            json!(0),
            json!(-4),
            json!(2.5),
            json!(true),
        ] {
            let with_cursor =
                json!({"conditions": {}, "afterServerSequence": sequence, "afterUpdatedAt": T0});
            assert!(
                matches!(
                    decode(with_cursor),
                    Err(SubscribeError::BadAfterSequence { .. })
                ),
                "{sequence}"
            );
            // Even with no timestamp, which would otherwise mean a full replay.
            let alone = json!({"conditions": {}, "afterServerSequence": sequence});
            assert!(matches!(
                decode(alone),
                Err(SubscribeError::BadAfterSequence { .. })
            ));
        }
        assert_eq!(
            request_sequence(&json!("")).unwrap_err().to_string(),
            "expected afterServerSequence to be a positive integer, got string \"\""
        );
    }

    #[test]
    fn malformed_cursor_fields_scope_and_token_are_rejected() {
        let cases = [
            (
                json!({"conditions": {}, "afterUpdatedAt": 5}),
                "expected afterUpdatedAt to be an ISO timestamp string or null, got number 5",
            ),
            (
                json!({"conditions": {}, "afterId": [1]}),
                "expected afterId to be a string, a number or null, got an array of 1 items",
            ),
            (
                json!({"conditions": {}, "authenticationToken": 5}),
                "expected authenticationToken to be a string or null, got number 5",
            ),
            (
                json!({"conditions": "x"}),
                "expected conditions to be an object, got string \"x\"",
            ),
        ];
        for (value, message) in cases {
            assert_eq!(decode(value).unwrap_err().to_string(), message);
        }
    }

    #[test]
    fn client_params_send_resource_types_only_for_the_all_types_scope_and_no_zero_sequence() {
        let all_types = decode(json!({
            "conditions": {}, "resourceType": null, "resourceTypes": ["Task"],
            "afterId": null, "afterUpdatedAt": T0, "authenticationToken": "tok"
        }))
        .unwrap();
        assert_eq!(
            Value::Object(all_types.to_params()),
            json!({"conditions": {}, "resourceType": null, "resourceTypes": ["Task"],
                   "afterId": null, "afterUpdatedAt": T0, "authenticationToken": "tok"})
        );
        let mut typed = decode(
            json!({"conditions": {"a": 1}, "resourceType": "Task", "resourceTypes": ["Note"]}),
        )
        .unwrap();
        typed.after = Some(SyncCursor::new(
            Some("1".to_owned()),
            Some(0),
            T0.to_owned(),
        ));
        let sent = typed.to_params();
        assert!(!sent.contains_key("resourceTypes"));
        assert!(!sent.contains_key("afterServerSequence"));
    }

    #[test]
    fn client_params_decode_back_to_the_same_subscription() {
        let original = decode(json!({
            "conditions": {"projectId": "p1"}, "resourceType": "Task",
            "afterId": "42", "afterServerSequence": 1234, "afterUpdatedAt": T0,
            "limit": 50, "authenticationToken": "tok", "locale": "da"
        }))
        .unwrap();
        assert_eq!(
            SubscribeParams::from_params(&original.to_params()),
            Ok(original)
        );
    }
}
