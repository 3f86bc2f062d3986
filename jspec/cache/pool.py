"""The device pools a model's steps read and write, and how big they are: the one owner of both.

- `Caches`: the paged KV pool (one K and one V array per attention layer) and the Gated-DeltaNet
  state pool (one conv window and one recurrent state array per GDN layer, indexed by request slot).
  A plain pytree, so a jitted step takes it as an argument and donates it.
- `allocate_caches`: zeroed pools for a model config.
- `PoolLayout` / `size_pools`: how many pages and slots an engine gets, decided once at start-up from
  the engine's limits (or, on a device with a memory limit, by `memory.plan_pages`). The host
  allocators (`allocator.py`) then account for exactly these pages and slots.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jspec.errors import ConfigError
from jspec.sharding import TP, kv_heads


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Caches:
    """kv[i] = (k_pages, v_pages) `[P, L, G, D]` for the i-th attention layer;
    conv[j] `[S, C, K-1]` and ssm[j] `[S, Hv, dk, dv]` (float32) for the j-th GDN layer, S = slots."""

    kv: list
    conv: list
    ssm: list


def allocate_caches(config, *, num_pages: int, page_size: int, num_state_slots: int, dtype,
                    tp_size: int = 1) -> Caches:
    """Zeroed pools for a model config (its attention layers and GDN layers); tp_size: of a target
    split that many ways, whose KV heads are replicated when fewer than tp (`jspec.sharding`)."""
    g, d = kv_heads(config.num_key_value_heads, tp_size), config.head_dim
    kv = [(jnp.zeros((num_pages, page_size, g, d), dtype), jnp.zeros((num_pages, page_size, g, d), dtype))
          for _ in config.attention_layer_ids]
    conv, ssm = [], []
    for _ in config.gdn_layer_ids:
        conv.append(jnp.zeros((num_state_slots, config.gdn_conv_dim, config.linear_conv_kernel_dim - 1), dtype))
        ssm.append(jnp.zeros((num_state_slots, config.linear_num_value_heads, config.linear_key_head_dim,
                              config.linear_value_head_dim), jnp.float32))
    return Caches(kv=kv, conv=conv, ssm=ssm)


def copy_state_rows(caches: Caches, src, dst) -> Caches:
    """Caches with row dst[i] of every GDN conv and recurrent state pool set to row src[i] (`[B]`
    each; dst < 0: nothing). The prefix cache's snapshots: a cached state into a request's slot,
    or a slot's state into a snapshot row."""
    def copy(pool):
        rows = pool.shape[0]
        return pool.at[jnp.where(dst >= 0, dst, rows)].set(pool[jnp.clip(src, 0, rows - 1)], mode="drop")

    return Caches(kv=caches.kv, conv=[copy(c) for c in caches.conv], ssm=[copy(s) for s in caches.ssm])


def pool_specs(caches: Caches) -> Caches:
    """PartitionSpecs of a split target's pools: KV pages by KV head, GDN conv windows by channel,
    recurrent states by value head (the splits of the layers that write them)."""
    return Caches(kv=[(P(None, None, TP, None), P(None, None, TP, None)) for _ in caches.kv],
                  conv=[P(None, TP, None) for _ in caches.conv],
                  ssm=[P(None, TP, None, None) for _ in caches.ssm])


def pool_shardings(caches: Caches, mesh, mixer_tp_size: int) -> Caches:
    """NamedShardings of a target's pools on mesh: split as `pool_specs` says when its token mixers
    are split (mixer_tp_size > 1), else whole on every device (replicated mixers, or one device)."""
    specs = pool_specs(caches) if mixer_tp_size > 1 else jax.tree.map(lambda _: P(), caches)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """num_pages includes the sink page; num_slots the sink slot. pages_per_seq: the width of a
    page-table row (the context length plus what a speculative step writes past it).
    num_snapshots: extra rows of the GDN state pool, past the slots, that hold the prefix cache's
    state snapshots (hybrid targets)."""

    page_size: int
    num_pages: int | None  # None until sized from the device's memory (`memory.plan_pages`)
    num_slots: int
    pages_per_seq: int
    num_snapshots: int = 0

    @property
    def snapshot_rows(self) -> list[int]:
        return list(range(self.num_slots, self.num_slots + self.num_snapshots))

    @property
    def pool_tokens(self) -> int:
        """Tokens of KV the usable pages hold (the sink page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def min_pages(self) -> int:
        """The smallest pool worth serving with, the sink page included: two pages (one page when a
        whole request fits one)."""
        return min(self.pages_per_seq, 2) + 1


def size_pools(*, page_size: int, context_length: int, kv_ahead: int, max_running_requests: int,
               max_total_tokens: int | None, from_device_memory: bool) -> PoolLayout:
    """Pages and slots for an engine.

    kv_ahead: KV indices past a request's length that a step may write (speculation), so a page-table
    row covers context_length + kv_ahead. max_total_tokens, when given, fixes the pool. Otherwise,
    with from_device_memory, num_pages is left None for `memory.plan_pages` to fill in once the
    weights are resident and the workspace is measured; without (a backend that reports no memory
    limit, the CPU), the pool holds four contexts (at least 8192 tokens)."""
    pages_per_seq = -(-(context_length + kv_ahead) // page_size)
    layout = PoolLayout(page_size=page_size, num_pages=None, num_slots=max_running_requests + 1,
                        pages_per_seq=pages_per_seq)
    if max_total_tokens is None:
        if from_device_memory:
            return layout
        max_total_tokens = max(4 * context_length, 8192) if context_length <= 8192 else context_length
    if max_total_tokens < 1:
        raise ConfigError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
    num_pages = -(-int(max_total_tokens) // page_size) + 1  # + the padding sink page
    if num_pages < layout.min_pages:
        raise ConfigError(f"max_total_tokens={max_total_tokens} gives a KV pool too small for one request "
                          f"({(num_pages - 1) * page_size} tokens)")
    return dataclasses.replace(layout, num_pages=num_pages)
