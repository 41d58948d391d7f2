//! Decoding JSON into typed messages with Zero's validation rules
//! (`docs/protocol/change-stream.md`, "Decoding rules").
//!
//! Text is parsed to a [`Value`] first (arbitrary precision keeps big integers exact, and
//! serde_json's recursion limit bounds hostile nesting), then taken apart by hand: known keys
//! are removed from each object and whatever is left becomes that level's `extra`. Every error
//! names the JSON path of the offending value.

use std::fmt;

use indexmap::IndexMap;
use serde_json::{Map, Number, Value};

use super::message::*;
use crate::watermark::{Watermark, WatermarkError};

/// The largest integer a JavaScript number holds exactly; Zero's parser turns larger ones into
/// bigints, which `number`-typed fields reject.
const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// Why a change-stream message or frame was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("at $: expected JSON text, found a syntax error ({message})")]
    Syntax { message: String },
    #[error("at {path}: expected {expected}, found {found}")]
    Unexpected {
        path: String,
        expected: String,
        found: String,
    },
    #[error("at {path}: expected {expected}, found nothing")]
    Missing { path: String, expected: String },
    #[error("at {path}: expected a {tag:?} tuple of {expected} elements, found {}", elements(*found))]
    Arity {
        path: String,
        tag: String,
        expected: usize,
        found: usize,
    },
    #[error("at {path}: expected a number within ±(2^53 − 1), found the big integer {found}")]
    BigInteger { path: String, found: String },
    #[error("at {path}: expected a watermark (canonical LexiVersion `major` or `major.minor`), found {found}")]
    Watermark {
        path: String,
        found: String,
        #[source]
        source: WatermarkError,
    },
}

fn elements(n: usize) -> String {
    match n {
        1 => "1 element".to_owned(),
        n => format!("{n} elements"),
    }
}

impl DecodeError {
    /// The JSON path of the offending value (`$` for text that is not JSON).
    pub fn path(&self) -> &str {
        match self {
            DecodeError::Syntax { .. } => "$",
            DecodeError::Unexpected { path, .. }
            | DecodeError::Missing { path, .. }
            | DecodeError::Arity { path, .. }
            | DecodeError::BigInteger { path, .. }
            | DecodeError::Watermark { path, .. } => path,
        }
    }
}

pub(super) type Result<T> = std::result::Result<T, DecodeError>;

/// A JSON path under construction; rendered only when an error is reported.
#[derive(Clone, Copy)]
pub(super) enum Path<'a> {
    Root,
    Key(&'a Path<'a>, &'a str),
    Index(&'a Path<'a>, usize),
}

impl<'a> Path<'a> {
    pub(super) fn key(&'a self, key: &'a str) -> Path<'a> {
        Path::Key(self, key)
    }

    pub(super) fn index(&'a self, index: usize) -> Path<'a> {
        Path::Index(self, index)
    }
}

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Path::Root => f.write_str("$"),
            Path::Index(parent, i) => write!(f, "{parent}[{i}]"),
            Path::Key(parent, key) => {
                let plain = key
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '$')
                    && key
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
                if plain {
                    write!(f, "{parent}.{key}")
                } else {
                    write!(f, "{parent}[{}]", Value::from(*key))
                }
            }
        }
    }
}

/// A short description of what arrived, for error messages.
pub(super) fn describe(value: &Value) -> String {
    const LIMIT: usize = 60;
    let clip = |text: String| {
        if text.len() <= LIMIT {
            return text;
        }
        let mut end = LIMIT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &text[..end])
    };
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => clip(n.to_string()),
        Value::String(_) => clip(value.to_string()),
        Value::Array(items) => format!("an array of {}", elements(items.len())),
        Value::Object(_) => "an object".to_owned(),
    }
}

pub(super) fn unexpected(path: &Path, expected: impl Into<String>, found: &Value) -> DecodeError {
    DecodeError::Unexpected {
        path: path.to_string(),
        expected: expected.into(),
        found: describe(found),
    }
}

fn missing(path: &Path, expected: &str) -> DecodeError {
    DecodeError::Missing {
        path: path.to_string(),
        expected: expected.to_owned(),
    }
}

/// A wire value with a fixed shape: decodable at a path, describable when absent.
trait Field: Sized {
    const EXPECTED: &'static str;
    fn decode(value: Value, path: &Path) -> Result<Self>;
}

impl<T: Field> Field for std::sync::Arc<T> {
    const EXPECTED: &'static str = T::EXPECTED;
    fn decode(value: Value, path: &Path) -> Result<Self> {
        T::decode(value, path).map(std::sync::Arc::new)
    }
}

/// Required key: absent is an error.
fn req<T: Field>(map: &mut Map<String, Value>, path: &Path, key: &str) -> Result<T> {
    let at = path.key(key);
    match map.shift_remove(key) {
        Some(value) => T::decode(value, &at),
        None => Err(missing(&at, T::EXPECTED)),
    }
}

/// Optional key: may be absent, but not `null`.
fn opt<T: Field>(map: &mut Map<String, Value>, path: &Path, key: &str) -> Result<Option<T>> {
    let at = path.key(key);
    map.shift_remove(key)
        .map(|value| T::decode(value, &at))
        .transpose()
}

/// Required but nullable key: must be present, may be `null`.
fn nullable<T: Field>(map: &mut Map<String, Value>, path: &Path, key: &str) -> Result<Option<T>> {
    let at = path.key(key);
    match map.shift_remove(key) {
        Some(Value::Null) => Ok(None),
        Some(value) => T::decode(value, &at).map(Some),
        None => Err(missing(&at, &format!("{} or null", T::EXPECTED))),
    }
}

/// Optional and nullable key: `None` absent, `Some(None)` null.
fn opt_nullable<T: Field>(
    map: &mut Map<String, Value>,
    path: &Path,
    key: &str,
) -> Result<Option<Option<T>>> {
    let at = path.key(key);
    match map.shift_remove(key) {
        None => Ok(None),
        Some(Value::Null) => Ok(Some(None)),
        Some(value) => T::decode(value, &at).map(|v| Some(Some(v))),
    }
}

fn object(value: Value, path: &Path, expected: &str) -> Result<Map<String, Value>> {
    match value {
        Value::Object(map) => Ok(map),
        other => Err(unexpected(path, expected, &other)),
    }
}

/// Removes and checks the inner `tag` literal.
fn tag_literal(map: &mut Map<String, Value>, path: &Path, literal: &str) -> Result<()> {
    let at = path.key("tag");
    match map.shift_remove("tag") {
        Some(Value::String(s)) if s == literal => Ok(()),
        Some(other) => Err(unexpected(&at, format!("{literal:?}"), &other)),
        None => Err(missing(&at, &format!("{literal:?}"))),
    }
}

impl Field for String {
    const EXPECTED: &'static str = "a string";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        match value {
            Value::String(s) => Ok(s),
            other => Err(unexpected(path, Self::EXPECTED, &other)),
        }
    }
}

impl Field for bool {
    const EXPECTED: &'static str = "a boolean";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        match value {
            Value::Bool(b) => Ok(b),
            other => Err(unexpected(path, Self::EXPECTED, &other)),
        }
    }
}

/// Whether Zero's bigint-aware parser would turn this number into a bigint: an integer literal
/// (no fraction, no exponent) outside ±(2^53 − 1).
pub(super) fn is_big_integer(n: &Number) -> bool {
    let text = n.to_string();
    if text.contains(['.', 'e', 'E']) {
        return false;
    }
    let digits = text.trim_start_matches('-');
    digits.len() > 16 || digits.parse::<u64>().map_or(true, |v| v > MAX_SAFE_INTEGER)
}

/// A `number` field: integers beyond 2^53 are rejected (rule 4).
impl Field for Number {
    const EXPECTED: &'static str = "a number";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        match value {
            Value::Number(n) if is_big_integer(&n) => Err(DecodeError::BigInteger {
                path: path.to_string(),
                found: n.to_string(),
            }),
            Value::Number(n) => Ok(n),
            other => Err(unexpected(path, Self::EXPECTED, &other)),
        }
    }
}

impl Field for Watermark {
    const EXPECTED: &'static str = "a watermark string";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let text = match value {
            Value::String(text) => text,
            other => return Err(unexpected(path, Self::EXPECTED, &other)),
        };
        Watermark::parse(&text).map_err(|source| DecodeError::Watermark {
            path: path.to_string(),
            found: describe(&Value::String(text)),
            source,
        })
    }
}

impl<T: Field> Field for Vec<T> {
    const EXPECTED: &'static str = "an array";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        match value {
            Value::Array(items) => items
                .into_iter()
                .enumerate()
                .map(|(i, item)| T::decode(item, &path.index(i)))
                .collect(),
            other => Err(unexpected(path, Self::EXPECTED, &other)),
        }
    }
}

/// A JSON object of `T` values, in wire order.
impl<T: Field> Field for IndexMap<String, T> {
    const EXPECTED: &'static str = "an object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let map = object(value, path, Self::EXPECTED)?;
        let mut out = IndexMap::with_capacity(map.len());
        for (key, item) in map {
            let decoded = T::decode(item, &path.key(&key))?;
            out.insert(key, decoded);
        }
        Ok(out)
    }
}

/// Any JSON object, kept as is (rows, `rowKey` of table metadata).
impl Field for Map<String, Value> {
    const EXPECTED: &'static str = "an object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        object(value, path, Self::EXPECTED)
    }
}

/// Any JSON value (row values, opaque predicates).
impl Field for Value {
    const EXPECTED: &'static str = "a JSON value";
    fn decode(value: Value, _path: &Path) -> Result<Self> {
        Ok(value)
    }
}

/// A backfill id: an opaque JSON object kept as a [`Value`].
struct ObjectValue(Value);

impl Field for ObjectValue {
    const EXPECTED: &'static str = "an object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        match value {
            Value::Object(_) => Ok(ObjectValue(value)),
            other => Err(unexpected(path, Self::EXPECTED, &other)),
        }
    }
}

/// A row of `rowValues`: any JSON values, big integers included.
struct RowValues(Vec<Value>);

impl Field for RowValues {
    const EXPECTED: &'static str = "an array of row values";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        match value {
            Value::Array(items) => Ok(RowValues(items)),
            other => Err(unexpected(path, Self::EXPECTED, &other)),
        }
    }
}

macro_rules! string_enum {
    ($ty:ty, $expected:literal, { $($text:literal => $variant:expr),+ $(,)? }) => {
        impl Field for $ty {
            const EXPECTED: &'static str = $expected;
            fn decode(value: Value, path: &Path) -> Result<Self> {
                match value.as_str() {
                    $(Some($text) => Ok($variant),)+
                    _ => Err(unexpected(path, Self::EXPECTED, &value)),
                }
            }
        }
    };
}

string_enum!(JsonFormat, r#""p" or "s""#, {
    "p" => JsonFormat::Parsed,
    "s" => JsonFormat::Stringified,
});

string_enum!(ReplicaIdentity, r#"one of "default", "nothing", "full", "index""#, {
    "default" => ReplicaIdentity::Default,
    "nothing" => ReplicaIdentity::Nothing,
    "full" => ReplicaIdentity::Full,
    "index" => ReplicaIdentity::Index,
});

string_enum!(PgTypeClass, r#"a type class, one of "b", "c", "d", "e", "p", "r", "m""#, {
    "b" => PgTypeClass::Base,
    "c" => PgTypeClass::Composite,
    "d" => PgTypeClass::Domain,
    "e" => PgTypeClass::Enum,
    "p" => PgTypeClass::Pseudo,
    "r" => PgTypeClass::Range,
    "m" => PgTypeClass::Multirange,
});

string_enum!(IndexDirection, r#""ASC" or "DESC""#, {
    "ASC" => IndexDirection::Asc,
    "DESC" => IndexDirection::Desc,
});

string_enum!(SubscriberMode, r#""serving" or "backup""#, {
    "serving" => SubscriberMode::Serving,
    "backup" => SubscriberMode::Backup,
});

impl Field for LagTimings {
    const EXPECTED: &'static str = "a lag timings object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(LagTimings {
            send_time_ms: req(&mut m, path, "sendTimeMs")?,
            commit_time_ms: req(&mut m, path, "commitTimeMs")?,
            receive_time_ms: req(&mut m, path, "receiveTimeMs")?,
            extra: m,
        })
    }
}

impl Field for LagReport {
    const EXPECTED: &'static str = "a lag report object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(LagReport {
            last_timings: opt(&mut m, path, "lastTimings")?,
            next_send_time_ms: req(&mut m, path, "nextSendTimeMs")?,
            extra: m,
        })
    }
}

impl Field for Identifier {
    const EXPECTED: &'static str = "an identifier object {schema, name}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(Identifier {
            schema: req(&mut m, path, "schema")?,
            name: req(&mut m, path, "name")?,
            extra: m,
        })
    }
}

impl Field for RowKey {
    const EXPECTED: &'static str = "a row key object {columns, type?}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(RowKey {
            columns: req(&mut m, path, "columns")?,
            r#type: opt(&mut m, path, "type")?,
            extra: m,
        })
    }
}

impl Field for Relation {
    const EXPECTED: &'static str = "a relation object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        let schema = req(&mut m, path, "schema")?;
        let name = req(&mut m, path, "name")?;
        let key_columns: Option<Vec<String>> = opt(&mut m, path, "keyColumns")?;
        let replica_identity = opt(&mut m, path, "replicaIdentity")?;
        let row_key = match opt(&mut m, path, "rowKey")? {
            Some(row_key) => row_key,
            // The deprecated pre-v5 form, normalized as Zero's schema does.
            None => match &key_columns {
                Some(columns) => RowKey::new(columns.clone(), replica_identity),
                None => {
                    return Err(missing(
                        &path.key("rowKey"),
                        "a row key object (or the deprecated \"keyColumns\")",
                    ))
                }
            },
        };
        Ok(Relation {
            schema,
            name,
            row_key,
            key_columns,
            replica_identity,
            extra: m,
        })
    }
}

impl Field for NewRelation {
    const EXPECTED: &'static str = "a relation object {schema, name, rowKey}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(NewRelation {
            schema: req(&mut m, path, "schema")?,
            name: req(&mut m, path, "name")?,
            row_key: req(&mut m, path, "rowKey")?,
            extra: m,
        })
    }
}

impl Field for ColumnSpec {
    const EXPECTED: &'static str = "a column spec object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(ColumnSpec {
            pos: req(&mut m, path, "pos")?,
            data_type: req(&mut m, path, "dataType")?,
            pg_type_class: opt(&mut m, path, "pgTypeClass")?,
            elem_pg_type_class: opt_nullable(&mut m, path, "elemPgTypeClass")?,
            character_maximum_length: opt_nullable(&mut m, path, "characterMaximumLength")?,
            not_null: opt_nullable(&mut m, path, "notNull")?,
            dflt: opt_nullable(&mut m, path, "dflt")?,
            extra: m,
        })
    }
}

impl Field for ColumnDef {
    const EXPECTED: &'static str = "a column object {name, spec}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(ColumnDef {
            name: req(&mut m, path, "name")?,
            spec: req(&mut m, path, "spec")?,
            extra: m,
        })
    }
}

impl Field for TableSpec {
    const EXPECTED: &'static str = "a table spec object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(TableSpec {
            schema: req(&mut m, path, "schema")?,
            name: req(&mut m, path, "name")?,
            columns: req(&mut m, path, "columns")?,
            primary_key: opt(&mut m, path, "primaryKey")?,
            extra: m,
        })
    }
}

impl Field for IndexSpec {
    const EXPECTED: &'static str = "an index spec object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(IndexSpec {
            schema: req(&mut m, path, "schema")?,
            name: req(&mut m, path, "name")?,
            table_name: req(&mut m, path, "tableName")?,
            unique: req(&mut m, path, "unique")?,
            columns: req(&mut m, path, "columns")?,
            predicate: opt(&mut m, path, "predicate")?,
            extra: m,
        })
    }
}

impl Field for TableMetadata {
    const EXPECTED: &'static str = "a table metadata object {rowKey, …}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(TableMetadata {
            row_key: req(&mut m, path, "rowKey")?,
            extra: m,
        })
    }
}

impl Field for DownloadStatus {
    const EXPECTED: &'static str = "a download status object {rows, totalRows, totalBytes?}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(DownloadStatus {
            rows: req(&mut m, path, "rows")?,
            total_rows: req(&mut m, path, "totalRows")?,
            total_bytes: opt(&mut m, path, "totalBytes")?,
            extra: m,
        })
    }
}

impl Field for ProgressMark {
    const EXPECTED: &'static str = "a progress mark object {progressMark, timeline?, …}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        let progress_mark = req(&mut m, path, "progressMark")?;
        let timeline = opt(&mut m, path, "timeline")?;
        // Other fields must be strings or numbers (echoed back in backfill requests).
        for (key, item) in &m {
            let at = path.key(key);
            match item {
                Value::String(_) => {}
                Value::Number(n) => {
                    Number::decode(Value::Number(n.clone()), &at)?;
                }
                other => return Err(unexpected(&at, "a string or a number", other)),
            }
        }
        Ok(ProgressMark {
            progress_mark,
            timeline,
            extra: m,
        })
    }
}

/// `backfill.progressMarks`: `current` is required.
struct BackfillMarks(ProgressMarks);

impl Field for BackfillMarks {
    const EXPECTED: &'static str = "a progress marks object {previous?, current}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        let previous = opt(&mut m, path, "previous")?;
        let current = req(&mut m, path, "current")?;
        Ok(BackfillMarks(ProgressMarks {
            previous,
            current: Some(current),
            extra: m,
        }))
    }
}

/// `backfill-completed.progressMarks`: only `previous` belongs to the schema, so a `current`
/// key stays an unknown (unchecked) key.
struct CompletedMarks(ProgressMarks);

impl Field for CompletedMarks {
    const EXPECTED: &'static str = "a progress marks object {previous?}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(CompletedMarks(ProgressMarks {
            previous: opt(&mut m, path, "previous")?,
            current: None,
            extra: m,
        }))
    }
}

impl Field for BackfillTable {
    const EXPECTED: &'static str = "a table object {schema, name, metadata}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(BackfillTable {
            schema: req(&mut m, path, "schema")?,
            name: req(&mut m, path, "name")?,
            metadata: nullable(&mut m, path, "metadata")?,
            extra: m,
        })
    }
}

impl Field for BackfillColumn {
    const EXPECTED: &'static str = "a backfill column object {id, progress?}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        let ObjectValue(id) = req(&mut m, path, "id")?;
        Ok(BackfillColumn {
            id,
            progress: opt(&mut m, path, "progress")?,
            extra: m,
        })
    }
}

impl Field for BackfillRequest {
    const EXPECTED: &'static str = "a backfill request object {table, columns}";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(BackfillRequest {
            table: req(&mut m, path, "table")?,
            columns: req(&mut m, path, "columns")?,
            extra: m,
        })
    }
}

const CHANGE_TAGS: &str = r#"a change tag, one of "insert", "update", "delete", "truncate", "backfill", "create-table", "rename-table", "update-table-metadata", "add-column", "update-column", "drop-column", "drop-table", "create-index", "drop-index", "backfill-completed""#;

impl Field for Change {
    const EXPECTED: &'static str = "a change object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        let tag_path = path.key("tag");
        let tag = match m.shift_remove("tag") {
            Some(Value::String(tag)) => tag,
            Some(other) => return Err(unexpected(&tag_path, CHANGE_TAGS, &other)),
            None => return Err(missing(&tag_path, CHANGE_TAGS)),
        };
        let p = path;
        let change = match tag.as_str() {
            "insert" => Change::Insert(Insert {
                relation: req(&mut m, p, "relation")?,
                new: req(&mut m, p, "new")?,
                extra: m,
            }),
            "update" => Change::Update(Update {
                relation: req(&mut m, p, "relation")?,
                key: nullable(&mut m, p, "key")?,
                new: req(&mut m, p, "new")?,
                extra: m,
            }),
            "delete" => Change::Delete(Delete {
                relation: req(&mut m, p, "relation")?,
                key: req(&mut m, p, "key")?,
                extra: m,
            }),
            "truncate" => Change::Truncate(Truncate {
                relations: req(&mut m, p, "relations")?,
                extra: m,
            }),
            "backfill" => {
                let relation = req(&mut m, p, "relation")?;
                let columns = req(&mut m, p, "columns")?;
                let watermark = req(&mut m, p, "watermark")?;
                let rows: Vec<RowValues> = req(&mut m, p, "rowValues")?;
                let marks: Option<BackfillMarks> = opt(&mut m, p, "progressMarks")?;
                Change::Backfill(Backfill {
                    relation,
                    columns,
                    watermark,
                    row_values: rows.into_iter().map(|RowValues(r)| r).collect(),
                    progress_marks: marks.map(|BackfillMarks(m)| m),
                    status: opt(&mut m, p, "status")?,
                    extra: m,
                })
            }
            "backfill-completed" => {
                let relation = req(&mut m, p, "relation")?;
                let columns = req(&mut m, p, "columns")?;
                let watermark = req(&mut m, p, "watermark")?;
                let marks: Option<CompletedMarks> = opt(&mut m, p, "progressMarks")?;
                Change::BackfillCompleted(BackfillCompleted {
                    relation,
                    columns,
                    watermark,
                    progress_marks: marks.map(|CompletedMarks(m)| m),
                    status: opt(&mut m, p, "status")?,
                    extra: m,
                })
            }
            "create-table" => {
                let spec = req(&mut m, p, "spec")?;
                let metadata = opt(&mut m, p, "metadata")?;
                let backfill: Option<IndexMap<String, ObjectValue>> = opt(&mut m, p, "backfill")?;
                Change::CreateTable(CreateTable {
                    spec,
                    metadata,
                    backfill: backfill
                        .map(|b| b.into_iter().map(|(k, ObjectValue(v))| (k, v)).collect()),
                    extra: m,
                })
            }
            "rename-table" => Change::RenameTable(RenameTable {
                old: req(&mut m, p, "old")?,
                new: req(&mut m, p, "new")?,
                extra: m,
            }),
            "update-table-metadata" => Change::UpdateTableMetadata(UpdateTableMetadata {
                table: req(&mut m, p, "table")?,
                old: req(&mut m, p, "old")?,
                new: req(&mut m, p, "new")?,
                extra: m,
            }),
            "add-column" => {
                let table = req(&mut m, p, "table")?;
                let column = req(&mut m, p, "column")?;
                let table_metadata = opt(&mut m, p, "tableMetadata")?;
                let backfill: Option<ObjectValue> = opt(&mut m, p, "backfill")?;
                Change::AddColumn(AddColumn {
                    table,
                    column,
                    table_metadata,
                    backfill: backfill.map(|ObjectValue(v)| v),
                    extra: m,
                })
            }
            "update-column" => Change::UpdateColumn(UpdateColumn {
                table: req(&mut m, p, "table")?,
                old: req(&mut m, p, "old")?,
                new: req(&mut m, p, "new")?,
                extra: m,
            }),
            "drop-column" => Change::DropColumn(DropColumn {
                table: req(&mut m, p, "table")?,
                column: req(&mut m, p, "column")?,
                extra: m,
            }),
            "drop-table" => Change::DropTable(DropTable {
                id: req(&mut m, p, "id")?,
                extra: m,
            }),
            "create-index" => Change::CreateIndex(CreateIndex {
                spec: req(&mut m, p, "spec")?,
                extra: m,
            }),
            "drop-index" => Change::DropIndex(DropIndex {
                id: req(&mut m, p, "id")?,
                extra: m,
            }),
            _ => return Err(unexpected(&tag_path, CHANGE_TAGS, &Value::String(tag))),
        };
        Ok(change)
    }
}

impl Field for SubscribeContext {
    const EXPECTED: &'static str = "a subscribe context object";
    fn decode(value: Value, path: &Path) -> Result<Self> {
        let mut m = object(value, path, Self::EXPECTED)?;
        Ok(SubscribeContext {
            task_id: req(&mut m, path, "taskID")?,
            id: req(&mut m, path, "id")?,
            mode: req(&mut m, path, "mode")?,
            replica_version: req(&mut m, path, "replicaVersion")?,
            watermark: req(&mut m, path, "watermark")?,
            backfills: opt(&mut m, path, "backfills")?,
            extra: m,
        })
    }
}

const DOWNSTREAM_TAGS: &str = r#"a downstream message tag, one of "status", "begin", "data", "commit", "rollback", "error", "reserved""#;
const UPSTREAM_TAGS: &str =
    r#"an upstream message tag, "reserve-snapshot" or "start-subscription""#;
const ANY_TAGS: &str = r#"a message tag, one of "status", "begin", "data", "commit", "rollback", "error", "reserved", "reserve-snapshot", "start-subscription""#;

/// Splits a message tuple into its tag and its elements after the tag, checking the arity.
fn tuple(value: Value, path: &Path, tags: &str) -> Result<(String, Vec<Value>)> {
    let mut items = match value {
        Value::Array(items) => items,
        other => return Err(unexpected(path, "a message tuple [tag, …]", &other)),
    };
    let tag_path = path.index(0);
    let tag = match items.first() {
        Some(Value::String(tag)) => tag.clone(),
        Some(other) => return Err(unexpected(&tag_path, tags, other)),
        None => return Err(missing(&tag_path, tags)),
    };
    let arity = match tag.as_str() {
        "begin" | "commit" => 3,
        "status" | "data" | "rollback" | "error" | "reserved" | "reserve-snapshot"
        | "start-subscription" => 2,
        _ => return Err(unexpected(&tag_path, tags, &items[0])),
    };
    if items.len() != arity {
        return Err(DecodeError::Arity {
            path: path.to_string(),
            tag,
            expected: arity,
            found: items.len(),
        });
    }
    items.remove(0);
    Ok((tag, items))
}

fn downstream_body(tag: &str, items: Vec<Value>, path: &Path) -> Result<DownstreamMessage> {
    let mut items = items.into_iter();
    let mut next = || items.next().unwrap_or(Value::Null);
    let (p1, p2) = (path.index(1), path.index(2));
    let message = match tag {
        "status" => {
            let mut m = object(next(), &p1, "a status object")?;
            tag_literal(&mut m, &p1, "status")?;
            DownstreamMessage::Status(Status {
                lag_report: opt(&mut m, &p1, "lagReport")?,
                extra: m,
            })
        }
        "begin" => {
            let mut m = object(next(), &p1, "a begin object")?;
            tag_literal(&mut m, &p1, "begin")?;
            let json = opt(&mut m, &p1, "json")?;
            let skip_ack = opt(&mut m, &p1, "skipAck")?;
            let mut w = object(next(), &p2, "an object {commitWatermark}")?;
            DownstreamMessage::Begin(Begin {
                json,
                skip_ack,
                extra: m,
                commit_watermark: req(&mut w, &p2, "commitWatermark")?,
                watermark_extra: w,
            })
        }
        "data" => DownstreamMessage::Data(Change::decode(next(), &p1)?),
        "commit" => {
            let mut m = object(next(), &p1, "a commit object")?;
            tag_literal(&mut m, &p1, "commit")?;
            let commit_time_ms = opt(&mut m, &p1, "commitTimeMs")?;
            let mut w = object(next(), &p2, "an object {watermark}")?;
            DownstreamMessage::Commit(Commit {
                commit_time_ms,
                extra: m,
                watermark: req(&mut w, &p2, "watermark")?,
                watermark_extra: w,
            })
        }
        "rollback" => {
            let mut m = object(next(), &p1, "a rollback object")?;
            tag_literal(&mut m, &p1, "rollback")?;
            DownstreamMessage::Rollback(Rollback { extra: m })
        }
        "error" => {
            let mut m = object(next(), &p1, "an error object {type, message?}")?;
            DownstreamMessage::Error(StreamError {
                error_type: req(&mut m, &p1, "type")?,
                message: opt(&mut m, &p1, "message")?,
                extra: m,
            })
        }
        // `tuple` only lets "reserved" through otherwise.
        _ => {
            let mut m = object(next(), &p1, "a reservation object")?;
            tag_literal(&mut m, &p1, "snapshot")?;
            DownstreamMessage::Reserved(Reserved {
                backup_url: req(&mut m, &p1, "backupURL")?,
                replica_version: req(&mut m, &p1, "replicaVersion")?,
                min_watermark: req(&mut m, &p1, "minWatermark")?,
                replica_size: opt(&mut m, &p1, "replicaSize")?,
                extra: m,
            })
        }
    };
    Ok(message)
}

fn upstream_body(tag: &str, items: Vec<Value>, path: &Path) -> Result<UpstreamMessage> {
    let p1 = path.index(1);
    let body = items.into_iter().next().unwrap_or(Value::Null);
    if tag == "reserve-snapshot" {
        let mut m = object(body, &p1, "an object {taskID}")?;
        return Ok(UpstreamMessage::ReserveSnapshot(ReserveSnapshot {
            task_id: req(&mut m, &p1, "taskID")?,
            extra: m,
        }));
    }
    Ok(UpstreamMessage::StartSubscription(
        SubscribeContext::decode(body, &p1)?,
    ))
}

fn is_upstream_tag(tag: &str) -> bool {
    matches!(tag, "reserve-snapshot" | "start-subscription")
}

pub(super) fn downstream_at(value: Value, path: &Path) -> Result<DownstreamMessage> {
    let first = value.as_array().and_then(|a| a.first()).cloned();
    if let Some(Value::String(tag)) = &first {
        if is_upstream_tag(tag) {
            return Err(unexpected(
                &path.index(0),
                DOWNSTREAM_TAGS,
                &Value::String(tag.clone()),
            ));
        }
    }
    let (tag, items) = tuple(value, path, DOWNSTREAM_TAGS)?;
    downstream_body(&tag, items, path)
}

pub(super) fn upstream_at(value: Value, path: &Path) -> Result<UpstreamMessage> {
    if let Some(Value::String(tag)) = value.as_array().and_then(|a| a.first()) {
        if !is_upstream_tag(tag) {
            return Err(unexpected(
                &path.index(0),
                UPSTREAM_TAGS,
                &Value::String(tag.clone()),
            ));
        }
    }
    let (tag, items) = tuple(value, path, UPSTREAM_TAGS)?;
    upstream_body(&tag, items, path)
}

pub(super) fn message_at(value: Value, path: &Path) -> Result<Message> {
    let (tag, items) = tuple(value, path, ANY_TAGS)?;
    if is_upstream_tag(&tag) {
        upstream_body(&tag, items, path).map(Message::Upstream)
    } else {
        downstream_body(&tag, items, path).map(Message::Downstream)
    }
}

/// Parses JSON text, keeping big integers exact.
pub fn parse_json(text: &str) -> Result<Value> {
    serde_json::from_str(text).map_err(|e| DecodeError::Syntax {
        message: e.to_string(),
    })
}

/// Decodes one downstream message from JSON text.
pub fn decode_downstream(text: &str) -> Result<DownstreamMessage> {
    downstream_at(parse_json(text)?, &Path::Root)
}

/// Decodes one downstream message from a parsed value.
pub fn decode_downstream_value(value: Value) -> Result<DownstreamMessage> {
    downstream_at(value, &Path::Root)
}

/// Decodes one upstream (`/subscribe` client → server) message from JSON text.
pub fn decode_upstream(text: &str) -> Result<UpstreamMessage> {
    upstream_at(parse_json(text)?, &Path::Root)
}

/// Decodes one upstream message from a parsed value.
pub fn decode_upstream_value(value: Value) -> Result<UpstreamMessage> {
    upstream_at(value, &Path::Root)
}

/// Decodes a message of either direction from JSON text.
pub fn decode_message(text: &str) -> Result<Message> {
    message_at(parse_json(text)?, &Path::Root)
}

/// Decodes a message of either direction from a parsed value.
pub fn decode_message_value(value: Value) -> Result<Message> {
    message_at(value, &Path::Root)
}

/// Decodes just a change (the second element of a `data` tuple), e.g. a change-log row.
pub fn decode_change_value(value: Value) -> Result<Change> {
    Change::decode(value, &Path::Root)
}

/// Decodes a backfill request (v8 shape).
pub fn decode_backfill_request_value(value: Value) -> Result<BackfillRequest> {
    BackfillRequest::decode(value, &Path::Root)
}

/// `Deserialize` through [`Value`] and the path-tracking decoder, so typed messages can be read
/// straight from stored JSON with the same validation.
macro_rules! deserialize_via_value {
    ($ty:ty, $decode:expr) => {
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(
                d: D,
            ) -> std::result::Result<Self, D::Error> {
                let value = Value::deserialize(d)?;
                $decode(value, &Path::Root).map_err(serde::de::Error::custom)
            }
        }
    };
}

deserialize_via_value!(DownstreamMessage, downstream_at);
deserialize_via_value!(UpstreamMessage, upstream_at);
deserialize_via_value!(Message, message_at);
deserialize_via_value!(Change, Change::decode);
deserialize_via_value!(BackfillRequest, BackfillRequest::decode);
deserialize_via_value!(ProgressMark, ProgressMark::decode);
deserialize_via_value!(TableMetadata, TableMetadata::decode);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change_stream::encode_downstream;
    use serde_json::json;

    fn err(text: &str) -> DecodeError {
        match decode_message(text) {
            Ok(m) => panic!("expected {text} to be rejected, decoded {m:?}"),
            Err(e) => e,
        }
    }

    fn ok(text: &str) -> DownstreamMessage {
        decode_downstream(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn insert(relation: Value) -> String {
        json!(["data", {"tag": "insert", "relation": relation, "new": {"id": 1}}]).to_string()
    }

    #[test]
    fn tag_mismatch_names_path_expected_and_found() {
        let e = err(r#"["begin",{"tag":"bgin"},{"commitWatermark":"00"}]"#);
        assert_eq!(
            e.to_string(),
            r#"at $[1].tag: expected "begin", found "bgin""#
        );
        assert_eq!(e.path(), "$[1].tag");
        let e = err(r#"["begin",{},{"commitWatermark":"00"}]"#);
        assert_eq!(
            e.to_string(),
            r#"at $[1].tag: expected "begin", found nothing"#
        );
        // `reserved` carries the inner tag "snapshot" (rule 3).
        let e = err(
            r#"["reserved",{"tag":"reserved","backupURL":"s3://b","replicaVersion":"00","minWatermark":"00"}]"#,
        );
        assert_eq!(e.path(), "$[1].tag");
        assert!(e.to_string().contains(r#"expected "snapshot""#), "{e}");
    }

    #[test]
    fn unknown_tuple_and_change_tags_are_rejected() {
        let e = err(r#"["bgin",{"tag":"begin"},{"commitWatermark":"00"}]"#);
        assert_eq!(e.path(), "$[0]");
        assert!(e.to_string().ends_with(r#"found "bgin""#), "{e}");
        let e = err(r#"["data",{"tag":"upsert"}]"#);
        assert_eq!(e.path(), "$[1].tag");
        let e = err("[]");
        assert!(matches!(e, DecodeError::Missing { .. }), "{e}");
        let e = err(r#"{"tag":"begin"}"#);
        assert_eq!(e.path(), "$");
    }

    #[test]
    fn tuples_have_exact_arity_rule_2() {
        let e = err(r#"["commit",{"tag":"commit"},{"watermark":"00"},{}]"#);
        assert_eq!(
            e,
            DecodeError::Arity {
                path: "$".into(),
                tag: "commit".into(),
                expected: 3,
                found: 4
            }
        );
        assert!(matches!(err(r#"["rollback"]"#), DecodeError::Arity { .. }));
        assert!(matches!(
            err(r#"["begin",{"tag":"begin"}]"#),
            DecodeError::Arity { .. }
        ));
        assert!(matches!(
            err(r#"["status",{"tag":"status"},{}]"#),
            DecodeError::Arity { found: 3, .. }
        ));
    }

    #[test]
    fn number_fields_reject_big_integers_rule_4() {
        let commit = |t: &str| {
            format!(r#"["commit",{{"tag":"commit","commitTimeMs":{t}}},{{"watermark":"00"}}]"#)
        };
        assert!(decode_downstream(&commit("9007199254740991")).is_ok());
        assert!(decode_downstream(&commit("-9007199254740991")).is_ok());
        // Decimal and exponent forms stay floats in Zero's parser, so they are accepted.
        assert!(decode_downstream(&commit("9007199254740993.0")).is_ok());
        assert!(decode_downstream(&commit("1e300")).is_ok());
        for big in [
            "9007199254740992",
            "-9007199254740992",
            "123456789012345678901234567890",
        ] {
            let e = err(&commit(big));
            assert_eq!(
                e,
                DecodeError::BigInteger {
                    path: "$[1].commitTimeMs".into(),
                    found: big.into()
                }
            );
        }
        let e = err(r#"["error",{"type":18446744073709551616}]"#);
        assert_eq!(e.path(), "$[1].type");
    }

    #[test]
    fn row_values_keep_big_integers_exactly() {
        let text = r#"["data",{"tag":"insert","relation":{"schema":"public","name":"t","rowKey":{"columns":["id"]}},"new":{"id":123456789012345678901234567890,"f":0.1000000000000000055511151231257827}}]"#;
        let m = ok(text);
        let DownstreamMessage::Data(Change::Insert(insert)) = &m else {
            panic!("{m:?}")
        };
        assert_eq!(
            insert.new["id"].to_string(),
            "123456789012345678901234567890"
        );
        assert_eq!(encode_downstream(&m), text);
    }

    #[test]
    fn optional_and_nullable_are_distinct_rule_5() {
        let rel = r#"{"schema":"s","name":"t","rowKey":{"columns":["id"]}}"#;
        // `update.key` must be present; null is fine.
        let update = |key: &str| {
            format!(r#"["data",{{"tag":"update","relation":{rel}{key},"new":{{"id":1}}}}]"#)
        };
        assert!(decode_downstream(&update(r#","key":null"#)).is_ok());
        assert!(decode_downstream(&update(r#","key":{"id":0}"#)).is_ok());
        let e = err(&update(""));
        assert_eq!(e.path(), "$[1].key");
        assert!(matches!(e, DecodeError::Missing { .. }));
        // `skipAck` may be absent but not null.
        let e = err(r#"["begin",{"tag":"begin","skipAck":null},{"commitWatermark":"00"}]"#);
        assert_eq!(
            e.to_string(),
            "at $[1].skipAck: expected a boolean, found null"
        );
        // `elemPgTypeClass` may be absent or null; null survives a round trip.
        let table = |spec: &str| {
            format!(
                r#"["data",{{"tag":"create-table","spec":{{"schema":"s","name":"t","columns":{{"a":{spec}}}}}}}]"#
            )
        };
        let with_null = table(r#"{"pos":1,"dataType":"int4[]","elemPgTypeClass":null}"#);
        assert_eq!(encode_downstream(&ok(&with_null)), with_null);
        let absent = table(r#"{"pos":1,"dataType":"int4"}"#);
        assert_eq!(encode_downstream(&ok(&absent)), absent);
        let e = err(&table(r#"{"pos":1,"dataType":"int4","pgTypeClass":null}"#));
        assert_eq!(e.path(), "$[1].spec.columns.a.pgTypeClass");
    }

    #[test]
    fn backfill_request_metadata_is_present_but_nullable_rule_5() {
        let request = |table: &str| {
            format!(
                r#"["start-subscription",{{"taskID":"t","id":"s","mode":"serving","replicaVersion":"00","watermark":"01","backfills":[{{"table":{table},"columns":{{"c":{{"id":{{"attNum":3}}}}}}}}]}}]"#
            )
        };
        let m = decode_upstream(&request(r#"{"schema":"s","name":"t","metadata":null}"#));
        let Ok(UpstreamMessage::StartSubscription(ctx)) = m else {
            panic!("{m:?}")
        };
        let backfills = ctx.backfills.unwrap_or_default();
        assert_eq!(backfills[0].table.metadata, None);
        assert_eq!(backfills[0].columns["c"].id, json!({"attNum": 3}));
        let e = err(&request(r#"{"schema":"s","name":"t"}"#));
        assert_eq!(e.path(), "$[1].backfills[0].table.metadata");
        let e = err(&request(
            r#"{"schema":"s","name":"t","metadata":{"schemaOID":1}}"#,
        ));
        assert_eq!(e.path(), "$[1].backfills[0].table.metadata.rowKey");
    }

    #[test]
    fn enum_literals_are_exact_rule_9() {
        let e = err(r#"["begin",{"tag":"begin","json":"S"},{"commitWatermark":"00"}]"#);
        assert_eq!(
            e.to_string(),
            r#"at $[1].json: expected "p" or "s", found "S""#
        );
        let e = err(&insert(
            json!({"schema":"s","name":"t","rowKey":{"columns":[],"type":"FULL"}}),
        ));
        assert_eq!(e.path(), "$[1].relation.rowKey.type");
        let e = err(&insert(
            json!({"schema":"s","name":"t","keyColumns":["id"],"replicaIdentity":"all"}),
        ));
        assert_eq!(e.path(), "$[1].relation.replicaIdentity");
        let e = err(
            r#"["data",{"tag":"create-table","spec":{"schema":"s","name":"t","columns":{"a b":{"pos":1,"dataType":"x","pgTypeClass":"z"}}}}]"#,
        );
        assert_eq!(e.path(), r#"$[1].spec.columns["a b"].pgTypeClass"#);
        let e = err(
            r#"["data",{"tag":"create-index","spec":{"schema":"s","name":"i","tableName":"t","unique":false,"columns":{"a":"asc"}}}]"#,
        );
        assert_eq!(e.path(), "$[1].spec.columns.a");
        let e = err(
            r#"["start-subscription",{"taskID":"t","id":"s","mode":"primary","replicaVersion":"00","watermark":"00"}]"#,
        );
        assert_eq!(e.path(), "$[1].mode");
    }

    #[test]
    fn relation_needs_row_key_or_deprecated_key_columns_rule_6() {
        let e = err(&insert(json!({"schema":"s","name":"t"})));
        assert_eq!(e.path(), "$[1].relation.rowKey");
        assert!(matches!(e, DecodeError::Missing { .. }));
        let m = ok(&insert(
            json!({"schema":"s","name":"t","keyColumns":["a","b"],"replicaIdentity":"full"}),
        ));
        let DownstreamMessage::Data(Change::Insert(i)) = &m else {
            panic!("{m:?}")
        };
        assert_eq!(
            i.relation.row_key,
            RowKey::new(vec!["a".into(), "b".into()], Some(ReplicaIdentity::Full))
        );
        // Both forms present: rowKey wins, the deprecated pair is kept for relaying.
        let m = ok(&insert(
            json!({"schema":"s","name":"t","keyColumns":["a"],"rowKey":{"columns":["b"]},"relationOid":7}),
        ));
        let DownstreamMessage::Data(Change::Insert(i)) = &m else {
            panic!("{m:?}")
        };
        assert_eq!(i.relation.row_key.columns, ["b"]);
        assert_eq!(i.relation.key_columns, Some(vec!["a".to_owned()]));
        assert_eq!(i.relation.extra["relationOid"], json!(7));
    }

    #[test]
    fn backfill_relations_require_row_key_and_row_values_are_arrays_rule_7() {
        let backfill = |relation: Value, rows: Value| {
            json!(["data", {"tag":"backfill","relation":relation,"columns":["c"],"watermark":"0a","rowValues":rows}]).to_string()
        };
        let good = json!({"schema":"s","name":"t","rowKey":{"columns":["id"]}});
        assert!(decode_downstream(&backfill(good.clone(), json!([[1, "x"], [2, null]]))).is_ok());
        let e = err(&backfill(
            json!({"schema":"s","name":"t","keyColumns":["id"]}),
            json!([]),
        ));
        assert_eq!(e.path(), "$[1].relation.rowKey");
        let e = err(&backfill(good.clone(), json!([[1, "x"], {"id": 2}])));
        assert_eq!(e.path(), "$[1].rowValues[1]");
        let e = err(&backfill(good, json!({"id": 2})));
        assert_eq!(e.path(), "$[1].rowValues");
    }

    #[test]
    fn table_metadata_needs_row_key_object_rule_8() {
        let meta = |m: Value| {
            json!(["data", {"tag":"update-table-metadata","table":{"schema":"s","name":"t"},"old":{"rowKey":{}},"new":m}]).to_string()
        };
        assert!(
            decode_downstream(&meta(json!({"rowKey":{"id":{"attNum":1}},"relationOID":5}))).is_ok()
        );
        assert_eq!(
            err(&meta(json!({"relationOID":5}))).path(),
            "$[1].new.rowKey"
        );
        assert_eq!(
            err(&meta(json!({"rowKey":["id"]}))).path(),
            "$[1].new.rowKey"
        );
    }

    #[test]
    fn watermarks_must_be_canonical() {
        let e = err(r#"["commit",{"tag":"commit"},{"watermark":"0A"}]"#);
        assert!(matches!(e, DecodeError::Watermark { .. }), "{e}");
        assert_eq!(e.path(), "$[2].watermark");
        assert!(e.to_string().ends_with(r#"found "0A""#), "{e}");
        let e = err(r#"["begin",{"tag":"begin"},{"commitWatermark":5}]"#);
        assert_eq!(
            e.to_string(),
            "at $[2].commitWatermark: expected a watermark string, found 5"
        );
    }

    #[test]
    fn progress_marks_follow_the_v8_shapes() {
        let backfill = |marks: Value| {
            json!(["data", {"tag":"backfill","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},
                "columns":[],"watermark":"0a","rowValues":[],"progressMarks":marks}]).to_string()
        };
        let m = ok(&backfill(
            json!({"current":{"progressMark":"b","timeline":"1","lsn":"0/1","n":4}}),
        ));
        let DownstreamMessage::Data(Change::Backfill(b)) = &m else {
            panic!("{m:?}")
        };
        let current = b.progress_marks.as_ref().and_then(|p| p.current.as_ref());
        assert_eq!(current.map(|c| c.extra.len()), Some(2));
        assert_eq!(
            err(&backfill(json!({"previous":{"progressMark":"a"}}))).path(),
            "$[1].progressMarks.current"
        );
        assert_eq!(
            err(&backfill(json!({"current":{"progressMark":"b","x":[1]}}))).path(),
            "$[1].progressMarks.current.x"
        );
        assert!(matches!(
            err(&backfill(
                json!({"current":{"progressMark":"b","x":9007199254740993u64}})
            )),
            DecodeError::BigInteger { .. }
        ));
        // On backfill-completed `current` is not part of the schema: it is an unchecked extra.
        let completed = json!(["data", {"tag":"backfill-completed","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},
            "columns":["c"],"watermark":"0a","progressMarks":{"previous":{"progressMark":"a"},"current":"whatever"}}]).to_string();
        let m = ok(&completed);
        let DownstreamMessage::Data(Change::BackfillCompleted(c)) = &m else {
            panic!("{m:?}")
        };
        let marks = c.progress_marks.clone().unwrap_or_default();
        assert_eq!(marks.current, None);
        assert_eq!(marks.extra["current"], json!("whatever"));
        assert_eq!(encode_downstream(&m), completed);
    }

    #[test]
    fn directions_are_kept_apart() {
        let reserve = r#"["reserve-snapshot",{"taskID":"t1"}]"#;
        assert!(decode_upstream(reserve).is_ok());
        assert_eq!(
            decode_downstream(reserve).map_err(|e| e.path().to_owned()),
            Err("$[0]".into())
        );
        assert_eq!(
            decode_upstream(r#"["status",{"tag":"status"}]"#).map_err(|e| e.path().to_owned()),
            Err("$[0]".into())
        );
        assert!(matches!(decode_message(reserve), Ok(Message::Upstream(_))));
    }

    #[test]
    fn hostile_text_is_a_typed_error() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(matches!(
            decode_message(&deep),
            Err(DecodeError::Syntax { .. })
        ));
        let deep_row = format!(
            r#"["data",{{"tag":"insert","relation":{{"schema":"s","name":"t","rowKey":{{"columns":[]}}}},"new":{{"a":{}1{}}}}}]"#,
            "[".repeat(5000),
            "]".repeat(5000)
        );
        assert!(matches!(
            decode_message(&deep_row),
            Err(DecodeError::Syntax { .. })
        ));
        for text in ["", "nul", "[\"begin\"", "\u{0}", "[1e99999999999]"] {
            assert!(decode_message(text).is_err(), "{text:?}");
        }
    }

    #[test]
    fn long_found_values_are_clipped() {
        let long = "x".repeat(500);
        let e = err(&format!(
            r#"["begin",{{"tag":"{long}"}},{{"commitWatermark":"00"}}]"#
        ));
        assert!(e.to_string().len() < 150, "{e}");
    }

    #[test]
    fn deserialize_uses_the_same_rules() {
        let m: DownstreamMessage =
            serde_json::from_str(r#"["rollback",{"tag":"rollback"}]"#).expect("valid");
        assert_eq!(m, DownstreamMessage::Rollback(Rollback::default()));
        let e = serde_json::from_str::<DownstreamMessage>(r#"["rollback",{"tag":"commit"}]"#)
            .expect_err("tag mismatch");
        assert!(e.to_string().contains("$[1].tag"), "{e}");
    }
}
