//! Replays every kept fuzz crasher (`fuzz/regressions/change_stream_frame/`) and every seed
//! vector through the change-stream decoder with the fuzz target's own property, so CI checks
//! them without the fuzzer: decoding never panics, and what decodes round-trips stably.

use std::path::{Path, PathBuf};

use highwater_engine::change_stream::{
    decode_downstream_frame, decode_envelope, decode_upstream_frame,
};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The `change_stream_frame` fuzz target's property, as a plain function. Returns whether the
/// input decoded as an envelope (and so had its round trip checked).
fn check(data: &[u8], origin: &str) -> bool {
    let Ok(text) = std::str::from_utf8(data) else {
        return false;
    };
    let decoded = decode_envelope(text);
    if let Ok(envelope) = &decoded {
        let encoded = envelope.encode();
        let again = decode_envelope(&encoded).unwrap_or_else(|e| {
            panic!("{origin}: re-encoded input does not decode: {e}\n{encoded}")
        });
        assert_eq!(&again, envelope, "{origin}: decode(encode(x)) differs");
        assert_eq!(again.encode(), encoded, "{origin}: encoding is not stable");
    }
    let _ = decode_downstream_frame(text);
    let _ = decode_upstream_frame(text);
    decoded.is_ok()
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
fn kept_crashers_replay_without_panicking() {
    let dir = repo().join("fuzz/regressions/change_stream_frame");
    assert!(dir.is_dir(), "{} is missing", dir.display());
    let kept = files(&dir);
    // The folder holds seed inputs (deep nesting, invalid UTF-8, big integers, every framing)
    // besides any crasher; an empty folder means the replay tests nothing.
    assert!(
        kept.len() >= 6,
        "expected the seed inputs in {}, found {} files",
        dir.display(),
        kept.len()
    );
    let mut round_tripped = 0;
    for path in kept {
        let data = std::fs::read(&path).expect("readable regression input");
        round_tripped += usize::from(check(&data, &path.display().to_string()));
    }
    assert!(
        round_tripped >= 3,
        "expected the valid frame seeds to decode and round-trip, {round_tripped} did"
    );
}

#[test]
fn seed_vectors_replay_as_fuzz_inputs() {
    let dir = repo().join("tests/vectors/change-stream");
    let mut lines = 0;
    for path in files(&dir) {
        let text = std::fs::read_to_string(&path).expect("vector file");
        for (n, line) in text.lines().enumerate() {
            let _ = check(line.as_bytes(), &format!("{}:{}", path.display(), n + 1));
            lines += 1;
        }
    }
    assert!(lines > 60, "seed vectors went missing ({lines} lines)");
}
