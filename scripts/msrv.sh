#!/bin/bash
# msrv.sh: the workspace's `rust-version` is true. CI has the stable
# toolchain only, so the declared minimum is never built; what keeps it
# true instead:
#   - this check: no package in Cargo.lock (dependencies at the locked
#     versions, dev-dependencies included) declares a newer rust-version
#     than the workspace does, and the workspace declares none older than
#     the language features it uses (let-chains: 1.88);
#   - clippy's `incompatible_msrv` (in the clippy stage) refuses a
#     standard-library API newer than the declaration.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
meta=$(mktemp)
trap 'rm -f "$meta"' EXIT
cargo metadata --locked --format-version 1 >"$meta"
python3 - "$meta" "$(rustc --version)" <<'PY'
import json, sys
LANGUAGE_FLOOR = (1, 88, 0)  # let-chains (edition 2024), used throughout
meta, rustc = json.load(open(sys.argv[1])), sys.argv[2]
def version(text):
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))
def dotted(v):
    return ".".join(map(str, v))
members = set(meta["workspace_members"])
declared = {version(p["rust_version"]) for p in meta["packages"] if p["id"] in members}
if len(declared) != 1:
    sys.exit(f"msrv: the workspace members declare {sorted(declared)}: one rust-version for all")
(msrv,) = declared
if msrv < LANGUAGE_FLOOR:
    sys.exit(f"msrv: rust-version {dotted(msrv)} is older than the let-chains the code uses "
             f"({dotted(LANGUAGE_FLOOR)})")
needs = sorted(
    (version(p["rust_version"]), p["name"], p["version"])
    for p in meta["packages"]
    if p["id"] not in members and p.get("rust_version")
)
newer = [n for n in needs if n[0] > msrv]
for need, name, ver in newer:
    print(f"msrv: {name} {ver} needs Rust {dotted(need)}", file=sys.stderr)
if newer:
    sys.exit(f"msrv: rust-version {dotted(msrv)} is older than the locked dependencies need")
need, name, ver = needs[-1]
print(f"msrv: rust-version {dotted(msrv)} declared; the newest any locked dependency needs is "
      f"{dotted(need)} ({name} {ver}); built with {rustc}")
PY
