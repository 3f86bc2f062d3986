#!/usr/bin/env bash
# Every captured decode executable under SKIP_TEMP (VMM allocator; .cache/d/allskip/sitecustomize.py
# with ALLSKIP=1 and JSPEC_GRAMMAR_UPDATE_MODE=SKIP_TEMP) against the defaults: c1 alternated
# (allskip, default, allskip, default; one engine each), then c32 (allskip, default).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
AS=/tmp/allskip; mkdir -p $AS && cp .cache/d/allskip/sitecustomize.py $AS/
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
run() {  # variant concurrency prompts dir
  local v=$1 c=$2 p=$3 d=/tmp/res/$4; mkdir -p $d; echo "== $4 $(date +%T) ($SECONDS s)"
  if [[ $v == allskip ]]; then
    ALLSKIP=1 JSPEC_GRAMMAR_UPDATE_MODE=SKIP_TEMP PYTHONPATH=$AS:$PWD:/tmp/llg CONCURRENCY=$c PROMPTS=$p ROUNDS=1 \
      timeout ${5:-300} bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"
  else
    PYTHONPATH=/tmp/llg CONCURRENCY=$c PROMPTS=$p ROUNDS=1 timeout ${5:-300} bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"
  fi
  grep -c "allskip:" $d/*.log | head -2; grep -ih "pages" $d/*.log | head -2
  save
}
for r in 1 2; do run allskip 1 4 c1_allskip$r; run default 1 4 c1_default$r; done
left=$((585 - SECONDS)); (( left > 70 )) && run allskip 32 32 c32_allskip $left
left=$((585 - SECONDS)); (( left > 70 )) && run default 32 32 c32_default $left
echo "== done $(date +%T) ($SECONDS s)"
