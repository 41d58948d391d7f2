//! The cookie jar: what each change means for the pending backfills of a table
//! (Zero's table metadata and backfill cookies).
//!
//! The change log keeps two cookies beside its rows — the latest metadata of each table and the
//! backfill ID of each column whose backfill has not completed — and hands them to the change
//! source on every stream start. [`cookie_ops`] is the one fold over the change stream that both
//! the durable jar and the in-memory [`BackfillState`](super::BackfillState) interpret, so the two
//! cannot drift.

use indexmap::IndexMap;

use crate::change_stream::{
    BackfillColumn, BackfillId, BackfillRequest, BackfillTable, Change, Extra, Identifier,
    TableMetadata,
};

/// A table named by schema and name, borrowed from a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableRef<'a> {
    pub schema: &'a str,
    pub name: &'a str,
}

impl<'a> From<&'a Identifier> for TableRef<'a> {
    fn from(id: &'a Identifier) -> Self {
        TableRef {
            schema: &id.schema,
            name: &id.name,
        }
    }
}

/// One mutation of the cookie jar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CookieOp<'a> {
    /// Insert or replace the table's metadata.
    UpsertMetadata {
        table: TableRef<'a>,
        metadata: &'a TableMetadata,
    },
    /// Start (or restart) the backfill of a column.
    UpsertBackfill {
        table: TableRef<'a>,
        column: &'a str,
        id: &'a BackfillId,
    },
    /// Move both cookies of a table.
    RenameTable {
        old: TableRef<'a>,
        new: TableRef<'a>,
    },
    /// Delete both cookies of a table.
    DropTable { table: TableRef<'a> },
    /// Move a column's pending backfill.
    RenameColumn {
        table: TableRef<'a>,
        old: &'a str,
        new: &'a str,
    },
    /// Forget a column's pending backfill.
    DropColumn {
        table: TableRef<'a>,
        column: &'a str,
    },
    /// Forget the pending backfills of completed columns (row-key columns included).
    CompleteBackfill {
        table: TableRef<'a>,
        columns: Vec<&'a str>,
    },
}

/// The cookie-jar mutations of `change`, in the order they apply. Row changes, `backfill` rows
/// and index changes produce none.
pub fn cookie_ops(change: &Change) -> Vec<CookieOp<'_>> {
    match change {
        Change::UpdateTableMetadata(c) => vec![CookieOp::UpsertMetadata {
            table: (&c.table).into(),
            metadata: &c.new,
        }],
        Change::CreateTable(c) => {
            let table = TableRef {
                schema: &c.spec.schema,
                name: &c.spec.name,
            };
            let metadata = c
                .metadata
                .iter()
                .map(|metadata| CookieOp::UpsertMetadata { table, metadata });
            let backfills = c
                .backfill
                .iter()
                .flatten()
                .map(|(column, id)| CookieOp::UpsertBackfill { table, column, id });
            metadata.chain(backfills).collect()
        }
        Change::RenameTable(c) => vec![CookieOp::RenameTable {
            old: (&c.old).into(),
            new: (&c.new).into(),
        }],
        Change::DropTable(c) => vec![CookieOp::DropTable {
            table: (&c.id).into(),
        }],
        Change::AddColumn(c) => {
            let table = TableRef::from(&c.table);
            let metadata = c
                .table_metadata
                .iter()
                .map(|metadata| CookieOp::UpsertMetadata { table, metadata });
            let backfill = c.backfill.iter().map(|id| CookieOp::UpsertBackfill {
                table,
                column: &c.column.name,
                id,
            });
            metadata.chain(backfill).collect()
        }
        Change::UpdateColumn(c) if c.old.name != c.new.name => vec![CookieOp::RenameColumn {
            table: (&c.table).into(),
            old: &c.old.name,
            new: &c.new.name,
        }],
        Change::DropColumn(c) => vec![CookieOp::DropColumn {
            table: (&c.table).into(),
            column: &c.column,
        }],
        Change::BackfillCompleted(c) => {
            let columns: Vec<&str> = c
                .relation
                .row_key
                .columns
                .iter()
                .chain(&c.columns)
                .map(String::as_str)
                .collect();
            if columns.is_empty() {
                return Vec::new();
            }
            vec![CookieOp::CompleteBackfill {
                table: TableRef {
                    schema: &c.relation.schema,
                    name: &c.relation.name,
                },
                columns,
            }]
        }
        Change::UpdateColumn(_)
        | Change::CreateIndex(_)
        | Change::DropIndex(_)
        | Change::Insert(_)
        | Change::Update(_)
        | Change::Delete(_)
        | Change::Truncate(_)
        | Change::Backfill(_) => Vec::new(),
    }
}

/// A stored table-metadata cookie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataCookie {
    pub schema: String,
    pub table: String,
    pub metadata: TableMetadata,
}

/// A stored backfilling-column cookie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackfillCookie {
    pub schema: String,
    pub table: String,
    pub column: String,
    pub id: BackfillId,
}

/// The backfill requests a stored cookie jar stands for: one per table with backfilling columns
/// (in order of first appearance), each column from scratch since the jar keeps no progress, and
/// the table's metadata cookie or `null`.
pub fn cookie_jar_requests(
    metadata: impl IntoIterator<Item = MetadataCookie>,
    backfilling: impl IntoIterator<Item = BackfillCookie>,
) -> Vec<BackfillRequest> {
    let mut metadata: IndexMap<(String, String), TableMetadata> = metadata
        .into_iter()
        .map(|c| ((c.schema, c.table), c.metadata))
        .collect();
    let mut requests: IndexMap<(String, String), BackfillRequest> = IndexMap::new();
    for cookie in backfilling {
        let key = (cookie.schema, cookie.table);
        let request = requests.entry(key.clone()).or_insert_with(|| {
            let metadata = metadata.swap_remove(&key);
            let (schema, name) = key;
            BackfillRequest {
                table: BackfillTable {
                    schema,
                    name,
                    metadata,
                    extra: Extra::new(),
                },
                columns: IndexMap::new(),
                extra: Extra::new(),
            }
        });
        let column = BackfillColumn {
            id: cookie.id,
            progress: None,
            extra: Extra::new(),
        };
        request.columns.insert(cookie.column, column);
    }
    requests.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change_stream::decode_change_value;
    use serde_json::json;
    use serde_json::Map;

    fn change(value: serde_json::Value) -> Change {
        decode_change_value(value).expect("a valid change")
    }

    fn foo() -> TableRef<'static> {
        TableRef {
            schema: "public",
            name: "foo",
        }
    }

    fn metadata(v: u8) -> TableMetadata {
        let mut row_key = Map::new();
        row_key.insert("id".into(), json!(v));
        TableMetadata {
            row_key,
            extra: Extra::new(),
        }
    }

    #[test]
    fn create_table_upserts_metadata_then_each_backfill() {
        let c = change(json!({
            "tag": "create-table",
            "spec": {"schema": "public", "name": "foo", "columns": {}},
            "metadata": {"rowKey": {"id": 1}},
            "backfill": {"a": {"attNum": 1}, "b": {"attNum": 2}},
        }));
        let id_a = json!({"attNum": 1});
        let id_b = json!({"attNum": 2});
        let m = metadata(1);
        assert_eq!(
            cookie_ops(&c),
            vec![
                CookieOp::UpsertMetadata {
                    table: foo(),
                    metadata: &m
                },
                CookieOp::UpsertBackfill {
                    table: foo(),
                    column: "a",
                    id: &id_a
                },
                CookieOp::UpsertBackfill {
                    table: foo(),
                    column: "b",
                    id: &id_b
                },
            ]
        );
    }

    #[test]
    fn create_table_and_add_column_without_cookies_produce_no_ops() {
        let create = change(json!({
            "tag": "create-table",
            "spec": {"schema": "public", "name": "foo", "columns": {}},
        }));
        let add = change(json!({
            "tag": "add-column",
            "table": {"schema": "public", "name": "foo"},
            "column": {"name": "c", "spec": {"pos": 3, "dataType": "text"}},
        }));
        assert!(cookie_ops(&create).is_empty());
        assert!(cookie_ops(&add).is_empty());
    }

    #[test]
    fn add_column_upserts_metadata_then_the_backfill() {
        let c = change(json!({
            "tag": "add-column",
            "table": {"schema": "public", "name": "foo"},
            "column": {"name": "c", "spec": {"pos": 3, "dataType": "text"}},
            "tableMetadata": {"rowKey": {"id": 2}},
            "backfill": {"attNum": 3},
        }));
        let id = json!({"attNum": 3});
        let m = metadata(2);
        assert_eq!(
            cookie_ops(&c),
            vec![
                CookieOp::UpsertMetadata {
                    table: foo(),
                    metadata: &m
                },
                CookieOp::UpsertBackfill {
                    table: foo(),
                    column: "c",
                    id: &id
                },
            ]
        );
    }

    #[test]
    fn update_column_renames_only_when_the_name_changes() {
        let update = |new_name: &str| {
            change(json!({
                "tag": "update-column",
                "table": {"schema": "public", "name": "foo"},
                "old": {"name": "b", "spec": {"pos": 2, "dataType": "text"}},
                "new": {"name": new_name, "spec": {"pos": 2, "dataType": "int4"}},
            }))
        };
        let renamed = update("bb");
        assert_eq!(
            cookie_ops(&renamed),
            vec![CookieOp::RenameColumn {
                table: foo(),
                old: "b",
                new: "bb"
            }]
        );
        assert!(cookie_ops(&update("b")).is_empty());
    }

    #[test]
    fn backfill_completed_completes_row_key_and_columns() {
        let c = change(json!({
            "tag": "backfill-completed",
            "relation": {"schema": "public", "name": "foo", "rowKey": {"columns": ["id"]}},
            "columns": ["a"],
            "watermark": "01",
        }));
        assert_eq!(
            cookie_ops(&c),
            vec![CookieOp::CompleteBackfill {
                table: foo(),
                columns: vec!["id", "a"]
            }]
        );
    }

    #[test]
    fn table_drops_renames_and_index_changes() {
        let rename = change(json!({
            "tag": "rename-table",
            "old": {"schema": "public", "name": "foo"},
            "new": {"schema": "public", "name": "bar"},
        }));
        assert_eq!(
            cookie_ops(&rename),
            vec![CookieOp::RenameTable {
                old: foo(),
                new: TableRef {
                    schema: "public",
                    name: "bar"
                }
            }]
        );
        let drop = change(json!({"tag": "drop-table", "id": {"schema": "public", "name": "foo"}}));
        assert_eq!(
            cookie_ops(&drop),
            vec![CookieOp::DropTable { table: foo() }]
        );
        let drop_index =
            change(json!({"tag": "drop-index", "id": {"schema": "public", "name": "foo_idx"}}));
        assert!(cookie_ops(&drop_index).is_empty());
    }

    #[test]
    fn cookie_jar_requests_group_columns_by_table_with_metadata_or_null() {
        let cookie = |table: &str, column: &str| BackfillCookie {
            schema: "public".into(),
            table: table.into(),
            column: column.into(),
            id: json!({ "col": column }),
        };
        let requests = cookie_jar_requests(
            [
                MetadataCookie {
                    schema: "public".into(),
                    table: "bar".into(),
                    metadata: metadata(7),
                },
                MetadataCookie {
                    schema: "public".into(),
                    table: "unrelated".into(),
                    metadata: metadata(8),
                },
            ],
            [cookie("foo", "a"), cookie("bar", "x"), cookie("foo", "b")],
        );
        let summary: Vec<_> = requests
            .iter()
            .map(|r| {
                let columns: Vec<_> = r.columns.keys().cloned().collect();
                (r.table.name.clone(), r.table.metadata.clone(), columns)
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("foo".into(), None, vec!["a".to_owned(), "b".to_owned()]),
                ("bar".into(), Some(metadata(7)), vec!["x".to_owned()]),
            ]
        );
        assert!(requests
            .iter()
            .flat_map(|r| r.columns.values())
            .all(|c| c.progress.is_none()));
    }
}
