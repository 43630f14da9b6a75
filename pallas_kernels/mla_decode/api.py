"""MLA decode attention over the latent cache: `mla_decode` picks the Mosaic GPU split-context
kernel (`mosaic.mla_decode_partial` + `reference.combine_splits`) or the jnp reference.

Legend: B batch rows, H heads, S cache slots, C latent width, R RoPE width.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._hopper import num_sms, on_hopper
from pallas_kernels.mla_decode import mosaic
from pallas_kernels.mla_decode.reference import combine_splits, mla_decode_reference

IMPLS = ("auto", "reference", "mosaic")


def pick_splits(b: int, head_groups: int, s: int, sms: int) -> int:
    """Context splits: enough CTAs for two per SM (B x splits x head groups >= 2 x sms), each
    split a whole number of the kernel's 64-slot steps; 1 when one row already fills them."""
    steps = s // mosaic.BS
    want = max(1, -(-2 * sms // (b * head_groups)))
    return max(d for d in range(1, steps + 1) if steps % d == 0 and d <= want)


def kernel_fits(q_lat, c_kv, k_rope) -> str | None:
    """None if `mla_decode(impl="mosaic")` takes these operands (c_kv in q's dtype, or int8 with
    scales), else the reason."""
    if k_rope.dtype != q_lat.dtype or c_kv.dtype not in (q_lat.dtype, jnp.dtype(jnp.int8)):
        return f"dtypes q {q_lat.dtype}, c_kv {c_kv.dtype}, k_rope {k_rope.dtype} differ"
    return mosaic.supported(c_kv.shape[2], k_rope.shape[2], c_kv.shape[1], c_kv.dtype)


def mla_decode(q_lat, q_rope, c_kv, k_rope, bias, scale: float, *, c_scale=None, impl: str = "auto"):
    """Softmax attention of one query per row and head over the MLA latent cache
    (`reference.mla_decode_reference`: absorbed MLA, DeepSeek-V2 sec. 2.1.2).

    Args:
      q_lat: [B, H, C], q_rope: [B, H, R]: the absorbed query (q_nope W_UK, and the roped part).
      c_kv: [B, S, C], k_rope: [B, S, R]: the cache, RoPE applied to k_rope; c_kv in q's dtype,
        or int8 with c_scale.
      bias: [B, S] float32: 0 for a slot to attend to, -inf for one to skip.
      scale: the softmax scale.
      c_scale: None, or [B, S] float32 per-token scales of an int8 c_kv (the latent is
        c_kv * c_scale[..., None]; the kernel converts the int8 tiles in shared memory).
      impl: "mosaic" (Hopper; GPU interpret mode elsewhere): each row's latent read once by the
        split-context kernel, P rounded to the cache dtype for the P . c_kv product; "reference":
        jnp in fp32; "auto": "mosaic" on a Hopper GPU where `kernel_fits`, else "reference".
    Returns:
      o [B, H, C] float32 (zeros for a row with no slot to attend to).
    Raises:
      ValueError: an unknown impl, an int8 c_kv without c_scale (or c_scale with another), or
        impl="mosaic" with operands the kernel does not take (`kernel_fits`: bf16 / fp16 cache
        or int8, C a multiple of 128 up to 512, R 64 or 128, S a multiple of 64).
    """
    if impl not in IMPLS:
        raise ValueError(f"mla_decode: impl {impl!r} not in {IMPLS}")
    if (c_kv.dtype == jnp.int8) != (c_scale is not None):
        raise ValueError("mla_decode: an int8 c_kv needs c_scale, and only an int8 one takes it")
    reason = kernel_fits(q_lat, c_kv, k_rope)
    if impl == "mosaic" and reason:
        raise ValueError(f"mla_decode(impl='mosaic'): {reason}")
    if impl == "reference" or (impl == "auto" and (reason or not on_hopper())):
        return mla_decode_reference(q_lat, q_rope, c_kv, k_rope, bias, scale, c_scale)
    b, h, _ = q_lat.shape
    hp = -(-h // mosaic.HB) * mosaic.HB
    pad = ((0, 0), (0, hp - h), (0, 0))
    splits = pick_splits(b, hp // mosaic.HB, c_kv.shape[1], num_sms())
    o, m2, l = mosaic.mla_decode_partial(jnp.pad(q_lat, pad), jnp.pad(q_rope, pad), c_kv, k_rope,
                                         bias.astype(jnp.float32), c_scale, scale=scale, splits=splits)
    return combine_splits(o, m2, l)[:, :h]
