//! A row's replicated columns kept as the JSON object text they arrived in.
//!
//! A client applies rows it mostly only hands on: to the app (one `JSON.parse` in the page) and
//! to its store. Decoding every row into a [`Map`] on arrival and encoding it again on the way
//! out was most of a replay's cost in the browser package (an ordered map, a hashed key and an
//! allocation per column, twice). [`RowText`] keeps the text instead: decoding checks it is a
//! JSON object and copies it once; encoding writes it back as it is; two rows are equal when
//! their texts are; a [`Map`] is built only when somebody asks for one.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// A JSON object's text, checked to be one. Serialized by `serde_json` as the object itself.
#[derive(Debug, Clone)]
pub struct RowText(Box<RawValue>);

impl RowText {
    /// The text of `map`.
    pub fn from_map(map: &Map<String, Value>) -> RowText {
        // A map of JSON values always serializes.
        match serde_json::value::to_raw_value(map) {
            Ok(raw) => RowText(raw),
            Err(_) => RowText::default(),
        }
    }

    /// `raw` if it is a JSON object, else `raw` back.
    pub fn from_raw(raw: Box<RawValue>) -> Result<RowText, Box<RawValue>> {
        if raw.get().starts_with('{') {
            Ok(RowText(raw))
        } else {
            Err(raw)
        }
    }

    /// The object's JSON text.
    pub fn as_str(&self) -> &str {
        self.0.get()
    }

    /// The row as a map (decoded now).
    pub fn to_map(&self) -> Map<String, Value> {
        serde_json::from_str(self.as_str()).unwrap_or_default()
    }

    /// One column's value (decodes the row).
    pub fn get(&self, column: &str) -> Option<Value> {
        self.to_map().remove(column)
    }
}

impl Default for RowText {
    fn default() -> Self {
        RowText::from_map(&Map::new())
    }
}

impl PartialEq for RowText {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for RowText {}

impl From<Map<String, Value>> for RowText {
    fn from(map: Map<String, Value>) -> Self {
        RowText::from_map(&map)
    }
}

impl Serialize for RowText {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for RowText {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(deserializer)?;
        RowText::from_raw(raw)
            .map_err(|_| serde::de::Error::custom("expected a row to be a JSON object"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_row_keeps_its_text_and_decodes_on_request() {
        let text = r#"{"id":7,"big":18446744073709551617,"title":"t\u00e9"}"#;
        let row: RowText = serde_json::from_str(text).unwrap();
        assert_eq!(row.as_str(), text);
        assert_eq!(serde_json::to_string(&row).unwrap(), text);
        assert_eq!(row.get("id"), Some(json!(7)));
        assert_eq!(row.to_map()["title"], json!("té"));
        assert_eq!(
            row.to_map()["big"].to_string(),
            "18446744073709551617",
            "wide integers stay exact"
        );
        let Value::Object(map) = json!({"id": 7}) else {
            unreachable!()
        };
        assert_eq!(RowText::from_map(&map).as_str(), r#"{"id":7}"#);
        assert_eq!(RowText::default().as_str(), "{}");
        assert!(serde_json::from_str::<RowText>("[1]").is_err());
        assert!(serde_json::from_str::<RowText>("\"{}\"").is_err());
    }
}
