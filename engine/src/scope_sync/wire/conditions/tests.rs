use super::*;
use proptest::prelude::*;
use serde_json::json;

fn conditions(value: Value) -> Result<Conditions, ConditionError> {
    match value {
        Value::Object(map) => Conditions::parse(&map),
        _ => panic!("not an object"),
    }
}

fn row(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => panic!("not an object"),
    }
}

fn holds(conds: Value, data: Value) -> bool {
    conditions(conds).expect("valid").matches(&row(data))
}

#[test]
fn scalars_arrays_and_operator_objects_parse_into_tests() {
    let parsed = conditions(json!({
        "owner": "ada", "status": ["open", "doing"], "due": null,
        "priority": {"gte": 3, "lt": 10}, "assignee": {"ne": "bot", "isNull": false}
    }))
    .expect("valid");
    let tests: Vec<(&str, &Test)> = parsed.tests().collect();
    assert_eq!(
        tests,
        [
            ("assignee", &Test::Ne(json!("bot"))),
            ("assignee", &Test::IsNull(false)),
            ("due", &Test::IsNull(true)),
            ("owner", &Test::Eq(json!("ada"))),
            ("priority", &Test::Gte(json!(3))),
            ("priority", &Test::Lt(json!(10))),
            ("status", &Test::In(vec![json!("open"), json!("doing")])),
        ]
    );
    assert_eq!(parsed.routing_key(), Some(("owner", &json!("ada"))));
    assert_eq!(parsed.equality("priority"), None);
    let by_operator = conditions(json!({"b": {"eq": 1}, "a": {"in": [1]}})).expect("valid");
    assert_eq!(by_operator.routing_key(), Some(("b", &json!(1))));
    assert_eq!(
        conditions(json!({"a": {"gt": 1}}))
            .expect("valid")
            .routing_key(),
        None
    );
}

#[test]
fn malformed_conditions_are_refused_with_the_column_and_what_was_wrong() {
    let error = |value: Value| conditions(value).expect_err("refused").to_string();
    assert!(error(json!({"p": {"between": [1, 2]}})).contains("unknown operator \"between\""));
    assert!(error(json!({"p": {}})).contains("without operators"));
    assert!(error(json!({"p": {"gt": null}})).contains("\"p\".gt"));
    assert!(error(json!({"p": {"gt": [1]}})).contains("an array"));
    assert!(error(json!({"p": {"in": 1}})).contains("expected \"p\".in to be an array"));
    assert!(error(json!({"p": {"notIn": [{"a": 1}]}})).contains("an array holding an object"));
    assert!(error(json!({"p": [[1]]})).contains("an array holding an array"));
    assert!(error(json!({"p": {"isNull": "yes"}})).contains("true or false"));
    let many: Vec<u32> = (0..=MAX_LIST_VALUES as u32).collect();
    assert!(error(json!({"p": many})).contains("at most 1000"));
}

#[test]
fn comparisons_follow_the_row_values_type() {
    // Numbers numerically, whatever their JSON spelling.
    assert!(holds(json!({"n": {"gt": 9}}), json!({"n": 10})));
    assert!(holds(json!({"n": {"gt": "9"}}), json!({"n": 10})));
    assert!(holds(json!({"n": 5}), json!({"n": 5.0})));
    assert!(holds(json!({"n": {"lt": -1.5}}), json!({"n": -2})));
    assert!(holds(
        json!({"n": {"gt": 9_007_199_254_740_992_u64}}),
        json!({"n": 9_007_199_254_740_993_u64})
    ));
    // Text by code point: "10" < "9", "Z" < "a" < "é" < "😀".
    assert!(holds(json!({"t": {"lt": "9"}}), json!({"t": "10"})));
    assert!(holds(json!({"t": {"lt": 9}}), json!({"t": "10"})));
    assert!(holds(json!({"t": {"lt": "a"}}), json!({"t": "Z"})));
    assert!(holds(json!({"t": {"gt": "é"}}), json!({"t": "😀"})));
    assert!(holds(json!({"t": 5}), json!({"t": "5"})));
    // Booleans: false < true, "true" reads as true.
    assert!(holds(json!({"b": {"lt": true}}), json!({"b": false})));
    assert!(holds(json!({"b": "true"}), json!({"b": true})));
    // Timestamps are Unix milliseconds; an ISO operand is its instant.
    let noon = 1_764_590_400_000_i64; // 2025-12-01T12:00:00Z
    assert!(holds(
        json!({"at": {"gte": "2025-12-01T13:00:00+01:00"}}),
        json!({"at": noon})
    ));
    assert!(!holds(
        json!({"at": {"gt": "2025-12-01T12:00:00.000Z"}}),
        json!({"at": noon})
    ));
    // An operand that cannot be read as the column's type matches nothing, ne included.
    assert!(!holds(json!({"n": "high"}), json!({"n": 3})));
    assert!(!holds(json!({"n": {"ne": "high"}}), json!({"n": 3})));
    assert!(!holds(json!({"b": {"ne": 1}}), json!({"b": true})));
}

#[test]
fn null_passes_only_is_null() {
    for test in [
        json!({"eq": 1}),
        json!({"ne": 1}),
        json!({"in": [1]}),
        json!({"notIn": [1]}),
        json!({"lt": 1}),
        json!({"gte": 1}),
        json!({"isNull": false}),
    ] {
        assert!(!holds(json!({"c": test}), json!({"c": null})), "{test}");
        assert!(
            !holds(json!({"c": test}), json!({})),
            "{test} on a missing column"
        );
    }
    assert!(holds(json!({"c": null}), json!({"c": null})));
    assert!(holds(json!({"c": {"isNull": true}}), json!({})));
    assert!(!holds(json!({"c": null}), json!({"c": 0})));
    assert!(holds(json!({"c": {"isNull": false}}), json!({"c": ""})));
}

#[test]
fn lists_and_their_edges() {
    assert!(holds(json!({"s": ["a", "b"]}), json!({"s": "b"})));
    assert!(!holds(json!({"s": []}), json!({"s": "b"})));
    assert!(holds(json!({"s": {"notIn": []}}), json!({"s": "b"})));
    assert!(!holds(json!({"s": {"notIn": ["b"]}}), json!({"s": "b"})));
    assert!(holds(json!({"n": {"notIn": [1, 2]}}), json!({"n": 3})));
    // One operand of another type makes notIn unknown, so no match (SQL's NOT IN with NULL).
    assert!(!holds(json!({"n": {"notIn": [1, "x"]}}), json!({"n": 3})));
    assert!(holds(json!({"n": {"in": [1, "x", 3]}}), json!({"n": 3})));
}

#[test]
fn all_conditions_must_hold() {
    let conds = json!({"owner": "ada", "priority": {"gte": 3}});
    assert!(holds(conds.clone(), json!({"owner": "ada", "priority": 3})));
    assert!(!holds(
        conds.clone(),
        json!({"owner": "ada", "priority": 2})
    ));
    assert!(!holds(conds, json!({"owner": "bob", "priority": 5})));
    assert!(holds(json!({}), json!({"anything": 1})));
}

proptest! {
    /// On integers the operators are Rust's comparisons, ne and notIn are the negations of eq
    /// and in, and lt/gte split every value in two.
    #[test]
    fn integer_operators_are_the_comparisons(value in -50i64..50, a in -50i64..50, list in proptest::collection::vec(-50i64..50, 0..5)) {
        let data = json!({"n": value});
        prop_assert_eq!(holds(json!({"n": {"eq": a}}), data.clone()), value == a);
        prop_assert_eq!(holds(json!({"n": {"ne": a}}), data.clone()), value != a);
        prop_assert_eq!(holds(json!({"n": {"lt": a}}), data.clone()), value < a);
        prop_assert_eq!(holds(json!({"n": {"lte": a}}), data.clone()), value <= a);
        prop_assert_eq!(holds(json!({"n": {"gt": a}}), data.clone()), value > a);
        prop_assert_eq!(holds(json!({"n": {"gte": a}}), data.clone()), value >= a);
        prop_assert_eq!(holds(json!({"n": {"in": list}}), data.clone()), list.contains(&value));
        prop_assert_eq!(holds(json!({"n": {"notIn": list}}), data.clone()), !list.contains(&value));
        prop_assert_eq!(holds(json!({"n": {"gt": a, "lte": a + 10}}), data), value > a && value <= a + 10);
    }

    /// Text orders by code point, as Rust's `str` does.
    #[test]
    fn text_orders_by_code_point(value in "\\PC{0,4}", a in "\\PC{0,4}") {
        let data = json!({"t": value});
        prop_assert_eq!(holds(json!({"t": {"lt": a}}), data.clone()), value < a);
        prop_assert_eq!(holds(json!({"t": {"gte": a}}), data.clone()), value >= a);
        prop_assert_eq!(holds(json!({"t": a}), data), value == a);
    }
}
