"""The pieces the FP8 Mosaic GPU GEMMs share: tile constants, shared-memory sizing, one compute
warpgroup's wgmma step, its scale promotions ("folds") and its output epilogue.

Legend: wg compute warpgroup (64 rows, one wgmma M tile), tn CTA columns, n_sub = tn / 128
column blocks, KB scale blocks of the contraction. Used by `mosaic_gemm` (the block-scaled
forward / dgrad kernel and, in its "rows" scale mode, the dense weight gradient of
`mosaic_wgrad`) and `mosaic_grouped_wgrad` (the K-grouped weight gradient).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.mosaic_gpu import _store_rows

BLOCK = 128                   # scale block along K (both operands) and along N (weights)
WG_ROWS = 64                  # rows per compute warpgroup: one wgmma M tile
TILE_M = 2 * WG_ROWS          # rows per CTA: two compute warpgroups
EPI = 64                      # output staged and stored in 64 x 64 sub-tiles
SMEM_BYTES = 227 * 1024 - 2048
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)   # one value per row of a [rows, cols] WGMMA tile
COL = plgpu.Layout.WGMMA.reduce(0)   # one value per column of a [rows, cols] WGMMA tile
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def transforms(minor_bytes, dtype):
    """Tiling and swizzle transforms of a shared-memory tile whose minor dimension has
    `minor_bytes` bytes of `dtype`."""
    swizzle = plgpu.find_swizzle(minor_bytes * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def stages(tn, out_dtype, want):
    """Shared-memory stages of the [TILE_M, 128] + [tn, 128] fp8 operand ring: `want`, capped by
    what fits beside the output staging (two 64 x 64 `out_dtype` slots per compute warpgroup).

    Raises:
      ValueError: fewer than two stages fit.
    """
    step = (TILE_M + tn) * BLOCK  # bytes of one a_q and one b_q tile
    fixed = 2 * 2 * EPI * EPI * jnp.dtype(out_dtype).itemsize
    n = min(want, (SMEM_BYTES - fixed) // step)
    if n < 2:
        raise ValueError(f"tiles too large for shared memory: {tn=}")
    return int(n)


def wg_product(a_smem, b_smem, a_rows, s, during=None):
    """One warpgroup's fp32 partial product of a step: a_smem[a_rows] [64, 128] against
    128-column block s of b_smem [tn, 128] (both fp8, K-major), in a fresh wgmma accumulator.

    Returns (the [64, 128] fp32 WGMMA-layout product, the value of `during()`), where `during`
    (optional) runs after the wgmma is issued, before it is waited for.
    """
    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_smem.at[a_rows], b_smem.at[pl.ds(s * BLOCK, BLOCK)].T)
        extra = during() if during is not None else None
        return acc_ref[...], extra
    return pl.run_scoped(mma, plgpu.ACC((WG_ROWS, BLOCK), jnp.float32))


def fold_rows(total, part, scale_row):
    """total + part * scale_row per row: part, total [64, 128] fp32 WGMMA, scale_row [64] ROW."""
    return total + part * lax.broadcast_in_dim(scale_row, part.shape, [0])


def fold_outer(total, part, sa, sb):
    """total + part * (sa outer sb): part, total [64, 128] fp32 WGMMA, sa [64] ROW (per row),
    sb [128] COL (per column)."""
    return total + (part * lax.broadcast_in_dim(sa, part.shape, [0])
                    * lax.broadcast_in_dim(sb, part.shape, [1]))


def load_outer_scales(as_ref, bs_ref, kb, r0, c0, n_sub):
    """Scales of step kb for `fold_outer`, from global memory: as_ref [KB, M] at rows
    [r0, r0 + 64) as a [64] ROW vector and bs_ref [KB, N] at columns [c0, c0 + 128 n_sub) as
    n_sub [128] COL vectors (one per 128-column block)."""
    sa = plgpu.load(as_ref.at[kb, pl.ds(r0, WG_ROWS)], layout=ROW, optimized=False)
    sbs = [plgpu.load(bs_ref.at[kb, pl.ds(c0 + s * BLOCK, BLOCK)], layout=COL, optimized=False)
           for s in range(n_sub)]
    return sa, sbs


def store_tiles(totals, out_smem, o_ref, wg, r0, c0, out_dtype, rows=None):
    """A warpgroup's [64, tn] fp32 sums (n_sub [64, 128] WGMMA arrays) as out_dtype to
    o_ref[r0:r0 + 64, c0:c0 + tn], in 64 x 64 sub-tiles through two staging slots per warpgroup
    (out_smem[w][0 or 1]), so that writing one slot overlaps the TMA store from the other.

    rows None: every row is stored, out_smem[w][i] a swizzled slot. rows (wlo, whi): only the
    rows [wlo, whi) of the warpgroup's 64 (grouped row tiles); out_smem[w][i] is then a pair
    (swizzled, row-major) of views of one slot: a whole sub-tile is TMA-stored from the
    swizzled view, a partial one row by row from the row-major view (`_store_rows`).
    """
    grouped = rows is not None
    wlo, whi = rows if grouped else (None, None)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    i = 0
    for s, total in enumerate(totals):
        for j in range(BLOCK // EPI):
            sub = total[:, j * EPI:(j + 1) * EPI].astype(out_dtype)
            dst = o_ref.at[pl.ds(r0, WG_ROWS), pl.ds(c0 + s * BLOCK + j * EPI, EPI)]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            for w in range(2):  # static slot refs: one branch per warpgroup
                staged = out_smem[w][i % 2]
                swizzled, row_major = staged if grouped else (staged, None)
                full = (wg == w) if not grouped else (wg == w) & (wlo == 0) & (whi == WG_ROWS)

                @pl.when(full)
                def _(swizzled=swizzled, sub=sub, dst=dst):
                    swizzled[...] = sub
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(swizzled, dst)

                if grouped:
                    @pl.when((wg == w) & jnp.logical_not(full) & (whi > wlo))
                    def _(row_major=row_major, sub=sub, dst=dst):
                        row_major[...] = sub
                        plgpu.commit_smem()
                        _store_rows(row_major, dst, wlo, whi, WG_ROWS)
            i += 1
