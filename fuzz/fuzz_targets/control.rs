//! Control-message framing: the decoder never panics, and whatever it
//! accepts is canonical: encoding it into a buffer of its encoded length
//! reproduces exactly the input.
#![no_main]

use gdr_core::engine::wire::Control;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = Control::decode(data) {
        assert_eq!(message.encoded_len(), data.len(), "{message:?}: length");
        let mut out = vec![0u8; message.encoded_len()];
        let written = message
            .encode_into(&mut out)
            .expect("a decoded message encodes");
        assert_eq!(written, data.len(), "{message:?}: bytes written");
        assert_eq!(out, data, "{message:?}: round-trips byte for byte");
        assert_eq!(Control::decode(&out), Ok(message), "and decodes again");
    }
});
