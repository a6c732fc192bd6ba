#!/bin/bash
# per-crate.sh: each workspace member's tests pass when it is built and
# run alone (`cargo test -p X`), with its own features: `cargo test
# --workspace` unifies the features of every member, so a crate whose
# tests or doc examples need a feature another member turns on (gdr-core's
# facade example needs `sim`) passes there and fails alone.
#
# Every member: `cargo test -p X` (its unit, integration and doc tests and
# examples, compiled and run), but for the tests crate (gdr-tests): all
# of its targets compiled alone (`--no-run`), and run only its library's
# tests, its doc tests and the suites that choose backends at run time
# (those naming `BackendChoice`, `run_with` or `Context::open`). Alone, it
# differs from the workspace run only in gdr-core's `rdma`, `cuda` and
# `doctor` features (other members turn them on), which change nothing but
# the backend choice (gdr-core's `backend` and `doctor`); its other suites,
# minutes of them, already ran under `cargo test --workspace`.
# Prints each crate's time.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
members=$(cargo metadata --no-deps --format-version 1 \
  | python3 -c 'import json, sys; print(" ".join(p["name"] for p in json.load(sys.stdin)["packages"]))') \
  || exit 1
# tests_alone: gdr-tests as described above.
tests_alone() {
  cargo test -p gdr-tests --no-run || return 1
  local suites=() t
  for t in $(grep -lE 'BackendChoice|run_with|Context::open' tests/tests/*.rs); do
    suites+=(--test "$(basename "$t" .rs)")
  done
  echo "per-crate: gdr-tests suites that choose backends: ${suites[*]}"
  cargo test -p gdr-tests --doc && cargo test -p gdr-tests --lib "${suites[@]}"
}
failed=0
for member in $members; do
  if [ "$member" = gdr-tests ]; then
    stage "alone-$member" tests_alone || failed=1
  else
    stage "alone-$member" cargo test -p "$member" || failed=1
  fi
done
summary
exit $failed
