//! `highwater zero-replica`: a Rocicorp Zero replica file, at one watermark, from a running
//! Highwater — so a stock Zero view-syncer can start from Highwater alone, with no Zero
//! replication-manager and no Zero initial sync.
//!
//! It downloads `GET /replica/snapshot` (a consistent copy of Highwater's replica at one
//! commit) and rewrites it into the SQLite layout Zero 1.9's initial sync leaves behind:
//! Zero's metadata tables (`_zero.versionHistory` at replica schema v13,
//! `_zero.replicationConfig` with Highwater's replica version and publications,
//! `_zero.replicationState` at the snapshot's watermark, an empty `_zero.changeLog2`,
//! `_zero.runtimeEvents`, `_zero.column_metadata`, `_zero.tableMetadata`), every table as
//! Zero's `createLiteTableStatement(mapPostgresToLite(spec))` writes it (declared types
//! `<pgtype>[|NOT_NULL][|TEXT_ENUM][|TEXT_ARRAY]`, no key, no defaults, a `_0_version`
//! column defaulting to the replica version), every upstream index under its upstream name
//! and uniqueness, and the rows with their stored values and row versions. Highwater's
//! replica already stores values the way Zero's replicator does (integers, REAL, 0/1, JSON
//! text), so rows are copied as they are.
//!
//! Why a command that converts on the user's side, and not an endpoint serving Zero's format:
//! the server keeps one snapshot endpoint (one thing to authenticate and to keep consistent);
//! the conversion's CPU and disk are spent where the view-syncer runs, not on the server every
//! serving node shares; the Zero layout is tied to a Zero version, which is the user's choice,
//! not the server's; and a snapshot already downloaded converts offline (`--snapshot`). The
//! output is written beside `--out` and renamed into place, so a view-syncer never opens a
//! half-written replica, and an existing file is never overwritten.
//!
//! The view-syncer then subscribes at the replica's watermark: Highwater's change log must
//! still reach back to it (it does for as long as Highwater's purge delay), and the replica
//! version must be Highwater's (it is, by construction).
//!
//! Limits: only Zero 1.9's layout (replica schema v13, [`ZERO_REPLICA_SCHEMA_VERSION`]) is
//! written. A snapshot with a backfill still pending is refused (its columns would lack their
//! values). A replica made before Highwater recorded upstream indexes (`_hw_indexes`) exports
//! its key index as `<table>_pkey` and its other indexes as non-unique.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use highwater_engine::change_stream::{IndexDirection, PgTypeClass};
use highwater_engine::watermark::Watermark;
use rusqlite::types::Value as SqlValue;
use rusqlite::{params, params_from_iter, Connection};

use crate::replica::schema::{
    self, quote_ident, replica_index_name, ReplicaColumn, ReplicaTable, UpstreamIndex,
};
use crate::replica::{Replica, ReplicaError};
use crate::serve::snapshot_download::{self, DownloadError};
use crate::serve::{load_token, ReplicationToken, TokenError};

/// Zero's replica schema version that this layout is (`schemaVersionMigrationMap` in Zero
/// 1.9's `replica-schema.js`: v13); a later Zero migrates it forward as it migrates its own.
pub(crate) const ZERO_REPLICA_SCHEMA_VERSION: i64 = 13;

/// Zero's row-version column (`ZERO_VERSION_COLUMN_NAME`).
pub(crate) const ZERO_VERSION_COLUMN: &str = "_0_version";

#[derive(Debug, Clone, clap::Args)]
pub struct ZeroReplicaArgs {
    /// Base URL of a running Highwater (http://HOST:PORT; ws:// is taken as http://).
    #[arg(long, value_name = "URL", required_unless_present = "snapshot")]
    pub from: Option<String>,
    /// Convert a snapshot already downloaded from `/replica/snapshot` instead.
    #[arg(long, value_name = "FILE", conflicts_with = "from")]
    pub snapshot: Option<PathBuf>,
    /// The Zero replica file to write (what the view-syncer gets as ZERO_REPLICA_FILE). It
    /// must not exist yet.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// File holding the replication token sent as `Authorization: Bearer …`. Without it the
    /// token is read from HIGHWATER_REPLICATION_TOKEN; with neither, none is sent.
    #[arg(long, value_name = "FILE")]
    pub(crate) replication_token_file: Option<PathBuf>,
    /// PEM file of the CA certificates an `https` Highwater's certificate must chain to (a
    /// private CA). Without it: the system's certificate bundle.
    #[arg(long, value_name = "FILE", conflicts_with = "snapshot")]
    pub from_ca_file: Option<PathBuf>,
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    pub replica_version: Watermark,
    pub watermark: Watermark,
    pub tables: usize,
    pub rows: u64,
}

/// Anything that stops an export.
#[derive(Debug, thiserror::Error)]
pub enum ZeroReplicaError {
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error("Zero replica database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("Zero replica metadata is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error(
        "expected a synced Highwater replica snapshot, got a database without replication state"
    )]
    NotInitialized,
    #[error(
        "expected a snapshot with every column backfilled, got pending backfills in {tables}; \
         export again once Highwater's backfills complete"
    )]
    PendingBackfill { tables: String },
    #[error(
        "expected a new file for the Zero replica, but {path} already exists (a view-syncer may \
         be using it); remove it and its -wal, -wal2 and -shm files first, or choose another --out"
    )]
    OutputExists { path: String },
    #[error("expected column {column:?} of table {table:?} to have a type Zero can name, got {data_type:?}")]
    BadType {
        table: String,
        column: String,
        data_type: String,
    },
    #[error("cannot download the snapshot from {url}: {reason}")]
    Download { url: String, reason: String },
    #[error(
        "expected the snapshot's content at {header} as its headers say, got content at {actual}"
    )]
    HeaderMismatch { header: String, actual: String },
    #[error("cannot read the replication token: {0}")]
    Token(#[from] TokenError),
    #[error(transparent)]
    Tls(#[from] crate::serve::TlsFileError),
}

/// Runs `highwater zero-replica`.
pub fn run(args: ZeroReplicaArgs) -> anyhow::Result<()> {
    crate::runtime::init_tracing("warn");
    let exported = match (&args.from, &args.snapshot) {
        (_, Some(snapshot)) => export(snapshot, &args.out)?,
        (Some(from), None) => {
            let token = load_token(args.replication_token_file.as_deref())?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let exporting = export_trusting(
                from,
                &args.out,
                token.as_ref(),
                args.from_ca_file.as_deref(),
            );
            runtime.block_on(exporting)?
        }
        (None, None) => anyhow::bail!("expected --from URL or --snapshot FILE, got neither"),
    };
    println!(
        "{}: Zero replica at watermark {} (replica version {}), {} tables, {} rows",
        args.out.display(),
        exported.watermark,
        exported.replica_version,
        exported.tables,
        exported.rows
    );
    Ok(())
}

/// The snapshot URL of a Highwater at `base` (`http(s)://host:port`, `ws(s)://host:port`, or
/// the snapshot URL itself).
pub(crate) fn snapshot_url(base: &str) -> String {
    let base = base.trim_end_matches('/');
    let base = if let Some(rest) = base.strip_prefix("ws://") {
        format!("http://{rest}")
    } else if let Some(rest) = base.strip_prefix("wss://") {
        format!("https://{rest}")
    } else {
        base.to_owned()
    };
    if base.ends_with(crate::serve::SNAPSHOT_PATH) {
        base
    } else {
        format!("{base}{}", crate::serve::SNAPSHOT_PATH)
    }
}

/// Downloads the snapshot of the Highwater at `base` and exports it to `out` (an `https`
/// peer's certificate checked against the system's certificate bundle).
#[cfg(test)]
pub(crate) async fn export_from(
    base: &str,
    out: &Path,
    token: Option<&ReplicationToken>,
) -> Result<Exported, ZeroReplicaError> {
    export_trusting(base, out, token, None).await
}

/// `export_from`, an `https` peer's certificate checked against `ca_file` when given.
pub(crate) async fn export_trusting(
    base: &str,
    out: &Path,
    token: Option<&ReplicationToken>,
    ca_file: Option<&Path>,
) -> Result<Exported, ZeroReplicaError> {
    refuse_existing(out)?;
    let url = snapshot_url(base);
    let download = sibling(out, "download");
    let _cleanup = RemoveOnDrop(download.clone());
    let client = match ca_file {
        None => snapshot_download::PeerClient::system(),
        Some(file) => snapshot_download::PeerClient::new(
            Ok(crate::serve::tls::client_config(Some(file))?),
            snapshot_download::DEFAULT_MAX_SNAPSHOT_BYTES,
            snapshot_download::DEFAULT_SNAPSHOT_TIMEOUT,
        ),
    };
    let headers = snapshot_download::download(&url, &download, token, &client)
        .await
        .map_err(|error| match error {
            DownloadError::Failed { url, reason } => ZeroReplicaError::Download { url, reason },
            DownloadError::Io(error) => ZeroReplicaError::Io(error),
            other => ZeroReplicaError::Download {
                url: url.clone(),
                reason: other.reason(),
            },
        })?;
    let out = out.to_owned();
    let exported = tokio::task::spawn_blocking(move || export(&download, &out))
        .await
        .map_err(|e| ZeroReplicaError::Io(std::io::Error::other(e.to_string())))??;
    for (header, actual) in [
        (&headers.watermark, &exported.watermark),
        (&headers.replica_version, &exported.replica_version),
    ] {
        if let Some(header) = header.as_deref().filter(|h| *h != actual.as_str()) {
            return Err(ZeroReplicaError::HeaderMismatch {
                header: header.to_owned(),
                actual: actual.to_string(),
            });
        }
    }
    Ok(exported)
}

/// Converts the Highwater replica snapshot at `snapshot` into a new Zero replica at `out`.
/// Blocking.
pub fn export(snapshot: &Path, out: &Path) -> Result<Exported, ZeroReplicaError> {
    refuse_existing(out)?;
    let source = Replica::open_read_only(snapshot)?;
    let state = source
        .state()
        .cloned()
        .ok_or(ZeroReplicaError::NotInitialized)?;
    let pending: Vec<String> = source
        .pending_backfills()
        .into_iter()
        .map(|p| p.table)
        .collect();
    if !pending.is_empty() {
        return Err(ZeroReplicaError::PendingBackfill {
            tables: pending.join(", "),
        });
    }
    let temp = sibling(out, "tmp");
    let cleanup = RemoveOnDrop(temp.clone());
    let _ = std::fs::remove_file(&temp);
    let mut zero = Connection::open(&temp)?;
    let tx = zero.transaction()?;
    write_metadata(
        &tx,
        &state.replica_version,
        &state.watermark,
        &state.publications,
    )?;
    // A replica made before Highwater recorded upstream indexes has no such table.
    let recorded: bool = source.connection().query_row(
        r#"SELECT count(*) > 0 FROM sqlite_schema WHERE type = 'table' AND name = '_hw_indexes'"#,
        [],
        |r| r.get(0),
    )?;
    let indexes = if recorded {
        schema::load_indexes(source.connection())?
    } else {
        Vec::new()
    };
    let mut rows = 0u64;
    let names = source.table_names();
    for name in &names {
        let Some(table) = source.table(name) else {
            continue;
        };
        tx.execute_batch(&create_table_sql(table, &state.replica_version)?)?;
        for column in &table.columns {
            insert_column_metadata(&tx, table, column)?;
        }
        if let Some(metadata) = &table.metadata {
            tx.execute(
                r#"INSERT INTO "_zero.tableMetadata" ("schema", "table", "upstreamMetadata")
                   VALUES (?1, ?2, ?3)"#,
                params![
                    table.schema,
                    table.table,
                    schema::metadata_json(metadata).to_string()
                ],
            )?;
        }
        rows += copy_rows(source.connection(), &tx, table)?;
    }
    for name in &names {
        let Some(table) = source.table(name) else {
            continue;
        };
        for sql in index_statements(source.connection(), table, &indexes)? {
            tx.execute_batch(&sql)?;
        }
    }
    tx.commit()?;
    // As Zero's schema set-up ends: statistics for the query planner.
    zero.execute_batch("ANALYZE main")?;
    zero.pragma_update(None, "journal_mode", "DELETE")?;
    drop(zero);
    std::fs::File::open(&temp)?.sync_all()?;
    refuse_existing(out)?;
    std::fs::rename(&temp, out)?;
    std::mem::forget(cleanup);
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(Exported {
        replica_version: state.replica_version,
        watermark: state.watermark,
        tables: names.len(),
        rows,
    })
}

fn refuse_existing(out: &Path) -> Result<(), ZeroReplicaError> {
    // Zero's SQLite build also keeps a `-wal2` file in its wal2 journal mode.
    for suffix in ["", "-wal", "-wal2", "-shm"] {
        let path = PathBuf::from(format!("{}{suffix}", out.display()));
        if path.exists() {
            return Err(ZeroReplicaError::OutputExists {
                path: path.display().to_string(),
            });
        }
    }
    Ok(())
}

fn sibling(out: &Path, what: &str) -> PathBuf {
    PathBuf::from(format!("{}.{what}-{}", out.display(), std::process::id()))
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Zero 1.9's metadata tables, verbatim from its `migration-lite.js` (`_zero.versionHistory`)
/// and `replication-state.js` (`CREATE_REPLICATION_STATE_SCHEMA`, with the change log,
/// runtime events, column metadata and table metadata tables it includes).
const ZERO_METADATA_SQL: &str = r#"
    CREATE TABLE IF NOT EXISTS "_zero.versionHistory" (
      dataVersion INTEGER NOT NULL,
      schemaVersion INTEGER NOT NULL,
      minSafeVersion INTEGER NOT NULL,

      lock INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock=1)
    );

  CREATE TABLE "_zero.replicationConfig" (
    replicaVersion TEXT NOT NULL,
    publications TEXT NOT NULL,
    initialSyncContext TEXT DEFAULT '{}',
    lock INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock=1)
  );
  
  CREATE TABLE "_zero.replicationState" (
    stateVersion TEXT NOT NULL,
    writeTimeMs INTEGER,
    lock INTEGER PRIMARY KEY DEFAULT 1 CHECK (lock=1)
  );
  
  CREATE TABLE "_zero.changeLog2" (
    "stateVersion"              TEXT NOT NULL,
    "pos"                       INT  NOT NULL,
    "table"                     TEXT NOT NULL,
    "rowKey"                    TEXT NOT NULL,
    "op"                        TEXT NOT NULL,
    "backfillingColumnVersions" TEXT DEFAULT '{}',
    PRIMARY KEY("stateVersion", "pos"),
    UNIQUE("table", "rowKey")
  );
  
  CREATE TABLE "_zero.runtimeEvents" (
    event TEXT PRIMARY KEY ON CONFLICT REPLACE,
    timestamp TEXT NOT NULL DEFAULT (current_timestamp)
  );

  CREATE TABLE "_zero.column_metadata" (
    table_name TEXT NOT NULL,
    column_name TEXT NOT NULL,
    upstream_type TEXT NOT NULL,
    is_not_null INTEGER NOT NULL,
    is_enum INTEGER NOT NULL,
    is_array INTEGER NOT NULL,
    character_max_length INTEGER,
    backfill TEXT,
    PRIMARY KEY (table_name, column_name)
  );

  CREATE TABLE "_zero.tableMetadata" (
    "schema"           TEXT NOT NULL,
    "table"            TEXT NOT NULL,
    "minRowVersion"    TEXT NOT NULL DEFAULT "00",
    "upstreamMetadata" TEXT,
    "metadata"         TEXT,  -- deprecated
    PRIMARY KEY ("schema", "table")
  );
"#;

/// The metadata rows Zero's `initReplicationState` and schema migration write, with the
/// state at `watermark` rather than at the replica version.
fn write_metadata(
    conn: &Connection,
    replica_version: &Watermark,
    watermark: &Watermark,
    publications: &[String],
) -> Result<(), ZeroReplicaError> {
    conn.execute_batch(ZERO_METADATA_SQL)?;
    conn.execute(
        r#"INSERT INTO "_zero.versionHistory" (dataVersion, schemaVersion, minSafeVersion, lock)
           VALUES (?1, ?1, 1, 1)"#,
        [ZERO_REPLICA_SCHEMA_VERSION],
    )?;
    let mut publications = publications.to_vec();
    publications.sort();
    conn.execute(
        r#"INSERT INTO "_zero.replicationConfig" (replicaVersion, publications, initialSyncContext)
           VALUES (?1, ?2, '{}')"#,
        params![
            replica_version.as_str(),
            serde_json::to_string(&publications)?
        ],
    )?;
    conn.execute(
        r#"INSERT INTO "_zero.replicationState" (stateVersion, writeTimeMs)
           VALUES (?1, unixepoch('subsec') * 1000)"#,
        [watermark.as_str()],
    )?;
    conn.execute(
        r#"INSERT INTO "_zero.runtimeEvents" (event) VALUES ('sync')"#,
        [],
    )?;
    Ok(())
}

/// Zero's `isEnumColumn`: the element type class of an array, else the type class, is `e`.
fn is_enum(column: &ReplicaColumn) -> bool {
    column.elem_type_class.or(column.type_class) == Some(PgTypeClass::Enum)
}

/// Zero's `isArrayColumn`: an element type class is set.
fn is_array(column: &ReplicaColumn) -> bool {
    column.elem_type_class.is_some()
}

/// Zero's `liteTypeString(dataType, notNull, isEnum, isArray)`.
fn zero_type(table: &ReplicaTable, column: &ReplicaColumn) -> Result<String, ZeroReplicaError> {
    if column.data_type.contains('|') || column.data_type.is_empty() {
        return Err(ZeroReplicaError::BadType {
            table: table.name.clone(),
            column: column.name.clone(),
            data_type: column.data_type.clone(),
        });
    }
    let mut declared = column.data_type.clone();
    if column.not_null {
        declared.push_str("|NOT_NULL");
    }
    if is_enum(column) {
        declared.push_str("|TEXT_ENUM");
    }
    if is_array(column) {
        declared.push_str("|TEXT_ARRAY");
    }
    Ok(declared)
}

/// `createLiteTableStatement(mapPostgresToLite(spec, replicaVersion))`, character for
/// character: columns by position, quoted lite types, no key, no defaults, then `_0_version`.
pub(crate) fn create_table_sql(
    table: &ReplicaTable,
    replica_version: &Watermark,
) -> Result<String, ZeroReplicaError> {
    let mut columns: Vec<&ReplicaColumn> = table.columns.iter().collect();
    columns.sort_by_key(|c| c.pos);
    let mut defs = Vec::with_capacity(columns.len() + 1);
    for column in columns {
        defs.push(format!(
            "{} {}",
            quote_ident(&column.name),
            quote_ident(&zero_type(table, column)?)
        ));
    }
    defs.push(format!(
        "{} \"text\" DEFAULT '{}'",
        quote_ident(ZERO_VERSION_COLUMN),
        replica_version.as_str()
    ));
    Ok(format!(
        "CREATE TABLE {} (\n{}\n);",
        quote_ident(&table.name),
        defs.join(",\n")
    ))
}

/// `ColumnMetadataStore.insert` of the column's upstream spec.
fn insert_column_metadata(
    conn: &Connection,
    table: &ReplicaTable,
    column: &ReplicaColumn,
) -> Result<(), ZeroReplicaError> {
    conn.execute(
        r#"INSERT INTO "_zero.column_metadata"
             (table_name, column_name, upstream_type, is_not_null, is_enum, is_array, character_max_length, backfill)
           VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, NULL)"#,
        params![
            table.name,
            column.name,
            column.data_type,
            i64::from(column.not_null),
            i64::from(is_enum(column)),
            i64::from(is_array(column)),
            column.character_max_length,
        ],
    )?;
    Ok(())
}

/// Copies every row with its stored values and row version. Returns the row count.
fn copy_rows(
    source: &Connection,
    target: &Connection,
    table: &ReplicaTable,
) -> Result<u64, ZeroReplicaError> {
    let mut names: Vec<String> = table.columns.iter().map(|c| quote_ident(&c.name)).collect();
    let select = format!(
        "SELECT {} FROM {}",
        names
            .iter()
            .cloned()
            .chain([quote_ident("_hw_version")])
            .collect::<Vec<_>>()
            .join(", "),
        quote_ident(&table.name)
    );
    names.push(quote_ident(ZERO_VERSION_COLUMN));
    let placeholders = vec!["?"; names.len()].join(",");
    let insert = format!(
        "INSERT INTO {} ({}) VALUES ({placeholders})",
        quote_ident(&table.name),
        names.join(",")
    );
    let mut insert = target.prepare(&insert)?;
    let mut stmt = source.prepare(&select)?;
    let mut rows = stmt.query([])?;
    let width = names.len();
    let mut count = 0u64;
    while let Some(row) = rows.next()? {
        let values = (0..width)
            .map(|i| row.get::<_, SqlValue>(i))
            .collect::<Result<Vec<_>, _>>()?;
        insert.execute(params_from_iter(values))?;
        count += 1;
    }
    Ok(count)
}

/// Zero's `createLiteIndexStatement(mapPostgresToLiteIndex(spec))` for every upstream index of
/// `table`: the recorded ones under their upstream names and uniqueness; an index the record
/// lacks (a replica made before indexes were recorded) from SQLite's own, as non-unique; a
/// key the record lacks as `<table>_pkey`, unique.
fn index_statements(
    source: &Connection,
    table: &ReplicaTable,
    recorded: &[UpstreamIndex],
) -> Result<Vec<String>, ZeroReplicaError> {
    let has_column = |c: &str| table.column(c).is_some();
    let mut out = Vec::new();
    let mut named = HashSet::new();
    let mut has_key = false;
    for index in recorded.iter().filter(|i| i.table_name == table.name) {
        if index.columns.is_empty() || !index.columns.iter().all(|(c, _)| has_column(c)) {
            continue;
        }
        has_key |= index.is_key;
        named.insert(index.name.clone());
        out.push(index_sql(
            &index.name,
            &table.name,
            index.unique,
            &index.columns,
        ));
    }
    let internal = [table.key_index_name(), table.seq_index_name()];
    let mut stmt = source.prepare(
        "SELECT name FROM sqlite_schema
         WHERE type = 'index' AND tbl_name = ?1 AND sql IS NOT NULL ORDER BY name",
    )?;
    let sqlite_indexes: Vec<String> = stmt
        .query_map([&table.name], |r| r.get(0))?
        .collect::<Result<_, _>>()?;
    for name in sqlite_indexes {
        if internal.contains(&name) || named.contains(&name) {
            continue;
        }
        let mut info = source.prepare(
            "SELECT name, \"desc\" FROM pragma_index_xinfo(?1) WHERE key = 1 ORDER BY seqno",
        )?;
        let columns: Vec<(String, IndexDirection)> = info
            .query_map([&name], |r| {
                let desc: i64 = r.get(1)?;
                Ok((
                    r.get::<_, String>(0)?,
                    if desc == 0 {
                        IndexDirection::Asc
                    } else {
                        IndexDirection::Desc
                    },
                ))
            })?
            .collect::<Result<_, _>>()?;
        if !columns.is_empty() {
            out.push(index_sql(&name, &table.name, false, &columns));
        }
    }
    if !has_key && !table.key.is_empty() {
        let columns: Vec<(String, IndexDirection)> = table
            .key
            .iter()
            .map(|c| (c.clone(), IndexDirection::Asc))
            .collect();
        let name = replica_index_name(&table.schema, &format!("{}_pkey", table.table));
        out.push(index_sql(&name, &table.name, true, &columns));
    }
    Ok(out)
}

fn index_sql(
    name: &str,
    table: &str,
    unique: bool,
    columns: &[(String, IndexDirection)],
) -> String {
    let columns: Vec<String> = columns
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
        "CREATE {} INDEX {} ON {} ({});",
        if unique { "UNIQUE" } else { "" },
        quote_ident(name),
        quote_ident(table),
        columns.join(",")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::{ReplicaState, ReplicaWriter};
    use highwater_engine::change_stream::{
        Begin, Change, ColumnDef, ColumnSpec, Commit, CreateIndex, CreateTable, DownstreamMessage,
        DropIndex, Identifier, IndexSpec, Insert, Relation, RenameTable, ReplicaIdentity, RowKey,
        TableSpec, UpdateColumn,
    };
    use highwater_engine::watermark::Lsn;
    use indexmap::IndexMap;
    use serde_json::{json, Number};

    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!(
                "highwater-zero-replica-{name}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn column(pos: i64, data_type: &str, class: PgTypeClass, not_null: bool) -> ColumnSpec {
        let mut spec = ColumnSpec::new(Number::from(pos), data_type);
        spec.pg_type_class = Some(class);
        spec.not_null = Some(Some(not_null));
        spec
    }

    fn index(
        name: &str,
        table: &str,
        unique: bool,
        columns: &[(&str, IndexDirection)],
        key: bool,
    ) -> Change {
        let mut extra = serde_json::Map::new();
        extra.insert("isPrimaryKey".into(), json!(key));
        extra.insert("isReplicaIdentity".into(), json!(false));
        Change::CreateIndex(CreateIndex {
            spec: IndexSpec {
                schema: "app".into(),
                name: name.into(),
                table_name: table.into(),
                unique,
                columns: columns.iter().map(|(c, d)| ((*c).to_owned(), *d)).collect(),
                predicate: None,
                extra,
            },
            extra: Default::default(),
        })
    }

    fn txn(writer: &mut ReplicaWriter, lsn: u64, changes: Vec<Change>) {
        let wm = Lsn(lsn).to_watermark();
        writer
            .apply(&DownstreamMessage::Begin(Begin::new(wm.clone())))
            .unwrap();
        for change in changes {
            writer.apply(&DownstreamMessage::Data(change)).unwrap();
        }
        writer
            .apply(&DownstreamMessage::Commit(Commit::new(wm)))
            .unwrap();
    }

    fn insert(id: i64, title: &str, state: &str) -> Change {
        let relation = Relation::new(
            "app",
            "issue",
            RowKey::new(vec!["id".into()], Some(ReplicaIdentity::Default)),
        );
        let new = json!({"id": id, "title": title, "state": state, "tags": ["a", "b"]});
        Change::Insert(Insert {
            relation: relation.into(),
            new: new.as_object().unwrap().clone(),
            extra: Default::default(),
        })
    }

    /// A Highwater replica file: `app.issue` created, indexed and filled at 0x200, then a
    /// column and the table renamed and an index dropped at 0x300.
    fn highwater_replica(path: &Path) {
        let mut replica = Replica::open(path).unwrap();
        let version = Lsn(0x100).to_watermark();
        replica
            .store_initial_state(&ReplicaState {
                replica_version: version.clone(),
                watermark: version,
                lsn: Lsn(0x100),
                publications: vec!["zpub".into(), "apub".into()],
                slot: "slot".into(),
                app_id: "highwater".into(),
                next_seq: 1,
            })
            .unwrap();
        let mut writer = ReplicaWriter::new(replica);
        let mut columns = IndexMap::new();
        columns.insert("id".to_owned(), column(1, "int8", PgTypeClass::Base, true));
        columns.insert(
            "title".to_owned(),
            column(2, "text", PgTypeClass::Base, false),
        );
        columns.insert(
            "state".to_owned(),
            column(3, "mood", PgTypeClass::Enum, false),
        );
        let mut tags = column(4, "text[]", PgTypeClass::Base, false);
        tags.elem_pg_type_class = Some(Some(PgTypeClass::Base));
        columns.insert("tags".to_owned(), tags);
        let create = Change::CreateTable(CreateTable {
            spec: TableSpec {
                schema: "app".into(),
                name: "issue".into(),
                columns,
                primary_key: Some(vec!["id".into()]),
                extra: serde_json::Map::new(),
            },
            metadata: None,
            backfill: None,
            extra: Default::default(),
        });
        use IndexDirection::{Asc, Desc};
        txn(
            &mut writer,
            0x200,
            vec![
                create,
                index("issue_pkey", "issue", true, &[("id", Asc)], true),
                index(
                    "issue_title",
                    "issue",
                    true,
                    &[("title", Desc), ("id", Asc)],
                    false,
                ),
                index("issue_state", "issue", false, &[("state", Asc)], false),
                insert(1, "one", "ok"),
                insert(2, "two", "sad"),
            ],
        );
        let old = ColumnDef {
            name: "title".into(),
            spec: column(2, "text", PgTypeClass::Base, false),
            extra: Default::default(),
        };
        let new = ColumnDef {
            name: "headline".into(),
            ..old.clone()
        };
        txn(
            &mut writer,
            0x300,
            vec![
                Change::UpdateColumn(UpdateColumn {
                    table: Identifier::new("app", "issue"),
                    old,
                    new,
                    extra: Default::default(),
                }),
                Change::DropIndex(DropIndex {
                    id: Identifier::new("app", "issue_state"),
                    extra: Default::default(),
                }),
                Change::RenameTable(RenameTable {
                    old: Identifier::new("app", "issue"),
                    new: Identifier::new("public", "ticket"),
                    extra: Default::default(),
                }),
            ],
        );
        drop(writer);
    }

    #[test]
    fn a_replica_exports_in_the_layout_of_zeros_initial_sync() {
        let dir = Scratch::new("layout");
        let snapshot = dir.0.join("snapshot.db");
        highwater_replica(&snapshot);
        let out = dir.0.join("zero.db");
        let exported = export(&snapshot, &out).expect("export");
        assert_eq!(exported.replica_version, Lsn(0x100).to_watermark());
        assert_eq!(exported.watermark, Lsn(0x300).to_watermark());
        assert_eq!((exported.tables, exported.rows), (1, 2));
        assert!(!sibling(&out, "tmp").exists());

        let zero = Connection::open(&out).unwrap();
        let sql = |name: &str| -> String {
            zero.query_row(
                "SELECT sql FROM sqlite_schema WHERE name = ?1",
                [name],
                |r| r.get(0),
            )
            .unwrap()
        };
        let v = Lsn(0x100).to_watermark();
        assert_eq!(
            sql("ticket"),
            format!(
                "CREATE TABLE \"ticket\" (\n\"id\" \"int8|NOT_NULL\",\n\"headline\" \"text\",\n\
                 \"state\" \"mood|TEXT_ENUM\",\n\"tags\" \"text[]|TEXT_ARRAY\",\n\
                 \"_0_version\" \"text\" DEFAULT '{v}'\n)"
            )
        );
        // Index names survive the table rename, columns the column rename, as upstream.
        assert_eq!(
            sql("app.issue_pkey"),
            r#"CREATE UNIQUE INDEX "app.issue_pkey" ON "ticket" ("id" ASC)"#
        );
        assert_eq!(
            sql("app.issue_title"),
            r#"CREATE UNIQUE INDEX "app.issue_title" ON "ticket" ("headline" DESC,"id" ASC)"#
        );
        let indexes: i64 = zero
            .query_row(
                "SELECT count(*) FROM sqlite_schema WHERE type = 'index' AND sql IS NOT NULL",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(
            indexes, 2,
            "the dropped index and Highwater's own are not exported"
        );

        let state: (String, String, String, i64) = zero
            .query_row(
                r#"SELECT c.replicaVersion, c.publications, s.stateVersion, v.dataVersion
                   FROM "_zero.replicationConfig" c, "_zero.replicationState" s, "_zero.versionHistory" v"#,
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )
            .unwrap();
        assert_eq!(
            state,
            (
                v.to_string(),
                r#"["apub","zpub"]"#.to_owned(),
                Lsn(0x300).to_watermark().to_string(),
                ZERO_REPLICA_SCHEMA_VERSION
            )
        );
        let metadata: Vec<(String, String, i64, i64, i64)> = zero
            .prepare(
                r#"SELECT column_name, upstream_type, is_not_null, is_enum, is_array
                   FROM "_zero.column_metadata" WHERE table_name = 'ticket' ORDER BY column_name"#,
            )
            .unwrap()
            .query_map([], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            metadata,
            vec![
                ("headline".into(), "text".into(), 0, 0, 0),
                ("id".into(), "int8".into(), 1, 0, 0),
                ("state".into(), "mood".into(), 0, 1, 0),
                ("tags".into(), "text[]".into(), 0, 0, 1),
            ]
        );
        let rows: Vec<(i64, String, String, String)> = zero
            .prepare(r#"SELECT id, headline, tags, _0_version FROM ticket ORDER BY id"#)
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let at = Lsn(0x200).to_watermark().to_string();
        assert_eq!(
            rows,
            vec![
                (1, "one".into(), r#"["a","b"]"#.into(), at.clone()),
                (2, "two".into(), r#"["a","b"]"#.into(), at),
            ]
        );
        let changes: i64 = zero
            .query_row(r#"SELECT count(*) FROM "_zero.changeLog2""#, [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(changes, 0);
    }

    #[test]
    fn a_replica_without_recorded_indexes_exports_its_key_and_sqlite_indexes() {
        let dir = Scratch::new("unrecorded");
        let snapshot = dir.0.join("snapshot.db");
        highwater_replica(&snapshot);
        let conn = Connection::open(&snapshot).unwrap();
        conn.execute_batch(r#"DROP TABLE "_hw_indexes""#).unwrap();
        drop(conn);
        let out = dir.0.join("zero.db");
        export(&snapshot, &out).expect("export");
        let zero = Connection::open(&out).unwrap();
        let indexes: Vec<String> = zero
            .prepare("SELECT sql FROM sqlite_schema WHERE type = 'index' AND sql IS NOT NULL ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            indexes,
            vec![
                // SQLite keeps the statement with one space after CREATE.
                r#"CREATE INDEX "app.issue_title" ON "ticket" ("headline" DESC,"id" ASC)"#,
                r#"CREATE UNIQUE INDEX "ticket_pkey" ON "ticket" ("id" ASC)"#,
            ]
        );
    }

    #[test]
    fn an_existing_replica_is_never_overwritten() {
        let dir = Scratch::new("exists");
        let snapshot = dir.0.join("snapshot.db");
        highwater_replica(&snapshot);
        let out = dir.0.join("zero.db");
        std::fs::write(format!("{}-wal", out.display()), b"live").unwrap();
        let error = export(&snapshot, &out).expect_err("refused");
        assert!(
            matches!(error, ZeroReplicaError::OutputExists { .. }),
            "{error}"
        );
        assert!(
            error.to_string().contains("zero.db-wal already exists"),
            "{error}"
        );
        assert!(!out.exists());
    }

    #[test]
    fn a_snapshot_without_replication_state_or_with_pending_backfills_is_refused() {
        let dir = Scratch::new("refused");
        let empty = dir.0.join("empty.db");
        drop(Replica::open(&empty).unwrap());
        let error = export(&empty, &dir.0.join("a.db")).expect_err("refused");
        assert!(matches!(error, ZeroReplicaError::NotInitialized), "{error}");

        let snapshot = dir.0.join("snapshot.db");
        highwater_replica(&snapshot);
        let conn = Connection::open(&snapshot).unwrap();
        conn.execute(
            r#"UPDATE "_hw_columns" SET "backfill" = '{"attNum":2}' WHERE "column_name" = 'headline'"#,
            [],
        )
        .unwrap();
        drop(conn);
        let out = dir.0.join("b.db");
        let error = export(&snapshot, &out).expect_err("refused");
        assert!(
            error.to_string().contains("pending backfills in ticket"),
            "{error}"
        );
        assert!(!out.exists() && !sibling(&out, "tmp").exists());
    }

    #[test]
    fn snapshot_urls_from_a_base_url() {
        for base in [
            "http://h:1",
            "http://h:1/",
            "ws://h:1",
            "http://h:1/replica/snapshot",
        ] {
            assert_eq!(snapshot_url(base), "http://h:1/replica/snapshot", "{base}");
        }
    }

    /// The token goes out as a Bearer header; a refusal names the status and the body.
    #[tokio::test]
    async fn the_download_sends_the_token_and_reports_a_refusal() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                request.extend_from_slice(&buf[..n]);
            }
            socket
                .write_all(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 13\r\n\r\nwrong token.\n")
                .await
                .unwrap();
            String::from_utf8(request).unwrap()
        });
        let dir = Scratch::new("token");
        let out = dir.0.join("zero.db");
        let token = ReplicationToken::new("secret-token-0123456789").expect("a valid token");
        let error = export_from(&format!("http://127.0.0.1:{port}"), &out, Some(&token))
            .await
            .expect_err("refused");
        let request = server.await.unwrap().to_ascii_lowercase();
        assert!(
            request.starts_with("get /replica/snapshot http/1.1"),
            "{request}"
        );
        assert!(
            request.contains("authorization: bearer secret-token-0123456789"),
            "{request}"
        );
        let message = error.to_string();
        assert!(
            message.contains("401 Unauthorized") && message.contains("wrong token"),
            "{message}"
        );
        assert!(!message.contains("secret-token"), "{message}");
        assert!(!out.exists() && !sibling(&out, "download").exists());
    }
}
