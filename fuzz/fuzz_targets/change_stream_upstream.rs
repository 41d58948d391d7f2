//! Arbitrary bytes as the frames one peer sends, one per line: see `fuzz/props/peer_frames.rs`
//! (`change_stream_upstream`) for the property checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../props/peer_frames.rs"]
mod props;

fuzz_target!(|data: &[u8]| props::change_stream_upstream(data));
