//! What can go wrong on the Postgres side of replication, split by what a caller does about it.

use std::fmt;
use std::time::Duration;

/// SQLSTATE `55006` object_in_use: another walsender holds the slot.
pub(crate) const OBJECT_IN_USE: &str = "55006";
/// SQLSTATE `55000` object_not_in_prerequisite_state: slot invalidated, wal_level too low, …
pub(crate) const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
/// SQLSTATE `42704` undefined_object: the slot does not exist.
pub(crate) const UNDEFINED_OBJECT: &str = "42704";
/// SQLSTATE class `28`: invalid authorization specification / invalid password.
const AUTH_CLASS: &str = "28";

/// An `ErrorResponse` from the server, with the fields a person needs to act on it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServerError {
    pub(crate) severity: String,
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.severity, self.code, self.message)?;
        if let Some(detail) = &self.detail {
            write!(f, " ({detail})")?;
        }
        if let Some(hint) = &self.hint {
            write!(f, " Hint: {hint}")?;
        }
        Ok(())
    }
}

impl ServerError {
    /// Whether this error says the slot lost the WAL it needs (it will never stream again).
    fn means_slot_invalidated(&self) -> bool {
        let text = format!(
            "{} {}",
            self.message,
            self.detail.as_deref().unwrap_or_default()
        );
        let wal_gone = text.contains("can no longer get changes")
            || text.contains("has already been removed")
            || text.contains("has been invalidated")
            || text.contains("cannot read from logical replication slot");
        wal_gone || (self.code == OBJECT_NOT_IN_PREREQUISITE_STATE && text.contains("slot"))
    }

    fn means_wal_level_too_low(&self) -> bool {
        self.code == OBJECT_NOT_IN_PREREQUISITE_STATE && self.message.contains("wal_level")
    }
}

/// A tokio-postgres error as a person needs to read it: its own text says only "db error" for
/// what the server answered, so the server's severity, SQLSTATE, message, detail and hint are
/// added (as [`ServerError`] shows them).
pub(crate) struct PgErrorText<'a>(pub &'a tokio_postgres::Error);

impl fmt::Display for PgErrorText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_db_error() {
            Some(db) => ServerError {
                severity: db.severity().to_owned(),
                code: db.code().code().to_owned(),
                message: db.message().to_owned(),
                detail: db.detail().map(str::to_owned),
                hint: db.hint().map(str::to_owned),
            }
            .fmt(f),
            None => match std::error::Error::source(self.0) {
                Some(source) => write!(f, "{}: {source}", self.0),
                None => self.0.fmt(f),
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    #[error("Invalid connection settings: {0}")]
    Config(String),

    #[error("Could not connect to Postgres at {target}: {source}")]
    Connect {
        target: String,
        #[source]
        source: std::io::Error,
    },

    #[error("Could not set up TLS to Postgres at {target}: {reason}")]
    Tls { target: String, reason: String },

    #[error("I/O error on the Postgres connection: {0}")]
    Io(#[from] std::io::Error),

    #[error("Postgres closed the replication connection")]
    Closed,

    #[error("Authentication as \"{user}\" failed: {reason}")]
    Auth { user: String, reason: String },

    #[error(
        "Replication slot \"{slot}\" is in use by another connection ({attempts} attempts): \
         {message}. Stop the other consumer, or end it with \
         SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = '{slot}'"
    )]
    SlotInUse {
        slot: String,
        attempts: u32,
        message: String,
    },

    #[error(
        "Replication slot \"{slot}\" can no longer stream changes: {message}. The WAL it needs is \
         gone; reset with SELECT pg_drop_replication_slot('{slot}') and resynchronise from a new \
         snapshot (consider raising max_slot_wal_keep_size)"
    )]
    SlotInvalidated { slot: String, message: String },

    #[error(
        "Replication slot \"{slot}\" does not exist; create it (initial sync) before streaming"
    )]
    SlotMissing { slot: String },

    #[error(
        "Logical replication needs wal_level = logical, but the server has wal_level = {actual}; \
         set it in postgresql.conf (ALTER SYSTEM SET wal_level = logical) and restart Postgres"
    )]
    WalLevelNotLogical { actual: String },

    #[error(
        "Invalid {kind} name \"{name}\": expected 1 to 63 characters matching ^[a-z_][a-z0-9_]*$"
    )]
    InvalidName { kind: &'static str, name: String },

    #[error("Postgres reported {0}")]
    Server(ServerError),

    #[error("Unexpected reply from Postgres: expected {expected}, got {got}")]
    Protocol { expected: String, got: String },

    #[error(
        "No message from Postgres for {:.1} s (twice wal_sender_timeout); the replication \
         connection is considered dead",
        .silence.as_secs_f64()
    )]
    Silent { silence: Duration },

    #[error("Postgres query failed: {}", PgErrorText(.0))]
    Query(#[from] tokio_postgres::Error),
}

impl ReplicationError {
    pub(crate) fn protocol(expected: impl Into<String>, got: impl Into<String>) -> Self {
        ReplicationError::Protocol {
            expected: expected.into(),
            got: got.into(),
        }
    }

    /// Maps a server error raised while working on `slot` to the variant a caller acts on.
    pub(crate) fn from_server(error: ServerError, slot: Option<&str>, user: &str) -> Self {
        let slot_name = || slot.unwrap_or("?").to_owned();
        if error.code.starts_with(AUTH_CLASS) {
            return ReplicationError::Auth {
                user: user.to_owned(),
                reason: error.to_string(),
            };
        }
        if error.means_wal_level_too_low() {
            return ReplicationError::WalLevelNotLogical {
                actual: "lower than logical".to_owned(),
            };
        }
        if slot.is_some() {
            if error.code == OBJECT_IN_USE {
                return ReplicationError::SlotInUse {
                    slot: slot_name(),
                    attempts: 1,
                    message: error.message,
                };
            }
            if error.code == UNDEFINED_OBJECT && error.message.contains("slot") {
                return ReplicationError::SlotMissing { slot: slot_name() };
            }
            if error.means_slot_invalidated() {
                return ReplicationError::SlotInvalidated {
                    slot: slot_name(),
                    message: error.to_string(),
                };
            }
        }
        ReplicationError::Server(error)
    }

    /// Whether reconnecting could help; the rest need a person (or a resync) first.
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            ReplicationError::Connect { .. }
            | ReplicationError::Io(_)
            | ReplicationError::Closed
            | ReplicationError::Silent { .. } => true,
            // 57P01 admin_shutdown and friends (class 57) arrive when the server restarts.
            ReplicationError::Server(e) => e.code.starts_with("57") || e.code.starts_with("08"),
            ReplicationError::Query(e) => e.is_closed() || e.as_db_error().is_none(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(code: &str, message: &str, detail: Option<&str>) -> ServerError {
        ServerError {
            severity: "ERROR".into(),
            code: code.into(),
            message: message.into(),
            detail: detail.map(Into::into),
            hint: None,
        }
    }

    #[test]
    fn object_in_use_on_a_slot_is_slot_in_use() {
        let e = server("55006", "replication slot \"s\" is active for PID 42", None);
        let mapped = ReplicationError::from_server(e, Some("s"), "u");
        assert!(matches!(mapped, ReplicationError::SlotInUse { ref slot, .. } if slot == "s"));
        assert!(mapped.to_string().contains("pg_terminate_backend"));
    }

    #[test]
    fn invalidated_slot_messages_map_to_slot_invalidated_with_reset_advice() {
        for (code, message, detail) in [
            (
                "55000",
                "cannot read from logical replication slot \"s\"",
                Some(
                    "This slot has been invalidated because it exceeded the maximum reserved size.",
                ),
            ),
            (
                "55000",
                "can no longer get changes from replication slot \"s\"",
                None,
            ),
            (
                "58P01",
                "requested WAL segment 000000010000000000000003 has already been removed",
                None,
            ),
        ] {
            let mapped =
                ReplicationError::from_server(server(code, message, detail), Some("s"), "u");
            assert!(
                matches!(mapped, ReplicationError::SlotInvalidated { .. }),
                "{message} -> {mapped:?}"
            );
            assert!(mapped.to_string().contains("pg_drop_replication_slot('s')"));
        }
    }

    #[test]
    fn wal_level_error_is_not_mistaken_for_an_invalidated_slot() {
        let e = server(
            "55000",
            "logical decoding requires wal_level >= logical",
            None,
        );
        let mapped = ReplicationError::from_server(e, Some("s"), "u");
        assert!(matches!(
            mapped,
            ReplicationError::WalLevelNotLogical { .. }
        ));
    }

    #[test]
    fn auth_class_errors_are_auth_failures() {
        let e = server(
            "28P01",
            "password authentication failed for user \"u\"",
            None,
        );
        let mapped = ReplicationError::from_server(e, None, "u");
        assert!(matches!(mapped, ReplicationError::Auth { ref user, .. } if user == "u"));
        assert!(!mapped.is_transient());
    }

    #[test]
    fn missing_slot_is_its_own_error() {
        let e = server("42704", "replication slot \"s\" does not exist", None);
        let mapped = ReplicationError::from_server(e, Some("s"), "u");
        assert!(matches!(mapped, ReplicationError::SlotMissing { .. }));
    }

    #[test]
    fn server_shutdown_is_transient_but_other_server_errors_are_not() {
        let shutdown = server(
            "57P01",
            "terminating connection due to administrator command",
            None,
        );
        assert!(ReplicationError::from_server(shutdown, Some("s"), "u").is_transient());
        let syntax = server("42601", "syntax error", None);
        assert!(!ReplicationError::from_server(syntax, Some("s"), "u").is_transient());
    }
}
