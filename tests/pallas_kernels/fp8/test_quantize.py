"""The fused FP8 quantisation kernel (`pallas_kernels.fp8.quantize.quantize_dual`, Mosaic GPU in
GPU interpret mode here): bitwise equality of both outputs (1 x 128 tiles; 128 x 1 tiles written
transposed) with `reference.quantize_rows_1x128` and `reference.quantize_cols_128x1_t` on random
inputs with outliers, zero tiles, partial edge tiles and values on E4M3 rounding ties, in bf16,
fp16 and fp32; the padded layout the GEMMs take; the 128 x 1 half alone; race detection;
fp8_linear / fp8_grouped_gemm with impl="mosaic" against the reference path; and the lowering
for a Hopper GPU from this CPU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _hopper
from pallas_kernels.fp8 import fp8_grouped_gemm, fp8_linear, quantize
from pallas_kernels.fp8 import reference as R
from pallas_kernels.fp8.quantize import quantize_dual


def bits(a):
    """An array's bytes as integers (bitwise comparison; NaN-safe)."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def activation(shape, dtype, seed):
    """Rows and columns of varied magnitudes, a few large outliers, one all-zero 128 x 128 tile,
    a zero row and a zero column (scale 1 in both layouts), and values whose quotient by their
    row's scale lands on E4M3 rounding ties."""
    m, k = shape
    kx, kr, kc, ko = jax.random.split(jax.random.key(seed), 4)
    x = (jax.random.normal(kx, shape) * jnp.exp(jax.random.normal(kr, (m, 1)))
         * jnp.exp(0.5 * jax.random.normal(kc, (1, k))))
    x = x.at[jax.random.randint(ko, (6,), 0, m), jax.random.randint(ko, (6,), 0, k)].set(
        jnp.array([300.0, -1e4, 7e3, -45.0, 2e4, 1e3]))
    x = x.at[:min(m, 128), :min(k, 128)].set(0.0) if m > 128 or k > 128 else x
    x = x.at[m // 2].set(0.0).at[:, k - 1].set(0.0)
    # row 1: amax 448 (s = 1), so the values 92, 13, -0.6875 sit exactly between two E4M3 values
    x = x.at[1, :4].set(jnp.array([448.0, 92.0, 13.0, -0.6875]))
    return x.astype(dtype)


def assert_bitwise(outs, x):
    refs = R.quantize_rows_1x128(x) + R.quantize_cols_128x1_t(x)
    for name, got, want in zip(("x_q", "x_s", "xt_q", "xt_s"), outs, refs):
        assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
        diff = np.argwhere(bits(got) != bits(want))
        assert not len(diff), (name, len(diff), diff[:5])


@pytest.mark.parametrize("shape,dtype", [((200, 576), jnp.bfloat16), ((256, 1056), jnp.bfloat16),
                                         ((130, 200), jnp.float16), ((200, 300), jnp.float32),
                                         ((64, 208), jnp.float32), ((8, 100), jnp.bfloat16)])
def test_bitwise_equal_to_the_references(shape, dtype):
    """Direct TMA reads with 128-, 64- and 32-byte swizzles (576 / 1056 bf16, 208 fp32) and the
    padded copy (M % 8, rows of 300 fp32 or 200 fp16 bytes not multiples of 32)."""
    x = activation(shape, dtype, seed=shape[0] * 7 + shape[1])
    outs = jax.jit(lambda x: quantize_dual(x, padded=False))(x)
    assert_bitwise(outs, x)


def test_wide_rows_and_padded_layout():
    """K = 10944 (mlp_down's input, 85.5 tiles) in bf16; the padded outputs are the GEMMs'
    layout: zeros with scale 1 outside x, the references' values inside; the 128 x 1 half alone
    equals the full kernel's."""
    x = activation((136, 10944), jnp.bfloat16, seed=3)
    x_q, x_s, xt_q, xt_s = jax.jit(quantize_dual)(x)
    assert x_q.shape == (256, 11008) and x_s.shape == (256, 86)
    assert xt_q.shape == (11008, 256) and xt_s.shape == (11008, 2)
    assert_bitwise((x_q[:136, :10944], x_s[:136], xt_q[:10944, :136], xt_s[:10944]), x)
    assert not bits(x_q[136:]).any() and not bits(x_q[:, 10944:]).any()
    assert not bits(xt_q[10944:]).any() and not bits(xt_q[:, 136:]).any()
    assert (np.asarray(x_s[136:]) == 1).all() and (np.asarray(xt_s[10944:]) == 1).all()
    cols = jax.jit(lambda x: quantize_dual(x, rows=False))(x)
    assert len(cols) == 2 and all((bits(a) == bits(b)).all() for a, b in zip(cols, (xt_q, xt_s)))


def test_refusals():
    with pytest.raises(ValueError, match="bfloat16"):
        quantize_dual(jnp.ones((128, 128), jnp.int8))
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        quantize_dual(jnp.ones((2, 128, 128), jnp.bfloat16))


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
def test_no_races(kernel_races, monkeypatch):
    monkeypatch.setattr(quantize, "default_interpret",
                        lambda: _hopper.interpret_params(detect_races=True))
    x = activation((256, 256), jnp.bfloat16, seed=4)
    jax.block_until_ready(quantize._call(x, True))
    assert kernel_races and not any(kernel_races), kernel_races


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("m,k,n,dtype", [(200, 300, 72, jnp.float32), (256, 576, 128, jnp.bfloat16)])
def test_fp8_linear_mosaic_with_the_fused_quantisation(m, k, n, dtype):
    """impl="mosaic" (fused quantisation of x and dy, the three GEMM kernels) against
    impl="reference": the same E4M3 operands, so forward and gradients agree to fp32 rounding
    (to the output's rounding in bf16)."""
    kx, kw, kr = jax.random.split(jax.random.key(m + k + n), 3)
    x = jax.random.normal(kx, (m, k)).astype(dtype)
    w = jax.random.normal(kw, (k, n)) * 0.05
    r = jax.random.normal(kr, (m, n)).astype(dtype)
    outs = {}
    for impl in ("mosaic", "reference"):
        f = lambda x, w: jnp.sum(fp8_linear(x, w, impl=impl).astype(jnp.float32) * r)  # noqa: E731
        both = jax.jit(lambda x, w: (fp8_linear(x, w, impl=impl),) + jax.grad(f, (0, 1))(x, w))  # noqa: B023
        outs[impl] = jax.block_until_ready(both(x, w))
    tol = 1e-6 if dtype == jnp.float32 else 2 ** -8
    for name, a, b in zip(("y", "dx", "dw"), outs["mosaic"], outs["reference"]):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel(a, b) < tol, (name, rel(a, b))


def test_fp8_grouped_gemm_mosaic_wgrad_operands(monkeypatch):
    """fp8_grouped_gemm(impl="mosaic")'s weight gradient on operands from the fused kernel's
    128 x 1 half (the grouped forward / dgrad GEMMs replaced by the reference's, the grouped
    wgrad kernel itself run) against impl="reference"."""
    from pallas_kernels.fp8 import api
    monkeypatch.setattr(api.mosaic_gemm, "fp8_gmm_blockwise",
                        lambda a_q, a_s, b_q, b_s, gs, out_dtype: R.grouped_gemm_blockwise_reference(
                            a_q, a_s, jnp.swapaxes(b_q, 1, 2), jnp.swapaxes(b_s, 1, 2), gs,
                            out_dtype=out_dtype))
    keys = jax.random.split(jax.random.key(11), 3)
    gs = jnp.array([90, 0, 150])
    x = jax.random.normal(keys[0], (256, 200))
    w = jax.random.normal(keys[1], (3, 200, 136)) * 0.05
    r = jax.random.normal(keys[2], (256, 136))
    dws = {}
    for impl in ("mosaic", "reference"):
        f = lambda w: jnp.sum(fp8_grouped_gemm(x, w, gs, impl=impl) * r)  # noqa: E731
        dws[impl] = jax.block_until_ready(jax.jit(jax.grad(f))(w))  # noqa: B023
    assert rel(dws["mosaic"], dws["reference"]) < 1e-6
    assert not np.asarray(dws["mosaic"][1]).any()


class _H100:
    """A stand-in Hopper device for `_hopper.target_device` (lowering only)."""
    platform, compute_capability, core_count = "gpu", "9.0", 132


def test_lowers_for_hopper():
    """Mosaic GPU lowering (layout inference, the cross-warp column maximum, the transposed
    fp8 store, every swizzle) for CUDA on this CPU; fp8_linear's forward + backward runs two
    quantisation kernels (x, dy) beside its three GEMMs."""
    S = jax.ShapeDtypeStruct
    for shape, dtype in (((8192, 10944), jnp.bfloat16), ((512, 1056), jnp.bfloat16),
                         ((512, 208), jnp.float32), ((520, 576), jnp.float16)):
        for rows in (True, False):
            with _hopper.target_device(_H100()):
                text = jax.jit(lambda x, rows=rows: quantize_dual(x, rows=rows)).trace(
                    S(shape, dtype)).lower(lowering_platforms=("cuda",)).as_text()
            assert len(re.findall(r'kernel_hash = "', text)) == 1, (shape, dtype, rows)

    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, impl="mosaic"), x, w)
        return (y,) + vjp(dy)

    with _hopper.target_device(_H100()):
        text = jax.jit(fwd_bwd).trace(S((512, 2048), jnp.bfloat16), S((2048, 576), jnp.float32),
                                      S((512, 576), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
    hashes = re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)
    assert len(hashes) == 5 and len(set(hashes)) == 5, len(hashes)
