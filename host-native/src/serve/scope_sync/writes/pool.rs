//! A few ordinary upstream connections for applying writes, reused between batches.
//!
//! A semaphore and a stack of idle clients rather than a pool crate (deadpool-postgres): our
//! connections come through [`PgConfig::connect`], which negotiates Highwater's own TLS (and
//! refuses a cleartext password over plain TCP), while a pool crate connects by itself from a
//! tokio-postgres `Config` and a connector of its own.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_postgres::{Client, Statement};

use crate::replication::{PgConfig, PgErrorText, ReplicationError};

/// Why no upstream connection could be had: the batch's mutations are answered `retry`.
#[derive(Debug, thiserror::Error)]
pub(super) enum ConnectError {
    #[error("could not connect to the upstream Postgres within {} s", CONNECT_TIMEOUT.as_secs())]
    Timeout,
    #[error("could not connect to the upstream Postgres: {0}")]
    Connect(#[source] ReplicationError),
    #[error("could not set up an upstream write connection: {}", PgErrorText(.0))]
    Setup(tokio_postgres::Error),
    #[error("the server is stopping")]
    Closed,
}

/// Upstream connections that apply writes at once, at most.
pub(super) const MAX_CONNECTIONS: usize = 4;
/// How long opening one may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Set on every connection: a mutation waits this long at most for a row another transaction
/// holds (then it is answered `retry`), and a statement runs this long at most.
const SESSION_SQL: &str = "SET lock_timeout = '10s'; SET statement_timeout = '30s'";

pub(super) struct Pool {
    upstream: PgConfig,
    permits: std::sync::Arc<Semaphore>,
    idle: Mutex<Vec<Conn>>,
}

/// Statements a connection keeps prepared, at most (then it starts again).
const MAX_PREPARED: usize = 256;

/// An upstream connection and the statements prepared on it: a mutation runs prepared
/// statements, one round trip each, where an unprepared one costs two.
pub(super) struct Conn {
    pub client: Client,
    prepared: HashMap<String, Statement>,
}

impl Conn {
    /// `sql` prepared on this connection (once).
    pub(super) async fn prepared(&mut self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        if let Some(statement) = self.prepared.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare(sql).await?;
        if self.prepared.len() >= MAX_PREPARED {
            self.prepared.clear();
        }
        self.prepared.insert(sql.to_owned(), statement.clone());
        Ok(statement)
    }

    /// Forgets the prepared statements (a schema change may have made one stale).
    pub(super) fn forget_prepared(&mut self) {
        self.prepared.clear();
    }
}

/// A connection taken from the pool; give it back with [`Pool::put`].
pub(super) struct Pooled {
    pub conn: Conn,
    _permit: OwnedSemaphorePermit,
}

impl Pool {
    pub(super) fn new(upstream: PgConfig) -> Pool {
        Pool {
            upstream,
            permits: std::sync::Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            idle: Mutex::new(Vec::new()),
        }
    }

    /// An idle connection, or a new one; waits while [`MAX_CONNECTIONS`] are in use.
    pub(super) async fn get(&self) -> Result<Pooled, ConnectError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ConnectError::Closed)?;
        loop {
            let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match idle {
                Some(conn) if conn.client.is_closed() => continue,
                Some(conn) => {
                    return Ok(Pooled {
                        conn,
                        _permit: permit,
                    })
                }
                None => break,
            }
        }
        let client = connect(&self.upstream).await?;
        Ok(Pooled {
            conn: Conn {
                client,
                prepared: HashMap::new(),
            },
            _permit: permit,
        })
    }

    /// Gives a connection back for the next batch (a closed one is dropped).
    pub(super) fn put(&self, pooled: Pooled) {
        if !pooled.conn.client.is_closed() {
            self.idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(pooled.conn);
        }
    }
}

/// A new upstream connection with the write session's settings.
pub(super) async fn connect(upstream: &PgConfig) -> Result<Client, ConnectError> {
    let (client, connection) = tokio::time::timeout(CONNECT_TIMEOUT, upstream.connect())
        .await
        .map_err(|_| ConnectError::Timeout)?
        .map_err(ConnectError::Connect)?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "upstream write connection ended");
        }
    });
    client
        .batch_execute(SESSION_SQL)
        .await
        .map_err(ConnectError::Setup)?;
    Ok(client)
}
