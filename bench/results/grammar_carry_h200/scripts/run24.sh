#!/usr/bin/env bash
# Input logprobs after the collector pause (gc_heap.paused) and the top-k threshold pass:
# 1) bench/top_k.py k 5 / 20, with and without the threshold, up to 2048 rows;
# 2) bench/input_logprob_ttft.py (blocks of 512) with traces; 3) the plain engine c32 off / input
# under host_phases (as run22); 4) bench/logprob_cost.sh off / input (EAGLE3 c1 / c32).
set -uo pipefail
out=$OUT
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res
echo "== top_k ($SECONDS s)"
PYTHONPATH=. timeout 150 python3 bench/top_k.py --rows 1,8,32,64,128,512,2048 --k 5 --blocks 1024,2048 --warps 4 \
    --thresholds 0,1 --reps 10 --out /tmp/res/top_k_k5.jsonl 2>&1 | cut -c1-400
PYTHONPATH=. timeout 120 python3 bench/top_k.py --rows 1,8,32,64,128,512 --k 20 --blocks 1024 --warps 4 \
    --thresholds 0,1 --reps 10 --out /tmp/res/top_k_k20.jsonl 2>&1 | cut -c1-400
save
echo "== ttft ($SECONDS s)"
PYTHONPATH=. timeout 200 python3 bench/input_logprob_ttft.py --preset qwen3-8b --block-bytes 536870912 \
    --profile /tmp/trace --out /tmp/res/input_logprob_ttft.json 2>&1 | grep -E "^blocks|rror"
for d in /tmp/trace/*/*; do
  PYTHONPATH=. python3 bench/trace_summary.py $d --steps 1 > /tmp/res/trace_$(basename $(dirname $d))_$(basename $d).txt 2>&1
done
head -12 /tmp/res/trace_536870912_t2048_input_top5.txt
save
common=(--model-path random:qwen3-8b --chunked-prefill-size 2048 --cuda-graph-bs 1,32 --prefill-token-buckets 2048
        --disable-top-k-top-p --quiet --dataset-name random --random-input-len 1024 --random-output-len 128
        --random-range-ratio 1 --num-prompts 64 --max-concurrency 32 --return-logprob --top-logprobs-num 5)
for stage in off input; do
  left=$((580 - SECONDS)); (( left > 60 )) || break
  extra=(); [[ $stage == input ]] && extra=(--logprob-start-len 0)
  echo "== phases $stage ($SECONDS s)"
  PYTHONPATH=. timeout $left python3 bench/host_phases.py record /tmp/res/phases_$stage.json -- bench serve "${common[@]}" \
      "${extra[@]}" --output-file /tmp/res/serve_$stage.jsonl 2>&1 | grep -E "Output token throughput|Mean TTFT|rror"
  PYTHONPATH=. python3 bench/host_phases.py totals /tmp/res/phases_$stage.json > /tmp/res/phases_$stage.txt 2>&1
  grep -E "dispatch|process|gc|step " /tmp/res/phases_$stage.txt
  save
done
for stage in off input; do
  left=$((585 - SECONDS)); (( left > 90 )) || break
  echo "== logprob_cost $stage ($SECONDS s)"
  timeout $left bash bench/logprob_cost.sh /tmp/res $stage 2>&1 | grep -E "EAGLE3|rror" | cut -c1-200
  save
done
echo "== done ($SECONDS s)"
