#!/usr/bin/env bash
# Start-up with and without the Triton lowering memo (pallas_kernels/lowering_cache.py) on one host:
# a cold pair (each with its own empty cache folder, memo off then on), then starts with XLA's
# persistent cache alone (the main thread traces and lowers every bucket, XLA loads), memo off / on
# alternated while time allows.
#   JSPEC_COMMIT=<sha> LIMIT=580 bash bench/results/session70/lowering_memo.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/device.txt; nproc >> $OUT/device.txt; lscpu | grep "Model name" >> $OUT/device.txt
run() { local d=$1; shift; timeout $((${LIMIT:-580} - SECONDS)) python3 bench/startup.py --preset qwen3-8b \
          --cache-dir $d "$@" --out $OUT/startup_lowering_memo.jsonl 2>&1 | grep -v "Warning\|warn(\|cuda_timer" | tail -2; }
mkdir -p /tmp/memo_off /tmp/memo_on
echo "== cold, memo 0 ($SECONDS s)"; JSPEC_PALLAS_LOWERING_CACHE=0 run /tmp/memo_off --runs cold
echo "== cold, memo 1 ($SECONDS s)"; JSPEC_PALLAS_LOWERING_CACHE=1 run /tmp/memo_on --runs cold
for m in 0 1 0 1 0 1; do
  (( ${LIMIT:-580} - SECONDS > 45 )) || { echo "== stop ($SECONDS s)"; break; }
  echo "== warm_xla, memo $m ($SECONDS s)"; JSPEC_PALLAS_LOWERING_CACHE=$m run /tmp/memo_on --runs warm_xla
done
echo "== done ($SECONDS s)"
