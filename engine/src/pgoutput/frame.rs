//! Streaming replication framing (the CopyData payloads of `START_REPLICATION`): XLogData and
//! primary keepalive from the server, the standby status update back to it.

use super::reader::Reader;
use super::{DecodeError, TagByte};
use crate::watermark::Lsn;

/// Unix milliseconds at the Postgres epoch, 2000-01-01 00:00:00 UTC.
pub const PG_EPOCH_UNIX_MS: i64 = 946_684_800_000;

/// A Postgres `TimestampTz` on the wire: microseconds since 2000-01-01 00:00:00 UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PgTimestamp(pub i64);

impl PgTimestamp {
    /// The Postgres timestamp of a Unix time in milliseconds (saturating at the i64 range).
    pub fn from_unix_ms(unix_ms: i64) -> Self {
        PgTimestamp(
            unix_ms
                .saturating_sub(PG_EPOCH_UNIX_MS)
                .saturating_mul(1000),
        )
    }

    /// Unix milliseconds, rounded down (towards the past) to whole milliseconds.
    pub fn to_unix_ms(self) -> i64 {
        self.0.div_euclid(1000) + PG_EPOCH_UNIX_MS
    }
}

/// One CopyData message of a logical replication stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationFrame<'a> {
    XLogData(XLogData<'a>),
    Keepalive(PrimaryKeepalive),
}

/// `w`: WAL data; for logical replication the payload is one pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XLogData<'a> {
    pub wal_start: Lsn,
    pub wal_end: Lsn,
    pub send_time: PgTimestamp,
    pub payload: &'a [u8],
}

/// `k`: the server's end of WAL, and whether it wants a status update at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrimaryKeepalive {
    pub wal_end: Lsn,
    pub send_time: PgTimestamp,
    pub reply_requested: bool,
}

impl<'a> ReplicationFrame<'a> {
    /// Decodes one CopyData payload; the XLogData payload is borrowed, not copied.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, DecodeError> {
        let mut r = Reader::new(bytes, "replication frame");
        match r.u8("frame tag")? {
            b'w' => {
                let mut r = Reader::new(&bytes[1..], "XLogData");
                let wal_start = Lsn(r.u64("WAL start")?);
                let wal_end = Lsn(r.u64("WAL end")?);
                let send_time = PgTimestamp(r.i64("send time")?);
                let payload = r.take(r.remaining(), "payload")?;
                Ok(ReplicationFrame::XLogData(XLogData {
                    wal_start,
                    wal_end,
                    send_time,
                    payload,
                }))
            }
            b'k' => {
                let mut r = Reader::new(&bytes[1..], "primary keepalive");
                let wal_end = Lsn(r.u64("WAL end")?);
                let send_time = PgTimestamp(r.i64("send time")?);
                let reply_requested = r.u8("reply-requested flag")? != 0;
                r.finish()?;
                Ok(ReplicationFrame::Keepalive(PrimaryKeepalive {
                    wal_end,
                    send_time,
                    reply_requested,
                }))
            }
            tag => Err(DecodeError::UnknownFrameTag { tag: TagByte(tag) }),
        }
    }
}

/// `r`: the standby status update a client sends to acknowledge WAL positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandbyStatusUpdate {
    pub write_lsn: Lsn,
    pub flush_lsn: Lsn,
    pub apply_lsn: Lsn,
    pub client_time: PgTimestamp,
    pub reply_requested: bool,
}

impl StandbyStatusUpdate {
    /// Encoded length: tag, three LSNs, client time, reply-requested flag.
    pub const LEN: usize = 34;

    /// Acknowledges `lsn` as written, flushed and applied at `now_unix_ms`, asking for no reply.
    pub fn acknowledging(lsn: Lsn, now_unix_ms: i64) -> Self {
        StandbyStatusUpdate {
            write_lsn: lsn,
            flush_lsn: lsn,
            apply_lsn: lsn,
            client_time: PgTimestamp::from_unix_ms(now_unix_ms),
            reply_requested: false,
        }
    }

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut out = [0u8; Self::LEN];
        out[0] = b'r';
        out[1..9].copy_from_slice(&self.write_lsn.0.to_be_bytes());
        out[9..17].copy_from_slice(&self.flush_lsn.0.to_be_bytes());
        out[17..25].copy_from_slice(&self.apply_lsn.0.to_be_bytes());
        out[25..33].copy_from_slice(&self.client_time.0.to_be_bytes());
        out[33] = u8::from(self.reply_requested);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn xlog(start: u64, end: u64, time: i64, payload: &[u8]) -> Vec<u8> {
        let mut out = vec![b'w'];
        out.extend_from_slice(&start.to_be_bytes());
        out.extend_from_slice(&end.to_be_bytes());
        out.extend_from_slice(&time.to_be_bytes());
        out.extend_from_slice(payload);
        out
    }

    fn keepalive(end: u64, time: i64, reply: u8) -> Vec<u8> {
        let mut out = vec![b'k'];
        out.extend_from_slice(&end.to_be_bytes());
        out.extend_from_slice(&time.to_be_bytes());
        out.push(reply);
        out
    }

    #[test]
    fn xlogdata_fields_and_borrowed_payload_are_decoded() {
        let bytes = xlog(0x1_0000_0010, 0x1_0000_0020, 12345, b"B-payload");
        let ReplicationFrame::XLogData(x) = ReplicationFrame::decode(&bytes).unwrap() else {
            panic!("expected XLogData");
        };
        assert_eq!(x.wal_start, Lsn(0x1_0000_0010));
        assert_eq!(x.wal_end, Lsn(0x1_0000_0020));
        assert_eq!(x.send_time, PgTimestamp(12345));
        assert_eq!(x.payload, b"B-payload");
        assert_eq!(x.payload.as_ptr(), bytes[25..].as_ptr());
    }

    #[test]
    fn keepalive_reply_requested_flag_is_decoded() {
        for (byte, expected) in [(0u8, false), (1, true)] {
            let bytes = keepalive(0x16_B374_D848, -7, byte);
            let frame = ReplicationFrame::decode(&bytes).unwrap();
            assert_eq!(
                frame,
                ReplicationFrame::Keepalive(PrimaryKeepalive {
                    wal_end: Lsn(0x16_B374_D848),
                    send_time: PgTimestamp(-7),
                    reply_requested: expected,
                })
            );
        }
    }

    #[test]
    fn every_truncation_of_a_frame_is_an_error() {
        let k = keepalive(5, 6, 1);
        for len in 0..k.len() {
            assert!(
                ReplicationFrame::decode(&k[..len]).is_err(),
                "keepalive prefix {len}"
            );
        }
        let w = xlog(1, 2, 3, b"");
        for len in 0..w.len() {
            assert!(
                ReplicationFrame::decode(&w[..len]).is_err(),
                "xlogdata prefix {len}"
            );
        }
    }

    #[test]
    fn keepalive_with_trailing_bytes_and_unknown_tags_are_rejected() {
        let mut k = keepalive(5, 6, 0);
        k.push(0);
        assert!(matches!(
            ReplicationFrame::decode(&k),
            Err(DecodeError::TrailingBytes { extra: 1, .. })
        ));
        let err = ReplicationFrame::decode(b"x123").unwrap_err();
        assert_eq!(err, DecodeError::UnknownFrameTag { tag: TagByte(b'x') });
        assert!(err.to_string().contains("'x'"), "{err}");
    }

    #[test]
    fn standby_status_update_is_34_bytes_in_wire_order() {
        let update = StandbyStatusUpdate {
            write_lsn: Lsn(0x0102_0304_0506_0708),
            flush_lsn: Lsn(0x1112_1314_1516_1718),
            apply_lsn: Lsn(0x2122_2324_2526_2728),
            client_time: PgTimestamp(0x3132_3334_3536_3738),
            reply_requested: true,
        };
        let bytes = update.encode();
        assert_eq!(bytes.len(), 34);
        assert_eq!(bytes[0], b'r');
        assert_eq!(bytes[1..9], [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            bytes[9..17],
            [0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18]
        );
        assert_eq!(
            bytes[17..25],
            [0x21, 0x22, 0x23, 0x24, 0x25, 0x26, 0x27, 0x28]
        );
        assert_eq!(
            bytes[25..33],
            [0x31, 0x32, 0x33, 0x34, 0x35, 0x36, 0x37, 0x38]
        );
        assert_eq!(bytes[33], 1);
    }

    #[test]
    fn acknowledging_sets_all_three_lsns_and_the_postgres_epoch_clock() {
        // 2000-01-01T00:00:01.5Z is 1.5 s after the Postgres epoch.
        let update = StandbyStatusUpdate::acknowledging(Lsn(42), PG_EPOCH_UNIX_MS + 1500);
        assert_eq!(update.write_lsn, Lsn(42));
        assert_eq!(update.flush_lsn, Lsn(42));
        assert_eq!(update.apply_lsn, Lsn(42));
        assert_eq!(update.client_time, PgTimestamp(1_500_000));
        assert_eq!(update.encode()[33], 0);
    }

    #[test]
    fn pg_timestamp_converts_known_instants() {
        // 1970-01-01 is 946684800 s before the Postgres epoch.
        assert_eq!(PgTimestamp(-946_684_800_000_000).to_unix_ms(), 0);
        assert_eq!(PgTimestamp(0).to_unix_ms(), PG_EPOCH_UNIX_MS);
        // Sub-millisecond parts round towards the past, also before the epoch.
        assert_eq!(PgTimestamp(1999).to_unix_ms(), PG_EPOCH_UNIX_MS + 1);
        assert_eq!(PgTimestamp(-1).to_unix_ms(), PG_EPOCH_UNIX_MS - 1);
        assert_eq!(
            PgTimestamp::from_unix_ms(0),
            PgTimestamp(-946_684_800_000_000)
        );
    }

    proptest! {
        #[test]
        fn unix_ms_round_trips_through_pg_timestamp(ms in -(1i64 << 52)..(1i64 << 52)) {
            prop_assert_eq!(PgTimestamp::from_unix_ms(ms).to_unix_ms(), ms);
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_frame_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = ReplicationFrame::decode(&bytes);
        }

        #[test]
        fn xlogdata_round_trips(start: u64, end: u64, time: i64, payload in proptest::collection::vec(any::<u8>(), 0..32)) {
            let bytes = xlog(start, end, time, &payload);
            let ReplicationFrame::XLogData(x) = ReplicationFrame::decode(&bytes).unwrap() else {
                panic!("expected XLogData");
            };
            prop_assert_eq!((x.wal_start, x.wal_end, x.send_time, x.payload), (Lsn(start), Lsn(end), PgTimestamp(time), &payload[..]));
        }
    }
}
