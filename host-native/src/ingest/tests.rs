//! `Storing` over a store that records what it is asked to do: the order of writes, commits
//! and syncs the engine's rules lead to, written once for every store.

use std::convert::Infallible;

use highwater_engine::change_stream::DownstreamMessage;
use highwater_engine::upstream::{DurableGroup, GroupLimits, SessionError};
use highwater_engine::watermark::{Lsn, Watermark};

use super::{GroupStore, Invariant, StoreWake, Storing};
use crate::replica::Replica;
use crate::upstream::EffectError;

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct TestError(String);

impl From<SessionError> for TestError {
    fn from(error: SessionError) -> Self {
        TestError(error.to_string())
    }
}

impl From<EffectError> for TestError {
    fn from(error: EffectError) -> Self {
        TestError(error.to_string())
    }
}

impl From<Invariant> for TestError {
    fn from(error: Invariant) -> Self {
        TestError(error.to_string())
    }
}

/// What the store was asked to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Did {
    Write(&'static str),
    Whole(Vec<&'static str>),
    Commit(&'static str),
    RollBack,
    CommitGroup(u64, usize),
    GroupCommitted,
    StartSync(usize),
    Durable(u64, usize),
}

/// Items are `(name, commit position)`; a commit's position is its watermark.
struct Recorder {
    replica: Replica,
    did: Vec<Did>,
    open: bool,
    apart: bool,
    syncing: bool,
    close_now: bool,
}

fn w(n: u64) -> Watermark {
    Lsn(n).to_watermark()
}

fn n(watermark: &Watermark) -> u64 {
    watermark.to_lsn().map_or(0, |lsn| lsn.0)
}

type Item = (&'static str, u64);

impl GroupStore for Recorder {
    type Item = Item;
    type Op = Infallible;
    type Error = TestError;

    fn replica(&self) -> &Replica {
        &self.replica
    }

    fn hand_on(
        &mut self,
        _storing: &mut Storing<Self>,
        _message: DownstreamMessage,
    ) -> Result<(), TestError> {
        Ok(())
    }

    fn try_next_op(&mut self) -> Option<Infallible> {
        None
    }

    fn execute(&mut self, _storing: &mut Storing<Self>, op: Infallible) -> Result<(), TestError> {
        match op {}
    }

    fn stores(op: &Infallible) -> bool {
        match *op {}
    }

    async fn wait(&mut self, _sync: bool) -> StoreWake<Infallible, TestError> {
        std::future::pending().await
    }

    fn write(&mut self, item: Item) -> Result<(), TestError> {
        self.open = true;
        self.did.push(Did::Write(item.0));
        Ok(())
    }

    fn write_whole(&mut self, items: Vec<Item>) -> Result<Watermark, TestError> {
        let last = items.last().map_or(0, |item| item.1);
        self.did
            .push(Did::Whole(items.into_iter().map(|item| item.0).collect()));
        Ok(w(last))
    }

    fn write_commit(&mut self, commit: Item) -> Result<Watermark, TestError> {
        self.open = false;
        self.did.push(Did::Commit(commit.0));
        Ok(w(commit.1))
    }

    fn roll_back(&mut self) -> Result<(), TestError> {
        self.open = false;
        self.did.push(Did::RollBack);
        Ok(())
    }

    fn in_transaction(&self) -> bool {
        self.open
    }

    fn closes_group_now(&self) -> bool {
        self.close_now
    }

    fn commit_group(&mut self, last: &Watermark, transactions: usize) -> Result<(), TestError> {
        self.did.push(Did::CommitGroup(n(last), transactions));
        Ok(())
    }

    fn group_committed(&mut self) -> Result<(), TestError> {
        self.did.push(Did::GroupCommitted);
        Ok(())
    }

    fn discard_group(&mut self) {}

    fn syncs_apart(&self) -> bool {
        self.apart
    }

    fn start_sync(&mut self, transactions: usize) {
        self.syncing = true;
        self.did.push(Did::StartSync(transactions));
    }

    fn sync_running(&self) -> bool {
        self.syncing
    }

    fn poll_sync(&mut self) -> Option<Result<(), TestError>> {
        None
    }

    async fn sync_done(&mut self) -> Result<(), TestError> {
        std::future::pending().await
    }

    fn durable(&mut self, group: &DurableGroup<Watermark>) -> Result<(), TestError> {
        self.did
            .push(Did::Durable(n(&group.last), group.transactions));
        Ok(())
    }
}

fn recorder(apart: bool) -> Recorder {
    Recorder {
        replica: Replica::open_in_memory().expect("an in-memory replica"),
        did: Vec::new(),
        open: false,
        apart,
        syncing: false,
        close_now: false,
    }
}

/// Groups of `transactions` that never close on time or bytes.
fn limits(transactions: usize) -> GroupLimits {
    GroupLimits {
        max_transactions: transactions,
        max_bytes: usize::MAX,
        max_delay_us: u64::MAX,
        linger_us: u64::MAX,
    }
}

/// One small transaction committed at `at`.
fn small(storing: &mut Storing<Recorder>, store: &mut Recorder, at: u64) {
    storing.begin(store, ("begin", at), 1).unwrap();
    storing.item(store, ("insert", at), 1).unwrap();
    storing.commit(store, ("commit", at), 1).unwrap();
}

#[test]
fn held_transactions_are_written_whole_and_a_full_group_is_durable_at_its_commit() {
    let mut store = recorder(false);
    let mut storing = Storing::new(limits(2));
    small(&mut storing, &mut store, 10);
    assert!(storing.group_open());
    assert!(storing.take_stored().is_empty(), "nothing durable yet");
    small(&mut storing, &mut store, 20);
    assert_eq!(
        store.did,
        [
            Did::Whole(vec!["begin", "insert", "commit"]),
            Did::Whole(vec!["begin", "insert", "commit"]),
            Did::CommitGroup(20, 2),
            Did::Durable(20, 2),
            Did::GroupCommitted,
        ]
    );
    assert_eq!(storing.take_stored(), [w(20)]);
    assert!(!storing.group_open());
}

#[test]
fn a_store_that_syncs_apart_reports_a_group_stored_only_once_its_sync_returned() {
    let mut store = recorder(true);
    let mut storing = Storing::new(limits(1));
    small(&mut storing, &mut store, 10);
    assert_eq!(
        store.did[1..],
        [
            Did::CommitGroup(10, 1),
            Did::StartSync(1),
            Did::GroupCommitted
        ]
    );
    assert!(storing.take_stored().is_empty(), "committed, not synced");
    // The next group commits while that sync runs: its sync waits for the running one.
    small(&mut storing, &mut store, 20);
    assert_eq!(store.did.last(), Some(&Did::GroupCommitted));
    assert_eq!(
        store
            .did
            .iter()
            .filter(|d| matches!(d, Did::StartSync(_)))
            .count(),
        1
    );
    store.syncing = false;
    storing.synced(&mut store, Ok(())).unwrap();
    assert_eq!(storing.take_stored(), [w(10)]);
    assert_eq!(
        store.did.last(),
        Some(&Did::StartSync(1)),
        "the next one's sync"
    );
    store.syncing = false;
    storing.synced(&mut store, Ok(())).unwrap();
    assert_eq!(storing.take_stored(), [w(20)]);
    // A failed sync reports nothing.
    small(&mut storing, &mut store, 30);
    store.syncing = false;
    assert!(storing
        .synced(&mut store, Err(TestError("disk".to_owned())))
        .is_err());
    assert!(storing.take_stored().is_empty());
}

#[test]
fn a_transaction_that_outgrows_the_hold_is_written_as_it_comes_begin_first() {
    let mut store = recorder(false);
    let mut storing = Storing::new(limits(100));
    storing.begin(&mut store, ("begin", 10), 0).unwrap();
    storing
        .item(
            &mut store,
            ("big", 10),
            highwater_engine::upstream::HOLD_BYTES,
        )
        .unwrap();
    storing.item(&mut store, ("next", 10), 1).unwrap();
    assert!(storing.in_transaction(&store));
    // The group cannot be committed with half a transaction in it.
    assert!(storing.commit_group(&mut store).is_err());
    storing.commit(&mut store, ("commit", 10), 1).unwrap();
    assert_eq!(
        store.did,
        [
            Did::Write("begin"),
            Did::Write("big"),
            Did::Write("next"),
            Did::Commit("commit"),
        ]
    );
}

#[test]
fn a_begin_after_the_deadline_commits_the_open_group_first() {
    let mut store = recorder(false);
    // No linger: the deadline passes as soon as a transaction is applied.
    let mut storing = Storing::new(GroupLimits {
        linger_us: 0,
        ..limits(100)
    });
    small(&mut storing, &mut store, 10);
    assert_eq!(storing.flush_in_us(&store), Some(0));
    storing.begin(&mut store, ("begin", 20), 1).unwrap();
    assert_eq!(
        store.did[1..],
        [
            Did::CommitGroup(10, 1),
            Did::Durable(10, 1),
            Did::GroupCommitted
        ]
    );
    // Half a transaction applied: no deadline until its commit.
    storing.settle(&mut store).unwrap();
    assert_eq!(storing.flush_in_us(&store), None);
}

#[test]
fn a_held_rollback_writes_nothing_and_what_waits_for_the_group_closes_it_at_the_end() {
    let mut store = recorder(false);
    let mut storing = Storing::new(limits(100));
    small(&mut storing, &mut store, 10);
    storing.begin(&mut store, ("begin", 20), 1).unwrap();
    storing.rollback(&mut store).unwrap();
    assert_eq!(
        store.did.len(),
        1,
        "a held transaction never reached storage"
    );
    storing.begin(&mut store, ("begin", 30), 1).unwrap();
    storing.settle(&mut store).unwrap();
    // Something waits for the group: the transaction's end closes it, rollback or commit.
    store.close_now = true;
    storing.rollback(&mut store).unwrap();
    assert_eq!(
        store.did[1..],
        [
            Did::Write("begin"),
            Did::RollBack,
            Did::CommitGroup(10, 1),
            Did::Durable(10, 1),
            Did::GroupCommitted,
        ]
    );
    small(&mut storing, &mut store, 40);
    assert_eq!(store.did.last(), Some(&Did::GroupCommitted));
    assert_eq!(storing.take_stored(), [w(10), w(40)]);
}
