//! Logical replication from Postgres.
//!
//! - [`setup`]: checks and objects on an ordinary connection (`wal_level`, `wal_sender_timeout`,
//!   the `<app>_pub` publication and `<app>_slot` slot).
//! - [`ReplicationConnection`]: a `replication=database` session: `IDENTIFY_SYSTEM`,
//!   `CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')`, `START_REPLICATION`.
//! - [`WalStream`]: the driver task that keeps a stream alive, bounded, acknowledged and resumed.
//! - [`initial_sync`]: the initial copy of the publications from a slot's exported snapshot
//!   (parallel `COPY … TO STDOUT` readers, `copy_text` parsing), handed to the replica's bulk
//!   load (`replica::load`), which writes it; [`bootstrap`] decides between a fresh sync and a
//!   resume.
//! - [`backfill`]: reads the rows of a table or column added to the publications from a
//!   snapshot, for the replica to merge.
//! - [`published_schema`]: the published schema as upstream's catalog describes it, the DDL
//!   event trigger that emits it into the WAL, and its events; `replica::ddl` applies what
//!   changed to the replica.
//!
//! This folder is the transport: everything that talks to upstream Postgres, and no SQLite.
//! The replica and the change log (`replica/`, `change_log/`) are SQLite only; what the
//! transport reads goes to them through their own APIs.
//!
//! The client is our own, on `postgres-protocol`'s message codec, rather than the
//! `pgwire-replication` crate, because that crate starts replication as part of connecting: it
//! has no `CREATE_REPLICATION_SLOT` with an exported snapshot (our initial copy needs one, on a
//! connection that then stays idle) and no `IDENTIFY_SYSTEM`; it reports server errors as text,
//! so slot-in-use (55006) and invalidated slots cannot be told apart by code; it sends status
//! updates on its own timer, where we need them tied to `wal_sender_timeout` and to the
//! consumer's durable acks; and it interprets pgoutput logical messages itself, while
//! `engine::pgoutput` must see every payload. The protocol surface we need is small.

pub mod backfill;
pub mod bootstrap;
mod connection;
pub(crate) mod copy_text;
mod error;
pub mod initial_sync;
pub(crate) mod published_schema;
pub mod setup;
mod stream;
pub(crate) mod tls;

pub(crate) use connection::PgConfig;
pub use connection::{ConnectParams, ReplicationConnection};
pub(crate) use error::PgErrorText;
pub use error::{ReplicationError, ServerError};
pub(crate) use stream::Acker;
pub use stream::{StreamConfig, WalEvent, WalStream};
