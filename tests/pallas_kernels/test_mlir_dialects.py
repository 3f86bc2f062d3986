"""MLIR's lookup of the Triton dialect's Python module (`pallas_kernels.mlir_dialects`): once
installed, lowering a Pallas kernel for CUDA (on any machine) imports nothing that is not there,
and the lowered module is the same text as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r'''
import json, sys
import jax, jax.numpy as jnp
from pallas_kernels import mlir_dialects
from pallas_kernels.rms_norm.kernel import add_rms_norm

class Missing:  # the last finder on sys.meta_path sees only the imports that fail
    names = []
    def find_spec(self, name, path=None, target=None):
        self.names.append(name)
sys.meta_path.append(Missing())

def module(rows):
    f = lambda x, d, w: add_rms_norm(x, d, w, eps=1e-6, zero_centred=False)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((rows, 256), (rows, 256), (256,))]
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

out = {"before": module(8)}
out["missing_before"] = len(Missing.names)
out["installed"] = mlir_dialects.install() and mlir_dialects.install()
del Missing.names[:]
out["after"] = module(8)  # the same kernel again: JAX caches no lowering between modules
out["missing_after"] = Missing.names
print(json.dumps(out))
'''


def test_the_triton_dialect_is_found_once_and_the_module_text_is_unchanged():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["installed"]
    assert out["missing_before"] > 10  # without it, failed imports for each operation of the kernel
    # the first lookup after install still tries the prefixes before this one, then never again
    assert len(out["missing_after"]) <= 3, out["missing_after"]
    assert out["after"] == out["before"]
