#!/usr/bin/env bash
# Two loaded copies of the forward part alternated by launch (TWINS=1, .cache/d/twins/sitecustomize.py):
# the command-buffer log of a 96-token c1 run under it (does the forward graph still re-record?),
# then c1 alternated (twins, default, twins, default; one engine each).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
TW=/tmp/twins; mkdir -p $TW && cp .cache/d/twins/sitecustomize.py $TW/
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res/cb_twins /tmp/cb
TWINS=1 PYTHONPATH=$TW:$PWD:/tmp/llg TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 SKIP_BASELINE=1 \
  EXTRA="--random-output-len 96 --prompts-per-concurrency 1" CONCURRENCY=1 PARTS=default \
  timeout 150 bash bench/grammar_cost.sh /tmp/cb graph-parts 2>&1 | grep -E "EAGLE3|rror" | head; grep -h "twins:" /tmp/cb/*.log | head -3
python3 bench/command_buffer_log.py /tmp/cb/serve_grammar_parts_default.log /tmp/res/cb_twins/cb.json > /dev/null 2>&1
python3 -c "
import json; d=json.load(open('/tmp/res/cb_twins/cb.json'))
for k,v in d.items():
    if v.get('updates',0) > 5: print(k, v.get('updates'), v.get('median_us'), v.get('updated_allocs'))"
save
run() {  # variant dir
  local d=/tmp/res/$2; mkdir -p $d; echo "== $2 $(date +%T) ($SECONDS s)"
  if [[ $1 == twins ]]; then pp=$TW:$PWD:/tmp/llg; else pp=/tmp/llg; fi
  TWINS=1 PYTHONPATH=$pp CONCURRENCY=1 PROMPTS=4 ROUNDS=1 timeout 150 bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"
  save
}
for r in 1 2; do run twins c1_twins$r; run default c1_default$r; done
echo "== done $(date +%T) ($SECONDS s)"
