//! Replays every kept input of the peer-frame fuzz targets (`fuzz/regressions/
//! change_stream_upstream/` and `fuzz/regressions/scope_sync_client/`) with the targets' own
//! properties (`fuzz/props/peer_frames.rs`), so CI checks them without the fuzzer.

use std::path::{Path, PathBuf};

#[path = "../../fuzz/props/peer_frames.rs"]
mod props;

fn inputs(target: &str) -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/regressions")
        .join(target);
    assert!(dir.is_dir(), "{} is missing", dir.display());
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("readable regression folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && !hidden(p))
        .collect();
    files.sort();
    files
}

fn hidden(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
}

fn replay(target: &str, property: fn(&[u8]), at_least: usize) {
    let files = inputs(target);
    // The folder holds the seed inputs besides any crasher; an empty one tests nothing.
    assert!(
        files.len() >= at_least,
        "expected at least {at_least} inputs for {target}, found {}",
        files.len()
    );
    for path in files {
        let data = std::fs::read(&path).expect("readable regression input");
        let outcome = std::panic::catch_unwind(|| property(&data));
        assert!(outcome.is_ok(), "{} fails the property", path.display());
    }
}

#[test]
fn change_stream_upstream_inputs_replay() {
    replay("change_stream_upstream", props::change_stream_upstream, 7);
}

#[test]
fn scope_sync_client_inputs_replay() {
    replay("scope_sync_client", props::scope_sync_client, 8);
}
