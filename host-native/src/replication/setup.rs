//! Upstream checks and objects on an ordinary `tokio-postgres` connection: `wal_level`,
//! `wal_sender_timeout`, the publication and the slot, named after an app id.

use std::str::FromStr;
use std::time::Duration;

use highwater_engine::watermark::Lsn;
use tokio_postgres::Client;

use super::connection::quote_ident;
#[cfg(any(test, feature = "test-support"))]
use super::connection::quote_literal;
use super::error::ReplicationError;

pub(crate) const DEFAULT_APP_ID: &str = "highwater";
const MAX_NAME_LEN: usize = 63;

/// Checks a Postgres object name against `^[a-z_][a-z0-9_]*$` and the 63-byte limit.
pub(crate) fn validate_name(kind: &'static str, name: &str) -> Result<(), ReplicationError> {
    let mut bytes = name.bytes();
    let first_ok = matches!(bytes.next(), Some(b'a'..=b'z' | b'_'));
    let rest_ok = bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'));
    if first_ok && rest_ok && name.len() <= MAX_NAME_LEN {
        Ok(())
    } else {
        Err(ReplicationError::InvalidName {
            kind,
            name: name.to_owned(),
        })
    }
}

/// The tables a publication FOR ALL TABLES holds, as a `WHERE` over `pg_class c` joined to
/// `pg_namespace n`: ordinary and partitioned tables (not partitions) outside the system
/// schemas.
pub(crate) const ALL_TABLES_WHERE: &str = "c.relkind IN ('r', 'p') AND NOT c.relispartition \
     AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_%'";

/// The upstream a read-only command inspects as `serve` would see it (`doctor`, `typegen`):
/// its URL, the app id naming the default publication, and the publications.
#[derive(Debug, Clone, clap::Args)]
pub struct UpstreamTarget {
    /// Postgres connection URL, as `serve --upstream` takes it.
    #[arg(long, env = "HIGHWATER_UPSTREAM", hide_env_values = true)]
    pub upstream: String,
    /// The app id `serve` runs with: names its slot and default publication (`<app-id>_pub`).
    #[arg(long, default_value = DEFAULT_APP_ID)]
    pub app_id: String,
    /// The publications `serve` replicates (default: `<app-id>_pub`, created for all tables at
    /// the first start).
    #[arg(long = "publication")]
    pub publications: Vec<String>,
}

impl UpstreamTarget {
    /// The publications `serve` would replicate: those given, else the app's default one.
    pub(crate) fn wanted_publications(&self, names: &ReplicationNames) -> Vec<String> {
        if self.publications.is_empty() {
            vec![names.publication.clone()]
        } else {
            self.publications.clone()
        }
    }
}

/// The publication and slot of one app: `<app>_pub` and `<app>_slot`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationNames {
    pub publication: String,
    pub slot: String,
}

impl ReplicationNames {
    pub fn for_app(app_id: &str) -> Result<Self, ReplicationError> {
        validate_name("app id", app_id)?;
        let names = ReplicationNames {
            publication: format!("{app_id}_pub"),
            slot: format!("{app_id}_slot"),
        };
        validate_name("publication", &names.publication)?;
        validate_name("slot", &names.slot)?;
        Ok(names)
    }
}

/// Server settings replication depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamSettings {
    pub server_version_num: u32,
    /// `None` when the server has the timeout disabled (0).
    pub wal_sender_timeout: Option<Duration>,
}

/// Reads the settings and fails with an actionable error unless `wal_level = logical`.
pub async fn check_upstream(client: &Client) -> Result<UpstreamSettings, ReplicationError> {
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), \
                    current_setting('server_version_num')::int4, \
                    (SELECT setting::int8 FROM pg_settings WHERE name = 'wal_sender_timeout')",
            &[],
        )
        .await?;
    let wal_level: String = row.try_get(0)?;
    if wal_level != "logical" {
        return Err(ReplicationError::WalLevelNotLogical { actual: wal_level });
    }
    let version: i32 = row.try_get(1)?;
    let timeout_ms: Option<i64> = row.try_get(2)?;
    Ok(UpstreamSettings {
        server_version_num: u32::try_from(version).unwrap_or(0),
        wal_sender_timeout: timeout_ms
            .and_then(|ms| u64::try_from(ms).ok())
            .filter(|&ms| ms > 0)
            .map(Duration::from_millis),
    })
}

/// A schema-qualified table for a publication's table list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

impl TableName {
    fn quoted(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }
}

/// Creates the publication if it is missing; returns whether it was created. With `tables`
/// `None` it publishes all tables (present and future); with a list, exactly those. An existing
/// publication is used as it stands, never altered.
pub async fn ensure_publication(
    client: &Client,
    publication: &str,
    tables: Option<&[TableName]>,
) -> Result<bool, ReplicationError> {
    validate_name("publication", publication)?;
    let exists = client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?
        .is_some();
    if exists {
        return Ok(false);
    }
    let target = match tables {
        None => "FOR ALL TABLES".to_owned(),
        Some(list) => format!(
            "FOR TABLE {}",
            list.iter()
                .map(TableName::quoted)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    client
        .batch_execute(&format!(
            "CREATE PUBLICATION {} {target}",
            quote_ident(publication)
        ))
        .await?;
    Ok(true)
}

/// A slot as `pg_replication_slots` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotState {
    pub(crate) plugin: Option<String>,
    pub active_pid: Option<i32>,
    pub(crate) restart_lsn: Option<Lsn>,
    pub confirmed_flush_lsn: Option<Lsn>,
    pub(crate) wal_status: Option<String>,
}

impl SlotState {
    /// A slot whose WAL is gone streams nothing ever again.
    pub fn is_invalidated(&self) -> bool {
        self.restart_lsn.is_none() || self.wal_status.as_deref() == Some("lost")
    }
}

pub async fn slot_state(
    client: &Client,
    slot: &str,
) -> Result<Option<SlotState>, ReplicationError> {
    let row = client
        .query_opt(
            "SELECT plugin::text, active_pid, restart_lsn::text, confirmed_flush_lsn::text, \
                    wal_status \
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let lsn = |i: usize| -> Result<Option<Lsn>, ReplicationError> {
        let text: Option<String> = row.try_get(i)?;
        text.map(|t| {
            Lsn::from_str(&t)
                .map_err(|_| ReplicationError::protocol("an LSN in pg_replication_slots", t))
        })
        .transpose()
    };
    Ok(Some(SlotState {
        plugin: row.try_get(0)?,
        active_pid: row.try_get(1)?,
        restart_lsn: lsn(2)?,
        confirmed_flush_lsn: lsn(3)?,
        wal_status: row.try_get(4)?,
    }))
}

/// Returns the slot, creating it with pgoutput if missing (without a snapshot: use
/// `ReplicationConnection::create_slot_with_snapshot` when an initial copy is needed).
/// An invalidated slot is an error naming the reset.
#[cfg(any(test, feature = "test-support"))]
pub async fn ensure_slot(client: &Client, slot: &str) -> Result<SlotState, ReplicationError> {
    validate_name("slot", slot)?;
    if let Some(state) = slot_state(client, slot).await? {
        if state.is_invalidated() {
            return Err(ReplicationError::SlotInvalidated {
                slot: slot.to_owned(),
                message: format!(
                    "pg_replication_slots shows wal_status {}",
                    state.wal_status.as_deref().unwrap_or("unknown")
                ),
            });
        }
        return Ok(state);
    }
    // Run alone: the function refuses a transaction that has already written.
    client
        .batch_execute(&format!(
            "SELECT pg_create_logical_replication_slot({}, 'pgoutput')",
            quote_literal(slot)
        ))
        .await?;
    slot_state(client, slot)
        .await?
        .ok_or_else(|| ReplicationError::SlotMissing {
            slot: slot.to_owned(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_derive_from_the_app_id() {
        let names = ReplicationNames::for_app(DEFAULT_APP_ID).unwrap();
        assert_eq!(names.publication, "highwater_pub");
        assert_eq!(names.slot, "highwater_slot");
    }

    #[test]
    fn bad_names_are_rejected_with_the_rule_in_the_message() {
        for bad in [
            "",
            "9lives",
            "Upper",
            "with-dash",
            "sp ace",
            "quote\"",
            &"a".repeat(64),
        ] {
            let err = validate_name("slot", bad).unwrap_err();
            assert!(err.to_string().contains("^[a-z_][a-z0-9_]*$"), "{err}");
        }
        validate_name("slot", &"a".repeat(63)).unwrap();
        validate_name("slot", "_x9").unwrap();
    }

    #[test]
    fn an_app_id_too_long_for_its_derived_names_is_rejected() {
        assert!(ReplicationNames::for_app(&"a".repeat(58)).is_ok());
        assert!(
            ReplicationNames::for_app(&"a".repeat(59)).is_err(),
            "<app>_slot would be 64"
        );
    }

    proptest! {
        #[test]
        fn validation_matches_the_pattern(name in "[a-zA-Z0-9_\\-]{0,70}") {
            let expected = !name.is_empty()
                && name.len() <= 63
                && name.chars().next().is_some_and(|c| c.is_ascii_lowercase() || c == '_')
                && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            prop_assert_eq!(validate_name("slot", &name).is_ok(), expected);
        }
    }
}
