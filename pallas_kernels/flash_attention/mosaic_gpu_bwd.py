"""Fused flash-attention backward for Hopper in Pallas Mosaic GPU (v4, FlashAttention-3's
head-dim-192 layout): one kernel computes S, P, dP and dS once per (key tile, query tile)
pair, keeps dK^T and dV^T in registers, and adds dQ into an fp32 buffer in global memory with
TMA reduce-adds.

Legend: B batch, T/S query/key length (Tp/Sp padded), N query heads, K kv heads, G = N // K,
Dqk q/k head dim, Dv value head dim, Dh = Dqk / 2; BQ = 64 queries per step, BN = 96 keys per
CTA, HK = 48 keys per compute warpgroup.

Maths: FlashAttention-2 backward (Dao 2023, arXiv 2307.08691, Alg. 2) with FlashAttention-3's
dQ accumulation (Shah et al. 2024, arXiv 2407.08608, sec. 3.1). For one 64-query tile t of
query head h and the HK keys of a warpgroup (base-2 softmax, c2 = scale * log2(e)):

    P = exp2(c2 * Q K^T - lse2),   dP = dO V^T,   dS = P * (dP - delta),
    dV^T += dO^T P,   dK^T += Q^T dS,   dQ[t] += dS K   (dK, dQ scaled by `scale` at the end)

Layout (the `hdim 192, dv <= 128` configuration of FlashAttention-3's Hopper backward,
hopper/flash_bwd_launch_template.h: kBlockM 64, kBlockN 96, two MMA warpgroups, dKV_swapAB):
grid (kv head, 96-key tile, batch); one TMA producer warpgroup loads the K/V tile and streams
the (Q, dO) tiles of all G query heads; compute warpgroup w owns keys [48 w, 48 w + 48) of the
tile. Its S and dP are [64, 48] slices (24 registers each) and its accumulators are dK^T
[Dqk, 48] and dV^T [Dv, 48] (M = head dim: 72 + 48 registers at MLA, against 96 + 64 for the
two-kernel backward's dK [64, Dqk] + dV [64, Dv]). P and dS go to shared memory transposed
(P^T, dS^T [96, 64]); dV^T and dK^T read the warpgroup's own 48 rows, and dQ[t] (columns
[Dh w, Dh w + Dh) per warpgroup) reads the dS^T rows of both, so the two warpgroups meet
once per step. Every product reads both operands from shared memory. Executed matmul work per
(query, key) pair: 2 Dqk + 2 Dv + Dqk (S, dP, dV, dK, dQ) = 832 units at MLA vs 1152 for the
two-kernel backward. Swizzles: Q, K and dS^T use 64-byte swizzle (the dQ product contracts
over 96 keys, a multiple of 32 but not of 64), dO, V and P^T 128-byte.

Padded keys (S not a multiple of 96) are masked: their dS would reach dQ. `backward` has the
inputs and outputs of `mosaic_gpu._backward`; head dims the kernel does not take (`fits`
False) go to that two-kernel backward.

Status (H200, RESULTS.md "v7"): correct (compiled: dq 6e-5, dk/dv 3e-4 from the two-kernel
backward; 3.0e-3 from the fp32 oracle like it), but slower, so not wired into `api.py`: MLA B4
T4096 backward 3.07 ms vs 2.05-2.15 ms, T16384 10.27 vs 7.37-7.50 (v3, the previous fused
kernel in history: 3.39 ms). Ablations at MLA B4: without the dQ product and its staging
1.73 ms (the two-kernel backward's dk/dv kernel alone: ~1.2-1.4), the dQ product + fp32
staging +0.98 ms, the TMA reduce-adds +0.35 ms; ptxas spills 608 B per thread.
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
from pallas_kernels.flash_attention.mosaic_gpu import (LOG2E, _COL, _ROW, _WGMMA, _iota, _pad_to,
                                                       _round_up, _tiled)

SMEM_LIMIT = 227 * 1024 - 1024   # the H100/H200 per-block opt-in limit, less barriers
BQ, BN, HK = 64, 96, 48


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Knobs of the fused backward (tiles are fixed: BQ, BN, HK above)."""
    stages: int = 2          # Q/dO pipeline depth
    regs: tuple = (240, 24)  # setmaxnreg of the compute / producer warpgroups
    # Timing ablations (wrong dq, for diagnosis only): "no_reduce" stages dQ in shared memory
    # but skips the TMA reduce-adds, "no_dq" also skips the dQ product and its staging (the
    # dS^T exchange barriers stay).
    ablate: str = ""

    def __post_init__(self):
        if self.ablate not in ("", "no_reduce", "no_dq"):
            raise ValueError(f"FusedConfig.ablate={self.ablate!r}: expected '', 'no_reduce' "
                             "or 'no_dq'")


def fused_smem_bytes(Dqk, Dv, fc: FusedConfig):
    """Shared memory of the fused kernel in bytes (2-byte inputs)."""
    qdo = fc.stages * BQ * (Dqk + Dv) * 2         # Q, dO pipeline
    kv = BN * (Dqk + Dv) * 2                      # the K/V tile
    pds = 2 * BN * BQ * 2                         # P^T, dS^T
    stage = BQ * Dqk * 4                          # fp32 dQ staging, Dh columns per warpgroup
    return qdo + kv + pds + stage


def fits(Dqk, Dv, fc: FusedConfig | None = None):
    """True when the fused kernel takes these head dims (else `backward` uses the two-kernel
    backward of `mosaic_gpu`): Dqk and Dv multiples of 64 and the tiles within shared memory."""
    fc = FusedConfig() if fc is None else fc
    return (Dqk % 64 == 0 and Dv % 64 == 0
            and fused_smem_bytes(Dqk, Dv, fc) <= SMEM_LIMIT)


def _fused_call(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, q_seg, kv_seg, dq_acc, *, scale,
                causal, S, fc: FusedConfig, interpret):
    """The fused kernel. q [B, Tp, N, Dqk], k [B, Sp, K, Dqk], v [B, Sp, K, Dv], do [B, Tp, N, Dv]
    (q.dtype, Tp % 64 == 0, Sp % 96 == 0); lse2, dlt [B, N, Tp] fp32; wgb [B, Sp // 48, 4] /
    ctab [B, Sp // 96, 2] int32 ranges of 64-query blocks per 48-key half tile / per CTA;
    dq_acc: fp32 [B, Tp, N, Dqk] mutable ref, zero on entry, receives sum_s dS[t, s] k[s]
    (unscaled).

    Returns dk [B, Sp, K, Dqk] = scale * sum dS^T q and dv [B, Sp, K, Dv] = sum P^T dO in
    q.dtype, summed over the G query heads of each kv head inside the kernel.
    """
    B, Tp, N, Dqk = q.shape
    Sp, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    Dh = Dqk // 2
    stages = fc.stages
    dtype = q.dtype
    has_seg = q_seg is not None
    c2 = scale * LOG2E
    compiled = interpret is None

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, dlt_ref, wgb_ref, ctab_ref, dl_ref, qseg_ref,
               kseg_ref, dq_ref, dk_ref, dv_ref, scoped):
        b = lax.axis_index("b")
        kvh = lax.axis_index("h")
        kt = lax.axis_index("kt")
        wg = lax.axis_index("wg")
        (q_smems, do_smems, k_smem, v_smem, pT_smem, dsT_smem, dq_stage), \
            (q_bar, do_bar, kv_bar), (q_cons, do_cons, ds_ready, ds_free) = scoped
        L = ctab_ref[b, kt, 0]
        H = ctab_ref[b, kt, 1]
        n_c = H - L
        n_c1 = jnp.maximum(n_c, 1)
        n = G * n_c

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(fc.regs[0], action="increase")
            off = pl.multiple_of(wg * HK, HK)          # this warpgroup's rows of the tile
            coff = pl.multiple_of(wg * Dh, Dh)         # and its dQ columns
            rows = pl.ds(off, HK)
            key0 = kt * BN + off
            lo, mlo, mhi, hi = (wgb_ref[b, 2 * kt + wg, i] for i in range(4))
            dl = dl_ref[0]
            if has_seg:
                kseg = plgpu.load(kseg_ref.at[b, pl.ds(key0, HK)], layout=_COL, optimized=False)
            dkT = plgpu.layout_cast(jnp.zeros((Dqk, HK), jnp.float32), _WGMMA)
            dvT = plgpu.layout_cast(jnp.zeros((Dv, HK), jnp.float32), _WGMMA)
            plgpu.barrier_wait(kv_bar.at[0])
            plgpu.barrier_wait(kv_bar.at[1])
            plgpu.barrier_arrive(ds_free)              # P^T / dS^T start free

            def step(g, c, carry, *, masked, active):
                dkT, dvT = carry
                h = kvh * G + g
                j = g * n_c + c - L
                slot = lax.rem(j, stages)
                qs = pl.ds(c * BQ, BQ)
                q_s, do_s = q_smems.at[slot], do_smems.at[slot]
                plgpu.barrier_wait(q_bar.at[slot])
                plgpu.barrier_wait(do_bar.at[slot])
                if active:
                    lse = plgpu.load(lse_ref.at[b, h, qs], layout=_ROW, optimized=False)
                    if masked and has_seg:
                        qseg = plgpu.load(qseg_ref.at[b, qs], layout=_ROW, optimized=False)

                    def probs(s):
                        p = jnp.exp2(s * c2 - lax.broadcast_in_dim(lse, s.shape, [0]))
                        if masked:
                            kv_pos = key0 + _iota((BQ, HK), 1)
                            ok = kv_pos < S    # padded keys: their dS would reach dQ
                            if causal:
                                ok = ok & (kv_pos <= c * BQ + _iota((BQ, HK), 0) + dl)
                            if has_seg:
                                ok = ok & (lax.broadcast_in_dim(qseg, (BQ, HK), [0])
                                           == lax.broadcast_in_dim(kseg, (BQ, HK), [1]))
                            p = jnp.where(ok, p, 0.0)
                        return p

                    p, dp = mg._mm_two(q_s, k_smem.at[rows].T, (BQ, HK), do_s,
                                       v_smem.at[rows].T, (BQ, HK), interpret=interpret,
                                       between=probs)
                    dlt = plgpu.load(dlt_ref.at[b, h, qs], layout=_ROW, optimized=False)
                    ds = p * (dp - lax.broadcast_in_dim(dlt, dp.shape, [0]))
                    plgpu.barrier_wait(ds_free)        # both dQs of the last step are done
                    pT_smem.at[rows].T[...] = p.astype(dtype)
                    dsT_smem.at[rows].T[...] = ds.astype(dtype)
                else:                                  # none of these keys sees query tile c
                    plgpu.barrier_wait(ds_free)
                    dsT_smem.at[rows].T[...] = plgpu.layout_cast(jnp.zeros((BQ, HK), dtype),
                                                                 _WGMMA)
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready)
                dq_cols = k_smem.at[:, pl.ds(coff, Dh)]
                if compiled:
                    def body(refs):
                        dvT_r, dkT_r, dq_r = refs
                        if active:
                            plgpu.wgmma(dvT_r, do_s.T, pT_smem.at[rows].T)
                            plgpu.wgmma(dkT_r, q_s.T, dsT_smem.at[rows].T)
                        plgpu.barrier_wait(ds_ready)
                        if fc.ablate != "no_dq":
                            plgpu.wgmma(dq_r, dsT_smem.T, dq_cols)
                    zero = plgpu.layout_cast(jnp.zeros((BQ, Dh), jnp.float32), _WGMMA)
                    dvT, dkT, dq = pl.run_state(body)(
                        (plgpu.ACC.init(dvT), plgpu.ACC.init(dkT), plgpu.ACC.init(zero)))
                else:
                    if active:
                        dvT = mg._mm(do_s.T, pT_smem.at[rows].T, (Dv, HK), dvT,
                                     interpret=interpret)
                        dkT = mg._mm(q_s.T, dsT_smem.at[rows].T, (Dqk, HK), dkT,
                                     interpret=interpret)
                    plgpu.barrier_wait(ds_ready)
                    dq = mg._mm(dsT_smem.T, dq_cols, (BQ, Dh), interpret=interpret)
                plgpu.barrier_arrive(ds_free)
                plgpu.barrier_arrive(do_cons.at[slot])
                plgpu.barrier_arrive(q_cons.at[slot])
                dq_dst = dq_ref.at[b, qs, h, pl.ds(coff, Dh)]
                if compiled and fc.ablate == "no_dq":
                    pass
                elif compiled:
                    st = dq_stage.at[wg]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    st[...] = dq
                    plgpu.commit_smem()
                    if fc.ablate != "no_reduce":
                        plgpu.copy_smem_to_gmem(st, dq_dst, reduction_op="add")
                else:
                    # GPU interpret mode (jax 0.11.2) has no TMA reductions; it runs CTAs one
                    # after another and the two warpgroups own disjoint columns, so a
                    # read-modify-write is exact.
                    dq_dst[...] = dq_dst[...] + dq
                return dkT, dvT

            def head(g, carry):
                def loop(a, z, **kw):
                    return lambda cr: lax.fori_loop(
                        a, z, lambda c, cr: step(g, c, cr, **kw), cr)
                carry = loop(L, lo, masked=True, active=False)(carry)
                carry = loop(lo, mlo, masked=True, active=True)(carry)
                carry = loop(mlo, mhi, masked=False, active=True)(carry)
                carry = loop(mhi, hi, masked=True, active=True)(carry)
                return loop(hi, H, masked=True, active=False)(carry)

            dkT, dvT = lax.fori_loop(0, G, head, (dkT, dvT))
            # The other warpgroup's last dQ reads these K rows: wait before overwriting them.
            plgpu.barrier_wait(ds_free)
            k_smem.at[rows].T[...] = (dkT * scale).astype(dtype)
            v_smem.at[rows].T[...] = dvT.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem.at[rows], dk_ref.at[b, pl.ds(key0, HK), kvh])
            plgpu.copy_smem_to_gmem(v_smem.at[rows], dv_ref.at[b, pl.ds(key0, HK), kvh])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(fc.regs[1], action="decrease")
            ks = pl.ds(kt * BN, BN)
            plgpu.copy_gmem_to_smem(k_ref.at[b, ks, kvh], k_smem, kv_bar.at[0])
            plgpu.copy_gmem_to_smem(v_ref.at[b, ks, kvh], v_smem, kv_bar.at[1])

            def load(j, slot):
                g = lax.div(j, n_c1)
                c = L + lax.rem(j, n_c1)
                h = kvh * G + g
                qs = pl.ds(c * BQ, BQ)
                plgpu.copy_gmem_to_smem(q_ref.at[b, qs, h], q_smems.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[b, qs, h], do_smems.at[slot], do_bar.at[slot])

            for i in range(stages):
                @pl.when(i < n)
                def _():
                    load(jnp.int32(i), i)

            @pl.loop(stages, n)
            def _(j):
                slot = lax.rem(j, stages)
                plgpu.barrier_wait(q_cons.at[slot])
                plgpu.barrier_wait(do_cons.at[slot])
                load(j, slot)

            @pl.loop(jnp.maximum(n - stages, 0), n)
            def _(j):   # observe the last consumptions too (GPU interpret mode checks phases)
                slot = lax.rem(j, stages)
                plgpu.barrier_wait(q_cons.at[slot])
                plgpu.barrier_wait(do_cons.at[slot])

    def entry(*refs):
        st = None if not compiled else _tiled((2, BQ, Dh), jnp.float32)
        smems = (_tiled((stages, BQ, Dqk), dtype, 64), _tiled((stages, BQ, Dv), dtype),
                 _tiled((BN, Dqk), dtype, 64), _tiled((BN, Dv), dtype),
                 _tiled((BN, BQ), dtype), _tiled((BN, BQ), dtype, 64), st)
        bars = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                plgpu.Barrier(num_barriers=2))
        syncs = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                 plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=2))
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), smems, bars, syncs,
                      collective_axes="wg")

    seg_args = (q_seg, kv_seg) if has_seg else (jnp.zeros((1, 1), jnp.int32),) * 2
    return plgpu.kernel(
        entry, out_type=(jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)),
        grid=(K, Sp // BN, B), grid_names=("h", "kt", "b"), num_threads=3,
        thread_name="wg", compiler_params=mg._compiler_params(), interpret=interpret,
    )(q, k, v, do, lse2, dlt, wgb, ctab, delta_arr, *seg_args, dq_acc)


def _key_ranges(B, Sp, Tp, T, S, causal, delta, q_seg, kv_seg):
    """Per 48-key half tile (lo, mlo, mhi, hi) over 64-query blocks and the CTA union (L, H),
    with half tiles that hold padded keys masked on every step (their dS must not reach dQ)."""
    wgb, ctab = mg._tile_ranges(B=B, n_rows_p=Sp, row_block=HK, n_cols_p=Tp, col_block=BQ,
                                rows_are_q=False, T=T, S=S, causal=causal, delta=delta,
                                q_seg=q_seg, kv_seg=kv_seg)
    padded = (jnp.arange(Sp // HK) * HK + HK > S)[None, :]
    hi = wgb[..., 3]
    mlo = jnp.where(padded, hi, wgb[..., 1])
    mhi = jnp.where(padded, hi, wgb[..., 2])
    return jnp.stack([wgb[..., 0], mlo, mhi, hi], -1), ctab


def backward(q, k, v, segs, offsets, o, lse2, do, dlse, *, scale, causal, cfg, interpret,
             fcfg: FusedConfig | None = None, static_delta=None):
    """dq, dk, dv of softmax attention from the forward residuals, by the fused kernel.

    Args (as `mosaic_gpu._backward`): q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] in
      bf16/fp16; segs None or (q_seg [B, T], kv_seg [B, S]) int; offsets (q_offset, kv_offset)
      ints or int32 scalars; o [B, T, N, Dv] the forward output; lse2 [B, N, T] fp32 base-2
      log-sum-exp (-inf on fully masked rows); do [B, T, N, Dv] cotangent of o; dlse None or
      [B, N, T] cotangent of the natural lse, entering as dS = P * (dP - (rowsum(o*do) - dlse));
      scale float; causal bool; cfg `mosaic_gpu.Config` (sets the query padding); interpret
      None or `plgpu.InterpretGPUParams`; fcfg `FusedConfig` (None: defaults); static_delta
      q_offset - kv_offset as a Python int when both are static (range tables as constants).

    Returns:
      (dq [B, T, N, Dqk], dk [B, S, K, Dqk], dv [B, S, K, Dv]) in q.dtype.

    Head dims the kernel does not take (`fits` False) run `mosaic_gpu._backward`.
    """
    fcfg = FusedConfig() if fcfg is None else fcfg
    B, T, N, Dqk = q.shape
    if not fits(Dqk, v.shape[-1], fcfg):
        return mg._backward(q, k, v, segs, offsets, o, lse2, do, dlse, scale=scale,
                            causal=causal, cfg=cfg, interpret=interpret,
                            static_delta=static_delta)
    qp, _, _, q_seg, _, delta, T, S, Tp, _ = mg._prepare(
        q, k, v, segs, offsets, causal=causal, cfg=cfg, static_delta=static_delta)
    Sp = _round_up(S, BN)
    kp, vp = _pad_to(k, 1, Sp), _pad_to(v, 1, Sp)
    kv_seg = None if segs is None else _pad_to(segs[1].astype(jnp.int32), 1, Sp)
    dlt = mg._delta_xla(o, do, dlse, Tp)
    lse_b, dop = mg._bwd_lse_do(lse2, do, q.dtype, Tp)
    wgb, ctab = _key_ranges(B, Sp, Tp, T, S, causal, mg._delta0(delta, static_delta), q_seg,
                            kv_seg)
    dq_acc = jax.new_ref(jnp.zeros((B, Tp, N, Dqk), jnp.float32))
    dk, dv = _fused_call(qp, kp, vp, dop, lse_b, dlt, wgb, ctab, delta, q_seg, kv_seg, dq_acc,
                         scale=scale, causal=causal, S=S, fc=fcfg, interpret=interpret)
    dq = (dq_acc[...][:, :T] * scale).astype(q.dtype)
    return dq, dk[:, :S], dv[:, :S]


# ----------------------------------------------------------------------------------------------
# A custom VJP with the `mosaic_gpu` forward and this backward (tests, benchmarks).
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _attention(q, k, v, segs, offsets, scale, causal, cfg, interpret, fcfg, static_delta):
    o, lse2 = mg._attn_fwd_impl(q, k, v, segs, offsets, scale=scale, causal=causal, cfg=cfg,
                                interpret=interpret, static_delta=static_delta)
    return o, lse2 * math.log(2.0)


def _attention_fwd(q, k, v, segs, offsets, scale, causal, cfg, interpret, fcfg, static_delta):
    o, lse2 = mg._attn_fwd_impl(q, k, v, segs, offsets, scale=scale, causal=causal, cfg=cfg,
                                interpret=interpret, static_delta=static_delta)
    return (o, lse2 * math.log(2.0)), (q, k, v, segs, offsets, o, lse2)


def _attention_bwd(scale, causal, cfg, interpret, fcfg, static_delta, res, cts):
    q, k, v, segs, offsets, o, lse2 = res
    do, dlse = cts
    dq, dk, dv = backward(q, k, v, segs, offsets, o, lse2, do, dlse, scale=scale, causal=causal,
                          cfg=cfg, interpret=interpret, fcfg=fcfg, static_delta=static_delta)
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
    static_delta = None
    if all(isinstance(x, int) for x in (q_offset, kv_offset)):
        static_delta = int(q_offset) - int(kv_offset)
    return _attention(q, k, v, segs, (q_offset, kv_offset), scale, causal, cfg, interpret,
                      FusedConfig() if fcfg is None else fcfg, static_delta)
