#!/usr/bin/env bash
# Which graphs re-record at c1, new (the carry change) vs old (step_common.py of 16a30a5).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
rm -rf /tmp/old && mkdir /tmp/old && cp -r bench jspec pallas_kernels checkpoints pyproject.toml /tmp/old/
cp .cache/d/step_common_head.py /tmp/old/jspec/speculative/step_common.py
here=$PWD
for v in new old; do
  [[ $v == new ]] && dir=$here || dir=/tmp/old
  mkdir -p /tmp/cb_$v
  (cd $dir && TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 SKIP_BASELINE=1 \
     EXTRA="--random-output-len 96 --prompts-per-concurrency 1" CONCURRENCY=1 PARTS=default \
     bash bench/grammar_cost.sh /tmp/cb_$v graph-parts > /dev/null 2>&1)
  grep -E "^ +EAGLE3" /tmp/cb_$v/serve_grammar_parts_default.log | head -3
  python3 bench/command_buffer_log.py /tmp/cb_$v/serve_grammar_parts_default.log $out/cb_$v.json > $out/cb_$v.txt 2>&1
  cat $out/cb_$v.txt | head -30
done
