"""FP8 weight-gradient GEMM on Hopper ("1D1D", DeepGEMM's term), in Pallas Mosaic GPU.

Legend: M rows of the output, N its columns, K the contraction width (the token axis of a
weight gradient), KB = K / 128 scale blocks of K, tm/tn CTA tile rows/columns, wg warpgroup.

out[m, n] = sum_kb (a_q[m, kb] . b_q[n, kb]) * a_s[m, kb] * b_s[n, kb]: both operands are
scaled per (row, 128 of K). For a linear layer y = x @ w (x [T, Kin], w [Kin, Nout]) the weight
gradient dw = x^T @ dy contracts over the T tokens, and DeepSeek-V3 quantises x and dy for it
in 128 x 1 tiles (per channel, 128 tokens; arXiv 2412.19437 sec. 3.3): a = x^T [Kin, T] and
b = dy^T [Nout, T], both quantised per (row, 128 tokens), i.e. token-major copies (wgmma reads
8-bit operands K-major only; `reference.quantize_cols_128x1_t` writes them).

The kernel is `mosaic_gemm.fp8_gemm_blockwise`'s (persistent grid, one TMA warpgroup streaming
[tm, 128] tiles of a_q and [tn, 128] tiles of b_q through a ring of shared-memory stages, two
compute warpgroups of 64 rows x tn columns, a fresh fp32 wgmma accumulator per 128-wide K
block folded into an fp32 sum in registers) with one change in the fold: the partial product
is multiplied by the outer product of a column vector (a_s of the warpgroup's 64 rows) and a
row vector (b_s of the tile's tn columns) instead of a column vector and one scalar per 128
columns. Both scale vectors are read from global memory, stored transposed ([KB, M] and
[KB, N], so one step's scales are contiguous), which is the layout `quantize_cols_128x1` gives.

Fold schedules (`Fp8Config`): overlap=False (the default here) folds each 128-column block
after its wgmma (registers: sum 64 x n_sub, accumulator 64 and the column scales 32 per
thread) and relies on the two compute warpgroups' alternation to keep the tensor cores busy;
overlap=True (tile_n 128) folds step k - 1's partial product, reloading its scales, while
step k's wgmma runs (sum, previous partial and accumulator: 3 x 64 registers, plus 32 for the
column scales).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import default_interpret, lower_once, num_sms
from pallas_kernels.fp8.mosaic_gemm import (
    _EPI, BLOCK, FP8, ROW, TILE_M, WG_ROWS, WGMMA, Fp8Config, _stages, _transforms)

COL = plgpu.Layout.WGMMA.reduce(0)   # one value per column of a [rows, cols] WGMMA tile
WGRAD_CONFIG = Fp8Config(overlap=False)


def check_operands_1d1d(a_q, a_s, b_q, b_s, config=WGRAD_CONFIG):
    """Raise ValueError unless the operands fit `fp8_gemm_1d1d` (docstring there)."""
    if any(t.ndim != 2 for t in (a_q, a_s, b_q, b_s)):
        raise ValueError(f"fp8 1D1D GEMM needs 2-d operands, got a_q {a_q.shape}, a_s {a_s.shape}, "
                         f"b_q {b_q.shape}, b_s {b_s.shape}")
    if a_q.dtype != FP8 or b_q.dtype != FP8:
        raise ValueError(f"fp8 1D1D GEMM needs float8_e4m3fn a_q and b_q, got {a_q.dtype}, {b_q.dtype}")
    if a_s.dtype != jnp.float32 or b_s.dtype != jnp.float32:
        raise ValueError(f"fp8 1D1D GEMM needs float32 scales, got {a_s.dtype}, {b_s.dtype}")
    m, k = a_q.shape
    n, k2 = b_q.shape
    if k != k2:
        raise ValueError(f"contraction mismatch: a_q {a_q.shape}, b_q {b_q.shape} (want [M, K], [N, K])")
    if k % BLOCK:
        raise ValueError(f"fp8 1D1D GEMM needs K a multiple of {BLOCK} (pad the tokens with zeros "
                         f"before quantising), got K={k}")
    if config.tile_n not in (128, 256) or n % config.tile_n:
        raise ValueError(f"fp8 1D1D GEMM needs N a multiple of tile_n={config.tile_n} (128 or 256), "
                         f"got N={n}")
    if a_s.shape != (m, k // BLOCK) or b_s.shape != (n, k // BLOCK):
        raise ValueError(f"scale shapes a_s {a_s.shape}, b_s {b_s.shape}: want "
                         f"[{m}, {k // BLOCK}] and [{n}, {k // BLOCK}]")
    if config.overlap and config.tile_n != 128:
        raise ValueError("overlap needs tile_n=128 (registers)")
    if config.grid_minor not in ("m", "n"):
        raise ValueError(f"grid_minor={config.grid_minor!r}: expected 'm' or 'n'")


@lower_once
def fp8_gemm_1d1d(a_q, a_s, b_q, b_s, *, out_dtype=jnp.float32, config=None):
    """out = (a_q * a_s) @ (b_q * b_s)^T with both operands scaled per (row, 128 of K), fp32
    accumulation promoted per 128 of K (the weight-gradient GEMM; module docstring).

    Args:
      a_q: [M, K] float8_e4m3fn, K-major (for dw = x^T dy: x^T, [in, tokens]).
      a_s: [M, K/128] float32: a_q[m, 128 kb : 128 (kb + 1)] stands for those values times
        a_s[m, kb].
      b_q: [N, K] float8_e4m3fn, K-major (dy^T, [out, tokens]).
      b_s: [N, K/128] float32, per (row of b_q, 128 of K).
      out_dtype: output dtype, float32 by default (a weight gradient accumulates in fp32).
      config: Fp8Config (default WGRAD_CONFIG: tile_n 128, fold after each wgmma).
    Returns:
      [M, N] out_dtype: sum over K blocks of the block's fp32 wgmma partial product times
      a_s[:, kb] (rows) * b_s[:, kb] (columns), summed in fp32.
    Raises:
      ValueError: wrong dtypes or ranks, K not a multiple of 128 or N not a multiple of
        config.tile_n (pad with zeros before quantising: a zero block adds nothing whatever
        its scale), scale shapes that do not match, or a bad config. M of any size is padded
        with zero rows to a multiple of 128 inside (a copy of a_q).
    """
    config = config or WGRAD_CONFIG
    check_operands_1d1d(a_q, a_s, b_q, b_s, config)
    m = a_q.shape[0]
    mp = -(-m // TILE_M) * TILE_M
    if mp != m:
        a_q = jnp.pad(a_q, ((0, mp - m), (0, 0)))
        a_s = jnp.pad(a_s, ((0, mp - m), (0, 0)))
    out = _call(a_q, a_s.T, b_q, b_s.T, jnp.dtype(out_dtype), config)
    return out[:m] if mp != m else out


def _call(a_q, a_st, b_q, b_st, out_dtype, config):
    """The kernel on a_q [Mp, K], a_st [KB, Mp], b_q [N, K], b_st [KB, N] (Mp a multiple of 128)."""
    mp, k = a_q.shape
    n = b_q.shape[0]
    tn = config.tile_n
    n_sub = tn // BLOCK
    k_steps = k // BLOCK
    n_iters = n // tn
    m_iters = mp // TILE_M
    stages = _stages(tn, out_dtype, config.max_concurrent_steps)
    in_tr = _transforms(BLOCK, FP8)
    out_tr = _transforms(_EPI * out_dtype.itemsize, out_dtype)
    minor = 1 if config.grid_minor == "n" else 0
    overlap = config.overlap

    def make_pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=config.memory_registers,
            in_specs=[
                plgpu.BlockSpec((TILE_M, BLOCK), lambda kb: (0, kb), transforms=in_tr),
                plgpu.BlockSpec((tn, BLOCK), lambda kb: (0, kb), transforms=in_tr),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=context,
        )

    def kernel(a_ref, ast_ref, b_ref, bst_ref, o_ref):
        ignore = lambda *_, **__: None  # noqa: E731
        slot = plgpu.SMEM((_EPI, _EPI), out_dtype, transforms=out_tr)

        @functools.partial(
            pl.run_scoped,
            allocs=make_pipeline(ignore, ignore).get_allocations(
                a_ref.at[pl.ds(0, TILE_M), :], b_ref.at[pl.ds(0, tn), :]),
            out_smem=tuple(tuple(slot for _ in range(2)) for _ in range(2)),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
            def _item(info):
                (lin,) = info.index
                mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), minor, config.grid_tile_width)
                row0 = mi * TILE_M
                r0 = row0 + wg * WG_ROWS  # this warpgroup's first row
                c0 = ni * tn
                a_rows = pl.ds(pl.multiple_of(wg * WG_ROWS, WG_ROWS), WG_ROWS)

                def scales(kb):
                    """[64] ROW scales of this warpgroup's rows, n_sub [128] COL scales."""
                    sa = plgpu.load(ast_ref.at[kb, pl.ds(r0, WG_ROWS)], layout=ROW,
                                    optimized=False)
                    sbs = [plgpu.load(bst_ref.at[kb, pl.ds(c0 + s * BLOCK, BLOCK)], layout=COL,
                                      optimized=False) for s in range(n_sub)]
                    return sa, sbs

                def product(a_smem, b_smem, s, during=None):
                    """The step's fp32 partial product of 128-column block s (fresh
                    accumulator) and the value of `during()`, which runs after the wgmma is
                    issued, before it is waited for."""
                    def mma(acc_ref):
                        plgpu.wgmma(acc_ref, a_smem.at[a_rows],
                                    b_smem.at[pl.ds(s * BLOCK, BLOCK)].T)
                        extra = during() if during is not None else None
                        return acc_ref[...], extra
                    return pl.run_scoped(mma, plgpu.ACC((WG_ROWS, BLOCK), jnp.float32))

                def fold(total, part, sa, sb):
                    """total + part * (sa outer sb)."""
                    return total + (part * lax.broadcast_in_dim(sa, part.shape, [0])
                                    * lax.broadcast_in_dim(sb, part.shape, [1]))

                def body(idx, a_smem, b_smem, carry):
                    (kb,) = idx
                    if overlap:  # carry: (sum, previous step's partial product)
                        total, prev = carry

                        def fold_prev():  # step 0's "previous" partial is zeros
                            psa, psbs = scales(jnp.maximum(kb - 1, 0))
                            return fold(total, prev, psa, psbs[0])
                        part, total = product(a_smem, b_smem, 0, during=fold_prev)
                        return total, part
                    sa, sbs = scales(kb)
                    totals = list(carry)
                    for s in range(n_sub):
                        part, _ = product(a_smem, b_smem, s)
                        totals[s] = fold(totals[s], part, sa, sbs[s])
                    return tuple(totals)

                def context(run):
                    zero = plgpu.layout_cast(jnp.zeros((WG_ROWS, BLOCK), jnp.float32), WGMMA)
                    if overlap:
                        total, prev = run((zero, zero))
                        sa, sbs = scales(k_steps - 1)
                        totals = [fold(total, prev, sa, sbs[0])]
                    else:
                        totals = list(run(tuple(zero for _ in range(n_sub))))
                    _store(totals, out_smem, o_ref, wg, r0, c0)

                make_pipeline(body, context)(
                    a_ref.at[pl.ds(row0, TILE_M), :], b_ref.at[pl.ds(c0, tn), :],
                    allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def _store(totals, out_smem, o_ref, wg, r0, c0):
        """The warpgroup's [64, tn] fp32 sums to o_ref[r0:, c0:] in 64 x 64 sub-tiles through
        two staging slots, so that writing one slot overlaps the TMA store from the other."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        i = 0
        for s, total in enumerate(totals):
            for j in range(BLOCK // _EPI):
                sub = total[:, j * _EPI:(j + 1) * _EPI].astype(out_dtype)
                dst = o_ref.at[pl.ds(r0, WG_ROWS), pl.ds(c0 + s * BLOCK + j * _EPI, _EPI)]
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                for w in range(2):  # static slot refs: one branch per warpgroup
                    staged = out_smem[w][i % 2]

                    @pl.when(wg == w)
                    def _(staged=staged, sub=sub, dst=dst):
                        staged[...] = sub
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(staged, dst)
                i += 1

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        interpret=default_interpret(),
    )
    return call(a_q, a_st, b_q, b_st)
