//! The highwater server as a library, so its integration tests and the benchmarks
//! (`highwater-bench`, in `bench/`) can use its parts.
//!
//! Modules of host-native are declared here, not in main.rs; the binary uses them through
//! `highwater_host::…`. Items are `pub(crate)` unless the binary, the benchmarks or the
//! integration tests use them (`unreachable_pub` warns of a `pub` no one outside can reach).

#![warn(unreachable_pub)]
// The module docs are for people working on the server and link its private parts: read them
// with `cargo doc -p highwater-host --document-private-items`.
#![allow(rustdoc::private_intra_doc_links)]

pub(crate) mod change_log;
pub mod commands;
pub mod data_lock;
pub(crate) mod ingest;
pub(crate) mod pause_point;
pub mod private_pg;
pub mod replica;
pub mod replicate;
pub mod replication;
pub mod runtime;
pub mod serve;
pub(crate) mod startup_retry;
pub mod sync_auth;
pub(crate) mod upstream;
