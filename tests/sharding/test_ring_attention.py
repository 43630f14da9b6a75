"""Ring attention equals full attention, forward and gradients, causal and not, with segments,
striped and contiguous layouts (context=4 on 8 fake CPU devices; batch over the other 2)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.flash_attention import flash_attention
from sharding.mesh import make_mesh
from sharding.ring_attention import ring_attention, stripe, unstripe


class M:
    data, fsdp, expert, tensor, context = 1, 2, 1, 1, 4


def _inputs(seg):
    B, T, N, Dqk, Dv = 2, 32, 2, 24, 16
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, N, Dqk), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, N, Dqk), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, N, Dv), jnp.float32)
    segs = None
    if seg:  # three packed documents per row plus trailing padding (segment 0)
        s = np.ones((B, T), np.int32)
        s[:, 9:20] = 2
        s[:, 20:29] = 3
        s[1, 29:] = 0
        segs = jnp.asarray(s)
    return q, k, v, segs


def test_stripe_roundtrip():
    x = np.arange(2 * 12).reshape(2, 12)
    y = stripe(x, 4)
    assert list(y[0, :3]) == [0, 4, 8] and list(y[0, 3:6]) == [1, 5, 9]
    np.testing.assert_array_equal(unstripe(y, 4), x)


@pytest.mark.parametrize("causal,seg,striped", [(True, False, True), (False, False, True),
                                                 (True, True, True), (False, True, False),
                                                 (True, True, False)])
def test_ring_equals_full_attention_fwd_and_grad(causal, seg, striped):
    mesh = make_mesh(M)
    q, k, v, segs = _inputs(seg)
    cp = 4
    w = jax.random.normal(jax.random.key(1), (2, 32, 2, 16))

    def full(q, k, v):
        o = flash_attention(q, k, v, causal=causal, segment_ids=segs, impl="reference")
        return jnp.sum(o * w), o

    def ring(q, k, v):
        tr = (lambda x: stripe(x, cp)) if striped else (lambda x: x)
        un = (lambda x: unstripe(x, cp)) if striped else (lambda x: x)
        sh = NamedSharding(mesh, P("fsdp", "context"))
        qs, ks, vs = (jax.lax.with_sharding_constraint(tr(x), sh) for x in (q, k, v))
        ss = None if segs is None else jax.lax.with_sharding_constraint(tr(segs), sh)
        o = ring_attention(qs, ks, vs, mesh=mesh, causal=causal, segment_ids=ss, striped=striped,
                           batch_axes=("fsdp",), impl="reference")
        o = un(o)
        return jnp.sum(o * w), o

    (l0, o0), g0 = jax.jit(jax.value_and_grad(full, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (l1, o1), g1 = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    err_o = float(jnp.max(jnp.abs(o0 - o1)))
    err_g = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g0, g1))
    print(f"ring causal={causal} seg={seg} striped={striped}: max|o|err {err_o:.2e} max|grad|err {err_g:.2e}")
    assert err_o < 1e-5 and err_g < 1e-5
