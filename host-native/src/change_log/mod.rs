//! The durable change log of Zero's change-streamer protocol: every upstream transaction as it was
//! forwarded, so subscribers that are behind can be caught up.
//!
//! # Where it lives
//!
//! The log's tables live **inside `replica.db`**, next to the replica, not in a separate
//! `changelog.db`. Each upstream transaction is then applied to the replica and appended to the
//! log in one SQLite transaction: one commit, one WAL fsync, and after a crash at any point the
//! replica position and `lastWatermark` are equal by construction, so the upstream ack (sent only
//! after that commit) never runs ahead of either. A separate file would need two commits per
//! transaction (SQLite's cross-file atomic commit does not hold in WAL mode) and a recovery step
//! reconciling the two positions after every crash. What a separate file would give — purging and
//! vacuuming the log on its own, serving the replica file without the log — is covered here by
//! purging in bounded chunks between transactions and by dropping the log tables from snapshot
//! copies (`serve::snapshot`).
//!
//! # Tables (Zero's `cdc` schema, in SQLite)
//!
//! * `_hw_change_log` — `(watermark, pos)` key, the inner `tag`, and `change`: the second element
//!   of the downstream tuple only (the inner object). `pos` is 0 for `begin`, the commit last.
//! * `_hw_change_log_state` — `lastWatermark`, `owner`, `ownerAddress` (single row).
//! * `_hw_change_log_config` — `replicaVersion`, `publications`, `resetRequired` (single row).
//! * `_hw_change_log_table_metadata`, `_hw_change_log_backfilling` — the cookie jar
//!   (`docs/protocol/change-stream.md`, "Backfills").
//!
//! Functions here take the connection they work on; the writer functions expect the caller to
//! have a transaction open (the replica writer's), so the log commits with the replica.
//!
//! `_hw_change_log` keeps SQLite's rowid beside its `(watermark, pos)` key: a `WITHOUT ROWID`
//! table, tried, saved too little per transaction to be worth a second layout of the log
//! (`BENCHMARKS.md`, section "Fan-out: one change stream to many subscribers, and catch-up
//! from the log").

mod catchup;

use highwater_engine::backfill::{
    cookie_jar_requests, cookie_ops, BackfillCookie, CookieOp, MetadataCookie, TableRef,
};
use highwater_engine::change_stream::{
    parse_json, BackfillRequest, Change, DecodeError, Extra, TableMetadata,
};
use highwater_engine::watermark::{Watermark, WatermarkError};
use rusqlite::{params, Connection, OptionalExtension};
use serde_json::{Map, Value};

pub(crate) use catchup::{CatchupLimits, CatchupReader, DEFAULT_CATCHUP_BATCH_ROWS};

/// Rows deleted per purge statement, so a large purge never holds the write lock for long.
pub(crate) const PURGE_CHUNK_ROWS: usize = 10_000;

/// DDL of the change log's tables.
pub(crate) const SCHEMA_SQL: &str = r#"
CREATE TABLE IF NOT EXISTS "_hw_change_log" (
    "watermark" TEXT NOT NULL,
    "pos" INTEGER NOT NULL,
    "tag" TEXT NOT NULL,
    "change" TEXT NOT NULL,
    PRIMARY KEY ("watermark", "pos")
);
CREATE TABLE IF NOT EXISTS "_hw_change_log_state" (
    "lock" INTEGER PRIMARY KEY CHECK ("lock" = 1),
    "last_watermark" TEXT NOT NULL,
    "owner" TEXT,
    "owner_address" TEXT
);
CREATE TABLE IF NOT EXISTS "_hw_change_log_config" (
    "lock" INTEGER PRIMARY KEY CHECK ("lock" = 1),
    "replica_version" TEXT NOT NULL,
    "publications" TEXT NOT NULL,
    "reset_required" INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS "_hw_change_log_table_metadata" (
    "schema" TEXT NOT NULL,
    "table" TEXT NOT NULL,
    "metadata" TEXT NOT NULL,
    PRIMARY KEY ("schema", "table")
);
CREATE TABLE IF NOT EXISTS "_hw_change_log_backfilling" (
    "schema" TEXT NOT NULL,
    "table" TEXT NOT NULL,
    "column" TEXT NOT NULL,
    "backfill" TEXT NOT NULL,
    PRIMARY KEY ("schema", "table", "column")
);
"#;

/// Names of the change log's tables (dropped from replica snapshots).
pub(crate) const TABLES: [&str; 5] = [
    "_hw_change_log",
    "_hw_change_log_state",
    "_hw_change_log_config",
    "_hw_change_log_table_metadata",
    "_hw_change_log_backfilling",
];

#[derive(Debug, thiserror::Error)]
pub enum ChangeLogError {
    #[error("change log database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("change log holds an invalid watermark: {0}")]
    Watermark(#[from] WatermarkError),
    #[error("change log holds invalid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("change log holds an invalid cookie: {0}")]
    Cookie(#[from] DecodeError),
    #[error("the change log has not been initialized")]
    NotInitialized,
    /// The log cannot serve this replica and the replica is past its initial sync: only a new
    /// initial sync (which reseeds the log) can fix it.
    #[error("the change log must be reset with a new initial sync: {reason}")]
    ResetRequired { reason: String },
}

/// Which replica the log belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChangeLogConfig {
    pub replica_version: Watermark,
    pub publications: Vec<String>,
}

/// Where the log stands (`getChangeLogState` plus the newest commit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChangeLogStatus {
    pub replica_version: Watermark,
    /// The newest stored commit (`replicationState.lastWatermark`).
    pub last_watermark: Watermark,
    /// The earliest stored watermark; the replica version for an empty log.
    pub min_watermark: Watermark,
    pub(crate) reset_required: bool,
}

/// What a purge did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PurgeReport {
    pub deleted: usize,
    /// The earliest watermark left.
    pub min_watermark: Watermark,
}

/// Creates the tables if missing.
pub(crate) fn create_tables(conn: &Connection) -> Result<(), ChangeLogError> {
    conn.execute_batch(SCHEMA_SQL)?;
    Ok(())
}

/// Makes the log belong to `config` (`change-stream.md`, "The change log"). A log for another
/// replica version or other publications (or none at all) is emptied and reseeded — only while
/// the replica is freshly synced (`replica_watermark == replica_version`); otherwise the log
/// could not serve the transactions the replica already holds and
/// [`ChangeLogError::ResetRequired`] asks for a new initial sync. Runs in its own transaction.
pub(crate) fn ensure(
    conn: &Connection,
    config: &ChangeLogConfig,
    replica_watermark: &Watermark,
) -> Result<ChangeLogStatus, ChangeLogError> {
    create_tables(conn)?;
    let current = status(conn)?;
    if let Some(status) = &current {
        if status.reset_required {
            return Err(ChangeLogError::ResetRequired {
                reason: "the change log was marked reset-required".to_owned(),
            });
        }
        let publications = stored_publications(conn)?;
        if status.replica_version == config.replica_version && publications == config.publications {
            if status.last_watermark != *replica_watermark {
                return Err(ChangeLogError::ResetRequired {
                    reason: format!(
                        "expected the replica at the change log's last watermark {}, found it at {replica_watermark}",
                        status.last_watermark
                    ),
                });
            }
            return Ok(status.clone());
        }
    }
    if *replica_watermark != config.replica_version {
        let found = match &current {
            Some(status) => format!(
                "a change log for replica version {}",
                status.replica_version
            ),
            None => "no change log".to_owned(),
        };
        return Err(ChangeLogError::ResetRequired {
            reason: format!(
                "expected a change log for replica version {} (the replica is at {replica_watermark}), found {found}",
                config.replica_version
            ),
        });
    }
    reseed(conn, config)?;
    status(conn)?.ok_or(ChangeLogError::NotInitialized)
}

/// Empties every table and seeds the log for a replica freshly synced at
/// `config.replica_version`: `lastWatermark = replicaVersion` and the two rows
/// `(replicaVersion, 0, begin)`, `(replicaVersion, 1, commit)`, so subscribers starting at the
/// replica version can be caught up.
pub(crate) fn reseed(conn: &Connection, config: &ChangeLogConfig) -> Result<(), ChangeLogError> {
    let version = config.replica_version.as_str();
    let tx = conn.unchecked_transaction()?;
    for table in TABLES {
        tx.execute(&format!(r#"DELETE FROM "{table}""#), [])?;
    }
    tx.execute(
        r#"INSERT INTO "_hw_change_log_config" ("lock","replica_version","publications","reset_required")
           VALUES (1, ?1, ?2, 0)"#,
        params![version, serde_json::to_string(&config.publications)?],
    )?;
    tx.execute(
        r#"INSERT INTO "_hw_change_log_state" ("lock","last_watermark") VALUES (1, ?1)"#,
        params![version],
    )?;
    append(
        &tx,
        &config.replica_version,
        0,
        "begin",
        r#"{"tag":"begin"}"#,
    )?;
    append(
        &tx,
        &config.replica_version,
        1,
        "commit",
        r#"{"tag":"commit"}"#,
    )?;
    tx.commit()?;
    Ok(())
}

/// The log's position, or `None` before [`ensure`] ran.
pub(crate) fn status(conn: &Connection) -> Result<Option<ChangeLogStatus>, ChangeLogError> {
    let row = conn
        .query_row(
            r#"SELECT c."replica_version", c."reset_required", s."last_watermark",
                      (SELECT MIN("watermark") FROM "_hw_change_log")
               FROM "_hw_change_log_config" c, "_hw_change_log_state" s
               WHERE c."lock" = 1 AND s."lock" = 1"#,
            [],
            |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, bool>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, Option<String>>(3)?,
                ))
            },
        )
        .optional()?;
    let Some((version, reset_required, last, min)) = row else {
        return Ok(None);
    };
    let replica_version = Watermark::parse(&version)?;
    let min_watermark = match min {
        Some(min) => Watermark::parse(&min)?,
        None => replica_version.clone(),
    };
    Ok(Some(ChangeLogStatus {
        last_watermark: Watermark::parse(&last)?,
        replica_version,
        min_watermark,
        reset_required,
    }))
}

fn stored_publications(conn: &Connection) -> Result<Vec<String>, ChangeLogError> {
    let text: String = conn.query_row(
        r#"SELECT "publications" FROM "_hw_change_log_config" WHERE "lock" = 1"#,
        [],
        |r| r.get(0),
    )?;
    Ok(serde_json::from_str(&text)?)
}

/// Writes one row of the open transaction. `change` is the inner object's JSON text.
pub(crate) fn append(
    conn: &Connection,
    watermark: &Watermark,
    pos: u64,
    tag: &str,
    change: &str,
) -> Result<(), ChangeLogError> {
    conn.prepare_cached(
        r#"INSERT INTO "_hw_change_log" ("watermark","pos","tag","change") VALUES (?1, ?2, ?3, ?4)"#,
    )?
    .execute(params![
        watermark.as_str(),
        i64::try_from(pos).unwrap_or(i64::MAX),
        tag,
        change
    ])?;
    Ok(())
}

/// One row of the log, for [`append_rows`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogRow<'a> {
    pub watermark: &'a Watermark,
    pub pos: u64,
    pub tag: &'a str,
    pub change: &'a str,
}

/// Rows written by one statement at most in [`append_rows`].
const ROWS_PER_INSERT: usize = 8;

/// Writes rows of the open transaction, up to [`ROWS_PER_INSERT`] to a statement (a small
/// transaction's `begin`, changes and `commit` in one): what [`append`] does for each, with a
/// statement's fixed cost paid once per few rows.
pub(crate) fn append_rows(conn: &Connection, rows: &[LogRow<'_>]) -> Result<(), ChangeLogError> {
    static SQL: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let sql = SQL.get_or_init(|| {
        (1..=ROWS_PER_INSERT)
            .map(|n| {
                let values = vec!["(?, ?, ?, ?)"; n].join(", ");
                format!(
                    r#"INSERT INTO "_hw_change_log" ("watermark","pos","tag","change") VALUES {values}"#
                )
            })
            .collect()
    });
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        let mut statement = conn.prepare_cached(&sql[chunk.len() - 1])?;
        for (n, row) in chunk.iter().enumerate() {
            let at = n * 4;
            statement.raw_bind_parameter(at + 1, row.watermark.as_str())?;
            statement.raw_bind_parameter(at + 2, i64::try_from(row.pos).unwrap_or(i64::MAX))?;
            statement.raw_bind_parameter(at + 3, row.tag)?;
            statement.raw_bind_parameter(at + 4, row.change)?;
        }
        statement.raw_execute()?;
    }
    Ok(())
}

/// Applies a schema change's cookie-jar updates (`change-stream.md`, "Backfills") in the open
/// transaction.
pub(crate) fn apply_cookie_ops(conn: &Connection, change: &Change) -> Result<(), ChangeLogError> {
    for op in cookie_ops(change) {
        apply_cookie_op(conn, &op)?;
    }
    Ok(())
}

fn apply_cookie_op(conn: &Connection, op: &CookieOp<'_>) -> Result<(), ChangeLogError> {
    match op {
        CookieOp::UpsertMetadata { table, metadata } => {
            conn.execute(
                r#"INSERT OR REPLACE INTO "_hw_change_log_table_metadata" ("schema","table","metadata")
                   VALUES (?1, ?2, ?3)"#,
                params![table.schema, table.name, metadata_json(metadata).to_string()],
            )?;
        }
        CookieOp::UpsertBackfill { table, column, id } => {
            conn.execute(
                r#"INSERT OR REPLACE INTO "_hw_change_log_backfilling" ("schema","table","column","backfill")
                   VALUES (?1, ?2, ?3, ?4)"#,
                params![table.schema, table.name, column, id.to_string()],
            )?;
        }
        CookieOp::RenameTable { old, new } => {
            for table in [
                "_hw_change_log_table_metadata",
                "_hw_change_log_backfilling",
            ] {
                conn.execute(
                    &format!(
                        r#"UPDATE OR REPLACE "{table}" SET "schema" = ?3, "table" = ?4
                           WHERE "schema" = ?1 AND "table" = ?2"#
                    ),
                    params![old.schema, old.name, new.schema, new.name],
                )?;
            }
        }
        CookieOp::DropTable { table } => {
            for name in [
                "_hw_change_log_table_metadata",
                "_hw_change_log_backfilling",
            ] {
                conn.execute(
                    &format!(r#"DELETE FROM "{name}" WHERE "schema" = ?1 AND "table" = ?2"#),
                    params![table.schema, table.name],
                )?;
            }
        }
        CookieOp::RenameColumn { table, old, new } => {
            conn.execute(
                r#"UPDATE OR REPLACE "_hw_change_log_backfilling" SET "column" = ?4
                   WHERE "schema" = ?1 AND "table" = ?2 AND "column" = ?3"#,
                params![table.schema, table.name, old, new],
            )?;
        }
        CookieOp::DropColumn { table, column } => delete_backfill(conn, table, column)?,
        CookieOp::CompleteBackfill { table, columns } => {
            for column in columns {
                delete_backfill(conn, table, column)?;
            }
        }
    }
    Ok(())
}

fn delete_backfill(
    conn: &Connection,
    table: &TableRef<'_>,
    column: &str,
) -> Result<(), ChangeLogError> {
    conn.execute(
        r#"DELETE FROM "_hw_change_log_backfilling" WHERE "schema" = ?1 AND "table" = ?2 AND "column" = ?3"#,
        params![table.schema, table.name, column],
    )?;
    Ok(())
}

/// TableMetadata as the JSON object it is on the wire.
fn metadata_json(metadata: &TableMetadata) -> Value {
    let mut object = Map::new();
    object.insert("rowKey".to_owned(), Value::Object(metadata.row_key.clone()));
    for (key, value) in &metadata.extra {
        if key != "rowKey" {
            object.insert(key.clone(), value.clone());
        }
    }
    Value::Object(object)
}

fn metadata_from_json(text: &str) -> Result<TableMetadata, ChangeLogError> {
    let Value::Object(mut object) = parse_json(text)? else {
        return Err(ChangeLogError::Json(serde::de::Error::custom(
            "expected table metadata to be a JSON object",
        )));
    };
    let row_key = match object.shift_remove("rowKey") {
        Some(Value::Object(row_key)) => row_key,
        _ => {
            return Err(ChangeLogError::Json(serde::de::Error::custom(
                "expected table metadata with a rowKey object",
            )))
        }
    };
    let mut extra = Extra::new();
    extra.extend(object);
    Ok(TableMetadata { row_key, extra })
}

/// Sets `lastWatermark` to the commit being written (in the open transaction).
pub(crate) fn commit(conn: &Connection, watermark: &Watermark) -> Result<(), ChangeLogError> {
    conn.prepare_cached(
        r#"UPDATE "_hw_change_log_state" SET "last_watermark" = ?1 WHERE "lock" = 1"#,
    )?
    .execute(params![watermark.as_str()])?;
    Ok(())
}

/// Records who writes the log and where subscribers reach it (discovery).
pub(crate) fn set_owner(
    conn: &Connection,
    owner: &str,
    owner_address: &str,
) -> Result<(), ChangeLogError> {
    conn.execute(
        r#"UPDATE "_hw_change_log_state" SET "owner" = ?1, "owner_address" = ?2 WHERE "lock" = 1"#,
        params![owner, owner_address],
    )?;
    Ok(())
}

/// Marks the log unusable (`resetRequired`): the next start resyncs.
#[cfg(test)]
pub(crate) fn mark_reset_required(conn: &Connection) -> Result<(), ChangeLogError> {
    conn.execute(
        r#"UPDATE "_hw_change_log_config" SET "reset_required" = 1 WHERE "lock" = 1"#,
        [],
    )?;
    Ok(())
}

/// The pending backfills the cookie jar stands for, to start an upstream stream with.
pub(crate) fn cookie_jar(conn: &Connection) -> Result<Vec<BackfillRequest>, ChangeLogError> {
    let mut metadata = Vec::new();
    let mut stmt = conn.prepare(
        r#"SELECT "schema","table","metadata" FROM "_hw_change_log_table_metadata" ORDER BY "schema","table""#,
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        metadata.push(MetadataCookie {
            schema: r.get(0)?,
            table: r.get(1)?,
            metadata: metadata_from_json(&r.get::<_, String>(2)?)?,
        });
    }
    let mut backfilling = Vec::new();
    let mut stmt = conn.prepare(
        r#"SELECT "schema","table","column","backfill" FROM "_hw_change_log_backfilling"
           ORDER BY "schema","table","column""#,
    )?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        backfilling.push(BackfillCookie {
            schema: r.get(0)?,
            table: r.get(1)?,
            column: r.get(2)?,
            id: parse_json(&r.get::<_, String>(3)?)?,
        });
    }
    Ok(cookie_jar_requests(metadata, backfilling))
}

/// Deletes the rows of transactions below `below`, always keeping the newest stored
/// transaction (`change-stream.md`, "Purging"). Runs in chunks of [`PURGE_CHUNK_ROWS`], each its
/// own transaction: call it between upstream transactions.
pub(crate) fn purge(conn: &Connection, below: &Watermark) -> Result<PurgeReport, ChangeLogError> {
    let mut deleted = 0;
    loop {
        let n = conn
            .prepare_cached(
                r#"DELETE FROM "_hw_change_log" WHERE rowid IN (
                     SELECT rowid FROM "_hw_change_log"
                     WHERE "watermark" < ?1
                       AND "watermark" < (SELECT MAX("watermark") FROM "_hw_change_log")
                     ORDER BY "watermark", "pos"
                     LIMIT ?2)"#,
            )?
            .execute(params![below.as_str(), PURGE_CHUNK_ROWS as i64])?;
        deleted += n;
        if n < PURGE_CHUNK_ROWS {
            break;
        }
    }
    let min_watermark = status(conn)?
        .ok_or(ChangeLogError::NotInitialized)?
        .min_watermark;
    Ok(PurgeReport {
        deleted,
        min_watermark,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use highwater_engine::change_stream::decode_change_value;
    use highwater_engine::streamer::CatchupRow;
    use highwater_engine::watermark::Lsn;
    use proptest::prelude::*;
    use serde_json::json;
    use std::ops::ControlFlow;

    fn w(n: u64) -> Watermark {
        Lsn(n).to_watermark()
    }

    fn config(version: u64) -> ChangeLogConfig {
        ChangeLogConfig {
            replica_version: w(version),
            publications: vec!["pub".to_owned()],
        }
    }

    fn fresh(version: u64) -> Connection {
        let conn = Connection::open_in_memory().expect("sqlite");
        ensure(&conn, &config(version), &w(version)).expect("seeded");
        conn
    }

    /// Stores a transaction of `rows` inserts the way the host does: one SQLite transaction.
    fn store(conn: &Connection, watermark: &Watermark, rows: usize) {
        let tx = conn.unchecked_transaction().expect("begin");
        append(&tx, watermark, 0, "begin", r#"{"tag":"begin"}"#).expect("begin row");
        for i in 0..rows {
            let change = format!(r#"{{"tag":"insert","n":{i}}}"#);
            append(&tx, watermark, i as u64 + 1, "insert", &change).expect("row");
        }
        append(
            &tx,
            watermark,
            rows as u64 + 1,
            "commit",
            r#"{"tag":"commit"}"#,
        )
        .expect("commit row");
        commit(&tx, watermark).expect("last watermark");
        tx.commit().expect("commit");
    }

    fn read_all(conn: Connection, from: &Watermark, through: &Watermark) -> Vec<CatchupRow> {
        let mut reader = CatchupReader::from_connection(conn);
        let mut out = Vec::new();
        reader
            .read(from, through, CatchupLimits::default(), |rows| {
                out.extend(rows);
                ControlFlow::Continue(())
            })
            .expect("read");
        out
    }

    #[test]
    fn a_fresh_log_is_seeded_with_the_replica_version_transaction() {
        let conn = fresh(100);
        let status = status(&conn).expect("status").expect("initialized");
        assert_eq!(
            status,
            ChangeLogStatus {
                replica_version: w(100),
                last_watermark: w(100),
                min_watermark: w(100),
                reset_required: false,
            }
        );
        let rows = read_all(conn, &w(100), &w(100));
        let tags: Vec<(&str, &str)> = rows
            .iter()
            .map(|r| (r.tag.as_str(), r.change.as_str()))
            .collect();
        assert_eq!(
            tags,
            [
                ("begin", r#"{"tag":"begin"}"#),
                ("commit", r#"{"tag":"commit"}"#)
            ]
        );
    }

    /// Rows written several to a statement read back as the same rows written one by one,
    /// at every count around the statement's width.
    #[test]
    fn rows_appended_together_are_the_rows_appended_one_by_one() {
        for count in [
            0,
            1,
            2,
            3,
            ROWS_PER_INSERT - 1,
            ROWS_PER_INSERT,
            ROWS_PER_INSERT + 1,
            3 * ROWS_PER_INSERT + 2,
        ] {
            let (one, many) = (fresh(100), fresh(100));
            let at = w(200);
            let changes: Vec<String> = (0..count)
                .map(|i| format!(r#"{{"tag":"insert","n":{i},"s":"quote ' and \" and ?"}}"#))
                .collect();
            let rows: Vec<LogRow<'_>> = changes
                .iter()
                .enumerate()
                .map(|(i, change)| LogRow {
                    watermark: &at,
                    pos: i as u64,
                    tag: if i == 0 { "begin" } else { "insert" },
                    change,
                })
                .collect();
            for row in &rows {
                append(&one, row.watermark, row.pos, row.tag, row.change).expect("one");
            }
            append_rows(&many, &rows).expect("many");
            let read = |conn: &Connection| -> Vec<(String, i64, String, String)> {
                let mut stmt = conn
                    .prepare(r#"SELECT "watermark","pos","tag","change" FROM "_hw_change_log" ORDER BY rowid"#)
                    .unwrap();
                stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap()
            };
            assert_eq!(read(&one), read(&many), "{count} rows");
            assert_eq!(
                read(&many).len(),
                count + 2,
                "{count} rows and the seed's two"
            );
        }
        // A duplicate key fails the statement, as it fails `append`.
        let conn = fresh(100);
        let at = w(200);
        let row = LogRow {
            watermark: &at,
            pos: 0,
            tag: "begin",
            change: "{}",
        };
        assert!(append_rows(&conn, &[row, row]).is_err());
    }

    #[test]
    fn ensure_keeps_a_matching_log_and_reseeds_only_a_fresh_replica() {
        let conn = fresh(100);
        store(&conn, &w(200), 2);
        // Same replica, replica at the log's last watermark: kept as is.
        let kept = ensure(&conn, &config(100), &w(200)).expect("kept");
        assert_eq!((kept.last_watermark, kept.min_watermark), (w(200), w(100)));
        // The replica disagrees with the log's position.
        let err = ensure(&conn, &config(100), &w(150)).expect_err("gap");
        assert!(matches!(err, ChangeLogError::ResetRequired { .. }), "{err}");
        // A new replica version past its initial sync cannot be served.
        let err = ensure(&conn, &config(300), &w(400)).expect_err("not fresh");
        assert!(err.to_string().contains("replica version"), "{err}");
        // Freshly synced at a new version: emptied and reseeded.
        let reseeded = ensure(&conn, &config(300), &w(300)).expect("reseeded");
        assert_eq!(
            (reseeded.last_watermark, reseeded.min_watermark),
            (w(300), w(300))
        );
        assert_eq!(read_all(conn, &w(0), &w(1000)).len(), 2);
    }

    #[test]
    fn ensure_refuses_a_replica_past_its_sync_without_a_log() {
        let conn = Connection::open_in_memory().expect("sqlite");
        let err = ensure(&conn, &config(100), &w(120)).expect_err("no log for a used replica");
        assert!(matches!(err, ChangeLogError::ResetRequired { .. }));
        // Changed publications count as another replica too.
        let conn = fresh(100);
        store(&conn, &w(200), 1);
        let mut other = config(100);
        other.publications = vec!["other".to_owned()];
        assert!(ensure(&conn, &other, &w(200)).is_err());
        mark_reset_required(&conn).expect("mark");
        assert!(ensure(&conn, &config(100), &w(200)).is_err());
    }

    #[test]
    fn a_rolled_back_transaction_leaves_no_trace() {
        let conn = fresh(100);
        store(&conn, &w(200), 1);
        {
            let tx = conn.unchecked_transaction().expect("begin");
            append(&tx, &w(300), 0, "begin", r#"{"tag":"begin"}"#).expect("row");
            append(&tx, &w(300), 1, "insert", r#"{"tag":"insert"}"#).expect("row");
            commit(&tx, &w(300)).expect("last watermark");
            tx.rollback().expect("rollback");
        }
        let status = status(&conn).expect("status").expect("initialized");
        assert_eq!(status.last_watermark, w(200));
        let rows = read_all(conn, &w(0), &w(1000));
        assert!(rows.iter().all(|r| r.watermark != w(300)));
        assert_eq!(rows.len(), 2 + 3);
    }

    #[test]
    fn catchup_reads_the_requested_transactions_in_order_and_in_batches() {
        let conn = fresh(100);
        for (wm, rows) in [(200, 3), (300, 0), (400, 5)] {
            store(&conn, &w(wm), rows);
        }
        let mut reader = CatchupReader::from_connection(conn);
        let mut batches = Vec::new();
        let limits = CatchupLimits {
            rows: 4,
            bytes: usize::MAX,
        };
        let total = reader
            .read(&w(200), &w(300), limits, |rows| {
                batches.push(rows);
                ControlFlow::Continue(())
            })
            .expect("read");
        assert_eq!(total, 7);
        assert_eq!(batches.iter().map(Vec::len).collect::<Vec<_>>(), [4, 3]);
        let seen: Vec<(Watermark, String)> = batches
            .concat()
            .into_iter()
            .map(|r| (r.watermark, r.tag))
            .collect();
        let expected: Vec<(Watermark, String)> = [
            (200, "begin"),
            (200, "insert"),
            (200, "insert"),
            (200, "insert"),
            (200, "commit"),
            (300, "begin"),
            (300, "commit"),
        ]
        .into_iter()
        .map(|(wm, tag)| (w(wm), tag.to_owned()))
        .collect();
        assert_eq!(seen, expected);

        // A byte limit ends batches too, and `Break` ends the read.
        let mut calls = 0;
        let limits = CatchupLimits {
            rows: 1000,
            bytes: 1,
        };
        let total = reader
            .read(&w(0), &w(1000), limits, |_| {
                calls += 1;
                if calls == 3 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .expect("read");
        assert_eq!((calls, total), (3, 3));
    }

    #[test]
    fn catchup_reads_from_one_snapshot() {
        let dir = std::env::temp_dir().join(format!(
            "highwater-change-log-snapshot-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("replica.db");
        let writer = Connection::open(&path).expect("open");
        writer
            .pragma_update(None, "journal_mode", "WAL")
            .expect("wal");
        ensure(&writer, &config(100), &w(100)).expect("seeded");
        store(&writer, &w(200), 3);
        let mut reader = CatchupReader::open(&path).expect("reader");
        let mut seen = Vec::new();
        let limits = CatchupLimits {
            rows: 1,
            bytes: usize::MAX,
        };
        reader
            .read(&w(100), &w(10_000), limits, |rows| {
                if seen.is_empty() {
                    // Committed while the read is under way: not part of its snapshot.
                    store(&writer, &w(300), 1);
                    purge(&writer, &w(250)).expect("purge");
                }
                seen.extend(rows.into_iter().map(|r| r.watermark));
                ControlFlow::Continue(())
            })
            .expect("read");
        assert_eq!(seen.len(), 2 + 5);
        assert!(seen.iter().all(|wm| *wm <= w(200)));
        drop(reader);
        drop(writer);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn batched_reads_hold_no_snapshot_between_batches_so_checkpoints_complete() {
        let dir = std::env::temp_dir().join(format!("highwater-batches-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("replica.db");
        let writer = Connection::open(&path).expect("open");
        writer
            .pragma_update(None, "journal_mode", "WAL")
            .expect("wal");
        ensure(&writer, &config(100), &w(100)).expect("seeded");
        store(&writer, &w(200), 3);
        store(&writer, &w(300), 2);
        let mut reader = CatchupReader::open(&path).expect("reader");
        let limits = CatchupLimits {
            rows: 2,
            bytes: usize::MAX,
        };
        let mut seen = Vec::new();
        let mut after = None;
        let mut later = 400;
        loop {
            let batch = reader
                .read_batch(&w(100), &w(300), after.as_ref(), limits)
                .expect("batch");
            assert!(batch.rows.len() <= 2);
            seen.extend(batch.rows.into_iter().map(|r| (r.watermark, r.tag)));
            // Between batches (a subscriber slow to take them) the writer commits and a full
            // checkpoint gets through: no reader holds the WAL.
            store(&writer, &w(later), 1);
            later += 100;
            let busy: i64 = writer
                .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))
                .expect("checkpoint");
            assert_eq!(busy, 0, "a checkpoint was blocked by the catch-up reader");
            match batch.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        // Every row up to 300 once, in order, none later.
        let mut expected = Vec::new();
        let mut all = CatchupReader::open(&path).expect("reader");
        all.read(&w(100), &w(300), CatchupLimits::default(), |rows| {
            expected.extend(rows.into_iter().map(|r| (r.watermark, r.tag)));
            ControlFlow::Continue(())
        })
        .expect("read");
        assert_eq!(seen, expected);
        // The seeded rows at 100, then begin, changes and commit of 200 and of 300.
        assert_eq!(seen.len(), 2 + 5 + 4);
        drop((reader, all, writer));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn purge_deletes_below_the_floor_but_keeps_the_newest_transaction() {
        let conn = fresh(100);
        store(&conn, &w(200), PURGE_CHUNK_ROWS + 10);
        store(&conn, &w(300), 1);
        let report = purge(&conn, &w(250)).expect("purge");
        assert_eq!(report.deleted, 2 + PURGE_CHUNK_ROWS + 12);
        assert_eq!(report.min_watermark, w(300));
        // Below a floor past everything, the newest transaction still stays.
        let report = purge(&conn, &w(1000)).expect("purge");
        assert_eq!((report.deleted, report.min_watermark), (0, w(300)));
        let status = status(&conn).expect("status").expect("initialized");
        assert_eq!(status.min_watermark, w(300));
        assert_eq!(read_all(conn, &w(0), &w(1000)).len(), 3);
    }

    fn change(value: Value) -> Change {
        decode_change_value(value).expect("a valid change")
    }

    #[test]
    fn the_cookie_jar_follows_schema_changes() {
        let conn = fresh(100);
        let column = json!({"pos": 1, "dataType": "int4"});
        let changes = [
            json!({"tag": "create-table",
                   "spec": {"schema": "public", "name": "foo", "columns": {"id": column, "a": column}},
                   "metadata": {"rowKey": {"id": {"attNum": 1}}, "relationOID": 7},
                   "backfill": {"a": {"attNum": 2}}}),
            json!({"tag": "add-column", "table": {"schema": "public", "name": "foo"},
                   "column": {"name": "b", "spec": column}, "backfill": {"attNum": 3}}),
            json!({"tag": "add-column", "table": {"schema": "public", "name": "foo"},
                   "column": {"name": "c", "spec": column}, "backfill": {"attNum": 4}}),
            json!({"tag": "rename-table", "old": {"schema": "public", "name": "foo"},
                   "new": {"schema": "public", "name": "bar"}}),
            json!({"tag": "update-column", "table": {"schema": "public", "name": "bar"},
                   "old": {"name": "c", "spec": column}, "new": {"name": "d", "spec": column}}),
            json!({"tag": "backfill-completed",
                   "relation": {"schema": "public", "name": "bar", "rowKey": {"columns": ["id"]}},
                   "columns": ["a"], "watermark": "0a"}),
            json!({"tag": "create-table",
                   "spec": {"schema": "public", "name": "gone", "columns": {"id": column}},
                   "backfill": {"id": {"attNum": 1}}}),
            json!({"tag": "drop-table", "id": {"schema": "public", "name": "gone"}}),
        ];
        for value in changes {
            apply_cookie_ops(&conn, &change(value)).expect("cookie ops");
        }
        let requests = cookie_jar(&conn).expect("jar");
        assert_eq!(requests.len(), 1);
        let request = &requests[0];
        assert_eq!(
            (request.table.schema.as_str(), request.table.name.as_str()),
            ("public", "bar")
        );
        let metadata = request
            .table
            .metadata
            .as_ref()
            .expect("metadata kept across the rename");
        assert_eq!(metadata.extra.get("relationOID"), Some(&json!(7)));
        let columns: Vec<(&str, &Value)> = request
            .columns
            .iter()
            .map(|(name, c)| (name.as_str(), &c.id))
            .collect();
        assert_eq!(
            columns,
            [("b", &json!({"attNum": 3})), ("d", &json!({"attNum": 4}))]
        );
        assert!(request.columns.values().all(|c| c.progress.is_none()));
    }

    proptest! {
        /// Whatever the batch limits, a catch-up hands out exactly the rows of the transactions
        /// in `from ..= through`, in `(watermark, pos)` order.
        #[test]
        fn catchup_returns_exactly_the_range_in_order(
            sizes in proptest::collection::vec(0usize..4, 0..8),
            from in 0u64..10,
            span in 0u64..10,
            batch_rows in 1usize..6,
            batch_bytes in 1usize..200,
        ) {
            let conn = fresh(1);
            let mut expected = Vec::new();
            for (i, rows) in sizes.iter().enumerate() {
                let watermark = w(2 + i as u64);
                store(&conn, &watermark, *rows);
                if (from..=from + span).contains(&(2 + i as u64)) {
                    for pos in 0..rows + 2 {
                        expected.push((watermark.clone(), pos));
                    }
                }
            }
            if (from..=from + span).contains(&1) {
                expected.splice(0..0, [(w(1), 0), (w(1), 1)]);
            }
            let mut reader = CatchupReader::from_connection(conn);
            let mut seen = Vec::new();
            let limits = CatchupLimits { rows: batch_rows, bytes: batch_bytes };
            reader.read(&w(from), &w(from + span), limits, |rows| {
                assert!(rows.len() <= batch_rows);
                seen.extend(rows);
                ControlFlow::Continue(())
            }).expect("read");
            // Positions restart at 0 for each transaction; the tags say where each one is.
            let mut positions = Vec::new();
            let mut pos = 0;
            for row in &seen {
                if row.tag == "begin" { pos = 0; }
                positions.push((row.watermark.clone(), pos));
                pos += 1;
            }
            prop_assert_eq!(positions, expected);
        }
    }
}
