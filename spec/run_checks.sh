#!/usr/bin/env bash
# Exhaustive SPIN checks of spec/omni_cache.pml; spec/MODEL.md explains each.
#
#   bash spec/run_checks.sh            # every check, two at a time
#   SPIN_JOBS=1 bash spec/run_checks.sh
#   bash spec/run_checks.sh safety bug_requeue   # only the named checks
#
# Installs nothing: spin and gcc must be on PATH. Works in a temporary
# directory. pan exits 0 even when it finds an error, so its output is
# parsed: a good run needs "errors: 0", a complete search and no trail; a
# known-bad variant needs "errors: N" with N > 0 or a trail. Prints one line
# per check (states explored, search depth, seconds) and exits non-zero if anything is off.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
model="$here/omni_cache.pml"
jobs="${SPIN_JOBS:-2}"

for tool in spin gcc; do
  command -v "$tool" >/dev/null 2>&1 || { echo "run_checks: $tool is not on PATH" >&2; exit 2; }
done

work="$(mktemp -d "${TMPDIR:-/tmp}/omni-spin.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# -O0: pan.c for this model is large, and an optimised build takes longer
# than the searches it would speed up. COLLAPSE compresses the 532-byte state
# vector about twofold and keeps the search exhaustive.
CFLAGS_SAFETY="-O0 -DSAFETY -DNOCLAIM -DCOLLAPSE -DMEMLIM=2048"
CFLAGS_LIVE="-O0 -DCOLLAPSE -DNFAIR=3 -DMEMLIM=2048"
# The default bounds leave preemption out (-DPREEMPTS=0): with it they give
# 8.4 million states. Preemption and resume are checked with two request
# admissions instead of three (safety) and one (liveness); MODEL.md says why.
BASE_DEFS="-DPREEMPTS=0"
RESUME_DEFS="-DSTARTS=2"
# Liveness runs with two request admissions instead of three (see MODEL.md).
LIVE_DEFS="-DSTARTS=2 -DPREEMPTS=0"
LIVE_RESUME_DEFS="-DSTARTS=1"
# Speculative decoding (SPEC): draft rows, their acceptance and rollback, under
# -DSPEC_DRAFTS (the default traces stay without them). Two admissions and
# four steps: a draft in step 2, its confirmation (and recompute) in step 3,
# and a hit on the recomputed block by the second request in step 4.
# Liveness with three steps (the claims name task ids 1..9).
SPEC_DEFS="-DSPEC_DRAFTS -DPREEMPTS=0 -DSTARTS=2 -DMAXSTEP=4"
LIVE_SPEC_DEFS="-DSPEC_DRAFTS -DPREEMPTS=0 -DSTARTS=2"
# Drafts with preemption (SPEC-5): three steps, a draft in step 2 and the
# preemption that leaves it unconfirmed in step 3, with its resume.
SPEC_RESUME_DEFS="-DSPEC_DRAFTS -DSTARTS=2"
# Reachability probes each configuration must produce (REACH(k) in the model).
PROBES_BASE="1 2 3 4 5 6 7 8 9 10 11 13 14 15 16 17 18 19 20 21 22 23 29 32"
PROBES_RESUME="1 2 3 4 5 7 8 9 10 11 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33"
PROBES_SPEC_RESUME="24 25 26 27 31 33 34 35 36 37 38 39 40 42 43 44"
PROBES_SPEC="1 2 3 4 5 7 8 9 10 11 13 14 15 16 17 18 19 20 21 22 23 29 32 34 35 36 37 38 39 40 41 42 43"

# name | kind | spin -D flags | claim (reach: the probes)
CHECKS=(
  "safety|safety|$BASE_DEFS|"
  "safety_resume|safety|$RESUME_DEFS|"
  "live_pages_released|live|$LIVE_DEFS|pages_released"
  "live_writes_end|live|$LIVE_DEFS|writes_end"
  "live_resume_pages_released|live|$LIVE_RESUME_DEFS|pages_released"
  "live_resume_writes_end|live|$LIVE_RESUME_DEFS|writes_end"
  "safety_spec|safety|$SPEC_DEFS|"
  "safety_spec_resume|safety|$SPEC_RESUME_DEFS|"
  "live_spec_pages_released|live|$LIVE_SPEC_DEFS|pages_released"
  "live_spec_writes_end|live|$LIVE_SPEC_DEFS|writes_end"
  "reach|reach|-DPROBES $BASE_DEFS|$PROBES_BASE"
  "reach_resume|reach|-DPROBES $RESUME_DEFS|$PROBES_RESUME"
  "reach_spec|reach|-DPROBES $SPEC_DEFS|$PROBES_SPEC"
  "reach_spec_resume|reach|-DPROBES $SPEC_RESUME_DEFS|$PROBES_SPEC_RESUME"
  "bug_wake_early|bad|$BASE_DEFS|"
  "bug_barrier_host_ready|bad|$BASE_DEFS|"
  "bug_requeue|bad|$BASE_DEFS|"
  "bug_ignore_tombstone|bad|$BASE_DEFS|"
  "bug_page_early|bad|$BASE_DEFS|"
  "bug_no_version|bad|$BASE_DEFS|"
  "bug_sparse_old|bad|$BASE_DEFS|"
  "bug_absent_no_cow|bad|$BASE_DEFS -DMAXSTEP=4 -DBUDGET=2|"
  "bug_order_pass_over|bad|$BASE_DEFS|"
  "bug_resume_redelivers|bad|$RESUME_DEFS|"
  "bug_resume_reads_pool|bad|$RESUME_DEFS|"
  "bug_spec_delivers_rejected|bad|$SPEC_DEFS|"
  "bug_spec_rejected_hit|bad|$SPEC_DEFS|"
  "bug_spec_no_catchup|bad|$SPEC_DEFS|"
  "bug_spec_end_marks_accepted_absent|bad|$SPEC_DEFS|"
  "bug_failed_keeps_page|badlive|$LIVE_DEFS|pages_released"
  "bug_lost_escalation|badlive|$LIVE_DEFS|writes_end"
)

# Runs one check in its own directory and writes one result line.
run_one() {
  local name="$1" kind="$2" defs="$3" claim="$4"
  local dir="$work/$name" t0 t1 out verdict="FAIL" why="" states depth cpu
  mkdir -p "$dir"
  cp "$model" "$dir/"
  t0=$(date +%s.%N)
  (
    cd "$dir"
    if [[ "$name" == bug_* ]]; then
      defs="$defs -D$(echo "$name" | tr '[:lower:]' '[:upper:]')"
    fi
    # shellcheck disable=SC2086
    spin $defs -a omni_cache.pml >spin.txt 2>&1 || { echo "spin -a failed" >why.txt; exit 0; }
    case "$kind" in
      safety|bad|reach) flags="$CFLAGS_SAFETY" ;;
      live|badlive) flags="$CFLAGS_LIVE" ;;
    esac
    # shellcheck disable=SC2086
    gcc $flags -o pan pan.c >gcc.txt 2>&1 || { echo "gcc failed" >why.txt; exit 0; }
    TIMEFORMAT='%U %S'
    {
    time {
    case "$kind" in
      safety|bad) ./pan -m100000 >pan.txt 2>&1 || true ;;
      # -c0: go on past each error. Every probe fires many times; keep one
      # line per probe and the rest of pan's output.
      reach) ./pan -m100000 -c0 2>&1 | awk '
               /REACHED==/ { match($0, /REACHED==[0-9]+/); seen[substr($0, RSTART, RLENGTH)] = 1; next }
               { print }
               END { for (p in seen) print p > "probes.txt" }' >pan.txt || true ;;
      live) ./pan -m200000 -a -f -N "$claim" >pan.txt 2>&1 || true ;;
      # -A: assertions are not the point here; the claim must fail.
      badlive) ./pan -m200000 -a -f -A -N "$claim" >pan.txt 2>&1 || true ;;
    esac
    }
    } 2>cpu.txt
  )
  t1=$(date +%s.%N)
  out="$dir/pan.txt"
  if [[ -f "$dir/why.txt" ]]; then
    why="$(cat "$dir/why.txt")"
  else
    local errors trail incomplete
    errors="$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$out" | head -1)"
    trail=$(find "$dir" -maxdepth 1 -name '*.trail' | head -1)
    incomplete=$(grep -c -e "reached -DMEMLIM" -e "max search depth too small" "$out" || true)
    case "$kind" in
      safety|live)
        if [[ "$errors" == "0" && -z "$trail" && "$incomplete" == "0" ]]; then verdict="PASS"
        else why="errors=${errors:-?} trail=${trail:+yes} incomplete=$incomplete"; fi ;;
      bad)
        if [[ "$errors" =~ ^[1-9] || -n "$trail" ]]; then verdict="PASS"
          why="caught: $(sed -n 's/.*assertion violated (\([A-Z][A-Z_0-9]*\)||.*/\1/p; s/.*\(invalid end state\).*/\1/p' "$out" | head -1)"
        else why="variant not caught (errors=${errors:-?})"; fi ;;
      badlive)
        if [[ ("$errors" =~ ^[1-9] || -n "$trail") ]] && grep -q "acceptance cycle" "$out"; then
          verdict="PASS"; why="caught: acceptance cycle"
        else why="claim not violated (errors=${errors:-?})"; fi ;;
      reach)
        local missing="" other
        for k in $claim; do
          grep -qx "REACHED==$k" "$dir/probes.txt" || missing="$missing $k"
        done
        other=$(grep -c "assertion violated" "$out" || true)
        if [[ -z "$missing" && "$other" == "0" && "$incomplete" == "0" ]]; then
          verdict="PASS"; why="all $(echo $claim | wc -w) probes reached"
        else why="unreached probes:${missing:- none}; other violations: $other"; fi ;;
    esac
  fi
  states="$(sed -n 's/^ *\([0-9.e+]*\) states, stored.*/\1/p' "$out" 2>/dev/null | head -1)"
  depth="$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' "$out" 2>/dev/null | head -1)"
  # cpu_s: user + system time of the search; wall_s: the whole check, with
  # spin -a and the compile.
  cpu="$(awk '{ printf "%.1f", $1 + $2 }' "$dir/cpu.txt" 2>/dev/null || true)"
  printf '%-4s %-24s states=%-9s depth=%-5s cpu_s=%-6s wall_s=%-6s %s\n' \
    "$verdict" "$name" "${states:-?}" "${depth:-?}" "${cpu:-?}" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')" "$why" \
    >"$work/$name.result"
}

selected=("$@")
wanted() {
  [[ ${#selected[@]} -eq 0 ]] && return 0
  local s
  for s in "${selected[@]}"; do [[ "$s" == "$1" ]] && return 0; done
  return 1
}

names=()
for entry in "${CHECKS[@]}"; do
  IFS='|' read -r name kind defs claim <<<"$entry"
  wanted "$name" || continue
  names+=("$name")
  while [[ $(jobs -rp | wc -l) -ge $jobs ]]; do wait -n || true; done
  run_one "$name" "$kind" "$defs" "$claim" &
done
wait

status=0
for name in "${names[@]}"; do
  if [[ -f "$work/$name.result" ]]; then
    cat "$work/$name.result"
    grep -q '^PASS' "$work/$name.result" || status=1
  else
    echo "FAIL $name (no result)"; status=1
  fi
done
[[ ${#names[@]} -gt 0 ]] || { echo "run_checks: no such check: $*" >&2; exit 2; }
exit $status
