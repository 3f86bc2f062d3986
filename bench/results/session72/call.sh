#!/usr/bin/env bash
# The next device call: on an H200, every open figure of issues 19 and 21 (../session68/all.sh);
# on an H100, cold starts alternated without / with pallas_kernels/mlir_dialects.py (nofix/),
# each in its own empty cache folder, after one throwaway process.
#   JSPEC_COMMIT=<sha> LIMIT=560 bash bench/results/session72/call.sh    (carry .cache/d)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if nvidia-smi -L | grep -q H200; then echo "== H200: all.sh"; exec bash "$here/../session68/all.sh"; fi
echo "== not an H200: MLIR dialect lookup, cold pairs"
export PYTHONPATH=.:$here/nofix PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/device.txt; nproc >> $OUT/device.txt
python3 -c "import jax, jax.numpy as jnp; import jspec.api; print(float(jnp.ones((4096, 4096)).sum()))" > /dev/null 2>&1
i=0
for off in ${OFF:-1 0 1 0 1 0}; do
  (( ${LIMIT:-560} - SECONDS > 90 )) || { echo "== stop ($SECONDS s)"; break; }
  i=$((i + 1)); mkdir -p /tmp/dcold_$i
  echo "== cold, fix off=$off ($SECONDS s)"
  JSPEC_NO_DIALECT_FIX=$off timeout $((${LIMIT:-560} - SECONDS)) python3 bench/startup.py --preset qwen3-8b \
    --cache-dir /tmp/dcold_$i --runs cold --out $OUT/startup_dialect_cold.jsonl 2>&1 | grep -v "Warning\|warn(\|cuda_timer" | tail -1
done
echo "== done ($SECONDS s)"
