//! Schema changes applied to the replica, as Zero's change source detects them.
//!
//! Upstream's side (the published-schema query, the DDL event trigger and its events, the
//! catalog queries) is `replication/published_schema.rs`. This module reads the replica's
//! schema and hands it, with the published one, to the engine: [`upstream::schema_changes`]
//! for a DDL event (tables matched by OID and columns by `attnum`, so renames are told apart
//! from drops) and [`upstream::relation_changes`] for a pgoutput Relation message. The changes
//! it returns are applied like any other (`ReplicaWriter`).

use highwater_engine::change_stream::{Change, ColumnSpec, Identifier};
use highwater_engine::upstream;
use serde_json::Number;

use super::schema::{parse_type_class, replica_table_name};
use super::{Replica, ReplicaError};

/// Upstream indexes present in the replica, by replica index name, with their table.
fn replica_indexes(replica: &Replica) -> Result<Vec<(String, String)>, ReplicaError> {
    let mut stmt = replica.connection().prepare(
        "SELECT name, tbl_name FROM sqlite_schema
         WHERE type = 'index' AND sql IS NOT NULL AND tbl_name NOT LIKE '\\_hw\\_%' ESCAPE '\\'
           AND name <> tbl_name || '_hw_key' AND name <> tbl_name || '_hw_seq'",
    )?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// The schema changes that turn the replica's schema into `published` (already limited to the
/// replica's publications; anything that converts to the engine's
/// [`upstream::PublishedTable`], as a DDL event's published tables do): the engine's
/// [`schema_changes`](highwater_engine::upstream::schema_changes) against the replica's tables
/// and indexes, where every rule of the diff lives (its order, renames told from drops, which
/// tables and columns are backfilled for `tag`, the command that changed the schema).
pub(crate) fn schema_changes(
    replica: &Replica,
    published: impl IntoIterator<Item = impl Into<upstream::PublishedTable>>,
    tag: &str,
) -> Result<Vec<Change>, ReplicaError> {
    let known: Vec<upstream::KnownTable> = replica
        .table_names()
        .iter()
        .filter_map(|n| replica.table(n))
        .map(|table| upstream::KnownTable {
            spec: table.to_spec(),
            metadata: table.metadata.clone(),
        })
        .collect();
    // Every index the replica holds is on one of its tables; each is named in its table's
    // schema, as upstream names it.
    let indexes: Vec<Identifier> = replica_indexes(replica)?
        .into_iter()
        .filter_map(|(index_name, table_name)| {
            let table = replica.table(&table_name)?;
            let name = index_name
                .strip_prefix(&format!("{}.", table.schema))
                .unwrap_or(&index_name);
            Some(Identifier::new(table.schema.clone(), name))
        })
        .collect();
    let published: Vec<upstream::PublishedTable> = published.into_iter().map(Into::into).collect();
    Ok(upstream::schema_changes(&known, &indexes, &published, tag))
}

/// A column type as upstream's catalog describes it (`RELATION_TYPES_SQL` reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RelationType {
    pub data_type: String,
    pub(crate) typtype: String,
    pub(crate) elem_typtype: Option<String>,
}

/// Tables and columns that a pgoutput Relation message shows but the replica does not have,
/// created with a backfill and never dropped: the engine's
/// [`relation_changes`](highwater_engine::upstream::relation_changes) against the replica's
/// table, with column types from `types` (upstream's catalog, `RELATION_TYPES_SQL`; `text`
/// for a type it did not describe).
///
/// `key` is the table's key when it must come from the catalog (replica identity FULL flags
/// every column); otherwise the Relation's key flags are used.
pub(crate) fn relation_changes(
    replica: &Replica,
    relation: &highwater_engine::pgoutput::Relation,
    types: &std::collections::HashMap<u32, RelationType>,
    key: Option<Vec<String>>,
) -> Vec<Change> {
    let column_spec = |type_oid: u32, pos: i64| {
        let ty = types.get(&type_oid);
        let mut spec = ColumnSpec::new(
            Number::from(pos),
            ty.map_or_else(|| "text".to_owned(), |t| t.data_type.clone()),
        );
        spec.pg_type_class = ty.and_then(|t| parse_type_class(&t.typtype));
        spec.elem_pg_type_class =
            Some(ty.and_then(|t| t.elem_typtype.as_deref().and_then(parse_type_class)));
        spec
    };
    let table = replica.table(&replica_table_name(&relation.namespace, &relation.name));
    let known: Option<Vec<(&str, i64)>> =
        table.map(|t| t.columns.iter().map(|c| (c.name.as_str(), c.pos)).collect());
    highwater_engine::upstream::relation_changes(relation, known.as_deref(), key, column_spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use highwater_engine::change_stream::{Begin, Commit, DownstreamMessage, TableSpec};
    use highwater_engine::watermark::Lsn;
    use serde_json::json;

    /// A replica holding `issue (id int4, t text)`, created as a DDL event creates it.
    fn replica_with_issue() -> super::super::ReplicaWriter {
        let mut replica = Replica::open_in_memory().unwrap();
        replica
            .store_initial_state(&super::super::ReplicaState {
                replica_version: Lsn(1).to_watermark(),
                watermark: Lsn(1).to_watermark(),
                lsn: Lsn(1),
                publications: vec!["p".into()],
                slot: "s".into(),
                app_id: "a".into(),
                next_seq: 1,
            })
            .unwrap();
        let column = |pos: i64, data_type: &str| ColumnSpec::new(Number::from(pos), data_type);
        let mut extra = serde_json::Map::new();
        extra.insert("oid".into(), json!(10));
        let issue = upstream::PublishedTable {
            spec: TableSpec {
                schema: "public".into(),
                name: "issue".into(),
                columns: [
                    ("id".to_owned(), column(1, "int4")),
                    ("t".to_owned(), column(2, "text")),
                ]
                .into_iter()
                .collect(),
                primary_key: Some(vec!["id".into()]),
                extra,
            },
            metadata: None,
            indexes: vec![],
            identity_columns: vec![],
        };
        let mut writer = super::super::ReplicaWriter::new(replica);
        let wm = Lsn(2).to_watermark();
        writer
            .apply(&DownstreamMessage::Begin(Begin::new(wm.clone())))
            .unwrap();
        for change in schema_changes(writer.replica(), [issue], "CREATE TABLE").unwrap() {
            writer.apply(&DownstreamMessage::Data(change)).unwrap();
        }
        writer
            .apply(&DownstreamMessage::Commit(Commit::new(wm)))
            .unwrap();
        writer
    }

    fn tags(changes: &[Change]) -> Vec<&'static str> {
        changes.iter().map(Change::tag).collect()
    }

    #[test]
    fn relation_messages_add_unknown_tables_and_columns_but_never_drop() {
        use highwater_engine::pgoutput::{Relation, RelationColumn, ReplicaIdentity};
        let w = replica_with_issue();
        let col = |name: &str, flags: u8, type_oid: u32| RelationColumn {
            flags,
            name: name.into(),
            type_oid,
            type_modifier: -1,
        };
        let types = std::collections::HashMap::from([
            (
                23,
                RelationType {
                    data_type: "int4".into(),
                    typtype: "b".into(),
                    elem_typtype: None,
                },
            ),
            (
                1009,
                RelationType {
                    data_type: "text[]".into(),
                    typtype: "b".into(),
                    elem_typtype: Some("b".into()),
                },
            ),
        ]);
        let relation = |name: &str, columns: Vec<RelationColumn>| Relation {
            oid: 77,
            namespace: "public".into(),
            name: name.into(),
            replica_identity: ReplicaIdentity::Default,
            columns,
        };
        // A column list publication shows fewer columns: nothing to do.
        let subset = relation("issue", vec![col("id", 1, 23)]);
        assert!(relation_changes(w.replica(), &subset, &types, None).is_empty());
        let wider = relation(
            "issue",
            vec![col("id", 1, 23), col("t", 0, 25), col("tags", 0, 1009)],
        );
        let changes = relation_changes(w.replica(), &wider, &types, None);
        assert_eq!(tags(&changes), vec!["add-column"]);
        let Change::AddColumn(add) = &changes[0] else {
            panic!("expected add-column");
        };
        assert_eq!(
            (add.column.name.as_str(), add.column.spec.data_type.as_str()),
            ("tags", "text[]")
        );
        assert!(add.backfill.is_some());
        let new = relation("fresh", vec![col("k", 1, 23), col("v", 0, 1009)]);
        let changes = relation_changes(w.replica(), &new, &types, None);
        let Change::CreateTable(create) = &changes[0] else {
            panic!("expected create-table");
        };
        assert_eq!(create.spec.primary_key, Some(vec!["k".to_owned()]));
        assert_eq!(create.backfill.as_ref().map(|b| b.len()), Some(2));
        assert_eq!(create.spec.extra["oid"], json!(77));
    }
}
