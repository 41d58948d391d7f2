//! One message of the stream, serialized once and shared by every subscriber, the backlog and
//! the change log (`docs/protocol/change-stream.md`, "Forward, store, ack").

use std::borrow::Cow;
use std::ops::Range;
use std::sync::{Arc, OnceLock};

use crate::backfill::affects_backfills;
use crate::change_stream::{
    adapt_for_version, decode_downstream, encode_downstream, header_end, Begin, Commit,
    DownstreamMessage, Rollback,
};
use crate::watermark::Watermark;

/// The tuple tag of a message, which decides how it is stored and gated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryKind {
    Begin,
    Data,
    Commit,
    Rollback,
    Status,
}

/// Tags of row changes whose relations v<5 subscribers need in the deprecated `keyColumns` form.
fn carries_relation(tag: &str) -> bool {
    matches!(tag, "insert" | "update" | "delete" | "truncate")
}

/// A message of the stream with its serialized tuple.
#[derive(Debug)]
pub struct Entry {
    kind: EntryKind,
    /// The inner `tag` (`"begin"`, `"insert"`, …, `"status"`).
    tag: Cow<'static, str>,
    /// The commit watermark of the enclosing transaction; `None` for a status.
    watermark: Option<Watermark>,
    /// The downstream tuple as JSON text.
    text: Arc<str>,
    /// Where the inner object (the change-log `change` column) sits in `text`.
    change: Range<usize>,
    /// The typed message, when the entry came from the live stream.
    message: Option<Arc<DownstreamMessage>>,
    /// The tuple as a v<5 subscriber must get it (relations with `keyColumns`), made once.
    legacy_text: OnceLock<Arc<str>>,
}

impl Entry {
    /// A message from the live stream; `watermark` is its transaction's commit watermark.
    pub(super) fn live(message: DownstreamMessage, watermark: Option<Watermark>) -> Self {
        let (kind, tag): (EntryKind, Cow<'static, str>) = match &message {
            DownstreamMessage::Begin(_) => (EntryKind::Begin, "begin".into()),
            DownstreamMessage::Commit(_) => (EntryKind::Commit, "commit".into()),
            DownstreamMessage::Rollback(_) => (EntryKind::Rollback, "rollback".into()),
            DownstreamMessage::Data(change) => (EntryKind::Data, change.tag().into()),
            // Errors and reservations never enter the stream; callers reject them first.
            DownstreamMessage::Status(_)
            | DownstreamMessage::Error(_)
            | DownstreamMessage::Reserved(_) => (EntryKind::Status, "status".into()),
        };
        let text: Arc<str> = encode_downstream(&message).into();
        // `["<tuple tag>",` precedes the inner object in the compact encoding.
        let tuple_tag = match kind {
            EntryKind::Data => "data",
            _ => tag.as_ref(),
        };
        let start = tuple_tag.len() + 4;
        let end = match kind {
            // Three-element tuples: the inner object is followed by the watermark object.
            EntryKind::Begin | EntryKind::Commit => {
                header_end(&message, &text).unwrap_or(start).max(start)
            }
            _ => text.len().saturating_sub(1),
        };
        Entry {
            kind,
            tag,
            watermark,
            change: start..end.max(start),
            text,
            message: Some(Arc::new(message)),
            legacy_text: OnceLock::new(),
        }
    }

    /// A change-log row, rebuilt into its downstream tuple (`change-stream.md`, "The change log").
    pub(super) fn stored(watermark: Watermark, tag: &str, change: &str) -> Self {
        let w = watermark.as_str();
        let (kind, prefix, suffix) = match tag {
            "begin" => (
                EntryKind::Begin,
                r#"["begin","#,
                format!(r#",{{"commitWatermark":"{w}"}}]"#),
            ),
            "commit" => (
                EntryKind::Commit,
                r#"["commit","#,
                format!(r#",{{"watermark":"{w}"}}]"#),
            ),
            "rollback" => (EntryKind::Rollback, r#"["rollback","#, "]".to_owned()),
            _ => (EntryKind::Data, r#"["data","#, "]".to_owned()),
        };
        let mut text = String::with_capacity(prefix.len() + change.len() + suffix.len());
        text.push_str(prefix);
        text.push_str(change);
        text.push_str(&suffix);
        Entry {
            kind,
            tag: Cow::Owned(tag.to_owned()),
            watermark: Some(watermark),
            change: prefix.len()..prefix.len() + change.len(),
            text: text.into(),
            message: None,
            legacy_text: OnceLock::new(),
        }
    }

    pub fn kind(&self) -> EntryKind {
        self.kind
    }

    pub fn tag(&self) -> &str {
        &self.tag
    }

    pub fn watermark(&self) -> Option<&Watermark> {
        self.watermark.as_ref()
    }

    /// The downstream tuple as JSON text.
    #[cfg(test)]
    pub fn text(&self) -> &Arc<str> {
        &self.text
    }

    /// The inner object: what the change log stores in its `change` column.
    pub fn change_json(&self) -> &str {
        self.text.get(self.change.clone()).unwrap_or_default()
    }

    /// The typed message, if the entry came from the live stream.
    pub fn message(&self) -> Option<&DownstreamMessage> {
        self.message.as_deref()
    }

    /// Bytes counted against backlogs and in-flight limits.
    pub fn bytes(&self) -> usize {
        self.text.len()
    }

    /// Whether a subscriber at `watermark` has already got this message's transaction.
    /// Statuses belong to no transaction and always pass (`change-stream.md`, "Transactions and
    /// ordering").
    pub fn is_seen_at(&self, watermark: &Watermark) -> bool {
        self.watermark.as_ref().is_some_and(|w| w <= watermark)
    }

    /// The text a subscriber at protocol `version` receives, or `None` if the message is
    /// withheld from it (status below v2, `update-table-metadata` below v5).
    pub fn text_for(&self, version: u32) -> Option<Arc<str>> {
        match self.kind {
            EntryKind::Status if version < 2 => return None,
            EntryKind::Data if version < 5 => {}
            _ => return Some(self.text.clone()),
        }
        if self.tag == "update-table-metadata" {
            return None;
        }
        if !carries_relation(&self.tag) {
            return Some(self.text.clone());
        }
        let legacy = self.legacy_text.get_or_init(|| {
            let decoded;
            let message = match self.message() {
                Some(message) => message,
                None => match decode_downstream(&self.text) {
                    Ok(message) => {
                        decoded = message;
                        &decoded
                    }
                    // A log row we cannot read back is relayed as stored.
                    Err(_) => return self.text.clone(),
                },
            };
            match adapt_for_version(message, version) {
                Some(Cow::Owned(adapted)) => encode_downstream(&adapted).into(),
                _ => self.text.clone(),
            }
        });
        Some(legacy.clone())
    }

    /// The message as backfill tracking needs it: transaction boundaries and changes that can
    /// move pending backfills; `None` for everything else (most rows are never decoded).
    pub fn for_backfill_tracking(&self) -> Option<Cow<'_, DownstreamMessage>> {
        let watermark = || self.watermark.clone();
        match self.kind {
            EntryKind::Begin => {
                watermark().map(|w| Cow::Owned(DownstreamMessage::Begin(Begin::new(w))))
            }
            EntryKind::Commit => {
                watermark().map(|w| Cow::Owned(DownstreamMessage::Commit(Commit::new(w))))
            }
            EntryKind::Rollback => {
                Some(Cow::Owned(DownstreamMessage::Rollback(Rollback::default())))
            }
            EntryKind::Status => None,
            EntryKind::Data if !affects_backfills(&self.tag) => None,
            EntryKind::Data => match self.message() {
                Some(message) => Some(Cow::Borrowed(message)),
                None => decode_downstream(&self.text).ok().map(Cow::Owned),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change_stream::decode_downstream;

    fn w(text: &str) -> Watermark {
        Watermark::parse(text).expect("watermark")
    }

    fn live(text: &str, watermark: Option<&str>) -> Entry {
        Entry::live(decode_downstream(text).expect("message"), watermark.map(w))
    }

    #[test]
    fn live_entries_expose_the_stored_change_object() {
        let begin = live(
            r#"["begin",{"tag":"begin","json":"s","xid":7},{"commitWatermark":"0a"}]"#,
            Some("0a"),
        );
        assert_eq!(begin.change_json(), r#"{"tag":"begin","json":"s","xid":7}"#);
        let commit = live(
            r#"["commit",{"tag":"commit"},{"watermark":"0a"}]"#,
            Some("0a"),
        );
        assert_eq!(commit.change_json(), r#"{"tag":"commit"}"#);
        let insert = live(
            r#"["data",{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":1}}]"#,
            Some("0a"),
        );
        assert_eq!(insert.tag(), "insert");
        assert_eq!(
            insert.change_json(),
            r#"{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":1}}"#
        );
        let rollback = live(r#"["rollback",{"tag":"rollback"}]"#, Some("0a"));
        assert_eq!(rollback.change_json(), r#"{"tag":"rollback"}"#);
    }

    #[test]
    fn stored_rows_rebuild_the_live_tuples() {
        for (text, watermark) in [
            (
                r#"["begin",{"tag":"begin","json":"s"},{"commitWatermark":"0b"}]"#,
                "0b",
            ),
            (r#"["commit",{"tag":"commit"},{"watermark":"0b"}]"#, "0b"),
            (
                r#"["data",{"tag":"delete","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"key":{"id":2}}]"#,
                "0b",
            ),
        ] {
            let original = live(text, Some(watermark));
            let stored = Entry::stored(w(watermark), original.tag(), original.change_json());
            assert_eq!(stored.text().as_ref(), text);
            assert_eq!(stored.kind(), original.kind());
            assert_eq!(stored.change_json(), original.change_json());
        }
    }

    #[test]
    fn gating_follows_the_subscriber_version() {
        let status = live(r#"["status",{"tag":"status"}]"#, None);
        assert!(status.text_for(1).is_none());
        assert!(status.text_for(2).is_some());
        assert!(!status.is_seen_at(&w("1zz")));
        let metadata = Entry::stored(
            w("0a"),
            "update-table-metadata",
            r#"{"tag":"update-table-metadata","table":{"schema":"s","name":"t"},"old":{"rowKey":{}},"new":{"rowKey":{}}}"#,
        );
        assert!(metadata.text_for(4).is_none());
        assert!(metadata.text_for(5).is_some());
        let insert = Entry::stored(
            w("0a"),
            "insert",
            r#"{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":1}}"#,
        );
        let v4 = insert.text_for(4).expect("sent");
        assert!(v4.contains(r#""keyColumns":["id"]"#), "{v4}");
        assert!(!insert.text_for(5).expect("sent").contains("keyColumns"));
        // The v<5 form is made once and shared.
        let again = insert.text_for(3).expect("sent");
        assert!(Arc::ptr_eq(&v4, &again));
        assert!(insert.is_seen_at(&w("0a")));
        assert!(!insert.is_seen_at(&w("09")));
    }

    #[test]
    fn backfill_tracking_decodes_only_what_can_move_backfills() {
        let insert = Entry::stored(
            w("0a"),
            "insert",
            r#"{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"]}},"new":{"id":1}}"#,
        );
        assert!(insert.for_backfill_tracking().is_none());
        let drop = Entry::stored(
            w("0a"),
            "drop-table",
            r#"{"tag":"drop-table","id":{"schema":"s","name":"t"}}"#,
        );
        assert!(matches!(
            drop.for_backfill_tracking().as_deref(),
            Some(DownstreamMessage::Data(_))
        ));
        let begin = Entry::stored(w("0a"), "begin", r#"{"tag":"begin"}"#);
        assert!(matches!(
            begin.for_backfill_tracking().as_deref(),
            Some(DownstreamMessage::Begin(b)) if b.commit_watermark == "0a"
        ));
    }
}
