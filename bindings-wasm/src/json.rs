//! JSON values ⇄ JS values, exact for big integers and unknown keys.
//!
//! serde_json keeps numbers as their source text (`arbitrary_precision`), which
//! serde-wasm-bindgen would expose as an internal wrapper object, so the conversion is done
//! here: integers within ±(2^53 − 1) become numbers, wider integers `BigInt`, other numbers
//! numbers; objects keep their key order (as far as JS allows: integer-like keys come first).

use js_sys::{Array, BigInt, Object, Reflect};
use serde::Serialize;
use serde_json::{Map, Number, Value};
use wasm_bindgen::prelude::*;
use wasm_bindgen::JsCast;

use crate::error::{ErrorCode, Failure};

#[wasm_bindgen(typescript_custom_section)]
const JSON_TS: &str = r#"
/** JSON as this package reads and writes it: integers beyond ±(2^53 − 1) are `bigint`. */
export type JsonValue =
  | null
  | boolean
  | number
  | bigint
  | string
  | JsonValue[]
  | { [key: string]: JsonValue };
"#;

/// 2^53 − 1: the widest integer a JS number holds exactly.
const MAX_SAFE_INTEGER: i64 = (1 << 53) - 1;

/// Converts a JSON value into the JS value `JSON.parse` would give, with `BigInt` for wide integers.
pub(crate) fn to_js(value: &Value) -> Result<JsValue, JsValue> {
    Ok(match value {
        Value::Null => JsValue::NULL,
        Value::Bool(b) => JsValue::from_bool(*b),
        Value::Number(n) => number_to_js(n)?,
        Value::String(s) => JsValue::from_str(s),
        Value::Array(items) => {
            let array = Array::new_with_length(items.len() as u32);
            for (i, item) in items.iter().enumerate() {
                array.set(i as u32, to_js(item)?);
            }
            array.into()
        }
        Value::Object(map) => {
            let object = Object::new();
            for (key, item) in map {
                define(&object, key, &to_js(item)?)?;
            }
            object.into()
        }
    })
}

/// [`to_js`] of a serializable value, for large ones (events, pages of rows): one
/// `JSON.parse` of its text instead of a call across the boundary per property, when that gives
/// the same value (see [`text_parses_exactly`]); otherwise through [`Value`] and [`to_js`].
/// Serialized straight to text, so the value is not first copied into a [`Value`]. The
/// client's (a tools-only build has no use for it).
#[cfg_attr(not(feature = "client"), allow(dead_code))]
pub(crate) fn to_js_bulk<T: Serialize + ?Sized>(value: &T) -> Result<JsValue, JsValue> {
    let unserializable = |e: serde_json::Error| {
        Failure::new(
            ErrorCode::InvalidValue,
            format!("unserializable value: {e}"),
        )
    };
    let text = serde_json::to_string(value).map_err(unserializable)?;
    if text_parses_exactly(&text) {
        return js_sys::JSON::parse(&text);
    }
    // Read back rather than `serde_json::to_value`, which would build a second serializer
    // of every event type into the module. The text nests no deeper than the frames and
    // stored rows it came from, which were read with the same depth limit.
    to_js(&serde_json::from_str::<Value>(&text).map_err(unserializable)?)
}

/// Whether `JSON.parse(text)` gives what [`to_js`] gives for the same JSON: it does unless a
/// number is an integer beyond ±(2^53 − 1) (a `bigint` for `to_js`, a rounded number for
/// `JSON.parse`) or `-0`. `text` is serde_json's own output, so a plain scan finds the numbers:
/// every number token outside a string. Written by hand: no JSON crate reports this.
#[cfg_attr(not(feature = "client"), allow(dead_code))]
fn text_parses_exactly(text: &str) -> bool {
    let bytes = text.as_bytes();
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        match byte {
            b'"' => {
                at += 1;
                while let Some(&byte) = bytes.get(at) {
                    at += if byte == b'\\' { 2 } else { 1 };
                    if byte == b'"' {
                        break;
                    }
                }
            }
            b'-' | b'0'..=b'9' => {
                let start = at;
                while bytes
                    .get(at)
                    .is_some_and(|b| matches!(b, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'))
                {
                    at += 1;
                }
                let token = &text[start..at];
                // Up to 15 digits is always within ±(2^53 − 1) (16 digits), so most integers
                // need no parse.
                let digits = token.len() - usize::from(token.starts_with('-'));
                if is_integer_text(token)
                    && (token == "-0"
                        || (digits > 15
                            && !token
                                .parse::<i64>()
                                .is_ok_and(|i| i.abs() <= MAX_SAFE_INTEGER)))
                {
                    return false;
                }
            }
            _ => at += 1,
        }
    }
    true
}

fn number_to_js(n: &Number) -> Result<JsValue, JsValue> {
    let text = n.to_string();
    if is_integer_text(&text) {
        return match text.parse::<i64>() {
            Ok(i) if i.abs() <= MAX_SAFE_INTEGER => Ok(JsValue::from_f64(i as f64)),
            // An integer text that does not fit i64 is beyond the safe range as well.
            _ => BigInt::new(&JsValue::from_str(&text))
                .map(Into::into)
                .map_err(Into::into),
        };
    }
    Ok(JsValue::from_f64(n.as_f64().unwrap_or(f64::NAN)))
}

fn is_integer_text(text: &str) -> bool {
    !text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E'))
}

/// Sets an own data property; `__proto__` must not go through the prototype setter.
fn define(object: &Object, key: &str, value: &JsValue) -> Result<(), JsValue> {
    if key == "__proto__" {
        let descriptor = Object::new();
        for (name, v) in [
            ("value", value.clone()),
            ("writable", JsValue::TRUE),
            ("enumerable", JsValue::TRUE),
            ("configurable", JsValue::TRUE),
        ] {
            Reflect::set(&descriptor, &name.into(), &v)?;
        }
        Object::define_property(object, &key.into(), &descriptor);
        return Ok(());
    }
    Reflect::set(object, &key.into(), value).map(|_| ())
}

/// Converts a JS value into JSON: `BigInt` becomes an exact integer, `undefined` object members
/// are left out (as `JSON.stringify` does). Anything else that is not JSON is an error.
/// Error paths read like the engine's decode errors: `$`, `$[1].new.id`, `$.conditions["a b"]`.
pub(crate) fn from_js(value: &JsValue) -> Result<Value, Failure> {
    from_js_at(value, &mut String::from("$"), 0)
}

/// Deeper values are refused, as serde_json refuses deeper text; this also stops on cycles.
const MAX_DEPTH: usize = 128;

fn from_js_at(value: &JsValue, path: &mut String, depth: usize) -> Result<Value, Failure> {
    if depth > MAX_DEPTH {
        return Err(invalid(
            path,
            format!(
                "expected JSON nested at most {MAX_DEPTH} levels deep (or a cycle), got deeper"
            ),
        ));
    }
    if value.is_null() {
        return Ok(Value::Null);
    }
    if let Some(b) = value.as_bool() {
        return Ok(Value::Bool(b));
    }
    if let Some(s) = value.as_string() {
        return Ok(Value::String(s));
    }
    if let Some(x) = value.as_f64() {
        return number_from_f64(x)
            .map(Value::Number)
            .ok_or_else(|| invalid(path, format!("expected a finite number, got {x}")));
    }
    if let Some(big) = value.dyn_ref::<BigInt>() {
        let text: String = big
            .to_string(10)
            .map_err(|_| invalid(path, "expected a BigInt printable in base 10"))?
            .into();
        return text
            .parse::<Number>()
            .map(Value::Number)
            .map_err(|e| invalid(path, format!("expected an integer, got {text}: {e}")));
    }
    if Array::is_array(value) {
        let array: &Array = value.unchecked_ref();
        let mut items = Vec::with_capacity(array.length() as usize);
        for (i, item) in array.iter().enumerate() {
            let len = path.len();
            path.push_str(&format!("[{i}]"));
            items.push(from_js_at(&item, path, depth + 1)?);
            path.truncate(len);
        }
        return Ok(Value::Array(items));
    }
    if is_plain_object(value) {
        let object: &Object = value.unchecked_ref();
        let mut map = Map::new();
        for key in Object::keys(object).iter() {
            let item = Reflect::get(object, &key).map_err(|_| {
                invalid(
                    path,
                    "expected readable properties, got one whose getter threw",
                )
            })?;
            if item.is_undefined() {
                continue;
            }
            let key = key.as_string().unwrap_or_default();
            let len = path.len();
            push_key(path, &key);
            map.insert(key, from_js_at(&item, path, depth + 1)?);
            path.truncate(len);
        }
        return Ok(Value::Object(map));
    }
    Err(invalid(
        path,
        format!(
            "expected a JSON value (null, boolean, number, bigint, string, array or plain object), got {}",
            describe(value)
        ),
    ))
}

/// `.key` for identifier-like keys, `["key"]` (JSON-quoted) for any other.
fn push_key(path: &mut String, key: &str) {
    let plain = key
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '$')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
    if plain {
        path.push('.');
        path.push_str(key);
    } else {
        path.push('[');
        path.push_str(&Value::from(key).to_string());
        path.push(']');
    }
}

/// A finite double as JSON: safe integers print without a fraction, like `JSON.stringify`.
fn number_from_f64(x: f64) -> Option<Number> {
    if x.fract() == 0.0 && x.abs() <= MAX_SAFE_INTEGER as f64 {
        return Some(Number::from(x as i64));
    }
    Number::from_f64(x)
}

fn is_plain_object(value: &JsValue) -> bool {
    if !value.is_object() || value.is_function() {
        return false;
    }
    let proto = Object::get_prototype_of(value);
    proto.is_null() || Object::get_prototype_of(&proto).is_null()
}

fn describe(value: &JsValue) -> String {
    if value.is_undefined() {
        return "undefined".into();
    }
    value
        .js_typeof()
        .as_string()
        .unwrap_or_else(|| "an unknown value".into())
}

fn invalid(path: &str, message: impl std::fmt::Display) -> Failure {
    Failure::new(ErrorCode::InvalidValue, message).at(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_text_is_told_from_decimals() {
        for text in [
            "0",
            "-1",
            "9007199254740993",
            "-123456789012345678901234567890",
        ] {
            assert!(is_integer_text(text), "{text}");
        }
        for text in ["1.0", "1e3", "-2.5E-7"] {
            assert!(!is_integer_text(text), "{text}");
        }
    }

    #[test]
    fn text_parses_exactly_unless_an_integer_is_unsafe_or_negative_zero() {
        for text in [
            r#"{"n":9007199254740991,"m":-9007199254740991,"x":1.5e300,"y":-0.0,"z":0}"#,
            r#"["12345678901234567890 in a string","\\",-0.5]"#,
            r#"{"a \" 99999999999999999999":1}"#,
            r#"[999999999999999,-999999999999999,1000000000000000]"#,
            "",
        ] {
            assert!(text_parses_exactly(text), "{text}");
        }
        for text in [
            r#"{"n":9007199254740992}"#,
            r#"[-9007199254740992]"#,
            r#"{"s":"\\","n":123456789012345678901234567890}"#,
            r#"{"z":-0}"#,
            r#"[9999999999999999]"#,
        ] {
            assert!(!text_parses_exactly(text), "{text}");
        }
    }

    #[test]
    fn paths_quote_keys_that_are_not_identifiers() {
        let path = |keys: &[&str]| {
            let mut path = String::from("$");
            for key in keys {
                push_key(&mut path, key);
            }
            path
        };
        assert_eq!(path(&["new", "id_2"]), "$.new.id_2");
        assert_eq!(path(&["a b", "2x", ""]), r#"$["a b"]["2x"][""]"#);
        assert_eq!(path(&["say \"hi\""]), r#"$["say \"hi\""]"#);
    }

    #[test]
    fn doubles_print_like_json_stringify() {
        let text = |x: f64| number_from_f64(x).map(|n| n.to_string());
        assert_eq!(text(1.0).as_deref(), Some("1"));
        assert_eq!(text(-0.0).as_deref(), Some("0"));
        assert_eq!(text(2.5).as_deref(), Some("2.5"));
        assert_eq!(
            text(9007199254740991.0).as_deref(),
            Some("9007199254740991")
        );
        assert_eq!(text(f64::INFINITY), None);
        assert_eq!(text(f64::NAN), None);
    }
}
