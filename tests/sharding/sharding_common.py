"""Shared tiny config, synthetic packed batches and a runner for the layout-equality tests."""
import sys
from pathlib import Path

import jax
import numpy as np

from dsjax import config as C
from dsjax.train import finetune, loop
from dsjax.train.optim import build_optimizer
from dsjax.train.step import init_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tiny import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = tiny_model(vocab=128, layers=2, heads=4, experts=8) + [
    "data.seq_len=16", "data.batch_size=8", "optim.warmup_steps=0", "optim.learning_rate=1e-3", "train.steps=3"]


def tiny_cfg(*mesh_sets):
    return C.load(ROOT / "configs" / "tiny.yaml", TINY + list(mesh_sets))


def mp_run_cfg(folder):
    """The two-process test's run (mp_worker.py): fsdp=8, metrics every step and TensorBoard,
    files in `folder`/run."""
    return tiny_cfg("mesh.preset=fsdp", "mesh.fsdp=8", "train.progress=false", "train.tensorboard=true",
                    "train.log_every=1", "checkpoint.every=3", f"train.run_dir={Path(folder) / 'run'}")


def synthetic_batches(cfg, n, seed=0, process_index=0, process_count=1):
    """n packed batches like PackedLoader's (two documents per row, segment-relative positions,
    no loss across the document boundary); returns this process's rows of each."""
    rng = np.random.default_rng(seed)
    B, T = cfg.data.batch_size * cfg.train.grad_accum, cfg.data.seq_len
    out = []
    for _ in range(n):
        toks = rng.integers(1, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
        cut = rng.integers(3, T - 3, (B,))
        idx = np.arange(T)[None]
        seg = np.where(idx < cut[:, None], 1, 2).astype(np.int32)
        pos = np.where(idx < cut[:, None], idx, idx - cut[:, None]).astype(np.int32)
        mask = np.ones((B, T), np.float32)
        mask[np.arange(B), cut - 1] = 0.0
        b = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": mask,
             "segment_ids": seg, "positions": pos}
        rows = B // process_count
        out.append({k: v[process_index * rows:(process_index + 1) * rows] for k, v in b.items()})
    return out


def randomize_lora_b(params, seed=7, scale=0.2):
    """Replace every LoRA B (zero at init) by random values."""
    leaves, tdef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(tdef, [
        jax.random.normal(k, x.shape, x.dtype) * scale if str(p[-1].key) == "lora_B" else x
        for k, (p, x) in zip(keys, leaves)])


def adam_mu(opt_state):
    return [x.mu for x in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(x, "mu")][0]


def run_layout(cfg, steps=3, devices=None, batches=None):
    """Train `steps` steps of `cfg` under its mesh; returns (losses, per-step clipped grads as
    numpy trees recovered from Adam's first moment, final params, Parallel, state)."""
    par = loop.setup_parallel(cfg, devices)
    fns, params, rest = init_model(cfg)
    if cfg.lora.rank:  # a trained adapter (B != 0), so every layout exercises the adapter maths
        params = randomize_lora_b(params)
    tx, schedule = build_optimizer(cfg.optim, cfg.train.steps)
    params, frozen = finetune.partition(cfg, params)
    state, sh = loop.create_state(fns, params, rest, tx, par, frozen=frozen or None)
    step = loop.jit_train_step(cfg, fns, tx, schedule, par, sh)
    batches = batches or synthetic_batches(cfg, steps, process_index=jax.process_index(),
                                           process_count=jax.process_count())
    b1 = cfg.optim.b1
    losses, grads = [], []
    mu_prev = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), params)
    for i in range(steps):
        state, m = step(state, loop.global_batch(par, batches[i], cfg.train.grad_accum))
        losses.append(float(m["loss"]))
        if jax.process_count() == 1:
            mu = jax.device_get(adam_mu(state["opt"]))
            grads.append(jax.tree.map(lambda a, b: (a - b1 * b) / (1 - b1), mu, mu_prev))
            mu_prev = mu
    params = jax.device_get(state["params"]) if jax.process_count() == 1 else None
    return losses, grads, params, par, state


_CACHE = {}


def cached_run(name, mesh_sets, devices=None):
    """run_layout of tiny_cfg(*mesh_sets), computed once per test session."""
    if name not in _CACHE:
        _CACHE[name] = run_layout(tiny_cfg(*mesh_sets), devices=devices)
    return _CACHE[name]
