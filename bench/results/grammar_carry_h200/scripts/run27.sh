#!/usr/bin/env bash
# Where the rest of input logprobs' cost at EAGLE3 c32 goes: bench/host_phases.py over the
# logprob_cost workload at c32 (64 prompts of 1024, 512 out, 5 top), off then input.
set -uo pipefail
out=$OUT
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
mkdir -p /tmp/res
save() { (cd /tmp/res && tar cJf $out/results.tar.xz --exclude='phases_*.json' .); }
common=(--model-path random:qwen3-8b --speculative-algorithm EAGLE3 --speculative-draft-model-path random
        --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
        --speculative-simulate-accept-length 3 --chunked-prefill-size 2048 --cuda-graph-bs 1,32
        --prefill-token-buckets 2048 --disable-top-k-top-p --quiet --dataset-name random --random-input-len 1024
        --random-output-len 512 --random-range-ratio 1 --num-prompts 64 --max-concurrency 32
        --return-logprob --top-logprobs-num 5)
for stage in ${STAGES:-off input}; do
  left=$((${LIMIT:-205} - SECONDS)); (( left > 30 )) || break
  extra=(); [[ $stage == input ]] && extra=(--logprob-start-len 0)
  echo "== phases $stage ($SECONDS s)"
  PYTHONPATH=. timeout $left python3 bench/host_phases.py record /tmp/res/phases_$stage.json -- bench serve "${common[@]}" \
      "${extra[@]}" --output-file /tmp/res/serve_$stage.jsonl 2>&1 | grep -E "Output token throughput|Mean TTFT|rror"
  PYTHONPATH=. python3 bench/host_phases.py totals /tmp/res/phases_$stage.json > /tmp/res/phases_$stage.txt 2>&1
  PYTHONPATH=. python3 bench/host_phases.py summary /tmp/res/phases_$stage.json > /tmp/res/phases_summary_$stage.txt 2>&1
  grep -E "run|dispatch|fetch|process|gc|step |chunk" /tmp/res/phases_$stage.txt
  python3 - /tmp/res/phases_$stage.json <<'PY' | tee /tmp/res/phases_prompt_$stage.txt
import json, statistics, sys
d = json.load(open(sys.argv[1]))
pr = [e for e in d if e[0] == "process"]; fe = [e for e in d if e[0] == "fetch"]
gcs = [e for e in d if e[0].startswith("gc")]
rows = []
for p in pr:
    f = sum(x[2] - x[1] for x in fe if x[1] >= p[1] and x[2] <= p[2])
    g = sum(x[2] - x[1] for x in gcs if x[1] >= p[1] and x[2] <= p[2])
    rows.append(((p[2] - p[1]) * 1e3, f * 1e3, g * 1e3))
big = [r for r in rows if r[1] > 20]; small = [r for r in rows if r[1] <= 20]
for name, L in (("fetch > 20 ms", big), ("others", small)):
    if L:
        print(f"process, {name}: n={len(L)} after-fetch {statistics.mean(r[0] - r[1] for r in L):.2f} ms, "
              f"fetch {statistics.mean(r[1] for r in L):.2f} ms, gc {statistics.mean(r[2] for r in L):.2f} ms")
PY
  save
done
echo "== done ($SECONDS s)"
