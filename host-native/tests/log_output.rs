//! What `highwater` writes to a stderr that is not a terminal (a log file, a pipe, journald):
//! plain text, no terminal colour codes; or with `--log-format json`, one JSON object a line.

use std::process::{Command, Output, Stdio};

/// `highwater serve` with a warning at start (--insecure-no-auth on a wildcard address) and
/// an `upstream` that refuses the connection, which ends the process at once. `env` sets
/// (`Some`) or removes (`None`) variables; `RUST_LOG` is always removed.
fn serve_to_a_refused_upstream(name: &str, upstream: &str, env: &[(&str, Option<&str>)]) -> Output {
    let data = std::env::temp_dir().join(format!("highwater-log-{name}-{}", std::process::id()));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut command = Command::new(env!("CARGO_BIN_EXE_highwater"));
    command
        .args(["serve", "--upstream", upstream])
        .arg("--data")
        .arg(&data)
        .args(["--host", "0.0.0.0", "--insecure-no-auth"])
        .args(["--port", &port.to_string()])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    let output = command.output().expect("run highwater serve");
    let _ = std::fs::remove_dir_all(&data);
    output
}

#[test]
fn logs_to_a_pipe_carry_no_terminal_colour_codes() {
    let output = serve_to_a_refused_upstream(
        "output",
        "postgres://postgres@127.0.0.1:1/postgres",
        &[("NO_COLOR", None)],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "expected the refused upstream to end it: {stderr}"
    );
    assert!(
        stderr.contains("WARN") && stderr.contains("--insecure-no-auth"),
        "expected the start warning in the log, got: {stderr}"
    );
    assert!(
        !stderr.contains('\u{1b}'),
        "expected plain text on a pipe, found terminal escape codes: {stderr:?}"
    );
}

#[test]
fn json_logs_are_one_object_a_line_to_the_last_and_hold_no_secret() {
    let password = "pw-that-must-not-be-logged";
    let secret = "a sync secret that must never be logged, 32+ bytes";
    let output = serve_to_a_refused_upstream(
        "json",
        &format!("postgres://postgres:{password}@127.0.0.1:1/postgres"),
        &[
            ("HIGHWATER_LOG_FORMAT", Some("json")),
            ("HIGHWATER_SYNC_SECRET", Some(secret)),
        ],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "the refused upstream ends it: {stderr}"
    );
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"))
        })
        .collect();
    for line in &lines {
        for key in ["timestamp", "level", "target", "message"] {
            assert!(line.get(key).is_some(), "{key} missing in {line}");
        }
    }
    assert!(
        lines.iter().any(|l| l["level"] == "WARN"
            && l["message"]
                .as_str()
                .is_some_and(|m| m.contains("--insecure-no-auth"))),
        "the start warning: {stderr}"
    );
    let last = lines.last().expect("a line");
    assert_eq!(last["level"], "ERROR", "{stderr}");
    assert!(
        last["error"]
            .as_str()
            .is_some_and(|e| e.contains("Could not connect to Postgres")),
        "the reason it stopped: {last}"
    );
    assert!(
        !stderr.contains(password) && !stderr.contains(secret),
        "a secret reached the log: {stderr}"
    );
}
