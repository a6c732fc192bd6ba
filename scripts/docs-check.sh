#!/bin/bash
# docs-check.sh: the user guide's C code is built, and the C library is
# usable the way the README and docs/guide.md say.
#   1. libgdr (debug) is installed with its header and pkg-config file into
#      a scratch prefix (scripts/gdr-pc.sh --prefix);
#   2. every docs/examples/*.c is compiled through `pkg-config gdr`, linked
#      against libgdr.so and, separately, statically against libgdr.a, and
#      both binaries run on the simulation backend (GDR_BACKEND=sim);
#   3. every ```c block of docs/guide.md is extracted and compiled (each is
#      a complete translation unit).
# The guide's Rust blocks are doc tests of gdr-core (`cargo test -p
# gdr-core --doc`, part of the host-tests stage).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
OUT="$(cargo_target_dir)/docs-check"
rm -rf "$OUT"
mkdir -p "$OUT"
cargo build -p gdr-ffi
"$ROOT/scripts/gdr-pc.sh" --profile debug --prefix "$OUT/prefix" >/dev/null
export PKG_CONFIG_PATH="$OUT/prefix/lib/pkgconfig"
CFLAGS=(-std=c11 -Wall -Wextra -Werror -g -pthread)
read -r -a cflags <<<"$(pkg-config --cflags gdr)"
read -r -a libs <<<"$(pkg-config --libs gdr)"
# The static link names the archive itself: -lgdr would take the .so beside it.
read -r -a static_libs <<<"$(pkg-config --static --libs gdr | sed "s|-lgdr|$OUT/prefix/lib/libgdr.a|")"
failed=0
shopt -s nullglob
for src in docs/examples/*.c; do
  name=$(basename "$src" .c)
  echo "== $src"
  if ! gcc "${CFLAGS[@]}" "${cflags[@]}" "$src" "${libs[@]}" \
    -Wl,-rpath,"$OUT/prefix/lib" -o "$OUT/$name"; then
    failed=1; continue
  fi
  gcc "${CFLAGS[@]}" "${cflags[@]}" "$src" "${static_libs[@]}" -o "$OUT/$name-static" || failed=1
  if ldd "$OUT/$name-static" | grep -q libgdr; then
    echo "docs: $name-static links libgdr.so" >&2; failed=1
  fi
  for bin in "$OUT/$name" "$OUT/$name-static"; do
    [ -x "$bin" ] || continue
    echo "-- $(basename "$bin") (GDR_BACKEND=sim)"
    GDR_BACKEND=sim "$bin" || { echo "docs: $bin failed" >&2; failed=1; }
  done
done
# The guide's C blocks, each a file of its own.
awk -v out="$OUT/guide" '
  /^```c[[:space:]]*$/ { n++; file = sprintf("%s-%d.c", out, n); inside = 1; next }
  /^```/ && inside { inside = 0; close(file); next }
  inside { print > file }
' docs/guide.md
for snippet in "$OUT"/guide-*.c; do
  echo "== docs/guide.md block $(basename "$snippet")"
  gcc "${CFLAGS[@]}" "${cflags[@]}" -c "$snippet" -o "${snippet%.c}.o" || failed=1
done
# The README's dependency line and Rust example as a user's crate has them:
# its first gdr-core line (the path stands in for crates.io) and its one
# Rust block as src/main.rs, built and run on its own.
echo "== README.md: the dependency line and the Rust example, as a crate of their own"
user="$OUT/readme-user"
mkdir -p "$user/src"
dep=$(sed -n '/^```toml/,/^```/p' README.md | grep -m1 '^gdr-core = ' |
  sed "s|version = \"0.1\"|version = \"0.1\", path = \"$ROOT/gdr-core\"|")
[ -n "$dep" ] || { echo "docs: no gdr-core line in the README's toml" >&2; exit 1; }
printf '[package]\nname = "readme-user"\nedition = "2024"\npublish = false\n\n[workspace]\n\n[dependencies]\n%s\n' "$dep" >"$user/Cargo.toml"
awk '/^```rust[[:space:]]*$/ { inside = 1; next } /^```/ && inside { inside = 0; next } inside { print }' \
  README.md >"$user/src/main.rs"
CARGO_TARGET_DIR="$(cargo_target_dir)" cargo run -q --manifest-path "$user/Cargo.toml" || failed=1
exit $failed
