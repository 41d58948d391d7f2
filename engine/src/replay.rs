//! Catch-up replay on the server: which change-feed pages to read and send when a scope-sync
//! client subscribes or resumes, and how far each subscription has been delivered
//! (catch-up pages after a cursor, then live).
//!
//! [`ReplayPlanner`] is one subscription's replay, sans-IO: the host feeds it inputs and carries
//! out the [`ReplayEffect`]s it returns, in order. A pass reads the feed page by page from a
//! start cursor up to a high-water pinned on the first page (rows above it arrive live), sends
//! each non-empty page as `{echoOrigin: null, syncs}`, and stops on an empty or short page.
//!
//! Beyond the velocious behaviour it is modelled on, it designs out three hazards
//! (`docs/protocol/scope-sync.md`, "Hazards"): the delivered cursor only ever moves forwards,
//! also when a replay page lands below a live row sent earlier (P5); every page request names
//! all of its `after*`/`upTo*` bounds, so stale subscribe params cannot leak into later pages
//! (P6); and a start cursor older than the retention window gets an explicit reset answer
//! followed by a full-scope replay instead of silently missing deletions ("Resets and
//! retention").

use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::cursor::{
    compare_cursors, cursor_to_params, is_cursor_after, CursorParamsForm, CursorPrefix, SyncCursor,
};
use crate::scope_sync::{SubscribeError, SubscribeParams, SyncEntry, SyncEnvelope, MAX_PAGE_LIMIT};

/// Key of the reset marker in a replay envelope: `{"echoOrigin":null,"syncs":[],"reset":{…}}`.
///
/// Velocious peers ignore unknown envelope keys and apply the empty `syncs`, so the marker is
/// harmless to them; Highwater clients drop the scope's local rows and cursor on it.
pub const RESET_KEY: &str = "reset";

/// Why a reset is sent, as written in the reset marker.
const RESET_REASON: &str = "cursor-before-retention";

/// What started a replay pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ReplayKind {
    /// The `channel-subscribe` replay. When it finishes the host sends `channel-subscribed`.
    Subscribe,
    /// The replay after `session-resume` re-bound the session. Nothing is sent when it ends.
    Resume,
}

/// One request to the change feed: rows of the subscription's scope strictly after `after`
/// (the whole scope when `None`) and at or below `up_to`, ascending by `server_sequence`, at
/// most `limit` of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PageRequest {
    /// The pass this page belongs to; echo it in [`FetchedPage::pass`].
    pub pass: u64,
    pub after: Option<SyncCursor>,
    /// `None` on a pass's first page: the host resolves the high-water (the newest row in
    /// scope) and returns it in [`FetchedPage::up_to`]; later pages carry the pinned value.
    pub up_to: Option<SyncCursor>,
    pub limit: u32,
}

impl PageRequest {
    /// The request as change-feed params: `base` (the subscribe params) with every `after*` and
    /// `upTo*` key and `limit` replaced by this page's values, in the server serializer form.
    /// Absent bounds are removed rather than left over from `base`.
    pub fn feed_params(&self, base: &Map<String, Value>) -> Map<String, Value> {
        let mut params = base.clone();
        for prefix in [CursorPrefix::After, CursorPrefix::UpTo] {
            for name in prefix.param_names() {
                params.remove(name);
            }
        }
        params.remove("limit");
        params.extend(cursor_to_params(
            CursorPrefix::After,
            self.after.as_ref(),
            CursorParamsForm::Server,
        ));
        params.extend(cursor_to_params(
            CursorPrefix::UpTo,
            self.up_to.as_ref(),
            CursorParamsForm::Server,
        ));
        params.insert("limit".to_owned(), Value::from(self.limit));
        params
    }
}

/// The feed's answer to a [`PageRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchedPage {
    /// The [`PageRequest::pass`] this answers.
    pub pass: u64,
    /// The high-water the feed used: on the first page, the newest row in scope (`None` when
    /// the scope is empty). Ignored once pinned.
    pub up_to: Option<SyncCursor>,
    /// The rows, ascending, each with its cursor fields (`id`, `serverSequence`, `updatedAt`).
    pub rows: Vec<SyncEntry>,
}

/// Something the host must do, in the order given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type", rename_all = "camelCase")]
pub enum ReplayEffect {
    /// The start cursor is older than the retention window: send `envelope` (a reset marker, see
    /// [`RESET_KEY`]) as a `channel-message`. A full-scope pass follows.
    #[serde(rename_all = "camelCase")]
    Reset {
        pass: u64,
        stale_cursor: SyncCursor,
        retention_floor: SyncCursor,
        envelope: SyncEnvelope,
    },
    /// Read one page from the change feed and answer with [`ReplayInput::PageFetched`].
    FetchPage(PageRequest),
    /// Send `envelope` (`{echoOrigin: null, syncs}`) as a `channel-message`, through the same
    /// delivery path as live broadcasts (user scopes filter entries there). The delivered
    /// cursor has already been advanced past the page.
    #[serde(rename_all = "camelCase")]
    SendEnvelope { pass: u64, envelope: SyncEnvelope },
    /// The pass is over. For [`ReplayKind::Subscribe`] the host now sends `channel-subscribed`.
    #[serde(rename_all = "camelCase")]
    Finished {
        pass: u64,
        kind: ReplayKind,
        pages: u64,
        rows: u64,
    },
}

/// What the host tells the planner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayInput {
    /// Start a pass. `retention_floor` is the newest position whose tombstones may have been
    /// pruned (`None` when nothing was): a start cursor before it cannot be resumed safely.
    ///
    /// A `Subscribe` pass starts from the subscribe cursor and may start once. A `Resume` pass
    /// starts from the later of the delivered and the subscribe cursor, and supersedes a pass
    /// still in flight (keeping its kind, so an unfinished subscribe replay still ends with
    /// `channel-subscribed`); pages of the superseded pass are then ignored.
    Begin {
        kind: ReplayKind,
        retention_floor: Option<SyncCursor>,
    },
    /// The answer to a [`ReplayEffect::FetchPage`].
    PageFetched(FetchedPage),
    /// A live broadcast envelope was sent to this subscription (after any user-scope
    /// filtering): the delivered cursor moves to its highest entry cursor, if that is later.
    Delivered { envelope: SyncEnvelope },
}

/// Why the planner refused an input. Each is a host or feed bug, or invalid client params.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Params(#[from] SubscribeError),
    #[error(
        "expected the subscribe replay to start once per subscription, but it already started"
    )]
    AlreadySubscribed,
    #[error("expected a page for replay pass {expected}, got one for pass {got}")]
    UnexpectedPage { expected: String, got: u64 },
    #[error("expected at most {limit} rows in a replay page, got {got}")]
    PageTooLarge { limit: u32, got: usize },
    #[error("expected the first non-empty replay page to come with a high-water cursor, got none")]
    MissingHighWater,
    #[error("expected replay row {index} to carry an updatedAt cursor, got none")]
    RowWithoutCursor { index: usize },
    #[error("expected replay row {index} to be after {after}, got a row at {found}")]
    RowOutOfOrder {
        index: usize,
        after: String,
        found: String,
    },
    #[error(
        "expected replay row {index} at or below the high-water {up_to}, got a row at {found}"
    )]
    RowAboveHighWater {
        index: usize,
        up_to: String,
        found: String,
    },
}

/// How far a subscription has been sent: the highest entry cursor delivered, live or replayed.
///
/// Monotonic: deliveries can reach a subscription out of cursor order (`scope-sync.md`,
/// "Delivered cursor"), and a lower cursor never replaces a higher one. It is send-side
/// (`scope-sync.md`, hazard P1): a client that suspects lost frames re-subscribes from its own
/// persisted cursor.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeliveredCursor(Option<SyncCursor>);

impl DeliveredCursor {
    pub fn cursor(&self) -> Option<&SyncCursor> {
        self.0.as_ref()
    }

    /// Moves to `candidate` if it is after the current position; says whether it moved.
    pub fn advance(&mut self, candidate: Option<&SyncCursor>) -> bool {
        match candidate {
            Some(candidate) if is_cursor_after(Some(candidate), self.0.as_ref()) => {
                self.0 = Some(candidate.clone());
                true
            }
            _ => false,
        }
    }

    /// Moves to the highest entry cursor of a sent envelope, if that is later.
    pub fn advance_envelope(&mut self, envelope: &SyncEnvelope) -> bool {
        let advanced = envelope.advanced_cursor(self.0.as_ref());
        self.advance(advanced.as_ref())
    }
}

/// The pass in flight.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ReplayPass {
    id: u64,
    kind: ReplayKind,
    /// Where the next page starts.
    after: Option<SyncCursor>,
    /// The high-water, once pinned by the first page.
    up_to: Option<SyncCursor>,
    pinned: bool,
    pages: u64,
    rows: u64,
}

/// One subscription's catch-up replay and delivered-cursor tracking. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayPlanner {
    limit: u32,
    /// The `after*` cursor of the subscribe params; cleared by a reset.
    subscribe_cursor: Option<SyncCursor>,
    delivered: DeliveredCursor,
    pass: Option<ReplayPass>,
    passes_started: u64,
    subscribe_started: bool,
}

impl ReplayPlanner {
    /// A planner starting from `subscribe_cursor` (`None`: the whole scope) with `limit` rows per
    /// page, clamped to `1..=`[`MAX_PAGE_LIMIT`].
    pub fn new(subscribe_cursor: Option<SyncCursor>, limit: u32) -> Self {
        Self {
            limit: limit.clamp(1, MAX_PAGE_LIMIT),
            subscribe_cursor,
            delivered: DeliveredCursor::default(),
            pass: None,
            passes_started: 0,
            subscribe_started: false,
        }
    }

    /// A planner for decoded subscribe params: their `after*` cursor and page limit.
    pub fn for_subscription(params: &SubscribeParams) -> Self {
        Self::new(params.after.clone(), params.page_limit())
    }

    /// Decodes and validates raw `channel-subscribe` params. Invalid limits (`0`, `-1`, `1.5`,
    /// `"abc"`) and after-sequences (`"abc"`, `""`) fail the subscription.
    pub fn from_params(params: &Map<String, Value>) -> Result<Self, ReplayError> {
        Ok(Self::for_subscription(&SubscribeParams::from_params(
            params,
        )?))
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// The highest cursor delivered to this subscription so far.
    pub fn delivered_cursor(&self) -> Option<&SyncCursor> {
        self.delivered.cursor()
    }

    /// Whether a pass is in flight.
    pub fn is_replaying(&self) -> bool {
        self.pass.is_some()
    }

    /// Feeds one input; returns the effects to carry out, in order.
    pub fn handle(&mut self, input: ReplayInput) -> Result<Vec<ReplayEffect>, ReplayError> {
        match input {
            ReplayInput::Begin {
                kind,
                retention_floor,
            } => self.begin(kind, retention_floor),
            ReplayInput::PageFetched(page) => self.page_fetched(page),
            ReplayInput::Delivered { envelope } => {
                self.delivered.advance_envelope(&envelope);
                Ok(Vec::new())
            }
        }
    }

    fn begin(
        &mut self,
        kind: ReplayKind,
        retention_floor: Option<SyncCursor>,
    ) -> Result<Vec<ReplayEffect>, ReplayError> {
        let (kind, start) = match kind {
            ReplayKind::Subscribe => {
                if self.subscribe_started {
                    return Err(ReplayError::AlreadySubscribed);
                }
                (ReplayKind::Subscribe, self.subscribe_cursor.clone())
            }
            ReplayKind::Resume => {
                // An unfinished subscribe pass is superseded but must still end in
                // `channel-subscribed`.
                let kind = self
                    .pass
                    .as_ref()
                    .map_or(ReplayKind::Resume, |pass| pass.kind);
                let start =
                    if is_cursor_after(self.subscribe_cursor.as_ref(), self.delivered.cursor()) {
                        self.subscribe_cursor.clone()
                    } else {
                        self.delivered.cursor().cloned()
                    };
                (kind, start)
            }
        };
        self.subscribe_started = true;
        self.passes_started += 1;
        let id = self.passes_started;
        let mut effects = Vec::new();
        let start = match (start, retention_floor) {
            (Some(stale), Some(floor)) if is_cursor_after(Some(&floor), Some(&stale)) => {
                // Deletions between the two may be gone: the client must start over.
                self.subscribe_cursor = None;
                effects.push(ReplayEffect::Reset {
                    pass: id,
                    envelope: reset_envelope(&floor),
                    stale_cursor: stale,
                    retention_floor: floor,
                });
                None
            }
            (start, _) => start,
        };
        self.pass = Some(ReplayPass {
            id,
            kind,
            after: start.clone(),
            up_to: None,
            pinned: false,
            pages: 0,
            rows: 0,
        });
        effects.push(ReplayEffect::FetchPage(PageRequest {
            pass: id,
            after: start,
            up_to: None,
            limit: self.limit,
        }));
        Ok(effects)
    }

    fn page_fetched(&mut self, page: FetchedPage) -> Result<Vec<ReplayEffect>, ReplayError> {
        let limit = self.limit;
        let pass = match self.pass.as_mut() {
            Some(pass) if pass.id == page.pass => pass,
            // A superseded pass's page: its rows are covered by the pass that replaced it.
            _ if page.pass > 0 && page.pass < self.passes_started => return Ok(Vec::new()),
            other => {
                return Err(ReplayError::UnexpectedPage {
                    expected: other.map_or_else(|| "none".to_owned(), |pass| pass.id.to_string()),
                    got: page.pass,
                })
            }
        };
        if page.rows.len() > limit as usize {
            return Err(ReplayError::PageTooLarge {
                limit,
                got: page.rows.len(),
            });
        }
        if !pass.pinned {
            if page.up_to.is_none() && !page.rows.is_empty() {
                return Err(ReplayError::MissingHighWater);
            }
            pass.up_to = page.up_to;
            pass.pinned = true;
        }
        let last = validate_rows(&page.rows, pass.after.as_ref(), pass.up_to.as_ref())?;
        let mut effects = Vec::new();
        if let Some(last) = last {
            pass.pages += 1;
            pass.rows += page.rows.len() as u64;
            self.delivered.advance(Some(&last));
            pass.after = Some(last);
            effects.push(ReplayEffect::SendEnvelope {
                pass: pass.id,
                envelope: SyncEnvelope::new(None, page.rows.clone()),
            });
        }
        if page.rows.len() < limit as usize {
            effects.push(ReplayEffect::Finished {
                pass: pass.id,
                kind: pass.kind,
                pages: pass.pages,
                rows: pass.rows,
            });
            self.pass = None;
        } else {
            effects.push(ReplayEffect::FetchPage(PageRequest {
                pass: pass.id,
                after: pass.after.clone(),
                up_to: pass.up_to.clone(),
                limit,
            }));
        }
        Ok(effects)
    }
}

/// Checks a page is strictly ascending after `after` and within `up_to`; returns the last
/// row's cursor. Strict ascent also guarantees every full page makes progress.
fn validate_rows(
    rows: &[SyncEntry],
    after: Option<&SyncCursor>,
    up_to: Option<&SyncCursor>,
) -> Result<Option<SyncCursor>, ReplayError> {
    let mut previous = after.cloned();
    for (index, row) in rows.iter().enumerate() {
        let cursor = row
            .cursor()
            .ok_or(ReplayError::RowWithoutCursor { index })?;
        if !is_cursor_after(Some(&cursor), previous.as_ref()) {
            return Err(ReplayError::RowOutOfOrder {
                index,
                after: cursor_text(previous.as_ref()),
                found: cursor.to_json_text(),
            });
        }
        if compare_cursors(Some(&cursor), up_to).is_gt() {
            return Err(ReplayError::RowAboveHighWater {
                index,
                up_to: cursor_text(up_to),
                found: cursor.to_json_text(),
            });
        }
        previous = Some(cursor);
    }
    Ok(previous.filter(|_| !rows.is_empty()))
}

fn cursor_text(cursor: Option<&SyncCursor>) -> String {
    cursor.map_or_else(
        || "the start of the scope".to_owned(),
        SyncCursor::to_json_text,
    )
}

/// The reset marker envelope: no entries, and `reset: {reason, retentionFloor}`.
pub fn reset_envelope(retention_floor: &SyncCursor) -> SyncEnvelope {
    let mut envelope = SyncEnvelope::new(None, Vec::new());
    envelope.extra.insert(
        RESET_KEY.to_owned(),
        json!({ "reason": RESET_REASON, "retentionFloor": retention_floor }),
    );
    envelope
}

/// Whether an envelope carries a reset marker (any `reset` value but `null` and `false`).
pub fn is_reset(envelope: &SyncEnvelope) -> bool {
    !matches!(
        envelope.extra.get(RESET_KEY),
        None | Some(Value::Null) | Some(Value::Bool(false))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn updated_at(sequence: i64) -> String {
        format!(
            "2026-07-01T10:{:02}:{:02}.000Z",
            sequence / 60,
            sequence % 60
        )
    }

    fn cursor(sequence: i64) -> SyncCursor {
        SyncCursor::new(
            Some(sequence.to_string()),
            Some(sequence),
            updated_at(sequence),
        )
    }

    fn row(sequence: i64) -> SyncEntry {
        let value = json!({
            "data": {"id": format!("t{sequence}")},
            "id": sequence.to_string(),
            "resourceId": format!("t{sequence}"),
            "resourceType": "Task",
            "serverSequence": sequence,
            "syncType": "update",
            "updatedAt": updated_at(sequence),
        });
        SyncEntry::try_from(value).expect("a valid entry")
    }

    fn envelope(sequences: &[i64]) -> SyncEnvelope {
        SyncEnvelope::new(None, sequences.iter().map(|&s| row(s)).collect())
    }

    /// A change feed over an in-memory replica: rows by ascending sequence.
    #[derive(Default)]
    struct Feed {
        rows: Vec<i64>,
        fetches: usize,
    }

    impl Feed {
        fn with(rows: impl IntoIterator<Item = i64>) -> Self {
            Self {
                rows: rows.into_iter().collect(),
                fetches: 0,
            }
        }

        fn fetch(&mut self, request: &PageRequest) -> FetchedPage {
            self.fetches += 1;
            let up_to = request
                .up_to
                .clone()
                .or_else(|| self.rows.iter().max().map(|&s| cursor(s)));
            let high = up_to.as_ref().and_then(|c| c.server_sequence).unwrap_or(0);
            let low = request
                .after
                .as_ref()
                .and_then(|c| c.server_sequence)
                .unwrap_or(i64::MIN);
            let mut selected: Vec<i64> = self
                .rows
                .iter()
                .copied()
                .filter(|&s| s > low && s <= high)
                .collect();
            selected.sort_unstable();
            selected.truncate(request.limit as usize);
            FetchedPage {
                pass: request.pass,
                up_to,
                rows: selected.into_iter().map(row).collect(),
            }
        }
    }

    /// Runs a pass to its end, answering every fetch from `feed`; returns all effects.
    fn run(planner: &mut ReplayPlanner, feed: &mut Feed, begin: ReplayInput) -> Vec<ReplayEffect> {
        let mut all = Vec::new();
        let mut pending = planner.handle(begin).expect("begin");
        while let Some(effect) = pending.first().cloned() {
            pending.remove(0);
            if let ReplayEffect::FetchPage(request) = &effect {
                let page = feed.fetch(request);
                pending.extend(
                    planner
                        .handle(ReplayInput::PageFetched(page))
                        .expect("page"),
                );
            }
            all.push(effect);
        }
        all
    }

    fn begin(kind: ReplayKind) -> ReplayInput {
        ReplayInput::Begin {
            kind,
            retention_floor: None,
        }
    }

    /// The sequences of each sent page.
    fn sent_pages(effects: &[ReplayEffect]) -> Vec<Vec<i64>> {
        effects
            .iter()
            .filter_map(|effect| match effect {
                ReplayEffect::SendEnvelope { envelope, .. } => Some(
                    envelope
                        .syncs
                        .iter()
                        .map(|entry| entry.server_sequence.expect("a sequence"))
                        .collect(),
                ),
                _ => None,
            })
            .collect()
    }

    fn params(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("expected an object, got {other}"),
        }
    }

    #[test]
    fn scenario_09_fresh_subscription_replays_whole_scope_in_order_before_finishing() {
        let mut planner =
            ReplayPlanner::from_params(&params(json!({"conditions": {}, "resourceType": "Task"})))
                .expect("valid params");
        let mut feed = Feed::with([3, 1, 2]);
        let effects = run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
        assert_eq!(sent_pages(&effects), vec![vec![1, 2, 3]]);
        assert!(matches!(
            effects.first(),
            Some(ReplayEffect::FetchPage(PageRequest {
                after: None,
                up_to: None,
                limit: 1000,
                ..
            }))
        ));
        // The page is sent before the pass finishes (and so before `channel-subscribed`).
        assert!(matches!(
            effects.last(),
            Some(ReplayEffect::Finished {
                kind: ReplayKind::Subscribe,
                pages: 1,
                rows: 3,
                ..
            })
        ));
        for effect in &effects {
            if let ReplayEffect::SendEnvelope { envelope, .. } = effect {
                assert_eq!(envelope.to_value()["echoOrigin"], Value::Null);
            }
        }
        assert_eq!(planner.delivered_cursor(), Some(&cursor(3)));
        assert!(!planner.is_replaying());
    }

    #[test]
    fn scenario_10_resume_from_cursor_does_not_resend_the_row_at_the_cursor() {
        let mut planner = ReplayPlanner::from_params(&params(json!({
            "conditions": {}, "resourceType": "Task",
            "afterId": "2", "afterServerSequence": 2, "afterUpdatedAt": updated_at(2),
        })))
        .expect("valid params");
        let mut feed = Feed::with(1..=5);
        let effects = run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
        assert_eq!(sent_pages(&effects), vec![vec![3, 4, 5]]);
    }

    #[test]
    fn scenario_11_five_rows_with_limit_two_arrive_as_two_two_one_and_stop_on_the_short_page() {
        let mut planner = ReplayPlanner::new(None, 2);
        let mut feed = Feed::with(1..=5);
        let effects = run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
        assert_eq!(sent_pages(&effects), vec![vec![1, 2], vec![3, 4], vec![5]]);
        assert_eq!(feed.fetches, 3);
    }

    #[test]
    fn scenario_11_four_rows_with_limit_two_end_on_an_empty_page() {
        let mut planner = ReplayPlanner::new(None, 2);
        let mut feed = Feed::with(1..=4);
        let effects = run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
        assert_eq!(sent_pages(&effects), vec![vec![1, 2], vec![3, 4]]);
        assert_eq!(
            feed.fetches, 3,
            "the third fetch returns the empty page that ends it"
        );
        assert!(matches!(
            effects.last(),
            Some(ReplayEffect::Finished {
                pages: 2,
                rows: 4,
                ..
            })
        ));
    }

    #[test]
    fn scenario_12_pinned_high_water_leaves_rows_inserted_during_replay_to_live_delivery() {
        let mut planner = ReplayPlanner::new(None, 2);
        let mut feed = Feed::with(1..=4);
        let first = planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
        let ReplayEffect::FetchPage(request) = &first[0] else {
            panic!("expected a fetch, got {first:?}");
        };
        let page = feed.fetch(request);
        let mut effects = planner
            .handle(ReplayInput::PageFetched(page))
            .expect("page");
        // A row commits mid-replay; it is live-delivered to the registered subscription.
        feed.rows.push(5);
        planner
            .handle(ReplayInput::Delivered {
                envelope: envelope(&[5]),
            })
            .expect("delivered");
        let mut sent = sent_pages(&effects);
        while let Some(ReplayEffect::FetchPage(request)) = effects.last().cloned() {
            assert_eq!(
                request.up_to,
                Some(cursor(4)),
                "later pages carry the pinned high-water"
            );
            effects = planner
                .handle(ReplayInput::PageFetched(feed.fetch(&request)))
                .expect("page");
            sent.extend(sent_pages(&effects));
        }
        assert_eq!(sent, vec![vec![1, 2], vec![3, 4]]);
        assert!(matches!(
            effects.last(),
            Some(ReplayEffect::Finished { .. })
        ));
        assert_eq!(planner.delivered_cursor(), Some(&cursor(5)));
    }

    #[test]
    fn scenario_13_invalid_limits_and_after_sequences_fail_the_subscription() {
        for limit in [json!(0), json!(-1), json!(1.5), json!("abc")] {
            let result = ReplayPlanner::from_params(&params(
                json!({"conditions": {}, "resourceType": "Task", "limit": limit}),
            ));
            assert!(
                matches!(
                    result,
                    Err(ReplayError::Params(SubscribeError::BadLimit { .. }))
                ),
                "limit {limit} gave {result:?}"
            );
        }
        for sequence in [json!("abc"), json!("")] {
            let result = ReplayPlanner::from_params(&params(json!({
                "conditions": {}, "resourceType": "Task",
                "afterServerSequence": sequence, "afterUpdatedAt": updated_at(1),
            })));
            assert!(
                matches!(
                    result,
                    Err(ReplayError::Params(SubscribeError::BadAfterSequence { .. }))
                ),
                "afterServerSequence {sequence} gave {result:?}"
            );
        }
        let clamped = ReplayPlanner::from_params(&params(
            json!({"conditions": {}, "resourceType": "Task", "limit": 5000}),
        ))
        .expect("a large limit is clamped");
        assert_eq!(clamped.limit(), MAX_PAGE_LIMIT);
        let default = ReplayPlanner::from_params(&params(json!({"conditions": {}})))
            .expect("no limit is the default");
        assert_eq!(default.limit(), 1000);
        // Without afterUpdatedAt the replay covers the whole scope.
        let mut whole = ReplayPlanner::from_params(&params(
            json!({"conditions": {}, "afterServerSequence": 3}),
        ))
        .expect("a lone sequence is valid");
        let effects = run(
            &mut whole,
            &mut Feed::with(1..=4),
            begin(ReplayKind::Subscribe),
        );
        assert_eq!(sent_pages(&effects), vec![vec![1, 2, 3, 4]]);
    }

    #[test]
    fn scenario_14_resume_replays_only_rows_after_the_delivered_cursor() {
        let mut planner = ReplayPlanner::new(None, 1000);
        let mut feed = Feed::with(1..=3);
        run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
        // Live rows 4 and 5 are sent; 6 and 7 are written while the socket is down and their
        // frames are lost.
        feed.rows.extend([4, 5, 6, 7]);
        for sequence in [4, 5] {
            planner
                .handle(ReplayInput::Delivered {
                    envelope: envelope(&[sequence]),
                })
                .expect("delivered");
        }
        feed.fetches = 0;
        let effects = run(&mut planner, &mut feed, begin(ReplayKind::Resume));
        assert!(matches!(
            effects.first(),
            Some(ReplayEffect::FetchPage(PageRequest { after: Some(after), .. })) if *after == cursor(5)
        ));
        assert_eq!(sent_pages(&effects), vec![vec![6, 7]]);
        assert_eq!(feed.fetches, 1, "no full re-read");
        assert!(matches!(
            effects.last(),
            Some(ReplayEffect::Finished {
                kind: ReplayKind::Resume,
                ..
            })
        ));
    }

    #[test]
    fn scenario_14_resume_before_any_delivery_starts_from_the_subscribe_cursor() {
        let mut planner = ReplayPlanner::new(Some(cursor(2)), 1000);
        let mut feed = Feed::with(1..=3);
        // The subscribe pass is lost with the socket before its page came back.
        planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
        let effects = run(&mut planner, &mut feed, begin(ReplayKind::Resume));
        assert_eq!(sent_pages(&effects), vec![vec![3]]);
        // It supersedes an unfinished subscribe pass, so it still ends in channel-subscribed.
        assert!(matches!(
            effects.last(),
            Some(ReplayEffect::Finished {
                kind: ReplayKind::Subscribe,
                ..
            })
        ));
    }

    #[test]
    fn scenario_23_out_of_order_fan_out_leaves_the_delivered_cursor_at_the_higher_sequence() {
        let mut planner = ReplayPlanner::new(None, 1000);
        let mut feed = Feed::with([]);
        run(&mut planner, &mut feed, begin(ReplayKind::Subscribe));
        feed.rows.extend([6, 7]);
        for sequence in [7, 6] {
            planner
                .handle(ReplayInput::Delivered {
                    envelope: envelope(&[sequence]),
                })
                .expect("delivered");
        }
        assert_eq!(planner.delivered_cursor(), Some(&cursor(7)));
        let effects = run(&mut planner, &mut feed, begin(ReplayKind::Resume));
        assert!(
            sent_pages(&effects).is_empty(),
            "6 is not re-sent: {effects:?}"
        );
    }

    #[test]
    fn a_replay_page_below_a_live_row_never_moves_the_delivered_cursor_back() {
        // Hazard P5 (scope-sync.md): velocious assigns the replay's page cursor to the
        // delivered cursor outright.
        let mut planner = ReplayPlanner::new(None, 2);
        let mut feed = Feed::with(1..=4);
        let first = planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
        let ReplayEffect::FetchPage(request) = &first[0] else {
            panic!("expected a fetch");
        };
        feed.rows.push(10);
        let page = feed.fetch(request);
        planner
            .handle(ReplayInput::Delivered {
                envelope: envelope(&[10]),
            })
            .expect("delivered");
        planner
            .handle(ReplayInput::PageFetched(page))
            .expect("page");
        assert_eq!(planner.delivered_cursor(), Some(&cursor(10)));
    }

    #[test]
    fn a_cursor_below_the_retention_floor_gets_a_reset_then_a_full_replay() {
        let mut planner = ReplayPlanner::new(Some(cursor(2)), 1000);
        let mut feed = Feed::with([6, 7]);
        let effects = run(
            &mut planner,
            &mut feed,
            ReplayInput::Begin {
                kind: ReplayKind::Subscribe,
                retention_floor: Some(cursor(5)),
            },
        );
        let ReplayEffect::Reset {
            stale_cursor,
            retention_floor,
            envelope,
            ..
        } = &effects[0]
        else {
            panic!("expected a reset first, got {effects:?}");
        };
        assert_eq!((stale_cursor, retention_floor), (&cursor(2), &cursor(5)));
        assert!(is_reset(envelope));
        let body = envelope.to_value();
        assert_eq!(body["echoOrigin"], Value::Null);
        assert_eq!(body["syncs"], json!([]));
        assert_eq!(
            body[RESET_KEY]["retentionFloor"]["serverSequence"],
            json!(5)
        );
        assert!(matches!(
            &effects[1],
            ReplayEffect::FetchPage(PageRequest { after: None, .. })
        ));
        assert_eq!(sent_pages(&effects), vec![vec![6, 7]]);
    }

    #[test]
    fn a_cursor_at_or_above_the_retention_floor_resumes_without_reset() {
        for (start, floor) in [
            (Some(5), Some(5)),
            (Some(6), Some(5)),
            (None, Some(5)),
            (Some(1), None),
        ] {
            let mut planner = ReplayPlanner::new(start.map(cursor), 1000);
            let effects = planner
                .handle(ReplayInput::Begin {
                    kind: ReplayKind::Subscribe,
                    retention_floor: floor.map(cursor),
                })
                .expect("begin");
            assert!(
                matches!(effects.as_slice(), [ReplayEffect::FetchPage(_)]),
                "start {start:?} floor {floor:?} gave {effects:?}"
            );
        }
    }

    #[test]
    fn a_resume_from_a_delivered_cursor_below_the_floor_is_reset_too() {
        let mut planner = ReplayPlanner::new(None, 1000);
        run(
            &mut planner,
            &mut Feed::with([1, 2]),
            begin(ReplayKind::Subscribe),
        );
        let effects = planner
            .handle(ReplayInput::Begin {
                kind: ReplayKind::Resume,
                retention_floor: Some(cursor(4)),
            })
            .expect("begin");
        assert!(matches!(
            effects.as_slice(),
            [
                ReplayEffect::Reset { .. },
                ReplayEffect::FetchPage(PageRequest { after: None, .. })
            ]
        ));
    }

    #[test]
    fn envelopes_without_a_reset_marker_are_not_resets() {
        assert!(!is_reset(&envelope(&[1])));
        let mut explicit_false = envelope(&[]);
        explicit_false
            .extra
            .insert(RESET_KEY.to_owned(), Value::Bool(false));
        assert!(!is_reset(&explicit_false));
        let decoded = SyncEnvelope::from_value(&reset_envelope(&cursor(3)).to_value())
            .expect("a reset envelope decodes");
        assert!(is_reset(&decoded));
    }

    #[test]
    fn feed_params_name_every_bound_so_stale_subscribe_params_cannot_leak() {
        // Hazard P6 (scope-sync.md): a page cursor without a sequence must not inherit the
        // subscribe-time sequence.
        let base = params(json!({
            "conditions": {"projectId": "p1"},
            "afterId": "9", "afterServerSequence": 9, "afterUpdatedAt": updated_at(9),
            "upToId": "x", "limit": 7,
        }));
        let request = PageRequest {
            pass: 1,
            after: Some(SyncCursor::legacy(updated_at(3))),
            up_to: Some(cursor(20)),
            limit: 2,
        };
        let feed = request.feed_params(&base);
        assert_eq!(
            Value::Object(feed),
            json!({
                "conditions": {"projectId": "p1"},
                "afterId": null, "afterUpdatedAt": updated_at(3),
                "upToId": "20", "upToServerSequence": 20, "upToUpdatedAt": updated_at(20),
                "limit": 2,
            })
        );
        let first = PageRequest {
            pass: 1,
            after: Some(SyncCursor::new(None, Some(0), updated_at(0))),
            up_to: None,
            limit: 5,
        };
        let feed = first.feed_params(&base);
        assert_eq!(
            feed.get("afterServerSequence"),
            Some(&json!(0)),
            "server form keeps 0"
        );
        assert!(!feed.contains_key("upToId"));
    }

    #[test]
    fn effects_serialize_with_a_type_tag_for_hosts_and_bindings() {
        let mut planner = ReplayPlanner::new(Some(cursor(2)), 10);
        let effects = planner
            .handle(ReplayInput::Begin {
                kind: ReplayKind::Subscribe,
                retention_floor: Some(cursor(4)),
            })
            .expect("begin");
        let values: Vec<Value> = effects
            .iter()
            .map(|effect| serde_json::to_value(effect).expect("serializable"))
            .collect();
        assert_eq!(values[0]["type"], json!("reset"));
        assert_eq!(values[0]["staleCursor"]["serverSequence"], json!(2));
        assert_eq!(
            values[0]["envelope"]["reset"]["reason"],
            json!("cursor-before-retention")
        );
        assert_eq!(
            values[1],
            json!({"type": "fetchPage", "pass": 1, "after": null, "upTo": null, "limit": 10})
        );
    }

    #[test]
    fn an_empty_scope_finishes_without_sending() {
        let mut planner = ReplayPlanner::new(None, 1000);
        let effects = run(
            &mut planner,
            &mut Feed::with([]),
            begin(ReplayKind::Subscribe),
        );
        assert!(matches!(
            effects.as_slice(),
            [
                ReplayEffect::FetchPage(_),
                ReplayEffect::Finished {
                    pages: 0,
                    rows: 0,
                    ..
                }
            ]
        ));
    }

    #[test]
    fn the_subscribe_pass_starts_only_once() {
        let mut planner = ReplayPlanner::new(None, 1000);
        planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
        assert_eq!(
            planner.handle(begin(ReplayKind::Subscribe)),
            Err(ReplayError::AlreadySubscribed)
        );
    }

    #[test]
    fn malformed_pages_are_refused_with_what_was_expected() {
        let page = |pass, up_to: Option<i64>, rows: &[i64]| {
            ReplayInput::PageFetched(FetchedPage {
                pass,
                up_to: up_to.map(cursor),
                rows: rows.iter().map(|&s| row(s)).collect(),
            })
        };
        let started = || {
            let mut planner = ReplayPlanner::new(Some(cursor(2)), 2);
            planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
            planner
        };
        assert_eq!(
            started().handle(page(1, Some(9), &[3, 4, 5])),
            Err(ReplayError::PageTooLarge { limit: 2, got: 3 })
        );
        assert_eq!(
            started().handle(page(1, None, &[3])),
            Err(ReplayError::MissingHighWater)
        );
        assert!(matches!(
            started().handle(page(1, Some(9), &[2, 3])),
            Err(ReplayError::RowOutOfOrder { index: 0, .. })
        ));
        assert!(matches!(
            started().handle(page(1, Some(9), &[4, 3])),
            Err(ReplayError::RowOutOfOrder { index: 1, .. })
        ));
        assert!(matches!(
            started().handle(page(1, Some(3), &[3, 4])),
            Err(ReplayError::RowAboveHighWater { index: 1, .. })
        ));
        let mut planner = started();
        let mut bare = row(3);
        bare.updated_at = None;
        assert_eq!(
            planner.handle(ReplayInput::PageFetched(FetchedPage {
                pass: 1,
                up_to: Some(cursor(9)),
                rows: vec![bare],
            })),
            Err(ReplayError::RowWithoutCursor { index: 0 })
        );
        let error = started()
            .handle(page(7, Some(9), &[3]))
            .expect_err("unknown pass");
        assert_eq!(
            error.to_string(),
            "expected a page for replay pass 1, got one for pass 7"
        );
    }

    #[test]
    fn pages_of_a_superseded_pass_are_ignored() {
        let mut planner = ReplayPlanner::new(None, 2);
        planner.handle(begin(ReplayKind::Subscribe)).expect("begin");
        planner.handle(begin(ReplayKind::Resume)).expect("resume");
        let late = FetchedPage {
            pass: 1,
            up_to: Some(cursor(2)),
            rows: vec![row(1), row(2)],
        };
        assert_eq!(
            planner.handle(ReplayInput::PageFetched(late)),
            Ok(Vec::new())
        );
        assert_eq!(planner.delivered_cursor(), None);
    }

    /// Renders effects one per line, for transcripts.
    fn render(effect: &ReplayEffect) -> String {
        let at = |c: &Option<SyncCursor>| {
            c.as_ref()
                .and_then(|c| c.server_sequence)
                .map_or_else(|| "-".to_owned(), |s| s.to_string())
        };
        match effect {
            ReplayEffect::Reset {
                pass,
                stale_cursor,
                retention_floor,
                ..
            } => format!(
                "reset pass {pass}: cursor {} is below floor {}",
                at(&Some(stale_cursor.clone())),
                at(&Some(retention_floor.clone()))
            ),
            ReplayEffect::FetchPage(request) => format!(
                "fetch pass {} after {} upTo {} limit {}",
                request.pass,
                at(&request.after),
                at(&request.up_to),
                request.limit
            ),
            ReplayEffect::SendEnvelope { pass, envelope } => format!(
                "send pass {pass} {:?}",
                envelope
                    .syncs
                    .iter()
                    .filter_map(|e| e.server_sequence)
                    .collect::<Vec<_>>()
            ),
            ReplayEffect::Finished {
                pass,
                kind,
                pages,
                rows,
            } => {
                format!("finished pass {pass} {kind:?}: {pages} pages, {rows} rows")
            }
        }
    }

    #[test]
    fn golden_transcript_of_subscribe_live_fan_out_and_resume() {
        let mut planner = ReplayPlanner::new(Some(cursor(1)), 2);
        let mut feed = Feed::with(1..=6);
        let mut transcript = Vec::new();
        fn step(
            transcript: &mut Vec<String>,
            planner: &mut ReplayPlanner,
            feed: &mut Feed,
            label: &str,
            input: ReplayInput,
        ) {
            transcript.push(format!("> {label}"));
            for effect in run(planner, feed, input) {
                transcript.push(format!("  {}", render(&effect)));
            }
        }
        step(
            &mut transcript,
            &mut planner,
            &mut feed,
            "begin subscribe",
            begin(ReplayKind::Subscribe),
        );
        feed.rows.extend([7, 8]);
        planner
            .handle(ReplayInput::Delivered {
                envelope: envelope(&[8]),
            })
            .expect("delivered");
        planner
            .handle(ReplayInput::Delivered {
                envelope: envelope(&[7]),
            })
            .expect("delivered");
        transcript.push("> delivered live [8] then [7]".to_owned());
        feed.rows.extend([9]);
        step(
            &mut transcript,
            &mut planner,
            &mut feed,
            "begin resume",
            begin(ReplayKind::Resume),
        );
        step(
            &mut transcript,
            &mut planner,
            &mut feed,
            "begin resume (floor 12)",
            ReplayInput::Begin {
                kind: ReplayKind::Resume,
                retention_floor: Some(cursor(12)),
            },
        );
        let expected = "\
> begin subscribe
  fetch pass 1 after 1 upTo - limit 2
  send pass 1 [2, 3]
  fetch pass 1 after 3 upTo 6 limit 2
  send pass 1 [4, 5]
  fetch pass 1 after 5 upTo 6 limit 2
  send pass 1 [6]
  finished pass 1 Subscribe: 3 pages, 5 rows
> delivered live [8] then [7]
> begin resume
  fetch pass 2 after 8 upTo - limit 2
  send pass 2 [9]
  finished pass 2 Resume: 1 pages, 1 rows
> begin resume (floor 12)
  reset pass 3: cursor 9 is below floor 12
  fetch pass 3 after - upTo - limit 2
  send pass 3 [1, 2]
  fetch pass 3 after 2 upTo 9 limit 2
  send pass 3 [3, 4]
  fetch pass 3 after 4 upTo 9 limit 2
  send pass 3 [5, 6]
  fetch pass 3 after 6 upTo 9 limit 2
  send pass 3 [7, 8]
  fetch pass 3 after 8 upTo 9 limit 2
  send pass 3 [9]
  finished pass 3 Resume: 5 pages, 9 rows";
        assert_eq!(transcript.join("\n"), expected);
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// Rows commit; their live broadcasts are pending until delivered.
        Write {
            count: u8,
        },
        /// Broadcasts of already-written rows land, in the given (possibly reversed) order.
        Deliver {
            reversed: bool,
        },
        Resume,
    }

    fn step_strategy() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u8..4).prop_map(|count| Step::Write { count }),
            any::<bool>().prop_map(|reversed| Step::Deliver { reversed }),
            Just(Step::Resume),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Every pass terminates within ⌈rows/limit⌉ + 1 fetches and sends exactly the rows
        /// after its start up to its high-water, ascending; the delivered cursor never moves
        /// back; and after a resume the client holds every row written.
        #[test]
        fn replay_passes_are_complete_bounded_and_monotonic(
            initial in 0i64..12,
            start in proptest::option::of(0i64..12),
            limit in 1u32..5,
            steps in proptest::collection::vec(step_strategy(), 0..12),
        ) {
            // A client cursor names a row the replica has (or had).
            let start = start.map(|s| s.min(initial));
            let mut feed = Feed::with(1..=initial);
            let mut planner = ReplayPlanner::new(start.map(cursor), limit);
            let mut client: std::collections::BTreeSet<i64> =
                (1..=start.unwrap_or(0)).collect();
            let mut pending_live: Vec<i64> = Vec::new();
            let mut last_delivered: Option<SyncCursor> = None;
            let check_pass = |planner: &mut ReplayPlanner, feed: &mut Feed, kind, client: &mut std::collections::BTreeSet<i64>| {
                let before = planner.delivered_cursor().cloned();
                let from = match kind {
                    ReplayKind::Subscribe => start.unwrap_or(0),
                    ReplayKind::Resume => before.as_ref().and_then(|c| c.server_sequence)
                        .unwrap_or(0).max(start.unwrap_or(0)),
                };
                let high = feed.rows.iter().copied().max().unwrap_or(0);
                let expected: Vec<i64> = (from + 1..=high).filter(|s| feed.rows.contains(s)).collect();
                feed.fetches = 0;
                let effects = run(planner, feed, begin(kind));
                let sent: Vec<i64> = sent_pages(&effects).concat();
                prop_assert_eq!(&sent, &expected);
                prop_assert!(feed.fetches <= expected.len() / limit as usize + 1);
                prop_assert!(!is_cursor_after(before.as_ref(), planner.delivered_cursor()));
                client.extend(sent);
                Ok(())
            };
            check_pass(&mut planner, &mut feed, ReplayKind::Subscribe, &mut client)?;
            for step in steps {
                match step {
                    Step::Write { count } => {
                        let next = feed.rows.iter().copied().max().unwrap_or(0) + 1;
                        for sequence in next..next + i64::from(count) {
                            feed.rows.push(sequence);
                            pending_live.push(sequence);
                        }
                    }
                    Step::Deliver { reversed } => {
                        if reversed {
                            pending_live.reverse();
                        }
                        for sequence in pending_live.drain(..) {
                            planner.handle(ReplayInput::Delivered { envelope: envelope(&[sequence]) })
                                .expect("delivered");
                            client.insert(sequence);
                        }
                    }
                    Step::Resume => {
                        // Broadcasts still in fan-out are never sent: the resume replay covers them.
                        pending_live.clear();
                        check_pass(&mut planner, &mut feed, ReplayKind::Resume, &mut client)?;
                        let all: std::collections::BTreeSet<i64> = feed.rows.iter().copied().collect();
                        prop_assert_eq!(&client, &all, "a resume leaves no gap");
                    }
                }
                prop_assert!(!is_cursor_after(last_delivered.as_ref(), planner.delivered_cursor()));
                last_delivered = planner.delivered_cursor().cloned();
            }
        }
    }
}
