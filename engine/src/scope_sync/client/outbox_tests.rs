//! Transcripts of the outbox: mutations queued, sent, echoed, answered, and the rows shown.

use super::*;
use crate::scope_sync::js_string_form;
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};

fn todo(id: &str, title: &str) -> Map<String, Value> {
    match json!({"id": id, "owner": "ada", "title": title}) {
        Value::Object(map) => map,
        _ => unreachable!(),
    }
}

/// A connected client with its outbox restored (client `c1`).
fn writer() -> (SyncClient, String) {
    let (mut client, sub) = connected(None);
    client.handle(
        0,
        ClientInput::RestoreOutbox {
            client_id: "c1".into(),
            last_id: 0,
            pending: vec![],
        },
    );
    // The scope is live with one row.
    frame(
        &mut client,
        0,
        message(
            &sub,
            vec![entry(
                1,
                1,
                "a",
                Some(json!({"id": "a", "owner": "ada", "title": "old"})),
            )],
        ),
    );
    frame(&mut client, 0, subscribed(&sub));
    (client, sub)
}

fn sent_frames(effects: &[ClientEffect]) -> Vec<Value> {
    effects
        .iter()
        .filter_map(|e| match e {
            ClientEffect::Send { text, .. } => serde_json::from_str(text).ok(),
            _ => None,
        })
        .collect()
}

fn changes(effects: &[ClientEffect]) -> Vec<RowChange> {
    effects
        .iter()
        .filter_map(|e| match e {
            ClientEffect::Changed { change, .. } => Some(change.clone()),
            _ => None,
        })
        .collect()
}

fn settled(effects: &[ClientEffect]) -> Vec<MutationResult> {
    effects
        .iter()
        .filter_map(|e| match e {
            ClientEffect::Settled { result } => Some(result.clone()),
            _ => None,
        })
        .collect()
}

fn titles(client: &SyncClient) -> Vec<String> {
    client
        .rows(1)
        .iter()
        .map(|row| {
            format!(
                "{}={}",
                row["id"].as_str().unwrap(),
                row["title"].as_str().unwrap_or("-")
            )
        })
        .collect()
}

fn echo_message(sub: &str, syncs: Vec<Value>, ids: &[u64]) -> String {
    json!({"type": "channel-message", "subscriptionId": sub,
           "body": {"echoOrigin": {"clientId": "c1", "mutationIds": ids}, "syncs": syncs}})
    .to_string()
}

fn result(ids: &[(u64, &str)]) -> String {
    let results: Vec<Value> = ids
        .iter()
        .map(|(id, status)| match *status {
            "confirmed" => json!({"id": id, "status": "confirmed"}),
            "retry" => {
                json!({"id": id, "status": "retry", "code": "unavailable", "message": "later"})
            }
            code => json!({"id": id, "status": "rejected", "code": code, "message": "no"}),
        })
        .collect();
    json!({"type": "mutation-result", "clientId": "c1", "results": results}).to_string()
}

#[test]
fn a_mutation_shows_at_once_is_persisted_and_sent_and_its_echo_replaces_it_without_a_gap() {
    let (mut client, sub) = writer();
    let (id, effects) = client.mutate(
        0,
        "todos".into(),
        MutationOp::Insert,
        todo("b", "new"),
        None,
    );
    assert_eq!(id, Ok(1));
    assert!(effects.iter().any(|e| matches!(e, ClientEffect::PersistOutbox { write } if write.put.len() == 1 && write.last_id == 1)));
    let frames = sent_frames(&effects);
    assert_eq!(frames[0]["type"], "mutate");
    assert_eq!(frames[0]["mutations"][0]["id"], 1);
    let shown = changes(&effects);
    assert_eq!(shown.len(), 1);
    assert_eq!(shown[0].inserted[0].id, "b");
    assert_eq!(titles(&client), ["a=old", "b=new"]);
    // The echo brings the server's row: one update, the row never leaves.
    let server_row = json!({"id": "b", "owner": "ada", "title": "new", "done": false});
    let effects = frame(
        &mut client,
        1,
        echo_message(&sub, vec![entry(1, 2, "b", Some(server_row))], &[1]),
    );
    let shown = changes(&effects);
    assert_eq!(shown.len(), 1);
    assert!(shown[0].removed.is_empty() && shown[0].inserted.is_empty());
    assert_eq!(shown[0].updated[0].id, "b");
    assert_eq!(client.rows(1)[1]["done"], json!(false));
    // The store is given the server's row, not an overlay.
    let stored = persists(&effects);
    assert!(stored.iter().all(|w| w.shadowed.is_empty()));
    // The answer settles it: nothing more changes.
    let effects = frame(&mut client, 2, result(&[(1, "confirmed")]));
    assert_eq!(settled(&effects)[0].id, 1);
    assert!(changes(&effects).is_empty());
    assert!(client.pending_mutations().is_empty());
}

#[test]
fn updates_and_deletes_lay_over_the_row_and_a_rejection_takes_them_back() {
    let (mut client, _) = writer();
    let mut update = Map::new();
    update.insert("id".into(), json!("a"));
    update.insert("title".into(), json!("edited"));
    let (_, effects) = client.mutate(0, "todos".into(), MutationOp::Update, update, Some(1));
    assert_eq!(titles(&client), ["a=edited"]);
    assert_eq!(changes(&effects)[0].updated.len(), 1);
    let mut delete = Map::new();
    delete.insert("id".into(), json!("a"));
    // One batch is out: the delete waits for its answer.
    let (_, effects) = client.mutate(0, "todos".into(), MutationOp::Delete, delete, None);
    assert!(sent_frames(&effects).is_empty());
    assert_eq!(titles(&client), Vec::<String>::new());
    // The update is rejected: the row comes back as the server has it, the delete goes out.
    let effects = frame(&mut client, 1, result(&[(1, "conflict")]));
    assert_eq!(settled(&effects)[0].code.as_deref(), Some("conflict"));
    assert_eq!(
        titles(&client),
        Vec::<String>::new(),
        "still deleted by mutation 2"
    );
    assert_eq!(sent_frames(&effects)[0]["mutations"][0]["id"], 2);
    let effects = frame(&mut client, 2, result(&[(2, "forbidden")]));
    assert_eq!(titles(&client), ["a=old"]);
    assert_eq!(changes(&effects)[0].inserted[0].id, "a");
}

#[test]
fn a_mutation_moved_out_of_the_scope_hides_the_row_and_keys_must_be_named() {
    let (mut client, _) = writer();
    let mut moved = todo("a", "old");
    moved.insert("owner".into(), json!("grace"));
    let _ = client.mutate(0, "todos".into(), MutationOp::Update, moved, None);
    assert!(client.rows(1).is_empty());
    let (refused, effects) = client.mutate(0, "todos".into(), MutationOp::Delete, Map::new(), None);
    assert!(
        matches!(refused, Err(MutateError::Invalid(_))),
        "{refused:?}"
    );
    assert!(effects.is_empty());
}

#[test]
fn unanswered_mutations_go_again_on_a_new_socket_and_retry_waits() {
    let (mut client, _) = writer();
    let _ = client.mutate(0, "todos".into(), MutationOp::Insert, todo("b", "x"), None);
    let socket = match client.link {
        Link::Open { socket, .. } => socket,
        _ => unreachable!(),
    };
    client.handle(
        1,
        ClientInput::SocketClosed {
            socket,
            reason: "gone".into(),
        },
    );
    // Reconnect.
    let mut effects = client.handle(60_000, ClientInput::Tick);
    if let Some(request) = token_request(&effects) {
        effects = client.handle(
            60_000,
            ClientInput::Token {
                request,
                result: Ok(None),
            },
        );
    }
    let socket = opened_socket(&effects).unwrap();
    let effects = client.handle(60_000, ClientInput::SocketOpened { socket });
    let mutate = sent_frames(&effects)
        .into_iter()
        .find(|f| f["type"] == "mutate")
        .unwrap();
    assert_eq!(mutate["mutations"][0]["id"], 1);
    // `retry`: kept, sent again after a delay, not before.
    let effects = frame(&mut client, 60_001, result(&[(1, "retry")]));
    assert!(settled(&effects).is_empty());
    assert!(sent_frames(&frame(
        &mut client,
        60_500,
        json!({"type": "pong"}).to_string()
    ))
    .iter()
    .all(|f| f["type"] != "mutate"));
    let effects = client.handle(61_100, ClientInput::Tick);
    assert!(sent_frames(&effects).iter().any(|f| f["type"] == "mutate"));
}

#[test]
fn a_restored_outbox_shows_its_mutations_and_keeps_counting() {
    let mut client = SyncClient::new(ClientConfig::default(), 1);
    client.handle(
        0,
        ClientInput::Subscribe {
            scope: 1,
            params: Box::new(params("ada")),
            stored: StoredScope::default(),
        },
    );
    let pending = vec![Mutation {
        id: 7,
        table: "todos".into(),
        op: MutationOp::Insert,
        row: todo("z", "offline"),
        if_version: None,
    }];
    let effects = client.handle(
        0,
        ClientInput::RestoreOutbox {
            client_id: "c1".into(),
            last_id: 9,
            pending,
        },
    );
    assert_eq!(changes(&effects)[0].inserted[0].id, "z");
    let (id, _) = client.mutate(
        0,
        "todos".into(),
        MutationOp::Insert,
        todo("y", "more"),
        None,
    );
    assert_eq!(id, Ok(10));
    assert_eq!(client.pending_mutations().len(), 2);
}

#[test]
fn uploads_go_to_the_app_and_are_awaited_on_the_socket() {
    let config = ClientConfig {
        upload: true,
        ..ClientConfig::default()
    };
    let mut client = SyncClient::new(config, 3);
    client.handle(
        0,
        ClientInput::RestoreOutbox {
            client_id: "c1".into(),
            last_id: 0,
            pending: vec![],
        },
    );
    let effects = client.handle(0, ClientInput::Start);
    let socket = opened_socket(&client.handle(
        0,
        ClientInput::Token {
            request: token_request(&effects).unwrap(),
            result: Ok(None),
        },
    ))
    .unwrap();
    client.handle(0, ClientInput::SocketOpened { socket });
    let (_, effects) = client.mutate(0, "todos".into(), MutationOp::Insert, todo("b", "x"), None);
    let upload = effects.iter().find_map(|e| match e {
        ClientEffect::Upload { mutations } => Some(mutations.clone()),
        _ => None,
    });
    assert_eq!(upload.unwrap()[0].id, 1);
    let effects = client.handle(
        0,
        ClientInput::Uploaded {
            ids: vec![1],
            result: Ok(vec![]),
        },
    );
    assert_eq!(
        sent_frames(&effects),
        vec![json!({"type": "await-mutations", "clientId": "c1", "ids": [1]})]
    );
    let effects = frame(&mut client, 1, result(&[(1, "confirmed")]));
    assert_eq!(settled(&effects)[0].id, 1);
    // A failed upload is tried again later.
    let _ = client.mutate(0, "todos".into(), MutationOp::Insert, todo("c", "x"), None);
    let effects = client.handle(
        2,
        ClientInput::Uploaded {
            ids: vec![2],
            result: Err("offline".into()),
        },
    );
    assert!(effects
        .iter()
        .any(|e| matches!(e, ClientEffect::Error { code, .. } if code == "upload-failed")));
    let effects = client.handle(1_100, ClientInput::Tick);
    assert!(effects
        .iter()
        .any(|e| matches!(e, ClientEffect::Upload { .. })));
}

#[test]
fn a_batch_stays_out_until_each_of_its_mutations_is_answered() {
    let (mut client, _) = writer();
    let _ = client.mutate(0, "todos".into(), MutationOp::Insert, todo("b", "1"), None);
    let _ = client.mutate(0, "todos".into(), MutationOp::Insert, todo("c", "2"), None);
    let _ = client.mutate(0, "todos".into(), MutationOp::Insert, todo("d", "3"), None);
    // Mutation 1 went alone; 2 and 3 wait. Its answer sends them as one batch.
    let effects = frame(&mut client, 1, result(&[(1, "confirmed")]));
    let sent = sent_frames(&effects);
    assert_eq!(sent[0]["mutations"].as_array().unwrap().len(), 2);
    // Half of that batch answered: nothing more goes (nothing is left to send anyway, but a
    // mutation queued now waits for the rest of the batch).
    let (_, effects) = client.mutate(2, "todos".into(), MutationOp::Insert, todo("e", "4"), None);
    assert!(sent_frames(&effects).is_empty());
    let effects = frame(&mut client, 3, result(&[(2, "confirmed")]));
    assert!(sent_frames(&effects).is_empty(), "3 is still out");
    let effects = frame(&mut client, 4, result(&[(3, "confirmed")]));
    assert_eq!(sent_frames(&effects)[0]["mutations"][0]["id"], 4);
}

/// A small deterministic random source for the randomized runs below.
struct Dice(u64);

impl Dice {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// The rows a scope shows, by the rule: the server's rows of the scope, with every pending
/// mutation not echoed in it laid over them in id order.
fn expected_rows(
    server: &BTreeMap<String, Map<String, Value>>,
    pending: &[Mutation],
    echoed: &BTreeSet<u64>,
) -> BTreeMap<String, Map<String, Value>> {
    let mut shown: BTreeMap<String, Option<Map<String, Value>>> = server
        .iter()
        .map(|(id, row)| (id.clone(), Some(row.clone())))
        .collect();
    for mutation in pending.iter().filter(|m| !echoed.contains(&m.id)) {
        let id = js_string_form(&mutation.row["id"]);
        let base = shown.get(&id).cloned().flatten();
        let next = match (mutation.op, base) {
            (MutationOp::Insert, base) => {
                let mut row = base.unwrap_or_default();
                row.extend(mutation.row.clone());
                Some(row)
            }
            (MutationOp::Update, Some(mut row)) => {
                row.extend(mutation.row.clone());
                Some(row)
            }
            (MutationOp::Update, None) => continue,
            (MutationOp::Delete, _) => None,
        };
        shown.insert(id, next.filter(|row| row["owner"] == json!("ada")));
    }
    shown
        .into_iter()
        .filter_map(|(id, row)| row.map(|row| (id, row)))
        .collect()
}

#[test]
fn the_rows_shown_and_the_change_events_follow_the_overlay_rule_under_random_writes() {
    for seed in 1..=40u64 {
        let mut dice = Dice(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (mut client, sub) = writer();
        // The server's rows of ada's scope, and the view built from change events alone.
        let mut server: BTreeMap<String, Map<String, Value>> = BTreeMap::new();
        server.insert("a".into(), todo("a", "old"));
        let mut view: BTreeMap<String, Value> = client
            .rows(1)
            .into_iter()
            .map(|row| (row["id"].as_str().unwrap().to_owned(), Value::Object(row)))
            .collect();
        let mut echoed = BTreeSet::new();
        let mut seq = 10;
        for step in 0..120 {
            let id = ["a", "b", "c", "d"][dice.below(4) as usize];
            let owner = if dice.below(5) == 0 { "grace" } else { "ada" };
            let effects = match dice.below(6) {
                // A write of this client.
                0 | 1 => {
                    let (op, row) = match dice.below(3) {
                        0 => (
                            MutationOp::Insert,
                            json!({"id": id, "owner": owner, "title": format!("i{step}")}),
                        ),
                        1 => (
                            MutationOp::Update,
                            json!({"id": id, "title": format!("u{step}")}),
                        ),
                        _ => (MutationOp::Delete, json!({"id": id})),
                    };
                    let Value::Object(row) = row else {
                        unreachable!()
                    };
                    client.mutate(step, "todos".into(), op, row, None).1
                }
                // Someone else's change of the row (or a row leaving ada's scope).
                2 | 3 => {
                    seq += 1;
                    let data = (owner == "ada")
                        .then(|| json!({"id": id, "owner": "ada", "title": format!("s{step}")}));
                    match &data {
                        Some(Value::Object(row)) => server.insert(id.to_owned(), row.clone()),
                        _ => server.remove(id),
                    };
                    frame(
                        &mut client,
                        step,
                        message(&sub, vec![entry(1, seq, id, data)]),
                    )
                }
                // The server's row for the oldest pending mutation, echoed.
                4 => {
                    let Some(oldest) = client.pending_mutations().into_iter().next() else {
                        continue;
                    };
                    seq += 1;
                    let row_id = js_string_form(&oldest.row["id"]);
                    let data = match oldest.op {
                        MutationOp::Delete => None,
                        _ => {
                            let mut row = server.get(&row_id).cloned().unwrap_or_default();
                            row.extend(oldest.row.clone());
                            row.entry("owner").or_insert(json!("ada"));
                            (row["owner"] == json!("ada")).then_some(Value::Object(row))
                        }
                    };
                    match &data {
                        Some(Value::Object(row)) => server.insert(row_id.clone(), row.clone()),
                        _ => server.remove(&row_id),
                    };
                    echoed.insert(oldest.id);
                    frame(
                        &mut client,
                        step,
                        echo_message(&sub, vec![entry(1, seq, &row_id, data)], &[oldest.id]),
                    )
                }
                // The answer for the oldest pending mutation.
                _ => {
                    let Some(oldest) = client.pending_mutations().into_iter().next() else {
                        continue;
                    };
                    let status = if echoed.contains(&oldest.id) || dice.below(2) == 0 {
                        "confirmed"
                    } else {
                        "conflict"
                    };
                    frame(&mut client, step, result(&[(oldest.id, status)]))
                }
            };
            for change in changes(&effects) {
                for row in &change.removed {
                    view.remove(&row.id);
                }
                for row in change.inserted.iter().chain(&change.updated) {
                    view.insert(
                        row.id.clone(),
                        serde_json::from_str(row.data.as_str()).unwrap(),
                    );
                }
            }
            let shown: BTreeMap<String, Value> = client
                .rows(1)
                .into_iter()
                .map(|row| (js_string_form(&row["id"]), Value::Object(row)))
                .collect();
            assert_eq!(
                view, shown,
                "seed {seed} step {step}: the change events disagree with rows()"
            );
            let pending = client.pending_mutations();
            let expected: BTreeMap<String, Value> = expected_rows(&server, &pending, &echoed)
                .into_iter()
                .map(|(id, row)| (id, Value::Object(row)))
                .collect();
            assert_eq!(
                shown, expected,
                "seed {seed} step {step}: rows() break the overlay rule"
            );
        }
    }
}

#[test]
fn a_write_confirmed_while_a_scope_subscribes_again_stays_shown_there_until_its_catch_up() {
    let (mut client, sub) = writer();
    let (id, _) = client.mutate(
        0,
        "todos".into(),
        MutationOp::Insert,
        todo("b", "mine"),
        None,
    );
    let id = id.unwrap();
    // The scope's token expired: it subscribes again, with a fresh id, and is not live.
    let effects = frame(&mut client, 1, channel_error(&sub, "auth-expired"));
    let request = token_request(&effects).expect("a fresh token is asked for");
    let effects = client.handle(
        2,
        ClientInput::Token {
            request,
            result: Ok(None),
        },
    );
    let again = subscribes(&effects)[0].0.clone();
    // Confirmed meanwhile: settled, but still shown over the scope that has not caught up.
    let effects = frame(&mut client, 3, result(&[(id, "confirmed")]));
    assert_eq!(settled(&effects)[0].id, id);
    assert!(client.pending_mutations().is_empty());
    assert!(
        changes(&effects).iter().all(|c| c.removed.is_empty()),
        "the row never leaves"
    );
    assert_eq!(titles(&client), ["a=old", "b=mine"]);
    // The catch-up brings the server's row; once the scope is live the overlay gives way.
    let server_row = json!({"id": "b", "owner": "ada", "title": "mine", "done": false});
    frame(
        &mut client,
        4,
        message(&again, vec![entry(1, 2, "b", Some(server_row))]),
    );
    let effects = frame(&mut client, 5, subscribed(&again));
    assert!(changes(&effects).iter().all(|c| c.removed.is_empty()));
    assert_eq!(client.rows(1)[1]["done"], json!(false), "the server's row");
    assert!(client.outbox.pending.is_empty(), "nothing lingers");
}
