//! `highwater demo` and `highwater watch` as a user runs them: the demo starts its own Postgres
//! and serves live writes; `watch` prints a stream that the engine's decoder accepts.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use highwater_engine::change_stream::{decode_downstream, DownstreamMessage};

const BIN: &str = env!("CARGO_BIN_EXE_highwater");

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Stops the demo on drop, so a failing test leaves no server behind.
struct Demo(std::process::Child);

impl Drop for Demo {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = Command::new("kill").arg(self.0.id().to_string()).status();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn demo_serves_live_writes_that_watch_prints_as_valid_messages() {
    let port = free_port();
    let mut demo = Demo(
        Command::new(BIN)
            .args([
                "demo",
                "--port",
                &port.to_string(),
                "--writes-per-second",
                "20",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("demo starts"),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the demo never listened");
        assert!(
            demo.0.try_wait().expect("wait").is_none(),
            "the demo exited"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let watched = Command::new(BIN)
        .args(["watch", &format!("ws://127.0.0.1:{port}"), "--commits", "5"])
        .output()
        .expect("watch runs");
    assert!(
        watched.status.success(),
        "watch failed: {}",
        String::from_utf8_lossy(&watched.stderr)
    );
    let text = String::from_utf8(watched.stdout).expect("utf-8");
    let messages: Vec<DownstreamMessage> = text
        .lines()
        .map(|line| decode_downstream(line).unwrap_or_else(|e| panic!("{line}: {e}")))
        .collect();
    let commits: Vec<_> = messages
        .iter()
        .filter_map(|m| match m {
            DownstreamMessage::Commit(commit) => Some(commit.watermark.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(commits.len(), 5, "{text}");
    assert!(commits.windows(2).all(|w| w[0] < w[1]), "{commits:?}");
    assert!(
        messages
            .iter()
            .any(|m| matches!(m, DownstreamMessage::Data(_))),
        "live writes arrive as data messages"
    );

    // SIGTERM stops the demo cleanly, with its private Postgres.
    let pid = demo.0.id();
    assert!(Command::new("kill")
        .arg(pid.to_string())
        .status()
        .expect("kill")
        .success());
    let status = demo.0.wait().expect("demo exits");
    assert!(status.success(), "demo exit status {status}");
    let data_dir = std::env::temp_dir().join(format!("highwater-demo-{pid}"));
    assert!(
        !data_dir.exists(),
        "the demo removed {}",
        data_dir.display()
    );
}
