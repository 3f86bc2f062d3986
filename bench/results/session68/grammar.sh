#!/usr/bin/env bash
# Structured output's cost at HEAD: `bench/grammar_cost.sh OUT alternate` at c1 (4 prompts) and c32,
# llguidance from the carried wheel (.cache/d). LIMIT: seconds for the whole script.
set -uo pipefail
out=$OUT
pip install -q --no-deps --target /tmp/llg .cache/d/llguidance-*.whl
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
mkdir -p /tmp/res
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
for c in ${CS:-1 32}; do
  left=$((${LIMIT:-570} - SECONDS)); (( left > 90 )) || break
  echo "== c$c ($SECONDS s)"; mkdir -p /tmp/res/c$c
  CONCURRENCY=$c PROMPTS=$(( c > 1 ? 64 : 4 )) ROUNDS=${ROUNDS:-2} timeout $left bash bench/grammar_cost.sh /tmp/res/c$c alternate 2>&1 | grep -E "^==|^constraint|alternat|rror" | cut -c1-240
  save
done
echo "== done ($SECONDS s)"
# THEN: a further script to run after this one in the same call (e.g. run26.sh's logprob stages).
if [[ -n ${THEN:-} ]]; then LIMIT=$((${LIMIT:-570} - SECONDS)) bash ${THEN}; fi
