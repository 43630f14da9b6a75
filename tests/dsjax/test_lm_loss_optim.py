"""The fused lm_head + cross-entropy (`dsjax.model.lm_loss`) against log_softmax autodiff, and the
optimizer's typed Adam moments (`dsjax.train.optim`) against optax.adamw."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dsjax.config import OptimConfig
from dsjax.model.lm_loss import lm_head_loss, logsumexp_one_pass, num_chunks
from dsjax.train.optim import build_optimizer, clip_by_global_norm, decay_mask


def _inputs(dtype, B=2, T=16, D=32, V=100, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (B, T, D)).astype(dtype)
    w = (0.3 * jax.random.normal(k[1], (D, V))).astype(dtype)
    t = jax.random.randint(k[2], (B, T), 0, V)
    m = (jax.random.uniform(k[3], (B, T)) > 0.3).astype(jnp.float32)
    return h, w, t, m


def _reference(h, w, t, m, weight):
    logits = jnp.dot(h.astype(jnp.float32), w.astype(jnp.float32))
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0]
    return weight * jnp.sum(nll * m)


def _rel(x, y):
    return float(jnp.linalg.norm(x.astype(jnp.float32) - y) / jnp.linalg.norm(y))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 6e-3)])
@pytest.mark.parametrize("n_chunks", [1, 4])
def test_lm_head_loss_matches_log_softmax_autodiff(dtype, tol, n_chunks):
    h, w, t, m = _inputs(dtype)
    weight = jnp.float32(1 / 11)
    obj, nll = lm_head_loss(h, w, t, m, weight, n_chunks)
    g = jax.grad(lambda h, w: lm_head_loss(h, w, t, m, weight, n_chunks)[0], (0, 1))(h, w)
    ref, g_ref = jax.value_and_grad(_reference, (0, 1))(h.astype(jnp.float32), w.astype(jnp.float32), t, m, weight)
    assert g[0].dtype == dtype and g[1].dtype == dtype
    assert abs(float(obj) - float(ref)) <= 1e-5 * abs(float(ref))
    assert abs(float(nll) * float(weight) - float(ref)) <= 1e-5 * abs(float(ref))
    assert _rel(g[0], g_ref[0]) < tol, _rel(g[0], g_ref[0])
    assert _rel(g[1], g_ref[1]) < tol, _rel(g[1], g_ref[1])
    # masked tokens get no gradient
    dead = np.asarray(m) == 0
    assert np.all(np.asarray(g[0], np.float32)[dead] == 0)


def test_lm_head_loss_chunks_agree_and_scale_by_cotangent():
    h, w, t, m = _inputs(jnp.float32, T=24)
    weight = jnp.float32(0.25)
    f = lambda n: jax.grad(lambda h, w: 3.0 * lm_head_loss(h, w, t, m, weight, n)[0], (0, 1))(h, w)  # noqa: E731
    g1, g3 = f(1), f(3)
    assert _rel(g3[0], g1[0]) < 1e-6 and _rel(g3[1], g1[1]) < 1e-6
    g_ref = jax.grad(lambda h, w: 3.0 * _reference(h, w, t, m, weight), (0, 1))(h, w)
    assert _rel(g1[0], g_ref[0]) < 1e-6 and _rel(g1[1], g_ref[1]) < 1e-6


@pytest.mark.parametrize("n_chunks", [1, 4])
def test_round_logits_is_hf_rounding(n_chunks):
    """round_logits: the loss and gradients of log_softmax autodiff on logits rounded to bf16
    and upcast (HF's `lm_head(h).float()`), and not those of fp32 logits."""
    h, w, t, m = _inputs(jnp.bfloat16, V=4096)
    h, w = (8 * h.astype(jnp.float32)).astype(jnp.bfloat16), w  # logits ~ 10: bf16 spacing 0.06
    weight = jnp.float32(1 / 11)

    def hf(h, w):
        logits = jnp.dot(h, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), t[..., None], axis=-1)[..., 0]
        return weight * jnp.sum(nll * m)

    f = lambda h, w: lm_head_loss(h, w, t, m, weight, n_chunks, True)[0]  # noqa: E731
    obj, g = jax.value_and_grad(f, (0, 1))(h, w)
    ref, g_ref = jax.value_and_grad(hf, (0, 1))(h, w)
    exact = float(_reference(h, w, t, m, weight))
    assert abs(float(obj) - float(ref)) <= 1e-5 * abs(float(ref))
    assert abs(float(obj) - exact) > 10 * abs(float(obj) - float(ref))  # the rounding shows
    g_ref = [x.astype(jnp.float32) for x in g_ref]
    assert g[0].dtype == g[1].dtype == jnp.bfloat16
    assert _rel(g[0], g_ref[0]) < 6e-3 and _rel(g[1], g_ref[1]) < 6e-3


@pytest.mark.parametrize("scale", [1.0, 40.0, 1e30])
def test_logsumexp_one_pass_matches_two_passes(scale):
    """The one-read log-sum-exp against float64 on random rows of 102,400 (V2's vocab) and 7,
    at logit scales from 1 to 1e30 (exp overflows without the max), as close as the two-pass
    jax.nn.logsumexp; a row holding a NaN gives NaN, one holding +inf gives +inf (not finite,
    as the two-pass form's NaN); -inf entries count as exp(-inf) = 0."""
    x = scale * jax.random.normal(jax.random.key(3), (3, 4, 102400))
    x64 = np.asarray(x, np.float64)
    mx = x64.max(-1)
    exact = mx + np.log(np.exp(x64 - mx[..., None]).sum(-1))
    got, two = logsumexp_one_pass(x), jax.nn.logsumexp(x, axis=-1)
    assert got.shape == (3, 4) and got.dtype == jnp.float32
    err = lambda a: np.max(np.abs(np.asarray(a, np.float64) - exact) / np.abs(exact))  # noqa: E731
    assert err(got) < max(1e-6, 4 * err(two)), (err(got), err(two))
    y = jnp.array([[0.5, -3.0, 2.0, 0.0, 1.0, -1.0, 4.0]] * 4)
    y = y.at[1, 2].set(jnp.nan).at[2, 4].set(jnp.inf).at[3, 0].set(-jnp.inf)
    got = np.asarray(logsumexp_one_pass(y))
    assert np.isnan(got[1]) and got[2] == np.inf
    np.testing.assert_allclose(got[[0, 3]], np.asarray(jax.nn.logsumexp(y[jnp.array([0, 3])], axis=-1)), rtol=1e-6)


def test_num_chunks():
    assert num_chunks(4, 2048, 102400) == 4      # 2048 tokens x 102400 x 4 B = 0.84 GB per chunk
    assert num_chunks(32, 128, 512) == 1
    assert num_chunks(1, 7, 1 << 30) == 7        # never more chunks than tokens per row


def _tree(seed, dtype):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"layer": {"kernel": jax.random.normal(k[0], (16, 8)).astype(dtype)},
            "norm": {"weight": (1 + 0.1 * jax.random.normal(k[1], (8,))).astype(dtype)}}


def test_adamw_fp32_matches_optax():
    cfg = OptimConfig(warmup_steps=2)
    tx, sched = build_optimizer(cfg, 10)
    ref = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm),
                      optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, mask=decay_mask))
    p = q = _tree(0, jnp.float32)
    s, r = tx.init(p), ref.init(q)
    assert jax.tree.structure(s) == jax.tree.structure(r)
    for i in range(5):
        g = jax.tree.map(lambda x: 0.5 * x, _tree(i + 1, jnp.float32))
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        u, r = ref.update(g, r, q)
        q = optax.apply_updates(q, u)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scale", [0.5, 0.01])
def test_clip_takes_the_callers_norm(scale):
    """optim.clip_by_global_norm: given the gradients' own norm (grad_norm=), bitwise optax's clip,
    above the threshold and below it; without it, the norm it computes; a caller's norm is the
    one used (the train step passes the norm it summed partly in the expert kernels)."""
    g = jax.tree.map(lambda x: scale * x, _tree(3, jnp.float32))
    norm = optax.tree.norm(g)
    assert (float(norm) > 1.0) == (scale == 0.5)
    ours, ref = clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
    want = ref.update(g, ref.init(g))[0]
    want_jit = jax.jit(lambda g: ref.update(g, optax.EmptyState())[0])(g)  # XLA may round differently
    for u, w in [(ours.update(g, ours.init(g), grad_norm=norm)[0], want), (ours.update(g, ours.init(g))[0], want),
                 (jax.jit(lambda g, n: ours.update(g, optax.EmptyState(), grad_norm=n)[0])(g, norm), want_jit)]:
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(w)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    u, _ = ours.update(g, optax.EmptyState(), grad_norm=2 * jnp.maximum(norm, 1.0))
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b) / (2 * max(float(norm), 1.0)), rtol=1e-6)


@pytest.mark.parametrize("weights,moments", [("bfloat16", "bfloat16"), ("bfloat16", "float32"),
                                             ("float32", "bfloat16")])
def test_adam_moment_dtypes_are_stable(weights, moments):
    """The moments keep optim.mu_dtype / nu_dtype whatever the weight and gradient dtypes (a
    state whose dtypes drift after the first step recompiles the step and changes checkpoints)."""
    cfg = OptimConfig(mu_dtype=moments, nu_dtype=moments)
    tx, _ = build_optimizer(cfg, 10)
    p = _tree(0, jnp.dtype(weights))
    s = tx.init(p)
    dtypes0 = [x.dtype for x in jax.tree.leaves(s)]
    for i in range(3):
        g = _tree(i + 1, jnp.bfloat16)  # compute-dtype gradients
        u, s = jax.jit(tx.update)(g, s, p)
        p = optax.apply_updates(p, u)
    assert [x.dtype for x in jax.tree.leaves(s)] == dtypes0
    assert all(x.dtype == jnp.dtype(weights) for x in jax.tree.leaves(p))
    mu = s[1][0].mu
    assert all(x.dtype == jnp.dtype(moments) for x in jax.tree.leaves(mu))
