#!/usr/bin/env bash
# A short call (about 300 s) for what is left: on an H200, the decode headline, structured output's
# cost at c32 (one alternation) and input logprobs' cost at c32 (one off / input pair), the H200
# figures issues 19 and 21 still owe; on an H100, one more cold pair of the lowering memo (on / off).
#   JSPEC_COMMIT=<sha> LIMIT=300 bash bench/results/session71/short.sh    (carry .cache/d)
set -uo pipefail
here=$(dirname "$0"); L=${LIMIT:-300}
if nvidia-smi -L | grep -q H200; then
  echo "== H200"
  STAGES=decode LIMIT=90 bash "$here/../headline_3c67c30_h100/run.sh"
  mkdir -p $OUT/grammar && OUT=$OUT/grammar CS=32 ROUNDS=1 LIMIT=$(( (L - SECONDS) / 2 + 20 )) bash "$here/../session68/grammar.sh"
  mkdir -p $OUT/logprob && OUT=$OUT/logprob LIMIT=$(( L - SECONDS )) bash "$here/../grammar_carry_h200/scripts/run26.sh"
else
  echo "== not an H200"; COLD="1 0" WARM="" LIMIT=$L bash "$here/memo_rounds.sh"
fi
