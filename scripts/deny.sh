#!/bin/bash
# deny.sh: the dependency policy of deny.toml (cargo-deny): licences,
# bans (a second version of a crate needs a written reason) and sources
# (crates.io only). The advisories check needs the RustSec database, a git
# repository CI's machines cannot fetch (they reach crates.io, not git
# hosts): it runs only where a copy is already on disk, and is otherwise
# skipped with that reason printed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PATH="$("$ROOT/scripts/ci-tools.sh"):$PATH"
checks=(licenses bans sources)
db_root=${CARGO_HOME:-$HOME/.cargo}/advisory-dbs
if compgen -G "$db_root/*" >/dev/null; then
  checks+=(advisories)
else
  echo "deny: advisories SKIPPED: no advisory database under $db_root, and this machine cannot fetch one"
fi
# --offline: never fetch (the database included); the lock file decides.
cargo deny --offline --locked check "${checks[@]}"
