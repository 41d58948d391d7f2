//! One subscriber's stream position, catch-up backlog and flow control
//! (`docs/protocol/change-stream.md`, "Subscription phases", "Acks and back-pressure").

use std::collections::VecDeque;
use std::sync::Arc;

use super::entry::{Entry, EntryKind};
use crate::backfill::BackfillStateTracker;
use crate::watermark::Watermark;

/// Where a subscriber is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Subscribed while a transaction was in flight; starts at the next commit or rollback so
    /// that catch-up and live stream meet at a transaction boundary (`change-stream.md`,
    /// "Catch-up", step 1).
    Queued,
    /// Reading the change log; live messages wait in the backlog.
    CatchingUp {
        /// Whether the first row has been judged (`change-stream.md`, "Catch-up", step 4).
        checked: bool,
    },
    /// Caught up; the backlog is being sent with bounded bytes in flight.
    Draining,
    /// Live messages go out directly.
    Live,
}

/// What a frame carried, for the accounting its ack releases.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Carried {
    /// Bytes that came out of the backlog.
    pub backlog_bytes: usize,
    /// Bytes read from the change log.
    pub catchup_bytes: usize,
    /// Bytes sent live, straight from the stream.
    pub live_bytes: usize,
    /// The last commit in the frame: its ack means the transaction was applied.
    pub commit: Option<Watermark>,
}

impl Carried {
    pub fn merge(&mut self, other: Carried) {
        self.backlog_bytes += other.backlog_bytes;
        self.catchup_bytes += other.catchup_bytes;
        self.live_bytes += other.live_bytes;
        if other.commit.is_some() {
            self.commit = other.commit;
        }
    }
}

/// Where a message sent to a subscriber came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Live,
    Backlog,
    Catchup,
}

/// Messages bound for one subscriber during one event, and what sending them observed.
pub struct Delivery<'a> {
    version: u32,
    tracker: &'a mut BackfillStateTracker,
    pub out: Vec<(Arc<str>, Carried)>,
    pub warnings: Vec<String>,
}

impl<'a> Delivery<'a> {
    pub fn new(version: u32, tracker: &'a mut BackfillStateTracker) -> Self {
        Self::reusing(version, tracker, Vec::new())
    }

    /// A delivery that collects into `out` (emptied first), an allocation kept from before.
    pub fn reusing(
        version: u32,
        tracker: &'a mut BackfillStateTracker,
        mut out: Vec<(Arc<str>, Carried)>,
    ) -> Self {
        out.clear();
        Delivery {
            version,
            tracker,
            out,
            warnings: Vec::new(),
        }
    }
}

/// Byte limits for backlogs and in-flight data (`change-stream.md`, "Acks and back-pressure").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WaterMarks {
    pub high: usize,
    pub low: usize,
}

/// A registered subscriber.
#[derive(Debug, Clone)]
pub struct Subscriber {
    /// The subscriber's own id (debugging and logs).
    pub id: String,
    /// Its key in the backfill tracker, unique per connection.
    pub tracker_key: String,
    /// Whether its backfills are tracked (a v8 subscriber with valid `backfills`).
    pub tracked: bool,
    /// The watermark it subscribed at.
    pub requested: Watermark,
    /// The last commit sent to it.
    pub watermark: Watermark,
    /// The last commit it acknowledged (applied); never moves backwards.
    pub acked: Watermark,
    pub phase: Phase,
    pub status_sent: bool,
    backlog: VecDeque<Arc<Entry>>,
    /// Backlog bytes: queued plus sent from the backlog but not yet acked (Zero's count).
    backlog_bytes: usize,
    /// Backlog bytes sent but not yet acked.
    backlog_in_flight: usize,
    /// Change-log bytes sent but not yet acked.
    catchup_in_flight: usize,
    /// Live bytes sent but not yet acked: a live subscriber that stops reading holds up the
    /// stream like a full backlog instead of piling up frames without limit.
    live_in_flight: usize,
    /// The host was told to stop reading the change log for this subscriber.
    pub catchup_paused: bool,
    /// The backlog plus unacknowledged live bytes reached high water and have not yet fallen
    /// to low water: this holds up the upstream stream.
    pub blocking: bool,
    /// When the host's clock first saw `blocking`.
    pub blocking_since: Option<u64>,
}

impl Subscriber {
    pub fn new(id: String, tracker_key: String, watermark: Watermark) -> Self {
        Subscriber {
            id,
            tracker_key,
            tracked: false,
            requested: watermark.clone(),
            acked: watermark.clone(),
            watermark,
            phase: Phase::Queued,
            status_sent: false,
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            backlog_in_flight: 0,
            catchup_in_flight: 0,
            live_in_flight: 0,
            catchup_paused: false,
            blocking: false,
            blocking_since: None,
        }
    }

    pub fn backlog_bytes(&self) -> usize {
        self.backlog_bytes
    }

    #[cfg(test)]
    pub fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    pub fn catchup_in_flight(&self) -> usize {
        self.catchup_in_flight
    }

    pub fn live_in_flight(&self) -> usize {
        self.live_in_flight
    }

    /// What this subscriber holds of the stream: its backlog and unacknowledged live bytes.
    fn held_bytes(&self) -> usize {
        self.backlog_bytes + self.live_in_flight
    }

    /// A live message: sent now, kept in the backlog, or ignored (queued subscribers start
    /// after it). Returns whether the subscriber just became aligned.
    pub fn offer(&mut self, entry: &Arc<Entry>, limits: WaterMarks, d: &mut Delivery) -> bool {
        match self.phase {
            Phase::Queued => false,
            Phase::Live => {
                self.deliver(entry, Source::Live, d);
                if self.held_bytes() >= limits.high {
                    self.blocking = true;
                }
                false
            }
            Phase::CatchingUp { .. } | Phase::Draining => {
                if entry.is_seen_at(&self.watermark) {
                    return false;
                }
                self.backlog_bytes += entry.bytes();
                self.backlog.push_back(entry.clone());
                if self.held_bytes() >= limits.high {
                    self.blocking = true;
                }
                self.phase == Phase::Draining && self.drain(limits, d)
            }
        }
    }

    /// A change-log row read for this subscriber's catch-up.
    pub fn catch_up(&mut self, entry: &Arc<Entry>, d: &mut Delivery) {
        self.deliver(entry, Source::Catchup, d);
    }

    /// Sends the initial status if it is due (v2+, once, before anything else of the stream).
    pub fn ensure_status(&mut self, status: &Arc<str>, d: &mut Delivery) {
        if !self.status_sent {
            self.status_sent = true;
            if d.version >= 2 {
                d.out.push((status.clone(), Carried::default()));
            }
        }
    }

    /// Sends backlog entries while fewer than `limits.high` backlog bytes are in flight.
    /// Returns whether the backlog was emptied and the subscriber thereby became aligned.
    pub fn drain(&mut self, limits: WaterMarks, d: &mut Delivery) -> bool {
        if self.phase != Phase::Draining {
            return false;
        }
        while self.backlog_in_flight < limits.high {
            let Some(entry) = self.backlog.pop_front() else {
                break;
            };
            let bytes = entry.bytes();
            if self.deliver(&entry, Source::Backlog, d) {
                self.backlog_in_flight += bytes;
            } else {
                self.backlog_bytes -= bytes;
            }
        }
        self.release_block(limits);
        if self.backlog.is_empty() {
            self.phase = Phase::Live;
            return true;
        }
        false
    }

    /// Sends `entry` if this subscriber has not seen its transaction and its protocol takes
    /// it; applies it to the subscriber's backfill state. Returns whether it was sent.
    fn deliver(&mut self, entry: &Arc<Entry>, source: Source, d: &mut Delivery) -> bool {
        if entry.is_seen_at(&self.watermark) {
            return false;
        }
        let Some(text) = entry.text_for(d.version) else {
            return false;
        };
        if self.tracked {
            if let Some(message) = entry.for_backfill_tracking() {
                let ignored = d.tracker.apply_sent(&self.tracker_key, &message);
                if ignored.unexpected {
                    d.warnings.push(format!(
                        "subscriber {} ignored backfill data for {}",
                        self.id,
                        ignored.columns.join(", ")
                    ));
                }
            }
        }
        let mut carried = Carried::default();
        match source {
            Source::Live => {
                carried.live_bytes = entry.bytes();
                self.live_in_flight += entry.bytes();
            }
            Source::Backlog => carried.backlog_bytes = entry.bytes(),
            Source::Catchup => {
                carried.catchup_bytes = entry.bytes();
                self.catchup_in_flight += entry.bytes();
            }
        }
        if entry.kind() == EntryKind::Commit {
            if let Some(w) = entry.watermark() {
                self.watermark = w.clone();
                carried.commit = Some(w.clone());
            }
        }
        d.out.push((text, carried));
        true
    }

    /// A frame this subscriber got was acknowledged.
    pub fn on_acked(&mut self, carried: &Carried, limits: WaterMarks) {
        self.backlog_bytes -= carried.backlog_bytes.min(self.backlog_bytes);
        self.backlog_in_flight -= carried.backlog_bytes.min(self.backlog_in_flight);
        self.catchup_in_flight -= carried.catchup_bytes.min(self.catchup_in_flight);
        self.live_in_flight -= carried.live_bytes.min(self.live_in_flight);
        if let Some(commit) = &carried.commit {
            if *commit > self.acked {
                self.acked = commit.clone();
            }
        }
        self.release_block(limits);
    }

    fn release_block(&mut self, limits: WaterMarks) {
        if self.blocking && self.held_bytes() <= limits.low {
            self.blocking = false;
            self.blocking_since = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change_stream::decode_downstream;

    const LIMITS: WaterMarks = WaterMarks {
        high: 200,
        low: 160,
    };

    fn w(text: &str) -> Watermark {
        Watermark::parse(text).expect("watermark")
    }

    fn entry(text: &str, watermark: Option<&str>) -> Arc<Entry> {
        Arc::new(Entry::live(
            decode_downstream(text).expect("message"),
            watermark.map(w),
        ))
    }

    fn begin(wm: &str) -> Arc<Entry> {
        entry(
            &format!(r#"["begin",{{"tag":"begin"}},{{"commitWatermark":"{wm}"}}]"#),
            Some(wm),
        )
    }

    fn commit(wm: &str) -> Arc<Entry> {
        entry(
            &format!(r#"["commit",{{"tag":"commit"}},{{"watermark":"{wm}"}}]"#),
            Some(wm),
        )
    }

    fn subscriber(at: &str) -> Subscriber {
        Subscriber::new("s".into(), "s/1".into(), w(at))
    }

    fn sent(d: &Delivery) -> Vec<String> {
        d.out.iter().map(|(t, _)| t.to_string()).collect()
    }

    #[test]
    fn catchup_and_backlog() {
        let mut tracker = BackfillStateTracker::new();
        let mut s = subscriber("0a");
        s.phase = Phase::CatchingUp { checked: true };
        let mut d = Delivery::new(6, &mut tracker);
        // Live transaction 0c arrives during catch-up: kept back.
        assert!(!s.offer(&begin("0c"), LIMITS, &mut d));
        assert!(!s.offer(&commit("0c"), LIMITS, &mut d));
        assert!(d.out.is_empty());
        assert_eq!(s.backlog_len(), 2);
        // Catch-up sends 0b from the log.
        s.catch_up(&begin("0b"), &mut d);
        s.catch_up(&commit("0b"), &mut d);
        assert_eq!(s.watermark, w("0b"));
        s.phase = Phase::Draining;
        assert!(s.drain(LIMITS, &mut d));
        assert_eq!(s.phase, Phase::Live);
        let texts = sent(&d);
        assert_eq!(texts.len(), 4);
        assert!(texts[0].contains(r#""0b""#) && texts[3].contains(r#""0c""#));
        assert_eq!(s.watermark, w("0c"));
    }

    #[test]
    fn watermark_filtering() {
        let mut tracker = BackfillStateTracker::new();
        let mut s = subscriber("0b");
        s.phase = Phase::Live;
        let mut d = Delivery::new(6, &mut tracker);
        for e in [begin("0a"), commit("0a"), begin("0b"), commit("0b")] {
            s.offer(&e, LIMITS, &mut d);
        }
        assert!(d.out.is_empty(), "{:?}", sent(&d));
        // Statuses belong to no transaction and always pass.
        s.offer(
            &entry(r#"["status",{"tag":"status"}]"#, None),
            LIMITS,
            &mut d,
        );
        s.offer(&begin("0c"), LIMITS, &mut d);
        s.offer(&commit("0c"), LIMITS, &mut d);
        assert_eq!(d.out.len(), 3);
        assert_eq!(d.out[2].1.commit, Some(w("0c")));
    }

    #[test]
    fn backlog_back_pressure_until_drained() {
        let mut tracker = BackfillStateTracker::new();
        let mut s = subscriber("01");
        s.phase = Phase::CatchingUp { checked: true };
        let mut d = Delivery::new(6, &mut tracker);
        let mut n = 1;
        while !s.blocking {
            n += 1;
            let wm = format!("0{}", char::from_digit(n, 36).expect("digit"));
            s.offer(&begin(&wm), LIMITS, &mut d);
            s.offer(&commit(&wm), LIMITS, &mut d);
        }
        assert!(s.backlog_bytes() >= LIMITS.high);
        // Draining hands entries out, but their bytes count until acked: the subscriber
        // keeps holding up the stream until acks bring it down to low water.
        s.phase = Phase::Draining;
        s.drain(LIMITS, &mut d);
        assert!(s.blocking);
        let mut next = 0;
        while s.blocking {
            let carried = d.out[next].1.clone();
            next += 1;
            assert!(s.backlog_bytes() > LIMITS.low);
            s.on_acked(&carried, LIMITS);
            s.drain(LIMITS, &mut d);
        }
        assert!(s.backlog_bytes() <= LIMITS.low);
    }

    #[test]
    fn live_bytes_count_until_acked_and_block_above_high_water() {
        let mut tracker = BackfillStateTracker::new();
        let mut s = subscriber("01");
        s.phase = Phase::Live;
        let mut d = Delivery::new(6, &mut tracker);
        let mut n = 1;
        while !s.blocking {
            n += 1;
            let wm = format!("0{}", char::from_digit(n, 36).expect("digit"));
            s.offer(&begin(&wm), LIMITS, &mut d);
            s.offer(&commit(&wm), LIMITS, &mut d);
        }
        // Sent at once, but held until acked.
        assert_eq!(d.out.len(), 2 * (n as usize - 1));
        assert!(s.live_in_flight() >= LIMITS.high);
        let mut next = 0;
        while s.blocking {
            assert!(s.live_in_flight() > LIMITS.low);
            s.on_acked(&d.out[next].1, LIMITS);
            next += 1;
        }
        assert!(s.live_in_flight() <= LIMITS.low);
        for (_, carried) in &d.out[next..] {
            s.on_acked(carried, LIMITS);
        }
        assert_eq!(s.live_in_flight(), 0);
        assert_eq!(s.backlog_bytes(), 0);
    }

    #[test]
    fn set_caught_up_drains_with_bounded_bytes_in_flight() {
        let mut tracker = BackfillStateTracker::new();
        let mut s = subscriber("01");
        s.phase = Phase::CatchingUp { checked: true };
        let mut d = Delivery::new(6, &mut tracker);
        for n in 2..20u32 {
            let wm = format!("0{}", char::from_digit(n, 36).expect("digit"));
            s.offer(&begin(&wm), LIMITS, &mut d);
            s.offer(&commit(&wm), LIMITS, &mut d);
        }
        s.phase = Phase::Draining;
        assert!(!s.drain(LIMITS, &mut d));
        let in_flight: usize = d.out.iter().map(|(_, c)| c.backlog_bytes).sum();
        let one = begin("0z").bytes().max(commit("0z").bytes());
        assert!(in_flight >= LIMITS.high && in_flight < LIMITS.high + one);
        assert_eq!(s.phase, Phase::Draining);
        // Each ack lets more out, until the backlog is empty and the subscriber is live.
        let mut aligned = false;
        let mut next = 0;
        while !aligned {
            let carried = d.out[next].1.clone();
            next += 1;
            s.on_acked(&carried, LIMITS);
            aligned = s.drain(LIMITS, &mut d);
        }
        assert_eq!(s.phase, Phase::Live);
        assert_eq!(s.watermark, w("0j"));
        assert_eq!(d.out.len(), 36);
    }

    #[test]
    fn on_ack_is_monotonic() {
        let mut s = subscriber("05");
        let acked = |c: &str| Carried {
            commit: Some(w(c)),
            ..Carried::default()
        };
        s.on_acked(&acked("0a"), LIMITS);
        assert_eq!(s.acked, w("0a"));
        s.on_acked(&acked("07"), LIMITS);
        assert_eq!(s.acked, w("0a"));
        s.on_acked(&Carried::default(), LIMITS);
        assert_eq!(s.acked, w("0a"));
    }

    #[test]
    fn first_status_only_for_v2_and_later() {
        let status: Arc<str> = r#"["status",{"tag":"status"}]"#.into();
        let mut tracker = BackfillStateTracker::new();
        for (version, expected) in [(1, 0), (2, 1), (8, 1)] {
            let mut s = subscriber("01");
            let mut d = Delivery::new(version, &mut tracker);
            s.ensure_status(&status, &mut d);
            s.ensure_status(&status, &mut d);
            assert_eq!(d.out.len(), expected, "v{version}");
            assert!(s.status_sent);
        }
    }
}
