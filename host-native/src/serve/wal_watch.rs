//! Watches how much WAL the replication slot keeps upstream: past `--wal-warn-bytes` (or once
//! the slot is invalidated) `serve` logs a warning and `/health` says `degraded` with the
//! reason, with the room left before `max_slot_wal_keep_size` would invalidate the slot.
//!
//! A slot that falls behind (a stalled server, a long outage) makes Postgres keep every WAL
//! segment since; the disk fills, or the slot is invalidated and a full resync follows.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::replication::PgConfig;

/// What to watch and when to warn.
#[derive(Debug, Clone)]
pub(crate) struct WalWatch {
    pub upstream: PgConfig,
    pub slot: String,
    pub(crate) warn_bytes: u64,
    pub every: Duration,
}

/// The current reason `/health` is degraded, if any.
#[derive(Debug, Default)]
pub(crate) struct WalHealth {
    degraded: Mutex<Option<String>>,
    /// The last reading of the slot.
    last: Mutex<Option<SlotWal>>,
}

impl WalHealth {
    pub(crate) fn degraded(&self) -> Option<String> {
        self.degraded.lock().map_or(None, |reason| reason.clone())
    }

    /// The slot as of the last check, if one succeeded.
    pub(crate) fn last(&self) -> Option<SlotWal> {
        self.last.lock().map_or(None, |last| last.clone())
    }

    fn read(&self, wal: SlotWal) {
        if let Ok(mut last) = self.last.lock() {
            *last = Some(wal);
        }
    }

    fn set(&self, reason: Option<String>) {
        if let Ok(mut degraded) = self.degraded.lock() {
            *degraded = reason;
        }
    }
}

/// What the slot looks like upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotWal {
    /// Bytes of WAL kept for the slot (`None`: its WAL is gone).
    pub retained: Option<i64>,
    pub(crate) wal_status: Option<String>,
    /// Bytes left before `max_slot_wal_keep_size` invalidates it (`None`: unlimited).
    pub(crate) safe_wal_size: Option<i64>,
    /// Bytes of WAL written upstream past the slot's confirmed flush position.
    pub behind: Option<i64>,
}

/// The degraded reason for a slot, if it is one.
pub(crate) fn judge(slot: &str, wal: &SlotWal, warn_bytes: u64) -> Option<String> {
    let mib = |bytes: i64| bytes as f64 / (1024.0 * 1024.0);
    if wal.wal_status.as_deref() == Some("lost") || wal.retained.is_none() {
        return Some(format!(
            "the replication slot {slot} was invalidated: the WAL it needed is gone; restart \
             with --auto-reset for a fresh initial sync"
        ));
    }
    let retained = wal.retained.unwrap_or(0);
    if u64::try_from(retained).unwrap_or(0) <= warn_bytes {
        return None;
    }
    let left = match wal.safe_wal_size {
        Some(left) => format!(
            "; {:.1} MiB left before max_slot_wal_keep_size invalidates it",
            mib(left)
        ),
        None => "; max_slot_wal_keep_size is unlimited, so the disk is the limit".to_owned(),
    };
    Some(format!(
        "the replication slot {slot} keeps {:.1} MiB of WAL (warning at {:.1} MiB){left}",
        mib(retained),
        mib(i64::try_from(warn_bytes).unwrap_or(i64::MAX))
    ))
}

/// Checks every `watch.every` until `shutdown`; logs each change of state.
pub(crate) async fn run(
    watch: WalWatch,
    health: Arc<WalHealth>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut client = None;
    let mut timer = tokio::time::interval(watch.every);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = timer.tick() => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        if client.is_none() {
            match watch.upstream.connect().await {
                Ok((connected, connection)) => {
                    tokio::spawn(connection);
                    client = Some(connected);
                }
                Err(error) => {
                    tracing::debug!(%error, "WAL watch: cannot connect upstream");
                    continue;
                }
            }
        }
        let Some(connected) = &client else { continue };
        let row = connected
            .query_opt(
                "SELECT (pg_current_wal_lsn() - restart_lsn)::int8, wal_status, safe_wal_size, \
                 (pg_current_wal_lsn() - confirmed_flush_lsn)::int8 \
                 FROM pg_replication_slots WHERE slot_name = $1",
                &[&watch.slot],
            )
            .await;
        let wal = match row {
            Ok(Some(row)) => SlotWal {
                retained: row.get(0),
                wal_status: row.get(1),
                safe_wal_size: row.get(2),
                behind: row.get(3),
            },
            Ok(None) => continue,
            Err(error) => {
                tracing::debug!(%error, "WAL watch: query failed");
                // Reconnect only when the connection is gone (a Postgres restart), not for
                // an error it would give again.
                if connected.is_closed() {
                    client = None;
                }
                continue;
            }
        };
        let reason = judge(&watch.slot, &wal, watch.warn_bytes);
        match (&reason, health.degraded()) {
            (Some(reason), None) => tracing::warn!(reason = %reason, "WAL retained upstream"),
            (None, Some(_)) => {
                tracing::info!(slot = %watch.slot, "WAL retained upstream is back under the warning")
            }
            _ => {}
        }
        health.set(reason);
        health.read(wal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_past_the_warning_or_invalidated_degrades_health_with_its_reason() {
        let wal = |retained: Option<i64>, status: &str, left: Option<i64>| SlotWal {
            retained,
            wal_status: Some(status.to_owned()),
            safe_wal_size: left,
            behind: None,
        };
        let mib = 1024 * 1024;
        assert_eq!(
            judge("s", &wal(Some(mib), "reserved", None), 2 * 1024 * 1024),
            None
        );
        let reason = judge(
            "s",
            &wal(Some(3 * mib), "extended", Some(mib)),
            2 * 1024 * 1024,
        )
        .expect("degraded");
        assert!(
            reason.contains("keeps 3.0 MiB") && reason.contains("1.0 MiB left"),
            "{reason}"
        );
        let unlimited = judge("s", &wal(Some(3 * mib), "reserved", None), 0).expect("degraded");
        assert!(unlimited.contains("unlimited"), "{unlimited}");
        let lost = judge("s", &wal(None, "lost", None), u64::MAX).expect("degraded");
        assert!(
            lost.contains("invalidated") && lost.contains("--auto-reset"),
            "{lost}"
        );
    }
}
