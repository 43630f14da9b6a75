"""MLA decode attention over the latent cache, in jnp: what `mosaic.mla_decode_partial` and
`api.mla_decode` compute.

Legend: B batch rows, H heads, S cache slots, C latent width (`kv_lora_rank`), R RoPE width
(`qk_rope_head_dim`), NS context splits.

Absorbed MLA (DeepSeek-V2, arXiv 2405.04434, sec. 2.1.2): with W_UK folded into the query, every
head scores the cached latent directly, s[b, h, j] = (q_lat[b, h] . c_kv[b, j] + q_rope[b, h] .
k_rope[b, j]) * scale + bias[b, j], and its output is the softmax-weighted sum of the latents,
o[b, h] = sum_j p[b, h, j] c_kv[b, j] (W_UV is applied afterwards, once per head). bias is 0 for a
valid slot and -inf for an empty or masked one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def mla_decode_reference(q_lat, q_rope, c_kv, k_rope, bias, scale: float, c_scale=None):
    """Softmax attention of one query per row over its latent cache, fp32.

    Args:
      q_lat: [B, H, C], q_rope: [B, H, R]: the absorbed query (any float dtype).
      c_kv: [B, S, C], k_rope: [B, S, R]: the cache (RoPE already applied to k_rope); c_kv
        may be int8 with c_scale.
      bias: [B, S] float32, 0 or -inf.
      scale: the softmax scale (1 / sqrt(qk_head_dim), YaRN-corrected).
      c_scale: None, or [B, S] float32 per-token scales of an int8 c_kv (the latent is
        c_kv * c_scale[..., None]).
    Returns:
      o [B, H, C] float32; a row whose every slot is masked gives zeros.
    """
    f32 = jnp.float32
    hp = jax.lax.Precision.HIGHEST
    if c_scale is not None:
        c_kv = c_kv.astype(f32) * c_scale[..., None]
    s = (jnp.einsum("bhc,bsc->bhs", q_lat.astype(f32), c_kv.astype(f32), precision=hp)
         + jnp.einsum("bhr,bsr->bhs", q_rope.astype(f32), k_rope.astype(f32), precision=hp))
    s = s * scale + bias[:, None, :]
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhs,bsc->bhc", p, c_kv.astype(f32), precision=hp)
    return jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)


def combine_splits(o_part, m2, l):
    """Merge per-split partial results (flash-decoding): o_part [B, NS, H, C] unnormalised sums
    of 2^(s2 - m2) c_kv, m2 / l [B, NS, H] each split's base-2 running max and sum. Returns
    o [B, H, C] float32 (zeros where every split is empty)."""
    m = jnp.max(m2, axis=1, keepdims=True)
    w = jnp.exp2(m2 - m)                       # [B, NS, H]
    den = jnp.sum(w * l, axis=1)               # [B, H]
    num = jnp.sum(w[..., None] * o_part, axis=1)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
