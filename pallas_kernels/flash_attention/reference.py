"""Pure-jnp attention reference: exact softmax, fp32 accumulation, memory linear in T.

Legend: B batch, T query length, S key length, N query heads, K kv heads (N % K == 0),
G = N // K query heads per kv head, Dqk q/k head dim, Dv value head dim.

Maths: softmax attention (Vaswani et al. 2017, eq. 1), o = softmax(scale * q k^T + mask) v,
with the log-sum-exp lse = log(sum_s exp(scale * q k_s^T)) over the unmasked keys. Queries are
processed in chunks of `chunk` rows under `jax.checkpoint`, so forward and backward hold one
[chunk, S] score block at a time instead of [T, S] (when T <= chunk the single block runs
directly, without the map and the backward recomputation: faster on CPU).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def split_segments(segment_ids, T, S):
    """Normalise `segment_ids` to (q_seg [B, T], kv_seg [B, S]) int arrays, or (None, None).

    Raises ValueError on a shape mismatch, or when one [B, T] array is given with T != S.
    """
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids: expected one [B, T] array or a pair ([B, T], [B, S])")
        q_seg, kv_seg = segment_ids
    else:
        if T != S:
            raise ValueError(f"segment_ids: one array needs T == S (got T={T}, S={S}); pass a pair")
        q_seg = kv_seg = segment_ids
    if q_seg.ndim != 2 or kv_seg.ndim != 2 or q_seg.shape[-1] != T or kv_seg.shape[-1] != S:
        raise ValueError(f"segment_ids: shapes {q_seg.shape}/{kv_seg.shape} do not match T={T}, S={S}")
    return q_seg, kv_seg


def check_shapes(q, k, v):
    """Validate q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv]; return (B, T, S, N, K, Dqk, Dv)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be 4-D [B, T, N, D]; got {q.shape}, {k.shape}, {v.shape}")
    B, T, N, Dqk = q.shape
    S, K = k.shape[1], k.shape[2]
    if k.shape != (B, S, K, Dqk):
        raise ValueError(f"k shape {k.shape} must be [B={B}, S, K, Dqk={Dqk}]")
    if v.shape[:3] != (B, S, K):
        raise ValueError(f"v shape {v.shape} must be [B={B}, S={S}, K={K}, Dv]")
    if N % K:
        raise ValueError(f"q heads N={N} must be a multiple of kv heads K={K}")
    return B, T, S, N, K, Dqk, v.shape[3]


def attention_reference(q, k, v, *, causal=True, scale=None, segment_ids=None, q_offset=0,
                        kv_offset=0, return_lse=False, chunk=512):
    """Exact softmax attention with fp32 statistics and fp32 accumulation.

    Args:
      q: [B, T, N, Dqk]; k: [B, S, K, Dqk]; v: [B, S, K, Dv] with N % K == 0 (GQA/MQA: query
        head n reads kv head n // (N // K)). Any float dtype; maths in fp32.
      causal: mask key s when s + kv_offset > t + q_offset.
      scale: softmax scale; default Dqk ** -0.5.
      segment_ids: [B, T] int (self-attention, T == S) or a pair ([B, T], [B, S]); a query only
        sees keys of its own segment.
      q_offset, kv_offset: global positions of q[:, 0] and k[:, 0] (ints or int scalars), for
        ring-attention blocks.
      return_lse: also return the natural log-sum-exp [B, N, T] fp32 (-inf for fully masked rows).
      chunk: query rows per block (memory is O(chunk * S) per step).

    Returns:
      o: [B, T, N, Dv] in q.dtype (fully masked rows give 0), and lse if asked.

    Raises:
      ValueError: bad shapes (see `check_shapes`, `split_segments`).
    """
    B, T, S, N, K, Dqk, Dv = check_shapes(q, k, v)
    scale = Dqk ** -0.5 if scale is None else scale
    G = N // K
    q_seg, kv_seg = split_segments(segment_ids, T, S)
    C = min(chunk, T)
    nc = -(-T // C)
    Tp = nc * C
    pad = Tp - T
    qf = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, nc, C, K, G, Dqk)
    qf = jnp.moveaxis(qf, 1, 0)                                   # [nc, B, C, K, G, Dqk]
    qpos = (jnp.arange(Tp, dtype=jnp.int32) + q_offset).reshape(nc, C)
    kpos = jnp.arange(S, dtype=jnp.int32) + kv_offset
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32)
    if q_seg is not None:
        qs = jnp.moveaxis(jnp.pad(q_seg, ((0, 0), (0, pad))).reshape(B, nc, C), 1, 0)
    else:
        qs = jnp.zeros((nc, B, C), jnp.int32)

    def one_chunk(args):
        q_c, qpos_c, qs_c = args                                    # [B,C,K,G,D], [C], [B,C]
        s = jnp.einsum("bckgd,bskd->bkgcs", q_c.astype(jnp.float32), kf) * scale
        mask = jnp.ones((1, 1, 1, C, S), dtype=bool)
        if causal:
            mask = mask & (kpos[None, :] <= qpos_c[:, None])[None, None, None]
        if q_seg is not None:
            mask = mask & (qs_c[:, None, None, :, None] == kv_seg[:, None, None, None, :])
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m_safe)
        l = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("bkgcs,bskd->bckgd", p / jnp.where(l == 0, 1.0, l), vf)
        lse = jnp.where(l[..., 0] == 0, -jnp.inf, jnp.log(jnp.where(l[..., 0] == 0, 1.0, l[..., 0]))
                        + m_safe[..., 0])                           # [B, K, G, C]
        return o, lse

    if nc == 1:  # T <= chunk: one block, O(T * S) memory anyway; skip the map and recompute
        o, lse = jax.tree.map(lambda x: x[None], one_chunk((qf[0], qpos[0], qs[0])))
    else:
        o, lse = jax.lax.map(jax.checkpoint(one_chunk), (qf, qpos, qs))  # [nc,B,C,K,G,Dv], [nc,B,K,G,C]
    o = jnp.moveaxis(o, 0, 1).reshape(B, Tp, N, Dv)[:, :T].astype(q.dtype)
    if not return_lse:
        return o
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, N, Tp)[:, :, :T]
    return o, lse


def attention_naive(q, k, v, *, causal=True, scale=None, segment_ids=None, q_offset=0, kv_offset=0):
    """Full [T, S] softmax in fp32 (test oracle only; memory O(T * S)). Returns (o fp32, lse)."""
    B, T, S, N, K, Dqk, Dv = check_shapes(q, k, v)
    scale = Dqk ** -0.5 if scale is None else scale
    kk = jnp.repeat(k.astype(jnp.float32), N // K, axis=2)
    vv = jnp.repeat(v.astype(jnp.float32), N // K, axis=2)
    s = jnp.einsum("btnd,bsnd->bnts", q.astype(jnp.float32), kk) * scale
    mask = jnp.ones((B, 1, T, S), bool)
    if causal:
        mask &= (jnp.arange(S)[None] + kv_offset <= jnp.arange(T)[:, None] + q_offset)[None, None]
    q_seg, kv_seg = split_segments(segment_ids, T, S)
    if q_seg is not None:
        mask &= (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
    s = jnp.where(mask, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    o = jnp.einsum("bnts,bsnd->btnd", p, vv)
    return o, lse
