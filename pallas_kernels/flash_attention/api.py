"""Public flash-attention entry point with backend dispatch.

Legend: B batch, T query length, S key length, N query heads, K kv heads, Dqk q/k head dim,
Dv value head dim.
"""
from __future__ import annotations

import functools

import jax

from pallas_kernels.flash_attention import mosaic_gpu
from pallas_kernels.flash_attention.reference import (attention_reference, check_shapes,
                                                      split_segments)

IMPLS = ("auto", "pallas", "reference")


@functools.lru_cache(maxsize=None)
def on_hopper() -> bool:
    """True when the default device is an NVIDIA GPU of compute capability 9.x."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return False
    cc = str(getattr(dev, "compute_capability", ""))
    return cc.startswith("9")


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
      impl: "auto" (the Mosaic GPU kernel on a Hopper GPU, else the reference), "pallas" (the
        Mosaic GPU kernel; on a non-GPU backend it runs in GPU interpret mode, which is slow and
        meant for tests) or "reference" (pure jnp, `reference.attention_reference`).

    Returns:
      o [B, T, N, Dv] in q.dtype (fully masked rows give 0), and lse if return_lse.

    Raises:
      ValueError: unknown impl, bad shapes, or (impl="pallas") inputs the kernel cannot take.

    Maths: FlashAttention-2 (arXiv 2307.08691) forward/backward with FlashAttention-3's
    warp-specialised Hopper layout (arXiv 2407.08608); see `mosaic_gpu.py`.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    B, T, S, N, K, Dqk, Dv = check_shapes(q, k, v)
    if impl == "auto":
        impl = "pallas" if on_hopper() else "reference"
    if impl == "reference":
        return attention_reference(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids,
                                   q_offset=q_offset, kv_offset=kv_offset, return_lse=return_lse)
    segs = split_segments(segment_ids, T, S)
    segs = None if segs[0] is None else segs
    interpret = None
    if jax.devices()[0].platform != "gpu":
        interpret = mosaic_gpu.interpret_params()
    elif not on_hopper():
        raise ValueError("impl='pallas': the Mosaic GPU kernel needs a Hopper GPU (sm_90)")
    o, lse = mosaic_gpu.flash_attention_mosaic(q, k, v, causal=causal, scale=scale, segments=segs,
                                               q_offset=q_offset, kv_offset=kv_offset,
                                               interpret=interpret)
    return (o, lse) if return_lse else o
