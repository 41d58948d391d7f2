//! Writes through the scope-sync socket, the host's half (`docs/protocol/scope-sync.md`,
//! "Writes"): the scope server asks for a `mutate` frame's mutations to be applied
//! ([`ServerEffect::ApplyMutations`](highwater_engine::scope_sync::server::ServerEffect)) and this
//! module applies them upstream and answers with a result per mutation.
//!
//! How one write flows:
//!
//! 1. The client sends `mutate {clientId, token, mutations}`; the scope server checks the
//!    frame and hands the batch to [`SyncHub`](super::SyncHub), which spawns
//!    [`Writes::apply`]: the batch runs on one pooled upstream connection, in order.
//! 2. Per mutation, before Postgres is asked anything: the token's claims (no token, no
//!    claims; a token that fails verification answers the whole batch `retry`/`auth`, so
//!    the client gets a fresh one), the table must be replicated and have a key, its columns
//!    must exist, and [`SyncRules::decide_write`] must allow the operation and columns.
//! 3. One Postgres transaction per mutation, of statements the connection keeps prepared:
//!    `highwater.confirm(client, id)` first, which locks the client's row in
//!    `highwater.client_mutations` (one client's writers take turns), records the id and puts a
//!    `highwater.confirm` logical message in the transaction; it raises `HW409` for an id at or
//!    below the client's last, handled before (a resend after a lost answer or a crash), which
//!    gets the answer it got then (its rejection in `highwater.rejected_mutations`, else
//!    `confirmed`), and nothing is written. Otherwise an
//!    update's or delete's row is locked and read (gone: `conflict`; out of the writer's
//!    reach: `forbidden`); with `ifVersion` the replica's `serverSequence` of the row must
//!    equal it (below); the row is written, with Postgres converting the values
//!    (`statement`), and the row written must still be in the writer's reach (no moving a
//!    row out of it); COMMIT.
//! 4. Any refusal rolls the whole mutation back and is recorded with `highwater.reject` in
//!    a transaction of its own, so a resend is answered the same. A constraint Postgres
//!    enforces is `constraint`, a value it cannot take `invalid`. A lost connection, a lock
//!    or statement timeout, a serialization failure: `retry`/`unavailable` for this mutation
//!    and every later one of the batch, so the client resends them in order.
//! 5. The confirm message comes back through logical replication: the ingest thread records
//!    it in the replica's `_hw_client_mutations` in the SQLite transaction of the write's
//!    rows, and once that commit is durable routes the transaction's rows with the confirms
//!    ([`ServerInput::Committed`](highwater_engine::scope_sync::server::ServerInput)): the writer's
//!    sockets get the envelopes with `echoOrigin` naming its mutations, and then its
//!    `confirmed` results (the scope server holds a confirmed result until then).
//! 6. After the batch, the client's last mutation id the replica holds is handed back with
//!    the results (`replicated`), so a resend of mutations applied long ago is answered at
//!    once. It is only handed back once the transaction that confirmed it is routed
//!    ([`Writes::routed_through`]): a result never overtakes its envelopes.
//!
//! `ifVersion` is exact. With the row locked upstream, nobody can change it before the
//! mutation commits; a change made before the lock may not have reached the replica yet, so
//! a fence is sent first: a non-transactional `highwater.fence` logical message, written
//! after the lock was taken, which the ingest thread releases once everything decoded
//! before it is committed to the replica. Only then is the replica's sequence of the row
//! read. A fence not released within [`FENCE_TIMEOUT`] answers `retry`/`unavailable`.
//!
//! A `where` with subqueries (`project_id IN (SELECT project_id FROM members WHERE user_id =
//! auth.sub)`) reads other tables, which the replica holds (they are in the scope feed). When
//! the row alone does not decide it ([`WriteGrant::admission`]), a fence is sent as for
//! `ifVersion` and the replica evaluates the filter over the row ([`feed::row_passes`]).
//! Membership is read from the replica, which trails the upstream by the replication lag: read
//! without the fence, a write right after a membership was granted would be refused (for good:
//! `forbidden` is final) and one right after it was revoked let through. With it, every
//! membership change committed before the write's row was locked counts, and such a write
//! waits for the replica (`retry`/`unavailable` when it does not catch up within
//! [`FENCE_TIMEOUT`]). The tables are read as they stand before the write: a subquery never
//! sees the mutation's own row.
//!
//! The rules check a row with the values a reader of the replica sees (the statements return
//! each column's text output, read as the replica reads pgoutput's), so a `where` compares the
//! same values on a write as on a read.
//!
//! Only a primary takes writes. A relay answers every mutation `retry`/`unavailable`, and as
//! the change stream it follows carries no confirms, an `await-mutations` on a relay is never
//! answered. With a `FOR ALL TABLES` publication the two `highwater` tables are replicated
//! like the app's.

mod install;
mod pool;
mod statement;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use highwater_engine::change_stream::JsonFormat;
use highwater_engine::pgoutput::TextColumn;
use highwater_engine::scope_sync::rejection::{self, PgRefusal};
use highwater_engine::scope_sync::rules::{Admission, DenialCode, SyncRules, WriteGrant};
use highwater_engine::scope_sync::{
    BatchResults, InvalidMutation, Mutation, MutationOp, MutationResult,
};
use highwater_engine::upstream::FENCE_MESSAGE_PREFIX;
use highwater_engine::watermark::Watermark;
use serde_json::{Map, Value};
use tokio::sync::oneshot;
use tokio_postgres::Client;

use crate::replica::feed;
use crate::replica::schema::{ReplicaTable, ValueKind};
use crate::replica::value;
use crate::replica::{Replica, ReplicaError};
use crate::replication::{PgConfig, PgErrorText};
use crate::sync_auth::{unix_now_ms, SyncAuth};
use pool::{Conn, Pool};

pub(crate) use install::{install, InstallError};

/// How long an `ifVersion` write waits for the replica to catch up with upstream.
pub(crate) const FENCE_TIMEOUT: Duration = Duration::from_secs(5);

/// The write applier of a primary that takes writes.
pub(crate) struct Writes {
    upstream: PgConfig,
    pool: Pool,
    auth: Arc<SyncAuth>,
    replica: ReplicaReader,
    /// The connection fences are sent on, and whether its server takes the flush argument
    /// of `pg_logical_emit_message` (Postgres 17+).
    fence_client: tokio::sync::Mutex<Option<(Client, bool)>>,
    /// Fences sent and not yet released, by nonce.
    fences: Mutex<HashMap<String, oneshot::Sender<()>>>,
    next_fence: AtomicU64,
    /// Tells this process's fences from others' (and from an earlier run's).
    fence_prefix: String,
    /// Every transaction up to here has been routed to the scope-sync sockets.
    routed: Mutex<Watermark>,
}

/// Why a mutation's transaction did not commit.
#[derive(Debug)]
enum Failure {
    /// Refused for good: rejected with this code (and, for a conflict, the current row).
    Refused {
        code: &'static str,
        message: String,
        row: Option<Value>,
    },
    /// Its id is not above the client's last: it was handled before.
    AlreadyApplied,
    /// Not now (Postgres unreachable, a timeout, a serialization failure).
    Unavailable(String),
}

impl Failure {
    fn refused(code: &'static str, message: impl Into<String>) -> Failure {
        Failure::Refused {
            code,
            message: message.into(),
            row: None,
        }
    }
}

impl From<tokio_postgres::Error> for Failure {
    fn from(error: tokio_postgres::Error) -> Failure {
        let Some(db) = error.as_db_error() else {
            return Failure::Unavailable(format!(
                "the upstream Postgres could not be reached: {}",
                PgErrorText(&error)
            ));
        };
        match rejection::for_sqlstate(db.code().code()) {
            PgRefusal::AlreadyApplied => Failure::AlreadyApplied,
            PgRefusal::Final(code) => Failure::refused(code, db.message()),
            PgRefusal::Transient => Failure::Unavailable(format!(
                "the upstream Postgres did not apply it: {}",
                PgErrorText(&error)
            )),
        }
    }
}

impl Writes {
    pub(crate) fn new(
        upstream: PgConfig,
        auth: Arc<SyncAuth>,
        replica_path: PathBuf,
        routed: Watermark,
    ) -> Writes {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        Writes {
            pool: Pool::new(upstream.clone()),
            upstream,
            auth,
            replica: ReplicaReader::new(replica_path),
            fence_client: tokio::sync::Mutex::new(None),
            fences: Mutex::new(HashMap::new()),
            next_fence: AtomicU64::new(1),
            fence_prefix: format!("{}-{started:x}", std::process::id()),
            routed: Mutex::new(routed),
        }
    }

    /// Every transaction up to `watermark` has been routed to the sockets.
    pub(crate) fn routed_through(&self, watermark: &Watermark) {
        let mut routed = self.routed.lock().unwrap_or_else(PoisonError::into_inner);
        if *watermark > *routed {
            *routed = watermark.clone();
        }
    }

    /// A fence came through ingest with everything before it committed to the replica.
    pub(crate) fn fence_passed(&self, nonce: &str) {
        let waiting = self
            .fences
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(nonce);
        if let Some(waiting) = waiting {
            let _ = waiting.send(());
        }
    }

    /// Applies one batch of `client_id`'s mutations, in order: a result per mutation, and
    /// the client's last mutation id the replica holds and has routed.
    pub(crate) async fn apply(
        &self,
        client_id: &str,
        token: Option<&str>,
        mutations: Vec<Result<Mutation, InvalidMutation>>,
    ) -> (Vec<MutationResult>, Option<u64>) {
        let ids: Vec<u64> = mutations
            .iter()
            .map(|m| match m {
                Ok(m) => m.id,
                Err(e) => e.id,
            })
            .collect();
        let retry_all = |code: &str, message: &str| BatchResults::retry_all(&ids, code, message);
        let claims = match token.filter(|t| !t.is_empty()) {
            None => Map::new(),
            Some(token) => match self.auth.verify(token, unix_now_ms()) {
                Ok(verified) => verified.claims,
                Err(denied) => {
                    let message = format!(
                        "the token was refused ({}: {}): send the mutations again with a fresh one",
                        denied.code, denied.message
                    );
                    return (retry_all(rejection::AUTH, &message), None);
                }
            },
        };
        let names: Vec<String> = mutations
            .iter()
            .filter_map(|m| m.as_ref().ok().map(|m| m.table.clone()))
            .collect();
        let tables = match self
            .replica
            .read(move |replica| {
                Ok(names
                    .into_iter()
                    .filter_map(|name| replica.table(&name).cloned().map(|t| (name, t)))
                    .collect::<HashMap<_, _>>())
            })
            .await
        {
            Ok(tables) => tables,
            Err(error) => {
                let message = format!("could not read the replica's tables: {error}");
                return (retry_all(rejection::UNAVAILABLE, &message), None);
            }
        };
        let mut pooled = match self.pool.get().await {
            Ok(pooled) => pooled,
            Err(error) => {
                return (
                    retry_all(rejection::UNAVAILABLE, &error.to_string()),
                    self.replicated(client_id).await,
                )
            }
        };
        let mut results = BatchResults::with_capacity(mutations.len());
        for mutation in mutations {
            let id = match &mutation {
                Ok(m) => m.id,
                Err(e) => e.id,
            };
            if !results.try_next(id) {
                continue;
            }
            let result = self
                .apply_one(&mut pooled.conn, client_id, &claims, &tables, mutation)
                .await;
            results.push(result);
        }
        self.pool.put(pooled);
        (results.finish(), self.replicated(client_id).await)
    }

    /// The client's last mutation id the replica holds, once the transaction that confirmed
    /// it has been routed to the sockets.
    pub(crate) async fn replicated(&self, client_id: &str) -> Option<u64> {
        let client = client_id.to_owned();
        let held = self
            .replica
            .read(move |replica| feed::client_mutation(replica.connection(), &client))
            .await
            .ok()
            .flatten()?;
        let routed = self
            .routed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        (held.1 <= routed).then_some(held.0)
    }

    async fn apply_one(
        &self,
        conn: &mut Conn,
        client_id: &str,
        claims: &Map<String, Value>,
        tables: &HashMap<String, ReplicaTable>,
        mutation: Result<Mutation, InvalidMutation>,
    ) -> MutationResult {
        let mutation = match mutation {
            Ok(mutation) => mutation,
            Err(invalid) => {
                let refusal = Failure::refused(rejection::INVALID, invalid.reason);
                return self
                    .refuse(&conn.client, client_id, invalid.id, refusal)
                    .await;
            }
        };
        let id = mutation.id;
        let checked = check(claims, tables, self.auth.rules(), &mutation);
        let (table, grant) = match checked {
            Ok(checked) => checked,
            Err(refusal) => return self.refuse(&conn.client, client_id, id, refusal).await,
        };
        match self
            .transact(conn, client_id, &mutation, table, &grant)
            .await
        {
            Ok(()) => MutationResult::confirmed(id),
            Err(failure) => {
                if matches!(failure, Failure::Unavailable(_)) {
                    // A failure that may pass may also be a statement a schema change made
                    // stale: the next attempt prepares them again.
                    conn.forget_prepared();
                }
                self.refuse(&conn.client, client_id, id, failure).await
            }
        }
    }

    /// The answer for a mutation that was not applied now.
    async fn refuse(
        &self,
        client: &Client,
        client_id: &str,
        id: u64,
        failure: Failure,
    ) -> MutationResult {
        match failure {
            Failure::Unavailable(message) => {
                MutationResult::retry(id, rejection::UNAVAILABLE, message)
            }
            Failure::AlreadyApplied => self.earlier(client, client_id, id).await,
            Failure::Refused { code, message, row } => {
                let Ok(db_id) = i64::try_from(id) else {
                    return MutationResult::rejected(
                        id,
                        rejection::INVALID,
                        "expected a mutation id below 2^63",
                    );
                };
                let recorded = client
                    .execute(
                        "SELECT highwater.reject($1, $2, $3, $4)",
                        &[&client_id, &db_id, &code, &message],
                    )
                    .await;
                match recorded.map_err(Failure::from) {
                    Ok(_) => {
                        let mut result = MutationResult::rejected(id, code, message);
                        result.row = row;
                        result
                    }
                    Err(Failure::AlreadyApplied) => self.earlier(client, client_id, id).await,
                    Err(Failure::Unavailable(message)) => {
                        MutationResult::retry(id, rejection::UNAVAILABLE, message)
                    }
                    Err(Failure::Refused { message, .. }) => MutationResult::retry(
                        id,
                        rejection::UNAVAILABLE,
                        format!("could not record the rejection upstream: {message}"),
                    ),
                }
            }
        }
    }

    /// The answer a mutation handled before got: its recorded rejection, else `confirmed`.
    async fn earlier(&self, client: &Client, client_id: &str, id: u64) -> MutationResult {
        let db_id = i64::try_from(id).unwrap_or(i64::MAX);
        let found = client
            .query_opt(
                "SELECT code, message FROM highwater.rejected_mutations \
                 WHERE client_id = $1 AND mutation_id = $2",
                &[&client_id, &db_id],
            )
            .await;
        let row = match found {
            Ok(row) => row,
            Err(error) => {
                let message = format!(
                    "could not read how the mutation was handled before: {}",
                    PgErrorText(&error)
                );
                return MutationResult::retry(id, rejection::UNAVAILABLE, message);
            }
        };
        let recorded = row.map(|row| (row.try_get::<_, String>(0), row.try_get::<_, String>(1)));
        match recorded {
            None => MutationResult::confirmed(id),
            Some((Ok(code), Ok(message))) => {
                let code = rejection::stable(&code);
                MutationResult::rejected(id, code, message)
            }
            Some(_) => MutationResult::retry(
                id,
                rejection::UNAVAILABLE,
                "could not read the recorded rejection",
            ),
        }
    }

    /// Applies one mutation in one upstream transaction (see the module docs); any failure
    /// drops the transaction, which rolls it back. Its statements are prepared on the
    /// connection before the transaction begins (once per connection and statement), and
    /// `highwater.confirm` runs first: it takes the client's row lock (one client's writers take
    /// turns) and raises `HW409` for a mutation handled before, so nothing else is asked then.
    async fn transact(
        &self,
        conn: &mut Conn,
        client_id: &str,
        mutation: &Mutation,
        table: &ReplicaTable,
        grant: &WriteGrant,
    ) -> Result<(), Failure> {
        let id = i64::try_from(mutation.id).map_err(|_| {
            Failure::refused(rejection::INVALID, "expected a mutation id below 2^63")
        })?;
        let row_json = Value::Object(mutation.row.clone()).to_string();
        let columns = || mutation.row.keys().map(String::as_str);
        let confirm = conn.prepared("SELECT highwater.confirm($1, $2)").await?;
        let lock = match mutation.op {
            MutationOp::Insert => None,
            MutationOp::Update | MutationOp::Delete => {
                Some(conn.prepared(&statement::lock_row(table)).await?)
            }
        };
        let write_sql = match mutation.op {
            MutationOp::Insert => Some(statement::insert(table, columns())),
            MutationOp::Update => statement::update(table, columns()),
            MutationOp::Delete => Some(statement::delete(table)),
        };
        let write = match write_sql {
            Some(sql) => Some(conn.prepared(&sql).await?),
            None => None,
        };
        let tx = conn.client.transaction().await?;
        tx.execute(&confirm, &[&client_id, &id]).await?;
        let op = mutation.op.as_str();
        // Whether a fence has brought the replica up to this transaction's start.
        let mut fenced = false;
        let old = match &lock {
            None => None,
            Some(lock) => {
                let Some(locked) = tx.query_opt(lock, &[&row_json]).await? else {
                    return Err(Failure::Refused {
                        code: rejection::CONFLICT,
                        message: format!("the {} row to {op} is gone", table.name),
                        row: Some(Value::Null),
                    });
                };
                let old = row_of(table, &locked)?;
                if !self.admits(grant, table, &old, &mut fenced).await? {
                    return Err(Failure::refused(
                        rejection::FORBIDDEN,
                        format!(
                            "the rules do not let this writer {op} that {} row",
                            table.name
                        ),
                    ));
                }
                if let Some(expected) = mutation.if_version {
                    self.fence_once(&mut fenced, "ifVersion").await?;
                    self.check_version(table, &old, expected, grant).await?;
                }
                Some(old)
            }
        };
        let written = match &write {
            Some(write) => tx.query_opt(write, &[&row_json]).await?,
            None => None,
        };
        if mutation.op != MutationOp::Delete {
            let new = match &written {
                Some(row) => Some(row_of(table, row)?),
                // No row back: an update naming only the key, or a trigger that skipped it.
                None => old,
            };
            let admitted = match &new {
                Some(new) => self.admits(grant, table, new, &mut fenced).await?,
                None => true,
            };
            if !admitted {
                return Err(Failure::refused(
                    rejection::FORBIDDEN,
                    format!(
                        "the rules do not let this writer {op} a {} row it could not read \
                         afterwards",
                        table.name
                    ),
                ));
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// Whether the writer may have `row` ([`WriteGrant::admission`]). A row filter whose
    /// answer hangs on its subqueries is answered by the replica once a fence has brought it up
    /// to everything committed upstream before now: read as it stood, it could trail the
    /// upstream by the replication lag, refusing a member just added for good and letting one
    /// just removed write (see the module docs).
    async fn admits(
        &self,
        grant: &WriteGrant,
        table: &ReplicaTable,
        row: &Map<String, Value>,
        fenced: &mut bool,
    ) -> Result<bool, Failure> {
        let filter = match grant.admission(row) {
            Admission::Decided(admitted) => return Ok(admitted),
            Admission::ReadSets(filter) => filter.clone(),
        };
        self.fence_once(fenced, "the rules' subqueries").await?;
        let (name, row) = (table.name.clone(), row.clone());
        let answer = self
            .replica
            .read(move |replica| replica.row_passes(&name, &filter, &row))
            .await
            .map_err(|error| {
                Failure::Unavailable(format!(
                    "could not read the replica for the write rules: {error}"
                ))
            })?;
        Ok(answer == Some(true))
    }

    /// Sends a fence unless this mutation's transaction has already sent one: one is enough,
    /// as it was sent after the row was locked.
    async fn fence_once(&self, fenced: &mut bool, what: &str) -> Result<(), Failure> {
        if !*fenced {
            self.fence(what).await?;
            *fenced = true;
        }
        Ok(())
    }

    /// `ifVersion`: the row's `serverSequence` in the replica, once the replica holds every
    /// change made before the row was locked (the caller has sent a fence), must be
    /// `expected`.
    async fn check_version(
        &self,
        table: &ReplicaTable,
        old: &Map<String, Value>,
        expected: i64,
        grant: &WriteGrant,
    ) -> Result<(), Failure> {
        let (replica_table, key_row) = (table.clone(), old.clone());
        let current = self
            .replica
            .read(move |replica| feed::row_with_seq(replica.connection(), &replica_table, &key_row))
            .await
            .map_err(|error| {
                Failure::Unavailable(format!("could not read the replica: {error}"))
            })?;
        match current {
            Some(current) if current.seq == expected => Ok(()),
            Some(feed::VersionedRow { data: row, seq }) => Err(Failure::Refused {
                code: rejection::CONFLICT,
                message: format!(
                    "the {} row changed since serverSequence {expected}: it is at {seq}",
                    table.name
                ),
                row: Some(Value::Object(grant.visible(row))),
            }),
            None => Err(Failure::Refused {
                code: rejection::CONFLICT,
                message: format!(
                    "the {} row is not at serverSequence {expected}: this node has no version \
                     of it",
                    table.name
                ),
                row: Some(Value::Object(grant.visible(old.clone()))),
            }),
        }
    }

    /// Sends a fence and waits until ingest has committed everything before it; `what` names
    /// the check that waits, for the answer when the replica does not catch up.
    async fn fence(&self, what: &str) -> Result<(), Failure> {
        let nonce = format!(
            "{}-{}",
            self.fence_prefix,
            self.next_fence.fetch_add(1, Ordering::Relaxed)
        );
        let (passed, released) = oneshot::channel();
        self.fences
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(nonce.clone(), passed);
        let waited = async {
            self.send_fence(&nonce).await?;
            match tokio::time::timeout(FENCE_TIMEOUT, released).await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(_)) => Err(Failure::Unavailable("the server is stopping".to_owned())),
                Err(_) => Err(Failure::Unavailable(format!(
                    "the replica did not catch up with the upstream Postgres within {} s, so \
                     {what} cannot be checked",
                    FENCE_TIMEOUT.as_secs()
                ))),
            }
        }
        .await;
        self.fences
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&nonce);
        waited
    }

    /// Writes the fence's logical message, on a connection of its own and in a transaction
    /// of its own: the mutation's transaction is still open, and a non-transactional message
    /// only reaches logical decoding once the WAL holding it is flushed (which the end of its
    /// own transaction asks the WAL writer for; Postgres 17+ flushes it at once when told to).
    async fn send_fence(&self, nonce: &str) -> Result<(), Failure> {
        let mut slot = self.fence_client.lock().await;
        if slot.as_ref().is_none_or(|(client, _)| client.is_closed()) {
            let client = pool::connect(&self.upstream)
                .await
                .map_err(|error| Failure::Unavailable(error.to_string()))?;
            let version: i32 = client
                .query_one("SELECT current_setting('server_version_num')::int", &[])
                .await?
                .try_get(0)?;
            *slot = Some((client, version >= 170_000));
        }
        let Some((client, flush)) = slot.as_ref() else {
            return Err(Failure::Unavailable(
                "no connection to send the fence on".to_owned(),
            ));
        };
        let sql = if *flush {
            format!(
                "SELECT pg_logical_emit_message(false, '{FENCE_MESSAGE_PREFIX}', $1::text, true)"
            )
        } else {
            format!("SELECT pg_logical_emit_message(false, '{FENCE_MESSAGE_PREFIX}', $1::text)")
        };
        client.execute(&sql, &[&nonce]).await?;
        Ok(())
    }
}

/// The checks made before Postgres is asked anything: the table, its columns and the rules.
fn check<'t>(
    claims: &Map<String, Value>,
    tables: &'t HashMap<String, ReplicaTable>,
    rules: &SyncRules,
    mutation: &Mutation,
) -> Result<(&'t ReplicaTable, WriteGrant), Failure> {
    let name = &mutation.table;
    let Some(table) = tables.get(name) else {
        return Err(Failure::refused(
            rejection::INVALID,
            format!("expected a replicated table, got {name:?}"),
        ));
    };
    if let Some(column) = mutation.row.keys().find(|c| table.column(c).is_none()) {
        return Err(Failure::refused(
            rejection::INVALID,
            format!("expected columns of {name:?}, got unknown column {column:?}"),
        ));
    }
    let grant = rules
        .decide_write(
            claims,
            name,
            mutation.op,
            mutation.row.keys().map(String::as_str),
            &table.key,
        )
        .map_err(|denial| {
            let code = match denial.code {
                DenialCode::Forbidden => rejection::FORBIDDEN,
                DenialCode::InvalidParams => rejection::INVALID,
            };
            Failure::refused(code, denial.message)
        })?;
    if table.key.is_empty() {
        return Err(Failure::refused(
            rejection::INVALID,
            format!("{name:?} has no primary key or replica identity index to find rows by"),
        ));
    }
    Ok((table, grant))
}

/// A row Postgres answered as `to_jsonb(…)::text`.
/// A row a write statement returned (its columns' text output, in the replica's column order;
/// see `statement`) with the values a reader of the replica sees: converted from the text as
/// pgoutput's is, then stored and read back as the replica does (timestamps as milliseconds,
/// `numeric` as a number, JSON parsed).
fn row_of(table: &ReplicaTable, row: &tokio_postgres::Row) -> Result<Map<String, Value>, Failure> {
    let texts: Vec<Option<String>> = row.try_get(0)?;
    if texts.len() != table.columns.len() {
        return Err(Failure::Unavailable(format!(
            "expected {} columns of {} from Postgres, got {}",
            table.columns.len(),
            table.name,
            texts.len()
        )));
    }
    let mut values = Map::new();
    for (column, text) in table.columns.iter().zip(texts) {
        let value = match text {
            None => Value::Null,
            Some(text) => {
                // As the initial sync reads COPY text: arrays of custom types are announced
                // as arrays, a column of unknown type is text.
                let announced_array = column.kind == ValueKind::Array && column.type_oid.is_some();
                let converted = TextColumn::new(column.type_oid.unwrap_or(25), announced_array)
                    .convert(text)
                    .map_err(|expected| {
                        Failure::Unavailable(format!(
                            "column {:?} of {}: expected {expected} from Postgres",
                            column.name, table.name
                        ))
                    })?;
                let stored = value::into_sql(column, converted, JsonFormat::Stringified);
                value::from_sql(
                    column,
                    rusqlite::types::ValueRef::from(&stored),
                    JsonFormat::Parsed,
                )
            }
        };
        values.insert(column.name.clone(), value);
    }
    Ok(values)
}

/// Read-only connections to the replica for the write checks, read on blocking threads: a
/// few, kept between reads, so the batches on the upstream connections read side by side.
struct ReplicaReader {
    path: PathBuf,
    idle: Arc<Mutex<Vec<Replica>>>,
}

/// Why the replica could not be read.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error("the replica read task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl ReplicaReader {
    fn new(path: PathBuf) -> ReplicaReader {
        ReplicaReader {
            path,
            idle: Arc::new(Mutex::new(Vec::new())),
        }
    }

    async fn read<T, F>(&self, read: F) -> Result<T, ReadError>
    where
        T: Send + 'static,
        F: FnOnce(&Replica) -> Result<T, ReplicaError> + Send + 'static,
    {
        let path = self.path.clone();
        let idle = self.idle.clone();
        let result = tokio::task::spawn_blocking(move || {
            let pooled = idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
            let replica = match pooled {
                Some(mut replica) => {
                    replica.refresh()?;
                    replica
                }
                None => Replica::open_read_only(&path)?,
            };
            let result = read(&replica);
            let mut idle = idle.lock().unwrap_or_else(PoisonError::into_inner);
            if idle.len() < pool::MAX_CONNECTIONS {
                idle.push(replica);
            }
            result
        })
        .await?;
        Ok(result?)
    }
}
