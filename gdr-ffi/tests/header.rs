//! `include/gdr.h` is what cbindgen makes of the crate now: CI fails when
//! an export changes and the committed header does not. With `GDR_BLESS=1`
//! the test writes the header instead.

use std::path::Path;

#[test]
fn the_committed_header_is_what_cbindgen_generates() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the crate")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    let path = crate_dir.join("include/gdr.h");
    if std::env::var("GDR_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("write include/gdr.h");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/gdr.h is stale: run `GDR_BLESS=1 cargo test -p gdr-ffi --test header` and commit it"
    );
}
