//! Replays every kept input of the `pgoutput_message` fuzz target (`fuzz/regressions/
//! pgoutput_message/`: seed sessions captured from Postgres and any crasher) with the target's
//! own property, so CI checks them without the fuzzer: framing, decoding and mapping never
//! panic, and every mapped change-stream message round-trips through its JSON encoding.

use std::path::{Path, PathBuf};

use highwater_engine::change_stream::{decode_downstream, encode_downstream};
use highwater_engine::pgoutput::{PgoutputEvent, PgoutputMapper};

/// The fuzz target's property, as a plain function; returns how many messages were mapped.
fn check(data: &[u8], origin: &str) -> usize {
    let mut mapper = PgoutputMapper::new();
    let mut mapped = 0;
    let mut rest = data;
    while !rest.is_empty() {
        let frame = match rest {
            [hi, lo, body @ ..] => {
                let len = usize::from(u16::from_be_bytes([*hi, *lo])).min(body.len());
                let (frame, tail) = body.split_at(len);
                rest = tail;
                frame
            }
            _ => std::mem::take(&mut rest),
        };
        match mapper.map_frame(frame) {
            Ok(Some(PgoutputEvent::Downstream(message))) => {
                let text = encode_downstream(&message);
                let again = decode_downstream(&text).unwrap_or_else(|e| {
                    panic!("{origin}: mapped message does not decode: {e}\n{text}")
                });
                assert_eq!(
                    again, message,
                    "{origin}: decode(encode(x)) differs: {text}"
                );
                mapped += 1;
            }
            Ok(Some(_)) => mapped += 1,
            Ok(None) | Err(_) => {}
        }
    }
    mapped
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    files
}

#[test]
fn kept_inputs_replay_without_panicking() {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions/pgoutput_message");
    let inputs = files(&dir);
    assert!(!inputs.is_empty(), "{} has no inputs", dir.display());
    for path in inputs {
        let data = std::fs::read(&path).expect("readable regression input");
        check(&data, &path.display().to_string());
    }
}

#[test]
fn captured_seed_session_maps_every_frame() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/regressions/pgoutput_message/seed-pg15-session");
    let data = std::fs::read(&path).expect("seed session");
    // 27 pgoutput messages and a keepalive; the two Type messages map to nothing.
    assert_eq!(check(&data, "seed-pg15-session"), 26);
}
