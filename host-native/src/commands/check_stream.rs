//! `highwater check-stream`: validates captured change-stream traffic with the engine's codec.
//!
//! Input is JSON lines: frames (`{"id","msg"}`, `{"id","batch"}`, `{"ack"}`) or bare message
//! tuples, in either direction; blank lines are skipped.
//!
//! Output without `--normalize` (stdout): `line <n>: <reason>` for each invalid line, then
//! `<N> passed, <M> failed` counting non-blank lines.
//!
//! Output with `--normalize`: stdout carries only the valid messages re-encoded, one bare message
//! per line (a batch frame's messages one per line, acks print nothing), so the output is itself
//! valid input; the `line <n>: <reason>` reports and the summary go to stderr.
//!
//! With `--protocol N --direction downstream|upstream` a line must also be traffic a peer at
//! protocol vN may send that way (framing per version, messages the version knows, defaults a
//! replicator can apply); without them any version's traffic passes.
//!
//! The exit status is 0 only when every line is valid.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::path::PathBuf;

use anyhow::{bail, Context};
use highwater_engine::change_stream::{
    check_traffic, decode_envelope, encode_message, Direction, MAX_PROTOCOL_VERSION,
    MIN_PROTOCOL_VERSION,
};

#[derive(clap::Args, Debug)]
pub struct CheckStreamArgs {
    /// JSON-lines file to check; `-` (the default) reads standard input.
    #[arg(default_value = "-")]
    input: PathBuf,
    /// Print each valid message re-encoded, one per line (reports and summary go to stderr).
    #[arg(long)]
    normalize: bool,
    /// Check against what a peer at this protocol version may send (needs --direction).
    #[arg(long, value_name = "N", requires = "direction",
          value_parser = clap::value_parser!(u32).range(MIN_PROTOCOL_VERSION as i64..=MAX_PROTOCOL_VERSION as i64))]
    protocol: Option<u32>,
    /// The direction the traffic flows (needs --protocol).
    #[arg(long, value_enum, requires = "protocol")]
    direction: Option<TrafficDirection>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum TrafficDirection {
    /// Change-streamer to subscriber.
    Downstream,
    /// Subscriber to change-streamer.
    Upstream,
}

/// What lines are checked against beyond their shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Peer {
    version: u32,
    direction: Direction,
}

/// Counts of non-blank lines.
#[derive(Debug, Default, PartialEq, Eq)]
struct Tally {
    passed: usize,
    failed: usize,
}

pub fn run(args: CheckStreamArgs) -> anyhow::Result<()> {
    let reader: Box<dyn BufRead> = if args.input.as_os_str() == "-" {
        Box::new(io::stdin().lock())
    } else {
        let file = File::open(&args.input)
            .with_context(|| format!("cannot open {}", args.input.display()))?;
        Box::new(BufReader::new(file))
    };
    let stdout = io::stdout().lock();
    let peer = match (args.protocol, args.direction) {
        (Some(version), Some(direction)) => Some(Peer {
            version,
            direction: match direction {
                TrafficDirection::Downstream => Direction::Downstream,
                TrafficDirection::Upstream => Direction::Upstream,
            },
        }),
        _ => None,
    };
    let tally = if args.normalize {
        check(reader, stdout, io::stderr().lock(), true, peer)?
    } else {
        check(reader, stdout, io::sink(), false, peer)?
    };
    if tally.failed > 0 {
        bail!(
            "{} of {} lines are not valid change-stream traffic",
            tally.failed,
            tally.passed + tally.failed
        );
    }
    Ok(())
}

/// Checks every line of `input`. Normalized messages go to `out`; reports and the summary go to
/// `reports` in normalize mode, else to `out` as well.
fn check(
    mut input: impl BufRead,
    mut out: impl Write,
    mut reports: impl Write,
    normalize: bool,
    peer: Option<Peer>,
) -> anyhow::Result<Tally> {
    let mut tally = Tally::default();
    let mut buf = Vec::new();
    let mut number = 0;
    loop {
        buf.clear();
        if input
            .read_until(b'\n', &mut buf)
            .context("cannot read input")?
            == 0
        {
            break;
        }
        number += 1;
        let report: &mut dyn Write = if normalize { &mut reports } else { &mut out };
        let line = match std::str::from_utf8(&buf) {
            Ok(line) => line.trim_end_matches(['\n', '\r']),
            Err(e) => {
                tally.failed += 1;
                writeln!(
                    report,
                    "line {number}: expected UTF-8 text, found invalid bytes ({e})"
                )?;
                continue;
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let checked = decode_envelope(line)
            .map_err(|e| e.to_string())
            .and_then(|envelope| match peer {
                Some(p) => check_traffic(&envelope, p.version, p.direction)
                    .map(|()| envelope)
                    .map_err(|e| e.to_string()),
                None => Ok(envelope),
            });
        match checked {
            Ok(envelope) => {
                tally.passed += 1;
                if normalize {
                    for message in envelope.messages() {
                        writeln!(out, "{}", encode_message(message))?;
                    }
                }
            }
            Err(e) => {
                tally.failed += 1;
                writeln!(report, "line {number}: {e}")?;
            }
        }
    }
    let summary = format!("{} passed, {} failed", tally.passed, tally.failed);
    if normalize {
        writeln!(reports, "{summary}")?;
    } else {
        writeln!(out, "{summary}")?;
    }
    out.flush()?;
    Ok(tally)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_check(input: &str, normalize: bool) -> (Tally, String, String) {
        let (mut out, mut reports) = (Vec::new(), Vec::new());
        let tally = check(input.as_bytes(), &mut out, &mut reports, normalize, None)
            .expect("in-memory I/O");
        let text = |b: Vec<u8>| String::from_utf8(b).expect("utf-8");
        (tally, text(out), text(reports))
    }

    const INPUT: &str = concat!(
        "[\"rollback\",{\"tag\":\"rollback\"}]\n",
        "\n",
        "{\"id\":1,\"batch\":[[\"status\",{\"tag\":\"status\"}],[\"rollback\",{\"tag\":\"rollback\",\"x\":1}]]}\r\n",
        "[\"rollback\",{\"tag\":\"commit\"}]\n",
        "{\"ack\":1}"
    );

    #[test]
    fn reports_invalid_lines_by_number_then_the_summary() {
        let (tally, out, reports) = run_check(INPUT, false);
        assert_eq!(
            tally,
            Tally {
                passed: 3,
                failed: 1
            }
        );
        assert_eq!(
            out,
            "line 4: at $[1].tag: expected \"rollback\", found \"commit\"\n3 passed, 1 failed\n"
        );
        assert_eq!(reports, "");
    }

    #[test]
    fn normalize_prints_one_message_per_line_and_reports_aside() {
        let (_, out, reports) = run_check(INPUT, true);
        assert_eq!(
            out,
            concat!(
                "[\"rollback\",{\"tag\":\"rollback\"}]\n",
                "[\"status\",{\"tag\":\"status\"}]\n",
                "[\"rollback\",{\"tag\":\"rollback\",\"x\":1}]\n"
            )
        );
        assert!(reports.starts_with("line 4: "), "{reports}");
        assert!(reports.ends_with("3 passed, 1 failed\n"), "{reports}");
    }

    #[test]
    fn a_peer_version_and_direction_reject_what_that_peer_would() {
        let input = concat!(
            "{\"id\":1,\"msg\":[\"status\",{\"tag\":\"status\"}]}\n",
            "{\"id\":2,\"batch\":[[\"rollback\",{\"tag\":\"rollback\"}]]}\n",
            "{\"ack\":1}\n",
        );
        let peer = |version, direction| Some(Peer { version, direction });
        let tally = |peer| {
            check(input.as_bytes(), io::sink(), io::sink(), false, peer).expect("in-memory I/O")
        };
        let t = |passed, failed| Tally { passed, failed };
        assert_eq!(tally(None), t(3, 0));
        assert_eq!(tally(peer(6, Direction::Downstream)), t(1, 2));
        assert_eq!(tally(peer(7, Direction::Downstream)), t(3, 0));
        assert_eq!(tally(peer(6, Direction::Upstream)), t(1, 2));
        let mut out = Vec::new();
        check(
            input.as_bytes(),
            &mut out,
            io::sink(),
            false,
            peer(6, Direction::Downstream),
        )
        .expect("in-memory I/O");
        assert!(
            String::from_utf8_lossy(&out)
                .starts_with("line 2: not valid v6 downstream traffic: a {batch} frame"),
            "{}",
            String::from_utf8_lossy(&out)
        );
    }

    #[test]
    fn invalid_utf8_is_a_failed_line_not_an_abort() {
        let input = b"\xff\xfe\n[\"rollback\",{\"tag\":\"rollback\"}]\n";
        let mut out = Vec::new();
        let tally = check(&input[..], &mut out, io::sink(), false, None).expect("in-memory I/O");
        assert_eq!(
            tally,
            Tally {
                passed: 1,
                failed: 1
            }
        );
        assert!(String::from_utf8_lossy(&out).starts_with("line 1: expected UTF-8 text"));
    }
}
