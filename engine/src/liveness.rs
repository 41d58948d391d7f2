//! Peer liveness, one rule for every socket the server holds (change-stream subscribers and
//! scope-sync clients alike): the host pings each peer once per ping interval, notes when it
//! last heard anything from it (a frame, a pong, a ping), and drops a peer silent for longer
//! than [`SILENT_INTERVALS`] whole intervals. Two intervals, not one: a pong that arrives just
//! after the next tick (a busy peer, a slow link) is not taken for a dead peer.

/// Whole ping intervals a peer may stay silent before it is dropped.
pub const SILENT_INTERVALS: u64 = 2;

/// Whether a peer last heard from at `last_heard_ms` is gone at `now_ms`, with pings every
/// `ping_interval_ms` (all on one clock of the host's choosing).
pub fn peer_is_gone(last_heard_ms: u64, now_ms: u64, ping_interval_ms: u64) -> bool {
    now_ms.saturating_sub(last_heard_ms) > SILENT_INTERVALS.saturating_mul(ping_interval_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_gone_only_after_two_silent_intervals() {
        assert!(!peer_is_gone(1_000, 1_000, 100));
        assert!(
            !peer_is_gone(1_000, 1_199, 100),
            "one missed pong is not enough"
        );
        assert!(!peer_is_gone(1_000, 1_200, 100));
        assert!(peer_is_gone(1_000, 1_201, 100));
        // A clock that went back (a host that restarted its epoch) never drops a peer.
        assert!(!peer_is_gone(5_000, 1_000, 100));
        assert!(!peer_is_gone(0, u64::MAX, u64::MAX), "no overflow");
    }
}
