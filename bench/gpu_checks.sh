#!/usr/bin/env bash
# The GPU checks a session runs first, in one call (about four minutes on an H200): every kernel's
# GPU output against its reference (the paged attention bench's correctness section, the attention
# inputs for Qwen3-8B and Qwen3-Next heads, add + RMSNorm, the two-part prompt attention), the tiny
# Qwen3's greedy ids plain and with EAGLE3 in bf16 and float32 (plain == EAGLE3 is printed; with llguidance
# importable also EAGLE3 under an allow-all regex, == EAGLE3 printed), and the
# Qwen3-8B and Qwen3-Next-12L decode steps, and the host time to launch the Qwen3-8B decode step.
# Writes JSON / JSONL under OUT.
#   bench/gpu_checks.sh OUT
set -euo pipefail
out=$1
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
quiet() { grep -v "Warning\|warn(\|cuda_timer" || true; }
python3 bench/kernels/norm_rope_write.py --tokens 1,32,2048 --out "$out/check_norm_rope_write.json" 2>&1 | quiet
python3 bench/kernels/norm_rope_write.py --tokens 1,32,2048 --heads 16 --kv-heads 2 --head-dim 256 \
  --rotary-dim 64 --gated --out "$out/check_norm_rope_write_gated.json" 2>&1 | quiet
python3 bench/kernels/add_rms_norm.py --tokens 1,32,2048 --out "$out/check_add_rms_norm.json" 2>&1 | quiet
python3 bench/kernels/prefill_attention.py --out "$out/check_prefill_attention.json" 2>&1 | quiet | grep max_abs_err
# With llguidance importable, also EAGLE3 under an allow-all regex (split, pipelined steps: the
# forward as two loaded copies), which must equal EAGLE3 unconstrained.
grammar=$(python3 -c "import llguidance" 2>/dev/null && echo --grammar || true)
for dtype in bfloat16 float32; do
  python3 bench/greedy_ids.py --dtype "$dtype" $grammar > "$out/check_greedy_$dtype.json"
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[2], 'plain == eagle3:', d['plain'] == d['eagle3'],
      *(['eagle3 == eagle3_regex:', d['eagle3'] == d['eagle3_regex']] if 'eagle3_regex' in d else []))" \
    "$out/check_greedy_$dtype.json" "$dtype"
done
for preset in qwen3-8b qwen3-next-12l; do
  python3 -m jspec.cli bench step --model-path "random:$preset" --batch-sizes 1,8,32 \
    --output-file "$out/check_step_$preset.jsonl" 2>&1 | grep -E "^ *(batch|[0-9]+ +[0-9]+)"
done
# Host time to launch the decode step (the steps take the parameters as a flat tuple since dbda911).
python3 bench/launch_cost.py --preset qwen3-8b --batch-sizes 1,32 --reps 20 --out "$out/check_launch_cost.jsonl" 2>&1 \
  | grep -v "Warning\|warn(\|cuda_timer" | tail -2
