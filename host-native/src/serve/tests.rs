//! Serve end to end with a scripted change source instead of Postgres — frames as a primary
//! sends them to a relay, one message each: real SQLite, real WebSockets, the engine's decoder
//! on every frame and its upstream session deciding every acknowledgement.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use highwater_engine::change_stream::{
    decode_downstream, decode_downstream_frame, DownstreamMessage, ErrorKind, Frame,
};
use highwater_engine::watermark::{Lsn, Watermark};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::source::{Confirm, PrimaryFeedback, Source, SourceEvent};
use super::{run_server, ServeError, Settings};
use crate::change_log::{self, ChangeLogConfig};
use crate::replica::{Replica, ReplicaState, ReplicaWriter};

const PROMPT: Duration = Duration::from_secs(10);

fn w(n: u64) -> Watermark {
    Lsn(n).to_watermark()
}

/// The replica version of every harness.
const VERSION: u64 = 0x100;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "highwater-serve-{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Limits a harness runs with.
struct Tuning {
    max_connections: usize,
    backlog_high_water_bytes: usize,
    /// Serve https and wss with this.
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            max_connections: super::DEFAULT_MAX_CONNECTIONS,
            backlog_high_water_bytes: highwater_engine::streamer::DEFAULT_BACKLOG_HIGH_WATER_BYTES,
            tls: None,
        }
    }
}

/// A server over a replica synced at [`VERSION`] with no tables, fed by the test.
struct Harness {
    addr: SocketAddr,
    source: mpsc::Sender<SourceEvent>,
    /// The source's connection (numbered by `Started`) and its next frame id.
    connection: AtomicU64,
    next_id: AtomicU64,
    feedback: Arc<PrimaryFeedback>,
    /// Frames acknowledged on the current connection.
    acks: Mutex<Vec<u64>>,
    stop: watch::Sender<bool>,
    server: JoinHandle<Result<(), ServeError>>,
    dir: TempDir,
}

impl Harness {
    async fn start(name: &str, purge_delay: Duration) -> Harness {
        Harness::start_with(name, purge_delay, Duration::from_secs(30)).await
    }

    async fn start_with(name: &str, purge_delay: Duration, ping_interval: Duration) -> Harness {
        Harness::start_full(name, purge_delay, ping_interval, None, Tuning::default()).await
    }

    /// A harness whose peer endpoints require `token`.
    async fn start_secured(name: &str, token: &str) -> Harness {
        let token = super::ReplicationToken::new(token).expect("a valid token");
        Harness::start_full(
            name,
            Duration::from_secs(30),
            Duration::from_secs(30),
            Some(token),
            Tuning::default(),
        )
        .await
    }

    /// A harness serving https and wss with `tls`.
    async fn start_tls(name: &str, tls: Arc<rustls::ServerConfig>) -> Harness {
        let ping = Duration::from_secs(30);
        Harness::start_full(
            name,
            Duration::from_secs(30),
            ping,
            None,
            Tuning {
                tls: Some(tls),
                ..Tuning::default()
            },
        )
        .await
    }

    async fn start_full(
        name: &str,
        purge_delay: Duration,
        ping_interval: Duration,
        token: Option<super::ReplicationToken>,
        tuning: Tuning,
    ) -> Harness {
        let dir = TempDir::new(name);
        let mut replica = Replica::open_in_dir(&dir.0).expect("replica");
        replica
            .store_initial_state(&ReplicaState {
                replica_version: w(VERSION),
                watermark: w(VERSION),
                lsn: Lsn(VERSION),
                publications: vec!["pub".to_owned()],
                slot: "slot".to_owned(),
                app_id: "highwater".to_owned(),
                next_seq: 1,
            })
            .expect("initial state");
        let config = ChangeLogConfig {
            replica_version: w(VERSION),
            publications: vec!["pub".to_owned()],
        };
        let log = change_log::ensure(replica.connection(), &config, &w(VERSION)).expect("log");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("listen");
        let addr = listener.local_addr().expect("addr");
        let (source, events) = mpsc::channel(64);
        let feedback = Arc::new(PrimaryFeedback::default());
        let settings = Settings {
            sync: None,
            sync_retention: Duration::from_secs(super::DEFAULT_SYNC_RETENTION_SECS),
            sync_slow_consumer_ms: super::DEFAULT_SLOW_CONSUMER_MS,
            sync_checkpoint_ms: super::DEFAULT_SYNC_CHECKPOINT_MS,
            group_commit: true,
            data: dir.0.clone(),
            public_url: format!("http://{addr}"),
            purge_delay,
            backup_interval: Duration::from_millis(50),
            ping_interval,
            owner: "test".to_owned(),
            app_id: "highwater".to_owned(),
            backlog_high_water_bytes: tuning.backlog_high_water_bytes,
            backlog_full_timeout_ms: highwater_engine::streamer::DEFAULT_BACKLOG_FULL_TIMEOUT_MS,
            max_connections: tuning.max_connections,
            backfill_from: None,
            peer_auth: super::security::PeerAuth {
                token,
                ..Default::default()
            },
            insecure_no_auth: false,
            tls: tuning.tls,
            extra_routes: None,
            wal_watch: None,
            metrics_addr: None,
            writes_to: None,
        };
        let (stop, stop_rx) = watch::channel(false);
        let server = tokio::spawn(run_server(
            listener,
            ReplicaWriter::new(replica),
            log,
            vec!["pub".to_owned()],
            Source {
                events,
                confirm: Confirm::Primary(feedback.clone()),
                start: Lsn(0),
                task: None,
            },
            settings,
            stop_rx,
        ));
        Harness {
            addr,
            source,
            connection: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            feedback,
            acks: Mutex::new(Vec::new()),
            stop,
            server,
            dir,
        }
    }

    async fn send(&self, message: &str) {
        let message = decode_downstream(message).expect("a valid scripted message");
        self.source
            .send(SourceEvent::Frame {
                id: self.next_id.fetch_add(1, Ordering::SeqCst),
                messages: vec![message],
            })
            .await
            .expect("server running");
    }

    /// Sends `messages` as one frame: the server takes them all in one go.
    async fn send_frame(&self, messages: &[String]) {
        let messages = messages
            .iter()
            .map(|m| decode_downstream(m).expect("a valid scripted message"))
            .collect();
        self.source
            .send(SourceEvent::Frame {
                id: self.next_id.fetch_add(1, Ordering::SeqCst),
                messages,
            })
            .await
            .expect("server running");
    }

    /// The source reconnects: frame ids start over.
    async fn restart(&self) {
        self.source
            .send(SourceEvent::Started)
            .await
            .expect("server running");
        self.connection.fetch_add(1, Ordering::SeqCst);
        self.next_id.store(1, Ordering::SeqCst);
        self.acks.lock().expect("acks").clear();
    }

    /// A transaction at LSN `n` inserting `ids` (creating the table first when `create`).
    async fn transaction(&self, n: u64, ids: &[u64], create: bool) {
        let wm = w(n);
        self.send(&format!(
            r#"["begin",{{"tag":"begin"}},{{"commitWatermark":"{wm}"}}]"#
        ))
        .await;
        if create {
            self.send(CREATE_ITEMS).await;
        }
        for id in ids {
            self.send(&format!(
                r#"["data",{{"tag":"insert","relation":{ITEMS},"new":{{"id":{id},"v":"row {id}"}}}}]"#
            ))
            .await;
        }
        self.send(&format!(
            r#"["commit",{{"tag":"commit"}},{{"watermark":"{wm}"}}]"#
        ))
        .await;
    }

    fn url(&self, path: &str) -> String {
        format!("ws://{}{path}", self.addr)
    }

    fn acks(&self) -> Vec<u64> {
        let taken = self.feedback.take(self.connection.load(Ordering::SeqCst));
        assert_eq!(taken.reconnect, None, "the session ended the connection");
        let mut acks = self.acks.lock().expect("acks");
        acks.extend(taken.acks);
        acks.clone()
    }

    fn db(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(self.dir.0.join("replica.db")).expect("open replica")
    }

    /// The ids in the replica's `items`, in order.
    fn item_ids(&self) -> Vec<u64> {
        self.db()
            .prepare("SELECT id FROM items ORDER BY id")
            .expect("query")
            .query_map([], |r| r.get(0))
            .expect("rows")
            .collect::<Result<_, _>>()
            .expect("rows")
    }

    async fn stop(self) {
        let _ = self.stop.send(true);
        let result = tokio::time::timeout(PROMPT, self.server)
            .await
            .expect("stops promptly")
            .expect("server task");
        result.expect("clean stop");
    }
}

const ITEMS: &str = r#"{"schema":"public","name":"items","rowKey":{"columns":["id"]}}"#;
const CREATE_ITEMS: &str = r#"["data",{"tag":"create-table","spec":{"schema":"public","name":"items","columns":{"id":{"pos":1,"dataType":"int8","notNull":true},"v":{"pos":2,"dataType":"text"}},"primaryKey":["id"]}}]"#;

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A change-stream client that checks every frame with the engine's decoder.
struct Client {
    socket: Socket,
}

/// What the server did next.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Received {
    Frame(Frame<DownstreamMessage>),
    Closed(Option<(CloseCode, String)>),
}

impl Client {
    async fn connect(url: &str) -> Client {
        let (socket, _) = tokio::time::timeout(PROMPT, tokio_tungstenite::connect_async(url))
            .await
            .expect("connects promptly")
            .expect("websocket handshake");
        Client { socket }
    }

    async fn next(&mut self) -> Received {
        loop {
            let message = tokio::time::timeout(PROMPT, self.socket.next())
                .await
                .expect("a frame or close in time");
            match message {
                Some(Ok(Message::Text(text))) => {
                    let frame = decode_downstream_frame(text.as_str())
                        .unwrap_or_else(|e| panic!("invalid frame {text}: {e}"));
                    return Received::Frame(frame);
                }
                Some(Ok(Message::Close(frame))) => {
                    return Received::Closed(frame.map(|f| (f.code, f.reason.to_string())))
                }
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => return Received::Closed(None),
            }
        }
    }

    async fn frame(&mut self) -> Frame<DownstreamMessage> {
        match self.next().await {
            Received::Frame(frame) => frame,
            Received::Closed(close) => panic!("expected a frame, the server closed: {close:?}"),
        }
    }

    async fn closed(&mut self) -> Option<(CloseCode, String)> {
        loop {
            if let Received::Closed(close) = self.next().await {
                return close;
            }
        }
    }

    async fn send(&mut self, text: &str) {
        self.socket
            .send(Message::text(text.to_owned()))
            .await
            .expect("send");
    }

    async fn ack(&mut self, id: u64) {
        self.send(&format!(r#"{{"ack":{id}}}"#)).await;
    }

    /// Receives and acks frames until `count` messages arrived.
    async fn messages(&mut self, count: usize) -> Vec<DownstreamMessage> {
        let mut out = Vec::new();
        while out.len() < count {
            let frame = self.frame().await;
            let id = frame.id().expect("an application frame");
            out.extend(frame.into_messages());
            self.ack(id).await;
        }
        out
    }
}

fn commits(messages: &[DownstreamMessage]) -> Vec<Watermark> {
    messages
        .iter()
        .filter_map(|m| match m {
            DownstreamMessage::Commit(c) => Some(c.watermark.clone()),
            _ => None,
        })
        .collect()
}

fn changes_url(
    h: &Harness,
    version: u32,
    replica_version: &Watermark,
    watermark: &Watermark,
) -> String {
    h.url(&format!(
        "/replication/v{version}/changes?id=sub&taskID=task&replicaVersion={replica_version}&watermark={watermark}"
    ))
}

async fn wait_until(mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PROMPT;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached in time"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn stored_last_watermark(conn: &rusqlite::Connection) -> String {
    conn.query_row(
        r#"SELECT "last_watermark" FROM "_hw_change_log_state""#,
        [],
        |r| r.get(0),
    )
    .expect("state")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_at_replica_version_gets_the_history_then_live_changes() {
    let h = Harness::start("history", Duration::from_secs(30)).await;
    h.transaction(0x200, &[1, 2], true).await;
    h.transaction(0x300, &[3], false).await;
    let mut client = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    // status, then 2 catch-up transactions: begin+create+2 inserts+commit, begin+insert+commit.
    let messages = client.messages(1 + 5 + 3).await;
    assert!(matches!(messages[0], DownstreamMessage::Status(_)));
    assert_eq!(commits(&messages), [w(0x200), w(0x300)]);
    h.transaction(0x400, &[4], false).await;
    let live = client.messages(3).await;
    assert_eq!(commits(&live), [w(0x400)]);
    // The replica holds every row, and the log's position matches.
    wait_until(|| stored_last_watermark(&h.db()) == w(0x400).as_str()).await;
    let rows: i64 = h
        .db()
        .query_row("SELECT count(*) FROM items", [], |r| r.get(0))
        .expect("count");
    assert_eq!(rows, 4);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_at_a_stored_watermark_gets_only_later_transactions() {
    let h = Harness::start("middle", Duration::from_secs(30)).await;
    h.transaction(0x200, &[1], true).await;
    h.transaction(0x300, &[2], false).await;
    h.transaction(0x400, &[3], false).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x400).as_str()).await;
    let mut client = Client::connect(&changes_url(&h, 5, &w(VERSION), &w(0x300))).await;
    let messages = client.messages(1 + 3).await;
    assert!(matches!(messages[0], DownstreamMessage::Status(_)));
    assert_eq!(commits(&messages), [w(0x400)]);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_is_acked_only_once_the_transaction_is_durable() {
    let h = Harness::start("acks", Duration::from_secs(30)).await;
    let mut client = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    assert!(matches!(
        client.messages(1).await[0],
        DownstreamMessage::Status(_)
    ));
    h.send(&format!(
        r#"["begin",{{"tag":"begin"}},{{"commitWatermark":"{}"}}]"#,
        w(0x200)
    ))
    .await;
    h.send(CREATE_ITEMS).await;
    // Forwarded at once, before the commit exists anywhere.
    let early = client.messages(2).await;
    assert!(matches!(early[1], DownstreamMessage::Data(_)));
    assert!(h.acks().is_empty());
    assert_eq!(stored_last_watermark(&h.db()), w(VERSION).as_str());
    h.send(&format!(
        r#"["commit",{{"tag":"commit"}},{{"watermark":"{}"}}]"#,
        w(0x200)
    ))
    .await;
    wait_until(|| !h.acks().is_empty()).await;
    // Every frame of the transaction is acknowledged, once, in order, and it is on disk by then.
    assert_eq!(h.acks(), [1, 2, 3]);
    assert_eq!(stored_last_watermark(&h.db()), w(0x200).as_str());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_taken_from_the_source_queue_together_is_stored_forwarded_and_acked_in_order() {
    let h = Harness::start("burst", Duration::from_secs(30)).await;
    let mut client = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    client.messages(1).await;
    // Sent without waiting for any of it: the source queue fills, and the ingest loop takes
    // what is queued together instead of one event per wake-up.
    const TXNS: u64 = 200;
    for n in 0..TXNS {
        h.transaction(0x200 + n * 0x10, &[n + 1], n == 0).await;
    }
    let frames = 3 * TXNS + 1;
    let messages = client.messages(usize::try_from(frames).unwrap()).await;
    let expected: Vec<Watermark> = (0..TXNS).map(|n| w(0x200 + n * 0x10)).collect();
    assert_eq!(commits(&messages), expected, "every transaction, in order");
    wait_until(|| h.acks().len() == usize::try_from(frames).unwrap()).await;
    // Every frame acknowledged once, in order, and only once stored.
    assert_eq!(h.acks(), (1..=frames).collect::<Vec<_>>());
    assert_eq!(
        stored_last_watermark(&h.db()),
        w(0x200 + (TXNS - 1) * 0x10).as_str()
    );
    let ids = h.item_ids();
    assert_eq!(ids, (1..=TXNS).collect::<Vec<_>>());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_is_forwarded_but_never_stored() {
    let h = Harness::start("rollback", Duration::from_secs(30)).await;
    h.transaction(0x200, &[1], true).await;
    let mut client = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    client.messages(1 + 4).await;
    h.send(&format!(
        r#"["begin",{{"tag":"begin"}},{{"commitWatermark":"{}"}}]"#,
        w(0x300)
    ))
    .await;
    h.send(&format!(
        r#"["data",{{"tag":"insert","relation":{ITEMS},"new":{{"id":9,"v":"gone"}}}}]"#
    ))
    .await;
    h.send(r#"["rollback",{"tag":"rollback"}]"#).await;
    h.transaction(0x400, &[2], false).await;
    let messages = client.messages(3 + 3).await;
    assert!(matches!(messages[2], DownstreamMessage::Rollback(_)));
    assert_eq!(commits(&messages), [w(0x400)]);
    wait_until(|| stored_last_watermark(&h.db()) == w(0x400).as_str()).await;
    let db = h.db();
    let stored: i64 = db
        .query_row(
            r#"SELECT count(*) FROM "_hw_change_log" WHERE "watermark" = ?1"#,
            [w(0x300).as_str()],
            |r| r.get(0),
        )
        .expect("count");
    assert_eq!(stored, 0);
    let ids: Vec<i64> = db
        .prepare("SELECT id FROM items ORDER BY id")
        .expect("query")
        .query_map([], |r| r.get(0))
        .expect("rows")
        .collect::<Result<_, _>>()
        .expect("ids");
    assert_eq!(ids, [1, 2]);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_replica_version_is_error_type_1() {
    let h = Harness::start("wrong-version", Duration::from_secs(30)).await;
    let mut client = Client::connect(&changes_url(&h, 6, &w(0x999), &w(0x999))).await;
    let frame = client.frame().await;
    let [DownstreamMessage::Error(error)] = frame.messages() else {
        panic!("expected an error, got {frame:?}");
    };
    assert_eq!(error.kind(), Some(ErrorKind::WrongReplicaVersion));
    assert_eq!(
        error.message.as_deref(),
        Some(
            format!(
                "current replica version is {} (requested {})",
                w(VERSION),
                w(0x999)
            )
            .as_str()
        )
    );
    client.ack(frame.id().expect("id")).await;
    assert!(client.closed().await.is_some());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_and_frames_close_the_socket_with_1002() {
    let h = Harness::start("bad", Duration::from_secs(30)).await;
    let mut client = Client::connect(&h.url("/replication/v9/changes?id=a")).await;
    assert_eq!(
        client.closed().await,
        Some((
            CloseCode::Protocol,
            "Error: Cannot service client at protocol v9. Supported protocols: [v1 ... v8]"
                .to_owned()
        ))
    );
    let mut client =
        Client::connect(&h.url("/replication/v6/changes?id=a&replicaVersion=01")).await;
    assert_eq!(
        client.closed().await,
        Some((
            CloseCode::Protocol,
            "Error: invalid querystring - missing watermark".to_owned()
        ))
    );
    let mut client = Client::connect(&h.url("/replication/v5/snapshot")).await;
    assert_eq!(
        client.closed().await,
        Some((
            CloseCode::Protocol,
            "Error: Missing taskID in snapshot request".to_owned()
        ))
    );
    // A frame that is not valid JSON ends the subscription; the server keeps running.
    let mut client = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    client.frame().await;
    client.send("{not json").await;
    assert!(matches!(
        client.closed().await,
        Some((CloseCode::Protocol, _))
    ));
    // An out-of-order ack too.
    h.transaction(0x200, &[1], true).await;
    let mut client = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    let first = client.frame().await.id().expect("id");
    let second = client.frame().await.id().expect("id");
    assert_eq!((first, second), (1, 2));
    client.ack(2).await;
    let (code, reason) = client.closed().await.expect("a close frame");
    assert_eq!(code, CloseCode::Protocol);
    assert!(
        reason.contains("expected an ack of frame 1, found an ack of frame 2"),
        "{reason}"
    );
    h.stop().await;
}

/// `GET` over plain HTTP/1.1: status line, headers (lower-case names), body.
async fn http_get(addr: SocketAddr, path: &str) -> (String, Vec<(String, String)>, Vec<u8>) {
    http_get_with(addr, path, "").await
}

/// `GET` with extra header lines (each ending in `\r\n`).
async fn http_get_with(
    addr: SocketAddr,
    path: &str,
    extra_headers: &str,
) -> (String, Vec<(String, String)>, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(
            format!(
                "GET {path} HTTP/1.1\r\nHost: test\r\n{extra_headers}Connection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .expect("request");
    let mut raw = Vec::new();
    tokio::time::timeout(PROMPT, stream.read_to_end(&mut raw))
        .await
        .expect("response in time")
        .expect("read");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of headers");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines.next().unwrap_or_default().to_owned();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, raw[split + 4..].to_vec())
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_serves_a_consistent_replica_without_the_change_log() {
    let h = Harness::start("snapshot", Duration::from_secs(30)).await;
    h.transaction(0x200, &[1, 2, 3], true).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x200).as_str()).await;
    let (status, headers, body) = http_get(h.addr, "/replica/snapshot").await;
    assert!(status.contains("200"), "{status}");
    assert_eq!(
        header(&headers, super::WATERMARK_HEADER),
        Some(w(0x200).as_str())
    );
    assert_eq!(
        header(&headers, super::snapshot::REPLICA_VERSION_HEADER),
        Some(w(VERSION).as_str())
    );
    assert_eq!(
        header(&headers, "content-length").and_then(|v| v.parse::<usize>().ok()),
        Some(body.len())
    );
    let dir = TempDir::new("snapshot-restored");
    let path = dir.0.join("replica.db");
    std::fs::write(&path, &body).expect("write snapshot");
    let restored = Replica::open(&path).expect("a valid SQLite replica");
    let state = restored.state().expect("replication state");
    assert_eq!(
        (state.watermark.clone(), state.replica_version.clone()),
        (w(0x200), w(VERSION))
    );
    let rows: i64 = restored
        .connection()
        .query_row("SELECT count(*) FROM items", [], |r| r.get(0))
        .expect("count");
    assert_eq!(rows, 3);
    let log_tables: i64 = restored
        .connection()
        .query_row(
            "SELECT count(*) FROM sqlite_schema WHERE name LIKE '\\_hw\\_change\\_log%' ESCAPE '\\'",
            [],
            |r| r.get(0),
        )
        .expect("schema");
    assert_eq!(log_tables, 0);
    // Health and keepalive answer too.
    let (status, _, body) = http_get(h.addr, "/health").await;
    assert!(status.contains("200"), "{status}");
    let health: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(health["lastWatermark"], w(0x200).as_str());
    for path in ["/", "/keepalive"] {
        assert!(http_get(h.addr, path).await.0.contains("200"));
    }
    // Only the snapshot kept for the next request at this watermark is on disk.
    let kept = Path::new(&h.dir.0.join("snapshots"))
        .read_dir()
        .expect("dir")
        .count();
    assert_eq!(kept, 1);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v7_reserve_then_subscribe_on_one_socket() {
    let h = Harness::start("subscribe", Duration::from_secs(30)).await;
    h.transaction(0x200, &[1], true).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x200).as_str()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut client = Client::connect(&h.url("/replication/v7/subscribe?taskID=t1")).await;
    client
        .send(r#"{"id":1,"msg":["reserve-snapshot",{"taskID":"t1"}]}"#)
        .await;
    // The reservation is confirmed once a backup watermark is known, and the control frame acked.
    let mut reserved = None;
    let mut acked = false;
    while reserved.is_none() || !acked {
        match client.frame().await {
            Frame::Ack { ack } => {
                assert_eq!(ack, 1);
                acked = true;
            }
            frame => {
                let id = frame.id().expect("id");
                let [DownstreamMessage::Reserved(r)] = frame.messages() else {
                    panic!("expected the reservation, got {frame:?}");
                };
                reserved = Some(r.clone());
                client.ack(id).await;
            }
        }
    }
    let reserved = reserved.expect("reserved");
    assert_eq!(
        reserved.backup_url,
        format!("http://{}/replica/snapshot", h.addr)
    );
    assert_eq!(reserved.replica_version, w(VERSION));
    assert_eq!(reserved.min_watermark, w(0x200));
    client
        .send(&format!(
            r#"{{"id":2,"msg":["start-subscription",{{"taskID":"t1","id":"r1","mode":"serving","replicaVersion":"{}","watermark":"{}"}}]}}"#,
            w(VERSION),
            w(0x200)
        ))
        .await;
    h.transaction(0x300, &[2, 3], false).await;
    let mut messages = Vec::new();
    let mut acked = false;
    while commits(&messages).is_empty() || !acked {
        match client.frame().await {
            Frame::Ack { ack } => {
                assert_eq!(ack, 2);
                acked = true;
            }
            frame => {
                let id = frame.id().expect("id");
                messages.extend(frame.into_messages());
                client.ack(id).await;
            }
        }
    }
    assert!(matches!(messages[0], DownstreamMessage::Status(_)));
    assert_eq!(commits(&messages), [w(0x300)]);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_pins_the_change_log_through_a_purge() {
    let h = Harness::start("purge", Duration::from_millis(100)).await;
    h.transaction(0x200, &[1], true).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x200).as_str()).await;
    // Let the ticker report 0x200 as the backup watermark.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut reservation = Client::connect(&h.url("/replication/v6/snapshot?taskID=t1")).await;
    let frame = reservation.frame().await;
    let [DownstreamMessage::Status(status)] = frame.messages() else {
        panic!("expected the legacy reservation status, got {frame:?}");
    };
    let pinned = status.extra["minWatermark"]
        .as_str()
        .expect("minWatermark")
        .to_owned();
    assert_eq!(pinned, w(0x200).as_str());
    reservation.ack(frame.id().expect("id")).await;
    for n in 3..8u64 {
        h.transaction(n << 8, &[n], false).await;
    }
    wait_until(|| stored_last_watermark(&h.db()) == w(0x700).as_str()).await;
    // Purges run (the delay is short) but stop at the reservation.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let min = |h: &Harness| -> String {
        h.db()
            .query_row(
                r#"SELECT MIN("watermark") FROM "_hw_change_log""#,
                [],
                |r| r.get(0),
            )
            .expect("min")
    };
    assert_eq!(min(&h), pinned);
    let mut client = Client::connect(&format!(
        "{}&initial=true",
        changes_url(&h, 6, &w(VERSION), &w(0x200)).replace("taskID=task", "taskID=t1")
    ))
    .await;
    let messages = client.messages(1 + 5 * 3).await;
    assert_eq!(
        commits(&messages),
        (3..8u64).map(|n| w(n << 8)).collect::<Vec<_>>()
    );
    // The subscription ended the reservation.
    assert!(reservation.closed().await.is_some());
    client.socket.close(None).await.expect("close");
    let hub = |h: &Harness| h.addr;
    loop {
        let (_, _, body) = http_get(hub(&h), "/health").await;
        let health: serde_json::Value = serde_json::from_slice(&body).expect("json");
        if health["connections"] == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Without reservation or subscriber, the next purge cuts the log to the newest transaction...
    h.transaction(0x800, &[8], false).await;
    wait_until(|| min(&h) == w(0x800).as_str()).await;
    // ...and a subscriber that far behind is told its watermark is too old.
    let mut late = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(0x200))).await;
    let frame = late.frame().await;
    let [DownstreamMessage::Error(error)] = frame.messages() else {
        panic!("expected an error, got {frame:?}");
    };
    assert_eq!(error.kind(), Some(ErrorKind::WatermarkTooOld));
    assert_eq!(
        error.message.as_deref(),
        Some(
            format!(
                "earliest supported watermark is {} (requested {})",
                w(0x800),
                w(0x200)
            )
            .as_str()
        )
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_source_resends_without_duplicates_or_half_transactions() {
    let h = Harness::start("restart", Duration::from_secs(30)).await;
    h.transaction(0x200, &[1], true).await;
    let mut client = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    client.messages(1 + 4).await;
    // The stream dies inside a transaction...
    h.send(&format!(
        r#"["begin",{{"tag":"begin"}},{{"commitWatermark":"{}"}}]"#,
        w(0x300)
    ))
    .await;
    h.send(&format!(
        r#"["data",{{"tag":"insert","relation":{ITEMS},"new":{{"id":2,"v":"first try"}}}}]"#
    ))
    .await;
    h.restart().await;
    // ...and upstream sends again from its last acknowledged position: 0x200 is stored already.
    h.transaction(0x200, &[1], true).await;
    h.transaction(0x300, &[2], false).await;
    let messages = client.messages(2 + 1 + 3).await;
    assert!(matches!(messages[2], DownstreamMessage::Rollback(_)));
    assert_eq!(commits(&messages), [w(0x300)]);
    wait_until(|| stored_last_watermark(&h.db()) == w(0x300).as_str()).await;
    let rows: Vec<(i64, String)> = h
        .db()
        .prepare("SELECT id, v FROM items ORDER BY id")
        .expect("query")
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("rows")
        .collect::<Result<_, _>>()
        .expect("rows");
    assert_eq!(rows, [(1, "row 1".to_owned()), (2, "row 2".to_owned())]);
    let stored: i64 = h
        .db()
        .query_row(r#"SELECT count(*) FROM "_hw_change_log""#, [], |r| r.get(0))
        .expect("count");
    // Seed (2) + 0x200 (begin, create, insert, commit) + 0x300 (begin, insert, commit).
    assert_eq!(stored, 2 + 4 + 3);
    h.stop().await;
}

fn begin_of(n: u64) -> String {
    format!(
        r#"["begin",{{"tag":"begin"}},{{"commitWatermark":"{}"}}]"#,
        w(n)
    )
}

fn insert_of(id: u64) -> String {
    format!(r#"["data",{{"tag":"insert","relation":{ITEMS},"new":{{"id":{id},"v":"row {id}"}}}}]"#)
}

fn commit_of(n: u64) -> String {
    format!(
        r#"["commit",{{"tag":"commit"}},{{"watermark":"{}"}}]"#,
        w(n)
    )
}

/// The ingest thread holds a small transaction whole until its commit (no savepoint) and
/// streams a large one into SQLite in a savepoint. Cut off by a restart right behind a
/// commit that is still in the open group, either kind leaves that commit stored and
/// nothing of itself: sent again, each is stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_and_streamed_transactions_cut_off_inside_a_group_leave_nothing_behind() {
    let h = Harness::start("cut-off", Duration::from_secs(30)).await;
    h.transaction(0x200, &[1], true).await;
    // One frame: a whole transaction, then the start of a small one; then the restart.
    h.send_frame(&[
        begin_of(0x300),
        insert_of(2),
        commit_of(0x300),
        begin_of(0x400),
        insert_of(3),
    ])
    .await;
    h.restart().await;
    h.transaction(0x300, &[2], false).await;
    h.transaction(0x400, &[3], false).await;
    // The same with a transaction too large to hold (more messages than the hold takes).
    let large: Vec<u64> = (1000..1300).collect();
    let mut frame = vec![
        begin_of(0x500),
        insert_of(4),
        commit_of(0x500),
        begin_of(0x600),
    ];
    frame.extend(large.iter().map(|&id| insert_of(id)));
    h.send_frame(&frame).await;
    h.restart().await;
    h.transaction(0x500, &[4], false).await;
    h.transaction(0x600, &large, false).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x600).as_str()).await;
    let ids = h.item_ids();
    let expected: Vec<u64> = [1, 2, 3, 4]
        .into_iter()
        .chain(large.iter().copied())
        .collect();
    assert_eq!(ids, expected);
    let per_transaction: Vec<(String, i64)> = h
        .db()
        .prepare(r#"SELECT "watermark", count(*) FROM "_hw_change_log" GROUP BY 1 ORDER BY 1"#)
        .expect("query")
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .expect("rows")
        .collect::<Result<_, _>>()
        .expect("rows");
    let expected: Vec<(String, i64)> = [
        (VERSION, 2),
        (0x200, 4),
        (0x300, 3),
        (0x400, 3),
        (0x500, 3),
        (0x600, 2 + large.len() as i64),
    ]
    .into_iter()
    .map(|(n, rows)| (w(n).as_str().to_owned(), rows))
    .collect();
    assert_eq!(per_transaction, expected);
    // The replica's position, written once per group, is the last commit's.
    let position: String = h
        .db()
        .query_row(r#"SELECT "watermark" FROM "_hw_state""#, [], |r| r.get(0))
        .expect("position");
    assert_eq!(position, w(0x600).as_str());
    h.stop().await;
}

#[test]
fn owner_address_is_what_zero_discovers() {
    assert_eq!(
        super::owner_address("http://10.0.0.5:4848"),
        "10.0.0.5:4848"
    );
    assert_eq!(
        super::owner_address("https://sync.example:443"),
        "wss://sync.example:443"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_answering_pings_is_dropped() {
    let h = Harness::start_with(
        "liveness",
        Duration::from_secs(30),
        Duration::from_millis(100),
    )
    .await;
    let connections = |h: &Harness| {
        let addr = h.addr;
        async move {
            let (_, _, body) = http_get(addr, "/health").await;
            let health: serde_json::Value = serde_json::from_slice(&body).expect("json");
            health["connections"].as_u64().expect("connections")
        }
    };
    // This one reads throughout, so its library answers every ping; its frames come here.
    let mut lively = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    let (frames, mut lively_frames) = tokio::sync::mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        while let Some(Ok(message)) = lively.socket.next().await {
            if let Message::Text(text) = message {
                let frame = decode_downstream_frame(text.as_str())
                    .unwrap_or_else(|e| panic!("invalid frame {text}: {e}"));
                if frames.send(frame).is_err() {
                    break;
                }
            }
        }
    });
    // This one reads its initial status, so it was subscribed, and then never again: no pong
    // ever comes back.
    let mut silent = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    let status = silent.frame().await;
    assert!(
        matches!(status.messages(), [DownstreamMessage::Status(_)]),
        "{status:?}"
    );
    // Pings go every 100 ms: the silent peer is dropped after a few of them, however busy the
    // machine running the test is.
    let deadline = tokio::time::Instant::now() + PROMPT;
    while connections(&h).await != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "expected the silent peer dropped within {PROMPT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Still subscribed: live changes reach the one that answers.
    h.transaction(0x200, &[1], true).await;
    let frame = loop {
        let frame = tokio::time::timeout(PROMPT, lively_frames.recv())
            .await
            .expect("a frame in time")
            .expect("the lively peer still connected");
        // Its initial status came before the transaction.
        if !matches!(frame.messages(), [DownstreamMessage::Status(_)]) {
            break frame;
        }
    };
    assert!(
        matches!(frame.messages(), [DownstreamMessage::Begin(_)]),
        "{frame:?}"
    );
    assert_eq!(connections(&h).await, 1);
    // The one the server dropped is the silent one.
    assert!(
        matches!(silent.next().await, Received::Closed(_)),
        "expected the silent peer's socket closed"
    );
    reader.abort();
    h.stop().await;
}

const TOKEN: &str = "replication-token-0123456789";

/// A WebSocket handshake with an `Authorization` header; the HTTP status when refused.
async fn connect_with(url: &str, authorization: Option<&str>) -> Result<Client, u16> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut request = url.into_client_request().expect("request");
    if let Some(value) = authorization {
        request
            .headers_mut()
            .insert("authorization", value.parse().expect("header value"));
    }
    let connecting = tokio_tungstenite::connect_async(request);
    match tokio::time::timeout(PROMPT, connecting)
        .await
        .expect("an answer in time")
    {
        Ok((socket, _)) => Ok(Client { socket }),
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            Err(response.status().as_u16())
        }
        Err(other) => panic!("expected a handshake or an HTTP refusal, got {other}"),
    }
}

fn basic(user: &str, password: &str) -> String {
    use base64::Engine as _;
    let encoded = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    format!("Basic {encoded}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_endpoints_refuse_missing_and_wrong_tokens_with_401_before_any_data() {
    let h = Harness::start_secured("peer-auth-refused", TOKEN).await;
    h.transaction(0x200, &[1, 2], true).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x200).as_str()).await;
    let changes = changes_url(&h, 6, &w(VERSION), &w(VERSION));
    let wrong_bearer = format!("Bearer {TOKEN}x");
    let wrong_basic = basic("any", "not-the-token-at-all");
    let token_as_user = basic(TOKEN, "");
    let refusals = [
        None,
        Some(wrong_bearer.as_str()),
        Some(wrong_basic.as_str()),
        Some(token_as_user.as_str()),
        Some("Bearer"),
        Some("Token replication-token-0123456789"),
    ];
    for authorization in refusals {
        for url in [
            changes.clone(),
            h.url("/replication/v8/subscribe?taskID=t"),
            h.url("/replication/v5/snapshot?taskID=t"),
        ] {
            assert_eq!(
                connect_with(&url, authorization).await.err(),
                Some(401),
                "{url} with {authorization:?}"
            );
        }
        let header_line = authorization
            .map(|value| format!("Authorization: {value}\r\n"))
            .unwrap_or_default();
        let (status, headers, body) =
            http_get_with(h.addr, super::SNAPSHOT_PATH, &header_line).await;
        assert!(status.contains("401"), "{status}");
        assert_eq!(
            header(&headers, "www-authenticate"),
            Some("Basic realm=\"highwater\"")
        );
        assert!(!body.starts_with(b"SQLite format"), "no replica bytes");
        let (status, _, body) = http_get_with(h.addr, "/metrics", &header_line).await;
        assert!(status.contains("401"), "{status}");
        assert!(!String::from_utf8_lossy(&body).contains("highwater_"));
    }
    // With the token, /metrics counts every refusal above: five requests per credential.
    let (status, _, body) = http_get_with(
        h.addr,
        "/metrics",
        &format!("Authorization: Bearer {TOKEN}\r\n"),
    )
    .await;
    assert!(status.contains("200"), "{status}");
    let text = String::from_utf8(body).expect("utf-8");
    let scrape =
        prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("parses");
    let refused: f64 = scrape
        .samples
        .iter()
        .filter(|s| s.metric == "highwater_auth_failures_total")
        .filter(|s| s.labels.get("endpoint") == Some("replication"))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
            _ => panic!("a counter"),
        })
        .sum();
    assert_eq!(refused, (refusals.len() * 5) as f64);
    // No snapshot was built for a refused request, and health stays open.
    assert!(h
        .dir
        .0
        .join("snapshots")
        .read_dir()
        .expect("dir")
        .next()
        .is_none());
    let (status, _, body) = http_get(h.addr, "/health").await;
    assert!(status.contains("200"), "{status}");
    let health: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(health["insecureNoAuth"], false);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_and_basic_with_the_token_as_password_are_both_accepted() {
    let h = Harness::start_secured("peer-auth-accepted", TOKEN).await;
    h.transaction(0x200, &[1, 2, 3], true).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x200).as_str()).await;
    let bearer = format!("Bearer {TOKEN}");
    // What a Zero view-syncer sends for ws://any:<token>@host:port.
    let basic = basic("any", TOKEN);
    for authorization in [bearer.as_str(), basic.as_str()] {
        let url = changes_url(&h, 6, &w(VERSION), &w(VERSION));
        let mut client = connect_with(&url, Some(authorization))
            .await
            .unwrap_or_else(|status| panic!("{authorization}: refused with {status}"));
        let messages = client.messages(1).await;
        assert!(!messages.is_empty(), "the history streams");
        let (status, headers, body) = http_get_with(
            h.addr,
            super::SNAPSHOT_PATH,
            &format!("Authorization: {authorization}\r\n"),
        )
        .await;
        assert!(status.contains("200"), "{status}");
        assert_eq!(
            header(&headers, super::WATERMARK_HEADER),
            Some(w(0x200).as_str())
        );
        assert!(body.starts_with(b"SQLite format 3"));
    }
    h.stop().await;
}

/// Regression: `mode=backup` with a watermark older than the change log used to mark the log
/// reset-required and stop the server, so anyone who could reach the port could wipe it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_subscriber_with_an_old_watermark_gets_an_error_and_the_server_serves_on() {
    let h = Harness::start("backup-reset", Duration::from_secs(30)).await;
    h.transaction(0x200, &[1, 2], true).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x200).as_str()).await;
    for version in [5, 6] {
        let url = h.url(&format!(
            "/replication/v{version}/changes?id=rm&taskID=rm&mode=backup&replicaVersion={}&watermark=00",
            w(VERSION)
        ));
        let mut client = Client::connect(&url).await;
        let frame = client.frame().await;
        let [DownstreamMessage::Error(error)] = frame.messages() else {
            panic!("expected an error, got {frame:?}");
        };
        assert_eq!(error.kind(), Some(ErrorKind::WatermarkTooOld));
        client.ack(frame.id().expect("id")).await;
        assert!(client.closed().await.is_some());
    }
    // The change log is not marked for a reset, and the server keeps storing and serving.
    let reset_required: bool = h
        .db()
        .query_row(
            r#"SELECT "reset_required" FROM "_hw_change_log_config""#,
            [],
            |r| r.get(0),
        )
        .expect("config row");
    assert!(!reset_required);
    h.transaction(0x300, &[3], false).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x300).as_str()).await;
    let mut client = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(0x200))).await;
    let commits = commits(&client.messages(4).await);
    assert_eq!(
        commits,
        [w(0x300)],
        "a serving subscriber still gets new transactions"
    );
    let (status, _, _) = http_get(h.addr, "/health").await;
    assert!(status.contains("200"), "{status}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_closes_that_connection_only_with_1009() {
    let h = Harness::start("too-big", Duration::from_secs(30)).await;
    let mut big = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    let mut other = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    big.frame().await;
    let first = other.frame().await.id().expect("id");
    other.ack(first).await;
    // Just over the limit: the frame is refused, not buffered and parsed.
    let text = "x".repeat(super::change_stream::connection::MAX_CLIENT_FRAME_BYTES + 1);
    let _ = big.socket.send(Message::text(text)).await;
    let (code, reason) = big.closed().await.expect("a close frame");
    assert_eq!(code, CloseCode::Size, "{reason}");
    assert!(reason.contains("at most 1 MiB"), "{reason}");
    // The other subscriber still gets its changes.
    h.transaction(0x200, &[1], true).await;
    let messages = other.messages(1).await;
    assert!(!messages.is_empty());
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_are_refused_with_503_until_one_ends() {
    let h = Harness::start_full(
        "limit",
        Duration::from_secs(30),
        Duration::from_secs(30),
        None,
        Tuning {
            max_connections: 2,
            ..Tuning::default()
        },
    )
    .await;
    let url = changes_url(&h, 6, &w(VERSION), &w(VERSION));
    let mut first = Client::connect(&url).await;
    let mut second = Client::connect(&url).await;
    first.frame().await;
    second.frame().await;
    let refused = tokio::time::timeout(PROMPT, tokio_tungstenite::connect_async(url.as_str()))
        .await
        .expect("answers promptly");
    match refused {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status(), 503);
            let body = String::from_utf8_lossy(response.body().as_deref().unwrap_or_default())
                .into_owned();
            assert!(
                body.contains("expected at most 2 open connections"),
                "{body}"
            );
        }
        other => panic!("expected a 503 refusal, got {other:?}"),
    }
    // Plain HTTP is not a WebSocket and is never refused.
    assert!(http_get(h.addr, "/health").await.0.contains("200"));
    // Once a connection ends its slot is free again.
    drop(first);
    let deadline = tokio::time::Instant::now() + PROMPT;
    let mut third = loop {
        match tokio_tungstenite::connect_async(url.as_str()).await {
            Ok((socket, _)) => break Client { socket },
            Err(tokio_tungstenite::tungstenite::Error::Http(response))
                if response.status() == 503 =>
            {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the slot never came back"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => panic!("expected a connection, got {error}"),
        }
    };
    third.frame().await;
    h.stop().await;
}

/// Waits until `/health` reports `lsn`'s watermark as the last durable one.
async fn until_durable(addr: SocketAddr, lsn: u64) {
    let deadline = tokio::time::Instant::now() + PROMPT;
    loop {
        let (_, _, health) = http_get(addr, "/health").await;
        let health: serde_json::Value = serde_json::from_slice(&health).expect("json");
        if health["lastWatermark"] == w(lsn).as_str() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{health}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_snapshot_requests_build_one_snapshot() {
    let h = Harness::start("snapshot-shared", Duration::from_secs(30)).await;
    h.transaction(0x200, &[1, 2, 3], true).await;
    // A snapshot is taken at the last durable watermark, which the server reaches once the
    // commit's WAL sync is done: a little after the replica holds it.
    until_durable(h.addr, 0x200).await;
    let addr = h.addr;
    let requests: Vec<_> = (0..50)
        .map(|_| tokio::spawn(async move { http_get(addr, "/replica/snapshot").await }))
        .collect();
    let mut bodies = Vec::new();
    for request in requests {
        let (status, headers, body) = request.await.expect("request task");
        assert!(status.contains("200"), "{status}");
        assert_eq!(
            header(&headers, super::WATERMARK_HEADER),
            Some(w(0x200).as_str())
        );
        bodies.push(body);
    }
    assert!(bodies.iter().all(|b| b == &bodies[0] && !b.is_empty()));
    let (_, _, health) = http_get(h.addr, "/health").await;
    let health: serde_json::Value = serde_json::from_slice(&health).expect("json");
    assert_eq!(health["snapshotsBuilt"], 1, "{health}");
    // At most the one snapshot file is kept on disk.
    let files = h.dir.0.join("snapshots").read_dir().expect("dir").count();
    assert!(files <= 1, "{files} snapshot files kept");
    // A later commit makes the next request build a new one, replacing the old file.
    h.transaction(0x300, &[4], false).await;
    until_durable(h.addr, 0x300).await;
    let (status, headers, _) = http_get(h.addr, "/replica/snapshot").await;
    assert!(status.contains("200"), "{status}");
    assert_eq!(
        header(&headers, super::WATERMARK_HEADER),
        Some(w(0x300).as_str())
    );
    let (_, _, health) = http_get(h.addr, "/health").await;
    let health: serde_json::Value = serde_json::from_slice(&health).expect("json");
    assert_eq!(health["snapshotsBuilt"], 2, "{health}");
    let files = h.dir.0.join("snapshots").read_dir().expect("dir").count();
    assert_eq!(files, 1, "the old snapshot file was not removed");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_stops_reading_during_catch_up_blocks_no_checkpoint_or_other_subscriber()
{
    let h = Harness::start_full(
        "slow-catchup",
        Duration::from_secs(30),
        Duration::from_secs(30),
        None,
        Tuning {
            backlog_high_water_bytes: 4096,
            ..Tuning::default()
        },
    )
    .await;
    // More rows than one catch-up batch holds (2000), so the read must pause between batches.
    let ids: Vec<u64> = (1..=20).collect();
    h.transaction(0x200, &ids, true).await;
    for n in 1..120 {
        h.transaction(0x200 + n * 0x10, &ids, false).await;
    }
    let last = w(0x200 + 119 * 0x10);
    wait_until(|| stored_last_watermark(&h.db()) == last.as_str()).await;
    // Catches up from the start, then never reads or acks: its catch-up pauses at the bound.
    let silent = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Its paused catch-up holds no read transaction: a full checkpoint gets through.
    let db = h.db();
    let (busy, _, _): (i64, i64, i64) = db
        .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .expect("checkpoint");
    assert_eq!(busy, 0, "the paused catch-up blocked a checkpoint");
    // Another subscriber catches up the whole log meanwhile.
    let mut other = Client::connect(&changes_url(&h, 6, &w(VERSION), &w(VERSION))).await;
    let mut seen = Vec::new();
    while seen.last() != Some(&last) {
        let frame = other.frame().await;
        let id = frame.id().expect("an application frame");
        seen.extend(commits(&frame.into_messages()));
        other.ack(id).await;
    }
    assert_eq!(seen.len(), 120);
    drop(silent);
    h.stop().await;
}

/// A CA, and a server certificate and key for `localhost` written as PEM files into `dir`.
fn tls_files(dir: &Path) -> (CertificateDerOwned, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca =
        CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("key")).expect("ca");
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["localhost".to_owned()])
        .expect("params")
        .signed_by(&key, &ca)
        .expect("cert");
    let cert_path = dir.join("server.crt");
    let key_path = dir.join("server.key");
    std::fs::write(&cert_path, cert.pem()).expect("write cert");
    std::fs::write(&key_path, key.serialize_pem()).expect("write key");
    (ca.der().clone(), cert_path, key_path)
}

type CertificateDerOwned = rustls::pki_types::CertificateDer<'static>;

async fn tls_connect(
    addr: SocketAddr,
    ca: &CertificateDerOwned,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).expect("root");
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    tokio::time::timeout(PROMPT, connector.connect(name, tcp))
        .await
        .expect("handshake in time")
        .expect("TLS handshake")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_serves_a_wss_subscriber_and_an_https_snapshot() {
    let files = TempDir::new("tls-files");
    let (ca, cert, key) = tls_files(&files.0);
    let config = super::tls::server_config(&cert, &key).expect("a TLS config");
    let h = Harness::start_tls("tls", config).await;
    h.transaction(0x200, &[1, 2], true).await;
    wait_until(|| stored_last_watermark(&h.db()) == w(0x200).as_str()).await;

    // wss: the change stream, history then a live transaction.
    let tls = tls_connect(h.addr, &ca).await;
    let url = format!(
        "wss://localhost:{}/replication/v6/changes?id=sub&taskID=t&replicaVersion={}&watermark={}",
        h.addr.port(),
        w(VERSION),
        w(VERSION)
    );
    let (mut socket, _) = tokio::time::timeout(PROMPT, tokio_tungstenite::client_async(url, tls))
        .await
        .expect("upgrade in time")
        .expect("wss upgrade");
    let mut commits_seen = Vec::new();
    h.transaction(0x300, &[3], false).await;
    while commits_seen.len() < 2 {
        let message = tokio::time::timeout(PROMPT, socket.next())
            .await
            .expect("a frame in time")
            .expect("open")
            .expect("a message");
        let Message::Text(text) = message else {
            continue;
        };
        let frame = decode_downstream_frame(text.as_str()).expect("a valid frame");
        let id = frame.id().expect("an application frame");
        commits_seen.extend(commits(&frame.into_messages()));
        socket
            .send(Message::text(format!(r#"{{"ack":{id}}}"#)))
            .await
            .expect("ack");
    }
    assert_eq!(commits_seen, [w(0x200), w(0x300)]);

    // https: the replica snapshot.
    let mut tls = tls_connect(h.addr, &ca).await;
    tls.write_all(
        b"GET /replica/snapshot HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .await
    .expect("request");
    let mut raw = Vec::new();
    let read = tokio::time::timeout(PROMPT, tls.read_to_end(&mut raw))
        .await
        .expect("response in time");
    // Some peers end without close_notify; the response is complete either way.
    if let Err(error) = read {
        assert_eq!(error.kind(), std::io::ErrorKind::UnexpectedEof, "{error}");
    }
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("end of headers");
    assert!(
        raw.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&raw[..split])
    );
    assert!(raw[split + 4..].starts_with(b"SQLite format 3"));

    // Plain HTTP on the TLS port gets no answer it could use, and the server serves on.
    let plain = tokio::time::timeout(
        PROMPT,
        tokio_tungstenite::connect_async(h.url("/replication/v8/subscribe?taskID=x")),
    )
    .await
    .expect("an answer in time");
    assert!(plain.is_err());
    let mut again = tls_connect(h.addr, &ca).await;
    again
        .write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(PROMPT, again.read_to_end(&mut raw)).await;
    assert!(raw.starts_with(b"HTTP/1.1 200"));
    h.stop().await;
}

#[test]
fn tls_files_that_are_missing_or_not_pem_are_clear_errors() {
    let dir = TempDir::new("tls-bad");
    let (_, cert, key) = tls_files(&dir.0);
    let missing = dir.0.join("absent.pem");
    let error = super::tls::server_config(&missing, &key).expect_err("missing cert");
    assert!(error.to_string().contains("absent.pem"), "{error}");
    std::fs::write(dir.0.join("junk.pem"), "not pem").expect("write");
    let error = super::tls::server_config(&cert, &dir.0.join("junk.pem")).expect_err("junk key");
    assert!(error.to_string().contains("TLS key"), "{error}");
    // A key that does not belong to the certificate.
    let other = TempDir::new("tls-other");
    let (_, _, other_key) = tls_files(&other.0);
    let error = super::tls::server_config(&cert, &other_key).expect_err("mismatched key");
    assert!(error.to_string().contains("TLS key"), "{error}");
}

/// Every socket `serve` accepts carries `TCP_NODELAY`, plain and TLS alike: without it a
/// socket carrying a steady stream of small frames waits on the peer's delayed ACK (Nagle).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_sockets_have_tcp_nodelay_plain_and_tls() {
    use axum::serve::Listener as _;

    let plain = TcpListener::bind("127.0.0.1:0").await.expect("listen");
    let addr = plain.local_addr().expect("addr");
    let mut plain = super::plain_listener(plain);
    let _client = TcpStream::connect(addr).await.expect("connect");
    let (io, _) = tokio::time::timeout(PROMPT, plain.accept())
        .await
        .expect("accepted in time");
    assert!(io.nodelay().expect("read TCP_NODELAY"), "plain socket");

    let files = TempDir::new("tls-nodelay");
    let (ca, cert, key) = tls_files(&files.0);
    let config = super::tls::server_config(&cert, &key).expect("a TLS config");
    let tcp = TcpListener::bind("127.0.0.1:0").await.expect("listen");
    let addr = tcp.local_addr().expect("addr");
    let mut tls = super::tls::TlsListener::new(tcp, config).expect("TLS listener");
    let client = tokio::spawn(async move { tls_connect(addr, &ca).await });
    let (io, _) = tokio::time::timeout(PROMPT, tls.accept())
        .await
        .expect("accepted in time");
    assert!(
        io.get_ref().0.nodelay().expect("read TCP_NODELAY"),
        "TLS socket"
    );
    drop(client.await.expect("client"));
}
