"""Fast MoE permute: a stable counting sort by expert and a Pallas Mosaic GPU row-scatter kernel.

Legend: T tokens, K top-k, D hidden, E experts, M = T*K routed rows, S sort block (rows),
B = cdiv(M, S) sort blocks, R tokens per CTA of the row kernel.

Counting sort (`counting_sort_by_expert`): gives exactly the `perm` of the stable argsort of
the flat expert ids (ties kept in slot order), plus `dest` = its inverse (sorted row of each
slot):
  dest[i] = start[e_i] + block_prefix[b_i, e_i] + rank_i
where start is the exclusive prefix sum of the expert counts, block_prefix the exclusive
prefix sum over blocks of the per-block counts [B, E], and rank_i the number of earlier rows
of i's block with the same expert: one fused compare-and-sum over [B, S, S] booleans (never
materialised), so the rank work is M*S compares. The block counts are an integer scatter-add
of ones; one inclusive cumulative sum over blocks gives block_prefix and, in its last row, the
expert totals. perm is dest scattered: perm[dest[i]] = i. S = `sort_block_for(E)`.

Row kernel (`scatter_rows`): out[dest[t, k]] = x[t]. x is read once (T*D) and the output
written once (M*D): the fewest bytes, where a gather x[perm // K] reads each token row K times.
One CTA per R tokens: one bulk copy (cp.async.bulk, contiguous, no tensor map) of the R rows
GMEM -> SMEM, then K*R single-row bulk stores SMEM -> GMEM; the K*R destination rows are read
while the load is in flight. Many small CTAs per SM (R*D*itemsize ~ 16 KiB of SMEM each) hide
the copy latency. Ragged T: the last block is shifted back to end at row T and skips the rows
the previous block already stored, so every output row is written by exactly one CTA.

On the H200 at V2-Lite and V3 shapes this sort took 16-18 us of device time and the row kernel
ran at ~3.75 TB/s of device time; a persistent pipelined row kernel, a register (SIMT) row
kernel, a one-hot matmul rank, other prefix sums and a radix sort were measured no faster
(benchmarks/RESULTS.md, MoE).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import default_interpret, lower_once

ROW_KERNEL_SMEM = 16 * 1024  # target SMEM bytes per CTA of the row kernel


def sort_block_for(num_experts):
    """S for the counting sort: the rank work is M*S compares and the prefix over blocks
    touches (M/S)*E counts, so S ~ sqrt(E); 4*sqrt(E) as a power of two, at least 16 (fitted
    on the H200: 32 at E=64 and 64 at E=256 were the fastest of 32..256)."""
    return max(16, pl.next_power_of_2(4 * math.isqrt(max(num_experts, 1))))


def counting_sort_by_expert(topk_ids, num_experts, *, block=None):
    """Stable counting sort of routed slots by expert (module docstring).

    Args:
      topk_ids: [T, K] int in [0, num_experts).
      block: S, rows per sort block (default `sort_block_for(num_experts)`; capped at the
        next power of two >= M, at least 8).
    Returns:
      group_sizes [E] int32, perm [M] int32 (== argsort(flat ids, stable=True)),
      dest [T, K] int32 (dest.reshape(-1)[perm[i]] == i).
    """
    t, k = topk_ids.shape
    m, e = t * k, num_experts
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    s = min(block or sort_block_for(e), max(8, pl.next_power_of_2(m)))
    nb = pl.cdiv(m, s)
    padded = jnp.pad(flat, (0, nb * s - m), constant_values=e).reshape(nb, s)  # pad id e
    earlier = jnp.tril(jnp.ones((s, s), jnp.bool_), -1)  # [i, j]: j < i
    rank = jnp.sum((padded[:, :, None] == padded[:, None, :]) & earlier, axis=2,
                   dtype=jnp.int32)  # [B, S]
    counts = jnp.zeros((nb, e + 1), jnp.int32).at[
        jnp.arange(nb)[:, None], padded].add(1)[:, :e]  # [B, E]; pad id e lands in column e
    inclusive = jnp.cumsum(counts, axis=0)
    block_prefix = inclusive - counts
    group_sizes = inclusive[-1].astype(jnp.int32)
    start = jnp.cumsum(group_sizes) - group_sizes
    base = block_prefix + start[None, :]  # [B, E]
    ids = jnp.minimum(padded, e - 1)
    dest = (rank + jnp.take_along_axis(base, ids, axis=1)).reshape(-1)[:m].astype(jnp.int32)
    perm = jnp.zeros((m,), jnp.int32).at[dest].set(
        jnp.arange(m, dtype=jnp.int32), unique_indices=True, indices_are_sorted=False)
    return group_sizes, perm, dest.reshape(t, k)


def rows_per_cta(t, d, dtype):
    """R of the row kernel: a power of two with R*D*itemsize about ROW_KERNEL_SMEM, <= T."""
    row = d * jnp.dtype(dtype).itemsize
    r = 1
    while 2 * r * row <= ROW_KERNEL_SMEM and 2 * r <= t:
        r *= 2
    return r


def scatter_rows_fits(x, k):
    """None if `scatter_rows` takes x [T, D] (K copies per row), else why."""
    t, d = x.shape
    row = d * x.dtype.itemsize
    if row % 128:
        return f"row of {row} bytes is not a multiple of 128"
    if row > 64 * 1024:
        return f"row of {row} bytes does not fit the SMEM budget"
    if t * k >= 2**31 // max(d, 1):
        return "too many rows for int32 offsets"
    return None


@lower_once
def scatter_rows(x, dest, *, rows=None, interpret=None):
    """out[dest[t, k]] = x[t] for a permutation dest of 0..T*K-1 (Pallas Mosaic GPU).

    Args:
      x: [T, D]; dest: [T, K] int32, each of 0..T*K-1 exactly once.
      rows: R, tokens per CTA (default `rows_per_cta`).
      interpret: GPU interpret params (default: compiled on Hopper, interpret elsewhere).
    Returns:
      [T*K, D] in x.dtype (pure copy, exact).
    Raises:
      ValueError: a shape the kernel cannot take (`scatter_rows_fits`).
    """
    t, d = x.shape
    k = dest.shape[1]
    reason = scatter_rows_fits(x, k)
    if reason:
        raise ValueError(f"scatter_rows: {reason}")
    r = min(rows or rows_per_cta(t, d, x.dtype), t)
    interpret = interpret if interpret is not None else default_interpret()
    dest = dest.astype(jnp.int32)

    def permute_rows_tma(x_ref, dest_ref, o_ref, buf, bar):
        first = lax.axis_index("b") * r
        start = jnp.minimum(first, t - r)  # the last block is shifted back to end at row t
        skip = first - start  # rows the previous block already stored
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(start, r)], buf, bar,
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        rows = [[dest_ref[start + i, j] for j in range(k)] for i in range(r)]  # in flight now
        plgpu.barrier_wait(bar)
        for i in range(r):
            @pl.when(i >= skip)
            def _(i=i):
                for j in range(k):
                    plgpu.copy_smem_to_gmem(buf.at[pl.ds(i, 1)], o_ref.at[pl.ds(rows[i][j], 1)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # SMEM reads done; writes land

    return plgpu.kernel(
        permute_rows_tma,
        out_type=jax.ShapeDtypeStruct((t * k, d), x.dtype),
        scratch_types=[plgpu.SMEM((r, d), x.dtype), plgpu.Barrier()],
        grid=(pl.cdiv(t, r),),
        grid_names=("b",),
        interpret=interpret,
    )(x, dest)


def gather_back(g, dest):
    """Backward of the permute: dx[t] = sum_k g[dest[t, k]] (fp32 sum, g.dtype out)."""
    t, k = dest.shape
    rows = jnp.take(g, dest.reshape(-1), axis=0).reshape(t, k, -1)
    return rows.astype(jnp.float32).sum(axis=1).astype(g.dtype)
