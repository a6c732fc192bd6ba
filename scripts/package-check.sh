#!/bin/bash
# package-check.sh: every publishable crate packs for crates.io.
# The crates are packaged in one `cargo package` so that each one's
# workspace dependencies (not on crates.io yet) resolve to the others'
# packages; a crate packaged alone fails with "no matching package".
# Then each .crate is checked for size (crates.io takes at most 10 MiB;
# we want far less) and for a README, and no file in it may be large.
#
# Each package is verified (built from its own .crate, as a user of
# crates.io would): every one differs from the tree. gdr-sim, gdr-core,
# gdr-ffi and gdr-cli name workspace crates by path, which the package
# replaces by the packaged versions; every crate's Cargo.toml is
# normalised and gets only the files under its own folder (gdr-core's
# crate docs include ../docs/guide.md for doc tests only, so they are not
# in the package: its doc tests run from the tree, never the package).
# Verifying hal-verbs, hal-cuda and gdr-proto (no workspace dependency
# each) costs nearly nothing more: the other packages build them from
# their packages anyway.
# GDR_PACKAGE_VERIFY=0 skips verification (a quick look at the contents).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
# In dependency order; gdr-tests and the fuzz workspace are not published.
CRATES=(hal-verbs hal-cuda gdr-sim gdr-proto gdr-core gdr-ffi gdr-bench gdr-cli)
MAX_CRATE_BYTES=$((2 * 1024 * 1024))
MAX_FILE_BYTES=$((512 * 1024))
args=()
for c in "${CRATES[@]}"; do args+=(-p "$c"); done
verify=
[ "${GDR_PACKAGE_VERIFY:-1}" = 0 ] && verify=--no-verify
# Verification unpacks the packages of a local registry under
# $CARGO_HOME/registry/src/-<hash>/ (keyed by the registry's path) and never
# unpacks a version again that is there already: on a machine that ran this
# before (from the same folder), our own crates from that earlier tree would
# be built instead of these. Gone first (only our crates, only there).
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
for c in "${CRATES[@]}"; do
  rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/"$c-$version"
done
# Likewise the verification builds: cargo takes a registry crate's build
# as fresh by its name and version, so an earlier tree's gdr-core would be
# linked into this tree's gdr-bench.
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
packages="$(cargo_target_dir)/package"
rm -rf "$packages"
# And their builds in the target folder: a registry crate's build is fresh
# to cargo by name and version, so an earlier run's hal-cuda (built from
# that tree's package) was linked into this run's gdr-sim (which then
# missed `hal_cuda::dynamic`). Found by their dep-info naming the local
# registry's sources; each goes with its fingerprint.
deps="$(cargo_target_dir)/debug/deps"
ours=$(IFS='|'; echo "${CRATES[*]}")
for info in "$deps"/*.d; do
  [ -e "$info" ] || continue
  grep -qE "/registry/src/-[0-9a-f]+/($ours)-$version/" "$info" || continue
  hash=$(basename "$info" .d)
  hash=${hash##*-}
  rm -rf "$deps"/*-"$hash" "$deps"/*-"$hash".* "$(cargo_target_dir)"/debug/.fingerprint/*-"$hash"
done
# --allow-dirty: CI checks the tree as it is; a release is cut from a clean one.
cargo package --allow-dirty $verify "${args[@]}"
failed=0
for c in "${CRATES[@]}"; do
  crate="$packages/$c-$version.crate"
  if [ ! -f "$crate" ]; then echo "package: $crate missing" >&2; failed=1; continue; fi
  size=$(stat -c %s "$crate")
  if [ "$size" -gt "$MAX_CRATE_BYTES" ]; then
    echo "package: $crate is $size bytes (> $MAX_CRATE_BYTES)" >&2; failed=1
  fi
  listing=$(tar -tvzf "$crate")
  if ! grep -q " $c-$version/README.md$" <<<"$listing"; then
    echo "package: $crate has no README.md" >&2; failed=1
  fi
  big=$(awk -v max="$MAX_FILE_BYTES" '$3 > max { print $3, $6 }' <<<"$listing")
  if [ -n "$big" ]; then echo "package: large files in $crate:" >&2; echo "$big" >&2; failed=1; fi
  echo "package: $c $version: $size bytes, $(wc -l <<<"$listing") files"
done
# gdr-tests must never be published.
if ! grep -q '^publish = false' tests/Cargo.toml; then
  echo "package: tests/Cargo.toml lacks publish = false" >&2; failed=1
fi
exit $failed
