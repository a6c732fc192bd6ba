#!/bin/bash
# fuzz.sh [SECONDS] [TARGET...]: coverage-guided fuzzing of gdr's parsers on
# the stable toolchain, with the instrumentation `cargo fuzz run -s none`
# uses (no sanitizer; `cargo +nightly fuzz run <target>` adds ASan). Seeds in
# fuzz/seeds/<target>; new corpus entries go to fuzz/corpus/<target>
# (ignored); a crash leaves its input in fuzz/artifacts/<target>/ and fails.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SECONDS_EACH=${1:-30}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(descriptor handshake control uri)
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
# With an explicit --target, RUSTFLAGS reach the fuzzed code but not build scripts.
TRIPLE=$(rustc -vV | sed -n "s/^host: //p")
cargo build --release --manifest-path "$ROOT/fuzz/Cargo.toml" --bins --target "$TRIPLE" \
  --target-dir "$ROOT/fuzz/target"
for t in "${TARGETS[@]}"; do
  mkdir -p "$ROOT/fuzz/corpus/$t" "$ROOT/fuzz/artifacts/$t"
  "$ROOT/fuzz/target/$TRIPLE/release/$t" -max_total_time="$SECONDS_EACH" -max_len=512 \
    -artifact_prefix="$ROOT/fuzz/artifacts/$t/" "$ROOT/fuzz/corpus/$t" "$ROOT/fuzz/seeds/$t"
done
