use serde_json::{json, Number};

use super::*;
use crate::change_stream::IndexDirection;

/// A published column at `attnum`, nullable, with no default.
fn column(attnum: i64, data_type: &str) -> ColumnSpec {
    let mut spec = ColumnSpec::new(Number::from(attnum), data_type);
    spec.not_null = Some(Some(false));
    spec.dflt = Some(None);
    spec.extra.insert("attNum".into(), json!(attnum));
    spec
}

fn metadata(oid: u32, schema_oid: u32, key: &[(&str, i64)]) -> TableMetadata {
    let mut extra = serde_json::Map::new();
    extra.insert("schemaOID".into(), json!(schema_oid));
    extra.insert("relationOID".into(), json!(oid));
    TableMetadata {
        row_key: key
            .iter()
            .map(|&(name, attnum)| (name.to_owned(), json!({"attNum": attnum})))
            .collect(),
        extra,
    }
}

fn index(table: &str, name: &str, columns: &[&str], key: bool) -> IndexSpec {
    let mut extra = serde_json::Map::new();
    extra.insert("isPrimaryKey".into(), json!(key));
    extra.insert("isReplicaIdentity".into(), json!(false));
    IndexSpec {
        schema: "public".into(),
        name: name.into(),
        table_name: table.into(),
        unique: key,
        columns: columns
            .iter()
            .map(|c| ((*c).to_owned(), IndexDirection::Asc))
            .collect(),
        predicate: None,
        extra,
    }
}

/// Table `name` (upstream OID `oid`) keyed by `id`, with `columns` (name, attnum, type).
fn published(oid: u32, name: &str, columns: &[(&str, i64, &str)]) -> PublishedTable {
    let mut extra = serde_json::Map::new();
    extra.insert("oid".into(), json!(oid));
    PublishedTable {
        spec: TableSpec {
            schema: "public".into(),
            name: name.into(),
            columns: columns
                .iter()
                .map(|&(c, attnum, ty)| (c.to_owned(), column(attnum, ty)))
                .collect(),
            primary_key: Some(vec!["id".into()]),
            extra,
        },
        metadata: Some(metadata(oid, 2200, &[("id", 1)])),
        indexes: vec![index(name, &format!("{name}_pkey"), &["id"], true)],
        identity_columns: Vec::new(),
    }
}

/// The table as the replica holds it once it applied `table`'s `create-table`.
fn known(table: &PublishedTable) -> KnownTable {
    KnownTable {
        spec: table.spec.clone(),
        metadata: table.metadata.clone(),
    }
}

fn tags(changes: &[Change]) -> Vec<&'static str> {
    changes.iter().map(Change::tag).collect()
}

fn issue() -> PublishedTable {
    published(10, "issue", &[("id", 1, "int4"), ("t", 2, "text")])
}

#[test]
fn an_unchanged_schema_needs_nothing() {
    let t = issue();
    assert!(schema_changes(&[known(&t)], &[], &[t], "ALTER TABLE").is_empty());
}

#[test]
fn renames_are_told_from_drops_by_oid_and_attnum() {
    let before = issue();
    let after = published(10, "ticket", &[("id", 1, "int4"), ("title", 2, "text")]);
    let changes = schema_changes(&[known(&before)], &[], &[after], "ALTER TABLE");
    assert_eq!(tags(&changes), vec!["rename-table", "update-column"]);
    let Change::RenameTable(rename) = &changes[0] else {
        panic!("expected rename-table, got {changes:?}");
    };
    assert_eq!(
        (rename.old.name.as_str(), rename.new.name.as_str()),
        ("issue", "ticket")
    );
    let Change::UpdateColumn(update) = &changes[1] else {
        panic!("expected update-column, got {changes:?}");
    };
    assert_eq!(
        (update.old.name.as_str(), update.new.name.as_str()),
        ("t", "title")
    );
    assert_eq!(update.table.name, "ticket");
    // The column keeps its position in the replica.
    assert_eq!(update.new.spec.pos, Number::from(2));
}

#[test]
fn a_retyped_or_newly_not_null_column_is_an_update_column() {
    let before = issue();
    let mut after = issue();
    after.spec.columns["t"].data_type = "varchar".into();
    let changes = schema_changes(&[known(&before)], &[], &[after], "ALTER TABLE");
    assert_eq!(tags(&changes), vec!["update-column"]);
    let mut after = issue();
    after.spec.columns["t"].not_null = Some(Some(true));
    let changes = schema_changes(&[known(&before)], &[], &[after], "ALTER TABLE");
    assert_eq!(tags(&changes), vec!["update-column"]);
    // Another default alone changes nothing the replica keeps.
    let mut after = issue();
    after.spec.columns["t"].dflt = Some(Some("'x'::text".into()));
    assert!(schema_changes(&[known(&before)], &[], &[after], "ALTER TABLE").is_empty());
}

#[test]
fn a_column_dropped_and_re_added_under_its_name_is_a_drop_and_an_add() {
    let before = issue();
    let mut after = published(10, "issue", &[("id", 1, "int4"), ("t", 3, "int8")]);
    after.spec.columns["t"].dflt = Some(Some("0".into()));
    let changes = schema_changes(&[known(&before)], &[], &[after], "ALTER TABLE");
    assert_eq!(tags(&changes), vec!["drop-column", "add-column"]);
    let Change::AddColumn(add) = &changes[1] else {
        panic!("expected add-column, got {changes:?}");
    };
    // Existing rows got a constant default upstream: the replica applies it, no backfill.
    assert_eq!(add.column.spec.dflt, Some(Some("0".to_owned())));
    assert_eq!(add.backfill, None);
    assert_eq!(add.column.spec.pos, Number::from(3), "pos is the attnum");
}

/// The one `add-column` that adding `new` at attnum 3 to `issue` by `tag` gives.
fn added(new: ColumnSpec, identity: bool, tag: &str) -> AddColumn {
    let before = issue();
    let mut after = issue();
    after.spec.columns.insert("c".into(), new);
    if identity {
        after.identity_columns.push("c".into());
    }
    let changes = schema_changes(&[known(&before)], &[], &[after], tag);
    match changes.as_slice() {
        [Change::AddColumn(add)] => add.clone(),
        other => panic!("expected one add-column, got {:?}", tags(other)),
    }
}

#[test]
fn an_added_column_is_backfilled_unless_the_replica_reproduces_its_default() {
    let with_default = |data_type: &str, dflt: &str| {
        let mut c = column(3, data_type);
        c.dflt = Some(Some(dflt.into()));
        c
    };
    let cases = [
        ("timestamptz", "now()", None),
        ("int8", "nextval('issue_n_seq'::regclass)", None),
        ("date", "'2024-01-01'::date", None),
        ("int4", "5", Some("5")),
        ("bool", "true", Some("true")),
        ("text", "'open'::text", Some("'open'::text")),
    ];
    for (data_type, dflt, kept) in cases {
        let add = added(with_default(data_type, dflt), false, "ALTER TABLE");
        assert_eq!(
            add.column.spec.dflt,
            Some(kept.map(str::to_owned)),
            "{dflt}"
        );
        assert_eq!(
            add.backfill,
            kept.is_none().then(|| json!({"attNum": 3})),
            "{dflt}"
        );
        assert_eq!(
            add.table_metadata,
            Some(metadata(10, 2200, &[("id", 1)])),
            "{dflt}"
        );
    }
    // No default: nothing to backfill, nothing to apply.
    let plain = added(column(3, "text"), false, "ALTER TABLE");
    assert_eq!((plain.column.spec.dflt, plain.backfill), (Some(None), None));
    // An identity has no default expression, but existing rows got values.
    let identity = added(column(3, "int8"), true, "ALTER TABLE");
    assert_eq!(identity.backfill, Some(json!({"attNum": 3})));
    // A column that appears other than by ALTER TABLE is always backfilled, even a constant.
    let published = added(with_default("int4", "5"), false, "ALTER PUBLICATION");
    assert_eq!(published.column.spec.dflt, Some(None));
    assert_eq!(published.backfill, Some(json!({"attNum": 3})));
}

#[test]
fn columns_learned_from_relation_messages_are_matched_by_name_and_stay_before_new_ones() {
    // The replica learned `issue` from Relation messages: no OID, no attnums, and `tags` at a
    // position of its own after the others.
    let mut learned = known(&issue());
    learned.spec.extra.remove("oid");
    learned.metadata = None;
    for spec in learned.spec.columns.values_mut() {
        spec.extra.remove("attNum");
    }
    learned
        .spec
        .columns
        .insert("tags".into(), ColumnSpec::new(Number::from(7), "text[]"));
    let mut after = published(
        10,
        "issue",
        &[("id", 1, "int4"), ("t", 2, "text"), ("n", 3, "int4")],
    );
    after
        .spec
        .columns
        .insert("tags".into(), column(4, "text[]"));
    let changes = schema_changes(&[learned], &[], &[after], "ALTER TABLE");
    assert_eq!(tags(&changes), vec!["add-column"]);
    let Change::AddColumn(add) = &changes[0] else {
        panic!("expected add-column, got {changes:?}");
    };
    assert_eq!(add.column.name, "n");
    assert_eq!(add.column.spec.pos, Number::from(8));
}

#[test]
fn tables_new_to_the_publication_are_backfilled_but_created_tables_are_not() {
    let t = published(11, "label", &[("id", 1, "int4"), ("name", 3, "text")]);
    let backfill = |tag: &str| {
        let changes = schema_changes(&[], &[], std::slice::from_ref(&t), tag);
        // Zero's replicator creates the table without a key: the key index must follow.
        assert_eq!(
            tags(&changes),
            vec!["create-table", "create-index"],
            "{tag}"
        );
        let Change::CreateIndex(key) = &changes[1] else {
            panic!("expected create-index, got {changes:?}");
        };
        assert!(is_key_index(&key.spec));
        let Change::CreateTable(create) = &changes[0] else {
            panic!("expected create-table, got {changes:?}");
        };
        assert_eq!(create.spec, t.spec);
        assert_eq!(create.metadata, t.metadata);
        create.backfill.clone()
    };
    assert_eq!(backfill("CREATE TABLE"), None);
    let added = backfill("ALTER PUBLICATION").expect("a backfill");
    assert_eq!(
        added.into_iter().collect::<Vec<_>>(),
        vec![
            ("id".to_owned(), json!({"attNum": 1})),
            ("name".to_owned(), json!({"attNum": 3})),
        ]
    );
}

#[test]
fn a_changed_row_key_or_schema_is_an_update_table_metadata() {
    let before = issue();
    let mut moved = issue();
    moved.spec.schema = "app".into();
    moved.metadata = Some(metadata(10, 3000, &[("id", 1)]));
    let changes = schema_changes(&[known(&before)], &[], &[moved], "ALTER TABLE");
    assert_eq!(
        tags(&changes),
        vec!["rename-table", "update-table-metadata"]
    );
    let Change::UpdateTableMetadata(update) = &changes[1] else {
        panic!("expected update-table-metadata, got {changes:?}");
    };
    assert_eq!(update.old.extra["schemaOID"], json!(2200));
    assert_eq!(update.new.extra["schemaOID"], json!(3000));
    assert_eq!(update.table.schema, "app");
    // Metadata the replica never stored is not diffed.
    let mut unknown = known(&before);
    unknown.metadata = None;
    let mut moved = issue();
    moved.metadata = Some(metadata(10, 3000, &[("id", 1)]));
    assert!(schema_changes(&[unknown], &[], &[moved], "ALTER TABLE").is_empty());
}

#[test]
fn a_new_key_re_keys_the_table_through_its_index_as_the_replica_identity() {
    let before = issue();
    let mut after = issue();
    after.spec.primary_key = Some(vec!["t".into()]);
    after.indexes = vec![index("issue", "issue_t_key", &["t"], true)];
    let changes = schema_changes(&[known(&before)], &[], &[after.clone()], "ALTER TABLE");
    let [Change::CreateIndex(create)] = changes.as_slice() else {
        panic!("expected one create-index, got {changes:?}");
    };
    assert_eq!(create.spec.name, "issue_t_key");
    assert_eq!(create.spec.extra["isReplicaIdentity"], json!(true));
    // A key with no index over exactly its columns: nothing to re-key by.
    after.indexes = vec![index("issue", "issue_t_key", &["t", "id"], true)];
    assert!(schema_changes(&[known(&before)], &[], &[after], "ALTER TABLE").is_empty());
}

#[test]
fn dropped_tables_and_indexes_go_first_and_new_indexes_last() {
    let mut a = published(10, "a", &[("id", 1, "int4"), ("x", 2, "int4")]);
    a.indexes.push(index("a", "a_x", &["x"], false));
    let b = published(20, "b", &[("id", 1, "int4")]);
    let replica = [known(&a), known(&b)];
    let replica_indexes = [Identifier::new("public", "a_x")];
    // The replica holds the index it was told of: nothing to do.
    let same = schema_changes(&replica, &replica_indexes, &[a.clone(), b], "CREATE INDEX");
    assert!(same.is_empty(), "{same:?}");
    a.indexes[1].name = "a_x2".into();
    let c = published(30, "c", &[("id", 1, "int4")]);
    let changes = schema_changes(&replica, &replica_indexes, &[a, c], "DROP TABLE");
    assert_eq!(
        tags(&changes),
        vec![
            "drop-index",
            "drop-table",
            "create-table",
            "create-index",
            "create-index"
        ]
    );
    let names: Vec<String> = changes
        .iter()
        .map(|c| match c {
            Change::DropIndex(d) => d.id.name.clone(),
            Change::DropTable(d) => d.id.name.clone(),
            Change::CreateTable(t) => t.spec.name.clone(),
            Change::CreateIndex(i) => i.spec.name.clone(),
            other => other.tag().to_owned(),
        })
        .collect();
    assert_eq!(names, ["a_x", "b", "c", "c_pkey", "a_x2"]);
}

#[test]
fn a_table_without_an_oid_is_matched_by_name() {
    let mut learned = known(&issue());
    learned.spec.extra.remove("oid");
    // Still published under its name: kept (and nothing else changed).
    assert!(schema_changes(&[learned.clone()], &[], &[issue()], "ALTER TABLE").is_empty());
    // Gone from the publication: dropped, and a table under another name does not keep it.
    let other = published(10, "ticket", &[("id", 1, "int4")]);
    let changes = schema_changes(&[learned], &[], &[other], "ALTER PUBLICATION");
    assert_eq!(
        tags(&changes),
        vec!["drop-table", "create-table", "create-index"]
    );
}
