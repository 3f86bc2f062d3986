#!/usr/bin/env bash
# XLA's separate temp-buffer color (--xla_gpu_temp_buffer_use_separate_color=true in XLA_FLAGS: the
# client adds a stream-ordered pool for every compiled step's temporaries, "fixed address on every
# iteration"; everything else stays in the BFC allocator) against the defaults: first the
# command-buffer log of a 96-token c1 run under it (do the forward part's graphs still re-record?),
# then c1 alternated (flag, default, flag, default; one engine each), then c32 once each.
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
mkdir -p /tmp/res /tmp/cb_color
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
FLAG=--xla_gpu_temp_buffer_use_separate_color=true
XLA_FLAGS=$FLAG TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 SKIP_BASELINE=1 \
  EXTRA="--random-output-len 96 --prompts-per-concurrency 1" CONCURRENCY=1 PARTS=default \
  bash bench/grammar_cost.sh /tmp/cb_color graph-parts 2>&1 | grep -E "EAGLE3|rror" | head
mkdir -p /tmp/res/cb_color
python3 bench/command_buffer_log.py /tmp/cb_color/serve_grammar_parts_default.log /tmp/res/cb_color/cb.json > /tmp/res/cb_color/cb.txt 2>&1
head -20 /tmp/res/cb_color/cb.txt; save
for r in 1 2; do
  for v in color default; do
    mkdir -p /tmp/res/c1_$v$r; echo "== c1 $v $r $(date +%T)"
    if [[ $v == color ]]; then f=$FLAG; else f=; fi
    XLA_FLAGS=$f CONCURRENCY=1 PROMPTS=4 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c1_$v$r alternate 2>&1 | grep -E "^constraint|rror"
    save
  done
done
for v in color default; do
  mkdir -p /tmp/res/c32_$v; echo "== c32 $v $(date +%T)"
  if [[ $v == color ]]; then f=$FLAG; else f=; fi
  XLA_FLAGS=$f PROMPTS=32 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c32_$v alternate 2>&1 | grep -E "^constraint|rror"
  save
done
