#!/usr/bin/env bash
# What structured output costs under speculation (bench/README.md, "Structured output"): Qwen3-8B
# shape + random EAGLE3 head at simulated accept 3 (spec v2), random 1024 in / 512 out, concurrency
# 1 and 32, a byte-level tokenizer of the whole 151,936-token vocabulary (bench/vocab_tokenizer.py:
# the machine has no model hub, and random drafters propose anywhere in it), one stage per call.
# Writes JSONL under OUT.
#   bench/grammar_cost.sh OUT nogrammar | off | open | json | graph-parts | static-carry | update-mode | copies |
#                          part-copies | alternate
# nogrammar: an engine without grammar_backend (fused steps), the baseline;
# off: the grammar engine (split steps), no request constrained: the cost of the split alone;
# open: every request under a regex that allows any text: the host's mid-step drafts read, grammar
#   walk and mask upload at the simulated acceptance;
# json: every request under a JSON schema with free string fields (random weights: most random
#   drafts break the JSON and are cut, so this shows the path, not a real model's acceptance).
# graph-parts: `open` only, 256 out, no baseline, at the concurrencies in CONCURRENCY (default 32;
#   e.g. "1,32", then compiled for exactly those batch sizes), once per setting of
#   JSPEC_GRAMMAR_UNCAPTURED_PARTS in PARTS (default: "default forward draft,forward
#   draft,forward,verify"; "default" leaves it unset): which parts of the pipelined constrained
#   step should run without command buffers, by width (jspec/runtime/compile_options.py). One
#   JSONL per setting.
# static-carry: `open` only, 256 out, no baseline, at CONCURRENCY (default 1), with the split parts'
#   carry in static buffers (JSPEC_GRAMMAR_STATIC_CARRY=1) and as separate arrays (=0), alternated
#   twice (jspec/runtime/static_carry.py): whether the parts' graphs stop being re-recorded pays.
# update-mode: `open` and `off`, 256 out, no baseline, at each concurrency in CONCURRENCY (default
#   "1 32"), under each XLA setting in MODES (default "SKIP_TEMP default"): an update mode of
#   `--xla_gpu_command_buffer_update_mode`, "default" (XLA_FLAGS as given), or a whole flag
#   (e.g. --xla_gpu_temp_buffer_use_separate_color=true), or environment settings joined by +
#   (e.g. XLA_PYTHON_CLIENT_ALLOCATOR=vmm+JSPEC_GRAMMAR_UPDATE_MODE=SKIP_TEMP: the mode on the
#   captured split parts only, jspec/runtime/compile_options.py). SKIP_TEMP keeps each compiled part's
#   temporaries at stable addresses, so a part's graph needs no update for them, and swaps the
#   client's allocator for XLA's VMM one (which, by XLA's source, keeps each executable's
#   temporaries mapped until memory runs short). The device memory in use is sampled every 0.5 s
#   (nvidia-smi); each run's peak goes to OUT/memory_peaks.txt. JSPEC_* knobs in the environment
#   (e.g. JSPEC_GRAMMAR_UNCAPTURED_PARTS=none JSPEC_GRAMMAR_STATIC_CARRY=1 for captured c32 parts)
#   reach every run and are named in its record. RUNS: which of `open off` to run (default both).
# copies: `alternate` with the pipelined forward part as two loaded copies and as one
#   (JSPEC_GRAMMAR_FORWARD_COPIES=1 / 0, jspec/runtime/part_copies.py), c1 twice each, c32 once each.
# part-copies: `alternate` at c1 with each JSPEC_GRAMMAR_PART_COPIES setting in SETS (which parts of
#   the pipelined step run as two copies; default forward, draft+forward, all three), twice each.
# alternate: one engine, every request under the allow-all regex and then none, alternated ROUNDS
#   times (default 3; `jspec bench serve --alternate-constraint`), decode-heavy (1024 out, PROMPTS
#   prompts a run, default twice CONCURRENCY, which defaults to 32): the constraint's cost without
#   the scatter between engines and machines. One JSONL, a record per run. PHASES=1: under
#   bench/host_phases.py as well (the loop's host phases per run, without a profiler).
#   PROCESSES=N: N engines one after another (files suffixed _p1.._pN), then
#   bench/alternate_summary.py over them: the cost spreads between processes far more than
#   between one engine's rounds, so a setting needs several.
# WHEELS: a folder holding the llguidance wheel (the GPU machine has no network). SKIP_BASELINE=1: no
# no-speculation column (the stages compare EAGLE3 engines; each baseline costs an engine build).
# EXTRA: more `jspec bench sweep` flags, after the stage's (later flags win), e.g.
#   EXTRA="--profile OUT/trace --random-output-len 128" for traces of a shorter run. At concurrency 32
#   a 256-out run is short and mostly the prompts' prefill, so repeats spread widely (bench/README.md):
#   compare c32 settings on EXTRA="--random-output-len 1024 --prompts-per-concurrency 1" (mostly decode).
set -euo pipefail
out=$1; stage=$2
if [[ -n "${WHEELS:-}" ]]; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" llguidance
fi
python3 -c "import llguidance"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}  # a caller's entries (a probe's sitecustomize) kept
tok=$(mktemp -d)
python3 bench/vocab_tokenizer.py 151936 "$tok"
common=(--model-path random:qwen3-8b --speculative-algorithm-list EAGLE3 --overlap-list on --quiet
        --speculative-draft-model-path random --speculative-num-steps-list 3 --speculative-eagle-topk-list 1
        --speculative-num-draft-tokens-list 4 --speculative-simulate-accept-length-list 3
        --chunked-prefill-size 2048 --cuda-graph-bs 1,32 --prefill-token-buckets 2048 --disable-top-k-top-p
        --dataset-name random --random-input-len 1024 --random-output-len 512 --random-range-ratio 1
        --prompts-per-concurrency 2 --max-concurrency-list 1,32 --tokenizer-path "$tok" ${SKIP_BASELINE:+--skip-baseline})
schema='{"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}}}'
open=(--grammar-backend llguidance --regex '[\s\S]*')
case $stage in
  nogrammar) extra=() ;;
  off) extra=(--grammar-backend llguidance) ;;
  open) extra=("${open[@]}") ;;
  json) extra=(--grammar-backend llguidance --json-schema "$schema") ;;
  graph-parts)
    for parts in ${PARTS:-default forward draft,forward draft,forward,verify}; do
      name=${parts//,/_}
      [[ $parts == default ]] && setting=() || setting=("JSPEC_GRAMMAR_UNCAPTURED_PARTS=$parts")
      echo "== uncaptured parts: $parts"
      env "${setting[@]}" python3 -m jspec.cli bench sweep "${common[@]}" "${open[@]}" --skip-baseline \
          --max-concurrency-list "${CONCURRENCY:-32}" ${CONCURRENCY:+--cuda-graph-bs "$CONCURRENCY"} \
          --random-output-len 256 ${EXTRA:-} \
          --output-file "$out/serve_grammar_parts_$name.jsonl" 2>&1 | tee "$out/serve_grammar_parts_$name.log" | grep -E "^ +EAGLE3"
    done
    exit 0 ;;
  copies)
    # The pipelined forward part as two loaded copies (JSPEC_GRAMMAR_FORWARD_COPIES=1, the GPU
    # default) against one (=0): `alternate` at concurrency 1 (4 prompts) twice each, alternated,
    # then at 32 (32 prompts) once each; one engine per run, each in OUT/copies_<c>_<setting>_r<round>.
    for c in 1 32; do
      rounds=2; (( c > 1 )) && rounds=1
      for round in $(seq $rounds); do
        for copies in 1 0; do
          dir=$out/copies_c${c}_${copies}_r$round; mkdir -p "$dir"; echo "== c$c JSPEC_GRAMMAR_FORWARD_COPIES=$copies (round $round)"
          JSPEC_GRAMMAR_FORWARD_COPIES=$copies CONCURRENCY=$c PROMPTS=$(( c > 1 ? 32 : 4 )) ROUNDS=1 bash "$0" "$dir" alternate
        done
      done
    done
    exit 0 ;;
  part-copies)
    # Which parts run as two loaded copies (JSPEC_GRAMMAR_PART_COPIES): each setting of SETS
    # (default: forward, draft+forward, all three) in turn, `alternate` at concurrency 1 (4 prompts),
    # ROUNDS_EACH rounds (default 2); one engine per run, in OUT/parts_<setting>_r<round>.
    for round in $(seq ${ROUNDS_EACH:-2}); do
      for set in ${SETS:-forward draft,forward draft,forward,verify}; do
        dir=$out/parts_${set//,/+}_r$round; mkdir -p "$dir"; echo "== c1 JSPEC_GRAMMAR_PART_COPIES=$set (round $round)"
        JSPEC_GRAMMAR_PART_COPIES=$set CONCURRENCY=1 PROMPTS=4 ROUNDS=1 bash "$0" "$dir" alternate
      done
    done
    exit 0 ;;
  static-carry)
    for round in 1 2; do
      for carry in 1 0; do
        echo "== JSPEC_GRAMMAR_STATIC_CARRY=$carry (round $round)"
        JSPEC_GRAMMAR_STATIC_CARRY=$carry python3 -m jspec.cli bench sweep "${common[@]}" "${open[@]}" --skip-baseline \
            --max-concurrency-list "${CONCURRENCY:-1}" --cuda-graph-bs "${CONCURRENCY:-1}" --random-output-len 256 \
            ${EXTRA:-} --output-file "$out/serve_grammar_static_carry_${carry}_r$round.jsonl" 2>&1 \
            | tee "$out/serve_grammar_static_carry_${carry}_r$round.log" | grep -E "^ +EAGLE3"
      done
    done
    exit 0 ;;
  update-mode)
    for mode in ${MODES:-SKIP_TEMP default}; do
      flag=; assigns=()
      case $mode in
        default) ;;
        --*) flag=$mode ;;
        *=*) IFS=+ read -ra assigns <<< "$mode" ;;
        *) flag=--xla_gpu_command_buffer_update_mode=$mode ;;
      esac
      flags="${XLA_FLAGS:-}${flag:+${XLA_FLAGS:+ }$flag}"
      label=$(echo "${mode#--xla_gpu_}" | tr -c 'A-Za-z0-9_\n' '_')
      for c in ${CONCURRENCY:-1 32}; do
        for run in ${RUNS:-open off}; do
          [[ $run == open ]] && grammar=("${open[@]}") || grammar=(--grammar-backend llguidance)
          name=${run}_${label}_c$c
          nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$out/memory_$name.csv" & smi=$!
          echo "== $name"
          env ${flags:+XLA_FLAGS="$flags"} "${assigns[@]}" python3 -m jspec.cli bench sweep "${common[@]}" "${grammar[@]}" --skip-baseline \
              --max-concurrency-list "$c" --cuda-graph-bs "$c" --random-output-len 256 ${EXTRA:-} \
              --output-file "$out/serve_grammar_update_mode_$name.jsonl" 2>&1 | grep -E "^ +EAGLE3|rror" || true
          kill $smi; wait $smi 2>/dev/null || true
          echo "$name peak_mib $(sort -n "$out/memory_$name.csv" | tail -1)" | tee -a "$out/memory_peaks.txt"
          rm -f "$out/memory_$name.csv"
        done
      done
    done
    exit 0 ;;
  alternate)
    c=${CONCURRENCY:-32}; n=${PROCESSES:-1}
    for p in $(seq "$n"); do
      (( n > 1 )) && tag=_p$p || tag=
      runner=(python3 -m jspec.cli)
      [[ -n ${PHASES:-} ]] && runner=(python3 bench/host_phases.py record "$out/host_phases_c$c$tag.json" --)
      "${runner[@]}" bench serve --model-path random:qwen3-8b --speculative-algorithm EAGLE3 --quiet \
          --speculative-draft-model-path random --speculative-num-steps 3 --speculative-eagle-topk 1 \
          --speculative-num-draft-tokens 4 --speculative-simulate-accept-length 3 --chunked-prefill-size 2048 \
          --cuda-graph-bs "$c" --prefill-token-buckets 2048 --disable-top-k-top-p --dataset-name random \
          --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1 --num-prompts "${PROMPTS:-$((2 * c))}" \
          --max-concurrency "$c" --tokenizer-path "$tok" "${open[@]}" --alternate-constraint "${ROUNDS:-3}" ${EXTRA:-} \
          --output-file "$out/serve_grammar_alternate_c$c$tag.jsonl" 2>&1 | tee "$out/serve_grammar_alternate_c$c$tag.log" \
          | grep -E "^constraint|rror"
      if [[ -n ${PHASES:-} ]]; then
        python3 bench/host_phases.py summary "$out/host_phases_c$c$tag.json" | tee "$out/host_phases_c$c$tag.txt"
      fi
    done
    (( n > 1 )) && python3 bench/alternate_summary.py "$out"
    exit 0 ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
python3 -m jspec.cli bench sweep "${common[@]}" "${extra[@]}" ${EXTRA:-} \
    --output-file "$out/serve_grammar_cost_$stage.jsonl" 2>&1 | tee "$out/serve_grammar_cost_$stage.log"
