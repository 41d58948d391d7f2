//! A relay's replica from its primary's snapshot (`docs/protocol/change-stream.md`,
//! "Reservations and snapshots"): reserve a snapshot on the `/subscribe` socket, download the
//! `backupURL` into the data directory, check it against the reservation, seed the relay's own
//! change log inside the copy, and put it in place with one rename. The socket stays open — it
//! *is* the reservation, pinning the primary's change log — and is handed to the change stream,
//! which sends `start-subscription` on it.
//!
//! The snapshot holds no change log (`serve::snapshot` leaves it out), so no cookie jar: the
//! seeded log starts with an empty one, and a fresh relay's first `start-subscription` says
//! `backfills: []`.

use std::path::Path;
use std::time::Duration;

use highwater_engine::change_stream::{
    DownstreamMessage, Extra, ReserveSnapshot, Reserved, UpstreamMessage,
};
use highwater_engine::streamer::{check_restored_snapshot, restored_log_start, SnapshotMismatch};
use highwater_engine::watermark::Watermark;
use rusqlite::Connection;

use super::upstream::{Incoming, UpstreamConnection};
use super::{RelayError, Upstream, REPLICA_FILE};
use crate::change_log::{self, ChangeLogConfig};
use crate::replica::Replica;
use crate::serve::snapshot_download::{download, DownloadError, SnapshotHeaders};

/// The snapshot being downloaded; only ever renamed into place once complete and checked.
pub(super) const RESTORE_FILE: &str = "replica.db.restore";

/// How long the primary may take to confirm a reservation (it waits for a backup watermark).
const RESERVE_TIMEOUT: Duration = Duration::from_secs(60);

/// A replica restored and in place, and the socket holding its reservation.
pub(super) struct Restored {
    pub upstream: UpstreamConnection,
    pub watermark: Watermark,
}

/// Restores `<data>/replica.db` from the primary at `subscribe_url` as task `task_id`.
pub(super) async fn restore(
    primary: &Upstream,
    task_id: &str,
    data: &Path,
) -> Result<Restored, RelayError> {
    let mut upstream = UpstreamConnection::connect(primary).await?;
    upstream
        .send(&UpstreamMessage::ReserveSnapshot(ReserveSnapshot {
            task_id: task_id.to_owned(),
            extra: Extra::new(),
        }))
        .await?;
    let reserved = tokio::time::timeout(RESERVE_TIMEOUT, reservation(&mut upstream))
        .await
        .map_err(|_| RelayError::Protocol {
            expected: format!(
                "a snapshot reservation within {} s",
                RESERVE_TIMEOUT.as_secs()
            ),
            found: "no answer".to_owned(),
        })??;
    tracing::info!(
        backup_url = %reserved.backup_url,
        replica_version = %reserved.replica_version,
        min_watermark = %reserved.min_watermark,
        "snapshot reserved; downloading"
    );
    let temp = data.join(RESTORE_FILE);
    // A restore killed while seeding leaves the copy's WAL beside it: with a new copy under it,
    // every read-only open would need to recover that WAL and fail ("attempt to write a
    // readonly database"), restore after restore.
    remove_sidecars(&temp)?;
    // The primary's token opens its snapshot as it opens its change stream.
    let download = async {
        download(
            &reserved.backup_url,
            &temp,
            primary.token.as_ref(),
            &primary.client,
        )
        .await
        .map_err(RelayError::from)
    };
    let headers = while_reserved(&mut upstream, download).await?;
    let watermark = {
        let temp = temp.clone();
        tokio::task::spawn_blocking(move || seed(&temp, &reserved, &headers))
            .await
            .map_err(|e| RelayError::Task(e.to_string()))??
    };
    let data = data.to_owned();
    tokio::task::spawn_blocking(move || install(&data, &temp))
        .await
        .map_err(|e| RelayError::Task(e.to_string()))??;
    tracing::info!(%watermark, "replica restored from the primary's snapshot");
    Ok(Restored {
        upstream,
        watermark,
    })
}

/// Removes the `-wal` and `-shm` files SQLite keeps beside `path`, if any.
fn remove_sidecars(path: &Path) -> Result<(), RelayError> {
    for suffix in ["-wal", "-shm"] {
        let mut sidecar = path.as_os_str().to_owned();
        sidecar.push(suffix);
        match std::fs::remove_file(&sidecar) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                return Err(RelayError::Task(format!(
                    "cannot remove {}: {error}",
                    std::path::Path::new(&sidecar).display()
                )))
            }
        }
    }
    Ok(())
}

/// Waits for the `reserved` answer, acking the primary's frames as they are read.
async fn reservation(upstream: &mut UpstreamConnection) -> Result<Reserved, RelayError> {
    loop {
        let (id, messages) = match upstream.recv().await? {
            Incoming::Frame { id, messages } => (id, messages),
            Incoming::Alive => continue,
            Incoming::Closed(close) => {
                return Err(RelayError::Closed {
                    during: "the snapshot reservation",
                    close,
                })
            }
        };
        upstream.ack(&[id]).await?;
        for message in messages {
            match message {
                DownstreamMessage::Reserved(reserved) => return Ok(reserved),
                DownstreamMessage::Error(error) => {
                    return Err(RelayError::Rejected(
                        error.message.unwrap_or_else(|| "no message".to_owned()),
                    ))
                }
                DownstreamMessage::Status(_) => {}
                other => {
                    return Err(RelayError::Protocol {
                        expected: "a snapshot reservation answer".to_owned(),
                        found: format!("{other:?}").chars().take(120).collect(),
                    })
                }
            }
        }
    }
}

/// Runs `work` while reading the reservation socket, so the primary's pings are answered and a
/// lost reservation is noticed.
async fn while_reserved<T>(
    upstream: &mut UpstreamConnection,
    work: impl std::future::Future<Output = Result<T, RelayError>>,
) -> Result<T, RelayError> {
    tokio::pin!(work);
    loop {
        tokio::select! {
            result = &mut work => return result,
            incoming = upstream.recv() => match incoming? {
                Incoming::Alive => {}
                Incoming::Closed(close) => {
                    return Err(RelayError::Closed { during: "the snapshot download", close })
                }
                Incoming::Frame { id, messages } => {
                    upstream.ack(&[id]).await?;
                    if let Some(DownstreamMessage::Error(error)) = messages.first() {
                        let message = error.message.clone().unwrap_or_else(|| "no message".to_owned());
                        return Err(RelayError::Rejected(message));
                    }
                }
            }
        }
    }
}

/// Checks the downloaded copy against the reservation and seeds its change log: the log takes
/// the primary's replica version, and starts at the copy's watermark, the only point from which
/// it can catch its own subscribers up. Blocking. Returns the copy's watermark.
fn seed(
    path: &Path,
    reserved: &Reserved,
    headers: &SnapshotHeaders,
) -> Result<Watermark, RelayError> {
    let state = Replica::open_read_only(path)?
        .state()
        .cloned()
        .ok_or(RelayError::Snapshot {
            expected: "a synced replica".to_owned(),
            found: "a database without replication state".to_owned(),
        })?;
    check_restored_snapshot(
        reserved,
        &state.replica_version,
        &state.watermark,
        headers.watermark.as_deref(),
        headers.replica_version.as_deref(),
    )
    .map_err(|SnapshotMismatch { expected, found }| RelayError::Snapshot { expected, found })?;
    let conn = Connection::open(path).map_err(change_log::ChangeLogError::from)?;
    let config = ChangeLogConfig {
        replica_version: state.replica_version.clone(),
        publications: state.publications.clone(),
    };
    change_log::create_tables(&conn)?;
    change_log::reseed(&conn, &config)?;
    if let Some(start) = restored_log_start(&state.replica_version, &state.watermark) {
        let tx = conn
            .unchecked_transaction()
            .map_err(change_log::ChangeLogError::from)?;
        change_log::append(&tx, &start, 0, "begin", r#"{"tag":"begin"}"#)?;
        change_log::append(&tx, &start, 1, "commit", r#"{"tag":"commit"}"#)?;
        change_log::commit(&tx, &start)?;
        tx.commit().map_err(change_log::ChangeLogError::from)?;
        change_log::purge(&conn, &start)?;
    }
    let status = change_log::status(&conn)?.ok_or(change_log::ChangeLogError::NotInitialized)?;
    if status.last_watermark != state.watermark || status.min_watermark != state.watermark {
        return Err(RelayError::Snapshot {
            expected: format!("a change log seeded at {}", state.watermark),
            found: format!(
                "one from {} to {}",
                status.min_watermark, status.last_watermark
            ),
        });
    }
    Ok(state.watermark)
}

/// Replaces the replica with the restored copy. The old database goes first, then its WAL (a
/// WAL left beside the new file would be replayed into it), then the rename. Blocking.
fn install(data: &Path, restored: &Path) -> Result<(), RelayError> {
    Replica::remove_in_dir(data)?;
    std::fs::rename(restored, data.join(REPLICA_FILE))?;
    std::fs::File::open(data)?.sync_all()?;
    Ok(())
}

impl From<DownloadError> for RelayError {
    fn from(error: DownloadError) -> Self {
        match error {
            DownloadError::Failed { url, reason } => RelayError::Download { url, reason },
            DownloadError::Io(error) => RelayError::Io(error),
            DownloadError::TooLarge { ref url, .. }
            | DownloadError::NoRoom { ref url, .. }
            | DownloadError::TimedOut { ref url, .. } => RelayError::Download {
                url: url.clone(),
                reason: error.reason(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_restores_wal_and_shm_are_removed_before_the_next_copy_and_none_is_no_error() {
        let dir = std::env::temp_dir().join(format!("hw-restore-sidecars-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let copy = dir.join(RESTORE_FILE);
        std::fs::write(&copy, b"copy").unwrap();
        for suffix in ["-wal", "-shm"] {
            std::fs::write(dir.join(format!("{RESTORE_FILE}{suffix}")), b"stale").unwrap();
        }
        remove_sidecars(&copy).unwrap();
        assert!(copy.exists(), "the copy itself stays");
        for suffix in ["-wal", "-shm"] {
            assert!(!dir.join(format!("{RESTORE_FILE}{suffix}")).exists());
        }
        remove_sidecars(&copy).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
