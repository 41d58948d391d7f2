//! Highwater's platform-neutral sync core.
//!
//! Everything here is sans-IO: bytes, messages and `now_ms` come in as arguments, and what to
//! send, store or acknowledge comes out as values. The same code runs inside the `highwater`
//! server and, compiled to WebAssembly, in browsers and Node.

pub mod backfill;
pub mod backoff;
pub mod change_stream;
pub mod liveness;
pub mod pgoutput;
pub mod scope_sync;
pub mod streamer;
pub mod upstream;
pub mod watermark;
