//! `highwater serve`: replicates Postgres into the SQLite replica and change log, and serves
//! Zero-compatible change-stream subscribers, replica snapshots, health checks and, with
//! `--sync-rules`, scope-sync clients on `GET /sync` (`sync.rs`: each commit's feed entries
//! are routed from the ingest thread once the replica commit is durable).
//!
//! ```text
//!  Postgres ──WalStream──▶ source task ──SourceEvent (raw pgoutput / primary frames)──┐
//!     ▲ Ack(lsn) / AckFrames(ids)                                                     ▼
//!     └──────────────── ingest thread: UpstreamSession::handle ── Apply ──▶ Hub::call(Streamer::on_upstream)
//!                        ReplicaWriter + change_log ◀── storage queue ── Store/FetchCatchup/Purge ─┐
//!  WebSocket tasks ── client frames ──▶ Hub::call(Streamer::…) ──── Send/Close ──▶ sockets         │
//!  catch-up readers ── rows ─────────▶ Hub::call(Streamer::catchup_rows)                           │
//!  ticker ── tick / backup watermark ▶ Hub::call(…)  ──────────────────────────────────────────────┘
//! ```
//!
//! The engine holds every rule; this module only carries effects out. The engine's
//! `UpstreamSession` decides what of the source is already stored, what to confirm and when,
//! where schema changes go and when a backfill may start; its
//! [`Streamer`] decides what each subscriber gets. The
//! loop is forward, store, ack: a message is forwarded to live subscribers as soon as it is
//! decoded, the whole upstream transaction is applied to the replica and appended to the
//! change log in one SQLite transaction, and only once that commit is durable does the source
//! hear the confirmation.

mod change_stream;
pub mod config_file;
mod endpoints;
mod fault;
mod ingest;
mod metrics;
mod relay;
mod scope_sync;
mod security;
mod snapshot;
pub(crate) mod snapshot_download;
mod source;
mod startup;
pub(crate) mod tls;
mod wal_watch;

pub(crate) use scope_sync::flush_thread_cache_if_asked;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use highwater_engine::change_stream::MAX_PROTOCOL_VERSION;
use highwater_engine::scope_sync::server::ServerConfig;
use highwater_engine::streamer::{
    BackupWatermark, ChangeLogState, Streamer, StreamerConfig, DEFAULT_BACKLOG_FULL_TIMEOUT_MS,
    DEFAULT_BACKLOG_HIGH_WATER_BYTES, DEFAULT_PURGE_DELAY_MS,
};
use highwater_engine::upstream::GroupLimits;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::change_log::ChangeLogError;
use crate::data_lock::{DataDirLock, DataLockError};
use crate::replica::ReplicaError;
use crate::replication::initial_sync::SyncError;
use crate::replication::setup::DEFAULT_APP_ID;
use crate::replication::ReplicationError;
use crate::sync_auth::{AuthConfigError, SyncAuth, SyncSecretArgs};
use change_stream::{Hub, Positions};

pub use endpoints::SNAPSHOT_PATH;
pub use relay::RelayError;
pub(crate) use security::load_token;
pub use security::{
    InsecureListen, ReplicationToken, SecurityArgs, TokenError, REPLICATION_TOKEN_ENV,
    UPSTREAM_TOKEN_ENV,
};
pub use snapshot::WATERMARK_HEADER;
pub use tls::TlsFileError;

/// Zero's change-streamer port when the sync port is 4848 is 4849; highwater serves both
/// protocols on one port.
pub(crate) const DEFAULT_PORT: u16 = 4848;
/// WebSocket liveness: ping this often, drop a peer silent for a whole period.
pub(crate) const PING_INTERVAL: Duration = Duration::from_secs(30);
/// How often the replica's durable position is reported as a backup watermark.
pub(crate) const DEFAULT_BACKUP_INTERVAL_MS: u64 = 10_000;

/// Command-line arguments of `highwater serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Upstream Postgres URL (`postgres://user[:password]@host:port/db`); the user needs the
    /// REPLICATION attribute, and a superuser to follow schema changes (event triggers).
    /// Empty for a relay (`--from`).
    #[arg(
        long,
        default_value = "",
        hide_default_value = true,
        required_unless_present = "from",
        conflicts_with = "from",
        env = "HIGHWATER_UPSTREAM",
        hide_env_values = true
    )]
    pub upstream: String,
    /// Relay mode: follow another Highwater (`ws://host:port`) instead of Postgres. The replica
    /// is restored from its snapshot, then kept current through its change stream; no
    /// replication slot is used.
    #[arg(long, env = "HIGHWATER_FROM")]
    pub from: Option<String>,
    /// Directory of the replica and change log (`<data>/replica.db`).
    #[arg(long, env = "HIGHWATER_DATA")]
    pub data: PathBuf,
    /// Port for WebSockets, snapshots and health checks.
    #[arg(long, default_value_t = DEFAULT_PORT, env = "HIGHWATER_PORT")]
    pub port: u16,
    /// Address to listen on; other than loopback only with a replication token (or
    /// `--insecure-no-auth`).
    #[arg(long, default_value = "127.0.0.1", env = "HIGHWATER_HOST")]
    pub host: String,
    /// Names the slot (`<app>_slot`), the default publication (`<app>_pub`) and the DDL trigger.
    #[arg(long, default_value = DEFAULT_APP_ID, env = "HIGHWATER_APP_ID")]
    pub app_id: String,
    /// Publications to replicate; by default `<app>_pub`, created FOR ALL TABLES if missing.
    #[arg(
        long = "publication",
        env = "HIGHWATER_PUBLICATIONS",
        value_delimiter = ','
    )]
    pub publications: Vec<String>,
    /// Base URL other servers reach this one at (for `backupURL`); by default
    /// `http://127.0.0.1:<port>` when listening on every address, else `http://<host>:<port>`.
    #[arg(long, env = "HIGHWATER_PUBLIC_URL")]
    pub public_url: Option<String>,
    /// Wait after a backup watermark before purging the change log up to it.
    #[arg(long, default_value_t = DEFAULT_PURGE_DELAY_MS, hide = true)]
    pub purge_delay_ms: u64,
    /// How often the replica's durable position is reported as a backup watermark.
    #[arg(long, default_value_t = DEFAULT_BACKUP_INTERVAL_MS, hide = true)]
    pub backup_interval_ms: u64,
    /// Unacknowledged bytes a subscriber may hold before the upstream stream is paused.
    #[arg(long, default_value_t = DEFAULT_BACKLOG_HIGH_WATER_BYTES, hide = true)]
    pub(crate) backlog_high_water_bytes: usize,
    /// How long a subscriber may hold up the stream with a full backlog before it is closed
    /// (1013, try again later).
    #[arg(long, default_value_t = DEFAULT_BACKLOG_FULL_TIMEOUT_MS, hide = true)]
    pub(crate) backlog_full_timeout_ms: u64,
    /// Open WebSocket connections (change-stream and scope sync together) served at once;
    /// one more is refused with 503 before the upgrade.
    #[arg(long, default_value_t = DEFAULT_MAX_CONNECTIONS, value_name = "N", env = "HIGHWATER_MAX_CONNECTIONS")]
    pub(crate) max_connections: usize,
    /// When the replication slot is missing or invalidated, discard the replica and change log
    /// and sync again instead of stopping with an error.
    #[arg(long, env = "HIGHWATER_AUTO_RESET")]
    pub auto_reset: bool,
    /// COPY readers of an initial sync, each on its own upstream connection in the slot's
    /// snapshot: tables are copied in parallel, and a table of 128 MiB or more is split into
    /// a page range per reader (Postgres 14+).
    #[arg(long, default_value_t = crate::replication::initial_sync::DEFAULT_SYNC_WORKERS, env = "HIGHWATER_SYNC_WORKERS")]
    pub sync_workers: usize,
    /// Turns on scope sync (`GET /sync`): the rules (JSON or YAML) saying which tables apps may
    /// read, which columns a scope may filter on, which are never sent, and which conditions
    /// must equal a token claim. Without it `/sync` answers 404.
    #[arg(long, value_name = "FILE", env = "HIGHWATER_SYNC_RULES")]
    pub sync_rules: Option<PathBuf>,
    #[command(flatten)]
    pub sync_secret: SyncSecretArgs,
    /// How long exits (deletes, rows leaving a scope) are kept for catch-up; an older cursor
    /// gets a reset and a full replay.
    #[arg(long, default_value_t = DEFAULT_SYNC_RETENTION_SECS, value_name = "SECONDS", env = "HIGHWATER_SYNC_RETENTION_SECS")]
    pub sync_retention_secs: u64,
    /// How long a scope-sync socket may stay over its outbound budget before it is closed
    /// (1013, "slow consumer").
    #[arg(long, default_value_t = DEFAULT_SLOW_CONSUMER_MS, hide = true)]
    pub sync_slow_consumer_ms: u64,
    /// How often a live scope-sync subscription whose scope is quiet is told how far the feed
    /// has moved (its client's cursor follows, so it stays above the retention floor).
    #[arg(long, default_value_t = DEFAULT_SYNC_CHECKPOINT_MS, hide = true)]
    pub sync_checkpoint_ms: u64,
    /// On SIGTERM or Ctrl-C, how long to finish the current group and close the sockets before
    /// exiting anyway (a second signal exits at once).
    #[arg(long, default_value_t = DEFAULT_SHUTDOWN_TIMEOUT_SECS, env = "HIGHWATER_SHUTDOWN_TIMEOUT_SECS")]
    pub(crate) shutdown_timeout_secs: u64,
    /// Print the effective configuration (each option's value and where it came from: the
    /// command line, the environment, the config file or the default; passwords masked) and
    /// exit.
    #[arg(long)]
    pub print_config: bool,
    /// A TOML file of options named as on the command line (`port = 4848`); the command line
    /// and the environment win over it.
    #[arg(long, value_name = "FILE", env = "HIGHWATER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Warn (log, and `/health` says `degraded`) when the replication slot keeps more WAL than
    /// this upstream, in bytes.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_WAL_WARN_BYTES, env = "HIGHWATER_WAL_WARN_BYTES")]
    pub(crate) wal_warn_bytes: u64,
    /// Also serve `GET /metrics` (Prometheus text format) on this address, without the
    /// replication token the main port asks for: bind it to an interface only your scraper
    /// reaches (e.g. `127.0.0.1:9464`).
    #[arg(long, value_name = "ADDR", env = "HIGHWATER_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// How often the slot's retained WAL is checked, in ms.
    #[arg(long, default_value_t = DEFAULT_WAL_CHECK_MS, hide = true)]
    pub wal_check_ms: u64,
    /// Store queued upstream transactions in one SQLite commit (group commit), on by default;
    /// `--no-group-commit` stores each in its own commit (for comparing the two).
    #[arg(long = "no-group-commit", hide = true, action = clap::ArgAction::SetFalse)]
    pub group_commit: bool,
    /// Boxed: the security options would make every `highwater` command as large as `serve`.
    #[command(flatten)]
    pub security: Box<SecurityArgs>,
    /// Routes served in front of the server's own, for a program that embeds `serve` (the demo
    /// mounts its page here). A request they do not match falls through to the server's routes.
    #[arg(skip)]
    pub(crate) extra_routes: Option<axum::Router>,
}

/// A scope-sync client may stay this long over its outbound budget.
pub(crate) const DEFAULT_SLOW_CONSUMER_MS: u64 = 10_000;

/// WebSocket connections served at once by default: each costs a task, buffers and a
/// backlog up to its bound, so the total stays within a small server's memory.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// A quiet live scope-sync subscription hears of the feed's position this often by default.
/// The close code sockets get when the server stops on a signal: 1012, service restart.
pub(crate) const SHUTDOWN_CLOSE_CODE: u16 = 1012;
/// The default of `--wal-warn-bytes`: 1 GiB.
pub(crate) const DEFAULT_WAL_WARN_BYTES: u64 = 1 << 30;
/// The default of `--wal-check-ms`.
pub(crate) const DEFAULT_WAL_CHECK_MS: u64 = 30_000;
/// The default of `--shutdown-timeout-secs`.
pub(crate) const DEFAULT_SHUTDOWN_TIMEOUT_SECS: u64 = 30;
pub(crate) const DEFAULT_SYNC_CHECKPOINT_MS: u64 = 30_000;

/// Exits are kept a week by default.
pub(crate) const DEFAULT_SYNC_RETENTION_SECS: u64 = 7 * 24 * 3600;

impl ServeArgs {
    /// Defaults for everything but the upstream and the data directory.
    pub fn new(upstream: impl Into<String>, data: impl Into<PathBuf>) -> Self {
        ServeArgs {
            upstream: upstream.into(),
            from: None,
            data: data.into(),
            port: DEFAULT_PORT,
            host: "127.0.0.1".to_owned(),
            app_id: DEFAULT_APP_ID.to_owned(),
            publications: Vec::new(),
            public_url: None,
            purge_delay_ms: DEFAULT_PURGE_DELAY_MS,
            backup_interval_ms: DEFAULT_BACKUP_INTERVAL_MS,
            backlog_high_water_bytes: DEFAULT_BACKLOG_HIGH_WATER_BYTES,
            backlog_full_timeout_ms: DEFAULT_BACKLOG_FULL_TIMEOUT_MS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            auto_reset: false,
            sync_workers: crate::replication::initial_sync::DEFAULT_SYNC_WORKERS,
            sync_rules: None,
            sync_secret: SyncSecretArgs::default(),
            sync_retention_secs: DEFAULT_SYNC_RETENTION_SECS,
            sync_slow_consumer_ms: DEFAULT_SLOW_CONSUMER_MS,
            sync_checkpoint_ms: DEFAULT_SYNC_CHECKPOINT_MS,
            shutdown_timeout_secs: DEFAULT_SHUTDOWN_TIMEOUT_SECS,
            print_config: false,
            config: None,
            wal_warn_bytes: DEFAULT_WAL_WARN_BYTES,
            wal_check_ms: DEFAULT_WAL_CHECK_MS,
            metrics_addr: None,
            group_commit: true,
            security: Box::default(),
            extra_routes: None,
        }
    }

    /// Defaults for a relay of the Highwater at `from` (`ws://host:port`).
    pub fn relay(from: impl Into<String>, data: impl Into<PathBuf>) -> Self {
        ServeArgs {
            from: Some(from.into()),
            ..ServeArgs::new("", data)
        }
    }

    fn public_url(&self) -> String {
        let scheme = if self.security.tls_cert.is_some() {
            "https"
        } else {
            "http"
        };
        match &self.public_url {
            Some(url) => url.trim_end_matches('/').to_owned(),
            None if self.host == "0.0.0.0" || self.host == "::" => {
                format!("{scheme}://127.0.0.1:{}", self.port)
            }
            None => format!("{scheme}://{}:{}", self.host, self.port),
        }
    }
}

/// Why the server stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error(transparent)]
    ChangeLog(#[from] ChangeLogError),
    #[error(transparent)]
    Replication(#[from] ReplicationError),
    #[error("initial sync failed: {0}")]
    Sync(#[from] SyncError),
    #[error(transparent)]
    Bootstrap(#[from] crate::replication::bootstrap::BootstrapError),
    #[error("upstream query failed: {}", crate::replication::PgErrorText(.0))]
    Postgres(#[from] tokio_postgres::Error),
    #[error("the change source broke the change-stream protocol: {0}")]
    Upstream(#[from] highwater_engine::streamer::UpstreamError),
    #[error("the change source cannot continue: {0}")]
    Session(#[from] highwater_engine::upstream::SessionError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Insecure(#[from] InsecureListen),
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error(transparent)]
    Tls(#[from] tls::TlsFileError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// An fsync of the replica's WAL failed: what it should have made durable may not be, and
    /// a retry could report lost pages synced, so the server stops.
    #[error("syncing the replica's write-ahead log failed: {0}")]
    WalSync(std::io::Error),
    #[error(transparent)]
    DataLock(#[from] DataLockError),
    #[error("relaying failed: {0}")]
    Relay(#[from] RelayError),
    #[error("the replication stream failed: {0}")]
    Source(String),
    #[error("expected {expected}, found {found}")]
    Invariant { expected: String, found: String },
    /// `--sync-rules` names tables or columns the replica does not have.
    #[error("the sync rules do not fit the replicated tables: {0}")]
    RulesDoNotFit(String),
    #[error("a server task failed: {0}")]
    Task(String),
    #[error("the server stopped: {0}")]
    Poisoned(String),
    #[error("scope sync cannot start")]
    SyncConfig(#[from] AuthConfigError),
    #[error(transparent)]
    WriteSetup(#[from] scope_sync::writes::InstallError),
}

/// The scope-sync rules and secret, when `--sync-rules` is given.
fn load_sync(args: &ServeArgs) -> Result<Option<Arc<SyncAuth>>, ServeError> {
    match &args.sync_rules {
        None => Ok(None),
        Some(rules) => Ok(Some(Arc::new(SyncAuth::load(rules, &args.sync_secret)?))),
    }
}

/// Serves until `stop` turns true or replication fails: prepares the replica (initial sync
/// when needed), then runs replication, the storage loop and the endpoints.
pub async fn serve(args: ServeArgs, stop: watch::Receiver<bool>) -> Result<(), ServeError> {
    let sync = load_sync(&args)?;
    let token = preflight(&args).await?;
    // Held until this returns: a second server on the same directory is refused at start.
    let _data_lock = DataDirLock::acquire(&args.data)?;
    if let Some(from) = args.from.clone() {
        return relay::serve(args, from, token, sync, stop).await;
    }
    // A primary with scope sync sets up writes: the `highwater` schema upstream, required when
    // its rules allow writes (it applies them), tried otherwise (for apps whose own backend
    // applies writes with `highwater.confirm`).
    let write_setup = match &sync {
        None => startup::WriteSetup::None,
        Some(auth) if auth.rules().allows_writes() => startup::WriteSetup::Required,
        Some(_) => startup::WriteSetup::Tried,
    };
    let handle = tokio::runtime::Handle::current();
    let prepared = {
        let args = args.clone();
        let handle = handle.clone();
        let stop = stop.clone();
        let prepared = tokio::task::spawn_blocking(move || {
            startup::prepare_retrying(&handle, &args, write_setup, &stop)
        })
        .await
        .map_err(|e| ServeError::Task(e.to_string()))??;
        match prepared {
            Some(prepared) => prepared,
            None => return Ok(()),
        }
    };
    let listener = listen(&args, token.as_ref()).await?;
    let public_url = args.public_url();
    let mut settings = settings(&args, token, sync, args.security.tls_config()?);
    settings.wal_watch = match crate::replication::setup::ReplicationNames::for_app(&args.app_id) {
        Ok(names) => Some(wal_watch::WalWatch {
            upstream: prepared.backfill_from.clone(),
            slot: names.slot,
            warn_bytes: args.wal_warn_bytes,
            every: Duration::from_millis(args.wal_check_ms.max(10)),
        }),
        Err(_) => None,
    };
    if write_setup != startup::WriteSetup::None {
        settings.writes_to = Some(prepared.backfill_from.clone());
    }
    settings.backfill_from = Some(prepared.backfill_from);
    let source = source::spawn_postgres(prepared.stream, stop.clone());
    tracing::info!(
        address = %listener.local_addr()?,
        %public_url,
        max_protocol = MAX_PROTOCOL_VERSION,
        "serving"
    );
    run_server(
        listener,
        prepared.writer,
        prepared.log,
        prepared.publications,
        source,
        settings,
        stop,
    )
    .await
}

/// The replication token this node requires, once the listen address is known to be safe
/// with it: checked before any replication or restore work starts.
async fn preflight(args: &ServeArgs) -> Result<Option<ReplicationToken>, ServeError> {
    let token = args.security.required_token()?;
    // Unusable TLS files stop the server before it replicates anything.
    args.security.tls_config()?;
    let listen = format!("{}:{}", args.host, args.port);
    let addrs = tokio::net::lookup_host(&listen)
        .await
        .map_err(|source| ServeError::Listen {
            addr: listen.clone(),
            source,
        })?;
    for addr in addrs {
        security::check_listener(addr, token.as_ref(), args.security.insecure_no_auth)?;
    }
    Ok(token)
}

/// Binds `--host:--port`, refusing a non-loopback address without a replication token.
async fn listen(
    args: &ServeArgs,
    token: Option<&ReplicationToken>,
) -> Result<TcpListener, ServeError> {
    let listen = format!("{}:{}", args.host, args.port);
    let listener = TcpListener::bind(&listen)
        .await
        .map_err(|source| ServeError::Listen {
            addr: listen.clone(),
            source,
        })?;
    security::check_listener(
        listener.local_addr()?,
        token,
        args.security.insecure_no_auth,
    )?;
    Ok(listener)
}

/// Sets up an accepted socket: `TCP_NODELAY`, so a small frame (a live change, an ack) goes
/// out at once instead of waiting for the peer's delayed ACK of the one before it (Nagle),
/// which added up to 40 ms, and p99s of 21-121 ms, to a socket carrying a steady stream of
/// small frames.
pub(crate) fn accepted(tcp: &tokio::net::TcpStream) {
    if let Err(error) = tcp.set_nodelay(true) {
        tracing::debug!(%error, "cannot set TCP_NODELAY on an accepted socket");
    }
}

/// The plain (no TLS) listener: every accepted socket goes through [`accepted`].
pub(crate) type PlainListener = axum::serve::TapIo<TcpListener, fn(&mut tokio::net::TcpStream)>;

/// [`PlainListener`] over `listener`.
pub(crate) fn plain_listener(listener: TcpListener) -> PlainListener {
    use axum::serve::ListenerExt;
    fn tap(tcp: &mut tokio::net::TcpStream) {
        accepted(tcp);
    }
    listener.tap_io(tap as fn(&mut tokio::net::TcpStream))
}

/// How the server runs, from its arguments and the replication token it requires.
fn settings(
    args: &ServeArgs,
    token: Option<ReplicationToken>,
    sync: Option<Arc<SyncAuth>>,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> Settings {
    Settings {
        sync,
        sync_retention: Duration::from_secs(args.sync_retention_secs),
        sync_slow_consumer_ms: args.sync_slow_consumer_ms,
        sync_checkpoint_ms: args.sync_checkpoint_ms,
        group_commit: args.group_commit,
        data: args.data.clone(),
        public_url: args.public_url(),
        purge_delay: Duration::from_millis(args.purge_delay_ms),
        backup_interval: Duration::from_millis(args.backup_interval_ms.max(1)),
        ping_interval: PING_INTERVAL,
        owner: format!("{}@{}", args.app_id, std::process::id()),
        app_id: args.app_id.clone(),
        backlog_high_water_bytes: args.backlog_high_water_bytes,
        backlog_full_timeout_ms: args.backlog_full_timeout_ms,
        max_connections: args.max_connections,
        backfill_from: None,
        peer_auth: security::PeerAuth {
            token,
            ..Default::default()
        },
        insecure_no_auth: args.security.insecure_no_auth,
        tls,
        extra_routes: args.extra_routes.clone(),
        wal_watch: None,
        metrics_addr: args.metrics_addr,
        writes_to: None,
    }
}

/// How the server runs, once the replica is ready.
#[derive(Debug, Clone)]
struct Settings {
    /// Scope sync's rules and token key; `None`: `/sync` is off.
    sync: Option<Arc<SyncAuth>>,
    sync_retention: Duration,
    sync_slow_consumer_ms: u64,
    sync_checkpoint_ms: u64,
    /// Group commit in the ingest thread (off with `--no-group-commit`).
    group_commit: bool,
    data: PathBuf,
    public_url: String,
    purge_delay: Duration,
    backup_interval: Duration,
    ping_interval: Duration,
    owner: String,
    /// Names the event trigger's DDL messages (`<app>/ddl`).
    app_id: String,
    backlog_high_water_bytes: usize,
    backlog_full_timeout_ms: u64,
    /// Open WebSocket connections served at once.
    max_connections: usize,
    /// Where the replica's pending backfills are read (Postgres); `None` when the change source
    /// streams its own (a relay).
    backfill_from: Option<crate::replication::PgConfig>,
    /// What `/replication/…` and `/replica/snapshot` require.
    peer_auth: security::PeerAuth,
    /// Serving without a token beyond loopback: `/health` says so.
    insecure_no_auth: bool,
    /// `--tls-cert`/`--tls-key`: serve https and wss.
    tls: Option<Arc<rustls::ServerConfig>>,
    /// Routes matched before the server's own ([`ServeArgs::extra_routes`]).
    extra_routes: Option<axum::Router>,
    /// The upstream slot's retained WAL, watched; `None` for a relay (it has no slot).
    wal_watch: Option<wal_watch::WalWatch>,
    /// `--metrics-addr`: `/metrics` alone, without a token, on an address of its own.
    metrics_addr: Option<SocketAddr>,
    /// Where sync clients' writes are applied (a primary whose rules allow writes); `None`:
    /// this node takes none.
    writes_to: Option<crate::replication::PgConfig>,
}

/// Runs the storage loop, the endpoints and the timers over a ready replica and a change
/// source, until `stop` or a failure.
async fn run_server(
    listener: TcpListener,
    mut writer: crate::replica::ReplicaWriter,
    log: crate::change_log::ChangeLogStatus,
    publications: Vec<String>,
    source: source::Source,
    settings: Settings,
    stop: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let handle = tokio::runtime::Handle::current();
    let mut config = StreamerConfig::new(log.replica_version.clone());
    config.backup_url = Some(format!("{}{SNAPSHOT_PATH}", settings.public_url));
    config.purge_delay_ms = u64::try_from(settings.purge_delay.as_millis()).unwrap_or(u64::MAX);
    config.backlog_high_water_bytes = settings.backlog_high_water_bytes;
    config.backlog_full_timeout_ms = Some(settings.backlog_full_timeout_ms);
    let streamer = Streamer::new(
        config,
        ChangeLogState {
            last_watermark: log.last_watermark.clone(),
            min_watermark: log.min_watermark.clone(),
        },
    );
    let (hub, ops) = Hub::new(streamer, Positions::from(&log));
    let session =
        crate::upstream::session(&settings.app_id, log.last_watermark.clone(), source.start);
    let db_path = settings.data.join("replica.db");
    crate::change_log::set_owner(
        writer.replica().connection(),
        &settings.owner,
        &owner_address(&settings.public_url),
    )?;
    let jar = crate::change_log::cookie_jar(writer.replica().connection())?;
    let requests = hub.with(|s| s.start_upstream(jar));
    if !requests.is_empty() {
        tracing::info!(
            tables = requests.len(),
            "pending backfills recorded in the change log"
        );
    }

    // Anything that ends the server ends all of it.
    let (shutdown_tx, shutdown) = watch::channel(false);
    let shutdown_tx = Arc::new(shutdown_tx);
    {
        let shutdown_tx = shutdown_tx.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let _ = stop.wait_for(|s| *s).await;
            shutdown_tx.send_replace(true);
        });
    }

    // A poisoned lock ends the server (and is its error, below).
    {
        let shutdown_tx = shutdown_tx.clone();
        let mut failed = hub.fault().failed();
        tokio::spawn(async move {
            if failed.wait_for(Option::is_some).await.is_ok() {
                shutdown_tx.send_replace(true);
            }
        });
    }

    let sync_hub = match &settings.sync {
        None => None,
        Some(auth) => {
            // Rules naming a table or column the replica lacks would only fail subscribes later,
            // one by one: the server refuses to start instead, naming every miss.
            let replica = writer.replica();
            let problems = auth.rules().schema_problems(|table| {
                replica
                    .table(table)
                    .map(|t| t.columns.iter().map(|c| c.name.clone()).collect())
            });
            if !problems.is_empty() {
                return Err(ServeError::RulesDoNotFit(problems.join("; ")));
            }
            writer.enable_scope_feed(auth.filter_columns().into_iter().collect())?;
            let mut config = ServerConfig::new(log.replica_version.as_str());
            config.slow_consumer_timeout_ms = settings.sync_slow_consumer_ms;
            config.checkpoint_interval_ms = settings.sync_checkpoint_ms;
            let writes = settings.writes_to.clone().map(|upstream| {
                Arc::new(scope_sync::writes::Writes::new(
                    upstream,
                    auth.clone(),
                    db_path.clone(),
                    log.last_watermark.clone(),
                ))
            });
            // Mutations are applied when the rules allow writes; `await-mutations` (writes the
            // app's backend applies) is answered either way.
            config.takes_writes = writes.is_some() && auth.rules().allows_writes();
            let sync_hub = scope_sync::SyncHub::new(
                config,
                auth.clone(),
                db_path.clone(),
                handle.clone(),
                settings.ping_interval,
                hub.fault().clone(),
                writes,
            )?;
            let floor = crate::replica::feed::retention_floor(writer.replica().connection())?;
            sync_hub.set_retention_floor(floor);
            Some(sync_hub)
        }
    };
    let ingest = ingest::ingest(ingest::IngestParts {
        hub: hub.clone(),
        writer,
        db_path: db_path.clone(),
        publications,
        handle: handle.clone(),
        session,
        events: source.events,
        confirm: source.confirm.clone(),
        backfill_from: settings.backfill_from.clone(),
        sync: sync_hub
            .clone()
            .map(|hub| ingest::SyncFeed::new(hub, settings.sync_retention)),
        group: if settings.group_commit {
            GroupLimits::default()
        } else {
            GroupLimits::off()
        },
        ops,
    });
    let ingest_task = {
        let shutdown_tx = shutdown_tx.clone();
        let shutdown = shutdown.clone();
        tokio::task::spawn_blocking(move || {
            let result = ingest::run(ingest, shutdown);
            shutdown_tx.send_replace(true);
            result
        })
    };

    let wal_health = settings.wal_watch.clone().map(|watch| {
        let health = Arc::new(wal_watch::WalHealth::default());
        tokio::spawn(wal_watch::run(watch, health.clone(), shutdown.clone()));
        health
    });

    let ticker = tokio::spawn(tick(
        hub.clone(),
        sync_hub.clone(),
        db_path.clone(),
        settings.backup_interval,
        shutdown.clone(),
    ));

    let snapshots = Arc::new(snapshot::Snapshots::new(
        db_path.clone(),
        settings.data.join("snapshots"),
    ));
    let registry = Arc::new(metrics::registry(metrics::Sources {
        hub: hub.clone(),
        sync: sync_hub.clone(),
        snapshots: snapshots.clone(),
        wal: wal_health.clone(),
        peer_refusals: settings.peer_auth.refusals.clone(),
        db_path,
        started_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
    }));
    let metrics_server = match settings.metrics_addr {
        Some(addr) => {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Listen {
                    addr: addr.to_string(),
                    source,
                })?;
            tracing::info!(%addr, "serving /metrics");
            let mut shutdown = shutdown.clone();
            let router = endpoints::metrics_router(registry.clone());
            Some(tokio::spawn(async move {
                axum::serve(listener, router)
                    .with_graceful_shutdown(async move {
                        let _ = shutdown.wait_for(|s| *s).await;
                    })
                    .await
            }))
        }
        None => None,
    };
    let state = endpoints::AppState {
        hub: hub.clone(),
        snapshots,
        ping_interval: settings.ping_interval,
        connection_slots: endpoints::ConnectionSlots::new(settings.max_connections),
        sync: sync_hub.clone(),
        peer_auth: settings.peer_auth.clone(),
        insecure_no_auth: settings.insecure_no_auth && settings.peer_auth.token.is_none(),
        wal: wal_health,
        metrics: registry,
    };
    snapshot::clear_dir(&settings.data.join("snapshots"))?;
    let app = match settings.extra_routes {
        Some(extra) => extra.fallback_service(endpoints::router(state)),
        None => endpoints::router(state),
    };
    let stopping = {
        let hub = hub.clone();
        let sync_hub = sync_hub.clone();
        let mut shutdown = shutdown.clone();
        async move {
            let _ = shutdown.wait_for(|s| *s).await;
            // 1012 (service restart): a client reconnects, to this server once it is back
            // or to another serving node.
            hub.close_all(SHUTDOWN_CLOSE_CODE, "server restarting");
            if let Some(sync_hub) = &sync_hub {
                sync_hub.close_all(SHUTDOWN_CLOSE_CODE, "server restarting");
                sync_hub.until_closed(Duration::from_secs(3)).await;
            }
        }
    };
    let served = match &settings.tls {
        Some(config) => {
            let listener = tls::TlsListener::new(listener, config.clone())?;
            axum::serve(listener, app.into_make_service())
                .with_graceful_shutdown(stopping)
                .await
        }
        None => {
            axum::serve(
                plain_listener(listener),
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(stopping)
            .await
        }
    };
    shutdown_tx.send_replace(true);
    let _ = ticker.await;
    if let Some(metrics_server) = metrics_server {
        let _ = metrics_server.await;
    }
    let ingested = ingest_task
        .await
        .map_err(|e| ServeError::Task(e.to_string()))?;
    let sourced = match source.task {
        Some(task) => task.await.map_err(|e| ServeError::Task(e.to_string())),
        None => Ok(()),
    };
    if let Some(failure) = hub.fault().failure() {
        return Err(ServeError::Poisoned(failure));
    }
    ingested?;
    sourced?;
    served?;
    tracing::info!("server stopped");
    Ok(())
}

/// The change-stream address other servers discover (`ownerAddress`): `host:port` for plain
/// WebSockets, `wss://host:port` for TLS, as Zero writes it.
fn owner_address(public_url: &str) -> String {
    if let Some(rest) = public_url.strip_prefix("https://") {
        format!("wss://{rest}")
    } else {
        public_url
            .strip_prefix("http://")
            .unwrap_or(public_url)
            .to_owned()
    }
}

/// Timers: the streamer's tick, and the replica's durable position as a backup watermark (the
/// replica is the backup: `/replica/snapshot` serves it at its current position).
async fn tick(
    hub: Arc<Hub>,
    sync_hub: Option<Arc<scope_sync::SyncHub>>,
    replica_path: PathBuf,
    backup_interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let period = backup_interval.min(Duration::from_secs(1));
    let mut timer = tokio::time::interval(period);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_backup: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = timer.tick() => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let due = last_backup.is_none_or(|at| at.elapsed() >= backup_interval);
        if due {
            last_backup = Some(tokio::time::Instant::now());
            let watermark = hub.positions().last_watermark;
            let replica_size = std::fs::metadata(&replica_path).ok().map(|m| m.len());
            hub.call(|s, now| {
                s.backup_watermark(
                    BackupWatermark {
                        watermark,
                        replica_size,
                    },
                    now,
                )
            });
        }
        hub.call(|s, now| s.tick(now));
        if let Some(sync_hub) = &sync_hub {
            sync_hub.tick();
        }
    }
}

#[cfg(test)]
mod tests;
