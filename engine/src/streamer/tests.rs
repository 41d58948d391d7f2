//! Golden transcripts (events → effects) of the streamer's rules in
//! `docs/protocol/change-stream.md`, the scenarios of Zero's change-streamer tests that concern
//! them, and a property test of the whole state machine against a simulated host.

use std::fmt::Write as _;

use super::*;
use crate::change_stream::{
    decode_backfill_request_value, decode_downstream, decode_downstream_frame, parse_json, Begin,
    Commit, SubscriberMode,
};

const RV: &str = "01";
const BACKUP_URL: &str = "s3://backups/replica";

fn w(text: &str) -> Watermark {
    Watermark::parse(text).expect("watermark")
}

fn msg(text: &str) -> DownstreamMessage {
    decode_downstream(text).expect("message")
}

fn begin(wm: &str) -> DownstreamMessage {
    DownstreamMessage::Begin(Begin::new(w(wm)))
}

fn commit(wm: &str) -> DownstreamMessage {
    DownstreamMessage::Commit(Commit::new(w(wm)))
}

fn insert(id: u64) -> DownstreamMessage {
    msg(&format!(
        r#"["data",{{"tag":"insert","relation":{{"schema":"s","name":"t","rowKey":{{"columns":["id"]}}}},"new":{{"id":{id}}}}}]"#
    ))
}

fn status() -> DownstreamMessage {
    DownstreamMessage::Status(Status::default())
}

fn ctx(id: &str, task: &str, mode: SubscriberMode, rv: &str, wm: &str) -> SubscribeContext {
    SubscribeContext {
        task_id: task.to_owned(),
        id: id.to_owned(),
        mode,
        replica_version: w(rv),
        watermark: w(wm),
        backfills: None,
        extra: Extra::new(),
    }
}

fn serving(wm: &str) -> SubscribeContext {
    ctx("vs", "task", SubscriberMode::Serving, RV, wm)
}

fn config() -> StreamerConfig {
    let mut config = StreamerConfig::new(w(RV));
    config.backup_url = Some(BACKUP_URL.to_owned());
    config
}

fn streamer_at(last: &str, min: &str) -> Streamer {
    Streamer::new(
        config(),
        ChangeLogState {
            last_watermark: w(last),
            min_watermark: w(min),
        },
    )
}

/// The rows a change log holds for one transaction.
fn log_tx(wm: &str, ids: &[u64]) -> Vec<CatchupRow> {
    let mut rows = vec![CatchupRow::new(w(wm), "begin", r#"{"tag":"begin"}"#)];
    for id in ids {
        rows.push(CatchupRow::new(
            w(wm),
            "insert",
            format!(
                r#"{{"tag":"insert","relation":{{"schema":"s","name":"t","rowKey":{{"columns":["id"]}}}},"new":{{"id":{id}}}}}"#
            ),
        ));
    }
    rows.push(CatchupRow::new(w(wm), "commit", r#"{"tag":"commit"}"#));
    rows
}

fn lines(effects: &[Effect]) -> Vec<String> {
    effects.iter().map(ToString::to_string).collect()
}

/// Frames sent to `conn`, as text.
fn sent_to(effects: &[Effect], conn: ConnId) -> Vec<String> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Send { conn: c, frame } if *c == conn => Some(frame.to_text()),
            _ => None,
        })
        .collect()
}

/// Messages (tuple text) sent to `conn`, batches unpacked.
fn messages_to(effects: &[Effect], conn: ConnId) -> Vec<String> {
    let mut out = Vec::new();
    for text in sent_to(effects, conn) {
        let frame = decode_downstream_frame(&text).expect("valid frame");
        out.extend(frame.messages().iter().map(encode_downstream));
    }
    out
}

fn has(effects: &[Effect], wanted: &str) -> bool {
    lines(effects).iter().any(|l| l == wanted)
}

fn has_prefix(effects: &[Effect], prefix: &str) -> bool {
    lines(effects).iter().any(|l| l.starts_with(prefix))
}

fn unwrap_ok(result: Result<Vec<Effect>, UpstreamError>) -> Vec<Effect> {
    result.expect("upstream message accepted")
}

/// Runs events and renders `> event` lines followed by the effects, for golden comparisons.
struct Transcript {
    streamer: Streamer,
    text: String,
}

impl Transcript {
    fn new(streamer: Streamer) -> Self {
        Transcript {
            streamer,
            text: String::new(),
        }
    }

    fn record(&mut self, event: &str, effects: Vec<Effect>) -> Vec<Effect> {
        let _ = writeln!(self.text, "> {event}");
        for effect in &effects {
            let _ = writeln!(self.text, "{effect}");
        }
        effects
    }

    fn upstream(&mut self, message: DownstreamMessage) -> Vec<Effect> {
        let event = format!("upstream {}", encode_downstream(&message));
        let effects = unwrap_ok(self.streamer.on_upstream(message));
        self.record(&event, effects)
    }

    /// The host found no more upstream messages waiting.
    fn drained(&mut self) -> Vec<Effect> {
        let effects = self.streamer.on_upstream_drained();
        self.record("upstream drained", effects)
    }

    fn check(&self, expected: &str) {
        let expected = expected.trim_start_matches('\n');
        if self.text != expected {
            panic!(
                "transcript differs\n--- got ---\n{}--- expected ---\n{expected}",
                self.text
            );
        }
    }
}

#[test]
fn streamer_and_effects_can_move_between_threads() {
    fn send<T: Send>() {}
    send::<Streamer>();
    send::<Effect>();
}

// ---- golden transcripts ----

#[test]
fn golden_v6_subscription_lifecycle_catchup_backlog_live_purge() {
    let mut t = Transcript::new(streamer_at("0c", RV));
    let c = ConnId(1);
    t.streamer.open(c, 6, false);
    let e = t.streamer.subscribe(c, serving("0a"), 0);
    t.record("subscribe #1 v6 at 0a", e);
    t.upstream(begin("0d"));
    t.upstream(insert(4));
    let mut rows = log_tx("0a", &[1]);
    rows.extend(log_tx("0c", &[3]));
    let e = t.streamer.catchup_rows(c, rows);
    t.record("catchup rows 0a, 0c", e);
    t.upstream(commit("0d"));
    let e = t.streamer.catchup_done(c);
    t.record("catchup done #1", e);
    t.streamer.on_stored(w("0d")).expect("accepted");
    for id in 1..=7 {
        let e = t.streamer.on_ack(c, id, 100);
        t.record(&format!("ack #1 {id}"), e);
    }
    let e = t.streamer.backup_watermark(
        BackupWatermark {
            watermark: w("0c"),
            replica_size: None,
        },
        1_000,
    );
    t.record("backup at 0c", e);
    let e = t.streamer.tick(30_999);
    t.record("tick 30999", e);
    let e = t.streamer.tick(31_000);
    t.record("tick 31000", e);
    t.upstream(begin("0e"));
    t.upstream(commit("0e"));
    let e = t.streamer.on_close(c);
    t.record("client closes #1", e);
    t.upstream(begin("0f"));
    t.check(
        r#"
> subscribe #1 v6 at 0a
fetch catchup #1 0a..=0c
> upstream ["begin",{"tag":"begin"},{"commitWatermark":"0d"}]
store begin 0d/0 {"tag":"begin"}
> upstream ["data",{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":4}}]
store append 0d/1 {"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":4}}
> catchup rows 0a, 0c
send #1 {"id":1,"msg":["status",{"tag":"status"}]}
send #1 {"id":2,"msg":["begin",{"tag":"begin"},{"commitWatermark":"0c"}]}
send #1 {"id":3,"msg":["data",{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":3}}]}
send #1 {"id":4,"msg":["commit",{"tag":"commit"},{"watermark":"0c"}]}
> upstream ["commit",{"tag":"commit"},{"watermark":"0d"}]
store commit 0d/2 {"tag":"commit"}
> catchup done #1
send #1 {"id":5,"msg":["begin",{"tag":"begin"},{"commitWatermark":"0d"}]}
send #1 {"id":6,"msg":["data",{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":4}}]}
send #1 {"id":7,"msg":["commit",{"tag":"commit"},{"watermark":"0d"}]}
> ack #1 1
> ack #1 2
> ack #1 3
> ack #1 4
> ack #1 5
> ack #1 6
> ack #1 7
> backup at 0c
> tick 30999
> tick 31000
purge below 0c
> upstream ["begin",{"tag":"begin"},{"commitWatermark":"0e"}]
store begin 0e/0 {"tag":"begin"}
send #1 {"id":8,"msg":["begin",{"tag":"begin"},{"commitWatermark":"0e"}]}
> upstream ["commit",{"tag":"commit"},{"watermark":"0e"}]
store commit 0e/1 {"tag":"commit"}
send #1 {"id":9,"msg":["commit",{"tag":"commit"},{"watermark":"0e"}]}
> client closes #1
> upstream ["begin",{"tag":"begin"},{"commitWatermark":"0f"}]
store begin 0f/0 {"tag":"begin"}
"#,
    );
    assert_eq!(t.streamer.subscriber(c), None);
}

#[test]
fn golden_v7_reserve_then_subscribe_on_one_connection() {
    let mut t = Transcript::new(streamer_at("0c", RV));
    let c = ConnId(7);
    t.streamer.open(c, 7, false);
    let e = t.streamer.on_client_frame(
        c,
        r#"{"id":1,"msg":["reserve-snapshot",{"taskID":"t1"}]}"#,
        0,
    );
    t.record("client #7 reserve-snapshot t1", e);
    let e = t.streamer.backup_watermark(
        BackupWatermark {
            watermark: w("0b"),
            replica_size: Some(4096),
        },
        10,
    );
    t.record("backup at 0b", e);
    let e = t.streamer.on_client_frame(c, r#"{"ack":1}"#, 20);
    t.record("client #7 ack 1", e);
    let e = t.streamer.on_client_frame(
        c,
        r#"{"id":2,"msg":["start-subscription",{"taskID":"t1","id":"vs-1","mode":"serving","replicaVersion":"01","watermark":"0b"}]}"#,
        30,
    );
    t.record("client #7 start-subscription at 0b", e);
    let mut rows = log_tx("0b", &[]);
    rows.extend(log_tx("0c", &[3]));
    let e = t.streamer.catchup_rows(c, rows);
    t.record("catchup rows 0b, 0c", e);
    let e = t.streamer.catchup_done(c);
    t.record("catchup done #7", e);
    t.upstream(status());
    t.drained();
    t.check(
        r#"
> client #7 reserve-snapshot t1
send #7 {"ack":1}
> backup at 0b
send #7 {"id":1,"msg":["reserved",{"tag":"snapshot","backupURL":"s3://backups/replica","replicaVersion":"01","minWatermark":"0b","replicaSize":4096}]}
> client #7 ack 1
> client #7 start-subscription at 0b
fetch catchup #7 0b..=0c
send #7 {"ack":2}
> catchup rows 0b, 0c
send #7 {"id":2,"batch":[["status",{"tag":"status"}],["begin",{"tag":"begin"},{"commitWatermark":"0c"}],["data",{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":3}}],["commit",{"tag":"commit"},{"watermark":"0c"}]]}
> catchup done #7
> upstream ["status",{"tag":"status"}]
> upstream drained
send #7 {"id":3,"msg":["status",{"tag":"status"}]}
"#,
    );
}

#[test]
fn golden_subscription_errors() {
    let mut t = Transcript::new(streamer_at("0c", "0b"));
    t.streamer.open(ConnId(1), 6, false);
    let e = t.streamer.subscribe(
        ConnId(1),
        ctx("vs", "t", SubscriberMode::Serving, "02", "0a"),
        0,
    );
    t.record("subscribe #1 with replica version 02", e);
    let e = t.streamer.on_ack(ConnId(1), 1, 5);
    t.record("ack #1 1", e);
    t.streamer.open(ConnId(2), 6, false);
    let e = t.streamer.subscribe(ConnId(2), serving("0a"), 10);
    t.record("subscribe #2 at 0a", e);
    let e = t.streamer.catchup_rows(ConnId(2), log_tx("0b", &[]));
    t.record("catchup rows 0b", e);
    let e = t.streamer.tick(10_009);
    t.record("tick 10009", e);
    let e = t.streamer.tick(10_010);
    t.record("tick 10010", e);
    t.streamer.open(ConnId(3), 6, false);
    let e = t.streamer.subscribe(
        ConnId(3),
        ctx("rm", "t", SubscriberMode::Backup, RV, "0a"),
        20,
    );
    t.record("subscribe #3 backup at 0a", e);
    let e = t.streamer.catchup_rows(ConnId(3), log_tx("0b", &[]));
    t.record("catchup rows 0b", e);
    t.check(
        r#"
> subscribe #1 with replica version 02
send #1 {"id":1,"msg":["error",{"type":1,"message":"current replica version is 01 (requested 02)"}]}
> ack #1 1
close #1 1000 error delivered
> subscribe #2 at 0a
fetch catchup #2 0a..=0c
> catchup rows 0b
send #2 {"id":1,"msg":["error",{"type":2,"message":"earliest supported watermark is 0b (requested 0a)"}]}
> tick 10009
> tick 10010
close #2 1000 error not acknowledged in time
> subscribe #3 backup at 0a
fetch catchup #3 0a..=0c
> catchup rows 0b
send #3 {"id":1,"msg":["error",{"type":2,"message":"earliest supported watermark is 0b (requested 0a)"}]}
"#,
    );
}

// ---- subscribe and catch-up (change-stream.md, "Catch-up"; storer, change-streamer-service) ----

#[test]
fn subscriber_ahead_of_change_log_is_caught_up_without_error() {
    let mut s = streamer_at("0c", RV);
    let c = ConnId(1);
    s.open(c, 6, false);
    // Behind the forwarded stream, ahead of what the log has durably: no row at all.
    unwrap_ok(s.on_upstream(begin("0e")));
    unwrap_ok(s.on_upstream(commit("0e")));
    let e = s.subscribe(c, serving("0d"), 0);
    assert!(has(&e, "fetch catchup #1 0d..=0e"));
    let e = s.catchup_done(c);
    assert_eq!(messages_to(&e, c), [r#"["status",{"tag":"status"}]"#]);
    // Ahead of everything forwarded: no read needed.
    s.open(ConnId(2), 6, false);
    let e = s.subscribe(ConnId(2), serving("0z"), 0);
    assert_eq!(
        messages_to(&e, ConnId(2)),
        [r#"["status",{"tag":"status"}]"#]
    );
    assert_eq!(s.subscriber(ConnId(2)).map(|s| s.phase), Some(Phase::Live));
    unwrap_ok(s.on_upstream(begin("0f")));
    let e = unwrap_ok(s.on_upstream(commit("0f")));
    assert!(messages_to(&e, ConnId(2)).is_empty());
    assert_eq!(messages_to(&e, c).len(), 1);
}

#[test]
fn subscriber_at_the_last_commit_goes_live_at_once() {
    let mut s = streamer_at("0c", RV);
    s.open(ConnId(1), 6, false);
    let e = s.subscribe(ConnId(1), serving("0c"), 0);
    assert!(!e.iter().any(|e| matches!(e, Effect::FetchCatchup { .. })));
    assert_eq!(s.subscriber(ConnId(1)).map(|s| s.phase), Some(Phase::Live));
}

#[test]
fn replica_version_watermark_after_its_seed_rows_were_purged_is_too_old() {
    // The seed rows at the replica version were purged: the subscriber's replica lacks the
    // changes before 0b, so it is told rather than silently served from 0b.
    let mut s = streamer_at("0c", "0b");
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving(RV), 0);
    let e = s.catchup_rows(c, log_tx("0b", &[2]));
    let got = messages_to(&e, c);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].starts_with(r#"["error",{"type":2"#), "{got:?}");
}

#[test]
fn catchup_excludes_the_subscribers_own_transaction() {
    let mut s = streamer_at("0c", RV);
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0b"), 0);
    let mut rows = log_tx("0b", &[1, 2]);
    rows.extend(log_tx("0c", &[3]));
    let e = s.catchup_rows(c, rows);
    let got = messages_to(&e, c);
    assert_eq!(got.len(), 4);
    assert!(got
        .iter()
        .skip(1)
        .all(|m| !m.contains(r#""0b""#) && !m.contains(r#""id":1"#)));
}

#[test]
fn wrong_replica_version_is_error_type_1() {
    let mut s = streamer_at("0c", RV);
    s.open(ConnId(1), 8, false);
    let e = s.subscribe(
        ConnId(1),
        ctx("vs", "t", SubscriberMode::Serving, "0a", "0c"),
        0,
    );
    assert_eq!(
        messages_to(&e, ConnId(1)),
        [r#"["error",{"type":1,"message":"current replica version is 01 (requested 0a)"}]"#]
    );
    // Not registered: the stream does not reach it.
    unwrap_ok(s.on_upstream(begin("0d")));
    let e = unwrap_ok(s.on_upstream(commit("0d")));
    assert!(sent_to(&e, ConnId(1)).is_empty());
}

#[test]
fn first_message_is_status_for_v2_and_later_never_for_v1() {
    for (version, first) in [(1, r#"["begin""#), (2, r#"["status""#), (8, r#"["status""#)] {
        let mut s = streamer_at("0c", RV);
        let c = ConnId(1);
        s.open(c, version, false);
        s.subscribe(c, serving("0b"), 0);
        let mut rows = log_tx("0b", &[]);
        rows.extend(log_tx("0c", &[]));
        let mut e = s.catchup_rows(c, rows);
        e.extend(s.catchup_done(c));
        // Live statuses are withheld from v1 as well.
        e.extend(unwrap_ok(s.on_upstream(status())));
        e.extend(s.on_upstream_drained());
        let got = messages_to(&e, c);
        assert!(got[0].starts_with(first), "v{version}: {got:?}");
        let statuses = got.iter().filter(|m| m.starts_with(r#"["status""#)).count();
        assert_eq!(statuses, if version < 2 { 0 } else { 2 }, "v{version}");
    }
}

#[test]
fn in_transaction_subscriber_is_queued_until_commit() {
    let mut s = streamer_at("0c", RV);
    let c = ConnId(1);
    s.open(c, 6, false);
    unwrap_ok(s.on_upstream(begin("0d")));
    let e = s.subscribe(c, serving("0c"), 0);
    assert!(e.is_empty(), "{:?}", lines(&e));
    assert_eq!(s.subscriber(c).map(|s| s.phase), Some(Phase::Queued));
    let e = unwrap_ok(s.on_upstream(insert(1)));
    assert!(sent_to(&e, c).is_empty());
    let e = unwrap_ok(s.on_upstream(commit("0d")));
    // It starts after the commit, reading it from the log (it got none of it live).
    assert!(sent_to(&e, c).is_empty());
    assert!(has(&e, "fetch catchup #1 0c..=0d"));
    let e = s.catchup_rows(c, log_tx("0c", &[]).into_iter().chain(log_tx("0d", &[1])));
    assert_eq!(messages_to(&e, c).len(), 4);
}

#[test]
fn in_transaction_subscriber_is_queued_until_rolled_back() {
    let mut s = streamer_at("0c", RV);
    let c = ConnId(1);
    s.open(c, 6, false);
    unwrap_ok(s.on_upstream(begin("0d")));
    s.subscribe(c, serving("0c"), 0);
    let e = unwrap_ok(s.on_upstream(msg(r#"["rollback",{"tag":"rollback"}]"#)));
    assert!(has(&e, "store abort"));
    assert!(sent_to(&e, c).iter().all(|f| !f.contains("rollback")));
    // Nothing was committed after its watermark: live at once.
    assert_eq!(s.subscriber(c).map(|s| s.phase), Some(Phase::Live));
    assert_eq!(messages_to(&e, c), [r#"["status",{"tag":"status"}]"#]);
}

#[test]
fn catchup_pauses_while_too_much_is_unacknowledged() {
    let mut config = config();
    config.backlog_high_water_bytes = 200;
    let mut s = Streamer::new(
        config,
        ChangeLogState {
            last_watermark: w("0f"),
            min_watermark: w(RV),
        },
    );
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0a"), 0);
    let mut rows = log_tx("0a", &[]);
    for wm in ["0b", "0c", "0d"] {
        rows.extend(log_tx(wm, &[1]));
    }
    let e = s.catchup_rows(c, rows);
    assert!(has(&e, "pause catchup #1"));
    let frames = sent_to(&e, c).len() as u64;
    let mut resumed = false;
    for id in 1..=frames {
        resumed |= has(&s.on_ack(c, id, 0), "resume catchup #1");
    }
    assert!(resumed);
}

// ---- backlog and back-pressure (change-stream.md, "Acks and back-pressure"; subscriber.test) ----

fn small_streamer(high: usize) -> Streamer {
    let mut config = config();
    config.backlog_high_water_bytes = high;
    config.backlog_full_timeout_ms = Some(5_000);
    Streamer::new(
        config,
        ChangeLogState {
            last_watermark: w("0c"),
            min_watermark: w(RV),
        },
    )
}

#[test]
fn backlog_back_pressure_pauses_upstream_until_low_water() {
    let mut s = small_streamer(300);
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0b"), 0);
    let mut paused = false;
    let mut n = 0;
    while !paused {
        n += 1;
        let wm = crate::watermark::encode_lexi(100 + n);
        let e = unwrap_ok(s.on_upstream(begin(&wm)));
        paused |= has(&e, "pause upstream");
        let e = unwrap_ok(s.on_upstream(commit(&wm)));
        paused |= has(&e, "pause upstream");
        assert!(n < 20, "never paused");
    }
    assert!(s.is_upstream_paused());
    let backlog = s.subscriber(c).map(|s| s.backlog_bytes).unwrap_or_default();
    assert!(backlog >= 300);
    // Catch-up ends; draining alone does not resume: the bytes count until acked.
    let mut e = s.catchup_rows(c, log_tx("0b", &[]).into_iter().chain(log_tx("0c", &[])));
    e.extend(s.catchup_done(c));
    assert!(!has(&e, "resume upstream"));
    let mut id = 0;
    let mut resumed = false;
    while !resumed {
        id += 1;
        let e = s.on_ack(c, id, 0);
        resumed = has(&e, "resume upstream");
        assert!(id < 100, "never resumed");
    }
    let backlog = s.subscriber(c).map(|s| s.backlog_bytes).unwrap_or_default();
    assert!(backlog <= 240, "{backlog}");
}

#[test]
fn subscriber_whose_backlog_stays_full_is_disconnected() {
    let mut s = small_streamer(100);
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0b"), 1_000);
    let mut e = unwrap_ok(s.on_upstream(begin("0d")));
    e.extend(unwrap_ok(s.on_upstream(insert(1))));
    e.extend(unwrap_ok(s.on_upstream(commit("0d"))));
    assert!(has(&e, "pause upstream"));
    assert_eq!(s.next_deadline(), Some(6_000));
    assert!(s.tick(5_999).is_empty());
    let e = s.tick(6_000);
    assert_eq!(
        lines(&e),
        [
            "close #1 1013 Error: subscriber backlog stayed above 100 bytes for 5000 ms",
            "resume upstream"
        ]
    );
}

/// A live subscriber that stops acking used to get every later frame queued for it without
/// limit; its unacknowledged live bytes now hold up the stream like a full backlog.
#[test]
fn live_subscriber_that_stops_acking_pauses_upstream_and_is_disconnected() {
    let mut s = small_streamer(300);
    let c = ConnId(1);
    s.open(c, 6, false);
    let e = s.subscribe(c, serving("0c"), 1_000);
    assert_eq!(sent_to(&e, c).len(), 1, "{e:?}");
    assert_eq!(s.subscriber(c).map(|s| s.phase), Some(Phase::Live));
    let mut sent = 0;
    let mut n = 0;
    loop {
        n += 1;
        assert!(n < 20, "never paused");
        let wm = crate::watermark::encode_lexi(100 + n);
        let mut e = unwrap_ok(s.on_upstream(begin(&wm)));
        e.extend(unwrap_ok(s.on_upstream(commit(&wm))));
        // Everything still goes out at once: live messages are not held back.
        sent += sent_to(&e, c).len();
        assert_eq!(sent, 2 * n as usize);
        if has(&e, "pause upstream") {
            break;
        }
    }
    let status = s.subscriber(c).expect("subscribed");
    assert!(status.live_bytes_in_flight >= 300);
    assert_eq!(status.backlog_bytes, 0);
    assert_eq!(s.next_deadline(), Some(6_000));
    assert!(s.tick(5_999).is_empty());
    assert_eq!(
        lines(&s.tick(6_000)),
        [
            "close #1 1013 Error: subscriber backlog stayed above 300 bytes for 5000 ms",
            "resume upstream"
        ]
    );
}

#[test]
fn live_subscriber_acking_again_resumes_upstream_at_low_water() {
    let mut s = small_streamer(300);
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0c"), 0);
    let mut n = 0;
    while !s.is_upstream_paused() {
        n += 1;
        assert!(n < 20, "never paused");
        let wm = crate::watermark::encode_lexi(100 + n);
        unwrap_ok(s.on_upstream(begin(&wm)));
        unwrap_ok(s.on_upstream(commit(&wm)));
    }
    // Frame 1 is the initial status; each ack releases one message's bytes.
    let mut id = 0;
    while s.is_upstream_paused() {
        id += 1;
        let in_flight = s.subscriber(c).map(|s| s.live_bytes_in_flight);
        assert!(in_flight > Some(240), "{in_flight:?}");
        s.on_ack(c, id, 0);
    }
    let in_flight = s.subscriber(c).map(|s| s.live_bytes_in_flight);
    assert!(in_flight <= Some(240), "{in_flight:?}");
    assert_eq!(s.next_deadline(), None);
}

#[test]
fn close_with_error_sends_it_and_waits_for_its_ack() {
    let mut s = streamer_at("0c", "0b");
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0a"), 0);
    let e = s.catchup_rows(c, log_tx("0b", &[]));
    assert_eq!(sent_to(&e, c).len(), 1);
    assert!(!e.iter().any(|e| matches!(e, Effect::Close { .. })));
    // Nothing more reaches a failed subscriber.
    unwrap_ok(s.on_upstream(begin("0d")));
    let e = unwrap_ok(s.on_upstream(commit("0d")));
    assert!(sent_to(&e, c).is_empty());
    assert_eq!(lines(&s.on_ack(c, 1, 0)), ["close #1 1000 error delivered"]);
}

#[test]
fn out_of_order_ack_closes_the_connection() {
    let mut s = streamer_at("0c", RV);
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0c"), 0);
    unwrap_ok(s.on_upstream(begin("0d")));
    assert_eq!(
        lines(&s.on_ack(c, 2, 0)),
        ["close #1 1002 Error: expected an ack of frame 1, found an ack of frame 2"]
    );
    assert_eq!(s.subscriber(c), None);
}

#[test]
fn acks_of_commit_frames_advance_acked_monotonically() {
    let mut s = streamer_at("0c", RV);
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0c"), 0);
    unwrap_ok(s.on_upstream(begin("0d")));
    unwrap_ok(s.on_upstream(commit("0d")));
    let acked = |s: &Streamer| s.subscriber(c).map(|s| s.acked.to_string());
    assert_eq!(acked(&s), Some("0c".to_owned()));
    s.on_ack(c, 1, 0); // status
    s.on_ack(c, 2, 0); // begin
    assert_eq!(acked(&s), Some("0c".to_owned()));
    s.on_ack(c, 3, 0); // commit
    assert_eq!(acked(&s), Some("0d".to_owned()));
}

#[test]
fn client_frames_on_legacy_connections_are_acks_only() {
    let mut s = streamer_at("0c", RV);
    s.open(ConnId(1), 6, false);
    let e = s.on_client_frame(
        ConnId(1),
        r#"{"id":1,"msg":["reserve-snapshot",{"taskID":"t"}]}"#,
        0,
    );
    assert_eq!(
        lines(&e),
        ["close #1 1002 Error: expected only acks from a v6 subscriber, found an application frame"]
    );
    s.open(ConnId(2), 7, false);
    let e = s.on_client_frame(ConnId(2), r#"{"id":1,"msg":["bogus",{}]}"#, 0);
    assert!(matches!(&e[..], [Effect::Close { code: 1002, .. }]));
}

// ---- per-version delivery (change-stream.md, "Protocol versions", "Acks and back-pressure") ----

#[test]
fn update_table_metadata_is_withheld_below_v5_and_key_columns_added() {
    let mut s = streamer_at("0c", RV);
    for (conn, version) in [(1, 4), (2, 5)] {
        s.open(ConnId(conn), version, false);
        s.subscribe(ConnId(conn), serving("0c"), 0);
    }
    unwrap_ok(s.on_upstream(begin("0d")));
    let e = unwrap_ok(s.on_upstream(msg(
        r#"["data",{"tag":"update-table-metadata","table":{"schema":"s","name":"t"},"old":{"rowKey":{}},"new":{"rowKey":{}}}]"#,
    )));
    assert!(sent_to(&e, ConnId(1)).is_empty());
    assert_eq!(sent_to(&e, ConnId(2)).len(), 1);
    let e = unwrap_ok(s.on_upstream(insert(9)));
    let v4 = messages_to(&e, ConnId(1));
    let v5 = messages_to(&e, ConnId(2));
    assert!(v4[0].contains(r#""keyColumns":["id"]"#), "{v4:?}");
    assert!(!v5[0].contains("keyColumns"));
}

#[test]
fn a_burst_reaches_a_batching_subscriber_as_one_frame_with_one_ack() {
    let mut s = streamer_at("0c", RV);
    let (v8, v6) = (ConnId(1), ConnId(2));
    s.open(v8, 8, false);
    s.open(v6, 6, false);
    s.subscribe(v8, serving("0c"), 0);
    s.subscribe(v6, serving("0c"), 0);
    let mut during = Vec::new();
    for (n, wm) in ["0d", "0e", "0f"].into_iter().enumerate() {
        during.extend(unwrap_ok(s.on_upstream(begin(wm))));
        during.extend(unwrap_ok(s.on_upstream(insert(n as u64))));
        during.extend(unwrap_ok(s.on_upstream(commit(wm))));
    }
    // The v6 subscriber takes no batches: one frame per message, at once.
    assert_eq!(sent_to(&during, v6).len(), 9);
    assert!(sent_to(&during, v8).is_empty(), "held until the burst ends");
    let status = s.subscriber(v8).expect("registered");
    assert!(
        status.live_bytes_in_flight > 0,
        "held bytes count against the bound"
    );
    let flushed = s.on_upstream_drained();
    let frames = sent_to(&flushed, v8);
    assert_eq!(frames.len(), 1, "{frames:?}");
    // Frame 1 was the initial status, sent at the subscription.
    assert!(
        frames[0].starts_with(r#"{"id":2,"batch":[["begin""#),
        "{}",
        frames[0]
    );
    let got = messages_to(&flushed, v8);
    assert_eq!(got.len(), 9, "3 × begin, insert, commit");
    assert!(got[8].contains(r#""0f""#));
    assert!(s.on_upstream_drained().is_empty(), "nothing is sent twice");
    // One ack releases the whole burst and acknowledges its last commit.
    s.on_ack(v8, 1, 10);
    s.on_ack(v8, 2, 10);
    let status = s.subscriber(v8).expect("registered");
    assert_eq!(status.live_bytes_in_flight, 0);
    assert_eq!(status.acked, w("0f"));
    assert_eq!(status.outstanding_frames, 0);
}

#[test]
fn held_messages_wait_out_a_keepalive_and_go_before_the_end_of_the_stream() {
    let mut s = streamer_at("0c", RV);
    let c = ConnId(1);
    s.open(c, 8, false);
    s.subscribe(c, serving("0c"), 0);
    unwrap_ok(s.on_upstream(begin("0d")));
    unwrap_ok(s.on_upstream(commit("0d")));
    // A keepalive from upstream does not end the burst (more may be queued behind it)…
    assert!(messages_to(&s.on_idle(), c).is_empty());
    // …the host's empty queue does.
    let e = s.on_upstream_drained();
    assert_eq!(messages_to(&e, c).len(), 2);
    unwrap_ok(s.on_upstream(begin("0e")));
    // The stream ending rolls the open transaction back, after what was held.
    let e = s.upstream_ended();
    let got = messages_to(&e, c);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got[0].starts_with(r#"["begin""#) && got[1].starts_with(r#"["rollback""#));
}

#[test]
fn live_messages_share_one_serialization() {
    let mut s = streamer_at("0c", RV);
    for conn in 1..=3 {
        s.open(ConnId(conn), 6 + (conn as u32 % 3), false);
        s.subscribe(ConnId(conn), serving("0c"), 0);
    }
    unwrap_ok(s.on_upstream(begin("0d")));
    s.on_upstream_drained();
    let mut e = unwrap_ok(s.on_upstream(insert(1)));
    e.extend(s.on_upstream_drained());
    let shared: Vec<&Arc<str>> = e
        .iter()
        .filter_map(|e| match e {
            Effect::Send {
                frame: Outgoing::Message { message, .. },
                ..
            } => Some(message),
            _ => None,
        })
        .collect();
    assert_eq!(shared.len(), 3);
    assert!(shared.windows(2).all(|p| Arc::ptr_eq(p[0], p[1])));
}

// ---- upstream (change-stream.md, "Forward, store, ack") ----

#[test]
fn upstream_protocol_violations_are_rejected_without_effect() {
    let mut s = streamer_at("0c", RV);
    assert_eq!(
        s.on_upstream(insert(1)).map_err(|e| e.to_string()).err(),
        Some("expected a begin or a status between transactions, found insert".to_owned())
    );
    assert!(matches!(
        s.on_upstream(begin("0c")),
        Err(UpstreamError::NotIncreasing { .. })
    ));
    unwrap_ok(s.on_upstream(begin("0d")));
    assert!(matches!(
        s.on_upstream(begin("0e")),
        Err(UpstreamError::NestedBegin { .. })
    ));
    assert_eq!(
        s.on_upstream(commit("0e")).map_err(|e| e.to_string()).err(),
        Some("expected a commit at 0d (the begin's commitWatermark), found 0e".to_owned())
    );
    assert!(matches!(
        s.on_upstream(msg(r#"["error",{"type":0}]"#)),
        Err(UpstreamError::NotFromSource { .. })
    ));
    // The transaction is still open and can finish.
    assert!(s.in_transaction());
    unwrap_ok(s.on_upstream(commit("0d")));
    assert_eq!(s.last_commit(), &w("0d"));
}

#[test]
fn upstream_ending_mid_transaction_rolls_back_subscribers_and_storage() {
    let mut s = streamer_at("0c", RV);
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0c"), 0);
    unwrap_ok(s.on_upstream(begin("0d")));
    unwrap_ok(s.on_upstream(insert(1)));
    let e = s.upstream_ended();
    assert_eq!(
        lines(&e),
        [
            "store abort",
            r#"send #1 {"id":4,"msg":["rollback",{"tag":"rollback"}]}"#
        ]
    );
    assert!(!s.in_transaction());
    // The restarted stream replays the same transaction in full.
    unwrap_ok(s.on_upstream(begin("0d")));
    unwrap_ok(s.on_upstream(insert(1)));
    let e = unwrap_ok(s.on_upstream(commit("0d")));
    assert_eq!(messages_to(&e, c).len(), 1);
    assert_eq!(s.subscriber(c).map(|s| s.watermark), Some(w("0d")));
}

// ---- snapshot reservations (change-stream.md, "Reservations and snapshots") ----

fn backup(wm: &str) -> BackupWatermark {
    BackupWatermark {
        watermark: w(wm),
        replica_size: None,
    }
}

#[test]
fn reservation_is_confirmed_once_with_the_backup_watermark() {
    let mut s = streamer_at("0c", RV);
    s.open(ConnId(1), 6, false);
    assert!(s.reserve(ConnId(1), "t1", 0).is_empty());
    let e = s.backup_watermark(backup("0a"), 0);
    assert_eq!(
        messages_to(&e, ConnId(1)),
        [
            r#"["status",{"tag":"status","backupURL":"s3://backups/replica","replicaVersion":"01","minWatermark":"0a"}]"#
        ]
    );
    // Idempotent: later backups do not confirm again; repeated ones are ignored.
    assert!(s.backup_watermark(backup("0b"), 0).is_empty());
    assert!(s.backup_watermark(backup("0a"), 0).is_empty());
    // A reservation opened after a backup is known is confirmed at once.
    s.open(ConnId(2), 8, false);
    let e = s.reserve(ConnId(2), "t2", 0);
    assert_eq!(
        messages_to(&e, ConnId(2)),
        [
            r#"["reserved",{"tag":"snapshot","backupURL":"s3://backups/replica","replicaVersion":"01","minWatermark":"0b"}]"#
        ]
    );
}

#[test]
fn reservation_waits_while_the_log_starts_after_the_backup() {
    let mut s = streamer_at("0c", "0b");
    s.open(ConnId(1), 7, false);
    s.reserve(ConnId(1), "t1", 0);
    let e = s.backup_watermark(backup("0a"), 0);
    assert!(sent_to(&e, ConnId(1)).is_empty());
    assert!(matches!(&e[..], [Effect::Warn { .. }]));
    let e = s.backup_watermark(backup("0b"), 0);
    assert_eq!(sent_to(&e, ConnId(1)).len(), 1);
}

#[test]
fn reservation_of_the_same_task_replaces_the_older_one() {
    let mut s = streamer_at("0c", RV);
    s.open(ConnId(1), 6, false);
    s.open(ConnId(2), 6, false);
    s.reserve(ConnId(1), "t1", 0);
    let e = s.reserve(ConnId(2), "t1", 0);
    assert_eq!(
        lines(&e),
        ["close #1 1000 snapshot reservation of t1 replaced by a newer one"]
    );
    let e = s.backup_watermark(backup("0a"), 0);
    assert!(sent_to(&e, ConnId(1)).is_empty());
    assert_eq!(sent_to(&e, ConnId(2)).len(), 1);
}

#[test]
fn reservation_is_released_after_its_task_subscribes() {
    let mut s = streamer_at("0c", RV);
    s.open(ConnId(1), 6, false);
    s.reserve(ConnId(1), "t1", 0);
    s.backup_watermark(backup("0a"), 0);
    s.open(ConnId(2), 6, false);
    let e = s.subscribe(
        ConnId(2),
        ctx("vs", "t1", SubscriberMode::Serving, RV, "0a"),
        0,
    );
    let first = lines(&e);
    assert_eq!(
        first[0],
        "close #1 1000 snapshot reservation of t1 ended by its subscription"
    );
    // Released: a purge is bounded by the subscriber (at 0a) and no longer by the reservation.
    s.on_stored(w("0c")).expect("accepted");
    s.backup_watermark(backup("0c"), 1);
    assert_eq!(lines(&s.tick(30_001)), ["purge below 0a"]);
}

#[test]
fn reservation_is_cancelled_when_its_connection_closes() {
    let mut s = streamer_at("0c", RV);
    s.open(ConnId(1), 7, false);
    s.reserve(ConnId(1), "t1", 0);
    s.backup_watermark(backup("0a"), 0);
    s.on_close(ConnId(1));
    s.backup_watermark(backup("0c"), 10);
    assert_eq!(lines(&s.tick(30_010)), ["purge below 0c"]);
}

#[test]
fn reservations_are_refused_without_backups() {
    let mut s = Streamer::new(
        StreamerConfig::new(w(RV)),
        ChangeLogState {
            last_watermark: w("0c"),
            min_watermark: w(RV),
        },
    );
    s.open(ConnId(1), 6, false);
    assert_eq!(
        lines(&s.reserve(ConnId(1), "t1", 0)),
        ["close #1 1002 Error: backups are not configured"]
    );
}

// ---- purging (change-stream.md, "Purging") ----

#[test]
fn purge_floor_holds_at_confirmed_reservations_and_subscriber_acks() {
    let mut s = streamer_at("0f", RV);
    s.on_stored(w("0f")).expect("accepted");
    s.open(ConnId(1), 6, false);
    s.reserve(ConnId(1), "t1", 0);
    s.backup_watermark(backup("0b"), 0); // confirms t1 at 0b
    s.backup_watermark(backup("0d"), 1_000);
    // The first due backup (0b) and the reservation both say 0b.
    assert_eq!(lines(&s.tick(30_000)), ["purge below 0b"]);
    assert!(s.tick(30_500).is_empty());
    // The reservation pins 0b even once the backup at 0d is due.
    assert!(s.tick(31_000).is_empty());
    s.on_close(ConnId(1));
    s.open(ConnId(2), 6, false);
    s.subscribe(ConnId(2), serving("0c"), 0);
    s.backup_watermark(backup("0e"), 2_000);
    assert_eq!(lines(&s.tick(32_000)), ["purge below 0c"]);
}

#[test]
fn purge_never_removes_the_newest_stored_transaction() {
    let mut s = streamer_at("0c", RV);
    s.backup_watermark(backup("0z"), 0);
    // No subscribers, no reservations: bounded by the newest stored commit only.
    assert_eq!(lines(&s.tick(30_000)), ["purge below 0c"]);
    s.on_purged(w("0c"));
    s.backup_watermark(backup("110"), 1);
    assert!(s.tick(30_001).is_empty());
}

// ---- v8 backfill tracking (change-stream.md, "Backfills") ----

fn backfill_request(column: &str, progress: Option<&str>) -> BackfillRequest {
    let progress = progress
        .map(|p| format!(r#","progress":{{"progressMark":"{p}"}}"#))
        .unwrap_or_default();
    let text = format!(
        r#"{{"table":{{"schema":"s","name":"t","metadata":null}},"columns":{{"{column}":{{"id":{{"attNum":2}}{progress}}}}}}}"#
    );
    decode_backfill_request_value(parse_json(&text).expect("json")).expect("request")
}

fn v8(wm: &str, backfills: Vec<BackfillRequest>) -> SubscribeContext {
    let mut c = serving(wm);
    c.backfills = Some(backfills);
    c
}

fn v8_at(wm: &str) -> SubscribeContext {
    let mut c = serving(wm);
    c.id = "vs8".to_owned();
    c
}

#[test]
fn aligned_v8_subscriber_with_uncovered_backfills_restarts_upstream_at_a_boundary() {
    let mut s = streamer_at("0c", RV);
    assert!(s.start_upstream(Vec::new()).is_empty());
    let c = ConnId(1);
    s.open(c, 8, false);
    unwrap_ok(s.on_upstream(begin("0d")));
    s.subscribe(c, v8("0c", vec![backfill_request("b", Some("m5"))]), 0);
    // Aligned when its catch-up ends, but mid-transaction: the restart waits for the commit.
    let e = unwrap_ok(s.on_upstream(commit("0d")));
    assert!(!e
        .iter()
        .any(|e| matches!(e, Effect::RestartUpstream { .. })));
    let mut e = s.catchup_rows(c, log_tx("0c", &[]).into_iter().chain(log_tx("0d", &[])));
    e.extend(s.catchup_done(c));
    assert!(has(
        &e,
        "restart upstream: subscriber vs/1 needs backfills that are not covered by the current stream: s.t.b"
    ));
    // Signalled once; the new stream requests the subscriber's backfill from its mark.
    assert!(s.on_idle().is_empty());
    s.upstream_ended();
    let requests = s.start_upstream(Vec::new());
    assert_eq!(requests, [backfill_request("b", Some("m5"))]);
}

#[test]
fn covered_v8_subscriber_and_v7_subscriber_do_not_restart() {
    let mut s = streamer_at("0c", RV);
    s.start_upstream(vec![backfill_request("b", None)]);
    s.open(ConnId(1), 8, false);
    let e = s.subscribe(
        ConnId(1),
        v8("0c", vec![backfill_request("b", Some("m5"))]),
        0,
    );
    assert!(!e
        .iter()
        .any(|e| matches!(e, Effect::RestartUpstream { .. })));
    // A v7 subscriber's backfills are not tracked at all.
    s.open(ConnId(2), 7, false);
    let e = s.subscribe(ConnId(2), v8("0c", vec![backfill_request("x", None)]), 0);
    assert!(!e
        .iter()
        .any(|e| matches!(e, Effect::RestartUpstream { .. })));
    assert!(s.backfills().subscriber("vs/2").is_none());
}

#[test]
fn forwarded_backfill_messages_move_the_subscribers_progress() {
    let mut s = streamer_at("0c", RV);
    s.start_upstream(vec![backfill_request("b", None)]);
    let c = ConnId(1);
    s.open(c, 8, false);
    s.subscribe(c, v8("0c", vec![backfill_request("b", None)]), 0);
    let mut skip = Begin::new(w("0c.01"));
    skip.skip_ack = Some(true);
    unwrap_ok(s.on_upstream(DownstreamMessage::Begin(skip)));
    unwrap_ok(s.on_upstream(msg(
        r#"["data",{"tag":"backfill","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"columns":["b"],"watermark":"0c","rowValues":[[1,"x"]],"progressMarks":{"current":{"progressMark":"m1"}}}]"#,
    )));
    unwrap_ok(s.on_upstream(commit("0c.01")));
    let requests = |s: &Streamer| {
        s.backfills()
            .subscriber("vs/1")
            .map(|b| b.requests())
            .unwrap_or_default()
    };
    // The subscriber has its progress with the commit, which waits to be durable.
    assert_eq!(requests(&s), [backfill_request("b", None)]);
    s.on_stored(w("0c.01")).expect("accepted");
    assert_eq!(requests(&s), [backfill_request("b", Some("m1"))]);
}

/// A backfill (`skipAck`) transaction, retried from a later snapshot if it is lost, may commit
/// at another watermark: its commit reaches subscribers only once it is durable.
#[test]
fn a_backfill_commit_reaches_subscribers_only_once_durable() {
    let mut s = streamer_at("0c", RV);
    let (v6, v8) = (ConnId(1), ConnId(2));
    s.open(v6, 6, false);
    s.open(v8, 8, false);
    s.subscribe(v6, serving("0c"), 0);
    s.subscribe(v8, v8_at("0c"), 0);
    let mut skip = Begin::new(w("0c.01"));
    skip.skip_ack = Some(true);
    let mut e = unwrap_ok(s.on_upstream(DownstreamMessage::Begin(skip)));
    e.extend(unwrap_ok(s.on_upstream(insert(1))));
    e.extend(unwrap_ok(s.on_upstream(commit("0c.01"))));
    e.extend(s.on_upstream_drained());
    assert!(has_prefix(&e, "store commit 0c.01/"), "{:?}", lines(&e));
    assert!(has(&e, "pause upstream"), "{:?}", lines(&e));
    assert!(s.holds_commit());
    for conn in [v6, v8] {
        let got = messages_to(&e, conn);
        assert!(
            got.iter().any(|m| m.starts_with(r#"["begin""#)),
            "{conn}: {got:?}"
        );
        assert!(
            !got.iter().any(|m| m.starts_with(r#"["commit""#)),
            "{conn} got the commit before it was durable: {got:?}"
        );
    }
    // What the host still feeds waits behind the held commit: not forwarded, not stored yet.
    let e = unwrap_ok(s.on_upstream(begin("0d")));
    assert!(e.is_empty(), "{:?}", lines(&e));
    // An older commit made durable releases nothing.
    let e = s.on_stored(w("0c")).expect("accepted");
    assert!(e.is_empty(), "{:?}", lines(&e));
    let mut e = s.on_stored(w("0c.01")).expect("accepted");
    e.extend(s.on_upstream_drained());
    assert!(!s.holds_commit());
    assert!(has(&e, "resume upstream"), "{:?}", lines(&e));
    assert!(has_prefix(&e, "store begin 0d/"), "{:?}", lines(&e));
    for conn in [v6, v8] {
        let got = messages_to(&e, conn);
        assert_eq!(got.len(), 2, "{conn}: {got:?}");
        assert!(got[0].starts_with(r#"["commit""#), "{conn}: {got:?}");
        assert!(got[0].contains(r#""0c.01""#), "{conn}: {got:?}");
        assert!(got[1].starts_with(r#"["begin""#), "{conn}: {got:?}");
    }
    // An upstream transaction's commit is not held.
    let mut e = unwrap_ok(s.on_upstream(commit("0d")));
    e.extend(s.on_upstream_drained());
    assert!(!s.holds_commit());
    assert!(messages_to(&e, v6)[0].starts_with(r#"["commit""#));
}

#[test]
fn messages_behind_a_held_commit_from_an_ended_stream_are_dropped() {
    let mut s = streamer_at("0c", RV);
    let c = ConnId(1);
    s.open(c, 6, false);
    s.subscribe(c, serving("0c"), 0);
    let mut skip = Begin::new(w("0c.01"));
    skip.skip_ack = Some(true);
    unwrap_ok(s.on_upstream(DownstreamMessage::Begin(skip)));
    unwrap_ok(s.on_upstream(commit("0c.01")));
    unwrap_ok(s.on_upstream(begin("0d")));
    unwrap_ok(s.on_upstream(insert(4)));
    // The stream ends; the next one sends 0d again.
    let e = s.upstream_ended();
    assert!(!has(&e, "store abort"), "{:?}", lines(&e));
    assert!(s.holds_commit(), "its store is already asked for");
    // A subscriber arriving meanwhile waits for the held transaction to end.
    let late = ConnId(2);
    s.open(late, 6, false);
    let e = s.subscribe(late, serving("0c"), 0);
    assert!(!has_prefix(&e, "fetch"), "{:?}", lines(&e));
    let e = s.on_stored(w("0c.01")).expect("accepted");
    let got = messages_to(&e, c);
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(got[0].starts_with(r#"["commit""#));
    assert!(!has_prefix(&e, "store begin 0d/"), "{:?}", lines(&e));
    assert!(
        has_prefix(&e, "fetch catchup #2 "),
        "the late subscriber catches up from the log: {:?}",
        lines(&e)
    );
}

// ---- property: every subscriber gets every transaction once, in order, without gaps ----

mod simulation {
    use std::collections::{BTreeMap, BTreeSet, VecDeque};

    use proptest::prelude::*;

    use super::*;
    use crate::change_stream::Frame;
    use crate::watermark::encode_lexi;

    const HIGH: usize = 400;

    #[derive(Debug, Clone)]
    struct TxSpec {
        rows: u8,
        /// A backfill's transaction: its commit must not reach anyone before it is durable.
        skip_ack: bool,
        rollback: bool,
        interrupted: bool,
        status_inside: bool,
        keepalive_after: bool,
    }

    #[derive(Debug, Clone)]
    enum Op {
        Feed,
        /// The host finds its upstream queue empty for now.
        Drained,
        Store,
        Catchup {
            conn: usize,
            rows: usize,
        },
        Ack {
            conn: usize,
            frames: usize,
        },
        Join {
            version: usize,
            at: usize,
        },
        Leave {
            conn: usize,
        },
    }

    fn tx_spec() -> impl Strategy<Value = TxSpec> {
        (0u8..4, 0u8..4, 0u8..8, 0u8..8, any::<bool>(), any::<bool>()).prop_map(
            |(rows, skip_ack, rollback, interrupted, status_inside, keepalive_after)| TxSpec {
                rows,
                skip_ack: skip_ack == 0,
                rollback: rollback == 0,
                interrupted: interrupted == 0,
                status_inside,
                keepalive_after,
            },
        )
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => Just(Op::Feed),
            2 => Just(Op::Drained),
            4 => Just(Op::Store),
            4 => (0usize..8, 1usize..6).prop_map(|(conn, rows)| Op::Catchup { conn, rows }),
            5 => (0usize..8, 1usize..4).prop_map(|(conn, frames)| Op::Ack { conn, frames }),
            2 => (0usize..7, 0usize..100).prop_map(|(version, at)| Op::Join { version, at }),
            1 => (0usize..8).prop_map(|conn| Op::Leave { conn }),
        ]
    }

    enum Step {
        Message(Box<DownstreamMessage>),
        Ended,
        Idle,
    }

    /// A committed upstream transaction: its insert ids.
    type Committed = BTreeMap<Watermark, Vec<u64>>;

    fn script(specs: &[TxSpec]) -> (VecDeque<Step>, Committed, BTreeSet<Watermark>) {
        let mut steps = VecDeque::new();
        let mut committed = Committed::new();
        let mut skip_acks = BTreeSet::new();
        for (i, spec) in specs.iter().enumerate() {
            let wm = Watermark::parse(&encode_lexi(100 + i as u128)).expect("lexi");
            let ids: Vec<u64> = (0..u64::from(spec.rows))
                .map(|j| i as u64 * 10 + j)
                .collect();
            if spec.skip_ack {
                skip_acks.insert(wm.clone());
            }
            let body = |steps: &mut VecDeque<Step>| {
                let mut b = Begin::new(wm.clone());
                b.skip_ack = spec.skip_ack.then_some(true);
                steps.push_back(Step::Message(Box::new(DownstreamMessage::Begin(b))));
                for (j, id) in ids.iter().enumerate() {
                    if spec.status_inside && j == 0 {
                        steps.push_back(Step::Message(Box::new(status())));
                    }
                    steps.push_back(Step::Message(Box::new(insert(*id))));
                }
            };
            if spec.interrupted {
                body(&mut steps);
                steps.push_back(Step::Ended);
            }
            body(&mut steps);
            if spec.rollback {
                steps.push_back(Step::Message(Box::new(msg(
                    r#"["rollback",{"tag":"rollback"}]"#,
                ))));
            } else {
                steps.push_back(Step::Message(Box::new(commit(wm.as_str()))));
                committed.insert(wm.clone(), ids);
            }
            if spec.keepalive_after {
                steps.push_back(Step::Idle);
            }
        }
        (steps, committed, skip_acks)
    }

    #[derive(Default)]
    struct Received {
        start: Option<Watermark>,
        version: u32,
        messages: Vec<DownstreamMessage>,
        unacked: VecDeque<u64>,
        fetch: Option<(Watermark, Watermark)>,
        rows: VecDeque<CatchupRow>,
        catchup_paused: bool,
        open: bool,
    }

    enum Queued {
        Store(LogOp),
        Fetch {
            conn: ConnId,
            from: Watermark,
            through: Watermark,
        },
    }

    struct Host {
        streamer: Streamer,
        log: Vec<CatchupRow>,
        open_tx: Vec<CatchupRow>,
        storage: VecDeque<Queued>,
        upstream: VecDeque<Step>,
        paused: bool,
        conns: Vec<Received>,
        max_message: usize,
        /// The backfill transactions' commits, and the newest commit durable in the log.
        skip_acks: BTreeSet<Watermark>,
        durable: Watermark,
    }

    impl Host {
        fn new(steps: VecDeque<Step>) -> Self {
            let mut config = StreamerConfig::new(w(RV));
            config.backlog_high_water_bytes = HIGH;
            config.backlog_full_timeout_ms = None;
            let mut log = log_tx(RV, &[]);
            log.truncate(2);
            Host {
                streamer: Streamer::new(
                    config,
                    ChangeLogState {
                        last_watermark: w(RV),
                        min_watermark: w(RV),
                    },
                ),
                log,
                open_tx: Vec::new(),
                storage: VecDeque::new(),
                upstream: steps,
                paused: false,
                conns: Vec::new(),
                max_message: 0,
                skip_acks: BTreeSet::new(),
                durable: w(RV),
            }
        }

        fn apply(&mut self, effects: Vec<Effect>) {
            for effect in effects {
                match effect {
                    Effect::Send { conn, frame } => {
                        let r = &mut self.conns[conn.0 as usize];
                        assert!(r.open, "sent to closed {conn}");
                        let text = frame.to_text();
                        for m in decode_downstream_frame(&text).expect("valid").messages() {
                            if let DownstreamMessage::Commit(c) = m {
                                assert!(
                                    !self.skip_acks.contains(&c.watermark)
                                        || c.watermark <= self.durable,
                                    "backfill commit {} sent to {conn} before it was durable",
                                    c.watermark
                                );
                            }
                        }
                        match decode_downstream_frame(&text).expect("valid frame") {
                            Frame::Message { id, msg } => {
                                r.unacked.push_back(id);
                                r.messages.push(msg);
                            }
                            Frame::Batch { id, batch } => {
                                assert!(r.version >= 7, "batch to v{}", r.version);
                                r.unacked.push_back(id);
                                r.messages.extend(batch);
                            }
                            Frame::Ack { .. } => panic!("ack frame downstream"),
                        }
                    }
                    Effect::Close { conn, reason, .. } => panic!("{conn} closed: {reason}"),
                    Effect::Store(op) => self.storage.push_back(Queued::Store(op)),
                    Effect::FetchCatchup {
                        conn,
                        from,
                        through,
                    } => {
                        self.storage.push_back(Queued::Fetch {
                            conn,
                            from,
                            through,
                        });
                    }
                    Effect::PauseCatchup { conn } => {
                        self.conns[conn.0 as usize].catchup_paused = true
                    }
                    Effect::ResumeCatchup { conn } => {
                        self.conns[conn.0 as usize].catchup_paused = false
                    }
                    Effect::PauseUpstream => {
                        assert!(!self.paused);
                        self.paused = true;
                    }
                    Effect::ResumeUpstream => {
                        assert!(self.paused);
                        self.paused = false;
                    }
                    other => panic!("unexpected effect {other}"),
                }
            }
        }

        fn feed(&mut self) -> bool {
            if self.paused {
                return false;
            }
            let Some(step) = self.upstream.pop_front() else {
                return false;
            };
            let effects = match step {
                Step::Message(message) => {
                    let size = encode_downstream(&message).len();
                    self.max_message = self.max_message.max(size);
                    unwrap_ok(self.streamer.on_upstream(*message))
                }
                Step::Ended => self.streamer.upstream_ended(),
                Step::Idle => self.streamer.on_idle(),
            };
            self.apply(effects);
            true
        }

        fn drained(&mut self) -> bool {
            let effects = self.streamer.on_upstream_drained();
            let sent = !effects.is_empty();
            self.apply(effects);
            sent
        }

        fn store(&mut self) -> bool {
            let Some(queued) = self.storage.pop_front() else {
                return false;
            };
            match queued {
                Queued::Store(LogOp::Abort) => self.open_tx.clear(),
                Queued::Store(LogOp::Begin(row) | LogOp::Append(row)) => {
                    assert_eq!(row.pos(), self.open_tx.len() as u64);
                    self.open_tx.push(CatchupRow::new(
                        row.watermark().clone(),
                        row.tag(),
                        row.change_json(),
                    ));
                }
                Queued::Store(LogOp::Commit(row)) => {
                    self.open_tx.push(CatchupRow::new(
                        row.watermark().clone(),
                        row.tag(),
                        row.change_json(),
                    ));
                    self.log.append(&mut self.open_tx);
                    self.durable = row.watermark().clone();
                    let effects = self
                        .streamer
                        .on_stored(row.watermark().clone())
                        .expect("what waited behind a held commit is accepted");
                    self.apply(effects);
                }
                Queued::Fetch {
                    conn,
                    from,
                    through,
                } => {
                    let r = &mut self.conns[conn.0 as usize];
                    if r.open {
                        r.fetch = Some((from.clone(), through.clone()));
                        r.rows = self
                            .log
                            .iter()
                            .filter(|row| row.watermark >= from && row.watermark <= through)
                            .cloned()
                            .collect();
                    }
                }
            }
            true
        }

        fn catch_up(&mut self, index: usize, rows: usize) -> bool {
            let Some(r) = self.conns.get_mut(index) else {
                return false;
            };
            if !r.open || r.fetch.is_none() || r.catchup_paused {
                return false;
            }
            let n = rows.min(r.rows.len());
            let page: Vec<CatchupRow> = r.rows.drain(..n).collect();
            let done = r.rows.is_empty();
            if done {
                r.fetch = None;
            }
            let conn = ConnId(index as u64);
            let mut effects = self.streamer.catchup_rows(conn, page);
            if done {
                effects.extend(self.streamer.catchup_done(conn));
            }
            self.apply(effects);
            true
        }

        fn ack(&mut self, index: usize, frames: usize) -> bool {
            let mut any = false;
            for _ in 0..frames {
                let Some(r) = self.conns.get_mut(index).filter(|r| r.open) else {
                    break;
                };
                let Some(id) = r.unacked.pop_front() else {
                    break;
                };
                let effects = self.streamer.on_ack(ConnId(index as u64), id, 0);
                self.apply(effects);
                any = true;
            }
            any
        }

        fn join(&mut self, version: usize, at: usize) {
            let version = [1, 2, 4, 5, 6, 7, 8][version % 7];
            let commits: Vec<Watermark> = self
                .log
                .iter()
                .filter(|r| r.tag == "commit")
                .map(|r| r.watermark.clone())
                .collect();
            // The last forwarded commit (perhaps not stored yet), one ahead of every
            // transaction, or a stored commit.
            let start = match at % 4 {
                0 => self.streamer.last_commit().clone(),
                1 => Watermark::parse(&encode_lexi(400)).expect("lexi"),
                _ => commits[at % commits.len()].clone(),
            };
            let conn = ConnId(self.conns.len() as u64);
            self.conns.push(Received {
                start: Some(start.clone()),
                version,
                open: true,
                ..Received::default()
            });
            self.streamer.open(conn, version, false);
            let effects = self.streamer.subscribe(conn, serving(start.as_str()), 0);
            self.apply(effects);
        }

        fn leave(&mut self, index: usize) {
            if let Some(r) = self.conns.get_mut(index).filter(|r| r.open) {
                r.open = false;
                let effects = self.streamer.on_close(ConnId(index as u64));
                self.apply(effects);
            }
        }

        fn check_backlogs(&self) {
            for (i, r) in self.conns.iter().enumerate() {
                if let Some(status) = self.streamer.subscriber(ConnId(i as u64)) {
                    assert!(r.open);
                    assert!(
                        status.backlog_bytes <= HIGH + self.max_message,
                        "backlog of #{i} holds {} bytes",
                        status.backlog_bytes
                    );
                    assert!(
                        status.live_bytes_in_flight <= HIGH + self.max_message,
                        "#{i} has {} live bytes unacknowledged",
                        status.live_bytes_in_flight
                    );
                }
            }
        }

        /// Runs every pending thing to completion.
        fn settle(&mut self) {
            for _ in 0..100_000 {
                let mut progress = self.store();
                for i in 0..self.conns.len() {
                    progress |= self.catch_up(i, usize::MAX);
                    progress |= self.ack(i, usize::MAX);
                }
                progress |= self.feed();
                if !progress {
                    // Nothing more is waiting upstream: what was held goes out.
                    progress |= self.drained();
                }
                self.check_backlogs();
                if !progress {
                    assert!(self.upstream.is_empty(), "stalled with upstream left");
                    return;
                }
            }
            panic!("did not settle");
        }
    }

    /// The transactions a subscriber received, checked for well-formedness.
    fn transactions(r: &Received) -> Vec<(Watermark, Vec<u64>)> {
        let mut out = Vec::new();
        let mut open: Option<(Watermark, Vec<u64>)> = None;
        for (i, m) in r.messages.iter().enumerate() {
            match m {
                DownstreamMessage::Status(_) => {
                    assert!(r.version >= 2, "status to v{}", r.version);
                }
                DownstreamMessage::Begin(b) => {
                    assert!(open.is_none(), "nested begin");
                    open = Some((b.commit_watermark.clone(), Vec::new()));
                }
                DownstreamMessage::Data(crate::change_stream::Change::Insert(ins)) => {
                    let (_, ids) = open.as_mut().expect("data inside a transaction");
                    ids.push(ins.new.get("id").and_then(Value::as_u64).expect("id"));
                    if r.version < 5 {
                        assert!(ins.relation.key_columns.is_some());
                    }
                }
                DownstreamMessage::Commit(c) => {
                    let (wm, ids) = open.take().expect("commit inside a transaction");
                    assert_eq!(wm, c.watermark);
                    out.push((wm, ids));
                }
                DownstreamMessage::Rollback(_) => {
                    open.take().expect("rollback inside a transaction");
                }
                other => panic!("unexpected message {other:?}"),
            }
            if i == 0 && r.version >= 2 {
                assert!(matches!(m, DownstreamMessage::Status(_)), "first is status");
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn every_subscriber_gets_each_transaction_once_in_order_without_gaps(
            specs in proptest::collection::vec(tx_spec(), 1..14),
            ops in proptest::collection::vec(op(), 0..120),
        ) {
            let (steps, committed, skip_acks) = script(&specs);
            let mut host = Host::new(steps);
            host.skip_acks = skip_acks;
            for op in ops {
                match op {
                    Op::Feed => { host.feed(); }
                    Op::Drained => { host.drained(); }
                    Op::Store => { host.store(); }
                    Op::Catchup { conn, rows } => { host.catch_up(conn, rows); }
                    Op::Ack { conn, frames } => { host.ack(conn, frames); }
                    Op::Join { version, at } => host.join(version, at),
                    Op::Leave { conn } => host.leave(conn),
                }
                host.check_backlogs();
            }
            host.settle();
            prop_assert!(!host.streamer.is_upstream_paused());
            for (i, r) in host.conns.iter().enumerate() {
                let got = transactions(r);
                let start = r.start.clone().expect("start");
                // Strictly increasing, each after the start.
                let mut last = start.clone();
                for (wm, ids) in &got {
                    prop_assert!(*wm > last, "#{} got {} after {}", i, wm, last);
                    last = wm.clone();
                    prop_assert_eq!(Some(ids), committed.get(wm), "#{} content of {}", i, wm);
                }
                if r.open {
                    // Live at the end: exactly the committed transactions after its start.
                    let expected: Vec<&Watermark> = committed.keys().filter(|wm| **wm > start).collect();
                    let got: Vec<&Watermark> = got.iter().map(|(wm, _)| wm).collect();
                    prop_assert_eq!(got, expected, "#{} (v{}) from {}", i, r.version, start);
                    let status = host.streamer.subscriber(ConnId(i as u64)).expect("registered");
                    prop_assert_eq!(status.phase, Phase::Live);
                    prop_assert_eq!(status.backlog_bytes, 0);
                    prop_assert_eq!(status.live_bytes_in_flight, 0);
                }
            }
        }
    }
}

#[test]
fn metrics_count_transactions_changes_rollbacks_and_subscribers_by_version_and_phase() {
    let mut s = streamer_at("0c", RV);
    assert_eq!(s.metrics(), StreamerMetrics::default());
    let (a, b, idle) = (ConnId(1), ConnId(2), ConnId(3));
    s.open(a, 6, false);
    let _ = s.subscribe(a, serving("0c"), 0);
    s.open(b, 5, false);
    s.open(idle, 6, false);
    let _ = unwrap_ok(s.on_upstream(begin("0d")));
    let _ = s.subscribe(b, serving("0c"), 0);
    let _ = unwrap_ok(s.on_upstream(insert(1)));
    let _ = unwrap_ok(s.on_upstream(insert(2)));
    let _ = unwrap_ok(s.on_upstream(commit("0d")));
    let _ = unwrap_ok(s.on_upstream(begin("0e")));
    let _ = unwrap_ok(s.on_upstream(insert(3)));
    let _ = unwrap_ok(s.on_upstream(msg(r#"["rollback",{"tag":"rollback"}]"#)));

    let metrics = s.metrics();
    assert_eq!(
        (metrics.transactions, metrics.changes, metrics.rollbacks),
        (1, 3, 1)
    );
    assert_eq!(metrics.idle_connections, 1);
    // The v6 subscriber was at the newest commit: live at once. The v5 one subscribed inside
    // a transaction, waited for its end, and now reads the change log.
    let expected = [((5, "catching_up"), 1), ((6, "live"), 1)];
    assert_eq!(
        metrics.subscribers,
        expected.into_iter().collect(),
        "{metrics:?}"
    );
    // Unacknowledged live bytes and the backlog of the one catching up are both held.
    assert!(
        metrics.backlog_bytes > metrics.max_backlog_bytes,
        "{metrics:?}"
    );
    assert!(!metrics.upstream_paused);
}
