//! A change-stream subscriber as Zero's view-syncer is one: it subscribes to
//! `/replication/v<N>/changes` at its last durable watermark, applies each transaction, makes
//! it durable (here: moves it into [`Durable`]) and only then acks its frames, and after a
//! disconnect resumes from that watermark.
//!
//! To exercise the resend of unacknowledged transactions, it holds a random number (0–3) of
//! received commits before it makes them durable and acks; a disconnect in that window drops
//! them (as a view-syncer rolls back what it did not commit), and the server sends them again.
//!
//! What counts as a duplicate: a transaction (known by the ledger row each workload
//! transaction inserts, and by its commit watermark) delivered to the subscriber while its
//! durable state already holds it: a commit at or below the watermark the subscription resumed
//! from or already made durable, or a ledger row already durable. A transaction received, not
//! yet acked and dropped at a disconnect, then received again, is a legal resend and is counted
//! apart (`resent`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use highwater_engine::change_stream::{
    decode_downstream_frame, Change, DownstreamMessage, Frame, MAX_PROTOCOL_VERSION,
};
use highwater_engine::watermark::Watermark;
use serde_json::{Map, Value};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

use crate::rng::Rng;
use crate::workload::{row_key, row_values, ITEMS, LEDGER};

/// A subscriber's durable state: what a view-syncer's replica would hold.
#[derive(Debug, Clone)]
pub struct Durable {
    pub watermark: Watermark,
    pub rows: BTreeMap<i64, BTreeMap<String, String>>,
    /// Ledger tag → how many times it was made durable (more than once is a duplicate).
    pub tags: BTreeMap<i64, u32>,
    pub commits: u64,
}

/// What the harness reads at the end.
#[derive(Debug, Clone)]
pub struct SubState {
    pub name: String,
    pub durable: Durable,
    pub connects: u64,
    /// Received, not acked, dropped at a disconnect (sent again legally).
    pub resent: u64,
    /// Commits delivered at or below the durable watermark.
    pub duplicate_commits: u64,
    /// Violations of the stream's framing or ordering, and stream errors.
    pub errors: Vec<String>,
}

pub struct StreamSub {
    pub state: Arc<Mutex<SubState>>,
    pub task: tokio::task::JoinHandle<()>,
}

/// One transaction as received.
struct Received {
    watermark: Watermark,
    changes: Vec<Change>,
}

impl StreamSub {
    pub fn start(
        name: String,
        addr: SocketAddr,
        token: String,
        replica_version: Watermark,
        mut rng: Rng,
        stop: watch::Receiver<bool>,
    ) -> StreamSub {
        let state = Arc::new(Mutex::new(SubState {
            name: name.clone(),
            durable: Durable {
                watermark: replica_version.clone(),
                rows: BTreeMap::new(),
                tags: BTreeMap::new(),
                commits: 0,
            },
            connects: 0,
            resent: 0,
            duplicate_commits: 0,
            errors: Vec::new(),
        }));
        let shared = state.clone();
        let task = tokio::spawn(async move {
            let mut stop = stop;
            while !*stop.borrow() {
                let from = lock(&shared).durable.watermark.clone();
                let url = format!(
                    "ws://{addr}/replication/v{MAX_PROTOCOL_VERSION}/changes?id={name}&taskID={name}\
                     &mode=serving&replicaVersion={replica_version}&watermark={from}"
                );
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => break,
                    ended = connection(&url, &token, &shared, &mut rng) => {
                        if let Err(error) = ended {
                            tracing::debug!(subscriber = %name, %error, "subscription ended");
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(rng.range(50, 400))).await;
            }
        });
        StreamSub { state, task }
    }
}

fn lock(state: &Mutex<SubState>) -> std::sync::MutexGuard<'_, SubState> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One subscription, until the socket ends. Whatever was received and not made durable is
/// dropped when it returns.
async fn connection(
    url: &str,
    token: &str,
    shared: &Mutex<SubState>,
    rng: &mut Rng,
) -> anyhow::Result<()> {
    let mut request = url.into_client_request()?;
    request
        .headers_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let (socket, _) = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_tungstenite::connect_async(request),
    )
    .await??;
    let (mut sink, mut stream) = socket.split();
    lock(shared).connects += 1;
    let mut open: Option<Received> = None;
    let mut held: Vec<Received> = Vec::new();
    let mut unacked_frames: Vec<u64> = Vec::new();
    let mut hold = rng.range(0, 4) as usize;
    // The last commit received on this connection: each must be above it.
    let mut last = lock(shared).durable.watermark.clone();
    let result = loop {
        let next = tokio::time::timeout(Duration::from_millis(300), stream.next()).await;
        let text = match next {
            // Quiet: make what is held durable.
            Err(_) => {
                if let Err(error) = flush(shared, &mut held, &mut unacked_frames, &mut sink).await {
                    break Err(error);
                }
                continue;
            }
            Ok(None) => break Ok(()),
            Ok(Some(Err(error))) => break Err(error.into()),
            Ok(Some(Ok(Message::Text(text)))) => text,
            Ok(Some(Ok(Message::Close(_)))) => break Ok(()),
            Ok(Some(Ok(_))) => continue,
        };
        let frame = match decode_downstream_frame(text.as_str()) {
            Ok(frame) => frame,
            Err(error) => {
                lock(shared)
                    .errors
                    .push(format!("undecodable frame {text}: {error}"));
                break Ok(());
            }
        };
        let id = match &frame {
            Frame::Ack { .. } => continue,
            other => other.id(),
        };
        let mut give_up = false;
        for message in frame.into_messages() {
            match message {
                DownstreamMessage::Begin(begin) => {
                    if open.is_some() {
                        lock(shared)
                            .errors
                            .push("expected a commit or rollback, got another begin".to_owned());
                    }
                    open = Some(Received {
                        watermark: begin.commit_watermark,
                        changes: Vec::new(),
                    });
                }
                DownstreamMessage::Data(change) => match open.as_mut() {
                    Some(tx) => tx.changes.push(change),
                    None => lock(shared).errors.push(format!(
                        "expected data inside a transaction, got {}",
                        change.tag()
                    )),
                },
                DownstreamMessage::Commit(commit) => {
                    let Some(mut tx) = open.take() else {
                        lock(shared)
                            .errors
                            .push("expected a commit of an open transaction".to_owned());
                        continue;
                    };
                    tx.watermark = commit.watermark;
                    if tx.watermark <= last {
                        let mut state = lock(shared);
                        state.duplicate_commits += 1;
                        state.errors.push(format!(
                            "commit {} delivered at or below {last}, already held",
                            tx.watermark
                        ));
                        continue;
                    }
                    last = tx.watermark.clone();
                    held.push(tx);
                }
                DownstreamMessage::Rollback(_) => open = None,
                DownstreamMessage::Status(_) | DownstreamMessage::Reserved(_) => {}
                DownstreamMessage::Error(error) => {
                    lock(shared)
                        .errors
                        .push(format!("stream error from the server: {error:?}"));
                    // A WatermarkTooOld repeats at every resume: give this connection up
                    // but keep trying, so the run ends with the failure reported.
                    give_up = true;
                }
            }
        }
        if give_up {
            tokio::time::sleep(Duration::from_secs(1)).await;
            break Ok(());
        }
        if let Some(id) = id {
            unacked_frames.push(id);
        }
        if held.len() > hold {
            if let Err(error) = flush(shared, &mut held, &mut unacked_frames, &mut sink).await {
                break Err(error);
            }
            hold = rng.range(0, 4) as usize;
        }
    };
    lock(shared).resent += held.len() as u64;
    result
}

/// Makes the held transactions durable, then acks every frame received so far, in order.
async fn flush<S>(
    shared: &Mutex<SubState>,
    held: &mut Vec<Received>,
    unacked_frames: &mut Vec<u64>,
    sink: &mut S,
) -> anyhow::Result<()>
where
    S: futures::Sink<Message, Error = tokio_tungstenite::tungstenite::Error> + Unpin,
{
    {
        let mut state = lock(shared);
        for tx in held.drain(..) {
            if tx.watermark <= state.durable.watermark {
                let error = format!(
                    "commit {} made durable at or below {}",
                    tx.watermark, state.durable.watermark
                );
                state.duplicate_commits += 1;
                state.errors.push(error);
                continue;
            }
            apply(&mut state.durable, &tx.changes);
            state.durable.watermark = tx.watermark;
            state.durable.commits += 1;
        }
    }
    for id in unacked_frames.drain(..) {
        sink.send(Message::text(format!(r#"{{"ack":{id}}}"#)))
            .await?;
    }
    Ok(())
}

fn apply(durable: &mut Durable, changes: &[Change]) {
    for change in changes {
        match change {
            Change::Insert(insert) if insert.relation.name == ITEMS => {
                if let Some(key) = row_key(&insert.new) {
                    durable.rows.insert(key, row_values(&insert.new));
                }
            }
            Change::Update(update) if update.relation.name == ITEMS => {
                if let Some(old) = update.key.as_ref().and_then(row_key) {
                    durable.rows.remove(&old);
                }
                if let Some(key) = row_key(&update.new) {
                    let row = durable.rows.entry(key).or_default();
                    // Unchanged TOASTed columns are absent: keep what was held.
                    row.extend(row_values(&update.new));
                }
            }
            Change::Delete(delete) if delete.relation.name == ITEMS => {
                if let Some(key) = row_key(&delete.key) {
                    durable.rows.remove(&key);
                }
            }
            Change::Insert(insert) if insert.relation.name == LEDGER => {
                if let Some(tag) = tag_of(&insert.new) {
                    *durable.tags.entry(tag).or_default() += 1;
                }
            }
            Change::Truncate(_) => durable.rows.clear(),
            _ => {}
        }
    }
}

fn tag_of(row: &Map<String, Value>) -> Option<i64> {
    crate::workload::int_of(row.get("tag")?)
}

/// Ledger tags held more than once.
pub fn duplicated_tags(durable: &Durable) -> BTreeSet<i64> {
    durable
        .tags
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(t, _)| *t)
        .collect()
}
