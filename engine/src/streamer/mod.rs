//! The change-streamer's rules (subscriptions, catch-up from the change log, acks and the purge
//! floor, backlog and back-pressure, backfill bookkeeping, reservations), sans-IO: the host
//! feeds events in and carries out the [`Effect`]s that come back.
//!
//! One [`Streamer`] sits between one upstream change source and many downstream connections.
//! It forwards every upstream message to the subscribers at once, asks the host to store it,
//! and acks it upstream only once the host reports it durable. Subscribers that are behind are
//! caught up from the change log while their live messages wait in a bounded backlog, then
//! switched to the live stream with no gap and no duplicate.
//!
//! The host's loop, per connection or upstream event, calls one method and carries out the
//! returned effects **in order**:
//!
//! * [`Effect::Store`] and [`Effect::FetchCatchup`] go through one storage queue, in order: a
//!   catch-up read must see every store asked for before it. After a [`LogOp::Commit`] is
//!   durable, report it with [`Streamer::on_stored`] and carry out what it returns. What to
//!   confirm to the change source, and when, is the upstream session's rule
//!   (`crate::upstream`), not the streamer's.
//! * [`Effect::PauseUpstream`]: feed no more upstream messages until [`Effect::ResumeUpstream`].
//!   [`Effect::PauseCatchup`]: read no more catch-up rows for that connection until
//!   [`Effect::ResumeCatchup`].
//! * [`Effect::RestartUpstream`]: stop the upstream stream, call [`Streamer::upstream_ended`],
//!   read the change log's cookie jar, and start a new stream at the last stored watermark with
//!   the requests [`Streamer::start_upstream`] returns.
//! * Call [`Streamer::tick`] at [`Streamer::next_deadline`] (or every second or so).
//! * Call [`Streamer::on_upstream_drained`] whenever no upstream message is waiting to be fed
//!   (before the host blocks for more input). Live messages to batch-capable (v7+) subscribers
//!   are held until then, so a burst of upstream transactions reaches each of them as one batch
//!   frame with one ack instead of a frame and an ack per message; a hold that grows past
//!   [`HELD_MAX_MESSAGES`] or [`HELD_MAX_BYTES`] goes out without waiting.
//!
//! Upstream transactions reach subscribers before they are durable: one lost in a crash is
//! sent again by the source at the same watermark. A `skipAck` transaction (a backfill) is not:
//! its retry is read later and may commit at another watermark, and a subscriber that had the
//! lost one would hold a watermark the change log never will. So its commit is held from
//! subscribers, and the upstream paused, until the host reports it durable.
//!
//! Connection ids ([`ConnId`]) and the time (`now_ms`) come from the host.
//!
//! One subscriber whose backlog stays above its high-water mark holds the upstream up for
//! every subscriber ([`Effect::PauseUpstream`]) until its acks bring it down to low water, or
//! until [`StreamerConfig::backlog_full_timeout_ms`] has passed and [`Streamer::tick`] closes
//! it (1013). There is no release by majority: the upstream does not go on once most
//! subscribers have taken a message, leaving the slow one to catch up from the change log.

mod catchup;
mod effect;
mod entry;
mod purge;
mod registry;
mod reservation;
mod subscriber;

#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::Arc;

use indexmap::IndexMap;
use serde_json::{Number, Value};

pub use catchup::CatchupRow;
pub use effect::{Effect, LogOp, Outgoing, StoredChange};
pub use purge::DEFAULT_PURGE_DELAY_MS;
pub use registry::{HELD_MAX_BYTES, HELD_MAX_MESSAGES};
pub use reservation::{check_restored_snapshot, restored_log_start, SnapshotMismatch};
pub use subscriber::Phase;

use crate::backfill::{BackfillStateTracker, Registration};
use crate::change_stream::{
    close_reason, decode_upstream_frame, encode_downstream, BackfillRequest, DownstreamMessage,
    ErrorKind, Extra, Frame, Reserved, Rollback, Status, StreamError, SubscribeContext,
    UpstreamMessage, MIN_SUBSCRIBE_PROTOCOL_VERSION, PROTOCOL_ERROR_CLOSE_CODE,
};
use crate::watermark::Watermark;
use catchup::{check_first_row, too_old_message, wrong_replica_version_message, FirstRow};
use entry::Entry;
use purge::purge_floor;
use registry::{Connection, SharedBatch};
use reservation::Reservations;
use subscriber::{Delivery, Subscriber, WaterMarks};

/// Zero's backlog high-water mark: 16 MiB.
pub const DEFAULT_BACKLOG_HIGH_WATER_BYTES: usize = 16 * 1024 * 1024;
/// Zero's low-water mark as a fraction of the high-water mark.
pub const DEFAULT_BACKLOG_LOW_WATER_RATIO: f64 = 0.8;
/// How long a subscriber may hold up the stream with a full backlog before it is dropped.
pub const DEFAULT_BACKLOG_FULL_TIMEOUT_MS: u64 = 60_000;
/// How long to wait for the ack of an `error` message before closing anyway.
pub const DEFAULT_ERROR_ACK_TIMEOUT_MS: u64 = 10_000;

/// WebSocket close codes used here.
pub const NORMAL_CLOSE_CODE: u16 = 1000;
pub const INTERNAL_ERROR_CLOSE_CODE: u16 = 1011;
pub const TRY_AGAIN_LATER_CLOSE_CODE: u16 = 1013;

/// A downstream connection, numbered by the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(pub u64);

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Settings of a [`Streamer`].
#[derive(Debug, Clone, PartialEq)]
pub struct StreamerConfig {
    /// The replica version subscribers must match.
    pub replica_version: Watermark,
    /// Where replica backups live; without it, snapshot reservations are refused.
    pub backup_url: Option<String>,
    pub backlog_high_water_bytes: usize,
    pub backlog_low_water_ratio: f64,
    /// Drop a subscriber whose backlog holds up the stream this long; `None` never drops.
    pub backlog_full_timeout_ms: Option<u64>,
    /// Wait after a new backup watermark before purging up to it.
    pub purge_delay_ms: u64,
    pub error_ack_timeout_ms: u64,
}

impl StreamerConfig {
    /// Zero's defaults for a change log at `replica_version`.
    pub fn new(replica_version: Watermark) -> Self {
        StreamerConfig {
            replica_version,
            backup_url: None,
            backlog_high_water_bytes: DEFAULT_BACKLOG_HIGH_WATER_BYTES,
            backlog_low_water_ratio: DEFAULT_BACKLOG_LOW_WATER_RATIO,
            backlog_full_timeout_ms: Some(DEFAULT_BACKLOG_FULL_TIMEOUT_MS),
            purge_delay_ms: DEFAULT_PURGE_DELAY_MS,
            error_ack_timeout_ms: DEFAULT_ERROR_ACK_TIMEOUT_MS,
        }
    }

    fn water_marks(&self) -> WaterMarks {
        let high = self.backlog_high_water_bytes.max(1);
        let ratio = self.backlog_low_water_ratio.clamp(0.0, 1.0);
        WaterMarks {
            high,
            low: (high as f64 * ratio) as usize,
        }
    }
}

/// The change log as the host found it at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeLogState {
    /// The newest stored commit (`replicationState.lastWatermark`).
    pub last_watermark: Watermark,
    /// The earliest stored watermark (the replica version for an empty log).
    pub min_watermark: Watermark,
}

/// A backup of the replica that reached `watermark`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupWatermark {
    pub watermark: Watermark,
    /// The replica file's size, advertised in reservation confirmations.
    pub replica_size: Option<u64>,
}

/// An upstream message that breaks the change-source protocol; the stream cannot continue
/// (call [`Streamer::upstream_ended`] and restart it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    #[error("expected a begin or a status between transactions, found {tag}")]
    OutsideTransaction { tag: String },
    #[error(
        "expected the transaction at {open} to end before another begins, found a begin for {found}"
    )]
    NestedBegin { open: Watermark, found: Watermark },
    #[error("expected a commit at {expected} (the begin's commitWatermark), found {found}")]
    CommitMismatch {
        expected: Watermark,
        found: Watermark,
    },
    #[error("expected a transaction after the last commit {last}, found a begin for {found}")]
    NotIncreasing { last: Watermark, found: Watermark },
    #[error("expected a change-stream message from the change source, found {tag}")]
    NotFromSource { tag: String },
}

/// A subscriber as seen from outside (metrics, tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberStatus {
    pub id: String,
    pub phase: Phase,
    /// The last commit sent.
    pub watermark: Watermark,
    /// The last commit acknowledged.
    pub acked: Watermark,
    pub backlog_bytes: usize,
    /// Bytes sent live and not yet acknowledged.
    pub live_bytes_in_flight: usize,
    pub outstanding_frames: usize,
}

/// What the streamer has counted since it started, and what it holds now: the values behind
/// the host's metrics (the host names and renders them; the rules of what counts are here).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StreamerMetrics {
    /// Upstream transactions committed and forwarded.
    pub transactions: u64,
    /// Upstream row changes (inserts, updates, deletes, truncates, schema changes).
    pub changes: u64,
    /// Upstream transactions rolled back.
    pub rollbacks: u64,
    /// Subscribers by protocol version and phase.
    pub subscribers: std::collections::BTreeMap<(u32, &'static str), usize>,
    /// Connections without a subscription yet (or only reserving).
    pub idle_connections: usize,
    /// Bytes held for subscribers: backlogs plus live bytes not yet acknowledged.
    pub backlog_bytes: usize,
    /// The largest single subscriber's share of `backlog_bytes`.
    pub max_backlog_bytes: usize,
    /// Whether a full backlog holds up the upstream stream.
    pub upstream_paused: bool,
    /// Reserved watermarks (backups in progress).
    pub reservations: usize,
}

impl Phase {
    /// The phase's name in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Queued => "queued",
            Phase::CatchingUp { .. } => "catching_up",
            Phase::Draining => "draining",
            Phase::Live => "live",
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Counted {
    transactions: u64,
    changes: u64,
    rollbacks: u64,
}

#[derive(Debug, Clone)]
struct OpenTx {
    watermark: Watermark,
    next_pos: u64,
    /// Begun with `skipAck`: its commit waits to be durable before subscribers get it.
    skip_ack: bool,
}

/// The change-streamer state machine. See the module documentation for the host's side.
#[derive(Debug)]
pub struct Streamer {
    config: StreamerConfig,
    limits: WaterMarks,
    conns: IndexMap<ConnId, Connection>,
    tracker: BackfillStateTracker,
    reservations: Reservations,
    purge: purge::PurgeSchedule,
    /// The newest commit durable in the change log.
    stored: Watermark,
    /// The earliest watermark in the change log.
    log_min: Watermark,
    /// The last commit forwarded.
    last_commit: Watermark,
    tx: Option<OpenTx>,
    /// A `skipAck` transaction's commit, stored but not yet durable: forwarded by
    /// [`Streamer::on_stored`]. Meanwhile the upstream is paused, and whatever the host still
    /// feeds waits in `behind_held`, in order.
    held_commit: Option<Arc<Entry>>,
    behind_held: std::collections::VecDeque<DownstreamMessage>,
    upstream_paused: bool,
    restart_signalled: bool,
    /// Some connection may hold live messages for the end of the burst.
    holding: bool,
    /// The batch payload the connections of one burst share (empty between bursts).
    shared_batch: SharedBatch,
    replica_size: Option<u64>,
    /// The latest time seen in any event.
    now_ms: u64,
    /// `["status",{"tag":"status"}]`, the first message of every v2+ subscription.
    initial_status: Arc<str>,
    /// What has been seen since the start.
    counted: Counted,
}

impl Streamer {
    pub fn new(config: StreamerConfig, log: ChangeLogState) -> Self {
        Streamer {
            limits: config.water_marks(),
            config,
            conns: IndexMap::new(),
            tracker: BackfillStateTracker::new(),
            reservations: Reservations::default(),
            purge: purge::PurgeSchedule::default(),
            stored: log.last_watermark.clone(),
            log_min: log.min_watermark,
            last_commit: log.last_watermark,
            tx: None,
            held_commit: None,
            behind_held: std::collections::VecDeque::new(),
            upstream_paused: false,
            restart_signalled: false,
            holding: false,
            shared_batch: SharedBatch::default(),
            replica_size: None,
            now_ms: 0,
            initial_status: encode_downstream(&DownstreamMessage::Status(Status::default())).into(),
            counted: Counted::default(),
        }
    }

    /// Counts since the start and the state held now, for metrics.
    pub fn metrics(&self) -> StreamerMetrics {
        let mut metrics = StreamerMetrics {
            transactions: self.counted.transactions,
            changes: self.counted.changes,
            rollbacks: self.counted.rollbacks,
            upstream_paused: self.upstream_paused,
            reservations: self.reservations.len(),
            ..StreamerMetrics::default()
        };
        for connection in self.conns.values() {
            let Some(subscriber) = &connection.subscriber else {
                metrics.idle_connections += 1;
                continue;
            };
            *metrics
                .subscribers
                .entry((connection.version, subscriber.phase.name()))
                .or_default() += 1;
            let held = subscriber.backlog_bytes() + subscriber.live_in_flight();
            metrics.backlog_bytes += held;
            metrics.max_backlog_bytes = metrics.max_backlog_bytes.max(held);
        }
        metrics
    }

    pub fn config(&self) -> &StreamerConfig {
        &self.config
    }

    /// Whether an upstream transaction is in flight.
    pub fn in_transaction(&self) -> bool {
        self.tx.is_some()
    }

    /// Whether a `skipAck` commit waits to be durable before subscribers get it.
    pub fn holds_commit(&self) -> bool {
        self.held_commit.is_some()
    }

    /// Whether the host was told to stop reading upstream.
    pub fn is_upstream_paused(&self) -> bool {
        self.upstream_paused
    }

    /// The last commit forwarded.
    pub fn last_commit(&self) -> &Watermark {
        &self.last_commit
    }

    /// The backfill bookkeeping across streams.
    pub fn backfills(&self) -> &BackfillStateTracker {
        &self.tracker
    }

    /// The subscriber on `conn`, if any.
    pub fn subscriber(&self, conn: ConnId) -> Option<SubscriberStatus> {
        let c = self.conns.get(&conn)?;
        let s = c.subscriber.as_ref()?;
        Some(SubscriberStatus {
            id: s.id.clone(),
            phase: s.phase,
            watermark: s.watermark.clone(),
            acked: s.acked.clone(),
            backlog_bytes: s.backlog_bytes(),
            live_bytes_in_flight: s.live_in_flight(),
            outstanding_frames: c.outstanding(),
        })
    }

    // ---- upstream ----

    /// Starts (or restarts) the upstream stream: `cookie_jar` is the change log's pending
    /// backfills at its last watermark; returns the backfill requests to start the stream with.
    pub fn start_upstream(&mut self, cookie_jar: Vec<BackfillRequest>) -> Vec<BackfillRequest> {
        self.restart_signalled = false;
        self.tracker.start_stream(cookie_jar)
    }

    /// A message from the change source: `begin`, `data`, `commit`, `rollback`, or a `status`
    /// to relay. Rejected messages change nothing.
    pub fn on_upstream(
        &mut self,
        message: DownstreamMessage,
    ) -> Result<Vec<Effect>, UpstreamError> {
        let mut out = Vec::new();
        if self.held_commit.is_some() {
            // The host was told to pause: what it still feeds (the rest of a relayed frame)
            // follows the held commit.
            self.behind_held.push_back(message);
            return Ok(out);
        }
        match message {
            DownstreamMessage::Begin(begin) => {
                if let Some(tx) = &self.tx {
                    return Err(UpstreamError::NestedBegin {
                        open: tx.watermark.clone(),
                        found: begin.commit_watermark,
                    });
                }
                if begin.commit_watermark <= self.last_commit {
                    return Err(UpstreamError::NotIncreasing {
                        last: self.last_commit.clone(),
                        found: begin.commit_watermark,
                    });
                }
                let watermark = begin.commit_watermark.clone();
                self.tx = Some(OpenTx {
                    watermark: watermark.clone(),
                    next_pos: 1,
                    skip_ack: begin.skip_ack == Some(true),
                });
                let entry = self.entry(DownstreamMessage::Begin(begin), Some(watermark.clone()));
                out.push(Effect::Store(LogOp::Begin(StoredChange::new(
                    &entry, &watermark, 0,
                ))));
                self.forward(&entry, &mut out);
            }
            DownstreamMessage::Data(change) => {
                let Some(tx) = &mut self.tx else {
                    return Err(UpstreamError::OutsideTransaction {
                        tag: change.tag().to_owned(),
                    });
                };
                let (pos, watermark) = (tx.next_pos, tx.watermark.clone());
                tx.next_pos += 1;
                self.counted.changes += 1;
                let entry = self.entry(DownstreamMessage::Data(change), Some(watermark.clone()));
                out.push(Effect::Store(LogOp::Append(StoredChange::new(
                    &entry, &watermark, pos,
                ))));
                self.forward(&entry, &mut out);
            }
            DownstreamMessage::Commit(commit) => {
                let Some(tx) = &self.tx else {
                    return Err(UpstreamError::OutsideTransaction {
                        tag: "commit".to_owned(),
                    });
                };
                if commit.watermark != tx.watermark {
                    return Err(UpstreamError::CommitMismatch {
                        expected: tx.watermark.clone(),
                        found: commit.watermark,
                    });
                }
                let (pos, skip_ack) = (tx.next_pos, tx.skip_ack);
                self.tx = None;
                self.counted.transactions += 1;
                let watermark = commit.watermark.clone();
                let entry = self.entry(DownstreamMessage::Commit(commit), Some(watermark.clone()));
                out.push(Effect::Store(LogOp::Commit(StoredChange::new(
                    &entry, &watermark, pos,
                ))));
                self.last_commit = watermark.clone();
                if skip_ack {
                    self.held_commit = Some(entry);
                } else {
                    self.end_of_commit(&entry, &mut out);
                }
            }
            DownstreamMessage::Rollback(rollback) => {
                if self.tx.is_none() {
                    return Err(UpstreamError::OutsideTransaction {
                        tag: "rollback".to_owned(),
                    });
                }
                self.counted.rollbacks += 1;
                self.end_transaction(rollback, &mut out);
            }
            DownstreamMessage::Status(status) => {
                let entry = self.entry(DownstreamMessage::Status(status), None);
                self.forward(&entry, &mut out);
                if self.tx.is_none() {
                    self.at_boundary(&mut out);
                }
            }
            DownstreamMessage::Error(_) => {
                return Err(UpstreamError::NotFromSource {
                    tag: "error".to_owned(),
                })
            }
            DownstreamMessage::Reserved(_) => {
                return Err(UpstreamError::NotFromSource {
                    tag: "reserved".to_owned(),
                })
            }
        }
        self.update_gate(&mut out);
        Ok(out)
    }

    /// The change source is between transactions with nothing new (a keepalive): a boundary
    /// at which the source may be restarted.
    pub fn on_idle(&mut self) -> Vec<Effect> {
        // Not an end of the burst: Postgres sends a keepalive each time its sender catches up
        // with the flushed WAL, which under load is every few messages, while more of them
        // are already queued at the host.
        let mut out = Vec::new();
        if self.tx.is_none() && self.held_commit.is_none() {
            self.at_boundary(&mut out);
        }
        out
    }

    /// The commit at `watermark` (and everything before it) is durable in the change log. A
    /// held `skipAck` commit it covers goes to the subscribers, then what waited behind it
    /// (whose rejection is returned as [`Streamer::on_upstream`]'s would be).
    pub fn on_stored(&mut self, watermark: Watermark) -> Result<Vec<Effect>, UpstreamError> {
        if watermark > self.stored {
            self.stored = watermark;
        }
        let mut out = Vec::new();
        let durable = self
            .held_commit
            .as_ref()
            .is_some_and(|held| held.watermark().is_some_and(|w| *w <= self.stored));
        if durable {
            if let Some(entry) = self.held_commit.take() {
                self.end_of_commit(&entry, &mut out);
            }
            while self.held_commit.is_none() {
                let Some(message) = self.behind_held.pop_front() else {
                    break;
                };
                out.extend(self.on_upstream(message)?);
            }
        }
        self.update_gate(&mut out);
        Ok(out)
    }

    /// A commit goes to the subscribers; subscribers waiting for a boundary start, and the
    /// upstream restarts if one needs it.
    fn end_of_commit(&mut self, entry: &Arc<Entry>, out: &mut Vec<Effect>) {
        self.forward(entry, out);
        self.activate_queued(out);
        self.at_boundary(out);
    }

    /// The upstream stream ended (error, close, or a restart). A transaction in flight is
    /// rolled back for the subscribers that saw its beginning and discarded from storage.
    pub fn upstream_ended(&mut self) -> Vec<Effect> {
        let mut out = Vec::new();
        // The ended stream's messages not yet taken are sent again by the next one. A held
        // commit stays held: its store is already asked for.
        self.behind_held.clear();
        if self.tx.is_some() {
            self.end_transaction(Rollback::default(), &mut out);
        }
        out.extend(self.on_upstream_drained());
        self.update_gate(&mut out);
        out
    }

    /// No upstream message is waiting: the live messages held for batching go out, one frame
    /// per connection.
    pub fn on_upstream_drained(&mut self) -> Vec<Effect> {
        let mut out = Vec::new();
        if !std::mem::take(&mut self.holding) {
            return out;
        }
        for (&conn, c) in self.conns.iter_mut() {
            if c.holds() {
                out.extend(
                    c.frame_sharing(&mut Vec::new(), &mut self.shared_batch)
                        .into_iter()
                        .map(|frame| Effect::Send { conn, frame }),
                );
            }
        }
        self.shared_batch.clear();
        out
    }

    fn end_transaction(&mut self, rollback: Rollback, out: &mut Vec<Effect>) {
        let Some(tx) = self.tx.take() else {
            return;
        };
        out.push(Effect::Store(LogOp::Abort));
        let entry = self.entry(DownstreamMessage::Rollback(rollback), Some(tx.watermark));
        self.forward(&entry, out);
        self.activate_queued(out);
        self.at_boundary(out);
    }

    /// Applies a forwarded message to the stream's backfill state (before anyone gets it) and
    /// serializes it once.
    fn entry(&mut self, message: DownstreamMessage, watermark: Option<Watermark>) -> Arc<Entry> {
        self.tracker.apply_message(&message);
        Arc::new(Entry::live(message, watermark))
    }

    fn forward(&mut self, entry: &Arc<Entry>, out: &mut Vec<Effect>) {
        let mut aligned = Vec::new();
        // One message list for every connection's delivery, so offering an entry to each
        // subscriber allocates nothing of its own.
        let mut messages = Vec::new();
        for (&conn, c) in self.conns.iter_mut() {
            let Some(sub) = c.subscriber.as_mut() else {
                continue;
            };
            let mut d = Delivery::reusing(c.version, &mut self.tracker, messages);
            if sub.offer(entry, self.limits, &mut d) {
                aligned.push(sub.tracker_key.clone());
            }
            messages = emit_live(conn, c, d, &mut self.shared_batch, out);
            self.holding |= c.holds();
        }
        self.shared_batch.clear();
        for key in aligned {
            self.tracker.mark_aligned(&key);
        }
    }

    /// At a transaction boundary: restart upstream if an aligned subscriber needs backfills the
    /// current stream does not cover.
    fn at_boundary(&mut self, out: &mut Vec<Effect>) {
        if self.restart_signalled {
            return;
        }
        if let Some(reason) = self.tracker.restart_reason() {
            self.restart_signalled = true;
            out.push(Effect::RestartUpstream {
                reason: reason.to_owned(),
            });
        }
    }

    fn update_gate(&mut self, out: &mut Vec<Effect>) {
        let mut blocked = self.held_commit.is_some();
        for c in self.conns.values_mut() {
            if let Some(s) = c.subscriber.as_mut().filter(|s| s.blocking) {
                blocked = true;
                s.blocking_since.get_or_insert(self.now_ms);
            }
        }
        if blocked != self.upstream_paused {
            self.upstream_paused = blocked;
            out.push(if blocked {
                Effect::PauseUpstream
            } else {
                Effect::ResumeUpstream
            });
        }
    }

    // ---- downstream connections ----

    /// A downstream connection was accepted at protocol `version` (already checked against
    /// the endpoint); `ws_batched` is the legacy `wsBatched=true` flag.
    pub fn open(&mut self, conn: ConnId, version: u32, ws_batched: bool) {
        self.conns
            .insert(conn, Connection::new(version, ws_batched));
    }

    /// A frame the client sent: acks on every version, and on `/subscribe` (v7+) the
    /// `reserve-snapshot` / `start-subscription` control messages, acked once processed.
    pub fn on_client_frame(&mut self, conn: ConnId, text: &str, now_ms: u64) -> Vec<Effect> {
        self.see(now_ms);
        let mut out = Vec::new();
        let Some(version) = self.conns.get(&conn).map(|c| c.version) else {
            return out;
        };
        let frame = match decode_upstream_frame(text) {
            Ok(frame) => frame,
            Err(e) => {
                let reason = close_reason(&e.to_string());
                self.close(conn, PROTOCOL_ERROR_CLOSE_CODE, reason, &mut out);
                return out;
            }
        };
        if let Frame::Ack { ack } = frame {
            return self.on_ack(conn, ack, now_ms);
        }
        if version < MIN_SUBSCRIBE_PROTOCOL_VERSION {
            let reason = close_reason(&format!(
                "expected only acks from a v{version} subscriber, found an application frame"
            ));
            self.close(conn, PROTOCOL_ERROR_CLOSE_CODE, reason, &mut out);
            return out;
        }
        let id = frame.id();
        for message in frame.into_messages() {
            out.extend(match message {
                UpstreamMessage::ReserveSnapshot(r) => self.reserve(conn, &r.task_id, now_ms),
                UpstreamMessage::StartSubscription(ctx) => self.subscribe(conn, ctx, now_ms),
            });
        }
        if let (Some(id), true) = (id, self.conns.contains_key(&conn)) {
            out.push(Effect::Send {
                conn,
                frame: Outgoing::Ack { id },
            });
        }
        out
    }

    /// Registers the subscription on `conn` (v≤6: from the URL; v7+: `start-subscription`).
    ///
    /// A wrong replica version is answered with `WrongReplicaVersion`. Otherwise the subscriber
    /// is registered, the task's snapshot reservation released, and its catch-up starts — at
    /// once, or at the end of the transaction in flight.
    pub fn subscribe(&mut self, conn: ConnId, ctx: SubscribeContext, now_ms: u64) -> Vec<Effect> {
        self.see(now_ms);
        let mut out = Vec::new();
        let Some(c) = self.conns.get_mut(&conn) else {
            out.push(Effect::Warn {
                conn: Some(conn),
                message: "subscription on a connection that is not open".to_owned(),
            });
            return out;
        };
        if c.subscriber.is_some() || c.closing.is_some() {
            let reason =
                close_reason("expected one start-subscription per connection, found another");
            self.close(conn, PROTOCOL_ERROR_CLOSE_CODE, reason, &mut out);
            return out;
        }
        if ctx.replica_version != self.config.replica_version {
            let message =
                wrong_replica_version_message(&self.config.replica_version, &ctx.replica_version);
            self.fail(conn, ErrorKind::WrongReplicaVersion, message, &mut out);
            return out;
        }
        let tracker_key = format!("{}/{}", ctx.id, conn.0);
        let mut sub = Subscriber::new(ctx.id, tracker_key.clone(), ctx.watermark);
        // Only v8 subscribers report backfills; the log's state stands in for the others.
        let backfills = ctx.backfills.filter(|_| c.version >= 8);
        match self.tracker.register(tracker_key, backfills) {
            Registration::Tracked => sub.tracked = true,
            Registration::Untracked => {}
            Registration::Invalid(e) => out.push(Effect::Warn {
                conn: Some(conn),
                message: format!(
                    "subscriber {} reported unusable backfills and is tracked as v7: {e}",
                    sub.id
                ),
            }),
        }
        c.subscriber = Some(sub);
        // Released only now, so the log is never unpinned while neither is known.
        if let Some(holder) = self.reservations.release(&ctx.task_id) {
            if holder != conn {
                let reason = format!(
                    "snapshot reservation of {} ended by its subscription",
                    ctx.task_id
                );
                self.close(holder, NORMAL_CLOSE_CODE, reason, &mut out);
            }
        }
        // A held commit is a transaction not yet ended for subscribers.
        if self.tx.is_none() && self.held_commit.is_none() {
            self.activate(conn, &mut out);
        }
        out
    }

    /// Opens a snapshot reservation for `task_id` on `conn` (`/snapshot`, or `reserve-snapshot`
    /// on `/subscribe`), replacing an older one of the same task. It is confirmed when a backup
    /// exists that the change log covers.
    pub fn reserve(&mut self, conn: ConnId, task_id: &str, now_ms: u64) -> Vec<Effect> {
        self.see(now_ms);
        let mut out = Vec::new();
        if !self.conns.contains_key(&conn) {
            return out;
        }
        if self.config.backup_url.is_none() {
            let reason = close_reason("backups are not configured");
            self.close(conn, PROTOCOL_ERROR_CLOSE_CODE, reason, &mut out);
            return out;
        }
        if let Some(old) = self.reservations.open(task_id, conn) {
            if old != conn {
                let reason = format!("snapshot reservation of {task_id} replaced by a newer one");
                self.close(old, NORMAL_CLOSE_CODE, reason, &mut out);
            }
        }
        self.confirm_reservations(&mut out);
        out
    }

    fn confirm_reservations(&mut self, out: &mut Vec<Effect>) {
        let (Some(backup), Some(url)) = (self.purge.backup(), &self.config.backup_url) else {
            return;
        };
        if self.log_min > *backup && !self.reservations.is_empty() {
            out.push(Effect::Warn {
                conn: None,
                message: format!(
                    "snapshot reservations wait: the change log starts at {}, \
                     after the backup at {backup}",
                    self.log_min
                ),
            });
        }
        for (_, holder) in self.reservations.confirm(backup, &self.log_min) {
            let Some(c) = self.conns.get_mut(&holder) else {
                continue;
            };
            let replica_size = self.replica_size.map(Number::from);
            let message = if c.version >= MIN_SUBSCRIBE_PROTOCOL_VERSION {
                DownstreamMessage::Reserved(Reserved {
                    backup_url: url.clone(),
                    replica_version: self.config.replica_version.clone(),
                    min_watermark: backup.clone(),
                    replica_size,
                    extra: Extra::new(),
                })
            } else {
                let mut extra = Extra::new();
                extra.insert("backupURL".to_owned(), Value::String(url.clone()));
                extra.insert(
                    "replicaVersion".to_owned(),
                    Value::String(self.config.replica_version.to_string()),
                );
                extra.insert("minWatermark".to_owned(), Value::String(backup.to_string()));
                if let Some(size) = replica_size {
                    extra.insert("replicaSize".to_owned(), Value::Number(size));
                }
                DownstreamMessage::Status(Status {
                    lag_report: None,
                    extra,
                })
            };
            let text: Arc<str> = encode_downstream(&message).into();
            for frame in c.frame(vec![(text, Default::default())]) {
                out.push(Effect::Send {
                    conn: holder,
                    frame,
                });
            }
        }
    }

    /// The client acknowledged frame `id` on `conn`.
    pub fn on_ack(&mut self, conn: ConnId, id: u64, now_ms: u64) -> Vec<Effect> {
        self.see(now_ms);
        let mut out = Vec::new();
        let Some(c) = self.conns.get_mut(&conn) else {
            return out;
        };
        let frame = match c.ack(id) {
            Ok(frame) => frame,
            Err(e) => {
                let reason = close_reason(&e.to_string());
                self.close(conn, PROTOCOL_ERROR_CLOSE_CODE, reason, &mut out);
                self.update_gate(&mut out);
                return out;
            }
        };
        if frame.is_error {
            self.close(
                conn,
                NORMAL_CLOSE_CODE,
                "error delivered".to_owned(),
                &mut out,
            );
            return out;
        }
        let limits = self.limits;
        let mut aligned = None;
        if let Some(sub) = c.subscriber.as_mut() {
            sub.on_acked(&frame.carried, limits);
            if sub.catchup_paused && sub.catchup_in_flight() <= limits.low {
                sub.catchup_paused = false;
                out.push(Effect::ResumeCatchup { conn });
            }
            if sub.phase == Phase::Draining {
                let mut d = Delivery::new(c.version, &mut self.tracker);
                if sub.drain(limits, &mut d) {
                    aligned = Some(sub.tracker_key.clone());
                }
                emit(conn, c, d, &mut out);
            }
        }
        if let Some(key) = aligned {
            self.aligned(&key, &mut out);
        }
        self.update_gate(&mut out);
        out
    }

    /// Change-log rows read for the catch-up of `conn`, in order (any number per call). Rows
    /// for a connection that is no longer catching up (closed, failed) are ignored.
    pub fn catchup_rows(
        &mut self,
        conn: ConnId,
        rows: impl IntoIterator<Item = CatchupRow>,
    ) -> Vec<Effect> {
        let mut out = Vec::new();
        let Some(c) = self.conns.get_mut(&conn) else {
            return out;
        };
        let Some(sub) = c.subscriber.as_mut() else {
            return out;
        };
        let Phase::CatchingUp { mut checked } = sub.phase else {
            return out;
        };
        let mut d = Delivery::new(c.version, &mut self.tracker);
        let mut failure = None;
        for row in rows {
            if !checked {
                let verdict = check_first_row(&row.watermark, &sub.requested);
                match verdict {
                    FirstRow::Continuous => {
                        checked = true;
                        sub.phase = Phase::CatchingUp { checked };
                        sub.ensure_status(&self.initial_status, &mut d);
                    }
                    FirstRow::TooOld { earliest } => {
                        failure = Some(too_old_message(&earliest, &sub.requested));
                        break;
                    }
                }
            }
            let entry = Arc::new(Entry::stored(row.watermark, &row.tag, &row.change));
            sub.catch_up(&entry, &mut d);
        }
        let pause =
            failure.is_none() && !sub.catchup_paused && sub.catchup_in_flight() >= self.limits.high;
        if pause {
            sub.catchup_paused = true;
        }
        emit(conn, c, d, &mut out);
        match failure {
            // Also for `mode=backup`: no subscriber can make the server reset (see
            // `check_first_row`).
            Some(message) => {
                self.fail(conn, ErrorKind::WatermarkTooOld, message, &mut out);
            }
            None if pause => out.push(Effect::PauseCatchup { conn }),
            None => {}
        }
        self.update_gate(&mut out);
        out
    }

    /// The catch-up of `conn` read its last row. With no row at all the subscriber is ahead of
    /// the durable log, which is fine (forwarding outruns storing).
    pub fn catchup_done(&mut self, conn: ConnId) -> Vec<Effect> {
        let mut out = Vec::new();
        self.caught_up(conn, &mut out);
        self.update_gate(&mut out);
        out
    }

    /// The catch-up read of `conn` failed; the subscriber reconnects and tries again.
    pub fn catchup_failed(&mut self, conn: ConnId, reason: &str) -> Vec<Effect> {
        let mut out = Vec::new();
        let reason = close_reason(&format!("catch-up from the change log failed: {reason}"));
        self.close(conn, INTERNAL_ERROR_CLOSE_CODE, reason, &mut out);
        self.update_gate(&mut out);
        out
    }

    /// The connection closed (by the peer or the network). Its reservation is cancelled.
    pub fn on_close(&mut self, conn: ConnId) -> Vec<Effect> {
        let mut out = Vec::new();
        self.forget(conn);
        self.update_gate(&mut out);
        out
    }

    // ---- backups, purging, time ----

    /// The replica backup reached `backup.watermark`. Earlier or repeated watermarks are
    /// ignored; a new one confirms waiting reservations and schedules a purge.
    pub fn backup_watermark(&mut self, backup: BackupWatermark, now_ms: u64) -> Vec<Effect> {
        self.see(now_ms);
        let mut out = Vec::new();
        if self
            .purge
            .on_backup(backup.watermark, now_ms, self.config.purge_delay_ms)
        {
            self.replica_size = backup.replica_size.or(self.replica_size);
            self.confirm_reservations(&mut out);
        }
        out
    }

    /// A purge finished; the change log now starts at `min_watermark`.
    pub fn on_purged(&mut self, min_watermark: Watermark) {
        self.log_min = min_watermark;
    }

    /// Timers: due purges, unacknowledged errors, subscribers stuck with a full backlog.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Effect> {
        self.see(now_ms);
        let mut out = Vec::new();
        if let Some(backup) = self.purge.take_due(now_ms) {
            let acks = self
                .conns
                .values()
                .filter_map(|c| c.subscriber.as_ref())
                .map(|s| &s.acked);
            let below = purge_floor(
                &backup,
                acks,
                self.reservations.reserved_watermarks(),
                &self.stored,
            )
            .clone();
            if below > self.log_min && self.purge.advance(&below) {
                out.push(Effect::Purge { below });
            }
        }
        let timeout = self.config.backlog_full_timeout_ms;
        let mut expired = Vec::new();
        let mut stuck = Vec::new();
        for (&conn, c) in &self.conns {
            if c.closing.is_some_and(|deadline| deadline <= now_ms) {
                expired.push(conn);
            }
            let since = c.subscriber.as_ref().and_then(|s| s.blocking_since);
            if let (Some(since), Some(timeout)) = (since, timeout) {
                if now_ms.saturating_sub(since) >= timeout {
                    stuck.push(conn);
                }
            }
        }
        for conn in expired {
            let reason = "error not acknowledged in time".to_owned();
            self.close(conn, NORMAL_CLOSE_CODE, reason, &mut out);
        }
        for conn in stuck {
            let reason = close_reason(&format!(
                "subscriber backlog stayed above {} bytes for {} ms",
                self.limits.high,
                timeout.unwrap_or_default()
            ));
            self.close(conn, TRY_AGAIN_LATER_CLOSE_CODE, reason, &mut out);
        }
        self.update_gate(&mut out);
        out
    }

    /// When [`Streamer::tick`] next has something to do.
    pub fn next_deadline(&self) -> Option<u64> {
        let timeout = self.config.backlog_full_timeout_ms;
        self.conns
            .values()
            .flat_map(|c| {
                let stuck = c
                    .subscriber
                    .as_ref()
                    .and_then(|s| s.blocking_since)
                    .zip(timeout)
                    .map(|(since, t)| since.saturating_add(t));
                [c.closing, stuck]
            })
            .chain([self.purge.next_due()])
            .flatten()
            .min()
    }

    // ---- internals ----

    fn see(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// Starts the catch-up of a registered subscriber (at a transaction boundary).
    fn activate(&mut self, conn: ConnId, out: &mut Vec<Effect>) {
        let Some(sub) = self
            .conns
            .get_mut(&conn)
            .and_then(|c| c.subscriber.as_mut())
        else {
            return;
        };
        sub.phase = Phase::CatchingUp { checked: false };
        if sub.watermark >= self.last_commit {
            // Nothing forwarded after its watermark: nothing to read.
            self.caught_up(conn, out);
        } else {
            out.push(Effect::FetchCatchup {
                conn,
                from: sub.watermark.clone(),
                through: self.last_commit.clone(),
            });
        }
    }

    fn activate_queued(&mut self, out: &mut Vec<Effect>) {
        let queued: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| {
                c.subscriber
                    .as_ref()
                    .is_some_and(|s| s.phase == Phase::Queued)
            })
            .map(|(&conn, _)| conn)
            .collect();
        for conn in queued {
            self.activate(conn, out);
        }
    }

    fn caught_up(&mut self, conn: ConnId, out: &mut Vec<Effect>) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(sub) = c.subscriber.as_mut() else {
            return;
        };
        if !matches!(sub.phase, Phase::CatchingUp { .. }) {
            return;
        }
        let mut d = Delivery::new(c.version, &mut self.tracker);
        sub.ensure_status(&self.initial_status, &mut d);
        sub.catchup_paused = false;
        sub.phase = Phase::Draining;
        let aligned = sub
            .drain(self.limits, &mut d)
            .then(|| sub.tracker_key.clone());
        emit(conn, c, d, out);
        if let Some(key) = aligned {
            self.aligned(&key, out);
        }
    }

    fn aligned(&mut self, tracker_key: &str, out: &mut Vec<Effect>) {
        self.tracker.mark_aligned(tracker_key);
        // Between transactions a restart can happen right away.
        if self.tx.is_none() && self.held_commit.is_none() {
            self.at_boundary(out);
        }
    }

    /// Sends `["error", …]`; the connection closes once it is acknowledged.
    fn fail(&mut self, conn: ConnId, kind: ErrorKind, message: String, out: &mut Vec<Effect>) {
        let deadline = self.now_ms.saturating_add(self.config.error_ack_timeout_ms);
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if let Some(sub) = c.subscriber.take() {
            self.tracker.unregister(&sub.tracker_key);
        }
        c.closing = Some(deadline);
        let error = DownstreamMessage::Error(StreamError::new(kind, message));
        let frames = c.frame_error(encode_downstream(&error).into());
        out.extend(frames.into_iter().map(|frame| Effect::Send { conn, frame }));
    }

    fn close(&mut self, conn: ConnId, code: u16, reason: String, out: &mut Vec<Effect>) {
        if self.forget(conn) {
            out.push(Effect::Close { conn, code, reason });
        }
    }

    /// Drops every trace of `conn`; returns whether it was known.
    fn forget(&mut self, conn: ConnId) -> bool {
        self.reservations.cancel_held_by(conn);
        let Some(c) = self.conns.shift_remove(&conn) else {
            return false;
        };
        if let Some(sub) = c.subscriber {
            self.tracker.unregister(&sub.tracker_key);
        }
        true
    }
}

/// Frames what a delivery collected for `conn` into effects.
fn emit(conn: ConnId, c: &mut Connection, d: Delivery, out: &mut Vec<Effect>) {
    emit_with(conn, d, out, |messages| c.frame(std::mem::take(messages)));
}

/// As [`emit`], for live messages of the upstream burst: held for one batch where the
/// connection takes batches, sharing the burst's payload with the other connections.
/// Returns the delivery's emptied message list, for the next delivery to fill.
fn emit_live(
    conn: ConnId,
    c: &mut Connection,
    d: Delivery,
    shared: &mut SharedBatch,
    out: &mut Vec<Effect>,
) -> Vec<(Arc<str>, subscriber::Carried)> {
    emit_with(conn, d, out, |messages| c.hold(messages, shared))
}

/// Frames the delivery's messages with `framer` (which empties the list) and reports its
/// warnings; returns the emptied list.
fn emit_with(
    conn: ConnId,
    d: Delivery,
    out: &mut Vec<Effect>,
    framer: impl FnOnce(&mut Vec<(Arc<str>, subscriber::Carried)>) -> Vec<Outgoing>,
) -> Vec<(Arc<str>, subscriber::Carried)> {
    let Delivery {
        out: mut messages,
        warnings,
        ..
    } = d;
    if !messages.is_empty() {
        for frame in framer(&mut messages) {
            out.push(Effect::Send { conn, frame });
        }
    }
    out.extend(warnings.into_iter().map(|message| Effect::Warn {
        conn: Some(conn),
        message,
    }));
    messages
}
