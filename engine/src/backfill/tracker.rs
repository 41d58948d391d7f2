//! The change streamer's backfill bookkeeping across stream restarts
//! (which backfills a restarted stream must request again).

use indexmap::IndexMap;

use super::progress::{superset, with_resume_point};
use super::state::BackfillState;
use super::BackfillError;
use crate::change_stream::{BackfillRequest, Change, DownstreamMessage};

/// How a subscriber's reported backfills were taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registration {
    /// A v8 subscriber: its pending backfills are tracked.
    Tracked,
    /// No backfills reported (protocol < v8): the change log's state stands in for it.
    Untracked,
    /// The reported backfills were unusable; the subscriber is treated as v7. Worth a warning.
    Invalid(BackfillError),
}

/// Columns a subscriber ignored in a backfill message sent to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IgnoredColumns {
    /// As `schema.table.column`.
    pub columns: Vec<String>,
    /// Whether the subscriber was aligned with no restart pending, where nothing should ever be
    /// ignored: worth a warning and a metric.
    pub unexpected: bool,
}

#[derive(Debug, Clone)]
struct TrackedSubscriber {
    backfills: BackfillState,
    /// Caught up and flushed: its state describes the streamer's own stream position.
    aligned: bool,
}

/// Tracks the pending backfills of the change log, the current change stream and every v8
/// subscriber, to decide which backfill requests start a stream and when a stream must restart.
///
/// The change streamer calls [`start_stream`](Self::start_stream) whenever it starts the
/// upstream stream, [`apply_message`](Self::apply_message) for every message it forwards
/// (before forwarding it, so the stream's state is never ahead of an aligned subscriber's),
/// [`apply_sent`](Self::apply_sent) for every message it sends to a subscriber, and restarts the
/// upstream stream at the next transaction boundary while
/// [`restart_reason`](Self::restart_reason) is set.
#[derive(Debug, Clone, Default)]
pub struct BackfillStateTracker {
    /// The change log's own pending backfills, i.e. those of a subscriber that applied every
    /// logged change. Stands in for subscribers that do not report theirs (protocol < v8).
    log: BackfillState,
    /// The progress of the current stream, seeded from the requests it was started with.
    session: BackfillState,
    subscribers: IndexMap<String, TrackedSubscriber>,
    restart_reason: Option<String>,
}

impl BackfillStateTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Why the upstream stream must be restarted (at the next transaction boundary), if it must.
    pub fn restart_reason(&self) -> Option<&str> {
        self.restart_reason.as_deref()
    }

    /// The change log's pending backfills.
    pub fn log(&self) -> &BackfillState {
        &self.log
    }

    /// The current stream's pending backfills and progress.
    pub fn session(&self) -> &BackfillState {
        &self.session
    }

    /// A registered v8 subscriber's pending backfills.
    pub fn subscriber(&self, id: &str) -> Option<&BackfillState> {
        self.subscribers.get(id).map(|s| &s.backfills)
    }

    /// Computes the backfill requests that start a new upstream stream.
    ///
    /// `cookie_jar` is the change log's cookie jar at the stream's starting watermark. It keeps
    /// no progress, so the log state is re-seeded from it carrying over the progress tracked in
    /// memory wherever the backfill ID still matches. The requests are the superset of the log's
    /// and every aligned v8 subscriber's, each rewritten to its resume point; they seed the
    /// session state and clear any restart reason.
    pub fn start_stream(&mut self, cookie_jar: Vec<BackfillRequest>) -> Vec<BackfillRequest> {
        // The jar may trail the in-memory log (a forwarded commit that was not stored); the new
        // stream re-delivers those changes.
        let reseeded = self.log.with_progress(superset([cookie_jar]));
        self.log = BackfillState::from_unique(reseeded);

        let aligned = self
            .subscribers
            .values()
            .filter(|s| s.aligned)
            .map(|s| s.backfills.requests());
        let requests: Vec<BackfillRequest> =
            superset(std::iter::once(self.log.requests()).chain(aligned))
                .iter()
                .map(with_resume_point)
                .collect();

        self.session = BackfillState::from_unique(requests.iter().cloned());
        self.restart_reason = None;
        requests
    }

    /// Applies a forwarded message to the session and log states.
    pub fn apply_message(&mut self, message: &DownstreamMessage) {
        self.session.apply_message(message);
        self.log.apply_message(message);
    }

    /// Applies a forwarded change to the session and log states.
    pub fn apply(&mut self, change: &Change) {
        self.session.apply(change);
        self.log.apply(change);
    }

    /// Registers a subscriber with the backfills it reported in `start-subscription` (`None`
    /// for protocol < v8). Only tracked subscribers count towards stream requests and coverage.
    pub fn register(
        &mut self,
        id: impl Into<String>,
        backfills: Option<Vec<BackfillRequest>>,
    ) -> Registration {
        let Some(backfills) = backfills else {
            return Registration::Untracked;
        };
        match BackfillState::try_from_requests(backfills) {
            Ok(backfills) => {
                let subscriber = TrackedSubscriber {
                    backfills,
                    aligned: false,
                };
                self.subscribers.insert(id.into(), subscriber);
                Registration::Tracked
            }
            Err(e) => Registration::Invalid(e),
        }
    }

    /// Forgets a subscriber (its connection closed).
    pub fn unregister(&mut self, id: &str) {
        self.subscribers.shift_remove(id);
    }

    /// Applies a message sent to subscriber `id` (catch-up, backlog or live) to its state.
    pub fn apply_sent(&mut self, id: &str, message: &DownstreamMessage) -> IgnoredColumns {
        let Some(subscriber) = self.subscribers.get_mut(id) else {
            return IgnoredColumns::default();
        };
        let columns = subscriber.backfills.apply_message(message);
        let unexpected = !columns.is_empty() && subscriber.aligned && self.restart_reason.is_none();
        IgnoredColumns {
            columns,
            unexpected,
        }
    }

    /// Marks subscriber `id` as aligned (caught up and flushed). If the current stream does not
    /// cover some of its pending columns, sets the restart reason (unless one is already set).
    /// Unregistered and untracked subscribers are ignored.
    ///
    /// Both sides compare committed state, so this may be called mid-transaction.
    pub fn mark_aligned(&mut self, id: &str) {
        let Some(subscriber) = self.subscribers.get_mut(id) else {
            return;
        };
        subscriber.aligned = true;
        let uncovered = subscriber.backfills.uncovered(&self.session);
        if !uncovered.is_empty() && self.restart_reason.is_none() {
            self.restart_reason = Some(format!(
                "subscriber {id} needs backfills that are not covered by the current stream: {}",
                uncovered.join(", ")
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backfill::progress::tests::{mark, request};
    use crate::backfill::state::tests::backfill;
    use crate::change_stream::{Begin, Commit, ProgressMark};
    use crate::watermark::Watermark;
    use serde_json::json;

    fn watermark() -> Watermark {
        Watermark::parse("02").expect("watermark")
    }

    fn transaction(tracker: &mut BackfillStateTracker, change: Change) {
        tracker.apply_message(&DownstreamMessage::Begin(Begin::new(watermark())));
        tracker.apply_message(&DownstreamMessage::Data(change));
        tracker.apply_message(&DownstreamMessage::Commit(Commit::new(watermark())));
    }

    /// A tracker whose stream (and log) advanced column `a` of `public.foo` to mark 05.
    fn tracker_at_05() -> BackfillStateTracker {
        let mut tracker = BackfillStateTracker::new();
        tracker.start_stream(vec![request(&[("a", None)])]);
        transaction(&mut tracker, backfill(&["a"], Some((None, mark("05")))));
        tracker
    }

    fn subscriber_at(tracker: &mut BackfillStateTracker, id: &str, progress: ProgressMark) {
        let registration = tracker.register(id, Some(vec![request(&[("a", Some(progress))])]));
        assert_eq!(registration, Registration::Tracked);
    }

    #[test]
    fn start_stream_returns_the_superset_of_the_log_and_aligned_subscribers() {
        let mut tracker = tracker_at_05();
        subscriber_at(&mut tracker, "sub", mark("03"));
        tracker.mark_aligned("sub");

        // The cookie jar reports no progress, the log carries 05 over in memory, and the
        // aligned subscriber's earlier 03 wins.
        let requests = tracker.start_stream(vec![request(&[("a", None)])]);
        assert_eq!(requests, vec![request(&[("a", Some(mark("03")))])]);
        assert_eq!(tracker.session().requests(), requests);
    }

    #[test]
    fn start_stream_carries_log_progress_over_from_the_cookie_jar() {
        let mut tracker = tracker_at_05();
        let requests = tracker.start_stream(vec![request(&[("a", None)])]);
        assert_eq!(requests, vec![request(&[("a", Some(mark("05")))])]);

        // A different backfill ID in the jar restarts the column from scratch.
        let mut restarted = request(&[("a", None)]);
        restarted.columns[0].id = json!({"col": "a", "attempt": 2});
        let requests = tracker.start_stream(vec![restarted.clone()]);
        assert_eq!(requests, vec![restarted]);
    }

    #[test]
    fn start_stream_rewrites_requests_to_their_resume_points() {
        let mut tracker = BackfillStateTracker::new();
        assert_eq!(
            tracker.register(
                "sub",
                Some(vec![request(&[
                    ("a", Some(mark("07"))),
                    ("b", Some(mark("04")))
                ])])
            ),
            Registration::Tracked
        );
        tracker.mark_aligned("sub");
        let requests = tracker.start_stream(Vec::new());
        assert_eq!(
            requests,
            vec![request(&[("a", Some(mark("04"))), ("b", Some(mark("04")))])]
        );
    }

    #[test]
    fn start_stream_ignores_unaligned_and_v7_subscribers() {
        let mut tracker = BackfillStateTracker::new();
        assert_eq!(tracker.register("v7", None), Registration::Untracked);
        tracker.mark_aligned("v7");
        subscriber_at(&mut tracker, "unaligned", mark("09"));

        let requests = tracker.start_stream(vec![request(&[("a", None)])]);
        assert_eq!(requests, vec![request(&[("a", None)])]);
        assert!(tracker.subscriber("v7").is_none());
    }

    #[test]
    fn uncovered_aligned_subscriber_sets_a_restart_reason() {
        let mut tracker = tracker_at_05();
        assert_eq!(tracker.restart_reason(), None);

        // The session has moved past 02, where this subscriber must resume.
        subscriber_at(&mut tracker, "sub-1", mark("02"));
        assert_eq!(tracker.restart_reason(), None);
        tracker.mark_aligned("sub-1");
        assert_eq!(
            tracker.restart_reason(),
            Some(
                "subscriber sub-1 needs backfills that are not covered by the current stream: \
                 public.foo.a"
            )
        );

        // The next stream starts early enough, and the reason is cleared.
        let requests = tracker.start_stream(vec![request(&[("a", None)])]);
        assert_eq!(requests, vec![request(&[("a", Some(mark("02")))])]);
        assert_eq!(tracker.restart_reason(), None);
    }

    #[test]
    fn first_restart_reason_is_kept() {
        let mut tracker = tracker_at_05();
        subscriber_at(&mut tracker, "first", mark("02"));
        subscriber_at(&mut tracker, "second", mark("01"));
        tracker.mark_aligned("first");
        tracker.mark_aligned("second");
        assert!(tracker
            .restart_reason()
            .is_some_and(|r| r.starts_with("subscriber first ")));
    }

    #[test]
    fn covered_aligned_subscriber_sets_no_restart_reason() {
        let mut tracker = tracker_at_05();
        // The session already delivered a continuous chain up to 08.
        subscriber_at(&mut tracker, "sub", mark("08"));
        tracker.mark_aligned("sub");
        assert_eq!(tracker.restart_reason(), None);
    }

    #[test]
    fn unregistered_subscriber_does_not_trigger_a_coverage_check() {
        let mut tracker = tracker_at_05();
        tracker.mark_aligned("never-registered");
        assert_eq!(tracker.restart_reason(), None);

        subscriber_at(&mut tracker, "gone", mark("02"));
        tracker.unregister("gone");
        tracker.mark_aligned("gone");
        assert_eq!(tracker.restart_reason(), None);
    }

    #[test]
    fn invalid_backfills_are_treated_as_v7() {
        let mut tracker = tracker_at_05();
        let registration = tracker.register(
            "dup",
            Some(vec![request(&[("a", None)]), request(&[("b", None)])]),
        );
        assert!(matches!(
            registration,
            Registration::Invalid(BackfillError::DuplicateTable { .. })
        ));
        tracker.mark_aligned("dup");
        assert_eq!(tracker.restart_reason(), None);
        assert!(tracker.subscriber("dup").is_none());
    }

    #[test]
    fn ignored_backfill_is_unexpected_only_for_aligned_subscribers_without_pending_restart() {
        let mut tracker = tracker_at_05();
        subscriber_at(&mut tracker, "sub", mark("08"));
        let gap = DownstreamMessage::Data(backfill(&["a"], Some((Some(mark("09")), mark("10")))));

        let ignored = tracker.apply_sent("sub", &gap);
        assert_eq!(ignored.columns, vec!["public.foo.a"]);
        assert!(!ignored.unexpected, "not aligned yet");

        tracker.mark_aligned("sub");
        assert!(tracker.apply_sent("sub", &gap).unexpected);

        subscriber_at(&mut tracker, "behind", mark("01"));
        tracker.mark_aligned("behind");
        assert!(tracker.restart_reason().is_some());
        assert!(
            !tracker.apply_sent("sub", &gap).unexpected,
            "restart pending"
        );
    }

    #[test]
    fn messages_sent_to_a_subscriber_advance_only_its_state() {
        let mut tracker = tracker_at_05();
        subscriber_at(&mut tracker, "sub", mark("05"));
        let next = DownstreamMessage::Data(backfill(&["a"], Some((Some(mark("05")), mark("07")))));
        assert!(tracker.apply_sent("sub", &next).columns.is_empty());
        assert_eq!(
            tracker.subscriber("sub").map(BackfillState::requests),
            Some(vec![request(&[("a", Some(mark("07")))])])
        );
        assert_eq!(
            tracker.session().requests(),
            vec![request(&[("a", Some(mark("05")))])]
        );
    }

    #[test]
    fn forwarded_changes_advance_session_and_log() {
        let mut tracker = tracker_at_05();
        tracker.apply(&backfill(&["a"], Some((Some(mark("05")), mark("06")))));
        let expected = vec![request(&[("a", Some(mark("06")))])];
        assert_eq!(tracker.session().requests(), expected);
        assert_eq!(tracker.log().requests(), expected);
    }
}
