#!/usr/bin/env bash
# Next session, call 2: copies at c32 (1 / 0, one engine each), then the input-logprob cost
# (`bench/logprob_cost.sh OUT off` and `input`, concurrency 1 and 32).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res
for copies in 1 0; do
  d=/tmp/res/copies_c32_$copies; mkdir -p $d; echo "== c32 copies=$copies ($SECONDS s)"
  JSPEC_GRAMMAR_FORWARD_COPIES=$copies CONCURRENCY=32 PROMPTS=32 ROUNDS=1 timeout 150 bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"
  save
done
for stage in off input; do
  left=$((585 - SECONDS)); (( left > 60 )) || break
  mkdir -p /tmp/res/logprob; echo "== logprob $stage ($SECONDS s)"
  timeout $left bash bench/logprob_cost.sh /tmp/res/logprob $stage 2>&1 | grep -E "^ +EAGLE3|rror" | head
  save
done
echo "== done ($SECONDS s)"
