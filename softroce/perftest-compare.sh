#!/bin/bash
# perftest-compare.sh [GDR_BINARY]
#
# Host-memory RDMA WRITE and READ throughput of gdr next to perftest's
# ib_write_bw/ib_read_bw, in ONE SoftRoCE guest (run-in-vm.sh), at 4 KiB,
# 64 KiB, 1 MiB and 4 MiB. Two gdr figures: `gdr bench rdma` (the bare
# post/poll loop on two QPs, the baseline) and `gdr bench engine` (the
# transfer engine: two engines in one process connected over rdma_cm,
# batches of requests, with its own defaults). Under TCG absolute figures
# mean nothing; the ratio gdr/perftest inside one guest does. Each round
# runs gdr bench rdma (all measurements, one process), gdr bench engine
# (likewise), then perftest (server and client in the guest, on rxe0 at
# 10.99.0.1, the TCP exchange: measured faster here than rdma_cm's -R); an
# untimed warm-up round of each gdr command first, then three rounds,
# medians reported (a run reporting 0 or failing is left out of its median),
# and the geometric mean of each ratio over 64 KiB..4 MiB. All get the same
# message counts (COMPARE_VOLUME bytes worth per measurement); the bare loop
# and perftest the same tx depth (128; both cap it at the message count);
# everything else is each tool's default. MB/s is 2^20 bytes/s everywhere
# (perftest's default unit).
#
# GDR_BINARY: default $CARGO_TARGET_DIR/release/gdr, else target/release/gdr
# (cargo build --release -p gdr-cli). It is copied first, so a concurrent
# build cannot change it mid-run.
# Knobs: COMPARE_VOLUME=32M (bytes per measurement), COMPARE_ROUNDS=3,
# COMPARE_SIZES="4K 64K 1M 4M", GDR_BENCH_ARGS (extra `gdr bench rdma`
# options), ENGINE_BENCH_ARGS (extra `gdr bench engine` options, e.g.
# "--batch 8 --qps 1"), COMPARE_ENGINE_DEPTH=16 (the engine's batches in
# flight: its bench's own default, 4 batches of 256 KiB, keeps 1 MiB in
# flight where perftest keeps 128 requests (8 MiB at 64 KiB), and a parked
# engine's wake-up then idles the wire: measured 2026-12-05, READ 64K-4M
# 0.95-0.97 of perftest at 4, 0.99-1.02 at 16), COMPARE_ENGINE=0 (leave the
# engine out),
# PERFTEST_ARGS (extra perftest options), and run-in-vm.sh's RXEVM_* knobs.
# Internal: `--in-guest BINARY` is what runs inside the guest.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SELF=$HERE/perftest-compare.sh
VOLUME=${COMPARE_VOLUME:-32M}
ROUNDS=${COMPARE_ROUNDS:-3}
read -r -a SIZES <<< "${COMPARE_SIZES:-4K 64K 1M 4M}"
read -r -a GDR_EXTRA <<< "${GDR_BENCH_ARGS:-}"
read -r -a ENGINE_EXTRA <<< "${ENGINE_BENCH_ARGS:-}"
ENGINE=${COMPARE_ENGINE:-1}
ENGINE_DEPTH=${COMPARE_ENGINE_DEPTH:-16}
read -r -a PT_EXTRA <<< "${PERFTEST_ARGS:-}"
TX_DEPTH=128
DEV=rxe0
SERVER=10.99.0.1

# shellcheck source=softroce/perftest-lib.sh
. "$HERE/perftest-lib.sh"

# perftest OP SIZE ITERS PORT: one ib_OP_bw server+client run; prints its
# BW average [MB/sec], or nothing if it failed (its output to stderr).
perftest() {
  local op=$1 size=$2 n=$3 port=$4 out sp ok=0
  local cmd=("ib_${op}_bw" -d "$DEV" -s "$size" -n "$n" -t "$TX_DEPTH" -F -p "$port" "${PT_EXTRA[@]}")
  timeout 120 "${cmd[@]}" > "$TMPDIR/pt-server.$port" 2>&1 & sp=$!
  for _ in $(seq 50); do
    sleep 0.2
    if out=$(timeout 120 "${cmd[@]}" "$SERVER" 2>&1); then ok=1; break; fi
    kill -0 "$sp" 2>/dev/null || break
  done
  wait "$sp" || ok=0
  if [ "$ok" = 1 ]; then
    perftest_mbs "$size" <<< "$out"
  else
    { echo "perftest-compare: ${cmd[*]} failed:"; echo "$out"; cat "$TMPDIR/pt-server.$port"; } >&2
  fi
}

in_guest() {
  local gdr=$1 round op size n port=18600 mbs t0
  local -A GDR ENG PT ITERS
  local sizes_csv
  sizes_csv=$(IFS=,; echo "${SIZES[*]}")
  local rdma_cmd=("$gdr" --backend real bench rdma --json --sizes "$sizes_csv" --ops "write,read"
    --volume "$VOLUME" --tx-depth "$TX_DEPTH" -d "$DEV" "${GDR_EXTRA[@]}")
  local engine_cmd=("$gdr" --backend real bench engine --json --sizes "$sizes_csv" --ops "write,read"
    --volume "$VOLUME" --depth "$ENGINE_DEPTH" -d "$DEV" "${ENGINE_EXTRA[@]}")
  t0=$(date +%s.%N)
  # Untimed warm-up round: for the first ~10 s after boot transfers run
  # ~30% slower (measured: every figure of a first round), which would
  # land on whichever tool goes first.
  "${rdma_cmd[@]}" > /dev/null
  if [ "$ENGINE" = 1 ]; then "${engine_cmd[@]}" > "$TMPDIR/engine.0"; fi
  for round in $(seq "$ROUNDS"); do
    echo "perftest-compare: round $round/$ROUNDS: gdr bench rdma" >&2
    # (no process substitution: the guest has no /dev/fd)
    "${rdma_cmd[@]}" > "$TMPDIR/gdr.$round"
    gdr_json "$TMPDIR/gdr.$round" GDR
    if [ "$ENGINE" = 1 ]; then
      echo "perftest-compare: round $round/$ROUNDS: gdr bench engine" >&2
      if "${engine_cmd[@]}" > "$TMPDIR/engine.$round"; then
        gdr_json "$TMPDIR/engine.$round" ENG
      else
        echo "perftest-compare: gdr bench engine failed in round $round" >&2
      fi
    fi
    echo "perftest-compare: round $round/$ROUNDS: ib_write_bw, ib_read_bw" >&2
    for op in write read; do
      for size in "${SIZES[@]}"; do
        size=$(bytes "$size"); n=$(iters "$size"); port=$((port + 1))
        ITERS[$size]=$n
        mbs=$(perftest "$op" "$size" "$n" "$port")
        PT[${op^^} $size]+=" ${mbs:-nan}"
      done
    done
  done

  echo "gdr bench rdma and gdr bench engine vs perftest $(dpkg-query -W -f '${Version}' perftest 2>/dev/null || echo '?'), one guest ($(nproc) vCPUs, kernel $(uname -r)), $DEV, host memory"
  echo "MB/s = 2^20 bytes/s; medians of $ROUNDS rounds (each run's figure in brackets); tx depth $TX_DEPTH (rdma, perftest)"
  if [ "$ENGINE" = 1 ] && [ -s "$TMPDIR/engine.0" ]; then
    grep -m1 '^{' "$TMPDIR/engine.0" | sed -E -n 's/.*"batch":([0-9]+),"depth":([0-9]+),"qps":([0-9]+),"slice":([0-9]+),"progress":"([a-z]+)".*/engine (first size): batch \1, depth \2 batches, \3 QPs, slice \4, progress \5/p'
  fi
  printf '%-6s %6s %6s %9s %9s %9s %6s %6s   %-22s %-22s %-22s\n' op size iters "rdma MB/s" "eng MB/s" "pt MB/s" rdma/pt eng/pt \
    "rdma runs" "engine runs" "perftest runs"
  local g e p r1 r2 big_r="" big_e=""
  for op in WRITE READ; do
    for size in "${SIZES[@]}"; do
      size=$(bytes "$size")
      g=$(median <<< "${GDR[$op $size]:-}")
      e=$(median <<< "${ENG[$op $size]:-}")
      p=$(median <<< "${PT[$op $size]:-}")
      r1=$(ratio "$g" "$p"); r2=$(ratio "$e" "$p")
      # The geometric means: 64 KiB and up.
      if [ "$size" -ge 65536 ]; then
        big_r+="$g $p"$'\n'; big_e+="$e $p"$'\n'
      fi
      printf '%-6s %6s %6s %9s %9s %9s %6s %6s   %-22s %-22s %-22s\n' "$op" "$((size >> 10))K" "${ITERS[$size]}" "$g" "$e" "$p" "$r1" "$r2" \
        "[${GDR[$op $size]# }]" "[${ENG[$op $size]# }]" "[${PT[$op $size]# }]"
    done
  done
  geomean "gdr bench rdma / perftest" <<< "$big_r"
  geomean "gdr bench engine / perftest" <<< "$big_e"
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "measurements took %.0f s\n", b - a }'
}

case "${1:-}" in
  --in-guest) in_guest "$2"; exit ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
GDR=$(private_gdr perftest-compare "$HERE" "${1:-}") || exit 2
trap 'rm -rf "$(dirname "$GDR")"' EXIT
# loose 9p caching: perftest starts 2-3x faster; the guest writes nothing
# back to the host.
RXEVM_9P_CACHE=${RXEVM_9P_CACHE:-loose} RXEVM_TIMEOUT=${RXEVM_TIMEOUT:-1200} "$HERE/run-in-vm.sh" "$SELF" --in-guest "$GDR"
