//! The SQL of one mutation on its upstream table. Postgres converts the values: every
//! statement reads the mutation's row (JSON, parameter `$1`) through
//! `jsonb_populate_record(NULL::<table>, …)`, so each column's value is cast to the column's
//! own type by Postgres' rules, and a value it cannot take fails the statement. Every
//! statement answers with the row as the array of its columns' text output ([`row_texts`]),
//! in the replica's column order: the text pgoutput sends, which the caller reads as the
//! replica does, so the rules check the values a reader of the replica sees.

use crate::replica::schema::{quote_ident, ReplicaTable};

/// The mutation's row, typed as a row of the table, named `r`; the table is `t`.
fn typed_row(target: &str) -> String {
    format!("jsonb_populate_record(NULL::{target}, $1::text::jsonb) AS r")
}

/// `schema.table` upstream, quoted.
fn target(table: &ReplicaTable) -> String {
    format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&table.table)
    )
}

/// The key columns of `t` equal to those of `r`.
fn key_match(key: &[String]) -> String {
    key.iter()
        .map(|k| format!("t.{0} = r.{0}", quote_ident(k)))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// The row `t` as the text output of each of the replica's columns, in order. `format('%s')`
/// calls the type's output function, as pgoutput does; a cast to text need not (a boolean
/// casts to `true`, an `inet` keeps its netmask, a `char(n)` loses its padding).
fn row_texts(table: &ReplicaTable) -> String {
    let columns: Vec<String> = table
        .columns
        .iter()
        .map(|c| {
            let column = format!("t.{}", quote_ident(&c.name));
            format!("CASE WHEN {column} IS NULL THEN NULL ELSE format('%s', {column}) END")
        })
        .collect();
    format!("ARRAY[{}]::text[]", columns.join(", "))
}

/// Locks the row the mutation's key names and reads it.
pub(super) fn lock_row(table: &ReplicaTable) -> String {
    let target = target(table);
    format!(
        "SELECT {} FROM {target} AS t, {} WHERE {} FOR UPDATE OF t",
        row_texts(table),
        typed_row(&target),
        key_match(&table.key)
    )
}

/// Inserts the columns the mutation names (the others take their defaults).
pub(super) fn insert<'a>(table: &ReplicaTable, columns: impl Iterator<Item = &'a str>) -> String {
    let target = target(table);
    let columns: Vec<String> = columns.map(quote_ident).collect();
    let from_row: Vec<String> = columns.iter().map(|c| format!("r.{c}")).collect();
    format!(
        "INSERT INTO {target} AS t ({}) SELECT {} FROM {} RETURNING {}",
        columns.join(", "),
        from_row.join(", "),
        typed_row(&target),
        row_texts(table)
    )
}

/// Sets the columns the mutation names on the row its key names; `None` when it names no
/// column beyond the key (nothing to set).
pub(super) fn update<'a>(
    table: &ReplicaTable,
    columns: impl Iterator<Item = &'a str>,
) -> Option<String> {
    let target = target(table);
    let set: Vec<String> = columns
        .filter(|c| !table.key.iter().any(|k| k == c))
        .map(|c| format!("{0} = r.{0}", quote_ident(c)))
        .collect();
    if set.is_empty() {
        return None;
    }
    Some(format!(
        "UPDATE {target} AS t SET {} FROM {} WHERE {} RETURNING {}",
        set.join(", "),
        typed_row(&target),
        key_match(&table.key),
        row_texts(table)
    ))
}

/// Deletes the row the mutation's key names.
pub(super) fn delete(table: &ReplicaTable) -> String {
    let target = target(table);
    format!(
        "DELETE FROM {target} AS t USING {} WHERE {} RETURNING {}",
        typed_row(&target),
        key_match(&table.key),
        row_texts(table)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::schema::ReplicaColumn;
    use highwater_engine::change_stream::ColumnSpec;
    use serde_json::Number;

    fn table() -> ReplicaTable {
        let column =
            |name: &str| ReplicaColumn::from_spec(name, &ColumnSpec::new(Number::from(1), "text"));
        ReplicaTable {
            name: "app.to\"dos".to_owned(),
            schema: "app".to_owned(),
            table: "to\"dos".to_owned(),
            oid: None,
            replica_identity: None,
            columns: vec![column("id"), column("list"), column("ti tle")],
            key: vec!["id".to_owned(), "list".to_owned()],
            metadata: None,
        }
    }

    #[test]
    fn statements_quote_every_name_and_let_postgres_type_the_row() {
        let t = table();
        assert_eq!(
            lock_row(&t),
            r#"SELECT ARRAY[CASE WHEN t."id" IS NULL THEN NULL ELSE format('%s', t."id") END, CASE WHEN t."list" IS NULL THEN NULL ELSE format('%s', t."list") END, CASE WHEN t."ti tle" IS NULL THEN NULL ELSE format('%s', t."ti tle") END]::text[] FROM "app"."to""dos" AS t, jsonb_populate_record(NULL::"app"."to""dos", $1::text::jsonb) AS r WHERE t."id" = r."id" AND t."list" = r."list" FOR UPDATE OF t"#
        );
        assert_eq!(
            insert(&t, ["id", "ti tle"].into_iter()),
            r#"INSERT INTO "app"."to""dos" AS t ("id", "ti tle") SELECT r."id", r."ti tle" FROM jsonb_populate_record(NULL::"app"."to""dos", $1::text::jsonb) AS r RETURNING ARRAY[CASE WHEN t."id" IS NULL THEN NULL ELSE format('%s', t."id") END, CASE WHEN t."list" IS NULL THEN NULL ELSE format('%s', t."list") END, CASE WHEN t."ti tle" IS NULL THEN NULL ELSE format('%s', t."ti tle") END]::text[]"#
        );
        assert_eq!(
            update(&t, ["id", "list", "done"].into_iter()).unwrap(),
            r#"UPDATE "app"."to""dos" AS t SET "done" = r."done" FROM jsonb_populate_record(NULL::"app"."to""dos", $1::text::jsonb) AS r WHERE t."id" = r."id" AND t."list" = r."list" RETURNING ARRAY[CASE WHEN t."id" IS NULL THEN NULL ELSE format('%s', t."id") END, CASE WHEN t."list" IS NULL THEN NULL ELSE format('%s', t."list") END, CASE WHEN t."ti tle" IS NULL THEN NULL ELSE format('%s', t."ti tle") END]::text[]"#
        );
        assert_eq!(update(&t, ["id", "list"].into_iter()), None);
        assert_eq!(
            delete(&t),
            r#"DELETE FROM "app"."to""dos" AS t USING jsonb_populate_record(NULL::"app"."to""dos", $1::text::jsonb) AS r WHERE t."id" = r."id" AND t."list" = r."list" RETURNING ARRAY[CASE WHEN t."id" IS NULL THEN NULL ELSE format('%s', t."id") END, CASE WHEN t."list" IS NULL THEN NULL ELSE format('%s', t."list") END, CASE WHEN t."ti tle" IS NULL THEN NULL ELSE format('%s', t."ti tle") END]::text[]"#
        );
    }
}
