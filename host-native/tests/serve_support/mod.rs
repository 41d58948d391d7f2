//! Shared pieces of the `highwater serve` integration tests: a private Postgres, the server
//! (in-process or the real binary), and a change-stream subscriber that checks every frame with
//! the engine's decoder and applies the stream to an in-memory copy of the `items` table.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use highwater_engine::change_stream::{
    decode_downstream_frame, decode_envelope, Change, DownstreamMessage, Frame, StreamError,
};
use highwater_engine::watermark::Watermark;
use highwater_host::serve::{serve, ServeArgs, ServeError};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// How long anything may take on a local server.
pub const PROMPT: Duration = Duration::from_secs(20);

pub const ITEMS_DDL: &str = "CREATE TABLE items (id int8 PRIMARY KEY, v text)";

pub use crate::scratch_support::{start_pg, DataDir};

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

pub fn serve_args(url: &str, data: &Path, port: u16) -> ServeArgs {
    let mut args = ServeArgs::new(url, data);
    args.port = port;
    args.host = "127.0.0.1".to_owned();
    args
}

/// `highwater serve` running in this process.
pub struct InProcess {
    pub addr: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl InProcess {
    pub async fn start(args: ServeArgs) -> InProcess {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
            )
            .with_test_writer()
            .try_init();
        let addr: SocketAddr = format!("127.0.0.1:{}", args.port).parse().expect("addr");
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(serve(args, stop_rx));
        wait_ready(addr).await;
        InProcess { addr, stop, task }
    }

    pub async fn stop(self) {
        let _ = self.stop.send(true);
        tokio::time::timeout(PROMPT, self.task)
            .await
            .expect("stops in time")
            .expect("server task")
            .expect("clean stop");
    }
}

/// The `highwater serve` binary.
pub struct Binary {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Binary {
    pub async fn start(url: &str, data: &Path, port: u16) -> Binary {
        Binary::start_with_env(url, data, port, &[]).await
    }

    /// [`Binary::start`] with more environment variables.
    pub async fn start_with_env(url: &str, data: &Path, port: u16, env: &[(&str, &str)]) -> Binary {
        Binary::start_with(url, data, port, &[], env).await
    }

    /// [`Binary::start`] with more `serve` arguments and environment variables.
    pub async fn start_with(
        url: &str,
        data: &Path,
        port: u16,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Binary {
        let child = Command::new(env!("CARGO_BIN_EXE_highwater"))
            .arg("serve")
            .args(["--upstream", url])
            .arg("--data")
            .arg(data)
            .args(["--port", &port.to_string(), "--host", "127.0.0.1"])
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn highwater serve");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let binary = Binary { child, addr };
        wait_ready(addr).await;
        binary
    }

    /// `kill -9`: no chance to clean up anything.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then the exit status.
    pub async fn terminate(self) -> std::process::ExitStatus {
        self.terminate_times(1).await
    }

    /// Sends SIGTERM `times` times back to back (one stop delivered twice, as a process group
    /// and a launcher that forwards signals both do), then waits for the exit.
    pub async fn terminate_times(mut self, times: usize) -> std::process::ExitStatus {
        for _ in 0..times {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(self.child.id().to_string())
                .status();
        }
        let deadline = tokio::time::Instant::now() + PROMPT;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "highwater serve did not stop on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `GET` over HTTP/1.1: status line, headers (lower-case names), body.
pub async fn http_get(
    addr: SocketAddr,
    path: &str,
) -> std::io::Result<(String, Vec<(String, String)>, Vec<u8>)> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no end of headers"))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines.next().unwrap_or_default().to_owned();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok((status, headers, raw[split + 4..].to_vec()))
}

/// `GET /health` as JSON, once the server answers.
pub async fn health(addr: SocketAddr) -> Value {
    let (status, _, body) = http_get(addr, "/health").await.expect("health request");
    assert!(status.contains("200"), "{status}");
    serde_json::from_slice(&body).expect("health JSON")
}

/// Waits until `/health` answers (the initial sync is done and the port is open).
pub async fn wait_ready(addr: SocketAddr) {
    let deadline = tokio::time::Instant::now() + PROMPT;
    loop {
        if let Ok((status, _, _)) = http_get(addr, "/health").await {
            if status.contains("200") {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server at {addr} did not become ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn replica_version(addr: SocketAddr) -> Watermark {
    let health = health(addr).await;
    Watermark::parse(health["replicaVersion"].as_str().expect("replicaVersion")).expect("watermark")
}

/// `items` as Postgres has it: id → `{"id","v"}`.
pub async fn pg_items(client: &tokio_postgres::Client) -> BTreeMap<i64, Value> {
    client
        .query("SELECT id, v FROM items ORDER BY id", &[])
        .await
        .expect("select items")
        .iter()
        .map(|r| {
            let id: i64 = r.get(0);
            let v: Option<String> = r.get(1);
            (id, serde_json::json!({"id": id, "v": v}))
        })
        .collect()
}

/// `items` rebuilt from a change stream, one transaction at a time.
#[derive(Debug, Default)]
pub struct Model {
    pub rows: BTreeMap<i64, Value>,
    /// The open transaction's changes.
    pending: Option<Vec<Change>>,
    /// Every commit applied, in order.
    pub commits: Vec<Watermark>,
    pub rollbacks: usize,
    pub statuses: usize,
    /// Tags of the schema changes applied, in order.
    pub schema_changes: Vec<String>,
}

fn id_of(row: &serde_json::Map<String, Value>) -> i64 {
    row.get("id")
        .and_then(Value::as_i64)
        .expect("an integer id")
}

impl Model {
    /// The watermark a subscription resumes from: the last commit applied.
    pub fn watermark(&self) -> Option<&Watermark> {
        self.commits.last()
    }

    pub fn apply(&mut self, message: DownstreamMessage) {
        match message {
            DownstreamMessage::Status(_) => self.statuses += 1,
            DownstreamMessage::Begin(begin) => {
                assert!(self.pending.is_none(), "begin inside a transaction");
                if let Some(last) = self.commits.last() {
                    assert!(
                        begin.commit_watermark > *last,
                        "transaction {} after {last}: not strictly increasing",
                        begin.commit_watermark
                    );
                }
                self.pending = Some(Vec::new());
            }
            DownstreamMessage::Data(change) => self
                .pending
                .as_mut()
                .expect("data inside a transaction")
                .push(change),
            DownstreamMessage::Commit(commit) => {
                let changes = self.pending.take().expect("commit of an open transaction");
                for change in changes {
                    self.change(change);
                }
                self.commits.push(commit.watermark);
            }
            DownstreamMessage::Rollback(_) => {
                self.pending = None;
                self.rollbacks += 1;
            }
            DownstreamMessage::Error(error) => panic!("unexpected stream error {error:?}"),
            DownstreamMessage::Reserved(_) => {}
        }
    }

    /// The connection dropped: a transaction received in part is discarded, as a replicator
    /// rolls back its open transaction.
    pub fn disconnected(&mut self) {
        if self.pending.take().is_some() {
            self.rollbacks += 1;
        }
    }

    fn change(&mut self, change: Change) {
        match change {
            Change::Insert(insert) if insert.relation.name == "items" => {
                self.rows
                    .insert(id_of(&insert.new), Value::Object(insert.new));
            }
            Change::Update(update) if update.relation.name == "items" => {
                if let Some(key) = &update.key {
                    self.rows.remove(&id_of(key));
                }
                self.rows
                    .insert(id_of(&update.new), Value::Object(update.new));
            }
            Change::Delete(delete) if delete.relation.name == "items" => {
                self.rows.remove(&id_of(&delete.key));
            }
            Change::Truncate(_) => self.rows.clear(),
            change if !change.is_row_change() => self.schema_changes.push(change.tag().to_owned()),
            _ => {}
        }
    }
}

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// How [`Subscriber::follow_until`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Followed {
    Done,
    Closed,
    TimedOut,
}

/// What the server did next.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Received {
    Frame(Frame<DownstreamMessage>),
    Closed(Option<(CloseCode, String)>),
}

/// A change-stream client. Every text frame must decode with the engine's decoders, the frame
/// decoder and the captured-line decoder `highwater check-stream` uses.
pub struct Subscriber {
    socket: Socket,
    pub model: Model,
}

pub fn changes_path(version: u32, replica_version: &Watermark, watermark: &Watermark) -> String {
    format!(
        "/replication/v{version}/changes?id=it&taskID=it&replicaVersion={replica_version}&watermark={watermark}"
    )
}

impl Subscriber {
    pub async fn connect(addr: SocketAddr, path: &str) -> Subscriber {
        Subscriber::try_connect(addr, path)
            .await
            .expect("websocket handshake")
    }

    pub async fn try_connect(
        addr: SocketAddr,
        path: &str,
    ) -> Result<Subscriber, tokio_tungstenite::tungstenite::Error> {
        let url = format!("ws://{addr}{path}");
        let (socket, _) = tokio::time::timeout(PROMPT, tokio_tungstenite::connect_async(url))
            .await
            .map_err(|_| tokio_tungstenite::tungstenite::Error::ConnectionClosed)??;
        Ok(Subscriber {
            socket,
            model: Model::default(),
        })
    }

    /// The next frame or the close, within `wait`.
    pub async fn next_within(&mut self, wait: Duration) -> Option<Received> {
        loop {
            let message = tokio::time::timeout(wait, self.socket.next()).await.ok()?;
            return Some(match message {
                Some(Ok(Message::Text(text))) => {
                    decode_envelope(text.as_str())
                        .unwrap_or_else(|e| panic!("check-stream rejects frame {text}: {e}"));
                    let frame = decode_downstream_frame(text.as_str())
                        .unwrap_or_else(|e| panic!("invalid frame {text}: {e}"));
                    Received::Frame(frame)
                }
                Some(Ok(Message::Close(frame))) => {
                    Received::Closed(frame.map(|f| (f.code, f.reason.to_string())))
                }
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => Received::Closed(None),
            });
        }
    }

    pub async fn next(&mut self) -> Received {
        self.next_within(PROMPT)
            .await
            .expect("a frame or a close in time")
    }

    pub async fn frame(&mut self) -> Frame<DownstreamMessage> {
        match self.next().await {
            Received::Frame(frame) => frame,
            Received::Closed(close) => panic!("expected a frame, the server closed: {close:?}"),
        }
    }

    /// The close frame, skipping frames before it.
    pub async fn closed(&mut self) -> Option<(CloseCode, String)> {
        loop {
            if let Received::Closed(close) = self.next().await {
                return close;
            }
        }
    }

    pub async fn send(&mut self, text: &str) {
        self.socket
            .send(Message::text(text.to_owned()))
            .await
            .expect("send");
    }

    pub async fn ack(&mut self, id: u64) {
        self.send(&format!(r#"{{"ack":{id}}}"#)).await;
    }

    /// Acks `id`, reporting a dead socket instead of panicking (the server may have just died).
    pub async fn try_ack(&mut self, id: u64) -> Result<(), tokio_tungstenite::tungstenite::Error> {
        self.socket
            .send(Message::text(format!(r#"{{"ack":{id}}}"#)))
            .await
    }

    /// The first frame carries only an `error`: returns it after acking it.
    pub async fn error(&mut self) -> StreamError {
        let frame = self.frame().await;
        let id = frame.id().expect("an application frame");
        let [DownstreamMessage::Error(error)] = frame.messages() else {
            panic!("expected an error, got {frame:?}");
        };
        let error = error.clone();
        self.ack(id).await;
        error
    }

    /// Applies frames (acking each once applied) until `done(model)`, the deadline, or the
    /// socket closes. Returns whether `done` was reached.
    pub async fn follow(
        &mut self,
        deadline: tokio::time::Instant,
        done: impl FnMut(&Model) -> bool,
    ) -> bool {
        self.follow_until(deadline, done).await == Followed::Done
    }

    /// [`Subscriber::follow`], saying how it ended.
    pub async fn follow_until(
        &mut self,
        deadline: tokio::time::Instant,
        mut done: impl FnMut(&Model) -> bool,
    ) -> Followed {
        loop {
            if done(&self.model) {
                return Followed::Done;
            }
            let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
            match self.next_within(wait).await {
                None => return Followed::TimedOut,
                Some(Received::Closed(_)) => return Followed::Closed,
                Some(Received::Frame(Frame::Ack { .. })) => {}
                Some(Received::Frame(frame)) => {
                    let id = frame.id();
                    for message in frame.into_messages() {
                        self.model.apply(message);
                    }
                    if let Some(id) = id {
                        if self.try_ack(id).await.is_err() {
                            return Followed::Closed;
                        }
                    }
                }
            }
        }
    }

    pub async fn close(mut self) -> Model {
        let _ = self.socket.close(None).await;
        self.model
    }
}
