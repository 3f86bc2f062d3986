set -u
export JSPEC_COMMIT=$(cat .cache/d/commit)
python3 -m pip install -q --no-index --find-links .cache/d llguidance
T0=$SECONDS
for parts in default none; do
  mkdir -p /tmp/q_$parts
  if [[ $parts == none ]]; then export JSPEC_GRAMMAR_UNCAPTURED_PARTS=none; fi
  RUNS=open CONCURRENCY=32 MODES=default EXTRA="--profile /tmp/q_$parts/trace --random-output-len 128" bash bench/grammar_cost.sh /tmp/q_$parts update-mode 2>&1 | grep -E "^ +EAGLE3|rror" | tail -3
  echo "t=$((SECONDS-T0))"
  python3 .cache/d/launch.py /tmp/q_$parts/trace/* > $OUT/launch_$parts.txt 2>&1; cat $OUT/launch_$parts.txt | head -100
  PYTHONPATH=. python3 bench/trace_timeline.py /tmp/q_$parts/trace/* --first 20 --steps 3 > $OUT/timeline_$parts.txt 2>&1
  echo "t=$((SECONDS-T0))"
done
