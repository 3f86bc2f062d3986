#!/usr/bin/env bash
# A free hole in the allocator for the step's small long-lived buffers (.cache/d/decoy/sitecustomize.py,
# DECOY=1) against the defaults: the command-buffer log of a 96-token c1 run with the hole (does the
# forward part's graph still re-record?), then c1 alternated (hole, default, hole, default; one
# engine each), then c32 with the hole if time is left.
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
mkdir -p /tmp/res/cb_decoy /tmp/cb_decoy
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
DEC=/tmp/decoy; mkdir -p $DEC && cp .cache/d/decoy/sitecustomize.py $DEC/
export PYTHONPATH=/tmp/llg
DECOY=1 PYTHONPATH=$DEC:$PWD:/tmp/llg TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 SKIP_BASELINE=1 \
  EXTRA="--random-output-len 96 --prompts-per-concurrency 1" CONCURRENCY=1 PARTS=default \
  bash bench/grammar_cost.sh /tmp/cb_decoy graph-parts 2>&1 | grep -E "EAGLE3|rror" | head
grep -h "decoy-exp" /tmp/cb_decoy/*.log | head -20 > /tmp/res/cb_decoy/decoy.txt
python3 bench/command_buffer_log.py /tmp/cb_decoy/serve_grammar_parts_default.log /tmp/res/cb_decoy/cb.json > /tmp/res/cb_decoy/cb.txt 2>&1
cat /tmp/res/cb_decoy/decoy.txt; python3 -c "
import json; d=json.load(open('/tmp/res/cb_decoy/cb.json'))
for k,v in d.items():
    if isinstance(v,dict): print(k, v.get('updates'), v.get('median_us'), v.get('updated_allocs'))"
save
for r in 1 2; do
  for v in decoy default; do
    mkdir -p /tmp/res/c1_$v$r; echo "== c1 $v $r $(date +%T) ($SECONDS s)"
    if [[ $v == decoy ]]; then pp=$DEC:$PWD:/tmp/llg; else pp=/tmp/llg; fi
    DECOY=1 PYTHONPATH=$pp CONCURRENCY=1 PROMPTS=4 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c1_$v$r alternate 2>&1 | grep -E "^constraint|rror"
    grep -h "decoy-exp hole" /tmp/res/c1_$v$r/*.log
    save
  done
done
left=$((575 - SECONDS))
if (( left > 90 )); then
  mkdir -p /tmp/res/c32_decoy; echo "== c32 decoy $(date +%T) ($SECONDS s, $left left)"
  DECOY=1 PYTHONPATH=$DEC:$PWD:/tmp/llg PROMPTS=32 ROUNDS=1 timeout $left bash bench/grammar_cost.sh /tmp/res/c32_decoy alternate 2>&1 | grep -E "^constraint|rror"
  grep -h "decoy-exp hole" /tmp/res/c32_decoy/*.log
  save
fi
echo "== done $(date +%T) ($SECONDS s)"
