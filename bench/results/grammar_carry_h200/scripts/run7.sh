#!/usr/bin/env bash
# The grammar engine's own choice (auto: SKIP_TEMP + VMM, allocator_env.choose_for_grammar) against
# XLA's default (opt-out: JSPEC_GRAMMAR_UPDATE_MODE= empty), c1 alternated twice, then c32 once each.
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
export PYTHONPATH=/tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
python3 -c "import importlib.util; print('cuda plugins', [n for n in ('jax_cuda12_plugin', 'jax_cuda13_plugin') if importlib.util.find_spec(n)])" >> $out/device.txt
cat $out/device.txt
mkdir -p /tmp/res
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
for r in 1 2; do
  for v in auto optout; do
    mkdir -p /tmp/res/c1_$v$r; echo "== c1 $v $r $(date +%T)"
    if [[ $v == auto ]]; then
      CONCURRENCY=1 PROMPTS=4 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c1_$v$r alternate 2>&1 | grep -E "^constraint|rror"
    else
      JSPEC_GRAMMAR_UPDATE_MODE= CONCURRENCY=1 PROMPTS=4 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c1_$v$r alternate 2>&1 | grep -E "^constraint|rror"
    fi
    save
  done
done
for v in auto optout; do
  mkdir -p /tmp/res/c32_$v; echo "== c32 $v $(date +%T)"
  if [[ $v == auto ]]; then
    PROMPTS=32 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c32_$v alternate 2>&1 | grep -E "^constraint|rror"
  else
    JSPEC_GRAMMAR_UPDATE_MODE= PROMPTS=32 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c32_$v alternate 2>&1 | grep -E "^constraint|rror"
  fi
  save
done
