//! Typed change-stream messages (Zero's change-streamer protocol, v1–v8).
//!
//! Every object level keeps the keys it does not know in `extra`, so a relay re-emits them
//! untouched. Fields that Zero declares optional are `Option<T>`; fields that are optional *and*
//! nullable are `Option<Option<T>>` (`None` = absent, `Some(None)` = `null`). Numbers that Zero
//! types as `number` are [`Number`]s (their wire text is kept); row values are plain JSON
//! values, so integers beyond 2^53 survive exactly.

use std::sync::Arc;

use indexmap::IndexMap;
use serde_json::{Map, Number, Value};

use crate::watermark::Watermark;

/// Unknown object keys, kept in arrival order so a relay does not drop them.
pub type Extra = Map<String, Value>;

/// A row: column name → JSON value (integers of any size kept exactly).
pub type Row = Map<String, Value>;

/// A source-defined, opaque backfill identifier. On the wire it is always a JSON object.
pub type BackfillId = Value;

/// A message from the change-streamer to a subscriber (`subscribeDownstreamSchema`).
// Messages are short-lived values handled one at a time; boxing the large schema-change variants
// would only make every producer's construction noisier.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DownstreamMessage {
    Status(Status),
    Begin(Begin),
    Data(Change),
    Commit(Commit),
    Rollback(Rollback),
    Error(StreamError),
    /// Snapshot reservation confirmation (v7+ `/subscribe` only).
    Reserved(Reserved),
}

/// A message from a subscriber to the change-streamer on `/subscribe` (v7+).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamMessage {
    ReserveSnapshot(ReserveSnapshot),
    StartSubscription(SubscribeContext),
}

/// Either direction; tuple tags are disjoint, so the tag alone decides.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Downstream(DownstreamMessage),
    Upstream(UpstreamMessage),
}

/// `["status", {"tag":"status", "lagReport"?}]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Status {
    pub lag_report: Option<LagReport>,
    pub extra: Extra,
}

/// Upstream lag measurement carried by status messages (v6+, display and metrics only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LagReport {
    pub last_timings: Option<LagTimings>,
    pub next_send_time_ms: Number,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LagTimings {
    pub send_time_ms: Number,
    pub commit_time_ms: Number,
    pub receive_time_ms: Number,
    pub extra: Extra,
}

/// `["begin", {"tag":"begin", "json"?, "skipAck"?}, {"commitWatermark"}]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    pub json: Option<JsonFormat>,
    /// `true` for synthetic (backfill) transactions that must not be acked upstream.
    pub skip_ack: Option<bool>,
    /// Unknown keys of the header object (Zero's PG source sends `commitLsn`, `commitTime`, `xid`).
    pub extra: Extra,
    pub commit_watermark: Watermark,
    /// Unknown keys of the third tuple element.
    pub watermark_extra: Extra,
}

impl Begin {
    pub fn new(commit_watermark: Watermark) -> Self {
        Begin {
            json: None,
            skip_ack: None,
            extra: Extra::new(),
            commit_watermark,
            watermark_extra: Extra::new(),
        }
    }
}

/// Format of JSON/JSONB column values inside a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JsonFormat {
    /// `"p"`: parsed JSON values (the default when absent).
    Parsed,
    /// `"s"`: JSON text strings, written to the replica as-is.
    Stringified,
}

/// `["commit", {"tag":"commit", "commitTimeMs"?}, {"watermark"}]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    pub commit_time_ms: Option<Number>,
    pub extra: Extra,
    pub watermark: Watermark,
    pub watermark_extra: Extra,
}

impl Commit {
    pub fn new(watermark: Watermark) -> Self {
        Commit {
            commit_time_ms: None,
            extra: Extra::new(),
            watermark,
            watermark_extra: Extra::new(),
        }
    }
}

/// `["rollback", {"tag":"rollback"}]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rollback {
    pub extra: Extra,
}

/// `["error", {"type", "message"?}]`; every error is terminal for the subscriber.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamError {
    /// Zero's `ErrorType`; any number is accepted, see [`StreamError::kind`].
    pub error_type: Number,
    pub message: Option<String>,
    pub extra: Extra,
}

impl StreamError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        StreamError {
            error_type: Number::from(kind as u8),
            message: Some(message.into()),
            extra: Extra::new(),
        }
    }

    /// The known error kind, or `None` for a type number this version does not know.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self.error_type.as_u64()? {
            0 => Some(ErrorKind::Unknown),
            1 => Some(ErrorKind::WrongReplicaVersion),
            2 => Some(ErrorKind::WatermarkTooOld),
            3 => Some(ErrorKind::StreamTooFarBehind),
            _ => None,
        }
    }
}

/// Zero's `ErrorType` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    Unknown = 0,
    WrongReplicaVersion = 1,
    WatermarkTooOld = 2,
    StreamTooFarBehind = 3,
}

/// `["reserved", {"tag":"snapshot", "backupURL", "replicaVersion", "minWatermark", "replicaSize"?}]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved {
    pub backup_url: String,
    pub replica_version: Watermark,
    pub min_watermark: Watermark,
    pub replica_size: Option<Number>,
    pub extra: Extra,
}

/// `["reserve-snapshot", {"taskID"}]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveSnapshot {
    pub task_id: String,
    pub extra: Extra,
}

/// `["start-subscription", SubscribeContext]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscribeContext {
    pub task_id: String,
    pub id: String,
    pub mode: SubscriberMode,
    pub replica_version: Watermark,
    pub watermark: Watermark,
    /// Pending backfills; required in spirit from v8, absent from v7 subscribers.
    pub backfills: Option<Vec<BackfillRequest>>,
    pub extra: Extra,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SubscriberMode {
    /// A user-facing replicator (view-syncer).
    Serving,
    /// The replicator whose replica is backed up.
    Backup,
}

/// The change union carried by `["data", change]`, discriminated by the inner `tag`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Insert(Insert),
    Update(Update),
    Delete(Delete),
    Truncate(Truncate),
    Backfill(Backfill),
    CreateTable(CreateTable),
    RenameTable(RenameTable),
    UpdateTableMetadata(UpdateTableMetadata),
    AddColumn(AddColumn),
    UpdateColumn(UpdateColumn),
    DropColumn(DropColumn),
    DropTable(DropTable),
    CreateIndex(CreateIndex),
    DropIndex(DropIndex),
    BackfillCompleted(BackfillCompleted),
}

impl Change {
    /// The wire tag, e.g. `"update-table-metadata"`.
    pub fn tag(&self) -> &'static str {
        match self {
            Change::Insert(_) => "insert",
            Change::Update(_) => "update",
            Change::Delete(_) => "delete",
            Change::Truncate(_) => "truncate",
            Change::Backfill(_) => "backfill",
            Change::CreateTable(_) => "create-table",
            Change::RenameTable(_) => "rename-table",
            Change::UpdateTableMetadata(_) => "update-table-metadata",
            Change::AddColumn(_) => "add-column",
            Change::UpdateColumn(_) => "update-column",
            Change::DropColumn(_) => "drop-column",
            Change::DropTable(_) => "drop-table",
            Change::CreateIndex(_) => "create-index",
            Change::DropIndex(_) => "drop-index",
            Change::BackfillCompleted(_) => "backfill-completed",
        }
    }

    /// Row changes (and backfill rows) as opposed to schema changes.
    pub fn is_row_change(&self) -> bool {
        matches!(
            self,
            Change::Insert(_)
                | Change::Update(_)
                | Change::Delete(_)
                | Change::Truncate(_)
                | Change::Backfill(_)
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// Shared: every row change of a table carries the same relation.
    pub relation: Arc<Relation>,
    pub new: Row,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// Shared: every row change of a table carries the same relation.
    pub relation: Arc<Relation>,
    /// Old key values: required on the wire, `null` when the key did not change.
    pub key: Option<Row>,
    /// The new row; unchanged TOASTed columns are absent.
    pub new: Row,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    /// Shared: every row change of a table carries the same relation.
    pub relation: Arc<Relation>,
    /// Key columns (the whole old row under replica identity FULL).
    pub key: Row,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    pub relations: Vec<Relation>,
    pub extra: Extra,
}

/// Existing rows of a table or column streamed after the schema change that announced them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backfill {
    pub relation: NewRelation,
    /// Backfilled columns, excluding the row-key columns; may be empty.
    pub columns: Vec<String>,
    /// The snapshot the rows were read at (not the enclosing transaction's watermark).
    pub watermark: Watermark,
    /// Each row is `[...rowKey values, ...columns values]`.
    pub row_values: Vec<Vec<Value>>,
    /// v8; `current` is always present here.
    pub progress_marks: Option<ProgressMarks>,
    pub status: Option<DownloadStatus>,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackfillCompleted {
    pub relation: NewRelation,
    pub columns: Vec<String>,
    pub watermark: Watermark,
    /// v8; only `previous` is part of the schema, `current` is always `None` here.
    pub progress_marks: Option<ProgressMarks>,
    pub status: Option<DownloadStatus>,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateTable {
    pub spec: TableSpec,
    pub metadata: Option<TableMetadata>,
    /// Columns whose existing values will arrive as backfills: column → backfill id.
    pub backfill: Option<IndexMap<String, BackfillId>>,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenameTable {
    pub old: Identifier,
    pub new: Identifier,
    pub extra: Extra,
}

/// Only sent to subscribers at v5 or later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpdateTableMetadata {
    pub table: Identifier,
    pub old: TableMetadata,
    pub new: TableMetadata,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddColumn {
    pub table: Identifier,
    pub column: ColumnDef,
    pub table_metadata: Option<TableMetadata>,
    pub backfill: Option<BackfillId>,
    pub extra: Extra,
}

/// Rename and/or type / not-null change of a column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpdateColumn {
    pub table: Identifier,
    pub old: ColumnDef,
    pub new: ColumnDef,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropColumn {
    pub table: Identifier,
    pub column: String,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropTable {
    pub id: Identifier,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateIndex {
    pub spec: IndexSpec,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropIndex {
    /// Schema and index name.
    pub id: Identifier,
    pub extra: Extra,
}

/// `{schema, name}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identifier {
    pub schema: String,
    pub name: String,
    pub extra: Extra,
}

impl Identifier {
    pub fn new(schema: impl Into<String>, name: impl Into<String>) -> Self {
        Identifier {
            schema: schema.into(),
            name: name.into(),
            extra: Extra::new(),
        }
    }
}

/// The relation of a row change.
///
/// Decoding accepts `rowKey`, the deprecated `keyColumns` + `replicaIdentity` pair, or both; the
/// deprecated pair alone is understood as `rowKey` (as Zero's schema does). Encoding always writes
/// `rowKey`, and writes `keyColumns` / `replicaIdentity` exactly when they are `Some` — which they
/// are after decoding a message that carried them, so a relay drops nothing.
/// [`Relation::with_legacy_key`] fills them from `row_key` for v<5 subscribers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub schema: String,
    pub name: String,
    pub row_key: RowKey,
    /// Deprecated (pre-v5) copy of `row_key.columns`.
    pub key_columns: Option<Vec<String>>,
    /// Deprecated (pre-v5) copy of `row_key.type`.
    pub replica_identity: Option<ReplicaIdentity>,
    /// Zero's PG source sends `relationOid` here.
    pub extra: Extra,
}

impl Relation {
    pub fn new(schema: impl Into<String>, name: impl Into<String>, row_key: RowKey) -> Self {
        Relation {
            schema: schema.into(),
            name: name.into(),
            row_key,
            key_columns: None,
            replica_identity: None,
            extra: Extra::new(),
        }
    }

    /// This relation with the deprecated `keyColumns` / `replicaIdentity` filled in from
    /// `row_key` where missing, as v<5 subscribers require.
    pub fn with_legacy_key(mut self) -> Self {
        self.fill_legacy_key();
        self
    }

    /// In-place [`Relation::with_legacy_key`].
    pub fn fill_legacy_key(&mut self) {
        if self.key_columns.is_none() {
            self.key_columns = Some(self.row_key.columns.clone());
        }
        if self.replica_identity.is_none() {
            self.replica_identity = self.row_key.r#type;
        }
    }

    /// Whether the deprecated fields a v<5 subscriber needs are present.
    pub fn has_legacy_key(&self) -> bool {
        self.key_columns.is_some()
            && (self.row_key.r#type.is_none() || self.replica_identity.is_some())
    }
}

/// `{columns, type?}`: the columns identifying a row and the table's replica identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowKey {
    pub columns: Vec<String>,
    pub r#type: Option<ReplicaIdentity>,
    pub extra: Extra,
}

impl RowKey {
    pub fn new(columns: Vec<String>, r#type: Option<ReplicaIdentity>) -> Self {
        RowKey {
            columns,
            r#type,
            extra: Extra::new(),
        }
    }
}

/// Postgres replica identity (`pg_class.relreplident`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaIdentity {
    Default,
    Nothing,
    Full,
    Index,
}

impl ReplicaIdentity {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaIdentity::Default => "default",
            ReplicaIdentity::Nothing => "nothing",
            ReplicaIdentity::Full => "full",
            ReplicaIdentity::Index => "index",
        }
    }
}

/// The relation of backfill messages: `rowKey` is required.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRelation {
    pub schema: String,
    pub name: String,
    pub row_key: RowKey,
    pub extra: Extra,
}

/// `create-table.spec`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSpec {
    pub schema: String,
    pub name: String,
    pub columns: IndexMap<String, ColumnSpec>,
    pub primary_key: Option<Vec<String>>,
    /// Zero's PG source adds `oid`, `schemaOID`, `replicaIdentity`, `publications`.
    pub extra: Extra,
}

/// `{name, spec}` of `add-column` / `update-column`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnDef {
    pub name: String,
    pub spec: ColumnSpec,
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnSpec {
    pub pos: Number,
    pub data_type: String,
    pub pg_type_class: Option<PgTypeClass>,
    pub elem_pg_type_class: Option<Option<PgTypeClass>>,
    pub character_maximum_length: Option<Option<Number>>,
    pub not_null: Option<Option<bool>>,
    pub dflt: Option<Option<String>>,
    /// Zero's PG source adds `typeOID`.
    pub extra: Extra,
}

impl ColumnSpec {
    pub fn new(pos: Number, data_type: impl Into<String>) -> Self {
        ColumnSpec {
            pos,
            data_type: data_type.into(),
            pg_type_class: None,
            elem_pg_type_class: None,
            character_maximum_length: None,
            not_null: None,
            dflt: None,
            extra: Extra::new(),
        }
    }
}

/// `pg_type.typtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PgTypeClass {
    /// `b`
    Base,
    /// `c`
    Composite,
    /// `d`
    Domain,
    /// `e`
    Enum,
    /// `p`
    Pseudo,
    /// `r`
    Range,
    /// `m`
    Multirange,
}

impl PgTypeClass {
    pub fn as_str(self) -> &'static str {
        match self {
            PgTypeClass::Base => "b",
            PgTypeClass::Composite => "c",
            PgTypeClass::Domain => "d",
            PgTypeClass::Enum => "e",
            PgTypeClass::Pseudo => "p",
            PgTypeClass::Range => "r",
            PgTypeClass::Multirange => "m",
        }
    }
}

/// `create-index.spec`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexSpec {
    pub schema: String,
    pub name: String,
    pub table_name: String,
    pub unique: bool,
    pub columns: IndexMap<String, IndexDirection>,
    /// Partial-index condition (canary); kept as opaque JSON.
    pub predicate: Option<Value>,
    pub extra: Extra,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IndexDirection {
    Asc,
    Desc,
}

/// Source-defined table metadata; only `rowKey` (an object) is required.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableMetadata {
    pub row_key: Map<String, Value>,
    /// Every other key (Zero's PG source: `schemaOID`, `relationOID`).
    pub extra: Extra,
}

/// Backfill progress for display: `{rows, totalRows, totalBytes?}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DownloadStatus {
    pub rows: Number,
    pub total_rows: Number,
    pub total_bytes: Option<Number>,
    pub extra: Extra,
}

/// A position inside a backfill run (v8). Marks are comparable only on the same timeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgressMark {
    /// Lexicographically sortable.
    pub progress_mark: String,
    pub timeline: Option<String>,
    /// Other fields (strings or numbers); must be echoed back in backfill requests.
    pub extra: Extra,
}

impl ProgressMark {
    pub fn new(progress_mark: impl Into<String>, timeline: Option<String>) -> Self {
        ProgressMark {
            progress_mark: progress_mark.into(),
            timeline,
            extra: Extra::new(),
        }
    }
}

/// `progressMarks` of `backfill` (`current` required) and `backfill-completed` (`current` absent).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProgressMarks {
    pub previous: Option<ProgressMark>,
    pub current: Option<ProgressMark>,
    pub extra: Extra,
}

/// A pending backfill a subscriber reports (v8 shape; element of `start-subscription.backfills`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackfillRequest {
    pub table: BackfillTable,
    pub columns: IndexMap<String, BackfillColumn>,
    pub extra: Extra,
}

/// `{schema, name, metadata}`; `metadata` is required on the wire but may be `null`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackfillTable {
    pub schema: String,
    pub name: String,
    pub metadata: Option<TableMetadata>,
    pub extra: Extra,
}

/// `{id, progress?}`; no `progress` means "backfill from scratch".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackfillColumn {
    pub id: BackfillId,
    pub progress: Option<ProgressMark>,
    pub extra: Extra,
}
