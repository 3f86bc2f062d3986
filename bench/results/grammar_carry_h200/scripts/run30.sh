#!/usr/bin/env bash
# Tenth session, one H200 call: issue 19's decode headline at this commit (engine_decode B1 / B32
# ctx 1024 and batch-1 end to end), then input logprobs' cost at EAGLE3 c32 with the prompt's top
# rows built by the reader (26b8ed1): bench/logprob_cost.sh off / input, twice, c32 only.
set -uo pipefail
out=$OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res
echo "== decode ($SECONDS s)"
timeout 150 python3 bench/engine_decode.py --models qwen3-8b --grid 1:1024,32:1024 --skip-peer \
    --out $out/engine_decode_h200.json 2>&1 | grep -E "ms|tok/s|copy" | grep -v "Warning\|warn(" | tail -8
export EXTRA="--max-concurrency-list 32 --skip-baseline"
for r in 1 2; do
  for stage in off input; do
    left=$((${LIMIT:-570} - SECONDS)); (( left > 60 )) || break 2
    mkdir -p /tmp/res/r$r
    echo "== $stage r$r ($SECONDS s)"
    timeout $left bash bench/logprob_cost.sh /tmp/res/r$r $stage 2>&1 | grep -E "^algorithm|rror" | cut -c1-200
    save
  done
done
echo "== done ($SECONDS s)"
