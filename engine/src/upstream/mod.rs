//! The upstream session: every rule for consuming one change source — a Postgres replication
//! stream (pgoutput) or, for a relay, a primary's change stream — in one sans-IO state machine.
//! `replicate`, `serve` and a relay's follower all drive an [`UpstreamSession`]; the host only
//! turns its socket into [`Input`]s and carries out the [`Effect`]s that come back.
//!
//! The session decides:
//!
//! * **what is already stored**: a transaction whose commit is at or below the newest commit
//!   handed on (or, at start, stored) is sent again after a reconnect; it is skipped whole, and
//!   only its confirmation is kept;
//! * **what to confirm upstream, and when**: Postgres is told a commit's *end* LSN (taken from
//!   the pgoutput Commit message) once that commit is durable, and a keepalive's WAL end once it
//!   arrived between transactions and every commit before it is durable; confirmations never
//!   run ahead of storage nor backwards. A relay acknowledges each frame of its primary once
//!   every transaction the frame carried a message of is durable or rolled back, once each, in
//!   id order. A `skipAck` commit (a backfill's) is stored like any other and confirms nothing;
//! * **how DDL is followed**: a `<app>/ddl` logical message (the event trigger's, when the
//!   upstream has one) and a Relation message (always sent before a table's first row in a
//!   session, and after its schema changed) both ask the host to resolve schema changes, at that
//!   point of the transaction, before the rows that follow. With the event trigger the DDL
//!   message brings the replica up to date and the later Relation message finds nothing to do;
//!   without one (a non-superuser upstream) the Relation message does the work;
//! * **restarts**: a new session drops the transaction in flight (the source sends it again from
//!   its beginning) and forgets the relation cache;
//! * **when a backfill may start**: between transactions, with everything before it durable.
//!
//! # What the host does with each effect
//!
//! Carry effects out **in order**, before feeding the next input:
//!
//! * [`Effect::Apply`]: hand the message on to storage (`replicate`: apply it to the replica;
//!   `serve`: give it to the streamer, whose stores go to the replica and change log). When the
//!   message is a `commit`, report [`Input::Stored`] with its watermark once it is durable —
//!   later is fine (several transactions committed as one storage transaction report only the
//!   last: every commit at or below a durable watermark is durable).
//! * [`Effect::ApplyText`]: the same for a row change whose values kept their text (a session
//!   told to [`keep_row_text`](UpstreamSession::keep_row_text): `replicate`, whose replica
//!   takes them as they are, with no JSON row in between).
//! * [`Effect::Ack`]: confirm the LSN to Postgres (standby status update, flush position).
//! * [`Effect::AckFrames`]: send `{"ack":id}` to the primary for each id, in order.
//! * [`Effect::ResolveDdl`] / [`Effect::ReconcileRelation`]: with every earlier `Apply` carried
//!   out (so the replica's schema is current), compute the schema changes the DDL event or the
//!   Relation message implies against the replica's schema (and upstream's catalog), and feed
//!   them back as [`Input::SchemaChanges`] — empty when there are none — before any other
//!   input. The session hands them on with `Apply` at that point of the transaction.
//! * [`Effect::Idle`]: the source has nothing more before `watermark` and no transaction is
//!   open (`serve` tells the streamer, which may restart the source at this boundary).
//! * [`Effect::BackfillDue`]: a backfill may start now. If the replica waits for one, start it
//!   and feed [`Input::BackfillStarted`], then its messages as [`Input::Backfill`] and
//!   [`Input::BackfillEnded`] when its stream ends; feed no upstream input meanwhile
//!   ([`UpstreamSession::accepts_upstream`]). It is due again after each commit; a host
//!   whose backfill failed feeds [`Input::RetryBackfills`] when its retry delay has passed,
//!   as a quiet database brings no commit.
//! * [`Effect::Reconnect`]: the primary refused or failed this subscription: acknowledge its
//!   `acks` (the primary closes once its error is acknowledged), close the connection and
//!   connect again after a backoff, or, with `restore`, restore the replica from a new snapshot
//!   first. Feed [`Input::Started`] for the new connection.
//! * [`Effect::Confirmed`]: record that the open transaction applies this sync client's
//!   mutation, in the storage transaction of its data, and hand it on with its commit (scope
//!   sync answers the mutation once that commit is routed).
//! * [`Effect::Fence`]: once every `Apply` before it is stored where readers of the replica
//!   see it (committed, not necessarily durable), release whoever waits for its nonce.
//! * [`Effect::Warn`]: worth a log line.
//!
//! Liveness (status updates due, silence limits) belongs to the transport that owns the socket
//! and is decided by [`Liveness`] with plain `now_ms` values: a status update must go out even
//! while storage is slow and the session is not being fed.
//!
//! Group commit ([`GroupCommit`]): the host may apply several transactions' `Apply`s in one
//! storage transaction and report one [`Input::Stored`] for the last commit; the session then
//! confirms that commit's end LSN (and releases every frame those transactions touched) at once.
//! [`GroupCommit`] decides when a group closes, and that an open group never waits for input
//! that may not come.
//!
//! The host's ingest loop around the session follows the engine's ingest rules too: which input
//! it takes first ([`Wake`], [`Listen`]), when to hold a transaction whole and when to spill it
//! ([`Hold`]), and what becomes of the open group and transaction at a stop ([`StopPlan`]).

mod ack;
mod confirms;
mod frames;
mod group;
mod ingest;
mod liveness;
mod reconcile;
mod schema_diff;

#[cfg(test)]
mod tests;

use crate::change_stream::{Begin, Change, Commit, DownstreamMessage, ErrorKind, Rollback};
use crate::pgoutput::{MappingError, PgoutputEvent, PgoutputMapper, Relation, TextRowChange};
use crate::scope_sync::{parse_confirm_message, CONFIRM_MESSAGE_PREFIX};
use crate::watermark::{Lsn, Watermark};
use ack::AckQueue;
use frames::FrameAcks;

pub use confirms::MutationConfirms;
pub use group::{
    outgrows_hold, DurableGroup, GroupCommit, GroupDecision, GroupLimits, SyncDecision, HOLD_BYTES,
    HOLD_MESSAGES,
};
pub use ingest::{
    carried_at_stop, Ending, Hold, HoldError, Listen, StopPlan, TxnCommit, TxnEnd, Wake,
};
pub use liveness::Liveness;
pub use reconcile::relation_changes;
pub use schema_diff::{is_key_index, schema_changes, KnownTable, PublishedTable};

/// Settings of an [`UpstreamSession`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// The prefix of the event trigger's DDL messages (`<app>/ddl`).
    pub ddl_prefix: String,
}

/// What the host feeds in.
// Frames and messages are the common inputs; boxing them would add an allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Input<'a> {
    /// A new session: the replication stream (re)started, or a new connection to the primary.
    Started,
    /// One CopyData payload of the replication stream (XLogData or a primary keepalive).
    WalData(&'a [u8]),
    /// One frame from the primary (a relay): its id and the messages it carries.
    RelayFrame {
        id: u64,
        messages: Vec<DownstreamMessage>,
    },
    /// Every commit up to `watermark` is durable.
    Stored { watermark: Watermark },
    /// The answer to [`Effect::ResolveDdl`] or [`Effect::ReconcileRelation`].
    SchemaChanges(Vec<Change>),
    /// The host started the backfill [`Effect::BackfillDue`] allowed.
    BackfillStarted,
    /// A message of the running backfill.
    Backfill(DownstreamMessage),
    /// The running backfill's stream ended (after its commit, or failed before it).
    BackfillEnded,
    /// A backfill that failed may be tried again now, with no upstream commit since (a quiet
    /// database has none): [`Effect::BackfillDue`] follows as soon as one may start.
    RetryBackfills,
}

/// What the host must do; see the module documentation.
// `Apply` is the common effect; boxing its message would add an allocation per message.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Store (and forward) this message; report [`Input::Stored`] for a commit once durable.
    Apply(DownstreamMessage),
    /// Store this row change, in the transaction of the `Apply`s around it: a `data` message
    /// whose values kept their text, from a session that
    /// [keeps row text](UpstreamSession::keep_row_text) (`TextRowChange::to_change` is that
    /// message).
    ApplyText(TextRowChange),
    /// Confirm this LSN to Postgres.
    Ack(Lsn),
    /// Acknowledge these frames of the primary, in order.
    AckFrames(Vec<u64>),
    /// Turn this DDL event (the logical message's content) into schema changes: the published
    /// schema it carries against the replica's ([`schema_changes`]).
    ResolveDdl {
        content: Vec<u8>,
    },
    /// Create what this Relation message shows and the replica lacks ([`relation_changes`]).
    ReconcileRelation(Relation),
    /// Between transactions: the source has sent everything before `watermark`.
    Idle {
        watermark: Watermark,
    },
    /// A backfill may start now.
    BackfillDue,
    /// Acknowledge `acks` (the primary waits for them to close), then end this connection to
    /// the primary and connect again (after restoring the replica from a new snapshot with
    /// `restore`).
    Reconnect {
        reason: String,
        restore: bool,
        acks: Vec<u64>,
    },
    /// The open transaction applies mutation `mutation_id` of sync client `client_id` (a
    /// `highwater.confirm` logical message in it): store that with the transaction's data, in
    /// the same storage transaction, and hand it on with the transaction's commit.
    Confirmed {
        client_id: String,
        mutation_id: u64,
    },
    /// A fence (a `highwater.fence` logical message, `nonce` its content): every transaction
    /// committed upstream before it has been handed on. Once they are all stored where the
    /// replica's readers see them, tell whoever waits for `nonce`.
    Fence {
        nonce: String,
    },
    Warn(String),
}

/// The prefix of the logical message a writer emits, outside its transaction, to learn when
/// the replica holds every transaction committed before it ([`Effect::Fence`]).
pub const FENCE_MESSAGE_PREFIX: &str = "highwater.fence";

/// Input the session cannot take; the source cannot continue as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    #[error("cannot map the replication stream: {0}")]
    Mapping(#[from] MappingError),
    #[error("expected {expected}, found {found}")]
    Unexpected { expected: String, found: String },
}

fn unexpected(expected: impl Into<String>, found: impl Into<String>) -> SessionError {
    SessionError::Unexpected {
        expected: expected.into(),
        found: found.into(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Upstream,
    Backfill,
}

#[derive(Debug, Clone)]
struct OpenTx {
    watermark: Watermark,
    /// Already stored: nothing of it is handed on.
    skip: bool,
    skip_ack: bool,
    origin: Origin,
}

/// What the session waits for from the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Awaiting {
    SchemaChanges,
}

/// One change source's session. See the module documentation.
#[derive(Debug, Clone)]
pub struct UpstreamSession {
    config: SessionConfig,
    mapper: PgoutputMapper,
    /// Row changes of the replication stream go out as [`Effect::ApplyText`].
    row_text: bool,
    frames: FrameAcks,
    acks: AckQueue,
    tx: Option<OpenTx>,
    /// The newest commit handed on (or stored, at start).
    last_commit: Watermark,
    awaiting: Option<Awaiting>,
    backfill_running: bool,
    /// A backfill may be waiting (at start, and after every commit).
    backfill_due: bool,
    /// The primary confirmed this connection's subscription (its first status).
    subscribed: bool,
    /// The primary sent an error on this connection: nothing more of it is used.
    refused: bool,
}

impl UpstreamSession {
    /// A session over storage whose newest durable commit is `stored`; `acked` is the position
    /// the source was started from (confirmations only move past it).
    pub fn new(config: SessionConfig, stored: Watermark, acked: Lsn) -> Self {
        UpstreamSession {
            config,
            mapper: PgoutputMapper::new(),
            row_text: false,
            frames: FrameAcks::new(stored.clone()),
            acks: AckQueue::new(stored.clone(), acked),
            tx: None,
            last_commit: stored,
            awaiting: None,
            backfill_running: false,
            backfill_due: true,
            subscribed: false,
            refused: false,
        }
    }

    /// From now on, the replication stream's inserts, updates and deletes go out as
    /// [`Effect::ApplyText`], their values kept as Postgres' text, for a store that takes them
    /// as they are; nothing else about the session changes. A relay's frames are unaffected.
    pub fn keep_row_text(&mut self) {
        self.row_text = true;
        self.mapper.keep_row_text();
    }

    /// The newest commit handed on.
    pub fn last_commit(&self) -> &Watermark {
        &self.last_commit
    }

    /// The newest commit reported durable.
    pub fn stored(&self) -> &Watermark {
        self.acks.stored()
    }

    /// The newest LSN confirmed to Postgres.
    pub fn acked(&self) -> Lsn {
        self.acks.acked()
    }

    /// Whether a transaction (upstream's or a backfill's) is open.
    pub fn in_transaction(&self) -> bool {
        self.tx.is_some() || self.mapper.in_transaction()
    }

    /// Whether the open transaction is being skipped (already stored).
    pub fn skipping(&self) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.skip)
    }

    pub fn backfill_running(&self) -> bool {
        self.backfill_running
    }

    /// Whether the host may feed upstream input now (no backfill running, no schema changes
    /// outstanding).
    pub fn accepts_upstream(&self) -> bool {
        !self.backfill_running && self.awaiting.is_none()
    }

    /// Takes one input; returns the effects to carry out, in order. Rejected input leaves the
    /// source unusable: restart it (feed [`Input::Started`] for the new session).
    pub fn handle(&mut self, input: Input<'_>) -> Result<Vec<Effect>, SessionError> {
        let mut out = Vec::new();
        match input {
            Input::Started => self.started(&mut out)?,
            Input::WalData(bytes) => {
                self.check_upstream_input("a replication frame")?;
                self.wal_data(bytes, &mut out)?;
            }
            Input::RelayFrame { id, messages } => {
                self.check_upstream_input("a frame from the primary")?;
                self.relay_frame(id, messages, &mut out)?;
            }
            Input::Stored { watermark } => {
                if let Some(lsn) = self.acks.stored_through(watermark.clone()) {
                    out.push(Effect::Ack(lsn));
                }
                self.frames.on_durable(watermark);
                self.release_frames(&mut out);
            }
            Input::SchemaChanges(changes) => {
                if self.awaiting != Some(Awaiting::SchemaChanges) {
                    return Err(unexpected(
                        "schema changes only after a DDL event or Relation message asked for them",
                        format!("{} schema changes", changes.len()),
                    ));
                }
                self.awaiting = None;
                out.extend(
                    changes
                        .into_iter()
                        .map(|change| Effect::Apply(DownstreamMessage::Data(change))),
                );
            }
            Input::BackfillStarted => {
                if self.backfill_running || self.in_transaction() || self.awaiting.is_some() {
                    return Err(unexpected(
                        "a backfill to start only between transactions, when it was due",
                        "a backfill started inside a transaction or beside another",
                    ));
                }
                self.backfill_running = true;
                self.backfill_due = false;
            }
            Input::Backfill(message) => {
                if !self.backfill_running {
                    return Err(unexpected(
                        "backfill messages only while a backfill runs",
                        format!("a backfill {}", message_tag(&message)),
                    ));
                }
                self.message(message, Origin::Backfill, None, &mut out)?;
            }
            Input::BackfillEnded => {
                if let Some(tx) = self.tx.as_ref().filter(|tx| tx.origin == Origin::Backfill) {
                    let skip = tx.skip;
                    self.tx = None;
                    if !skip {
                        out.push(Effect::Apply(DownstreamMessage::Rollback(
                            Rollback::default(),
                        )));
                    }
                    if let Some(lsn) = self.acks.rollback() {
                        out.push(Effect::Ack(lsn));
                    }
                }
                self.backfill_running = false;
                self.backfill_due = true;
            }
            Input::RetryBackfills => self.backfill_due = true,
        }
        self.check_backfill_due(&mut out);
        Ok(out)
    }

    fn check_upstream_input(&self, what: &str) -> Result<(), SessionError> {
        if self.backfill_running {
            return Err(unexpected(
                "no upstream input while a backfill runs",
                what.to_owned(),
            ));
        }
        if self.awaiting.is_some() {
            return Err(unexpected(
                "the schema changes asked for before more upstream input",
                what.to_owned(),
            ));
        }
        Ok(())
    }

    fn started(&mut self, out: &mut Vec<Effect>) -> Result<(), SessionError> {
        if self.backfill_running || self.awaiting.is_some() {
            return Err(unexpected(
                "a new upstream session between transactions of the host",
                "one while a backfill ran or schema changes were outstanding",
            ));
        }
        if let Some(tx) = self.tx.take() {
            // Sent again from its beginning by the new session.
            if !tx.skip {
                out.push(Effect::Apply(DownstreamMessage::Rollback(
                    Rollback::default(),
                )));
            }
        }
        self.mapper = PgoutputMapper::new();
        if self.row_text {
            self.mapper.keep_row_text();
        }
        self.acks.restarted();
        self.frames = FrameAcks::new(self.acks.stored().clone());
        self.subscribed = false;
        self.refused = false;
        Ok(())
    }

    fn wal_data(&mut self, bytes: &[u8], out: &mut Vec<Effect>) -> Result<(), SessionError> {
        let Some(event) = self.mapper.map_frame(bytes)? else {
            return Ok(());
        };
        match event {
            PgoutputEvent::Downstream(message) => {
                self.message(message, Origin::Upstream, None, out)?
            }
            PgoutputEvent::Commit { commit, end_lsn } => self.message(
                DownstreamMessage::Commit(commit),
                Origin::Upstream,
                Some(end_lsn),
                out,
            )?,
            PgoutputEvent::Keepalive(keepalive) => {
                let in_transaction = self.in_transaction();
                if let Some(lsn) = self.acks.keepalive(keepalive.wal_end, in_transaction) {
                    out.push(Effect::Ack(lsn));
                }
                if !in_transaction {
                    out.push(Effect::Idle {
                        watermark: keepalive.watermark,
                    });
                }
            }
            PgoutputEvent::LogicalMessage(message) => {
                if message.prefix == self.config.ddl_prefix && self.in_live_transaction() {
                    self.awaiting = Some(Awaiting::SchemaChanges);
                    out.push(Effect::ResolveDdl {
                        content: message.content,
                    });
                } else if message.prefix == CONFIRM_MESSAGE_PREFIX && self.in_live_transaction() {
                    match parse_confirm_message(&message.content) {
                        Some((client_id, mutation_id)) => out.push(Effect::Confirmed {
                            client_id,
                            mutation_id,
                        }),
                        None => out.push(Effect::Warn(format!(
                            "ignoring a {CONFIRM_MESSAGE_PREFIX} message that is not \
                             {{\"clientId\": \"…\", \"mutationId\": N}}: {}",
                            String::from_utf8_lossy(&message.content)
                        ))),
                    }
                } else if message.prefix == FENCE_MESSAGE_PREFIX && !self.skipping() {
                    out.push(Effect::Fence {
                        nonce: String::from_utf8_lossy(&message.content).into_owned(),
                    });
                }
            }
            PgoutputEvent::RowText(change) => {
                if self.data_is_live(change.tag())? {
                    out.push(Effect::ApplyText(change));
                }
            }
            PgoutputEvent::Relation { relation, .. } => {
                // A skipped transaction shows the schema of its time, older than storage's.
                if self.in_live_transaction() {
                    self.awaiting = Some(Awaiting::SchemaChanges);
                    out.push(Effect::ReconcileRelation(relation));
                }
            }
        }
        Ok(())
    }

    /// Whether a row or schema change (of wire tag `tag`) is to be applied: inside a
    /// transaction that is not skipped. Outside any transaction it is refused.
    fn data_is_live(&self, tag: &str) -> Result<bool, SessionError> {
        match &self.tx {
            Some(tx) => Ok(!tx.skip),
            None => Err(unexpected(
                "row and schema changes inside a transaction",
                format!("{tag} outside one"),
            )),
        }
    }

    fn in_live_transaction(&self) -> bool {
        self.tx.as_ref().is_some_and(|tx| !tx.skip)
    }

    fn relay_frame(
        &mut self,
        id: u64,
        messages: Vec<DownstreamMessage>,
        out: &mut Vec<Effect>,
    ) -> Result<(), SessionError> {
        if self.refused {
            return Ok(());
        }
        self.frames.on_frame(id, &messages);
        for message in messages {
            match message {
                // The first status confirms the subscription; it is the relay's alone.
                DownstreamMessage::Status(_) if !self.subscribed => self.subscribed = true,
                DownstreamMessage::Error(error) => {
                    // Acknowledged so the primary can close; nothing after it is used.
                    self.refused = true;
                    let acks = self.frames.release();
                    let reason = format!(
                        "{} (error type {})",
                        error.message.as_deref().unwrap_or("no message"),
                        error.error_type
                    );
                    let restore = matches!(
                        error.kind(),
                        Some(ErrorKind::WrongReplicaVersion | ErrorKind::WatermarkTooOld)
                    );
                    out.push(Effect::Reconnect {
                        reason,
                        restore,
                        acks,
                    });
                    return Ok(());
                }
                DownstreamMessage::Reserved(_) => out.push(Effect::Warn(
                    "ignoring a snapshot reservation answer inside the change stream".to_owned(),
                )),
                message => {
                    if matches!(message, DownstreamMessage::Begin(_)) {
                        self.subscribed = true;
                    }
                    self.message(message, Origin::Upstream, None, out)?;
                }
            }
        }
        self.release_frames(out);
        Ok(())
    }

    fn release_frames(&mut self, out: &mut Vec<Effect>) {
        let ids = self.frames.release();
        if !ids.is_empty() {
            out.push(Effect::AckFrames(ids));
        }
    }

    /// One change-stream message of `origin`; `end` is a pgoutput commit's end LSN.
    fn message(
        &mut self,
        message: DownstreamMessage,
        origin: Origin,
        end: Option<Lsn>,
        out: &mut Vec<Effect>,
    ) -> Result<(), SessionError> {
        match message {
            DownstreamMessage::Begin(begin) => self.begin(begin, origin, out),
            DownstreamMessage::Data(change) => {
                if self.data_is_live(change.tag())? {
                    out.push(Effect::Apply(DownstreamMessage::Data(change)));
                }
                Ok(())
            }
            DownstreamMessage::Commit(commit) => self.commit(commit, end, out),
            DownstreamMessage::Rollback(rollback) => {
                let Some(tx) = self.tx.take() else {
                    return Err(unexpected(
                        "a rollback inside a transaction",
                        "one outside any",
                    ));
                };
                if !tx.skip {
                    out.push(Effect::Apply(DownstreamMessage::Rollback(rollback)));
                }
                if let Some(lsn) = self.acks.rollback() {
                    out.push(Effect::Ack(lsn));
                }
                Ok(())
            }
            DownstreamMessage::Status(status) => {
                out.push(Effect::Apply(DownstreamMessage::Status(status)));
                Ok(())
            }
            other => Err(unexpected(
                "a change-stream message from the change source",
                message_tag(&other),
            )),
        }
    }

    fn begin(
        &mut self,
        begin: Begin,
        origin: Origin,
        out: &mut Vec<Effect>,
    ) -> Result<(), SessionError> {
        if let Some(open) = &self.tx {
            return Err(unexpected(
                format!(
                    "the transaction at {} to end before another begins",
                    open.watermark
                ),
                format!("a begin for {}", begin.commit_watermark),
            ));
        }
        // Stored (or handed on) before the source restarted, confirmed too late for the
        // source to leave it out: nothing to store again.
        let skip = begin.commit_watermark <= self.last_commit;
        self.tx = Some(OpenTx {
            watermark: begin.commit_watermark.clone(),
            skip,
            skip_ack: begin.skip_ack == Some(true),
            origin,
        });
        if !skip {
            out.push(Effect::Apply(DownstreamMessage::Begin(begin)));
        }
        Ok(())
    }

    fn commit(
        &mut self,
        commit: Commit,
        end: Option<Lsn>,
        out: &mut Vec<Effect>,
    ) -> Result<(), SessionError> {
        let Some(tx) = self.tx.take() else {
            return Err(unexpected(
                "a commit inside a transaction",
                format!("a commit at {} outside any", commit.watermark),
            ));
        };
        if commit.watermark != tx.watermark {
            let found = format!("a commit at {}", commit.watermark);
            self.tx = Some(tx.clone());
            return Err(unexpected(
                format!("the commit of the transaction at {}", tx.watermark),
                found,
            ));
        }
        let watermark = commit.watermark.clone();
        if !tx.skip {
            out.push(Effect::Apply(DownstreamMessage::Commit(commit)));
            self.last_commit = watermark.clone();
        }
        let end = if tx.skip_ack { None } else { end };
        if let Some(lsn) = self.acks.commit(watermark, end) {
            out.push(Effect::Ack(lsn));
        }
        self.backfill_due = true;
        Ok(())
    }

    fn check_backfill_due(&mut self, out: &mut Vec<Effect>) {
        let ready = self.backfill_due
            && !self.backfill_running
            && !self.in_transaction()
            && self.awaiting.is_none()
            && !self.acks.waits_for_storage()
            && *self.acks.stored() >= self.last_commit;
        if ready {
            self.backfill_due = false;
            out.push(Effect::BackfillDue);
        }
    }
}

fn message_tag(message: &DownstreamMessage) -> String {
    match message {
        DownstreamMessage::Begin(_) => "begin".to_owned(),
        DownstreamMessage::Data(change) => change.tag().to_owned(),
        DownstreamMessage::Commit(_) => "commit".to_owned(),
        DownstreamMessage::Rollback(_) => "rollback".to_owned(),
        DownstreamMessage::Status(_) => "status".to_owned(),
        DownstreamMessage::Error(_) => "error".to_owned(),
        DownstreamMessage::Reserved(_) => "reserved".to_owned(),
    }
}
