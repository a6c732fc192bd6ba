#!/bin/bash
# python-tests.sh: the Python package (gdr-py) as a user installs it, then
# its pytest suite on the simulation.
#   1. a virtual environment (<target>/py-venv, made once) with maturin,
#      pytest and numpy from PyPI;
#   2. the abi3 wheel built by maturin with the dev profile into the
#      workspace's target directory, so the dependencies host-tests
#      compiled are reused (gdr-core itself is rebuilt for the package's
#      own features);
#   3. the wheel installed (no index, no dependencies: the one just built);
#   4. the type stubs checked: stubtest compares gdr/_gdr.pyi with the
#      native module as built, and mypy --strict checks the package and its
#      examples against them;
#   5. pytest on gdr-py/tests. Its exit 5 (no test collected) is a failure
#      like any other.
# PYTHON picks the interpreter (default python3).
#
# With --pip: the README's `pip install ./gdr-py` into a fresh virtual
# environment, and the suite against it.
#
# With --rxe: the tests that need rdma-core (gdr-py/tests/test_rxe.py: two
# Python processes over rxe0), run inside the SoftRoCE guest with the
# environment and wheel a run without --rxe left (the guest boots with the
# host's /), GDR_EXPECT_RXE=1 so a missing device fails rather than skips.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
TARGET=$(cargo_target_dir)
VENV="$TARGET/py-venv"
WHEELS="$TARGET/wheels"
if [ "${1:-}" = --pip ]; then
  # The README's install, as a user runs it: a fresh virtual environment,
  # `pip install ./gdr-py` (maturin from PyPI builds the extension, release
  # profile), then the suite against that install (pytest and numpy added).
  fresh=$(mktemp -d)
  trap 'rm -rf "$fresh"' EXIT
  "${PYTHON:-python3}" -m venv "$fresh/venv"
  "$fresh/venv/bin/pip" install -q --disable-pip-version-check ./gdr-py
  "$fresh/venv/bin/pip" install -q --disable-pip-version-check "pytest>=7" "numpy>=1.21"
  cd gdr-py
  site=$("$fresh/venv/bin/python" -c 'import gdr, os; print(os.path.dirname(gdr.__file__))')
  case $site in "$fresh"/*) ;; *) echo "python-tests: gdr came from $site, not the install" >&2; exit 1 ;; esac
  status=0
  "$fresh/venv/bin/python" -m pytest -q -p no:cacheprovider tests || status=$?
  exit "$status"
fi
if [ "${1:-}" = --rxe ]; then
  [ -x "$VENV/bin/python" ] || { echo "python-tests: no $VENV (run without --rxe first)" >&2; exit 1; }
  cd gdr-py
  exec env GDR_EXPECT_RXE=1 "$ROOT/softroce/run-in-vm.sh" \
    "$VENV/bin/python" -m pytest -ra -p no:cacheprovider tests/test_rxe.py
fi
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "maturin>=1.8,<2" "pytest>=7" "numpy>=1.21" "mypy>=1.18"
rm -rf "$WHEELS"
"$VENV/bin/maturin" build --profile dev --manifest-path gdr-py/Cargo.toml --out "$WHEELS"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
  --force-reinstall "$WHEELS"/gdr-*.whl
cd gdr-py
"$VENV/bin/python" -m mypy.stubtest gdr._gdr
"$VENV/bin/python" -m mypy --strict python/gdr examples
status=0
"$VENV/bin/python" -m pytest -ra tests || status=$?
if [ "$status" = 5 ]; then
  echo "python-tests: pytest collected no test" >&2
fi
exit "$status"
