//! The shared heart of `serve`: the engine's [`Streamer`] behind one lock, the links to every
//! open WebSocket, and the routing of the effects the streamer returns.
//!
//! Every event — an upstream message, a client frame, a catch-up batch, a timer — goes through
//! [`Hub::call`], which runs the streamer and dispatches its effects *while still holding the
//! lock*. That keeps one total order: writes and catch-up reads enter the storage queue in the
//! order the streamer asked for them, so a catch-up read always sees every store requested
//! before it. The lock is never held across an await: all of it is plain, non-blocking code
//! (channel sends), and SQLite work happens on the ingest thread that drains the queue.

pub(crate) mod connection;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use highwater_engine::streamer::{
    ConnId, Effect, LogOp, Outgoing, Streamer, UpstreamError, TRY_AGAIN_LATER_CLOSE_CODE,
};
use highwater_engine::watermark::Watermark;
use tokio::sync::{mpsc, watch};

use super::fault::Fault;
use crate::change_log::ChangeLogStatus;

/// What a connection task is told to do.
#[derive(Debug)]
pub(crate) enum ConnCommand {
    Frame(Outgoing),
    Close { code: u16, reason: String },
}

/// Work for the ingest thread, in the order the streamer asked for it.
#[derive(Debug)]
pub(crate) enum StorageOp {
    Store(LogOp),
    FetchCatchup {
        conn: ConnId,
        from: Watermark,
        through: Watermark,
    },
    Purge {
        below: Watermark,
    },
    RestartUpstream {
        reason: String,
    },
}

/// The smallest frame the streamer sends a subscriber (an ack, `{"ack":1}`, is 9 bytes; a
/// message frame is longer): used to turn the backlog's byte bound into a frame count.
const MIN_FRAME_BYTES: usize = 16;
/// Frames a connection's queue holds beyond its backlog's worth: the streamer checks the
/// backlog after each catch-up batch, so one batch (and one more read before the pause is seen)
/// may go past it, one frame per row at most; then acks of the client's frames, status and
/// error messages, the close.
const QUEUE_SLACK_FRAMES: usize = 2 * crate::change_log::DEFAULT_CATCHUP_BATCH_ROWS + 1024;
/// Close reason for a subscriber whose outbound queue overflowed.
const QUEUE_FULL_REASON: &str = "slow consumer: the outbound queue is full";

/// The hub's side of one WebSocket.
struct Link {
    out: mpsc::Sender<ConnCommand>,
    /// `true` while the streamer wants this connection's catch-up read paused.
    catchup_paused: watch::Sender<bool>,
    /// The close (code, reason), set with the close command: a connection stuck writing to a
    /// peer that stopped reading would otherwise never get to the command.
    closing: watch::Sender<Option<(u16, String)>>,
}

/// Positions shown by `/health` and used for backup watermarks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Positions {
    pub replica_version: Watermark,
    /// The newest durable commit.
    pub last_watermark: Watermark,
    /// The earliest watermark left in the change log.
    pub min_watermark: Watermark,
}

impl From<&ChangeLogStatus> for Positions {
    fn from(status: &ChangeLogStatus) -> Self {
        Positions {
            replica_version: status.replica_version.clone(),
            last_watermark: status.last_watermark.clone(),
            min_watermark: status.min_watermark.clone(),
        }
    }
}

pub(crate) struct Hub {
    streamer: Mutex<Streamer>,
    links: Mutex<HashMap<ConnId, Link>>,
    storage: mpsc::UnboundedSender<StorageOp>,
    upstream_paused: watch::Sender<bool>,
    positions: Mutex<Positions>,
    next_conn: AtomicU64,
    /// Capacity of each connection's outbound queue, in frames.
    queue_frames: usize,
    epoch: Instant,
    fault: Fault,
    /// Durable SQLite commits of upstream transactions, and the transactions they held.
    store_commits: AtomicU64,
    stored_transactions: AtomicU64,
    /// What the ingest thread records for `/metrics`.
    recorded: Arc<super::metrics::Recorded>,
}

impl Hub {
    /// A hub around `streamer`; returns the storage queue's receiving end for the ingest thread.
    pub(crate) fn new(
        streamer: Streamer,
        positions: Positions,
    ) -> (Arc<Hub>, mpsc::UnboundedReceiver<StorageOp>) {
        // Bounded by how it is used rather than by a capacity (a full queue could only be
        // answered by blocking under the streamer lock): the ingest thread, the only consumer,
        // drains it before it takes the next source event, so it holds the stores of one
        // event, plus at most one catch-up request per open connection (itself bounded by
        // `--max-connections`) and the timers' purges.
        let (storage, ops) = mpsc::unbounded_channel();
        let queue_frames = queue_frames(streamer.config().backlog_high_water_bytes);
        let hub = Hub {
            streamer: Mutex::new(streamer),
            links: Mutex::new(HashMap::new()),
            storage,
            upstream_paused: watch::channel(false).0,
            positions: Mutex::new(positions),
            next_conn: AtomicU64::new(1),
            queue_frames,
            epoch: Instant::now(),
            fault: Fault::default(),
            store_commits: AtomicU64::new(0),
            stored_transactions: AtomicU64::new(0),
            recorded: Arc::default(),
        };
        (Arc::new(hub), ops)
    }

    /// Where a poisoned lock of this server is reported.
    pub(crate) fn fault(&self) -> &Fault {
        &self.fault
    }

    /// Milliseconds since the hub started: the streamer's clock.
    pub(crate) fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Runs `f` on the streamer and carries out the effects it returns.
    pub(crate) fn call(&self, f: impl FnOnce(&mut Streamer, u64) -> Vec<Effect>) {
        let now = self.now_ms();
        let mut streamer = self.fault.lock(&self.streamer, "streamer");
        let effects = f(&mut streamer, now);
        let mut overflowed = self.dispatch(effects);
        // A connection whose queue overflowed is closed in the streamer at once, so its backlog
        // holds up no one while its task writes out what was queued.
        while let Some(conn) = overflowed.pop() {
            let effects = streamer.on_close(conn);
            overflowed.extend(self.dispatch(effects));
        }
    }

    /// Runs an upstream-side call of the streamer and carries out its effects; a message it
    /// rejects changed nothing, and the rejection is returned.
    pub(crate) fn try_call(
        &self,
        f: impl FnOnce(&mut Streamer) -> Result<Vec<Effect>, UpstreamError>,
    ) -> Result<(), UpstreamError> {
        let mut rejected = None;
        self.call(|s, _| {
            f(s).unwrap_or_else(|e| {
                rejected = Some(e);
                Vec::new()
            })
        });
        rejected.map_or(Ok(()), Err)
    }

    /// Reads the streamer without producing effects.
    pub(crate) fn inspect<R>(&self, f: impl FnOnce(&Streamer) -> R) -> R {
        f(&self.fault.lock(&self.streamer, "streamer"))
    }

    /// Runs `f` on the streamer where the call returns a value and no effects.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Streamer) -> R) -> R {
        f(&mut self.fault.lock(&self.streamer, "streamer"))
    }

    /// Carries out `effects`; returns the connections whose queue overflowed (see [`queue`]).
    fn dispatch(&self, effects: Vec<Effect>) -> Vec<ConnId> {
        let mut overflowed = Vec::new();
        if effects.is_empty() {
            return overflowed;
        }
        let mut links = self.fault.lock(&self.links, "links");
        for effect in effects {
            match effect {
                Effect::Send { conn, frame } => {
                    if !queue(&mut links, conn, ConnCommand::Frame(frame)) {
                        overflowed.push(conn);
                    }
                }
                Effect::Close { conn, code, reason } => {
                    if let Some(link) = links.get(&conn) {
                        link.closing.send_replace(Some((code, reason.clone())));
                    }
                    if !queue(&mut links, conn, ConnCommand::Close { code, reason }) {
                        overflowed.push(conn);
                    }
                }
                Effect::Store(op) => self.enqueue(StorageOp::Store(op)),
                Effect::FetchCatchup {
                    conn,
                    from,
                    through,
                } => self.enqueue(StorageOp::FetchCatchup {
                    conn,
                    from,
                    through,
                }),
                Effect::Purge { below } => self.enqueue(StorageOp::Purge { below }),
                Effect::RestartUpstream { reason } => {
                    self.enqueue(StorageOp::RestartUpstream { reason })
                }
                Effect::PauseCatchup { conn } | Effect::ResumeCatchup { conn } => {
                    let paused = matches!(effect, Effect::PauseCatchup { .. });
                    if let Some(link) = links.get(&conn) {
                        link.catchup_paused.send_replace(paused);
                    }
                }
                Effect::PauseUpstream => {
                    tracing::debug!(
                        "pausing the upstream stream (a subscriber backlog is full, or a \
                         backfill's commit waits to be durable)"
                    );
                    self.upstream_paused.send_replace(true);
                }
                Effect::ResumeUpstream => {
                    tracing::debug!("resuming the upstream stream");
                    self.upstream_paused.send_replace(false);
                }
                Effect::Warn { conn, message } => match conn {
                    Some(conn) => tracing::warn!(%conn, "{message}"),
                    None => tracing::warn!("{message}"),
                },
            }
        }
        overflowed
    }

    fn enqueue(&self, op: StorageOp) {
        // The receiver lives as long as the ingest thread; after it stopped nothing is stored.
        let _ = self.storage.send(op);
    }

    // ---- upstream ----

    /// Follows whether the streamer wants the upstream stream paused.
    pub(crate) fn upstream_paused(&self) -> watch::Receiver<bool> {
        self.upstream_paused.subscribe()
    }

    // ---- positions ----

    pub(crate) fn positions(&self) -> Positions {
        self.fault.lock(&self.positions, "positions").clone()
    }

    pub(crate) fn set_last_watermark(&self, watermark: Watermark) {
        self.fault.lock(&self.positions, "positions").last_watermark = watermark;
    }

    /// One sync made `transactions` upstream transactions durable (group commit; with the WAL
    /// synced apart, one sync may cover several SQLite commits).
    pub(crate) fn note_durable(&self, transactions: usize) {
        self.store_commits.fetch_add(1, Ordering::Relaxed);
        self.stored_transactions.fetch_add(
            u64::try_from(transactions).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// What the ingest thread records for `/metrics`.
    pub(crate) fn recorded(&self) -> &Arc<super::metrics::Recorded> {
        &self.recorded
    }

    /// Syncs that made commits durable so far, and the upstream transactions they stored.
    pub(crate) fn store_counts(&self) -> (u64, u64) {
        (
            self.store_commits.load(Ordering::Relaxed),
            self.stored_transactions.load(Ordering::Relaxed),
        )
    }

    pub(crate) fn set_min_watermark(&self, watermark: Watermark) {
        self.fault.lock(&self.positions, "positions").min_watermark = watermark;
    }

    // ---- connections ----

    /// Registers a new connection: its id, the commands it receives and its catch-up gate.
    ///
    /// Its queue is bounded by [`queue_frames`]. Everything the streamer sends a subscriber
    /// and that is not yet acknowledged (catch-up included) counts against its backlog, which
    /// pauses catch-up and then the upstream at the high-water mark and closes the subscriber
    /// (1013) once it stayed full past the timeout; the queue holds a backlog's worth of the
    /// smallest frames and more, so under those rules it never fills. It fills only when
    /// frames the backlog does not count pile up (acks of a client that sends and never
    /// reads): see [`queue`].
    pub(crate) fn connect(&self) -> (ConnId, mpsc::Receiver<ConnCommand>) {
        let conn = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        let (out, commands) = mpsc::channel(self.queue_frames);
        let link = Link {
            out,
            catchup_paused: watch::channel(false).0,
            closing: watch::channel(None).0,
        };
        self.fault.lock(&self.links, "links").insert(conn, link);
        (conn, commands)
    }

    /// Forgets a connection that ended, in the streamer too.
    pub(crate) fn disconnect(&self, conn: ConnId) {
        self.fault.lock(&self.links, "links").remove(&conn);
        self.call(|s, _| s.on_close(conn));
    }

    /// The catch-up gate of `conn`, if it is still open.
    pub(crate) fn catchup_gate(&self, conn: ConnId) -> Option<watch::Receiver<bool>> {
        self.fault
            .lock(&self.links, "links")
            .get(&conn)
            .map(|link| link.catchup_paused.subscribe())
    }

    /// The close `conn` is told to make, once it is; `None` if it is no longer open.
    pub(crate) fn closing_signal(
        &self,
        conn: ConnId,
    ) -> Option<watch::Receiver<Option<(u16, String)>>> {
        self.fault
            .lock(&self.links, "links")
            .get(&conn)
            .map(|link| link.closing.subscribe())
    }

    pub(crate) fn is_connected(&self, conn: ConnId) -> bool {
        self.fault.lock(&self.links, "links").contains_key(&conn)
    }

    pub(crate) fn connections(&self) -> usize {
        self.fault.lock(&self.links, "links").len()
    }

    /// Closes every connection (shutdown).
    pub(crate) fn close_all(&self, code: u16, reason: &str) {
        let mut links = self.fault.lock(&self.links, "links");
        let conns: Vec<ConnId> = links.keys().copied().collect();
        for conn in conns {
            if let Some(link) = links.get(&conn) {
                link.closing.send_replace(Some((code, reason.to_owned())));
            }
            let reason = reason.to_owned();
            // Shutting down: a full queue is dropped all the same, and the streamer goes too.
            let _ = queue(&mut links, conn, ConnCommand::Close { code, reason });
        }
    }
}

/// Frames a connection's outbound queue holds: the backlog's high-water mark in the smallest
/// frames, plus slack. A tokio channel allocates its slots as they fill, so an idle queue costs
/// nothing; a full one about 40 bytes a slot besides the frames (which the backlog counts).
fn queue_frames(backlog_high_water_bytes: usize) -> usize {
    (backlog_high_water_bytes / MIN_FRAME_BYTES).saturating_add(QUEUE_SLACK_FRAMES)
}

/// Queues `command` for `conn`; `false` when its queue was full. A full queue ends the
/// connection as a subscriber over its backlog is ended: its link goes (nothing more is queued,
/// so what it still gets is a gap-free prefix of its stream), it is told to close with 1013,
/// the caller closes it in the streamer, and once its task has written what was queued — or
/// given up on a peer that stopped reading — it closes the socket.
fn queue(links: &mut HashMap<ConnId, Link>, conn: ConnId, command: ConnCommand) -> bool {
    let Some(link) = links.get(&conn) else {
        return true;
    };
    match link.out.try_send(command) {
        Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            tracing::warn!(%conn, "the outbound queue of a connection is full: closing it");
            if let Some(link) = links.remove(&conn) {
                let close = (TRY_AGAIN_LATER_CLOSE_CODE, QUEUE_FULL_REASON.to_owned());
                // Kept by the receivers after the sender goes with the link.
                link.closing.send_if_modified(|closing| {
                    let unset = closing.is_none();
                    if unset {
                        *closing = Some(close);
                    }
                    unset
                });
            }
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(n: u64) -> Watermark {
        highwater_engine::watermark::Lsn(n).to_watermark()
    }

    #[test]
    fn a_full_outbound_queue_closes_that_connection_with_1013_after_a_gap_free_prefix() {
        use highwater_engine::streamer::{ChangeLogState, StreamerConfig};
        let mut config = StreamerConfig::new(w(1));
        config.backlog_high_water_bytes = 100 * MIN_FRAME_BYTES;
        let capacity = queue_frames(config.backlog_high_water_bytes);
        assert_eq!(capacity, 100 + QUEUE_SLACK_FRAMES);
        let log = ChangeLogState {
            last_watermark: w(1),
            min_watermark: w(1),
        };
        let positions = Positions {
            replica_version: w(1),
            last_watermark: w(1),
            min_watermark: w(1),
        };
        let (hub, _ops) = Hub::new(Streamer::new(config, log), positions);
        let (flooded, mut commands) = hub.connect();
        let (other, mut other_commands) = hub.connect();
        let closing = hub.closing_signal(flooded).expect("open");
        hub.call(|s, now| {
            use highwater_engine::change_stream::{Extra, SubscribeContext, SubscriberMode};
            s.open(flooded, 6, false);
            let context = SubscribeContext {
                task_id: "t".to_owned(),
                id: "flooded".to_owned(),
                mode: SubscriberMode::Serving,
                replica_version: w(1),
                watermark: w(1),
                backfills: None,
                extra: Extra::new(),
            };
            s.subscribe(flooded, context, now)
        });
        assert!(hub.inspect(|s| s.subscriber(flooded).is_some()));
        // What the subscription sent so far (its status) comes first.
        let mut early = Vec::new();
        while let Ok(ConnCommand::Frame(frame)) = commands.try_recv() {
            early.push(frame);
        }
        let acks = |conn, ids: std::ops::Range<u64>| {
            ids.map(|id| Effect::Send {
                conn,
                frame: Outgoing::Ack { id },
            })
            .collect::<Vec<_>>()
        };
        let sent = u64::try_from(capacity).expect("fits") + 500;
        hub.call(|_, _| acks(flooded, 0..sent));
        hub.call(|_, _| acks(other, 0..3));
        // Dropped from the hub, told to close with 1013; the other connection goes on.
        assert!(!hub.is_connected(flooded));
        assert!(hub.is_connected(other));
        let close = closing.borrow().clone().expect("told to close");
        assert_eq!(close.0, TRY_AGAIN_LATER_CLOSE_CODE);
        assert!(close.1.starts_with("slow consumer"), "{}", close.1);
        // What it still gets is the first `capacity` frames, in order, and then the end.
        let mut ids = Vec::new();
        while let Ok(command) = commands.try_recv() {
            match command {
                ConnCommand::Frame(frame) => ids.push(frame.to_text()),
                ConnCommand::Close { .. } => panic!("no room was left for a close command"),
            }
        }
        let expected: Vec<String> = (0..capacity)
            .map(|id| format!(r#"{{"ack":{id}}}"#))
            .collect();
        assert_eq!(ids, expected);
        assert!(matches!(
            commands.try_recv(),
            Err(mpsc::error::TryRecvError::Disconnected)
        ));
        // The streamer forgot it at once: nothing it holds counts against anyone.
        assert!(hub.inspect(|s| s.subscriber(flooded).is_none()));
        // Later frames for it go nowhere; the other connection's three arrived.
        hub.call(|_, _| acks(flooded, sent..sent + 1));
        assert!(commands.try_recv().is_err());
        let mut others = 0;
        while other_commands.try_recv().is_ok() {
            others += 1;
        }
        assert_eq!(others, 3);
    }
}
