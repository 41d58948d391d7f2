//! Arbitrary bytes as a replication session: a sequence of CopyData frames, each behind a
//! big-endian u16 length (a short tail is the last frame). Every frame goes through XLogData /
//! keepalive framing, pgoutput decoding and mapping; nothing panics, and every change-stream
//! message the mapper emits encodes to text that decodes back to the same message.
#![no_main]

use highwater_engine::change_stream::{decode_downstream, encode_downstream};
use highwater_engine::pgoutput::{PgoutputEvent, PgoutputMapper};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut mapper = PgoutputMapper::new();
    let mut rest = data;
    while !rest.is_empty() {
        let frame = match rest {
            [hi, lo, body @ ..] => {
                let len = usize::from(u16::from_be_bytes([*hi, *lo])).min(body.len());
                let (frame, tail) = body.split_at(len);
                rest = tail;
                frame
            }
            _ => std::mem::take(&mut rest),
        };
        if let Ok(Some(PgoutputEvent::Downstream(message))) = mapper.map_frame(frame) {
            let text = encode_downstream(&message);
            let again = match decode_downstream(&text) {
                Ok(again) => again,
                Err(e) => panic!("mapped message does not decode: {e}\n{text}"),
            };
            assert_eq!(again, message, "decode(encode(x)) differs: {text}");
        }
    }
});
