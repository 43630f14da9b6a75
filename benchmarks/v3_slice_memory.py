"""GPU check of the memory plan: the per-device program of a DeepSeek-V3 slice, compiled by XLA's
GPU compiler on one H200, next to `dsjax.plan`'s CPU compile of the same slice.

    python benchmarks/v3_slice_memory.py            # on a machine with one Hopper GPU
    python benchmarks/v3_slice_memory.py --moe-layers 2 --devices 256

The slice is configs/deepseek_v3.yaml with its 3 dense layers, `--moe-layers` MoE layers and
the MTP module, on the full layout (`--devices` 256: expert=8, fsdp=32) with the full per-device
batch (1 x 4096 tokens): every per-device shape (sharded state, gathered layer weights,
dispatch chunks, logits chunks) equals the 61-layer run's; only the depth differs.

GPU side (a subprocess; nothing runs, nothing is allocated): the train step is compiled ahead
of time for a PJRT GPU topology of `--devices` GPUs
(`jax.experimental.topologies.get_topology_desc(platform="cuda", topology="1x<devices/8>x8")`,
target config from the local GPU) although only one exists, and its `memory_analysis()` is the
per-device program's. The Pallas kernels are the real Mosaic GPU kernels (`impl` "auto" on
Hopper).
CPU side (a subprocess, concurrently): `dsjax.plan.compile_memory` on `--devices` fake CPU
devices with the compile-only kernel stand-ins, as `python -m dsjax.plan` does.

Prints both analyses (argument, output, alias, temp, peak, in GB) and the GPU / CPU ratios.
Runtime on the H200 machine (16 cores): under 5 minutes at `--moe-layers 2`, the two compiles
overlapping (2026-12-02, beside a training benchmark).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
KEYS = ("params", "optimizer", "argument", "output", "alias", "temp", "peak")


def _slice_cfg(moe_layers: int, sets: list[str]):
    from dsjax import config as C
    cfg = C.load(ROOT / "configs" / "deepseek_v3.yaml", sets)
    first = cfg.model.first_k_dense_replace
    import dataclasses
    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, num_hidden_layers=first + moe_layers))


def _child(a) -> int:
    """One compile in this process; prints one JSON line `RESULT {...}`."""
    import jax
    devices = None
    if a.child == "topology":
        from jax.experimental import topologies
        topo = topologies.get_topology_desc(platform="cuda", topology=f"1x{a.devices // 8}x8")
        devices = list(topo.devices)
    from dsjax.plan import compile_memory
    cfg = _slice_cfg(a.moe_layers, a.sets)
    hopper_stand_ins = a.child == "cpu"
    m = compile_memory(cfg, a.devices, devices=devices, hopper_kernels=hopper_stand_ins)
    m["backend"] = jax.default_backend()
    m["device_kind"] = getattr(jax.devices()[0], "device_kind", "?")
    print("RESULT " + json.dumps(m), flush=True)
    return 0


def _spawn(kind: str, a) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if kind == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={a.devices}").strip()
    else:  # compile only: leave the GPU's memory to whatever else runs on it
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    args = [sys.executable, __file__, "--child", kind, "--devices", str(a.devices),
            "--moe-layers", str(a.moe_layers)] + [x for s in a.sets for x in ("--set", s)]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _collect(p: subprocess.Popen, kind: str):
    out, _ = p.communicate()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = "\n".join(out.splitlines()[-25:])
    print(f"--- {kind} compile failed (exit {p.returncode}); last lines:\n{tail}", flush=True)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--devices", type=int, default=256)
    ap.add_argument("--no-cpu", action="store_true", help="skip the CPU plan of the slice")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE")
    ap.add_argument("--child", choices=("cpu", "topology"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return _child(a)
    cpu = None if a.no_cpu else _spawn("cpu", a)
    gpu = _collect(_spawn("topology", a), "GPU (topology)")
    cpu_res = _collect(cpu, "CPU plan") if cpu else None
    print(f"V3 slice: 3 dense + {a.moe_layers} MoE layers + MTP, {a.devices}-device layout, "
          f"per-device program; GB per device")
    print(f"  {'':10} " + " ".join(f"{k:>10}" for k in KEYS))
    for name, r in (("GPU", gpu), ("CPU plan", cpu_res)):
        if r:
            print(f"  {name:10} " + " ".join(f"{r[k] / GB:10.2f}" for k in KEYS)
                  + f"   ({r['backend']}, {r['device_kind']})")
    if gpu and cpu_res:
        print("  GPU / CPU  " + " ".join(
            f"{gpu[k] / cpu_res[k]:10.3f}" if cpu_res[k] else f"{'-':>10}" for k in KEYS))
    return 0 if gpu else 1


if __name__ == "__main__":
    sys.exit(main())
