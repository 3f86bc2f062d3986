#!/usr/bin/env bash
# Second round of the lowering memo's start-up figure (pallas_kernels/lowering_cache.py), with the
# order reversed against session 70's first call (memo on first), so that a first start's own costs
# (a cold file cache, the first import) fall on the other side: cold starts memo on / off
# alternated, each in its own empty cache folder, then warm_xla starts alternated while time allows.
# On an H200 it runs ../session68/all.sh instead (the open figures of issues 19 and 21).
#   JSPEC_COMMIT=<sha> LIMIT=560 bash bench/results/session71/memo_rounds.sh    (carry .cache/d)
set -uo pipefail
here=$(dirname "$0")
if nvidia-smi -L | grep -q H200; then echo "== H200: all.sh"; exec bash "$here/../session68/all.sh"; fi
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/device.txt; nproc >> $OUT/device.txt; lscpu | grep "Model name" >> $OUT/device.txt
run() { local d=$1; shift; timeout $((${LIMIT:-560} - SECONDS)) python3 bench/startup.py --preset qwen3-8b \
          --cache-dir $d "$@" --out $OUT/startup_lowering_memo.jsonl 2>&1 | grep -v "Warning\|warn(\|cuda_timer" | tail -1; }
i=0
for m in ${COLD:-1 0 1 0}; do
  (( ${LIMIT:-560} - SECONDS > 90 )) || { echo "== stop ($SECONDS s)"; break; }
  i=$((i + 1)); mkdir -p /tmp/cold_$i
  echo "== cold, memo $m ($SECONDS s)"; JSPEC_PALLAS_LOWERING_CACHE=$m run /tmp/cold_$i --runs cold
done
for m in ${WARM:-1 0 1 0 1 0}; do
  (( ${LIMIT:-560} - SECONDS > 50 )) || { echo "== stop ($SECONDS s)"; break; }
  echo "== warm_xla, memo $m ($SECONDS s)"; JSPEC_PALLAS_LOWERING_CACHE=$m run /tmp/cold_1 --runs warm_xla
done
echo "== done ($SECONDS s)"
