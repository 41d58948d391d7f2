//! What the host is asked to do: the effects a [`Streamer`](super::Streamer) returns.

use std::fmt;
use std::sync::Arc;

use super::entry::Entry;
use super::ConnId;
use crate::change_stream::{write_ack_frame, write_message_frame, BatchPayload, DownstreamMessage};
use crate::watermark::Watermark;

/// One frame for a downstream connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outgoing {
    /// `{"id":<id>,"msg":<message>}`; the message text is shared by every recipient.
    Message { id: u64, message: Arc<str> },
    /// `{"id":<id>` followed by the shared `,"batch":[…]}` payload.
    Batch { id: u64, payload: Arc<BatchPayload> },
    /// `{"ack":<id>}` for a frame the client sent (v7+).
    Ack { id: u64 },
}

impl Outgoing {
    /// The frame's id (`None` for an ack).
    pub fn id(&self) -> Option<u64> {
        match self {
            Outgoing::Message { id, .. } | Outgoing::Batch { id, .. } => Some(*id),
            Outgoing::Ack { .. } => None,
        }
    }

    /// The frame's JSON text.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = self.write_text(&mut out);
        out
    }

    /// Appends the frame's JSON text ([`Outgoing::to_text`]) to `out`, so a host can write
    /// every frame of a connection into one buffer it reuses.
    pub fn write_text(&self, out: &mut impl fmt::Write) -> fmt::Result {
        match self {
            Outgoing::Message { id, message } => write_message_frame(*id, message, out),
            Outgoing::Batch { id, payload } => payload.write_frame(*id, out),
            Outgoing::Ack { id } => write_ack_frame(*id, out),
        }
    }
}

/// A change-log row to write.
#[derive(Debug, Clone)]
pub struct StoredChange {
    entry: Arc<Entry>,
    watermark: Watermark,
    pos: u64,
}

impl StoredChange {
    /// The transaction's commit watermark.
    pub fn watermark(&self) -> &Watermark {
        &self.watermark
    }

    /// Position within the transaction: 0 for `begin`, the commit last.
    pub fn pos(&self) -> u64 {
        self.pos
    }

    /// The inner `tag`.
    pub fn tag(&self) -> &str {
        self.entry.tag()
    }

    /// The inner change object as JSON text (the change log's `change` column).
    pub fn change_json(&self) -> &str {
        self.entry.change_json()
    }

    /// The typed message (for cookie-jar updates of schema changes).
    pub fn message(&self) -> Option<&DownstreamMessage> {
        self.entry.message()
    }
}

/// A write to the change log (`docs/protocol/change-stream.md`, "Forward, store, ack"): one
/// store transaction per upstream transaction.
#[derive(Debug, Clone)]
pub enum LogOp {
    /// Open a store transaction and write the `begin` row (pos 0).
    Begin(StoredChange),
    /// Write a row of the open transaction.
    Append(StoredChange),
    /// Write the `commit` row, set `lastWatermark`, commit; then report
    /// [`Streamer::on_stored`](super::Streamer::on_stored).
    Commit(StoredChange),
    /// Discard the open store transaction.
    Abort,
}

/// What the host must do.
#[derive(Debug, Clone)]
pub enum Effect {
    /// Send a frame on a connection.
    Send {
        conn: ConnId,
        frame: Outgoing,
    },
    /// Close a connection (it is forgotten here already).
    Close {
        conn: ConnId,
        code: u16,
        reason: String,
    },
    /// Write to the change log.
    Store(LogOp),
    /// Read the change log for a subscriber: rows with `from <= watermark <= through` in
    /// `(watermark, pos)` order, fed to
    /// [`Streamer::catchup_rows`](super::Streamer::catchup_rows), then
    /// [`Streamer::catchup_done`](super::Streamer::catchup_done).
    FetchCatchup {
        conn: ConnId,
        from: Watermark,
        through: Watermark,
    },
    /// Too much catch-up data is unacknowledged: read no more rows for `conn` for now.
    PauseCatchup {
        conn: ConnId,
    },
    ResumeCatchup {
        conn: ConnId,
    },
    /// A subscriber's backlog is full: stop reading the upstream stream.
    PauseUpstream,
    ResumeUpstream,
    /// Restart the upstream stream (we are at a transaction boundary): once the storage
    /// queue has drained, read the cookie jar and the last watermark and start anew.
    RestartUpstream {
        reason: String,
    },
    /// Delete change-log rows with `watermark < below`; then report
    /// [`Streamer::on_purged`](super::Streamer::on_purged).
    Purge {
        below: Watermark,
    },
    /// Worth a log line.
    Warn {
        conn: Option<ConnId>,
        message: String,
    },
}

impl fmt::Display for Effect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Effect::Send { conn, frame } => write!(f, "send {conn} {}", frame.to_text()),
            Effect::Close { conn, code, reason } => write!(f, "close {conn} {code} {reason}"),
            Effect::Store(LogOp::Abort) => write!(f, "store abort"),
            Effect::Store(op) => {
                let (name, row) = match op {
                    LogOp::Begin(row) => ("begin", row),
                    LogOp::Append(row) => ("append", row),
                    LogOp::Commit(row) => ("commit", row),
                    LogOp::Abort => return Ok(()),
                };
                write!(
                    f,
                    "store {name} {}/{} {}",
                    row.watermark(),
                    row.pos(),
                    row.change_json()
                )
            }
            Effect::FetchCatchup {
                conn,
                from,
                through,
            } => write!(f, "fetch catchup {conn} {from}..={through}"),
            Effect::PauseCatchup { conn } => write!(f, "pause catchup {conn}"),
            Effect::ResumeCatchup { conn } => write!(f, "resume catchup {conn}"),
            Effect::PauseUpstream => write!(f, "pause upstream"),
            Effect::ResumeUpstream => write!(f, "resume upstream"),
            Effect::RestartUpstream { reason } => write!(f, "restart upstream: {reason}"),
            Effect::Purge { below } => write!(f, "purge below {below}"),
            Effect::Warn {
                conn: Some(conn),
                message,
            } => write!(f, "warn {conn}: {message}"),
            Effect::Warn {
                conn: None,
                message,
            } => write!(f, "warn: {message}"),
        }
    }
}

impl StoredChange {
    pub(super) fn new(entry: &Arc<Entry>, watermark: &Watermark, pos: u64) -> Self {
        StoredChange {
            entry: entry.clone(),
            watermark: watermark.clone(),
            pos,
        }
    }
}
