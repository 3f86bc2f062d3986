#!/usr/bin/env bash
# Next session: which parts of the pipelined constrained step should run as two copies
# (JSPEC_GRAMMAR_PART_COPIES, eca9a73): c1 alternate with forward / draft+forward / all three,
# twice each (bench/grammar_cost.sh OUT part-copies), one engine per run.
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
mkdir -p /tmp/res
( timeout 570 bash bench/grammar_cost.sh /tmp/res part-copies 2>&1 | grep -E "^==|^constraint|rror" ) &
wait
(cd /tmp/res && tar cJf $out/results.tar.xz .)
echo "== done ($SECONDS s)"
