"""Context-parallel ring attention vs single-GPU flash attention: forward and forward+backward
TFLOP/s per GPU.

Run on a multi-GPU host (e.g. 4 H200s):
    python3 benchmarks/ring_attention.py [--T 131072] [--B 1] [--N 16] [--dqk 192] [--dv 128]
        [--impl auto] [--layout striped|contiguous] [--devices P] [--reps 5] [--iters 3]
        [--dtype bfloat16|float32] [--json F] [--tiny]
Smoke test on CPU with fake devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python3 benchmarks/ring_attention.py --tiny --devices 4

What it measures. A mesh with context = P devices (default: all local devices; the other axes 1)
holds causal self-attention inputs q [B, T, N, Dqk], k [B, T, N, Dqk], v [B, T, N, Dv] (random
normal, bf16 by default), sharded over the sequence (NamedSharding P(None, "context")); with
`--layout striped` (default) the sequence is first put in `sharding.ring_attention.stripe` order,
which balances the causal work over the ranks; `contiguous` leaves rank i with block i (the last
rank then does about twice the average work, so the step takes about twice as long). Timed, all
jitted: `ring_attention` forward, and forward+backward (`jax.vjp` with a random cotangent); then,
on ONE device, `flash_attention` at T/P (same B, N, head dims, causal) forward and
forward+backward. Each time: median over `--reps` timings of `--iters` back-to-back calls after a
warm-up call (`benchmarks/attention.py` `_time`). When `--tiny` or T <= 8192, the ring forward
output (and its gradients) is also compared with one-device `flash_attention` of the whole
problem on the same inputs (relative L2 error; skipped at long T, where full attention on one
GPU is slow and large).

FLOPs (causal, useful work only, as `benchmarks/attention.py`):
    forward, global problem: 2*B*N*T*T*(Dqk+Dv)/2, per GPU: that / P
    single-GPU reference at T/P: 2*B*N*(T/P)^2*(Dqk+Dv)/2
    forward+backward: 3.5x forward (backward counted as 2.5x forward).
Per GPU, the ring does P times the work of the T/P reference (P blocks of (T/P)^2/2 each).

Per-GPU efficiency = ring TFLOP/s per GPU / single-GPU flash TFLOP/s at T/P (column "ring /
single"): 100 % means the ring costs each GPU exactly P single-GPU attentions at T/P, i.e. the
K/V passes (ppermute), the log-sum-exp merges and the load imbalance are all hidden; below 100 %
is their cost. It is not an efficiency against the GPU's peak (see `benchmarks/attention.py`).

The table is printed last; `--json F` writes it (rows plus the run's settings and errors).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import _rel, _time  # noqa: E402  (house timing and relative L2 error)
from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from sharding.mesh import make_mesh  # noqa: E402
from sharding.ring_attention import ring_attention, stripe, unstripe  # noqa: E402

CHECK_MAX_T = 8192  # longest T at which the full problem is also run on one device


class _MeshConfig:
    """`make_mesh` config: context = P, every other axis 1."""

    def __init__(self, context):
        self.data = self.fsdp = self.expert = self.tensor = 1
        self.context = context


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=131072, help="global sequence length")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--N", type=int, default=16, help="heads (q and kv)")
    ap.add_argument("--dqk", type=int, default=192)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--impl", default="auto", help="flash-attention impl: auto|pallas|reference")
    ap.add_argument("--layout", default="striped", choices=("striped", "contiguous"))
    ap.add_argument("--devices", type=int, default=0, help="P, context size (0: all local)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--json", default="")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke test: T=512, N=2, Dqk=Dv=64, impl reference")
    a = ap.parse_args()
    if a.tiny:
        a.T, a.N, a.dqk, a.dv, a.impl = 512, 2, 64, 64, "reference"
    return a


def _inputs(a, mesh, cp, striped, dtype):
    """Global q, k, v, dO in the original token order (`orig`) and in the ring's layout
    (`ring`, sharded over `context`, striped if asked). Each device draws its own shard."""
    B, T, N = a.B, a.T, a.N
    sh = NamedSharding(mesh, P(None, "context"))
    shapes = [(B, T, N, a.dqk), (B, T, N, a.dqk), (B, T, N, a.dv), (B, T, N, a.dv)]
    keys = jax.random.split(jax.random.key(0), 4)
    orig = [jax.jit(lambda key, s=s: jax.random.normal(key, s, dtype), out_shardings=sh)(key)
            for key, s in zip(keys, shapes)]
    if striped:
        ring = [jax.jit(lambda x: stripe(x, cp), out_shardings=sh)(x) for x in orig]
    else:
        ring = orig
    return orig, ring


def _ring_fns(mesh, striped, impl):
    """Jitted ring forward and forward+backward (`sharding.ring_attention.ring_attention`)."""

    def fwd(q, k, v):
        return ring_attention(q, k, v, mesh=mesh, causal=True, striped=striped, impl=impl)

    def fwdbwd(q, k, v, do):
        o, vjp = jax.vjp(fwd, q, k, v)
        return o, vjp(do)
    return jax.jit(fwd), jax.jit(fwdbwd)


def _flash_fns(impl):
    def fwd(q, k, v):
        return flash_attention(q, k, v, causal=True, impl=impl)

    def fwdbwd(q, k, v, do):
        o, vjp = jax.vjp(fwd, q, k, v)
        return o, vjp(do)
    return jax.jit(fwd), jax.jit(fwdbwd)


def _check(a, ring_fb, orig, ring_in, cp, striped, impl):
    """Relative L2 errors of the ring's o, dq, dk, dv vs one-device flash attention of the
    whole problem (original token order; ring outputs unstriped)."""
    un = (lambda x: unstripe(x, cp)) if striped else (lambda x: x)
    o, g = ring_fb(*ring_in)
    got = [jax.device_get(un(x)) for x in (o, *g)]
    dev0 = jax.devices()[0]
    full_in = [jax.device_put(jax.device_get(x), dev0) for x in orig]
    o0, g0 = _flash_fns(impl)[1](*full_in)
    names = ("o", "dq", "dk", "dv")
    return {n: _rel(jnp.asarray(x), jnp.asarray(jax.device_get(y)))
            for n, x, y in zip(names, got, (o0, *g0))}


def _row(name, devices, t_local, tf, tfb, flops_per_gpu):
    return dict(row=name, devices=devices, T_per_gpu=t_local, fwd_ms=tf * 1e3,
                fwdbwd_ms=tfb * 1e3, fwd_tflops_per_gpu=flops_per_gpu / tf / 1e12,
                fwdbwd_tflops_per_gpu=3.5 * flops_per_gpu / tfb / 1e12)


def main():
    a = _args()
    dtype = jnp.dtype(a.dtype)
    cp = a.devices or jax.local_device_count()
    striped = a.layout == "striped"
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind} "
          f"(platform {jax.devices()[0].platform}, {jax.local_device_count()} local devices)",
          flush=True)
    if cp > jax.local_device_count() or a.T % cp:
        raise SystemExit(f"--devices {cp}: need <= {jax.local_device_count()} devices and T % P == 0")
    B, T, N, Dqk, Dv = a.B, a.T, a.N, a.dqk, a.dv
    Tl = T // cp
    print(f"B={B} T={T} N={N} Dqk={Dqk} Dv={Dv} {a.dtype} causal, impl={a.impl}, "
          f"layout={a.layout}, P={cp} (T/P={Tl}), iters={a.iters} reps={a.reps}", flush=True)
    mesh = make_mesh(_MeshConfig(cp), devices=jax.local_devices()[:cp])
    ring_flops = 2.0 * B * N * T * T * (Dqk + Dv) / 2 / cp        # per GPU
    single_flops = 2.0 * B * N * Tl * Tl * (Dqk + Dv) / 2
    t0 = time.perf_counter()
    rows, errors = [], {}

    def stamp(msg):
        print(f"{msg} t={time.perf_counter() - t0:.0f}s", flush=True)

    orig, ring_in = _inputs(a, mesh, cp, striped, dtype)
    ring_name = f"ring ({a.layout})"
    rfwd, rfb = _ring_fns(mesh, striped, a.impl)
    try:
        # Forward first (under GPU interpret mode a fwd+bwd as the kernels' first call hangs).
        tf = _time(rfwd, tuple(ring_in[:3]), a.iters, a.reps)
        stamp(f"ring fwd {tf * 1e3:.3f} ms")
        tfb = _time(rfb, tuple(ring_in), a.iters, a.reps)
        stamp(f"ring fwd+bwd {tfb * 1e3:.3f} ms")
        rows.append(_row(ring_name, cp, Tl, tf, tfb, ring_flops))
    except Exception as e:  # noqa: BLE001 - report and still time the single-GPU reference
        traceback.print_exc()
        errors["ring"] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
    if a.tiny or T <= CHECK_MAX_T:
        try:
            errors["vs_full"] = _check(a, rfb, orig, ring_in, cp, striped, a.impl)
            stamp("check vs full attention: " + ", ".join(
                f"{k} {v:.1e}" for k, v in errors["vs_full"].items()))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            errors["vs_full"] = f"FAILED {type(e).__name__}: {str(e)[:200]}"
    del orig, ring_in

    dev0 = jax.devices()[0]
    ks = jax.random.split(jax.random.key(1), 4)
    shapes = [(B, Tl, N, Dqk), (B, Tl, N, Dqk), (B, Tl, N, Dv), (B, Tl, N, Dv)]
    single_in = [jax.device_put(jax.random.normal(k, s, dtype), dev0) for k, s in zip(ks, shapes)]
    sfwd, sfb = _flash_fns(a.impl)
    try:
        tf = _time(sfwd, tuple(single_in[:3]), a.iters, a.reps)
        stamp(f"single fwd {tf * 1e3:.3f} ms")
        tfb = _time(sfb, tuple(single_in), a.iters, a.reps)
        stamp(f"single fwd+bwd {tfb * 1e3:.3f} ms")
        rows.append(_row("single", 1, Tl, tf, tfb, single_flops))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        errors["single"] = f"FAILED {type(e).__name__}: {str(e)[:200]}"

    single = next((r for r in rows if r["row"] == "single"), None)
    for r in rows:
        for key in ("fwd", "fwdbwd"):
            r[f"ratio_{key}"] = (r[f"{key}_tflops_per_gpu"] / single[f"{key}_tflops_per_gpu"]
                                 if single else float("nan"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(jax=jax.__version__, device=dev0.device_kind, args=vars(a),
                           rows=rows, errors=errors), f, indent=1)

    vs = errors.get("vs_full")
    if isinstance(vs, dict):
        vs = "o %.1e dq %.1e dk %.1e dv %.1e" % tuple(vs[n] for n in ("o", "dq", "dk", "dv"))
    print(f"\nring vs full attention on one device (rel. L2): "
          f"{vs if vs else f'not run (T > {CHECK_MAX_T})'}")
    for k in ("ring", "single"):
        if k in errors:
            print(f"{k}: {errors[k]}")
    print(f"\nB={B} T={T} N={N} {Dqk}/{Dv} {a.dtype} causal, impl {a.impl}, {dev0.device_kind}")
    print("| row | devices | T per GPU | fwd ms | fwd+bwd ms | fwd TFLOP/s per GPU |"
          " fwd+bwd TFLOP/s per GPU | ring / single per GPU (fwd, fwd+bwd) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['devices']} | {r['T_per_gpu']} | {r['fwd_ms']:.3f} |"
              f" {r['fwdbwd_ms']:.3f} | {r['fwd_tflops_per_gpu']:.3g} |"
              f" {r['fwdbwd_tflops_per_gpu']:.3g} |"
              f" {r['ratio_fwd']:.0%}, {r['ratio_fwdbwd']:.0%} |")


if __name__ == "__main__":
    main()
