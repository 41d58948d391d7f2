//! How upstream tables look in the replica: names, declared column types, key indexes, and the
//! `_hw_tables` / `_hw_columns` metadata that remembers the upstream shape of every column.

use highwater_engine::change_stream::{
    ColumnSpec, IndexDirection, IndexSpec, PgTypeClass, ReplicaIdentity, TableMetadata, TableSpec,
};
use rusqlite::{params, Connection};
use serde_json::{Number, Value};

use super::ReplicaError;

/// The replica's name for an upstream table: `table` in `public`, else `schema.table`.
pub fn replica_table_name(schema: &str, name: &str) -> String {
    if schema == "public" {
        name.to_owned()
    } else {
        format!("{schema}.{name}")
    }
}

/// A double-quoted SQL identifier (SQLite and Postgres quote the same way).
pub fn quote_ident(ident: &str) -> String {
    let mut out = String::with_capacity(ident.len() + 2);
    out.push('"');
    for c in ident.chars() {
        if c == '"' {
            out.push('"');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// How a column's values are stored in SQLite and turned back into JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// `bool`: 0/1.
    Bool,
    /// Integers, floats, numerics, timestamps (ms), dates, times: INTEGER or REAL.
    Number,
    /// `json`/`jsonb`: JSON text.
    Json,
    /// Any array: JSON text of the array.
    Array,
    /// Everything else (text-like, uuid, enum, unknown types): TEXT.
    Text,
}

impl ValueKind {
    /// The storage of a Postgres type, by its name as it appears in `dataType`.
    pub fn of(data_type: &str, type_class: Option<PgTypeClass>) -> ValueKind {
        if data_type.ends_with("[]") || data_type.starts_with('_') {
            return ValueKind::Array;
        }
        if type_class == Some(PgTypeClass::Enum) {
            return ValueKind::Text;
        }
        match data_type {
            "bool" | "boolean" => ValueKind::Bool,
            "int2" | "int4" | "int8" | "smallint" | "integer" | "bigint" | "oid" | "float4"
            | "float8" | "real" | "double precision" | "numeric" | "decimal" | "timestamp"
            | "timestamptz" | "date" | "time" | "timetz" => ValueKind::Number,
            "json" | "jsonb" => ValueKind::Json,
            _ => ValueKind::Text,
        }
    }

    fn stored_as_text(self) -> bool {
        matches!(self, ValueKind::Json | ValueKind::Array | ValueKind::Text)
    }
}

/// SQLite's column affinity for a declared type (<https://sqlite.org/datatype3.html> §3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Affinity {
    Integer,
    Text,
    Blob,
    Real,
    Numeric,
}

fn affinity(declared: &str) -> Affinity {
    let upper = declared.to_ascii_uppercase();
    if upper.contains("INT") {
        Affinity::Integer
    } else if upper.contains("CHAR") || upper.contains("CLOB") || upper.contains("TEXT") {
        Affinity::Text
    } else if upper.contains("BLOB") || upper.is_empty() {
        Affinity::Blob
    } else if upper.contains("REAL") || upper.contains("FLOA") || upper.contains("DOUB") {
        Affinity::Real
    } else {
        Affinity::Numeric
    }
}

/// One replicated column as the replica knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaColumn {
    pub name: String,
    pub pos: i64,
    /// Upstream type name (`int4`, `text`, `int4[]`, an enum's name, …).
    pub data_type: String,
    pub type_oid: Option<u32>,
    pub(crate) type_class: Option<PgTypeClass>,
    pub(crate) elem_type_class: Option<PgTypeClass>,
    pub(crate) not_null: bool,
    pub(crate) character_max_length: Option<i64>,
    pub dflt: Option<String>,
    /// Upstream `attnum`; identifies the column across renames.
    pub(crate) attnum: Option<i64>,
    /// Set while the column's existing values are still being backfilled.
    pub backfill: Option<Value>,
    pub kind: ValueKind,
}

impl ReplicaColumn {
    pub(crate) fn from_spec(name: &str, spec: &ColumnSpec) -> ReplicaColumn {
        let type_class = spec.pg_type_class;
        ReplicaColumn {
            name: name.to_owned(),
            pos: spec.pos.as_i64().unwrap_or(0),
            data_type: spec.data_type.clone(),
            type_oid: extra_u32(&spec.extra, "typeOID"),
            type_class,
            elem_type_class: spec.elem_pg_type_class.flatten(),
            not_null: spec.not_null.flatten().unwrap_or(false),
            character_max_length: spec
                .character_maximum_length
                .clone()
                .flatten()
                .and_then(|n| n.as_i64()),
            dflt: spec.dflt.clone().flatten(),
            attnum: spec.extra.get("attNum").and_then(Value::as_i64),
            backfill: None,
            kind: ValueKind::of(&spec.data_type, type_class),
        }
    }

    /// The change-stream spec of this column (with `typeOID` and `attNum` when known).
    pub(crate) fn to_spec(&self) -> ColumnSpec {
        let mut spec = ColumnSpec::new(Number::from(self.pos), self.data_type.clone());
        spec.pg_type_class = self.type_class;
        spec.elem_pg_type_class = Some(self.elem_type_class);
        spec.character_maximum_length = Some(self.character_max_length.map(Number::from));
        spec.not_null = Some(Some(self.not_null));
        spec.dflt = Some(self.dflt.clone());
        if let Some(oid) = self.type_oid {
            spec.extra.insert("typeOID".into(), Value::from(oid));
        }
        if let Some(attnum) = self.attnum {
            spec.extra.insert("attNum".into(), Value::from(attnum));
        }
        spec
    }

    pub(crate) fn is_enum(&self) -> bool {
        self.type_class == Some(PgTypeClass::Enum)
    }

    /// `<pgtype>[|NOT_NULL][|TEXT_ENUM][|TEXT_ARRAY][|TEXT_VALUE]`, like Zero's replica.
    ///
    /// The declared type also fixes SQLite's column affinity, and a NUMERIC affinity would turn
    /// numeric-looking text (`'01'`, `'1.50'` in a json column) into numbers. Text-stored columns
    /// therefore carry an attribute that gives them TEXT affinity; only a type whose name contains
    /// `int` keeps INTEGER affinity, which SQLite checks first.
    pub fn declared_type(&self) -> String {
        let mut declared = self.data_type.clone();
        if self.not_null {
            declared.push_str("|NOT_NULL");
        }
        if self.is_enum() {
            declared.push_str("|TEXT_ENUM");
        }
        if self.kind == ValueKind::Array {
            declared.push_str("|TEXT_ARRAY");
        }
        if self.kind.stored_as_text()
            && !matches!(affinity(&declared), Affinity::Text | Affinity::Integer)
        {
            declared.push_str("|TEXT_VALUE");
        }
        declared
    }
}

fn extra_u32(extra: &serde_json::Map<String, Value>, key: &str) -> Option<u32> {
    extra
        .get(key)
        .and_then(Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
}

/// One replicated table as the replica knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaTable {
    /// Replica name (`table` or `schema.table`).
    pub name: String,
    pub schema: String,
    pub table: String,
    /// Upstream `pg_class` oid; identifies the table across renames.
    pub oid: Option<u32>,
    pub replica_identity: Option<ReplicaIdentity>,
    /// Columns in upstream position order.
    pub columns: Vec<ReplicaColumn>,
    /// The key the replica indexes rows by: primary key or replica identity index columns.
    /// Empty when the table has none (rows are then matched on every column).
    pub key: Vec<String>,
    /// The change source's table metadata (`create-table.metadata`, `add-column.tableMetadata`,
    /// `update-table-metadata.new`), kept to tell when it changes.
    pub metadata: Option<TableMetadata>,
}

impl ReplicaTable {
    pub(crate) fn from_spec(spec: &TableSpec) -> ReplicaTable {
        let mut columns: Vec<ReplicaColumn> = spec
            .columns
            .iter()
            .map(|(name, col)| ReplicaColumn::from_spec(name, col))
            .collect();
        columns.sort_by_key(|c| c.pos);
        ReplicaTable {
            name: replica_table_name(&spec.schema, &spec.name),
            schema: spec.schema.clone(),
            table: spec.name.clone(),
            oid: extra_u32(&spec.extra, "oid"),
            replica_identity: spec
                .extra
                .get("replicaIdentity")
                .and_then(Value::as_str)
                .and_then(parse_replica_identity),
            columns,
            key: spec.primary_key.clone().unwrap_or_default(),
            metadata: None,
        }
    }

    pub(crate) fn to_spec(&self) -> TableSpec {
        let mut extra = serde_json::Map::new();
        if let Some(oid) = self.oid {
            extra.insert("oid".into(), Value::from(oid));
        }
        if let Some(identity) = self.replica_identity {
            extra.insert("replicaIdentity".into(), Value::from(identity.as_str()));
        }
        TableSpec {
            schema: self.schema.clone(),
            name: self.table.clone(),
            columns: self
                .columns
                .iter()
                .map(|c| (c.name.clone(), c.to_spec()))
                .collect(),
            primary_key: (!self.key.is_empty()).then(|| self.key.clone()),
            extra,
        }
    }

    pub fn column(&self, name: &str) -> Option<&ReplicaColumn> {
        self.columns.iter().find(|c| c.name == name)
    }

    pub(crate) fn column_mut(&mut self, name: &str) -> Option<&mut ReplicaColumn> {
        self.columns.iter_mut().find(|c| c.name == name)
    }

    /// The columns rows are matched on: the key, or every column of a keyless table.
    pub(crate) fn match_columns(&self) -> Vec<String> {
        if self.key.is_empty() {
            self.columns.iter().map(|c| c.name.clone()).collect()
        } else {
            self.key.clone()
        }
    }

    pub(crate) fn create_table_sql(&self) -> String {
        let mut sql = format!("CREATE TABLE {} (", quote_ident(&self.name));
        for col in &self.columns {
            sql.push_str(&quote_ident(&col.name));
            sql.push(' ');
            sql.push_str(&quote_ident(&col.declared_type()));
            sql.push_str(", ");
        }
        // `_hw_updated_at`: the commit time of the last write, kept for scope-sync tables only.
        sql.push_str(
            "\"_hw_version\" TEXT NOT NULL, \"_hw_seq\" INTEGER NOT NULL, \"_hw_updated_at\" TEXT)",
        );
        sql
    }

    pub(crate) fn key_index_name(&self) -> String {
        format!("{}_hw_key", self.name)
    }

    pub(crate) fn seq_index_name(&self) -> String {
        format!("{}_hw_seq", self.name)
    }

    /// The unique index that upserts conflict on; none for a keyless table.
    pub(crate) fn create_key_index_sql(&self) -> Option<String> {
        if self.key.is_empty() {
            return None;
        }
        let cols: Vec<String> = self.key.iter().map(|c| quote_ident(c)).collect();
        Some(format!(
            "CREATE UNIQUE INDEX {} ON {} ({})",
            quote_ident(&self.key_index_name()),
            quote_ident(&self.name),
            cols.join(", ")
        ))
    }

    pub(crate) fn create_seq_index_sql(&self) -> String {
        format!(
            "CREATE INDEX {} ON {} (\"_hw_seq\")",
            quote_ident(&self.seq_index_name()),
            quote_ident(&self.name)
        )
    }
}

pub(crate) fn parse_replica_identity(text: &str) -> Option<ReplicaIdentity> {
    match text {
        "default" | "d" => Some(ReplicaIdentity::Default),
        "nothing" | "n" => Some(ReplicaIdentity::Nothing),
        "full" | "f" => Some(ReplicaIdentity::Full),
        "index" | "i" => Some(ReplicaIdentity::Index),
        _ => None,
    }
}

pub(crate) fn parse_type_class(text: &str) -> Option<PgTypeClass> {
    match text {
        "b" => Some(PgTypeClass::Base),
        "c" => Some(PgTypeClass::Composite),
        "d" => Some(PgTypeClass::Domain),
        "e" => Some(PgTypeClass::Enum),
        "p" => Some(PgTypeClass::Pseudo),
        "r" => Some(PgTypeClass::Range),
        "m" => Some(PgTypeClass::Multirange),
        _ => None,
    }
}

/// The replica's name for an upstream index (`index` in `public`, else `schema.index`).
pub(crate) fn replica_index_name(schema: &str, name: &str) -> String {
    replica_table_name(schema, name)
}

/// Secondary indexes are created non-unique: the replica applies row changes one by one in
/// upstream order, and a deferred upstream constraint may be violated between two of them.
pub(crate) fn create_index_sql(spec: &IndexSpec) -> String {
    let cols: Vec<String> = spec
        .columns
        .iter()
        .map(|(c, dir)| {
            let dir = match dir {
                IndexDirection::Asc => "ASC",
                IndexDirection::Desc => "DESC",
            };
            format!("{} {dir}", quote_ident(c))
        })
        .collect();
    format!(
        "CREATE INDEX IF NOT EXISTS {} ON {} ({})",
        quote_ident(&replica_index_name(&spec.schema, &spec.name)),
        quote_ident(&replica_table_name(&spec.schema, &spec.table_name)),
        cols.join(", ")
    )
}

/// DDL of the replica's internal tables.
pub(crate) const INTERNAL_TABLES_SQL: &str = r#"
-- Single row: where replication stands, written in the same transaction as the rows.
CREATE TABLE IF NOT EXISTS "_hw_state" (
    "lock" INTEGER PRIMARY KEY CHECK ("lock" = 1),
    "replica_version" TEXT NOT NULL,
    "watermark" TEXT NOT NULL,
    "lsn" TEXT NOT NULL,
    "publications" TEXT NOT NULL,
    "slot" TEXT NOT NULL,
    "app_id" TEXT NOT NULL,
    "next_seq" INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS "_hw_tables" (
    "table_name" TEXT PRIMARY KEY,
    "schema" TEXT NOT NULL,
    "name" TEXT NOT NULL,
    "oid" INTEGER,
    "replica_identity" TEXT,
    "key_columns" TEXT NOT NULL,
    "metadata" TEXT
);
-- Upstream shape of every column; `backfill` is set while its existing values are awaited.
CREATE TABLE IF NOT EXISTS "_hw_columns" (
    "table_name" TEXT NOT NULL,
    "column_name" TEXT NOT NULL,
    "pos" INTEGER NOT NULL,
    "upstream_type" TEXT NOT NULL,
    "type_oid" INTEGER,
    "type_class" TEXT,
    "elem_type_class" TEXT,
    "is_not_null" INTEGER NOT NULL,
    "is_enum" INTEGER NOT NULL,
    "is_array" INTEGER NOT NULL,
    "character_max_length" INTEGER,
    "dflt" TEXT,
    "attnum" INTEGER,
    "backfill" TEXT,
    PRIMARY KEY ("table_name", "column_name")
);
-- Deleted rows (and rows whose key changed), newest per key; a NULL row_key marks a truncate
-- of the whole table. A row that exists with a greater _hw_seq supersedes its tombstone.
CREATE TABLE IF NOT EXISTS "_hw_tombstones" (
    "table_name" TEXT NOT NULL,
    "row_key" TEXT,
    "seq" INTEGER NOT NULL,
    "version" TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS "_hw_tombstones_key" ON "_hw_tombstones" ("table_name", "row_key");
CREATE INDEX IF NOT EXISTS "_hw_tombstones_seq" ON "_hw_tombstones" ("seq");
-- Per scope-sync client: the last of its mutations an upstream transaction applied here (its
-- `highwater.confirm` message), and the commit watermark of that transaction. Written in the
-- transaction that applies the write's rows.
CREATE TABLE IF NOT EXISTS "_hw_client_mutations" (
    "client_id" TEXT PRIMARY KEY,
    "last_mutation_id" INTEGER NOT NULL,
    "watermark" TEXT NOT NULL
);
-- Upstream indexes as the change source announced them (key indexes too, which the replica
-- keeps as its own `_hw_key` index): name, uniqueness and columns, so that an export in
-- another replica format can recreate them exactly.
CREATE TABLE IF NOT EXISTS "_hw_indexes" (
    "index_name" TEXT PRIMARY KEY,
    "table_name" TEXT NOT NULL,
    "is_unique" INTEGER NOT NULL,
    "is_key" INTEGER NOT NULL,
    "columns" TEXT NOT NULL
);
-- While a column awaits its backfill: the version of the last streamed write to it, per row.
-- A backfill read in an older snapshot must not overwrite such a value.
CREATE TABLE IF NOT EXISTS "_hw_backfill_versions" (
    "table_name" TEXT NOT NULL,
    "row_key" TEXT NOT NULL,
    "column_name" TEXT NOT NULL,
    "version" TEXT NOT NULL,
    PRIMARY KEY ("table_name", "row_key", "column_name")
) WITHOUT ROWID;
"#;

fn class_str(class: Option<PgTypeClass>) -> Option<&'static str> {
    class.map(PgTypeClass::as_str)
}

/// Adds the columns of internal tables that replicas made by earlier versions lack.
pub(crate) fn upgrade_internal_tables(conn: &Connection) -> Result<(), ReplicaError> {
    let has_metadata: bool = conn.query_row(
        r#"SELECT count(*) > 0 FROM pragma_table_info('_hw_tables') WHERE name = 'metadata'"#,
        [],
        |r| r.get(0),
    )?;
    if !has_metadata {
        conn.execute_batch(r#"ALTER TABLE "_hw_tables" ADD COLUMN "metadata" TEXT"#)?;
    }
    Ok(())
}

pub(crate) fn metadata_json(metadata: &TableMetadata) -> Value {
    let mut object = metadata.extra.clone();
    object.insert("rowKey".into(), Value::Object(metadata.row_key.clone()));
    Value::Object(object)
}

fn metadata_from_json(value: Value) -> Option<TableMetadata> {
    let Value::Object(mut object) = value else {
        return None;
    };
    let Some(Value::Object(row_key)) = object.remove("rowKey") else {
        return None;
    };
    Some(TableMetadata {
        row_key,
        extra: object,
    })
}

/// Writes a table's metadata rows (replacing any previous ones).
pub(crate) fn store_table(conn: &Connection, table: &ReplicaTable) -> Result<(), ReplicaError> {
    forget_table(conn, &table.name)?;
    conn.execute(
        r#"INSERT INTO "_hw_tables" ("table_name","schema","name","oid","replica_identity","key_columns","metadata")
           VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"#,
        params![
            table.name,
            table.schema,
            table.table,
            table.oid,
            table.replica_identity.map(ReplicaIdentity::as_str),
            serde_json::to_string(&table.key)?,
            table.metadata.as_ref().map(|m| metadata_json(m).to_string()),
        ],
    )?;
    for col in &table.columns {
        store_column(conn, &table.name, col)?;
    }
    Ok(())
}

pub(crate) fn store_column(
    conn: &Connection,
    table_name: &str,
    col: &ReplicaColumn,
) -> Result<(), ReplicaError> {
    conn.execute(
        r#"INSERT OR REPLACE INTO "_hw_columns" ("table_name","column_name","pos","upstream_type",
             "type_oid","type_class","elem_type_class","is_not_null","is_enum","is_array",
             "character_max_length","dflt","attnum","backfill")
           VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11,?12,?13,?14)"#,
        params![
            table_name,
            col.name,
            col.pos,
            col.data_type,
            col.type_oid,
            class_str(col.type_class),
            class_str(col.elem_type_class),
            col.not_null,
            col.is_enum(),
            col.kind == ValueKind::Array,
            col.character_max_length,
            col.dflt,
            col.attnum,
            col.backfill.as_ref().map(Value::to_string),
        ],
    )?;
    Ok(())
}

pub(crate) fn forget_table(conn: &Connection, table_name: &str) -> Result<(), ReplicaError> {
    conn.execute(
        r#"DELETE FROM "_hw_tables" WHERE "table_name" = ?1"#,
        [table_name],
    )?;
    conn.execute(
        r#"DELETE FROM "_hw_columns" WHERE "table_name" = ?1"#,
        [table_name],
    )?;
    Ok(())
}

/// An upstream index as recorded in `_hw_indexes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UpstreamIndex {
    /// Replica name (`index` in `public`, else `schema.index`).
    pub name: String,
    pub table_name: String,
    pub unique: bool,
    /// A primary key or replica identity index (kept as the table's `_hw_key` index).
    pub(crate) is_key: bool,
    /// Columns in index order, with their direction.
    pub columns: Vec<(String, IndexDirection)>,
}

/// Records (or replaces) an upstream index the change source announced.
pub(crate) fn record_index(
    conn: &Connection,
    spec: &IndexSpec,
    is_key: bool,
) -> Result<(), ReplicaError> {
    let columns: Vec<(&str, &str)> = spec
        .columns
        .iter()
        .map(|(c, dir)| (c.as_str(), direction_str(*dir)))
        .collect();
    conn.execute(
        r#"INSERT OR REPLACE INTO "_hw_indexes" ("index_name","table_name","is_unique","is_key","columns")
           VALUES (?1, ?2, ?3, ?4, ?5)"#,
        params![
            replica_index_name(&spec.schema, &spec.name),
            replica_table_name(&spec.schema, &spec.table_name),
            spec.unique,
            is_key,
            serde_json::to_string(&columns)?,
        ],
    )?;
    Ok(())
}

pub(crate) fn forget_index(conn: &Connection, index_name: &str) -> Result<(), ReplicaError> {
    conn.execute(
        r#"DELETE FROM "_hw_indexes" WHERE "index_name" = ?1"#,
        [index_name],
    )?;
    Ok(())
}

/// Forgets the indexes of a dropped (or replaced) table.
pub(crate) fn forget_table_indexes(
    conn: &Connection,
    table_name: &str,
) -> Result<(), ReplicaError> {
    conn.execute(
        r#"DELETE FROM "_hw_indexes" WHERE "table_name" = ?1"#,
        [table_name],
    )?;
    Ok(())
}

/// Follows a table rename (index names stay, as upstream and in SQLite).
pub(crate) fn rename_table_indexes(
    conn: &Connection,
    old: &str,
    new: &str,
) -> Result<(), ReplicaError> {
    conn.execute(
        r#"UPDATE "_hw_indexes" SET "table_name" = ?1 WHERE "table_name" = ?2"#,
        params![new, old],
    )?;
    Ok(())
}

/// Follows a column rename in the recorded index columns.
pub(crate) fn rename_index_column(
    conn: &Connection,
    table_name: &str,
    old: &str,
    new: &str,
) -> Result<(), ReplicaError> {
    for mut index in load_indexes(conn)?
        .into_iter()
        .filter(|i| i.table_name == table_name)
    {
        if !index.columns.iter().any(|(c, _)| c == old) {
            continue;
        }
        for (c, _) in index.columns.iter_mut().filter(|(c, _)| c == old) {
            *c = new.to_owned();
        }
        let columns: Vec<(&str, &str)> = index
            .columns
            .iter()
            .map(|(c, dir)| (c.as_str(), direction_str(*dir)))
            .collect();
        conn.execute(
            r#"UPDATE "_hw_indexes" SET "columns" = ?1 WHERE "index_name" = ?2"#,
            params![serde_json::to_string(&columns)?, index.name],
        )?;
    }
    Ok(())
}

fn direction_str(dir: IndexDirection) -> &'static str {
    match dir {
        IndexDirection::Asc => "ASC",
        IndexDirection::Desc => "DESC",
    }
}

/// Every recorded upstream index, by name.
pub(crate) fn load_indexes(conn: &Connection) -> Result<Vec<UpstreamIndex>, ReplicaError> {
    let mut stmt = conn.prepare(
        r#"SELECT "index_name","table_name","is_unique","is_key","columns"
           FROM "_hw_indexes" ORDER BY "index_name""#,
    )?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, bool>(2)?,
            r.get::<_, bool>(3)?,
            r.get::<_, String>(4)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (name, table_name, unique, is_key, columns) = row?;
        let columns: Vec<(String, String)> = serde_json::from_str(&columns)?;
        out.push(UpstreamIndex {
            name,
            table_name,
            unique,
            is_key,
            columns: columns
                .into_iter()
                .map(|(c, dir)| {
                    let dir = if dir == "DESC" {
                        IndexDirection::Desc
                    } else {
                        IndexDirection::Asc
                    };
                    (c, dir)
                })
                .collect(),
        });
    }
    Ok(out)
}

/// Reads every table's metadata.
pub(crate) fn load_tables(conn: &Connection) -> Result<Vec<ReplicaTable>, ReplicaError> {
    let mut tables = Vec::new();
    let mut stmt = conn.prepare(
        r#"SELECT "table_name","schema","name","oid","replica_identity","key_columns","metadata"
           FROM "_hw_tables" ORDER BY "table_name""#,
    )?;
    let rows = stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, Option<u32>>(3)?,
            r.get::<_, Option<String>>(4)?,
            r.get::<_, String>(5)?,
            r.get::<_, Option<String>>(6)?,
        ))
    })?;
    for row in rows {
        let (name, schema, table, oid, identity, key, metadata) = row?;
        tables.push(ReplicaTable {
            columns: load_columns(conn, &name)?,
            name,
            schema,
            table,
            oid,
            replica_identity: identity.as_deref().and_then(parse_replica_identity),
            key: serde_json::from_str(&key)?,
            metadata: metadata
                .map(|text| serde_json::from_str::<Value>(&text))
                .transpose()?
                .and_then(metadata_from_json),
        });
    }
    Ok(tables)
}

fn load_columns(conn: &Connection, table_name: &str) -> Result<Vec<ReplicaColumn>, ReplicaError> {
    let mut stmt = conn.prepare(
        r#"SELECT "column_name","pos","upstream_type","type_oid","type_class","elem_type_class",
                  "is_not_null","character_max_length","dflt","attnum","backfill"
           FROM "_hw_columns" WHERE "table_name" = ?1 ORDER BY "pos""#,
    )?;
    let rows = stmt.query_map([table_name], |r| {
        let data_type: String = r.get(2)?;
        let type_class = r
            .get::<_, Option<String>>(4)?
            .as_deref()
            .and_then(parse_type_class);
        Ok(ReplicaColumn {
            name: r.get(0)?,
            pos: r.get(1)?,
            kind: ValueKind::of(&data_type, type_class),
            data_type,
            type_oid: r.get(3)?,
            type_class,
            elem_type_class: r
                .get::<_, Option<String>>(5)?
                .as_deref()
                .and_then(parse_type_class),
            not_null: r.get(6)?,
            character_max_length: r.get(7)?,
            dflt: r.get(8)?,
            attnum: r.get(9)?,
            backfill: r
                .get::<_, Option<String>>(10)?
                .and_then(|t| serde_json::from_str(&t).ok()),
        })
    })?;
    Ok(rows.collect::<Result<_, _>>()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use indexmap::IndexMap;

    fn col(pos: i64, data_type: &str, class: Option<PgTypeClass>, not_null: bool) -> ColumnSpec {
        let mut spec = ColumnSpec::new(Number::from(pos), data_type);
        spec.pg_type_class = class;
        spec.not_null = Some(Some(not_null));
        spec
    }

    #[test]
    fn public_tables_keep_their_name_and_others_are_schema_qualified() {
        assert_eq!(replica_table_name("public", "issue"), "issue");
        assert_eq!(replica_table_name("app", "issue"), "app.issue");
        assert_eq!(quote_ident(r#"we"ird"#), r#""we""ird""#);
    }

    #[test]
    fn declared_types_keep_the_upstream_type_and_give_text_values_text_affinity() {
        let cases = [
            ("int8", None, true, "int8|NOT_NULL", Affinity::Integer),
            ("float8", None, false, "float8", Affinity::Real),
            ("numeric", None, false, "numeric", Affinity::Numeric),
            ("text", None, false, "text", Affinity::Text),
            ("jsonb", None, false, "jsonb|TEXT_VALUE", Affinity::Text),
            (
                "uuid",
                None,
                true,
                "uuid|NOT_NULL|TEXT_VALUE",
                Affinity::Text,
            ),
            (
                "mood",
                Some(PgTypeClass::Enum),
                false,
                "mood|TEXT_ENUM",
                Affinity::Text,
            ),
            (
                "int4[]",
                None,
                false,
                "int4[]|TEXT_ARRAY",
                Affinity::Integer,
            ),
            ("text[]", None, false, "text[]|TEXT_ARRAY", Affinity::Text),
            ("timestamptz", None, false, "timestamptz", Affinity::Numeric),
        ];
        for (data_type, class, not_null, declared, aff) in cases {
            let c = ReplicaColumn::from_spec("c", &col(1, data_type, class, not_null));
            assert_eq!(c.declared_type(), declared, "{data_type}");
            assert_eq!(affinity(&c.declared_type()), aff, "{data_type}");
        }
    }

    #[test]
    fn table_metadata_round_trips_through_the_replica() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(INTERNAL_TABLES_SQL).unwrap();
        let mut columns = IndexMap::new();
        columns.insert("id".to_owned(), col(1, "int8", None, true));
        let mut state = col(2, "state", Some(PgTypeClass::Enum), false);
        state.extra.insert("typeOID".into(), Value::from(16_400));
        state.extra.insert("attNum".into(), Value::from(2));
        columns.insert("state".to_owned(), state);
        let spec = TableSpec {
            schema: "app".into(),
            name: "issue".into(),
            columns,
            primary_key: Some(vec!["id".into()]),
            extra: serde_json::Map::new(),
        };
        let table = ReplicaTable::from_spec(&spec);
        store_table(&conn, &table).unwrap();
        let loaded = load_tables(&conn).unwrap();
        assert_eq!(loaded, vec![table.clone()]);
        assert_eq!(loaded[0].name, "app.issue");
        assert_eq!(loaded[0].column("state").unwrap().type_oid, Some(16_400));
        assert_eq!(ReplicaTable::from_spec(&table.to_spec()), table);
    }
}
