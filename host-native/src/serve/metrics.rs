//! `GET /metrics`: every metric of `serve`, named, described and rendered here, in the
//! Prometheus text format (the Prometheus project's `prometheus-client` crate).
//!
//! Two sources, one place:
//! - counts and state of the engine's state machines, read at scrape time from
//!   [`Streamer::metrics`](highwater_engine::streamer::Streamer::metrics) and
//!   [`ScopeServer::metrics`](highwater_engine::scope_sync::server::ScopeServer::metrics) (what
//!   counts as what is decided there), plus the server's own positions and files;
//! - what only the host sees as it happens (group commits, their durations, the age of what
//!   it stores and routes), recorded into [`Recorded`] by the ingest thread.
//!
//! The endpoint answers on the main port behind the replication token, like the other
//! server-to-server endpoints, and without one on `--metrics-addr` when that is given (for a
//! scraper on an internal interface). The README lists every metric.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::change_stream::Hub;
use super::scope_sync::SyncHub;
use super::security::PeerRefusals;
use super::snapshot::Snapshots;
use super::wal_watch::WalHealth;

/// The content type of the exposition format `prometheus-client` writes (OpenMetrics text,
/// which Prometheus reads).
pub(crate) const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What the ingest thread records as it happens.
#[derive(Debug)]
pub(crate) struct Recorded {
    /// Upstream transactions per SQLite group commit.
    group_transactions: Histogram,
    /// Seconds one group commit took (the replica's and the change log's writes).
    group_commit_seconds: Histogram,
    /// Seconds from the upstream commit to its changes routed to scope-sync subscriptions.
    commit_to_route_seconds: Histogram,
    /// Milliseconds from the upstream commit to durable here, for the newest durable commit.
    lag_ms: AtomicI64,
    /// Whether `lag_ms` has been measured.
    lag_known: AtomicBool,
}

impl Default for Recorded {
    fn default() -> Self {
        Recorded {
            // 1, 2, 4, … 4096 transactions.
            group_transactions: Histogram::new(exponential_buckets(1.0, 2.0, 13)),
            // 50 µs … ~1.6 s.
            group_commit_seconds: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
            // 1 ms … ~16 s.
            commit_to_route_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            lag_ms: AtomicI64::new(0),
            lag_known: AtomicBool::new(false),
        }
    }
}

impl Recorded {
    /// A group of `transactions` committed in `seconds`.
    pub(crate) fn group_committed(&self, transactions: usize, seconds: f64) {
        self.group_transactions.observe(transactions as f64);
        self.group_commit_seconds.observe(seconds);
    }

    /// The newest commit made durable here was committed upstream at `commit_ms` (Unix ms).
    pub(crate) fn durable(&self, commit_ms: i64) {
        self.lag_ms
            .store((unix_ms() - commit_ms).max(0), Ordering::Relaxed);
        self.lag_known.store(true, Ordering::Relaxed);
    }

    /// Changes committed upstream at `commit_ms` were routed to scope-sync subscriptions now.
    pub(crate) fn routed(&self, commit_ms: i64) {
        let seconds = (unix_ms() - commit_ms).max(0) as f64 / 1000.0;
        self.commit_to_route_seconds.observe(seconds);
    }
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// What the scrape reads.
pub(crate) struct Sources {
    pub(crate) hub: Arc<Hub>,
    pub sync: Option<Arc<SyncHub>>,
    pub snapshots: Arc<Snapshots>,
    pub wal: Option<Arc<WalHealth>>,
    pub(crate) peer_refusals: Arc<PeerRefusals>,
    /// The replica and change log file (`<data>/replica.db`).
    pub db_path: PathBuf,
    pub(crate) started_unix_s: f64,
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sources")
            .field("db_path", &self.db_path)
            .finish_non_exhaustive()
    }
}

/// Every metric of the server: the recorded ones and the collector that reads the rest.
pub(crate) fn registry(sources: Sources) -> Registry {
    let mut registry = Registry::with_prefix("highwater");
    let recorded = sources.hub.recorded();
    registry.register(
        "group_transactions",
        "Upstream transactions stored per SQLite group commit",
        recorded.group_transactions.clone(),
    );
    registry.register(
        "group_commit_seconds",
        "Time one group commit of the replica and change log took",
        recorded.group_commit_seconds.clone(),
    );
    registry.register(
        "commit_to_route_seconds",
        "Time from the upstream commit to its changes routed to scope-sync subscriptions",
        recorded.commit_to_route_seconds.clone(),
    );
    registry.register_collector(Box::new(Collected(sources)));
    registry
}

/// Renders `registry` in the text format.
pub(crate) fn render(registry: &Registry) -> String {
    let mut text = String::new();
    // Writing into a String cannot fail; a collector error would leave a partial text.
    if prometheus_client::encoding::text::encode(&mut text, registry).is_err() {
        text.clear();
    }
    text
}

#[derive(Debug)]
struct Collected(Sources);

/// One metric family at a time.
struct Out<'a, 'b> {
    encoder: &'a mut DescriptorEncoder<'b>,
}

impl Out<'_, '_> {
    fn counter(&mut self, name: &str, help: &str, value: u64) -> std::fmt::Result {
        let metric = ConstCounter::new(value);
        let family = self
            .encoder
            .encode_descriptor(name, help, None, MetricType::Counter)?;
        metric.encode(family)
    }

    fn gauge<N: prometheus_client::encoding::EncodeGaugeValue>(
        &mut self,
        name: &str,
        help: &str,
        value: N,
    ) -> std::fmt::Result {
        let metric = ConstGauge::new(value);
        let family = self
            .encoder
            .encode_descriptor(name, help, None, MetricType::Gauge)?;
        metric.encode(family)
    }

    /// One family with a series per label set.
    fn labelled<const N: usize>(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricType,
        series: &[([(&str, String); N], u64)],
    ) -> std::fmt::Result {
        let mut family = self.encoder.encode_descriptor(name, help, None, kind)?;
        for (labels, value) in series {
            let encoder = family.encode_family(labels)?;
            match kind {
                MetricType::Counter => ConstCounter::new(*value).encode(encoder)?,
                _ => ConstGauge::new(*value).encode(encoder)?,
            }
        }
        Ok(())
    }
}

impl Collector for Collected {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let sources = &self.0;
        let mut out = Out {
            encoder: &mut encoder,
        };
        out.gauge(
            "start_time_seconds",
            "When the server started, in Unix seconds",
            sources.started_unix_s,
        )?;

        // Ingest: what the change-streamer has taken in, and what the store has made durable.
        let streamer = sources.hub.inspect(|s| s.metrics());
        out.counter(
            "transactions",
            "Upstream transactions committed and forwarded",
            streamer.transactions,
        )?;
        out.counter(
            "changes",
            "Upstream row changes (inserts, updates, deletes, truncates, schema changes)",
            streamer.changes,
        )?;
        out.counter(
            "rollbacks",
            "Upstream transactions rolled back",
            streamer.rollbacks,
        )?;
        let (store_commits, stored_transactions) = sources.hub.store_counts();
        out.counter(
            "store_commits",
            "SQLite commits that made upstream transactions durable",
            store_commits,
        )?;
        out.counter(
            "stored_transactions",
            "Upstream transactions made durable in the replica and change log",
            stored_transactions,
        )?;
        let recorded = sources.hub.recorded();
        if recorded.lag_known.load(Ordering::Relaxed) {
            out.gauge(
                "replication_lag_seconds",
                "Time from the upstream commit to durable here, for the newest durable commit",
                recorded.lag_ms.load(Ordering::Relaxed) as f64 / 1000.0,
            )?;
        }
        let positions = sources.hub.positions();
        if let Ok(lsn) = positions.last_watermark.to_lsn() {
            out.gauge(
                "change_log_last_lsn",
                "The newest commit in the change log, as an LSN",
                lsn_gauge(lsn.0),
            )?;
        }
        if let Ok(lsn) = positions.min_watermark.to_lsn() {
            out.gauge(
                "change_log_floor_lsn",
                "The purge floor: the earliest watermark left in the change log, as an LSN",
                lsn_gauge(lsn.0),
            )?;
        }
        out.gauge(
            "store_bytes",
            "Size of the replica and change log on disk (database file and its WAL)",
            store_bytes(&sources.db_path),
        )?;

        // The replication slot upstream (not on a relay), as of the last WAL check.
        if let Some(slot) = sources.wal.as_ref().and_then(|wal| wal.last()) {
            if let Some(retained) = slot.retained {
                out.gauge(
                    "slot_retained_wal_bytes",
                    "WAL Postgres keeps for the replication slot",
                    retained,
                )?;
            }
            if let Some(behind) = slot.behind {
                out.gauge(
                    "slot_lag_bytes",
                    "WAL written upstream past the slot's confirmed flush position",
                    behind,
                )?;
            }
        }
        let degraded = sources.wal.iter().filter_map(|wal| wal.degraded()).count();
        out.gauge(
            "degraded",
            "1 while /health says degraded (the slot keeps too much WAL or was invalidated)",
            i64::from(degraded > 0),
        )?;

        // Change-stream subscribers.
        let subscribers: Vec<([(&str, String); 2], u64)> = streamer
            .subscribers
            .iter()
            .map(|((version, phase), count)| {
                (
                    [
                        ("protocol", format!("v{version}")),
                        ("phase", (*phase).to_owned()),
                    ],
                    *count as u64,
                )
            })
            .collect();
        out.labelled(
            "change_stream_subscribers",
            "Change-stream subscribers by protocol version and phase",
            MetricType::Gauge,
            &subscribers,
        )?;
        out.gauge(
            "change_stream_connections",
            "Open change-stream WebSocket connections, subscribed or not",
            sources.hub.connections(),
        )?;
        out.gauge(
            "backlog_bytes",
            "Bytes held for change-stream subscribers: backlogs and unacknowledged live bytes",
            streamer.backlog_bytes,
        )?;
        out.gauge(
            "backlog_max_bytes",
            "The largest one subscriber's share of backlog_bytes",
            streamer.max_backlog_bytes,
        )?;
        out.gauge(
            "upstream_paused",
            "1 while a full subscriber backlog holds up the upstream stream",
            i64::from(streamer.upstream_paused),
        )?;
        out.gauge(
            "reservations",
            "Reserved watermarks (replica backups in progress)",
            streamer.reservations,
        )?;
        out.counter(
            "snapshots_built",
            "Replica snapshots built for relays and view-syncers",
            sources.snapshots.built(),
        )?;

        // Authentication failures, by endpoint and code.
        let mut failures: Vec<([(&str, String); 2], u64)> = vec![
            (
                [
                    ("endpoint", "replication".to_owned()),
                    ("code", "bad-token".to_owned()),
                ],
                sources.peer_refusals.bad_token(),
            ),
            (
                [
                    ("endpoint", "replication".to_owned()),
                    ("code", "missing-token".to_owned()),
                ],
                sources.peer_refusals.missing_token(),
            ),
        ];
        let sync = sources.sync.as_ref().map(|sync| sync.metrics());
        for (code, count) in sync.iter().flat_map(|m| &m.counts.denied) {
            failures.push((
                [("endpoint", "sync".to_owned()), ("code", code.clone())],
                *count,
            ));
        }
        out.labelled(
            "auth_failures",
            "Requests and subscriptions refused for their credentials or the rules, by code",
            MetricType::Counter,
            &failures,
        )?;

        // Scope sync, when on.
        if let Some(sync) = sync {
            out.gauge(
                "sync_connections",
                "Open scope-sync sockets",
                sync.connections,
            )?;
            let stages: BTreeMap<&str, usize> = ["authorizing", "replaying", "live"]
                .into_iter()
                .map(|stage| (stage, sync.subscriptions.get(stage).copied().unwrap_or(0)))
                .collect();
            let series: Vec<([(&str, String); 1], u64)> = stages
                .iter()
                .map(|(stage, count)| ([("stage", (*stage).to_owned())], *count as u64))
                .collect();
            out.labelled(
                "sync_subscriptions",
                "Scope-sync subscriptions by stage",
                MetricType::Gauge,
                &series,
            )?;
            let counts = &sync.counts;
            out.counter(
                "sync_subscriptions_granted",
                "Scope-sync subscriptions the rules granted",
                counts.granted,
            )?;
            out.counter(
                "sync_replay_pages",
                "Replay pages read from the replica",
                counts.replay_pages,
            )?;
            out.counter(
                "sync_replay_rows",
                "Rows sent by replays",
                counts.replay_rows,
            )?;
            out.counter(
                "sync_live_envelopes",
                "Live envelopes sent (one per transaction and subscription it reaches)",
                counts.live_envelopes,
            )?;
            out.counter("sync_live_rows", "Row changes sent live", counts.live_rows)?;
            out.counter(
                "sync_live_removals",
                "Of sync_live_rows, rows that left a scope (deleted or changed out of it)",
                counts.live_removals,
            )?;
            out.counter(
                "sync_resets",
                "Reset markers sent (a cursor that could not be resumed, a truncate)",
                counts.resets,
            )?;
            out.counter(
                "sync_checkpoints",
                "Checkpoints sent to quiet live subscriptions",
                counts.checkpoints,
            )?;
            out.counter(
                "sync_mutations_received",
                "Mutations received in mutate frames",
                counts.mutations_received,
            )?;
            let outcomes: Vec<([(&str, String); 1], u64)> = [
                ("applied", counts.mutations_applied),
                ("rejected", counts.mutations_rejected),
                ("retry", counts.mutations_retried),
            ]
            .into_iter()
            .map(|(outcome, count)| ([("outcome", outcome.to_owned())], count))
            .collect();
            out.labelled(
                "sync_mutations",
                "Mutations answered: applied (now or before), rejected, or to send again (retry)",
                MetricType::Counter,
                &outcomes,
            )?;
        }
        Ok(())
    }
}

/// An LSN as a gauge value: exact below 2^63, which every LSN Postgres hands out is.
fn lsn_gauge(lsn: u64) -> i64 {
    i64::try_from(lsn).unwrap_or(i64::MAX)
}

fn store_bytes(db_path: &std::path::Path) -> u64 {
    let size = |path: PathBuf| std::fs::metadata(path).map_or(0, |m| m.len());
    let mut wal = db_path.as_os_str().to_owned();
    wal.push("-wal");
    size(db_path.to_path_buf()) + size(PathBuf::from(wal))
}
