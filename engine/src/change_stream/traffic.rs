//! What a peer at a given protocol version may send in each direction, beyond the shape of
//! each message: the rules a Zero replicator at that version holds its change-streamer to.
//!
//! * Downstream (change-streamer to subscriber): v1–v6 is one-way, so only `{id,msg}` frames;
//!   a `{id,batch}` frame (its frame schema requires `msg`) and an `{ack}` are invalid there.
//!   From v7 (`/subscribe`, duplex) batches are the norm and acks of the subscriber's frames
//!   flow downstream too. Messages must be downstream ones the version knows: `status` from
//!   v2, `update-table-metadata` from v5, `backfill` / `backfill-completed` from v6,
//!   `reserved` from v7; below v5 every relation needs the deprecated `keyColumns`. An
//!   `add-column` default must be one the replicator can turn into a SQLite default (it applies
//!   it even when a backfill follows, and stops the stream on anything else).
//! * Upstream (subscriber to change-streamer): v1–v6 sends nothing but `{ack}`; v7+ also sends
//!   `{id,msg}` control frames with `reserve-snapshot` / `start-subscription`, never a batch.

use super::column_default::lite_default;
use super::frame::{Envelope, Frame};
use super::message::{Change, DownstreamMessage, Message, Relation};
use super::version::{MAX_PROTOCOL_VERSION, MIN_PROTOCOL_VERSION, MIN_SUBSCRIBE_PROTOCOL_VERSION};

/// Which way traffic flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Change-streamer to subscriber.
    Downstream,
    /// Subscriber to change-streamer.
    Upstream,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Downstream => "downstream",
            Direction::Upstream => "upstream",
        }
    }
}

/// A well-formed frame or message that a peer at this version may not send this way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not valid v{version} {} traffic: {reason}", direction.as_str())]
pub struct TrafficError {
    pub version: u32,
    pub direction: Direction,
    pub reason: String,
}

/// Checks one decoded frame or bare message against what a peer at protocol `version` may
/// send in `direction`. `version` outside the supported range is itself an error.
pub fn check_traffic(
    envelope: &Envelope,
    version: u32,
    direction: Direction,
) -> Result<(), TrafficError> {
    let fail = |reason: String| TrafficError {
        version,
        direction,
        reason,
    };
    if !(MIN_PROTOCOL_VERSION..=MAX_PROTOCOL_VERSION).contains(&version) {
        return Err(fail(format!(
            "expected a protocol version from {MIN_PROTOCOL_VERSION} to {MAX_PROTOCOL_VERSION}"
        )));
    }
    let duplex = version >= MIN_SUBSCRIBE_PROTOCOL_VERSION;
    match (envelope, direction) {
        (Envelope::Frame(Frame::Ack { .. }), Direction::Downstream) if !duplex => {
            return Err(fail(
                "an {ack} frame; below v7 acks only flow upstream".to_owned(),
            ));
        }
        (Envelope::Frame(Frame::Batch { .. }), Direction::Downstream) if !duplex => {
            return Err(fail(
                "a {batch} frame; below v7 a subscriber accepts only {id,msg} frames".to_owned(),
            ));
        }
        (Envelope::Frame(Frame::Batch { .. }), Direction::Upstream) => {
            return Err(fail(
                "a {batch} frame; a subscriber sends single {id,msg} frames".to_owned(),
            ));
        }
        (Envelope::Frame(Frame::Message { .. }) | Envelope::Bare(_), Direction::Upstream)
            if !duplex =>
        {
            return Err(fail(
                "an application message; below v7 a subscriber sends only {ack} frames".to_owned(),
            ));
        }
        _ => {}
    }
    for message in envelope.messages() {
        check_message(message, version, direction).map_err(fail)?;
    }
    Ok(())
}

fn check_message(message: &Message, version: u32, direction: Direction) -> Result<(), String> {
    let downstream = match (message, direction) {
        (Message::Downstream(m), Direction::Downstream) => m,
        (Message::Upstream(_), Direction::Upstream) => return Ok(()),
        (Message::Upstream(_), Direction::Downstream) => {
            return Err("an upstream message (reserve-snapshot / start-subscription)".to_owned());
        }
        (Message::Downstream(_), Direction::Upstream) => {
            return Err("a downstream message".to_owned());
        }
    };
    let since = |tag: &str, first: u32| {
        if version >= first {
            Ok(())
        } else {
            Err(format!("{tag} is sent from protocol v{first}"))
        }
    };
    match downstream {
        DownstreamMessage::Status(_) => since("status", 2),
        DownstreamMessage::Reserved(_) => since("reserved", 7),
        DownstreamMessage::Data(change) => check_change(change, version, since),
        _ => Ok(()),
    }
}

fn check_change(
    change: &Change,
    version: u32,
    since: impl Fn(&str, u32) -> Result<(), String>,
) -> Result<(), String> {
    let legacy = |relations: &[&Relation]| {
        if version >= 5 {
            return Ok(());
        }
        match relations.iter().find(|r| !r.has_legacy_key()) {
            Some(r) => Err(format!(
                "relation {}.{} lacks keyColumns, which subscribers below v5 need",
                r.schema, r.name
            )),
            None => Ok(()),
        }
    };
    match change {
        Change::Insert(c) => legacy(&[&c.relation]),
        Change::Update(c) => legacy(&[&c.relation]),
        Change::Delete(c) => legacy(&[&c.relation]),
        Change::Truncate(c) => legacy(&c.relations.iter().collect::<Vec<_>>()),
        Change::UpdateTableMetadata(_) => since("update-table-metadata", 5),
        Change::Backfill(_) => since("backfill", 6),
        Change::BackfillCompleted(_) => since("backfill-completed", 6),
        Change::AddColumn(add) => match add.column.spec.dflt.as_ref().and_then(Option::as_deref) {
            Some(dflt) => lite_default(dflt).map(|_| ()).map_err(|e| {
                format!(
                    "add-column {}.{}: {e}; a replicator stops on it, so send dflt null with a backfill",
                    add.table.name, add.column.name
                )
            }),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::change_stream::decode_envelope;

    fn check(line: &str, version: u32, direction: Direction) -> Result<(), String> {
        let envelope = decode_envelope(line).expect("well-formed");
        check_traffic(&envelope, version, direction).map_err(|e| e.to_string())
    }

    const BEGIN: &str = r#"{"id":1,"msg":["begin",{"tag":"begin"},{"commitWatermark":"0a"}]}"#;
    const BATCH: &str = r#"{"id":1,"batch":[["commit",{"tag":"commit"},{"watermark":"0a"}]]}"#;
    const ACK: &str = r#"{"ack":1}"#;
    const RESERVED: &str = r#"{"id":1,"msg":["reserved",{"tag":"snapshot","backupURL":"u","replicaVersion":"0a","minWatermark":"0a"}]}"#;
    const RESERVE: &str = r#"{"id":1,"msg":["reserve-snapshot",{"taskID":"t"}]}"#;

    #[test]
    fn framing_per_version_and_direction() {
        use Direction::{Downstream as D, Upstream as U};
        let cases: &[(&str, u32, Direction, bool)] = &[
            (BEGIN, 6, D, true),
            (BATCH, 6, D, false),
            (BATCH, 7, D, true),
            (ACK, 6, D, false),
            (ACK, 7, D, true),
            (ACK, 6, U, true),
            (BEGIN, 6, U, false),
            (RESERVE, 6, U, false),
            (RESERVE, 7, U, true),
            (RESERVE, 7, D, false),
            (BEGIN, 8, U, false),
            (BATCH, 8, U, false),
            (RESERVED, 6, D, false),
            (RESERVED, 7, D, true),
            (BEGIN, 0, D, false),
            (BEGIN, 9, D, false),
        ];
        for (line, version, direction, ok) in cases {
            let got = check(line, *version, *direction);
            assert_eq!(got.is_ok(), *ok, "{line} v{version} {direction:?}: {got:?}");
        }
        let err = check(BATCH, 6, D).unwrap_err();
        assert_eq!(
            err,
            "not valid v6 downstream traffic: a {batch} frame; below v7 a subscriber accepts only {id,msg} frames"
        );
    }

    #[test]
    fn messages_a_version_does_not_know() {
        use Direction::Downstream as D;
        let status = r#"["status",{"tag":"status"}]"#;
        assert!(check(status, 1, D).is_err());
        assert!(check(status, 2, D).is_ok());
        let meta = r#"["data",{"tag":"update-table-metadata","table":{"schema":"public","name":"t"},
            "old":{"rowKey":{}},"new":{"rowKey":{}}}]"#;
        assert!(check(meta, 4, D).is_err());
        assert!(check(meta, 5, D).is_ok());
        let done = r#"["data",{"tag":"backfill-completed","relation":{"schema":"public","name":"t",
            "rowKey":{"columns":["id"]}},"columns":[],"watermark":"0a"}]"#;
        assert!(check(done, 5, D).is_err());
        assert!(check(done, 6, D).is_ok());
        let modern = r#"["data",{"tag":"insert","relation":{"schema":"public","name":"t",
            "rowKey":{"columns":["id"]}},"new":{"id":1}}]"#;
        let legacy = r#"["data",{"tag":"insert","relation":{"schema":"public","name":"t",
            "rowKey":{"columns":["id"]},"keyColumns":["id"]},"new":{"id":1}}]"#;
        assert!(check(modern, 4, D).is_err());
        assert!(check(legacy, 4, D).is_ok());
        assert!(check(modern, 5, D).is_ok());
    }

    /// The message that stopped a Zero 1.9 view-syncer: `add-column` with `"dflt":"now()"`
    /// (and a backfill) fails in its replicator with "Unsupported default value".
    #[test]
    fn an_add_column_default_a_replicator_cannot_map_is_invalid_downstream() {
        let add = |dflt: &str, backfill: &str| {
            format!(
                r#"["data",{{"tag":"add-column","table":{{"schema":"public","name":"issue"}},
                "column":{{"name":"updated","spec":{{"pos":3,"dataType":"timestamptz","dflt":{dflt}}}}}{backfill}}}]"#
            )
        };
        let backfill = r#","backfill":{"attNum":3}"#;
        let err = check(&add(r#""now()""#, backfill), 6, Direction::Downstream).unwrap_err();
        assert!(err.contains("Unsupported default value: now()"), "{err}");
        assert!(check(&add(r#""now()""#, ""), 6, Direction::Downstream).is_err());
        assert!(check(&add("null", backfill), 6, Direction::Downstream).is_ok());
        assert!(check(&add(r#""5""#, ""), 6, Direction::Downstream).is_ok());
    }
}
