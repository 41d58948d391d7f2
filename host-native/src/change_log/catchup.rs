//! Reading the change log for a subscriber's catch-up (`docs/protocol/change-stream.md`,
//! "Catch-up"): rows with `from <= watermark <= through` in `(watermark, pos)` order, from one
//! read snapshot, handed out in bounded batches so a long log never sits in memory at once.

#[cfg(test)]
use std::ops::ControlFlow;
use std::path::Path;
use std::time::Duration;

use highwater_engine::streamer::CatchupRow;
use highwater_engine::watermark::Watermark;
use rusqlite::{params, Connection, OpenFlags};

use super::ChangeLogError;

/// Zero's catch-up cursor batch: 2000 rows.
pub(crate) const DEFAULT_CATCHUP_BATCH_ROWS: usize = 2000;
/// A batch also ends once its stored changes reach this many bytes.
pub(crate) const DEFAULT_CATCHUP_BATCH_BYTES: usize = 1024 * 1024;

/// One batch of a catch-up read: the rows after `(?1, ?2)` up to the commit `?3`. The lower
/// bound is the row value alone, so SQLite seeks the primary key to the cursor. With a
/// separate `"watermark" >= from` beside it, SQLite ranged the key from `from` and filtered
/// the row value row by row: every batch read the log again from the start of the catch-up,
/// and a subscriber 1,000,000 changes behind caught up at 42,000 rows/s instead of 500,000.
const CATCHUP_BATCH_SQL: &str = r#"SELECT "watermark", "tag", "change", "pos" FROM "_hw_change_log"
   WHERE ("watermark", "pos") > (?1, ?2) AND "watermark" <= ?3
   ORDER BY "watermark", "pos""#;

/// How big one batch of catch-up rows may get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CatchupLimits {
    pub rows: usize,
    pub bytes: usize,
}

impl Default for CatchupLimits {
    fn default() -> Self {
        CatchupLimits {
            rows: DEFAULT_CATCHUP_BATCH_ROWS,
            bytes: DEFAULT_CATCHUP_BATCH_BYTES,
        }
    }
}

/// A read connection to the database holding the change log.
pub(crate) struct CatchupReader {
    conn: Connection,
}

impl CatchupReader {
    /// Opens its own connection to `path`; in WAL mode it reads beside the writer.
    pub(crate) fn open(path: &Path) -> Result<CatchupReader, ChangeLogError> {
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(Duration::from_secs(30))?;
        Ok(CatchupReader { conn })
    }

    #[cfg(test)]
    pub(crate) fn from_connection(conn: Connection) -> CatchupReader {
        CatchupReader { conn }
    }

    /// Streams the rows of transactions `from ..= through` to `sink` in batches of at most
    /// `limits`, from one snapshot (later commits and purges do not show). `sink` may stop the
    /// read early with `Break`. Returns the number of rows handed out.
    #[cfg(test)]
    pub(crate) fn read(
        &mut self,
        from: &Watermark,
        through: &Watermark,
        limits: CatchupLimits,
        mut sink: impl FnMut(Vec<CatchupRow>) -> ControlFlow<()>,
    ) -> Result<u64, ChangeLogError> {
        let tx = self.conn.transaction()?;
        let mut total = 0;
        {
            let mut stmt = tx.prepare_cached(
                r#"SELECT "watermark", "tag", "change" FROM "_hw_change_log"
                   WHERE "watermark" >= ?1 AND "watermark" <= ?2
                   ORDER BY "watermark", "pos""#,
            )?;
            let mut rows = stmt.query(params![from.as_str(), through.as_str()])?;
            let mut batch = Vec::new();
            let mut bytes = 0;
            while let Some(row) = rows.next()? {
                let change: String = row.get(2)?;
                bytes += change.len();
                batch.push(CatchupRow::new(
                    Watermark::parse(&row.get::<_, String>(0)?)?,
                    row.get::<_, String>(1)?,
                    change,
                ));
                total += 1;
                if batch.len() >= limits.rows.max(1) || bytes >= limits.bytes {
                    bytes = 0;
                    if sink(std::mem::take(&mut batch)).is_break() {
                        return Ok(total);
                    }
                }
            }
            if !batch.is_empty() {
                // The last batch; whether the sink wants more no longer matters.
                let _ = sink(batch);
            }
        }
        tx.commit()?;
        Ok(total)
    }

    /// Reads the next batch of rows of transactions `from ..= through`, after `after` (from
    /// the start when `None`), in a read transaction of its own that ends before it returns:
    /// nothing is held between batches, so a subscriber that is slow to take them holds up
    /// neither checkpoints nor the writer. (Rows the subscriber still needs are not purged in
    /// between: its acked watermark bounds the purge.) `next` is where the read goes on, when
    /// the batch ended at a limit.
    pub(crate) fn read_batch(
        &mut self,
        from: &Watermark,
        through: &Watermark,
        after: Option<&CatchupCursor>,
        limits: CatchupLimits,
    ) -> Result<CatchupBatch, ChangeLogError> {
        let tx = self.conn.transaction()?;
        let mut batch = CatchupBatch {
            rows: Vec::new(),
            next: None,
        };
        {
            let mut stmt = tx.prepare_cached(CATCHUP_BATCH_SQL)?;
            // The first batch starts at `from` (every `pos` is above `i64::MIN`); the next ones
            // just after the cursor, which is never before `from`.
            let (after_watermark, after_pos) = match after {
                Some(cursor) => (cursor.watermark.as_str(), cursor.pos),
                None => (from.as_str(), i64::MIN),
            };
            let mut rows = stmt.query(params![after_watermark, after_pos, through.as_str()])?;
            let mut bytes = 0;
            while let Some(row) = rows.next()? {
                let watermark: String = row.get(0)?;
                let change: String = row.get(2)?;
                let pos: i64 = row.get(3)?;
                bytes += change.len();
                batch.rows.push(CatchupRow::new(
                    Watermark::parse(&watermark)?,
                    row.get::<_, String>(1)?,
                    change,
                ));
                if batch.rows.len() >= limits.rows.max(1) || bytes >= limits.bytes {
                    batch.next = Some(CatchupCursor { watermark, pos });
                    break;
                }
            }
        }
        tx.commit()?;
        Ok(batch)
    }
}

/// Where a batched catch-up read goes on: just after this row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CatchupCursor {
    watermark: String,
    pos: i64,
}

/// One batch of a catch-up read.
#[derive(Debug)]
pub(crate) struct CatchupBatch {
    pub rows: Vec<CatchupRow>,
    /// Where the next batch starts; `None` when this one was the last.
    pub next: Option<CatchupCursor>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by `bench fanout`'s catch-up: each batch must start where the last one ended,
    /// not be found again by reading from the start of the catch-up.
    #[test]
    fn a_batch_seeks_to_its_cursor() {
        let conn = Connection::open_in_memory().expect("open");
        conn.execute_batch(super::super::SCHEMA_SQL)
            .expect("schema");
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {CATCHUP_BATCH_SQL}"))
            .expect("plan")
            .query_map(params!["0a", 0, "0b"], |row| row.get::<_, String>(3))
            .expect("plan rows")
            .collect::<Result<_, _>>()
            .expect("plan text");
        assert!(
            plan.iter().any(|step| step.contains("(watermark,pos)>")),
            "expected a search from the cursor, found {plan:?}"
        );
    }
}
