"""Chunked expert-parallel dispatch equals the one-chunk dispatch (forward and gradients), and
the compile-only kernel stand-ins keep the shapes of the kernels they stand for."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels._compile_only import hopper_kernels_compile_only
from pallas_kernels.moe import grouped_matmul, permute
from sharding.expert_parallel import default_chunk_tokens, moe_expert_parallel


def _mesh(ep):
    devs = np.asarray(jax.devices()[:8]).reshape(8 // ep, ep)
    return Mesh(devs, ("fsdp", "expert"))


def _inputs(B=8, T=16, D=32, F=16, E=16, K=4, seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(B, T, D)), jnp.float32)
    ids = jnp.asarray(np.argsort(r.random((B, T, E)), axis=-1)[..., :K], jnp.int32)
    w = jnp.asarray(r.random((B, T, K)), jnp.float32)
    wg, wu = (jnp.asarray(r.normal(size=(E, D, F)) / np.sqrt(D), jnp.float32) for _ in range(2))
    wd = jnp.asarray(r.normal(size=(E, F, D)) / np.sqrt(F), jnp.float32)
    return x, ids, w, wg, wu, wd


@pytest.mark.parametrize("ep,chunk", [(8, 16), (8, 32), (4, 8), (1, 8)])
def test_chunked_dispatch_matches_one_chunk(ep, chunk):
    mesh = _mesh(ep)
    x, ids, w, wg, wu, wd = _inputs()
    batch = ("fsdp", "expert") if ep > 1 else ("fsdp",)

    def loss(chunk_tokens, x, w, wg, wu, wd):
        y = moe_expert_parallel(x, ids, w, wg, wu, wd, mesh=mesh, batch_axes=batch,
                                impl="reference", dtype=jnp.float32, chunk_tokens=chunk_tokens)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))), y

    x = jax.device_put(x, NamedSharding(mesh, P(batch)))
    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5), has_aux=True),
                   static_argnums=0)
    (l1, y1), g1 = grad(None, x, w, wg, wu, wd)
    (l2, y2), g2 = grad(chunk, x, w, wg, wu, wd)
    m = x.shape[0] // 8 * x.shape[1] * ep  # tokens a rank processes (ep ranks gathered)
    assert default_chunk_tokens(m, 4, 32, 4) == m  # small: one chunk by default
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y2), rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert abs(float(l1) - float(l2)) < 1e-4


def test_recompute_gives_the_same_output_and_gradients():
    """recompute=True (model.moe_recompute under a mesh): the one-chunk step keeps only its named
    GEMM outputs for the backward; output and gradients bitwise equal to recompute=False."""
    mesh = _mesh(4)
    x, ids, w, wg, wu, wd = _inputs(seed=3)
    batch = ("fsdp", "expert")

    def loss(recompute, x, w, wg, wu, wd):
        y = moe_expert_parallel(x, ids, w, wg, wu, wd, mesh=mesh, batch_axes=batch,
                                impl="reference", dtype=jnp.float32, recompute=recompute)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))), y

    x = jax.device_put(x, NamedSharding(mesh, P(batch)))
    args = (x, w, wg, wu, wd)
    for flag in (False, True):
        text = str(jax.make_jaxpr(loss, static_argnums=0)(flag, *args))
        assert ("SaveOnlyTheseNames" in text) == flag
    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3, 4, 5), has_aux=True),
                   static_argnums=0)
    (l1, y1), g1 = grad(False, *args)
    (l2, y2), g2 = grad(True, *args)
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.max(jnp.abs(g1[2]))) > 0


def test_default_chunk_tokens_and_errors():
    # V3 on one rank of expert=8: 8 x 4096 tokens, K=8, D=7168 bf16 -> 4096 tokens a chunk
    assert default_chunk_tokens(8 * 4096, 8, 7168, 2) == 4096
    assert default_chunk_tokens(7, 8, 1 << 30, 2) == 1
    mesh = _mesh(8)
    x, ids, w, wg, wu, wd = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens=5 does not divide"):
        jax.jit(lambda x: moe_expert_parallel(x, ids, w, wg, wu, wd, mesh=mesh,
                                              batch_axes=("fsdp", "expert"), impl="reference",
                                              chunk_tokens=5))(x)


def test_stand_ins_keep_kernel_shapes():
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(256, 128)), jnp.bfloat16)
    ids = jnp.asarray(r.integers(0, 4, (256, 2)), jnp.int32)
    w = jnp.asarray(r.normal(size=(4, 128, 256)), jnp.bfloat16)

    def f(x, w):
        xs, gs, perm = permute(x, ids, num_experts=4)
        return jnp.sum(grouped_matmul(xs, w, gs).astype(jnp.float32))

    with hopper_kernels_compile_only():
        jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w)
        lowered = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, w)
    text = str(jaxpr)
    assert text.count("pure_callback") == 4  # permute rows, GEMM forward, dx, dw
    assert "bf16[512,128]" in text and "bf16[4,128,256]" in text
    assert lowered.compile().memory_analysis() is not None
