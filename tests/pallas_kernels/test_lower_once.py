"""`_hopper.lower_once`: identical kernel calls share one lowering, so an unrolled model compiles
each distinct Mosaic GPU kernel once. The kernels are lowered for CUDA on this CPU (Mosaic GPU
lowering, layout inference and serialisation run without a GPU)."""
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import _hopper
from pallas_kernels.moe import mosaic_gpu


def test_values_gradients_and_one_shared_function():
    calls = []

    @_hopper.lower_once
    def f(x, y, *, s, tag=None):
        calls.append(tag)
        return jnp.sin(x) * s + y

    def g(x):
        for i in range(3):
            x = f(x, x, s=2.0, tag="a")
        return f(x, x, s=3.0, tag="b")  # another static value: a second function

    def g_plain(x):
        for i in range(3):
            x = jnp.sin(x) * 2.0 + x
        return jnp.sin(x) * 3.0 + x

    x = jnp.asarray(np.random.default_rng(0).normal(size=(8,)), jnp.float32)
    text = jax.jit(g).lower(x).as_text()
    assert len(re.findall(r"func\.func private", text)) == 2  # s=2.0 once, s=3.0 once
    assert sorted(calls) == ["a", "b"]  # traced once per signature
    np.testing.assert_allclose(jax.jit(g)(x), g_plain(x), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: g(x).sum())(x),
                               jax.grad(lambda x: g_plain(x).sum())(x), rtol=1e-6)


def _kernel_hashes(fn, *args, monkeypatch):
    """Lower fn for CUDA with the Mosaic kernels compiled (not interpreted): the kernel hash of
    every mosaic_gpu custom call in the module."""
    monkeypatch.setattr(mosaic_gpu, "default_interpret", lambda: None)
    monkeypatch.setattr(mosaic_gpu, "num_sms", lambda: 132)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)


def test_identical_grouped_gemms_compile_once(monkeypatch):
    e, m, d, n = 4, 512, 256, 256
    x = jax.ShapeDtypeStruct((m, d), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((e, d, n), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((e,), jnp.int32)

    def layers(x, w1, w2, w3, gs):  # three "layers" of the same GEMM, as an unrolled stack
        for w_ in (w1, w2, w3):
            x = mosaic_gpu.gmm(x, w_, gs)
        return mosaic_gpu.gmm(x, w1, gs, transpose_rhs=True)  # a different kernel

    hashes = _kernel_hashes(layers, x, w, w, w, gs, monkeypatch=monkeypatch)
    assert len(hashes) == 2 and len(set(hashes)) == 2

    # layers read in place from a stack [3 E, d, n] (traced group offsets): one kernel
    def in_stack(x, stack, gs):
        for i in range(3):
            x = mosaic_gpu.gmm(x, stack, gs, group_offset=jnp.asarray(i * e, jnp.int32))
        return mosaic_gpu.gmm(x, stack, gs, transpose_rhs=True, group_offset=jnp.asarray(e, jnp.int32))

    stack = jax.ShapeDtypeStruct((3 * e, d, n), jnp.bfloat16)
    hashes = _kernel_hashes(in_stack, x, stack, gs, monkeypatch=monkeypatch)
    assert len(hashes) == 2  # one function called by the three layers, one for dx

    # without the wrapper, each call is its own kernel (what lower_once prevents)
    raw = mosaic_gpu.gmm.__wrapped__
    hashes = _kernel_hashes(lambda x, w, gs: raw(raw(x, w, gs), w, gs), x, w, gs,
                            monkeypatch=monkeypatch)
    assert len(hashes) == 2 and len(set(hashes)) == 2


@pytest.mark.parametrize("r", [16, 32, 64])
def test_extra_contraction_lowers_for_hopper_at_v2_lite_widths(monkeypatch, r):
    """The grouped GEMMs of V2-Lite's routed-expert LoRA with the adapter's extra contraction
    (R = 16, 32: the rank-16 down and the gate + up adapters; 64), lowered for CUDA: Mosaic GPU's
    layout inference, wgmma descriptors and shared-memory plan run on this CPU, so a tile shape
    the compiled kernel cannot take (e.g. A and B of one wgmma with two swizzles) fails here,
    not on the GPU."""
    bf, m, e, d, f = jnp.bfloat16, 1024, 64, 2048, 1408
    S = jax.ShapeDtypeStruct
    gs = S((e,), jnp.int32)
    cases = [  # (x, w, t, b, transpose_rhs): gate/up forward, down forward, their dx
        ((m, d), (e, d, f), (m, r), (e, r, f), False),
        ((m, f), (e, f, d), (m, r), (e, r, d), False),
        ((m, f), (e, d, f), (m, r), (e, d, r), True),
        ((m, d), (e, f, d), (m, r), (e, f, r), True),
    ]
    for xs, ws, ts, bs, tr in cases:
        def f_(x, w, gs, t, b, tr=tr):
            return mosaic_gpu.gmm(x, w, gs, transpose_rhs=tr, extra=(t, b))
        hashes = _kernel_hashes(f_, S(xs, bf), S(ws, bf), gs, S(ts, bf), S(bs, bf),
                                monkeypatch=monkeypatch)
        assert len(hashes) == 1, (xs, ws, tr)


def test_narrow_k_steps_lower_for_hopper(monkeypatch):
    """tile_k = 32 (A's rows 64 bytes: a 64-byte swizzle, which B's tile then takes too), forward
    and transposed, lowered for CUDA."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    config = mosaic_gpu.TileConfig(tile_k=32)
    for tr, ws in ((False, (8, 1408, 2048)), (True, (8, 2048, 1408))):
        def f_(x, w, gs, tr=tr):
            return mosaic_gpu.gmm(x, w, gs, transpose_rhs=tr, config=config)
        hashes = _kernel_hashes(f_, S((1024, 1408), bf), S(ws, bf), S((8,), jnp.int32),
                                monkeypatch=monkeypatch)
        assert len(hashes) == 1, tr
