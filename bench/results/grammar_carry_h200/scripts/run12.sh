#!/usr/bin/env bash
# c32 alternated: the forward's launch started before the loop reads the previous step
# (.cache/d/early/sitecustomize.py), then the default; one engine each, one machine.
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
nproc > $OUT/device.txt; nvidia-smi -L >> $OUT/device.txt
E=/tmp/early; mkdir -p $E && cp .cache/d/early/sitecustomize.py $E/
mkdir -p /tmp/res3
for v in early default; do
  d=/tmp/res3/c32_$v; mkdir -p $d
  if [[ $v == early ]]; then pp=$E:$PWD:/tmp/llg; else pp=/tmp/llg; fi
  echo "== $v $SECONDS"
  PYTHONPATH=$pp PROMPTS=32 ROUNDS=1 timeout $((185 - SECONDS)) bash bench/grammar_cost.sh $d alternate 2>&1 | grep -E "^constraint|rror"
  (cd /tmp/res3 && tar cJf $OUT/res3.tar.xz .)
done
echo "== done $SECONDS"
