//! Sync scopes: the digest that keys a client's scope row, and broadcast routing.
//!
//! Every rule is `highwater_engine::scope_sync::scope`'s; this module converts and maps errors.

use highwater_engine::scope_sync::scope::{ChangesScope, Scope};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tsify::Tsify;
use wasm_bindgen::prelude::*;

use crate::error::{ErrorCode, Failure};
use crate::json::from_js;

/// A client's sync scope, as JS sees it. Not used at run time: its derive writes the TypeScript
/// declaration, and a test keeps it equal to the engine's JSON.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct SyncScope {
    /// The resource type; `null` for the all-types user scope.
    #[tsify(optional, type = "string | null")]
    resource_type: Option<String>,
    /// Conditions by column: a scalar (equality), an array of scalars (membership) or an
    /// object of operators.
    #[tsify(optional, type = "Record<string, ScopeCondition>")]
    #[serde(default)]
    conditions: Map<String, Value>,
    /// A local partition key (the user scope uses the auth token); part of the digest only.
    #[tsify(optional, type = "JsonValue")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    owner: Option<Value>,
}

/// The scope a server parses from subscribe params and routes broadcasts by.
#[derive(Tsify, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[allow(dead_code)]
struct SubscribedScope {
    /// The resource type; `null` for the all-types scope.
    #[tsify(optional, type = "string | null")]
    resource_type: Option<String>,
    /// Conditions by attribute; empty for a user scope.
    #[tsify(type = "Record<string, ScopeCondition>")]
    conditions: Map<String, Value>,
    /// For the all-types scope: the types the client can apply.
    #[tsify(optional, type = "string[] | null")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    resource_types: Option<Vec<String>>,
}

/// One condition: a scalar (equality; `null` tests for NULL), an array of scalars meaning
/// "any of", or an object of operators that must all hold.
#[derive(Tsify)]
#[serde(untagged)]
#[allow(dead_code)]
enum ScopeCondition {
    Scalar(ScopeScalar),
    AnyOf(Vec<ScopeScalar>),
    Operators(Box<ScopeOperators>),
}

/// Operators a column's value must all pass, e.g. `{ gte: 3, lt: 10 }`. NULL passes only
/// `isNull: true`. Numbers compare numerically, timestamps (Unix ms, or an ISO-8601 operand)
/// by instant, booleans with false < true, text by code point.
#[derive(Tsify)]
#[serde(rename_all = "camelCase")]
#[allow(dead_code)]
struct ScopeOperators {
    #[tsify(optional)]
    eq: Option<ScopeScalar>,
    #[tsify(optional)]
    ne: Option<ScopeScalar>,
    #[tsify(optional)]
    #[serde(rename = "in")]
    any_of: Option<Vec<ScopeScalar>>,
    #[tsify(optional)]
    not_in: Option<Vec<ScopeScalar>>,
    #[tsify(optional)]
    lt: Option<ScopeScalar>,
    #[tsify(optional)]
    lte: Option<ScopeScalar>,
    #[tsify(optional)]
    gt: Option<ScopeScalar>,
    #[tsify(optional)]
    gte: Option<ScopeScalar>,
    #[tsify(optional)]
    is_null: Option<bool>,
}

/// A scalar condition value; a number matches the same number as text (`5` matches `"5"`).
#[derive(Tsify)]
#[serde(untagged)]
#[allow(dead_code)]
enum ScopeScalar {
    Text(String),
    Number(f64),
    Big(#[tsify(type = "bigint")] i128),
    Flag(bool),
    Null(#[tsify(type = "null")] ()),
}

/// The digest of a scope (a lowercase UUID), the key of its persisted row. Peers compute the
/// same digest for the same scope. Throws `HW_INVALID_SCOPE`.
#[wasm_bindgen(js_name = scopeDigest)]
pub fn scope_digest(
    #[wasm_bindgen(unchecked_param_type = "SyncScope")] scope: JsValue,
) -> Result<String, Failure> {
    let scope: Scope = serde_json::from_value(from_js(&scope)?)
        .map_err(|e| Failure::new(ErrorCode::InvalidScope, e))?;
    scope.validate()?;
    Ok(scope.digest().to_string())
}

/// Whether a broadcast with these params (`resourceType` plus attribute values) reaches the
/// scope: same type, and every condition met (by value, by membership, by each operator). Throws
/// `HW_INVALID_SCOPE`, or `HW_INVALID_ARGUMENT` when `params` is not an object.
#[wasm_bindgen(js_name = scopeMatches)]
pub fn scope_matches(
    #[wasm_bindgen(unchecked_param_type = "SubscribedScope")] scope: JsValue,
    #[wasm_bindgen(unchecked_param_type = "Record<string, JsonValue>")] params: JsValue,
) -> Result<bool, Failure> {
    let scope = ChangesScope::try_from(from_js(&scope)?)?;
    match from_js(&params)? {
        Value::Object(params) => Ok(scope.matches(&params)),
        other => Err(Failure::new(
            ErrorCode::InvalidArgument,
            format!("expected broadcast params to be an object, got {other}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn declared_scope_matches_the_engine_json() {
        let conditions =
            json!({"projectId": 5, "state": ["open", "draft"], "priority": {"gte": 3}});
        let Value::Object(conditions) = conditions else {
            panic!("an object");
        };
        for scope in [Scope::of_type("Task", conditions), Scope::user("token-1")] {
            let engine_json = serde_json::to_value(&scope).expect("serializes");
            let declared: SyncScope = serde_json::from_value(engine_json.clone())
                .expect("engine JSON fits the declaration");
            assert_eq!(
                serde_json::to_value(&declared).expect("serializes"),
                engine_json
            );
        }
    }

    #[test]
    fn declared_subscribed_scope_matches_the_engine_json() {
        for params in [
            json!({"resourceType": "Task", "conditions": {"projectId": [1, 2]}}),
            json!({"resourceType": "Task", "conditions": {"due": {"isNull": false, "lt": 5}}}),
            json!({"resourceType": null, "conditions": {}, "resourceTypes": ["Task", "Project"]}),
        ] {
            let scope = ChangesScope::try_from(params).expect("valid");
            let engine_json = serde_json::to_value(&scope).expect("serializes");
            let declared: SubscribedScope = serde_json::from_value(engine_json.clone())
                .expect("engine JSON fits the declaration");
            assert_eq!(
                serde_json::to_value(&declared).expect("serializes"),
                engine_json
            );
        }
    }
}
