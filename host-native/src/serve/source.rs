//! The change source: what the ingest thread's upstream session takes in (raw pgoutput
//! payloads from Postgres, or a relay's frames from its primary), and where the session's
//! confirmations go back to. No rule lives here: the engine's `UpstreamSession` on the ingest
//! thread decodes, skips, orders and decides every confirmation.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use highwater_engine::change_stream::DownstreamMessage;
use highwater_engine::watermark::Lsn;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;

use crate::replication::{Acker, StreamConfig, WalEvent, WalStream};

/// Upstream events buffered ahead of the ingest thread. While it does not take them (the
/// streamer paused upstream), the replication stream stops reading the socket.
const EVENT_CAPACITY: usize = 1024;
/// The same buffer bounded in bytes (pgoutput bytes of its messages), so large rows do not
/// multiply it; a larger message still goes through, alone.
const EVENT_BUDGET_BYTES: usize = 4 * 1024 * 1024;
/// Raw payloads the replication stream reads ahead of the pump: the buffer above is the real
/// one.
const PAYLOADS_AHEAD: usize = 64;

/// One upstream event: an input of the ingest thread's upstream session.
#[derive(Debug)]
pub(crate) enum SourceEvent {
    /// A new session: the replication stream (re)started, or a new connection to the primary.
    Started,
    /// One CopyData payload of the replication stream.
    Wal(Bytes),
    /// One frame of the primary (a relay).
    Frame {
        id: u64,
        messages: Vec<DownstreamMessage>,
    },
    /// The source gave up.
    Failed(String),
}

/// Where the session's confirmations go.
#[derive(Clone)]
pub(crate) enum Confirm {
    /// Standby status updates of the replication stream.
    Postgres(Acker),
    /// `{"ack":id}` frames and reconnect requests, carried out by the relay's socket task.
    Primary(Arc<PrimaryFeedback>),
}

impl Confirm {
    pub(super) fn ack(&self, lsn: Lsn) {
        match self {
            Confirm::Postgres(acker) => acker.ack(lsn),
            // A primary's transactions carry no LSN to confirm: the session never asks.
            Confirm::Primary(_) => {
                tracing::debug!(%lsn, "no LSN confirmation for a primary");
            }
        }
    }
}

/// What the ingest thread tells the relay's socket task, per connection: the frames to
/// acknowledge (in order) and whether to reconnect. Connections are numbered by the
/// [`SourceEvent::Started`] that opened them, on both sides, so nothing meant for an old
/// connection reaches a new one.
#[derive(Debug, Default)]
pub(crate) struct PrimaryFeedback {
    state: Mutex<FeedbackState>,
    notify: Notify,
}

#[derive(Debug, Default)]
struct FeedbackState {
    connection: u64,
    acks: Vec<u64>,
    reconnect: Option<(String, bool)>,
}

/// What the socket task is to do on its connection.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Feedback {
    pub acks: Vec<u64>,
    /// Reconnect, with the reason and whether the replica must be restored first.
    pub reconnect: Option<(String, bool)>,
}

impl PrimaryFeedback {
    fn on(&self, connection: u64, f: impl FnOnce(&mut FeedbackState)) {
        {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if state.connection != connection {
                *state = FeedbackState {
                    connection,
                    ..FeedbackState::default()
                };
            }
            f(&mut state);
        }
        self.notify.notify_one();
    }

    /// Frames `ids` of `connection` are consumed.
    pub(super) fn ack(&self, connection: u64, ids: Vec<u64>) {
        self.on(connection, |state| state.acks.extend(ids));
    }

    /// Frames `ids` of `connection` are consumed, and then the connection must end: both
    /// at once, so the socket task never sends the acks (after which the primary closes)
    /// without knowing why it is to end.
    pub(super) fn reconnect(&self, connection: u64, ids: Vec<u64>, reason: String, restore: bool) {
        self.on(connection, |state| {
            state.acks.extend(ids);
            state.reconnect.get_or_insert((reason, restore));
        });
    }

    /// What `connection` is to do now (and nothing left for an older one).
    pub(super) fn take(&self, connection: u64) -> Feedback {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.connection != connection {
            return Feedback::default();
        }
        Feedback {
            acks: std::mem::take(&mut state.acks),
            reconnect: state.reconnect.take(),
        }
    }

    /// Resolves once there may be something to take.
    pub(super) async fn changed(&self) {
        self.notify.notified().await;
    }
}

/// A running change source.
pub(crate) struct Source {
    pub events: mpsc::Receiver<SourceEvent>,
    pub confirm: Confirm,
    /// Where the source starts (confirmations only move past it).
    pub start: Lsn,
    pub task: Option<JoinHandle<()>>,
}

/// Streams from Postgres with `config` until `stop`.
pub(crate) fn spawn_postgres(config: StreamConfig, stop: watch::Receiver<bool>) -> Source {
    let mut config = config;
    config.capacity = config.capacity.min(PAYLOADS_AHEAD);
    let start = config.start;
    let stream = WalStream::spawn(config);
    let acker = stream.acker();
    let (tx, events) = mpsc::channel(EVENT_CAPACITY);
    let task = tokio::spawn(pump(stream, tx, stop));
    Source {
        events,
        confirm: Confirm::Postgres(acker),
        start,
        task: Some(task),
    }
}

async fn pump(
    mut stream: WalStream,
    tx: mpsc::Sender<SourceEvent>,
    mut stop: watch::Receiver<bool>,
) {
    let mut queued = Queued::default();
    loop {
        let event = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            // The ingest thread ended (it failed): nobody takes events any more.
            _ = tx.closed() => break,
            event = stream.recv() => event,
        };
        let (event, size) = match event {
            None => (
                SourceEvent::Failed("the replication stream ended".to_owned()),
                0,
            ),
            Some(Err(error)) => (SourceEvent::Failed(error.to_string()), 0),
            Some(Ok(WalEvent::Started { start, backend_pid })) => {
                tracing::debug!(%start, backend_pid, "replication session started");
                (SourceEvent::Started, 0)
            }
            Some(Ok(WalEvent::CopyData(bytes))) => {
                let size = bytes.len();
                (SourceEvent::Wal(bytes), size)
            }
        };
        let failed = matches!(event, SourceEvent::Failed(_));
        let sent = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            sent = queued.send(&tx, event, size) => sent.is_ok(),
        };
        if failed || !sent {
            break;
        }
    }
    stream.shutdown().await;
}

/// The sizes of the events in the channel to the ingest thread, which itself only counts them.
#[derive(Debug, Default)]
struct Queued {
    sizes: VecDeque<usize>,
    bytes: usize,
}

impl Queued {
    /// Sends `event` once the channel holds no more than [`EVENT_BUDGET_BYTES`] with it (or
    /// is empty).
    async fn send(
        &mut self,
        tx: &mpsc::Sender<SourceEvent>,
        event: SourceEvent,
        size: usize,
    ) -> Result<(), mpsc::error::SendError<SourceEvent>> {
        loop {
            // One sender and no permits held: what is not free is in the channel.
            self.taken(tx.max_capacity() - tx.capacity());
            if self.sizes.is_empty() || self.bytes + size <= EVENT_BUDGET_BYTES {
                break;
            }
            // Wait until the receiver takes at least one more event.
            let wanted = tx.capacity() + 1;
            if tx.reserve_many(wanted).await.is_err() {
                return Err(mpsc::error::SendError(event));
            }
        }
        tx.send(event).await?;
        self.sizes.push_back(size);
        self.bytes += size;
        Ok(())
    }

    /// Of the events sent, only the last `in_channel` are still there.
    fn taken(&mut self, in_channel: usize) {
        while self.sizes.len() > in_channel {
            if let Some(size) = self.sizes.pop_front() {
                self.bytes -= size;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn event() -> SourceEvent {
        SourceEvent::Started
    }

    #[test]
    fn feedback_for_an_old_connection_never_reaches_a_new_one() {
        let feedback = PrimaryFeedback::default();
        feedback.ack(1, vec![1, 2]);
        feedback.ack(1, vec![3]);
        assert_eq!(feedback.take(1).acks, [1, 2, 3]);
        feedback.ack(1, vec![4]);
        feedback.reconnect(1, vec![5], "gone".to_owned(), false);
        // The socket task moved on to connection 2: what was meant for 1 is dropped.
        assert_eq!(feedback.take(2), Feedback::default());
        feedback.reconnect(2, vec![1], "refused".to_owned(), true);
        feedback.ack(2, vec![2]);
        assert_eq!(feedback.take(1), Feedback::default());
        assert_eq!(
            feedback.take(2),
            Feedback {
                acks: vec![1, 2],
                reconnect: Some(("refused".to_owned(), true))
            }
        );
    }

    #[tokio::test]
    async fn the_event_buffer_is_bounded_in_bytes_as_well_as_in_events() {
        let (tx, mut rx) = mpsc::channel(EVENT_CAPACITY);
        let mut queued = Queued::default();
        let big = EVENT_BUDGET_BYTES / 3;
        for _ in 0..3 {
            queued.send(&tx, event(), big).await.expect("room");
        }
        // A fourth would exceed the budget: it waits for the receiver.
        let mut fourth = Box::pin(queued.send(&tx, event(), big));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut fourth)
                .await
                .is_err(),
            "sent beyond the byte budget"
        );
        assert!(rx.recv().await.is_some());
        tokio::time::timeout(Duration::from_secs(5), fourth)
            .await
            .expect("sent once an event was taken")
            .expect("open");
        assert_eq!(tx.max_capacity() - tx.capacity(), 3);
        // A message larger than the whole budget still goes through, alone.
        while rx.try_recv().is_ok() {}
        queued
            .send(&tx, event(), EVENT_BUDGET_BYTES * 2)
            .await
            .expect("alone");
        assert_eq!(queued.sizes.len(), 1);
        // Small events are bounded by the channel's count.
        while rx.try_recv().is_ok() {}
        for _ in 0..EVENT_CAPACITY {
            queued.send(&tx, event(), 10).await.expect("room");
        }
        assert_eq!(tx.capacity(), 0);
        drop(rx);
        assert!(queued.send(&tx, event(), 10).await.is_err());
    }
}
