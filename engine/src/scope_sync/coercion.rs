//! The JavaScript value coercions the velocious peers apply to sync data, reproduced exactly.
//!
//! Peers run `Number(text)`, `String(value)` and `JSON.stringify`; matching their results is what
//! makes cursors, digests and routing agree across the two implementations. Integers are read
//! from the digits themselves, never through `f64`, so sequences beyond 2^53 survive.

use serde_json::{Number, Value};

/// What `Number(text)` makes of a string, restricted to the integer question.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IntegerText {
    Integer(i64),
    /// Numeric, but not an integer (`1.5`, `Infinity`) — or not numeric at all.
    NotInteger,
    /// An integer whose magnitude does not fit in 64 bits.
    OutOfRange,
}

/// JS `WhiteSpace` and `LineTerminator`: Unicode `White_Space` without U+0085, plus U+FEFF.
fn is_js_whitespace(c: char) -> bool {
    (c.is_whitespace() && c != '\u{85}') || c == '\u{feff}'
}

/// Reads `text` as `Number(text)` would and says whether the value is an exact integer.
///
/// Accepts surrounding JS whitespace, a sign, decimal digits with an optional fraction and
/// exponent (`"1e3"`, `"5."`, `".5e1"`) and unsigned `0x`/`0o`/`0b` literals. A blank string is
/// not an integer here, although `Number("")` is 0: typanic rejects blank text before converting.
pub(crate) fn integer_from_text(text: &str) -> IntegerText {
    let text = text.trim_matches(is_js_whitespace);
    if text.is_empty() {
        return IntegerText::NotInteger;
    }
    let bytes = text.as_bytes();
    if bytes.len() > 2 && bytes[0] == b'0' {
        let radix = match bytes[1] {
            b'x' | b'X' => Some(16),
            b'o' | b'O' => Some(8),
            b'b' | b'B' => Some(2),
            _ => None,
        };
        if let Some(radix) = radix {
            return radix_integer(&text[2..], radix);
        }
    }
    decimal_integer(text)
}

fn radix_integer(digits: &str, radix: u32) -> IntegerText {
    let mut value: u64 = 0;
    for c in digits.chars() {
        let Some(d) = c.to_digit(radix) else {
            return IntegerText::NotInteger;
        };
        match value
            .checked_mul(u64::from(radix))
            .and_then(|v| v.checked_add(u64::from(d)))
        {
            Some(v) => value = v,
            None => return finish_digits_or_range(digits, radix),
        }
    }
    i64::try_from(value).map_or(IntegerText::OutOfRange, IntegerText::Integer)
}

/// After an overflow, the rest must still be digits for the text to count as a (too big) integer.
fn finish_digits_or_range(digits: &str, radix: u32) -> IntegerText {
    if digits.chars().all(|c| c.is_digit(radix)) {
        IntegerText::OutOfRange
    } else {
        IntegerText::NotInteger
    }
}

fn decimal_integer(text: &str) -> IntegerText {
    let (negative, body) = match text.as_bytes()[0] {
        b'-' => (true, &text[1..]),
        b'+' => (false, &text[1..]),
        _ => (false, text),
    };
    if body == "Infinity" {
        return IntegerText::NotInteger;
    }
    let (mantissa, exponent) = match body.find(['e', 'E']) {
        Some(at) => (&body[..at], Some(&body[at + 1..])),
        None => (body, None),
    };
    let (int_part, frac_part) = match mantissa.find('.') {
        Some(at) => (&mantissa[..at], &mantissa[at + 1..]),
        None => (mantissa, ""),
    };
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if (int_part.is_empty() && frac_part.is_empty())
        || !all_digits(int_part)
        || !all_digits(frac_part)
    {
        return IntegerText::NotInteger;
    }
    let exponent: i64 = match exponent {
        None => 0,
        Some(exp) => {
            let (exp_negative, exp_digits) = match exp.as_bytes().first() {
                Some(b'-') => (true, &exp[1..]),
                Some(b'+') => (false, &exp[1..]),
                _ => (false, exp),
            };
            if exp_digits.is_empty() || !all_digits(exp_digits) {
                return IntegerText::NotInteger;
            }
            // Saturate: any exponent this large already decides the answer.
            let magnitude = exp_digits.bytes().fold(0i64, |acc, b| {
                acc.saturating_mul(10).saturating_add(i64::from(b - b'0'))
            });
            if exp_negative {
                -magnitude
            } else {
                magnitude
            }
        }
    };
    // value = digits × 10^scale, with the digits stripped of leading and trailing zeros.
    let digits: String = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    if digits.is_empty() {
        return IntegerText::Integer(0);
    }
    let significant = digits.trim_end_matches('0');
    let trailing_zeros = (digits.len() - significant.len()) as i64;
    let scale = exponent
        .saturating_sub(frac_part.len() as i64)
        .saturating_add(trailing_zeros);
    if scale < 0 {
        return IntegerText::NotInteger;
    }
    // i64 has at most 19 digits; anything longer is out of range.
    if (significant.len() as i64).saturating_add(scale) > 19 {
        return IntegerText::OutOfRange;
    }
    let mut value: i128 = 0;
    for b in significant.bytes() {
        value = value * 10 + i128::from(b - b'0');
    }
    for _ in 0..scale {
        value *= 10;
    }
    if negative {
        value = -value;
    }
    i64::try_from(value).map_or(IntegerText::OutOfRange, IntegerText::Integer)
}

/// Reads a JSON number as an exact integer (`1234`, `1e3`, `12.0` are integers; `1.5` is not).
pub(crate) fn integer_from_number(number: &Number) -> IntegerText {
    decimal_integer(&number.to_string())
}

/// The `f64` a JS peer holds for this JSON number.
fn js_double(number: &Number) -> f64 {
    // Parse the text ourselves: `as_f64` hides overflow to infinity, which JS keeps.
    number.to_string().parse().unwrap_or(f64::NAN)
}

/// `Number.prototype.toString()` of a double: shortest round-trip digits, JS exponent rules.
pub(crate) fn js_number_text(value: f64) -> String {
    if value.is_nan() {
        return "NaN".to_owned();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    if value == 0.0 {
        return "0".to_owned();
    }
    if value < 0.0 {
        return format!("-{}", js_number_text(-value));
    }
    // Rust's `{:e}` yields the same shortest round-trip digits ECMAScript requires.
    let scientific = format!("{value:e}");
    let (mantissa, exp) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let k = digits.len() as i64;
    let n = exp.parse::<i64>().unwrap_or(0) + 1;
    if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 21 {
        let (head, tail) = digits.split_at(n as usize);
        format!("{head}.{tail}")
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let e = n - 1;
        let sign = if e < 0 { '-' } else { '+' };
        let (first, rest) = digits.split_at(1);
        if rest.is_empty() {
            format!("{first}e{sign}{}", e.abs())
        } else {
            format!("{first}.{rest}e{sign}{}", e.abs())
        }
    }
}

/// How `JSON.stringify` writes a number a JS peer parsed from this JSON number.
///
/// Integer literals keep their own digits: JS writes every integer it holds as such digits (or
/// with an exponent, which this path formats as JS does), so JS-made JSON prints identically,
/// while integers beyond 2^53 from other writers stay exact instead of colliding.
pub(crate) fn json_number_text(number: &Number) -> String {
    let text = number.to_string();
    if !text.contains(['.', 'e', 'E']) {
        let digits = text
            .strip_prefix('-')
            .unwrap_or(&text)
            .trim_start_matches('0');
        return match (text.starts_with('-'), digits.is_empty()) {
            (_, true) => "0".to_owned(),
            (true, false) => format!("-{digits}"),
            (false, false) => digits.to_owned(),
        };
    }
    let double = js_double(number);
    if double.is_finite() {
        js_number_text(double)
    } else {
        // JSON.stringify(Infinity) is "null"; keep the text rather than collide with null.
        text
    }
}

/// `String(value)` for a JSON value, as a JS peer computes it when comparing routing values.
/// Numbers print as in [`json_number_text`], so big integers compare exactly.
pub fn js_string_form(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => json_number_text(n),
        Value::String(s) => s.clone(),
        // Array.prototype.join: null and undefined elements become empty strings.
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::Null => String::new(),
                other => js_string_form(other),
            })
            .collect::<Vec<_>>()
            .join(","),
        Value::Object(_) => "[object Object]".to_owned(),
    }
}

/// Orders two strings as JS does: by UTF-16 code units, not by code points.
pub(crate) fn js_string_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    a.encode_utf16().cmp(b.encode_utf16())
}

/// A short description of a JSON value for error messages: its kind and, for scalars, its text.
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(items) => format!("an array of {} items", items.len()),
        Value::Object(_) => "an object".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn number(text: &str) -> Number {
        serde_json::from_str(text).expect("a JSON number")
    }

    #[test]
    fn number_conversion_accepts_every_integer_spelling_typanic_accepts() {
        for (text, expected) in [
            ("12", 12),
            (" 7 ", 7),
            ("1e3", 1000),
            ("0x10", 16),
            ("0o17", 15),
            ("0b101", 5),
            ("+5", 5),
            ("-0", 0),
            ("5.", 5),
            (".5e1", 5),
            ("12.000", 12),
            ("1200e-2", 12),
            ("\u{feff}\t9\u{2028}", 9),
            ("9223372036854775807", i64::MAX),
            ("-9223372036854775808", i64::MIN),
        ] {
            assert_eq!(
                integer_from_text(text),
                IntegerText::Integer(expected),
                "{text:?}"
            );
        }
    }

    #[test]
    fn number_conversion_rejects_fractions_words_and_blank_text() {
        for text in [
            "",
            "   ",
            "abc",
            "1.5",
            "1e-1",
            "Infinity",
            "-Infinity",
            "-0x10",
            "0x",
            "1e",
            "1_000",
            ".",
            "+",
            "12abc",
            "\u{85}1",
        ] {
            assert_eq!(integer_from_text(text), IntegerText::NotInteger, "{text:?}");
        }
    }

    #[test]
    fn number_conversion_reports_integers_beyond_64_bits_as_out_of_range() {
        for text in [
            "9223372036854775808",
            "1e19",
            "0xffffffffffffffffff",
            "1e999999999999999999999",
        ] {
            assert_eq!(integer_from_text(text), IntegerText::OutOfRange, "{text:?}");
        }
    }

    #[test]
    fn json_numbers_are_read_exactly_beyond_two_to_the_53() {
        assert_eq!(
            integer_from_number(&number("9007199254740993")),
            IntegerText::Integer(9_007_199_254_740_993)
        );
        assert_eq!(
            integer_from_number(&number("12.0")),
            IntegerText::Integer(12)
        );
        assert_eq!(integer_from_number(&number("1.5")), IntegerText::NotInteger);
    }

    #[test]
    fn numbers_print_like_javascript() {
        for (value, expected) in [
            (5.0, "5"),
            (-0.0, "0"),
            (0.1, "0.1"),
            (123.456, "123.456"),
            (1e21, "1e+21"),
            (1e20, "100000000000000000000"),
            (1.5e-7, "1.5e-7"),
            (0.000001, "0.000001"),
            (-2.5e30, "-2.5e+30"),
        ] {
            assert_eq!(js_number_text(value), expected, "{value}");
        }
    }

    #[test]
    fn json_number_text_keeps_integer_digits_and_formats_the_rest_like_javascript() {
        assert_eq!(json_number_text(&number("5.0")), "5");
        assert_eq!(json_number_text(&number("1e3")), "1000");
        assert_eq!(
            json_number_text(&number("9007199254740992")),
            "9007199254740992"
        );
        assert_eq!(
            json_number_text(&number("9007199254740993")),
            "9007199254740993"
        );
        assert_eq!(json_number_text(&number("-0")), "0");
        assert_eq!(
            json_number_text(&number("19496133083489512")),
            "19496133083489512"
        );
        assert_eq!(json_number_text(&number("-12.50")), "-12.5");
        assert_eq!(json_number_text(&number("1E21")), "1e+21");
    }

    #[test]
    fn string_forms_match_javascript_string_conversion() {
        let v: Value = serde_json::from_str(r#"[5, "a", null, true, 1.50, {"x":1}]"#).unwrap();
        assert_eq!(js_string_form(&v), "5,a,,true,1.5,[object Object]");
        assert_eq!(js_string_form(&Value::Null), "null");
    }

    #[test]
    fn js_string_order_is_utf16_order() {
        // U+FF61 sorts after U+1F600 by code point but before it by UTF-16 code unit.
        assert_eq!(
            js_string_cmp("\u{1F600}", "\u{FF61}"),
            std::cmp::Ordering::Less
        );
    }

    proptest! {
        #[test]
        fn every_i64_round_trips_through_its_decimal_text(n in any::<i64>()) {
            prop_assert_eq!(integer_from_text(&n.to_string()), IntegerText::Integer(n));
        }

        #[test]
        fn doubles_print_to_text_that_parses_back_to_them(x in any::<f64>().prop_filter("finite", |x| x.is_finite())) {
            let text = js_number_text(x);
            let back: f64 = text.parse().expect("JS number text parses");
            prop_assert_eq!(back, if x == 0.0 { 0.0 } else { x });
        }
    }
}
