"""Flash attention forward and backward for Hopper in Pallas Mosaic GPU (TMA, wgmma, warp
specialisation), for MLA shapes (Dqk != Dv) and equal head dims.

Legend: B batch, T/S query/key length (Tp/Sp padded to the CTA tile), N query heads, K kv heads,
G = N // K, Dqk q/k head dim, Dv value head dim, bq/bkv tile rows.

Maths: FlashAttention-2 online softmax and its backward (Dao 2023, arXiv 2307.08691, Alg. 1-2),
with the FlashAttention-3 layout (Shah et al. 2024, arXiv 2407.08608, sec. 3.1): one TMA
producer warpgroup, two consumer warpgroups that each own a 64-row tile, a "ping-pong" schedule
barrier in the forward pass, whose key loop is software-pipelined (sec. 3.2: the P V product of
block j - 1 is issued together with Q K^T of block j). Softmax runs in base 2: s2 = s * scale * log2(e), lse2 = m2 + log2(l).

Masking: the wrapper computes, for every 64-row tile, the range of column blocks that can hold
an unmasked entry [lo, hi) and the sub-range that needs no element mask [mlo, mhi) (causal,
ragged lengths, segment min/max); fully masked tiles are never loaded nor computed. The CTA
(two tiles) streams the union [L, H) of its tiles' ranges; a warpgroup outside its own range
only keeps the barriers in step ("skip" steps).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
_WGMMA = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)   # one value per row of a [rows, cols] WGMMA tile
_COL = plgpu.Layout.WGMMA.reduce(0)   # one value per column
_M_INIT = -1e30                       # finite running-max start: no inf - inf on empty rows
_NAMED_BAR0 = 4                       # hardware barriers 0..3: Mosaic GPU's (CTA, warpgroups)


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes. Rows per compute warpgroup are 64 (one wgmma M tile); two warpgroups per CTA."""
    block_q: int = 64        # forward / dq: query rows per warpgroup
    block_kv: int = 128      # forward: keys per pipeline step
    stages: int = 2          # forward: K/V pipeline depth
    block_kv_dq: int = 64    # dq kernel: keys per step
    block_kv_dkv: int = 64   # dkv kernel: key rows per warpgroup
    block_q_dkv: int = 64    # dkv kernel: query rows per step
    stages_bwd: int = 2
    # Forward (v3): causal grids run the query tiles with the most key blocks first, so the
    # launch does not end on a wave of the longest tiles (H200: MLA B4 T4096 fwd 509-514 ->
    # 558 TFLOP/s, RESULTS.md "v3 forward").
    fwd_longest_first: bool = True
    # Backward schedule (session 4, RESULTS.md "v4 backward schedules"; the measured-best
    # values are the defaults, default_config picks dkv_issue by head dims).
    # bwd_longest_first: the dq kernel's causal grid runs its later query tiles (more keys)
    # first, as the forward does (the dk/dv grid is longest first already: key tile 0 sees
    # every query). dq_issue / dkv_issue: "serial" waits for each wgmma before issuing the
    # next; "sdp" issues the two products that read only shared memory (S and dP) back to back
    # and waits once; "sdp1" waits for S only and computes P while dP runs; "dvdp" (dk/dv
    # kernel only) issues dV += P^T dO (P from registers) and then dP^T back to back.
    bwd_longest_first: bool = True
    dq_issue: str = "sdp1"
    dkv_issue: str = "serial"
    # dkv_fold (dkv_issue "serial" only): start the S^T and dP^T accumulators at -lse / c2 and
    # -delta instead of subtracting those row vectors from the products.
    dkv_fold: bool = True
    # setmaxnreg (compute warpgroups, TMA warpgroup): 2 * compute + memory <= 512 (64K
    # registers / 128 threads). FA3 uses (240, 24).
    regs_fwd: tuple = (232, 40)
    regs_bwd: tuple = (240, 24)
    # Session 5 (RESULTS.md "v5 forward"). fwd_pipe: software-pipelined forward (FA3 sec. 3.2,
    # with P V issued first so no register operand is fenced while a product is in flight):
    # step j issues O += P_{j-1} V_{j-1} and then S_j = Q K_j^T, waits once for both and runs
    # softmax(S_j) while the other warpgroup's products run (the ping-pong is a strict turn
    # per step). H200, interleaved timing: MLA B4 T4096 529 -> 543 TFLOP/s, T16384 587 -> 626,
    # 128/128 flat (475 -> 473).
    fwd_pipe: bool = True
    # no_auto_barriers: CompilerParams(unsafe_no_auto_barriers=True) for all three kernels
    # (tokamax sets it); safe here: no thread reads and then writes one shared-memory region
    # without a commit_smem (which has a warpgroup barrier) between. Measured neutral on the
    # H200 (forward and backward within run-to-run noise), so off.
    no_auto_barriers: bool = False
    # Session 8 (RESULTS.md "v8"). fwd_fma: the forward's row max is taken on the raw scores
    # and P = exp2(s * c2 - m2) is one FMA per element (no separately scaled copy of S).
    # H200: MLA B4 forward 551 -> 578 TFLOP/s, 128/128 485 -> 521. named_barriers: the
    # "slot consumed" signals of all three kernels and the turn signals are PTX named
    # barriers (bar.arrive / bar.sync, as tokamax's kernels use) instead of mbarriers; the
    # TMA completion barriers stay mbarriers. H200: MLA B4 backward 2.14 -> 2.05 ms, 128/128
    # flat. GPU interpret mode keeps mbarriers unless its params set
    # inline_mgpu=INTERPRET_NAMED_BARRIERS (`interpret_params()`, which the tests use).
    fwd_fma: bool = True
    named_barriers: bool = True
    # dkv_stat_smem: the dk/dv kernel's memory warpgroup TMA-loads each query block's lse and
    # delta rows beside Q and dO (FA3 does the same), instead of every compute warpgroup
    # loading them from global memory in every step (an L2 round trip before the S^T and
    # dP^T products). H200: backward 128/128 1.69 -> 1.60 ms, MLA B4 2.11 -> 2.07 ms;
    # gradients bitwise unchanged.
    dkv_stat_smem: bool = True
    # Session 9. dq_regs: the dq kernel loads one of its warpgroup's fixed tiles into registers
    # once (bf16: "q" [64, Dqk], Dqk / 4 registers per thread; "do" [64, Dv], Dv / 4) and
    # issues S = Q K^T ("q") or dP = dO V^T ("do") with A from registers, so the key loop reads
    # only K (V) from shared memory for that product. "" keeps both in shared memory. GPU
    # interpret mode always does (its wgmma reads operands from there). The same for the
    # forward's S product ran at 425 instead of 611 TFLOP/s (RESULTS.md "v9"). default_config
    # picks "do" at 192/128.
    dq_regs: str = ""

    def __post_init__(self):
        for name, allowed in (("dq_issue", DQ_ISSUE), ("dkv_issue", DKV_ISSUE),
                              ("dq_regs", DQ_REGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Config.{name}={getattr(self, name)!r}: expected one of "
                                 f"{allowed}")
        if self.named_barriers and 2 * max(self.stages, self.stages_bwd) + 2 > 16 - _NAMED_BAR0:
            raise ValueError(f"Config.named_barriers: stages={self.stages}, stages_bwd="
                             f"{self.stages_bwd} need more than the {16 - _NAMED_BAR0} free "
                             "hardware barriers")
        for name in ("regs_fwd", "regs_bwd"):
            rc, rm = getattr(self, name)
            if rc % 8 or rm % 8 or not (24 <= rm <= rc <= 256) or 2 * rc + rm > 512:
                raise ValueError(f"Config.{name}={(rc, rm)}: need multiples of 8, 24 <= memory"
                                 " <= compute <= 256 and 2 * compute + memory <= 512")


DQ_ISSUE = ("serial", "sdp", "sdp1")
DKV_ISSUE = ("serial", "sdp", "sdp1", "dvdp")
DQ_REGS = ("", "q", "do")


SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_BYTES = 220 * 1024    # of the H100/H200's 227 KiB per block, leaving room for barriers


def smem_bytes(Dqk, Dv, cfg: Config):
    """Shared memory (bytes, 2-byte inputs) of the forward, dq and dkv kernels."""
    qo = Dqk if Dv <= Dqk else Dqk + Dv      # O reuses Q's buffer when it fits
    fwd = 2 * cfg.block_q * qo * 2 + cfg.stages * cfg.block_kv * (Dqk + Dv) * 2
    dq = (2 * cfg.block_q + cfg.stages_bwd * cfg.block_kv_dq) * (Dqk + Dv) * 2
    dkv = (2 * cfg.block_kv_dkv + cfg.stages_bwd * cfg.block_q_dkv) * (Dqk + Dv) * 2
    if cfg.dkv_stat_smem:    # fp32 lse and delta rows per stage
        dkv += cfg.stages_bwd * cfg.block_q_dkv * 2 * 4
    return fwd, dq, dkv


def default_config(Dqk, Dv) -> Config:
    """Largest tiles that fit shared memory: 128-key forward steps and 2-deep backward
    pipelines up to Dqk + Dv = 320 (MLA 192/128); 64-key steps / 1-deep backward for 256/256.
    The dk/dv kernel overlaps P with the dP product (dkv_issue "sdp1") only up to
    Dqk + Dv = 256: with MLA's 192-wide dK accumulator the extra live registers spill (H200:
    128/128 dk/dv 1.19 -> 1.08 ms, MLA 1.55 -> 1.98 ms). The dq kernel takes dO from registers
    (dq_regs "do") only where that was measured faster, at 192/128 (RESULTS.md "v9"; 128/128
    was not)."""
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


def _tile_ranges(**kw):
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
    [lo, mlo) and [mhi, hi) need the element mask; [mlo, mhi) need none.
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
        if rows_are_q:
            meet = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])
        else:
            meet = (kmin[:, :, None] <= qmax[:, None, :]) & (qmin[:, None, :] <= kmax[:, :, None])
        nonempty = nonempty & meet
        full = jnp.zeros_like(full)
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


# ----------------------------------------------------------------------------------------------
# Shared in-kernel helpers.
# ----------------------------------------------------------------------------------------------

def _mm(a, b, shape, acc=None, *, interpret, stage=None, a_in_regs=False):
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


def _mm_two(a1, b1, shape1, a2, b2, shape2, *, interpret, between=None):
    """Two wgmmas from shared memory issued back to back: (a1 @ b1, a2 @ b2) in fresh fp32
    accumulators, one wait for both (one pipeline drain instead of two). With `between`, waits
    for the first product only, returns (between(first), second) and runs `between` while the
    second product is on the tensor cores."""
    if interpret:
        x1 = _mm(a1, b1, shape1, interpret=interpret)
        x2 = _mm(a2, b2, shape2, interpret=interpret)
        return (x1 if between is None else between(x1)), x2

    def body(r1, r2):
        plgpu.wgmma(r1, a1, b1)
        plgpu.wgmma(r2, a2, b2)
        if between is None:
            return r1[...], r2[...]
        y = between(plgpu.wgmma_accumulator_load(r1, wait_n=1))
        return y, plgpu.wgmma_accumulator_load(r2, wait_n=0)
    return pl.run_scoped(body, plgpu.ACC(shape1, jnp.float32), plgpu.ACC(shape2, jnp.float32))


def _mm_acc_then_fresh(a1, b1, acc1, a2, b2, shape2, *, interpret, stage, after_issue=None):
    """(acc1 + a1 @ b1, a2 @ b2) with a1 in registers, issued in that order, one wait: the
    register operand is fenced before the first product starts. `after_issue()` runs once both
    products are issued, before the wait."""
    if interpret:
        x1 = _mm(a1, b1, acc1.shape, acc1, interpret=interpret, stage=stage, a_in_regs=True)
        x2 = _mm(a2, b2, shape2, interpret=interpret)
        if after_issue is not None:
            after_issue()
        return x1, x2

    def body(refs):
        r1, r2 = refs
        plgpu.wgmma(r1, a1, b1)
        plgpu.wgmma(r2, a2, b2)
        if after_issue is not None:
            after_issue()
    zero = plgpu.layout_cast(jnp.zeros(shape2, jnp.float32), _WGMMA)
    return pl.run_state(body)((plgpu.ACC.init(acc1), plgpu.ACC.init(zero)))


def _ranged_loops(L, lo, mlo, mhi, hi, H, step, skip, carry):
    """Run skip over [L, lo), step(masked=True) over [lo, mlo), step(masked=False) over
    [mlo, mhi), step(masked=True) over [mhi, hi) and skip over [hi, H)."""
    def sk(i, c):
        skip(i)
        return c
    carry = lax.fori_loop(L, lo, sk, carry)
    carry = lax.fori_loop(lo, mlo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(mlo, mhi, functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(mhi, hi, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(hi, H, sk, carry)
    return carry


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=_WGMMA)


def _tiled(shape, dtype, swizzle=128):
    """A shared-memory buffer in wgmma's layout: (8, swizzle / itemsize) tiles, `swizzle`-byte
    swizzle (128 for 2-byte inputs: (8, 64) tiles)."""
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)),
                                                plgpu.SwizzleTransform(swizzle)))


def _named_bar(operation, barrier_id, num_threads):
    """PTX `bar.{operation} barrier_id, num_threads` on a hardware named barrier (operation
    "sync": arrive and wait; "arrive": do not wait); barrier_id a Python int or a traced int32
    scalar. The inner function's name (`bar_op`) and closure (`operation`, `num_threads`,
    `barrier_id`) are what GPU interpret mode recognises, so the interpreter (and its race
    detector) runs these barriers too."""
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


# GPU interpret mode runs `_named_bar` only with this (private) setting; with its default
# ("error") the kernels keep mbarriers there.
INTERPRET_NAMED_BARRIERS = "_hack_model_inline_mgpu_tokamax"


def interpret_params(**kw):
    """`plgpu.InterpretGPUParams(**kw)` for these kernels' GPU interpret mode, with the named
    barriers simulated too (as compiled)."""
    return plgpu.InterpretGPUParams(inline_mgpu=INTERPRET_NAMED_BARRIERS, **kw)


def _use_named(cfg, interpret):
    """Config.named_barriers, unless in GPU interpret mode without INTERPRET_NAMED_BARRIERS."""
    return cfg.named_barriers and (
        interpret is None or getattr(interpret, "inline_mgpu", "") == INTERPRET_NAMED_BARRIERS)


class _Sync:
    """The "slot consumed" signals (two compute warpgroups -> the memory warpgroup) and the
    compute warpgroups' turn signals of one kernel, as mbarriers or (`named`) PTX named
    barriers: hardware barrier _NAMED_BAR0 + i, `cons` kinds in order, `stages`
    slots each, then the two turns. A named barrier counts arrivals without phases; every
    protocol here lets a side arrive again only after the other side has waited."""

    def __init__(self, cons, turn, *, named, stages):
        self.cons, self.turn, self.named, self.stages = cons, turn, named, stages
        self.kinds = list(cons)

    def _id(self, kind, slot):
        return _NAMED_BAR0 + self.kinds.index(kind) * self.stages + slot

    def free(self, kind, slot):
        """Compute warpgroup: done reading `kind`'s shared-memory slot."""
        if self.named:
            _named_bar("arrive", self._id(kind, slot), 3 * 128)
        else:
            plgpu.barrier_arrive(self.cons[kind].at[slot])

    def wait_free(self, kind, slot):
        """Memory warpgroup: wait until both compute warpgroups freed the slot."""
        if self.named:
            _named_bar("sync", self._id(kind, slot), 3 * 128)
        else:
            plgpu.barrier_wait(self.cons[kind].at[slot])

    def turn_wait(self, wg):
        if self.named:
            _named_bar("sync", _NAMED_BAR0 + len(self.kinds) * self.stages + wg, 2 * 128)
        else:
            plgpu.barrier_wait(self.turn.at[wg])

    def turn_pass(self, wg):
        if self.named:
            _named_bar("arrive", _NAMED_BAR0 + len(self.kinds) * self.stages + 1 - wg, 2 * 128)
        else:
            plgpu.barrier_arrive(self.turn.at[1 - wg])


def _in_regs(tile_smem, on, interpret):
    """A wgmma A operand (Config.dq_regs): the shared-memory tile as a register array in
    wgmma's layout when `on` and compiled (call after the tile's TMA barrier was waited), else
    the tile itself (GPU interpret mode's wgmma reads only shared memory)."""
    if not on or interpret is not None:
        return tile_smem
    return plgpu.load(tile_smem, (), layout=_WGMMA)


def _compiler_params(cfg: Config | None = None):
    nab = cfg is not None and cfg.no_auto_barriers
    return plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=nab)


# ----------------------------------------------------------------------------------------------
# Forward.
# ----------------------------------------------------------------------------------------------

def _online_softmax(s2, acc, m_i, l_i, dtype, c2=None):
    """One key block of the base-2 online softmax (FA2 Alg. 1): s2 [bq, bkv] fp32 scaled and
    masked scores, acc [bq, Dv], m_i / l_i [bq] running max and sum. Returns the rescaled acc,
    the new max and sum, and P [bq, bkv] in `dtype` for the P V product. With `c2`, s2 is the
    unscaled masked S and the scale enters P = exp2(S * c2 - m) as one FMA (c2 > 0, so
    max(S) * c2 = max(S * c2))."""
    m_new = jnp.maximum(m_i, s2.max(axis=1) if c2 is None else s2.max(axis=1) * c2)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2((s2 if c2 is None else s2 * c2) - lax.broadcast_in_dim(m_new, s2.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return acc, m_new, l_i, p.astype(dtype)


def _pipelined_loops(*, L, lo, mlo, mhi, hi, H, wg, carry, q_smem, k_smems, v_smems, bars, sig,
                     mask, c2, fma, stages, shapes, dtype, stage, interpret):
    """Forward key loop of one compute warpgroup, software-pipelined (Config.fwd_pipe).

    Key blocks [L, H) are the CTA's; this warpgroup computes [lo, hi) (element masks outside
    [mlo, mhi)) and only keeps the barriers in step elsewhere. Block lo computes S alone
    (prologue); each later block j issues O += P_{j-1} V_{j-1} (P from registers, fenced before
    anything is in flight) and S_j = Q K_j^T back to back and waits once; the last P V runs
    after the loop. Turns: warpgroup w waits on turn[w] before issuing a block's products and
    arrives on turn[1 - w] after, so the two warpgroups' products alternate while the other
    runs its softmax (warpgroup 0 takes the first turn unasked and consumes the last arrival
    at the end). Returns (acc [bq, Dv] fp32 unnormalised, m2 [bq], l [bq]).
    """
    k_bar, v_bar = bars
    (bq, bkv), acc_shape = shapes
    acc, m_i, l_i = carry

    def turn_wait(j):
        @pl.when((wg == 1) | (j != L))
        def _():
            sig.turn_wait(wg)

    def turn_arrive():
        sig.turn_pass(wg)

    def slot(j):
        return lax.rem(j - L, stages)

    def softmax(s, j, acc, m_i, l_i, masked):
        if not fma:
            s = s * c2
        if masked:
            s = mask(s, j)
        return _online_softmax(s, acc, m_i, l_i, dtype, c2 if fma else None)

    def skip(j, c):
        plgpu.barrier_wait(k_bar.at[slot(j)])
        sig.free("k", slot(j))
        plgpu.barrier_wait(v_bar.at[slot(j)])
        sig.free("v", slot(j))
        turn_wait(j)
        turn_arrive()
        return c

    def first(j, c):          # block lo: S alone, always element-masked (one block per tile)
        acc, m_i, l_i, _ = c
        plgpu.barrier_wait(k_bar.at[slot(j)])
        turn_wait(j)

        def qk(s_ref):
            plgpu.wgmma(s_ref, q_smem, k_smems.at[slot(j)].T)
            turn_arrive()
            return s_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
        sig.free("k", slot(j))
        return softmax(s, j, acc, m_i, l_i, True)

    def step(j, c, *, masked):
        acc, m_i, l_i, p16 = c
        sp, sj = slot(j - 1), slot(j)
        plgpu.barrier_wait(v_bar.at[sp])
        plgpu.barrier_wait(k_bar.at[sj])
        turn_wait(j)
        acc, s = _mm_acc_then_fresh(p16, v_smems.at[sp], acc, q_smem, k_smems.at[sj].T,
                                    (bq, bkv), interpret=interpret, stage=stage,
                                    after_issue=turn_arrive)
        sig.free("v", sp)
        sig.free("k", sj)
        return softmax(s, j, acc, m_i, l_i, masked)

    def last(j, c):           # the P V product of block hi - 1
        acc, m_i, l_i, p16 = c
        plgpu.barrier_wait(v_bar.at[slot(j)])
        acc = _mm(p16, v_smems.at[slot(j)], acc_shape, acc, interpret=interpret, stage=stage,
                  a_in_regs=True)
        sig.free("v", slot(j))
        return acc, m_i, l_i, p16

    p0 = plgpu.layout_cast(jnp.zeros((bq, bkv), dtype), _WGMMA)
    c = (acc, m_i, l_i, p0)
    c = lax.fori_loop(L, lo, skip, c)
    s = jnp.minimum(lo + 1, hi)          # [lo, s): 0 or 1 block
    c = lax.fori_loop(lo, s, first, c)
    c = lax.fori_loop(s, jnp.maximum(mlo, s), functools.partial(step, masked=True), c)
    c = lax.fori_loop(jnp.maximum(mlo, s), jnp.maximum(mhi, s),
                      functools.partial(step, masked=False), c)
    c = lax.fori_loop(jnp.maximum(mhi, s), hi, functools.partial(step, masked=True), c)
    c = lax.fori_loop(jnp.maximum(hi - 1, lo), hi, last, c)
    c = lax.fori_loop(hi, H, skip, c)

    @pl.when((wg == 0) & (H > L))
    def _():
        sig.turn_wait(0)
    return c[:3]


def _forward(q, k, v, wgb, ctab, delta_arr, q_seg, kv_seg, *, scale, causal, T, S, cfg: Config,
             interpret):
    """q [B, Tp, N, Dqk], k [B, Sp, K, Dqk], v [B, Sp, K, Dv] -> o [B, Tp, N, Dv],
    lse2 [B, N, Tp] fp32 (base-2 log-sum-exp of scale * q k^T; -inf on fully masked rows)."""
    B, Tp, N, Dqk = q.shape
    Sp, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    bq, bkv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    dtype = q.dtype
    has_seg = q_seg is not None
    c2 = scale * LOG2E
    union_o = Dv <= Dqk and (bq * Dqk) % Dv == 0 and ((bq * Dqk) // Dv) % 8 == 0
    n_qt = Tp // (2 * bq)
    named = _use_named(cfg, interpret)

    def kernel(q_ref, k_ref, v_ref, wgb_ref, ctab_ref, dl_ref, qseg_ref, kseg_ref, o_ref, lse_ref,
               scoped):
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        qt = lax.axis_index("qt")
        if causal and cfg.fwd_longest_first:   # later query tiles see more keys: start them first
            qt = n_qt - 1 - qt
        wg = lax.axis_index("wg")
        (qo_smems, k_smems, v_smems, lse_smems, stage_smems), (k_bar, v_bar, q_bar), \
            (k_cons, v_cons), sched = scoped
        q_smems, o_smems = qo_smems
        sig = _Sync({"k": k_cons, "v": v_cons}, sched, named=named, stages=stages)
        L = ctab_ref[b, qt, 0]
        H = ctab_ref[b, qt, 1]

        def sync():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(cfg.regs_fwd[0], action="increase")
            tile = 2 * qt + wg
            q_base = tile * bq
            q_smem = q_smems.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_base, bq), h], q_smem, q_bar.at[wg])
            lo = wgb_ref[b, tile, 0]
            mlo = wgb_ref[b, tile, 1]
            mhi = wgb_ref[b, tile, 2]
            hi = wgb_ref[b, tile, 3]
            dl = dl_ref[0]
            if has_seg:
                qseg = plgpu.load(qseg_ref.at[b, pl.ds(q_base, bq)], layout=_ROW, optimized=False)
            acc = plgpu.layout_cast(jnp.zeros((bq, Dv), jnp.float32), _WGMMA)
            m_i = plgpu.layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), _ROW)
            l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), _ROW)
            plgpu.barrier_wait(q_bar.at[wg])
            if not cfg.fwd_pipe:
                pl.when(wg == 1)(sync)

            def mask(s, ki):
                """s with -inf where key block ki's columns are masked for this tile's rows."""
                kv_pos = ki * bkv + _iota((bq, bkv), 1)
                ok = kv_pos < S
                if causal:
                    ok = ok & (kv_pos <= q_base + _iota((bq, bkv), 0) + dl)
                if has_seg:
                    kseg = plgpu.load(kseg_ref.at[b, pl.ds(ki * bkv, bkv)], layout=_COL,
                                      optimized=False)
                    ok = ok & (lax.broadcast_in_dim(qseg, (bq, bkv), [0])
                               == lax.broadcast_in_dim(kseg, (bq, bkv), [1]))
                return jnp.where(ok, s, -jnp.inf)

            def skip(ki):
                slot = lax.rem(ki - L, stages)
                plgpu.barrier_wait(k_bar.at[slot])
                sig.free("k", slot)
                sync()
                plgpu.barrier_wait(v_bar.at[slot])
                sig.free("v", slot)
                sync()

            stage = None if stage_smems is None else stage_smems.at[wg]

            def step(ki, carry, *, masked):
                acc, m_i, l_i = carry
                slot = lax.rem(ki - L, stages)
                plgpu.barrier_wait(k_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smems.at[slot].T)
                    plgpu.barrier_arrive(sched)
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
                sig.free("k", slot)
                plgpu.barrier_wait(sched)
                if not cfg.fwd_fma:
                    s = s * c2
                if masked:
                    s = mask(s, ki)
                acc, m_new, l_i, p16 = _online_softmax(s, acc, m_i, l_i, dtype,
                                                       c2 if cfg.fwd_fma else None)
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_wait(sched)
                acc = _mm(p16, v_smems.at[slot], (bq, Dv), acc, interpret=interpret,
                          a_in_regs=True, stage=stage)
                sig.free("v", slot)
                return acc, m_new, l_i

            if cfg.fwd_pipe:
                acc, m_i, l_i = _pipelined_loops(
                    L=L, lo=lo, mlo=mlo, mhi=mhi, hi=hi, H=H, wg=wg, carry=(acc, m_i, l_i),
                    q_smem=q_smem, k_smems=k_smems, v_smems=v_smems, bars=(k_bar, v_bar),
                    sig=sig, mask=mask, c2=c2, fma=cfg.fwd_fma, stages=stages,
                    shapes=((bq, bkv), (bq, Dv)), dtype=dtype, stage=stage,
                    interpret=interpret)
            else:
                acc, m_i, l_i = _ranged_loops(L, lo, mlo, mhi, hi, H, step, skip,
                                              (acc, m_i, l_i))
                pl.when(wg == 0)(sync)
            empty = l_i == 0.0
            inv = 1.0 / jnp.where(empty, 1.0, l_i)
            acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            lse_smem = lse_smems.at[wg]
            lse_smem[...] = jnp.where(empty, -jnp.inf, m_i + jnp.log2(jnp.where(empty, 1.0, l_i)))
            o_smem = o_smems.at[wg, pl.ds(0, bq)] if union_o else o_smems.at[wg]
            o_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, pl.ds(q_base, bq), h])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q_base, bq)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(cfg.regs_fwd[1], action="decrease")
            kvh = lax.div(h, jnp.int32(G))

            def load(ki, slot, wait=False):   # wait: for the slot's previous use to be freed
                if wait:
                    sig.wait_free("k", slot)
                ks = pl.ds(ki * bkv, bkv)
                plgpu.copy_gmem_to_smem(k_ref.at[b, ks, kvh], k_smems.at[slot], k_bar.at[slot])
                if wait:
                    sig.wait_free("v", slot)
                plgpu.copy_gmem_to_smem(v_ref.at[b, ks, kvh], v_smems.at[slot], v_bar.at[slot])

            for i in range(stages):
                @pl.when(L + i < H)
                def _():
                    load(L + i, i)

            @pl.loop(L + stages, H)
            def _(ki):
                load(ki, lax.rem(ki - L, stages), wait=True)

            @pl.loop(jnp.maximum(H - stages, L), H)
            def _(ki):   # observe the last consumptions too (GPU interpret mode checks phases)
                slot = lax.rem(ki - L, stages)
                sig.wait_free("k", slot)
                sig.wait_free("v", slot)

    def entry(*refs):
        q_s = _tiled((2, bq, Dqk), dtype)
        if union_o:
            qo = plgpu.RefUnion(q_s, _tiled((2, (bq * Dqk) // Dv, Dv), dtype))
        else:
            qo = (q_s, _tiled((2, bq, Dv), dtype))
        stage = plgpu.SMEM((2, bq, bkv), dtype) if interpret else None
        smems = (qo, _tiled((stages, bkv, Dqk), dtype), _tiled((stages, bkv, Dv), dtype),
                 plgpu.SMEM((2, bq), jnp.float32), stage)
        bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2))
        cons = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages))
        # ping-pong: one 2-arrival barrier (two syncs per step), or with fwd_pipe one
        # 1-arrival barrier per warpgroup ("your turn", one per step)
        sched = (plgpu.Barrier(num_arrivals=1, num_barriers=2) if cfg.fwd_pipe
                 else plgpu.Barrier(num_arrivals=2))
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smems, bars, cons, sched,
                      collective_axes="wg")

    out_type = (jax.ShapeDtypeStruct((B, Tp, N, Dv), dtype),
                jax.ShapeDtypeStruct((B, N, Tp), jnp.float32))
    seg_args = (q_seg, kv_seg) if has_seg else (jnp.zeros((1, 1), jnp.int32),) * 2
    return plgpu.kernel(
        entry, out_type=out_type, grid=(N, n_qt, B), grid_names=("h", "qt", "b"),
        num_threads=3, thread_name="wg", compiler_params=_compiler_params(cfg),
        interpret=interpret,
    )(q, k, v, wgb, ctab, delta_arr, *seg_args)


# ----------------------------------------------------------------------------------------------
# Backward: dq kernel (rows = query tiles) and dk/dv kernel (rows = key tiles).
# ----------------------------------------------------------------------------------------------

def dq_dlt_fits(Dqk, Dv, cfg: Config):
    """True when the dq kernel has the shared memory to compute delta = rowsum(o * dO) itself
    (an O tile and a [bq] fp32 row per warpgroup on top of `smem_bytes`' dq figure)."""
    return smem_bytes(Dqk, Dv, cfg)[1] + 2 * cfg.block_q * (2 * Dv + 4) <= SMEM_BYTES


def _dq_kernel_call(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, q_seg, kv_seg, *, scale,
                    causal, S, cfg: Config, interpret, o=None, dlse=None):
    """dq [B, Tp, N, Dqk] = scale * sum_s dS[t, s] k[s], dS = P * (dP - dlt) (FA2 Alg. 2).

    With o [B, Tp, N, Dv] given (dlt None), each warpgroup computes its rows' delta =
    rowsum(o * dO) - dlse (dlse [B, N, Tp] fp32 or None) from the O and dO tiles it loads, and
    the kernel returns (dq, delta [B, N, Tp] fp32) for the dk/dv kernel; this replaces an XLA
    reduction (H200: ~48 us at MLA B4 T4096, ~2 % of forward+backward)."""
    B, Tp, N, Dqk = q.shape
    Sp, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    bq, bkv, stages = cfg.block_q, cfg.block_kv_dq, cfg.stages_bwd
    dtype = q.dtype
    has_seg = q_seg is not None
    c2 = scale * LOG2E
    own_dlt = o is not None
    has_dlse = dlse is not None
    named = _use_named(cfg, interpret)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_or_o_ref, wgb_ref, ctab_ref, dl_ref,
               qseg_ref, kseg_ref, *rest):
        dlse_ref = rest[0] if has_dlse else None
        dq_ref, *rest = rest[1:] if has_dlse else rest
        dlt_out_ref, scoped = rest if own_dlt else (None, rest[0])
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        qt = lax.axis_index("qt")
        if causal and cfg.bwd_longest_first:
            qt = Tp // (2 * bq) - 1 - qt
        wg = lax.axis_index("wg")
        (q_smems, do_smems, k_smems, v_smems, stage_smems, o_smems, dlt_smems), \
            (k_bar, v_bar, q_bar, do_bar, o_bar), (k_cons, v_cons) = scoped
        sig = _Sync({"k": k_cons, "v": v_cons}, None, named=named, stages=stages)
        L = ctab_ref[b, qt, 0]
        H = ctab_ref[b, qt, 1]

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(cfg.regs_bwd[0], action="increase")
            tile = 2 * qt + wg
            q_base = tile * bq
            q_smem, do_smem = q_smems.at[wg], do_smems.at[wg]
            stage = None if stage_smems is None else stage_smems.at[wg]
            qs = pl.ds(q_base, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[b, qs, h], q_smem, q_bar.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[b, qs, h], do_smem, do_bar.at[wg])
            if own_dlt:
                plgpu.copy_gmem_to_smem(dlt_or_o_ref.at[b, qs, h], o_smems.at[wg], o_bar.at[wg])
            lo, mlo, mhi, hi = (wgb_ref[b, tile, i] for i in range(4))
            dl = dl_ref[0]
            lse = plgpu.load(lse_ref.at[b, h, qs], layout=_ROW, optimized=False)
            if own_dlt:   # delta = rowsum(o * dO) - dlse, written out for the dk/dv kernel
                plgpu.barrier_wait(o_bar.at[wg])
                plgpu.barrier_wait(do_bar.at[wg])
                od = (plgpu.load(o_smems.at[wg], layout=_WGMMA).astype(jnp.float32)
                      * plgpu.load(do_smem, layout=_WGMMA).astype(jnp.float32))
                dlt = od.sum(axis=1)
                if has_dlse:
                    dlt = dlt - plgpu.load(dlse_ref.at[b, h, qs], layout=_ROW, optimized=False)
                dlt_smems.at[wg][...] = dlt
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dlt_smems.at[wg], dlt_out_ref.at[b, h, qs])
            else:
                dlt = plgpu.load(dlt_or_o_ref.at[b, h, qs], layout=_ROW, optimized=False)
            if has_seg:
                qseg = plgpu.load(qseg_ref.at[b, qs], layout=_ROW, optimized=False)
            dq = plgpu.layout_cast(jnp.zeros((bq, Dqk), jnp.float32), _WGMMA)
            plgpu.barrier_wait(q_bar.at[wg])
            if not own_dlt:
                plgpu.barrier_wait(do_bar.at[wg])

            q_op = _in_regs(q_smem, cfg.dq_regs == "q", interpret)
            do_op = _in_regs(do_smem, cfg.dq_regs == "do", interpret)

            def step(ki, dq, *, masked):
                slot = lax.rem(ki - L, stages)

                def probs(s):
                    p = jnp.exp2(s * c2 - lax.broadcast_in_dim(lse, s.shape, [0]))
                    if masked:
                        kv_pos = ki * bkv + _iota((bq, bkv), 1)
                        ok = kv_pos < S
                        if causal:
                            ok = ok & (kv_pos <= q_base + _iota((bq, bkv), 0) + dl)
                        if has_seg:
                            kseg = plgpu.load(kseg_ref.at[b, pl.ds(ki * bkv, bkv)],
                                              layout=_COL, optimized=False)
                            ok = ok & (lax.broadcast_in_dim(qseg, (bq, bkv), [0])
                                       == lax.broadcast_in_dim(kseg, (bq, bkv), [1]))
                        p = jnp.where(ok, p, 0.0)
                    return p

                plgpu.barrier_wait(k_bar.at[slot])
                if cfg.dq_issue in ("sdp", "sdp1"):
                    plgpu.barrier_wait(v_bar.at[slot])
                    p, dp = _mm_two(q_op, k_smems.at[slot].T, (bq, bkv), do_op,
                                    v_smems.at[slot].T, (bq, bkv), interpret=interpret,
                                    between=probs if cfg.dq_issue == "sdp1" else None)
                    if cfg.dq_issue == "sdp":
                        p = probs(p)
                else:
                    p = probs(_mm(q_op, k_smems.at[slot].T, (bq, bkv), interpret=interpret))
                    plgpu.barrier_wait(v_bar.at[slot])
                    dp = _mm(do_op, v_smems.at[slot].T, (bq, bkv), interpret=interpret)
                sig.free("v", slot)
                ds = p * (dp - lax.broadcast_in_dim(dlt, dp.shape, [0]))
                dq = _mm(ds.astype(dtype), k_smems.at[slot], (bq, Dqk), dq, interpret=interpret,
                         stage=stage, a_in_regs=True)
                sig.free("k", slot)
                return dq

            def skip(ki):
                slot = lax.rem(ki - L, stages)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                sig.free("v", slot)
                sig.free("k", slot)

            dq = _ranged_loops(L, lo, mlo, mhi, hi, H, step, skip, dq)
            q_smem[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, qs, h])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(cfg.regs_bwd[1], action="decrease")
            kvh = lax.div(h, jnp.int32(G))

            def load(ki, slot, wait=False):   # wait: for the slot's previous use to be freed
                ks = pl.ds(ki * bkv, bkv)
                if wait:
                    sig.wait_free("k", slot)
                plgpu.copy_gmem_to_smem(k_ref.at[b, ks, kvh], k_smems.at[slot], k_bar.at[slot])
                if wait:
                    sig.wait_free("v", slot)
                plgpu.copy_gmem_to_smem(v_ref.at[b, ks, kvh], v_smems.at[slot], v_bar.at[slot])

            for i in range(stages):
                @pl.when(L + i < H)
                def _():
                    load(L + i, i)

            @pl.loop(L + stages, H)
            def _(ki):
                load(ki, lax.rem(ki - L, stages), wait=True)

            @pl.loop(jnp.maximum(H - stages, L), H)
            def _(ki):   # observe the last consumptions too (GPU interpret mode checks phases)
                slot = lax.rem(ki - L, stages)
                sig.wait_free("k", slot)
                sig.wait_free("v", slot)

    def entry(*refs):
        stage = plgpu.SMEM((2, bq, bkv), dtype) if interpret else None
        o_smems = _tiled((2, bq, Dv), dtype) if own_dlt else None
        dlt_smems = plgpu.SMEM((2, bq), jnp.float32) if own_dlt else None
        smems = (_tiled((2, bq, Dqk), dtype), _tiled((2, bq, Dv), dtype),
                 _tiled((stages, bkv, Dqk), dtype), _tiled((stages, bkv, Dv), dtype), stage,
                 o_smems, dlt_smems)
        bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
                plgpu.Barrier(num_barriers=2) if own_dlt else None)
        cons = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages))
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smems, bars, cons,
                      collective_axes="wg")

    seg_args = (q_seg, kv_seg) if has_seg else (jnp.zeros((1, 1), jnp.int32),) * 2
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    if own_dlt:
        out_type = (out_type, jax.ShapeDtypeStruct((B, N, Tp), jnp.float32))
    return plgpu.kernel(
        entry, out_type=out_type, grid=(N, Tp // (2 * bq), B),
        grid_names=("h", "qt", "b"), num_threads=3, thread_name="wg",
        compiler_params=_compiler_params(cfg), interpret=interpret,
    )(q, k, v, do, lse2, o if own_dlt else dlt, wgb, ctab, delta_arr, *seg_args,
      *((dlse,) if has_dlse else ()))


def _dkv_kernel_call(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, q_seg, kv_seg, *, scale,
                     causal, cfg: Config, interpret):
    """dk [B, Sp, K, Dqk] = scale * sum_{g, t} dS^T k-row, dv [B, Sp, K, Dv] = sum P^T dO, summed
    over the G query heads of each kv head inside the kernel (FA2 Alg. 2, transposed tiles)."""
    B, Tp, N, Dqk = q.shape
    Sp, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    bkv, bq, stages = cfg.block_kv_dkv, cfg.block_q_dkv, cfg.stages_bwd
    dtype = q.dtype
    has_seg = q_seg is not None
    c2 = scale * LOG2E
    named = _use_named(cfg, interpret)
    stat = cfg.dkv_stat_smem

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_ref, wgb_ref, ctab_ref, dl_ref, qseg_ref,
               kseg_ref, dk_ref, dv_ref, scoped):
        b = lax.axis_index("b")
        kvh = lax.axis_index("h")
        kt = lax.axis_index("kt")
        wg = lax.axis_index("wg")
        (k_smems, v_smems, q_smems, do_smems, stage_smems, lse_smems, dlt_smems), \
            (q_bar, do_bar, k_bar, v_bar), (q_cons, do_cons) = scoped
        sig = _Sync({"q": q_cons, "do": do_cons}, None, named=named, stages=stages)
        L = ctab_ref[b, kt, 0]
        H = ctab_ref[b, kt, 1]
        n_c = H - L
        n_c1 = jnp.maximum(n_c, 1)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(cfg.regs_bwd[0], action="increase")
            tile = 2 * kt + wg
            kv_base = tile * bkv
            ks = pl.ds(kv_base, bkv)
            k_smem, v_smem = k_smems.at[wg], v_smems.at[wg]
            stage = None if stage_smems is None else stage_smems.at[wg]
            plgpu.copy_gmem_to_smem(k_ref.at[b, ks, kvh], k_smem, k_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, ks, kvh], v_smem, v_bar.at[wg])
            lo, mlo, mhi, hi = (wgb_ref[b, tile, i] for i in range(4))
            dl = dl_ref[0]
            if has_seg:
                kseg = plgpu.load(kseg_ref.at[b, ks], layout=_ROW, optimized=False)
            dk = plgpu.layout_cast(jnp.zeros((bkv, Dqk), jnp.float32), _WGMMA)
            dv = plgpu.layout_cast(jnp.zeros((bkv, Dv), jnp.float32), _WGMMA)
            plgpu.barrier_wait(k_bar.at[wg])
            plgpu.barrier_wait(v_bar.at[wg])

            def head(g, carry):
                h = kvh * G + g

                def step(c, carry, *, masked):
                    dk, dv = carry
                    slot = lax.rem(g * n_c + c - L, stages)
                    qs = pl.ds(c * bq, bq)
                    # Without dkv_stat_smem: lse issued before the Q wait, off the S product's
                    # path (measured: no change on the H200, RESULTS.md v2); dlt stays after
                    # dP: loaded earlier it would raise the register peak.
                    if not stat:
                        lse = plgpu.load(lse_ref.at[b, h, qs], layout=_COL, optimized=False)
                    if masked and has_seg:
                        qseg = plgpu.load(qseg_ref.at[b, qs], layout=_COL, optimized=False)
                    def probs(sT, folded=False):
                        if folded:
                            pT = jnp.exp2(sT * c2)
                        else:
                            pT = jnp.exp2(sT * c2 - lax.broadcast_in_dim(lse, sT.shape, [1]))
                        if masked:
                            ok = None
                            if causal:
                                ok = ((kv_base + _iota((bkv, bq), 0))
                                      <= (c * bq + _iota((bkv, bq), 1) + dl))
                            if has_seg:
                                same = (lax.broadcast_in_dim(kseg, (bkv, bq), [0])
                                        == lax.broadcast_in_dim(qseg, (bkv, bq), [1]))
                                ok = same if ok is None else ok & same
                            if ok is not None:
                                pT = jnp.where(ok, pT, 0.0)
                        return pT

                    def stat_load(ref):
                        x = plgpu.load(ref, layout=_COL, optimized=False)
                        if interpret:
                            # The TMA that refills this slot (async proxy) follows a plain
                            # shared-memory read here; compiled, the read has completed (its
                            # value feeds a product) before the slot is freed, which GPU
                            # interpret mode's race detector does not model: a proxy fence
                            # tells it so.
                            plgpu.commit_smem()
                        return x

                    plgpu.barrier_wait(q_bar.at[slot])
                    if stat:   # the rows' statistics came with Q (lse) and dO (delta)
                        lse = stat_load(lse_smems.at[slot])

                    def load_dlt():
                        if stat:
                            return stat_load(dlt_smems.at[slot])
                        return plgpu.load(dlt_ref.at[b, h, qs], layout=_COL, optimized=False)
                    do_s = do_smems.at[slot]
                    if cfg.dkv_issue in ("sdp", "sdp1"):
                        plgpu.barrier_wait(do_bar.at[slot])
                        pT, dpT = _mm_two(k_smem, q_smems.at[slot].T, (bkv, bq), v_smem, do_s.T,
                                          (bkv, bq), interpret=interpret,
                                          between=probs if cfg.dkv_issue == "sdp1" else None)
                        if cfg.dkv_issue == "sdp":
                            pT = probs(pT)
                        dv = _mm(pT.astype(dtype), do_s, (bkv, Dv), dv, interpret=interpret,
                                 stage=stage, a_in_regs=True)
                    elif cfg.dkv_issue == "dvdp":
                        pT = probs(_mm(k_smem, q_smems.at[slot].T, (bkv, bq), interpret=interpret))
                        plgpu.barrier_wait(do_bar.at[slot])
                        dv, dpT = _mm_acc_then_fresh(pT.astype(dtype), do_s, dv, v_smem, do_s.T,
                                                     (bkv, bq), interpret=interpret, stage=stage)
                    elif cfg.dkv_fold:
                        # The row statistics start the accumulators: S^T - lse / c2 and
                        # dP^T - delta come out of the products, so neither vector is live
                        # beside a [bkv, bq] tile (16 registers fewer at the peak).
                        s0 = lax.broadcast_in_dim(lse * (-1.0 / c2), (bkv, bq), [1])
                        sT = _mm(k_smem, q_smems.at[slot].T, (bkv, bq), s0, interpret=interpret)
                        pT = probs(sT, folded=True)
                        plgpu.barrier_wait(do_bar.at[slot])
                        dv = _mm(pT.astype(dtype), do_s, (bkv, Dv), dv, interpret=interpret,
                                 stage=stage, a_in_regs=True)
                        dlt = load_dlt()
                        dpT = _mm(v_smem, do_s.T, (bkv, bq),
                                  lax.broadcast_in_dim(-dlt, (bkv, bq), [1]), interpret=interpret)
                    else:
                        pT = probs(_mm(k_smem, q_smems.at[slot].T, (bkv, bq), interpret=interpret))
                        plgpu.barrier_wait(do_bar.at[slot])
                        dv = _mm(pT.astype(dtype), do_s, (bkv, Dv), dv, interpret=interpret,
                                 stage=stage, a_in_regs=True)
                        dpT = _mm(v_smem, do_s.T, (bkv, bq), interpret=interpret)
                    folded = cfg.dkv_issue == "serial" and cfg.dkv_fold
                    if stat and not folded:
                        dlt = load_dlt()    # before the dO slot (and its delta row) is freed
                    sig.free("do", slot)
                    if folded:
                        dsT = pT * dpT
                    else:
                        if not stat:
                            dlt = load_dlt()
                        dsT = pT * (dpT - lax.broadcast_in_dim(dlt, dpT.shape, [1]))
                    dk = _mm(dsT.astype(dtype), q_smems.at[slot], (bkv, Dqk), dk,
                             interpret=interpret, stage=stage, a_in_regs=True)
                    sig.free("q", slot)
                    return dk, dv

                def skip(c):
                    slot = lax.rem(g * n_c + c - L, stages)
                    plgpu.barrier_wait(q_bar.at[slot])
                    plgpu.barrier_wait(do_bar.at[slot])
                    sig.free("do", slot)
                    sig.free("q", slot)

                return _ranged_loops(L, lo, mlo, mhi, hi, H, step, skip, carry)

            dk, dv = lax.fori_loop(0, G, head, (dk, dv))
            k_smem[...] = (dk * scale).astype(dtype)
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, ks, kvh])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, ks, kvh])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(cfg.regs_bwd[1], action="decrease")
            n = G * n_c

            def copy_q(b, qs, h, slot):     # Q rows (+ their lse with dkv_stat_smem)
                plgpu.copy_gmem_to_smem(q_ref.at[b, qs, h], q_smems.at[slot], q_bar.at[slot])
                if stat:
                    plgpu.copy_gmem_to_smem(lse_ref.at[b, h, qs], lse_smems.at[slot],
                                            q_bar.at[slot])

            def copy_do(b, qs, h, slot):    # dO rows (+ their delta)
                plgpu.copy_gmem_to_smem(do_ref.at[b, qs, h], do_smems.at[slot], do_bar.at[slot])
                if stat:
                    plgpu.copy_gmem_to_smem(dlt_ref.at[b, h, qs], dlt_smems.at[slot],
                                            do_bar.at[slot])

            def load(j, slot, wait=False):   # wait: for the slot's previous use to be freed
                g = lax.div(j, n_c1)
                c = L + lax.rem(j, n_c1)
                h = kvh * G + g
                qs = pl.ds(c * bq, bq)
                if wait:
                    sig.wait_free("q", slot)
                copy_q(b, qs, h, slot)
                if wait:
                    sig.wait_free("do", slot)
                copy_do(b, qs, h, slot)

            for i in range(stages):
                @pl.when(i < n)
                def _():
                    load(jnp.int32(i), i)

            @pl.loop(stages, n)
            def _(j):
                load(j, lax.rem(j, stages), wait=True)

            @pl.loop(jnp.maximum(n - stages, 0), n)
            def _(j):
                slot = lax.rem(j, stages)
                sig.wait_free("q", slot)
                sig.wait_free("do", slot)

    def entry(*refs):
        stage = plgpu.SMEM((2, bkv, bq), dtype) if interpret else None
        smems = (_tiled((2, bkv, Dqk), dtype), _tiled((2, bkv, Dv), dtype),
                 _tiled((stages, bq, Dqk), dtype), _tiled((stages, bq, Dv), dtype), stage,
                 plgpu.SMEM((stages, bq), jnp.float32) if stat else None,
                 plgpu.SMEM((stages, bq), jnp.float32) if stat else None)
        per_slot = 2 if stat else 1     # TMA copies completing on each Q / dO barrier
        bars = (plgpu.Barrier(num_arrivals=per_slot, num_barriers=stages),
                plgpu.Barrier(num_arrivals=per_slot, num_barriers=stages),
                plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2))
        cons = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                plgpu.Barrier(num_arrivals=2, num_barriers=stages))
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smems, bars, cons,
                      collective_axes="wg")

    seg_args = (q_seg, kv_seg) if has_seg else (jnp.zeros((1, 1), jnp.int32),) * 2
    return plgpu.kernel(
        entry, out_type=(jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)),
        grid=(K, Sp // (2 * bkv), B), grid_names=("h", "kt", "b"), num_threads=3,
        thread_name="wg", compiler_params=_compiler_params(cfg), interpret=interpret,
    )(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, *seg_args)


def _delta_xla(o, do, dlse, Tp):
    """delta [B, N, Tp] fp32 = rowsum(o * do) - dlse by XLA, padded rows 0 (o, do [B, T, N, Dv];
    dlse [B, N, T] or None)."""
    dlt = jnp.einsum("btnd,btnd->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    if dlse is not None:
        dlt = dlt - dlse.astype(jnp.float32)
    return _pad_to(dlt, 2, Tp)


def _bwd_lse_do(lse2, do, dtype, Tp):
    """The backward kernels' lse2 [B, N, Tp] (+inf on fully masked and padded rows, so P = 0
    there) and dO [B, Tp, N, Dv] in the inputs' dtype."""
    lse_b = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)
    return _pad_to(lse_b, 2, Tp, value=jnp.inf), _pad_to(do.astype(dtype), 1, Tp)


def _backward(q, k, v, segs, offsets, o, lse2, do, dlse, *, scale, causal, cfg, interpret,
              static_delta=None):
    """dq, dk, dv from the forward residuals. dlse (cotangent of the natural lse) enters as
    dS = P * (dP - (rowsum(o * do) - dlse))."""
    B, T, N, _ = q.shape
    qp, kp, vp, q_seg, kv_seg, delta, T, S, Tp, Sp = _prepare(
        q, k, v, segs, offsets, causal=causal, cfg=cfg, static_delta=static_delta)
    # delta = rowsum(o * dO) - dlse: inside the dq kernel when its shared memory allows (an
    # XLA reduction took ~48 us at MLA B4 T4096 on the H200), else here.
    own_dlt = dq_dlt_fits(q.shape[-1], v.shape[-1], cfg)
    if own_dlt:
        dlt = None
        dlse_p = None if dlse is None else _pad_to(dlse.astype(jnp.float32), 2, Tp)
    else:
        dlt = _delta_xla(o, do, dlse, Tp)
    lse_b, dop = _bwd_lse_do(lse2, do, q.dtype, Tp)
    wgb, ctab = _fwd_ranges(B, Tp, Sp, T, S, causal, delta, q_seg, kv_seg, cfg, cfg.block_kv_dq,
                            static_delta)
    dq = _dq_kernel_call(qp, kp, vp, dop, lse_b, dlt, wgb, ctab, delta, q_seg, kv_seg,
                         scale=scale, causal=causal, S=S, cfg=cfg, interpret=interpret,
                         o=_pad_to(o.astype(q.dtype), 1, Tp) if own_dlt else None,
                         dlse=dlse_p if own_dlt else None)
    if own_dlt:
        dq, dlt = dq
    if interpret is not None:
        # GPU interpret mode keeps global simulator state: run the two kernels one after the
        # other (under jit, XLA:CPU could otherwise run them concurrently and hang).
        dq, qp = lax.optimization_barrier((dq, qp))
    wgb2, ctab2 = _tile_ranges(B=B, n_rows_p=Sp, row_block=cfg.block_kv_dkv, n_cols_p=Tp,
                               col_block=cfg.block_q_dkv, rows_are_q=False, T=T, S=S,
                               causal=causal, delta=_delta0(delta, static_delta), q_seg=q_seg,
                               kv_seg=kv_seg)
    dk, dv = _dkv_kernel_call(qp, kp, vp, dop, lse_b, dlt, wgb2, ctab2, delta, q_seg, kv_seg,
                              scale=scale, causal=causal, cfg=cfg, interpret=interpret)
    return dq[:, :T], dk[:, :S], dv[:, :S]


# ----------------------------------------------------------------------------------------------
# Wrapper: padding, ranges, custom VJP.
# ----------------------------------------------------------------------------------------------

def _round_up(x, m):
    return -(-x // m) * m


def _pad_to(x, axis, size, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _prepare(q, k, v, segs, offsets, *, causal, cfg, static_delta=None):
    B, T, N, _ = q.shape
    S = k.shape[1]
    tile_t = 2 * cfg.block_q
    tile_s = max(cfg.block_kv, 2 * cfg.block_kv_dkv, cfg.block_kv_dq)
    Tp, Sp = _round_up(T, tile_t), _round_up(S, tile_s)
    qp, kp, vp = _pad_to(q, 1, Tp), _pad_to(k, 1, Sp), _pad_to(v, 1, Sp)
    if static_delta is not None:
        delta = jnp.full((1,), static_delta, jnp.int32)
    else:
        delta = (jnp.asarray(offsets[0], jnp.int32)
                 - jnp.asarray(offsets[1], jnp.int32)).reshape(1)
    if segs is not None:
        q_seg = _pad_to(segs[0].astype(jnp.int32), 1, Tp)
        kv_seg = _pad_to(segs[1].astype(jnp.int32), 1, Sp)
    else:
        q_seg = kv_seg = None
    return qp, kp, vp, q_seg, kv_seg, delta, T, S, Tp, Sp


def _delta0(delta, static_delta):
    """q_offset - kv_offset for the range tables: the Python int when static, else traced."""
    return int(static_delta) if static_delta is not None else delta[0]


def _fwd_ranges(B, Tp, Sp, T, S, causal, delta, q_seg, kv_seg, cfg, block_kv, static_delta=None):
    return _tile_ranges(B=B, n_rows_p=Tp, row_block=cfg.block_q, n_cols_p=Sp, col_block=block_kv,
                        rows_are_q=True, T=T, S=S, causal=causal,
                        delta=_delta0(delta, static_delta), q_seg=q_seg, kv_seg=kv_seg)


def _attn_fwd_impl(q, k, v, segs, offsets, *, scale, causal, cfg, interpret, static_delta=None):
    qp, kp, vp, q_seg, kv_seg, delta, T, S, Tp, Sp = _prepare(
        q, k, v, segs, offsets, causal=causal, cfg=cfg, static_delta=static_delta)
    wgb, ctab = _fwd_ranges(q.shape[0], Tp, Sp, T, S, causal, delta, q_seg, kv_seg, cfg,
                            cfg.block_kv, static_delta)
    o, lse2 = _forward(qp, kp, vp, wgb, ctab, delta, q_seg, kv_seg, scale=scale, causal=causal,
                       T=T, S=S, cfg=cfg, interpret=interpret)
    return o[:, :T], lse2[:, :, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _attention(q, k, v, segs, offsets, scale, causal, cfg, interpret, static_delta):
    o, lse2 = _attn_fwd_impl(q, k, v, segs, offsets, scale=scale, causal=causal, cfg=cfg,
                             interpret=interpret, static_delta=static_delta)
    return o, lse2 * math.log(2.0)


def _attention_fwd(q, k, v, segs, offsets, scale, causal, cfg, interpret, static_delta):
    o, lse2 = _attn_fwd_impl(q, k, v, segs, offsets, scale=scale, causal=causal, cfg=cfg,
                             interpret=interpret, static_delta=static_delta)
    return (o, lse2 * math.log(2.0)), (q, k, v, segs, offsets, o, lse2)


def _attention_bwd(scale, causal, cfg, interpret, static_delta, res, cts):
    q, k, v, segs, offsets, o, lse2 = res
    do, dlse = cts
    dq, dk, dv = _backward(q, k, v, segs, offsets, o, lse2, do, dlse, scale=scale, causal=causal,
                           cfg=cfg, interpret=interpret, static_delta=static_delta)
    seg_ct = None if segs is None else jax.tree.map(lambda _: None, segs)
    return dq, dk, dv, seg_ct, (None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_mosaic(q, k, v, *, causal=True, scale=None, segments=None, q_offset=0,
                           kv_offset=0, cfg: Config | None = None, interpret=None):
    """Mosaic GPU flash attention with its own backward kernels.

    Args:
      q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv]: bf16 or fp16, Dqk and Dv multiples of
        64 up to 256, N % K == 0.
      segments: None or (q_seg [B, T], kv_seg [B, S]) int.
      q_offset, kv_offset: int or int32 scalar (may be traced).
      interpret: None (compile for the GPU) or `plgpu.InterpretGPUParams` (CPU simulation;
        `interpret_params()` simulates the named barriers too, other params keep mbarriers).

    Returns:
      (o [B, T, N, Dv] in q.dtype, lse [B, N, T] fp32 natural log, -inf on fully masked rows).
    """
    check_supported(q, k, v, cfg)
    cfg = default_config(q.shape[-1], v.shape[-1]) if cfg is None else cfg
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    segs = None if segments is None else (jnp.asarray(segments[0]), jnp.asarray(segments[1]))
    static_delta = None     # offsets known while tracing: range tables become constants
    if all(isinstance(x, int) for x in (q_offset, kv_offset)):
        static_delta = int(q_offset) - int(kv_offset)
    return _attention(q, k, v, segs, (q_offset, kv_offset), scale, causal, cfg, interpret,
                      static_delta)
