//! Upstream acknowledgements (§8.4, §7.3): the change source learns that a position is safe
//! only once everything up to it is durable in the change log.

use std::collections::VecDeque;

use crate::watermark::Watermark;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Pending {
    /// A forwarded commit, acked once stored unless its begin said `skipAck`.
    Commit {
        watermark: Watermark,
        skip_ack: bool,
    },
    /// A keepalive that asked for a reply, answered once every earlier commit is stored.
    Keepalive(Watermark),
}

/// Orders upstream acks behind durable storage.
#[derive(Debug, Clone)]
pub struct UpstreamAcks {
    pending: VecDeque<Pending>,
    /// Keepalives that arrived inside the open transaction: answered after it ends, so a reply
    /// never confirms a position the transaction in flight might precede.
    deferred: Vec<Watermark>,
    /// The newest durable commit.
    stored: Watermark,
    /// The newest position acked upstream; acks never move backwards.
    acked: Option<Watermark>,
}

impl UpstreamAcks {
    /// Starts with the change log's newest stored commit.
    pub fn new(stored: Watermark) -> Self {
        UpstreamAcks {
            pending: VecDeque::new(),
            deferred: Vec::new(),
            stored,
            acked: None,
        }
    }

    /// The newest durable commit.
    pub fn stored(&self) -> &Watermark {
        &self.stored
    }

    /// A commit was forwarded (its storing is under way).
    pub fn commit(&mut self, watermark: Watermark, skip_ack: bool) -> Vec<Watermark> {
        self.pending.push_back(Pending::Commit {
            watermark,
            skip_ack,
        });
        self.end_transaction()
    }

    /// The open transaction ended without a commit.
    pub fn rollback(&mut self) -> Vec<Watermark> {
        self.end_transaction()
    }

    fn end_transaction(&mut self) -> Vec<Watermark> {
        self.pending
            .extend(self.deferred.drain(..).map(Pending::Keepalive));
        self.release()
    }

    /// A keepalive asked for a reply.
    pub fn keepalive(&mut self, watermark: Watermark, in_transaction: bool) -> Vec<Watermark> {
        if in_transaction {
            self.deferred.push(watermark);
            return Vec::new();
        }
        self.pending.push_back(Pending::Keepalive(watermark));
        self.release()
    }

    /// The commit at `watermark` (and everything before it) is durable.
    pub fn on_stored(&mut self, watermark: Watermark) -> Vec<Watermark> {
        if watermark > self.stored {
            self.stored = watermark;
        }
        self.release()
    }

    /// The upstream connection ended: its keepalives need no reply any more.
    pub fn upstream_ended(&mut self) {
        self.deferred.clear();
        self.pending.retain(|p| matches!(p, Pending::Commit { .. }));
    }

    fn release(&mut self) -> Vec<Watermark> {
        let mut acks = Vec::new();
        while let Some(front) = self.pending.front() {
            let ack = match front {
                Pending::Commit { watermark, .. } if *watermark > self.stored => break,
                Pending::Commit { skip_ack: true, .. } => None,
                Pending::Commit { watermark, .. } => Some(watermark.clone()),
                // A keepalive is answered even when it moves nothing, but never backwards.
                Pending::Keepalive(watermark) => Some(match &self.acked {
                    Some(acked) if acked > watermark => acked.clone(),
                    _ => watermark.clone(),
                }),
            };
            self.pending.pop_front();
            if let Some(ack) = ack {
                if self.acked.as_ref().is_none_or(|a| *a < ack) {
                    self.acked = Some(ack.clone());
                }
                acks.push(ack);
            }
        }
        acks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(text: &str) -> Watermark {
        Watermark::parse(text).expect("watermark")
    }

    #[test]
    fn commits_are_acked_only_once_durable_and_in_order() {
        let mut acks = UpstreamAcks::new(w("01"));
        assert!(acks.commit(w("0a"), false).is_empty());
        assert!(acks.commit(w("0b"), false).is_empty());
        assert_eq!(acks.on_stored(w("0a")), [w("0a")]);
        assert_eq!(acks.on_stored(w("0b")), [w("0b")]);
        assert!(acks.on_stored(w("0b")).is_empty());
    }

    #[test]
    fn skip_ack_transactions_are_stored_but_not_acked() {
        let mut acks = UpstreamAcks::new(w("01"));
        acks.commit(w("0a.01"), true);
        acks.commit(w("0b"), false);
        assert!(acks.on_stored(w("0a.01")).is_empty());
        assert_eq!(acks.on_stored(w("0b")), [w("0b")]);
    }

    #[test]
    fn keepalives_wait_for_earlier_commits() {
        let mut acks = UpstreamAcks::new(w("01"));
        assert_eq!(acks.keepalive(w("05"), false), [w("05")]);
        acks.commit(w("0a"), false);
        assert!(acks.keepalive(w("0c"), false).is_empty());
        assert_eq!(acks.on_stored(w("0a")), [w("0a"), w("0c")]);
    }

    #[test]
    fn keepalives_inside_a_transaction_wait_for_its_end() {
        let mut acks = UpstreamAcks::new(w("01"));
        assert!(acks.keepalive(w("0c"), true).is_empty());
        // Answered after the commit, which is itself not durable yet.
        assert!(acks.commit(w("0d"), false).is_empty());
        // The keepalive position is behind the commit: the reply repeats the commit.
        assert_eq!(acks.on_stored(w("0d")), [w("0d"), w("0d")]);
        assert!(acks.keepalive(w("0e"), true).is_empty());
        assert_eq!(acks.rollback(), [w("0e")]);
    }

    #[test]
    fn an_ended_upstream_drops_unanswered_keepalives() {
        let mut acks = UpstreamAcks::new(w("01"));
        acks.commit(w("0a"), false);
        acks.keepalive(w("0b"), false);
        acks.keepalive(w("0c"), true);
        acks.upstream_ended();
        assert_eq!(acks.on_stored(w("0a")), [w("0a")]);
        assert_eq!(acks.stored(), &w("0a"));
    }
}
