//! Protocol versions (`docs/protocol/change-stream.md`, "Protocol versions"): what we accept,
//! the 1002 close reason, and what a subscriber at protocol vN may receive.

use std::borrow::Cow;

use super::message::{Change, DownstreamMessage, Relation};

/// Oldest protocol a client may speak on the legacy endpoints.
pub const MIN_PROTOCOL_VERSION: u32 = 1;
/// Newest protocol we speak (backfill tracking in `start-subscription`).
pub const MAX_PROTOCOL_VERSION: u32 = 8;
/// `/subscribe` (the merged duplex connection) exists from v7.
pub const MIN_SUBSCRIBE_PROTOCOL_VERSION: u32 = 7;
/// WebSocket close code for errors while setting up a request.
pub const PROTOCOL_ERROR_CLOSE_CODE: u16 = 1002;
/// A WebSocket close reason is at most 123 bytes.
pub const MAX_CLOSE_REASON_BYTES: usize = 123;

/// The three change-streamer endpoints, `/replication/v<N>/<endpoint>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    Changes,
    Snapshot,
    Subscribe,
}

impl Endpoint {
    /// The last path segment naming this endpoint.
    pub fn parse(segment: &str) -> Option<Self> {
        match segment {
            "changes" => Some(Endpoint::Changes),
            "snapshot" => Some(Endpoint::Snapshot),
            "subscribe" => Some(Endpoint::Subscribe),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Changes => "changes",
            Endpoint::Snapshot => "snapshot",
            Endpoint::Subscribe => "subscribe",
        }
    }

    /// The oldest protocol this endpoint serves.
    pub fn min_version(self) -> u32 {
        match self {
            Endpoint::Changes | Endpoint::Snapshot => MIN_PROTOCOL_VERSION,
            Endpoint::Subscribe => MIN_SUBSCRIBE_PROTOCOL_VERSION,
        }
    }
}

/// A requested protocol version we cannot serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Cannot service client at protocol v{requested}. Supported protocols: [v{min} ... v{max}]")]
pub struct UnsupportedVersion {
    pub requested: u64,
    pub min: u32,
    pub max: u32,
}

impl UnsupportedVersion {
    /// The close reason to send with code 1002.
    pub fn close_reason(&self) -> String {
        close_reason(&self.to_string())
    }
}

/// Accepts `requested` for `endpoint`, or says which versions are supported there.
pub fn check_protocol_version(
    requested: u64,
    endpoint: Endpoint,
) -> Result<u32, UnsupportedVersion> {
    let (min, max) = (endpoint.min_version(), MAX_PROTOCOL_VERSION);
    match u32::try_from(requested) {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        _ => Err(UnsupportedVersion {
            requested,
            min,
            max,
        }),
    }
}

/// `Error: <message>`, cut to the 123 bytes a WebSocket close reason may hold.
pub fn close_reason(message: &str) -> String {
    let mut reason = format!("Error: {message}");
    if reason.len() > MAX_CLOSE_REASON_BYTES {
        let mut end = MAX_CLOSE_REASON_BYTES;
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        reason.truncate(end);
    }
    reason
}

/// The exact 1002 reason for an unsupported version:
/// `Error: Cannot service client at protocol v<N>. Supported protocols: [v<min> ... v<max>]`.
pub fn unsupported_version_reason(requested: u64, min: u32, max: u32) -> String {
    UnsupportedVersion {
        requested,
        min,
        max,
    }
    .close_reason()
}

/// Whether a subscriber at `version` may receive `message` at all: no `status` below v2, no
/// `update-table-metadata` below v5, no `reserved` below v7.
pub fn may_receive(version: u32, message: &DownstreamMessage) -> bool {
    match message {
        DownstreamMessage::Status(_) => version >= 2,
        DownstreamMessage::Reserved(_) => version >= 7,
        DownstreamMessage::Data(Change::UpdateTableMetadata(_)) => version >= 5,
        _ => true,
    }
}

/// Whether `{"id":n,"batch":[…]}` frames may be sent: always on `/subscribe` (v7+), and on the
/// legacy `/changes` path only when the client asked for `wsBatched=true`.
pub fn batch_frames_allowed(version: u32, ws_batched: bool) -> bool {
    version >= MIN_SUBSCRIBE_PROTOCOL_VERSION || ws_batched
}

/// `message` as a subscriber at `version` must receive it: `None` if it is withheld, borrowed if
/// it goes out unchanged, owned when v<5 relations need the deprecated `keyColumns` /
/// `replicaIdentity` filled in.
pub fn adapt_for_version(
    message: &DownstreamMessage,
    version: u32,
) -> Option<Cow<'_, DownstreamMessage>> {
    if !may_receive(version, message) {
        return None;
    }
    if version >= 5 {
        return Some(Cow::Borrowed(message));
    }
    let DownstreamMessage::Data(change) = message else {
        return Some(Cow::Borrowed(message));
    };
    let relations_ok = match change {
        Change::Insert(c) => c.relation.has_legacy_key(),
        Change::Update(c) => c.relation.has_legacy_key(),
        Change::Delete(c) => c.relation.has_legacy_key(),
        Change::Truncate(c) => c.relations.iter().all(|r| r.has_legacy_key()),
        _ => true,
    };
    if relations_ok {
        return Some(Cow::Borrowed(message));
    }
    let mut change = change.clone();
    match &mut change {
        Change::Insert(c) => std::sync::Arc::make_mut(&mut c.relation).fill_legacy_key(),
        Change::Update(c) => std::sync::Arc::make_mut(&mut c.relation).fill_legacy_key(),
        Change::Delete(c) => std::sync::Arc::make_mut(&mut c.relation).fill_legacy_key(),
        Change::Truncate(c) => c.relations.iter_mut().for_each(Relation::fill_legacy_key),
        _ => {}
    }
    Some(Cow::Owned(DownstreamMessage::Data(change)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change_stream::{decode_downstream, encode_downstream, Status};

    #[test]
    fn unsupported_version_reason_is_exact() {
        assert_eq!(
            unsupported_version_reason(9, 1, 8),
            "Error: Cannot service client at protocol v9. Supported protocols: [v1 ... v8]"
        );
        let e = check_protocol_version(6, Endpoint::Subscribe).expect_err("subscribe needs v7");
        assert_eq!(
            e.close_reason(),
            "Error: Cannot service client at protocol v6. Supported protocols: [v7 ... v8]"
        );
        let huge = check_protocol_version(u64::MAX, Endpoint::Changes).expect_err("too new");
        assert!(huge.close_reason().len() <= MAX_CLOSE_REASON_BYTES);
        // "Error: x" is 8 bytes and each "é" 2, so the cut falls inside a char and backs off to 122.
        assert_eq!(close_reason(&format!("x{}", "é".repeat(100))).len(), 122);
    }

    #[test]
    fn accepted_versions_per_endpoint() {
        assert_eq!(
            check_protocol_version(0, Endpoint::Changes).map_err(|e| e.min),
            Err(1)
        );
        assert_eq!(check_protocol_version(1, Endpoint::Changes), Ok(1));
        assert_eq!(check_protocol_version(8, Endpoint::Snapshot), Ok(8));
        assert_eq!(check_protocol_version(7, Endpoint::Subscribe), Ok(7));
        assert!(check_protocol_version(9, Endpoint::Subscribe).is_err());
        assert_eq!(Endpoint::parse("subscribe"), Some(Endpoint::Subscribe));
        assert_eq!(Endpoint::parse("subscribe/"), None);
    }

    #[test]
    fn gating_per_version() {
        let status = DownstreamMessage::Status(Status::default());
        let reserved = decode_downstream(
            r#"["reserved",{"tag":"snapshot","backupURL":"s3://b","replicaVersion":"00","minWatermark":"0a"}]"#,
        )
        .expect("valid");
        let metadata = decode_downstream(
            r#"["data",{"tag":"update-table-metadata","table":{"schema":"s","name":"t"},"old":{"rowKey":{}},"new":{"rowKey":{}}}]"#,
        )
        .expect("valid");
        let commit =
            decode_downstream(r#"["commit",{"tag":"commit"},{"watermark":"0a"}]"#).expect("valid");
        let table: [(u32, [bool; 4]); 5] = [
            (1, [false, false, false, true]),
            (2, [true, false, false, true]),
            (5, [true, true, false, true]),
            (6, [true, true, false, true]),
            (7, [true, true, true, true]),
        ];
        for (v, expected) in table {
            let got = [&status, &metadata, &reserved, &commit].map(|m| may_receive(v, m));
            assert_eq!(got, expected, "v{v}");
        }
        assert!(!batch_frames_allowed(6, false));
        assert!(batch_frames_allowed(6, true));
        assert!(batch_frames_allowed(7, false));
    }

    #[test]
    fn v4_subscribers_get_key_columns() {
        let m = decode_downstream(
            r#"["data",{"tag":"insert","relation":{"schema":"s","name":"t","rowKey":{"columns":["id"],"type":"full"}},"new":{"id":1}}]"#,
        )
        .expect("valid");
        let v4 = adapt_for_version(&m, 4).expect("delivered");
        assert!(matches!(v4, Cow::Owned(_)));
        assert_eq!(
            encode_downstream(&v4),
            r#"["data",{"tag":"insert","relation":{"schema":"s","name":"t","keyColumns":["id"],"replicaIdentity":"full","rowKey":{"columns":["id"],"type":"full"}},"new":{"id":1}}]"#
        );
        // Already carrying the old form, or a v5+ subscriber: sent as is.
        assert!(matches!(adapt_for_version(&v4, 4), Some(Cow::Borrowed(_))));
        assert!(matches!(adapt_for_version(&m, 5), Some(Cow::Borrowed(_))));
        assert!(adapt_for_version(&DownstreamMessage::Status(Status::default()), 1).is_none());
    }
}
