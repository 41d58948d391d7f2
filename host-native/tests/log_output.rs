//! What `highwater` writes to a stderr that is not a terminal (a log file, a pipe, journald):
//! plain text, no terminal colour codes; or with `--log-format json`, one JSON object a line.

use std::process::{Command, Stdio};

#[test]
fn logs_to_a_pipe_carry_no_terminal_colour_codes() {
    let data = std::env::temp_dir().join(format!("highwater-log-output-{}", std::process::id()));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    // A warning at start (--insecure-no-auth on a wildcard address), then a refused upstream
    // ends the process at once.
    let output = Command::new(env!("CARGO_BIN_EXE_highwater"))
        .args([
            "serve",
            "--upstream",
            "postgres://postgres@127.0.0.1:1/postgres",
        ])
        .arg("--data")
        .arg(&data)
        .args(["--host", "0.0.0.0", "--insecure-no-auth"])
        .args(["--port", &port.to_string()])
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run highwater serve");
    let _ = std::fs::remove_dir_all(&data);
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
    let data = std::env::temp_dir().join(format!("highwater-log-json-{}", std::process::id()));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let password = "pw-that-must-not-be-logged";
    let secret = "a sync secret that must never be logged, 32+ bytes";
    let output = Command::new(env!("CARGO_BIN_EXE_highwater"))
        .args(["serve", "--upstream"])
        .arg(format!(
            "postgres://postgres:{password}@127.0.0.1:1/postgres"
        ))
        .arg("--data")
        .arg(&data)
        .args(["--host", "0.0.0.0", "--insecure-no-auth"])
        .args(["--port", &port.to_string()])
        .env("HIGHWATER_LOG_FORMAT", "json")
        .env("HIGHWATER_SYNC_SECRET", secret)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run highwater serve");
    let _ = std::fs::remove_dir_all(&data);
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
