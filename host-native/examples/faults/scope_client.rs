//! A native scope-sync client: the engine's [`SyncClient`] state machine (the same one the npm
//! package drives in the browser) over tokio-tungstenite, with an in-memory store that takes
//! its `Persist` writes as one storage transaction would. It subscribes to `items` where
//! `owner = <owner>` with a token signed by the run's secret, as an app's token source would.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::stream::SplitSink;
use futures::{SinkExt, StreamExt};
use highwater_engine::backoff::BackoffPolicy;
use highwater_engine::scope_sync::client::{
    ClientConfig, ClientEffect, ClientInput, SocketId, StoredRow, StoredScope, SyncClient,
};
use highwater_engine::scope_sync::cursor::{compare_cursors, SyncCursor};
use highwater_engine::scope_sync::SubscribeParams;
use highwater_host::sync_auth::{mint_token, SyncSecret};
use serde_json::json;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::rng::Rng;
use crate::workload::{row_values, ITEMS};

const SCOPE: u32 = 1;

type Sink = SplitSink<WebSocketStream<MaybeTlsStream<TcpStream>>, Message>;

/// What the harness reads at the end.
#[derive(Debug, Clone, Default)]
pub struct ScopeState {
    pub name: String,
    pub owner: String,
    /// The store: `resourceId` → columns, as persisted.
    pub stored: BTreeMap<String, BTreeMap<String, String>>,
    pub cursor: Option<SyncCursor>,
    /// The store's rows as written, for a restart from the store.
    pub raw: BTreeMap<String, StoredRow>,
    /// Times the app restarted from its store.
    pub restarts: u64,
    /// The state machine's own rows.
    pub held: BTreeMap<String, BTreeMap<String, String>>,
    pub sockets_opened: u64,
    /// Reset markers received (a full replay; legal, never expected in this run).
    pub resets: u64,
    /// A persisted cursor that went backwards.
    pub cursor_regressions: u64,
    /// The scope was refused for good.
    pub failed: Vec<String>,
    /// Errors the client survived (a server `error` frame, an unreadable frame).
    pub errors: Vec<String>,
    pub live: bool,
}

pub struct ScopeClient {
    pub state: Arc<Mutex<ScopeState>>,
    pub task: tokio::task::JoinHandle<()>,
    halt: watch::Sender<bool>,
    stop: watch::Receiver<bool>,
    addr: SocketAddr,
    owner: &'static str,
    secret: SyncSecret,
}

enum Event {
    Opened(SocketId, Box<Sink>),
    Frame(SocketId, String),
    Closed(SocketId, String),
}

fn lock(state: &Mutex<ScopeState>) -> std::sync::MutexGuard<'_, ScopeState> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0))
}

impl ScopeClient {
    pub fn start(
        name: String,
        addr: SocketAddr,
        owner: &'static str,
        secret: SyncSecret,
        rng: Rng,
        stop: watch::Receiver<bool>,
    ) -> anyhow::Result<ScopeClient> {
        let state = ScopeState {
            name,
            owner: owner.to_owned(),
            ..ScopeState::default()
        };
        ScopeClient::launch(state, addr, owner, secret, rng, stop)
    }

    /// The app restarts: this client stops (its socket with it) and a new one starts from
    /// what the store holds, as a page reload starts from IndexedDB.
    pub async fn restart(&mut self, rng: Rng) -> anyhow::Result<()> {
        let _ = self.halt.send(true);
        let _ = (&mut self.task).await;
        let state = lock(&self.state).clone();
        let stop = self.stop.clone();
        *self = ScopeClient::launch(state, self.addr, self.owner, self.secret.clone(), rng, stop)?;
        lock(&self.state).restarts += 1;
        Ok(())
    }

    fn launch(
        state: ScopeState,
        addr: SocketAddr,
        owner: &'static str,
        secret: SyncSecret,
        mut rng: Rng,
        stop: watch::Receiver<bool>,
    ) -> anyhow::Result<ScopeClient> {
        let params = serde_json::Map::from_iter([
            ("resourceType".to_owned(), json!(ITEMS)),
            ("conditions".to_owned(), json!({ "owner": owner })),
            ("limit".to_owned(), json!(50)),
        ]);
        let params = SubscribeParams::from_params(&params)?;
        let stored = StoredScope {
            rows: state.raw.values().cloned().collect(),
            cursor: state.cursor.clone(),
        };
        let state = Arc::new(Mutex::new(state));
        let config = ClientConfig {
            backoff: BackoffPolicy {
                initial_ms: 100,
                max_ms: 2_000,
            },
            ping_interval_ms: 1_000,
            silence_limit_ms: 4_000,
            connect_timeout_ms: 5_000,
            healthy_after_ms: 5_000,
            // Small pages: a resume after a fault replays in several.
            page_limit: Some(50),
            ..ClientConfig::default()
        };
        let client = SyncClient::new(config, rng.next_u64());
        let (halt, halt_rx) = watch::channel(false);
        let task = tokio::spawn(drive(
            client,
            Subscription {
                params,
                stored,
                addr,
                owner,
                secret: secret.clone(),
            },
            state.clone(),
            [stop.clone(), halt_rx],
        ));
        Ok(ScopeClient {
            state,
            task,
            halt,
            stop,
            addr,
            owner,
            secret,
        })
    }
}

struct Subscription {
    params: SubscribeParams,
    stored: StoredScope,
    addr: SocketAddr,
    owner: &'static str,
    secret: SyncSecret,
}

async fn drive(
    mut client: SyncClient,
    subscription: Subscription,
    shared: Arc<Mutex<ScopeState>>,
    [mut stop, mut halt]: [watch::Receiver<bool>; 2],
) {
    let Subscription {
        params,
        stored,
        addr,
        owner,
        secret,
    } = subscription;
    let started = Instant::now();
    let now = || u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let (events_tx, mut events) = mpsc::unbounded_channel::<Event>();
    let mut inputs = VecDeque::from([
        ClientInput::Start,
        ClientInput::Subscribe {
            scope: SCOPE,
            params: Box::new(params),
            stored,
        },
    ]);
    let mut sink: Option<(SocketId, Box<Sink>)> = None;
    let mut readers: HashMap<SocketId, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut timer: Option<u64> = None;
    loop {
        while let Some(input) = inputs.pop_front() {
            for effect in client.handle(now(), input) {
                match effect {
                    ClientEffect::RequestToken { request } => {
                        let result = mint_token(
                            &secret,
                            owner,
                            Duration::from_secs(3600),
                            &[],
                            now_unix_ms(),
                        )
                        .map(Some)
                        .map_err(|e| e.to_string());
                        inputs.push_back(ClientInput::Token { request, result });
                    }
                    ClientEffect::OpenSocket { socket } => {
                        lock(&shared).sockets_opened += 1;
                        let tx = events_tx.clone();
                        readers.insert(socket, tokio::spawn(read_socket(addr, socket, tx)));
                    }
                    ClientEffect::Send { socket, text } => {
                        if let Some((open, out)) = sink.as_mut() {
                            if *open == socket {
                                let sent = tokio::time::timeout(
                                    Duration::from_secs(5),
                                    out.send(Message::text(text)),
                                )
                                .await;
                                if !matches!(sent, Ok(Ok(()))) {
                                    // The reader reports the close.
                                    sink = None;
                                }
                            }
                        }
                    }
                    ClientEffect::CloseSocket { socket, .. } => {
                        if sink.as_ref().is_some_and(|(open, _)| *open == socket) {
                            sink = None;
                        }
                        if let Some(reader) = readers.remove(&socket) {
                            reader.abort();
                        }
                    }
                    ClientEffect::SetTimer { at_ms } => timer = at_ms,
                    ClientEffect::Persist { write, .. } => {
                        let mut state = lock(&shared);
                        if write.forget_cursor {
                            state.cursor = None;
                        }
                        for row in &write.upserts {
                            state
                                .stored
                                .insert(row.id.clone(), row_values(&row.data.to_map()));
                            state.raw.insert(row.id.clone(), row.clone());
                        }
                        for id in &write.deletes {
                            state.stored.remove(id);
                            state.raw.remove(id);
                        }
                        if let Some(cursor) = write.cursor {
                            if compare_cursors(Some(&cursor), state.cursor.as_ref())
                                == Ordering::Less
                            {
                                state.cursor_regressions += 1;
                            }
                            state.cursor = Some(cursor);
                        }
                    }
                    ClientEffect::Changed { reset, .. } => {
                        if reset {
                            lock(&shared).resets += 1;
                        }
                    }
                    ClientEffect::Ready { .. } => lock(&shared).live = true,
                    ClientEffect::ScopeFailed { code, message, .. } => {
                        lock(&shared).failed.push(format!("{code}: {message}"));
                    }
                    ClientEffect::Error { code, message, .. } => {
                        lock(&shared).errors.push(format!("{code}: {message}"));
                    }
                    ClientEffect::Progress { .. } | ClientEffect::Status(_) => {}
                    // This client makes no mutations.
                    ClientEffect::PersistOutbox { .. }
                    | ClientEffect::Settled { .. }
                    | ClientEffect::Upload { .. } => {
                        lock(&shared)
                            .errors
                            .push(format!("an outbox effect without a mutation: {effect:?}"));
                    }
                }
            }
        }
        {
            let mut state = lock(&shared);
            state.held = client
                .rows(SCOPE)
                .into_iter()
                .map(|row| {
                    let id = row
                        .get("id")
                        .map(crate::workload::text_of)
                        .unwrap_or_default();
                    (id, row_values(&row))
                })
                .collect();
            if !client.is_live(SCOPE) {
                state.live = false;
            }
        }
        let wait = timer.map_or(Duration::from_secs(3600), |at| {
            Duration::from_millis(at.saturating_sub(now()))
        });
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            _ = halt.wait_for(|s| *s) => break,
            event = events.recv() => match event {
                Some(Event::Opened(socket, out)) => {
                    sink = Some((socket, out));
                    inputs.push_back(ClientInput::SocketOpened { socket });
                }
                Some(Event::Frame(socket, text)) => {
                    inputs.push_back(ClientInput::SocketFrame { socket, text });
                }
                Some(Event::Closed(socket, reason)) => {
                    readers.remove(&socket);
                    if sink.as_ref().is_some_and(|(open, _)| *open == socket) {
                        sink = None;
                    }
                    inputs.push_back(ClientInput::SocketClosed { socket, reason });
                }
                None => break,
            },
            _ = tokio::time::sleep(wait) => {
                timer = None;
                inputs.push_back(ClientInput::Tick);
            }
        }
    }
    for (_, reader) in readers {
        reader.abort();
    }
}

/// Opens the socket and reports its life as events.
async fn read_socket(addr: SocketAddr, socket: SocketId, events: mpsc::UnboundedSender<Event>) {
    let url = format!("ws://{addr}/sync");
    let opened = tokio::time::timeout(
        Duration::from_secs(5),
        tokio_tungstenite::connect_async(url),
    )
    .await;
    let stream = match opened {
        Ok(Ok((stream, _))) => stream,
        Ok(Err(error)) => {
            let _ = events.send(Event::Closed(socket, error.to_string()));
            return;
        }
        Err(_) => {
            let _ = events.send(Event::Closed(socket, "connect timed out".to_owned()));
            return;
        }
    };
    let (out, mut incoming) = stream.split();
    if events.send(Event::Opened(socket, Box::new(out))).is_err() {
        return;
    }
    let reason = loop {
        match incoming.next().await {
            Some(Ok(Message::Text(text))) => {
                if events.send(Event::Frame(socket, text.to_string())).is_err() {
                    return;
                }
            }
            Some(Ok(Message::Close(frame))) => {
                break frame.map_or_else(
                    || "closed".to_owned(),
                    |f| format!("{} {}", f.code, f.reason),
                );
            }
            Some(Ok(_)) => {}
            Some(Err(error)) => break error.to_string(),
            None => break "ended".to_owned(),
        }
    };
    let _ = events.send(Event::Closed(socket, reason));
}
