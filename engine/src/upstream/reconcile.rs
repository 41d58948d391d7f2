//! The answer to [`Effect::ReconcileRelation`](super::Effect::ReconcileRelation): the schema
//! changes a pgoutput Relation message implies against the replica's schema.

use serde_json::{json, Value};

use crate::change_stream::{
    AddColumn, Change, ColumnDef, ColumnSpec, CreateTable, Identifier, TableSpec,
};
use crate::pgoutput::Relation;

/// Tables and columns that `relation` shows but the replica does not have, as schema changes.
///
/// Rows of a table created by `CREATE TABLE AS` precede its DDL event, and without the event
/// trigger no DDL event comes at all, so a Relation message may be the first the replica hears
/// of a table or a column:
///
/// * a table the replica lacks (`known` is `None`) becomes a `create-table` of every column the
///   Relation shows, at positions 1, 2, … in its order, keyed by `key` when the key must come
///   from the catalog (replica identity FULL flags every column) or else by the Relation's key
///   flags (no primary key when there are none), with upstream's `oid` in the spec;
/// * a column a known table lacks becomes an `add-column` after the table's last position
///   (`known` holds its column names and positions: columns added from Relation messages have
///   positions of their own, which the next stays after), in the Relation's order.
///
/// Everything created is backfilled, marked `{"relation": oid}`: the table may hold rows the
/// stream never carried, and a new column values only upstream knows (a default). Nothing is
/// dropped on a Relation message's word: a publication with a column list legitimately shows
/// fewer columns. A known table with no new column gives no change.
///
/// `column_spec` gives a column's spec from its type OID and position (the host reads types
/// from upstream's catalog); every spec also records the `typeOID`.
pub fn relation_changes(
    relation: &Relation,
    known: Option<&[(&str, i64)]>,
    key: Option<Vec<String>>,
    column_spec: impl Fn(u32, i64) -> ColumnSpec,
) -> Vec<Change> {
    let spec_of = |type_oid: u32, pos: i64| {
        let mut spec = column_spec(type_oid, pos);
        spec.extra.insert("typeOID".into(), Value::from(type_oid));
        spec
    };
    let backfill = || json!({"relation": relation.oid});
    let Some(known) = known else {
        let key = key.unwrap_or_else(|| {
            relation
                .columns
                .iter()
                .filter(|c| c.is_key())
                .map(|c| c.name.clone())
                .collect()
        });
        let mut extra = serde_json::Map::new();
        extra.insert("oid".into(), Value::from(relation.oid));
        let spec = TableSpec {
            schema: relation.namespace.clone(),
            name: relation.name.clone(),
            columns: relation
                .columns
                .iter()
                .zip(1..)
                .map(|(c, pos)| (c.name.clone(), spec_of(c.type_oid, pos)))
                .collect(),
            primary_key: (!key.is_empty()).then_some(key),
            extra,
        };
        return vec![Change::CreateTable(CreateTable {
            spec,
            metadata: None,
            backfill: Some(
                relation
                    .columns
                    .iter()
                    .map(|c| (c.name.clone(), backfill()))
                    .collect(),
            ),
            extra: Default::default(),
        })];
    };
    let table = Identifier::new(relation.namespace.clone(), relation.name.clone());
    let mut next_pos = known.iter().map(|&(_, pos)| pos).max().unwrap_or(0);
    relation
        .columns
        .iter()
        .filter(|c| known.iter().all(|&(name, _)| name != c.name))
        .map(|c| {
            next_pos += 1;
            Change::AddColumn(AddColumn {
                table: table.clone(),
                column: ColumnDef {
                    name: c.name.clone(),
                    spec: spec_of(c.type_oid, next_pos),
                    extra: Default::default(),
                },
                table_metadata: None,
                backfill: Some(backfill()),
                extra: Default::default(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::Number;

    use super::*;
    use crate::pgoutput::{RelationColumn, ReplicaIdentity};

    fn spec(type_oid: u32, pos: i64) -> ColumnSpec {
        ColumnSpec::new(
            Number::from(pos),
            if type_oid == 23 { "int4" } else { "text" },
        )
    }

    fn relation(identity: ReplicaIdentity, columns: &[(&str, u8, u32)]) -> Relation {
        Relation {
            oid: 77,
            namespace: "public".into(),
            name: "issue".into(),
            replica_identity: identity,
            columns: columns
                .iter()
                .map(|&(name, flags, type_oid)| RelationColumn {
                    flags,
                    name: name.into(),
                    type_oid,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    #[test]
    fn a_new_table_is_created_whole_and_backfilled_keyed_by_the_flags() {
        let r = relation(ReplicaIdentity::Default, &[("id", 1, 23), ("t", 0, 25)]);
        let changes = relation_changes(&r, None, None, spec);
        let [Change::CreateTable(create)] = changes.as_slice() else {
            panic!("expected one create-table, got {changes:?}");
        };
        assert_eq!(create.spec.primary_key, Some(vec!["id".to_owned()]));
        assert_eq!(create.spec.extra["oid"], json!(77));
        let columns: Vec<_> = create
            .spec
            .columns
            .iter()
            .map(|(n, s)| {
                (
                    n.as_str(),
                    s.pos.clone(),
                    s.data_type.as_str(),
                    s.extra["typeOID"].clone(),
                )
            })
            .collect();
        assert_eq!(
            columns,
            vec![
                ("id", Number::from(1), "int4", json!(23)),
                ("t", Number::from(2), "text", json!(25)),
            ]
        );
        let backfill = create.backfill.as_ref().expect("a backfill");
        assert_eq!(backfill.keys().collect::<Vec<_>>(), ["id", "t"]);
        assert!(backfill.values().all(|b| *b == json!({"relation": 77})));
    }

    #[test]
    fn a_new_table_takes_the_catalog_key_over_the_flags() {
        // Replica identity FULL flags every column; the primary key comes from the catalog.
        let r = relation(ReplicaIdentity::Full, &[("id", 1, 23), ("t", 1, 25)]);
        let changes = relation_changes(&r, None, Some(vec!["id".to_owned()]), spec);
        let [Change::CreateTable(create)] = changes.as_slice() else {
            panic!("expected one create-table, got {changes:?}");
        };
        assert_eq!(create.spec.primary_key, Some(vec!["id".to_owned()]));
        // No key flags and no catalog key: no primary key.
        let r = relation(ReplicaIdentity::Nothing, &[("id", 0, 23)]);
        let changes = relation_changes(&r, None, None, spec);
        let [Change::CreateTable(create)] = changes.as_slice() else {
            panic!("expected one create-table, got {changes:?}");
        };
        assert_eq!(create.spec.primary_key, None);
    }

    #[test]
    fn a_new_column_of_a_known_table_goes_after_its_last_position() {
        let r = relation(
            ReplicaIdentity::Default,
            &[("id", 1, 23), ("tags", 0, 1009), ("t", 0, 25)],
        );
        // `t` was itself added from a Relation message, at a position of its own.
        let changes = relation_changes(&r, Some(&[("id", 1), ("t", 5)]), None, spec);
        let [Change::AddColumn(add)] = changes.as_slice() else {
            panic!("expected one add-column, got {changes:?}");
        };
        assert_eq!(add.table, Identifier::new("public", "issue"));
        assert_eq!(add.column.name, "tags");
        assert_eq!(add.column.spec.pos, Number::from(6));
        assert_eq!(add.column.spec.extra["typeOID"], json!(1009));
        assert_eq!(add.backfill, Some(json!({"relation": 77})));
    }

    #[test]
    fn a_known_table_with_no_new_column_needs_nothing() {
        let known: &[(&str, i64)] = &[("id", 1), ("t", 2)];
        let same = relation(ReplicaIdentity::Default, &[("id", 1, 23), ("t", 0, 25)]);
        assert!(relation_changes(&same, Some(known), None, spec).is_empty());
        // A publication's column list shows fewer columns: nothing is dropped.
        let fewer = relation(ReplicaIdentity::Default, &[("id", 1, 23)]);
        assert!(relation_changes(&fewer, Some(known), None, spec).is_empty());
    }
}
