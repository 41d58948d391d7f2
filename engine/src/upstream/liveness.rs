//! The two clocks of an upstream connection, as plain values: when a status update is due (we
//! must show the server we are alive), and when the server has been silent too long (it is
//! gone). The transport that owns the socket calls these with its own `now_ms`; they live
//! beside the socket rather than in [`UpstreamSession`](super::UpstreamSession) because a
//! status update must go out even while storage is slow and the session is not being fed.
//!
//! For Postgres (Zero's rules, from `wal_sender_timeout`): a status update whenever 75% of the
//! timeout passed without one, and 2× the timeout without any message means the connection is
//! dead. For a relay following a primary: the primary pings every interval, so silence beyond
//! that (plus slack) is dead. While the consumer is not taking input (back-pressure) the
//! transport is not reading, so it calls [`Liveness::received`] then too: silence it caused
//! itself is not the server's.

/// Status and silence deadlines of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Liveness {
    status_every_ms: Option<u64>,
    silence_limit_ms: Option<u64>,
    last_sent_ms: u64,
    last_received_ms: u64,
}

impl Liveness {
    /// A connection opened at `now_ms`; `None` disables that clock.
    pub fn new(status_every_ms: Option<u64>, silence_limit_ms: Option<u64>, now_ms: u64) -> Self {
        Liveness {
            status_every_ms,
            silence_limit_ms,
            last_sent_ms: now_ms,
            last_received_ms: now_ms,
        }
    }

    /// Postgres's clocks for a server `wal_sender_timeout` (`None` when it is disabled).
    pub fn for_wal_sender_timeout(timeout_ms: Option<u64>, now_ms: u64) -> Self {
        Liveness::new(
            timeout_ms.map(|t| t * 3 / 4),
            timeout_ms.map(|t| t.saturating_mul(2)),
            now_ms,
        )
    }

    /// How often to look at the clocks so a due status is late by at most a fifth of its
    /// interval; `idle_ms` when no status is ever due.
    pub fn check_every_ms(&self, idle_ms: u64) -> u64 {
        self.status_every_ms
            .map_or(idle_ms, |every| (every / 5).max(10))
    }

    /// Something arrived from the server (or we chose not to read).
    pub fn received(&mut self, now_ms: u64) {
        self.last_received_ms = self.last_received_ms.max(now_ms);
    }

    /// A status update went out.
    pub fn sent(&mut self, now_ms: u64) {
        self.last_sent_ms = self.last_sent_ms.max(now_ms);
    }

    /// Whether a status update must go out now.
    pub fn status_due(&self, now_ms: u64) -> bool {
        self.status_every_ms
            .is_some_and(|every| now_ms.saturating_sub(self.last_sent_ms) >= every)
    }

    /// How long the server has been silent, once that reached the limit.
    pub fn silent_past_limit(&self, now_ms: u64) -> Option<u64> {
        let silence = now_ms.saturating_sub(self.last_received_ms);
        self.silence_limit_ms
            .filter(|limit| silence >= *limit)
            .map(|_| silence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_is_due_at_three_quarters_of_the_timeout_and_silence_kills_at_twice_it() {
        let mut live = Liveness::for_wal_sender_timeout(Some(60_000), 1_000);
        assert!(!live.status_due(1_000 + 44_999));
        assert!(live.status_due(1_000 + 45_000));
        live.sent(46_000);
        assert!(!live.status_due(46_000 + 44_999));
        assert_eq!(live.silent_past_limit(1_000 + 119_999), None);
        assert_eq!(live.silent_past_limit(1_000 + 120_000), Some(120_000));
        live.received(100_000);
        assert_eq!(live.silent_past_limit(121_000), None);
        assert_eq!(live.check_every_ms(30_000), 9_000);
    }

    #[test]
    fn a_disabled_timeout_never_asks_for_a_status_nor_gives_up() {
        let live = Liveness::for_wal_sender_timeout(None, 0);
        assert!(!live.status_due(u64::MAX));
        assert_eq!(live.silent_past_limit(u64::MAX), None);
        assert_eq!(live.check_every_ms(30_000), 30_000);
    }

    #[test]
    fn clocks_never_run_backwards() {
        let mut live = Liveness::new(Some(10), Some(100), 50);
        live.received(20);
        live.sent(20);
        assert!(!live.status_due(59));
        assert_eq!(live.silent_past_limit(149), None);
        assert_eq!(live.silent_past_limit(150), Some(100));
    }
}
