//! Writes through the scope-sync socket (`docs/protocol/scope-sync.md`, "Writes"): the mutations
//! a client sends, the server's answer for each, and the echo that names a client's mutations
//! in the envelope of the upstream transaction that applied them.
//!
//! A mutation is numbered by its client: `id` grows with every mutation a client (`clientId`, a
//! random id its store keeps) makes, so a resend is recognised upstream (the last applied id of
//! each client is written in the same Postgres transaction as the write) and applied once.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::scope_sync::coercion::{describe, integer_from_number, IntegerText};

/// Mutations one `mutate` frame may carry; a client sends its outbox in batches of at most this.
pub const MAX_MUTATIONS_PER_FRAME: usize = 100;
/// The longest `clientId`, in bytes.
pub const MAX_CLIENT_ID_BYTES: usize = 64;
/// The most columns a mutation's row may name (Postgres allows 1,600 per table).
pub const MAX_ROW_COLUMNS: usize = 1600;

/// Stable codes of a rejected mutation (and of one to retry).
pub mod rejection {
    /// The rules do not allow this write (table, operation, column, or a row out of reach).
    pub const FORBIDDEN: &str = "forbidden";
    /// The mutation is malformed, names an unknown column, or holds a value Postgres refuses.
    pub const INVALID: &str = "invalid";
    /// Postgres refused it for a constraint (unique, foreign key, not null, check).
    pub const CONSTRAINT: &str = "constraint";
    /// `ifVersion` no longer matches, or the row to update or delete is gone.
    pub const CONFLICT: &str = "conflict";
    /// The token was refused; the client gets a fresh one and sends the mutation again.
    pub const AUTH: &str = "auth";
    /// Not applied now (the node takes no writes, or Postgres is unreachable): send it again
    /// later. Never final.
    pub const UNAVAILABLE: &str = "unavailable";

    /// The SQLSTATE `highwater.confirm` raises for a mutation id not above the client's last:
    /// the mutation was handled before (`docs/protocol/scope-sync.md`, "Writes").
    pub const ALREADY_APPLIED_SQLSTATE: &str = "HW409";

    /// How a mutation is answered when Postgres refused its transaction with SQLSTATE `code`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum PgRefusal {
        /// Handled before: it gets the answer it got then.
        AlreadyApplied,
        /// Refused for good, with this code.
        Final(&'static str),
        /// It may pass later (a timeout, a serialization failure, the server going away):
        /// `retry`.
        Transient,
    }

    /// The answer for a transaction Postgres refused with SQLSTATE `code`: integrity
    /// constraints (class 23) are `constraint`; data exceptions (class 22), an unknown column
    /// or table, a datatype mismatch, and an app's trigger raising (`P0001`) are `invalid`; a
    /// missing privilege is `forbidden`; anything else may pass later.
    pub fn for_sqlstate(code: &str) -> PgRefusal {
        match code {
            ALREADY_APPLIED_SQLSTATE => PgRefusal::AlreadyApplied,
            _ if code.starts_with("23") => PgRefusal::Final(CONSTRAINT),
            "42703" | "42804" | "42P01" | "P0001" => PgRefusal::Final(INVALID),
            _ if code.starts_with("22") => PgRefusal::Final(INVALID),
            "42501" => PgRefusal::Final(FORBIDDEN),
            _ => PgRefusal::Transient,
        }
    }

    /// A recorded rejection's code as one of the final codes (an app may record codes of its
    /// own, which are `invalid`).
    pub fn stable(code: &str) -> &'static str {
        [FORBIDDEN, INVALID, CONSTRAINT, CONFLICT]
            .into_iter()
            .find(|known| *known == code)
            .unwrap_or(INVALID)
    }
}

/// A batch's results, in order (`docs/protocol/scope-sync.md`, "Writes"): once a mutation's
/// result is `retry`, every later one of the batch is `retry` with the same code and is not
/// applied, so the client sends them again in order.
#[derive(Debug, Clone, Default)]
pub struct BatchResults {
    results: Vec<MutationResult>,
    /// The first `retry`: its id and code.
    stopped: Option<(u64, String)>,
}

impl BatchResults {
    pub fn with_capacity(mutations: usize) -> Self {
        BatchResults {
            results: Vec::with_capacity(mutations),
            stopped: None,
        }
    }

    /// Every mutation of a batch answered `retry` with `code`, before any was tried (a token
    /// refused, the replica or upstream out of reach).
    pub fn retry_all(ids: &[u64], code: &str, message: &str) -> Vec<MutationResult> {
        ids.iter()
            .map(|id| MutationResult::retry(*id, code, message))
            .collect()
    }

    /// Whether mutation `id` is to be tried; when the batch has stopped, its `retry` is
    /// recorded instead and it must not be applied.
    pub fn try_next(&mut self, id: u64) -> bool {
        let Some((stop_id, code)) = &self.stopped else {
            return true;
        };
        let message =
            format!("not applied: mutation {stop_id} before it is to be sent again first");
        self.results.push(MutationResult::retry(id, code, message));
        false
    }

    /// The result of a mutation tried; a `retry` stops the batch.
    pub fn push(&mut self, result: MutationResult) {
        if result.status == MutationStatus::Retry && self.stopped.is_none() {
            let code = result.code.as_deref().unwrap_or(rejection::UNAVAILABLE);
            self.stopped = Some((result.id, code.to_owned()));
        }
        self.results.push(result);
    }

    pub fn finish(self) -> Vec<MutationResult> {
        self.results
    }
}

/// What a mutation does to its row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MutationOp {
    /// A new row: every column the app sets (the others take their defaults).
    Insert,
    /// The key columns plus the changed columns.
    Update,
    /// The key columns.
    Delete,
}

impl MutationOp {
    pub fn as_str(self) -> &'static str {
        match self {
            MutationOp::Insert => "insert",
            MutationOp::Update => "update",
            MutationOp::Delete => "delete",
        }
    }
}

/// One write of a client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Mutation {
    /// The client's number for it: positive, growing with each mutation the client makes.
    pub id: u64,
    pub table: String,
    pub op: MutationOp,
    pub row: Map<String, Value>,
    /// For an update or delete: the row's `serverSequence` the client saw. The write is
    /// refused with `conflict` when the row has changed since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub if_version: Option<i64>,
}

/// A mutation the server cannot read past its id: it is rejected as `invalid` on its own, and
/// the ones after it in the frame still apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mutation {id}: {reason}")]
pub struct InvalidMutation {
    pub id: u64,
    pub reason: String,
}

/// A `mutate` frame's mutation without a usable `id`: the whole frame is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected each mutation to be an object with a positive integer `id`, got {found}")]
pub struct MutationIdError {
    pub found: String,
}

impl Mutation {
    /// Reads one mutation of a `mutate` frame. Unknown keys are ignored.
    pub fn parse(value: &Value) -> Result<Result<Mutation, InvalidMutation>, MutationIdError> {
        let id = value
            .get("id")
            .and_then(|id| match id {
                Value::Number(number) => match integer_from_number(number) {
                    IntegerText::Integer(id) => u64::try_from(id).ok().filter(|id| *id > 0),
                    IntegerText::NotInteger | IntegerText::OutOfRange => None,
                },
                _ => None,
            })
            .ok_or_else(|| MutationIdError {
                found: describe(value.get("id").unwrap_or(value)),
            })?;
        let invalid = |reason: String| Ok(Err(InvalidMutation { id, reason }));
        let table = match value.get("table") {
            Some(Value::String(table)) if !table.trim().is_empty() => table.clone(),
            other => {
                return invalid(format!(
                    "expected `table` to name a table, got {}",
                    other.map_or_else(|| "nothing".to_owned(), describe)
                ))
            }
        };
        let op = match value.get("op").and_then(Value::as_str) {
            Some("insert") => MutationOp::Insert,
            Some("update") => MutationOp::Update,
            Some("delete") => MutationOp::Delete,
            _ => {
                return invalid(format!(
                    "expected `op` to be \"insert\", \"update\" or \"delete\", got {}",
                    value
                        .get("op")
                        .map_or_else(|| "nothing".to_owned(), describe)
                ))
            }
        };
        let row = match value.get("row") {
            Some(Value::Object(row)) if row.is_empty() => {
                return invalid(
                    "expected `row` to name at least one column, got an empty object".to_owned(),
                )
            }
            Some(Value::Object(row)) if row.len() > MAX_ROW_COLUMNS => {
                return invalid(format!(
                    "expected `row` to name at most {MAX_ROW_COLUMNS} columns, got {}",
                    row.len()
                ))
            }
            Some(Value::Object(row)) => row.clone(),
            other => {
                return invalid(format!(
                    "expected `row` to be an object of columns, got {}",
                    other.map_or_else(|| "nothing".to_owned(), describe)
                ))
            }
        };
        let if_version = match value.get("ifVersion") {
            None | Some(Value::Null) => None,
            Some(Value::Number(number)) => match integer_from_number(number) {
                IntegerText::Integer(version) if version >= 0 => Some(version),
                _ => {
                    return invalid(format!(
                        "expected `ifVersion` to be a serverSequence (an integer), got {}",
                        describe(&Value::Number(number.clone()))
                    ))
                }
            },
            Some(other) => {
                return invalid(format!(
                    "expected `ifVersion` to be a serverSequence (an integer), got {}",
                    describe(other)
                ))
            }
        };
        if if_version.is_some() && op == MutationOp::Insert {
            return invalid("`ifVersion` is for updates and deletes, not inserts".to_owned());
        }
        Ok(Ok(Mutation {
            id,
            table,
            op,
            row,
            if_version,
        }))
    }

    /// The mutation as it goes in a `mutate` frame.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// Whether a client id is acceptable: 1 to [`MAX_CLIENT_ID_BYTES`] bytes of letters, digits,
/// `-` and `_`.
pub fn valid_client_id(client_id: &str) -> bool {
    !client_id.is_empty()
        && client_id.len() <= MAX_CLIENT_ID_BYTES
        && client_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// What became of one mutation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MutationStatus {
    /// Applied upstream (now or by an earlier send), and its change has reached this node's
    /// replica and was sent, before this answer, to every scope of the socket it belongs to.
    Confirmed,
    /// Refused for good: the client drops it; `code` says why.
    Rejected,
    /// Not applied now: the client keeps it and sends it again later.
    Retry,
}

/// The server's answer for one mutation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MutationResult {
    pub id: u64,
    pub status: MutationStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// For `conflict`: the row as it is now (`null` when it is gone), with the columns the
    /// rules let this client read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row: Option<Value>,
}

impl MutationResult {
    pub fn confirmed(id: u64) -> Self {
        MutationResult {
            id,
            status: MutationStatus::Confirmed,
            code: None,
            message: None,
            row: None,
        }
    }

    pub fn rejected(id: u64, code: &str, message: impl Into<String>) -> Self {
        MutationResult {
            id,
            status: MutationStatus::Rejected,
            code: Some(code.to_owned()),
            message: Some(message.into()),
            row: None,
        }
    }

    pub fn retry(id: u64, code: &str, message: impl Into<String>) -> Self {
        MutationResult {
            id,
            status: MutationStatus::Retry,
            code: Some(code.to_owned()),
            message: Some(message.into()),
            row: None,
        }
    }

    /// Reads one result of a `mutation-result` frame: what its `Deserialize` accepts from an
    /// object (`id` a u64, `status` one of the statuses, `code` and `message` strings or null,
    /// any `row`; other keys ignored), read in place. A client's module has no serde
    /// deserializer over `Value` for it (one per type, each several KB of wasm).
    pub fn from_value(value: &Value) -> Option<MutationResult> {
        let object = value.as_object()?;
        let status = match object.get("status")?.as_str()? {
            "confirmed" => MutationStatus::Confirmed,
            "rejected" => MutationStatus::Rejected,
            "retry" => MutationStatus::Retry,
            _ => return None,
        };
        Some(MutationResult {
            id: object.get("id")?.as_u64()?,
            status,
            code: optional_text(object.get("code"))?,
            message: optional_text(object.get("message"))?,
            row: object.get("row").filter(|row| !row.is_null()).cloned(),
        })
    }
}

/// An optional string field as serde reads `Option<String>`: absent or null is `None`, a
/// string is itself, anything else fails (the outer `None`).
fn optional_text(value: Option<&Value>) -> Option<Option<String>> {
    match value {
        None | Some(Value::Null) => Some(None),
        Some(Value::String(text)) => Some(Some(text.clone())),
        Some(_) => None,
    }
}

impl Echo {
    /// Reads the object form of an envelope's `echoOrigin` as its `Deserialize` does from an
    /// object (`clientId` a string, `mutationIds` an array of u64; other keys ignored), in
    /// place.
    pub fn from_object(object: &Map<String, Value>) -> Option<Echo> {
        Some(Echo {
            client_id: object.get("clientId")?.as_str()?.to_owned(),
            mutation_ids: object
                .get("mutationIds")?
                .as_array()?
                .iter()
                .map(Value::as_u64)
                .collect::<Option<_>>()?,
        })
    }
}

/// The mutations of one client an envelope's upstream transaction applied: the envelope's
/// `echoOrigin` in its object form, sent to that client only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Echo {
    pub client_id: String,
    pub mutation_ids: Vec<u64>,
}

/// The content of the logical decoding message `highwater.confirm(client_id, mutation_id)`
/// writes into the transaction that applied a mutation.
pub const CONFIRM_MESSAGE_PREFIX: &str = "highwater.confirm";

/// Reads a confirm message's content: `{"clientId": "…", "mutationId": N}`.
pub fn parse_confirm_message(content: &[u8]) -> Option<(String, u64)> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Confirm {
        client_id: String,
        mutation_id: u64,
    }
    let confirm: Confirm = serde_json::from_slice(content).ok()?;
    valid_client_id(&confirm.client_id).then_some((confirm.client_id, confirm.mutation_id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_mutation_reads_from_its_wire_form_and_writes_back_the_same() {
        let wire = json!({"id": 7, "table": "todos", "op": "update",
            "row": {"id": 3, "done": true}, "ifVersion": 41});
        let mutation = Mutation::parse(&wire).unwrap().unwrap();
        assert_eq!(mutation.id, 7);
        assert_eq!(mutation.op, MutationOp::Update);
        assert_eq!(mutation.if_version, Some(41));
        assert_eq!(mutation.to_value(), wire);
    }

    #[test]
    fn a_malformed_mutation_is_invalid_on_its_own_and_one_without_an_id_refuses_the_frame() {
        for (wire, reason) in [
            (
                json!({"id": 1, "table": "", "op": "insert", "row": {"a": 1}}),
                "expected `table` to name a table, got string \"\"",
            ),
            (
                json!({"id": 1, "table": "t", "op": "upsert", "row": {"a": 1}}),
                "expected `op` to be \"insert\", \"update\" or \"delete\", got string \"upsert\"",
            ),
            (
                json!({"id": 1, "table": "t", "op": "insert", "row": [1]}),
                "expected `row` to be an object of columns, got an array of 1 items",
            ),
            (
                json!({"id": 1, "table": "t", "op": "insert", "row": {"a": 1}, "ifVersion": 3}),
                "`ifVersion` is for updates and deletes, not inserts",
            ),
            (
                json!({"id": 1, "table": "t", "op": "delete", "row": {"a": 1}, "ifVersion": "3"}),
                "expected `ifVersion` to be a serverSequence (an integer), got string \"3\"",
            ),
        ] {
            let error = Mutation::parse(&wire).unwrap().unwrap_err();
            assert_eq!(error.id, 1);
            assert!(error.reason.starts_with(reason), "{wire}: {}", error.reason);
        }
        for wire in [
            json!({"table": "t"}),
            json!({"id": 0}),
            json!({"id": -1}),
            json!({"id": 1.5}),
            json!(3),
        ] {
            assert!(Mutation::parse(&wire).is_err(), "{wire}");
        }
    }

    #[test]
    fn client_ids_are_short_and_plain() {
        assert!(valid_client_id("c-1_AZ"));
        assert!(!valid_client_id(""));
        assert!(!valid_client_id("a b"));
        assert!(!valid_client_id(&"x".repeat(MAX_CLIENT_ID_BYTES + 1)));
    }

    #[test]
    fn confirm_messages_name_a_client_and_a_mutation() {
        assert_eq!(
            parse_confirm_message(br#"{"clientId":"c1","mutationId":9}"#),
            Some(("c1".to_owned(), 9))
        );
        assert_eq!(
            parse_confirm_message(br#"{"clientId":"c 1","mutationId":9}"#),
            None
        );
        assert_eq!(parse_confirm_message(b"not json"), None);
    }

    #[test]
    fn results_round_trip() {
        let result = MutationResult::rejected(4, rejection::CONFLICT, "changed since");
        let value = serde_json::to_value(&result).unwrap();
        assert_eq!(
            value,
            json!({"id": 4, "status": "rejected", "code": "conflict", "message": "changed since"})
        );
        assert_eq!(MutationResult::from_value(&value), Some(result));
    }

    #[test]
    fn postgres_refusals_map_to_final_codes_or_a_retry() {
        use rejection::{for_sqlstate, PgRefusal};
        assert_eq!(for_sqlstate("HW409"), PgRefusal::AlreadyApplied);
        for (code, answer) in [
            ("23505", rejection::CONSTRAINT),
            ("23503", rejection::CONSTRAINT),
            ("22P02", rejection::INVALID),
            ("42703", rejection::INVALID),
            ("42P01", rejection::INVALID),
            ("P0001", rejection::INVALID),
            ("42501", rejection::FORBIDDEN),
        ] {
            assert_eq!(for_sqlstate(code), PgRefusal::Final(answer), "{code}");
        }
        for code in ["40001", "40P01", "57014", "55P03", "08006", "XX000"] {
            assert_eq!(for_sqlstate(code), PgRefusal::Transient, "{code}");
        }
        assert_eq!(rejection::stable("conflict"), rejection::CONFLICT);
        assert_eq!(rejection::stable("my-app-code"), rejection::INVALID);
    }

    #[test]
    fn a_retry_stops_the_batch_and_every_later_mutation_is_retried_with_its_code() {
        let mut batch = BatchResults::with_capacity(4);
        assert!(batch.try_next(1));
        batch.push(MutationResult::confirmed(1));
        assert!(batch.try_next(2));
        batch.push(MutationResult::rejected(2, rejection::CONFLICT, "gone"));
        assert!(batch.try_next(3));
        batch.push(MutationResult::retry(3, rejection::UNAVAILABLE, "timeout"));
        assert!(!batch.try_next(4));
        assert!(!batch.try_next(5));
        let results = batch.finish();
        let statuses: Vec<_> = results.iter().map(|r| (r.id, r.status)).collect();
        assert_eq!(
            statuses,
            [
                (1, MutationStatus::Confirmed),
                (2, MutationStatus::Rejected),
                (3, MutationStatus::Retry),
                (4, MutationStatus::Retry),
                (5, MutationStatus::Retry)
            ]
        );
        assert_eq!(results[4].code.as_deref(), Some(rejection::UNAVAILABLE));
        assert_eq!(
            results[4].message.as_deref(),
            Some("not applied: mutation 3 before it is to be sent again first")
        );
        let all = BatchResults::retry_all(&[7, 8], rejection::AUTH, "fresh token");
        assert!(all
            .iter()
            .all(|r| r.status == MutationStatus::Retry && r.code.as_deref() == Some("auth")));
    }
}
