"""Helpers shared by the MoE tests: relative error, group-size patterns, random GEMM operands."""
import jax
import jax.numpy as jnp
import numpy as np


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def group_sizes_of(kind, m, e, seed):
    """Group sizes [E] summing to at most m, of a given pattern (no routing needed)."""
    rng = np.random.default_rng(seed)
    if kind == "one":
        gs = np.zeros(e, np.int64)
        gs[e // 2] = m
    elif kind == "zipf":
        p = 1.0 / np.arange(1, e + 1) ** 1.5
        rng.shuffle(p)
        gs = rng.multinomial(m, p / p.sum())
        gs[gs < m // (4 * e)] = 0  # a few empty experts
    elif kind == "tail":  # rows past the sum must come out as zeros
        gs = rng.multinomial(m - 37, np.ones(e) / e)
        gs[1] = 0
    else:
        gs = rng.multinomial(m, np.ones(e) / e)
    return jnp.asarray(gs, jnp.int32)


def operands(m, kd, n, e, seed):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k1, (m, kd)).astype(jnp.bfloat16)
    w = (jax.random.normal(k2, (e, kd, n)) / 8).astype(jnp.bfloat16)
    dy = jax.random.normal(k3, (m, n)).astype(jnp.bfloat16)
    return x, w, dy
