#!/usr/bin/env bash
# Input logprobs after the stream stopped rebuilding the prompt's rows per chunk (722563f):
# bench/logprob_cost.sh off / logprobs / input on one machine, then c1 copies 1 / 0 once more.
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res/logprob
for stage in off logprobs input; do
  left=$((580 - SECONDS)); (( left > 60 )) || break
  echo "== logprob $stage ($SECONDS s)"
  timeout $left bash bench/logprob_cost.sh /tmp/res/logprob $stage 2>&1 | grep -E "^ +(none|EAGLE3)|rror" | head
  save
done
for copies in 1 0; do
  left=$((580 - SECONDS)); (( left > 70 )) || break
  d=/tmp/res/copies_c1_${copies}_r3; mkdir -p $d; echo "== c1 copies=$copies r3 ($SECONDS s)"
  JSPEC_GRAMMAR_FORWARD_COPIES=$copies CONCURRENCY=1 PROMPTS=4 ROUNDS=1 timeout $left bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"
  save
done
echo "== done ($SECONDS s)"
