//! The published schema, as upstream's catalog describes it: the query that reads it
//! ([`PUBLISHED_SCHEMA_SQL`]), its tables, columns and indexes ([`PublishedTable`]), the DDL
//! events that carry it through the WAL ([`DdlEvent`], [`event_trigger_sql`]) and the catalog
//! queries for tables known only from a Relation message ([`RELATION_TYPES_SQL`],
//! [`PRIMARY_KEY_SQL`]). What a schema change does to the replica is `replica::ddl`'s.
//!
//! Detection uses a DDL event trigger, as Zero does: at `ddl_command_end` of every table, index,
//! publication or schema command it emits the published schema with
//! `pg_logical_emit_message(true, '<app>/ddl', json)`. The message is transactional, so it sits
//! in the WAL exactly between the DDL and the row changes that depend on it, and the replica
//! diffs it against its own schema at that point. Comparing pgoutput Relation messages instead
//! needs no privileges, but Relation messages only arrive before the next row change of a table:
//! they never announce a dropped or an empty new table or an index, cannot tell a rename from a
//! drop plus an add, carry no NOT NULL or defaults, and arrive too late to backfill existing
//! rows of an added column. Event triggers need a superuser; without one, `highwater replicate`
//! warns that schema changes are not followed.
//!
//! A published table goes to the engine's schema diff as [`upstream::PublishedTable`]
//! ([`PublishedTable::to_published`]): its spec, metadata and indexes as Zero's change source
//! sends them.
//!
//! Publication column lists and row filters (Postgres 15+): [`PublishedTable::restrict_to`]
//! keeps a table's published columns (key columns always) and its publications' row filters,
//! combined with `OR`, and the initial sync and backfills read upstream with them as the stream
//! sends rows. A row filter changed later (`ALTER PUBLICATION … SET TABLE … WHERE …`) is not
//! re-applied to rows already replicated, as in Postgres' own logical replication: a resync
//! applies it.

use highwater_engine::change_stream::{
    ColumnSpec, IndexDirection, IndexSpec, ReplicaIdentity, TableMetadata, TableSpec,
};
use highwater_engine::upstream;
use serde::Deserialize;
use serde_json::{json, Number, Value};

use crate::replica::schema::{
    parse_replica_identity, parse_type_class, quote_ident, replica_table_name,
};

/// The published schema as JSON, for the publications in `$1` (a `text[]`).
///
/// Generated columns are left out (Postgres does not publish them); so are expression and
/// partial indexes, which the replica cannot represent.
pub(crate) const PUBLISHED_SCHEMA_SQL: &str = r#"
SELECT coalesce(json_agg(t ORDER BY t.schema, t.name), '[]'::json)::text FROM (
  SELECT c.oid::int8 AS oid, n.nspname::text AS schema, c.relnamespace::int8 AS "schemaOID",
    c.relname::text AS name,
    CASE c.relreplident WHEN 'd' THEN 'default' WHEN 'n' THEN 'nothing'
                        WHEN 'f' THEN 'full' ELSE 'index' END AS "replicaIdentity",
    (SELECT json_agg(DISTINCT pt.pubname::text) FROM pg_publication_tables pt
      WHERE pt.schemaname = n.nspname AND pt.tablename = c.relname
        AND pt.pubname::text = ANY($1::text[])) AS publications,
    -- Per publication, its column list and row filter (Postgres 15+; read through to_jsonb so
    -- the query also runs where pg_publication_tables has no such columns).
    (SELECT json_object_agg(pt.pubname::text, json_build_object(
        'columns', to_jsonb(pt) -> 'attnames', 'rowFilter', to_jsonb(pt) ->> 'rowfilter'))
      FROM pg_publication_tables pt
      WHERE pt.schemaname = n.nspname AND pt.tablename = c.relname
        AND pt.pubname::text = ANY($1::text[])) AS "publicationDetails",
    (SELECT coalesce(json_agg(json_build_object(
        'name', a.attname::text, 'attnum', a.attnum, 'typeOID', a.atttypid::int8,
        'dataType', CASE WHEN t.typcategory = 'A' AND et.oid IS NOT NULL
                         THEN et.typname::text || '[]' ELSE t.typname::text END,
        'typeName', t.typname::text,
        'typtype', t.typtype::text, 'elemTyptype', et.typtype::text,
        'notNull', a.attnotnull,
        'dflt', pg_get_expr(d.adbin, d.adrelid),
        'identity', a.attidentity <> '',
        'charMaxLen', CASE WHEN a.atttypmod > 4 AND t.typname IN ('bpchar', 'varchar')
                           THEN a.atttypmod - 4 END
      ) ORDER BY a.attnum), '[]'::json)
      FROM pg_attribute a
      JOIN pg_type t ON t.oid = a.atttypid
      LEFT JOIN pg_type et ON et.oid = t.typelem AND t.typcategory = 'A'
      LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
      WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
        AND a.attgenerated = '') AS columns,
    (SELECT coalesce(json_agg(a.attname::text ORDER BY k.ord), '[]'::json)
      FROM pg_index i
      CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
      WHERE i.indrelid = c.oid AND k.ord <= i.indnkeyatts
        AND CASE WHEN c.relreplident = 'i' THEN i.indisreplident
                 ELSE i.indisprimary END) AS key,
    (SELECT coalesce(json_agg(json_build_object(
        'name', ic.relname::text, 'unique', i.indisunique,
        'isPrimaryKey', i.indisprimary, 'isReplicaIdentity', i.indisreplident,
        'columns', (SELECT json_agg(json_build_array(a.attname::text,
                      CASE WHEN (i.indoption[(k.ord - 1)::int] & 1) = 1
                           THEN 'DESC' ELSE 'ASC' END) ORDER BY k.ord)
                    FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
                    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                    WHERE k.ord <= i.indnkeyatts)
      ) ORDER BY ic.relname), '[]'::json)
      FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
      WHERE i.indrelid = c.oid AND i.indpred IS NULL AND i.indexprs IS NULL
        AND NOT (0 = ANY (i.indkey::int2[]))) AS indexes
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
  WHERE c.relkind IN ('r', 'p') AND EXISTS (
    SELECT 1 FROM pg_publication_tables pt
    WHERE pt.schemaname = n.nspname AND pt.tablename = c.relname AND pt.pubname::text = ANY($1::text[]))
) t
"#;

/// One published table as [`PUBLISHED_SCHEMA_SQL`] describes it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PublishedTable {
    pub oid: u32,
    pub schema: String,
    /// Absent from DDL events written before it was added.
    #[serde(rename = "schemaOID", default)]
    pub(crate) schema_oid: Option<u32>,
    pub name: String,
    pub replica_identity: String,
    #[serde(default)]
    pub publications: Option<Vec<String>>,
    pub columns: Vec<PublishedColumn>,
    pub key: Vec<String>,
    pub indexes: Vec<PublishedIndex>,
    /// Per publication: its column list and row filter (absent before Postgres 15).
    #[serde(default)]
    pub(crate) publication_details: Option<std::collections::BTreeMap<String, PublicationDetail>>,
    /// The row filter the table is published with to the replica's publications (set by
    /// [`PublishedTable::restrict_to`]): rows outside it are never replicated.
    #[serde(skip)]
    pub row_filter: Option<String>,
}

/// How one publication publishes a table (Postgres 15+).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PublicationDetail {
    /// The published columns (every column when the publication has no column list).
    #[serde(default)]
    pub columns: Option<Vec<String>>,
    /// `WHERE` of the publication's row filter, as Postgres deparses it; `None`: every row.
    #[serde(default)]
    pub row_filter: Option<String>,
}

/// The row filter of a table published by several publications: a row is published if any of
/// them publishes it, so the filters are ORed, and one publication without a filter publishes
/// every row (as Postgres combines them for its own subscribers).
pub(crate) fn combine_row_filters<'a>(
    filters: impl IntoIterator<Item = Option<&'a str>>,
) -> Option<String> {
    let mut parts = Vec::new();
    for filter in filters {
        parts.push(format!("({})", filter?));
    }
    (!parts.is_empty()).then(|| parts.join(" OR "))
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PublishedColumn {
    pub name: String,
    pub(crate) attnum: i64,
    #[serde(rename = "typeOID")]
    pub type_oid: u32,
    pub data_type: String,
    pub(crate) type_name: String,
    pub(crate) typtype: String,
    pub(crate) elem_typtype: Option<String>,
    pub(crate) not_null: bool,
    pub dflt: Option<String>,
    #[serde(default)]
    pub identity: bool,
    pub(crate) char_max_len: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct PublishedIndex {
    pub name: String,
    pub unique: bool,
    pub(crate) is_primary_key: bool,
    pub(crate) is_replica_identity: bool,
    /// `[column, "ASC" | "DESC"]` pairs.
    pub columns: Option<Vec<(String, String)>>,
}

/// The content of a `<app>/ddl` message.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub(crate) struct DdlEvent {
    /// The command tag (`CREATE TABLE`, `ALTER TABLE`, `ALTER PUBLICATION`, …).
    pub tag: String,
    pub schema: Vec<PublishedTable>,
}

/// Parses the published schema JSON.
pub(crate) fn parse_published_schema(text: &str) -> Result<Vec<PublishedTable>, serde_json::Error> {
    serde_json::from_str(text)
}

pub(crate) fn parse_ddl_event(content: &[u8]) -> Result<DdlEvent, serde_json::Error> {
    serde_json::from_slice(content)
}

/// The logical-message prefix of DDL events of an app.
pub(crate) fn ddl_prefix(app_id: &str) -> String {
    format!("{app_id}/ddl")
}

impl PublishedColumn {
    /// The column's spec as Zero's change source sends it: `pos` is the `attnum`.
    pub(crate) fn to_spec(&self) -> ColumnSpec {
        let mut spec = ColumnSpec::new(Number::from(self.attnum), self.data_type.clone());
        spec.pg_type_class = parse_type_class(&self.typtype);
        spec.elem_pg_type_class = Some(self.elem_typtype.as_deref().and_then(parse_type_class));
        spec.character_maximum_length = Some(self.char_max_len.map(Number::from));
        spec.not_null = Some(Some(self.not_null));
        spec.dflt = Some(self.dflt.clone());
        spec.extra
            .insert("typeOID".into(), Value::from(self.type_oid));
        spec.extra.insert("attNum".into(), Value::from(self.attnum));
        spec
    }
}

impl PublishedTable {
    pub(crate) fn replica_name(&self) -> String {
        replica_table_name(&self.schema, &self.name)
    }

    /// Keeps what `publications` publish of the table: the columns of their column lists (key
    /// columns always: Postgres requires them in a column list of a publication that publishes
    /// updates or deletes), the indexes over those columns, and their combined row filter.
    /// Nothing changes for a schema read before Postgres 15 (no column lists or row filters).
    pub(crate) fn restrict_to(&mut self, publications: &[String]) {
        let Some(details) = &self.publication_details else {
            return;
        };
        let ours: Vec<&PublicationDetail> = details
            .iter()
            .filter(|(name, _)| publications.contains(name))
            .map(|(_, detail)| detail)
            .collect();
        if ours.is_empty() {
            return;
        }
        if ours.iter().all(|detail| detail.columns.is_some()) {
            let published: std::collections::BTreeSet<&str> = ours
                .iter()
                .flat_map(|detail| detail.columns.iter().flatten())
                .map(String::as_str)
                .collect();
            let key = &self.key;
            self.columns
                .retain(|c| published.contains(c.name.as_str()) || key.contains(&c.name));
            let kept: Vec<String> = self.columns.iter().map(|c| c.name.clone()).collect();
            self.indexes.retain(|index| {
                index
                    .columns
                    .iter()
                    .flatten()
                    .all(|(column, _)| kept.contains(column))
            });
        }
        self.row_filter = combine_row_filters(ours.iter().map(|d| d.row_filter.as_deref()));
    }

    /// The table's spec as Zero's change source sends it (its published-table spec: `oid`,
    /// `schemaOID`, `replicaIdentity` as `pg_class.relreplident`, `publications` as a record
    /// of row filters, `replicaIdentityColumns`).
    pub(crate) fn to_spec(&self) -> TableSpec {
        let mut extra = serde_json::Map::new();
        extra.insert("oid".into(), Value::from(self.oid));
        if let Some(schema_oid) = self.schema_oid {
            extra.insert("schemaOID".into(), Value::from(schema_oid));
        }
        let identity = parse_replica_identity(&self.replica_identity).map_or(
            self.replica_identity.as_str(),
            |i| match i {
                ReplicaIdentity::Default => "d",
                ReplicaIdentity::Nothing => "n",
                ReplicaIdentity::Full => "f",
                ReplicaIdentity::Index => "i",
            },
        );
        extra.insert("replicaIdentity".into(), Value::from(identity));
        if let Some(publications) = &self.publications {
            let record: serde_json::Map<String, Value> = publications
                .iter()
                .map(|p| {
                    let filter = self
                        .publication_details
                        .as_ref()
                        .and_then(|details| details.get(p))
                        .and_then(|detail| detail.row_filter.clone());
                    (p.clone(), json!({ "rowFilter": filter }))
                })
                .collect();
            extra.insert("publications".into(), Value::Object(record));
        }
        extra.insert("replicaIdentityColumns".into(), json!(self.key));
        TableSpec {
            schema: self.schema.clone(),
            name: self.name.clone(),
            columns: self
                .columns
                .iter()
                .map(|c| (c.name.clone(), c.to_spec()))
                .collect(),
            primary_key: (!self.key.is_empty()).then(|| self.key.clone()),
            extra,
        }
    }

    /// The table metadata Zero's change source attaches to `create-table` and `add-column`
    /// and diffs into `update-table-metadata`: `{schemaOID, relationOID, rowKey: {column:
    /// {attNum}}}`. `None` for a schema read before `schemaOID` was published.
    pub(crate) fn metadata(&self) -> Option<TableMetadata> {
        let schema_oid = self.schema_oid?;
        let row_key = self
            .key
            .iter()
            .filter_map(|k| {
                let col = self.columns.iter().find(|c| &c.name == k)?;
                Some((k.clone(), json!({"attNum": col.attnum})))
            })
            .collect();
        let mut extra = serde_json::Map::new();
        extra.insert("schemaOID".into(), Value::from(schema_oid));
        extra.insert("relationOID".into(), Value::from(self.oid));
        Some(TableMetadata { row_key, extra })
    }

    /// The table as the engine's schema diff reads it
    /// ([`upstream::PublishedTable`]): its spec, metadata and indexes as Zero's change source
    /// sends them, and its identity columns.
    pub(crate) fn to_published(&self) -> upstream::PublishedTable {
        upstream::PublishedTable {
            spec: self.to_spec(),
            metadata: self.metadata(),
            indexes: self.index_specs(),
            identity_columns: self
                .columns
                .iter()
                .filter(|c| c.identity)
                .map(|c| c.name.clone())
                .collect(),
        }
    }

    /// Its indexes (the key's among them), as `create-index` specs.
    pub(crate) fn index_specs(&self) -> Vec<IndexSpec> {
        self.indexes
            .iter()
            .filter_map(|index| {
                let columns = index.columns.as_ref()?;
                let mut extra = serde_json::Map::new();
                extra.insert("isPrimaryKey".into(), Value::from(index.is_primary_key));
                extra.insert(
                    "isReplicaIdentity".into(),
                    Value::from(index.is_replica_identity),
                );
                Some(IndexSpec {
                    schema: self.schema.clone(),
                    name: index.name.clone(),
                    table_name: self.name.clone(),
                    unique: index.unique,
                    columns: columns
                        .iter()
                        .map(|(c, dir)| {
                            let dir = if dir == "DESC" {
                                IndexDirection::Desc
                            } else {
                                IndexDirection::Asc
                            };
                            (c.clone(), dir)
                        })
                        .collect(),
                    predicate: None,
                    extra,
                })
            })
            .collect()
    }
}

/// Keeps the tables of `publications`, each as they publish it ([`PublishedTable::restrict_to`]).
pub(crate) fn in_publications(
    tables: Vec<PublishedTable>,
    publications: &[String],
) -> Vec<PublishedTable> {
    tables
        .into_iter()
        .filter(|t| {
            t.publications
                .as_ref()
                .is_none_or(|p| p.iter().any(|name| publications.contains(name)))
        })
        .map(|mut table| {
            table.restrict_to(publications);
            table
        })
        .collect()
}

impl From<&PublishedTable> for upstream::PublishedTable {
    fn from(table: &PublishedTable) -> Self {
        table.to_published()
    }
}

/// Type names and classes by OID (`$1`: `oid[]`), for columns known only from a Relation message.
pub(crate) const RELATION_TYPES_SQL: &str = "
SELECT t.oid, CASE WHEN t.typcategory = 'A' AND et.oid IS NOT NULL
                   THEN et.typname::text || '[]' ELSE t.typname::text END,
       t.typtype::text, et.typtype::text
FROM pg_type t LEFT JOIN pg_type et ON et.oid = t.typelem AND t.typcategory = 'A'
WHERE t.oid = ANY($1::oid[])";

/// The primary key of a table by OID (`$1`), in key order.
pub(crate) const PRIMARY_KEY_SQL: &str = "
SELECT a.attname::text FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = $1 AND i.indisprimary AND k.ord <= i.indnkeyatts ORDER BY k.ord";

/// SQL that installs the event trigger for `app_id` (needs a superuser). Idempotent.
pub(crate) fn event_trigger_sql(app_id: &str) -> String {
    let schema = quote_ident(app_id);
    let prefix = ddl_prefix(app_id).replace('\'', "''");
    let trigger = quote_ident(&format!("{app_id}_ddl"));
    format!(
        r#"
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE OR REPLACE FUNCTION {schema}.published_schema(pubs text[]) RETURNS text
  LANGUAGE sql STABLE AS $hw${PUBLISHED_SCHEMA_SQL}$hw$;
CREATE OR REPLACE FUNCTION {schema}.emit_ddl() RETURNS event_trigger
  LANGUAGE plpgsql AS $hw$
BEGIN
  PERFORM pg_logical_emit_message(true, '{prefix}', json_build_object(
    'tag', TG_TAG,
    'schema', {schema}.published_schema(ARRAY(SELECT pubname::text FROM pg_publication))::json
  )::text);
END
$hw$;
DROP EVENT TRIGGER IF EXISTS {trigger};
CREATE EVENT TRIGGER {trigger} ON ddl_command_end
  WHEN TAG IN ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO', 'ALTER TABLE', 'DROP TABLE',
               'CREATE INDEX', 'DROP INDEX', 'ALTER INDEX', 'ALTER PUBLICATION',
               'ALTER SCHEMA', 'DROP SCHEMA')
  EXECUTE FUNCTION {schema}.emit_ddl();
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::ddl::schema_changes;
    use crate::replica::{Replica, ReplicaState, ReplicaWriter};
    use highwater_engine::change_stream::{AddColumn, Change};
    use highwater_engine::upstream::is_key_index;

    fn column(name: &str, attnum: i64, data_type: &str) -> PublishedColumn {
        PublishedColumn {
            name: name.into(),
            attnum,
            type_oid: 23,
            data_type: data_type.into(),
            type_name: data_type.into(),
            typtype: "b".into(),
            elem_typtype: None,
            not_null: false,
            dflt: None,
            identity: false,
            char_max_len: None,
        }
    }

    fn table(oid: u32, name: &str, columns: Vec<PublishedColumn>) -> PublishedTable {
        PublishedTable {
            oid,
            schema: "public".into(),
            schema_oid: Some(2200),
            name: name.into(),
            replica_identity: "default".into(),
            publications: Some(vec!["p".into()]),
            columns,
            key: vec!["id".into()],
            indexes: vec![],
            publication_details: None,
            row_filter: None,
        }
    }

    #[test]
    fn a_table_is_kept_as_its_publications_publish_it() {
        let detail = |columns: Option<&[&str]>, filter: Option<&str>| PublicationDetail {
            columns: columns.map(|c| c.iter().map(|s| s.to_string()).collect()),
            row_filter: filter.map(str::to_owned),
        };
        let mut t = table(
            1,
            "t",
            vec![
                column("id", 1, "int8"),
                column("v", 2, "text"),
                column("tenant", 3, "int4"),
            ],
        );
        t.indexes = vec![PublishedIndex {
            name: "t_tenant".into(),
            unique: false,
            is_primary_key: false,
            is_replica_identity: false,
            columns: Some(vec![("tenant".into(), "ASC".into())]),
        }];
        t.publication_details = Some(
            [
                ("p".to_owned(), detail(Some(&["v"]), Some("(tenant = 1)"))),
                (
                    "q".to_owned(),
                    detail(Some(&["v", "tenant"]), Some("(tenant = 2)")),
                ),
                ("other".to_owned(), detail(None, None)),
            ]
            .into_iter()
            .collect(),
        );
        // One publication: its column list (the key kept), its filter, no index over a
        // column it leaves out.
        let mut only_p = t.clone();
        only_p.restrict_to(&["p".to_owned()]);
        let names: Vec<&str> = only_p.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["id", "v"]);
        assert!(only_p.indexes.is_empty());
        assert_eq!(only_p.row_filter.as_deref(), Some("((tenant = 1))"));
        // Two: the union of their columns, their filters ORed.
        let mut both = t.clone();
        both.restrict_to(&["p".to_owned(), "q".to_owned()]);
        assert_eq!(both.columns.len(), 3);
        assert_eq!(both.indexes.len(), 1);
        assert_eq!(
            both.row_filter.as_deref(),
            Some("((tenant = 1)) OR ((tenant = 2))")
        );
        // One of ours without a list or a filter publishes every column and row.
        let mut with_other = t.clone();
        with_other.restrict_to(&["p".to_owned(), "other".to_owned()]);
        assert_eq!(with_other.columns.len(), 3);
        assert_eq!(with_other.row_filter, None);
        // Another app's publications change nothing.
        let mut theirs = t.clone();
        theirs.restrict_to(&["mine".to_owned()]);
        assert_eq!((theirs.columns.len(), theirs.row_filter), (3, None));
    }

    fn replica_with(tables: &[PublishedTable]) -> ReplicaWriter {
        use highwater_engine::change_stream::{Begin, Commit, DownstreamMessage};
        use highwater_engine::watermark::Lsn;
        let mut replica = Replica::open_in_memory().unwrap();
        replica
            .store_initial_state(&ReplicaState {
                replica_version: Lsn(1).to_watermark(),
                watermark: Lsn(1).to_watermark(),
                lsn: Lsn(1),
                publications: vec!["p".into()],
                slot: "s".into(),
                app_id: "a".into(),
                next_seq: 1,
            })
            .unwrap();
        let mut writer = ReplicaWriter::new(replica);
        let wm = Lsn(2).to_watermark();
        writer
            .apply(&DownstreamMessage::Begin(Begin::new(wm.clone())))
            .unwrap();
        for change in schema_changes(writer.replica(), tables, "CREATE TABLE").unwrap() {
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
    fn renames_are_told_from_drops_by_oid_and_attnum() {
        let before = table(
            10,
            "issue",
            vec![column("id", 1, "int4"), column("t", 2, "text")],
        );
        let w = replica_with(&[before]);
        let after = table(
            10,
            "ticket",
            vec![column("id", 1, "int4"), column("title", 2, "text")],
        );
        let changes = schema_changes(w.replica(), &[after], "ALTER TABLE").unwrap();
        assert_eq!(tags(&changes), vec!["rename-table", "update-column"]);
        let Change::UpdateColumn(update) = &changes[1] else {
            panic!("expected update-column");
        };
        assert_eq!(
            (update.old.name.as_str(), update.new.name.as_str()),
            ("t", "title")
        );
        assert_eq!(update.table.name, "ticket");
    }

    #[test]
    fn a_column_dropped_and_re_added_under_its_name_is_a_drop_and_an_add() {
        let before = table(
            10,
            "issue",
            vec![column("id", 1, "int4"), column("t", 2, "text")],
        );
        let w = replica_with(&[before]);
        let mut readded = column("t", 3, "int8");
        readded.dflt = Some("0".into());
        let after = table(10, "issue", vec![column("id", 1, "int4"), readded]);
        let changes = schema_changes(w.replica(), &[after], "ALTER TABLE").unwrap();
        assert_eq!(tags(&changes), vec!["drop-column", "add-column"]);
        let Change::AddColumn(add) = &changes[1] else {
            panic!("expected add-column");
        };
        // Existing rows got a constant default upstream: the replica applies it, no backfill.
        assert_eq!(add.column.spec.dflt, Some(Some("0".to_owned())));
        assert!(add.backfill.is_none());
    }

    fn added(before: PublishedTable, new: PublishedColumn, tag: &str) -> AddColumn {
        let w = replica_with(std::slice::from_ref(&before));
        let mut after = before;
        after.columns.push(new);
        let changes = schema_changes(w.replica(), &[after], tag).unwrap();
        match changes.as_slice() {
            [Change::AddColumn(add)] => add.clone(),
            other => panic!("expected one add-column, got {:?}", tags(other)),
        }
    }

    /// Zero's view-syncer applies an `add-column` default and stops on one it cannot map
    /// (`UnsupportedColumnDefaultError: Unsupported default value for issue.updated: now()`):
    /// volatile and non-literal defaults go as `dflt: null` with a backfill, as Zero's change
    /// source sends them; a constant goes as `dflt` without one.
    #[test]
    fn added_column_defaults_follow_zeros_change_source() {
        let base = || {
            table(
                10,
                "issue",
                vec![column("id", 1, "int4"), column("t", 2, "text")],
            )
        };
        let with_default = |name: &str, data_type: &str, dflt: &str| {
            let mut c = column(name, 3, data_type);
            c.dflt = Some(dflt.into());
            c
        };
        let cases = [
            ("timestamptz", "now()", None),
            (
                "timestamptz",
                "'2024-01-01 00:00:00+00'::timestamp with time zone",
                None,
            ),
            ("int8", "nextval('issue_n_seq'::regclass)", None),
            ("date", "'2024-01-01'::date", None),
            ("int4", "5", Some("5")),
            ("bool", "true", Some("true")),
            ("text", "'open'::text", Some("'open'::text")),
            ("text[]", "'{}'::text[]", Some("'{}'::text[]")),
        ];
        for (data_type, dflt, kept) in cases {
            let add = added(base(), with_default("c", data_type, dflt), "ALTER TABLE");
            assert_eq!(
                add.column.spec.dflt,
                Some(kept.map(str::to_owned)),
                "{dflt}"
            );
            assert_eq!(add.backfill.is_some(), kept.is_none(), "{dflt}");
            // Whatever goes, Zero's replicator can apply it.
            if let Some(Some(d)) = &add.column.spec.dflt {
                assert!(highwater_engine::change_stream::lite_default(d).is_ok());
            }
            assert_eq!(
                add.table_metadata
                    .as_ref()
                    .map(|m| m.extra["relationOID"].clone()),
                Some(json!(10))
            );
            assert_eq!(add.column.spec.pos, Number::from(3), "pos is the attnum");
        }
        // No default: nothing to backfill, nothing to apply.
        let plain = added(base(), column("c", 3, "text"), "ALTER TABLE");
        assert_eq!((plain.column.spec.dflt, plain.backfill), (Some(None), None));
        // An identity has no default expression but existing rows got values.
        let mut identity = column("c", 3, "int8");
        identity.identity = true;
        let add = added(base(), identity, "ALTER TABLE");
        assert!(add.backfill.is_some());
        // Columns that appear other than by ALTER TABLE are always backfilled, even a constant.
        let add = added(base(), with_default("c", "int4", "5"), "ALTER PUBLICATION");
        assert_eq!(add.column.spec.dflt, Some(None));
        assert!(add.backfill.is_some());
    }

    #[test]
    fn create_table_carries_zeros_published_spec_and_metadata() {
        let w = replica_with(&[]);
        let mut t = table(
            11,
            "label",
            vec![column("id", 1, "int4"), column("name", 3, "text")],
        );
        t.columns[1].dflt = Some("now()".into());
        t.indexes.push(PublishedIndex {
            name: "label_pkey".into(),
            unique: true,
            is_primary_key: true,
            is_replica_identity: false,
            columns: Some(vec![("id".into(), "ASC".into())]),
        });
        let changes =
            schema_changes(w.replica(), std::slice::from_ref(&t), "CREATE TABLE").unwrap();
        // Zero's replicator creates the table without a key: the key index must follow.
        assert_eq!(tags(&changes), vec!["create-table", "create-index"]);
        let Change::CreateIndex(key) = &changes[1] else {
            panic!("expected create-index");
        };
        assert!(key.spec.unique && is_key_index(&key.spec));
        let Change::CreateTable(create) = &changes[0] else {
            panic!("expected create-table");
        };
        let spec = &create.spec;
        assert_eq!(spec.extra["schemaOID"], json!(2200));
        assert_eq!(spec.extra["replicaIdentity"], json!("d"));
        assert_eq!(
            spec.extra["publications"],
            json!({"p": {"rowFilter": null}})
        );
        assert_eq!(spec.columns["name"].pos, Number::from(3));
        // Zero's replicator ignores create-table defaults; its change source sends them as is.
        assert_eq!(spec.columns["name"].dflt, Some(Some("now()".to_owned())));
        let metadata = create.metadata.as_ref().expect("metadata");
        assert_eq!(
            metadata.row_key,
            json!({"id": {"attNum": 1}}).as_object().unwrap().clone()
        );
        assert_eq!(metadata.extra["schemaOID"], json!(2200));
        assert_eq!(metadata.extra["relationOID"], json!(11));
        // Once the table exists, its key index is not announced again.
        let mut w = w;
        let wm = highwater_engine::watermark::Lsn(3).to_watermark();
        use highwater_engine::change_stream::{Begin, Commit, DownstreamMessage};
        w.apply(&DownstreamMessage::Begin(Begin::new(wm.clone())))
            .unwrap();
        for change in changes {
            w.apply(&DownstreamMessage::Data(change)).unwrap();
        }
        w.apply(&DownstreamMessage::Commit(Commit::new(wm)))
            .unwrap();
        assert!(schema_changes(w.replica(), &[t], "CREATE INDEX")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn a_changed_row_key_or_schema_is_an_update_table_metadata() {
        let before = table(
            10,
            "issue",
            vec![column("id", 1, "int4"), column("k", 2, "int4")],
        );
        let w = replica_with(std::slice::from_ref(&before));
        assert!(w.replica().table("issue").unwrap().metadata.is_some());
        let mut moved = before.clone();
        moved.schema = "app".into();
        moved.schema_oid = Some(3000);
        let changes = schema_changes(w.replica(), &[moved], "ALTER TABLE").unwrap();
        assert_eq!(
            tags(&changes),
            vec!["rename-table", "update-table-metadata"]
        );
        let Change::UpdateTableMetadata(update) = &changes[1] else {
            panic!("expected update-table-metadata");
        };
        assert_eq!(update.old.extra["schemaOID"], json!(2200));
        assert_eq!(update.new.extra["schemaOID"], json!(3000));
        assert_eq!(update.table.schema, "app");
        // Unchanged metadata: nothing.
        assert!(schema_changes(w.replica(), &[before], "ALTER TABLE")
            .unwrap()
            .is_empty());
    }

    #[test]
    fn tables_new_to_the_publication_are_backfilled_but_created_tables_are_not() {
        let w = replica_with(&[]);
        let t = table(11, "label", vec![column("id", 1, "int4")]);
        let created =
            schema_changes(w.replica(), std::slice::from_ref(&t), "CREATE TABLE").unwrap();
        let added = schema_changes(w.replica(), &[t], "ALTER PUBLICATION").unwrap();
        let backfill = |c: &Change| match c {
            Change::CreateTable(c) => c.backfill.is_some(),
            _ => panic!("expected create-table"),
        };
        assert!(!backfill(&created[0]));
        assert!(backfill(&added[0]));
    }

    #[test]
    fn dropped_tables_and_indexes_go_first_and_new_indexes_last() {
        let mut a = table(
            10,
            "a",
            vec![column("id", 1, "int4"), column("x", 2, "int4")],
        );
        a.indexes.push(PublishedIndex {
            name: "a_x".into(),
            unique: false,
            is_primary_key: false,
            is_replica_identity: false,
            columns: Some(vec![("x".into(), "ASC".into())]),
        });
        let b = table(20, "b", vec![column("id", 1, "int4")]);
        let w = replica_with(&[a.clone(), b]);
        a.indexes[0].name = "a_x2".into();
        let c = table(30, "c", vec![column("id", 1, "int4")]);
        let changes = schema_changes(w.replica(), &[a, c], "DROP TABLE").unwrap();
        assert_eq!(
            tags(&changes),
            vec!["drop-index", "drop-table", "create-table", "create-index"]
        );
    }

    #[test]
    fn published_schema_json_parses() {
        let text = r#"[{"oid": 16384, "schema": "public", "name": "issue",
            "replicaIdentity": "default", "publications": ["p"],
            "columns": [{"name": "id", "attnum": 1, "typeOID": 20, "dataType": "int8",
                "typeName": "int8", "typtype": "b", "elemTyptype": null, "notNull": true,
                "dflt": null, "identity": false, "charMaxLen": null}],
            "key": ["id"],
            "indexes": [{"name": "issue_pkey", "unique": true, "isPrimaryKey": true,
                "isReplicaIdentity": false, "columns": [["id", "ASC"]]}]}]"#;
        let tables = parse_published_schema(text).unwrap();
        let spec = tables[0].to_spec();
        assert_eq!(spec.primary_key, Some(vec!["id".to_owned()]));
        assert_eq!(spec.columns["id"].extra["typeOID"], json!(20));
        assert!(is_key_index(&tables[0].index_specs()[0]));
    }
}
