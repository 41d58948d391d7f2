//! What `highwater` writes to a stderr that is not a terminal (a log file, a pipe, journald):
//! plain text, no terminal colour codes.

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
