"""Per-device memory plan of a training config on N devices, from the compiled train step.

    python -m dsjax.plan --config configs/deepseek_v3.yaml --devices 256 --hbm-gb 141 --explain

The train step is lowered with `jax.ShapeDtypeStruct`s (nothing is allocated) on a mesh of N
fake CPU devices (the plan re-runs itself in a subprocess with
`--xla_force_host_platform_device_count=N`), with the config's layout, batch, remat and dtypes,
and compiled; `compile().memory_analysis()` gives the per-device argument (state + batch),
output, aliased (donated) and temporary bytes. Parameters and optimizer moments per device are
also computed exactly from their shardings; the compiled argument size must agree with them
(the check is printed).

Kernels (`--kernels`). A GPU run's `attention_impl` / `moe_impl` "auto" picks the Mosaic GPU
kernels; on CPU "auto" would pick the jnp references, whose intermediates (padded row copies,
fp32 GEMM outputs and accumulators, chunked attention scores) a GPU never allocates. By default
(`hopper`) the plan compiles under `pallas_kernels._compile_only.hopper_kernels_compile_only`:
the kernel choices of a Hopper GPU, each Mosaic kernel an opaque stand-in that allocates exactly
the kernel's outputs. What still differs from the GPU program: XLA's CPU scheduling and fusion
(the GPU compiler orders and fuses differently), and bf16 collectives: XLA:CPU runs every
all-gather in fp32 (a convert before, one after), so each gathered bf16 buffer (a layer's
weights, the gathered tokens) is planned at twice its size plus its bf16 copy.
`benchmarks/v3_slice_memory.py` compiles a V3 slice for the GPU to measure the difference.
`--kernels backend` plans what this CPU would run.

`--explain N` dumps XLA's buffer assignment and lists the N largest temporaries live at the
peak with their shape, HLO op and the source lines that made them (`dsjax.plan_explain`).

With `model.scan_layers` (the V2 and V3 configs set it) the layer stacks are scanned, so
compiling the full depth costs about as much as a shallow one; unrolled layers compile each.
The check: a smaller config (the dense layers plus 1 MoE layer, same widths and layout) is
compiled the same way; both report compiled argument bytes next to the sharding-derived ones,
and the difference gives the per-layer cost.

Fewest devices: for the config's Adam moments and for bf16 ones, the smallest device count
(a multiple of the mesh's fixed axes, the per-device batch kept) whose estimated peak fits
`--hbm-gb`: the state there exactly from the shardings, the temporaries of this compile with
the gradient buffers rescaled (`predicted_peak`); `--verify-min` compiles there too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from dsjax import config as C
from dsjax import plan_explain
from dsjax.train import finetune, loop
from dsjax.train.optim import build_optimizer
from dsjax.train.step import COPY_KEY, init_state
from pallas_kernels._compile_only import hopper_kernels_compile_only

GB = 1e9
EXPLAIN_MODULE = "jit_traced"  # the jitted train step's HLO module (loop.jit_train_step)


def _child_env(n: int, dump_dir: str | None = None) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f)
    flags += f" --xla_force_host_platform_device_count={n}"
    if dump_dir:
        flags += (f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
                  f" --xla_dump_hlo_module_re={EXPLAIN_MODULE}")
        env["DSJAX_PLAN_DUMP"] = dump_dir
    env["XLA_FLAGS"] = flags.strip()
    env["DSJAX_PLAN_CHILD"] = "1"
    return env


def _per_device(tree, shard) -> int:
    return sum(int(math.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(
                   shard, is_leaf=lambda z: isinstance(z, NamedSharding))))


def _abstract_state(cfg, devices):
    """The train state `python -m dsjax.train` builds for cfg, as sharded shapes: with LoRA
    adapters and frozen leaves (bf16, no moments) when cfg.lora / lora.freeze ask for them."""
    par = loop.setup_parallel(cfg, devices)
    fns, params, rest = finetune.abstract_model(cfg)
    tx, schedule = build_optimizer(cfg.optim, max(cfg.train.steps, 1))
    trainable, frozen = finetune.partition(cfg, params)
    fp8 = loop.fp8_copy_paths(fns, par)
    abstract = jax.eval_shape(lambda p, r, f: init_state(p, r, tx, frozen=f, compute_dtype=jnp.dtype(cfg.model.dtype),
                                                         fp8_paths=fp8),
                              trainable, rest, frozen or None)
    sh = loop.state_shardings(fns, tx, par, abstract)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, sh)
    return par, fns, tx, schedule, sh, state


# the state's parts that `state_bytes` and `compile_memory` report by name (the rest is "rest")
_PARTS = {"params": "params", "optimizer": "opt", "frozen": "frozen", "compute_copy": COPY_KEY}


def _state_parts(state: dict, sh: dict) -> dict:
    """Per-device bytes of each of _PARTS (0 where the state has no such key)."""
    return {name: _per_device(state[k], sh[k]) if k in state else 0 for name, k in _PARTS.items()}


def state_bytes(cfg, n_devices: int) -> dict:
    """Per-device bytes of parameters and optimizer moments of cfg on n_devices (from the
    shardings, nothing compiled)."""
    _, _, _, _, sh, state = _abstract_state(cfg, jax.devices()[:n_devices])
    return _state_parts(state, sh)


def compile_memory(cfg, n_devices: int, explain_top: int = 0, devices=None,
                   hopper_kernels: bool = True, hlo: bool = False) -> dict:
    """Compile cfg's train step on the first n_devices devices; returns bytes per device.

    Args:
      devices: the devices of the mesh (default `jax.devices()[:n_devices]`; e.g. the
        compile-only devices of a GPU topology).
      hopper_kernels: compile under `hopper_kernels_compile_only()`: the kernel choices of a
        Hopper GPU, with the Mosaic kernels as shape-only stand-ins (their output buffers).
        False: the choices of the compiling backend (on CPU the jnp references).
      explain_top: > 0 with XLA dumping to $DSJAX_PLAN_DUMP (`_child_env`): also return
        "explain", `plan_explain.explain` of this compile (the temp buffers live at its peak).
      hlo: also return "hlo", the compiled module's text (`compiled.as_text()`).
    Returns:
      bytes per device: params (trainable), optimizer, frozen (LoRA / lora.freeze: frozen
        weights in the compute dtype), compute_copy (the compute-dtype copy of master weights
        kept in another dtype, `dsjax.train.step.COPY_KEY`; on one device the FP8 GEMMs'
        weights as their stored E4M3 copy, `dsjax.train.loop.fp8_copy_paths`), rest (router biases, scalars), batch (sharding-
      derived), argument / output / alias / temp (compiled memory analysis), peak =
      argument + output - alias + temp.
    """
    devices = list(devices) if devices is not None else jax.devices()[:n_devices]
    par, fns, tx, schedule, sh, state = _abstract_state(cfg, devices)
    per_device = _per_device
    A, B, T = cfg.train.grad_accum, cfg.data.batch_size, cfg.data.seq_len
    bsh = par.batch_sharding(3)
    batch = {k: jax.ShapeDtypeStruct((A, B, T), dt, sharding=bsh) for k, dt in
             (("inputs", jnp.int32), ("targets", jnp.int32), ("loss_mask", jnp.float32),
              ("segment_ids", jnp.int32), ("positions", jnp.int32))}
    step = loop.jit_train_step(cfg, fns, tx, schedule, par, sh)
    with hopper_kernels_compile_only(hopper_kernels):
        compiled = step.lower(state, batch).compile()
    ma = compiled.memory_analysis()
    batch_bytes = sum(per_device(v, bsh) for v in batch.values())
    out = {
        **_state_parts(state, sh),
        "rest": sum(per_device(state[k], sh[k]) for k in state if k not in _PARTS.values()),
        "batch": batch_bytes,
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "generated_code": int(getattr(ma, "generated_code_size_in_bytes", 0)),
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    if explain_top and os.environ.get("DSJAX_PLAN_DUMP"):
        out["explain"] = plan_explain.explain(os.environ["DSJAX_PLAN_DUMP"], EXPLAIN_MODULE,
                                              explain_top)
    if hlo:
        out["hlo"] = compiled.as_text()
    return out


def _with_layers(cfg, n_moe: int):
    m = dataclasses.replace(cfg.model, num_hidden_layers=cfg.model.first_k_dense_replace + n_moe)
    return dataclasses.replace(cfg, model=m)


def _bf16_moments(cfg):
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, mu_dtype="bfloat16",
                                                              nu_dtype="bfloat16"))


def _on_devices(cfg, n_from: int, n_to: int):
    """cfg on n_to devices with the per-device batch of n_from (batch_size scaled), or None
    when the batch does not scale to a whole number of rows."""
    b = cfg.data.batch_size * n_to
    if b % n_from:
        return None
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=b // n_from))


def predicted_peak(cfg, n_from: int, full: dict, n_to: int) -> float | None:
    """Peak bytes per device of cfg on n_to <= n_from devices, the per-device batch kept, from
    the compile on n_from devices: the state on n_to devices exactly (shardings), the
    temporaries of n_from with the parameter-sized ones (the gradients, and the compute-dtype
    copy of the weights where the state does not hold it, both sharded like the parameters)
    rescaled by n_from / n_to. None if cfg does not shard over n_to devices."""
    c = _on_devices(cfg, n_from, n_to)
    if c is None:
        return None
    try:
        st = state_bytes(c, n_to)
    except (ValueError, C.ConfigError):  # mesh / rules errors of this device count
        return None
    ratio = jnp.dtype(cfg.model.dtype).itemsize / jnp.dtype(cfg.model.weight_dtype).itemsize
    scaled = (1 if full.get("compute_copy") else 2) * full["params"] * ratio
    temp = full["temp"] + scaled * (n_from / n_to - 1)
    args = st["params"] + st["optimizer"] + st["frozen"] + st["compute_copy"] + full["rest"] + full["batch"]
    return args + full["output"] - full["alias"] + temp  # outputs other than the donated state


def _candidates(cfg, n: int) -> list[int]:
    """Device counts m <= n whose free mesh axis (the -1 one) divides its size on n devices, so
    that every dimension sharded on n devices shards the same way on m (counts where ZeRO-3
    falls back to fewer axes or replication shard differently and are not estimated)."""
    sizes = {k: v for k, v in dataclasses.asdict(cfg.mesh).items()
             if k in ("data", "fsdp", "expert", "tensor", "context")}
    fixed = math.prod(v for v in sizes.values() if v > 0)
    if n % fixed:
        return []
    free_n = n // fixed
    return [fixed * f for f in range(1, free_n + 1) if free_n % f == 0]


def min_devices(cfg, n: int, full: dict, hbm_bytes: float, start: int = 0) -> tuple[int, float] | None:
    """Smallest device count m in `_candidates(cfg, n)[start:]` whose `predicted_peak` fits
    hbm_bytes, and that peak; None if none fits."""
    for m in _candidates(cfg, n)[start:]:
        p = predicted_peak(cfg, n, full, m)
        if p is not None and p <= hbm_bytes:
            return m, p
    return None


def plan(cfg, n_devices: int, hbm_gb: float, explain_top: int = 0, check: bool = True,
         hopper_kernels: bool = True, verify_min: bool = False) -> dict:
    """Per-device bytes of the full config (compiled; the layer stacks are scanned, so the
    compile costs about the same at any depth), of a smaller config (1 MoE layer, same widths
    and layout) compiled the same way for the check, and the smallest device counts that fit
    hbm_gb with the config's and with bf16 Adam moments (`min_devices`; compiled there too
    with verify_min)."""
    res = {"full": compile_memory(cfg, n_devices, explain_top, hopper_kernels=hopper_kernels)}
    if check:
        small = _with_layers(cfg, 1)
        res["small"] = compile_memory(small, n_devices, hopper_kernels=hopper_kernels)
        res["small_layers"] = small.model.num_hidden_layers
    res["min_devices"] = {}
    for name, c in (("config moments", cfg), ("bf16 moments", _bf16_moments(cfg))):
        full = res["full"]
        if c is not cfg:
            full = dict(full, **{k: v for k, v in state_bytes(c, n_devices).items()})
        cands = _candidates(c, n_devices)
        m = min_devices(c, n_devices, full, hbm_gb * GB)
        entry = {"devices": m[0] if m else None, "predicted_peak": m[1] if m else None}
        while m and verify_min:  # compile there; if it does not fit, the next count up
            peak = (res["full"]["peak"] if m[0] == n_devices and c is cfg else
                    compile_memory(_on_devices(c, n_devices, m[0]), m[0],
                                   hopper_kernels=hopper_kernels)["peak"])
            entry = {"devices": m[0], "predicted_peak": m[1], "compiled_peak": peak}
            if peak <= hbm_gb * GB:
                break
            entry["devices"] = None
            m = min_devices(c, n_devices, full, hbm_gb * GB, cands.index(m[0]) + 1)
        res["min_devices"][name] = entry
    return res


def _derived(m: dict) -> int:
    """The compiled arguments' bytes as the shardings give them: the state's parts and the batch."""
    return sum(m[k] for k in ("params", "optimizer", "frozen", "compute_copy", "rest", "batch"))


def _report(cfg, n, hbm_gb, res) -> str:
    f = res["full"]
    lines = [f"dsjax plan: {n} devices, mesh {cfg.mesh}, batch {cfg.data.batch_size} x "
             f"{cfg.data.seq_len} (accum {cfg.train.grad_accum}), remat {cfg.model.remat}, "
             f"dtype {cfg.model.dtype}/{cfg.model.weight_dtype}, moments "
             f"{cfg.optim.mu_dtype}/{cfg.optim.nu_dtype}, kernels {res.get('kernels', 'hopper')}",
             "per device (GB):",
             f"  parameters        {f['params'] / GB:9.2f}",
             f"  optimizer state   {f['optimizer'] / GB:9.2f}",
             *([f"  frozen weights    {f['frozen'] / GB:9.2f}  (LoRA / lora.freeze: compute dtype, "
                "no moments)"] if f.get("frozen") else []),
             *([f"  compute copy      {f['compute_copy'] / GB:9.2f}  (the master weights in the compute dtype, "
                "renewed by each update)"] if f.get("compute_copy") else []),
             f"  router bias, misc {f['rest'] / GB:9.4f}",
             f"  batch             {f['batch'] / GB:9.4f}",
             f"  compiled args     {f['argument'] / GB:9.2f}  (state + batch; "
             f"sharding-derived {_derived(f) / GB:.2f})",
             f"  temporaries       {f['temp'] / GB:9.2f}  (gradients, activations, gathered weights)",
             f"  outputs (donated) {f['output'] / GB:9.2f}  aliased {f['alias'] / GB:.2f}",
             f"  peak              {f['peak'] / GB:9.2f}  of {hbm_gb:.0f} GB HBM -> "
             f"{'fits' if f['peak'] <= hbm_gb * GB else 'DOES NOT FIT'}"]
    if "small" in res:
        sm, L = res["small"], cfg.model.num_hidden_layers
        per_layer = {k: (f[k] - sm[k]) / max(L - res["small_layers"], 1) for k in ("params", "optimizer", "temp")}
        lines.append(f"check: {res['small_layers']}-layer config compiled on the same mesh: args "
                     f"{sm['argument'] / GB:.3f} GB (sharding-derived "
                     f"{_derived(sm) / GB:.3f}), temporaries "
                     f"{sm['temp'] / GB:.2f} GB, peak {sm['peak'] / GB:.2f} GB; per extra layer: params "
                     f"{per_layer['params'] / GB:.3f}, optimizer {per_layer['optimizer'] / GB:.3f}, "
                     f"temporaries {per_layer['temp'] / GB:.3f} GB")
    per_dev = cfg.data.batch_size * cfg.data.seq_len // n
    for name, e in res.get("min_devices", {}).items():
        head = f"fewest devices that fit {hbm_gb:.0f} GB ({name}, {per_dev} tokens per device): "
        if e["devices"] is None:
            seen = (f" (the last compiled: peak {e['compiled_peak'] / GB:.2f} GB)"
                    if "compiled_peak" in e else "")
            lines.append(head + f"none up to {n}{seen}; plan more devices")
            continue
        tail = (f"; compiled there: peak {e['compiled_peak'] / GB:.2f} GB" if "compiled_peak" in e
                else " (estimate: exact state, temporaries of this compile with the "
                "parameter-sized ones rescaled)")
        lines.append(head + f"{e['devices']}, predicted peak {e['predicted_peak'] / GB:.2f} GB" + tail)
    if "explain" in f:
        lines.append(plan_explain.format_explain(f["explain"], f"the {n}-device step"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsjax.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", required=True, metavar="FILE",
                    help="YAML config; repeatable, applied left to right (a file's 'base:' first)")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--hbm-gb", type=float, default=80.0,
                    help="device memory in GB the plan must fit (default 80; an H200 has 141)")
    ap.add_argument("--explain", type=int, nargs="?", const=15, default=0, metavar="N",
                    help="list the N (default 15) largest temporaries live at the peak, with "
                         "their HLO op and source line")
    ap.add_argument("--kernels", choices=("hopper", "backend"), default="hopper",
                    help="hopper (default): the kernels a Hopper GPU runs, as compile-only "
                         "stand-ins of their outputs; backend: what this CPU runs (references)")
    ap.add_argument("--dump-dir", help="with --explain: keep XLA's dump (HLO, buffer assignment, "
                                       "live ranges) in this directory")
    ap.add_argument("--no-check", action="store_true", help="skip the 1-MoE-layer check compile")
    ap.add_argument("--verify-min", action="store_true",
                    help="compile at the predicted fewest device counts too")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    a = ap.parse_args(argv)
    if os.environ.get("DSJAX_PLAN_CHILD") != "1":
        with tempfile.TemporaryDirectory(prefix="dsjax-plan-") as tmp:
            dump = (a.dump_dir or tmp) if a.explain else None
            r = subprocess.run([sys.executable, "-m", "dsjax.plan",
                                *(argv if argv is not None else sys.argv[1:])],
                               env=_child_env(a.devices, dump))
        return r.returncode
    cfg = C.load(a.config, a.sets)
    res = plan(cfg, a.devices, a.hbm_gb, a.explain, not a.no_check, a.kernels == "hopper",
               a.verify_min)
    res["kernels"] = a.kernels
    if a.json:
        res["full"].pop("explain", None)
    print(json.dumps(res) if a.json else _report(cfg, a.devices, a.hbm_gb, res), flush=True)
    return 0


if __name__ == "__main__":
    from dsjax.cli import run_main

    run_main("dsjax.plan", lambda: sys.exit(main()))  # a bad config: one line, exit status 2
