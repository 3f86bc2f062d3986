#!/usr/bin/env bash
# c32 alternate (three engines one after another) and c1 (one), at the carry change.
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nvidia-smi --query-gpu=name,driver_version --format=csv > $out/device.txt
nproc >> $out/device.txt
mkdir -p $out/c32 $out/c1
PHASES=1 ROUNDS=1 PROMPTS=32 PROCESSES=3 bash bench/grammar_cost.sh $out/c32 alternate 2>&1 | tail -12
CONCURRENCY=1 PROMPTS=4 ROUNDS=2 bash bench/grammar_cost.sh $out/c1 alternate 2>&1 | tail -6
rm -f $out/c32/host_phases_*.json
cd $out && tar cJf /tmp/results.tar.xz . && mv /tmp/results.tar.xz $out/ && ls -la $out
