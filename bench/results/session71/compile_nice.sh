#!/usr/bin/env bash
# Whether the start-up compile pool at a lower priority (JSPEC_COMPILE_NICE, jspec/runtime/compile_pool.py)
# shortens a cold start. Session 71's memo runs: the main thread's tracing + lowering takes 46-54 s
# (memo off) or 30-36 s (memo on) of a cold start beside the compiles, against 20-32 s in a warm_xla
# start with nothing compiling, so the compiles slow the serial critical path. One throwaway process
# first (imports, a device computation: the first process on a fresh machine runs ~1.4x slower), then
# cold starts alternated nice 0 / 10, each in its own empty cache folder.
#   JSPEC_COMMIT=<sha> LIMIT=560 bash bench/results/session71/compile_nice.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/device.txt; nproc >> $OUT/device.txt; lscpu | grep "Model name" >> $OUT/device.txt
python3 -c "import jax, jax.numpy as jnp; import jspec.api; print(float(jnp.ones((4096, 4096)).sum()))" > /dev/null 2>&1
i=0
for n in ${NICE:-0 10 0 10 0 10}; do
  (( ${LIMIT:-560} - SECONDS > 90 )) || { echo "== stop ($SECONDS s)"; break; }
  i=$((i + 1)); mkdir -p /tmp/nice_$i
  echo "== cold, nice $n ($SECONDS s)"
  JSPEC_COMPILE_NICE=$n timeout $((${LIMIT:-560} - SECONDS)) python3 bench/startup.py --preset qwen3-8b --cache-dir /tmp/nice_$i \
    --runs cold --out $OUT/startup_compile_nice.jsonl 2>&1 | grep -v "Warning\|warn(\|cuda_timer" | tail -1
done
echo "== done ($SECONDS s)"
