//! Encoding typed messages back to Zero's exact JSON tuple shapes.
//!
//! Known fields are written first, in schema order, then the `extra` keys in the order they
//! arrived. An `extra` key that names a field written at the same level is skipped, so a value
//! built by hand can never produce a duplicate key.

use indexmap::IndexMap;
use serde::ser::{Error as _, SerializeMap, SerializeSeq, Serializer};
use serde::Serialize;
use serde_json::Value;

use super::message::*;

/// The most known fields any object level has (ColumnSpec: 7).
const MAX_FIELDS: usize = 8;

/// Writes one JSON object: known fields, then the unknown keys that do not clash with them.
struct Obj<M> {
    map: M,
    written: [&'static str; MAX_FIELDS],
    count: usize,
}

impl<M: SerializeMap> Obj<M> {
    fn new<S: Serializer<SerializeMap = M>>(s: S) -> Result<Self, S::Error> {
        Ok(Obj {
            map: s.serialize_map(None)?,
            written: [""; MAX_FIELDS],
            count: 0,
        })
    }

    fn field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), M::Error> {
        match self.written.get_mut(self.count) {
            Some(slot) => *slot = key,
            None => return Err(M::Error::custom("too many fields in one object")),
        }
        self.count += 1;
        self.map.serialize_entry(key, value)
    }

    fn opt<T: Serialize>(&mut self, key: &'static str, value: &Option<T>) -> Result<(), M::Error> {
        match value {
            Some(v) => self.field(key, v),
            None => Ok(()),
        }
    }

    fn finish(mut self, extra: &Extra) -> Result<M::Ok, M::Error> {
        let written = &self.written[..self.count];
        for (key, value) in extra {
            if !written.contains(&key.as_str()) {
                self.map.serialize_entry(key, value)?;
            }
        }
        self.map.end()
    }
}

/// A JSON object of typed values, in map order.
struct Entries<'a, T>(&'a IndexMap<String, T>);

impl<T: Serialize> Serialize for Entries<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter())
    }
}

macro_rules! serialize_as_str {
    ($ty:ty, { $($variant:path => $text:literal),+ $(,)? }) => {
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(match self { $($variant => $text,)+ })
            }
        }
    };
}

serialize_as_str!(JsonFormat, { JsonFormat::Parsed => "p", JsonFormat::Stringified => "s" });
serialize_as_str!(ReplicaIdentity, {
    ReplicaIdentity::Default => "default",
    ReplicaIdentity::Nothing => "nothing",
    ReplicaIdentity::Full => "full",
    ReplicaIdentity::Index => "index",
});
serialize_as_str!(PgTypeClass, {
    PgTypeClass::Base => "b",
    PgTypeClass::Composite => "c",
    PgTypeClass::Domain => "d",
    PgTypeClass::Enum => "e",
    PgTypeClass::Pseudo => "p",
    PgTypeClass::Range => "r",
    PgTypeClass::Multirange => "m",
});
serialize_as_str!(IndexDirection, { IndexDirection::Asc => "ASC", IndexDirection::Desc => "DESC" });
serialize_as_str!(SubscriberMode, {
    SubscriberMode::Serving => "serving",
    SubscriberMode::Backup => "backup",
});

/// Implements `Serialize` for a struct written as one JSON object.
macro_rules! serialize_object {
    ($ty:ty, |$this:ident, $o:ident| $body:block) => {
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let $this = self;
                let mut $o = Obj::new(s)?;
                $body
                $o.finish(&$this.extra)
            }
        }
    };
}

serialize_object!(LagTimings, |t, o| {
    o.field("sendTimeMs", &t.send_time_ms)?;
    o.field("commitTimeMs", &t.commit_time_ms)?;
    o.field("receiveTimeMs", &t.receive_time_ms)?;
});

serialize_object!(LagReport, |r, o| {
    o.opt("lastTimings", &r.last_timings)?;
    o.field("nextSendTimeMs", &r.next_send_time_ms)?;
});

serialize_object!(Identifier, |i, o| {
    o.field("schema", &i.schema)?;
    o.field("name", &i.name)?;
});

serialize_object!(RowKey, |k, o| {
    o.field("columns", &k.columns)?;
    o.opt("type", &k.r#type)?;
});

serialize_object!(Relation, |r, o| {
    o.field("schema", &r.schema)?;
    o.field("name", &r.name)?;
    o.opt("keyColumns", &r.key_columns)?;
    o.opt("replicaIdentity", &r.replica_identity)?;
    o.field("rowKey", &r.row_key)?;
});

serialize_object!(NewRelation, |r, o| {
    o.field("schema", &r.schema)?;
    o.field("name", &r.name)?;
    o.field("rowKey", &r.row_key)?;
});

serialize_object!(ColumnSpec, |c, o| {
    o.field("pos", &c.pos)?;
    o.field("dataType", &c.data_type)?;
    o.opt("pgTypeClass", &c.pg_type_class)?;
    o.opt("elemPgTypeClass", &c.elem_pg_type_class)?;
    o.opt("characterMaximumLength", &c.character_maximum_length)?;
    o.opt("notNull", &c.not_null)?;
    o.opt("dflt", &c.dflt)?;
});

serialize_object!(ColumnDef, |c, o| {
    o.field("name", &c.name)?;
    o.field("spec", &c.spec)?;
});

serialize_object!(TableSpec, |t, o| {
    o.field("schema", &t.schema)?;
    o.field("name", &t.name)?;
    o.field("columns", &Entries(&t.columns))?;
    o.opt("primaryKey", &t.primary_key)?;
});

serialize_object!(IndexSpec, |i, o| {
    o.field("schema", &i.schema)?;
    o.field("name", &i.name)?;
    o.field("tableName", &i.table_name)?;
    o.field("unique", &i.unique)?;
    o.field("columns", &Entries(&i.columns))?;
    o.opt("predicate", &i.predicate)?;
});

serialize_object!(TableMetadata, |t, o| {
    o.field("rowKey", &t.row_key)?;
});

serialize_object!(DownloadStatus, |d, o| {
    o.field("rows", &d.rows)?;
    o.field("totalRows", &d.total_rows)?;
    o.opt("totalBytes", &d.total_bytes)?;
});

serialize_object!(ProgressMark, |p, o| {
    o.field("progressMark", &p.progress_mark)?;
    o.opt("timeline", &p.timeline)?;
});

serialize_object!(ProgressMarks, |p, o| {
    o.opt("previous", &p.previous)?;
    o.opt("current", &p.current)?;
});

serialize_object!(BackfillTable, |t, o| {
    o.field("schema", &t.schema)?;
    o.field("name", &t.name)?;
    o.field("metadata", &t.metadata)?;
});

serialize_object!(BackfillColumn, |c, o| {
    o.field("id", &c.id)?;
    o.opt("progress", &c.progress)?;
});

serialize_object!(BackfillRequest, |r, o| {
    o.field("table", &r.table)?;
    o.field("columns", &Entries(&r.columns))?;
});

serialize_object!(SubscribeContext, |c, o| {
    o.field("taskID", &c.task_id)?;
    o.field("id", &c.id)?;
    o.field("mode", &c.mode)?;
    o.field("replicaVersion", &c.replica_version)?;
    o.field("watermark", &c.watermark)?;
    o.opt("backfills", &c.backfills)?;
});

serialize_object!(ReserveSnapshot, |r, o| {
    o.field("taskID", &r.task_id)?;
});

serialize_object!(Status, |st, o| {
    o.field("tag", "status")?;
    o.opt("lagReport", &st.lag_report)?;
});

serialize_object!(Rollback, |_r, o| {
    o.field("tag", "rollback")?;
});

serialize_object!(StreamError, |e, o| {
    o.field("type", &e.error_type)?;
    o.opt("message", &e.message)?;
});

serialize_object!(Reserved, |r, o| {
    o.field("tag", "snapshot")?;
    o.field("backupURL", &r.backup_url)?;
    o.field("replicaVersion", &r.replica_version)?;
    o.field("minWatermark", &r.min_watermark)?;
    o.opt("replicaSize", &r.replica_size)?;
});

/// The header object of a `begin` tuple.
struct BeginHeader<'a>(&'a Begin);

impl Serialize for BeginHeader<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut o = Obj::new(s)?;
        o.field("tag", "begin")?;
        o.opt("json", &self.0.json)?;
        o.opt("skipAck", &self.0.skip_ack)?;
        o.finish(&self.0.extra)
    }
}

struct BeginWatermark<'a>(&'a Begin);

impl Serialize for BeginWatermark<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut o = Obj::new(s)?;
        o.field("commitWatermark", &self.0.commit_watermark)?;
        o.finish(&self.0.watermark_extra)
    }
}

struct CommitHeader<'a>(&'a Commit);

impl Serialize for CommitHeader<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut o = Obj::new(s)?;
        o.field("tag", "commit")?;
        o.opt("commitTimeMs", &self.0.commit_time_ms)?;
        o.finish(&self.0.extra)
    }
}

struct CommitWatermark<'a>(&'a Commit);

impl Serialize for CommitWatermark<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut o = Obj::new(s)?;
        o.field("watermark", &self.0.watermark)?;
        o.finish(&self.0.watermark_extra)
    }
}

impl Serialize for Change {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut o = Obj::new(s)?;
        o.field("tag", self.tag())?;
        let extra = match self {
            Change::Insert(c) => {
                o.field("relation", &*c.relation)?;
                o.field("new", &c.new)?;
                &c.extra
            }
            Change::Update(c) => {
                o.field("relation", &*c.relation)?;
                o.field("key", &c.key)?;
                o.field("new", &c.new)?;
                &c.extra
            }
            Change::Delete(c) => {
                o.field("relation", &*c.relation)?;
                o.field("key", &c.key)?;
                &c.extra
            }
            Change::Truncate(c) => {
                o.field("relations", &c.relations)?;
                &c.extra
            }
            Change::Backfill(c) => {
                o.field("relation", &c.relation)?;
                o.field("columns", &c.columns)?;
                o.field("watermark", &c.watermark)?;
                o.field("rowValues", &c.row_values)?;
                o.opt("progressMarks", &c.progress_marks)?;
                o.opt("status", &c.status)?;
                &c.extra
            }
            Change::BackfillCompleted(c) => {
                o.field("relation", &c.relation)?;
                o.field("columns", &c.columns)?;
                o.field("watermark", &c.watermark)?;
                o.opt("progressMarks", &c.progress_marks)?;
                o.opt("status", &c.status)?;
                &c.extra
            }
            Change::CreateTable(c) => {
                o.field("spec", &c.spec)?;
                o.opt("metadata", &c.metadata)?;
                if let Some(backfill) = &c.backfill {
                    o.field("backfill", &Entries(backfill))?;
                }
                &c.extra
            }
            Change::RenameTable(c) => {
                o.field("old", &c.old)?;
                o.field("new", &c.new)?;
                &c.extra
            }
            Change::UpdateTableMetadata(c) => {
                o.field("table", &c.table)?;
                o.field("old", &c.old)?;
                o.field("new", &c.new)?;
                &c.extra
            }
            Change::AddColumn(c) => {
                o.field("table", &c.table)?;
                o.field("column", &c.column)?;
                o.opt("tableMetadata", &c.table_metadata)?;
                o.opt("backfill", &c.backfill)?;
                &c.extra
            }
            Change::UpdateColumn(c) => {
                o.field("table", &c.table)?;
                o.field("old", &c.old)?;
                o.field("new", &c.new)?;
                &c.extra
            }
            Change::DropColumn(c) => {
                o.field("table", &c.table)?;
                o.field("column", &c.column)?;
                &c.extra
            }
            Change::DropTable(c) => {
                o.field("id", &c.id)?;
                &c.extra
            }
            Change::CreateIndex(c) => {
                o.field("spec", &c.spec)?;
                &c.extra
            }
            Change::DropIndex(c) => {
                o.field("id", &c.id)?;
                &c.extra
            }
        };
        o.finish(extra)
    }
}

fn tuple2<S: Serializer, T: Serialize + ?Sized>(
    s: S,
    tag: &str,
    body: &T,
) -> Result<S::Ok, S::Error> {
    let mut seq = s.serialize_seq(Some(2))?;
    seq.serialize_element(tag)?;
    seq.serialize_element(body)?;
    seq.end()
}

fn tuple3<S: Serializer, A: Serialize, B: Serialize>(
    s: S,
    tag: &str,
    a: &A,
    b: &B,
) -> Result<S::Ok, S::Error> {
    let mut seq = s.serialize_seq(Some(3))?;
    seq.serialize_element(tag)?;
    seq.serialize_element(a)?;
    seq.serialize_element(b)?;
    seq.end()
}

impl Serialize for DownstreamMessage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            DownstreamMessage::Status(m) => tuple2(s, "status", m),
            DownstreamMessage::Begin(m) => tuple3(s, "begin", &BeginHeader(m), &BeginWatermark(m)),
            DownstreamMessage::Data(m) => tuple2(s, "data", m),
            DownstreamMessage::Commit(m) => {
                tuple3(s, "commit", &CommitHeader(m), &CommitWatermark(m))
            }
            DownstreamMessage::Rollback(m) => tuple2(s, "rollback", m),
            DownstreamMessage::Error(m) => tuple2(s, "error", m),
            DownstreamMessage::Reserved(m) => tuple2(s, "reserved", m),
        }
    }
}

impl Serialize for UpstreamMessage {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UpstreamMessage::ReserveSnapshot(m) => tuple2(s, "reserve-snapshot", m),
            UpstreamMessage::StartSubscription(m) => tuple2(s, "start-subscription", m),
        }
    }
}

impl Serialize for Message {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Message::Downstream(m) => m.serialize(s),
            Message::Upstream(m) => m.serialize(s),
        }
    }
}

/// JSON text of any serializable protocol value.
///
/// Our `Serialize` impls only fail beyond [`MAX_FIELDS`] known fields per object, which no type
/// has, and JSON text of string-keyed maps cannot fail; the empty fallback is unreachable.
pub(super) fn to_text<T: Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

pub(super) fn to_value<T: Serialize + ?Sized>(value: &T) -> Value {
    serde_json::to_value(value).unwrap_or(Value::Null)
}

/// Encodes a downstream message as JSON text.
pub fn encode_downstream(message: &DownstreamMessage) -> String {
    to_text(message)
}

/// Where the second element of `text`, the compact encoding of `message`, ends: for the
/// three-element `begin` and `commit` tuples, before the `,{watermark}]` that follows it;
/// `None` for the others, whose inner object runs to the closing bracket.
pub fn header_end(message: &DownstreamMessage, text: &str) -> Option<usize> {
    let tail = match message {
        DownstreamMessage::Begin(m) => to_text(&BeginWatermark(m)),
        DownstreamMessage::Commit(m) => to_text(&CommitWatermark(m)),
        _ => return None,
    };
    // `,` + the watermark object + `]`.
    text.len().checked_sub(tail.len() + 2)
}

/// Encodes a downstream message as a JSON value.
pub fn encode_downstream_value(message: &DownstreamMessage) -> Value {
    to_value(message)
}

/// Encodes an upstream message as JSON text.
pub fn encode_upstream(message: &UpstreamMessage) -> String {
    to_text(message)
}

/// Encodes an upstream message as a JSON value.
pub fn encode_upstream_value(message: &UpstreamMessage) -> Value {
    to_value(message)
}

/// Encodes a message of either direction as JSON text.
pub fn encode_message(message: &Message) -> String {
    to_text(message)
}

/// Encodes a change (the second element of a `data` tuple) as JSON text, e.g. for a change log.
pub fn encode_change(change: &Change) -> String {
    to_text(change)
}

#[cfg(test)]
mod tests;
