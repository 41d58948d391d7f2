//! Postgres logical replication with the `pgoutput` plugin, protocol version 1.
//!
//! - [`ReplicationFrame`] decodes the CopyData framing (XLogData, primary keepalive);
//!   [`StandbyStatusUpdate`] encodes acknowledgements.
//! - [`PgoutputMessage`] decodes the pgoutput messages inside XLogData, borrowing from the input.
//! - [`RelationCache`] remembers Relation messages by OID.
//! - [`PgoutputMapper`] turns a session's frames into change-stream messages
//!   ([`crate::change_stream::DownstreamMessage`]), keepalives and logical messages; for a store
//!   that takes values as they are, row changes can keep their text instead ([`TextRowChange`]).
//!
//! Values arrive in Postgres TEXT format and are converted by type OID as Zero's replicator
//! expects (see `value.rs`). Date/time values must be printed with `DateStyle` ISO, so the
//! replication connection should set `-c datestyle=ISO`. Binary values (the `binary` option) are
//! decoded but not mapped: they are a typed [`MappingError::BinaryValue`].
//!
//! Everything here is pure: bytes in, values out. Malformed input is a typed error, never a panic.
//!
//! Protocol version 1 only: Postgres sends a transaction once it has committed, so a large
//! transaction reaches the consumer all at once, after its commit, and is decoded and stored
//! from then on. Streaming in-progress transactions (protocol version 2's `streaming` option,
//! Postgres 14+) is not built: the replica would have to hold a streamed transaction's rows
//! apart until its commit or abort. `BENCHMARKS.md`, section "Ingest: Postgres commit to
//! durable SQLite replica", measures what that costs (its `--mode live-shared` runs).

mod array;
mod datetime;
mod frame;
mod mapper;
mod message;
mod reader;
mod relation;
mod text_row;
mod value;

/// Encodes pgoutput messages and replication frames (tests, and the `testkit` feature for the
/// simulation).
#[cfg(any(test, feature = "testkit"))]
pub mod test_encoder;

pub use frame::{
    PgTimestamp, PrimaryKeepalive, ReplicationFrame, StandbyStatusUpdate, XLogData,
    PG_EPOCH_UNIX_MS,
};
pub use mapper::{EmittedMessage, Keepalive, MappingError, PgoutputEvent, PgoutputMapper};
pub use message::{
    Begin, Commit, DecodeError, Delete, Insert, LogicalMessage, OldTuple, Origin, PgType,
    PgoutputMessage, Relation, RelationColumn, ReplicaIdentity, TagByte, Truncate, Tuple,
    TupleValue, Update,
};
pub use relation::{RelationCache, UnknownRelation};
pub use text_row::{TextRow, TextRowChange, TextRowKind, TextValue};
pub use value::{ScalarText, TextColumn, TextRead};
