//! Writes on the scope-sync socket (`docs/protocol/scope-sync.md`, "Writes"): the server half.
//!
//! A `mutate` frame becomes one [`ServerEffect::ApplyMutations`]: the host checks the token and
//! the write rules, applies each mutation upstream in its own transaction (exactly once: the
//! client's last applied id is written in the same transaction), and answers
//! [`ServerInput::MutationsApplied`] with a result per mutation. One batch per socket is out at
//! a time; a client waits for a batch's results before sending the next.
//!
//! A mutation applied upstream is answered `confirmed` only once its change is here: its
//! transaction's confirm message has come through this node's replica
//! ([`ServerInput::Committed`]'s `confirms`, or the replica's record handed back with the
//! results), and every subscription of the socket is live, so every scope of the socket has
//! been sent the change before the answer (read-your-writes). The envelopes of that transaction
//! carry the client's mutation ids in `echoOrigin`, on the writing client's sockets only.
//! Results go out in the order the mutations were sent.

use std::collections::VecDeque;

use serde_json::Value;

use super::{ConnId, ScopeServer, ServerEffect, Stage};
use crate::scope_sync::{
    rejection, Echo, InvalidMutation, Mutation, MutationResult, MutationStatus, ServerFrame,
};

/// `error` frame codes of the write frames.
pub mod write_codes {
    /// A `mutate` or `await-mutations` frame named another client than the socket's first.
    pub const CLIENT_CHANGED: &str = "client-changed";
    /// A `mutate` frame came while the socket's previous batch was still being applied.
    pub const BUSY: &str = "busy";
    /// More mutations are awaited on the socket than [`super::MAX_AWAITED`].
    pub const TOO_MANY_AWAITED: &str = "too-many-awaited";
}

/// Results a socket may have waiting for their changes to reach the replica.
pub const MAX_AWAITED: usize = 10_000;

/// One socket's writes.
#[derive(Debug, Default)]
pub(super) struct ConnWrites {
    /// The client the socket writes for (its first `mutate` or `await-mutations` frame).
    client_id: Option<String>,
    /// The ticket of the batch the host is applying.
    applying: Option<u64>,
    /// Results in the order their mutations came, not sent yet: a confirmed one waits for its
    /// change to reach the replica and for the socket's subscriptions to be live.
    queued: VecDeque<MutationResult>,
}

/// What a write frame asks of the server.
pub(super) enum WriteFrame {
    Mutate {
        client_id: String,
        token: Option<String>,
        mutations: Vec<Value>,
    },
    Await {
        client_id: String,
        ids: Vec<u64>,
    },
}

impl ScopeServer {
    /// A `mutate` or `await-mutations` frame.
    pub(super) fn write_frame(
        &mut self,
        conn: ConnId,
        frame: WriteFrame,
        out: &mut Vec<ServerEffect>,
    ) {
        let client_id = match &frame {
            WriteFrame::Mutate { client_id, .. } | WriteFrame::Await { client_id, .. } => {
                client_id.clone()
            }
        };
        let Some(connection) = self.connections.get_mut(&conn) else {
            return;
        };
        match &connection.writes.client_id {
            Some(bound) if *bound != client_id => {
                let error = format!(
                    "expected clientId {bound:?} (this socket's client), got {client_id:?}"
                );
                return self.error_frame(conn, write_codes::CLIENT_CHANGED, error, out);
            }
            Some(_) => {}
            None => connection.writes.client_id = Some(client_id.clone()),
        }
        match frame {
            WriteFrame::Await { ids, .. } => {
                if connection.writes.queued.len() + ids.len() > MAX_AWAITED {
                    let error = format!(
                        "expected at most {MAX_AWAITED} mutations awaited on one socket, got more"
                    );
                    return self.error_frame(conn, write_codes::TOO_MANY_AWAITED, error, out);
                }
                connection
                    .writes
                    .queued
                    .extend(ids.into_iter().map(MutationResult::confirmed));
                // Their change may have reached the replica before this socket named its
                // client (the backend committed first): the host looks, and answers
                // `Replicated`.
                out.push(ServerEffect::LookUpReplicated {
                    client_id: client_id.clone(),
                });
                self.flush_results(conn, out);
            }
            WriteFrame::Mutate {
                token, mutations, ..
            } => {
                if connection.writes.applying.is_some() {
                    let error = "expected one mutate frame at a time: wait for the mutation-result of the last one".to_owned();
                    return self.error_frame(conn, write_codes::BUSY, error, out);
                }
                let mut parsed: Vec<Result<Mutation, InvalidMutation>> = Vec::new();
                for value in &mutations {
                    match Mutation::parse(value) {
                        Ok(mutation) => parsed.push(mutation),
                        Err(error) => {
                            return self.error_frame(
                                conn,
                                super::codes::BAD_FRAME,
                                error.to_string(),
                                out,
                            )
                        }
                    }
                }
                let ids: Vec<u64> = parsed
                    .iter()
                    .map(|m| match m {
                        Ok(m) => m.id,
                        Err(e) => e.id,
                    })
                    .collect();
                if ids.windows(2).any(|pair| pair[0] >= pair[1]) {
                    let error = format!(
                        "expected the mutations of a frame in ascending id order, got ids {ids:?}"
                    );
                    return self.error_frame(conn, super::codes::BAD_FRAME, error, out);
                }
                if parsed.is_empty() {
                    return;
                }
                if !self.config.takes_writes {
                    let results = ids
                        .into_iter()
                        .map(|id| {
                            MutationResult::retry(
                                id,
                                rejection::UNAVAILABLE,
                                "this node takes no writes (a relay): they are applied through the primary",
                            )
                        })
                        .collect();
                    return self.send(
                        conn,
                        &ServerFrame::MutationResult { client_id, results },
                        out,
                    );
                }
                self.tickets += 1;
                let ticket = self.tickets;
                connection.writes.applying = Some(ticket);
                self.counted.mutations_received += parsed.len() as u64;
                out.push(ServerEffect::ApplyMutations {
                    conn,
                    ticket,
                    client_id,
                    token,
                    mutations: parsed,
                });
            }
        }
    }

    /// The host's answer to [`ServerEffect::ApplyMutations`]. `replicated` is the client's last
    /// mutation id the replica had applied when the host looked, after the batch.
    pub(super) fn mutations_applied(
        &mut self,
        conn: ConnId,
        ticket: u64,
        results: Vec<MutationResult>,
        replicated: Option<u64>,
        out: &mut Vec<ServerEffect>,
    ) {
        let Some(connection) = self.connections.get_mut(&conn) else {
            return;
        };
        if connection.writes.applying != Some(ticket) {
            return;
        }
        connection.writes.applying = None;
        // Order holds: after a mutation to send again, every later one is sent again too (one
        // applied meanwhile is recognised as applied then).
        let mut results = results;
        if let Some(first) = results
            .iter()
            .position(|r| r.status == MutationStatus::Retry)
        {
            let (code, message) = (results[first].code.clone(), results[first].message.clone());
            for result in &mut results[first + 1..] {
                if result.status != MutationStatus::Retry {
                    *result = MutationResult {
                        id: result.id,
                        status: MutationStatus::Retry,
                        code: code.clone(),
                        message: message.clone(),
                        row: None,
                    };
                }
            }
        }
        if let (Some(client), Some(id)) = (&connection.writes.client_id, replicated) {
            let seen = self.replicated.entry(client.clone()).or_insert(0);
            *seen = (*seen).max(id);
        }
        for result in &results {
            match result.status {
                MutationStatus::Confirmed => self.counted.mutations_applied += 1,
                MutationStatus::Rejected => self.counted.mutations_rejected += 1,
                MutationStatus::Retry => self.counted.mutations_retried += 1,
            }
        }
        connection.writes.queued.extend(results);
        self.flush_results(conn, out);
    }

    /// The host's answer to [`ServerEffect::LookUpReplicated`].
    pub(super) fn replicated_up_to(
        &mut self,
        client_id: &str,
        last: Option<u64>,
        out: &mut Vec<ServerEffect>,
    ) {
        let conns: Vec<ConnId> = self
            .connections
            .iter()
            .filter(|(_, c)| c.writes.client_id.as_deref() == Some(client_id))
            .map(|(conn, _)| *conn)
            .collect();
        if conns.is_empty() {
            return;
        }
        if let Some(last) = last {
            let seen = self.replicated.entry(client_id.to_owned()).or_insert(0);
            *seen = (*seen).max(last);
        }
        for conn in conns {
            self.flush_results(conn, out);
        }
    }

    /// Records the client mutations a committed upstream transaction confirmed; returns the
    /// echo each socket of those clients gets on the transaction's envelopes.
    pub(super) fn note_confirms(&mut self, confirms: &[(String, u64)]) -> Vec<(ConnId, Echo)> {
        if confirms.is_empty() {
            return Vec::new();
        }
        let mut echoes = Vec::new();
        for (conn, connection) in &self.connections {
            let Some(client) = &connection.writes.client_id else {
                continue;
            };
            let ids: Vec<u64> = confirms
                .iter()
                .filter(|(c, _)| c == client)
                .map(|(_, id)| *id)
                .collect();
            if let Some(&last) = ids.iter().max() {
                let seen = self.replicated.entry(client.clone()).or_insert(0);
                *seen = (*seen).max(last);
                echoes.push((
                    *conn,
                    Echo {
                        client_id: client.clone(),
                        mutation_ids: ids,
                    },
                ));
            }
        }
        echoes
    }

    /// Sends the socket's results that may go now, in order: up to the first confirmed one
    /// whose change has not reached the replica (or, while a subscription of the socket is not
    /// live yet, up to the first confirmed one).
    pub(super) fn flush_results(&mut self, conn: ConnId, out: &mut Vec<ServerEffect>) {
        let Some(client) = self
            .connections
            .get(&conn)
            .and_then(|c| c.writes.client_id.clone())
        else {
            return;
        };
        // A commit that confirms a mutation may be held (its moves being read) after the host
        // counted it routed: the mutation is confirmed once that commit is sent, not before.
        let held = self.confirm_held(&client);
        let Some(connection) = self.connections.get_mut(&conn) else {
            return;
        };
        let replicated = self.replicated.get(&client).copied().unwrap_or(0);
        let all_live = connection
            .subscriptions
            .values()
            .all(|sub| matches!(sub.stage, Stage::Live));
        let mut results = Vec::new();
        while let Some(front) = connection.writes.queued.front() {
            let ready = match front.status {
                MutationStatus::Confirmed => {
                    all_live && front.id <= replicated && held.is_none_or(|held| front.id < held)
                }
                MutationStatus::Rejected | MutationStatus::Retry => true,
            };
            if !ready {
                break;
            }
            results.extend(connection.writes.queued.pop_front());
        }
        if !results.is_empty() {
            self.send(
                conn,
                &ServerFrame::MutationResult {
                    client_id: client,
                    results,
                },
                out,
            );
        }
    }

    /// Forgets a closed socket's client when no other socket writes for it.
    pub(super) fn forget_writer(&mut self, client: Option<String>) {
        let Some(client) = client else { return };
        let still_open = self
            .connections
            .values()
            .any(|c| c.writes.client_id.as_deref() == Some(client.as_str()));
        if !still_open {
            self.replicated.remove(&client);
        }
    }

    fn error_frame(
        &mut self,
        conn: ConnId,
        code: &str,
        error: String,
        out: &mut Vec<ServerEffect>,
    ) {
        let frame = ServerFrame::Error {
            error,
            code: Some(code.to_owned()),
            retry_after_ms: None,
        };
        self.send(conn, &frame, out);
    }
}

impl ConnWrites {
    pub(super) fn client_id(&self) -> Option<&str> {
        self.client_id.as_deref()
    }
}
