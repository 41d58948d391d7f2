//! Which frames from a primary a relay may acknowledge: a frame is consumed once every
//! transaction it carried a message of is durable in the relay's replica and change log (or was
//! rolled back), and acks go out exactly once per frame, in id order.

use std::collections::VecDeque;

use crate::change_stream::DownstreamMessage;
use crate::watermark::Watermark;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Open,
    Committed(Watermark),
    RolledBack,
}

/// A transaction seen on this connection, numbered in arrival order.
#[derive(Debug, Clone)]
struct Transaction {
    seq: u64,
    outcome: Outcome,
}

#[derive(Debug, Clone, Copy)]
struct PendingFrame {
    id: u64,
    /// The newest transaction the frame carried a message of.
    last_transaction: Option<u64>,
}

/// The consumption state of one subscription's downstream frames.
#[derive(Debug, Clone)]
pub(crate) struct FrameAcks {
    frames: VecDeque<PendingFrame>,
    /// Transactions not yet resolved, oldest first.
    transactions: VecDeque<Transaction>,
    next_seq: u64,
    open: Option<u64>,
    durable: Watermark,
}

impl FrameAcks {
    /// Starts with `durable`, the newest commit already in the change log.
    pub fn new(durable: Watermark) -> FrameAcks {
        FrameAcks {
            frames: VecDeque::new(),
            transactions: VecDeque::new(),
            next_seq: 0,
            open: None,
            durable,
        }
    }

    /// Records frame `id` and the messages it carries, before they are handed on.
    pub fn on_frame(&mut self, id: u64, messages: &[DownstreamMessage]) {
        let mut last_transaction = None;
        for message in messages {
            match message {
                DownstreamMessage::Begin(_) => {
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    self.transactions.push_back(Transaction {
                        seq,
                        outcome: Outcome::Open,
                    });
                    self.open = Some(seq);
                    last_transaction = Some(seq);
                }
                DownstreamMessage::Data(_) => last_transaction = self.open.or(last_transaction),
                DownstreamMessage::Commit(commit) => {
                    if let Some(seq) = self.open.take() {
                        self.resolve(seq, Outcome::Committed(commit.watermark.clone()));
                        last_transaction = Some(seq);
                    }
                }
                DownstreamMessage::Rollback(_) => {
                    if let Some(seq) = self.open.take() {
                        self.resolve(seq, Outcome::RolledBack);
                        last_transaction = Some(seq);
                    }
                }
                // Consumed once handed on: they store nothing.
                DownstreamMessage::Status(_)
                | DownstreamMessage::Error(_)
                | DownstreamMessage::Reserved(_) => {}
            }
        }
        self.frames.push_back(PendingFrame {
            id,
            last_transaction,
        });
    }

    fn resolve(&mut self, seq: u64, outcome: Outcome) {
        if let Some(t) = self.transactions.iter_mut().rev().find(|t| t.seq == seq) {
            t.outcome = outcome;
        }
    }

    /// The change log is durable up to `watermark`.
    pub fn on_durable(&mut self, watermark: Watermark) {
        if watermark > self.durable {
            self.durable = watermark;
        }
    }

    /// The ids of the frames consumed since the last call, in order.
    pub fn release(&mut self) -> Vec<u64> {
        while let Some(front) = self.transactions.front() {
            let resolved = match &front.outcome {
                Outcome::Open => false,
                Outcome::Committed(watermark) => *watermark <= self.durable,
                Outcome::RolledBack => true,
            };
            if !resolved {
                break;
            }
            self.transactions.pop_front();
        }
        let unresolved = self.transactions.front().map(|t| t.seq);
        let mut ids = Vec::new();
        while let Some(frame) = self.frames.front() {
            let waiting = matches!(
                (frame.last_transaction, unresolved),
                (Some(last), Some(first)) if last >= first
            );
            if waiting {
                break;
            }
            ids.push(frame.id);
            self.frames.pop_front();
        }
        ids
    }
}

#[cfg(test)]
mod tests {
    use crate::change_stream::{Begin, Change, Commit, Rollback, Status, Truncate};
    use crate::watermark::Lsn;
    use proptest::prelude::*;

    use super::*;

    fn w(n: u64) -> Watermark {
        Lsn(n).to_watermark()
    }

    fn begin(n: u64) -> DownstreamMessage {
        DownstreamMessage::Begin(Begin::new(w(n)))
    }

    fn data() -> DownstreamMessage {
        DownstreamMessage::Data(Change::Truncate(Truncate {
            relations: Vec::new(),
            extra: Default::default(),
        }))
    }

    fn commit(n: u64) -> DownstreamMessage {
        DownstreamMessage::Commit(Commit::new(w(n)))
    }

    fn rollback() -> DownstreamMessage {
        DownstreamMessage::Rollback(Rollback::default())
    }

    fn status() -> DownstreamMessage {
        DownstreamMessage::Status(Status::default())
    }

    #[test]
    fn a_transaction_frame_waits_for_its_commit_to_be_durable() {
        let mut acks = FrameAcks::new(w(10));
        acks.on_frame(1, &[status()]);
        acks.on_frame(2, &[begin(20), data()]);
        acks.on_frame(3, &[data(), commit(20)]);
        // The status alone is consumed at once; the transaction's frames wait.
        assert_eq!(acks.release(), vec![1]);
        acks.on_durable(w(15));
        assert_eq!(acks.release(), Vec::<u64>::new());
        acks.on_durable(w(20));
        assert_eq!(acks.release(), vec![2, 3]);
    }

    #[test]
    fn a_status_frame_behind_a_pending_transaction_waits_its_turn() {
        let mut acks = FrameAcks::new(w(10));
        acks.on_frame(1, &[begin(20), data(), commit(20)]);
        acks.on_frame(2, &[status()]);
        assert_eq!(acks.release(), Vec::<u64>::new());
        acks.on_durable(w(20));
        assert_eq!(acks.release(), vec![1, 2]);
    }

    #[test]
    fn a_rolled_back_transaction_does_not_release_an_earlier_commit() {
        let mut acks = FrameAcks::new(w(10));
        acks.on_frame(1, &[begin(20), commit(20), begin(30)]);
        acks.on_frame(2, &[rollback()]);
        // Transaction 30 is resolved (rolled back) but 20 is not durable yet.
        assert_eq!(acks.release(), Vec::<u64>::new());
        acks.on_durable(w(20));
        assert_eq!(acks.release(), vec![1, 2]);
    }

    #[test]
    fn a_transaction_already_durable_is_consumed_at_once() {
        // Sent again after a reconnect while its first copy was being stored.
        let mut acks = FrameAcks::new(w(30));
        acks.on_frame(1, &[begin(20), data(), commit(20)]);
        assert_eq!(acks.release(), vec![1]);
    }

    /// A generated stream: per transaction, its number of data messages and whether it
    /// commits; each message is tagged with its transaction's index.
    fn stream(txs: &[(usize, bool)]) -> Vec<(DownstreamMessage, Option<usize>)> {
        let mut out = Vec::new();
        for (i, &(data_messages, committed)) in txs.iter().enumerate() {
            let n = (i as u64 + 1) * 10;
            out.push((begin(n), Some(i)));
            for _ in 0..data_messages {
                out.push((data(), Some(i)));
            }
            out.push((if committed { commit(n) } else { rollback() }, Some(i)));
            out.push((status(), None));
        }
        out
    }

    proptest! {
        /// Acks are exactly once, in id order, and only for frames whose transactions are all
        /// durable or rolled back, however the stream is cut into frames and whenever storage
        /// catches up; once everything is durable every frame is acked.
        #[test]
        fn acks_are_in_order_once_and_never_ahead_of_storage(
            txs in prop::collection::vec((0usize..4, any::<bool>()), 1..12),
            cuts in prop::collection::vec(1usize..5, 1..40),
            stores in prop::collection::vec(any::<bool>(), 1..40),
        ) {
            let messages = stream(&txs);
            let mut frames: Vec<&[(DownstreamMessage, Option<usize>)]> = Vec::new();
            let mut rest = messages.as_slice();
            for &n in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (frame, tail) = rest.split_at(n.min(rest.len()));
                frames.push(frame);
                rest = tail;
            }
            let mut acks = FrameAcks::new(w(1));
            // Whether each transaction's commit or rollback was handed over yet.
            let mut ended = vec![false; txs.len()];
            let mut newest_commit_seen: Option<usize> = None;
            let mut durable: Option<usize> = None;
            let mut acked = Vec::new();
            let mut store = stores.iter().cycle();
            for (i, frame) in frames.iter().enumerate() {
                let messages: Vec<DownstreamMessage> = frame.iter().map(|(m, _)| m.clone()).collect();
                acks.on_frame(i as u64 + 1, &messages);
                for (message, tx) in frame.iter() {
                    if let (DownstreamMessage::Commit(_) | DownstreamMessage::Rollback(_), Some(tx)) = (message, tx) {
                        ended[*tx] = true;
                        if txs[*tx].1 {
                            newest_commit_seen = Some(*tx);
                        }
                    }
                }
                if *store.next().unwrap_or(&false) {
                    if let Some(tx) = newest_commit_seen {
                        durable = Some(tx);
                        acks.on_durable(w((tx as u64 + 1) * 10));
                    }
                }
                for id in acks.release() {
                    for (_, tx) in frames[(id - 1) as usize] {
                        if let Some(tx) = *tx {
                            let resolved = ended[tx] && (!txs[tx].1 || durable.is_some_and(|d| d >= tx));
                            prop_assert!(resolved, "frame {} acked before transaction {} was resolved", id, tx);
                        }
                    }
                    acked.push(id);
                }
            }
            acks.on_durable(w((txs.len() as u64 + 1) * 10));
            acked.extend(acks.release());
            let expected: Vec<u64> = (1..=frames.len() as u64).collect();
            prop_assert_eq!(acked, expected);
        }
    }
}
