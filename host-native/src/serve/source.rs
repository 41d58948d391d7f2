//! The change source: upstream events as the ingest thread consumes them, and the Postgres
//! implementation (the replication stream decoded by `engine::pgoutput`).

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
    loop {
        let event = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            // The ingest thread ended (it failed): nobody takes events any more.
            _ = tx.closed() => break,
            event = stream.recv() => event,
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
            sent = tx.send(event) => sent.is_ok(),
        };
        if failed || !sent {
            break;
        }
    }
    stream.shutdown().await;
}
