"""The split-context MLA decode kernel (`pallas_kernels.mla_decode`, Mosaic GPU in GPU interpret
mode here) against the fp32 reference and against the same maths with P rounded to bf16 before
the P . c_kv product (what the kernel does, and XLA's absorbed path too): random latents, ragged
valid lengths, a split with no valid slot, holes in the middle (a sinks + window cache), padded
heads; the split choice; refusals; race detection; the lowering for a Hopper GPU from this CPU."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _hopper
from pallas_kernels.mla_decode import api, mla_decode, mosaic
from pallas_kernels.mla_decode import reference as R


def operands(b, h, s, c=512, r=64, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    q_lat = (jax.random.normal(k[0], (b, h, c)) * 0.05).astype(jnp.bfloat16)
    q_rope = (jax.random.normal(k[1], (b, h, r)) * 0.3).astype(jnp.bfloat16)
    c_kv = jax.random.normal(k[2], (b, s, c)).astype(jnp.bfloat16)
    k_rope = jax.random.normal(k[3], (b, s, r)).astype(jnp.bfloat16)
    return q_lat, q_rope, c_kv, k_rope


def p_rounded(q_lat, q_rope, c_kv, k_rope, bias, scale):
    """The reference with P rounded to bf16 before the product with c_kv (normalised after)."""
    f32, hp = jnp.float32, jax.lax.Precision.HIGHEST
    s = (jnp.einsum("bhc,bsc->bhs", q_lat.astype(f32), c_kv.astype(f32), precision=hp)
         + jnp.einsum("bhr,bsr->bhs", q_rope.astype(f32), k_rope.astype(f32), precision=hp))
    s = s * scale + bias[:, None, :]
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    o = jnp.einsum("bhs,bsc->bhc", p.astype(jnp.bfloat16).astype(f32), c_kv.astype(f32), precision=hp)
    return o / jnp.sum(p, axis=-1)[..., None]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_kernel_matches_the_references():
    """2 rows x 16 heads (padded to 64) x 256 slots in 2 splits of 2 steps: row 0 valid up to
    slot 200, row 1 a sinks + window pattern (slots 0-3 and 150-255) and, for the split
    [0, 128), only its first 4 slots. The kernel rounds P to bf16 (relative to its running
    max) for the P . c_kv product, as XLA's absorbed path rounds it (relative to the row's
    max): its error against fp32 is that rounding's, ~2^-9 per element, so it must stay within
    1.25x of the error of P rounded once at the row's max."""
    b, h, s = 2, 16, 256
    q_lat, q_rope, c_kv, k_rope = operands(b, h, s)
    pos = jnp.arange(s)
    valid = jnp.stack([pos < 200, (pos < 4) | (pos >= 150)])
    bias = jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32)
    scale = 0.1
    pad = ((0, 0), (0, 64 - h), (0, 0))
    o, m2, l = mosaic.mla_decode_partial(jnp.pad(q_lat, pad), jnp.pad(q_rope, pad), c_kv, k_rope,
                                         bias, scale=scale, splits=2)
    assert o.shape == (b, 2, 64, 512) and m2.shape == l.shape == (b, 2, 64)
    got = R.combine_splits(o, m2, l)[:, :h]
    want = R.mla_decode_reference(q_lat, q_rope, c_kv, k_rope, bias, scale)
    ideal = rel(p_rounded(q_lat, q_rope, c_kv, k_rope, bias, scale), want)
    assert 1e-4 < ideal < 4e-3 and rel(got, want) < 1.25 * ideal, (rel(got, want), ideal)
    # the same through the api (impl="mosaic", the split count of `pick_splits`)
    got_api = mla_decode(q_lat, q_rope, c_kv, k_rope, bias, scale, impl="mosaic")
    assert got_api.shape == (b, h, 512) and rel(got_api, got) < 1e-6



def int8_cache(c_kv):
    """c_kv quantised per token as `dsjax.model.decode.quantize_int8` does: (int8, scales)."""
    x = c_kv.astype(jnp.float32)
    sc = jnp.max(jnp.abs(x), axis=-1) / 127.0
    q = jnp.clip(jnp.rint(x / jnp.where(sc > 0, sc, 1.0)[..., None]), -127, 127).astype(jnp.int8)
    return q, sc


def test_int8_cache_matches_the_references():
    """An int8 c_kv with per-token scales (2 rows x 16 heads x 256 slots in 2 splits, the
    masks of the bf16 test): the kernel converts each int8 tile in shared memory and scales the
    latent scores' and P's columns by the token scales. Against the fp32 reference on the same
    int8 latent, within 1.25x of the error of (P x scale) rounded once to bf16 at the row's
    max (the XLA path's rounding)."""
    b, h, s = 2, 16, 256
    q_lat, q_rope, c_bf16, k_rope = operands(b, h, s, seed=5)
    c8, cs = int8_cache(c_bf16)
    pos = jnp.arange(s)
    valid = jnp.stack([pos < 200, (pos < 4) | (pos >= 150)])
    bias = jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32)
    scale = 0.1
    got = mla_decode(q_lat, q_rope, c8, k_rope, bias, scale, c_scale=cs, impl="mosaic")
    want = R.mla_decode_reference(q_lat, q_rope, c8, k_rope, bias, scale, c_scale=cs)
    f32, hp = jnp.float32, jax.lax.Precision.HIGHEST
    sc = (jnp.einsum("bhc,bsc->bhs", q_lat.astype(f32), c8.astype(f32) * cs[..., None], precision=hp)
          + jnp.einsum("bhr,bsr->bhs", q_rope.astype(f32), k_rope.astype(f32), precision=hp))
    sc = sc * scale + bias[:, None, :]
    p = jnp.exp(sc - jnp.max(sc, axis=-1, keepdims=True))
    pc = (p * cs[:, None, :]).astype(jnp.bfloat16).astype(f32)
    ideal = rel(jnp.einsum("bhs,bsc->bhc", pc, c8.astype(f32), precision=hp)
                / jnp.sum(p, axis=-1)[..., None], want)
    assert got.shape == (b, h, 512) and 1e-4 < ideal < 4e-3, ideal
    assert rel(got, want) < 1.25 * ideal, (rel(got, want), ideal)
    # the int8 latent itself is within int8 rounding of the bf16 one
    assert rel(want, R.mla_decode_reference(q_lat, q_rope, c_bf16, k_rope, bias, scale)) < 2e-2
    with pytest.raises(ValueError, match="needs c_scale"):
        mla_decode(q_lat, q_rope, c8, k_rope, bias, scale, impl="mosaic")
    with pytest.raises(ValueError, match="needs c_scale"):
        mla_decode(q_lat, q_rope, c_bf16, k_rope, bias, scale, c_scale=cs)


def test_a_row_with_no_valid_slot_gives_zeros_and_splits_merge():
    o = jnp.ones((1, 3, 2, 4))
    m2 = jnp.array([[[0.0, -1e30], [1.0, -1e30], [-1e30, -1e30]]])
    l = jnp.array([[[2.0, 0.0], [1.0, 0.0], [0.0, 0.0]]])
    got = np.asarray(R.combine_splits(o, m2, l))
    # head 0: (1 * 2^-1 + 1 * 1) / (2 * 2^-1 + 1 * 1) per element; head 1: no valid slot
    np.testing.assert_allclose(got[0, 0], 1.5 / 2.0)
    assert (got[0, 1] == 0).all()


def test_pick_splits():
    sms = 132
    assert api.pick_splits(1, 1, 32768, sms) == 256 and api.pick_splits(1, 1, 4096, sms) == 64
    assert api.pick_splits(64, 1, 32768, sms) == 4 and api.pick_splits(300, 1, 4096, sms) == 1
    assert api.pick_splits(16, 2, 192, sms) == 3  # a divisor of the 3 steps


def test_refusals_and_auto():
    q_lat, q_rope, c_kv, k_rope = operands(1, 4, 64, c=96)
    bias = jnp.zeros((1, 64), jnp.float32)
    with pytest.raises(ValueError, match="latent width 96"):
        mla_decode(q_lat, q_rope, c_kv, k_rope, bias, 0.1, impl="mosaic")
    with pytest.raises(ValueError, match="impl"):
        mla_decode(q_lat, q_rope, c_kv, k_rope, bias, 0.1, impl="triton")
    out = mla_decode(q_lat, q_rope, c_kv, k_rope, bias, 0.1)  # auto: the reference off Hopper
    assert rel(out, R.mla_decode_reference(q_lat, q_rope, c_kv, k_rope, bias, 0.1)) < 1e-7
    assert "slots" in api.kernel_fits(*operands(1, 4, 100)[::2], operands(1, 4, 100)[3])


@pytest.mark.skipif(_hopper.on_hopper(), reason="race detection runs in CPU interpret mode")
def test_no_races(kernel_races, monkeypatch):
    monkeypatch.setattr(mosaic, "default_interpret", lambda: _hopper.interpret_params(detect_races=True))
    q_lat, q_rope, c_kv, k_rope = operands(1, 64, 128, seed=3)
    bias = jnp.zeros((1, 128), jnp.float32)
    jax.block_until_ready(mosaic.mla_decode_partial(q_lat, q_rope, c_kv, k_rope, bias, scale=0.1,
                                                    splits=1))
    c8, cs = int8_cache(c_kv)  # the converted tile: written by both warpgroups, read by both
    jax.block_until_ready(mosaic.mla_decode_partial(q_lat, q_rope, c8, k_rope, bias, cs, scale=0.1,
                                                    splits=1))
    assert len(kernel_races) == 2 and not any(kernel_races), kernel_races


class _H100:
    """A stand-in Hopper device for `_hopper.target_device` (lowering only)."""
    platform, compute_capability, core_count = "gpu", "9.0", 132


def test_lowers_for_hopper():
    """V2-Lite's latent (512 + 64) at batch 1 / 4K and batch 64 / 32K slots, bf16 and int8."""
    S = jax.ShapeDtypeStruct
    for b, s in ((1, 4096), (64, 32768)):
        with _hopper.target_device(_H100()):
            text = jax.jit(lambda *a: mla_decode(*a, 0.1, impl="mosaic")).trace(
                S((b, 16, 512), jnp.bfloat16), S((b, 16, 64), jnp.bfloat16), S((b, s, 512), jnp.bfloat16),
                S((b, s, 64), jnp.bfloat16), S((b, s), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
        assert len(re.findall(r'kernel_hash = "', text)) == 1, (b, s)
        with _hopper.target_device(_H100()):
            text = jax.jit(lambda q, qr, c, kr, bias, cs: mla_decode(
                q, qr, c, kr, bias, 0.1, c_scale=cs, impl="mosaic")).trace(
                S((b, 16, 512), jnp.bfloat16), S((b, 16, 64), jnp.bfloat16), S((b, s, 512), jnp.int8),
                S((b, s, 64), jnp.bfloat16), S((b, s), jnp.float32), S((b, s), jnp.float32)).lower(
                lowering_platforms=("cuda",)).as_text()
        assert len(re.findall(r'kernel_hash = "', text)) == 1, ("int8", b, s)
