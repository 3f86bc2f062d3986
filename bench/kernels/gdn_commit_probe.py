"""Probe: forms of the GDN commit kernel with a tracked snapshot node, timed at the decode shape
(B32, N4, Qwen3-Next heads) untracked and tracked, against the kernel before tracking.

  PYTHONPATH=. python3 bench/kernels/gdn_commit_probe.py OUT.json
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

sys.path.insert(0, "bench/kernels")
import gdn as gb  # noqa: E402
try:  # the kernel before tracking, when a copy of it is placed beside this file (gdn_commit_before.py)
    from gdn_commit_before import commit as commit_before  # noqa: E402
except ImportError:
    commit_before = None

from pallas_kernels.gdn.commit import commit as shipped_commit  # noqa: E402
from pallas_kernels.gdn import reference as ref  # noqa: E402
from pallas_kernels.gdn.common import ANY, block_for, cdiv, delta_rule_token, triton_params  # noqa: E402

CB = 256


def _kernel(slots_ref, accepted_ref, path_ref, tn_ref, dst_ref, k_ref, v_ref, g_ref, beta_ref, conv_scr_ref,
            state_ref, conv_ref, state_out_ref, conv_out_ref, *, num_draft, block_v, group, conv_iters, form):
    del conv_ref
    b, h, jv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hk = h // group
    cols = pl.ds(jv * block_v, block_v)
    a = accepted_ref[b]

    @pl.when(a >= 0)
    def _():
        slot = slots_ref[b]
        last = jnp.minimum(a, num_draft - 1)
        tn = tn_ref[b]
        dst = dst_ref[b]

        def body(i, s):
            def replay():
                return delta_rule_token(s, b * num_draft + i, h, hk, cols, None, k_ref, v_ref, g_ref, beta_ref, None,
                                        scale=1.0, use_qk_l2norm=True)
            s = jax.lax.cond(path_ref[b, i] != 0, replay, lambda: s)

            @pl.when(i == tn)
            def _():
                state_out_ref[dst, h, :, cols] = s
            return s

        state_out_ref[slot, h, :, cols] = jax.lax.fori_loop(0, last + 1, body, state_ref[slot, h, :, cols])
        programs = pl.num_programs(1) * pl.num_programs(2)
        f = h * pl.num_programs(2) + jv
        size = conv_scr_ref.shape[2]
        node = jnp.clip(tn, 0, last)
        for it in range(conv_iters):
            off = (f + it * programs) * CB
            live = off + jnp.arange(CB) < size
            x = plt.load(conv_scr_ref.at[b, last, pl.ds(off, CB)], mask=live, other=0.0)
            plt.store(conv_out_ref.at[slot, pl.ds(off, CB)], x.astype(conv_out_ref.dtype), mask=live)
            if form == "masked":
                t = live & (tn >= 0)
                y = plt.load(conv_scr_ref.at[b, node, pl.ds(off, CB)], mask=t, other=0.0)
                plt.store(conv_out_ref.at[jnp.maximum(dst, 0), pl.ds(off, CB)], y.astype(conv_out_ref.dtype), mask=t)
        if form == "when":
            @pl.when(tn >= 0)
            def _():
                for it in range(conv_iters):
                    off = (f + it * programs) * CB
                    live = off + jnp.arange(CB) < size
                    y = plt.load(conv_scr_ref.at[b, node, pl.ds(off, CB)], mask=live, other=0.0)
                    plt.store(conv_out_ref.at[dst, pl.ds(off, CB)], y.astype(conv_out_ref.dtype), mask=live)


def variant(form):
    def commit(state_pool, conv_pool, conv_scratch, k, v, g, beta, slots, path, accepted, track_node=None,
               track_dst=None, block_v=32, num_warps=4):
        batch, num_draft = path.shape
        if track_node is None:
            track_node = track_dst = jnp.full((batch,), -1, jnp.int32)
        hv, dv = v.shape[1:]
        block_v = block_for(dv, block_v)
        conv_flat = conv_pool.reshape(conv_pool.shape[0], -1)
        conv_scr = conv_scratch.reshape(batch, num_draft, -1)
        conv_iters = cdiv(cdiv(conv_flat.shape[1], CB), hv * (dv // block_v))
        kern = functools.partial(_kernel, num_draft=num_draft, block_v=block_v, group=hv // k.shape[1],
                                 conv_iters=conv_iters, form=form)
        s, c = pl.pallas_call(
            kern, out_shape=(jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
                             jax.ShapeDtypeStruct(conv_flat.shape, conv_flat.dtype)),
            grid=(batch, hv, dv // block_v), in_specs=[ANY] * 12, out_specs=[ANY] * 2,
            input_output_aliases={10: 0, 11: 1}, compiler_params=triton_params(num_warps, 1), name="gdn_commit_probe",
        )(slots, accepted, path.astype(jnp.int32), track_node, track_dst, k, v, g, beta, conv_scr, state_pool, conv_flat)
        return s, c.reshape(conv_pool.shape)
    return commit


def main(out_path):
    batch, n_draft, rot = 32, 4, 4
    slots_n = batch * rot
    pool0 = 0.1 * jax.random.normal(jax.random.key(20), (slots_n, gb.HV, gb.DK, gb.DV), jnp.float32)
    sets = [jnp.arange(r * batch, (r + 1) * batch, dtype=jnp.int32) for r in range(rot)]
    _, kv_, vv, gv, bv_ = gb.gdn_inputs(jax.random.key(22), batch * n_draft, batch * n_draft)
    cpool0 = jax.random.normal(jax.random.key(24), (slots_n, gb.CONV_C, gb.CONV_K - 1)).astype(gb.BF16)
    cscr = jax.random.normal(jax.random.key(25), (batch, n_draft, gb.CONV_C, gb.CONV_K - 1)).astype(gb.BF16)
    chain = jnp.tile(jnp.arange(-1, n_draft - 1, dtype=jnp.int32), (batch, 1))
    accepted = jnp.asarray(np.random.default_rng(1).integers(0, n_draft, batch), jnp.int32)
    path = ref.accepted_path(chain, accepted)
    tn = jnp.where(accepted > 0, accepted - 1, 0)
    forms = {"before": commit_before, "shipped_split": shipped_commit, "inloop_when": variant("when"),
             "inloop_masked": variant("masked")}
    forms = {k: v for k, v in forms.items() if v is not None}
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    want = jax.jit(ref.commit)(pool0, cpool0, cscr, kv_, vv, gv, bv_, sets[0], path, accepted, tn, sets[1])
    for name, fn in forms.items():
        f = jax.jit(fn, donate_argnums=(0, 1))
        if name != "before":
            got = jax.jit(fn)(pool0, cpool0, cscr, kv_, vv, gv, bv_, sets[0], path, accepted, tn, sets[1])
            res[f"{name}_err"] = float(jnp.max(jnp.abs(got[0] - want[0]))) + float(
                jnp.max(jnp.abs(got[1].astype(jnp.float32) - want[1].astype(jnp.float32))))
        for rnd in range(2):  # interleaved rounds: the spread shows
            res.setdefault(f"{name}_ms", []).append(gb.time_calls(
                lambda p, i: f(*p, cscr, kv_, vv, gv, bv_, sets[i % rot], path, accepted), (pool0 + 0, cpool0 + 0),
                calls=50)[0])
            if name != "before":
                res.setdefault(f"{name}_tracked_ms", []).append(gb.time_calls(
                    lambda p, i: f(*p, cscr, kv_, vv, gv, bv_, sets[i % rot], path, accepted, tn, sets[(i + 1) % rot]),
                    (pool0 + 0, cpool0 + 0), calls=50)[0])
    print(json.dumps(res, indent=1))
    with open(out_path, "w") as fh:
        json.dump(res, fh, indent=1)



if __name__ == "__main__":
    main(sys.argv[1])
