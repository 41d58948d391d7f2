//! The `highwater` command: one binary for the server, the replicator and the stream tools.

use clap::{CommandFactory, Parser, Subcommand};

/// jemalloc rather than the C library's allocator, for every allocation of the process
/// (SQLite's too): measured on `bench sync`, the server's memory falls back after clients
/// leave and after large replays (glibc kept 135 MiB after a run, jemalloc 27–36 MiB), and a
/// replay is served faster. Its settings, a background thread returning memory unused for a
/// second, are in `.cargo/config.toml`. mimalloc, tried earlier for the change stream's
/// fan-out, was not kept: it halved the page faults but cost more CPU than it saved
/// (`BENCHMARKS.md`, section "Fan-out: one change stream to many subscribers, and catch-up
/// from the log").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
    CheckStream(highwater_host::commands::check_stream::CheckStreamArgs),
    /// Replicate upstream publications into `<data>/replica.db` until Ctrl-C / SIGTERM.
    Replicate(highwater_host::replicate::ReplicateArgs),
    /// Replicate upstream and serve change-stream subscribers, replica snapshots and health.
    Serve(Box<highwater_host::serve::ServeArgs>),
    /// Run the server on an embedded default: a private Postgres with demo data and live writes.
    Demo(highwater_host::commands::demo::DemoArgs),
    /// Check what `serve` needs from the upstream Postgres, and say how to fix each miss.
    Doctor(highwater_host::commands::doctor::DoctorArgs),
    /// Subscribe to a change streamer and print each message as a JSON line.
    Watch(highwater_host::commands::watch::WatchArgs),
    /// Write a Zero-format replica file from a running Highwater's snapshot, for a stock Zero
    /// view-syncer to start from (ZERO_REPLICA_FILE).
    ZeroReplica(highwater_host::commands::zero_replica::ZeroReplicaArgs),
    /// Print a development scope-sync token (HS256) signed with the configured secret.
    Token(highwater_host::commands::token::TokenArgs),
    /// Write TypeScript types of the rows the client delivers, for every replicated table.
    Typegen(highwater_host::commands::typegen::TypegenArgs),
}

fn main() -> std::process::ExitCode {
    use highwater_host::serve::config_file;
    let (args, from_file) =
        match config_file::with_config_file(std::env::args_os().collect(), &Cli::command()) {
            Ok(found) => found,
            Err(error) => {
                eprintln!("Error: {error}");
                return std::process::ExitCode::from(2);
            }
        };
    let cli = Cli::parse_from(&args);
    let log_format = cli.log_format;
    highwater_host::runtime::set_log_format(log_format);
    if let Command::Serve(serve) = &cli.command {
        if serve.print_config {
            print!("{}", serve_config(&args, &from_file));
            return std::process::ExitCode::SUCCESS;
        }
    }
    let result = match cli.command {
        Command::CheckStream(args) => highwater_host::commands::check_stream::run(args),
        Command::Replicate(args) => highwater_host::commands::replicate::run(args),
        Command::Serve(args) => highwater_host::commands::serve::run(*args),
        Command::Demo(args) => highwater_host::commands::demo::run(args),
        Command::Doctor(args) => highwater_host::commands::doctor::run(args),
        Command::Typegen(args) => highwater_host::commands::typegen::run(args),
        Command::Watch(args) => highwater_host::commands::watch::run(args),
        Command::ZeroReplica(args) => highwater_host::commands::zero_replica::run(args),
        Command::Token(args) => highwater_host::commands::token::run(args).map_err(Into::into),
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

/// `serve --print-config`: every option of `serve` with its effective value and its source,
/// one `name = value  # source` line each. The arguments are parsed again for it, so the
/// values are exactly what clap resolved.
fn serve_config(
    args: &[std::ffi::OsString],
    from_file: &highwater_host::serve::config_file::FromFile,
) -> String {
    use clap::parser::ValueSource;
    let command = Cli::command();
    let matches = command.clone().get_matches_from(args);
    let Some(("serve", serve)) = matches.subcommand() else {
        return String::new();
    };
    let Some(serve_command) = command.find_subcommand("serve") else {
        return String::new();
    };
    let mut out = String::new();
    for arg in serve_command.get_arguments() {
        let id = arg.get_id().as_str();
        if arg.is_hide_set() || id == "print_config" || id == "help" || id == "version" {
            continue;
        }
        let Some(long) = arg.get_long() else {
            continue;
        };
        let values: Vec<String> = serve
            .get_raw(id)
            .into_iter()
            .flatten()
            .map(|value| masked(&value.to_string_lossy()))
            .collect();
        let source = match serve.value_source(id) {
            Some(ValueSource::CommandLine) if from_file.options.iter().any(|o| o == long) => {
                format!(
                    "config {}",
                    from_file
                        .path
                        .as_deref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                )
            }
            Some(ValueSource::CommandLine) => "command line".to_owned(),
            Some(ValueSource::EnvVariable) => format!(
                "environment {}",
                arg.get_env()
                    .map(|e| e.to_string_lossy())
                    .unwrap_or_default()
            ),
            Some(ValueSource::DefaultValue) => "default".to_owned(),
            _ => "not set".to_owned(),
        };
        let value = match values.as_slice() {
            [] => "-".to_owned(),
            [one] => one.clone(),
            many => many.join(","),
        };
        out.push_str(&format!("{long} = {value}  # {source}\n"));
    }
    out
}

/// A value with any password in it replaced by `***`: a URL's `user:password@`, and a
/// `password=` or `sslpassword=` parameter (of a URL's query or a key=value string).
fn masked(value: &str) -> String {
    let mut out = value.to_owned();
    if let Some((scheme, rest)) = value.split_once("://") {
        if let Some((userinfo, host)) = rest.split_once('@') {
            if let Some((user, _password)) = userinfo.split_once(':') {
                out = format!("{scheme}://{user}:***@{host}");
            }
        }
    }
    let mut masked = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(at) = rest.find("password=") {
        let value_start = at + "password=".len();
        masked.push_str(&rest[..value_start]);
        masked.push_str("***");
        let value_len = rest[value_start..]
            .find(|c: char| c == '&' || c.is_whitespace())
            .unwrap_or(rest.len() - value_start);
        rest = &rest[value_start + value_len..];
    }
    masked.push_str(rest);
    masked
}

#[cfg(test)]
mod tests {
    use super::masked;

    #[test]
    fn passwords_are_masked_wherever_a_connection_string_holds_them() {
        assert_eq!(
            masked("postgres://app:hunter2@db:5432/app?sslmode=require&password=x&sslpassword=y"),
            "postgres://app:***@db:5432/app?sslmode=require&password=***&sslpassword=***"
        );
        assert_eq!(
            masked("host=db user=app password=hunter2 dbname=app"),
            "host=db user=app password=*** dbname=app"
        );
        assert_eq!(masked("postgres://app@db/app"), "postgres://app@db/app");
        assert_eq!(masked("/var/lib/highwater"), "/var/lib/highwater");
    }
}
