"""Fused FP8 quantisation in Pallas Mosaic GPU: one read of each 128 x 128 tile of an activation
or a weight, both layouts its GEMMs read written.

Legend: M rows (tokens), K columns, Mp / Kp = M / K rounded up to multiples of 128,
Mb = Mp / 128, Kb = Kp / 128; E experts (a weight's leading axis). A weight w [K, N] takes the
place of x [M, K] (its K the rows, its N the columns).

A linear layer's activation x [M, K] (and, in the backward, its output gradient dy) is quantised
twice (reference.py): in 1 x 128 tiles for the forward (or dgrad) GEMM, `quantize_rows_1x128`,
and in 128 x 1 tiles written transposed for the weight gradient, `quantize_cols_128x1_t`. Here
one kernel does both from a single read of x (`quantize_dual`): 2 (bf16 / fp16) or 4 (fp32)
bytes read and 2 bytes written per element (x_q and x^T_q, one byte each), plus 8 bytes of
scales per 128 elements.

A weight w [K, N] is quantised in 128 x 128 blocks (`quantize_blocks_128x128`), read by the
forward GEMM as w^T [N, K] and by the dgrad as w [K, N]; the same kernel in its "blocks" mode
(`quantize_blocks_dual`) writes both copies of the blocks from one read of w, with the
[Kb, Nb] block scales and their transpose: again 2 bytes written per element. Routed experts
[E, K, N] are one launch, the expert index a grid dimension.

Kernel: a grid of ([E,] Mb, Kb) CTAs, one warpgroup each, one 128 x 128 tile of x per CTA:
  1. TMA copies x[128 i : 128 (i + 1), 128 j : 128 (j + 1)] into shared memory; rows and
     columns past M and K are filled with zeros by the TMA unit, so a partial edge tile is
     quantised exactly as the references quantise their zero-padded tiles;
  2. the tile is loaded into registers (WGMMA layout, converted to fp32) and reduced to
     max|x| per row (within each warp: a row lives in one quad of lanes) and per column
     (across the four warps, through shared memory); blocks: the column maxima reduced once
     more to the block's, a scalar;
  3. s = amax / 448 (1 for an all-zero row, column or block), q = clip(x / s, -448, 448)
     rounded to E4M3 (round to nearest even, `cvt.rn.satfinite.e4m3x2.f32`): the fp32
     operations that XLA compiles reference.py's functions to (`INV_E4M3_MAX`), so the results
     are bitwise those of the references;
  4. the row-scaled tile is stored to shared memory as is; the column-scaled tile is first
     permuted within pairs of lanes into the WGMMA_TRANSPOSED register layout (one shuffle),
     then stored through the transposed view of a [128, 128] fp8 buffer (2-byte stores along
     the buffer's rows), which makes it the tile of x^T;
  5. TMA writes the two fp8 tiles (to [Mp, Kp] and [Kp, Mp]) and the two 128-vectors of
     scales (to [Kb, Mp] and [Mb, Kp]: one step's scales contiguous, the layout in which
     the GEMM kernels read them); blocks: both tiles hold the same values, and the block's scale
     is stored (a scalar store, every thread the same value) to [Mb, Kb] and [Kb, Mb].
Each CTA holds 1 x 128 x 128 input and 2 x 16 KiB fp8 tiles in shared memory (64 KiB for bf16,
96 KiB for fp32), so two or three CTAs per SM overlap one's loads with another's stores; there is
no software pipeline within a CTA.
All fp8 outputs are padded to multiples of 128 (zeros; the activations' scale vectors with 1,
the block scales need none): the layout the GEMM kernels take, so their callers need no padded
copies. `rows=False` skips the 1 x 128 outputs (the grouped weight gradient needs only the
128 x 1 ones). The "grouped" mode (`quantize_grouped_cols`) writes those 128 x 1 tiles of the
routed experts' group-padded layout straight from x: each CTA's tile of rows comes from a table
(8-aligned first row, the rows that are the tile's own), the other rows zeroed in registers.

x is read as it is when M is a multiple of 8 and a row of x a multiple of 32 bytes (the tiled,
swizzled shared-memory layout of its tile; TMA's 16-byte row stride follows); other shapes are
first padded with zeros to multiples of 128 (a copy of x). The model's widths (576, 1408,
2048, 10944, ...) and token counts qualify.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import default_interpret, lower_once
from pallas_kernels.fp8.mosaic_common import BLOCK, FP8, transforms
from pallas_kernels.fp8.reference import E4M3_MAX, _cdiv, _pad_to, group_tile_table

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


SWIZZLES = (128, 64, 32)  # bytes; Mosaic GPU's swizzled shared-memory tiles


def _direct(m: int, k: int, itemsize: int) -> bool:
    """Whether the kernel can read x [M, K] as it is: M a multiple of the 8-row tiles and a row
    of x a multiple of the narrowest swizzle (which also makes the row stride TMA's 16 bytes)."""
    return m % 8 == 0 and (k * itemsize) % SWIZZLES[-1] == 0


def _swizzle_bytes(row_bytes: int) -> int:
    """The widest shared-memory swizzle (bytes) whose tile width divides a row of x."""
    return next(s for s in SWIZZLES if row_bytes % s == 0)


# reference.py's amax / 448 and x / s as XLA compiles them: its algebraic simplifier (a pass
# of the CPU and the GPU pipelines alike; seen in the CPU-compiled HLO) turns a division by a
# constant or by a broadcast into a multiplication by the reciprocal, amax * fl(1 / 448) and
# x * fl(1 / s), which round differently from the divisions on E4M3 ties. The kernel writes
# these multiplications literally, since Mosaic GPU keeps a division a division.
INV_E4M3_MAX = float(np.float32(1.0) / np.float32(E4M3_MAX))


def _scale(amax):
    """[128] fp32 scales of [128] tile maxima: amax / 448, 1 for an all-zero tile."""
    return jnp.where(amax > 0, amax * INV_E4M3_MAX, 1.0)


def _clipped(x, inv_scale):
    """x / s (as x * fl(1 / s)) clipped to E4M3's range, fp32 (rounded by the caller's cast)."""
    return jnp.clip(x * inv_scale, -E4M3_MAX, E4M3_MAX)


MODES = ("dual", "cols", "blocks", "blocks_stored", "blocks_t", "grouped")


def _call(x, mode: str, table=None, num_groups: int = 0):
    """The kernel on x [M, K] or [E, M, K] (`_direct`), one CTA per 128 x 128 tile (and per
    leading index e, a grid dimension). Returns, each with x's leading axis if it has one:
      "dual":    (q [Mp, Kp], s_t [Kb, Mp], qt [Kp, Mp], st [Mb, Kp]): 1 x 128 tiles and the
                 transposed 128 x 1 tiles;
      "cols":    (qt, st) alone;
      "blocks":  (q [Mp, Kp], s [Mb, Kb], qt [Kp, Mp], st [Kb, Mb]): 128 x 128 blocks, both
                 layouts of the same values, the block scales and their transpose;
      "blocks_stored", "blocks_t": the first pair (as stored) or the second (transposed) alone;
      "grouped": (qt [Kp, 128 T], st [T, Kp]) as "cols" of the group-padded copy of x, from
                 table [4, T] (`reference.group_tile_table`, num_groups = E): CTA row t reads
                 x's rows [row0, row0 + 128) and zeroes those outside [lo, hi) (all of them in
                 a tile of group E or an unused one) before the maxima.
    """
    assert mode in MODES and (table is not None) == (mode == "grouped"), mode
    *lead, m, k = x.shape
    mb, kb = (table.shape[1] if table is not None else _cdiv(m, BLOCK)), _cdiv(k, BLOCK)
    mp, kp = mb * BLOCK, kb * BLOCK
    x_tr = transforms(_swizzle_bytes(k * x.dtype.itemsize), x.dtype)
    q_tr = transforms(BLOCK, FP8)
    blocks, grouped = mode.startswith("blocks"), mode == "grouped"
    rows = mode in ("dual", "blocks", "blocks_stored")  # writes the tile as stored
    cols = mode != "blocks_stored"  # writes the transposed tile

    def kernel(*refs):
        table_ref, (x_ref, *out_refs) = (refs[0], refs[1:]) if grouped else (None, refs)
        it = iter(out_refs)
        q_ref, s_ref = (next(it), next(it)) if rows else (None, None)
        qt_ref, st_ref = (next(it), next(it)) if cols else (None, None)

        def scoped(x_smem, q_smem, qt_smem, s_smem, st_smem, bar):
            g = (lax.axis_index("e"),) if lead else ()
            i, j = lax.axis_index("m"), lax.axis_index("k")
            row0 = pl.multiple_of(table_ref[1, i], 8) if grouped else i * BLOCK
            plgpu.copy_gmem_to_smem(
                x_ref.at[(*g, pl.ds(row0, BLOCK), pl.ds(j * BLOCK, BLOCK))], x_smem, bar)
            plgpu.barrier_wait(bar)
            xt = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            if grouped:  # only the tile's own rows; a tile of group E or an unused one: none
                lo = table_ref[2, i]
                hi = jnp.where(table_ref[0, i] < num_groups, table_ref[3, i], lo)
                r = plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0, layout=plgpu.Layout.WGMMA)
                xt = jnp.where((r >= lo) & (r < hi), xt, 0.0)
            ax = jnp.abs(xt)
            col_max = jnp.max(ax, axis=0)  # [128] per column
            if blocks:  # one scale for the whole block; both layouts hold the same values
                s_blk = _scale(jnp.max(col_max))
                q_col = q_row = _clipped(xt, 1.0 / s_blk)
            else:
                s_col = _scale(col_max)  # 128 x 1 tiles
                q_col = _clipped(xt, lax.broadcast_in_dim(1.0 / s_col, xt.shape, [1]))
            if cols:  # x^T's tile: permuted within lane pairs, stored through the transposed view
                qt_smem.T[...] = plgpu.layout_cast(q_col, plgpu.Layout.WGMMA_TRANSPOSED).astype(FP8)
            if mode == "dual":
                s_row = _scale(jnp.max(ax, axis=1))  # [128] per row: 1 x 128 tiles
                q_row = _clipped(xt, lax.broadcast_in_dim(1.0 / s_row, xt.shape, [0]))
                s_smem[...] = s_row
            if not blocks:
                st_smem[...] = s_col
            if rows:
                q_smem[...] = q_row.astype(FP8)
            plgpu.commit_smem()
            if cols:
                plgpu.copy_smem_to_gmem(
                    qt_smem, qt_ref.at[(*g, pl.ds(j * BLOCK, BLOCK), pl.ds(i * BLOCK, BLOCK))])
            if rows:
                plgpu.copy_smem_to_gmem(
                    q_smem, q_ref.at[(*g, pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK))])
            if blocks:  # a scalar each: plain stores
                if rows:
                    s_ref[(*g, i, j)] = s_blk
                if cols:
                    st_ref[(*g, j, i)] = s_blk
            else:
                plgpu.copy_smem_to_gmem(st_smem, st_ref.at[(*g, i, pl.ds(j * BLOCK, BLOCK))])
                if rows:
                    plgpu.copy_smem_to_gmem(s_smem, s_ref.at[(*g, j, pl.ds(i * BLOCK, BLOCK))])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(scoped,
                      plgpu.SMEM((BLOCK, BLOCK), x.dtype, transforms=x_tr),
                      plgpu.SMEM((BLOCK, BLOCK), FP8, transforms=q_tr),
                      plgpu.SMEM((BLOCK, BLOCK), FP8, transforms=q_tr),
                      plgpu.SMEM((BLOCK,), jnp.float32),
                      plgpu.SMEM((BLOCK,), jnp.float32),
                      plgpu.Barrier())

    def out(*shape, dtype=jnp.float32):
        return jax.ShapeDtypeStruct((*lead, *shape), dtype)

    if blocks:
        out_type = (((out(mp, kp, dtype=FP8), out(mb, kb)) if rows else ())
                    + ((out(kp, mp, dtype=FP8), out(kb, mb)) if cols else ()))
    else:
        cols_out = (out(kp, mp, dtype=FP8), out(mb, kp))
        out_type = ((out(mp, kp, dtype=FP8), out(kb, mp)) if rows else ()) + cols_out
    call = plgpu.kernel(kernel, out_type=out_type, grid=(*lead, mb, kb),
                        grid_names=(("e",) if lead else ()) + ("m", "k"),
                        interpret=default_interpret())
    return call(table, x) if grouped else call(x)


@lower_once
def _padded(x, mode: str):
    *_, m, k = x.shape
    if not _direct(m, k, x.dtype.itemsize):
        x = _pad_to(_pad_to(x, -2), -1)
    return _call(x, mode)


@lower_once
def _grouped(x, table, num_groups: int):
    m, k = x.shape
    mp = max(-(-m // 8) * 8, BLOCK)  # the rows `reference.group_tile_table` was built for
    kp = k if _direct(mp, k, x.dtype.itemsize) else k + (-k % BLOCK)
    if (mp, kp) != (m, k):
        x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    return _call(x, "grouped", table, num_groups)


def _check(fn: str, arg: str, x, ndims: tuple[int, ...], shapes: str):
    """Raises ValueError unless x (`fn`'s argument `arg`, of `shapes`) has one of `ndims` dims,
    none empty, and a dtype in DTYPES."""
    if x.ndim not in ndims or 0 in x.shape:
        raise ValueError(f"{fn} needs {arg} {shapes} with every size >= 1, got shape {x.shape}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{fn} needs {arg} in {[str(d) for d in DTYPES]}, got {x.dtype}")


def quantize_dual(x, *, rows: bool = True, padded: bool = True):
    """Quantise x [M, K] in 1 x 128 tiles and in 128 x 1 tiles written transposed, reading x once
    (module docstring): bitwise `reference.quantize_rows_1x128(x)` and
    `reference.quantize_cols_128x1_t(x)`.

    Args:
      x: [M, K] bfloat16, float16 or float32; any M, K >= 1.
      rows: also return the 1 x 128 tiles (False: only the transposed 128 x 1 ones).
      padded: outputs padded to multiples of 128 (zeros, scale 1), as the GEMM kernels take
        them; False slices them to the references' shapes (a copy).
    Returns:
      padded: (x_q [Mp, Kp] e4m3, x_s [Mp, Kb] fp32, xt_q [Kp, Mp] e4m3, xt_s [Kp, Mb] fp32),
      the first two only if rows; x[m, k] ~= x_q[m, k] x_s[m, k // 128]
      ~= xt_q[k, m] xt_s[k, m // 128]. Not padded: x_q [M, K], x_s [M, Kb], xt_q [K, M],
      xt_s [K, Mb].
    Raises:
      ValueError: x not 2-d, empty, or of another dtype.
    """
    _check("quantize_dual", "x", x, (2,), "[M, K]")
    m, k = x.shape
    outs = _padded(x, "dual" if rows else "cols")
    qt, st = outs[-2:]
    res = (qt, st.T)
    if rows:
        res = (outs[0], outs[1].T) + res
    if padded:
        return res
    mb, kb = _cdiv(m, BLOCK), _cdiv(k, BLOCK)
    shapes = ((m, k), (m, kb), (k, m), (k, mb))[(0 if rows else 2):]
    return tuple(t[:a, :b] for t, (a, b) in zip(res, shapes))


def quantize_grouped_cols(x, group_sizes):
    """The routed experts' weight-gradient operand: x [M, K] (rows grouped by group_sizes) in
    the group-padded layout (`reference.pad_groups`) quantised in 128 x 1 tiles and written
    transposed, straight from x: bitwise `reference.quantize_cols_128x1_t(reference.pad_groups(
    x, group_sizes)[0])`, with no padded copy of x written and read again.

    Each CTA takes one 128-token tile of `reference.group_tile_table` (whose tiles start at
    multiples of 8 rows of x, where TMA reads them) and one 128-column block, zeroes the rows of
    the tile that belong to another group, then quantises as `quantize_dual`'s 128 x 1 half.

    Args:
      x: [M, K] bfloat16, float16 or float32, rows sorted by group; any M, K >= 1 (M not a
        multiple of 8, or under 128, is first padded with zero rows: a copy).
      group_sizes: [E] int, sum <= M (rows past the sum are in no tile).
    Returns:
      (xt_q [Kp, P] float8_e4m3fn, xt_s [P / 128, Kp] float32), P = 128 T
      (`reference.group_tile_table`), Kp = K rounded up to a multiple of 128 (zeros, scale 1):
      the operand layout of `mosaic_grouped_wgrad.fp8_grouped_wgrad`.
    Raises:
      ValueError: x not 2-d, empty, or of another dtype; group_sizes not 1-d.
    """
    _check("quantize_grouped_cols", "x", x, (2,), "[M, K]")
    if group_sizes.ndim != 1 or group_sizes.shape[0] < 1:
        raise ValueError(f"quantize_grouped_cols needs group_sizes [E], got shape {group_sizes.shape}")
    table = group_tile_table(group_sizes, x.shape[0])
    return _grouped(x, table, group_sizes.shape[0])


def quantize_blocks_dual(w, *, padded: bool = True):
    """Quantise w [K, N] (or each w[e] of [E, K, N]) in 128 x 128 blocks, reading w once and
    writing the blocks both as stored and transposed (module docstring, "blocks"): bitwise
    `reference.quantize_blocks_128x128(w)` and its transpose.

    A weight's forward GEMM reads w^T [N, K] (K-major) and its dgrad w [K, N]; one kernel writes
    both. Each CTA reduces its block to one max|w| (per column, then across the columns),
    s = amax * fl(1 / 448) (1 for a zero block), q = clip(w * fl(1 / s), -448, 448) in E4M3:
    the reference's arithmetic as XLA compiles it (`INV_E4M3_MAX`). An expert axis is a grid
    dimension (one launch for all experts).

    Args:
      w: [K, N] or [E, K, N] bfloat16, float16 or float32; any K, N >= 1.
      padded: outputs padded to multiples of 128 (zeros, scale 1), as the GEMM kernels take
        them; False slices them to the reference's shapes (a copy).
    Returns:
      padded: (w_q [.., Kp, Np] e4m3, w_s [.., Kb, Nb] fp32, wt_q [.., Np, Kp] e4m3,
      wt_s [.., Nb, Kb] fp32), `..` w's expert axis if it has one; w[k, n] ~= w_q[k, n]
      w_s[k // 128, n // 128], wt_q = w_q^T and wt_s = w_s^T. Not padded: w_q [.., K, N],
      wt_q [.., N, K] (the scales have no padding).
    Raises:
      ValueError: w not 2-d or 3-d, empty, or of another dtype.
    """
    _check("quantize_blocks_dual", "w", w, (2, 3), "[K, N] or [E, K, N]")
    outs = _padded(w, "blocks")
    if padded:
        return outs
    k, n = w.shape[-2:]
    w_q, w_s, wt_q, wt_s = outs
    return w_q[..., :k, :n], w_s, wt_q[..., :n, :k], wt_s


def quantize_blocks(w, *, transposed: bool, padded: bool = True):
    """One layout of `quantize_blocks_dual`: w [K, N] (or each w[e] of [E, K, N]) in 128 x 128
    blocks, written as stored (transposed=False: the dgrad's operand) or transposed (True: the
    forward's), from one read of w. Bitwise the matching half of `quantize_blocks_dual`, with
    half its writes.

    Args:
      w: [K, N] or [E, K, N] bfloat16, float16 or float32; any K, N >= 1.
      transposed: which layout to write.
      padded: as `quantize_blocks_dual`.
    Returns:
      transposed=False: (w_q [.., Kp, Np] e4m3, w_s [.., Kb, Nb] fp32); True: (wt_q [.., Np, Kp],
      wt_s [.., Nb, Kb]). Not padded: w_q [.., K, N] or wt_q [.., N, K].
    Raises:
      ValueError: w not 2-d or 3-d, empty, or of another dtype.
    """
    _check("quantize_blocks", "w", w, (2, 3), "[K, N] or [E, K, N]")
    q, s = _padded(w, "blocks_t" if transposed else "blocks_stored")
    if padded:
        return q, s
    k, n = w.shape[-2:]
    return (q[..., :n, :k] if transposed else q[..., :k, :n]), s
