//! Change-stream JSON values to SQLite values and back, as Zero's replica stores them.
//!
//! Integers are INTEGER (int8 beyond 2^53 exactly), other numbers REAL, booleans 0/1, JSON and
//! arrays JSON text, everything else TEXT. Reading back uses the column's upstream type, so a
//! value comes out in the same JSON form it went in.
//!
//! A `numeric` that is not an integer fitting an `i64` is stored as REAL too, so one with more
//! digits than a double holds is stored rounded to one; scope sync, which reads rows from the
//! replica (`replica/feed.rs`), sends it rounded, while the change stream carries its exact
//! text.

use std::borrow::Cow;

use highwater_engine::change_stream::JsonFormat;
use highwater_engine::pgoutput::ScalarText;
use rusqlite::types::{Value as SqlValue, ValueRef};
use serde_json::{Number, Value};

use super::schema::{ReplicaColumn, ValueKind};

/// The SQLite value stored for a change-stream value of `column`: [`to_sql_ref`], owned.
pub(crate) fn to_sql(column: &ReplicaColumn, value: &Value, json: JsonFormat) -> SqlValue {
    to_sql_ref(column, value, json).into()
}

/// [`to_sql`] taking the value: the same SQLite value, without copying its text.
pub(crate) fn into_sql(column: &ReplicaColumn, value: Value, json: JsonFormat) -> SqlValue {
    match value {
        // A string is stored as it is, except a parsed JSON string, which is stored as JSON.
        Value::String(text)
            if column.kind != ValueKind::Json || json == JsonFormat::Stringified =>
        {
            SqlValue::Text(text)
        }
        value => to_sql(column, &value, json),
    }
}

/// A SQLite value whose text may be borrowed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum SqlScalar<'a> {
    Null,
    Integer(i64),
    Real(f64),
    Text(Cow<'a, str>),
}

impl SqlScalar<'_> {
    pub(crate) fn as_value_ref(&self) -> ValueRef<'_> {
        match self {
            SqlScalar::Null => ValueRef::Null,
            SqlScalar::Integer(i) => ValueRef::Integer(*i),
            SqlScalar::Real(f) => ValueRef::Real(*f),
            SqlScalar::Text(text) => ValueRef::Text(text.as_bytes()),
        }
    }
}

impl From<SqlScalar<'_>> for SqlValue {
    fn from(value: SqlScalar<'_>) -> Self {
        match value {
            SqlScalar::Null => SqlValue::Null,
            SqlScalar::Integer(i) => SqlValue::Integer(i),
            SqlScalar::Real(f) => SqlValue::Real(f),
            SqlScalar::Text(text) => SqlValue::Text(text.into_owned()),
        }
    }
}

impl From<SqlValue> for SqlScalar<'_> {
    fn from(value: SqlValue) -> Self {
        match value {
            SqlValue::Null => SqlScalar::Null,
            SqlValue::Integer(i) => SqlScalar::Integer(i),
            SqlValue::Real(f) => SqlScalar::Real(f),
            SqlValue::Text(text) => SqlScalar::Text(text.into()),
            // `into_sql` makes no blobs; one would read back from SQLite as its bytes as text.
            SqlValue::Blob(bytes) => {
                SqlScalar::Text(String::from_utf8_lossy(&bytes).into_owned().into())
            }
        }
    }
}

impl rusqlite::ToSql for SqlScalar<'_> {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        Ok(rusqlite::types::ToSqlOutput::Borrowed(self.as_value_ref()))
    }
}

/// The SQLite value stored for a change-stream value of `column`, borrowing the value's text:
/// for binding straight from a change-stream row.
pub(crate) fn to_sql_ref<'v>(
    column: &ReplicaColumn,
    value: &'v Value,
    json: JsonFormat,
) -> SqlScalar<'v> {
    match (column.kind, value) {
        (_, Value::Null) => SqlScalar::Null,
        (ValueKind::Json, Value::String(text)) if json == JsonFormat::Stringified => {
            SqlScalar::Text(text.as_str().into())
        }
        (ValueKind::Json, other) => SqlScalar::Text(other.to_string().into()),
        (_, Value::Bool(b)) => {
            if column.kind == ValueKind::Text {
                SqlScalar::Text(b.to_string().into())
            } else {
                SqlScalar::Integer(i64::from(*b))
            }
        }
        (ValueKind::Text, Value::Number(n)) => SqlScalar::Text(n.as_str().into()),
        (_, Value::Number(n)) => number_text_to_sql(n.as_str().into()),
        (_, Value::String(text)) => SqlScalar::Text(text.as_str().into()),
        (_, other @ (Value::Array(_) | Value::Object(_))) => {
            SqlScalar::Text(other.to_string().into())
        }
    }
}

/// Largest magnitude below which every integer is an exact `f64`.
const F64_EXACT_INTEGERS: i128 = 1 << 53;

/// [`into_sql`] (stringified JSON) of the value `value` stands for, without building it: the
/// same SQLite value, borrowing its text where it can.
pub(crate) fn scalar_to_sql<'a>(column: &ReplicaColumn, value: ScalarText<'a>) -> SqlScalar<'a> {
    // JSON and text columns store a non-string value as its JSON text.
    let as_text = matches!(column.kind, ValueKind::Json | ValueKind::Text);
    match value {
        ScalarText::Null => SqlScalar::Null,
        ScalarText::String(text) => SqlScalar::Text(text.into()),
        ScalarText::Bool(b) if as_text => SqlScalar::Text(b.to_string().into()),
        ScalarText::Bool(b) => SqlScalar::Integer(i64::from(b)),
        ScalarText::Integer(n) if as_text => SqlScalar::Text(n.to_string().into()),
        ScalarText::Integer(n) => SqlScalar::Integer(n),
        ScalarText::Number(text) if as_text => SqlScalar::Text(text.into()),
        ScalarText::Number(text) => number_text_to_sql(text.into()),
        ScalarText::Micros(micros) if !as_text => {
            // What parsing the exact decimal milliseconds gives, computed: an integer where
            // they are whole, else the correctly rounded quotient (exact operands, one IEEE
            // division), the same double as parsing its decimal text.
            let whole = (micros % 1000 == 0)
                .then(|| i64::try_from(micros / 1000).ok())
                .flatten();
            match whole {
                Some(ms) => SqlScalar::Integer(ms),
                #[allow(clippy::cast_precision_loss)]
                None if micros.abs() <= F64_EXACT_INTEGERS => {
                    SqlScalar::Real(micros as f64 / 1000.0)
                }
                None => number_text_to_sql(Cow::Owned(
                    value.number_text().unwrap_or_default().into_owned(),
                )),
            }
        }
        ScalarText::Micros(_) => {
            SqlScalar::Text(value.number_text().unwrap_or_default().into_owned().into())
        }
    }
}

/// The SQLite value of the JSON number written `text`: an INTEGER where it is one that fits,
/// else a finite REAL, else its text (a number beyond the largest double).
fn number_text_to_sql(text: Cow<'_, str>) -> SqlScalar<'_> {
    if let Ok(i) = text.parse::<i64>() {
        SqlScalar::Integer(i)
    } else if let Some(f) = text.parse::<f64>().ok().filter(|f| f.is_finite()) {
        SqlScalar::Real(f)
    } else {
        SqlScalar::Text(text)
    }
}

/// The change-stream value of a stored SQLite value of `column`; JSON columns come back parsed
/// (`JsonFormat::Parsed`) or as their text (`Stringified`).
pub(crate) fn from_sql(column: &ReplicaColumn, value: ValueRef<'_>, json: JsonFormat) -> Value {
    match (column.kind, value) {
        (_, ValueRef::Null) => Value::Null,
        (ValueKind::Bool, ValueRef::Integer(i)) => Value::Bool(i != 0),
        (ValueKind::Text, ValueRef::Integer(i)) => Value::String(i.to_string()),
        (ValueKind::Text, ValueRef::Real(f)) => Value::String(f.to_string()),
        (_, ValueRef::Integer(i)) => Value::from(i),
        (_, ValueRef::Real(f)) => Number::from_f64(f).map_or(Value::Null, Value::Number),
        (ValueKind::Json, ValueRef::Text(bytes)) => {
            let text = String::from_utf8_lossy(bytes);
            match json {
                JsonFormat::Stringified => Value::String(text.into_owned()),
                JsonFormat::Parsed => {
                    serde_json::from_str(&text).unwrap_or(Value::String(text.into_owned()))
                }
            }
        }
        (ValueKind::Array, ValueRef::Text(bytes)) => {
            let text = String::from_utf8_lossy(bytes);
            serde_json::from_str(&text).unwrap_or(Value::String(text.into_owned()))
        }
        (ValueKind::Number, ValueRef::Text(bytes)) => {
            let text = String::from_utf8_lossy(bytes);
            match text.parse::<Number>() {
                Ok(n) => Value::Number(n),
                Err(_) => Value::String(text.into_owned()),
            }
        }
        (_, ValueRef::Text(bytes)) => Value::String(String::from_utf8_lossy(bytes).into_owned()),
        (_, ValueRef::Blob(bytes)) => {
            let mut hex = String::with_capacity(2 + bytes.len() * 2);
            hex.push_str("\\x");
            for b in bytes {
                hex.push_str(&format!("{b:02x}"));
            }
            Value::String(hex)
        }
    }
}

/// The canonical JSON of a row key: key columns in key order, values as the replica reads them
/// back, so the same key gives the same text whichever path wrote it.
pub(crate) fn row_key_json(columns: &[(&ReplicaColumn, SqlScalar<'_>)]) -> String {
    let mut map = serde_json::Map::new();
    for (col, value) in columns {
        map.insert(
            col.name.clone(),
            from_sql(col, value.as_value_ref(), JsonFormat::Parsed),
        );
    }
    Value::Object(map).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use highwater_engine::change_stream::{ColumnSpec, PgTypeClass};
    use serde_json::json;

    fn column(data_type: &str, class: Option<PgTypeClass>) -> ReplicaColumn {
        let mut spec = ColumnSpec::new(Number::from(1), data_type);
        spec.pg_type_class = class;
        ReplicaColumn::from_spec("c", &spec)
    }

    /// A column type of every storage kind (an enum is text).
    const STORAGE_TYPES: [(&str, Option<PgTypeClass>); 9] = [
        ("int8", None),
        ("numeric", None),
        ("float8", None),
        ("timestamptz", None),
        ("bool", None),
        ("text", None),
        ("jsonb", None),
        ("int4[]", None),
        ("level", Some(PgTypeClass::Enum)),
    ];

    fn round_trip(data_type: &str, value: Value, json: JsonFormat) -> Value {
        let col = column(data_type, None);
        let stored = to_sql(&col, &value, json);
        from_sql(&col, ValueRef::from(&stored), json)
    }

    #[test]
    fn values_of_every_storage_kind_read_back_as_written() {
        let big: Value = serde_json::from_str("9007199254740993").unwrap();
        let cases = [
            ("int8", big.clone()),
            ("int8", json!(-9_223_372_036_854_775_808_i64)),
            ("int4", json!(7)),
            ("float8", json!(1.5)),
            ("timestamptz", json!(1_700_000_000_123.456)),
            ("bool", json!(true)),
            ("bool", json!(false)),
            ("text", json!("héllo\tworld")),
            ("text", json!("01")),
            ("uuid", json!("4c9b6f3e-8d0a-4f5e-9c39-1f2d3e4a5b6c")),
            ("int4[]", json!([1, 2, null])),
            ("text[]", json!(["a", "b"])),
            ("jsonb", json!({"a": [1, 2], "b": null})),
            ("jsonb", json!("just a string")),
            ("text", Value::Null),
        ];
        for (data_type, value) in cases {
            assert_eq!(
                round_trip(data_type, value.clone(), JsonFormat::Parsed),
                value,
                "{data_type}"
            );
        }
        assert_eq!(
            round_trip("int8", big.clone(), JsonFormat::Parsed).to_string(),
            "9007199254740993"
        );
    }

    #[test]
    fn into_sql_stores_what_to_sql_stores() {
        let big: Value = serde_json::from_str("9007199254740993").unwrap();
        let values = [
            Value::Null,
            json!(true),
            json!(false),
            json!(7),
            big,
            json!(1.5),
            serde_json::from_str("1.50").unwrap(),
            json!("text"),
            json!("{\"a\": 1}"),
            json!([1, "a", null]),
            json!({"a": [1, 2]}),
        ];
        for (data_type, class) in STORAGE_TYPES {
            let col = column(data_type, class);
            for value in &values {
                for json in [JsonFormat::Parsed, JsonFormat::Stringified] {
                    assert_eq!(
                        into_sql(&col, value.clone(), json),
                        to_sql(&col, value, json),
                        "{data_type} {value} {json:?}"
                    );
                }
            }
        }
    }

    /// Every storage kind, with every shape of scalar value.
    fn assert_scalar_stores_as_into_sql(value: ScalarText<'_>) {
        for (data_type, class) in STORAGE_TYPES {
            let col = column(data_type, class);
            let slow = into_sql(&col, value.to_value(), JsonFormat::Stringified);
            let fast = SqlValue::from(scalar_to_sql(&col, value));
            // NaN never occurs (non-finite numbers are NULL or text), so `==` is exact.
            assert_eq!(fast, slow, "{data_type} {value:?}");
            if let (SqlValue::Real(a), SqlValue::Real(b)) = (&fast, &slow) {
                assert_eq!(a.to_bits(), b.to_bits(), "{data_type} {value:?}");
            }
        }
    }

    #[test]
    fn scalar_values_store_as_their_json_would() {
        let values = [
            ScalarText::Null,
            ScalarText::Bool(true),
            ScalarText::Bool(false),
            ScalarText::String("héllo"),
            ScalarText::String("{\"a\": 1}"),
            ScalarText::Number("7"),
            ScalarText::Number("-0"),
            ScalarText::Number("9223372036854775808"),
            ScalarText::Number("1.50"),
            ScalarText::Number("1e+999999"),
            ScalarText::Number("-1.5e-7"),
            ScalarText::Number("12345678901234567890.123456789000"),
            ScalarText::Integer(-86_400_000),
            ScalarText::Micros(0),
            ScalarText::Micros(-1500),
            ScalarText::Micros(1_547_249_435_381_101),
            ScalarText::Micros(9_007_199_254_740_993),
            ScalarText::Micros(9_223_372_036_854_775_807_000),
            ScalarText::Micros(-9_223_372_036_854_775_809_001),
        ];
        for value in values {
            assert_scalar_stores_as_into_sql(value);
        }
    }

    proptest::proptest! {
        #[test]
        fn any_instant_stores_as_its_milliseconds_text_would(micros: i64, wide: i128) {
            assert_scalar_stores_as_into_sql(ScalarText::Micros(i128::from(micros)));
            assert_scalar_stores_as_into_sql(ScalarText::Micros(wide >> 40));
        }

        #[test]
        fn any_number_stores_as_its_json_would(n: i64, f: f64) {
            let (n, f, e) = (n.to_string(), f.to_string(), format!("{f:e}"));
            for text in [n.as_str(), f.as_str(), e.as_str()] {
                // The engine gives `Number` only the texts serde_json keeps as written.
                if text.parse::<Number>().is_ok_and(|n| n.to_string() == text) {
                    assert_scalar_stores_as_into_sql(ScalarText::Number(text));
                }
            }
        }
    }

    #[test]
    fn stringified_json_is_stored_as_is_and_parsed_json_is_serialized() {
        let col = column("json", None);
        assert_eq!(
            to_sql(&col, &json!("{\"a\": 1}"), JsonFormat::Stringified),
            SqlValue::Text("{\"a\": 1}".into())
        );
        assert_eq!(
            to_sql(&col, &json!("x"), JsonFormat::Parsed),
            SqlValue::Text("\"x\"".into())
        );
        assert_eq!(
            round_trip("json", json!("{\"a\": 1}"), JsonFormat::Stringified),
            json!("{\"a\": 1}")
        );
    }

    #[test]
    fn enum_values_stay_text() {
        let col = column("level", Some(PgTypeClass::Enum));
        let stored = to_sql(&col, &json!("1"), JsonFormat::Parsed);
        assert_eq!(stored, SqlValue::Text("1".into()));
        assert_eq!(
            from_sql(&col, ValueRef::Integer(1), JsonFormat::Parsed),
            json!("1")
        );
    }

    #[test]
    fn row_keys_are_canonical_across_number_spellings() {
        let col = column("numeric", None);
        let (a, b): (Value, Value) = (
            serde_json::from_str("1.50").unwrap(),
            serde_json::from_str("1.5").unwrap(),
        );
        let (a, b) = (
            to_sql_ref(&col, &a, JsonFormat::Parsed),
            to_sql_ref(&col, &b, JsonFormat::Parsed),
        );
        assert_eq!(row_key_json(&[(&col, a)]), row_key_json(&[(&col, b)]));
    }
}
