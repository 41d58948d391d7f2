use super::*;
use proptest::prelude::*;
use serde_json::json;

const T0: &str = "2026-07-01T10:00:00.000Z";
const T1: &str = "2026-07-01T10:00:01.000Z";
const T2: &str = "2026-07-01T10:00:02.000Z";

fn cursor(id: Option<&str>, seq: Option<i64>, updated_at: &str) -> SyncCursor {
    SyncCursor::new(id.map(str::to_owned), seq, updated_at.to_owned())
}

fn after(candidate: &SyncCursor, current: &SyncCursor) -> bool {
    is_cursor_after(Some(candidate), Some(current))
}

// Worked comparison examples, one test each (scope-sync.md, "Comparing cursors").

#[test]
fn example_01_anything_is_after_a_null_current() {
    assert!(is_cursor_after(Some(&cursor(Some("a"), Some(5), T0)), None));
}

#[test]
fn example_02_a_null_candidate_is_never_after() {
    assert!(!is_cursor_after(
        None,
        Some(&cursor(Some("a"), Some(5), T0))
    ));
    assert!(!is_cursor_after(None, None));
}

#[test]
fn example_03_a_higher_sequence_is_after() {
    assert!(after(
        &cursor(Some("b"), Some(11), T1),
        &cursor(Some("a"), Some(10), T0)
    ));
}

#[test]
fn example_04_a_duplicate_is_not_after() {
    let c = cursor(Some("a"), Some(10), T0);
    assert!(!after(&c, &c.clone()));
    assert_eq!(compare_cursors(Some(&c), Some(&c)), Ordering::Equal);
}

#[test]
fn example_05_a_lower_sequence_loses_despite_a_later_timestamp() {
    assert!(!after(
        &cursor(Some("x"), Some(9), T1),
        &cursor(Some("y"), Some(10), T0)
    ));
}

#[test]
fn example_06_a_higher_sequence_wins_despite_an_earlier_timestamp() {
    assert!(after(
        &cursor(Some("x"), Some(11), T0),
        &cursor(Some("y"), Some(10), T1)
    ));
}

#[test]
fn example_07_against_a_legacy_cursor_the_later_instant_is_after() {
    assert!(after(
        &cursor(Some("a"), Some(12), T1),
        &cursor(None, None, T0)
    ));
}

#[test]
fn example_08_against_a_legacy_cursor_the_earlier_instant_is_not_after() {
    assert!(!after(
        &cursor(Some("a"), Some(12), T0),
        &cursor(None, None, T1)
    ));
}

#[test]
fn example_09_equal_instants_fall_back_to_id_order() {
    assert!(after(
        &cursor(Some("b"), None, T0),
        &cursor(Some("a"), None, T0)
    ));
    assert!(!after(
        &cursor(Some("a"), None, T0),
        &cursor(Some("b"), None, T0)
    ));
}

#[test]
fn example_10_string_sequences_compare_as_integers() {
    let candidate = parse_cursor_payload(&json!({"serverSequence": "12", "updatedAt": T0}))
        .unwrap()
        .unwrap();
    let current = parse_cursor_payload(&json!({"serverSequence": "9", "updatedAt": T0}))
        .unwrap()
        .unwrap();
    assert!(candidate.is_after(Some(&current)));
    let entry = cursor_from_sync_entry(&json!({"serverSequence": "12", "updatedAt": T0}));
    let older = cursor_from_sync_entry(&json!({"serverSequence": "9", "updatedAt": T0}));
    assert!(is_cursor_after(entry.as_ref(), older.as_ref()));
}

#[test]
fn example_11_mixed_iso_precisions_of_one_instant_are_equal() {
    let candidate = cursor(Some("a"), None, "2026-07-01T10:00:00Z");
    let current = cursor(Some("a"), None, "2026-07-01T10:00:00.000Z");
    assert!(!after(&candidate, &current));
    assert!(!after(&current, &candidate));
    assert_eq!(
        compare_cursors(Some(&candidate), Some(&current)),
        Ordering::Equal
    );
}

#[test]
fn example_12_numeric_looking_ids_compare_as_strings() {
    assert!(!after(
        &cursor(Some("10"), None, T0),
        &cursor(Some("9"), None, T0)
    ));
    assert!(after(
        &cursor(Some("9"), None, T0),
        &cursor(Some("10"), None, T0)
    ));
}

#[test]
fn a_null_id_orders_as_the_empty_string() {
    assert!(after(&cursor(Some("a"), None, T0), &cursor(None, None, T0)));
    assert_eq!(
        compare_cursors(
            Some(&cursor(Some(""), None, T0)),
            Some(&cursor(None, None, T0))
        ),
        Ordering::Equal
    );
}

#[test]
fn mixed_legacy_and_sequenced_cursors_can_cycle() {
    // The instant fallback between kinds (examples 7 and 8) admits no total order.
    let low_seq_late = cursor(Some("a"), Some(5), T2);
    let high_seq_early = cursor(Some("b"), Some(10), T0);
    let legacy_middle = cursor(None, None, T1);
    assert!(after(&high_seq_early, &low_seq_late));
    assert!(after(&legacy_middle, &high_seq_early));
    assert!(after(&low_seq_late, &legacy_middle));
}

#[test]
fn unparseable_timestamps_sort_after_every_instant_and_by_text_among_themselves() {
    let instant = cursor(None, None, "9999-12-31T23:59:59.999Z");
    let garbage = cursor(None, None, "{\"id\":\"a\"}");
    let other_garbage = cursor(None, None, "yesterday");
    assert!(after(&garbage, &instant));
    assert!(after(&other_garbage, &instant));
    // `{` (0x7B) sorts above `y` (0x79), as plain text comparison would have it.
    assert!(after(&garbage, &other_garbage));
}

// Scenario 1: cursor parse matrix (scope-sync.md, "Cursors").

#[test]
fn scenario_01_falsy_payloads_are_the_null_cursor() {
    for payload in [json!(null), json!(""), json!(0), json!(0.0), json!(false)] {
        assert_eq!(parse_cursor_payload(&payload), Ok(None), "{payload}");
    }
    assert_eq!(parse_cursor_text(""), None);
}

#[test]
fn scenario_01_a_raw_iso_string_is_a_legacy_cursor() {
    assert_eq!(
        parse_cursor_text(T0),
        Some(SyncCursor::legacy(T0.to_owned()))
    );
    assert_eq!(
        parse_cursor_payload(&json!(T0)),
        Ok(Some(SyncCursor::legacy(T0.to_owned())))
    );
}

#[test]
fn scenario_01_objects_with_numeric_or_string_sequences_parse_to_integers() {
    let expected = Some(cursor(Some("42"), Some(1234), T0));
    let numeric = format!(r#"{{"id":42,"serverSequence":1234,"updatedAt":"{T0}"}}"#);
    let string = format!(r#"{{"id":"42","serverSequence":"1234","updatedAt":"{T0}"}}"#);
    assert_eq!(parse_cursor_text(&numeric), expected);
    assert_eq!(parse_cursor_text(&string), expected);
    let object = json!({"id": 42, "serverSequence": "1234", "updatedAt": T0});
    assert_eq!(parse_cursor_payload(&object), Ok(expected));
}

#[test]
fn scenario_01_every_integer_spelling_of_a_sequence_is_accepted() {
    for (sequence, expected) in [
        (json!(" 7 "), 7),
        (json!("1e3"), 1000),
        (json!("0x10"), 16),
        (json!(0), 0),
        (json!(-3), -3),
        (json!(12.0), 12),
        (json!(9_007_199_254_740_993_i64), 9_007_199_254_740_993),
    ] {
        let payload = json!({"serverSequence": sequence, "updatedAt": T0});
        assert_eq!(
            parse_cursor_payload(&payload)
                .unwrap()
                .unwrap()
                .server_sequence,
            Some(expected),
            "{sequence}"
        );
    }
    let empty = json!({"serverSequence": "", "updatedAt": T0});
    assert_eq!(
        parse_cursor_payload(&empty)
            .unwrap()
            .unwrap()
            .server_sequence,
        None
    );
}

#[test]
fn scenario_01_a_big_sequence_in_cursor_text_is_read_exactly() {
    let text = format!(r#"{{"serverSequence":9007199254740993,"updatedAt":"{T0}"}}"#);
    assert_eq!(
        parse_cursor_text(&text).unwrap().server_sequence,
        Some(9_007_199_254_740_993)
    );
}

#[test]
fn scenario_01_without_updated_at_the_cursor_is_null() {
    assert_eq!(parse_cursor_text(r#"{"serverSequence":5}"#), None);
    assert_eq!(
        parse_cursor_payload(&json!({"serverSequence": 5})),
        Ok(None)
    );
    assert_eq!(parse_cursor_payload(&json!({"updatedAt": ""})), Ok(None));
    assert_eq!(parse_cursor_payload(&json!({"updatedAt": 17})), Ok(None));
    // The timestamp check comes first: a bad sequence beside no timestamp is no error.
    assert_eq!(
        parse_cursor_payload(&json!({"serverSequence": "abc"})),
        Ok(None)
    );
}

#[test]
fn scenario_01_a_string_holding_a_json_number_is_null() {
    assert_eq!(parse_cursor_text("1700000000"), None);
    assert_eq!(parse_cursor_text("true"), None);
    assert_eq!(parse_cursor_text("[1,2]"), None);
    assert_eq!(parse_cursor_payload(&json!([T0])), Ok(None));
    assert_eq!(parse_cursor_payload(&json!(17)), Ok(None));
}

#[test]
fn scenario_01_a_json_string_literal_is_a_legacy_cursor_of_its_content() {
    assert_eq!(
        parse_cursor_text("\"2026-07-01\""),
        Some(SyncCursor::legacy("2026-07-01".to_owned()))
    );
}

#[test]
fn scenario_01_a_bad_sequence_inside_a_string_makes_the_whole_text_legacy() {
    let text = format!(r#"{{"id":"a","serverSequence":"abc","updatedAt":"{T0}"}}"#);
    assert_eq!(
        parse_cursor_text(&text),
        Some(SyncCursor::legacy(text.clone()))
    );
    assert_eq!(
        parse_cursor_payload(&Value::String(text.clone())),
        Ok(Some(SyncCursor::legacy(text)))
    );
}

#[test]
fn scenario_01_a_bad_sequence_in_an_object_is_an_error() {
    let error = parse_cursor_payload(&json!({"id": "a", "serverSequence": "abc", "updatedAt": T0}))
        .unwrap_err();
    assert_eq!(
        error,
        CursorError::BadSequence {
            found: "string \"abc\"".to_owned()
        }
    );
    assert_eq!(
        error.to_string(),
        "expected serverSequence to be an integer or an integer string, got string \"abc\""
    );
    for bad in [json!(1.5), json!(true), json!("  "), json!({"n": 1})] {
        let payload = json!({"serverSequence": bad, "updatedAt": T0});
        assert!(matches!(
            parse_cursor_payload(&payload),
            Err(CursorError::BadSequence { .. })
        ));
    }
    let huge = json!({"serverSequence": "99999999999999999999", "updatedAt": T0});
    assert!(matches!(
        parse_cursor_payload(&huge),
        Err(CursorError::SequenceOutOfRange { .. })
    ));
}

#[test]
fn scenario_01_a_zero_sequence_is_kept_when_parsed() {
    let payload = json!({"serverSequence": 0, "updatedAt": T0});
    assert_eq!(
        parse_cursor_payload(&payload)
            .unwrap()
            .unwrap()
            .server_sequence,
        Some(0)
    );
}

#[test]
fn ids_are_stringified_and_structured_ids_rejected() {
    let numeric = json!({"id": 1.50, "updatedAt": T0});
    assert_eq!(
        parse_cursor_payload(&numeric)
            .unwrap()
            .unwrap()
            .id
            .as_deref(),
        Some("1.5")
    );
    let boolean = json!({"id": true, "updatedAt": T0});
    assert_eq!(
        parse_cursor_payload(&boolean)
            .unwrap()
            .unwrap()
            .id
            .as_deref(),
        Some("true")
    );
    let structured = json!({"id": [1], "updatedAt": T0});
    assert!(matches!(
        parse_cursor_payload(&structured),
        Err(CursorError::BadId { .. })
    ));
}

// Scenario 2: serializer asymmetry (scope-sync.md, "Cursors").

#[test]
fn scenario_02_client_params_omit_a_zero_or_null_sequence_but_keep_a_null_id() {
    for sequence in [Some(0), None] {
        let c = cursor(None, sequence, T0);
        let params = cursor_to_params(CursorPrefix::After, Some(&c), CursorParamsForm::Client);
        assert_eq!(
            Value::Object(params),
            json!({"afterId": null, "afterUpdatedAt": T0})
        );
    }
}

#[test]
fn scenario_02_server_params_keep_a_zero_sequence() {
    let c = cursor(None, Some(0), T0);
    let params = cursor_to_params(CursorPrefix::UpTo, Some(&c), CursorParamsForm::Server);
    assert_eq!(
        Value::Object(params),
        json!({"upToId": null, "upToServerSequence": 0, "upToUpdatedAt": T0})
    );
    let legacy = cursor(None, None, T0);
    let params = cursor_to_params(CursorPrefix::UpTo, Some(&legacy), CursorParamsForm::Server);
    assert!(!params.contains_key("upToServerSequence"));
}

#[test]
fn scenario_02_a_null_cursor_yields_no_params() {
    for form in [CursorParamsForm::Client, CursorParamsForm::Server] {
        assert!(cursor_to_params(CursorPrefix::After, None, form).is_empty());
    }
}

#[test]
fn cursor_params_come_in_id_sequence_timestamp_order() {
    let c = cursor(Some("42"), Some(1234), T0);
    let params = cursor_to_params(CursorPrefix::After, Some(&c), CursorParamsForm::Client);
    let keys: Vec<&str> = params.keys().map(String::as_str).collect();
    assert_eq!(keys, ["afterId", "afterServerSequence", "afterUpdatedAt"]);
    assert_eq!(params["afterServerSequence"], json!(1234));
}

#[test]
fn prefixes_and_forms_parse_from_their_js_names() {
    assert_eq!("upTo".parse(), Ok(CursorPrefix::UpTo));
    assert_eq!("after".parse(), Ok(CursorPrefix::After));
    assert!("before".parse::<CursorPrefix>().is_err());
    assert_eq!("server".parse(), Ok(CursorParamsForm::Server));
    assert_eq!(
        serde_json::to_value(CursorPrefix::UpTo).unwrap(),
        json!("upTo")
    );
    assert_eq!(
        serde_json::to_value(CursorParamsForm::Client).unwrap(),
        json!("client")
    );
}

// Entry cursors (scope-sync.md, "Cursors").

#[test]
fn entry_cursors_use_the_sync_row_id_not_the_resource_id() {
    let entry = json!({"id": 7, "resourceId": "r1", "serverSequence": "31", "updatedAt": T0});
    assert_eq!(
        cursor_from_sync_entry(&entry),
        Some(cursor(Some("7"), Some(31), T0))
    );
}

#[test]
fn entries_without_updated_at_have_no_cursor() {
    let bare = json!({"syncType": "update", "resourceId": "r1", "data": {}});
    assert_eq!(cursor_from_sync_entry(&bare), None);
    assert_eq!(cursor_from_sync_entry(&json!({"updatedAt": ""})), None);
    assert_eq!(cursor_from_sync_entry(&json!([T0])), None);
}

#[test]
fn an_entry_with_a_bad_sequence_still_has_a_legacy_cursor() {
    let entry = json!({"id": "a", "serverSequence": "abc", "updatedAt": T0});
    assert_eq!(
        cursor_from_sync_entry(&entry),
        Some(cursor(Some("a"), None, T0))
    );
}

// Edge cases (scope-sync.md, "Comparing cursors").

#[test]
fn rows_within_one_millisecond_are_ordered_by_sequence_alone() {
    assert!(after(
        &cursor(Some("a"), Some(2), T0),
        &cursor(Some("b"), Some(1), T0)
    ));
}

#[test]
fn equal_sequences_are_equal_whatever_their_timestamps_and_ids() {
    let a = cursor(Some("a"), Some(10), T0);
    let b = cursor(Some("b"), Some(10), T1);
    assert_eq!(compare_cursors(Some(&a), Some(&b)), Ordering::Equal);
    assert!(!after(&b, &a));
}

#[test]
fn second_precision_columns_and_millisecond_text_name_the_same_instant() {
    assert_eq!(
        instant_ms("2026-07-01T10:00:00.000Z"),
        instant_ms("2026-07-01T10:00:00Z")
    );
    assert_eq!(
        instant_ms("2026-07-01T10:00:00.1239Z"),
        instant_ms("2026-07-01T10:00:00.123Z")
    );
}

#[test]
fn instants_follow_the_ecmascript_date_time_format() {
    assert_eq!(instant_ms("1970-01-01T00:00:00.000Z"), Some(0));
    assert_eq!(
        instant_ms("2026-07-01T10:00:00.000Z"),
        Some(1_782_900_000_000)
    );
    assert_eq!(instant_ms("2026-07-01T12:00:00+02:00"), instant_ms(T0));
    assert_eq!(instant_ms("2026-07-01"), instant_ms("2026-07-01T00:00Z"));
    assert_eq!(instant_ms("2026-07"), instant_ms("2026-07-01"));
    assert_eq!(instant_ms("2026"), instant_ms("2026-01-01"));
    assert_eq!(instant_ms("2026-07-01T24:00"), instant_ms("2026-07-02"));
    assert_eq!(instant_ms("1969-12-31T23:59:59.999Z"), Some(-1));
    assert_eq!(instant_ms("+002026-07-01T10:00:00.000Z"), instant_ms(T0));
    assert_eq!(instant_ms("2024-02-29"), Some(1_709_164_800_000));
    for bad in [
        "",
        "226",
        "2026-13-01",
        "2026-02-29",
        "2026-07-01T10:00:60Z",
        "2026-07-01T24:00:01",
        "2026-07-01 10:00:00Z",
        "2026-07-01T10:00:00.Z",
        "2026-07-01T10Z",
        "-000000-01-01",
        "2026-07-01T10:00:00+0200",
        "2026-07-01T10:00:00.000Zx",
        "1700000000",
    ] {
        assert_eq!(instant_ms(bad), None, "{bad:?}");
    }
}

#[test]
fn cursors_serialize_to_the_persisted_camel_case_shape() {
    let c = cursor(Some("42"), None, T0);
    assert_eq!(
        c.to_json_text(),
        format!(r#"{{"id":"42","serverSequence":null,"updatedAt":"{T0}"}}"#)
    );
    let back: SyncCursor = serde_json::from_str(&c.to_json_text()).unwrap();
    assert_eq!(back, c);
    let lenient: SyncCursor =
        serde_json::from_value(json!({"id": 1, "serverSequence": "2", "updatedAt": T0})).unwrap();
    assert_eq!(lenient, cursor(Some("1"), Some(2), T0));
    let missing = serde_json::from_value::<SyncCursor>(json!({"serverSequence": 2}));
    assert!(missing
        .unwrap_err()
        .to_string()
        .contains("non-empty updatedAt"));
}

// Orderings.

fn timestamp() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "2026-07-01T10:00:00Z",
        "2026-07-01T10:00:00.000Z",
        "2026-07-01T12:00:00+02:00",
        "2026-07-01T10:00:00.5Z",
        "2026-07-01T10:00:01.000Z",
        "2026-07-01",
        "2025-12-31T23:59:59.999Z",
        "yesterday",
        "{\"id\":\"a\"}",
    ])
    .prop_map(str::to_owned)
}

fn id() -> impl Strategy<Value = Option<String>> {
    prop::option::of(prop::sample::select(vec!["", "a", "b", "10", "9"]).prop_map(str::to_owned))
}

fn sequenced() -> impl Strategy<Value = SyncCursor> {
    (id(), -3i64..6, timestamp()).prop_map(|(id, seq, at)| SyncCursor::new(id, Some(seq), at))
}

fn legacy() -> impl Strategy<Value = SyncCursor> {
    (id(), timestamp()).prop_map(|(id, at)| SyncCursor::new(id, None, at))
}

fn any_cursor() -> impl Strategy<Value = Option<SyncCursor>> {
    prop::option::of(prop_oneof![sequenced(), legacy()])
}

/// Checks the order is a total preorder on `cursors`.
fn assert_total_order(cursors: &[Option<SyncCursor>]) -> Result<(), TestCaseError> {
    for a in cursors {
        for b in cursors {
            let ab = compare_cursors(a.as_ref(), b.as_ref());
            prop_assert_eq!(ab, compare_cursors(b.as_ref(), a.as_ref()).reverse());
            prop_assert_eq!(
                ab == Ordering::Greater,
                is_cursor_after(a.as_ref(), b.as_ref())
            );
            for c in cursors {
                let bc = compare_cursors(b.as_ref(), c.as_ref());
                let ac = compare_cursors(a.as_ref(), c.as_ref());
                if ab != Ordering::Greater && bc != Ordering::Greater {
                    prop_assert_ne!(ac, Ordering::Greater, "{:?} {:?} {:?}", a, b, c);
                }
                if ab == Ordering::Equal && bc == Ordering::Equal {
                    prop_assert_eq!(ac, Ordering::Equal);
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn comparison_is_antisymmetric_and_reflexive(a in any_cursor(), b in any_cursor()) {
        prop_assert_eq!(
            compare_cursors(a.as_ref(), b.as_ref()),
            compare_cursors(b.as_ref(), a.as_ref()).reverse()
        );
        prop_assert_eq!(compare_cursors(a.as_ref(), a.as_ref()), Ordering::Equal);
        prop_assert!(!is_cursor_after(a.as_ref(), a.as_ref()));
    }

    #[test]
    fn sequenced_cursors_with_null_form_a_total_order(
        cursors in prop::collection::vec(prop::option::weighted(0.9, sequenced()), 3..6)
    ) {
        assert_total_order(&cursors)?;
    }

    #[test]
    fn legacy_cursors_with_null_form_a_total_order(
        cursors in prop::collection::vec(prop::option::weighted(0.9, legacy()), 3..6)
    ) {
        assert_total_order(&cursors)?;
    }

    #[test]
    fn mixed_cursors_form_a_total_order_when_sequences_follow_time(
        seqs in prop::collection::vec(0i64..20, 1..4),
        legacy_slots in prop::collection::vec((0i64..40, id()), 1..4),
    ) {
        // Sequence n sits at second 2n; legacy cursors at any second between.
        let at = |second: i64| format!("2026-07-01T10:{:02}:{:02}.000Z", second / 60, second % 60);
        let mut cursors: Vec<Option<SyncCursor>> = seqs
            .iter()
            .map(|&seq| Some(SyncCursor::new(Some(format!("s{seq}")), Some(seq), at(2 * seq))))
            .collect();
        cursors.extend(
            legacy_slots.into_iter().map(|(second, id)| Some(SyncCursor::new(id, None, at(second)))),
        );
        cursors.push(None);
        assert_total_order(&cursors)?;
    }

    #[test]
    fn order_agrees_with_sequence_order(a in sequenced(), b in sequenced()) {
        let (sa, sb) = (a.server_sequence, b.server_sequence);
        prop_assert_eq!(compare_cursors(Some(&a), Some(&b)), sa.cmp(&sb));
    }

    #[test]
    fn persisted_text_parses_back_to_the_same_cursor(
        id in id(), seq in prop::option::of(any::<i64>()), at in timestamp()
    ) {
        let c = SyncCursor::new(id, seq, at);
        prop_assert_eq!(parse_cursor_text(&c.to_json_text()), Some(c));
    }
}
