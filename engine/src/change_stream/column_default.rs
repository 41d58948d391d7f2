//! What a column's `dflt` means to a replica, as Zero's replicator reads it.
//!
//! An `add-column` without a `backfill` asks the replica to add the column with `dflt` as its
//! SQLite default, so existing rows get that value. Zero's replicator turns the upstream default
//! expression into a SQLite default with a fixed set of patterns (a numeric literal, `true` /
//! `false`, a quoted literal with a one-word cast, an empty array) and fails the whole change
//! stream with "Unsupported default value" on anything else (`now()`, `nextval(…)`, a timestamp
//! literal). A change source must therefore send such a column with `dflt: null` and a
//! `backfill` instead; `create-table` and `update-column` defaults are never applied and may
//! carry any expression.

use super::PgTypeClass;

/// An upstream default expression that Zero's replicator cannot turn into a SQLite default.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Unsupported default value: {expression} (expected a numeric or boolean literal, a quoted literal with a one-word cast, or an empty array)")]
pub struct UnsupportedDefault {
    pub expression: String,
}

/// The SQLite default Zero's replicator derives from an upstream default expression
/// (`pg_get_expr` text), or the error it stops on.
pub fn lite_default(expression: &str) -> Result<String, UnsupportedDefault> {
    if is_numeric_literal(expression) {
        return Ok(expression.to_owned());
    }
    match expression {
        "true" => return Ok("1".to_owned()),
        "false" => return Ok("0".to_owned()),
        _ => {}
    }
    if let Some((literal, _cast)) = quoted_with_cast(expression) {
        return Ok(literal.to_owned());
    }
    if is_empty_array(expression) {
        return Ok("'[]'".to_owned());
    }
    Err(UnsupportedDefault {
        expression: expression.to_owned(),
    })
}

/// The default a change source may send without a backfill: one Zero's replicator accepts and
/// whose SQLite value is exactly what replicating the column's upstream value would store, so
/// existing rows end up as upstream has them. `None` means: send `dflt: null` and backfill.
///
/// Stricter than Zero's own change source, which also sends defaults the replica would store
/// differently from replicated values (`'2024-01-01'::date` as text where dates are numbers,
/// `'ab'::bpchar` without its padding).
pub fn exact_lite_default(
    expression: &str,
    data_type: &str,
    type_class: Option<PgTypeClass>,
) -> Option<String> {
    let lite = lite_default(expression).ok()?;
    let exact = if data_type.ends_with("[]") {
        is_empty_array(expression)
    } else if is_numeric_literal(expression) {
        matches!(
            data_type,
            "int2" | "int4" | "int8" | "float4" | "float8" | "numeric"
        )
    } else if expression == "true" || expression == "false" {
        data_type == "bool"
    } else if let Some((_, cast)) = quoted_with_cast(expression) {
        let text_like = matches!(data_type, "text" | "uuid" | "json" | "jsonb")
            || type_class == Some(PgTypeClass::Enum);
        text_like && cast == data_type
    } else {
        false
    };
    exact.then_some(lite)
}

/// `^-?\d+(\.\d+)?$`
fn is_numeric_literal(s: &str) -> bool {
    let s = s.strip_prefix('-').unwrap_or(s);
    let (int, frac) = match s.split_once('.') {
        Some((int, frac)) => (int, Some(frac)),
        None => (s, None),
    };
    let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    digits(int) && frac.is_none_or(digits)
}

/// A JavaScript regex `\w`.
fn is_word(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// `^('.*')::(\w+)$` (a JavaScript `.` matches no line terminator): the quoted literal and
/// the cast. `\w+` holds no `:`, so the cast follows the last `::`.
fn quoted_with_cast(s: &str) -> Option<(&str, &str)> {
    let (literal, cast) = s.rsplit_once("::")?;
    let quoted = literal.len() >= 2 && literal.starts_with('\'') && literal.ends_with('\'');
    let one_line = !literal.contains(['\n', '\r', '\u{2028}', '\u{2029}']);
    (quoted && one_line && is_word(cast)).then_some((literal, cast))
}

/// `^ARRAY\s*\[\s*\]::\w+\[\]$` (case-insensitive) or `^'\{\}'::\w+\[\]$`.
fn is_empty_array(s: &str) -> bool {
    let Some((value, cast)) = s.rsplit_once("::") else {
        return false;
    };
    let Some(element) = cast.strip_suffix("[]") else {
        return false;
    };
    if !is_word(element) {
        return false;
    }
    if value == "'{}'" {
        return true;
    }
    let Some(head) = value.get(..5).filter(|h| h.eq_ignore_ascii_case("ARRAY")) else {
        return false;
    };
    let rest = value[head.len()..].trim_start();
    let Some(rest) = rest.strip_prefix('[') else {
        return false;
    };
    rest.trim_start() == "]"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_maps_literals_and_rejects_expressions() {
        let cases: &[(&str, Option<&str>)] = &[
            ("5", Some("5")),
            ("-12.50", Some("-12.50")),
            ("1.", None),
            (".5", None),
            ("true", Some("1")),
            ("false", Some("0")),
            ("'abc'::text", Some("'abc'")),
            ("'it''s'::text", Some("'it''s'")),
            ("'-1'::integer", Some("'-1'")),
            ("'a'::character varying", None),
            ("'2024-01-01 00:00:00+00'::timestamp with time zone", None),
            ("'{}'::text[]", Some("'[]'")),
            ("ARRAY[]::integer[]", Some("'[]'")),
            ("array [ ]::int4[]", Some("'[]'")),
            ("'{1,2}'::integer[]", None),
            ("now()", None),
            ("CURRENT_TIMESTAMP", None),
            ("nextval('issue_id_seq'::regclass)", None),
            ("'a\nb'::text", None),
            ("", None),
        ];
        for (expression, lite) in cases {
            assert_eq!(
                lite_default(expression).ok().as_deref(),
                *lite,
                "{expression:?}"
            );
        }
        let err = lite_default("now()").unwrap_err();
        assert!(err.to_string().contains("now()"), "{err}");
    }

    #[test]
    fn only_defaults_stored_like_replicated_values_go_without_a_backfill() {
        let cases: &[(&str, &str, Option<PgTypeClass>, Option<&str>)] = &[
            ("5", "int4", None, Some("5")),
            ("1.5", "numeric", None, Some("1.5")),
            ("5", "text", None, None),
            ("true", "bool", None, Some("1")),
            ("'abc'::text", "text", None, Some("'abc'")),
            ("'{}'::jsonb", "jsonb", None, Some("'{}'")),
            (
                "'open'::state",
                "state",
                Some(PgTypeClass::Enum),
                Some("'open'"),
            ),
            ("'-1'::integer", "int4", None, None),
            ("'2024-01-01'::date", "date", None, None),
            ("'ab'::bpchar", "bpchar", None, None),
            ("'{}'::text[]", "text[]", None, Some("'[]'")),
            ("5", "int4[]", None, None),
            ("now()", "timestamptz", None, None),
        ];
        for (expression, data_type, class, want) in cases {
            assert_eq!(
                exact_lite_default(expression, data_type, *class).as_deref(),
                *want,
                "{expression:?} on {data_type}"
            );
        }
    }
}
