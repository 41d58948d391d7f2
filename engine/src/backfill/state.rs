//! One party's pending backfills, folded over the change stream.

use indexmap::IndexMap;

use super::cookie::{cookie_ops, CookieOp, TableRef};
use super::progress::{accept_backfill, covers, Marks, Verdict};
use super::BackfillError;
use crate::change_stream::{
    decode_downstream, BackfillColumn, BackfillRequest, BackfillTable, Change, DownstreamMessage,
    Extra, NewRelation, TableMetadata,
};

type TableKey = (String, String);

/// Pending backfills by table; every entry has at least one column.
type Tables = IndexMap<TableKey, BackfillRequest>;

fn key(table: TableRef<'_>) -> TableKey {
    (table.schema.to_owned(), table.name.to_owned())
}

fn request_key(request: &BackfillRequest) -> TableKey {
    (request.table.schema.clone(), request.table.name.clone())
}

/// The pending backfills of one party — a v8 subscriber, the change log, or a stream session —
/// and how far each column got, kept by applying the same rules a replicator applies: schema
/// changes fold through [`cookie_ops`], and `backfill` / `backfill-completed` messages pass the
/// continuity policy of [`accept_backfill`] column by column.
///
/// Changes between `begin` and `commit` form a transaction: [`BackfillState::requests`] reflects
/// committed transactions only, and `rollback` discards the open one. A `begin` without a
/// preceding `commit` (an interrupted stream) keeps the older snapshot, so nothing half-applied
/// is ever reported as committed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackfillState {
    tables: Tables,
    /// The committed tables while a transaction is open.
    before_tx: Option<Tables>,
}

impl BackfillState {
    /// A state with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// A state seeded with `requests` (a v8 `start-subscription.backfills`, or a change log's
    /// cookie jar). Requests without columns are dropped; two requests for one table are an
    /// error, since which progress holds would be ambiguous.
    pub fn try_from_requests(
        requests: impl IntoIterator<Item = BackfillRequest>,
    ) -> Result<Self, BackfillError> {
        let mut tables = Tables::new();
        for request in requests {
            let key = request_key(&request);
            if tables.contains_key(&key) {
                let (schema, name) = key;
                return Err(BackfillError::DuplicateTable { schema, name });
            }
            if !request.columns.is_empty() {
                tables.insert(key, request);
            }
        }
        Ok(BackfillState {
            tables,
            before_tx: None,
        })
    }

    /// Like [`BackfillState::try_from_requests`] for requests known to name each table once
    /// (e.g. a [`superset`](super::superset)); a repeated table keeps its last request.
    pub(super) fn from_unique(requests: impl IntoIterator<Item = BackfillRequest>) -> Self {
        let tables = requests
            .into_iter()
            .filter(|r| !r.columns.is_empty())
            .map(|r| (request_key(&r), r))
            .collect();
        BackfillState {
            tables,
            before_tx: None,
        }
    }

    fn committed(&self) -> &Tables {
        self.before_tx.as_ref().unwrap_or(&self.tables)
    }

    /// The committed pending backfills, one request per table.
    pub fn requests(&self) -> Vec<BackfillRequest> {
        self.committed().values().cloned().collect()
    }

    /// Whether nothing is pending (as committed).
    pub fn is_empty(&self) -> bool {
        self.committed().is_empty()
    }

    /// Whether a transaction is open.
    pub fn in_transaction(&self) -> bool {
        self.before_tx.is_some()
    }

    /// `requests` with this state's committed progress applied to each column pending here with
    /// the same backfill ID; every other column restarts from scratch. Used to re-seed from a
    /// progress-agnostic cookie jar without losing what was tracked in memory.
    pub fn with_progress(&self, requests: Vec<BackfillRequest>) -> Vec<BackfillRequest> {
        let committed = self.committed();
        requests
            .into_iter()
            .map(|mut request| {
                let tracked = committed.get(&request_key(&request));
                for (name, column) in &mut request.columns {
                    column.progress = tracked
                        .and_then(|t| t.columns.get(name))
                        .filter(|t| t.id == column.id)
                        .and_then(|t| t.progress.clone());
                }
                request
            })
            .collect()
    }

    /// The committed pending columns (as `schema.table.column`) for which the committed progress
    /// of `stream` will not deliver everything: the stream does not have the column pending with
    /// the same backfill ID, or its progress does not [`covers`] this state's.
    pub fn uncovered(&self, stream: &BackfillState) -> Vec<String> {
        let stream = stream.committed();
        let mut uncovered = Vec::new();
        for (key, request) in self.committed() {
            let stream_columns = stream.get(key).map(|r| &r.columns);
            for (name, column) in &request.columns {
                let is_covered = stream_columns
                    .and_then(|columns| columns.get(name))
                    .is_some_and(|s| {
                        s.id == column.id && covers(s.progress.as_ref(), column.progress.as_ref())
                    });
                if !is_covered {
                    uncovered.push(column_path(
                        &request.table.schema,
                        &request.table.name,
                        name,
                    ));
                }
            }
        }
        uncovered
    }

    /// Opens a transaction (keeping the older snapshot if one is already open).
    pub fn begin(&mut self) {
        if self.before_tx.is_none() {
            self.before_tx = Some(self.tables.clone());
        }
    }

    /// Commits the open transaction, if any.
    pub fn commit(&mut self) {
        self.before_tx = None;
    }

    /// Discards the open transaction, if any.
    pub fn rollback(&mut self) {
        if let Some(tables) = self.before_tx.take() {
            self.tables = tables;
        }
    }

    /// Applies a downstream message: transaction boundaries and `data` changes; everything else
    /// is ignored. Returns the columns (as `schema.table.column`) for which a backfill message was
    /// ignored by the continuity policy.
    pub fn apply_message(&mut self, message: &DownstreamMessage) -> Vec<String> {
        match message {
            DownstreamMessage::Begin(_) => self.begin(),
            DownstreamMessage::Commit(_) => self.commit(),
            DownstreamMessage::Rollback(_) => self.rollback(),
            DownstreamMessage::Data(change) => return self.apply(change),
            DownstreamMessage::Status(_)
            | DownstreamMessage::Error(_)
            | DownstreamMessage::Reserved(_) => {}
        }
        Vec::new()
    }

    /// Applies a stored message given as its tag and its serialized downstream tuple, decoding
    /// only what can affect backfills (a change is typically relayed to many parties as one
    /// string, and most changes are rows).
    pub fn apply_serialized(
        &mut self,
        tag: &str,
        json: &str,
    ) -> Result<Vec<String>, BackfillError> {
        match tag {
            "begin" => self.begin(),
            "commit" => self.commit(),
            "rollback" => self.rollback(),
            tag if affects_backfills(tag) => {
                let message = decode_downstream(json).map_err(|source| BackfillError::Decode {
                    tag: tag.to_owned(),
                    source,
                })?;
                return Ok(self.apply_message(&message));
            }
            _ => {}
        }
        Ok(Vec::new())
    }

    /// Applies one change. Returns the columns (as `schema.table.column`) for which a
    /// `backfill` / `backfill-completed` message was ignored by the continuity policy.
    pub fn apply(&mut self, change: &Change) -> Vec<String> {
        match change {
            Change::Backfill(b) => {
                let marks = b.progress_marks.as_ref().map(Marks::from);
                self.apply_backfill(&b.relation, &b.columns, marks, false)
            }
            Change::BackfillCompleted(c) => {
                let marks = c.progress_marks.as_ref().map(Marks::completion);
                self.apply_backfill(&c.relation, &c.columns, marks, true)
            }
            _ => {
                self.apply_schema_change(change);
                Vec::new()
            }
        }
    }

    /// Applies the policy to each pending column of `rowKey.columns ∪ columns`; a `completion`
    /// removes the accepted columns, a backfill moves their progress.
    fn apply_backfill(
        &mut self,
        relation: &NewRelation,
        columns: &[String],
        marks: Option<Marks<'_>>,
        completion: bool,
    ) -> Vec<String> {
        let key = (relation.schema.clone(), relation.name.clone());
        let Some(request) = self.tables.get_mut(&key) else {
            return Vec::new();
        };
        let mut ignored = Vec::new();
        // Row-key columns are not listed in `columns` but are backfilled with them.
        for name in relation.row_key.columns.iter().chain(columns) {
            let Some(column) = request.columns.get_mut(name) else {
                continue;
            };
            match accept_backfill(column.progress.as_ref(), marks) {
                Verdict::Accept(_) if completion => {
                    request.columns.shift_remove(name);
                }
                Verdict::Accept(progress) => column.progress = progress,
                Verdict::Ignore => {
                    ignored.push(column_path(&relation.schema, &relation.name, name));
                }
            }
        }
        if request.columns.is_empty() {
            self.tables.shift_remove(&key);
        }
        ignored
    }

    fn apply_schema_change(&mut self, change: &Change) {
        // Metadata carried by this same change, for a table that becomes pending with it.
        let mut announced: Vec<(TableRef<'_>, &TableMetadata)> = Vec::new();
        for op in cookie_ops(change) {
            match op {
                CookieOp::UpsertMetadata { table, metadata } => {
                    announced.push((table, metadata));
                    if let Some(request) = self.tables.get_mut(&key(table)) {
                        request.table.metadata = Some(metadata.clone());
                    }
                }
                CookieOp::UpsertBackfill { table, column, id } => {
                    let request = self.tables.entry(key(table)).or_insert_with(|| {
                        let metadata = announced
                            .iter()
                            .rev()
                            .find(|(t, _)| *t == table)
                            .map(|(_, m)| (*m).clone());
                        new_request(table, metadata)
                    });
                    // A new backfill always starts from scratch.
                    let column_state = BackfillColumn {
                        id: id.clone(),
                        progress: None,
                        extra: Extra::new(),
                    };
                    request.columns.insert(column.to_owned(), column_state);
                }
                CookieOp::RenameTable { old, new } => {
                    if let Some(mut request) = self.tables.shift_remove(&key(old)) {
                        new.schema.clone_into(&mut request.table.schema);
                        new.name.clone_into(&mut request.table.name);
                        self.tables.insert(key(new), request);
                    }
                }
                CookieOp::DropTable { table } => {
                    self.tables.shift_remove(&key(table));
                }
                CookieOp::RenameColumn { table, old, new } => {
                    if let Some(request) = self.tables.get_mut(&key(table)) {
                        if let Some(column) = request.columns.shift_remove(old) {
                            request.columns.insert(new.to_owned(), column);
                        }
                    }
                }
                CookieOp::DropColumn { table, column } => {
                    let key = key(table);
                    if let Some(request) = self.tables.get_mut(&key) {
                        request.columns.shift_remove(column);
                        if request.columns.is_empty() {
                            self.tables.shift_remove(&key);
                        }
                    }
                }
                // Only `backfill-completed` yields this, and it goes through the policy instead.
                CookieOp::CompleteBackfill { .. } => {}
            }
        }
    }
}

/// Whether a change with this tag can change a party's pending backfills: `backfill` and every
/// schema change except index changes. Transaction boundaries are handled separately.
pub fn affects_backfills(tag: &str) -> bool {
    matches!(
        tag,
        "backfill"
            | "backfill-completed"
            | "create-table"
            | "rename-table"
            | "update-table-metadata"
            | "add-column"
            | "update-column"
            | "drop-column"
            | "drop-table"
    )
}

fn new_request(table: TableRef<'_>, metadata: Option<TableMetadata>) -> BackfillRequest {
    BackfillRequest {
        table: BackfillTable {
            schema: table.schema.to_owned(),
            name: table.name.to_owned(),
            metadata,
            extra: Extra::new(),
        },
        columns: IndexMap::new(),
        extra: Extra::new(),
    }
}

fn column_path(schema: &str, table: &str, column: &str) -> String {
    format!("{schema}.{table}.{column}")
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::backfill::progress::tests::{mark, mark_on, request, request_for};
    use crate::change_stream::{decode_change_value, ProgressMark};
    use serde_json::{json, Value};

    fn change(value: Value) -> Change {
        decode_change_value(value).expect("a valid change")
    }

    fn marks_json(previous: Option<&ProgressMark>, current: Option<&ProgressMark>) -> Value {
        let to_json = |m: &ProgressMark| {
            let mut o = m.extra.clone();
            o.insert("progressMark".into(), json!(m.progress_mark));
            if let Some(t) = &m.timeline {
                o.insert("timeline".into(), json!(t));
            }
            Value::Object(o)
        };
        let mut o = serde_json::Map::new();
        if let Some(p) = previous {
            o.insert("previous".into(), to_json(p));
        }
        if let Some(c) = current {
            o.insert("current".into(), to_json(c));
        }
        Value::Object(o)
    }

    /// A `backfill` of `public.<table>` (row key `id`); `marks` = None is a pre-v8 message.
    pub(crate) fn backfill_of(
        table: &str,
        columns: &[&str],
        marks: Option<(Option<ProgressMark>, ProgressMark)>,
    ) -> Change {
        let mut c = json!({
            "tag": "backfill",
            "relation": {"schema": "public", "name": table, "rowKey": {"columns": ["id"]}},
            "columns": columns,
            "watermark": "01",
            "rowValues": [],
        });
        if let Some((previous, current)) = marks {
            c["progressMarks"] = marks_json(previous.as_ref(), Some(&current));
        }
        change(c)
    }

    pub(crate) fn backfill(
        columns: &[&str],
        marks: Option<(Option<ProgressMark>, ProgressMark)>,
    ) -> Change {
        backfill_of("foo", columns, marks)
    }

    /// A `backfill-completed` of `public.foo`; `marks` = None is a pre-v8 message.
    fn completed(columns: &[&str], marks: Option<Option<ProgressMark>>) -> Change {
        let mut c = json!({
            "tag": "backfill-completed",
            "relation": {"schema": "public", "name": "foo", "rowKey": {"columns": ["id"]}},
            "columns": columns,
            "watermark": "01",
        });
        if let Some(previous) = marks {
            c["progressMarks"] = marks_json(previous.as_ref(), None);
        }
        change(c)
    }

    fn state(requests: Vec<BackfillRequest>) -> BackfillState {
        BackfillState::try_from_requests(requests).expect("valid requests")
    }

    fn metadata(v: u8) -> TableMetadata {
        let mut row_key = serde_json::Map::new();
        row_key.insert("id".into(), json!(v));
        TableMetadata {
            row_key,
            extra: Extra::new(),
        }
    }

    #[test]
    fn tracks_contiguous_progress_and_ignores_gaps() {
        let mut s = state(vec![request(&[("a", Some(mark("05"))), ("b", None)])]);
        s.begin();
        // Contiguous for `a`; `b` has no data yet and needs a run from scratch.
        let ignored = s.apply(&backfill(&["a", "b"], Some((Some(mark("05")), mark("08")))));
        assert_eq!(ignored, vec!["public.foo.b"]);
        s.commit();
        assert_eq!(
            s.requests(),
            vec![request(&[("a", Some(mark("08"))), ("b", None)])]
        );

        // A run from scratch is accepted by both.
        s.begin();
        assert!(s
            .apply(&backfill(&["a", "b"], Some((None, mark("02")))))
            .is_empty());
        s.commit();
        assert_eq!(
            s.requests(),
            vec![request(&[("a", Some(mark("02"))), ("b", Some(mark("02")))])]
        );
    }

    #[test]
    fn backfill_applies_to_row_key_columns_too() {
        let mut s = state(vec![request(&[("id", None), ("a", None)])]);
        assert!(s
            .apply(&backfill(&["a"], Some((None, mark("03")))))
            .is_empty());
        assert_eq!(
            s.requests(),
            vec![request(&[
                ("id", Some(mark("03"))),
                ("a", Some(mark("03")))
            ])]
        );
        let ignored = s.apply(&backfill(&[], Some((Some(mark("07")), mark("09")))));
        assert_eq!(ignored, vec!["public.foo.id"]);
    }

    #[test]
    fn backfill_of_untracked_table_or_column_is_neither_applied_nor_ignored() {
        let mut s = state(vec![request(&[("a", Some(mark("05")))])]);
        let gap = Some((Some(mark("09")), mark("10")));
        assert!(s.apply(&backfill_of("bar", &["a"], gap.clone())).is_empty());
        assert!(s.apply(&backfill(&["z"], gap)).is_empty());
        assert_eq!(s.requests(), vec![request(&[("a", Some(mark("05")))])]);
    }

    #[test]
    fn completes_only_contiguous_columns() {
        let mut s = state(vec![request(&[
            ("a", Some(mark("05"))),
            ("b", Some(mark("02"))),
        ])]);
        s.begin();
        let ignored = s.apply(&completed(&["a", "b"], Some(Some(mark("04")))));
        assert_eq!(ignored, vec!["public.foo.b"]);
        s.commit();
        assert_eq!(s.requests(), vec![request(&[("b", Some(mark("02")))])]);

        s.begin();
        assert!(s
            .apply(&completed(&["b"], Some(Some(mark("01")))))
            .is_empty());
        s.commit();
        assert!(s.requests().is_empty());
        assert!(s.is_empty());
    }

    #[test]
    fn completion_of_an_empty_run_from_scratch_removes_columns_without_progress() {
        let mut s = state(vec![request(&[("a", None)])]);
        assert!(s.apply(&completed(&["a"], Some(None))).is_empty());
        assert!(s.is_empty());
    }

    #[test]
    fn legacy_messages_are_accepted() {
        let mut s = state(vec![request(&[("a", Some(mark("05")))])]);
        s.begin();
        assert!(s.apply(&backfill(&["a"], None)).is_empty());
        s.commit();
        // Progress unchanged by a pre-v8 backfill.
        assert_eq!(s.requests(), vec![request(&[("a", Some(mark("05")))])]);
        s.begin();
        assert!(s.apply(&completed(&["a"], None)).is_empty());
        s.commit();
        assert!(s.requests().is_empty());
    }

    #[test]
    fn schema_changes_add_rename_and_drop_columns_rename_create_and_drop_tables() {
        let mut s = state(vec![request(&[
            ("a", Some(mark("05"))),
            ("b", Some(mark("02"))),
        ])]);
        s.begin();
        s.apply(&change(json!({
            "tag": "add-column",
            "table": {"schema": "public", "name": "foo"},
            "tableMetadata": {"rowKey": {"id": 1}},
            "column": {"name": "c", "spec": {"pos": 3, "dataType": "text"}},
            "backfill": {"col": "c"},
        })));
        s.apply(&change(json!({
            "tag": "update-column",
            "table": {"schema": "public", "name": "foo"},
            "old": {"name": "b", "spec": {"pos": 2, "dataType": "text"}},
            "new": {"name": "bb", "spec": {"pos": 2, "dataType": "text"}},
        })));
        s.apply(&change(json!({
            "tag": "drop-column",
            "table": {"schema": "public", "name": "foo"},
            "column": "a",
        })));
        s.apply(&change(json!({
            "tag": "rename-table",
            "old": {"schema": "public", "name": "foo"},
            "new": {"schema": "public", "name": "bar"},
        })));
        s.apply(&change(json!({
            "tag": "create-table",
            "spec": {"schema": "public", "name": "baz", "columns": {}},
            "metadata": {"rowKey": {"id": 2}},
            "backfill": {"x": {"col": "x"}},
        })));
        s.commit();

        let mut bar = request_for("bar", &[("c", None)]);
        let mut bb = request(&[("b", Some(mark("02")))]).columns[0].clone();
        bb.progress = Some(mark("02"));
        bar.columns.insert("bb".into(), bb);
        bar.table.metadata = Some(metadata(1));
        let mut baz = request_for("baz", &[("x", None)]);
        baz.table.metadata = Some(metadata(2));
        let by_column = |mut r: BackfillRequest| {
            r.columns.sort_keys();
            r
        };
        let requests: Vec<_> = s.requests().into_iter().map(by_column).collect();
        assert_eq!(requests, vec![by_column(bar), baz.clone()]);

        s.begin();
        s.apply(&change(
            json!({"tag": "drop-table", "id": {"schema": "public", "name": "bar"}}),
        ));
        s.commit();
        assert_eq!(s.requests(), vec![baz]);
    }

    #[test]
    fn update_table_metadata_replaces_metadata() {
        let mut s = state(vec![request(&[("a", None)])]);
        s.apply(&change(json!({
            "tag": "update-table-metadata",
            "table": {"schema": "public", "name": "foo"},
            "old": {"rowKey": {"id": 1}},
            "new": {"rowKey": {"id": 9}},
        })));
        assert_eq!(s.requests()[0].table.metadata, Some(metadata(9)));
    }

    #[test]
    fn new_backfill_id_for_a_pending_column_restarts_it_from_scratch() {
        let mut s = state(vec![request(&[("a", Some(mark("05")))])]);
        s.apply(&change(json!({
            "tag": "add-column",
            "table": {"schema": "public", "name": "foo"},
            "column": {"name": "a", "spec": {"pos": 1, "dataType": "text"}},
            "backfill": {"col": "a2"},
        })));
        let column = &s.requests()[0].columns["a"];
        assert_eq!(
            (&column.id, &column.progress),
            (&json!({"col": "a2"}), &None)
        );
    }

    #[test]
    fn dropping_the_last_pending_column_drops_the_table() {
        let mut s = state(vec![request(&[("a", None)])]);
        s.apply(&change(json!({
            "tag": "drop-column",
            "table": {"schema": "public", "name": "foo"},
            "column": "a",
        })));
        assert!(s.is_empty());
    }

    #[test]
    fn index_and_row_changes_are_no_ops() {
        let mut s = state(vec![request(&[("a", Some(mark("05")))])]);
        let before = s.clone();
        for c in [
            json!({"tag": "create-index", "spec": {"schema": "public", "name": "i",
                "tableName": "foo", "unique": false, "columns": {"a": "ASC"}}}),
            json!({"tag": "drop-index", "id": {"schema": "public", "name": "i"}}),
            json!({"tag": "insert", "relation": {"schema": "public", "name": "foo",
                "rowKey": {"columns": ["id"]}}, "new": {"id": 1}}),
            json!({"tag": "truncate", "relations": []}),
        ] {
            assert!(s.apply(&change(c)).is_empty());
        }
        assert_eq!(s, before);
    }

    #[test]
    fn rolled_back_changes_are_discarded() {
        let mut s = state(vec![request(&[("a", Some(mark("05")))])]);
        s.begin();
        s.apply(&backfill(&["a"], Some((Some(mark("05")), mark("09")))));
        s.apply(&change(
            json!({"tag": "drop-table", "id": {"schema": "public", "name": "foo"}}),
        ));
        // Uncommitted changes are not reflected.
        assert_eq!(s.requests(), vec![request(&[("a", Some(mark("05")))])]);
        s.rollback();
        assert_eq!(s.requests(), vec![request(&[("a", Some(mark("05")))])]);

        // Later transactions proceed from the pre-rollback state.
        s.begin();
        s.apply(&backfill(&["a"], Some((Some(mark("05")), mark("07")))));
        s.commit();
        assert_eq!(s.requests(), vec![request(&[("a", Some(mark("07")))])]);
    }

    #[test]
    fn begin_without_commit_keeps_the_older_snapshot() {
        let mut s = state(vec![request(&[("a", Some(mark("05")))])]);
        s.begin();
        s.apply(&backfill(&["a"], Some((Some(mark("05")), mark("07")))));
        // The stream was interrupted: no commit, then a new transaction.
        s.begin();
        s.apply(&backfill(&["a"], Some((Some(mark("07")), mark("09")))));
        assert_eq!(s.requests(), vec![request(&[("a", Some(mark("05")))])]);
        s.rollback();
        assert_eq!(s.requests(), vec![request(&[("a", Some(mark("05")))])]);
        assert!(!s.in_transaction());
    }

    #[test]
    fn uncovered_lists_columns_the_stream_does_not_deliver() {
        let session = state(vec![request(&[
            ("a", Some(mark("03"))),
            ("b", None),
            ("c", Some(mark_on("05", "t2"))),
        ])]);
        let covered = state(vec![request(&[
            ("a", Some(mark("04"))),
            ("b", Some(mark("01"))),
            ("c", Some(mark_on("06", "t2"))),
        ])]);
        assert!(covered.uncovered(&session).is_empty());
        let behind = state(vec![request(&[
            ("a", Some(mark("02"))),
            ("b", None),
            ("c", Some(mark("06"))),
        ])]);
        assert_eq!(
            behind.uncovered(&session),
            vec!["public.foo.a", "public.foo.c"]
        );
        // A column that is not pending in the session is not covered.
        assert_eq!(
            state(vec![request(&[("d", None)])]).uncovered(&session),
            vec!["public.foo.d"]
        );
        // Nor is one with a different backfill ID.
        let mut other_id = request(&[("b", None)]);
        other_id.columns[0].id = json!({"other": true});
        assert_eq!(
            state(vec![other_id]).uncovered(&session),
            vec!["public.foo.b"]
        );
    }

    #[test]
    fn apply_serialized_decodes_only_relevant_messages() {
        use crate::change_stream::{encode_downstream, Begin, Commit};
        use crate::watermark::Watermark;
        let wm = Watermark::parse("02").expect("watermark");
        let mut s = state(vec![request(&[("a", Some(mark("05")))])]);
        let begin = encode_downstream(&DownstreamMessage::Begin(Begin::new(wm.clone())));
        let commit = encode_downstream(&DownstreamMessage::Commit(Commit::new(wm)));
        let data = |c: Change| encode_downstream(&DownstreamMessage::Data(c));

        s.apply_serialized("begin", &begin).expect("begin");
        let gap = data(backfill(&["a"], Some((Some(mark("06")), mark("09")))));
        assert_eq!(
            s.apply_serialized("backfill", &gap).expect("backfill"),
            vec!["public.foo.a"]
        );
        let next = data(backfill(&["a"], Some((Some(mark("05")), mark("09")))));
        assert!(s
            .apply_serialized("backfill", &next)
            .expect("backfill")
            .is_empty());
        // Irrelevant messages are not decoded.
        assert!(s
            .apply_serialized("insert", "not json")
            .expect("skipped")
            .is_empty());
        s.apply_serialized("commit", &commit).expect("commit");
        assert_eq!(s.requests(), vec![request(&[("a", Some(mark("09")))])]);

        let err = s.apply_serialized("drop-table", "not json").unwrap_err();
        assert!(matches!(err, BackfillError::Decode { ref tag, .. } if tag == "drop-table"));
    }

    #[test]
    fn with_progress_carries_committed_progress_for_matching_ids() {
        let mut s = state(vec![request(&[
            ("a", Some(mark("05"))),
            ("b", Some(mark("03"))),
            ("c", None),
        ])]);
        // Uncommitted progress is not carried.
        s.begin();
        s.apply(&backfill(&["a"], Some((Some(mark("05")), mark("09")))));

        let mut reseeded = request(&[("a", None), ("b", None), ("c", None), ("d", None)]);
        reseeded.columns["b"].id = json!({"col": "other"});
        let bar = request_for("bar", &[("x", None)]);
        let mut expected = reseeded.clone();
        expected.columns["a"].progress = Some(mark("05"));
        assert_eq!(
            s.with_progress(vec![reseeded, bar.clone()]),
            vec![expected, bar]
        );
    }

    #[test]
    fn construction_drops_requests_without_columns_and_rejects_duplicate_tables() {
        let s = state(vec![request(&[]), request_for("bar", &[("x", None)])]);
        assert_eq!(s.requests(), vec![request_for("bar", &[("x", None)])]);
        let err = BackfillState::try_from_requests(vec![
            request(&[("a", None)]),
            request(&[("b", None)]),
        ])
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "expected at most one backfill request per table, got several for public.foo"
        );
    }

    #[test]
    fn relevant_tags_are_backfills_and_schema_changes_except_indexes() {
        for tag in [
            "backfill",
            "backfill-completed",
            "create-table",
            "drop-column",
        ] {
            assert!(affects_backfills(tag), "{tag}");
        }
        for tag in [
            "insert",
            "update",
            "delete",
            "truncate",
            "create-index",
            "drop-index",
        ] {
            assert!(!affects_backfills(tag), "{tag}");
        }
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use crate::change_stream::{decode_change_value, ProgressMark};
    use proptest::prelude::*;
    use serde_json::{json, Value};

    const TABLES: [&str; 3] = ["t0", "t1", "t2"];
    const COLUMNS: [&str; 4] = ["c0", "c1", "c2", "c3"];

    #[derive(Debug, Clone)]
    enum Step {
        Begin,
        Commit,
        Rollback,
        Change(Value),
    }

    fn table() -> impl Strategy<Value = &'static str> {
        prop::sample::select(&TABLES[..])
    }

    fn column() -> impl Strategy<Value = &'static str> {
        prop::sample::select(&COLUMNS[..])
    }

    fn id() -> impl Strategy<Value = Value> {
        (0u8..2).prop_map(|g| json!({ "g": g }))
    }

    fn mark() -> impl Strategy<Value = Value> {
        // Mostly one timeline, so that continuations meet comparable progress.
        let timeline = prop_oneof![
            3 => Just(Some("x")),
            1 => Just(Some("y")),
            1 => Just(None),
        ];
        (0u8..8, timeline).prop_map(|(position, timeline)| {
            let mut m = json!({ "progressMark": position.to_string() });
            if let Some(t) = timeline {
                m["timeline"] = json!(t);
            }
            m
        })
    }

    fn metadata() -> impl Strategy<Value = Value> {
        (0u8..3).prop_map(|v| json!({ "rowKey": { "v": v } }))
    }

    fn relation(table: &str, row_key: &[&str]) -> Value {
        json!({ "schema": "public", "name": table, "rowKey": { "columns": row_key } })
    }

    fn ident(table: &str) -> Value {
        json!({ "schema": "public", "name": table })
    }

    /// Disjoint row-key and other columns of a backfill message.
    fn split_columns() -> impl Strategy<Value = (Vec<&'static str>, Vec<&'static str>)> {
        prop::collection::vec(prop::option::of(any::<bool>()), COLUMNS.len()).prop_map(|picks| {
            let mut row_key = Vec::new();
            let mut others = Vec::new();
            for (name, pick) in COLUMNS.iter().zip(picks) {
                match pick {
                    Some(true) => row_key.push(*name),
                    Some(false) => others.push(*name),
                    None => {}
                }
            }
            (row_key, others)
        })
    }

    fn change() -> impl Strategy<Value = Value> {
        prop_oneof![
            1 => (
                table(),
                prop::option::of(metadata()),
                prop::collection::vec((column(), id()), 0..3)
            )
                .prop_map(|(t, m, backfill)| {
                    let mut c = json!({"tag": "create-table",
                        "spec": {"schema": "public", "name": t, "columns": {}}});
                    if let Some(m) = m {
                        c["metadata"] = m;
                    }
                    if !backfill.is_empty() {
                        let map: serde_json::Map<String, Value> = backfill
                            .into_iter()
                            .map(|(c, id)| (c.to_owned(), id))
                            .collect();
                        c["backfill"] = Value::Object(map);
                    }
                    c
                }),
            2 => (
                table(),
                column(),
                prop::option::of(metadata()),
                prop::option::of(id())
            )
                .prop_map(|(t, col, m, id)| {
                    let mut c = json!({"tag": "add-column", "table": ident(t),
                        "column": {"name": col, "spec": {"pos": 1, "dataType": "text"}}});
                    if let Some(m) = m {
                        c["tableMetadata"] = m;
                    }
                    if let Some(id) = id {
                        c["backfill"] = id;
                    }
                    c
                }),
            1 => (table(), column(), column()).prop_map(|(t, old, new)| json!({
                "tag": "update-column", "table": ident(t),
                "old": {"name": old, "spec": {"pos": 1, "dataType": "text"}},
                "new": {"name": new, "spec": {"pos": 1, "dataType": "text"}},
            })),
            1 => (table(), column()).prop_map(
                |(t, col)| json!({"tag": "drop-column", "table": ident(t), "column": col})
            ),
            1 => (table(), table()).prop_map(
                |(old, new)| json!({"tag": "rename-table", "old": ident(old), "new": ident(new)})
            ),
            1 => table().prop_map(|t| json!({"tag": "drop-table", "id": ident(t)})),
            1 => (table(), metadata(), metadata()).prop_map(|(t, old, new)| json!({
                "tag": "update-table-metadata", "table": ident(t), "old": old, "new": new,
            })),
            6 => (
                table(),
                split_columns(),
                prop::option::of((prop::option::of(mark()), mark()))
            )
                .prop_map(|(t, (row_key, columns), marks)| {
                    let mut c = json!({"tag": "backfill", "relation": relation(t, &row_key),
                        "columns": columns, "watermark": "01", "rowValues": []});
                    if let Some((previous, current)) = marks {
                        c["progressMarks"] = json!({"current": current});
                        if let Some(p) = previous {
                            c["progressMarks"]["previous"] = p;
                        }
                    }
                    c
                }),
            2 => (
                table(),
                split_columns(),
                prop::option::of(prop::option::of(mark()))
            )
                .prop_map(|(t, (row_key, columns), marks)| {
                    let mut c = json!({"tag": "backfill-completed",
                        "relation": relation(t, &row_key), "columns": columns, "watermark": "01"});
                    if let Some(previous) = marks {
                        c["progressMarks"] = json!({});
                        if let Some(p) = previous {
                            c["progressMarks"]["previous"] = p;
                        }
                    }
                    c
                }),
            1 => table().prop_map(
                |t| json!({"tag": "insert", "relation": relation(t, &["c0"]),
                "new": {"c0": 1}})
            ),
        ]
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            1 => Just(Step::Begin),
            1 => Just(Step::Commit),
            1 => Just(Step::Rollback),
            6 => change().prop_map(Step::Change),
        ]
    }

    /// Requests covering every table and column so that backfills have something to act on.
    fn seed() -> impl Strategy<Value = Vec<Value>> {
        let column = (id(), prop::option::weighted(0.8, mark()));
        let columns = prop::collection::btree_map(column_owned(), column, 0..4);
        prop::collection::btree_map(table(), columns, 0..3).prop_map(|tables| {
            tables
                .into_iter()
                .map(|(name, columns)| {
                    let columns: serde_json::Map<String, Value> = columns
                        .into_iter()
                        .map(|(c, (id, progress))| {
                            let mut col = json!({ "id": id });
                            if let Some(p) = progress {
                                col["progress"] = p;
                            }
                            (c, col)
                        })
                        .collect();
                    json!({"table": {"schema": "public", "name": name, "metadata": null},
                        "columns": columns})
                })
                .collect()
        })
    }

    fn column_owned() -> impl Strategy<Value = String> {
        column().prop_map(str::to_owned)
    }

    fn working(s: &BackfillState) -> Vec<BackfillRequest> {
        s.tables.values().cloned().collect()
    }

    fn progress_of(s: &BackfillState, table: &str, column: &str) -> Option<Option<ProgressMark>> {
        let key = ("public".to_owned(), table.to_owned());
        s.tables
            .get(&key)
            .and_then(|r| r.columns.get(column))
            .map(|c| c.progress.clone())
    }

    /// `(table, [(column, marks verdict input)])` of a backfill or completion, for checking.
    fn backfill_columns(change: &Change) -> Option<(&NewRelation, Vec<&str>, bool)> {
        let (relation, columns, completion) = match change {
            Change::Backfill(b) => (&b.relation, &b.columns, false),
            Change::BackfillCompleted(c) => (&c.relation, &c.columns, true),
            _ => return None,
        };
        let names = relation
            .row_key
            .columns
            .iter()
            .chain(columns)
            .map(String::as_str)
            .collect();
        Some((relation, names, completion))
    }

    fn marks_of(change: &Change) -> Option<Marks<'_>> {
        match change {
            Change::Backfill(b) => b.progress_marks.as_ref().map(Marks::from),
            Change::BackfillCompleted(c) => c.progress_marks.as_ref().map(Marks::completion),
            _ => None,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn transactions_and_the_continuity_policy_hold_over_random_streams(
            seed in seed(),
            steps in prop::collection::vec(step(), 0..40),
        ) {
            let seed: Vec<BackfillRequest> = seed
                .into_iter()
                .map(|v| crate::change_stream::decode_backfill_request_value(v).expect("seed"))
                .collect();
            let mut s = BackfillState::try_from_requests(seed).expect("unique tables");
            // The state as of the last commit, kept independently of `s`.
            let mut committed = working(&s);

            for step in steps {
                match step {
                    Step::Begin => s.begin(),
                    Step::Commit => {
                        s.commit();
                        committed = working(&s);
                    }
                    Step::Rollback => {
                        let was_open = s.in_transaction();
                        s.rollback();
                        if was_open {
                            // Rollback restores the pre-transaction state exactly.
                            prop_assert_eq!(working(&s), committed.clone());
                        }
                    }
                    Step::Change(value) => {
                        let change = decode_change_value(value).expect("generated change");
                        let before = s.clone();
                        let ignored = s.apply(&change);

                        if let Some((relation, names, completion)) = backfill_columns(&change) {
                            let marks = marks_of(&change);
                            let mut expected_ignored = Vec::new();
                            for name in names {
                                let Some(own) = progress_of(&before, &relation.name, name) else {
                                    prop_assert_eq!(progress_of(&s, &relation.name, name), None);
                                    continue;
                                };
                                let after = progress_of(&s, &relation.name, name);
                                match accept_backfill(own.as_ref(), marks) {
                                    Verdict::Ignore => {
                                        expected_ignored.push(
                                            format!("public.{}.{}", relation.name, name));
                                        prop_assert_eq!(after, Some(own));
                                    }
                                    Verdict::Accept(_) if completion => {
                                        prop_assert_eq!(after, None);
                                    }
                                    Verdict::Accept(progress) => {
                                        // A continuation never moves a timeline backwards.
                                        let continuation = marks.is_some_and(|m| m.previous.is_some());
                                        if let (true, Some(old), Some(new)) =
                                            (continuation, own.as_ref(), progress.as_ref())
                                        {
                                            if old.timeline == new.timeline {
                                                prop_assert!(new.progress_mark >= old.progress_mark);
                                            }
                                        }
                                        prop_assert_eq!(after, Some(progress));
                                    }
                                }
                            }
                            // Ignored columns are exactly those the policy rejects.
                            prop_assert_eq!(ignored, expected_ignored);
                        } else {
                            prop_assert!(ignored.is_empty());
                        }
                        if matches!(change, Change::Insert(_)) {
                            prop_assert_eq!(&s, &before);
                        }
                        if !s.in_transaction() {
                            committed = working(&s);
                        }
                    }
                }

                // `requests()` is the state as of the last commit.
                prop_assert_eq!(s.requests(), committed.clone());
                // No table is kept without pending columns.
                prop_assert!(working(&s).iter().all(|r| !r.columns.is_empty()));
                prop_assert!(s.requests().iter().all(|r| !r.columns.is_empty()));
            }
        }
    }
}
