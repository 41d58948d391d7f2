//! `highwater token` run as a real process: its output verifies with the same secret.

use std::path::PathBuf;
use std::process::{Command, Output};

use highwater_engine::scope_sync::rules::SyncRules;
use highwater_host::sync_auth::{unix_now_ms, SyncAuth, SyncSecret, SYNC_SECRET_ENV};
use serde_json::{json, Map, Value};

const SECRET: &str = "a development secret of more than 32 bytes";
const RULES: &str = r#"{"tables":{"todos":{"filterColumns":["owner","org"],"require":{"owner":"sub","org":"org"}}}}"#;

fn highwater(args: &[&str], env_secret: Option<&str>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_highwater"));
    command.args(args).env_remove(SYNC_SECRET_ENV);
    if let Some(secret) = env_secret {
        command.env(SYNC_SECRET_ENV, secret);
    }
    command.output().expect("highwater runs")
}

fn token_of(output: &Output) -> String {
    assert!(
        output.status.success(),
        "highwater token failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout.clone()).expect("utf-8");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one line, the token: {stdout:?}");
    lines[0].to_owned()
}

fn sync_auth(secret: &str) -> SyncAuth {
    SyncAuth::new(
        SyncRules::from_json(RULES).expect("rules"),
        &SyncSecret::from_bytes(secret).expect("secret"),
    )
}

fn scope(owner: &str, org: &str) -> Map<String, Value> {
    match json!({"owner": owner, "org": org}) {
        Value::Object(map) => map,
        _ => unreachable!("an object literal"),
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("highwater-token-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[test]
fn a_token_from_the_environment_secret_verifies_and_grants_its_scope() {
    let output = highwater(
        &[
            "token", "--sub", "ada", "--ttl", "2h", "--claim", "org=acme",
        ],
        Some(SECRET),
    );
    let token = token_of(&output);
    let now = unix_now_ms();
    let auth = sync_auth(SECRET);
    let verified = auth.verify(&token, now).expect("verifies");
    assert_eq!(verified.claims["sub"], json!("ada"));
    assert_eq!(verified.claims["org"], json!("acme"));
    let iat = verified.claims["iat"].as_u64().expect("iat");
    let exp = verified.claims["exp"].as_u64().expect("exp");
    assert_eq!(exp - iat, 7200);
    assert!(iat.abs_diff(now / 1000) < 60, "iat is now");
    let grant = auth
        .authorize(Some(&token), "todos", &scope("ada", "acme"), now)
        .expect("granted");
    assert_eq!(grant.table, "todos");
    assert_eq!(
        auth.authorize(Some(&token), "todos", &scope("grace", "acme"), now)
            .expect_err("other owner")
            .code,
        "forbidden"
    );
    assert_eq!(
        auth.authorize(
            Some(&token),
            "todos",
            &scope("ada", "acme"),
            now + 3 * 3_600_000
        )
        .expect_err("past its ttl")
        .code,
        "auth-expired"
    );
    let other = sync_auth("another secret, also more than 32 bytes");
    assert_eq!(
        other.verify(&token, now).expect_err("wrong secret").code,
        "auth-invalid"
    );
}

#[test]
fn the_secret_file_takes_precedence_over_the_environment() {
    let dir = scratch("file");
    let file = dir.join("sync-secret");
    std::fs::write(&file, format!("{SECRET}\n")).expect("write secret");
    let path = file.to_str().expect("utf-8 path");
    let output = highwater(
        &["token", "--sub", "ada", "--sync-secret-file", path],
        Some("an environment secret that must not be used here"),
    );
    let token = token_of(&output);
    let verified = sync_auth(SECRET)
        .verify(&token, unix_now_ms())
        .expect("verifies");
    let exp = verified.claims["exp"].as_u64().expect("exp");
    let iat = verified.claims["iat"].as_u64().expect("iat");
    assert_eq!(exp - iat, 3600, "the default ttl is one hour");
    std::fs::remove_dir_all(&dir).expect("clean up");
}

#[test]
fn without_a_secret_the_command_fails_with_a_clear_message() {
    let output = highwater(&["token", "--sub", "ada"], None);
    assert!(!output.status.success());
    assert!(output.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(SYNC_SECRET_ENV), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let short = highwater(&["token", "--sub", "ada"], Some("short"));
    assert!(!short.status.success());
    let stderr = String::from_utf8_lossy(&short.stderr);
    assert!(stderr.contains("at least 32 bytes"), "{stderr}");
    assert!(
        !stderr.contains("short\n"),
        "the secret is not echoed: {stderr}"
    );
}

#[test]
fn the_secret_is_not_accepted_as_an_argument_value() {
    let output = highwater(&["token", "--sub", "ada", "--sync-secret", SECRET], None);
    assert!(!output.status.success());
    assert!(output.stdout.is_empty());
    let bad_ttl = highwater(&["token", "--sub", "ada", "--ttl", "forever"], Some(SECRET));
    assert!(!bad_ttl.status.success());
    assert!(
        String::from_utf8_lossy(&bad_ttl.stderr).contains("expected a number with s, m, h or d")
    );
}
