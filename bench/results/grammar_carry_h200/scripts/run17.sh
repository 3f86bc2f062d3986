#!/usr/bin/env bash
# c32: twins, default (one engine each).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
TW=/tmp/twins; mkdir -p $TW && cp .cache/d/twins/sitecustomize.py $TW/
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }

run() {  # variant dir
  local d=/tmp/res/$2; mkdir -p $d; echo "== $2 $(date +%T) ($SECONDS s)"
  if [[ $1 == twins ]]; then pp=$TW:$PWD:/tmp/llg; else pp=/tmp/llg; fi
  TWINS=1 PYTHONPATH=$pp CONCURRENCY=32 PROMPTS=32 ROUNDS=1 timeout 150 bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"
  save
}
run twins c32_twins; run default c32_default
echo "== done $(date +%T) ($SECONDS s)"
