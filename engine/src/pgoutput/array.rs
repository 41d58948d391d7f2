//! Postgres array text output (`{1,2,NULL}`, `{{"a b","c\"d"},{e,f}}`, `[0:1]={x,y}`) to JSON
//! arrays, converting each element with the element type's converter.

use std::borrow::Cow;

use serde_json::Value;

/// Postgres arrays have at most six dimensions (`MAXDIM`); deeper input is rejected, which also
/// bounds recursion on hostile text.
const MAX_DIMENSIONS: usize = 6;

/// Why an array literal was rejected: what the parser expected at which byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ArrayError<E> {
    Syntax {
        expected: &'static str,
        offset: usize,
    },
    Element(E),
}

/// Parses `text` as an array literal with `,` delimiters; unquoted `NULL` is a null element.
pub(super) fn parse_array<E>(
    text: &str,
    element: &mut dyn FnMut(&str) -> Result<Value, E>,
) -> Result<Value, ArrayError<E>> {
    let mut parser = Parser {
        s: text.as_bytes(),
        text,
        pos: 0,
    };
    // Non-default lower bounds are printed as a dimension decoration: `[2:3]={…}`.
    if parser.peek() == Some(b'[') {
        let equals = text
            .find('=')
            .ok_or(parser.error("'=' after the dimensions"))?;
        parser.pos = equals + 1;
    }
    parser.skip_space();
    let value = parser.array(1, element)?;
    parser.skip_space();
    if parser.pos != parser.s.len() {
        return Err(parser.error("the end of the array"));
    }
    Ok(value)
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn error<E>(&self, expected: &'static str) -> ArrayError<E> {
        ArrayError::Syntax {
            expected,
            offset: self.pos,
        }
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_whitespace()) {
            self.pos += 1;
        }
    }

    fn array<E>(
        &mut self,
        depth: usize,
        element: &mut dyn FnMut(&str) -> Result<Value, E>,
    ) -> Result<Value, ArrayError<E>> {
        if depth > MAX_DIMENSIONS {
            return Err(self.error("at most six array dimensions"));
        }
        if self.peek() != Some(b'{') {
            return Err(self.error("'{'"));
        }
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_space();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.skip_space();
            let item = match self.peek() {
                Some(b'{') => self.array(depth + 1, element)?,
                Some(b'"') => {
                    let text = self.quoted()?;
                    element(&text).map_err(ArrayError::Element)?
                }
                _ => match self.unquoted()? {
                    None => Value::Null,
                    Some(text) => element(&text).map_err(ArrayError::Element)?,
                },
            };
            items.push(item);
            self.skip_space();
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Ok(Value::Array(items));
                }
                _ => return Err(self.error("',' or '}' after an array element")),
            }
        }
    }

    /// A double-quoted element; `\` escapes the next character.
    fn quoted<E>(&mut self) -> Result<Cow<'a, str>, ArrayError<E>> {
        self.pos += 1;
        let start = self.pos;
        let mut owned: Option<String> = None;
        let mut chunk_start = start;
        loop {
            match self.peek() {
                None => return Err(self.error("a closing '\"'")),
                Some(b'"') => {
                    let tail = &self.text[chunk_start..self.pos];
                    self.pos += 1;
                    return Ok(match owned {
                        None => Cow::Borrowed(tail),
                        Some(mut s) => {
                            s.push_str(tail);
                            Cow::Owned(s)
                        }
                    });
                }
                Some(b'\\') => {
                    let s = owned.get_or_insert_with(String::new);
                    s.push_str(&self.text[chunk_start..self.pos]);
                    self.pos += 1;
                    chunk_start = self.pos;
                    self.skip_escaped()?;
                }
                Some(_) => self.pos += 1,
            }
        }
    }

    /// Steps over the (possibly multi-byte) character after a backslash, keeping it in the
    /// current chunk.
    fn skip_escaped<E>(&mut self) -> Result<(), ArrayError<E>> {
        let ch = self.text[self.pos..]
            .chars()
            .next()
            .ok_or(self.error("a character after '\\'"))?;
        self.pos += ch.len_utf8();
        Ok(())
    }

    /// An unquoted element up to `,` or `}`, trailing spaces trimmed; `None` for `NULL`.
    fn unquoted<E>(&mut self) -> Result<Option<Cow<'a, str>>, ArrayError<E>> {
        let mut owned: Option<String> = None;
        let mut chunk_start = self.pos;
        let mut escaped = false;
        loop {
            match self.peek() {
                None => return Err(self.error("',' or '}' after an array element")),
                Some(b',' | b'}') => break,
                Some(b'{' | b'"') => {
                    return Err(self.error("no '{' or '\"' inside an unquoted element"))
                }
                Some(b'\\') => {
                    escaped = true;
                    let s = owned.get_or_insert_with(String::new);
                    s.push_str(&self.text[chunk_start..self.pos]);
                    self.pos += 1;
                    chunk_start = self.pos;
                    self.skip_escaped()?;
                }
                Some(_) => self.pos += 1,
            }
        }
        let tail = &self.text[chunk_start..self.pos];
        let text = match owned {
            None => Cow::Borrowed(tail.trim_end()),
            Some(mut s) => {
                s.push_str(tail.trim_end());
                Cow::Owned(s)
            }
        };
        if text.is_empty() {
            return Err(self.error("an array element"));
        }
        if !escaped && text.eq_ignore_ascii_case("NULL") {
            return Ok(None);
        }
        Ok(Some(text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn strings(text: &str) -> Result<Value, ArrayError<()>> {
        parse_array(text, &mut |s| Ok(Value::String(s.to_owned())))
    }

    fn ints(text: &str) -> Result<Value, ArrayError<()>> {
        parse_array(text, &mut |s| {
            s.parse::<i64>().map(Value::from).map_err(|_| ())
        })
    }

    #[test]
    fn flat_arrays_with_nulls() {
        assert_eq!(ints("{1,2,3}").unwrap(), json!([1, 2, 3]));
        assert_eq!(ints("{}").unwrap(), json!([]));
        assert_eq!(ints("{NULL,-4,null}").unwrap(), json!([null, -4, null]));
    }

    #[test]
    fn quoted_elements_unescape_and_quoted_null_is_a_string() {
        assert_eq!(
            strings(r#"{"a b","c\"d","e\\f",NULL,"NULL","",g}"#).unwrap(),
            json!(["a b", "c\"d", "e\\f", null, "NULL", "", "g"])
        );
        assert_eq!(
            strings(r#"{"{x,y}",é\,z}"#).unwrap(),
            json!(["{x,y}", "é,z"])
        );
        // An escaped NULL is the text NULL.
        assert_eq!(strings(r"{\NULL}").unwrap(), json!(["NULL"]));
    }

    #[test]
    fn multi_dimensional_arrays_nest() {
        assert_eq!(
            ints("{{1,2},{3,NULL}}").unwrap(),
            json!([[1, 2], [3, null]])
        );
        assert_eq!(ints("[0:1][1:1]={{5},{6}}").unwrap(), json!([[5], [6]]));
        assert_eq!(ints("{{{{{{1}}}}}}").unwrap(), json!([[[[[[1]]]]]]));
        assert!(ints("{{{{{{{1}}}}}}}").is_err());
    }

    #[test]
    fn malformed_literals_are_rejected() {
        for bad in [
            "",
            "1,2",
            "{1,2",
            "{1,,2}",
            "{1}x",
            r#"{"a}"#,
            "{a\"b}",
            "{1,}",
            "[1:2]{1,2}",
            "{\\",
        ] {
            assert!(
                matches!(strings(bad), Err(ArrayError::Syntax { .. })),
                "{bad:?} was accepted"
            );
        }
        assert_eq!(ints("{1,x}"), Err(ArrayError::Element(())));
    }

    proptest! {
        #[test]
        fn quoted_strings_round_trip(items in proptest::collection::vec(proptest::option::of(".{0,8}"), 0..6)) {
            let literal = format!(
                "{{{}}}",
                items
                    .iter()
                    .map(|item| match item {
                        None => "NULL".to_owned(),
                        Some(s) => format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\"")),
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            );
            let expected = Value::Array(items.iter().map(|i| i.clone().map_or(Value::Null, Value::String)).collect());
            prop_assert_eq!(strings(&literal).unwrap(), expected);
        }

        #[test]
        fn arbitrary_text_never_panics(text in "[{}\",\\\\a-c NULé\\[\\]:=0-9]{0,40}") {
            let _ = strings(&text);
        }
    }
}
