"""Frozen FP8 weights (`pallas_kernels.fp8.frozen`): the checkpoint layout and DeepSeek's
dequantisation convention, the dense and grouped GEMMs (forward and dgrad) against explicit
dequantise-and-dot, no re-quantisation of the stored weight, and the memory of the format."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import _hopper
from pallas_kernels.fp8 import fp8_linear
from pallas_kernels.fp8 import reference as ref
from pallas_kernels.fp8.frozen import (Fp8Weight, fp8_grouped_gemm_frozen, fp8_linear_frozen,
                                       scale_grid)

HI = jax.lax.Precision.HIGHEST


def _checkpoint_weight(rng, out_dim, in_dim):
    """A DeepSeek-V3-style checkpoint tensor: e4m3 [out, in] + fp32 weight_scale_inv per block."""
    q = rng.normal(size=(out_dim, in_dim)).astype(np.float32) * 100
    q = np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(1e-4, 1e-2, scale_grid((out_dim, in_dim))).astype(np.float32)
    return q, s


def test_from_checkpoint_layout_and_convention_kv_a_shape():
    """kv_a_proj_with_mqa [576, 7168] -> scale grid [5, 56]; our [in, out] weight is the
    transposed checkpoint tensor, w = q * scale_inv per block (DeepSeek's `weight_dequant`),
    bitwise the numpy dequantiser's."""
    from dsjax.hf.safetensors_io import dequant_fp8
    rng = np.random.default_rng(0)
    q, s = _checkpoint_weight(rng, 576, 7168)
    assert s.shape == (5, 56)
    w = Fp8Weight.from_out_in(jnp.asarray(q), jnp.asarray(s))
    assert w.shape == (7168, 576) and w.s.shape == (56, 5) and w.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(w.q).view(np.uint8), q.T.view(np.uint8))
    deq = np.asarray(w.dequantize())
    np.testing.assert_array_equal(deq, dequant_fp8(q, s, (128, 128)).T)
    # the partial last block of `out` (rows 512..575) uses scale row 4
    np.testing.assert_array_equal(deq[130, 570], q[570, 130].astype(np.float32) * s[4, 1])
    with pytest.raises(ValueError, match=r"scales \[4, 56\] do not match weight \[576, 7168\].*\[5, 56\]"):
        Fp8Weight.from_out_in(jnp.asarray(q), jnp.asarray(s[:4]))


def test_quantize_is_the_reference_quantiser_and_memory_is_half_of_bf16():
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 384, 200), jnp.float32)
    fw = Fp8Weight.quantize(w)
    q0, s0 = ref.quantize_blocks_128x128(w[1])
    np.testing.assert_array_equal(np.asarray(fw.q[1], np.float32), np.asarray(q0, np.float32))
    np.testing.assert_array_equal(np.asarray(fw.s[1]), np.asarray(s0))
    assert fw.s.shape == (3, 3, 2)
    big = Fp8Weight(jnp.zeros((7168, 2048), jnp.float8_e4m3fn), jnp.zeros((56, 16), jnp.float32))
    per_elem = big.nbytes / (7168 * 2048)
    assert per_elem == pytest.approx(1 + 4 / 16384)
    assert per_elem / 2 == pytest.approx(0.5, abs=1e-3)  # vs bf16: 2 bytes per element


def _want_linear(x, w: Fp8Weight):
    """Explicit reference: x dequantised from its 1 x 128 tiles, w from its stored blocks, fp32 dot."""
    xq, xs = ref.quantize_rows_1x128(x.reshape(-1, x.shape[-1]))
    a = ref.dequantize_rows_1x128(xq, xs)
    return jnp.dot(a, w.dequantize(), precision=HI).reshape(*x.shape[:-1], w.shape[1])


@pytest.mark.parametrize("k,n", [(256, 384), (200, 576)])
def test_linear_forward_and_dgrad_use_the_stored_weight(k, n):
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(ks[0], (2, 40, k), jnp.float32)
    w = Fp8Weight.quantize(jax.random.normal(ks[1], (k, n)) * 0.05)
    y = fp8_linear_frozen(x, w, impl="reference")
    assert y.shape == (2, 40, n) and y.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(y), np.asarray(_want_linear(x, w)), rtol=1e-6, atol=1e-6)
    # the GEMM of the re-quantised dequantised weight is close (activation rounding equal) but
    # the frozen path never forms it
    y2 = fp8_linear(x, w.dequantize(), impl="reference")
    assert float(jnp.max(jnp.abs(y - y2))) <= 1e-5 * float(jnp.max(jnp.abs(y)))
    jaxpr = str(jax.make_jaxpr(lambda x: fp8_linear_frozen(x, w, impl="reference"))(x))
    assert "reduce_max" in jaxpr and jaxpr.count("reduce_max") == 1  # x's tiles only, not w's blocks
    # dgrad: dy in 1 x 128 tiles times w^T
    dy = jax.random.normal(ks[2], y.shape, jnp.float32)
    _, vjp = jax.vjp(lambda x: fp8_linear_frozen(x, w, impl="reference"), x)
    (dx,) = vjp(dy)
    dq, ds = ref.quantize_rows_1x128(dy.reshape(-1, n))
    want = jnp.dot(ref.dequantize_rows_1x128(dq, ds), w.dequantize().T, precision=HI).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(want), rtol=1e-6, atol=1e-6)
    # bf16 compute dtype: output and dx in bf16, close to the fp32 path
    yb = fp8_linear_frozen(x.astype(jnp.bfloat16), w, impl="reference")
    assert yb.dtype == jnp.bfloat16
    assert float(jnp.linalg.norm(yb.astype(jnp.float32) - y) / jnp.linalg.norm(y)) < 0.02


def test_linear_gradient_flows_only_to_x_and_beside_adapters():
    """A LoRA-style layer y = fp8_linear_frozen(x, w) + x A B: grads reach x, A and B; the
    frozen weight takes part in no gradient."""
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    x = jax.random.normal(ks[0], (64, 128))
    w = Fp8Weight.quantize(jax.random.normal(ks[1], (128, 256)) * 0.05)
    a = jax.random.normal(ks[2], (128, 4)) * 0.1
    b = jax.random.normal(ks[3], (4, 256)) * 0.1

    def loss(x, a, b):
        return jnp.sum(jnp.tanh(fp8_linear_frozen(x, w, impl="reference") + x @ a @ b))

    gx, ga, gb = jax.grad(loss, argnums=(0, 1, 2))(x, a, b)
    assert all(float(jnp.linalg.norm(g)) > 0 for g in (gx, ga, gb))


def test_errors():
    w = Fp8Weight.quantize(jnp.ones((128, 64)))
    with pytest.raises(ValueError, match=r"do not contract"):
        fp8_linear_frozen(jnp.ones((4, 100)), w)
    with pytest.raises(ValueError, match=r"want an Fp8Weight of 2 dims"):
        fp8_linear_frozen(jnp.ones((4, 128)), Fp8Weight(w.q, w.s[:, :0]))
    with pytest.raises(ValueError, match=r"impl='x'"):
        fp8_linear_frozen(jnp.ones((4, 128)), w, impl="x")


def _per_row(a, w, gs):
    """Row i times the matrix of its group (zero past sum(gs)), one row at a time."""
    g = np.searchsorted(np.cumsum(np.asarray(gs)), np.arange(a.shape[0]), side="right")
    out = np.zeros((a.shape[0], w.shape[2]), np.float32)
    a, w = np.asarray(a, np.float64), np.asarray(w, np.float64)
    for i, gi in enumerate(g):
        if gi < w.shape[0]:
            out[i] = a[i] @ w[gi]
    return out


@pytest.mark.parametrize("impl", ["reference", "mosaic"])
def test_grouped_forward_and_dgrad(impl):
    """Per row, x's 1 x 128 tiles times its expert's stored blocks (forward) and dy's times the
    blocks transposed (dgrad), an empty expert and widths that are not multiples of 128;
    "mosaic": the grouped Mosaic GPU kernel (GPU interpret mode here) on those blocks."""
    ks = jax.random.split(jax.random.PRNGKey(4), 3)
    m, k, n, e = 96, 200, 136, 4
    gs = jnp.array([30, 0, 40, 20])
    x = jax.random.normal(ks[0], (m, k))
    w = Fp8Weight.quantize(jax.random.normal(ks[1], (e, k, n)) * 0.05)
    # the 8-bit wgmma's accumulator on a Hopper GPU (tests/pallas_kernels/fp8/test_mosaic_grouped.py)
    tol = 5e-4 if impl == "mosaic" and _hopper.on_hopper() else 1e-5
    y, vjp = jax.vjp(lambda x: fp8_grouped_gemm_frozen(x, w, gs, impl=impl), x)
    xq, xs = ref.quantize_rows_1x128(x)
    want = _per_row(ref.dequantize_rows_1x128(xq, xs), w.dequantize(), gs)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=tol, atol=tol)
    assert float(jnp.max(jnp.abs(y[90:]))) == 0.0  # rows past sum(group_sizes)
    dy = jax.random.normal(ks[2], y.shape)
    (dx,) = jax.block_until_ready(vjp(dy))
    jax.effects_barrier()  # interpret mode's kernel callbacks done before the next program
    dq, ds = ref.quantize_rows_1x128(dy)
    want_dx = _per_row(ref.dequantize_rows_1x128(dq, ds), jnp.swapaxes(w.dequantize(), 1, 2), gs)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match=r"do not fit"):
        fp8_grouped_gemm_frozen(x[:, :100], w, gs)
