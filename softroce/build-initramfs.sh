#!/bin/bash
# build-initramfs.sh: builds what run-in-vm.sh boots, into $RXEVM_CACHE
# (default: softroce/cache/), and does nothing when that is up to date:
#   vmlinuz          Debian's kernel as shipped (bzImage)
#   vmlinux          the same kernel as an uncompressed ELF (booted through its
#                    PVH entry: no in-guest decompression, ~1.3 s less under TCG)
#   modules/         the .ko files needed + load-order
#   initrd.cpio      static busybox + modules + guest-init.sh as /init
#   kernel-version, config
# The kernel .deb is downloaded and unpacked, never installed. Needs apt lists
# (apt-get update) only when the kernel is not cached yet; busybox-static and
# xz-utils installed (setup.sh does both). Safe to run concurrently (flock).
set -euo pipefail
export LC_ALL=C
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${RXEVM_CACHE:-$HERE/cache}
mkdir -p "$CACHE"
exec 9> "$CACHE/.lock"
flock 9

# Modules wanted (their dependencies come from modules.dep):
#  virtio_pci virtio_console 9pnet_virtio 9p -- host root over 9p, output over hvc
#  dummy          -- Ethernet-like netdev for rxe0 in a single guest
#  virtio_net     -- eth0, for two guests joined by a QEMU netdev
#  crc32_generic  -- rdma_rxe asks for the "crc32" shash through request_module()
#                    when a device is added, which modules.dep does not show;
#                    without it "rdma link add" fails with ENOENT
#  rdma_rxe rdma_ucm -- SoftRoCE, and rdma_cm for userspace
#  sch_netem sch_ingress cls_matchall act_gact -- the wire tests' impairments
#                    through the host's tc (seen through the 9p root): netem
#                    delays and drops what leaves, an ingress matchall rule
#                    with a drop action what arrives (softroce/two-guest-wire.sh)
WANT="virtio_pci virtio_console 9pnet_virtio 9p dummy virtio_net crc32_generic rdma_rxe rdma_ucm"
WANT="$WANT sch_netem sch_ingress cls_matchall act_gact"
OPTIONAL="crc32-pclmul"   # faster ICRC where the CPU has PCLMULQDQ; may fail to load

kernel_cached() {
  local m
  [ -f "$CACHE/modules/load-order" ] && [ -f "$CACHE/vmlinuz" ] || return 1
  for m in $WANT; do
    [ -f "$CACHE/modules/$m.ko" ] || [ -f "$CACHE/modules/${m//_/-}.ko" ] || return 1
  done
}

if ! kernel_cached; then
  KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  [ -n "$KPKG" ] || { echo "softroce: cannot resolve linux-image-amd64 (run apt-get update)" >&2; exit 1; }
  W=$(mktemp -d "$CACHE/kbuild.XXXXXX")
  trap 'rm -rf "$W"' EXIT
  echo "softroce: downloading $KPKG" >&2
  (cd "$W" && apt-get download -q -o APT::Sandbox::User=root "$KPKG" >&2)
  dpkg-deb -x "$W/${KPKG}"_*.deb "$W/root"
  KV=$(ls "$W/root/lib/modules")
  MD=$W/root/lib/modules/$KV
  busybox depmod -b "$W/root" "$KV"     # the .deb ships no modules.dep
  declare -A SEEN=()
  ORDER=()
  visit() {   # depth-first: dependencies before the module itself
    local rel=$1 line d
    [ -z "${SEEN[$rel]:-}" ] || return 0
    SEEN[$rel]=1
    line=$(grep -E "^$rel:" "$MD/modules.dep")
    for d in ${line#*:}; do visit "$d"; done
    ORDER+=("$rel")
  }
  for m in $OPTIONAL $WANT; do
    rel=$(grep -E "/$m\.ko:" "$MD/modules.dep" | head -1 | cut -d: -f1)
    [ -n "$rel" ] || { echo "softroce: module $m not found in kernel $KV" >&2; exit 1; }
    visit "$rel"
  done
  mkdir "$W/modules"
  for rel in "${ORDER[@]}"; do
    b=$(basename "$rel")
    cp "$MD/$rel" "$W/modules/$b"
    case " $OPTIONAL " in *" ${b%.ko} "*) b="?$b" ;; esac
    echo "$b" >> "$W/modules/load-order"
  done
  cp "$W/root/boot/config-$KV" "$CACHE/config"
  echo "$KV" > "$CACHE/kernel-version"
  rm -rf "$CACHE/modules" "$CACHE/vmlinux" "$CACHE/initrd.cpio"
  mv "$W/modules" "$CACHE/modules"
  cp "$W/root/boot/vmlinuz-$KV" "$CACHE/vmlinuz"
  rm -rf "$W"
  trap - EXIT
fi

if [ ! -f "$CACHE/vmlinux" ]; then
  # The bzImage holds an xz stream whose contents are the ELF vmlinux.
  off=$(grep -abo $'\xfd7zXZ' "$CACHE/vmlinuz" | head -1 | cut -d: -f1 || true)
  if [ -n "$off" ]; then
    tail -c +"$((off + 1))" "$CACHE/vmlinuz" | xz -dc > "$CACHE/vmlinux.tmp" 2>/dev/null || true
    if [ "$(head -c 4 "$CACHE/vmlinux.tmp" | od -An -c | tr -d ' ')" = '177ELF' ]; then
      mv "$CACHE/vmlinux.tmp" "$CACHE/vmlinux"
    fi
  fi
  rm -f "$CACHE/vmlinux.tmp"
  [ -f "$CACHE/vmlinux" ] || echo "softroce: no ELF vmlinux; booting the bzImage (slower)" >&2
fi

CPIO=$CACHE/initrd.cpio
if [ -f "$CPIO" ] && [ "$CPIO" -nt "$HERE/guest-init.sh" ] && [ "$CPIO" -nt "$HERE/build-initramfs.sh" ] \
   && [ "$CPIO" -nt "$CACHE/modules/load-order" ]; then
  exit 0
fi
BB=$(command -v busybox || true)
[ -n "$BB" ] || { echo "softroce: busybox missing: apt-get install busybox-static" >&2; exit 1; }
if ldd "$BB" >/dev/null 2>&1; then
  echo "softroce: $BB is dynamically linked: apt-get install busybox-static" >&2; exit 1
fi
T=$(mktemp -d "$CACHE/initrd.XXXXXX")
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/bin" "$T/proc" "$T/sys" "$T/dev" "$T/newroot"
cp "$BB" "$T/bin/busybox"
cp -r "$CACHE/modules" "$T/modules"
cp "$HERE/guest-init.sh" "$T/init"
chmod 755 "$T/init" "$T/bin/busybox"
(cd "$T" && find . | busybox cpio -o -H newc > "$CPIO.tmp" 2>/dev/null)
mv "$CPIO.tmp" "$CPIO"
echo "softroce: built $CPIO ($(stat -c %s "$CPIO") bytes), kernel $(cat "$CACHE/kernel-version"), modules: $(tr '\n' ' ' < "$CACHE/modules/load-order")" >&2
