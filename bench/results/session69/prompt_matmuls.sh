#!/usr/bin/env bash
# Prompt steps' matmuls, XLA's autotuned Triton GEMM fusions vs cuBLAS's heuristic
# (JSPEC_PROMPT_MATMULS, jspec/runtime/compile_options.py), one call: time to first token of
# 512-16384-token prompts (bench/prefill_ttft.py --compare matmuls, four engines alternated), then
# cold starts of the default bucket set, cublas / autotune / cublas, the first one also profiled.
#   JSPEC_COMMIT=<sha> bash bench/results/session69/prompt_matmuls.sh
# STAGES="cold" MODES="autotune cublas autotune cublas" PROFILE=0: cold starts alone, none profiled.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L > $OUT/device.txt; nproc >> $OUT/device.txt
[[ " ${STAGES:-ttft cold} " == *" ttft "* ]] && echo "== ttft ($SECONDS s)" && timeout 260 python3 bench/prefill_ttft.py --preset qwen3-8b --compare matmuls --out $OUT/prefill_ttft_matmuls.json 2>&1 \
  | grep -v "Warning\|warn(\|cuda_timer" | tail -8
i=0
[[ " ${STAGES:-ttft cold} " == *" cold "* ]] || MODES=""
for mode in ${MODES-cublas autotune cublas}; do
  i=$((i + 1)); left=$((${LIMIT:-580} - SECONDS))
  (( left > 80 )) || { echo "== skip cold $mode ($left s left)"; continue; }
  prof=(); [[ $i == 1 && ${PROFILE:-1} == 1 ]] && prof=(--profile-dir /tmp/prof)
  echo "== cold $mode ($SECONDS s)"
  JSPEC_PROMPT_MATMULS=$mode timeout $left python3 bench/startup.py --preset qwen3-8b --runs cold "${prof[@]}" \
    --out $OUT/startup_cold_prompt_matmuls.jsonl 2>&1 | grep -v "Warning\|warn(\|cuda_timer" | tail -4
done
[[ -d /tmp/prof ]] && cp /tmp/prof/*.txt $OUT/ 2>/dev/null
echo "== done ($SECONDS s)"
