#!/usr/bin/env bash
# Issue 19's headlines at one commit on one machine, each stage into OUT as it finishes:
#   STAGES="decode spec profile startup prefill" LIMIT=580 bash run.sh
# decode: bench/engine_decode.py B1 / B32 at ctx 1024 and batch-1 end to end; spec: the EAGLE3 3/1/4
# and NEXTN step rows; profile: the B1 / B32 decode profile; startup: cold, warm with XLA's cache,
# warm with the compiled-step cache; prefill: the prompt-chunk attention kernel bench.
set -uo pipefail
out=$OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1
tag=${TAG:-$(nvidia-smi -L | grep -q H200 && echo h200 || echo h100)}
nvidia-smi -L > $out/device_$tag.txt; nproc >> $out/device_$tag.txt
run() {  # name, seconds wanted, command...
  local name=$1 want=$2; shift 2
  local left=$((${LIMIT:-580} - SECONDS))
  (( left > want )) || { echo "== skip $name ($left s left, $want wanted)"; return; }
  echo "== $name ($SECONDS s)"
  timeout $left "$@" 2>&1 | grep -v "Warning\|warn(\|cuda_timer" | tail -${TAILN:-25}
}
for stage in ${STAGES:-decode spec profile startup prefill}; do
  case $stage in
    decode) run decode 60 python3 bench/engine_decode.py --models qwen3-8b --grid 1:1024,32:1024 --skip-peer \
              --out $out/engine_decode_$tag.json ;;
    spec) run spec 90 python3 bench/spec_eagle.py --batches 1,32 --split-batches 1 --trees "" \
              --out $out/spec_eagle_$tag.json ;;
    profile) run profile 60 python3 bench/decode_profile.py --cases qwen3-8b:1:pallas,qwen3-8b:32:pallas \
              --out $out/decode_profile_$tag.json ;;
    startup) run startup 150 python3 bench/startup.py --preset qwen3-8b --out $out/startup_$tag.jsonl ;;
    prefill) run prefill 60 python3 bench/kernels/prefill_attention.py --out $out/prefill_attention_$tag.json ;;
  esac
done
echo "== done ($SECONDS s)"
