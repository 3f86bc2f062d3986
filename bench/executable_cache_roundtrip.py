"""Does an executable that JAX loaded from its persistent compilation cache serialize into one that
runs? (`jspec/runtime/executable_cache.py` stores fresh compiles only because on CPU, jax 0.10, it
does not: the reloaded copy fails at its first run with "Function ... not found".)

Three processes on one cache folder: the first compiles a small program (fresh) and serializes it;
the second compiles the same program (XLA's cache serves it) and serializes that; the third loads
each payload and runs it. Prints one JSON line: platform, jax version, and for each payload whether
it ran and gave the fresh compile's result.

    PYTHONPATH=. python3 bench/executable_cache_roundtrip.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, pickle, sys
import jax, jax.numpy as jnp
from jax.experimental import serialize_executable
folder, step = sys.argv[1], sys.argv[2]
jax.config.update("jax_compilation_cache_dir", folder)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
f = jax.jit(lambda x, i: jnp.take(jnp.pad(jnp.sin(x) * 2.0, 3), i) / 3.0 + x.sum())
x, i = jnp.arange(4096.0), jnp.arange(64) * 7
if step in ("fresh", "served"):
    compiled = f.lower(x, i).compile()
    with open(f"{folder}/{step}.pkl", "wb") as fh:
        pickle.dump(serialize_executable.serialize(compiled), fh)
    print(json.dumps({"value": float(compiled(x, i).sum())}))
else:
    out = {"platform": jax.devices()[0].platform, "jax": jax.__version__}
    for name in ("fresh", "served"):
        try:
            with open(f"{folder}/{name}.pkl", "rb") as fh:
                exe = serialize_executable.deserialize_and_load(*pickle.load(fh))
            out[name] = {"ran": True, "value": float(exe(x, i).sum())}
        except Exception as e:
            out[name] = {"ran": False, "error": f"{type(e).__name__}: {e}"[:300]}
    print(json.dumps(out))
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        def child(step: str) -> dict:
            done = subprocess.run([sys.executable, "-c", CHILD, folder, step], capture_output=True, text=True,
                                  env={**os.environ})
            if done.returncode:
                raise SystemExit(f"{step}: {done.stderr[-2000:]}")
            return json.loads(done.stdout.strip().splitlines()[-1])

        expected = child("fresh")["value"]
        child("served")
        result = child("load")
        for name in ("fresh", "served"):
            if result[name]["ran"]:
                result[name]["correct"] = abs(result[name]["value"] - expected) <= 1e-3 * max(1.0, abs(expected))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
