"""FP8 GEMM with DeepSeek-V3's block scales on Hopper, in Pallas Mosaic GPU (TMA + wgmma).

Legend: M rows (tokens), N output columns, K contraction width, KB = K / 128 scale blocks of K,
tm/tn CTA tile rows/columns, wg warpgroup.

out[m, n] = sum_kb (a_q[m, kb] . b_q[n, kb]) * a_s[m, kb] * b_s[n // 128, kb], where a_q [M, K]
and b_q [N, K] are float8_e4m3fn (both K-major: a weight is stored [out, in]), a_s [M, KB] the
activations' per-(row, 128 of K) scales and b_s [N/128, KB] the weights' per 128 x 128 block
scales (DeepSeek-V3 tech report, arXiv 2412.19437, sec. 3.3; the layouts of DeepGEMM).

Kernel: persistent (one CTA per SM looping over (row tile, column tile) work items) and
warp-specialized: one TMA warpgroup streams [tm, 128] tiles of a_q and [tn, 128] tiles of b_q
through a ring of shared-memory stages; two compute warpgroups each own 64 rows (one wgmma M
tile) x tn columns. The contraction step is one scale block (BLOCK_K = 128, 4 fp8 wgmma of K
32): its product goes into a fresh fp32 wgmma accumulator, which is then scaled by
a_s[row, kb] * b_s[col block, kb] and added to a separate fp32 sum in registers (the report's
"promotion" to CUDA cores every N_C = 128 of K). With tn = 128 (`Fp8Config.overlap`) a
warpgroup folds step k - 1's partial product into the sum while step k's wgmma runs, so the
fold costs no tensor-core time (registers: sum, previous partial and accumulator, 3 x 64 per
thread); with tn = 256 it folds each 128-column half after its wgmma (sum 128 + accumulator 64
registers) and the two warpgroups' alternation hides the fold. The activation scales are read
transposed, [KB, M] (M-major, as DeepGEMM stores them), so a warpgroup's 64 row scales of one
step are contiguous; they and the weight scale (one scalar per 128 columns and step) are loaded
from global memory before the step's wgmma is waited for. `Fp8Config.cluster` pairs CTAs in
2-CTA clusters on two row tiles of one column tile ("m") or two column tiles of one row tile
("n"), the shared operand's tiles multicast to both by TMA (`collective_axes` of the pipeline's
BlockSpec): half the L2 reads of that operand.

The same kernel serves the dense weight gradient (`mosaic_wgrad.fp8_gemm_1d1d`): with
b_scales="rows" the B scales are per (row of b_q, 128 of K), read transposed [KB, N] as one
128-vector per 128 columns and step, and the fold multiplies the partial product by the outer
product of the row and column scale vectors; the overlapped schedule then reloads step
k - 1's scales inside the fold instead of carrying them. Only the scale loads and the fold
differ between the two modes.

wgmma with 8-bit operands reads both A and B K-major from shared memory (Mosaic GPU: "Only f16
WGMMA supports transposes"), hence b_q [N, K]; a transposed use (dgrad, wgrad) needs a copy
quantised along the other axis.
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
    BLOCK, EPI, FP8, ROW, TILE_M, WG_ROWS, WGMMA, fold_outer, fold_rows, load_outer_scales,
    stages, store_tiles, transforms, wg_product)
from pallas_kernels.moe.mosaic_gpu import row_tile_table


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """Tiles and pipeline of `fp8_gemm_blockwise`.

    tile_n: CTA columns, 128 or 256 (a multiple of the weights' 128-column scale block; each
      128 columns get their own scale). max_concurrent_steps: shared-memory stages of the
      a_q / b_q ring (capped by shared memory). overlap: fold the previous step's partial
      product while the current wgmma runs (tile_n 128 only). grid_minor: "n" (column tiles
      vary fastest over the work items) or "m"; grid_tile_width: width of the bands in which
      the work items snake (`plgpu.planar_snake`), for L2 reuse. cluster: None (one CTA per
      work item), "m" (dense only: 2-CTA clusters on two row tiles of the same column tile,
      its b_q tiles multicast to both by TMA) or "n" (two column tiles of the same row tile,
      its a_q tiles multicast): each shared operand read once from L2 for two CTAs; the
      paired dimension's tile count must be even.
    """
    tile_n: int = 128
    max_concurrent_steps: int = 4
    memory_registers: int = 40
    overlap: bool = True
    grid_minor: str = "n"
    grid_tile_width: int = 8
    cluster: str | None = None


DEFAULT_CONFIG = Fp8Config()


def check_operands(a_q, a_s, b_q, b_s, config=DEFAULT_CONFIG, group_sizes=None):
    """Raise ValueError unless the operands fit `fp8_gemm_blockwise` (group_sizes None) or
    `fp8_gmm_blockwise` (docstrings there)."""
    grouped = group_sizes is not None
    wb = 3 if grouped else 2  # rank of b_q and b_s
    if a_q.ndim != 2 or a_s.ndim != 2 or b_q.ndim != wb or b_s.ndim != wb:
        raise ValueError(f"fp8 GEMM needs a_q, a_s 2-d and b_q, b_s {wb}-d, got a_q {a_q.shape}, "
                         f"a_s {a_s.shape}, b_q {b_q.shape}, b_s {b_s.shape}")
    check_dtypes("fp8 GEMM", a_q, a_s, b_q, b_s)
    m, k = a_q.shape
    n, k2 = b_q.shape[-2:]
    if k != k2:
        raise ValueError(f"contraction mismatch: a_q {a_q.shape}, b_q {b_q.shape} (want [..., N, K])")
    if k % BLOCK or n % BLOCK:
        raise ValueError(f"fp8 GEMM needs K and N multiples of {BLOCK} (pad the weight and the "
                         f"activations' K with zeros before quantising), got K={k}, N={n}")
    lead = b_q.shape[:1] if grouped else ()
    if a_s.shape != (m, k // BLOCK) or b_s.shape != (*lead, n // BLOCK, k // BLOCK):
        raise ValueError(f"scale shapes a_s {a_s.shape}, b_s {b_s.shape}: want "
                         f"[{m}, {k // BLOCK}] and {[*lead, n // BLOCK, k // BLOCK]}")
    if grouped and group_sizes.shape != lead:
        raise ValueError(f"group_sizes shape {group_sizes.shape} != ({b_q.shape[0]},)")
    if config.tile_n not in (128, 256):
        raise ValueError(f"tile_n={config.tile_n}: expected 128 or 256")
    if n % config.tile_n:
        raise ValueError(f"N={n} must be a multiple of tile_n={config.tile_n}")
    check_schedule(config)


def check_dtypes(what, a_q, a_s, b_q, b_s):
    """Raise ValueError (naming `what`) unless a_q and b_q are float8_e4m3fn and a_s and b_s
    float32."""
    if a_q.dtype != FP8 or b_q.dtype != FP8:
        raise ValueError(f"{what} needs float8_e4m3fn a_q and b_q, got {a_q.dtype}, {b_q.dtype}")
    if a_s.dtype != jnp.float32 or b_s.dtype != jnp.float32:
        raise ValueError(f"{what} needs float32 scales, got {a_s.dtype}, {b_s.dtype}")


def check_schedule(config):
    """Raise ValueError unless config's fold schedule and grid order are valid (overlap only
    with tile_n 128; grid_minor "m" or "n")."""
    if config.overlap and config.tile_n != 128:
        raise ValueError("overlap needs tile_n=128 (registers)")
    if config.grid_minor not in ("m", "n"):
        raise ValueError(f"grid_minor={config.grid_minor!r}: expected 'm' or 'n'")
    if config.cluster not in (None, "m", "n"):
        raise ValueError(f"cluster={config.cluster!r}: expected None, 'm' or 'n'")


@lower_once
def fp8_gemm_blockwise(a_q, a_s, b_q, b_s, *, out_dtype=jnp.bfloat16, config=None):
    """out = (a_q * a_s) @ (b_q * b_s)^T with DeepSeek-V3's block scales, fp32 accumulation.

    Args:
      a_q: [M, K] float8_e4m3fn activations, K-major.
      a_s: [M, K/128] float32: a_q[m, 128 kb : 128 (kb + 1)] stands for those values times
        a_s[m, kb] (per token and 128 channels).
      b_q: [N, K] float8_e4m3fn weight, [out, in] (K-major).
      b_s: [N/128, K/128] float32: one scale per 128 x 128 block of b_q.
      out_dtype: output dtype (bf16 by default; fp32 for tests).
      config: Fp8Config (default DEFAULT_CONFIG).
    Returns:
      [M, N] out_dtype. Each 128-wide K block's fp32 wgmma partial sum is multiplied by its two
      scales and added to an fp32 sum (one promotion per K block).
    Raises:
      ValueError: wrong dtypes or ranks, K or N not a multiple of 128 (refused: pad the weight
        and the activations' K with zeros before quantising; a zero block adds nothing
        whatever its scale), N not a multiple of config.tile_n, scale shapes that do not match,
        or a bad config. M of any size is padded with zero rows to a multiple of 128 inside
        (a copy of a_q; M a multiple of 128 avoids it).
    """
    config = config or DEFAULT_CONFIG
    check_operands(a_q, a_s, b_q, b_s, config)
    return dense_call(a_q, a_s, b_q, b_s[None], out_dtype, config)


def dense_call(a_q, a_s, b_q, b_s, out_dtype, config, b_scales="block", interpret=None):
    """The dense kernel on checked operands: a_q [M, K] and a_s [M, KB] padded with zero rows to
    a multiple of 128 (a copy; none when M is one), b_q [N, K] and b_s as `_call` takes it for
    `b_scales` ([1, N/128, KB] or [KB, N]). Returns [M, N] out_dtype."""
    m = a_q.shape[0]
    mp = -(-m // TILE_M) * TILE_M
    if mp != m:
        a_q = jnp.pad(a_q, ((0, mp - m), (0, 0)))
        a_s = jnp.pad(a_s, ((0, mp - m), (0, 0)))
    out = _call(a_q, a_s.T, b_q[None], b_s, None, jnp.dtype(out_dtype), config, b_scales,
                interpret)
    return out[:m] if mp != m else out


@lower_once
def fp8_gmm_blockwise(a_q, a_s, b_q, b_s, group_sizes, *, out_dtype=jnp.bfloat16, config=None):
    """Grouped (MoE) form of `fp8_gemm_blockwise`: out[i] = (a_q[i] * a_s[i]) @ (b_q[g(i)] *
    b_s[g(i)])^T, where rows are sorted by group and g(i) is the group of row i.

    Args:
      a_q: [M, K] float8_e4m3fn, rows sorted by group (`pallas_kernels.moe.permute`).
      a_s: [M, K/128] float32 per-(row, 128 of K) scales.
      b_q: [E, N, K] float8_e4m3fn, each expert's weight [out, in].
      b_s: [E, N/128, K/128] float32, each expert's own 128 x 128 block scales.
      group_sizes: [E] int, rows per group, sum <= M.
      out_dtype, config: as `fp8_gemm_blockwise`.
    Returns:
      [M, N] out_dtype; rows past sum(group_sizes) are 0 (their products are scaled by 0, so
      a_q must hold finite values there, as a quantiser's output does). Row tiles are 128 rows starting at
      each group's 8-aligned first row (`pallas_kernels.moe.mosaic_gpu.row_tile_table`);
      only the group's rows are stored.
    Raises:
      ValueError: as `fp8_gemm_blockwise`, or group_sizes not of shape [E]. M is padded with
        zero rows to a multiple of 8 and at least 128 inside.
    """
    config = config or DEFAULT_CONFIG
    check_operands(a_q, a_s, b_q, b_s, config, group_sizes)
    m = a_q.shape[0]
    mp = max(-(-m // 8) * 8, TILE_M)
    if mp != m:
        a_q = jnp.pad(a_q, ((0, mp - m), (0, 0)))
        a_s = jnp.pad(a_s, ((0, mp - m), (0, 0)))
    table = row_tile_table(group_sizes, mp, TILE_M)
    out = _call(a_q, a_s.T, b_q, b_s, table, jnp.dtype(out_dtype), config)
    return out[:m] if mp != m else out


def _call(a_q, a_st, b_q, b_s, table, out_dtype, config, b_scales="block", interpret=None):
    """The kernel on a_q [Mp, K], a_st [KB, Mp], b_q [G, N, K]; table None (dense: G = 1, Mp a
    multiple of 128) or the grouped row-tile table [4, T].

    b_scales "block": b_s [G, N/128, KB], one scale per 128 x 128 block of b_q. "rows" (dense
    only): b_s [KB, N], one per (row of b_q, 128 of K), folded as an outer product with the row
    scales. interpret: the `plgpu.kernel` interpret setting (None: `default_interpret()`).
    """
    mp, k = a_q.shape
    e, n = b_q.shape[:2]
    grouped = table is not None
    rows = b_scales == "rows"
    assert b_scales in ("block", "rows") and not (rows and grouped), (b_scales, grouped)
    tn = config.tile_n
    n_sub = tn // BLOCK
    k_steps = k // BLOCK
    n_iters = n // tn
    m_iters = table.shape[1] if grouped else mp // TILE_M
    cluster = config.cluster
    if cluster == "m" and grouped:
        raise ValueError("cluster='m' pairs row tiles of one weight tile: dense only")
    if cluster and (m_iters if cluster == "m" else n_iters) % 2:
        raise ValueError(f"cluster={cluster!r} needs an even number of "
                         f"{'row' if cluster == 'm' else 'column'} tiles, got "
                         f"{m_iters if cluster == 'm' else n_iters}")
    csize = 2 if cluster else 1
    pm, pn = (m_iters // 2, n_iters) if cluster == "m" else (m_iters, n_iters // csize)
    n_stages = stages(tn, out_dtype, config.max_concurrent_steps)
    in_tr = transforms(BLOCK, FP8)
    out_tr = transforms(EPI * out_dtype.itemsize, out_dtype)
    minor = 1 if config.grid_minor == "n" else 0
    overlap = config.overlap

    def make_pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_steps,),
            memory_registers=config.memory_registers,
            in_specs=[
                plgpu.BlockSpec((TILE_M, BLOCK), lambda kb: (0, kb), transforms=in_tr,
                                collective_axes=("cluster",) if cluster == "n" else None),
                plgpu.BlockSpec((tn, BLOCK), lambda kb: (0, kb), transforms=in_tr,
                                collective_axes=("cluster",) if cluster == "m" else None),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=n_stages,
            compute_context=context,
        )

    def kernel(*refs):
        table_ref, (a_ref, ast_ref, b_ref, bs_ref, o_ref) = (
            (refs[0], refs[1:]) if grouped else (None, refs))
        ignore = lambda *_, **__: None
        # each warpgroup's two output slots, seen swizzled (the wgmma register layout stores
        # into it without bank conflicts; whole sub-tiles are TMA-stored from it) and, grouped,
        # row-major (a row range of a partial sub-tile is stored from it)
        slot = (plgpu.RefUnion(plgpu.SMEM((EPI, EPI), out_dtype, transforms=out_tr),
                               plgpu.SMEM((EPI, EPI), out_dtype)) if grouped
                else plgpu.SMEM((EPI, EPI), out_dtype, transforms=out_tr))

        @functools.partial(
            pl.run_scoped,
            allocs=make_pipeline(ignore, ignore).get_allocations(
                a_ref.at[pl.ds(0, TILE_M), :], b_ref.at[0, pl.ds(0, tn), :]),
            out_smem=tuple(tuple(slot for _ in range(2)) for _ in range(2)),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            wg = lax.axis_index("wg")

            cta = lax.axis_index("cluster") if cluster else 0

            @plgpu.nd_loop((pm * pn,), collective_axes="sm")
            def _item(info):
                (lin,) = info.index
                if grouped:
                    t, ni = lin // pn, lin % pn * csize + cta
                    g = table_ref[0, t]
                    row0 = pl.multiple_of(table_ref[1, t], 8)
                    lo, hi = table_ref[2, t], table_ref[3, t]
                    real = g < e  # group e: rows past sum(group_sizes), stored as zeros
                    gw = jnp.minimum(g, e - 1)
                    wlo = jnp.clip(lo - wg * WG_ROWS, 0, WG_ROWS)
                    whi = jnp.clip(hi - wg * WG_ROWS, 0, WG_ROWS)
                else:
                    mi, ni = plgpu.planar_snake(lin, (pm, pn), minor, config.grid_tile_width)
                    if cluster == "m":
                        mi = mi * 2 + cta
                    elif cluster == "n":
                        ni = ni * 2 + cta
                    row0, gw, real = mi * TILE_M, 0, None
                    lo = hi = wlo = whi = None
                r0 = row0 + wg * WG_ROWS  # this warpgroup's first row
                a_rows = pl.ds(pl.multiple_of(wg * WG_ROWS, WG_ROWS), WG_ROWS)

                def scales(kb):
                    """[64] ROW scales of this warpgroup's rows and the n_sub B scales (block:
                    scalars; rows: [128] COL vectors)."""
                    if rows:
                        return load_outer_scales(ast_ref, bs_ref, kb, r0, ni * tn, n_sub)
                    sa = plgpu.load(ast_ref.at[kb, pl.ds(r0, WG_ROWS)], layout=ROW,
                                    optimized=False)
                    sbs = [bs_ref[gw, ni * n_sub + s, kb] for s in range(n_sub)]
                    if grouped:  # rows past sum(group_sizes): every product scaled by 0
                        sbs = [sb * real.astype(jnp.float32) for sb in sbs]
                    return sa, sbs

                def fold(total, part, sa, sb):
                    if rows:
                        return fold_outer(total, part, sa, sb)
                    return fold_rows(total, part, sa * sb)

                def product(a_smem, b_smem, s, during=None):
                    return wg_product(a_smem, b_smem, a_rows, s, during)

                def body(idx, a_smem, b_smem, carry):
                    (kb,) = idx
                    if overlap and rows:  # carry: (sum, previous partial); its scales reloaded
                        total, prev = carry

                        def fold_prev():  # step 0's "previous" partial is zeros
                            psa, psbs = scales(jnp.maximum(kb - 1, 0))
                            return fold(total, prev, psa, psbs[0])
                        part, total = product(a_smem, b_smem, 0, during=fold_prev)
                        return total, part
                    sa, sbs = scales(kb)
                    if overlap:  # carry: (sum, previous partial, its row scales)
                        total, prev, prev_scale = carry
                        part, total = product(a_smem, b_smem, 0,
                                              during=lambda: fold_rows(total, prev, prev_scale))
                        return total, part, sa * sbs[0]
                    totals = list(carry)
                    for s in range(n_sub):
                        part, _ = product(a_smem, b_smem, s)
                        totals[s] = fold(totals[s], part, sa, sbs[s])
                    return tuple(totals)

                def context(run):
                    zero = plgpu.layout_cast(jnp.zeros((WG_ROWS, BLOCK), jnp.float32), WGMMA)
                    if overlap and rows:
                        total, prev = run((zero, zero))
                        sa, sbs = scales(k_steps - 1)
                        totals = [fold(total, prev, sa, sbs[0])]
                    elif overlap:
                        zrow = plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), ROW)
                        total, prev, prev_scale = run((zero, zero, zrow))
                        totals = [fold_rows(total, prev, prev_scale)]
                    else:
                        totals = list(run(tuple(zero for _ in range(n_sub))))
                    store_tiles(totals, out_smem, o_ref, wg, r0, ni * tn, out_dtype,
                                (wlo, whi) if grouped else None)

                def pipeline():
                    make_pipeline(body, context)(
                        a_ref.at[pl.ds(row0, TILE_M), :], b_ref.at[gw, pl.ds(ni * tn, tn), :],
                        allocations=allocs)
                if grouped:
                    pl.when(hi > lo)(pipeline)
                else:
                    pipeline()

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    cluster_args = dict(cluster=(2,), cluster_names=("cluster",)) if cluster else {}
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid=(num_sms() // csize,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        interpret=default_interpret() if interpret is None else interpret,
        **cluster_args,
    )
    operands = (a_q, a_st, b_q, b_s)
    return call(*((table,) + operands if grouped else operands))
