#!/bin/bash
# perftest-compare.sh [GDR_BINARY]
#
# Host-memory RDMA WRITE and READ throughput of `gdr bench rdma` next to
# perftest's ib_write_bw/ib_read_bw, in ONE SoftRoCE guest (run-in-vm.sh),
# at 64 KiB, 1 MiB and 4 MiB. Under TCG absolute figures mean nothing; the
# ratio gdr/perftest inside one guest does. Each round runs gdr (all six
# measurements, one process) and right after it perftest (server and client
# in the guest, on rxe0 at 10.99.0.1, the TCP exchange: measured faster here
# than rdma_cm's -R); an untimed warm-up round, then three rounds, medians
# reported (a run reporting 0 or failing is left out of its median). Both sides get the same
# message counts (COMPARE_VOLUME bytes worth per measurement) and tx depth
# (128; both cap it at the message count); everything else is each tool's
# default. MB/s is 2^20 bytes/s on both sides (perftest's default unit).
#
# GDR_BINARY: default $CARGO_TARGET_DIR/release/gdr, else target/release/gdr
# (cargo build --release -p gdr-cli). It is copied first, so a concurrent
# build cannot change it mid-run.
# Knobs: COMPARE_VOLUME=32M (bytes per measurement), COMPARE_ROUNDS=3,
# COMPARE_SIZES="64K 1M 4M", GDR_BENCH_ARGS (extra `gdr bench rdma` options),
# PERFTEST_ARGS (extra perftest options), and run-in-vm.sh's RXEVM_* knobs.
# Internal: `--in-guest BINARY` is what runs inside the guest.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SELF=$HERE/perftest-compare.sh
VOLUME=${COMPARE_VOLUME:-32M}
ROUNDS=${COMPARE_ROUNDS:-3}
read -r -a SIZES <<< "${COMPARE_SIZES:-64K 1M 4M}"
read -r -a GDR_EXTRA <<< "${GDR_BENCH_ARGS:-}"
read -r -a PT_EXTRA <<< "${PERFTEST_ARGS:-}"
TX_DEPTH=128
DEV=rxe0
SERVER=10.99.0.1

bytes() {   # 64K -> 65536 (K, M, G: powers of 1024)
  local n=${1%[KkMmGg]}
  case $1 in
    *[Kk]) echo $((n << 10)) ;; *[Mm]) echo $((n << 20)) ;; *[Gg]) echo $((n << 30)) ;;
    *) echo "$n" ;;
  esac
}
iters() {   # SIZE_BYTES -> messages per measurement (as gdr's --volume, >= 5)
  local n=$(( $(bytes "$VOLUME") / $1 ))
  [ "$n" -ge 5 ] || n=5
  echo "$n"
}
# median of the positive numbers among its input's words (a failed run is
# "nan"; perftest now and then reports 0.00 under TCG: both left out)
median() { tr ' ' '\n' | awk '$1 + 0 > 0' | sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.2f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

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
    awk -v s="$size" '$1 == s && NF >= 5 { print $4; exit }' <<< "$out"
  else
    { echo "perftest-compare: ${cmd[*]} failed:"; echo "$out"; cat "$TMPDIR/pt-server.$port"; } >&2
  fi
}

in_guest() {
  local gdr=$1 round op size n port=18600 line mbs t0
  local -A GDR PT ITERS
  local sizes_csv
  sizes_csv=$(IFS=,; echo "${SIZES[*]}")
  t0=$(date +%s.%N)
  # Untimed warm-up round: for the first ~10 s after boot transfers run
  # ~30% slower (measured: every figure of a first round), which would
  # land on whichever tool goes first.
  "$gdr" --backend real bench rdma --sizes "$sizes_csv" --ops write,read --volume "$VOLUME" \
    --tx-depth "$TX_DEPTH" -d "$DEV" "${GDR_EXTRA[@]}" > /dev/null
  for round in $(seq "$ROUNDS"); do
    echo "perftest-compare: round $round/$ROUNDS: gdr bench rdma" >&2
    # (no process substitution: the guest has no /dev/fd)
    "$gdr" --backend real bench rdma --json --sizes "$sizes_csv" --ops write,read \
      --volume "$VOLUME" --tx-depth "$TX_DEPTH" -d "$DEV" "${GDR_EXTRA[@]}" > "$TMPDIR/gdr.$round"
    while read -r line; do
      [[ $line == '{'* ]] || continue
      op=$(sed -E 's/.*"op":"([A-Z]+)".*/\1/' <<< "$line")
      size=$(sed -E 's/.*"size":([0-9]+).*/\1/' <<< "$line")
      mbs=$(sed -E 's/.*"mb_per_s":([0-9.]+).*/\1/' <<< "$line")
      GDR[$op $size]+=" $mbs"
    done < "$TMPDIR/gdr.$round"
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

  echo "gdr bench rdma vs perftest $(dpkg-query -W -f '${Version}' perftest 2>/dev/null || echo '?'), one guest ($(nproc) vCPUs, kernel $(uname -r)), $DEV, host memory"
  echo "MB/s = 2^20 bytes/s; medians of $ROUNDS rounds (each run's figure in brackets); tx depth $TX_DEPTH"
  printf '%-6s %6s %6s %10s %10s %7s   %-22s %-22s\n' op size iters "gdr MB/s" "pt MB/s" ratio "gdr runs" "perftest runs"
  local g p ratio logsum=0 count=0
  for op in WRITE READ; do
    for size in "${SIZES[@]}"; do
      size=$(bytes "$size")
      g=$(median <<< "${GDR[$op $size]:-}")
      p=$(median <<< "${PT[$op $size]:-}")
      ratio=$(awk -v g="$g" -v p="$p" 'BEGIN { if (g + 0 > 0 && p + 0 > 0) printf "%.2f", g / p; else print "n/a" }')
      if [ "$ratio" != n/a ]; then
        logsum=$(awk -v s="$logsum" -v g="$g" -v p="$p" 'BEGIN { print s + log(g / p) }'); count=$((count + 1))
      fi
      printf '%-6s %6s %6s %10s %10s %7s   %-22s %-22s\n' "$op" "$((size >> 10))K" "${ITERS[$size]}" "$g" "$p" "$ratio" \
        "[${GDR[$op $size]# }]" "[${PT[$op $size]# }]"
    done
  done
  if [ "$count" -gt 0 ]; then
    awk -v s="$logsum" -v c="$count" 'BEGIN { printf "geometric mean of the ratios (gdr / perftest): %.2f over %d\n", exp(s / c), c }'
  fi
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "measurements took %.0f s\n", b - a }'
}

case "${1:-}" in
  --in-guest) in_guest "$2"; exit ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
BIN=${1:-}
if [ -z "$BIN" ]; then
  for cand in "${CARGO_TARGET_DIR:-}/release/gdr" "$HERE/../target/release/gdr"; do
    if [ -x "$cand" ]; then BIN=$cand; break; fi
  done
fi
if [ -z "$BIN" ] || [ ! -x "$BIN" ]; then
  echo "perftest-compare: no gdr binary (cargo build --release -p gdr-cli, or pass its path)" >&2; exit 2
fi
# A private copy under a host folder the guest sees at the same path.
COPY=$(mktemp -d /var/tmp/perftest-compare.XXXXXX)
trap 'rm -rf "$COPY"' EXIT
cp "$BIN" "$COPY/gdr"
echo "perftest-compare: $BIN ($(stat -c '%y' "$BIN" | cut -d. -f1)), volume $VOLUME per measurement, $ROUNDS rounds" >&2
# loose 9p caching: perftest starts 2-3x faster; the guest writes nothing
# back to the host.
RXEVM_9P_CACHE=${RXEVM_9P_CACHE:-loose} RXEVM_TIMEOUT=${RXEVM_TIMEOUT:-600} "$HERE/run-in-vm.sh" "$SELF" --in-guest "$COPY/gdr"
