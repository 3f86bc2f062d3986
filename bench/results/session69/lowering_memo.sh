#!/usr/bin/env bash
# Start-up with and without the Triton lowering memo (pallas_kernels/lowering_cache.py): one cold
# start fills XLA's persistent cache, then starts with that cache alone (the main thread traces and
# lowers every bucket, XLA loads), memo off / on alternated while time allows.
#   JSPEC_COMMIT=<sha> LIMIT=175 bash bench/results/session69/lowering_memo.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/device.txt; nproc >> $OUT/device.txt
d=/tmp/startup_cache; mkdir -p $d
run() { timeout $((${LIMIT:-580} - SECONDS)) python3 bench/startup.py --preset qwen3-8b --cache-dir $d "$@" \
          --out $OUT/startup_lowering_memo.jsonl 2>&1 | grep -v "Warning\|warn(\|cuda_timer" | tail -2; }
echo "== cold, memo on ($SECONDS s)"; run --runs cold
for m in 0 1 0 1; do
  (( ${LIMIT:-580} - SECONDS > 45 )) || { echo "== stop ($SECONDS s)"; break; }
  echo "== warm_xla, memo $m ($SECONDS s)"; JSPEC_PALLAS_LOWERING_CACHE=$m run --runs warm_xla
done
echo "== done ($SECONDS s)"
