use serde_json::{json, Map, Value};

use super::*;

const RULES: &str = r#"{
  "tables": {
    "todos": {
      "filterColumns": ["owner", "done"],
      "omitColumns": ["secret_note"],
      "require": { "owner": "sub" }
    },
    "projects": { "filterColumns": ["org", "id"], "require": { "org": "org" } },
    "announcements": { "filterColumns": ["lang"] }
  }
}"#;

fn rules() -> SyncRules {
    SyncRules::from_json(RULES).expect("the example rules parse")
}

fn map(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        other => panic!("expected an object, got {other}"),
    }
}

#[test]
fn rules_parse_into_tables_filter_columns_and_requirements() {
    let rules = rules();
    let todos = rules.table("todos").expect("todos is readable");
    assert_eq!(todos.filter_columns(), ["owner", "done"]);
    assert_eq!(todos.omit_columns(), ["secret_note"]);
    assert_eq!(
        todos.require().get("owner").map(String::as_str),
        Some("sub")
    );
    assert!(todos.needs_claims());
    assert!(!rules.table("announcements").expect("listed").needs_claims());
    assert!(rules.table("users").is_none());
    let filters = rules.filter_columns();
    assert_eq!(
        filters.keys().map(String::as_str).collect::<Vec<_>>(),
        ["announcements", "projects", "todos"]
    );
    assert_eq!(filters["projects"], ["org", "id"]);
    assert_eq!(filters["announcements"], ["lang"]);
}

#[test]
fn bad_rules_files_are_typed_errors_naming_the_path() {
    let cases: &[(&str, &str)] = &[
        ("not json", "expected the rules to be JSON"),
        ("[]", "the rules: expected an object, got an array of 0 items"),
        ("{}", "the rules: expected a key \"tables\""),
        (r#"{"tables":{},"extra":1}"#, "the rules.extra: unknown key"),
        (r#"{"tables":[]}"#, "tables: expected an object, got an array"),
        (r#"{"tables":{"t":1}}"#, "tables.t: expected an object, got number 1"),
        (
            r#"{"tables":{"t":{"requires":{"owner":"sub"}}}}"#,
            "tables.t.requires: unknown key; expected one of \"filterColumns\"",
        ),
        (
            r#"{"tables":{"t":{"filterColumns":"owner"}}}"#,
            "tables.t.filterColumns: expected an array of column names, got string \"owner\"",
        ),
        (
            r#"{"tables":{"t":{"filterColumns":["owner",7]}}}"#,
            "tables.t.filterColumns[1]: expected a column name (a string), got number 7",
        ),
        (
            r#"{"tables":{"t":{"filterColumns":["owner","owner"]}}}"#,
            "tables.t.filterColumns[1]: column \"owner\" is listed twice",
        ),
        (
            r#"{"tables":{"t":{"filterColumns":[" owner"]}}}"#,
            "tables.t.filterColumns[0]: expected a non-blank name",
        ),
        (
            r#"{"tables":{"":{}}}"#,
            "tables: expected a non-blank name without surrounding spaces, got \"\"",
        ),
        (
            r#"{"tables":{"t":{"filterColumns":["a"],"omitColumns":["a"]}}}"#,
            "tables.t.omitColumns: column \"a\" is in omitColumns and filterColumns",
        ),
        (
            r#"{"tables":{"t":{"filterColumns":["a"],"require":{"owner":"sub"}}}}"#,
            "tables.t.require: column \"owner\" must equal a claim, so it must be listed in filterColumns",
        ),
        (
            r#"{"tables":{"t":{"filterColumns":["owner"],"require":{"owner":1}}}}"#,
            "tables.t.require.owner: expected a claim name (a string), got number 1",
        ),
        (
            r#"{"tables":{"t":{"filterColumns":["owner"],"require":{"owner":""}}}}"#,
            "tables.t.require.owner: expected a non-blank name",
        ),
        (
            r#"{"tables":{"t":{"require":[]}}}"#,
            "tables.t.require: expected an object, got an array of 0 items",
        ),
    ];
    for (text, expected) in cases {
        let error = SyncRules::from_json(text).expect_err(text).to_string();
        assert!(
            error.starts_with(expected),
            "rules {text}: expected an error starting {expected:?}, got {error:?}"
        );
    }
}

#[test]
fn an_empty_table_list_parses_and_allows_nothing() {
    let rules = SyncRules::from_json(r#"{"tables":{}}"#).expect("parses");
    let denial = rules
        .decide(&Map::new(), "todos", &Map::new(), None)
        .expect_err("nothing is readable");
    assert_eq!(denial.code, DenialCode::Forbidden);
}

/// The grant's table, or the denial's code and message prefix.
type Expected = Result<&'static str, (DenialCode, &'static str)>;

/// One row per decision: claims, table, conditions → the code, or the grant's table.
#[test]
fn decisions_follow_the_rules() {
    let rules = rules();
    let ada = json!({"sub": "ada", "org": 42});
    let cases: Vec<(Value, &str, Value, Expected)> = vec![
        (ada.clone(), "todos", json!({"owner": "ada"}), Ok("todos")),
        (ada.clone(), "todos", json!({"owner": "ada", "done": false}), Ok("todos")),
        (
            ada.clone(),
            "todos",
            json!({"owner": "grace"}),
            Err((DenialCode::Forbidden, "the condition \"owner\" must equal the token's \"sub\" claim")),
        ),
        (
            ada.clone(),
            "todos",
            json!({"done": true}),
            Err((DenialCode::Forbidden, "a scope of table \"todos\" must have the condition \"owner\"")),
        ),
        (
            ada.clone(),
            "todos",
            json!({}),
            Err((DenialCode::Forbidden, "a scope of table \"todos\" must have the condition \"owner\"")),
        ),
        (
            ada.clone(),
            "todos",
            json!({"owner": "ada", "secret_note": "x"}),
            Err((DenialCode::Forbidden, "table \"todos\" may not be filtered on column \"secret_note\"; allowed: owner, done")),
        ),
        (
            ada.clone(),
            "users",
            json!({"owner": "ada"}),
            Err((DenialCode::Forbidden, "the sync rules do not allow reading table \"users\"")),
        ),
        (
            json!({"org": 42}),
            "todos",
            json!({"owner": "ada"}),
            Err((DenialCode::Forbidden, "a scope of table \"todos\" needs a token with a scalar \"sub\" claim")),
        ),
        (
            json!({"sub": ["ada"]}),
            "todos",
            json!({"owner": "ada"}),
            Err((DenialCode::Forbidden, "a scope of table \"todos\" needs a token with a scalar \"sub\" claim")),
        ),
        (
            json!({"sub": null}),
            "todos",
            json!({"owner": "null"}),
            Err((DenialCode::Forbidden, "a scope of table \"todos\" needs a token with a scalar \"sub\" claim")),
        ),
        // String-form comparison: a numeric claim matches the same number sent as text.
        (ada.clone(), "projects", json!({"org": "42"}), Ok("projects")),
        (ada.clone(), "projects", json!({"org": 42, "id": 7}), Ok("projects")),
        (
            ada.clone(),
            "projects",
            json!({"org": 43}),
            Err((DenialCode::Forbidden, "the condition \"org\" must equal the token's \"org\" claim")),
        ),
        // A table without `require` needs no claims at all.
        (json!({}), "announcements", json!({"lang": "en"}), Ok("announcements")),
        (json!({}), "announcements", json!({}), Ok("announcements")),
        (
            ada.clone(),
            "",
            json!({}),
            Err((DenialCode::InvalidParams, "expected resourceType to name a table, got nothing")),
        ),
        // The require column needs an equality test: a list or a NULL test is no grant.
        (
            ada.clone(),
            "todos",
            json!({"owner": ["ada", "grace"]}),
            Err((DenialCode::Forbidden, "a scope of table \"todos\" must have the condition \"owner\" equal to the token's \"sub\" claim")),
        ),
        (
            ada.clone(),
            "todos",
            json!({"owner": null}),
            Err((DenialCode::Forbidden, "a scope of table \"todos\" must have the condition \"owner\" equal to the token's \"sub\" claim")),
        ),
        (
            ada.clone(),
            "todos",
            json!({"owner": {"ne": "x"}}),
            Err((DenialCode::Forbidden, "a scope of table \"todos\" must have the condition \"owner\" equal to the token's \"sub\" claim")),
        ),
        // Other tests may narrow a granted scope further.
        (ada.clone(), "todos", json!({"owner": {"eq": "ada", "ne": "bob"}, "done": {"ne": true}}), Ok("todos")),
        (ada.clone(), "announcements", json!({"lang": ["en", "fr"]}), Ok("announcements")),
        (
            ada.clone(),
            "todos",
            json!({"owner": {"$ne": "x"}}),
            Err((DenialCode::InvalidParams, "condition \"owner\" has the unknown operator \"$ne\"")),
        ),
        (
            ada.clone(),
            "todos",
            json!({"owner": [{"a": 1}]}),
            Err((DenialCode::InvalidParams, "expected \"owner\".in to be an array of strings")),
        ),
    ];
    for (claims, table, conditions, expected) in cases {
        let got = rules.decide(
            &map(claims.clone()),
            table,
            &map(conditions.clone()),
            Some(9),
        );
        match (&got, &expected) {
            (Ok(grant), Ok(expected_table)) => {
                assert_eq!(grant.table, *expected_table);
                assert_eq!(grant.expires_at_ms, Some(9));
            }
            (Err(denial), Err((code, message))) => {
                assert_eq!(denial.code, *code, "{claims} {table} {conditions}");
                assert!(
                    denial.message.starts_with(message),
                    "{claims} {table} {conditions}: expected {message:?}, got {:?}",
                    denial.message
                );
            }
            _ => panic!("{claims} {table} {conditions}: expected {expected:?}, got {got:?}"),
        }
    }
}

#[test]
fn a_grant_lists_the_omitted_columns_of_its_table() {
    let rules = rules();
    let claims = map(json!({"sub": "ada"}));
    let grant = rules
        .decide(&claims, "todos", &map(json!({"owner": "ada"})), None)
        .expect("allowed");
    assert_eq!(
        grant,
        Grant {
            table: "todos".to_owned(),
            omit_columns: vec!["secret_note".to_owned()],
            expires_at_ms: None,
            row_filter: None,
        }
    );
    let grant = rules
        .decide(&claims, "projects", &map(json!({"org": "1"})), None)
        .expect_err("org claim missing");
    assert_eq!(grant.code.as_str(), "forbidden");
}

#[test]
fn denial_codes_are_the_stable_wire_codes() {
    assert_eq!(DenialCode::Forbidden.as_str(), "forbidden");
    assert_eq!(DenialCode::InvalidParams.as_str(), "invalid-params");
}

#[test]
fn a_where_filter_is_parsed_at_load_bound_to_the_claims_and_indexed() {
    let rules = SyncRules::from_value(&json!({"tables": {"docs": {
        "filterColumns": ["priority"],
        "where": "(owner = auth.sub OR shared) AND deleted_at IS NULL"
    }}}))
    .expect("parses");
    let docs = rules.table("docs").expect("listed");
    assert!(docs.needs_claims(), "the filter reads auth.sub");
    assert_eq!(
        rules.filter_columns()["docs"],
        ["priority", "owner", "shared", "deleted_at"],
        "the filter's columns are indexed and kept in exits"
    );
    let grant = rules
        .decide(&map(json!({"sub": "ada"})), "docs", &Map::new(), None)
        .expect("granted");
    let filter = grant.row_filter.expect("bound");
    assert!(filter.matches(&map(json!({"owner": "ada"}))));
    assert!(filter.matches(&map(json!({"owner": "bob", "shared": true}))));
    assert!(!filter.matches(&map(json!({"owner": "bob", "shared": false}))));
    assert!(!filter.matches(&map(
        json!({"owner": "ada", "deleted_at": 1_764_590_400_000_i64})
    )));
    let denial = rules
        .decide(&map(json!({"org": 1})), "docs", &Map::new(), None)
        .expect_err("no sub claim");
    assert_eq!(denial.code, DenialCode::Forbidden);
    assert!(denial.message.contains("\"sub\""), "{denial}");

    for (filter, reason) in [
        ("lower(owner) = auth.sub", "functions (lower)"),
        (
            "project_id NOT IN (SELECT project_id FROM members)",
            "may only let rows in",
        ),
        ("owner = ", "Expected"),
    ] {
        let error = SyncRules::from_value(&json!({"tables": {"docs": {"where": filter}}}))
            .expect_err(filter)
            .to_string();
        assert!(
            error.starts_with("tables.docs.where: the row filter is refused")
                && error.contains(reason),
            "{filter}: {error}"
        );
    }
    let error = SyncRules::from_value(&json!({"tables": {"docs": {"where": 1}}}))
        .expect_err("not text")
        .to_string();
    assert!(error.contains("a SQL boolean expression"), "{error}");
}

#[test]
fn schema_problems_name_each_table_and_column_the_replica_lacks() {
    let rules = SyncRules::from_json(
        r#"{"tables": {
            "todos": {"filterColumns": ["owner", "ownr"], "omitColumns": ["secret"],
                      "require": {"ownr": "sub"}, "where": "done = false OR prio > 3"},
            "ghosts": {"filterColumns": ["id"]}
        }}"#,
    )
    .expect("rules");
    let columns_of = |table: &str| {
        (table == "todos").then(|| vec!["id".to_owned(), "owner".to_owned(), "done".to_owned()])
    };
    let problems = rules.schema_problems(columns_of);
    assert_eq!(
        problems,
        [
            r#"tables.ghosts: the replica has no table "ghosts" (is it in the publication?)"#,
            r#"tables.todos.filterColumns: todos has no column "ownr" (it has id, owner, done)"#,
            r#"tables.todos.omitColumns: todos has no column "secret" (it has id, owner, done)"#,
            r#"tables.todos.where: todos has no column "prio" (it has id, owner, done)"#,
        ]
    );
    let fitting = SyncRules::from_json(r#"{"tables": {"todos": {"filterColumns": ["owner"]}}}"#)
        .expect("rules");
    assert!(fitting.schema_problems(columns_of).is_empty());
}

const WRITE_RULES: &str = r#"{
  "tables": {
    "todos": {
      "filterColumns": ["owner", "done"],
      "omitColumns": ["secret_note"],
      "require": { "owner": "sub" },
      "write": { "insert": true, "update": ["title", "done"], "delete": false }
    },
    "docs": { "where": "org = auth.org AND NOT archived", "write": { "update": true } },
    "announcements": { "filterColumns": ["lang"] }
  }
}"#;

#[test]
fn write_rules_say_which_operations_and_columns_a_table_takes() {
    assert!(!rules().allows_writes(), "no write key: read-only");
    let rules = SyncRules::from_json(WRITE_RULES).unwrap();
    assert!(rules.allows_writes());
    let ada = map(json!({"sub": "ada", "org": 7}));
    let key = ["id".to_owned()];
    let decide = |table: &str, op: MutationOp, columns: &[&str]| {
        rules
            .decide_write(&ada, table, op, columns.iter().copied(), &key)
            .map(|_| ())
            .map_err(|denial| (denial.code.as_str(), denial.message))
    };
    assert_eq!(
        decide("todos", MutationOp::Insert, &["id", "owner", "title"]),
        Ok(())
    );
    assert_eq!(decide("todos", MutationOp::Update, &["id", "done"]), Ok(()));
    let (code, message) = decide("todos", MutationOp::Update, &["id", "owner"]).unwrap_err();
    assert_eq!(code, "forbidden");
    assert_eq!(
        message,
        "an update of \"todos\" may not set column \"owner\"; allowed: title, done"
    );
    assert_eq!(
        decide("todos", MutationOp::Delete, &["id"]).unwrap_err().1,
        "the sync rules do not allow deletes from \"todos\""
    );
    assert_eq!(
        decide("announcements", MutationOp::Insert, &["id"])
            .unwrap_err()
            .1,
        "the sync rules do not allow inserts into \"announcements\""
    );
    assert_eq!(
        decide("secrets", MutationOp::Insert, &["id"])
            .unwrap_err()
            .1,
        "the sync rules do not allow writing table \"secrets\""
    );
    assert_eq!(
        decide("todos", MutationOp::Update, &["title"]).unwrap_err(),
        (
            "invalid-params",
            "an update of \"todos\" must name its key column \"id\"".to_owned()
        )
    );
    assert_eq!(
        decide("docs", MutationOp::Update, &["id", "archived", "body"]),
        Ok(())
    );
    // A token without the claim the rules read.
    let anonymous = Map::new();
    let denial = rules
        .decide_write(&anonymous, "todos", MutationOp::Insert, ["id"], &key)
        .unwrap_err();
    assert_eq!(
        denial.message,
        "a write to \"todos\" needs a token with a scalar \"sub\" claim"
    );
}

#[test]
fn a_write_grant_admits_only_rows_the_writer_may_read() {
    let rules = SyncRules::from_json(WRITE_RULES).unwrap();
    let ada = map(json!({"sub": "ada", "org": 7}));
    let key = ["id".to_owned()];
    let todos = rules
        .decide_write(&ada, "todos", MutationOp::Update, ["id", "title"], &key)
        .unwrap();
    assert!(todos.admits(&map(json!({"id": 1, "owner": "ada"}))));
    assert!(
        !todos.admits(&map(json!({"id": 1, "owner": "grace"}))),
        "another user's row"
    );
    assert!(!todos.admits(&map(json!({"id": 1, "owner": null}))));
    assert_eq!(
        todos.visible(map(json!({"id": 1, "owner": "ada", "secret_note": "x"}))),
        map(json!({"id": 1, "owner": "ada"}))
    );
    let docs = rules
        .decide_write(&ada, "docs", MutationOp::Update, ["id", "body"], &key)
        .unwrap();
    assert!(docs.admits(&map(json!({"org": 7, "archived": false}))));
    assert!(
        !docs.admits(&map(json!({"org": 7, "archived": true}))),
        "moved out of reach"
    );
    assert!(!docs.admits(&map(json!({"org": 8, "archived": false}))));
}

#[test]
fn a_write_grant_with_a_subquery_asks_for_the_sets_only_when_the_row_leaves_it_open() {
    let rules = SyncRules::from_value(&json!({"tables": {
        "todos": {
            "filterColumns": ["org"],
            "require": {"org": "org"},
            "where": "(project_id IN (SELECT project_id FROM members WHERE user_id = auth.sub) \
                      OR owner = auth.sub) AND NOT archived",
            "write": {"insert": true, "update": true},
        },
    }}))
    .expect("loads");
    let ada = map(json!({"sub": "ada", "org": 7}));
    let grant = rules
        .decide_write(
            &ada,
            "todos",
            MutationOp::Insert,
            ["id"],
            &["id".to_owned()],
        )
        .expect("granted");
    let admission = |row: Value| grant.admission(&map(row));
    // Decided by the row: her own todo, an archived one, another org's.
    assert_eq!(
        admission(json!({"org": 7, "owner": "ada", "project_id": 1, "archived": false})),
        Admission::Decided(true)
    );
    assert_eq!(
        admission(json!({"org": 7, "owner": "bob", "project_id": 1, "archived": true})),
        Admission::Decided(false)
    );
    assert_eq!(
        admission(json!({"org": 8, "owner": "ada", "project_id": 1, "archived": false})),
        Admission::Decided(false)
    );
    // Another user's todo: only her memberships can say.
    let Admission::ReadSets(filter) =
        admission(json!({"org": 7, "owner": "bob", "project_id": 1, "archived": false}))
    else {
        panic!("the sets decide it")
    };
    assert_eq!(filter.set_tables(), ["members"]);
    assert!(
        !grant.admits(&map(
            json!({"org": 7, "owner": "bob", "project_id": 1, "archived": false})
        )),
        "not from the row alone"
    );
    // A filter without subqueries never asks: unknown is no.
    let plain = SyncRules::from_value(&json!({"tables": {
        "docs": {"where": "owner = auth.sub", "write": {"insert": true}},
    }}))
    .expect("loads")
    .decide_write(&ada, "docs", MutationOp::Insert, ["id"], &["id".to_owned()])
    .expect("granted");
    assert_eq!(
        plain.admission(&map(json!({"owner": null}))),
        Admission::Decided(false)
    );
}

#[test]
fn malformed_write_rules_are_refused_with_their_place() {
    for (rules, message) in [
        (
            r#"{"tables":{"t":{"write":{"insert":"yes"}}}}"#,
            "tables.t.write.insert: expected true or false, got string \"yes\"",
        ),
        (
            r#"{"tables":{"t":{"write":{"upsert":true}}}}"#,
            "tables.t.write.upsert: unknown key; expected one of \"insert\", \"update\", \"delete\"",
        ),
        (
            r#"{"tables":{"t":{"write":{"update":"title"}}}}"#,
            "tables.t.write.update: expected true, false or a list of columns, got string \"title\"",
        ),
    ] {
        assert_eq!(SyncRules::from_json(rules).unwrap_err().to_string(), message);
    }
    let rules = SyncRules::from_json(r#"{"tables":{"t":{"write":{"update":["titel"]}}}}"#).unwrap();
    assert_eq!(
        rules.schema_problems(|_| Some(vec!["id".to_owned(), "title".to_owned()])),
        ["tables.t.write.update: t has no column \"titel\" (it has id, title)"]
    );
}

#[test]
fn subqueries_reach_rows_through_membership_tables_and_their_tables_join_the_feed() {
    let rules = SyncRules::from_value(&json!({"tables": {
        "projects": {"where": "id IN (SELECT project_id FROM members WHERE user_id = auth.sub)"},
        "comments": {"where": "todo_id IN (SELECT id FROM todos WHERE project_id IN \
            (SELECT project_id FROM members WHERE user_id = auth.sub)) OR author = auth.sub"},
    }}))
    .expect("loads");
    // The tables the subqueries read are in the feed (members is not readable), with the
    // columns the sets are kept by.
    let columns = rules.filter_columns();
    assert_eq!(columns["members"], ["project_id", "user_id"]);
    assert_eq!(columns["todos"], ["id", "project_id"]);
    assert_eq!(columns["comments"], ["todo_id", "author"]);
    assert!(rules.table("members").is_none(), "members stays unreadable");
    assert!(rules
        .table("comments")
        .is_some_and(TableRules::needs_claims));

    let grant = rules
        .decide(&map(json!({"sub": "ada"})), "comments", &Map::new(), None)
        .expect("granted");
    let filter = grant.row_filter.expect("a filter");
    assert_eq!(filter.set_tables(), ["todos", "members"]);
    let sets = filter.sets();
    assert_eq!(sets.len(), 1);
    let (column, todos, top) = sets[0];
    // Under OR: a todo leaving the set does not take every comment of it out.
    assert_eq!(
        (column, todos.table.as_str(), top),
        ("todo_id", "todos", false)
    );
    assert_eq!(
        todos.to_string(),
        "(SELECT \"id\" FROM \"todos\" WHERE (\"project_id\" IN (SELECT \"project_id\" FROM \
         \"members\" WHERE (\"user_id\" Eq(String(\"ada\"))))))"
    );
    // Bound to another token, the same subquery is another set.
    let grace = rules
        .decide(&map(json!({"sub": "grace"})), "comments", &Map::new(), None)
        .expect("granted")
        .row_filter
        .expect("a filter");
    assert_ne!(grace.sets()[0].1.to_string(), todos.to_string());
    // Without sets, a subquery's test is unknown: a write check must answer it elsewhere.
    assert_eq!(
        filter.eval(&map(json!({"todo_id": 1, "author": "bob"}))),
        None
    );
    assert_eq!(
        filter.eval(&map(json!({"todo_id": 1, "author": "ada"}))),
        Some(true)
    );

    // Rules naming a subquery's table or column the replica lacks are refused at start.
    let problems = rules.schema_problems(|table| match table {
        "projects" | "comments" => Some(vec!["id".into(), "todo_id".into(), "author".into()]),
        "members" => Some(vec!["project_id".into(), "user".into()]),
        _ => None,
    });
    assert!(
        problems.iter().any(|p| p.contains("reads table \"todos\"")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("tables.projects.where")
                && p.contains("column \"user_id\" of members")),
        "{problems:?}"
    );
}
