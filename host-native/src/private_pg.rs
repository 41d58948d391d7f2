//! A private Postgres server for tests, benchmarks and `highwater demo`: a fresh data directory
//! under the temp dir, the newest binaries in `/usr/lib/postgresql/*/bin`, a free port on
//! 127.0.0.1, logical replication enabled. It is stopped and removed on drop.
//!
//! Postgres refuses to run as root, so as root the tools run as the `postgres` OS user
//! (`runuser -u postgres --`) in a directory owned by that user. `scripts/pg-start` does the same
//! from bash.

use std::fmt::Write as _;
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command as StdCommand, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::process::Command;

/// Where Debian installs Postgres, one directory per major version.
const INSTALL_ROOT: &str = "/usr/lib/postgresql";
/// Overrides the binaries directory (a directory holding `initdb` and `pg_ctl`).
const BIN_DIR_ENV: &str = "HIGHWATER_PG_BIN";
const OS_USER: &str = "postgres";
const PORT_ATTEMPTS: usize = 5;

/// Settings every private server gets; they make logical replication work and tests fast.
const BASE_SETTINGS: &[(&str, &str)] = &[
    ("listen_addresses", "127.0.0.1"),
    ("wal_level", "logical"),
    ("max_wal_senders", "10"),
    ("max_replication_slots", "10"),
    ("fsync", "off"),
    ("full_page_writes", "off"),
];

#[derive(Debug, thiserror::Error)]
pub enum PrivatePgError {
    #[error(
        "No Postgres binaries found: expected {INSTALL_ROOT}/<version>/bin/pg_ctl (apt-get install \
         postgresql) or a directory in ${BIN_DIR_ENV}"
    )]
    BinariesMissing,

    #[error("Could not {action}: {source}")]
    Io {
        action: String,
        #[source]
        source: std::io::Error,
    },

    #[error("`{command}` failed ({status}): {output}")]
    Command {
        command: String,
        status: String,
        output: String,
    },
}

fn io_error(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> PrivatePgError {
    let action = action.into();
    move |source| PrivatePgError::Io { action, source }
}

/// Extra configuration for a private server.
#[derive(Debug, Clone, Default)]
pub struct PgOptions {
    /// Lines put at the top of `pg_hba.conf`, ahead of initdb's `trust` lines (first match
    /// wins), e.g. `host all scram_user 127.0.0.1/32 scram-sha-256`.
    pub hba_lines: Vec<String>,
    /// Extra `postgresql.conf` settings, applied after the defaults (later ones win).
    pub settings: Vec<(String, String)>,
}

/// A running (or stopped, until dropped) private Postgres server.
#[derive(Debug)]
pub struct PrivatePg {
    bin_dir: PathBuf,
    base_dir: PathBuf,
    port: u16,
    as_postgres_user: bool,
    running: bool,
}

impl PrivatePg {
    /// Initialises a fresh cluster and starts it on a free port; returns once it accepts
    /// connections.
    pub async fn start(options: PgOptions) -> Result<PrivatePg, PrivatePgError> {
        let bin_dir = newest_bin_dir()?;
        let as_postgres_user = running_as_root();
        let base_dir = unique_base_dir();
        tokio::fs::create_dir_all(&base_dir)
            .await
            .map_err(io_error(format!("create {}", base_dir.display())))?;
        // From here on, Drop removes the directory whatever fails.
        let mut pg = PrivatePg {
            bin_dir,
            base_dir,
            port: 0,
            as_postgres_user,
            running: false,
        };
        if as_postgres_user {
            let mut chown = Command::new("chown");
            chown.arg(format!("{OS_USER}:{OS_USER}")).arg(&pg.base_dir);
            run(chown).await?;
        }
        let mut initdb = pg.tool("initdb");
        initdb
            .arg("-D")
            .arg(pg.data_dir())
            .args(["--auth=trust", "--username=postgres", "--encoding=UTF8"])
            .args(["--locale=C", "--no-sync"]);
        run(initdb).await?;
        pg.configure(&options).await?;
        pg.start_on_free_port().await?;
        Ok(pg)
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres` (trust auth).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A URL for `user` with `password` to database `postgres`.
    pub fn url_for(&self, user: &str, password: &str) -> String {
        format!(
            "postgres://{}:{}@127.0.0.1:{}/postgres",
            percent_encode(user),
            percent_encode(password),
            self.port
        )
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn data_dir(&self) -> PathBuf {
        self.base_dir.join("data")
    }

    fn log_file(&self) -> PathBuf {
        self.base_dir.join("postgres.log")
    }

    /// An ordinary client as the superuser; its connection task runs on the current runtime.
    pub async fn connect(&self) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        let (client, connection) =
            tokio_postgres::connect(&self.url(), tokio_postgres::NoTls).await?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "private postgres connection ended");
            }
        });
        Ok(client)
    }

    /// Stops the server (fast shutdown: sessions are disconnected, a clean checkpoint is made).
    pub async fn stop_server(&mut self) -> Result<(), PrivatePgError> {
        self.stop_with("fast").await
    }

    /// Stops the server as a crash would (`pg_ctl stop -m immediate`: every process exits at
    /// once, no shutdown checkpoint; the next start recovers from the WAL).
    pub async fn crash_server(&mut self) -> Result<(), PrivatePgError> {
        self.stop_with("immediate").await
    }

    async fn stop_with(&mut self, mode: &str) -> Result<(), PrivatePgError> {
        if self.running {
            let mut stop = self.tool("pg_ctl");
            stop.arg("-D")
                .arg(self.data_dir())
                .args(["-m", mode, "-w", "-t", "60", "stop"]);
            run(stop).await?;
            self.running = false;
        }
        Ok(())
    }

    /// Starts the stopped server again, same data and port.
    pub async fn start_server(&mut self) -> Result<(), PrivatePgError> {
        if !self.running {
            run(self.pg_ctl_start()).await?;
            self.running = true;
        }
        Ok(())
    }

    /// Stop, then start on the same port and data directory.
    pub async fn restart(&mut self) -> Result<(), PrivatePgError> {
        self.stop_server().await?;
        self.start_server().await
    }

    fn tool(&self, name: &str) -> Command {
        Command::from(self.std_tool(name))
    }

    fn std_tool(&self, name: &str) -> StdCommand {
        let path = self.bin_dir.join(name);
        let mut command = if self.as_postgres_user {
            let mut c = StdCommand::new("runuser");
            c.args(["-u", OS_USER, "--"]).arg(path);
            c
        } else {
            StdCommand::new(path)
        };
        // The caller's working directory may be closed to the postgres user.
        command.current_dir(&self.base_dir);
        command
    }

    fn pg_ctl_start(&self) -> Command {
        let mut start = self.tool("pg_ctl");
        start
            .arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.log_file())
            .args(["-w", "-t", "60", "start"]);
        start
    }

    async fn configure(&self, options: &PgOptions) -> Result<(), PrivatePgError> {
        let socket_dir = self.base_dir.display().to_string();
        let mut conf = String::from("\n# private server\n");
        let settings = BASE_SETTINGS
            .iter()
            .map(|&(k, v)| (k, v))
            .chain([("unix_socket_directories", socket_dir.as_str())])
            .chain(
                options
                    .settings
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str())),
            );
        for (name, value) in settings {
            let _ = writeln!(conf, "{name} = '{}'", value.replace('\'', "''"));
        }
        append(&self.data_dir().join("postgresql.conf"), &conf).await?;

        if !options.hba_lines.is_empty() {
            let hba_path = self.data_dir().join("pg_hba.conf");
            let existing = tokio::fs::read_to_string(&hba_path)
                .await
                .map_err(io_error("read pg_hba.conf"))?;
            let mut hba = options.hba_lines.join("\n");
            hba.push('\n');
            hba.push_str(&existing);
            tokio::fs::write(&hba_path, hba)
                .await
                .map_err(io_error("write pg_hba.conf"))?;
        }
        Ok(())
    }

    /// Picks a port by binding port 0, and tries another if someone takes it in between.
    async fn start_on_free_port(&mut self) -> Result<(), PrivatePgError> {
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            self.port = free_port()?;
            // Later lines win, so a retry simply appends the next port.
            append(
                &self.data_dir().join("postgresql.conf"),
                &format!("port = {}\n", self.port),
            )
            .await?;
            match run(self.pg_ctl_start()).await {
                Ok(_) => {
                    self.running = true;
                    return Ok(());
                }
                Err(error) => {
                    let log = tokio::fs::read_to_string(self.log_file())
                        .await
                        .unwrap_or_default();
                    if !log.contains("could not bind") && !log.contains("already in use") {
                        return Err(with_log(error, &log));
                    }
                    last_error = Some(with_log(error, &log));
                }
            }
        }
        Err(last_error.unwrap_or(PrivatePgError::BinariesMissing))
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        if self.running {
            // Blocking on purpose: the server must be gone before its directory is removed.
            let mut stop = self.std_tool("pg_ctl");
            stop.arg("-D")
                .arg(self.data_dir())
                .args(["-m", "immediate", "-w", "-t", "60", "stop"]);
            match stop.output() {
                Ok(out) if out.status.success() => {}
                Ok(out) => tracing::warn!(
                    "could not stop private postgres: {}",
                    String::from_utf8_lossy(&out.stderr)
                ),
                Err(error) => tracing::warn!(%error, "could not run pg_ctl stop"),
            }
        }
        if let Err(error) = std::fs::remove_dir_all(&self.base_dir) {
            let dir = self.base_dir.display();
            tracing::warn!(%error, %dir, "could not remove private postgres directory");
        }
    }
}

/// The `bin` directory of the newest installed major version (or `$HIGHWATER_PG_BIN`).
pub fn newest_bin_dir() -> Result<PathBuf, PrivatePgError> {
    if let Some(dir) = std::env::var_os(BIN_DIR_ENV) {
        let dir = PathBuf::from(dir);
        return if dir.join("pg_ctl").exists() {
            Ok(dir)
        } else {
            Err(PrivatePgError::BinariesMissing)
        };
    }
    let entries = std::fs::read_dir(INSTALL_ROOT).map_err(|_| PrivatePgError::BinariesMissing)?;
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let version = version_key(&entry.file_name().to_string_lossy())?;
            let bin = entry.path().join("bin");
            bin.join("pg_ctl").exists().then_some((version, bin))
        })
        .max()
        .map(|(_, bin)| bin)
        .ok_or(PrivatePgError::BinariesMissing)
}

/// `15` → (15, 0); `9.6` → (9, 6); anything else is not a version directory.
fn version_key(name: &str) -> Option<(u32, u32)> {
    let mut parts = name.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = match parts.next() {
        Some(minor) => minor.parse().ok()?,
        None => 0,
    };
    parts.next().is_none().then_some((major, minor))
}

fn running_as_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn unique_base_dir() -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // Short on purpose: the socket path must fit in 107 bytes.
    std::env::temp_dir().join(format!("highwater-pg-{}-{nanos:x}-{n}", std::process::id()))
}

fn free_port() -> Result<u16, PrivatePgError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io_error("find a free port"))?;
    let port = listener
        .local_addr()
        .map_err(io_error("find a free port"))?
        .port();
    Ok(port)
}

async fn append(path: &Path, text: &str) -> Result<(), PrivatePgError> {
    use tokio::io::AsyncWriteExt;
    let mut file = tokio::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .await
        .map_err(io_error(format!("open {}", path.display())))?;
    file.write_all(text.as_bytes())
        .await
        .map_err(io_error(format!("write {}", path.display())))
}

async fn run(mut command: Command) -> Result<Output, PrivatePgError> {
    let description = format!("{:?}", command.as_std());
    let output = command
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(io_error(format!("run {description}")))?;
    if output.status.success() {
        return Ok(output);
    }
    Err(PrivatePgError::Command {
        command: description,
        status: output.status.to_string(),
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
        .trim()
        .to_owned(),
    })
}

fn with_log(error: PrivatePgError, log: &str) -> PrivatePgError {
    match error {
        PrivatePgError::Command {
            command,
            status,
            output,
        } => {
            let tail: Vec<&str> = log.lines().rev().take(10).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            PrivatePgError::Command {
                command,
                status,
                output: format!("{output}\nserver log:\n{}", tail.join("\n")),
            }
        }
        other => other,
    }
}

fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_directories_order_numerically() {
        let mut versions: Vec<_> = ["9.6", "15", "10", "16"]
            .iter()
            .filter_map(|v| version_key(v))
            .collect();
        versions.sort();
        assert_eq!(versions.last(), Some(&(16, 0)));
        assert_eq!(versions.first(), Some(&(9, 6)));
        assert_eq!(version_key("common"), None);
        assert_eq!(version_key("15.1.2"), None);
    }

    #[test]
    fn url_credentials_are_percent_encoded() {
        assert_eq!(percent_encode("p@ss:w/rd"), "p%40ss%3Aw%2Frd");
        assert_eq!(percent_encode("plain_user-1"), "plain_user-1");
    }

    #[test]
    fn base_dirs_are_unique_and_short_enough_for_a_socket_path() {
        let a = unique_base_dir();
        let b = unique_base_dir();
        assert_ne!(a, b);
        let socket = a.join(".s.PGSQL.65535");
        assert!(socket.as_os_str().len() < 100, "{}", socket.display());
    }
}
