use super::*;
use crate::scope_sync::rules::row_filter::{RowFilter, RuleFilter};
use crate::scope_sync::Conditions;
use serde_json::json;

fn values(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("expected an object, got {other}"),
    }
}

fn row(id: &str, scope: Value) -> ScopedRow {
    ScopedRow {
        resource_id: id.to_owned(),
        values: values(scope),
    }
}

fn exit(id: &str, seq: i64, old: Value, new: Option<Value>, journal: bool) -> Exit {
    Exit {
        table: "todos".to_owned(),
        resource_id: id.to_owned(),
        seq,
        old: values(old),
        new: new.map(values),
        journal,
    }
}

#[test]
fn an_update_that_changes_a_scope_column_exits_at_the_rows_seq_with_old_and_new_values() {
    let change = RowChange::Updated {
        before: Some(row("1", json!({"owner": "ada", "done": false}))),
        after: Some((row("1", json!({"owner": "bob", "done": false})), 7)),
        seqs: 7..8,
    };
    assert_eq!(
        exits("todos", change),
        [exit(
            "1",
            7,
            json!({"owner": "ada", "done": false}),
            Some(json!({"owner": "bob", "done": false})),
            true
        )]
    );
}

#[test]
fn an_update_that_changes_no_scope_column_records_no_exit() {
    let change = RowChange::Updated {
        before: Some(row("1", json!({"owner": "ada"}))),
        after: Some((row("1", json!({"owner": "ada"})), 7)),
        seqs: 7..8,
    };
    assert_eq!(exits("todos", change), []);
}

#[test]
fn a_key_change_exits_the_old_key_at_its_tombstone_seq_without_new_values() {
    // The row took 7 under its new key; the old key's tombstone took 8.
    let change = RowChange::Updated {
        before: Some(row("1", json!({"owner": "ada"}))),
        after: Some((row("2", json!({"owner": "ada"})), 7)),
        seqs: 7..9,
    };
    assert_eq!(
        exits("todos", change),
        [exit("1", 8, json!({"owner": "ada"}), None, true)]
    );
    // Nothing under the new key to compare with: the row is gone under the old one.
    let change = RowChange::Updated {
        before: Some(row("1", json!({"owner": "ada"}))),
        after: None,
        seqs: 7..9,
    };
    assert_eq!(
        exits("todos", change),
        [exit("1", 8, json!({"owner": "ada"}), None, true)]
    );
}

#[test]
fn a_delete_exits_at_its_tombstone_seq() {
    let change = RowChange::Deleted {
        before: Some(row("4", json!({"owner": "ada"}))),
        seqs: 12..13,
    };
    assert_eq!(
        exits("todos", change),
        [exit("4", 12, json!({"owner": "ada"}), None, true)]
    );
}

#[test]
fn a_truncate_exits_every_row_at_its_marker_seq_unjournalled() {
    let change = RowChange::Truncated {
        rows: vec![
            row("1", json!({"owner": "ada"})),
            row("2", json!({"owner": "bob"})),
        ],
        marker: 20,
    };
    assert_eq!(
        exits("todos", change),
        [
            exit("1", 20, json!({"owner": "ada"}), None, false),
            exit("2", 20, json!({"owner": "bob"}), None, false),
        ]
    );
    let empty = RowChange::Truncated {
        rows: Vec::new(),
        marker: 20,
    };
    assert_eq!(exits("todos", empty), []);
}

#[test]
fn a_change_to_a_row_not_held_or_that_took_no_seq_records_no_exit() {
    let moved = || Some((row("1", json!({"owner": "bob"})), 7));
    for change in [
        RowChange::Updated {
            before: None,
            after: moved(),
            seqs: 7..8,
        },
        RowChange::Deleted {
            before: None,
            seqs: 7..8,
        },
        RowChange::Updated {
            before: Some(row("1", json!({"owner": "ada"}))),
            after: moved(),
            seqs: 7..7,
        },
        RowChange::Deleted {
            before: Some(row("1", json!({"owner": "ada"}))),
            seqs: 7..7,
        },
    ] {
        assert_eq!(exits("todos", change.clone()), [], "{change:?}");
    }
}

fn upsert(id: &str, seq: i64) -> FeedEntry {
    FeedEntry {
        table: "todos".to_owned(),
        resource_id: id.to_owned(),
        seq,
        updated_at: "1970-01-01T00:00:00.000Z".to_owned(),
        change: FeedChange::Upsert {
            data: values(json!({"id": id})),
        },
    }
}

/// (resource id, seq, whether an exit) of each entry.
fn order(entries: &[FeedEntry]) -> Vec<(&str, i64, bool)> {
    entries
        .iter()
        .map(|e| {
            (
                e.resource_id.as_str(),
                e.seq,
                matches!(e.change, FeedChange::Exit { .. }),
            )
        })
        .collect()
}

#[test]
fn a_commits_entries_ascend_by_seq_with_an_exit_after_the_row_write_of_its_seq() {
    const AT: &str = "2026-12-01T12:00:00.123Z";
    // Rows as a replica hands them back (any order), exits as they were recorded: row 1 moved
    // out of a scope at 5, row 3 was deleted at 7, a truncate at 9 took rows 8 and 6.
    let rows = vec![upsert("2", 6), upsert("1", 5)];
    let exits = vec![
        exit(
            "1",
            5,
            json!({"owner": "ada"}),
            Some(json!({"owner": "bob"})),
            true,
        ),
        exit("3", 7, json!({"owner": "ada"}), None, true),
        exit("8", 9, json!({"owner": "ada"}), None, false),
        exit("6", 9, json!({"owner": "bob"}), None, false),
    ];
    let entries = commit_entries(rows, exits, AT);
    assert_eq!(
        order(&entries),
        [
            ("1", 5, false),
            ("1", 5, true),
            ("2", 6, false),
            ("3", 7, true),
            ("8", 9, true),
            ("6", 9, true),
        ]
    );
    assert!(entries.iter().all(|e| e.updated_at == AT), "{entries:?}");
    // An exit given before the row write of its seq still sorts after it.
    let mut given = vec![
        exit("1", 5, json!({}), Some(json!({})), true).into_entry(AT),
        upsert("1", 5),
    ];
    sort_entries(&mut given);
    assert_eq!(order(&given), [("1", 5, false), ("1", 5, true)]);
}

fn conditions(value: Value) -> Conditions {
    Conditions::parse(&values(value)).expect("valid conditions")
}

fn filter(text: &str) -> RowFilter {
    RuleFilter::parse(text)
        .expect("parses")
        .bind(&Map::new())
        .expect("binds")
}

/// Whether the exit from `old` to `new` leaves the scope of `conditions` and `row_filter`.
fn leaves(
    conditions: &Conditions,
    row_filter: Option<&RowFilter>,
    old: Value,
    new: Option<Value>,
) -> bool {
    let (old, new) = (values(old), new.map(values));
    exit_leaves(&old, new.as_ref(), |values| {
        if !conditions.matches(values) {
            return Some(false);
        }
        row_filter.map_or(Some(true), |f| f.eval(values))
    })
}

#[test]
fn a_page_carries_an_exit_whose_old_values_passed_the_scope_and_new_ones_do_not() {
    let ada = conditions(json!({"owner": "ada"}));
    let old = || json!({"owner": "ada", "done": false});
    assert!(leaves(
        &ada,
        None,
        old(),
        Some(json!({"owner": "bob", "done": false}))
    ));
    assert!(leaves(&ada, None, old(), None), "gone under its key");
    assert!(
        !leaves(
            &ada,
            None,
            old(),
            Some(json!({"owner": "ada", "done": true}))
        ),
        "still in: another scope column changed"
    );
    assert!(
        !leaves(&ada, None, json!({"owner": "bob"}), None),
        "never in the scope"
    );

    // Through a row filter, the filter and the conditions together.
    let open = filter("done = false AND points > 2");
    let f = Some(&open);
    let all = Conditions::default();
    let old = || json!({"owner": "ada", "done": false, "points": 3});
    assert!(leaves(
        &all,
        f,
        old(),
        Some(json!({"done": true, "points": 3}))
    ));
    assert!(leaves(
        &all,
        f,
        old(),
        Some(json!({"done": false, "points": 1}))
    ));
    assert!(!leaves(
        &all,
        f,
        old(),
        Some(json!({"done": false, "points": 5}))
    ));
    assert!(!leaves(&all, f, json!({"done": true, "points": 3}), None));
    assert!(
        !leaves(
            &ada,
            f,
            json!({"owner": "bob", "done": false, "points": 3}),
            None
        ),
        "the filter passed, the conditions did not"
    );

    // Unknown answers: a NULL in the new values cannot keep the row in, a NULL in the old ones
    // never had it in.
    assert!(leaves(
        &all,
        f,
        old(),
        Some(json!({"done": false, "points": null}))
    ));
    assert!(leaves(&all, f, old(), Some(json!({"done": false}))));
    assert!(!leaves(&all, f, json!({"done": null, "points": 3}), None));
    let negated = filter("NOT (points > 2)");
    assert!(leaves(
        &all,
        Some(&negated),
        json!({"points": 1}),
        Some(json!({"points": null}))
    ));

    // A scope of the whole table: only rows gone under their key left it.
    assert!(leaves(&all, None, json!({"owner": "ada"}), None));
    assert!(!leaves(
        &all,
        None,
        json!({"owner": "ada"}),
        Some(json!({"owner": "bob"}))
    ));
}

#[test]
fn exit_leaves_asks_of_the_new_values_only_when_the_old_ones_passed() {
    // Answers a database computed: the old values' answer, then the new values'.
    let asked = std::cell::RefCell::new(Vec::new());
    let ask = |answer: Option<bool>| {
        asked.borrow_mut().push(answer);
        answer
    };
    assert!(!exit_leaves(None, Some(Some(true)), ask));
    assert!(!exit_leaves(Some(false), Some(Some(false)), ask));
    assert_eq!(
        asked.take(),
        [None, Some(false)],
        "the new values were not asked about"
    );
    assert!(exit_leaves(Some(true), Some(None), ask));
    assert!(exit_leaves(Some(true), Some(Some(false)), ask));
    assert!(!exit_leaves(Some(true), Some(Some(true)), ask));
    assert!(exit_leaves(Some(true), None, ask));
    assert_eq!(asked.take().len(), 7);
}

#[test]
fn a_page_merges_rows_and_exits_in_feed_order_up_to_its_limit() {
    let gone = |id: &str, seq: i64| exit(id, seq, json!({}), None, true).into_entry("t");
    let rows = vec![upsert("1", 2), upsert("2", 4), upsert("3", 6)];
    let exits = vec![gone("7", 3), gone("2", 4), gone("8", 5)];
    assert_eq!(
        order(&page_entries(rows.clone(), exits.clone(), 4)),
        [
            ("1", 2, false),
            ("7", 3, true),
            ("2", 4, false),
            ("2", 4, true)
        ]
    );
    assert_eq!(order(&page_entries(rows.clone(), exits, 10)).len(), 6);
    assert_eq!(
        order(&page_entries(rows, Vec::new(), 2)),
        [("1", 2, false), ("2", 4, false)]
    );
}
