#!/usr/bin/env bash
# Issue 21: where a constrained EAGLE3 step's time goes at concurrency 1 (graphs kept, the default there).
export JSPEC_COMMIT=$(cat .cache/dev/commit) PYTHONUNBUFFERED=1 WHEELS=.cache/wheels
EXTRA="--profile /tmp/prof --max-concurrency-list 1 --random-output-len 96 --prompts-per-concurrency 1" SKIP_BASELINE=1 timeout 170 bench/grammar_cost.sh $OUT open 2>&1 | grep -E "^ +EAGLE3"
rm -f $OUT/*.log
python3 bench/trace_summary.py /tmp/prof --steps 1 --json $OUT/trace_summary_open_c1.json > $OUT/trace_summary_open_c1.txt 2>&1
head -70 $OUT/trace_summary_open_c1.txt
