//! `highwater serve --from ws://host:port`: a relay. Many serving nodes share one replication
//! slot by following another Highwater instead of Postgres.
//!
//! ```text
//!  primary ──/replication/v8/subscribe──▶ relay source ──SourceEvent──▶ ingest (as for Postgres)
//!     ▲  reserve-snapshot → reserved → GET backupURL → start-subscription   │ replica + change log
//!     └──────────── {ack:n} once every transaction of frame n is durable ◀──┘
//! ```
//!
//! A fresh relay restores the primary's snapshot (its `/replica/snapshot`) and seeds its own
//! change log at the snapshot's watermark; a relay with a valid replica subscribes straight
//! from its stored watermark. From there it is a server like any other: the same storage loop,
//! the same endpoints, its own snapshots, so relays chain. When the primary answers
//! `WrongReplicaVersion` or `WatermarkTooOld`, the replica cannot follow it any more: the relay
//! stops serving, wipes it and restores a new snapshot.

mod restore;
mod upstream;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use highwater_engine::change_stream::{AckError, DecodeError, MAX_PROTOCOL_VERSION};
use tokio::sync::watch;

use super::{owner_address, run_server, ServeArgs, ServeError};
use crate::change_log::{self, ChangeLogConfig, ChangeLogError, ChangeLogStatus};
use crate::replica::{Replica, ReplicaError, ReplicaWriter};
use upstream::{SubscribeTarget, UpstreamConnection};

/// The relay's replica, as in every data directory.
const REPLICA_FILE: &str = "replica.db";

/// This node's random id, made once per data directory: part of the relay's task id.
const NODE_ID_FILE: &str = "node-id";

/// The protocol the relay speaks to its primary: `/subscribe` with backfill tracking.
const SUBSCRIBE_VERSION: u32 = 8;

/// Longest wait between reconnects (Zero's change-streamer uses the same bound).
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(10);
pub(super) const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// Why following the primary failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("cannot connect to the primary at {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("the connection to the primary failed: {0}")]
    Socket(#[from] tokio_tungstenite::tungstenite::Error),
    #[error(
        "expected a change-stream frame from the primary, found one that does not decode: {0}"
    )]
    Frame(#[from] DecodeError),
    #[error("the primary acknowledged out of order: {0}")]
    Ack(#[from] AckError),
    #[error("expected {expected} from the primary, found {found}")]
    Protocol { expected: String, found: String },
    #[error("the primary closed the connection during {during}{}", close.as_deref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Closed {
        during: &'static str,
        close: Option<String>,
    },
    #[error("the primary refused: {0}")]
    Rejected(String),
    #[error("cannot download the snapshot {url}: {reason}")]
    Download { url: String, reason: String },
    #[error("expected {expected} in the downloaded snapshot, found {found}")]
    Snapshot { expected: String, found: String },
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error(transparent)]
    ChangeLog(#[from] ChangeLogError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("a relay task failed: {0}")]
    Task(String),
}

/// The subscribe URL for `from` (`ws://host:port`, `host:port`, or an `http(s)://` base).
fn subscribe_url(from: &str, task_id: &str) -> String {
    let from = from.trim_end_matches('/');
    let base = if let Some(rest) = from.strip_prefix("http://") {
        format!("ws://{rest}")
    } else if let Some(rest) = from.strip_prefix("https://") {
        format!("wss://{rest}")
    } else if from.contains("://") {
        from.to_owned()
    } else {
        format!("ws://{from}")
    };
    let task: String = task_id
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    format!("{base}/replication/v{SUBSCRIBE_VERSION}/subscribe?taskID={task}")
}

/// The primary's subscribe URL and the token it requires.
#[derive(Debug, Clone)]
pub(super) struct Upstream {
    /// `ws://host:port/replication/v8/subscribe?taskID=…`.
    pub url: String,
    pub token: Option<super::ReplicationToken>,
    /// TLS trust and snapshot-download bounds.
    pub client: super::snapshot_download::PeerClient,
}

/// A replica ready to stream into, and the socket of its fresh restore, if there was one.
struct Prepared {
    writer: ReplicaWriter,
    log: ChangeLogStatus,
    publications: Vec<String>,
    handover: Option<UpstreamConnection>,
}

/// Serves as a relay of `from` until `stop`.
pub(super) async fn serve(
    args: ServeArgs,
    from: String,
    required: Option<super::ReplicationToken>,
    sync: Option<Arc<crate::sync_auth::SyncAuth>>,
    stop: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let public_url = args.public_url();
    let node = {
        let data = args.data.clone();
        tokio::task::spawn_blocking(move || node_id(&data))
            .await
            .map_err(|e| ServeError::Task(e.to_string()))??
    };
    // The node id keeps two relays that advertise the same address (both defaulting to
    // 127.0.0.1:<port>) from taking over each other's reservations.
    let task_id = format!(
        "{}-relay-{node}@{}",
        args.app_id,
        owner_address(&public_url)
    );
    let url = subscribe_url(&from, &task_id);
    let upstream = Upstream {
        url: url.clone(),
        token: args.security.upstream_token()?,
        client: args.security.peer_client(&from)?,
    };
    loop {
        let Some(prepared) = prepare(&args.data, &upstream, &task_id, stop.clone()).await? else {
            return Ok(());
        };
        let listener = super::listen(&args, required.as_ref()).await?;
        let restore_required = Arc::new(AtomicBool::new(false));
        let source = upstream::spawn(
            SubscribeTarget {
                upstream: upstream.clone(),
                task_id: task_id.clone(),
                replica_version: prepared.log.replica_version.clone(),
                replica_path: args.data.join(REPLICA_FILE),
                liveness: super::PING_INTERVAL + Duration::from_secs(3),
            },
            prepared.handover,
            restore_required.clone(),
            stop.clone(),
        );
        tracing::info!(
            address = %listener.local_addr()?,
            primary = %from,
            %public_url,
            max_protocol = MAX_PROTOCOL_VERSION,
            "serving as a relay"
        );
        let served = run_server(
            listener,
            prepared.writer,
            prepared.log,
            prepared.publications,
            source,
            super::settings(
                &args,
                required.clone(),
                sync.clone(),
                args.security.tls_config()?,
            ),
            stop.clone(),
        )
        .await;
        if !restore_required.load(Ordering::SeqCst) || *stop.borrow() {
            return served;
        }
        tracing::warn!("the primary rejected the replica: wiping it and restoring a new snapshot");
        let data = args.data.clone();
        tokio::task::spawn_blocking(move || Replica::remove_in_dir(&data))
            .await
            .map_err(|e| ServeError::Task(e.to_string()))??;
    }
}

/// Opens the replica, restoring it from the primary while it is missing or unusable (retrying
/// with backoff). `None` when stopped first.
async fn prepare(
    data: &Path,
    upstream: &Upstream,
    task_id: &str,
    mut stop: watch::Receiver<bool>,
) -> Result<Option<Prepared>, ServeError> {
    let mut backoff = crate::runtime::backoff(FIRST_BACKOFF, MAX_BACKOFF);
    let mut handover = None;
    loop {
        let opened = {
            let data = data.to_owned();
            tokio::task::spawn_blocking(move || open(&data))
                .await
                .map_err(|e| ServeError::Task(e.to_string()))??
        };
        if let Some((writer, log, publications)) = opened {
            tracing::info!(
                replica_version = %log.replica_version,
                watermark = %log.last_watermark,
                min_watermark = %log.min_watermark,
                "relay replica and change log ready"
            );
            return Ok(Some(Prepared {
                writer,
                log,
                publications,
                handover,
            }));
        }
        if let Some(conn) = handover.take() {
            // Restored a moment ago and still unusable: not something a retry fixes.
            UpstreamConnection::close(conn).await;
            return Err(ServeError::Invariant {
                expected: "a usable replica after a restore".to_owned(),
                found: "one that cannot be opened with its change log".to_owned(),
            });
        }
        tracing::info!(primary = %upstream.url, "no usable replica: restoring the primary's snapshot");
        let restored = tokio::select! {
            _ = stop.wait_for(|s| *s) => return Ok(None),
            restored = restore::restore(upstream, task_id, data) => restored,
        };
        match restored {
            Ok(restored) => {
                tracing::debug!(watermark = %restored.watermark, "restore complete");
                handover = Some(restored.upstream);
            }
            Err(error) => {
                let delay = crate::runtime::next_delay(&mut backoff);
                tracing::warn!(%error, retry_in_ms = delay.as_millis() as u64, "restore failed; retrying");
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => return Ok(None),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// This data directory's node id (16 hex digits), created on first use. Blocking.
fn node_id(data: &Path) -> Result<String, ServeError> {
    use std::hash::{BuildHasher, Hasher};
    std::fs::create_dir_all(data)?;
    let path = data.join(NODE_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text)
            if text.trim().len() == 16 && text.trim().bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            return Ok(text.trim().to_owned())
        }
        Ok(_) | Err(_) => {}
    }
    // Unique, not secret: std seeds each RandomState from the operating system's randomness.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.write_u32(std::process::id());
    let id = format!("{:016x}", hasher.finish());
    let temp = data.join(format!("{NODE_ID_FILE}.tmp"));
    std::fs::write(&temp, format!("{id}\n"))?;
    std::fs::rename(&temp, &path)?;
    Ok(id)
}

/// The replica and its change log, if both are there and belong together. Blocking.
fn open(data: &Path) -> Result<Option<(ReplicaWriter, ChangeLogStatus, Vec<String>)>, ServeError> {
    std::fs::create_dir_all(data)?;
    let _ = std::fs::remove_file(data.join(restore::RESTORE_FILE));
    if !data.join(REPLICA_FILE).exists() {
        // A WAL without its database belongs to no database: it must not meet a new one.
        Replica::remove_in_dir(data)?;
        return Ok(None);
    }
    let replica = Replica::open_in_dir(data)?;
    let Some(state) = replica.state().cloned() else {
        return Ok(None);
    };
    let config = ChangeLogConfig {
        replica_version: state.replica_version.clone(),
        publications: state.publications.clone(),
    };
    match change_log::ensure(replica.connection(), &config, &state.watermark) {
        Ok(log) => Ok(Some((ReplicaWriter::new(replica), log, state.publications))),
        Err(ChangeLogError::ResetRequired { reason }) => {
            tracing::warn!(%reason, "the replica cannot be served");
            Ok(None)
        }
        Err(error) => Err(error.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscribe_urls_accept_the_forms_zero_accepts() {
        let path = "/replication/v8/subscribe?taskID=app-relay%40127.0.0.1%3A4850";
        for from in [
            "ws://primary:4848",
            "ws://primary:4848/",
            "primary:4848",
            "http://primary:4848",
        ] {
            assert_eq!(
                subscribe_url(from, "app-relay@127.0.0.1:4850"),
                format!("ws://primary:4848{path}"),
                "{from}"
            );
        }
        assert_eq!(
            subscribe_url("https://primary", "t"),
            "wss://primary/replication/v8/subscribe?taskID=t"
        );
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn from_and_upstream_exclude_each_other_and_one_is_required() {
        use clap::error::ErrorKind;
        use clap::Parser;
        let parse = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
                .map(|cli| cli.serve)
                .map_err(|e| e.kind())
        };
        let relay = parse(&["--from", "ws://primary:4848", "--data", "d"]).expect("a relay");
        assert_eq!(relay.from.as_deref(), Some("ws://primary:4848"));
        assert_eq!(relay.upstream, "");
        let primary =
            parse(&["--upstream", "postgres://u@h/db", "--data", "d"]).expect("a primary");
        assert_eq!(
            (primary.upstream.as_str(), primary.from),
            ("postgres://u@h/db", None)
        );
        assert_eq!(
            parse(&["--data", "d"]).err(),
            Some(ErrorKind::MissingRequiredArgument)
        );
        assert_eq!(
            parse(&[
                "--upstream",
                "postgres://u@h/db",
                "--from",
                "ws://p",
                "--data",
                "d"
            ])
            .err(),
            Some(ErrorKind::ArgumentConflict)
        );
    }

    #[test]
    fn a_node_id_is_made_once_per_data_directory() {
        let base = std::env::temp_dir().join(format!("highwater-node-id-{}", std::process::id()));
        let (one, two) = (base.join("one"), base.join("two"));
        let first = node_id(&one).expect("made");
        assert_eq!(first.len(), 16);
        assert_eq!(
            node_id(&one).expect("read back"),
            first,
            "stable across restarts"
        );
        assert_ne!(node_id(&two).expect("made"), first, "unique per node");
        std::fs::write(one.join(NODE_ID_FILE), "garbage").expect("write");
        assert_ne!(node_id(&one).expect("remade"), "garbage");
        std::fs::remove_dir_all(&base).expect("clean up");
    }
}
