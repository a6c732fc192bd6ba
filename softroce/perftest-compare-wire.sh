#!/bin/bash
# perftest-compare-wire.sh [GDR_BINARY]
#
# Host-memory RDMA WRITE and READ throughput of the transfer engine next to
# perftest's ib_write_bw/ib_read_bw ACROSS two SoftRoCE guests on one
# virtual wire (two-guests.sh): A (10.99.0.1) serves, B (10.99.0.2)
# measures, both tools connecting with rdma_cm. Each round runs
# `gdr bench engine --connect` in B against `gdr bench engine --listen` in
# A (every size and op in one process, its own defaults), then for each op
# and size an `ib_OP_bw -R` client in B against a server in A; an untimed
# warm-up run of the engine first, then COMPARE_ROUNDS rounds, medians
# reported (a run reporting 0 or failing is left out of its median), and
# the geometric mean of the ratio over 64 KiB..4 MiB. Both get the same
# message counts (COMPARE_VOLUME bytes worth per measurement); perftest
# its tx depth 128; MB/s is 2^20 bytes/s. Under TCG absolute figures mean
# little; the ratio inside one run does. B prints the table.
#
# GDR_BINARY: default $CARGO_TARGET_DIR/release/gdr, else target/release/gdr
# (cargo build --release -p gdr-cli); copied first, so a concurrent build
# cannot change it mid-run.
# Knobs: COMPARE_VOLUME=16M, COMPARE_ROUNDS=3, COMPARE_SIZES="4K 64K 1M 4M",
# ENGINE_BENCH_ARGS (extra `gdr bench engine` options of the client, e.g.
# "--qps 1 --batch 8"), PERFTEST_ARGS (extra perftest options), and the
# RXEVM_* knobs of two-guests.sh.
# Internal: `--server BINARY` and `--client BINARY` are what run in A and B.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SELF=$HERE/perftest-compare-wire.sh
# shellcheck source=softroce/perftest-lib.sh
. "$HERE/perftest-lib.sh"
export COMPARE_VOLUME=${COMPARE_VOLUME:-16M} COMPARE_ROUNDS=${COMPARE_ROUNDS:-3}
export COMPARE_SIZES=${COMPARE_SIZES:-4K 64K 1M 4M}
VOLUME=$COMPARE_VOLUME
ROUNDS=$COMPARE_ROUNDS
read -r -a SIZES <<< "$COMPARE_SIZES"
read -r -a ENGINE_EXTRA <<< "${ENGINE_BENCH_ARGS:-}"
read -r -a PT_EXTRA <<< "${PERFTEST_ARGS:-}"
TX_DEPTH=128
DEV=rxe0
SERVER=10.99.0.1
# Every step (a server in A, its client in B) has a port of its own, so a
# client that gave up on one step cannot reach the next step's server.
BASE_PORT=18700
# A client retries its server (not yet listening) this many seconds, a
# server waits this long for its client (which, once connected, ends the
# server's run whether it passes or fails), so a failed step leaves the two
# in step.
CLIENT_RETRY=120
SERVER_WAIT=300

# steps: the run's steps in order, "KIND OP SIZE" (engine steps cover every
# op and size in one process: "engine - -"); the same list in A and B.
steps() {
  local op size
  echo "engine - -"
  for _ in $(seq "$ROUNDS"); do
    echo "engine - -"
    for op in write read; do
      for size in "${SIZES[@]}"; do echo "perftest $op $(bytes "$size")"; done
    done
  done
}

perftest_cmd() {   # OP SIZE PORT: the perftest command line of one step
  echo "ib_$1_bw -d $DEV -R -s $2 -n $(iters "$2") -t $TX_DEPTH -F -p $3 ${PT_EXTRA[*]}"
}

sizes_csv() { local IFS=,; echo "${SIZES[*]}"; }

server() {
  local gdr=$1 kind op size port=$BASE_PORT
  # (no process substitution: the guest has no /dev/fd)
  steps > "$TMPDIR/steps"
  while read -r kind op size <&3; do
    port=$((port + 1))
    if [ "$kind" = engine ]; then
      timeout "$SERVER_WAIT" "$gdr" --backend real bench engine --listen "0.0.0.0:$port" -d "$DEV" \
        > /dev/null || echo "perftest-compare-wire: engine server on port $port failed" >&2
    else
      # shellcheck disable=SC2046  # the command line's words
      timeout "$SERVER_WAIT" $(perftest_cmd "$op" "$size" "$port") > /dev/null 2>&1 \
        || echo "perftest-compare-wire: ib_${op}_bw server on port $port failed" >&2
    fi
  done 3< "$TMPDIR/steps"
}

# retry SECONDS CMD...: runs CMD until it succeeds (its server may not
# listen yet), at most SECONDS; its last output on stdout, or fails.
retry() {
  local until=$(( $(date +%s) + $1 )) out; shift
  while :; do
    if out=$(timeout 120 "$@" 2>&1); then echo "$out"; return 0; fi
    [ "$(date +%s)" -lt "$until" ] || { echo "$out" >&2; return 1; }
    sleep 0.5
  done
}

client() {
  local gdr=$1 kind op size port=$BASE_PORT n=0 t0 out
  local -A ENG PT
  local cmd=("$gdr" --backend real bench engine --json --sizes "$(sizes_csv)" --ops "write,read"
    --volume "$VOLUME" -d "$DEV" "${ENGINE_EXTRA[@]}")
  t0=$(date +%s.%N)
  steps > "$TMPDIR/steps"
  while read -r kind op size <&3; do
    port=$((port + 1))
    if [ "$kind" = engine ]; then
      n=$((n + 1))
      echo "perftest-compare-wire: gdr bench engine, run $n$([ "$n" -gt 1 ] || echo ' (untimed warm-up)')" >&2
      if ! retry "$CLIENT_RETRY" "${cmd[@]}" --connect "$SERVER:$port" > "$TMPDIR/engine.$n"; then
        echo "perftest-compare-wire: gdr bench engine run $n failed" >&2
      elif [ "$n" -gt 1 ]; then
        gdr_json "$TMPDIR/engine.$n" ENG
      fi
    else
      echo "perftest-compare-wire: ib_${op}_bw $size" >&2
      # shellcheck disable=SC2046  # the command line's words
      out=$(retry "$CLIENT_RETRY" $(perftest_cmd "$op" "$size" "$port") "$SERVER") || out=
      PT["${op^^} $size"]+=" $(perftest_mbs "$size" <<< "$out" | grep . || echo nan)"
    fi
  done 3< "$TMPDIR/steps"

  echo "gdr bench engine vs perftest $(dpkg-query -W -f '${Version}' perftest 2>/dev/null || echo '?') (rdma_cm, -R) across two guests on a virtual wire ($(nproc) vCPU each, kernel $(uname -r)), $DEV, host memory"
  echo "MB/s = 2^20 bytes/s; medians of $ROUNDS rounds (each run's figure in brackets); $VOLUME per measurement; perftest tx depth $TX_DEPTH"
  grep -m1 '^{' "$TMPDIR/engine.2" 2>/dev/null | sed -E -n 's/.*"batch":([0-9]+),"depth":([0-9]+),"qps":([0-9]+),"slice":([0-9]+),"progress":"([a-z]+)".*/engine (first size): batch \1, depth \2 batches, \3 QPs, slice \4, progress \5/p' || true
  printf '%-6s %6s %6s %9s %9s %6s   %-24s %-24s\n' op size iters "eng MB/s" "pt MB/s" eng/pt "engine runs" "perftest runs"
  local e p big=""
  for op in WRITE READ; do
    for size in "${SIZES[@]}"; do
      size=$(bytes "$size")
      e=$(median <<< "${ENG[$op $size]:-}")
      p=$(median <<< "${PT[$op $size]:-}")
      [ "$size" -lt 65536 ] || big+="$e $p"$'\n'
      printf '%-6s %6s %6s %9s %9s %6s   %-24s %-24s\n' "$op" "$((size >> 10))K" "$(iters "$size")" "$e" "$p" \
        "$(ratio "$e" "$p")" "[${ENG[$op $size]# }]" "[${PT[$op $size]# }]"
    done
  done
  geomean "gdr bench engine / perftest" <<< "$big"
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "measurements took %.0f s\n", b - a }'
}

case "${1:-}" in
  --server) server "$2"; exit ;;
  --client) client "$2"; exit ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
GDR=$(private_gdr perftest-compare-wire "$HERE" "${1:-}") || exit 2
trap 'rm -rf "$(dirname "$GDR")"' EXIT
# loose 9p caching: perftest starts 2-3x faster; the guests write nothing
# back to the host.
RXEVM_9P_CACHE=${RXEVM_9P_CACHE:-loose} RXEVM_TIMEOUT=${RXEVM_TIMEOUT:-1800} \
  "$HERE/two-guests.sh" "'$SELF' --server '$GDR'" "'$SELF' --client '$GDR'"
