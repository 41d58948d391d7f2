use super::*;
use proptest::prelude::*;
use serde_json::json;

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

fn row(sequence: i64) -> SyncEntry {
    let value = json!({
        "data": {"id": format!("t{sequence}")},
        "id": sequence.to_string(),
        "resourceId": format!("t{sequence}"),
        "resourceType": "Task",
        "serverSequence": sequence,
        "syncType": "update",
        "updatedAt": updated_at(sequence),
    });
    SyncEntry::try_from(value).expect("a valid entry")
}

fn envelope(sequences: &[i64]) -> SyncEnvelope {
    SyncEnvelope::new(None, sequences.iter().map(|&s| row(s)).collect())
}

/// A change feed over an in-memory replica: rows by ascending sequence.
#[derive(Default)]
struct Feed {
    rows: Vec<i64>,
    fetches: usize,
}

impl Feed {
    fn with(rows: impl IntoIterator<Item = i64>) -> Self {
        Self {
            rows: rows.into_iter().collect(),
            fetches: 0,
        }
    }

    fn fetch(&mut self, request: &PageRequest) -> FetchedPage {
        self.fetches += 1;
        let up_to = request
            .up_to
            .clone()
            .or_else(|| self.rows.iter().max().map(|&s| cursor(s)));
        let high = up_to.as_ref().and_then(|c| c.server_sequence).unwrap_or(0);
        let low = request
            .after
            .as_ref()
            .and_then(|c| c.server_sequence)
            .unwrap_or(i64::MIN);
        let mut selected: Vec<i64> = self
            .rows
            .iter()
            .copied()
            .filter(|&s| s > low && s <= high)
            .collect();
        selected.sort_unstable();
        selected.truncate(request.limit as usize);
        FetchedPage {
            pass: request.pass,
            up_to,
            rows: selected.into_iter().map(row).collect(),
        }
    }
}

/// Runs a pass to its end, answering every fetch from `feed`; returns all effects.
fn run(planner: &mut ReplayPlanner, feed: &mut Feed, begin: ReplayInput) -> Vec<ReplayEffect> {
    let mut all = Vec::new();
    let mut pending = planner.handle(begin).expect("begin");
    while let Some(effect) = pending.first().cloned() {
        pending.remove(0);
        if let ReplayEffect::FetchPage(request) = &effect {
            let page = feed.fetch(request);
            pending.extend(
                planner
                    .handle(ReplayInput::PageFetched(page))
                    .expect("page"),
            );
        }
        all.push(effect);
    }
    all
}

fn begin(kind: ReplayKind) -> ReplayInput {
    ReplayInput::Begin {
        kind,
        retention_floor: None,
    }
}

/// The sequences of each sent page.
fn sent_pages(effects: &[ReplayEffect]) -> Vec<Vec<i64>> {
    effects
        .iter()
        .filter_map(|effect| match effect {
            ReplayEffect::SendEnvelope { envelope, .. } => Some(
                envelope
                    .syncs
                    .iter()
                    .map(|entry| entry.server_sequence.expect("a sequence"))
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

fn params(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("expected an object, got {other}"),
    }
}

#[test]
fn scenario_09_fresh_subscription_replays_whole_scope_in_order_before_finishing() {
    let mut planner =
        ReplayPlanner::from_params(&params(json!({"conditions": {}, "resourceType": "Task"})))
            .expect("valid params");
    let mut feed = Feed::with([3, 1, 2]);
    let effects = run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
    assert_eq!(sent_pages(&effects), vec![vec![1, 2, 3]]);
    assert!(matches!(
        effects.first(),
        Some(ReplayEffect::FetchPage(PageRequest {
            after: None,
            up_to: None,
            limit: 1000,
            ..
        }))
    ));
    // The page is sent before the pass finishes (and so before `channel-subscribed`).
    assert!(matches!(
        effects.last(),
        Some(ReplayEffect::Finished {
            kind: ReplayKind::Subscribe,
            pages: 1,
            rows: 3,
            ..
        })
    ));
    for effect in &effects {
        if let ReplayEffect::SendEnvelope { envelope, .. } = effect {
            assert_eq!(envelope.to_value()["echoOrigin"], Value::Null);
        }
    }
    assert_eq!(planner.delivered_cursor(), Some(&cursor(3)));
    assert!(!planner.is_replaying());
}

#[test]
fn scenario_10_resume_from_cursor_does_not_resend_the_row_at_the_cursor() {
    let mut planner = ReplayPlanner::from_params(&params(json!({
        "conditions": {}, "resourceType": "Task",
        "afterId": "2", "afterServerSequence": 2, "afterUpdatedAt": updated_at(2),
    })))
    .expect("valid params");
    let mut feed = Feed::with(1..=5);
    let effects = run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
    assert_eq!(sent_pages(&effects), vec![vec![3, 4, 5]]);
}

#[test]
fn scenario_11_five_rows_with_limit_two_arrive_as_two_two_one_and_stop_on_the_short_page() {
    let mut planner = ReplayPlanner::new(None, 2);
    let mut feed = Feed::with(1..=5);
    let effects = run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
    assert_eq!(sent_pages(&effects), vec![vec![1, 2], vec![3, 4], vec![5]]);
    assert_eq!(feed.fetches, 3);
}

#[test]
fn scenario_11_four_rows_with_limit_two_end_on_an_empty_page() {
    let mut planner = ReplayPlanner::new(None, 2);
    let mut feed = Feed::with(1..=4);
    let effects = run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
    assert_eq!(sent_pages(&effects), vec![vec![1, 2], vec![3, 4]]);
    assert_eq!(
        feed.fetches, 3,
        "the third fetch returns the empty page that ends it"
    );
    assert!(matches!(
        effects.last(),
        Some(ReplayEffect::Finished {
            pages: 2,
            rows: 4,
            ..
        })
    ));
}

#[test]
fn scenario_12_pinned_high_water_leaves_rows_inserted_during_replay_to_live_delivery() {
    let mut planner = ReplayPlanner::new(None, 2);
    let mut feed = Feed::with(1..=4);
    let first = planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
    let ReplayEffect::FetchPage(request) = &first[0] else {
        panic!("expected a fetch, got {first:?}");
    };
    let page = feed.fetch(request);
    let mut effects = planner
        .handle(ReplayInput::PageFetched(page))
        .expect("page");
    // A row commits mid-replay; it is live-delivered to the registered subscription.
    feed.rows.push(5);
    planner
        .handle(ReplayInput::Delivered {
            envelope: envelope(&[5]),
        })
        .expect("delivered");
    let mut sent = sent_pages(&effects);
    while let Some(ReplayEffect::FetchPage(request)) = effects.last().cloned() {
        assert_eq!(
            request.up_to,
            Some(cursor(4)),
            "later pages carry the pinned high-water"
        );
        effects = planner
            .handle(ReplayInput::PageFetched(feed.fetch(&request)))
            .expect("page");
        sent.extend(sent_pages(&effects));
    }
    assert_eq!(sent, vec![vec![1, 2], vec![3, 4]]);
    assert!(matches!(
        effects.last(),
        Some(ReplayEffect::Finished { .. })
    ));
    assert_eq!(planner.delivered_cursor(), Some(&cursor(5)));
}

#[test]
fn scenario_13_invalid_limits_and_after_sequences_fail_the_subscription() {
    for limit in [json!(0), json!(-1), json!(1.5), json!("abc")] {
        let result = ReplayPlanner::from_params(&params(
            json!({"conditions": {}, "resourceType": "Task", "limit": limit}),
        ));
        assert!(
            matches!(
                result,
                Err(ReplayError::Params(SubscribeError::BadLimit { .. }))
            ),
            "limit {limit} gave {result:?}"
        );
    }
    for sequence in [json!("abc"), json!("")] {
        let result = ReplayPlanner::from_params(&params(json!({
            "conditions": {}, "resourceType": "Task",
            "afterServerSequence": sequence, "afterUpdatedAt": updated_at(1),
        })));
        assert!(
            matches!(
                result,
                Err(ReplayError::Params(SubscribeError::BadAfterSequence { .. }))
            ),
            "afterServerSequence {sequence} gave {result:?}"
        );
    }
    let clamped = ReplayPlanner::from_params(&params(
        json!({"conditions": {}, "resourceType": "Task", "limit": 5000}),
    ))
    .expect("a large limit is clamped");
    assert_eq!(clamped.limit(), MAX_PAGE_LIMIT);
    let default = ReplayPlanner::from_params(&params(json!({"conditions": {}})))
        .expect("no limit is the default");
    assert_eq!(default.limit(), 1000);
    // Without afterUpdatedAt the replay covers the whole scope.
    let mut whole =
        ReplayPlanner::from_params(&params(json!({"conditions": {}, "afterServerSequence": 3})))
            .expect("a lone sequence is valid");
    let effects = run(
        &mut whole,
        &mut Feed::with(1..=4),
        begin(ReplayKind::Subscribe),
    );
    assert_eq!(sent_pages(&effects), vec![vec![1, 2, 3, 4]]);
}

#[test]
fn scenario_14_resume_replays_only_rows_after_the_delivered_cursor() {
    let mut planner = ReplayPlanner::new(None, 1000);
    let mut feed = Feed::with(1..=3);
    run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
    // Live rows 4 and 5 are sent; 6 and 7 are written while the socket is down and their
    // frames are lost.
    feed.rows.extend([4, 5, 6, 7]);
    for sequence in [4, 5] {
        planner
            .handle(ReplayInput::Delivered {
                envelope: envelope(&[sequence]),
            })
            .expect("delivered");
    }
    feed.fetches = 0;
    let effects = run(&mut planner, &mut feed, begin(ReplayKind::Resume));
    assert!(matches!(
        effects.first(),
        Some(ReplayEffect::FetchPage(PageRequest { after: Some(after), .. })) if *after == cursor(5)
    ));
    assert_eq!(sent_pages(&effects), vec![vec![6, 7]]);
    assert_eq!(feed.fetches, 1, "no full re-read");
    assert!(matches!(
        effects.last(),
        Some(ReplayEffect::Finished {
            kind: ReplayKind::Resume,
            ..
        })
    ));
}

#[test]
fn scenario_14_resume_before_any_delivery_starts_from_the_subscribe_cursor() {
    let mut planner = ReplayPlanner::new(Some(cursor(2)), 1000);
    let mut feed = Feed::with(1..=3);
    // The subscribe pass is lost with the socket before its page came back.
    planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
    let effects = run(&mut planner, &mut feed, begin(ReplayKind::Resume));
    assert_eq!(sent_pages(&effects), vec![vec![3]]);
    // It supersedes an unfinished subscribe pass, so it still ends in channel-subscribed.
    assert!(matches!(
        effects.last(),
        Some(ReplayEffect::Finished {
            kind: ReplayKind::Subscribe,
            ..
        })
    ));
}

#[test]
fn scenario_23_out_of_order_fan_out_leaves_the_delivered_cursor_at_the_higher_sequence() {
    let mut planner = ReplayPlanner::new(None, 1000);
    let mut feed = Feed::with([]);
    run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
    feed.rows.extend([6, 7]);
    for sequence in [7, 6] {
        planner
            .handle(ReplayInput::Delivered {
                envelope: envelope(&[sequence]),
            })
            .expect("delivered");
    }
    assert_eq!(planner.delivered_cursor(), Some(&cursor(7)));
    let effects = run(&mut planner, &mut feed, begin(ReplayKind::Resume));
    assert!(
        sent_pages(&effects).is_empty(),
        "6 is not re-sent: {effects:?}"
    );
}

#[test]
fn a_replay_page_below_a_live_row_never_moves_the_delivered_cursor_back() {
    // Hazard P5 (scope-sync.md): velocious assigns the replay's page cursor to the
    // delivered cursor outright.
    let mut planner = ReplayPlanner::new(None, 2);
    let mut feed = Feed::with(1..=4);
    let first = planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
    let ReplayEffect::FetchPage(request) = &first[0] else {
        panic!("expected a fetch");
    };
    feed.rows.push(10);
    let page = feed.fetch(request);
    planner
        .handle(ReplayInput::Delivered {
            envelope: envelope(&[10]),
        })
        .expect("delivered");
    planner
        .handle(ReplayInput::PageFetched(page))
        .expect("page");
    assert_eq!(planner.delivered_cursor(), Some(&cursor(10)));
}

#[test]
fn a_cursor_below_the_retention_floor_gets_a_reset_then_a_full_replay() {
    let mut planner = ReplayPlanner::new(Some(cursor(2)), 1000);
    let mut feed = Feed::with([6, 7]);
    let effects = run(
        &mut planner,
        &mut feed,
        ReplayInput::Begin {
            kind: ReplayKind::Subscribe,
            retention_floor: Some(cursor(5)),
        },
    );
    let ReplayEffect::Reset {
        stale_cursor,
        retention_floor,
        envelope,
        ..
    } = &effects[0]
    else {
        panic!("expected a reset first, got {effects:?}");
    };
    assert_eq!((stale_cursor, retention_floor), (&cursor(2), &cursor(5)));
    assert!(is_reset(envelope));
    let body = envelope.to_value();
    assert_eq!(body["echoOrigin"], Value::Null);
    assert_eq!(body["syncs"], json!([]));
    assert_eq!(
        body[RESET_KEY]["retentionFloor"]["serverSequence"],
        json!(5)
    );
    assert!(matches!(
        &effects[1],
        ReplayEffect::FetchPage(PageRequest { after: None, .. })
    ));
    assert_eq!(sent_pages(&effects), vec![vec![6, 7]]);
}

#[test]
fn a_cursor_at_or_above_the_retention_floor_resumes_without_reset() {
    for (start, floor) in [
        (Some(5), Some(5)),
        (Some(6), Some(5)),
        (None, Some(5)),
        (Some(1), None),
    ] {
        let mut planner = ReplayPlanner::new(start.map(cursor), 1000);
        let effects = planner
            .handle(ReplayInput::Begin {
                kind: ReplayKind::Subscribe,
                retention_floor: floor.map(cursor),
            })
            .expect("begin");
        assert!(
            matches!(effects.as_slice(), [ReplayEffect::FetchPage(_)]),
            "start {start:?} floor {floor:?} gave {effects:?}"
        );
    }
}

#[test]
fn a_resume_from_a_delivered_cursor_below_the_floor_is_reset_too() {
    let mut planner = ReplayPlanner::new(None, 1000);
    run(
        &mut planner,
        &mut Feed::with([1, 2]),
        begin(ReplayKind::Subscribe),
    );
    let effects = planner
        .handle(ReplayInput::Begin {
            kind: ReplayKind::Resume,
            retention_floor: Some(cursor(4)),
        })
        .expect("begin");
    assert!(matches!(
        effects.as_slice(),
        [
            ReplayEffect::Reset { .. },
            ReplayEffect::FetchPage(PageRequest { after: None, .. })
        ]
    ));
}

#[test]
fn envelopes_without_a_reset_marker_are_not_resets() {
    assert!(!is_reset(&envelope(&[1])));
    let mut explicit_false = envelope(&[]);
    explicit_false
        .extra
        .insert(RESET_KEY.to_owned(), Value::Bool(false));
    assert!(!is_reset(&explicit_false));
    let decoded = SyncEnvelope::from_value(&reset_envelope(&cursor(3)).to_value())
        .expect("a reset envelope decodes");
    assert!(is_reset(&decoded));
}

#[test]
fn feed_params_name_every_bound_so_stale_subscribe_params_cannot_leak() {
    // Hazard P6 (scope-sync.md): a page cursor without a sequence must not inherit the
    // subscribe-time sequence.
    let base = params(json!({
        "conditions": {"projectId": "p1"},
        "afterId": "9", "afterServerSequence": 9, "afterUpdatedAt": updated_at(9),
        "upToId": "x", "limit": 7,
    }));
    let request = PageRequest {
        pass: 1,
        after: Some(SyncCursor::legacy(updated_at(3))),
        up_to: Some(cursor(20)),
        limit: 2,
    };
    let feed = request.feed_params(&base);
    assert_eq!(
        Value::Object(feed),
        json!({
            "conditions": {"projectId": "p1"},
            "afterId": null, "afterUpdatedAt": updated_at(3),
            "upToId": "20", "upToServerSequence": 20, "upToUpdatedAt": updated_at(20),
            "limit": 2,
        })
    );
    let first = PageRequest {
        pass: 1,
        after: Some(SyncCursor::new(None, Some(0), updated_at(0))),
        up_to: None,
        limit: 5,
    };
    let feed = first.feed_params(&base);
    assert_eq!(
        feed.get("afterServerSequence"),
        Some(&json!(0)),
        "server form keeps 0"
    );
    assert!(!feed.contains_key("upToId"));
}

#[test]
fn effects_serialize_with_a_type_tag_for_hosts_and_bindings() {
    let mut planner = ReplayPlanner::new(Some(cursor(2)), 10);
    let effects = planner
        .handle(ReplayInput::Begin {
            kind: ReplayKind::Subscribe,
            retention_floor: Some(cursor(4)),
        })
        .expect("begin");
    let values: Vec<Value> = effects
        .iter()
        .map(|effect| serde_json::to_value(effect).expect("serializable"))
        .collect();
    assert_eq!(values[0]["type"], json!("reset"));
    assert_eq!(values[0]["staleCursor"]["serverSequence"], json!(2));
    assert_eq!(
        values[0]["envelope"]["reset"]["reason"],
        json!("cursor-before-retention")
    );
    assert_eq!(
        values[1],
        json!({"type": "fetchPage", "pass": 1, "after": null, "upTo": null, "limit": 10})
    );
}

#[test]
fn an_empty_scope_finishes_without_sending() {
    let mut planner = ReplayPlanner::new(None, 1000);
    let effects = run(
        &mut planner,
        &mut Feed::with([]),
        begin(ReplayKind::Subscribe),
    );
    assert!(matches!(
        effects.as_slice(),
        [
            ReplayEffect::FetchPage(_),
            ReplayEffect::Finished {
                pages: 0,
                rows: 0,
                ..
            }
        ]
    ));
}

#[test]
fn the_subscribe_pass_starts_only_once() {
    let mut planner = ReplayPlanner::new(None, 1000);
    planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
    assert_eq!(
        planner.handle(begin(ReplayKind::Subscribe)),
        Err(ReplayError::AlreadySubscribed)
    );
}

#[test]
fn malformed_pages_are_refused_with_what_was_expected() {
    let page = |pass, up_to: Option<i64>, rows: &[i64]| {
        ReplayInput::PageFetched(FetchedPage {
            pass,
            up_to: up_to.map(cursor),
            rows: rows.iter().map(|&s| row(s)).collect(),
        })
    };
    let started = || {
        let mut planner = ReplayPlanner::new(Some(cursor(2)), 2);
        planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
        planner
    };
    assert_eq!(
        started().handle(page(1, Some(9), &[3, 4, 5])),
        Err(ReplayError::PageTooLarge { limit: 2, got: 3 })
    );
    assert_eq!(
        started().handle(page(1, None, &[3])),
        Err(ReplayError::MissingHighWater)
    );
    assert!(matches!(
        started().handle(page(1, Some(9), &[2, 3])),
        Err(ReplayError::RowOutOfOrder { index: 0, .. })
    ));
    assert!(matches!(
        started().handle(page(1, Some(9), &[4, 3])),
        Err(ReplayError::RowOutOfOrder { index: 1, .. })
    ));
    assert!(matches!(
        started().handle(page(1, Some(3), &[3, 4])),
        Err(ReplayError::RowAboveHighWater { index: 1, .. })
    ));
    let mut planner = started();
    let mut bare = row(3);
    bare.updated_at = None;
    assert_eq!(
        planner.handle(ReplayInput::PageFetched(FetchedPage {
            pass: 1,
            up_to: Some(cursor(9)),
            rows: vec![bare],
        })),
        Err(ReplayError::RowWithoutCursor { index: 0 })
    );
    let error = started()
        .handle(page(7, Some(9), &[3]))
        .expect_err("unknown pass");
    assert_eq!(
        error.to_string(),
        "expected a page for replay pass 1, got one for pass 7"
    );
}

#[test]
fn pages_of_a_superseded_pass_are_ignored() {
    let mut planner = ReplayPlanner::new(None, 2);
    planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
    planner.handle(begin(ReplayKind::Resume)).expect("resume");
    let late = FetchedPage {
        pass: 1,
        up_to: Some(cursor(2)),
        rows: vec![row(1), row(2)],
    };
    assert_eq!(
        planner.handle(ReplayInput::PageFetched(late)),
        Ok(Vec::new())
    );
    assert_eq!(planner.delivered_cursor(), None);
}

/// Renders effects one per line, for transcripts.
fn render(effect: &ReplayEffect) -> String {
    let at = |c: &Option<SyncCursor>| {
        c.as_ref()
            .and_then(|c| c.server_sequence)
            .map_or_else(|| "-".to_owned(), |s| s.to_string())
    };
    match effect {
        ReplayEffect::Reset {
            pass,
            stale_cursor,
            retention_floor,
            ..
        } => format!(
            "reset pass {pass}: cursor {} is below floor {}",
            at(&Some(stale_cursor.clone())),
            at(&Some(retention_floor.clone()))
        ),
        ReplayEffect::FetchPage(request) => format!(
            "fetch pass {} after {} upTo {} limit {}",
            request.pass,
            at(&request.after),
            at(&request.up_to),
            request.limit
        ),
        ReplayEffect::SendEnvelope { pass, envelope } => format!(
            "send pass {pass} {:?}",
            envelope
                .syncs
                .iter()
                .filter_map(|e| e.server_sequence)
                .collect::<Vec<_>>()
        ),
        ReplayEffect::Finished {
            pass,
            kind,
            pages,
            rows,
        } => {
            format!("finished pass {pass} {kind:?}: {pages} pages, {rows} rows")
        }
    }
}

#[test]
fn golden_transcript_of_subscribe_live_fan_out_and_resume() {
    let mut planner = ReplayPlanner::new(Some(cursor(1)), 2);
    let mut feed = Feed::with(1..=6);
    let mut transcript = Vec::new();
    fn step(
        transcript: &mut Vec<String>,
        planner: &mut ReplayPlanner,
        feed: &mut Feed,
        label: &str,
        input: ReplayInput,
    ) {
        transcript.push(format!("> {label}"));
        for effect in run(planner, feed, input) {
            transcript.push(format!("  {}", render(&effect)));
        }
    }
    step(
        &mut transcript,
        &mut planner,
        &mut feed,
        "begin subscribe",
        begin(ReplayKind::Subscribe),
    );
    feed.rows.extend([7, 8]);
    planner
        .handle(ReplayInput::Delivered {
            envelope: envelope(&[8]),
        })
        .expect("delivered");
    planner
        .handle(ReplayInput::Delivered {
            envelope: envelope(&[7]),
        })
        .expect("delivered");
    transcript.push("> delivered live [8] then [7]".to_owned());
    feed.rows.extend([9]);
    step(
        &mut transcript,
        &mut planner,
        &mut feed,
        "begin resume",
        begin(ReplayKind::Resume),
    );
    step(
        &mut transcript,
        &mut planner,
        &mut feed,
        "begin resume (floor 12)",
        ReplayInput::Begin {
            kind: ReplayKind::Resume,
            retention_floor: Some(cursor(12)),
        },
    );
    let expected = "\
> begin subscribe
  fetch pass 1 after 1 upTo - limit 2
  send pass 1 [2, 3]
  fetch pass 1 after 3 upTo 6 limit 2
  send pass 1 [4, 5]
  fetch pass 1 after 5 upTo 6 limit 2
  send pass 1 [6]
  finished pass 1 Subscribe: 3 pages, 5 rows
> delivered live [8] then [7]
> begin resume
  fetch pass 2 after 8 upTo - limit 2
  send pass 2 [9]
  finished pass 2 Resume: 1 pages, 1 rows
> begin resume (floor 12)
  reset pass 3: cursor 9 is below floor 12
  fetch pass 3 after - upTo - limit 2
  send pass 3 [1, 2]
  fetch pass 3 after 2 upTo 9 limit 2
  send pass 3 [3, 4]
  fetch pass 3 after 4 upTo 9 limit 2
  send pass 3 [5, 6]
  fetch pass 3 after 6 upTo 9 limit 2
  send pass 3 [7, 8]
  fetch pass 3 after 8 upTo 9 limit 2
  send pass 3 [9]
  finished pass 3 Resume: 5 pages, 9 rows";
    assert_eq!(transcript.join("\n"), expected);
}

#[derive(Debug, Clone)]
enum Step {
    /// Rows commit; their live broadcasts are pending until delivered.
    Write {
        count: u8,
    },
    /// Broadcasts of already-written rows land, in the given (possibly reversed) order.
    Deliver {
        reversed: bool,
    },
    Resume,
}

fn step_strategy() -> impl Strategy<Value = Step> {
    prop_oneof![
        (1u8..4).prop_map(|count| Step::Write { count }),
        any::<bool>().prop_map(|reversed| Step::Deliver { reversed }),
        Just(Step::Resume),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every pass terminates within ⌈rows/limit⌉ + 1 fetches and sends exactly the rows
    /// after its start up to its high-water, ascending; the delivered cursor never moves
    /// back; and after a resume the client holds every row written.
    #[test]
    fn replay_passes_are_complete_bounded_and_monotonic(
        initial in 0i64..12,
        start in proptest::option::of(0i64..12),
        limit in 1u32..5,
        steps in proptest::collection::vec(step_strategy(), 0..12),
    ) {
        // A client cursor names a row the replica has (or had).
        let start = start.map(|s| s.min(initial));
        let mut feed = Feed::with(1..=initial);
        let mut planner = ReplayPlanner::new(start.map(cursor), limit);
        let mut client: std::collections::BTreeSet<i64> =
            (1..=start.unwrap_or(0)).collect();
        let mut pending_live: Vec<i64> = Vec::new();
        let mut last_delivered: Option<SyncCursor> = None;
        let check_pass = |planner: &mut ReplayPlanner, feed: &mut Feed, kind, client: &mut std::collections::BTreeSet<i64>| {
            let before = planner.delivered_cursor().cloned();
            let from = match kind {
                ReplayKind::Subscribe => start.unwrap_or(0),
                ReplayKind::Resume => before.as_ref().and_then(|c| c.server_sequence)
                    .unwrap_or(0).max(start.unwrap_or(0)),
            };
            let high = feed.rows.iter().copied().max().unwrap_or(0);
            let expected: Vec<i64> = (from + 1..=high).filter(|s| feed.rows.contains(s)).collect();
            feed.fetches = 0;
            let effects = run(planner, feed, begin(kind));
            let sent: Vec<i64> = sent_pages(&effects).concat();
            prop_assert_eq!(&sent, &expected);
            prop_assert!(feed.fetches <= expected.len() / limit as usize + 1);
            prop_assert!(!is_cursor_after(before.as_ref(), planner.delivered_cursor()));
            client.extend(sent);
            Ok(())
        };
        check_pass(&mut planner, &mut feed, ReplayKind::Subscribe, &mut client)?;
        for step in steps {
            match step {
                Step::Write { count } => {
                    let next = feed.rows.iter().copied().max().unwrap_or(0) + 1;
                    for sequence in next..next + i64::from(count) {
                        feed.rows.push(sequence);
                        pending_live.push(sequence);
                    }
                }
                Step::Deliver { reversed } => {
                    if reversed {
                        pending_live.reverse();
                    }
                    for sequence in pending_live.drain(..) {
                        planner.handle(ReplayInput::Delivered { envelope: envelope(&[sequence]) })
                            .expect("delivered");
                        client.insert(sequence);
                    }
                }
                Step::Resume => {
                    // Broadcasts still in fan-out are never sent: the resume replay covers them.
                    pending_live.clear();
                    check_pass(&mut planner, &mut feed, ReplayKind::Resume, &mut client)?;
                    let all: std::collections::BTreeSet<i64> = feed.rows.iter().copied().collect();
                    prop_assert_eq!(&client, &all, "a resume leaves no gap");
                }
            }
            prop_assert!(!is_cursor_after(last_delivered.as_ref(), planner.delivered_cursor()));
            last_delivered = planner.delivered_cursor().cloned();
        }
    }
}
