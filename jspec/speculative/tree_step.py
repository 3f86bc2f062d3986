"""The speculative decode step of a hidden-state drafter with a draft tree (topk K > 1).

Phases like `eagle_step.py` (read it first), but:
1. draft: depth 1 is the carried top-K; S - 1 drafter forwards expand it (`tree.py`). The
   forward for depth i runs over all kept nodes of depths 1..i (i * K tokens per request, KV
   indices L0 .. L0 + i*K - 1) with their ancestor mask, so every node attends exactly to the
   prompt, its ancestors and itself; its hidden input is its parent's output hidden. Re-running
   the shallower depths repeats identical work (the drafter is one layer) and keeps the attention
   a plain tree-masked extend;
2. verify the root plus the N - 1 best candidates with the tree mask (hybrid targets: the GDN
   verify kernels follow the same parents);
3. walk the tree (greedy or exact sampling), then move the accepted nodes' KV from their tree
   indices L0 + path[j] to L0 + j in every target layer, and commit the GDN state of the last
   accepted node;
4. extend the drafter over the accepted path, as for a chain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache.pool import Caches
from jspec.runtime.step_inputs import Bucket, SpecRows, kv_slots_at
from jspec.speculative import accept, grammar_nodes, tree, verify
from jspec.speculative.eagle_draft import catch_up, proposals
from jspec.speculative.step_common import Phase, SpecStep, begin, compose, penalised, snapshot_track, walk_parents


def move_kv(caches: Caches, page_table, l0, path, n, valid, page_size: int) -> Caches:
    """Copy the KV of accepted nodes path[j] (tree index) to index j, for j = 1..n, every layer."""
    b, s1 = path.shape
    j = jnp.arange(1, s1, dtype=jnp.int32)[None, :]
    src = kv_slots_at(page_table, l0[:, None] + path[:, 1:], page_size)
    dst = kv_slots_at(page_table, l0[:, None] + j, page_size)
    keep = valid[:, None] & (j <= n[:, None]) & (path[:, 1:] != j)
    src, dst = src.reshape(-1), jnp.where(keep, dst, -1).reshape(-1)
    kv = []
    for k_pages, v_pages in caches.kv:
        p, l = k_pages.shape[:2]

        def move(pages):
            flat = pages.reshape((p * l,) + pages.shape[2:])
            moved = flat[jnp.maximum(src, 0)]
            return flat.at[jnp.where(dst >= 0, dst, p * l)].set(moved, mode="drop").reshape(pages.shape)

        kv.append((move(k_pages), move(v_pages)))
    return Caches(kv=kv, conv=caches.conv, ssm=caches.ssm)


def phases(*, num_steps: int, topk: int, num_draft_tokens: int,
           simulate_accept_length: float | None = None) -> list[Phase]:
    s, k, n_nodes = num_steps, topk, num_draft_tokens
    pool_depth = np.concatenate([np.ones(k, np.int32)] + [np.full(k * k, d, np.int32) for d in range(2, s + 1)])

    def draft(c: SpecStep) -> None:
        # Kept nodes per depth: tokens [B, K], scores, pool index, parent (kept index among all
        # kept nodes so far, -1 = root), hidden input [B, K, E].
        b_cap, spec = c.batch_size, c.spec_state
        kept_tok, kept_score = spec["tokens"][c.slots], spec["logp"][c.slots]
        kept_pool = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b_cap, k))
        kept_parent = jnp.full((b_cap, k), -1, jnp.int32)
        root_hidden = spec["hidden"][c.slots]
        kept_hidden = jnp.broadcast_to(root_hidden[:, None], (b_cap, k, root_hidden.shape[-1]))
        pool_tok, pool_score = [kept_tok], [kept_score]
        pool_parent = [jnp.full((b_cap, k), -1, jnp.int32)]
        toks, parents, hiddens = [], [], []
        pool_base = k
        for depth in range(1, s):
            toks.append(kept_tok)
            parents.append(kept_parent)
            hiddens.append(kept_hidden)
            t_all = jnp.concatenate(toks, axis=1)  # [B, depth*K]
            par_all = jnp.concatenate(parents, axis=1)
            h_all = jnp.concatenate(hiddens, axis=1)
            m = t_all.shape[1]
            dep = jnp.broadcast_to(jnp.repeat(jnp.arange(depth, dtype=jnp.int32), k), (b_cap, m))
            batch = verify.verify_batch(t_all, c.l0, c.valid, c.page_table, c.slots, c.page_size, depth=dep,
                                        parents=par_all, tree_mask=tree.ancestor_mask(par_all))
            rows_new = (jnp.arange(b_cap)[:, None] * m + (m - k) + jnp.arange(k)[None, :]).reshape(-1)
            out, c.draft_caches = c.drafter(batch, c.draft_caches, h_all.reshape(b_cap * m, -1), target=c.target,
                                            logits_indices=rows_new)
            c_tok, c_lp = proposals(c.drafter, out, k, c.target)  # [B*K, K]
            c_tok, c_lp = c_tok.reshape(b_cap, k * k), c_lp.reshape(b_cap, k, k)
            c_score = (kept_score[:, :, None] + c_lp).reshape(b_cap, k * k)
            c_from = jnp.repeat(jnp.arange(k), k)[None, :]  # which kept node each child expands
            pool_tok.append(c_tok)
            pool_score.append(c_score)
            pool_parent.append(jnp.broadcast_to(jnp.take_along_axis(kept_pool, c_from, axis=1), (b_cap, k * k)))
            # Keep the K best children for the next expansion.
            best_score, best = jax.lax.top_k(c_score, k)
            from_kept = best // k
            kept_tok = jnp.take_along_axis(c_tok, best, axis=1)
            kept_score = best_score
            kept_parent = (depth - 1) * k + from_kept  # index among all kept nodes so far
            kept_pool = pool_base + best
            kept_hidden = jnp.take_along_axis(out.hidden.reshape(b_cap, k, -1), from_kept[:, :, None], axis=1)
            pool_base += k * k
        c.drafts, c.scratch["depth"], c.scratch["parents"] = tree.select(
            jnp.concatenate(pool_tok, axis=1), jnp.concatenate(pool_score, axis=1),
            jnp.concatenate(pool_parent, axis=1), pool_depth, n_nodes)

    def verify_(c: SpecStep) -> None:
        parents = c.scratch["parents"]
        vt = jnp.concatenate([c.last[:, None], c.drafts], axis=1)  # [B, N]
        vbatch = verify.verify_batch(vt, c.l0, c.valid, c.page_table, c.slots, c.page_size, depth=c.scratch["depth"],
                                     parents=parents, tree_mask=tree.ancestor_mask(parents))
        out, c.caches = c.target(vbatch, c.caches, capture_layers=c.drafter.capture_layers)
        c.scratch.update(out=out, vt=vt, logits=out.logits.reshape(c.batch_size, n_nodes, -1))

    def accept_(c: SpecStep) -> None:
        parents, vt = c.scratch["parents"], c.scratch["vt"]
        logits = penalised(c, c.scratch["logits"], vt, tree.ancestor_mask(parents), depth=c.scratch["depth"])
        if simulate_accept_length is None:
            path, c.n, c.bonus = tree.walk(logits, vt, walk_parents(c, parents), c.sb, c.greedy, c.key_fn, s,
                                           sort=c.bucket.sort, tp=c.target.tp_size)
        else:  # benchmark only: a forced number kept along the first-child path
            path = first_child_path(walk_parents(c, parents), s)
            limit = path_len(path) if "walk" not in c.scratch else grammar_nodes.path_limit(c.scratch["walk"], path)
            c.n, c.bonus = accept.simulated(jnp.take_along_axis(logits, path[:, :, None], axis=1), c.key_fn,
                                            simulate_accept_length, s, c.sb, c.greedy, sort=c.bucket.sort,
                                            limit=limit, tp=c.target.tp_size)
        # Move the accepted KV into place, commit the GDN state of the last accepted node.
        c.caches = move_kv(c.caches, c.page_table, c.l0, path, c.n, c.valid, c.page_size)
        last_node = jnp.take_along_axis(path, c.n[:, None], axis=1)[:, 0]
        c.caches = verify.commit(c.caches, c.scratch["out"].gdn_scratch, c.slots, jnp.where(c.valid, last_node, -1),
                                 parents, track=snapshot_track(c, path), tp=c.target.mixer_tp_size)
        c.kept = jnp.take_along_axis(vt, path, axis=1)[:, 1:]  # [B, S] accepted draft tokens (valid up to n)
        c.scratch["path"] = path
        c.scratch["path_logits"] = jnp.take_along_axis(logits, path[:, :, None], axis=1)  # [B, S+1, V]

    def extend(c: SpecStep) -> None:
        # The target's hidden gathered along the accepted path.
        b_cap = c.batch_size
        hidden = c.drafter.target_hidden(c.scratch["out"]).reshape(b_cap, n_nodes, -1)
        hidden = jnp.take_along_axis(hidden, c.scratch["path"][:, :, None], axis=1).reshape(b_cap * (s + 1), -1)
        c.draft_caches, c.spec_state = catch_up(c.drafter, c.target, c.draft_caches, c.spec_state, c.kept, c.n,
                                                c.bonus, hidden, c.l0, c.valid, c.page_table, c.slots, c.page_size)

    return [("draft", draft), ("verify", verify_), ("accept", accept_), ("extend", extend)]


def make_tree_spec_step(graphdef, draft_graphdef, bucket: Bucket, *, page_size: int, num_steps: int, topk: int,
                        num_draft_tokens: int, rows: SpecRows, simulate_accept_length: float | None = None,
                        full_steps: int | None = None):
    """full_steps: the configured depth when this tree is shallower (an adaptive variant): keys are
    counted as the full tree's."""
    full = num_steps if full_steps is None else full_steps
    start = begin(bucket, graphdef, draft_graphdef, page_size=page_size, num_keys=full + 1)
    return compose(start, phases(num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens,
                                 simulate_accept_length=simulate_accept_length), rows)


def first_child_path(parents, max_depth: int):
    """Root, its first child, that child's first child, ... (`[B, max_depth + 1]`, repeats at a leaf)."""
    b, n = parents.shape
    cur = jnp.zeros((b,), jnp.int32)
    path = [cur]
    for _ in range(max_depth):
        kids = parents == cur[:, None]
        has = jnp.any(kids, axis=1)
        cur = jnp.where(has, jnp.argmax(kids, axis=1).astype(jnp.int32), cur)
        path.append(cur)
    return jnp.stack(path, axis=1)


def path_len(path):
    """Number of distinct steps along a `first_child_path` (stops growing at a leaf)."""
    return jnp.sum((path[:, 1:] != path[:, :-1]).astype(jnp.int32), axis=1)
