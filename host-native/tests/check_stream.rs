//! `highwater check-stream` run as a real process on the conformance vectors and on stdin.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn vector(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/vectors/change-stream")
        .join(name)
}

fn non_blank_lines(name: &str) -> usize {
    let text = std::fs::read_to_string(vector(name)).expect("vector file");
    text.lines().filter(|l| !l.trim().is_empty()).count()
}

fn highwater(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_highwater"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn highwater");
    let mut input = child.stdin.take().expect("stdin");
    input
        .write_all(stdin.unwrap_or_default().as_bytes())
        .expect("write stdin");
    drop(input);
    child.wait_with_output().expect("highwater runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).expect("utf-8 output")
}

#[test]
fn valid_vectors_all_pass() {
    let path = vector("valid.jsonl");
    let out = highwater(&["check-stream", path.to_str().expect("utf-8 path")], None);
    let n = non_blank_lines("valid.jsonl");
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_eq!(text(&out.stdout), format!("{n} passed, 0 failed\n"));
}

#[test]
fn invalid_vectors_each_get_a_report_line_and_a_failing_exit() {
    let path = vector("invalid.jsonl");
    let out = highwater(&["check-stream", path.to_str().expect("utf-8 path")], None);
    assert!(!out.status.success());
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let n = non_blank_lines("invalid.jsonl");
    assert_eq!(lines.len(), n + 1, "{stdout}");
    assert_eq!(lines[n], format!("0 passed, {n} failed"));
    let expected = std::fs::read_to_string(vector("invalid.expected.jsonl")).expect("expectations");
    for (i, (line, expectation)) in lines.iter().zip(expected.lines()).enumerate() {
        let expectation: serde_json::Value = serde_json::from_str(expectation).expect("json");
        let prefix = format!(
            "line {}: at {}: ",
            i + 1,
            expectation["path"].as_str().unwrap_or("")
        );
        assert!(
            line.starts_with(&prefix),
            "{line:?} should start with {prefix:?}"
        );
        let reason = expectation["reason"].as_str().unwrap_or("");
        assert!(line.contains(reason), "{line:?} lacks {reason:?}");
    }
}

#[test]
fn stdin_is_read_with_dash_or_no_file() {
    let input = "[\"status\",{\"tag\":\"status\"}]\n\n[\"commit\",{\"tag\":\"commit\"},{\"watermark\":\"0A\"}]\n";
    for args in [&["check-stream", "-"][..], &["check-stream"][..]] {
        let out = highwater(args, Some(input));
        assert!(!out.status.success());
        let stdout = text(&out.stdout);
        assert!(
            stdout.starts_with("line 3: at $[2].watermark: expected a watermark"),
            "{stdout}"
        );
        assert!(stdout.ends_with("1 passed, 1 failed\n"), "{stdout}");
    }
}

#[test]
fn normalize_emits_one_message_per_line_that_checks_clean() {
    let path = vector("valid.jsonl");
    let out = highwater(
        &[
            "check-stream",
            path.to_str().expect("utf-8 path"),
            "--normalize",
        ],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let normalized = text(&out.stdout);
    // Bare messages only: every line is a tuple; frames were unwrapped.
    assert!(
        normalized.lines().all(|l| l.starts_with('[')),
        "{normalized}"
    );
    assert!(
        normalized.contains("123456789012345678901234567890"),
        "big integers survive"
    );
    assert!(text(&out.stderr).ends_with(" passed, 0 failed\n"));
    let again = highwater(&["check-stream", "--normalize"], Some(&normalized));
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert_eq!(text(&again.stdout), normalized, "normalizing is idempotent");
}

#[test]
fn missing_file_is_an_error() {
    let out = highwater(&["check-stream", "/nonexistent/stream.jsonl"], None);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("cannot open /nonexistent/stream.jsonl"));
}

/// The frame that stopped a Zero 1.9 view-syncer (`Unsupported default value … now()`) passes
/// the any-version check and fails as v6 downstream traffic, like the batch and ack frames a
/// v6 subscriber cannot take.
#[test]
fn protocol_and_direction_reject_what_a_v6_subscriber_would() {
    let input = concat!(
        r#"{"id":1,"msg":["data",{"tag":"add-column","table":{"schema":"public","name":"issue"},"column":{"name":"updated","spec":{"pos":3,"dataType":"timestamptz","dflt":"now()"}},"backfill":{"attNum":3}}]}"#,
        "\n",
        r#"{"id":2,"batch":[["rollback",{"tag":"rollback"}]]}"#,
        "\n",
        r#"{"ack":1}"#,
        "\n",
        r#"{"id":3,"msg":["rollback",{"tag":"rollback"}]}"#,
        "\n",
    );
    let any = highwater(&["check-stream"], Some(input));
    assert!(any.status.success(), "{}", text(&any.stdout));
    let v6 = highwater(
        &[
            "check-stream",
            "--protocol",
            "6",
            "--direction",
            "downstream",
        ],
        Some(input),
    );
    assert!(!v6.status.success());
    let stdout = text(&v6.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{stdout}");
    assert!(
        lines[0].starts_with("line 1: not valid v6 downstream traffic: add-column issue.updated: Unsupported default value: now()"),
        "{stdout}"
    );
    assert!(lines[1].starts_with("line 2: "), "{stdout}");
    assert!(lines[2].starts_with("line 3: "), "{stdout}");
    assert_eq!(lines[3], "1 passed, 3 failed");
    for bad in [
        &["check-stream", "--protocol", "6"][..],
        &["check-stream", "--direction", "upstream"][..],
        &["check-stream", "--protocol", "9", "--direction", "upstream"][..],
    ] {
        let out = highwater(bad, Some(""));
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {}", text(&out.stderr));
    }
}
