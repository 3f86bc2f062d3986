#!/usr/bin/env bash
# Tenth session, one call: issue 19's decode headline at this commit (the decode stage of
# ../../headline_3c67c30_h100/run.sh), then input logprobs' cost at EAGLE3 c32 with the prompt's top
# rows built by the reader (26b8ed1): run26.sh (bench/logprob_cost.sh off / input, twice, c32 only).
# As run, the decode stage was written inline and named its file engine_decode_h200.json on any device.
set -uo pipefail
here=$(dirname "$0")
echo "== decode"
STAGES=decode LIMIT=150 bash "$here/../../headline_3c67c30_h100/run.sh"
LIMIT=$((${LIMIT:-570} - SECONDS)) bash "$here/run26.sh"
