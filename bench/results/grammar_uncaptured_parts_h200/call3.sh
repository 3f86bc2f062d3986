#!/usr/bin/env bash
# Issue 21: all split parts uncaptured vs default at concurrency 1, the no-spec constrained baseline, and a c32 profile.
export JSPEC_COMMIT=$(cat .cache/dev/commit) PYTHONUNBUFFERED=1
export WHEELS=.cache/wheels
ALL=draft,forward,verify
JSPEC_GRAMMAR_UNCAPTURED_PARTS=$ALL EXTRA="--random-output-len 256" timeout 250 bench/grammar_cost.sh $OUT open > $OUT/open_all.log 2>&1
grep -E "^ +[A-Z0-9]" $OUT/open_all.log | tail -8
mv $OUT/serve_grammar_cost_open.jsonl $OUT/open_all_c1_c32.jsonl
export WHEELS=
SKIP_BASELINE=1 EXTRA="--max-concurrency-list 1 --random-output-len 256" timeout 120 bench/grammar_cost.sh $OUT open 2>&1 | grep -E "^ +EAGLE3"
mv $OUT/serve_grammar_cost_open.jsonl $OUT/open_default_c1.jsonl
SKIP_BASELINE=1 EXTRA="--max-concurrency-list 1 --random-output-len 256" timeout 120 bench/grammar_cost.sh $OUT off 2>&1 | grep -E "^ +EAGLE3"
mv $OUT/serve_grammar_cost_off.jsonl $OUT/off_c1.jsonl
rm -f $OUT/*.log
JSPEC_GRAMMAR_UNCAPTURED_PARTS=$ALL EXTRA="--profile /tmp/prof --max-concurrency-list 32 --random-output-len 128 --prompts-per-concurrency 1" SKIP_BASELINE=1 timeout 150 bench/grammar_cost.sh /tmp open 2>&1 | grep -E "^ +EAGLE3"
python3 bench/trace_summary.py /tmp/prof --steps 1 --json $OUT/trace_summary_open_c32_all_uncaptured.json > $OUT/trace_summary_open_c32_all_uncaptured.txt 2>&1
head -60 $OUT/trace_summary_open_c32_all_uncaptured.txt
