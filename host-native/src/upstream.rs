//! The host's side of the engine's upstream session (`highwater_engine::upstream`), shared by
//! `replicate` and `serve` (a Postgres source or a relay's primary): the one effect loop
//! ([`feed`], [`carry`]) that both commands run their session through, what each command
//! supplies to it ([`EffectHost`]: where messages are stored, where confirmations go), and the
//! effects that need the replica's schema or upstream's catalog. Nothing here decides what to
//! skip, what to confirm or when: the session does; this only carries out what it asked for,
//! in its order, and reports completions back.
//!
//! Both commands run one ingest loop (`crate::ingest`), which is the [`EffectHost`]; they
//! differ only in where it stores and where its input comes from. Backfills stream through the
//! session in both. Before a schema change is computed against the replica,
//! [`EffectHost::settle`] has every store asked for carried out, a transaction held whole until
//! its commit included, so a second DDL in one transaction sees what the first one did.

use std::collections::{HashMap, VecDeque};

use highwater_engine::change_stream::{Begin, Change, DownstreamMessage};
use highwater_engine::pgoutput::{Relation, ReplicaIdentity, TextRowChange};
use highwater_engine::upstream::{
    carried_at_stop, Effect, Input, SessionConfig, SessionError, UpstreamSession,
};
use highwater_engine::watermark::{Lsn, Watermark};
use tokio::runtime::Handle;
use tokio_postgres::Client;

use crate::replica::ddl::{relation_changes, schema_changes, RelationType};
use crate::replica::{Replica, ReplicaError};
use crate::replication::backfill::{
    BackfillItem, BackfillPlanner, BackfillStream, RecentXids, BACKFILL_BATCH_ROWS,
};
use crate::replication::initial_sync::SyncError;
use crate::replication::published_schema::{
    ddl_prefix, in_publications, parse_ddl_event, PRIMARY_KEY_SQL, RELATION_TYPES_SQL,
};
use crate::replication::PgConfig;

/// Why an effect could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum EffectError {
    #[error("expected a DDL event as JSON, found {0}")]
    DdlEvent(serde_json::Error),
    #[error(transparent)]
    Replica(#[from] ReplicaError),
    #[error("cannot connect to the upstream Postgres: {0}")]
    Connect(String),
    #[error("upstream catalog query failed: {}", crate::replication::PgErrorText(.0))]
    Catalog(#[from] tokio_postgres::Error),
    #[error("a Relation message arrived from a source without a Postgres catalog")]
    NoCatalog,
}

/// What a command carries the session's effects out with.
pub(crate) trait EffectHost {
    type Error: From<SessionError> + From<EffectError>;

    fn session(&mut self) -> &mut UpstreamSession;

    /// Hands a message on to storage; returns the commits that are durable now (a store
    /// that commits later reports them from [`EffectHost::settle`] or on its own).
    fn apply(&mut self, message: DownstreamMessage) -> Result<Vec<Watermark>, Self::Error>;

    /// Hands on a row change whose values kept their text (a session told to keep row text);
    /// by default, as the `data` message it stands for.
    fn apply_text(&mut self, change: TextRowChange) -> Result<Vec<Watermark>, Self::Error> {
        self.apply(DownstreamMessage::Data(change.to_change()))
    }

    /// Carries out every store asked for so far; returns the commits that became durable.
    fn settle(&mut self) -> Result<Vec<Watermark>, Self::Error>;

    /// Confirms `lsn` to Postgres.
    fn confirm(&mut self, lsn: Lsn);

    /// Acknowledges frames of the primary (a relay).
    fn ack_frames(&mut self, ids: Vec<u64>);

    /// Ends the connection to the primary once `acks` are sent (a relay).
    fn reconnect(&mut self, reason: String, restore: bool, acks: Vec<u64>);

    /// The replica, as of every message applied and settled.
    fn replica(&self) -> &Replica;

    fn publications(&self) -> &[String];

    /// [`reconcile_relation`] with this command's catalog.
    fn reconcile(&mut self, relation: &Relation) -> Result<Vec<Change>, Self::Error>;

    /// The source is between transactions with nothing new.
    fn idle(&mut self);

    /// The open transaction applies a sync client's mutation
    /// ([`Effect::Confirmed`]): stored with
    /// its data. A command that serves no sync clients ignores it.
    fn confirmed(&mut self, _client_id: String, _mutation_id: u64) -> Result<(), Self::Error> {
        Ok(())
    }

    /// A fence passed ([`Effect::Fence`]): release
    /// its waiter once everything before it is readable in the replica. A command that takes
    /// no writes ignores it.
    fn fence(&mut self, _nonce: String) -> Result<(), Self::Error> {
        Ok(())
    }

    /// The backfills this command reads from upstream itself, beside the replica they fill;
    /// `None` for a relay (its primary streams them).
    fn backfills(&mut self) -> Option<(&mut Backfills, &Replica)>;

    fn handle(&self) -> &Handle;
}

/// Feeds `input` to the host's session and carries out what it says.
pub(crate) fn feed<H: EffectHost>(host: &mut H, input: Input<'_>) -> Result<(), H::Error> {
    let effects = host.session().handle(input)?;
    carry(host, effects)
}

/// Carries out `effects` in order; what a completion feeds back is carried out before the
/// rest.
pub(crate) fn carry<H: EffectHost>(host: &mut H, effects: Vec<Effect>) -> Result<(), H::Error> {
    let mut queue: VecDeque<Effect> = effects.into();
    while let Some(effect) = queue.pop_front() {
        let mut inputs: Vec<Input<'static>> = Vec::new();
        let stored = |watermark| Input::Stored { watermark };
        match effect {
            Effect::Apply(message) => inputs.extend(host.apply(message)?.into_iter().map(stored)),
            Effect::ApplyText(change) => {
                inputs.extend(host.apply_text(change)?.into_iter().map(stored))
            }
            Effect::Ack(lsn) => host.confirm(lsn),
            Effect::AckFrames(ids) => host.ack_frames(ids),
            Effect::Reconnect {
                reason,
                restore,
                acks,
            } => host.reconnect(reason, restore, acks),
            Effect::ResolveDdl { content } => {
                // Against the replica as of every message before.
                inputs.extend(host.settle()?.into_iter().map(stored));
                let changes = resolve_ddl(host.replica(), host.publications(), &content)?;
                inputs.push(Input::SchemaChanges(changes));
            }
            Effect::ReconcileRelation(relation) => {
                inputs.extend(host.settle()?.into_iter().map(stored));
                inputs.push(Input::SchemaChanges(host.reconcile(&relation)?));
            }
            Effect::Idle { .. } => host.idle(),
            Effect::BackfillDue => {
                // The replica's schema and pending columns as of the last commit forwarded.
                inputs.extend(host.settle()?.into_iter().map(stored));
                let position = host.session().last_commit().clone();
                let handle = host.handle().clone();
                if let Some((backfills, replica)) = host.backfills() {
                    if backfills.start(&handle, replica, &position) {
                        inputs.push(Input::BackfillStarted);
                    }
                }
            }
            Effect::Confirmed {
                client_id,
                mutation_id,
            } => host.confirmed(client_id, mutation_id)?,
            Effect::Fence { nonce } => host.fence(nonce)?,
            Effect::Warn(message) => tracing::warn!("{message}"),
        }
        let mut more = Vec::new();
        for input in inputs {
            more.extend(host.session().handle(input)?);
        }
        for effect in more.into_iter().rev() {
            queue.push_front(effect);
        }
    }
    Ok(())
}

/// Reports `watermark` stored to the host's session after its loop ended, and of what follows
/// carries out only the confirmations (the engine's `upstream::carried_at_stop`): nothing new
/// starts at a stop.
pub(crate) fn stored_at_stop<H: EffectHost>(
    host: &mut H,
    watermark: Watermark,
) -> Result<(), H::Error> {
    let effects = host.session().handle(Input::Stored { watermark })?;
    for effect in effects.into_iter().filter(carried_at_stop) {
        match effect {
            Effect::Ack(lsn) => host.confirm(lsn),
            Effect::AckFrames(ids) => host.ack_frames(ids),
            _ => {}
        }
    }
    Ok(())
}

/// `duration` in whole microseconds, rounded up (a wait never ends before its deadline).
pub(crate) fn micros_ceil(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_nanos().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// A session over storage whose newest durable commit is `stored`, started from `start`.
pub(crate) fn session(app_id: &str, stored: Watermark, start: Lsn) -> UpstreamSession {
    UpstreamSession::new(
        SessionConfig {
            ddl_prefix: ddl_prefix(app_id),
        },
        stored,
        start,
    )
}

/// [`Effect::ResolveDdl`]: the schema changes a
/// DDL event implies for the replica as it is now.
pub(crate) fn resolve_ddl(
    replica: &Replica,
    publications: &[String],
    content: &[u8],
) -> Result<Vec<Change>, EffectError> {
    let ddl = parse_ddl_event(content).map_err(EffectError::DdlEvent)?;
    let tables = in_publications(ddl.schema, publications);
    let changes = schema_changes(replica, &tables, &ddl.tag)?;
    for change in &changes {
        tracing::info!(change = change.tag(), "schema change");
    }
    Ok(changes)
}

/// An ordinary connection for catalog queries, opened when first needed and reopened after
/// upstream restarts.
pub(crate) struct Catalog {
    config: PgConfig,
    client: Option<Client>,
}

impl Catalog {
    pub(crate) fn new(config: PgConfig) -> Catalog {
        Catalog {
            config,
            client: None,
        }
    }

    fn client(&mut self, handle: &Handle) -> Result<&Client, EffectError> {
        if self.client.as_ref().is_none_or(Client::is_closed) {
            let (client, connection) = handle
                .block_on(self.config.connect())
                .map_err(|e| EffectError::Connect(e.to_string()))?;
            handle.spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%error, "upstream query connection ended");
                }
            });
            self.client = Some(client);
        }
        self.client.as_ref().ok_or(EffectError::NoCatalog)
    }
}

/// For [`Effect::ReconcileRelation`], what
/// the Relation message shows and the replica lacks (see `replica::ddl::relation_changes`);
/// nothing when the replica has every column already (the DDL event came first). Blocking:
/// call it on a thread of `handle`'s runtime that may block.
pub(crate) fn reconcile_relation(
    handle: &Handle,
    catalog: Option<&mut Catalog>,
    replica: &Replica,
    relation: &Relation,
) -> Result<Vec<Change>, EffectError> {
    let name = crate::replica::schema::replica_table_name(&relation.namespace, &relation.name);
    let known = replica.table(&name).is_some_and(|table| {
        relation
            .columns
            .iter()
            .all(|c| table.column(&c.name).is_some())
    });
    if known {
        return Ok(Vec::new());
    }
    let client = catalog.ok_or(EffectError::NoCatalog)?.client(handle)?;
    let oids: Vec<u32> = relation.columns.iter().map(|c| c.type_oid).collect();
    let types = handle
        .block_on(client.query(RELATION_TYPES_SQL, &[&oids]))?
        .iter()
        .map(|row| {
            Ok((
                row.try_get::<_, u32>(0)?,
                RelationType {
                    data_type: row.try_get(1)?,
                    typtype: row.try_get(2)?,
                    elem_typtype: row.try_get(3)?,
                },
            ))
        })
        .collect::<Result<HashMap<_, _>, tokio_postgres::Error>>()?;
    let key = if relation.replica_identity == ReplicaIdentity::Full {
        let rows = handle.block_on(client.query(PRIMARY_KEY_SQL, &[&relation.oid]))?;
        Some(
            rows.iter()
                .map(|r| r.try_get(0))
                .collect::<Result<Vec<String>, _>>()?,
        )
    } else {
        None
    };
    let changes = relation_changes(replica, relation, &types, key);
    for change in &changes {
        tracing::warn!(
            table = %name,
            change = change.tag(),
            "the replica learns of a table or column from the stream rather than from a DDL \
             event; it is backfilled"
        );
    }
    Ok(changes)
}

/// The backfills a command reads from upstream itself (`replica::backfill`), as a second
/// source of transactions for the session: started when it says one may start, their messages
/// fed to it until their commit.
pub(crate) struct Backfills {
    upstream: PgConfig,
    planner: BackfillPlanner,
    /// The one running, and its table.
    running: Option<(BackfillStream, String)>,
    recent_xids: RecentXids,
}

impl Backfills {
    pub(crate) fn new(upstream: PgConfig) -> Backfills {
        Backfills {
            upstream,
            planner: BackfillPlanner::new(),
            running: None,
            recent_xids: RecentXids::default(),
        }
    }

    /// An upstream transaction began: the next backfill's snapshot must see it.
    pub(crate) fn note(&mut self, begin: &Begin) {
        self.recent_xids.note(begin);
    }

    /// The running backfill's next item (pending forever when none runs).
    pub(crate) async fn next(&mut self) -> Option<Result<BackfillItem, SyncError>> {
        match &mut self.running {
            Some((stream, _)) => stream.next().await,
            None => std::future::pending().await,
        }
    }

    /// Starts the next backfill the replica waits for, planned at `position`; `true` if one
    /// started.
    fn start(&mut self, handle: &Handle, replica: &Replica, position: &Watermark) -> bool {
        if self.running.is_some() || !replica.has_pending_backfills() {
            return false;
        }
        let xids = self.recent_xids.to_vec();
        let Some(job) = self
            .planner
            .next_job(replica, position, &xids, BACKFILL_BATCH_ROWS)
        else {
            return false;
        };
        tracing::info!(
            table = %job.table.name,
            columns = ?job.pending.columns,
            watermark = %job.commit_watermark,
            "backfilling"
        );
        let table = job.table.name.clone();
        let stream = BackfillStream::spawn(handle, &self.upstream, job);
        self.running = Some((stream, table));
        true
    }
}

/// Feeds an item of the running backfill to the host's session: its messages until its commit,
/// then its end; a failure (or an end before the commit) ends it too, and it is tried again
/// after the next transaction or its retry delay ([`backfill_retry_in`]).
pub(crate) fn backfill_item<H: EffectHost>(
    host: &mut H,
    item: Option<Result<BackfillItem, SyncError>>,
) -> Result<(), H::Error> {
    let in_transaction = host.session().in_transaction();
    let position = host.session().last_commit().clone();
    let Some((backfills, _)) = host.backfills() else {
        return Ok(());
    };
    let table = backfills
        .running
        .as_ref()
        .map(|(_, table)| table.clone())
        .unwrap_or_default();
    let failure = match item {
        Some(Ok(BackfillItem::Message(message))) => {
            let commit = matches!(message, DownstreamMessage::Commit(_));
            feed(host, Input::Backfill(message))?;
            if commit {
                if let Some((backfills, _)) = host.backfills() {
                    backfills.planner.on_completed();
                }
                end_backfill(host)?;
            }
            return Ok(());
        }
        Some(Ok(BackfillItem::Missing { columns, snapshot })) => {
            tracing::info!(%table, ?columns, "columns to backfill are not upstream yet");
            backfills.planner.on_missing(&table, &columns, &snapshot);
            return Ok(());
        }
        Some(Err(error)) => Some(error.to_string()),
        None if in_transaction => Some("the backfill ended before its commit".to_owned()),
        None => None,
    };
    if let Some(error) = failure {
        backfills
            .planner
            .on_failed(&table, &position, std::time::Instant::now());
        let retry_in = backfill_retry_in(Some(backfills));
        tracing::warn!(
            %table,
            %error,
            ?retry_in,
            "backfill failed; retrying after the next transaction or the delay"
        );
    }
    // Subscribers that saw a failed backfill's beginning get a rollback (the session hands it
    // on); nothing of it is stored.
    end_backfill(host)
}

/// How long until a failed backfill may be tried again with no upstream commit in between;
/// `None` when none waits. A host about to wait for input waits at most this long, then calls
/// [`retry_backfills`].
pub(crate) fn backfill_retry_in(backfills: Option<&Backfills>) -> Option<std::time::Duration> {
    let at = backfills?.planner.retry_at()?;
    Some(at.saturating_duration_since(std::time::Instant::now()))
}

/// Releases the failed backfills whose delay passed and tells the session, which starts one
/// as soon as nothing is in between ([`Effect::BackfillDue`]).
pub(crate) fn retry_backfills<H: EffectHost>(host: &mut H) -> Result<(), H::Error> {
    let released = host
        .backfills()
        .is_some_and(|(backfills, _)| backfills.planner.release_due(std::time::Instant::now()));
    if released {
        feed(host, Input::RetryBackfills)?;
    }
    Ok(())
}

fn end_backfill<H: EffectHost>(host: &mut H) -> Result<(), H::Error> {
    if let Some((backfills, _)) = host.backfills() {
        backfills.running = None;
    }
    feed(host, Input::BackfillEnded)
}
