//! The simulation as a test: a small sweep of seeds passes, a seed replays exactly, and planted
//! defects (storage that loses a commit it reported durable, an acker that acks before
//! storing, a backfill that sends no rows, a move read that ignores the row filter, pages that
//! never report a change of access) make seeds fail, so the invariants can fail at all. Each
//! engine defect the simulation found is kept as a regression test: the seed that caught it.

use highwater_sim::ingest::IngestBug;
use highwater_sim::storage::StorageBug;
use highwater_sim::{run, AccessBug, BackfillBug, Options};

fn small(seed: u64) -> Options {
    let mut opts = Options::new(seed);
    opts.transactions = 40;
    opts
}

#[test]
fn a_sweep_of_twenty_seeds_passes() {
    let mut crashes = 0;
    let mut disconnects = 0;
    let mut backfills = 0;
    let (mut set_reads, mut move_envelopes, mut access_changed) = (0, 0, 0);
    for seed in 1..=20 {
        let outcome = run(small(seed));
        if let Some(why) = &outcome.failure {
            panic!(
                "seed {seed} failed: {why}\n{}\nreplay: scripts/simulate --seed {seed} --trace --transactions 40",
                outcome.trace.join("\n")
            );
        }
        assert_eq!(outcome.transactions, 40);
        crashes += outcome.crashes;
        disconnects += outcome.disconnects;
        backfills += outcome.backfills;
        set_reads += outcome.set_reads;
        move_envelopes += outcome.move_envelopes;
        access_changed += outcome.access_changed;
    }
    assert!(backfills > 0, "no seed stored a backfill");
    // Memberships changed what users' scopes hold, live and on resume.
    assert!(set_reads > 0, "no subquery's set was read");
    assert!(move_envelopes > 0, "no rows moved in or out live");
    assert!(
        access_changed > 0,
        "no resumed scope found its access changed"
    );
    // The sweep exercised the faults it is there for.
    assert!(crashes > 0, "no seed crashed the server");
    assert!(disconnects > 0, "no seed dropped a connection");
}

#[test]
fn a_seed_replays_exactly() {
    let mut a = small(7);
    a.full_trace = true;
    let b = a.clone();
    let (a, b) = (run(a), run(b));
    assert_eq!(a.steps, b.steps);
    assert_eq!(a.trace, b.trace);
    let other = run(small(8));
    assert_ne!(a.trace, other.trace, "different seeds ran the same events");
}

#[test]
fn storage_that_loses_a_durable_commit_is_caught() {
    let mut caught = None;
    for seed in 1..=30 {
        let mut opts = small(seed);
        opts.storage_bug = Some(StorageBug::LosesLastCommit);
        let outcome = run(opts);
        if let Some(why) = outcome.failure {
            caught = Some(why);
            break;
        }
    }
    let why = caught.expect("some seed catches storage that loses a durable commit");
    assert!(
        why.contains("moved backwards") || why.contains("past durable storage"),
        "{why}"
    );
}

#[test]
fn an_acker_that_acks_before_storing_is_caught() {
    let mut opts = small(1);
    opts.ingest_bug = Some(IngestBug::AcksOnForward);
    let outcome = run(opts);
    let why = outcome.failure.expect("the early ack is caught");
    assert!(why.contains("acknowledged past durable storage"), "{why}");
}

#[test]
fn a_backfill_that_brings_no_rows_is_caught() {
    let mut caught = None;
    for seed in 1..=30 {
        let mut opts = small(seed);
        opts.backfill_bug = Some(BackfillBug::DropsRows);
        if let Some(why) = run(opts).failure {
            caught = Some(why);
            break;
        }
    }
    let why = caught.expect("some seed catches a backfill that brings no rows");
    // The backfilled column is compared even where the replica or a client leaves it out.
    assert!(why.contains("after") && why.contains("quiet"), "{why}");
    assert!(
        why.contains("stamp")
            || why.contains("extra")
            || why.contains("archive")
            || why.contains("events"),
        "{why}"
    );
}

#[test]
fn backfill_streams_fail_and_are_retried() {
    let (mut stored, mut failed) = (0, 0);
    for seed in 1..=40 {
        let outcome = run(small(seed));
        assert!(
            outcome.failure.is_none(),
            "seed {seed}: {:?}",
            outcome.failure
        );
        stored += outcome.backfills;
        failed += outcome.backfill_failures;
    }
    assert!(failed > 0, "no backfill stream failed");
    assert!(stored > 0, "no backfill was stored");
}

/// The first failure among seeds 1..=30 (small runs) with `plant` applied.
fn first_failure(plant: impl Fn(&mut Options)) -> Option<String> {
    (1..=30).find_map(|seed| {
        let mut opts = small(seed);
        plant(&mut opts);
        run(opts).failure
    })
}

#[test]
fn a_move_read_that_ignores_the_row_filter_is_caught() {
    let why = first_failure(|o| o.access_bug = Some(AccessBug::MovesIgnoreFilter))
        .expect("some seed catches rows moved in past the filter");
    assert!(why.contains("allowed at no point"), "{why}");
}

#[test]
fn pages_that_never_report_a_change_of_access_are_caught() {
    let why = first_failure(|o| o.access_bug = Some(AccessBug::AccessNeverChanges))
        .expect("some seed catches a resume that kept rows its access lost");
    assert!(why.contains("quiet") && why.contains("IN (SELECT"), "{why}");
}

/// A seed that once caught an engine defect (now fixed) passes.
fn passes(seed: u64) {
    let outcome = run(Options::new(seed));
    assert_eq!(
        outcome.failure, None,
        "replay: scripts/simulate --seed {seed} --trace"
    );
}

/// The scope server's sets, trailing the replica a page was read from, once dropped rows of a
/// full page and took it for the last one (seed 942 also got a row a move sent again).
#[test]
fn a_replay_never_ends_on_a_full_page() {
    passes(157);
    passes(942);
}

/// A mutation was once confirmed while the server still held its commit, reading moves.
#[test]
fn a_confirm_never_overtakes_its_rows() {
    passes(71);
}

/// The guard against resending a row a move sent was once dropped as the commit holding that
/// very entry was routed.
#[test]
fn a_row_a_move_sent_is_not_sent_again_live() {
    passes(25);
}
