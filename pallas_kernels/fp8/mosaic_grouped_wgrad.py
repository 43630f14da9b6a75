"""FP8 weight gradient of the routed experts on Hopper ("1D1D", K-grouped), in Pallas Mosaic GPU.

Legend: E experts, K and N the widths of x and dy (dw [E, K, N]), P rows of the group-padded
layout (a multiple of 128: every 128-row token tile belongs to one expert,
`reference.pad_groups`, whose tiles `reference.group_tiles` counts), T = P / 128 token tiles,
tn CTA columns, wg warpgroup.

dw[e] = sum over expert e's token tiles t of (xt_q[:, t] . dyt_q[:, t]) * xt_s[t, k] * dyt_s[t, n]

where xt_q [K, P] and dyt_q [N, P] are the E4M3 operands stored transposed (tokens contiguous:
Hopper's 8-bit wgmma reads both operands K-major from shared memory, the contraction here being
the tokens), xt_s [T, K] and dyt_s [T, N] their fp32 scales, one per channel and 128 tokens
(128 x 1 tiles of x and dy; DeepSeek-V3 tech report, arXiv 2412.19437, sec. 3.3; DeepGEMM's
K-grouped wgrad GEMM). Both scales vary along the output: the promotion of each token tile's
partial product multiplies it by the outer product of a row vector (x's scales) and a column
vector (dy's scales).

Kernel: persistent (one CTA per SM looping over (expert, 128-row tile of K, tn-column tile of N)
work items) and warp-specialized: one TMA warpgroup streams [128, 128] tiles of xt_q and
[tn, 128] tiles of dyt_q of the expert's token tiles through a ring of shared-memory stages
(the step count is the expert's tile count, a dynamic grid); two compute warpgroups each own 64
rows (one wgmma M tile) x tn columns. Per token tile each warpgroup runs one 128-column block
at a time into a fresh fp32 accumulator (4 fp8 wgmma of K 32), then adds it times
xt_s[t, rows] (x) dyt_s[t, cols] into an fp32 sum in registers (sum 64 x tn / 128 and
accumulator 64 registers per thread, plus 32 of the block's column scales); the two warpgroups'
alternation hides one's fold behind the other's wgmma. The scales are loaded from global memory
(contiguous in both: [T, K] and [T, N]) before the step's wgmma is waited for. Experts without
rows give zeros. The output is fp32 (the weight gradient kept in high precision), or, with
`out=`, the fp32 sums cast once in the epilogue to the dtype of a mutable ref that receives them
in place (e.g. one layer's rows of a stacked bf16 gradient [L * E, K, N]: no fp32 [E, K, N]
written, read and cast again); `sq_out=` also writes, per row and column chunk, the sum of
squares of the values as stored (the gradient's share of a global norm, dw not read again).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import default_interpret, lower_once, num_sms
from pallas_kernels.fp8.mosaic_common import (
    BLOCK, EPI, FP8, TILE_M, WG_ROWS, WGMMA, fold_outer, load_outer_scales, stages, store_tiles,
    transforms, wg_product)
from pallas_kernels.fp8.reference import group_tiles


@dataclasses.dataclass(frozen=True)
class WgradConfig:
    """Tiles and pipeline of `fp8_grouped_wgrad`.

    tile_n: CTA columns of dw, 128 or 256 (a warpgroup's fp32 sum is 64 x tile_n).
    max_concurrent_steps: shared-memory stages of the xt_q / dyt_q ring (capped by shared
    memory). memory_registers: registers per thread of the TMA warpgroup.
    """
    tile_n: int = 128
    max_concurrent_steps: int = 4
    memory_registers: int = 40


DEFAULT_CONFIG = WgradConfig()


SQ_WIDTHS = (64, 128, 256)  # columns per partial sum of squares that the epilogue can write


def check_operands(xt_q, xt_s, dyt_q, dyt_s, group_sizes, config=DEFAULT_CONFIG):
    """Raise ValueError unless the operands fit `fp8_grouped_wgrad` (its docstring)."""
    if any(a.ndim != 2 for a in (xt_q, xt_s, dyt_q, dyt_s)) or group_sizes.ndim != 1:
        raise ValueError(f"fp8 grouped wgrad needs 2-d operands and scales and 1-d group_sizes, got "
                         f"xt_q {xt_q.shape}, xt_s {xt_s.shape}, dyt_q {dyt_q.shape}, dyt_s "
                         f"{dyt_s.shape}, group_sizes {group_sizes.shape}")
    if xt_q.dtype != FP8 or dyt_q.dtype != FP8:
        raise ValueError(f"fp8 grouped wgrad needs float8_e4m3fn xt_q and dyt_q, got "
                         f"{xt_q.dtype}, {dyt_q.dtype}")
    if xt_s.dtype != jnp.float32 or dyt_s.dtype != jnp.float32:
        raise ValueError(f"fp8 grouped wgrad needs float32 scales, got {xt_s.dtype}, {dyt_s.dtype}")
    (k, p), n = xt_q.shape, dyt_q.shape[0]
    if dyt_q.shape[1] != p:
        raise ValueError(f"token mismatch: xt_q {xt_q.shape}, dyt_q {dyt_q.shape} (want [K, P], [N, P])")
    if p % BLOCK or k % BLOCK or n % BLOCK:
        raise ValueError(f"fp8 grouped wgrad needs P, K and N multiples of {BLOCK} (pad with zeros "
                         f"before quantising), got P={p}, K={k}, N={n}")
    if xt_s.shape != (p // BLOCK, k) or dyt_s.shape != (p // BLOCK, n):
        raise ValueError(f"scale shapes xt_s {xt_s.shape}, dyt_s {dyt_s.shape}: want "
                         f"[{p // BLOCK}, {k}] and [{p // BLOCK}, {n}]")
    if config.tile_n not in (128, 256) or n % config.tile_n:
        raise ValueError(f"tile_n={config.tile_n}: expected 128 or 256 dividing N={n}")


def _check_sinks(k, n, e, out_dtype, out, out_row, sq_out, config):
    """Raise ValueError unless out / out_row / sq_out fit a dw [e, k, n] in out_dtype."""
    if out is not None and (tuple(out.shape[1:]) != (k, n) or out.ndim != 3 or out.shape[0] < e
                            or out.dtype != out_dtype or out_row is None):
        raise ValueError(f"out: {out.dtype}{list(out.shape)} does not take dw {out_dtype}[{e}, {k}, {n}] "
                         f"(out_row {out_row})")
    if sq_out is None:
        return
    j = sq_out.shape[1] if sq_out.ndim == 3 else 0
    w = n // j if j and n % j == 0 else 0
    if (sq_out.ndim != 3 or tuple(sq_out.shape[2:]) != (k,) or sq_out.shape[0] < e
            or sq_out.dtype != jnp.float32 or w not in SQ_WIDTHS or config.tile_n % w):
        raise ValueError(f"sq_out: {sq_out.dtype}{list(sq_out.shape)} does not take the squares of dw "
                         f"[{e}, {k}, {n}] (want float32[G, N / W, {k}], W one of {SQ_WIDTHS} "
                         f"dividing tile_n={config.tile_n})")


@lower_once
def fp8_grouped_wgrad(xt_q, xt_s, dyt_q, dyt_s, group_sizes, *, config=None, out=None, out_row=None,
                      sq_out=None):
    """dw[e] = x[rows of e]^T @ dy[rows of e] from E4M3 operands in 128 x 1 tiles, per 128-token
    tile promoted with the outer product of the two scale vectors, fp32 accumulation.

    Args:
      xt_q: [K, P] float8_e4m3fn: x in the group-padded layout (`reference.pad_groups`),
        quantised per channel and 128 tokens (`reference.quantize_cols_128x1`), transposed.
      xt_s: [P/128, K] float32: xt_q[k, 128 t : 128 (t + 1)] stands for those values times
        xt_s[t, k].
      dyt_q: [N, P] float8_e4m3fn, dyt_s: [P/128, N] float32: dy the same way.
      group_sizes: [E] int, rows per group before padding; group e's token tiles are
        `reference.group_tiles`' (the layout of `reference.pad_groups`), groups in order, all
        within P.
      config: WgradConfig (default DEFAULT_CONFIG).
      out: None, or a mutable ref (`jax.new_ref` / `jax.empty_ref`) [G, K, N] of any float
        dtype that receives dw in place at rows out_row .. out_row + E, each fp32 sum rounded
        once to the ref's dtype (e.g. layer l of a stacked gradient [L * E, K, N] at
        out_row = l * E).
      out_row: int or int32 scalar, with out; the caller keeps 0 <= out_row <= G - E.
      sq_out: None, or a mutable fp32 ref [G, N / W, K], W in SQ_WIDTHS dividing
        config.tile_n, that receives at [out_row + e, j, k] (out_row 0 without out) the sum over
        columns j W .. (j + 1) W of dw[e, k, :] ** 2, dw as stored (rounded to out's dtype,
        fp32 without out): the sum of its rows out_row .. out_row + E is ||dw||^2. The layout
        of `pallas_kernels.moe.dw_sq_shape` where W fits.
    Returns:
      [E, K, N] float32 (None with out); groups without rows give zeros. Token tiles past the
      groups' are not read.
    Raises:
      ValueError: wrong dtypes or ranks, P, K or N not multiples of 128, scale shapes that do
        not match, a bad config, or an out or sq_out whose shape or dtype does not fit.
    """
    config = config or DEFAULT_CONFIG
    check_operands(xt_q, xt_s, dyt_q, dyt_s, group_sizes, config)
    out_dtype = jnp.dtype(out.dtype if out is not None else jnp.float32)
    _check_sinks(xt_q.shape[0], dyt_q.shape[0], group_sizes.shape[0], out_dtype, out, out_row, sq_out,
                 config)
    first, count = group_tiles(group_sizes)
    return _call(first, count, xt_q, xt_s, dyt_q, dyt_s, config, out_dtype, out, out_row, sq_out)


def _store_squares(totals, sq_ref, r0, j0, width, out_dtype):
    """A warpgroup's [64, tn] fp32 sums (n_sub [64, 128] WGMMA arrays, `store_tiles`' totals)
    as stored (rounded to out_dtype): per row and `width`-column chunk c, the sum of squares,
    written to sq_ref [N / width, K] at [j0 + c, r0:r0 + 64] (straight to global memory: [64]
    fp32 ROW vectors)."""
    parts = []
    for total in totals:
        for j in range(BLOCK // EPI):
            r = total[:, j * EPI:(j + 1) * EPI].astype(out_dtype).astype(jnp.float32)
            parts.append(jnp.sum(r * r, axis=1))
    per = width // EPI
    for c in range(len(parts) // per):
        chunk = parts[c * per]
        for part in parts[c * per + 1:(c + 1) * per]:
            chunk = chunk + part
        sq_ref[j0 + c, pl.ds(r0, WG_ROWS)] = chunk


def _call(first, count, xt_q, xt_s, dyt_q, dyt_s, config, out_dtype, out, out_row, sq_out):
    k, p = xt_q.shape
    n = dyt_q.shape[0]
    e = first.shape[0]
    tn = config.tile_n
    n_sub = tn // BLOCK
    k_iters, n_iters = k // TILE_M, n // tn
    n_stages = stages(tn, out_dtype, config.max_concurrent_steps)
    in_tr = transforms(BLOCK, FP8)
    out_tr = transforms(EPI * out_dtype.itemsize, out_dtype)
    sq_width = n // sq_out.shape[1] if sq_out is not None else None

    def make_pipeline(body, context, steps, t0):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=config.memory_registers,
            in_specs=[
                plgpu.BlockSpec((TILE_M, BLOCK), lambda s: (0, t0 + s), transforms=in_tr),
                plgpu.BlockSpec((tn, BLOCK), lambda s: (0, t0 + s), transforms=in_tr),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=n_stages,
            compute_context=context,
        )

    def kernel(first_ref, count_ref, a_ref, as_ref, b_ref, bs_ref, *refs):
        refs = list(refs)  # [out_row], [out], [sq_out], then the returned dw without out
        row0 = refs.pop(0)[0] if out is not None or sq_out is not None else 0  # from global memory
        o_ref = refs.pop(0) if out is not None else None
        sq_ref = refs.pop(0) if sq_out is not None else None
        o_ref = refs.pop(0) if o_ref is None else o_ref
        ignore = lambda *_, **__: None
        zero_i32 = jnp.asarray(0, jnp.int32)
        one_i32 = jnp.asarray(1, jnp.int32)  # a dynamic grid, as in the real pipelines
        slot = plgpu.SMEM((EPI, EPI), out_dtype, transforms=out_tr)

        @functools.partial(
            pl.run_scoped,
            allocs=make_pipeline(ignore, ignore, one_i32, zero_i32).get_allocations(
                a_ref.at[pl.ds(0, TILE_M), :], b_ref.at[pl.ds(0, tn), :]),
            out_smem=tuple(tuple(slot for _ in range(2)) for _ in range(2)),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((e * k_iters * n_iters,), collective_axes="sm")
            def _item(info):
                (lin,) = info.index
                g = lin // (k_iters * n_iters)
                rem = lin % (k_iters * n_iters)
                ki, ni = rem // n_iters, rem % n_iters
                t0 = first_ref[g]
                steps = count_ref[g]
                r0 = ki * TILE_M + wg * WG_ROWS  # this warpgroup's first row of dw[g]
                a_rows = pl.ds(pl.multiple_of(wg * WG_ROWS, WG_ROWS), WG_ROWS)

                def body(idx, a_smem, b_smem, carry):
                    (s,) = idx
                    sa, sbs = load_outer_scales(as_ref, bs_ref, t0 + s, r0, ni * tn, n_sub)
                    totals = list(carry)
                    for j in range(n_sub):
                        part, _ = wg_product(a_smem, b_smem, a_rows, j)
                        totals[j] = fold_outer(totals[j], part, sa, sbs[j])
                    return tuple(totals)

                def zeros():
                    z = plgpu.layout_cast(jnp.zeros((WG_ROWS, BLOCK), jnp.float32), WGMMA)
                    return tuple(z for _ in range(n_sub))

                def store(totals):
                    store_tiles(totals, out_smem, o_ref.at[row0 + g], wg, r0, ni * tn, out_dtype)
                    if sq_ref is not None:
                        _store_squares(totals, sq_ref.at[row0 + g], r0, ni * (tn // sq_width),
                                       sq_width, out_dtype)

                @pl.when(steps > 0)
                def _():
                    make_pipeline(body, lambda run: store(run(zeros())), steps, t0)(
                        a_ref.at[pl.ds(ki * TILE_M, TILE_M), :], b_ref.at[pl.ds(ni * tn, tn), :],
                        allocations=allocs)

                # an expert without rows: its zeros stored directly by the two compute
                # warpgroups (wg 2 is the pipeline's TMA warpgroup), no pipeline of zero steps
                pl.when((steps == 0) & (wg < 2))(lambda: store(zeros()))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel,
        out_type=() if out is not None else jax.ShapeDtypeStruct((e, k, n), jnp.float32),
        grid=(num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        interpret=default_interpret(),
    )
    args = (first, count, xt_q, xt_s, dyt_q, dyt_s)
    if out is not None or sq_out is not None:
        args += (jnp.asarray(out_row if out is not None else 0, jnp.int32).reshape(1),)
    args += tuple(r for r in (out, sq_out) if r is not None)
    if out is None:
        return call(*args)
    call(*args)
    return None
