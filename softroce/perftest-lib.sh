# shellcheck shell=bash
# Sourced by perftest-compare.sh and perftest-compare-wire.sh: sizes,
# medians, ratios and the parsing of gdr's and perftest's output they share.
# Needs VOLUME (bytes per measurement, e.g. 32M) for iters.

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
# ratio A B: A/B to two places, or n/a unless both are positive
ratio() { awk -v g="$1" -v p="$2" 'BEGIN { if (g + 0 > 0 && p + 0 > 0) printf "%.2f", g / p; else print "n/a" }'; }
# geomean LABEL: the geometric mean of A/B over its input's "A B" lines
# (pairs with a non-positive side left out), as one line
geomean() {
  awk -v label="$1" '$1 + 0 > 0 && $2 + 0 > 0 { s += log($1 / $2); n++ }
    END { if (n > 0) printf "geometric mean over 64K-4M, %s: %.2f over %d\n", label, exp(s / n), n }'
}
# perftest_mbs SIZE: the "BW average[MB/sec]" of perftest's output (stdin)
# for messages of SIZE bytes
perftest_mbs() { awk -v s="$1" '$1 == s && NF >= 5 { print $4; exit }'; }

# gdr_json FILE ARRAY: adds each JSON line's mb_per_s of FILE to ARRAY["OP SIZE"].
gdr_json() {
  local -n into=$2
  local line op size mbs
  while read -r line; do
    [[ $line == '{'* ]] || continue
    op=$(sed -E 's/.*"op":"([A-Z]+)".*/\1/' <<< "$line")
    size=$(sed -E 's/.*"size":([0-9]+).*/\1/' <<< "$line")
    mbs=$(sed -E 's/.*"mb_per_s":([0-9.]+).*/\1/' <<< "$line")
    into["$op $size"]+=" $mbs"
  done < "$1"
}

# private_gdr SCRIPT HERE [BINARY]: copies the gdr binary (BINARY, else
# $CARGO_TARGET_DIR/release/gdr, else HERE/../target/release/gdr) into a new
# folder under /var/tmp, which the guests see at the same path, so that a
# concurrent build cannot change it mid-run; prints the copy's path.
private_gdr() {
  local script=$1 here=$2 bin=${3:-} cand copy
  if [ -z "$bin" ]; then
    for cand in "${CARGO_TARGET_DIR:-}/release/gdr" "$here/../target/release/gdr"; do
      if [ -x "$cand" ]; then bin=$cand; break; fi
    done
  fi
  if [ -z "$bin" ] || [ ! -x "$bin" ]; then
    echo "$script: no gdr binary (cargo build --release -p gdr-cli, or pass its path)" >&2; return 2
  fi
  copy=$(mktemp -d /var/tmp/perftest-compare.XXXXXX)
  cp "$bin" "$copy/gdr"
  echo "$script: $bin ($(stat -c '%y' "$bin" | cut -d. -f1)), volume $VOLUME per measurement, $ROUNDS rounds" >&2
  echo "$copy/gdr"
}
