#!/usr/bin/env bash
# The serving sweeps of bench/README.md ("Serving at high concurrency"), one stage per call so each
# fits a 10-minute device command. Writes JSONL (and the printed table) under OUT.
#   bench/serving_sweep.sh OUT eagle3-v2 | eagle3-v1 | mtp-v2 | adaptive-on | adaptive-off
# adaptive-*: a drafter that is accepted less (simulated accept length 1.5), where speculation stops
# paying at large batches, with speculative_adaptive on and off (random 1024 in / 512 out).
set -euo pipefail
out=$1; stage=$2
common=(--chunked-prefill-size 2048 --cuda-graph-bs 1,8,32,64,128 --speculative-draft-model-path random --quiet
        --disable-top-k-top-p --dataset-name random --random-input-len 1024 --random-output-len 1024
        --random-range-ratio 1 --prompts-per-concurrency 2 --max-concurrency-list 1,8,32,64,128
        --speculative-num-steps-list 3 --speculative-eagle-topk-list 1 --speculative-num-draft-tokens-list 4
        --speculative-simulate-accept-length-list 3)
case $stage in
  eagle3-v2) args=(--model-path random:qwen3-8b --speculative-algorithm-list none,EAGLE3 --overlap-list on) ;;
  eagle3-v1) args=(--model-path random:qwen3-8b --speculative-algorithm-list none,EAGLE3 --overlap-list off) ;;
  mtp-v2) args=(--model-path random:qwen3-next-12l --speculative-algorithm-list none,NEXTN --overlap-list on) ;;
  adaptive-on|adaptive-off)
    # later flags override the common ones (argparse keeps the last)
    args=(--model-path random:qwen3-8b --speculative-algorithm-list none,EAGLE3 --overlap-list on
          --speculative-adaptive "${stage#adaptive-}" --speculative-simulate-accept-length-list 1.5
          --random-output-len 512 --max-concurrency-list 1,32,128) ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
PYTHONPATH=. python3 -m jspec.cli bench sweep "${common[@]}" "${args[@]}" \
    --output-file "$out/serve_sweep_$stage.jsonl" 2>&1 | tee "$out/serve_sweep_$stage.log"
