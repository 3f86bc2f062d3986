# Profiled 128-out c32 runs (constrained, then nothing constrained): GPU timelines of a few decode steps and the GPU idle summary.
set -u
export JSPEC_COMMIT=${JSPEC_COMMIT:?} PYTHONPATH=/tmp/p
T0=$SECONDS
for r in open off; do
  mkdir -p /tmp/q_$r
  RUNS=$r CONCURRENCY=32 MODES=default EXTRA="--profile /tmp/q_$r/trace --random-output-len 128 --prompts-per-concurrency 1" bash bench/grammar_cost.sh /tmp/q_$r update-mode 2>&1 | grep -E "^ +EAGLE3|rror" | tail -3
  echo "t=$((SECONDS-T0))"
  PYTHONPATH=. python3 bench/trace_summary.py /tmp/q_$r/trace/* --steps 43 > $OUT/summary_$r.txt 2>&1
  PYTHONPATH=. python3 bench/trace_timeline.py /tmp/q_$r/trace/* --first 25 --steps 4 > $OUT/timeline_$r.txt 2>&1
  echo "t=$((SECONDS-T0))"
done
