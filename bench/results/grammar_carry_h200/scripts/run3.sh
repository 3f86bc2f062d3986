#!/usr/bin/env bash
# c1 alternate, the carry change (new) against the tree before it (old: step_common.py of 16a30a5),
# one engine each, new, old, new, old, on one machine.
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt
rm -rf /tmp/old && mkdir /tmp/old && cp -r bench jspec pallas_kernels checkpoints pyproject.toml /tmp/old/
cp .cache/d/step_common_head.py /tmp/old/jspec/speculative/step_common.py
here=$PWD
for r in 1 2; do
  for v in ${VARIANTS:-new old}; do
    mkdir -p $out/$v$r
    [[ $v == new ]] && dir=$here || dir=/tmp/old
    echo "== $v $r"
    (cd $dir && CONCURRENCY=1 PROMPTS=4 ROUNDS=1 bash bench/grammar_cost.sh $out/$v$r alternate 2>&1 | grep -E "^constraint")
  done
done
cd $out && tar cJf /tmp/results.tar.xz . && mv /tmp/results.tar.xz $out/
