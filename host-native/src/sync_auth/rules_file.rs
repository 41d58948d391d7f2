//! The sync rules file (`--sync-rules FILE`), in JSON or YAML.
//!
//! Both forms become the JSON value [`SyncRules::from_value`] checks, so they take the same
//! checks and messages. YAML is read from the parser's events (not through a generic loader)
//! so that what a JSON value cannot hold is refused at its line rather than passed on changed:
//! a key that is not a string, a key twice in one map, a tag other than the core schema's
//! (`!!str`, `!!int`, `!!float`, `!!bool`, `!!null`, `!!map`, `!!seq`), a number that is not
//! finite, a second document. Anchors and aliases are expanded. A rule refused in a YAML file
//! also names the line its path starts on.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use highwater_engine::scope_sync::rules::{RulesError, SyncRules};
use saphyr::Scalar;
use saphyr_parser::{Event, Marker, Parser, ScalarStyle, Span, SpannedEventReceiver, Tag};
use serde_json::{Map, Number, Value};

/// What the engine's paths call the whole file (`the rules.<unknown key>`).
const ROOT: &str = "the rules";
/// Rules nest five levels deep; far deeper is a mistake or an attack on the stack.
const MAX_DEPTH: usize = 64;
/// Values that aliases may expand to in one file, all aliases together ("billion laughs").
const MAX_ALIAS_VALUES: usize = 100_000;

/// How a rules file is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RulesFormat {
    Json,
    Yaml,
}

impl RulesFormat {
    /// By the file's extension: `.json` is JSON, `.yaml` and `.yml` are YAML. Under any other
    /// name the text is JSON when its first non-blank character is `{`, else YAML (a comment
    /// first makes it YAML too: JSON has none).
    pub(crate) fn of(path: &Path, text: &str) -> Self {
        let extension = path
            .extension()
            .and_then(|extension| extension.to_str())
            .map(str::to_ascii_lowercase);
        match extension.as_deref() {
            Some("json") => Self::Json,
            Some("yaml" | "yml") => Self::Yaml,
            _ if text
                .trim_start_matches(|c: char| c.is_whitespace() || c == '\u{feff}')
                .starts_with('{') =>
            {
                Self::Json
            }
            _ => Self::Yaml,
        }
    }
}

/// Why a rules file's text was refused.
#[derive(Debug, thiserror::Error)]
pub enum RulesFileError {
    /// Not YAML, or YAML a JSON value cannot hold. `column` counts characters from 1.
    #[error("line {line}, column {column}: {reason}")]
    Yaml {
        line: usize,
        column: usize,
        reason: String,
    },
    /// Rules the engine refuses, at the line (of a YAML file) where the refused part starts.
    #[error("at line {line}")]
    RulesAt {
        line: usize,
        #[source]
        source: RulesError,
    },
    /// Rules the engine refuses, named by their path only (JSON, or no line to give).
    #[error(transparent)]
    Rules(#[from] RulesError),
}

/// Parses a rules file's text written as `format`.
pub(crate) fn parse_rules(text: &str, format: RulesFormat) -> Result<SyncRules, RulesFileError> {
    match format {
        RulesFormat::Json => Ok(SyncRules::from_json(text)?),
        RulesFormat::Yaml => {
            let document = read_yaml(text)?;
            SyncRules::from_value(&document.value).map_err(|source| {
                match error_path(&source).and_then(|path| document.lines.get(path)) {
                    Some(&line) => RulesFileError::RulesAt { line, source },
                    None => RulesFileError::Rules(source),
                }
            })
        }
    }
}

/// The place a rules error names, when it names one.
fn error_path(error: &RulesError) -> Option<&str> {
    match error {
        RulesError::WrongType { path, .. }
        | RulesError::UnknownKey { path, .. }
        | RulesError::MissingTables { path }
        | RulesError::BadName { path, .. }
        | RulesError::Duplicate { path, .. }
        | RulesError::OmittedFilter { path, .. }
        | RulesError::RequireNotFilter { path, .. }
        | RulesError::BadFilter { path, .. } => Some(path),
        _ => None,
    }
}

/// A YAML document as a JSON value, and the line each of its paths (as the engine names them:
/// `tables.todos.where`, `tables.todos.filterColumns[1]`) starts on.
struct YamlRules {
    value: Value,
    lines: HashMap<String, usize>,
}

fn read_yaml(text: &str) -> Result<YamlRules, RulesFileError> {
    let mut reader = YamlReader::default();
    let parsed = Parser::new_from_str(text).load(&mut reader, true);
    // The reader's error comes from an event before the one the parser failed on.
    if let Some(error) = reader.error {
        return Err(error);
    }
    if let Err(error) = parsed {
        return Err(refusal(
            *error.marker(),
            format!("not valid YAML: {}", error.info()),
        ));
    }
    Ok(YamlRules {
        value: reader.document.unwrap_or(Value::Null),
        lines: reader.lines,
    })
}

fn refusal(at: Marker, reason: impl Into<String>) -> RulesFileError {
    RulesFileError::Yaml {
        line: at.line(),
        column: at.col() + 1,
        reason: reason.into(),
    }
}

/// Builds the JSON value from the parser's events; stops at the first refusal.
#[derive(Default)]
struct YamlReader {
    /// The sequences and maps being read, outermost first.
    open: Vec<Collection>,
    document: Option<Value>,
    documents: usize,
    anchors: HashMap<usize, Value>,
    alias_values: usize,
    lines: HashMap<String, usize>,
    error: Option<RulesFileError>,
}

struct Collection {
    /// Its anchor id, 0 for none.
    anchor: usize,
    path: String,
    items: Items,
}

enum Items {
    Sequence(Vec<Value>),
    Map {
        entries: Map<String, Value>,
        key_lines: HashMap<String, usize>,
        /// The key read, waiting for its value.
        key: Option<String>,
    },
}

impl<'input> SpannedEventReceiver<'input> for YamlReader {
    fn on_event(&mut self, event: Event<'input>, span: Span) {
        if self.error.is_none() {
            if let Err(error) = self.read(event, span.start) {
                self.error = Some(error);
            }
        }
    }
}

impl YamlReader {
    fn read(&mut self, event: Event<'_>, at: Marker) -> Result<(), RulesFileError> {
        match event {
            Event::DocumentStart(_) => {
                self.documents += 1;
                if self.documents > 1 {
                    return Err(refusal(at, "expected one YAML document, got a second one"));
                }
            }
            Event::Scalar(text, style, anchor, tag) => {
                let value = scalar(text, style, tag.as_ref(), at)?;
                self.node(value, anchor, at)?;
            }
            Event::Alias(id) => {
                let Some(value) = self.anchors.get(&id) else {
                    return Err(refusal(
                        at,
                        "expected an alias of a finished value, got one inside the value it names",
                    ));
                };
                self.alias_values += count_values(value);
                if self.alias_values > MAX_ALIAS_VALUES {
                    return Err(refusal(
                        at,
                        format!("expected aliases to expand to at most {MAX_ALIAS_VALUES} values in all, got more"),
                    ));
                }
                let value = value.clone();
                self.node(value, 0, at)?;
            }
            Event::SequenceStart(anchor, tag) => {
                self.open(anchor, tag.as_deref(), Items::Sequence(Vec::new()), at)?;
            }
            Event::MappingStart(anchor, tag) => {
                let items = Items::Map {
                    entries: Map::new(),
                    key_lines: HashMap::new(),
                    key: None,
                };
                self.open(anchor, tag.as_deref(), items, at)?;
            }
            Event::SequenceEnd | Event::MappingEnd => {
                if let Some(collection) = self.open.pop() {
                    let value = match collection.items {
                        Items::Sequence(items) => Value::Array(items),
                        Items::Map { entries, .. } => Value::Object(entries),
                    };
                    if collection.anchor > 0 {
                        self.anchors.insert(collection.anchor, value.clone());
                    }
                    self.place(value);
                }
            }
            Event::StreamStart | Event::StreamEnd | Event::DocumentEnd | Event::Nothing => {}
        }
        Ok(())
    }

    /// A sequence or map starts.
    fn open(
        &mut self,
        anchor: usize,
        tag: Option<&Tag>,
        items: Items,
        at: Marker,
    ) -> Result<(), RulesFileError> {
        let (kind, core) = match items {
            Items::Sequence(_) => ("a list", "seq"),
            Items::Map { .. } => ("a map", "map"),
        };
        if let Some(tag) = tag.filter(|tag| !is_core(tag, &[core])) {
            return Err(tag_refusal(tag, at));
        }
        if self.at_key() {
            return Err(refusal(
                at,
                format!("expected a string as a key, got {kind}"),
            ));
        }
        if self.open.len() >= MAX_DEPTH {
            return Err(refusal(
                at,
                format!("expected at most {MAX_DEPTH} levels of nesting, got more"),
            ));
        }
        let path = self.value_path(at);
        self.open.push(Collection {
            anchor,
            path,
            items,
        });
        Ok(())
    }

    /// A scalar or an alias: a key, or a value.
    fn node(&mut self, value: Value, anchor: usize, at: Marker) -> Result<(), RulesFileError> {
        if anchor > 0 {
            self.anchors.insert(anchor, value.clone());
        }
        if !self.at_key() {
            self.value_path(at);
            self.place(value);
            return Ok(());
        }
        let key = match value {
            Value::String(key) => key,
            Value::Null => return Err(refusal(at, "expected a string as a key, got null")),
            other => {
                return Err(refusal(
                    at,
                    format!("expected a string as a key, got {other} (quote it to make it one)"),
                ))
            }
        };
        let root = self.open.len() == 1;
        let Some(Collection {
            path,
            items:
                Items::Map {
                    key_lines,
                    key: waiting,
                    ..
                },
            ..
        }) = self.open.last_mut()
        else {
            return Ok(());
        };
        if let Some(first) = key_lines.get(&key) {
            return Err(refusal(
                at,
                format!(
                    "expected each key once in a map, got {key:?} again (first on line {first})"
                ),
            ));
        }
        key_lines.insert(key.clone(), at.line());
        let child = if root {
            // The engine names a key of the whole file both ways: `tables`, `the rules.tabels`.
            self.lines
                .entry(format!("{ROOT}.{key}"))
                .or_insert(at.line());
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        self.lines.entry(child).or_insert(at.line());
        *waiting = Some(key);
        Ok(())
    }

    fn at_key(&self) -> bool {
        matches!(
            self.open.last(),
            Some(Collection {
                items: Items::Map { key: None, .. },
                ..
            })
        )
    }

    /// The path of the value starting at `at`; an item of a sequence gets its line here (an
    /// entry of a map got its key's).
    fn value_path(&mut self, at: Marker) -> String {
        let root = self.open.len() == 1;
        match self.open.last() {
            None => ROOT.to_owned(),
            Some(Collection {
                path,
                items: Items::Sequence(items),
                ..
            }) => {
                let path = format!("{path}[{}]", items.len());
                self.lines.entry(path.clone()).or_insert(at.line());
                path
            }
            Some(Collection {
                path,
                items: Items::Map { key, .. },
                ..
            }) => {
                let key = key.as_deref().unwrap_or_default();
                if root {
                    key.to_owned()
                } else {
                    format!("{path}.{key}")
                }
            }
        }
    }

    /// A finished value goes into its sequence, its map (under the key read), or is the
    /// document.
    fn place(&mut self, value: Value) {
        match self.open.last_mut() {
            None => self.document = Some(value),
            Some(Collection {
                items: Items::Sequence(items),
                ..
            }) => items.push(value),
            Some(Collection {
                items: Items::Map { entries, key, .. },
                ..
            }) => {
                if let Some(key) = key.take() {
                    entries.insert(key, value);
                }
            }
        }
    }
}

/// A scalar's value by the YAML 1.2 core schema: `null`/`~`/empty, `true`/`false`, integers,
/// finite floats, otherwise a string (always when quoted or `!!str`).
fn scalar(
    text: Cow<'_, str>,
    style: ScalarStyle,
    tag: Option<&Cow<'_, Tag>>,
    at: Marker,
) -> Result<Value, RulesFileError> {
    if let Some(tag) = tag.filter(|tag| !is_core(tag, &["str", "int", "float", "bool", "null"])) {
        return Err(tag_refusal(tag, at));
    }
    let shown = text.clone().into_owned();
    let Some(scalar) = Scalar::parse_from_cow_and_metadata(text, style, tag) else {
        let tag = tag.map(|tag| tag_name(tag)).unwrap_or_default();
        return Err(refusal(
            at,
            format!("expected a value {tag} can hold, got {shown:?}"),
        ));
    };
    Ok(match scalar {
        Scalar::Null => Value::Null,
        Scalar::Boolean(flag) => Value::Bool(flag),
        Scalar::Integer(number) => Value::from(number),
        Scalar::FloatingPoint(number) => match Number::from_f64(number.0) {
            Some(number) => Value::Number(number),
            None => {
                return Err(refusal(
                    at,
                    format!("expected a finite number, got {shown}"),
                ))
            }
        },
        Scalar::String(text) => Value::String(text.into_owned()),
    })
}

fn is_core(tag: &Tag, suffixes: &[&str]) -> bool {
    tag.is_yaml_core_schema() && suffixes.contains(&tag.suffix.as_str())
}

fn tag_name(tag: &Tag) -> String {
    if tag.is_yaml_core_schema() {
        format!("!!{}", tag.suffix)
    } else {
        format!("{}{}", tag.handle, tag.suffix)
    }
}

fn tag_refusal(tag: &Tag, at: Marker) -> RulesFileError {
    refusal(
        at,
        format!(
            "expected a plain value, got the tag {} (sync rules hold JSON values: strings, numbers, true/false, null, lists and maps)",
            tag_name(tag)
        ),
    )
}

/// How many values `value` holds, itself included.
fn count_values(value: &Value) -> usize {
    1 + match value {
        Value::Array(items) => items.iter().map(count_values).sum(),
        Value::Object(entries) => entries.values().map(count_values).sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests;
