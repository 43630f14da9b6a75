"""Flash-attention backward kernels for Hopper in Pallas Mosaic GPU: a dq kernel (rows = query
tiles) and a dk/dv kernel (rows = key tiles), both recomputing P from the forward's lse, and
the driver that runs them.

Legend: B batch, T/S query/key length (Tp/Sp padded to the CTA tile), N query heads, K kv heads,
G = N // K, Dqk q/k head dim, Dv value head dim, bq/bkv tile rows.

Maths: FlashAttention-2 backward (Dao 2023, arXiv 2307.08691, Alg. 2) in base 2:
P = exp2(S * c2 - lse2) with c2 = scale * log2(e), dS = P * (dP - delta), delta =
rowsum(O * dO) - dlse; dQ = scale * dS K, dK = scale * dS^T Q, dV = P^T dO. See `mosaic_common`
for the CTA layout and the masking ranges.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import lower_once
from pallas_kernels.flash_attention.mosaic_common import (COL, LOG2E, ROW, SMEM_BYTES, WGMMA,
                                                          Config, Sync, compiler_params, delta0,
                                                          iota, mm, pad_to, prepare,
                                                          query_ranges, smem_bytes, tile_ranges,
                                                          tiled)

REGS = (240, 24)         # setmaxnreg of the compute and memory warpgroups: 2 * 240 + 24 <= 512


def _mm_two_split(a1, b1, shape1, a2, b2, shape2, *, interpret, between):
    """Two wgmmas from shared memory issued back to back into fresh fp32 accumulators; waits
    for the first only and returns (between(a1 @ b1), a2 @ b2): `between` runs while the second
    product is on the tensor cores."""
    if interpret:
        x1 = mm(a1, b1, shape1, interpret=interpret)
        x2 = mm(a2, b2, shape2, interpret=interpret)
        return between(x1), x2

    def body(r1, r2):
        plgpu.wgmma(r1, a1, b1)
        plgpu.wgmma(r2, a2, b2)
        y = between(plgpu.wgmma_accumulator_load(r1, wait_n=1))
        return y, plgpu.wgmma_accumulator_load(r2, wait_n=0)
    return pl.run_scoped(body, plgpu.ACC(shape1, jnp.float32), plgpu.ACC(shape2, jnp.float32))


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


def dq_dlt_fits(Dqk, Dv, cfg: Config):
    """True when the dq kernel has the shared memory to compute delta = rowsum(o * dO) itself
    (an O tile and a [bq] fp32 row per warpgroup on top of `smem_bytes`' dq figure)."""
    return smem_bytes(Dqk, Dv, cfg)[1] + 2 * cfg.block_q * (2 * Dv + 4) <= SMEM_BYTES


@lower_once
def _dq_kernel(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, q_seg, kv_seg, *, scale, causal, S,
               cfg: Config, interpret, o=None, dlse=None):
    """dq [B, Tp, N, Dqk] = scale * sum_s dS[t, s] k[s], dS = P * (dP - dlt) (FA2 Alg. 2).

    Per key block, S = Q K^T and dP = dO V^T are issued back to back and P is computed while dP
    runs. With o [B, Tp, N, Dv] given (dlt None), each warpgroup computes its rows' delta =
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

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_or_o_ref, wgb_ref, ctab_ref, dl_ref,
               qseg_ref, kseg_ref, *rest):
        dlse_ref = rest[0] if has_dlse else None
        dq_ref, *rest = rest[1:] if has_dlse else rest
        dlt_out_ref, scoped = rest if own_dlt else (None, rest[0])
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        qt = lax.axis_index("qt")
        if causal:   # later query tiles see more keys: start them first (no tail of long tiles)
            qt = Tp // (2 * bq) - 1 - qt
        wg = lax.axis_index("wg")
        (q_smems, do_smems, k_smems, v_smems, stage_smems, o_smems, dlt_smems), \
            (k_bar, v_bar, q_bar, do_bar, o_bar) = scoped
        sig = Sync(("k", "v"), stages=stages)
        L = ctab_ref[b, qt, 0]
        H = ctab_ref[b, qt, 1]

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(REGS[0], action="increase")
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
            lse = plgpu.load(lse_ref.at[b, h, qs], layout=ROW, optimized=False)
            if own_dlt:   # delta = rowsum(o * dO) - dlse, written out for the dk/dv kernel
                plgpu.barrier_wait(o_bar.at[wg])
                plgpu.barrier_wait(do_bar.at[wg])
                od = (plgpu.load(o_smems.at[wg], layout=WGMMA).astype(jnp.float32)
                      * plgpu.load(do_smem, layout=WGMMA).astype(jnp.float32))
                dlt = od.sum(axis=1)
                if has_dlse:
                    dlt = dlt - plgpu.load(dlse_ref.at[b, h, qs], layout=ROW, optimized=False)
                dlt_smems.at[wg][...] = dlt
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dlt_smems.at[wg], dlt_out_ref.at[b, h, qs])
            else:
                dlt = plgpu.load(dlt_or_o_ref.at[b, h, qs], layout=ROW, optimized=False)
            if has_seg:
                qseg = plgpu.load(qseg_ref.at[b, qs], layout=ROW, optimized=False)
            dq = plgpu.layout_cast(jnp.zeros((bq, Dqk), jnp.float32), WGMMA)
            plgpu.barrier_wait(q_bar.at[wg])
            if not own_dlt:
                plgpu.barrier_wait(do_bar.at[wg])
            # dq_regs "do": dO from registers for dP (loaded once the TMA barrier was waited)
            do_op = do_smem
            if cfg.dq_regs == "do" and interpret is None:
                do_op = plgpu.load(do_smem, (), layout=WGMMA)

            def step(ki, dq, *, masked):
                slot = lax.rem(ki - L, stages)

                def probs(s):
                    p = jnp.exp2(s * c2 - lax.broadcast_in_dim(lse, s.shape, [0]))
                    if masked:
                        kv_pos = ki * bkv + iota((bq, bkv), 1)
                        ok = kv_pos < S
                        if causal:
                            ok = ok & (kv_pos <= q_base + iota((bq, bkv), 0) + dl)
                        if has_seg:
                            kseg = plgpu.load(kseg_ref.at[b, pl.ds(ki * bkv, bkv)],
                                              layout=COL, optimized=False)
                            ok = ok & (lax.broadcast_in_dim(qseg, (bq, bkv), [0])
                                       == lax.broadcast_in_dim(kseg, (bq, bkv), [1]))
                        p = jnp.where(ok, p, 0.0)
                    return p

                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                p, dp = _mm_two_split(q_smem, k_smems.at[slot].T, (bq, bkv), do_op,
                                      v_smems.at[slot].T, (bq, bkv), interpret=interpret,
                                      between=probs)
                sig.free("v", slot)
                ds = p * (dp - lax.broadcast_in_dim(dlt, dp.shape, [0]))
                dq = mm(ds.astype(dtype), k_smems.at[slot], (bq, Dqk), dq, interpret=interpret,
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
            plgpu.set_max_registers(REGS[1], action="decrease")
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
            def _(ki):   # the last frees too: no named-barrier arrival is left unmatched at exit
                slot = lax.rem(ki - L, stages)
                sig.wait_free("k", slot)
                sig.wait_free("v", slot)

    def entry(*refs):
        stage = plgpu.SMEM((2, bq, bkv), dtype) if interpret else None
        o_smems = tiled((2, bq, Dv), dtype) if own_dlt else None
        dlt_smems = plgpu.SMEM((2, bq), jnp.float32) if own_dlt else None
        smems = (tiled((2, bq, Dqk), dtype), tiled((2, bq, Dv), dtype),
                 tiled((stages, bkv, Dqk), dtype), tiled((stages, bkv, Dv), dtype), stage,
                 o_smems, dlt_smems)
        bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
                plgpu.Barrier(num_barriers=2) if own_dlt else None)
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smems, bars, collective_axes="wg")

    seg_args = (q_seg, kv_seg) if has_seg else (jnp.zeros((1, 1), jnp.int32),) * 2
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    if own_dlt:
        out_type = (out_type, jax.ShapeDtypeStruct((B, N, Tp), jnp.float32))
    return plgpu.kernel(
        entry, out_type=out_type, grid=(N, Tp // (2 * bq), B),
        grid_names=("h", "qt", "b"), num_threads=3, thread_name="wg",
        compiler_params=compiler_params(), interpret=interpret,
    )(q, k, v, do, lse2, o if own_dlt else dlt, wgb, ctab, delta_arr, *seg_args,
      *((dlse,) if has_dlse else ()))


@lower_once
def _dkv_kernel(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, q_seg, kv_seg, *, scale, causal,
                cfg: Config, interpret):
    """dk [B, Sp, K, Dqk] = scale * sum_{g, t} dS^T q-row, dv [B, Sp, K, Dv] = sum P^T dO, summed
    over the G query heads of each kv head inside the kernel (FA2 Alg. 2, transposed tiles).
    The memory warpgroup TMA-loads each query block's lse and delta rows with its Q and dO
    tiles (no L2 round trip in the compute warpgroups' steps); `Config.dkv_issue` orders the
    products."""
    B, Tp, N, Dqk = q.shape
    Sp, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    bkv, bq, stages = cfg.block_kv_dkv, cfg.block_q_dkv, cfg.stages_bwd
    dtype = q.dtype
    has_seg = q_seg is not None
    c2 = scale * LOG2E

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_ref, wgb_ref, ctab_ref, dl_ref, qseg_ref,
               kseg_ref, dk_ref, dv_ref, scoped):
        b = lax.axis_index("b")
        kvh = lax.axis_index("h")
        kt = lax.axis_index("kt")
        wg = lax.axis_index("wg")
        (k_smems, v_smems, q_smems, do_smems, stage_smems, lse_smems, dlt_smems), \
            (q_bar, do_bar, k_bar, v_bar) = scoped
        sig = Sync(("q", "do"), stages=stages)
        L = ctab_ref[b, kt, 0]
        H = ctab_ref[b, kt, 1]
        n_c = H - L
        n_c1 = jnp.maximum(n_c, 1)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(REGS[0], action="increase")
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
                kseg = plgpu.load(kseg_ref.at[b, ks], layout=ROW, optimized=False)
            dk = plgpu.layout_cast(jnp.zeros((bkv, Dqk), jnp.float32), WGMMA)
            dv = plgpu.layout_cast(jnp.zeros((bkv, Dv), jnp.float32), WGMMA)
            plgpu.barrier_wait(k_bar.at[wg])
            plgpu.barrier_wait(v_bar.at[wg])

            def head(g, carry):
                def step(c, carry, *, masked):
                    dk, dv = carry
                    slot = lax.rem(g * n_c + c - L, stages)
                    qs = pl.ds(c * bq, bq)
                    if masked and has_seg:
                        qseg = plgpu.load(qseg_ref.at[b, qs], layout=COL, optimized=False)

                    def probs(sT, folded):
                        """P^T [bkv, bq] from S^T (folded: S^T - lse / c2), masked."""
                        if folded:
                            pT = jnp.exp2(sT * c2)
                        else:
                            pT = jnp.exp2(sT * c2 - lax.broadcast_in_dim(lse, sT.shape, [1]))
                        if masked:
                            ok = None
                            if causal:
                                ok = ((kv_base + iota((bkv, bq), 0))
                                      <= (c * bq + iota((bkv, bq), 1) + dl))
                            if has_seg:
                                same = (lax.broadcast_in_dim(kseg, (bkv, bq), [0])
                                        == lax.broadcast_in_dim(qseg, (bkv, bq), [1]))
                                ok = same if ok is None else ok & same
                            if ok is not None:
                                pT = jnp.where(ok, pT, 0.0)
                        return pT

                    def stat_load(ref):
                        x = plgpu.load(ref, layout=COL, optimized=False)
                        if interpret:
                            # The TMA that refills this slot (async proxy) follows a plain
                            # shared-memory read here; compiled, the read has completed (its
                            # value feeds a product) before the slot is freed, which GPU
                            # interpret mode's race detector does not model: a proxy fence
                            # tells it so.
                            plgpu.commit_smem()
                        return x

                    plgpu.barrier_wait(q_bar.at[slot])
                    lse = stat_load(lse_smems.at[slot])    # the rows' lse came with Q
                    do_s = do_smems.at[slot]
                    if cfg.dkv_issue == "sdp1":
                        plgpu.barrier_wait(do_bar.at[slot])
                        pT, dpT = _mm_two_split(k_smem, q_smems.at[slot].T, (bkv, bq), v_smem,
                                                do_s.T, (bkv, bq), interpret=interpret,
                                                between=functools.partial(probs, folded=False))
                        dv = mm(pT.astype(dtype), do_s, (bkv, Dv), dv, interpret=interpret,
                                stage=stage, a_in_regs=True)
                        dlt = stat_load(dlt_smems.at[slot])   # before the dO slot is freed
                        sig.free("do", slot)
                        dsT = pT * (dpT - lax.broadcast_in_dim(dlt, dpT.shape, [1]))
                    else:   # "serial": the row statistics start the accumulators
                        s0 = lax.broadcast_in_dim(lse * (-1.0 / c2), (bkv, bq), [1])
                        sT = mm(k_smem, q_smems.at[slot].T, (bkv, bq), s0, interpret=interpret)
                        pT = probs(sT, folded=True)
                        plgpu.barrier_wait(do_bar.at[slot])
                        dv = mm(pT.astype(dtype), do_s, (bkv, Dv), dv, interpret=interpret,
                                stage=stage, a_in_regs=True)
                        dlt = stat_load(dlt_smems.at[slot])    # the delta row came with dO
                        dpT = mm(v_smem, do_s.T, (bkv, bq),
                                 lax.broadcast_in_dim(-dlt, (bkv, bq), [1]), interpret=interpret)
                        sig.free("do", slot)
                        dsT = pT * dpT
                    dk = mm(dsT.astype(dtype), q_smems.at[slot], (bkv, Dqk), dk,
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
            plgpu.set_max_registers(REGS[1], action="decrease")
            n = G * n_c

            def load(j, slot, wait=False):   # wait: for the slot's previous use to be freed
                g = lax.div(j, n_c1)
                c = L + lax.rem(j, n_c1)
                h = kvh * G + g
                qs = pl.ds(c * bq, bq)
                if wait:
                    sig.wait_free("q", slot)
                # Q rows and their lse complete on one barrier, dO rows and their delta on another
                plgpu.copy_gmem_to_smem(q_ref.at[b, qs, h], q_smems.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[b, h, qs], lse_smems.at[slot], q_bar.at[slot])
                if wait:
                    sig.wait_free("do", slot)
                plgpu.copy_gmem_to_smem(do_ref.at[b, qs, h], do_smems.at[slot], do_bar.at[slot])
                plgpu.copy_gmem_to_smem(dlt_ref.at[b, h, qs], dlt_smems.at[slot],
                                        do_bar.at[slot])

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
        smems = (tiled((2, bkv, Dqk), dtype), tiled((2, bkv, Dv), dtype),
                 tiled((stages, bq, Dqk), dtype), tiled((stages, bq, Dv), dtype), stage,
                 plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32))
        bars = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),   # Q + lse; dO + delta
                plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2))
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smems, bars, collective_axes="wg")

    seg_args = (q_seg, kv_seg) if has_seg else (jnp.zeros((1, 1), jnp.int32),) * 2
    return plgpu.kernel(
        entry, out_type=(jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)),
        grid=(K, Sp // (2 * bkv), B), grid_names=("h", "kt", "b"), num_threads=3,
        thread_name="wg", compiler_params=compiler_params(), interpret=interpret,
    )(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, *seg_args)


def _delta_xla(o, do, dlse, Tp):
    """delta [B, N, Tp] fp32 = rowsum(o * do) - dlse by XLA, padded rows 0 (o, do [B, T, N, Dv];
    dlse [B, N, T] or None)."""
    dlt = jnp.einsum("btnd,btnd->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    if dlse is not None:
        dlt = dlt - dlse.astype(jnp.float32)
    return pad_to(dlt, 2, Tp)


def backward(q, k, v, segs, offsets, o, lse2, do, dlse, *, scale, causal, cfg, interpret,
             static_delta=None):
    """dq, dk, dv from the forward's inputs (as `mosaic_fwd.forward`) and residuals o, lse2
    (base 2), and the cotangents do [B, T, N, Dv] and dlse [B, N, T] (of the natural lse, or
    None), which enters as dS = P * (dP - (rowsum(o * do) - dlse))."""
    B, T, N, _ = q.shape
    qp, kp, vp, q_seg, kv_seg, delta, T, S, Tp, Sp = prepare(
        q, k, v, segs, offsets, cfg=cfg, static_delta=static_delta)
    # delta = rowsum(o * dO) - dlse: inside the dq kernel when its shared memory allows, else
    # here by XLA.
    own_dlt = dq_dlt_fits(q.shape[-1], v.shape[-1], cfg)
    if own_dlt:
        dlt = None
        dlse_p = None if dlse is None else pad_to(dlse.astype(jnp.float32), 2, Tp)
    else:
        dlt = _delta_xla(o, do, dlse, Tp)
    # lse2 +inf on fully masked and padded rows, so P = 0 there
    lse_b = pad_to(jnp.where(jnp.isneginf(lse2), jnp.inf, lse2), 2, Tp, value=jnp.inf)
    dop = pad_to(do.astype(q.dtype), 1, Tp)
    wgb, ctab = query_ranges(B, Tp, Sp, T, S, causal, delta, q_seg, kv_seg, cfg, cfg.block_kv_dq,
                             static_delta)
    dq = _dq_kernel(qp, kp, vp, dop, lse_b, dlt, wgb, ctab, delta, q_seg, kv_seg, scale=scale,
                    causal=causal, S=S, cfg=cfg, interpret=interpret,
                    o=pad_to(o.astype(q.dtype), 1, Tp) if own_dlt else None,
                    dlse=dlse_p if own_dlt else None)
    if own_dlt:
        dq, dlt = dq
    if interpret is not None:
        # GPU interpret mode keeps global simulator state: run the two kernels one after the
        # other (under jit, XLA:CPU could otherwise run them concurrently and hang).
        dq, qp = lax.optimization_barrier((dq, qp))
    wgb2, ctab2 = tile_ranges(B=B, n_rows_p=Sp, row_block=cfg.block_kv_dkv, n_cols_p=Tp,
                              col_block=cfg.block_q_dkv, rows_are_q=False, T=T, S=S,
                              causal=causal, delta=delta0(delta, static_delta), q_seg=q_seg,
                              kv_seg=kv_seg)
    dk, dv = _dkv_kernel(qp, kp, vp, dop, lse_b, dlt, wgb2, ctab2, delta, q_seg, kv_seg,
                         scale=scale, causal=causal, cfg=cfg, interpret=interpret)
    return dq[:, :T], dk[:, :S], dv[:, :S]
