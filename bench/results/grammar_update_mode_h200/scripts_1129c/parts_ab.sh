#!/usr/bin/env bash
# The one-wave c32 alternate run with host phases under settings of the split parts' capture.
set -uo pipefail
out=$1
for setting in ${SETTINGS:-JSPEC_GRAMMAR_UNCAPTURED_PARTS=none JSPEC_GRAMMAR_UNCAPTURED_PARTS=none+JSPEC_GRAMMAR_UPDATE_MODE=SKIP_TEMP}; do
  name=$(echo "$setting" | tr -c 'A-Za-z0-9\n' '_'); d=$out/$name; mkdir -p "$d"
  IFS=+ read -ra assigns <<< "$setting"
  echo "== $setting"
  env "${assigns[@]}" PHASES=1 ROUNDS=1 PROMPTS=32 bash bench/grammar_cost.sh "$d" alternate 2>&1 | grep -E "^constraint|rror"
  grep -E "^run 1|first_call|second_call|forward_launch|walk|fetch" "$d/host_phases_c32.txt" | tail -6
done
