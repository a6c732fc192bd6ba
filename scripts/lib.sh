# shellcheck shell=bash
# Shared by the scripts: stage timing.
# stage NAME CMD...  runs CMD, prints its wall time, and records it for the summary.
STAGES=()
stage() {
  local name=$1; shift
  local t0 t1 rc
  echo "::: stage $name: $*" >&2
  t0=$(date +%s)
  if [ -n "${GDR_STAGE_LOGS:-}" ]; then
    # Also kept apart, so the end of the run can repeat a failed stage's
    # last lines (a CI log's reader may see only its tail).
    local log="$GDR_STAGE_LOGS/$name.log"
    { "$@" 2>&1; echo $? > "$log.rc"; } | tee "$log"
    rc=$(cat "$log.rc" 2>/dev/null || echo 1)
    echo "$name $rc" >> "$GDR_STAGE_LOGS/ended"
  else
    "$@"; rc=$?
  fi
  t1=$(date +%s)
  STAGES+=("$(printf '%-28s %5ss  %s' "$name" $((t1 - t0)) "$([ $rc = 0 ] && echo ok || echo "FAILED ($rc)")")")
  # The free disk after each stage: a shared CI machine's full disk once
  # failed a link (ld: Bus error) with nothing else to say so.
  echo "::: stage $name took $((t1 - t0)) s (exit $rc; $(df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' ') free)" >&2
  return $rc
}
summary() {
  echo "::: stage timings" >&2
  printf '%s\n' "${STAGES[@]}" >&2
}
# cargo_target_dir: cargo's target directory, as cargo itself resolves it
# (CARGO_TARGET_DIR, relative or not; build.target-dir; else ./target).
cargo_target_dir() {
  cargo metadata --no-deps --format-version 1 \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p'
}
# failed_stage_tails: each failed stage's last lines, innermost first (a
# stage inside another ends before it), when GDR_STAGE_LOGS kept them.
failed_stage_tails() {
  [ -n "${GDR_STAGE_LOGS:-}" ] && [ -f "$GDR_STAGE_LOGS/ended" ] || return 0
  local name rc
  while read -r name rc; do
    [ "$rc" = 0 ] && continue
    echo "::: stage $name FAILED ($rc); its last 60 lines:" >&2
    tail -n 60 "$GDR_STAGE_LOGS/$name.log" >&2
  done < "$GDR_STAGE_LOGS/ended"
}
