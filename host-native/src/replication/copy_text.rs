//! Postgres `COPY … TO STDOUT` text format: rows split across arbitrary chunks, tab-separated
//! fields, `\N` for NULL, backslash escapes (<https://www.postgresql.org/docs/current/sql-copy.html>).

/// A malformed COPY text row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyTextError {
    #[error("expected {expected} fields in COPY row {row}, got {actual}")]
    FieldCount {
        row: u64,
        expected: usize,
        actual: usize,
    },
    #[error("expected UTF-8 text in field {field} of COPY row {row}")]
    NotUtf8 { row: u64, field: usize },
    #[error("COPY data ended in the middle of a row ({bytes} bytes without a newline)")]
    UnterminatedRow { bytes: usize },
}

/// Reassembles rows from COPY data chunks; holds at most one partial row between chunks.
pub(crate) struct CopyRows {
    columns: usize,
    partial: Vec<u8>,
    rows: u64,
    /// The current row's unescaped fields, end to end, and each one's span in it (`None`:
    /// NULL); reused from row to row.
    text: String,
    spans: Vec<Option<(usize, usize)>>,
}

/// One row's fields, borrowed from the parser until the next row.
#[derive(Clone, Copy)]
pub(crate) struct CopyRow<'a> {
    text: &'a str,
    spans: &'a [Option<(usize, usize)>],
}

impl<'a> CopyRow<'a> {
    /// Field `i`: `None` for NULL (and past the last field).
    pub(crate) fn get(&self, i: usize) -> Option<&'a str> {
        let (start, end) = (*self.spans.get(i)?)?;
        self.text.get(start..end)
    }

    pub(crate) fn len(&self) -> usize {
        self.spans.len()
    }

    pub(crate) fn to_owned_fields(self) -> Vec<Option<String>> {
        (0..self.len())
            .map(|i| self.get(i).map(str::to_owned))
            .collect()
    }
}

impl CopyRows {
    pub(crate) fn new(columns: usize) -> CopyRows {
        CopyRows {
            columns,
            partial: Vec::new(),
            rows: 0,
            text: String::new(),
            spans: Vec::with_capacity(columns),
        }
    }

    /// Feeds one chunk; `on_row` gets every row completed by it, as owned fields.
    pub(crate) fn push<E: From<CopyTextError>>(
        &mut self,
        chunk: &[u8],
        mut on_row: impl FnMut(Vec<Option<String>>) -> Result<(), E>,
    ) -> Result<(), E> {
        self.push_rows(chunk, |row| on_row(row.to_owned_fields()))
    }

    /// Feeds one chunk; `on_row` gets every row completed by it, borrowed: no allocation per
    /// row or field.
    pub(crate) fn push_rows<E: From<CopyTextError>>(
        &mut self,
        chunk: &[u8],
        mut on_row: impl FnMut(CopyRow<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut rest = chunk;
        while let Some(end) = memchr::memchr(b'\n', rest) {
            if self.partial.is_empty() {
                self.parse(&rest[..end])?;
            } else {
                self.partial.extend_from_slice(&rest[..end]);
                let line = std::mem::take(&mut self.partial);
                let parsed = self.parse(&line);
                // Keep the buffer's allocation for the next partial row.
                self.partial = line;
                self.partial.clear();
                parsed?;
            }
            on_row(CopyRow {
                text: &self.text,
                spans: &self.spans,
            })?;
            rest = &rest[end + 1..];
        }
        self.partial.extend_from_slice(rest);
        Ok(())
    }

    /// Checks that the data did not stop inside a row.
    pub(crate) fn finish(&self) -> Result<(), CopyTextError> {
        if self.partial.is_empty() {
            Ok(())
        } else {
            Err(CopyTextError::UnterminatedRow {
                bytes: self.partial.len(),
            })
        }
    }

    /// Parses `line` into `text` and `spans`.
    fn parse(&mut self, line: &[u8]) -> Result<(), CopyTextError> {
        self.rows += 1;
        let row = self.rows;
        self.spans.clear();
        let mut bytes = std::mem::take(&mut self.text).into_bytes();
        bytes.clear();
        // A zero-column row is an empty line, not one empty field.
        if self.columns > 0 || !line.is_empty() {
            let mut start = 0;
            for end in memchr::memchr_iter(b'\t', line).chain(std::iter::once(line.len())) {
                let raw = &line[start..end];
                start = end + 1;
                if raw == b"\\N" {
                    self.spans.push(None);
                    continue;
                }
                let from = bytes.len();
                unescape(raw, &mut bytes);
                self.spans.push(Some((from, bytes.len())));
            }
        }
        if self.spans.len() != self.columns {
            return Err(CopyTextError::FieldCount {
                row,
                expected: self.columns,
                actual: self.spans.len(),
            });
        }
        // One check for the whole row, then each field must start and end on a character
        // boundary of it: two invalid halves in adjacent fields can make a valid whole.
        let not_utf8 = |field| CopyTextError::NotUtf8 { row, field };
        let text = match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => {
                let bytes = e.as_bytes();
                let field = self.spans.iter().position(|span| {
                    span.is_some_and(|(s, e)| std::str::from_utf8(&bytes[s..e]).is_err())
                });
                return Err(not_utf8(field.unwrap_or(0)));
            }
        };
        let split = self.spans.iter().position(|span| {
            span.is_some_and(|(s, e)| !text.is_char_boundary(s) || !text.is_char_boundary(e))
        });
        self.text = text;
        match split {
            Some(field) => Err(not_utf8(field)),
            None => Ok(()),
        }
    }
}

/// Appends the COPY text field `raw` to `out`, escapes decoded.
fn unescape(raw: &[u8], out: &mut Vec<u8>) {
    if memchr::memchr(b'\\', raw).is_none() {
        out.extend_from_slice(raw);
        return;
    }
    let mut i = 0;
    while i < raw.len() {
        let b = raw[i];
        i += 1;
        if b != b'\\' || i == raw.len() {
            out.push(b);
            continue;
        }
        let c = raw[i];
        i += 1;
        match c {
            b'b' => out.push(0x08),
            b'f' => out.push(0x0c),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'v' => out.push(0x0b),
            b'0'..=b'7' => {
                let mut value = u32::from(c - b'0');
                for _ in 0..2 {
                    match raw.get(i) {
                        Some(&d @ b'0'..=b'7') => {
                            value = value * 8 + u32::from(d - b'0');
                            i += 1;
                        }
                        _ => break,
                    }
                }
                out.push((value & 0xff) as u8);
            }
            b'x' if raw.get(i).is_some_and(u8::is_ascii_hexdigit) => {
                let mut value = 0u8;
                for _ in 0..2 {
                    match raw.get(i).and_then(|d| (*d as char).to_digit(16)) {
                        Some(d) => {
                            value = value * 16 + d as u8;
                            i += 1;
                        }
                        None => break,
                    }
                }
                out.push(value);
            }
            other => out.push(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse_all(
        columns: usize,
        chunks: &[&[u8]],
    ) -> Result<Vec<Vec<Option<String>>>, CopyTextError> {
        let mut rows = Vec::new();
        let mut copy = CopyRows::new(columns);
        for chunk in chunks {
            copy.push(chunk, |row| {
                rows.push(row);
                Ok::<_, CopyTextError>(())
            })?;
        }
        copy.finish()?;
        Ok(rows)
    }

    /// What Postgres writes for a text value.
    fn escape(value: &str) -> String {
        let mut out = String::new();
        for c in value.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                '\u{b}' => out.push_str("\\v"),
                c => out.push(c),
            }
        }
        out
    }

    #[test]
    fn fields_nulls_and_escapes_decode() {
        let rows = parse_all(3, &[b"1\t\\N\ta\\tb\\nc\\\\d\n2\t\\101\\x42\\u\t\n"]).unwrap();
        assert_eq!(
            rows,
            vec![
                vec![Some("1".into()), None, Some("a\tb\nc\\d".into())],
                vec![Some("2".into()), Some("ABu".into()), Some(String::new())],
            ]
        );
    }

    #[test]
    fn octal_escapes_can_spell_multibyte_utf8() {
        // é is C3 A9.
        let rows = parse_all(1, &[b"\\303\\251\n"]).unwrap();
        assert_eq!(rows, vec![vec![Some("é".into())]]);
    }

    #[test]
    fn wrong_field_counts_and_cut_rows_are_errors() {
        assert_eq!(
            parse_all(2, &[b"1\n"]),
            Err(CopyTextError::FieldCount {
                row: 1,
                expected: 2,
                actual: 1
            })
        );
        assert_eq!(
            parse_all(1, &[b"1\n2"]),
            Err(CopyTextError::UnterminatedRow { bytes: 1 })
        );
        assert!(matches!(
            parse_all(1, &[b"\\377\n"]),
            Err(CopyTextError::NotUtf8 { .. })
        ));
        // The two bytes of é, one in each field: valid together, neither on its own.
        assert_eq!(
            parse_all(3, &[b"a\t\\303\t\\251\n"]),
            Err(CopyTextError::NotUtf8 { row: 1, field: 1 })
        );
        assert_eq!(
            parse_all(2, &[b"ok\t\\303\n"]),
            Err(CopyTextError::NotUtf8 { row: 1, field: 1 })
        );
    }

    proptest! {
        /// Any values, escaped as Postgres does and cut into any chunks, come back unchanged.
        #[test]
        fn rows_survive_any_chunking(
            rows in proptest::collection::vec(
                proptest::collection::vec(proptest::option::of(".*"), 3), 0..8),
            cuts in proptest::collection::vec(0usize..400, 0..6),
        ) {
            let mut data = String::new();
            for row in &rows {
                let fields: Vec<String> = row
                    .iter()
                    .map(|f| f.as_deref().map_or("\\N".to_owned(), escape))
                    .collect();
                data.push_str(&fields.join("\t"));
                data.push('\n');
            }
            let bytes = data.as_bytes();
            let mut points: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            points.sort_unstable();
            let mut chunks = Vec::new();
            let mut start = 0;
            for p in points {
                chunks.push(&bytes[start..p]);
                start = p;
            }
            chunks.push(&bytes[start..]);
            prop_assert_eq!(parse_all(3, &chunks).unwrap(), rows);
        }
    }
}
