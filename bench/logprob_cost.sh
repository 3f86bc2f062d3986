#!/usr/bin/env bash
# What logprobs and penalties cost under speculation (bench/README.md, "Logprobs and penalties"):
# Qwen3-8B shape + random EAGLE3 head at simulated accept 3 (spec v2), random 1024 in / 512 out,
# concurrency 1 and 32, one stage per call. Writes JSONL under OUT.
#   bench/logprob_cost.sh OUT off | logprobs | input | penalties | before
# input: every request also asks for its prompt's logprobs from position 0 (SGLang's
#   input_token_logprobs; the engine compiles its input-logprob prompt steps for it).
# EXTRA: more options for the sweep, after the others (e.g. "--max-concurrency-list 32 --skip-baseline").
# before: the same run on an older tree (CODE=DIR holding its jspec/, pallas_kernels/, checkpoints/),
#   e.g. the commit before speculative steps computed penalties and logprobs.
set -euo pipefail
out=$1; stage=$2
common=(--model-path random:qwen3-8b --speculative-algorithm-list EAGLE3 --overlap-list on --quiet
        --speculative-draft-model-path random --speculative-num-steps-list 3 --speculative-eagle-topk-list 1
        --speculative-num-draft-tokens-list 4 --speculative-simulate-accept-length-list 3
        --chunked-prefill-size 2048 --cuda-graph-bs 1,32 --prefill-token-buckets 2048 --disable-top-k-top-p
        --dataset-name random --random-input-len 1024 --random-output-len 512 --random-range-ratio 1
        --prompts-per-concurrency 2 --max-concurrency-list 1,32)
code=.
case $stage in
  off) extra=() ;;
  logprobs) extra=(--return-logprob --top-logprobs-num 5) ;;
  input) extra=(--return-logprob --top-logprobs-num 5 --logprob-start-len 0) ;;
  penalties) extra=(--frequency-penalty 0.5 --presence-penalty 0.3 --repetition-penalty 1.1) ;;
  before) extra=(); code=${CODE:?set CODE to the older tree} ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
PYTHONPATH=$code python3 -m jspec.cli bench sweep "${common[@]}" "${extra[@]}" ${EXTRA:-} \
    --output-file "$out/serve_logprob_cost_$stage.jsonl" 2>&1 | tee "$out/serve_logprob_cost_$stage.log"
