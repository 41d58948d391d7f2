//! The highwater server as a library, so its integration tests and the benchmarks
//! (`highwater-bench`, in `bench/`) can use its parts.
//!
//! Modules of host-native are declared here, not in main.rs; the binary uses them through
//! `highwater_host::…`.

pub mod change_log;
pub mod commands;
pub mod data_lock;
pub(crate) mod ingest;
pub mod pause_point;
pub mod private_pg;
pub mod replica;
pub mod replicate;
pub mod replication;
pub mod runtime;
pub mod serve;
pub(crate) mod startup_retry;
pub mod sync_auth;
pub mod upstream;
