"""LoRA on grouped (per-expert) weights: the low-rank update of a grouped GEMM, computed by two
grouped GEMMs over the same row groups as the base GEMM.

Legend: M rows sorted by group, Kd input width, N output width, E groups (experts), r rank.
delta[i] = (x[i] @ A[g(i)]) @ B[g(i)] * scale, the adapter term of
x[i] @ (W[g(i)] + A[g(i)] B[g(i)] scale) (Hu et al. 2021, arXiv 2106.09685, eq. 3), with the
per-expert factors of SkyRL tx's `LoRAExpert`. The rank-r GEMMs are too narrow for the Mosaic
GPU kernels (widths must be multiples of 128), so impl="pallas" runs them in the "auto"
backend choice; gradients come from `grouped_matmul`'s custom VJP (dx, dA, dB grouped GEMMs).
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.moe import api


def _impl_for(impl, x, w):
    if impl == "pallas" and api._pallas_fits(x, w) is not None:
        return "auto"
    return impl


def grouped_lora_delta(x, a, b, group_sizes, *, scale: float, impl: str = "auto"):
    """The adapter term of a grouped GEMM.

    Args:
      x: [M, Kd] rows grouped consecutively by `group_sizes` (bf16/f16/fp32).
      a: [E, Kd, r]; b: [E, r, N] (cast to x.dtype); group_sizes: [E] int, sum <= M (rows past
        the sum give zeros, as in `grouped_matmul`).
      scale: alpha / r; impl: "auto" | "pallas" | "reference" ("pallas" falls back to "auto"
        for the GEMMs the kernels cannot take).
    Returns:
      [M, N] in x.dtype: scale * (x[i] @ a[g(i)]) @ b[g(i)], fp32 accumulation in each GEMM.
      Differentiable in x, a and b.
    Raises:
      ValueError: unknown impl.
    """
    a = a.astype(x.dtype)
    b = b.astype(x.dtype)
    t = api.grouped_matmul(x, a, group_sizes, impl=_impl_for(impl, x, a))
    y = api.grouped_matmul(t, b, group_sizes, impl=_impl_for(impl, t, b))
    return y * jnp.asarray(scale, y.dtype)
