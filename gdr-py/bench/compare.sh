#!/bin/bash
# compare.sh: the Python package against the Rust API on the simulator,
# back to back in one run (the same workload: gdr-core's facade_rate
# example and bench/rate.py), then the ratios. Release builds of both.
#   gdr-py/bench/compare.sh [seconds per shape]   (default 3)
# Needs a virtual environment with maturin and numpy at $VENV (default
# target/py-venv, which scripts/python-tests.sh makes).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
seconds=${1:-3}
VENV=${VENV:-$ROOT/target/py-venv}
"$VENV/bin/maturin" build --release --manifest-path gdr-py/Cargo.toml --out target/wheels-release >/dev/null
"$VENV/bin/python" -m pip install -q --no-index --no-deps --force-reinstall target/wheels-release/gdr-*.whl
cargo build -q --release -p gdr-core --features sim --example facade_rate
out=$(mktemp)
trap 'rm -f "$out"' EXIT
target/release/examples/facade_rate "$seconds" | tee -a "$out"
"$VENV/bin/python" gdr-py/bench/rate.py "$seconds" | tee -a "$out"
awk '
  $1 == "rust" { rust[$2] = $3 }
  $1 == "python" { py[$2] = $3; us[$2] = $5; n[$2] = 1 }
  END {
    for (s in py) {
      base = s; sub(/-list$/, "", base)
      if (base in rust) printf "ratio %s python/rust batches/s %.2f\n", s, py[s] / rust[base]
    }
  }' "$out" | sort
