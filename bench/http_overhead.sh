#!/usr/bin/env bash
# What the HTTP server costs (bench/README.md, "HTTP server"): the same workload through `jspec serve`
# (streamed /generate, `jspec bench serve --backend http`) and in process, Qwen3-8B shape + random
# EAGLE3 3/1/4 at simulated accept 3 (spec v2), random 1024 in / 512 out, concurrency 1 (8 prompts),
# 32 (64 prompts) and 128 (256 prompts). Writes JSONL and logs under OUT. WHEELS: a folder of wheels to install the
# serve extra from (a machine without a network). SERVER_ONLY=1: the HTTP runs only (no in-process
# runs); JSPEC_SWITCH_INTERVAL reaches the server (`jspec serve`'s GIL switch interval, default 0.0005 s).
# C1_PROMPTS: prompts at concurrency 1 (default 8; more for a TTFT mean to within a millisecond).
# CONCURRENCY: the concurrencies to run (default "1 32 128"). The server's /metrics (GC pauses among them)
# are saved as OUT/http_metrics.txt; JSPEC_GC_FREEZE=0 reaches the server (no gc.freeze after start-up).
set -euo pipefail
out=$1
if [[ -n "${WHEELS:-}" ]]; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" fastapi uvicorn prometheus_client jinja2
fi
engine=(--model-path random:qwen3-8b --speculative-algorithm EAGLE3 --speculative-draft-model-path random
        --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
        --speculative-simulate-accept-length 3 --chunked-prefill-size 2048 --cuda-graph-bs 1,32,128
        --prefill-token-buckets 2048 --disable-top-k-top-p)
work=(--quiet --dataset-name random --random-input-len 1024 --random-output-len 512 --random-range-ratio 1)
export PYTHONPATH=.
python3 -m jspec.cli serve "${engine[@]}" --port 30000 > "$out/http_server.log" 2>&1 &
server=$!
python3 -c "import uvicorn, fastapi"  # the serve extra is there (else the wait below is for nothing)
for _ in $(seq 300); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:30000/health', timeout=2)" 2> /dev/null && break
  sleep 1
done
for c in ${CONCURRENCY:-1 32 128}; do
  n=$(( c == 1 ? ${C1_PROMPTS:-8} : 2 * c ))
  python3 -m jspec.cli bench serve --backend http --base-url http://127.0.0.1:30000 --model-path random:qwen3-8b \
      "${work[@]}" \
      --num-prompts $n --max-concurrency $c --output-file "$out/serve_http_overhead.jsonl" 2>&1 \
      | tee -a "$out/http_bench.log" | grep -E "Output token throughput|Mean TTFT"
done
python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:30000/metrics').read().decode())" \
    >> "$out/http_metrics.txt"
kill -TERM $server; wait $server || true
[[ -n "${SERVER_ONLY:-}" ]] && exit 0
for c in ${CONCURRENCY:-1 32 128}; do
  n=$(( c == 1 ? ${C1_PROMPTS:-8} : 2 * c ))
  python3 -m jspec.cli bench serve "${engine[@]}" "${work[@]}" --num-prompts $n --max-concurrency $c \
      --output-file "$out/serve_http_overhead.jsonl" 2>&1 | tee -a "$out/engine_bench.log" \
      | grep -E "Output token throughput|Mean TTFT"
done
