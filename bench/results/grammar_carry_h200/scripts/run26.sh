#!/usr/bin/env bash
# Input logprobs' cost at EAGLE3 c32, repeated: off / input twice more (bench/logprob_cost.sh, c32 only).
# LIMIT: seconds for the whole script (default 400).
set -uo pipefail
out=$OUT
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
export EXTRA="--max-concurrency-list 32 --skip-baseline"
for r in 1 2; do
  for stage in off input; do
    left=$((${LIMIT:-400} - SECONDS)); (( left > 60 )) || break 2
    mkdir -p /tmp/res/r$r
    echo "== $stage r$r ($SECONDS s)"
    timeout $left bash bench/logprob_cost.sh /tmp/res/r$r $stage 2>&1 | grep -E "^algorithm|rror" | cut -c1-200
    save
  done
done
echo "== done ($SECONDS s)"
