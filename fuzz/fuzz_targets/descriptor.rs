//! Memory descriptors v2, binary and text: the parsers never panic, every
//! accepted input has exactly one spelling (re-encoding gives the input back,
//! byte for byte), and the two forms carry the same descriptor.
#![no_main]

use gdr_core::descriptor::{MAX_ENCODED_LEN, MAX_TEXT_LEN, MemoryDescriptor};
use libfuzzer_sys::fuzz_target;

/// Both forms of an accepted descriptor, each parsed back to it.
fn check_forms(descriptor: &MemoryDescriptor) {
    descriptor
        .validate()
        .expect("an accepted descriptor is valid");
    let bytes = descriptor.encode().expect("a valid descriptor encodes");
    assert!(bytes.len() <= MAX_ENCODED_LEN);
    let decoded = MemoryDescriptor::decode(&bytes).expect("own binary form decodes");
    assert_eq!(&decoded, descriptor, "binary form round-trips");
    let text = descriptor.to_string();
    assert!(text.len() <= MAX_TEXT_LEN);
    let parsed: MemoryDescriptor = text.parse().expect("own text form parses");
    assert_eq!(&parsed, descriptor, "text form round-trips");
    for device in descriptor.devices() {
        let first = descriptor
            .segment(device, 0, 1)
            .expect("a device reaches byte 0");
        assert_eq!(first.offset, 0);
        let last = descriptor
            .segment(device, descriptor.len - 1, 1)
            .expect("a device reaches the last byte");
        assert_eq!(last.offset + last.len, descriptor.len);
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(descriptor) = MemoryDescriptor::decode(data) {
        let encoded = descriptor.encode().expect("a decoded descriptor is valid");
        assert_eq!(encoded, data, "binary form has one spelling");
        check_forms(&descriptor);
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(descriptor) = text.parse::<MemoryDescriptor>()
    {
        assert_eq!(descriptor.to_string(), text, "text form has one spelling");
        check_forms(&descriptor);
    }
});
