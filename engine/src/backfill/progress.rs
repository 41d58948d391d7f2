//! The continuity policy for v8 backfill progress marks, and the request arithmetic built on it
//! (Zero's backfill progress marks).
//!
//! A column's tracked progress is `None` while it has received no backfill data (it needs a run
//! from scratch). Marks compare only on the same timeline; `progressMark` strings compare the way
//! JavaScript compares strings (UTF-16 code units), so Highwater and Zero agree on every order.

use std::cmp::Ordering;

use indexmap::IndexMap;

use crate::change_stream::{BackfillColumn, BackfillRequest, ProgressMark, ProgressMarks};

/// The `previous` / `current` marks of one backfill message, borrowed.
///
/// `backfill` messages carry both (`previous` absent for a run from scratch); `backfill-completed`
/// carries only `previous`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Marks<'a> {
    pub previous: Option<&'a ProgressMark>,
    pub current: Option<&'a ProgressMark>,
}

impl<'a> Marks<'a> {
    /// The marks of a `backfill-completed` message: only `previous` counts.
    pub fn completion(marks: &'a ProgressMarks) -> Self {
        Marks {
            previous: marks.previous.as_ref(),
            current: None,
        }
    }
}

impl<'a> From<&'a ProgressMarks> for Marks<'a> {
    fn from(marks: &'a ProgressMarks) -> Self {
        Marks {
            previous: marks.previous.as_ref(),
            current: marks.current.as_ref(),
        }
    }
}

/// What the continuity policy decided for one column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Apply the message; the column's progress becomes the given mark (`None` = from scratch).
    Accept(Option<ProgressMark>),
    /// Ignore the message for this column: applying it would leave a gap.
    Ignore,
}

impl Verdict {
    pub fn is_accept(&self) -> bool {
        matches!(self, Verdict::Accept(_))
    }
}

/// Whether two marks are on the same timeline, and thus comparable.
fn same_timeline(a: &ProgressMark, b: &ProgressMark) -> bool {
    a.timeline == b.timeline
}

/// Orders two marks' positions as JavaScript orders strings (UTF-16 code units).
fn position_cmp(a: &ProgressMark, b: &ProgressMark) -> Ordering {
    a.progress_mark
        .encode_utf16()
        .cmp(b.progress_mark.encode_utf16())
}

/// The earlier of two marks on the same timeline; `a` on a tie.
fn earlier<'a>(a: &'a ProgressMark, b: &'a ProgressMark) -> &'a ProgressMark {
    if position_cmp(b, a) == Ordering::Less {
        b
    } else {
        a
    }
}

/// The later of two marks on the same timeline; `a` on a tie.
fn later<'a>(a: &'a ProgressMark, b: &'a ProgressMark) -> &'a ProgressMark {
    if position_cmp(b, a) == Ordering::Greater {
        b
    } else {
        a
    }
}

/// Applies the continuity policy of a `backfill` / `backfill-completed` message with `marks` to a
/// column whose tracked progress is `own`.
///
/// * No marks (a pre-v8 message): accepted, progress unchanged.
/// * No `previous`: a run from scratch (or on a new timeline), which cannot leave a gap:
///   accepted, progress becomes `current`.
/// * Otherwise accepted only if `own` is on `previous`'s timeline and `previous` is at or before
///   `own`. Progress then stays `own` without `current`, becomes the later of `own` and `current`
///   on the same timeline, and `current` on another.
pub fn accept_backfill(own: Option<&ProgressMark>, marks: Option<Marks<'_>>) -> Verdict {
    let Some(Marks { previous, current }) = marks else {
        return Verdict::Accept(own.cloned());
    };
    let Some(previous) = previous else {
        return Verdict::Accept(current.cloned());
    };
    let Some(own) = own else {
        return Verdict::Ignore;
    };
    if !same_timeline(own, previous) || position_cmp(previous, own) == Ordering::Greater {
        return Verdict::Ignore;
    }
    let progress = match current {
        None => own,
        Some(current) if same_timeline(own, current) => later(own, current),
        Some(current) => current,
    };
    Verdict::Accept(Some(progress.clone()))
}

/// Whether a stream at progress `stream` delivers everything a subscriber at `subscriber` still
/// needs for the same column. A stream from scratch (`None`) covers every subscriber.
pub fn covers(stream: Option<&ProgressMark>, subscriber: Option<&ProgressMark>) -> bool {
    match (stream, subscriber) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(s), Some(p)) => same_timeline(s, p) && position_cmp(s, p) != Ordering::Greater,
    }
}

/// The position a backfill of `request` must start from to satisfy every column: the earliest
/// mark, or `None` (from scratch) if a column has no progress, the timelines differ, or the
/// request has no columns.
pub fn resume_point(request: &BackfillRequest) -> Option<&ProgressMark> {
    let mut point: Option<&ProgressMark> = None;
    for column in request.columns.values() {
        let progress = column.progress.as_ref()?;
        point = Some(match point {
            None => progress,
            Some(p) if same_timeline(p, progress) => earlier(p, progress),
            Some(_) => return None,
        });
    }
    point
}

/// `request` with every column's progress set to its [`resume_point`], i.e. where the backfill
/// of the request actually starts.
pub fn with_resume_point(request: &BackfillRequest) -> BackfillRequest {
    let point = resume_point(request).cloned();
    BackfillRequest {
        table: request.table.clone(),
        columns: request
            .columns
            .iter()
            .map(|(name, column)| {
                let column = BackfillColumn {
                    progress: point.clone(),
                    ..column.clone()
                };
                (name.clone(), column)
            })
            .collect(),
        extra: request.extra.clone(),
    }
}

/// Merges two requests for the same table into one that satisfies both.
///
/// The result has the union of the columns. A column in both takes the earlier mark (the whole
/// mark, extra fields included) when the marks share a timeline and the backfill IDs are equal;
/// otherwise it restarts from scratch with `a`'s ID. Metadata is `a`'s, or else `b`'s.
pub fn table_superset(a: &BackfillRequest, b: &BackfillRequest) -> BackfillRequest {
    let mut columns: IndexMap<String, BackfillColumn> = a.columns.clone();
    for (name, theirs) in &b.columns {
        let Some(ours) = columns.get_mut(name) else {
            columns.insert(name.clone(), theirs.clone());
            continue;
        };
        ours.progress = match (&ours.progress, &theirs.progress) {
            (Some(mine), Some(other)) if same_timeline(mine, other) && ours.id == theirs.id => {
                Some(earlier(mine, other).clone())
            }
            _ => None,
        };
    }
    let mut table = a.table.clone();
    if table.metadata.is_none() {
        table.metadata.clone_from(&b.table.metadata);
    }
    BackfillRequest {
        table,
        columns,
        extra: a.extra.clone(),
    }
}

/// Merges the requests of several parties into one request per table (keyed by schema and
/// name, in order of first appearance) with [`table_superset`].
pub fn superset<S>(sets: S) -> Vec<BackfillRequest>
where
    S: IntoIterator,
    S::Item: IntoIterator<Item = BackfillRequest>,
{
    let mut merged: IndexMap<(String, String), BackfillRequest> = IndexMap::new();
    for request in sets.into_iter().flatten() {
        let key = (request.table.schema.clone(), request.table.name.clone());
        match merged.get_mut(&key) {
            Some(existing) => *existing = table_superset(existing, &request),
            None => {
                merged.insert(key, request);
            }
        }
    }
    merged.into_values().collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::change_stream::{BackfillTable, Extra, TableMetadata};
    use serde_json::{json, Value};

    pub(crate) fn mark(position: &str) -> ProgressMark {
        mark_on(position, "t1")
    }

    pub(crate) fn mark_on(position: &str, timeline: &str) -> ProgressMark {
        ProgressMark::new(position, Some(timeline.to_owned()))
    }

    /// A request for `public.<table>` whose column `c` has backfill ID `{"col": c}`.
    pub(crate) fn request_for(
        table: &str,
        columns: &[(&str, Option<ProgressMark>)],
    ) -> BackfillRequest {
        BackfillRequest {
            table: BackfillTable {
                schema: "public".into(),
                name: table.into(),
                metadata: None,
                extra: Extra::new(),
            },
            columns: columns
                .iter()
                .map(|(name, progress)| {
                    let column = BackfillColumn {
                        id: json!({ "col": name }),
                        progress: progress.clone(),
                        extra: Extra::new(),
                    };
                    ((*name).to_owned(), column)
                })
                .collect(),
            extra: Extra::new(),
        }
    }

    pub(crate) fn request(columns: &[(&str, Option<ProgressMark>)]) -> BackfillRequest {
        request_for("foo", columns)
    }

    fn marks(previous: Option<ProgressMark>, current: Option<ProgressMark>) -> ProgressMarks {
        ProgressMarks {
            previous,
            current,
            extra: Extra::new(),
        }
    }

    fn accept(
        own: Option<ProgressMark>,
        message: Option<(Option<ProgressMark>, Option<ProgressMark>)>,
    ) -> Verdict {
        let message = message.map(|(p, c)| marks(p, c));
        accept_backfill(own.as_ref(), message.as_ref().map(Marks::from))
    }

    #[test]
    fn legacy_message_without_marks_is_accepted_without_progress_change() {
        assert_eq!(
            accept(Some(mark("05")), None),
            Verdict::Accept(Some(mark("05")))
        );
        assert_eq!(accept(None, None), Verdict::Accept(None));
    }

    #[test]
    fn run_from_scratch_is_always_accepted() {
        assert_eq!(
            accept(Some(mark("05")), Some((None, Some(mark("02"))))),
            Verdict::Accept(Some(mark("02")))
        );
    }

    #[test]
    fn run_from_scratch_on_a_new_timeline_is_accepted() {
        assert_eq!(
            accept(Some(mark("05")), Some((None, Some(mark_on("02", "t2"))))),
            Verdict::Accept(Some(mark_on("02", "t2")))
        );
    }

    #[test]
    fn run_from_scratch_without_own_progress_is_accepted() {
        assert_eq!(
            accept(None, Some((None, Some(mark("02"))))),
            Verdict::Accept(Some(mark("02")))
        );
    }

    #[test]
    fn contiguous_continuation_is_accepted() {
        assert_eq!(
            accept(Some(mark("05")), Some((Some(mark("05")), Some(mark("08"))))),
            Verdict::Accept(Some(mark("08")))
        );
    }

    #[test]
    fn overlapping_continuation_is_accepted() {
        assert_eq!(
            accept(Some(mark("05")), Some((Some(mark("03")), Some(mark("08"))))),
            Verdict::Accept(Some(mark("08")))
        );
    }

    #[test]
    fn redundant_continuation_does_not_regress_progress() {
        assert_eq!(
            accept(Some(mark("05")), Some((Some(mark("01")), Some(mark("03"))))),
            Verdict::Accept(Some(mark("05")))
        );
    }

    #[test]
    fn continuation_onto_a_new_timeline_takes_current() {
        assert_eq!(
            accept(
                Some(mark("05")),
                Some((Some(mark("04")), Some(mark_on("01", "t2"))))
            ),
            Verdict::Accept(Some(mark_on("01", "t2")))
        );
    }

    #[test]
    fn gap_is_rejected() {
        assert_eq!(
            accept(Some(mark("05")), Some((Some(mark("06")), Some(mark("08"))))),
            Verdict::Ignore
        );
    }

    #[test]
    fn continuation_without_own_progress_is_rejected() {
        assert_eq!(
            accept(None, Some((Some(mark("01")), Some(mark("08"))))),
            Verdict::Ignore
        );
    }

    #[test]
    fn continuation_on_another_timeline_is_rejected() {
        assert_eq!(
            accept(
                Some(mark("05")),
                Some((Some(mark_on("01", "t2")), Some(mark_on("08", "t2"))))
            ),
            Verdict::Ignore
        );
        // A missing timeline is a timeline of its own.
        let untimed = ProgressMark::new("01", None);
        assert_eq!(
            accept(Some(mark("05")), Some((Some(untimed), Some(mark("08"))))),
            Verdict::Ignore
        );
    }

    #[test]
    fn completion_of_a_contiguous_run_is_accepted() {
        assert_eq!(
            accept(Some(mark("05")), Some((Some(mark("05")), None))),
            Verdict::Accept(Some(mark("05")))
        );
    }

    #[test]
    fn completion_of_an_empty_run_from_scratch_is_accepted() {
        assert_eq!(accept(None, Some((None, None))), Verdict::Accept(None));
    }

    #[test]
    fn completion_of_a_run_with_a_gap_is_rejected() {
        assert_eq!(
            accept(Some(mark("05")), Some((Some(mark("09")), None))),
            Verdict::Ignore
        );
    }

    #[test]
    fn completion_marks_drop_current() {
        let m = marks(Some(mark("05")), Some(mark("09")));
        assert_eq!(
            Marks::completion(&m),
            Marks {
                previous: Some(&mark("05")),
                current: None
            }
        );
    }

    #[test]
    fn positions_compare_as_javascript_strings() {
        // UTF-8 byte order puts U+FF5E first; JavaScript compares the surrogate 0xD83D of
        // U+1F600 with 0xFF5E, so the emoji comes first.
        let emoji = mark("\u{1F600}");
        let fullwidth = mark("\u{FF5E}");
        assert!(covers(Some(&emoji), Some(&fullwidth)));
        assert!(!covers(Some(&fullwidth), Some(&emoji)));
    }

    #[test]
    fn covers_table() {
        let cases: [(&str, Option<ProgressMark>, Option<ProgressMark>, bool); 7] = [
            ("from scratch covers anything", None, Some(mark("05")), true),
            ("from scratch covers from scratch", None, None, true),
            (
                "started stream does not cover from scratch",
                Some(mark("01")),
                None,
                false,
            ),
            (
                "earlier stream covers",
                Some(mark("03")),
                Some(mark("05")),
                true,
            ),
            (
                "equal stream covers",
                Some(mark("05")),
                Some(mark("05")),
                true,
            ),
            (
                "later stream does not cover",
                Some(mark("06")),
                Some(mark("05")),
                false,
            ),
            (
                "other timeline does not cover",
                Some(mark_on("01", "t2")),
                Some(mark("05")),
                false,
            ),
        ];
        for (name, stream, subscriber, expected) in cases {
            assert_eq!(
                covers(stream.as_ref(), subscriber.as_ref()),
                expected,
                "{name}"
            );
        }
    }

    #[test]
    fn resume_point_is_the_earliest_mark() {
        let req = request(&[("a", Some(mark("05"))), ("b", Some(mark("03")))]);
        assert_eq!(resume_point(&req), Some(&mark("03")));
    }

    #[test]
    fn resume_point_is_from_scratch_if_any_column_has_no_progress() {
        let req = request(&[("a", Some(mark("05"))), ("b", None)]);
        assert_eq!(resume_point(&req), None);
    }

    #[test]
    fn resume_point_is_from_scratch_if_timelines_differ() {
        let req = request(&[("a", Some(mark("05"))), ("b", Some(mark_on("03", "t2")))]);
        assert_eq!(resume_point(&req), None);
    }

    #[test]
    fn with_resume_point_applies_the_resume_point_to_all_columns() {
        assert_eq!(
            with_resume_point(&request(&[
                ("a", Some(mark("05"))),
                ("b", Some(mark("03")))
            ])),
            request(&[("a", Some(mark("03"))), ("b", Some(mark("03")))])
        );
        assert_eq!(
            with_resume_point(&request(&[("a", Some(mark("05"))), ("b", None)])),
            request(&[("a", None), ("b", None)])
        );
    }

    #[test]
    fn table_superset_is_the_union_with_the_earliest_progress() {
        assert_eq!(
            table_superset(
                &request(&[("a", Some(mark("05"))), ("b", Some(mark_on("03", "x")))]),
                &request(&[("b", Some(mark_on("02", "x"))), ("c", Some(mark("09")))]),
            ),
            request(&[
                ("a", Some(mark("05"))),
                ("b", Some(mark_on("02", "x"))),
                ("c", Some(mark("09"))),
            ])
        );
    }

    #[test]
    fn table_superset_keeps_the_whole_earlier_mark_including_extra_fields() {
        let with_extra = |position: &str, extra: &str| {
            let mut m = mark(position);
            m.extra.insert("extra".into(), Value::from(extra));
            m
        };
        let earlier = with_extra("01", "e1");
        let later = with_extra("02", "e2");
        assert_eq!(
            table_superset(
                &request(&[("a", Some(later))]),
                &request(&[("a", Some(earlier.clone()))])
            ),
            request(&[("a", Some(earlier))])
        );
    }

    #[test]
    fn table_superset_is_from_scratch_for_other_timelines_or_missing_progress() {
        assert_eq!(
            table_superset(
                &request(&[
                    ("a", Some(mark("05"))),
                    ("b", Some(mark("03"))),
                    ("c", None)
                ]),
                &request(&[
                    ("a", Some(mark_on("01", "t2"))),
                    ("b", None),
                    ("c", Some(mark("02"))),
                ]),
            ),
            request(&[("a", None), ("b", None), ("c", None)])
        );
    }

    #[test]
    fn table_superset_is_from_scratch_with_the_first_id_for_different_backfill_ids() {
        let mut other = request(&[("a", Some(mark("01")))]);
        other.columns[0].id = json!({"other": true});
        assert_eq!(
            table_superset(&request(&[("a", Some(mark("05")))]), &other),
            request(&[("a", None)])
        );
    }

    #[test]
    fn table_superset_takes_the_first_metadata_or_else_the_second() {
        let with_metadata = |mut req: BackfillRequest, v: u8| {
            let mut extra = Extra::new();
            extra.insert("v".into(), Value::from(v));
            req.table.metadata = Some(TableMetadata {
                row_key: Extra::new(),
                extra,
            });
            req
        };
        let version = |req: BackfillRequest| req.table.metadata.map(|m| m.extra["v"].clone());
        assert_eq!(
            version(table_superset(
                &request(&[("a", None)]),
                &with_metadata(request(&[("b", None)]), 2)
            )),
            Some(Value::from(2))
        );
        assert_eq!(
            version(table_superset(
                &with_metadata(request(&[("a", None)]), 1),
                &with_metadata(request(&[("b", None)]), 2)
            )),
            Some(Value::from(1))
        );
    }

    #[test]
    fn superset_merges_per_table_in_order_of_first_appearance() {
        let merged = superset([
            vec![
                request(&[("a", Some(mark("05")))]),
                request_for("bar", &[("x", Some(mark("01")))]),
            ],
            vec![],
            vec![request(&[("a", Some(mark("03"))), ("b", None)])],
        ]);
        assert_eq!(
            merged,
            vec![
                request(&[("a", Some(mark("03"))), ("b", None)]),
                request_for("bar", &[("x", Some(mark("01")))]),
            ]
        );
    }

    #[test]
    fn superset_keys_tables_by_schema_and_name() {
        let mut other_schema = request(&[("b", None)]);
        other_schema.table.schema = "private".into();
        let merged = superset([vec![request(&[("a", None)]), other_schema.clone()]]);
        assert_eq!(merged, vec![request(&[("a", None)]), other_schema]);
    }
}
