"""Fused flash-attention backward for Hopper in Pallas Mosaic GPU (v3): one kernel computes
S, P, dP and dS once per (key tile, query tile) pair, keeps dK and dV in registers, and adds
dQ into an fp32 buffer in global memory with TMA reduce-adds.

Legend: B batch, T/S query/key length (Tp/Sp padded), N query heads, K kv heads, G = N // K,
Dqk q/k head dim, Dv value head dim, bq = bkv = 64 tile rows.

Maths: FlashAttention-2 backward (Dao 2023, arXiv 2307.08691, Alg. 2) with FlashAttention-3's
dQ accumulation (Shah et al. 2024, arXiv 2407.08608, sec. 3.1). Per query tile t of a kv head:

    P^T = exp2(c2 * K Q^T - lse2),  dV += P^T dO,  dP^T = V dO^T,  dS^T = P^T * (dP^T - dlt),
    dK += dS^T Q,                   dQ[t] += dS K  (both scaled by `scale` at the end)

Layout: grid (kv head, 128-key tile, batch); one TMA producer warpgroup streams the (Q, dO)
tiles of all G query heads; two compute warpgroups each own 64 keys (dK, dV in registers).
dQ[t] needs the dS of both warpgroups, so each publishes its dS^T tile in shared memory and
each computes a 64-column slice of dQ[t] over all 128 keys. Unlike the v2 kernels (RESULTS.md,
"v2"), the two warpgroups are not locked together step by step: dS^T is double-buffered and
the dQ of step j is computed after the S/dP/dS work of step j + 1, so one warpgroup's
element-wise phase can run under the other's matrix products. The dQ column chunks alternate
between the warpgroups from step to step (MLA: 3 chunks of 64 columns, 2 + 1 then 1 + 2).

`backward` has the inputs and outputs of `mosaic_gpu._backward`; shapes whose shared memory
does not fit the fused kernel (Dqk + Dv > 320, e.g. 256/256) go to that two-kernel backward.

Status (H200, RESULTS.md "v3 fused backward"): correct (compiled: dk, dv bitwise equal to v1,
dq 6e-5 from v1), but not faster: MLA B4 T4096 3.39 ms vs v1 2.51 ms, 128/128 1.91 vs 1.88.
ptxas spills 1.7 KB (MLA) / 0.8 KB (128/128) per thread at 240 registers, and with 192-224 KiB
of shared memory the L1 left for local memory is small; the timing ablations in `FusedConfig`
put the extra time in the dQ part (products + fp32 staging: +0.95 ms at MLA; reduce-adds
+0.56 ms), not in the dS exchange (+0.30 ms) nor the dK/dV step (1.57 ms alone).
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

from pallas_kernels.flash_attention import mosaic_gpu as mg
from pallas_kernels.flash_attention.mosaic_gpu import (LOG2E, _COL, _ROW, _WGMMA, _iota, _mm,
                                                       _pad_to, _tiled)

SMEM_LIMIT = 227 * 1024 - 1024   # the H100/H200 per-block opt-in limit, less barriers


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Knobs of the fused backward. Tiles are fixed: 64 keys per compute warpgroup, 64 queries
    per step (one wgmma M tile each)."""
    stages: int = 2          # Q/dO pipeline depth
    dq_cols: int = 64        # dQ columns per wgmma and per TMA reduce-add
    p_bf16: bool = False     # form dS from the bf16-rounded P (16 fewer live registers)
    regs: tuple = (240, 24)  # setmaxnreg of the compute / producer warpgroups
    # Timing ablations (wrong dq, for diagnosis only): "no_reduce" skips the TMA reduce-adds,
    # "no_dq" also the dQ products and staging (the dS^T exchange stays), "no_exchange" also
    # the dS^T stores and barriers (what remains is the v1 dk/dv kernel's step).
    ablate: str = ""


BQ = BKV = 64


def fused_smem_bytes(Dqk, Dv, fc: FusedConfig):
    """Shared memory of the fused kernel in bytes (2-byte inputs)."""
    kv = 2 * BKV * (Dqk + Dv) * 2                 # K, V of both warpgroups
    qdo = fc.stages * BQ * (Dqk + Dv) * 2         # Q, dO pipeline
    ds = 2 * 2 * BKV * BQ * 2                     # dS^T: 2 warpgroups x 2 buffers
    stage = 2 * BQ * fc.dq_cols * 4               # fp32 dQ staging, one per warpgroup
    return kv + qdo + ds + stage


def fits(Dqk, Dv, fc: FusedConfig | None = None):
    """True when the fused kernel takes these head dims (else `backward` uses the v1 kernels)."""
    fc = FusedConfig() if fc is None else fc
    return Dqk % fc.dq_cols == 0 and fused_smem_bytes(Dqk, Dv, fc) <= SMEM_LIMIT


def _fp32_tiled(shape):
    return plgpu.SMEM(shape, jnp.float32, transforms=(plgpu.TilingTransform((8, 32)),
                                                      plgpu.SwizzleTransform(128)))


def _fused_call(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, q_seg, kv_seg, dq_acc, *, scale,
                causal, S, fc: FusedConfig, interpret):
    """The fused kernel. q [B, Tp, N, Dqk], k [B, Sp, K, Dqk], v [B, Sp, K, Dv], do [B, Tp, N, Dv]
    (q.dtype); lse2, dlt [B, N, Tp] fp32; wgb [B, Sp // 64, 4] / ctab [B, Sp // 128, 2] int32
    key-tile ranges over 64-query column blocks; dq_acc: fp32 [B, Tp, N, Dqk] mutable ref, zero
    on entry, receives sum_s dS[t, s] k[s] (unscaled).

    Returns dk [B, Sp, K, Dqk] = scale * sum dS^T q and dv [B, Sp, K, Dv] = sum P^T dO in
    q.dtype, summed over the G query heads of each kv head inside the kernel.
    """
    B, Tp, N, Dqk = q.shape
    Sp, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    bq, bkv, stages, dqc = BQ, BKV, fc.stages, fc.dq_cols
    dtype = q.dtype
    has_seg = q_seg is not None
    c2 = scale * LOG2E
    n_chunks = Dqk // dqc
    chunk_sets = (tuple(range(0, n_chunks, 2)), tuple(range(1, n_chunks, 2)))

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_ref, wgb_ref, ctab_ref, dl_ref, qseg_ref,
               kseg_ref, dq_ref, dk_ref, dv_ref, scoped):
        b = lax.axis_index("b")
        kvh = lax.axis_index("h")
        kt = lax.axis_index("kt")
        wg = lax.axis_index("wg")
        (k_smems, v_smems, q_smems, do_smems, ds_smems, dq_stage, stage_smems), \
            (q_bar, do_bar, k_bar, v_bar), (q_cons, do_cons, ds_ready, ds_free) = scoped
        L = ctab_ref[b, kt, 0]
        H = ctab_ref[b, kt, 1]
        n_c = H - L
        n_c1 = jnp.maximum(n_c, 1)
        n = G * n_c

        def step_coords(j):
            g = lax.div(j, n_c1)
            c = L + lax.rem(j, n_c1)
            return kvh * G + g, c

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(fc.regs[0], action="increase")
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
            plgpu.barrier_wait(k_bar.at[0])      # dQ reads the K tiles of both warpgroups
            plgpu.barrier_wait(k_bar.at[1])
            plgpu.barrier_wait(v_bar.at[wg])
            if fc.ablate != "no_exchange":
                plgpu.barrier_arrive(ds_free.at[0])  # both dS^T buffers start free
                plgpu.barrier_arrive(ds_free.at[1])

            def dq_step(j):
                """dQ columns of this warpgroup for step j, over the keys of both warpgroups."""
                h, c = step_coords(j)
                qs = pl.ds(c * bq, bq)
                buf = lax.rem(j, 2)
                plgpu.barrier_wait(ds_ready.at[buf])
                if fc.ablate == "no_dq":
                    plgpu.barrier_arrive(ds_free.at[buf])
                    return
                mine = lax.rem(wg + j, 2) == 0
                for pred, chunks in ((mine, chunk_sets[0]), (~mine, chunk_sets[1])):
                    @pl.when(pred)
                    def _(chunks=chunks):
                        if not chunks:
                            plgpu.barrier_arrive(ds_free.at[buf])
                        for i, ci in enumerate(chunks):
                            cols = pl.ds(ci * dqc, dqc)

                            def body(acc_ref):
                                for w in range(2):
                                    plgpu.wgmma(acc_ref, ds_smems.at[w, buf].T,
                                                k_smems.at[w, :, cols])
                                return acc_ref[...]
                            part = pl.run_scoped(body, plgpu.ACC((bq, dqc), jnp.float32))
                            if i == len(chunks) - 1:
                                plgpu.barrier_arrive(ds_free.at[buf])
                            if fc.ablate == "no_reduce":
                                st = dq_stage.at[wg]
                                st[...] = part
                                plgpu.commit_smem()
                            elif interpret is not None:
                                # GPU interpret mode (jax 0.11.2) has no TMA reductions; it runs
                                # CTAs one after another, so a read-modify-write is exact.
                                dq_ref[b, qs, h, cols] = dq_ref[b, qs, h, cols] + part
                            else:
                                st = dq_stage.at[wg]
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                st[...] = part
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(st, dq_ref.at[b, qs, h, cols],
                                                        reduction_op="add")

            def publish(j, dsT16):
                """Hand this step's dS^T to both warpgroups, then do the previous step's dQ."""
                if fc.ablate == "no_exchange":
                    return
                buf = lax.rem(j, 2)
                plgpu.barrier_wait(ds_free.at[buf])
                ds_smems.at[wg, buf][...] = dsT16
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[buf])

                @pl.when(j > 0)
                def _():
                    dq_step(j - 1)

            def step(g, c, carry, *, masked):
                dk, dv = carry
                h = kvh * G + g
                j = g * n_c + c - L
                slot = lax.rem(j, stages)
                qs = pl.ds(c * bq, bq)
                lse = plgpu.load(lse_ref.at[b, h, qs], layout=_COL, optimized=False)
                if masked and has_seg:
                    qseg = plgpu.load(qseg_ref.at[b, qs], layout=_COL, optimized=False)
                plgpu.barrier_wait(q_bar.at[slot])
                sT = _mm(k_smem, q_smems.at[slot].T, (bkv, bq), interpret=interpret)
                pT = jnp.exp2(sT * c2 - lax.broadcast_in_dim(lse, sT.shape, [1]))
                if masked:
                    kv_pos = kv_base + _iota((bkv, bq), 0)
                    ok = kv_pos < S     # padded keys: their dS would reach dQ
                    if causal:
                        ok = ok & (kv_pos <= c * bq + _iota((bkv, bq), 1) + dl)
                    if has_seg:
                        ok = ok & (lax.broadcast_in_dim(kseg, (bkv, bq), [0])
                                   == lax.broadcast_in_dim(qseg, (bkv, bq), [1]))
                    pT = jnp.where(ok, pT, 0.0)
                pT16 = pT.astype(dtype)
                if fc.p_bf16:
                    del pT
                plgpu.barrier_wait(do_bar.at[slot])
                dv = _mm(pT16, do_smems.at[slot], (bkv, Dv), dv, interpret=interpret,
                         stage=stage, a_in_regs=True)
                dpT = _mm(v_smem, do_smems.at[slot].T, (bkv, bq), interpret=interpret)
                plgpu.barrier_arrive(do_cons.at[slot])
                dlt = plgpu.load(dlt_ref.at[b, h, qs], layout=_COL, optimized=False)
                p = pT16.astype(jnp.float32) if fc.p_bf16 else pT
                dsT16 = (p * (dpT - lax.broadcast_in_dim(dlt, dpT.shape, [1]))).astype(dtype)
                dk = _mm(dsT16, q_smems.at[slot], (bkv, Dqk), dk, interpret=interpret,
                         stage=stage, a_in_regs=True)
                plgpu.barrier_arrive(q_cons.at[slot])
                publish(j, dsT16)
                return dk, dv

            def skip(g, c, carry):   # none of this warpgroup's keys sees query tile c
                j = g * n_c + c - L
                slot = lax.rem(j, stages)
                plgpu.barrier_wait(q_bar.at[slot])
                plgpu.barrier_wait(do_bar.at[slot])
                plgpu.barrier_arrive(do_cons.at[slot])
                plgpu.barrier_arrive(q_cons.at[slot])
                publish(j, plgpu.layout_cast(jnp.zeros((bkv, bq), dtype), _WGMMA))
                return carry

            def head(g, carry):
                def loop(a, z, fn, carry):
                    return lax.fori_loop(a, z, lambda c, cr: fn(g, c, cr), carry)
                carry = loop(L, lo, skip, carry)
                carry = loop(lo, mlo, functools.partial(step, masked=True), carry)
                carry = loop(mlo, mhi, functools.partial(step, masked=False), carry)
                carry = loop(mhi, hi, functools.partial(step, masked=True), carry)
                return loop(hi, H, skip, carry)

            dk, dv = lax.fori_loop(0, G, head, (dk, dv))

            if fc.ablate != "no_exchange":
                @pl.when(n > 0)
                def _():
                    dq_step(n - 1)

                # The other warpgroup's last dQ reads this K tile: wait before overwriting it.
                plgpu.barrier_wait(ds_free.at[0])
                plgpu.barrier_wait(ds_free.at[1])
            k_smem[...] = (dk * scale).astype(dtype)
            v_smem[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[b, ks, kvh])
            plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[b, ks, kvh])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(fc.regs[1], action="decrease")

            def load(j, slot):
                h, c = step_coords(j)
                qs = pl.ds(c * bq, bq)
                plgpu.copy_gmem_to_smem(q_ref.at[b, qs, h], q_smems.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[b, qs, h], do_smems.at[slot], do_bar.at[slot])

            for i in range(stages):
                @pl.when(i < n)
                def _():
                    load(jnp.int32(i), i)

            @pl.loop(stages, n)
            def _(j):
                slot = lax.rem(j, stages)
                h, c = step_coords(j)
                qs = pl.ds(c * bq, bq)
                plgpu.barrier_wait(q_cons.at[slot])
                plgpu.copy_gmem_to_smem(q_ref.at[b, qs, h], q_smems.at[slot], q_bar.at[slot])
                plgpu.barrier_wait(do_cons.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[b, qs, h], do_smems.at[slot], do_bar.at[slot])

            @pl.loop(jnp.maximum(n - stages, 0), n)
            def _(j):   # observe the last consumptions too (GPU interpret mode checks phases)
                slot = lax.rem(j, stages)
                plgpu.barrier_wait(q_cons.at[slot])
                plgpu.barrier_wait(do_cons.at[slot])

    def entry(*refs):
        stage = plgpu.SMEM((2, bkv, bq), dtype) if interpret is not None else None
        dq_st = None if interpret is not None else _fp32_tiled((2, bq, dqc))
        smems = (_tiled((2, bkv, Dqk), dtype), _tiled((2, bkv, Dv), dtype),
                 _tiled((stages, bq, Dqk), dtype), _tiled((stages, bq, Dv), dtype),
                 _tiled((2, 2, bkv, bq), dtype), dq_st, stage)
        bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2))
        syncs = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=2, num_barriers=2),
                 plgpu.Barrier(num_arrivals=2, num_barriers=2))
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smems, bars, syncs,
                      collective_axes="wg")

    seg_args = (q_seg, kv_seg) if has_seg else (jnp.zeros((1, 1), jnp.int32),) * 2
    return plgpu.kernel(
        entry, out_type=(jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)),
        grid=(K, Sp // (2 * bkv), B), grid_names=("h", "kt", "b"), num_threads=3,
        thread_name="wg", compiler_params=mg._compiler_params(), interpret=interpret,
    )(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, *seg_args, dq_acc)


def _key_ranges(B, Sp, Tp, T, S, causal, delta, q_seg, kv_seg):
    """Per 64-key tile (lo, mlo, mhi, hi) over 64-query blocks and the CTA union (L, H), with
    key tiles that hold padded keys masked on every step (their dS must not reach dQ)."""
    wgb, ctab = mg._tile_ranges(B=B, n_rows_p=Sp, row_block=BKV, n_cols_p=Tp, col_block=BQ,
                                rows_are_q=False, T=T, S=S, causal=causal, delta=delta[0],
                                q_seg=q_seg, kv_seg=kv_seg)
    padded = (jnp.arange(Sp // BKV) * BKV + BKV > S)[None, :]
    hi = wgb[..., 3]
    mlo = jnp.where(padded, hi, wgb[..., 1])
    mhi = jnp.where(padded, hi, wgb[..., 2])
    return jnp.stack([wgb[..., 0], mlo, mhi, hi], -1), ctab


def backward(q, k, v, segs, offsets, o, lse2, do, dlse, *, scale, causal, cfg, interpret,
             fcfg: FusedConfig | None = None):
    """dq, dk, dv of softmax attention from the forward residuals, by the fused kernel.

    Args (as `mosaic_gpu._backward`): q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] in
      bf16/fp16; segs None or (q_seg [B, T], kv_seg [B, S]) int; offsets (q_offset, kv_offset)
      ints or int32 scalars; o [B, T, N, Dv] the forward output; lse2 [B, N, T] fp32 base-2
      log-sum-exp (-inf on fully masked rows); do [B, T, N, Dv] cotangent of o; dlse None or
      [B, N, T] cotangent of the natural lse, entering as dS = P * (dP - (rowsum(o*do) - dlse));
      scale float; causal bool; cfg `mosaic_gpu.Config` (sets the padding); interpret None or
      `plgpu.InterpretGPUParams`; fcfg `FusedConfig` (None: defaults).

    Returns:
      (dq [B, T, N, Dqk], dk [B, S, K, Dqk], dv [B, S, K, Dv]) in q.dtype.

    Head dims whose shared memory does not fit (`fits` False) run `mosaic_gpu._backward`.
    """
    fcfg = FusedConfig() if fcfg is None else fcfg
    B, T, N, Dqk = q.shape
    if not fits(Dqk, v.shape[-1], fcfg):
        return mg._backward(q, k, v, segs, offsets, o, lse2, do, dlse, scale=scale,
                            causal=causal, cfg=cfg, interpret=interpret)
    qp, kp, vp, q_seg, kv_seg, delta, T, S, Tp, Sp = mg._prepare(q, k, v, segs, offsets,
                                                                 causal=causal, cfg=cfg)
    assert Tp % BQ == 0 and Sp % (2 * BKV) == 0, (Tp, Sp)
    dlt = jnp.einsum("btnd,btnd->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    if dlse is not None:
        dlt = dlt - dlse.astype(jnp.float32)
    dlt = _pad_to(dlt, 2, Tp)
    lse_b = jnp.where(jnp.isneginf(lse2), jnp.inf, lse2)     # fully masked rows: P = 0
    lse_b = _pad_to(lse_b, 2, Tp, value=jnp.inf)              # padded rows: P = 0
    dop = _pad_to(do.astype(q.dtype), 1, Tp)
    wgb, ctab = _key_ranges(B, Sp, Tp, T, S, causal, delta, q_seg, kv_seg)
    dq_acc = jax.new_ref(jnp.zeros((B, Tp, N, Dqk), jnp.float32))
    dk, dv = _fused_call(qp, kp, vp, dop, lse_b, dlt, wgb, ctab, delta, q_seg, kv_seg, dq_acc,
                         scale=scale, causal=causal, S=S, fc=fcfg, interpret=interpret)
    dq = (dq_acc[...][:, :T] * scale).astype(q.dtype)
    return dq, dk[:, :S], dv[:, :S]


# ----------------------------------------------------------------------------------------------
# A custom VJP with the v1 forward and this backward (tests, benchmarks).
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _attention(q, k, v, segs, offsets, scale, causal, cfg, interpret, fcfg):
    o, lse2 = mg._attn_fwd_impl(q, k, v, segs, offsets, scale=scale, causal=causal, cfg=cfg,
                                interpret=interpret)
    return o, lse2 * math.log(2.0)


def _attention_fwd(q, k, v, segs, offsets, scale, causal, cfg, interpret, fcfg):
    o, lse2 = mg._attn_fwd_impl(q, k, v, segs, offsets, scale=scale, causal=causal, cfg=cfg,
                                interpret=interpret)
    return (o, lse2 * math.log(2.0)), (q, k, v, segs, offsets, o, lse2)


def _attention_bwd(scale, causal, cfg, interpret, fcfg, res, cts):
    q, k, v, segs, offsets, o, lse2 = res
    do, dlse = cts
    dq, dk, dv = backward(q, k, v, segs, offsets, o, lse2, do, dlse, scale=scale, causal=causal,
                          cfg=cfg, interpret=interpret, fcfg=fcfg)
    seg_ct = None if segs is None else jax.tree.map(lambda _: None, segs)
    return dq, dk, dv, seg_ct, (None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_fused(q, k, v, *, causal=True, scale=None, segments=None, q_offset=0,
                          kv_offset=0, cfg: mg.Config | None = None, interpret=None,
                          fcfg: FusedConfig | None = None):
    """`mosaic_gpu.flash_attention_mosaic` (same arguments and returns: (o [B, T, N, Dv],
    lse [B, N, T] natural log)) with the fused backward of this module."""
    mg.check_supported(q, k, v, cfg)
    cfg = mg.default_config(q.shape[-1], v.shape[-1]) if cfg is None else cfg
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    segs = None if segments is None else (jnp.asarray(segments[0]), jnp.asarray(segments[1]))
    return _attention(q, k, v, segs, (q_offset, kv_offset), scale, causal, cfg, interpret,
                      FusedConfig() if fcfg is None else fcfg)
