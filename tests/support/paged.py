"""Drive a model through the paged cache the way the engine will: several requests ragged in one
step, random non-contiguous pages, fixed (bucket) shapes with padding, page 0 and state slot 0 as
padding sinks, and every page / slot nobody owns poisoned with NaN so a wrong read shows up."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jspec.cache.pool import Caches
from jspec.models.batch import ForwardBatch, ForwardMode
from jspec.models.scoring import forward


class PagedHarness:
    def __init__(self, model, *, page_size=4, num_pages=64, num_slots=8, pages_per_seq=16, seed=0):
        cfg = model.config
        self.model, self.page_size, self.pages_per_seq = model, page_size, pages_per_seq
        self.rng = np.random.default_rng(seed)
        nan = jnp.nan
        kv_shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        kv = [(jnp.full(kv_shape, nan, model.dtype), jnp.full(kv_shape, nan, model.dtype))
              for _ in cfg.attention_layer_ids]
        conv = [jnp.full((num_slots, cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim - 1), nan, model.dtype)
                for _ in cfg.gdn_layer_ids]
        ssm = [jnp.full((num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim), nan, jnp.float32) for _ in cfg.gdn_layer_ids]
        self.caches = Caches(kv=kv, conv=conv, ssm=ssm)
        self.free_pages = list(self.rng.permutation(np.arange(1, num_pages)))  # page 0: sink
        self.free_slots = list(self.rng.permutation(np.arange(1, num_slots)))  # slot 0: sink
        self.pages: dict = {}
        self.slot: dict = {}
        self.length: dict = {}

    def _ensure_pages(self, sid, new_len):
        need = -(-new_len // self.page_size)
        while len(self.pages[sid]) < need:
            self.pages[sid].append(int(self.free_pages.pop()))

    def step(self, chunks: dict, *, num_tokens: int, batch_size: int, mode: ForwardMode = ForwardMode.EXTEND):
        """chunks: request id -> new token ids. Returns request id -> logits `[n, V]`."""
        ids, pos, slots_map, rows = [], [], [], []
        cu, seq_lens, table, state_slots, has_init = [0], [], [], [], []
        for sid, toks in chunks.items():
            if sid not in self.pages:
                self.pages[sid], self.slot[sid], self.length[sid] = [], int(self.free_slots.pop()), 0
            start = self.length[sid]
            end = start + len(toks)
            self._ensure_pages(sid, end)
            for i, tok in enumerate(toks):
                p = start + i
                ids.append(tok)
                pos.append(p)
                slots_map.append(self.pages[sid][p // self.page_size] * self.page_size + p % self.page_size)
            rows.append((sid, len(ids) - len(toks), len(ids)))
            cu.append(len(ids))
            seq_lens.append(end)
            row = self.pages[sid] + [0] * (self.pages_per_seq - len(self.pages[sid]))
            table.append(row)
            state_slots.append(self.slot[sid])
            has_init.append(start > 0)
            self.length[sid] = end
        n_real, b_real = len(ids), len(chunks)
        assert n_real <= num_tokens and b_real <= batch_size
        if mode is ForwardMode.DECODE:
            assert num_tokens == batch_size and n_real == b_real
        # Padding requests: no KV (seq_len 0), sink page and slot; in decode each still owns one token.
        for _ in range(batch_size - b_real):
            if mode is ForwardMode.DECODE:
                ids.append(0), pos.append(0), slots_map.append(-1)
                cu.append(cu[-1] + 1)
            else:
                cu.append(cu[-1])
            seq_lens.append(0), table.append([0] * self.pages_per_seq), state_slots.append(0)
            has_init.append(False)
        pad = num_tokens - len(ids)
        ids += [0] * pad
        pos += [0] * pad
        slots_map += [-1] * pad
        batch = ForwardBatch(
            input_ids=jnp.asarray(ids, jnp.int32), positions=jnp.asarray(pos, jnp.int32),
            seq_lens=jnp.asarray(seq_lens, jnp.int32), cu_q_lens=jnp.asarray(cu, jnp.int32),
            page_table=jnp.asarray(table, jnp.int32), slot_mapping=jnp.asarray(slots_map, jnp.int32),
            state_slots=jnp.asarray(state_slots, jnp.int32), has_initial_state=jnp.asarray(has_init, bool),
            mode=mode,
        )
        out, self.caches = forward(self.model, self.caches, batch)
        logits = np.asarray(out.logits)
        return {sid: logits[a:b] for sid, a, b in rows}
