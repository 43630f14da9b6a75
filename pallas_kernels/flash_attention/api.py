"""Public flash-attention entry point with backend dispatch, and the Mosaic GPU kernels' entry
(`flash_attention_mosaic`: the forward kernel with its own backward kernels as a custom VJP).

Legend: B batch, T query length, S key length, N query heads, K kv heads, Dqk q/k head dim,
Dv value head dim.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _compile_only
from pallas_kernels._hopper import (INTERPRET_NAMED_BARRIERS, interpret_params, on_gpu,
                                    on_hopper)
from pallas_kernels.flash_attention import mosaic_bwd, mosaic_fwd
from pallas_kernels.flash_attention.mosaic_common import Config, check_supported, default_config
from pallas_kernels.flash_attention.reference import (attention_reference, check_shapes,
                                                      split_segments)

IMPLS = ("auto", "pallas", "reference")


def flash_attention(q, k, v, *, causal=True, scale=None, segment_ids=None, q_offset=0,
                    kv_offset=0, return_lse=False, impl="auto"):
    """Softmax attention for MLA shapes: q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv].

    Args:
      q, k, v: as above, N % K == 0 (GQA/MQA). The Pallas kernel takes bf16/fp16 and head dims
        that are multiples of 64 up to 256; the reference takes any float dtype and shape.
      causal: mask key s when s + kv_offset > t + q_offset.
      scale: softmax scale; default Dqk ** -0.5.
      segment_ids: None, one [B, T] int array (self-attention, T == S), or a pair
        ([B, T], [B, S]); a query only sees keys of its own segment (packed documents).
      q_offset, kv_offset: global positions of the first query / key (int or int32 scalar), for
        ring-attention blocks.
      return_lse: also return the natural log-sum-exp [B, N, T] fp32 (-inf on fully masked rows);
        it is differentiable, so partial results can be merged (ring attention).
      impl: "auto" (the Mosaic GPU kernel on a Hopper GPU where it takes the inputs, e.g. not
        fp32 or head dims that are not multiples of 64; else the reference), "pallas" (the
        Mosaic GPU kernel; on a non-GPU backend it runs in GPU interpret mode, which is slow and
        meant for tests) or "reference" (pure jnp, `reference.attention_reference`).

    Returns:
      o [B, T, N, Dv] in q.dtype (fully masked rows give 0), and lse if return_lse.

    Raises:
      ValueError: unknown impl, bad shapes, or (impl="pallas") inputs the kernel cannot take.

    Maths: FlashAttention-2 (arXiv 2307.08691) forward/backward with FlashAttention-3's
    warp-specialised Hopper layout (arXiv 2407.08608); see `mosaic_common.py`.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    B, T, S, N, K, Dqk, Dv = check_shapes(q, k, v)
    if impl == "auto":  # the kernel on a Hopper GPU (or while planning) where it takes the inputs
        impl = "pallas" if (_compile_only.active() or on_hopper()) and supports(q, k, v) else "reference"
    if impl == "pallas" and _compile_only.active():  # memory planning: outputs of the kernels
        check_supported(q, k, v, None)
        o, lse = _attention_stand_in(q, k, v, segment_ids)
        return (o, lse) if return_lse else o
    if impl == "reference":
        return attention_reference(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids,
                                   q_offset=q_offset, kv_offset=kv_offset, return_lse=return_lse)
    segs = split_segments(segment_ids, T, S)
    segs = None if segs[0] is None else segs
    interpret = None
    if not on_gpu():
        interpret = interpret_params()
    elif not on_hopper():
        raise ValueError("impl='pallas': the Mosaic GPU kernel needs a Hopper GPU (sm_90)")
    o, lse = flash_attention_mosaic(q, k, v, causal=causal, scale=scale, segments=segs,
                                    q_offset=q_offset, kv_offset=kv_offset, interpret=interpret)
    return (o, lse) if return_lse else o


def supports(q, k, v) -> bool:
    """Whether the Mosaic GPU kernel takes q, k, v (arrays or `jax.ShapeDtypeStruct`s) with its
    default tiles: bf16/fp16, head dims multiples of 64 up to 256, within shared memory."""
    try:
        check_supported(q, k, v, None)
    except ValueError:
        return False
    return True


def flash_attention_mosaic(q, k, v, *, causal=True, scale=None, segments=None, q_offset=0,
                           kv_offset=0, cfg: Config | None = None, interpret=None):
    """Mosaic GPU flash attention with its own backward kernels.

    Args:
      q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv]: bf16 or fp16, Dqk and Dv multiples of
        64 up to 256, N % K == 0.
      segments: None or (q_seg [B, T], kv_seg [B, S]) int.
      q_offset, kv_offset: int or int32 scalar (may be traced).
      cfg: tiles and schedules; default `default_config(Dqk, Dv)`.
      interpret: None (compile for the GPU) or `_hopper.interpret_params(...)` (GPU interpret
        mode, a CPU simulation that runs the kernels' PTX named barriers too).

    Returns:
      (o [B, T, N, Dv] in q.dtype, lse [B, N, T] fp32 natural log, -inf on fully masked rows).
    """
    check_supported(q, k, v, cfg)
    if interpret is not None and getattr(interpret, "inline_mgpu", None) != INTERPRET_NAMED_BARRIERS:
        raise ValueError("interpret: the kernels' named barriers need "
                         "`_hopper.interpret_params()` (inline_mgpu=INTERPRET_NAMED_BARRIERS)")
    cfg = default_config(q.shape[-1], v.shape[-1]) if cfg is None else cfg
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    segs = None if segments is None else (jnp.asarray(segments[0]), jnp.asarray(segments[1]))
    static_delta = None     # offsets known while tracing: range tables become constants
    if all(isinstance(x, int) for x in (q_offset, kv_offset)):
        static_delta = int(q_offset) - int(kv_offset)
    return _attention(q, k, v, segs, (q_offset, kv_offset), scale, causal, cfg, interpret,
                      static_delta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _attention(q, k, v, segs, offsets, scale, causal, cfg, interpret, static_delta):
    o, lse2 = mosaic_fwd.forward(q, k, v, segs, offsets, scale=scale, causal=causal, cfg=cfg,
                                 interpret=interpret, static_delta=static_delta)
    return o, lse2 * math.log(2.0)


def _attention_fwd(q, k, v, segs, offsets, scale, causal, cfg, interpret, static_delta):
    o, lse2 = mosaic_fwd.forward(q, k, v, segs, offsets, scale=scale, causal=causal, cfg=cfg,
                                 interpret=interpret, static_delta=static_delta)
    return (o, lse2 * math.log(2.0)), (q, k, v, segs, offsets, o, lse2)


def _attention_bwd(scale, causal, cfg, interpret, static_delta, res, cts):
    q, k, v, segs, offsets, o, lse2 = res
    do, dlse = cts
    dq, dk, dv = mosaic_bwd.backward(q, k, v, segs, offsets, o, lse2, do, dlse, scale=scale,
                                     causal=causal, cfg=cfg, interpret=interpret,
                                     static_delta=static_delta)
    seg_ct = None if segs is None else jax.tree.map(lambda _: None, segs)
    return dq, dk, dv, seg_ct, (None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


@jax.custom_vjp
def _attention_stand_in(q, k, v, segment_ids):
    """Compile-only stand-in of `_attention` (`pallas_kernels._compile_only`): the kernels'
    outputs o [B, T, N, Dv] and lse [B, N, T] fp32, residuals (q, k, v, o, lse) and gradients
    dq, dk, dv, and no other buffer."""
    B, T, N, _ = q.shape
    out = (jax.ShapeDtypeStruct(q.shape[:3] + v.shape[3:], q.dtype),
           jax.ShapeDtypeStruct((B, N, T), jnp.float32))
    return _compile_only.stand_in(out, q, k, v, *([] if segment_ids is None else [segment_ids]))


def _stand_in_fwd(q, k, v, segment_ids):
    o, lse = _attention_stand_in(q, k, v, segment_ids)
    return (o, lse), (q, k, v, segment_ids, o, lse)


def _stand_in_bwd(res, cts):
    q, k, v, segment_ids, o, lse = res
    out = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    dq, dk, dv = _compile_only.stand_in(out, q, k, v, o, lse, cts[0], cts[1])
    seg_ct = None if segment_ids is None else jax.tree.map(lambda _: None, segment_ids)
    return dq, dk, dv, seg_ct


_attention_stand_in.defvjp(_stand_in_fwd, _stand_in_bwd)
