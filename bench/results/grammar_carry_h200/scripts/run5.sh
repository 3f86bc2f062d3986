#!/usr/bin/env bash
# c1 alternate, the carry change (new) against the tree before it (old: step_common.py of 16a30a5),
# one engine each, new, old alternated ROUNDS times (default 3) on one machine; results tarred
# after every engine so that a cut call still brings back what finished.
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
rm -rf /tmp/old && mkdir /tmp/old && cp -r bench jspec pallas_kernels checkpoints pyproject.toml /tmp/old/
cp .cache/d/step_common_head.py /tmp/old/jspec/speculative/step_common.py
here=$PWD
mkdir -p /tmp/res
for r in $(seq ${ROUNDS:-3}); do
  for v in ${VARIANTS:-new old}; do
    mkdir -p /tmp/res/$v$r
    [[ $v == new ]] && dir=$here || dir=/tmp/old
    echo "== $v $r $(date +%T)"
    (cd $dir && CONCURRENCY=1 PROMPTS=4 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/$v$r alternate 2>&1 | grep -E "^constraint")
    (cd /tmp/res && tar cJf $out/results.tar.xz .)
  done
done
