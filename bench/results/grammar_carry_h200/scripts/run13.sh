#!/usr/bin/env bash
# XLA's primary-graph LRU (--xla_gpu_command_buffer_cache_size=N: a compiled region keeps up to N
# graphs, one per set of buffer addresses, instead of re-recording one graph whenever an address
# moved). Does jaxlib here have the flag? If so: the command-buffer log of a 96-token c1 run
# under it, then c1 alternated (flag, default, flag, default), then c32 (flag, default).
set -uo pipefail
out=$OUT
mkdir -p /tmp/llg && tar xJf .cache/d/llg.tar.xz -C /tmp/llg
nproc > $out/device.txt; nvidia-smi -L >> $out/device.txt
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)" >> $out/device.txt
d=$(python3 -c "import jaxlib, os; print(os.path.dirname(jaxlib.__file__))")
for f in $(find $d $(python3 -c "import jax_plugins, os; print(os.path.dirname(jax_plugins.__path__[0]))" 2>/dev/null)/jax_plugins -name "*.so" 2>/dev/null); do
  grep -l "command_buffer_cache_size" $f; done > $out/flag_files.txt 2>&1
cat $out/device.txt $out/flag_files.txt
N=${N:-8}
FLAG="--xla_gpu_command_buffer_cache_size=$N"
XLA_FLAGS="$FLAG" python3 -c "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(3)))" > $out/flag_check.txt 2>&1
echo "flag check rc=$?"; tail -3 $out/flag_check.txt
if ! grep -q "2\." $out/flag_check.txt; then echo "no flag"; exit 0; fi
mkdir -p /tmp/res/cb /tmp/cb
save() { (cd /tmp/res && tar cJf $out/results.tar.xz .); }
export PYTHONPATH=/tmp/llg
XLA_FLAGS="$FLAG" TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 SKIP_BASELINE=1 \
  EXTRA="--random-output-len 96 --prompts-per-concurrency 1" CONCURRENCY=1 PARTS=default \
  bash bench/grammar_cost.sh /tmp/cb graph-parts 2>&1 | grep -E "EAGLE3|rror" | head
python3 .cache/d/cblog.py /tmp/cb/serve_grammar_parts_default.log /tmp/res/cb/cache.json | head -20
python3 bench/command_buffer_log.py /tmp/cb/serve_grammar_parts_default.log /tmp/res/cb/cb.json > /dev/null 2>&1
grep -c "cache hit" /tmp/cb/serve_grammar_parts_default.log; grep -c "cache miss" /tmp/cb/serve_grammar_parts_default.log
save
for r in 1 2; do
  for v in lru default; do
    mkdir -p /tmp/res/c1_$v$r; echo "== c1 $v $r $(date +%T) ($SECONDS s)"
    if [[ $v == lru ]]; then f=$FLAG; else f=; fi
    env ${f:+XLA_FLAGS=$f} CONCURRENCY=1 PROMPTS=4 ROUNDS=1 bash bench/grammar_cost.sh /tmp/res/c1_$v$r alternate 2>&1 | grep -E "^constraint|rror"
    save
  done
done
for v in lru default; do
  left=$((585 - SECONDS)); (( left > 70 )) || break
  mkdir -p /tmp/res/c32_$v; echo "== c32 $v $(date +%T) ($SECONDS s, $left left)"
  if [[ $v == lru ]]; then f=$FLAG; else f=; fi
  env ${f:+XLA_FLAGS=$f} PROMPTS=32 ROUNDS=1 timeout $left bash bench/grammar_cost.sh /tmp/res/c32_$v alternate 2>&1 | grep -E "^constraint|rror"
  save
done
echo "== done $(date +%T) ($SECONDS s)"
