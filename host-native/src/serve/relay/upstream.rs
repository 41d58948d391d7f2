//! The relay's side of its primary's `/replication/v8/subscribe` socket
//! (`docs/protocol/change-stream.md`, "Endpoints"): the framed connection, and the change
//! source that subscribes from the relay's durable watermark, hands every frame to the ingest
//! thread's upstream session, and carries out what the session says back: which frames to
//! acknowledge, and when to end the connection. It decides none of it; liveness (silence past
//! the ping interval) is the engine's `Liveness` on plain values.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use highwater_engine::change_stream::{
    ack_frame, decode_downstream_frame, encode_upstream, message_frame, AckQueue, BackfillRequest,
    DownstreamMessage, Extra, Frame, SubscribeContext, SubscriberMode, UpstreamMessage,
};
use highwater_engine::upstream::Liveness;
use highwater_engine::watermark::Lsn;
use highwater_engine::watermark::Watermark;
use rusqlite::{Connection as Sqlite, OpenFlags};
use tokio::sync::{mpsc, watch};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{http, Message};
use tokio_tungstenite::WebSocketStream;

use super::{RelayError, Upstream, FIRST_BACKOFF, MAX_BACKOFF};
use crate::change_log::{self, ChangeLogError};
use crate::serve::source::{Confirm, PrimaryFeedback, Source, SourceEvent};

type Socket = WebSocketStream<crate::serve::snapshot_download::PeerStream>;

/// Messages buffered ahead of the ingest thread; while it does not take them (the streamer
/// paused upstream), the primary's socket is not read and TCP pushes back.
const EVENT_CAPACITY: usize = 1024;

/// How long the WebSocket handshake with the primary may take (after the TCP connection and
/// TLS handshake, bounded on their own).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the silence limit is looked at.
const LIVENESS_CHECK: Duration = Duration::from_millis(500);

/// What arrived from the primary.
#[derive(Debug)]
pub(super) enum Incoming {
    /// An application frame and the messages it carries.
    Frame {
        id: u64,
        messages: Vec<DownstreamMessage>,
    },
    /// A ping or pong: the primary is alive.
    Alive,
    /// The primary closed the socket (code and reason, if it gave them).
    Closed(Option<String>),
}

/// One framed `/subscribe` connection to the primary.
pub(super) struct UpstreamConnection {
    socket: Socket,
    /// Our frames (control messages) not yet acked by the primary.
    outgoing: AckQueue,
}

impl UpstreamConnection {
    /// Opens the socket: `ws://` over TCP, `wss://` over TLS checked against the relay's
    /// trust (`--from-ca-file`, else the system bundle).
    pub(super) async fn connect(upstream: &Upstream) -> Result<UpstreamConnection, RelayError> {
        let url = upstream.url.as_str();
        let failed = |reason: String| RelayError::Connect {
            url: url.to_owned(),
            reason,
        };
        let mut request = url
            .into_client_request()
            .map_err(|e| failed(e.to_string()))?;
        if let Some(token) = &upstream.token {
            request
                .headers_mut()
                .insert(http::header::AUTHORIZATION, token.authorization());
        }
        let uri = request.uri();
        let tls = match uri.scheme_str() {
            Some("ws") => false,
            Some("wss") => true,
            other => {
                return Err(failed(format!(
                    "expected a ws:// or wss:// URL, found scheme {:?}",
                    other.unwrap_or("")
                )))
            }
        };
        let host = uri
            .host()
            .ok_or_else(|| failed("expected a host in the URL".to_owned()))?
            .to_owned();
        let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let stream = upstream
            .client
            .connect(&host, port, tls)
            .await
            .map_err(failed)?;
        let handshake = tokio_tungstenite::client_async(request, stream);
        let (socket, _) = tokio::time::timeout(CONNECT_TIMEOUT, handshake)
            .await
            .map_err(|_| {
                failed(format!(
                    "no handshake within {} s",
                    CONNECT_TIMEOUT.as_secs()
                ))
            })?
            .map_err(|e| failed(e.to_string()))?;
        Ok(UpstreamConnection {
            socket,
            outgoing: AckQueue::new(),
        })
    }

    /// Sends a control message as `{"id","msg"}`.
    pub(super) async fn send(&mut self, message: &UpstreamMessage) -> Result<(), RelayError> {
        let id = self.outgoing.next_id();
        let text = message_frame(id, &encode_upstream(message));
        self.socket.send(Message::text(text)).await?;
        Ok(())
    }

    /// Acks frames `ids` of the primary, in order, with one flush.
    pub(super) async fn ack(&mut self, ids: &[u64]) -> Result<(), RelayError> {
        if ids.is_empty() {
            return Ok(());
        }
        for &id in ids {
            self.socket.feed(Message::text(ack_frame(id))).await?;
        }
        self.socket.flush().await?;
        Ok(())
    }

    /// The next application frame, ping or close. Acks of our frames are checked here; pings
    /// are answered by the socket while it is read. Cancel-safe.
    pub(super) async fn recv(&mut self) -> Result<Incoming, RelayError> {
        loop {
            let message = match self.socket.next().await {
                None => return Ok(Incoming::Closed(None)),
                Some(message) => message?,
            };
            match message {
                Message::Text(text) => match decode_downstream_frame(text.as_str())? {
                    Frame::Ack { ack } => self.outgoing.ack(ack)?,
                    Frame::Message { id, msg } => {
                        return Ok(Incoming::Frame {
                            id,
                            messages: vec![msg],
                        })
                    }
                    Frame::Batch { id, batch } => {
                        return Ok(Incoming::Frame {
                            id,
                            messages: batch,
                        })
                    }
                },
                Message::Binary(_) => {
                    return Err(RelayError::Protocol {
                        expected: "a text frame".to_owned(),
                        found: "a binary frame".to_owned(),
                    })
                }
                Message::Close(frame) => {
                    return Ok(Incoming::Closed(
                        frame.map(|f| format!("{} {}", u16::from(f.code), f.reason)),
                    ))
                }
                Message::Ping(_) | Message::Pong(_) => return Ok(Incoming::Alive),
                Message::Frame(_) => {}
            }
        }
    }

    pub(super) async fn close(mut self) {
        let _ = self.socket.close(None).await;
    }
}

/// Where and as whom the relay subscribes.
#[derive(Debug, Clone)]
pub(super) struct SubscribeTarget {
    pub upstream: Upstream,
    pub task_id: String,
    pub replica_version: Watermark,
    /// The relay's replica (its change log lives inside).
    pub(crate) replica_path: PathBuf,
    /// The primary pings at least this often; silence for longer means it is gone.
    pub(crate) liveness: Duration,
}

/// Reads the relay's position from its change log, beside the ingest thread's writer: a commit
/// visible to this connection is committed, not always synced yet (the ingest thread syncs its
/// WAL apart). Resubscribing from there is sound: this process holds those commits and syncs
/// them before it acknowledges their frames, and a relay that lost them in a power loss starts
/// from its older position, which the primary kept because it was never acknowledged.
struct DurableLog {
    conn: Sqlite,
}

impl DurableLog {
    fn open(path: &Path) -> Result<DurableLog, ChangeLogError> {
        let conn = Sqlite::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(Duration::from_secs(30))?;
        Ok(DurableLog { conn })
    }

    fn last_watermark(&self) -> Result<Watermark, ChangeLogError> {
        let status = change_log::status(&self.conn)?.ok_or(ChangeLogError::NotInitialized)?;
        Ok(status.last_watermark)
    }

    fn pending_backfills(&self) -> Result<Vec<BackfillRequest>, ChangeLogError> {
        change_log::cookie_jar(&self.conn)
    }
}

/// How one subscription ended.
enum Ended {
    Stopped,
    /// The primary cannot serve this replica: it must be restored again.
    RestoreRequired(String),
    Reconnect(String),
}

/// Streams from the primary into the ingest thread until `stop`. `handover` is the socket a
/// fresh restore reserved its snapshot on: the subscription starts on it. When the session
/// says the primary rejected the replica, `restore_required` is set and the source fails.
pub(super) fn spawn(
    target: SubscribeTarget,
    handover: Option<UpstreamConnection>,
    restore_required: Arc<AtomicBool>,
    stop: watch::Receiver<bool>,
) -> Source {
    let (tx, events) = mpsc::channel(EVENT_CAPACITY);
    let feedback = Arc::new(PrimaryFeedback::default());
    let task = {
        let feedback = feedback.clone();
        tokio::spawn(async move {
            let failure = run(target, handover, &tx, &feedback, &restore_required, stop).await;
            if let Some(reason) = failure {
                let _ = tx.send(SourceEvent::Failed(reason)).await;
            }
        })
    };
    Source {
        events,
        confirm: Confirm::Primary(feedback),
        // A primary's stream has no LSN to confirm.
        start: Lsn(0),
        task: Some(task),
    }
}

/// Returns why the source failed, or `None` when stopped.
async fn run(
    target: SubscribeTarget,
    mut handover: Option<UpstreamConnection>,
    events: &mpsc::Sender<SourceEvent>,
    feedback: &PrimaryFeedback,
    restore_required: &AtomicBool,
    mut stop: watch::Receiver<bool>,
) -> Option<String> {
    // Held as `&mut` across awaits: a SQLite connection may move between threads, but not be
    // shared by them.
    let mut log = match DurableLog::open(&target.replica_path) {
        Ok(log) => log,
        Err(error) => return Some(format!("cannot read the relay's change log: {error}")),
    };
    let mut backoff = crate::runtime::backoff(FIRST_BACKOFF, MAX_BACKOFF);
    // Connections numbered as the ingest thread numbers them: by the `Started` that opens each.
    let mut connection = 0u64;
    loop {
        // Whether the primary sent anything on this subscription (a later failure starts the
        // backoff over).
        let mut accepted = false;
        let connected = match handover.take() {
            Some(conn) => Ok(conn),
            None => tokio::select! {
                _ = until_stopped(&mut stop) => return None,
                _ = events.closed() => return None,
                connected = UpstreamConnection::connect(&target.upstream) => connected,
            },
        };
        let ended = match connected {
            Ok(conn) => {
                connection += 1;
                // A transaction cut off with the previous connection will not be completed.
                if !hand_on(events, SourceEvent::Started, &mut stop).await {
                    return None;
                }
                let subscribed = subscribe(
                    &target,
                    conn,
                    &mut log,
                    events,
                    Feedbacks {
                        feedback,
                        connection,
                    },
                    &mut stop,
                    &mut accepted,
                );
                subscribed
                    .await
                    .unwrap_or_else(|error| Ended::Reconnect(error.to_string()))
            }
            Err(error) => Ended::Reconnect(error.to_string()),
        };
        match ended {
            Ended::Stopped => return None,
            Ended::RestoreRequired(reason) => {
                restore_required.store(true, Ordering::SeqCst);
                return Some(format!(
                    "the primary cannot serve this replica ({reason}); it is wiped and restored \
                     from a new snapshot"
                ));
            }
            Ended::Reconnect(reason) => {
                if accepted {
                    backoff.reset();
                }
                let delay = crate::runtime::next_delay(&mut backoff);
                tracing::warn!(
                    %reason,
                    retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                    "the subscription to the primary ended; reconnecting"
                );
                tokio::select! {
                    _ = until_stopped(&mut stop) => return None,
                    _ = events.closed() => return None,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
}

/// Resolves once `stop` turns true (or its sender is gone), holding no borrow of its value.
async fn until_stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Hands an event to the ingest thread; `false` once stopped or the ingest thread is gone.
async fn hand_on(
    events: &mpsc::Sender<SourceEvent>,
    event: SourceEvent,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    tokio::select! {
        _ = stop.wait_for(|s| *s) => false,
        sent = events.send(event) => sent.is_ok(),
    }
}

/// The ingest thread's word for one connection.
#[derive(Clone, Copy)]
struct Feedbacks<'a> {
    feedback: &'a PrimaryFeedback,
    connection: u64,
}

impl Feedbacks<'_> {
    /// Sends the acks the session released; `Some` when it says the connection must end.
    async fn carry_out(&self, conn: &mut UpstreamConnection) -> Result<Option<Ended>, RelayError> {
        let feedback = self.feedback.take(self.connection);
        conn.ack(&feedback.acks).await?;
        Ok(feedback.reconnect.map(|(reason, restore)| {
            if restore {
                Ended::RestoreRequired(reason)
            } else {
                Ended::Reconnect(reason)
            }
        }))
    }
}

/// Milliseconds on this process's monotonic clock, for [`Liveness`].
fn now_ms(epoch: tokio::time::Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// One subscription: `start-subscription` from the durable watermark, then the stream.
/// `accepted` turns true once the primary sent a frame.
async fn subscribe(
    target: &SubscribeTarget,
    mut conn: UpstreamConnection,
    log: &mut DurableLog,
    events: &mpsc::Sender<SourceEvent>,
    feedback: Feedbacks<'_>,
    stop: &mut watch::Receiver<bool>,
    accepted: &mut bool,
) -> Result<Ended, RelayError> {
    let watermark = log.last_watermark()?;
    let context = SubscribeContext {
        task_id: target.task_id.clone(),
        id: target.task_id.clone(),
        mode: SubscriberMode::Serving,
        replica_version: target.replica_version.clone(),
        watermark: watermark.clone(),
        backfills: Some(log.pending_backfills()?),
        extra: Extra::new(),
    };
    conn.send(&UpstreamMessage::StartSubscription(context))
        .await?;
    tracing::info!(url = %target.upstream.url, %watermark, "subscribing to the primary");
    let epoch = tokio::time::Instant::now();
    let silence_limit = u64::try_from(target.liveness.as_millis()).unwrap_or(u64::MAX);
    let mut liveness = Liveness::new(None, Some(silence_limit), now_ms(epoch));
    let mut check = tokio::time::interval(LIVENESS_CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The frame handler needs `stop` too, while the select holds this one.
    let mut stopped = stop.clone();
    let ended = loop {
        tokio::select! {
            biased;
            _ = until_stopped(&mut stopped) => break Ended::Stopped,
            _ = events.closed() => break Ended::Stopped,
            _ = feedback.feedback.changed() => {
                if let Some(ended) = feedback.carry_out(&mut conn).await? {
                    break ended;
                }
            }
            _ = check.tick() => {
                if let Some(silence) = liveness.silent_past_limit(now_ms(epoch)) {
                    break Ended::Reconnect(format!(
                        "no message or ping from the primary for {} s",
                        silence / 1000
                    ));
                }
            }
            incoming = conn.recv() => {
                liveness.received(now_ms(epoch));
                match incoming? {
                    Incoming::Alive => {}
                    Incoming::Closed(close) => {
                        // The session may have asked to end first (the primary closes once its
                        // error is acknowledged).
                        if let Some(ended) = feedback.carry_out(&mut conn).await.ok().flatten() {
                            break ended;
                        }
                        break Ended::Reconnect(match close {
                            Some(close) => format!("the primary closed the connection ({close})"),
                            None => "the primary closed the connection".to_owned(),
                        });
                    }
                    Incoming::Frame { id, messages } => {
                        *accepted = true;
                        if !hand_on(events, SourceEvent::Frame { id, messages }, stop).await {
                            break Ended::Stopped;
                        }
                        // Waiting for the ingest thread is not the primary's silence.
                        liveness.received(now_ms(epoch));
                    }
                }
            }
        }
    };
    conn.close().await;
    Ok(ended)
}
