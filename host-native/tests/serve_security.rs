//! `highwater serve` safe defaults, run as a real process: no listening beyond loopback without
//! a replication token unless the operator opts out, and then a warning.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Output};

use highwater_host::serve::REPLICATION_TOKEN_ENV;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "highwater-serve-security-{}-{name}",
        std::process::id()
    ))
}

/// `serve` against a Postgres address where nothing listens, so it stops at its first step.
fn serve(data: &PathBuf, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_highwater"))
        .arg("serve")
        .args(["--upstream", "postgres://nobody@127.0.0.1:9/none"])
        .arg("--data")
        .arg(data)
        .args(["--port", &free_port().to_string()])
        .args(extra)
        .env_remove(REPLICATION_TOKEN_ENV)
        .env("NO_COLOR", "1")
        .output()
        .expect("highwater runs")
}

#[test]
fn a_non_loopback_address_without_a_token_is_refused_before_any_work() {
    let data = scratch("refused");
    for host in ["0.0.0.0", "::"] {
        let output = serve(&data, &["--host", host]);
        assert!(!output.status.success(), "{host}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("refusing to listen on"), "{stderr}");
        assert!(stderr.contains("--replication-token-file"), "{stderr}");
        assert!(stderr.contains("--insecure-no-auth"), "{stderr}");
        assert!(
            !stderr.contains("connecting to server"),
            "no upstream work: {stderr}"
        );
        assert!(!data.exists(), "nothing written");
    }
}

#[test]
fn insecure_no_auth_goes_on_with_a_warning_and_a_token_needs_no_opt_out() {
    let data = scratch("opted-out");
    let output = serve(&data, &["--host", "0.0.0.0", "--insecure-no-auth"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("--insecure-no-auth: anyone who can reach this address")
            || stderr.contains("--insecure-no-auth: anyone who can reach this address"),
        "{stdout}{stderr}"
    );
    // It went on to Postgres, which is not there.
    assert!(stderr.contains("Could not connect to Postgres"), "{stderr}");

    let token_file = scratch("token");
    std::fs::write(&token_file, "a-replication-token-0123456789\n").expect("token file");
    let output = serve(
        &data,
        &[
            "--host",
            "0.0.0.0",
            "--replication-token-file",
            token_file.to_str().expect("utf-8"),
        ],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("Could not connect to Postgres"), "{stderr}");
    assert!(
        !stderr.contains("a-replication-token"),
        "the token is never printed"
    );
    let _ = std::fs::remove_file(&token_file);
    let _ = std::fs::remove_dir_all(&data);
}

#[test]
fn the_default_host_is_loopback() {
    let data = scratch("default");
    let output = serve(&data, &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!stderr.contains("refusing to listen"), "{stderr}");
    assert!(stderr.contains("Could not connect to Postgres"), "{stderr}");
    let _ = std::fs::remove_dir_all(&data);
}

#[test]
fn tls_needs_both_files_and_refuses_unreadable_ones_before_any_work() {
    let data = scratch("tls");
    let output = serve(&data, &["--tls-cert", "/nonexistent/cert.pem"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--tls-key"), "{stderr}");
    let output = serve(
        &data,
        &[
            "--tls-cert",
            "/nonexistent/cert.pem",
            "--tls-key",
            "/nonexistent/key.pem",
        ],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("cannot use the TLS certificate /nonexistent/cert.pem"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("connecting to server"),
        "no upstream work: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&data);
}

#[test]
fn a_second_process_on_a_data_directory_in_use_is_refused_before_any_work() {
    let data = scratch("in-use");
    // This test process holds the directory, as a running server would.
    let held = highwater_host::data_lock::DataDirLock::acquire(&data).expect("lock");
    let expected = format!(
        "another highwater process (pid {}) is using the data directory",
        std::process::id()
    );
    let output = serve(&data, &[]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&expected), "{stderr}");
    assert!(
        !stderr.contains("Could not connect to Postgres"),
        "no upstream work: {stderr}"
    );
    let output = Command::new(env!("CARGO_BIN_EXE_highwater"))
        .arg("replicate")
        .args(["--upstream", "postgres://nobody@127.0.0.1:9/none"])
        .arg("--data")
        .arg(&data)
        .env("NO_COLOR", "1")
        .output()
        .expect("highwater runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(&expected), "{stderr}");
    // Once the holder is gone, a server goes on (to Postgres, which is not there).
    drop(held);
    let output = serve(&data, &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("Could not connect to Postgres"), "{stderr}");
    let _ = std::fs::remove_dir_all(&data);
}
