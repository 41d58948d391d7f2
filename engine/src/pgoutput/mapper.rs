//! Decoded pgoutput messages to change-stream messages, as Zero's Postgres change source maps them.
//!
//! [`PgoutputMapper`] is sans-IO: the host feeds it every CopyData frame of the replication
//! stream in order and gets back what to forward, store or answer. It keeps the relation cache,
//! the custom array types announced by Type messages, and the open transaction.

use std::collections::HashSet;

use serde_json::{Number, Value};

use super::frame::{PrimaryKeepalive, ReplicationFrame, PG_EPOCH_UNIX_MS};
use super::message::{
    DecodeError, OldTuple, PgoutputMessage, Relation, RelationColumn, Tuple, TupleValue,
};
use super::relation::{CachedRelation, RelationCache, UnknownRelation};
use super::text_row::{TextRow, TextRowChange, TextRowKind};
use super::value::{self, ScalarText, TextColumn, TextRead, ValueType};
use crate::change_stream::{self, Change, DownstreamMessage, JsonFormat, Row};
use crate::watermark::{Lsn, Watermark};

/// What one replication frame means for the host.
// The large variant is the common one (every row change), so boxing it would only add an
// allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgoutputEvent {
    /// `begin` or `data` (insert/update/delete/truncate), ready to forward and store.
    Downstream(DownstreamMessage),
    /// The transaction's `commit`, and the end LSN of its commit record: the position to
    /// confirm upstream once the transaction is durable (the commit LSN, which names the
    /// transaction, is the record's start; confirming it would have Postgres send it again).
    Commit {
        commit: change_stream::Commit,
        end_lsn: Lsn,
    },
    /// A primary keepalive: the server's WAL end as a watermark, and whether it wants a
    /// standby status update now. Becomes a change-source status, not a downstream message.
    Keepalive(Keepalive),
    /// A `pg_logical_emit_message` message; the host routes it by prefix (DDL events, lag reports).
    LogicalMessage(EmittedMessage),
    /// A Relation message (now cached); `previous` is the entry it replaced, for schema-drift checks.
    Relation {
        relation: Relation,
        previous: Option<Relation>,
    },
    /// An insert, update or delete with its values kept as text, from a mapper that
    /// [keeps row text](PgoutputMapper::keep_row_text) (otherwise they are `Downstream` data).
    RowText(TextRowChange),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keepalive {
    pub wal_end: Lsn,
    /// `lexi(wal_end)`.
    pub watermark: Watermark,
    pub reply_requested: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmittedMessage {
    pub transactional: bool,
    pub lsn: Lsn,
    pub prefix: String,
    pub content: Vec<u8>,
}

/// Why a frame could not be turned into change-stream messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error(transparent)]
    UnknownRelation(#[from] UnknownRelation),
    #[error("expected {expected} column values for {table} (relation OID {oid}) as its Relation message announced, got {found}")]
    ColumnCount {
        table: String,
        oid: u32,
        expected: usize,
        found: usize,
    },
    #[error("expected {expected} in column {column} of {table} (type OID {type_oid}), got {len} bytes that do not parse as one")]
    InvalidValue {
        table: String,
        column: String,
        type_oid: u32,
        expected: &'static str,
        len: usize,
    },
    #[error("expected UTF-8 text in column {column} of {table}, got invalid bytes")]
    InvalidUtf8 { table: String, column: String },
    #[error("expected text column values (replication without the binary option), got a binary value in column {column} of {table}")]
    BinaryValue { table: String, column: String },
    #[error("expected a Commit for the transaction ending at {open} before another Begin, got a Begin for {next}")]
    NestedBegin { open: Lsn, next: Lsn },
    #[error("expected a Begin before a Commit, got a Commit at {commit} outside any transaction")]
    CommitWithoutBegin { commit: Lsn },
    #[error("expected the Commit LSN to equal the Begin's final LSN {begin}, got {commit}")]
    CommitMismatch { begin: Lsn, commit: Lsn },
    #[error("expected row changes inside a transaction, got {kind} outside one")]
    OutsideTransaction { kind: &'static str },
}

/// Turns a session's replication frames into change-stream messages. Start a new mapper for
/// each replication session: Postgres re-sends Relation messages after a reconnect.
#[derive(Debug, Clone, Default)]
pub struct PgoutputMapper {
    relations: RelationCache,
    /// Custom types whose Type message names an array (`_name`, Postgres's array naming), e.g.
    /// arrays of enums.
    array_types: HashSet<u32>,
    /// Final LSN of the open transaction.
    open_transaction: Option<Lsn>,
    /// Row changes as [`PgoutputEvent::RowText`] instead of JSON rows.
    keep_text: bool,
}

impl PgoutputMapper {
    pub fn new() -> Self {
        Self::default()
    }

    /// Maps inserts, updates and deletes to [`PgoutputEvent::RowText`] from now on: the same
    /// changes with their values kept as Postgres' text, for a store that takes them as they
    /// are ([`TextRowChange::to_change`] is what they would have been).
    pub fn keep_row_text(&mut self) {
        self.keep_text = true;
    }

    pub fn relations(&self) -> &RelationCache {
        &self.relations
    }

    pub fn in_transaction(&self) -> bool {
        self.open_transaction.is_some()
    }

    /// Decodes and maps one CopyData payload of the replication stream.
    pub fn map_frame(&mut self, frame: &[u8]) -> Result<Option<PgoutputEvent>, MappingError> {
        match ReplicationFrame::decode(frame)? {
            ReplicationFrame::XLogData(x) => self.map_message(PgoutputMessage::decode(x.payload)?),
            ReplicationFrame::Keepalive(k) => Ok(Some(Self::map_keepalive(k))),
        }
    }

    pub fn map_keepalive(keepalive: PrimaryKeepalive) -> PgoutputEvent {
        PgoutputEvent::Keepalive(Keepalive {
            wal_end: keepalive.wal_end,
            watermark: keepalive.wal_end.to_watermark(),
            reply_requested: keepalive.reply_requested,
        })
    }

    /// Maps one decoded pgoutput message; Origin and Type messages produce nothing.
    pub fn map_message(
        &mut self,
        message: PgoutputMessage<'_>,
    ) -> Result<Option<PgoutputEvent>, MappingError> {
        let change = match message {
            PgoutputMessage::Begin(b) => {
                if let Some(open) = self.open_transaction {
                    return Err(MappingError::NestedBegin {
                        open,
                        next: b.final_lsn,
                    });
                }
                self.open_transaction = Some(b.final_lsn);
                let mut begin = change_stream::Begin::new(b.final_lsn.to_watermark());
                begin.json = Some(JsonFormat::Stringified);
                begin
                    .extra
                    .insert("commitLsn".into(), b.final_lsn.to_string().into());
                begin
                    .extra
                    .insert("commitTime".into(), unix_micros(b.commit_time.0));
                begin.extra.insert("xid".into(), b.xid.into());
                return Ok(Some(downstream(DownstreamMessage::Begin(begin))));
            }
            PgoutputMessage::Commit(c) => {
                match self.open_transaction.take() {
                    None => {
                        return Err(MappingError::CommitWithoutBegin {
                            commit: c.commit_lsn,
                        })
                    }
                    Some(begin) if begin != c.commit_lsn => {
                        return Err(MappingError::CommitMismatch {
                            begin,
                            commit: c.commit_lsn,
                        })
                    }
                    Some(_) => {}
                }
                let mut commit = change_stream::Commit::new(c.commit_lsn.to_watermark());
                commit.commit_time_ms = js_safe_number(c.commit_time.to_unix_ms());
                commit.extra.insert("flags".into(), c.flags.into());
                commit
                    .extra
                    .insert("commitLsn".into(), c.commit_lsn.to_string().into());
                commit
                    .extra
                    .insert("commitTime".into(), unix_micros(c.commit_time.0));
                return Ok(Some(PgoutputEvent::Commit {
                    commit,
                    end_lsn: c.end_lsn,
                }));
            }
            PgoutputMessage::Origin(_) => return Ok(None),
            PgoutputMessage::Type(t) => {
                if t.name.starts_with('_') {
                    self.array_types.insert(t.oid);
                } else {
                    self.array_types.remove(&t.oid);
                }
                return Ok(None);
            }
            PgoutputMessage::Relation(relation) => {
                let previous = self.relations.insert(relation.clone());
                return Ok(Some(PgoutputEvent::Relation { relation, previous }));
            }
            PgoutputMessage::Message(m) => {
                return Ok(Some(PgoutputEvent::LogicalMessage(EmittedMessage {
                    transactional: m.transactional,
                    lsn: m.lsn,
                    prefix: m.prefix.to_owned(),
                    content: m.content.to_owned(),
                })));
            }
            PgoutputMessage::Insert(insert) if self.keep_text => {
                self.require_transaction("an Insert")?;
                let entry = self.relations.entry(insert.relation_oid)?;
                let new = self.text_row(entry, &insert.new, Columns::All, None)?;
                return Ok(Some(text_change(entry, TextRowKind::Insert { new })));
            }
            PgoutputMessage::Update(update) if self.keep_text => {
                self.require_transaction("an Update")?;
                let entry = self.relations.entry(update.relation_oid)?;
                let key = match &update.old {
                    None => None,
                    Some(old) => Some(self.old_text_row(entry, old)?),
                };
                let new = self.text_row(entry, &update.new, Columns::All, update.old.as_ref())?;
                return Ok(Some(text_change(entry, TextRowKind::Update { key, new })));
            }
            PgoutputMessage::Delete(delete) if self.keep_text => {
                self.require_transaction("a Delete")?;
                let entry = self.relations.entry(delete.relation_oid)?;
                let key = self.old_text_row(entry, &delete.old)?;
                return Ok(Some(text_change(entry, TextRowKind::Delete { key })));
            }
            PgoutputMessage::Insert(insert) => {
                self.require_transaction("an Insert")?;
                let entry = self.relations.entry(insert.relation_oid)?;
                Change::Insert(change_stream::Insert {
                    relation: entry.stream_relation.clone(),
                    new: self.row(entry, &insert.new, Columns::All, None)?,
                    extra: Default::default(),
                })
            }
            PgoutputMessage::Update(update) => {
                self.require_transaction("an Update")?;
                let entry = self.relations.entry(update.relation_oid)?;
                let key = match &update.old {
                    None => None,
                    Some(old) => Some(self.old_row(entry, old)?),
                };
                Change::Update(change_stream::Update {
                    relation: entry.stream_relation.clone(),
                    key,
                    new: self.row(entry, &update.new, Columns::All, update.old.as_ref())?,
                    extra: Default::default(),
                })
            }
            PgoutputMessage::Delete(delete) => {
                self.require_transaction("a Delete")?;
                let entry = self.relations.entry(delete.relation_oid)?;
                Change::Delete(change_stream::Delete {
                    relation: entry.stream_relation.clone(),
                    key: self.old_row(entry, &delete.old)?,
                    extra: Default::default(),
                })
            }
            PgoutputMessage::Truncate(truncate) => {
                self.require_transaction("a Truncate")?;
                let relations = truncate
                    .relation_oids
                    .iter()
                    .map(|&oid| self.relations.stream_relation(oid).cloned())
                    .collect::<Result<_, _>>()?;
                Change::Truncate(change_stream::Truncate {
                    relations,
                    extra: Default::default(),
                })
            }
        };
        Ok(Some(downstream(DownstreamMessage::Data(change))))
    }

    fn require_transaction(&self, kind: &'static str) -> Result<(), MappingError> {
        match self.open_transaction {
            Some(_) => Ok(()),
            None => Err(MappingError::OutsideTransaction { kind }),
        }
    }

    /// The `key` of an update or delete: the key columns of a `K` tuple, or the whole old row
    /// of an `O` tuple (replica identity FULL).
    fn old_row(&self, entry: &CachedRelation, old: &OldTuple<'_>) -> Result<Row, MappingError> {
        let (tuple, columns) = old_columns(old);
        self.row(entry, tuple, columns, None)
    }

    /// A tuple as a row. Unchanged TOAST values are taken from `old` where it has them (an
    /// `O` tuple, or a key column of a `K` tuple) and are otherwise left out.
    fn row(
        &self,
        entry: &CachedRelation,
        tuple: &Tuple<'_>,
        columns: Columns,
        old: Option<&OldTuple<'_>>,
    ) -> Result<Row, MappingError> {
        let relation = &entry.relation;
        let mut row = Row::with_capacity(relation.columns.len());
        present_values(relation, tuple, columns, old, |_, column, text| {
            let value = match text {
                None => Value::Null,
                Some(bytes) => self.text_value(relation, column, bytes)?,
            };
            row.insert(column.name.clone(), value);
            Ok(())
        })?;
        Ok(row)
    }

    /// [`PgoutputMapper::old_row`], its values kept as text.
    fn old_text_row(
        &self,
        entry: &CachedRelation,
        old: &OldTuple<'_>,
    ) -> Result<TextRow, MappingError> {
        let (tuple, columns) = old_columns(old);
        self.text_row(entry, tuple, columns, None)
    }

    /// [`PgoutputMapper::row`], its values kept as text: the same columns, checked the same way.
    fn text_row(
        &self,
        entry: &CachedRelation,
        tuple: &Tuple<'_>,
        columns: Columns,
        old: Option<&OldTuple<'_>>,
    ) -> Result<TextRow, MappingError> {
        let relation = &entry.relation;
        let text_len = tuple
            .0
            .iter()
            .map(|v| match v {
                TupleValue::Text(bytes) => bytes.len(),
                _ => 0,
            })
            .sum();
        let mut row = TextRow::with_capacity(relation.columns.len(), text_len);
        present_values(relation, tuple, columns, old, |index, column, text| {
            // At most 65,535 columns: pgoutput sends the count as a 16-bit integer.
            let position = u16::try_from(index).unwrap_or(u16::MAX);
            let Some(bytes) = text else {
                row.push_scalar(position, ScalarText::Null);
                return Ok(());
            };
            let text = utf8(relation, column, bytes)?;
            let ty = TextColumn::of(self.value_type(column.type_oid));
            match ty
                .read(text)
                .map_err(|expected| invalid(relation, column, expected, bytes))?
            {
                TextRead::Scalar(scalar) => row.push_scalar(position, scalar),
                TextRead::Json(value) => row.push_json(position, value),
            }
            Ok(())
        })?;
        Ok(row)
    }

    fn text_value(
        &self,
        relation: &Relation,
        column: &RelationColumn,
        bytes: &[u8],
    ) -> Result<Value, MappingError> {
        let text = utf8(relation, column, bytes)?;
        value::convert(self.value_type(column.type_oid), text)
            .map_err(|e| invalid(relation, column, e.expected, bytes))
    }

    fn value_type(&self, oid: u32) -> ValueType {
        // Most streams announce no custom array type: skip hashing every value's OID then.
        ValueType::of(
            oid,
            !self.array_types.is_empty() && self.array_types.contains(&oid),
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Columns {
    All,
    Key,
}

/// An old tuple and the columns its row has: the key columns of a `K` tuple, every column of an
/// `O` tuple.
fn old_columns<'o, 't>(old: &'o OldTuple<'t>) -> (&'o Tuple<'t>, Columns) {
    match old {
        OldTuple::Key(t) => (t, Columns::Key),
        OldTuple::Full(t) => (t, Columns::All),
    }
}

/// Calls `each` with every column of `tuple` that a row of `columns` has, its position and its
/// text (`None` for NULL), in column order. Unchanged TOAST values are taken from `old` where
/// it has them (an `O` tuple, or a key column of a `K` tuple) and are otherwise left out.
fn present_values<'t>(
    relation: &Relation,
    tuple: &Tuple<'t>,
    columns: Columns,
    old: Option<&OldTuple<'t>>,
    mut each: impl FnMut(usize, &RelationColumn, Option<&'t [u8]>) -> Result<(), MappingError>,
) -> Result<(), MappingError> {
    check_column_count(relation, tuple)?;
    if let Some(old) = old {
        check_column_count(relation, old.tuple())?;
    }
    for (index, (column, value)) in relation.columns.iter().zip(&tuple.0).enumerate() {
        if columns == Columns::Key && !column.is_key() {
            continue;
        }
        let text = match value {
            TupleValue::Null => None,
            TupleValue::Text(bytes) => Some(*bytes),
            TupleValue::Binary(_) => {
                return Err(MappingError::BinaryValue {
                    table: table_name(relation),
                    column: column.name.clone(),
                })
            }
            TupleValue::UnchangedToast => match old.and_then(|o| toast_source(o, index, column)) {
                Some(bytes) => Some(bytes),
                None => continue,
            },
        };
        each(index, column, text)?;
    }
    Ok(())
}

fn utf8<'b>(
    relation: &Relation,
    column: &RelationColumn,
    bytes: &'b [u8],
) -> Result<&'b str, MappingError> {
    std::str::from_utf8(bytes).map_err(|_| MappingError::InvalidUtf8 {
        table: table_name(relation),
        column: column.name.clone(),
    })
}

fn invalid(
    relation: &Relation,
    column: &RelationColumn,
    expected: &'static str,
    bytes: &[u8],
) -> MappingError {
    MappingError::InvalidValue {
        table: table_name(relation),
        column: column.name.clone(),
        type_oid: column.type_oid,
        expected,
        len: bytes.len(),
    }
}

fn text_change(entry: &CachedRelation, kind: TextRowKind) -> PgoutputEvent {
    PgoutputEvent::RowText(TextRowChange {
        relation: entry.stream_relation.clone(),
        columns: entry.column_names.clone(),
        kind,
    })
}

fn downstream(message: DownstreamMessage) -> PgoutputEvent {
    PgoutputEvent::Downstream(message)
}

/// The old value of a column whose new value is an unchanged TOAST pointer. A `K` tuple only
/// carries key columns; its other columns are null placeholders, not values.
fn toast_source<'a>(old: &OldTuple<'a>, index: usize, column: &RelationColumn) -> Option<&'a [u8]> {
    let usable = match old {
        OldTuple::Full(_) => true,
        OldTuple::Key(_) => column.is_key(),
    };
    match old.tuple().0.get(index) {
        Some(TupleValue::Text(bytes)) if usable => Some(bytes),
        _ => None,
    }
}

fn check_column_count(relation: &Relation, tuple: &Tuple<'_>) -> Result<(), MappingError> {
    if tuple.0.len() == relation.columns.len() {
        Ok(())
    } else {
        Err(MappingError::ColumnCount {
            table: table_name(relation),
            oid: relation.oid,
            expected: relation.columns.len(),
            found: tuple.0.len(),
        })
    }
}

fn table_name(relation: &Relation) -> String {
    format!("{}.{}", relation.namespace, relation.name)
}

/// `commitTimeMs` is a JSON `number` for Zero; a time beyond ±(2^53 − 1) ms (about 285 000 years)
/// cannot be one, so it is left out rather than sent imprecisely.
fn js_safe_number(value: i64) -> Option<Number> {
    const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;
    (value.unsigned_abs() <= MAX_SAFE_INTEGER).then(|| Number::from(value))
}

/// A Postgres-epoch timestamp as Unix microseconds (Zero's `commitTime`), exact beyond 2^53.
fn unix_micros(pg_micros: i64) -> Value {
    let micros = i128::from(pg_micros) + i128::from(PG_EPOCH_UNIX_MS) * 1000;
    // Every real timestamp fits an i64, which needs no text round trip; only Postgres'
    // `infinity` neighbours go beyond it.
    if let Ok(micros) = i64::try_from(micros) {
        return Value::from(micros);
    }
    // An i128 always renders as a valid JSON integer; the fallback is unreachable.
    micros
        .to_string()
        .parse::<Number>()
        .map_or(Value::Null, Value::Number)
}

#[cfg(test)]
mod tests;
