//! `highwater demo`: the server on an embedded default. It starts a private Postgres from the
//! machine's binaries (or uses `--upstream`), creates a small demo schema with data, keeps
//! writing to it so subscribers see live changes, and runs `highwater serve` against it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::watch;

use crate::private_pg::{PgOptions, PrivatePg};
use crate::runtime;
use crate::serve::{self, ServeArgs, DEFAULT_PORT};

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Use this Postgres instead of starting a private one (it needs wal_level=logical).
    #[arg(long)]
    pub upstream: Option<String>,
    /// Where the replica and change log live (default: a fresh temporary directory).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// HTTP and WebSocket port.
    #[arg(long, default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Demo writes per second (0 for none).
    #[arg(long, default_value_t = 1.0)]
    pub writes_per_second: f64,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS todos (
    id bigserial PRIMARY KEY,
    owner text NOT NULL,
    title text NOT NULL,
    done boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO todos (owner, title)
SELECT owner, 'Seed todo ' || n
FROM unnest(ARRAY['ada', 'grace', 'linus']) AS owner, generate_series(1, 5) AS n
WHERE NOT EXISTS (SELECT 1 FROM todos);
";

/// Runs the demo until Ctrl-C or SIGTERM.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    runtime::init_tracing("info");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(demo(args))
}

async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    // `private` is held for the whole run: dropping it stops the server and removes its files.
    let (private, upstream) = match args.upstream.clone() {
        Some(url) => (None, url),
        None => {
            let pg = PrivatePg::start(PgOptions::default())
                .await
                .context("starting a private Postgres for the demo")?;
            let url = pg.url();
            (Some(pg), url)
        }
    };
    let (client, connection) = tokio_postgres::connect(&upstream, tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connecting to {upstream}"))?;
    tokio::spawn(connection);
    client
        .batch_execute(SCHEMA)
        .await
        .context("creating the demo schema")?;

    // Without --data the replica lives in a fresh directory removed at exit: a private Postgres
    // is new on every run, so its replica must be too.
    let temp = match &args.data {
        Some(_) => None,
        None => {
            let dir = std::env::temp_dir().join(format!("highwater-demo-{}", std::process::id()));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            Some(dir)
        }
    };
    let data = args
        .data
        .clone()
        .or_else(|| temp.clone())
        .unwrap_or_default();
    let mut serve_args = ServeArgs::new(upstream.clone(), data.clone());
    serve_args.port = args.port;
    serve_args.host = args.host.clone();

    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(async move {
        runtime::wait_for_signal().await;
        tracing::info!("stopping the demo");
        let _ = stop_tx.send(true);
    });
    if args.writes_per_second > 0.0 {
        let period = Duration::from_secs_f64(1.0 / args.writes_per_second);
        tokio::spawn(write_forever(client, period, stop.clone()));
    }

    let base = format!("{}:{}", args.host, args.port);
    println!("Highwater demo");
    println!("  upstream      {upstream}");
    println!("  data          {}", data.display());
    println!("  health        http://{base}/health");
    println!("  change stream ws://{base}/replication/v8/subscribe  (v1-v8, Zero-compatible)");
    println!("  snapshot      http://{base}/replica/snapshot");
    println!("  watch it      highwater watch ws://{base} | highwater check-stream --normalize -");
    println!("Ctrl-C stops the demo.");
    let served = serve::serve(serve_args, stop).await;
    drop(private);
    if let Some(dir) = temp {
        let _ = std::fs::remove_dir_all(dir);
    }
    served.map_err(Into::into)
}

/// Inserts, completes and deletes todos in turn, so every kind of change flows.
async fn write_forever(
    client: tokio_postgres::Client,
    period: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let owners = ["ada", "grace", "linus"];
    let mut tick = tokio::time::interval(period);
    for n in 0u64.. {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let owner = owners[(n % 3) as usize];
        let statement = match n % 4 {
            0 | 1 => client
                .execute(
                    "INSERT INTO todos (owner, title) VALUES ($1, $2)",
                    &[&owner, &format!("Live todo {n}")],
                )
                .await,
            2 => client
                .execute(
                    "UPDATE todos SET done = NOT done, updated_at = now()
                     WHERE id = (SELECT id FROM todos WHERE owner = $1 ORDER BY updated_at LIMIT 1)",
                    &[&owner],
                )
                .await,
            _ => client
                .execute(
                    "DELETE FROM todos
                     WHERE id = (SELECT id FROM todos WHERE owner = $1 AND done ORDER BY id LIMIT 1)",
                    &[&owner],
                )
                .await,
        };
        if let Err(error) = statement {
            tracing::warn!(%error, "demo write failed");
        }
    }
}
