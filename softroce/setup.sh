#!/bin/bash
# setup.sh: one-time setup for run-in-vm.sh on Debian 12, as root. Idempotent:
# a second run installs and downloads nothing and takes about a second.
#  1. apt packages (apt-get update only when one is missing);
#  2. Debian's kernel .deb, downloaded and unpacked (never installed), and the
#     guest initramfs, into $RXEVM_CACHE (default: softroce/cache/), through
#     build-initramfs.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export RXEVM_CACHE=${RXEVM_CACHE:-$HERE/cache}
T0=$(date +%s.%N)
export DEBIAN_FRONTEND=noninteractive
# qemu-system-x86   the VM (TCG; KVM where there is hardware virtualization)
# busybox-static    the initramfs userland (must be static)
# iproute2          ip and rdma (rdma link add rxe0 ...), run from the shared root
# libibverbs1 ibverbs-providers  libibverbs and librxe (/etc/libibverbs.d/rxe.driver)
# librdmacm1        rdma_cm
# ibverbs-utils perftest  ibv_devices/ibv_devinfo, ib_write_bw & co. (selftest)
# xz-utils          to unpack the bzImage into an ELF vmlinux (faster boot)
PKGS="qemu-system-x86 busybox-static iproute2 libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils perftest xz-utils"
MISSING=
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || MISSING="$MISSING $p"
done
UPDATED=0
if [ -n "$MISSING" ]; then
  echo "softroce: installing$MISSING" >&2
  apt-get update -qq
  UPDATED=1
  # shellcheck disable=SC2086
  apt-get install -y -qq --no-install-recommends --no-upgrade $MISSING > /dev/null
fi
# The kernel download needs the apt lists; a fresh machine may have none.
if [ ! -f "$RXEVM_CACHE/vmlinuz" ] && [ "$UPDATED" = 0 ] \
   && ! apt-cache depends linux-image-amd64 2>/dev/null | grep -q 'Depends: linux-image-[0-9]'; then
  apt-get update -qq
fi
# Stale apt lists may name a kernel .deb the mirror no longer has: update, retry.
if ! "$HERE/build-initramfs.sh"; then
  [ "$UPDATED" = 0 ] || exit 1
  echo "softroce: retrying after apt-get update" >&2
  apt-get update -qq
  "$HERE/build-initramfs.sh"
fi
echo "softroce: setup done in $(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN { printf "%.1f", a - b }') s; cache $RXEVM_CACHE ($(du -sh "$RXEVM_CACHE" | cut -f1)), kernel $(cat "$RXEVM_CACHE/kernel-version")" >&2
