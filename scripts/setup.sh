#!/bin/bash
# Everything a fresh Debian 12 machine lacks to build and test gdr, as root.
# Idempotent: a second run installs nothing.
#  - cmake, clang, libclang-dev: rdma-mummy-sys builds its loader shim with
#    cmake and runs bindgen at build time;
#  - gcc (with its ASan and UBSan runtimes), Valgrind and python3: the C
#    ABI's tests (scripts/c-tests.sh); python3-venv: the Python package's
#    (scripts/python-tests.sh: a virtual environment, its tools from PyPI);
#  - rustfmt and clippy, where rustup lacks them;
#  - the SoftRoCE VM (softroce/setup.sh): QEMU, rdma-core's libraries and
#    tools, a Debian kernel and the guest initramfs.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export DEBIAN_FRONTEND=noninteractive
PKGS="cmake clang libclang-dev pkg-config gcc valgrind python3 python3-venv"
MISSING=
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || MISSING="$MISSING $p"
done
if [ -n "$MISSING" ]; then
  echo "setup: installing$MISSING" >&2
  apt-get update -qq
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends $MISSING > /dev/null
fi
if command -v rustup > /dev/null; then
  rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
  rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
fi
[ "${1:-}" = --no-vm ] || "$ROOT/softroce/setup.sh"
