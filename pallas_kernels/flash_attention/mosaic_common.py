"""What the Mosaic GPU flash-attention kernels share: their Config, shared-memory budget, the
per-tile column ranges, wgmma and barrier helpers, and the padding of the inputs.

Legend: B batch, T/S query/key length (Tp/Sp padded to the CTA tile), N query heads, K kv heads,
G = N // K, Dqk q/k head dim, Dv value head dim, bq/bkv tile rows.

Layout of every kernel (FlashAttention-3, Shah et al. 2024, arXiv 2407.08608, sec. 3.1): a CTA
of three warpgroups, one memory warpgroup that streams the tiles of a loop by TMA into a ring of
`stages` shared-memory slots, and two compute warpgroups that each own a 64-row tile (one wgmma
M tile) and issue wgmma. Softmax runs in base 2: s2 = s * scale * log2(e), lse2 = m2 + log2(l).

Masking: `tile_ranges` computes, for every 64-row tile, the range of column blocks that can hold
an unmasked entry [lo, hi) and the sub-range that needs no element mask [mlo, mhi) (causal,
ragged lengths, segment min/max); fully masked tiles are never loaded nor computed. The CTA
(two tiles) streams the union [L, H) of its tiles' ranges; a warpgroup outside its own range
only keeps the barriers in step ("skip" steps).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)    # one value per row of a [rows, cols] WGMMA tile
COL = plgpu.Layout.WGMMA.reduce(0)    # one value per column
NAMED_BAR0 = 4                        # hardware barriers 0..3: Mosaic GPU's (CTA, warpgroups)
NUM_HW_BARRIERS = 16                  # per CTA

DKV_ISSUE = ("serial", "sdp1")
DQ_REGS = ("", "do")


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles, pipeline depths and the two backward schedules that `default_config` picks by head
    dims. Rows per compute warpgroup are 64 (one wgmma M tile); two warpgroups per CTA.

    dkv_issue, the dk/dv kernel's order of products per query block: "serial" starts the S^T
    and dP^T accumulators at -lse / c2 and -delta (so neither row vector is live beside a
    [bkv, bq] tile) and waits for each product before the next; "sdp1" issues S^T and dP^T
    back to back and computes P^T while dP^T runs (more registers live at once).
    dq_regs: "do" loads the dq kernel's dO tile into registers once and issues dP = dO V^T
    with A from registers (only V is read from shared memory in the key loop); "" keeps it in
    shared memory. GPU interpret mode always keeps it there (its wgmma reads shared memory).
    """
    block_q: int = 64        # forward / dq: query rows per warpgroup
    block_kv: int = 128      # forward: keys per pipeline step
    stages: int = 2          # forward: K/V pipeline depth
    block_kv_dq: int = 64    # dq kernel: keys per step
    block_kv_dkv: int = 64   # dkv kernel: key rows per warpgroup
    block_q_dkv: int = 64    # dkv kernel: query rows per step
    stages_bwd: int = 2
    dkv_issue: str = "serial"
    dq_regs: str = ""

    def __post_init__(self):
        for name, allowed in (("dkv_issue", DKV_ISSUE), ("dq_regs", DQ_REGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Config.{name}={getattr(self, name)!r}: expected one of "
                                 f"{allowed}")
        # named barriers: one per slot of the two streamed kinds, plus two turn signals
        if 2 * max(self.stages, self.stages_bwd) + 2 > NUM_HW_BARRIERS - NAMED_BAR0:
            raise ValueError(f"Config: stages={self.stages}, stages_bwd={self.stages_bwd} need "
                             f"more than the {NUM_HW_BARRIERS - NAMED_BAR0} free hardware "
                             "barriers")


SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_BYTES = 220 * 1024    # of the H100/H200's 227 KiB per block, leaving room for barriers


def smem_bytes(Dqk, Dv, cfg: Config):
    """Shared memory (bytes, 2-byte inputs) of the forward, dq and dkv kernels."""
    qo = Dqk if Dv <= Dqk else Dqk + Dv      # O reuses Q's buffer when it fits
    fwd = 2 * cfg.block_q * qo * 2 + cfg.stages * cfg.block_kv * (Dqk + Dv) * 2
    dq = (2 * cfg.block_q + cfg.stages_bwd * cfg.block_kv_dq) * (Dqk + Dv) * 2
    dkv = (2 * cfg.block_kv_dkv + cfg.stages_bwd * cfg.block_q_dkv) * (Dqk + Dv) * 2
    dkv += cfg.stages_bwd * cfg.block_q_dkv * 2 * 4    # fp32 lse and delta rows per stage
    return fwd, dq, dkv


def default_config(Dqk, Dv) -> Config:
    """Largest tiles that fit shared memory: 128-key forward steps and 2-deep backward
    pipelines up to Dqk + Dv = 320 (MLA 192/128); 64-key steps / 1-deep backward for 256/256.
    The dk/dv kernel overlaps P with the dP product (dkv_issue "sdp1") only up to
    Dqk + Dv = 256: with MLA's 192-wide dK accumulator the extra live registers spill (H200:
    128/128 dk/dv 1.19 -> 1.08 ms, MLA 1.55 -> 1.98 ms). The dq kernel takes dO from registers
    (dq_regs "do") only at 192/128, where it was measured faster (128/128 was not)."""
    cfg = Config(dkv_issue="sdp1" if Dqk + Dv <= 256 else "serial",
                 dq_regs="do" if (Dqk, Dv) == (192, 128) else "")
    if smem_bytes(Dqk, Dv, cfg)[0] > SMEM_BYTES:
        cfg = dataclasses.replace(cfg, block_kv=64)
    if max(smem_bytes(Dqk, Dv, cfg)[1:]) > SMEM_BYTES:
        cfg = dataclasses.replace(cfg, stages_bwd=1)
    return cfg


def check_supported(q, k, v, cfg: Config | None = None):
    """Raise ValueError for inputs the Mosaic kernels cannot take."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype}: the Mosaic GPU kernel takes bfloat16 or float16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    Dqk, Dv = q.shape[-1], v.shape[-1]
    for name, d in (("Dqk", Dqk), ("Dv", Dv)):
        if d % 64 or d > 256:
            raise ValueError(f"{name}={d}: the Mosaic GPU kernel takes head dims that are multiples"
                             " of 64 and at most 256")
    cfg = default_config(Dqk, Dv) if cfg is None else cfg
    need = smem_bytes(Dqk, Dv, cfg)
    if max(need) > SMEM_BYTES:
        raise ValueError(f"Dqk={Dqk}, Dv={Dv} with {cfg}: needs {max(need)} bytes of shared memory"
                         f" (fwd, dq, dkv = {need}); the limit is {SMEM_BYTES}")


# ----------------------------------------------------------------------------------------------
# Tile ranges (plain jnp, runs in XLA before the kernels).
# ----------------------------------------------------------------------------------------------

def _seg_minmax(seg, n_real, block):
    """Per-block min and max segment id over the real positions: [B, nblocks] each."""
    Bn, P = seg.shape
    pos = jnp.arange(P)
    big = jnp.iinfo(jnp.int32).max
    real = (pos < n_real)[None]
    smin = jnp.where(real, seg, big).reshape(Bn, P // block, block).min(-1)
    smax = jnp.where(real, seg, -big).reshape(Bn, P // block, block).max(-1)
    return smin, smax


def tile_ranges(**kw):
    """`_tile_ranges_jnp`; evaluated while tracing when nothing in it is traced (no segments,
    static offsets: `delta` a Python int), so the tables are constants of the program instead
    of ~8 small XLA kernels per kernel launch (H200: 1-3 us each)."""
    if kw["q_seg"] is None and isinstance(kw["delta"], int):
        with jax.ensure_compile_time_eval():
            return _tile_ranges_jnp(**kw)
    return _tile_ranges_jnp(**kw)


def _tile_ranges_jnp(*, B, n_rows_p, row_block, n_cols_p, col_block, rows_are_q, T, S, causal,
                     delta, q_seg, kv_seg):
    """Column-block ranges per row tile and per CTA (two row tiles).

    Returns wg_bounds [B, n_row_tiles, 4] int32 = (lo, mlo, mhi, hi) and cta_bounds
    [B, n_row_tiles // 2, 2] int32 = (L, H), with L <= lo <= mlo <= mhi <= hi <= H. Columns in
    [lo, mlo) and [mhi, hi) need the element mask; [mlo, mhi) need none: no padded key, fully
    below the causal diagonal and, with segments, one segment id over the block's queries and
    keys (a block that straddles a document boundary is masked).
    """
    nr, nc = n_rows_p // row_block, n_cols_p // col_block
    r = jnp.arange(nr)[:, None]
    c = jnp.arange(nc)[None, :]
    if rows_are_q:
        q_lo, q_hi = r * row_block, r * row_block + row_block - 1
        k_lo, k_hi = c * col_block, c * col_block + col_block - 1
        q_real, k_real = q_lo < T, k_lo < S
        no_pad = k_hi < S        # padded keys must be masked; padded queries are harmless
    else:
        k_lo, k_hi = r * row_block, r * row_block + row_block - 1
        q_lo, q_hi = c * col_block, c * col_block + col_block - 1
        q_real, k_real = q_lo < T, k_lo < S
        no_pad = jnp.ones_like(k_real)
    nonempty = q_real & k_real
    full = no_pad
    if causal:
        nonempty = nonempty & (k_lo <= q_hi + delta)
        full = full & (k_hi <= q_lo + delta)
    nonempty = jnp.broadcast_to(nonempty, (B, nr, nc))
    full = jnp.broadcast_to(full, (B, nr, nc))
    if q_seg is not None:
        qmin, qmax = _seg_minmax(q_seg, T, row_block if rows_are_q else col_block)
        kmin, kmax = _seg_minmax(kv_seg, S, col_block if rows_are_q else row_block)
        # per row block [B, nr, 1] and per column block [B, 1, nc]
        (rmin, rmax), (cmin, cmax) = ((qmin, qmax), (kmin, kmax)) if rows_are_q else (
            (kmin, kmax), (qmin, qmax))
        rmin, rmax, cmin, cmax = rmin[:, :, None], rmax[:, :, None], cmin[:, None], cmax[:, None]
        nonempty = nonempty & (rmin <= cmax) & (cmin <= rmax)   # their id ranges meet
        # A block needs no segment mask when its queries and its keys all carry one and the
        # same id (documents longer than a block, or one segment per row): only those skip it.
        full = full & (rmin == rmax) & (cmin == cmax) & (rmin == cmin)
    full = full & nonempty
    idx = jnp.arange(nc)
    any_ne = nonempty.any(-1)
    lo = jnp.where(any_ne, jnp.argmax(nonempty, -1), 0)
    hi = jnp.where(any_ne, nc - jnp.argmax(nonempty[..., ::-1], -1), 0)
    in_rng = (idx >= lo[..., None]) & (idx < hi[..., None])
    f = full & in_rng
    mlo = jnp.where(f.any(-1), jnp.argmax(f, -1), hi)
    after = (~f) & (idx >= mlo[..., None]) & in_rng
    mhi = jnp.where(after.any(-1), jnp.argmax(after, -1), hi)
    mhi = jnp.maximum(mhi, mlo)
    # CTA union over its two row tiles (empty tiles do not count).
    ne2 = any_ne.reshape(B, nr // 2, 2)
    big = nc + 1
    L = jnp.where(ne2, lo.reshape(B, nr // 2, 2), big).min(-1)
    H = jnp.where(ne2, hi.reshape(B, nr // 2, 2), -1).max(-1)
    L = jnp.where(ne2.any(-1), L, 0)
    H = jnp.where(ne2.any(-1), H, 0)
    Lr = jnp.repeat(L, 2, axis=-1)
    lo, mlo, mhi, hi = (jnp.where(any_ne, x, Lr) for x in (lo, mlo, mhi, hi))
    wg = jnp.stack([lo, mlo, mhi, hi], -1).astype(jnp.int32)
    cta = jnp.stack([L, H], -1).astype(jnp.int32)
    return wg, cta


def query_ranges(B, Tp, Sp, T, S, causal, delta, q_seg, kv_seg, cfg, block_kv, static_delta):
    """`tile_ranges` of the kernels whose rows are query tiles (forward, dq)."""
    return tile_ranges(B=B, n_rows_p=Tp, row_block=cfg.block_q, n_cols_p=Sp, col_block=block_kv,
                       rows_are_q=True, T=T, S=S, causal=causal,
                       delta=delta0(delta, static_delta), q_seg=q_seg, kv_seg=kv_seg)


# ----------------------------------------------------------------------------------------------
# In-kernel helpers.
# ----------------------------------------------------------------------------------------------

def mm(a, b, shape, acc=None, *, interpret, stage=None, a_in_regs=False):
    """wgmma a @ b into a fresh fp32 [shape] accumulator, plus `acc` if given.

    `a` may be a register array (a_in_regs; compiled: wgmma's A-from-registers form). GPU
    interpret mode only reads wgmma operands from SMEM, so there `a` is first stored to `stage`.
    """
    if interpret and a_in_regs:
        stage[...] = a
        a = stage
    if acc is not None and not interpret:
        def body(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
        return pl.run_state(body)(plgpu.ACC.init(acc))

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]
    out = pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))
    return out if acc is None else acc + out


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def tiled(shape, dtype, swizzle=128):
    """A shared-memory buffer in wgmma's layout: (8, swizzle / itemsize) tiles, `swizzle`-byte
    swizzle (128 for 2-byte inputs: (8, 64) tiles)."""
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)),
                                                plgpu.SwizzleTransform(swizzle)))


def _named_bar(operation, barrier_id, num_threads):
    """PTX `bar.{operation} barrier_id, num_threads` on a hardware named barrier (operation
    "sync": arrive and wait; "arrive": do not wait); barrier_id a Python int or a traced int32
    scalar. The inner function's name (`bar_op`) and closure (`operation`, `num_threads`,
    `barrier_id`) are what GPU interpret mode recognises (with
    `_hopper.INTERPRET_NAMED_BARRIERS`), so the interpreter and its race detector run these
    barriers too."""
    from jax.experimental.mosaic import gpu as mgpu
    if isinstance(barrier_id, int):
        @plgpu.inline_mgpu()
        def bar_op(_):
            mgpu.utils.inline_ptx(f"bar.{operation} {barrier_id}, {num_threads};",
                                  has_side_effects=True, convergent=True)
        bar_op()
    else:
        @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
        def bar_op(_, i):
            mgpu.utils.inline_ptx(f"bar.{operation} $0, {num_threads};", i.registers[()],
                                  has_side_effects=True, convergent=True)
        bar_op(jnp.asarray(barrier_id, jnp.int32))


def named_sync(barrier_id: int, num_threads: int):
    """Wait until `num_threads` threads (whole warpgroups, e.g. 2 x 128 for two compute
    warpgroups) have reached hardware named barrier `barrier_id` (PTX bar.sync; runs in GPU
    interpret mode too). Ids NAMED_BAR0 and up are free of Mosaic GPU's own."""
    _named_bar("sync", barrier_id, num_threads)


class Sync:
    """A kernel's "slot consumed" signals (two compute warpgroups -> the memory warpgroup) and
    the compute warpgroups' turn signals, as PTX named barriers (bar.arrive / bar.sync): hardware
    barrier NAMED_BAR0 + i, the `kinds` in order, `stages` slots each, then the two turns. The
    TMA completion signals stay mbarriers. A named barrier counts arrivals without phases; every
    protocol here lets a side arrive again only after the other side has waited."""

    def __init__(self, kinds, *, stages):
        self.kinds, self.stages = list(kinds), stages

    def _id(self, kind, slot):
        return NAMED_BAR0 + self.kinds.index(kind) * self.stages + slot

    def free(self, kind, slot):
        """Compute warpgroup: done reading `kind`'s shared-memory slot."""
        _named_bar("arrive", self._id(kind, slot), 3 * 128)

    def wait_free(self, kind, slot):
        """Memory warpgroup: wait until both compute warpgroups freed the slot."""
        _named_bar("sync", self._id(kind, slot), 3 * 128)

    def turn_wait(self, wg):
        _named_bar("sync", NAMED_BAR0 + len(self.kinds) * self.stages + wg, 2 * 128)

    def turn_pass(self, wg):
        _named_bar("arrive", NAMED_BAR0 + len(self.kinds) * self.stages + 1 - wg, 2 * 128)


def compiler_params():
    return plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=False)


# ----------------------------------------------------------------------------------------------
# Padding to the CTA tiles.
# ----------------------------------------------------------------------------------------------

def _round_up(x, m):
    return -(-x // m) * m


def pad_to(x, axis, size, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def prepare(q, k, v, segs, offsets, *, cfg, static_delta=None):
    """q, k, v padded to the CTA tiles (Tp, Sp), delta = q_offset - kv_offset as an int32 [1]
    array, and the padded segment ids (or None).
    Returns (qp, kp, vp, q_seg, kv_seg, delta, T, S, Tp, Sp)."""
    B, T, N, _ = q.shape
    S = k.shape[1]
    tile_t = 2 * cfg.block_q
    tile_s = max(cfg.block_kv, 2 * cfg.block_kv_dkv, cfg.block_kv_dq)
    Tp, Sp = _round_up(T, tile_t), _round_up(S, tile_s)
    qp, kp, vp = pad_to(q, 1, Tp), pad_to(k, 1, Sp), pad_to(v, 1, Sp)
    if static_delta is not None:
        delta = jnp.full((1,), static_delta, jnp.int32)
    else:
        delta = (jnp.asarray(offsets[0], jnp.int32)
                 - jnp.asarray(offsets[1], jnp.int32)).reshape(1)
    if segs is not None:
        q_seg = pad_to(segs[0].astype(jnp.int32), 1, Tp)
        kv_seg = pad_to(segs[1].astype(jnp.int32), 1, Sp)
    else:
        q_seg = kv_seg = None
    return qp, kp, vp, q_seg, kv_seg, delta, T, S, Tp, Sp


def delta0(delta, static_delta):
    """q_offset - kv_offset for the range tables: the Python int when static, else traced."""
    return int(static_delta) if static_delta is not None else delta[0]
