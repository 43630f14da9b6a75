"""Rotary position embedding with YaRN frequencies, as transformers computes it for DeepSeek.

Sources: transformers/modeling_rope_utils.py (`_compute_default_rope_parameters`,
`_compute_yarn_parameters`, `get_mscale`), transformers/models/deepseek_v3/modeling_deepseek_v3.py
(`apply_rotary_pos_emb_interleave`, softmax `scaling`); YaRN paper (arXiv 2309.00071) sec. 3.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dsjax.config import ModelConfig


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(scale) + 1 for scale > 1, else 1 (HF `get_mscale`)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies [qk_rope_head_dim // 2] (float32) and the cos/sin multiplier."""
    dim, base = cfg.qk_rope_head_dim, float(cfg.rope_theta)
    exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exps, dtype=np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    factor = float(rs.factor)
    orig = float(rs.original_max_position_embeddings)
    if rs.attention_factor is not None:
        attn_factor = float(rs.attention_factor)
    elif rs.mscale and rs.mscale_all_dim:
        attn_factor = yarn_get_mscale(factor, rs.mscale) / yarn_get_mscale(factor, rs.mscale_all_dim)
    else:
        attn_factor = yarn_get_mscale(factor)

    def corr_dim(n_rot):
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(rs.beta_fast)), 0)
    high = min(math.ceil(corr_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra = np.float32(1.0) / pos_freqs
    inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    extrapolation = np.float32(1.0) - ramp
    inv_freq = inter * (np.float32(1.0) - extrapolation) + extra * extrapolation
    return inv_freq.astype(np.float32), float(attn_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN (HF DeepseekV3Attention)."""
    scale = cfg.qk_head_dim ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        m = yarn_get_mscale(float(rs.factor), float(rs.mscale_all_dim))
        scale = scale * m * m
    return scale


def rope_cos_sin(positions, inv_freq, attention_factor):
    """positions [B, T] int -> (cos, sin) [B, T, R/2] float32, already times attention_factor."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)[None, None, :]
    return jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor


def apply_rope(x, cos, sin, interleave: bool = True):
    """Rotate x [B, T, N, R] by (cos, sin) [B, T, R/2] in fp32; returns x.dtype.

    interleave=True pairs dims (2i, 2i+1) with frequency i (DeepSeek's layout; HF
    `rope_interleave=True` and V2's complex form) and returns the pairs de-interleaved
    ([rotated evens | rotated odds]), as HF V3 does; q.k is unchanged by that common permutation.
    interleave=False pairs (i, i + R/2) (`rotate_half`).
    """
    xf = x.astype(jnp.float32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
