//! The shared heart of `serve`: the engine's [`Streamer`] behind one lock, the links to every
//! open WebSocket, and the routing of the effects the streamer returns.
//!
//! Every event — an upstream message, a client frame, a catch-up batch, a timer — goes through
//! [`Hub::call`], which runs the streamer and dispatches its effects *while still holding the
//! lock*. That keeps one total order: writes and catch-up reads enter the storage queue in the
//! order the streamer asked for them, so a catch-up read always sees every store requested
//! before it. The lock is never held across an await: all of it is plain, non-blocking code
//! (channel sends), and SQLite work happens on the ingest thread that drains the queue.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use highwater_engine::streamer::{ConnId, Effect, LogOp, Outgoing, Streamer};
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

/// The hub's side of one WebSocket.
struct Link {
    out: mpsc::UnboundedSender<ConnCommand>,
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
    epoch: Instant,
    fault: Fault,
}

impl Hub {
    /// A hub around `streamer`; returns the storage queue's receiving end for the ingest thread.
    pub fn new(
        streamer: Streamer,
        positions: Positions,
    ) -> (Arc<Hub>, mpsc::UnboundedReceiver<StorageOp>) {
        // Bounded by how it is used rather than by a capacity (a full queue could only be
        // answered by blocking under the streamer lock): the ingest thread, the only consumer,
        // drains it before it takes the next source event, so it holds the stores of one
        // event, plus at most one catch-up request per open connection (itself bounded by
        // `--max-connections`) and the timers' purges.
        let (storage, ops) = mpsc::unbounded_channel();
        let hub = Hub {
            streamer: Mutex::new(streamer),
            links: Mutex::new(HashMap::new()),
            storage,
            upstream_paused: watch::channel(false).0,
            positions: Mutex::new(positions),
            next_conn: AtomicU64::new(1),
            epoch: Instant::now(),
            fault: Fault::default(),
        };
        (Arc::new(hub), ops)
    }

    /// Where a poisoned lock of this server is reported.
    pub fn fault(&self) -> &Fault {
        &self.fault
    }

    /// Milliseconds since the hub started: the streamer's clock.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Runs `f` on the streamer and carries out the effects it returns.
    pub fn call(&self, f: impl FnOnce(&mut Streamer, u64) -> Vec<Effect>) {
        let now = self.now_ms();
        let mut streamer = self.fault.lock(&self.streamer, "streamer");
        let effects = f(&mut streamer, now);
        self.dispatch(effects);
    }

    /// Reads the streamer without producing effects.
    pub fn inspect<R>(&self, f: impl FnOnce(&Streamer) -> R) -> R {
        f(&self.fault.lock(&self.streamer, "streamer"))
    }

    /// Runs `f` on the streamer where the call returns a value and no effects.
    pub fn with<R>(&self, f: impl FnOnce(&mut Streamer) -> R) -> R {
        f(&mut self.fault.lock(&self.streamer, "streamer"))
    }

    fn dispatch(&self, effects: Vec<Effect>) {
        if effects.is_empty() {
            return;
        }
        let links = self.fault.lock(&self.links, "links");
        for effect in effects {
            match effect {
                Effect::Send { conn, frame } => {
                    if let Some(link) = links.get(&conn) {
                        let _ = link.out.send(ConnCommand::Frame(frame));
                    }
                }
                Effect::Close { conn, code, reason } => {
                    if let Some(link) = links.get(&conn) {
                        link.closing.send_replace(Some((code, reason.clone())));
                        let _ = link.out.send(ConnCommand::Close { code, reason });
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
                    tracing::debug!("a subscriber backlog is full: pausing the upstream stream");
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
    }

    fn enqueue(&self, op: StorageOp) {
        // The receiver lives as long as the ingest thread; after it stopped nothing is stored.
        let _ = self.storage.send(op);
    }

    // ---- upstream ----

    /// Follows whether the streamer wants the upstream stream paused.
    pub fn upstream_paused(&self) -> watch::Receiver<bool> {
        self.upstream_paused.subscribe()
    }

    // ---- positions ----

    pub fn positions(&self) -> Positions {
        self.fault.lock(&self.positions, "positions").clone()
    }

    pub fn set_last_watermark(&self, watermark: Watermark) {
        self.fault.lock(&self.positions, "positions").last_watermark = watermark;
    }

    pub fn set_min_watermark(&self, watermark: Watermark) {
        self.fault.lock(&self.positions, "positions").min_watermark = watermark;
    }

    // ---- connections ----

    /// Registers a new connection: its id, the commands it receives and its catch-up gate.
    pub fn connect(&self) -> (ConnId, mpsc::UnboundedReceiver<ConnCommand>) {
        let conn = ConnId(self.next_conn.fetch_add(1, Ordering::Relaxed));
        // Bounded by the streamer rather than by a capacity: everything sent to a subscriber
        // and not yet acknowledged (catch-up included) counts against its backlog, which
        // pauses catch-up and then the upstream at the high-water mark and closes the
        // subscriber (1013) once it stayed full past the timeout.
        let (out, commands) = mpsc::unbounded_channel();
        let link = Link {
            out,
            catchup_paused: watch::channel(false).0,
            closing: watch::channel(None).0,
        };
        self.fault.lock(&self.links, "links").insert(conn, link);
        (conn, commands)
    }

    /// Forgets a connection that ended, in the streamer too.
    pub fn disconnect(&self, conn: ConnId) {
        self.fault.lock(&self.links, "links").remove(&conn);
        self.call(|s, _| s.on_close(conn));
    }

    /// The catch-up gate of `conn`, if it is still open.
    pub fn catchup_gate(&self, conn: ConnId) -> Option<watch::Receiver<bool>> {
        self.fault
            .lock(&self.links, "links")
            .get(&conn)
            .map(|link| link.catchup_paused.subscribe())
    }

    /// The close `conn` is told to make, once it is; `None` if it is no longer open.
    pub fn closing_signal(&self, conn: ConnId) -> Option<watch::Receiver<Option<(u16, String)>>> {
        self.fault
            .lock(&self.links, "links")
            .get(&conn)
            .map(|link| link.closing.subscribe())
    }

    pub fn is_connected(&self, conn: ConnId) -> bool {
        self.fault.lock(&self.links, "links").contains_key(&conn)
    }

    pub fn connections(&self) -> usize {
        self.fault.lock(&self.links, "links").len()
    }

    /// Closes every connection (shutdown).
    pub fn close_all(&self, code: u16, reason: &str) {
        for link in self.fault.lock(&self.links, "links").values() {
            let _ = link.out.send(ConnCommand::Close {
                code,
                reason: reason.to_owned(),
            });
            link.closing.send_replace(Some((code, reason.to_owned())));
        }
    }
}
