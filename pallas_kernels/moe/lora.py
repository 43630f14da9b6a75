"""LoRA on grouped (per-expert) weights: the low-rank update of a grouped GEMM, computed by two
grouped GEMMs over the same row groups as the base GEMM.

Legend: M rows sorted by group, Kd input width, N output width, E groups (experts), r rank.
delta[i] = (x[i] @ A[g(i)]) @ B[g(i)] * scale, the adapter term of
x[i] @ (W[g(i)] + A[g(i)] B[g(i)] scale) (Hu et al. 2021, arXiv 2106.09685, eq. 3), with the
per-expert factors of SkyRL tx's `LoRAExpert`. The Mosaic GPU kernels take widths that are
multiples of 128, so where they run, the rank is zero-padded to the next multiple of 128 (A's
extra columns and B's extra rows are zeros: the product, and the gradients of the real
columns and rows, are exact); at rank 16 that is 8x the adapter GEMMs' FLOPs, still a small
share of the base GEMM's, where the fallback `lax.ragged_dot` runs ~50x slower than the kernels
on an H200. Adapters of GEMMs that share their input (gate and up) share the first GEMM
(`grouped_lora_deltas`). Gradients come from `grouped_matmul`'s custom VJP (dx, dA, dB grouped
GEMMs).
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from pallas_kernels.moe import api


KERNEL_WIDTH = 128  # the Mosaic GPU grouped GEMMs' width granule (output and contraction)


def _impl_for(impl, x, w):
    if impl == "pallas" and api._pallas_fits(x, w) is not None:
        return "auto"
    return impl


def lora_dropout(x, rate: float, key):
    """Inverted dropout on an adapter's input: x [..., D] with each element zeroed with
    probability `rate` (Bernoulli mask from `key`, a PRNG key) and the rest scaled by
    1 / (1 - rate), in x.dtype (Hu et al. 2021, LoRA dropout as PEFT applies it). x itself when
    rate <= 0 or key is None."""
    if key is None or rate <= 0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def padded_rank(x, a, b, impl):
    """The rank the adapter GEMMs run at: r rounded up to KERNEL_WIDTH when the kernels take
    both padded GEMMs for this impl and device (`api._resolve`), else r."""
    r = a.shape[-1]
    rp = -(-r // KERNEL_WIDTH) * KERNEL_WIDTH
    if rp == r or impl == "reference":
        return r
    a_p = jax.ShapeDtypeStruct(a.shape[:-1] + (rp,), x.dtype)
    t_p = jax.ShapeDtypeStruct(x.shape[:-1] + (rp,), x.dtype)
    b_p = jax.ShapeDtypeStruct((b.shape[0], rp, b.shape[2]), x.dtype)
    fits = api._pallas_fits(x, a_p) is None and api._pallas_fits(t_p, b_p) is None
    if not fits or api._resolve(impl, x, a_p) == "reference":
        return r
    return rp


def grouped_lora_deltas(x, pairs, group_sizes, *, scale: float, impl: str = "auto"):
    """The adapter terms of grouped GEMMs that share their input rows x (the routed experts'
    gate and up projections), with one GEMM for all their A factors.

    t = x @ [A_1 | A_2 | ...] is one grouped GEMM of width R = r_1 + r_2 + ... (padded to
    KERNEL_WIDTH where the kernels run, so two rank-16 adapters cost what one does), and
    delta_i = t @ B_i', where B_i' is scale * B_i placed in rows r_1 + ... + r_(i-1) onwards of
    an [E, R, N_i] zero block: the padded t feeds every second GEMM without a slice or pad.
    In the backward the cotangents of t add up ([M, R]), so dx and the dA of all adapters
    are one grouped GEMM each. The scale multiplies B (fp32, then cast), never an [M, N]
    tensor: exact for power-of-two scales (alpha / r = 2 by default), one bf16 rounding of
    the scaled B otherwise.

    Args:
      x: [M, Kd] rows grouped consecutively by `group_sizes` (bf16/f16/fp32).
      pairs: sequence of (A [E, Kd, r_i], B [E, r_i, N_i]) (cast to x.dtype).
      group_sizes: [E] int, sum <= M (rows past the sum give zeros, as in `grouped_matmul`).
      scale: alpha / r; impl: "auto" | "pallas" | "reference" ("pallas" falls back to "auto"
        for the GEMMs the kernels cannot take).
    Returns:
      tuple of [M, N_i] in x.dtype: scale * (x[i] @ A_i[g(i)]) @ B_i[g(i)], fp32 accumulation
      in each GEMM. Differentiable in x and every A, B.
    Raises:
      ValueError: unknown impl, or no pairs.
    """
    if not pairs:
        raise ValueError("grouped_lora_deltas: no (A, B) pairs")
    ranks = [a.shape[-1] for a, _ in pairs]
    a = jnp.concatenate([a.astype(x.dtype) for a, _ in pairs], axis=-1)
    bs = [(b.astype(jnp.float32) * scale).astype(x.dtype) for _, b in pairs]
    r = a.shape[-1]
    # any pair the padded kernels cannot take (padded_rank returns r): no padding at all
    rp = min(padded_rank(x, a, b, impl) for b in bs)
    if rp != r:
        a = jnp.pad(a, ((0, 0), (0, 0), (0, rp - r)))
    t = api.grouped_matmul(x, a, group_sizes, impl=_impl_for(impl, x, a))
    # named for remat policies (`jax.checkpoint_policies.save_only_these_names`): only the r real
    # columns (the padded ones are exact zeros), padded again for the second GEMMs
    t = jnp.pad(checkpoint_name(t[:, :r], "lora_t"), ((0, 0), (0, rp - r)))
    outs, lo = [], 0
    for ri, b in zip(ranks, bs):
        if rp == r:  # unpadded: each adapter's own columns of t (all of t for one adapter)
            ti, bi = t[:, lo:lo + ri], b
        else:  # padded: B's rows placed at this adapter's columns of t
            ti, bi = t, jnp.pad(b, ((0, 0), (lo, rp - lo - ri), (0, 0)))
        outs.append(api.grouped_matmul(ti, bi, group_sizes, impl=_impl_for(impl, ti, bi)))
        lo += ri
    return tuple(outs)


def grouped_lora_delta(x, a, b, group_sizes, *, scale: float, impl: str = "auto"):
    """The adapter term of one grouped GEMM: `grouped_lora_deltas(x, ((a, b),), ...)[0]`.

    Args:
      x: [M, Kd]; a: [E, Kd, r]; b: [E, r, N]; group_sizes: [E] int; scale, impl: as there.
    Returns:
      [M, N] in x.dtype: scale * (x[i] @ a[g(i)]) @ b[g(i)].
    Raises:
      ValueError: unknown impl.
    """
    return grouped_lora_deltas(x, ((a, b),), group_sizes, scale=scale, impl=impl)[0]
