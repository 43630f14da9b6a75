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
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import default_interpret, lower_once
from pallas_kernels.flash_attention.mosaic_common import COL, LOG2E, ROW, WGMMA, mm, tiled

HB = 64          # heads per CTA: one wgmma M tile
BS = 64          # cache slots per pipeline step (the P . c_kv product's K: a multiple of 64)
EPI = 64         # output columns per staged store
M_INIT = -1e30   # finite running-max start: no inf - inf for a fully masked tile


def supported(c: int, r: int, s: int, dtype) -> str | None:
    """None if the kernel takes latent width c, RoPE width r, s slots in dtype, else why."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)} (bf16 / fp16 only)"
    if c % 128 or c > 512 or r % 64 or r > 128:
        return f"latent width {c} (a multiple of 128, <= 512) or RoPE width {r} (64 or 128)"
    if s % BS:
        return f"{s} cache slots: not a multiple of {BS}"
    return None


@lower_once
def mla_decode_partial(q_lat, q_rope, c_kv, k_rope, bias, *, scale: float, splits: int,
                       stages: int = 2):
    """Per-split partial attention of `reference.mla_decode_reference`.

    Args:
      q_lat: [B, Hp, C], q_rope: [B, Hp, R] in the cache dtype, Hp a multiple of 64 (padded
        heads are computed and discarded by the caller).
      c_kv: [B, S, C], k_rope: [B, S, R] (rotated), S a multiple of splits x 64.
      bias: [B, S] float32, 0 (valid) or -inf.
      scale: softmax scale. splits: context splits NS. stages: pipeline stages.
    Returns:
      (o [B, NS, Hp, C] float32 unnormalised, m2 [B, NS, Hp] float32 base-2 running max of the
      scaled scores, l [B, NS, Hp] float32 sum of 2^(s2 - m2)), for `reference.combine_splits`.
    Raises:
      ValueError: shapes the kernel does not take (`supported`), Hp not a multiple of 64, or S
        not a multiple of splits x 64.
    """
    b, hp, c = q_lat.shape
    s, r = c_kv.shape[1], k_rope.shape[2]
    reason = supported(c, r, s, c_kv.dtype)
    if reason or hp % HB or s % (splits * BS):
        raise ValueError(f"mla_decode_partial: {reason or f'heads {hp} / slots {s} / splits {splits}'}")
    dtype = c_kv.dtype
    span = s // splits
    steps = span // BS
    half = c // 2
    c2 = scale * LOG2E
    interpret = default_interpret()

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((BS, c), lambda j: (j, 0), transforms=_tr(c, dtype)),
                      plgpu.BlockSpec((BS, r), lambda j: (j, 0), transforms=_tr(r, dtype))],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages,
            compute_context=context)

    def kernel(q_ref, qr_ref, c_ref, r_ref, bias_ref, o_ref, m_ref, l_ref):
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
            bar=plgpu.Barrier(num_barriers=2),
            done=plgpu.Barrier(num_arrivals=2),
            collective_axes="wg")
        def _scope(allocs, qo, ml_stage, p_stage, bar, done):
            (q_smem, qr_smem), o_stage = qo
            wg = lax.axis_index("wg")
            heads = pl.ds(hg * HB, HB)

            def body(idx, c_smem, r_smem, carry):
                (j,) = idx
                acc, m_i, l_i = carry

                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_smem, c_smem.T)
                    plgpu.wgmma(s_ref, qr_smem, r_smem.T)
                    return s_ref[...]
                sc = pl.run_scoped(qk, plgpu.ACC((HB, BS), jnp.float32))
                bj = plgpu.load(bias_ref.at[bi, pl.ds(first + j * BS, BS)], layout=COL,
                                optimized=False)
                s2 = sc * c2 + lax.broadcast_in_dim(bj * LOG2E, sc.shape, [1])
                m_new = jnp.maximum(m_i, s2.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s2 - lax.broadcast_in_dim(m_new, s2.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                cols = c_smem.at[:, pl.ds(pl.multiple_of(wg * half, half), half)]
                acc = mm(p.astype(dtype), cols, (HB, half), acc, interpret=interpret,
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
    return plgpu.kernel(kernel, out_type=out_type, grid=(b, splits, hp // HB),
                        grid_names=("b", "sp", "hg"), num_threads=3, thread_name="wg",
                        interpret=interpret)(q_lat, q_rope, c_kv, k_rope, bias)


def _tr(width: int, dtype):
    """Tiling and swizzle of a [rows, width] tile of dtype in shared memory (wgmma's layout)."""
    row_bytes = width * jnp.dtype(dtype).itemsize
    swizzle = 128 if row_bytes % 128 == 0 else 64
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))
