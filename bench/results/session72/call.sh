#!/usr/bin/env bash
# Session 72's device call: on an H200, every open figure of issues 19 and 21 (../session68/all.sh);
# on an H100, the compile-pool priority experiment (../session71/compile_nice.sh).
#   JSPEC_COMMIT=<sha> LIMIT=560 bash bench/results/session72/call.sh    (carry .cache/d)
set -uo pipefail
here=$(dirname "$0")
if nvidia-smi -L | grep -q H200; then echo "== H200: all.sh"; exec bash "$here/../session68/all.sh"; fi
echo "== not an H200: compile_nice.sh"; exec bash "$here/../session71/compile_nice.sh"
