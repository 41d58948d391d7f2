//! The integration tests of `highwater-host`, one test binary for all of them: each file here is
//! a module of it, so a change to the library links one test executable instead of one per file.
//! One file's tests: `cargo test -p highwater-host --test integration scope_sync::`.

// Fixtures shared by the modules below.
mod replica_support;
mod scratch_support;
mod serve_support;
mod support;

mod backfill_rewrite;
mod check_stream;
mod demo_watch;
mod demo_web;
mod log_output;
mod pg_tls;
mod private_pg;
mod relay_tls;
mod replica_ddl;
mod replica_faults;
mod replica_initial_sync;
mod replica_reset;
mod replica_sync;
mod replication_stream;
mod scope_sync;
mod serve_backfill;
mod serve_backpressure;
mod serve_ddl;
mod serve_relay;
mod serve_restart;
mod serve_security;
mod serve_startup;
mod serve_stream;
mod sync_token;
