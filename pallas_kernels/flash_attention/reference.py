"""Pure-jnp attention reference with fp32 softmax statistics.

Legend: B batch, T query length, S key length, N query heads, K kv heads, Dqk q/k head dim,
Dv value head dim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _split_segments(segment_ids, T, S):
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        q_seg, kv_seg = segment_ids
    else:
        q_seg = kv_seg = segment_ids
    if q_seg.shape[-1] != T or kv_seg.shape[-1] != S:
        raise ValueError(f"segment_ids: shapes {q_seg.shape}/{kv_seg.shape} do not match T={T}, S={S}")
    return q_seg, kv_seg


def attention_reference(q, k, v, *, causal=True, scale=None, segment_ids=None, q_offset=0,
                        kv_offset=0, return_lse=False):
    """Exact softmax attention, fp32 statistics.

    Args:
      q: [B, T, N, Dqk]; k: [B, S, K, Dqk]; v: [B, S, K, Dv] with N % K == 0.
      causal: mask key position s (+kv_offset) > query position t (+q_offset).
      scale: softmax scale; default Dqk**-0.5.
      segment_ids: [B, T] int (self-attention, T == S) or a pair ([B, T], [B, S]); a query only
        sees keys of its own segment.
      return_lse: also return the log-sum-exp [B, N, T] (fp32; -inf for fully masked rows).

    Returns:
      o: [B, T, N, Dv] in q.dtype (fully masked rows give 0), and lse if asked.
    """
    B, T, N, Dqk = q.shape
    S, K = k.shape[1], k.shape[2]
    if N % K:
        raise ValueError(f"q heads N={N} must be a multiple of kv heads K={K}")
    scale = Dqk ** -0.5 if scale is None else scale
    G = N // K
    qf = q.astype(jnp.float32).reshape(B, T, K, G, Dqk)
    s = jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(jnp.float32)) * scale
    mask = jnp.ones((B, 1, 1, T, S), dtype=bool)
    if causal:
        qpos = jnp.arange(T)[:, None] + q_offset
        kpos = jnp.arange(S)[None, :] + kv_offset
        mask = mask & (kpos <= qpos)[None, None, None]
    q_seg, kv_seg = _split_segments(segment_ids, T, S)
    if q_seg is not None:
        mask = mask & (q_seg[:, None, None, :, None] == kv_seg[:, None, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkgts,bskd->btkgd", p / jnp.where(l == 0, 1.0, l), v.astype(jnp.float32))
    o = o.reshape(B, T, N, -1).astype(q.dtype)
    if not return_lse:
        return o
    lse = jnp.where(l[..., 0] == 0, -jnp.inf, jnp.log(jnp.where(l[..., 0] == 0, 1.0, l[..., 0])) + m_safe[..., 0])
    return o, lse.reshape(B, N, T)
