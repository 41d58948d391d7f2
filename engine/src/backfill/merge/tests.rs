use super::*;

fn w(text: &str) -> Watermark {
    Watermark::parse(text).expect("a watermark")
}

/// `id` (the key, backfilling only for a whole table), `title` (not backfilling) and the
/// backfilling `due` and `tags`.
fn values(whole_table: bool) -> Vec<BackfilledValue<'static>> {
    let value = |column, in_key, awaits_backfill| BackfilledValue {
        column,
        in_key,
        awaits_backfill,
    };
    vec![
        value("id", true, whole_table),
        value("title", false, whole_table),
        value("due", false, true),
        value("tags", false, true),
    ]
}

fn merge(update: Vec<usize>, insert: Option<RowVersion>) -> RowMerge {
    RowMerge::Merge {
        update,
        version: RowVersion::Later,
        insert,
    }
}

#[test]
fn a_held_row_takes_its_backfilling_columns_but_not_its_key_and_keeps_the_later_version() {
    let snapshot = w("0b");
    let columns = BackfillMerge::new(&snapshot, false, None).expect("rows to merge");
    assert_eq!(
        columns.row(&values(false), None, &[]),
        merge(vec![2, 3], None)
    );
    // A table new to the replica: every value but the key, and a row it lacks is inserted at
    // the snapshot's version.
    let table = BackfillMerge::new(&snapshot, true, None).expect("rows to merge");
    assert_eq!(
        table.row(&values(true), None, &[]),
        merge(vec![1, 2, 3], Some(RowVersion::Snapshot))
    );
    // Nothing backfilling but the key: nothing to write, only to insert if missing.
    let key_only = [BackfilledValue {
        column: "id",
        in_key: true,
        awaits_backfill: true,
    }];
    assert_eq!(
        table.row(&key_only, None, &[]),
        merge(vec![], Some(RowVersion::Snapshot))
    );
}

#[test]
fn a_row_deleted_after_the_snapshot_stays_deleted() {
    let snapshot = w("0b");
    let merge_rows = BackfillMerge::new(&snapshot, true, None).expect("rows to merge");
    assert_eq!(
        merge_rows.row(&values(true), Some(&w("0c")), &[]),
        RowMerge::Skip
    );
    // Deleted at or before the snapshot (re-inserted since, or the snapshot would not hold
    // it): the backfill's values stand.
    for deleted in ["0a", "0b"] {
        assert_eq!(
            merge_rows.row(&values(true), Some(&w(deleted)), &[]),
            merge(vec![1, 2, 3], Some(RowVersion::Snapshot)),
            "{deleted}"
        );
    }
}

#[test]
fn a_column_the_stream_wrote_after_the_snapshot_keeps_the_streamed_value() {
    let snapshot = w("0b");
    let merge_rows = BackfillMerge::new(&snapshot, false, None).expect("rows to merge");
    let written = [("due".to_owned(), w("0c")), ("tags".to_owned(), w("0b"))];
    assert_eq!(
        merge_rows.row(&values(false), None, &written),
        merge(vec![3], None)
    );
    let later = [("due".to_owned(), w("0b.01")), ("tags".to_owned(), w("0c"))];
    assert_eq!(
        merge_rows.row(&values(false), None, &later),
        merge(vec![], None)
    );
}

#[test]
fn a_table_truncated_after_the_snapshot_takes_nothing() {
    let snapshot = w("0b");
    assert!(BackfillMerge::new(&snapshot, true, Some(&w("0c"))).is_none());
    assert!(BackfillMerge::new(&snapshot, true, Some(&w("0b"))).is_some());
    assert!(BackfillMerge::new(&snapshot, false, Some(&w("0a"))).is_some());
}

#[test]
fn the_backfill_yields_only_to_writes_after_its_snapshot() {
    let snapshot = w("0b.01");
    let merge_rows = BackfillMerge::new(&snapshot, false, None).expect("rows to merge");
    assert!(merge_rows.yields_to(&w("0b.02")));
    assert!(merge_rows.yields_to(&w("0c")));
    assert!(!merge_rows.yields_to(&w("0b.01")));
    assert!(!merge_rows.yields_to(&w("0b")));
}
