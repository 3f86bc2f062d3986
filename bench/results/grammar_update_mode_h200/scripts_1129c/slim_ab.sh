#!/usr/bin/env bash
# New (this tree) against old (.cache/d/old.tar.xz, the tree before slim parts) on one machine:
# the one-wave c32 alternate run with host phases, processes interleaved.
set -uo pipefail
out=$1
mkdir -p /tmp/old && tar xJf .cache/d/old.tar.xz -C /tmp/old
here=$(pwd)
for i in 1 2; do
  for v in new old; do
    d=$out/${v}_$i; mkdir -p "$d"
    [[ $v == new ]] && dir=$here || dir=/tmp/old
    echo "== $v $i"
    (cd "$dir" && PHASES=1 ROUNDS=1 PROMPTS=32 bash bench/grammar_cost.sh "$d" alternate 2>&1 | grep -E "^constraint|rror")
    grep -E "^run 1|first_call|second_call|forward_launch|walk" "$d/host_phases_c32.txt" | head -12
  done
done
