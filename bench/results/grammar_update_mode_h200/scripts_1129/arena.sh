set -u
export JSPEC_COMMIT=$(cat .cache/d/commit)
python3 -m pip install -q --no-index --find-links .cache/d llguidance
export PYTHONPATH=$PWD/.cache/d/probe
T0=$SECONDS
mkdir -p /tmp/a1 /tmp/a2
ARENA_LOG=$OUT/arena_long.txt RUNS=open CONCURRENCY=32 MODES=default EXTRA="--random-output-len 1024 --prompts-per-concurrency 1" bash bench/grammar_cost.sh /tmp/a1 update-mode 2>&1 | grep -E "^ +EAGLE3|rror" | tail -3
cp /tmp/a1/*.jsonl $OUT/long.jsonl
echo "t=$((SECONDS-T0))"; cut -c1-3000 $OUT/arena_long.txt
ARENA_LOG=$OUT/arena_prof.txt RUNS=open CONCURRENCY=32 MODES=default EXTRA="--profile /tmp/a2/trace --random-output-len 128" bash bench/grammar_cost.sh /tmp/a2 update-mode 2>&1 | grep -E "^ +EAGLE3|rror" | tail -3
cp /tmp/a2/*.jsonl $OUT/prof.jsonl
echo "t=$((SECONDS-T0))"; cut -c1-3000 $OUT/arena_prof.txt
