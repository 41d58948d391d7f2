//! The `highwater` command: one binary for the server, the replicator and the stream tools.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "highwater", version, about = "Postgres-to-client sync engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    // Each subcommand lives in its own module; add a variant and a match arm per command.
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {}
}
