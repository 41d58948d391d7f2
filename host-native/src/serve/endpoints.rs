//! HTTP routes: the change-stream WebSockets `/replication/v<N>/{changes,snapshot,subscribe}`
//! (`docs/protocol/change-stream.md`, "Endpoints"), `GET /replica/snapshot`, `GET /metrics`,
//! and health checks (`/`, `/keepalive`, `/health`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use highwater_engine::change_stream::{
    check_protocol_version, close_reason, Endpoint, Extra, SubscribeContext, SubscriberMode,
    PROTOCOL_ERROR_CLOSE_CODE,
};
use highwater_engine::streamer::{ConnId, Effect, Streamer};
use highwater_engine::watermark::Watermark;
use serde_json::json;

use super::change_stream::connection;
use super::change_stream::Hub;
use super::{scope_sync, snapshot};

/// Where a consistent copy of the replica is served (the reservations' `backupURL`).
pub const SNAPSHOT_PATH: &str = "/replica/snapshot";

#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) hub: Arc<Hub>,
    pub snapshots: Arc<snapshot::Snapshots>,
    pub(crate) ping_interval: Duration,
    /// Open WebSocket connections, bounded.
    pub(crate) connection_slots: ConnectionSlots,
    /// Scope sync, when `--sync-rules` turned it on.
    pub sync: Option<Arc<scope_sync::SyncHub>>,
    pub(crate) peer_auth: super::security::PeerAuth,
    pub(crate) insecure_no_auth: bool,
    /// The upstream slot's retained WAL, when watched (not on a relay).
    pub wal: Option<Arc<super::wal_watch::WalHealth>>,
    /// Every metric, for `GET /metrics`.
    pub metrics: Arc<prometheus_client::registry::Registry>,
}

impl axum::extract::FromRef<AppState> for Arc<prometheus_client::registry::Registry> {
    fn from_ref(state: &AppState) -> Self {
        state.metrics.clone()
    }
}

pub(crate) fn router(state: AppState) -> Router {
    // Server-to-server endpoints: the replication token is checked before any upgrade.
    let peers = Router::new()
        .route("/replication/{version}/{endpoint}", get(replication))
        .route(SNAPSHOT_PATH, get(replica_snapshot))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(
            state.peer_auth.clone(),
            super::security::require_token,
        ));
    Router::new()
        .route("/", get(ok))
        .route("/keepalive", get(ok))
        .route("/health", get(health))
        .merge(peers)
        .route("/sync", get(scope_sync))
        .with_state(state)
}

async fn ok() -> &'static str {
    "OK"
}

/// `GET /metrics`, on the main port (behind the replication token) and on `--metrics-addr`.
pub(crate) async fn metrics(
    State(registry): State<Arc<prometheus_client::registry::Registry>>,
) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(super::metrics::CONTENT_TYPE),
        )],
        super::metrics::render(&registry),
    )
        .into_response()
}

/// The router of `--metrics-addr`: `/metrics` alone, without a token.
pub(crate) fn metrics_router(registry: Arc<prometheus_client::registry::Registry>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(registry)
}

async fn health(State(state): State<AppState>) -> Json<serde_json::Value> {
    let positions = state.hub.positions();
    let (store_commits, stored_transactions) = state.hub.store_counts();
    // Degraded, not down: the server still serves; an operator must act before the slot does
    // harm upstream.
    let degraded: Vec<String> = state.wal.iter().filter_map(|wal| wal.degraded()).collect();
    Json(json!({
        "status": if degraded.is_empty() { "ok" } else { "degraded" },
        "degraded": degraded,
        "replicaVersion": positions.replica_version,
        "lastWatermark": positions.last_watermark,
        "minWatermark": positions.min_watermark,
        "connections": state.hub.connections(),
        "syncConnections": state.sync.as_ref().map(|sync| sync.connections()),
        "snapshotsBuilt": state.snapshots.built(),
        // A subscriber's full backlog holds up replication (back-pressure).
        "upstreamPaused": state.hub.inspect(|s| s.is_upstream_paused()),
        "insecureNoAuth": state.insecure_no_auth,
        // Group commit: how many upstream transactions share one sync of the replica's WAL
        // (`storeCommits` counts the syncs that made commits durable).
        "storeCommits": store_commits,
        "storedTransactions": stored_transactions,
    }))
}

/// The bound on open WebSocket connections: a slot is taken before the upgrade and given back
/// when the socket ends; with none free the request gets 503 and no socket.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionSlots {
    slots: Arc<tokio::sync::Semaphore>,
    max: usize,
}

impl ConnectionSlots {
    pub(crate) fn new(max: usize) -> ConnectionSlots {
        let max = max.min(tokio::sync::Semaphore::MAX_PERMITS);
        ConnectionSlots {
            slots: Arc::new(tokio::sync::Semaphore::new(max)),
            max,
        }
    }

    /// A slot for one more connection, or the refusal to answer with.
    fn take(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Box<Response>> {
        self.slots.clone().try_acquire_owned().map_err(|_| {
            tracing::warn!(
                max = self.max,
                "connection limit reached: refusing a WebSocket"
            );
            let message = format!(
                "expected at most {} open connections, and that many are open: try again later",
                self.max
            );
            Box::new(
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [(header::RETRY_AFTER, HeaderValue::from_static("5"))],
                    message,
                )
                    .into_response(),
            )
        })
    }
}

/// A change-stream request, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StreamRequest {
    /// `/changes` (v≤6): the subscription context comes from the query string.
    Changes {
        version: u32,
        ws_batched: bool,
        context: SubscribeContext,
    },
    /// `/snapshot` (legacy): the open socket is the task's reservation.
    Snapshot { version: u32, task_id: String },
    /// `/subscribe` (v7+): reservation and subscription arrive as control frames.
    Subscribe { version: u32 },
}

impl StreamRequest {
    /// Opens the stream of this request on `conn`.
    fn start(self, s: &mut Streamer, conn: ConnId, now: u64) -> Vec<Effect> {
        match self {
            StreamRequest::Changes {
                version,
                ws_batched,
                context,
            } => {
                s.open(conn, version, ws_batched);
                s.subscribe(conn, context, now)
            }
            StreamRequest::Snapshot { version, task_id } => {
                s.open(conn, version, false);
                s.reserve(conn, &task_id, now)
            }
            StreamRequest::Subscribe { version } => {
                s.open(conn, version, false);
                Vec::new()
            }
        }
    }
}

/// `v<digits>` → the requested version (saturating: any huge number is unsupported anyway).
fn parse_version(segment: &str) -> Option<u64> {
    let digits = segment.strip_prefix('v')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(digits.parse().unwrap_or(u64::MAX))
}

/// Validates a change-stream request; the error is the 1002 close reason.
pub(crate) fn parse_request(
    requested: u64,
    endpoint: Endpoint,
    query: &HashMap<String, String>,
) -> Result<StreamRequest, String> {
    let version = check_protocol_version(requested, endpoint).map_err(|e| e.close_reason())?;
    // An empty value counts as missing (change-stream.md, "Endpoints").
    let param = |name: &str| query.get(name).filter(|v| !v.is_empty());
    let required = |name: &str| {
        param(name)
            .cloned()
            .ok_or_else(|| close_reason(&format!("invalid querystring - missing {name}")))
    };
    let watermark = |name: &str| {
        let text = required(name)?;
        Watermark::parse(&text).map_err(|e| {
            close_reason(&format!(
                "invalid querystring - expected {name} to be a watermark, found {text:?}: {e}"
            ))
        })
    };
    match endpoint {
        Endpoint::Snapshot => match param("taskID") {
            Some(task_id) => Ok(StreamRequest::Snapshot {
                version,
                task_id: task_id.clone(),
            }),
            None => Err(close_reason("Missing taskID in snapshot request")),
        },
        Endpoint::Changes => {
            let id = required("id")?;
            let replica_version = watermark("replicaVersion")?;
            let watermark = watermark("watermark")?;
            let mode = match param("mode").map(String::as_str) {
                Some("backup") => SubscriberMode::Backup,
                _ => SubscriberMode::Serving,
            };
            Ok(StreamRequest::Changes {
                version,
                ws_batched: param("wsBatched").is_some_and(|v| v == "true"),
                context: SubscribeContext {
                    // Optional before canary; links the subscription to its reservation.
                    task_id: param("taskID").cloned().unwrap_or_default(),
                    id,
                    mode,
                    replica_version,
                    watermark,
                    backfills: None,
                    extra: Extra::new(),
                },
            })
        }
        Endpoint::Subscribe => Ok(StreamRequest::Subscribe { version }),
    }
}

async fn replication(
    State(state): State<AppState>,
    Path((version, endpoint)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let (Some(endpoint), Some(requested)) = (Endpoint::parse(&endpoint), parse_version(&version))
    else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let upgrade = match upgrade {
        Ok(upgrade) => upgrade,
        Err(rejection) => return rejection.into_response(),
    };
    let slot = match state.connection_slots.take() {
        Ok(slot) => slot,
        Err(refusal) => return *refusal,
    };
    let request = parse_request(requested, endpoint, &query);
    let upgrade = upgrade
        .max_message_size(connection::MAX_CLIENT_FRAME_BYTES)
        .max_frame_size(connection::MAX_CLIENT_FRAME_BYTES)
        .read_buffer_size(connection::READ_BUFFER_BYTES);
    upgrade.on_upgrade(move |socket| async move {
        let _slot = slot;
        match request {
            Err(reason) => {
                tracing::info!(%reason, "change-stream request rejected");
                connection::reject(socket, PROTOCOL_ERROR_CLOSE_CODE, reason).await;
            }
            Ok(request) => {
                let (conn, commands) = state.hub.connect();
                tracing::debug!(%conn, ?request, "change-stream connection");
                connection::run(
                    socket,
                    state.hub.clone(),
                    conn,
                    commands,
                    state.ping_interval,
                    move |s, now| request.start(s, conn, now),
                )
                .await;
            }
        }
    })
}

/// `GET /sync`: the scope-sync WebSocket; 404 without `--sync-rules`.
async fn scope_sync(
    State(state): State<AppState>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let Some(hub) = state.sync.clone() else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let upgrade = match upgrade {
        Ok(upgrade) => upgrade,
        Err(rejection) => return rejection.into_response(),
    };
    let slot = match state.connection_slots.take() {
        Ok(slot) => slot,
        Err(refusal) => return *refusal,
    };
    upgrade
        .max_message_size(scope_sync::MAX_CLIENT_FRAME_BYTES)
        .max_frame_size(scope_sync::MAX_CLIENT_FRAME_BYTES)
        .read_buffer_size(connection::READ_BUFFER_BYTES)
        .on_upgrade(move |socket| async move {
            let _slot = slot;
            hub.run_socket(socket).await;
        })
}

/// `GET /replica/snapshot`: a consistent copy of the replica, without the change log. The
/// watermark it reached is in the `X-Highwater-Watermark` header. Concurrent requests at one
/// watermark share one build; a disk without room for it gets 507.
async fn replica_snapshot(State(state): State<AppState>) -> Response {
    let current = state.hub.positions().last_watermark;
    let snapshot = match state.snapshots.get(&current).await {
        Ok(snapshot) => snapshot,
        Err(error @ snapshot::SnapshotError::NoRoom { .. }) => {
            tracing::warn!(%error, "no room for a replica snapshot");
            let message = format!("cannot create a replica snapshot: {error}");
            return (StatusCode::INSUFFICIENT_STORAGE, message).into_response();
        }
        Err(error) => {
            tracing::error!(%error, "cannot create a replica snapshot");
            let message = format!("cannot create a replica snapshot: {error}");
            return (StatusCode::INTERNAL_SERVER_ERROR, message).into_response();
        }
    };
    let file = match snapshot.open().await {
        Ok(file) => file,
        Err(error) => {
            let message = format!("cannot read the replica snapshot: {error}");
            return (StatusCode::INTERNAL_SERVER_ERROR, message).into_response();
        }
    };
    let (size, watermark, replica_version) = (
        snapshot.size,
        snapshot.watermark.clone(),
        snapshot.replica_version.clone(),
    );
    let mut response = Response::new(Body::from_stream(snapshot::chunks(file, snapshot)));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/vnd.sqlite3"),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
    let values = [
        (snapshot::WATERMARK_HEADER, watermark.as_str()),
        (snapshot::REPLICA_VERSION_HEADER, replica_version.as_str()),
    ];
    for (name, value) in values {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(name, value);
        }
    }
    let disposition = format!("attachment; filename=\"replica-{watermark}.db\"");
    if let Ok(value) = HeaderValue::from_str(&disposition) {
        headers.insert(header::CONTENT_DISPOSITION, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn changes_query() -> HashMap<String, String> {
        query(&[
            ("id", "sub"),
            ("taskID", "task"),
            ("replicaVersion", "0a"),
            ("watermark", "0b"),
            ("mode", "backup"),
            ("wsBatched", "true"),
        ])
    }

    #[test]
    fn version_segments() {
        assert_eq!(parse_version("v6"), Some(6));
        assert_eq!(parse_version("v99999999999999999999999"), Some(u64::MAX));
        for bad in ["6", "v", "v6a", "V6", "v-1"] {
            assert_eq!(parse_version(bad), None, "{bad}");
        }
    }

    #[test]
    fn changes_request_takes_its_context_from_the_query() {
        let request = parse_request(6, Endpoint::Changes, &changes_query()).expect("valid");
        let StreamRequest::Changes {
            version,
            ws_batched,
            context,
        } = request
        else {
            panic!("expected a /changes request, got {request:?}");
        };
        assert_eq!((version, ws_batched), (6, true));
        assert_eq!(
            (context.id.as_str(), context.task_id.as_str()),
            ("sub", "task")
        );
        assert_eq!(context.mode, SubscriberMode::Backup);
        assert_eq!(
            (context.replica_version.as_str(), context.watermark.as_str()),
            ("0a", "0b")
        );
    }

    #[test]
    fn missing_parameters_close_with_the_exact_reason() {
        for name in ["id", "replicaVersion", "watermark"] {
            let mut q = changes_query();
            q.remove(name);
            assert_eq!(
                parse_request(5, Endpoint::Changes, &q),
                Err(format!("Error: invalid querystring - missing {name}"))
            );
            // An empty value is missing too.
            q.insert(name.to_owned(), String::new());
            assert_eq!(
                parse_request(5, Endpoint::Changes, &q),
                Err(format!("Error: invalid querystring - missing {name}"))
            );
        }
        let mut q = changes_query();
        q.insert("watermark".to_owned(), "zz".to_owned());
        let reason = parse_request(5, Endpoint::Changes, &q).expect_err("bad watermark");
        assert!(reason.starts_with("Error: invalid querystring - expected watermark"));
        assert_eq!(
            parse_request(5, Endpoint::Snapshot, &query(&[])),
            Err("Error: Missing taskID in snapshot request".to_owned())
        );
        assert_eq!(
            parse_request(5, Endpoint::Snapshot, &query(&[("taskID", "t")])),
            Ok(StreamRequest::Snapshot {
                version: 5,
                task_id: "t".to_owned()
            })
        );
    }

    #[test]
    fn unsupported_versions_close_with_the_supported_range() {
        assert_eq!(
            parse_request(9, Endpoint::Changes, &changes_query()),
            Err(
                "Error: Cannot service client at protocol v9. Supported protocols: [v1 ... v8]"
                    .to_owned()
            )
        );
        assert_eq!(
            parse_request(6, Endpoint::Subscribe, &query(&[])),
            Err(
                "Error: Cannot service client at protocol v6. Supported protocols: [v7 ... v8]"
                    .to_owned()
            )
        );
        assert_eq!(
            parse_request(8, Endpoint::Subscribe, &query(&[])),
            Ok(StreamRequest::Subscribe { version: 8 })
        );
    }
}
