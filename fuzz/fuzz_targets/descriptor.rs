//! Memory descriptors, binary and text: the parsers never panic, and
//! whatever they accept re-encodes to exactly the input.
#![no_main]

use gdr_core::descriptor::MemoryDescriptor;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(descriptor) = MemoryDescriptor::decode(data) {
        let encoded = descriptor.encode().expect("a decoded descriptor is valid");
        assert_eq!(encoded, data, "binary form round-trips byte for byte");
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(descriptor) = text.parse::<MemoryDescriptor>()
    {
        let again: MemoryDescriptor = descriptor.to_string().parse().expect("own text parses");
        assert_eq!(again, descriptor, "text form round-trips");
    }
});
