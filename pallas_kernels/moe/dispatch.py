"""Fast MoE permute: a stable counting sort by expert and a Pallas Mosaic GPU row-scatter kernel.

Legend: T tokens, K top-k, D hidden, E experts, M = T*K routed rows, S sort block (rows),
B = cdiv(M, S) sort blocks, R tokens per CTA of the row kernel.

Counting sort (`counting_sort_by_expert`): gives exactly the `perm` of the stable argsort of
the flat expert ids (ties kept in slot order), plus `dest` = its inverse (sorted row of each
slot):
  dest[i] = start[e_i] + block_prefix[b_i, e_i] + rank_i
where start is the exclusive prefix sum of the expert counts, block_prefix the exclusive
prefix sum over blocks of the per-block counts [B, E], and rank_i the number of earlier rows
of i's block with the same expert. v3 ("compare") gets rank and the block counts from two
fused compare-and-sum reductions ([B, S, S] and [B, S, E] booleans, never materialised);
v2 ("matmul") from a one-hot [B, S, E] bf16 times the strictly lower-triangular [S, S] ones
matrix (0/1 operands, fp32 accumulation: exact). perm is dest scattered: perm[dest[i]] = i.

Row kernel (`scatter_rows`): out[dest[t, k]] = x[t]. Each CTA copies R consecutive token rows
GMEM -> SMEM with one bulk copy (cp.async.bulk, contiguous, no tensor map), then issues
K * R single-row bulk copies SMEM -> GMEM to their sorted rows. x is read once (T*D) and the
output written once (M*D): the fewest bytes, where a gather x[perm // K] reads each token row
K times. Many small CTAs per SM (R*D*itemsize ~ 16 KiB of SMEM each) hide the copy latency.
The last block is shifted back to end at row T (ragged T) and skips the rows the previous
block already stored.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.mosaic_gpu import on_hopper

SORT_BLOCK = 256
ROW_KERNEL_SMEM = 16 * 1024  # target SMEM bytes per CTA of the row kernel


def counting_sort_by_expert(topk_ids, num_experts, *, block=SORT_BLOCK, method="compare"):
    """Stable counting sort of routed slots by expert.

    Args:
      topk_ids: [T, K] int in [0, num_experts).
      block: S, rows per sort block (the rank-within-block work is M * S compares).
      method: "compare" (v3: rank within a block = number of earlier rows of the block with
        the same expert, one fused compare-and-sum over [B, S, S]; block counts = a fused
        compare-and-sum over [B, S, E]) or "matmul" (v2: one-hot [B, S, E] bf16 times a
        strictly-lower-triangular [S, S] ones matrix, fp32 accumulation). Same result.
    Returns:
      group_sizes [E] int32, perm [M] int32 (== argsort(flat ids, stable=True)),
      dest [T, K] int32 (dest.reshape(-1)[perm[i]] == i).
    Raises:
      ValueError: unknown method.
    """
    if method not in ("compare", "matmul"):
        raise ValueError(f"method={method!r}: expected 'compare' or 'matmul'")
    t, k = topk_ids.shape
    m, e = t * k, num_experts
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    s = min(block, max(8, pl.next_power_of_2(m)))
    nb = pl.cdiv(m, s)
    padded = jnp.pad(flat, (0, nb * s - m), constant_values=e).reshape(nb, s)  # pad id e
    if method == "compare":
        earlier = jnp.tril(jnp.ones((s, s), jnp.bool_), -1)  # [i, j]: j < i
        rank = jnp.sum((padded[:, :, None] == padded[:, None, :]) & earlier, axis=2,
                       dtype=jnp.int32)  # [B, S]
        counts = jnp.sum(padded[:, :, None] == jnp.arange(e, dtype=jnp.int32), axis=1,
                         dtype=jnp.int32)  # [B, E]
    else:
        oh = jax.nn.one_hot(padded, e, dtype=jnp.bfloat16)  # [B, S, E]; id e: zero row
        tril = jnp.tril(jnp.ones((s, s), jnp.bfloat16), -1)
        within = jnp.einsum("ij,bje->bie", tril, oh,
                            preferred_element_type=jnp.float32).astype(jnp.int32)
        counts = jnp.sum(oh, axis=1, dtype=jnp.int32)
        ids = jnp.minimum(padded, e - 1)
        rank = jnp.take_along_axis(within, ids[..., None], axis=2)[..., 0]
    block_prefix = jnp.cumsum(counts, axis=0) - counts
    group_sizes = jnp.sum(counts, axis=0).astype(jnp.int32)
    start = jnp.cumsum(group_sizes) - group_sizes
    base = block_prefix + start[None, :]  # [B, E]
    ids = jnp.minimum(padded, e - 1)
    dest = (rank + jnp.take_along_axis(base, ids, axis=1)).reshape(-1)[:m].astype(jnp.int32)
    perm = jnp.zeros((m,), jnp.int32).at[dest].set(
        jnp.arange(m, dtype=jnp.int32), unique_indices=True, indices_are_sorted=False)
    return group_sizes, perm, dest.reshape(t, k)


def rows_per_cta(t, d, dtype):
    """R: tokens per CTA, a power of two with R*D*itemsize about ROW_KERNEL_SMEM, <= T."""
    row = d * jnp.dtype(dtype).itemsize
    r = 1
    while 2 * r * row <= ROW_KERNEL_SMEM and 2 * r <= t:
        r *= 2
    return r


def scatter_rows_fits(x, k):
    """None if `scatter_rows` takes x [T, D] (K copies per row), else the reason."""
    t, d = x.shape
    row = d * x.dtype.itemsize
    if row % 128:
        return f"row of {row} bytes is not a multiple of 128"
    if row > 64 * 1024:
        return f"row of {row} bytes does not fit the SMEM budget"
    if t * k >= 2**31 // max(d, 1):
        return "too many rows for int32 offsets"
    return None


def _interpret_params():
    return None if on_hopper() else plgpu.InterpretGPUParams()


def scatter_rows(x, dest, *, rows=None):
    """out[dest[t, k]] = x[t] for a permutation dest of 0..T*K-1 (Pallas Mosaic GPU).

    Args:
      x: [T, D]; dest: [T, K] int32, each of 0..T*K-1 exactly once.
      rows: tokens per CTA (default `rows_per_cta`).
    Returns:
      [T*K, D] in x.dtype (pure copy, exact).
    """
    t, d = x.shape
    k = dest.shape[1]
    reason = scatter_rows_fits(x, k)
    if reason:
        raise ValueError(f"scatter_rows: {reason}")
    r = rows or rows_per_cta(t, d, x.dtype)
    r = min(r, t)
    nblk = pl.cdiv(t, r)

    def kernel(x_ref, dest_ref, o_ref, buf, bar):
        b = lax.axis_index("b")
        first_tok = b * r
        start = jnp.minimum(first_tok, t - r)  # last block ends at row t
        skip = first_tok - start  # rows of the shifted last block stored by the previous one
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(start, r)], buf, bar,
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        plgpu.barrier_wait(bar)
        for i in range(r):
            @pl.when(i >= skip)
            def _(i=i):
                for j in range(k):
                    row = dest_ref[start + i, j]
                    plgpu.copy_smem_to_gmem(buf.at[pl.ds(i, 1)], o_ref.at[pl.ds(row, 1)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM reads done; writes land

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((t * k, d), x.dtype),
        scratch_types=[plgpu.SMEM((r, d), x.dtype), plgpu.Barrier()],
        grid=(nblk,),
        grid_names=("b",),
        interpret=_interpret_params(),
    )
    return call(x, dest.astype(jnp.int32))


def gather_back(g, dest):
    """Backward of the permute: dx[t] = sum_k g[dest[t, k]] (fp32 sum, g.dtype out)."""
    t, k = dest.shape
    rows = jnp.take(g, dest.reshape(-1), axis=0).reshape(t, k, -1)
    return rows.astype(jnp.float32).sum(axis=1).astype(g.dtype)
