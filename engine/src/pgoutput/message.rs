//! pgoutput protocol version 1 messages (the payload of each XLogData frame).
//!
//! Decoding borrows strings and column values from the input; only Relation and Type messages,
//! which are rare and cached, are copied into owned values.

use std::fmt;

use super::frame::PgTimestamp;
use super::reader::Reader;
use crate::watermark::Lsn;

/// A byte that should have been a known tag, shown as a character when printable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagByte(pub u8);

impl fmt::Display for TagByte {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_ascii_graphic() {
            write!(f, "'{}' (0x{:02x})", self.0 as char, self.0)
        } else {
            write!(f, "0x{:02x}", self.0)
        }
    }
}

/// Why bytes from the replication stream could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("expected {needed} more bytes for the {field} at offset {offset} of a {context} message, but only {available} remain")]
    Truncated {
        context: &'static str,
        field: &'static str,
        offset: usize,
        needed: usize,
        available: usize,
    },
    #[error("expected a replication frame tag 'w' (XLogData) or 'k' (keepalive), got {tag}")]
    UnknownFrameTag { tag: TagByte },
    #[error("expected a pgoutput v1 message tag (B, C, O, R, Y, I, U, D, T or M), got {tag}")]
    UnknownMessageTag { tag: TagByte },
    #[error("expected a NUL-terminated {field} at offset {offset} of a {context} message, but the message ends first")]
    UnterminatedString {
        context: &'static str,
        field: &'static str,
        offset: usize,
    },
    #[error("expected UTF-8 text in the {field} at offset {offset} of a {context} message")]
    InvalidUtf8 {
        context: &'static str,
        field: &'static str,
        offset: usize,
    },
    #[error("{context} message announces {count} {field}, which needs at least {needed} bytes, but only {available} remain")]
    CountTooLarge {
        context: &'static str,
        field: &'static str,
        count: usize,
        needed: usize,
        available: usize,
    },
    #[error("expected a non-negative length for the {field} of a {context} message, got {length}")]
    NegativeLength {
        context: &'static str,
        field: &'static str,
        length: i32,
    },
    #[error("expected the {context} message to end, but {extra} bytes remain (another protocol version?)")]
    TrailingBytes { context: &'static str, extra: usize },
    #[error("expected a replica identity setting d, n, f or i in a Relation message, got {found}")]
    UnknownReplicaIdentity { found: TagByte },
    #[error(
        "expected a column value kind n, u, t or b for column {column} of a tuple, got {found}"
    )]
    UnknownValueKind { column: usize, found: TagByte },
    #[error("expected {expected} in a {context} message, got {found}")]
    UnexpectedTupleMarker {
        context: &'static str,
        expected: &'static str,
        found: TagByte,
    },
}

/// One pgoutput v1 message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PgoutputMessage<'a> {
    Begin(Begin),
    Commit(Commit),
    Origin(Origin<'a>),
    Relation(Relation),
    Type(PgType),
    Insert(Insert<'a>),
    Update(Update<'a>),
    Delete(Delete<'a>),
    Truncate(Truncate),
    Message(LogicalMessage<'a>),
}

/// `B`: a transaction starts; `final_lsn` is the LSN of its commit record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Begin {
    pub final_lsn: Lsn,
    pub commit_time: PgTimestamp,
    pub xid: u32,
}

/// `C`: the transaction ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    pub flags: u8,
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub commit_time: PgTimestamp,
}

/// `O`: the transaction was replicated from another origin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin<'a> {
    pub commit_lsn: Lsn,
    pub name: &'a str,
}

/// The table's `REPLICA IDENTITY` (`pg_class.relreplident`): what old values updates and
/// deletes carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaIdentity {
    /// `d`: the primary key.
    Default,
    /// `n`: nothing.
    Nothing,
    /// `f`: all columns.
    Full,
    /// `i`: the columns of a chosen unique index.
    Index,
}

impl ReplicaIdentity {
    fn from_byte(byte: u8) -> Result<Self, DecodeError> {
        match byte {
            b'd' => Ok(ReplicaIdentity::Default),
            b'n' => Ok(ReplicaIdentity::Nothing),
            b'f' => Ok(ReplicaIdentity::Full),
            b'i' => Ok(ReplicaIdentity::Index),
            other => Err(DecodeError::UnknownReplicaIdentity {
                found: TagByte(other),
            }),
        }
    }

    pub fn as_byte(self) -> u8 {
        match self {
            ReplicaIdentity::Default => b'd',
            ReplicaIdentity::Nothing => b'n',
            ReplicaIdentity::Full => b'f',
            ReplicaIdentity::Index => b'i',
        }
    }
}

/// `R`: a table's shape, sent before its first row change in a session and after it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub oid: u32,
    /// The schema; empty for `pg_catalog`.
    pub namespace: String,
    pub name: String,
    pub replica_identity: ReplicaIdentity,
    pub columns: Vec<RelationColumn>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    pub flags: u8,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

impl RelationColumn {
    /// Flag bit 1 marks a column of the replica identity key.
    pub fn is_key(&self) -> bool {
        self.flags & 1 != 0
    }
}

/// `Y`: a non-built-in data type used by a following Relation message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgType {
    pub oid: u32,
    /// The schema; empty for `pg_catalog`.
    pub namespace: String,
    pub name: String,
}

/// `I`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert<'a> {
    pub relation_oid: u32,
    pub new: Tuple<'a>,
}

/// `U`: `old` is present when the key changed (`K`) or the replica identity is FULL (`O`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update<'a> {
    pub relation_oid: u32,
    pub old: Option<OldTuple<'a>>,
    pub new: Tuple<'a>,
}

/// `D`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete<'a> {
    pub relation_oid: u32,
    pub old: OldTuple<'a>,
}

/// The old values of an updated or deleted row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple<'a> {
    /// `K`: only the replica identity key columns are set; the others are null.
    Key(Tuple<'a>),
    /// `O`: the whole old row (replica identity FULL).
    Full(Tuple<'a>),
}

impl<'a> OldTuple<'a> {
    pub fn tuple(&self) -> &Tuple<'a> {
        match self {
            OldTuple::Key(t) | OldTuple::Full(t) => t,
        }
    }
}

/// `T`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    pub options: u8,
    pub relation_oids: Vec<u32>,
}

impl Truncate {
    pub fn cascade(&self) -> bool {
        self.options & 1 != 0
    }

    pub fn restart_identity(&self) -> bool {
        self.options & 2 != 0
    }
}

/// `M`: a message written with `pg_logical_emit_message`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogicalMessage<'a> {
    pub transactional: bool,
    pub lsn: Lsn,
    pub prefix: &'a str,
    pub content: &'a [u8],
}

/// TupleData: one value per column of the relation, in column order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tuple<'a>(pub Vec<TupleValue<'a>>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TupleValue<'a> {
    /// `n`
    Null,
    /// `u`: a TOASTed value that did not change; its value is not sent.
    UnchangedToast,
    /// `t`: the type's text output.
    Text(&'a [u8]),
    /// `b`: the type's binary send format (only with the `binary` option).
    Binary(&'a [u8]),
}

impl<'a> PgoutputMessage<'a> {
    /// Decodes one pgoutput v1 message; any malformed, truncated or over-long input is an error.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, DecodeError> {
        let (&tag, body) = bytes.split_first().ok_or(DecodeError::Truncated {
            context: "pgoutput",
            field: "message tag",
            offset: 0,
            needed: 1,
            available: 0,
        })?;
        let message = match tag {
            b'B' => {
                let mut r = Reader::new(body, "Begin");
                let begin = Begin {
                    final_lsn: Lsn(r.u64("final LSN")?),
                    commit_time: PgTimestamp(r.i64("commit time")?),
                    xid: r.u32("xid")?,
                };
                r.finish()?;
                PgoutputMessage::Begin(begin)
            }
            b'C' => {
                let mut r = Reader::new(body, "Commit");
                let commit = Commit {
                    flags: r.u8("flags")?,
                    commit_lsn: Lsn(r.u64("commit LSN")?),
                    end_lsn: Lsn(r.u64("end LSN")?),
                    commit_time: PgTimestamp(r.i64("commit time")?),
                };
                r.finish()?;
                PgoutputMessage::Commit(commit)
            }
            b'O' => {
                let mut r = Reader::new(body, "Origin");
                let origin = Origin {
                    commit_lsn: Lsn(r.u64("origin commit LSN")?),
                    name: r.cstr("origin name")?,
                };
                r.finish()?;
                PgoutputMessage::Origin(origin)
            }
            b'R' => PgoutputMessage::Relation(decode_relation(body)?),
            b'Y' => {
                let mut r = Reader::new(body, "Type");
                let ty = PgType {
                    oid: r.u32("type OID")?,
                    namespace: r.cstr("namespace")?.to_owned(),
                    name: r.cstr("type name")?.to_owned(),
                };
                r.finish()?;
                PgoutputMessage::Type(ty)
            }
            b'I' => {
                let mut r = Reader::new(body, "Insert");
                let relation_oid = r.u32("relation OID")?;
                expect_marker(&mut r, b'N', "'N' before the new tuple")?;
                let new = decode_tuple(&mut r)?;
                r.finish()?;
                PgoutputMessage::Insert(Insert { relation_oid, new })
            }
            b'U' => {
                let mut r = Reader::new(body, "Update");
                let relation_oid = r.u32("relation OID")?;
                let old = match r.u8("tuple marker")? {
                    b'K' => Some(OldTuple::Key(decode_tuple(&mut r)?)),
                    b'O' => Some(OldTuple::Full(decode_tuple(&mut r)?)),
                    b'N' => None,
                    other => {
                        return Err(DecodeError::UnexpectedTupleMarker {
                            context: "Update",
                            expected: "'K', 'O' or 'N'",
                            found: TagByte(other),
                        })
                    }
                };
                if old.is_some() {
                    expect_marker(&mut r, b'N', "'N' before the new tuple")?;
                }
                let new = decode_tuple(&mut r)?;
                r.finish()?;
                PgoutputMessage::Update(Update {
                    relation_oid,
                    old,
                    new,
                })
            }
            b'D' => {
                let mut r = Reader::new(body, "Delete");
                let relation_oid = r.u32("relation OID")?;
                let old = match r.u8("tuple marker")? {
                    b'K' => OldTuple::Key(decode_tuple(&mut r)?),
                    b'O' => OldTuple::Full(decode_tuple(&mut r)?),
                    other => {
                        return Err(DecodeError::UnexpectedTupleMarker {
                            context: "Delete",
                            expected: "'K' or 'O'",
                            found: TagByte(other),
                        })
                    }
                };
                r.finish()?;
                PgoutputMessage::Delete(Delete { relation_oid, old })
            }
            b'T' => {
                let mut r = Reader::new(body, "Truncate");
                let count = r.u32("relation count")? as usize;
                let options = r.u8("options")?;
                let count = r.count(count, 4, "relation OIDs")?;
                let mut relation_oids = Vec::with_capacity(count);
                for _ in 0..count {
                    relation_oids.push(r.u32("relation OID")?);
                }
                r.finish()?;
                PgoutputMessage::Truncate(Truncate {
                    options,
                    relation_oids,
                })
            }
            b'M' => {
                let mut r = Reader::new(body, "logical decoding Message");
                let transactional = r.u8("flags")? & 1 != 0;
                let lsn = Lsn(r.u64("message LSN")?);
                let prefix = r.cstr("prefix")?;
                let len = length(&mut r, "content")?;
                let content = r.take(len, "content")?;
                r.finish()?;
                PgoutputMessage::Message(LogicalMessage {
                    transactional,
                    lsn,
                    prefix,
                    content,
                })
            }
            other => {
                return Err(DecodeError::UnknownMessageTag {
                    tag: TagByte(other),
                })
            }
        };
        Ok(message)
    }
}

fn decode_relation(body: &[u8]) -> Result<Relation, DecodeError> {
    let mut r = Reader::new(body, "Relation");
    let oid = r.u32("relation OID")?;
    let namespace = r.cstr("namespace")?.to_owned();
    let name = r.cstr("relation name")?.to_owned();
    let replica_identity = ReplicaIdentity::from_byte(r.u8("replica identity")?)?;
    let count = usize::from(r.u16("column count")?);
    // Flags, an empty name's NUL, type OID and type modifier: at least 10 bytes per column.
    let count = r.count(count, 10, "columns")?;
    let mut columns = Vec::with_capacity(count);
    for _ in 0..count {
        columns.push(RelationColumn {
            flags: r.u8("column flags")?,
            name: r.cstr("column name")?.to_owned(),
            type_oid: r.u32("column type OID")?,
            type_modifier: r.i32("column type modifier")?,
        });
    }
    r.finish()?;
    Ok(Relation {
        oid,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn expect_marker(
    r: &mut Reader<'_>,
    marker: u8,
    expected: &'static str,
) -> Result<(), DecodeError> {
    let found = r.u8("tuple marker")?;
    if found == marker {
        Ok(())
    } else {
        Err(DecodeError::UnexpectedTupleMarker {
            context: "row",
            expected,
            found: TagByte(found),
        })
    }
}

fn length(r: &mut Reader<'_>, field: &'static str) -> Result<usize, DecodeError> {
    let len = r.i32(field)?;
    usize::try_from(len).map_err(|_| DecodeError::NegativeLength {
        context: "pgoutput",
        field,
        length: len,
    })
}

fn decode_tuple<'a>(r: &mut Reader<'a>) -> Result<Tuple<'a>, DecodeError> {
    let count = usize::from(r.u16("tuple column count")?);
    // Every column takes at least its one-byte kind.
    let count = r.count(count, 1, "tuple columns")?;
    let mut values = Vec::with_capacity(count);
    for column in 0..count {
        let value = match r.u8("column value kind")? {
            b'n' => TupleValue::Null,
            b'u' => TupleValue::UnchangedToast,
            b't' => {
                let len = length(r, "text value")?;
                TupleValue::Text(r.take(len, "text value")?)
            }
            b'b' => {
                let len = length(r, "binary value")?;
                TupleValue::Binary(r.take(len, "binary value")?)
            }
            other => {
                return Err(DecodeError::UnknownValueKind {
                    column,
                    found: TagByte(other),
                })
            }
        };
        values.push(value);
    }
    Ok(Tuple(values))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pgoutput::test_encoder::encode;
    use proptest::prelude::*;

    fn round_trip(message: PgoutputMessage<'_>) {
        let bytes = encode(&message);
        assert_eq!(PgoutputMessage::decode(&bytes).unwrap(), message);
        // Every strict prefix is an error, never a panic or a shorter message.
        for len in 0..bytes.len() {
            assert!(
                PgoutputMessage::decode(&bytes[..len]).is_err(),
                "prefix of {len} bytes of {message:?} decoded"
            );
        }
        // A byte too many is an error too.
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(PgoutputMessage::decode(&longer).is_err());
    }

    fn users() -> Relation {
        Relation {
            oid: 16385,
            namespace: "public".into(),
            name: "users".into(),
            replica_identity: ReplicaIdentity::Index,
            columns: vec![
                RelationColumn {
                    flags: 1,
                    name: "id".into(),
                    type_oid: 20,
                    type_modifier: -1,
                },
                RelationColumn {
                    flags: 0,
                    name: "name".into(),
                    type_oid: 1043,
                    type_modifier: 68,
                },
            ],
        }
    }

    #[test]
    fn begin_round_trips() {
        round_trip(PgoutputMessage::Begin(Begin {
            final_lsn: Lsn(0x16_B374_D848),
            commit_time: PgTimestamp(774_000_000_123_456),
            xid: 7331,
        }));
    }

    #[test]
    fn commit_round_trips() {
        round_trip(PgoutputMessage::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn(0x1A2B_3C4D),
            end_lsn: Lsn(0x1A2B_3C80),
            commit_time: PgTimestamp(-5),
        }));
    }

    #[test]
    fn origin_round_trips() {
        round_trip(PgoutputMessage::Origin(Origin {
            commit_lsn: Lsn(99),
            name: "pg_16390",
        }));
    }

    #[test]
    fn relation_round_trips_with_key_flags_and_replica_identity() {
        let relation = users();
        assert!(relation.columns[0].is_key());
        assert!(!relation.columns[1].is_key());
        round_trip(PgoutputMessage::Relation(relation));
        for identity in [
            ReplicaIdentity::Default,
            ReplicaIdentity::Nothing,
            ReplicaIdentity::Full,
            ReplicaIdentity::Index,
        ] {
            round_trip(PgoutputMessage::Relation(Relation {
                replica_identity: identity,
                columns: vec![],
                ..users()
            }));
        }
    }

    #[test]
    fn relation_with_unknown_replica_identity_is_rejected() {
        let mut bytes = encode(&PgoutputMessage::Relation(users()));
        // Tag, OID, "public\0", "users\0", then the identity byte.
        let at = 1 + 4 + 7 + 6;
        assert_eq!(bytes[at], b'i');
        bytes[at] = b'x';
        assert_eq!(
            PgoutputMessage::decode(&bytes),
            Err(DecodeError::UnknownReplicaIdentity {
                found: TagByte(b'x')
            })
        );
    }

    #[test]
    fn type_round_trips() {
        round_trip(PgoutputMessage::Type(PgType {
            oid: 16400,
            namespace: "public".into(),
            name: "mood".into(),
        }));
    }

    #[test]
    fn insert_round_trips_every_value_kind() {
        round_trip(PgoutputMessage::Insert(Insert {
            relation_oid: 16385,
            new: Tuple(vec![
                TupleValue::Text(b"1"),
                TupleValue::Null,
                TupleValue::UnchangedToast,
                TupleValue::Binary(&[0, 1, 2]),
                TupleValue::Text(b""),
            ]),
        }));
    }

    #[test]
    fn update_round_trips_without_key_with_key_and_with_old_row() {
        let new = Tuple(vec![TupleValue::Text(b"2"), TupleValue::Text(b"bob")]);
        round_trip(PgoutputMessage::Update(Update {
            relation_oid: 1,
            old: None,
            new: new.clone(),
        }));
        round_trip(PgoutputMessage::Update(Update {
            relation_oid: 1,
            old: Some(OldTuple::Key(Tuple(vec![
                TupleValue::Text(b"1"),
                TupleValue::Null,
            ]))),
            new: new.clone(),
        }));
        round_trip(PgoutputMessage::Update(Update {
            relation_oid: 1,
            old: Some(OldTuple::Full(Tuple(vec![
                TupleValue::Text(b"1"),
                TupleValue::Text(b"al"),
            ]))),
            new,
        }));
    }

    #[test]
    fn delete_round_trips_with_key_and_with_old_row() {
        round_trip(PgoutputMessage::Delete(Delete {
            relation_oid: 3,
            old: OldTuple::Key(Tuple(vec![TupleValue::Text(b"1"), TupleValue::Null])),
        }));
        round_trip(PgoutputMessage::Delete(Delete {
            relation_oid: 3,
            old: OldTuple::Full(Tuple(vec![TupleValue::Text(b"1"), TupleValue::Text(b"x")])),
        }));
    }

    #[test]
    fn delete_without_key_or_old_tuple_is_rejected() {
        let mut bytes = vec![b'D'];
        bytes.extend_from_slice(&3u32.to_be_bytes());
        bytes.push(b'N');
        bytes.extend_from_slice(&0u16.to_be_bytes());
        assert!(matches!(
            PgoutputMessage::decode(&bytes),
            Err(DecodeError::UnexpectedTupleMarker {
                found: TagByte(b'N'),
                ..
            })
        ));
    }

    #[test]
    fn truncate_round_trips_with_options() {
        let truncate = Truncate {
            options: 3,
            relation_oids: vec![16385, 16390],
        };
        assert!(truncate.cascade() && truncate.restart_identity());
        round_trip(PgoutputMessage::Truncate(truncate));
        round_trip(PgoutputMessage::Truncate(Truncate {
            options: 0,
            relation_oids: vec![],
        }));
    }

    #[test]
    fn logical_message_round_trips() {
        for transactional in [true, false] {
            round_trip(PgoutputMessage::Message(LogicalMessage {
                transactional,
                lsn: Lsn(0xABCD),
                prefix: "zero/0/ddl",
                content: br#"{"type":"ddlUpdate"}"#,
            }));
        }
    }

    #[test]
    fn hostile_counts_are_rejected_before_allocating() {
        // Truncate announcing 2^32 - 1 relations in a 6-byte body.
        let mut bytes = vec![b'T'];
        bytes.extend_from_slice(&u32::MAX.to_be_bytes());
        bytes.push(0);
        assert!(matches!(
            PgoutputMessage::decode(&bytes),
            Err(DecodeError::CountTooLarge { count, .. }) if count == u32::MAX as usize
        ));
        // Insert announcing 65535 columns with no column data.
        let mut bytes = vec![b'I'];
        bytes.extend_from_slice(&1u32.to_be_bytes());
        bytes.push(b'N');
        bytes.extend_from_slice(&u16::MAX.to_be_bytes());
        assert!(matches!(
            PgoutputMessage::decode(&bytes),
            Err(DecodeError::CountTooLarge { count: 65535, .. })
        ));
        // A text value claiming 2 GiB.
        let mut bytes = vec![b'I'];
        bytes.extend_from_slice(&1u32.to_be_bytes());
        bytes.push(b'N');
        bytes.extend_from_slice(&1u16.to_be_bytes());
        bytes.push(b't');
        bytes.extend_from_slice(&i32::MAX.to_be_bytes());
        assert!(matches!(
            PgoutputMessage::decode(&bytes),
            Err(DecodeError::Truncated { .. })
        ));
        // A negative length.
        let len = bytes.len();
        bytes[len - 4..].copy_from_slice(&(-1i32).to_be_bytes());
        assert!(matches!(
            PgoutputMessage::decode(&bytes),
            Err(DecodeError::NegativeLength { length: -1, .. })
        ));
    }

    #[test]
    fn unknown_tags_and_invalid_text_are_typed_errors() {
        assert_eq!(
            PgoutputMessage::decode(b"S\0\0\0\x01"),
            Err(DecodeError::UnknownMessageTag { tag: TagByte(b'S') })
        );
        let mut bytes = vec![b'O'];
        bytes.extend_from_slice(&1u64.to_be_bytes());
        bytes.extend_from_slice(b"\xff\xfe\0");
        assert!(matches!(
            PgoutputMessage::decode(&bytes),
            Err(DecodeError::InvalidUtf8 { .. })
        ));
        let mut bytes = vec![b'I'];
        bytes.extend_from_slice(&1u32.to_be_bytes());
        bytes.extend_from_slice(b"N\0\x01z");
        let err = PgoutputMessage::decode(&bytes).unwrap_err();
        assert_eq!(
            err,
            DecodeError::UnknownValueKind {
                column: 0,
                found: TagByte(b'z')
            }
        );
        assert!(err.to_string().starts_with("expected a column value kind"));
    }

    fn value() -> impl Strategy<Value = TupleValue<'static>> {
        prop_oneof![
            Just(TupleValue::Null),
            Just(TupleValue::UnchangedToast),
            proptest::collection::vec(any::<u8>(), 0..12)
                .prop_map(|v| TupleValue::Text(Vec::leak(v))),
            proptest::collection::vec(any::<u8>(), 0..12)
                .prop_map(|v| TupleValue::Binary(Vec::leak(v))),
        ]
    }

    fn tuple() -> impl Strategy<Value = Tuple<'static>> {
        proptest::collection::vec(value(), 0..6).prop_map(Tuple)
    }

    fn old_tuple() -> impl Strategy<Value = OldTuple<'static>> {
        prop_oneof![
            tuple().prop_map(OldTuple::Key),
            tuple().prop_map(OldTuple::Full)
        ]
    }

    fn text() -> impl Strategy<Value = &'static str> {
        "[a-z_0-9/ é]{0,10}".prop_map(|s| &*String::leak(s))
    }

    fn relation() -> impl Strategy<Value = Relation> {
        let column = (any::<u8>(), text(), any::<u32>(), any::<i32>()).prop_map(
            |(flags, name, type_oid, type_modifier)| RelationColumn {
                flags,
                name: name.into(),
                type_oid,
                type_modifier,
            },
        );
        let identity = prop_oneof![
            Just(ReplicaIdentity::Default),
            Just(ReplicaIdentity::Nothing),
            Just(ReplicaIdentity::Full),
            Just(ReplicaIdentity::Index),
        ];
        (
            any::<u32>(),
            text(),
            text(),
            identity,
            proptest::collection::vec(column, 0..5),
        )
            .prop_map(
                |(oid, namespace, name, replica_identity, columns)| Relation {
                    oid,
                    namespace: namespace.into(),
                    name: name.into(),
                    replica_identity,
                    columns,
                },
            )
    }

    fn message() -> impl Strategy<Value = PgoutputMessage<'static>> {
        prop_oneof![
            (any::<u64>(), any::<i64>(), any::<u32>()).prop_map(|(l, t, xid)| {
                PgoutputMessage::Begin(Begin {
                    final_lsn: Lsn(l),
                    commit_time: PgTimestamp(t),
                    xid,
                })
            }),
            (any::<u8>(), any::<u64>(), any::<u64>(), any::<i64>()).prop_map(|(f, c, e, t)| {
                PgoutputMessage::Commit(Commit {
                    flags: f,
                    commit_lsn: Lsn(c),
                    end_lsn: Lsn(e),
                    commit_time: PgTimestamp(t),
                })
            }),
            (any::<u64>(), text()).prop_map(|(l, name)| PgoutputMessage::Origin(Origin {
                commit_lsn: Lsn(l),
                name
            })),
            relation().prop_map(PgoutputMessage::Relation),
            (any::<u32>(), text(), text()).prop_map(|(oid, ns, name)| {
                PgoutputMessage::Type(PgType {
                    oid,
                    namespace: ns.into(),
                    name: name.into(),
                })
            }),
            (any::<u32>(), tuple()).prop_map(|(relation_oid, new)| {
                PgoutputMessage::Insert(Insert { relation_oid, new })
            }),
            (any::<u32>(), proptest::option::of(old_tuple()), tuple()).prop_map(
                |(relation_oid, old, new)| {
                    PgoutputMessage::Update(Update {
                        relation_oid,
                        old,
                        new,
                    })
                }
            ),
            (any::<u32>(), old_tuple()).prop_map(|(relation_oid, old)| {
                PgoutputMessage::Delete(Delete { relation_oid, old })
            }),
            (0u8..4, proptest::collection::vec(any::<u32>(), 0..5)).prop_map(
                |(options, relation_oids)| PgoutputMessage::Truncate(Truncate {
                    options,
                    relation_oids
                })
            ),
            (
                any::<bool>(),
                any::<u64>(),
                text(),
                proptest::collection::vec(any::<u8>(), 0..16)
            )
                .prop_map(|(transactional, l, prefix, content)| {
                    PgoutputMessage::Message(LogicalMessage {
                        transactional,
                        lsn: Lsn(l),
                        prefix,
                        content: Vec::leak(content),
                    })
                }),
        ]
    }

    proptest! {
        #[test]
        fn every_message_round_trips_through_the_encoder(message in message()) {
            let bytes = encode(&message);
            prop_assert_eq!(PgoutputMessage::decode(&bytes).unwrap(), message);
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = PgoutputMessage::decode(&bytes);
        }

        #[test]
        fn arbitrary_bodies_behind_each_tag_never_panic(
            tag in prop::sample::select(b"BCORYIUDTM".to_vec()),
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut bytes = vec![tag];
            bytes.extend_from_slice(&body);
            let _ = PgoutputMessage::decode(&bytes);
        }

        #[test]
        fn mutated_valid_messages_never_panic(message in message(), at: usize, byte: u8) {
            let mut bytes = encode(&message);
            let len = bytes.len();
            bytes[at % len] = byte;
            let _ = PgoutputMessage::decode(&bytes);
        }
    }
}
