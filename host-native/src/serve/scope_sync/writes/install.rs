//! The upstream half of writes: schema `highwater`, installed by `serve` at its start on a
//! primary whose sync rules allow writes. Idempotent: the tables are created when missing (so
//! the DDL event trigger hears of them once), the functions are replaced every time.
//!
//! `highwater.confirm(client_id, mutation_id)` is public: an app that applies a client's
//! mutation in its own backend calls it in the write's transaction, and the client's
//! `await-mutations` is answered once that transaction reaches the replica. Keep its name,
//! arguments and SQLSTATE.

use crate::replication::{PgConfig, PgErrorText, ReplicationError};

/// Creates schema `highwater`: the last mutation of each client, the rejections (so that a
/// resent mutation gets the answer it got the first time), and the functions that advance
/// them. A client's row is locked by the first call in a transaction, so one client's writers
/// take turns; its last mutation id only grows.
pub(super) const WRITES_SQL: &str = r#"
CREATE SCHEMA IF NOT EXISTS highwater;
DO $hw$
BEGIN
  IF to_regclass('highwater.client_mutations') IS NULL THEN
    CREATE TABLE highwater.client_mutations (
      client_id text PRIMARY KEY,
      last_mutation_id bigint NOT NULL,
      updated_at timestamptz NOT NULL DEFAULT now()
    );
  END IF;
  IF to_regclass('highwater.rejected_mutations') IS NULL THEN
    CREATE TABLE highwater.rejected_mutations (
      client_id text,
      mutation_id bigint,
      code text NOT NULL,
      message text NOT NULL,
      at timestamptz NOT NULL DEFAULT now(),
      PRIMARY KEY (client_id, mutation_id)
    );
  END IF;
END
$hw$;

-- Advances the client's last mutation id to mutation_id, or raises HW409 when it is not above it.
CREATE OR REPLACE FUNCTION highwater.advance_mutation(client_id text, mutation_id bigint)
  RETURNS void LANGUAGE plpgsql AS $hw$
#variable_conflict use_column
DECLARE
  previous bigint;
BEGIN
  IF $1 IS NULL OR $1 !~ '^[A-Za-z0-9_-]{1,64}$' THEN
    RAISE EXCEPTION 'expected a client id of 1 to 64 letters, digits, - or _, got %',
      coalesce(quote_literal($1), 'NULL') USING ERRCODE = '22023';
  END IF;
  IF $2 IS NULL OR $2 < 1 THEN
    RAISE EXCEPTION 'expected a positive mutation id, got %', coalesce($2::text, 'NULL')
      USING ERRCODE = '22023';
  END IF;
  INSERT INTO highwater.client_mutations AS m (client_id, last_mutation_id)
  VALUES ($1, $2)
  ON CONFLICT (client_id) DO UPDATE
    SET last_mutation_id = excluded.last_mutation_id, updated_at = now()
    WHERE m.last_mutation_id < excluded.last_mutation_id;
  IF NOT FOUND THEN
    SELECT m.last_mutation_id INTO previous FROM highwater.client_mutations m WHERE m.client_id = $1;
    RAISE EXCEPTION 'mutation % of client % was applied already (its last mutation is %)',
      $2, $1, previous USING ERRCODE = 'HW409';
  END IF;
END
$hw$;

-- In the transaction that applies a client's mutation: records it as the client's last, and
-- tells Highwater through the transaction's logical decoding message.
CREATE OR REPLACE FUNCTION highwater.confirm(client_id text, mutation_id bigint)
  RETURNS void LANGUAGE plpgsql AS $hw$
BEGIN
  PERFORM highwater.advance_mutation($1, $2);
  PERFORM pg_logical_emit_message(true, 'highwater.confirm',
    json_build_object('clientId', $1, 'mutationId', $2)::text);
END
$hw$;

-- Records that a client's mutation was refused for good (and advances its last mutation id).
CREATE OR REPLACE FUNCTION highwater.reject(client_id text, mutation_id bigint, code text,
                                            message text)
  RETURNS void LANGUAGE plpgsql AS $hw$
#variable_conflict use_column
BEGIN
  PERFORM highwater.advance_mutation($1, $2);
  INSERT INTO highwater.rejected_mutations (client_id, mutation_id, code, message)
  VALUES ($1, $2, $3, $4);
END
$hw$;
"#;

/// Why the write functions could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("cannot connect to the upstream Postgres to install the write functions")]
    Connect(#[source] ReplicationError),
    #[error(
        "cannot install the write functions (schema highwater) upstream: {}",
        PgErrorText(.0)
    )]
    Sql(tokio_postgres::Error),
}

/// Installs [`WRITES_SQL`] upstream.
pub(crate) async fn install(upstream: &PgConfig) -> Result<(), InstallError> {
    let (client, connection) = upstream.connect().await.map_err(InstallError::Connect)?;
    let connection = tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "write setup connection ended");
        }
    });
    let installed = client
        .batch_execute(WRITES_SQL)
        .await
        .map_err(InstallError::Sql);
    drop(client);
    let _ = connection.await;
    installed
}
