//! Transcripts of the scope server: inputs in, effects out, with plain values.

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::*;
use crate::scope_sync::MAX_MUTATIONS_PER_FRAME;

const EPOCH: &str = "v1";
const C: ConnId = 7;

fn server() -> ScopeServer {
    let mut server = ScopeServer::new(ServerConfig::new(EPOCH));
    server.handle(
        ServerInput::Opened {
            conn: C,
            session_id: "s".into(),
        },
        0,
    );
    server
}

fn object(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => panic!("not an object"),
    }
}

fn upsert(seq: i64, id: i64, owner: &str) -> FeedEntry {
    FeedEntry {
        table: "todos".into(),
        resource_id: id.to_string(),
        seq,
        updated_at: "2026-12-01T12:00:00.000Z".into(),
        change: FeedChange::Upsert {
            data: object(json!({"id": id, "owner": owner, "title": "t", "secret": "x"})),
        },
    }
}

fn exit(seq: i64, id: i64, old: &str, new: Option<&str>) -> FeedEntry {
    FeedEntry {
        table: "todos".into(),
        resource_id: id.to_string(),
        seq,
        updated_at: "2026-12-01T12:00:00.000Z".into(),
        change: FeedChange::Exit {
            old: object(json!({"owner": old})),
            new: new.map(|n| object(json!({"owner": n}))),
        },
    }
}

fn subscribe_text(id: &str, owner: &str, extra: Value) -> String {
    let mut params = object(json!({"resourceType": "todos", "conditions": {"owner": owner}}));
    params.extend(object(extra));
    json!({"type": "channel-subscribe", "subscriptionId": id, "channelType": "velocious-sync", "params": params}).to_string()
}

fn frame(server: &mut ScopeServer, text: &str) -> Vec<ServerEffect> {
    server.handle(
        ServerInput::Frame {
            conn: C,
            text: text.to_owned(),
        },
        0,
    )
}

fn grant() -> Decision {
    Decision::Granted(Grant {
        table: "todos".into(),
        omit_columns: vec!["secret".into()],
        expires_at_ms: None,
        row_filter: None,
    })
}

/// Sent frames as JSON values.
fn sent(effects: &[ServerEffect]) -> Vec<Value> {
    effects
        .iter()
        .filter_map(|e| match e {
            ServerEffect::Send { text, .. } => Some(serde_json::from_str(text).unwrap()),
            _ => None,
        })
        .collect()
}

/// A page request: ticket, pass, after, up to, count the total.
type Fetch = (u64, u64, Option<i64>, Option<i64>, bool);

fn fetch(effects: &[ServerEffect]) -> Option<Fetch> {
    effects.iter().find_map(|e| match e {
        ServerEffect::FetchPage {
            ticket,
            pass,
            after,
            up_to,
            count_total,
            ..
        } => Some((*ticket, *pass, *after, *up_to, *count_total)),
        _ => None,
    })
}

fn ticket_of(effects: &[ServerEffect]) -> u64 {
    effects
        .iter()
        .find_map(|e| match e {
            ServerEffect::Authorize { ticket, .. } => Some(*ticket),
            _ => None,
        })
        .expect("an Authorize effect")
}

fn page(
    server: &mut ScopeServer,
    ticket: u64,
    pass: u64,
    up_to: i64,
    rows: Vec<FeedEntry>,
) -> Vec<ServerEffect> {
    page_seeing_floor(server, ticket, pass, up_to, rows, None)
}

/// A page whose read saw the retention floor `floor`.
fn page_seeing_floor(
    server: &mut ScopeServer,
    ticket: u64,
    pass: u64,
    up_to: i64,
    rows: Vec<FeedEntry>,
    floor: Option<i64>,
) -> Vec<ServerEffect> {
    server.handle(
        ServerInput::PageFetched {
            conn: C,
            ticket,
            pass,
            result: PageResult::Rows {
                up_to,
                rows,
                total: Some(3),
                floor,
                access_changed: false,
            },
        },
        0,
    )
}

/// Subscribes `id` to owner `owner` and grants it; returns the ticket and the effects.
fn granted(
    server: &mut ScopeServer,
    id: &str,
    owner: &str,
    extra: Value,
) -> (u64, Vec<ServerEffect>) {
    granted_text(server, C, &subscribe_text(id, owner, extra))
}

/// Sends the subscribe frame `text` on `conn` and grants it; returns the ticket and the
/// effects of the grant.
fn granted_text(server: &mut ScopeServer, conn: ConnId, text: &str) -> (u64, Vec<ServerEffect>) {
    let effects = server.handle(
        ServerInput::Frame {
            conn,
            text: text.to_owned(),
        },
        0,
    );
    let ticket = ticket_of(&effects);
    let effects = server.handle(
        ServerInput::Authorized {
            conn,
            ticket,
            decision: grant(),
        },
        0,
    );
    (ticket, effects)
}

#[test]
fn a_socket_opens_with_session_established_and_answers_ping_and_resume() {
    let mut server = ScopeServer::new(ServerConfig::new(EPOCH));
    let effects = server.handle(
        ServerInput::Opened {
            conn: C,
            session_id: "abc".into(),
        },
        0,
    );
    assert_eq!(
        sent(&effects),
        vec![json!({"type": "session-established", "sessionId": "abc", "graceSeconds": 0})]
    );
    assert_eq!(
        sent(&frame(&mut server, r#"{"type":"ping"}"#)),
        vec![json!({"type": "pong"})]
    );
    assert_eq!(
        sent(&frame(
            &mut server,
            r#"{"type":"session-resume","sessionId":"abc"}"#
        )),
        vec![json!({"type": "session-gone"})]
    );
}

#[test]
fn a_fresh_subscribe_replays_pages_in_order_then_confirms() {
    let mut server = server();
    let (ticket, effects) = granted(&mut server, "s1", "ada", json!({"limit": 2}));
    let (t, pass, after, up_to, count) = fetch(&effects).expect("first page requested");
    assert_eq!((t, after, up_to, count), (ticket, None, None, true));
    let effects = page(
        &mut server,
        ticket,
        pass,
        9,
        vec![upsert(2, 1, "ada"), upsert(5, 2, "ada")],
    );
    let frames = sent(&effects);
    assert_eq!(frames.len(), 1);
    let body = &frames[0]["body"];
    assert_eq!(body["progress"], json!({"done": 2, "total": 3}));
    assert_eq!(body["syncs"][0]["id"], json!("v1:2"));
    assert_eq!(body["syncs"][0]["owner"], json!("ada"));
    assert_eq!(
        body["syncs"][0]["data"],
        json!({"id": 1, "owner": "ada", "title": "t"}),
        "secret omitted"
    );
    assert_eq!(
        fetch(&effects).map(|f| (f.2, f.3, f.4)),
        Some((Some(5), Some(9), false))
    );
    let effects = page(&mut server, ticket, pass, 9, vec![upsert(8, 3, "ada")]);
    let frames = sent(&effects);
    assert_eq!(frames.len(), 3);
    assert_eq!(
        frames[0]["body"]["progress"],
        json!({"done": 3, "total": 3})
    );
    // The scope's newest row is 8, but the client holds everything up to the pin, 9: its
    // cursor goes there, so a resume is never judged by a row that is only older.
    assert_eq!(
        frames[1]["body"],
        json!({"echoOrigin": null, "syncs": [],
               "cursor": {"id": "v1:9", "serverSequence": 9, "updatedAt": "1970-01-01T00:00:00.000Z"}})
    );
    assert_eq!(
        frames[2],
        json!({"type": "channel-subscribed", "subscriptionId": "s1"})
    );
    assert_eq!(
        server
            .delivered_cursor(C, "s1")
            .and_then(|c| c.server_sequence),
        Some(9)
    );
}

#[test]
fn a_replay_whose_last_row_is_the_pin_ends_without_a_checkpoint() {
    let mut server = server();
    let (ticket, effects) = granted(&mut server, "s1", "ada", json!({}));
    let pass = fetch(&effects).unwrap().1;
    let effects = page(&mut server, ticket, pass, 5, vec![upsert(5, 2, "ada")]);
    let frames = sent(&effects);
    assert_eq!(frames.len(), 2, "{frames:?}");
    assert_eq!(frames[1]["type"], "channel-subscribed");
}

#[test]
fn a_quiet_live_scope_is_told_how_far_the_feed_moved_once_per_checkpoint_interval() {
    let mut config = ServerConfig::new(EPOCH);
    config.checkpoint_interval_ms = 1_000;
    let mut server = ScopeServer::new(config);
    server.handle(
        ServerInput::Opened {
            conn: C,
            session_id: "s".into(),
        },
        0,
    );
    let (ticket, effects) = granted(&mut server, "s1", "ada", json!({}));
    let pass = fetch(&effects).unwrap().1;
    page(&mut server, ticket, pass, 5, vec![upsert(5, 2, "ada")]);
    // Others' rows move the feed on; ada's scope is quiet.
    server.handle(
        ServerInput::Committed {
            entries: vec![upsert(6, 9, "grace"), upsert(7, 10, "grace")],
            confirms: Vec::new(),
        },
        0,
    );
    assert!(
        sent(&server.handle(ServerInput::Tick, 100)).is_empty(),
        "the first tick starts the interval"
    );
    assert!(
        sent(&server.handle(ServerInput::Tick, 900)).is_empty(),
        "not before the interval"
    );
    let frames = sent(&server.handle(ServerInput::Tick, 1_100));
    assert_eq!(
        frames,
        vec![json!({"type": "channel-message", "subscriptionId": "s1",
            "body": {"echoOrigin": null, "syncs": [],
                     "cursor": {"id": "v1:7", "serverSequence": 7, "updatedAt": "2026-12-01T12:00:00.000Z"}}})]
    );
    // Nothing new since: no second checkpoint.
    assert!(sent(&server.handle(ServerInput::Tick, 5_000)).is_empty());
    // Its own row arrives live: that moves its cursor, so no checkpoint is due for it.
    server.handle(
        ServerInput::Committed {
            entries: vec![upsert(8, 2, "ada")],
            confirms: Vec::new(),
        },
        5_000,
    );
    assert!(sent(&server.handle(ServerInput::Tick, 9_000)).is_empty());
    assert_eq!(
        server
            .delivered_cursor(C, "s1")
            .and_then(|c| c.server_sequence),
        Some(8)
    );
}

#[test]
fn live_rows_above_the_pin_arrive_once_and_rows_at_or_below_come_by_replay() {
    let mut server = server();
    let (ticket, effects) = granted(&mut server, "s1", "ada", json!({"limit": 1}));
    let pass = fetch(&effects).unwrap().1;
    // Committed while the first page is read: which side of the pin is not known yet.
    let early = server.handle(
        ServerInput::Committed {
            entries: vec![upsert(4, 1, "ada")],
            confirms: Vec::new(),
        },
        0,
    );
    let late = server.handle(
        ServerInput::Committed {
            entries: vec![upsert(6, 2, "ada")],
            confirms: Vec::new(),
        },
        0,
    );
    assert!(
        sent(&early).is_empty() && sent(&late).is_empty(),
        "buffered until the pin"
    );
    // The page saw seq 4 (pin 5); seq 6 committed after the read.
    let effects = page(&mut server, ticket, pass, 5, vec![upsert(4, 1, "ada")]);
    let frames = sent(&effects);
    let seqs: Vec<Value> = frames
        .iter()
        .filter(|f| f["type"] == "channel-message")
        .map(|f| f["body"]["syncs"][0]["serverSequence"].clone())
        .collect();
    assert_eq!(
        seqs,
        vec![json!(4), json!(6)],
        "seq 4 by replay, seq 6 live, each once"
    );
    assert!(
        frames[1]["body"].get("progress").is_none(),
        "live envelopes carry no progress"
    );
    let effects = page(&mut server, ticket, pass, 5, vec![]);
    assert_eq!(
        sent(&effects),
        vec![json!({"type": "channel-subscribed", "subscriptionId": "s1"})]
    );
    let again = server.handle(
        ServerInput::Committed {
            entries: vec![upsert(5, 9, "ada")],
            confirms: Vec::new(),
        },
        0,
    );
    assert!(
        sent(&again).is_empty(),
        "at or below the pin: the replay had it"
    );
}

#[test]
fn one_transaction_is_one_envelope_and_moves_route_removals_to_the_old_scope() {
    let mut server = server();
    let (ta, ea) = granted(&mut server, "ada", "ada", json!({}));
    page(&mut server, ta, fetch(&ea).unwrap().1, 1, vec![]);
    let (tg, eg) = granted(&mut server, "grace", "grace", json!({}));
    page(&mut server, tg, fetch(&eg).unwrap().1, 1, vec![]);
    let (tz, ez) = granted(&mut server, "zed", "zed", json!({}));
    page(&mut server, tz, fetch(&ez).unwrap().1, 1, vec![]);
    let effects = server.handle(
        ServerInput::Committed {
            entries: vec![
                upsert(2, 1, "ada"),
                upsert(3, 2, "grace"),
                exit(3, 2, "ada", Some("grace")),
            ],
            confirms: Vec::new(),
        },
        0,
    );
    let frames = sent(&effects);
    assert_eq!(frames.len(), 2, "zed is not reached: {frames:?}");
    let ada = frames
        .iter()
        .find(|f| f["subscriptionId"] == "ada")
        .unwrap();
    let types: Vec<&Value> = ada["body"]["syncs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| &e["syncType"])
        .collect();
    assert_eq!(types, vec!["update", "delete"]);
    assert_eq!(
        ada["body"]["syncs"][1]["owner"],
        json!("ada"),
        "old scope values"
    );
    assert_eq!(ada["body"]["syncs"][1]["data"], Value::Null);
    let grace = frames
        .iter()
        .find(|f| f["subscriptionId"] == "grace")
        .unwrap();
    assert_eq!(grace["body"]["syncs"].as_array().unwrap().len(), 1);
    assert_eq!(grace["body"]["syncs"][0]["syncType"], json!("update"));
}

#[test]
fn refusals_are_typed_and_deliver_nothing() {
    let mut server = server();
    let code = |effects: &[ServerEffect]| sent(effects)[0]["code"].clone();
    let other =
        r#"{"type":"channel-subscribe","subscriptionId":"x","channelType":"chat","params":{}}"#;
    assert_eq!(code(&frame(&mut server, other)), json!("unknown-channel"));
    assert_eq!(code(&frame(&mut server, "{nope")), json!("bad-frame"));
    assert_eq!(
        code(&frame(&mut server, r#"{"type":"channel-subscribe"}"#)),
        json!("bad-frame")
    );
    let bad_limit = subscribe_text("l", "ada", json!({"limit": 0}));
    assert_eq!(
        code(&frame(&mut server, &bad_limit)),
        json!("invalid-params")
    );
    let no_type = r#"{"type":"channel-subscribe","subscriptionId":"n","channelType":"velocious-sync","params":{"conditions":{}}}"#;
    assert_eq!(code(&frame(&mut server, no_type)), json!("invalid-params"));
    let first = frame(&mut server, &subscribe_text("s1", "ada", json!({})));
    assert!(sent(&first).is_empty());
    let twice = frame(&mut server, &subscribe_text("s1", "ada", json!({})));
    assert_eq!(code(&twice), json!("subscription-in-use"));
    let denied = server.handle(
        ServerInput::Authorized {
            conn: C,
            ticket: ticket_of(&first),
            decision: Decision::Denied {
                code: "forbidden".into(),
                message: "no".into(),
            },
        },
        0,
    );
    assert_eq!(
        sent(&denied),
        vec![
            json!({"type": "channel-error", "subscriptionId": "s1", "message": "no", "code": "forbidden"})
        ]
    );
    assert!(fetch(&denied).is_none());
    let live = server.handle(
        ServerInput::Committed {
            entries: vec![upsert(2, 1, "ada")],
            confirms: Vec::new(),
        },
        0,
    );
    assert!(live.is_empty(), "a refused subscription gets nothing");
    assert_eq!(server.subscriptions(), 0);
}

#[test]
fn the_subscription_cap_is_per_socket() {
    let mut config = ServerConfig::new(EPOCH);
    config.max_subscriptions_per_connection = 1;
    let mut server = ScopeServer::new(config);
    server.handle(
        ServerInput::Opened {
            conn: C,
            session_id: "s".into(),
        },
        0,
    );
    frame(&mut server, &subscribe_text("a", "ada", json!({})));
    let effects = frame(&mut server, &subscribe_text("b", "ada", json!({})));
    assert_eq!(sent(&effects)[0]["code"], json!("too-many-subscriptions"));
}

#[test]
fn cursors_of_another_epoch_or_without_one_get_a_reset_and_a_full_replay() {
    for (after_id, reason) in [
        ("v0:5", "replica-version-changed"),
        ("5", "cursor-without-epoch"),
    ] {
        let mut server = server();
        let cursor = json!({"afterId": after_id, "afterServerSequence": 5, "afterUpdatedAt": "2026-12-01T12:00:00.000Z"});
        let (_, effects) = granted(&mut server, "s1", "ada", cursor);
        let frames = sent(&effects);
        assert_eq!(frames[0]["body"]["reset"]["reason"], json!(reason));
        assert_eq!(frames[0]["body"]["syncs"], json!([]));
        assert_eq!(fetch(&effects).map(|f| f.2), Some(None), "the whole scope");
    }
}

#[test]
fn a_resume_in_the_epoch_starts_after_the_cursor_unless_retention_or_a_truncate_says_reset() {
    let cursor = json!({"afterId": "v1:5", "afterServerSequence": 5, "afterUpdatedAt": "2026-12-01T12:00:00.000Z"});
    let mut server = server();
    let (ticket, effects) = granted(&mut server, "s1", "ada", cursor.clone());
    assert!(sent(&effects).is_empty());
    let (_, pass, after, ..) = fetch(&effects).unwrap();
    assert_eq!(after, Some(5));
    let truncated = server.handle(
        ServerInput::PageFetched {
            conn: C,
            ticket,
            pass,
            result: PageResult::Truncated,
        },
        0,
    );
    assert_eq!(
        sent(&truncated)[0]["body"]["reset"]["reason"],
        json!("table-truncated")
    );
    assert_eq!(fetch(&truncated).map(|f| f.2), Some(None));

    let mut server = self::server();
    server.handle(ServerInput::RetentionFloor(Some(9)), 0);
    let (_, effects) = granted(&mut server, "s1", "ada", cursor);
    assert_eq!(
        sent(&effects)[0]["body"]["reset"]["reason"],
        json!("cursor-before-retention")
    );
    assert_eq!(fetch(&effects).map(|f| f.2), Some(None));
}

/// Found by the simulation (seed 236): a row sent live while a replay ran
/// was dropped by the client with everything else at a truncate's reset marker, and the full
/// replay that followed left it out as "already sent live": the client lost the row.
#[test]
fn a_row_sent_live_before_a_truncate_reset_comes_again_in_the_full_replay() {
    let cursor = json!({"afterId": "v1:5", "afterServerSequence": 5, "afterUpdatedAt": "2026-12-01T12:00:00.000Z", "limit": 1});
    let mut server = server();
    let (ticket, effects) = granted(&mut server, "s1", "ada", cursor);
    let pass = fetch(&effects).unwrap().1;
    // The first page pins the high-water at 8; more pages follow.
    page(&mut server, ticket, pass, 8, vec![upsert(6, 1, "ada")]);
    // Row 2 is written above the pin: sent live while the replay runs.
    let live = server.handle(
        ServerInput::Committed {
            entries: vec![upsert(9, 2, "ada")],
            confirms: Vec::new(),
        },
        0,
    );
    assert_eq!(sent(&live)[0]["body"]["syncs"][0]["resourceId"], json!("2"));
    // The next page finds the table truncated after the cursor: reset, then a full replay.
    let truncated = server.handle(
        ServerInput::PageFetched {
            conn: C,
            ticket,
            pass,
            result: PageResult::Truncated,
        },
        0,
    );
    assert_eq!(
        sent(&truncated)[0]["body"]["reset"]["reason"],
        json!("table-truncated")
    );
    let (_, pass, after, ..) = fetch(&truncated).unwrap();
    assert_eq!(after, None);
    // The client dropped row 2 with the reset: the full replay must bring it again.
    let effects = page(&mut server, ticket, pass, 9, vec![upsert(9, 2, "ada")]);
    let ids: Vec<Value> = sent(&effects)
        .iter()
        .filter(|f| f["type"] == "channel-message")
        .flat_map(|f| f["body"]["syncs"].as_array().cloned().unwrap_or_default())
        .map(|e| e["resourceId"].clone())
        .collect();
    assert_eq!(ids, vec![json!("2")]);
}

/// Found by the simulation (seed 5011): exits were pruned past a subscription's cursor while
/// its replay ran; the pages read after the prune lacked those removals, and the client kept
/// rows that were gone.
#[test]
fn a_retention_floor_that_passes_a_running_replay_restarts_it_with_a_reset() {
    let cursor = json!({"afterId": "v1:5", "afterServerSequence": 5, "afterUpdatedAt": "2026-12-01T12:00:00.000Z", "limit": 1});
    let mut server = server();
    let (ticket, effects) = granted(&mut server, "s1", "ada", cursor);
    let pass = fetch(&effects).unwrap().1;
    let effects = page(&mut server, ticket, pass, 9, vec![upsert(6, 1, "ada")]);
    assert!(fetch(&effects).is_some(), "more pages follow");
    // Exits up to seq 7 are pruned while the next page is read.
    assert!(server
        .handle(ServerInput::RetentionFloor(Some(7)), 0)
        .is_empty());
    let effects = page(&mut server, ticket, pass, 9, vec![upsert(8, 2, "ada")]);
    let frames = sent(&effects);
    assert_eq!(
        frames[0]["body"]["reset"]["reason"],
        json!("cursor-before-retention"),
        "{frames:?}"
    );
    assert!(
        !frames
            .iter()
            .any(|f| f["body"]["syncs"].as_array().is_some_and(|s| !s.is_empty())),
        "the page read past the floor is not delivered"
    );
    let (_, _, after, ..) = fetch(&effects).unwrap();
    assert_eq!(after, None, "a full replay follows");
    // A subscription that starts above the floor goes on as before.
    let mut server = self::server();
    server.handle(ServerInput::RetentionFloor(Some(3)), 0);
    let cursor = json!({"afterId": "v1:5", "afterServerSequence": 5, "afterUpdatedAt": "2026-12-01T12:00:00.000Z", "limit": 1});
    let (ticket, effects) = granted(&mut server, "s1", "ada", cursor);
    let pass = fetch(&effects).unwrap().1;
    let effects = page(&mut server, ticket, pass, 9, vec![upsert(6, 1, "ada")]);
    assert_eq!(
        sent(&effects)[0]["body"]["syncs"][0]["resourceId"],
        json!("1")
    );
}

/// Found by the simulation (seed 1441): the host prunes exits, then hands the new floor over;
/// a page read in between reached the server first and passed a cursor whose removals were
/// gone. The floor the page's own read saw now counts, without the hand-off.
#[test]
fn a_page_that_saw_a_floor_past_its_cursor_restarts_the_replay_before_the_floor_arrives() {
    // A subscription resuming at seq 5 whose first page's read saw `floor`.
    let first_page = |row: FeedEntry, floor: i64| {
        let cursor = json!({"afterId": "v1:5", "afterServerSequence": 5, "afterUpdatedAt": "2026-12-01T12:00:00.000Z", "limit": 1});
        let mut server = server();
        let (ticket, effects) = granted(&mut server, "s1", "ada", cursor);
        let pass = fetch(&effects).unwrap().1;
        page_seeing_floor(&mut server, ticket, pass, 9, vec![row], Some(floor))
    };
    let effects = first_page(upsert(8, 2, "ada"), 7);
    let frames = sent(&effects);
    assert_eq!(
        frames[0]["body"]["reset"]["reason"],
        json!("cursor-before-retention"),
        "{frames:?}"
    );
    let (_, _, after, ..) = fetch(&effects).unwrap();
    assert_eq!(after, None, "a full replay follows");
    // A floor below the cursor changes nothing.
    let effects = first_page(upsert(6, 1, "ada"), 3);
    assert_eq!(
        sent(&effects)[0]["body"]["syncs"][0]["resourceId"],
        json!("1")
    );
}

#[test]
fn replay_pages_wait_for_room_and_a_socket_that_stays_full_is_closed() {
    let mut config = ServerConfig::new(EPOCH);
    config.outbound_budget_bytes = 200;
    config.slow_consumer_timeout_ms = 1_000;
    let mut server = ScopeServer::new(config);
    server.handle(
        ServerInput::Opened {
            conn: C,
            session_id: "s".into(),
        },
        0,
    );
    let (ticket, effects) = granted(&mut server, "s1", "ada", json!({"limit": 1}));
    let pass = fetch(&effects).unwrap().1;
    let effects = page(&mut server, ticket, pass, 9, vec![upsert(2, 1, "ada")]);
    assert!(
        fetch(&effects).is_none(),
        "the socket is over its budget: no page read"
    );
    let unflushed: usize = 400;
    let effects = server.handle(
        ServerInput::Written {
            conn: C,
            bytes: unflushed,
        },
        10,
    );
    assert!(
        fetch(&effects).is_some(),
        "room again: the next page is read"
    );
    // Live rows keep coming while nothing is flushed.
    let mut closed = Vec::new();
    for (i, now) in [100, 600, 1_200].into_iter().enumerate() {
        let effects = server.handle(
            ServerInput::Committed {
                entries: vec![upsert(20 + i as i64, 1, "ada")],
                confirms: Vec::new(),
            },
            now,
        );
        closed.extend(
            effects
                .into_iter()
                .filter(|e| matches!(e, ServerEffect::Close { .. })),
        );
    }
    assert_eq!(
        closed,
        vec![ServerEffect::Close {
            conn: C,
            code: 1013,
            reason: "slow consumer".into()
        }]
    );
    assert_eq!(server.connections(), 0);
}

#[test]
fn an_expired_token_ends_its_subscription_with_auth_expired() {
    let mut server = server();
    let effects = frame(&mut server, &subscribe_text("s1", "ada", json!({})));
    server.handle(
        ServerInput::Authorized {
            conn: C,
            ticket: ticket_of(&effects),
            decision: Decision::Granted(Grant {
                table: "todos".into(),
                omit_columns: vec![],
                expires_at_ms: Some(5_000),
                row_filter: None,
            }),
        },
        0,
    );
    assert!(sent(&server.handle(ServerInput::Tick, 4_999)).is_empty());
    let effects = server.handle(ServerInput::Tick, 5_000);
    assert_eq!(sent(&effects)[0]["code"], json!("auth-expired"));
    assert_eq!(server.subscriptions(), 0);
}

#[test]
fn unsubscribe_stops_delivery_and_frees_the_id() {
    let mut server = server();
    let (t, e) = granted(&mut server, "s1", "ada", json!({}));
    page(&mut server, t, fetch(&e).unwrap().1, 1, vec![]);
    let effects = frame(
        &mut server,
        r#"{"type":"channel-unsubscribe","subscriptionId":"s1"}"#,
    );
    assert_eq!(
        sent(&effects),
        vec![json!({"type": "channel-unsubscribed", "subscriptionId": "s1"})]
    );
    assert!(server
        .handle(
            ServerInput::Committed {
                entries: vec![upsert(2, 1, "ada")],
                confirms: Vec::new()
            },
            0
        )
        .is_empty());
    let (_, e) = granted(&mut server, "s1", "ada", json!({}));
    assert!(fetch(&e).is_some(), "the id can be used again");
}

/// A replica of one table in memory: rows by id with their seq and owner, and exits.
#[derive(Default)]
struct Feed {
    rows: BTreeMap<i64, (i64, String)>,
    exits: Vec<(i64, i64, String, Option<String>)>,
    seq: i64,
}

impl Feed {
    /// Applies a write; returns its feed entries.
    fn write(&mut self, id: i64, owner: Option<String>) -> Vec<FeedEntry> {
        self.seq += 1;
        let seq = self.seq;
        let old = self.rows.get(&id).map(|(_, o)| o.clone());
        let mut entries = Vec::new();
        match &owner {
            Some(owner) => {
                self.rows.insert(id, (seq, owner.clone()));
                entries.push(upsert(seq, id, owner));
            }
            None => {
                self.rows.remove(&id);
            }
        }
        if let Some(old) = old {
            if owner.as_ref() != Some(&old) {
                self.exits.push((seq, id, old.clone(), owner.clone()));
                entries.push(exit(seq, id, &old, owner.as_deref()));
            }
        }
        entries
    }

    fn page(
        &self,
        owner: &str,
        after: Option<i64>,
        up_to: Option<i64>,
        limit: u32,
    ) -> (i64, Vec<FeedEntry>) {
        let up_to = up_to.unwrap_or(self.seq);
        let after_seq = after.unwrap_or(0);
        let mut found: Vec<FeedEntry> = self
            .rows
            .iter()
            .filter(|(_, (seq, o))| o == owner && *seq > after_seq && *seq <= up_to)
            .map(|(id, (seq, o))| upsert(*seq, *id, o))
            .collect();
        if after.is_some() {
            found.extend(
                self.exits
                    .iter()
                    .filter(|(seq, _, old, new)| {
                        old == owner
                            && new.as_deref() != Some(owner)
                            && *seq > after_seq
                            && *seq <= up_to
                    })
                    .map(|(seq, id, old, new)| exit(*seq, *id, old, new.as_deref())),
            );
        }
        found.sort_by_key(|e| e.seq);
        found.truncate(limit as usize);
        (up_to, found)
    }
}

/// A client applying what it receives: rows by id, cursor never moving back.
#[derive(Default, Debug)]
struct Client {
    rows: BTreeMap<i64, String>,
    cursor: Option<i64>,
    subscribed: bool,
}

impl Client {
    fn receive(&mut self, frames: Vec<Value>) {
        for frame in frames {
            match frame["type"].as_str() {
                Some("channel-subscribed") => self.subscribed = true,
                Some("channel-message") => {
                    for entry in frame["body"]["syncs"].as_array().unwrap() {
                        let id: i64 = entry["resourceId"].as_str().unwrap().parse().unwrap();
                        if entry["syncType"] == "delete" {
                            self.rows.remove(&id);
                        } else {
                            self.rows
                                .insert(id, entry["data"]["owner"].as_str().unwrap().to_owned());
                        }
                        let seq = entry["serverSequence"].as_i64().unwrap();
                        self.cursor = Some(self.cursor.map_or(seq, |c| c.max(seq)));
                    }
                }
                _ => {}
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Step {
    Write { id: i64, owner: Option<u8> },
    Page,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0i64..6, proptest::option::weighted(0.8, 0u8..3)).prop_map(|(id, owner)| Step::Write { id, owner }),
        2 => Just(Step::Page),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Writes interleaved with replay pages in any order, from a fresh or a resumed cursor:
    /// the client ends equal to the scope, and its cursor never moves back.
    #[test]
    fn a_subscriber_ends_equal_to_its_scope_whatever_interleaves_with_its_replay(
        before in proptest::collection::vec((0i64..6, proptest::option::weighted(0.8, 0u8..3)), 0..12),
        resume_at in 0usize..12,
        steps in proptest::collection::vec(step(), 0..30),
        limit in 1u32..4,
    ) {
        let owners = ["ada", "grace", "zed"];
        let mut feed = Feed::default();
        let mut client = Client::default();
        for (i, (id, owner)) in before.iter().enumerate() {
            feed.write(*id, owner.map(|o| owners[o as usize].to_owned()));
            if i + 1 == resume_at {
                client.rows = feed.rows.iter().filter(|(_, (_, o))| o == "ada").map(|(id, (_, o))| (*id, o.clone())).collect();
                client.cursor = Some(feed.seq);
            }
        }
        let mut server = server();
        let extra = match client.cursor {
            Some(seq) => json!({"limit": limit, "afterId": format!("v1:{seq}"), "afterServerSequence": seq, "afterUpdatedAt": "2026-12-01T12:00:00.000Z"}),
            None => json!({"limit": limit}),
        };
        let (ticket, effects) = granted(&mut server, "s1", "ada", extra);
        let mut pending = fetch(&effects);
        client.receive(sent(&effects));
        let mut steps = steps;
        // Finish the replay in the end.
        steps.extend(std::iter::repeat_n(Step::Page, 40));
        for step in steps {
            let previous = client.cursor;
            match step {
                Step::Write { id, owner } => {
                    let entries = feed.write(id, owner.map(|o| owners[o as usize].to_owned()));
                    let effects = server.handle(ServerInput::Committed { entries, confirms: Vec::new() }, 0);
                    client.receive(sent(&effects));
                }
                Step::Page => {
                    let Some((_, pass, after, up_to, _)) = pending.take() else { continue };
                    let (pin, rows) = feed.page("ada", after, up_to, limit);
                    let effects = page(&mut server, ticket, pass, pin, rows);
                    pending = fetch(&effects);
                    client.receive(sent(&effects));
                }
            }
            prop_assert!(client.cursor >= previous, "the cursor moved back");
        }
        prop_assert!(client.subscribed);
        let want: BTreeMap<i64, String> = feed.rows.iter().filter(|(_, (_, o))| o == "ada").map(|(id, (_, o))| (*id, o.clone())).collect();
        prop_assert_eq!(&client.rows, &want);
    }
}

#[test]
fn tables_sized_for_a_burst_of_connections_shrink_once_they_leave() {
    let mut server = ScopeServer::new(ServerConfig::new(EPOCH));
    let conns: Vec<ConnId> = (100..1100).collect();
    for &conn in &conns {
        server.handle(
            ServerInput::Opened {
                conn,
                session_id: format!("s{conn}"),
            },
            0,
        );
        granted_text(
            &mut server,
            conn,
            &subscribe_text("a", &format!("u{conn}"), json!({})),
        );
    }
    assert_eq!(server.connections.len(), 1000);
    assert_eq!(server.index.len(), 1000, "every scope is routed");
    for &conn in &conns[..990] {
        server.handle(ServerInput::Closed { conn }, 0);
    }
    assert_eq!(server.connections.len(), 10);
    assert!(
        server.connections.capacity() <= 128 && server.index.capacity() <= 128,
        "capacities {} and {} after 990 of 1,000 connections left",
        server.connections.capacity(),
        server.index.capacity()
    );
}

/// Subscribes `id` with `conditions` and grants it, then finishes an empty replay.
fn live_with(server: &mut ScopeServer, id: &str, conditions: Value) {
    let text =
        json!({"type": "channel-subscribe", "subscriptionId": id, "channelType": "velocious-sync",
        "params": {"resourceType": "todos", "conditions": conditions}})
        .to_string();
    let (ticket, effects) = granted_text(server, C, &text);
    let pass = fetch(&effects).expect("a page is read").1;
    page(server, ticket, pass, 1, vec![]);
}

#[test]
fn scopes_with_operators_are_routed_live_and_left_by_the_rows_that_stop_matching() {
    let mut server = server();
    live_with(&mut server, "pair", json!({"owner": ["ada", "grace"]}));
    live_with(&mut server, "not-ada", json!({"owner": {"ne": "ada"}}));
    live_with(&mut server, "late", json!({"owner": {"gte": "h"}}));
    let effects = server.handle(
        ServerInput::Committed {
            entries: vec![
                upsert(2, 1, "ada"),
                upsert(3, 2, "zed"),
                // Row 3 moves from grace to zed: it leaves "pair" and enters "late".
                upsert(4, 3, "zed"),
                exit(4, 3, "grace", Some("zed")),
                // Row 4 moves from ada to grace: it stays in "pair".
                upsert(5, 4, "grace"),
                exit(5, 4, "ada", Some("grace")),
            ],
            confirms: Vec::new(),
        },
        0,
    );
    let frames = sent(&effects);
    let of = |id: &str| -> Vec<(Value, Value)> {
        frames
            .iter()
            .filter(|f| f["subscriptionId"] == id)
            .flat_map(|f| f["body"]["syncs"].as_array().cloned().unwrap_or_default())
            .map(|e| (e["resourceId"].clone(), e["syncType"].clone()))
            .collect()
    };
    assert_eq!(
        of("pair"),
        [
            (json!("1"), json!("update")),
            (json!("3"), json!("delete")),
            (json!("4"), json!("update")),
        ]
    );
    assert_eq!(
        of("not-ada"),
        [
            (json!("2"), json!("update")),
            (json!("3"), json!("update")),
            (json!("4"), json!("update")),
        ]
    );
    assert_eq!(
        of("late"),
        [(json!("2"), json!("update")), (json!("3"), json!("update"))]
    );
}

#[test]
fn malformed_operators_are_refused_with_invalid_params() {
    let mut server = server();
    let text = json!({"type": "channel-subscribe", "subscriptionId": "bad", "channelType": "velocious-sync",
        "params": {"resourceType": "todos", "conditions": {"owner": {"like": "a%"}}}})
    .to_string();
    let frames = sent(&frame(&mut server, &text));
    assert_eq!(frames.len(), 1);
    assert_eq!(frames[0]["type"], json!("channel-error"));
    assert_eq!(frames[0]["code"], json!("invalid-params"), "{frames:?}");
    assert!(
        frames[0]
            .to_string()
            .contains("unknown operator \\\"like\\\""),
        "{frames:?}"
    );
}

#[test]
fn metrics_count_grants_refusals_replay_and_live_rows_and_subscriptions_by_stage() {
    let mut server = server();
    let (ta, ea) = granted(&mut server, "ada", "ada", json!({}));
    let pass = fetch(&ea).unwrap().1;
    let (_, _) = granted(&mut server, "grace", "grace", json!({}));
    let refused = frame(&mut server, &subscribe_text("zed", "zed", json!({})));
    server.handle(
        ServerInput::Authorized {
            conn: C,
            ticket: ticket_of(&refused),
            decision: Decision::Denied {
                code: "forbidden".into(),
                message: "no".into(),
            },
        },
        0,
    );
    let metrics = server.metrics();
    assert_eq!(metrics.counts.granted, 2);
    assert_eq!(
        metrics.counts.denied,
        [("forbidden".to_owned(), 1)].into_iter().collect()
    );
    assert_eq!(metrics.subscriptions.get("replaying"), Some(&2));
    assert_eq!(metrics.connections, 1);

    page(
        &mut server,
        ta,
        pass,
        3,
        vec![upsert(2, 1, "ada"), upsert(3, 2, "ada")],
    );
    server.handle(
        ServerInput::Committed {
            entries: vec![upsert(4, 3, "ada"), exit(4, 1, "ada", Some("grace"))],
            confirms: Vec::new(),
        },
        0,
    );
    let metrics = server.metrics();
    assert_eq!(metrics.counts.replay_pages, 1);
    assert_eq!(metrics.counts.replay_rows, 2);
    // ada is live and gets one envelope (an upsert and a removal); grace still replays and
    // holds the entries it will be sent once its first page pins the high-water.
    assert_eq!(
        (metrics.counts.live_envelopes, metrics.counts.live_rows),
        (1, 2)
    );
    assert_eq!(metrics.counts.live_removals, 1);
    assert_eq!(metrics.subscriptions.get("live"), Some(&1));
    assert_eq!(metrics.subscriptions.get("replaying"), Some(&1));
    assert_eq!(metrics.routed_seq, Some(4));
}

// Writes.

fn writer() -> ScopeServer {
    let mut config = ServerConfig::new(EPOCH);
    config.takes_writes = true;
    let mut server = ScopeServer::new(config);
    for conn in [C, C + 1] {
        server.handle(
            ServerInput::Opened {
                conn,
                session_id: "s".into(),
            },
            0,
        );
    }
    server
}

fn mutate_text(client: &str, ids: &[u64]) -> String {
    let mutations: Vec<Value> = ids
        .iter()
        .map(|id| json!({"id": id, "table": "todos", "op": "insert", "row": {"id": id, "owner": "ada"}}))
        .collect();
    json!({"type": "mutate", "clientId": client, "mutations": mutations}).to_string()
}

/// The ticket and mutations of the ApplyMutations effect.
fn applying(effects: &[ServerEffect]) -> (u64, Vec<Result<Mutation, InvalidMutation>>) {
    effects
        .iter()
        .find_map(|e| match e {
            ServerEffect::ApplyMutations {
                ticket, mutations, ..
            } => Some((*ticket, mutations.clone())),
            _ => None,
        })
        .expect("an ApplyMutations effect")
}

/// A live subscription `id` on `conn` to ada's todos.
fn live_on(server: &mut ScopeServer, conn: ConnId, id: &str) {
    let (ticket, effects) = granted_text(server, conn, &subscribe_text(id, "ada", json!({})));
    let pass = fetch(&effects).unwrap().1;
    server.handle(
        ServerInput::PageFetched {
            conn,
            ticket,
            pass,
            result: PageResult::Rows {
                up_to: 1,
                rows: vec![],
                total: Some(0),
                floor: None,
                access_changed: false,
            },
        },
        0,
    );
}

#[test]
fn an_applied_mutation_is_confirmed_after_its_echoed_change_reaches_the_writer() {
    let mut server = writer();
    live_on(&mut server, C, "mine");
    live_on(&mut server, C + 1, "theirs");
    let (ticket, mutations) = applying(&frame(&mut server, &mutate_text("c1", &[1, 2])));
    assert_eq!(mutations.len(), 2);
    // Applied upstream, but the replica has not seen it yet: no answer.
    let effects = server.handle(
        ServerInput::MutationsApplied {
            conn: C,
            ticket,
            results: vec![MutationResult::confirmed(1), MutationResult::confirmed(2)],
            replicated: Some(0),
        },
        0,
    );
    assert_eq!(sent(&effects), Vec::<Value>::new());
    // Its transaction commits: the writer's envelope names its mutations, the other socket's
    // does not, and the answer follows the envelope.
    let effects = server.handle(
        ServerInput::Committed {
            entries: vec![upsert(5, 1, "ada"), upsert(6, 2, "ada")],
            confirms: vec![("c1".into(), 1), ("c1".into(), 2)],
        },
        0,
    );
    let mine: Vec<Value> = effects
        .iter()
        .filter_map(|e| match e {
            ServerEffect::Send { conn, text } if *conn == C => {
                Some(serde_json::from_str(text).unwrap())
            }
            _ => None,
        })
        .collect();
    assert_eq!(mine.len(), 2, "{mine:?}");
    assert_eq!(
        mine[0]["body"]["echoOrigin"],
        json!({"clientId": "c1", "mutationIds": [1, 2]})
    );
    assert_eq!(
        mine[1],
        json!({"type": "mutation-result", "clientId": "c1", "results": [
            {"id": 1, "status": "confirmed"}, {"id": 2, "status": "confirmed"}]})
    );
    let theirs: Vec<Value> = effects
        .iter()
        .filter_map(|e| match e {
            ServerEffect::Send { conn, text } if *conn == C + 1 => {
                Some(serde_json::from_str(text).unwrap())
            }
            _ => None,
        })
        .collect();
    assert_eq!(theirs.len(), 1);
    assert_eq!(theirs[0]["body"]["echoOrigin"], Value::Null);
}

#[test]
fn a_resent_mutation_the_replica_already_holds_is_confirmed_at_once_and_rejections_keep_their_place(
) {
    let mut server = writer();
    live_on(&mut server, C, "mine");
    let (ticket, _) = applying(&frame(&mut server, &mutate_text("c1", &[3, 4, 5])));
    let effects = server.handle(
        ServerInput::MutationsApplied {
            conn: C,
            ticket,
            results: vec![
                MutationResult::confirmed(3),
                MutationResult::rejected(4, "forbidden", "not yours"),
                MutationResult::confirmed(5),
            ],
            replicated: Some(3),
        },
        0,
    );
    // 3 is in the replica, 4 is refused, 5 waits for its change.
    assert_eq!(
        sent(&effects),
        vec![
            json!({"type": "mutation-result", "clientId": "c1", "results": [
            {"id": 3, "status": "confirmed"},
            {"id": 4, "status": "rejected", "code": "forbidden", "message": "not yours"}]})
        ]
    );
    let effects = server.handle(
        ServerInput::Committed {
            entries: vec![],
            confirms: vec![("c1".into(), 5)],
        },
        0,
    );
    assert_eq!(
        sent(&effects),
        vec![
            json!({"type": "mutation-result", "clientId": "c1", "results": [{"id": 5, "status": "confirmed"}]})
        ]
    );
    let metrics = server.metrics().counts;
    assert_eq!(
        (
            metrics.mutations_received,
            metrics.mutations_applied,
            metrics.mutations_rejected
        ),
        (3, 2, 1)
    );
}

#[test]
fn a_confirmation_waits_for_the_sockets_replays_to_finish() {
    let mut server = writer();
    let (ticket, effects) = granted(&mut server, "s1", "ada", json!({}));
    let pass = fetch(&effects).unwrap().1;
    let (apply, _) = applying(&frame(&mut server, &mutate_text("c1", &[1])));
    let effects = server.handle(
        ServerInput::MutationsApplied {
            conn: C,
            ticket: apply,
            results: vec![MutationResult::confirmed(1)],
            replicated: Some(1),
        },
        0,
    );
    assert_eq!(sent(&effects), Vec::<Value>::new(), "held while s1 replays");
    let effects = page(&mut server, ticket, pass, 5, vec![upsert(5, 1, "ada")]);
    let frames = sent(&effects);
    let last = frames.last().unwrap();
    assert_eq!(last["type"], "mutation-result", "{frames:?}");
    let page_at = frames
        .iter()
        .position(|f| f["type"] == "channel-message")
        .unwrap();
    assert!(
        page_at < frames.len() - 1,
        "the row comes before the answer"
    );
}

#[test]
fn write_frames_are_checked_one_batch_one_client_and_ordered() {
    let mut server = writer();
    let (ticket, _) = applying(&frame(&mut server, &mutate_text("c1", &[1])));
    // A second batch while the first is applied.
    let frames = sent(&frame(&mut server, &mutate_text("c1", &[2])));
    assert_eq!(frames[0]["code"], "busy");
    server.handle(
        ServerInput::MutationsApplied {
            conn: C,
            ticket,
            results: vec![MutationResult::rejected(1, "invalid", "no")],
            replicated: None,
        },
        0,
    );
    // Another client on the same socket.
    let frames = sent(&frame(&mut server, &mutate_text("c2", &[2])));
    assert_eq!(frames[0]["code"], "client-changed");
    // Ids out of order, and a mutation without an id.
    let frames = sent(&frame(&mut server, &mutate_text("c1", &[3, 2])));
    assert_eq!(frames[0]["code"], "bad-frame");
    let text =
        json!({"type": "mutate", "clientId": "c1", "mutations": [{"table": "t"}]}).to_string();
    assert_eq!(sent(&frame(&mut server, &text))[0]["code"], "bad-frame");
    // A malformed mutation is handed on as invalid, the next one applies.
    let text = json!({"type": "mutate", "clientId": "c1", "mutations": [
        {"id": 4, "table": "todos", "op": "merge", "row": {"id": 1}},
        {"id": 5, "table": "todos", "op": "delete", "row": {"id": 1}}]})
    .to_string();
    let (_, mutations) = applying(&frame(&mut server, &text));
    assert!(mutations[0].is_err());
    assert_eq!(mutations[1].as_ref().unwrap().id, 5);
    // Too many in one frame.
    let ids: Vec<u64> = (10..=10 + MAX_MUTATIONS_PER_FRAME as u64).collect();
    let mut fresh = writer();
    assert_eq!(
        sent(&frame(&mut fresh, &mutate_text("c1", &ids)))[0]["code"],
        "bad-frame"
    );
}

#[test]
fn after_a_mutation_to_send_again_every_later_one_is_sent_again() {
    let mut server = writer();
    let (ticket, _) = applying(&frame(&mut server, &mutate_text("c1", &[1, 2, 3])));
    let effects = server.handle(
        ServerInput::MutationsApplied {
            conn: C,
            ticket,
            results: vec![
                MutationResult::rejected(1, "invalid", "no"),
                MutationResult::retry(2, "unavailable", "Postgres went away"),
                MutationResult::confirmed(3),
            ],
            replicated: Some(3),
        },
        0,
    );
    let statuses: Vec<Value> = sent(&effects)[0]["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["status"].clone())
        .collect();
    assert_eq!(
        statuses,
        [json!("rejected"), json!("retry"), json!("retry")]
    );
}

#[test]
fn a_node_that_takes_no_writes_asks_for_them_again_later() {
    let mut server = server();
    let frames = sent(&frame(&mut server, &mutate_text("c1", &[1, 2])));
    assert_eq!(
        frames,
        vec![
            json!({"type": "mutation-result", "clientId": "c1", "results": [
            {"id": 1, "status": "retry", "code": "unavailable",
             "message": "this node takes no writes (a relay): they are applied through the primary"},
            {"id": 2, "status": "retry", "code": "unavailable",
             "message": "this node takes no writes (a relay): they are applied through the primary"}]})
        ]
    );
}

#[test]
fn awaited_mutations_already_in_the_replica_are_confirmed_once_the_host_has_looked() {
    let mut server = writer();
    let text = json!({"type": "await-mutations", "clientId": "c1", "ids": [3]}).to_string();
    let effects = frame(&mut server, &text);
    assert!(effects
        .iter()
        .any(|e| matches!(e, ServerEffect::LookUpReplicated { client_id } if client_id == "c1")));
    assert_eq!(sent(&effects), Vec::<Value>::new());
    let effects = server.handle(
        ServerInput::Replicated {
            client_id: "c1".into(),
            last: Some(4),
        },
        0,
    );
    assert_eq!(
        sent(&effects),
        vec![
            json!({"type": "mutation-result", "clientId": "c1", "results": [{"id": 3, "status": "confirmed"}]})
        ]
    );
}

#[test]
fn awaited_mutations_of_an_app_backend_are_confirmed_when_their_confirm_arrives() {
    let mut server = writer();
    let text = json!({"type": "await-mutations", "clientId": "c1", "ids": [7, 8]}).to_string();
    assert_eq!(sent(&frame(&mut server, &text)), Vec::<Value>::new());
    let effects = server.handle(
        ServerInput::Committed {
            entries: vec![],
            confirms: vec![("c1".into(), 7)],
        },
        0,
    );
    assert_eq!(
        sent(&effects),
        vec![
            json!({"type": "mutation-result", "clientId": "c1", "results": [{"id": 7, "status": "confirmed"}]})
        ]
    );
    // A socket that closes forgets its client.
    server.handle(ServerInput::Closed { conn: C }, 0);
    assert!(server.replicated.is_empty());
}

/// A `channel-message` written with its envelope streamed in is the frame's own text, so a
/// client reads the same keys in the same order as from `ServerFrame::to_json`.
#[test]
fn message_text_is_the_channel_message_frame_text() {
    let entry = |seq: i64| {
        SyncEntry::try_from(json!({
            "data": {"id": seq, "owner": "ada", "big": 123456789012345678901234567890_u128},
            "id": format!("e1:{seq}"),
            "resourceId": seq.to_string(),
            "resourceType": "Task",
            "serverSequence": seq,
            "syncType": "update",
            "updatedAt": "2026-07-01T10:00:00.000Z",
            "owner": "ada",
        }))
        .expect("an entry")
    };
    let mut envelope = SyncEnvelope::new(None, vec![entry(1), entry(2)]);
    envelope
        .extra
        .insert("progress".to_owned(), json!({"done": 2, "total": 9}));
    for envelope in [
        envelope.clone(),
        SyncEnvelope::checkpoint(&feed_cursor("e1", 7, None)),
        envelope.with_echo(Some(Echo {
            client_id: "c".to_owned(),
            mutation_ids: vec![3],
        })),
    ] {
        let frame = ServerFrame::ChannelMessage {
            subscription_id: "s\"1".to_owned(),
            body: envelope.to_value(),
            event_id: None,
        };
        assert_eq!(message_text("s\"1", &envelope), frame.to_json());
    }
}
