#!/usr/bin/env bash
# The constraint's cost with EOS biased away on both sides (db87a9a): c32 alternate over three
# engines with host phases, then one c32 engine with the bias switched off (the old workload,
# through a sitecustomize that replaces jspec.bench.serve.eos_bias), then c1 (one engine, 2 rounds).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/device.txt
nproc >> $out/device.txt
mkdir -p /tmp/res/c32 /tmp/res/c32_nobias /tmp/res/c1 /tmp/nobias
save() { (cd /tmp/res && tar cJf $out/results.tar.xz --exclude='host_phases_*.json' .); }
echo "== c32 $(date +%T)"
PHASES=1 ROUNDS=1 PROMPTS=32 PROCESSES=3 bash bench/grammar_cost.sh /tmp/res/c32 alternate 2>&1 | tail -12
save
printf 'import jspec.bench.serve as s\ns.eos_bias = lambda args, eos_token_ids: None\n' > /tmp/nobias/sitecustomize.py
echo "== c32 nobias $(date +%T)"
PYTHONPATH=/tmp/nobias:$PWD:/tmp/llg ROUNDS=1 PROMPTS=32 bash bench/grammar_cost.sh /tmp/res/c32_nobias alternate 2>&1 | tail -4
save
echo "== c1 $(date +%T)"
CONCURRENCY=1 PROMPTS=4 ROUNDS=2 bash bench/grammar_cost.sh /tmp/res/c1 alternate 2>&1 | tail -6
save
echo "== done $(date +%T)"
