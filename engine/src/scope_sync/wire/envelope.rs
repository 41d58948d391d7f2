//! Channel-message bodies: `{echoOrigin, syncs:[entry…]}` envelopes and their entries
//! (`docs/protocol/scope-sync.md`, "Envelopes").

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::mutation::Echo;
use crate::scope_sync::coercion::{describe, integer_from_text, json_number_text, IntegerText};
use crate::scope_sync::cursor::{
    parse_cursor_payload, sequence_from_value, CursorError, CursorKey, SyncCursor,
};

/// Envelope key of a position the subscription has every change of its scope up to:
/// `{"echoOrigin":null,"syncs":[],"cursor":{"id":…,"serverSequence":…,"updatedAt":…}}`.
///
/// A scope whose rows do not change still sees the feed move on: the server sends this at the
/// end of a replay (the high-water it pinned) and now and then while live, so the cursor a
/// client keeps follows the feed instead of staying at its scope's newest row, and a resume
/// from it is never older than the retention floor only because the scope was quiet.
/// Velocious peers ignore the key and apply the empty `syncs`.
pub const CURSOR_KEY: &str = "cursor";

/// Key of an envelope that moves rows in or out of its scope as access changed (a membership
/// added or removed): `{"out": [{"column": c, "values": [...]}]}`. The client first drops its
/// rows of the scope whose `c` is one of `values`, then applies the entries; the entries
/// (rows let in) carry their own seqs, older or newer than the commit, so only the envelope's
/// [`CURSOR_KEY`] moves the cursor.
pub const MOVES_KEY: &str = "moves";

/// The body of a scope-sync `channel-message`.
///
/// Velocious peers also accept a bare entry as the whole body (the legacy form); `bare` records
/// that, so encoding writes the body back in the form it arrived in.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "Value")]
pub struct SyncEnvelope {
    /// The device that caused these changes; a client drops envelopes carrying its own origin.
    /// Replay envelopes carry `None`.
    pub echo_origin: Option<String>,
    /// Highwater: the writing client's mutations this upstream transaction applied (the
    /// object form of `echoOrigin`, sent only to that client; see [`Echo`]).
    pub echo: Option<Echo>,
    /// The entries, applied together as one batch, in order.
    pub syncs: Vec<SyncEntry>,
    /// The body was a single bare entry rather than `{echoOrigin, syncs}`.
    pub bare: bool,
    /// Other envelope keys, kept so a relay does not lose them.
    pub extra: Map<String, Value>,
}

/// One change: a resource created, updated or deleted, at a change-feed position.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "Value")]
pub struct SyncEntry {
    /// The change-feed row id (a number or string on the wire), not the resource id.
    pub id: Option<String>,
    pub resource_id: Option<String>,
    /// `None`: the key was absent, and the channel's default type applies. `Some(None)`: an
    /// explicit `null`, which overrides the default (and then fails to apply).
    pub resource_type: Option<Option<String>>,
    /// `"update"` or `"delete"`; empty when absent or null.
    pub sync_type: String,
    pub server_sequence: Option<i64>,
    pub updated_at: Option<String>,
    /// The row: an object, a JSON string holding one, or null. `None` when absent.
    pub data: Option<Value>,
    /// Scope attributes and any other keys, kept for relays and routing.
    pub extra: Map<String, Value>,
}

/// Why a message body was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("expected a sync message to be an envelope object, got {found}")]
    NotObject { found: String },
    #[error("expected echoOrigin to be a string, a number, null or {{clientId, mutationIds}}, got {found}")]
    BadEchoOrigin { found: String },
    #[error("expected sync entry {index} to be an object, got {found}")]
    EntryNotObject { index: usize, found: String },
    #[error("expected `{field}` of sync entry {index} to be {expected}, got {found}")]
    BadField {
        index: usize,
        field: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("expected `data` of a sync entry to hold a JSON object, got {found}")]
    BadData { found: String },
}

/// The values of an entry's [`ENTRY_KEYS`], in that order.
type EntrySlots = [Option<Value>; ENTRY_KEYS.len()];

/// The entry keys with a meaning of their own; every other key goes to `extra`.
const ENTRY_KEYS: [&str; 7] = [
    "data",
    "id",
    "resourceId",
    "resourceType",
    "serverSequence",
    "syncType",
    "updatedAt",
];

impl SyncEnvelope {
    /// An envelope of entries.
    pub fn new(echo_origin: Option<String>, syncs: Vec<SyncEntry>) -> Self {
        Self {
            echo_origin,
            echo: None,
            syncs,
            bare: false,
            extra: Map::new(),
        }
    }

    /// The envelope with `echo` as its `echoOrigin`.
    pub fn with_echo(mut self, echo: Option<Echo>) -> Self {
        self.echo = echo;
        self
    }

    /// Decodes a body (`scope-sync.md`, "Envelopes"): it must be an object; `syncs` is taken
    /// when it is an array, otherwise the body itself is one bare entry.
    pub fn from_value(body: &Value) -> Result<Self, EnvelopeError> {
        Self::from_owned(body.clone())
    }

    /// [`SyncEnvelope::from_value`] of a body the caller no longer needs: its entries and rows
    /// are moved into the envelope, not copied.
    pub fn from_owned(body: Value) -> Result<Self, EnvelopeError> {
        let Value::Object(mut object) = body else {
            return Err(EnvelopeError::NotObject {
                found: describe(&body),
            });
        };
        let (echo_origin, echo) = read_echo_origin(object.get("echoOrigin").cloned())?;
        if !matches!(object.get("syncs"), Some(Value::Array(_))) {
            object.shift_remove("echoOrigin");
            return Ok(Self {
                echo_origin,
                echo,
                syncs: vec![SyncEntry::from_owned_object(0, object)?],
                bare: true,
                extra: Map::new(),
            });
        }
        let mut syncs = Vec::new();
        let mut extra = Map::new();
        for (key, value) in object {
            match (key.as_str(), value) {
                ("echoOrigin", _) => {}
                ("syncs", Value::Array(items)) => {
                    syncs = items
                        .into_iter()
                        .enumerate()
                        .map(|(index, item)| match item {
                            Value::Object(entry) => SyncEntry::from_owned_object(index, entry),
                            other => Err(EnvelopeError::EntryNotObject {
                                index,
                                found: describe(&other),
                            }),
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                }
                (_, value) => {
                    extra.insert(key, value);
                }
            }
        }
        Ok(Self {
            echo_origin,
            echo,
            syncs,
            bare: false,
            extra,
        })
    }

    /// Decodes a body from its text.
    pub fn from_json(text: &str) -> Result<Self, EnvelopeError> {
        let value: Value =
            serde_json::from_str(text).map_err(|error| EnvelopeError::NotObject {
                found: format!("invalid JSON ({error})"),
            })?;
        Self::from_owned(value)
    }

    /// The body as JSON: `{echoOrigin, syncs, …}`, or the entry itself for a bare body.
    pub fn to_value(&self) -> Value {
        let mut object = Map::new();
        let echo_origin = match &self.echo {
            Some(echo) => serde_json::to_value(echo).unwrap_or(Value::Null),
            None => self.echo_origin.clone().map_or(Value::Null, Value::String),
        };
        match (self.bare, self.syncs.as_slice()) {
            (true, [entry]) => {
                if let Value::Object(entry) = entry.to_value() {
                    object = entry;
                }
                if !echo_origin.is_null() {
                    object.insert("echoOrigin".to_owned(), echo_origin);
                }
            }
            _ => {
                object.insert("echoOrigin".to_owned(), echo_origin);
                object.insert(
                    "syncs".to_owned(),
                    Value::Array(self.syncs.iter().map(SyncEntry::to_value).collect()),
                );
                object.extend(self.extra.clone());
            }
        }
        Value::Object(object)
    }

    /// The body's text.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// An empty envelope that tells a subscription it holds every change of its scope up to
    /// `cursor`: see [`CURSOR_KEY`].
    pub fn checkpoint(cursor: &SyncCursor) -> Self {
        let mut envelope = Self::new(None, Vec::new());
        envelope
            .extra
            .insert(CURSOR_KEY.to_owned(), serde_json::json!(cursor));
        envelope
    }

    /// The envelope's [`CURSOR_KEY`] position, if it carries a valid one.
    pub fn checkpoint_cursor(&self) -> Option<SyncCursor> {
        parse_cursor_payload(self.extra.get(CURSOR_KEY)?)
            .ok()
            .flatten()
    }

    /// The highest cursor strictly after `current` among the entries and the envelope's
    /// [`CURSOR_KEY`] position, if any is after it (`scope-sync.md`, "Envelopes"): where a
    /// scope watermark moves once this envelope is applied or delivered.
    pub fn advanced_cursor(&self, current: Option<&SyncCursor>) -> Option<SyncCursor> {
        // Compared borrowed: only the winner becomes a cursor (a replay page has a thousand
        // entries).
        let checkpoint = self.checkpoint_cursor();
        let current = current.map(CursorKey::of);
        let mut best: Option<CursorKey<'_>> = None;
        let moves = self.extra.contains_key(MOVES_KEY);
        let entries = self
            .syncs
            .iter()
            .filter(|_| !moves)
            .filter_map(SyncEntry::cursor_key);
        for key in entries.chain(checkpoint.as_ref().map(CursorKey::of)) {
            if best
                .or(current)
                .is_none_or(|base| key.cmp(&base) == std::cmp::Ordering::Greater)
            {
                best = Some(key);
            }
        }
        best.map(CursorKey::to_cursor)
    }
}

/// An `echoOrigin`: a device's id (velocious: a string or a number), or Highwater's object
/// naming a client's mutations.
fn read_echo_origin(value: Option<Value>) -> Result<(Option<String>, Option<Echo>), EnvelopeError> {
    match value {
        None | Some(Value::Null) => Ok((None, None)),
        Some(Value::String(origin)) => Ok((Some(origin), None)),
        Some(Value::Number(origin)) => Ok((Some(json_number_text(&origin)), None)),
        Some(Value::Object(object)) => match Echo::from_object(&object) {
            Some(echo) => Ok((None, Some(echo))),
            None => Err(EnvelopeError::BadEchoOrigin {
                found: describe(&Value::Object(object)),
            }),
        },
        Some(other) => Err(EnvelopeError::BadEchoOrigin {
            found: describe(&other),
        }),
    }
}

/// A body decoded by [`SyncEnvelope::from_text_keeping_rows`]: the envelope (its entries without
/// `data`) and each entry's `data` as it came (`None` where the entry had none).
pub type EnvelopeWithRows = (SyncEnvelope, Vec<Option<Box<RawValue>>>);

impl SyncEnvelope {
    /// Decodes a body from its text as [`SyncEnvelope::from_json`] does, but leaves each entry's
    /// `data` as its JSON text instead of decoding it (a client hands rows on, see
    /// [`super::RowText`]): the entries come without `data`, their data texts beside them. A
    /// body of another form (a bare entry, `syncs` that is not an array of objects, `data` that
    /// is neither an object, a string nor null) is decoded the ordinary way, with `data` in its
    /// entries, and its errors are the ordinary ones.
    pub fn from_text_keeping_rows(text: &str) -> Result<EnvelopeWithRows, EnvelopeError> {
        if let Ok(Some(body)) = serde_json::from_str::<Option<RawBody>>(text) {
            if let Some(decoded) = body.into_envelope()? {
                return Ok(decoded);
            }
        }
        let envelope = Self::from_json(text)?;
        let rows = vec![None; envelope.syncs.len()];
        Ok((envelope, rows))
    }
}

/// A message body read in place, in one pass over a frame's text, each entry's `data` kept as
/// text: what [`SyncEnvelope::from_text_keeping_rows`] reads, for a frame decoder that meets
/// the body as one of the frame's keys (`#[serde(default)] body: Option<KeptBody>`), but that
/// its entries come without their other keys (`extra`: the scope attributes a server repeats
/// in every entry, which a client applying rows never reads; four allocations per row saved).
/// A body that is not an object fails the frame's read: decode that frame the ordinary way.
pub struct KeptBody(RawBody);

impl<'de> Deserialize<'de> for KeptBody {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_map(BodySeed { entry_extra: false })
            .map(KeptBody)
    }
}

impl KeptBody {
    /// The envelope and its rows' texts; `None` for a body of another form or with an error
    /// (then decode the frame the ordinary way, which gives the same envelope or the error).
    pub fn into_envelope(self) -> Option<EnvelopeWithRows> {
        self.0.into_envelope().ok().flatten()
    }
}

/// A body object, each entry's `data` kept as text; `syncs: None` when the key held no array.
#[derive(Default)]
struct RawBody {
    echo_origin: Option<Value>,
    syncs: Option<Vec<RawEntry>>,
    extra: Map<String, Value>,
}

struct RawEntry {
    /// The known keys but `data`, read straight into their types.
    fields: EntryFields,
    extra: Map<String, Value>,
    data: Option<Box<RawValue>>,
    /// A known key held a form the typed read does not take (a numeric `id`, a sequence that
    /// is not a plain integer, an object where text belongs): the ordinary decoder judges the
    /// body, with its errors.
    other_form: bool,
}

/// An entry's known keys as a server writes them: `None` when absent, `Some(None)` for null.
#[derive(Default)]
struct EntryFields {
    id: Option<Option<String>>,
    resource_id: Option<Option<String>>,
    resource_type: Option<Option<String>>,
    server_sequence: Option<Option<i64>>,
    sync_type: Option<Option<String>>,
    updated_at: Option<Option<String>>,
}

impl EntryFields {
    /// The entry these fields make, as [`SyncEntry::from_slots`] makes it of the same values.
    fn into_entry(self, extra: Map<String, Value>) -> SyncEntry {
        SyncEntry {
            id: self.id.flatten(),
            resource_id: self.resource_id.flatten(),
            resource_type: self.resource_type,
            sync_type: self.sync_type.flatten().unwrap_or_default(),
            server_sequence: self.server_sequence.flatten(),
            updated_at: self.updated_at.flatten(),
            data: None,
            extra,
        }
    }
}

impl RawBody {
    /// The envelope and its data texts; `None` for a body the ordinary decoder must judge.
    fn into_envelope(self) -> Result<Option<EnvelopeWithRows>, EnvelopeError> {
        let Some(raw_entries) = self.syncs else {
            return Ok(None);
        };
        let is_row_form =
            |data: &RawValue| matches!(data.get().as_bytes().first(), Some(b'{' | b'"' | b'n'));
        if raw_entries.iter().any(|entry| {
            entry.other_form || entry.data.as_deref().is_some_and(|data| !is_row_form(data))
        }) {
            return Ok(None);
        }
        let (echo_origin, echo) = read_echo_origin(self.echo_origin)?;
        let mut syncs = Vec::with_capacity(raw_entries.len());
        let mut rows = Vec::with_capacity(raw_entries.len());
        for entry in raw_entries {
            syncs.push(entry.fields.into_entry(entry.extra));
            rows.push(entry.data);
        }
        Ok(Some((
            SyncEnvelope {
                echo_origin,
                echo,
                syncs,
                bare: false,
                extra: self.extra,
            },
            rows,
        )))
    }
}

impl<'de> Deserialize<'de> for RawBody {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(BodySeed { entry_extra: true })
    }
}

/// Reads a [`RawBody`]; `entry_extra`: whether its entries keep their other keys.
struct BodySeed {
    entry_extra: bool,
}

impl<'de> Visitor<'de> for BodySeed {
    type Value = RawBody;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an envelope object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawBody, A::Error> {
        let mut body = RawBody::default();
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "echoOrigin" => body.echo_origin = Some(map.next_value()?),
                "syncs" => {
                    body.syncs = map.next_value_seed(Syncs {
                        entry_extra: self.entry_extra,
                    })?
                }
                _ => {
                    let value = map.next_value()?;
                    body.extra.insert(key, value);
                }
            }
        }
        Ok(body)
    }
}

/// `syncs`: its entries when it is an array, `None` for any other value.
struct Syncs {
    entry_extra: bool,
}

impl<'de> DeserializeSeed<'de> for Syncs {
    type Value = Option<Vec<RawEntry>>;
    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Syncs {
    type Value = Option<Vec<RawEntry>>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an array of entries")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        let seed = EntrySeed {
            extra: self.entry_extra,
        };
        while let Some(entry) = seq.next_element_seed(seed)? {
            entries.push(entry);
        }
        Ok(Some(entries))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// Reads a [`RawEntry`]; `extra`: whether it keeps its other keys (else they are read and
/// dropped).
#[derive(Clone, Copy)]
struct EntrySeed {
    extra: bool,
}

impl<'de> DeserializeSeed<'de> for EntrySeed {
    type Value = RawEntry;
    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<RawEntry, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for EntrySeed {
    type Value = RawEntry;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an entry object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawEntry, A::Error> {
        let mut entry = RawEntry {
            fields: EntryFields::default(),
            extra: Map::new(),
            data: None,
            other_form: false,
        };
        // Stores a slot's read; another form marks the entry for the ordinary decoder.
        fn put<T>(slot: &mut Option<Option<T>>, read: Slot<T>, other_form: &mut bool) {
            match read {
                Slot::Null => *slot = Some(None),
                Slot::Is(value) => *slot = Some(Some(value)),
                Slot::Other => *other_form = true,
            }
        }
        while let Some(key) = map.next_key_seed(EntryKeySeed { keep: self.extra })? {
            // The slots are `ENTRY_KEYS`' places.
            let (fields, other) = (&mut entry.fields, &mut entry.other_form);
            match key {
                EntryKey::Known(0) => entry.data = Some(map.next_value()?),
                EntryKey::Known(1) => put(
                    &mut fields.id,
                    map.next_value_seed(ScalarSeed)?.text(),
                    other,
                ),
                EntryKey::Known(2) => put(
                    &mut fields.resource_id,
                    map.next_value_seed(ScalarSeed)?.text(),
                    other,
                ),
                EntryKey::Known(3) => put(
                    &mut fields.resource_type,
                    map.next_value_seed(ScalarSeed)?.text(),
                    other,
                ),
                EntryKey::Known(4) => put(
                    &mut fields.server_sequence,
                    map.next_value_seed(ScalarSeed)?.sequence(),
                    other,
                ),
                EntryKey::Known(5) => put(
                    &mut fields.sync_type,
                    map.next_value_seed(ScalarSeed)?.text(),
                    other,
                ),
                EntryKey::Known(_) => put(
                    &mut fields.updated_at,
                    map.next_value_seed(ScalarSeed)?.text(),
                    other,
                ),
                EntryKey::Other(key) if self.extra => {
                    let value = map.next_value()?;
                    entry.extra.insert(key, value);
                }
                EntryKey::Other(_) => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(entry)
    }
}

/// A known key's value as the typed read takes it.
enum Slot<T> {
    Null,
    Is(T),
    /// Another form (read and dropped): the ordinary decoder judges the body.
    Other,
}

/// A known key's value, read once for every slot: null, text, an integer within 64 bits, or
/// another form (read and dropped).
enum Scalar {
    Null,
    Text(String),
    Integer(i64),
    Other,
}

impl Scalar {
    /// As text or null (`id`, `resourceId`, `resourceType`, `syncType`, `updatedAt` as a
    /// server writes them); a number or any other form is [`Slot::Other`].
    fn text(self) -> Slot<String> {
        match self {
            Scalar::Null => Slot::Null,
            Scalar::Text(text) => Slot::Is(text),
            Scalar::Integer(_) | Scalar::Other => Slot::Other,
        }
    }

    /// As `serverSequence`: an integer (a JSON number within 64 bits, or a string `Number()`
    /// reads as one), null or `""`; any other form is [`Slot::Other`].
    fn sequence(self) -> Slot<i64> {
        match self {
            Scalar::Null => Slot::Null,
            Scalar::Integer(sequence) => Slot::Is(sequence),
            Scalar::Text(text) if text.is_empty() => Slot::Null,
            Scalar::Text(text) => match integer_from_text(&text) {
                IntegerText::Integer(sequence) => Slot::Is(sequence),
                IntegerText::NotInteger | IntegerText::OutOfRange => Slot::Other,
            },
            Scalar::Other => Slot::Other,
        }
    }
}

struct ScalarSeed;

impl<'de> DeserializeSeed<'de> for ScalarSeed {
    type Value = Scalar;
    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Scalar, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ScalarSeed {
    type Value = Scalar;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string, an integer or null")
    }
    fn visit_str<E>(self, text: &str) -> Result<Scalar, E> {
        Ok(Scalar::Text(text.to_owned()))
    }
    fn visit_string<E>(self, text: String) -> Result<Scalar, E> {
        Ok(Scalar::Text(text))
    }
    fn visit_unit<E>(self) -> Result<Scalar, E> {
        Ok(Scalar::Null)
    }
    fn visit_none<E>(self) -> Result<Scalar, E> {
        Ok(Scalar::Null)
    }
    fn visit_i64<E>(self, number: i64) -> Result<Scalar, E> {
        Ok(Scalar::Integer(number))
    }
    fn visit_u64<E>(self, number: u64) -> Result<Scalar, E> {
        Ok(i64::try_from(number).map_or(Scalar::Other, Scalar::Integer))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Scalar, E> {
        Ok(Scalar::Other)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
        // Also a number beyond 64 bits, or not an integer: `serde_json` hands those over as a
        // map of their text (`arbitrary_precision`).
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar::Other)
    }
}

/// An entry's key: the slot of a known one (read without allocating), or another.
enum EntryKey {
    Known(usize),
    /// Another key (empty, without allocating, when it is not kept).
    Other(String),
}

/// Reads an entry's key; `keep`: whether another key's name is kept.
struct EntryKeySeed {
    keep: bool,
}

impl<'de> DeserializeSeed<'de> for EntryKeySeed {
    type Value = EntryKey;
    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<EntryKey, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for EntryKeySeed {
    type Value = EntryKey;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E>(self, key: &str) -> Result<EntryKey, E> {
        Ok(match ENTRY_KEYS.iter().position(|known| *known == key) {
            Some(slot) => EntryKey::Known(slot),
            None if self.keep => EntryKey::Other(key.to_owned()),
            None => EntryKey::Other(String::new()),
        })
    }
    fn visit_string<E>(self, key: String) -> Result<EntryKey, E> {
        Ok(match ENTRY_KEYS.iter().position(|known| *known == key) {
            Some(slot) => EntryKey::Known(slot),
            None => EntryKey::Other(key),
        })
    }
}

impl TryFrom<Value> for SyncEnvelope {
    type Error = EnvelopeError;

    fn try_from(value: Value) -> Result<Self, Self::Error> {
        Self::from_owned(value)
    }
}

impl From<SyncEnvelope> for Value {
    fn from(envelope: SyncEnvelope) -> Self {
        envelope.to_value()
    }
}

/// Written as [`SyncEnvelope::to_value`] writes it, straight to the serializer: an envelope
/// (a replay page of a thousand rows, a live commit) is not first copied into a [`Value`] tree
/// on its way to a socket.
impl Serialize for SyncEnvelope {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        // The forms whose keys `to_value` merges (a bare entry; an `extra` naming one of the
        // envelope's own keys, which takes that key's place) are rare: written through it.
        if self.bare || self.extra.contains_key("echoOrigin") || self.extra.contains_key("syncs") {
            return self.to_value().serialize(serializer);
        }
        let mut map = serializer.serialize_map(Some(2 + self.extra.len()))?;
        match &self.echo {
            Some(echo) => map.serialize_entry("echoOrigin", echo)?,
            None => map.serialize_entry("echoOrigin", &self.echo_origin)?,
        }
        map.serialize_entry("syncs", &self.syncs)?;
        for (key, value) in &self.extra {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// Written as [`SyncEntry::to_value`] writes it (known keys in the feed's alphabetical order,
/// then the others), without copying the row.
impl Serialize for SyncEntry {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        // An `extra` key named like a known one takes that key's place in `to_value`.
        if self
            .extra
            .keys()
            .any(|key| ENTRY_KEYS.contains(&key.as_str()))
        {
            return self.to_value().serialize(serializer);
        }
        let mut map = serializer.serialize_map(None)?;
        if let Some(data) = &self.data {
            map.serialize_entry("data", data)?;
        }
        map.serialize_entry("id", &self.id)?;
        map.serialize_entry("resourceId", &self.resource_id)?;
        if let Some(resource_type) = &self.resource_type {
            map.serialize_entry("resourceType", resource_type)?;
        }
        map.serialize_entry("serverSequence", &self.server_sequence)?;
        if !self.sync_type.is_empty() {
            map.serialize_entry("syncType", &self.sync_type)?;
        }
        map.serialize_entry("updatedAt", &self.updated_at)?;
        for (key, value) in &self.extra {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

impl SyncEntry {
    /// Decodes one entry object; `index` is its position, for error messages.
    pub fn from_object(index: usize, entry: &Map<String, Value>) -> Result<Self, EnvelopeError> {
        Self::from_owned_object(index, entry.clone())
    }

    /// [`SyncEntry::from_object`] of an object the caller no longer needs: its values are
    /// moved into the entry, not copied.
    pub fn from_owned_object(
        index: usize,
        entry: Map<String, Value>,
    ) -> Result<Self, EnvelopeError> {
        // One pass: the known keys into their slots (in `ENTRY_KEYS` order), every other key
        // to `extra` in the order it came. They are checked below in a fixed order, so the
        // error for an entry with several bad fields does not depend on the key order.
        let mut known: EntrySlots = Default::default();
        let mut extra = Map::new();
        for (key, value) in entry {
            match ENTRY_KEYS.iter().position(|known| *known == key) {
                Some(slot) => known[slot] = Some(value),
                None => {
                    extra.insert(key, value);
                }
            }
        }
        Self::from_slots(index, known, extra)
    }

    /// An entry from its known keys' values (in `ENTRY_KEYS` order) and its other keys.
    fn from_slots(
        index: usize,
        known: EntrySlots,
        extra: Map<String, Value>,
    ) -> Result<Self, EnvelopeError> {
        let bad =
            |field: &'static str, expected: &'static str, found: &Value| EnvelopeError::BadField {
                index,
                field,
                expected,
                found: describe(found),
            };
        let [data, id, resource_id, resource_type, server_sequence, sync_type, updated_at] = known;
        let id_field = |field: &'static str, value: Option<Value>| match value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(text)) => Ok(Some(text)),
            Some(Value::Number(number)) => Ok(Some(json_number_text(&number))),
            Some(other) => Err(bad(field, "a string, a number or null", &other)),
        };
        let id = id_field("id", id)?;
        let resource_id = id_field("resourceId", resource_id)?;
        let resource_type = match resource_type {
            None => None,
            Some(Value::Null) => Some(None),
            Some(Value::String(text)) => Some(Some(text)),
            Some(other) => return Err(bad("resourceType", "a string or null", &other)),
        };
        let sync_type = match sync_type {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(text)) => text,
            Some(other) => return Err(bad("syncType", "a string or null", &other)),
        };
        let server_sequence = match server_sequence {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) if text.is_empty() => None,
            Some(value) => Some(sequence_from_value(&value).map_err(|error| match error {
                CursorError::SequenceOutOfRange { .. } => {
                    bad("serverSequence", "an integer within 64 bits", &value)
                }
                _ => bad("serverSequence", "an integer or an integer string", &value),
            })?),
        };
        let updated_at = match updated_at {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) => Some(text),
            Some(other) => return Err(bad("updatedAt", "an ISO timestamp string or null", &other)),
        };
        let data = match data {
            None => None,
            Some(value @ (Value::Null | Value::Object(_) | Value::String(_))) => Some(value),
            Some(other) => return Err(bad("data", "an object, a JSON string or null", &other)),
        };
        Ok(Self {
            id,
            resource_id,
            resource_type,
            sync_type,
            server_sequence,
            updated_at,
            data,
            extra,
        })
    }

    /// Whether `key` is one of an entry's own keys (`data`, `id`, `resourceId`,
    /// `resourceType`, `serverSequence`, `syncType`, `updatedAt`), which never go to `extra`.
    pub fn is_known_key(key: &str) -> bool {
        ENTRY_KEYS.contains(&key)
    }

    /// The entry's cursor (`scope-sync.md`, "Cursors"): `None` without an `updatedAt`, so it
    /// moves no cursor.
    pub fn cursor(&self) -> Option<SyncCursor> {
        self.cursor_key().map(CursorKey::to_cursor)
    }

    /// [`SyncEntry::cursor`], borrowed.
    fn cursor_key(&self) -> Option<CursorKey<'_>> {
        let updated_at = self.updated_at.as_deref().filter(|text| !text.is_empty())?;
        Some(CursorKey {
            id: self.id.as_deref(),
            server_sequence: self.server_sequence,
            updated_at,
        })
    }

    /// The entry's type once the channel default is applied (`scope-sync.md`, "Envelopes"):
    /// the default fills in only an absent key; an explicit null stays null.
    pub fn resolved_resource_type(&self, channel_default: Option<&str>) -> Option<String> {
        match &self.resource_type {
            None => channel_default.map(str::to_owned),
            Some(explicit) => explicit.clone(),
        }
    }

    /// Whether this entry removes the resource.
    pub fn is_delete(&self) -> bool {
        self.sync_type == "delete"
    }

    /// [`SyncEntry::data_object`], moving a `data` object out of the entry (`data` is then
    /// absent) instead of copying it; `data` in any other form stays.
    pub fn take_data_object(&mut self) -> Result<Option<Map<String, Value>>, EnvelopeError> {
        match self.data.take() {
            Some(Value::Object(object)) => Ok(Some(object)),
            other => {
                self.data = other;
                self.data_object()
            }
        }
    }

    /// The row as an object: `data` itself, or parsed from a JSON string; `None` for null or
    /// absent data.
    pub fn data_object(&self) -> Result<Option<Map<String, Value>>, EnvelopeError> {
        match &self.data {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(object)) => Ok(Some(object.clone())),
            Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
                Ok(Value::Object(object)) => Ok(Some(object)),
                Ok(other) => Err(EnvelopeError::BadData {
                    found: describe(&other),
                }),
                Err(error) => Err(EnvelopeError::BadData {
                    found: format!("invalid JSON ({error})"),
                }),
            },
            Some(other) => Err(EnvelopeError::BadData {
                found: describe(other),
            }),
        }
    }

    /// The entry as JSON, known keys in the feed's alphabetical order, then the others.
    pub fn to_value(&self) -> Value {
        let mut object = Map::new();
        let text = |value: &Option<String>| value.clone().map_or(Value::Null, Value::String);
        if let Some(data) = &self.data {
            object.insert("data".to_owned(), data.clone());
        }
        object.insert("id".to_owned(), text(&self.id));
        object.insert("resourceId".to_owned(), text(&self.resource_id));
        if let Some(resource_type) = &self.resource_type {
            object.insert("resourceType".to_owned(), text(resource_type));
        }
        object.insert(
            "serverSequence".to_owned(),
            self.server_sequence.map_or(Value::Null, Value::from),
        );
        if !self.sync_type.is_empty() {
            object.insert("syncType".to_owned(), Value::String(self.sync_type.clone()));
        }
        object.insert("updatedAt".to_owned(), text(&self.updated_at));
        object.extend(self.extra.clone());
        Value::Object(object)
    }
}

impl TryFrom<Value> for SyncEntry {
    type Error = EnvelopeError;

    fn try_from(value: Value) -> Result<Self, Self::Error> {
        match value {
            Value::Object(entry) => SyncEntry::from_owned_object(0, entry),
            other => Err(EnvelopeError::EntryNotObject {
                index: 0,
                found: describe(&other),
            }),
        }
    }
}

impl From<SyncEntry> for Value {
    fn from(entry: SyncEntry) -> Self {
        entry.to_value()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    const T0: &str = "2026-07-01T10:00:00.000Z";

    fn feed_entry(id: i64, sequence: i64) -> Value {
        json!({
            "data": {"id": "r1", "title": "x"},
            "id": id,
            "resourceId": "r1",
            "resourceType": "Task",
            "serverSequence": sequence,
            "syncType": "update",
            "updatedAt": T0,
            "projectId": "p1"
        })
    }

    #[test]
    fn envelopes_decode_entries_with_their_scope_attributes() {
        let body = json!({"echoOrigin": "device-1", "syncs": [feed_entry(7, 31)]});
        let envelope = SyncEnvelope::from_value(&body).unwrap();
        assert_eq!(envelope.echo_origin.as_deref(), Some("device-1"));
        assert!(!envelope.bare);
        let entry = &envelope.syncs[0];
        assert_eq!(entry.id.as_deref(), Some("7"));
        assert_eq!(entry.resource_id.as_deref(), Some("r1"));
        assert_eq!(entry.server_sequence, Some(31));
        assert_eq!(entry.extra.get("projectId"), Some(&json!("p1")));
        assert_eq!(
            entry.cursor(),
            Some(SyncCursor::new(
                Some("7".to_owned()),
                Some(31),
                T0.to_owned()
            ))
        );
        assert_eq!(envelope.to_value()["syncs"][0]["projectId"], json!("p1"));
    }

    #[test]
    fn scenario_18_array_null_and_primitive_bodies_are_rejected() {
        for body in [
            json!([feed_entry(1, 1)]),
            json!(null),
            json!("text"),
            json!(5),
            json!(true),
        ] {
            let error = SyncEnvelope::from_value(&body).unwrap_err();
            assert!(matches!(error, EnvelopeError::NotObject { .. }), "{body}");
        }
        assert_eq!(
            SyncEnvelope::from_value(&json!(null))
                .unwrap_err()
                .to_string(),
            "expected a sync message to be an envelope object, got null"
        );
    }

    #[test]
    fn scenario_18_a_bare_entry_is_accepted_and_written_back_bare() {
        let body =
            json!({"syncType": "update", "resourceId": 5, "data": {"id": 5}, "echoOrigin": "d"});
        let envelope = SyncEnvelope::from_value(&body).unwrap();
        assert!(envelope.bare);
        assert_eq!(envelope.echo_origin.as_deref(), Some("d"));
        assert_eq!(envelope.syncs.len(), 1);
        assert_eq!(envelope.syncs[0].resource_id.as_deref(), Some("5"));
        assert!(!envelope.syncs[0].extra.contains_key("echoOrigin"));
        assert_eq!(envelope.syncs[0].cursor(), None);
        let again = SyncEnvelope::from_value(&envelope.to_value()).unwrap();
        assert_eq!(again, envelope);
    }

    /// Scope attributes and unknown keys keep the order they came in, in an envelope, in its
    /// entries and in a bare entry whose `echoOrigin` sits between them.
    #[test]
    fn extra_keys_keep_their_order() {
        let keys = |extra: &Map<String, Value>| extra.keys().cloned().collect::<Vec<_>>();
        let bare = json!({"zeta": 1, "echoOrigin": "d", "alpha": 2, "resourceId": "r", "mid": 3});
        let envelope = SyncEnvelope::from_value(&bare).unwrap();
        assert_eq!(keys(&envelope.syncs[0].extra), ["zeta", "alpha", "mid"]);
        let body =
            json!({"z": 1, "syncs": [{"b": 1, "id": 2, "a": 2}], "echoOrigin": null, "a": 2});
        let envelope = SyncEnvelope::from_value(&body).unwrap();
        assert_eq!(keys(&envelope.extra), ["z", "a"]);
        assert_eq!(keys(&envelope.syncs[0].extra), ["b", "a"]);
    }

    #[test]
    fn a_non_array_syncs_key_makes_the_body_a_bare_entry() {
        let envelope =
            SyncEnvelope::from_value(&json!({"syncs": "nope", "resourceId": "r"})).unwrap();
        assert!(envelope.bare);
        assert_eq!(envelope.syncs[0].extra.get("syncs"), Some(&json!("nope")));
    }

    #[test]
    fn scenario_18_the_channel_type_fills_in_only_an_absent_resource_type() {
        let absent = SyncEntry::try_from(json!({"resourceId": "r"})).unwrap();
        assert_eq!(
            absent.resolved_resource_type(Some("Task")).as_deref(),
            Some("Task")
        );
        let null = SyncEntry::try_from(json!({"resourceId": "r", "resourceType": null})).unwrap();
        assert_eq!(null.resolved_resource_type(Some("Task")), None);
        let named = SyncEntry::try_from(json!({"resourceType": "Note"})).unwrap();
        assert_eq!(
            named.resolved_resource_type(Some("Task")).as_deref(),
            Some("Note")
        );
        // The distinction survives encoding.
        assert_eq!(SyncEntry::try_from(null.to_value()).unwrap(), null);
        assert!(!absent
            .to_value()
            .as_object()
            .unwrap()
            .contains_key("resourceType"));
    }

    #[test]
    fn entries_accept_string_sequences_numeric_ids_and_json_string_data() {
        let entry = SyncEntry::try_from(json!({
            "id": "9", "serverSequence": "1234", "data": "{\"id\":1}", "syncType": null
        }))
        .unwrap();
        assert_eq!(entry.server_sequence, Some(1234));
        assert_eq!(entry.sync_type, "");
        assert_eq!(
            entry.data_object(),
            Ok(Some(Map::from_iter([("id".to_owned(), json!(1))])))
        );
        let deleted = SyncEntry::try_from(json!({"syncType": "delete", "data": null})).unwrap();
        assert!(deleted.is_delete());
        assert_eq!(deleted.data_object(), Ok(None));
        let broken = SyncEntry::try_from(json!({"data": "[1]"})).unwrap();
        assert!(matches!(
            broken.data_object(),
            Err(EnvelopeError::BadData { .. })
        ));
    }

    #[test]
    fn malformed_entries_name_the_entry_field_and_value() {
        let cases = [
            (json!({"syncs": [1]}), "expected sync entry 0 to be an object, got number 1"),
            (
                json!({"syncs": [{}, {"serverSequence": "abc"}]}),
                "expected `serverSequence` of sync entry 1 to be an integer or an integer string, got string \"abc\"",
            ),
            (
                json!({"syncs": [{"serverSequence": "99999999999999999999"}]}),
                "expected `serverSequence` of sync entry 0 to be an integer within 64 bits, got string \"99999999999999999999\"",
            ),
            (
                json!({"syncs": [{"resourceType": 3}]}),
                "expected `resourceType` of sync entry 0 to be a string or null, got number 3",
            ),
            (
                json!({"syncs": [{"id": {"a": 1}}]}),
                "expected `id` of sync entry 0 to be a string, a number or null, got an object",
            ),
            (
                json!({"syncs": [{"data": 5}]}),
                "expected `data` of sync entry 0 to be an object, a JSON string or null, got number 5",
            ),
            (
                json!({"syncs": [{"updatedAt": 5}]}),
                "expected `updatedAt` of sync entry 0 to be an ISO timestamp string or null, got number 5",
            ),
            (
                json!({"echoOrigin": ["d"], "syncs": []}),
                "expected echoOrigin to be a string, a number, null or {clientId, mutationIds}, got an array of 1 items",
            ),
        ];
        for (body, message) in cases {
            assert_eq!(
                SyncEnvelope::from_value(&body).unwrap_err().to_string(),
                message,
                "{body}"
            );
        }
    }

    #[test]
    fn envelope_extra_keys_survive_a_relay() {
        let body = json!({"echoOrigin": null, "syncs": [], "trace": "t1"});
        let envelope: SyncEnvelope = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(serde_json::to_value(&envelope).unwrap(), body);
    }

    #[test]
    fn the_advanced_cursor_is_the_highest_entry_above_the_watermark() {
        let body = json!({"echoOrigin": null, "syncs": [feed_entry(1, 5), feed_entry(2, 3), feed_entry(3, 7), {"resourceId": "bare"}]});
        let envelope = SyncEnvelope::from_value(&body).unwrap();
        assert_eq!(
            envelope
                .advanced_cursor(None)
                .and_then(|c| c.server_sequence),
            Some(7)
        );
        let at_seven = SyncCursor::new(None, Some(7), T0.to_owned());
        assert_eq!(envelope.advanced_cursor(Some(&at_seven)), None);
    }

    /// The entries a server writes (a numeric sequence, text elsewhere) are read by the typed
    /// read, not handed to the ordinary decoder.
    #[test]
    fn a_servers_entries_take_the_typed_read() {
        let body = format!(
            r#"{{"echoOrigin":null,"syncs":[{{"data":{{"id":1}},"id":"e:5","resourceId":"1","resourceType":"Task","serverSequence":5,"syncType":"update","updatedAt":"{T0}","owner":"ada"}},{{"id":"e:6","resourceId":"2","serverSequence":-9223372036854775808,"syncType":"delete","updatedAt":"{T0}","data":null}}]}}"#
        );
        let raw: RawBody = serde_json::from_str(&body).unwrap();
        let (envelope, rows) = raw.into_envelope().unwrap().expect("the typed read");
        assert_eq!(envelope.syncs[0].server_sequence, Some(5));
        assert_eq!(envelope.syncs[1].server_sequence, Some(i64::MIN));
        assert_eq!(envelope.syncs[0].extra["owner"], json!("ada"));
        assert_eq!(envelope.syncs[1].resource_type, None);
        assert_eq!(rows[0].as_deref().map(RawValue::get), Some(r#"{"id":1}"#));
        assert_eq!(rows[1].as_deref().map(RawValue::get), Some("null"));
        let (ordinary, _) = SyncEnvelope::from_text_keeping_rows(&body).unwrap();
        assert_eq!(ordinary, envelope);
    }

    /// A body read with its frame (`KeptBody`) is the body `from_text_keeping_rows` reads,
    /// but that its entries come without their other keys; the envelope keeps its own.
    #[test]
    fn a_body_read_with_its_frame_drops_only_its_entries_other_keys() {
        #[derive(Deserialize)]
        struct Frame {
            body: KeptBody,
        }
        let body = format!(
            r#"{{"echoOrigin":null,"syncs":[{{"data":{{"id":1}},"id":"e:5","resourceId":"1","owner":"ada","serverSequence":5,"syncType":"update","updatedAt":"{T0}","tags":{{"a":[1,{{"b":null}}]}}}}],"progress":{{"done":1,"total":1}}}}"#
        );
        let frame: Frame = serde_json::from_str(&format!(r#"{{"body":{body}}}"#)).unwrap();
        let (kept, kept_rows) = frame.body.into_envelope().expect("the typed read");
        let (mut ordinary, rows) = SyncEnvelope::from_text_keeping_rows(&body).unwrap();
        assert_eq!(ordinary.syncs[0].extra.len(), 2);
        ordinary.syncs[0].extra.clear();
        assert_eq!(kept, ordinary);
        assert_eq!(kept.extra["progress"], json!({"done": 1, "total": 1}));
        assert_eq!(
            kept_rows
                .iter()
                .map(|row| row.as_deref().map(RawValue::get))
                .collect::<Vec<_>>(),
            rows.iter()
                .map(|row| row.as_deref().map(RawValue::get))
                .collect::<Vec<_>>()
        );
    }

    proptest! {
        #[test]
        fn advancing_never_regresses_and_reaches_the_maximum(
            current in prop::option::of(0i64..50),
            sequences in prop::collection::vec(0i64..50, 0..8),
        ) {
            let syncs: Vec<Value> = sequences.iter().enumerate().map(|(i, &s)| feed_entry(i as i64, s)).collect();
            let envelope = SyncEnvelope::from_value(&json!({"syncs": syncs})).unwrap();
            let current = current.map(|s| SyncCursor::new(None, Some(s), T0.to_owned()));
            let advanced = envelope.advanced_cursor(current.as_ref());
            let max = sequences.iter().copied().max();
            let expected = match (max, current.as_ref().and_then(|c| c.server_sequence)) {
                (Some(max), Some(now)) if max > now => Some(max),
                (Some(max), None) => Some(max),
                _ => None,
            };
            prop_assert_eq!(advanced.and_then(|c| c.server_sequence), expected);
        }

        /// Decoding a body keeping rows as text gives what the ordinary decoder gives, the
        /// rows beside the entries instead of in them, whatever keys, forms and order.
        #[test]
        fn bodies_decoded_keeping_rows_equal_the_ordinary_decoding(
            sequence in prop::option::of(any::<i64>()),
            data in prop::sample::select(vec![
                r#"{"id":1,"big":123456789012345678901234567890,"s":"\u00e9\"x"}"#,
                r#""{\"id\":2}""#,
                "null",
                "absent",
                "7",
                "[1]",
            ]),
            extra_first in any::<bool>(),
            echo in prop::sample::select(vec!["null", "\"me\"", "12", "true"]),
            syncs_form in prop::sample::select(vec!["array", "object", "null", "absent", "bad entry"]),
            sequence_form in prop::sample::select(vec![
                "number", "string", "\"\"", "\" 0x1F \"", "\"x\"", "1.5", "1e2", "-0",
                "18446744073709551616", "-9223372036854775809", "true", "{}", "[2]",
            ]),
            id in prop::sample::select(vec!["\"x\"", "12", "-1.50", "null", "[1]", "{\"a\":1}", "false"]),
            text_form in prop::sample::select(vec!["text", "null", "absent", "7", "{}"]),
        ) {
            let seq = match (sequence_form, sequence) {
                (_, None) => "null".to_owned(),
                ("number", Some(s)) => s.to_string(),
                ("string", Some(s)) => format!("\"{s}\""),
                (form, Some(_)) => form.to_owned(),
            };
            // `syncType` and `resourceType` in one of their forms, or absent.
            let texts = match text_form {
                "text" => r#","syncType":"update","resourceType":"Task""#.to_owned(),
                "absent" => String::new(),
                other => format!(r#","syncType":{other},"resourceType":{other}"#),
            };
            let data = if data == "absent" { String::new() } else { format!(r#","data":{data}"#) };
            let entry = format!(
                r#"{{"id":{id},"resourceId":"r","serverSequence":{seq}{texts},"updatedAt":"{T0}","projectId":"p"{data}}}"#
            );
            let syncs = match syncs_form {
                "array" => format!(r#""syncs":[{entry},{entry}]"#),
                "object" => r#""syncs":{"a":1}"#.to_owned(),
                "null" => r#""syncs":null"#.to_owned(),
                "bad entry" => format!(r#""syncs":[{entry},3]"#),
                _ => r#""resourceId":"bare","updatedAt":"2026-07-01T10:00:00.000Z""#.to_owned(),
            };
            let extra = r#""progress":{"done":1,"total":2}"#;
            let body = if extra_first {
                format!(r#"{{{extra},"echoOrigin":{echo},{syncs}}}"#)
            } else {
                format!(r#"{{"echoOrigin":{echo},{syncs},{extra}}}"#)
            };
            let ordinary = SyncEnvelope::from_json(&body);
            let kept = SyncEnvelope::from_text_keeping_rows(&body);
            match (ordinary, kept) {
                (Ok(mut ordinary), Ok((mut kept, rows))) => {
                    prop_assert_eq!(rows.len(), kept.syncs.len());
                    for (entry, row) in kept.syncs.iter_mut().zip(rows) {
                        if let Some(row) = row {
                            prop_assert!(entry.data.is_none());
                            entry.data = Some(serde_json::from_str(row.get()).unwrap());
                        }
                    }
                    // Key order of `extra` is not part of an envelope's meaning.
                    ordinary.extra.sort_keys();
                    kept.extra.sort_keys();
                    prop_assert_eq!(kept, ordinary);
                }
                (Err(ordinary), Err(kept)) => prop_assert_eq!(kept, ordinary),
                (ordinary, kept) => prop_assert!(false, "{body}: {ordinary:?} against {kept:?}"),
            }
        }

        #[test]
        fn entries_round_trip_through_json(
            id in prop::option::of("[0-9a-z]{1,5}"),
            sequence in prop::option::of(any::<i64>()),
            sync_type in prop::sample::select(vec!["", "update", "delete"]),
            resource_type in prop::option::of(prop::option::of("[A-Z][a-z]{0,5}")),
        ) {
            let entry = SyncEntry {
                id,
                resource_id: Some("r".to_owned()),
                resource_type,
                sync_type: sync_type.to_owned(),
                server_sequence: sequence,
                updated_at: Some(T0.to_owned()),
                data: Some(json!({"k": 1})),
                extra: Map::from_iter([("projectId".to_owned(), json!("p"))]),
            };
            let text = SyncEnvelope::new(None, vec![entry.clone()]).to_json();
            let back = SyncEnvelope::from_json(&text).unwrap();
            prop_assert_eq!(back.syncs, vec![entry]);
        }

        /// An envelope written straight to text is the text of its [`SyncEnvelope::to_value`],
        /// key for key and in the same order, whatever its form: echoes, bare bodies, absent
        /// fields, and `extra` keys named like the known ones.
        #[test]
        fn envelopes_serialize_as_their_value(
            id in prop::option::of("[0-9a-z]{1,5}"),
            sequence in prop::option::of(any::<i64>()),
            sync_type in prop::sample::select(vec!["", "update", "delete"]),
            resource_type in prop::option::of(prop::option::of("[A-Z][a-z]{0,5}")),
            data in prop::sample::select(vec!["absent", "null", "object", "string"]),
            entry_extra in prop::sample::select(vec!["", "projectId", "syncType", "data", "id"]),
            entries in 0usize..3,
            bare in any::<bool>(),
            echo in prop::sample::select(vec!["none", "origin", "echo"]),
            envelope_extra in prop::sample::select(vec!["", "progress", "syncs", "echoOrigin"]),
        ) {
            let data = match data {
                "absent" => None,
                "null" => Some(Value::Null),
                "object" => Some(json!({"k": 1, "big": 123456789012345678901234567890_u128, "s": "\u{e9}\""})),
                _ => Some(json!(r#"{"k":2}"#)),
            };
            let mut extra = Map::new();
            if !entry_extra.is_empty() {
                extra.insert(entry_extra.to_owned(), json!("p"));
            }
            let entry = SyncEntry {
                id,
                resource_id: Some("r".to_owned()),
                resource_type,
                sync_type: sync_type.to_owned(),
                server_sequence: sequence,
                updated_at: Some(T0.to_owned()),
                data,
                extra,
            };
            let mut envelope = SyncEnvelope::new(
                (echo == "origin").then(|| "me".to_owned()),
                vec![entry; entries],
            )
            .with_echo((echo == "echo").then(|| Echo {
                client_id: "c".to_owned(),
                mutation_ids: vec![1, 2],
            }));
            envelope.bare = bare;
            if !envelope_extra.is_empty() {
                envelope.extra.insert(envelope_extra.to_owned(), json!({"done": 1}));
            }
            prop_assert_eq!(envelope.to_json(), envelope.to_value().to_string());
            prop_assert_eq!(serde_json::to_value(&envelope).unwrap(), envelope.to_value());
            for entry in &envelope.syncs {
                prop_assert_eq!(serde_json::to_string(entry).unwrap(), entry.to_value().to_string());
            }
        }
    }
}
