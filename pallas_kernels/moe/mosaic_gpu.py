"""Grouped GEMMs for dropless MoE on Hopper, in Pallas Mosaic GPU (TMA + wgmma).

Legend: M routed rows (sorted by expert), E experts, Kc contraction width, N output width,
tm/tn/tk tile sizes (rows, columns per compute warpgroup, contraction step), wg warpgroup.

Two kernels, both persistent (one CTA per SM looping over work items) and warp-specialized
(two compute warpgroups, one TMA producer warpgroup):

* `gmm`:  out[M, N] = x[M, Kc] @ w[g(row)] (`transpose_rhs`: @ w[g]^T). Work items are
  (row tile, column tile) pairs; a row tile is tm rows of x holding rows of one group, from a
  (group, first row, lo, hi) table computed outside the kernel with jnp (the kernel's size
  does not grow with E). A group's row tiles start at its 8-aligned first row, so a group of
  s rows takes cdiv(s + 7, tm) tiles (a fixed tm grid would visit every boundary block once
  per group). wg_split="n" (the forward's default): each compute warpgroup owns tn columns
  of all tm rows. wg_split="m" (the default of dx, `transpose_rhs`): each warpgroup owns tm/2
  rows x all 2*tn columns and skips its wgmma when its rows hold none of the group (64-row
  compute granularity at group ends); it reads 25% more SMEM per k-step (64x64 of A + 64x256
  of B per warpgroup instead of 128x64 + 64x128), which made the forward slower on the H200
  and dx = dy @ w^T faster. Only the group's rows are stored: a whole tile by one TMA store
  from swizzled staging, a partial one by a TMA store per set bit of its row count from the
  same staging seen row-major, 64 x 64 at a time through two slots per warpgroup (writing one
  slot overlaps the store from the other). Rows past sum(group_sizes) are written as zeros.
  Where every CTA runs two or more work items, they run as one pipeline of pipelines: the TMA
  warpgroup loads the next item's first k steps while the compute warpgroups finish the
  current one.
  epilogue="swiglu": weight columns come gate/up interleaved in blocks of half a warpgroup's columns
  (`interleave_gate_up`, 64 by default), so each warpgroup's accumulator holds matching gate
  and up halves; it stores silu(gate) * up from the fp32 accumulators ([M, N/2]) and, for
  the backward, optionally the pre-activation h [M, N]. extra=(t, b): t[i] @ b[g] (a LoRA
  adapter's second factor, R a multiple of 16) is one more wgmma into the same accumulator after
  the main loop; each compute warpgroup loads its t rows and b columns by TMA at the start of
  the work item, into its own slots, so the load overlaps the main loop.
* `tgmm` (the weight gradient, in `mosaic_tgmm.py`): dw[E, Kx, N] = per group
  x[rows]^T @ dy[rows], with this file's tiles, configs and helpers.

Maths: grouped GEMM of MegaBlocks (arXiv 2211.15841, sec. 5); dx = dy @ w^T and
dw = x^T @ dy per expert are the standard matmul derivatives; SwiGLU(x) = silu(x Wg) * (x Wu)
(Shazeer 2020, arXiv 2002.05202, eq. 6). wgmma/TMA usage follows the
Pallas Mosaic GPU reference (jax docs/pallas/gpu/reference.md).
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

EXTRA_STEP = 16  # the extra contraction's width granule: one bf16/f16 wgmma k step
_SMEM_BYTES = 227 * 1024 - 2048  # usable dynamic SMEM per CTA on sm90, minus barrier slack
_EPI = 64  # plain epilogue: rows and columns of one staged output sub-tile
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes and work split of the grouped GEMM kernels.

    A CTA tile is tile_m rows x 2*tile_n columns. wg_split "n": each of the two compute
    warpgroups owns tile_n columns and all tile_m rows. wg_split "m" (gmm only): each
    owns tile_m/2 rows and all 2*tile_n columns, and a warpgroup whose rows hold none of the
    work item's group skips its wgmma (64-row compute granularity at group boundaries).
    """
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    memory_registers: int = 40
    wg_split: str = "n"


DEFAULT_CONFIG = TileConfig()
# dx = dy @ w^T (transposed B): rows split between warpgroups measured faster at V2-Lite on the
# H200 (backward 3.29 ms with the row split vs 3.86 ms with the column split; at V3 the gate/up
# GEMM's fwd+bwd took 30.3 ms with it vs 29.3 ms without).
TRANSPOSED_CONFIG = TileConfig(wg_split="m")


def _transforms(minor_elems, dtype, swizzle_elems=None):
    """SMEM tiling + swizzle of a tile whose minor dimension has `minor_elems` elements: the
    widest swizzle that divides it, or that of `swizzle_elems` (a wgmma's two operands must share
    one swizzle, so a narrow A sets B's)."""
    swizzle = plgpu.find_swizzle((swizzle_elems or minor_elems) * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _stages(stage_bytes, fixed_bytes, want):
    stages = min(want, (_SMEM_BYTES - fixed_bytes) // stage_bytes)
    if stages < 2:
        raise ValueError(f"tiles too large for shared memory: {stage_bytes=} {fixed_bytes=}")
    return int(stages)


def pick_tile_n(n):
    """Per-warpgroup column tile for an output width n (CTA width 2*tile_n must divide n)."""
    for tn in (128, 64):
        if n % (2 * tn) == 0:
            return tn
    raise ValueError(f"output width {n} must be a multiple of 128 for the Mosaic GPU kernels")


def check_dtypes(*arrays):
    dt = arrays[0].dtype
    if any(a.dtype != dt for a in arrays) or dt not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        names = ", ".join(jnp.dtype(d).name for d in SUPPORTED_DTYPES)
        raise ValueError(f"Mosaic GPU grouped GEMM needs one dtype of {names}, got "
                         f"{', '.join(str(a.dtype) for a in arrays)}")


def row_tile_table(group_sizes, m, tile_m):
    """Work table of the forward kernel: int32 [4, num_columns].

    Column t describes row tile t: (group, row0, lo, hi) meaning rows [row0 + lo, row0 + hi)
    of x belong to `group` (0 <= lo < hi <= tile_m, row0 a multiple of 8 with
    row0 + tile_m <= m). Group E stands for rows past sum(group_sizes) (written as zeros).
    Unused columns have lo == hi == 0. Each group's tiles start at its 8-aligned first row,
    and a tile that would run past m is shifted back to end at m (needs m % 8 == 0 and
    m >= tile_m).
    """
    e = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    total = ends[-1]
    starts = jnp.concatenate([ends - gs, total[None]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    sizes = ends - starts
    base = starts // 8 * 8
    ntiles = jnp.where(sizes > 0, (ends - base + tile_m - 1) // tile_m, 0)
    num = -(-(m + 7 * (e + 1)) // tile_m) + e + 1
    tile_end = jnp.cumsum(ntiles)
    tile_start = tile_end - ntiles
    t = jnp.arange(num, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), e).astype(jnp.int32)
    valid = t < tile_end[-1]
    row0 = base[g] + (t - tile_start[g]) * tile_m
    lo = jnp.maximum(starts[g] - row0, 0)
    hi = jnp.minimum(ends[g] - row0, tile_m)
    shift = jnp.maximum(row0 + tile_m - m, 0)
    row0, lo, hi = row0 - shift, lo + shift, hi + shift
    zero = jnp.zeros_like(t)
    return jnp.stack([g, jnp.where(valid, row0, zero), jnp.where(valid, lo, zero),
                      jnp.where(valid, hi, zero)]).astype(jnp.int32)


def _store_rows(src_smem, dst_gmem, lo, hi, tile_m):
    """TMA-store rows [lo, hi) of src_smem [tile_m, n] to the same rows of dst_gmem.

    TMA boxes have static sizes, so a partial tile is stored as one box per set bit of
    hi - lo (at most log2(tile_m) boxes).
    """
    full = (lo == 0) & (hi == tile_m)

    @pl.when(full)
    def _():
        plgpu.copy_smem_to_gmem(src_smem, dst_gmem)

    @pl.when(jnp.logical_not(full))
    def _():
        size = hi - lo
        start = lo
        p = tile_m // 2
        while p >= 1:
            @pl.when((size & p) != 0)
            def _(start=start, p=p):
                plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(start, p)], dst_gmem.at[pl.ds(start, p)])
            start = start + (size & p)
            p //= 2


def swiglu_block(config=None):
    """Gate/up interleave block of `gmm(..., epilogue="swiglu")` under a config (default
    DEFAULT_CONFIG): half of one compute warpgroup's columns, 64 for wg_split "n", 128 for "m"."""
    config = config or DEFAULT_CONFIG
    return 128 if config.wg_split == "m" else 64


def interleave_gate_up(w, block=None):
    """[..., 2I] gate|up columns -> [..., 2I] with gate and up blocks of `block` alternating.

    Column layout of the result: for j < I/block, columns [2j*block, (2j+1)*block) are gate
    columns [j*block, (j+1)*block) and the next `block` are the matching up columns. With
    block = `swiglu_block()` (the default) this is the weight layout
    `gmm(..., epilogue="swiglu")` takes: each warpgroup's accumulator holds both halves.
    Raises ValueError when 2I is not a multiple of 2 * block.
    """
    block = block or swiglu_block()
    n = w.shape[-1]
    if n % (2 * block):
        raise ValueError(f"gate|up width {n} must be a multiple of {2 * block}")
    i = n // 2
    g = w[..., :i].reshape(*w.shape[:-1], i // block, 1, block)
    u = w[..., i:].reshape(*w.shape[:-1], i // block, 1, block)
    return jnp.concatenate([g, u], axis=-2).reshape(w.shape)


def deinterleave_gate_up(h, block=None):
    """Inverse of `interleave_gate_up`: [..., 2I] interleaved -> (gate [..., I], up [..., I])."""
    block = block or swiglu_block()
    n = h.shape[-1]
    i = n // 2
    hb = h.reshape(*h.shape[:-1], i // block, 2, block)
    return hb[..., 0, :].reshape(*h.shape[:-1], i), hb[..., 1, :].reshape(*h.shape[:-1], i)


def _column_tiles(n, out_dtype, config, swiglu=False, extra_r=0):
    """(tn, wm, wn) of `gmm`: per-warpgroup column tile, and the rows and columns each compute
    warpgroup owns; the output staging (two warpgroups) stays within 64 KiB."""
    split_m = config.wg_split == "m"
    tn = 128 if swiglu else min(config.tile_n, pick_tile_n(n))
    if extra_r:
        tn = min(tn, 64)
    wm = config.tile_m // 2 if split_m else config.tile_m

    def wg_cols(tn):
        return 2 * tn if split_m else tn
    while 2 * wm * wg_cols(tn) * out_dtype.itemsize > 64 * 1024:
        if swiglu:
            raise ValueError(f"epilogue='swiglu' needs a 2-byte out_dtype, got {out_dtype}")
        tn //= 2
    return tn, wm, wg_cols(tn)


def _gmm_stages(tn, wm, wn, itemsize, out_dtype, config, extra_r=0, swiglu=False):
    """Pipeline stages of `gmm` in shared memory beside its output staging and extra tiles."""
    staging = 2 * wm * wn if swiglu else 2 * 2 * min(_EPI, wm) * min(_EPI, wn)
    fixed = staging * out_dtype.itemsize + 2 * (wm * extra_r + extra_r * wn) * itemsize
    step = (config.tile_m * config.tile_k + config.tile_k * 2 * tn) * itemsize
    return _stages(step, fixed, config.max_concurrent_steps)


def extra_fits(n, r, dtype, *, out_dtype=None, transpose_rhs=False, config=None):
    """None if `gmm(..., extra=(t [M, r], b))` fits at output width n (its tiles and shared
    memory), else the reason. config: as `gmm`'s default for transpose_rhs."""
    config = config or (TRANSPOSED_CONFIG if transpose_rhs else DEFAULT_CONFIG)
    dtype = jnp.dtype(dtype)
    out_dtype = jnp.dtype(out_dtype or dtype)
    try:
        if r % EXTRA_STEP:
            raise ValueError(f"extra width {r} must be a multiple of {EXTRA_STEP}")
        tn, wm, wn = _column_tiles(n, out_dtype, config, extra_r=r)
        _gmm_stages(tn, wm, wn, dtype.itemsize, out_dtype, config, r)
    except ValueError as err:
        return str(err)
    return None


@lower_once
def gmm(x, w, group_sizes, *, transpose_rhs=False, out_dtype=None, config=None, epilogue=None,
        return_h=False, group_offset=None, extra=None):
    """Grouped GEMM: out[i] = x[i] @ w[o + g(i)] (or @ w[o + g(i)]^T when transpose_rhs),
    plus t[i] @ b[g(i)] (or @ b[g(i)]^T) with `extra`.

    Args:
      x: [M, Kc] bf16/f16, rows sorted by group; w: [G, Kc, N] ([G, N, Kc] if transpose_rhs),
        same dtype, G = E without group_offset; group_sizes: [E] int, sum <= M.
      group_offset: None (o = 0), or o as an int32 scalar array (traced: one compiled kernel
        serves every offset): w may then hold more groups than E, e.g. a layer stack
        [L * E, ...] (a free reshape of [L, E, ...]) read in place at layer l with o = l * E.
        The caller keeps 0 <= o <= G - E; it is not checked on the device.
      out_dtype: output dtype (default x.dtype); accumulation is fp32.
      config: TileConfig (default DEFAULT_CONFIG, TRANSPOSED_CONFIG when transpose_rhs).
      epilogue: None, or "swiglu": w's columns are gate/up interleaved in blocks of
        `swiglu_block(config)` (`interleave_gate_up`) and the output is silu(gate) * up
        computed from the fp32 accumulators, [M, N/2] (no transpose_rhs).
      return_h: with epilogue="swiglu", also return the pre-activation h = x @ w [M, N]
        (interleaved layout, out_dtype) for the backward pass.
      extra: None, or (t [M, R], b [E, R, N] ([E, N, R] if transpose_rhs)), same dtype as x,
        R a multiple of 16: one more contraction into the same fp32 accumulator, e.g. a
        LoRA adapter's second factor (x W + (x A) B without writing (x A) B or adding it in
        another pass). b is indexed by the group alone (no group_offset). Each compute
        warpgroup loads its t rows and b columns by TMA while its main loop runs; the column
        tile is then capped at 64 per warpgroup so the pipeline keeps its stages. Not with
        epilogue="swiglu".
    Returns:
      [M, N] ([M, N/2] for swiglu; (act, h) when return_h); rows past sum(group_sizes) are 0.
    Raises:
      ValueError: dtype not bf16/f16, Kc not a multiple of tile_k, N not a multiple of 128
        (256 for swiglu), M < tile_m, a bad config/epilogue, an extra whose shapes do not fit,
        or tiles too large for shared memory.
    """
    config = config or (TRANSPOSED_CONFIG if transpose_rhs else DEFAULT_CONFIG)
    check_dtypes(x, w)
    m, kc = x.shape
    e = w.shape[0] if group_offset is None else group_sizes.shape[0]
    n = w.shape[1] if transpose_rhs else w.shape[2]
    kw = w.shape[2] if transpose_rhs else w.shape[1]
    if kw != kc:
        raise ValueError(f"contraction mismatch: x {x.shape}, w {w.shape}, {transpose_rhs=}")
    if group_sizes.shape != (e,) or e > w.shape[0]:
        raise ValueError(f"group_sizes shape {group_sizes.shape} != ({e},) or more groups than w {w.shape}")
    if config.wg_split not in ("m", "n"):
        raise ValueError(f"wg_split={config.wg_split!r}: expected 'm' or 'n'")
    if epilogue not in (None, "swiglu"):
        raise ValueError(f"epilogue={epilogue!r}: expected None or 'swiglu'")
    swiglu = epilogue == "swiglu"
    if swiglu and (transpose_rhs or n % 256):
        raise ValueError("epilogue='swiglu' needs no transpose_rhs and N % 256 == 0")
    if return_h and not swiglu:
        raise ValueError("return_h needs epilogue='swiglu'")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    tm, tk = config.tile_m, config.tile_k
    split_m = config.wg_split == "m"
    r = 0
    if extra is not None:
        t_x, b_x = extra
        check_dtypes(x, t_x, b_x)
        r = t_x.shape[1]
        b_want = (e, n, r) if transpose_rhs else (e, r, n)
        if swiglu or t_x.shape != (m, r) or r % EXTRA_STEP or tuple(b_x.shape) != b_want:
            raise ValueError(f"extra: t {t_x.shape} and b {b_x.shape} do not fit x {x.shape} "
                             f"(want t [{m}, R], R % {EXTRA_STEP} == 0, b {list(b_want)}; no swiglu)")
    tn, wm, wn = _column_tiles(n, out_dtype, config, swiglu, r)
    if kc % tk:
        raise ValueError(f"contraction width {kc} must be a multiple of tile_k={tk}")
    if m < tm:
        raise ValueError(f"Mosaic GPU grouped GEMM needs at least tile_m={tm} rows, got {m}")
    if split_m and tm % 128:
        raise ValueError(f"wg_split 'm' needs tile_m a multiple of 128, got {tm}")
    m_pad = -m % 8
    if m_pad:  # row tiles need 8-aligned row offsets up to m - tile_m
        x = jnp.pad(x, ((0, m_pad), (0, 0)))
        if extra is not None:
            t_x = jnp.pad(t_x, ((0, m_pad), (0, 0)))
    mp = m + m_pad
    cta_n = 2 * tn
    grid_n = n // cta_n
    k_steps = kc // tk
    table = row_tile_table(group_sizes, mp, tm)
    if group_offset is not None:  # row 4: the group of w each tile reads
        off = jnp.asarray(group_offset, jnp.int32)
        table = jnp.concatenate([table, (jnp.minimum(table[0], e - 1) + off)[None]])
    num_tiles = table.shape[1]
    stages = _gmm_stages(tn, wm, wn, x.dtype.itemsize, out_dtype, config, r, swiglu)
    # Consecutive work items of a CTA run as one pipeline of pipelines (START, STEADY..., STOP):
    # the memory warpgroup loads the next item's first slots while the compute warpgroups finish
    # the current one, instead of draining and refilling the pipeline per item. It needs the
    # k steps to fill whole rounds of the slots, and every CTA to run at least two items (the
    # tiles cover all mp rows, so there are at least mp // tm * grid_n of them).
    # With the extra contraction or the SwiGLU epilogue, k steps that do not fill whole rounds
    # (K 1408 = 22 steps of 64 into 4 slots) are padded: the padding steps load the last block
    # again and skip the wgmma. On the H200 the padding gained 3-5 % on those GEMMs at V2-Lite
    # widths and lost up to 4 % on the plain GEMM, which is therefore not padded.
    pad = extra is not None or swiglu
    pipe_steps = -(-k_steps // stages) * stages if pad else k_steps
    chain = pipe_steps % stages == 0 and mp // tm * grid_n >= 2 * num_sms()
    if chain:  # last row: the number of valid work items (rows lo < hi), in every column
        n_items = jnp.sum(table[3] > table[2]).astype(jnp.int32) * grid_n
        table = jnp.concatenate([table, jnp.broadcast_to(n_items, (1, num_tiles))])
    else:
        pipe_steps = k_steps
    a_tr = _transforms(tk, x.dtype)
    b_tr = _transforms(tk if transpose_rhs else cta_n, x.dtype, swizzle_elems=tk)
    if extra is not None:  # per compute warpgroup: its t rows [wm, R] and b columns
        bx_block = (wn, r) if transpose_rhs else (r, wn)
        t_tr = _transforms(r, x.dtype)
        bx_tr = _transforms(r if transpose_rhs else wn, x.dtype, swizzle_elems=r)
    out_tr = _transforms(min(_EPI, wn), out_dtype)
    em, en = min(_EPI, wm), min(_EPI, wn)  # plain epilogue sub-tile
    b_block = (cta_n, tk) if transpose_rhs else (tk, cta_n)
    last_k = lambda k: jnp.minimum(k, k_steps - 1) if pipe_steps > k_steps else k
    b_index = (lambda k: (0, last_k(k))) if transpose_rhs else (lambda k: (last_k(k), 0))
    half = wn // 2  # swiglu: gate and up columns per warpgroup

    def make_pipeline(body, context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(pipe_steps,),
            memory_registers=config.memory_registers,
            in_specs=[
                plgpu.BlockSpec((tm, tk), lambda k: (0, last_k(k)), transforms=a_tr,
                                delay_release=0),
                plgpu.BlockSpec(b_block, b_index, transforms=b_tr, delay_release=0),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=context,
            pipeline_state=state,
        )

    def _store_tiled(acc, out_smem, o_ref, wg, r0, c0, wlo, whi):
        """Plain epilogue: the warpgroup's [wm, wn] fp32 accumulator, rows [wlo, whi) of it,
        to o_ref[r0:, c0:] in em x en sub-tiles through two staging slots, so that writing
        one slot overlaps the TMA store from the other. Sub-tiles without rows store nothing,
        so the previous item's last store may have used either slot: all of them are awaited
        first (issued before this item's main loop, they are long done)."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for i in range((wm // em) * (wn // en)):
            mi, nj = divmod(i, wn // en)
            sub = acc[mi * em:(mi + 1) * em, nj * en:(nj + 1) * en].astype(out_dtype)
            slo = jnp.clip(wlo - mi * em, 0, em)
            shi = jnp.clip(whi - mi * em, 0, em)
            full = (slo == 0) & (shi == em)
            dst = o_ref.at[pl.ds(r0 + mi * em, em), pl.ds(c0 + nj * en, en)]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            for w in range(2):
                swizzled, row_major = out_smem[w][i % 2]

                @pl.when((wg == w) & full)
                def _(swizzled=swizzled):
                    swizzled[...] = sub
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(swizzled, dst)

                @pl.when((wg == w) & jnp.logical_not(full) & (shi > slo))
                def _(row_major=row_major):
                    row_major[...] = sub
                    plgpu.commit_smem()
                    _store_rows(row_major, dst, slo, shi, em)

    def kernel(table_ref, x_ref, w_ref, *refs):
        t_ref, b_ref = refs[:2] if extra is not None else (None, None)
        refs = refs[2:] if extra is not None else refs
        o_ref = refs[0]
        h_ref = refs[1] if return_h else None
        ignore = lambda *_, **__: None
        w_view0 = (w_ref.at[0, pl.ds(0, cta_n), :] if transpose_rhs
                   else w_ref.at[0, :, pl.ds(0, cta_n)])
        out_shape = (2, 2, wm, half) if swiglu else (2, wm, wn)

        @functools.partial(
            pl.run_scoped,
            allocs=make_pipeline(ignore, ignore).get_allocations(
                x_ref.at[pl.ds(0, tm), :], w_view0),
            # plain path: each warpgroup's buffer seen two ways, swizzled (wgmma's register
            # layout stores into it without bank conflicts; TMA stores whole tiles from it) and
            # row-major (partial tiles store any row range from it)
            out_smem=plgpu.SMEM(out_shape, out_dtype) if swiglu else tuple(
                tuple(plgpu.RefUnion(plgpu.SMEM((em, en), out_dtype, transforms=out_tr),
                                     plgpu.SMEM((em, en), out_dtype))
                      for _ in range(2))
                for _ in range(2)),
            extra_smem=None if extra is None else (
                plgpu.SMEM((2, wm, r), x.dtype, transforms=t_tr),
                plgpu.SMEM((2, *bx_block), x.dtype, transforms=bx_tr)),
            extra_bar=None if extra is None else plgpu.Barrier(num_barriers=4),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem, extra_smem, extra_bar):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((num_tiles * grid_n,), collective_axes="sm")
            def _item(info):
                (idx,) = info.index
                t = idx // grid_n
                ni = idx % grid_n
                g = table_ref[0, t]
                row0 = pl.multiple_of(table_ref[1, t], 8)
                lo = table_ref[2, t]
                hi = table_ref[3, t]
                real = g < e  # group e = rows past sum(group_sizes): store zeros
                gw = jnp.minimum(g, e - 1) if group_offset is None else table_ref[4, t]
                if split_m:  # this warpgroup's rows [wlo, whi) of its wm-row half
                    wlo = jnp.clip(lo - wg * wm, 0, wm)
                    whi = jnp.clip(hi - wg * wm, 0, wm)
                    r0 = row0 + wg * wm
                    c0 = ni * cta_n
                else:
                    wlo, whi, r0, c0 = lo, hi, row0, ni * cta_n + wg * tn
                active = real & (whi > wlo)

                @pl.when(hi > lo)
                def _():
                    def mma(idx, a_smem, b_smem, acc_ref):
                        @pl.when(active & (idx[0] < k_steps) if pipe_steps > k_steps else active)
                        def _():
                            if split_m:
                                a = a_smem.at[pl.ds(pl.multiple_of(wg * wm, wm), wm)]
                                b = b_smem.transpose((1, 0)) if transpose_rhs else b_smem
                            else:
                                a = a_smem
                                b = (b_smem.at[pl.ds(wg * tn, tn), :].transpose((1, 0))
                                     if transpose_rhs else b_smem.at[:, pl.ds(wg * tn, tn)])
                            plgpu.wgmma(acc_ref, a, b)
                            plgpu.wgmma_wait(0)
                        return acc_ref

                    def context(run):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
                        def _acc(acc_ref):
                            if extra is not None:  # this warpgroup's own slots and barriers
                                t_s, b_s = extra_smem[0].at[wg], extra_smem[1].at[wg]
                                gb = jnp.minimum(g, e - 1)
                                b_src = (b_ref.at[gb, pl.ds(c0, wn), :] if transpose_rhs
                                         else b_ref.at[gb, :, pl.ds(c0, wn)])
                                plgpu.copy_gmem_to_smem(t_ref.at[pl.ds(r0, wm), :], t_s,
                                                        extra_bar.at[2 * wg])
                                plgpu.copy_gmem_to_smem(b_src, b_s, extra_bar.at[2 * wg + 1])
                            run(acc_ref)
                            if extra is not None:
                                plgpu.barrier_wait(extra_bar.at[2 * wg])
                                plgpu.barrier_wait(extra_bar.at[2 * wg + 1])

                                @pl.when(active)
                                def _():
                                    plgpu.wgmma(acc_ref, t_s,
                                                b_s.transpose((1, 0)) if transpose_rhs else b_s)
                            plgpu.wgmma_wait(0)
                            acc = acc_ref[...]
                            rows = pl.ds(r0, wm)
                            if not swiglu:
                                _store_tiled(acc, out_smem, o_ref, wg, r0, c0, wlo, whi)
                                return
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            gate = acc[:, :half]
                            up = acc[:, half:]
                            if return_h:
                                out_smem[wg, 0] = gate.astype(out_dtype)
                                out_smem[wg, 1] = up.astype(out_dtype)
                                plgpu.commit_smem()
                                for j in range(2):
                                    _store_rows(out_smem.at[wg, j],
                                                h_ref.at[rows, pl.ds(c0 + j * half, half)],
                                                wlo, whi, wm)
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            act = gate * jax.nn.sigmoid(gate) * up
                            out_smem[wg, 0] = act.astype(out_dtype)
                            plgpu.commit_smem()
                            _store_rows(out_smem.at[wg, 0],
                                        o_ref.at[rows, pl.ds(c0 // 2, half)], wlo, whi, wm)

                    w_view = (w_ref.at[gw, pl.ds(ni * cta_n, cta_n), :] if transpose_rhs
                              else w_ref.at[gw, :, pl.ds(ni * cta_n, cta_n)])
                    state = None
                    if chain:  # valid items are a prefix of the item order
                        last = (table_ref[table.shape[0] - 1, 0] - 1 - lax.axis_index("sm")) \
                            // num_sms()
                        j = info.local_index
                        state = jnp.where(j == 0, plgpu.PipelinePipeline.START,
                                          jnp.where(j == last, plgpu.PipelinePipeline.STOP,
                                                    plgpu.PipelinePipeline.STEADY))
                    make_pipeline(mma, context, state)(
                        x_ref.at[pl.ds(row0, tm), :], w_view, allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_n = n // 2 if swiglu else n
    out_type = [jax.ShapeDtypeStruct((mp, out_n), out_dtype)]
    if return_h:
        out_type.append(jax.ShapeDtypeStruct((mp, n), out_dtype))
    call = plgpu.kernel(
        kernel,
        out_type=tuple(out_type),
        grid=(num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=default_interpret(),
    )
    operands = (table, x, w) + ((t_x, b_x) if extra is not None else ())
    outs = [o[:m] if m_pad else o for o in call(*operands)]
    return tuple(outs) if return_h else outs[0]

