//! `GET /sync`: the scope-sync WebSocket (the velocious-compatible frames of `scope_sync`), on
//! the primary and on relays, on when `serve --sync-rules FILE` is given.
//!
//! The engine's [`ScopeServer`] holds every rule; this module carries out its effects:
//! - `Send` goes to the socket's writer queue (in effect order: effects are queued while the
//!   server lock is held, so two callers never reorder one socket's frames); the writer reports
//!   `Written` after each flush, which is the outbound budget the engine paces replay by;
//! - `Authorize` is answered with [`SyncAuth::authorize`] (the token is checked here, the
//!   decision is a value);
//! - `FetchPage` reads one replay page on a reader thread, in one read transaction that ends
//!   before the page is handed back, so no read transaction waits on a slow socket;
//! - `Close` ends the socket with that code, even when its writer is stuck on a full socket;
//! - `ApplyMutations` is carried out by [`Writes`] on a task of its own, which answers
//!   `MutationsApplied` (the module docs of `writes` follow a write through).
//!
//! Commits reach [`SyncHub::committed`] from the ingest thread after the replica commit.
//!
//! A burst of connections leaves some memory behind once they close: the replay readers it
//! opened stay pooled (`READER_POOL`, each with a `READER_CACHE_KIB` page cache) and the
//! allocator keeps its metadata; the runtime's worker threads empty their allocator caches once
//! a burst has left ([`flush_thread_cache_if_asked`]), and the reader threads (a fixed number,
//! [`read_pool`]) theirs whenever their queue runs empty. Later bursts return to the level the
//! first one leaves (`BENCHMARKS.md`, section "Scope sync: commit to browser client, replay,
//! idle connections").

mod read_pool;
pub(crate) mod writes;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures::{SinkExt, StreamExt};
use highwater_engine::liveness;
use highwater_engine::scope_sync::server::{
    codes, ConnId, Decision, FeedChange, FeedEntry, PageResult, ScopeServer, ServerConfig,
    ServerEffect, ServerInput, SLOW_CONSUMER_CLOSE_CODE, SLOW_CONSUMER_REASON,
};
use highwater_engine::scope_sync::{rejection, Conditions, MutationResult, ServerFrame};
use highwater_engine::watermark::Watermark;
use tokio::sync::{mpsc, watch};

use super::change_stream::connection::too_big;
use super::fault::Fault;
use crate::replica::feed::{CommittedChanges, FeedKind, FeedRow, ScopePage, ScopeQuery};
use crate::replica::Replica;
use crate::sync_auth::SyncAuth;
use read_pool::ReadPool;
use writes::Writes;

pub(crate) use super::change_stream::connection::{MAX_CLIENT_FRAME_BYTES, TOO_BIG_CLOSE_CODE};
/// How long a close frame may take to get through before the socket is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(2);
/// Read-only replica connections kept for replay reads.
const READER_POOL: usize = 4;
/// The page cache of each replay reader, in KiB (SQLite's default is 2,000).
const READER_CACHE_KIB: i64 = 256;

/// Bumped when a burst of sockets has left (the last one closed, or the peer table shrank):
/// each runtime worker then empties its allocator cache the next time it parks.
static THREAD_CACHE_FLUSH: AtomicU64 = AtomicU64::new(0);

/// The runtime's `on_thread_park` hook (`commands/serve.rs`): empties this worker's jemalloc
/// thread cache once after each burst of sockets has left.
///
/// A worker's cache keeps up to 200 freed blocks per small size class for its next
/// allocations, and after a thousand sockets closed those blocks are scattered over pages that
/// would otherwise be empty: each keeps a whole page resident. An idle worker never allocates,
/// so jemalloc's own collection of the cache (which runs as a thread allocates) never comes.
/// Measured on `bench sync` with 1,000 idle sockets, 10 s after they closed: 116–118 % of the
/// baseline without this, 104–111 % with it (about 1.3 MiB less; `BENCHMARKS.md`, "Scope
/// sync"). Costs one atomic load per park; the flush itself (turning the thread's cache off
/// and on, a safe `mallctl`) runs once per burst and worker, never per request.
pub(crate) fn flush_thread_cache_if_asked() {
    thread_local! {
        static FLUSHED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }
    let asked = THREAD_CACHE_FLUSH.load(Ordering::Relaxed);
    FLUSHED.with(|flushed| {
        if flushed.get() != asked {
            flushed.set(asked);
            flush_thread_cache();
        }
    });
}

/// Empties this thread's jemalloc cache: turning it off returns its blocks to the arena; on
/// again, it starts empty.
fn flush_thread_cache() {
    use tikv_jemalloc_ctl::{Access, AsName};
    let enabled = b"thread.tcache.enabled\0".name();
    if enabled.write(false).is_ok() {
        let _ = enabled.write(true);
    }
}

/// Frames queued for one socket's writer. The engine keeps a socket's unflushed bytes under
/// its outbound budget (replay waits for `Written`) and closes it as a slow consumer past the
/// hard limit; this bound on the queue's length holds even for many tiny frames, and
/// overflowing it is the same slow-consumer close.
pub(super) const MAX_QUEUED_FRAMES: usize = 4096;

enum Outbound {
    Text(String),
}

struct Peer {
    outbound: mpsc::Sender<Outbound>,
    close: watch::Sender<Option<(u16, String)>>,
}

impl Peer {
    /// Queues a frame for the writer; a full queue closes the socket as a slow consumer
    /// instead of growing. Returns whether the frame was queued.
    fn queue(&self, text: String) -> bool {
        match self.outbound.try_send(Outbound::Text(text)) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(_)) => {
                if self.close.borrow().is_none() {
                    tracing::info!(
                        "a scope-sync socket has {MAX_QUEUED_FRAMES} frames unwritten: closing it"
                    );
                    self.close.send_replace(Some((
                        SLOW_CONSUMER_CLOSE_CODE,
                        SLOW_CONSUMER_REASON.to_owned(),
                    )));
                }
                false
            }
        }
    }
}

/// The scope server of a serving node and the sockets it talks to.
pub(crate) struct SyncHub {
    server: Mutex<ScopeServer>,
    peers: Mutex<HashMap<ConnId, Peer>>,
    next_conn: AtomicU64,
    auth: Arc<SyncAuth>,
    replica_path: PathBuf,
    readers: Mutex<Vec<Replica>>,
    /// The threads replay reads run on, one per pooled reader.
    reading: ReadPool,
    handle: tokio::runtime::Handle,
    ping_interval: Duration,
    fault: Fault,
    /// Applies `mutate` frames; `None` on a node that takes no writes.
    writes: Option<Arc<Writes>>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl SyncHub {
    pub(crate) fn new(
        config: ServerConfig,
        auth: Arc<SyncAuth>,
        replica_path: PathBuf,
        handle: tokio::runtime::Handle,
        ping_interval: Duration,
        fault: Fault,
        writes: Option<Arc<Writes>>,
    ) -> std::io::Result<Arc<SyncHub>> {
        let reading = ReadPool::start(READER_POOL, "replay-reader", &handle)?;
        Ok(Arc::new(SyncHub {
            server: Mutex::new(ScopeServer::new(config)),
            peers: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            auth,
            replica_path,
            readers: Mutex::new(Vec::new()),
            reading,
            handle,
            ping_interval,
            fault,
            writes,
        }))
    }

    /// Feeds inputs to the scope server and carries out the effects, until none are left.
    pub(crate) fn call(self: &Arc<Self>, input: ServerInput) {
        let mut inputs = vec![input];
        while let Some(input) = inputs.pop() {
            let effects = {
                let mut server = self.fault.lock(&self.server, "scope-sync server");
                let effects = server.handle(input, now_ms());
                // Sends and closes are queued under the lock: one socket's frames keep the
                // order the server produced them in.
                let peers = self.fault.lock(&self.peers, "scope-sync peers");
                let mut rest = Vec::new();
                for effect in effects {
                    match effect {
                        ServerEffect::Send { conn, text } => {
                            if let Some(peer) = peers.get(&conn) {
                                peer.queue(text);
                            }
                        }
                        ServerEffect::Close { conn, code, reason } => {
                            if let Some(peer) = peers.get(&conn) {
                                tracing::info!(conn, code, %reason, "closing a scope-sync socket");
                                peer.close.send_replace(Some((code, reason)));
                            }
                        }
                        other => rest.push(other),
                    }
                }
                rest
            };
            for effect in effects {
                match effect {
                    ServerEffect::Authorize {
                        conn,
                        ticket,
                        token,
                        resource_type,
                        conditions,
                    } => {
                        let decision = match self.auth.authorize(
                            token.as_deref(),
                            &resource_type,
                            &conditions,
                            now_ms(),
                        ) {
                            Ok(grant) => Decision::Granted(grant),
                            Err(denied) => Decision::Denied {
                                code: denied.code.to_owned(),
                                message: denied.message,
                            },
                        };
                        inputs.push(ServerInput::Authorized {
                            conn,
                            ticket,
                            decision,
                        });
                    }
                    ServerEffect::FetchPage {
                        conn,
                        ticket,
                        pass,
                        table,
                        conditions,
                        row_filter,
                        after,
                        up_to,
                        limit,
                        count_total,
                        access,
                    } => self.read_async(move |hub| {
                        let result = hub.read_page(&ScopeQuery {
                            table: &table,
                            conditions: &conditions,
                            row_filter: row_filter.as_ref(),
                            after,
                            up_to,
                            limit,
                            count_total,
                            access: &access,
                        });
                        ServerInput::PageFetched {
                            conn,
                            ticket,
                            pass,
                            result,
                        }
                    }),
                    ServerEffect::ReadSet {
                        set,
                        table,
                        row_filter,
                        limit,
                    } => self.read_async(move |hub| ServerInput::SetRead {
                        set,
                        result: hub.read_all(&table, &Conditions::default(), &row_filter, limit),
                    }),
                    ServerEffect::ReadMoves {
                        read,
                        table,
                        conditions,
                        row_filter,
                        limit,
                    } => self.read_async(move |hub| ServerInput::MovesRead {
                        read,
                        result: hub.read_all(&table, &conditions, &row_filter, limit),
                    }),
                    ServerEffect::ApplyMutations {
                        conn,
                        ticket,
                        client_id,
                        token,
                        mutations,
                    } => match self.writes.clone() {
                        // Applied on a task of its own; the answer comes back as an input.
                        Some(writes) => {
                            let hub = self.clone();
                            self.handle.spawn(async move {
                                let (results, replicated) =
                                    writes.apply(&client_id, token.as_deref(), mutations).await;
                                hub.call(ServerInput::MutationsApplied {
                                    conn,
                                    ticket,
                                    results,
                                    replicated,
                                });
                            });
                        }
                        // The server asks only when told it takes writes; answered all the same.
                        None => {
                            let results = mutations
                                .iter()
                                .map(|mutation| {
                                    let id = match mutation {
                                        Ok(mutation) => mutation.id,
                                        Err(invalid) => invalid.id,
                                    };
                                    MutationResult::retry(
                                        id,
                                        rejection::UNAVAILABLE,
                                        "this node takes no writes",
                                    )
                                })
                                .collect();
                            inputs.push(ServerInput::MutationsApplied {
                                conn,
                                ticket,
                                results,
                                replicated: None,
                            });
                        }
                    },
                    ServerEffect::LookUpReplicated { client_id } => match self.writes.clone() {
                        Some(writes) => {
                            let hub = self.clone();
                            self.handle.spawn(async move {
                                let last = writes.replicated(&client_id).await;
                                hub.call(ServerInput::Replicated { client_id, last });
                            });
                        }
                        None => inputs.push(ServerInput::Replicated {
                            client_id,
                            last: None,
                        }),
                    },
                    ServerEffect::Send { .. } | ServerEffect::Close { .. } => {}
                }
            }
        }
    }

    /// Reads from the replica on a reader thread and feeds the answer back. `READER_POOL`
    /// reads run at once, each with a pooled reader: a burst of subscribes queues here rather
    /// than opening a reader and a thread apiece (a thousand of them held 80 MB at their peak).
    fn read_async(
        self: &Arc<Self>,
        read: impl FnOnce(&Arc<SyncHub>) -> ServerInput + Send + 'static,
    ) {
        let hub = self.clone();
        self.reading.run(move || {
            let answer = read(&hub);
            hub.call(answer);
        });
    }

    /// Reads every row of `table` matching `conditions` and `row_filter` (up to `limit`), in
    /// one read transaction: a set's rows, or a move's. Blocking.
    fn read_all(
        &self,
        table: &str,
        conditions: &Conditions,
        row_filter: &highwater_engine::scope_sync::rules::row_filter::RowFilter,
        limit: u32,
    ) -> PageResult {
        self.read_page(&ScopeQuery {
            table,
            conditions,
            row_filter: Some(row_filter),
            after: None,
            up_to: None,
            limit,
            count_total: false,
            access: &[],
        })
    }

    /// Reads one replay page with a pooled read-only connection. Blocking.
    fn read_page(&self, query: &ScopeQuery<'_>) -> PageResult {
        let pooled = self.fault.lock(&self.readers, "scope-sync readers").pop();
        let reader = match pooled {
            Some(mut reader) => reader.refresh().map(|()| reader),
            None => Replica::open_read_only(&self.replica_path).and_then(|reader| {
                // Pages are range scans of a file the OS caches anyway: a small cache per
                // reader keeps the server's memory from growing with the scopes it has read.
                reader
                    .connection()
                    .pragma_update(None, "cache_size", -READER_CACHE_KIB)?;
                Ok(reader)
            }),
        };
        let mut reader = match reader {
            Ok(reader) => reader,
            Err(error) => {
                return PageResult::Failed {
                    message: format!("could not read the replica: {error}"),
                }
            }
        };
        let page = reader.read_scope_page(query);
        let result = match page {
            Ok(ScopePage::Rows {
                up_to,
                rows,
                total,
                floor,
                access_changed,
            }) => PageResult::Rows {
                up_to,
                rows: rows.into_iter().map(feed_entry).collect(),
                total,
                floor,
                access_changed,
            },
            Ok(ScopePage::Truncated) => PageResult::Truncated,
            Ok(ScopePage::UnknownTable) => PageResult::Failed {
                message: format!(
                    "expected table {:?} in the replica, but it is not replicated",
                    query.table
                ),
            },
            Ok(ScopePage::UnknownColumn(column)) => PageResult::Failed {
                message: format!(
                    "expected column {column:?} in table {:?}, but the replica has none",
                    query.table
                ),
            },
            Ok(ScopePage::Incomparable(column)) => PageResult::Failed {
                message: format!(
                    "column {column:?} of table {:?} holds JSON or arrays, which a condition \
                     cannot compare (only isNull can test it)",
                    query.table
                ),
            },
            Err(error) => PageResult::Failed {
                message: format!("could not read the replica: {error}"),
            },
        };
        let _ = reader.refresh();
        let mut readers = self.fault.lock(&self.readers, "scope-sync readers");
        if readers.len() < READER_POOL {
            readers.push(reader);
        }
        result
    }

    /// Routes the feed entries of one committed transaction, and the sync clients' mutations
    /// it applied (call once the replica commit is durable).
    pub(crate) fn committed(self: &Arc<Self>, changes: CommittedChanges) {
        if changes.rows.is_empty() && changes.confirms.is_empty() {
            return;
        }
        self.call(ServerInput::Committed {
            entries: changes.rows.into_iter().map(feed_entry).collect(),
            confirms: changes.confirms,
        });
    }

    /// Every transaction up to `watermark` has been routed ([`SyncHub::committed`]).
    pub(crate) fn routed_through(&self, watermark: &Watermark) {
        if let Some(writes) = &self.writes {
            writes.routed_through(watermark);
        }
    }

    /// A fence passed ingest with everything before it committed to the replica.
    pub(crate) fn fence_passed(&self, nonce: &str) {
        if let Some(writes) = &self.writes {
            writes.fence_passed(nonce);
        }
    }

    pub(crate) fn set_retention_floor(self: &Arc<Self>, floor: Option<i64>) {
        self.call(ServerInput::RetentionFloor(floor));
    }

    pub(crate) fn tick(self: &Arc<Self>) {
        self.call(ServerInput::Tick);
    }

    /// The scope server's counts and state, for `/metrics`.
    pub(crate) fn metrics(&self) -> highwater_engine::scope_sync::server::ServerMetrics {
        self.fault.lock(&self.server, "scope-sync server").metrics()
    }

    /// Open scope-sync sockets.
    pub(crate) fn connections(&self) -> usize {
        self.fault
            .lock(&self.server, "scope-sync server")
            .connections()
    }

    /// Closes every socket (shutdown).
    pub(crate) fn close_all(&self, code: u16, reason: &str) {
        let peers = self.fault.lock(&self.peers, "scope-sync peers");
        for peer in peers.values() {
            peer.close.send_replace(Some((code, reason.to_owned())));
        }
    }

    /// Waits until every socket has ended (each sends its close frame first, within
    /// `CLOSE_GRACE`), or `limit` passed. The HTTP server's graceful shutdown does not wait for
    /// upgraded sockets: without this, a busy process could exit before the close frames left.
    pub(crate) async fn until_closed(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let open = self.fault.lock(&self.peers, "scope-sync peers").len();
            if open == 0 || tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Runs one socket until either side ends it.
    pub(crate) async fn run_socket(self: Arc<Self>, socket: WebSocket) {
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let (outbound_tx, mut outbound) = mpsc::channel(MAX_QUEUED_FRAMES);
        let (close_tx, close_rx) = watch::channel(None);
        self.fault.lock(&self.peers, "scope-sync peers").insert(
            conn,
            Peer {
                outbound: outbound_tx,
                close: close_tx,
            },
        );
        let session_id = format!(
            "{:x}-{conn}",
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        self.call(ServerInput::Opened { conn, session_id });
        let (mut sink, mut stream) = socket.split();
        let last_seen = Arc::new(AtomicU64::new(now_ms()));

        let writer = {
            let hub = self.clone();
            let close = close_rx.clone();
            let last_seen = last_seen.clone();
            let ping_interval = self.ping_interval;
            async move {
                let mut ping = tokio::time::interval(ping_interval);
                ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ping.tick().await;
                let frame = loop {
                    tokio::select! {
                        biased;
                        frame = close_signal(close.clone()) => break frame,
                        next = outbound.recv() => {
                            let Some(Outbound::Text(first)) = next else { break None };
                            let mut bytes = first.len();
                            let mut batch = vec![first];
                            while batch.len() < 256 {
                                match outbound.try_recv() {
                                    Ok(Outbound::Text(text)) => {
                                        bytes += text.len();
                                        batch.push(text);
                                    }
                                    Err(_) => break,
                                }
                            }
                            let write = async {
                                for text in batch {
                                    sink.feed(Message::Text(text.into())).await?;
                                }
                                sink.flush().await
                            };
                            tokio::select! {
                                biased;
                                frame = close_signal(close.clone()) => break frame,
                                written = write => {
                                    if written.is_err() { break None }
                                    hub.call(ServerInput::Written { conn, bytes });
                                }
                            }
                        }
                        _ = ping.tick() => {
                            let interval_ms = u64::try_from(ping_interval.as_millis()).unwrap_or(u64::MAX);
                            if liveness::peer_is_gone(last_seen.load(Ordering::Relaxed), now_ms(), interval_ms) {
                                tracing::info!(conn, "scope-sync peer silent for two ping intervals: closing");
                                break None;
                            }
                            if sink.send(Message::Ping(Default::default())).await.is_err() {
                                break None;
                            }
                        }
                    }
                };
                if let Some((code, reason)) = frame {
                    let close = sink.send(Message::Close(Some(CloseFrame {
                        code,
                        reason: reason.into(),
                    })));
                    let _ = tokio::time::timeout(CLOSE_GRACE, close).await;
                }
            }
        };

        let reader = {
            let hub = self.clone();
            async move {
                while let Some(message) = stream.next().await {
                    last_seen.store(now_ms(), Ordering::Relaxed);
                    match message {
                        Ok(Message::Text(text)) => hub.call(ServerInput::Frame {
                            conn,
                            text: text.as_str().to_owned(),
                        }),
                        Ok(Message::Binary(_)) => hub.send_error(
                            conn,
                            "expected a text frame holding JSON, got a binary frame",
                        ),
                        Ok(Message::Ping(_) | Message::Pong(_)) => {}
                        Ok(Message::Close(_)) => break,
                        Err(error) => {
                            if too_big(&error) {
                                hub.close(
                                    conn,
                                    TOO_BIG_CLOSE_CODE,
                                    "expected frames of at most 1 MiB, got a larger one",
                                );
                                // Let the writer send the close frame.
                                tokio::time::sleep(CLOSE_GRACE).await;
                            }
                            break;
                        }
                    }
                }
            }
        };

        let mut close_seen = close_rx;
        tokio::select! {
            _ = writer => {}
            _ = reader => {
                // The writer may still owe a close frame.
                if close_seen.borrow_and_update().is_some() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        {
            let mut peers = self.fault.lock(&self.peers, "scope-sync peers");
            peers.remove(&conn);
            // Sized for the largest burst of clients otherwise.
            if peers.capacity() > 64 && peers.len() * 4 < peers.capacity() {
                let len = peers.len();
                peers.shrink_to(len * 2);
                THREAD_CACHE_FLUSH.fetch_add(1, Ordering::Relaxed);
            } else if peers.is_empty() {
                THREAD_CACHE_FLUSH.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.call(ServerInput::Closed { conn });
    }

    fn send_error(&self, conn: ConnId, message: &str) {
        let frame = ServerFrame::Error {
            error: message.to_owned(),
            code: Some(codes::BAD_FRAME.to_owned()),
            retry_after_ms: None,
        };
        if let Some(peer) = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&conn)
        {
            peer.queue(frame.to_json());
        }
    }

    fn close(&self, conn: ConnId, code: u16, reason: &str) {
        if let Some(peer) = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&conn)
        {
            peer.close.send_replace(Some((code, reason.to_owned())));
        }
    }
}

/// The close the server asked for, once it does.
async fn close_signal(mut close: watch::Receiver<Option<(u16, String)>>) -> Option<(u16, String)> {
    let frame = match close.wait_for(Option::is_some).await {
        Ok(frame) => frame.clone(),
        Err(_) => None,
    };
    match frame {
        Some(frame) => Some(frame),
        None => std::future::pending().await,
    }
}

fn feed_entry(row: FeedRow) -> FeedEntry {
    FeedEntry {
        table: row.table,
        resource_id: row.resource_id,
        seq: row.seq,
        updated_at: row.updated_at,
        change: match row.kind {
            FeedKind::Upsert { data } => FeedChange::Upsert { data },
            FeedKind::Exit { old, new } => FeedChange::Exit { old, new },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_outbound_queue_closes_the_socket_as_a_slow_consumer() {
        let (outbound, mut queued) = mpsc::channel(MAX_QUEUED_FRAMES);
        let (close, closing) = watch::channel(None);
        let peer = Peer { outbound, close };
        for n in 0..MAX_QUEUED_FRAMES {
            assert!(peer.queue(format!("frame {n}")), "frame {n} fits");
        }
        assert_eq!(*closing.borrow(), None, "not closed while under the bound");
        assert!(
            !peer.queue("one too many".to_owned()),
            "queued past the bound"
        );
        assert_eq!(
            *closing.borrow(),
            Some((SLOW_CONSUMER_CLOSE_CODE, SLOW_CONSUMER_REASON.to_owned()))
        );
        // Nothing past the bound was kept.
        let mut kept = 0;
        while queued.try_recv().is_ok() {
            kept += 1;
        }
        assert_eq!(kept, MAX_QUEUED_FRAMES);
    }
}
