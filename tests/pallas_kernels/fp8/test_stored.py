"""The stored E4M3 weight copy (pallas_kernels/fp8/stored.py, `api.fp8_copy`): `fp8_linear` and
`fp8_grouped_gemm` given the copy of w (with a gradient carrier) give bitwise the forward, dx and
dw of the same functions quantising w themselves, on the reference and on the Mosaic kernels
(GPU interpret mode), the experts with an empty expert and with a dw_sink; the copy of an fp32
weight is `_quantize_weight`'s blocks of it, bitwise."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.fp8 import api, fp8_grouped_gemm, fp8_linear
from pallas_kernels.fp8.stored import Fp8Copy
from pallas_kernels.moe import dw_sq_shape


def finished(out):
    """out once its program (interpret mode's host callbacks included) has completed."""
    jax.block_until_ready(out)
    jax.effects_barrier()
    return out


def varied(key, shape, scale=1.0):
    """Normal values with rows of different magnitudes (so that every scale matters)."""
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, shape) * jnp.exp(jax.random.normal(k2, shape[:-1] + (1,))) * scale


def same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("impl", ["reference", "mosaic"])
@pytest.mark.parametrize("shape", [(128, 256), (3, 200, 72)])
def test_the_copy_of_an_fp32_weight_is_its_quantised_blocks(impl, shape):
    w = varied(jax.random.key(1), shape, 0.05)  # fp32
    c = finished(jax.jit(lambda w: api.fp8_copy(w, impl=impl))(w))
    w_q, w_s, wt_q, wt_s = api._quantize_weight(impl, w)
    same((c.q, c.s, c.qt), (w_q, w_s, wt_q))
    same(jnp.swapaxes(c.s, -1, -2), wt_s)
    padded = tuple(-(-d // 128) * 128 for d in shape[-2:])
    assert c.q.shape[-2:] == (padded if impl == "mosaic" else shape[-2:])
    assert c.grad is None and c.nbytes == sum(x.nbytes for x in (c.q, c.s, c.qt))
    with pytest.raises(ValueError, match="carrier"):
        c.shape  # noqa: B018


@pytest.mark.parametrize("impl,requant", [("reference", False), ("reference", True), ("mosaic", False)])
@pytest.mark.parametrize("m,k,n", [(256, 256, 128), (130, 200, 72)])
def test_fp8_linear_of_the_copy_is_fp8_linear_of_the_weight(impl, requant, m, k, n):
    kx, kw, kr = jax.random.split(jax.random.key(m + k + n), 3)
    x = varied(kx, (m, k)).astype(jnp.bfloat16)
    w = varied(kw, (k, n), 0.05).astype(jnp.bfloat16)
    cot = jax.random.normal(kr, (m, n))
    copy = api.fp8_copy(w, impl=impl)

    def plain(x, w):
        return jnp.sum(fp8_linear(x, w, impl=impl, requantize_weight=requant).astype(jnp.float32) * cot)

    def stored(x, carrier, copy):
        return jnp.sum(fp8_linear(x, copy.with_grad(carrier), impl=impl,
                                  requantize_weight=requant).astype(jnp.float32) * cot)

    want = finished(jax.jit(lambda x, w: (fp8_linear(x, w, impl=impl),
                                          jax.grad(plain, (0, 1))(x, w)))(x, w))
    carrier = jnp.zeros((k, n), jnp.bfloat16)
    got = finished(jax.jit(lambda x, c, cp: (fp8_linear(x, cp.with_grad(c), impl=impl),
                                             jax.grad(stored, (0, 1))(x, c, cp)))(x, carrier, copy))
    assert np.abs(np.asarray(want[1][1], np.float32)).max() > 0
    same(got, want)  # y, dx and dw (the carrier's, in its dtype bf16)


@pytest.mark.parametrize("impl", ["reference", "mosaic"])
def test_fp8_grouped_gemm_of_the_copy_is_that_of_the_weight(impl):
    """Experts [E, K, N] with one empty expert: y, dx, dw bitwise; then with a dw_sink per layer
    of a two-layer stack: the sink's rows and squares as the weight's, the carrier gets zeros."""
    e, m, k, n, layers = 4, 300, 256, 128, 2
    gs = jnp.asarray((100, 0, 37, 163), jnp.int32)
    kx, kw, kr = jax.random.split(jax.random.key(7), 3)
    xs = [varied(key, (m, k)).astype(jnp.bfloat16) for key in jax.random.split(kx, layers)]
    stack = varied(kw, (layers, e, k, n), 0.05).astype(jnp.bfloat16)
    cot = jax.random.normal(kr, (m, n))
    copies = api.fp8_copy(stack.reshape(layers * e, k, n), impl=impl)
    copies = jax.tree.map(lambda a: a.reshape((layers, e) + a.shape[1:]), copies)

    def loss(ws, ref=None, sq=None):
        y = 0.0
        for i in range(layers):
            sink = None if ref is None else (ref, i * e, sq)
            y = y + fp8_grouped_gemm(xs[i], ws[i], gs, impl=impl, dw_sink=sink).astype(jnp.float32)
        return jnp.sum(y * cot)

    def as_copies(carrier):
        return [Fp8Copy(copies.q[i], copies.s[i], copies.qt[i], carrier[i]) for i in range(layers)]

    carrier = jnp.zeros_like(stack)
    want = finished(jax.jit(lambda w: (fp8_grouped_gemm(xs[0], w[0], gs, impl=impl),
                                       jax.grad(loss)(list(w))))(stack))
    got = finished(jax.jit(lambda c: (fp8_grouped_gemm(xs[0], as_copies(c)[0], gs, impl=impl),
                                      jax.grad(lambda c: loss(as_copies(c)))(c)))(carrier))
    assert not bool(jnp.any(want[1][0][1] != 0))  # the empty expert
    same(got[0], want[0])
    same(jnp.stack(got[1]) if isinstance(got[1], list) else got[1], jnp.stack(want[1]))

    sq_shape = dw_sq_shape((layers * e, k, n), stack.dtype)

    def sunk(ws_of, arg):
        ref = jax.empty_ref(jax.ShapeDtypeStruct((layers * e, k, n), stack.dtype))
        sq = jax.empty_ref(jax.ShapeDtypeStruct(sq_shape, jnp.float32))
        g = jax.grad(lambda a: loss(ws_of(a), ref, sq))(arg)
        return g, ref[...], sq[...]

    g_w, dw_w, sq_w = finished(jax.jit(lambda w: sunk(list, w))(stack))
    g_c, dw_c, sq_c = finished(jax.jit(lambda c: sunk(as_copies, c))(carrier))
    same(dw_c, dw_w)
    same(sq_c, sq_w)
    same(dw_c.reshape(stack.shape), jnp.stack(want[1]))
    assert not bool(jnp.any(g_c != 0)) and not bool(jnp.any(g_w != 0))
