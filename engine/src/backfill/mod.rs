//! Backfill tracking, as Zero's change-streamer protocol defines backfills.
//!
//! When a table or column appears whose existing rows the replication stream cannot carry, the
//! change source streams them as `backfill` messages and ends with `backfill-completed`. Backfill
//! state lives in the change source's session, so whoever restarts a stream must re-request every
//! pending backfill — from the right place. This module tracks, for each party (a v8 subscriber,
//! the change log, the current stream session), which columns are pending and how far each got:
//!
//! * [`progress`]: the continuity policy for v8 progress marks and the request arithmetic on it;
//! * [`cookie_ops`]: what each schema change means for pending backfills (the cookie jar);
//! * [`BackfillState`]: one party's pending columns, folded transactionally over the stream;
//! * [`BackfillStateTracker`]: the change streamer's view — which requests start a stream, and
//!   when a newly aligned subscriber forces a restart.
//!
//! [`BackfillMerge`] is the replica's side: what a backfilled row does to the row it meets.
//! [`BackfillPlanner`] serves a change source that reads backfills from upstream itself: which
//! one runs next, with which columns, and when a failed one is tried again.

mod cookie;
mod merge;
mod planner;
pub mod progress;
mod state;
mod tracker;

pub use cookie::{
    cookie_jar_requests, cookie_ops, BackfillCookie, CookieOp, MetadataCookie, TableRef,
};
pub use merge::{BackfillMerge, BackfilledValue, RowMerge, RowVersion};
pub use planner::{
    BackfillPlan, BackfillPlanner, PendingBackfill, BACKFILL_RETRY, BACKFILL_RETRY_FLOOR_MS,
};
pub use progress::{
    accept_backfill, covers, resume_point, superset, table_superset, with_resume_point, Marks,
    Verdict,
};
pub use state::{affects_backfills, BackfillState};
pub use tracker::{BackfillStateTracker, IgnoredColumns, Registration};

use crate::change_stream::DecodeError;

/// Why backfill requests or a stored change could not be tracked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackfillError {
    #[error("expected at most one backfill request per table, got several for {schema}.{name}")]
    DuplicateTable { schema: String, name: String },
    #[error("expected a stored change-stream message with tag {tag:?}: {source}")]
    Decode {
        tag: String,
        #[source]
        source: DecodeError,
    },
}
