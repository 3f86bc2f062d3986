"""bench/lowering_cost.py with `pallas_kernels.mlir_dialects.install` on (FIX=1) or replaced by a
no-op (FIX=0), for the A/B of session 72 (2-core CPU, jax 0.10.2):
  for f in 0 1 0 1 0 1 0 1; do FIX=$f OUTF=/tmp/ab_$f.jsonl PYTHONPATH=. python3 bench/results/session72/mlir_dialects_ab.py; done
"""
import os
import runpy
import sys

if os.environ.get("FIX") == "0":
    import pallas_kernels.mlir_dialects as m
    m.install = lambda: False
sys.argv = ["bench/lowering_cost.py", "--preset", "tiny-qwen3", "--layers", "36", "--out", os.environ["OUTF"],
            "--engine-json", '{"cuda_graph_bs": [1, 4, 8, 16, 32, 64], "prefill_token_buckets": [64]}']
try:
    runpy.run_path("bench/lowering_cost.py", run_name="__main__")
except SystemExit:
    pass
