#!/usr/bin/env bash
# Issue 21: which batch sizes gain from uncaptured split parts: concurrency 8 and 16, default vs all uncaptured, twice alternated.
export JSPEC_COMMIT=$(cat .cache/dev/commit) PYTHONUNBUFFERED=1
export WHEELS=.cache/wheels
for round in 1 2; do
  [[ $round == 1 ]] && P="default draft,forward,verify" || P="draft,forward,verify default"
  PARTS="$P" EXTRA="--max-concurrency-list 8,16 --cuda-graph-bs 8,16" timeout 280 bench/grammar_cost.sh $OUT graph-parts 2>&1
  for f in $OUT/serve_grammar_parts_*.jsonl; do mv $f ${f%.jsonl}_c8_c16_r$round.jsonl; done
  rm -f $OUT/*.log; export WHEELS=
done
