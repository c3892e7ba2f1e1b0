#!/usr/bin/env bash
# Model checks of spec/omni_cache.pml: exhaustive safety, liveness under weak fairness, and every
# known-bad variant (each must be caught). pan exits 0 even when it finds an error, so its output
# is parsed: a good run needs "errors: 0" and no trail file; a bad variant needs an error.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
model="$here/omni_cache.pml"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
status=0

build() {  # build [spin flags...] -- [gcc flags...]
    local spin_flags=() gcc_flags=()
    while [[ $# -gt 0 && $1 != -- ]]; do spin_flags+=("$1"); shift; done
    shift || true
    gcc_flags=("$@")
    rm -f pan pan.* ./*.trail
    spin "${spin_flags[@]}" -a "$model" >spin.out 2>&1 || { cat spin.out; return 1; }
    gcc -O2 -w "${gcc_flags[@]}" -o pan pan.c  # a later -O1 in the flags wins
}

good() {  # good NAME [pan flags...]
    local name=$1; shift
    local start=$SECONDS
    ./pan "$@" >pan.out 2>&1 || true
    local states
    states="$(grep -Eo '[0-9]+ states, stored' pan.out | head -1 | cut -d' ' -f1)"
    if grep -q 'errors: 0' pan.out && ! ls ./*.trail >/dev/null 2>&1; then
        echo "ok    $name: errors 0, ${states:-?} states, $((SECONDS - start)) s"
    else
        echo "FAIL  $name: pan found an error"; grep -E 'error|assert|violated' pan.out | head -5
        status=1
    fi
}

bad() {  # bad FLAG
    local flag=$1 start=$SECONDS
    build "-D$flag" -- -O1 -DSAFETY -DNOCLAIM -DCOLLAPSE
    ./pan -m100000 >pan.out 2>&1 || true
    if grep -Eq 'errors: [1-9]' pan.out || ls ./*.trail >/dev/null 2>&1; then
        echo "ok    $flag: caught ($(grep -Eo 'assertion violated [^ ]+|invalid end state|acceptance cycle' pan.out | head -1)), $((SECONDS - start)) s"
    else
        echo "FAIL  $flag: the variant passed, the model cannot see that bug"
        status=1
    fi
}

build -- -DSAFETY -DNOCLAIM -DCOLLAPSE
good "safety (assertions, invalid end states)" -m100000
for claim in $(grep -Eo '^ltl [a-z_]+' "$model" | cut -d' ' -f2); do
    build -- -DCOLLAPSE -DNFAIR=3
    good "liveness $claim (weak fairness)" -a -f -m100000 -N "$claim"
done
for flag in $(grep -Eo 'BUG_[A-Z_]+' "$model" | sort -u); do
    bad "$flag"
done
exit $status
