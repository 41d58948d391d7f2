//! A relay following an `https`/`wss` primary (`serve --from https://…`): the primary serves
//! with a certificate from a CA the test makes, the relay trusts that CA (`--from-ca-file`) and
//! sends its token; it restores the snapshot over https, follows the change stream over wss and
//! ends equal to Postgres. With another CA, or a snapshot over `--max-snapshot-bytes`, the
//! relay says why and stores nothing.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use highwater_host::serve::{serve, ReplicationToken, ServeArgs, UPSTREAM_TOKEN_ENV};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::serve_support::*;

const PRIMARY_TOKEN: &str = "tls-primary-token-0123456789";

/// Writes a CA (`ca.pem`) and a `localhost` certificate it signed (`server.crt`, `server.key`)
/// into `dir`.
fn make_certs(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        format!("highwater test CA {}", dir.display()),
    );
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let paths = (
        dir.join("ca.pem"),
        dir.join("server.crt"),
        dir.join("server.key"),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

/// `GET path` over https, trusting `ca`: the status line.
async fn https_status(port: u16, ca: &Path, path: &str) -> std::io::Result<String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await?;
    tls.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut raw = Vec::new();
    // Some peers end without close_notify; what arrived is enough for the status line.
    let _ = tls.read_to_end(&mut raw).await;
    Ok(String::from_utf8_lossy(&raw)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned())
}

/// The primary, serving https and wss with `cert`, requiring [`PRIMARY_TOKEN`].
struct Primary {
    port: u16,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<Result<(), highwater_host::serve::ServeError>>,
}

impl Primary {
    async fn start(pg_url: &str, data: &Path, cert: &Path, key: &Path, ca: &Path) -> Primary {
        let port = free_port();
        let mut args = serve_args(pg_url, data, port);
        args.security.tls_cert = Some(cert.to_owned());
        args.security.tls_key = Some(key.to_owned());
        args.security.replication_token = Some(ReplicationToken::new(PRIMARY_TOKEN).unwrap());
        // The certificate names localhost: reservations must point there.
        args.public_url = Some(format!("https://localhost:{port}"));
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(serve(args, stop_rx));
        let deadline = tokio::time::Instant::now() + PROMPT;
        while !https_status(port, ca, "/health")
            .await
            .is_ok_and(|s| s.contains("200"))
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the primary did not serve https"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Primary { port, stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        tokio::time::timeout(PROMPT, self.task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

fn sqlite_items(path: &Path) -> BTreeMap<i64, Value> {
    let Ok(db) =
        rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return BTreeMap::new();
    };
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    let Ok(mut stmt) = db.prepare("SELECT id, v FROM items ORDER BY id") else {
        return BTreeMap::new();
    };
    let rows = stmt
        .query_map([], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, Option<String>>(1)?))
        })
        .unwrap()
        .map(|r| {
            let (id, v) = r.unwrap();
            (id, serde_json::json!({"id": id, "v": v}))
        })
        .collect();
    rows
}

async fn replica_reaches(data: &Path, expected: &BTreeMap<i64, Value>) {
    let deadline = tokio::time::Instant::now() + PROMPT;
    while &sqlite_items(&data.join("replica.db")) != expected {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica in {} did not converge",
            data.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn insert(client: &tokio_postgres::Client, ids: std::ops::Range<i64>) {
    for id in ids {
        client
            .execute(
                "INSERT INTO items VALUES ($1, $2)",
                &[&id, &format!("v{id}")],
            )
            .await
            .unwrap();
    }
}

/// The `highwater` binary as a relay of `from` with `extra` options; returns the first stderr
/// line that contains `expected` (within [`PROMPT`]), and stops the relay by its pid.
fn relay_binary_says(from: &str, data: &Path, extra: &[&str], expected: &str) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_highwater"))
        .arg("serve")
        .args(["--from", from, "--host", "127.0.0.1"])
        .args(["--port", &free_port().to_string()])
        .arg("--data")
        .arg(data)
        .args(extra)
        .env(UPSTREAM_TOKEN_ENV, PRIMARY_TOKEN)
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + PROMPT;
    let mut seen = Vec::new();
    let found = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(expected) => break Some(line),
            Ok(line) => seen.push(line),
            Err(_) => break None,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    found.unwrap_or_else(|| panic!("expected a line with {expected:?}, got {seen:#?}"))
}

/// Nothing of a replica (or a partial download of one) is in `data`.
fn nothing_stored(data: &Path) {
    for name in ["replica.db", "replica.db.restore"] {
        assert!(
            !data.join(name).exists(),
            "{name} exists in {}",
            data.display()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_follows_an_https_primary_it_trusts_and_refuses_one_it_does_not() {
    let pg = start_pg().await;
    let client = pg.connect().await.unwrap();
    client.batch_execute(ITEMS_DDL).await.unwrap();
    insert(&client, 0..20).await;
    let tls_dir = DataDir::new("relay-tls-certs");
    let (ca, cert, key) = make_certs(tls_dir.path());
    let (other_ca, _, _) = make_certs(&tls_dir.path().join("other"));
    let primary_data = DataDir::new("relay-tls-primary");
    let primary = Primary::start(&pg.url(), primary_data.path(), &cert, &key, &ca).await;
    insert(&client, 20..30).await;
    let from = format!("https://localhost:{}", primary.port);

    // Trusting the primary's CA and sending its token: restored over https, then live over
    // wss, equal to Postgres.
    let relay_data = DataDir::new("relay-tls-relay");
    let mut args = ServeArgs::relay(from.clone(), relay_data.path());
    args.port = free_port();
    args.host = "127.0.0.1".to_owned();
    args.security.upstream_token = Some(ReplicationToken::new(PRIMARY_TOKEN).unwrap());
    args.security.from_ca_file = Some(ca.clone());
    let relay = InProcess::start(args).await;
    replica_reaches(relay_data.path(), &pg_items(&client).await).await;
    insert(&client, 30..50).await;
    replica_reaches(relay_data.path(), &pg_items(&client).await).await;
    relay.stop().await;

    // Another CA: the TLS handshake fails, clearly, and nothing is stored.
    let untrusting = DataDir::new("relay-tls-wrong-ca");
    let line = relay_binary_says(
        &from,
        untrusting.path(),
        &["--from-ca-file", other_ca.to_str().unwrap()],
        "restore failed",
    );
    assert!(line.contains("TLS handshake failed"), "{line}");
    assert!(line.to_lowercase().contains("issuer"), "{line}");
    nothing_stored(untrusting.path());

    // A snapshot over --max-snapshot-bytes is refused before it is stored.
    let capped = DataDir::new("relay-tls-capped");
    let line = relay_binary_says(
        &from,
        capped.path(),
        &[
            "--from-ca-file",
            ca.to_str().unwrap(),
            "--max-snapshot-bytes",
            "4096",
        ],
        "restore failed",
    );
    assert!(
        line.contains("expected at most 4096 bytes (--max-snapshot-bytes)"),
        "{line}"
    );
    nothing_stored(capped.path());

    // The primary served throughout; a relay without its token gets 401 on the snapshot.
    let status = https_status(primary.port, &ca, "/replica/snapshot")
        .await
        .unwrap();
    assert!(status.contains("401"), "{status}");
    primary.stop().await;
}
