//! Which LSN to confirm to Postgres, and when: a commit's *end* LSN once the commit is durable,
//! a keepalive's WAL end once every commit received before it is durable, never a position
//! ahead of storage and never one behind what was confirmed already.

use std::collections::VecDeque;

use crate::watermark::{Lsn, Watermark};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Pending {
    /// A forwarded (or skipped, already stored) commit: confirmable once `watermark` is
    /// durable. `end` is `None` for a transaction that must not be confirmed (`skipAck`, a
    /// backfill's): its durability only releases what queues behind it.
    Commit {
        watermark: Watermark,
        end: Option<Lsn>,
    },
    /// A keepalive's WAL end, received between transactions.
    Keepalive(Lsn),
}

/// Orders upstream confirmations behind durable storage.
#[derive(Debug, Clone)]
pub(crate) struct AckQueue {
    pending: VecDeque<Pending>,
    /// Keepalives received inside a transaction: queued once it ends, so a confirmation never
    /// covers the transaction in flight.
    deferred: Vec<Lsn>,
    /// The newest durable commit.
    stored: Watermark,
    /// The newest position confirmed (or the one the stream started from).
    acked: Lsn,
}

impl AckQueue {
    pub fn new(stored: Watermark, acked: Lsn) -> Self {
        AckQueue {
            pending: VecDeque::new(),
            deferred: Vec::new(),
            stored,
            acked,
        }
    }

    pub fn stored(&self) -> &Watermark {
        &self.stored
    }

    pub fn acked(&self) -> Lsn {
        self.acked
    }

    /// Whether a commit received waits for storage.
    pub fn waits_for_storage(&self) -> bool {
        self.pending
            .iter()
            .any(|p| matches!(p, Pending::Commit { watermark, .. } if *watermark > self.stored))
    }

    /// A transaction ended with a commit at `watermark` (confirm `end` once durable).
    pub fn commit(&mut self, watermark: Watermark, end: Option<Lsn>) -> Option<Lsn> {
        self.pending.push_back(Pending::Commit { watermark, end });
        self.end_transaction()
    }

    /// The open transaction ended without a commit.
    pub fn rollback(&mut self) -> Option<Lsn> {
        self.end_transaction()
    }

    fn end_transaction(&mut self) -> Option<Lsn> {
        self.pending
            .extend(self.deferred.drain(..).map(Pending::Keepalive));
        self.release()
    }

    /// A keepalive reported the server's WAL end.
    pub fn keepalive(&mut self, wal_end: Lsn, in_transaction: bool) -> Option<Lsn> {
        if in_transaction {
            self.deferred.push(wal_end);
            return None;
        }
        self.pending.push_back(Pending::Keepalive(wal_end));
        self.release()
    }

    /// Everything up to `watermark` is durable.
    pub fn stored_through(&mut self, watermark: Watermark) -> Option<Lsn> {
        if watermark > self.stored {
            self.stored = watermark;
        }
        self.release()
    }

    /// A new session: keepalives of the old one are void; commits already received still
    /// become durable and are confirmed then.
    pub fn restarted(&mut self) {
        self.deferred.clear();
        self.pending.retain(|p| matches!(p, Pending::Commit { .. }));
    }

    /// The position to confirm now, if it moved.
    fn release(&mut self) -> Option<Lsn> {
        let mut newest = None;
        while let Some(front) = self.pending.front() {
            let lsn = match front {
                Pending::Commit { watermark, .. } if *watermark > self.stored => break,
                Pending::Commit { end, .. } => *end,
                Pending::Keepalive(lsn) => Some(*lsn),
            };
            self.pending.pop_front();
            newest = newest.max(lsn);
        }
        let newest = newest.filter(|lsn| *lsn > self.acked)?;
        self.acked = newest;
        Some(newest)
    }
}
