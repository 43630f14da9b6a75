"""Dropless MoE dispatch: reference vs a naive per-token formula, exact permute round trip,
and the grouped-GEMM entry points (Mosaic GPU kernels in GPU interpret mode on CPU) vs the
fp32 reference, gradients included, on uniform, Zipf-skewed (empty experts) and all-on-one
routing. The kernels' own tests are in test_mosaic_gmm.py."""
import functools
import sys
from pathlib import Path

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import _hopper
from pallas_kernels.moe import (dw_sq_shape, gate_up_swiglu, grouped_matmul, permute, sorted_weights, swiglu, unpermute,
                                unpermute_sum)
from pallas_kernels.moe import mosaic_gpu
from pallas_kernels.moe.reference import grouped_matmul_reference

sys.path.insert(0, str(Path(__file__).parent))
from moe_common import group_sizes_of, operands, rel_err  # noqa: E402


def routing(kind, t, k, e, seed):
    """topk_ids [T, K] (distinct experts per token) of a given load pattern."""
    rng = np.random.default_rng(seed)
    if kind == "one":  # every token picks experts e-1, e-2, ..., e-k: all others stay empty
        ids = np.broadcast_to(e - 1 - np.arange(k), (t, k))
        return jnp.asarray(ids, jnp.int32)
    if kind == "uniform":
        p = np.ones(e)
    elif kind == "zipf":  # skewed load; the tail experts usually get no token
        p = 1.0 / np.arange(1, e + 1) ** 2.0
        p[e // 2:] = 0.0
    p = p / p.sum()
    ids = np.stack([rng.choice(e, size=k, replace=False, p=p) for _ in range(t)])
    return jnp.asarray(ids, jnp.int32)


def naive_moe(x, w_up, w_down, ids, p):
    """out[t] = sum_k p[t,k] * relu(x[t] @ w_up[e]) @ w_down[e], e = ids[t,k], token by token."""
    h = jnp.einsum("td,tkdf->tkf", x, w_up[ids])
    h = jax.nn.relu(h)
    y = jnp.einsum("tkf,tkfn->tkn", h, w_down[ids])
    return jnp.einsum("tkn,tk->tn", y, p)


def moe_layer(x, w_up, w_down, ids, p, impl):
    e = w_up.shape[0]
    xs, gs, perm = permute(x, ids, num_experts=e, impl=impl)
    h = jax.nn.relu(grouped_matmul(xs, w_up, gs, impl=impl))
    y = grouped_matmul(h, w_down, gs, impl=impl)
    return unpermute(y, perm, p, impl=impl)


@pytest.mark.parametrize("kind,t,k,e", [("uniform", 24, 2, 4), ("zipf", 40, 6, 64),
                                         ("one", 16, 3, 8), ("uniform", 12, 8, 256)])
def test_reference_matches_naive_formula(kind, t, k, e):
    d, f, n = 16, 24, 8
    keys = jax.random.split(jax.random.key(hash((kind, e)) % 2**31), 4)
    x = jax.random.normal(keys[0], (t, d))
    w_up = jax.random.normal(keys[1], (e, d, f)) / 4
    w_down = jax.random.normal(keys[2], (e, f, n)) / 4
    ids = routing(kind, t, k, e, seed=e)
    p = jax.nn.softmax(jax.random.normal(keys[3], (t, k)))

    out = moe_layer(x, w_up, w_down, ids, p, "reference")
    ref = naive_moe(x, w_up, w_down, ids, p)
    assert rel_err(out, ref) < 1e-5

    loss = lambda fn: (lambda *a: jnp.sum(jnp.sin(fn(*a))))
    args = (x, w_up, w_down, ids, p)
    g_out = jax.grad(loss(lambda *a: moe_layer(*a, "reference")), argnums=(0, 1, 2, 4))(*args)
    g_ref = jax.grad(loss(naive_moe), argnums=(0, 1, 2, 4))(*args)
    for name, go, gr in zip(("dx", "dw_up", "dw_down", "dp"), g_out, g_ref):
        assert rel_err(go, gr) < 1e-5, name


@pytest.mark.parametrize("kind", ["uniform", "zipf"])
def test_weights_before_down_equal_weighted_combine(kind):
    """The model's order (rows scaled by their routing weight in `swiglu`, then the
    down projection, then `unpermute_sum`) against the weighted combine of the expert outputs
    (`unpermute`): fp32 forward and every gradient, also through routing weights of 0."""
    t, k, e, d, f = 40, 6, 16, 24, 32
    keys = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(keys[0], (t, d))
    wg, wu = (jax.random.normal(kk, (e, d, f)) / 4 for kk in keys[1:3])
    wd = jax.random.normal(keys[3], (e, f, d)) / 4
    ids = routing(kind, t, k, e, seed=11)
    p = jax.nn.softmax(jax.random.normal(keys[4], (t, k))).at[::5, 0].set(0.0)

    def expert_rows(x, wg, wu):
        xs, gs, perm = permute(x, ids, num_experts=e, impl="reference")
        return grouped_matmul(xs, wg, gs, impl="reference"), grouped_matmul(xs, wu, gs, impl="reference"), gs, perm

    def weighted_after(x, wg, wu, wd, p):
        g, u, gs, perm = expert_rows(x, wg, wu)
        y = grouped_matmul(jax.nn.silu(g) * u, wd, gs, impl="reference")
        return unpermute(y, perm, p, impl="reference")

    def weighted_before(x, wg, wu, wd, p):
        g, u, gs, perm = expert_rows(x, wg, wu)
        h = swiglu(g, u, sorted_weights(p, perm))
        return unpermute_sum(grouped_matmul(h, wd, gs, impl="reference"), perm, k)

    args = (x, wg, wu, wd, p)
    assert rel_err(weighted_before(*args), weighted_after(*args)) < 1e-6
    perm = permute(x, ids, num_experts=e, impl="reference")[2]
    c = jax.random.normal(keys[0], (t * k,))  # sorted_weights' gradient is the gather's, exactly
    np.testing.assert_array_equal(jax.grad(lambda p: jnp.sum(sorted_weights(p, perm) * c))(p),
                                  jax.grad(lambda p: jnp.sum(jnp.take(p.reshape(-1), perm) * c))(p))
    loss = lambda fn: (lambda *a: jnp.sum(jnp.sin(fn(*a))))
    got = jax.grad(loss(weighted_before), argnums=range(5))(*args)
    want = jax.grad(loss(weighted_after), argnums=range(5))(*args)
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down", "dp"), got, want):
        assert rel_err(a, b) < 1e-5, name


@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_vjp_matches_autodiff_bf16(weighted):
    """The custom VJP (residuals g, u, w only) against autodiff of the fp32 formula, bf16 in/out,
    with leading batch dims."""
    shape = (3, 32, 64)
    keys = jax.random.split(jax.random.key(3), 4)
    g, u = (jax.random.normal(kk, shape).astype(jnp.bfloat16) * 2 for kk in keys[:2])
    w = jax.random.uniform(keys[2], shape[:-1])
    dh = jax.random.normal(keys[3], shape).astype(jnp.bfloat16)
    formula = lambda g, u, *w: (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)
                                * (w[0][..., None] if w else 1.0))
    args = (g, u, w) if weighted else (g, u)
    out, vjp = jax.vjp(swiglu, *args)
    ref, vjp_ref = jax.vjp(formula, *args)
    assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < 4e-3
    for name, a, b in zip(("dg", "du", "dw"), vjp(dh), vjp_ref(dh.astype(jnp.float32))):
        assert a.dtype == {"dw": jnp.float32}.get(name, jnp.bfloat16), name
        assert rel_err(a, b) < 4e-3, name


def test_permute_unpermute_round_trip_exact():
    t, k, e, d = 50, 6, 64, 12
    x = jax.random.normal(jax.random.key(1), (t, d)).astype(jnp.bfloat16)
    ids = routing("zipf", t, k, e, seed=3)
    xs, gs, perm = permute(x, ids, num_experts=e, impl="reference")
    assert xs.shape == (t * k, d) and gs.shape == (e,) and perm.shape == (t * k,)
    assert gs.dtype == jnp.int32 and perm.dtype == jnp.int32
    assert int(gs.sum()) == t * k and int((gs == 0).sum()) > 0
    np.testing.assert_array_equal(np.bincount(np.asarray(ids).ravel(), minlength=e), gs)
    sorted_ids = np.asarray(ids).ravel()[np.asarray(perm)]
    assert np.all(np.diff(sorted_ids) >= 0), "rows not grouped by expert"
    np.testing.assert_array_equal(np.asarray(xs), np.asarray(x)[np.asarray(perm) // k])
    one_hot = jax.nn.one_hot(jnp.full((t,), 2), k, dtype=jnp.float32)
    back = unpermute(xs, perm, one_hot, impl="reference")
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_impl_validation():
    x = jnp.ones((8, 4))
    with pytest.raises(ValueError, match="impl"):
        permute(x, jnp.zeros((8, 2), jnp.int32), num_experts=4, impl="triton")
    with pytest.raises(ValueError, match="pallas"):  # fp32 is not a Mosaic GPU dtype
        grouped_matmul(jnp.ones((256, 128)), jnp.ones((2, 128, 256)), jnp.array([100, 156]),
                       impl="pallas")
    # auto on a machine without a Hopper GPU is the reference
    out = grouped_matmul(jnp.ones((4, 2)), jnp.ones((2, 2, 3)), jnp.array([1, 3]), impl="auto")
    np.testing.assert_allclose(out, 2.0)


# --- the grouped-GEMM entry points through the Mosaic GPU kernels in GPU interpret mode
# (bf16 operands, fp32 reference on the same values)

@pytest.mark.parametrize("r", [64, 16])
def test_grouped_matmul_extra_gradients(r):
    """grouped_matmul(extra=(t, b)) through jax.grad, kernels (interpret mode) and reference:
    output and the gradients of x, t and b (w frozen: no weight-gradient GEMM) equal those of
    x @ w + t @ b written out, bf16 against the fp32 reference; likewise extra=(t, b, a), whose
    dx GEMM also carries the x @ a path's gradient. r 16: t narrower than the dB kernel's
    64-row tile (padded for it)."""
    m, kd, n, e = 200, 128, 256, 4
    x, w, dy = operands(m, kd, n, e, seed=12)
    k = jax.random.split(jax.random.key(13), 2)
    t = jax.random.normal(k[0], (m, r)).astype(jnp.bfloat16)
    b = (jax.random.normal(k[1], (e, r, n)) / 8).astype(jnp.bfloat16)
    gs = group_sizes_of("zipf", 180, e, seed=12)
    f32 = lambda a: a.astype(jnp.float32)

    def ref(x, t, b):
        return grouped_matmul_reference(x, f32(w), gs) + grouped_matmul_reference(t, b, gs)
    out_r, vjp_r = jax.vjp(ref, f32(x), f32(t), f32(b))
    grads_r = vjp_r(f32(dy))
    for impl, tol in (("pallas", 1e-2), ("reference", 1e-6)):
        args = (x, t, b) if impl == "pallas" else (f32(x), f32(t), f32(b))
        wi = w if impl == "pallas" else f32(w)
        f = lambda x, t, b: grouped_matmul(x, wi, gs, impl=impl, extra=(t, b))
        out, vjp = jax.vjp(f, *args)
        assert rel_err(out, out_r) < tol, impl
        for name, g, g_r in zip("xtb", vjp(dy.astype(out.dtype)), grads_r):
            assert g.shape == g_r.shape and rel_err(g, g_r) < 2 * tol, (impl, name)
    # only t and b differentiated (x and w constant: a LoRA run's first adapted layer)
    gt, gb = jax.grad(lambda t, b: jnp.vdot(grouped_matmul(f32(x), f32(w), gs, impl="reference",
                                                           extra=(t, b)), f32(dy)),
                      argnums=(0, 1))(f32(t), f32(b))
    assert rel_err(gt, grads_r[1]) < 1e-6 and rel_err(gb, grads_r[2]) < 1e-6
    # extra (t, b, a) with t = x a, x's gradient stopped there: dx = dy w^T + (dy b^T) a^T
    # from dx's GEMM, the same gradients as x @ w + (x @ a) @ b written out
    a = (jax.random.normal(jax.random.key(14), (e, kd, r)) / 8).astype(jnp.bfloat16)

    def ref_a(x, a, b):
        return grouped_matmul_reference(x, f32(w), gs) + grouped_matmul_reference(
            grouped_matmul_reference(x, a, gs), b, gs)
    out_r, vjp_r = jax.vjp(ref_a, f32(x), f32(a), f32(b))
    grads_r = vjp_r(f32(dy))
    for impl, tol in (("pallas", 1e-2), ("reference", 1e-6)):
        cast = (lambda p: p) if impl == "pallas" else f32

        def f(x, a, b):
            a128 = jnp.pad(a, ((0, 0), (0, 0), (0, 128 - r)))  # the kernels' output width
            t = grouped_matmul(jax.lax.stop_gradient(x), a128, gs, impl=impl)[:, :r]
            return grouped_matmul(x, cast(w), gs, impl=impl, extra=(t, b, a))
        out, vjp = jax.vjp(f, cast(x), cast(a), cast(b))
        assert rel_err(out, out_r) < tol, impl
        for name, g, g_r in zip("xab", vjp(cast(dy)), grads_r):
            assert rel_err(g, g_r) < 2 * tol, (impl, name)
    # db (4 x 64 x 256) under half the size of t and dy at 1000 rows: tied to dx by one barrier
    big = [jnp.ones((1000, c), jnp.float32) for c in (kd, r, n)]
    jx = str(jax.make_jaxpr(jax.grad(lambda x, t, b: jnp.vdot(
        grouped_matmul(x, f32(w), gs, impl="reference", extra=(t, b)), big[2]), argnums=(0, 1, 2)))(
            big[0], big[1], f32(b)))
    assert jx.count("optimization_barrier") == 1
    with pytest.raises(ValueError, match="extra"):
        grouped_matmul(x, w, gs, impl="pallas", extra=(t, b[:, :, :128]))


def test_mosaic_grouped_matmul_custom_vjp_bf16():
    """impl='pallas' end to end through jax.grad: bf16 outputs and gradients vs fp32 reference."""
    m, kd, n, e = 128, 128, 128, 5
    x, w, dy = operands(m, kd, n, e, seed=11)
    gs = group_sizes_of("zipf", m, e, seed=11)
    f32 = lambda a: a.astype(jnp.float32)
    out, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, gs, impl="pallas"), x, w)
    gx, gw = vjp(dy)
    assert out.dtype == gx.dtype == gw.dtype == jnp.bfloat16
    out_r, vjp_r = jax.vjp(lambda x, w: grouped_matmul(x, w, gs, impl="reference"), f32(x), f32(w))
    gx_r, gw_r = vjp_r(f32(dy))
    assert rel_err(out, out_r) < 1e-2
    assert rel_err(gx, gx_r) < 1e-2
    assert rel_err(gw, gw_r) < 1e-2


def test_few_rows_run_on_the_kernels_padded_to_a_row_tile(monkeypatch):
    """A decode step's routed rows (one token, 6 experts: M = 6 < tile_m): impl='pallas' pads
    them with zero rows past sum(group_sizes) and runs the kernels (before, it refused and
    'auto' fell back to the reference, whose per-tile loop reads every expert's weights);
    outputs and gradients vs the fp32 reference, the padding invisible."""
    m, kd, n, e = 6, 128, 128, 8
    x, w, dy = operands(m, kd, n, e, seed=5)
    gs = jnp.array([1, 0, 2, 0, 1, 1, 0, 1], jnp.int32)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    run = lambda x, w: grouped_matmul(x, w, gs, impl="pallas")  # noqa: E731
    rows, real = [], mosaic_gpu.gmm
    monkeypatch.setattr(mosaic_gpu, "gmm", lambda x, *a, **kw: rows.append(x.shape[0]) or real(x, *a, **kw))
    out, vjp = jax.vjp(run, x, w)
    gx, gw = vjp(dy)
    assert rows == [mosaic_gpu.TileConfig().tile_m] * 2  # forward and dx, padded
    assert out.shape == (m, n) and gx.shape == (m, kd) and gw.shape == (e, kd, n)
    out_r, vjp_r = jax.vjp(lambda x, w: grouped_matmul(x, w, gs, impl="reference"), f32(x), f32(w))
    gx_r, gw_r = vjp_r(f32(dy))
    for got, want in ((out, out_r), (gx, gx_r), (gw, gw_r)):
        assert rel_err(got, want) < 1e-2
    assert not np.asarray(gw[jnp.array([1, 3, 6])], np.float32).any()  # experts without rows


def test_grouped_matmul_gradients_only_where_needed():
    """Frozen weights (only x differentiated): the same dx, no weight-gradient GEMM and no
    barrier; weights alone: the same dw; both: dw tied to dx by one optimization barrier (so
    XLA computes it in the layer's backward, not at the end) when dw is small beside x and dy
    (an adapter factor), not when it is as large (a base expert weight)."""
    x, w, dy = (a.astype(jnp.float32) for a in operands(400, 64, 48, 4, seed=3))
    gs = group_sizes_of("zipf", 400, 4, seed=3)
    loss = lambda x, w: jnp.vdot(grouped_matmul(x, w, gs, impl="reference"), dy)
    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    gx_r = jax.grad(lambda x: jnp.vdot(grouped_matmul_reference(x, w, gs), dy))(x)
    gw_r = jax.grad(lambda w: jnp.vdot(grouped_matmul_reference(x, w, gs), dy))(w)
    assert rel_err(gx, gx_r) < 1e-6 and rel_err(gw, gw_r) < 1e-6
    np.testing.assert_array_equal(jax.grad(loss)(x, w), gx)
    np.testing.assert_array_equal(jax.grad(loss, argnums=1)(x, w), gw)
    jx = str(jax.make_jaxpr(jax.grad(loss))(x, w))
    jxw = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
    assert "optimization_barrier" not in jx and jxw.count("optimization_barrier") == 1
    assert jx.count("dot_general") < jxw.count("dot_general")
    x_few, dy_few = x[:100], dy[:100]  # dw (4 x 64 x 48) as large as x and dy: XLA's order
    loss_few = lambda x, w: jnp.vdot(grouped_matmul(x, w, gs // 4, impl="reference"), dy_few)
    assert "optimization_barrier" not in str(jax.make_jaxpr(jax.grad(loss_few, argnums=(0, 1)))(x_few, w))


def test_grouped_matmul_in_stack_reads_the_layer_in_place():
    """in_stack=(stack, i): the kernels read layer i of a [L, E, Kd, N] stack (group offset
    i * E), in the forward and for dx: output and gradients bitwise those of w = stack[i], also
    when w's value is garbage (the kernels never read it); a layer out of range raises."""
    m, kd, n, e, layers = 136, 128, 256, 3, 3
    x, _, dy = operands(m, kd, n, e, seed=5)
    stack = (jax.random.normal(jax.random.key(6), (layers, e, kd, n)) / 8).astype(jnp.bfloat16)
    gs = group_sizes_of("zipf", 120, e, seed=5)  # 16 rows past the sum
    for i in (0, 2):
        out, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, gs, impl="pallas"), x, stack[i])
        gx, gw = vjp(dy)
        f = lambda x, w: grouped_matmul(x, w, gs, impl="pallas", in_stack=(stack, i))
        out_s, vjp_s = jax.vjp(f, x, stack[i])
        gx_s, gw_s = vjp_s(dy)
        for a, b in ((out_s, out), (gx_s, gx), (gw_s, gw)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        np.testing.assert_array_equal(np.asarray(f(x, jnp.full_like(stack[i], jnp.nan)), np.float32),
                                      np.asarray(out, np.float32))
    with pytest.raises(ValueError, match="in_stack"):
        grouped_matmul(x, stack[0], gs, impl="pallas", in_stack=(stack, layers))


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_grouped_matmul_dw_sink_writes_the_stacked_gradient_in_place(impl):
    """dw_sink=(ref, l * E) in each layer of a stack: every layer's weight gradient lands in rows
    l E .. (l + 1) E of one uninitialised ref (the kernel: in place, `tgmm(out=...)`), bitwise the
    per-layer gradients of plain autodiff; the weights themselves get zero gradients; a ref of the
    wrong shape raises."""
    m, kd, n, e, layers = 136, 128, 256, 3, 2
    x, _, _ = operands(m, kd, n, e, seed=7)
    stack = (jax.random.normal(jax.random.key(8), (layers, e, kd, n)) / 8).astype(jnp.bfloat16)
    gs = group_sizes_of("zipf", 120, e, seed=7)
    cot = jax.random.normal(jax.random.key(9), (m, n)).astype(jnp.bfloat16)

    def loss(stack, sink=None):
        y = 0.0
        for i in range(layers):
            y = y + grouped_matmul(x, stack[i], gs, impl=impl, in_stack=(stack, i),
                                   dw_sink=None if sink is None else (sink, i * e)).astype(jnp.float32)
        return jnp.sum(y * cot.astype(jnp.float32))

    @jax.jit
    def sunk(stack):
        ref = jax.empty_ref(jax.ShapeDtypeStruct((layers * e, kd, n), stack.dtype))
        g = jax.grad(loss)(stack, ref)
        return g, ref[...].reshape(stack.shape)

    want = jax.jit(jax.grad(loss))(stack)
    g_w, got = sunk(stack)
    assert float(jnp.max(jnp.abs(want.astype(jnp.float32)))) > 0
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not bool(jnp.any(g_w != 0))
    with pytest.raises(ValueError, match="dw_sink"):
        grouped_matmul(x, stack[0], gs, impl=impl, dw_sink=(jnp.zeros((e, kd, n + 128), jnp.bfloat16), 0))


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_grouped_matmul_dw_sink_sums_the_squares_of_the_gradient(impl):
    """dw_sink=(ref, l * E, sq) in each layer of a stack: sq (`dw_sq_shape`) receives at the
    layer's rows the partial sums of squares of the gradient written into ref, summing to
    ||dW_l||^2 of the bf16 values stored; the gradient is bitwise the one written without sq;
    squares of the wrong shape raise."""
    m, kd, n, e, layers = 136, 128, 256, 3, 2
    x, _, _ = operands(m, kd, n, e, seed=17)
    stack = (jax.random.normal(jax.random.key(18), (layers, e, kd, n)) / 8).astype(jnp.bfloat16)
    gs = group_sizes_of("zipf", 120, e, seed=17)
    cot = jax.random.normal(jax.random.key(19), (m, n)).astype(jnp.bfloat16)
    shape = dw_sq_shape((layers * e, kd, n), stack.dtype)
    assert shape == (layers * e, n // 128, kd)

    def loss(stack, ref, sq):
        y = 0.0
        for i in range(layers):
            sink = (ref, i * e) + ((sq,) if sq is not None else ())
            y = y + grouped_matmul(x, stack[i], gs, impl=impl, in_stack=(stack, i),
                                   dw_sink=sink).astype(jnp.float32)
        return jnp.sum(y * cot.astype(jnp.float32))

    @functools.partial(jax.jit, static_argnums=1)
    def sunk(stack, squares):
        ref = jax.empty_ref(jax.ShapeDtypeStruct((layers * e, kd, n), stack.dtype))
        sq = jax.empty_ref(jax.ShapeDtypeStruct(shape, jnp.float32)) if squares else None
        jax.grad(loss)(stack, ref, sq)
        return ref[...], sq[...] if squares else None

    dw, sq = sunk(stack, True)
    dw_plain, _ = sunk(stack, False)
    np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(dw_plain, np.float32))
    for i in range(layers):
        want = float(jnp.sum(jnp.square(dw[i * e:(i + 1) * e].astype(jnp.float32))))
        assert want > 0
        np.testing.assert_allclose(float(jnp.sum(sq[i * e:(i + 1) * e])), want, rtol=1e-6)
    ref = jnp.zeros((layers * e, kd, n), jnp.bfloat16)
    with pytest.raises(ValueError, match="squares"):
        grouped_matmul(x, stack[0], gs, impl=impl, dw_sink=(ref, 0, jnp.zeros((layers * e, 1, kd), jnp.float32)))


def test_fused_gate_up_swiglu_forward_and_grads():
    """gate_up_swiglu (one kernel: gate/up GEMM + SwiGLU on the fp32 accumulators) vs the fp32
    formula silu(x @ Wg) * (x @ Wu) per group, values and gradients; an empty expert."""
    m, d, i, e = 128, 128, 128, 5
    keys = jax.random.split(jax.random.key(21), 4)
    x = jax.random.normal(keys[0], (m, d)).astype(jnp.bfloat16)
    w_cat = (jax.random.normal(keys[1], (e, d, 2 * i)) / 8).astype(jnp.bfloat16)  # [Wg | Wu]
    w_il = mosaic_gpu.interleave_gate_up(w_cat)
    gs = jnp.array([30, 0, 50, 29, 19], jnp.int32)  # sum 128
    da = jax.random.normal(keys[2], (m, i)).astype(jnp.bfloat16)
    f32 = lambda a: a.astype(jnp.float32)
    np.testing.assert_array_equal(
        np.concatenate(mosaic_gpu.deinterleave_gate_up(np.asarray(f32(w_il))), -1),
        np.asarray(f32(w_cat)))

    def formula(x, w_cat):
        h = grouped_matmul_reference(x, w_cat, gs)
        return jax.nn.silu(h[:, :i]) * h[:, i:]

    out, vjp = jax.vjp(lambda x, w: gate_up_swiglu(x, w, gs, impl="pallas"), x, w_il)
    gx, gw = vjp(da)
    out_r, vjp_r = jax.vjp(formula, f32(x), f32(w_cat))
    gx_r, gw_r = vjp_r(f32(da))
    assert out.shape == (m, i) and out.dtype == gx.dtype == gw.dtype == jnp.bfloat16
    assert rel_err(out, out_r) < 1e-2
    assert rel_err(gx, gx_r) < 1e-2
    gw_cat = np.concatenate(mosaic_gpu.deinterleave_gate_up(np.asarray(f32(gw))), -1)
    assert rel_err(gw_cat, gw_r) < 1e-2
    assert np.all(gw_cat[1] == 0)  # the empty expert gets no weight gradient
    # the reference impl: same function in fp32
    out_ref, vjp_ref = jax.vjp(lambda x, w: gate_up_swiglu(x, w, gs, impl="reference"),
                               f32(x), f32(w_il))
    assert rel_err(out_ref, out_r) < 1e-5
    assert rel_err(vjp_ref(f32(da))[0], gx_r) < 1e-5
    with pytest.raises(ValueError, match="256"):
        gate_up_swiglu(x, w_il[..., :128], gs, impl="reference")


# --- fast permute: counting sort (exact vs stable argsort) and the Mosaic GPU row scatter
# (GPU interpret mode on CPU), bit-identical to the reference path

from pallas_kernels.moe import dispatch  # noqa: E402
from pallas_kernels.moe.reference import sort_by_expert  # noqa: E402


@pytest.mark.parametrize("t,k,e,block", [(50, 6, 64, 256), (37, 3, 8, 16), (1, 1, 4, 256),
                                         (300, 8, 256, 64), (129, 2, 5, 8), (300, 6, 64, 32),
                                         (300, 8, 256, None), (50, 6, 64, None)])
def test_counting_sort_matches_stable_argsort(t, k, e, block):
    rng = np.random.default_rng(t + e)
    ids = rng.integers(0, e, (t, k))  # repeats within a token too: ties must stay in slot order
    if t > 100:
        ids[: t // 2] = e // 3  # one heavy expert across many sort blocks
    ids = jnp.asarray(ids, jnp.int32)
    gs, perm, dest = dispatch.counting_sort_by_expert(ids, e, block=block)
    gs_ref, perm_ref = sort_by_expert(ids, e)
    assert gs.dtype == perm.dtype == dest.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(gs), np.asarray(gs_ref))
    np.testing.assert_array_equal(np.asarray(perm), np.asarray(perm_ref))
    np.testing.assert_array_equal(np.asarray(dest).reshape(-1)[np.asarray(perm)], np.arange(t * k))


def test_sort_block_for():
    assert [dispatch.sort_block_for(n) for n in (4, 64, 256)] == [16, 32, 64]


@pytest.mark.parametrize("t,k,d,rows,dtype", [(37, 3, 128, 4, jnp.bfloat16),   # ragged last block
                                              (5, 2, 256, None, jnp.float32),
                                              (16, 6, 1024, None, jnp.bfloat16),
                                              (3, 8, 256, 2, jnp.bfloat16),
                                              (5, 2, 64, None, jnp.float32)])  # 256-byte rows
def test_scatter_rows_exact(t, k, d, rows, dtype):
    x = jax.random.normal(jax.random.key(t), (t, d)).astype(dtype)
    ids = jnp.asarray(np.random.default_rng(k).integers(0, 8, (t, k)), jnp.int32)
    _, perm, dest = dispatch.counting_sort_by_expert(ids, 8)
    out = dispatch.scatter_rows(x, dest, rows=rows)
    assert out.shape == (t * k, d) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x)[np.asarray(perm) // k])


def test_scatter_rows_errors():
    dest = jnp.asarray([[0, 1]] * 4, jnp.int32)
    with pytest.raises(ValueError, match="multiple of 128"):  # 6 bf16 = 12-byte rows
        dispatch.scatter_rows(jnp.ones((4, 6), jnp.bfloat16), dest)
    with pytest.raises(ValueError, match="SMEM"):
        dispatch.scatter_rows(jnp.ones((4, 64 * 1024), jnp.bfloat16), dest)


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
def test_scatter_rows_no_races(kernel_races):
    """GPU interpret mode with race detection, ragged T (the last block shifted back)."""
    t, k, d = 21, 3, 256
    x = jax.random.normal(jax.random.key(5), (t, d)).astype(jnp.bfloat16)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 6, (t, k)), jnp.int32)
    _, perm, dest = dispatch.counting_sort_by_expert(ids, 6)
    out = dispatch.scatter_rows(x, dest, rows=4,
                                interpret=_hopper.interpret_params(detect_races=True))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x)[np.asarray(perm) // k])
    assert kernel_races == [False]


def test_unpermute_sum_gradient_through_the_row_kernel(monkeypatch):
    """unpermute_sum's gradient with impl="pallas" is permute's row kernel (interpret mode) and
    equals the XLA row gather dout[perm // K] bit for bit; a row the kernel cannot take (12
    bytes) falls back to the gather instead of raising."""
    from pallas_kernels.moe import dispatch
    calls = []
    kernel = dispatch.scatter_rows
    monkeypatch.setattr(dispatch, "scatter_rows", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    t, k, e = 21, 6, 16
    ids = routing("zipf", t, k, e, seed=5)
    perm = permute(jnp.zeros((t, 8)), ids, num_experts=e, impl="reference")[2]
    for d in (128, 6):
        y = jax.random.normal(jax.random.key(6), (t * k, d)).astype(jnp.bfloat16)
        g = jax.random.normal(jax.random.key(7), (t, d)).astype(jnp.bfloat16)

        def run(impl):
            out, vjp = jax.vjp(lambda y: unpermute_sum(y, perm, k, impl=impl), y)
            return out, vjp(g)[0]

        got, want = run("pallas"), run("reference")
        for a, b in zip(got, want):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(g)[np.asarray(perm) // k])
        assert len(calls) == 1, d  # the kernel ran for d = 128; the 12-byte rows never reach it


def test_permute_pallas_bit_identical_to_reference_with_grad():
    t, k, e, d = 21, 6, 16, 128
    x = jax.random.normal(jax.random.key(2), (t, d)).astype(jnp.bfloat16)
    ids = routing("zipf", t, k, e, seed=4)
    g = jax.random.normal(jax.random.key(3), (t * k, d)).astype(jnp.bfloat16)

    def run(impl):
        xs, gs, perm = permute(x, ids, num_experts=e, impl=impl)
        _, vjp = jax.vjp(lambda x: permute(x, ids, num_experts=e, impl=impl)[0], x)
        return xs, gs, perm, vjp(g)[0]

    for a, b in zip(run("pallas"), run("reference")):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="pallas"):  # 6 bf16 = 12-byte rows
        permute(jnp.ones((4, 6), jnp.bfloat16), jnp.zeros((4, 2), jnp.int32), num_experts=2,
                impl="pallas")
