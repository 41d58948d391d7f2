use super::*;
use crate::scope_sync::scope::{ChangesScope, Scope};
use proptest::prelude::*;
use serde_json::json;

const LOCAL_ORIGIN: &str = "device-1";

fn config() -> BridgeConfig {
    BridgeConfig {
        local_origin: Some(LOCAL_ORIGIN.to_owned()),
        resource_types: ["Task", "Project"].iter().map(|t| t.to_string()).collect(),
        ..BridgeConfig::default()
    }
}

fn updated_at(sequence: i64) -> String {
    format!(
        "2026-07-01T10:{:02}:{:02}.000Z",
        sequence / 60,
        sequence % 60
    )
}

fn cursor(sequence: i64) -> SyncCursor {
    SyncCursor::new(
        Some(sequence.to_string()),
        Some(sequence),
        updated_at(sequence),
    )
}

fn digest(project: &str) -> ScopeDigest {
    let mut conditions = Map::new();
    conditions.insert("project_id".to_owned(), json!(project));
    Scope::of_type("Task", conditions).digest()
}

/// A Task scope on one project, with its persisted cursor.
fn channel(project: &str, after: Option<i64>) -> ScopeChannel {
    let mut conditions = Map::new();
    conditions.insert("projectId".to_owned(), json!(project));
    ScopeChannel {
        scope: digest(project),
        params: SubscribeParams {
            scope: ChangesScope {
                resource_type: Some("Task".to_owned()),
                conditions,
                resource_types: None,
            },
            after: after.map(cursor),
            limit: None,
            authentication_token: Some("token".to_owned()),
            extra: Map::new(),
        },
    }
}

fn entry(sequence: i64) -> Value {
    json!({
        "data": {"id": format!("t{sequence}")},
        "id": sequence.to_string(),
        "resourceId": format!("t{sequence}"),
        "resourceType": "Task",
        "serverSequence": sequence,
        "syncType": "update",
        "updatedAt": updated_at(sequence),
    })
}

fn body(sequences: &[i64]) -> Value {
    json!({"echoOrigin": null, "syncs": sequences.iter().map(|&s| entry(s)).collect::<Vec<_>>()})
}

/// A message as the client takes it off the socket: its body as text.
fn message(subscription_id: &str, body: Value) -> BridgeInput {
    BridgeInput::ChannelMessage {
        subscription_id: subscription_id.to_owned(),
        body: MessageBody::Text(serde_json::value::to_raw_value(&body).expect("text")),
    }
}

/// A message whose body was decoded already (the JS bridge's host hands those).
fn decoded_message(subscription_id: &str, body: Value) -> BridgeInput {
    BridgeInput::ChannelMessage {
        subscription_id: subscription_id.to_owned(),
        body: MessageBody::Value(body),
    }
}

fn confirmed(subscription_id: &str) -> BridgeInput {
    BridgeInput::ChannelSubscribed {
        subscription_id: subscription_id.to_owned(),
    }
}

fn ok(ticket: u64) -> BridgeInput {
    BridgeInput::Applied {
        ticket,
        result: Ok(()),
    }
}

fn feed(bridge: &mut ScopeBridge, input: BridgeInput) -> Vec<BridgeEffect> {
    bridge.handle(input).expect("a valid input")
}

/// Feeds an input, then acknowledges every batch handed out, as a fast host would.
fn feed_applying(bridge: &mut ScopeBridge, input: BridgeInput) -> Vec<BridgeEffect> {
    let mut effects = feed(bridge, input);
    let mut index = 0;
    while index < effects.len() {
        if let BridgeEffect::ApplyBatch { ticket, .. } = effects[index] {
            let more = feed(bridge, ok(ticket));
            effects.extend(more);
        }
        index += 1;
    }
    effects
}

fn saves(effects: &[BridgeEffect]) -> Vec<i64> {
    effects
        .iter()
        .filter_map(|effect| match effect {
            BridgeEffect::SaveCursor { cursor, .. } => cursor.server_sequence,
            _ => None,
        })
        .collect()
}

fn batches(effects: &[BridgeEffect]) -> Vec<Vec<i64>> {
    effects
        .iter()
        .filter_map(|effect| match effect {
            BridgeEffect::ApplyBatch { changes, .. } => Some(
                changes
                    .iter()
                    .filter_map(|change| change.cursor()?.server_sequence)
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

/// A bridge subscribed to one project scope, confirmed and caught up.
fn subscribed(after: Option<i64>) -> ScopeBridge {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", after)],
        },
    );
    let effects = feed(&mut bridge, confirmed("sync-1"));
    assert!(effects.contains(&BridgeEffect::Ready { generation: 0 }));
    bridge
}

#[test]
fn subscribe_params_carry_the_persisted_cursor_in_client_form() {
    for (after, expected) in [
        (None, json!({})),
        (
            Some(0),
            json!({"afterId": "0", "afterUpdatedAt": updated_at(0)}),
        ),
        (
            Some(12),
            json!({"afterId": "12", "afterServerSequence": 12, "afterUpdatedAt": updated_at(12)}),
        ),
    ] {
        let mut bridge = ScopeBridge::new(config());
        let effects = feed(
            &mut bridge,
            BridgeInput::Subscribe {
                channels: vec![channel("p1", after)],
            },
        );
        let [BridgeEffect::SendSubscribe {
            subscription_id,
            scope,
            params,
        }] = effects.as_slice()
        else {
            panic!("expected one subscribe, got {effects:?}");
        };
        assert_eq!((subscription_id.as_str(), *scope), ("sync-1", digest("p1")));
        let after_keys: Map<String, Value> = params
            .iter()
            .filter(|(key, _)| key.starts_with("after"))
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        assert_eq!(Value::Object(after_keys), expected, "after {after:?}");
        assert_eq!(params["conditions"], json!({"projectId": "p1"}));
        assert_eq!(params["resourceType"], json!("Task"));
        assert_eq!(params["authenticationToken"], json!("token"));
    }
}

#[test]
fn scenario_09_fresh_subscription_applies_the_replay_and_is_ready_after_confirmation() {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None)],
        },
    );
    assert_eq!(bridge.state(), BridgeState::Subscribing);
    let mut effects = feed_applying(&mut bridge, message("sync-1", body(&[1, 2])));
    effects.extend(feed_applying(&mut bridge, message("sync-1", body(&[3]))));
    assert_eq!(batches(&effects), vec![vec![1, 2], vec![3]]);
    assert!(
        saves(&effects).is_empty(),
        "nothing persisted before confirmation"
    );
    let effects = feed(&mut bridge, confirmed("sync-1"));
    assert_eq!(
        effects,
        vec![
            BridgeEffect::SaveCursor {
                scope: digest("p1"),
                cursor: cursor(3)
            },
            BridgeEffect::Ready { generation: 0 },
        ]
    );
    assert_eq!(bridge.state(), BridgeState::Subscribed);
}

#[test]
fn scenario_09_ready_waits_for_every_scope() {
    let mut bridge = ScopeBridge::new(config());
    let effects = feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None), channel("p2", Some(4))],
        },
    );
    assert_eq!(effects.len(), 2);
    assert!(feed(&mut bridge, confirmed("sync-1")).is_empty());
    assert_eq!(
        feed(&mut bridge, confirmed("sync-2")),
        vec![BridgeEffect::Ready { generation: 0 }]
    );
}

#[test]
fn p3_live_rows_interleaved_with_replay_are_persisted_only_once_the_replay_is_applied() {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", Some(2))],
        },
    );
    // A live row above the pinned high-water lands before the replay pages.
    let mut effects = feed_applying(&mut bridge, message("sync-1", body(&[10])));
    let replay = feed(&mut bridge, message("sync-1", body(&[3, 4])));
    // The confirmation arrives while the last replay page is still being applied.
    let confirmation = feed(&mut bridge, confirmed("sync-1"));
    assert!(saves(&effects).is_empty() && confirmation.is_empty());
    assert_eq!(bridge.persisted_cursor(&digest("p1")), Some(&cursor(2)));
    let [BridgeEffect::ApplyBatch { ticket, .. }] = replay.as_slice() else {
        panic!("expected the replay batch, got {replay:?}");
    };
    effects = feed(&mut bridge, ok(*ticket));
    assert_eq!(saves(&effects), vec![10]);
    assert!(effects.contains(&BridgeEffect::Ready { generation: 0 }));
}

#[test]
fn p3_an_interrupted_replay_leaves_the_stored_cursor_where_it_was() {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", Some(2))],
        },
    );
    feed_applying(&mut bridge, message("sync-1", body(&[10])));
    // The socket dies before the replay finished; the server forgot the session.
    let effects = feed(&mut bridge, BridgeInput::SessionGone);
    let [BridgeEffect::SendSubscribe {
        subscription_id,
        params,
        ..
    }] = effects.as_slice()
    else {
        panic!("expected a re-subscribe, got {effects:?}");
    };
    assert_eq!(subscription_id, "sync-2");
    assert_eq!(
        params["afterServerSequence"],
        json!(2),
        "from the stored cursor, not 10"
    );
}

#[test]
fn scenario_15_session_gone_resubscribes_and_duplicates_never_regress_the_cursor() {
    let mut bridge = subscribed(Some(2));
    let effects = feed_applying(&mut bridge, message("sync-1", body(&[3, 4, 5])));
    assert_eq!(saves(&effects), vec![5]);
    let effects = feed(&mut bridge, BridgeInput::SessionGone);
    assert!(matches!(
        effects.as_slice(),
        [BridgeEffect::SendSubscribe { subscription_id, params, .. }]
            if subscription_id == "sync-2" && params["afterServerSequence"] == json!(5)
    ));
    assert_eq!(bridge.state(), BridgeState::Subscribing);
    // A server replaying from an older cursor sends duplicates; the old id is retired.
    let mut effects = feed_applying(&mut bridge, message("sync-2", body(&[3, 4, 5, 6])));
    effects.extend(feed(&mut bridge, message("sync-1", body(&[7]))));
    effects.extend(feed(&mut bridge, confirmed("sync-2")));
    effects.extend(feed_applying(&mut bridge, message("sync-2", body(&[4]))));
    assert_eq!(saves(&effects), vec![6]);
    assert!(effects.contains(&BridgeEffect::Dropped {
        subscription_id: "sync-1".to_owned(),
        reason: DropReason::UnknownSubscription
    }));
    assert_eq!(bridge.persisted_cursor(&digest("p1")), Some(&cursor(6)));
    assert_eq!(bridge.state(), BridgeState::Subscribed);
}

#[test]
fn scenario_14_session_resumed_reopens_each_scope_from_its_stored_cursor() {
    let mut bridge = subscribed(None);
    feed_applying(&mut bridge, message("sync-1", body(&[1, 2])));
    // Queued before the resume; its subscription is retired before it is applied.
    let effects = feed(&mut bridge, BridgeInput::SessionResumed);
    assert_eq!(
        effects[0],
        BridgeEffect::SendUnsubscribe {
            subscription_id: "sync-1".to_owned()
        }
    );
    assert!(matches!(
        &effects[1],
        BridgeEffect::SendSubscribe { subscription_id, params, .. }
            if subscription_id == "sync-2" && params["afterServerSequence"] == json!(2)
    ));
    let mut without_reopen = ScopeBridge::new(BridgeConfig {
        reopen_on_resume: false,
        ..config()
    });
    feed(
        &mut without_reopen,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None)],
        },
    );
    assert!(feed(&mut without_reopen, BridgeInput::SessionResumed).is_empty());
}

#[test]
fn scenario_16_monotonic_client_cursor_saves_only_on_change() {
    let mut bridge = subscribed(None);
    let mut effects = Vec::new();
    for sequence in [5, 3, 5, 7] {
        effects.extend(feed_applying(
            &mut bridge,
            message("sync-1", body(&[sequence])),
        ));
    }
    assert_eq!(batches(&effects).len(), 4, "every push is applied");
    assert_eq!(saves(&effects), vec![5, 7]);
    assert_eq!(bridge.persisted_cursor(&digest("p1")), Some(&cursor(7)));
}

#[test]
fn scenario_16_a_message_saves_its_highest_entry_once() {
    let mut bridge = subscribed(Some(4));
    let effects = feed_applying(&mut bridge, message("sync-1", body(&[9, 6, 8, 3])));
    assert_eq!(saves(&effects), vec![9]);
}

#[test]
fn scenario_17_echoes_are_dropped_without_moving_the_cursor_and_null_origins_apply() {
    let mut bridge = subscribed(Some(1));
    let mut echo = body(&[5]);
    echo["echoOrigin"] = json!(LOCAL_ORIGIN);
    let effects = feed_applying(&mut bridge, message("sync-1", echo));
    assert_eq!(
        effects,
        vec![BridgeEffect::Dropped {
            subscription_id: "sync-1".to_owned(),
            reason: DropReason::Echo
        }]
    );
    assert_eq!(bridge.persisted_cursor(&digest("p1")), Some(&cursor(1)));
    let mut other = body(&[3]);
    other["echoOrigin"] = json!("device-2");
    let mut effects = feed_applying(&mut bridge, message("sync-1", other));
    effects.extend(feed_applying(&mut bridge, message("sync-1", body(&[4]))));
    assert_eq!(batches(&effects), vec![vec![3], vec![4]]);
    assert_eq!(saves(&effects), vec![3, 4]);
    // Origins compare by string form: a numeric echo origin matches its text.
    let mut numeric = ScopeBridge::new(BridgeConfig {
        local_origin: Some("42".to_owned()),
        ..config()
    });
    feed(
        &mut numeric,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None)],
        },
    );
    let mut echo = body(&[1]);
    echo["echoOrigin"] = json!(42);
    assert!(matches!(
        feed(&mut numeric, message("sync-1", echo)).as_slice(),
        [BridgeEffect::Dropped {
            reason: DropReason::Echo,
            ..
        }]
    ));
}

fn rejection(effects: &[BridgeEffect]) -> &MessageError {
    match effects {
        [BridgeEffect::MessageRejected { error, .. }] => error,
        other => panic!("expected one rejection, got {other:?}"),
    }
}

#[test]
fn scenario_18_envelope_validation() {
    let mut bridge = subscribed(Some(1));
    for bad in [json!([entry(2)]), Value::Null, json!(7), json!("text")] {
        let effects = feed(&mut bridge, message("sync-1", bad.clone()));
        assert!(
            matches!(
                rejection(&effects),
                MessageError::Envelope(EnvelopeError::NotObject { .. })
            ),
            "{bad} gave {effects:?}"
        );
    }
    // A bare entry is a one-entry message.
    let effects = feed_applying(&mut bridge, message("sync-1", entry(2)));
    assert_eq!(batches(&effects), vec![vec![2]]);
    // A missing resourceType takes the channel default.
    let mut untyped = entry(3);
    untyped
        .as_object_mut()
        .expect("object")
        .remove("resourceType");
    let effects = feed(&mut bridge, message("sync-1", json!({"syncs": [untyped]})));
    let [BridgeEffect::ApplyBatch {
        ticket, changes, ..
    }] = effects.as_slice()
    else {
        panic!("expected a batch, got {effects:?}");
    };
    assert_eq!(changes[0].resource_type, "Task");
    feed(&mut bridge, ok(*ticket));
    // An explicit null overrides the default and fails.
    let mut null_typed = entry(4);
    null_typed["resourceType"] = Value::Null;
    let effects = feed(
        &mut bridge,
        message("sync-1", json!({"syncs": [entry(5), null_typed]})),
    );
    assert_eq!(
        rejection(&effects).to_string(),
        "expected sync entry 1 to name its resourceType, got null"
    );
    // An unknown type fails loudly and does not advance the cursor.
    let mut ghost = entry(6);
    ghost["resourceType"] = json!("Ghost");
    let effects = feed(&mut bridge, message("sync-1", body_of(vec![ghost])));
    assert_eq!(
        rejection(&effects),
        &MessageError::UnknownResourceType {
            index: 0,
            resource_type: "Ghost".to_owned()
        }
    );
    assert_eq!(rejection(&effects).code(), "unknown-resource-type");
    assert_eq!(bridge.persisted_cursor(&digest("p1")), Some(&cursor(3)));
    // Data given as JSON text is parsed; text that is not an object fails.
    let mut textual = entry(7);
    textual["data"] = json!("{\"id\":\"t7\",\"title\":\"x\"}");
    let effects = feed(&mut bridge, message("sync-1", body_of(vec![textual])));
    let [BridgeEffect::ApplyBatch {
        ticket, changes, ..
    }] = effects.as_slice()
    else {
        panic!("expected a batch, got {effects:?}");
    };
    assert_eq!(
        changes[0].data.as_ref().and_then(|d| d.get("title")),
        Some(json!("x"))
    );
    feed(&mut bridge, ok(*ticket));
    let mut broken = entry(8);
    broken["data"] = json!("[1]");
    let effects = feed(&mut bridge, message("sync-1", body_of(vec![broken])));
    assert!(matches!(
        rejection(&effects),
        MessageError::BadData { index: 0, .. }
    ));
}

fn body_of(entries: Vec<Value>) -> Value {
    json!({"echoOrigin": null, "syncs": entries})
}

/// A change holds its row once (moved out of the entry), and still gives back and
/// serializes the entry exactly as received, whichever form `data` came in.
#[test]
fn a_change_holds_its_row_once_and_gives_the_entry_back_as_received() {
    let mut bridge = subscribed(Some(1));
    let mut textual = entry(3);
    textual["data"] = json!("{\"id\":\"t3\"}");
    let mut empty = entry(4);
    empty["data"] = Value::Null;
    empty["syncType"] = json!("delete");
    let mut absent = entry(5);
    absent.as_object_mut().expect("object").remove("data");
    absent["syncType"] = json!("delete");
    let sent = vec![entry(2), textual, empty, absent];
    // Both ways a body comes: as text (rows kept as text), and decoded.
    for input in [
        message("sync-1", body_of(sent.clone())),
        decoded_message("sync-1", body_of(sent.clone())),
    ] {
        let mut bridge = subscribed(Some(1));
        let effects = feed(&mut bridge, input);
        let [BridgeEffect::ApplyBatch { changes, .. }] = effects.as_slice() else {
            panic!("expected a batch, got {effects:?}");
        };
        assert_eq!(changes[0].entry.data, None, "the object moved to `data`");
        assert_eq!(
            changes[0].data.as_ref().map(RowText::to_map),
            sent[0]["data"].as_object().cloned()
        );
        assert_eq!(
            changes[1].data.as_ref().and_then(|d| d.get("id")),
            Some(json!("t3"))
        );
    }
    let effects = feed(&mut bridge, message("sync-1", body_of(sent.clone())));
    let [BridgeEffect::ApplyBatch { changes, .. }] = effects.as_slice() else {
        panic!("expected a batch, got {effects:?}");
    };
    for (change, sent) in changes.iter().zip(&sent) {
        let received = change.received();
        assert_eq!(
            received.to_value(),
            SyncEntry::try_from(sent.clone()).unwrap().to_value()
        );
        let json = serde_json::to_value(change).expect("serializes");
        assert_eq!(json["entry"], received.to_value());
        assert_eq!(json["data"], serde_json::to_value(&change.data).unwrap());
    }
}

#[test]
fn scenario_18_the_all_types_scope_has_no_default_type() {
    let mut bridge = ScopeBridge::new(config());
    let mut all_types = channel("p1", None);
    all_types.scope = Scope::user("token").digest();
    all_types.params.scope = ChangesScope {
        resource_type: None,
        conditions: Map::new(),
        resource_types: Some(vec!["Task".to_owned(), "Project".to_owned()]),
    };
    let effects = feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![all_types],
        },
    );
    assert!(matches!(
        effects.as_slice(),
        [BridgeEffect::SendSubscribe { params, .. }] if params["resourceTypes"] == json!(["Task", "Project"])
    ));
    let mut untyped = entry(1);
    untyped
        .as_object_mut()
        .expect("object")
        .remove("resourceType");
    let effects = feed(&mut bridge, message("sync-1", body_of(vec![untyped])));
    assert!(matches!(
        rejection(&effects),
        MessageError::MissingResourceType { index: 0, .. }
    ));
    let mut project = entry(2);
    project["resourceType"] = json!("Project");
    assert_eq!(
        batches(&feed(
            &mut bridge,
            message("sync-1", body_of(vec![project]))
        )),
        vec![vec![2]]
    );
}

#[test]
fn scenario_19_one_message_is_one_batch_and_a_slow_first_batch_holds_back_the_second() {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None), channel("p2", None)],
        },
    );
    let first = feed(&mut bridge, message("sync-1", body(&[1, 2, 3])));
    assert_eq!(batches(&first), vec![vec![1, 2, 3]]);
    // Another channel's message waits behind the unacknowledged batch.
    assert!(feed(&mut bridge, message("sync-2", body(&[9]))).is_empty());
    assert!(feed(&mut bridge, message("sync-1", body(&[4]))).is_empty());
    assert_eq!(bridge.status().queued, 2);
    let second = feed(&mut bridge, ok(1));
    assert!(matches!(
        second.as_slice(),
        [BridgeEffect::ApplyBatch { ticket: 2, scope, .. }] if *scope == digest("p2")
    ));
    assert_eq!(batches(&feed(&mut bridge, ok(2))), vec![vec![4]]);
}

#[test]
fn scenario_20_unsubscribe_drops_queued_messages_and_closes_its_subscriptions() {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None), channel("p2", None)],
        },
    );
    // Still connecting: sync-2 is unconfirmed. One batch is in flight, one is queued.
    feed(&mut bridge, confirmed("sync-1"));
    feed(&mut bridge, message("sync-1", body(&[1])));
    feed(&mut bridge, message("sync-2", body(&[2])));
    let effects = feed(&mut bridge, BridgeInput::Unsubscribe);
    assert_eq!(
        effects,
        vec![
            BridgeEffect::SendUnsubscribe {
                subscription_id: "sync-1".to_owned()
            },
            BridgeEffect::SendUnsubscribe {
                subscription_id: "sync-2".to_owned()
            },
        ]
    );
    assert_eq!(
        (bridge.state(), bridge.generation()),
        (BridgeState::Unsubscribed, 1)
    );
    // The batch in flight completes but saves nothing; the queued one is dropped.
    let effects = feed(&mut bridge, ok(1));
    assert_eq!(
        effects,
        vec![BridgeEffect::Dropped {
            subscription_id: "sync-2".to_owned(),
            reason: DropReason::StaleSubscription
        }]
    );
    // Frames for the old ids keep arriving and are ignored; a new subscribe starts afresh.
    assert!(matches!(
        feed(&mut bridge, message("sync-1", body(&[3]))).as_slice(),
        [BridgeEffect::Dropped {
            reason: DropReason::UnknownSubscription,
            ..
        }]
    ));
    assert!(feed(&mut bridge, confirmed("sync-1")).is_empty());
    let effects = feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None)],
        },
    );
    assert!(matches!(
        effects.as_slice(),
        [BridgeEffect::SendSubscribe { subscription_id, .. }] if subscription_id == "sync-3"
    ));
    assert_eq!(
        feed(&mut bridge, confirmed("sync-3")),
        vec![BridgeEffect::Ready { generation: 1 }]
    );
}

#[test]
fn scenario_20_a_batch_in_flight_across_unsubscribe_still_holds_the_queue() {
    let mut bridge = subscribed(None);
    feed(&mut bridge, message("sync-1", body(&[1])));
    feed(&mut bridge, BridgeInput::Unsubscribe);
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None)],
        },
    );
    assert!(feed(&mut bridge, message("sync-2", body(&[2]))).is_empty());
    assert_eq!(batches(&feed(&mut bridge, ok(1))), vec![vec![2]]);
}

#[test]
fn subscribe_is_single_flight_and_checks_its_channels() {
    let mut bridge = ScopeBridge::new(config());
    assert_eq!(
        bridge.handle(BridgeInput::Subscribe { channels: vec![] }),
        Err(BridgeError::NothingToSubscribe)
    );
    assert_eq!(
        bridge.handle(BridgeInput::Subscribe {
            channels: vec![channel("p1", None), channel("p1", Some(3))]
        }),
        Err(BridgeError::DuplicateScope {
            scope: digest("p1")
        })
    );
    let mut ghost = channel("p1", None);
    ghost.params.scope.resource_type = Some("Ghost".to_owned());
    let error = bridge
        .handle(BridgeInput::Subscribe {
            channels: vec![ghost],
        })
        .expect_err("an unknown type fails");
    assert_eq!(error.code(), "unknown-scope-type");
    assert_eq!(bridge.state(), BridgeState::Unsubscribed);
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None)],
        },
    );
    assert!(feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p2", None)]
        }
    )
    .is_empty());
}

#[test]
fn scenario_26_a_failed_message_is_reported_and_the_next_one_still_applies() {
    let mut bridge = subscribed(Some(1));
    feed(&mut bridge, message("sync-1", body(&[2])));
    feed(&mut bridge, message("sync-1", json!([])));
    feed(&mut bridge, message("sync-1", body(&[3])));
    let effects = feed(
        &mut bridge,
        BridgeInput::Applied {
            ticket: 1,
            result: Err("constraint violated".to_owned()),
        },
    );
    assert!(matches!(
        effects.as_slice(),
        [
            BridgeEffect::ApplyFailed { ticket: 1, message, .. },
            BridgeEffect::MessageRejected { .. },
            BridgeEffect::ApplyBatch { ticket: 2, .. },
        ] if message == "constraint violated"
    ));
    // The failed row is skipped (scope-sync.md, hazard P11): the next success moves the
    // cursor past it.
    assert_eq!(saves(&feed(&mut bridge, ok(2))), vec![3]);
    assert_eq!(bridge.status().queued, 0);
}

#[test]
fn an_apply_result_must_answer_the_batch_in_flight() {
    let mut bridge = subscribed(None);
    assert_eq!(
        bridge.handle(ok(1)),
        Err(BridgeError::UnexpectedTicket {
            expected: "none".to_owned(),
            got: 1
        })
    );
    feed(&mut bridge, message("sync-1", body(&[1])));
    assert!(bridge.handle(ok(5)).is_err());
    assert_eq!(
        bridge.status().applying,
        Some(1),
        "a wrong ticket leaves the batch in flight"
    );
    assert_eq!(saves(&feed(&mut bridge, ok(1))), vec![1]);
}

#[test]
fn a_reset_message_clears_the_scope_and_the_full_replay_is_persisted_at_confirmation() {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", Some(9))],
        },
    );
    let reset = crate::scope_sync::replay::reset_envelope(&cursor(20)).to_value();
    let effects = feed(&mut bridge, message("sync-1", reset));
    assert!(matches!(
        effects.as_slice(),
        [BridgeEffect::ApplyBatch { reset: true, changes, ticket: 1, .. }] if changes.is_empty()
    ));
    feed(&mut bridge, ok(1));
    assert_eq!(bridge.persisted_cursor(&digest("p1")), None);
    feed_applying(&mut bridge, message("sync-1", body(&[1, 2])));
    let effects = feed(&mut bridge, confirmed("sync-1"));
    assert_eq!(
        saves(&effects),
        vec![2],
        "below the old cursor 9, but after the reset"
    );
}

#[test]
fn a_reset_committing_after_a_resubscribe_reopens_that_subscription_from_the_whole_scope() {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", Some(9))],
        },
    );
    let reset = crate::scope_sync::replay::reset_envelope(&cursor(20)).to_value();
    feed(&mut bridge, message("sync-1", reset));
    // While the reset batch is being applied, the session is lost and sync-2 asks the
    // server to resume after 9, a cursor the reset is about to delete with its rows.
    let effects = feed(&mut bridge, BridgeInput::SessionGone);
    assert!(matches!(
        effects.as_slice(),
        [BridgeEffect::SendSubscribe { params, .. }] if params["afterServerSequence"] == json!(9)
    ));
    let effects = feed(&mut bridge, ok(1));
    assert_eq!(
        effects[0],
        BridgeEffect::SendUnsubscribe {
            subscription_id: "sync-2".to_owned()
        }
    );
    let BridgeEffect::SendSubscribe {
        subscription_id,
        params,
        ..
    } = &effects[1]
    else {
        panic!("expected a re-subscribe, got {effects:?}");
    };
    assert_eq!(subscription_id, "sync-3");
    assert!(
        !params.contains_key("afterUpdatedAt"),
        "the whole scope: {params:?}"
    );
}

#[test]
fn a_reset_on_a_caught_up_subscription_reopens_it_and_ends_with_channel_subscribed() {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", Some(9))],
        },
    );
    let effects = feed(&mut bridge, confirmed("sync-1"));
    assert!(effects
        .iter()
        .any(|e| matches!(e, BridgeEffect::Ready { .. })));
    let reset = crate::scope_sync::replay::reset_envelope(&cursor(20)).to_value();
    feed(&mut bridge, message("sync-1", reset));
    let effects = feed(&mut bridge, ok(1));
    assert_eq!(
        effects[0],
        BridgeEffect::SendUnsubscribe {
            subscription_id: "sync-1".to_owned()
        }
    );
    let BridgeEffect::SendSubscribe {
        subscription_id,
        params,
        ..
    } = &effects[1]
    else {
        panic!("expected a re-subscribe, got {effects:?}");
    };
    assert_eq!(subscription_id, "sync-2");
    assert!(!params.contains_key("afterServerSequence"), "{params:?}");
    assert_eq!(bridge.state(), BridgeState::Subscribing);
    let applied = feed_applying(&mut bridge, message("sync-2", body(&[1, 2])));
    assert!(
        saves(&applied).is_empty(),
        "nothing persisted before the confirmation"
    );
    let effects = feed(&mut bridge, confirmed("sync-2"));
    assert_eq!(saves(&effects), vec![2]);
    assert!(effects
        .iter()
        .any(|e| matches!(e, BridgeEffect::Ready { .. })));
}

#[test]
fn a_channel_error_before_ready_fails_the_attempt_and_after_ready_only_its_channel() {
    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None), channel("p2", None)],
        },
    );
    feed(&mut bridge, message("sync-1", body(&[1])));
    feed(&mut bridge, message("sync-1", body(&[2])));
    let effects = feed(
        &mut bridge,
        BridgeInput::ChannelError {
            subscription_id: "sync-2".to_owned(),
            message: "Subscription not authorized".to_owned(),
        },
    );
    assert_eq!(
        effects,
        vec![
            BridgeEffect::ChannelFailed {
                scope: digest("p2"),
                subscription_id: "sync-2".to_owned(),
                message: "Subscription not authorized".to_owned()
            },
            BridgeEffect::SendUnsubscribe {
                subscription_id: "sync-1".to_owned()
            },
            BridgeEffect::SubscribeFailed {
                generation: 0,
                message: "Subscription not authorized".to_owned()
            },
        ]
    );
    assert_eq!(
        (bridge.state(), bridge.generation()),
        (BridgeState::Unsubscribed, 1)
    );
    assert!(matches!(
        feed(&mut bridge, ok(1)).as_slice(),
        [BridgeEffect::Dropped {
            reason: DropReason::StaleSubscription,
            ..
        }]
    ));

    let mut bridge = ScopeBridge::new(config());
    feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", None), channel("p2", None)],
        },
    );
    feed(&mut bridge, confirmed("sync-1"));
    feed(&mut bridge, confirmed("sync-2"));
    let effects = feed(
        &mut bridge,
        BridgeInput::ChannelError {
            subscription_id: "sync-2".to_owned(),
            message: "gone".to_owned(),
        },
    );
    assert!(matches!(
        effects.as_slice(),
        [BridgeEffect::ChannelFailed { .. }]
    ));
    assert_eq!(bridge.state(), BridgeState::Subscribed);
    assert_eq!(
        bridge
            .status()
            .channels
            .iter()
            .map(|c| c.ready)
            .collect::<Vec<_>>(),
        vec![true, false]
    );
}

#[test]
fn server_frames_map_to_inputs() {
    let frame = ServerFrame::from_json(
        r#"{"type":"channel-message","subscriptionId":"sync-1","body":{"echoOrigin":null,"syncs":[]}}"#,
    )
    .expect("a frame");
    assert_eq!(
        BridgeInput::from_server_frame(frame),
        Some(decoded_message(
            "sync-1",
            json!({"echoOrigin": null, "syncs": []})
        ))
    );
    let gone = ServerFrame::from_json(r#"{"type":"session-gone"}"#).expect("a frame");
    assert_eq!(
        BridgeInput::from_server_frame(gone),
        Some(BridgeInput::SessionGone)
    );
    let established = ServerFrame::from_json(
        r#"{"type":"session-established","sessionId":"a","graceSeconds":300}"#,
    )
    .expect("a frame");
    assert_eq!(BridgeInput::from_server_frame(established), None);
}

#[test]
fn effects_serialize_for_bindings_and_frames() {
    let mut bridge = ScopeBridge::new(config());
    let effects = feed(
        &mut bridge,
        BridgeInput::Subscribe {
            channels: vec![channel("p1", Some(3))],
        },
    );
    let frame = effects[0].client_frame().expect("a frame");
    assert_eq!(
        serde_json::to_value(&frame).expect("json")["channelType"],
        json!("velocious-sync")
    );
    let value = serde_json::to_value(&effects[0]).expect("json");
    assert_eq!(value["type"], json!("sendSubscribe"));
    assert_eq!(value["subscriptionId"], json!("sync-1"));
    assert_eq!(value["scope"], json!(digest("p1").to_string()));
    let rejected = feed(&mut bridge, message("sync-1", json!(null)));
    let value = serde_json::to_value(&rejected[0]).expect("json");
    assert_eq!(value["type"], json!("messageRejected"));
    assert_eq!(value["error"]["code"], json!("invalid-envelope"));
    assert_eq!(
        value["error"]["message"],
        json!("expected a sync message to be an envelope object, got null")
    );
}

/// Renders inputs and effects one per line, for transcripts.
fn render_input(input: &BridgeInput) -> String {
    match input {
        BridgeInput::Subscribe { channels } => format!(
            "subscribe {}",
            channels
                .iter()
                .map(|c| format!(
                    "{} after {}",
                    project_of(&c.scope),
                    c.params
                        .after
                        .as_ref()
                        .and_then(|a| a.server_sequence)
                        .map_or("-".to_owned(), |s| s.to_string())
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        BridgeInput::ChannelSubscribed { subscription_id } => {
            format!("channel-subscribed {subscription_id}")
        }
        BridgeInput::ChannelMessage {
            subscription_id,
            body,
        } => {
            format!("channel-message {subscription_id} {body}")
        }
        BridgeInput::ChannelError {
            subscription_id,
            message,
        } => {
            format!("channel-error {subscription_id} {message:?}")
        }
        BridgeInput::Applied { ticket, result } => format!("applied #{ticket} {result:?}"),
        BridgeInput::Unsubscribe => "unsubscribe".to_owned(),
        BridgeInput::SessionResumed => "session-resumed".to_owned(),
        BridgeInput::SessionGone => "session-gone".to_owned(),
        BridgeInput::Renew { .. } => "renew".to_owned(),
    }
}

fn project_of(scope: &ScopeDigest) -> &'static str {
    ["p1", "p2"]
        .into_iter()
        .find(|p| digest(p) == *scope)
        .unwrap_or("?")
}

fn render_effect(effect: &BridgeEffect) -> String {
    let seq = |c: &Option<SyncCursor>| {
        c.as_ref()
            .and_then(|c| c.server_sequence)
            .map_or("-".to_owned(), |s| s.to_string())
    };
    match effect {
        BridgeEffect::SendSubscribe {
            subscription_id,
            scope,
            params,
        } => format!(
            "send channel-subscribe {subscription_id} {} afterServerSequence={}",
            project_of(scope),
            params
                .get("afterServerSequence")
                .map_or("-".to_owned(), Value::to_string)
        ),
        BridgeEffect::SendUnsubscribe { subscription_id } => {
            format!("send channel-unsubscribe {subscription_id}")
        }
        BridgeEffect::ApplyBatch {
            ticket,
            generation,
            scope,
            reset,
            changes,
            ..
        } => format!(
            "apply #{ticket} gen {generation} {}{} {:?}",
            project_of(scope),
            if *reset { " (reset)" } else { "" },
            changes.iter().map(|c| seq(&c.cursor())).collect::<Vec<_>>()
        ),
        BridgeEffect::SaveCursor { scope, cursor } => {
            format!(
                "save {} cursor {}",
                project_of(scope),
                seq(&Some(cursor.clone()))
            )
        }
        BridgeEffect::Ready { generation } => format!("ready gen {generation}"),
        BridgeEffect::MessageRejected {
            subscription_id,
            error,
            ..
        } => {
            format!("rejected {subscription_id}: {error}")
        }
        BridgeEffect::ApplyFailed {
            ticket, message, ..
        } => format!("apply #{ticket} failed: {message}"),
        BridgeEffect::Dropped {
            subscription_id,
            reason,
        } => format!("dropped {subscription_id} ({reason:?})"),
        BridgeEffect::ChannelFailed {
            subscription_id,
            message,
            ..
        } => {
            format!("channel {subscription_id} failed: {message}")
        }
        BridgeEffect::SubscribeFailed {
            generation,
            message,
        } => {
            format!("subscribe gen {generation} failed: {message}")
        }
    }
}

fn transcript(inputs: Vec<BridgeInput>) -> String {
    let mut bridge = ScopeBridge::new(config());
    let mut lines = Vec::new();
    for input in inputs {
        lines.push(format!("> {}", render_input(&input)));
        for effect in feed(&mut bridge, input) {
            lines.push(format!("  {}", render_effect(&effect)));
        }
    }
    lines.join("\n")
}

fn compact(sequences: &[i64]) -> Value {
    json!({"echoOrigin": null, "syncs": sequences.iter().map(|&s| json!({
        "id": s.to_string(), "serverSequence": s, "updatedAt": updated_at(s),
    })).collect::<Vec<_>>()})
}

#[test]
fn golden_transcript_subscribe_replay_live_echo_and_failure() {
    let actual = transcript(vec![
        BridgeInput::Subscribe {
            channels: vec![channel("p1", Some(2)), channel("p2", None)],
        },
        message("sync-1", compact(&[9])),
        message("sync-1", compact(&[3, 4])),
        message("sync-2", compact(&[1])),
        confirmed("sync-1"),
        ok(1),
        ok(2),
        confirmed("sync-2"),
        ok(3),
        message(
            "sync-2",
            json!({"echoOrigin": LOCAL_ORIGIN, "syncs": [{"id": "5"}]}),
        ),
        message("sync-1", json!(["not", "an", "envelope"])),
        message("sync-1", compact(&[10])),
        BridgeInput::Applied {
            ticket: 4,
            result: Err("disk full".to_owned()),
        },
        message("sync-1", compact(&[11])),
        ok(5),
        BridgeInput::Unsubscribe,
    ]);
    let expected = r#"> subscribe p1 after 2, p2 after -
  send channel-subscribe sync-1 p1 afterServerSequence=2
  send channel-subscribe sync-2 p2 afterServerSequence=-
> channel-message sync-1 {"echoOrigin":null,"syncs":[{"id":"9","serverSequence":9,"updatedAt":"2026-07-01T10:00:09.000Z"}]}
  apply #1 gen 0 p1 ["9"]
> channel-message sync-1 {"echoOrigin":null,"syncs":[{"id":"3","serverSequence":3,"updatedAt":"2026-07-01T10:00:03.000Z"},{"id":"4","serverSequence":4,"updatedAt":"2026-07-01T10:00:04.000Z"}]}
> channel-message sync-2 {"echoOrigin":null,"syncs":[{"id":"1","serverSequence":1,"updatedAt":"2026-07-01T10:00:01.000Z"}]}
> channel-subscribed sync-1
> applied #1 Ok(())
  apply #2 gen 0 p1 ["3", "4"]
> applied #2 Ok(())
  apply #3 gen 0 p2 ["1"]
> channel-subscribed sync-2
> applied #3 Ok(())
  save p1 cursor 9
  save p2 cursor 1
  ready gen 0
> channel-message sync-2 {"echoOrigin":"device-1","syncs":[{"id":"5"}]}
  dropped sync-2 (Echo)
> channel-message sync-1 ["not","an","envelope"]
  rejected sync-1: expected a sync message to be an envelope object, got an array of 3 items
> channel-message sync-1 {"echoOrigin":null,"syncs":[{"id":"10","serverSequence":10,"updatedAt":"2026-07-01T10:00:10.000Z"}]}
  apply #4 gen 0 p1 ["10"]
> applied #4 Err("disk full")
  apply #4 failed: disk full
> channel-message sync-1 {"echoOrigin":null,"syncs":[{"id":"11","serverSequence":11,"updatedAt":"2026-07-01T10:00:11.000Z"}]}
  apply #5 gen 0 p1 ["11"]
> applied #5 Ok(())
  save p1 cursor 11
> unsubscribe
  send channel-unsubscribe sync-1
  send channel-unsubscribe sync-2"#;
    assert_eq!(actual, expected);
}

/// One step of a random session.
#[derive(Debug, Clone)]
enum Op {
    Subscribe {
        scopes: usize,
    },
    Confirm {
        pick: usize,
    },
    Message {
        pick: usize,
        sequences: Vec<i64>,
        echo: bool,
        invalid: bool,
        reset: bool,
    },
    ApplyOk,
    ApplyErr,
    ChannelError {
        pick: usize,
    },
    Unsubscribe,
    SessionGone,
    SessionResumed,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (1usize..=3).prop_map(|scopes| Op::Subscribe { scopes }),
        4 => any::<usize>().prop_map(|pick| Op::Confirm { pick }),
        10 => (
            any::<usize>(),
            proptest::collection::vec(1i64..40, 0..4),
            proptest::bool::weighted(0.15),
            proptest::bool::weighted(0.1),
            proptest::bool::weighted(0.05),
        )
            .prop_map(|(pick, sequences, echo, invalid, reset)| Op::Message {
                pick, sequences, echo, invalid, reset
            }),
        8 => Just(Op::ApplyOk),
        2 => Just(Op::ApplyErr),
        1 => any::<usize>().prop_map(|pick| Op::ChannelError { pick }),
        1 => Just(Op::Unsubscribe),
        1 => Just(Op::SessionGone),
        1 => Just(Op::SessionResumed),
    ]
}

/// A model host: a cursor store and the bookkeeping the invariants need.
#[derive(Default)]
struct Harness {
    store: BTreeMap<ScopeDigest, SyncCursor>,
    /// Highest entry cursor committed to the local store per scope (since its last reset).
    applied: BTreeMap<ScopeDigest, SyncCursor>,
    /// Every subscription id the bridge issued, oldest first.
    issued: Vec<String>,
    /// The subscription each scope currently has open, per the bridge's frames.
    current: BTreeMap<ScopeDigest, String>,
    /// Messages fed per subscription id; and how many were fed before its confirmation.
    fed: BTreeMap<String, usize>,
    fed_before_confirm: BTreeMap<String, usize>,
    /// Messages of each subscription id that reached an outcome.
    resolved: BTreeMap<String, usize>,
    pending: Option<(u64, String, ScopeDigest, bool, Option<SyncCursor>)>,
}

impl Harness {
    fn pick(&self, pick: usize) -> Option<String> {
        // Mostly the open subscriptions, sometimes a retired one.
        let open: Vec<&String> = self.current.values().collect();
        if !open.is_empty() && !pick.is_multiple_of(4) {
            return Some(open[pick % open.len()].clone());
        }
        (!self.issued.is_empty()).then(|| self.issued[pick % self.issued.len()].clone())
    }

    fn resolve(&mut self, subscription_id: &str) {
        *self.resolved.entry(subscription_id.to_owned()).or_default() += 1;
    }

    fn observe(
        &mut self,
        bridge: &ScopeBridge,
        effects: Vec<BridgeEffect>,
    ) -> Result<(), TestCaseError> {
        for effect in effects {
            match effect {
                BridgeEffect::SendSubscribe {
                    subscription_id,
                    scope,
                    params,
                } => {
                    let expected = crate::scope_sync::cursor::cursor_to_params(
                        crate::scope_sync::cursor::CursorPrefix::After,
                        self.store.get(&scope),
                        crate::scope_sync::cursor::CursorParamsForm::Client,
                    );
                    for (key, value) in &expected {
                        prop_assert_eq!(
                            params.get(key),
                            Some(value),
                            "subscribe from the stored cursor"
                        );
                    }
                    self.issued.push(subscription_id.clone());
                    self.current.insert(scope, subscription_id);
                }
                BridgeEffect::SendUnsubscribe { subscription_id }
                | BridgeEffect::ChannelFailed {
                    subscription_id, ..
                } => {
                    self.current.retain(|_, open| *open != subscription_id);
                }
                BridgeEffect::ApplyBatch {
                    ticket,
                    generation,
                    scope,
                    subscription_id,
                    reset,
                    changes,
                    ..
                } => {
                    prop_assert!(self.pending.is_none(), "one batch at a time");
                    prop_assert_eq!(
                        generation,
                        bridge.generation(),
                        "stale generations never apply"
                    );
                    prop_assert_eq!(
                        self.current.get(&scope),
                        Some(&subscription_id),
                        "only open subscriptions apply"
                    );
                    for change in &changes {
                        prop_assert!(change.resource_id() != Some("echo"), "echoes never apply");
                        prop_assert_eq!(change.resource_type.as_str(), "Task");
                    }
                    let top = changes.iter().filter_map(RemoteChange::cursor).fold(
                        None::<SyncCursor>,
                        |best, c| {
                            if c.is_after(best.as_ref()) {
                                Some(c)
                            } else {
                                best
                            }
                        },
                    );
                    self.pending = Some((ticket, subscription_id, scope, reset, top));
                }
                BridgeEffect::SaveCursor { scope, cursor } => {
                    prop_assert!(
                        cursor.is_after(self.store.get(&scope)),
                        "saved cursors only move forwards"
                    );
                    prop_assert!(
                        !is_cursor_after(Some(&cursor), self.applied.get(&scope)),
                        "never beyond what was applied"
                    );
                    let open = self.current.get(&scope).cloned();
                    prop_assert!(open.is_some(), "saves belong to an open subscription");
                    let open = open.unwrap_or_default();
                    let before = self.fed_before_confirm.get(&open).copied();
                    prop_assert!(before.is_some(), "nothing is saved before confirmation");
                    prop_assert!(
                        self.resolved.get(&open).copied().unwrap_or(0) >= before.unwrap_or(0),
                        "nothing is saved before the replay is applied"
                    );
                    self.store.insert(scope, cursor);
                }
                BridgeEffect::MessageRejected {
                    subscription_id, ..
                }
                | BridgeEffect::Dropped {
                    subscription_id, ..
                } => self.resolve(&subscription_id),
                BridgeEffect::Ready { .. }
                | BridgeEffect::ApplyFailed { .. }
                | BridgeEffect::SubscribeFailed { .. } => {}
            }
        }
        Ok(())
    }

    fn settle(&mut self, bridge: &mut ScopeBridge, success: bool) -> Result<(), TestCaseError> {
        let Some((ticket, subscription_id, scope, reset, top)) = self.pending.take() else {
            return Ok(());
        };
        self.resolve(&subscription_id);
        if success {
            if reset {
                self.store.remove(&scope);
                self.applied.remove(&scope);
            }
            if let Some(top) = top {
                if top.is_after(self.applied.get(&scope)) {
                    self.applied.insert(scope, top);
                }
            }
        }
        let result = if success {
            Ok(())
        } else {
            Err("rejected by the store".to_owned())
        };
        let effects = bridge
            .handle(BridgeInput::Applied { ticket, result })
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        self.observe(bridge, effects)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random sessions keep the bridge's promises: persisted cursors never move back (but
    /// for an explicit reset) nor past what was applied, nothing is saved before a
    /// subscription is confirmed and its replay applied, stale or retired subscriptions never
    /// apply, at most one batch is out at a time, and every message reaches an outcome.
    #[test]
    fn random_sessions_keep_the_bridge_invariants(
        initial in proptest::collection::vec(proptest::option::of(1i64..20), 3),
        ops in proptest::collection::vec(op_strategy(), 1..60),
    ) {
        let projects = ["p1", "p2", "p3"];
        let mut harness = Harness::default();
        for (project, after) in projects.iter().zip(&initial) {
            if let Some(after) = after {
                harness.store.insert(digest(project), cursor(*after));
                harness.applied.insert(digest(project), cursor(*after));
            }
        }
        let mut bridge = ScopeBridge::new(config());
        for op in ops {
            let input = match op {
                Op::Subscribe { scopes } => BridgeInput::Subscribe {
                    channels: projects[..scopes].iter().map(|project| {
                        let mut channel = channel(project, None);
                        channel.params.after = harness.store.get(&digest(project)).cloned();
                        channel
                    }).collect(),
                },
                Op::Confirm { pick } => match harness.pick(pick) {
                    Some(id) => {
                        let fed = harness.fed.get(&id).copied().unwrap_or(0);
                        harness.fed_before_confirm.entry(id.clone()).or_insert(fed);
                        confirmed(&id)
                    }
                    None => continue,
                },
                Op::Message { pick, sequences, echo, invalid, reset } => {
                    let Some(id) = harness.pick(pick) else { continue };
                    *harness.fed.entry(id.clone()).or_default() += 1;
                    let mut entries: Vec<Value> = sequences.iter().map(|&s| entry(s)).collect();
                    if echo {
                        for entry in &mut entries {
                            entry["resourceId"] = json!("echo");
                        }
                    }
                    if invalid {
                        entries.push(json!({"resourceType": "Ghost", "serverSequence": 99,
                            "updatedAt": updated_at(99), "id": "99"}));
                    }
                    let mut body = body_of(entries);
                    if echo {
                        body["echoOrigin"] = json!(LOCAL_ORIGIN);
                    }
                    if reset {
                        body[crate::scope_sync::replay::RESET_KEY] = json!({"reason": "test"});
                    }
                    message(&id, body)
                }
                Op::ApplyOk => {
                    harness.settle(&mut bridge, true)?;
                    continue;
                }
                Op::ApplyErr => {
                    harness.settle(&mut bridge, false)?;
                    continue;
                }
                Op::ChannelError { pick } => match harness.pick(pick) {
                    Some(id) => BridgeInput::ChannelError { subscription_id: id, message: "refused".to_owned() },
                    None => continue,
                },
                Op::Unsubscribe => {
                    harness.current.clear();
                    BridgeInput::Unsubscribe
                }
                Op::SessionGone => {
                    harness.current.clear();
                    BridgeInput::SessionGone
                }
                Op::SessionResumed => BridgeInput::SessionResumed,
            };
            let effects = bridge.handle(input).map_err(|e| TestCaseError::fail(e.to_string()))?;
            harness.observe(&bridge, effects)?;
        }
        // The queue never stalls: answering the batches drains it.
        while harness.pending.is_some() {
            harness.settle(&mut bridge, true)?;
        }
        let status = bridge.status();
        prop_assert_eq!((status.queued, status.applying), (0, None));
        prop_assert_eq!(&harness.resolved, &harness.fed.iter().filter(|(_, n)| **n > 0)
            .map(|(id, n)| (id.clone(), *n)).collect::<BTreeMap<_, _>>(), "every message reached an outcome");
        for track in &status.channels {
            prop_assert_eq!(track.persisted_cursor.as_ref(), harness.store.get(&track.scope));
        }
    }
}

/// A body read with its frame shows, and compares, as the body it came as, less its entries'
/// other keys (which that read drops).
#[test]
fn a_kept_body_shows_as_the_body_it_came_as() {
    let body = json!({"echoOrigin": null, "syncs": [
        {"data": {"id": 1, "big": 123456789012345678901234567890_u128}, "id": "e:1",
         "resourceId": "1", "serverSequence": 1, "syncType": "update",
         "updatedAt": "2026-07-01T10:00:00.000Z", "owner": "ada"},
        {"data": null, "id": "e:2", "resourceId": "2", "serverSequence": 2,
         "syncType": "delete", "updatedAt": "2026-07-01T10:00:00.000Z"},
    ], "progress": {"done": 2, "total": 2}});
    #[derive(serde::Deserialize)]
    struct Frame {
        body: crate::scope_sync::KeptBody,
    }
    let read = || {
        let frame: Frame = serde_json::from_value(json!({ "body": body })).unwrap();
        MessageBody::Kept(Box::new(
            frame.body.into_envelope().expect("the typed read"),
        ))
    };
    let kept = read();
    let shown: Value = serde_json::from_str(&kept.to_string()).unwrap();
    let mut unattributed = body.clone();
    unattributed["syncs"][0]
        .as_object_mut()
        .unwrap()
        .remove("owner");
    assert_eq!(shown, unattributed);
    assert_eq!(kept, read());
    let MessageBody::Kept(mut other) = read() else {
        unreachable!()
    };
    other.1[0] = serde_json::value::to_raw_value(&json!({"id": 2})).ok();
    assert_ne!(kept, MessageBody::Kept(other));
}
