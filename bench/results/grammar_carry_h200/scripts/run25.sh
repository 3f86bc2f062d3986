#!/usr/bin/env bash
# The top-k threshold as the default (every row count): a GPU check with row masks, the top-k
# bench at k 20, then bench/logprob_cost.sh off / logprobs / input (EAGLE3 c1 / c32).
set -uo pipefail
out=$OUT
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res
PYTHONPATH=. timeout 120 python3 .cache/d/check_top_k.py 2>&1 | tail -3
PYTHONPATH=. timeout 100 python3 bench/top_k.py --rows 1,32,128,512,2048 --k 20 --blocks 1024 --warps 4 \
    --reps 10 --out /tmp/res/top_k_k20.jsonl 2>&1 | cut -c1-300
save
for stage in off logprobs input; do
  left=$((585 - SECONDS)); (( left > 90 )) || break
  echo "== logprob_cost $stage ($SECONDS s)"
  timeout $left bash bench/logprob_cost.sh /tmp/res $stage 2>&1 | grep -E "^algorithm|rror" | cut -c1-200
  save
done
echo "== done ($SECONDS s)"
