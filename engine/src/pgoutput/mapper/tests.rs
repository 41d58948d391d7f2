use super::*;

#[test]
fn commit_times_render_exactly_at_every_size() {
    let offset = i128::from(PG_EPOCH_UNIX_MS) * 1000;
    for pg in [
        0,
        1,
        -1,
        817_000_000_000_000, // 2025
        i64::MAX - offset as i64,
        i64::MAX - offset as i64 + 1, // the first past i64
        i64::MAX,
        i64::MIN,
    ] {
        let value = unix_micros(pg);
        assert_eq!(value.to_string(), (i128::from(pg) + offset).to_string());
    }
}
use crate::change_stream::encode_downstream;
use crate::pgoutput::frame::PgTimestamp;
use crate::pgoutput::message::{
    Begin, Commit, Delete, Insert, LogicalMessage, Origin, PgType, ReplicaIdentity, Truncate,
    Update,
};
use crate::pgoutput::test_encoder::{keepalive_frame, xlog};
use crate::pgoutput::TextValue;
use proptest::prelude::*;
use serde_json::json;

const USERS: u32 = 16385;
const TYPES: u32 = 16390;
const MOOD: u32 = 16400;
const MOOD_ARRAY: u32 = 16399;

fn column(name: &str, type_oid: u32, key: bool) -> RelationColumn {
    RelationColumn {
        flags: u8::from(key),
        name: name.into(),
        type_oid,
        type_modifier: -1,
    }
}

fn users(identity: ReplicaIdentity) -> Relation {
    Relation {
        oid: USERS,
        namespace: "public".into(),
        name: "users".into(),
        replica_identity: identity,
        columns: vec![
            column("id", 20, true),
            column("name", 25, false),
            column("bio", 25, false),
        ],
    }
}

/// One column per converted type.
fn types_relation() -> Relation {
    Relation {
        oid: TYPES,
        namespace: "app".into(),
        name: "types".into(),
        replica_identity: ReplicaIdentity::Default,
        columns: vec![
            column("id", 2950, true),
            column("big", 20, false),
            column("amount", 1700, false),
            column("doc", 3802, false),
            column("raw", 114, false),
            column("at", 1184, false),
            column("tags", 1009, false),
            column("mood", MOOD, false),
            column("moods", MOOD_ARRAY, false),
            column("ok", 16, false),
            column("n", 23, false),
            column("ratio", 701, false),
            column("day", 1082, false),
            column("blob", 17, false),
            column("scores", 1016, false),
        ],
    }
}

/// Feeds messages as XLogData frames, like the host does.
fn feed(
    mapper: &mut PgoutputMapper,
    message: PgoutputMessage<'_>,
) -> Result<Option<PgoutputEvent>, MappingError> {
    mapper.map_frame(&xlog(&message))
}

fn begin(lsn: u64) -> PgoutputMessage<'static> {
    PgoutputMessage::Begin(Begin {
        final_lsn: Lsn(lsn),
        commit_time: PgTimestamp(0),
        xid: 1,
    })
}

fn commit(lsn: u64) -> PgoutputMessage<'static> {
    PgoutputMessage::Commit(Commit {
        flags: 0,
        commit_lsn: Lsn(lsn),
        end_lsn: Lsn(lsn + 8),
        commit_time: PgTimestamp(0),
    })
}

/// A mapper that knows `relation` and is inside a transaction.
fn mapper_with(relation: Relation) -> PgoutputMapper {
    let mut mapper = PgoutputMapper::new();
    feed(&mut mapper, PgoutputMessage::Relation(relation)).unwrap();
    feed(&mut mapper, begin(0x100)).unwrap();
    mapper
}

fn change(event: Option<PgoutputEvent>) -> Change {
    match event {
        Some(PgoutputEvent::Downstream(DownstreamMessage::Data(change))) => change,
        other => panic!("expected a data message, got {other:?}"),
    }
}

fn wire(event: Option<PgoutputEvent>) -> serde_json::Value {
    match event {
        Some(PgoutputEvent::Downstream(message)) => {
            serde_json::from_str(&encode_downstream(&message)).unwrap()
        }
        Some(PgoutputEvent::Commit { commit, .. }) => {
            serde_json::from_str(&encode_downstream(&DownstreamMessage::Commit(commit))).unwrap()
        }
        other => panic!("expected a downstream message, got {other:?}"),
    }
}

fn text(s: &'static str) -> TupleValue<'static> {
    TupleValue::Text(s.as_bytes())
}

#[test]
fn begin_maps_to_stringified_json_and_final_lsn_watermark() {
    let mut mapper = PgoutputMapper::new();
    let event = feed(
        &mut mapper,
        PgoutputMessage::Begin(Begin {
            final_lsn: "0/16B3748".parse().unwrap(),
            commit_time: PgTimestamp(1_000_001),
            xid: 77,
        }),
    )
    .unwrap();
    assert!(mapper.in_transaction());
    assert_eq!(
        wire(event),
        json!(["begin",
            {"tag": "begin", "json": "s", "commitLsn": "0/16B3748", "commitTime": 946_684_801_000_001_i64, "xid": 77},
            {"commitWatermark": "4e672g"}])
    );
}

#[test]
fn commit_maps_commit_time_ms_and_commit_lsn_watermark() {
    let mut mapper = PgoutputMapper::new();
    feed(&mut mapper, begin(0x1A2B_3C4D)).unwrap();
    let event = feed(
        &mut mapper,
        PgoutputMessage::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn(0x1A2B_3C4D),
            end_lsn: Lsn(0x1A2B_3C80),
            // 2019-01-11T23:30:35.381101Z in Postgres-epoch microseconds.
            commit_time: PgTimestamp(600_564_635_381_101),
        }),
    )
    .unwrap();
    assert!(!mapper.in_transaction());
    assert!(
        matches!(&event, Some(PgoutputEvent::Commit { end_lsn, .. }) if *end_lsn == Lsn(0x1A2B_3C80)),
        "the commit carries its end LSN: {event:?}"
    );
    let value = wire(event);
    assert_eq!(value[0], "commit");
    assert_eq!(value[1]["commitTimeMs"], json!(1_547_249_435_381_i64));
    assert!(
        value[1].get("commitEndLsn").is_none(),
        "no position hidden in unknown keys"
    );
    assert_eq!(value[2], json!({"watermark": "579e6a5"}));
}

#[test]
fn commit_time_beyond_the_js_safe_range_is_left_out() {
    let mut mapper = PgoutputMapper::new();
    feed(&mut mapper, begin(9)).unwrap();
    let event = feed(
        &mut mapper,
        PgoutputMessage::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn(9),
            end_lsn: Lsn(10),
            commit_time: PgTimestamp(i64::MAX),
        }),
    )
    .unwrap();
    let Some(PgoutputEvent::Commit { commit, .. }) = event else {
        panic!("expected a commit");
    };
    assert_eq!(commit.commit_time_ms, None);
    assert_eq!(commit.watermark, Lsn(9).to_watermark());
}

#[test]
fn transaction_boundaries_are_checked() {
    let mut mapper = PgoutputMapper::new();
    assert_eq!(
        feed(&mut mapper, commit(5)),
        Err(MappingError::CommitWithoutBegin { commit: Lsn(5) })
    );
    feed(&mut mapper, begin(5)).unwrap();
    assert_eq!(
        feed(&mut mapper, begin(6)),
        Err(MappingError::NestedBegin {
            open: Lsn(5),
            next: Lsn(6)
        })
    );
    assert_eq!(
        feed(&mut mapper, commit(6)),
        Err(MappingError::CommitMismatch {
            begin: Lsn(5),
            commit: Lsn(6)
        })
    );
    feed(
        &mut mapper,
        PgoutputMessage::Relation(users(ReplicaIdentity::Default)),
    )
    .unwrap();
    let insert = PgoutputMessage::Insert(Insert {
        relation_oid: USERS,
        new: Tuple(vec![text("1"), text("a"), text("b")]),
    });
    let err = feed(&mut mapper, insert).unwrap_err();
    assert_eq!(err, MappingError::OutsideTransaction { kind: "an Insert" });
}

#[test]
fn insert_maps_relation_row_key_and_values() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Default));
    let event = feed(
        &mut mapper,
        PgoutputMessage::Insert(Insert {
            relation_oid: USERS,
            new: Tuple(vec![
                text("9007199254740993"),
                text("ann"),
                TupleValue::Null,
            ]),
        }),
    )
    .unwrap();
    assert_eq!(
        wire(event),
        json!(["data", {
            "tag": "insert",
            "relation": {
                "schema": "public",
                "name": "users",
                "rowKey": {"columns": ["id"], "type": "default"},
                "keyColumns": ["id"],
                "replicaIdentity": "default",
                "relationOid": 16385
            },
            "new": {"id": 9_007_199_254_740_993_u64, "name": "ann", "bio": null}
        }])
    );
}

#[test]
fn values_convert_by_type_oid() {
    let mut mapper = PgoutputMapper::new();
    // Enum types arrive as Type messages before the Relation that uses them.
    feed(
        &mut mapper,
        PgoutputMessage::Type(PgType {
            oid: MOOD,
            namespace: "app".into(),
            name: "mood".into(),
        }),
    )
    .unwrap();
    feed(
        &mut mapper,
        PgoutputMessage::Type(PgType {
            oid: MOOD_ARRAY,
            namespace: "app".into(),
            name: "_mood".into(),
        }),
    )
    .unwrap();
    feed(&mut mapper, PgoutputMessage::Relation(types_relation())).unwrap();
    feed(&mut mapper, begin(0x100)).unwrap();
    let Change::Insert(insert) = change(
        feed(
            &mut mapper,
            PgoutputMessage::Insert(Insert {
                relation_oid: TYPES,
                new: Tuple(vec![
                    text("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
                    text("-9223372036854775808"),
                    text("1234567890123456789.000100"),
                    text(r#"{"a": 1, "b": [true]}"#),
                    text(r#"[1,  2]"#),
                    text("2019-01-12 00:30:35.381101+01"),
                    text(r#"{plain,"with space","quote\"d",NULL,"NULL"}"#),
                    text("happy"),
                    text("{happy,sad}"),
                    text("t"),
                    text("-42"),
                    text("Infinity"),
                    text("2000-01-01"),
                    text("\\xdeadbeef"),
                    text("{{1,NULL},{9007199254740993,2}}"),
                ]),
            }),
        )
        .unwrap(),
    ) else {
        panic!("expected an insert");
    };
    let row = serde_json::to_string(&insert.new).unwrap();
    assert_eq!(
        row,
        concat!(
            r#"{"id":"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11","big":-9223372036854775808,"#,
            r#""amount":1234567890123456789.000100,"doc":"{\"a\": 1, \"b\": [true]}","#,
            r#""raw":"[1,  2]","at":1547249435381.101,"#,
            r#""tags":["plain","with space","quote\"d",null,"NULL"],"mood":"happy","#,
            r#""moods":["happy","sad"],"ok":true,"n":-42,"ratio":null,"day":946684800000,"#,
            r#""blob":"\\xdeadbeef","scores":[[1,null],[9007199254740993,2]]}"#
        )
    );
}

#[test]
fn invalid_values_name_the_column_and_type() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Default));
    let err = feed(
        &mut mapper,
        PgoutputMessage::Insert(Insert {
            relation_oid: USERS,
            new: Tuple(vec![text("twelve"), text("a"), text("b")]),
        }),
    )
    .unwrap_err();
    assert_eq!(
        err,
        MappingError::InvalidValue {
            table: "public.users".into(),
            column: "id".into(),
            type_oid: 20,
            expected: "an integer",
            len: 6,
        }
    );
    assert!(err
        .to_string()
        .starts_with("expected an integer in column id of public.users"));
    let err = feed(
        &mut mapper,
        PgoutputMessage::Insert(Insert {
            relation_oid: USERS,
            new: Tuple(vec![text("1"), TupleValue::Text(b"\xff"), text("b")]),
        }),
    )
    .unwrap_err();
    assert!(matches!(err, MappingError::InvalidUtf8 { .. }));
}

#[test]
fn binary_values_are_a_typed_error() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Default));
    let err = feed(
        &mut mapper,
        PgoutputMessage::Insert(Insert {
            relation_oid: USERS,
            new: Tuple(vec![TupleValue::Binary(&[0; 8]), text("a"), text("b")]),
        }),
    )
    .unwrap_err();
    assert_eq!(
        err,
        MappingError::BinaryValue {
            table: "public.users".into(),
            column: "id".into()
        }
    );
}

#[test]
fn unknown_relation_and_column_count_mismatch_are_errors() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Default));
    let err = feed(
        &mut mapper,
        PgoutputMessage::Insert(Insert {
            relation_oid: 99,
            new: Tuple(vec![]),
        }),
    )
    .unwrap_err();
    assert_eq!(
        err,
        MappingError::UnknownRelation(UnknownRelation { oid: 99 })
    );
    let err = feed(
        &mut mapper,
        PgoutputMessage::Insert(Insert {
            relation_oid: USERS,
            new: Tuple(vec![text("1"), text("a")]),
        }),
    )
    .unwrap_err();
    assert!(matches!(
        err,
        MappingError::ColumnCount {
            expected: 3,
            found: 2,
            ..
        }
    ));
}

#[test]
fn update_without_old_tuple_has_null_key() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Default));
    let Change::Update(update) = change(
        feed(
            &mut mapper,
            PgoutputMessage::Update(Update {
                relation_oid: USERS,
                old: None,
                new: Tuple(vec![text("1"), text("bo"), TupleValue::Null]),
            }),
        )
        .unwrap(),
    ) else {
        panic!("expected an update");
    };
    assert_eq!(update.key, None);
    assert_eq!(
        json!(update.new),
        json!({"id": 1, "name": "bo", "bio": null})
    );
}

#[test]
fn key_change_maps_the_key_tuple_to_key_columns_only() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Default));
    let event = feed(
        &mut mapper,
        PgoutputMessage::Update(Update {
            relation_oid: USERS,
            // Postgres sends non-key columns of a key tuple as nulls.
            old: Some(OldTuple::Key(Tuple(vec![
                text("1"),
                TupleValue::Null,
                TupleValue::Null,
            ]))),
            new: Tuple(vec![text("2"), text("bo"), text("x")]),
        }),
    )
    .unwrap();
    let value = wire(event);
    assert_eq!(value[1]["key"], json!({"id": 1}));
    assert_eq!(value[1]["new"], json!({"id": 2, "name": "bo", "bio": "x"}));
}

#[test]
fn unchanged_toast_is_omitted_from_new() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Default));
    let Change::Update(update) = change(
        feed(
            &mut mapper,
            PgoutputMessage::Update(Update {
                relation_oid: USERS,
                old: None,
                new: Tuple(vec![text("1"), text("bo"), TupleValue::UnchangedToast]),
            }),
        )
        .unwrap(),
    ) else {
        panic!("expected an update");
    };
    assert_eq!(json!(update.new), json!({"id": 1, "name": "bo"}));
    // A key tuple's null placeholders are not old values.
    let Change::Update(update) = change(
        feed(
            &mut mapper,
            PgoutputMessage::Update(Update {
                relation_oid: USERS,
                old: Some(OldTuple::Key(Tuple(vec![
                    text("1"),
                    TupleValue::Null,
                    TupleValue::Null,
                ]))),
                new: Tuple(vec![text("2"), text("bo"), TupleValue::UnchangedToast]),
            }),
        )
        .unwrap(),
    ) else {
        panic!("expected an update");
    };
    assert_eq!(json!(update.new), json!({"id": 2, "name": "bo"}));
}

#[test]
fn replica_identity_full_keys_by_old_row_and_fills_toast_from_it() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Full));
    let event = feed(
        &mut mapper,
        PgoutputMessage::Update(Update {
            relation_oid: USERS,
            old: Some(OldTuple::Full(Tuple(vec![
                text("1"),
                text("al"),
                text("long bio"),
            ]))),
            new: Tuple(vec![text("1"), text("bo"), TupleValue::UnchangedToast]),
        }),
    )
    .unwrap();
    let value = wire(event);
    assert_eq!(
        value[1]["relation"]["rowKey"],
        json!({"columns": ["id"], "type": "full"})
    );
    assert_eq!(
        value[1]["key"],
        json!({"id": 1, "name": "al", "bio": "long bio"})
    );
    assert_eq!(
        value[1]["new"],
        json!({"id": 1, "name": "bo", "bio": "long bio"})
    );

    let Change::Delete(delete) = change(
        feed(
            &mut mapper,
            PgoutputMessage::Delete(Delete {
                relation_oid: USERS,
                old: OldTuple::Full(Tuple(vec![text("1"), text("bo"), TupleValue::Null])),
            }),
        )
        .unwrap(),
    ) else {
        panic!("expected a delete");
    };
    assert_eq!(
        json!(delete.key),
        json!({"id": 1, "name": "bo", "bio": null})
    );
}

#[test]
fn delete_with_key_tuple_keys_by_key_columns() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Default));
    let value = wire(
        feed(
            &mut mapper,
            PgoutputMessage::Delete(Delete {
                relation_oid: USERS,
                old: OldTuple::Key(Tuple(vec![text("7"), TupleValue::Null, TupleValue::Null])),
            }),
        )
        .unwrap(),
    );
    assert_eq!(value[1]["tag"], "delete");
    assert_eq!(value[1]["key"], json!({"id": 7}));
}

#[test]
fn truncate_maps_every_relation_and_rejects_unknown_ones() {
    let mut mapper = mapper_with(users(ReplicaIdentity::Default));
    feed(&mut mapper, PgoutputMessage::Relation(types_relation())).unwrap();
    let Change::Truncate(truncate) = change(
        feed(
            &mut mapper,
            PgoutputMessage::Truncate(Truncate {
                options: 0,
                relation_oids: vec![USERS, TYPES],
            }),
        )
        .unwrap(),
    ) else {
        panic!("expected a truncate");
    };
    let names: Vec<_> = truncate.relations.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["users", "types"]);
    assert_eq!(
        feed(
            &mut mapper,
            PgoutputMessage::Truncate(Truncate {
                options: 0,
                relation_oids: vec![USERS, 5],
            })
        ),
        Err(MappingError::UnknownRelation(UnknownRelation { oid: 5 }))
    );
}

#[test]
fn relation_messages_replace_the_cached_shape() {
    let mut mapper = PgoutputMapper::new();
    let first = feed(
        &mut mapper,
        PgoutputMessage::Relation(users(ReplicaIdentity::Default)),
    )
    .unwrap();
    assert!(matches!(
        first,
        Some(PgoutputEvent::Relation { previous: None, .. })
    ));
    let mut altered = users(ReplicaIdentity::Default);
    altered.columns.push(column("age", 23, false));
    let Some(PgoutputEvent::Relation { relation, previous }) =
        feed(&mut mapper, PgoutputMessage::Relation(altered.clone())).unwrap()
    else {
        panic!("expected a relation event");
    };
    assert_eq!(relation, altered);
    assert_eq!(previous, Some(users(ReplicaIdentity::Default)));
    feed(&mut mapper, begin(1)).unwrap();
    let Change::Insert(insert) = change(
        feed(
            &mut mapper,
            PgoutputMessage::Insert(Insert {
                relation_oid: USERS,
                new: Tuple(vec![text("1"), text("a"), text("b"), text("30")]),
            }),
        )
        .unwrap(),
    ) else {
        panic!("expected an insert");
    };
    assert_eq!(insert.new.get("age"), Some(&json!(30)));
}

#[test]
fn keepalives_carry_the_wal_end_watermark_and_reply_flag() {
    let mut mapper = PgoutputMapper::new();
    let event = mapper
        .map_frame(&keepalive_frame(&PrimaryKeepalive {
            wal_end: "16/B374D848".parse().unwrap(),
            send_time: PgTimestamp(0),
            reply_requested: true,
        }))
        .unwrap();
    assert_eq!(
        event,
        Some(PgoutputEvent::Keepalive(Keepalive {
            wal_end: Lsn(0x16_B374_D848),
            watermark: Watermark::parse("718sh0nk8").unwrap(),
            reply_requested: true,
        }))
    );
}

#[test]
fn logical_messages_surface_and_origin_is_ignored() {
    let mut mapper = PgoutputMapper::new();
    let event = feed(
        &mut mapper,
        PgoutputMessage::Message(LogicalMessage {
            transactional: true,
            lsn: Lsn(10),
            prefix: "zero/0/ddl",
            content: b"{}",
        }),
    )
    .unwrap();
    assert_eq!(
        event,
        Some(PgoutputEvent::LogicalMessage(EmittedMessage {
            transactional: true,
            lsn: Lsn(10),
            prefix: "zero/0/ddl".into(),
            content: b"{}".to_vec(),
        }))
    );
    let origin = PgoutputMessage::Origin(Origin {
        commit_lsn: Lsn(1),
        name: "other",
    });
    assert_eq!(feed(&mut mapper, origin), Ok(None));
}

#[test]
fn malformed_frames_are_decode_errors() {
    let mut mapper = PgoutputMapper::new();
    assert!(matches!(
        mapper.map_frame(b""),
        Err(MappingError::Decode(_))
    ));
    let mut frame = xlog(&begin(1));
    frame.truncate(frame.len() - 1);
    assert!(matches!(
        mapper.map_frame(&frame),
        Err(MappingError::Decode(_))
    ));
    assert!(!mapper.in_transaction());
}

fn transcript_line(event: Option<PgoutputEvent>) -> String {
    match event {
        None => "null".into(),
        Some(PgoutputEvent::Commit { commit, end_lsn }) => {
            let message = DownstreamMessage::Commit(commit);
            let text = encode_downstream(&message);
            let again = crate::change_stream::decode_downstream(&text).unwrap();
            assert_eq!(again, message, "{text}");
            // One JSON line: the commit as sent, and the end LSN that is confirmed upstream.
            format!("{{\"commit\":{text},\"endLsn\":\"{end_lsn}\"}}")
        }
        Some(PgoutputEvent::Downstream(message)) => {
            let text = encode_downstream(&message);
            // Whatever the mapper emits is a valid change-stream message.
            let again = crate::change_stream::decode_downstream(&text).unwrap();
            assert_eq!(again, message, "{text}");
            text
        }
        Some(PgoutputEvent::Relation { relation, previous }) => json!({
            "relation": format!("{}.{}", relation.namespace, relation.name),
            "columns": relation.columns.iter().map(|c| &c.name).collect::<Vec<_>>(),
            "replaces": previous.is_some(),
        })
        .to_string(),
        Some(PgoutputEvent::LogicalMessage(m)) => json!({
            "message": m.prefix,
            "transactional": m.transactional,
            "content": String::from_utf8_lossy(&m.content),
        })
        .to_string(),
        Some(PgoutputEvent::Keepalive(k)) => json!({"keepalive": k.watermark.as_str()}).to_string(),
        Some(PgoutputEvent::RowText(row)) => {
            transcript_line(Some(downstream(DownstreamMessage::Data(row.to_change()))))
        }
    }
}

/// Maps `message` with `json` and with `text` (a mapper keeping row text): a row change of
/// `text` must be exactly `json`'s change, and everything else (errors included) the same.
fn twin(
    json: &mut PgoutputMapper,
    text: &mut PgoutputMapper,
    message: PgoutputMessage<'_>,
) -> Result<Option<PgoutputEvent>, MappingError> {
    let from_json = json.map_message(message.clone());
    let from_text = text.map_message(message);
    match (&from_json, from_text) {
        (
            Ok(Some(PgoutputEvent::Downstream(DownstreamMessage::Data(change)))),
            Ok(Some(PgoutputEvent::RowText(row))),
        ) => assert_eq!(&row.to_change(), change),
        (Ok(Some(PgoutputEvent::RowText(_))), _) => panic!("a JSON mapper made a text row"),
        (from_json, from_text) => assert_eq!(from_json, &from_text),
    }
    from_json
}

#[test]
fn a_mapper_keeping_row_text_makes_row_changes_of_text_and_the_same_changes() {
    let mut json = PgoutputMapper::new();
    let mut text = PgoutputMapper::new();
    text.keep_row_text();
    for mapper in [&mut json, &mut text] {
        feed(
            mapper,
            PgoutputMessage::Relation(users(ReplicaIdentity::Full)),
        )
        .unwrap();
        feed(mapper, begin(0x100)).unwrap();
    }
    let t = |s: &'static str| TupleValue::Text(s.as_bytes());
    let insert = PgoutputMessage::Insert(Insert {
        relation_oid: USERS,
        new: Tuple(vec![t("7"), t("ann"), TupleValue::Null]),
    });
    match text.map_message(insert.clone()).unwrap() {
        Some(PgoutputEvent::RowText(row)) => {
            assert_eq!(row.tag(), "insert");
            let TextRowKind::Insert { new } = &row.kind else {
                panic!("{row:?}")
            };
            let values: Vec<_> = new.iter().collect();
            assert_eq!(
                values,
                [
                    (0, TextValue::Scalar(ScalarText::Number("7"))),
                    (1, TextValue::Scalar(ScalarText::String("ann"))),
                    (2, TextValue::Scalar(ScalarText::Null)),
                ]
            );
            assert_eq!(&*row.columns, ["id", "name", "bio"]);
        }
        other => panic!("expected a text row, got {other:?}"),
    }
    // Under replica identity FULL an unchanged TOAST value comes from the old row.
    let update = PgoutputMessage::Update(Update {
        relation_oid: USERS,
        old: Some(OldTuple::Full(Tuple(vec![t("7"), t("ann"), t("long bio")]))),
        new: Tuple(vec![t("8"), t("ann"), TupleValue::UnchangedToast]),
    });
    twin(&mut json, &mut text, update).unwrap();
    let delete = PgoutputMessage::Delete(Delete {
        relation_oid: USERS,
        old: OldTuple::Full(Tuple(vec![t("8"), t("ann"), t("long bio")])),
    });
    twin(&mut json, &mut text, delete).unwrap();
    // The same typed errors.
    let bad = PgoutputMessage::Insert(Insert {
        relation_oid: USERS,
        new: Tuple(vec![t("seven"), t("ann"), TupleValue::Null]),
    });
    assert!(matches!(
        twin(&mut json, &mut text, bad),
        Err(MappingError::InvalidValue { .. })
    ));
}

/// Texts of every converted type, valid and not: what a column of `types_relation` is
/// drawn from, besides arbitrary text.
const SAMPLE_TEXTS: &[&str] = &[
    "0",
    "-12",
    "007",
    "9007199254740993",
    "3.14",
    "-0.5",
    "1e+20",
    "1e-7",
    "1E5",
    "1e5",
    "NaN",
    "Infinity",
    "-Infinity",
    "t",
    "f",
    "true",
    "2024-01-02",
    "infinity",
    "2024-01-02 03:04:05.123456+00",
    "2024-01-02 03:04:05",
    "0044-03-15 12:00:00 BC",
    "12:34:56.5",
    "12:34:56+02",
    "{1,2,3}",
    "{\"a b\",NULL}",
    "{}",
    "{{1,2},{3,4}}",
    "{\"k\": [1, 2.5e3]}",
    "null",
    "\\x00ff",
    "a1b2c3d4-0000-0000-0000-000000000000",
    "",
    " ",
    "é",
];

fn tuple_value() -> impl Strategy<Value = TupleValue<'static>> {
    prop_oneof![
        Just(TupleValue::Null),
        Just(TupleValue::UnchangedToast),
        proptest::sample::select(SAMPLE_TEXTS).prop_map(|s| TupleValue::Text(s.as_bytes())),
        proptest::sample::select(SAMPLE_TEXTS).prop_map(|s| TupleValue::Text(s.as_bytes())),
        ".{0,12}".prop_map(|s| TupleValue::Text(String::leak(s).as_bytes())),
    ]
}

/// Valid texts for each column of `types_relation`, in its order.
fn valid_texts(position: usize) -> &'static [&'static str] {
    const TEXT: &[&str] = &["", "é", "a b", "{\"k\": 1}", "\\x00ff", "null"];
    const INT: &[&str] = &["0", "-12", "9007199254740993", "2147483647"];
    const NUMBER: &[&str] = &[
        "3.14", "-0.5", "1e+20", "1E5", "1e5", "-0", "NaN", "Infinity",
    ];
    const AT: &[&str] = &[
        "2024-01-02 03:04:05.123456+00",
        "2024-01-02 03:04:05-07:30",
        "0044-03-15 12:00:00+00 BC",
        "infinity",
        "-infinity",
    ];
    const ARRAY: &[&str] = &["{1,2,3}", "{\"a b\",NULL}", "{}", "{{1,2},{3,4}}"];
    const INT_ARRAY: &[&str] = &["{1,2,3}", "{NULL,-5}", "{}", "{{1,2},{3,4}}"];
    const DAY: &[&str] = &["2024-01-02", "infinity", "0044-03-15 BC"];
    match position {
        1 | 10 => INT,
        2 | 11 => NUMBER,
        5 => AT,
        6 | 8 => ARRAY,
        14 => INT_ARRAY,
        9 => &["t", "f"],
        12 => DAY,
        _ => TEXT,
    }
}

/// Every text `typed_tuple` draws as valid maps, in both forms: the property test below
/// compares values, not mostly errors.
#[test]
fn every_valid_text_maps() {
    let mut json = mapper_with(types_relation());
    let mut text = mapper_with(types_relation());
    text.keep_row_text();
    let longest = (0..15).map(|p| valid_texts(p).len()).max().unwrap();
    for k in 0..longest {
        let new = Tuple(
            (0..15)
                .map(|p| {
                    let texts = valid_texts(p);
                    TupleValue::Text(texts[k % texts.len()].as_bytes())
                })
                .collect(),
        );
        let insert = PgoutputMessage::Insert(Insert {
            relation_oid: TYPES,
            new,
        });
        twin(&mut json, &mut text, insert).unwrap();
    }
}

/// A tuple of `types_relation`, mostly valid (so that most rows map), sometimes not.
fn typed_tuple() -> impl Strategy<Value = Tuple<'static>> {
    let columns: Vec<_> = (0..15)
        .map(|position| {
            prop_oneof![
                40 => proptest::sample::select(valid_texts(position))
                    .prop_map(|s| TupleValue::Text(s.as_bytes())),
                1 => tuple_value(),
            ]
        })
        .collect();
    columns.prop_map(Tuple)
}

/// Golden transcript: pgoutput v1 bytes captured from Postgres 15 with
/// `pg_logical_slot_peek_binary_changes(…, 'proto_version', '1', 'messages', 'true')` (one
/// `lsn|hex` line per message; rows with large TOASTed values left out) and what they map to.
#[test]
fn postgres_15_capture_maps_to_the_golden_transcript() {
    let input = include_str!("../testdata/pg15_session.hex");
    let expected: Vec<&str> = include_str!("../testdata/pg15_session.expected.jsonl")
        .lines()
        .collect();
    let mut mapper = PgoutputMapper::new();
    let mut text_mapper = PgoutputMapper::new();
    text_mapper.keep_row_text();
    let actual: Vec<String> = input
        .lines()
        .map(|line| {
            let (_, hex) = line.split_once('|').unwrap();
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            let message = PgoutputMessage::decode(&bytes).unwrap();
            transcript_line(twin(&mut mapper, &mut text_mapper, message).unwrap())
        })
        .collect();
    if actual != expected {
        eprintln!("{}", actual.join("\n"));
    }
    assert_eq!(actual, expected);
}

proptest! {
    /// Random frames after a valid relation and begin never panic the mapper.
    #[test]
    fn arbitrary_frames_never_panic(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..48), 0..8)) {
        let mut mapper = mapper_with(users(ReplicaIdentity::Full));
        for frame in frames {
            let mut bytes = vec![b'w'];
            bytes.extend_from_slice(&[0; 24]);
            bytes.extend_from_slice(&frame);
            let _ = mapper.map_frame(&bytes);
            let _ = mapper.map_frame(&frame);
        }
    }

    /// Whatever a row change carries (any type's text, NULLs, unchanged TOAST, key and full
    /// old tuples), a mapper keeping row text makes exactly the JSON mapper's change, or the
    /// same error.
    #[test]
    fn text_rows_are_the_json_rows(
        messages in proptest::collection::vec(
            (0u8..5, typed_tuple(), typed_tuple()),
            1..6,
        ),
    ) {
        let mut json = PgoutputMapper::new();
        let mut text = PgoutputMapper::new();
        text.keep_row_text();
        let announce = PgoutputMessage::Type(PgType {
            oid: MOOD_ARRAY,
            namespace: "app".into(),
            name: "_mood".into(),
        });
        for message in [PgoutputMessage::Relation(types_relation()), announce, begin(0x100)] {
            twin(&mut json, &mut text, message).unwrap();
        }
        for (kind, new, old) in messages {
            let message = match kind {
                0 => PgoutputMessage::Insert(Insert { relation_oid: TYPES, new }),
                1 => PgoutputMessage::Update(Update { relation_oid: TYPES, old: None, new }),
                2 => PgoutputMessage::Update(Update {
                    relation_oid: TYPES,
                    old: Some(OldTuple::Key(old)),
                    new,
                }),
                3 => PgoutputMessage::Update(Update {
                    relation_oid: TYPES,
                    old: Some(OldTuple::Full(old)),
                    new,
                }),
                _ => PgoutputMessage::Delete(Delete { relation_oid: TYPES, old: OldTuple::Full(old) }),
            };
            // Most rows map (see `every_valid_text_maps`); the rest fail the same way.
            let _ = twin(&mut json, &mut text, message);
        }
    }

    /// Any text in any column of a well-formed insert maps or fails with a typed error.
    #[test]
    fn arbitrary_values_map_or_fail_cleanly(values in proptest::collection::vec(proptest::option::of(".{0,24}"), 15)) {
        let mut mapper = mapper_with(types_relation());
        let leaked: Vec<TupleValue<'static>> = values
            .into_iter()
            .map(|v| v.map_or(TupleValue::Null, |s| TupleValue::Text(String::leak(s).as_bytes())))
            .collect();
        let result = feed(&mut mapper, PgoutputMessage::Insert(Insert { relation_oid: TYPES, new: Tuple(leaked) }));
        let clean = matches!(result, Ok(Some(_)) | Err(MappingError::InvalidValue { .. }));
        prop_assert!(clean, "unexpected result {:?}", result);
    }
}
