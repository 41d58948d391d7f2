//! The client's writes: an outbox of mutations, sent in order and kept until the server says
//! what became of each, and the optimistic rows they lay over the server's.
//!
//! Rules held here and nowhere else:
//! - A mutation gets the next id of the client (`clientId`, kept by the store with the last id
//!   given out) and is persisted ([`ClientEffect::PersistOutbox`]) in the same call that
//!   queues it; the store gives the outbox back on the next run ([`ClientInput::RestoreOutbox`]),
//!   and nothing is sent or laid over before it has.
//! - Built-in writes: on an open socket, one `mutate` frame of at most
//!   [`MAX_MUTATIONS_PER_FRAME`] mutations, oldest first, is out at a time; the next goes once
//!   its `mutation-result` came. A new socket sends the unanswered ones again (the server
//!   applies each once and answers a resend with what happened the first time).
//! - App-applied writes (`upload`): the host hands batches to the app
//!   ([`ClientEffect::Upload`]) and reports [`ClientInput::Uploaded`]; the uploaded ones are
//!   then awaited (`await-mutations`, again on every new socket) until the server has their
//!   change. A failed upload is tried again after a delay.
//! - A `retry` answer keeps the mutation and sends it again after a delay that doubles from
//!   1 s to 30 s; `confirmed` and `rejected` settle it ([`ClientEffect::Settled`]) and drop it.
//!   A rejected mutation never holds back the ones after it.
//! - Overlay: a scope shows its server rows with the pending mutations of its table laid over
//!   them in id order (an insert shows its row, an update merges its columns into the row held,
//!   a delete hides it; a row that no longer matches the scope's conditions is hidden). A
//!   mutation echoed in an envelope of the scope (`echoOrigin`) is no longer laid over that
//!   scope, in the same apply as the server's row: the row changes once, never disappears.
//!   Every change event reports the rows as shown.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::{Map, Value};

use super::{
    set_of, ChangedRow, ClientEffect, Link, Phase, RowChange, RowData, ScopeKey, ScopeSlot,
    SocketId, SyncClient,
};
use crate::scope_sync::{
    js_string_form, ClientFrame, Conditions, Echo, Mutation, MutationOp, MutationResult,
    MutationStatus, RowText, MAX_MUTATIONS_PER_FRAME,
};

/// The first and the longest delay before mutations answered `retry` are sent again.
const RETRY_FIRST_MS: u64 = 1_000;
const RETRY_MAX_MS: u64 = 30_000;

/// A mutation not settled yet.
#[derive(Debug, Clone)]
pub(super) struct Pending {
    pub(super) mutation: Mutation,
    /// The `resourceId` of its row (`None`: its row lacks a key column, so it is laid over
    /// nothing: an insert whose key Postgres makes).
    row_id: Option<String>,
    /// Scopes whose envelope echoed it: it is no longer laid over them.
    echoed: Scopes,
    /// Uploaded by the app (`upload`), awaiting its change.
    uploaded: bool,
    /// Confirmed while scopes of its table were not live (a re-subscribe after a lost socket
    /// or an expired token): it stays laid over those scopes until each is live again, so a
    /// confirmed write never leaves the rows shown. It is no longer pending otherwise.
    lingers: Option<Scopes>,
}

/// A few scopes (those of one table, at most every scope of the client), as a list: a set's
/// code for one more key type would cost the client's module kilobytes for no speed here.
#[derive(Debug, Clone, Default)]
pub(super) struct Scopes(Vec<ScopeKey>);

impl Scopes {
    fn insert(&mut self, key: ScopeKey) {
        if !self.contains(&key) {
            self.0.push(key);
        }
    }

    fn contains(&self, key: &ScopeKey) -> bool {
        self.0.contains(key)
    }

    /// Whether `key` was among them.
    fn remove(&mut self, key: &ScopeKey) -> bool {
        let before = self.0.len();
        self.0.retain(|k| k != key);
        self.0.len() != before
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The outbox and its sending state.
#[derive(Debug, Clone, Default)]
pub(super) struct Outbox {
    /// Set by [`ClientInput::RestoreOutbox`]; nothing is sent or laid over before.
    client_id: Option<String>,
    last_id: u64,
    pub(super) pending: BTreeMap<u64, Pending>,
    /// Pending mutation ids by table and `resourceId`: laying one row's overlay replays only
    /// the mutations of that row.
    by_row: HashMap<(String, String), BTreeSet<u64>>,
    /// The batch out (sent on that socket, or handed to `upload`), not answered yet.
    in_flight: Option<(Option<SocketId>, Vec<u64>)>,
    /// The socket the uploaded mutations were last awaited on.
    awaited_on: Option<SocketId>,
    /// When mutations answered `retry` (or a failed upload) go again.
    retry_at_ms: Option<u64>,
    retry_delay_ms: u64,
    /// A `retry` answer came; `retry_at_ms` is set at the next pump (which knows the time).
    retry_due: bool,
}

/// One write of the outbox to the store: ONE storage transaction.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct OutboxWrite {
    pub client_id: String,
    /// The last mutation id given out (kept even when the outbox is empty).
    pub last_id: u64,
    pub put: Vec<Mutation>,
    /// Ids to delete.
    pub remove: Vec<u64>,
}

/// Why a mutation was refused before it was queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MutateError {
    #[error("the outbox is not loaded yet: restore it from the store first")]
    NotRestored,
    #[error("expected {0}")]
    Invalid(String),
}

impl Outbox {
    fn add(&mut self, mutation: Mutation, row_id: Option<String>) {
        if let Some(row_id) = &row_id {
            self.by_row
                .entry((mutation.table.clone(), row_id.clone()))
                .or_default()
                .insert(mutation.id);
        }
        self.pending.insert(
            mutation.id,
            Pending {
                mutation,
                row_id,
                echoed: Scopes::default(),
                uploaded: false,
                lingers: None,
            },
        );
    }

    fn remove(&mut self, id: u64) -> Option<Pending> {
        let pending = self.pending.remove(&id)?;
        if let Some(row_id) = &pending.row_id {
            let at = (pending.mutation.table.clone(), row_id.clone());
            if let Some(ids) = self.by_row.get_mut(&at) {
                ids.remove(&id);
                if ids.is_empty() {
                    self.by_row.remove(&at);
                }
            }
        }
        Some(pending)
    }

    /// The rows of `table` pending mutations are laid over.
    fn rows_of(&self, table: &str) -> Vec<String> {
        self.by_row
            .keys()
            .filter(|(t, _)| t == table)
            .map(|(_, id)| id.clone())
            .collect()
    }
}

impl SyncClient {
    /// Gives the client its outbox as the store kept it (or a fresh client id and none).
    pub(super) fn restore_outbox(
        &mut self,
        client_id: String,
        last_id: u64,
        pending: Vec<Mutation>,
        out: &mut Vec<ClientEffect>,
    ) {
        self.outbox.client_id = Some(client_id);
        self.outbox.last_id = pending.iter().map(|m| m.id).max().unwrap_or(0).max(last_id);
        for mutation in pending {
            let row_id = resource_id(&mutation.row, &self.key_columns(&mutation.table));
            self.outbox.add(mutation, row_id);
        }
        self.relay_all(out);
    }

    /// Queues a mutation (see [`SyncClient::mutate`]).
    pub(super) fn queue(
        &mut self,
        table: String,
        op: MutationOp,
        row: Map<String, Value>,
        if_version: Option<i64>,
        out: &mut Vec<ClientEffect>,
    ) -> Result<u64, MutateError> {
        let Some(client_id) = self.outbox.client_id.clone() else {
            return Err(MutateError::NotRestored);
        };
        let id = self.outbox.last_id + 1;
        let mutation = Mutation {
            id,
            table,
            op,
            row,
            if_version,
        };
        // The server's reading of a mutation, applied before it is queued: a mutation it
        // would refuse as invalid never waits in the outbox.
        match Mutation::parse(&mutation.to_value()) {
            Ok(Ok(_)) => {}
            Ok(Err(invalid)) => return Err(MutateError::Invalid(invalid.reason)),
            Err(error) => return Err(MutateError::Invalid(error.to_string())),
        }
        let key = self.key_columns(&mutation.table);
        if mutation.op != MutationOp::Insert && !key.iter().all(|k| mutation.row.contains_key(k)) {
            return Err(MutateError::Invalid(format!(
                "an {} of {:?} to name its key columns ({})",
                mutation.op.as_str(),
                mutation.table,
                key.join(", ")
            )));
        }
        self.outbox.last_id = id;
        out.push(ClientEffect::PersistOutbox {
            write: OutboxWrite {
                client_id,
                last_id: id,
                put: vec![mutation.clone()],
                remove: Vec::new(),
            },
        });
        let table = mutation.table.clone();
        let row_id = resource_id(&mutation.row, &key);
        self.outbox.add(mutation, row_id.clone());
        self.relay_rows(&table, row_id.into_iter().collect(), out);
        Ok(id)
    }

    /// The key columns of a table: configured, else `id`.
    fn key_columns(&self, table: &str) -> Vec<String> {
        self.config
            .keys
            .get(table)
            .cloned()
            .unwrap_or_else(|| vec!["id".to_owned()])
    }

    /// Sends what may go now: the next batch, the awaits of a new socket, after a retry delay.
    pub(super) fn pump(&mut self, now_ms: u64, out: &mut Vec<ClientEffect>) {
        let Some(client_id) = self.outbox.client_id.clone() else {
            return;
        };
        let socket = match self.link {
            Link::Open { socket, .. } => Some(socket),
            _ => None,
        };
        let outbox = &mut self.outbox;
        if std::mem::take(&mut outbox.retry_due) {
            outbox.retry_delay_ms = if outbox.retry_delay_ms == 0 {
                RETRY_FIRST_MS
            } else {
                (outbox.retry_delay_ms * 2).min(RETRY_MAX_MS)
            };
            outbox.retry_at_ms = Some(now_ms.saturating_add(outbox.retry_delay_ms));
        }
        // A batch sent on a socket that is gone is answered by nobody.
        if let Some((Some(sent_on), _)) = &outbox.in_flight {
            if Some(*sent_on) != socket {
                outbox.in_flight = None;
            }
        }
        let Some(socket) = socket else {
            return;
        };
        if self.config.upload && outbox.awaited_on != Some(socket) {
            outbox.awaited_on = Some(socket);
            let awaited: Vec<u64> = outbox
                .pending
                .values()
                .filter(|p| p.uploaded)
                .map(|p| p.mutation.id)
                .collect();
            send_awaits(socket, &client_id, &awaited, out);
        }
        if outbox.in_flight.is_some() || outbox.retry_at_ms.is_some_and(|at| now_ms < at) {
            return;
        }
        outbox.retry_at_ms = None;
        let batch: Vec<Mutation> = outbox
            .pending
            .values()
            .filter(|p| !p.uploaded && p.lingers.is_none())
            .take(MAX_MUTATIONS_PER_FRAME)
            .map(|p| p.mutation.clone())
            .collect();
        if batch.is_empty() {
            return;
        }
        let ids = batch.iter().map(|m| m.id).collect();
        if self.config.upload {
            outbox.in_flight = Some((None, ids));
            out.push(ClientEffect::Upload { mutations: batch });
        } else {
            outbox.in_flight = Some((Some(socket), ids));
            out.push(ClientEffect::Send {
                socket,
                text: ClientFrame::Mutate {
                    client_id,
                    token: self.token.clone(),
                    mutations: batch.iter().map(Mutation::to_value).collect(),
                }
                .to_json(),
            });
        }
    }

    /// When the outbox wants the timer: a retry delay running out while a socket is open.
    pub(super) fn outbox_deadline(&self) -> Option<u64> {
        self.outbox
            .retry_at_ms
            .filter(|_| !self.outbox.pending.is_empty())
    }

    /// A `mutation-result` frame.
    pub(super) fn mutation_results(
        &mut self,
        client_id: &str,
        results: Vec<MutationResult>,
        out: &mut Vec<ClientEffect>,
    ) {
        if self.outbox.client_id.as_deref() != Some(client_id) {
            return;
        }
        // The batch stays out until each of its mutations is answered (the server answers
        // confirmed ones as their changes reach it, so one batch may take several frames).
        let answered = set_of(results.iter().map(|r| r.id));
        if let Some((_, ids)) = &mut self.outbox.in_flight {
            ids.retain(|id| !answered.contains(id));
            if ids.is_empty() {
                self.outbox.in_flight = None;
            }
        }
        let mut settled = Vec::new();
        for result in results {
            match result.status {
                MutationStatus::Retry => self.outbox.retry_due = true,
                MutationStatus::Confirmed | MutationStatus::Rejected => {
                    if self
                        .outbox
                        .pending
                        .get(&result.id)
                        .is_some_and(|p| p.lingers.is_none())
                    {
                        if result.status == MutationStatus::Confirmed {
                            self.outbox.retry_delay_ms = 0;
                        }
                        settled.push(result);
                    }
                }
            }
        }
        self.settle(settled, out);
    }

    /// The app's `upload` finished: `Ok` with the ones it refused for good, or `Err` (tried
    /// again after a delay).
    pub(super) fn uploaded(
        &mut self,
        ids: &[u64],
        result: Result<Vec<MutationResult>, String>,
        out: &mut Vec<ClientEffect>,
    ) {
        match &self.outbox.in_flight {
            Some((None, sent)) if sent == ids => self.outbox.in_flight = None,
            _ => return,
        }
        let rejected = match result {
            Ok(rejected) => rejected,
            Err(message) => {
                self.outbox.retry_due = true;
                out.push(ClientEffect::Error {
                    scope: None,
                    code: "upload-failed".to_owned(),
                    message,
                });
                return;
            }
        };
        self.outbox.retry_delay_ms = 0;
        let refused = set_of(rejected.iter().map(|r| r.id));
        let mut awaited = Vec::new();
        for id in ids {
            if refused.contains(id) {
                continue;
            }
            if let Some(pending) = self.outbox.pending.get_mut(id) {
                pending.uploaded = true;
                awaited.push(*id);
            }
        }
        if let (Link::Open { socket, .. }, Some(client_id)) = (self.link, &self.outbox.client_id) {
            if self.outbox.awaited_on == Some(socket) {
                send_awaits(socket, client_id, &awaited, out);
            }
        }
        let settled = rejected
            .into_iter()
            .filter(|r| ids.contains(&r.id))
            .map(|mut r| {
                r.status = MutationStatus::Rejected;
                r
            })
            .collect();
        self.settle(settled, out);
    }

    /// Drops settled mutations: from the store, from the overlays, and tells the app.
    fn settle(&mut self, settled: Vec<MutationResult>, out: &mut Vec<ClientEffect>) {
        if settled.is_empty() {
            return;
        }
        let Some(client_id) = self.outbox.client_id.clone() else {
            return;
        };
        let mut rows: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut remove = Vec::new();
        for result in &settled {
            let Some(pending) = self.outbox.pending.get(&result.id) else {
                continue;
            };
            let table = pending.mutation.table.clone();
            rows.entry(table.clone())
                .or_default()
                .extend(pending.row_id.clone());
            remove.push(result.id);
            // Its change reached every live scope; one being subscribed again has not had it.
            let mut waiting = Scopes::default();
            for key in self
                .scopes
                .iter()
                .filter(|(key, slot)| {
                    slot.params.scope.resource_type.as_deref() == Some(table.as_str())
                        && !matches!(slot.phase, Phase::Live | Phase::Failed)
                        && !pending.echoed.contains(key)
                })
                .map(|(key, _)| *key)
            {
                waiting.insert(key);
            }
            if result.status == MutationStatus::Confirmed && !waiting.is_empty() {
                if let Some(pending) = self.outbox.pending.get_mut(&result.id) {
                    pending.lingers = Some(waiting);
                }
            } else {
                self.outbox.remove(result.id);
            }
        }
        out.push(ClientEffect::PersistOutbox {
            write: OutboxWrite {
                client_id,
                last_id: self.outbox.last_id,
                put: Vec::new(),
                remove,
            },
        });
        for (table, ids) in rows {
            self.relay_rows(&table, ids, out);
        }
        for result in settled {
            out.push(ClientEffect::Settled { result });
        }
    }

    /// An envelope applied to scope `key` echoed these mutations of this client; returns the
    /// rows they were laid over (to lay again with the envelope's change).
    pub(super) fn echoed(&mut self, key: ScopeKey, echo: Option<Echo>) -> Vec<String> {
        let Some(echo) = echo else {
            return Vec::new();
        };
        if self.outbox.client_id.as_deref() != Some(echo.client_id.as_str()) {
            return Vec::new();
        }
        let mut rows = Vec::new();
        let mut done = Vec::new();
        for id in echo.mutation_ids {
            if let Some(pending) = self.outbox.pending.get_mut(&id) {
                pending.echoed.insert(key);
                rows.extend(pending.row_id.clone());
                if let Some(lingers) = &mut pending.lingers {
                    lingers.remove(&key);
                    if lingers.is_empty() {
                        done.push(id);
                    }
                }
            }
        }
        // Only the echoed mutations are looked at: an echo costs what it names.
        for id in done {
            self.outbox.remove(id);
        }
        rows
    }

    /// Scope `key` is live again (or gone): confirmed mutations that lingered over it for want
    /// of their change stop; returns the rows to lay again.
    pub(super) fn stop_lingering(&mut self, key: ScopeKey) -> Vec<String> {
        let mut rows = Vec::new();
        let mut done = Vec::new();
        for (id, pending) in &mut self.outbox.pending {
            let Some(lingers) = &mut pending.lingers else {
                continue;
            };
            if lingers.remove(&key) {
                rows.extend(pending.row_id.clone());
            }
            if lingers.is_empty() {
                done.push(*id);
            }
        }
        for id in done {
            self.outbox.remove(id);
        }
        rows
    }

    /// Scope `key` is live again: the confirmed mutations that lingered over it give way to
    /// the rows its catch-up brought.
    pub(super) fn scope_live(&mut self, key: ScopeKey, out: &mut Vec<ClientEffect>) {
        let rows = self.stop_lingering(key);
        if !rows.is_empty() {
            self.emit_change(key, false, RowChange::default(), &rows, out);
        }
    }

    /// The rows of scope `key`'s table that pending mutations are laid over.
    pub(super) fn overlaid_rows(&self, key: ScopeKey) -> Vec<String> {
        self.scopes
            .get(&key)
            .and_then(|slot| slot.params.scope.resource_type.as_deref())
            .map_or_else(Vec::new, |table| self.outbox.rows_of(table))
    }

    /// Lays the overlays over every scope again (the outbox was restored).
    fn relay_all(&mut self, out: &mut Vec<ClientEffect>) {
        let keys: Vec<ScopeKey> = self.scopes.keys().copied().collect();
        for key in keys {
            let rows = self.overlaid_rows(key);
            self.emit_change(key, false, RowChange::default(), &rows, out);
        }
    }

    /// Lays the overlays of these rows of `table` again over its scopes (their mutations
    /// changed).
    fn relay_rows(&mut self, table: &str, rows: Vec<String>, out: &mut Vec<ClientEffect>) {
        if rows.is_empty() {
            return;
        }
        let keys: Vec<ScopeKey> = self
            .scopes
            .iter()
            .filter(|(_, slot)| slot.params.scope.resource_type.as_deref() == Some(table))
            .map(|(key, _)| *key)
            .collect();
        for key in keys {
            self.emit_change(key, false, RowChange::default(), &rows, out);
        }
    }

    /// Reports a change of scope `key`'s server rows (`server`, possibly empty) as the change
    /// of the rows shown: the overlay of each row the change touches, and of the rows in
    /// `relay` (whose mutations changed), is laid again and the change it makes merged in.
    /// Costs what those rows' pending mutations cost, not the whole outbox.
    pub(super) fn emit_change(
        &mut self,
        key: ScopeKey,
        reset: bool,
        server: RowChange,
        relay: &[String],
        out: &mut Vec<ClientEffect>,
    ) {
        let Some(slot) = self.scopes.get(&key) else {
            return;
        };
        let table = slot.params.scope.resource_type.clone().unwrap_or_default();
        let overlaid = slot.overlay.is_empty() && self.outbox.by_row.is_empty();
        let change = if overlaid {
            server
        } else {
            let mut rows = set_of(relay.iter().cloned());
            for row in server
                .inserted
                .iter()
                .chain(&server.updated)
                .chain(&server.removed)
            {
                rows.insert(row.id.clone());
            }
            let conditions = Conditions::parse(&slot.params.scope.conditions).ok();
            let laid: Vec<(String, Option<Option<RowData>>)> = rows
                .iter()
                .map(|id| {
                    let shown = self.overlay_row(key, &table, id, conditions.as_ref());
                    (id.clone(), shown)
                })
                .collect();
            let Some(slot) = self.scopes.get_mut(&key) else {
                return;
            };
            let mut old = HashMap::new();
            for (id, shown) in laid {
                let was = match shown {
                    Some(shown) => slot.overlay.insert(id.clone(), shown),
                    None => slot.overlay.remove(&id),
                };
                if let Some(was) = was {
                    old.insert(id, was);
                }
            }
            slot.shown_change(&old, &rows, server)
        };
        if reset || !change.is_empty() {
            out.push(ClientEffect::Changed {
                scope: key,
                reset,
                change,
            });
        }
    }

    /// Row `id` of scope `key` with its pending mutations laid over it, in id order: `None`
    /// when no mutation is laid over it, `Some(None)` when it is hidden.
    fn overlay_row(
        &self,
        key: ScopeKey,
        table: &str,
        id: &str,
        conditions: Option<&Conditions>,
    ) -> Option<Option<RowData>> {
        let ids = self.outbox.by_row.get(&(table.to_owned(), id.to_owned()))?;
        let slot = self.scopes.get(&key)?;
        let mut shown: Option<Option<Map<String, Value>>> = None;
        for mutation_id in ids {
            let Some(pending) = self.outbox.pending.get(mutation_id) else {
                continue;
            };
            if pending.echoed.contains(&key)
                || pending
                    .lingers
                    .as_ref()
                    .is_some_and(|scopes| !scopes.contains(&key))
            {
                continue;
            }
            let mutation = &pending.mutation;
            let base = match &shown {
                Some(shown) => shown.clone(),
                None => slot.rows.get(id).map(|row| row.data.to_map()),
            };
            let next = match (mutation.op, base) {
                (MutationOp::Insert, base) => Some(merged(base.unwrap_or_default(), &mutation.row)),
                (MutationOp::Update, Some(base)) => Some(merged(base, &mutation.row)),
                // An update of a row the scope does not hold: nothing to show it over.
                (MutationOp::Update, None) => continue,
                (MutationOp::Delete, _) => None,
            };
            shown = Some(next.filter(|row| conditions.is_none_or(|c| c.matches(row))));
        }
        shown.map(|shown| shown.map(|row| Arc::new(RowText::from_map(&row))))
    }

    /// The rows of scope `key` as shown (server rows with the overlay laid over them).
    pub(super) fn shown_rows(&self, key: ScopeKey) -> Vec<(String, RowData)> {
        let Some(slot) = self.scopes.get(&key) else {
            return Vec::new();
        };
        let mut rows: BTreeMap<String, RowData> = slot
            .rows
            .iter()
            .map(|(id, row)| (id.clone(), Arc::clone(&row.data)))
            .collect();
        for (id, shown) in &slot.overlay {
            match shown {
                Some(row) => {
                    rows.insert(id.clone(), Arc::clone(row));
                }
                None => {
                    rows.remove(id);
                }
            }
        }
        rows.into_iter().collect()
    }

    /// Pending mutations (not settled), oldest first.
    pub fn pending_mutations(&self) -> Vec<Mutation> {
        self.outbox
            .pending
            .values()
            .filter(|p| p.lingers.is_none())
            .map(|p| p.mutation.clone())
            .collect()
    }
}

/// A row as shown before a change: absent, this data, or present with data the change
/// replaced (an update of a server row that had no overlay).
enum Before {
    Absent,
    Known(RowData),
    Replaced,
}

impl ScopeSlot {
    /// The change of the rows shown, from the server rows' change and the overlay before it of
    /// the rows laid again (`old`; `self.overlay` is the one after it). `rows` holds every row
    /// the server change touched and every row laid again.
    fn shown_change(
        &self,
        old: &HashMap<String, Option<RowData>>,
        rows: &BTreeSet<String>,
        server: RowChange,
    ) -> RowChange {
        let mut before: BTreeMap<String, Before> = BTreeMap::new();
        for row in &server.inserted {
            before.insert(row.id.clone(), Before::Absent);
        }
        for row in &server.updated {
            before.insert(row.id.clone(), Before::Replaced);
        }
        for row in &server.removed {
            before.insert(row.id.clone(), Before::Known(Arc::clone(&row.data)));
        }
        for id in rows {
            if !before.contains_key(id) {
                let held = self.rows.get(id).map(|row| Arc::clone(&row.data));
                before.insert(id.clone(), held.map_or(Before::Absent, Before::Known));
            }
        }
        let mut change = RowChange::default();
        for (id, server_before) in before {
            let was = match old.get(&id) {
                Some(Some(row)) => Before::Known(Arc::clone(row)),
                Some(None) => Before::Absent,
                None => server_before,
            };
            let now = match self.overlay.get(&id) {
                Some(shown) => shown.clone(),
                None => self.rows.get(&id).map(|row| Arc::clone(&row.data)),
            };
            match (was, now) {
                (Before::Absent, Some(now)) => change.inserted.push(ChangedRow::new(&id, &now)),
                (Before::Absent, None) => {}
                (Before::Known(was), None) => change.removed.push(ChangedRow { id, data: was }),
                (Before::Replaced, None) => change.removed.push(ChangedRow {
                    id,
                    data: Arc::default(),
                }),
                (Before::Known(was), Some(now)) if was == now => {}
                (_, Some(now)) => change.updated.push(ChangedRow::new(&id, &now)),
            }
        }
        change
    }

    /// Ids among `ids` whose shown row is not the server's (the store must be given the
    /// server's).
    pub(super) fn shadowed<'a>(&self, ids: impl Iterator<Item = &'a str>) -> Vec<String> {
        if self.overlay.is_empty() {
            return Vec::new();
        }
        ids.filter(|id| self.overlay.contains_key(*id))
            .map(str::to_owned)
            .collect()
    }
}

/// A row's `resourceId` from its key columns, as the server forms it: a one-column key's value
/// in JS string form, else the JSON array of the values. `None` if a key column is missing.
pub fn resource_id(row: &Map<String, Value>, key: &[String]) -> Option<String> {
    match key {
        [one] => row.get(one).filter(|v| !v.is_null()).map(js_string_form),
        _ => {
            let values: Option<Vec<Value>> = key.iter().map(|k| row.get(k).cloned()).collect();
            Some(Value::Array(values?).to_string())
        }
    }
}

/// `await-mutations` frames for `ids` on `socket`, at most a frame's worth each.
fn send_awaits(socket: SocketId, client_id: &str, ids: &[u64], out: &mut Vec<ClientEffect>) {
    for ids in ids.chunks(MAX_MUTATIONS_PER_FRAME) {
        out.push(ClientEffect::Send {
            socket,
            text: ClientFrame::AwaitMutations {
                client_id: client_id.to_owned(),
                ids: ids.to_vec(),
            }
            .to_json(),
        });
    }
}

fn merged(mut base: Map<String, Value>, row: &Map<String, Value>) -> Map<String, Value> {
    for (column, value) in row {
        base.insert(column.clone(), value.clone());
    }
    base
}
