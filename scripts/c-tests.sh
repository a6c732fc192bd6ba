#!/bin/bash
# c-tests.sh: the C ABI from C. Builds libgdr (gdr-ffi) and, against
# include/gdr.h, tests/c/abi.c (buffers, URIs between two contexts, every
# promised refusal, a second dlopen'ed copy of the library, the doctor's
# JSON report), transfer.c (two
# engines of one process: grants, descriptors, batched READs and WRITEs of
# host and device memory, the refusals, the stream-ordered fences both ways
# where the context has a GPU) and hostile.c (generated from gdr.h:
# every export fed zero, NULL, freed and short arguments). uri_share.c
# shares a GPU buffer between two processes by its gdr:// URI (the sim's
# IPC across processes). Each runs twice, on the simulation
# (GDR_BACKEND=sim): built with gcc's AddressSanitizer (leaks included)
# and UBSan, and without them under Valgrind (the Rust side's memory
# checked there). No suppressions.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
TARGET=$(cargo_target_dir)
OUT="$TARGET/c-tests"
LIB="$TARGET/debug"
mkdir -p "$OUT"
cargo build -p gdr-ffi
python3 gdr-ffi/tests/c/gen_hostile.py gdr-ffi/include/gdr.h "$OUT/hostile.c"
# A second file of the same library: dlopen loads it as another instance.
cp "$LIB/libgdr.so" "$OUT/libgdr-copy.so"
CFLAGS=(-std=c11 -Wall -Wextra -Werror -g -pthread -I gdr-ffi/include -I gdr-ffi/tests/c)
LINK=(-L "$LIB" -lgdr -ldl -Wl,-rpath,"$LIB")
failed=0
for test in abi transfer uri_share hostile; do
  src="gdr-ffi/tests/c/$test.c"
  [ "$test" = hostile ] && src="$OUT/hostile.c"
  gcc "${CFLAGS[@]}" -fsanitize=address,undefined -fno-omit-frame-pointer \
    -fno-sanitize-recover=undefined "$src" "${LINK[@]}" -o "$OUT/$test-asan"
  gcc "${CFLAGS[@]}" "$src" "${LINK[@]}" -o "$OUT/$test"
  echo "== $test (gcc ASan + UBSan)"
  # allocator_may_return_null: a size malloc refuses is NULL, as in libc
  # (abi.c asks for 64 TiB and expects an error back, not ASan's abort).
  GDR_BACKEND=sim ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=1 \
    "$OUT/$test-asan" "$OUT/libgdr-copy.so" || failed=1
  echo "== $test (Valgrind memcheck)"
  GDR_BACKEND=sim valgrind -q --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite \
    --show-possibly-lost=no "$OUT/$test" "$OUT/libgdr-copy.so" || failed=1
done
exit $failed
