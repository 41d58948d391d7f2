//! `highwater-sim`: runs seeds of the deterministic simulation.
//!
//! ```text
//! highwater-sim --seed S [--trace]        one seed; --trace prints its whole event list
//! highwater-sim --seeds N [--from S]      seeds S..S+N (S defaults to 1)
//!               [--transactions T]        upstream transactions per seed (default 120)
//!               [--plant loses-commit|early-ack|backfill-drops-rows|moves-ignore-filter|access-never-changes]
//!                                         plant a defect the run must catch
//! ```
//!
//! Ends with `simulation: N seeds, F failed, S steps, K crashes, D disconnects, X transactions,
//! B backfills (R failed before their commit, C crashes during one)`
//! then the writes' and the access (memberships') lines, and
//! `# pass P` / `# fail F`; exits non-zero when a seed failed. `SIM_DEBUG_CLIENT=1` and
//! `SIM_DEBUG_SERVER=1` print every scope client's and the scope server's inputs and effects to
//! stderr.

use std::process::ExitCode;

use highwater_sim::ingest::IngestBug;
use highwater_sim::storage::StorageBug;
use highwater_sim::{describe, run, AccessBug, BackfillBug, Options};

fn usage() -> ExitCode {
    eprintln!(
        "usage: highwater-sim (--seed S [--trace] | --seeds N [--from S]) [--transactions T] [--plant P]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut seed = None;
    let mut seeds = None;
    let mut from = 1u64;
    let mut trace = false;
    let mut transactions = None;
    let mut plant = None;
    let mut i = 0;
    while i < args.len() {
        let value = |i: usize| args.get(i + 1).and_then(|v| v.parse::<u64>().ok());
        match args[i].as_str() {
            "--seed" => {
                let Some(v) = value(i) else { return usage() };
                seed = Some(v);
                i += 1;
            }
            "--seeds" => {
                let Some(v) = value(i) else { return usage() };
                seeds = Some(v);
                i += 1;
            }
            "--from" => {
                let Some(v) = value(i) else { return usage() };
                from = v;
                i += 1;
            }
            "--transactions" => {
                let Some(v) = value(i) else { return usage() };
                transactions = Some(v as usize);
                i += 1;
            }
            "--plant" => {
                plant = args.get(i + 1).cloned();
                if !matches!(
                    plant.as_deref(),
                    Some(
                        "loses-commit"
                            | "early-ack"
                            | "backfill-drops-rows"
                            | "moves-ignore-filter"
                            | "access-never-changes"
                    )
                ) {
                    return usage();
                }
                i += 1;
            }
            "--trace" => trace = true,
            _ => return usage(),
        }
        i += 1;
    }
    let list: Vec<u64> = match (seed, seeds) {
        (Some(s), None) => vec![s],
        (None, Some(n)) => (from..from.saturating_add(n)).collect(),
        _ => return usage(),
    };
    let (mut failed, mut steps, mut crashes, mut disconnects, mut txs) = (0u64, 0, 0, 0, 0);
    let (mut backfills, mut backfill_failures, mut backfill_crashes) = (0u64, 0u64, 0u64);
    let (mut mutations, mut confirmed, mut applied_before) = (0u64, 0u64, 0u64);
    let (mut set_reads, mut move_reads, mut move_envelopes) = (0u64, 0u64, 0u64);
    let mut access_changed = 0u64;
    for &s in &list {
        let mut opts = Options::new(s);
        opts.full_trace = trace;
        if let Some(t) = transactions {
            opts.transactions = t;
        }
        match plant.as_deref() {
            Some("loses-commit") => opts.storage_bug = Some(StorageBug::LosesLastCommit),
            Some("early-ack") => opts.ingest_bug = Some(IngestBug::AcksOnForward),
            Some("backfill-drops-rows") => opts.backfill_bug = Some(BackfillBug::DropsRows),
            Some("moves-ignore-filter") => opts.access_bug = Some(AccessBug::MovesIgnoreFilter),
            Some("access-never-changes") => opts.access_bug = Some(AccessBug::AccessNeverChanges),
            _ => {}
        }
        let outcome = run(opts);
        steps += outcome.steps;
        crashes += outcome.crashes;
        disconnects += outcome.disconnects;
        txs += outcome.transactions;
        backfills += outcome.backfills;
        backfill_failures += outcome.backfill_failures;
        backfill_crashes += outcome.backfill_crashes;
        mutations += outcome.mutations;
        confirmed += outcome.confirmed;
        applied_before += outcome.applied_before;
        set_reads += outcome.set_reads;
        move_reads += outcome.move_reads;
        move_envelopes += outcome.move_envelopes;
        access_changed += outcome.access_changed;
        if trace {
            for line in &outcome.trace {
                println!("{line}");
            }
        }
        match &outcome.failure {
            Some(why) => {
                failed += 1;
                println!("not ok seed {s}: {why}");
                if !trace {
                    println!("# trace of seed {s} (last {} events):", outcome.trace.len());
                    for line in &outcome.trace {
                        println!("#   {line}");
                    }
                }
                let mut replay = format!("scripts/simulate --seed {s} --trace");
                if let Some(t) = transactions {
                    replay.push_str(&format!(" --transactions {t}"));
                }
                if let Some(p) = &plant {
                    replay.push_str(&format!(" --plant {p}"));
                }
                println!("# replay: {replay}");
            }
            None if list.len() == 1 => println!("ok {}", describe(&outcome)),
            None => {}
        }
    }
    let n = list.len() as u64;
    println!(
        "simulation: {n} seeds, {failed} failed, {steps} steps, {crashes} crashes, {disconnects} disconnects, {txs} transactions, {backfills} backfills ({backfill_failures} failed before their commit, {backfill_crashes} crashes during one)"
    );
    println!(
        "writes: {mutations} client mutations, {confirmed} confirmed, {applied_before} sent again after being applied"
    );
    println!(
        "access: {set_reads} set reads, {move_reads} move reads, {move_envelopes} envelopes moving rows, {access_changed} resumed pages with access changed"
    );
    println!("# pass {}", n - failed);
    println!("# fail {failed}");
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
