"""Flash-attention forward kernel for Hopper in Pallas Mosaic GPU.

Legend: B batch, T/S query/key length (Tp/Sp padded to the CTA tile), N query heads, K kv heads,
G = N // K, Dqk q/k head dim, Dv value head dim, bq/bkv tile rows.

Maths: FlashAttention-2 online softmax (Dao 2023, arXiv 2307.08691, Alg. 1) in base 2, with the
FlashAttention-3 schedule (arXiv 2407.08608, sec. 3.1-3.2): the two compute warpgroups take
turns ("ping-pong") issuing their products, and each one's key loop is software-pipelined (the
P V product of block j - 1 is issued together with Q K^T of block j), so one warpgroup's softmax
runs while the other's products are on the tensor cores. See `mosaic_common` for the CTA layout
and the masking ranges.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import lower_once
from pallas_kernels.flash_attention.mosaic_common import (COL, LOG2E, ROW, WGMMA, Config, Sync,
                                                          compiler_params, iota, mm, prepare,
                                                          query_ranges, tiled)

M_INIT = -1e30           # finite running-max start: no inf - inf on empty rows
REGS = (232, 40)         # setmaxnreg of the compute and memory warpgroups: 2 * 232 + 40 <= 512


def _online_softmax(s, acc, m_i, l_i, dtype, c2):
    """One key block of the base-2 online softmax (FA2 Alg. 1): s [bq, bkv] fp32 masked,
    unscaled scores, acc [bq, Dv], m_i / l_i [bq] running max (base 2, scaled) and sum. The
    scale enters P = exp2(s * c2 - m) as one FMA per element (c2 > 0, so max(s) * c2 =
    max(s * c2)). Returns the rescaled acc, the new max and sum, and P [bq, bkv] in `dtype` for
    the P V product."""
    m_new = jnp.maximum(m_i, s.max(axis=1) * c2)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s * c2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return acc, m_new, l_i, p.astype(dtype)


def _mm_acc_then_fresh(a1, b1, acc1, a2, b2, shape2, *, interpret, stage, after_issue):
    """(acc1 + a1 @ b1, a2 @ b2) with a1 in registers, issued in that order, one wait: the
    register operand is fenced before the first product starts. `after_issue()` runs once both
    products are issued, before the wait."""
    if interpret:
        x1 = mm(a1, b1, acc1.shape, acc1, interpret=interpret, stage=stage, a_in_regs=True)
        x2 = mm(a2, b2, shape2, interpret=interpret)
        after_issue()
        return x1, x2

    def body(refs):
        r1, r2 = refs
        plgpu.wgmma(r1, a1, b1)
        plgpu.wgmma(r2, a2, b2)
        after_issue()
    zero = plgpu.layout_cast(jnp.zeros(shape2, jnp.float32), WGMMA)
    return pl.run_state(body)((plgpu.ACC.init(acc1), plgpu.ACC.init(zero)))


def _key_loop(*, L, lo, mlo, mhi, hi, H, wg, carry, q_smem, k_smems, v_smems, bars, sig, mask,
              c2, stages, shapes, dtype, stage, interpret):
    """Key loop of one compute warpgroup, software-pipelined.

    Key blocks [L, H) are the CTA's; this warpgroup computes [lo, hi) (element masks outside
    [mlo, mhi)) and only keeps the barriers in step elsewhere. Block lo computes S alone
    (prologue); each later block j issues O += P_{j-1} V_{j-1} (P from registers, fenced before
    anything is in flight) and S_j = Q K_j^T back to back and waits once; the last P V runs
    after the loop. Turns: warpgroup w waits for its turn before issuing a block's products and
    passes the turn after, so the two warpgroups' products alternate while the other runs its
    softmax (warpgroup 0 takes the first turn unasked and consumes the last pass at the end).
    Returns (acc [bq, Dv] fp32 unnormalised, m2 [bq], l [bq]).
    """
    k_bar, v_bar = bars
    (bq, bkv), acc_shape = shapes
    acc, m_i, l_i = carry

    def turn_wait(j):
        @pl.when((wg == 1) | (j != L))
        def _():
            sig.turn_wait(wg)

    def turn_pass():
        sig.turn_pass(wg)

    def slot(j):
        return lax.rem(j - L, stages)

    def softmax(s, j, acc, m_i, l_i, masked):
        if masked:
            s = mask(s, j)
        return _online_softmax(s, acc, m_i, l_i, dtype, c2)

    def skip(j, c):
        plgpu.barrier_wait(k_bar.at[slot(j)])
        sig.free("k", slot(j))
        plgpu.barrier_wait(v_bar.at[slot(j)])
        sig.free("v", slot(j))
        turn_wait(j)
        turn_pass()
        return c

    def first(j, c):          # block lo: S alone, always element-masked (one block per tile)
        acc, m_i, l_i, _ = c
        plgpu.barrier_wait(k_bar.at[slot(j)])
        turn_wait(j)

        def qk(s_ref):
            plgpu.wgmma(s_ref, q_smem, k_smems.at[slot(j)].T)
            turn_pass()
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
                                    after_issue=turn_pass)
        sig.free("v", sp)
        sig.free("k", sj)
        return softmax(s, j, acc, m_i, l_i, masked)

    def last(j, c):           # the P V product of block hi - 1
        acc, m_i, l_i, p16 = c
        plgpu.barrier_wait(v_bar.at[slot(j)])
        acc = mm(p16, v_smems.at[slot(j)], acc_shape, acc, interpret=interpret, stage=stage,
                 a_in_regs=True)
        sig.free("v", slot(j))
        return acc, m_i, l_i, p16

    p0 = plgpu.layout_cast(jnp.zeros((bq, bkv), dtype), WGMMA)
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


@lower_once
def _forward_kernel(q, k, v, wgb, ctab, delta_arr, q_seg, kv_seg, *, scale, causal, S,
                    cfg: Config, interpret):
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

    def kernel(q_ref, k_ref, v_ref, wgb_ref, ctab_ref, dl_ref, qseg_ref, kseg_ref, o_ref, lse_ref,
               scoped):
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        qt = lax.axis_index("qt")
        if causal:   # later query tiles see more keys: start them first (no tail of long tiles)
            qt = n_qt - 1 - qt
        wg = lax.axis_index("wg")
        (qo_smems, k_smems, v_smems, lse_smems, stage_smems), (k_bar, v_bar, q_bar) = scoped
        q_smems, o_smems = qo_smems
        sig = Sync(("k", "v"), stages=stages)
        L = ctab_ref[b, qt, 0]
        H = ctab_ref[b, qt, 1]

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(REGS[0], action="increase")
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
                qseg = plgpu.load(qseg_ref.at[b, pl.ds(q_base, bq)], layout=ROW, optimized=False)
            acc = plgpu.layout_cast(jnp.zeros((bq, Dv), jnp.float32), WGMMA)
            m_i = plgpu.layout_cast(jnp.full((bq,), M_INIT, jnp.float32), ROW)
            l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), ROW)
            plgpu.barrier_wait(q_bar.at[wg])

            def mask(s, ki):
                """s with -inf where key block ki's columns are masked for this tile's rows."""
                kv_pos = ki * bkv + iota((bq, bkv), 1)
                ok = kv_pos < S
                if causal:
                    ok = ok & (kv_pos <= q_base + iota((bq, bkv), 0) + dl)
                if has_seg:
                    kseg = plgpu.load(kseg_ref.at[b, pl.ds(ki * bkv, bkv)], layout=COL,
                                      optimized=False)
                    ok = ok & (lax.broadcast_in_dim(qseg, (bq, bkv), [0])
                               == lax.broadcast_in_dim(kseg, (bq, bkv), [1]))
                return jnp.where(ok, s, -jnp.inf)

            acc, m_i, l_i = _key_loop(
                L=L, lo=lo, mlo=mlo, mhi=mhi, hi=hi, H=H, wg=wg, carry=(acc, m_i, l_i),
                q_smem=q_smem, k_smems=k_smems, v_smems=v_smems, bars=(k_bar, v_bar), sig=sig,
                mask=mask, c2=c2, stages=stages, shapes=((bq, bkv), (bq, Dv)), dtype=dtype,
                stage=None if stage_smems is None else stage_smems.at[wg], interpret=interpret)
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
            plgpu.set_max_registers(REGS[1], action="decrease")
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
            def _(ki):   # the last frees too: no named-barrier arrival is left unmatched at exit
                slot = lax.rem(ki - L, stages)
                sig.wait_free("k", slot)
                sig.wait_free("v", slot)

    def entry(*refs):
        q_s = tiled((2, bq, Dqk), dtype)
        if union_o:
            qo = plgpu.RefUnion(q_s, tiled((2, (bq * Dqk) // Dv, Dv), dtype))
        else:
            qo = (q_s, tiled((2, bq, Dv), dtype))
        stage = plgpu.SMEM((2, bq, bkv), dtype) if interpret else None
        smems = (qo, tiled((stages, bkv, Dqk), dtype), tiled((stages, bkv, Dv), dtype),
                 plgpu.SMEM((2, bq), jnp.float32), stage)
        bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2))   # TMA completion: K, V slots; Q per warpgroup
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smems, bars, collective_axes="wg")

    out_type = (jax.ShapeDtypeStruct((B, Tp, N, Dv), dtype),
                jax.ShapeDtypeStruct((B, N, Tp), jnp.float32))
    seg_args = (q_seg, kv_seg) if has_seg else (jnp.zeros((1, 1), jnp.int32),) * 2
    return plgpu.kernel(
        entry, out_type=out_type, grid=(N, n_qt, B), grid_names=("h", "qt", "b"),
        num_threads=3, thread_name="wg", compiler_params=compiler_params(),
        interpret=interpret,
    )(q, k, v, wgb, ctab, delta_arr, *seg_args)


def forward(q, k, v, segs, offsets, *, scale, causal, cfg, interpret, static_delta=None):
    """o [B, T, N, Dv] in q.dtype and lse2 [B, N, T] fp32 (base 2, -inf on fully masked rows)
    of q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv]; segs None or (q_seg [B, T],
    kv_seg [B, S]); offsets (q_offset, kv_offset); static_delta q_offset - kv_offset when both
    are Python ints (the range tables become constants)."""
    qp, kp, vp, q_seg, kv_seg, delta, T, S, Tp, Sp = prepare(
        q, k, v, segs, offsets, cfg=cfg, static_delta=static_delta)
    wgb, ctab = query_ranges(q.shape[0], Tp, Sp, T, S, causal, delta, q_seg, kv_seg, cfg,
                             cfg.block_kv, static_delta)
    o, lse2 = _forward_kernel(qp, kp, vp, wgb, ctab, delta, q_seg, kv_seg, scale=scale,
                              causal=causal, S=S, cfg=cfg, interpret=interpret)
    return o[:, :T], lse2[:, :, :T]
