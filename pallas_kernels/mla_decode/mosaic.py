"""Split-context MLA decode attention over the latent cache for Hopper, in Pallas Mosaic GPU.

Legend: B batch rows, H heads (Hp padded to HG x 64), S cache slots, C latent width, R RoPE
width, NS context splits of S / NS slots, BS slots per pipeline step.

Flash-decoding (Dao et al. 2023) of absorbed MLA (reference.py): one CTA per (row b, split,
64-head group) streams its slots' latents c_kv [BS, C] and RoPE keys k_rope [BS, R] once
through a ring of shared-memory stages (one TMA warpgroup, `emit_pipeline_warp_specialized`)
and two compute warpgroups consume each tile:
  s = q_lat [64, C] . c_kv^T + q_rope [64, R] . k_rope^T   (wgmma, both warpgroups alike)
  online softmax in base 2 over s * scale * log2(e) + bias * log2(e)   (FlashAttention-2)
  acc += P [64, BS] . c_kv[:, 256 w : 256 (w + 1)]          (warpgroup w's half of C)
so every head of the row shares one read of the latent: the cache is read once per step (per
64-head group), where XLA's two latent products read it twice. Each CTA writes its unnormalised
[64, C] sum with the base-2 running max and sum per head; `reference.combine_splits` merges the
splits. Shared memory: q (64 x (C + R)), then in the same bytes two 64 x 64 fp32 output staging
slots; `stages` x BS x (C + R) tiles (2 stages at C = 512: 216 KiB in all).

An int8 cache (c_kv int8 with one fp32 scale per token, `dsjax.model.decode.quantize_int8`) is
read as int8: the TMA ring holds BS x C int8 tiles (half the bytes), and each step the two
compute warpgroups convert the tile (each its half of C) into one BS x C compute-dtype tile in
shared memory, exact (|values| <= 127), synchronised by a named barrier before and after; the
token scales multiply the latent scores' columns (s = (q_lat . c_int8) c_scale + q_rope .
k_rope) and P's columns before P . c_int8, as the XLA path does. Shared memory at C = 512:
q 72 KiB, 2 stages x (32 + 8) KiB, the converted tile 64 KiB: 216 KiB.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import default_interpret, lower_once
from pallas_kernels.flash_attention.mosaic_common import COL, LOG2E, NAMED_BAR0, ROW, WGMMA, mm, named_sync, tiled

HB = 64          # heads per CTA: one wgmma M tile
BS = 64          # cache slots per pipeline step (the P . c_kv product's K: a multiple of 64)
EPI = 64         # output columns per staged store
M_INIT = -1e30   # finite running-max start: no inf - inf for a fully masked tile


CACHE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.int8))


def supported(c: int, r: int, s: int, dtype) -> str | None:
    """None if the kernel takes latent width c, RoPE width r, s slots of a c_kv in dtype (bf16,
    fp16, or int8 with per-token scales), else why."""
    if jnp.dtype(dtype) not in CACHE_DTYPES:
        return f"dtype {jnp.dtype(dtype)} (bf16 / fp16, or int8 with scales)"
    if c % 128 or c > 512 or r % 64 or r > 128:
        return f"latent width {c} (a multiple of 128, <= 512) or RoPE width {r} (64 or 128)"
    if jnp.dtype(dtype) == jnp.int8 and c % 256:
        return f"latent width {c} of an int8 cache (a multiple of 256: each warpgroup converts 128-wide tiles)"
    if s % BS:
        return f"{s} cache slots: not a multiple of {BS}"
    return None


@lower_once
def mla_decode_partial(q_lat, q_rope, c_kv, k_rope, bias, c_scale=None, *, scale: float,
                       splits: int, stages: int = 2):
    """Per-split partial attention of `reference.mla_decode_reference`.

    Args:
      q_lat: [B, Hp, C], q_rope: [B, Hp, R] in the compute dtype (bf16 / fp16; the cache's for
        a bf16 / fp16 cache), Hp a multiple of 64 (padded heads are computed and discarded by
        the caller).
      c_kv: [B, S, C] (the compute dtype, or int8 with c_scale), k_rope: [B, S, R] (rotated, the
        compute dtype), S a multiple of splits x 64.
      bias: [B, S] float32, 0 (valid) or -inf.
      c_scale: None, or [B, S] float32 per-token scales of an int8 c_kv.
      scale: softmax scale. splits: context splits NS. stages: pipeline stages.
    Returns:
      (o [B, NS, Hp, C] float32 unnormalised, m2 [B, NS, Hp] float32 base-2 running max of the
      scaled scores, l [B, NS, Hp] float32 sum of 2^(s2 - m2)), for `reference.combine_splits`.
    Raises:
      ValueError: shapes the kernel does not take (`supported`), Hp not a multiple of 64, S
        not a multiple of splits x 64, or an int8 c_kv without c_scale (or c_scale with
        another).
    """
    b, hp, c = q_lat.shape
    s, r = c_kv.shape[1], k_rope.shape[2]
    reason = supported(c, r, s, c_kv.dtype)
    int8 = c_kv.dtype == jnp.int8
    if not reason and int8 != (c_scale is not None):
        reason = "an int8 c_kv needs c_scale, and only an int8 one takes it"
    if not reason and int8 and q_lat.dtype not in CACHE_DTYPES[:2]:
        reason = f"q dtype {q_lat.dtype} (bf16 / fp16)"
    if reason or hp % HB or s % (splits * BS):
        raise ValueError(f"mla_decode_partial: {reason or f'heads {hp} / slots {s} / splits {splits}'}")
    dtype = q_lat.dtype  # the wgmmas' operand dtype
    span = s // splits
    steps = span // BS
    half = c // 2
    c2 = scale * LOG2E
    interpret = default_interpret()

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((BS, c), lambda j: (j, 0), transforms=_tr(c, c_kv.dtype)),
                      plgpu.BlockSpec((BS, r), lambda j: (j, 0), transforms=_tr(r, dtype))],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages,
            compute_context=context)

    def kernel(q_ref, qr_ref, c_ref, r_ref, bias_ref, *refs):
        cs_ref, (o_ref, m_ref, l_ref) = (refs[0], refs[1:]) if int8 else (None, refs)
        bi, sp, hg = lax.axis_index("b"), lax.axis_index("sp"), lax.axis_index("hg")
        first = sp * span
        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore).get_allocations(c_ref.at[0, pl.ds(0, span)],
                                                            r_ref.at[0, pl.ds(0, span)]),
            # the query until both compute warpgroups are done with it, then the output staging
            qo=plgpu.RefUnion((tiled((HB, c), dtype), tiled((HB, r), dtype)),
                              plgpu.SMEM((2, HB, EPI), jnp.float32)),
            ml_stage=plgpu.SMEM((2, HB), jnp.float32),
            p_stage=tiled((2, HB, BS), dtype) if interpret else None,
            c_conv=tiled((BS, c), dtype) if int8 else None,  # the int8 tile converted
            bar=plgpu.Barrier(num_barriers=2),
            done=plgpu.Barrier(num_arrivals=2),
            collective_axes="wg")
        def _scope(allocs, qo, ml_stage, p_stage, c_conv, bar, done):
            (q_smem, qr_smem), o_stage = qo
            wg = lax.axis_index("wg")
            heads = pl.ds(hg * HB, HB)

            mine = pl.ds(pl.multiple_of(wg * half, half), half)  # this warpgroup's half of C

            def body(idx, c_smem, r_smem, carry):
                (j,) = idx
                acc, m_i, l_i = carry
                slots = pl.ds(first + j * BS, BS)
                if int8:
                    named_sync(NAMED_BAR0, 2 * 128)  # both warpgroups done with the last tile
                    for k in range(0, half, 128):  # exact: |int8| <= 127
                        cols = pl.ds(pl.multiple_of(wg * half + k, 128), 128)
                        c_conv.at[:, cols][...] = plgpu.load(
                            c_smem.at[:, cols], layout=WGMMA).astype(dtype)
                    plgpu.commit_smem()
                    named_sync(NAMED_BAR0, 2 * 128)  # the whole tile converted
                    c_smem = c_conv
                    cj = plgpu.load(cs_ref.at[bi, slots], layout=COL, optimized=False)

                    def qk(s_ref, t_ref):  # the latent's and the RoPE part's scores apart
                        plgpu.wgmma(s_ref, q_smem, c_smem.T)
                        plgpu.wgmma(t_ref, qr_smem, r_smem.T)
                        return s_ref[...], t_ref[...]
                    s_lat, s_rope = pl.run_scoped(qk, plgpu.ACC((HB, BS), jnp.float32),
                                                  plgpu.ACC((HB, BS), jnp.float32))
                    sc = s_lat * lax.broadcast_in_dim(cj, s_lat.shape, [1]) + s_rope
                else:
                    def qk(s_ref):
                        plgpu.wgmma(s_ref, q_smem, c_smem.T)
                        plgpu.wgmma(s_ref, qr_smem, r_smem.T)
                        return s_ref[...]
                    sc = pl.run_scoped(qk, plgpu.ACC((HB, BS), jnp.float32))
                bj = plgpu.load(bias_ref.at[bi, slots], layout=COL, optimized=False)
                s2 = sc * c2 + lax.broadcast_in_dim(bj * LOG2E, sc.shape, [1])
                m_new = jnp.maximum(m_i, s2.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s2 - lax.broadcast_in_dim(m_new, s2.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                pv = p * lax.broadcast_in_dim(cj, p.shape, [1]) if int8 else p  # P c_scale . c_int8
                acc = mm(pv.astype(dtype), c_smem.at[:, mine], (HB, half), acc, interpret=interpret,
                         stage=None if p_stage is None else p_stage.at[wg], a_in_regs=True)
                return acc, m_new, l_i

            def context(run):
                @pl.when(wg == 0)
                def _():
                    plgpu.copy_gmem_to_smem(q_ref.at[bi, heads], q_smem, bar.at[0])
                    plgpu.copy_gmem_to_smem(qr_ref.at[bi, heads], qr_smem, bar.at[1])
                plgpu.barrier_wait(bar.at[0])
                plgpu.barrier_wait(bar.at[1])
                acc = plgpu.layout_cast(jnp.zeros((HB, half), jnp.float32), WGMMA)
                m_i = plgpu.layout_cast(jnp.full((HB,), M_INIT, jnp.float32), ROW)
                l_i = plgpu.layout_cast(jnp.zeros((HB,), jnp.float32), ROW)
                acc, m_i, l_i = run((acc, m_i, l_i))
                plgpu.barrier_arrive(done)  # both warpgroups past their last read of the query
                plgpu.barrier_wait(done)
                stage = o_stage.at[wg]
                for k in range(half // EPI):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    stage[...] = acc[:, k * EPI:(k + 1) * EPI]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        stage, o_ref.at[bi, sp, heads, pl.ds(wg * half + k * EPI, EPI)])
                for w, ref, val in ((0, m_ref, m_i), (1, l_ref, l_i)):  # both hold the same m, l
                    @pl.when(wg == w)
                    def _(ref=ref, val=val, w=w):
                        ml_stage.at[w][...] = val
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(ml_stage.at[w], ref.at[bi, sp, heads])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            pipeline(body, context)(c_ref.at[bi, pl.ds(first, span)],
                                    r_ref.at[bi, pl.ds(first, span)], allocations=allocs)

    f32 = jnp.float32
    out_type = (jax.ShapeDtypeStruct((b, splits, hp, c), f32),
                jax.ShapeDtypeStruct((b, splits, hp), f32), jax.ShapeDtypeStruct((b, splits, hp), f32))
    args = (q_lat, q_rope, c_kv, k_rope, bias) + ((c_scale.astype(f32),) if int8 else ())
    return plgpu.kernel(kernel, out_type=out_type, grid=(b, splits, hp // HB),
                        grid_names=("b", "sp", "hg"), num_threads=3, thread_name="wg",
                        interpret=interpret)(*args)


def _tr(width: int, dtype):
    """Tiling and swizzle of a [rows, width] tile of dtype in shared memory (wgmma's layout)."""
    row_bytes = width * jnp.dtype(dtype).itemsize
    swizzle = 128 if row_bytes % 128 == 0 else 64
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))
