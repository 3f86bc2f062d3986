#!/usr/bin/env bash
# XLA's stream-ordered allocator (XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async) against the default:
# c1 alternate (one engine each, async, default, async), c32 alternate under async, and the
# command-buffer log of a 96-token c1 run under async (which captured graphs re-record).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
mkdir -p /tmp/res
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res/cb_async
TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 SKIP_BASELINE=1 XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async \
  EXTRA="--random-output-len 96 --prompts-per-concurrency 1" CONCURRENCY=1 PARTS=default \
  bash bench/grammar_cost.sh /tmp/cb_async graph-parts 2>&1 | grep -E "EAGLE3|rror" | head
python3 bench/command_buffer_log.py /tmp/cb_async/serve_grammar_parts_default.log /tmp/res/cb_async/cb_async.json > /tmp/res/cb_async/cb_async.txt 2>&1
head -30 /tmp/res/cb_async/cb_async.txt; save
for v in async default async; do
  [[ $v == async ]] && a=cuda_async || a=default
  mkdir -p /tmp/res/c1_$v$SECONDS
  echo "== c1 $v $(date +%T)"
  XLA_PYTHON_CLIENT_ALLOCATOR=$a CONCURRENCY=1 PROMPTS=4 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c1_$v$SECONDS alternate 2>&1 | grep -E "^constraint|rror"
  save
done
mkdir -p /tmp/res/c32_async
echo "== c32 async $(date +%T)"
XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async CONCURRENCY=32 PROMPTS=32 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c32_async alternate 2>&1 | grep -E "^constraint|rror"
save
