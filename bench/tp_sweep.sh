#!/usr/bin/env bash
# Tensor-parallel benchmarks of bench/README.md ("Tensor parallelism"), one stage per call so each
# fits a 10-minute device command; results (JSONL / JSON + printed tables) under OUT.
#   bench/tp_sweep.sh OUT allreduce | allreduce-captured | step-8b-mp | step-8b-graph | collectives | step-8b | step-8b-flags | step-rep [PRESET] | next80b [ALGOS] | next80b-ep | next80b-rep | llama70b | qwen397b | graph-rows [ROWS]
# allreduce (any multi-GPU kind): latency of 72 chained all-reduces per size: XLA's defaults (NCCL)
#   beside jspec's one-shot Mosaic GPU kernel over peer memory, NCCL's low-latency protocol, and
#   XLA's one-shot all-reduce kernel over peer memory
#   (--xla_gpu_unsupported_use_all_reduce_one_shot_kernel), beside the figure a TP step pays per layer.
# allreduce-captured (any multi-GPU kind): whether a chain of all-reduces captured in one graph with
#   nothing moving between calls (--in-place, +COLLECTIVES) runs at the GPU's pace rather than the
#   host's: XLA's defaults beside +COLLECTIVES, each with results in place, in one process and in one
#   process per GPU (multi-controller: where NCCL can be captured per device).
# step-8b-mp (any multi-GPU kind): the Qwen3-8B TP2 decode step's launch (bench/launch_cost.py) in one
#   process for both GPUs vs one process per GPU (multi-controller), each with XLA's defaults and with
#   the all-reduces in the command buffers, plain and with nothing moving between calls (stage+arena).
# step-8b-graph (any multi-GPU kind): the Qwen3-8B TP2 decode step's launch with XLA's collective
#   kernels (its own one-shot all-reduce, a thunk kind the command-buffer conversion does not take, so
#   each all-reduce ends a graph) turned off, so that NCCL all-reduces can be recorded into the
#   command buffers (+COLLECTIVES): one graph per step if nothing else splits it. Against the defaults.
# step-8b (any multi-GPU kind): Qwen3-8B decode step at batch 1 / 32, TP1 vs TP2 (XLA's defaults,
#   profiled and summarised) vs TP2 with collectives in the command buffers (+COLLECTIVES).
# step-rep [PRESET] (any multi-GPU kind; qwen3-next-80b-a3b needs nvidia-h200-x2): the decode step at
#   batch 1 / 8 / 32, TP1 (presets that fit one GPU), TP2, and TP2 with the token mixers replicated
#   (--replicate-attention: one all-reduce per layer instead of two), then the host's launch cost of
#   TP2 split vs replicated (bench/launch_cost.py). PRESET defaults to qwen3-8b.
# collectives (any multi-GPU kind): the collectives compiled into every decode bucket of TP engines
#   (bench/tp_collectives.py): Qwen3-8B plain and EAGLE3, Qwen3-Next plain and NEXTN (4 layers each).
# step-8b-flags (any multi-GPU kind): the batch-1 step at TP2 under XLA settings that decide how the
#   72 all-reduces are launched: defaults, collectives recorded into the command buffers
#   (+COLLECTIVES), that with the one-shot kernel, and command buffers off; a trace summary each.
# next80b [ALGOS] (nvidia-h200-x2): Qwen3-Next-80B-A3B, no spec vs NEXTN 3/1/4 (simulated accept 3),
#   v1 and v2, concurrency 1 / 32, TP2. ALGOS (default none,NEXTN) picks the engines of this call, so
#   that each call's compiles fit 10 minutes; engines compiled earlier on the same machine reuse
#   XLA's compilation cache (XLA_CACHE, default /tmp/xla).
# next80b-ep (nvidia-h200-x2): the same with expert parallelism (256 whole experts per GPU instead of
#   every expert's half), v2 only: which MoE split serves the 512-expert model faster.
# next80b-rep (nvidia-h200-x2): NEXTN v2 only, the intermediate split against the token mixers
#   replicated (--replicate-attention), one machine: whether a third less host launch per step
#   reaches serving.
# llama70b (the largest kind lent; on 2 x H200 the 140 GB of weights leave a small KV pool):
#   Llama-3.1-70B, the batch-1 decode step against its bytes floor, then no spec vs EAGLE3 3/1/4 at
#   concurrency 1, TP = all visible GPUs.
# qwen397b (8 x H200 for the whole model: 793 GB of bf16 weights; with fewer GPUs its 12-layer cut,
#   qwen3.5-397b-12l, 161 GB, which 2 x H200 hold beside its MTP layer with 92% of each GPU for JAX,
#   jspec's default): Qwen3.5-397B-A17B, the decode step at batch 1 / 32
#   against its bytes floor, then no spec vs NEXTN 3/1/4 v2 (random MTP layer, simulated accept 3) at
#   concurrency 1 / 32, TP = all visible GPUs.
# graph-rows [ROWS] (any multi-GPU kind): the Qwen3-8B TP2 decode step at batch 1 / 8 / 32 with NCCL
#   all-reduces recorded into the command buffers of decode steps from ROWS target rows (default 32;
#   JSPEC_TP_GRAPH_COLLECTIVES_FROM_ROWS, per bucket) against the defaults, alternated twice.
set -euo pipefail
out=$1; stage=$2
oneshot=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true
ngpu=$(python3 -c "import jax; print(jax.device_count())")
serve=(--chunked-prefill-size 2048 --speculative-draft-model-path random --quiet --disable-top-k-top-p
       --dataset-name random --random-input-len 1024 --random-output-len 256 --random-range-ratio 1
       --prompts-per-concurrency 2 --speculative-num-steps-list 3 --speculative-eagle-topk-list 1
       --speculative-num-draft-tokens-list 4 --speculative-simulate-accept-length-list 3
       --speculative-adaptive off --compilation-cache-dir "${XLA_CACHE:-/tmp/xla}")
algos=${3:-none,NEXTN}
# Without "none" in ALGOS the call runs only the speculative engines (their baseline ran earlier).
[[ ,$algos, == *,none,* ]] && base=() || base=(--skip-baseline)
case $stage in
  allreduce)
    PYTHONPATH=. python3 bench/allreduce.py --impl psum,oneshot --out "$out/allreduce_default.json"
    NCCL_PROTO=LL PYTHONPATH=. python3 bench/allreduce.py --out "$out/allreduce_nccl_ll.json"
    XLA_FLAGS="${XLA_FLAGS:-} $oneshot" PYTHONPATH=. python3 bench/allreduce.py --out "$out/allreduce_oneshot.json" ;;
  allreduce-captured)
    cap=--xla_gpu_enable_command_buffer=+COLLECTIVES
    sizes=(--sizes 8192,262144 --chain 72)
    for procs in 1 2; do
      PYTHONPATH=. python3 bench/allreduce.py "${sizes[@]}" --processes $procs --out "$out/allreduce_p${procs}_default.json"
      PYTHONPATH=. python3 bench/allreduce.py "${sizes[@]}" --processes $procs --in-place --out "$out/allreduce_p${procs}_inplace.json"
      XLA_FLAGS="${XLA_FLAGS:-} $cap" PYTHONPATH=. python3 bench/allreduce.py "${sizes[@]}" --processes $procs \
          --in-place --out "$out/allreduce_p${procs}_inplace_captured.json"
    done ;;
  step-8b-mp)
    cap=--xla_gpu_enable_command_buffer=+COLLECTIVES
    for procs in 1 2; do
      for flags in "" "$cap"; do
        XLA_FLAGS=$(echo ${XLA_FLAGS:-} $flags) PYTHONPATH=. python3 bench/launch_cost.py --preset qwen3-8b --tp-size 2 \
            --processes $procs --batch-sizes 1,32 --reps 30 --variants plain,stage+arena --out "$out/launch_cost_tp2_mp.jsonl"
      done
    done ;;
  step-8b-graph)
    cap=--xla_gpu_enable_command_buffer=+COLLECTIVES
    for flags in "" "$cap" "--xla_gpu_experimental_use_collective_kernels= $cap" \
                 "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false $cap" \
                 "--xla_gpu_experimental_use_collective_kernels= $cap --xla_gpu_graph_min_graph_size=1"; do
      echo "== XLA_FLAGS: $flags"
      XLA_FLAGS=$(echo ${XLA_FLAGS:-} $flags) TF_CPP_VMODULE=command_buffer_thunk=3 PYTHONPATH=. python3 \
          bench/launch_cost.py --preset qwen3-8b --tp-size 2 --batch-sizes 1,32 --reps 30 --variants plain \
          --out "$out/launch_cost_tp2_graph.jsonl" 2> "$out/graph_log.txt" | tail -6 || tail -5 "$out/graph_log.txt"
      echo "graph executions logged: $(grep -c -i 'execut' "$out/graph_log.txt"), updates: $(grep -c -i 'updat' "$out/graph_log.txt")"
    done
    rm -f "$out/graph_log.txt" ;;
  step-8b)
    PYTHONPATH=. python3 -m jspec.cli bench step --model-path random:qwen3-8b --batch-sizes 1,32 \
        --context-lens 1024 --tp-size 1 --output-file "$out/step_tp.jsonl"
    PYTHONPATH=. python3 -m jspec.cli bench step --model-path random:qwen3-8b --batch-sizes 1,32 \
        --context-lens 1024 --tp-size 2 --profile "$out/profile_tp2" --output-file "$out/step_tp.jsonl"
    python3 bench/trace_summary.py "$out/profile_tp2/b1_ctx1024" "$out/profile_tp2/b32_ctx1024" \
        --json "$out/step_tp2_trace_summary.json"
    rm -rf "$out/profile_tp2"
    XLA_FLAGS=$(echo ${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+COLLECTIVES) PYTHONPATH=. python3 -m jspec.cli \
        bench step --model-path random:qwen3-8b --batch-sizes 1,32 --context-lens 1024 --tp-size 2 \
        --output-file "$out/step_tp.jsonl" ;;
  step-rep)
    preset=${3:-qwen3-8b}
    step=(bench step --model-path "random:$preset" --batch-sizes 1,8,32 --context-lens 1024
          --output-file "$out/step_rep_$preset.jsonl")
    [[ $preset == qwen3-8b ]] && PYTHONPATH=. python3 -m jspec.cli "${step[@]}" --tp-size 1
    PYTHONPATH=. python3 -m jspec.cli "${step[@]}" --tp-size 2
    PYTHONPATH=. python3 -m jspec.cli "${step[@]}" --tp-size 2 --replicate-attention
    if [[ $preset == qwen3-8b ]]; then
      for rep in "" --replicate-attention; do
        PYTHONPATH=. python3 bench/launch_cost.py --preset "$preset" --tp-size 2 $rep --batch-sizes 1,32 --reps 30 \
            --variants plain --out "$out/launch_cost_rep_$preset.jsonl" | tail -4
      done
    fi ;;
  collectives)
    PYTHONPATH=. python3 bench/tp_collectives.py --preset qwen3-8b --layers 2 --tp-size "$ngpu" \
        --algorithms none,EAGLE3 --out "$out/tp_collectives_qwen3_8b.json"
    PYTHONPATH=. python3 bench/tp_collectives.py --preset qwen3-next-80b-a3b --layers 4 --tp-size "$ngpu" \
        --algorithms none,NEXTN --out "$out/tp_collectives_next.json" ;;
  step-8b-flags)
    i=0
    for flags in "" "--xla_gpu_enable_command_buffer=+COLLECTIVES" "--xla_gpu_enable_command_buffer=+COLLECTIVES $oneshot" \
                 "--xla_gpu_enable_command_buffer="; do
      i=$((i + 1))
      XLA_FLAGS=$(echo ${XLA_FLAGS:-} $flags) PYTHONPATH=. python3 -m jspec.cli bench step --model-path random:qwen3-8b \
          --batch-sizes 1 --context-lens 1024 --tp-size 2 --profile "$out/flags$i" --output-file "$out/step_tp_flags.jsonl"
      python3 bench/trace_summary.py "$out/flags$i/b1_ctx1024" --json "$out/flags${i}_summary.json"
      rm -rf "$out/flags$i"
    done ;;
  next80b)
    PYTHONPATH=. python3 -m jspec.cli bench sweep --model-path random:qwen3-next-80b-a3b --tp-size 2 "${serve[@]}" \
        --cuda-graph-bs 1,32 --max-concurrency-list 1,32 --speculative-algorithm-list "$algos" "${base[@]}" \
        --overlap-list "${OVERLAP:-off,on}" --output-file "$out/serve_next80b_tp2.jsonl" 2>&1 | tee "$out/serve_next80b_tp2.log" ;;
  next80b-ep)
    PYTHONPATH=. python3 -m jspec.cli bench sweep --model-path random:qwen3-next-80b-a3b --tp-size 2 --ep-size 2 \
        "${serve[@]}" --cuda-graph-bs 1,32 --max-concurrency-list 1,32 --speculative-algorithm-list none,NEXTN \
        --overlap-list on --output-file "$out/serve_next80b_tp2_ep2.jsonl" 2>&1 | tee "$out/serve_next80b_tp2_ep2.log" ;;
  next80b-rep)
    for rep in "" --replicate-attention; do
      PYTHONPATH=. python3 -m jspec.cli bench sweep --model-path random:qwen3-next-80b-a3b --tp-size 2 $rep "${serve[@]}" \
          --cuda-graph-bs 1,32 --max-concurrency-list 1,32 --speculative-algorithm-list NEXTN --skip-baseline \
          --overlap-list on --output-file "$out/serve_next80b_tp2_rep.jsonl" 2>&1 | tee -a "$out/serve_next80b_tp2_rep.log" | tail -8
    done ;;
  llama70b)
    PYTHONPATH=. python3 -m jspec.cli bench step --model-path random:llama-3.1-70b --batch-sizes 1 --context-lens 1024 \
        --tp-size "$ngpu" --output-file "$out/step_llama70b_tp$ngpu.jsonl"
    PYTHONPATH=. python3 -m jspec.cli bench sweep --model-path random:llama-3.1-70b --tp-size "$ngpu" "${serve[@]}" \
        --cuda-graph-bs 1 --max-concurrency-list 1 --speculative-algorithm-list none,EAGLE3 --overlap-list on \
        --context-length 4096 --output-file "$out/serve_llama70b_tp$ngpu.jsonl" 2>&1 | tee "$out/serve_llama70b.log" ;;
  qwen397b)
    preset=qwen3.5-397b-a17b; (( ngpu >= 8 )) || preset=qwen3.5-397b-12l
    PYTHONPATH=. python3 -m jspec.cli bench step --model-path random:$preset --batch-sizes 1,32 --context-lens 1024 \
        --tp-size "$ngpu" --output-file "$out/step_${preset}_tp$ngpu.jsonl"
    PYTHONPATH=. python3 -m jspec.cli bench sweep --model-path random:$preset --tp-size "$ngpu" "${serve[@]}" \
        --cuda-graph-bs 1,32 --max-concurrency-list 1,32 --speculative-algorithm-list none,NEXTN --overlap-list on \
        --output-file "$out/serve_${preset}_tp$ngpu.jsonl" 2>&1 | tee "$out/serve_${preset}.log" ;;
  graph-rows)
    for round in 1 2; do
      for rows in "" "${3:-32}"; do
        echo "== JSPEC_TP_GRAPH_COLLECTIVES_FROM_ROWS=$rows"
        JSPEC_TP_GRAPH_COLLECTIVES_FROM_ROWS=$rows PYTHONPATH=. python3 -m jspec.cli bench step --model-path random:qwen3-8b \
            --tp-size 2 --batch-sizes 1,8,32 --output-file "$out/step_tp2_graph_rows${rows:-_default}.jsonl" 2>&1 \
            | grep -E "^ *(batch|[0-9]+ +[0-9]+)"
      done
    done ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
