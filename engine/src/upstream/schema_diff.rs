//! The answer to [`Effect::ResolveDdl`](super::Effect::ResolveDdl): the schema changes that turn
//! the replica's schema into the published schema a DDL event carries.
//!
//! Tables are matched by upstream's OID and columns by their `attnum`, so a rename is told
//! apart from a drop and an add; a table or column the replica learned from a Relation message
//! (no OID, no `attnum`) is matched by its name.

use indexmap::IndexMap;
use serde_json::{json, Number, Value};

use crate::change_stream::{
    exact_lite_default, AddColumn, Change, ColumnDef, ColumnSpec, CreateIndex, CreateTable,
    DropColumn, DropIndex, DropTable, Identifier, IndexSpec, RenameTable, TableMetadata, TableSpec,
    UpdateColumn, UpdateTableMetadata,
};

/// A table of the replica, as the diff reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct KnownTable {
    /// The table's spec as the replica holds it: columns in position order, each with its
    /// `pos` and, when known, its `attNum` in `extra`; upstream's `oid` in `extra` when known;
    /// the key as `primary_key`.
    pub spec: TableSpec,
    /// The change source's table metadata the replica last stored for it.
    pub metadata: Option<TableMetadata>,
}

/// A table of the published schema (already limited to the replica's publications).
#[derive(Debug, Clone, PartialEq)]
pub struct PublishedTable {
    /// The table's spec as Zero's change source sends it: each column's `pos` is its `attnum`
    /// (also `attNum` in its `extra`), upstream's `oid` in `extra`, the key as `primary_key`.
    pub spec: TableSpec,
    /// The change source's table metadata for it (`None` when the event has no `schemaOID`).
    pub metadata: Option<TableMetadata>,
    /// Its indexes as `create-index` specs, the key's among them ([`is_key_index`]).
    pub indexes: Vec<IndexSpec>,
    /// Its identity columns: existing rows got values for them that only upstream knows,
    /// though they have no default expression.
    pub identity_columns: Vec<String>,
}

/// Whether `spec` is a table's key index (flagged `isPrimaryKey` or `isReplicaIdentity`).
pub fn is_key_index(spec: &IndexSpec) -> bool {
    let flag = |key: &str| spec.extra.get(key).and_then(Value::as_bool) == Some(true);
    flag("isPrimaryKey") || flag("isReplicaIdentity")
}

/// The schema changes that turn `replica` (its tables, and `replica_indexes`: its indexes
/// other than the keys, each named in its table's schema) into `published`, in Zero's order:
/// drop-index, drop-table, per table rename-table, drop-column, update-column,
/// update-table-metadata, add-column and a new key's create-index, then create-table (each
/// followed by its key index) and create-index.
///
/// `tag` is the command that changed the schema (the DDL event's): a table that appears other
/// than by `CREATE TABLE` (added to a publication, moved into a published schema) already has
/// rows, and so does a column that appears other than by `ALTER TABLE`; both are backfilled,
/// marked with their `attNum`. A column added by `ALTER TABLE` is backfilled when existing rows
/// got values only upstream knows: an identity, or a default the replica cannot reproduce
/// exactly ([`exact_lite_default`], not `now()`); it then goes with no default (Zero's
/// replicator stops on a default it cannot map) and the values come from the backfill. A
/// default the replica reproduces goes as `dflt`, with no backfill.
pub fn schema_changes(
    replica: &[KnownTable],
    replica_indexes: &[Identifier],
    published: &[PublishedTable],
    tag: &str,
) -> Vec<Change> {
    let find_current = |table: &PublishedTable| {
        let oid = oid(&table.spec);
        replica
            .iter()
            .find(|known| oid.is_some() && self::oid(&known.spec) == oid)
            .or_else(|| {
                replica
                    .iter()
                    .find(|known| self::oid(&known.spec).is_none() && same_name(known, table))
            })
    };
    let wanted_indexes: Vec<&IndexSpec> = published
        .iter()
        .flat_map(|t| &t.indexes)
        .filter(|spec| !is_key_index(spec))
        .collect();
    let wanted = |id: &Identifier| {
        wanted_indexes
            .iter()
            .any(|spec| spec.schema == id.schema && spec.name == id.name)
    };

    let mut changes = Vec::new();
    for id in replica_indexes.iter().filter(|id| !wanted(id)) {
        changes.push(Change::DropIndex(DropIndex {
            id: id.clone(),
            extra: Default::default(),
        }));
    }
    for known in replica {
        let kept = published.iter().any(|t| match oid(&known.spec) {
            Some(known_oid) => oid(&t.spec) == Some(known_oid),
            None => same_name(known, t),
        });
        if !kept {
            changes.push(Change::DropTable(DropTable {
                id: Identifier::new(known.spec.schema.clone(), known.spec.name.clone()),
                extra: Default::default(),
            }));
        }
    }
    for table in published {
        if let Some(known) = find_current(table) {
            table_changes(known, table, tag, &mut changes);
        }
    }
    // A new table's key index goes out like any index: Zero's replicator creates tables
    // without a key and relies on this index for its upserts (`ON CONFLICT (key)`).
    let mut key_indexes = Vec::new();
    for table in published {
        if find_current(table).is_some() {
            continue;
        }
        key_indexes.extend(table.indexes.iter().filter(|s| is_key_index(s)).cloned());
        let backfill = (tag != "CREATE TABLE").then(|| {
            table
                .spec
                .columns
                .iter()
                .map(|(name, spec)| (name.clone(), json!({"attNum": published_attnum(spec)})))
                .collect::<IndexMap<_, _>>()
        });
        changes.push(Change::CreateTable(CreateTable {
            spec: table.spec.clone(),
            metadata: table.metadata.clone(),
            backfill,
            extra: Default::default(),
        }));
    }
    for spec in key_indexes {
        changes.push(Change::CreateIndex(CreateIndex {
            spec,
            extra: Default::default(),
        }));
    }
    for spec in wanted_indexes {
        let id = Identifier::new(spec.schema.clone(), spec.name.clone());
        if !replica_indexes.contains(&id) {
            changes.push(Change::CreateIndex(CreateIndex {
                spec: spec.clone(),
                extra: Default::default(),
            }));
        }
    }
    changes
}

/// Upstream's OID of a table, from its spec.
fn oid(spec: &TableSpec) -> Option<u32> {
    spec.extra
        .get("oid")
        .and_then(Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
}

fn same_name(known: &KnownTable, table: &PublishedTable) -> bool {
    known.spec.schema == table.spec.schema && known.spec.name == table.spec.name
}

/// A replica column's `attnum`, when the replica knows it.
fn known_attnum(spec: &ColumnSpec) -> Option<i64> {
    spec.extra.get("attNum").and_then(Value::as_i64)
}

/// A published column's `attnum` (its `pos` where `attNum` is missing).
fn published_attnum(spec: &ColumnSpec) -> i64 {
    known_attnum(spec)
        .or_else(|| spec.pos.as_i64())
        .unwrap_or(0)
}

fn position(spec: &ColumnSpec) -> i64 {
    spec.pos.as_i64().unwrap_or(0)
}

fn not_null(spec: &ColumnSpec) -> bool {
    spec.not_null.flatten().unwrap_or(false)
}

fn column_def(name: &str, spec: ColumnSpec) -> ColumnDef {
    ColumnDef {
        name: name.to_owned(),
        spec,
        extra: Default::default(),
    }
}

/// Whether a published column, by its `attnum` and name, is the replica column `known`.
fn is_column(known: (&String, &ColumnSpec), attnum: i64, name: &str) -> bool {
    match known_attnum(known.1) {
        Some(a) => a == attnum,
        None => known.0 == name,
    }
}

/// The spec of a column added by `ALTER TABLE` (`always_backfill`: by another command), and
/// whether existing rows need a backfill (see [`schema_changes`]).
fn added_spec(spec: &ColumnSpec, identity: bool, always_backfill: bool) -> (ColumnSpec, bool) {
    let mut spec = spec.clone();
    let dflt = spec.dflt.clone().flatten();
    let exact = dflt
        .as_deref()
        .and_then(|d| exact_lite_default(d, &spec.data_type, spec.pg_type_class));
    let backfill = always_backfill || identity || (dflt.is_some() && exact.is_none());
    if backfill {
        spec.dflt = Some(None);
    }
    (spec, backfill)
}

fn table_changes(known: &KnownTable, table: &PublishedTable, tag: &str, changes: &mut Vec<Change>) {
    let id = Identifier::new(table.spec.schema.clone(), table.spec.name.clone());
    if known.spec.schema != table.spec.schema || known.spec.name != table.spec.name {
        changes.push(Change::RenameTable(RenameTable {
            old: Identifier::new(known.spec.schema.clone(), known.spec.name.clone()),
            new: id.clone(),
            extra: Default::default(),
        }));
    }
    let find_new = |old: (&String, &ColumnSpec)| {
        table
            .spec
            .columns
            .iter()
            .find(|&(name, spec)| match known_attnum(old.1) {
                Some(a) => published_attnum(spec) == a,
                None => name == old.0,
            })
    };
    for old in &known.spec.columns {
        if find_new(old).is_none() {
            changes.push(Change::DropColumn(DropColumn {
                table: id.clone(),
                column: old.0.clone(),
                extra: Default::default(),
            }));
        }
    }
    for old in &known.spec.columns {
        let Some((new_name, new)) = find_new(old) else {
            continue;
        };
        let (old_name, old) = old;
        if new_name != old_name || new.data_type != old.data_type || not_null(new) != not_null(old)
        {
            let mut new_spec = new.clone();
            new_spec.pos = old.pos.clone();
            changes.push(Change::UpdateColumn(UpdateColumn {
                table: id.clone(),
                old: column_def(old_name, old.clone()),
                new: column_def(new_name, new_spec),
                extra: Default::default(),
            }));
        }
    }
    if let (Some(old), Some(new)) = (&known.metadata, &table.metadata) {
        if old != new {
            changes.push(Change::UpdateTableMetadata(UpdateTableMetadata {
                table: id.clone(),
                old: old.clone(),
                new: new.clone(),
                extra: Default::default(),
            }));
        }
    }
    let max_pos = known.spec.columns.values().map(position).max().unwrap_or(0);
    for (name, new) in &table.spec.columns {
        let attnum = published_attnum(new);
        if known
            .spec
            .columns
            .iter()
            .any(|c| is_column(c, attnum, name))
        {
            continue;
        }
        let identity = table.identity_columns.contains(name);
        let (mut spec, backfill) = added_spec(new, identity, tag != "ALTER TABLE");
        // Columns added from Relation messages have positions of their own: stay after them.
        spec.pos = Number::from(attnum.max(max_pos + 1));
        changes.push(Change::AddColumn(AddColumn {
            table: id.clone(),
            column: column_def(name, spec),
            table_metadata: table.metadata.clone(),
            backfill: backfill.then(|| json!({"attNum": attnum})),
            extra: Default::default(),
        }));
    }
    let key = table.spec.primary_key.as_deref().unwrap_or_default();
    let known_key = known.spec.primary_key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != known_key {
        // A new primary key or replica identity index: the replica re-keys its rows by it.
        let key_index = table
            .indexes
            .iter()
            .find(|s| is_key_index(s) && s.columns.keys().eq(key.iter()));
        if let Some(spec) = key_index {
            let mut spec = spec.clone();
            spec.extra
                .insert("isReplicaIdentity".into(), Value::Bool(true));
            changes.push(Change::CreateIndex(CreateIndex {
                spec,
                extra: Default::default(),
            }));
        }
    }
}

#[cfg(test)]
mod tests;
