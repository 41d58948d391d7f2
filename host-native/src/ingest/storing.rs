//! What the ingest loop is storing: the transaction in progress (held whole or streaming in, by
//! the engine's `upstream::Hold`), the open group and the committed groups waiting for their sync
//! (`upstream::GroupCommit`), and the commits made durable and not yet reported to the session.
//! A store's requests to store go through here, which asks the engine's rules and calls the
//! store for each write, commit and sync they lead to, in their order.

use std::time::Instant;

use highwater_engine::upstream::{
    GroupCommit, GroupDecision, GroupLimits, Hold, SyncDecision, TxnCommit, TxnEnd,
};
use highwater_engine::watermark::Watermark;

use super::{GroupStore, Invariant};
use crate::pause_point::{self, Point};

pub(crate) struct Storing<S: GroupStore> {
    /// The open group of applied, not yet durable commits, and the committed ones waiting for
    /// their sync.
    group: GroupCommit<Watermark>,
    /// The transaction being stored.
    hold: Hold<S::Item>,
    /// Commits made durable and not yet reported stored to the session.
    stored: Vec<Watermark>,
    epoch: Instant,
}

impl<S: GroupStore> Storing<S> {
    pub(super) fn new(limits: GroupLimits) -> Self {
        Storing {
            group: GroupCommit::new(limits),
            hold: Hold::new(),
            stored: Vec::new(),
            epoch: Instant::now(),
        }
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Whether a transaction is being stored: held, or open in storage.
    pub(crate) fn in_transaction(&self, store: &S) -> bool {
        self.hold.in_transaction() || store.in_transaction()
    }

    /// Whether applied transactions wait for their group's commit.
    pub(crate) fn group_open(&self) -> bool {
        self.group.is_open()
    }

    /// µs until the open group must be made durable (`GroupCommit::flush_in_us`).
    pub(super) fn flush_in_us(&self, store: &S) -> Option<u64> {
        self.group
            .flush_in_us(self.now_us(), self.in_transaction(store))
    }

    /// Counts bytes of the source towards the transaction being stored (or the next).
    pub(super) fn count(&mut self, bytes: usize) {
        self.hold.count(bytes);
    }

    /// A transaction's `begin` (of `bytes`): held. A group whose deadline passed is committed
    /// first: it never holds its first transaction back for one yet to come.
    pub(crate) fn begin(
        &mut self,
        store: &mut S,
        begin: S::Item,
        bytes: usize,
    ) -> Result<(), S::Error> {
        if self.in_transaction(store) {
            return Err(Invariant {
                expected: "a `begin` between transactions".to_owned(),
                found: "one inside a transaction".to_owned(),
            }
            .into());
        }
        if self.group.flush_in_us(self.now_us(), false) == Some(0) {
            self.commit_group(store)?;
        }
        self.hold.begin(begin, bytes).map_err(|error| Invariant {
            expected: "a `begin` between transactions".to_owned(),
            found: error.to_string(),
        })?;
        Ok(())
    }

    /// An item of the transaction: held, or written (with what was held, if it outgrew the
    /// hold).
    pub(crate) fn item(
        &mut self,
        store: &mut S,
        item: S::Item,
        bytes: usize,
    ) -> Result<(), S::Error> {
        for item in self.hold.item(item, bytes) {
            store.write(item)?;
        }
        Ok(())
    }

    /// The transaction's `commit`: written (whole, if it was held) into the open group, which
    /// is committed when full, or when something waits for it.
    pub(crate) fn commit(
        &mut self,
        store: &mut S,
        commit: S::Item,
        bytes: usize,
    ) -> Result<(), S::Error> {
        let (commit, bytes) = self.hold.commit(commit, bytes);
        let watermark = match commit {
            TxnCommit::Whole(items) => store.write_whole(items)?,
            TxnCommit::Streamed(commit) => store.write_commit(commit)?,
        };
        let decision = self.group.applied(watermark, bytes, self.now_us());
        // A catch-up read waiting for this commit closes the group here too.
        if decision == GroupDecision::Flush || store.closes_group_now() {
            self.commit_group(store)?;
        }
        Ok(())
    }

    /// The transaction was rolled back: nothing of it is stored (a held one never reached
    /// storage).
    pub(crate) fn rollback(&mut self, store: &mut S) -> Result<(), S::Error> {
        if self.hold.rollback() == TxnEnd::RollBack {
            store.roll_back()?;
        }
        if store.closes_group_now() {
            self.commit_group(store)?;
        }
        Ok(())
    }

    /// Storage as of every item so far: a held transaction is written now.
    pub(super) fn settle(&mut self, store: &mut S) -> Result<(), S::Error> {
        for item in self.hold.settle() {
            store.write(item)?;
        }
        Ok(())
    }

    /// Commits the open group (between transactions only), and starts its sync or, for a
    /// store whose commits sync themselves, takes it as durable; then whatever waited for the
    /// store committed goes on (also when no group was open).
    pub(crate) fn commit_group(&mut self, store: &mut S) -> Result<(), S::Error> {
        if self.in_transaction(store) {
            return Err(Invariant {
                expected: "a group committed between transactions".to_owned(),
                found: "one with a transaction half applied".to_owned(),
            }
            .into());
        }
        if let Some(last) = self.group.last().cloned() {
            let transactions = self.group.transactions();
            pause_point::reach(Point::BeforeGroupCommit, transactions);
            store.commit_group(&last, transactions)?;
            pause_point::reach(Point::AfterGroupCommit, transactions);
            if store.syncs_apart() {
                if self.group.committed() == SyncDecision::Start {
                    self.start_sync(store);
                }
            } else if let Some(durable) = self.group.durable() {
                store.durable(&durable)?;
                self.stored.push(durable.last);
            }
        }
        store.group_committed()
    }

    fn start_sync(&mut self, store: &mut S) {
        // The transactions the sync covers, for the crash tests' pause point.
        let transactions = self
            .group
            .syncing()
            .map_or(0, |durable| durable.transactions);
        store.start_sync(transactions);
    }

    /// The running sync returned (`result`): the groups it covers are durable; groups
    /// committed since get a sync of their own.
    pub(super) fn synced(
        &mut self,
        store: &mut S,
        result: Result<(), S::Error>,
    ) -> Result<(), S::Error> {
        result?;
        let (durable, next) = self.group.synced();
        pause_point::reach(
            Point::AfterGroupSync,
            durable.as_ref().map_or(0, |durable| durable.transactions),
        );
        if let Some(durable) = durable {
            store.durable(&durable)?;
            self.stored.push(durable.last);
        }
        if next == SyncDecision::Start {
            self.start_sync(store);
        }
        Ok(())
    }

    /// Takes the sync's result if it returned since the last look.
    pub(super) fn poll_sync(&mut self, store: &mut S) -> Result<(), S::Error> {
        match store.poll_sync() {
            Some(result) => self.synced(store, result),
            None => Ok(()),
        }
    }

    /// The commits made durable since the last call, to report stored.
    pub(super) fn take_stored(&mut self) -> Vec<Watermark> {
        std::mem::take(&mut self.stored)
    }

    /// The loop ends: what becomes of the transaction in progress.
    pub(super) fn stop(&mut self) -> TxnEnd {
        self.hold.stop()
    }

    /// The open group was discarded: nothing of it may be reported stored.
    pub(super) fn discard(&mut self) {
        self.group.discarded();
    }
}
