//! Arbitrary bytes as a change-stream line (frame or bare message): decoding never panics, and
//! whatever decodes re-encodes to text that decodes to the same value and encodes identically.
#![no_main]

use highwater_engine::change_stream::{
    decode_downstream_frame, decode_envelope, decode_upstream_frame,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(envelope) = decode_envelope(text) {
        let encoded = envelope.encode();
        let again = match decode_envelope(&encoded) {
            Ok(again) => again,
            Err(e) => panic!("re-encoded line does not decode: {e}\n{encoded}"),
        };
        assert_eq!(again, envelope, "decode(encode(x)) differs");
        assert_eq!(again.encode(), encoded, "encoding is not stable");
    }
    let _ = decode_downstream_frame(text);
    let _ = decode_upstream_frame(text);
});
