#!/bin/bash
# The whole test suite, from a fresh machine: set-up, then
#   1. every test on the host (simulation always; SoftRoCE and GPU tests skip
#      here with a printed reason; the guide's Rust examples as doc tests),
#      crates.io packaging, each package built from its .crate
#      (scripts/package-check.sh), the C ABI's C tests
#      (scripts/c-tests.sh), the guide's C examples (scripts/docs-check.sh),
#      the Python package's pytest suite (scripts/python-tests.sh);
#   2. the SoftRoCE harness self-test;
#   3. the rdma-core tests inside the SoftRoCE VM (the C ABI's, the Python
#      package's two processes, and each Rust test binary, which boots a
#      guest with rxe0, as cargo's runner); rdma_cm between two guests; the
#      transfer engine between two guests (two wires, then a guest killed),
#      and with the wire between them cut, pulled, flapping and impaired;
#   4. the loom models of gdr-core's concurrency, and each against its
#      mutants (scripts/loom-mutants.sh); gdr-proto's planted bugs against
#      its tests; the engine's planted bugs against the seeded soak
#      (scripts/soak-planted-bugs.py);
#   5. a short coverage-guided fuzz run of each parser (scripts/fuzz.sh).
# Prints each stage's time; exits non-zero if any stage failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

failed=0
stage setup "$ROOT/scripts/setup.sh" || exit 1
stage host-tests cargo test --workspace || failed=1
# Every publishable crate packs for crates.io and builds from its package
# (scripts/package-check.sh).
stage package "$ROOT/scripts/package-check.sh" || failed=1
# The C ABI from C: gcc's ASan + UBSan on the C side, Valgrind on the Rust side.
stage c-abi "$ROOT/scripts/c-tests.sh" || failed=1
# The user guide's C examples, built through pkg-config against libgdr.so
# and libgdr.a and run on the simulation (its Rust examples are doc tests,
# run by host-tests).
stage guide-examples "$ROOT/scripts/docs-check.sh" || failed=1
# The Python package: its wheel built (the dev profile, reusing host-tests'
# compiled dependencies), installed into a virtual environment, and its
# pytest suite on the simulation.
stage python "$ROOT/scripts/python-tests.sh" || failed=1
# The README's `pip install ./gdr-py` into a fresh virtual environment, and
# the suite against that install.
stage python-pip "$ROOT/scripts/python-tests.sh" --pip || failed=1
stage softroce-selftest "$ROOT/softroce/selftest.sh" || failed=1
# The C ABI's transfer test against rdma-core (rxe0) in the guest, the
# binary scripts/c-tests.sh built (host memory: the guest has no GPU).
stage c-abi-rxe env GDR_BACKEND=real "$ROOT/softroce/run-in-vm.sh" "$(cargo_target_dir)/c-tests/transfer" || failed=1
# The Python package on rdma-core: two Python processes over rxe0 in the
# guest (the environment and wheel the python stage built).
stage python-rxe "$ROOT/scripts/python-tests.sh" --rxe || failed=1
# Build on the host, run inside the guest: the runner boots one VM per binary.
rxe_tests=()
for t in tests/tests/rxe_*.rs; do
  [ -e "$t" ] && rxe_tests+=(--test "$(basename "$t" .rs)")
done
if [ ${#rxe_tests[@]} -gt 0 ]; then
  stage rxe-tests env GDR_EXPECT_RXE=1 \
    CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$ROOT/softroce/run-in-vm.sh" \
    cargo test -p gdr-tests "${rxe_tests[@]}" || failed=1
fi
# test_binary NAME: the path of tests/tests/NAME.rs's test binary, built.
# shellcheck disable=SC2317  # called by functions called through stage
test_binary() {
  cargo test -p gdr-tests --test "$1" --no-run 2>&1 \
    | sed -n "s/.*Executable tests\/$1.rs (\(.*\))\$/\1/p"
}
# rdma_cm between two guests on a virtual wire, then with the server guest
# killed mid-transfer (the client must see an error, not hang).
# shellcheck disable=SC2317  # called through stage
two_guest_cm() {
  local bin
  bin=$(test_binary rxe_cm)
  [ -x "$bin" ] || { echo "test: no rxe_cm test binary" >&2; return 1; }
  "$ROOT/softroce/two-guest-cm.sh" "$bin" && "$ROOT/softroce/two-guest-cm.sh" "$bin" --kill-server 2
}
if [ -e tests/tests/rxe_cm.rs ]; then
  stage two-guest-cm two_guest_cm || failed=1
fi
# The transfer engine between two guests joined by two wires: 32 MiB
# batches over rxe0, then over rxe0 and rxe1 at once, then the server's
# guest killed mid-batch; one boot for all three (~1.5 min under TCG).
# shellcheck disable=SC2317  # called through stage
two_guest_engine() {
  local bin
  bin=$(test_binary rxe_engine_wire)
  [ -x "$bin" ] || { echo "test: no rxe_engine_wire test binary" >&2; return 1; }
  "$ROOT/softroce/two-guest-engine.sh" "$bin" --kill-server 1 && return 0
  # Seen once in four runs on 2026-12-05: a 32 MiB WRITE between the two
  # TCG guests stalled to its 120 s deadline (the same binary passed when
  # run again). Run once more, saying so, while it is looked into (issue
  # 23's wire campaign); a second failure fails the stage.
  echo "two-guest-engine: FAILED; running it once more (a known intermittent stall, under investigation)" >&2
  "$ROOT/softroce/two-guest-engine.sh" "$bin" --kill-server 1
}
if [ -e tests/tests/rxe_engine_wire.rs ]; then
  stage two-guest-engine two_guest_engine || failed=1
fi
# The same engines with the wire between the guests really cut: silently
# (tc in guest B), by the cable pulled (qemu's set_link), past the
# reconnect bound, flapping for a minute, and impaired by netem; one boot
# for all five (4-5 min under TCG).
# No second run: a failure here is news about recovery.
# shellcheck disable=SC2317  # called through stage
two_guest_wire() {
  local bin
  bin=$(test_binary rxe_engine_wire)
  [ -x "$bin" ] || { echo "test: no rxe_engine_wire test binary" >&2; return 1; }
  "$ROOT/softroce/two-guest-wire.sh" "$bin"
}
if [ -e tests/tests/rxe_engine_wire.rs ]; then
  stage two-guest-wire two_guest_wire || failed=1
fi
# Every loom model, unbounded; then each mutant (a deliberate bug in the
# loom build) against the models named for it: each of those runs must fail.
stage loom "$ROOT/scripts/loom-mutants.sh" || failed=1
# Planted bugs in gdr-proto's peer-copy and gate protocols: its in-memory
# tests must catch each one.
# Incremental for this stage alone: each planted bug rebuilds gdr-proto and
# its tests, and the unchanged rest is reused (CI turns incremental off).
stage proto-mutants env CARGO_INCREMENTAL=1 python3 "$ROOT/scripts/proto-planted-bugs.py" || failed=1
# Planted bugs in the engine (a skipped lease, a double completion, an
# unbounded queue, a group told done early):
# the seeded soak (tests/tests/sim_soak.rs) must catch each within its
# seeds; each run stops at the first failure, at most 120 s.
stage soak-mutants env CARGO_INCREMENTAL=1 python3 "$ROOT/scripts/soak-planted-bugs.py" || failed=1
for target in descriptor handshake control uri; do
  stage "fuzz-$target" "$ROOT/scripts/fuzz.sh" "${GDR_FUZZ_SECONDS:-20}" "$target" || failed=1
done
summary
exit $failed
