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

use crate::scope_sync::cursor::{
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
mod tests;
