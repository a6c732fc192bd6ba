//! `gdr://` buffer URIs: the parser never panics, and every accepted input
//! has exactly one spelling (printing it gives the input back, byte for
//! byte) and states a range inside its allocation.
#![no_main]

use gdr_core::uri::{BufferUri, MAX_URI_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(uri) = text.parse::<BufferUri>() else {
        return;
    };
    assert_eq!(uri.to_string(), text, "a URI has one spelling");
    assert!(text.len() <= MAX_URI_LEN);
    uri.validate().expect("an accepted URI is valid");
    assert!(uri.size() > 0);
    if let Some(allocation) = uri.allocation() {
        let end = uri.offset().checked_add(uri.size());
        assert!(end.is_some_and(|end| end <= allocation), "the range is inside");
    }
});
