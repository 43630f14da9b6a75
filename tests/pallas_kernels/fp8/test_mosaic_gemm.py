"""The Mosaic GPU FP8 block-scaled GEMMs in GPU interpret mode: random normal operands quantised
locally (1 x 128 activation tiles, 128 x 128 weight blocks, e4m3), against the fp32 sum over K
blocks of the dequantised products; dense and grouped, both tile widths, row padding, race
detection, and the refusals."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _hopper
from pallas_kernels.fp8 import mosaic_gemm
from pallas_kernels.fp8.mosaic_gemm import Fp8Config, fp8_gemm_blockwise, fp8_gmm_blockwise

E4M3_MAX = 448.0
WIDE = Fp8Config(tile_n=256, overlap=False)  # two 128-column scale blocks per CTA tile
PLAIN = Fp8Config(overlap=False)             # fold after each wgmma, tile_n 128
PAIR_M = Fp8Config(cluster="m")              # 2-CTA clusters sharing b_q's tiles (multicast)
PAIR_N = Fp8Config(cluster="n")              # 2-CTA clusters sharing a_q's tiles


def quant_rows(x):
    """[M, K] -> e4m3 [M, K], scales [M, K/128] (per row and 128 columns)."""
    m, k = x.shape
    xb = x.reshape(m, k // 128, 128)
    s = jnp.max(jnp.abs(xb), -1) / E4M3_MAX
    s = jnp.where(s == 0, 1.0, s)
    return (xb / s[..., None]).astype(jnp.float8_e4m3fn).reshape(m, k), s.astype(jnp.float32)


def quant_blocks(w):
    """[N, K] -> e4m3 [N, K], scales [N/128, K/128] (per 128 x 128 block)."""
    n, k = w.shape
    wb = w.reshape(n // 128, 128, k // 128, 128)
    s = jnp.max(jnp.abs(wb), (1, 3)) / E4M3_MAX
    q = (wb / s[:, None, :, None]).astype(jnp.float8_e4m3fn)
    return q.reshape(n, k), s.astype(jnp.float32)


def reference(a_q, a_s, b_q, b_s):
    """fp32 sum_kb (a_q[:, kb] @ b_q[:, kb]^T) * a_s[:, kb] * b_s[:, kb] (float64 in numpy)."""
    m, k = a_q.shape
    n = b_q.shape[0]
    a = np.asarray(a_q.astype(jnp.float32), np.float64).reshape(m, k // 128, 128)
    b = np.asarray(b_q.astype(jnp.float32), np.float64).reshape(n, k // 128, 128)
    parts = np.einsum("mkc,nkc->kmn", a, b)
    sb = np.repeat(np.asarray(b_s, np.float64), 128, axis=0)  # [N, KB]
    return np.einsum("kmn,mk,nk->mn", parts, np.asarray(a_s, np.float64), sb)


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def dense_operands(m, n, k, seed):
    ka, kb, kc = jax.random.split(jax.random.key(seed), 3)
    # rows of different magnitudes, so that the per-row scales matter
    a = jax.random.normal(ka, (m, k)) * jnp.exp(jax.random.normal(kc, (m, 1)))
    a_q, a_s = quant_rows(a)
    b_q, b_s = quant_blocks(jax.random.normal(kb, (n, k)) * 0.05)
    return a_q, a_s, b_q, b_s


@pytest.mark.parametrize("m,n,k,config", [(256, 256, 384, None), (256, 512, 384, WIDE),
                                          (200, 256, 256, PLAIN), (256, 256, 384, PAIR_M),
                                          (128, 512, 256, PAIR_N)])
def test_dense_matches_blockwise_reference(m, n, k, config):
    a_q, a_s, b_q, b_s = dense_operands(m, n, k, seed=m + n)
    ref = reference(a_q, a_s, b_q, b_s)
    out = fp8_gemm_blockwise(a_q, a_s, b_q, b_s, out_dtype=jnp.float32, config=config)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    assert rel_err(out, ref) < 1e-5
    if config is None:  # bf16 output: the fp32 result rounded once
        out16 = fp8_gemm_blockwise(a_q, a_s, b_q, b_s)
        assert out16.dtype == jnp.bfloat16
        assert rel_err(out16, ref) < 4e-3
        np.testing.assert_allclose(np.asarray(out16, np.float32),
                                   np.asarray(out.astype(jnp.bfloat16), np.float32),
                                   rtol=1e-2, atol=1e-3 * np.abs(ref).max())


def test_scales_are_applied_per_block():
    """Scaling one activation block or one weight block scales exactly its contribution."""
    m, n, k = 128, 256, 384
    a_q, a_s, b_q, b_s = dense_operands(m, n, k, seed=3)
    base = np.asarray(fp8_gemm_blockwise(a_q, a_s, b_q, b_s, out_dtype=jnp.float32))
    b_s2 = b_s.at[1, 2].multiply(4.0)  # columns 128..255, K block 2
    a_s2 = a_s.at[5, 0].multiply(0.0)  # row 5, K block 0
    out = np.asarray(fp8_gemm_blockwise(a_q, a_s2, b_q, b_s2, out_dtype=jnp.float32))
    np.testing.assert_allclose(out, reference(a_q, a_s2, b_q, b_s2), rtol=1e-4,
                               atol=1e-5 * np.abs(base).max())
    assert not np.allclose(out[:, 128:], base[:, 128:])
    np.testing.assert_allclose(out[np.arange(m) != 5, :128], base[np.arange(m) != 5, :128],
                               rtol=1e-6, atol=1e-6 * np.abs(base).max())


def grouped_operands(m, n, k, e, seed):
    a_q, a_s, _, _ = dense_operands(m, n, k, seed)
    ws = jax.random.normal(jax.random.key(seed + 1), (e, n, k)) * 0.05
    qs = [quant_blocks(ws[i]) for i in range(e)]
    return a_q, a_s, jnp.stack([q for q, _ in qs]), jnp.stack([s for _, s in qs])


def grouped_reference(a_q, a_s, b_q, b_s, gs):
    ends = np.cumsum(np.asarray(gs))
    ref = np.zeros((a_q.shape[0], b_q.shape[1]))
    for g, (lo, hi) in enumerate(zip(ends - np.asarray(gs), ends)):
        if hi > lo:
            ref[lo:hi] = reference(a_q[lo:hi], a_s[lo:hi], b_q[g], b_s[g])
    return ref, ends[-1]


@pytest.mark.parametrize("m,gs,config", [(384, (100, 0, 37, 200), None),
                                         (300, (10, 150, 133), WIDE),
                                         (384, (100, 0, 37, 200), PAIR_N)])
def test_grouped_matches_per_group_reference(m, gs, config):
    n, k = (256, 256) if config is None else (512, 256)
    gs = jnp.asarray(gs, jnp.int32)
    a_q, a_s, b_q, b_s = grouped_operands(m, n, k, len(gs), seed=m)
    out = fp8_gmm_blockwise(a_q, a_s, b_q, b_s, gs, out_dtype=jnp.float32, config=config)
    ref, total = grouped_reference(a_q, a_s, b_q, b_s, gs)
    assert out.shape == (m, n)
    assert rel_err(out, ref) < 1e-5
    assert np.all(np.asarray(out)[total:] == 0)  # rows past sum(group_sizes)


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
def test_no_races(kernel_races, monkeypatch):
    """GPU interpret mode with race detection: dense (both fold schedules, both cluster
    pairings) and grouped (alone and paired)."""
    monkeypatch.setattr(mosaic_gemm, "default_interpret",
                        lambda: _hopper.interpret_params(detect_races=True))
    a_q, a_s, b_q, b_s = dense_operands(256, 256, 384, seed=7)
    outs = [fp8_gemm_blockwise(a_q, a_s, b_q, b_s, out_dtype=jnp.float32, config=c)
            for c in (None, PLAIN, PAIR_M, PAIR_N)]
    gs = jnp.asarray([70, 0, 130], jnp.int32)
    ga = grouped_operands(256, 256, 256, 3, seed=8)
    outs += [fp8_gmm_blockwise(*ga, gs, out_dtype=jnp.float32, config=c) for c in (None, PAIR_N)]
    jax.block_until_ready(outs)
    assert len(kernel_races) == len(outs) and not any(kernel_races), kernel_races


def test_refusals():
    a_q, a_s, b_q, b_s = dense_operands(128, 256, 256, seed=1)
    with pytest.raises(ValueError, match="multiples of 128"):  # K
        fp8_gemm_blockwise(a_q[:, :192], a_s[:, :2], b_q[:, :192], b_s)
    with pytest.raises(ValueError, match="multiples of 128"):  # N
        fp8_gemm_blockwise(a_q, a_s, b_q[:192], b_s[:2])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm_blockwise(a_q.astype(jnp.bfloat16), a_s, b_q, b_s)
    with pytest.raises(ValueError, match="scale shapes"):
        fp8_gemm_blockwise(a_q, a_s, b_q, b_s.T[:1])
    with pytest.raises(ValueError, match="overlap needs tile_n=128"):
        fp8_gemm_blockwise(a_q, a_s, b_q, b_s, config=Fp8Config(tile_n=256))
    with pytest.raises(ValueError, match="group_sizes shape"):
        fp8_gmm_blockwise(a_q, a_s, b_q[None], b_s[None], jnp.zeros((2,), jnp.int32))
    # 2-CTA clusters: row-tile pairs only for one weight tile (dense), an even tile count
    with pytest.raises(ValueError, match="dense only"):
        fp8_gmm_blockwise(a_q, a_s, b_q[None], b_s[None], jnp.full((1,), 128, jnp.int32), config=PAIR_M)
    with pytest.raises(ValueError, match="even number of row tiles, got 1"):
        fp8_gemm_blockwise(a_q, a_s, b_q, b_s, config=PAIR_M)
    with pytest.raises(ValueError, match="cluster='k'"):
        fp8_gemm_blockwise(a_q, a_s, b_q, b_s, config=Fp8Config(cluster="k"))
