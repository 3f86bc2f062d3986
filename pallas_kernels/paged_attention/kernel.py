"""The Pallas kernel behind decode, ragged extend, tree verify and DFlash blocks.

One program = (query block i, KV head g, KV split s). It holds every query head of KV head g for
the block's BQ new tokens as the rows of one matrix (`rows = BQ * H/G`, padded to a power of two
of at least 16, the smallest MMA tile), so each K/V page is read once per KV head and verify with
N draft tokens costs one decode-sized program, not N of them. It walks its split of the
request's KV in steps of `block_kv` tokens with an online softmax, and writes either the final
rows (one split) or (acc, max, sum) partials for `combine.py` (several splits). Given an init
(`prefill.py`), it resumes another kernel's softmax of each row, reads keys only below a
per-request stop, and writes the final rows in place into that kernel's `[T, H, D]` output.

Each split runs two loops. The first covers KV steps that every row may see in full (the cached
prefix up to the block's first token): no mask at all. The second covers the rest with the mask of
`mask_mode`. Poisoned slots (other requests' pages, the tail of the last page, NaN allowed) only
ever appear in the second loop, where logits are replaced (`where`, not multiply) by -inf and V
rows by 0 before the products.

Lowering: Triton (`pallas.triton.CompilerParams`), chosen because
- the same `pl.pallas_call` runs in interpret mode on CPU, so the tested kernel is the shipped one;
- K/V rows are gathered per token through the page table (`k_ref[slots, g, :]`), which the
  Triton lowering turns into plain vectorised loads that its software pipeliner overlaps
  (`num_stages`);
- Mosaic GPU was measured and would gain little: a Mosaic GPU kernel that only TMA-copies the same
  paged bytes and computes nothing (bench/kernels/paged_decode_probe.py) streams only slightly
  faster than this kernel with its softmax and products, and a TMA kernel would give up the
  CPU-tested kernel. Probes that drop the page table, or every product, are no faster either: what
  limits decode is how the Triton lowering streams a program's strided rows, not paging.

Launch shapes (`Config`, `choose`) are static: T, B, Pmax, H, G, D and the page size L are fixed
per bucket, lengths are not, so a choice may only depend on the former and is made at trace time
(the splits' shares of the KV excepted: those follow each request's length at run time).

The figures behind every choice here, and the designs tried and dropped: NOTES.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # the Triton lowering's parameters (deprecated but present on jax 0.11)
    from jax.experimental.pallas import triton as _pltriton

    _TritonParams = _pltriton.CompilerParams
except ImportError:  # pragma: no cover - only on a jax without the Triton backend
    _TritonParams = None


# ----------------------------------------------------------------------------- launch shapes


@dataclasses.dataclass(frozen=True)
class Config:
    """block_q: new tokens of one request per program (BQ); rows: BQ x H/G padded to a power of two
    (the MMA M dimension); block_kv: KV tokens per loop step; splits: programs along the KV axis
    (flash-decoding), each over an equal share of the block's actual KV in whole steps."""

    block_q: int
    rows: int
    block_kv: int
    splits: int
    num_warps: int
    num_stages: int


def next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def num_sms() -> int:
    """Streaming multiprocessors of the default device; off the GPU, the 132 of the Hopper parts the
    kernel targets, so a CPU trace picks the launch shapes a GPU would."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return 132
    return int(getattr(dev, "core_count", 132) or 132)


def widest_block_q(head_dim: int, group: int) -> int:
    """New tokens per program such that rows = block_q x H/G stay near 128 (64 for D=256): past
    that the accumulator no longer fits in registers, so longer queries take several blocks."""
    return max(1, (128 if head_dim <= 128 else 64) // group)


def extend_block_q(num_tokens: int, batch: int, head_dim: int, group: int) -> int:
    """block_q of a ragged extend of T tokens over B requests: a power of two, at most the widest."""
    return min(next_pow2(-(-num_tokens // batch)), next_pow2(widest_block_q(head_dim, group)))


# Programs wanted per SM when a call splits the KV (flash-decoding); measured in NOTES.md.
PROGRAMS_PER_SM = 1


def choose(
    *,
    num_blocks: int,
    block_q: int,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    block_kv: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Config:
    """The launch shapes of one call, from static shapes only; whatever the caller set is kept.

    num_blocks: query blocks NB of the grid (`query_blocks.max_blocks`, B for decode); block_q: new
    tokens per block; group: H / G; pages_per_seq: Pmax, the page table's width.
    The KV step is 64 tokens (32 for D=256): a K and a V tile of 16 KiB each per pipeline stage.
    Decode is indifferent to steps of 32 to 256 tokens; prefill loses much of its rate at 128.
    Splits: `PROGRAMS_PER_SM` programs for every SM (memory-bound decode needs many loads in
    flight), at most one per two KV steps of the widest context; each takes an equal share of
    the actual KV at run time.
    """
    rows = next_pow2(max(16, block_q * group))
    if block_kv is None:
        block_kv = 32 if head_dim >= 256 else 64
    kv_tokens = pages_per_seq * page_size
    if splits is None:
        programs = max(1, num_blocks * num_kv_heads)
        want = max(1, math.ceil(PROGRAMS_PER_SM * num_sms() / programs))
        most = max(1, kv_tokens // (2 * block_kv))
        splits = min(next_pow2(want), next_pow2(most) if most > 1 else 1)
        if rows >= 128:  # prefill-sized programs are plentiful and compute-bound
            splits = 1
    if num_warps is None:
        # 4 warps up to a 128 x 128 tile: 8 were slower for both causal prefill and decode.
        num_warps = 4 if rows * head_dim <= 128 * 128 else 8
    if num_stages is None:
        # Decode (<= 16 rows): 4 stages beat 3 even though they leave room for one program per SM
        # only: the page-id -> K/V load chain needs the depth. Prefill: 3 stages (2 a little slower).
        num_stages = 4 if rows <= 16 else 3
    return Config(block_q, rows, block_kv, max(1, splits), num_warps, num_stages)


# ----------------------------------------------------------------------------- the kernel

LOG2E = math.log2(math.e)
MODE_CODES = {"causal": 0, "tree": 1, "full": 2}


def _kernel(
    blk_req_ref,  # [NB] request of each query block (B = unused block)
    blk_q0_ref,  # [NB] first new-token index of the block within its request
    cu_q_ref,  # [B + 1]
    seq_lens_ref,  # [B]
    page_table_ref,  # [B, Pmax]
    tree_ref,  # [B, N, W] int32 bit-packed tree mask (unused unless mode is tree)
    q_ref,  # [T, H, D]
    k_ref,  # [P * L, G, D] (pages flattened into slots)
    v_ref,  # [P * L, G, D]
    *refs,  # o [M, D] block of [NB, G, S, M, D], then stats; with has_init: o0, lse0, seg, stop, o
    mode: int,
    cfg: Config,
    group: int,
    page_size: int,
    scale_log2: float,
    exact_f32: bool,
    has_init: bool,
):
    # stat_refs: ([M] max, [M] sum) blocks when splits > 1. With has_init: o0 [T, H, D], lse0
    # [S, H, T'], seg [B] and stop [B] in (`attention_blocks`), and o the whole [T, H, D] array,
    # which aliases o0 (written in place).
    (o0_ref, lse0_ref, seg_ref, stop_ref, o_ref, *stat_refs) = refs if has_init else (None,) * 4 + tuple(refs)
    i, g, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    batch, pages_per_seq = page_table_ref.shape
    num_slots = k_ref.shape[0]
    num_tokens = q_ref.shape[0]
    rows, block_kv = cfg.rows, cfg.block_kv

    b_raw = blk_req_ref[i]
    live = b_raw < batch
    b = jnp.minimum(b_raw, batch - 1)
    q_start = cu_q_ref[b]
    q_len = cu_q_ref[b + 1] - q_start
    seq_len = jnp.where(live, seq_lens_ref[b], 0)
    prefix = seq_len - q_len
    # Keys this call reads stop here: the whole KV, or (init) where the init's keys take over.
    seq_cut = jnp.minimum(seq_len, stop_ref[b]) if has_init else seq_len
    j0 = blk_q0_ref[i]

    r = jnp.arange(rows, dtype=jnp.int32)
    j_row = j0 + r // group  # new-token index of each row
    if has_init:  # rows past the request's tokens repeat the block's first token (same q, same
        # position), so their in-place writes carry the same values as that row's own
        j_row = jnp.where(j_row < q_len, j_row, j0)
    head = g * group + r % group
    tok = jnp.clip(q_start + j_row, 0, num_tokens - 1)
    q = q_ref[tok, head, :]  # [M, D]
    q_pos = prefix + j_row  # each row's own KV index

    # KV extent of this block, then of this split.
    if mode == MODE_CODES["causal"]:
        kv_end = jnp.minimum(seq_cut, prefix + j0 + cfg.block_q)
        free_end = prefix + j0 + 1  # every row sees [0, first row's own index] (steps past kv_end: none)
    elif mode == MODE_CODES["tree"]:
        kv_end, free_end = seq_len, prefix
    else:
        kv_end, free_end = seq_len, seq_len
    # Splits share the actual KV (not the page table's width, which is the longest context the
    # engine allows), so every split of a short request has work; shares are whole KV steps.
    share = (kv_end + cfg.splits * block_kv - 1) // (cfg.splits * block_kv) * block_kv
    lo = s * share
    hi = jnp.minimum(lo + share, kv_end)
    n_steps = jnp.maximum(hi - lo + block_kv - 1, 0) // block_kv
    n_free = jnp.clip(jnp.maximum(jnp.minimum(free_end, hi) - lo, 0) // block_kv, 0, n_steps)

    if mode == MODE_CODES["tree"]:
        n_new = tree_ref.shape[1]
        j_tree = jnp.clip(j_row, 0, n_new - 1)
        words = [tree_ref[b, j_tree, w] for w in range(tree_ref.shape[2])]  # each [M]

    col = jnp.arange(block_kv, dtype=jnp.int32)
    # fp32 caches ask for IEEE products (Triton would use tf32); bf16 takes the default.
    precision = lax.Precision.HIGHEST if exact_f32 else None

    def matmul(a, b, contract_b):  # [M, K] x b -> [M, N] in f32, b contracted on axis contract_b
        return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)

    def load_kv(start):
        c = start + col
        page = page_table_ref[b, jnp.minimum(c // page_size, pages_per_seq - 1)]
        slot = jnp.clip(page, 0, num_slots // page_size - 1) * page_size + c % page_size
        return c, k_ref[slot, g, :], v_ref[slot, g, :]  # [BK], [BK, D], [BK, D]

    def softmax_step(carry, logits, v):
        acc, m, l = carry
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # fully masked row: keep p = 0, not NaN
        p = jnp.exp2(logits - m_use[:, None])
        alpha = jnp.exp2(m - m_use)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + matmul(p.astype(v.dtype), v, 0)
        return acc, m_new, l

    def free_body(step, carry):
        _, k, v = load_kv(lo + step * block_kv)
        logits = matmul(q, k, 1) * scale_log2
        return softmax_step(carry, logits, v)

    def masked_body(step, carry):
        c, k, v = load_kv(lo + step * block_kv)
        in_seq = c < seq_cut  # [BK]
        if mode == MODE_CODES["causal"]:
            ok = (c[None, :] <= q_pos[:, None]) & in_seq[None, :]
        elif mode == MODE_CODES["tree"]:
            rel = c - prefix
            rel_c = jnp.clip(rel, 0, n_new - 1)
            word = words[0][:, None]
            for w in range(1, len(words)):
                word = jnp.where((rel_c >> 5)[None, :] == w, words[w][:, None], word)
            bit = (word >> (rel_c & 31)[None, :]) & 1
            ok = ((rel < 0)[None, :] | ((rel < n_new)[None, :] & (bit != 0))) & in_seq[None, :]
        else:
            ok = jnp.broadcast_to(in_seq[None, :], (rows, block_kv))
        logits = matmul(q, k, 1) * scale_log2
        logits = jnp.where(ok, logits, -jnp.inf)
        v = jnp.where(in_seq[:, None], v, jnp.zeros_like(v))
        return softmax_step(carry, logits, v)

    def walk(carry):
        carry = lax.fori_loop(0, n_free, free_body, carry)
        return lax.fori_loop(n_free, n_steps, masked_body, carry)

    if has_init:  # resume another kernel's softmax over other keys: its rows at m = lse, l = 1
        seg = seg_ref[b]

        @pl.when(live & (n_steps > 0))  # a block with no keys here keeps o0's rows: no traffic
        def _():
            lse0 = lse0_ref[jnp.maximum(seg, 0), head, jnp.minimum(j_row, lse0_ref.shape[2] - 1)]
            lse0 = jnp.where(seg >= 0, lse0 * LOG2E, -jnp.inf)  # [M], to the log2 domain used here
            seen = lse0 > -jnp.inf  # False for rows that saw nothing there (-inf or NaN)
            acc, _, l = walk((
                jnp.where(seen[:, None], o0_ref[tok, head, :].astype(jnp.float32), 0.0),
                jnp.where(seen, lse0, -jnp.inf),
                jnp.where(seen, 1.0, 0.0),
            ))
            o_ref[tok, head, :] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)

        # Zeros, as the reference gives them, for a request with no KV and for padding tokens: an
        # unused block's q0 counts from the end of the requests' tokens (`prefill.py`).
        pad_start = cu_q_ref[batch] + j0

        @pl.when((live & (seq_len == 0)) | (jnp.logical_not(live) & (pad_start < num_tokens)))
        def _():
            row = jnp.where(live, tok, jnp.minimum(pad_start + r // group, num_tokens - 1))
            o_ref[row, head, :] = jnp.zeros((rows, q.shape[-1]), o_ref.dtype)
        return

    acc, m, l = walk((
        jnp.zeros((rows, q.shape[-1]), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    ))
    if stat_refs:
        m_ref, l_ref = stat_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def attention_blocks(
    q,
    k_pages,
    v_pages,
    page_table,
    seq_lens,
    cu_q_lens,
    blk_req,
    blk_q0,
    tree_words,
    *,
    mode: str,
    cfg: Config,
    sm_scale: float,
    interpret: bool,
    init=None,
):
    """Run the kernel over query blocks. Returns `o [NB, G, S, M, D]` and, when S > 1, the
    row max and sum `[NB, G, S, M]` (log2 domain); with S == 1, `o` is final and in q's dtype.

    init: `(o0 [T, H, D], lse0 [S, H, T'] float32, seg [B] int32, stop [B] int32)` with mode
    "causal" and one split: each token's attention over keys this call does not read, and its
    natural-log log-sum-exp at `lse0[seg[b], h, j]` for new token j of request b (cuDNN's
    per-segment layout; seg -1 or -inf: no such keys), and per request the KV index where those
    keys begin (this call reads keys below it only). The online softmax starts from them, so the
    result covers both key sets; it comes back as `[T, H, D]` written into o0's buffer (rows of
    blocks with no keys here stay o0's), with zeros for requests of KV length 0 and for padding
    tokens, which unused blocks (request B) cover from `blk_q0` counted past the last request."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    nb = blk_req.shape[0]
    grid = (nb, num_kv_heads, cfg.splits)
    split = cfg.splits > 1

    out_dtype = jnp.float32 if split else q.dtype
    out_shape = [jax.ShapeDtypeStruct((nb, num_kv_heads, cfg.splits, cfg.rows, head_dim), out_dtype)]
    out_specs = [pl.BlockSpec((None, None, None, cfg.rows, head_dim), lambda i, g, s: (i, g, s, 0, 0))]
    if split:
        stat = jax.ShapeDtypeStruct((nb, num_kv_heads, cfg.splits, cfg.rows), jnp.float32)
        stat_spec = pl.BlockSpec((None, None, None, cfg.rows), lambda i, g, s: (i, g, s, 0))
        out_shape += [stat, stat]
        out_specs += [stat_spec, stat_spec]

    kernel = functools.partial(
        _kernel,
        mode=MODE_CODES[mode],
        cfg=cfg,
        group=group,
        page_size=page_size,
        scale_log2=float(sm_scale) * LOG2E,
        exact_f32=jnp.dtype(q.dtype) == jnp.float32,
        has_init=init is not None,
    )
    extra, aliases = (), {}
    if init is not None:
        if cfg.splits > 1 or mode != "causal":
            raise ValueError(f"attention_blocks: init needs mode 'causal' and one split, got {mode!r}, {cfg.splits}")
        extra = (init[0], init[1].astype(jnp.float32), init[2].astype(jnp.int32), init[3].astype(jnp.int32))
        aliases = {9: 0}  # o0 (input 9) is the output
        out_shape, out_specs = [jax.ShapeDtypeStruct(init[0].shape, init[0].dtype)], [pl.no_block_spec]
    params = {}
    if not interpret and _TritonParams is not None:
        params["compiler_params"] = _TritonParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        out_specs=out_specs,
        input_output_aliases=aliases,
        interpret=interpret,
        name=f"paged_attention_{mode}",
        **params,
    )(
        blk_req,
        blk_q0,
        cu_q_lens.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        page_table.astype(jnp.int32),
        tree_words,
        q,
        k_pages.reshape(flat),
        v_pages.reshape(flat),
        *extra,
    )
    return outs if split else (outs[0], None, None)
