//! Column values from Postgres TEXT output to the JSON values Zero's replicator expects
//! (Zero's change-stream value encoding).
//!
//! Choices where Zero leaves room: float `NaN`/`±Infinity` and numeric `NaN`/`±Infinity` become
//! `null` (what `JSON.stringify` makes of them); numerics are JSON numbers written from the exact
//! text, so no digits are lost; timestamps are exact decimal milliseconds.

use std::str::FromStr;

use serde_json::{Number, Value};

use super::array::{parse_array, ArrayError};
use super::datetime::{self, Instant, MS_PER_DAY};

/// How a scalar column (or array element) is converted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scalar {
    Bool,
    /// int2, int4, int8, oid: exact integers of any size.
    Integer,
    Float,
    Numeric,
    /// json, jsonb: the JSON text as a string (begin `json: "s"`).
    Json,
    Timestamp,
    TimestampTz,
    Date,
    Time,
    TimeTz,
    /// Text-like, uuid, enum, bytea (hex text), unknown types: the text itself.
    Text,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ValueType {
    Scalar(Scalar),
    /// A one- or multi-dimensional array with `,`-delimited elements.
    Array(Scalar),
}

impl ValueType {
    /// The conversion for a built-in type OID, or `None` for OIDs not built in.
    pub(super) fn builtin(oid: u32) -> Option<ValueType> {
        use Scalar::*;
        use ValueType::{Array as A, Scalar as S};
        Some(match oid {
            16 => S(Bool),
            20 | 21 | 23 | 26 => S(Integer),
            700 | 701 => S(Float),
            1700 => S(Numeric),
            114 | 3802 => S(Json),
            1114 => S(Timestamp),
            1184 => S(TimestampTz),
            1082 => S(Date),
            1083 => S(Time),
            1266 => S(TimeTz),
            // bytea, "char", name, text, xml, unknown, bpchar, varchar, uuid, and other built-ins
            // whose text is the value (inet, interval, money, bit, …).
            17 | 18 | 19 | 25 | 142 | 705 | 1042 | 1043 | 2950 => S(Text),
            1000 => A(Bool),
            1005 | 1007 | 1016 | 1028 => A(Integer),
            1021 | 1022 => A(Float),
            1231 => A(Numeric),
            199 | 3807 => A(Json),
            1115 => A(Timestamp),
            1185 => A(TimestampTz),
            1182 => A(Date),
            1183 => A(Time),
            1270 => A(TimeTz),
            // bytea[], "char"[], name[], text[], bpchar[], varchar[], uuid[], xml[], inet[],
            // cidr[], macaddr[], interval[], money[], bit[], varbit[].
            1001 | 1002 | 1003 | 1009 | 1014 | 1015 | 2951 | 143 | 1041 | 651 | 1040 | 1187
            | 791 | 1561 | 1563 => A(Text),
            _ => return None,
        })
    }
}

impl ValueType {
    /// The conversion of a column of `oid`: a built-in, else an array of text when a Type
    /// message named the OID as an array type (`_name`), else text.
    pub(super) fn of(oid: u32, announced_array: bool) -> ValueType {
        ValueType::builtin(oid).unwrap_or(if announced_array {
            ValueType::Array(Scalar::Text)
        } else {
            ValueType::Scalar(Scalar::Text)
        })
    }
}

/// One column's conversion from TEXT output, the one [`super::PgoutputMapper`] applies to a
/// tuple value of that column, for callers that get the text elsewhere (COPY).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextColumn {
    ty: ValueType,
}

impl TextColumn {
    /// A column of `type_oid`; `announced_array` when a Type message named the OID as an array
    /// type (`_name`, arrays of enums and other custom types).
    pub fn new(type_oid: u32, announced_array: bool) -> TextColumn {
        TextColumn {
            ty: ValueType::of(type_oid, announced_array),
        }
    }

    pub(super) fn of(ty: ValueType) -> TextColumn {
        TextColumn { ty }
    }

    /// The value of `text`, or what it should have looked like. Text-like and JSON values
    /// take `text` as their string without copying it.
    pub fn convert(&self, text: String) -> Result<Value, &'static str> {
        match self.ty {
            ValueType::Scalar(Scalar::Text | Scalar::Json) => Ok(Value::String(text)),
            ty => convert(ty, &text).map_err(|e| e.expected),
        }
    }
}

/// A column value read from its text by [`TextColumn::read`]: borrowed where the type allows,
/// else the JSON value.
#[derive(Debug, Clone, PartialEq)]
pub enum TextRead<'a> {
    Scalar(ScalarText<'a>),
    /// Arrays, and floats or numerics whose JSON spelling is not their text.
    Json(Value),
}

/// A scalar column value read from its text without building a JSON value: what
/// [`TextColumn::convert`] makes of the same text, in parts a store can take as they are (the
/// replica's initial sync converts every COPY field this way).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScalarText<'a> {
    /// JSON `null`: float and numeric `NaN`/`±Infinity`, infinite dates and timestamps.
    Null,
    Bool(bool),
    /// A JSON string: text-like, JSON and unknown types.
    String(&'a str),
    /// A JSON number whose exact text is this (integers, numerics, floats).
    Number(&'a str),
    /// A JSON integer (dates and times, in milliseconds).
    Integer(i64),
    /// A timestamp: a JSON number holding these microseconds as exact decimal milliseconds.
    Micros(i128),
}

impl ScalarText<'_> {
    /// The text of the JSON number this is, for [`ScalarText::Number`], [`ScalarText::Integer`]
    /// and [`ScalarText::Micros`].
    pub fn number_text(&self) -> Option<std::borrow::Cow<'_, str>> {
        match *self {
            ScalarText::Number(text) => Some(text.into()),
            ScalarText::Integer(n) => Some(n.to_string().into()),
            ScalarText::Micros(micros) => Some(datetime::micros_as_ms_text(micros).into()),
            ScalarText::Null | ScalarText::Bool(_) | ScalarText::String(_) => None,
        }
    }

    /// The JSON value [`TextColumn::convert`] gives for the same text.
    pub fn to_value(&self) -> Value {
        match *self {
            ScalarText::Null => Value::Null,
            ScalarText::Bool(b) => Value::Bool(b),
            ScalarText::String(text) => Value::String(text.to_owned()),
            ScalarText::Integer(n) => Value::Number(n.into()),
            ScalarText::Number(_) | ScalarText::Micros(_) => self
                .number_text()
                .and_then(|text| exact_number(&text))
                .unwrap_or(Value::Null),
        }
    }
}

/// Decimal digits with an optional `-`, no leading zero: how Postgres writes an integer.
fn is_canonical_integer(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
}

/// Whether `text` is a JSON number (RFC 8259 §6), the check [`exact_number`] makes, without
/// building one.
fn is_json_number(text: &str) -> bool {
    let b = text.as_bytes();
    let mut i = usize::from(b.first() == Some(&b'-'));
    let digits = |i: &mut usize| {
        let start = *i;
        while b.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i - start
    };
    match b.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => {
            digits(&mut i);
        }
        _ => return false,
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        if digits(&mut i) == 0 {
            return false;
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == b.len()
}

impl TextColumn {
    /// [`TextColumn::convert`] of a scalar column's `text`, borrowing it: `None` where that
    /// takes more than a look at the text (arrays, a float or numeric whose JSON spelling is not
    /// its text), and the caller converts with [`TextColumn::convert`] instead.
    pub fn convert_scalar<'a>(
        &self,
        text: &'a str,
    ) -> Option<Result<ScalarText<'a>, &'static str>> {
        let ValueType::Scalar(scalar) = self.ty else {
            return None;
        };
        match classify(scalar, text) {
            Ok(Classified::Scalar(value)) => Some(Ok(value)),
            Ok(Classified::Respelled(_) | Classified::Float(_)) => None,
            Err(e) => Some(Err(e.expected)),
        }
    }
}

impl TextColumn {
    /// The value of `text` as [`TextColumn::convert`] makes it, borrowing the text where
    /// [`TextColumn::convert_scalar`] can, or what it should have looked like.
    pub fn read<'a>(&self, text: &'a str) -> Result<TextRead<'a>, &'static str> {
        match self.convert_scalar(text) {
            Some(scalar) => scalar.map(TextRead::Scalar),
            None => convert(self.ty, text)
                .map(TextRead::Json)
                .map_err(|e| e.expected),
        }
    }
}

/// A scalar's text, read: what both conversions (to JSON, and to the borrowed [`ScalarText`])
/// are made from, so that they cannot disagree.
enum Classified<'a> {
    /// The value, borrowing the text.
    Scalar(ScalarText<'a>),
    /// A JSON number whose text serde_json spells differently (an exponent written `E`, or `e`
    /// without a sign: `1E5` is `1e+5`).
    Respelled(&'a str),
    /// A finite float whose text is not a JSON number: written from the parsed value.
    Float(f64),
}

/// serde_json writes an exponent as `e` with its sign; a number spelled so keeps its text.
fn keeps_text(text: &str) -> bool {
    let b = text.as_bytes();
    !b.iter()
        .enumerate()
        .any(|(i, &c)| c == b'E' || (c == b'e' && !matches!(b.get(i + 1), Some(b'+' | b'-'))))
}

/// A JSON number's text as [`Classified`]: itself, or respelled.
fn number(text: &str) -> Classified<'_> {
    if keeps_text(text) {
        Classified::Scalar(ScalarText::Number(text))
    } else {
        Classified::Respelled(text)
    }
}

fn classify(scalar: Scalar, text: &str) -> Result<Classified<'_>, ValueError> {
    let fail = |expected| ValueError { expected };
    let value = match scalar {
        Scalar::Text | Scalar::Json => ScalarText::String(text),
        Scalar::Bool => match text {
            "t" => ScalarText::Bool(true),
            "f" => ScalarText::Bool(false),
            _ => return Err(fail("a boolean 't' or 'f'")),
        },
        // A canonical integer is a JSON number with its own text.
        Scalar::Integer if is_canonical_integer(text) => ScalarText::Number(text),
        Scalar::Integer => return Err(fail("an integer")),
        Scalar::Float => match text {
            "NaN" | "Infinity" | "-Infinity" => ScalarText::Null,
            _ => {
                let parsed: f64 = text.parse().map_err(|_| fail("a floating-point number"))?;
                // Keep Postgres's shortest round-trip text; re-render only if it is not JSON.
                if is_json_number(text) {
                    return Ok(number(text));
                }
                if !parsed.is_finite() {
                    return Err(fail("a finite floating-point number"));
                }
                return Ok(Classified::Float(parsed));
            }
        },
        Scalar::Numeric => match text {
            "NaN" | "Infinity" | "-Infinity" => ScalarText::Null,
            _ if is_json_number(text) => return Ok(number(text)),
            _ => return Err(fail("a numeric")),
        },
        Scalar::Timestamp | Scalar::TimestampTz => {
            let with_zone = scalar == Scalar::TimestampTz;
            match datetime::parse_timestamp(text, with_zone) {
                Some(Instant::Infinite) => ScalarText::Null,
                Some(Instant::Finite(micros)) => ScalarText::Micros(micros),
                None if with_zone => return Err(fail("a timestamptz 'YYYY-MM-DD HH:MM:SS[.ffffff]±HH[:MM[:SS]][ BC]' (DateStyle ISO)")),
                None => return Err(fail("a timestamp 'YYYY-MM-DD HH:MM:SS[.ffffff][ BC]' (DateStyle ISO)")),
            }
        }
        Scalar::Date => match datetime::parse_date(text) {
            Some(Instant::Infinite) => ScalarText::Null,
            // At most ~2.1e9 days either way, so the product fits i64.
            Some(Instant::Finite(days)) => ScalarText::Integer(days * MS_PER_DAY),
            None => return Err(fail("a date 'YYYY-MM-DD[ BC]' (DateStyle ISO)")),
        },
        Scalar::Time => match datetime::parse_time(text) {
            Some(ms) => ScalarText::Integer(ms),
            None => return Err(fail("a time 'HH:MM:SS[.ffffff]'")),
        },
        Scalar::TimeTz => match datetime::parse_time_tz(text) {
            Some(ms) => ScalarText::Integer(ms),
            None => return Err(fail("a timetz 'HH:MM:SS[.ffffff]±HH[:MM[:SS]]'")),
        },
    };
    Ok(Classified::Scalar(value))
}

/// What a value should have looked like; the caller adds the column and type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ValueError {
    pub expected: &'static str,
}

pub(super) fn convert(ty: ValueType, text: &str) -> Result<Value, ValueError> {
    match ty {
        ValueType::Scalar(scalar) => scalar_value(scalar, text),
        ValueType::Array(scalar) => parse_array(text, &mut |element| scalar_value(scalar, element))
            .map_err(|e| match e {
                ArrayError::Element(e) => e,
                ArrayError::Syntax { expected, .. } => ValueError { expected },
            }),
    }
}

/// The JSON value of a scalar's text.
fn scalar_value(scalar: Scalar, text: &str) -> Result<Value, ValueError> {
    match classify(scalar, text)? {
        Classified::Scalar(value) => Ok(value.to_value()),
        // serde_json parses any JSON number.
        Classified::Respelled(text) => exact_number(text).ok_or(ValueError {
            expected: "a numeric",
        }),
        Classified::Float(parsed) => {
            Number::from_f64(parsed)
                .map(Value::Number)
                .ok_or(ValueError {
                    expected: "a finite floating-point number",
                })
        }
    }
}

/// A JSON number holding exactly `text` (serde_json keeps the text with arbitrary_precision).
fn exact_number(text: &str) -> Option<Value> {
    Number::from_str(text).ok().map(Value::Number)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn scalar(s: Scalar, text: &str) -> Value {
        convert(ValueType::Scalar(s), text).unwrap()
    }

    fn json_text(v: &Value) -> String {
        serde_json::to_string(v).unwrap()
    }

    #[test]
    fn a_text_column_converts_as_the_mapper_does() {
        let cases: &[(u32, bool, &str)] = &[
            (20, false, "9223372036854775807"),
            (1700, false, "1.50"),
            (16, false, "t"),
            (25, false, "héllo"),
            (3802, false, "{\"a\": 1}"),
            (1184, false, "2024-01-01 00:00:01+00"),
            (1007, false, "{1,NULL,3}"),
            (99_999, true, "{a,b}"),
            (99_999, false, "{a,b}"),
            (701, false, "NaN"),
        ];
        for &(oid, array, text) in cases {
            assert_eq!(
                TextColumn::new(oid, array).convert(text.to_owned()),
                convert(ValueType::of(oid, array), text).map_err(|e| e.expected),
                "{oid} {text}"
            );
        }
        assert_eq!(
            TextColumn::new(23, false).convert("x".into()),
            Err("an integer")
        );
    }

    #[test]
    fn int8_beyond_2_pow_53_stays_exact() {
        let v = scalar(Scalar::Integer, "9223372036854775807");
        assert_eq!(json_text(&v), "9223372036854775807");
        assert_eq!(
            json_text(&scalar(Scalar::Integer, "-9007199254740993")),
            "-9007199254740993"
        );
        for bad in ["", "-", "1.5", "01", "1e3", " 1", "+1"] {
            assert!(
                convert(ValueType::Scalar(Scalar::Integer), bad).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn numeric_keeps_its_exact_text_and_nan_is_null() {
        let v = scalar(Scalar::Numeric, "12345678901234567890.123456789000");
        assert_eq!(json_text(&v), "12345678901234567890.123456789000");
        assert_eq!(scalar(Scalar::Numeric, "NaN"), Value::Null);
        assert_eq!(scalar(Scalar::Numeric, "-Infinity"), Value::Null);
        assert!(convert(ValueType::Scalar(Scalar::Numeric), "12,5").is_err());
    }

    #[test]
    fn floats_are_numbers_and_non_finite_floats_are_null() {
        assert_eq!(json_text(&scalar(Scalar::Float, "1.5")), "1.5");
        assert_eq!(json_text(&scalar(Scalar::Float, "1e+100")), "1e+100");
        assert_eq!(json_text(&scalar(Scalar::Float, "-0")), "-0");
        assert_eq!(scalar(Scalar::Float, "NaN"), Value::Null);
        assert_eq!(scalar(Scalar::Float, "Infinity"), Value::Null);
        assert!(convert(ValueType::Scalar(Scalar::Float), "abc").is_err());
    }

    #[test]
    fn bools_json_and_text() {
        assert_eq!(scalar(Scalar::Bool, "t"), Value::Bool(true));
        assert_eq!(scalar(Scalar::Bool, "f"), Value::Bool(false));
        assert!(convert(ValueType::Scalar(Scalar::Bool), "true").is_err());
        assert_eq!(
            scalar(Scalar::Json, r#"{"a": [1, 2]}"#),
            Value::String(r#"{"a": [1, 2]}"#.into())
        );
        assert_eq!(
            scalar(Scalar::Text, "\\x0102"),
            Value::String("\\x0102".into())
        );
    }

    #[test]
    fn dates_times_and_timestamps() {
        assert_eq!(
            json_text(&scalar(Scalar::Date, "2000-01-01")),
            "946684800000"
        );
        assert_eq!(scalar(Scalar::Date, "infinity"), Value::Null);
        assert_eq!(json_text(&scalar(Scalar::Time, "01:02:03.004")), "3723004");
        assert_eq!(
            json_text(&scalar(Scalar::TimeTz, "01:02:03.004+01")),
            "123004"
        );
        assert_eq!(
            json_text(&scalar(
                Scalar::TimestampTz,
                "2019-01-11 23:30:35.381101+00"
            )),
            "1547249435381.101"
        );
        assert_eq!(
            json_text(&scalar(Scalar::Timestamp, "2000-01-01 00:00:00")),
            "946684800000"
        );
        assert_eq!(scalar(Scalar::TimestampTz, "-infinity"), Value::Null);
        let err = convert(ValueType::Scalar(Scalar::TimestampTz), "Tue Jan 01 2019").unwrap_err();
        assert!(err.expected.contains("DateStyle ISO"));
    }

    #[test]
    fn arrays_convert_each_element() {
        let v = convert(
            ValueType::Array(Scalar::Integer),
            "{{1,NULL},{9223372036854775807,-2}}",
        )
        .unwrap();
        assert_eq!(json_text(&v), "[[1,null],[9223372036854775807,-2]]");
        let v = convert(
            ValueType::Array(Scalar::TimestampTz),
            r#"{"2019-01-11 23:30:35.381101+00",NULL,infinity}"#,
        )
        .unwrap();
        assert_eq!(json_text(&v), "[1547249435381.101,null,null]");
        let v = convert(ValueType::Array(Scalar::Json), r#"{"{\"a\": 1}",null}"#).unwrap();
        assert_eq!(json_text(&v), r#"["{\"a\": 1}",null]"#);
        assert!(convert(ValueType::Array(Scalar::Bool), "{t,x}").is_err());
        assert!(convert(ValueType::Array(Scalar::Bool), "{t").is_err());
    }

    #[test]
    fn builtin_oids_resolve() {
        assert_eq!(
            ValueType::builtin(20),
            Some(ValueType::Scalar(Scalar::Integer))
        );
        assert_eq!(
            ValueType::builtin(3802),
            Some(ValueType::Scalar(Scalar::Json))
        );
        assert_eq!(
            ValueType::builtin(1009),
            Some(ValueType::Array(Scalar::Text))
        );
        assert_eq!(ValueType::builtin(16400), None);
    }

    /// `convert_scalar` against `convert` of the same text: the same value or the same error,
    /// or `None` (left to `convert`) only where allowed.
    fn assert_scalar_agrees(oid: u32, text: &str) {
        let column = TextColumn::new(oid, false);
        let slow = column.convert(text.to_owned());
        match column.convert_scalar(text) {
            Some(Ok(fast)) => {
                assert_eq!(Ok(fast.to_value()), slow, "{oid} {text:?}");
                if let Ok(Value::Number(n)) = &slow {
                    assert_eq!(fast.number_text().as_deref(), Some(n.to_string().as_str()));
                }
            }
            Some(Err(expected)) => assert_eq!(Err(expected), slow, "{oid} {text:?}"),
            None => assert!(
                matches!(ValueType::of(oid, false), ValueType::Array(_))
                    || (matches!(
                        ValueType::of(oid, false),
                        ValueType::Scalar(Scalar::Float | Scalar::Numeric)
                    ) && !matches!(&slow, Ok(Value::Number(n)) if n.as_str() == text)),
                "{oid} {text:?} was left to convert"
            ),
        }
    }

    const SCALAR_OIDS: [u32; 13] = [
        16, 20, 23, 700, 701, 1700, 3802, 1114, 1184, 1082, 1083, 1266, 25,
    ];

    #[test]
    fn scalar_text_is_what_convert_makes() {
        let texts = [
            "t",
            "f",
            "x",
            "",
            "0",
            "-0",
            "42",
            "-9223372036854775808",
            "9223372036854775808",
            "01",
            "1.50",
            "-0.001",
            "1e3",
            "1.5e+300",
            "1e999999",
            "NaN",
            "Infinity",
            "-Infinity",
            "12345678901234567890.123456789000",
            "{\"a\": 1}",
            "héllo",
            "2024-01-01 00:00:01+00",
            "2019-01-11 22:30:35.381101-01",
            "1970-01-01 00:00:00.0005",
            "0044-03-15 12:00:00 BC",
            "294276-12-31 23:59:59.999999+00",
            "infinity",
            "-infinity",
            "2024-01-01",
            "2024-02-30",
            "13:45:00.25",
            "13:45:00+02",
            "24:00:00",
        ];
        for oid in SCALAR_OIDS {
            for text in texts {
                assert_scalar_agrees(oid, text);
            }
        }
        assert_eq!(TextColumn::new(1007, false).convert_scalar("{1}"), None);
        assert_eq!(
            TextColumn::new(1184, false)
                .convert_scalar("2019-01-11 22:30:35.381101-01")
                .unwrap()
                .unwrap()
                .number_text()
                .as_deref(),
            Some("1547249435381.101")
        );
    }

    proptest! {
        #[test]
        fn the_json_number_check_is_serde_jsons(text in "[-+0-9.eE]{0,12}") {
            prop_assert_eq!(is_json_number(&text), Number::from_str(&text).is_ok(), "{:?}", text);
        }

        #[test]
        fn scalar_text_agrees_on_any_text(text in ".{0,32}", which in 0usize..13) {
            assert_scalar_agrees(SCALAR_OIDS[which], &text);
        }

        #[test]
        fn scalar_text_agrees_on_numbers_and_instants(
            n: i64,
            f: f64,
            date in (1i64..=294_276, 1u32..=12, 1u32..=28),
            time in (0u32..24, 0u32..60, 0u32..60, 0u32..1_000_000),
            offset in -15i32..=15,
            which in 0usize..13,
        ) {
            let oid = SCALAR_OIDS[which];
            assert_scalar_agrees(oid, &n.to_string());
            assert_scalar_agrees(oid, &f.to_string());
            assert_scalar_agrees(oid, &format!("{f:e}"));
            let ((year, month, day), (h, m, sec, frac)) = (date, time);
            let text = format!("{year:04}-{month:02}-{day:02} {h:02}:{m:02}:{sec:02}.{frac:06}");
            assert_scalar_agrees(1114, &text);
            assert_scalar_agrees(1184, &format!("{text}{offset:+03}"));
            assert_scalar_agrees(1184, &format!("{text}{offset:+03} BC"));
        }

        #[test]
        fn every_i64_round_trips_exactly(n: i64) {
            prop_assert_eq!(json_text(&scalar(Scalar::Integer, &n.to_string())), n.to_string());
        }

        #[test]
        fn arbitrary_text_never_panics_any_converter(text in ".{0,32}", which in 0usize..22) {
            let scalars = [
                Scalar::Bool, Scalar::Integer, Scalar::Float, Scalar::Numeric, Scalar::Json,
                Scalar::Timestamp, Scalar::TimestampTz, Scalar::Date, Scalar::Time, Scalar::TimeTz,
                Scalar::Text,
            ];
            let s = scalars[which % scalars.len()];
            let ty = if which < scalars.len() { ValueType::Scalar(s) } else { ValueType::Array(s) };
            let _ = convert(ty, &text);
        }
    }
}
