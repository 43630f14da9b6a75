"""MoE token routing: permute tokens to expert-sorted rows, combine rows back, SwiGLU.

Legend: T tokens, K top-k, D hidden, E experts, M = T*K routed rows, N output width.

Backends (`impl`) as in `pallas_kernels.moe.api`: "reference" (pure jnp), "pallas" (Mosaic GPU
row kernels, GPU interpret mode off Hopper; raises ValueError for shapes they cannot take),
"auto" ("pallas" on a Hopper GPU when the shapes fit, else "reference"); "stand_in" while
planning with compile-only kernels.

permute: "reference" is a stable argsort + XLA row gather; "pallas" (and "auto" on Hopper) is
a stable counting sort (dispatch.py, same perm) + a Mosaic GPU row-scatter kernel that reads
each token row once and writes its K copies. Its gradient is a K-row gather + fp32 sum per
token (XLA). unpermute is an XLA gather + weighted fp32 row sum in every backend; gradients
are gathers and unique-index scatters (no scatter-add), and unpermute_sum's is permute's row
kernel where it runs. The model scales rows by their routing weight before the down
projection (`swiglu(g, u, w)`) and combines with the unweighted `unpermute_sum`.

Gradients: for out[t] = sum_k p[t,k] y[slot(t,k)]: dy[slot] = p[t,k] dout[t] and
dp[t,k] = <y[slot(t,k)], dout[t]>.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compile_only
from pallas_kernels._hopper import on_hopper
from pallas_kernels.moe import dispatch
from pallas_kernels.moe.reference import inverse_permutation, sort_by_expert

IMPLS = ("auto", "pallas", "reference")


def _check(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")


def _kernel_backend():
    """"stand_in" while planning with compile-only kernels, else "pallas"."""
    return "stand_in" if _compile_only.active() else "pallas"


def _hopper():
    return _compile_only.active() or on_hopper()


# ----------------------------------------------------------------------------- permute

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_rows(x, perm, k):
    return jnp.take(x, perm // k, axis=0)


def _gather_rows_fwd(x, perm, k):
    return _gather_rows(x, perm, k), perm


def _sum_copies(y, perm, k):
    """y [T*K, N] sorted rows -> [T, N]: each token's K copies summed in fp32 (y.dtype out)."""
    inv = inverse_permutation(perm)
    t = perm.shape[0] // k
    return jnp.take(y, inv, axis=0).reshape(t, k, -1).astype(jnp.float32).sum(axis=1).astype(y.dtype)


def _gather_rows_bwd(k, perm, g):
    return _sum_copies(g, perm, k), None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scatter_rows(x, dest, stand_in=False):
    if stand_in:
        t, k = dest.shape
        return _compile_only.stand_in(jax.ShapeDtypeStruct((t * k, x.shape[1]), x.dtype), x, dest)
    return dispatch.scatter_rows(x, dest)


def _scatter_rows_fwd(x, dest, stand_in=False):
    return _scatter_rows(x, dest, stand_in), dest


def _scatter_rows_bwd(stand_in, dest, g):
    return dispatch.gather_back(g, dest), None


_scatter_rows.defvjp(_scatter_rows_fwd, _scatter_rows_bwd)


def _permute_backend(impl, x, k):
    if impl == "reference":
        return "reference"
    reason = dispatch.scatter_rows_fits(x, k)
    if impl == "pallas":
        if reason:
            raise ValueError(f"impl='pallas': {reason}")
        return _kernel_backend()
    return _kernel_backend() if (reason is None and _hopper()) else "reference"


def permute(x, topk_ids, *, num_experts, impl="auto"):
    """Sort token copies by expert (dropless).

    Args:
      x: [T, D] any float dtype; topk_ids: [T, K] int in [0, num_experts).
      num_experts: E (<= 256 tested); impl: "auto" | "pallas" | "reference".
    Returns:
      x_sorted [T*K, D] (x.dtype; rows grouped by expert, stable within an expert),
      group_sizes [E] int32, perm [T*K] int32 (sorted row i is routed slot perm[i] = t*K + k).
      Differentiable in x: dx[t] = sum_k dx_sorted[slot(t, k)] (fp32 sum).
      "pallas"/"auto" on Hopper: `dispatch.counting_sort_by_expert` and the Mosaic GPU row
      kernel `dispatch.scatter_rows` (bit-identical to "reference"); "pallas" raises
      ValueError when a row is not a multiple of 128 bytes.
    """
    _check(impl)
    t, k = topk_ids.shape
    backend = _permute_backend(impl, x, k)
    if backend != "reference":
        group_sizes, perm, dest = dispatch.counting_sort_by_expert(topk_ids, num_experts)
        return _scatter_rows(x, dest, backend == "stand_in"), group_sizes, perm
    group_sizes, perm = sort_by_expert(topk_ids, num_experts)
    return _gather_rows(x, perm, k), group_sizes, perm


# ----------------------------------------------------------------------------- unpermute

@jax.custom_vjp
def _combine(y, perm, p):
    t, k = p.shape
    inv = inverse_permutation(perm)
    y_tok = jnp.take(y, inv, axis=0).reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkn,tk->tn", y_tok, p.astype(jnp.float32)).astype(y.dtype)


def _combine_fwd(y, perm, p):
    return _combine(y, perm, p), (y, perm, p)


def _combine_bwd(res, g):
    y, perm, p = res
    t, k = p.shape
    g32 = g.astype(jnp.float32)
    scale = jnp.take(p.reshape(-1).astype(jnp.float32), perm)
    dy = (jnp.take(g32, perm // k, axis=0) * scale[:, None]).astype(y.dtype)
    inv = inverse_permutation(perm)
    y_tok = jnp.take(y, inv, axis=0).reshape(t, k, -1).astype(jnp.float32)
    dp = jnp.einsum("tkn,tn->tk", y_tok, g32).astype(p.dtype)
    return dy, None, dp


_combine.defvjp(_combine_fwd, _combine_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _sum_rows(y, perm, k, backend):
    return _sum_copies(y, perm, k)


def _sum_rows_fwd(y, perm, k, backend):
    return _sum_copies(y, perm, k), perm


def _sum_rows_bwd(k, backend, perm, g):
    if backend == "reference":
        return jnp.take(g, perm // k, axis=0), None
    # dy[i] = g[perm[i] // K] is permute's row copy: token t to the sorted rows dest[t, :]
    dest = inverse_permutation(perm).reshape(-1, k)
    return _scatter_rows(g, dest, backend == "stand_in"), None


_sum_rows.defvjp(_sum_rows_fwd, _sum_rows_bwd)


@jax.custom_vjp
def _slot_values(p_flat, perm):
    return jnp.take(p_flat, perm)


def _slot_values_fwd(p_flat, perm):
    return jnp.take(p_flat, perm), perm


def _slot_values_bwd(perm, g):
    # g arrives as the row sums of the SwiGLU backward; the barrier keeps that reduction out of
    # the scatter's fusion, where each row's sum would run in one thread
    g = jax.lax.optimization_barrier(g)
    return jnp.zeros_like(g).at[perm].set(g, unique_indices=True), None


_slot_values.defvjp(_slot_values_fwd, _slot_values_bwd)


def sorted_weights(topk_weights, perm):
    """Each sorted row's routing weight: w[i] = topk_weights.flat[perm[i]].

    Args:
      topk_weights: [T, K] float; perm: [T*K] int32 from `permute` (a permutation).
    Returns:
      [T*K] in topk_weights.dtype. The gradient goes back by one scatter with unique indices
      (plain stores) of a materialised cotangent: autodiff of the gather would scatter-add with
      atomics (0.26 ms per V2-Lite layer on the H200, for 49152 values), and a scatter that
      fuses the SwiGLU backward's row sums computes each row in one thread (0.21 ms).
    """
    t, k = topk_weights.shape
    return _slot_values(topk_weights.reshape(t * k), perm)


def unpermute_sum(y, perm, k, *, impl="auto"):
    """Unweighted combine back to token order: out[t] = sum_k y[slot(t, k)].

    For rows already scaled by their routing weight (`swiglu(g, u, w)` before the down
    projection: (w h) W = w (h W) row by row), so the backward keeps only `perm`, not y.

    Args:
      y: [T*K, N] rows sorted by expert; perm: [T*K] int32 from `permute`; k: K.
    Returns:
      [T, N] in y.dtype, summed in fp32. Gradient: dy[i] = dout[perm[i] // K], the row copy of
      `permute`: the `dispatch.scatter_rows` kernel (each dout row read once) where permute's
      "pallas"/"auto" would run it for dout, else an XLA row gather (never raises).
    """
    _check(impl)
    backend = "reference"
    if impl != "reference" and (impl == "pallas" or _hopper()):
        fits = dispatch.scatter_rows_fits(jax.ShapeDtypeStruct((perm.shape[0] // k, y.shape[1]), y.dtype), k)
        backend = _kernel_backend() if fits is None else "reference"
    return _sum_rows(y, perm, k, backend)


def swiglu_grads(g, u, da):
    """fp32 (d/dg, d/du, silu(g) * u) of silu(g) * u for the fp32 cotangent da; g, u, da
    [..., F] (g, u any float dtype)."""
    g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
    sg = jax.nn.sigmoid(g32)
    silu = g32 * sg
    return da * u32 * sg * (1.0 + g32 * (1.0 - sg)), da * silu, silu * u32


def swiglu_value(g, u, w=None):
    """silu(g) * u (* w[..., None]) in fp32, rounded to g.dtype; g, u [..., F], w None or [...]."""
    h = jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)
    return (h if w is None else h * w.astype(jnp.float32)[..., None]).astype(g.dtype)


@jax.custom_vjp
def _swiglu(g, u):
    return swiglu_value(g, u)


def _swiglu_fwd(g, u):
    return _swiglu(g, u), (g, u)


def _swiglu_bwd(res, dh):
    g, u = res
    dg, du, _ = swiglu_grads(g, u, dh.astype(jnp.float32))
    return dg.astype(g.dtype), du.astype(u.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def _swiglu_weighted(g, u, w):
    return swiglu_value(g, u, w)


def _swiglu_weighted_fwd(g, u, w):
    return _swiglu_weighted(g, u, w), (g, u, w)


def _swiglu_weighted_bwd(res, dh):
    g, u, w = res
    d = dh.astype(jnp.float32)
    dg, du, a = swiglu_grads(g, u, d * w.astype(jnp.float32)[..., None])
    return dg.astype(g.dtype), du.astype(u.dtype), jnp.sum(d * a, axis=-1).astype(w.dtype)


_swiglu_weighted.defvjp(_swiglu_weighted_fwd, _swiglu_weighted_bwd)


def swiglu(g, u, w=None):
    """SwiGLU of gate and up projections, optionally scaled per row: h = silu(g) * u (* w[..., None]).

    With w, the routed experts' rows carry their routing weight into the down projection: exact
    in real arithmetic ((w h) W = w (h W)), so the combine is `unpermute_sum` and no [T*K, D]
    expert output is kept for the weights' gradient, which is dw = sum_n dh * silu(g) * u.

    Args:
      g, u: [..., F] gate / up projections (any float dtype); w: None or [...] routing weight of
        each row (`sorted_weights(topk_weights, perm)`), any float dtype.
    Returns:
      h [..., F] in g.dtype, fp32 math. Custom VJP whose only residuals are g, u (and w):
      d/dg = dh w u s (1 + g (1 - s)), d/du = dh w silu(g), s = sigmoid(g); gradients in the
      inputs' dtypes. Autodiff of the formula would also keep sigmoid(g) and silu(g).
    """
    return _swiglu(g, u) if w is None else _swiglu_weighted(g, u, w)


def unpermute(y, perm, topk_weights, *, impl="auto"):
    """Weighted combine back to token order: out[t] = sum_k w[t, k] * y[slot(t, k)].

    Args:
      y: [T*K, N] rows sorted by expert; perm: [T*K] int32 from `permute`;
      topk_weights: [T, K] routing weights (any float dtype).
    Returns:
      [T, N] in y.dtype, summed in fp32. Differentiable in y and topk_weights.
    """
    _check(impl)
    return _combine(y, perm, topk_weights)
