# Traces of the constrained c32 step at the default (forward uncaptured, static carry) and of nothing constrained.
set -u
export JSPEC_COMMIT=$(cat .cache/d/commit)
python3 -m pip install -q --no-index --find-links .cache/d llguidance
T0=$SECONDS
for r in open off; do
  (( SECONDS - T0 > 380 )) && break
  mkdir -p /tmp/p_$r
  RUNS=$r CONCURRENCY=32 MODES=default EXTRA="--profile /tmp/p_$r/trace --random-output-len 128" bash bench/grammar_cost.sh /tmp/p_$r update-mode 2>&1 | grep -E "^ +EAGLE3|rror" | tail -3
  echo "t=$((SECONDS-T0))"
  PYTHONPATH=. python3 bench/trace_summary.py /tmp/p_$r/trace/* --steps 43 --json $OUT/trace_${r}_c32.json > $OUT/trace_${r}_c32.txt 2>&1
  head -60 $OUT/trace_${r}_c32.txt
  PYTHONPATH=. python3 bench/trace_timeline.py /tmp/p_$r/trace/* --first 20 --steps 3 > $OUT/timeline_${r}_c32.txt 2>&1
  echo "t=$((SECONDS-T0))"
done
