//! The connection handshake: hellos and reject reasons. The decoders never
//! panic, and whatever they accept re-encodes to exactly the input and
//! decodes again to the same value.
#![no_main]

use gdr_core::engine::wire::{Hello, RejectReason};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(hello) = Hello::decode(data) {
        assert_eq!(hello.validate(), Ok(()), "a decoded hello is valid");
        let encoded = hello.encode();
        assert_eq!(encoded, data, "a hello round-trips byte for byte");
        assert_eq!(Hello::decode(&encoded), Ok(hello), "and decodes again");
    }
    if let Ok(reason) = RejectReason::decode(data) {
        let encoded = reason.encode();
        assert_eq!(encoded, data, "a reject round-trips byte for byte");
        assert_eq!(
            RejectReason::decode(&encoded),
            Ok(reason),
            "and decodes again"
        );
    }
});
