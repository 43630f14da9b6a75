"""Flash attention: the jnp reference vs a naive full softmax, and the Mosaic GPU kernels
(forward, dq, dk, dv) vs the fp32 oracle. On CPU the kernels run in GPU interpret mode; on a
Hopper GPU the same cases run compiled (`impl="pallas"` picks the mode from the backend) when
the run sets JAX_PLATFORMS=cuda (tests/conftest.py defaults it to cpu)."""
import dataclasses
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._hopper import interpret_params
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention.api import flash_attention_mosaic
from pallas_kernels.flash_attention.mosaic_common import Config, default_config, tile_ranges
from pallas_kernels.flash_attention.reference import attention_naive, attention_reference

sys.path.insert(0, str(Path(__file__).parent))
from attention_common import docs as _docs  # noqa: E402
from attention_common import inputs as _inputs  # noqa: E402
from attention_common import rel as _rel  # noqa: E402

ON_GPU = jax.devices()[0].platform == "gpu"


# ------------------------------------------------------------------ reference vs naive softmax

@pytest.mark.parametrize("causal,seg,q_off,kv_off,N,K,chunk", [
    (True, False, 0, 0, 4, 2, 64),
    (False, True, 0, 0, 2, 2, 48),
    (True, True, 7, 30, 4, 1, 100),      # offsets: the first rows see no key at all
    (True, True, 0, 0, 4, 2, 512),       # T <= chunk: the single-block path (no map/remat)
])
def test_reference_matches_naive(causal, seg, q_off, kv_off, N, K, chunk):
    B, T, S = 2, 150, 150
    q, k, v, do = _inputs(1, B, T, S, N, K, 24, 16, jnp.float32)
    segs = _docs(B, T, 3, 0) if seg else None
    kw = dict(causal=causal, segment_ids=segs, q_offset=q_off, kv_offset=kv_off)
    o, lse = attention_reference(q, k, v, return_lse=True, chunk=chunk, **kw)
    no, nlse = attention_naive(q, k, v, **kw)
    assert _rel(o, no) < 1e-5
    fin = np.isfinite(np.asarray(nlse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(nlse)[fin], rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda *a: (attention_reference(*a, chunk=chunk, **kw) * do).sum(), (0, 1, 2))(q, k, v)
    ng = jax.grad(lambda *a: (attention_naive(*a, **kw)[0] * do).sum(), (0, 1, 2))(q, k, v)
    for a, b in zip(g, ng):
        assert _rel(a, b) < 1e-5


def test_errors():
    q, k, v, _ = _inputs(0, 1, 8, 8, 3, 2, 64, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, k, v, impl="reference")
    q, k, v, _ = _inputs(0, 1, 8, 8, 2, 1, 64, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="impl="):
        flash_attention(q, k, v, impl="triton")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        flash_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                        impl="pallas")
    q2, k2, v2, _ = _inputs(0, 1, 8, 8, 2, 1, 96, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="multiples"):
        flash_attention(q2, k2, v2, impl="pallas")
    with pytest.raises(ValueError, match="segment_ids"):
        flash_attention(q, k[:, :4], v[:, :4], segment_ids=jnp.zeros((1, 8), jnp.int32),
                        impl="reference")


# ------------------------------------------------------------------ Mosaic GPU kernels


CASES = {
    # name: (B, T, S, N, K, Dqk, Dv, dtype, causal, segments, q_offset, kv_offset)
    "mla_causal_ragged_gqa": (1, 200, 200, 2, 1, 192, 128, jnp.bfloat16, True, None, 0, 0),
    # T = 129: a last query block of one row (blocks of 64 or 128)
    "d64_noncausal_ragged_ts": (1, 129, 333, 4, 2, 64, 64, jnp.float16, False, None, 0, 0),
    "d128_causal_segments": (2, 256, 256, 1, 1, 128, 128, jnp.bfloat16, True, "self", 0, 0),
    "d256_segment_pair": (1, 130, 190, 1, 1, 256, 256, jnp.bfloat16, False, "pair", 0, 0),
    "mla_offsets_masked_rows": (1, 128, 256, 1, 1, 192, 128, jnp.bfloat16, True, None, 0, 70),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_forward_and_grads(name):
    B, T, S, N, K, Dqk, Dv, dtype, causal, seg, q_off, kv_off = CASES[name]
    q, k, v, do = _inputs(list(CASES).index(name), B, T, S, N, K, Dqk, Dv, dtype)
    if seg == "self":
        segs = _docs(B, T, 3, 1)
    elif seg == "pair":
        segs = (_docs(B, T, 2, 2), _docs(B, S, 2, 3))
    else:
        segs = None
    kw = dict(causal=causal, segment_ids=segs, q_offset=q_off, kv_offset=kv_off)
    dlse = jax.random.normal(jax.random.key(9), (B, N, T), jnp.float32)

    def loss(fn, q, k, v):
        o, lse = fn(q, k, v)
        return (o.astype(jnp.float32) * do).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0).sum()

    pallas = lambda q, k, v: flash_attention(q, k, v, return_lse=True, impl="pallas", **kw)
    naive = lambda q, k, v: attention_naive(q, k, v, **kw)
    (o, lse), vjp = jax.vjp(pallas, q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    no, nlse = naive(*f32)
    assert _rel(o, no) < 1e-2
    fin = np.isfinite(np.asarray(nlse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(nlse)[fin], rtol=1e-4, atol=1e-4)
    if not fin.all():   # fully masked rows: zero output
        rows = ~fin.transpose(0, 2, 1)                           # [B, T, N]
        assert np.abs(np.asarray(o.astype(jnp.float32))[rows]).max() == 0.0
    g = jax.grad(lambda *a: loss(pallas, *a), (0, 1, 2))(q, k, v)
    ng = jax.grad(lambda *a: loss(naive, *a), (0, 1, 2))(*f32)
    for gname, a, b in zip(("dq", "dk", "dv"), g, ng):
        assert _rel(a, b) < 1e-2, gname


def _config_case(seed, seg_seeds, variant):
    """The Config tests' case: MLA 192/128, T=192 queries, S=256 keys, GQA 2:1, causal with
    kv_offset 40 (the first 40 rows see no key) and packed segments; the default Config with
    `variant` applied; interpret mode off the GPU.
    Returns (q, k, v, dO, segments, cfg, kwargs for flash_attention_mosaic, interpret)."""
    B, T, S, N, K, Dqk, Dv = 1, 192, 256, 2, 1, 192, 128
    q, k, v, do = _inputs(seed, B, T, S, N, K, Dqk, Dv, jnp.bfloat16)
    segs = (_docs(B, T, 2, seg_seeds[0]), _docs(B, S, 2, seg_seeds[1]))
    cfg = dataclasses.replace(default_config(Dqk, Dv), **variant)
    kw = dict(causal=True, segments=segs, kv_offset=40)
    ip = None if ON_GPU else interpret_params()
    return q, k, v, do, segs, cfg, kw, ip


@pytest.mark.parametrize("variant", [
    dict(block_kv=64),
])
def test_forward_configs(variant):
    """Forward Config choices that default_config makes at other head dims (64-key steps, as
    at 256/256) on a case with skip steps, masked rows and GQA: causal with kv_offset 40 (the
    first 40 rows see no key) and packed segments."""
    q, k, v, _, segs, cfg, kw, ip = _config_case(7, (4, 5), variant)
    o, lse = flash_attention_mosaic(q, k, v, cfg=cfg, interpret=ip, **kw)
    no, nlse = attention_naive(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True,
                               segment_ids=segs, kv_offset=40)
    fin = np.isfinite(np.asarray(nlse))
    assert not fin.all()
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(nlse)[fin], rtol=1e-4, atol=1e-4)
    assert _rel(o, no) < 1e-2
    rows = ~fin.transpose(0, 2, 1)
    assert np.abs(np.asarray(o.astype(jnp.float32))[rows]).max() == 0.0


@pytest.mark.parametrize("variant", [
    dict(dkv_issue="sdp1"),
    # dq_regs "" (the default off 192/128): interpret mode keeps dO in shared memory either
    # way, so this differs from the default in the register path only when compiled
    dict(dq_regs=""),
])
def test_backward_configs(variant):
    """The backward schedules that default_config picks at other head dims (Config.dkv_issue
    "sdp1" as at 128/128, dq_regs "") give the oracle's dq, dk, dv on the MLA case with skip
    steps, masked rows, GQA and packed segments."""
    q, k, v, do, segs, cfg, kw, ip = _config_case(11, (6, 7), variant)
    loss = lambda o: (o.astype(jnp.float32) * do).sum()
    g = jax.grad(lambda *a: loss(flash_attention_mosaic(*a, cfg=cfg, interpret=ip, **kw)[0]),
                 (0, 1, 2))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ng = jax.grad(lambda *a: loss(attention_naive(*a, causal=True, segment_ids=segs,
                                                  kv_offset=40)[0]), (0, 1, 2))(*f32)
    for gname, a, b in zip(("dq", "dk", "dv"), g, ng):
        assert _rel(a, b) < 1e-2, gname


def _ranges(seg, T, rows_are_q, row_block, col_block):
    kw = dict(B=seg.shape[0] if seg is not None else 2, n_rows_p=T, row_block=row_block,
              n_cols_p=T, col_block=col_block, rows_are_q=rows_are_q, T=T, S=T, causal=True,
              delta=0, q_seg=seg, kv_seg=seg)
    return [np.asarray(a) for a in tile_ranges(**kw)]


@pytest.mark.parametrize("rows_are_q,row_block,col_block", [(True, 64, 128), (False, 64, 64)])
def test_segment_ranges_skip_masks_within_one_document(rows_are_q, row_block, col_block):
    """With segment ids, a (row, column) block needs no element mask exactly when all its
    queries and keys carry one id: one segment per row gives the tables of no segments at all,
    and packed documents mark mask-free only blocks inside one document (and below the
    diagonal), never one that straddles a boundary."""
    T = 512
    ones = jnp.ones((2, T), jnp.int32)
    for a, b in zip(_ranges(ones, T, rows_are_q, row_block, col_block),
                    _ranges(None, T, rows_are_q, row_block, col_block)):
        np.testing.assert_array_equal(a, b)
    seg = np.asarray(_docs(2, T, 3, 12))
    wg, _ = _ranges(jnp.asarray(seg), T, rows_are_q, row_block, col_block)
    free = 0
    for bi in range(2):
        for r in range(T // row_block):
            lo, mlo, mhi, hi = wg[bi, r]
            assert lo <= mlo <= mhi <= hi
            for c in range(mlo, mhi):
                rows = seg[bi, r * row_block:(r + 1) * row_block]
                cols = seg[bi, c * col_block:(c + 1) * col_block]
                q, kk = (rows, cols) if rows_are_q else (cols, rows)
                assert len(set(q.tolist()) | set(kk.tolist())) == 1, (bi, r, c)
                qpos = r * row_block if rows_are_q else c * col_block
                kpos = c * col_block if rows_are_q else r * row_block
                kend = kpos + (col_block if rows_are_q else row_block) - 1
                assert kend <= qpos                                  # below the diagonal
                free += 1
    assert free > 0                                  # the case has mask-free blocks to check


def test_kernel_long_documents():
    """Packed documents longer than the kernels' blocks (the pretraining batch's common case),
    so the forward, dq and dk/dv kernels run mask-free blocks with segment ids beside masked
    ones at the boundaries: o, lse and the gradients equal the fp32 oracle's; and one segment
    per row gives, bit for bit, the outputs and gradients of no segment ids."""
    B, T, N, K, Dqk, Dv = 1, 384, 2, 1, 192, 128
    q, k, v, do = _inputs(21, B, T, T, N, K, Dqk, Dv, jnp.bfloat16)
    seg = jnp.asarray(np.where(np.arange(T) < 300, 1, 2)[None], jnp.int32)

    def run(segs):
        f = lambda q, k, v: flash_attention(q, k, v, causal=True, segment_ids=segs,
                                            return_lse=True, impl="pallas")
        (o, lse), vjp = jax.vjp(f, q, k, v)
        return o, lse, vjp((do.astype(o.dtype), jnp.zeros_like(lse)))

    o, lse, g = run(seg)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    (no, nlse), nvjp = jax.vjp(lambda *a: attention_naive(*a, causal=True, segment_ids=seg), *f32)
    ng = nvjp((do, jnp.zeros_like(nlse)))
    assert _rel(o, no) < 1e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(nlse), rtol=1e-4, atol=1e-4)
    for gname, a, b in zip(("dq", "dk", "dv"), g, ng):
        assert _rel(a, b) < 1e-2, gname
    same = run(jnp.ones((B, T), jnp.int32))
    plain = run(None)
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))


def test_traced_offsets_match_static():
    """Offsets known while tracing (Python ints) make the kernels' range tables constants;
    traced offsets (as ring attention passes them) build the same tables in XLA. Both give the
    same o, lse and gradients, bit for bit, on a case with fully masked rows (kv_offset 70)."""
    q, k, v, do = _inputs(5, 1, 128, 256, 2, 1, 192, 128, jnp.bfloat16)
    ip = None if ON_GPU else interpret_params()

    def run(q, k, v, q_off, kv_off):
        def f(q, k, v):
            return flash_attention_mosaic(q, k, v, causal=True, q_offset=q_off,
                                             kv_offset=kv_off, interpret=ip)
        (o, lse), vjp = jax.vjp(f, q, k, v)
        return o, lse, vjp((do.astype(o.dtype), jnp.zeros_like(lse)))

    static = run(q, k, v, 0, 70)
    traced = jax.jit(run)(q, k, v, jnp.int32(0), jnp.int32(70))
    assert not np.isfinite(np.asarray(static[1])).all()      # the case has masked rows
    for a, b in zip(jax.tree.leaves(static), jax.tree.leaves(traced)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))


def test_config_errors():
    with pytest.raises(ValueError, match="dkv_issue"):
        Config(dkv_issue="dvdp")
    with pytest.raises(ValueError, match="dq_regs"):
        Config(dq_regs="q")
    with pytest.raises(ValueError, match="hardware barriers"):     # 2 x 6 slots + 2 turns > 12
        Config(stages=6)
    Config(stages=5)
    q, k, v, _ = _inputs(0, 1, 64, 64, 1, 1, 64, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="interpret_params"):    # named barriers need it
        flash_attention_mosaic(q, k, v, interpret=plgpu.InterpretGPUParams())


def test_kernel_no_races(kernel_races):
    """GPU interpret mode with race detection: forward and backward (the forward again, the dq
    and the dk/dv kernels), one small MLA case, with the kernels' named barriers interpreted
    (`_hopper.interpret_params`); every launch checked (`kernel_races`)."""
    if ON_GPU:
        pytest.skip("race detection is a CPU interpret-mode check; compiled cases run above")
    q, k, v, _ = _inputs(3, 1, 100, 100, 1, 1, 192, 128, jnp.bfloat16)
    ip = interpret_params(detect_races=True)
    f = lambda q, k, v: flash_attention_mosaic(q, k, v, causal=True, interpret=ip)[0]
    o = f(q, k, v)
    assert kernel_races == [False]
    g = jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), (0, 1, 2))(q, k, v)
    jax.block_until_ready(g)
    assert len(kernel_races) == 4 and not any(kernel_races), kernel_races
    assert _rel(o, attention_naive(q, k, v, causal=True)[0]) < 1e-2


def test_auto_on_hopper_takes_the_reference_where_the_kernel_does_not_fit(monkeypatch):
    """On a Hopper GPU, impl="auto" runs the kernel only on inputs it takes: fp32 or head dims
    that are not multiples of 64 go to the reference (impl="pallas" raises for them)."""
    from pallas_kernels.flash_attention import api

    monkeypatch.setattr(api, "on_hopper", lambda: True)
    taken = []
    real = api.flash_attention_mosaic
    monkeypatch.setattr(api, "flash_attention_mosaic", lambda *a, **k: (taken.append(1), real(*a, **k))[1])
    for dt, dqk, dv in ((jnp.float32, 64, 64), (jnp.bfloat16, 48, 32)):
        q, k, v, _ = _inputs(4, 1, 64, 64, 2, 2, dqk, dv, dt)
        o = flash_attention(q, k, v, causal=True, impl="auto")
        assert o.dtype == dt and _rel(o, attention_naive(q, k, v, causal=True)[0]) < 1e-2
        with pytest.raises(ValueError, match="bfloat16 or float16|multiples of 64"):
            flash_attention(q, k, v, causal=True, impl="pallas")
    assert len(taken) == 2  # the two impl="pallas" calls; "auto" never entered the kernel
    assert api.supports(*_inputs(4, 1, 64, 64, 2, 2, 192, 128, jnp.bfloat16)[:3])


def test_auto_dispatch_and_model_signature():
    """impl="auto" picks the reference off Hopper and gives the same numbers either way."""
    q, k, v, _ = _inputs(4, 1, 64, 64, 2, 2, 64, 64, jnp.bfloat16)
    o = flash_attention(q, k, v, causal=True, scale=0.1, segment_ids=None, impl="auto")
    r = attention_naive(q, k, v, causal=True, scale=0.1)[0]
    assert o.shape == (1, 64, 2, 64) and o.dtype == jnp.bfloat16
    assert _rel(o, r) < 1e-2


# A projection, RoPE and in-jit segment ids before the kernel, all under jax.jit: with 2 XLA:CPU
# threads and one CPU device this deadlocked in most runs (`_hopper._warn_small_cpu_pool`).
_JIT_SCRIPT = """
import jax, jax.numpy as jnp
from pallas_kernels.flash_attention import flash_attention
T = 256
ks = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(ks[0], (1, T, 64), jnp.bfloat16)
wq = (jax.random.normal(ks[1], (64, 128)) / 8).astype(jnp.bfloat16)
k, v = (jax.random.normal(kk, (1, T, 2, 64), jnp.bfloat16) for kk in ks[2:])
pos = jnp.arange(T * 16, dtype=jnp.float32).reshape(1, T, 16) / 100
def f(x, wq, k, v):
    q = (x @ wq).reshape(1, T, 2, 64)
    a, b = q[..., 32:48].astype(jnp.float32), q[..., 48:].astype(jnp.float32)
    c, s = jnp.cos(pos)[:, :, None], jnp.sin(pos)[:, :, None]
    q = jnp.concatenate([q[..., :32], (a * c - b * s).astype(q.dtype), (b * c + a * s).astype(q.dtype)], -1)
    seg = jnp.ones((1, T), jnp.int32)
    return flash_attention(q, k, v, causal=True, impl="pallas", segment_ids=seg).astype(jnp.float32).mean()
g = jax.jit(jax.grad(f, (0, 1, 2, 3)))(x, wq, k, v)
print("finite", all(bool(jnp.isfinite(t.astype(jnp.float32)).all()) for t in g), jax.local_device_count())
"""


def test_interpret_mode_under_jit_on_one_cpu_device_with_the_advised_pool():
    """The jitted gradient through the kernel in a process with one CPU device finishes with
    PJRT_NPROC at the advised size, without a warning."""
    env = dict(os.environ, PJRT_NPROC="8", XLA_FLAGS="--xla_backend_optimization_level=0", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", _JIT_SCRIPT], env=env,
                       capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[3])
    assert p.returncode == 0 and p.stdout.split() == ["finite", "True", "1"], p.stderr[-2000:]


def test_small_cpu_pool_warns_once(monkeypatch):
    from pallas_kernels import _hopper
    monkeypatch.setattr(_hopper.jax, "local_device_count", lambda: 1)
    for threads, warns in (("2", True), ("8", False)):
        monkeypatch.setenv("PJRT_NPROC", threads)
        _hopper._warn_small_cpu_pool.cache_clear()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            interpret_params()
            interpret_params()
        msgs = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
        assert msgs == (["Mosaic GPU interpret mode under jax.jit can deadlock with 2 XLA CPU threads: set "
                         "PJRT_NPROC=8 in the environment before jax starts"] if warns else []), msgs
    _hopper._warn_small_cpu_pool.cache_clear()
