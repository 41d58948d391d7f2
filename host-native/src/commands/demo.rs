//! `highwater demo`: the server on an embedded default. It starts a private Postgres from the
//! machine's binaries (or uses `--upstream`), creates a small demo schema with data (projects,
//! their members, their todos), keeps writing to it so subscribers see live changes (inserts,
//! completions, moves between projects, deletes), and runs `highwater serve` against it with
//! scope sync on: a demo rules file (each user reads the projects it is a member of, who else is
//! in them, and their todos) and a demo secret generated at start, kept in a private file and
//! never printed. In front of serve's routes it mounts the web page (`/`), the built npm package
//! (`/pkg/`), demo tokens, the schema-change button and the membership switches ([`routes`]);
//! the page writes its todos through `/sync`.

mod routes;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::watch;

use crate::private_pg::{PgOptions, PrivatePg};
use crate::runtime;
use crate::serve::{self, ServeArgs, DEFAULT_PORT};
use crate::sync_auth::{mint_token, unix_now_ms, SyncSecret};

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
    /// Address to listen on. Anyone who can reach the demo gets its tokens and can write to its
    /// Postgres: keep it on loopback.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Demo writes per second (0 for none).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) writes_per_second: f64,
    /// The page's files (`index.html`, `app.js`, `style.css`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../web-demo"))]
    pub(crate) web_dir: PathBuf,
    /// The built npm package `highwater` (`scripts/build-wasm` writes it).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../bindings-wasm/dist"))]
    pub(crate) package_dir: PathBuf,
}

/// Scope-sync rules of the demo: a user reads the projects it is a member of, the memberships
/// of those projects (who else is in them) and their todos, all through its own memberships, and
/// writes todos in those projects. Moving a todo to a project the writer is not in would put it
/// out of the writer's reach, so that write is refused. Memberships change only upstream (the
/// page's switches call [`routes`], an admin's action), and move each project's rows in and out.
const RULES: &str = r#"# highwater demo: everything a user sees comes through its memberships.
tables:
  projects:
    where: "id IN (SELECT project_id FROM members WHERE user_id = auth.sub)"
  members:
    where: "project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)"
  todos:
    filterColumns: [project_id, done]
    where: "project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)"
    write: { insert: true, update: [title, done, project_id], delete: true }
"#;

/// The demo's tables, created when missing and seeded when empty: ada and grace share Launch,
/// and each of the three users has a project of their own.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS projects (
    id bigint PRIMARY KEY,
    name text NOT NULL
);
CREATE TABLE IF NOT EXISTS members (
    id bigserial PRIMARY KEY,
    project_id bigint NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    user_id text NOT NULL,
    UNIQUE (project_id, user_id)
);
CREATE TABLE IF NOT EXISTS todos (
    id bigserial PRIMARY KEY,
    project_id bigint NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    title text NOT NULL CHECK (length(title) BETWEEN 1 AND 200),
    done boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO projects (id, name)
VALUES (1, 'Launch'), (2, 'Docs'), (3, 'Hiring'), (4, 'Infra')
ON CONFLICT (id) DO NOTHING;
INSERT INTO members (project_id, user_id)
SELECT project_id, user_id
FROM (VALUES (1, 'ada'), (1, 'grace'), (2, 'ada'), (3, 'grace'), (4, 'linus')) AS m (project_id, user_id)
WHERE NOT EXISTS (SELECT 1 FROM members);
INSERT INTO todos (project_id, title)
SELECT project_id, title
FROM (VALUES
    (1, 'Pick the launch date'), (1, 'Draft the announcement'), (1, 'Freeze the release branch'),
    (1, 'Record the demo video'),
    (2, 'Document scope sync'), (2, 'Write the quick start'), (2, 'Explain row filters'),
    (3, 'Review applications'), (3, 'Schedule interviews'), (3, 'Write the job post'),
    (4, 'Upgrade Postgres'), (4, 'Rotate the demo secret'), (4, 'Add a relay in Europe')
) AS t (project_id, title)
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
    let base = format!("{}:{}", args.host, args.port);
    // The page first: it is what a visitor came for.
    println!("Highwater demo: http://{base}/");
    if !args.package_dir.join("web.js").is_file() {
        // Everything else still works; only the page needs the package.
        println!(
            "  the page needs the npm package, not found at {}: run scripts/build-wasm",
            args.package_dir.display()
        );
    }

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
    let writer = connect(&upstream).await?;
    writer
        .batch_execute(SCHEMA)
        .await
        .context("creating the demo schema")?;
    let endpoints = Arc::new(connect(&upstream).await?);

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
    let secrets = SyncConfig::create()?;
    let mut serve_args = ServeArgs::new(upstream.clone(), data.clone());
    serve_args.port = args.port;
    serve_args.host = args.host.clone();
    serve_args.sync_rules = Some(secrets.rules.clone());
    serve_args.sync_secret.sync_secret_file = Some(secrets.secret_file.clone());
    serve_args.extra_routes = Some(routes::router(Arc::new(routes::DemoState {
        web_dir: args.web_dir.clone(),
        package_dir: args.package_dir.clone(),
        postgres: endpoints,
        sign: secrets.signer(),
    })));

    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(async move {
        runtime::wait_for_signal().await;
        tracing::info!("stopping the demo");
        let _ = stop_tx.send(true);
    });
    if args.writes_per_second > 0.0 {
        let period = Duration::from_secs_f64(1.0 / args.writes_per_second);
        tokio::spawn(write_forever(writer, period, stop.clone()));
    }

    println!(
        "  users         {} (each sees the todos of the projects it is in)",
        routes::USERS.join(", ")
    );
    println!("  upstream      {upstream}");
    println!("  data          {}", data.display());
    println!(
        "  scope sync    ws://{base}/sync  (rules: {})",
        secrets.rules.display()
    );
    println!("  health        http://{base}/health");
    println!("  change stream ws://{base}/replication/v8/subscribe  (v1-v8, Zero-compatible)");
    println!("  snapshot      http://{base}/replica/snapshot");
    println!("  watch it      highwater watch ws://{base} | highwater check-stream --normalize -");
    println!("Ctrl-C stops the demo.");
    let served = serve::serve(serve_args, stop).await;
    drop(private);
    drop(secrets);
    if let Some(dir) = temp {
        let _ = std::fs::remove_dir_all(dir);
    }
    served.map_err(Into::into)
}

async fn connect(upstream: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(upstream, tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connecting to {upstream}"))?;
    tokio::spawn(connection);
    Ok(client)
}

/// The demo's scope-sync configuration: the rules file and a secret generated for this run, in
/// a directory only this user can read, removed when dropped.
struct SyncConfig {
    dir: PathBuf,
    rules: PathBuf,
    secret_file: PathBuf,
    secret: SyncSecret,
}

impl SyncConfig {
    fn create() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("highwater-demo-auth-{}", std::process::id()));
        create_private_dir(&dir)?;
        let mut secret = vec![0u8; 32];
        {
            use std::io::Read as _;
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| f.read_exact(&mut secret))
                .context("reading a random demo secret from /dev/urandom")?;
        }
        let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        let rules = dir.join("rules.yaml");
        let secret_file = dir.join("secret");
        write_private(&rules, RULES.as_bytes())?;
        write_private(&secret_file, hex.as_bytes())?;
        Ok(SyncConfig {
            dir,
            rules,
            secret_file,
            secret: SyncSecret::from_bytes(hex)?,
        })
    }

    /// Signs demo tokens with this run's secret.
    fn signer(&self) -> routes::TokenSigner {
        let secret = self.secret.clone();
        Arc::new(move |sub: &str, ttl_seconds: u64| {
            mint_token(
                &secret,
                sub,
                Duration::from_secs(ttl_seconds),
                &[],
                unix_now_ms(),
            )
            .map_err(|e| format!("Could not sign a demo token: {e}"))
        })
    }
}

impl Drop for SyncConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))
}

fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(bytes))
        .with_context(|| format!("writing {}", path.display()))
}

/// Inserts, completes, moves and deletes todos in turn, project by project, so every kind of
/// change flows; a move to another project is a move-out for the users of one and a move-in for
/// those of the other.
async fn write_forever(
    client: tokio_postgres::Client,
    period: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let projects: Vec<i64> = match client
        .query("SELECT id FROM projects ORDER BY id", &[])
        .await
    {
        Ok(rows) => rows.iter().map(|row| row.get(0)).collect(),
        Err(error) => {
            tracing::warn!(%error, "the demo's writer could not read its projects");
            return;
        }
    };
    if projects.is_empty() {
        return;
    }
    let mut tick = tokio::time::interval(period);
    for n in 0u64.. {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let at = |k: u64| projects[((n + k) % projects.len() as u64) as usize];
        let (project, next_project) = (at(0), at(1));
        let statement = match n % 5 {
            0 | 1 => client
                .execute(
                    "INSERT INTO todos (project_id, title) VALUES ($1, $2)",
                    &[&project, &format!("Live todo {n}")],
                )
                .await,
            2 => client
                .execute(
                    "UPDATE todos SET done = NOT done, updated_at = now()
                     WHERE id = (SELECT id FROM todos WHERE project_id = $1 ORDER BY updated_at LIMIT 1)",
                    &[&project],
                )
                .await,
            3 => client
                .execute(
                    "UPDATE todos SET project_id = $2, updated_at = now()
                     WHERE id = (SELECT id FROM todos WHERE project_id = $1 ORDER BY updated_at LIMIT 1)",
                    &[&project, &next_project],
                )
                .await,
            _ => client
                .execute(
                    "DELETE FROM todos
                     WHERE id = (SELECT id FROM todos WHERE project_id = $1 AND done ORDER BY id LIMIT 1)",
                    &[&project],
                )
                .await,
        };
        if let Err(error) = statement {
            tracing::warn!(%error, "demo write failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync_auth::{parse_rules, RulesFormat};
    use highwater_engine::scope_sync::rules::UpdateColumns;

    #[test]
    fn the_demo_rules_parse_and_let_users_write_only_todos() {
        let rules = parse_rules(RULES, RulesFormat::Yaml).expect("the demo rules parse");
        let names: Vec<&str> = rules.tables().map(|(name, _)| name).collect();
        assert_eq!(names.len(), 3, "{names:?}");
        for table in ["projects", "members", "todos"] {
            let filter = rules.table(table).and_then(|t| t.row_filter());
            assert!(filter.is_some(), "{table} is read through memberships");
        }
        let writes = |table: &str| rules.table(table).map(|t| t.write().clone());
        let todos = writes("todos").expect("todos");
        assert!(todos.insert && todos.delete);
        assert_eq!(
            todos.update,
            Some(UpdateColumns::Only(vec![
                "title".into(),
                "done".into(),
                "project_id".into()
            ]))
        );
        // Memberships change only through the demo's admin endpoint.
        for table in ["projects", "members"] {
            let write = writes(table).expect(table);
            assert!(
                !write.insert && !write.delete && write.update.is_none(),
                "{table}"
            );
        }
    }
}
