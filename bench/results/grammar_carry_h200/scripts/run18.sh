#!/usr/bin/env bash
# Next session, call 1: the committed forward copies on a GPU. Greedy ids of the tiny Qwen3
# (plain, EAGLE3, EAGLE3 under an allow-all regex: split pipelined steps with the forward's two
# copies) in float32, then `grammar_cost.sh OUT copies` at c1 (copies=1 / 0 alternated twice).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
mkdir -p /tmp/res
PYTHONPATH=.:/tmp/llg python3 bench/greedy_ids.py --dtype float32 --grammar > /tmp/res/greedy_float32.json 2>/tmp/res/greedy.err
python3 -c "import json; d = json.load(open('/tmp/res/greedy_float32.json')); print('plain == eagle3', d['plain'] == d['eagle3'], 'eagle3 == eagle3_regex', d['eagle3'] == d['eagle3_regex'])"
save
# c1 only here (the stage's c32 runs go to the second call's script).
for round in 1 2; do
  for copies in 1 0; do
    d=/tmp/res/copies_c1_${copies}_r$round; mkdir -p $d; echo "== c1 copies=$copies r$round ($SECONDS s)"
    JSPEC_GRAMMAR_FORWARD_COPIES=$copies CONCURRENCY=1 PROMPTS=4 ROUNDS=1 timeout 150 bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"
    save
  done
done
echo "== done ($SECONDS s)"
