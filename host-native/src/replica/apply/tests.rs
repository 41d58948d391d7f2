use super::*;
use highwater_engine::change_stream::{
    ColumnDef, ColumnSpec, Delete, IndexDirection, IndexSpec, Insert, NewRelation, PgTypeClass,
    ReplicaIdentity, RowKey, TableMetadata, TableSpec, Update,
};
use highwater_engine::watermark::Lsn;
use indexmap::IndexMap;
use serde_json::{json, Number};

fn spec(schema: &str, name: &str, cols: &[(&str, &str)], key: &[&str]) -> TableSpec {
    let mut columns = IndexMap::new();
    for (i, (c, t)) in cols.iter().enumerate() {
        let mut s = ColumnSpec::new(Number::from(i as i64 + 1), *t);
        s.pg_type_class = Some(PgTypeClass::Base);
        columns.insert((*c).to_owned(), s);
    }
    TableSpec {
        schema: schema.into(),
        name: name.into(),
        columns,
        primary_key: Some(key.iter().map(|k| (*k).to_owned()).collect()),
        extra: serde_json::Map::new(),
    }
}

fn writer() -> ReplicaWriter {
    let mut replica = Replica::open_in_memory().unwrap();
    let version = Lsn(0x100).to_watermark();
    replica
        .store_initial_state(&ReplicaState {
            replica_version: version.clone(),
            watermark: version,
            lsn: Lsn(0x100),
            publications: vec!["pub".into()],
            slot: "slot".into(),
            app_id: "highwater".into(),
            next_seq: 1,
        })
        .unwrap();
    let mut writer = ReplicaWriter::new(replica);
    let mut tables = std::mem::take(&mut writer.replica.tables);
    let issue = spec(
        "public",
        "issue",
        &[("id", "int8"), ("title", "text"), ("meta", "jsonb")],
        &["id"],
    );
    create_replica_table(
        &writer.replica.conn,
        &mut tables,
        ReplicaTable::from_spec(&issue),
    )
    .unwrap();
    writer.replica.tables = tables;
    writer
}

fn rel(name: &str, key: &[&str], identity: ReplicaIdentity) -> Relation {
    Relation::new(
        "public",
        name,
        RowKey::new(
            key.iter().map(|k| (*k).to_owned()).collect(),
            Some(identity),
        ),
    )
}

fn row(v: Value) -> Row {
    match v {
        Value::Object(map) => map,
        _ => panic!("not an object"),
    }
}

fn insert(id: i64, title: &str) -> Change {
    Change::Insert(Insert {
        relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
        new: row(json!({"id": id, "title": title, "meta": null})),
        extra: Default::default(),
    })
}

fn txn(writer: &mut ReplicaWriter, lsn: u64, changes: Vec<Change>) -> Applied {
    let wm = Lsn(lsn).to_watermark();
    writer
        .apply(&DownstreamMessage::Begin(Begin::new(wm.clone())))
        .unwrap();
    for c in changes {
        writer.apply(&DownstreamMessage::Data(c)).unwrap();
    }
    writer
        .apply(&DownstreamMessage::Commit(Commit::new(wm)))
        .unwrap()
}

fn add_column(name: &str, data_type: &str, dflt: &str, backfill: bool) -> Change {
    let mut spec = ColumnSpec::new(Number::from(9), data_type);
    spec.pg_type_class = Some(PgTypeClass::Base);
    spec.dflt = Some(Some(dflt.to_owned()));
    Change::AddColumn(AddColumn {
        table: Identifier::new("public", "issue"),
        column: ColumnDef {
            name: name.into(),
            spec,
            extra: Default::default(),
        },
        table_metadata: Some(TableMetadata {
            row_key: json!({"id": {"attNum": 1}}).as_object().unwrap().clone(),
            extra: json!({"relationOID": 7}).as_object().unwrap().clone(),
        }),
        backfill: backfill.then(|| json!({"attNum": 9})),
        extra: Default::default(),
    })
}

/// A constant default without a backfill is what existing rows hold upstream (Zero's
/// change source sends `DEFAULT 5` this way): the replica must not leave them NULL, and
/// subscribers catching up by sequence must see them change.
#[test]
fn an_added_column_without_backfill_takes_its_default_on_existing_rows() {
    let mut w = writer();
    txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
    let seq_before: i64 = w
        .replica()
        .connection()
        .query_row(r#"SELECT max("_hw_seq") FROM "issue""#, [], |r| r.get(0))
        .unwrap();
    txn(
        &mut w,
        0x300,
        vec![
            add_column("points", "int4", "5", false),
            add_column("done", "bool", "false", false),
            add_column("state", "text", "'open'::text", false),
            // A default only upstream can compute comes with a backfill: NULL until then.
            add_column("updated", "timestamptz", "now()", true),
            // One Zero's replicator cannot map and no backfill: NULL, not a failure.
            add_column("odd", "int8", "nextval('s'::regclass)", false),
        ],
    );
    let got = rows(&w, "issue");
    assert_eq!(
        got[0],
        json!({"id": 1, "title": "a", "meta": null, "points": 5, "done": false,
               "state": "open", "updated": null, "odd": null})
    );
    let (versions, min_seq): (i64, i64) = w
        .replica()
        .connection()
        .query_row(
            r#"SELECT count(DISTINCT "_hw_version"), min("_hw_seq") FROM "issue""#,
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(versions, 1);
    assert!(min_seq > seq_before, "{min_seq} > {seq_before}");
    let table = w.replica().table("issue").unwrap();
    assert_eq!(
        table.metadata.as_ref().unwrap().extra["relationOID"],
        json!(7)
    );
}

fn rows(writer: &ReplicaWriter, table: &str) -> Vec<Value> {
    writer
        .replica()
        .rows(table, JsonFormat::Parsed)
        .unwrap()
        .into_iter()
        .map(Value::Object)
        .collect()
}

fn tombstones(writer: &ReplicaWriter) -> Vec<(String, Option<String>, i64)> {
    let conn = &writer.replica().conn;
    let mut stmt = conn
        .prepare(r#"SELECT "table_name","row_key","seq" FROM "_hw_tombstones" ORDER BY "seq""#)
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[test]
fn a_committed_transaction_stores_rows_versions_sequences_and_position() {
    let mut w = writer();
    let applied = txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
    assert_eq!(
        applied,
        Applied::Committed {
            watermark: Lsn(0x200).to_watermark(),
            lsn: Lsn(0x200)
        }
    );
    assert_eq!(
        rows(&w, "issue"),
        vec![
            json!({"id": 1, "title": "a", "meta": null}),
            json!({"id": 2, "title": "b", "meta": null})
        ]
    );
    let (version, seq): (String, i64) = w
        .replica()
        .conn
        .query_row(
            r#"SELECT "_hw_version", "_hw_seq" FROM "issue" WHERE "id" = 2"#,
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(version, Lsn(0x200).to_watermark().as_str());
    assert_eq!(seq, 2);
    let state = w.replica().state().unwrap();
    assert_eq!(state.lsn, Lsn(0x200));
    assert_eq!(state.next_seq, 3);
}

#[test]
fn a_transaction_at_or_below_the_position_is_refused_not_applied_twice() {
    let mut w = writer();
    txn(&mut w, 0x200, vec![insert(1, "a")]);
    let replay = w.apply(&DownstreamMessage::Begin(Begin::new(
        Lsn(0x200).to_watermark(),
    )));
    assert!(matches!(replay, Err(ReplicaError::NotAfterPosition { .. })));
    assert!(!w.in_transaction());
    assert_eq!(
        rows(&w, "issue"),
        vec![json!({"id": 1, "title": "a", "meta": null})]
    );
}

fn stored_state(w: &ReplicaWriter) -> (String, i64) {
    w.replica()
        .conn
        .query_row(
            r#"SELECT "watermark", "next_seq" FROM "_hw_state" WHERE "lock" = 1"#,
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
}

#[test]
fn grouped_transactions_share_one_commit_and_a_rollback_keeps_the_group() {
    let mut w = writer();
    w.set_group_commit(true);
    assert_eq!(
        txn(&mut w, 0x200, vec![insert(1, "a")]),
        Applied::Grouped {
            watermark: Lsn(0x200).to_watermark(),
            lsn: Lsn(0x200)
        }
    );
    assert!(matches!(
        txn(&mut w, 0x300, vec![insert(2, "b")]),
        Applied::Grouped { .. }
    ));
    // The third is rolled back: only its savepoint goes.
    let wm = Lsn(0x400).to_watermark();
    w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
    w.apply(&DownstreamMessage::Data(insert(3, "c"))).unwrap();
    assert_eq!(
        w.apply(&DownstreamMessage::Rollback(Default::default()))
            .unwrap(),
        Applied::RolledBack
    );
    assert!(w.group_open());
    assert!(!w.replica().conn.is_autocommit(), "nothing committed yet");
    assert!(w.commit_group().unwrap());
    assert!(w.replica().conn.is_autocommit());
    assert_eq!(
        stored_state(&w),
        (Lsn(0x300).to_watermark().as_str().to_owned(), 3)
    );
    assert_eq!(
        rows(&w, "issue"),
        vec![
            json!({"id": 1, "title": "a", "meta": null}),
            json!({"id": 2, "title": "b", "meta": null})
        ]
    );
    // A transaction not after the group's position is refused; the next one's seq
    // follows on.
    let replay = w.apply(&DownstreamMessage::Begin(Begin::new(
        Lsn(0x300).to_watermark(),
    )));
    assert!(matches!(replay, Err(ReplicaError::NotAfterPosition { .. })));
    assert!(matches!(
        txn(&mut w, 0x500, vec![insert(4, "d")]),
        Applied::Grouped { .. }
    ));
    // A discarded group leaves the durable state, in memory too.
    w.discard_group().unwrap();
    assert_eq!(
        w.replica().state().unwrap().watermark,
        Lsn(0x300).to_watermark()
    );
    assert_eq!(rows(&w, "issue").len(), 2);
    assert!(matches!(
        txn(&mut w, 0x500, vec![insert(4, "d")]),
        Applied::Grouped { .. }
    ));
    w.commit_group().unwrap();
    assert_eq!(
        stored_state(&w),
        (Lsn(0x500).to_watermark().as_str().to_owned(), 4)
    );
}

fn whole(lsn: u64, changes: Vec<Change>) -> Vec<DownstreamMessage> {
    let wm = Lsn(lsn).to_watermark();
    std::iter::once(DownstreamMessage::Begin(Begin::new(wm.clone())))
        .chain(changes.into_iter().map(DownstreamMessage::Data))
        .chain(std::iter::once(DownstreamMessage::Commit(Commit::new(wm))))
        .collect()
}

fn unknown_table_insert() -> Change {
    Change::Insert(Insert {
        relation: rel("nope", &["id"], ReplicaIdentity::Default).into(),
        new: row(json!({"id": 1})),
        extra: Default::default(),
    })
}

#[test]
fn whole_transactions_join_a_group_and_an_error_in_one_discards_the_group() {
    let mut w = writer();
    w.set_group_commit(true);
    // The first of a group opens the SQLite transaction; later ones join it.
    assert!(matches!(
        w.apply_whole(&whole(0x200, vec![insert(1, "a")])).unwrap(),
        Applied::Grouped { .. }
    ));
    txn(&mut w, 0x300, vec![insert(2, "b")]);
    assert_eq!(
        w.apply_whole(&whole(0x400, vec![insert(3, "c"), insert(4, "d")]))
            .unwrap(),
        Applied::Grouped {
            watermark: Lsn(0x400).to_watermark(),
            lsn: Lsn(0x400)
        }
    );
    assert!(!w.in_transaction());
    // One write of the position, by the group's commit.
    assert_eq!(
        stored_state(&w),
        (Lsn(0x100).to_watermark().as_str().to_owned(), 1)
    );
    assert!(w.commit_group().unwrap());
    assert_eq!(
        stored_state(&w),
        (Lsn(0x400).to_watermark().as_str().to_owned(), 5)
    );
    // Inside the next group, a failing whole transaction takes the group's undurable
    // transactions with it: the replica is back at the durable position, in memory too.
    txn(&mut w, 0x500, vec![insert(5, "e")]);
    let failed = w.apply_whole(&whole(0x600, vec![insert(6, "f"), unknown_table_insert()]));
    assert!(
        matches!(failed, Err(ReplicaError::UnknownTable { .. })),
        "{failed:?}"
    );
    assert!(!w.group_open());
    assert!(!w.in_transaction());
    assert!(w.replica().conn.is_autocommit());
    assert_eq!(rows(&w, "issue").len(), 4);
    let state = w.replica().state().unwrap();
    assert_eq!(
        (state.watermark.clone(), state.next_seq),
        (Lsn(0x400).to_watermark(), 5)
    );
    // Sent again, they apply.
    txn(&mut w, 0x500, vec![insert(5, "e")]);
    w.apply_whole(&whole(0x600, vec![insert(6, "f")])).unwrap();
    w.commit_group().unwrap();
    assert_eq!(rows(&w, "issue").len(), 6);
    assert_eq!(
        stored_state(&w),
        (Lsn(0x600).to_watermark().as_str().to_owned(), 7)
    );
}

#[test]
fn a_whole_transaction_must_run_from_begin_to_commit() {
    let mut w = writer();
    w.set_group_commit(true);
    txn(&mut w, 0x200, vec![insert(1, "a")]);
    let mut headless = whole(0x300, vec![insert(2, "b")]);
    headless.remove(0);
    assert!(matches!(
        w.apply_whole(&headless),
        Err(ReplicaError::IncompleteTransaction { .. })
    ));
    // Refused before anything was applied: the group stays.
    assert!(w.group_open());
    let mut endless = whole(0x300, vec![insert(2, "b")]);
    endless.pop();
    assert!(matches!(
        w.apply_whole(&endless),
        Err(ReplicaError::IncompleteTransaction { .. })
    ));
    assert!(!w.group_open() && !w.in_transaction());
    assert!(rows(&w, "issue").is_empty());
    assert_eq!(
        w.replica().state().unwrap().watermark,
        Lsn(0x100).to_watermark()
    );
}

/// The position of a group's commits is written only by the group's commit: a schema
/// change rolled back inside the group reloads the schema, not that older position.
#[test]
fn a_schema_change_rolled_back_inside_a_group_keeps_the_groups_position() {
    let mut w = writer();
    w.set_group_commit(true);
    txn(&mut w, 0x200, vec![insert(1, "a")]);
    let wm = Lsn(0x300).to_watermark();
    w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
    w.apply(&DownstreamMessage::Data(add_column(
        "extra", "int4", "5", false,
    )))
    .unwrap();
    w.apply(&DownstreamMessage::Rollback(Default::default()))
        .unwrap();
    let state = w.replica().state().unwrap();
    assert_eq!(
        (state.watermark.clone(), state.next_seq),
        (Lsn(0x200).to_watermark(), 2)
    );
    assert!(w
        .replica()
        .table("issue")
        .unwrap()
        .column("extra")
        .is_none());
    // Not applied again, and the group's commit writes it.
    let replay = w.apply(&DownstreamMessage::Begin(Begin::new(
        Lsn(0x200).to_watermark(),
    )));
    assert!(matches!(replay, Err(ReplicaError::NotAfterPosition { .. })));
    w.commit_group().unwrap();
    assert_eq!(
        stored_state(&w),
        (Lsn(0x200).to_watermark().as_str().to_owned(), 2)
    );
}

#[test]
fn rollback_discards_rows_and_sequence_numbers() {
    let mut w = writer();
    let wm = Lsn(0x300).to_watermark();
    w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
    w.apply(&DownstreamMessage::Data(insert(1, "a"))).unwrap();
    let applied = w
        .apply(&DownstreamMessage::Rollback(Default::default()))
        .unwrap();
    assert_eq!(applied, Applied::RolledBack);
    assert!(rows(&w, "issue").is_empty());
    txn(&mut w, 0x400, vec![insert(2, "b")]);
    assert_eq!(w.replica().state().unwrap().next_seq, 2);
}

#[test]
fn a_commit_watermark_other_than_begin_is_rejected_and_nothing_is_stored() {
    let mut w = writer();
    w.apply(&DownstreamMessage::Begin(Begin::new(
        Lsn(0x300).to_watermark(),
    )))
    .unwrap();
    w.apply(&DownstreamMessage::Data(insert(1, "a"))).unwrap();
    let err = w
        .apply(&DownstreamMessage::Commit(Commit::new(
            Lsn(0x301).to_watermark(),
        )))
        .unwrap_err();
    assert!(
        matches!(err, ReplicaError::WatermarkMismatch { .. }),
        "{err}"
    );
    assert!(!w.in_transaction());
    assert!(rows(&w, "issue").is_empty());
    assert_eq!(w.replica().state().unwrap().lsn, Lsn(0x100));
}

#[test]
fn updates_keep_absent_columns_and_follow_key_changes_with_a_tombstone() {
    let mut w = writer();
    txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
    let relation = rel("issue", &["id"], ReplicaIdentity::Default);
    // `title` is an unchanged TOAST value: absent from `new`.
    let keep_title = Change::Update(Update {
        relation: relation.clone().into(),
        key: None,
        new: row(json!({"id": 1, "meta": {"x": 1}})),
        extra: Default::default(),
    });
    let move_key = Change::Update(Update {
        relation: relation.into(),
        key: Some(row(json!({"id": 2}))),
        new: row(json!({"id": 3, "title": "b2", "meta": null})),
        extra: Default::default(),
    });
    txn(&mut w, 0x300, vec![keep_title, move_key]);
    assert_eq!(
        rows(&w, "issue"),
        vec![
            json!({"id": 1, "title": "a", "meta": {"x": 1}}),
            json!({"id": 3, "title": "b2", "meta": null})
        ]
    );
    assert_eq!(
        tombstones(&w),
        vec![("issue".to_owned(), Some(r#"{"id":2}"#.to_owned()), 5)]
    );
}

#[test]
fn an_update_of_a_missing_row_becomes_an_insert() {
    let mut w = writer();
    let update = Change::Update(Update {
        relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
        key: None,
        new: row(json!({"id": 5, "title": "e", "meta": null})),
        extra: Default::default(),
    });
    txn(&mut w, 0x200, vec![update]);
    assert_eq!(
        rows(&w, "issue"),
        vec![json!({"id": 5, "title": "e", "meta": null})]
    );
}

#[test]
fn replica_identity_full_is_keyed_by_the_table_key_not_all_columns() {
    let mut w = writer();
    txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
    let relation = rel("issue", &["id", "title", "meta"], ReplicaIdentity::Full);
    let update = Change::Update(Update {
        relation: relation.clone().into(),
        key: Some(row(json!({"id": 1, "title": "a", "meta": null}))),
        new: row(json!({"id": 1, "title": "a2", "meta": null})),
        extra: Default::default(),
    });
    let delete = Change::Delete(Delete {
        relation: relation.into(),
        key: row(json!({"id": 2, "title": "b", "meta": null})),
        extra: Default::default(),
    });
    txn(&mut w, 0x300, vec![update, delete]);
    assert_eq!(
        rows(&w, "issue"),
        vec![json!({"id": 1, "title": "a2", "meta": null})]
    );
    // The update kept its key: only the delete left a tombstone.
    assert_eq!(
        tombstones(&w).into_iter().map(|t| t.1).collect::<Vec<_>>(),
        vec![Some(r#"{"id":2}"#.to_owned())]
    );
}

#[test]
fn truncate_empties_the_table_and_leaves_one_marker() {
    let mut w = writer();
    txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
    let delete = Change::Delete(Delete {
        relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
        key: row(json!({"id": 1})),
        extra: Default::default(),
    });
    txn(&mut w, 0x300, vec![delete]);
    let truncate = Change::Truncate(Truncate {
        relations: vec![rel("issue", &["id"], ReplicaIdentity::Default)],
        extra: Default::default(),
    });
    txn(&mut w, 0x400, vec![truncate]);
    assert!(rows(&w, "issue").is_empty());
    assert_eq!(tombstones(&w), vec![("issue".to_owned(), None, 4)]);
}

#[test]
fn schema_changes_apply_in_the_transaction_of_the_rows_that_follow_them() {
    let mut w = writer();
    let create = Change::CreateTable(CreateTable {
        spec: spec("app", "label", &[("id", "int4"), ("name", "text")], &["id"]),
        metadata: None,
        backfill: None,
        extra: Default::default(),
    });
    let label = |v: Value| {
        Change::Insert(Insert {
            relation: Relation::new(
                "app",
                "tag",
                RowKey::new(vec!["id".into()], Some(ReplicaIdentity::Default)),
            )
            .into(),
            new: row(v),
            extra: Default::default(),
        })
    };
    let rename = Change::RenameTable(RenameTable {
        old: Identifier::new("app", "label"),
        new: Identifier::new("app", "tag"),
        extra: Default::default(),
    });
    let mut color = ColumnSpec::new(Number::from(3), "text");
    color.not_null = Some(Some(false));
    let add = Change::AddColumn(AddColumn {
        table: Identifier::new("app", "tag"),
        column: ColumnDef {
            name: "color".into(),
            spec: color,
            extra: Default::default(),
        },
        table_metadata: None,
        backfill: None,
        extra: Default::default(),
    });
    let index = Change::CreateIndex(CreateIndex {
        spec: IndexSpec {
            schema: "app".into(),
            name: "tag_name".into(),
            table_name: "tag".into(),
            unique: true,
            columns: IndexMap::from([("name".to_owned(), IndexDirection::Asc)]),
            predicate: None,
            extra: Default::default(),
        },
        extra: Default::default(),
    });
    txn(
        &mut w,
        0x200,
        vec![
            create,
            rename,
            add,
            index,
            label(json!({"id": 1, "name": "bug", "color": "red"})),
        ],
    );
    assert_eq!(
        rows(&w, "app.tag"),
        vec![json!({"id": 1, "name": "bug", "color": "red"})]
    );
    let rename_col = Change::UpdateColumn(UpdateColumn {
        table: Identifier::new("app", "tag"),
        old: ColumnDef {
            name: "name".into(),
            spec: ColumnSpec::new(Number::from(2), "text"),
            extra: Default::default(),
        },
        new: ColumnDef {
            name: "title".into(),
            spec: ColumnSpec::new(Number::from(2), "varchar"),
            extra: Default::default(),
        },
        extra: Default::default(),
    });
    let drop_col = Change::DropColumn(DropColumn {
        table: Identifier::new("app", "tag"),
        column: "color".into(),
        extra: Default::default(),
    });
    txn(&mut w, 0x300, vec![rename_col, drop_col]);
    assert_eq!(rows(&w, "app.tag"), vec![json!({"id": 1, "title": "bug"})]);
    let reopened = Replica::with_connection(std::mem::replace(
        &mut w.replica.conn,
        rusqlite::Connection::open_in_memory().unwrap(),
    ))
    .unwrap();
    let tag = reopened.table("app.tag").unwrap();
    assert_eq!(tag.column("title").unwrap().data_type, "varchar");
    // The retyped column waits for upstream's converted values.
    assert!(tag.column("title").unwrap().backfill.is_some());
    assert!(reopened.table("app.label").is_none());
    let drop = Change::DropTable(DropTable {
        id: Identifier::new("app", "tag"),
        extra: Default::default(),
    });
    let mut w = ReplicaWriter::new(reopened);
    txn(&mut w, 0x400, vec![drop]);
    assert!(w.replica().table("app.tag").is_none());
}

#[test]
fn a_rolled_back_schema_change_leaves_the_schema_as_it_was() {
    let mut w = writer();
    let wm = Lsn(0x300).to_watermark();
    w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
    w.apply(&DownstreamMessage::Data(Change::DropTable(DropTable {
        id: Identifier::new("public", "issue"),
        extra: Default::default(),
    })))
    .unwrap();
    assert!(w.replica().table("issue").is_none());
    w.apply(&DownstreamMessage::Rollback(Default::default()))
        .unwrap();
    assert!(w.replica().table("issue").is_some());
    txn(&mut w, 0x400, vec![insert(1, "a")]);
    assert_eq!(rows(&w, "issue").len(), 1);
}

#[test]
fn backfills_fill_existing_rows_and_complete_the_pending_columns() {
    let mut w = writer();
    txn(&mut w, 0x200, vec![insert(1, "a"), insert(2, "b")]);
    let mut prio = ColumnSpec::new(Number::from(4), "int4");
    prio.not_null = Some(Some(false));
    let add = Change::AddColumn(AddColumn {
        table: Identifier::new("public", "issue"),
        column: ColumnDef {
            name: "prio".into(),
            spec: prio,
            extra: Default::default(),
        },
        table_metadata: None,
        backfill: Some(json!({"attNum": 4})),
        extra: Default::default(),
    });
    txn(&mut w, 0x300, vec![add]);
    let pending = w.pending_backfills();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].columns, vec!["prio".to_owned()]);
    assert!(!pending[0].whole_table);
    let relation = NewRelation {
        schema: "public".into(),
        name: "issue".into(),
        row_key: RowKey::new(vec!["id".into()], None),
        extra: Default::default(),
    };
    let backfill = Change::Backfill(Backfill {
        relation: relation.clone(),
        columns: vec!["prio".into()],
        watermark: Lsn(0x300).to_watermark(),
        // Row 7 is not in the replica: a column backfill does not create it.
        row_values: vec![vec![json!(1), json!(10)], vec![json!(7), json!(70)]],
        progress_marks: None,
        status: None,
        extra: Default::default(),
    });
    let done = Change::BackfillCompleted(BackfillCompleted {
        relation,
        columns: vec!["prio".into()],
        watermark: Lsn(0x300).to_watermark(),
        progress_marks: None,
        status: None,
        extra: Default::default(),
    });
    let wm = Lsn(0x300).to_watermark().state_version().next_minor();
    let wm = wm.to_watermark().unwrap();
    let mut begin = Begin::new(wm.clone());
    begin.skip_ack = Some(true);
    w.apply(&DownstreamMessage::Begin(begin)).unwrap();
    w.apply(&DownstreamMessage::Data(backfill)).unwrap();
    w.apply(&DownstreamMessage::Data(done)).unwrap();
    w.apply(&DownstreamMessage::Commit(Commit::new(wm)))
        .unwrap();
    assert_eq!(
        rows(&w, "issue"),
        vec![
            json!({"id": 1, "title": "a", "meta": null, "prio": 10}),
            json!({"id": 2, "title": "b", "meta": null, "prio": null})
        ]
    );
    assert!(w.pending_backfills().is_empty());
    // The next upstream transaction (a larger major) is not mistaken for a replay.
    let applied = txn(&mut w, 0x301, vec![insert(3, "c")]);
    assert!(matches!(applied, Applied::Committed { .. }));
}

fn add_prio_with_backfill(w: &mut ReplicaWriter, lsn: u64) {
    let mut prio = ColumnSpec::new(Number::from(4), "int4");
    prio.not_null = Some(Some(false));
    let add = Change::AddColumn(AddColumn {
        table: Identifier::new("public", "issue"),
        column: ColumnDef {
            name: "prio".into(),
            spec: prio,
            extra: Default::default(),
        },
        table_metadata: None,
        backfill: Some(json!({"attNum": 4})),
        extra: Default::default(),
    });
    txn(w, lsn, vec![add]);
}

fn issue_relation() -> NewRelation {
    NewRelation {
        schema: "public".into(),
        name: "issue".into(),
        row_key: RowKey::new(vec!["id".into()], None),
        extra: Default::default(),
    }
}

/// One synthetic backfill transaction after `after` (a skipAck transaction at its next
/// minor version), read at the snapshot `snapshot`.
fn backfill_txn(
    w: &mut ReplicaWriter,
    after: u64,
    snapshot: u64,
    columns: &[&str],
    row_values: Vec<Vec<Value>>,
    complete: bool,
) -> Applied {
    let wm = Lsn(after).to_watermark().state_version().next_minor();
    let wm = wm.to_watermark().unwrap();
    let columns: Vec<String> = columns.iter().map(|c| (*c).to_owned()).collect();
    let mut begin = Begin::new(wm.clone());
    begin.skip_ack = Some(true);
    w.apply(&DownstreamMessage::Begin(begin)).unwrap();
    w.apply(&DownstreamMessage::Data(Change::Backfill(Backfill {
        relation: issue_relation(),
        columns: columns.clone(),
        watermark: Lsn(snapshot).to_watermark(),
        row_values,
        progress_marks: None,
        status: None,
        extra: Default::default(),
    })))
    .unwrap();
    if complete {
        w.apply(&DownstreamMessage::Data(Change::BackfillCompleted(
            BackfillCompleted {
                relation: issue_relation(),
                columns,
                watermark: Lsn(snapshot).to_watermark(),
                progress_marks: None,
                status: None,
                extra: Default::default(),
            },
        )))
        .unwrap();
    }
    w.apply(&DownstreamMessage::Commit(Commit::new(wm)))
        .unwrap()
}

fn versions(w: &ReplicaWriter) -> Vec<(i64, String)> {
    let mut stmt = w
        .replica()
        .conn
        .prepare(r#"SELECT "id", "_hw_version" FROM "issue" ORDER BY "id""#)
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn tracked_versions(w: &ReplicaWriter) -> i64 {
    w.replica()
        .conn
        .query_row(r#"SELECT count(*) FROM "_hw_backfill_versions""#, [], |r| {
            r.get(0)
        })
        .unwrap()
}

/// A backfill read at a snapshot older than later streamed changes skips the rows deleted
/// after it and keeps the backfilling values the stream wrote after it
/// (`change-stream.md`, "Backfills").
#[test]
fn backfill_skips_rows_deleted_after_its_snapshot_and_keeps_later_streamed_values() {
    let mut w = writer();
    txn(
        &mut w,
        0x200,
        vec![insert(1, "a"), insert(2, "b"), insert(3, "c")],
    );
    add_prio_with_backfill(&mut w, 0x300);
    let update = Change::Update(Update {
        relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
        key: None,
        new: row(json!({"id": 1, "title": "a2", "meta": null, "prio": 11})),
        extra: Default::default(),
    });
    let delete = Change::Delete(Delete {
        relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
        key: row(json!({"id": 2})),
        extra: Default::default(),
    });
    // Only the title of row 3 changes (its prio left out, like an unchanged TOAST value).
    let title_only = Change::Update(Update {
        relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
        key: None,
        new: row(json!({"id": 3, "title": "c2", "meta": null})),
        extra: Default::default(),
    });
    txn(&mut w, 0x400, vec![update, delete, title_only]);
    assert_eq!(tracked_versions(&w), 1, "only row 1's prio was written");
    let applied = backfill_txn(
        &mut w,
        0x400,
        0x350,
        &["prio"],
        vec![
            vec![json!(1), json!(10)],
            vec![json!(2), json!(20)],
            vec![json!(3), json!(30)],
        ],
        true,
    );
    assert!(matches!(applied, Applied::Committed { .. }));
    assert_eq!(
        rows(&w, "issue"),
        vec![
            json!({"id": 1, "title": "a2", "meta": null, "prio": 11}),
            json!({"id": 3, "title": "c2", "meta": null, "prio": 30})
        ]
    );
    // Row 1 took nothing and keeps its version; row 3 took its prio and moved forward to the
    // backfill transaction's version, not back to the snapshot's.
    let backfill_version = Lsn(0x400).to_watermark().state_version().next_minor();
    assert_eq!(
        versions(&w),
        vec![
            (1, Lsn(0x400).to_watermark().as_str().to_owned()),
            (3, backfill_version.to_watermark().unwrap().into_string())
        ]
    );
    assert!(w.pending_backfills().is_empty());
    assert_eq!(
        tracked_versions(&w),
        0,
        "completion forgets the write versions"
    );
}

/// A table new to the replica gets the rows it lacks, versioned at the backfill's snapshot;
/// rows the stream wrote after the snapshot keep their values, and a truncate after the
/// snapshot drops the whole backfill (`change-stream.md`, "Backfills").
#[test]
fn whole_table_backfill_inserts_missing_rows_at_the_snapshot_version() {
    let mut w = writer();
    let drop = Change::DropTable(DropTable {
        id: Identifier::new("public", "issue"),
        extra: Default::default(),
    });
    let create = Change::CreateTable(CreateTable {
        spec: spec(
            "public",
            "issue",
            &[("id", "int8"), ("title", "text"), ("meta", "jsonb")],
            &["id"],
        ),
        metadata: None,
        backfill: Some(
            ["id", "title", "meta"]
                .iter()
                .map(|c| ((*c).to_owned(), json!({"attNum": 1})))
                .collect(),
        ),
        extra: Default::default(),
    });
    txn(&mut w, 0x200, vec![drop, create]);
    assert!(w.pending_backfills()[0].whole_table);
    txn(&mut w, 0x300, vec![insert(1, "streamed")]);
    let rows_read = vec![
        vec![json!(1), json!("old"), json!(null)],
        vec![json!(2), json!("b"), json!(null)],
    ];
    backfill_txn(
        &mut w,
        0x300,
        0x280,
        &["title", "meta"],
        rows_read.clone(),
        false,
    );
    assert_eq!(
        rows(&w, "issue"),
        vec![
            json!({"id": 1, "title": "streamed", "meta": null}),
            json!({"id": 2, "title": "b", "meta": null})
        ]
    );
    assert_eq!(
        versions(&w),
        vec![
            (1, Lsn(0x300).to_watermark().as_str().to_owned()),
            (2, Lsn(0x280).to_watermark().as_str().to_owned())
        ]
    );
    // A truncate after the snapshot: nothing read before it comes back.
    let truncate = Change::Truncate(Truncate {
        relations: vec![rel("issue", &["id"], ReplicaIdentity::Default)],
        extra: Default::default(),
    });
    txn(&mut w, 0x500, vec![truncate]);
    backfill_txn(&mut w, 0x500, 0x450, &["title", "meta"], rows_read, true);
    assert!(rows(&w, "issue").is_empty());
    assert!(w.pending_backfills().is_empty());
}

/// Once a column's backfill completed, the stream owns its values: a backfill delivered
/// again (a relay's source restarting) changes nothing.
#[test]
fn a_backfill_of_a_completed_column_changes_nothing() {
    let mut w = writer();
    txn(&mut w, 0x200, vec![insert(1, "a")]);
    add_prio_with_backfill(&mut w, 0x300);
    backfill_txn(
        &mut w,
        0x300,
        0x310,
        &["prio"],
        vec![vec![json!(1), json!(5)]],
        true,
    );
    let update = Change::Update(Update {
        relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
        key: None,
        new: row(json!({"id": 1, "title": "a", "meta": null, "prio": 6})),
        extra: Default::default(),
    });
    txn(&mut w, 0x400, vec![update]);
    backfill_txn(
        &mut w,
        0x400,
        0x310,
        &["prio"],
        vec![vec![json!(1), json!(5)]],
        true,
    );
    assert_eq!(
        rows(&w, "issue"),
        vec![json!({"id": 1, "title": "a", "meta": null, "prio": 6})]
    );
}

#[test]
fn changes_to_unknown_tables_or_columns_are_typed_errors() {
    let mut w = writer();
    let wm = Lsn(0x200).to_watermark();
    w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
    let err = w
        .apply(&DownstreamMessage::Data(Change::Insert(Insert {
            relation: rel("nope", &["id"], ReplicaIdentity::Default).into(),
            new: row(json!({"id": 1})),
            extra: Default::default(),
        })))
        .unwrap_err();
    assert!(matches!(err, ReplicaError::UnknownTable { .. }), "{err}");
    let err = w
        .apply(&DownstreamMessage::Data(insert(1, "a")))
        .unwrap_err();
    assert!(
        matches!(err, ReplicaError::NotInTransaction { .. }),
        "{err}"
    );
}

#[derive(Debug, Clone)]
enum Op {
    Upsert(i64, String),
    Update { from: i64, to: i64, title: String },
    Delete(i64),
    Truncate,
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (0i64..8, "[a-z]{0,3}").prop_map(|(id, t)| Op::Upsert(id, t)),
        (0i64..8, 0i64..8, "[a-z]{0,3}").prop_map(|(from, to, title)| Op::Update {
            from,
            to,
            title
        }),
        (0i64..8).prop_map(Op::Delete),
        Just(Op::Truncate),
    ]
}

/// What Postgres would hold after `op` (updates and deletes of missing rows do nothing).
fn model_apply(model: &mut std::collections::BTreeMap<i64, String>, op: &Op) {
    match op {
        Op::Upsert(id, t) => {
            model.insert(*id, t.clone());
        }
        Op::Update { from, to, title } => {
            if model.remove(from).is_some() {
                model.insert(*to, title.clone());
            }
        }
        Op::Delete(id) => {
            model.remove(id);
        }
        Op::Truncate => model.clear(),
    }
}

fn change_of(op: &Op, model: &std::collections::BTreeMap<i64, String>) -> Option<Change> {
    let relation = rel("issue", &["id"], ReplicaIdentity::Default);
    Some(match op {
        Op::Upsert(id, t) if model.contains_key(id) => Change::Update(Update {
            relation: relation.into(),
            key: None,
            new: row(json!({"id": id, "title": t, "meta": null})),
            extra: Default::default(),
        }),
        Op::Upsert(id, t) => Change::Insert(Insert {
            relation: relation.into(),
            new: row(json!({"id": id, "title": t, "meta": null})),
            extra: Default::default(),
        }),
        Op::Update { from, to, title } => {
            if !model.contains_key(from) || (from != to && model.contains_key(to)) {
                return None;
            }
            Change::Update(Update {
                relation: relation.into(),
                key: (from != to).then(|| row(json!({"id": from}))),
                // The title is left out when unchanged, like an unchanged TOAST value.
                new: if model.get(from) == Some(title) {
                    row(json!({"id": to, "meta": null}))
                } else {
                    row(json!({"id": to, "title": title, "meta": null}))
                },
                extra: Default::default(),
            })
        }
        Op::Delete(id) if model.contains_key(id) => Change::Delete(Delete {
            relation: relation.into(),
            key: row(json!({"id": id})),
            extra: Default::default(),
        }),
        Op::Delete(_) => return None,
        Op::Truncate => Change::Truncate(Truncate {
            relations: vec![relation],
            extra: Default::default(),
        }),
    })
}

// ---- text rows: the same replica as JSON rows ----

mod text_rows {
    use super::*;
    use highwater_engine::pgoutput::{
        self as pg, OldTuple, PgoutputEvent, PgoutputMapper, PgoutputMessage, RelationColumn,
        Tuple, TupleValue,
    };
    use proptest::prelude::*;

    const ORDERS: u32 = 16500;
    /// The columns of `public.orders`: name, type OID, replica data type.
    const COLUMNS: &[(&str, u32, &str)] = &[
        ("id", 20, "int8"),
        ("account", 23, "int4"),
        ("title", 25, "text"),
        ("amount", 1700, "numeric"),
        ("at", 1184, "timestamptz"),
        ("attrs", 3802, "jsonb"),
        ("ok", 16, "bool"),
        ("ratio", 701, "float8"),
        ("tags", 1009, "text[]"),
        ("day", 1082, "date"),
    ];

    fn orders_writer() -> ReplicaWriter {
        let mut w = writer();
        let cols: Vec<(&str, &str)> = COLUMNS.iter().map(|(n, _, t)| (*n, *t)).collect();
        let mut tables = std::mem::take(&mut w.replica.tables);
        let orders = spec("public", "orders", &cols, &["id"]);
        create_replica_table(
            &w.replica.conn,
            &mut tables,
            ReplicaTable::from_spec(&orders),
        )
        .unwrap();
        w.replica.tables = tables;
        w
    }

    fn relation() -> pg::Relation {
        pg::Relation {
            oid: ORDERS,
            namespace: "public".into(),
            name: "orders".into(),
            replica_identity: pg::ReplicaIdentity::Default,
            columns: COLUMNS
                .iter()
                .map(|(name, oid, _)| RelationColumn {
                    flags: u8::from(*name == "id"),
                    name: (*name).into(),
                    type_oid: *oid,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    /// Values for every column but the key, drawn per column.
    fn values() -> impl Strategy<Value = Vec<TupleValue<'static>>> {
        let pool: [&'static [&'static str]; 9] = [
            &["1", "-7", "2147483647"],
            &["", "plain", "é ☃", "a\"quote"],
            &["12.50", "-0.01", "1e+20", "1E5", "NaN", "Infinity"],
            &[
                "2024-01-02 03:04:05.123456+00",
                "1999-12-31 23:59:59-07:30",
                "infinity",
            ],
            &["{}", "{\"k\": [1, 2.5e3]}", "null", "\"s\""],
            &["t", "f"],
            &[
                "3.14",
                "-0",
                "1e-7",
                "1E5",
                "NaN",
                "-Infinity",
                "9007199254740993",
            ],
            &["{}", "{a,\"b c\",NULL}", "{{x,y},{z,w}}"],
            &["2024-01-02", "infinity", "0044-03-15 BC"],
        ];
        let columns: Vec<_> = pool
            .into_iter()
            .map(|texts| {
                prop_oneof![
                    8 => proptest::sample::select(texts).prop_map(|t| TupleValue::Text(t.as_bytes())),
                    1 => Just(TupleValue::Null),
                    1 => Just(TupleValue::UnchangedToast),
                ]
            })
            .collect();
        columns
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, Vec<TupleValue<'static>>),
        /// From one id to another (the same for no key change).
        Update(u8, u8, Vec<TupleValue<'static>>),
        Delete(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..6, values()).prop_map(|(id, v)| Op::Insert(id, v)),
            (0u8..6, 0u8..6, values()).prop_map(|(a, b, v)| Op::Update(a, b, v)),
            (0u8..6).prop_map(Op::Delete),
        ]
    }

    fn id(n: u8) -> TupleValue<'static> {
        TupleValue::Text(String::leak(n.to_string()).as_bytes())
    }

    fn tuple(key: u8, values: &[TupleValue<'static>]) -> Tuple<'static> {
        Tuple(
            std::iter::once(id(key))
                .chain(values.iter().cloned())
                .collect(),
        )
    }

    /// The key tuple of the row at `key`: the key column, the others null.
    fn key_tuple(key: u8) -> OldTuple<'static> {
        OldTuple::Key(Tuple(
            std::iter::once(id(key))
                .chain((1..COLUMNS.len()).map(|_| TupleValue::Null))
                .collect(),
        ))
    }

    fn message(op: &Op) -> PgoutputMessage<'static> {
        match op {
            Op::Insert(key, values) => {
                // An insert never has unchanged TOAST values.
                let values: Vec<_> = values
                    .iter()
                    .map(|v| match v {
                        TupleValue::UnchangedToast => TupleValue::Null,
                        v => *v,
                    })
                    .collect();
                PgoutputMessage::Insert(pg::Insert {
                    relation_oid: ORDERS,
                    new: tuple(*key, &values),
                })
            }
            Op::Update(from, to, values) => PgoutputMessage::Update(pg::Update {
                relation_oid: ORDERS,
                old: (from != to).then(|| key_tuple(*from)),
                new: tuple(*to, values),
            }),
            Op::Delete(key) => PgoutputMessage::Delete(pg::Delete {
                relation_oid: ORDERS,
                old: key_tuple(*key),
            }),
        }
    }

    /// Maps `message` and applies what it maps to: `text` rows with `apply_text`, others
    /// with `apply`.
    fn apply(
        writer: &mut ReplicaWriter,
        mapper: &mut PgoutputMapper,
        message: PgoutputMessage<'_>,
    ) {
        match mapper.map_message(message).unwrap() {
            Some(PgoutputEvent::Downstream(message)) => {
                writer.apply(&message).unwrap();
            }
            Some(PgoutputEvent::Commit { commit, .. }) => {
                writer.apply(&DownstreamMessage::Commit(commit)).unwrap();
            }
            Some(PgoutputEvent::RowText(change)) => {
                writer.apply_text(&change).unwrap();
            }
            Some(PgoutputEvent::Relation { .. }) | None => {}
            Some(other) => panic!("unexpected {other:?}"),
        }
    }

    /// Everything a transaction leaves in the replica: rows with their versions and seqs,
    /// and tombstones.
    type Contents = (Vec<Vec<String>>, Vec<(String, Option<String>, i64)>);

    fn contents(w: &ReplicaWriter) -> Contents {
        let conn = &w.replica().conn;
        let mut stmt = conn
            .prepare(r#"SELECT *, typeof("amount"), typeof("ratio"), typeof("at") FROM "orders" ORDER BY "id""#)
            .unwrap();
        let n = stmt.column_count();
        let rows = stmt
            .query_map([], |r| {
                (0..n)
                    .map(|i| {
                        r.get_ref(i).map(|v| match v {
                            rusqlite::types::ValueRef::Real(f) => {
                                format!("real {:?}", f.to_bits())
                            }
                            other => format!("{other:?}"),
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        (rows, tombstones(w))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any history of inserts, updates (key changes and unchanged TOAST included) and
        /// deletes leaves the same replica, bit for bit, whether the rows are applied from
        /// their text or from the JSON rows of the same messages.
        #[test]
        fn text_rows_store_what_json_rows_store(
            txns in proptest::collection::vec(proptest::collection::vec(op(), 1..6), 1..5),
        ) {
            let mut json = (orders_writer(), PgoutputMapper::new());
            let mut text = (orders_writer(), PgoutputMapper::new());
            text.1.keep_row_text();
            let mut lsn = 0x200;
            let mut present = std::collections::BTreeSet::new();
            for ops in &txns {
                let mut messages = vec![
                    PgoutputMessage::Relation(relation()),
                    PgoutputMessage::Begin(pg::Begin {
                        final_lsn: Lsn(lsn),
                        commit_time: pg::PgTimestamp(0),
                        xid: 9,
                    }),
                ];
                // Upstream's key is unique: no key changes onto another row.
                for op in ops {
                    match op {
                        Op::Update(from, to, _) if from != to && present.contains(to) => continue,
                        Op::Insert(key, _) => { present.insert(*key); }
                        Op::Update(from, to, _) => { present.remove(from); present.insert(*to); }
                        Op::Delete(key) => { present.remove(key); }
                    }
                    messages.push(message(op));
                }
                messages.push(PgoutputMessage::Commit(pg::Commit {
                    flags: 0,
                    commit_lsn: Lsn(lsn),
                    end_lsn: Lsn(lsn + 8),
                    commit_time: pg::PgTimestamp(0),
                }));
                for (writer, mapper) in [&mut json, &mut text] {
                    for m in &messages {
                        apply(writer, mapper, m.clone());
                    }
                }
                lsn += 0x100;
            }
            prop_assert_eq!(contents(&json.0), contents(&text.0));
        }
    }
}

proptest::proptest! {
    /// Any history of transactions, some rolled back and some delivered twice (a replay
    /// after a reconnect: a committed one is refused, a rolled-back one applies again),
    /// leaves the replica equal to the upstream table.
    #[test]
    fn replica_equals_upstream_after_any_history_with_rollbacks_and_replays(
        txns in proptest::collection::vec(
            (proptest::collection::vec(op(), 1..6), proptest::bool::ANY, proptest::bool::ANY),
            1..12,
        )
    ) {
        let mut w = writer();
        let mut model = std::collections::BTreeMap::new();
        for (i, (ops, rolled_back, replayed)) in txns.iter().enumerate() {
            let wm = Lsn(0x1000 + i as u64 * 0x10).to_watermark();
            let mut after = model.clone();
            let mut changes = Vec::new();
            for op in ops {
                if let Some(change) = change_of(op, &after) {
                    changes.push(change);
                    model_apply(&mut after, op);
                }
            }
            let deliveries = if *replayed { 2 } else { 1 };
            for delivery in 0..deliveries {
                let begin = w.apply(&DownstreamMessage::Begin(Begin::new(wm.clone())));
                if delivery > 0 && !rolled_back {
                    proptest::prop_assert!(
                        matches!(begin, Err(ReplicaError::NotAfterPosition { .. })),
                        "a committed transaction delivered again: {:?}",
                        begin
                    );
                    continue;
                }
                begin.unwrap();
                for change in &changes {
                    w.apply(&DownstreamMessage::Data(change.clone())).unwrap();
                }
                if *rolled_back {
                    w.apply(&DownstreamMessage::Rollback(Default::default())).unwrap();
                } else {
                    w.apply(&DownstreamMessage::Commit(Commit::new(wm.clone()))).unwrap();
                }
            }
            if !rolled_back {
                model = after;
            }
        }
        let expected: Vec<Value> = model
            .iter()
            .map(|(id, t)| json!({"id": id, "title": t, "meta": null}))
            .collect();
        proptest::prop_assert_eq!(rows(&w, "issue"), expected);
        // Every live row has its own sequence number, below the next one to hand out.
        let (distinct, max): (i64, Option<i64>) = w
            .replica()
            .conn
            .query_row(r#"SELECT count(DISTINCT "_hw_seq"), max("_hw_seq") FROM "issue""#, [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap();
        proptest::prop_assert_eq!(distinct as usize, model.len());
        proptest::prop_assert!(max.unwrap_or(0) < w.replica().state().unwrap().next_seq);
    }
}

fn feed_writer() -> ReplicaWriter {
    let mut w = writer();
    w.enable_scope_feed(
        [("issue".to_owned(), vec!["title".to_owned()])]
            .into_iter()
            .collect(),
    )
    .unwrap();
    w
}

/// Row seqs by id, tombstones, and the next seq.
type Seqs = (Vec<(i64, i64)>, Vec<(String, Option<String>, i64)>, i64);

fn seqs(w: &ReplicaWriter) -> Seqs {
    let conn = &w.replica().conn;
    let mut stmt = conn
        .prepare(r#"SELECT "id", "_hw_seq" FROM "issue" ORDER BY "id""#)
        .unwrap();
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    (rows, tombstones(w), w.replica().state().unwrap().next_seq)
}

/// The scope `title = t` as a client rebuilds it: from `start` (its rows at a cursor),
/// replaying pages of `limit` from `after`, starting over on a truncate reset.
fn replay_scope(
    w: &ReplicaWriter,
    title: &str,
    start: std::collections::BTreeMap<i64, String>,
    after: Option<i64>,
    limit: u32,
) -> std::collections::BTreeMap<i64, String> {
    use super::feed::{read_scope_page, FeedKind, ScopePage, ScopeQuery};
    let conditions =
        highwater_engine::scope_sync::Conditions::parse(&row(json!({ "title": title }))).unwrap();
    let mut client = start;
    let mut after = after;
    let mut up_to = None;
    loop {
        let page = read_scope_page(
            &w.replica().conn,
            &w.replica().tables,
            &ScopeQuery {
                table: "issue",
                conditions: &conditions,
                row_filter: None,
                after,
                up_to,
                limit,
                count_total: up_to.is_none(),
                access: &[],
            },
        )
        .unwrap();
        let (pinned, rows) = match page {
            ScopePage::Rows { up_to, rows, .. } => (up_to, rows),
            ScopePage::Truncated => {
                client.clear();
                after = None;
                up_to = None;
                continue;
            }
            other => panic!("unexpected page {other:?}"),
        };
        up_to = Some(pinned);
        let mut last = after;
        for feed_row in &rows {
            assert!(Some(feed_row.seq) > last, "rows ascend strictly");
            assert!(
                feed_row.seq <= pinned,
                "rows stay at or below the high-water"
            );
            last = Some(feed_row.seq);
            let id: i64 = feed_row.resource_id.parse().unwrap();
            match &feed_row.kind {
                FeedKind::Upsert { data } => {
                    assert_eq!(data["title"], json!(title));
                    client.insert(id, title.to_owned());
                }
                FeedKind::Exit { .. } => {
                    client.remove(&id);
                }
            }
        }
        after = last.or(Some(after.unwrap_or(0)));
        if rows.len() < limit as usize {
            return client;
        }
    }
}

#[test]
fn a_row_moved_out_of_a_scope_is_an_exit_there_and_a_write_in_the_new_scope() {
    let mut w = feed_writer();
    let mut commit_time = Commit::new(Lsn(0x200).to_watermark());
    commit_time.commit_time_ms = Some(Number::from(1_796_126_400_123_i64));
    let wm = Lsn(0x200).to_watermark();
    w.apply(&DownstreamMessage::Begin(Begin::new(wm))).unwrap();
    w.apply(&DownstreamMessage::Data(insert(1, "ada"))).unwrap();
    w.apply(&DownstreamMessage::Commit(commit_time)).unwrap();
    let first = w.take_committed().unwrap();
    assert_eq!(first.rows.len(), 1);
    assert_eq!(first.rows[0].updated_at, "2026-12-01T12:00:00.123Z");
    let moved = Change::Update(Update {
        relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
        key: None,
        new: row(json!({"id": 1, "title": "grace", "meta": null})),
        extra: Default::default(),
    });
    txn(&mut w, 0x300, vec![moved]);
    let second = w.take_committed().unwrap();
    use super::feed::FeedKind;
    assert_eq!(second.rows.len(), 2, "{second:?}");
    assert!(matches!(&second.rows[0].kind, FeedKind::Upsert { data } if data["title"] == "grace"));
    assert!(matches!(
        &second.rows[1].kind,
        FeedKind::Exit { old, new: Some(new) } if old["title"] == "ada" && new["title"] == "grace"
    ));
    assert_eq!(second.rows[0].seq, second.rows[1].seq);
    let ada = replay_scope(&w, "ada", [(1, "ada".to_owned())].into(), Some(1), 10);
    assert!(ada.is_empty(), "{ada:?}");
    let grace = replay_scope(&w, "grace", Default::default(), Some(1), 10);
    assert_eq!(grace, [(1, "grace".to_owned())].into());
}

/// Regression: a column added with a default the replica applies changed every row, but
/// the transaction's feed entries were empty, so live scope subscribers never saw the new
/// column until each row changed again.
#[test]
fn an_added_column_with_a_default_reaches_live_scope_subscribers() {
    let mut w = feed_writer();
    txn(&mut w, 0x200, vec![insert(1, "ada"), insert(2, "grace")]);
    w.take_committed();
    txn(
        &mut w,
        0x300,
        vec![add_column("points", "int4", "5", false)],
    );
    let committed = w.take_committed().unwrap();
    use super::feed::FeedKind;
    let mut points: Vec<_> = committed
        .rows
        .iter()
        .map(|r| match &r.kind {
            FeedKind::Upsert { data } => (data["id"].clone(), data["points"].clone()),
            other => panic!("expected upserts, found {other:?}"),
        })
        .collect();
    points.sort_by_key(|(id, _)| id.as_i64());
    assert_eq!(points, vec![(json!(1), json!(5)), (json!(2), json!(5))]);
    // A column that waits for its backfill changes no row now: nothing to send yet.
    txn(
        &mut w,
        0x400,
        vec![add_column("later", "timestamptz", "now()", true)],
    );
    assert!(w.take_committed().is_none_or(|c| c.rows.is_empty()));
}

#[test]
fn pruning_exits_raises_the_retention_floor() {
    let mut w = feed_writer();
    txn(&mut w, 0x200, vec![insert(1, "ada"), insert(2, "ada")]);
    let delete = Change::Delete(Delete {
        relation: rel("issue", &["id"], ReplicaIdentity::Default).into(),
        key: row(json!({"id": 1})),
        extra: Default::default(),
    });
    txn(&mut w, 0x300, vec![delete]);
    let conn = &w.replica().conn;
    assert_eq!(
        super::feed::retention_floor(conn).unwrap(),
        Some(0),
        "followed from the start"
    );
    assert_eq!(
        super::feed::prune_exits(conn, "1970-01-01T00:00:00.000Z").unwrap(),
        Some(0),
        "nothing is older than the epoch"
    );
    assert_eq!(
        super::feed::prune_exits(conn, "2100-01-01T00:00:00.000Z").unwrap(),
        Some(3)
    );
    // A page carries the floor its own read saw, with its rows.
    use super::feed::{read_scope_page, ScopePage, ScopeQuery};
    let conditions = highwater_engine::scope_sync::Conditions::default();
    let page = read_scope_page(
        conn,
        &w.replica().tables,
        &ScopeQuery {
            table: "issue",
            conditions: &conditions,
            row_filter: None,
            after: Some(1),
            up_to: None,
            limit: 10,
            count_total: false,
            access: &[],
        },
    )
    .unwrap();
    assert!(
        matches!(page, ScopePage::Rows { floor: Some(3), .. }),
        "{page:?}"
    );
}

#[test]
fn following_a_new_filter_column_raises_the_floor_to_now() {
    let mut w = feed_writer();
    txn(&mut w, 0x200, vec![insert(1, "ada"), insert(2, "ada")]);
    let same = [("issue".to_owned(), vec!["title".to_owned()])];
    w.enable_scope_feed(same.into_iter().collect()).unwrap();
    assert_eq!(
        super::feed::retention_floor(&w.replica().conn).unwrap(),
        Some(0)
    );
    let more = [(
        "issue".to_owned(),
        vec!["title".to_owned(), "meta".to_owned()],
    )];
    w.enable_scope_feed(more.into_iter().collect()).unwrap();
    assert_eq!(
        super::feed::retention_floor(&w.replica().conn).unwrap(),
        Some(2),
        "moves on `meta` before now were never journalled"
    );
}

proptest::proptest! {
    /// With the scope feed on, seqs are exactly those without it (a relay with other rules
    /// assigns the same), and every scope replayed from any cursor of the history lands on
    /// the upstream rows of that scope.
    #[test]
    fn the_scope_feed_keeps_seqs_and_replays_every_scope_from_any_cursor(
        txns in proptest::collection::vec(proptest::collection::vec(op(), 1..6), 1..10),
        cut in 0usize..10,
        limit in 1u32..4,
    ) {
        let mut plain = writer();
        let mut fed = feed_writer();
        let mut model = std::collections::BTreeMap::new();
        let mut history = vec![(None, model.clone())];
        let mut titles = std::collections::BTreeSet::new();
        for (i, ops) in txns.iter().enumerate() {
            let mut changes = Vec::new();
            for op in ops {
                if let Some(change) = change_of(op, &model) {
                    changes.push(change);
                    model_apply(&mut model, op);
                }
            }
            titles.extend(model.values().cloned());
            let lsn = 0x1000 + i as u64 * 0x10;
            txn(&mut plain, lsn, changes.clone());
            txn(&mut fed, lsn, changes);
            let seq = fed.replica().state().unwrap().next_seq - 1;
            history.push((Some(seq), model.clone()));
        }
        proptest::prop_assert_eq!(seqs(&plain), seqs(&fed));
        let (after, at_cursor) = history[cut % history.len()].clone();
        for title in &titles {
            let start = at_cursor
                .iter()
                .filter(|(_, t)| *t == title)
                .map(|(id, t)| (*id, t.clone()))
                .collect();
            let want: std::collections::BTreeMap<i64, String> = model
                .iter()
                .filter(|(_, t)| *t == title)
                .map(|(id, t)| (*id, t.clone()))
                .collect();
            let got = replay_scope(&fed, title, start, after, limit);
            proptest::prop_assert_eq!(got, want, "scope title = {:?} after {:?}", title, after);
        }
    }
}
