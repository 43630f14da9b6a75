"""The Mosaic GPU FP8 weight-gradient ("1D1D") GEMM in GPU interpret mode: x and dy of a linear
layer quantised in 128 x 1 tiles (per channel, 128 tokens) and written token-major
(`quantize_cols_128x1_t`), dw = x^T dy against `gemm_1d1d_reference` (the same per-128-token
promoted sum in fp32) and against the float64 sum of the same E4M3 operands; both fold
schedules and tile widths, row padding, the outer-product promotion, race detection, refusals.

Error scale: the products of two E4M3 values are exact in fp32 and every 128-term block sum
is rounded in fp32 (2^-24 relative per addition), so kernel and references agree to ~1e-7
relative; against the unquantised fp32 x^T dy the E4M3 rounding of both operands costs ~3.5 %
(the kernel adds nothing measurable to it)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _hopper
from pallas_kernels.fp8 import mosaic_wgrad
from pallas_kernels.fp8 import reference as R
from pallas_kernels.fp8.mosaic_gemm import Fp8Config
from pallas_kernels.fp8.mosaic_wgrad import fp8_gemm_1d1d

OVERLAP = Fp8Config(overlap=True)               # fold step k - 1 while step k's wgmma runs
WIDE = Fp8Config(tile_n=256, overlap=False)     # two 128-column blocks per CTA tile


def operands(tokens, k, n, seed):
    """x [T, K] with channels of different magnitudes and dy [T, N] with tokens of different
    magnitudes (so both scale vectors matter), quantised for the weight gradient."""
    kx, kd, kc, kt = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(kx, (tokens, k)) * jnp.exp(jax.random.normal(kc, (1, k)))
    dy = jax.random.normal(kd, (tokens, n)) * jnp.exp(jax.random.normal(kt, (tokens, 1)))
    return x, dy, R.quantize_cols_128x1_t(x) + R.quantize_cols_128x1_t(dy)


def f64_reference(a_q, a_s, b_q, b_s):
    """sum_kb (a_q[:, kb] . b_q[:, kb]) * a_s[:, kb] * b_s[:, kb] in float64."""
    m, k = a_q.shape
    n = b_q.shape[0]
    a = np.asarray(a_q.astype(jnp.float32), np.float64).reshape(m, k // 128, 128)
    b = np.asarray(b_q.astype(jnp.float32), np.float64).reshape(n, k // 128, 128)
    return np.einsum("mkc,nkc,mk,nk->mn", a, b, np.asarray(a_s, np.float64),
                     np.asarray(b_s, np.float64))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite output"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("tokens,k,n,config", [(384, 256, 256, None), (256, 200, 256, OVERLAP),
                                                (256, 128, 512, WIDE)])
def test_wgrad_matches_1d1d_reference(tokens, k, n, config):
    x, dy, (a_q, a_s, b_q, b_s) = operands(tokens, k, n, seed=tokens + k + n)
    out = fp8_gemm_1d1d(a_q, a_s, b_q, b_s, config=config)
    assert out.shape == (k, n) and out.dtype == jnp.float32
    ref = R.gemm_1d1d_reference(a_q, a_s, b_q, b_s)
    err_ref, err64 = rel(out, ref), rel(out, f64_reference(a_q, a_s, b_q, b_s))
    ideal = rel(ref, x.T @ dy)  # the E4M3 rounding of both operands
    print(f"||kernel - 1d1d ref|| / ||ref|| = {err_ref:.1e}, vs float64 {err64:.1e}; "
          f"kernel vs fp32 x^T dy {rel(out, x.T @ dy):.3e}, ideal rounding's {ideal:.3e}")
    assert err_ref < 1e-6 and err64 < 1e-6
    assert ideal < 0.05 and abs(rel(out, x.T @ dy) - ideal) < 1e-6


def test_promotion_is_an_outer_product_per_block():
    """Scaling one row's or one column's scale of one token block scales exactly that row's
    or column's contribution of that block."""
    _, _, (a_q, a_s, b_q, b_s) = operands(256, 128, 256, seed=5)
    base = np.asarray(fp8_gemm_1d1d(a_q, a_s, b_q, b_s))
    a_s2 = a_s.at[7, 1].multiply(0.0)     # row 7, tokens 128..255
    b_s2 = b_s.at[200, 0].multiply(4.0)   # column 200, tokens 0..127
    out = np.asarray(fp8_gemm_1d1d(a_q, a_s2, b_q, b_s2))
    ref = f64_reference(a_q, a_s2, b_q, b_s2)
    assert rel(out, ref) < 1e-6
    others_r, others_c = np.arange(128) != 7, np.arange(256) != 200
    np.testing.assert_allclose(out[np.ix_(others_r, others_c)], base[np.ix_(others_r, others_c)],
                               rtol=1e-6, atol=1e-6 * np.abs(base).max())
    assert not np.allclose(out[7], base[7]) and not np.allclose(out[:, 200], base[:, 200])


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
def test_no_races(kernel_races, monkeypatch):
    monkeypatch.setattr(mosaic_wgrad, "default_interpret",
                        lambda: _hopper.interpret_params(detect_races=True))
    _, _, ops = operands(384, 256, 256, seed=9)
    outs = [fp8_gemm_1d1d(*ops, config=c) for c in (None, OVERLAP)]
    jax.block_until_ready(outs)
    assert len(kernel_races) == len(outs) and not any(kernel_races), kernel_races


def test_refusals():
    _, _, (a_q, a_s, b_q, b_s) = operands(256, 128, 256, seed=1)
    with pytest.raises(ValueError, match="K a multiple of 128"):
        fp8_gemm_1d1d(a_q[:, :192], a_s, b_q[:, :192], b_s)
    with pytest.raises(ValueError, match="N a multiple of tile_n"):
        fp8_gemm_1d1d(a_q, a_s, b_q[:192], b_s[:192])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm_1d1d(a_q.astype(jnp.bfloat16), a_s, b_q, b_s)
    with pytest.raises(ValueError, match="scale shapes"):
        fp8_gemm_1d1d(a_q, a_s[:, :1], b_q, b_s)
    with pytest.raises(ValueError, match="overlap needs tile_n=128"):
        fp8_gemm_1d1d(a_q, a_s, b_q, b_s, config=Fp8Config(tile_n=256))


class _H100:
    """A stand-in Hopper device for `_hopper.target_device` (lowering only)."""
    platform, compute_capability, core_count = "gpu", "9.0", 132


def _kernel_hashes(fn, *args):
    import re
    with _hopper.target_device(_H100()):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)


def test_kernels_lower_for_hopper():
    """Mosaic GPU lowering (layout inference of the column scales included) for CUDA on this
    CPU: the wgrad kernel in its three configs, and fp8_linear's forward + backward at
    kv_a_proj_with_mqa's shape (2048 -> 576, N padded to 640) as six distinct kernels (three
    GEMMs, the fused quantisation of x and of dy, the weight's block quantisation)."""
    from pallas_kernels.fp8 import fp8_linear
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    S = jax.ShapeDtypeStruct
    ops = (S((384, 512), f8), S((384, 4), f32), S((512, 512), f8), S((512, 4), f32))
    for cfg in (None, OVERLAP, WIDE):
        assert len(_kernel_hashes(lambda *o, cfg=cfg: fp8_gemm_1d1d(*o, config=cfg), *ops)) == 1

    def fwd_bwd(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, impl="mosaic"), x, w)
        return (y,) + vjp(dy)

    hashes = _kernel_hashes(fwd_bwd, S((512, 2048), jnp.bfloat16), S((2048, 576), f32),
                            S((512, 576), jnp.bfloat16))
    assert len(hashes) == 6 and len(set(hashes)) == 6
