"""Per-device memory plan of a training config on N devices, from the compiled train step.

    python -m dsjax.plan --config configs/deepseek_v3.yaml --devices 256 --hbm-gb 141

The train step is lowered with `jax.ShapeDtypeStruct`s (nothing is allocated) on a mesh of N
fake CPU devices (the plan re-runs itself in a subprocess with
`--xla_force_host_platform_device_count=N`), with the config's layout, batch, remat and dtypes,
and compiled; `compile().memory_analysis()` gives the per-device argument (state + batch),
output, aliased (donated) and temporary bytes. Parameters and optimizer moments per device are
also computed exactly from their shardings; the compiled argument size must agree with them
(the check is printed).

With `model.scan_layers` (the V2 and V3 configs set it) the layer stacks are scanned, so
compiling the full depth costs about as much as a shallow one; unrolled layers compile each. The check: a smaller config (the dense layers plus 1 MoE layer, same widths and layout) is
compiled the same way; both report compiled argument bytes next to the sharding-derived ones,
and the difference gives the per-layer cost.
Temporary bytes come from XLA's CPU buffer assignment of the same partitioned program; the GPU
compiler's scheduling differs, so treat them as an estimate (+/- tens of percent).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from dsjax import config as C
from dsjax.model import abstract_model
from dsjax.train import loop
from dsjax.train.optim import build_optimizer
from dsjax.train.step import init_state

GB = 1e9


def _child_env(n: int) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f)
    env["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={n}").strip()
    env["DSJAX_PLAN_CHILD"] = "1"
    return env


def compile_memory(cfg, n_devices: int) -> dict:
    """Compile cfg's train step on the first n_devices devices; returns bytes per device."""
    par = loop.setup_parallel(cfg, jax.devices()[:n_devices])
    fns, params, rest = abstract_model(cfg.model)
    tx, schedule = build_optimizer(cfg.optim, max(cfg.train.steps, 1))
    abstract = jax.eval_shape(lambda p, r: init_state(p, r, tx), params, rest)
    sh = loop.state_shardings(fns, tx, par, abstract)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, sh)

    def per_device(tree, shard):
        return sum(int(jnp.prod(jnp.asarray(s.shard_shape(x.shape)))) * x.dtype.itemsize
                   for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(
                       shard, is_leaf=lambda z: isinstance(z, NamedSharding))))

    A, B, T = cfg.train.grad_accum, cfg.data.batch_size, cfg.data.seq_len
    bsh = par.batch_sharding(3)
    batch = {k: jax.ShapeDtypeStruct((A, B, T), dt, sharding=bsh) for k, dt in
             (("inputs", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.float32),
              ("segment_ids", jnp.int32), ("positions", jnp.int32))}
    step = loop.jit_train_step(cfg, fns, tx, schedule, par, sh)
    compiled = step.lower(state, batch).compile()
    ma = compiled.memory_analysis()
    batch_bytes = sum(per_device(v, bsh) for v in batch.values())
    out = {
        "params": per_device(state["params"], sh["params"]),
        "optimizer": per_device(state["opt"], sh["opt"]),
        "rest": per_device(state["rest"], sh["rest"]) + sum(
            per_device(state[k], sh[k]) for k in state if k not in ("params", "opt", "rest")),
        "batch": batch_bytes,
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "generated_code": int(getattr(ma, "generated_code_size_in_bytes", 0)),
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def _with_layers(cfg, n_moe: int):
    m = dataclasses.replace(cfg.model, num_hidden_layers=cfg.model.first_k_dense_replace + n_moe)
    return dataclasses.replace(cfg, model=m)


def plan(cfg, n_devices: int) -> dict:
    """Per-device bytes of the full config (compiled; the layer stacks are scanned, so the
    compile costs about the same at any depth) and of a smaller config (1 MoE layer, same widths
    and layout) compiled the same way, for the check."""
    small = _with_layers(cfg, 1)
    return {"full": compile_memory(cfg, n_devices), "small": compile_memory(small, n_devices),
            "small_layers": small.model.num_hidden_layers}


def _report(cfg, n, hbm_gb, res) -> str:
    f = res["full"]
    lines = [f"dsjax plan: {n} devices, mesh {cfg.mesh}, batch {cfg.data.batch_size} x "
             f"{cfg.data.seq_len} (accum {cfg.train.grad_accum}), remat {cfg.model.remat}, "
             f"dtype {cfg.model.dtype}/{cfg.model.weight_dtype}",
             "per device (GB):",
             f"  parameters        {f['params'] / GB:9.2f}",
             f"  optimizer state   {f['optimizer'] / GB:9.2f}",
             f"  router bias, misc {f['rest'] / GB:9.4f}",
             f"  batch             {f['batch'] / GB:9.4f}",
             f"  compiled args     {f['argument'] / GB:9.2f}  (state + batch; "
             f"sharding-derived {(f['params'] + f['optimizer'] + f['rest'] + f['batch']) / GB:.2f})",
             f"  temporaries       {f['temp'] / GB:9.2f}  (gradients, activations, gathered weights)",
             f"  outputs (donated) {f['output'] / GB:9.2f}  aliased {f['alias'] / GB:.2f}",
             f"  peak              {f['peak'] / GB:9.2f}  of {hbm_gb:.0f} GB HBM -> "
             f"{'fits' if f['peak'] <= hbm_gb * GB else 'DOES NOT FIT'}"]
    sm, L = res["small"], cfg.model.num_hidden_layers
    per_layer = {k: (f[k] - sm[k]) / max(L - res["small_layers"], 1) for k in ("params", "optimizer", "temp")}
    lines.append(f"check: {res['small_layers']}-layer config compiled on the same mesh: args "
                 f"{sm['argument'] / GB:.3f} GB (sharding-derived "
                 f"{(sm['params'] + sm['optimizer'] + sm['rest'] + sm['batch']) / GB:.3f}), temporaries "
                 f"{sm['temp'] / GB:.2f} GB, peak {sm['peak'] / GB:.2f} GB; per extra layer: params "
                 f"{per_layer['params'] / GB:.3f}, optimizer {per_layer['optimizer'] / GB:.3f}, "
                 f"temporaries {per_layer['temp'] / GB:.3f} GB")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsjax.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--hbm-gb", type=float, default=80.0)
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    a = ap.parse_args(argv)
    if os.environ.get("DSJAX_PLAN_CHILD") != "1":
        r = subprocess.run([sys.executable, "-m", "dsjax.plan", *(argv if argv is not None else sys.argv[1:])],
                           env=_child_env(a.devices))
        return r.returncode
    cfg = C.load(a.config, a.sets)
    res = plan(cfg, a.devices)
    print(json.dumps(res) if a.json else _report(cfg, a.devices, a.hbm_gb, res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
