//! `highwater demo`'s web side as the page uses it: the page and package routes, demo tokens for
//! the demo users only, scopes through project memberships, and the endpoints that change the
//! schema and the memberships in the upstream Postgres.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::{SinkExt as _, StreamExt as _};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;

const BIN: &str = env!("CARGO_BIN_EXE_highwater");

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Stops the demo on drop, so a failing test leaves no server behind.
struct Demo {
    child: Child,
    port: u16,
    upstream: String,
}

impl Drop for Demo {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .arg(self.child.id().to_string())
                .status();
            let _ = self.child.wait();
        }
    }
}

impl Demo {
    fn start() -> Demo {
        let port = free_port();
        let mut child = Command::new(BIN)
            .args([
                "demo",
                "--port",
                &port.to_string(),
                "--writes-per-second",
                "0",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("demo starts");
        // The header names the upstream; read until that line.
        let mut stdout = child.stdout.take().expect("stdout");
        let mut text = String::new();
        let mut byte = [0u8; 1];
        let upstream = loop {
            if let Some(line) = text
                .lines()
                .find(|l| l.trim_start().starts_with("upstream"))
            {
                if text.ends_with('\n') {
                    break line.split_whitespace().nth(1).expect("a URL").to_owned();
                }
            }
            match stdout.read(&mut byte) {
                Ok(1) => text.push(byte[0] as char),
                _ => panic!("the demo ended its output early: {text}"),
            }
        };
        assert!(
            text.starts_with(&format!("Highwater demo: http://127.0.0.1:{port}/\n")),
            "the page URL comes first: {text}"
        );
        // Keep draining stdout so the demo never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
        let demo = Demo {
            child,
            port,
            upstream,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while demo.request("GET", "/health", None).0 != 200 {
            assert!(Instant::now() < deadline, "the demo never served /health");
            std::thread::sleep(Duration::from_millis(100));
        }
        demo
    }

    /// One HTTP/1.1 request; the status and the body.
    fn request(&self, method: &str, path: &str, json: Option<&Value>) -> (u16, String) {
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port)) else {
            return (0, String::new());
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let body = json.map(Value::to_string).unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if stream.write_all(request.as_bytes()).is_err() {
            return (0, String::new());
        }
        let mut response = String::new();
        if stream.read_to_string(&mut response).is_err() {
            return (0, String::new());
        }
        let status = response
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    fn json(&self, method: &str, path: &str, json: Option<&Value>) -> (u16, Value) {
        let (status, body) = self.request(method, path, json);
        (status, serde_json::from_str(&body).unwrap_or(Value::Null))
    }

    /// Subscribes `todos` with `conditions` and `token` on a new `/sync` socket; the rows of its
    /// replay and the frame that ends the subscribe (`channel-subscribed` or `channel-error`).
    fn subscribe(&self, conditions: Value, token: &str) -> (Vec<Value>, Value) {
        let url = format!("ws://127.0.0.1:{}/sync", self.port);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let (mut socket, _) = tokio_tungstenite::connect_async(url).await.expect("/sync");
            let subscribe = json!({
                "type": "channel-subscribe", "subscriptionId": "s1", "channelType": "velocious-sync",
                "params": {"resourceType": "todos", "conditions": conditions,
                           "authenticationToken": token}});
            socket
                .send(Message::Text(subscribe.to_string().into()))
                .await
                .expect("send");
            let mut rows = Vec::new();
            loop {
                let frame = tokio::time::timeout(Duration::from_secs(20), socket.next())
                    .await
                    .expect("an answer in time")
                    .expect("an open socket")
                    .expect("a frame");
                let Message::Text(text) = frame else { continue };
                let frame: Value = serde_json::from_str(text.as_str()).expect("JSON");
                if let Some(syncs) = frame["body"]["syncs"].as_array() {
                    rows.extend(syncs.iter().map(|entry| entry["data"].clone()));
                }
                if matches!(
                    frame["type"].as_str(),
                    Some("channel-subscribed" | "channel-error")
                ) {
                    return (rows, frame);
                }
            }
        })
    }

    /// `SELECT count(*) FROM <from>`.
    fn count(&self, from: &str) -> usize {
        let count: i64 = self.sql(&format!("SELECT count(*) FROM {from}"))[0].get(0);
        usize::try_from(count).expect("a count")
    }

    fn sql(&self, query: &str) -> Vec<tokio_postgres::Row> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let (client, connection) =
                tokio_postgres::connect(&self.upstream, tokio_postgres::NoTls)
                    .await
                    .expect("connect upstream");
            tokio::spawn(connection);
            client.query(query, &[]).await.expect("query")
        })
    }
}

/// The projects of `rows`, each once, in order.
fn projects_of(rows: &[Value]) -> Vec<i64> {
    let projects: std::collections::BTreeSet<i64> = rows
        .iter()
        .map(|row| row["project_id"].as_i64().expect("a project"))
        .collect();
    projects.into_iter().collect()
}

#[test]
fn demo_serves_the_page_tokens_memberships_and_schema_changes() {
    let demo = Demo::start();

    // The page at `/` (in front of serve's own `/`), its files, and nothing outside them.
    let (status, page) = demo.request("GET", "/", None);
    assert_eq!(status, 200);
    assert!(page.contains("/demo/app.js"), "{page}");
    assert_eq!(demo.request("GET", "/demo/style.css", None).0, 200);
    assert_eq!(demo.request("GET", "/demo/..%2fREADME.md", None).0, 404);
    assert_eq!(demo.request("GET", "/pkg/.hidden", None).0, 404);
    // serve's routes still answer behind the demo's.
    assert_eq!(
        demo.request("GET", "/keepalive", None),
        (200, "OK".to_owned())
    );

    // Tokens for the demo users only, with their `sub`.
    let (status, token) = demo.json("GET", "/demo/token?sub=grace", None);
    assert_eq!(status, 200, "{token}");
    let jwt = token["token"].as_str().expect("a token");
    let payload = jwt.split('.').nth(1).expect("three parts");
    let claims: Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .expect("base64url"),
    )
    .expect("JSON claims");
    assert_eq!(claims["sub"], "grace");
    assert!(claims["exp"].as_u64() > claims["iat"].as_u64(), "{claims}");
    assert_eq!(demo.json("GET", "/demo/token?sub=eve", None).0, 400);

    // Scope sync is on with the demo rules: grace's token opens the todos of her projects,
    // Launch (1) and Hiring (3), and no other.
    let (rows, subscribed) = demo.subscribe(json!({}), jwt);
    assert_eq!(subscribed["type"], "channel-subscribed", "{subscribed}");
    assert_eq!(projects_of(&rows), [1, 3]);
    assert_eq!(rows.len(), demo.count("todos WHERE project_id IN (1, 3)"));
    let (rows, _) = demo.subscribe(json!({"project_id": 2}), jwt);
    assert!(rows.is_empty(), "a project grace is not in: {rows:?}");
    let refused = demo.subscribe(json!({"title": "x"}), jwt).1;
    assert_eq!(
        refused["type"], "channel-error",
        "not a filter column: {refused}"
    );
    assert_eq!(
        demo.subscribe(json!({}), "not-a-token").1["code"],
        "auth-invalid"
    );

    // Memberships change upstream through the demo's admin endpoint; her scope follows.
    let (status, projects) = demo.json("GET", "/demo/projects", None);
    assert_eq!(status, 200);
    let names: Vec<&str> = projects["projects"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert_eq!(names, ["Launch", "Docs", "Hiring", "Infra"]);
    let (status, joined) = demo.json("PUT", "/demo/projects/2/members/grace", None);
    assert_eq!(status, 200, "{joined}");
    assert_eq!(
        joined,
        json!({"project": 2, "user": "grace", "member": true})
    );
    // Again is a no-op.
    assert_eq!(
        demo.json("PUT", "/demo/projects/2/members/grace", None).0,
        200
    );
    assert_eq!(
        demo.count("members WHERE project_id = 2 AND user_id = 'grace'"),
        1
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while projects_of(&demo.subscribe(json!({}), jwt).0) != [1, 2, 3] {
        assert!(
            Instant::now() < deadline,
            "Docs never reached grace's scope"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, left) = demo.json("DELETE", "/demo/projects/2/members/grace", None);
    assert_eq!((status, &left["member"]), (200, &json!(false)), "{left}");
    assert_eq!(
        demo.count("members WHERE project_id = 2 AND user_id = 'grace'"),
        0
    );
    assert_eq!(
        demo.json("PUT", "/demo/projects/2/members/eve", None).0,
        400
    );
    assert_eq!(
        demo.json("PUT", "/demo/projects/99/members/grace", None).0,
        404
    );
    // Not POST: a page of another origin could send that without asking.
    let status = demo
        .request("POST", "/demo/projects/2/members/grace", None)
        .0;
    assert_eq!(status, 405);

    // The page writes through `/sync`, like any app: the demo has no write endpoints.
    for (method, path) in [
        ("POST", "/demo/todos"),
        ("PATCH", "/demo/todos/1"),
        ("DELETE", "/demo/todos/1"),
    ] {
        let status = demo.request(method, path, None).0;
        assert!(
            status == 404 || status == 405,
            "{method} {path} answered {status}"
        );
    }

    // Each click adds the next column, with a default every row then holds.
    let (status, column) = demo.json("POST", "/demo/columns", None);
    assert_eq!((status, column["column"].as_str()), (200, Some("priority")));
    let (_, column) = demo.json("POST", "/demo/columns", None);
    assert_eq!(column["column"], "tag");
    let missing =
        demo.sql("SELECT count(*) FROM todos WHERE priority IS DISTINCT FROM 3 OR tag <> 'inbox'");
    assert_eq!(missing[0].get::<_, i64>(0), 0);
}
