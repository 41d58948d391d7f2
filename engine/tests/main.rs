//! The integration tests of `highwater-engine`, one test binary for all of them: each file here
//! is a module of it, so a change to the library links one test executable instead of one per
//! file. One file's tests:
//! `cargo test -p highwater-engine --test integration change_stream_vectors::`.

mod change_stream_fuzz_regressions;
mod change_stream_vectors;
mod peer_frame_fuzz_regressions;
mod pgoutput_fuzz_regressions;
