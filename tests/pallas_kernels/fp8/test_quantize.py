"""The fused FP8 quantisation kernel (`pallas_kernels.fp8.quantize`, Mosaic GPU in GPU interpret
mode here): bitwise equality of both outputs of `quantize_dual` (1 x 128 tiles; 128 x 1 tiles
written transposed) with `reference.quantize_rows_1x128` and `reference.quantize_cols_128x1_t`,
of `quantize_blocks_dual` (128 x 128 blocks as stored and transposed, dense and per expert)
with `reference.quantize_blocks_128x128`, and of `quantize_grouped_cols` with the 128 x 1 tiles of
`reference.pad_groups`' copy, on random inputs with outliers, zero tiles, partial
edge tiles and values on E4M3 rounding ties, in bf16, fp16 and fp32; the padded layout the GEMMs
take; the 128 x 1 half alone; race detection; fp8_linear / fp8_grouped_gemm with impl="mosaic"
against the reference path, their backward reusing the forward's weight blocks; and the
lowering for a Hopper GPU from this CPU."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _hopper
from pallas_kernels.fp8 import fp8_grouped_gemm, fp8_linear, quantize
from pallas_kernels.fp8 import reference as R
from pallas_kernels.fp8.quantize import quantize_blocks, quantize_blocks_dual, quantize_dual


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
    with pytest.raises(ValueError, match=r"w \[K, N\] or \[E, K, N\]"):
        quantize_blocks_dual(jnp.ones((2, 2, 128, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"every size >= 1"):
        quantize_blocks_dual(jnp.ones((0, 128, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"needs w in .*float32.*got float8_e4m3fn"):
        quantize_blocks_dual(jnp.ones((128, 128), jnp.float8_e4m3fn))


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
def test_no_races(kernel_races, monkeypatch):
    monkeypatch.setattr(quantize, "default_interpret",
                        lambda: _hopper.interpret_params(detect_races=True))
    x = activation((256, 256), jnp.bfloat16, seed=4)
    jax.block_until_ready(quantize._call(x, "dual"))
    jax.block_until_ready(quantize._call(jnp.stack([x, -2 * x]), "blocks"))
    jax.block_until_ready(quantize.quantize_grouped_cols(x, jnp.array([100, 0, 156])))
    assert len(kernel_races) == 3 and not any(kernel_races), kernel_races


@pytest.mark.parametrize("m,k,groups,dtype", [
    (320, 256, (90, 0, 140, 50), jnp.bfloat16),   # unaligned starts, an empty group, 40 rows unused
    (300, 200, (7, 130, 0, 163), jnp.float32),    # M % 8, K % 128, a tile moved back to end at M
    (96, 136, (3, 90, 0, 1), jnp.float16),        # M < 128: padded to one tile's rows
    (512, 1056, (0, 0, 0, 512), jnp.bfloat16),    # one group holds every row; 32-byte swizzle
])
def test_grouped_cols_bitwise_equal_to_the_reference(m, k, groups, dtype):
    """quantize_grouped_cols reads the routed rows themselves: bitwise the 128 x 1 tiles of
    reference.pad_groups' copy (quantize_cols_128x1_t), Kp - K zero rows and scale 1 past K."""
    x = activation((m, k), dtype, seed=m + k)
    gs = jnp.asarray(groups, jnp.int32)
    q, s = jax.jit(quantize.quantize_grouped_cols)(x, gs)
    want_q, want_s = R.quantize_cols_128x1_t(R.pad_groups(x, gs)[0])
    kp = -(-k // 128) * 128
    assert q.shape == (kp, want_q.shape[1]) and s.shape == (want_q.shape[1] // 128, kp)
    assert not np.argwhere(bits(q[:k]) != bits(want_q)).size
    assert not np.argwhere(bits(s[:, :k].T) != bits(want_s)).size
    assert not np.asarray(q[k:].astype(jnp.float32)).any() and (np.asarray(s[:, k:]) == 1).all()
    # the rows past sum(groups) are in no tile: changing them changes nothing
    if sum(groups) < m:
        q2, s2 = jax.jit(quantize.quantize_grouped_cols)(x.at[sum(groups):].set(7.0), gs)
        assert (bits(q2) == bits(q)).all() and (bits(s2) == bits(s)).all()


def weight(shape, dtype, seed):
    """`activation`'s values, per expert for a leading axis E (each its own seed; expert 1 scaled
    by 1e-3, small scales): outliers, a zero 128 x 128 block, zero rows and columns, and (but
    for expert 1) a block of amax 448 whose values 92, 13, -0.6875 sit on E4M3 rounding ties."""
    if len(shape) == 2:
        return activation(shape, dtype, seed)
    return jnp.stack([activation(shape[1:], jnp.float32, seed + e) * (1e-3 if e == 1 else 1.0)
                      for e in range(shape[0])]).astype(dtype)


def assert_blocks_bitwise(outs, w):
    q, s = (R.quantize_blocks_128x128(w) if w.ndim == 2
            else jax.vmap(R.quantize_blocks_128x128)(w))
    refs = (q, s, jnp.swapaxes(q, -1, -2), jnp.swapaxes(s, -1, -2))
    for name, got, want in zip(("w_q", "w_s", "wt_q", "wt_s"), outs, refs):
        assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
        diff = np.argwhere(bits(got) != bits(want))
        assert not len(diff), (name, len(diff), diff[:5])


@pytest.mark.parametrize("shape,dtype", [
    ((576, 1408), jnp.bfloat16), ((10944, 200), jnp.float32), ((1408, 200), jnp.float16),
    ((200, 576), jnp.bfloat16), ((3, 200, 300), jnp.float16), ((3, 256, 1408), jnp.bfloat16),
    ((3, 136, 576), jnp.float32)])
def test_blocks_bitwise_equal_to_the_reference(shape, dtype):
    """128 x 128 blocks, both layouts: dense weights of the model's widths (576, 1408, 10944 =
    85.5 blocks) and partial edge blocks (200, 136, 300), experts [E, K, N] as one launch
    (E = 3), read directly (128- and 32-byte swizzles) or through the padded copy (rows of 200
    or 300 fp16: 400 and 600 bytes)."""
    w = weight(shape, dtype, seed=sum(shape))
    outs = jax.jit(lambda w: quantize_blocks_dual(w, padded=False))(w)
    assert_blocks_bitwise(outs, w)


def test_blocks_padded_layout_and_scales():
    """The padded outputs are the GEMMs' layout (zeros past w, in both copies); the scales are
    per block (one max over 128 x 128 elements: an outlier sets its whole block's scale, an
    all-zero block gets 1), wt_q is w_q transposed bit for bit."""
    w = jax.random.normal(jax.random.key(5), (2, 300, 200), jnp.float32)
    w = w.at[0, 130, 7].set(-3e3).at[1, :128, 128:].set(0.0)
    w_q, w_s, wt_q, wt_s = jax.jit(quantize_blocks_dual)(w)
    assert w_q.shape == (2, 384, 256) and wt_q.shape == (2, 256, 384)
    assert w_s.shape == (2, 3, 2) and wt_s.shape == (2, 2, 3)
    assert (bits(wt_q) == bits(jnp.swapaxes(w_q, 1, 2))).all()
    assert (np.asarray(wt_s) == np.swapaxes(np.asarray(w_s), 1, 2)).all()
    assert not bits(w_q[:, 300:]).any() and not bits(w_q[:, :, 200:]).any()
    assert np.asarray(w_s)[0, 1, 0] == np.float32(3e3) * np.float32(quantize.INV_E4M3_MAX)
    assert np.asarray(w_s)[1, 0, 1] == 1.0 and not bits(w_q[1, :128, 128:]).any()
    assert np.asarray(w_q[0, 130, 7], np.float32) == -448.0
    assert_blocks_bitwise((w_q[:, :300, :200], w_s, wt_q[:, :200, :300], wt_s), w)



@pytest.mark.parametrize("shape,dtype", [((576, 1408), jnp.bfloat16), ((3, 200, 300), jnp.float16),
                                         ((2, 136, 256), jnp.float32)])
def test_one_block_layout_is_its_half_of_the_dual_kernel(shape, dtype):
    """quantize_blocks writes one layout of quantize_blocks_dual's blocks: bitwise its half,
    padded and not, as stored (the dgrad's) and transposed (the forward's)."""
    w = weight(shape, dtype, seed=7 + sum(shape))
    dual = jax.jit(quantize_blocks_dual)(w)
    dual_sliced = jax.jit(lambda w: quantize_blocks_dual(w, padded=False))(w)
    for transposed, half in ((False, slice(0, 2)), (True, slice(2, 4))):
        for padded, want in ((True, dual[half]), (False, dual_sliced[half])):
            got = jax.jit(lambda w: quantize_blocks(w, transposed=transposed, padded=padded))(w)  # noqa: B023
            for g, wnt in zip(got, want):
                assert g.shape == wnt.shape and g.dtype == wnt.dtype, (transposed, padded)
                assert (bits(g) == bits(wnt)).all(), (transposed, padded)
    with pytest.raises(ValueError, match="quantize_blocks needs w"):
        quantize_blocks(jnp.ones((128,), jnp.bfloat16), transposed=True)


def grouped_gemms_on_the_reference(monkeypatch):
    """fp8_grouped_gemm's grouped forward / dgrad kernel replaced by the reference's promoted
    sums (the kernel itself runs in test_mosaic_gemm.py); its quantisation kernels still run."""
    from pallas_kernels.fp8 import api
    monkeypatch.setattr(api.mosaic_gemm, "fp8_gmm_blockwise",
                        lambda a_q, a_s, b_q, b_s, gs, out_dtype: R.grouped_gemm_blockwise_reference(
                            a_q, a_s, jnp.swapaxes(b_q, 1, 2), jnp.swapaxes(b_s, 1, 2), gs,
                            out_dtype=out_dtype))


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
    grouped_gemms_on_the_reference(monkeypatch)
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


def test_weights_quantised_once_by_the_kernel(monkeypatch):
    """impl="mosaic": fp8_linear and fp8_grouped_gemm quantise w by one `quantize_blocks_dual`
    call per forward + backward and never in XLA; the residual kept for the dgrad is the
    kernel's padded w_q (the dense one checked bitwise). The GEMM kernels are replaced by the
    reference's promoted sums (the kernels themselves run in the tests above and in
    test_mosaic_grouped.py); forward and gradients equal impl="reference"'s."""
    from pallas_kernels.fp8 import api
    monkeypatch.setattr(api.mosaic_gemm, "fp8_gemm_blockwise",
                        lambda a_q, a_s, b_q, b_s, out_dtype: R.gemm_blockwise_reference(
                            a_q, a_s, b_q, b_s, out_dtype=out_dtype))
    monkeypatch.setattr(api.mosaic_wgrad, "fp8_gemm_1d1d",
                        lambda a_q, a_s, b_q, b_s, out_dtype: R.gemm_1d1d_reference(
                            a_q, a_s, b_q, b_s, out_dtype=out_dtype))
    grouped_gemms_on_the_reference(monkeypatch)
    keys = jax.random.split(jax.random.key(12), 6)
    gs = jnp.array([70, 0, 130])
    x, xg = jax.random.normal(keys[0], (136, 300)), jax.random.normal(keys[1], (256, 200))
    w = jax.random.normal(keys[2], (300, 200), jnp.bfloat16) * 0.05
    wg = jax.random.normal(keys[3], (3, 200, 136)) * 0.05
    r, rg = jax.random.normal(keys[4], (136, 200)), jax.random.normal(keys[5], (256, 136))

    def run(impl):
        def f(x, w):
            y = fp8_linear(x, w, impl=impl)
            return jnp.sum(y * r), y

        def g(x, w):
            y = fp8_grouped_gemm(x, w, gs, impl=impl)
            return jnp.sum(y * rg), y
        grad = functools.partial(jax.value_and_grad, argnums=(0, 1), has_aux=True)
        return [jax.block_until_ready(jax.jit(grad(h))(a, b))
                for h, a, b in ((f, x, w), (g, xg, wg))]

    want = run("reference")
    calls, real = [], quantize.quantize_blocks_dual

    def counted(w, **kw):
        calls.append(w.shape)
        return real(w, **kw)

    def refused(w):
        raise AssertionError("w quantised in XLA")

    monkeypatch.setattr(quantize, "quantize_blocks_dual", counted)
    monkeypatch.setattr(R, "quantize_blocks_128x128", refused)
    got = run("mosaic")
    assert calls == [(300, 200), (3, 200, 136)], calls
    for ((_, y), (dx, dw)), ((_, y_r), (dx_r, dw_r)) in zip(got, want):
        assert rel(y, y_r) < 1e-6 and rel(dx, dx_r) < 1e-6
        assert rel(dw, dw_r) < (1e-6 if dw.dtype == jnp.float32 else 2 ** -8)
        assert dw.dtype == dw_r.dtype
    _, vjp = jax.vjp(lambda w: fp8_linear(x, w, impl="mosaic"), w)
    res = [l for l in jax.tree.leaves(vjp) if getattr(l, "dtype", None) == jnp.float8_e4m3fn]
    w_q = real(w)[0]
    assert any(l.shape == w_q.shape and (bits(l) == bits(w_q)).all() for l in res)



@pytest.mark.parametrize("impl", ["reference", "mosaic"])
def test_grouped_gemm_requantizing_the_weight_in_the_backward(impl, monkeypatch):
    """fp8_grouped_gemm(requantize_weight=True) gives bitwise the forward and gradients of the
    default (the dgrad's E4M3 copy of w quantised again in the backward instead of kept), and
    its backward holds w itself, no E4M3 copy of it; "mosaic" (quantisation kernels run in
    interpret mode, the GEMMs by the reference's promoted sums) writes one layout per call."""
    grouped_gemms_on_the_reference(monkeypatch)
    keys = jax.random.split(jax.random.key(21), 3)
    gs = jnp.array([70, 0, 130])
    x = jax.random.normal(keys[0], (256, 200)).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (3, 200, 136)) * 0.05).astype(jnp.bfloat16)
    r = jax.random.normal(keys[2], (256, 136))
    calls, real = [], quantize.quantize_blocks
    monkeypatch.setattr(quantize, "quantize_blocks",
                        lambda w, **kw: calls.append(kw["transposed"]) or real(w, **kw))

    def run(requant):
        def f(x, w):
            y = fp8_grouped_gemm(x, w, gs, impl=impl, requantize_weight=requant)
            return jnp.sum(y.astype(jnp.float32) * r), y
        grad = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
        return jax.block_until_ready(jax.jit(grad)(x, w))

    kept, requant = run(False), run(True)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(requant)):
        assert a.dtype == b.dtype and (bits(a) == bits(b)).all()
    assert calls == ([True, False] if impl == "mosaic" else []), calls
    for flag, fp8_held in ((False, True), (True, False)):
        _, vjp = jax.vjp(lambda w: fp8_grouped_gemm(x, w, gs, impl=impl, requantize_weight=flag), w)  # noqa: B023
        shapes = [l.shape for l in jax.tree.leaves(vjp) if getattr(l, "dtype", None) == jnp.float8_e4m3fn]
        assert any(len(s_) == 3 for s_ in shapes) == fp8_held, shapes  # w_q [E, K, N]



def test_lowers_for_hopper():
    """Mosaic GPU lowering (layout inference, the cross-warp column maximum, the block maximum
    and scalar scale stores, the transposed fp8 store, every swizzle; the block mode with both
    layouts and with either alone) for CUDA on this CPU;
    fp8_linear's forward + backward runs three quantisation kernels (x, dy, w) beside its three
    GEMMs and converts nothing to fp8 in XLA."""
    S = jax.ShapeDtypeStruct
    for shape, dtype in (((8192, 10944), jnp.bfloat16), ((512, 1056), jnp.bfloat16),
                         ((512, 208), jnp.float32), ((520, 576), jnp.float16)):
        for rows in (True, False):
            with _hopper.target_device(_H100()):
                text = jax.jit(lambda x, rows=rows: quantize_dual(x, rows=rows)).trace(
                    S(shape, dtype)).lower(lowering_platforms=("cuda",)).as_text()
            assert len(re.findall(r'kernel_hash = "', text)) == 1, (shape, dtype, rows)
    for shape, dtype in (((2048, 10944), jnp.bfloat16), ((64, 2048, 1408), jnp.bfloat16),
                         ((3, 1408, 2048), jnp.float32), ((520, 200), jnp.float16)):
        for f in (quantize_blocks_dual, functools.partial(quantize_blocks, transposed=True),
                  functools.partial(quantize_blocks, transposed=False)):
            with _hopper.target_device(_H100()):
                text = jax.jit(f).trace(S(shape, dtype)).lower(lowering_platforms=("cuda",)).as_text()
            assert len(re.findall(r'kernel_hash = "', text)) == 1, (shape, dtype)
    for shape, dtype in (((49152, 2048), jnp.bfloat16), ((300, 200), jnp.float32)):
        with _hopper.target_device(_H100()):
            text = jax.jit(quantize.quantize_grouped_cols).trace(
                S(shape, dtype), S((64,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert len(re.findall(r'kernel_hash = "', text)) == 1, (shape, dtype)

    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, impl="mosaic"), x, w)
        return (y,) + vjp(dy)

    with _hopper.target_device(_H100()):
        text = jax.jit(fwd_bwd).trace(S((512, 2048), jnp.bfloat16), S((2048, 576), jnp.float32),
                                      S((512, 576), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
    hashes = re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)
    assert len(hashes) == 6 and len(set(hashes)) == 6, len(hashes)
    assert not re.search(r"stablehlo.convert .*-> tensor<[0-9x]*f8E4M3FN>", text)
