# One c32 decode-heavy run per setting in SETTINGS (in order), each into its own folder, merged at the end.
# A run starts only when LIMIT seconds have not yet passed (each takes about 110-120 s).
set -u
export JSPEC_COMMIT=$(cat .cache/d/commit)
python3 -m pip install -q --no-index --find-links .cache/d llguidance
T0=$SECONDS; i=0
long="--random-output-len 1024 --prompts-per-concurrency 1 ${EXTRA2:-}"
for s in $SETTINGS; do
  (( SECONDS - T0 > ${LIMIT:-420} )) && { echo "skip $s (t=$((SECONDS-T0)))"; continue; }
  i=$((i+1)); d=/tmp/r$i; mkdir -p $d
  if [[ $s == off ]]; then runs=off; mode=default; else runs=open; mode=$s; fi
  echo "== $i $s"
  RUNS=$runs CONCURRENCY=32 MODES="$mode" EXTRA="$long" bash bench/grammar_cost.sh $d update-mode 2>&1 | grep -E "^ +EAGLE3|rror|peak" | tail -3
  python3 .cache/d/merge.py $d $OUT/all.jsonl "r$i"
  sed "s|^|r$i $s |" $d/memory_peaks.txt >> $OUT/peaks.txt 2>/dev/null
  echo "t=$((SECONDS-T0))"
done
