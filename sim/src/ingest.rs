//! The ingest adapter: replication frames in, what to hand the [`Streamer`] out. The one place
//! the simulation stands in for the engine's upstream session, so that switching to it is a
//! local change.
//!
//! What it does, as `serve`'s ingest does today: maps every CopyData frame with the engine's
//! [`PgoutputMapper`] (a new one per replication session); skips a transaction the change log
//! already holds (its commit at or below the last commit forwarded, re-sent after a restart);
//! turns a Relation message that names a table or column the replica lacks into
//! `create-table` / `add-column` changes at that point of the transaction (following DDL through
//! Relation messages, as `replicate` does); turns keepalives into
//! [`Streamer::on_keepalive`] calls; and tells Postgres an ack's commit LSN.
//!
//! [`Streamer`]: highwater_engine::streamer::Streamer
//! [`Streamer::on_keepalive`]: highwater_engine::streamer::Streamer::on_keepalive

use std::collections::BTreeMap;

use highwater_engine::change_stream::{
    AddColumn, Change, ColumnDef, ColumnSpec, CreateTable, DownstreamMessage, Identifier, TableSpec,
};
use highwater_engine::pgoutput::{PgoutputEvent, PgoutputMapper, Relation};
use highwater_engine::watermark::{Lsn, Watermark};
use indexmap::IndexMap;
use serde_json::Number;

use crate::upstream::INT4;

/// What one frame asks of the streamer.
// Forwarded messages are the common case; boxing them would add an allocation each.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Ingested {
    Forward(DownstreamMessage),
    Keepalive {
        watermark: Watermark,
        reply_requested: bool,
    },
}

/// A defect to plant in the adapter, so tests can show that the simulation catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IngestBug {
    /// Acknowledge every commit to Postgres as soon as it is forwarded, before it is stored.
    AcksOnForward,
}

#[derive(Debug)]
pub struct Ingest {
    mapper: PgoutputMapper,
    /// Replica schema as of the messages forwarded so far: table → columns.
    schema: BTreeMap<String, Vec<String>>,
    /// Schema changes of the open transaction, undone if it does not commit.
    open_ddl: Vec<(String, Option<String>)>,
    /// Inside a transaction that is already stored.
    skipping: bool,
    in_tx: bool,
    pub bug: Option<IngestBug>,
}

impl Ingest {
    /// A new replication session over a replica with `schema`.
    pub fn new(schema: BTreeMap<String, Vec<String>>, bug: Option<IngestBug>) -> Self {
        Ingest {
            mapper: PgoutputMapper::new(),
            schema,
            open_ddl: Vec::new(),
            skipping: false,
            in_tx: false,
            bug,
        }
    }

    /// A new replication session (the mapper's relation cache starts empty).
    pub fn restart(&mut self) {
        self.mapper = PgoutputMapper::new();
        self.rollback();
    }

    /// The open transaction will not commit: forget its schema changes.
    pub fn rollback(&mut self) {
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
        self.skipping = false;
        self.in_tx = false;
    }

    /// One CopyData frame; `last_commit` is the streamer's last commit forwarded.
    pub fn frame(
        &mut self,
        bytes: &[u8],
        last_commit: &Watermark,
    ) -> Result<Vec<Ingested>, String> {
        let Some(event) = self.mapper.map_frame(bytes).map_err(|e| e.to_string())? else {
            return Ok(Vec::new());
        };
        Ok(match event {
            PgoutputEvent::Keepalive(k) => vec![Ingested::Keepalive {
                watermark: k.watermark,
                reply_requested: k.reply_requested,
            }],
            PgoutputEvent::LogicalMessage(_) => Vec::new(),
            PgoutputEvent::Relation { relation, .. } => {
                if self.skipping || !self.in_tx {
                    Vec::new()
                } else {
                    self.relation_changes(&relation)
                        .into_iter()
                        .map(|c| Ingested::Forward(DownstreamMessage::Data(c)))
                        .collect()
                }
            }
            PgoutputEvent::Downstream(message) => match &message {
                DownstreamMessage::Begin(begin) => {
                    self.in_tx = true;
                    self.open_ddl.clear();
                    self.skipping = begin.commit_watermark <= *last_commit;
                    if self.skipping {
                        Vec::new()
                    } else {
                        vec![Ingested::Forward(message)]
                    }
                }
                DownstreamMessage::Commit(_) => {
                    self.in_tx = false;
                    self.open_ddl.clear();
                    if std::mem::take(&mut self.skipping) {
                        Vec::new()
                    } else {
                        vec![Ingested::Forward(message)]
                    }
                }
                _ if self.skipping => Vec::new(),
                _ => vec![Ingested::Forward(message)],
            },
        })
    }

    /// The LSN to confirm to Postgres for an ack of `watermark` (a commit's watermark is its
    /// commit LSN; a keepalive's is the WAL end it reported).
    pub fn ack_position(watermark: &Watermark) -> Option<Lsn> {
        watermark.to_lsn().ok()
    }

    fn relation_changes(&mut self, relation: &Relation) -> Vec<Change> {
        let spec = |type_oid: u32, pos: usize| {
            ColumnSpec::new(
                Number::from(pos as u64),
                if type_oid == INT4 { "int4" } else { "text" },
            )
        };
        let name = relation.name.clone();
        match self.schema.get_mut(&name) {
            None => {
                let columns: IndexMap<String, ColumnSpec> = relation
                    .columns
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (c.name.clone(), spec(c.type_oid, i + 1)))
                    .collect();
                let key = relation
                    .columns
                    .iter()
                    .filter(|c| c.is_key())
                    .map(|c| c.name.clone())
                    .collect();
                self.schema.insert(
                    name.clone(),
                    relation.columns.iter().map(|c| c.name.clone()).collect(),
                );
                self.open_ddl.push((name.clone(), None));
                vec![Change::CreateTable(CreateTable {
                    spec: TableSpec {
                        schema: relation.namespace.clone(),
                        name,
                        columns,
                        primary_key: Some(key),
                        extra: Default::default(),
                    },
                    metadata: None,
                    backfill: None,
                    extra: Default::default(),
                })]
            }
            Some(known) => {
                let mut out = Vec::new();
                for (i, c) in relation.columns.iter().enumerate() {
                    if known.contains(&c.name) {
                        continue;
                    }
                    known.push(c.name.clone());
                    self.open_ddl.push((name.clone(), Some(c.name.clone())));
                    out.push(Change::AddColumn(AddColumn {
                        table: Identifier::new(relation.namespace.clone(), name.clone()),
                        column: ColumnDef {
                            name: c.name.clone(),
                            spec: spec(c.type_oid, i + 1),
                            extra: Default::default(),
                        },
                        table_metadata: None,
                        backfill: None,
                        extra: Default::default(),
                    }));
                }
                out
            }
        }
    }
}
