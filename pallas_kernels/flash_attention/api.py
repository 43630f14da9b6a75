"""Public flash-attention entry point with backend dispatch."""
from __future__ import annotations

import jax

from pallas_kernels.flash_attention.reference import attention_reference

IMPLS = ("auto", "pallas", "reference")


def flash_attention(q, k, v, *, causal=True, scale=None, segment_ids=None, q_offset=0,
                    kv_offset=0, return_lse=False, impl="auto"):
    """Attention for MLA shapes: q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] -> [B, T, N, Dv].

    impl: "auto" (Pallas Mosaic GPU on Hopper, else reference) | "pallas" | "reference".
    See `reference.attention_reference` for the argument semantics.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "pallas":
        raise ValueError("impl='pallas': the Mosaic GPU flash-attention kernel is not available yet")
    return attention_reference(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids,
                               q_offset=q_offset, kv_offset=kv_offset, return_lse=return_lse)
