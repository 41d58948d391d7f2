//! The host's side of the engine's upstream session (`highwater_engine::upstream`), shared by
//! `replicate` and `serve` (a Postgres source or a relay's primary): how a session is set up
//! over a replica, and how the effects that need the replica's schema or upstream's catalog
//! are carried out. Neither command decides here what to skip, what to confirm or when: the
//! session does; these functions only compute what it asked for.

use std::collections::HashMap;

use highwater_engine::change_stream::Change;
use highwater_engine::pgoutput::{Relation, ReplicaIdentity};
use highwater_engine::upstream::{SessionConfig, UpstreamSession};
use highwater_engine::watermark::{Lsn, Watermark};
use tokio::runtime::Handle;
use tokio_postgres::Client;

use crate::replica::ddl::{
    ddl_prefix, in_publications, parse_ddl_event, relation_changes, schema_changes, RelationType,
    PRIMARY_KEY_SQL, RELATION_TYPES_SQL,
};
use crate::replica::{Replica, ReplicaError};
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
    #[error("upstream catalog query failed: {0}")]
    Catalog(#[from] tokio_postgres::Error),
    #[error("a Relation message arrived from a source without a Postgres catalog")]
    NoCatalog,
}

/// A session over storage whose newest durable commit is `stored`, started from `start`.
pub fn session(app_id: &str, stored: Watermark, start: Lsn) -> UpstreamSession {
    UpstreamSession::new(
        SessionConfig {
            ddl_prefix: ddl_prefix(app_id),
        },
        stored,
        start,
    )
}

/// [`Effect::ResolveDdl`](highwater_engine::upstream::Effect::ResolveDdl): the schema changes a
/// DDL event implies for the replica as it is now.
pub fn resolve_ddl(
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
pub struct Catalog {
    config: PgConfig,
    client: Option<Client>,
}

impl Catalog {
    pub fn new(config: PgConfig) -> Catalog {
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

/// [`Effect::ReconcileRelation`](highwater_engine::upstream::Effect::ReconcileRelation): what
/// the Relation message shows and the replica lacks (see `replica::ddl::relation_changes`);
/// nothing when the replica has every column already (the DDL event came first). Blocking:
/// call it on a thread of `handle`'s runtime that may block.
pub fn reconcile_relation(
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
