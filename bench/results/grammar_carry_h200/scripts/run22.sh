#!/usr/bin/env bash
# Next session: where input logprobs cost (bench/README "input logprobs": -17.7% at c32, EAGLE3,
# about 25-55 ms more per 2048-token prompt chunk). 1) bench/input_logprob_ttft.py: TTFT of fresh
# 1024 / 2048-token prompts without / with input logprobs (/ with 5 top), blocks of 128 tokens
# (the old size) and 512 (the default), with a trace of each kind summarised by trace_summary.py;
# 2) the plain engine at c32 (64 prompts of 1024, 128 out) without / with input logprobs under
# bench/host_phases.py (every span summed per run: `totals`).
set -uo pipefail
out=$OUT
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res
echo "== ttft ($SECONDS s)"
PYTHONPATH=. timeout 300 python3 bench/input_logprob_ttft.py --preset qwen3-8b --block-bytes 77791232,536870912 \
    --profile /tmp/trace --out /tmp/res/input_logprob_ttft.json 2>&1 | grep -E "^blocks|rror"
for d in /tmp/trace/*/*; do
  PYTHONPATH=. python3 bench/trace_summary.py $d --steps 1 > /tmp/res/trace_$(basename $(dirname $d))_$(basename $d).txt 2>&1
done
head -40 /tmp/res/trace_536870912_t2048_input_top5.txt
save
common=(--model-path random:qwen3-8b --chunked-prefill-size 2048 --cuda-graph-bs 1,32 --prefill-token-buckets 2048
        --disable-top-k-top-p --quiet --dataset-name random --random-input-len 1024 --random-output-len 128
        --random-range-ratio 1 --num-prompts 64 --max-concurrency 32 --return-logprob --top-logprobs-num 5)
for stage in off input; do
  left=$((570 - SECONDS)); (( left > 90 )) || break
  extra=(); [[ $stage == input ]] && extra=(--logprob-start-len 0)
  echo "== phases $stage ($SECONDS s)"
  PYTHONPATH=. timeout $left python3 bench/host_phases.py record /tmp/res/phases_$stage.json -- bench serve "${common[@]}" \
      "${extra[@]}" --output-file /tmp/res/serve_$stage.jsonl 2>&1 | grep -E "Output token throughput|Mean TTFT|Mean TPOT|rror"
  PYTHONPATH=. python3 bench/host_phases.py totals /tmp/res/phases_$stage.json > /tmp/res/phases_$stage.txt 2>&1
  tail -14 /tmp/res/phases_$stage.txt
  save
done
echo "== done ($SECONDS s)"
