#!/bin/bash
# Instructions per request of the engine and of the bare HAL loop (the
# sim, 4 KiB, tests/benches/engine.rs), counted by callgrind over the
# measured loop only (set-up and warm-up left out), run for n and 2n
# batches: the difference over n batches is the steady state (the window's
# fill and drain cancel out). Prints one line per direction and batch size:
# bare, engine, bare/engine (the engine's rate relative to the bare loop's,
# as instructions go). The engine runs on the erased backends
# (`hal_verbs::dynamic`, `hal_cuda::dynamic`), as every engine does; the
# bare loop on the sim's own types.
#
# Usage: scripts/engine-callgrind.sh [iters]   (default 2000 batches)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
iters=${1:-2000}
command -v valgrind >/dev/null || { echo "engine-callgrind: valgrind is not installed" >&2; exit 1; }
bin=$(cargo bench -p gdr-tests --bench engine --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*\/engine-[^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "engine-callgrind: no bench binary" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
instructions() { # dir kind batch iters -> instructions in the measured loop
  GDR_BENCH_ONLY="$1/$2/$3" GDR_BENCH_ITERS=$4 valgrind --tool=callgrind \
    --collect-atstart=no --toggle-collect='*measured*' \
    --callgrind-out-file="$out/cg" "$bin" >/dev/null 2>"$out/log" ||
    { cat "$out/log" >&2; exit 1; }
  sed -n 's/^summary: \([0-9]*\).*/\1/p' "$out/cg"
}
count() { # dir kind batch -> instructions per request
  local one two
  one=$(instructions "$1" "$2" "$3" "$iters")
  two=$(instructions "$1" "$2" "$3" $((2 * iters)))
  echo $(((two - one) / (iters * $3)))
}
printf '%-6s %5s %12s %12s %7s\n' dir batch bare_Ir/req engine_Ir/req ratio
for dir in write read; do
  for b in 1 16 64; do
    bare=$(count "$dir" bare_hal "$b")
    engine=$(count "$dir" engine "$b")
    printf '%-6s %5s %12s %12s %7.2f\n' "$dir" "$b" "$bare" "$engine" \
      "$(echo "$bare / $engine" | bc -l)"
  done
done
