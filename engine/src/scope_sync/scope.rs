//! Sync scopes: a resource type plus equality conditions, their digest, and broadcast routing.
//!
//! [`Scope`] is the client's declared scope; its [`ScopeDigest`] keys the persisted scope row
//! and so must equal the digest a velocious peer computes for the same scope. [`ChangesScope`] is
//! the scope a server parses from subscribe params, authorizes, and routes broadcasts by.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::scope_sync::coercion::{describe, js_string_cmp, js_string_form, json_number_text};
use crate::scope_sync::{ConditionError, Conditions};

/// Prefix of every digested scope name.
const DIGEST_NAME_PREFIX: &str = "velocious-sync-scope:";

/// A client's sync scope: which rows of which type it keeps, and for whom.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Scope {
    /// The resource type, or `None` for the all-types user scope.
    pub resource_type: Option<String>,
    /// Equality conditions, keyed by column name: scalars, or arrays of scalars (membership).
    #[serde(default)]
    pub conditions: Map<String, Value>,
    /// A local partition key (the user scope uses the auth token). It is part of the digest
    /// only, never sent to the server, never stored in the row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Value>,
}

/// Why a scope or the scope part of subscribe params was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScopeError {
    #[error("expected resourceType to be null or a non-blank string, got {found}")]
    BadResourceType { found: String },
    #[error("expected conditions to be an object, got {found}")]
    BadConditions { found: String },
    #[error(transparent)]
    Condition(#[from] ConditionError),
    #[error("expected resourceTypes to be null or an array of non-blank strings, got {found}")]
    BadResourceTypes { found: String },
    #[error("expected a scope digest (a UUID), got {found:?}")]
    BadDigest { found: String },
}

impl Scope {
    /// A scope of one resource type.
    pub fn of_type(resource_type: impl Into<String>, conditions: Map<String, Value>) -> Self {
        Self {
            resource_type: Some(resource_type.into()),
            conditions,
            owner: None,
        }
    }

    /// The all-types user scope: no conditions, partitioned by `owner` (the auth token), so
    /// another account on the same device starts from its own cursor.
    pub fn user(owner: impl Into<String>) -> Self {
        Self {
            resource_type: None,
            conditions: Map::new(),
            owner: Some(Value::String(owner.into())),
        }
    }

    /// Checks the conditions are plain equality: scalars or arrays of scalars.
    pub fn validate(&self) -> Result<(), ScopeError> {
        validate_conditions(&self.conditions)
    }

    /// The text the digest is computed from:
    /// `[owner=<stable JSON>|]<resourceType or "">:<stable JSON of conditions>`.
    pub fn key(&self) -> String {
        let mut key = String::new();
        if let Some(owner) = self.owner.as_ref().filter(|owner| !owner.is_null()) {
            key.push_str("owner=");
            write_stable_json(owner, &mut key);
            key.push('|');
        }
        key.push_str(self.resource_type.as_deref().unwrap_or(""));
        key.push(':');
        key.push_str(&self.conditions_json());
        key
    }

    /// The stable JSON of the conditions, as stored in the scope row's `conditions_json`.
    pub fn conditions_json(&self) -> String {
        let mut out = String::new();
        write_stable_object(&self.conditions, &mut out);
        out
    }

    /// The scope's digest (`docs/protocol/scope-sync.md`, "Scopes and digests"): UUIDv5 in the
    /// URL namespace of `velocious-sync-scope:<key>`.
    ///
    /// The name is fed as the low byte of each UTF-16 code unit, not as UTF-8: velocious digests
    /// with pure-uuid, which does exactly that. ASCII names therefore give standard v5 UUIDs;
    /// non-ASCII names give the same non-standard UUIDs velocious peers store.
    pub fn digest(&self) -> ScopeDigest {
        let name: Vec<u8> = DIGEST_NAME_PREFIX
            .encode_utf16()
            .chain(self.key().encode_utf16())
            .map(|unit| unit.to_le_bytes()[0])
            .collect();
        ScopeDigest(Uuid::new_v5(&Uuid::NAMESPACE_URL, &name))
    }
}

/// The digest of a scope: a UUID written lowercase with hyphens. Not unique per row: velocious
/// stores can hold duplicates, and lookups take the first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeDigest(Uuid);

impl ScopeDigest {
    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Display for ScopeDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Uuid's Display is the lowercase hyphenated form.
        fmt::Display::fmt(&self.0, f)
    }
}

impl FromStr for ScopeDigest {
    type Err = ScopeError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Uuid::try_parse(text)
            .map(ScopeDigest)
            .map_err(|_| ScopeError::BadDigest {
                found: text.to_owned(),
            })
    }
}

impl Serialize for ScopeDigest {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ScopeDigest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// The scope a server parses from `channel-subscribe` params (`scope-sync.md`, "Subscribe
/// params") and routes broadcasts by.
///
/// Serializes as `{resourceType, conditions, resourceTypes?}`; deserializing applies the same
/// validation as [`ChangesScope::from_params`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", try_from = "Value")]
pub struct ChangesScope {
    /// The trimmed resource type, or `None` for the all-types scope.
    pub resource_type: Option<String>,
    /// Attribute-named conditions (see [`Conditions`](crate::scope_sync::Conditions)). Empty
    /// conditions make a user scope, whose every delivery is re-checked for access.
    pub conditions: Map<String, Value>,
    /// For the all-types scope: the types the client can apply. Narrows delivery; it is not
    /// authorization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_types: Option<Vec<String>>,
}

impl ChangesScope {
    /// Reads `resourceType`, `conditions` and `resourceTypes` from subscribe params; other keys
    /// are ignored. `conditions` is required (an object); the other two may be null or absent.
    pub fn from_params(params: &Map<String, Value>) -> Result<Self, ScopeError> {
        let resource_type = match params.get("resourceType") {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) if !text.trim().is_empty() => Some(text.trim().to_owned()),
            Some(other) => {
                return Err(ScopeError::BadResourceType {
                    found: describe(other),
                })
            }
        };
        let conditions = match params.get("conditions") {
            Some(Value::Object(conditions)) => conditions.clone(),
            other => {
                return Err(ScopeError::BadConditions {
                    found: other.map_or_else(|| "nothing".to_owned(), describe),
                })
            }
        };
        validate_conditions(&conditions)?;
        let resource_types = match params.get("resourceTypes") {
            None | Some(Value::Null) => None,
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|item| match item {
                        Value::String(text) if !text.trim().is_empty() => {
                            Ok(text.trim().to_owned())
                        }
                        other => Err(ScopeError::BadResourceTypes {
                            found: format!("an array holding {}", describe(other)),
                        }),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            Some(other) => {
                return Err(ScopeError::BadResourceTypes {
                    found: describe(other),
                })
            }
        };
        Ok(Self {
            resource_type,
            conditions,
            resource_types,
        })
    }

    /// A user scope has no conditions; its deliveries need a per-entry access check.
    pub fn is_user_scope(&self) -> bool {
        self.conditions.is_empty()
    }

    /// Whether a broadcast with these params reaches this scope (`scope-sync.md`, "Conditions").
    ///
    /// The params must carry a non-null `resourceType`: equal to the scope's type, or listed in
    /// `resourceTypes` for the all-types scope (which without `resourceTypes` matches nothing).
    /// Then every condition must hold for the params' values, as
    /// [`Conditions`](crate::scope_sync::Conditions) has it: a scalar by value (`5` matches
    /// `"5"`), an array by membership, an operator object by each operator; a missing key is
    /// NULL.
    pub fn matches(&self, params: &Map<String, Value>) -> bool {
        // Fail closed on a missing or null type; JS would compare the text "null".
        let broadcast_type = match params.get("resourceType") {
            None | Some(Value::Null) => return false,
            Some(value) => js_string_form(value),
        };
        let type_matches = match (&self.resource_type, &self.resource_types) {
            (Some(resource_type), _) => *resource_type == broadcast_type,
            (None, Some(resource_types)) => resource_types.contains(&broadcast_type),
            (None, None) => false,
        };
        // The conditions were validated when the scope was made.
        type_matches
            && Conditions::parse(&self.conditions)
                .is_ok_and(|conditions| conditions.matches(params))
    }
}

impl TryFrom<Value> for ChangesScope {
    type Error = ScopeError;

    fn try_from(value: Value) -> Result<Self, Self::Error> {
        match value {
            Value::Object(params) => ChangesScope::from_params(&params),
            other => Err(ScopeError::BadConditions {
                found: format!("a scope that is {}", describe(&other)),
            }),
        }
    }
}

fn validate_conditions(conditions: &Map<String, Value>) -> Result<(), ScopeError> {
    Conditions::parse(conditions)?;
    Ok(())
}

/// Stable JSON, as velocious computes it for digests and `conditions_json`: `JSON.stringify`
/// with object keys sorted recursively in JS order (UTF-16 code units), no whitespace.
pub fn stable_json(value: &Value) -> String {
    let mut out = String::new();
    write_stable_json(value, &mut out);
    out
}

fn write_stable_json(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(flag) => out.push_str(if *flag { "true" } else { "false" }),
        Value::Number(number) => out.push_str(&json_number_text(number)),
        Value::String(text) => write_js_string(text, out),
        Value::Array(items) => {
            out.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                write_stable_json(item, out);
            }
            out.push(']');
        }
        Value::Object(object) => write_stable_object(object, out),
    }
}

fn write_stable_object(object: &Map<String, Value>, out: &mut String) {
    let mut entries: Vec<_> = object.iter().collect();
    entries.sort_by(|(a, _), (b, _)| js_string_cmp(a, b));
    out.push('{');
    for (index, (key, value)) in entries.into_iter().enumerate() {
        if index > 0 {
            out.push(',');
        }
        write_js_string(key, out);
        out.push(':');
        write_stable_json(value, out);
    }
    out.push('}');
}

/// A string as `JSON.stringify` writes it: short escapes for `\b \f \n \r \t`, `\u00xx` for
/// other control characters, everything else (non-ASCII included) verbatim.
fn write_js_string(text: &str, out: &mut String) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(object) => object,
            other => panic!("expected an object, got {other}"),
        }
    }

    // Scenario 4: the digest vectors (scope-sync.md, "Scopes and digests").

    #[test]
    fn scenario_04_user_scope_digest_includes_the_owner() {
        let scope = Scope::user("token-abc");
        assert_eq!(scope.key(), "owner=\"token-abc\"|:{}");
        assert_eq!(
            scope.digest().to_string(),
            "848fc985-57e9-5355-82a4-467eb5f792cd"
        );
    }

    #[test]
    fn scenario_04_all_types_scope_without_owner() {
        let scope = Scope {
            resource_type: None,
            conditions: Map::new(),
            owner: None,
        };
        assert_eq!(scope.key(), ":{}");
        assert_eq!(
            scope.digest().to_string(),
            "6c2ff54c-cd6a-5ecc-810f-a80b20aa0c85"
        );
    }

    #[test]
    fn scenario_04_typed_scope_with_one_condition() {
        let scope = Scope::of_type("Task", object(json!({"project_id": "p1"})));
        assert_eq!(scope.key(), "Task:{\"project_id\":\"p1\"}");
        assert_eq!(
            scope.digest().to_string(),
            "46fa6bff-e1f7-5d79-ba0d-967dec3d28b6"
        );
    }

    #[test]
    fn scenario_04_conditions_are_sorted_before_digesting() {
        let scope = Scope::of_type(
            "Task",
            object(json!({"status": ["open", "done"], "project_id": 5})),
        );
        assert_eq!(
            scope.key(),
            "Task:{\"project_id\":5,\"status\":[\"open\",\"done\"]}"
        );
        assert_eq!(
            scope.digest().to_string(),
            "3b36dacf-b9e6-5e95-b395-d4b38bd5615b"
        );
    }

    #[test]
    fn scenario_04_non_ascii_names_digest_their_utf16_low_bytes() {
        let scope = Scope::of_type("Task", object(json!({"title": "Blåbær"})));
        assert_eq!(scope.key(), "Task:{\"title\":\"Blåbær\"}");
        assert_eq!(
            scope.digest().to_string(),
            "210e4b5a-443b-52c1-a770-e32636745b9c"
        );
        // Standard v5 over UTF-8 differs: the quirk is really in effect.
        let name = format!("{DIGEST_NAME_PREFIX}{}", scope.key());
        let standard = Uuid::new_v5(&Uuid::NAMESPACE_URL, name.as_bytes());
        assert!(standard.to_string().starts_with("67f8d7f0-"));
    }

    #[test]
    fn a_null_owner_is_the_same_scope_as_no_owner() {
        let mut scope = Scope::of_type("Task", Map::new());
        let without = scope.digest();
        scope.owner = Some(Value::Null);
        assert_eq!(scope.digest(), without);
        scope.owner = Some(json!("someone"));
        assert_ne!(scope.digest(), without);
    }

    #[test]
    fn digests_parse_back_from_their_text() {
        let digest = Scope::user("t").digest();
        assert_eq!(digest.to_string().parse::<ScopeDigest>(), Ok(digest));
        assert_eq!(
            serde_json::to_value(digest).unwrap(),
            json!(digest.to_string())
        );
        assert!(matches!(
            "nope".parse::<ScopeDigest>(),
            Err(ScopeError::BadDigest { .. })
        ));
    }

    #[test]
    fn scopes_serialize_in_their_camel_case_shape() {
        let scope = Scope::of_type("Task", object(json!({"projectId": "p1"})));
        assert_eq!(
            serde_json::to_value(&scope).unwrap(),
            json!({"resourceType": "Task", "conditions": {"projectId": "p1"}})
        );
        let back: Scope =
            serde_json::from_value(json!({"resourceType": null, "owner": "t"})).unwrap();
        assert_eq!(back, Scope::user("t"));
    }

    // Stable JSON.

    #[test]
    fn stable_json_sorts_keys_recursively_and_writes_numbers_like_javascript() {
        let value = json!({"b": {"z": 1, "a": [2.0, {"y": null, "x": true}]}, "a": 1.5e21});
        assert_eq!(
            stable_json(&value),
            r#"{"a":1.5e+21,"b":{"a":[2,{"x":true,"y":null}],"z":1}}"#
        );
    }

    #[test]
    fn stable_json_escapes_strings_like_json_stringify() {
        let value = json!("q\"b\\\u{8}\u{c}\n\r\t\u{1}\u{7f}é\u{2028}");
        assert_eq!(
            stable_json(&value),
            "\"q\\\"b\\\\\\b\\f\\n\\r\\t\\u0001\u{7f}é\u{2028}\""
        );
    }

    #[test]
    fn stable_json_orders_keys_by_utf16_code_units() {
        let value = json!({"\u{FF61}": 1, "\u{1F600}": 2, "a": 3});
        assert_eq!(
            stable_json(&value),
            "{\"a\":3,\"\u{1F600}\":2,\"\u{FF61}\":1}"
        );
    }

    #[test]
    fn conditions_must_be_scalars_arrays_of_scalars_or_operator_objects() {
        assert!(
            Scope::of_type("Task", object(json!({"a": [1, "x", null, true]})))
                .validate()
                .is_ok()
        );
        for bad in [
            json!({"a": {"b": 1}}),
            json!({"a": {}}),
            json!({"a": [[1]]}),
            json!({"a": [{}]}),
        ] {
            let error = Scope::of_type("Task", object(bad)).validate().unwrap_err();
            assert!(error.to_string().contains("\"a\""), "{error}");
        }
    }

    // Parsing the scope of subscribe params (scope-sync.md, "Subscribe params").

    #[test]
    fn changes_scope_trims_types_and_requires_object_conditions() {
        let scope = ChangesScope::from_params(&object(json!({
            "resourceType": " Task ", "conditions": {"projectId": "p1"}, "other": 1
        })))
        .unwrap();
        assert_eq!(scope.resource_type.as_deref(), Some("Task"));
        assert_eq!(scope.resource_types, None);
        assert!(!scope.is_user_scope());

        let all = ChangesScope::from_params(&object(json!({
            "resourceType": null, "conditions": {}, "resourceTypes": ["Task", " Note "]
        })))
        .unwrap();
        assert_eq!(
            all.resource_types,
            Some(vec!["Task".to_owned(), "Note".to_owned()])
        );
        assert!(all.is_user_scope());
    }

    #[test]
    fn malformed_scopes_are_rejected_with_what_arrived() {
        let cases = [
            (json!({"resourceType": "  ", "conditions": {}}), "expected resourceType to be null or a non-blank string, got string \"  \""),
            (json!({"resourceType": 5, "conditions": {}}), "expected resourceType to be null or a non-blank string, got number 5"),
            (json!({"conditions": []}), "expected conditions to be an object, got an array of 0 items"),
            (json!({"resourceType": "Task"}), "expected conditions to be an object, got nothing"),
            (json!({"conditions": {}, "resourceTypes": "Task"}), "expected resourceTypes to be null or an array of non-blank strings, got string \"Task\""),
            (json!({"conditions": {}, "resourceTypes": ["Task", ""]}), "expected resourceTypes to be null or an array of non-blank strings, got an array holding string \"\""),
        ];
        for (params, message) in cases {
            let error = ChangesScope::from_params(&object(params)).unwrap_err();
            assert_eq!(error.to_string(), message);
        }
    }

    // Scenario 22 (routing) and the type rules of scenario 21.

    fn task_scope(conditions: Value) -> ChangesScope {
        ChangesScope::from_params(&object(
            json!({"resourceType": "Task", "conditions": conditions}),
        ))
        .unwrap()
    }

    #[test]
    fn scenario_22_a_numeric_condition_matches_a_string_param_by_value() {
        let scope = task_scope(json!({"projectId": 5}));
        assert!(scope.matches(&object(json!({"resourceType": "Task", "projectId": "5"}))));
        assert!(!scope.matches(&object(json!({"resourceType": "Task", "projectId": "6"}))));
        let by_text = task_scope(json!({"projectId": "5"}));
        assert!(by_text.matches(&object(json!({"resourceType": "Task", "projectId": 5.0}))));
    }

    #[test]
    fn scenario_22_an_array_condition_matches_by_membership() {
        let scope = task_scope(json!({"status": ["open", "done"]}));
        assert!(scope.matches(&object(json!({"resourceType": "Task", "status": "done"}))));
        assert!(!scope.matches(&object(json!({"resourceType": "Task", "status": "closed"}))));
    }

    #[test]
    fn scenario_22_a_missing_condition_key_never_matches() {
        let scope = task_scope(json!({"projectId": "p1", "status": "open"}));
        assert!(!scope.matches(&object(json!({"resourceType": "Task", "projectId": "p1"}))));
        assert!(scope.matches(&object(
            json!({"resourceType": "Task", "projectId": "p1", "status": "open", "extra": 1})
        )));
    }

    #[test]
    fn scenario_21_a_broadcast_without_a_type_never_matches() {
        let typed = task_scope(json!({}));
        assert!(!typed.matches(&object(json!({"projectId": "p1"}))));
        assert!(!typed.matches(&object(json!({"resourceType": null}))));
        let all = ChangesScope::from_params(&object(
            json!({"conditions": {}, "resourceTypes": ["Task"]}),
        ))
        .unwrap();
        assert!(!all.matches(&object(json!({}))));
    }

    #[test]
    fn scenario_21_the_all_types_scope_matches_only_listed_types() {
        let all = ChangesScope::from_params(&object(
            json!({"resourceType": null, "conditions": {}, "resourceTypes": ["Task", "Note"]}),
        ))
        .unwrap();
        assert!(all.matches(&object(json!({"resourceType": "Note", "projectId": "p9"}))));
        assert!(!all.matches(&object(json!({"resourceType": "Secret"}))));
        let unlisted = ChangesScope::from_params(&object(json!({"conditions": {}}))).unwrap();
        assert!(!unlisted.matches(&object(json!({"resourceType": "Task"}))));
    }

    #[test]
    fn a_typed_user_scope_matches_every_broadcast_of_its_type() {
        let scope = task_scope(json!({}));
        assert!(scope.matches(&object(json!({"resourceType": "Task", "projectId": "p1"}))));
        assert!(!scope.matches(&object(json!({"resourceType": "Note"}))));
    }

    #[test]
    fn changes_scopes_deserialize_with_validation() {
        let scope: ChangesScope =
            serde_json::from_value(json!({"resourceType": "Task", "conditions": {"a": 1}}))
                .unwrap();
        assert_eq!(scope, task_scope(json!({"a": 1})));
        assert!(serde_json::from_value::<ChangesScope>(json!({"conditions": 1})).is_err());
        assert_eq!(
            serde_json::to_value(&scope).unwrap(),
            json!({"resourceType": "Task", "conditions": {"a": 1}})
        );
    }

    proptest! {
        #[test]
        fn digests_ignore_condition_key_order(
            pairs in prop::collection::btree_map("[a-z_]{1,6}", any::<i32>(), 0..6)
        ) {
            let forward: Map<String, Value> =
                pairs.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
            let backward: Map<String, Value> =
                pairs.iter().rev().map(|(k, v)| (k.clone(), json!(v))).collect();
            prop_assert_eq!(
                Scope::of_type("T", forward).digest(),
                Scope::of_type("T", backward).digest()
            );
        }

        #[test]
        fn a_scalar_condition_matches_its_own_value_in_any_string_form(value in any::<i64>()) {
            let scope = task_scope(json!({"k": value}));
            let as_text = value.to_string();
            let params = object(json!({"resourceType": "Task", "k": as_text}));
            prop_assert!(scope.matches(&params));
        }
    }
}
