"""Fused flash-attention backward (`mosaic_gpu_bwd.py`) vs the fp32 naive-softmax oracle: dq, dk,
dv (and the forward it is paired with) on random inputs. On CPU the kernels run in GPU interpret
mode; on a Hopper GPU the same cases run compiled."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention import mosaic_gpu as mg
from pallas_kernels.flash_attention import mosaic_gpu_bwd as fb
from pallas_kernels.flash_attention.reference import attention_naive

sys.path.insert(0, str(Path(__file__).parent))
from attention_common import docs as _docs  # noqa: E402
from attention_common import inputs as _inputs  # noqa: E402
from attention_common import rel as _rel  # noqa: E402

ON_GPU = jax.devices()[0].platform == "gpu"
INTERPRET = None if ON_GPU else plgpu.InterpretGPUParams()


CASES = {
    # name: (B, T, S, N, K, Dqk, Dv, dtype, causal, segments, q_offset, kv_offset)
    "mla_causal_ragged_gqa": (1, 200, 200, 2, 1, 192, 128, jnp.bfloat16, True, None, 0, 0),
    "d128_noncausal_ragged_ts_gqa": (1, 130, 333, 4, 2, 128, 128, jnp.float16, False, None, 0, 0),
    "d128_causal_segments": (2, 256, 256, 1, 1, 128, 128, jnp.bfloat16, True, "self", 0, 0),
    "d64_segment_pair": (1, 130, 190, 2, 1, 64, 64, jnp.bfloat16, False, "pair", 0, 0),
    "mla_offsets_masked_rows": (1, 128, 256, 1, 1, 192, 128, jnp.bfloat16, True, None, 0, 70),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_grads_match_oracle(name):
    B, T, S, N, K, Dqk, Dv, dtype, causal, seg, q_off, kv_off = CASES[name]
    assert fb.fits(Dqk, Dv)
    q, k, v, do = _inputs(list(CASES).index(name), B, T, S, N, K, Dqk, Dv, dtype)
    if seg == "self":
        segs = _docs(B, T, 3, 1)
        segs_pair = (segs, segs)
    elif seg == "pair":
        segs_pair = (_docs(B, T, 2, 2), _docs(B, S, 2, 3))
        segs = segs_pair
    else:
        segs = segs_pair = None
    dlse = jax.random.normal(jax.random.key(9), (B, N, T), jnp.float32)

    def loss(fn, q, k, v):
        o, lse = fn(q, k, v)
        return (o.astype(jnp.float32) * do).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0).sum()

    fused = lambda q, k, v: fb.flash_attention_fused(
        q, k, v, causal=causal, segments=segs_pair, q_offset=q_off, kv_offset=kv_off,
        interpret=INTERPRET)
    naive = lambda q, k, v: attention_naive(q, k, v, causal=causal, segment_ids=segs,
                                            q_offset=q_off, kv_offset=kv_off)
    g = jax.grad(lambda *a: loss(fused, *a), (0, 1, 2))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ng = jax.grad(lambda *a: loss(naive, *a), (0, 1, 2))(*f32)
    for gname, a, b in zip(("dq", "dk", "dv"), g, ng):
        assert a.dtype == dtype and a.shape == b.shape
        assert _rel(a, b) < 1e-2, gname


def test_fused_no_races():
    """Race detection on (GPU interpret mode), one small MLA case with GQA (two heads through
    the Q/dO pipeline) and a ragged key tile."""
    if ON_GPU:
        pytest.skip("race detection is a CPU interpret-mode check; compiled cases run above")
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    q, k, v, do = _inputs(5, 1, 100, 100, 2, 1, 192, 128, jnp.bfloat16)
    ip = plgpu.InterpretGPUParams(detect_races=True)
    f = lambda q, k, v: fb.flash_attention_fused(q, k, v, causal=True, interpret=ip)[0]
    g = jax.grad(lambda *a: (f(*a).astype(jnp.float32) * do).sum(), (0, 1, 2))(q, k, v)
    jax.block_until_ready(g)
    assert not gpu_callbacks.get_races().races_found
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ng = jax.grad(lambda *a: (attention_naive(*a, causal=True)[0] * do).sum(), (0, 1, 2))(*f32)
    for gname, a, b in zip(("dq", "dk", "dv"), g, ng):
        assert _rel(a, b) < 1e-2, gname


def test_key_ranges_mask_padded_key_tiles():
    """A 48-key half tile holding padded keys has no unmasked sub-range; others keep theirs."""
    B, Tp, Sp, T, S = 1, 256, 192, 256, 120
    wgb, ctab = fb._key_ranges(B, Sp, Tp, T, S, False, 0, None, None)
    wgb = np.asarray(wgb)
    assert (wgb[0, 0] == [0, 0, 4, 4]).all() and (wgb[0, 1] == [0, 0, 4, 4]).all()
    assert (wgb[0, 2] == [0, 4, 4, 4]).all()            # keys 96..143: 120.. are padding
    assert wgb[0, 3, 0] == wgb[0, 3, 3]                  # keys 144..191: all padding, empty
    assert (np.asarray(ctab)[0] == [[0, 4], [0, 4]]).all()


def test_unfit_head_dims_use_v1_backward():
    """256/256 does not fit the fused kernel's shared memory: `backward` runs the v1 kernels."""
    assert not fb.fits(256, 256) and fb.fits(192, 128) and fb.fits(128, 128)
    q, k, v, do = _inputs(6, 1, 64, 64, 1, 1, 256, 256, jnp.bfloat16)
    cfg = mg.default_config(256, 256)
    o, lse = mg.flash_attention_mosaic(q, k, v, causal=True, cfg=cfg, interpret=INTERPRET)
    lse2 = lse / np.log(2.0)
    args = (q, k, v, None, (0, 0), o, lse2, do.astype(q.dtype), None)
    kw = dict(scale=256 ** -0.5, causal=True, cfg=cfg, interpret=INTERPRET)
    got = fb.backward(*args, **kw)
    want = mg._backward(*args, **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
