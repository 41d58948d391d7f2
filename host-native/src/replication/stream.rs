//! The replication stream driver: a tokio task that keeps `START_REPLICATION` running, hands raw
//! CopyData payloads to one consumer through a bounded channel, and reports back only what the
//! consumer has acknowledged as durably stored.
//!
//! Liveness follows `wal_sender_timeout` (Zero's rules): a status update goes out whenever 75% of
//! the timeout passed without one, and 2× the timeout without any message from the server means
//! the connection is dead. While the consumer is not taking payloads (back-pressure) the task
//! stops reading the socket but keeps sending status updates, and the silence window is reset.
//! Lost connections are retried with exponential backoff (capped), resuming from the last
//! acknowledged position.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::FutureExt as _;
use highwater_engine::pgoutput::{ReplicationFrame, StandbyStatusUpdate};
use highwater_engine::watermark::Lsn;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use super::connection::{ConnectParams, ReplicationConnection, ReplicationStream};
use super::error::ReplicationError;

const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Tick period when the server has no `wal_sender_timeout`: nothing is due, so rarely.
const IDLE_TICK: Duration = Duration::from_secs(30);
/// Payloads already read that go on without checking stop, acknowledgements and liveness: a
/// burst costs one such check, and a long one still makes it this often.
const BURST_PAYLOADS: u32 = 64;

/// How to run the stream.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    pub params: ConnectParams,
    pub slot: String,
    pub publications: Vec<String>,
    /// Where to start; once the consumer acknowledges a later position, reconnects start there.
    pub start: Lsn,
    /// The server's `wal_sender_timeout` (see `setup::check_upstream`); `None` when disabled.
    pub wal_sender_timeout: Option<Duration>,
    /// Payloads buffered ahead of the consumer.
    pub capacity: usize,
    /// Upper bound of the reconnect backoff.
    pub(crate) max_backoff: Duration,
    /// Attempts while the slot is held by another connection before giving up.
    pub slot_in_use_attempts: u32,
}

impl StreamConfig {
    pub fn new(params: ConnectParams, slot: &str, publications: &[String], start: Lsn) -> Self {
        StreamConfig {
            params,
            slot: slot.to_owned(),
            publications: publications.to_vec(),
            start,
            wal_sender_timeout: Some(Duration::from_secs(60)),
            capacity: 1024,
            max_backoff: Duration::from_secs(10),
            slot_in_use_attempts: 8,
        }
    }
}

/// What the consumer receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WalEvent {
    /// Streaming (re)started at `start`. After a restart the server resends from the start of
    /// any transaction not yet acknowledged: drop partially received transactions, and expect
    /// transactions stored but not yet acknowledged to arrive again.
    Started { start: Lsn, backend_pid: i32 },
    /// One CopyData payload, undecoded: `w` XLogData or `k` keepalive
    /// (`highwater_engine::pgoutput::ReplicationFrame::decode`).
    CopyData(Bytes),
}

/// Reports durably stored positions to the stream; cheap to clone into the storing task.
#[derive(Debug, Clone)]
pub(crate) struct Acker(watch::Sender<Lsn>);

impl Acker {
    /// Everything up to `lsn` is durably stored (normally a commit's end LSN). Positions only
    /// move forward; an older one is ignored.
    pub(crate) fn ack(&self, lsn: Lsn) {
        self.0.send_if_modified(|acked| {
            let advance = lsn > *acked;
            if advance {
                *acked = lsn;
            }
            advance
        });
    }

    /// The highest position acknowledged so far (`Lsn(0)` before the first ack).
    #[cfg(test)]
    pub(crate) fn acked(&self) -> Lsn {
        *self.0.borrow()
    }
}

/// Handle of a running replication stream. Dropping it stops the task.
#[derive(Debug)]
pub struct WalStream {
    events: mpsc::Receiver<Result<WalEvent, ReplicationError>>,
    acker: Acker,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl WalStream {
    /// Starts the driver task on the current tokio runtime.
    pub fn spawn(config: StreamConfig) -> WalStream {
        let (events_tx, events) = mpsc::channel(config.capacity.max(1));
        let (acks_tx, acks_rx) = watch::channel(Lsn(0));
        let (stop, stop_rx) = watch::channel(false);
        let driver = Driver {
            config,
            events: events_tx,
            acks: acks_rx,
            stop: stop_rx,
        };
        let task = tokio::spawn(driver.run());
        WalStream {
            events,
            acker: Acker(acks_tx),
            stop,
            task,
        }
    }

    /// The next event. An `Err` is final (the task has given up); `None` follows it.
    pub async fn recv(&mut self) -> Option<Result<WalEvent, ReplicationError>> {
        self.events.recv().await
    }

    /// Waits for at least one event, then moves up to `limit` queued events into `buffer` in
    /// one wake-up; returns how many (0 once the stream has ended).
    pub(crate) async fn recv_many(
        &mut self,
        buffer: &mut Vec<Result<WalEvent, ReplicationError>>,
        limit: usize,
    ) -> usize {
        self.events.recv_many(buffer, limit).await
    }

    /// Moves up to `limit` events already queued into `buffer` without waiting.
    pub(crate) fn try_recv_many(
        &mut self,
        buffer: &mut Vec<Result<WalEvent, ReplicationError>>,
        limit: usize,
    ) -> usize {
        let mut taken = 0;
        while taken < limit {
            match self.events.try_recv() {
                Ok(event) => buffer.push(event),
                Err(_) => break,
            }
            taken += 1;
        }
        taken
    }

    /// See [`Acker::ack`].
    pub fn ack(&self, lsn: Lsn) {
        self.acker.ack(lsn);
    }

    pub(crate) fn acker(&self) -> Acker {
        self.acker.clone()
    }

    /// Ends the stream politely (CopyDone, Terminate) and waits for the task.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}

/// Why a streaming session ended without an error.
enum SessionEnd {
    Stopped,
    ServerEndedCopy,
}

struct Driver {
    config: StreamConfig,
    events: mpsc::Sender<Result<WalEvent, ReplicationError>>,
    acks: watch::Receiver<Lsn>,
    stop: watch::Receiver<bool>,
}

impl Driver {
    async fn run(mut self) {
        let mut backoff = crate::runtime::backoff(FIRST_BACKOFF, self.config.max_backoff);
        let mut busy_attempts = 0u32;
        loop {
            let start = self.config.start.max(self.acked());
            let error = match self.session(start, &mut backoff, &mut busy_attempts).await {
                Ok(SessionEnd::Stopped) => return,
                Ok(SessionEnd::ServerEndedCopy) => {
                    tracing::warn!(slot = %self.config.slot, "server ended the stream; reconnecting");
                    None
                }
                Err(error) => Some(error),
            };
            if let Some(error) = error {
                match error {
                    ReplicationError::SlotInUse { slot, message, .. } => {
                        busy_attempts += 1;
                        if busy_attempts >= self.config.slot_in_use_attempts {
                            let attempts = busy_attempts;
                            self.give_up(ReplicationError::SlotInUse {
                                slot,
                                attempts,
                                message,
                            })
                            .await;
                            return;
                        }
                        tracing::info!(%slot, attempt = busy_attempts, "slot busy; retrying");
                    }
                    error if error.is_transient() => {
                        let slot = &self.config.slot;
                        tracing::warn!(%slot, %error, "replication connection lost; reconnecting");
                    }
                    error => {
                        self.give_up(error).await;
                        return;
                    }
                }
            }
            let delay = crate::runtime::next_delay(&mut backoff);
            tokio::select! {
                _ = self.stop.changed() => return,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Copies the position out, so no watch lock is held across an await.
    fn acked(&self) -> Lsn {
        *self.acks.borrow()
    }

    async fn give_up(&self, error: ReplicationError) {
        tracing::error!(slot = %self.config.slot, %error, "replication stream stopped");
        let _ = self.events.send(Err(error)).await;
    }

    async fn session(
        &mut self,
        start: Lsn,
        backoff: &mut highwater_engine::backoff::Backoff,
        busy_attempts: &mut u32,
    ) -> Result<SessionEnd, ReplicationError> {
        let connection = tokio::select! {
            _ = self.stop.changed() => return Ok(SessionEnd::Stopped),
            c = ReplicationConnection::connect(&self.config.params) => c?,
        };
        let mut stream = connection
            .start_replication(&self.config.slot, start, &self.config.publications)
            .await?;
        backoff.reset();
        *busy_attempts = 0;
        tracing::info!(slot = %self.config.slot, %start, "replication stream started");
        let started = WalEvent::Started {
            start,
            backend_pid: stream.backend_pid(),
        };
        let result = self.pump(&mut stream, started).await;
        if matches!(result, Ok(SessionEnd::Stopped)) {
            // A stop can win the race against the last acknowledgement: confirm it now, so
            // the next session does not receive again what is already durable (a large last
            // transaction would be decoded and sent in full once more).
            let status = StandbyStatusUpdate::acknowledging(self.acked(), unix_now_ms());
            let _ = stream.send_copy_data(&status.encode()).await;
            stream.close().await;
        }
        result
    }

    /// Forwards `first`, then payloads from the socket, until stopped or broken.
    async fn pump(
        &mut self,
        stream: &mut ReplicationStream,
        first: WalEvent,
    ) -> Result<SessionEnd, ReplicationError> {
        let mut liveness = Liveness::new(self.config.wal_sender_timeout);
        let mut ticker = tokio::time::interval(liveness.tick_period());
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut pending = Some(first);
        let mut burst = 0;
        loop {
            if let Some(event) = pending.take() {
                if let Some(end) = self
                    .forward(stream, &mut liveness, &mut ticker, event)
                    .await?
                {
                    return Ok(end);
                }
            }
            // A payload already in the read buffer goes on at once, up to BURST_PAYLOADS in a
            // row: the select below (stop, acknowledgements, the liveness tick) then runs once
            // per burst instead of once per payload, and its timer and clock reads with it.
            let ready = if burst < BURST_PAYLOADS {
                stream.next_copy_data().now_or_never()
            } else {
                None
            };
            let payload = if let Some(payload) = ready {
                burst += 1;
                payload?
            } else {
                burst = 0;
                tokio::select! {
                biased;
                _ = self.stop.changed() => return Ok(SessionEnd::Stopped),
                changed = self.acks.changed() => {
                    if changed.is_err() {
                        return Ok(SessionEnd::Stopped);
                    }
                    let acked = *self.acks.borrow_and_update();
                    send_status(stream, acked, &mut liveness).await?;
                    continue;
                }
                _ = ticker.tick() => {
                    liveness.check_silence()?;
                    if liveness.status_due() {
                        send_status(stream, self.acked(), &mut liveness).await?;
                    }
                    continue;
                }
                payload = stream.next_copy_data() => payload?,
                }
            };
            let Some(payload) = payload else {
                return Ok(SessionEnd::ServerEndedCopy);
            };
            if burst <= 1 {
                // Later payloads of a burst arrived with its first.
                liveness.received();
            }
            if payload.first() == Some(&b'k') {
                match ReplicationFrame::decode(&payload) {
                    Ok(ReplicationFrame::Keepalive(keepalive)) if keepalive.reply_requested => {
                        send_status(stream, self.acked(), &mut liveness).await?;
                    }
                    Ok(_) => {}
                    Err(error) => {
                        return Err(ReplicationError::protocol(
                            "a well-formed primary keepalive",
                            error.to_string(),
                        ))
                    }
                }
            }
            pending = Some(WalEvent::CopyData(payload));
        }
    }

    /// Hands `event` to the consumer, waiting for room without reading the socket meanwhile
    /// (back-pressure reaches the server through TCP), while still acknowledging and keeping
    /// the session alive. `Some` when the session must end.
    async fn forward(
        &mut self,
        stream: &mut ReplicationStream,
        liveness: &mut Liveness,
        ticker: &mut tokio::time::Interval,
        event: WalEvent,
    ) -> Result<Option<SessionEnd>, ReplicationError> {
        // Room now (the common case while the consumer keeps up): no select, no timer.
        match self.events.try_reserve() {
            Ok(permit) => {
                permit.send(Ok(event));
                return Ok(None);
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(())) => {
                return Ok(Some(SessionEnd::Stopped))
            }
            Err(tokio::sync::mpsc::error::TrySendError::Full(())) => {}
        }
        let permit = loop {
            tokio::select! {
                biased;
                _ = self.stop.changed() => return Ok(Some(SessionEnd::Stopped)),
                permit = self.events.reserve() => match permit {
                    Ok(permit) => break permit,
                    Err(_) => return Ok(Some(SessionEnd::Stopped)),
                },
                changed = self.acks.changed() => {
                    if changed.is_err() {
                        return Ok(Some(SessionEnd::Stopped));
                    }
                    let acked = *self.acks.borrow_and_update();
                    send_status(stream, acked, liveness).await?;
                }
                _ = ticker.tick() => {
                    // Not silence: we are not reading while the consumer lags.
                    liveness.received();
                    if liveness.status_due() {
                        send_status(stream, self.acked(), liveness).await?;
                    }
                }
            }
        };
        permit.send(Ok(event));
        Ok(None)
    }
}

/// The two liveness clocks of a session: the engine's rules
/// ([`highwater_engine::upstream::Liveness`]) read against this task's tokio clock.
struct Liveness {
    epoch: Instant,
    rules: highwater_engine::upstream::Liveness,
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

impl Liveness {
    fn new(wal_sender_timeout: Option<Duration>) -> Self {
        Liveness {
            epoch: Instant::now(),
            rules: highwater_engine::upstream::Liveness::for_wal_sender_timeout(
                wal_sender_timeout.map(millis),
                0,
            ),
        }
    }

    fn now_ms(&self) -> u64 {
        millis(self.epoch.elapsed())
    }

    fn tick_period(&self) -> Duration {
        Duration::from_millis(self.rules.check_every_ms(millis(IDLE_TICK)))
    }

    fn received(&mut self) {
        let now = self.now_ms();
        self.rules.received(now);
    }

    fn sent(&mut self) {
        let now = self.now_ms();
        self.rules.sent(now);
    }

    fn status_due(&self) -> bool {
        self.rules.status_due(self.now_ms())
    }

    fn check_silence(&self) -> Result<(), ReplicationError> {
        match self.rules.silent_past_limit(self.now_ms()) {
            Some(silence) => Err(ReplicationError::Silent {
                silence: Duration::from_millis(silence),
            }),
            None => Ok(()),
        }
    }
}

/// Reports `acked` as written, flushed and applied.
async fn send_status(
    stream: &mut ReplicationStream,
    acked: Lsn,
    liveness: &mut Liveness,
) -> Result<(), ReplicationError> {
    let status = StandbyStatusUpdate::acknowledging(acked, unix_now_ms());
    stream.send_copy_data(&status.encode()).await?;
    liveness.sent();
    Ok(())
}

fn unix_now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acks_only_move_forward() {
        let (tx, _rx) = watch::channel(Lsn(0));
        let acker = Acker(tx);
        acker.ack(Lsn(50));
        acker.ack(Lsn(20));
        assert_eq!(acker.acked(), Lsn(50));
        acker.ack(Lsn(70));
        assert_eq!(acker.acked(), Lsn(70));
    }

    #[test]
    fn liveness_uses_three_quarters_and_twice_the_timeout() {
        let liveness = Liveness::new(Some(Duration::from_secs(60)));
        assert_eq!(liveness.tick_period(), Duration::from_secs(9));
        assert!(!liveness.status_due());
        assert!(liveness.check_silence().is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_disabled_timeout_disables_both_clocks() {
        let liveness = Liveness::new(None);
        tokio::time::advance(Duration::from_secs(3600)).await;
        assert!(!liveness.status_due());
        assert!(liveness.check_silence().is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn status_falls_due_and_silence_fails_on_the_timeout_clocks() {
        let mut liveness = Liveness::new(Some(Duration::from_millis(400)));
        tokio::time::advance(Duration::from_millis(299)).await;
        assert!(!liveness.status_due());
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(liveness.status_due());
        liveness.sent();
        assert!(!liveness.status_due());
        tokio::time::advance(Duration::from_millis(498)).await;
        assert!(liveness.check_silence().is_ok());
        tokio::time::advance(Duration::from_millis(2)).await;
        assert!(matches!(
            liveness.check_silence(),
            Err(ReplicationError::Silent { .. })
        ));
        liveness.received();
        assert!(liveness.check_silence().is_ok());
    }
}
