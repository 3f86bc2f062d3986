#!/usr/bin/env bash
# Input logprobs in larger blocks that skip a chunk's padding (this commit): logprob_cost.sh off / input.
set -uo pipefail
out=$OUT
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res/logprob
for stage in off input; do
  left=$((330 - SECONDS)); (( left > 60 )) || break
  echo "== logprob $stage ($SECONDS s)"
  timeout $left bash bench/logprob_cost.sh /tmp/res/logprob $stage 2>&1 | grep -E "^ +(none|EAGLE3)|rror" | head
  save
done
echo "== done ($SECONDS s)"
