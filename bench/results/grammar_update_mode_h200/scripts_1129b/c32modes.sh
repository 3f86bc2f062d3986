# One c32 decode-heavy run per setting in SETTINGS (in order), each into its own folder, merged at the end.
# A run starts only when LIMIT seconds have not yet passed (each takes about 110-120 s).
set -u
export JSPEC_COMMIT=${JSPEC_COMMIT:?set JSPEC_COMMIT}
export PYTHONPATH=/tmp/p${PYTHONPATH:+:$PYTHONPATH}
T0=$SECONDS; i=0
long="--random-output-len 1024 --prompts-per-concurrency 1 ${EXTRA2:-}"
for s in $SETTINGS; do
  (( SECONDS - T0 > ${LIMIT:-420} )) && { echo "skip $s (t=$((SECONDS-T0)))"; continue; }
  i=$((i+1)); d=/tmp/r$i; mkdir -p $d
  if [[ $s == off ]]; then runs=off; mode=default; else runs=open; mode=$s; fi
  echo "== $i $s"
  RUNS=$runs CONCURRENCY=32 MODES="$mode" EXTRA="$long" bash bench/grammar_cost.sh $d update-mode 2>&1 | grep -E "^ +EAGLE3|rror|peak" | tail -3
  python3 - $d $OUT/all.jsonl "r$i" <<'PYEOF'
"""Fold every JSONL under a folder into one file, each record tagged with its source file (the device returns at most 8 files)."""
import json, pathlib, sys
src, dst, tag = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
with dst.open("a") as out:
    for f in sorted(src.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rec = json.loads(line); rec["_file"] = f"{tag}/{f.name}"
                out.write(json.dumps(rec) + "\n")
        f.unlink()
PYEOF
  sed "s|^|r$i $s |" $d/memory_peaks.txt >> $OUT/peaks.txt 2>/dev/null
  echo "t=$((SECONDS-T0))"
done
