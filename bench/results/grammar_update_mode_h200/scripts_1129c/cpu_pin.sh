#!/usr/bin/env bash
# Whether the constrained c32 step's per-process spread follows where the engine loop and the
# launcher thread run: the one-wave alternate run (constraint off, on) in fresh processes, free and
# with the two threads pinned to distinct CPUs (PINS), every thread's CPU sampled each second.
set -uo pipefail
out=$1; n=${N:-2}
site=$(cd "$(dirname "$0")/site" && pwd)
for i in $(seq "$n"); do
  for mode in free ${PINS:-jspec-engine=3,jspec-launch=9}; do
    name=$(echo "$mode" | tr -c 'A-Za-z0-9\n' '_')_$i; d=$out/$name; mkdir -p "$d"
    [[ $mode == free ]] && pin= || pin=$mode
    echo "== $name"
    PROBE_PIN=$pin PROBE_THREADS=$d/threads.txt PYTHONPATH=$site:${PYTHONPATH:-} PHASES=1 ROUNDS=1 PROMPTS=32 \
        bash bench/grammar_cost.sh "$d" alternate 2>&1 | grep -E "^constraint"
  done
done
