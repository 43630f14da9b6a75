"""Pure-jnp, sort-based, dropless MoE dispatch with fp32 accumulation.

Legend: T tokens, K top-k, D hidden, E experts, M = T*K routed rows, N output width.
Memory is linear in tokens: the grouped GEMM runs over row tiles that each belong to one
expert (groups padded to the tile), never building an [M, E, N] or [T, E, D] temporary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def permute_reference(x, topk_ids, num_experts):
    """Sort token copies by expert.

    Args:
      x: [T, D]; topk_ids: [T, K] int32 in [0, num_experts).
    Returns:
      x_sorted [T*K, D] (rows grouped by expert, stable within an expert), group_sizes [E] int32,
      perm [T*K] int32: sorted row i holds flat routed slot perm[i] = t*K + k.
    """
    T, K = topk_ids.shape
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    perm = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    x_sorted = jnp.take(x, perm // K, axis=0)
    return x_sorted, group_sizes, perm


def grouped_matmul_reference(x, w, group_sizes, *, tile=64, preferred_element_type=None):
    """y[i] = x[i] @ w[g(i)] where rows are grouped consecutively by `group_sizes`.

    Args:
      x: [M, K]; w: [E, K, N]; group_sizes: [E] int32 with sum <= M (rows past the sum give 0).
    Returns:
      [M, N] in `preferred_element_type` (default x.dtype); products accumulated in fp32.
    """
    M, Kd = x.shape
    E, _, N = w.shape
    out_dtype = preferred_element_type or x.dtype
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    rows = jnp.arange(M, dtype=jnp.int32)
    row_group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # E for unused rows
    padded = (gs + tile - 1) // tile * tile
    pad_ends = jnp.cumsum(padded)
    pad_starts = pad_ends - padded
    num_tiles = -(-M // tile) + E
    g = jnp.minimum(row_group, E - 1)
    dest = jnp.where(row_group < E, pad_starts[g] + rows - starts[g], num_tiles * tile)
    xp = jnp.zeros((num_tiles * tile, Kd), x.dtype).at[dest].set(x, mode="drop")
    tile_group = jnp.searchsorted(pad_ends, jnp.arange(num_tiles, dtype=jnp.int32) * tile, side="right")
    tile_group = jnp.minimum(tile_group, E - 1).astype(jnp.int32)

    def one(args):
        xt, gi = args
        return jnp.dot(xt, w[gi], preferred_element_type=jnp.float32)

    yp = jax.lax.map(one, (xp.reshape(num_tiles, tile, Kd), tile_group), batch_size=8)
    yp = yp.reshape(num_tiles * tile, N)
    y = jnp.take(yp, jnp.minimum(dest, num_tiles * tile - 1), axis=0)
    y = jnp.where((row_group < E)[:, None], y, 0.0)
    return y.astype(out_dtype)


def unpermute_reference(y, perm, topk_weights):
    """Weighted combine back to token order: out[t] = sum_k w[t, k] * y[slot(t, k)] (fp32 sum).

    Args:
      y: [T*K, N] sorted rows; perm: [T*K] from `permute_reference`; topk_weights: [T, K].
    Returns:
      [T, N] in y.dtype.
    """
    T, K = topk_weights.shape
    inv = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))
    y_tok = jnp.take(y, inv, axis=0).reshape(T, K, -1).astype(jnp.float32)
    out = jnp.einsum("tkn,tk->tn", y_tok, topk_weights.astype(jnp.float32))
    return out.astype(y.dtype)
