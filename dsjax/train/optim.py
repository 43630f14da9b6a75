"""The optimizer, built by one function: config in, `optax.GradientTransformation` out.

clip_by_global_norm -> AdamW (decay mask: no decay on norms, biases) with a warmup + cosine / WSD /
constant schedule. Router biases (noaux_tc) are not parameters and never reach the optimizer.
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


def build_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Returns (optimizer, schedule). Moments are fp32 (they follow the fp32 master weights)."""
    schedule = build_schedule(cfg, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip_norm) if cfg.grad_clip_norm > 0 else optax.identity(),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                    mask=decay_mask),
    )
    return tx, schedule
