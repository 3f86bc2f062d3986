#!/usr/bin/env bash
# One call that does what the card in hand still owes: on an H200, every open figure of issues 19
# and 21 (../session68/all.sh); on an H100 (four headline runs on record), the lowering memo's
# start-up figure (lowering_memo.sh). Carry .cache/d (the llguidance wheel):
#   JSPEC_COMMIT=<sha> LIMIT=580 bash bench/results/session70/either.sh
here=$(dirname "$0")
if nvidia-smi -L | grep -q H200; then echo "== H200: all.sh"; bash "$here/../session68/all.sh"
else echo "== not an H200: lowering_memo.sh"; bash "$here/lowering_memo.sh"; fi
