//! One change-stream WebSocket: frames the streamer produced go out, client frames go to the
//! streamer, and a ping every interval drops a peer that went silent
//! (`docs/protocol/change-stream.md`, "Liveness").
//!
//! Each frame's text is written into one buffer the connection reuses (`FrameBuffer`), so a
//! batch payload the streamer shares among connections ([`Outgoing::Batch`]) is still copied
//! once per connection. Sending the shared payload without that copy would take WebSocket
//! continuation frames (the frame's own `{"id":…` head, then the shared bytes), which axum's
//! `WebSocket` does not expose; it is not built.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use bytes::BytesMut;
use futures::{SinkExt, StreamExt};
use highwater_engine::change_stream::{close_reason, PROTOCOL_ERROR_CLOSE_CODE};
use highwater_engine::liveness;
use highwater_engine::streamer::{ConnId, Effect, Outgoing};
use tokio::sync::{mpsc, watch};

use super::{ConnCommand, Hub};

/// How long to wait for the peer's answer to our close frame.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// How long the close frame may take to get through to a peer that stopped reading (behind
/// whatever was already written to it) before the socket is dropped.
const CLOSE_WRITE_GRACE: Duration = Duration::from_secs(5);

/// Largest frame a change-stream subscriber may send (its frames are small control messages:
/// subscribe, ack, status); a larger one closes that connection with 1009.
pub(crate) const MAX_CLIENT_FRAME_BYTES: usize = 1 << 20;
/// Each WebSocket's read buffer. A peer's frames here are small (acks, control messages,
/// scope-sync requests); a larger frame still arrives whole (the buffer grows to the frame's
/// length), read in chunks of this size. tungstenite zero-fills the free part of the buffer
/// before every read, so its 128 KiB default cost a 128 KiB memset per ack under load, and as
/// much memory per idle connection.
pub(crate) const READ_BUFFER_BYTES: usize = 8 * 1024;
/// WebSocket close code for a frame over the size limit.
pub(crate) const TOO_BIG_CLOSE_CODE: u16 = 1009;

/// Frames written before one flush.
const MAX_FRAMES_PER_FLUSH: usize = 256;

/// Sends a close frame right away (a request rejected before any stream began).
pub(crate) async fn reject(mut socket: WebSocket, code: u16, reason: String) {
    let frame = CloseFrame {
        code,
        reason: reason.into(),
    };
    if socket.send(Message::Close(Some(frame))).await.is_ok() {
        await_close(&mut socket).await;
    }
}

/// Reads until the peer's close (or the grace period ends), so the close frame is delivered.
async fn await_close<S>(stream: &mut S)
where
    S: futures::Stream<Item = Result<Message, axum::Error>> + Unpin,
{
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        while let Some(Ok(message)) = stream.next().await {
            if matches!(message, Message::Close(_)) {
                break;
            }
        }
    })
    .await;
}

/// Runs a registered connection until either side closes it. `start` opens the stream in the
/// streamer (subscribe, or reserve a snapshot); its effects may already address `conn`.
pub(crate) async fn run(
    socket: WebSocket,
    hub: Arc<Hub>,
    conn: ConnId,
    mut commands: mpsc::Receiver<ConnCommand>,
    ping_interval: Duration,
    start: impl FnOnce(&mut highwater_engine::streamer::Streamer, u64) -> Vec<Effect>,
) {
    hub.call(start);
    let mut closing = hub.closing_signal(conn);
    let (mut sink, mut stream) = socket.split();
    let mut ping = tokio::time::interval(ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ping.tick().await;
    // When anything last arrived from the peer (the engine's liveness rule judges it).
    let clock = std::time::Instant::now();
    let elapsed_ms = || u64::try_from(clock.elapsed().as_millis()).unwrap_or(u64::MAX);
    let mut last_heard_ms = 0;
    let ping_interval_ms = u64::try_from(ping_interval.as_millis()).unwrap_or(u64::MAX);
    let mut close: Option<CloseFrame> = None;
    let mut frames = FrameBuffer::default();
    loop {
        tokio::select! {
            command = commands.recv() => {
                let Some(command) = command else {
                    // The hub dropped this connection (its queue overflowed): the close it
                    // asked for follows what was queued.
                    close = told_to_close(&closing);
                    break;
                };
                let written = match unless_stuck(write(&mut sink, command, &mut commands, &mut frames), &mut closing).await {
                    Ok(written) => written,
                    Err(frame) => {
                        close = Some(frame);
                        break;
                    }
                };
                match written {
                    Ok(None) => {}
                    Ok(Some(frame)) => {
                        close = Some(frame);
                        break;
                    }
                    Err(_) => break,
                }
            }
            message = stream.next() => {
                last_heard_ms = elapsed_ms();
                match message {
                    Some(Ok(Message::Text(text))) => {
                        hub.call(|s, now| s.on_client_frame(conn, text.as_str(), now));
                    }
                    Some(Ok(Message::Binary(_))) => {
                        let reason = close_reason("expected text frames, found a binary frame");
                        close = Some(CloseFrame { code: PROTOCOL_ERROR_CLOSE_CODE, reason: reason.into() });
                        break;
                    }
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(Err(error)) if too_big(&error) => {
                        let reason = close_reason("expected frames of at most 1 MiB, got a larger one");
                        close = Some(CloseFrame { code: TOO_BIG_CLOSE_CODE, reason: reason.into() });
                        break;
                    }
                    Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
                }
            }
            _ = ping.tick() => {
                if liveness::peer_is_gone(last_heard_ms, elapsed_ms(), ping_interval_ms) {
                    tracing::info!(%conn, "no message or pong for two ping intervals: closing");
                    break;
                }
                let ping = sink.send(Message::Ping(Default::default()));
                match unless_stuck(ping, &mut closing).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => break,
                    Err(frame) => {
                        close = Some(frame);
                        break;
                    }
                }
            }
        }
    }
    hub.disconnect(conn);
    if let Some(frame) = close {
        let sent = tokio::time::timeout(CLOSE_WRITE_GRACE, sink.send(Message::Close(Some(frame))));
        match sent.await {
            Ok(Ok(())) => await_close(&mut stream).await,
            Ok(Err(_)) => {}
            Err(_) => tracing::info!(%conn, "the peer is not reading: dropping the connection"),
        }
    }
}

/// Whether a read failed because the frame was over the size limit.
pub(crate) fn too_big(error: &axum::Error) -> bool {
    let text = error.to_string();
    text.contains("too long") || text.contains("Space limit") || text.contains("too big")
}

/// Runs a write. A peer that stopped reading blocks it for good, and then the close the hub
/// asks for would never get its turn: once told to close, the write gets [`CLOSE_GRACE`] to
/// finish, else the close frame is returned instead.
async fn unless_stuck<T>(
    write: impl std::future::Future<Output = T>,
    closing: &mut Option<watch::Receiver<Option<(u16, String)>>>,
) -> Result<T, CloseFrame> {
    tokio::pin!(write);
    tokio::select! {
        biased;
        done = &mut write => Ok(done),
        frame = signalled(closing) => match tokio::time::timeout(CLOSE_GRACE, write).await {
            Ok(done) => Ok(done),
            Err(_) => Err(frame),
        },
    }
}

/// The close the hub asked for, if it did.
fn told_to_close(closing: &Option<watch::Receiver<Option<(u16, String)>>>) -> Option<CloseFrame> {
    let (code, reason) = closing.as_ref()?.borrow().clone()?;
    Some(CloseFrame {
        code,
        reason: reason.into(),
    })
}

/// The close frame, once the hub told this connection to close (never, without a signal).
async fn signalled(closing: &mut Option<watch::Receiver<Option<(u16, String)>>>) -> CloseFrame {
    if let Some(closing) = closing {
        if let Ok(close) = closing.wait_for(Option::is_some).await {
            if let Some((code, reason)) = close.clone() {
                return CloseFrame {
                    code,
                    reason: reason.into(),
                };
            }
        }
    }
    std::future::pending().await
}

/// The text of a connection's frames, written into one allocation that is reused once the
/// socket has taken the frame before it. A burst's batch frame is tens of KiB per subscriber:
/// a fresh `String` for each was, at 100 subscribers, page faults for about a sixth of the
/// server's CPU (glibc gives the freed memory of a thread's arena back to the kernel).
/// It holds at most the largest frame the connection was sent (frames are bounded).
#[derive(Default)]
struct FrameBuffer {
    buf: BytesMut,
}

impl FrameBuffer {
    fn text(&mut self, frame: &Outgoing) -> Utf8Bytes {
        // `BytesMut` reclaims its allocation here once the previous frame's bytes are dropped.
        self.buf.clear();
        // Writing to a `BytesMut` cannot fail.
        let _ = frame.write_text(&mut self.buf);
        let bytes = self.buf.split().freeze();
        // The engine writes frames from `str`s, so the check passes; were it ever to fail,
        // the frame goes as a `String` of its own instead.
        Utf8Bytes::try_from(bytes).unwrap_or_else(|_| Utf8Bytes::from(frame.to_text()))
    }
}

/// Writes `first` and whatever else is queued (up to a bound), then flushes once. Returns the
/// close frame to end with, if a command asked for one.
async fn write<S>(
    sink: &mut S,
    first: ConnCommand,
    commands: &mut mpsc::Receiver<ConnCommand>,
    frames: &mut FrameBuffer,
) -> Result<Option<CloseFrame>, axum::Error>
where
    S: futures::Sink<Message, Error = axum::Error> + Unpin,
{
    let mut next = Some(first);
    let mut written = 0;
    while let Some(command) = next.take() {
        match command {
            ConnCommand::Frame(frame) => {
                sink.feed(Message::Text(frames.text(&frame))).await?;
                written += 1;
            }
            ConnCommand::Close { code, reason } => {
                sink.flush().await?;
                return Ok(Some(CloseFrame {
                    code,
                    reason: reason.into(),
                }));
            }
        }
        if written < MAX_FRAMES_PER_FLUSH {
            next = commands.try_recv().ok();
        }
    }
    sink.flush().await?;
    Ok(None)
}
