use super::*;
use crate::change_stream::decode_downstream_frame;
use crate::change_stream::{decode_downstream, decode_upstream, BatchPayload, Frame};
use crate::watermark::{Lsn, StateVersion, Watermark, U256};
use proptest::prelude::*;
use serde_json::{json, Map, Number};
use std::str::FromStr;

#[test]
fn header_end_finds_the_inner_object_of_begin_and_commit() {
    for text in [
        r#"["begin",{"tag":"begin","note":"a },{ b]"},{"commitWatermark":"0a"}]"#,
        r#"["commit",{"tag":"commit","commitTime":3},{"watermark":"0a"}]"#,
    ] {
        let message = crate::change_stream::decode_downstream(text).expect("message");
        let encoded = encode_downstream(&message);
        let start = encoded.find(",{").expect("inner object") + 1;
        let end = header_end(&message, &encoded).expect("a three-element tuple");
        let inner = &encoded[start..end];
        assert_eq!(
            serde_json::from_str::<Value>(inner).ok(),
            encode_downstream_value(&message).get(1).cloned(),
            "{inner}"
        );
    }
    let status =
        crate::change_stream::decode_downstream(r#"["status",{"tag":"status"}]"#).expect("message");
    assert_eq!(header_end(&status, &encode_downstream(&status)), None);
}

#[test]
fn extra_keys_that_name_written_fields_are_skipped() {
    let mut relation = Relation::new("s", "t", RowKey::new(vec!["id".into()], None));
    relation.extra.insert("schema".into(), json!("other"));
    relation.extra.insert("relationOid".into(), json!(16384));
    let mut insert = Insert {
        relation: relation.into(),
        new: Map::new(),
        extra: Map::new(),
    };
    insert.extra.insert("tag".into(), json!("delete"));
    let text = encode_change(&Change::Insert(insert));
    assert_eq!(
        text,
        r#"{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]},"relationOid":16384},"new":{}}"#
    );
}

#[test]
fn begin_and_commit_keep_extras_in_both_objects() {
    let text = r#"["begin",{"tag":"begin","json":"s","commitLsn":"0/1A2B3C4D","commitTime":1726600000000000,"xid":771},{"commitWatermark":"579e6a5","x":[1]}]"#;
    let m = decode_downstream(text).expect("valid");
    assert_eq!(encode_downstream(&m), text);
    let text = r#"["commit",{"tag":"commit","commitTimeMs":1726600000000.25,"flags":0},{"watermark":"579e6a5"}]"#;
    let m = decode_downstream(text).expect("valid");
    assert_eq!(encode_downstream(&m), text);
}

#[test]
fn deprecated_relation_is_re_encoded_with_row_key_and_keeps_the_old_fields() {
    let text = r#"["data",{"tag":"delete","relation":{"schema":"s","name":"t","keyColumns":["id"],"replicaIdentity":"default"},"key":{"id":1}}]"#;
    let m = decode_downstream(text).expect("valid");
    assert_eq!(
        encode_downstream(&m),
        r#"["data",{"tag":"delete","relation":{"schema":"s","name":"t","keyColumns":["id"],"replicaIdentity":"default","rowKey":{"columns":["id"],"type":"default"}},"key":{"id":1}}]"#
    );
}

#[test]
fn encode_value_matches_encode_text() {
    let m = DownstreamMessage::Error(StreamError::new(
        ErrorKind::WatermarkTooOld,
        "earliest supported watermark is 0a (requested 01)",
    ));
    let value = encode_downstream_value(&m);
    assert_eq!(
        value,
        json!(["error", {"type": 2, "message": "earliest supported watermark is 0a (requested 01)"}])
    );
    assert_eq!(value.to_string(), encode_downstream(&m));
    let up = UpstreamMessage::ReserveSnapshot(ReserveSnapshot {
        task_id: "task-1".into(),
        extra: Map::new(),
    });
    assert_eq!(
        encode_upstream_value(&up),
        json!(["reserve-snapshot", {"taskID": "task-1"}])
    );
    assert_eq!(decode_upstream(&encode_upstream(&up)), Ok(up));
}

// ---- generators for the round-trip properties ----

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "-?[1-9][0-9]{15,40}".prop_map(|d| Value::Number(Number::from_str(&d).expect("digits"))),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "\\PC{0,12}".prop_map(Value::String),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("\\PC{0,6}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

fn extra() -> impl Strategy<Value = Extra> {
    prop::collection::vec(("x[A-Za-z_]{0,6}", json_value()), 0..3)
        .prop_map(|kv| kv.into_iter().collect())
}

fn row() -> impl Strategy<Value = Row> {
    prop::collection::vec(("\\PC{1,8}", json_value()), 0..4).prop_map(|kv| kv.into_iter().collect())
}

fn safe_number() -> impl Strategy<Value = Number> {
    prop_oneof![
        (-(1i64 << 53) + 1..(1i64 << 53)).prop_map(Number::from),
        (-1e15f64..1e15).prop_map(|f| Number::from_f64(f).unwrap_or_else(|| Number::from(0))),
    ]
}

fn watermark() -> impl Strategy<Value = Watermark> {
    (any::<u64>(), prop::option::of(0u64..1000)).prop_map(|(major, minor)| match minor {
        None => Lsn(major).to_watermark(),
        Some(minor) => StateVersion {
            major: U256::from(major),
            minor: Some(U256::from(minor)),
        }
        .to_watermark()
        .unwrap_or_else(|| Lsn(major).to_watermark()),
    })
}

fn name() -> impl Strategy<Value = String> {
    "[a-z_][a-z0-9_ ]{0,8}"
}

fn replica_identity() -> impl Strategy<Value = ReplicaIdentity> {
    prop_oneof![
        Just(ReplicaIdentity::Default),
        Just(ReplicaIdentity::Nothing),
        Just(ReplicaIdentity::Full),
        Just(ReplicaIdentity::Index),
    ]
}

fn row_key() -> impl Strategy<Value = RowKey> {
    (
        prop::collection::vec(name(), 0..3),
        prop::option::of(replica_identity()),
        extra(),
    )
        .prop_map(|(columns, r#type, extra)| RowKey {
            columns,
            r#type,
            extra,
        })
}

fn relation() -> impl Strategy<Value = Relation> {
    (
        name(),
        name(),
        row_key(),
        prop::option::of(prop::collection::vec(name(), 0..3)),
        prop::option::of(replica_identity()),
        extra(),
    )
        .prop_map(
            |(schema, name, row_key, key_columns, replica_identity, extra)| Relation {
                schema,
                name,
                row_key,
                key_columns,
                replica_identity,
                extra,
            },
        )
}

fn new_relation() -> impl Strategy<Value = NewRelation> {
    (name(), name(), row_key(), extra()).prop_map(|(schema, name, row_key, extra)| NewRelation {
        schema,
        name,
        row_key,
        extra,
    })
}

fn identifier() -> impl Strategy<Value = Identifier> {
    (name(), name(), extra()).prop_map(|(schema, name, extra)| Identifier {
        schema,
        name,
        extra,
    })
}

fn type_class() -> impl Strategy<Value = PgTypeClass> {
    prop::sample::select(vec![
        PgTypeClass::Base,
        PgTypeClass::Composite,
        PgTypeClass::Domain,
        PgTypeClass::Enum,
        PgTypeClass::Pseudo,
        PgTypeClass::Range,
        PgTypeClass::Multirange,
    ])
}

fn column_spec() -> impl Strategy<Value = ColumnSpec> {
    (
        safe_number(),
        name(),
        prop::option::of(type_class()),
        prop::option::of(prop::option::of(type_class())),
        prop::option::of(prop::option::of(safe_number())),
        prop::option::of(prop::option::of(any::<bool>())),
        prop::option::of(prop::option::of(name())),
        extra(),
    )
        .prop_map(|(pos, data_type, c, e, l, n, d, extra)| ColumnSpec {
            pos,
            data_type,
            pg_type_class: c,
            elem_pg_type_class: e,
            character_maximum_length: l,
            not_null: n,
            dflt: d,
            extra,
        })
}

fn column_def() -> impl Strategy<Value = ColumnDef> {
    (name(), column_spec(), extra()).prop_map(|(name, spec, extra)| ColumnDef { name, spec, extra })
}

fn table_metadata() -> impl Strategy<Value = TableMetadata> {
    (row(), extra()).prop_map(|(row_key, extra)| TableMetadata { row_key, extra })
}

fn backfill_id() -> impl Strategy<Value = BackfillId> {
    row().prop_map(Value::Object)
}

fn progress_mark() -> impl Strategy<Value = ProgressMark> {
    let field = prop_oneof![
        "\\PC{0,6}".prop_map(Value::String),
        safe_number().prop_map(Value::Number)
    ];
    (
        "[0-9a-z]{1,8}",
        prop::option::of("[0-9]{1,3}"),
        prop::collection::vec(("x[a-z]{0,4}", field), 0..2),
    )
        .prop_map(|(progress_mark, timeline, extra)| ProgressMark {
            progress_mark,
            timeline,
            extra: extra.into_iter().collect(),
        })
}

fn download_status() -> impl Strategy<Value = DownloadStatus> {
    (
        safe_number(),
        safe_number(),
        prop::option::of(safe_number()),
        extra(),
    )
        .prop_map(|(rows, total_rows, total_bytes, extra)| DownloadStatus {
            rows,
            total_rows,
            total_bytes,
            extra,
        })
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        (relation(), row(), extra()).prop_map(|(relation, new, extra)| Change::Insert(Insert {
            relation: relation.into(),
            new,
            extra
        })),
        (relation(), prop::option::of(row()), row(), extra()).prop_map(
            |(relation, key, new, extra)| Change::Update(Update {
                relation: relation.into(),
                key,
                new,
                extra
            })
        ),
        (relation(), row(), extra()).prop_map(|(relation, key, extra)| Change::Delete(Delete {
            relation: relation.into(),
            key,
            extra
        })),
        (prop::collection::vec(relation(), 0..3), extra())
            .prop_map(|(relations, extra)| Change::Truncate(Truncate { relations, extra })),
        (
            new_relation(),
            prop::collection::vec(name(), 0..3),
            watermark(),
            prop::collection::vec(prop::collection::vec(json_value(), 0..3), 0..3),
            prop::option::of((prop::option::of(progress_mark()), progress_mark(), extra())),
            prop::option::of(download_status()),
            extra(),
        )
            .prop_map(
                |(relation, columns, watermark, row_values, marks, status, extra)| {
                    Change::Backfill(Backfill {
                        relation,
                        columns,
                        watermark,
                        row_values,
                        progress_marks: marks.map(|(previous, current, extra)| ProgressMarks {
                            previous,
                            current: Some(current),
                            extra,
                        }),
                        status,
                        extra,
                    })
                }
            ),
        (
            new_relation(),
            prop::collection::vec(name(), 0..3),
            watermark(),
            prop::option::of((prop::option::of(progress_mark()), extra())),
            prop::option::of(download_status()),
            extra(),
        )
            .prop_map(|(relation, columns, watermark, marks, status, extra)| {
                Change::BackfillCompleted(BackfillCompleted {
                    relation,
                    columns,
                    watermark,
                    progress_marks: marks.map(|(previous, extra)| ProgressMarks {
                        previous,
                        current: None,
                        extra,
                    }),
                    status,
                    extra,
                })
            }),
        (
            name(),
            name(),
            prop::collection::vec((name(), column_spec()), 0..3),
            prop::option::of(prop::collection::vec(name(), 0..2)),
            prop::option::of(table_metadata()),
            prop::option::of(prop::collection::vec((name(), backfill_id()), 0..2)),
            extra(),
            extra(),
        )
            .prop_map(
                |(schema, name, columns, primary_key, metadata, backfill, spec_extra, extra)| {
                    Change::CreateTable(CreateTable {
                        spec: TableSpec {
                            schema,
                            name,
                            columns: columns.into_iter().collect(),
                            primary_key,
                            extra: spec_extra,
                        },
                        metadata,
                        backfill: backfill.map(|b| b.into_iter().collect()),
                        extra,
                    })
                }
            ),
        (identifier(), identifier(), extra())
            .prop_map(|(old, new, extra)| Change::RenameTable(RenameTable { old, new, extra })),
        (identifier(), table_metadata(), table_metadata(), extra()).prop_map(
            |(table, old, new, extra)| Change::UpdateTableMetadata(UpdateTableMetadata {
                table,
                old,
                new,
                extra
            })
        ),
        (
            identifier(),
            column_def(),
            prop::option::of(table_metadata()),
            prop::option::of(backfill_id()),
            extra()
        )
            .prop_map(|(table, column, table_metadata, backfill, extra)| {
                Change::AddColumn(AddColumn {
                    table,
                    column,
                    table_metadata,
                    backfill,
                    extra,
                })
            }),
        (identifier(), column_def(), column_def(), extra()).prop_map(|(table, old, new, extra)| {
            Change::UpdateColumn(UpdateColumn {
                table,
                old,
                new,
                extra,
            })
        }),
        (identifier(), name(), extra()).prop_map(|(table, column, extra)| Change::DropColumn(
            DropColumn {
                table,
                column,
                extra
            }
        )),
        (identifier(), extra()).prop_map(|(id, extra)| Change::DropTable(DropTable { id, extra })),
        (
            name(),
            name(),
            name(),
            any::<bool>(),
            prop::collection::vec(
                (
                    name(),
                    prop_oneof![Just(IndexDirection::Asc), Just(IndexDirection::Desc)]
                ),
                0..3
            ),
            prop::option::of(json_value()),
            extra(),
            extra(),
        )
            .prop_map(
                |(schema, name, table_name, unique, columns, predicate, spec_extra, extra)| {
                    Change::CreateIndex(CreateIndex {
                        spec: IndexSpec {
                            schema,
                            name,
                            table_name,
                            unique,
                            columns: columns.into_iter().collect(),
                            predicate,
                            extra: spec_extra,
                        },
                        extra,
                    })
                }
            ),
        (identifier(), extra()).prop_map(|(id, extra)| Change::DropIndex(DropIndex { id, extra })),
    ]
}

fn downstream() -> impl Strategy<Value = DownstreamMessage> {
    let timings =
        (safe_number(), safe_number(), safe_number(), extra()).prop_map(|(s, c, r, extra)| {
            LagTimings {
                send_time_ms: s,
                commit_time_ms: c,
                receive_time_ms: r,
                extra,
            }
        });
    let lag = (prop::option::of(timings), safe_number(), extra()).prop_map(
        |(last_timings, next_send_time_ms, extra)| LagReport {
            last_timings,
            next_send_time_ms,
            extra,
        },
    );
    prop_oneof![
        (prop::option::of(lag), extra()).prop_map(|(lag_report, extra)| {
            DownstreamMessage::Status(Status { lag_report, extra })
        }),
        (
            prop::option::of(prop_oneof![
                Just(JsonFormat::Parsed),
                Just(JsonFormat::Stringified)
            ]),
            prop::option::of(any::<bool>()),
            extra(),
            watermark(),
            extra(),
        )
            .prop_map(
                |(json, skip_ack, extra, commit_watermark, watermark_extra)| {
                    DownstreamMessage::Begin(Begin {
                        json,
                        skip_ack,
                        extra,
                        commit_watermark,
                        watermark_extra,
                    })
                }
            ),
        change().prop_map(DownstreamMessage::Data),
        (
            prop::option::of(safe_number()),
            extra(),
            watermark(),
            extra()
        )
            .prop_map(|(commit_time_ms, extra, watermark, watermark_extra)| {
                DownstreamMessage::Commit(Commit {
                    commit_time_ms,
                    extra,
                    watermark,
                    watermark_extra,
                })
            }),
        extra().prop_map(|extra| DownstreamMessage::Rollback(Rollback { extra })),
        (safe_number(), prop::option::of("\\PC{0,20}"), extra()).prop_map(
            |(error_type, message, extra)| DownstreamMessage::Error(StreamError {
                error_type,
                message,
                extra
            })
        ),
        (
            "\\PC{0,20}",
            watermark(),
            watermark(),
            prop::option::of(safe_number()),
            extra()
        )
            .prop_map(
                |(backup_url, replica_version, min_watermark, replica_size, extra)| {
                    DownstreamMessage::Reserved(Reserved {
                        backup_url,
                        replica_version,
                        min_watermark,
                        replica_size,
                        extra,
                    })
                }
            ),
    ]
}

fn upstream() -> impl Strategy<Value = UpstreamMessage> {
    let column = (backfill_id(), prop::option::of(progress_mark()), extra()).prop_map(
        |(id, progress, extra)| BackfillColumn {
            id,
            progress,
            extra,
        },
    );
    let request = (
        name(),
        name(),
        prop::option::of(table_metadata()),
        extra(),
        prop::collection::vec((name(), column), 0..3),
        extra(),
    )
        .prop_map(
            |(schema, name, metadata, table_extra, columns, extra)| BackfillRequest {
                table: BackfillTable {
                    schema,
                    name,
                    metadata,
                    extra: table_extra,
                },
                columns: columns.into_iter().collect(),
                extra,
            },
        );
    prop_oneof![
        ("\\PC{0,10}", extra()).prop_map(|(task_id, extra)| UpstreamMessage::ReserveSnapshot(
            ReserveSnapshot { task_id, extra }
        )),
        (
            "\\PC{0,10}",
            "\\PC{0,10}",
            prop_oneof![Just(SubscriberMode::Serving), Just(SubscriberMode::Backup)],
            watermark(),
            watermark(),
            prop::option::of(prop::collection::vec(request, 0..3)),
            extra(),
        )
            .prop_map(
                |(task_id, id, mode, replica_version, watermark, backfills, extra)| {
                    UpstreamMessage::StartSubscription(SubscribeContext {
                        task_id,
                        id,
                        mode,
                        replica_version,
                        watermark,
                        backfills,
                        extra,
                    })
                }
            ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn downstream_encode_decode_encode_is_stable(m in downstream()) {
        let text = encode_downstream(&m);
        let decoded = decode_downstream(&text);
        prop_assert_eq!(decoded.as_ref(), Ok(&m), "{}", text);
        prop_assert_eq!(encode_downstream(&m), text);
        prop_assert_eq!(encode_downstream_value(&m), serde_json::from_str::<Value>(&encode_downstream(&m)).expect("json"));
    }

    #[test]
    fn upstream_encode_decode_encode_is_stable(m in upstream()) {
        let text = encode_upstream(&m);
        prop_assert_eq!(decode_upstream(&text), Ok(m), "{}", text);
    }

    #[test]
    fn shared_batch_payload_equals_a_batch_frame(batch in prop::collection::vec(downstream(), 0..4), id in 0u64..(1 << 53)) {
        let shared = BatchPayload::new(&batch).frame(id);
        let frame = Frame::Batch { id, batch };
        prop_assert_eq!(&shared, &frame.encode());
        prop_assert_eq!(decode_downstream_frame(&shared), Ok(frame));
    }
}
