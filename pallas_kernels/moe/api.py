"""Public MoE dispatch API: permute -> grouped GEMM -> weighted combine, each with a custom VJP.

Legend: T tokens, K top-k, D hidden, E experts, M = T*K routed rows, N output width.

Backends (`impl`):
  "reference": pure jnp (reference.py), fp32 accumulation, memory linear in tokens.
  "pallas":    Mosaic GPU grouped GEMMs (mosaic_gpu.py) for forward, dx and dw; on a machine
               without a Hopper GPU they run in GPU interpret mode (slow; for tests). Raises
               ValueError for shapes/dtypes the kernels cannot take.
  "auto":      "pallas" on a Hopper GPU when the shapes fit the kernels, else "reference".
Inside `pallas_kernels._compile_only.hopper_kernels_compile_only()` (memory planning on CPU)
"auto" resolves as on Hopper and the Mosaic kernels compile to shape-only stand-ins
(backend "stand_in"): same outputs, no other buffers, not runnable.
permute: "reference" is a stable argsort + XLA row gather; "pallas" (and "auto" on Hopper) is
a stable counting sort (dispatch.py, same perm) + a Mosaic GPU row-scatter kernel that reads
each token row once and writes its K copies. Its gradient is a K-row gather + fp32 sum per
token (XLA). unpermute is an XLA gather + weighted fp32 row sum in every backend; gradients
are inverse gathers (no scatter-add). The model scales rows by their routing weight before the
down projection (`swiglu(g, u, w)`) and combines with the unweighted `unpermute_sum`.

grouped_matmul(extra=(t, b[, a])): x @ w[g] + t @ b[g] in one kernel (a LoRA adapter's second
factor as one more contraction), and with a, dx = dy @ w^T + (dy @ b^T) @ a^T in one kernel.

gate_up_swiglu: the expert gate/up projection with SwiGLU fused into the Mosaic GPU kernel's
epilogue (weights gate/up interleaved in 64-column blocks); its backward is an XLA SwiGLU
derivative + the dx / dw grouped GEMMs.

Gradients (standard matmul calculus): for y = x @ w[g], dx = dy @ w[g]^T (a grouped GEMM with
transposed weights) and dw[g] = x[rows g]^T @ dy[rows g] (a grouped GEMM whose contraction is
the ragged dimension). For out[t] = sum_k p[t,k] y[slot(t,k)]: dy[slot] = p[t,k] dout[t] and
dp[t,k] = <y[slot(t,k)], dout[t]>.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compile_only
from pallas_kernels._hopper import on_hopper
from pallas_kernels.moe import dispatch, mosaic_gpu
from pallas_kernels.moe.reference import (grouped_matmul_reference,
                                          grouped_matmul_transposed_reference,
                                          inverse_permutation, sort_by_expert)

IMPLS = ("auto", "pallas", "reference")


def _check(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")


def _pallas_fits(x, w, transpose_rhs=False):
    """None if the Mosaic GPU kernels take these operands, else the reason."""
    try:
        mosaic_gpu.check_dtypes(x, w)
        n = w.shape[1] if transpose_rhs else w.shape[2]
        kc = x.shape[1]
        mosaic_gpu.pick_tile_n(n)
        mosaic_gpu.pick_tile_n(kc)  # dx of the forward GEMM has width kc
        if kc % 64:
            raise ValueError(f"contraction width {kc} must be a multiple of 64")
        if x.shape[0] < mosaic_gpu.TileConfig().tile_m:
            raise ValueError(f"{x.shape[0]} rows < tile_m")
    except ValueError as err:
        return str(err)
    return None


def _kernel_backend():
    """"stand_in" while planning with compile-only kernels, else "pallas"."""
    return "stand_in" if _compile_only.active() else "pallas"


def _hopper():
    return _compile_only.active() or on_hopper()


def _extra_fits(x, w, extra, out_dtype=None):
    """None if the Mosaic GPU kernels take grouped_matmul's extra contraction (t, b[, a]) beside
    x @ w (and, with a, in dx's GEMM: output width Kd, transposed), else the reason."""
    if not extra:
        return None
    if any(p.dtype != x.dtype for p in extra):
        return f"extra: {[str(p.dtype) for p in extra]} must be x's dtype {x.dtype}"
    r = extra[0].shape[1]
    reason = mosaic_gpu.extra_fits(w.shape[2], r, x.dtype, out_dtype=out_dtype)
    if reason is None and len(extra) == 3:
        reason = mosaic_gpu.extra_fits(w.shape[1], r, x.dtype, transpose_rhs=True)
    return None if reason is None else f"extra: {reason}"


def _resolve(impl, x, w, extra=(), out_dtype=None):
    _check(impl)
    if impl == "reference":
        return "reference"
    reason = _pallas_fits(x, w) or _extra_fits(x, w, extra, out_dtype)
    if impl == "pallas":
        if reason:
            raise ValueError(f"impl='pallas': {reason}")
        return _kernel_backend()
    return _kernel_backend() if (reason is None and _hopper()) else "reference"


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


# ----------------------------------------------------------------------------- grouped GEMM

def _gmm_backend(backend, x, w, gs, out_dtype, transpose_rhs=False, src=(), extra=()):
    """x @ w[g] (or w[g]^T), plus t @ b[g] for extra = (t, b) (same orientation as w, summed
    in the fp32 accumulator); src = (stack [L*E, ...], offset int32 []) where w = the stack's
    groups [offset, offset + E): the kernels (and the stand-in) read the stack, not w."""
    if backend == "stand_in":
        n = w.shape[1] if transpose_rhs else w.shape[2]
        return _compile_only.stand_in(jax.ShapeDtypeStruct((x.shape[0], n), out_dtype), x,
                                      *(src or (w,)), gs, *extra)
    if backend == "pallas":
        kw = dict(transpose_rhs=transpose_rhs, out_dtype=out_dtype, extra=tuple(extra) or None)
        if src:
            return mosaic_gpu.gmm(x, src[0], gs, group_offset=src[1], **kw)
        return mosaic_gpu.gmm(x, w, gs, **kw)
    orient = (lambda a: jnp.swapaxes(a, 1, 2)) if transpose_rhs else (lambda a: a)
    if not extra:
        return grouped_matmul_reference(x, orient(w), gs, preferred_element_type=out_dtype)
    t, b = extra
    out = (grouped_matmul_reference(x, orient(w), gs, preferred_element_type=jnp.float32)
           + grouped_matmul_reference(t, orient(b), gs, preferred_element_type=jnp.float32))
    return out.astype(out_dtype)


def _extra_dt(backend, g, b, gs, t_dtype):
    """dt = g @ b[g]^T [M, R] for gmm's extra (t, b): the kernels' output width is a multiple of
    128, so b's rows are zero-padded up to one and the extra columns of dt dropped."""
    r = b.shape[1]
    rk = -(-r // 128) * 128
    if backend != "pallas" or rk == r:
        return _gmm_backend(backend, g, b, gs, t_dtype, transpose_rhs=True)
    b = jnp.pad(b, ((0, 0), (0, rk - r), (0, 0)))
    return _gmm_backend(backend, g, b, gs, t_dtype, transpose_rhs=True)[:, :r]


def _tgmm_backend(backend, x, dy, gs, out_dtype):
    if backend == "stand_in":
        shape = (gs.shape[0], x.shape[1], dy.shape[1])
        return _compile_only.stand_in(jax.ShapeDtypeStruct(shape, out_dtype), x, dy, gs)
    if backend == "pallas":
        return mosaic_gpu.tgmm(x, dy, gs, out_dtype=out_dtype)
    return grouped_matmul_transposed_reference(x, dy, gs, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gmm(x, w, gs, src, extra, out_dtype, backend):
    return _gmm_backend(backend, x, w, gs, out_dtype, src=src, extra=extra[:2])


def _gmm_fwd(x, w, gs, src, extra, out_dtype, backend):
    # symbolic zeros: each argument comes as a CustomVJPPrimal (value, perturbed). x is kept only
    # when w trains (frozen expert weights under LoRA need dx alone); x[:0] carries x's dtype,
    # and a second x[:0] (None when x does not train) says whether dx is wanted.
    # With src, w's value is read by nothing (XLA then drops the slice that made it): the
    # forward and dx read the stack, and w only receives its gradient. extra (t, b[, a]):
    # res holds t when b trains, t[:0] when t trains (its dtype; None: no dt wanted), b always
    # (for dt, and db's dtype), and a (for dx).
    x_trains, w_trains = x.perturbed, w.perturbed
    t_trains, b_trains = (extra[0].perturbed, extra[1].perturbed) if extra else (False, False)
    x, w, gs = x.value, w.value, gs.value
    src, extra = tuple(p.value for p in src), tuple(p.value for p in extra)
    ex = ()
    if extra:
        t = extra[0]
        ex = (t if b_trains else None, t[:0] if t_trains else None) + extra[1:]
    res = (w[:0] if src else w, gs, src, x[:0], x[:0] if x_trains else None,
           x if w_trains else None, ex)
    return _gmm(x, w, gs, src, extra, out_dtype, backend), res


def _tie(anchor, grads, sources):
    """Tie each weight gradient that is under half the size of its sources (the x or t and the
    dy it came from) to `anchor` by one optimization barrier. Such a gradient feeds nothing
    until the optimizer, so XLA may schedule it at the very end of the backward and keep every
    layer's sources alive until then (unrolled layers: ~5 GB of [T*K, D] cotangents at the
    V2-Lite LoRA step's peak); tied, it runs in its layer's backward. A base expert weight's
    dw is as large as its x and dy, and tying it cost memory (+0.8 GB on the H200's 4-layer
    full-training step), so XLA keeps its own order there."""
    small = [i for i, (d, s) in enumerate(zip(grads, sources))
             if d is not None and 2 * d.size < s]
    if anchor is None or not small:
        return anchor, grads
    anchor, tied = jax.lax.optimization_barrier((anchor, [grads[i] for i in small]))
    grads = list(grads)
    for i, d in zip(small, tied):
        grads[i] = d
    return anchor, grads


def _gmm_bwd(out_dtype, backend, res, g):
    w, gs, src, x_meta, dx_wanted, x, ex = res
    nothing = (None,) * len(src)
    n_extra = len(ex) - 1 if ex else 0  # ex holds t's dtype carrier besides the inputs
    ex_nothing = (None,) * n_extra
    if isinstance(g, jax.custom_derivatives.SymbolicZero):  # the output is unused
        return None, None, None, nothing, ex_nothing
    x_dt = x_meta.dtype
    if backend != "reference":
        g = g.astype(x_dt)
    dx = dw = dt = db = None
    dx_extra = ()
    if ex:
        t, t_meta, b = ex[:3]
        a = ex[3] if len(ex) == 4 else None
        via_dx = a is not None and dx_wanted is not None  # t = x a, x's gradient stopped there
        if t_meta is not None or via_dx:
            dt = _extra_dt(backend, g, b, gs, (b if t_meta is None else t_meta).dtype)
        if t is not None:
            db = _tgmm_backend(backend, t, g, gs, b.dtype)
        if via_dx:  # that GEMM's dx, dt a^T, joins dx's GEMM
            dx_extra = (dt.astype(x_dt), a)
        if t_meta is None:
            dt = None
    if dx_wanted is not None:
        dx = _gmm_backend(backend, g, w, gs, x_dt, transpose_rhs=True, src=src, extra=dx_extra)
    if x is not None:
        dw = _tgmm_backend(backend, x, g, gs, w.dtype)
    sources = (x.size + g.size if x is not None else 0, t.size + g.size if db is not None else 0)
    anchor, (dw, db) = _tie(dx if dx is not None else dt, (dw, db), sources)
    if dx is not None:
        dx = anchor
    else:
        dt = anchor
    return dx, dw, None, nothing, (dt, db, None)[:n_extra]


_gmm.defvjp(_gmm_fwd, _gmm_bwd, symbolic_zeros=True)


def extra_fits(x, w, r, *, impl="auto"):
    """True when `grouped_matmul(x, w, ..., extra=(t, b, a))` with t [M, r] runs on the backend
    that x @ w alone would take (the kernels, or the reference), in the forward and in dx's
    GEMM; False when the kernels would take x @ w but not the extra (r too wide for their
    shared memory, or not a multiple of 64)."""
    _check(impl)
    kernels = impl == "pallas" or (impl == "auto" and _hopper())
    if impl == "reference" or not kernels or _pallas_fits(x, w) is not None:
        return True
    return (mosaic_gpu.extra_fits(w.shape[2], r, x.dtype) is None
            and mosaic_gpu.extra_fits(w.shape[1], r, x.dtype, transpose_rhs=True) is None)


def grouped_matmul(x, w, group_sizes, *, impl="auto", preferred_element_type=None, in_stack=None,
                   extra=None):
    """Grouped GEMM over consecutive row groups: out[i] = x[i] @ w[g(i)] (+ t[i] @ b[g(i)]).

    Args:
      x: [M, Kd]; w: [E, Kd, N] (same dtype for "pallas": bf16 or f16);
      group_sizes: [E] int, sum <= M; rows past the sum give zeros.
      preferred_element_type: output dtype (default x.dtype); accumulation is always fp32.
      in_stack: None, or (stack, i) where w == stack[i], stack [L, E, Kd, N] in w's dtype and i
        a Python int: the Mosaic GPU kernels then read layer i of the stack in place, in the
        forward and for dx, so no copy of w is made for them (unrolled layers slice each
        layer's weights out of their stack; XLA copies a slice that a kernel reads). w's value
        is then unused and w still receives the gradient; the stack gets none through this
        call. The reference backend reads w.
      extra: None, or (t [M, R], b [E, R, N]) or (t, b, a [E, Kd, R]): t[i] @ b[g(i)] is
        added in the same fp32 accumulator (a LoRA adapter's second factor: no [M, N] product
        written and added in another pass). With a, where t = x @ a was computed with x's
        gradient stopped, dx also takes that path's term dt @ a^T inside dx's GEMM (the
        adapter's whole input gradient without an [M, Kd] product and add); a gets no
        gradient here (its own GEMM gives da = x^T dt). For the kernels, t, b, a are in x's
        dtype and R is a multiple of 64 small enough for shared memory (`extra_fits`; 128 at
        V2-Lite's widths); otherwise "auto" runs the reference.
    Returns:
      [M, N]. Differentiable in x, w, t and b (custom VJP: dx by a grouped GEMM with transposed
      weights, dw by a ragged-contraction grouped GEMM, computed only when w is differentiated;
      dt = dy b^T and db = t^T dy likewise; a weight gradient under half the size of its
      sources is tied to dx (or dt) by an optimization barrier); group_sizes gets no gradient.
    Raises:
      ValueError: unknown impl, impl="pallas" with shapes/dtypes the kernels cannot take
      (N and Kd multiples of 128, M >= 128), an in_stack whose layer is not w's shape and
      dtype or whose i is outside [0, L), or an extra whose shapes do not fit x and w.
    """
    extra = tuple(extra) if extra is not None else ()
    if extra:
        t, b = extra[:2]
        e, kd, n = w.shape
        r = t.shape[-1]
        a_bad = len(extra) == 3 and extra[2].shape != (e, kd, r)
        if (len(extra) > 3 or t.ndim != 2 or t.shape[0] != x.shape[0] or b.shape != (e, r, n)
                or a_bad):
            raise ValueError(f"extra: {[list(p.shape) for p in extra]} do not fit x {list(x.shape)} "
                             f"and w {list(w.shape)} (want t [M, R], b [E, R, N], a [E, Kd, R])")
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    backend = _resolve(impl, x, w, extra, out_dtype)
    src = ()
    if in_stack is not None:
        stack, i = in_stack
        if stack.shape[1:] != w.shape or stack.dtype != w.dtype or not 0 <= i < stack.shape[0]:
            raise ValueError(f"in_stack: layer {i} of {stack.dtype}{list(stack.shape)} is not w "
                             f"{w.dtype}{list(w.shape)}")
        if backend != "reference":
            e = w.shape[0]
            src = (stack.reshape(-1, *w.shape[1:]), jnp.asarray(i * e, jnp.int32))
    return _gmm(x, w, group_sizes.astype(jnp.int32), src, extra, out_dtype, backend)


# ----------------------------------------------------------------------------- fused gate/up + SwiGLU

def _swiglu_from_h(h, out_dtype):
    """h [M, 2I] gate/up interleaved (`interleave_gate_up`) -> silu(gate) * up (fp32 math)."""
    g, u = mosaic_gpu.deinterleave_gate_up(h.astype(jnp.float32))
    return (jax.nn.silu(g) * u).astype(out_dtype)


def _swiglu_forward(x, w, gs, backend, return_h):
    if backend == "stand_in":
        m, n = x.shape[0], w.shape[2]
        act = jax.ShapeDtypeStruct((m, n // 2), x.dtype)
        out = (act, jax.ShapeDtypeStruct((m, n), x.dtype)) if return_h else act
        return _compile_only.stand_in(out, x, w, gs)
    if backend == "pallas":
        return mosaic_gpu.gmm(x, w, gs, epilogue="swiglu", return_h=return_h)
    h = grouped_matmul_reference(x, w, gs, preferred_element_type=jnp.float32)
    act = _swiglu_from_h(h, x.dtype)
    return (act, h.astype(x.dtype)) if return_h else act


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gate_up_swiglu(x, w, gs, backend):
    return _swiglu_forward(x, w, gs, backend, False)


def _gate_up_swiglu_fwd(x, w, gs, backend):
    act, h = _swiglu_forward(x, w, gs, backend, True)
    return act, (x, w, gs, h)


def swiglu_backward_interleaved(h, da, block=None):
    """dh of act = silu(gate) * up with h [M, 2I] gate/up interleaved in `block` columns.

    One elementwise pass over h viewed as [M, I/block, 2, block] (no slicing/concatenation,
    so XLA emits a single fusion reading h and da once and writing dh once), fp32 math:
    d/dgate = da * up * s (1 + gate (1 - s)), d/dup = da * silu(gate), s = sigmoid(gate).
    Returns dh [M, 2I] in h.dtype, same interleaved layout.
    """
    block = block or mosaic_gpu.swiglu_block()
    m, n = h.shape
    hb = h.reshape(m, n // (2 * block), 2, block).astype(jnp.float32)
    g, u = hb[:, :, :1, :], hb[:, :, 1:, :]
    d = da.reshape(m, n // (2 * block), 1, block).astype(jnp.float32)
    sg = jax.nn.sigmoid(g)
    first = jax.lax.broadcasted_iota(jnp.int32, hb.shape, 2) == 0
    dh = jnp.where(first, d * u * sg * (1.0 + g * (1.0 - sg)), d * g * sg)
    return dh.reshape(m, n).astype(h.dtype)


def _gate_up_swiglu_bwd(backend, res, da):
    x, w, gs, h = res
    dh = swiglu_backward_interleaved(h, da).astype(x.dtype)
    dx = _gmm_backend(backend, dh, w, gs, x.dtype, transpose_rhs=True)
    dw = _tgmm_backend(backend, x, dh, gs, w.dtype)
    return dx, dw, None


_gate_up_swiglu.defvjp(_gate_up_swiglu_fwd, _gate_up_swiglu_bwd)


def gate_up_swiglu(x, w_gate_up, group_sizes, *, impl="auto"):
    """Fused expert gate/up projection and SwiGLU: silu(x @ Wg[g]) * (x @ Wu[g]) per row.

    Args:
      x: [M, D] rows sorted by group; w_gate_up: [E, D, 2I] with gate and up columns
        interleaved in blocks of `mosaic_gpu.swiglu_block()` (64 under the default config):
        `mosaic_gpu.interleave_gate_up` of [Wg | Wu], for every impl;
        group_sizes: [E] int, sum <= M (rows past the sum give zeros).
    Returns:
      [M, I] in x.dtype. "pallas": one Mosaic GPU kernel computes both halves of a CTA tile
      and applies SwiGLU to the fp32 accumulators (the [M, 2I] pre-activation is written only
      under differentiation, as the backward's residual); "reference": jnp, fp32.
      Differentiable in x and w_gate_up (the SwiGLU backward is XLA; dx/dw grouped GEMMs).
    Raises:
      ValueError: unknown impl, 2I not a multiple of 256 (any impl), or impl="pallas" with
      shapes the kernels cannot take (D a multiple of 128, M >= 128, bf16/f16).
    """
    if w_gate_up.shape[-1] % 256:
        raise ValueError(f"gate|up width {w_gate_up.shape[-1]} is not a multiple of 256")
    backend = _resolve(impl, x, w_gate_up)
    return _gate_up_swiglu(x, w_gate_up, group_sizes.astype(jnp.int32), backend)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _sum_rows(y, perm, k):
    return _sum_copies(y, perm, k)


def _sum_rows_fwd(y, perm, k):
    return _sum_copies(y, perm, k), perm


def _sum_rows_bwd(k, perm, g):
    return jnp.take(g, perm // k, axis=0), None


_sum_rows.defvjp(_sum_rows_fwd, _sum_rows_bwd)


@jax.custom_vjp
def _slot_values(p_flat, perm):
    return jnp.take(p_flat, perm)


def _slot_values_fwd(p_flat, perm):
    return jnp.take(p_flat, perm), perm


def _slot_values_bwd(perm, g):
    return jnp.zeros_like(g).at[perm].set(g, unique_indices=True), None


_slot_values.defvjp(_slot_values_fwd, _slot_values_bwd)


def sorted_weights(topk_weights, perm):
    """Each sorted row's routing weight: w[i] = topk_weights.flat[perm[i]].

    Args:
      topk_weights: [T, K] float; perm: [T*K] int32 from `permute` (a permutation).
    Returns:
      [T*K] in topk_weights.dtype. The gradient goes back by one scatter with unique indices
      (plain stores): autodiff of the gather would scatter-add with atomics (0.26 ms per
      V2-Lite layer on the H200, for 49152 values).
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
      [T, N] in y.dtype, summed in fp32. Gradient: dy[i] = dout[perm[i] // K] (a row gather).
    """
    _check(impl)
    return _sum_rows(y, perm, k)


def _swiglu_grads(g, u, da):
    """fp32 (d/dg, d/du, silu(g) * u) of silu(g) * u for the fp32 cotangent da."""
    g32, u32 = g.astype(jnp.float32), u.astype(jnp.float32)
    sg = jax.nn.sigmoid(g32)
    silu = g32 * sg
    return da * u32 * sg * (1.0 + g32 * (1.0 - sg)), da * silu, silu * u32


def _swiglu_value(g, u, w=None):
    """silu(g) * u (* w[..., None]) in fp32, rounded to g.dtype."""
    h = jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)
    return (h if w is None else h * w.astype(jnp.float32)[..., None]).astype(g.dtype)


@jax.custom_vjp
def _swiglu(g, u):
    return _swiglu_value(g, u)


def _swiglu_fwd(g, u):
    return _swiglu(g, u), (g, u)


def _swiglu_bwd(res, dh):
    g, u = res
    dg, du, _ = _swiglu_grads(g, u, dh.astype(jnp.float32))
    return dg.astype(g.dtype), du.astype(u.dtype)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def _swiglu_weighted(g, u, w):
    return _swiglu_value(g, u, w)


def _swiglu_weighted_fwd(g, u, w):
    return _swiglu_weighted(g, u, w), (g, u, w)


def _swiglu_weighted_bwd(res, dh):
    g, u, w = res
    d = dh.astype(jnp.float32)
    dg, du, a = _swiglu_grads(g, u, d * w.astype(jnp.float32)[..., None])
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
