//! Row changes whose values stay as Postgres wrote them: what a store that takes values as they
//! are (a SQLite replica) needs from an insert, update or delete, without a JSON row per change.
//!
//! [`PgoutputMapper::keep_row_text`](super::PgoutputMapper::keep_row_text) maps Insert, Update
//! and Delete messages to [`TextRowChange`]s instead of change-stream `data` messages. The rules
//! are the same as for JSON rows: the same columns are present (unchanged TOAST values taken from
//! the old tuple where it has them, left out otherwise), every value is checked the same way and
//! fails with the same [`MappingError`](super::MappingError), and [`TextRowChange::to_change`]
//! gives exactly the change-stream change the JSON path would have made. A row keeps all its
//! texts in one string, so a row costs two allocations, not one per column name and value.
//!
//! `replicate` takes row changes in this form (its session keeps row text) and binds each value
//! from its text; `serve` keeps JSON rows, since its change stream carries them. The property
//! test `text_rows_are_the_json_rows` (`mapper.rs`) checks that both forms give the same change
//! for any row, and the replica's `text_rows_store_what_json_rows_store` that they store the
//! same row.

use std::sync::Arc;

use serde_json::Value;

use super::value::ScalarText;
use crate::change_stream::{self, Change, Row};

/// One row change of a pgoutput stream, its values kept as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextRowChange {
    /// The change-stream relation (schema, name, row key), shared by the relation's changes.
    pub relation: Arc<change_stream::Relation>,
    /// The relation's column names in Postgres' order, shared by the relation's changes.
    pub columns: Arc<[String]>,
    pub kind: TextRowKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextRowKind {
    Insert {
        new: TextRow,
    },
    /// `key`: the old key (the whole old row under replica identity FULL) when Postgres sent
    /// one, i.e. when the key changed or the identity is FULL.
    Update {
        key: Option<TextRow>,
        new: TextRow,
    },
    Delete {
        key: TextRow,
    },
}

/// The present columns of one tuple, in column order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextRow {
    /// Every text value of the row, one after the other.
    text: String,
    cells: Vec<Cell>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Cell {
    /// The column's position in the relation.
    column: u16,
    value: CellValue,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum CellValue {
    Null,
    Bool(bool),
    /// `text[start..end]` as a JSON string.
    String(u32, u32),
    /// `text[start..end]` as a JSON number with that text.
    Number(u32, u32),
    Integer(i64),
    Micros(i128),
    /// A value that takes more than a look at its text (arrays, a float re-rendered for JSON).
    Json(Value),
}

/// One value of a [`TextRow`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TextValue<'a> {
    Scalar(ScalarText<'a>),
    Json(&'a Value),
}

impl TextValue<'_> {
    /// The JSON value the change-stream row has for this column.
    pub fn to_value(&self) -> Value {
        match self {
            TextValue::Scalar(scalar) => scalar.to_value(),
            TextValue::Json(value) => (*value).clone(),
        }
    }
}

impl TextRow {
    pub(super) fn with_capacity(columns: usize, text: usize) -> TextRow {
        TextRow {
            text: String::with_capacity(text),
            cells: Vec::with_capacity(columns),
        }
    }

    pub(super) fn push_scalar(&mut self, column: u16, value: ScalarText<'_>) {
        let value = match value {
            ScalarText::Null => CellValue::Null,
            ScalarText::Bool(b) => CellValue::Bool(b),
            ScalarText::Integer(n) => CellValue::Integer(n),
            ScalarText::Micros(micros) => CellValue::Micros(micros),
            ScalarText::String(text) => {
                let (start, end) = self.push_text(text);
                CellValue::String(start, end)
            }
            ScalarText::Number(text) => {
                let (start, end) = self.push_text(text);
                CellValue::Number(start, end)
            }
        };
        self.cells.push(Cell { column, value });
    }

    pub(super) fn push_json(&mut self, column: u16, value: Value) {
        let value = match value {
            Value::Null => CellValue::Null,
            value => CellValue::Json(value),
        };
        self.cells.push(Cell { column, value });
    }

    fn push_text(&mut self, text: &str) -> (u32, u32) {
        // A tuple comes from one pgoutput message, whose length Postgres sends as a 32-bit
        // integer; a longer one saturates, and `slice` then yields "" rather than panicking.
        let start = u32::try_from(self.text.len()).unwrap_or(u32::MAX);
        self.text.push_str(text);
        let end = u32::try_from(self.text.len()).unwrap_or(u32::MAX);
        (start, end)
    }

    fn slice(&self, start: u32, end: u32) -> &str {
        self.text
            .get(start as usize..end as usize)
            .unwrap_or_default()
    }

    /// The present columns (their position in the relation) and values, in column order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, TextValue<'_>)> {
        self.cells
            .iter()
            .map(|cell| (usize::from(cell.column), self.value(&cell.value)))
    }

    /// The value of the column at `position`, if present.
    pub fn get(&self, position: usize) -> Option<TextValue<'_>> {
        self.cells
            .iter()
            .find(|cell| usize::from(cell.column) == position)
            .map(|cell| self.value(&cell.value))
    }

    fn value<'a>(&'a self, value: &'a CellValue) -> TextValue<'a> {
        TextValue::Scalar(match *value {
            CellValue::Null => ScalarText::Null,
            CellValue::Bool(b) => ScalarText::Bool(b),
            CellValue::String(start, end) => ScalarText::String(self.slice(start, end)),
            CellValue::Number(start, end) => ScalarText::Number(self.slice(start, end)),
            CellValue::Integer(n) => ScalarText::Integer(n),
            CellValue::Micros(micros) => ScalarText::Micros(micros),
            CellValue::Json(ref value) => return TextValue::Json(value),
        })
    }

    /// The change-stream row: column names of `columns` to JSON values.
    pub fn to_row(&self, columns: &[String]) -> Row {
        let mut row = Row::with_capacity(self.cells.len());
        for (position, value) in self.iter() {
            if let Some(name) = columns.get(position) {
                row.insert(name.clone(), value.to_value());
            }
        }
        row
    }
}

impl TextRowChange {
    /// The change-stream change the JSON path makes of the same message.
    pub fn to_change(&self) -> Change {
        let relation = self.relation.clone();
        let row = |row: &TextRow| row.to_row(&self.columns);
        match &self.kind {
            TextRowKind::Insert { new } => Change::Insert(change_stream::Insert {
                relation,
                new: row(new),
                extra: Default::default(),
            }),
            TextRowKind::Update { key, new } => Change::Update(change_stream::Update {
                relation,
                key: key.as_ref().map(row),
                new: row(new),
                extra: Default::default(),
            }),
            TextRowKind::Delete { key } => Change::Delete(change_stream::Delete {
                relation,
                key: row(key),
                extra: Default::default(),
            }),
        }
    }

    /// The wire tag of the change, e.g. `"insert"`.
    pub fn tag(&self) -> &'static str {
        match self.kind {
            TextRowKind::Insert { .. } => "insert",
            TextRowKind::Update { .. } => "update",
            TextRowKind::Delete { .. } => "delete",
        }
    }
}
