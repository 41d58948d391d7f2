//! Scope sync end to end: a real Postgres, `highwater serve --sync-rules` (in this process or
//! the binary), and real WebSocket clients on `/sync` that apply what they receive and must end
//! equal to `SELECT … WHERE owner = …` in Postgres.

// Helpers outside #[test] functions count as non-test code for clippy; tests may unwrap.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use highwater_host::serve::ServeArgs;
use highwater_host::sync_auth::{mint_token, unix_now_ms, SyncSecret};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::serve_support::*;

const SECRET: &str = "a scope-sync test secret of more than 32 bytes";
const RULES: &str = r#"{"tables":{"todos":{"filterColumns":["owner","done"],"omitColumns":["secret_note"],"require":{"owner":"sub"}}}}"#;
const TODOS_DDL: &str = "CREATE TABLE todos (id int8 PRIMARY KEY, owner text, title text, done bool NOT NULL DEFAULT false, secret_note text)";

/// Rules and secret files for `serve --sync-rules`.
struct SyncFiles {
    _dir: DataDir,
    rules: PathBuf,
    secret: PathBuf,
}

impl SyncFiles {
    fn new() -> SyncFiles {
        SyncFiles::with_rules(RULES)
    }

    fn with_rules(rules_json: &str) -> SyncFiles {
        SyncFiles::with_rules_file("rules.json", rules_json)
    }

    /// Rules in a file of this name (`rules.yaml` for YAML).
    fn with_rules_file(name: &str, text: &str) -> SyncFiles {
        let dir = DataDir::new("sync-files");
        let rules = dir.path().join(name);
        let secret = dir.path().join("secret");
        std::fs::write(&rules, text).unwrap();
        std::fs::write(&secret, SECRET).unwrap();
        SyncFiles {
            _dir: dir,
            rules,
            secret,
        }
    }

    fn apply(&self, args: &mut ServeArgs) {
        args.sync_rules = Some(self.rules.clone());
        args.sync_secret.sync_secret_file = Some(self.secret.clone());
    }
}

fn token(sub: &str) -> String {
    let secret = SyncSecret::from_bytes(SECRET).unwrap();
    mint_token(&secret, sub, Duration::from_secs(3600), &[], unix_now_ms()).unwrap()
}

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// One scope as a client keeps it: rows by resourceId, and its cursor.
#[derive(Debug, Default, Clone)]
struct Scope {
    rows: BTreeMap<String, Value>,
    cursor: Option<(String, i64, String)>,
    subscribed: bool,
    /// Entries applied by the last replay (before `channel-subscribed`).
    replayed: usize,
    resets: usize,
    /// Every (resourceId, serverSequence) applied since the last reset: each change once.
    seen: std::collections::BTreeSet<(String, i64)>,
    /// Envelopes that moved rows in or out as access changed.
    moves: usize,
}

impl Scope {
    fn apply(&mut self, body: &Value) {
        if body.get("reset").is_some_and(|r| !r.is_null()) {
            self.rows.clear();
            self.cursor = None;
            self.resets += 1;
            self.seen.clear();
        }
        // A move: rows of values that left go first; the rows let in carry their own seqs
        // (one may come again after a move out), and only the envelope's cursor counts.
        let moves = body.get("moves").filter(|m| !m.is_null());
        if let Some(moves) = moves {
            self.moves += 1;
            for out in moves["out"].as_array().unwrap() {
                let column = out["column"].as_str().unwrap();
                let values: Vec<String> = out["values"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_string().trim_matches('"').to_owned())
                    .collect();
                self.rows.retain(|_, row| {
                    !values.contains(&row[column].to_string().trim_matches('"').to_owned())
                });
            }
            for entry in body["syncs"].as_array().unwrap() {
                let id = entry["resourceId"].as_str().unwrap().to_owned();
                assert_ne!(entry["syncType"], "delete", "a move sends rows in: {entry}");
                self.rows.insert(id, entry["data"].clone());
            }
        }
        for entry in body["syncs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|_| moves.is_none())
        {
            let id = entry["resourceId"].as_str().unwrap().to_owned();
            if entry["syncType"] == "delete" {
                self.rows.remove(&id);
            } else {
                assert!(
                    entry["data"].get("secret_note").is_none(),
                    "an omitted column was sent: {entry}"
                );
                self.rows.insert(id, entry["data"].clone());
            }
            let seq = entry["serverSequence"].as_i64().unwrap();
            assert!(
                self.seen.insert((id_of(entry), seq)),
                "a change arrived twice: {entry}"
            );
            if self.cursor.as_ref().is_none_or(|c| seq > c.1) {
                self.cursor = Some((
                    entry["id"].as_str().unwrap().to_owned(),
                    seq,
                    entry["updatedAt"].as_str().unwrap().to_owned(),
                ));
            }
            if !self.subscribed {
                self.replayed += 1;
            }
        }
        // A checkpoint: the scope is complete up to this feed position.
        if let Some(cursor) = body.get("cursor").filter(|c| !c.is_null()) {
            let seq = cursor["serverSequence"].as_i64().unwrap();
            if self.cursor.as_ref().is_none_or(|c| seq > c.1) {
                self.cursor = Some((
                    cursor["id"].as_str().unwrap().to_owned(),
                    seq,
                    cursor["updatedAt"].as_str().unwrap().to_owned(),
                ));
            }
        }
    }

    fn cursor_params(&self) -> Value {
        match &self.cursor {
            None => json!({}),
            Some((id, seq, at)) => {
                json!({"afterId": id, "afterServerSequence": seq, "afterUpdatedAt": at})
            }
        }
    }
}

fn id_of(entry: &Value) -> String {
    entry["resourceId"].as_str().unwrap().to_owned()
}

/// A `/sync` client with scopes by subscription id.
struct Client {
    socket: Socket,
    scopes: BTreeMap<String, Scope>,
    /// Every non-message frame received, in order.
    others: Vec<Value>,
    /// The `echoOrigin` of every channel message received, in order.
    echoes: Vec<Value>,
}

impl Client {
    async fn connect(addr: SocketAddr) -> Client {
        let (socket, _) = tokio_tungstenite::connect_async(format!("ws://{addr}/sync"))
            .await
            .expect("connect to /sync");
        let mut client = Client {
            socket,
            scopes: BTreeMap::new(),
            others: Vec::new(),
            echoes: Vec::new(),
        };
        let first = client.next().await.expect("a first frame");
        assert_eq!(first["type"], "session-established", "{first}");
        client
    }

    async fn send(&mut self, frame: Value) {
        self.socket
            .send(Message::Text(frame.to_string().into()))
            .await
            .unwrap();
    }

    async fn subscribe(&mut self, id: &str, owner: &str, token: Option<&str>, extra: Value) {
        let scope = self.scopes.entry(id.to_owned()).or_default();
        scope.subscribed = false;
        scope.replayed = 0;
        let mut params = json!({"resourceType": "todos", "conditions": {"owner": owner}});
        for (k, v) in scope.cursor_params().as_object().unwrap() {
            params[k] = v.clone();
        }
        if let Some(token) = token {
            params["authenticationToken"] = json!(token);
        }
        for (k, v) in extra.as_object().unwrap() {
            params[k] = v.clone();
        }
        self.send(json!({"type": "channel-subscribe", "subscriptionId": id, "channelType": "velocious-sync", "params": params})).await;
    }

    /// Subscribes `id` to `table` where `conditions`, with no token, from the scope's cursor.
    async fn subscribe_where(&mut self, id: &str, table: &str, conditions: &Value) {
        let scope = self.scopes.entry(id.to_owned()).or_default();
        scope.subscribed = false;
        let mut params = json!({"resourceType": table, "conditions": conditions});
        for (k, v) in scope.cursor_params().as_object().unwrap() {
            params[k] = v.clone();
        }
        self.send(json!({"type": "channel-subscribe", "subscriptionId": id, "channelType": "velocious-sync",
            "params": params}))
        .await;
    }

    /// The next frame, applied to its scope if it is a message; `None` on close or timeout.
    async fn next(&mut self) -> Option<Value> {
        loop {
            let message = tokio::time::timeout(PROMPT, self.socket.next())
                .await
                .ok()??;
            match message.ok()? {
                Message::Text(text) => {
                    let frame: Value = serde_json::from_str(text.as_str()).unwrap();
                    if let Some(id) = frame["subscriptionId"].as_str() {
                        if let Some(scope) = self.scopes.get_mut(id) {
                            match frame["type"].as_str() {
                                Some("channel-message") => scope.apply(&frame["body"]),
                                Some("channel-subscribed") => scope.subscribed = true,
                                _ => {}
                            }
                        }
                    }
                    if frame["type"] == "channel-message" {
                        self.echoes.push(frame["body"]["echoOrigin"].clone());
                    } else {
                        self.others.push(frame.clone());
                    }
                    return Some(frame);
                }
                Message::Close(frame) => {
                    self.others
                        .push(json!({"close": frame.map(|f| u16::from(f.code))}));
                    return None;
                }
                _ => {}
            }
        }
    }

    async fn until_subscribed(&mut self, id: &str) {
        while !self.scopes[id].subscribed {
            let frame = self.next().await;
            assert!(
                frame.is_some(),
                "the socket ended before {id} was subscribed"
            );
            if let Some(frame) = frame {
                assert_ne!(frame["type"], "channel-error", "{frame}");
            }
        }
    }

    /// The next frame that is not a channel message.
    async fn next_other(&mut self) -> Value {
        loop {
            let frame = self.next().await.expect("a frame");
            if frame["type"] != "channel-message" {
                return frame;
            }
        }
    }

    /// Reads until the scope equals `want` (or the wait runs out).
    async fn until_equal(&mut self, id: &str, want: &BTreeMap<String, Value>) {
        let deadline = tokio::time::Instant::now() + PROMPT;
        while &self.scopes[id].rows != want {
            assert!(
                tokio::time::Instant::now() < deadline,
                "scope {id} did not converge: {} rows, expected {}",
                self.scopes[id].rows.len(),
                want.len()
            );
            let _ = tokio::time::timeout(Duration::from_millis(200), self.next()).await;
        }
    }
}

/// `SELECT … WHERE owner = $1` as the client should hold it.
async fn pg_scope(pg: &tokio_postgres::Client, owner: &str) -> BTreeMap<String, Value> {
    pg.query(
        "SELECT id, owner, title, done FROM todos WHERE owner = $1",
        &[&owner],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| {
        let id: i64 = r.get(0);
        let owner: Option<String> = r.get(1);
        let title: Option<String> = r.get(2);
        let done: bool = r.get(3);
        (
            id.to_string(),
            json!({"id": id, "owner": owner, "title": title, "done": done}),
        )
    })
    .collect()
}

/// Waits until the replica in `data` holds exactly Postgres's `todos` (so a subscribe sees
/// everything by replay, not partly live).
async fn replica_caught_up(pg: &tokio_postgres::Client, data: &Path) {
    let want: Vec<(i64, Option<String>, Option<String>)> = pg
        .query("SELECT id, owner, title FROM todos ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let deadline = tokio::time::Instant::now() + PROMPT;
    loop {
        let db = rusqlite::Connection::open_with_flags(
            data.join("replica.db"),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .unwrap();
        db.busy_timeout(Duration::from_secs(5)).unwrap();
        let got: Vec<(i64, Option<String>, Option<String>)> = db
            .prepare("SELECT id, owner, title FROM todos ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        if got == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn start_server(pg_url: &str, data: &Path, files: &SyncFiles) -> InProcess {
    let mut args = serve_args(pg_url, data, free_port());
    files.apply(&mut args);
    InProcess::start(args).await
}

/// [`start_server`] with group commit.
async fn start_grouping_server(pg_url: &str, data: &Path, files: &SyncFiles) -> InProcess {
    let mut args = serve_args(pg_url, data, free_port());
    files.apply(&mut args);
    args.group_commit = true;
    InProcess::start(args).await
}

/// A thousand writes of every kind to ada's and grace's rows, with owner changes moving rows
/// in and out of both scopes; with `truncate`, a truncate near the end.
async fn churn(pg: &tokio_postgres::Client, base: i64, truncate: bool) {
    let owners = ["ada", "grace"];
    for i in 0..1000_i64 {
        let id = base + i % 40;
        let owner = owners[(i % 3 % 2) as usize];
        let sql = match i % 5 {
            0 | 1 => format!("INSERT INTO todos (id, owner, title) VALUES ({id}, '{owner}', 't{i}') ON CONFLICT (id) DO UPDATE SET title = excluded.title"),
            2 => format!("UPDATE todos SET owner = CASE owner WHEN 'ada' THEN 'grace' ELSE 'ada' END WHERE id = {id}"),
            3 => format!("UPDATE todos SET done = NOT done, secret_note = 's{i}' WHERE id = {id}"),
            _ => format!("DELETE FROM todos WHERE id = {id}"),
        };
        if truncate && i == 990 {
            pg.batch_execute("TRUNCATE todos").await.unwrap();
        }
        pg.batch_execute(&sql).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scope_sync_replays_routes_live_resumes_and_refuses_with_typed_errors() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    for i in 1..=7_i64 {
        let owner = if i % 3 == 0 { "grace" } else { "ada" };
        db.execute(
            "INSERT INTO todos (id, owner, title, secret_note) VALUES ($1, $2, $3, 'hidden')",
            &[&i, &owner, &format!("t{i}")],
        )
        .await
        .unwrap();
    }
    let files = SyncFiles::new();
    let data = DataDir::new("scope-sync");
    let server = start_server(&pg.url(), data.path(), &files).await;
    let ada = token("ada");

    // Fresh subscribe, pages of 2: the whole scope in seq order, then channel-subscribed.
    let mut client = Client::connect(server.addr).await;
    client
        .subscribe("s1", "ada", Some(&ada), json!({"limit": 2}))
        .await;
    let mut seqs = Vec::new();
    let mut pages = 0;
    loop {
        let frame = client.next().await.expect("replay frames");
        match frame["type"].as_str().unwrap() {
            "channel-message" => {
                pages += 1;
                assert!(frame["body"]["progress"]["total"] == json!(5), "{frame}");
                for entry in frame["body"]["syncs"].as_array().unwrap() {
                    seqs.push(entry["serverSequence"].as_i64().unwrap());
                    assert_eq!(entry["owner"], "ada");
                    assert!(entry["id"].as_str().unwrap().contains(':'), "epoch:seq id");
                }
            }
            "channel-subscribed" => break,
            other => panic!("unexpected {other}: {frame}"),
        }
    }
    assert_eq!(pages, 3, "5 rows in pages of 2");
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "seq order: {seqs:?}");
    assert_eq!(client.scopes["s1"].rows, pg_scope(&db, "ada").await);

    // Live: ada's row arrives, grace's does not; a move out is a delete for ada.
    db.batch_execute(
        "INSERT INTO todos (id, owner, title) VALUES (100, 'grace', 'g'), (101, 'ada', 'a')",
    )
    .await
    .unwrap();
    db.batch_execute("UPDATE todos SET owner = 'grace' WHERE id = 1")
        .await
        .unwrap();
    client.until_equal("s1", &pg_scope(&db, "ada").await).await;
    assert!(!client.scopes["s1"].rows.contains_key("100"));

    // Refusals on the same socket: typed, nothing delivered, the socket stays usable.
    let tampered = {
        let mut t = token("ada");
        let last = t.pop().unwrap();
        t.push(if last == 'A' { 'B' } else { 'A' });
        t
    };
    let expired = mint_token(
        &SyncSecret::from_bytes(SECRET).unwrap(),
        "ada",
        Duration::from_secs(1),
        &[],
        unix_now_ms() - 3_600_000,
    )
    .unwrap();
    let cases: Vec<(&str, Option<String>, Value, &str)> = vec![
        ("e1", None, json!({}), "auth-required"),
        ("e2", Some(token("grace")), json!({}), "forbidden"),
        ("e3", Some(tampered), json!({}), "auth-invalid"),
        ("e4", Some(expired), json!({}), "auth-expired"),
        (
            "e5",
            Some(ada.clone()),
            json!({"conditions": {"owner": "ada", "title": "t1"}}),
            "forbidden",
        ),
        (
            "e6",
            Some(ada.clone()),
            json!({"limit": "abc"}),
            "invalid-params",
        ),
        ("s1", Some(ada.clone()), json!({}), "subscription-in-use"),
    ];
    for (id, token, extra, code) in cases {
        client.subscribe(id, "ada", token.as_deref(), extra).await;
        let frame = client.next_other().await;
        assert_eq!(frame["type"], "channel-error", "{id}: {frame}");
        assert_eq!(frame["code"], code, "{id}: {frame}");
        assert_eq!(frame["subscriptionId"], id);
        if id != "s1" {
            assert!(client.scopes[id].rows.is_empty());
        }
    }
    client
        .send(json!({"type": "channel-subscribe", "channelType": "chat"}))
        .await;
    assert_eq!(client.next_other().await["code"], "bad-frame");
    client
        .socket
        .send(Message::Text("{not json".into()))
        .await
        .unwrap();
    assert_eq!(client.next_other().await["code"], "bad-frame");
    client.send(json!({"type": "channel-subscribe", "subscriptionId": "c1", "channelType": "chat", "params": {}})).await;
    assert_eq!(client.next_other().await["code"], "unknown-channel");
    client.send(json!({"type": "ping"})).await;
    assert_eq!(client.next_other().await, json!({"type": "pong"}));

    // An oversized frame closes that socket with 1009; the server stays healthy.
    let mut big = Client::connect(server.addr).await;
    let huge = "x".repeat(1_100_000);
    let _ = big.socket.send(Message::Text(huge.into())).await;
    while big.next().await.is_some() {}
    assert_eq!(
        big.others.last(),
        Some(&json!({"close": 1009})),
        "{:?}",
        big.others
    );
    db.batch_execute("INSERT INTO todos (id, owner, title) VALUES (102, 'ada', 'after')")
        .await
        .unwrap();
    client.until_equal("s1", &pg_scope(&db, "ada").await).await;

    // Unsubscribe and subscribe again without reconnecting: only rows after the cursor.
    client
        .send(json!({"type": "channel-unsubscribe", "subscriptionId": "s1"}))
        .await;
    assert_eq!(client.next_other().await["type"], "channel-unsubscribed");
    client.subscribe("s1", "ada", Some(&ada), json!({})).await;
    client.until_subscribed("s1").await;
    assert_eq!(
        client.scopes["s1"].replayed, 0,
        "nothing newer than the cursor"
    );

    // Disconnected through a thousand writes of every kind, then resumed from the cursor.
    let scope = client.scopes["s1"].clone();
    drop(client);
    churn(&db, 200, false).await;
    replica_caught_up(&db, data.path()).await;
    let mut client = Client::connect(server.addr).await;
    client.scopes.insert("s1".into(), scope.clone());
    client
        .subscribe("s1", "ada", Some(&ada), json!({"limit": 50}))
        .await;
    client.until_subscribed("s1").await;
    client.until_equal("s1", &pg_scope(&db, "ada").await).await;
    assert!(client.scopes["s1"].cursor.as_ref().unwrap().1 > scope.cursor.as_ref().unwrap().1);
    assert_eq!(
        client.scopes["s1"].resets, 0,
        "deletes and moves out replay as removals"
    );

    // The same with a truncate in the middle: the older cursor gets a reset and a full replay.
    let scope = client.scopes["s1"].clone();
    drop(client);
    churn(&db, 300, true).await;
    replica_caught_up(&db, data.path()).await;
    let mut client = Client::connect(server.addr).await;
    client.scopes.insert("s1".into(), scope);
    client
        .subscribe("s1", "ada", Some(&ada), json!({"limit": 50}))
        .await;
    client.until_subscribed("s1").await;
    let want = pg_scope(&db, "ada").await;
    client.until_equal("s1", &want).await;
    assert_eq!(
        client.scopes["s1"].resets, 1,
        "the truncate resets the older cursor"
    );

    // A second resume right after: nothing to replay.
    let scope = client.scopes["s1"].clone();
    drop(client);
    let mut client = Client::connect(server.addr).await;
    client.scopes.insert("s1".into(), scope);
    client.subscribe("s1", "ada", Some(&ada), json!({})).await;
    client.until_subscribed("s1").await;
    assert_eq!(client.scopes["s1"].replayed, 0);
    assert_eq!(client.scopes["s1"].rows, want);

    // Rows written while a fresh replay runs in pages of one: above the pin they arrive live,
    // each change once (the client asserts it), and the scope ends equal.
    let writer = {
        let url = pg.url();
        tokio::spawn(async move {
            let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            insert_ada(&db, 1000..1030).await;
        })
    };
    client
        .subscribe("r1", "ada", Some(&ada), json!({"limit": 1}))
        .await;
    client.until_subscribed("r1").await;
    writer.await.unwrap();
    client.until_equal("r1", &pg_scope(&db, "ada").await).await;
    server.stop().await;
}

/// `highwater serve --sync-rules …` as a process, so it can be killed with -9.
fn spawn_primary(url: &str, data: &Path, port: u16, files: &SyncFiles, app_id: &str) -> Binary {
    let child = Command::new(env!("CARGO_BIN_EXE_highwater"))
        .arg("serve")
        .args(["--upstream", url, "--app-id", app_id])
        .arg("--data")
        .arg(data)
        .args(["--port", &port.to_string(), "--host", "127.0.0.1"])
        .arg("--sync-rules")
        .arg(&files.rules)
        .arg("--sync-secret-file")
        .arg(&files.secret)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn highwater serve");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    Binary { child, addr }
}

async fn insert_ada(db: &tokio_postgres::Client, ids: std::ops::Range<i64>) {
    for id in ids {
        db.execute(
            "INSERT INTO todos (id, owner, title) VALUES ($1, 'ada', $2)",
            &[&id, &format!("t{id}")],
        )
        .await
        .unwrap();
    }
}

/// Subscribes a fresh socket to ada's scope from `scope`'s cursor; returns the client once
/// caught up.
async fn resume(addr: SocketAddr, scope: &Scope) -> Client {
    let mut client = Client::connect(addr).await;
    client.scopes.insert("s1".into(), scope.clone());
    client
        .subscribe("s1", "ada", Some(&token("ada")), json!({}))
        .await;
    client.until_subscribed("s1").await;
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursors_are_portable_across_relays_survive_kill_9_and_reset_on_a_new_replica() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    insert_ada(&db, 1..6).await;
    let files = SyncFiles::new();
    let primary_data = DataDir::new("sync-primary");
    let port = free_port();
    let primary = spawn_primary(&pg.url(), primary_data.path(), port, &files, "highwater");
    wait_ready(primary.addr).await;
    let relay_data = DataDir::new("sync-relay");
    let mut relay_args = ServeArgs::relay(format!("ws://{}", primary.addr), relay_data.path());
    relay_args.port = free_port();
    relay_args.host = "127.0.0.1".to_owned();
    files.apply(&mut relay_args);
    let relay = InProcess::start(relay_args).await;

    // Subscribe on the relay, then present its cursor to the primary: nothing to replay.
    replica_caught_up(&db, relay_data.path()).await;
    let client = resume(relay.addr, &Scope::default()).await;
    let on_relay = client.scopes["s1"].clone();
    assert_eq!(on_relay.rows, pg_scope(&db, "ada").await);
    drop(client);
    let client = resume(primary.addr, &on_relay).await;
    assert_eq!(client.scopes["s1"].replayed, 0, "nothing twice");
    assert_eq!(client.scopes["s1"].resets, 0);
    drop(client);

    // Ten more rows; a primary cursor from before them, presented to the relay, replays
    // exactly those ten.
    insert_ada(&db, 6..16).await;
    replica_caught_up(&db, primary_data.path()).await;
    replica_caught_up(&db, relay_data.path()).await;
    let client = resume(relay.addr, &on_relay).await;
    assert_eq!(
        client.scopes["s1"].replayed, 10,
        "nothing missing, nothing twice"
    );
    assert_eq!(client.scopes["s1"].rows, pg_scope(&db, "ada").await);
    let from_relay = client.scopes["s1"].clone();
    drop(client);
    let client = resume(primary.addr, &from_relay).await;
    assert_eq!(client.scopes["s1"].replayed, 0);
    drop(client);

    // kill -9 of the primary in the middle of a stream of writes; restart, resume, equal.
    let mut live = resume(primary.addr, &from_relay).await;
    let writer = {
        let url = pg.url();
        tokio::spawn(async move {
            let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(conn);
            insert_ada(&db, 100..300).await;
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    primary.kill9();
    while live.next().await.is_some() {}
    let scope = live.scopes["s1"].clone();
    writer.await.unwrap();
    let primary = spawn_primary(&pg.url(), primary_data.path(), port, &files, "highwater");
    wait_ready(primary.addr).await;
    replica_caught_up(&db, primary_data.path()).await;
    let client = resume(primary.addr, &scope).await;
    assert_eq!(client.scopes["s1"].resets, 0);
    assert_eq!(client.scopes["s1"].rows, pg_scope(&db, "ada").await);
    drop(client);
    // The relay follows the restarted primary; its cursors stay valid there too.
    replica_caught_up(&db, relay_data.path()).await;
    let client = resume(relay.addr, &scope).await;
    assert_eq!(client.scopes["s1"].rows, pg_scope(&db, "ada").await);
    drop(client);

    // A new replica (new data directory, new slot): another epoch, so a reset and a full replay.
    let fresh_data = DataDir::new("sync-fresh");
    let fresh = spawn_primary(&pg.url(), fresh_data.path(), free_port(), &files, "fresh");
    wait_ready(fresh.addr).await;
    let client = resume(fresh.addr, &scope).await;
    assert_eq!(client.scopes["s1"].resets, 1);
    assert_eq!(client.scopes["s1"].rows, pg_scope(&db, "ada").await);
    drop(client);
    relay.stop().await;
    primary.kill9();
    fresh.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_subscribers_each_to_its_own_scope_all_end_equal() {
    const N: usize = 1000;
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    let files = SyncFiles::new();
    let data = DataDir::new("sync-many");
    let server = start_server(&pg.url(), data.path(), &files).await;
    let mut clients = Vec::with_capacity(N);
    for i in 0..N {
        let mut client = Client::connect(server.addr).await;
        let owner = format!("u{i}");
        client
            .subscribe("s", &owner, Some(&token(&owner)), json!({}))
            .await;
        clients.push(client);
    }
    for client in &mut clients {
        client.until_subscribed("s").await;
    }
    // Two rows per owner, in transactions of a hundred rows each.
    for batch in 0..(2 * N / 100) {
        let values: Vec<String> = (0..100)
            .map(|k| {
                let n = batch * 100 + k;
                format!("({n}, 'u{}', 't{n}')", n % N)
            })
            .collect();
        db.batch_execute(&format!(
            "INSERT INTO todos (id, owner, title) VALUES {}",
            values.join(", ")
        ))
        .await
        .unwrap();
    }
    for (i, client) in clients.iter_mut().enumerate() {
        let want = pg_scope(&db, &format!("u{i}")).await;
        assert_eq!(want.len(), 2);
        client.until_equal("s", &want).await;
    }
    let health = health(server.addr).await;
    assert_eq!(health["syncConnections"], json!(N));
    drop(clients);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_keep_up_is_closed_with_1013_and_the_server_stays_healthy() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    let files = SyncFiles::new();
    let data = DataDir::new("sync-slow");
    let mut args = serve_args(&pg.url(), data.path(), free_port());
    files.apply(&mut args);
    args.sync_slow_consumer_ms = 1_000;
    let server = InProcess::start(args).await;
    let mut slow = Client::connect(server.addr).await;
    slow.subscribe("s1", "ada", Some(&token("ada")), json!({}))
        .await;
    slow.until_subscribed("s1").await;
    // A megabyte per row, far more than the socket's budget, while the client reads nothing.
    for id in 0..40_i64 {
        db.execute(
            "INSERT INTO todos (id, owner, title) VALUES ($1, 'ada', repeat('x', 1000000))",
            &[&id],
        )
        .await
        .unwrap();
    }
    // The server drops it instead of buffering for it (its socket is still open on this side).
    let deadline = tokio::time::Instant::now() + PROMPT;
    while health(server.addr).await["syncConnections"] != json!(0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slow client was never closed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Draining what reached it ends the socket: with close code 1013 when the close frame got
    // through behind the data, else by the connection ending.
    while slow.next().await.is_some() {}
    let last = slow.others.last().cloned().unwrap_or(Value::Null);
    if last.get("close").is_some_and(|code| !code.is_null()) {
        assert_eq!(last, json!({"close": 1013}));
    }
    // Healthy: a new client catches up on the same rows.
    let mut client = Client::connect(server.addr).await;
    client
        .subscribe("s1", "ada", Some(&token("ada")), json!({"limit": 5}))
        .await;
    client.until_subscribed("s1").await;
    client.until_equal("s1", &pg_scope(&db, "ada").await).await;
    assert_eq!(client.scopes["s1"].rows.len(), 40);
    server.stop().await;
}

/// Reads until the scope equals `want`; `false` once `by` passes first.
async fn equal_by(
    client: &mut Client,
    id: &str,
    want: &BTreeMap<String, Value>,
    by: tokio::time::Instant,
) -> bool {
    while &client.scopes[id].rows != want {
        let left = by.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        let _ = tokio::time::timeout(left, client.next()).await;
    }
    true
}

/// Group commit: queued small transactions share one SQLite commit, and nothing of a group
/// reaches scope clients before it is durable. The last transaction of a burst must still
/// reach a `/sync` client — one subscribed all along and one that subscribes while the burst
/// is stored — and a change-stream subscriber within a second, with no further upstream
/// traffic to push the open group out (an open group that waited for the next upstream event
/// held them back until Postgres' next keepalive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_of_a_burst_of_small_transactions_reaches_scope_clients_and_subscribers_within_a_second(
) {
    let pg = start_pg().await;
    let db = Arc::new(pg.connect().await.unwrap());
    db.batch_execute(TODOS_DDL).await.unwrap();
    let files = SyncFiles::new();
    let data = DataDir::new("scope-sync-burst");
    let server = start_grouping_server(&pg.url(), data.path(), &files).await;
    let rv = replica_version(server.addr).await;
    let mut live = Subscriber::connect(server.addr, &changes_path(6, &rv, &rv)).await;
    let mut steady = Client::connect(server.addr).await;
    steady
        .subscribe("a", "ada", Some(&token("ada")), json!({}))
        .await;
    steady.until_subscribed("a").await;

    let mut transactions = 0;
    for round in 0..4_i64 {
        // Single-row transactions committed in one round trip (one implicit transaction
        // without the BEGIN/COMMIT): they queue up.
        let sql: String = (0..300_i64)
            .map(|i| {
                let id = round * 1000 + i;
                format!(
                    "BEGIN; INSERT INTO todos (id, owner, title) VALUES ({id}, 'ada', 't{i}'); COMMIT;"
                )
            })
            .collect();
        let writer = db.clone();
        let burst = tokio::spawn(async move { writer.batch_execute(&sql).await.unwrap() });
        // A client that subscribes while the burst is being stored.
        let mut joining = Client::connect(server.addr).await;
        joining
            .subscribe("j", "ada", Some(&token("ada")), json!({}))
            .await;
        burst.await.unwrap();
        transactions += 300;
        let want = pg_scope(&db, "ada").await;
        let by = tokio::time::Instant::now() + Duration::from_secs(1);
        assert!(
            equal_by(&mut steady, "a", &want, by).await,
            "round {round}: the subscribed client holds {} of {} rows a second after the burst",
            steady.scopes["a"].rows.len(),
            want.len()
        );
        assert!(
            equal_by(&mut joining, "j", &want, by).await,
            "round {round}: the client that joined holds {} of {} rows a second after the burst",
            joining.scopes["j"].rows.len(),
            want.len()
        );
        assert!(
            live.follow(by, |m| m.commits.len() == transactions).await,
            "round {round}: the change stream has {} of {transactions} transactions a second after the burst",
            live.model.commits.len()
        );
    }
    assert_eq!(live.model.rollbacks, 0);
    let health = health(server.addr).await;
    let commits = health["storeCommits"].as_u64().unwrap();
    let stored = health["storedTransactions"].as_u64().unwrap();
    assert!(stored >= 1200, "{health}");
    assert!(
        commits < stored,
        "no two transactions shared a commit: {health}"
    );
    server.stop().await;
}

/// Group commit, as the client end-to-end suite exercises it: bursts of a hundred single-row
/// transactions of every kind (inserts, owner changes moving rows between scopes, updates,
/// deletes) while a `/sync` client's socket is cut and it resumes from its cursor. After each
/// burst its scope must equal Postgres within a second, with no further upstream traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_resuming_during_bursts_of_grouped_transactions_is_equal_within_a_second() {
    let pg = start_pg().await;
    let db = Arc::new(pg.connect().await.unwrap());
    db.batch_execute(TODOS_DDL).await.unwrap();
    let files = SyncFiles::new();
    let data = DataDir::new("scope-sync-resume-burst");
    let server = start_grouping_server(&pg.url(), data.path(), &files).await;
    let mut client = Client::connect(server.addr).await;
    client
        .subscribe("a", "ada", Some(&token("ada")), json!({}))
        .await;
    client.until_subscribed("a").await;
    for batch in 0..10_i64 {
        let sql: String = (batch * 100..batch * 100 + 100)
            .map(|i| {
                let id = 2000 + i % 50;
                let owner = if i % 3 == 0 { "grace" } else { "ada" };
                let statement = match i % 4 {
                    0 => format!("INSERT INTO todos (id, owner, title) VALUES ({id}, '{owner}', 't{i}') ON CONFLICT (id) DO UPDATE SET title = excluded.title"),
                    1 => format!("UPDATE todos SET owner = CASE owner WHEN 'ada' THEN 'grace' ELSE 'ada' END WHERE id = {id}"),
                    2 => format!("UPDATE todos SET done = NOT done, secret_note = 's{i}' WHERE id = {id}"),
                    _ => format!("DELETE FROM todos WHERE id = {id}"),
                };
                format!("BEGIN; {statement}; COMMIT;")
            })
            .collect();
        let writer = db.clone();
        let burst = tokio::spawn(async move { writer.batch_execute(&sql).await.unwrap() });
        if batch % 2 == 0 {
            // The socket cut while the burst is stored; the client resumes from its cursor.
            tokio::time::sleep(Duration::from_millis(20)).await;
            let scopes = std::mem::take(&mut client.scopes);
            drop(client);
            client = Client::connect(server.addr).await;
            client.scopes = scopes;
            client
                .subscribe("a", "ada", Some(&token("ada")), json!({}))
                .await;
        }
        burst.await.unwrap();
        let want = pg_scope(&db, "ada").await;
        let by = tokio::time::Instant::now() + Duration::from_secs(1);
        assert!(
            equal_by(&mut client, "a", &want, by).await,
            "batch {batch}: the client holds {} rows, Postgres {}, a second after the burst",
            client.scopes["a"].rows.len(),
            want.len()
        );
    }
    server.stop().await;
}

/// The replica's retention floor (`_hw_feed_state`), and the newest seq of `owner`'s rows.
fn floor_and_newest(data: &Path, owner: &str) -> (Option<i64>, i64) {
    let db = rusqlite::Connection::open_with_flags(
        data.join("replica.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    let floor = db
        .query_row(r#"SELECT "floor" FROM "_hw_feed_state""#, [], |r| r.get(0))
        .ok();
    let newest = db
        .query_row(
            r#"SELECT max("_hw_seq") FROM todos WHERE owner = ?1"#,
            [owner],
            |r| r.get(0),
        )
        .unwrap();
    (floor, newest)
}

/// Resumes `scope` on a fresh socket and checks the answer: no reset, exactly `replayed`
/// entries, rows equal to Postgres.
async fn resumes_with(
    addr: SocketAddr,
    scope: &Scope,
    db: &tokio_postgres::Client,
    replayed: usize,
    when: &str,
) -> Scope {
    let client = resume(addr, scope).await;
    let got = client.scopes["s1"].clone();
    assert_eq!(got.resets, 0, "{when}: a reset");
    assert_eq!(got.replayed, replayed, "{when}: entries replayed");
    assert_eq!(got.rows, pg_scope(db, "ada").await, "{when}: rows");
    got
}

/// On a database that already had rows, a client's cursor after a fresh subscribe is the
/// replay's high-water, not its scope's newest row: resuming it never resets (the first
/// start's retention floor is the last seq the initial sync copied), after an idle
/// disconnect, one edited row, a restart, on a relay, and across a retention prune while it
/// was connected (live checkpoints move it with the feed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_on_a_database_that_already_had_rows_replay_only_what_changed() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    db.batch_execute(
        "INSERT INTO todos (id, owner, title) SELECT i, (ARRAY['linus', 'ada', 'grace'])[i % 3 + 1], 't' || i FROM generate_series(1, 300) AS i",
    )
    .await
    .unwrap();
    let files = SyncFiles::new();
    let data = DataDir::new("sync-resume-rows");
    let mut args = serve_args(&pg.url(), data.path(), free_port());
    files.apply(&mut args);
    args.sync_retention_secs = 1;
    args.sync_checkpoint_ms = 100;
    let server = InProcess::start(args.clone()).await;
    replica_caught_up(&db, data.path()).await;
    let (floor, newest) = floor_and_newest(data.path(), "ada");
    assert!(
        floor.is_some_and(|floor| floor > newest),
        "ada's newest row ({newest}) is below the first start's floor ({floor:?}): the case"
    );

    // A fresh subscribe: the whole scope, and a cursor at the replay's high-water.
    let client = resume(server.addr, &Scope::default()).await;
    let fresh = client.scopes["s1"].clone();
    assert_eq!(fresh.replayed, 100);
    assert!(fresh.cursor.as_ref().unwrap().1 >= floor.unwrap());
    drop(client);
    let idle = resumes_with(server.addr, &fresh, &db, 0, "an idle disconnect").await;

    // One of ada's rows edited while disconnected: that row alone.
    db.batch_execute("UPDATE todos SET title = 'edited' WHERE id = 4")
        .await
        .unwrap();
    replica_caught_up(&db, data.path()).await;
    let edited = resumes_with(server.addr, &idle, &db, 1, "one edited row").await;

    // A restart: nothing to replay.
    server.stop().await;
    let server = InProcess::start(args.clone()).await;
    let restarted = resumes_with(server.addr, &edited, &db, 0, "after a restart").await;

    // A relay restored from the primary's snapshot takes the same cursor.
    let relay_data = DataDir::new("sync-resume-relay");
    let mut relay_args = ServeArgs::relay(format!("ws://{}", server.addr), relay_data.path());
    relay_args.port = free_port();
    files.apply(&mut relay_args);
    let relay = InProcess::start(relay_args).await;
    replica_caught_up(&db, relay_data.path()).await;
    resumes_with(relay.addr, &restarted, &db, 0, "on a relay").await;
    relay.stop().await;

    // Connected while grace's rows move to linus (exits, seqs above ada's cursor), until a
    // checkpoint tells it the feed's position; then those exits age past the retention
    // window and a restart prunes them (the first group commit of a start prunes).
    let mut live = resume(server.addr, &restarted).await;
    db.batch_execute("UPDATE todos SET owner = 'linus' WHERE id IN (2, 5, 8)")
        .await
        .unwrap();
    replica_caught_up(&db, data.path()).await;
    let (_, moved) = floor_and_newest(data.path(), "linus");
    let deadline = tokio::time::Instant::now() + PROMPT;
    while live.scopes["s1"].cursor.as_ref().unwrap().1 < moved {
        assert!(tokio::time::Instant::now() < deadline, "no checkpoint");
        let _ = tokio::time::timeout(Duration::from_millis(200), live.next()).await;
    }
    assert_eq!(live.scopes["s1"].replayed, 0);
    let checkpointed = live.scopes["s1"].clone();
    drop(live);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    server.stop().await;
    let server = InProcess::start(args.clone()).await;
    db.batch_execute("INSERT INTO todos (id, owner, title) VALUES (1000, 'linus', 'prune')")
        .await
        .unwrap();
    replica_caught_up(&db, data.path()).await;
    let deadline = tokio::time::Instant::now() + PROMPT;
    while floor_and_newest(data.path(), "ada").0 < Some(moved) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the exits were not pruned"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    resumes_with(server.addr, &checkpointed, &db, 0, "after a prune").await;
    // The cursor from before the checkpoint is below the floor now: that one resets.
    let client = resume(server.addr, &restarted).await;
    assert_eq!(
        client.scopes["s1"].resets, 1,
        "a cursor older than the pruned exits"
    );
    assert_eq!(client.scopes["s1"].rows, pg_scope(&db, "ada").await);
    drop(client);
    server.stop().await;
}

/// A small deterministic generator (xorshift64*), so a failing case can be replayed by seed.
/// `HIGHWATER_TEST_SEED` if set (to replay a failure), else the test's own seed.
fn test_seed(default: u64) -> u64 {
    std::env::var("HIGHWATER_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }
}

const TASKS_DDL: &str = "CREATE TABLE tasks (id int8 PRIMARY KEY, n int4, f float8, t text, b bool, at timestamptz, owner text)";
const TASKS_RULES: &str =
    r#"{"tables":{"tasks":{"filterColumns":["n","f","t","b","at","owner"]}}}"#;

/// Values of each column, NULL included: negatives, the int4 extremes, non-ASCII text and
/// digits as text, instants with whole milliseconds.
fn column_values(column: &str) -> Vec<Value> {
    match column {
        "n" => json!([null, -3, -1, 0, 1, 2, 3, 2147483647, -2147483648]),
        "f" => json!([null, -1.5, 0.0, 0.25, 2.5, 1e10]),
        "t" => json!([null, "", "a", "B", "é", "😀", "Zoë", "10", "9"]),
        "b" => json!([null, true, false]),
        "at" => json!([
            null,
            "2026-01-01T00:00:00.000Z",
            "2026-06-30T23:59:59.999Z",
            "1999-12-31T23:00:00.000Z"
        ]),
        _ => json!([null, "ada", "grace"]),
    }
    .as_array()
    .unwrap()
    .clone()
}

/// A value as a Postgres literal of its column's type.
fn pg_literal(column: &str, value: &Value) -> String {
    match value {
        Value::Null => "NULL".to_owned(),
        Value::String(text) if column == "at" => format!("'{text}'::timestamptz"),
        Value::String(text) => format!("'{}'", text.replace('\'', "''")),
        // A numeric operand of the timestamp column is its Unix milliseconds.
        Value::Number(ms) if column == "at" => format!("to_timestamp({ms} / 1000.0)"),
        other => other.to_string(),
    }
}

/// A random condition on `column` as subscribe conditions and as the Postgres predicate the
/// rules say it means (text compared by code point: `COLLATE "C"`).
fn random_condition(g: &mut Gen, column: &str) -> (Value, String) {
    let values: Vec<Value> = column_values(column)
        .into_iter()
        .filter(|v| !v.is_null())
        .collect();
    let mut operand = g.pick(&values);
    // Other spellings of the same operand: a number as a numeric string, an instant as ms.
    if g.below(4) == 0 {
        if let (Some(n), "n") = (operand.as_i64(), column) {
            operand = json!(n.to_string());
        }
        if let (Some(text), "at") = (operand.as_str(), column) {
            let ms = highwater_engine::scope_sync::cursor::SyncCursor::legacy(text.to_owned())
                .updated_at_ms()
                .unwrap();
            operand = json!(ms);
        }
    }
    let lhs = if column == "t" || column == "owner" {
        format!("{column} COLLATE \"C\"")
    } else {
        column.to_owned()
    };
    let pg_operand = |v: &Value| match (column, v) {
        ("n", Value::String(text)) => text.clone(),
        _ => pg_literal(column, v),
    };
    let list = |g: &mut Gen| -> Vec<Value> {
        let n = g.below(4);
        (0..n).map(|_| g.pick(&values)).collect()
    };
    match g.below(10) {
        0 => (operand.clone(), format!("{lhs} = {}", pg_operand(&operand))),
        1 => (
            json!({"ne": operand}),
            format!("{lhs} <> {}", pg_operand(&operand)),
        ),
        2 => (
            json!({"lt": operand}),
            format!("{lhs} < {}", pg_operand(&operand)),
        ),
        3 => (
            json!({"lte": operand}),
            format!("{lhs} <= {}", pg_operand(&operand)),
        ),
        4 => (
            json!({"gt": operand}),
            format!("{lhs} > {}", pg_operand(&operand)),
        ),
        5 => (
            json!({"gte": operand}),
            format!("{lhs} >= {}", pg_operand(&operand)),
        ),
        6 => {
            let items = list(g);
            let sql = if items.is_empty() {
                "false".to_owned()
            } else {
                let items: Vec<String> = items.iter().map(pg_operand).collect();
                format!("{lhs} IN ({})", items.join(", "))
            };
            (json!(items), sql)
        }
        7 => {
            let items = list(g);
            // With no values, every non-NULL value passes (NULL passes no comparison).
            let sql = if items.is_empty() {
                format!("{column} IS NOT NULL")
            } else {
                let items: Vec<String> = items.iter().map(pg_operand).collect();
                format!("{lhs} NOT IN ({})", items.join(", "))
            };
            (json!({"notIn": items}), sql)
        }
        8 => {
            let is_null = g.below(2) == 0;
            let sql = format!("{column} IS {}NULL", if is_null { "" } else { "NOT " });
            (json!({ "isNull": is_null }), sql)
        }
        _ => {
            let high = g.pick(&values);
            (
                json!({"gte": operand, "lt": high}),
                format!(
                    "{lhs} >= {} AND {lhs} < {}",
                    pg_operand(&operand),
                    pg_operand(&high)
                ),
            )
        }
    }
}

/// The ids Postgres finds in `table` `WHERE predicate`.
async fn pg_ids(
    db: &tokio_postgres::Client,
    table: &str,
    predicate: &str,
) -> std::collections::BTreeSet<String> {
    db.query(&format!("SELECT id FROM {table} WHERE {predicate}"), &[])
        .await
        .unwrap_or_else(|e| panic!("{predicate}: {e}"))
        .iter()
        .map(|r| r.get::<_, i64>(0).to_string())
        .collect()
}

async fn random_task_row(db: &tokio_postgres::Client, g: &mut Gen, id: i64) {
    let columns = ["n", "f", "t", "b", "at", "owner"];
    let values: Vec<String> = columns
        .iter()
        .map(|c| pg_literal(c, &g.pick(&column_values(c))))
        .collect();
    db.batch_execute(&format!(
        "INSERT INTO tasks (id, n, f, t, b, at, owner) VALUES ({id}, {}) \
         ON CONFLICT (id) DO UPDATE SET (n, f, t, b, at, owner) = \
         (EXCLUDED.n, EXCLUDED.f, EXCLUDED.t, EXCLUDED.b, EXCLUDED.at, EXCLUDED.owner)",
        values.join(", ")
    ))
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scopes_with_operators_equal_the_same_where_in_postgres_by_replay_and_live() {
    let seed = test_seed(0x5EED_C0DE_u64);
    let mut g = Gen(seed);
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TASKS_DDL).await.unwrap();
    // A database that already had rows when the server first started.
    for id in 1..=60 {
        random_task_row(&db, &mut g, id).await;
    }
    let files = SyncFiles::with_rules(TASKS_RULES);
    let data = DataDir::new("scope-operators");
    let server = start_server(&pg.url(), data.path(), &files).await;
    let mut client = Client::connect(server.addr).await;
    let columns = ["n", "f", "t", "b", "at", "owner"];
    let mut scopes = Vec::new();
    for i in 0..48 {
        let mut conditions = serde_json::Map::new();
        let mut predicates = Vec::new();
        for _ in 0..1 + g.below(2) {
            let column = g.pick(&columns);
            if conditions.contains_key(column) {
                continue;
            }
            let (condition, predicate) = random_condition(&mut g, column);
            conditions.insert(column.to_owned(), condition);
            predicates.push(format!("({predicate})"));
        }
        let conditions = Value::Object(conditions);
        let predicate = predicates.join(" AND ");
        let id = format!("q{i}");
        client.subscribe_where(&id, "tasks", &conditions).await;
        client.until_subscribed(&id).await;
        let got: std::collections::BTreeSet<String> =
            client.scopes[&id].rows.keys().cloned().collect();
        assert_eq!(
            got,
            pg_ids(&db, "tasks", &predicate).await,
            "replay of {conditions} (WHERE {predicate}), seed {seed}"
        );
        scopes.push((id, conditions, predicate));
    }

    // Live: rows change columns (to and from NULL), move in and out of scopes, are deleted
    // and inserted; every scope ends equal to its query again.
    churn_tasks(&db, &mut g).await;
    for (id, conditions, predicate) in &scopes {
        let want = pg_ids(&db, "tasks", predicate).await;
        let deadline = tokio::time::Instant::now() + PROMPT;
        loop {
            let got: std::collections::BTreeSet<String> =
                client.scopes[id].rows.keys().cloned().collect();
            if got == want {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "live {conditions} (WHERE {predicate}), seed {seed}: got {got:?}, want {want:?}"
            );
            let _ = tokio::time::timeout(Duration::from_millis(200), client.next()).await;
        }
    }
    assert!(
        client.others.iter().all(|f| f["type"] != "channel-error"),
        "{:?}",
        client.others
    );

    // Offline while the same happens again; each scope resumes from its cursor and replays
    // only the rows that entered or changed and the exits of those that left.
    let saved = std::mem::take(&mut client.scopes);
    drop(client);
    churn_tasks(&db, &mut g).await;
    // The last write, seen in the replica: everything before it is there too, so each
    // resume below is answered by replay alone.
    db.batch_execute("INSERT INTO tasks (id, t) VALUES (1000, 'last write')")
        .await
        .unwrap();
    until_replicated(data.path(), "tasks", 1000).await;
    let mut client = Client::connect(server.addr).await;
    client.scopes = saved;
    for (id, conditions, predicate) in &scopes {
        client.subscribe_where(id, "tasks", conditions).await;
        client.until_subscribed(id).await;
        let got: std::collections::BTreeSet<String> =
            client.scopes[id].rows.keys().cloned().collect();
        assert_eq!(
            got,
            pg_ids(&db, "tasks", predicate).await,
            "resume of {conditions} (WHERE {predicate}), seed {seed}"
        );
        assert_eq!(client.scopes[id].resets, 0, "{id} resumed without a reset");
    }
}

/// Waits until the replica in `data` holds row `id` of `table`: a write committed after
/// every other one has reached it, so all of them have.
async fn until_replicated(data: &Path, table: &str, id: i64) {
    let deadline = tokio::time::Instant::now() + PROMPT;
    loop {
        let db = rusqlite::Connection::open_with_flags(
            data.join("replica.db"),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
        )
        .unwrap();
        db.busy_timeout(Duration::from_secs(5)).unwrap();
        let found = db
            .query_row(
                &format!("SELECT count(*) FROM {table} WHERE id = ?1"),
                [id],
                |r| r.get::<_, i64>(0),
            )
            .is_ok_and(|n| n == 1);
        if found {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replica did not catch up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// 80 random writes to the tasks: updates of every column, deletes and inserts.
async fn churn_tasks(db: &tokio_postgres::Client, g: &mut Gen) {
    for _ in 0..80 {
        let id = 1 + g.below(70) as i64;
        if g.below(6) == 0 {
            db.execute("DELETE FROM tasks WHERE id = $1", &[&id])
                .await
                .unwrap();
        } else {
            random_task_row(db, g, id).await;
        }
    }
}

const DOCS_DDL: &str = "CREATE TABLE docs (id int8 PRIMARY KEY, owner text, org int4, shared bool, deleted_at timestamptz, priority int4, body text)";
const DOCS_FILTER: &str =
    "(owner = auth.sub OR (shared AND org = auth.org)) AND deleted_at IS NULL";

/// The docs filter with a user's claims in place, as Postgres runs it.
fn docs_predicate(sub: &str, org: i64) -> String {
    format!("(owner = '{sub}' OR (shared AND org = {org})) AND deleted_at IS NULL")
}

async fn random_doc(db: &tokio_postgres::Client, g: &mut Gen, id: i64) {
    let owner = g.pick(&["'ada'", "'bob'", "'cy'", "NULL"]);
    let org = g.pick(&["1", "2", "NULL"]);
    let shared = g.pick(&["true", "false", "NULL"]);
    let deleted = g.pick(&["NULL", "NULL", "'2026-01-01T00:00:00Z'"]);
    let priority = g.pick(&["0", "1", "2", "3", "NULL"]);
    db.batch_execute(&format!(
        "INSERT INTO docs (id, owner, org, shared, deleted_at, priority, body) \
         VALUES ({id}, {owner}, {org}, {shared}, {deleted}, {priority}, 'b{id}') \
         ON CONFLICT (id) DO UPDATE SET (owner, org, shared, deleted_at, priority, body) = \
         (EXCLUDED.owner, EXCLUDED.org, EXCLUDED.shared, EXCLUDED.deleted_at, EXCLUDED.priority, EXCLUDED.body)"
    ))
    .await
    .unwrap();
}

async fn churn_docs(db: &tokio_postgres::Client, g: &mut Gen) {
    for _ in 0..80 {
        let id = 1 + g.below(50) as i64;
        if g.below(8) == 0 {
            db.execute("DELETE FROM docs WHERE id = $1", &[&id])
                .await
                .unwrap();
        } else {
            random_doc(db, g, id).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_filter_with_claims_decides_what_each_token_sees_live_and_on_resume() {
    let seed = test_seed(0xD0C5_u64);
    let mut g = Gen(seed);
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(DOCS_DDL).await.unwrap();
    for id in 1..=40 {
        random_doc(&db, &mut g, id).await;
    }
    let rules = format!(
        r#"{{"tables":{{"docs":{{"filterColumns":["priority"],"omitColumns":["body"],"where":"{DOCS_FILTER}"}}}}}}"#
    );
    let files = SyncFiles::with_rules(&rules);
    let data = DataDir::new("scope-row-filter");
    let server = start_server(&pg.url(), data.path(), &files).await;
    let users = [("ada", 1_i64), ("bob", 1), ("cy", 2)];
    let token_of = |sub: &str, org: i64| {
        let secret = SyncSecret::from_bytes(SECRET).unwrap();
        mint_token(
            &secret,
            sub,
            Duration::from_secs(3600),
            &[("org".to_owned(), org.to_string())],
            unix_now_ms(),
        )
        .unwrap()
    };
    // Each user: the whole table as the filter lets them see it, and their priority >= 2.
    let scopes: Vec<(String, &str, i64, Value, String)> = users
        .iter()
        .flat_map(|(sub, org)| {
            let all = docs_predicate(sub, *org);
            [
                (format!("{sub}-all"), *sub, *org, json!({}), all.clone()),
                (
                    format!("{sub}-high"),
                    *sub,
                    *org,
                    json!({"priority": {"gte": 2}}),
                    format!("({all}) AND priority >= 2"),
                ),
            ]
        })
        .collect();
    let mut clients = Vec::new();
    for (id, sub, org, conditions, predicate) in &scopes {
        let mut client = Client::connect(server.addr).await;
        client.scopes.entry(id.clone()).or_default();
        client
            .send(json!({"type": "channel-subscribe", "subscriptionId": id, "channelType": "velocious-sync",
                "params": {"resourceType": "docs", "conditions": conditions,
                           "authenticationToken": token_of(sub, *org)}}))
            .await;
        client.until_subscribed(id).await;
        let got: std::collections::BTreeSet<String> =
            client.scopes[id].rows.keys().cloned().collect();
        assert_eq!(
            got,
            pg_ids(&db, "docs", predicate).await,
            "replay of {id}, seed {seed}"
        );
        assert!(
            client.scopes[id]
                .rows
                .values()
                .all(|row| row.get("body").is_none()),
            "omitted columns stay omitted"
        );
        clients.push(client);
    }

    // Live: ownership, sharing, org and deletion change; each client follows its filter.
    churn_docs(&db, &mut g).await;
    for ((id, _, _, _, predicate), client) in scopes.iter().zip(clients.iter_mut()) {
        let want = pg_ids(&db, "docs", predicate).await;
        let deadline = tokio::time::Instant::now() + PROMPT;
        loop {
            let got: std::collections::BTreeSet<String> =
                client.scopes[id].rows.keys().cloned().collect();
            if got == want {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "live {id}, seed {seed}: got {got:?}, want {want:?}"
            );
            let _ = tokio::time::timeout(Duration::from_millis(200), client.next()).await;
        }
    }

    // Offline through more of the same, then a resume from each cursor: replay alone.
    let saved: Vec<_> = clients.into_iter().map(|c| c.scopes).collect();
    churn_docs(&db, &mut g).await;
    db.batch_execute("INSERT INTO docs (id, body) VALUES (1000, 'last write')")
        .await
        .unwrap();
    until_replicated(data.path(), "docs", 1000).await;
    for ((id, sub, org, conditions, predicate), scopes_of) in scopes.iter().zip(saved) {
        let mut client = Client::connect(server.addr).await;
        client.scopes = scopes_of;
        let mut params = json!({"resourceType": "docs", "conditions": conditions,
                                "authenticationToken": token_of(sub, *org)});
        for (k, v) in client.scopes[id].cursor_params().as_object().unwrap() {
            params[k] = v.clone();
        }
        client.scopes.get_mut(id).unwrap().subscribed = false;
        client
            .send(json!({"type": "channel-subscribe", "subscriptionId": id, "channelType": "velocious-sync", "params": params}))
            .await;
        client.until_subscribed(id).await;
        let got: std::collections::BTreeSet<String> =
            client.scopes[id].rows.keys().cloned().collect();
        assert_eq!(
            got,
            pg_ids(&db, "docs", predicate).await,
            "resume of {id}, seed {seed}"
        );
        assert_eq!(client.scopes[id].resets, 0, "{id} resumed without a reset");
    }

    // A token without the claim the filter reads, and no token at all, see nothing.
    let mut client = Client::connect(server.addr).await;
    client.subscribe_where("no-org", "docs", &json!({})).await;
    let refused = client.next_other().await;
    assert_eq!(refused["code"], "auth-required", "{refused}");
    client
        .send(json!({"type": "channel-subscribe", "subscriptionId": "ada-no-org", "channelType": "velocious-sync",
            "params": {"resourceType": "docs", "conditions": {}, "authenticationToken": token("ada")}}))
        .await;
    let refused = client.next_other().await;
    assert_eq!(refused["code"], "forbidden", "{refused}");
    assert!(
        refused["message"].as_str().unwrap().contains("\"org\""),
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_tells_sync_clients_to_reconnect_with_1012_and_exits_cleanly() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    insert_ada(&db, 1..5).await;
    let files = SyncFiles::new();
    let data = DataDir::new("scope-sigterm");
    let server = spawn_primary(&pg.url(), data.path(), free_port(), &files, "highwater");
    wait_ready(server.addr).await;
    let mut client = Client::connect(server.addr).await;
    client
        .subscribe("s1", "ada", Some(&token("ada")), json!({}))
        .await;
    client.until_subscribed("s1").await;
    let asked = std::time::Instant::now();
    // Delivered twice, as `npx highwater serve` with a terminal's Ctrl-C does: still one stop.
    let status = server.terminate_times(2).await;
    assert!(status.success(), "a clean exit on SIGTERM: {status}");
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "stopped in {:?}",
        asked.elapsed()
    );
    // The close frame was sent before the process ended; it is still there to read.
    while client.next().await.is_some() {}
    assert_eq!(
        client.others.last(),
        Some(&json!({"close": 1012})),
        "{:?}",
        client.others
    );
}

/// `GET /metrics` parsed by a Prometheus text parser.
async fn scrape(addr: SocketAddr) -> prometheus_parse::Scrape {
    let (status, headers, body) = http_get(addr, "/metrics").await.unwrap();
    assert!(status.contains("200"), "{status}");
    let content_type = headers
        .iter()
        .find(|(name, _)| name == "content-type")
        .map(|(_, value)| value.as_str());
    assert_eq!(
        content_type,
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let text = String::from_utf8(body).unwrap();
    prometheus_parse::Scrape::parse(text.lines().map(|line| Ok(line.to_owned()))).unwrap()
}

/// The value of the one sample named `name` whose labels include `labels`.
fn sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let found: Vec<f64> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match &s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => *v,
            other => panic!("{name} is not a single value: {other:?}"),
        })
        .collect();
    assert!(found.len() <= 1, "{name}{labels:?} matches {found:?}");
    found.first().copied()
}

fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    sample(scrape, name, labels).unwrap_or_else(|| panic!("no sample {name}{labels:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_prometheus_text_and_move_under_a_workload() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    insert_ada(&db, 1..6).await;
    let files = SyncFiles::new();
    let data = DataDir::new("metrics");
    let metrics_addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut args = serve_args(&pg.url(), data.path(), free_port());
    files.apply(&mut args);
    args.metrics_addr = Some(metrics_addr);
    args.wal_check_ms = 100;
    let server = InProcess::start(args).await;

    // A server just started: every family is there, nothing ingested yet.
    let before = scrape(metrics_addr).await;
    assert_eq!(value(&before, "highwater_transactions_total", &[]), 0.0);
    assert_eq!(value(&before, "highwater_sync_connections", &[]), 0.0);
    assert!(value(&before, "highwater_store_bytes", &[]) > 0.0);
    assert!(value(&before, "highwater_start_time_seconds", &[]) > 1.7e9);
    // The main port serves the same (no replication token on loopback).
    let main = scrape(server.addr).await;
    assert!(sample(&main, "highwater_transactions_total", &[]).is_some());

    let mut client = Client::connect(server.addr).await;
    client
        .subscribe("s1", "ada", Some(&token("ada")), json!({}))
        .await;
    client.until_subscribed("s1").await;
    client
        .subscribe("s2", "ada", Some("not a token"), json!({}))
        .await;
    let refused = client.next_other().await;
    assert_eq!(refused["type"], "channel-error", "{refused}");
    let code = refused["code"].as_str().unwrap().to_owned();

    for id in 100..150_i64 {
        insert_ada(&db, id..id + 1).await;
    }
    db.batch_execute("DELETE FROM todos WHERE id = 100")
        .await
        .unwrap();
    client.until_equal("s1", &pg_scope(&db, "ada").await).await;

    // The WAL check runs every 100 ms; the live rows are counted as they are sent, and a
    // transaction's commit-to-route time just after its rows are handed to the sockets, so
    // the client may hold the last rows a moment before the histogram counts them.
    let deadline = tokio::time::Instant::now() + PROMPT;
    let after = loop {
        let now = scrape(metrics_addr).await;
        if sample(&now, "highwater_slot_retained_wal_bytes", &[]).is_some()
            && value(&now, "highwater_commit_to_route_seconds_count", &[]) >= 51.0
        {
            break now;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no slot reading, or fewer than 51 routed transactions, in /metrics"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let grew = |name: &str| value(&after, name, &[]) - value(&before, name, &[]);
    assert!(grew("highwater_transactions_total") >= 51.0);
    assert!(grew("highwater_changes_total") >= 51.0);
    assert!(grew("highwater_stored_transactions_total") >= 51.0);
    assert!(value(&after, "highwater_store_commits_total", &[]) >= 1.0);
    assert_eq!(value(&after, "highwater_sync_live_rows_total", &[]), 51.0);
    assert_eq!(
        value(&after, "highwater_sync_live_removals_total", &[]),
        1.0
    );
    assert_eq!(value(&after, "highwater_sync_replay_rows_total", &[]), 5.0);
    assert_eq!(value(&after, "highwater_sync_connections", &[]), 1.0);
    assert_eq!(
        value(&after, "highwater_sync_subscriptions", &[("stage", "live")]),
        1.0
    );
    assert_eq!(
        value(
            &after,
            "highwater_auth_failures_total",
            &[("endpoint", "sync"), ("code", &code)]
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            "highwater_auth_failures_total",
            &[("endpoint", "replication"), ("code", "bad-token")]
        ),
        0.0
    );
    // Every transaction went through a group commit and was routed to scope sync.
    assert!(value(&after, "highwater_group_transactions_sum", &[]) >= 51.0);
    assert!(value(&after, "highwater_group_commit_seconds_count", &[]) >= 1.0);
    assert!(value(&after, "highwater_commit_to_route_seconds_count", &[]) >= 51.0);
    let lag = value(&after, "highwater_replication_lag_seconds", &[]);
    assert!((0.0..60.0).contains(&lag), "lag {lag}");
    assert!(value(&after, "highwater_slot_lag_bytes", &[]) >= 0.0);
    assert!(
        value(&after, "highwater_change_log_last_lsn", &[])
            > value(&before, "highwater_change_log_last_lsn", &[])
    );
    assert_eq!(value(&after, "highwater_degraded", &[]), 0.0);

    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_naming_a_table_or_column_the_replica_lacks_are_refused_at_start() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    // The same rules as JSON and as YAML.
    let yaml = "\
tables:
  todos:
    filterColumns: [owner, ownr]
    omitColumns: [secret_note]
    where: >-
      done = false
      OR prio > 3
  ghosts:
    filterColumns: [id]
";
    for (name, text) in [
        (
            "rules.json",
            r#"{"tables":{"todos":{"filterColumns":["owner","ownr"],"omitColumns":["secret_note"],"where":"done = false OR prio > 3"},"ghosts":{"filterColumns":["id"]}}}"#,
        ),
        ("rules.yaml", yaml),
    ] {
        let files = SyncFiles::with_rules_file(name, text);
        let data = DataDir::new("rules-misfit");
        let mut args = serve_args(&pg.url(), data.path(), free_port());
        files.apply(&mut args);
        let (_stop, stop) = tokio::sync::watch::channel(false);
        let error = tokio::time::timeout(PROMPT, highwater_host::serve::serve(args, stop))
            .await
            .expect("serve stops on its own")
            .expect_err("rules that do not fit are refused");
        assert!(
            matches!(error, highwater_host::serve::ServeError::RulesDoNotFit(_)),
            "{name}: {error}"
        );
        let text = error.to_string();
        for miss in [
            r#"tables.ghosts: the replica has no table "ghosts""#,
            r#"tables.todos.filterColumns: todos has no column "ownr""#,
            r#"tables.todos.where: todos has no column "prio""#,
        ] {
            assert!(text.contains(miss), "{name}: {miss} in {text}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yaml_rules_serve_the_rows_their_row_filter_allows() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(&format!(
        "{TODOS_DDL}; ALTER TABLE todos ADD COLUMN shared bool NOT NULL DEFAULT false;
         INSERT INTO todos (id, owner, title, shared) VALUES
           (1, 'ada', 'mine', false), (2, 'grace', 'hers', false), (3, 'grace', 'ours', true)"
    ))
    .await
    .unwrap();
    let files = SyncFiles::with_rules_file(
        "rules.yaml",
        "\
# Each user sees their own todos and the shared ones.
tables:
  todos:
    filterColumns: [done]
    omitColumns:
      - secret_note
    where: owner = auth.sub
      OR shared
",
    );
    let data = DataDir::new("yaml-rules");
    let server = start_server(&pg.url(), data.path(), &files).await;
    let mut client = Client::connect(server.addr).await;
    client.scopes.insert("s1".to_owned(), Scope::default());
    client
        .send(json!({"type": "channel-subscribe", "subscriptionId": "s1", "channelType": "velocious-sync",
            "params": {"resourceType": "todos", "conditions": {}, "authenticationToken": token("ada")}}))
        .await;
    client.until_subscribed("s1").await;
    let ids: Vec<&String> = client.scopes["s1"].rows.keys().collect();
    assert_eq!(ids, ["1", "3"]);
    server.stop().await;
}

// ---- writes through the socket ----

/// Rules that let ada write her own todos (title, done and owner may change; never the secret
/// note) and only read `notes`.
const WRITE_RULES: &str = r#"{"tables":{
    "todos":{"filterColumns":["owner","done"],"omitColumns":["secret_note"],"require":{"owner":"sub"},
             "write":{"insert":true,"update":["title","done","owner"],"delete":true}},
    "notes":{"filterColumns":["id"]}}}"#;
const NOTES_DDL: &str = "CREATE TABLE notes (id int8 PRIMARY KEY, body text)";

impl Client {
    /// Sends a `mutate` frame and reads until each of its mutations has a result; returns
    /// every frame read meanwhile, in order.
    async fn mutate(
        &mut self,
        client_id: &str,
        token: Option<&str>,
        mutations: Value,
    ) -> Vec<Value> {
        let count = mutations.as_array().unwrap().len();
        let mut frame = json!({"type": "mutate", "clientId": client_id, "mutations": mutations});
        if let Some(token) = token {
            frame["token"] = json!(token);
        }
        self.send(frame).await;
        self.until_results(count).await
    }

    /// Reads until `count` mutation results came; returns every frame read, in order.
    async fn until_results(&mut self, count: usize) -> Vec<Value> {
        let mut frames = Vec::new();
        let mut results = 0;
        while results < count {
            let frame = self
                .next()
                .await
                .expect("frames until every mutation's result");
            assert_ne!(frame["type"], "error", "{frame}");
            if frame["type"] == "mutation-result" {
                results += frame["results"].as_array().unwrap().len();
            }
            frames.push(frame);
        }
        frames
    }
}

/// The mutation results among `frames`, in order.
fn results_in(frames: &[Value]) -> Vec<Value> {
    frames
        .iter()
        .filter(|f| f["type"] == "mutation-result")
        .flat_map(|f| f["results"].as_array().unwrap().clone())
        .collect()
}

/// `(status, code)` of each result.
fn outcomes(results: &[Value]) -> Vec<(String, Option<String>)> {
    results
        .iter()
        .map(|r| {
            (
                r["status"].as_str().unwrap().to_owned(),
                r["code"].as_str().map(str::to_owned),
            )
        })
        .collect()
}

/// Every todo in Postgres, by id, every column.
async fn pg_todos(db: &tokio_postgres::Client) -> BTreeMap<i64, Value> {
    db.query("SELECT id, to_jsonb(t.*)::text FROM todos t", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| {
            let text: String = r.get(1);
            (r.get(0), serde_json::from_str(&text).unwrap())
        })
        .collect()
}

/// The writes tests' start: a private Postgres with `todos` (holding `rows`, SQL values) and
/// `notes`, and `serve` with [`WRITE_RULES`] on a replica in `dir`.
struct Writes {
    pg: highwater_host::private_pg::PrivatePg,
    db: tokio_postgres::Client,
    server: InProcess,
    _data: DataDir,
    _files: SyncFiles,
}

async fn writes_server(dir: &str, rows: &str) -> Writes {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    db.batch_execute(NOTES_DDL).await.unwrap();
    if !rows.is_empty() {
        db.batch_execute(&format!(
            "INSERT INTO todos (id, owner, title, secret_note) VALUES {rows}"
        ))
        .await
        .unwrap();
    }
    let data = DataDir::new(dir);
    let files = SyncFiles::with_rules(WRITE_RULES);
    let server = start_server(&pg.url(), data.path(), &files).await;
    Writes {
        pg,
        db,
        server,
        _data: data,
        _files: files,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutations_apply_once_echo_to_the_writer_and_are_confirmed_after_their_envelope() {
    let Writes {
        pg: _pg,
        db,
        server,
        _data,
        _files,
    } = writes_server(
        "scope-writes",
        "(1, 'ada', 'one', NULL), (2, 'ada', 'two', NULL), (3, 'grace', 'three', NULL)",
    )
    .await;
    let ada = token("ada");
    let mut writer = Client::connect(server.addr).await;
    writer.subscribe("s1", "ada", Some(&ada), json!({})).await;
    writer.until_subscribed("s1").await;
    let mut reader = Client::connect(server.addr).await;
    reader.subscribe("s1", "ada", Some(&ada), json!({})).await;
    reader.until_subscribed("s1").await;

    let batch = json!([
        {"id": 1, "table": "todos", "op": "insert", "row": {"id": 1001, "owner": "ada", "title": "w1"}},
        {"id": 2, "table": "todos", "op": "update", "row": {"id": 1, "title": "one!", "done": true}},
        {"id": 3, "table": "todos", "op": "delete", "row": {"id": 2}},
    ]);
    let frames = writer.mutate("c1", Some(&ada), batch.clone()).await;
    let results = results_in(&frames);
    assert_eq!(
        outcomes(&results),
        vec![("confirmed".to_owned(), None); 3],
        "{results:?}"
    );
    // Each mutation is its own upstream transaction: its envelope names it, on the writer's
    // socket, before its result.
    for id in 1..=3_u64 {
        let echo = json!({"clientId": "c1", "mutationIds": [id]});
        let envelope = frames
            .iter()
            .position(|f| f["type"] == "channel-message" && f["body"]["echoOrigin"] == echo)
            .unwrap_or_else(|| panic!("no envelope echoes mutation {id}: {frames:?}"));
        let result = frames
            .iter()
            .position(|f| {
                f["type"] == "mutation-result"
                    && f["results"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|r| r["id"] == id)
            })
            .unwrap();
        assert!(
            envelope < result,
            "mutation {id}: result before its envelope: {frames:?}"
        );
    }
    let todos = pg_todos(&db).await;
    assert_eq!(todos[&1001]["title"], "w1");
    assert_eq!(todos[&1]["title"], "one!");
    assert_eq!(todos[&1]["done"], true);
    assert!(!todos.contains_key(&2));
    assert_eq!(writer.scopes["s1"].rows, pg_scope(&db, "ada").await);
    // Another socket gets the same changes, with no echo and no results.
    reader.echoes.clear();
    reader.until_equal("s1", &pg_scope(&db, "ada").await).await;
    assert_eq!(
        reader.echoes,
        vec![Value::Null; 3],
        "live envelopes, unechoed"
    );
    assert!(reader.others.iter().all(|f| f["type"] != "mutation-result"));

    // The same batch again on a new socket (its answer was lost): answered as before, and
    // applied once.
    let mut again = Client::connect(server.addr).await;
    let frames = again.mutate("c1", Some(&ada), batch).await;
    assert_eq!(
        outcomes(&results_in(&frames)),
        vec![("confirmed".to_owned(), None); 3]
    );
    assert!(
        frames.iter().all(|f| f["type"] == "mutation-result"),
        "nothing is written again: {frames:?}"
    );
    assert_eq!(pg_todos(&db).await, todos, "Postgres holds each write once");
    let last: i64 = db
        .query_one(
            "SELECT last_mutation_id FROM highwater.client_mutations WHERE client_id = 'c1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(last, 3);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutations_the_rules_or_postgres_refuse_change_nothing_and_the_batch_goes_on() {
    let Writes {
        pg: _pg,
        db,
        server,
        _data: data,
        _files,
    } = writes_server(
        "scope-writes-refused",
        "(1, 'ada', 'one', 's'), (2, 'grace', 'two', 's')",
    )
    .await;
    replica_caught_up(&db, data.path()).await;
    let before = pg_todos(&db).await;
    let ada = token("ada");
    let batch = json!([
        // Another user's row.
        {"id": 1, "table": "todos", "op": "update", "row": {"id": 2, "title": "mine now"}},
        // A column the rules keep from updates.
        {"id": 2, "table": "todos", "op": "update", "row": {"id": 1, "secret_note": "x"}},
        // Moving her row out of her reach, and inserting one outside it.
        {"id": 3, "table": "todos", "op": "update", "row": {"id": 1, "owner": "grace"}},
        {"id": 4, "table": "todos", "op": "insert", "row": {"id": 3, "owner": "grace"}},
        // A read-only table.
        {"id": 5, "table": "notes", "op": "insert", "row": {"id": 1, "body": "hi"}},
        // A unique violation, and text where Postgres wants an integer.
        {"id": 6, "table": "todos", "op": "insert", "row": {"id": 1, "owner": "ada"}},
        {"id": 7, "table": "todos", "op": "insert", "row": {"id": "abc", "owner": "ada"}},
        // A column the table lacks, and an operation that is not one.
        {"id": 8, "table": "todos", "op": "update", "row": {"id": 1, "colour": "red"}},
        {"id": 9, "table": "todos", "op": "upsert", "row": {"id": 1}},
        // The batch goes on after all of them.
        {"id": 10, "table": "todos", "op": "insert", "row": {"id": 50, "owner": "ada", "title": "ok"}},
    ]);
    let mut client = Client::connect(server.addr).await;
    let frames = client.mutate("c2", Some(&ada), batch.clone()).await;
    let results = results_in(&frames);
    let rejected = |code: &str| ("rejected".to_owned(), Some(code.to_owned()));
    let expected = vec![
        rejected("forbidden"),
        rejected("forbidden"),
        rejected("forbidden"),
        rejected("forbidden"),
        rejected("forbidden"),
        rejected("constraint"),
        rejected("invalid"),
        rejected("invalid"),
        rejected("invalid"),
        ("confirmed".to_owned(), None),
    ];
    assert_eq!(outcomes(&results), expected, "{results:?}");
    let ids: Vec<u64> = results.iter().map(|r| r["id"].as_u64().unwrap()).collect();
    assert_eq!(
        ids,
        (1..=10).collect::<Vec<_>>(),
        "results in mutation order"
    );
    assert!(
        results[5]["message"]
            .as_str()
            .unwrap()
            .contains("duplicate key"),
        "Postgres' own message: {}",
        results[5]
    );
    let mut after = pg_todos(&db).await;
    assert_eq!(after.remove(&50).unwrap()["title"], "ok");
    assert_eq!(after, before, "nothing refused changed Postgres");
    let notes: i64 = db
        .query_one("SELECT count(*) FROM notes", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(notes, 0);

    // Without a token nothing of a table that needs claims is written; an expired token is to
    // be refreshed and sent again.
    let frames = client
        .mutate(
            "c2",
            None,
            json!([{"id": 11, "table": "todos", "op": "insert", "row": {"id": 60, "owner": "ada"}}]),
        )
        .await;
    assert_eq!(outcomes(&results_in(&frames)), vec![rejected("forbidden")]);
    let expired = mint_token(
        &SyncSecret::from_bytes(SECRET).unwrap(),
        "ada",
        Duration::from_secs(1),
        &[],
        unix_now_ms() - 3_600_000,
    )
    .unwrap();
    let frames = client
        .mutate(
            "c2",
            Some(&expired),
            json!([{"id": 12, "table": "todos", "op": "insert", "row": {"id": 61, "owner": "ada"}}]),
        )
        .await;
    assert_eq!(
        outcomes(&results_in(&frames)),
        vec![("retry".to_owned(), Some("auth".to_owned()))]
    );

    // Sent again, each gets the answer it got the first time.
    let frames = client.mutate("c2", Some(&ada), batch).await;
    assert_eq!(outcomes(&results_in(&frames)), expected);
    assert!(!pg_todos(&db).await.contains_key(&61));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn if_version_refuses_a_write_to_a_row_changed_since_with_the_row_as_it_is() {
    let Writes {
        pg: _pg,
        db,
        server,
        _data,
        _files,
    } = writes_server(
        "scope-writes-if-version",
        "(1, 'ada', 'one', 's'), (2, 'ada', 'two', 's')",
    )
    .await;
    let ada = token("ada");
    let mut client = Client::connect(server.addr).await;
    client.subscribe("s1", "ada", Some(&ada), json!({})).await;
    client.until_subscribed("s1").await;
    let version_of = |client: &Client, id: &str| -> i64 {
        client.scopes["s1"]
            .seen
            .iter()
            .filter(|(rid, _)| rid == id)
            .map(|(_, seq)| *seq)
            .max()
            .unwrap()
    };
    let seen = version_of(&client, "1");

    // Changed upstream and written at once, before the replica may have the change: refused
    // all the same, with the row as it is now (minus what the writer may not read).
    db.batch_execute("UPDATE todos SET title = 'changed' WHERE id = 1")
        .await
        .unwrap();
    let frames = client
        .mutate(
            "c3",
            Some(&ada),
            json!([
                {"id": 1, "table": "todos", "op": "update", "row": {"id": 1, "title": "stale"}, "ifVersion": seen},
                {"id": 2, "table": "todos", "op": "delete", "row": {"id": 1}, "ifVersion": seen},
            ]),
        )
        .await;
    let results = results_in(&frames);
    assert_eq!(
        outcomes(&results),
        vec![("rejected".to_owned(), Some("conflict".to_owned())); 2],
        "{results:?}"
    );
    assert_eq!(results[0]["row"]["title"], "changed");
    assert_eq!(results[0]["row"]["id"], 1);
    assert!(
        results[0]["row"].get("secret_note").is_none(),
        "{}",
        results[0]
    );
    assert_eq!(pg_todos(&db).await[&1]["title"], "changed");

    // At the version the client holds now, the write applies.
    client.until_equal("s1", &pg_scope(&db, "ada").await).await;
    let current = version_of(&client, "1");
    assert!(current > seen);
    let frames = client
        .mutate(
            "c3",
            Some(&ada),
            json!([
                {"id": 3, "table": "todos", "op": "update", "row": {"id": 1, "title": "fresh"}, "ifVersion": current},
                {"id": 4, "table": "todos", "op": "delete", "row": {"id": 2}, "ifVersion": version_of(&client, "2")},
                {"id": 5, "table": "todos", "op": "update", "row": {"id": 2, "title": "gone"}},
            ]),
        )
        .await;
    let results = results_in(&frames);
    assert_eq!(
        outcomes(&results),
        vec![
            ("confirmed".to_owned(), None),
            ("confirmed".to_owned(), None),
            ("rejected".to_owned(), Some("conflict".to_owned())),
        ],
        "{results:?}"
    );
    assert_eq!(results[2]["row"], Value::Null, "the row is gone");
    let todos = pg_todos(&db).await;
    assert_eq!(todos[&1]["title"], "fresh");
    assert!(!todos.contains_key(&2));
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_writes_with_highwater_confirm_answers_await_mutations() {
    let Writes {
        pg,
        db: _db,
        server,
        _data,
        _files,
    } = writes_server("scope-writes-backend", "").await;
    let ada = token("ada");
    let mut client = Client::connect(server.addr).await;
    client.subscribe("s1", "ada", Some(&ada), json!({})).await;
    client.until_subscribed("s1").await;
    client
        .send(json!({"type": "await-mutations", "clientId": "cX", "ids": [1]}))
        .await;

    // The app's backend applies mutation 1 of client cX in its own transaction.
    let mut app = pg.connect().await.unwrap();
    let tx = app.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO todos (id, owner, title) VALUES (7, 'ada', 'from the backend')",
        &[],
    )
    .await
    .unwrap();
    tx.execute("SELECT highwater.confirm('cX', 1)", &[])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let frames = client.until_results(1).await;
    assert_eq!(
        results_in(&frames),
        vec![json!({"id": 1, "status": "confirmed"})]
    );
    assert!(
        client.scopes["s1"].rows.contains_key("7"),
        "the write reached the socket's scopes before its result"
    );
    assert_eq!(
        client.echoes.last(),
        Some(&json!({"clientId": "cX", "mutationIds": [1]}))
    );

    // The same mutation id again is refused: it was applied already.
    let error = app
        .execute("SELECT highwater.confirm('cX', 1)", &[])
        .await
        .expect_err("a mutation id at or below the client's last");
    assert_eq!(error.code().map(|c| c.code()), Some("HW409"), "{error:?}");
    server.stop().await;
}

/// The next `mutation-result` frame's results, or `None` once the socket is gone.
async fn next_results(client: &mut Client) -> Option<Vec<Value>> {
    loop {
        let frame = client.next().await?;
        if frame["type"] == "mutation-result" {
            return Some(frame["results"].as_array().unwrap().clone());
        }
    }
}

/// A client flushes an outbox of 1,000 inserts as the client core does (frames of 100, one out
/// at a time, unanswered ones sent again on a new socket); `serve` is killed with -9 while a
/// frame is being applied and started again. Then a page sends a frame and is gone before any
/// answer, and its next socket sends it again. Every mutation is answered `confirmed` (a second
/// apply of an insert would be refused as `constraint`), and Postgres holds each row once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_an_outbox_flushes_or_a_page_gone_before_its_answer_applies_each_mutation_once(
) {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(TODOS_DDL).await.unwrap();
    db.batch_execute(NOTES_DDL).await.unwrap();
    let files = SyncFiles::with_rules(WRITE_RULES);
    let data = DataDir::new("sync-writes-kill");
    let port = free_port();
    let mut primary = spawn_primary(&pg.url(), data.path(), port, &files, "highwater");
    wait_ready(primary.addr).await;
    let token = token("ada");
    let frame = |client_id: &str, ids: &[u64]| {
        let mutations: Vec<Value> = ids
            .iter()
            .map(|id| json!({"id": id, "table": "todos", "op": "insert", "row": {"id": id, "owner": "ada", "title": format!("m{id}")}}))
            .collect();
        json!({"type": "mutate", "clientId": client_id, "token": token, "mutations": mutations})
    };

    let mut pending: Vec<u64> = (1..=1000).collect();
    let mut client = Client::connect(primary.addr).await;
    let (mut frames_sent, mut killed) = (0, false);
    while !pending.is_empty() {
        let batch: Vec<u64> = pending.iter().take(100).copied().collect();
        client.send(frame("flush", &batch)).await;
        frames_sent += 1;
        if frames_sent == 4 && !killed {
            // While the frame is being applied: some of it may be committed upstream, with
            // no answer out.
            tokio::time::sleep(Duration::from_millis(30)).await;
            primary.kill9();
            killed = true;
            let committed: i64 = db
                .query_one(
                    "SELECT coalesce(max(last_mutation_id), 0) FROM highwater.client_mutations",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            eprintln!("# killed with mutations up to {committed} committed (the frame sent last ends at {})", batch[batch.len() - 1]);
            primary = spawn_primary(&pg.url(), data.path(), port, &files, "highwater");
            wait_ready(primary.addr).await;
            client = Client::connect(primary.addr).await;
            continue;
        }
        // The frame is out until each of its mutations is answered (confirmed ones are
        // answered as their changes come back, maybe over several frames).
        let mut out = batch;
        while !out.is_empty() {
            match next_results(&mut client).await {
                Some(results) => {
                    for result in results {
                        assert_eq!(result["status"], "confirmed", "{result}");
                        let id = result["id"].as_u64().unwrap();
                        pending.retain(|p| *p != id);
                        out.retain(|p| *p != id);
                    }
                }
                None => {
                    client = Client::connect(primary.addr).await;
                    break;
                }
            }
        }
    }
    assert!(killed);

    // A page gone right after sending: its frame is applied (or not) with nobody to answer.
    let mut gone = Client::connect(primary.addr).await;
    let page_ids: Vec<u64> = (1001..=1010).collect();
    gone.send(frame("page", &page_ids)).await;
    drop(gone);
    let mut again = Client::connect(primary.addr).await;
    again.send(frame("page", &page_ids)).await;
    let mut results = Vec::new();
    while results.len() < page_ids.len() {
        results.extend(
            next_results(&mut again)
                .await
                .expect("the resent frame's results"),
        );
    }
    assert_eq!(results.len(), 10);
    assert!(
        results.iter().all(|r| r["status"] == "confirmed"),
        "{results:?}"
    );

    let rows = pg_todos(&db).await;
    assert_eq!(rows.len(), 1010);
    assert_eq!(
        rows.keys().copied().collect::<Vec<_>>(),
        (1..=1010).collect::<Vec<i64>>()
    );
    let last: Vec<(String, i64)> = db
        .query(
            "SELECT client_id, last_mutation_id FROM highwater.client_mutations ORDER BY client_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        last,
        [("flush".to_owned(), 1000), ("page".to_owned(), 1010)]
    );
    // Since the restart: the mutations answered, by outcome, none refused.
    let metrics = scrape(primary.addr).await;
    let applied = value(
        &metrics,
        "highwater_sync_mutations_total",
        &[("outcome", "applied")],
    );
    let received = value(&metrics, "highwater_sync_mutations_received_total", &[]);
    assert!(
        applied >= 10.0 && received >= applied,
        "{applied} of {received}"
    );
    assert_eq!(
        value(
            &metrics,
            "highwater_sync_mutations_total",
            &[("outcome", "rejected")]
        ),
        0.0
    );
    primary.kill9();
}

/// The write rules compare the values a reader of the replica sees: a `where` on a timestamp
/// column compares milliseconds on a write as on a read (Postgres' own JSON would give text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_rules_compare_timestamps_and_numerics_as_reads_do() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    // `todos` too: `replica_caught_up` reads it.
    db.batch_execute(TODOS_DDL).await.unwrap();
    db.batch_execute(
        "CREATE TABLE events (id int8 PRIMARY KEY, starts_at timestamptz NOT NULL, price numeric NOT NULL)",
    )
    .await
    .unwrap();
    // 2023-11-14T22:13:20Z, and a price of at most 100.
    let files = SyncFiles::with_rules(
        r#"{"tables":{"events":{"filterColumns":["id"],
            "where":"starts_at >= 1700000000000 AND price <= 100",
            "write":{"insert":true,"update":true,"delete":true}}}}"#,
    );
    let data = DataDir::new("scope-writes-typed");
    let server = start_server(&pg.url(), data.path(), &files).await;
    replica_caught_up(&db, data.path()).await;
    let batch = json!([
        {"id": 1, "table": "events", "op": "insert", "row": {"id": 1, "starts_at": "2026-12-06T12:00:00Z", "price": "99.50"}},
        {"id": 2, "table": "events", "op": "insert", "row": {"id": 2, "starts_at": "2020-01-01T00:00:00Z", "price": 10}},
        {"id": 3, "table": "events", "op": "insert", "row": {"id": 3, "starts_at": "2026-12-06T12:00:00Z", "price": 100.01}},
        {"id": 4, "table": "events", "op": "update", "row": {"id": 1, "price": 100}},
    ]);
    let mut client = Client::connect(server.addr).await;
    let frames = client.mutate("typed", None, batch).await;
    let rejected = ("rejected".to_owned(), Some("forbidden".to_owned()));
    let confirmed = ("confirmed".to_owned(), None);
    assert_eq!(
        outcomes(&results_in(&frames)),
        [confirmed.clone(), rejected.clone(), rejected, confirmed]
    );
    let ids: Vec<i64> = db
        .query("SELECT id FROM events ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, [1]);
    server.stop().await;
}

const MEMBERSHIP_DDL: &str = "
CREATE TABLE projects (id int8 PRIMARY KEY, name text);
CREATE TABLE members (id int8 PRIMARY KEY, project_id int8, user_id text);
CREATE TABLE todos (id int8 PRIMARY KEY, project_id int8, title text, done bool NOT NULL DEFAULT false);
CREATE TABLE comments (id int8 PRIMARY KEY, todo_id int8, author text, body text);
";

/// Projects through memberships, their todos, and the comments on those todos (or written by
/// the user: a second path to a comment).
const MEMBERSHIP_RULES: &str = r#"
tables:
  projects: { where: "id IN (SELECT project_id FROM members WHERE user_id = auth.sub)" }
  members:  { where: "user_id = auth.sub" }
  todos:
    filterColumns: [done, project_id]
    where: "project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)"
  comments:
    omitColumns: [body]
    where: >-
      todo_id IN (SELECT id FROM todos WHERE project_id IN
        (SELECT project_id FROM members WHERE user_id = auth.sub))
      OR author = auth.sub
"#;

/// What `user` may see of `table`, as Postgres says it.
fn member_predicate(table: &str, user: &str) -> String {
    let projects = format!("(SELECT project_id FROM members WHERE user_id = '{user}')");
    match table {
        "projects" => format!("id IN {projects}"),
        "members" => format!("user_id = '{user}'"),
        "todos" => format!("project_id IN {projects}"),
        "comments" => format!(
            "todo_id IN (SELECT id FROM todos WHERE project_id IN {projects}) OR author = '{user}'"
        ),
        _ => unreachable!(),
    }
}

const MEMBER_USERS: [&str; 3] = ["ada", "bob", "cy"];
const MEMBER_TABLES: [&str; 4] = ["projects", "members", "todos", "comments"];

/// One random write of the membership schema: memberships come and go, todos move between
/// projects, comments move between todos, a project is deleted with its memberships.
async fn membership_write(db: &tokio_postgres::Client, g: &mut Gen) {
    let project = 1 + g.below(6) as i64;
    let user = g.pick(&MEMBER_USERS);
    let sql = match g.below(10) {
        0 | 1 => format!(
            "INSERT INTO members (id, project_id, user_id) VALUES ({}, {project}, '{user}') \
             ON CONFLICT (id) DO UPDATE SET project_id = EXCLUDED.project_id, user_id = EXCLUDED.user_id",
            1 + g.below(30)
        ),
        2 => format!("DELETE FROM members WHERE id = {}", 1 + g.below(30)),
        3 | 4 => format!(
            "INSERT INTO todos (id, project_id, title) VALUES ({}, {project}, 't') \
             ON CONFLICT (id) DO UPDATE SET project_id = EXCLUDED.project_id, done = NOT todos.done",
            1 + g.below(60)
        ),
        5 => format!("DELETE FROM todos WHERE id = {}", 1 + g.below(60)),
        6 | 7 => format!(
            "INSERT INTO comments (id, todo_id, author, body) VALUES ({}, {}, '{user}', 'b') \
             ON CONFLICT (id) DO UPDATE SET todo_id = EXCLUDED.todo_id",
            1 + g.below(120),
            1 + g.below(60)
        ),
        8 => format!("DELETE FROM comments WHERE id = {}", 1 + g.below(120)),
        _ => format!(
            "BEGIN; DELETE FROM members WHERE project_id = {project}; DELETE FROM projects WHERE id = {project}; \
             INSERT INTO projects (id, name) VALUES ({project}, 'again'); COMMIT;"
        ),
    };
    db.batch_execute(&sql).await.unwrap();
}

/// Subscribes to every table as `user` sees it, from the scopes' cursors.
async fn subscribe_member_tables(client: &mut Client, user: &str) {
    for table in MEMBER_TABLES {
        let id = format!("{user}-{table}");
        let scope = client.scopes.entry(id.clone()).or_default();
        scope.subscribed = false;
        let mut params =
            json!({"resourceType": table, "conditions": {}, "authenticationToken": token(user)});
        for (k, v) in scope.cursor_params().as_object().unwrap() {
            params[k] = v.clone();
        }
        client
            .send(json!({"type": "channel-subscribe", "subscriptionId": id, "channelType": "velocious-sync", "params": params}))
            .await;
    }
    for table in MEMBER_TABLES {
        client.until_subscribed(&format!("{user}-{table}")).await;
    }
}

/// Reads until every scope of `user` equals Postgres' answer for it.
async fn until_members_equal(
    client: &mut Client,
    db: &tokio_postgres::Client,
    user: &str,
    what: &str,
) {
    for table in MEMBER_TABLES {
        let id = format!("{user}-{table}");
        let want = pg_ids(db, table, &member_predicate(table, user)).await;
        let deadline = tokio::time::Instant::now() + PROMPT;
        loop {
            let got: std::collections::BTreeSet<String> =
                client.scopes[&id].rows.keys().cloned().collect();
            if got == want {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: {id} holds {got:?}, Postgres says {want:?}"
            );
            let _ = tokio::time::timeout(Duration::from_millis(100), client.next()).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_reached_through_memberships_move_in_and_out_live_on_resume_and_across_a_restart() {
    let seed = test_seed(0x3E3B_u64);
    let mut g = Gen(seed);
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(MEMBERSHIP_DDL).await.unwrap();
    db.batch_execute(
        "INSERT INTO projects SELECT g, 'p' || g FROM generate_series(1, 6) g;
         INSERT INTO members VALUES (1, 1, 'ada'), (2, 2, 'ada'), (3, 2, 'bob'), (4, 3, 'cy');
         INSERT INTO todos SELECT g, 1 + g % 6, 't' || g FROM generate_series(1, 40) g;
         INSERT INTO comments SELECT g, 1 + g % 40, (ARRAY['ada','bob','cy'])[1 + g % 3], 'b' FROM generate_series(1, 80) g;",
    )
    .await
    .unwrap();
    let files = SyncFiles::with_rules_file("rules.yaml", MEMBERSHIP_RULES);
    let data = DataDir::new("scope-membership");
    let server = start_server(&pg.url(), data.path(), &files).await;
    let mut clients = Vec::new();
    for user in MEMBER_USERS {
        let mut client = Client::connect(server.addr).await;
        subscribe_member_tables(&mut client, user).await;
        until_members_equal(&mut client, &db, user, &format!("replay, seed {seed}")).await;
        clients.push(client);
    }

    // Bob joins project 1 while subscribed: its todos and their comments arrive as moves.
    db.batch_execute("INSERT INTO members VALUES (100, 1, 'bob')")
        .await
        .unwrap();
    until_members_equal(&mut clients[1], &db, "bob", "bob joined project 1").await;
    assert!(
        clients[1].scopes["bob-todos"].moves > 0,
        "bob's todos moved in"
    );
    // And leaves it again: they go, but his own comments stay.
    db.batch_execute("DELETE FROM members WHERE id = 100")
        .await
        .unwrap();
    until_members_equal(&mut clients[1], &db, "bob", "bob left project 1").await;

    // Live through random writes of every kind.
    for round in 0..4 {
        for _ in 0..40 {
            membership_write(&db, &mut g).await;
        }
        for (client, user) in clients.iter_mut().zip(MEMBER_USERS) {
            until_members_equal(
                client,
                &db,
                user,
                &format!("live round {round}, seed {seed}"),
            )
            .await;
        }
    }

    // Offline through more, then a resume from each cursor.
    let saved: Vec<_> = clients.into_iter().map(|c| c.scopes).collect();
    for _ in 0..60 {
        membership_write(&db, &mut g).await;
    }
    db.batch_execute("INSERT INTO projects VALUES (1000, 'last')")
        .await
        .unwrap();
    until_replicated(data.path(), "projects", 1000).await;
    let mut clients = Vec::new();
    for (scopes, user) in saved.into_iter().zip(MEMBER_USERS) {
        let mut client = Client::connect(server.addr).await;
        client.scopes = scopes;
        subscribe_member_tables(&mut client, user).await;
        until_members_equal(&mut client, &db, user, &format!("resume, seed {seed}")).await;
        clients.push(client);
    }

    // A restart, writes while it is down, and a resume from the cursors again.
    let saved: Vec<_> = clients.into_iter().map(|c| c.scopes).collect();
    server.stop().await;
    for _ in 0..40 {
        membership_write(&db, &mut g).await;
    }
    db.batch_execute("INSERT INTO projects VALUES (1001, 'after the restart')")
        .await
        .unwrap();
    let server = start_server(&pg.url(), data.path(), &files).await;
    until_replicated(data.path(), "projects", 1001).await;
    for (scopes, user) in saved.into_iter().zip(MEMBER_USERS) {
        let mut client = Client::connect(server.addr).await;
        client.scopes = scopes;
        subscribe_member_tables(&mut client, user).await;
        until_members_equal(
            &mut client,
            &db,
            user,
            &format!("after a restart, seed {seed}"),
        )
        .await;
        for table in MEMBER_TABLES {
            assert!(
                client.scopes[&format!("{user}-{table}")]
                    .rows
                    .values()
                    .all(|row| row.get("body").is_none()),
                "omitted columns stay omitted"
            );
        }
    }

    // A scope asking for a project its user is not in gets nothing of it, while the same
    // conditions with a member's token get the project's todos.
    let project: i64 = db
        .query_one(
            "SELECT t.project_id FROM todos t JOIN members m USING (project_id) \
             WHERE t.project_id NOT IN (SELECT project_id FROM members WHERE user_id = 'bob') LIMIT 1",
            &[],
        )
        .await
        .map(|row| row.get(0))
        .unwrap_or_else(|_| panic!("a todo of a project bob is not in, seed {seed}"));
    let member: String = db
        .query_one(
            "SELECT user_id FROM members WHERE project_id = $1 LIMIT 1",
            &[&project],
        )
        .await
        .unwrap()
        .get(0);
    let mut client = Client::connect(server.addr).await;
    for (id, user) in [
        ("peek", "bob"),
        ("own", member.as_str()),
        ("none", "nobody"),
    ] {
        client.scopes.entry(id.into()).or_default();
        client
            .send(json!({"type": "channel-subscribe", "subscriptionId": id, "channelType": "velocious-sync",
                "params": {"resourceType": "todos", "conditions": {"project_id": project},
                           "authenticationToken": token(user)}}))
            .await;
        client.until_subscribed(id).await;
    }
    assert!(
        client.scopes["peek"].rows.is_empty(),
        "bob sees nothing of project {project}"
    );
    assert!(
        client.scopes["none"].rows.is_empty(),
        "a user of no project sees no todo"
    );
    let want = pg_ids(&db, "todos", &format!("project_id = {project}")).await;
    let got: std::collections::BTreeSet<String> =
        client.scopes["own"].rows.keys().cloned().collect();
    assert_eq!(got, want, "{member} sees project {project}");
    assert!(!want.is_empty());
}

/// A member of a project writes its todos: the write rules' subquery reads `members` from the
/// replica, once it has caught up with the upstream, so a membership granted or revoked just
/// before a write counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_a_membership_subquery_are_allowed_to_members_only() {
    let pg = start_pg().await;
    let db = pg.connect().await.unwrap();
    db.batch_execute(MEMBERSHIP_DDL).await.unwrap();
    db.batch_execute(
        "INSERT INTO members VALUES (1, 1, 'ada'), (2, 2, 'bob');
         INSERT INTO todos (id, project_id, title) VALUES (1, 1, 'a1'), (2, 2, 'b1');",
    )
    .await
    .unwrap();
    let files = SyncFiles::with_rules(
        r#"{"tables":{"todos":{
            "where":"project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)",
            "write":{"insert":true,"update":true,"delete":true}}}}"#,
    );
    let data = DataDir::new("scope-writes-membership");
    let server = start_server(&pg.url(), data.path(), &files).await;
    let before = pg_todos(&db).await;
    let confirmed = ("confirmed".to_owned(), None);
    let forbidden = ("rejected".to_owned(), Some("forbidden".to_owned()));

    let ada = token("ada");
    let mut client = Client::connect(server.addr).await;
    let frames = client
        .mutate(
            "member",
            Some(&ada),
            json!([
                {"id": 1, "table": "todos", "op": "insert", "row": {"id": 10, "project_id": 1, "title": "mine"}},
                {"id": 2, "table": "todos", "op": "update", "row": {"id": 1, "title": "a1!"}},
                // Into a project she is not a member of, moved into one, and bob's rows.
                {"id": 3, "table": "todos", "op": "insert", "row": {"id": 11, "project_id": 2, "title": "x"}},
                {"id": 4, "table": "todos", "op": "update", "row": {"id": 1, "project_id": 2}},
                {"id": 5, "table": "todos", "op": "update", "row": {"id": 2, "title": "x"}},
                {"id": 6, "table": "todos", "op": "delete", "row": {"id": 2}},
                {"id": 7, "table": "todos", "op": "insert", "row": {"id": 12, "project_id": 1}},
                {"id": 8, "table": "todos", "op": "delete", "row": {"id": 12}},
            ]),
        )
        .await;
    let results = results_in(&frames);
    assert_eq!(
        outcomes(&results),
        [
            confirmed.clone(),
            confirmed.clone(),
            forbidden.clone(),
            forbidden.clone(),
            forbidden.clone(),
            forbidden.clone(),
            confirmed.clone(),
            confirmed.clone(),
        ],
        "{results:?}"
    );
    let mut after = pg_todos(&db).await;
    let mine = after.remove(&10).expect("her insert is in Postgres");
    assert_eq!(
        (&mine["project_id"], &mine["title"]),
        (&json!(1), &json!("mine"))
    );
    let first = after.get_mut(&1).unwrap();
    assert_eq!(
        (&first["project_id"], &first["title"]),
        (&json!(1), &json!("a1!"))
    );
    first["title"] = json!("a1");
    assert_eq!(after, before, "nothing refused was written");

    // A user of no project, and no token at all, write nothing.
    let cy = token("cy");
    let mut stranger = Client::connect(server.addr).await;
    let frames = stranger
        .mutate(
            "stranger",
            Some(&cy),
            json!([{"id": 1, "table": "todos", "op": "insert", "row": {"id": 20, "project_id": 1}}]),
        )
        .await;
    assert_eq!(
        outcomes(&results_in(&frames)),
        std::slice::from_ref(&forbidden)
    );
    let mut anonymous = Client::connect(server.addr).await;
    let frames = anonymous
        .mutate(
            "anonymous",
            None,
            json!([{"id": 1, "table": "todos", "op": "insert", "row": {"id": 21, "project_id": 1}}]),
        )
        .await;
    assert_eq!(
        outcomes(&results_in(&frames)),
        std::slice::from_ref(&forbidden)
    );
    let todos = pg_todos(&db).await;
    assert!(!todos.contains_key(&20) && !todos.contains_key(&21));

    // A membership granted upstream counts for the very next write, and one revoked too.
    db.batch_execute("INSERT INTO members VALUES (3, 2, 'ada')")
        .await
        .unwrap();
    let frames = client
        .mutate(
            "member",
            Some(&ada),
            json!([
                {"id": 9, "table": "todos", "op": "insert", "row": {"id": 13, "project_id": 2}},
                {"id": 10, "table": "todos", "op": "update", "row": {"id": 1, "project_id": 2}},
            ]),
        )
        .await;
    assert_eq!(
        outcomes(&results_in(&frames)),
        [confirmed.clone(), confirmed.clone()]
    );
    db.batch_execute("DELETE FROM members WHERE id = 3")
        .await
        .unwrap();
    let frames = client
        .mutate(
            "member",
            Some(&ada),
            json!([{"id": 11, "table": "todos", "op": "update", "row": {"id": 13, "title": "still mine?"}}]),
        )
        .await;
    assert_eq!(outcomes(&results_in(&frames)), [forbidden]);
    let todos = pg_todos(&db).await;
    assert_eq!(todos[&13]["title"], Value::Null);
    assert_eq!(todos[&1]["project_id"], 2);
    server.stop().await;
}
