"""FP8 E4M3 quantisers and GEMM references (pallas_kernels/fp8/reference.py): round-trip error
bound, ideal (round-to-nearest-even) rounding, scale shapes with partial tiles, zero tiles, and
the promoted blockwise GEMMs against float64 sums of the same operands.

The bound: E4M3 keeps 3 mantissa bits, so rounding x / s (in [-448, 448]) to nearest costs at
most half a unit in the last place, 2^-4 of the value in the normal range (|x / s| >= 2^-6), and
half the subnormal spacing 2^-9, i.e. 2^-10, below it: |q s - x| <= max(2^-4 |x|, 2^-10 s)."""
import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.fp8 import reference as R


def heavy(key, shape):
    """Random values over several binades (normal times log-normal), never exactly zero."""
    a, b = jax.random.split(key)
    return jax.random.normal(a, shape) * jnp.exp(1.5 * jax.random.normal(b, shape)) + 1e-3


def _within_bound(x, deq, s_full):
    x, deq, s_full = (np.asarray(v, np.float64) for v in (x, deq, s_full))
    bound = np.maximum(2.0 ** -4 * np.abs(x), 2.0 ** -10 * s_full) * (1 + 1e-6) + 1e-30
    return np.abs(deq - x) <= bound


@pytest.mark.parametrize("shape", [(200, 300), (37, 1000), (5, 64), (128, 128)])
def test_round_trip_bound_and_scale_shapes(shape):
    m, k = shape
    x = heavy(jax.random.PRNGKey(m * k), shape)
    cd = lambda n: -(-n // 128)  # noqa: E731
    q, s = R.quantize_rows_1x128(x)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    assert q.shape == (m, k) and s.shape == (m, cd(k))
    assert _within_bound(x, R.dequantize_rows_1x128(q, s), R._expand(s, k, 1)).all()
    q, s = R.quantize_cols_128x1(x)
    assert q.shape == (m, k) and s.shape == (cd(m), k)
    assert _within_bound(x, R.dequantize_cols_128x1(q, s), R._expand(s, m, 0)).all()
    qt, st = R.quantize_cols_128x1_t(x)  # the same tiles written transposed, bitwise
    assert qt.shape == (k, m) and st.shape == (k, cd(m))
    np.testing.assert_array_equal(np.asarray(qt.astype(jnp.float32)), np.asarray(q.astype(jnp.float32)).T)
    np.testing.assert_array_equal(np.asarray(st), np.asarray(s).T)
    q, s = R.quantize_blocks_128x128(x)
    assert q.shape == (m, k) and s.shape == (cd(m), cd(k))
    s_full = R._expand(R._expand(s, m, 0), k, 1)
    assert _within_bound(x, R.dequantize_blocks_128x128(q, s), s_full).all()
    # the scale is amax / 448 of each block, partial edge blocks included
    xp = np.zeros((cd(m) * 128, cd(k) * 128))
    xp[:m, :k] = np.abs(np.asarray(x))
    amax = xp.reshape(cd(m), 128, cd(k), 128).max(axis=(1, 3))
    np.testing.assert_allclose(np.asarray(s), amax / 448.0, rtol=1e-6)


def test_rounding_is_ideal_round_to_nearest_even():
    """q equals ml_dtypes' own E4M3 rounding (round to nearest even) of x / s, and the largest
    element of each tile lands on +-448 exactly."""
    x = heavy(jax.random.PRNGKey(3), (64, 384))
    q, s = R.quantize_rows_1x128(x)
    scaled = np.asarray(x, np.float32) / np.repeat(np.asarray(s), 128, axis=1)
    want = np.clip(scaled, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want.view(np.uint8))
    top = np.abs(np.asarray(q, np.float32)).reshape(64, 3, 128).max(axis=-1)
    np.testing.assert_array_equal(top, 448.0)


def test_zero_tiles_get_unit_scales_and_exact_zeros():
    x = np.array(heavy(jax.random.PRNGKey(4), (130, 260)))
    x[:, 128:256] = 0.0  # a zero 1 x 128 tile in every row, and zero 128 x 128 blocks
    x[128:, :] = 0.0  # a zero 128 x 1 tile in every column (partial: rows 128, 129)
    for quant, deq in ((R.quantize_rows_1x128, R.dequantize_rows_1x128),
                       (R.quantize_cols_128x1, R.dequantize_cols_128x1),
                       (R.quantize_blocks_128x128, R.dequantize_blocks_128x128)):
        q, s = quant(jnp.asarray(x))
        assert np.isfinite(np.asarray(s)).all() and (np.asarray(s) > 0).all()
        back = np.asarray(deq(q, s))
        assert (back[x == 0] == 0).all() and np.isfinite(back).all()
    _, s = R.quantize_rows_1x128(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(s)[:, 1], 1.0)
    _, s = R.quantize_cols_128x1(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(s)[1], 1.0)


def _f64(q, s_full):
    return np.asarray(q, np.float64) * np.asarray(s_full, np.float64)


def test_blockwise_and_1d1d_gemms_are_the_promoted_sums():
    """The references equal float64 sums of the same E4M3 operands to fp32 rounding."""
    ka, kb = jax.random.split(jax.random.PRNGKey(5))
    a, b = heavy(ka, (70, 300)), heavy(kb, (150, 300))
    a_q, a_s = R.quantize_rows_1x128(a)
    b_q, b_s = R.quantize_blocks_128x128(b)
    got = np.asarray(R.gemm_blockwise_reference(a_q, a_s, b_q, b_s))
    want = _f64(a_q, R._expand(a_s, 300, 1)) @ _f64(b_q, R._expand(R._expand(b_s, 150, 0), 300, 1)).T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    b_q, b_s = R.quantize_rows_1x128(b)
    got = np.asarray(R.gemm_1d1d_reference(a_q, a_s, b_q, b_s, out_dtype=jnp.bfloat16), np.float64)
    want = _f64(a_q, R._expand(a_s, 300, 1)) @ _f64(b_q, R._expand(b_s, 300, 1)).T
    np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max())


def test_grouped_references_with_empty_experts_and_unused_rows():
    keys = jax.random.split(jax.random.PRNGKey(6), 3)
    m, k, n, e = 300, 200, 144, 5
    gs = jnp.array([90, 0, 140, 0, 50])  # 280 rows used, two empty experts
    x, w, dy = heavy(keys[0], (m, k)), heavy(keys[1], (e, k, n)), heavy(keys[2], (m, n))
    x_q, x_s = R.quantize_rows_1x128(x)
    w_q, w_s = jax.vmap(R.quantize_blocks_128x128)(w)
    got = np.asarray(R.grouped_gemm_blockwise_reference(x_q, x_s, w_q, w_s, gs))
    xd = _f64(x_q, R._expand(x_s, k, 1))
    wd = np.stack([_f64(w_q[i], R._expand(R._expand(w_s[i], k, 0), n, 1)) for i in range(e)])
    g = np.asarray(R.row_groups(gs, m))
    want = np.stack([xd[i] @ wd[g[i]] if g[i] < e else np.zeros(n) for i in range(m)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert (got[280:] == 0).all()
    # weight gradient: 128-row tiles restart at every expert (never span two), per-tile scales
    x_p, tile_group, dest = R.pad_groups(x, gs)
    dy_p, _, _ = R.pad_groups(dy, gs)
    assert x_p.shape[0] % 128 == 0
    # every row at its padded row, zeros everywhere else
    want_p = np.zeros(x_p.shape, np.float32)
    used = np.asarray(dest) < x_p.shape[0]
    want_p[np.asarray(dest)[used]] = np.asarray(x)[used]
    np.testing.assert_array_equal(np.asarray(x_p), want_p)
    # a group's tiles start at its first row rounded down to 8 (90 -> 88, 230 -> 224), and a
    # tile past x's 304 rows (300 rounded up to 8) reads the 128 rows ending there instead:
    # expert 2's second tile (rows 216.. ) and expert 4's tile (rows 224..) read rows 176..303
    assert used.sum() == 280 and np.asarray(dest)[used].tolist() == (
        list(range(90)) + list(range(128 + 2, 256)) + list(range(256 + 40, 256 + 54))
        + list(range(384 + 54, 384 + 104)))
    assert np.asarray(tile_group)[:4].tolist() == [0, 2, 2, 4]
    xt_q, xt_s = R.quantize_cols_128x1(x_p)
    dyt_q, dyt_s = R.quantize_cols_128x1(dy_p)
    dw = np.asarray(R.grouped_wgrad_reference(xt_q, xt_s, dyt_q, dyt_s, tile_group, e))
    ends = np.cumsum(np.asarray(gs))
    for i in range(e):
        start = ends[i] - int(gs[i])
        rows = slice(start, ends[i])
        if int(gs[i]) == 0:
            assert (dw[i] == 0).all()
            continue
        # the group's rows quantised on their own, in 128-row tiles from the group's first row
        # rounded down to 8 (zeros before it; moving a tile back changes no tile's rows)
        lead = ((start % 8, 0), (0, 0))
        a_q, a_s = R.quantize_cols_128x1(jnp.pad(x[rows], lead))
        b_q, b_s = R.quantize_cols_128x1(jnp.pad(dy[rows], lead))
        want = _f64(a_q, R._expand(a_s, a_q.shape[0], 0)).T @ _f64(b_q, R._expand(b_s, b_q.shape[0], 0))
        np.testing.assert_allclose(dw[i], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
