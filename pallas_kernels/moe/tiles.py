"""Tile plans for the expert-tiled gather kernels: which (token, expert) pairs each program serves.

A tile is up to `block_m` pairs routed to ONE expert. A kernel program multiplies its tile's rows
(a `[block_m, Kd]` operand) by that expert's matrix, so the expert is read once per tile rather
than once per pair; `block_m` = 16 costs the same tensor-core instruction as one row padded to 16.

A plan is two int32 arrays, built on device with static shapes (no host sync):
    tile_expert  [NT]           the tile's expert, -1 for an unused tile
    tile_pairs   [NT, block_m]  the tile's pair ids p = t*K + k, -1 in padding rows
Every pair is in exactly one tile, and a used tile's live rows come first.

`pair_tiles`: one pair per tile (NT = P), in pair order: no device work at all. The right plan when
pairs rarely share an expert (one token's top-k experts are distinct).
`sorted_tiles`: pairs stably sorted by expert and each expert's run cut into tiles of `block_m`;
tiles numbered densely in expert order, the unused rest at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound NT on the tiles of `sorted_tiles`. An expert with n pairs takes ceil(n / block_m)
    <= n / block_m + 1 tiles, at most min(X, P) experts have pairs, and no tile is empty."""
    return min(pairs, -(-pairs // block_m) + min(num_experts, pairs))


def pair_tiles(experts, block_m: int):
    """One tile per pair: the plan of the per-pair kernel. experts: `[P]` int."""
    p = experts.shape[0]
    tile_pairs = jnp.full((p, block_m), -1, jnp.int32).at[:, 0].set(jnp.arange(p, dtype=jnp.int32))
    return experts.astype(jnp.int32), tile_pairs


def sorted_tiles(experts, num_experts: int, block_m: int):
    """Tiles of up to block_m pairs of one expert. experts: `[P]` int in [0, X)."""
    p = experts.shape[0]
    nt = max_tiles(p, num_experts, block_m)
    q = jnp.arange(p, dtype=jnp.int32)
    # One stable sort carries the pair ids along (argsort + a gather would be two passes).
    sorted_e, order = jax.lax.sort((experts.astype(jnp.int32), q), num_keys=1, is_stable=True)
    run_first = jnp.concatenate([jnp.ones((1,), bool), sorted_e[1:] != sorted_e[:-1]])
    local = q - jax.lax.cummax(jnp.where(run_first, q, 0), axis=0)  # position within the expert's run
    tile_first = local % block_m == 0
    tile = jnp.cumsum(tile_first.astype(jnp.int32)) - 1  # dense tile numbers, in expert order
    tile_pairs = jnp.full((nt, block_m), -1, jnp.int32).at[tile, local % block_m].set(order)
    # One write per tile (from its first pair); the others aim past the end and are dropped.
    tile_expert = jnp.full((nt,), -1, jnp.int32).at[jnp.where(tile_first, tile, nt)].set(sorted_e, mode="drop")
    return tile_expert, tile_pairs
