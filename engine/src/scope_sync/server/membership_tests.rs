//! Transcripts of scopes whose row filter reaches rows through a membership table: sets read
//! and kept, rows moved in and out live, a replay started over, a resume that finds its access
//! changed.

use serde_json::{json, Map, Value};

use super::*;
use crate::scope_sync::rules::row_filter::RuleFilter;

const EPOCH: &str = "v1";
const C: ConnId = 3;
const AT: &str = "2026-12-01T12:00:00.000Z";

fn object(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => panic!("not an object"),
    }
}

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

fn filter(text: &str, sub: &str) -> RowFilter {
    RuleFilter::parse(text)
        .expect("parses")
        .bind(&object(json!({"sub": sub})))
        .expect("binds")
}

const MEMBER_OF: &str = "project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub)";

fn todo(seq: i64, id: i64, project: i64) -> FeedEntry {
    FeedEntry {
        table: "todos".into(),
        resource_id: id.to_string(),
        seq,
        updated_at: AT.into(),
        change: FeedChange::Upsert {
            data: object(json!({"id": id, "project_id": project, "title": "t"})),
        },
    }
}

fn member(seq: i64, id: i64, user: &str, project: i64) -> FeedEntry {
    FeedEntry {
        table: "members".into(),
        resource_id: id.to_string(),
        seq,
        updated_at: AT.into(),
        change: FeedChange::Upsert {
            data: object(json!({"id": id, "user_id": user, "project_id": project})),
        },
    }
}

fn member_gone(seq: i64, id: i64, user: &str, project: i64) -> FeedEntry {
    FeedEntry {
        table: "members".into(),
        resource_id: id.to_string(),
        seq,
        updated_at: AT.into(),
        change: FeedChange::Exit {
            old: object(json!({"user_id": user, "project_id": project})),
            new: None,
        },
    }
}

fn rows(up_to: i64, rows: Vec<FeedEntry>) -> PageResult {
    PageResult::Rows {
        up_to,
        rows,
        total: None,
        floor: None,
        access_changed: false,
    }
}

fn commit(server: &mut ScopeServer, entries: Vec<FeedEntry>) -> Vec<ServerEffect> {
    server.handle(
        ServerInput::Committed {
            entries,
            confirms: Vec::new(),
        },
        0,
    )
}

/// The channel messages sent, as envelope bodies.
fn bodies(effects: &[ServerEffect]) -> Vec<Value> {
    effects
        .iter()
        .filter_map(|e| match e {
            ServerEffect::Send { text, .. } => {
                let frame: Value = serde_json::from_str(text).unwrap();
                (frame["type"] == "channel-message").then(|| frame["body"].clone())
            }
            _ => None,
        })
        .collect()
}

/// The resource ids an envelope upserts, and those it deletes.
fn ids(body: &Value) -> (Vec<String>, Vec<String>) {
    let mut upserts = Vec::new();
    let mut deletes = Vec::new();
    for entry in body["syncs"].as_array().into_iter().flatten() {
        let id = entry["resourceId"].as_str().unwrap().to_owned();
        if entry["syncType"] == "delete" {
            deletes.push(id);
        } else {
            upserts.push(id);
        }
    }
    (upserts, deletes)
}

fn set_reads(effects: &[ServerEffect]) -> Vec<(SetId, String, String)> {
    effects
        .iter()
        .filter_map(|e| match e {
            ServerEffect::ReadSet {
                set,
                table,
                row_filter,
                ..
            } => Some((*set, table.clone(), row_filter.to_string())),
            _ => None,
        })
        .collect()
}

fn move_reads(effects: &[ServerEffect]) -> Vec<(u64, String)> {
    effects
        .iter()
        .filter_map(|e| match e {
            ServerEffect::ReadMoves {
                read, row_filter, ..
            } => Some((*read, row_filter.to_string())),
            _ => None,
        })
        .collect()
}

fn page_request(effects: &[ServerEffect]) -> Option<(u64, u64, Vec<SetQuery>)> {
    effects.iter().find_map(|e| match e {
        ServerEffect::FetchPage {
            ticket,
            pass,
            access,
            ..
        } => Some((*ticket, *pass, access.clone())),
        _ => None,
    })
}

/// Subscribes `id` to every todo `sub` may see, with `after` as its cursor; returns the
/// effects of the grant.
fn subscribe(
    server: &mut ScopeServer,
    id: &str,
    sub: &str,
    after: Option<Value>,
) -> Vec<ServerEffect> {
    subscribe_to(server, id, "todos", filter(MEMBER_OF, sub), after)
}

/// Subscribes `id` to every row of `table`, granted with `row_filter`, from `after`; returns
/// the effects of the grant.
fn subscribe_to(
    server: &mut ScopeServer,
    id: &str,
    table: &str,
    row_filter: RowFilter,
    after: Option<Value>,
) -> Vec<ServerEffect> {
    let mut params = json!({"resourceType": table, "conditions": {}});
    if let Some(after) = after {
        params["afterId"] = after["id"].clone();
        params["afterServerSequence"] = after["serverSequence"].clone();
        params["afterUpdatedAt"] = after["updatedAt"].clone();
    }
    let text = json!({"type": "channel-subscribe", "subscriptionId": id,
        "channelType": "velocious-sync", "params": params})
    .to_string();
    let effects = server.handle(ServerInput::Frame { conn: C, text }, 0);
    let ticket = effects
        .iter()
        .find_map(|e| match e {
            ServerEffect::Authorize { ticket, .. } => Some(*ticket),
            _ => None,
        })
        .expect("authorize");
    server.handle(
        ServerInput::Authorized {
            conn: C,
            ticket,
            decision: Decision::Granted(Grant {
                table: table.into(),
                omit_columns: Vec::new(),
                expires_at_ms: None,
                row_filter: Some(row_filter),
            }),
        },
        0,
    )
}

/// Ada, a member of project 1, subscribed and her set read: the first page is asked for
/// (ticket and pass).
fn replaying_ada() -> (ScopeServer, u64, u64) {
    let mut server = server();
    let effects = subscribe(&mut server, "s", "ada", None);
    let (set, ..) = set_reads(&effects)[0].clone();
    let effects = server.handle(
        ServerInput::SetRead {
            set,
            result: rows(9, vec![member(5, 100, "ada", 1)]),
        },
        0,
    );
    let (ticket, pass, _) = page_request(&effects).expect("the replay starts");
    (server, ticket, pass)
}

/// Ada, a member of project 1, subscribed and live with todo 1 (project 1); seq 10 is the
/// newest.
fn live_ada() -> (ScopeServer, SetId) {
    let mut server = server();
    let effects = subscribe(&mut server, "s", "ada", None);
    let reads = set_reads(&effects);
    assert_eq!(reads.len(), 1, "{effects:?}");
    let (set, table, filter) = reads[0].clone();
    assert_eq!(table, "members");
    assert!(
        filter.contains("\"user_id\" Eq(String(\"ada\"))"),
        "{filter}"
    );
    assert!(
        page_request(&effects).is_none(),
        "the replay waits for its set"
    );

    let effects = server.handle(
        ServerInput::SetRead {
            set,
            result: rows(9, vec![member(5, 100, "ada", 1)]),
        },
        0,
    );
    let (ticket, pass, access) = page_request(&effects).expect("the replay starts");
    assert!(
        access.is_empty(),
        "a fresh subscribe has no cursor to check"
    );
    let effects = server.handle(
        ServerInput::PageFetched {
            conn: C,
            ticket,
            pass,
            result: rows(10, vec![todo(7, 1, 1)]),
        },
        0,
    );
    assert_eq!(ids(&bodies(&effects)[0]).0, ["1"]);
    (server, set)
}

#[test]
fn a_membership_added_moves_its_project_in_and_one_removed_moves_it_out() {
    let (mut server, _) = live_ada();

    // Routed by the set's values: project 1's todo reaches ada, project 2's does not.
    let effects = commit(&mut server, vec![todo(11, 2, 1), todo(12, 3, 2)]);
    let sent = bodies(&effects);
    assert_eq!(sent.len(), 1);
    assert_eq!(ids(&sent[0]), (vec!["2".to_owned()], vec![]));

    // Ada joins project 2: its rows are read, and the commit waits for them.
    let effects = commit(&mut server, vec![member(13, 101, "ada", 2)]);
    assert!(bodies(&effects).is_empty(), "{effects:?}");
    let reads = move_reads(&effects);
    assert_eq!(reads.len(), 1);
    let (read, narrowed) = reads[0].clone();
    assert!(
        narrowed.contains("\"project_id\" In([Number(2)])"),
        "{narrowed}"
    );
    // A commit meanwhile waits its turn.
    let effects = commit(&mut server, vec![todo(14, 4, 2), todo(15, 9, 2)]);
    assert!(effects.is_empty(), "{effects:?}");

    // The read (taken after seq 14) has todo 3 and the newer todo 4.
    let effects = server.handle(
        ServerInput::MovesRead {
            read,
            result: rows(14, vec![todo(12, 3, 2), todo(14, 4, 2)]),
        },
        0,
    );
    let sent = bodies(&effects);
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(
        ids(&sent[0]),
        (vec!["3".to_owned(), "4".to_owned()], vec![])
    );
    // The waiting commit follows without todo 4's entry: the move sent that version.
    assert_eq!(ids(&sent[1]), (vec!["9".to_owned()], vec![]), "{sent:?}");
    assert_eq!(sent[0]["moves"], json!({"out": []}));
    assert_eq!(
        sent[0]["cursor"]["id"], "v1:13",
        "the cursor is the moving commit's"
    );
    assert_eq!(server.metrics().counts.moves, 1);

    // Ada leaves project 1: its rows go, by value, with no read.
    let effects = commit(&mut server, vec![member_gone(16, 100, "ada", 1)]);
    assert!(move_reads(&effects).is_empty());
    let sent = bodies(&effects);
    assert_eq!(sent.len(), 1);
    assert_eq!(
        sent[0]["moves"],
        json!({"out": [{"column": "project_id", "values": [1]}]})
    );
    assert_eq!(sent[0]["cursor"]["id"], "v1:16");
    // And project 1's changes no longer reach her; project 2's do.
    let effects = commit(&mut server, vec![todo(17, 1, 1), todo(18, 3, 2)]);
    let sent = bodies(&effects);
    assert_eq!(sent.len(), 1);
    assert_eq!(ids(&sent[0]), (vec!["3".to_owned()], vec![]));

    // Another user's membership changes nothing for ada.
    let effects = commit(&mut server, vec![member(19, 102, "bob", 1)]);
    assert!(effects.is_empty(), "{effects:?}");
}

#[test]
fn two_memberships_of_one_project_keep_it_until_the_last_goes() {
    let (mut server, _) = live_ada();
    // A second path to project 1 (say, through a team) changes nothing.
    let effects = commit(&mut server, vec![member(11, 200, "ada", 1)]);
    assert!(effects.is_empty(), "{effects:?}");
    let effects = commit(&mut server, vec![member_gone(12, 100, "ada", 1)]);
    assert!(effects.is_empty(), "{effects:?}");
    let effects = commit(&mut server, vec![member_gone(13, 200, "ada", 1)]);
    assert_eq!(
        bodies(&effects)[0]["moves"]["out"][0]["values"],
        json!([1]),
        "{effects:?}"
    );
}

#[test]
fn under_or_a_value_that_leaves_is_read_again_for_rows_another_path_keeps() {
    let mut server = server();
    let or_filter = filter(&format!("{MEMBER_OF} OR owner = auth.sub"), "ada");
    let effects = subscribe_to(&mut server, "s", "todos", or_filter, None);
    let (set, ..) = set_reads(&effects)[0].clone();
    let effects = server.handle(
        ServerInput::SetRead {
            set,
            result: rows(9, vec![member(5, 100, "ada", 1)]),
        },
        0,
    );
    let (ticket, pass, _) = page_request(&effects).unwrap();
    server.handle(
        ServerInput::PageFetched {
            conn: C,
            ticket,
            pass,
            result: rows(10, vec![]),
        },
        0,
    );
    // Routed by both branches: the set's values and the owner. A row found by both is sent
    // once; one found by neither is not looked at.
    let owned = |seq: i64, id: i64, project: i64, owner: &str| {
        let mut entry = todo(seq, id, project);
        if let FeedChange::Upsert { data } = &mut entry.change {
            data.insert("owner".into(), json!(owner));
        }
        entry
    };
    let effects = commit(&mut server, vec![owned(11, 7, 1, "ada")]);
    let sent = bodies(&effects);
    assert_eq!(sent.len(), 1);
    assert_eq!(ids(&sent[0]).0, ["7"], "once, though both routes find it");
    let candidates = server.candidates(&owned(10, 8, 9, "bob"));
    assert!(candidates.is_empty(), "{candidates:?}");
    assert_eq!(server.candidates(&owned(10, 8, 9, "ada")).len(), 1);
    let effects = commit(&mut server, vec![member_gone(11, 100, "ada", 1)]);
    let reads = move_reads(&effects);
    assert_eq!(
        reads.len(),
        1,
        "rows of project 1 ada owns stay: {effects:?}"
    );
    let mut own = todo(8, 5, 1);
    if let FeedChange::Upsert { data } = &mut own.change {
        data.insert("owner".into(), json!("ada"));
    }
    let effects = server.handle(
        ServerInput::MovesRead {
            read: reads[0].0,
            result: rows(12, vec![own, owned(11, 7, 1, "ada")]),
        },
        0,
    );
    let sent = bodies(&effects);
    assert_eq!(sent[0]["moves"]["out"][0]["values"], json!([1]));
    assert_eq!(
        ids(&sent[0]).0,
        ["5", "7"],
        "dropped by value, then kept by owner (7 again: the client dropped it too)"
    );
}

#[test]
fn a_replay_under_way_when_access_changes_starts_over_with_a_reset() {
    let (mut server, ticket, pass) = replaying_ada();
    // Ada leaves project 1 while the first page is being read.
    let effects = commit(&mut server, vec![member_gone(10, 100, "ada", 1)]);
    assert!(bodies(&effects).is_empty() && move_reads(&effects).is_empty());
    let effects = server.handle(
        ServerInput::PageFetched {
            conn: C,
            ticket,
            pass,
            result: rows(9, vec![todo(7, 1, 1)]),
        },
        0,
    );
    let sent = bodies(&effects);
    assert_eq!(sent.len(), 1, "only the reset marker: {sent:?}");
    assert_eq!(sent[0]["reset"]["reason"], "access-changed");
    assert!(ids(&sent[0]).0.is_empty(), "the stale page is not sent");
    assert!(page_request(&effects).is_some(), "the replay starts over");
}

#[test]
fn a_resume_whose_access_changed_since_its_cursor_replays_whole() {
    let (mut server, _) = live_ada();
    let effects = subscribe(
        &mut server,
        "r",
        "ada",
        Some(json!({"id": "v1:10", "serverSequence": 10, "updatedAt": AT})),
    );
    // Ada's set is shared: no read, and the resume checks it since the cursor.
    assert!(set_reads(&effects).is_empty());
    let (ticket, pass, access) = page_request(&effects).expect("starts at once");
    assert_eq!(access.len(), 1);
    assert_eq!(access[0].table, "members");
    let effects = server.handle(
        ServerInput::PageFetched {
            conn: C,
            ticket,
            pass,
            result: PageResult::Rows {
                up_to: 12,
                rows: vec![],
                total: None,
                floor: None,
                access_changed: true,
            },
        },
        0,
    );
    let sent = bodies(&effects);
    assert_eq!(sent[0]["reset"]["reason"], "access-changed");
    let (_, _, access) = page_request(&effects).expect("a full replay");
    assert!(access.is_empty(), "a full replay has no cursor to check");
    assert_eq!(server.metrics().sets, 1);
    // The last holder gone, the set goes.
    server.handle(ServerInput::Closed { conn: C }, 0);
    assert_eq!(server.metrics().sets, 0);
}

#[test]
fn nested_subqueries_read_children_first_and_reread_parents_when_a_child_changes() {
    let mut server = server();
    let nested = filter(
        &format!("todo_id IN (SELECT id FROM todos WHERE {MEMBER_OF})"),
        "ada",
    );
    let effects = subscribe_to(&mut server, "c", "comments", nested, None);
    let reads = set_reads(&effects);
    assert_eq!(reads.len(), 1, "the members set first: {reads:?}");
    assert_eq!(reads[0].1, "members");
    let effects = server.handle(
        ServerInput::SetRead {
            set: reads[0].0,
            result: rows(9, vec![member(5, 100, "ada", 1)]),
        },
        0,
    );
    let reads = set_reads(&effects);
    assert_eq!(reads.len(), 1, "then the todos set: {reads:?}");
    assert_eq!(reads[0].1, "todos");
    let todos_set = reads[0].0;
    assert!(page_request(&effects).is_none());
    let effects = server.handle(
        ServerInput::SetRead {
            set: todos_set,
            result: rows(9, vec![todo(7, 1, 1)]),
        },
        0,
    );
    let (ticket, pass, _) = page_request(&effects).expect("now the replay");
    server.handle(
        ServerInput::PageFetched {
            conn: C,
            ticket,
            pass,
            result: rows(10, vec![]),
        },
        0,
    );
    let comment = |seq: i64, id: i64, todo: i64| FeedEntry {
        table: "comments".into(),
        resource_id: id.to_string(),
        seq,
        updated_at: AT.into(),
        change: FeedChange::Upsert {
            data: object(json!({"id": id, "todo_id": todo})),
        },
    };
    // A todo created in project 1 joins the todos set at once: its comments are read in
    // (one may predate it), and the one written with it is sent once.
    let effects = commit(&mut server, vec![todo(11, 2, 1), comment(12, 50, 2)]);
    let reads = move_reads(&effects);
    assert!(
        reads[0].1.contains("\"todo_id\" In([Number(2)])"),
        "{reads:?}"
    );
    let effects = server.handle(
        ServerInput::MovesRead {
            read: reads[0].0,
            result: rows(12, vec![comment(3, 49, 2), comment(12, 50, 2)]),
        },
        0,
    );
    let sent = bodies(&effects);
    assert_eq!(ids(&sent[0]).0, ["50", "49"], "{sent:?}");
    // Ada joins project 2: the todos set is read again, then the comments moved in.
    let effects = commit(&mut server, vec![member(13, 101, "ada", 2)]);
    let reads = set_reads(&effects);
    assert_eq!(
        reads,
        vec![(todos_set, "todos".to_owned(), reads[0].2.clone())]
    );
    assert!(move_reads(&effects).is_empty(), "moves wait for the set");
    let effects = server.handle(
        ServerInput::SetRead {
            set: todos_set,
            result: rows(13, vec![todo(7, 1, 1), todo(11, 2, 1), todo(9, 3, 2)]),
        },
        0,
    );
    let reads = move_reads(&effects);
    assert_eq!(reads.len(), 1);
    assert!(
        reads[0].1.contains("\"todo_id\" In([Number(3)])"),
        "{}",
        reads[0].1
    );
    let effects = server.handle(
        ServerInput::MovesRead {
            read: reads[0].0,
            result: rows(13, vec![comment(4, 60, 3)]),
        },
        0,
    );
    assert_eq!(ids(&bodies(&effects)[0]).0, ["60"]);
    // A todo moved from project 1 to project 3 takes its comments out.
    let effects = commit(&mut server, vec![todo(14, 2, 3)]);
    let sent = bodies(&effects);
    assert_eq!(
        sent[0]["moves"]["out"],
        json!([{"column": "todo_id", "values": [2]}])
    );
}

#[test]
fn a_replay_page_is_judged_by_the_read_not_by_sets_that_trail_it() {
    const PAGE: i64 = crate::scope_sync::DEFAULT_PAGE_LIMIT as i64;
    let (mut server, ticket, pass) = replaying_ada();
    // The page was read after ada joined project 2 (seq 10), which the server has not routed
    // yet: its rows are in, and the page, full, is not taken for the last one.
    let page: Vec<FeedEntry> = (0..PAGE)
        .map(|i| todo(10 + i, 100 + i, 1 + i % 2))
        .collect();
    let effects = server.handle(
        ServerInput::PageFetched {
            conn: C,
            ticket,
            pass,
            result: rows(10 + PAGE, page),
        },
        0,
    );
    let sent = bodies(&effects);
    assert_eq!(ids(&sent[0]).0.len(), PAGE as usize, "{effects:?}");
    assert!(
        page_request(&effects).is_some(),
        "a full page asks for the next one"
    );
}
