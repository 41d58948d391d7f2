//! `highwater-bench …`: benchmarks a user can run, each printing a results table. They use the
//! server's parts through its library (`highwater_host`); `sync` and `writes` run the
//! `highwater` binary itself as a process of its own (see [`server_binary`]).
//!
//! - `ingest` ([`ingest`]): Postgres changes to the durable SQLite replica, with
//!   `pg_recvlogical` on the same workload as the yardstick.
//! - `apply` ([`apply`]): the replica's apply path alone (no Postgres), JSON rows against rows
//!   that kept their pgoutput text.
//! - `fanout` ([`fanout`]): committed changes delivered to 1, 10, 100 change-stream
//!   subscribers (throughput, commit-to-subscriber latency), and catch-up speed from the log.
//! - `initial-sync` ([`initial_sync`]): copying a table into a fresh replica, against
//!   `psql \copy … to /dev/null` of the same table.
//! - `streamer` ([`streamer`]): the engine's change-stream streamer alone, in memory: routing
//!   and framing cost per transaction and subscriber.
//! - `sync` ([`sync`]): scope sync on `/sync`: commit-to-client latency at many connections,
//!   replay rows/s, memory per idle subscription.
//! - `writes` ([`writes`]): writes through `/sync`, end to end: mutation → confirmed latency
//!   at 1 and 100 writers, flushing a queued outbox, and `HighwaterClient`'s outbox in Node.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

/// The same allocator as the `highwater` binary (host-native/src/main.rs): the benchmarks that
/// run the server's parts in this process (`ingest`, `apply`, `fanout`, `initial-sync`) measure
/// them as the server runs them. Its settings are in `.cargo/config.toml`.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

pub mod apply;
mod common;
pub mod fanout;
pub mod ingest;
pub mod initial_sync;
mod recvlogical;
pub mod streamer;
pub mod sync;
mod workload;
pub mod writes;

/// Command-line arguments of `highwater-bench`.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "highwater-bench",
    version,
    about = "Highwater's benchmarks, each printing a results table (BENCHMARKS.md)"
)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub benchmark: Benchmark,
}

/// The benchmarks.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Benchmark {
    /// Ingest throughput, commit to durable replica, against `pg_recvlogical` on the same WAL.
    Ingest(ingest::IngestArgs),
    /// The replica's apply path alone: JSON rows against rows that kept their text.
    Apply(apply::ApplyArgs),
    /// Delivery to many change-stream subscribers, and catch-up of one far behind.
    Fanout(fanout::FanoutArgs),
    /// Initial sync of a large table, against `psql \copy … to /dev/null` of it.
    InitialSync(initial_sync::InitialSyncArgs),
    /// The change-stream streamer alone, in memory: routing cost per transaction and subscriber.
    Streamer(streamer::StreamerArgs),
    /// Scope sync: commit-to-client latency, replay speed, memory per idle subscription.
    Sync(sync::SyncArgs),
    /// Writes through scope sync: mutation to confirmed latency, outbox flush, the Node client.
    Writes(writes::WritesArgs),
}

fn main() -> anyhow::Result<()> {
    run(BenchArgs::parse())
}

/// Runs the chosen benchmark and prints its table to stdout.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    match args.benchmark {
        Benchmark::Ingest(args) => ingest::run(args),
        Benchmark::Apply(args) => apply::run(args),
        Benchmark::Fanout(args) => fanout::run(args),
        Benchmark::InitialSync(args) => initial_sync::run(args),
        Benchmark::Streamer(args) => streamer::run(args),
        Benchmark::Sync(args) => sync::run(args),
        Benchmark::Writes(args) => writes::run(args),
    }
}

/// The `highwater` binary a benchmark serves with: `explicit` if given, else the one beside this
/// binary in the same target directory (`target/release/highwater` for
/// `target/release/highwater-bench`). `cargo run -p highwater-bench` does not build it;
/// `cargo build --release -p highwater-host --bin highwater` does.
pub(crate) fn server_binary(explicit: Option<&PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path.clone());
    }
    let exe = std::env::current_exe().context("cannot find this binary's path")?;
    let path = exe.with_file_name(format!("highwater{}", std::env::consts::EXE_SUFFIX));
    if !path.is_file() {
        let release = if cfg!(debug_assertions) {
            ""
        } else {
            " --release"
        };
        anyhow::bail!(
            "no highwater binary at {}: build it (cargo build{release} -p highwater-host --bin \
             highwater) or name one with --server-binary",
            path.display()
        );
    }
    Ok(path)
}
