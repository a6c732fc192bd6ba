#!/bin/bash
# features.sh: each crate builds with its own features, not the union
# `cargo test --workspace` compiles. `cargo check` (not test: it is the
# features that are in question, and check is a fraction of the time) of
#   - hal-verbs, hal-cuda, gdr-sim, gdr-proto, gdr-ffi, gdr-bench, gdr-cli: every feature alone,
#     none, and the defaults (cargo hack --each-feature);
#   - gdr-core: no feature, `sim`, `rdma`+`cuda`, and each combination
#     with `sim`; `tokio` (the async driver) alone and with `sim`; `rdma`
#     or `cuda` alone must be refused with its compile_error (the run-time
#     backend choice needs a verbs and a CUDA backend); `doctor` with `sim`
#     and with `rdma`+`cuda`, and alone refused (it needs a backend);
#     `testing` (the test hooks) alone and with `sim`;
# then what the README promises a build leaves out: gdr-core with no
# feature, with `sim` only, with `sim` and `tokio` or with `sim` and `doctor`, hal-verbs without
# `rdma-core` and hal-cuda without `cuda` link nothing native (no
# rdma-mummy-sys, cudarc or libloading in their dependency trees).
# (The async driver's tests run with the rest: gdr-tests enables
# gdr-core's `tokio`, so `cargo test --workspace` builds it.)
# Dev-dependencies play no part: only libraries and binaries are checked,
# and the resolver does not unify dev-dependencies' features into them.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PATH="$("$ROOT/scripts/ci-tools.sh"):$PATH" || exit 1
failed=0
note() { echo "features: $*"; }
fail() { echo "features: FAILED: $*" >&2; failed=1; }

cargo hack check --each-feature -p hal-verbs -p hal-cuda -p gdr-sim -p gdr-proto -p gdr-ffi -p gdr-bench -p gdr-cli \
  || fail "cargo hack --each-feature"

for features in "" sim rdma cuda doctor "rdma,cuda" "sim,rdma" "sim,cuda" "sim,rdma,cuda" tokio "sim,tokio" \
  "sim,doctor" "rdma,cuda,doctor" testing "sim,testing"; do
  note "gdr-core --features '$features'"
  cargo check -q -p gdr-core --no-default-features --features "$features" \
    || fail "gdr-core with features '$features'"
done
# native PACKAGE ARGS...: the native-facing crates in PACKAGE's tree.
native() {
  local package=$1; shift
  cargo tree -q -p "$package" -e normal,build --prefix none "$@" \
    | grep -oE '^(rdma-mummy-sys|cudarc|libloading) ' | sort -u | tr -d ' ' | tr '\n' ' '
}
for build in "gdr-core --no-default-features" "gdr-core --no-default-features --features sim" \
  "gdr-core --no-default-features --features sim,tokio" \
  "gdr-core --no-default-features --features sim,doctor" \
  "hal-verbs --no-default-features" "hal-cuda --no-default-features"; do
  # shellcheck disable=SC2086  # the words of $build are arguments
  found=$(native $build)
  if [ -n "$found" ]; then fail "$build pulls in $found"; else note "$build: nothing native"; fi
done
exit $failed
