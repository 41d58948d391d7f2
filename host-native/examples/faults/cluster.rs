//! The real processes of a run: `highwater serve` (the primary) and `highwater serve --from`
//! (the relay), started from the built binary with their own data directories, stopped only
//! by the pids this run started.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One `highwater serve` process, restartable on the same data directory and port.
pub struct Server {
    pub name: &'static str,
    pub addr: SocketAddr,
    binary: PathBuf,
    args: Vec<OsString>,
    log: PathBuf,
    child: Option<Child>,
    /// Whether the running process answered `/health` since it was started.
    serving: bool,
    /// Exits this run did not cause, after the process had started serving.
    pub unexpected_exits: Vec<String>,
    /// Exits this run did not cause while the process was still starting (an error such as a
    /// lost Postgres connection during startup ends it; a supervisor starts it again).
    pub startup_exits: Vec<String>,
}

impl Server {
    pub fn new(
        name: &'static str,
        binary: &Path,
        port: u16,
        args: Vec<OsString>,
        log: PathBuf,
    ) -> Server {
        Server {
            name,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            binary: binary.to_owned(),
            args,
            log,
            child: None,
            serving: false,
            unexpected_exits: Vec::new(),
            startup_exits: Vec::new(),
        }
    }

    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Starts the process; its stderr and stdout go to its log file.
    pub fn spawn(&mut self) -> anyhow::Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open {}", self.log.display()))?;
        let child = Command::new(&self.binary)
            .arg("serve")
            .args(&self.args)
            .args([
                "--port",
                &self.addr.port().to_string(),
                "--host",
                "127.0.0.1",
            ])
            .env("RUST_LOG", "warn")
            // Plain log files (tracing colours stderr unless told not to).
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()
            .with_context(|| format!("start {} ({})", self.name, self.binary.display()))?;
        self.child = Some(child);
        self.serving = false;
        Ok(())
    }

    /// Notes whether a process still starting answers `/health` now.
    pub async fn poll_serving(&mut self) {
        if self.child.is_some() && !self.serving && health(self.addr).await.is_ok() {
            self.serving = true;
        }
    }

    /// `kill -9` of the process this run started; returns whether one was running.
    pub fn kill9(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return false;
        };
        // Child::kill sends SIGKILL: no chance to flush or close anything.
        let _ = child.kill();
        let _ = child.wait();
        true
    }

    /// Reaps a process that exited without being killed, recording how it ended.
    pub fn reap(&mut self) -> Option<String> {
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => {
                self.child = None;
                let text = if self.serving {
                    let text = format!("{} exited on its own ({status})", self.name);
                    self.unexpected_exits.push(text.clone());
                    text
                } else {
                    let text = format!("{} exited while starting ({status})", self.name);
                    self.startup_exits.push(text.clone());
                    text
                };
                Some(text)
            }
            _ => None,
        }
    }

    /// Waits until `/health` answers 200, the process stays up, within `limit`.
    pub async fn wait_ready(&mut self, limit: Duration) -> anyhow::Result<Value> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if let Some(exit) = self.reap() {
                bail!("{exit} while starting; see {}", self.log.display());
            }
            if let Ok(health) = health(self.addr).await {
                self.serving = true;
                return Ok(health);
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "{} did not answer /health within {limit:?}; see {}",
                    self.name,
                    self.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// `GET /health` as JSON.
pub async fn health(addr: SocketAddr) -> anyhow::Result<Value> {
    let request = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: faults\r\nConnection: close\r\n\r\n")
            .await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(5), request).await??;
    let text = String::from_utf8_lossy(&raw);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!(
            "expected an HTTP answer from /health, got {} bytes",
            raw.len()
        );
    };
    if !head.starts_with("HTTP/1.1 200") {
        bail!(
            "expected 200 from /health, got {}",
            head.lines().next().unwrap_or("")
        );
    }
    Ok(serde_json::from_str(body)?)
}

/// Writes a file only its owner may read (tokens, secrets).
pub fn write_secret(path: &Path, contents: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file: File = OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    file.write_all(contents.as_bytes())?;
    Ok(())
}

/// The last `lines` lines of a log file.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
