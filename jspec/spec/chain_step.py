"""One speculative decode step for a chain drafter, greedy: a draft model (STANDALONE) or draft
tokens proposed on the host (NGRAM).

Everything on device, one jitted function per batch bucket:
1. draft: S + 1 decode forwards of the draft model from each request's last token (the last one
   only writes the draft KV of the S-th draft token, so a fully accepted chain leaves the draft
   cache complete);
2. verify: one target forward over [last, d1 .. dS] at positions L0 .. L0+S (causal extend);
3. accept: greedy rows keep d(j+1) while it equals the target's argmax at j, and the argmax after
   the last kept token is the bonus; sampling rows use speculative (rejection) sampling, which
   keeps the target distribution exactly: d(j+1) ~ q(j+1) is kept with probability
   min(1, p(j)[d] / q(j+1)[d]); at the first rejection the bonus is drawn from
   normalise(max(p(j) - q(j+1), 0)), and after a fully kept chain from p(S). p and q are the
   filtered distributions (temperature, top-k, top-p, min-p) of target and drafter; a host
   (NGRAM) proposal is a point mass q = one-hot(d);
4. the bonus becomes the request's next input (`last_token`); KV written for rejected tokens lies
   past the new length and is overwritten by the next step before anything reads it.
Output row: [number of tokens produced (n + 1), tokens..., -1 padding].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.models.batch import ForwardBatch
from jspec.runtime import sampler as sampling
from jspec.runtime.step import DeviceState, _apply_page_updates
from jspec.runtime.step_inputs import Bucket


def make_chain_spec_step(graphdef, draft_graphdef, bucket: Bucket, *, page_size: int, num_steps: int):
    b_cap, s = bucket.batch_size, num_steps

    def step(params, state: DeviceState, packed):
        # With a draft model params is (target, draft); host-drafted (NGRAM) steps get the target's.
        target_params, draft_params = params if draft_graphdef is not None else (params, None)
        x = bucket.unpack(packed)
        req_to_page = _apply_page_updates(state.req_to_page, x["page_updates"])
        slots = x["req_slots"]
        valid = x["seq_lens"] > 0  # padding rows carry seq_len 0
        l0 = x["positions"][:b_cap]  # position of each request's last token (not yet in the KV)
        page_table = req_to_page[slots]
        sb = sampling.SamplingBatch(
            temperature=x["temperature"], top_p=x["top_p"], top_k=x["top_k"], min_p=x["min_p"],
            repetition_penalty=x["repetition_penalty"], frequency_penalty=x["frequency_penalty"],
            presence_penalty=x["presence_penalty"], seed=x["seeds"], step=x["out_index"],
        )
        greedy = x["temperature"] < sampling.GREEDY_TEMPERATURE

        def row_keys(k: int):
            # One stream per request, indexed by (index of the step's first output, use k): the
            # same tokens whatever else is in the batch.
            return jax.vmap(lambda sd, st: sampling._row_key(sd, st * (2 * s + 2) + k))(x["seeds"], x["out_index"])

        def slot_mapping(pos, row_valid):  # pos [B] -> flat KV slot, -1 for padding rows
            page = jnp.take_along_axis(page_table, (pos // page_size)[:, None], axis=1)[:, 0]
            return jnp.where(row_valid, page * page_size + pos % page_size, -1)

        def _draft_chain(draft_gd, dparams):
            nonlocal dcaches
            draft = nnx.merge(draft_gd, dparams)
            tok = state.last_token[slots]
            drafts = []
            for k in range(s + 1):
                pos = l0 + k
                batch = ForwardBatch(
                    input_ids=tok, positions=pos, seq_lens=jnp.where(valid, pos + 1, 0),
                    cu_q_lens=jnp.arange(b_cap + 1, dtype=jnp.int32), page_table=page_table,
                    slot_mapping=slot_mapping(pos, valid), state_slots=slots, has_initial_state=valid,
                    mode="decode",
                )
                out, dcaches = draft(batch, dcaches, compute_logits=k < s)
                if k < s:
                    q = sampling.filtered_probs(out.logits, sb, sort=bucket.sort)  # [B, V]
                    drawn = jax.vmap(jax.random.categorical)(row_keys(k), jnp.log(q))
                    tok = jnp.where(greedy, jnp.argmax(out.logits, axis=-1), drawn).astype(jnp.int32)
                    drafts.append(tok)
                    qs.append(q)
            return jnp.stack(drafts, axis=1)  # [B, S]

        # 1. Draft, autoregressively, one token per request per forward (or proposed by the host).
        dcaches = state.draft_caches
        qs = []
        if draft_graphdef is None:
            d = x["draft_tokens"]
            q_all = None  # point masses at the host's proposals
        else:
            d = _draft_chain(draft_graphdef, draft_params)
            q_all = jnp.stack(qs, axis=1)  # [B, S, V]

        # 2. Verify all S + 1 tokens of every request in one target forward.
        last = state.last_token[slots]
        vt = jnp.concatenate([last[:, None], d], axis=1)  # [B, S+1]
        vpos = l0[:, None] + jnp.arange(s + 1, dtype=jnp.int32)[None, :]
        vmap_slots = jnp.take_along_axis(page_table, vpos // page_size, axis=1) * page_size + vpos % page_size
        vslots = jnp.where(valid[:, None], vmap_slots, -1)
        batch = ForwardBatch(
            input_ids=vt.reshape(-1), positions=vpos.reshape(-1), seq_lens=jnp.where(valid, l0 + s + 1, 0),
            cu_q_lens=(jnp.arange(b_cap + 1, dtype=jnp.int32) * (s + 1)), page_table=page_table,
            slot_mapping=vslots.reshape(-1), state_slots=slots, has_initial_state=valid, mode="extend",
        )
        target = nnx.merge(graphdef, target_params)
        out, caches = target(batch, state.caches)
        a = jnp.argmax(out.logits, axis=-1).astype(jnp.int32).reshape(b_cap, s + 1)

        # 3a. Greedy acceptance along the chain.
        n_greedy = jnp.sum(jnp.cumprod((d == a[:, :s]).astype(jnp.int32), axis=1), axis=1)  # [B] in 0..S
        bonus_greedy = jnp.take_along_axis(a, n_greedy[:, None], axis=1)[:, 0]

        # 3b. Speculative sampling for the other rows.
        vocab = out.logits.shape[-1]
        rep = jax.tree_util.tree_map(lambda f: jnp.repeat(f, s + 1, axis=0), sb)
        p_all = sampling.filtered_probs(out.logits, rep, sort=bucket.sort).reshape(b_cap, s + 1, vocab)
        p_d = jnp.take_along_axis(p_all[:, :s], d[:, :, None], axis=2)[:, :, 0]  # p(j)[d(j+1)]
        if q_all is None:
            q_d = jnp.ones_like(p_d)
        else:
            q_d = jnp.take_along_axis(q_all, d[:, :, None], axis=2)[:, :, 0]
        u = jnp.stack([jax.vmap(lambda kk: jax.random.uniform(kk))(row_keys(s + j)) for j in range(s)], axis=1)
        keep = u * q_d < p_d  # u < p / q without dividing by a possibly tiny q
        n_sample = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)
        p_n = jnp.take_along_axis(p_all, n_sample[:, None, None], axis=1)[:, 0]  # [B, V]
        if q_all is None:
            q_n = jax.nn.one_hot(jnp.take_along_axis(d, jnp.minimum(n_sample, s - 1)[:, None], axis=1)[:, 0], vocab)
        else:
            q_n = jnp.take_along_axis(q_all, jnp.minimum(n_sample, s - 1)[:, None, None], axis=1)[:, 0]
        residual = jnp.maximum(p_n - q_n, 0.0)
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        # After a fully kept chain the bonus comes from p(S) itself; a zero residual (p == q on the
        # support, so rejection had probability 0) falls back to p as well.
        use_p = (n_sample == s)[:, None] | (mass <= 0)
        r = jnp.where(use_p, p_n, residual / jnp.where(mass > 0, mass, 1.0))
        bonus_sample = jax.vmap(jax.random.categorical)(row_keys(2 * s + 1), jnp.log(r)).astype(jnp.int32)

        n = jnp.where(greedy, n_greedy, n_sample)
        bonus = jnp.where(greedy, bonus_greedy, bonus_sample)
        j = jnp.arange(s + 1)[None, :]
        d_pad = jnp.concatenate([d, jnp.zeros((b_cap, 1), jnp.int32)], axis=1)
        tokens = jnp.where(j < n[:, None], d_pad, jnp.where(j == n[:, None], bonus[:, None], -1))
        count = jnp.where(valid, n + 1, 0)

        oob = state.last_token.shape[0]
        last_token = state.last_token.at[jnp.where(valid, slots, oob)].set(bonus, mode="drop")
        new_state = DeviceState(caches=caches, req_to_page=req_to_page, last_token=last_token,
                                output_counts=state.output_counts, prompt_mask=state.prompt_mask,
                                draft_caches=dcaches)
        return new_state, jnp.concatenate([count[:, None], tokens], axis=1).astype(jnp.int32)

    return step
