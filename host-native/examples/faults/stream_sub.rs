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
use crate::workload::{merge_values, row_key, row_values, ITEMS, LEDGER};

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

impl SubState {
    /// A subscriber that holds nothing yet, at the replica version.
    pub fn new(name: String, replica_version: Watermark) -> SubState {
        SubState {
            name,
            durable: Durable {
                watermark: replica_version,
                rows: BTreeMap::new(),
                tags: BTreeMap::new(),
                commits: 0,
            },
            connects: 0,
            resent: 0,
            duplicate_commits: 0,
            errors: Vec::new(),
        }
    }
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
        initial: BTreeMap<i64, BTreeMap<String, String>>,
        mut rng: Rng,
        stop: watch::Receiver<bool>,
    ) -> StreamSub {
        let mut state = SubState::new(name.clone(), replica_version.clone());
        // What the replica held at its version, as a view-syncer restores it from a snapshot.
        state.durable.rows = initial;
        let state = Arc::new(Mutex::new(state));
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
    let mut session = Session::new(&mut lock(shared));
    let mut hold = rng.range(0, 4) as usize;
    let result = loop {
        let next = tokio::time::timeout(Duration::from_millis(300), stream.next()).await;
        let text = match next {
            // Quiet: make what is held durable.
            Err(_) => {
                let ids = session.flush(&mut lock(shared));
                if let Err(error) = ack(&mut sink, ids).await {
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
        if session.receive(&mut lock(shared), frame) == Next::GiveUp {
            // A WatermarkTooOld repeats at every resume: this connection is given up, the
            // next tried a little later, so the run ends with the failure reported.
            tokio::time::sleep(Duration::from_secs(1)).await;
            break Ok(());
        }
        if session.held() > hold {
            let ids = session.flush(&mut lock(shared));
            if let Err(error) = ack(&mut sink, ids).await {
                break Err(error);
            }
            hold = rng.range(0, 4) as usize;
        }
    };
    session.end(&mut lock(shared));
    result
}

async fn ack<S>(sink: &mut S, ids: Vec<u64>) -> anyhow::Result<()>
where
    S: futures::Sink<Message, Error = tokio_tungstenite::tungstenite::Error> + Unpin,
{
    for id in ids {
        sink.send(Message::text(format!(r#"{{"ack":{id}}}"#)))
            .await?;
    }
    Ok(())
}

/// What to do after a frame.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    Go,
    GiveUp,
}

/// One connection's part of the subscriber: the open transaction, the commits received and not
/// yet durable, the frames not yet acked.
struct Session {
    open: Option<Received>,
    held: Vec<Received>,
    unacked_frames: Vec<u64>,
    /// The last commit received on this connection (at first, the watermark it resumed from):
    /// each commit must be above it.
    last: Watermark,
}

impl Session {
    fn new(state: &mut SubState) -> Session {
        state.connects += 1;
        Session {
            open: None,
            held: Vec::new(),
            unacked_frames: Vec::new(),
            last: state.durable.watermark.clone(),
        }
    }

    fn held(&self) -> usize {
        self.held.len()
    }

    fn receive(&mut self, state: &mut SubState, frame: Frame<DownstreamMessage>) -> Next {
        let id = match &frame {
            Frame::Ack { .. } => return Next::Go,
            other => other.id(),
        };
        let mut next = Next::Go;
        for message in frame.into_messages() {
            match message {
                DownstreamMessage::Begin(begin) => {
                    if self.open.is_some() {
                        state
                            .errors
                            .push("expected a commit or rollback, got another begin".to_owned());
                    }
                    self.open = Some(Received {
                        watermark: begin.commit_watermark,
                        changes: Vec::new(),
                    });
                }
                DownstreamMessage::Data(change) => match self.open.as_mut() {
                    Some(tx) => tx.changes.push(change),
                    None => state.errors.push(format!(
                        "expected data inside a transaction, got {}",
                        change.tag()
                    )),
                },
                DownstreamMessage::Commit(commit) => {
                    let Some(mut tx) = self.open.take() else {
                        state
                            .errors
                            .push("expected a commit of an open transaction".to_owned());
                        continue;
                    };
                    tx.watermark = commit.watermark;
                    if tx.watermark <= self.last {
                        state.duplicate_commits += 1;
                        state.errors.push(format!(
                            "commit {} delivered at or below {}, already held",
                            tx.watermark, self.last
                        ));
                        continue;
                    }
                    self.last = tx.watermark.clone();
                    self.held.push(tx);
                }
                DownstreamMessage::Rollback(_) => self.open = None,
                DownstreamMessage::Status(_) | DownstreamMessage::Reserved(_) => {}
                DownstreamMessage::Error(error) => {
                    state
                        .errors
                        .push(format!("stream error from the server: {error:?}"));
                    next = Next::GiveUp;
                }
            }
        }
        if let Some(id) = id {
            self.unacked_frames.push(id);
        }
        next
    }

    /// Makes the held transactions durable; returns the frames to ack now, in order.
    fn flush(&mut self, state: &mut SubState) -> Vec<u64> {
        for tx in self.held.drain(..) {
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
        std::mem::take(&mut self.unacked_frames)
    }

    /// The connection ended: what was received and not made durable is dropped (the server
    /// sends it again, legally).
    fn end(self, state: &mut SubState) {
        state.resent += self.held.len() as u64;
    }
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
                let Some(key) = row_key(&update.new) else {
                    continue;
                };
                // A key change moves the row; its old key is sent only then.
                let old = update.key.as_ref().and_then(row_key).unwrap_or(key);
                let mut row = durable.rows.remove(&old).unwrap_or_default();
                // Unchanged TOASTed columns are absent: they keep what was held.
                merge_values(&mut row, &update.new);
                durable.rows.insert(key, row);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn w(text: &str) -> Watermark {
        Watermark::parse(text).expect("watermark")
    }

    /// One transaction, as a v8 batch frame: its ledger row and one item.
    fn tx(frame: u64, watermark: &str, tag: i64, item: i64) -> Frame<DownstreamMessage> {
        let relation = |name: &str| {
            format!(
                r#"{{"schema":"public","name":"{name}","rowKey":{{"columns":["{}"]}}}}"#,
                if name == LEDGER { "tag" } else { "id" }
            )
        };
        let text = format!(
            r#"{{"id":{frame},"batch":[["begin",{{"tag":"begin"}},{{"commitWatermark":"{watermark}"}}],["data",{{"tag":"insert","relation":{},"new":{{"tag":{tag},"writer":1}}}}],["data",{{"tag":"insert","relation":{},"new":{{"id":{item},"owner":"ada","v":"x"}}}}],["commit",{{"tag":"commit"}},{{"watermark":"{watermark}"}}]]}}"#,
            relation(LEDGER),
            relation(ITEMS)
        );
        decode_downstream_frame(&text).expect("a valid frame")
    }

    #[test]
    fn a_resend_of_an_unacked_transaction_is_legal_and_a_resend_of_an_acked_one_is_a_duplicate() {
        let mut state = SubState::new("t".into(), w("01"));
        // Received, not made durable, then the connection drops.
        let mut first = Session::new(&mut state);
        assert_eq!(first.receive(&mut state, tx(1, "02", 7, 70)), Next::Go);
        first.end(&mut state);
        assert_eq!((state.resent, state.durable.commits), (1, 0));
        assert!(state.durable.tags.is_empty());

        // Sent again after the resume: legal, and now durable and acked.
        let mut second = Session::new(&mut state);
        second.receive(&mut state, tx(1, "02", 7, 70));
        assert_eq!(second.flush(&mut state), vec![1]);
        second.end(&mut state);
        assert_eq!(state.duplicate_commits, 0);
        assert_eq!(state.durable.watermark, w("02"));
        assert_eq!(state.durable.tags.get(&7), Some(&1));
        assert!(state.durable.rows.contains_key(&70));
        assert!(state.errors.is_empty());

        // Sent again on a subscription that resumed at 02: a duplicate.
        let mut third = Session::new(&mut state);
        third.receive(&mut state, tx(1, "02", 7, 70));
        assert_eq!(third.flush(&mut state), vec![1]);
        assert_eq!(state.duplicate_commits, 1);
        assert_eq!(state.durable.tags.get(&7), Some(&1));
    }

    #[test]
    fn a_transaction_under_a_second_watermark_is_a_duplicate_by_its_ledger_row() {
        let mut state = SubState::new("t".into(), w("01"));
        let mut session = Session::new(&mut state);
        session.receive(&mut state, tx(1, "02", 7, 70));
        session.receive(&mut state, tx(2, "03", 7, 71));
        assert_eq!(session.flush(&mut state), vec![1, 2]);
        assert_eq!(duplicated_tags(&state.durable), BTreeSet::from([7]));
        assert_eq!(state.durable.commits, 2);
    }

    #[test]
    fn commits_must_rise_within_a_connection() {
        let mut state = SubState::new("t".into(), w("01"));
        let mut session = Session::new(&mut state);
        session.receive(&mut state, tx(1, "05", 1, 10));
        session.receive(&mut state, tx(2, "04", 2, 20));
        session.flush(&mut state);
        assert_eq!(state.duplicate_commits, 1);
        assert_eq!(state.errors.len(), 1);
        assert!(!state.durable.tags.contains_key(&2));
    }
}
