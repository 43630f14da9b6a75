"""Ring attention over the `context` mesh axis (context parallelism), forward and backward.

Legend: B batch, T global sequence, Tl = T / cp local block, N heads, Dqk / Dv head dims,
cp context-parallel size.

Each context rank holds a block of queries and the matching block of keys/values. For cp steps,
it attends its queries to the K/V block it holds with `pallas_kernels.flash_attention(...,
return_lse=True)` while `ppermute` passes that block to the next rank around the ring; the
partial outputs are merged exactly with their log-sum-exps:
  lse = log(exp(lse_a) + exp(lse_b)),  o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse).
The backward pass is JAX's transpose of the same program (ppermute transposes to the reverse
ring; the flash kernel's lse is differentiable). Sources: Liu et al., "Ring Attention with
Blockwise Transformers", arXiv 2310.01889; Brandon et al., "Striped Attention", arXiv 2311.09431.

Causal load balance (striping). With a contiguous split, rank i's queries see only blocks
j <= i, so rank cp-1 does cp times the work of rank 0. Striping puts token t on rank t % cp at
local index t // cp (`stripe`, applied once to the batch on the host or by the caller, as MaxText's
`context_parallel_reorder_strategy: striped`): every rank then has an equal share of every
block. For rank i's queries against rank j's keys, key (lk, j) precedes query (lq, i) iff
lk*cp + j <= lq*cp + i, i.e. lk <= lq when j <= i and lk < lq when j > i: the block is causal
on local indices with kv_offset = (j > i). Every position-dependent input (RoPE positions,
segment ids, targets, loss mask) is striped the same way, and the loss is a sum over tokens,
so the model needs no other change.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels.flash_attention import flash_attention

CONTEXT = "context"


def stripe(x, cp: int, axis: int = 1):
    """Reorder the sequence axis so that a contiguous split over cp ranks is striped.

    Output position i * (T / cp) + l holds input token l * cp + i. Works on numpy and jax arrays.
    Raises ValueError if cp does not divide the sequence length.
    """
    if cp == 1:
        return x
    T = x.shape[axis]
    if T % cp:
        raise ValueError(f"stripe: sequence length {T} is not divisible by context={cp}")
    xp = jnp if isinstance(x, jax.Array) else np
    x = xp.moveaxis(x, axis, 0)
    y = x.reshape(T // cp, cp, *x.shape[1:]).swapaxes(0, 1).reshape(T, *x.shape[1:])
    return xp.moveaxis(y, 0, axis)


def unstripe(x, cp: int, axis: int = 1):
    """Inverse of `stripe`."""
    if cp == 1:
        return x
    T = x.shape[axis]
    xp = jnp if isinstance(x, jax.Array) else np
    x = xp.moveaxis(x, axis, 0)
    y = x.reshape(cp, T // cp, *x.shape[1:]).swapaxes(0, 1).reshape(T, *x.shape[1:])
    return xp.moveaxis(y, 0, axis)


def merge(o_a, lse_a, o_b, lse_b):
    """Merge two partial attention results over disjoint key sets.

    o_*: [B, T, N, Dv] (fp32); lse_*: [B, N, T] fp32 natural log-sum-exp, -inf where a row saw
    no key. Returns (o, lse); rows masked in both stay (0, -inf). Gradient-safe at -inf.
    """
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    s = jnp.exp(lse_a - m_safe) + jnp.exp(lse_b - m_safe)
    ok = s > 0
    lse = jnp.where(ok, jnp.log(jnp.where(ok, s, 1.0)) + m_safe, -jnp.inf)
    lse_safe = jnp.where(ok, lse, 0.0)
    wa = jnp.where(ok, jnp.exp(lse_a - lse_safe), 0.0)
    wb = jnp.where(ok, jnp.exp(lse_b - lse_safe), 0.0)
    tr = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # [B, N, T] -> [B, T, N, 1]
    return o_a * tr(wa) + o_b * tr(wb), lse


def _ring_body(q, k, v, q_seg, kv_seg, *, cp, causal, scale, striped, impl, axis):
    """Per-rank program. q [B, Tl, N, Dqk], k [B, Tl, K, Dqk], v [B, Tl, K, Dv], segs [B, Tl] or None."""
    Tl = q.shape[1]
    i = jax.lax.axis_index(axis)
    perm = [(r, (r + 1) % cp) for r in range(cp)]
    o_acc = lse_acc = None
    for s in range(cp):
        if s + 1 < cp:  # start passing the block on while this one is computed
            k_next, v_next = jax.lax.ppermute(k, axis, perm), jax.lax.ppermute(v, axis, perm)
            seg_next = jax.lax.ppermute(kv_seg, axis, perm) if kv_seg is not None else None
        j = (i - s) % cp  # the rank whose K/V block this is
        if striped:
            q_off, kv_off = 0, (j > i).astype(jnp.int32)
        else:
            q_off, kv_off = i * Tl, j * Tl
        segs = None if q_seg is None else (q_seg, kv_seg)
        o, lse = flash_attention(q, k, v, causal=causal, scale=scale, segment_ids=segs,
                                 q_offset=q_off, kv_offset=kv_off, return_lse=True, impl=impl)
        o = o.astype(jnp.float32)
        if o_acc is None:
            o_acc, lse_acc = o, lse
        else:
            o_acc, lse_acc = merge(o_acc, lse_acc, o, lse)
        if s + 1 < cp:
            k, v, kv_seg = k_next, v_next, seg_next
    return o_acc.astype(q.dtype)


def ring_attention(q, k, v, *, mesh, causal=True, scale=None, segment_ids=None, striped=True,
                   batch_axes=(), head_axes=(), impl="auto", axis=CONTEXT):
    """Attention with the sequence sharded over mesh axis `axis`.

    Args:
      q: [B, T, N, Dqk]; k: [B, T, K, Dqk]; v: [B, T, K, Dv] global arrays (self-attention,
        same T), sequence laid out in `striped` order when causal load balancing is wanted.
      mesh: the device mesh; `axis` its context axis (size cp, cp | T).
      causal: causal mask on the original token order.
      scale: softmax scale (default Dqk ** -0.5).
      segment_ids: None or [B, T] int (same layout as q); queries only see keys of their segment.
      striped: True if the sequence is in `stripe` order, False for contiguous blocks.
      batch_axes / head_axes: mesh axes that shard B / the heads (kept local in the shard_map).
      impl: flash-attention backend ("auto" | "pallas" | "reference").
    Returns:
      o [B, T, N, Dv] in q.dtype, same layout as q.
    """
    cp = int(dict(mesh.shape)[axis])
    ba = tuple(batch_axes) or None
    ha = tuple(head_axes) or None
    qs = P(ba, axis, ha, None)
    kvs = P(ba, axis, ha if k.shape[2] == q.shape[2] else None, None)
    ss = P(ba, axis)
    has_seg = segment_ids is not None

    def body(q, k, v, seg):
        seg = seg if has_seg else None
        return _ring_body(q, k, v, seg, seg, cp=cp, causal=causal, scale=scale, striped=striped,
                          impl=impl, axis=axis)

    seg = segment_ids if has_seg else jnp.zeros(q.shape[:2], jnp.int32)
    # check_vma=False: with impl="pallas" the kernels' loop counters fail the varying-manual-axes
    # type check (found tracing on fake devices); tests/sharding/test_ring_attention.py checks
    # the result and gradients against full attention.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(qs, kvs, kvs, ss), out_specs=qs, check_vma=False)
    return fn(q, k, v, seg)


def context_attention(q, k, v, *, ctx, causal=True, scale=None, segment_ids=None, impl="auto"):
    """`ring_attention` with axes taken from an active `sharding.rules.ShardingContext`: batch
    over the preset's `batch` axes, heads over its `act_heads` axes, sequence over `context`."""
    batch_axes = ctx.rules.mesh_axes("batch", ctx.mesh)
    head_axes = ctx.rules.mesh_axes("act_heads", ctx.mesh)
    return ring_attention(q, k, v, mesh=ctx.mesh, causal=causal, scale=scale,
                          segment_ids=segment_ids, striped=ctx.striped, batch_axes=batch_axes,
                          head_axes=head_axes, impl=impl)


def local_attention(q, k, v, *, ctx, causal=True, scale=None, segment_ids=None, impl="auto"):
    """`flash_attention` inside `shard_map`: every device attends over its own batch rows and
    heads (the whole sequence; no context axis). A Pallas kernel is one opaque custom call that
    XLA's SPMD partitioner cannot split, so without this it runs on gathered, replicated inputs
    (4 H200s, fsdp=4: every device computed the global batch's attention, benchmarks/RESULTS.md).

    Args:
      q: [B, T, N, Dqk]; k: [B, S, K, Dqk]; v: [B, S, K, Dv]; segment_ids: None or [B, T] int.
      ctx: the active `sharding.rules.ShardingContext`; B goes over its `batch` axes and the
        heads over its `act_heads` axes where the sizes divide (heads stay whole when K does not
        split like N: the GQA grouping must stay local).
    Returns:
      o [B, T, N, Dv] in q.dtype, laid out like q.
    """
    logical = ("batch", None, "act_heads", None)
    qs = ctx.spec(logical, q.shape, strict=False)
    kvs = ctx.spec(logical, k.shape, strict=False)
    if qs[0] != kvs[0] or qs[2] != kvs[2]:
        qs = kvs = P(qs[0] if qs[0] == kvs[0] else None, None, None, None)
    call = lambda q, k, v, seg: flash_attention(q, k, v, causal=causal, scale=scale,
                                                segment_ids=seg, impl=impl)
    if ctx.mesh.size == 1 or (qs[0] is None and qs[2] is None):
        return call(q, k, v, segment_ids)
    has_seg = segment_ids is not None
    seg = segment_ids if has_seg else jnp.zeros(q.shape[:2], jnp.int32)
    # check_vma=False: the Pallas kernels' loops carry unannotated counters, which the
    # varying-manual-axes type check rejects (seen on 4 H200s); the layout tests compare the
    # result with one device.
    fn = jax.shard_map(lambda q, k, v, s: call(q, k, v, s if has_seg else None), mesh=ctx.mesh,
                       in_specs=(qs, kvs, kvs, P(qs[0], None)), out_specs=qs, check_vma=False)
    return fn(q, k, v, seg)
