"""The optimizer, built by one function: config in, `optax.GradientTransformation` out.

clip_by_global_norm -> AdamW (decay mask: no decay on norms, biases) with a warmup + cosine / WSD /
constant schedule. Router biases (noaux_tc) are not parameters and never reach the optimizer.
The Adam moments have fixed dtypes (`optim.mu_dtype`, `optim.nu_dtype`) whatever the dtypes of
the weights and gradients: the moment update runs in fp32 and is rounded once on store.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from dsjax.config import OptimConfig


def build_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate per optimizer step: linear warmup from 0, then cosine to min_lr_ratio * lr,
    WSD (constant, then linear decay over the last wsd_decay_fraction), or constant."""
    lr, warm = cfg.learning_rate, cfg.warmup_steps
    decay = max((cfg.decay_steps or total_steps) - warm, 1)
    floor = lr * cfg.min_lr_ratio
    warmup = optax.linear_schedule(0.0, lr, max(warm, 1)) if warm > 0 else optax.constant_schedule(lr)
    if cfg.schedule == "cosine":
        main = optax.cosine_decay_schedule(lr, decay, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "wsd":
        n_decay = max(int(round(decay * cfg.wsd_decay_fraction)), 1)
        main = optax.join_schedules(
            [optax.constant_schedule(lr), optax.linear_schedule(lr, floor, n_decay)], [decay - n_decay])
    else:
        main = optax.constant_schedule(lr)
    if warm == 0:
        return main
    return optax.join_schedules([warmup, main], [warm])


def decay_mask(params):
    """True for leaves that get weight decay: matrices and tensors, not norms or biases."""
    def keep(path, x):
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        return x.ndim >= 2 and not any("norm" in n or n == "bias" for n in names)
    return jax.tree_util.tree_map_with_path(keep, params)


def scale_by_adam(b1: float, b2: float, eps: float, mu_dtype, nu_dtype) -> optax.GradientTransformation:
    """Adam's direction m_hat / (sqrt(v_hat) + eps) (Kingma & Ba 2015, Alg. 1) with moments
    stored in `mu_dtype` / `nu_dtype`.

    Gradients of any float dtype (bf16 when the step differentiates the compute-dtype weights)
    are read once; m and v are updated in fp32 and the update is computed from those fp32 values
    before they are rounded for storage. The state is `optax.ScaleByAdamState`, so checkpoints and
    `sharding.rules.optimizer_shardings` see the same tree as `optax.scale_by_adam`'s. The updates
    are fp32.
    """
    def init_fn(params):
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params),
            nu=jax.tree.map(lambda p: jnp.zeros(p.shape, nu_dtype), params))

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        c1 = 1 - jnp.asarray(b1, jnp.float32) ** count
        c2 = 1 - jnp.asarray(b2, jnp.float32) ** count

        def one(g, m, v):
            g = g.astype(jnp.float32)
            m = (1 - b1) * g + b1 * m.astype(jnp.float32)
            v = (1 - b2) * (g * g) + b2 * v.astype(jnp.float32)
            u = (m / c1) / (jnp.sqrt(v / c2) + eps)
            return u, m.astype(mu_dtype), v.astype(nu_dtype)

        out = jax.tree.map(one, updates, state.mu, state.nu)
        pick = lambda i: jax.tree.map(lambda _, t: t[i], updates, out)  # noqa: E731
        return pick(0), optax.ScaleByAdamState(count=count, mu=pick(1), nu=pick(2))

    return optax.GradientTransformation(init_fn, update_fn)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` (Pascanu et al. 2012) that takes the norm from the caller:
    `update(updates, state, params, grad_norm=...)` scales the updates by max_norm / grad_norm
    when grad_norm >= max_norm, with optax's expression, so the same norm gives bitwise optax's
    updates; without grad_norm it computes `optax.tree.norm(updates)` as optax does. The train
    step passes the norm it already has (part of it summed by the expert weight-gradient
    kernels), so the clip does not read the gradients again. State: `optax.EmptyState`, as
    optax's."""
    def update_fn(updates, state, params=None, *, grad_norm=None, **extra):
        del params, extra
        g_norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        trigger = jnp.squeeze(g_norm < max_norm)
        clip = lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)  # noqa: E731
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def build_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns (optimizer, schedule): clip -> Adam (moments in optim.mu_dtype / nu_dtype) ->
    decoupled weight decay on `decay_mask` leaves -> - learning rate (the state tree of
    `optax.chain(clip, optax.adamw(...))`). `update` takes an optional `grad_norm=`, the
    gradients' global norm, for the clip (`clip_by_global_norm`)."""
    schedule = build_schedule(cfg, total_steps)
    adamw = optax.chain(
        scale_by_adam(cfg.b1, cfg.b2, cfg.eps, jnp.dtype(cfg.mu_dtype), jnp.dtype(cfg.nu_dtype)),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule),
    )
    tx = optax.chain(
        clip_by_global_norm(cfg.grad_clip_norm) if cfg.grad_clip_norm > 0 else optax.identity(),
        adamw,
    )
    return tx, schedule
