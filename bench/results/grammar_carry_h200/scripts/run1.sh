#!/usr/bin/env bash
# One call: profiled c32 runs (EAGLE3 3/1/4, accept 3, 1024 in / 256 out, one wave): the grammar
# engine unconstrained (fused steps), every request under the allow-all regex (split steps) with
# the carry change, and the same at HEAD's step_common.py (a copy of the tree); then the device
# work per steady decode step side by side (bench/step_device_diff.py) and a timeline of each.
set -uo pipefail
out=$OUT; tr=/tmp/tr
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/device.txt
python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__)" >> $out/device.txt
rm -rf /tmp/old && mkdir /tmp/old && cp -r bench jspec pallas_kernels checkpoints pyproject.toml /tmp/old/ 2>/dev/null
cp .cache/d/step_common_head.py /tmp/old/jspec/speculative/step_common.py
extra() { echo "--profile $tr/$1 --max-concurrency-list 32 --cuda-graph-bs 32 --random-output-len 256 --prompts-per-concurrency 1"; }
t0=$SECONDS
SKIP_BASELINE=1 EXTRA="$(extra off)" bash bench/grammar_cost.sh $out off 2>&1 | tail -3; echo "off done $((SECONDS-t0)) s"
SKIP_BASELINE=1 EXTRA="$(extra open)" bash bench/grammar_cost.sh $out open 2>&1 | tail -3; echo "open done $((SECONDS-t0)) s"
mkdir -p $out/old
(cd /tmp/old && SKIP_BASELINE=1 EXTRA="$(extra open_head)" bash bench/grammar_cost.sh $out/old open 2>&1 | tail -3); echo "old done $((SECONDS-t0)) s"
for r in off open open_head; do ls $tr/$r; done
python3 bench/step_device_diff.py off=$tr/off/EAGLE3_v2_c32 open=$tr/open/EAGLE3_v2_c32 open_head=$tr/open_head/EAGLE3_v2_c32 \
    --top 40 --json $out/step_device_diff.json 2>&1 | tee $out/step_device_diff.txt
python3 bench/step_device_diff.py open_head=$tr/open_head/EAGLE3_v2_c32 open=$tr/open/EAGLE3_v2_c32 --top 25 \
    2>&1 | tee $out/step_device_diff_head_vs_new.txt
for r in off open; do
  python3 bench/trace_timeline.py $tr/$r/EAGLE3_v2_c32 --first 40 --steps 3 > $out/timeline_steady_$r.txt 2>&1
  python3 bench/trace_timeline.py $tr/$r/EAGLE3_v2_c32 --step "jspec.dispatch extend" --first 8 --steps 2 > $out/timeline_ramp_$r.txt 2>&1
done
python3 bench/trace_summary.py $tr/off/EAGLE3_v2_c32 $tr/open/EAGLE3_v2_c32 --steps 1 > $out/trace_summary.txt 2>&1
cd $out && tar cJf results.tar.xz --exclude=results.tar.xz . && ls -la
