//! Transcript tests of the upstream session: pgoutput bytes and relay frames in, effects out.

use proptest::prelude::*;

use super::*;
use crate::change_stream::{Status, StreamError, Truncate};

const DDL: &str = "app/ddl";
const ITEMS: u32 = 16_384;

fn w(n: u64) -> Watermark {
    Lsn(n).to_watermark()
}

fn session(stored: u64) -> UpstreamSession {
    UpstreamSession::new(
        SessionConfig {
            ddl_prefix: DDL.to_owned(),
        },
        w(stored),
        Lsn(stored),
    )
}

// ---- pgoutput bytes ----

fn xlog(payload: &[u8]) -> Vec<u8> {
    let mut out = vec![b'w'];
    out.extend_from_slice(&[0; 24]);
    out.extend_from_slice(payload);
    out
}

fn pg_begin(lsn: u64) -> Vec<u8> {
    let mut p = vec![b'B'];
    p.extend_from_slice(&lsn.to_be_bytes());
    p.extend_from_slice(&0i64.to_be_bytes());
    p.extend_from_slice(&7u32.to_be_bytes());
    xlog(&p)
}

/// The commit of the transaction at `lsn`, whose record ends at `lsn + 8`.
fn pg_commit(lsn: u64) -> Vec<u8> {
    let mut p = vec![b'C', 0];
    p.extend_from_slice(&lsn.to_be_bytes());
    p.extend_from_slice(&end(lsn).0.to_be_bytes());
    p.extend_from_slice(&0i64.to_be_bytes());
    xlog(&p)
}

fn end(lsn: u64) -> Lsn {
    Lsn(lsn + 8)
}

fn cstr(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(s.as_bytes());
    out.push(0);
}

fn pg_relation(columns: &[&str]) -> Vec<u8> {
    let mut p = vec![b'R'];
    p.extend_from_slice(&ITEMS.to_be_bytes());
    cstr(&mut p, "public");
    cstr(&mut p, "items");
    p.push(b'd');
    p.extend_from_slice(&(columns.len() as u16).to_be_bytes());
    for (i, name) in columns.iter().enumerate() {
        p.push(u8::from(i == 0));
        cstr(&mut p, name);
        p.extend_from_slice(&25u32.to_be_bytes());
        p.extend_from_slice(&(-1i32).to_be_bytes());
    }
    xlog(&p)
}

fn pg_insert(values: &[&str]) -> Vec<u8> {
    let mut p = vec![b'I'];
    p.extend_from_slice(&ITEMS.to_be_bytes());
    p.push(b'N');
    p.extend_from_slice(&(values.len() as u16).to_be_bytes());
    for v in values {
        p.push(b't');
        p.extend_from_slice(&(v.len() as u32).to_be_bytes());
        p.extend_from_slice(v.as_bytes());
    }
    xlog(&p)
}

fn pg_message(prefix: &str, content: &str) -> Vec<u8> {
    pg_message_of(true, prefix, content)
}

/// A logical message, transactional (`pg_logical_emit_message(true, …)`) or not.
fn pg_message_of(transactional: bool, prefix: &str, content: &str) -> Vec<u8> {
    let mut p = vec![b'M', u8::from(transactional)];
    p.extend_from_slice(&0u64.to_be_bytes());
    cstr(&mut p, prefix);
    p.extend_from_slice(&(content.len() as u32).to_be_bytes());
    p.extend_from_slice(content.as_bytes());
    xlog(&p)
}

fn pg_keepalive(wal_end: u64, reply: bool) -> Vec<u8> {
    let mut out = vec![b'k'];
    out.extend_from_slice(&wal_end.to_be_bytes());
    out.extend_from_slice(&0i64.to_be_bytes());
    out.push(u8::from(reply));
    out
}

// ---- transcripts ----

/// One line per effect: `apply begin 1a`, `ack 0/22`, `ddl {...}`, …
fn line(effect: &Effect) -> String {
    match effect {
        Effect::Apply(DownstreamMessage::Begin(b)) => format!("apply begin {}", b.commit_watermark),
        Effect::Apply(DownstreamMessage::Commit(c)) => format!("apply commit {}", c.watermark),
        Effect::Apply(DownstreamMessage::Data(change)) => format!("apply {}", change.tag()),
        Effect::ApplyText(change) => format!("apply text {}", change.tag()),
        Effect::Apply(DownstreamMessage::Rollback(_)) => "apply rollback".to_owned(),
        Effect::Apply(DownstreamMessage::Status(_)) => "apply status".to_owned(),
        Effect::Apply(other) => format!("apply {other:?}"),
        Effect::Ack(lsn) => format!("ack {lsn}"),
        Effect::AckFrames(ids) => format!("ack frames {ids:?}"),
        Effect::ResolveDdl { content } => format!("ddl {}", String::from_utf8_lossy(content)),
        Effect::ReconcileRelation(r) => format!("relation {} {}", r.name, r.columns.len()),
        Effect::Idle { watermark } => format!("idle {watermark}"),
        Effect::BackfillDue => "backfill due".to_owned(),
        Effect::Reconnect { restore, acks, .. } => {
            format!("reconnect restore={restore} acks {acks:?}")
        }
        Effect::Confirmed {
            client_id,
            mutation_id,
        } => format!("confirmed {client_id} {mutation_id}"),
        Effect::Fence { nonce } => format!("fence {nonce}"),
        Effect::Warn(message) => format!("warn {message}"),
    }
}

fn feed(s: &mut UpstreamSession, input: Input<'_>) -> Vec<String> {
    s.handle(input)
        .expect("input taken")
        .iter()
        .map(line)
        .collect()
}

fn wal(s: &mut UpstreamSession, frames: &[Vec<u8>]) -> Vec<String> {
    frames
        .iter()
        .flat_map(|f| feed(s, Input::WalData(f)))
        .collect()
}

fn stored(s: &mut UpstreamSession, n: u64) -> Vec<String> {
    feed(s, Input::Stored { watermark: w(n) })
}

fn schema_change() -> Change {
    Change::Truncate(Truncate {
        relations: Vec::new(),
        extra: Default::default(),
    })
}

/// A session past its first `backfill due` (given at the first input).
fn started(stored: u64) -> UpstreamSession {
    let mut s = session(stored);
    assert_eq!(feed(&mut s, Input::Started), ["backfill due"]);
    s
}

fn tx(lsn: u64) -> Vec<Vec<u8>> {
    vec![
        pg_begin(lsn),
        pg_relation(&["id", "v"]),
        pg_insert(&["1", "a"]),
        pg_commit(lsn),
    ]
}

/// Feeds a transaction with one Relation message, answering the reconcile with nothing.
fn live_tx(s: &mut UpstreamSession, lsn: u64) -> Vec<String> {
    let mut out = wal(s, &[pg_begin(lsn), pg_relation(&["id", "v"])]);
    out.extend(feed(s, Input::SchemaChanges(Vec::new())));
    out.extend(wal(s, &[pg_insert(&["1", "a"]), pg_commit(lsn)]));
    out
}

#[test]
fn a_transaction_is_applied_and_its_commit_end_is_acked_once_durable() {
    let mut s = started(0x10);
    assert_eq!(
        live_tx(&mut s, 0x20),
        [
            format!("apply begin {}", w(0x20)),
            "relation items 2".to_owned(),
            "apply insert".to_owned(),
            format!("apply commit {}", w(0x20)),
        ]
    );
    assert_eq!(s.acked(), Lsn(0x10), "nothing acked before storage");
    assert_eq!(
        stored(&mut s, 0x20),
        [format!("ack {}", end(0x20)), "backfill due".to_owned()]
    );
}

#[test]
fn a_resent_transaction_at_or_below_the_stored_commit_is_skipped_but_acked() {
    let mut s = started(0x20);
    // Stored before the restart, acknowledged too late for Postgres to leave it out.
    let out = wal(&mut s, &tx(0x20));
    assert_eq!(
        out,
        [format!("ack {}", end(0x20)), "backfill due".to_owned()]
    );
    // Its Relation message was cached all the same: the next transaction's rows map.
    assert_eq!(
        wal(
            &mut s,
            &[pg_begin(0x30), pg_insert(&["2", "b"]), pg_commit(0x30)]
        ),
        [
            format!("apply begin {}", w(0x30)),
            "apply insert".to_owned(),
            format!("apply commit {}", w(0x30)),
        ]
    );
}

#[test]
fn a_session_keeping_row_text_hands_rows_on_as_text_under_the_same_rules() {
    let mut s = started(0x20);
    s.keep_row_text();
    // Stored already: skipped whole, as with JSON rows.
    assert_eq!(
        wal(&mut s, &tx(0x20)),
        [format!("ack {}", end(0x20)), "backfill due".to_owned()]
    );
    let frames = [pg_begin(0x30), pg_insert(&["2", "b"]), pg_commit(0x30)];
    assert_eq!(
        wal(&mut s, &frames),
        [
            format!("apply begin {}", w(0x30)),
            "apply text insert".to_owned(),
            format!("apply commit {}", w(0x30)),
        ]
    );
    let row = s
        .handle(Input::Started)
        .and_then(|_| s.handle(Input::WalData(&pg_begin(0x40))))
        .and_then(|_| s.handle(Input::WalData(&pg_relation(&["id", "v"]))))
        .and_then(|_| s.handle(Input::SchemaChanges(Vec::new())))
        .and_then(|_| s.handle(Input::WalData(&pg_insert(&["3", "c"]))))
        .expect("taken");
    // A new session (a reconnect) keeps the mode.
    match row.as_slice() {
        [Effect::ApplyText(change)] => {
            let Change::Insert(insert) = change.to_change() else {
                panic!("{change:?}")
            };
            assert_eq!(
                serde_json::Value::Object(insert.new),
                serde_json::json!({"id": "3", "v": "c"})
            );
        }
        other => panic!("expected one text row, got {other:?}"),
    }
    // Outside a transaction a row is refused, as a JSON row is.
    let mut outside = started(0x20);
    outside.keep_row_text();
    wal(&mut outside, &[pg_begin(0x30), pg_relation(&["id", "v"])]);
    feed(&mut outside, Input::SchemaChanges(Vec::new()));
    wal(&mut outside, &[pg_commit(0x30)]);
    assert!(outside
        .handle(Input::WalData(&pg_insert(&["4", "d"])))
        .is_err());
}

#[test]
fn a_resent_transaction_handed_on_but_not_yet_durable_is_skipped_and_acked_once_durable() {
    let mut s = started(0x10);
    live_tx(&mut s, 0x20);
    assert!(feed(&mut s, Input::Started).is_empty());
    // Sent again by the new session while the first copy is still being stored.
    assert!(wal(&mut s, &tx(0x20)).is_empty());
    assert_eq!(
        stored(&mut s, 0x20),
        [format!("ack {}", end(0x20)), "backfill due".to_owned()]
    );
}

#[test]
fn acks_follow_the_newest_durable_commit_and_never_move_back() {
    let mut s = started(0x10);
    live_tx(&mut s, 0x20);
    live_tx(&mut s, 0x30);
    live_tx(&mut s, 0x40);
    // Storage reports the first two at once (one durable completion for several).
    assert_eq!(stored(&mut s, 0x30), [format!("ack {}", end(0x30))]);
    // An older report changes nothing.
    assert!(stored(&mut s, 0x20).is_empty());
    assert_eq!(s.acked(), end(0x30));
    assert_eq!(
        stored(&mut s, 0x40),
        [format!("ack {}", end(0x40)), "backfill due".to_owned()]
    );
    assert!(stored(&mut s, 0x40).is_empty());
}

#[test]
fn a_keepalive_is_acked_only_between_transactions_with_everything_stored() {
    let mut s = started(0x10);
    // Between transactions, nothing pending: the slot may advance over WAL without changes.
    assert_eq!(
        wal(&mut s, &[pg_keepalive(0x18, false)]),
        [format!("ack {}", Lsn(0x18)), format!("idle {}", w(0x18))]
    );
    live_tx(&mut s, 0x20);
    // Behind a commit that is not durable: it waits.
    assert_eq!(
        wal(&mut s, &[pg_keepalive(0x50, true)]),
        [format!("idle {}", w(0x50))]
    );
    assert_eq!(
        stored(&mut s, 0x20),
        [format!("ack {}", Lsn(0x50)), "backfill due".to_owned()]
    );
    // Inside a transaction: answered only once that transaction ended and is durable.
    wal(&mut s, &[pg_begin(0x60), pg_keepalive(0x70, false)]);
    assert_eq!(s.acked(), Lsn(0x50));
    wal(&mut s, &[pg_insert(&["1", "a"])]);
    assert_eq!(
        wal(&mut s, &[pg_commit(0x60)]),
        [format!("apply commit {}", w(0x60))]
    );
    assert_eq!(
        stored(&mut s, 0x60),
        [format!("ack {}", Lsn(0x70)), "backfill due".to_owned()]
    );
    // A keepalive behind what was acked moves nothing.
    assert_eq!(
        wal(&mut s, &[pg_keepalive(0x30, true)]),
        [format!("idle {}", w(0x30))]
    );
    assert_eq!(s.acked(), Lsn(0x70));
}

#[test]
fn a_ddl_event_asks_for_schema_changes_applied_at_that_point_of_the_transaction() {
    let mut s = started(0x10);
    let out = wal(
        &mut s,
        &[pg_begin(0x20), pg_message(DDL, r#"{"tag":"ALTER TABLE"}"#)],
    );
    assert_eq!(
        out,
        [
            format!("apply begin {}", w(0x20)),
            r#"ddl {"tag":"ALTER TABLE"}"#.to_owned()
        ]
    );
    // Nothing more upstream until the host answered.
    assert!(!s.accepts_upstream());
    assert!(matches!(
        s.handle(Input::WalData(&pg_commit(0x20))),
        Err(SessionError::Unexpected { .. })
    ));
    assert_eq!(
        feed(
            &mut s,
            Input::SchemaChanges(vec![schema_change(), schema_change()])
        ),
        ["apply truncate", "apply truncate"]
    );
    assert_eq!(
        wal(&mut s, &[pg_relation(&["id", "v", "w"])]),
        ["relation items 3"]
    );
    assert!(feed(&mut s, Input::SchemaChanges(Vec::new())).is_empty());
    assert_eq!(
        wal(&mut s, &[pg_insert(&["1", "a", "b"]), pg_commit(0x20)]),
        [
            "apply insert".to_owned(),
            format!("apply commit {}", w(0x20))
        ]
    );
}

#[test]
fn ddl_messages_of_other_prefixes_outside_transactions_or_in_skipped_ones_are_ignored() {
    let mut s = started(0x20);
    assert!(wal(&mut s, &[pg_message("other/ddl", "{}")]).is_empty());
    assert!(wal(&mut s, &[pg_message(DDL, "{}")]).is_empty());
    // A skipped transaction's DDL and Relation are of the past: the replica has them.
    let out = wal(
        &mut s,
        &[
            pg_begin(0x20),
            pg_message(DDL, "{}"),
            pg_relation(&["id"]),
            pg_insert(&["1"]),
            pg_commit(0x20),
        ],
    );
    assert_eq!(
        out,
        [format!("ack {}", end(0x20)), "backfill due".to_owned()]
    );
    assert!(matches!(
        s.handle(Input::SchemaChanges(Vec::new())),
        Err(SessionError::Unexpected { .. })
    ));
}

#[test]
fn confirm_messages_of_live_transactions_name_the_mutations_they_apply() {
    let mut s = started(0x20);
    let confirm = r#"{"clientId":"c1","mutationId":7}"#;
    // Outside a transaction, or in one already stored: nothing to record.
    assert!(wal(&mut s, &[pg_message(CONFIRM_MESSAGE_PREFIX, confirm)]).is_empty());
    let out = wal(
        &mut s,
        &[
            pg_begin(0x20),
            pg_message(CONFIRM_MESSAGE_PREFIX, confirm),
            pg_commit(0x20),
        ],
    );
    assert_eq!(
        out,
        [format!("ack {}", end(0x20)), "backfill due".to_owned()]
    );
    // In a live one: recorded at that point of the transaction; a malformed one is only
    // worth a warning, and other prefixes are not the session's.
    let out = wal(
        &mut s,
        &[
            pg_begin(0x30),
            pg_message(CONFIRM_MESSAGE_PREFIX, confirm),
            pg_message(
                CONFIRM_MESSAGE_PREFIX,
                r#"{"clientId":"c 1","mutationId":8}"#,
            ),
            pg_message("highwater.other", confirm),
            pg_commit(0x30),
        ],
    );
    assert_eq!(out.len(), 4, "{out:?}");
    assert_eq!(out[0], format!("apply begin {}", w(0x30)));
    assert_eq!(out[1], "confirmed c1 7");
    assert!(
        out[2].starts_with("warn ignoring a highwater.confirm message"),
        "{}",
        out[2]
    );
    assert_eq!(out[3], format!("apply commit {}", w(0x30)));
}

#[test]
fn fences_pass_between_transactions_whatever_their_flag() {
    let mut s = started(0x20);
    assert_eq!(
        wal(&mut s, &[pg_message_of(false, FENCE_MESSAGE_PREFIX, "n1")]),
        ["fence n1"]
    );
    // One in a transaction already stored is of the past: nobody waits for it.
    let out = wal(
        &mut s,
        &[
            pg_begin(0x20),
            pg_message(FENCE_MESSAGE_PREFIX, "n0"),
            pg_commit(0x20),
        ],
    );
    assert!(!out.iter().any(|line| line.starts_with("fence")), "{out:?}");
}

#[test]
fn without_an_event_trigger_relation_messages_bring_the_schema_changes() {
    let mut s = started(0x10);
    live_tx(&mut s, 0x20);
    // An added column: Postgres sends the new Relation before the first row using it.
    let out = wal(&mut s, &[pg_begin(0x30), pg_relation(&["id", "v", "w"])]);
    assert_eq!(
        out,
        [
            format!("apply begin {}", w(0x30)),
            "relation items 3".to_owned()
        ]
    );
    assert_eq!(
        feed(&mut s, Input::SchemaChanges(vec![schema_change()])),
        ["apply truncate"]
    );
    assert_eq!(
        wal(&mut s, &[pg_insert(&["2", "b", "c"]), pg_commit(0x30)]),
        [
            "apply insert".to_owned(),
            format!("apply commit {}", w(0x30))
        ]
    );
}

#[test]
fn a_restart_mid_transaction_drops_it_and_forgets_the_relations() {
    let mut s = started(0x10);
    wal(&mut s, &[pg_begin(0x20), pg_relation(&["id", "v"])]);
    feed(&mut s, Input::SchemaChanges(Vec::new()));
    wal(&mut s, &[pg_insert(&["1", "a"]), pg_keepalive(0x28, true)]);
    assert_eq!(feed(&mut s, Input::Started), ["apply rollback"]);
    assert!(!s.in_transaction());
    // The keepalive of the old session is void.
    assert!(stored(&mut s, 0x10).is_empty());
    assert_eq!(s.acked(), Lsn(0x10));
    // Relation messages come again in the new session; a row before them is an error.
    wal(&mut s, &[pg_begin(0x20)]);
    assert!(matches!(
        s.handle(Input::WalData(&pg_insert(&["1", "a"]))),
        Err(SessionError::Mapping(MappingError::UnknownRelation(_)))
    ));
    // The transaction is sent again whole and applied whole.
    feed(&mut s, Input::Started);
    assert_eq!(
        live_tx(&mut s, 0x20),
        [
            format!("apply begin {}", w(0x20)),
            "relation items 2".to_owned(),
            "apply insert".to_owned(),
            format!("apply commit {}", w(0x20)),
        ]
    );
}

#[test]
fn a_backfill_is_due_only_between_transactions_with_everything_durable() {
    let mut s = started(0x10);
    wal(&mut s, &[pg_begin(0x20)]);
    assert!(!wal(&mut s, &[pg_relation(&["id", "v"])]).contains(&"backfill due".to_owned()));
    feed(&mut s, Input::SchemaChanges(Vec::new()));
    let out = wal(&mut s, &[pg_insert(&["1", "a"]), pg_commit(0x20)]);
    assert!(
        !out.contains(&"backfill due".to_owned()),
        "not before durable"
    );
    assert_eq!(
        stored(&mut s, 0x20),
        [format!("ack {}", end(0x20)), "backfill due".to_owned()]
    );
    // Once said, not again until the next commit.
    assert!(wal(&mut s, &[pg_keepalive(0x28, false)])
        .iter()
        .all(|l| l != "backfill due"));
    // A running backfill is a transaction like any other, never acked, and the only source.
    assert!(feed(&mut s, Input::BackfillStarted).is_empty());
    assert!(!s.accepts_upstream());
    assert!(matches!(
        s.handle(Input::WalData(&pg_begin(0x30))),
        Err(SessionError::Unexpected { .. })
    ));
    let watermark = Watermark::parse(&format!("{}.01", w(0x28))).unwrap();
    let mut begin = Begin::new(watermark.clone());
    begin.skip_ack = Some(true);
    assert_eq!(
        feed(&mut s, Input::Backfill(DownstreamMessage::Begin(begin))),
        [format!("apply begin {watermark}")]
    );
    feed(
        &mut s,
        Input::Backfill(DownstreamMessage::Commit(Commit::new(watermark.clone()))),
    );
    assert_eq!(feed(&mut s, Input::BackfillEnded), Vec::<String>::new());
    assert!(feed(&mut s, Input::Stored { watermark }).contains(&"backfill due".to_owned()));
    assert_eq!(s.acked(), Lsn(0x28), "a skipAck commit confirms nothing");
}

#[test]
fn a_backfill_that_fails_mid_transaction_is_rolled_back() {
    let mut s = started(0x10);
    feed(&mut s, Input::BackfillStarted);
    let watermark = Watermark::parse(&format!("{}.01", w(0x10))).unwrap();
    let mut begin = Begin::new(watermark);
    begin.skip_ack = Some(true);
    feed(&mut s, Input::Backfill(DownstreamMessage::Begin(begin)));
    assert_eq!(
        feed(&mut s, Input::BackfillEnded),
        ["apply rollback", "backfill due"]
    );
    assert!(s.accepts_upstream());
}

/// A failed backfill's retry needs no upstream commit: the host says when its delay passed,
/// and the session lets it start as soon as nothing is in between.
#[test]
fn a_backfill_retry_is_due_without_an_upstream_commit_but_never_inside_a_transaction() {
    let mut s = started(0x10);
    feed(&mut s, Input::BackfillStarted);
    assert_eq!(
        feed(&mut s, Input::BackfillEnded),
        ["backfill due"],
        "the host's planner holds the failed one back"
    );
    assert!(feed(&mut s, Input::RetryBackfills).contains(&"backfill due".to_owned()));
    // Asked for in the middle of an upstream transaction, it waits for that commit's storing.
    wal(&mut s, &[pg_begin(0x20)]);
    assert!(!feed(&mut s, Input::RetryBackfills).contains(&"backfill due".to_owned()));
    let effects = wal(&mut s, &[pg_commit(0x20)]);
    assert!(!effects.contains(&"backfill due".to_owned()), "{effects:?}");
    assert!(stored(&mut s, 0x20).contains(&"backfill due".to_owned()));
}

// ---- relay frames ----

fn begin_msg(n: u64) -> DownstreamMessage {
    DownstreamMessage::Begin(Begin::new(w(n)))
}

fn commit_msg(n: u64) -> DownstreamMessage {
    DownstreamMessage::Commit(Commit::new(w(n)))
}

fn data_msg() -> DownstreamMessage {
    DownstreamMessage::Data(schema_change())
}

fn status_msg() -> DownstreamMessage {
    DownstreamMessage::Status(Status::default())
}

fn frame(s: &mut UpstreamSession, id: u64, messages: Vec<DownstreamMessage>) -> Vec<String> {
    feed(s, Input::RelayFrame { id, messages })
}

#[test]
fn relay_frames_are_acked_in_id_order_once_each_when_their_transactions_are_durable() {
    let mut s = started(10);
    // The first status confirms the subscription and is not handed on.
    assert_eq!(frame(&mut s, 1, vec![status_msg()]), ["ack frames [1]"]);
    assert_eq!(
        frame(&mut s, 2, vec![begin_msg(20), data_msg()]),
        [
            format!("apply begin {}", w(20)),
            "apply truncate".to_owned()
        ]
    );
    assert_eq!(
        frame(&mut s, 3, vec![commit_msg(20), status_msg()]),
        [format!("apply commit {}", w(20)), "apply status".to_owned()]
    );
    assert_eq!(stored(&mut s, 20), ["ack frames [2, 3]", "backfill due"]);
    assert!(stored(&mut s, 20).is_empty(), "once each");
}

#[test]
fn a_skip_ack_commit_from_the_primary_releases_its_frames_once_durable_and_acks_no_lsn() {
    let mut s = started(10);
    frame(&mut s, 1, vec![status_msg()]);
    let watermark = Watermark::parse(&format!("{}.01", w(10))).unwrap();
    let mut begin = Begin::new(watermark.clone());
    begin.skip_ack = Some(true);
    let out = frame(
        &mut s,
        2,
        vec![
            DownstreamMessage::Begin(begin),
            data_msg(),
            DownstreamMessage::Commit(Commit::new(watermark.clone())),
        ],
    );
    // No keepalive stands in for it: the frame waits for the commit to be durable.
    assert_eq!(
        out,
        [
            format!("apply begin {watermark}"),
            "apply truncate".to_owned(),
            format!("apply commit {watermark}"),
        ]
    );
    assert_eq!(
        feed(&mut s, Input::Stored { watermark }),
        ["ack frames [2]", "backfill due"]
    );
    assert_eq!(s.acked(), Lsn(10));
}

#[test]
fn a_reconnected_relay_skips_what_it_stored_and_acks_it_at_once() {
    let mut s = started(10);
    frame(&mut s, 1, vec![status_msg(), begin_msg(20), data_msg()]);
    assert_eq!(feed(&mut s, Input::Started), ["apply rollback"]);
    frame(&mut s, 1, vec![status_msg()]);
    frame(&mut s, 2, vec![begin_msg(20), data_msg(), commit_msg(20)]);
    stored(&mut s, 20);
    assert_eq!(feed(&mut s, Input::Started), Vec::<String>::new());
    assert_eq!(frame(&mut s, 1, vec![status_msg()]), ["ack frames [1]"]);
    assert_eq!(
        frame(&mut s, 2, vec![begin_msg(20), data_msg(), commit_msg(20)]),
        ["ack frames [2]", "backfill due"]
    );
}

#[test]
fn an_error_from_the_primary_acks_what_came_before_and_asks_for_a_restore_or_a_reconnect() {
    let mut s = started(10);
    let error = |kind| DownstreamMessage::Error(StreamError::new(kind, "no"));
    let out = frame(
        &mut s,
        1,
        vec![error(ErrorKind::WatermarkTooOld), status_msg()],
    );
    assert_eq!(out, ["reconnect restore=true acks [1]"]);
    // Nothing after it is used.
    assert!(frame(&mut s, 2, vec![begin_msg(20)]).is_empty());
    feed(&mut s, Input::Started);
    let out = frame(&mut s, 1, vec![error(ErrorKind::Unknown)]);
    assert_eq!(out, ["reconnect restore=false acks [1]"]);
}

// ---- properties ----

#[derive(Debug, Clone)]
enum Step {
    /// A transaction with `rows` inserts, cut off after `cut` messages when `Some`.
    Tx {
        rows: usize,
        cut: Option<usize>,
    },
    Keepalive,
    /// Storage catches up with everything handed on.
    Store,
    Restart,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0usize..3, prop::option::weighted(0.2, 0usize..4))
            .prop_map(|(rows, cut)| Step::Tx { rows, cut }),
        1 => Just(Step::Keepalive),
        2 => Just(Step::Store),
        1 => Just(Step::Restart),
    ]
}

/// The host and Postgres around a session, as the property test drives them.
#[derive(Default)]
struct Model {
    /// The WAL: committed transactions (lsn, rows) in commit order.
    wal: Vec<(u64, usize)>,
    /// Transactions applied to storage, and the open one (lsn, rows so far).
    applied: Vec<u64>,
    open: Option<(u64, usize)>,
    durable: u64,
    /// The WAL end sent so far.
    sent_through: u64,
    acked: Lsn,
}

fn frames_of(lsn: u64, rows: usize) -> Vec<Vec<u8>> {
    let mut frames = vec![pg_begin(lsn), pg_relation(&["id", "v"])];
    frames.extend((0..rows).map(|_| pg_insert(&["1", "a"])));
    frames.push(pg_commit(lsn));
    frames
}

impl Model {
    fn feed(&mut self, s: &mut UpstreamSession, input: Input<'_>) -> Result<(), TestCaseError> {
        let effects = s
            .handle(input)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for effect in effects {
            match effect {
                Effect::Apply(DownstreamMessage::Begin(b)) => {
                    prop_assert!(self.open.is_none());
                    self.open = Some((b.commit_watermark.to_lsn().unwrap().0, 0));
                }
                Effect::Apply(DownstreamMessage::Data(_)) => {
                    self.open.as_mut().expect("open").1 += 1;
                }
                Effect::Apply(DownstreamMessage::Commit(c)) => {
                    let (lsn, rows) = self.open.take().expect("open");
                    prop_assert_eq!(c.watermark.to_lsn().unwrap().0, lsn);
                    prop_assert!(!self.applied.contains(&lsn), "applied twice");
                    prop_assert!(self.applied.last().is_none_or(|l| *l < lsn));
                    let expected = self.wal.iter().find(|(l, _)| *l == lsn).map(|t| t.1);
                    prop_assert_eq!(Some(rows), expected, "applied whole");
                    self.applied.push(lsn);
                }
                Effect::Apply(DownstreamMessage::Rollback(_)) => self.open = None,
                Effect::ReconcileRelation(_) => self.feed(s, Input::SchemaChanges(Vec::new()))?,
                Effect::Ack(lsn) => {
                    prop_assert!(lsn > self.acked, "acks move forward");
                    prop_assert!(lsn.0 <= self.sent_through, "ack past the WAL received");
                    for (l, _) in &self.wal {
                        prop_assert!(
                            end(*l) > lsn || *l <= self.durable,
                            "ack {} covers {:x}, which is not durable",
                            lsn,
                            l
                        );
                    }
                    self.acked = lsn;
                }
                Effect::Idle { .. } | Effect::BackfillDue => {}
                other => prop_assert!(false, "unexpected {:?}", other),
            }
        }
        Ok(())
    }

    fn send(&mut self, s: &mut UpstreamSession, frames: &[Vec<u8>]) -> Result<(), TestCaseError> {
        for f in frames {
            self.feed(s, Input::WalData(f))?;
        }
        Ok(())
    }

    /// A new session: Postgres resends every transaction whose end is past the confirmed
    /// position.
    fn restart(&mut self, s: &mut UpstreamSession) -> Result<(), TestCaseError> {
        self.feed(s, Input::Started)?;
        let resend: Vec<(u64, usize)> = self
            .wal
            .iter()
            .copied()
            .filter(|(l, _)| end(*l) > self.acked)
            .collect();
        for (lsn, rows) in resend {
            self.send(s, &frames_of(lsn, rows))?;
        }
        Ok(())
    }

    fn store(&mut self, s: &mut UpstreamSession) -> Result<(), TestCaseError> {
        if let Some(&last) = self.applied.last() {
            self.durable = self.durable.max(last);
            let watermark = w(self.durable);
            self.feed(s, Input::Stored { watermark })?;
        }
        Ok(())
    }
}

proptest! {
    /// Over any interleaving of transactions, sessions cut off mid-transaction, keepalives,
    /// restarts (which resend everything not yet confirmed) and storage catching up: every
    /// transaction is applied exactly once and whole, in order; an ack never covers a commit
    /// that is not durable nor passes the WAL received, and never moves backwards.
    #[test]
    fn every_transaction_is_applied_once_and_acks_never_pass_storage(
        steps in prop::collection::vec(step(), 1..40),
    ) {
        let mut s = started(0x10);
        let mut m = Model { durable: 0x10, sent_through: 0x10, acked: Lsn(0x10), ..Model::default() };
        let mut next_lsn = 0x20;
        for step in steps {
            match step {
                Step::Tx { rows, cut } => {
                    let lsn = next_lsn;
                    next_lsn += 0x10;
                    m.wal.push((lsn, rows));
                    let frames = frames_of(lsn, rows);
                    let take = cut.map_or(frames.len(), |c| c.min(frames.len()));
                    m.sent_through = end(lsn).0;
                    m.send(&mut s, &frames[..take])?;
                    if take < frames.len() {
                        m.restart(&mut s)?;
                    }
                }
                Step::Keepalive => {
                    let wal_end = m.sent_through;
                    m.feed(&mut s, Input::WalData(&pg_keepalive(wal_end, true)))?;
                }
                Step::Store => m.store(&mut s)?,
                Step::Restart => m.restart(&mut s)?,
            }
        }
        // Once storage catches up, everything the WAL holds is applied, once, and confirmed.
        m.store(&mut s)?;
        let expected: Vec<u64> = m.wal.iter().map(|t| t.0).collect();
        prop_assert_eq!(&m.applied, &expected);
        if let Some(&(last, _)) = m.wal.last() {
            prop_assert_eq!(m.acked, end(last));
        }
    }
}

#[derive(Debug, Clone)]
enum RelayStep {
    /// The primary sends a frame of up to this many messages.
    Frame(usize),
    /// Storage catches up with everything handed on.
    Store,
    /// The connection drops; the relay subscribes again from its durable watermark.
    Reconnect,
}

fn relay_step() -> impl Strategy<Value = RelayStep> {
    prop_oneof![
        5 => (1usize..5).prop_map(RelayStep::Frame),
        2 => Just(RelayStep::Store),
        1 => Just(RelayStep::Reconnect),
    ]
}

/// A relay's storage and its connection to the primary, around a session.
struct RelayModel {
    /// The primary's change log: each message and its transaction's index.
    log: Vec<(DownstreamMessage, usize)>,
    /// Rows per transaction.
    rows: Vec<usize>,
    applied: Vec<usize>,
    open: Option<(usize, usize)>,
    /// The newest durable transaction.
    durable: Option<usize>,
    /// This connection: the next message to send, the next frame id, what each frame sent
    /// carried, and the next id an ack must name.
    next: usize,
    next_id: u64,
    frames: Vec<Vec<usize>>,
    next_ack: u64,
}

fn tx_watermark(tx: usize) -> Watermark {
    w(0x10 * (tx as u64 + 1))
}

impl RelayModel {
    fn feed(&mut self, s: &mut UpstreamSession, input: Input<'_>) -> Result<(), TestCaseError> {
        let effects = s
            .handle(input)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for effect in effects {
            match effect {
                Effect::Apply(DownstreamMessage::Begin(b)) => {
                    prop_assert!(self.open.is_none());
                    let tx = (0..self.rows.len())
                        .find(|t| tx_watermark(*t) == b.commit_watermark)
                        .expect("a known transaction");
                    self.open = Some((tx, 0));
                }
                Effect::Apply(DownstreamMessage::Data(_)) => {
                    self.open.as_mut().expect("open").1 += 1
                }
                Effect::Apply(DownstreamMessage::Commit(_)) => {
                    let (tx, rows) = self.open.take().expect("open");
                    prop_assert!(!self.applied.contains(&tx), "applied twice");
                    prop_assert_eq!(rows, self.rows[tx], "applied whole");
                    self.applied.push(tx);
                }
                Effect::Apply(DownstreamMessage::Rollback(_)) => self.open = None,
                Effect::Apply(DownstreamMessage::Status(_)) => {}
                Effect::AckFrames(ids) => {
                    for id in ids {
                        prop_assert_eq!(id, self.next_ack, "acks once each, in id order");
                        self.next_ack += 1;
                        for tx in &self.frames[(id - 1) as usize] {
                            prop_assert!(
                                self.durable.is_some_and(|d| d >= *tx),
                                "frame {} acked before transaction {} is durable",
                                id,
                                tx
                            );
                        }
                    }
                }
                Effect::BackfillDue | Effect::Idle { .. } => {}
                other => prop_assert!(false, "unexpected {:?}", other),
            }
        }
        Ok(())
    }

    fn frame(&mut self, s: &mut UpstreamSession, count: usize) -> Result<(), TestCaseError> {
        let mut messages = Vec::new();
        let mut carried = Vec::new();
        if self.next_id == 1 {
            messages.push(status_msg());
        }
        for (message, tx) in self.log.iter().skip(self.next).take(count) {
            messages.push(message.clone());
            if !carried.contains(tx) {
                carried.push(*tx);
            }
        }
        self.next = (self.next + count).min(self.log.len());
        self.frames.push(carried);
        let id = self.next_id;
        self.next_id += 1;
        self.feed(s, Input::RelayFrame { id, messages })
    }

    fn store(&mut self, s: &mut UpstreamSession) -> Result<(), TestCaseError> {
        if let Some(&last) = self.applied.last() {
            self.durable = Some(last);
            self.feed(
                s,
                Input::Stored {
                    watermark: tx_watermark(last),
                },
            )?;
        }
        Ok(())
    }

    /// A new connection, subscribed from the durable watermark.
    fn reconnect(&mut self, s: &mut UpstreamSession) -> Result<(), TestCaseError> {
        self.feed(s, Input::Started)?;
        let from = self.durable.map_or(0, |d| d + 1);
        self.next = self
            .log
            .iter()
            .position(|(_, tx)| *tx >= from)
            .unwrap_or(self.log.len());
        self.next_id = 1;
        self.frames.clear();
        self.next_ack = 1;
        Ok(())
    }
}

proptest! {
    /// However the primary's stream is cut into frames, whenever storage catches up and the
    /// connection drops: every transaction is applied once, whole, in order; frames are acked
    /// once each, in id order, never before every transaction they carried is durable; and once
    /// storage has everything, every frame of the connection is acked.
    #[test]
    fn relay_frames_are_acked_once_in_order_and_never_before_their_transactions_are_durable(
        txs in prop::collection::vec((0usize..3, any::<bool>()), 1..8),
        steps in prop::collection::vec(relay_step(), 1..60),
    ) {
        let mut log = Vec::new();
        for (tx, &(rows, skip_ack)) in txs.iter().enumerate() {
            let mut begin = Begin::new(tx_watermark(tx));
            begin.skip_ack = skip_ack.then_some(true);
            log.push((DownstreamMessage::Begin(begin), tx));
            log.extend((0..rows).map(|_| (data_msg(), tx)));
            log.push((DownstreamMessage::Commit(Commit::new(tx_watermark(tx))), tx));
        }
        let mut m = RelayModel {
            log,
            rows: txs.iter().map(|t| t.0).collect(),
            applied: Vec::new(),
            open: None,
            durable: None,
            next: 0,
            next_id: 1,
            frames: Vec::new(),
            next_ack: 1,
        };
        let mut s = started(0x08);
        for step in steps {
            match step {
                RelayStep::Frame(count) => m.frame(&mut s, count)?,
                RelayStep::Store => m.store(&mut s)?,
                RelayStep::Reconnect => m.reconnect(&mut s)?,
            }
        }
        let rest = m.log.len() - m.next;
        m.frame(&mut s, rest)?;
        m.store(&mut s)?;
        prop_assert_eq!(&m.applied, &(0..txs.len()).collect::<Vec<_>>());
        prop_assert_eq!(m.next_ack, m.next_id, "every frame acked");
    }
}
