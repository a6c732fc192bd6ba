#!/bin/bash
# The main job, from a fresh machine: build gdr, list what this machine has
# (`gdr info`), then prove the data path with loopback RDMA through host and
# GPU memory (`gdr loopback`). Real RDMA devices and GPUs are used where
# found; otherwise gdr says so and runs on the simulation backend.
# Arguments go to `gdr loopback` (e.g. --size 64M, --backend sim).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
"$ROOT/scripts/setup.sh" --no-vm
cargo build --release -p gdr-cli
gdr="$(cargo_target_dir)/release/gdr"
"$gdr" info
"$gdr" loopback "$@"
