//! Conformance vectors for the change-stream codec (`tests/vectors/change-stream/`): every valid
//! line decodes and round-trips, every invalid line fails at the expected JSON path.

use std::path::PathBuf;

use highwater_engine::change_stream::{decode_envelope, DecodeError};
use serde_json::Value;

fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/vectors/change-stream")
}

fn lines(name: &str) -> Vec<(usize, String)> {
    let path = vectors_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l.to_owned()))
        .collect()
}

/// Checks that `encoded` holds everything `original` holds, collecting keys it added.
fn covers(original: &Value, encoded: &Value, path: &str, added: &mut Vec<String>) {
    match (original, encoded) {
        (Value::Object(o), Value::Object(e)) => {
            for (key, value) in o {
                let inner = format!("{path}.{key}");
                let other = e.get(key).unwrap_or_else(|| panic!("{inner} was dropped"));
                covers(value, other, &inner, added);
            }
            added.extend(
                e.keys()
                    .filter(|k| !o.contains_key(*k))
                    .map(|k| format!("{path}.{k}")),
            );
        }
        (Value::Array(o), Value::Array(e)) => {
            assert_eq!(o.len(), e.len(), "{path}: array length changed");
            for (i, (a, b)) in o.iter().zip(e).enumerate() {
                covers(a, b, &format!("{path}[{i}]"), added);
            }
        }
        // Numbers compare by their exact text (arbitrary precision), so big integers must match.
        _ => assert_eq!(original, encoded, "{path} changed"),
    }
}

#[test]
fn valid_vectors_decode_and_round_trip() {
    let valid = lines("valid.jsonl");
    assert!(valid.len() >= 30, "the valid vectors went missing");
    let mut normalized_relations = 0;
    for (n, line) in valid {
        let envelope = decode_envelope(&line).unwrap_or_else(|e| panic!("line {n}: {e}\n{line}"));
        let encoded = envelope.encode();
        let original: Value = serde_json::from_str(&line).expect("valid JSON");
        let reencoded: Value = serde_json::from_str(&encoded).expect("encoder writes JSON");
        let mut added = Vec::new();
        covers(&original, &reencoded, "$", &mut added);
        // The only thing encoding adds is `rowKey` to relations sent in the deprecated form.
        for key in &added {
            assert!(key.ends_with(".rowKey"), "line {n}: encoding added {key}");
            normalized_relations += 1;
        }
        let again =
            decode_envelope(&encoded).unwrap_or_else(|e| panic!("line {n} re-encoded: {e}"));
        assert_eq!(again, envelope, "line {n}: decode(encode(x)) differs");
        assert_eq!(again.encode(), encoded, "line {n}: encoding is not stable");
    }
    assert!(
        normalized_relations >= 2,
        "deprecated relation vectors went missing"
    );
}

#[test]
fn invalid_vectors_fail_at_the_expected_path() {
    let invalid = lines("invalid.jsonl");
    let expected = lines("invalid.expected.jsonl");
    assert_eq!(
        invalid.len(),
        expected.len(),
        "invalid.expected.jsonl must be line-aligned"
    );
    assert!(invalid.len() >= 30, "the invalid vectors went missing");
    for ((n, line), (_, expectation)) in invalid.into_iter().zip(expected) {
        let expectation: Value = serde_json::from_str(&expectation).expect("expectation JSON");
        let (path, reason) = (&expectation["path"], &expectation["reason"]);
        let error: DecodeError = match decode_envelope(&line) {
            Ok(decoded) => panic!("line {n} should be invalid, decoded {decoded:?}"),
            Err(e) => e,
        };
        assert_eq!(Some(error.path()), path.as_str(), "line {n}: {error}");
        let message = error.to_string();
        let reason = reason.as_str().unwrap_or_default();
        assert!(
            message.contains(reason),
            "line {n}: {message:?} lacks {reason:?}"
        );
        assert!(
            message.starts_with(&format!("at {}: ", error.path())),
            "line {n}: {message}"
        );
    }
}
