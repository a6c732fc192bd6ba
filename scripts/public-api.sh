#!/bin/bash
# gdr-core's public API, as names, against the committed list
# (gdr-core/public-api.txt): fails with the difference when they differ, so
# every change to what users can name is seen in review. The API is read
# from rustdoc's pages with the features a user builds (sim, rdma, cuda,
# tokio, doctor; not `testing`, the tests' hooks): scripts/public-api.py.
#
# Usage: scripts/public-api.sh           check
#        scripts/public-api.sh --bless   write the list (then commit it)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
cargo doc -q -p gdr-core --no-deps --features sim,rdma,cuda,tokio,doctor
mode=--check
[ "${1:-}" = --bless ] && mode=--bless
python3 "$ROOT/scripts/public-api.py" "$(cargo_target_dir)/doc/gdr_core" "$mode" "$ROOT/gdr-core/public-api.txt"
