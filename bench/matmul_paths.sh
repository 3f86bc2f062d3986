#!/usr/bin/env bash
# Which matmul path the decode steps should take (bench/README.md, "wide decode steps with XLA's
# autotuning off"): `jspec/runtime/compile_options.py` compiles decode steps of CUBLAS_FROM_ROWS
# (24) or more target rows with Triton GEMM fusions off and XLA's autotuning off, so that cuBLAS's
# own heuristic picks each algorithm; narrower steps keep XLA's autotuned Triton GEMM fusions.
# Each stage alternates two XLA settings twice on one machine. Writes JSONL under OUT.
#   bench/matmul_paths.sh OUT narrow | spec
# narrow: Qwen3-8B plain decode at batch 1 / 2 / 4 / 8 / 16, XLA's defaults (Triton GEMM fusions,
#   autotuned) vs cuBLAS's heuristic for every matmul: whether CUBLAS_FROM_ROWS should come down.
# spec: the EAGLE3 (Qwen3-8B) and NEXTN (Qwen3-Next-12L) chain 3/1/4 steps at batch 1 / 8 / 32
#   (`bench/spec_eagle.py`), as compiled now vs with XLA's autotuning back on everywhere: whether
#   the verify steps of 24+ target rows (and their drafters' matmuls) gain or lose on the heuristic.
set -euo pipefail
# XLA reads a flags value that does not start with "--" as a file name: set it only when not empty.
out=$1; stage=$2
heuristic="--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"
for round in 1 2; do
  case $stage in
    narrow)
      for arm in default heuristic; do
        flags=${XLA_FLAGS:-}; [ $arm = heuristic ] && flags="$flags $heuristic"
        echo "== $arm (round $round)"
        env ${flags:+"XLA_FLAGS=$flags"} PYTHONPATH=. python3 -m jspec.cli bench step --model-path random:qwen3-8b \
            --batch-sizes 1,2,4,8,16 --output-file "$out/step_matmul_paths_$arm.jsonl" 2>&1 | grep -E "^ *(batch|[0-9]+ +[0-9]+)"
      done ;;
    spec)
      for arm in now autotuned; do
        flags=${XLA_FLAGS:-}; [ $arm = autotuned ] && flags="$flags --xla_gpu_autotune_level=4"
        echo "== $arm (round $round)"
        env ${flags:+"XLA_FLAGS=$flags"} PYTHONPATH=. python3 bench/spec_eagle.py --batches 1,8,32 --split-batches "" \
            --trees "" --out "$out/spec_matmul_paths_${arm}_$round.json" 2>&1 | grep -E "vs|ms" | tail -8
      done ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
