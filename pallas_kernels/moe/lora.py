"""LoRA on grouped (per-expert) weights: the low-rank update of a grouped GEMM over the same
row groups as the base GEMM.

Legend: M rows sorted by group, Kd input width, N output width, E groups (experts), r rank.
y[i] = x[i] @ W[g(i)] + scale * (x[i] @ A[g(i)]) @ B[g(i)], i.e. x[i] @ (W[g(i)] + A[g(i)]
B[g(i)] scale) (Hu et al. 2021, arXiv 2106.09685, eq. 3), with the per-expert factors of SkyRL
tx's `LoRAExpert`. t = x @ A is one grouped GEMM (shared by the adapters of GEMMs with the
same input: gate and up); t @ B runs inside the base GEMM as one more contraction into its
accumulator (`grouped_matmul(extra=...)`). The Mosaic GPU kernels take output widths that are
multiples of 128 and contractions in steps of 64 (16 for the extra contraction), so where they
run, A is zero-padded to 128 columns and t and B to a multiple of 16 (zero columns and rows: the
product, and the gradients of the real columns and rows, are exact); the fallback
`lax.ragged_dot` runs ~50x slower than the kernels on an H200. Gradients come from
`grouped_matmul`'s custom VJP (dx, dA, dt, dB grouped GEMMs).
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from pallas_kernels.moe import api


KERNEL_WIDTH = 128  # the Mosaic GPU grouped GEMMs' width granule (output and contraction)
CONTRACTION_STEP = 16  # `grouped_matmul(extra=...)` takes t and B widths in multiples of it


def _impl_for(impl, x, w):
    if impl == "pallas" and api.pallas_unsupported(x, w) is not None:
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
    fits = api.pallas_unsupported(x, a_p) is None and api.pallas_unsupported(t_p, b_p) is None
    if not fits or api._resolve(impl, x, a_p) == "reference":
        return r
    return rp


def _widths(x, pairs, impl):
    """(r, rp, rc) of adapters sharing x: r the sum of their ranks, rp the width of the x A GEMM
    (r rounded up to KERNEL_WIDTH where the kernels take every padded GEMM, else r: any pair
    they cannot take means no padding at all), rc that of t for the B GEMMs (r rounded up to
    CONTRACTION_STEP where padded)."""
    r = sum(a.shape[-1] for a, _ in pairs)
    a_cat = jax.ShapeDtypeStruct(pairs[0][0].shape[:-1] + (r,), x.dtype)
    rp = min(padded_rank(x, a_cat, b, impl) for _, b in pairs)
    return r, rp, (r if rp == r else -(-r // CONTRACTION_STEP) * CONTRACTION_STEP)


def lora_factors(x, pairs, group_sizes, *, scale: float, impl: str = "auto", dx_elsewhere=False):
    """The shared first factor and the placed second factors of LoRA adapters on grouped GEMMs
    that share their input rows x (the routed experts' gate and up projections).

    t = x @ [A_1 | A_2 | ...] is one grouped GEMM of width R = r_1 + r_2 + ... (padded to
    KERNEL_WIDTH where the kernels run, so two rank-16 adapters cost what one does); its r real
    columns are named "lora_t" for remat policies and zero-padded to a multiple of the kernels'
    contraction step (16). B_i' is scale * B_i placed in rows r_1 + ... + r_(i-1) onwards of an
    [E, R', N_i] zero block, so t @ B_i' is adapter i's term and needs no slice of t. In the
    backward the cotangents of t add up, so the dA of all adapters is one grouped GEMM (and
    their dx, unless `dx_elsewhere`). The scale multiplies B (fp32, then cast), never an
    [M, N] tensor: exact for power-of-two scales (alpha / r = 2 by default), one bf16 rounding
    of the scaled B otherwise.

    Args:
      x: [M, Kd] rows grouped consecutively by `group_sizes` (bf16/f16/fp32).
      pairs: sequence of (A [E, Kd, r_i], B [E, r_i, N_i]) (cast to x.dtype).
      group_sizes: [E] int, sum <= M; scale: alpha / r; impl: "auto" | "pallas" | "reference"
        ("pallas" falls back to "auto" for the GEMMs the kernels cannot take).
      dx_elsewhere: t's GEMM gives no gradient to x (x's gradient stopped there); the caller
        adds dt A^T to x's gradient (`grouped_matmul(extra=(t, B', A'))`).
    Returns:
      (t [M, R'] in x.dtype, (B_1' [E, R', N_1], ...) in x.dtype, A' [E, Kd, R'] in x.dtype:
      [A_1 | A_2 | ...] zero-padded like t), R' = r where the kernels do not run.
      Differentiable in x and every A, B.
    Raises:
      ValueError: unknown impl, or no pairs.
    """
    if not pairs:
        raise ValueError("lora_factors: no (A, B) pairs")
    ranks = [a.shape[-1] for a, _ in pairs]
    a = jnp.concatenate([a.astype(x.dtype) for a, _ in pairs], axis=-1)
    bs = [(b.astype(jnp.float32) * scale).astype(x.dtype) for _, b in pairs]
    r, rp, rc = _widths(x, pairs, impl)
    a_p = jnp.pad(a, ((0, 0), (0, 0), (0, rp - r)))
    xt = jax.lax.stop_gradient(x) if dx_elsewhere else x
    t = api.grouped_matmul(xt, a_p, group_sizes, impl=_impl_for(impl, x, a_p))
    t = jnp.pad(checkpoint_name(t[:, :r], "lora_t"), ((0, 0), (0, rc - r)))
    placed, lo = [], 0
    for ri, b in zip(ranks, bs):
        placed.append(jnp.pad(b, ((0, 0), (lo, rc - lo - ri), (0, 0))))
        lo += ri
    return t, tuple(placed), jnp.pad(a, ((0, 0), (0, 0), (0, rc - r)))


def grouped_lora_matmuls(x, ws, pairs, group_sizes, *, scale: float, impl: str = "auto",
                         x_adapter=None, in_stacks=None, dw_sinks=None, base_gemm=None):
    """Grouped GEMMs of the same rows x, each with its LoRA adapter:
    y_i = x @ W_i[g] + scale * (x_a @ A_i[g]) @ B_i[g] (Hu et al. 2021, eq. 3, per expert).

    The adapters share one x_a A GEMM (`lora_factors`); each y_i is one grouped GEMM whose
    accumulator also takes t @ B_i' (`grouped_matmul(extra=...)`), so no [M, N_i] adapter term
    is written and added in another pass. Without dropout (x_a is x) the backward likewise
    adds each adapter's dt_i A^T inside dx's GEMM of y_i, not as a GEMM and add of its own.

    Args:
      x: [M, Kd] rows grouped by `group_sizes`; ws: (W_i [E, Kd, N_i], ...);
      pairs: per W_i (A [E, Kd, r], B [E, r, N_i]) or None (no adapter);
      group_sizes: [E] int, sum <= M; scale: alpha / r; impl: as in `grouped_matmul`;
      x_adapter: the adapters' input (x with LoRA dropout), default x;
      in_stacks: None, or per W_i None or (stack, i) (`grouped_matmul(in_stack=...)`);
      dw_sinks: None, or per W_i None or (ref, row) (`grouped_matmul(dw_sink=...)`).
      base_gemm: None (each x @ W_i is `grouped_matmul`, with its adapter term inside), or a
        function (x, W_i, group_sizes[, dw_sink=...]) -> [M, N_i] in x.dtype that computes the
        base GEMMs instead (e.g. `pallas_kernels.fp8.frozen.grouped_gemm`, E4M3 block-scaled):
        the adapters' GEMMs then stay in x's dtype and run beside it; in_stacks must then be
        None, and a W_i's dw_sink goes to base_gemm as its keyword.
    Returns:
      tuple of [M, N_i] in x.dtype, fp32 accumulation. Differentiable in x, x_adapter and
      every W, A, B.
    Raises:
      ValueError: as `grouped_matmul`; base_gemm with in_stacks.
    """
    in_stacks = in_stacks or (None,) * len(ws)
    dw_sinks = dw_sinks or (None,) * len(ws)
    if base_gemm is not None and any(p is not None for p in in_stacks):
        raise ValueError("grouped_lora_matmuls: base_gemm reads no in_stacks")
    live = [i for i, p in enumerate(pairs) if p is not None]
    extras = [None] * len(ws)
    fused = base_gemm is None
    if live:
        xa = x if x_adapter is None else x_adapter
        live_pairs = [pairs[i] for i in live]
        # t's width as lora_factors pads it; a wide one (rank > 64 on gate and up together) does
        # not fit the kernels' shared memory: t B then runs as its own GEMM
        rc = _widths(xa, live_pairs, impl)[2]
        fused = fused and all(api.extra_fits(x, ws[i], rc, impl=impl) for i in live)
        same = fused and xa is x
        t, placed, a = lora_factors(xa, live_pairs, group_sizes, scale=scale, impl=impl,
                                    dx_elsewhere=same)
        for i, b in zip(live, placed):
            extras[i] = (t, b, a) if same else (t, b)
    if base_gemm is not None:
        ys = [base_gemm(x, w, group_sizes) if sk is None else base_gemm(x, w, group_sizes, dw_sink=sk)
              for w, sk in zip(ws, dw_sinks)]
    else:
        ys = [api.grouped_matmul(x, w, group_sizes, impl=impl, in_stack=st, extra=ex if fused else None,
                                 dw_sink=sk)
              for w, st, ex, sk in zip(ws, in_stacks, extras, dw_sinks)]
    if not fused:
        for i in live:
            t, b = extras[i]
            ys[i] = ys[i] + api.grouped_matmul(t, b, group_sizes, impl=_impl_for(impl, t, b))
    return tuple(ys)
