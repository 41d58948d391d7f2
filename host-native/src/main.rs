//! The `highwater` command: one binary for the server, the replicator and the stream tools.

use clap::{Parser, Subcommand};

/// jemalloc rather than the C library's allocator, for every allocation of the process
/// (SQLite's too): measured on `bench sync`, the server's memory falls back after clients
/// leave and after large replays (glibc kept 135 MiB after a run, jemalloc 27–36 MiB), and a
/// replay is served faster. Its settings, a background thread returning memory unused for a
/// second, are in `.cargo/config.toml`.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod check_stream;

#[derive(Parser)]
#[command(name = "highwater", version, about = "Postgres-to-client sync engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines are written to stderr: `text`, or `json` (one object per line). Levels
    /// come from `RUST_LOG`.
    #[arg(
        long,
        global = true,
        env = "HIGHWATER_LOG_FORMAT",
        value_enum,
        default_value_t = highwater_host::runtime::LogFormat::Text
    )]
    log_format: highwater_host::runtime::LogFormat,
}

#[derive(Subcommand)]
enum Command {
    // Each subcommand lives in its own module; add a variant and a match arm per command.
    /// Validate change-stream frames or messages (JSON lines) and report the invalid ones.
    CheckStream(check_stream::CheckStreamArgs),
    /// Replicate upstream publications into `<data>/replica.db` until Ctrl-C / SIGTERM.
    Replicate(highwater_host::replicate::ReplicateArgs),
    /// Replicate upstream and serve change-stream subscribers, replica snapshots and health.
    Serve(Box<highwater_host::serve::ServeArgs>),
    /// Run the server on an embedded default: a private Postgres with demo data and live writes.
    Demo(highwater_host::demo::DemoArgs),
    /// Check what `serve` needs from the upstream Postgres, and say how to fix each miss.
    Doctor(highwater_host::doctor::DoctorArgs),
    /// Subscribe to a change streamer and print each message as a JSON line.
    Watch(highwater_host::watch::WatchArgs),
    /// Run a benchmark and print its results table (`highwater bench ingest`).
    Bench(highwater_host::bench::BenchArgs),
    /// Write a Zero-format replica file from a running Highwater's snapshot, for a stock Zero
    /// view-syncer to start from (ZERO_REPLICA_FILE).
    ZeroReplica(highwater_host::zero_replica::ZeroReplicaArgs),
    /// Print a development scope-sync token (HS256) signed with the configured secret.
    Token(highwater_host::sync_auth::TokenArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let log_format = cli.log_format;
    highwater_host::runtime::set_log_format(log_format);
    let result = match cli.command {
        Command::CheckStream(args) => check_stream::run(args),
        Command::Replicate(args) => highwater_host::replicate::run(args),
        Command::Serve(args) => highwater_host::serve::run(*args),
        Command::Demo(args) => highwater_host::demo::run(args),
        Command::Doctor(args) => highwater_host::doctor::run(args),
        Command::Watch(args) => highwater_host::watch::run(args),
        Command::Bench(args) => highwater_host::bench::run(args),
        Command::ZeroReplica(args) => highwater_host::zero_replica::run(args),
        Command::Token(args) => highwater_host::sync_auth::run_token(args).map_err(Into::into),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // With JSON logs every line of stderr is an object, the last one included.
            if log_format == highwater_host::runtime::LogFormat::Json
                && tracing::dispatcher::has_been_set()
            {
                tracing::error!(
                    error = format!("{error:#}"),
                    "highwater stopped on an error"
                );
            } else {
                eprintln!("Error: {error:?}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}
