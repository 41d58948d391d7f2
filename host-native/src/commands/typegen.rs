//! `highwater typegen --upstream URL [--out FILE]`: TypeScript types of the rows the client
//! delivers, one interface per table `serve` would replicate, read from the upstream catalog.
//!
//! Each column's type is what a `HighwaterClient` row holds for it (the replica's storage of the
//! Postgres type, as the scope feed sends it, as the client's JSON reading makes it), not the
//! Postgres type itself: timestamps and dates are numbers of milliseconds since the Unix epoch,
//! `int8` and `numeric` are numbers that turn into `bigint` past ±(2^53 − 1), enums are unions
//! of their labels, arrays may hold nulls, `json`/`jsonb` are JSON values, and every other type
//! (text, uuid, bytea as `\x…` hex, intervals, domains whatever their base type, …) is a
//! string. A column without `NOT NULL` may be
//! `null`. With `--sync-rules FILE` only the tables the rules expose are written, without the
//! columns the rules never send.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use highwater_engine::scope_sync::rules::SyncRules;

use crate::replica::schema::replica_table_name;
use crate::replication::setup::{ReplicationNames, UpstreamTarget, ALL_TABLES_WHERE};
use crate::replication::ConnectParams;

/// Command-line arguments of `highwater typegen`.
#[derive(Debug, Clone, clap::Args)]
pub struct TypegenArgs {
    #[command(flatten)]
    pub target: UpstreamTarget,
    /// Only the tables these sync rules expose, without their omitted columns.
    #[arg(long, value_name = "FILE")]
    pub sync_rules: Option<PathBuf>,
    /// Write the types here instead of to stdout.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// One column as the catalog describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    /// The type's name, or an array's element type. A domain goes by its own name: the
    /// replica stores its values as text, whatever its base type.
    pub(crate) type_name: String,
    pub(crate) is_array: bool,
    pub(crate) not_null: bool,
    /// The labels of an enum (or of an array's enum element), in order.
    pub(crate) enum_labels: Option<Vec<String>>,
}

/// One table, by the name scopes use (`resourceType`: `todos`, or `schema.table` outside
/// `public`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub name: String,
    pub columns: Vec<Column>,
}

/// Runs `highwater typegen`.
pub fn run(args: TypegenArgs) -> anyhow::Result<()> {
    crate::runtime::init_tracing("warn");
    let rules = match &args.sync_rules {
        Some(path) => Some(crate::sync_auth::read_rules(path)?),
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let tables = runtime.block_on(read_tables(&args))?;
    let tables = match &rules {
        Some(rules) => exposed(tables, rules),
        None => tables,
    };
    let text = render(&tables);
    match &args.out {
        Some(path) => std::fs::write(path, text)
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => print!("{text}"),
    }
    Ok(())
}

/// The tables the rules expose, without the columns they never send.
pub(crate) fn exposed(tables: Vec<Table>, rules: &SyncRules) -> Vec<Table> {
    tables
        .into_iter()
        .filter_map(|mut table| {
            let table_rules = rules.table(&table.name)?;
            table
                .columns
                .retain(|c| !table_rules.omit_columns().contains(&c.name));
            Some(table)
        })
        .collect()
}

async fn read_tables(args: &TypegenArgs) -> anyhow::Result<Vec<Table>> {
    let target = &args.target;
    let params: ConnectParams = target.upstream.parse()?;
    let (client, connection) = params.upstream().connect().await?;
    tokio::spawn(connection);
    let publications = target.wanted_publications(&ReplicationNames::for_app(&target.app_id)?);
    let existing: Vec<String> = client
        .query(
            "SELECT pubname::text FROM pg_publication WHERE pubname = ANY($1)",
            &[&publications],
        )
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    if existing.is_empty() && !target.publications.is_empty() {
        anyhow::bail!(
            "expected the publications {publications:?} upstream, found none of them; \
             `highwater doctor` says how to create them"
        );
    }
    // The tables `serve` replicates: the publications', or all while the default one is still
    // to be created FOR ALL TABLES.
    let tables = if existing.is_empty() {
        format!(
            "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE {ALL_TABLES_WHERE}"
        )
    } else {
        "SELECT (quote_ident(schemaname) || '.' || quote_ident(tablename))::regclass::oid \
         FROM pg_publication_tables WHERE pubname = ANY($1)"
            .to_owned()
    };
    let bind: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = if existing.is_empty() {
        Vec::new()
    } else {
        vec![&existing]
    };
    let rows = client
        .query(
            &format!(
                "SELECT n.nspname::text, c.relname::text, a.attname::text, \
                   coalesce(et.typname, t.typname)::text, t.typcategory = 'A', a.attnotnull, \
                   (SELECT array_agg(e.enumlabel::text ORDER BY e.enumsortorder) FROM pg_enum e \
                     WHERE e.enumtypid = coalesce(et.oid, t.oid)) \
                 FROM pg_class c \
                 JOIN pg_namespace n ON n.oid = c.relnamespace \
                 JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 \
                   AND NOT a.attisdropped AND a.attgenerated = '' \
                 JOIN pg_type t ON t.oid = a.atttypid \
                 LEFT JOIN pg_type et ON et.oid = t.typelem AND t.typcategory = 'A' \
                 WHERE c.oid IN ({tables}) \
                 ORDER BY 1, 2, a.attnum"
            ),
            &bind,
        )
        .await?;
    let mut by_table: BTreeMap<String, Vec<Column>> = BTreeMap::new();
    for row in rows {
        let schema: String = row.get(0);
        let table: String = row.get(1);
        by_table
            .entry(replica_table_name(&schema, &table))
            .or_default()
            .push(Column {
                name: row.get(2),
                type_name: row.get(3),
                is_array: row.get(4),
                not_null: row.get(5),
                enum_labels: row.get(6),
            });
    }
    Ok(by_table
        .into_iter()
        .map(|(name, columns)| Table { name, columns })
        .collect())
}

/// The TypeScript type of one value of the column, null aside.
pub(crate) fn ts_type(column: &Column) -> String {
    let scalar = match &column.enum_labels {
        Some(labels) if !labels.is_empty() => labels
            .iter()
            .map(|label| serde_json::Value::String(label.clone()).to_string())
            .collect::<Vec<_>>()
            .join(" | "),
        _ => match column.type_name.as_str() {
            "bool" => "boolean",
            "int2" | "int4" | "oid" | "float4" | "float8" => "number",
            // Exact past 2^53 − 1 only as a bigint, which the client makes of such integers.
            "int8" | "numeric" => "number | bigint",
            // Milliseconds since the Unix epoch (a time: since midnight).
            "timestamp" | "timestamptz" | "date" | "time" | "timetz" => "number",
            "json" | "jsonb" => "JsonValue",
            _ => "string",
        }
        .to_owned(),
    };
    if column.is_array {
        format!("Array<{scalar} | null>")
    } else {
        scalar
    }
}

/// The file: one interface per table and a `Tables` map from scope name to row type.
pub fn render(tables: &[Table]) -> String {
    let mut out = String::from(
        "// Row types of the tables Highwater replicates, as `HighwaterClient` delivers them.\n\
         // Written by `highwater typegen`; run it again after a schema change.\n\
         import type { JsonValue } from \"highwater\";\n",
    );
    let mut names: BTreeMap<String, usize> = BTreeMap::new();
    let mut entries = Vec::new();
    for table in tables {
        let mut name = interface_name(&table.name);
        let seen = names.entry(name.clone()).or_default();
        *seen += 1;
        if *seen > 1 {
            name = format!("{name}{seen}");
        }
        let _ = writeln!(out, "\n/** `{}` */\nexport interface {name} {{", table.name);
        for column in &table.columns {
            let nullable = if column.not_null { "" } else { " | null" };
            let _ = writeln!(
                out,
                "  {}: {}{nullable};",
                property_name(&column.name),
                ts_type(column)
            );
        }
        out.push_str("}\n");
        entries.push((table.name.clone(), name));
    }
    out.push_str("\n/** Row type by `resourceType`. */\nexport interface Tables {\n");
    for (table, name) in &entries {
        let _ = writeln!(out, "  {}: {name};", property_name(table));
    }
    out.push_str("}\n");
    out
}

/// `todo_items` → `TodoItems`, `audit.log` → `AuditLog`; a name that would start with a digit
/// gets a leading `T`.
fn interface_name(table: &str) -> String {
    let mut name = String::new();
    for part in table.split(|c: char| !c.is_ascii_alphanumeric()) {
        let mut chars = part.chars();
        if let Some(first) = chars.next() {
            name.push(first.to_ascii_uppercase());
            name.extend(chars);
        }
    }
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        name.insert(0, 'T');
    }
    name
}

/// A property name as written in an interface: bare when it is an identifier, else quoted.
fn property_name(name: &str) -> String {
    let identifier = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == '$')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$');
    if identifier {
        name.to_owned()
    } else {
        serde_json::Value::String(name.to_owned()).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn column(name: &str, type_name: &str, not_null: bool) -> Column {
        Column {
            name: name.to_owned(),
            type_name: type_name.to_owned(),
            is_array: false,
            not_null,
            enum_labels: None,
        }
    }

    #[test]
    fn columns_are_typed_as_the_client_delivers_them() {
        let expect = [
            ("bool", "boolean"),
            ("int4", "number"),
            ("int8", "number | bigint"),
            ("numeric", "number | bigint"),
            ("timestamptz", "number"),
            ("date", "number"),
            ("jsonb", "JsonValue"),
            ("uuid", "string"),
            ("bytea", "string"),
            ("interval", "string"),
        ];
        for (pg, ts) in expect {
            assert_eq!(ts_type(&column("c", pg, true)), ts, "{pg}");
        }
        let mut tags = column("tags", "text", false);
        tags.is_array = true;
        assert_eq!(ts_type(&tags), "Array<string | null>");
        let mut mood = column("mood", "mood", true);
        mood.enum_labels = Some(vec!["sad".into(), "o\"k".into()]);
        assert_eq!(ts_type(&mood), r#""sad" | "o\"k""#);
    }

    #[test]
    fn the_file_has_an_interface_per_table_and_a_map_by_resource_type() {
        let tables = vec![
            Table {
                name: "todo_items".into(),
                columns: vec![column("id", "int8", true), column("due at", "date", false)],
            },
            Table {
                name: "audit.todo_items".into(),
                columns: vec![column("id", "int4", true)],
            },
        ];
        let text = render(&tables);
        assert!(text.contains("export interface TodoItems {\n  id: number | bigint;\n  \"due at\": number | null;\n}"), "{text}");
        assert!(text.contains("export interface AuditTodoItems {"), "{text}");
        assert!(
            text.contains("  todo_items: TodoItems;\n  \"audit.todo_items\": AuditTodoItems;"),
            "{text}"
        );
        assert_eq!(interface_name("2fa"), "T2fa");
    }

    #[test]
    fn sync_rules_keep_the_tables_they_expose_without_omitted_columns() {
        let rules = SyncRules::from_json(
            r#"{"tables":{"todos":{"filterColumns":["owner"],"omitColumns":["secret"]}}}"#,
        )
        .expect("rules");
        let tables = vec![
            Table {
                name: "todos".into(),
                columns: vec![column("id", "int8", true), column("secret", "text", false)],
            },
            Table {
                name: "hidden".into(),
                columns: vec![column("id", "int8", true)],
            },
        ];
        let kept = exposed(tables, &rules);
        assert_eq!(kept.len(), 1);
        let names: Vec<&str> = kept[0].columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["id"]);
    }
}
