//! The change source: upstream events as the ingest thread consumes them, and the Postgres
//! implementation (the replication stream decoded by `engine::pgoutput`).

use std::collections::VecDeque;
use std::sync::Arc;

use highwater_engine::change_stream::DownstreamMessage;
use highwater_engine::pgoutput::{PgoutputEvent, PgoutputMapper};
use highwater_engine::watermark::Watermark;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use super::hub::AckSink;
use crate::replica::ddl::ddl_prefix;
use crate::replication::{StreamConfig, WalEvent, WalStream};

/// Upstream events buffered ahead of the ingest thread. While it does not take them (the
/// streamer paused upstream), the replication stream stops reading the socket.
const EVENT_CAPACITY: usize = 1024;
/// The same buffer bounded in bytes (pgoutput bytes of its messages), so large rows do not
/// multiply it; a larger message still goes through, alone.
const EVENT_BUDGET_BYTES: usize = 4 * 1024 * 1024;
/// Raw payloads the replication stream reads ahead of decoding: the decoded buffer above is
/// the real one.
const PAYLOADS_AHEAD: usize = 64;

/// One upstream event.
// Messages are the common variant; boxing them would add an allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum SourceEvent {
    /// `begin`, `data`, `commit` or `rollback`.
    Message(DownstreamMessage),
    /// A DDL event (the content of a `<app>/ddl` logical message) inside the open transaction:
    /// turned into schema changes against the replica's schema.
    Ddl(Vec<u8>),
    /// Upstream has sent everything up to `watermark` (between transactions).
    Keepalive(Watermark),
    /// The stream (re)started: a transaction in flight will be sent again from its beginning.
    Restarted,
    /// The stream gave up.
    Failed(String),
}

/// A running change source.
pub(crate) struct Source {
    pub events: mpsc::Receiver<SourceEvent>,
    /// Where durable positions are reported.
    pub ack_sink: AckSink,
    pub task: Option<JoinHandle<()>>,
}

/// Streams from Postgres with `config` until `stop`.
pub(crate) fn spawn_postgres(
    config: StreamConfig,
    app_id: &str,
    stop: watch::Receiver<bool>,
) -> Source {
    let mut config = config;
    config.capacity = config.capacity.min(PAYLOADS_AHEAD);
    let stream = WalStream::spawn(config);
    let acker = stream.acker();
    let (tx, events) = mpsc::channel(EVENT_CAPACITY);
    let task = tokio::spawn(pump(stream, ddl_prefix(app_id), tx, stop));
    Source {
        events,
        ack_sink: Arc::new(move |lsn| acker.ack(lsn)),
        task: Some(task),
    }
}

async fn pump(
    mut stream: WalStream,
    prefix: String,
    tx: mpsc::Sender<SourceEvent>,
    mut stop: watch::Receiver<bool>,
) {
    let mut mapper = PgoutputMapper::new();
    let mut queued = Queued::default();
    loop {
        let event = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            // The ingest thread ended (it failed): nobody takes events any more.
            _ = tx.closed() => break,
            event = stream.recv() => event,
        };
        let size = match &event {
            Some(Ok(WalEvent::CopyData(bytes))) => bytes.len(),
            _ => 0,
        };
        let event = match event {
            None => SourceEvent::Failed("the replication stream ended".to_owned()),
            Some(Err(error)) => SourceEvent::Failed(error.to_string()),
            Some(Ok(WalEvent::Started { start, backend_pid })) => {
                tracing::debug!(%start, backend_pid, "replication session started");
                // Relation messages are sent again in a new session.
                mapper = PgoutputMapper::new();
                SourceEvent::Restarted
            }
            Some(Ok(WalEvent::CopyData(bytes))) => match mapper.map_frame(&bytes) {
                Err(error) => SourceEvent::Failed(format!("cannot decode pgoutput: {error}")),
                Ok(None) => continue,
                Ok(Some(PgoutputEvent::Downstream(message))) => SourceEvent::Message(message),
                Ok(Some(PgoutputEvent::Commit {
                    mut commit,
                    end_lsn,
                })) => {
                    commit
                        .extra
                        .insert("commitEndLsn".into(), end_lsn.to_string().into());
                    SourceEvent::Message(DownstreamMessage::Commit(commit))
                }
                Ok(Some(PgoutputEvent::LogicalMessage(message))) if message.prefix == prefix => {
                    SourceEvent::Ddl(message.content)
                }
                // Only between transactions does the server's position cover all we have.
                Ok(Some(PgoutputEvent::Keepalive(keepalive))) if !mapper.in_transaction() => {
                    SourceEvent::Keepalive(keepalive.watermark)
                }
                Ok(Some(_)) => continue,
            },
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
        SourceEvent::Restarted
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
