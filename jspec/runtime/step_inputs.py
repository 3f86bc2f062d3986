"""One host->device transfer per step: every small input packed into a single int32 vector.

A bucket fixes the shapes (T tokens, B requests, U page-table updates); the layout lists the fields
in order, floats travel bit-cast to int32, and the step unpacks them with static slices. Outputs
come back the same way: one int32 matrix `[B, 2 + 2 * n_top]` per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache.page_allocator import SINK_PAGE
from jspec.cache.slot_allocator import SINK_SLOT
from jspec.runtime.scheduler import TOKEN_FROM_DEVICE, TOKEN_PROMPT, TOKEN_REFED_OUTPUT, StepPlan

INT_FIELDS_T = ("input_ids", "positions", "token_kind")
INT_FIELDS_B = ("seq_lens", "req_slots", "has_initial", "sample_mask", "reset_mask", "out_index", "seeds", "top_k")
FLOAT_FIELDS_B = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


@dataclasses.dataclass(frozen=True)
class Bucket:
    mode: str  # "extend" | "decode" | "spec" (packed like decode: one row per request)
    num_tokens: int  # T
    batch_size: int  # B
    num_page_updates: int  # U
    sort: bool | None = None  # sampler variant: None decides on device; True / False static
    next_ids: bool = False  # extend steps for a hidden-state drafter: the token after each token

    def fields(self):
        t, b, u = self.num_tokens, self.batch_size, self.num_page_updates
        out = [(name, (t,)) for name in INT_FIELDS_T]
        out.append(("cu_q_lens", (b + 1,)))
        out += [(name, (b,)) for name in INT_FIELDS_B + FLOAT_FIELDS_B]
        out.append(("page_updates", (u, 3)))
        if self.next_ids:
            out.append(("next_ids", (t,)))
        return out

    @property
    def size(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.fields())

    def unpack(self, packed) -> dict:
        """Device side: int32 `[size]` -> dict of typed arrays (static slices)."""
        out, off = {}, 0
        for name, shape in self.fields():
            n = int(np.prod(shape))
            x = packed[off:off + n].reshape(shape)
            if name in FLOAT_FIELDS_B:
                x = jax.lax.bitcast_convert_type(x, jnp.float32)
            out[name] = x
            off += n
        return out


def pack(plan: StepPlan, bucket: Bucket) -> np.ndarray:
    """Host side: a step plan -> the bucket's int32 vector (padding rows point at the sinks)."""
    t_cap, b_cap, u_cap = bucket.num_tokens, bucket.batch_size, bucket.num_page_updates
    f = {name: np.zeros(shape, np.int32) for name, shape in bucket.fields() if name not in FLOAT_FIELDS_B}
    fl = {name: np.zeros((b_cap,), np.float32) for name in FLOAT_FIELDS_B}
    f["req_slots"][:] = SINK_SLOT
    f["top_k"][:] = -1
    fl["temperature"][:] = 0.0
    fl["top_p"][:] = 1.0
    fl["repetition_penalty"][:] = 1.0
    t = 0
    cu = f["cu_q_lens"]
    for i, s in enumerate(plan.reqs):
        req, sp = s.req, s.req.sampling
        n = s.num_tokens
        if s.token_ids is None:
            f["input_ids"][t] = -1
            f["token_kind"][t] = TOKEN_FROM_DEVICE
        else:
            f["input_ids"][t:t + n] = s.token_ids
            prompt_len = len(req.input_ids)
            idx = np.arange(s.start, s.start + n)
            f["token_kind"][t:t + n] = np.where(idx < prompt_len, TOKEN_PROMPT, TOKEN_REFED_OUTPUT)
        f["positions"][t:t + n] = np.arange(s.start, s.start + n)
        t += n
        cu[i + 1] = t
        f["seq_lens"][i] = s.start + n
        f["req_slots"][i] = req.slot
        f["has_initial"][i] = s.start > 0
        f["sample_mask"][i] = s.sample
        f["reset_mask"][i] = s.reset
        f["out_index"][i] = s.output_index
        f["seeds"][i] = req.seed
        f["top_k"][i] = sp.top_k
        fl["temperature"][i] = 0.0 if sp.is_greedy else sp.temperature
        fl["top_p"][i] = sp.top_p
        fl["min_p"][i] = sp.min_p
        fl["repetition_penalty"][i] = sp.repetition_penalty
        fl["frequency_penalty"][i] = sp.frequency_penalty
        fl["presence_penalty"][i] = sp.presence_penalty
    n_req = len(plan.reqs)
    if bucket.mode in ("decode", "spec"):
        # Decode kernels assume one token per row: padding rows own one dummy token each.
        for i in range(n_req, b_cap):
            cu[i + 1] = cu[i] + 1
        f["input_ids"][t:] = 0
    else:
        cu[n_req + 1:] = t
    assert t <= t_cap and n_req <= b_cap, (t, t_cap, n_req, b_cap)
    if bucket.next_ids:
        # The token after each token (EAGLE-family drafters lag by one); -1 where it is the
        # request's newest token, which only the device has (sampled by this very step).
        nxt = f["next_ids"]
        nxt[:] = -1
        t = 0
        for s in plan.reqs:
            n = s.num_tokens
            if s.token_ids is not None:
                seq = s.req.all_ids
                for k in range(n):
                    i = s.start + k + 1
                    nxt[t + k] = seq[i] if i < len(seq) else -1
            t += n
    upd = f["page_updates"]
    upd[:] = -1
    if len(plan.page_updates) > u_cap:
        raise AssertionError(f"{len(plan.page_updates)} page updates exceed the bucket's {u_cap}")
    for j, (slot, idx, page) in enumerate(plan.page_updates):
        upd[j] = (slot, idx, page)
    parts = []
    for name, shape in bucket.fields():
        parts.append((fl[name].view(np.int32) if name in FLOAT_FIELDS_B else f[name]).reshape(-1))
    out = np.concatenate(parts)
    assert out.size == bucket.size
    return out


def unpack_outputs(out: np.ndarray, num_top: int):
    """`[B, 2 + 2 n]` int32 -> tokens, logprobs, top ids, top logprobs."""
    tokens = out[:, 0]
    logprobs = out[:, 1].view(np.float32)
    top_ids = out[:, 2:2 + num_top]
    top_lps = out[:, 2 + num_top:2 + 2 * num_top].view(np.float32)
    return tokens, logprobs, top_ids, top_lps


__all__ = ["Bucket", "pack", "unpack_outputs", "SINK_PAGE", "SINK_SLOT"]
