#!/usr/bin/env bash
# GPU A/B of pallas_kernels/mlir_dialects.py: one cold start to fill XLA's cache, then warm_xla
# starts (the main thread's tracing + lowering with nothing compiling beside it) alternated
# without / with it (nofix/sitecustomize.py turns it off).
#   JSPEC_COMMIT=<sha> LIMIT=500 bash bench/results/session72/dialect_ab.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=.:$here/nofix PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/device.txt
mkdir -p /tmp/dab
run() { timeout $((${LIMIT:-500} - SECONDS)) python3 bench/startup.py --preset qwen3-8b --cache-dir /tmp/dab "$@" \
          --out $OUT/startup_dialect_ab.jsonl 2>&1 | grep -v "Warning\|warn(\|cuda_timer" | tail -1; }
echo "== cold, fix on ($SECONDS s)"; run --runs cold
for off in 1 0 1 0 1 0 1 0; do
  (( ${LIMIT:-500} - SECONDS > 45 )) || { echo "== stop ($SECONDS s)"; break; }
  echo "== warm_xla, fix off=$off ($SECONDS s)"; JSPEC_NO_DIALECT_FIX=$off run --runs warm_xla
done
echo "== done ($SECONDS s)"
