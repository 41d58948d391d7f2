//! Shared pieces of the replication integration tests: decoding what the stream hands out, and
//! waiting with a deadline.

use std::future::Future;
use std::time::Duration;

use highwater_engine::pgoutput::{PgoutputMessage, ReplicationFrame};
use highwater_engine::watermark::Lsn;
use highwater_host::replication::{WalEvent, WalStream};

/// A deadline for anything that should happen promptly on a local server.
pub const PROMPT: Duration = Duration::from_secs(15);

/// What the tests look at in a decoded payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    Started {
        start: Lsn,
        backend_pid: i32,
    },
    Begin,
    Insert {
        relation_oid: u32,
        first_column: Option<String>,
    },
    Commit {
        end_lsn: Lsn,
    },
    Keepalive {
        reply_requested: bool,
    },
    Other,
}

/// Decodes one stream event with the engine's decoders.
pub fn decode(event: &WalEvent) -> Seen {
    let payload = match event {
        WalEvent::Started { start, backend_pid } => {
            return Seen::Started {
                start: *start,
                backend_pid: *backend_pid,
            }
        }
        WalEvent::CopyData(payload) => payload,
    };
    match ReplicationFrame::decode(payload).expect("a replication frame") {
        ReplicationFrame::Keepalive(k) => Seen::Keepalive {
            reply_requested: k.reply_requested,
        },
        ReplicationFrame::XLogData(x) => {
            match PgoutputMessage::decode(x.payload).expect("a pgoutput message") {
                PgoutputMessage::Begin(_) => Seen::Begin,
                PgoutputMessage::Commit(c) => Seen::Commit { end_lsn: c.end_lsn },
                PgoutputMessage::Insert(i) => Seen::Insert {
                    relation_oid: i.relation_oid,
                    first_column: i.new.0.first().and_then(|v| match v {
                        highwater_engine::pgoutput::TupleValue::Text(t) => {
                            Some(String::from_utf8_lossy(t).into_owned())
                        }
                        _ => None,
                    }),
                },
                _ => Seen::Other,
            }
        }
    }
}

/// The next event that is not a keepalive, within [`PROMPT`].
pub async fn next_seen(stream: &mut WalStream) -> Seen {
    loop {
        let event = within(PROMPT, stream.recv())
            .await
            .expect("the stream is still open")
            .expect("no stream error");
        let seen = decode(&event);
        if !matches!(seen, Seen::Keepalive { .. } | Seen::Other) {
            return seen;
        }
    }
}

/// Reads one transaction (Begin … Commit); returns the first-column values of its inserts and
/// the commit's end LSN.
pub async fn next_transaction(stream: &mut WalStream) -> (Vec<String>, Lsn) {
    loop {
        if next_seen(stream).await == Seen::Begin {
            break;
        }
    }
    let mut values = Vec::new();
    loop {
        match next_seen(stream).await {
            Seen::Insert { first_column, .. } => values.push(first_column.unwrap_or_default()),
            Seen::Commit { end_lsn } => return (values, end_lsn),
            Seen::Begin | Seen::Started { .. } => panic!("transaction interrupted"),
            _ => {}
        }
    }
}

pub async fn within<T>(limit: Duration, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(limit, future)
        .await
        .unwrap_or_else(|_| panic!("timed out after {limit:?}"))
}

/// Polls `check` until it returns `Some`, or panics after [`PROMPT`].
pub async fn eventually<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + PROMPT;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
