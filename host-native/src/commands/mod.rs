//! The `highwater` subcommands: each module holds one command's arguments and its `run`, and
//! is the only place that turns the library's typed errors into `anyhow` reports for a user.
//!
//! - [`check_stream`]: `highwater check-stream`, validate change-stream frames (JSON lines)
//! - [`demo`]: `highwater demo`, the server on an embedded default (what `npm start` runs)
//! - [`doctor`]: `highwater doctor`, what `serve` needs from Postgres and the fix for each miss
//! - [`token`]: `highwater token`, a development scope-sync token
//! - [`typegen`]: `highwater typegen`, TypeScript row types as the client delivers them
//! - [`watch`]: `highwater watch`, print a live change stream as JSON lines
//! - [`zero_replica`]: `highwater zero-replica`, a Zero-format replica file from a snapshot
//!
//! - [`replicate`]: `highwater replicate`, the replica alone (the replicator is `crate::replicate`)
//! - [`serve`]: `highwater serve`, the server (its parts are `crate::serve`)

pub mod check_stream;
pub mod demo;
pub mod doctor;
pub mod replicate;
pub mod serve;
pub mod token;
pub mod typegen;
pub mod watch;
pub mod zero_replica;
