//! `highwater-bench streamer`: the engine's change-stream streamer alone, in memory, on one
//! thread: what routing and framing live transactions costs per subscriber, without Postgres,
//! SQLite, sockets or the other processes `bench fanout` shares the cores with. Every
//! subscriber is a v8 connection that acks each frame at once; a burst of `--burst`
//! transactions is framed when the host would report its upstream queue drained. Each frame's
//! text is written into one reused buffer per connection, as `serve`'s connections do.
//!
//! The bench checks that every subscriber got every message of every transaction.

use std::time::Instant;

use anyhow::{bail, ensure};
use highwater_engine::change_stream::{
    decode_downstream, Begin, Commit, DownstreamMessage, Extra, SubscribeContext, SubscriberMode,
};
use highwater_engine::streamer::{
    ChangeLogState, ConnId, Effect, Outgoing, Streamer, StreamerConfig,
};
use highwater_engine::watermark::{encode_lexi, Watermark};

#[derive(Debug, Clone, clap::Args)]
pub struct StreamerArgs {
    /// Subscriber counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    pub subscribers: Vec<usize>,
    /// Transactions (begin, one insert, commit) per level.
    #[arg(long, default_value_t = 20_000)]
    pub txns: u64,
    /// Transactions between two "upstream drained" reports (the size of a burst).
    #[arg(long, default_value_t = 10)]
    pub burst: u64,
    /// Runs of each level; the table shows each.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
}

pub fn run(args: StreamerArgs) -> anyhow::Result<()> {
    ensure!(
        args.txns > 0 && args.burst > 0,
        "--txns and --burst must be positive"
    );
    println!(
        "Streamer alone: v8 subscribers, {} single-row transactions per level, drained every {}",
        args.txns, args.burst
    );
    println!(
        "{:>11} {:>5} {:>12} {:>14} {:>12} {:>12}",
        "subscribers", "round", "tx/s", "ns/tx/subscr", "frames", "msgs/frame"
    );
    for &subscribers in &args.subscribers {
        for round in 1..=args.rounds {
            let r = level(subscribers, args.txns, args.burst)?;
            let seconds = r.elapsed.as_secs_f64().max(1e-9);
            println!(
                "{:>11} {:>5} {:>12.0} {:>14.1} {:>12} {:>12.1}",
                subscribers,
                round,
                args.txns as f64 / seconds,
                r.elapsed.as_nanos() as f64 / (args.txns as f64 * subscribers as f64),
                r.frames,
                r.messages as f64 / r.frames.max(1) as f64,
            );
        }
    }
    Ok(())
}

struct Level {
    elapsed: std::time::Duration,
    frames: u64,
    messages: u64,
}

fn watermark(n: u64) -> Watermark {
    Watermark::parse(&encode_lexi(u128::from(n))).expect("encode_lexi makes watermarks")
}

fn level(subscribers: usize, txns: u64, burst: u64) -> anyhow::Result<Level> {
    let start = watermark(1_000);
    let mut streamer = Streamer::new(
        StreamerConfig::new(watermark(1)),
        ChangeLogState {
            last_watermark: start.clone(),
            min_watermark: watermark(1),
        },
    );
    for conn in (1..=subscribers as u64).map(ConnId) {
        streamer.open(conn, 8, false);
        let ctx = SubscribeContext {
            task_id: format!("task-{}", conn.0),
            id: format!("sub-{}", conn.0),
            mode: SubscriberMode::Serving,
            replica_version: watermark(1),
            watermark: start.clone(),
            backfills: None,
            extra: Extra::new(),
        };
        let effects = streamer.subscribe(conn, ctx, 0);
        ack_all(&mut streamer, effects, &mut Tally::new(subscribers), false)?;
    }
    // The messages are decoded before the clock runs, as the host's decoder would hand them.
    let messages: Vec<[DownstreamMessage; 3]> = (0..txns)
        .map(|i| {
            let w = watermark(1_001 + i);
            let insert = decode_downstream(&format!(
                r#"["data",{{"tag":"insert","relation":{{"schema":"public","name":"t","rowKey":{{"columns":["id"]}}}},"new":{{"id":{i},"payload":"row {i} of the streamer bench, about a hundred bytes of text like a real row"}}}}]"#
            ))
            .expect("a valid insert");
            [
                DownstreamMessage::Begin(Begin::new(w.clone())),
                insert,
                DownstreamMessage::Commit(Commit::new(w)),
            ]
        })
        .collect();
    let mut tally = Tally::new(subscribers);
    let clock = Instant::now();
    for (i, tx) in messages.into_iter().enumerate() {
        for message in tx {
            let effects = streamer.on_upstream(message)?;
            ack_all(&mut streamer, effects, &mut tally, true)?;
        }
        if (i as u64 + 1).is_multiple_of(burst) {
            let effects = streamer.on_upstream_drained();
            ack_all(&mut streamer, effects, &mut tally, true)?;
        }
    }
    let effects = streamer.on_upstream_drained();
    ack_all(&mut streamer, effects, &mut tally, true)?;
    let elapsed = clock.elapsed();
    // Each transaction is a begin, an insert and a commit.
    if let Some(short) = tally.got.iter().position(|&got| got != 3 * txns) {
        bail!(
            "subscriber {} got {} of the {} messages",
            short + 1,
            tally.got[short],
            3 * txns
        );
    }
    Ok(Level {
        elapsed,
        frames: tally.frames,
        messages: tally.got.iter().sum(),
    })
}

/// What the subscribers got, and each connection's reused frame buffer.
struct Tally {
    frames: u64,
    /// Messages each subscriber got.
    got: Vec<u64>,
    buffers: Vec<String>,
}

impl Tally {
    fn new(subscribers: usize) -> Tally {
        Tally {
            frames: 0,
            got: vec![0; subscribers],
            buffers: vec![String::new(); subscribers],
        }
    }
}

/// Writes every frame's text as a connection would, and acks it at once.
fn ack_all(
    streamer: &mut Streamer,
    effects: Vec<Effect>,
    tally: &mut Tally,
    count: bool,
) -> anyhow::Result<()> {
    for effect in effects {
        match effect {
            Effect::Send { conn, frame } => {
                let slot = (conn.0 - 1) as usize;
                let buf = &mut tally.buffers[slot];
                buf.clear();
                frame.write_text(buf)?;
                if count {
                    tally.frames += 1;
                    tally.got[slot] += match &frame {
                        Outgoing::Message { .. } => 1,
                        Outgoing::Batch { payload, .. } => payload.len() as u64,
                        Outgoing::Ack { .. } => 0,
                    };
                }
                if let Some(id) = frame.id() {
                    let more = streamer.on_ack(conn, id, 0);
                    // An ack answers with nothing to send while the backlog stays low.
                    ensure!(
                        more.iter().all(|e| !matches!(e, Effect::Close { .. })),
                        "the streamer closed a subscriber: {more:?}"
                    );
                }
            }
            Effect::Close { conn, reason, .. } => bail!("subscriber {} closed: {reason}", conn.0),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_subscriber_gets_every_message() {
        let r = level(3, 25, 4).expect("a clean run");
        assert!(r.frames >= 3 * (25 / 4), "one frame per burst at least");
        assert_eq!(r.messages, 3 * 25 * 3, "begin, insert and commit to each");
    }
}
