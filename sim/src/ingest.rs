//! The ingest adapter: the host side of the engine's [`UpstreamSession`], as `serve` drives it.
//!
//! Every rule lives in the session: what is already stored (skipped), which LSN to confirm
//! to Postgres and when (a commit's end LSN once durable, a keepalive's WAL end between
//! transactions), restarts, and that a Relation message needs reconciling. This adapter only
//! carries out what the session asks: it answers [`Effect::ReconcileRelation`] with the
//! `create-table` / `add-column` changes the replica's schema lacks (the engine's
//! `upstream::relation_changes`, as the host's `replica::ddl` calls it), and hands the rest
//! back to the world as [`Ingested`] values.

use std::collections::BTreeMap;

use highwater_engine::change_stream::{Change, ColumnSpec, DownstreamMessage};
use highwater_engine::pgoutput::Relation;
use highwater_engine::upstream::{
    relation_changes, Effect, Input, MutationConfirms, SessionConfig, UpstreamSession,
};
use highwater_engine::watermark::{Lsn, Watermark};
use serde_json::Number;

use crate::upstream::INT4;

/// What the session asks of the rest of the server.
// Forwarded messages are the common case; boxing them would add an allocation each.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Ingested {
    /// Hand this message to the streamer.
    Forward(DownstreamMessage),
    /// Confirm this position to Postgres.
    Ack(Lsn),
    /// Between transactions: upstream sent everything before `watermark`.
    Idle(Watermark),
    /// A backfill may start now (between transactions, everything before it durable).
    BackfillDue,
    /// The sync-client mutations the transaction committing at `watermark` applied (its
    /// `highwater.confirm` messages): stored with it, handed on with its commit. Comes just
    /// before that transaction's commit is forwarded.
    Confirms(Watermark, Vec<(String, u64)>),
    Warn(String),
}

/// A defect to plant in the host's side, so tests can show that the simulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngestBug {
    /// Report every commit durable to the session as soon as it is forwarded, before it is
    /// stored (a host that acks early).
    AcksOnForward,
}

#[derive(Debug)]
pub struct Ingest {
    session: UpstreamSession,
    /// Replica schema as of the messages forwarded so far: table → columns.
    schema: BTreeMap<String, Vec<String>>,
    /// Schema changes of the open transaction, undone if it does not commit.
    open_ddl: Vec<(String, Option<String>)>,
    /// Mutations confirmed by transactions handed on and not committed yet, by the engine's
    /// rule (as the host's serve keeps them).
    confirms: MutationConfirms,
    pub bug: Option<IngestBug>,
}

impl Ingest {
    /// A session over a replica with `schema` whose newest durable commit is `stored`; the
    /// replication slot starts at `confirmed`.
    pub fn new(
        schema: BTreeMap<String, Vec<String>>,
        stored: Watermark,
        confirmed: Lsn,
        bug: Option<IngestBug>,
    ) -> Self {
        let config = SessionConfig {
            ddl_prefix: "highwater/ddl".to_owned(),
        };
        Ingest {
            session: UpstreamSession::new(config, stored, confirmed),
            schema,
            open_ddl: Vec::new(),
            confirms: MutationConfirms::default(),
            bug,
        }
    }

    /// A new replication session (the previous connection is gone).
    pub fn started(&mut self) -> Result<Vec<Ingested>, String> {
        self.run(Input::Started)
    }

    /// One CopyData frame of the replication stream.
    pub fn frame(&mut self, bytes: &[u8]) -> Result<Vec<Ingested>, String> {
        self.run(Input::WalData(bytes))
    }

    /// Every commit up to `watermark` is durable.
    pub fn stored(&mut self, watermark: Watermark) -> Result<Vec<Ingested>, String> {
        self.run(Input::Stored { watermark })
    }

    /// The host started the backfill [`Ingested::BackfillDue`] allowed.
    pub fn backfill_started(&mut self) -> Result<Vec<Ingested>, String> {
        self.run(Input::BackfillStarted)
    }

    /// One message of the running backfill.
    pub fn backfill(&mut self, message: DownstreamMessage) -> Result<Vec<Ingested>, String> {
        self.run(Input::Backfill(message))
    }

    /// The running backfill's stream ended (after its commit, or before it).
    pub fn backfill_ended(&mut self) -> Result<Vec<Ingested>, String> {
        self.run(Input::BackfillEnded)
    }

    /// A failed backfill's retry delay passed (the host's planner released it).
    pub fn retry_backfills(&mut self) -> Result<Vec<Ingested>, String> {
        self.run(Input::RetryBackfills)
    }

    /// Whether upstream frames may be fed now.
    pub fn accepts_upstream(&self) -> bool {
        self.session.accepts_upstream()
    }

    pub fn backfill_running(&self) -> bool {
        self.session.backfill_running()
    }

    /// The newest commit handed on: a backfill's position.
    pub fn last_commit(&self) -> Watermark {
        self.session.last_commit().clone()
    }

    fn run(&mut self, input: Input<'_>) -> Result<Vec<Ingested>, String> {
        let mut out = Vec::new();
        let mut effects = self.session.handle(input).map_err(|e| e.to_string())?;
        while !effects.is_empty() {
            let mut next = Vec::new();
            for effect in effects {
                match effect {
                    Effect::Apply(message) => {
                        match &message {
                            DownstreamMessage::Begin(begin) => {
                                self.open_ddl.clear();
                                self.confirms.begin(&begin.commit_watermark);
                            }
                            DownstreamMessage::Commit(c) => {
                                self.open_ddl.clear();
                                let confirms = self.confirms.take(&c.watermark);
                                if !confirms.is_empty() {
                                    out.push(Ingested::Confirms(c.watermark.clone(), confirms));
                                }
                            }
                            // Its confirms go with the next commit taken (the engine's rule).
                            DownstreamMessage::Rollback(_) => self.undo_open_ddl(),
                            _ => {}
                        }
                        let early = match (&message, self.bug) {
                            (DownstreamMessage::Commit(c), Some(IngestBug::AcksOnForward)) => {
                                Some(c.watermark.clone())
                            }
                            _ => None,
                        };
                        out.push(Ingested::Forward(message));
                        if let Some(watermark) = early {
                            next.extend(
                                self.session
                                    .handle(Input::Stored { watermark })
                                    .map_err(|e| e.to_string())?,
                            );
                        }
                    }
                    // The simulated server forwards JSON rows; a text row is the same change.
                    Effect::ApplyText(change) => out.push(Ingested::Forward(
                        DownstreamMessage::Data(change.to_change()),
                    )),
                    Effect::Ack(lsn) => out.push(Ingested::Ack(lsn)),
                    Effect::ReconcileRelation(relation) => {
                        let changes = self.relation_changes(&relation);
                        next.extend(
                            self.session
                                .handle(Input::SchemaChanges(changes))
                                .map_err(|e| e.to_string())?,
                        );
                    }
                    Effect::ResolveDdl { .. } => {
                        return Err("a DDL event, which the simulated upstream never sends".into())
                    }
                    Effect::Confirmed {
                        client_id,
                        mutation_id,
                    } => self.confirms.confirmed(client_id, mutation_id),
                    Effect::Fence { .. } => {
                        return Err(
                            "a fence message, which the simulated upstream never sends".into()
                        )
                    }
                    Effect::Idle { watermark } => out.push(Ingested::Idle(watermark)),
                    Effect::BackfillDue => out.push(Ingested::BackfillDue),
                    Effect::AckFrames(_) | Effect::Reconnect { .. } => {
                        return Err("a relay effect from a Postgres source".into())
                    }
                    Effect::Warn(message) => out.push(Ingested::Warn(message)),
                }
            }
            effects = next;
        }
        Ok(out)
    }

    fn undo_open_ddl(&mut self) {
        for (table, column) in self.open_ddl.drain(..).rev() {
            match column {
                None => {
                    self.schema.remove(&table);
                }
                Some(column) => {
                    if let Some(cols) = self.schema.get_mut(&table) {
                        cols.retain(|c| *c != column);
                    }
                }
            }
        }
    }

    /// The engine's [`relation_changes`] against the schema forwarded so far (the simulated
    /// upstream has INT4 and TEXT columns, and keys its tables by their key flags), kept up to
    /// date with what it creates so the open transaction's are undone if it does not commit.
    fn relation_changes(&mut self, relation: &Relation) -> Vec<Change> {
        let name = relation.name.clone();
        // Columns the sim forwarded stand at positions 1, 2, … in the order it learned them.
        let known: Option<Vec<(&str, i64)>> = self
            .schema
            .get(&name)
            .map(|cols| cols.iter().map(String::as_str).zip(1..).collect());
        let changes = relation_changes(relation, known.as_deref(), None, |type_oid, pos| {
            ColumnSpec::new(
                Number::from(pos),
                if type_oid == INT4 { "int4" } else { "text" },
            )
        });
        for change in &changes {
            match change {
                Change::CreateTable(create) => {
                    let columns = create.spec.columns.keys().cloned().collect();
                    self.schema.insert(name.clone(), columns);
                    self.open_ddl.push((name.clone(), None));
                }
                Change::AddColumn(add) => {
                    let column = add.column.name.clone();
                    self.schema
                        .entry(name.clone())
                        .or_default()
                        .push(column.clone());
                    self.open_ddl.push((name.clone(), Some(column)));
                }
                _ => {}
            }
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use crate::upstream::{SimPg, EPOCH_UNIX_MS, TEXT};

    fn schema(pg: &SimPg) -> BTreeMap<String, Vec<String>> {
        pg.tables
            .iter()
            .map(|(n, t)| {
                let cols = t
                    .relation()
                    .columns
                    .iter()
                    .map(|c| c.name.clone())
                    .collect();
                (n.clone(), cols)
            })
            .collect()
    }

    fn tags(items: &[Ingested]) -> Vec<String> {
        items
            .iter()
            .filter_map(|i| match i {
                Ingested::Forward(DownstreamMessage::Data(c)) => Some(c.tag().to_owned()),
                Ingested::Forward(DownstreamMessage::Begin(_)) => Some("begin".to_owned()),
                Ingested::Forward(DownstreamMessage::Commit(_)) => Some("commit".to_owned()),
                _ => None,
            })
            .collect()
    }

    fn drain(pg: &mut SimPg, ingest: &mut Ingest) -> Vec<Ingested> {
        let mut out = Vec::new();
        while let Some(frame) = pg.next_frame() {
            out.extend(ingest.frame(&frame).expect("accepted"));
        }
        out
    }

    #[test]
    fn an_added_column_is_reconciled_once_and_a_resent_stored_transaction_is_skipped() {
        let mut rng = Rng::new(11);
        let mut pg = SimPg::new(&mut rng);
        let mut ingest = Ingest::new(schema(&pg), SimPg::replica_version(), pg.confirmed, None);
        pg.add_column("todos", "extra", TEXT);
        pg.create_unscoped_table("events");
        for i in 0..6 {
            pg.transaction(&mut rng, 4, EPOCH_UNIX_MS + i);
        }
        pg.start_replication();
        let items = drain(&mut pg, &mut ingest);
        let seen = tags(&items);
        let adds = seen.iter().filter(|t| *t == "add-column").count();
        let creates = seen.iter().filter(|t| *t == "create-table").count();
        assert_eq!(adds, 1, "{seen:?}");
        assert_eq!(creates, 1, "{seen:?}");
        // Nothing is confirmed before it is durable.
        assert!(!items.iter().any(|i| matches!(i, Ingested::Ack(_))));
        let first = pg.wal[0].clone();
        let acks = ingest.stored(first.watermark()).expect("accepted");
        assert!(
            acks.iter()
                .any(|i| matches!(i, Ingested::Ack(lsn) if *lsn == first.end_lsn)),
            "{acks:?}"
        );
        // A new session from the commit LSN re-sends the first transaction: skipped whole.
        pg.confirmed = first.commit_lsn;
        ingest.started().expect("accepted");
        pg.start_replication();
        let again = tags(&drain(&mut pg, &mut ingest));
        assert!(again.is_empty(), "{again:?}");
    }

    #[test]
    fn a_write_is_applied_once_and_its_confirm_comes_just_before_its_commit() {
        let mut rng = Rng::new(5);
        let mut pg = SimPg::new(&mut rng);
        let mut ingest = Ingest::new(schema(&pg), SimPg::replica_version(), pg.confirmed, None);
        let row = serde_json::json!({"id": 1_000_000, "owner": "ada", "title": "w"});
        let row = row.as_object().cloned().unwrap_or_default();
        let applied = pg.apply_mutation("client0", 1, "todos", &row, EPOCH_UNIX_MS);
        assert_eq!(applied, Ok(crate::upstream::Applied::Now));
        let again = pg.apply_mutation("client0", 1, "todos", &row, EPOCH_UNIX_MS);
        assert_eq!(again, Ok(crate::upstream::Applied::Before));
        assert_eq!(pg.applied, [("client0".to_owned(), 1)]);
        pg.start_replication();
        let items = drain(&mut pg, &mut ingest);
        let at = items
            .iter()
            .position(
                |i| matches!(i, Ingested::Confirms(_, c) if *c == [("client0".to_owned(), 1)]),
            )
            .expect("a confirm");
        assert!(
            matches!(&items[at + 1], Ingested::Forward(DownstreamMessage::Commit(c)) if c.watermark == pg.wal[0].watermark()),
            "{items:?}"
        );
    }
}
