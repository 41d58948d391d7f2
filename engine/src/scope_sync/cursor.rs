//! Scope-sync cursors: where a client stands in a scope's change feed.
//!
//! A cursor is `null` (never synced) or `{id, serverSequence, updatedAt}`, the position of one
//! change-feed row. This module reads cursors from every form they are stored or sent in, writes
//! the two request-param forms, and orders cursors so that client watermarks and server delivery
//! marks only ever move forwards.
//!
//! Cursors deliberately implement neither `Ord` nor `PartialOrd`: the order mixes a numeric
//! sequence with a timestamp fallback for legacy cursors, which is a total order within each kind
//! but can cycle across the two (see [`compare_cursors`]).

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::scope_sync::coercion::{
    describe, integer_from_number, integer_from_text, js_string_cmp, json_number_text, IntegerText,
};

/// The position of one change-feed row. `Option<SyncCursor>` is the full cursor: `None` is the
/// never-synced cursor, which every other cursor is after.
///
/// Serializes to the persisted `cursor_json` shape, always with all three keys:
/// `{"id":"42","serverSequence":1234,"updatedAt":"2026-07-01T10:00:00.000Z"}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SyncCursor {
    /// Id of the change-feed row (not of the resource), always as a string.
    pub id: Option<String>,
    /// The row's server-allocated sequence: the primary ordering key. `None` marks a legacy
    /// cursor ordered by `updated_at` then `id`. Signed because peers accept 0 and negatives
    /// in persisted cursors (the feed itself rejects them as request bounds).
    pub server_sequence: Option<i64>,
    /// The row's `updated_at` exactly as given (ISO-8601 text); never empty.
    pub updated_at: String,
}

/// Why a cursor payload or param was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CursorError {
    #[error("expected serverSequence to be an integer or an integer string, got {found}")]
    BadSequence { found: String },
    #[error("expected serverSequence to fit in a signed 64-bit integer, got {found}")]
    SequenceOutOfRange { found: String },
    #[error("expected id to be a string, a number or null, got {found}")]
    BadId { found: String },
    #[error("expected a cursor object with a non-empty updatedAt string, got {found}")]
    NotACursor { found: String },
    #[error("expected a cursor param prefix `after` or `upTo`, got {found:?}")]
    BadPrefix { found: String },
    #[error("expected a cursor param form `client` or `server`, got {found:?}")]
    BadForm { found: String },
}

impl SyncCursor {
    /// A cursor of a feed row, as the server derives it (`docs/protocol/scope-sync.md`,
    /// "Cursors").
    pub fn new(id: Option<String>, server_sequence: Option<i64>, updated_at: String) -> Self {
        Self {
            id,
            server_sequence,
            updated_at,
        }
    }

    /// The legacy form a raw timestamp string parses to: no id and no sequence.
    pub fn legacy(updated_at: String) -> Self {
        Self::new(None, None, updated_at)
    }

    /// The persisted `cursor_json` text of this cursor.
    pub fn to_json_text(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// `updated_at` as milliseconds since the epoch, when it is an ECMAScript date-time string.
    pub fn updated_at_ms(&self) -> Option<i64> {
        instant_ms(&self.updated_at)
    }

    /// Whether this cursor is strictly after `current` (`scope-sync.md`, "Comparing cursors").
    /// Equal cursors are not after.
    pub fn is_after(&self, current: Option<&SyncCursor>) -> bool {
        is_cursor_after(Some(self), current)
    }

    /// Reads a cursor object: the object half of [`parse_cursor_payload`].
    fn from_object(object: &Map<String, Value>) -> Result<Option<Self>, CursorError> {
        let updated_at = match object.get("updatedAt") {
            Some(Value::String(text)) if !text.is_empty() => text.clone(),
            // Without a timestamp the whole cursor is null, even beside a valid sequence.
            _ => return Ok(None),
        };
        let id = match object.get("id") {
            None | Some(Value::Null) => None,
            Some(value) => Some(id_text(value)?),
        };
        let server_sequence = match object.get("serverSequence") {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) if text.is_empty() => None,
            Some(value) => Some(sequence_from_value(value)?),
        };
        Ok(Some(Self::new(id, server_sequence, updated_at)))
    }
}

impl<'de> Deserialize<'de> for SyncCursor {
    /// Accepts the persisted object shape with the same leniency as payload parsing (numeric
    /// ids, integer-string sequences), but an object without `updatedAt` is an error here.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        let parsed = match &value {
            Value::Object(object) => SyncCursor::from_object(object),
            _ => Ok(None),
        };
        match parsed {
            Ok(Some(cursor)) => Ok(cursor),
            Ok(None) => Err(CursorError::NotACursor {
                found: describe(&value),
            }),
            Err(error) => Err(error),
        }
        .map_err(serde::de::Error::custom)
    }
}

/// `String(id)` for the id kinds a feed row can carry.
fn id_text(value: &Value) -> Result<String, CursorError> {
    match value {
        Value::String(text) => Ok(text.clone()),
        Value::Number(number) => Ok(json_number_text(number)),
        Value::Bool(flag) => Ok(flag.to_string()),
        other => Err(CursorError::BadId {
            found: describe(other),
        }),
    }
}

/// typanic's `optionalInteger` for a present, non-null sequence: an integer number, or a
/// non-blank string whose `Number()` value is an integer. Read exactly, never through `f64`.
pub(crate) fn sequence_from_value(value: &Value) -> Result<i64, CursorError> {
    let verdict = match value {
        Value::Number(number) => integer_from_number(number),
        Value::String(text) => integer_from_text(text),
        _ => IntegerText::NotInteger,
    };
    match verdict {
        IntegerText::Integer(sequence) => Ok(sequence),
        IntegerText::NotInteger => Err(CursorError::BadSequence {
            found: describe(value),
        }),
        IntegerText::OutOfRange => Err(CursorError::SequenceOutOfRange {
            found: describe(value),
        }),
    }
}

/// Parses a persisted or response cursor payload (`scope-sync.md`, "Cursors").
///
/// - Falsy input (`null`, `""`, `0`, `false`) is the null cursor.
/// - A string is JSON-parsed and the result parsed again; if either step fails, the string
///   itself is a legacy timestamp cursor. So a raw ISO timestamp is a legacy cursor, while a
///   string holding a JSON number (`"1700000000"`) is null.
/// - Any other non-object, and an array, is null.
/// - An object needs a non-empty `updatedAt` string (else null). A `serverSequence` that is not
///   an integer is an error here, whereas inside a string it made the whole text a legacy cursor.
pub fn parse_cursor_payload(payload: &Value) -> Result<Option<SyncCursor>, CursorError> {
    match payload {
        Value::Null | Value::Bool(false) => Ok(None),
        Value::String(text) => Ok(parse_cursor_text(text)),
        Value::Object(object) => SyncCursor::from_object(object),
        // Zero is falsy and other numbers are not objects: null either way.
        Value::Number(_) | Value::Bool(true) | Value::Array(_) => Ok(None),
    }
}

/// Parses the text of a persisted `cursor_json` column (`scope-sync.md`, "Cursors"). Never
/// fails: text that is not a valid cursor payload is a legacy timestamp cursor holding the whole
/// text.
pub fn parse_cursor_text(text: &str) -> Option<SyncCursor> {
    if text.is_empty() {
        return None;
    }
    match serde_json::from_str::<Value>(text) {
        Ok(value) => match parse_cursor_payload(&value) {
            Ok(cursor) => cursor,
            Err(_) => Some(SyncCursor::legacy(text.to_owned())),
        },
        Err(_) => Some(SyncCursor::legacy(text.to_owned())),
    }
}

/// The cursor of a pushed or replayed sync entry (`scope-sync.md`, "Cursors"), or `None` when
/// the entry has no `updatedAt` (legacy bare envelopes), so that such entries never move a
/// cursor.
///
/// `id` is the entry's sync-row id, not its `resourceId`. A sequence that is neither an integer
/// nor an integer string is dropped rather than rejected: the entry still orders as legacy.
pub fn cursor_from_sync_entry(entry: &Value) -> Option<SyncCursor> {
    let object = entry.as_object()?;
    let updated_at = match object.get("updatedAt") {
        Some(Value::String(text)) if !text.is_empty() => text.clone(),
        _ => return None,
    };
    let id = object.get("id").and_then(|value| match value {
        Value::Null => None,
        other => id_text(other).ok(),
    });
    let server_sequence = object
        .get("serverSequence")
        .and_then(|value| sequence_from_value(value).ok());
    Some(SyncCursor::new(id, server_sequence, updated_at))
}

/// Which cursor a set of request params describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CursorPrefix {
    /// `afterId` / `afterServerSequence` / `afterUpdatedAt`: exclusive start.
    #[serde(rename = "after")]
    After,
    /// `upToId` / `upToServerSequence` / `upToUpdatedAt`: inclusive, pinned end.
    #[serde(rename = "upTo")]
    UpTo,
}

impl CursorPrefix {
    pub fn as_str(self) -> &'static str {
        match self {
            CursorPrefix::After => "after",
            CursorPrefix::UpTo => "upTo",
        }
    }

    /// The three param names of this prefix: id, sequence, timestamp.
    pub fn param_names(self) -> [&'static str; 3] {
        match self {
            CursorPrefix::After => ["afterId", "afterServerSequence", "afterUpdatedAt"],
            CursorPrefix::UpTo => ["upToId", "upToServerSequence", "upToUpdatedAt"],
        }
    }
}

impl fmt::Display for CursorPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CursorPrefix {
    type Err = CursorError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "after" => Ok(CursorPrefix::After),
            "upTo" => Ok(CursorPrefix::UpTo),
            other => Err(CursorError::BadPrefix {
                found: other.to_owned(),
            }),
        }
    }
}

/// The two cursor serializers (`scope-sync.md`, "Cursors"), which differ only in when the
/// sequence is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CursorParamsForm {
    /// Pulls and realtime subscribe params: a zero or null sequence is omitted (the feed
    /// rejects 0, and the client never sends it).
    Client,
    /// The server's replay page params: any non-null sequence is written, 0 included.
    Server,
}

impl FromStr for CursorParamsForm {
    type Err = CursorError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "client" => Ok(CursorParamsForm::Client),
            "server" => Ok(CursorParamsForm::Server),
            other => Err(CursorError::BadForm {
                found: other.to_owned(),
            }),
        }
    }
}

/// Serializes a cursor into request params (`scope-sync.md`, "Cursors"), in the order id,
/// sequence, timestamp.
///
/// A null cursor yields no params at all. Otherwise `<prefix>Id` is always present (possibly
/// `null`) and so is `<prefix>UpdatedAt`; `<prefix>ServerSequence` follows `form`.
pub fn cursor_to_params(
    prefix: CursorPrefix,
    cursor: Option<&SyncCursor>,
    form: CursorParamsForm,
) -> Map<String, Value> {
    let mut params = Map::new();
    let Some(cursor) = cursor else {
        return params;
    };
    let [id_name, sequence_name, updated_at_name] = prefix.param_names();
    params.insert(
        id_name.to_owned(),
        cursor.id.clone().map_or(Value::Null, Value::String),
    );
    let sequence = match (form, cursor.server_sequence) {
        (CursorParamsForm::Client, Some(0)) | (_, None) => None,
        (_, Some(sequence)) => Some(sequence),
    };
    if let Some(sequence) = sequence {
        params.insert(sequence_name.to_owned(), Value::from(sequence));
    }
    params.insert(
        updated_at_name.to_owned(),
        Value::String(cursor.updated_at.clone()),
    );
    params
}

/// Orders two cursors (`scope-sync.md`, "Comparing cursors"): the null cursor is lowest; two
/// sequenced cursors compare by sequence alone; otherwise `updatedAt` as an instant, then `id`
/// as a string (null as `""`).
///
/// Within sequenced cursors and within legacy cursors this is a total order. A set mixing both
/// can cycle (`seq 5 @T2 < seq 10 @T0 < legacy @T1 < seq 5 @T2`): the rules require the instant
/// fallback between the kinds, and no single order satisfies it. Such mixes occur only while a
/// legacy cursor is being replaced by sequenced ones, where any forward step is acceptable.
///
/// Timestamps compare as instants, at millisecond precision, so `…:00Z` equals `…:00.000Z`. A
/// timestamp that is not an ECMAScript date-time string sorts after every one that is, and by
/// its text among its kind; comparing raw text with parsed instants would not be transitive.
pub fn compare_cursors(a: Option<&SyncCursor>, b: Option<&SyncCursor>) -> Ordering {
    match (a, b) {
        (None, None) => Ordering::Equal,
        (None, Some(_)) => Ordering::Less,
        (Some(_), None) => Ordering::Greater,
        (Some(a), Some(b)) => CursorKey::of(a).cmp(&CursorKey::of(b)),
    }
}

/// A cursor's fields, borrowed: compared as [`compare_cursors`] compares cursors, so the
/// highest of many (an envelope's entries) is found without building a cursor for each.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CursorKey<'a> {
    pub(crate) id: Option<&'a str>,
    pub(crate) server_sequence: Option<i64>,
    pub(crate) updated_at: &'a str,
}

impl<'a> CursorKey<'a> {
    pub(crate) fn of(cursor: &'a SyncCursor) -> Self {
        Self {
            id: cursor.id.as_deref(),
            server_sequence: cursor.server_sequence,
            updated_at: &cursor.updated_at,
        }
    }

    /// `scope-sync.md`, "Comparing cursors".
    pub(crate) fn cmp(&self, other: &CursorKey<'_>) -> Ordering {
        match (self.server_sequence, other.server_sequence) {
            (Some(a), Some(b)) => a.cmp(&b),
            _ => TimestampKey::of(self.updated_at)
                .cmp(&TimestampKey::of(other.updated_at))
                .then_with(|| js_string_cmp(self.id.unwrap_or(""), other.id.unwrap_or(""))),
        }
    }

    pub(crate) fn to_cursor(self) -> SyncCursor {
        SyncCursor::new(
            self.id.map(str::to_owned),
            self.server_sequence,
            self.updated_at.to_owned(),
        )
    }
}

/// Whether `candidate` is strictly after `current` (`scope-sync.md`, "Comparing cursors"). A
/// null candidate never is; anything is after a null current; an equal cursor is not after, so
/// duplicates never advance.
pub fn is_cursor_after(candidate: Option<&SyncCursor>, current: Option<&SyncCursor>) -> bool {
    compare_cursors(candidate, current) == Ordering::Greater
}

/// `updatedAt` as an ordering key: parsed instants first, unparseable text after them.
#[derive(Debug, PartialEq, Eq)]
enum TimestampKey<'a> {
    Instant(i64),
    Text(&'a str),
}

impl<'a> TimestampKey<'a> {
    fn of(text: &'a str) -> Self {
        instant_ms(text).map_or(TimestampKey::Text(text), TimestampKey::Instant)
    }
}

impl Ord for TimestampKey<'_> {
    fn cmp(&self, other: &Self) -> Ordering {
        match (self, other) {
            (TimestampKey::Instant(a), TimestampKey::Instant(b)) => a.cmp(b),
            (TimestampKey::Instant(_), TimestampKey::Text(_)) => Ordering::Less,
            (TimestampKey::Text(_), TimestampKey::Instant(_)) => Ordering::Greater,
            (TimestampKey::Text(a), TimestampKey::Text(b)) => js_string_cmp(a, b),
        }
    }
}

impl PartialOrd for TimestampKey<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Parses an ECMAScript date-time string (`YYYY[-MM[-DD]][THH:mm[:ss[.f…]]][Z|±HH:mm]`,
/// extended years `±YYYYYY`) to epoch milliseconds, truncating sub-millisecond digits.
///
/// Written by hand because this is exactly the grammar JS peers' `Date.parse` guarantees, and
/// general ISO-8601 parsers accept more (week dates, basic format) or less (date-only).
/// Without an offset the time is read as UTC: a sans-IO core has no local zone, and servers
/// only emit `Z`.
pub(crate) fn instant_ms(text: &str) -> Option<i64> {
    let mut rest = text.as_bytes();
    let year = match rest.first()? {
        sign @ (b'+' | b'-') => {
            let digits = take_digits(&mut rest.get(1..)?, 6)?;
            rest = &rest[7..];
            // -000000 is not a valid year.
            if *sign == b'-' && digits == 0 {
                return None;
            }
            if *sign == b'-' {
                -digits
            } else {
                digits
            }
        }
        _ => take_digits(&mut rest, 4)?,
    };
    let mut month = 1;
    let mut day = 1;
    if let Some(after) = rest.strip_prefix(b"-") {
        rest = after;
        month = take_digits(&mut rest, 2)?;
        if let Some(after) = rest.strip_prefix(b"-") {
            rest = after;
            day = take_digits(&mut rest, 2)?;
        }
    }
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return None;
    }
    let (mut hour, mut minute, mut second, mut millis, mut offset_minutes) = (0, 0, 0, 0, 0);
    if let Some(after) = rest.strip_prefix(b"T") {
        rest = after;
        hour = take_digits(&mut rest, 2)?;
        rest = rest.strip_prefix(b":")?;
        minute = take_digits(&mut rest, 2)?;
        if let Some(after) = rest.strip_prefix(b":") {
            rest = after;
            second = take_digits(&mut rest, 2)?;
            if let Some(after) = rest.strip_prefix(b".") {
                rest = after;
                let count = rest.iter().take_while(|b| b.is_ascii_digit()).count();
                if count == 0 || count > 9 {
                    return None;
                }
                millis = rest[..count.min(3)]
                    .iter()
                    .fold(0, |acc, b| acc * 10 + i64::from(b - b'0'))
                    * 10_i64.pow(3 - count.min(3) as u32);
                rest = &rest[count..];
            }
        }
        let end_of_day = hour == 24 && minute == 0 && second == 0 && millis == 0;
        if !(hour < 24 || end_of_day) || minute > 59 || second > 59 {
            return None;
        }
        match rest.first() {
            None => {}
            Some(b'Z') => rest = &rest[1..],
            Some(sign @ (b'+' | b'-')) => {
                let negative = *sign == b'-';
                rest = &rest[1..];
                let offset_hours = take_digits(&mut rest, 2)?;
                rest = rest.strip_prefix(b":")?;
                let offset_mins = take_digits(&mut rest, 2)?;
                if offset_hours > 23 || offset_mins > 59 {
                    return None;
                }
                offset_minutes = offset_hours * 60 + offset_mins;
                if negative {
                    offset_minutes = -offset_minutes;
                }
            }
            Some(_) => return None,
        }
    }
    if !rest.is_empty() {
        return None;
    }
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + hour * 3_600 + (minute - offset_minutes) * 60 + second;
    Some(seconds * 1_000 + millis)
}

/// Takes exactly `count` ASCII digits from the front of `rest`.
fn take_digits(rest: &mut &[u8], count: usize) -> Option<i64> {
    let digits = rest.get(..count)?;
    if !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    *rest = &rest[count..];
    Some(
        digits
            .iter()
            .fold(0, |acc, b| acc * 10 + i64::from(b - b'0')),
    )
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if year % 4 == 0 && (year % 100 != 0 || year % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests;
