"""Public MoE dispatch API: permute -> grouped GEMM -> weighted combine, each with a custom VJP.

This module holds the grouped GEMMs; permute, unpermute, unpermute_sum, sorted_weights and
swiglu live in routing.py (all exported by `pallas_kernels.moe`).

Legend: T tokens, K top-k, D hidden, E experts, M = T*K routed rows, N output width.

Backends (`impl`):
  "reference": pure jnp (reference.py), fp32 accumulation, memory linear in tokens.
  "pallas":    Mosaic GPU grouped GEMMs (mosaic_gpu.py for forward and dx, mosaic_tgmm.py for
               dw); on a machine without a Hopper GPU they run in GPU interpret mode (slow; for
               tests). Raises ValueError for shapes/dtypes the kernels cannot take.
  "auto":      "pallas" on a Hopper GPU when the shapes fit the kernels, else "reference".
Inside `pallas_kernels._compile_only.hopper_kernels_compile_only()` (memory planning on CPU)
"auto" resolves as on Hopper and the Mosaic kernels compile to shape-only stand-ins
(backend "stand_in"): same outputs, no other buffers, not runnable.

grouped_matmul(extra=(t, b[, a])): x @ w[g] + t @ b[g] in one kernel (a LoRA adapter's second
factor as one more contraction), and with a, dx = dy @ w^T + (dy @ b^T) @ a^T in one kernel.

gate_up_swiglu: the expert gate/up projection with SwiGLU fused into the Mosaic GPU kernel's
epilogue (weights gate/up interleaved in 64-column blocks); its backward is an XLA SwiGLU
derivative + the dx / dw grouped GEMMs.

Gradients (standard matmul calculus): for y = x @ w[g], dx = dy @ w[g]^T (a grouped GEMM with
transposed weights) and dw[g] = x[rows g]^T @ dy[rows g] (a grouped GEMM whose contraction is
the ragged dimension).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _compile_only
from pallas_kernels.moe import mosaic_gpu, mosaic_tgmm
from pallas_kernels.moe.reference import grouped_matmul_reference, grouped_matmul_transposed_reference
from pallas_kernels.moe.routing import _check, _hopper, _kernel_backend


def pallas_unsupported(x, w, transpose_rhs=False):
    """None if the Mosaic GPU kernels take x [M, K] @ w [E, K, N] (w [E, N, K] with
    transpose_rhs; arrays or `jax.ShapeDtypeStruct`s) forward and backward, else the reason in
    one line: one dtype, bf16 or fp16; K and N multiples of 128. Any M: fewer rows than the row
    tile are padded to it (`_padded_rows`)."""
    try:
        mosaic_gpu.check_dtypes(x, w)
        n = w.shape[1] if transpose_rhs else w.shape[2]
        kc = x.shape[1]
        mosaic_gpu.pick_tile_n(n)
        mosaic_gpu.pick_tile_n(kc)  # dx of the forward GEMM has width kc
        if kc % 64:
            raise ValueError(f"contraction width {kc} must be a multiple of 64")
    except ValueError as err:
        return str(err)
    return None


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


def _padded_rows(backend, arrays):
    """For the kernels (backend not "reference"): arrays of M < tile_m rows ([M, ...] each)
    padded with zero rows to tile_m, and M; else (arrays, None). The padded rows lie past
    sum(group_sizes), so the kernels give them zeros and they add nothing to a weight gradient:
    a decode step's few routed rows (6 per token) read only the experts they route to, where the
    reference's per-tile loop would read every expert's weights."""
    m = arrays[0].shape[0]
    tile = mosaic_gpu.TileConfig().tile_m
    if backend == "reference" or m >= tile:
        return arrays, None
    return tuple(jnp.pad(a, ((0, tile - m),) + ((0, 0),) * (a.ndim - 1)) for a in arrays), m


def _resolve(impl, x, w, extra=(), out_dtype=None):
    _check(impl)
    if impl == "reference":
        return "reference"
    reason = pallas_unsupported(x, w) or _extra_fits(x, w, extra, out_dtype)
    if impl == "pallas":
        if reason:
            raise ValueError(f"impl='pallas': {reason}")
        return _kernel_backend()
    return _kernel_backend() if (reason is None and _hopper()) else "reference"


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


def dw_sq_shape(w_shape, dtype) -> tuple[int, int, int]:
    """Shape of the fp32 ref that `grouped_matmul(dw_sink=(ref, row, sq))` fills with the
    partial sums of squares of a weight gradient [G, Kd, N] (`w_shape`) in `dtype`:
    [G, N // tn, Kd], tn the dW kernel's column tile where the kernel takes the widths, else
    [G, 1, Kd]."""
    g, kd, n = w_shape
    try:
        tn = mosaic_tgmm.sq_tile_n(kd, n, dtype)
    except ValueError:
        tn = n
    return g, n // tn, kd


def _tgmm_into(backend, x, dy, gs, sink):
    """dw = x^T dy per group (as `_tgmm_backend`) written into sink = (ref [G, Kx, N], row int32
    [][, sq fp32 `dw_sq_shape`]) at rows row .. row + E: in place by the kernel, by a dynamic
    update of the ref otherwise (`store_dw`); sq gets dw's partial sums of squares at the same
    rows."""
    ref, row, *sq = sink
    if backend == "pallas":
        mosaic_tgmm.tgmm(x, dy, gs, out=ref, out_row=row, sq_out=sq[0] if sq else None)
        return
    store_dw(sink, _tgmm_backend(backend, x, dy, gs, ref.dtype))


def store_dw(sink, dw):
    """Write dw [E, Kx, N] (in the ref's dtype) into sink = (ref [G, Kx, N], row int32 [][, sq
    fp32 `dw_sq_shape`]) at rows row .. row + E by a dynamic update of the ref (XLA updates it
    in place), and sq's rows there with dw's partial sums of squares: sq[row + e, j, k] = the
    sum over columns j N / J .. (j + 1) N / J of dw[e, k, :] ** 2 (J = sq.shape[1]), as the dW
    kernels' epilogues write them. The sink as `check_dw_sink` returns it."""
    ref, row, *sq = sink
    ref[...] = jax.lax.dynamic_update_slice(ref[...], dw, (row, 0, 0))
    if sq:
        sq = sq[0]
        # the barrier keeps XLA from squaring the GEMM's unrounded fp32 result (excess precision,
        # allowed by default on GPU): sq sums the values ref holds, as the kernel's epilogue does
        dw = jax.lax.optimization_barrier(dw)
        e, kx, n = dw.shape
        nt = sq.shape[1]
        part = jnp.sum(jnp.square(dw.astype(jnp.float32)).reshape(e, kx, nt, n // nt), -1)
        sq[...] = jax.lax.dynamic_update_slice(sq[...], jnp.swapaxes(part, 1, 2), (row, 0, 0))


def check_dw_sink(dw_sink, w):
    """The `grouped_matmul(dw_sink=...)` argument (ref, row) or (ref, row, sq) for a weight w
    [E, Kd, N] (array or `jax.ShapeDtypeStruct`), checked: (ref, row as an int32 scalar[, sq]).

    Raises:
      ValueError: a ref that is not [G >= E, Kd, N] in w's dtype, or squares that are not one
        fp32 ref of `dw_sq_shape(ref.shape, w.dtype)`.
    """
    ref, row, *sq = dw_sink
    if tuple(ref.shape[1:]) != tuple(w.shape[1:]) or ref.dtype != w.dtype or ref.shape[0] < w.shape[0]:
        raise ValueError(f"dw_sink: {ref.dtype}{list(ref.shape)} does not take w's gradient "
                         f"{w.dtype}{list(w.shape)}")
    want = dw_sq_shape(ref.shape, w.dtype) if sq else None
    if sq and (len(sq) > 1 or tuple(sq[0].shape) != want or sq[0].dtype != jnp.float32):
        raise ValueError(f"dw_sink: squares {[f'{r.dtype}{list(r.shape)}' for r in sq]} do not fit w's "
                         f"gradient (want float32{list(want)})")
    return (ref, jnp.asarray(row, jnp.int32), *sq)


def _tgmm_backend(backend, x, dy, gs, out_dtype):
    if backend == "stand_in":
        shape = (gs.shape[0], x.shape[1], dy.shape[1])
        return _compile_only.stand_in(jax.ShapeDtypeStruct(shape, out_dtype), x, dy, gs)
    if backend == "pallas":
        kx = x.shape[1]
        if kx % 64:  # an extra's t narrower than the kernel's 64-row tile: zero columns, dropped
            x = jnp.pad(x, ((0, 0), (0, -kx % 64)))
            return mosaic_tgmm.tgmm(x, dy, gs, out_dtype=out_dtype)[:, :kx]
        return mosaic_tgmm.tgmm(x, dy, gs, out_dtype=out_dtype)
    return grouped_matmul_transposed_reference(x, dy, gs, preferred_element_type=out_dtype)


def _gmm_impl(x, w, gs, src, extra, out_dtype, backend):
    return _gmm_backend(backend, x, w, gs, out_dtype, src=src, extra=extra[:2])


_gmm = jax.custom_vjp(_gmm_impl, nondiff_argnums=(5, 6))


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
    return _gmm_impl(x, w, gs, src, extra, out_dtype, backend), res


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


def _gmm_bwd(out_dtype, backend, res, g, sink=None):
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
    if x is not None and sink is not None:  # w's gradient goes to the sink; w gets none
        _tgmm_into(backend, x, g, gs, sink)
    elif x is not None:
        dw = _tgmm_backend(backend, x, g, gs, w.dtype)
    sources = (x.size + g.size if x is not None else 0, t.size + g.size if db is not None else 0)
    anchor, (dw, db) = _tie(dx if dx is not None else dt, (dw, db), sources)
    if dx is not None:
        dx = anchor
    else:
        dt = anchor
    return dx, dw, None, nothing, (dt, db, None)[:n_extra]


_gmm.defvjp(_gmm_fwd, _gmm_bwd, symbolic_zeros=True)


def _gmm_sinking(sink):
    """`_gmm` whose weight gradient is written into sink = (ref, row[, sq]) (`_tgmm_into`)."""
    f = jax.custom_vjp(_gmm_impl, nondiff_argnums=(5, 6))
    f.defvjp(_gmm_fwd, lambda out_dtype, backend, res, g: _gmm_bwd(out_dtype, backend, res, g, sink),
             symbolic_zeros=True)
    return f


def extra_fits(x, w, r, *, impl="auto"):
    """True when `grouped_matmul(x, w, ..., extra=(t, b, a))` with t [M, r] runs on the backend
    that x @ w alone would take (the kernels, or the reference), in the forward and in dx's
    GEMM; False when the kernels would take x @ w but not the extra (r too wide for their
    shared memory, or not a multiple of 64)."""
    _check(impl)
    kernels = impl == "pallas" or (impl == "auto" and _hopper())
    if impl == "reference" or not kernels or pallas_unsupported(x, w) is not None:
        return True
    return (mosaic_gpu.extra_fits(w.shape[2], r, x.dtype) is None
            and mosaic_gpu.extra_fits(w.shape[1], r, x.dtype, transpose_rhs=True) is None)


def grouped_matmul(x, w, group_sizes, *, impl="auto", preferred_element_type=None, in_stack=None,
                   extra=None, dw_sink=None):
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
        dtype and R is a multiple of 16 small enough for shared memory (`extra_fits`; 128 at
        V2-Lite's widths); otherwise "auto" runs the reference.
      dw_sink: None, or (ref, row) or (ref, row, sq): w's gradient is written into the mutable
        ref (`jax.new_ref` / `jax.empty_ref`, [G, Kd, N] in w's dtype, made by the caller
        outside `jax.grad`) at rows row .. row + E (row an int32 scalar), in place by the dW
        kernel, and w itself gets a zero gradient; e.g. layer l of an unrolled stack writes its
        experts' gradient into the stack's gradient at row l * E, so the layers' gradients need
        no concatenation. sq, a mutable fp32 ref of shape `dw_sq_shape(ref.shape, w.dtype)`,
        gets the gradient's partial sums of squares (as stored, in w's dtype) at the same rows,
        summed by the dW kernel's epilogue: sum(sq) is ||dW||^2 without reading dW again.
    Returns:
      [M, N]. Differentiable in x, w, t and b (custom VJP: dx by a grouped GEMM with transposed
      weights, dw by a ragged-contraction grouped GEMM, computed only when w is differentiated;
      dt = dy b^T and db = t^T dy likewise; a weight gradient under half the size of its
      sources is tied to dx (or dt) by an optimization barrier); group_sizes gets no gradient.
    Raises:
      ValueError: unknown impl, impl="pallas" with shapes/dtypes the kernels cannot take
      (N and Kd multiples of 128; M < 128 rows are padded), an in_stack whose layer is not w's shape and
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
    gmm = _gmm
    if dw_sink is not None:
        gmm = _gmm_sinking(check_dw_sink(dw_sink, w))
    (x, *t), m = _padded_rows(backend, (x,) + extra[:1])
    out = gmm(x, w, group_sizes.astype(jnp.int32), src, tuple(t) + extra[1:], out_dtype, backend)
    return out if m is None else out[:m]


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
      shapes the kernels cannot take (D a multiple of 128, bf16/f16; M < 128 rows are padded).
    """
    if w_gate_up.shape[-1] % 256:
        raise ValueError(f"gate|up width {w_gate_up.shape[-1]} is not a multiple of 256")
    backend = _resolve(impl, x, w_gate_up)
    (x,), m = _padded_rows(backend, (x,))
    out = _gate_up_swiglu(x, w_gate_up, group_sizes.astype(jnp.int32), backend)
    return out if m is None else out[:m]
