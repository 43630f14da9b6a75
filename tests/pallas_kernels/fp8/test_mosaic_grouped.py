"""The grouped (MoE expert) FP8 GEMMs on the Mosaic GPU kernels, in GPU interpret mode: the dgrad
use of `fp8_gmm_blockwise` (b = the experts' weights as quantised, [E, K, N]) and the 1D1D
weight-gradient kernel `fp8_grouped_wgrad` against reference.py's promoted sums of the same E4M3
operands, and `fp8_grouped_gemm(impl="mosaic")` against impl="reference" (forward and jax.grad),
with an empty expert, an expert holding every row, rows past sum(group_sizes) and widths that
are not multiples of 128."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import _hopper
from pallas_kernels.fp8 import api, fp8_grouped_gemm
from pallas_kernels.fp8 import mosaic_grouped_wgrad as mw
from pallas_kernels.fp8 import reference as R
from pallas_kernels.fp8.mosaic_gemm import fp8_gmm_blockwise
from pallas_kernels.fp8.mosaic_grouped_wgrad import WgradConfig, fp8_grouped_wgrad

E = 4
# the kernels against the fp32 promotion of the same E4M3 operands: exact up to fp32 rounding in
# interpret mode; on a Hopper GPU the 8-bit wgmma sums each 128-wide block with its own reduced
# accumulator precision (~14 bits, DeepSeek-V3 sec. 3.3.2, which the per-block promotion bounds):
# 1.1e-4 measured for the grouped weight gradient on an H100, a fault gives 1e-2 and more
TOL = 5e-4 if _hopper.on_hopper() else 1e-6
# rows 0..299 used; one expert empty / one expert with every row
GROUPS = {"empty": (100, 0, 37, 163), "all": (0, 0, 300, 0)}


def finished(out):
    """out once its program, interpret mode's host callbacks included, has completed: a callback
    still running when the next eager op is dispatched can deadlock the two."""
    jax.block_until_ready(out)
    jax.effects_barrier()
    return out


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite output"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def varied(key, shape):
    """Normal values, rows and columns of different magnitudes (so that every scale matters)."""
    k1, k2, k3 = jax.random.split(key, 3)
    return (jax.random.normal(k1, shape) * jnp.exp(jax.random.normal(k2, (shape[0], 1)))
            * jnp.exp(0.5 * jax.random.normal(k3, (1, shape[1]))))


def wgrad_operands(seed, m, k, n, gs):
    """x [m, k], dy [m, n] -> their group-padded 128 x 1 quantisations (reference layout) and
    the tile -> group map."""
    kx, kd = jax.random.split(jax.random.key(seed))
    x, dy = varied(kx, (m, k)), varied(kd, (m, n))
    x_p, tile_group, _ = R.pad_groups(x, gs)
    dy_p, _, _ = R.pad_groups(dy, gs)
    return R.quantize_cols_128x1(x_p), R.quantize_cols_128x1(dy_p), tile_group


@pytest.mark.parametrize("groups,tile_n", [("empty", 128), ("all", 128), ("empty", 256)])
def test_grouped_wgrad_matches_reference(groups, tile_n):
    gs = jnp.asarray(GROUPS[groups], jnp.int32)
    m, k, n = 320, 256, 256  # 20 rows past sum(group_sizes), dropped by pad_groups
    (xq, xs), (dq, ds), tile_group = wgrad_operands(len(groups) + tile_n, m, k, n, gs)
    want = R.grouped_wgrad_reference(xq, xs, dq, ds, tile_group, E)
    got = finished(fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs, config=WgradConfig(tile_n=tile_n)))
    assert got.shape == (E, k, n) and got.dtype == jnp.float32
    assert rel(got, want) < TOL
    for g in range(E):
        if GROUPS[groups][g] == 0:
            assert (np.asarray(got[g]) == 0).all()
        else:
            assert rel(got[g], want[g]) < TOL


def test_grouped_wgrad_scales_are_applied_per_tile_row_and_column():
    """Scaling one token tile's scale of x channel k or of dy channel n scales exactly the
    contribution of that tile to row k or column n of its expert's gradient."""
    gs = jnp.asarray(GROUPS["empty"], jnp.int32)
    (xq, xs), (dq, ds), tile_group = wgrad_operands(5, 300, 256, 256, gs)
    base = np.asarray(finished(fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs)))
    first, count = (np.asarray(a) for a in R.group_tiles(gs))
    assert count.tolist() == [1, 0, 1, 2] and first.tolist() == [0, 1, 1, 2]
    xs2 = xs.at[3, 17].multiply(0.0)   # expert 3's second tile, x channel 17
    ds2 = ds.at[0, 200].multiply(3.0)  # expert 0's tile, dy channel 200
    got = np.asarray(finished(fp8_grouped_wgrad(xq.T, xs2, dq.T, ds2, gs)))
    want = np.asarray(R.grouped_wgrad_reference(xq, xs2, dq, ds2, tile_group, E))
    assert rel(got, want) < TOL
    np.testing.assert_allclose(got[0][:, 200], 3 * base[0][:, 200], rtol=1e-6,
                               atol=1e-6 * np.abs(base[0]).max())
    assert not np.allclose(got[3][17], base[3][17])
    keep = np.ones(256, bool)
    keep[200] = False
    np.testing.assert_array_equal(got[0][:, keep], base[0][:, keep])
    np.testing.assert_array_equal(got[1:3], base[1:3])


@pytest.mark.parametrize("groups", ["empty", "all"])
def test_dgrad_kernel_reads_the_weights_as_quantised(groups):
    """dx = dy @ w_e^T per expert: fp8_gmm_blockwise with b = w_q [E, K, N] (K the output, N the
    contraction) and the [E, K/128, N/128] block scales as they are."""
    gs = jnp.asarray(GROUPS[groups], jnp.int32)
    m, k, n = 300, 256, 384
    kd, kw = jax.random.split(jax.random.key(11))
    dy_q, dy_s = R.quantize_rows_1x128(varied(kd, (m, n)))
    w = jax.random.normal(kw, (E, k, n)) * 0.05
    w_q, w_s = jax.vmap(R.quantize_blocks_128x128)(w)  # [E, K, N], [E, Kb, Nb]
    got = finished(fp8_gmm_blockwise(dy_q, dy_s, w_q, w_s, gs, out_dtype=jnp.float32))
    want = R.grouped_gemm_blockwise_reference(dy_q, dy_s, jnp.swapaxes(w_q, 1, 2),
                                              jnp.swapaxes(w_s, 1, 2), gs)
    assert got.shape == (m, k)
    assert rel(got, want) < TOL


@pytest.mark.parametrize("m,k,n,groups,dtype", [(300, 256, 256, "empty", jnp.float32),
                                                (320, 200, 320, "all", jnp.bfloat16)])
def test_fp8_grouped_gemm_mosaic_matches_reference(m, k, n, groups, dtype):
    """Forward and gradients of impl="mosaic" equal impl="reference" to fp32 rounding (bf16
    outputs: to one bf16 rounding); K and N not multiples of 128 are zero-padded for the
    kernels; rows past sum(group_sizes) give zeros and get zero gradients."""
    gs = jnp.asarray(GROUPS[groups], jnp.int32)
    kx, kw, kr = jax.random.split(jax.random.key(m + k + n), 3)
    x = varied(kx, (m, k)).astype(dtype)
    w = jax.random.normal(kw, (E, k, n)) * 0.05  # fp32 master weights
    r = jax.random.normal(kr, (m, n))
    outs = {}
    for impl in ("mosaic", "reference"):
        def forward_and_grads(x, w, impl=impl):  # one program: no eager op beside the kernels
            def loss(x, w):
                y = fp8_grouped_gemm(x, w, gs, impl=impl)
                return jnp.sum(y.astype(jnp.float32) * r), y
            (_, y), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, w)
            return (y,) + grads
        outs[impl] = finished(jax.jit(forward_and_grads)(x, w))
    (y, dx, dw), (y_r, dx_r, dw_r) = outs["mosaic"], outs["reference"]
    assert (y.dtype, dx.dtype, dw.dtype) == (dtype, dtype, jnp.float32)
    assert y.shape == (m, n) and dx.shape == (m, k) and dw.shape == (E, k, n)
    tol = TOL if dtype == jnp.float32 else 2 ** -8
    assert rel(y, y_r) < tol and rel(dx, dx_r) < tol
    assert rel(dw, dw_r) < TOL
    for g, size in enumerate(GROUPS[groups]):
        if size == 0:
            assert (np.asarray(dw[g]) == 0).all()
    assert (np.asarray(y[300:]) == 0).all() and (np.asarray(dx[300:]) == 0).all()


def test_grouped_impl_resolution(monkeypatch):
    assert api.resolve_impl("reference") == "reference"
    monkeypatch.setattr(api, "on_hopper", lambda: False)
    assert api.resolve_impl("auto") == "reference"
    monkeypatch.setattr(api, "on_hopper", lambda: True)
    assert api.resolve_impl("auto") == "mosaic"
    with pytest.raises(ValueError, match="expected one of auto, reference, mosaic"):
        fp8_grouped_gemm(jnp.ones((8, 128)), jnp.ones((2, 128, 128)), jnp.array([4, 4]), impl="cuda")


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
@pytest.mark.parametrize("into", [False, True])
def test_wgrad_no_races(kernel_races, monkeypatch, into):
    """No race in the kernel, also when it writes bf16 into a ref with the squares (`out=`)."""
    monkeypatch.setattr(mw, "default_interpret", lambda: _hopper.interpret_params(detect_races=True))
    gs = jnp.asarray((60, 0, 200, 0), jnp.int32)
    (xq, xs), (dq, ds), _ = wgrad_operands(3, 260, 256, 256, gs)
    if into:
        def run(xq, xs, dq, ds):
            ref = jax.empty_ref(jax.ShapeDtypeStruct((E, 256, 256), jnp.bfloat16))
            sq = jax.empty_ref(jax.ShapeDtypeStruct((E, 4, 256), jnp.float32))
            fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs, out=ref, out_row=0, sq_out=sq)
            return ref[...], sq[...]
        finished(jax.jit(run)(xq, xs, dq, ds))
    else:
        finished(fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs))
    assert len(kernel_races) == 1 and not any(kernel_races), kernel_races


def test_wgrad_refusals():
    gs = jnp.asarray((100, 28), jnp.int32)
    (xq, xs), (dq, ds), _ = wgrad_operands(4, 128, 256, 128, gs)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_grouped_wgrad(xq.T.astype(jnp.bfloat16), xs, dq.T, ds, gs)
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_grouped_wgrad(xq.T[:, :200], xs, dq.T[:, :200], ds, gs)
    with pytest.raises(ValueError, match="token mismatch"):
        fp8_grouped_wgrad(xq.T, xs, dq.T[:, :128], ds, gs)
    with pytest.raises(ValueError, match="scale shapes"):
        fp8_grouped_wgrad(xq.T, xs.T, dq.T, ds, gs)
    with pytest.raises(ValueError, match="tile_n=256"):
        fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs, config=WgradConfig(tile_n=256))


@pytest.mark.parametrize("tile_n,width", [(128, 64), (256, 256)])
def test_grouped_wgrad_writes_its_rows_of_a_ref_in_place(tile_n, width):
    """out=ref, out_row=E: the kernel writes its fp32 sums cast once to the ref's dtype (bf16)
    into rows E .. 2E of a [3E, K, N] ref and nothing else (the other rows keep their values),
    bitwise the fp32 output cast; sq_out gets at the same rows, per row and `width` columns,
    the sums of squares of the bf16 values stored."""
    gs = jnp.asarray(GROUPS["empty"], jnp.int32)
    m, k, n = 320, 256, 512
    (xq, xs), (dq, ds), _ = wgrad_operands(21 + tile_n, m, k, n, gs)
    config = WgradConfig(tile_n=tile_n)
    want = finished(fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs, config=config)).astype(jnp.bfloat16)
    fill = jax.random.normal(jax.random.key(3), (3 * E, k, n)).astype(jnp.bfloat16)
    sq_fill = jnp.full((3 * E, n // width, k), -1.0, jnp.float32)

    @jax.jit
    def into(fill, sq_fill):
        ref, sq = jax.new_ref(fill), jax.new_ref(sq_fill)
        assert fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs, config=config, out=ref, out_row=E, sq_out=sq) is None
        return ref[...], sq[...]

    got, sq = (np.asarray(a, np.float32) for a in finished(into(fill, sq_fill)))
    want, fill = np.asarray(want, np.float32), np.asarray(fill, np.float32)
    assert np.abs(want).max() > 0
    np.testing.assert_array_equal(got[E:2 * E], want)
    np.testing.assert_array_equal(got[:E], fill[:E])
    np.testing.assert_array_equal(got[2 * E:], fill[2 * E:])
    squares = np.square(want.astype(np.float64)).reshape(E, k, n // width, width).sum(-1).transpose(0, 2, 1)
    np.testing.assert_allclose(sq[E:2 * E], squares, rtol=1e-6)
    assert (sq[:E] == -1).all() and (sq[2 * E:] == -1).all()


def test_grouped_wgrad_refuses_sinks_that_do_not_fit():
    gs = jnp.asarray((100, 28), jnp.int32)
    (xq, xs), (dq, ds), _ = wgrad_operands(4, 128, 256, 128, gs)
    ref = jnp.zeros((4, 256, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="out:"):
        fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs, out=jnp.zeros((4, 256, 256), jnp.bfloat16), out_row=0)
    with pytest.raises(ValueError, match="out:"):
        fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs, out=ref)  # no out_row
    with pytest.raises(ValueError, match="sq_out"):  # chunks of 32 columns
        fp8_grouped_wgrad(xq.T, xs, dq.T, ds, gs, out=ref, out_row=0, sq_out=jnp.zeros((4, 4, 256)))


@pytest.mark.parametrize("impl,k", [("mosaic", 256), ("mosaic", 200), ("reference", 256)])
def test_fp8_grouped_gemm_dw_sink_writes_the_stacked_gradient(impl, k, monkeypatch):
    """fp8_grouped_gemm(dw_sink=(ref, l E, sq)) in each layer of a stack: every layer's weight
    gradient lands in rows l E .. (l + 1) E of one uninitialised ref, bitwise the per-layer
    gradients of plain autodiff (in the weights' dtype, bf16), and sq (`dw_sq_shape`) sums to
    each layer's ||dW||^2; the weights themselves get zero gradients. "mosaic" with K a multiple
    of 128: the wgrad kernel writes both in place; K = 200: dw then the ref's dynamic update."""
    from pallas_kernels.moe import dw_sq_shape
    m, n, layers = 300, 128, 2
    gs = jnp.asarray(GROUPS["empty"], jnp.int32)
    kx, kw, kr = jax.random.split(jax.random.key(k), 3)
    xs = [varied(key, (m, k)).astype(jnp.bfloat16) for key in jax.random.split(kx, layers)]
    stack = (jax.random.normal(kw, (layers, E, k, n)) * 0.05).astype(jnp.bfloat16)
    cot = jax.random.normal(kr, (m, n))
    shape = dw_sq_shape((layers * E, k, n), stack.dtype)
    writes = []
    real = api.mosaic_grouped_wgrad.fp8_grouped_wgrad

    def spy(*a, **kw):
        writes.append(kw.get("out") is not None)
        return real(*a, **kw)

    def loss(stack, ref=None, sq=None):
        y = 0.0
        for i in range(layers):
            sink = None if ref is None else (ref, i * E, sq)
            y = y + fp8_grouped_gemm(xs[i], stack[i], gs, impl=impl, dw_sink=sink).astype(jnp.float32)
        return jnp.sum(y * cot)

    @jax.jit
    def sunk(stack):
        ref = jax.empty_ref(jax.ShapeDtypeStruct((layers * E, k, n), stack.dtype))
        sq = jax.empty_ref(jax.ShapeDtypeStruct(shape, jnp.float32))
        g = jax.grad(loss)(stack, ref, sq)
        return g, ref[...].reshape(stack.shape), sq[...]

    want = np.asarray(finished(jax.jit(jax.grad(loss))(stack)), np.float32)
    monkeypatch.setattr(api.mosaic_grouped_wgrad, "fp8_grouped_wgrad", spy)
    g_w, got, sq = finished(sunk(stack))
    assert writes == ([True] * layers if impl == "mosaic" and k % 128 == 0 else
                      [False] * layers if impl == "mosaic" else [])
    assert np.abs(want).max() > 0 and not bool(jnp.any(g_w != 0))
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    for i in range(layers):
        np.testing.assert_allclose(float(jnp.sum(sq[i * E:(i + 1) * E])),
                                   float(np.sum(np.square(want[i].astype(np.float64)))), rtol=1e-6)
    with pytest.raises(ValueError, match="dw_sink"):
        fp8_grouped_gemm(xs[0], stack[0], gs, impl=impl,
                         dw_sink=(jnp.zeros((E, k, n), jnp.float32), 0))


def test_grouped_wgrad_lowers_for_hopper():
    """Mosaic GPU lowering for CUDA on this CPU (a stand-in H100 for `_hopper.target_device`): the
    grouped wgrad kernel returning fp32 dW and writing bf16 dW with its squares into refs, each
    with the branch that stores an expert without rows as zeros beside the pipeline."""
    import re

    class H100:
        platform, compute_capability, core_count = "gpu", "9.0", 132
    f8, f32, S = jnp.float8_e4m3fn, jnp.float32, jax.ShapeDtypeStruct
    ops = (S((256, 640), f8), S((5, 256), f32), S((256, 640), f8), S((5, 256), f32), S((E,), jnp.int32))

    def into(xq, xs, dq, ds, gs):
        ref = jax.empty_ref(S((E, 256, 256), jnp.bfloat16))
        sq = jax.empty_ref(S((E, 4, 256), f32))
        fp8_grouped_wgrad(xq, xs, dq, ds, gs, out=ref, out_row=0, sq_out=sq)
        return ref[...], sq[...]
    for fn in (fp8_grouped_wgrad, into):
        with _hopper.target_device(H100()):
            text = jax.jit(fn).trace(*ops).lower(lowering_platforms=("cuda",)).as_text()
        assert len(re.findall(r'kernel_hash = "', text)) == 1
