#!/usr/bin/env bash
# The loop waiting for the forward part's launch (SYNC_FWD=1, .cache/d/syncfwd/sitecustomize.py):
# the command-buffer log of a 96-token c1 run under it (does the forward graph still re-record?),
# then c1 alternated (sync, default, sync, default; one engine each).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
SY=/tmp/syncfwd; mkdir -p $SY && cp .cache/d/syncfwd/sitecustomize.py $SY/
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res/cb_sync /tmp/cb
SYNC_FWD=1 PYTHONPATH=$SY:$PWD:/tmp/llg TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 SKIP_BASELINE=1 \
  EXTRA="--random-output-len 96 --prompts-per-concurrency 1" CONCURRENCY=1 PARTS=default \
  timeout 150 bash bench/grammar_cost.sh /tmp/cb graph-parts 2>&1 | grep -E "EAGLE3|rror" | head
python3 bench/command_buffer_log.py /tmp/cb/serve_grammar_parts_default.log /tmp/res/cb_sync/cb.json > /dev/null 2>&1
python3 -c "
import json; d=json.load(open('/tmp/res/cb_sync/cb.json'))
for k,v in d.items():
    if v.get('updates',0) > 5: print(k, v.get('updates'), v.get('median_us'), v.get('updated_allocs'))"
save
run() {  # variant dir
  local d=/tmp/res/$2; mkdir -p $d; echo "== $2 $(date +%T) ($SECONDS s)"
  if [[ $1 == sync ]]; then pp=$SY:$PWD:/tmp/llg; else pp=/tmp/llg; fi
  SYNC_FWD=1 PYTHONPATH=$pp CONCURRENCY=1 PROMPTS=4 ROUNDS=1 timeout 150 bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"
  save
}
for r in 1 2; do run sync c1_sync$r; run default c1_default$r; done
echo "== done $(date +%T) ($SECONDS s)"
