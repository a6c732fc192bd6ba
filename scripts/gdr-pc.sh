#!/bin/bash
# gdr-pc.sh: the pkg-config file of libgdr (gdr-ffi), and optionally an
# installation of the C library.
#
#   scripts/gdr-pc.sh [--profile debug|release]
#       writes <target>/<profile>/pkgconfig/gdr.pc pointing into this tree
#       (gdr-ffi/include, <target>/<profile>): for building against a clone;
#       <target> is cargo's target directory (CARGO_TARGET_DIR where set);
#   scripts/gdr-pc.sh --prefix DIR [--profile ...]
#       also installs DIR/include/gdr.h, DIR/lib/libgdr.so, DIR/lib/libgdr.a
#       and DIR/lib/pkgconfig/gdr.pc (the same file with DIR's paths).
#
# The library must be built first (cargo build [--release] -p gdr-ffi).
# Libs.private is what rustc says a static libgdr.a needs (for
# `pkg-config --static`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
profile=release
prefix=
while [ $# -gt 0 ]; do
  case $1 in
    --profile) profile=$2; shift 2 ;;
    --prefix) prefix=$2; shift 2 ;;
    *) echo "usage: $0 [--profile debug|release] [--prefix DIR]" >&2; exit 2 ;;
  esac
done
target=$(cargo_target_dir)
[ -n "$target" ] || { echo "gdr-pc: cargo metadata named no target directory" >&2; exit 1; }
build="$target/$profile"
for f in libgdr.so libgdr.a; do
  [ -f "$build/$f" ] || {
    echo "gdr-pc: $build/$f missing: cargo build $([ "$profile" = release ] && echo --release) -p gdr-ffi" >&2
    exit 1
  }
done
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
# The system libraries a static link needs, as rustc lists them (nothing
# native of rdma-core or CUDA: both are loaded at run time).
libs_private="-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc"
render() { # PREFIX LIBDIR INCLUDEDIR
  sed -e "s|@PREFIX@|$1|" -e "s|@LIBDIR@|$2|" -e "s|@INCLUDEDIR@|$3|" \
    -e "s|@VERSION@|$version|" -e "s|@LIBS_PRIVATE@|$libs_private|" gdr-ffi/gdr.pc.in
}
mkdir -p "$build/pkgconfig"
render "$ROOT" "$build" "$ROOT/gdr-ffi/include" >"$build/pkgconfig/gdr.pc"
echo "gdr-pc: wrote $build/pkgconfig/gdr.pc"
if [ -n "$prefix" ]; then
  install -D -m 644 gdr-ffi/include/gdr.h "$prefix/include/gdr.h"
  install -D -m 755 "$build/libgdr.so" "$prefix/lib/libgdr.so"
  install -D -m 644 "$build/libgdr.a" "$prefix/lib/libgdr.a"
  mkdir -p "$prefix/lib/pkgconfig"
  # shellcheck disable=SC2016  # pkg-config expands ${prefix}, not the shell
  render "$prefix" '${prefix}/lib' '${prefix}/include' >"$prefix/lib/pkgconfig/gdr.pc"
  echo "gdr-pc: installed gdr.h, libgdr.so, libgdr.a and gdr.pc under $prefix"
fi
