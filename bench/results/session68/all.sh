#!/usr/bin/env bash
# One call for every open GPU figure of issues 19 and 21 at a commit (about 560 s on an H100):
# the decode headline and start-up (../headline_3c67c30_h100/run.sh), structured output's cost at
# c1 and c32 (grammar.sh), then input logprobs' cost at c32 (../grammar_carry_h200/scripts/run26.sh).
# Needs the llguidance wheel in .cache/d (carry it):
#   JSPEC_COMMIT=<sha> bash bench/results/session68/all.sh
set -uo pipefail
here=$(dirname "$0")
STAGES="decode startup" LIMIT=230 bash "$here/../headline_3c67c30_h100/run.sh"
CS="1 32" ROUNDS=2 LIMIT=$((${LIMIT:-580} - SECONDS - 140)) bash "$here/grammar.sh"
LIMIT=$((${LIMIT:-580} - SECONDS)) bash "$here/../grammar_carry_h200/scripts/run26.sh"
