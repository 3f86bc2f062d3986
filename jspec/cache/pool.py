"""The device pools a model's steps read and write, and how big they are: the one owner of both.

- `Caches`: the paged KV pool (one K and one V array per attention layer) and the Gated-DeltaNet
  state pool (one conv window and one recurrent state array per GDN layer, indexed by request slot).
  A plain pytree, so a jitted step takes it as an argument and donates it.
- `allocate_caches`: zeroed pools for a model config.
- `PoolLayout` / `size_pools`: how many pages and slots an engine gets, decided once at start-up from
  the engine's limits, the model's KV bytes per token and the device's memory. The host allocators
  (`allocator.py`) then account for exactly these pages and slots.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import ConfigError

# Device memory kept out of the pool for activations and XLA's workspace when sizing from free bytes.
RESERVED_BYTES = 1 << 30
DEFAULT_MEM_FRACTION = 0.85


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Caches:
    """kv[i] = (k_pages, v_pages) `[P, L, G, D]` for the i-th attention layer;
    conv[j] `[S, C, K-1]` and ssm[j] `[S, Hv, dk, dv]` (float32) for the j-th GDN layer, S = slots."""

    kv: list
    conv: list
    ssm: list


def allocate_caches(config, *, num_pages: int, page_size: int, num_state_slots: int, dtype) -> Caches:
    """Zeroed pools for a model config (its attention layers and GDN layers)."""
    g, d = config.num_key_value_heads, config.head_dim
    kv = [(jnp.zeros((num_pages, page_size, g, d), dtype), jnp.zeros((num_pages, page_size, g, d), dtype))
          for _ in config.attention_layer_ids]
    conv, ssm = [], []
    for _ in config.gdn_layer_ids:
        conv.append(jnp.zeros((num_state_slots, config.gdn_conv_dim, config.linear_conv_kernel_dim - 1), dtype))
        ssm.append(jnp.zeros((num_state_slots, config.linear_num_value_heads, config.linear_key_head_dim,
                              config.linear_value_head_dim), jnp.float32))
    return Caches(kv=kv, conv=conv, ssm=ssm)


def kv_elements_per_token(config) -> int:
    """K and V elements one token occupies across a model's attention layers."""
    return 2 * len(config.attention_layer_ids) * config.num_key_value_heads * config.head_dim


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """num_pages includes the sink page; num_slots the sink slot. pages_per_seq: the width of a
    page-table row (the context length plus what a speculative step writes past it)."""

    page_size: int
    num_pages: int
    num_slots: int
    pages_per_seq: int

    @property
    def pool_tokens(self) -> int:
        """Tokens of KV the usable pages hold (the sink page excluded)."""
        return (self.num_pages - 1) * self.page_size


def device_free_bytes() -> int | None:
    """Free bytes of the first device, or None where the backend reports no limit (CPU)."""
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - CPU backends have none
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def checkpoint_bytes(path) -> int:
    """Bytes of a checkpoint's safetensors files: the weights before they are resident."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def size_pools(*, page_size: int, context_length: int, kv_ahead: int, max_running_requests: int,
               max_total_tokens: int | None, kv_bytes_per_token: int, weight_bytes: int,
               mem_fraction_static: float | None) -> PoolLayout:
    """Pages and slots for an engine.

    kv_ahead: KV indices past a request's length that a step may write (speculation), so a page-table
    row covers context_length + kv_ahead. max_total_tokens, when given, fixes the pool; otherwise it
    takes mem_fraction_static of the device's free bytes less the weights and a reserve, and on a
    backend without a memory limit (CPU) room for four contexts (at least 8192 tokens)."""
    pages_per_seq = -(-(context_length + kv_ahead) // page_size)
    if max_total_tokens is None:
        free = device_free_bytes()
        if free is None:
            max_total_tokens = max(4 * context_length, 8192) if context_length <= 8192 else context_length
        else:
            frac = mem_fraction_static or DEFAULT_MEM_FRACTION
            budget = int(free * frac) - weight_bytes - RESERVED_BYTES
            max_total_tokens = max(budget // max(kv_bytes_per_token, 1), page_size * 2)
    if max_total_tokens < 1:
        raise ConfigError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
    num_pages = -(-int(max_total_tokens) // page_size) + 1  # + the padding sink page
    usable = (num_pages - 1) * page_size
    if usable < min(context_length, 2 * page_size):
        raise ConfigError(f"max_total_tokens={max_total_tokens} gives a KV pool too small for one request "
                          f"({usable} tokens)")
    return PoolLayout(page_size=page_size, num_pages=num_pages, num_slots=max_running_requests + 1,
                      pages_per_seq=pages_per_seq)


def dtype_bytes(dtype) -> int:
    return np.dtype(dtype).itemsize
