"""Helpers shared by the flash-attention tests: relative error, random inputs, packed documents."""
import jax
import jax.numpy as jnp
import numpy as np


def rel(a, b):
    """||a - b|| / ||b|| in fp32; fails on NaN in a."""
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    assert not np.isnan(a).any(), "NaN in output"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def inputs(seed, B, T, S, N, K, Dqk, Dv, dtype):
    """Random normal q [B, T, N, Dqk], k [B, S, K, Dqk], v [B, S, K, Dv] in dtype, dO fp32."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, Dqk), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, S, K, Dqk), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, S, K, Dv), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, T, N, Dv), jnp.float32)
    return q, k, v, do


def docs(B, L, n_docs, seed):
    """Packed-document segment ids [B, L]: sorted random boundaries, ids 1..n_docs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(B):
        cuts = np.sort(rng.choice(np.arange(1, L), n_docs - 1, replace=False))
        out.append(np.searchsorted(cuts, np.arange(L), side="right") + 1)
    return jnp.asarray(np.stack(out), jnp.int32)
