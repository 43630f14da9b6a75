"""Ragged-contraction grouped GEMM (the MoE weight gradient) on Hopper, in Pallas Mosaic GPU.

Legend as in `mosaic_gpu`: M routed rows (sorted by expert), E experts, Kx and N the widths of
x and dy, tm/tn/tk tile sizes, wg warpgroup.

`tgmm`: dw[E, Kx, N] = per group x[rows]^T @ dy[rows] (the ragged dimension is the
contraction). Persistent and warp-specialized like `mosaic_gpu.gmm`, whose tile configs,
shared-memory budget and interpret switch it shares. Work items are (group, Kx tile, N tile);
the pipeline walks the group's rows in tk-row steps from the 8-aligned row at or below the
group's first row (TMA into 8-row-tiled SMEM) and zeroes the rows outside the group in the
first and last steps. Empty groups give zeros. `out=` writes dw in place into a mutable ref
(e.g. one layer's rows of a stacked gradient). `sq_out=` also writes, per output row and
warpgroup column tile, the sum of squares of dw as stored (after rounding to its dtype): the
gradient's contribution to a global norm without reading dw back from memory.

Maths: dw = x^T @ dy per expert, the matmul derivative (grouped as in MegaBlocks, arXiv
2211.15841, sec. 5).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import lower_once
from pallas_kernels.moe import mosaic_gpu as mg
from pallas_kernels.moe.mosaic_gpu import DEFAULT_CONFIG, _stages, _transforms, check_dtypes, pick_tile_n


def _tiles(kx, n, out_dtype, config):
    """(tm, tn): rows of x^T and columns of dy per warpgroup's output tile."""
    tm = config.tile_m if kx % config.tile_m == 0 else 64
    if kx % tm:
        raise ValueError(f"x width {kx} must be a multiple of 64 for the Mosaic GPU tgmm")
    tn = min(config.tile_n, pick_tile_n(n))
    if 2 * tm * tn * jnp.dtype(out_dtype).itemsize > 64 * 1024:  # fp32 outputs: halve the column tile
        tn = 64
    return tm, tn


def sq_tile_n(kx, n, out_dtype, config=None):
    """Columns per partial sum of `tgmm(sq_out=...)` for a dw [E, kx, n] in out_dtype: sq_out
    is [G, n // sq_tile_n(...), kx]. Raises ValueError as `tgmm` for widths it cannot take."""
    return _tiles(kx, n, out_dtype, config or DEFAULT_CONFIG)[1]


@lower_once
def tgmm(x, dy, group_sizes, *, out_dtype=None, config=None, out=None, out_row=None, sq_out=None):
    """Ragged-contraction grouped GEMM (weight gradient): dw[g] = x[rows g]^T @ dy[rows g].

    Args:
      x: [M, Kx]; dy: [M, N], bf16/f16, rows sorted by group; group_sizes: [E] int,
        sum <= M (rows past the sum are ignored). M need not be a multiple of 8: the rows
        are then zero-padded to one (a copy of x and dy).
      out_dtype: output dtype (default x.dtype, or out's); accumulation is fp32.
      out: None, or a mutable ref (`jax.new_ref`) [G, Kx, N] that receives dw in place at
        rows out_row .. out_row + E (e.g. layer l of a stacked gradient [L * E, Kx, N] at
        out_row = l * E), so no [E, Kx, N] buffer is written and copied into it.
      out_row: int or int32 scalar, with out; the caller keeps 0 <= out_row <= G - E.
      sq_out: None, or a mutable ref fp32 [G, n // sq_tile_n(Kx, n, out_dtype), Kx] that
        receives at [out_row + g, j, k] (out_row 0 without out) the sum over columns
        j * tn .. (j + 1) * tn of dw[g, k, :] ** 2, dw rounded to out_dtype first: the sum of
        its rows out_row .. out_row + E is ||dw||^2 (fp32 partial sums, in any order).
    Returns:
      [E, Kx, N] (None with out); groups with no rows give zeros.
    Raises:
      ValueError: dtype not bf16/f16, Kx not a multiple of 64, N not a multiple of 128, or an
      out or sq_out whose shape or dtype does not fit.
    """
    config = config or DEFAULT_CONFIG
    check_dtypes(x, dy)
    m, kx = x.shape
    n = dy.shape[1]
    if dy.shape[0] != m:
        raise ValueError(f"row mismatch: x {x.shape}, dy {dy.shape}")
    m_pad = -m % 8
    if m_pad:  # TMA reads 8-row tiles; the zero rows lie past sum(group_sizes) and are ignored
        x = jnp.pad(x, ((0, m_pad), (0, 0)))
        dy = jnp.pad(dy, ((0, m_pad), (0, 0)))
    e = group_sizes.shape[0]
    out_dtype = jnp.dtype(out_dtype or (out.dtype if out is not None else x.dtype))
    if out is not None and (tuple(out.shape[1:]) != (kx, n) or out.shape[0] < e
                            or out.dtype != out_dtype or out_row is None):
        raise ValueError(f"out: {out.dtype}{list(out.shape)} does not take dw {out_dtype}[{e}, {kx}, {n}] "
                         f"(out_row {out_row})")
    tk = config.tile_k
    tm, tn = _tiles(kx, n, out_dtype, config)
    if sq_out is not None and (tuple(sq_out.shape[1:]) != (n // tn, kx) or sq_out.dtype != jnp.float32
                               or sq_out.shape[0] < e):
        raise ValueError(f"sq_out: {sq_out.dtype}{list(sq_out.shape)} does not take the squares of dw "
                         f"{out_dtype}[{e}, {kx}, {n}] (want float32[G, {n // tn}, {kx}])")
    cta_n = 2 * tn
    grid_k, grid_n = kx // tm, n // cta_n
    gs = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(gs) - gs
    itemsize = x.dtype.itemsize
    x_tr = _transforms(tm, x.dtype)
    dy_tr = _transforms(cta_n, x.dtype)
    out_tr = _transforms(tn, out_dtype)
    out_bytes = 2 * tm * tn * out_dtype.itemsize + (2 * tm * 4 if sq_out is not None else 0)
    stages = _stages((tk * tm + tk * cta_n) * itemsize, out_bytes, config.max_concurrent_steps)

    def make_pipeline(body, context, steps):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=config.memory_registers,
            in_specs=[
                plgpu.BlockSpec((tk, tm), lambda s: (s, 0), transforms=x_tr, delay_release=0),
                plgpu.BlockSpec((tk, cta_n), lambda s: (s, 0), transforms=dy_tr,
                                delay_release=0),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=context,
        )

    def kernel(starts_ref, sizes_ref, x_ref, dy_ref, *refs):
        refs = list(refs)  # [out_row], [out], [sq_out], then the returned dw without out
        row0 = refs.pop(0)[0] if out is not None or sq_out is not None else 0  # from global memory
        o_ref = refs.pop(0) if out is not None else None
        sq_ref = refs.pop(0) if sq_out is not None else None
        o_ref = refs.pop(0) if o_ref is None else o_ref
        ignore = lambda *_, **__: None
        dummy_steps = jnp.asarray(1, jnp.int32)  # dynamic grid, as in the real pipelines

        @functools.partial(
            pl.run_scoped,
            allocs=make_pipeline(ignore, ignore, dummy_steps).get_allocations(
                x_ref.at[:, pl.ds(0, tm)], dy_ref.at[:, pl.ds(0, cta_n)]),
            out_smem=plgpu.SMEM((2, tm, tn), out_dtype, transforms=out_tr),
            **({"sq_smem": plgpu.SMEM((2, tm), jnp.float32)} if sq_out is not None else {}),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem, sq_smem=None):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((e * grid_k * grid_n,), collective_axes="sm")
            def _item(info):
                (idx,) = info.index
                g = idx // (grid_k * grid_n)
                rem = idx % (grid_k * grid_n)
                ki = rem // grid_n
                ni = rem % grid_n
                start = starts_ref[g]
                size = sizes_ref[g]
                # TMA into 8-row-tiled SMEM needs a row offset that is a multiple of 8: start
                # from the 8-aligned row below the group and mask rows outside [lo, hi).
                base = pl.multiple_of(start // 8 * 8, 8)
                lo = start - base
                hi = lo + size
                steps = jnp.where(size > 0, (hi + tk - 1) // tk, 0)

                def mma(idxs, x_smem, dy_smem, acc_ref):
                    (s,) = idxs
                    b = dy_smem.at[:, pl.ds(pl.multiple_of(wg * tn, tn), tn)]
                    first = s * tk

                    @pl.when((first < lo) | (first + tk > hi))
                    def _():
                        rows = plgpu.layout_cast(
                            lax.broadcasted_iota(jnp.int32, (tk, tn), 0), plgpu.Layout.WGMMA)
                        keep = ((rows >= lo - first).astype(b.dtype)
                                * (rows < hi - first).astype(b.dtype))
                        b[...] = b[...] * keep
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), b)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                def context(run):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                    def _acc(acc_ref):
                        run(acc_ref)
                        plgpu.wgmma_wait(0)
                        acc = acc_ref[...]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        stored = acc.astype(out_dtype)
                        out_smem[wg] = stored
                        if sq_ref is not None:
                            r = stored.astype(jnp.float32)
                            sq_smem[wg] = jnp.sum(r * r, axis=1)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg],
                            o_ref.at[row0 + g, pl.ds(ki * tm, tm), pl.ds(ni * cta_n + wg * tn, tn)])
                        if sq_ref is not None:
                            plgpu.copy_smem_to_gmem(
                                sq_smem.at[wg], sq_ref.at[row0 + g, ni * 2 + wg, pl.ds(ki * tm, tm)])

                make_pipeline(mma, context, steps)(
                    x_ref.at[pl.ds(base, m), pl.ds(ki * tm, tm)],
                    dy_ref.at[pl.ds(base, m), pl.ds(ni * cta_n, cta_n)],
                    allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel,
        out_type=() if out is not None else jax.ShapeDtypeStruct((e, kx, n), out_dtype),
        grid=(mg.num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mg.default_interpret(),
    )
    args = (starts, gs, x, dy)
    if out is not None or sq_out is not None:
        args += (jnp.asarray(out_row if out is not None else 0, jnp.int32).reshape(1),)
    args += tuple(r for r in (out, sq_out) if r is not None)
    if out is None:
        return call(*args)
    call(*args)
    return None
