"""Pure-jnp, sort-based, dropless MoE dispatch with fp32 accumulation.

Legend: T tokens, K top-k, D hidden, E experts, M = T*K routed rows, N output width.
Memory is linear in tokens: the grouped GEMMs run over row tiles that each belong to one
expert (groups padded to the tile), never building an [M, E, N] or [T, E, D] temporary.

Maths: the dropless "sort, grouped GEMM, weighted combine" scheme of MegaBlocks
(Gale et al. 2022, arXiv 2211.15841, sec. 5) with DeepSeekMoE routing (arXiv 2401.06066,
eq. 3-5): out[t] = sum_k w[t, k] * FFN_{e(t, k)}(x[t]).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def inverse_permutation(perm):
    """perm [M] int32, a permutation of 0..M-1 -> inv [M] with inv[perm[i]] = i."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype), unique_indices=True)


def permute_reference(x, topk_ids, num_experts):
    """Sort token copies by expert.

    Args:
      x: [T, D]; topk_ids: [T, K] int in [0, num_experts).
    Returns:
      x_sorted [T*K, D] (rows grouped by expert, stable within an expert), group_sizes [E] int32,
      perm [T*K] int32: sorted row i holds flat routed slot perm[i] = t*K + k.
    """
    K = topk_ids.shape[1]
    group_sizes, perm = sort_by_expert(topk_ids, num_experts)
    x_sorted = jnp.take(x, perm // K, axis=0)
    return x_sorted, group_sizes, perm


def sort_by_expert(topk_ids, num_experts):
    """topk_ids [T, K] int -> (group_sizes [E] int32, perm [T*K] int32), stable sort by expert."""
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    perm = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return group_sizes, perm


def _tile_layout(group_sizes, M, tile):
    """Row -> padded-tile layout shared by the two grouped GEMMs (all int32).

    Each group's rows are copied to a slab that starts on a tile boundary, so every tile of
    `tile` rows belongs to exactly one group. Returns (dest [M] padded row of each row, or
    num_tiles*tile for rows past sum(group_sizes); tile_group [num_tiles]; num_tiles).
    """
    E = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    rows = jnp.arange(M, dtype=jnp.int32)
    row_group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # E: unused row
    padded = (gs + tile - 1) // tile * tile
    pad_ends = jnp.cumsum(padded)
    pad_starts = pad_ends - padded
    num_tiles = -(-M // tile) + E
    g = jnp.minimum(row_group, E - 1)
    dest = jnp.where(row_group < E, pad_starts[g] + rows - starts[g], num_tiles * tile)
    tile_group = jnp.searchsorted(pad_ends, jnp.arange(num_tiles, dtype=jnp.int32) * tile,
                                  side="right")
    tile_group = jnp.minimum(tile_group, E - 1).astype(jnp.int32)
    return dest, tile_group, num_tiles


def grouped_matmul_reference(x, w, group_sizes, *, tile=64, preferred_element_type=None):
    """y[i] = x[i] @ w[g(i)] where rows are grouped consecutively by `group_sizes`.

    Args:
      x: [M, K]; w: [E, K, N]; group_sizes: [E] int with sum <= M (rows past the sum give 0).
    Returns:
      [M, N] in `preferred_element_type` (default x.dtype); products accumulated in fp32.
    """
    M, Kd = x.shape
    N = w.shape[2]
    out_dtype = preferred_element_type or x.dtype
    dest, tile_group, num_tiles = _tile_layout(group_sizes, M, tile)
    xp = jnp.zeros((num_tiles * tile, Kd), x.dtype).at[dest].set(x, mode="drop")

    def one(args):
        xt, gi = args
        return jnp.dot(xt, w[gi], preferred_element_type=jnp.float32)

    yp = jax.lax.map(one, (xp.reshape(num_tiles, tile, Kd), tile_group), batch_size=8)
    yp = yp.reshape(num_tiles * tile, N)
    y = jnp.take(yp, jnp.minimum(dest, num_tiles * tile - 1), axis=0)
    y = jnp.where((dest < num_tiles * tile)[:, None], y, 0.0)
    return y.astype(out_dtype)


def grouped_matmul_transposed_reference(x, dy, group_sizes, *, tile=64,
                                        preferred_element_type=None):
    """Weight gradient of the grouped GEMM: dw[e] = x[rows of e]^T @ dy[rows of e].

    Args:
      x: [M, K]; dy: [M, N]; group_sizes: [E] int with sum <= M (rows past the sum ignored).
    Returns:
      [E, K, N] in `preferred_element_type` (default x.dtype), fp32 accumulation; experts with
      no rows get zeros. Memory: one [E, K, N] fp32 accumulator plus the padded inputs.
    """
    M, Kd = x.shape
    N = dy.shape[1]
    E = group_sizes.shape[0]
    out_dtype = preferred_element_type or x.dtype
    dest, tile_group, num_tiles = _tile_layout(group_sizes, M, tile)
    xp = jnp.zeros((num_tiles * tile, Kd), x.dtype).at[dest].set(x, mode="drop")
    dyp = jnp.zeros((num_tiles * tile, N), dy.dtype).at[dest].set(dy, mode="drop")

    def step(acc, args):
        xt, dyt, gi = args
        upd = jnp.dot(xt.T, dyt, preferred_element_type=jnp.float32)
        return acc.at[gi].add(upd), None

    acc0 = jnp.zeros((E, Kd, N), jnp.float32)
    acc, _ = jax.lax.scan(step, acc0, (xp.reshape(num_tiles, tile, Kd),
                                       dyp.reshape(num_tiles, tile, N), tile_group))
    return acc.astype(out_dtype)


def unpermute_reference(y, perm, topk_weights):
    """Weighted combine back to token order: out[t] = sum_k w[t, k] * y[slot(t, k)] (fp32 sum).

    Args:
      y: [T*K, N] sorted rows; perm: [T*K] from `permute_reference`; topk_weights: [T, K].
    Returns:
      [T, N] in y.dtype.
    """
    T, K = topk_weights.shape
    inv = inverse_permutation(perm)
    y_tok = jnp.take(y, inv, axis=0).reshape(T, K, -1).astype(jnp.float32)
    out = jnp.einsum("tkn,tk->tn", y_tok, topk_weights.astype(jnp.float32))
    return out.astype(y.dtype)
