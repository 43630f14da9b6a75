"""Run state of fine-tuning: the train state of a full params tree (trainable and frozen parts,
`dsjax.train.finetune.partition`), reading a run's checkpoint as its own config lays it out, and
the base weights of a run for `train.init_from`."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from dsjax import config as C
from dsjax.checkpoint import Checkpointer
from dsjax.config import Config
from dsjax.model.layers import dtype_of
from dsjax.model.lora import merged_params, path_names
from dsjax.train.finetune import FP32_FROZEN, abstract_model, full_params, partition
from dsjax.train.optim import build_optimizer
from dsjax.train.step import init_state
from pallas_kernels.fp8.frozen import Fp8Weight


def make_state(cfg: Config, params: dict, rest: dict, tx, loss_scale: float = 1.0) -> dict:
    """The train state of full params: trainable leaves in `params` (with optimizer state), the
    rest in `frozen` (compute dtype; FP8 GEMM weights as `Fp8Weight` under model.fp8=blockwise),
    absent when nothing is frozen."""
    train, frozen = partition(cfg, params)
    return init_state(train, rest, tx, loss_scale, frozen=frozen or None)


def restore_run(run_dir, step: int | None = None):
    """(Config, full params, rest, step) of a dsjax run's checkpoint (the newest unless `step`),
    read as that run's own config lays out its state (adapters and frozen leaves included),
    without a random init. Raises FileNotFoundError when RUN_DIR has no checkpoints."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"no checkpoints directory in {run_dir}")
    ck = Checkpointer(ckpt_dir, read_only=True)
    try:
        cfg = C.from_dict(ck.read_config(step))
        _, p_abs, r_abs = abstract_model(cfg)
        tx, _ = build_optimizer(cfg.optim, cfg.train.steps)
        abstract = jax.eval_shape(lambda p, r: make_state(cfg, p, r, tx), p_abs, r_abs)
        state, _, _, step = ck.restore(abstract, step)
    finally:
        ck.close()
    return cfg, full_params(state), state["rest"], step


def load_base_run(run_dir, cfg: Config) -> tuple[dict, dict]:
    """Base weights (adapters of that run folded in, fp32) and rest of a dsjax run's newest
    checkpoint, for `train.init_from`.

    Raises ConfigError naming the first model field that differs from `cfg.model` (numerics
    and kernel switches may differ), FileNotFoundError when RUN_DIR has no checkpoints."""
    theirs, params, rest, step = restore_run(run_dir)
    free = {"dtype", "weight_dtype", "attention_impl", "moe_impl", "remat", "moe_recompute", "round_logits",
            "scan_layers", "initializer_range", "router_bias_update_rate", "aux_loss_alpha",
            "mtp_loss_weight"}
    for f in dataclasses.fields(cfg.model):
        if f.name not in free and getattr(cfg.model, f.name) != getattr(theirs.model, f.name):
            raise C.ConfigError(f"config: train.init_from={run_dir}: model.{f.name}="
                                f"{getattr(cfg.model, f.name)!r} but the checkpoint has "
                                f"{getattr(theirs.model, f.name)!r}")
    base = merged_params(params, theirs.lora)
    wdt = dtype_of(cfg.model.weight_dtype)
    base = jax.tree_util.tree_map_with_path(  # frozen FP8 weights of that run dequantised
        lambda p, x: (x.dequantize() if isinstance(x, Fp8Weight) else x).astype(
            jnp.float32 if path_names(p)[-1] in FP32_FROZEN else wdt), base,
        is_leaf=lambda x: isinstance(x, Fp8Weight))
    return base, rest
