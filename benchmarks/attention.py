"""Attention TFLOP/s on one Hopper GPU: ours (Pallas Mosaic GPU) vs cuDNN, tokamax mosaic, XLA.

Run on the GPU machine: `python benchmarks/attention.py [--quick]`. Prints one table.
FLOPs: forward 2*B*N*T*S*(Dqk+Dv), halved for causal; forward+backward = 3.5x forward
(backward counted as 2.5x forward). Inputs bf16, random normal (never zeros).
Each cell: median over `reps` timings of `iters` back-to-back calls, after a warm-up call;
with `--rounds R` the impls of a shape are compiled first and then timed interleaved (R rounds,
each impl once per round), the median over rounds reported with the forward's spread, and a
second table pairs each impl with the shape's first one round by round: the median and range
over rounds of its time / the first impl's time in the same round, for the forward, the
forward+backward and the backward alone (fwd+bwd minus fwd). Pairing within a round removes
most of the clock drift that the GPU's power cap puts between rounds (identical kernels have
differed by up to ~6 % between rounds; RESULTS.md "v9").

`--impls` takes `ours`, `ours:fused` (the fused backward of `mosaic_gpu_bwd`), `ours:VARIANT`
(a `VARIANTS` entry: Config fields changed from `default_config`; one name may be listed twice
to time it twice), `cudnn`, `tokamax`, `xla`.
`--check` compares every impl with the fp32 chunked reference (`attention_reference` at
"highest" matmul precision): relative L2 error of o and of dq, dk, dv (cotangent: one random
dO), and for ours the max abs error of the natural lse. `--budget S` skips the cells left once
S seconds have passed; `--json F` writes the rows.
`--trace DIR`: after each (shape, impl) is timed (also under `--rounds`), `--trace-calls N`
(default 5) back-to-back calls of its jitted fwd+bwd program and, separately, of its forward are
traced with jax.profiler into DIR/<shape index>_<impl>_fwdbwd and DIR/<shape index>_<impl>_fwd
(characters other than letters, digits, "_.-" in the impl become "_", e.g. ours_split); printed
per program: a markdown table of its GPU kernels (launches per call, us per call, share of the
summed kernel time) and the device busy us per call vs the wall us per call (first kernel's
start to last kernel's end, divided by N), whose difference is the gaps between kernels; then
the last call's kernels of >= 5 us in launch order (the forward, dq and dk/dv kernels share one
name). A failing trace prints its traceback; the benchmark goes on.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.flash_attention import mosaic_gpu  # noqa: E402
from pallas_kernels.flash_attention.reference import attention_reference  # noqa: E402

from _trace import device_events, kernel_summary, summary_markdown  # noqa: E402 (benchmarks/_trace.py)

SHAPES = [  # (name, B, T, N, Dqk, Dv, causal)
    ("MLA B4 T4096 N16 192/128 causal", 4, 4096, 16, 192, 128, True),
    ("MLA B1 T16384 N16 192/128 causal", 1, 16384, 16, 192, 128, True),
    ("B4 T4096 N16 128/128 causal", 4, 4096, 16, 128, 128, True),
]


VARIANTS = {   # name: Config fields changed from default_config (v1: forward before session 3)
    "v1": dict(fwd_longest_first=False),
    "lf": dict(fwd_longest_first=True),
    "s3": dict(stages_bwd=3),
    "dq128": dict(block_kv_dq=128),
    "qdkv128": dict(block_q_dkv=128),
    "dq128s3": dict(block_kv_dq=128, stages_bwd=3),
    # session 4 (Config.bwd_longest_first / dq_issue / dkv_issue / regs_fwd / regs_bwd); the
    # first run's names: blf, r240, sdp, sdp1, dvdp changed one field from the session-3
    # backward (bwd3), the default since.
    "bwd3": dict(bwd_longest_first=False, dq_issue="serial", dkv_issue="serial",
                 dkv_fold=False, regs_bwd=(232, 40)),
    "nofold": dict(dkv_fold=False),
    "dkv_sdp": dict(dkv_issue="sdp"),
    "fr240": dict(regs_fwd=(240, 24)),
    "dkv_serial": dict(dkv_issue="serial"),
    "dkv_sdp1": dict(dkv_issue="sdp1"),
    "dkv_dvdp": dict(dkv_issue="dvdp"),
    "dq_serial": dict(dq_issue="serial"),
    # session 5: Config.fwd_pipe (on by default since) and no_auto_barriers (off: neutral)
    "nopipe": dict(fwd_pipe=False),
    "nab": dict(no_auto_barriers=True),
    "s4": dict(fwd_pipe=False),   # session 4's defaults
    "pipe64": dict(block_kv=64),
    # session 8: Config.fwd_fma, named_barriers, dkv_stat_smem (on by default since)
    "s7": dict(fwd_fma=False, named_barriers=False, dkv_stat_smem=False),  # session 7's defaults
    "fma": dict(named_barriers=False, dkv_stat_smem=False),
    "nb": dict(fwd_fma=False, dkv_stat_smem=False),
    "fma_nb": dict(dkv_stat_smem=False),
    # session 9: Config.dq_regs
    "dqq": dict(dq_regs="q"),
    "dqdo": dict(dq_regs="do"),
    "dq0": dict(dq_regs=""),     # session 8's dq kernel (dq_regs "do" is MLA's default since)
}


def inputs(seed, B, T, N, K, Dqk, Dv):
    """Random normal bf16 q [B, T, N, Dqk], k [B, T, K, Dqk], v [B, T, K, Dv], dO [B, T, N, Dv]
    (shared with attention_bwd.py)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, Dqk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, K, Dqk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, K, Dv), jnp.bfloat16)
    do = jax.random.normal(ks[3], (B, T, N, Dv), jnp.bfloat16)
    return q, k, v, do


def ours(q, k, v, causal):
    return flash_attention(q, k, v, causal=causal, impl="pallas")


def _interpret():
    """None on a GPU (compile the kernels); GPU interpret mode elsewhere (--tiny on CPU)."""
    if jax.devices()[0].platform == "gpu":
        return None
    return mosaic_gpu.interpret_params()


def ours_fused(q, k, v, causal, return_lse=False):
    """Our forward with the fused (FA3 hdim-192 layout) backward of `mosaic_gpu_bwd`."""
    from pallas_kernels.flash_attention import mosaic_gpu_bwd
    o, lse = mosaic_gpu_bwd.flash_attention_fused(q, k, v, causal=causal,
                                                  interpret=_interpret())
    return (o, lse) if return_lse else o


def ours_variant(name):
    if name == "fused":
        return ours_fused

    def run(q, k, v, causal, return_lse=False):
        cfg = dataclasses.replace(mosaic_gpu.default_config(q.shape[-1], v.shape[-1]),
                                  **VARIANTS[name])
        o, lse = mosaic_gpu.flash_attention_mosaic(q, k, v, causal=causal, cfg=cfg,
                                                   interpret=_interpret())
        return (o, lse) if return_lse else o
    return run


def cudnn(q, k, v, causal):
    if q.shape[-1] == v.shape[-1]:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    return dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5,
                                 mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
                                 qkv_layout="BTNH")


def tokamax_mosaic(q, k, v, causal):
    import tokamax
    return tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic")


def xla(q, k, v, causal):
    """Plain XLA attention: bf16 matmuls, fp32 softmax."""
    T, S = q.shape[1], k.shape[1]
    s = jnp.einsum("btnd,bsnd->bnts", q, k, preferred_element_type=jnp.float32)
    s = s * q.shape[-1] ** -0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((T, S), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("bnts,bsnd->btnd", p, v)


IMPLS = [("ours", ours), ("cudnn", cudnn), ("tokamax", tokamax_mosaic), ("xla", xla)]


def _calls(fn, args, iters):
    """`iters` back-to-back calls of `fn`, waited for at the end."""
    # GPU interpret mode (CPU) has global simulator state: never run two calls at once there.
    sync_each = jax.devices()[0].platform != "gpu"
    for _ in range(iters):
        out = fn(*args)
        if sync_each:
            jax.block_until_ready(out)
    jax.block_until_ready(out)


def _time(fn, args, iters, reps):
    """Seconds per call: the median over `reps` timings of `iters` back-to-back calls, after a
    warm-up call."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _calls(fn, args, iters)
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)


def _trace_programs(trace_dir, calls, si, iname, fwd, fwdbwd, args):
    """--trace: for each of the jitted programs fwdbwd and fwd, a jax.profiler trace of `calls`
    back-to-back calls (after one untraced call) into trace_dir/<si>_<iname sanitized>_<tag>,
    then its per-kernel table (benchmarks/_trace.py `summary_markdown`: us per call, device busy
    vs wall us per call). A failure prints its traceback and the next program is traced."""
    for tag, fn in (("fwdbwd", fwdbwd), ("fwd", fwd)):
        d = os.path.join(trace_dir, f"{si}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', iname)}_{tag}")
        try:
            jax.block_until_ready(fn(*args))
            jax.profiler.start_trace(d)
            try:
                _calls(fn, args, calls)
            finally:
                jax.profiler.stop_trace()
            summ = kernel_summary(d)
            print(f"\ntrace {d}: {calls} calls, {summ['events']} kernel launches", flush=True)
            if summ["events"]:
                print(summary_markdown(summ, calls), flush=True)
                # Kernels of one name (all Mosaic GPU kernels are "entry_mosaic_gpu_kernel")
                # are told apart by their order: the last call's kernels of >= 5 us, in order.
                evs = device_events(d)
                last = evs[-(len(evs) // calls):]
                print("last call, in order: " + ", ".join(
                    f"{n[:28]} {dur / 1e3:.1f} us" for _, dur, n in last if dur >= 5000),
                    flush=True)
        except Exception:  # noqa: BLE001 - report and keep benchmarking
            print(f"trace {d} FAILED:", flush=True)
            traceback.print_exc()


def _impl(iname):
    if iname.startswith("ours:"):
        return ours_variant(iname.split(":", 1)[1])
    return dict(IMPLS)[iname]


def _rel(x, y):
    x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    return float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--impls", default=",".join(n for n, _ in IMPLS))
    ap.add_argument("--shapes", default="0,1,2")
    ap.add_argument("--tiny", action="store_true", help="smoke test: T=256, N=2 (any backend)")
    ap.add_argument("--check", action="store_true", help="errors vs the fp32 reference")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds; 0 = no limit")
    ap.add_argument("--json", default="")
    ap.add_argument("--shape-impls", action="append", default=[],
                    help="SI=LIST: impls for shape SI instead of --impls (repeatable)")
    ap.add_argument("--iters", type=int, default=5, help="back-to-back calls per timing")
    ap.add_argument("--reps", type=int, default=5, help="timings (the median is reported)")
    ap.add_argument("--rounds", type=int, default=0, help="interleave the impls of a shape: "
                    "R rounds of one timing each (an impl listed twice is compiled twice)")
    ap.add_argument("--trace", default="", metavar="DIR", help="after timing, trace each "
                    "(shape, impl)'s fwd and fwd+bwd programs into DIR and print their kernels")
    ap.add_argument("--trace-calls", type=int, default=5, help="calls per --trace trace")
    a = ap.parse_args()
    per_shape = dict(x.split("=", 1) for x in a.shape_impls)
    iters, reps = (3, 3) if a.quick else (a.iters, a.reps)
    t_start = time.perf_counter()
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    rows, paired = [], []
    for si in map(int, a.shapes.split(",")):
        name, B, T, N, Dqk, Dv, causal = SHAPES[si]
        if a.tiny:
            name, B, T, N = name + " [tiny]", 1, 256, 2
        q, k, v, do = inputs(si, B, T, N, N, Dqk, Dv)
        flops = 2.0 * B * N * T * T * (Dqk + Dv) * (0.5 if causal else 1.0)
        ref_o = ref_g = ref_lse = None
        if a.check:
            def ref_fn(q, k, v, do):
                (o, lse), vjp = jax.vjp(
                    lambda *y: attention_reference(*y, causal=causal, return_lse=True), q, k, v)
                return o, lse, vjp((do, jnp.zeros_like(lse)))
            with jax.default_matmul_precision("highest"):
                ref_o, ref_lse, ref_g = jax.jit(ref_fn)(
                    *(x.astype(jnp.float32) for x in (q, k, v, do)))
        compiled = []
        for iname in per_shape.get(str(si), a.impls).split(","):
            if a.budget and time.perf_counter() - t_start > a.budget:
                print(f"budget: skip {name} / {iname}", flush=True)
                continue
            impl = _impl(iname)
            try:
                fwd = jax.jit(lambda q, k, v, impl=impl: impl(q, k, v, causal))

                def fb(q, k, v, impl=impl):
                    o, vjp = jax.vjp(lambda *x: impl(*x, causal), q, k, v)
                    return o, vjp(do)
                fwdbwd = jax.jit(fb)
                # Forward first: under GPU interpret mode (CPU) a jitted fwd+bwd as the first
                # call of the kernels hangs (seen with the committed kernels too).
                jax.block_until_ready(fwd(q, k, v))
                o, g = fwdbwd(q, k, v)
                if ref_o is None:   # no reference: compare with the first impl that runs
                    ref_o, ref_g = o, g
                    err = "-"
                else:
                    err = "o %.1e dq %.1e dk %.1e dv %.1e" % (
                        _rel(o, ref_o), *(_rel(x, y) for x, y in zip(g, ref_g)))
                if a.check and iname.startswith("ours"):
                    fl = ours_variant(iname.split(":", 1)[1]) if ":" in iname else (
                        lambda q, k, v, c, return_lse: flash_attention(
                            q, k, v, causal=c, impl="pallas", return_lse=return_lse))
                    o2, lse = jax.jit(lambda q, k, v: fl(q, k, v, causal, return_lse=True))(q, k, v)
                    fin = jnp.isfinite(ref_lse)
                    lse_err = float(jnp.max(jnp.where(fin, jnp.abs(lse - ref_lse), 0.0)))
                    same = bool(jnp.all(jnp.isfinite(lse) == fin))
                    err += " lse %.1e%s" % (lse_err, "" if same else " (-inf rows differ!)")
                    assert not bool(jnp.isnan(o2.astype(jnp.float32)).any()), "NaN in o"
                if a.rounds:   # timed below, interleaved with the shape's other impls
                    compiled.append((iname, fwd, fwdbwd, err))
                    continue
                tf = _time(fwd, (q, k, v), iters, reps)
                tfb = _time(fwdbwd, (q, k, v), iters, reps)
                rows.append((name, iname, flops / tf / 1e12, 3.5 * flops / tfb / 1e12,
                             tf * 1e3, tfb * 1e3, err))
                if a.trace:
                    _trace_programs(a.trace, a.trace_calls, si, iname, fwd, fwdbwd, (q, k, v))
            except Exception as e:  # noqa: BLE001 - report and keep benchmarking the rest
                traceback.print_exc()
                rows.append((name, iname, float("nan"), float("nan"), float("nan"), float("nan"),
                             f"FAILED {type(e).__name__}: {str(e)[:80]}"))
            print(rows[-1], "t=%.0fs" % (time.perf_counter() - t_start), flush=True)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
        if compiled:
            # --rounds R: R rounds, each timing every impl once (fwd, then fwd+bwd, `iters`
            # calls each) in list order; the median over rounds is reported, so a drift of
            # the GPU clock during the shape's timings reaches every impl alike.
            ts = [([], []) for _ in compiled]
            for _ in range(a.rounds):
                for i, (_, fwd, fwdbwd, _) in enumerate(compiled):
                    ts[i][0].append(_time(fwd, (q, k, v), iters, 1))
                    ts[i][1].append(_time(fwdbwd, (q, k, v), iters, 1))
            for (iname, _, _, _), (tfs, tfbs) in list(zip(compiled, ts))[1:]:
                paired.append((name, iname, compiled[0][0],
                               *(_ratios(x, y) for x, y in (
                                   (tfs, ts[0][0]), (tfbs, ts[0][1]),
                                   ([b - f for f, b in zip(tfs, tfbs)],
                                    [b - f for f, b in zip(*ts[0])])))))
            for (iname, _, _, err), (tfs, tfbs) in zip(compiled, ts):
                tf, tfb = statistics.median(tfs), statistics.median(tfbs)
                spread = max(tfs) / min(tfs) - 1
                rows.append((name, iname, flops / tf / 1e12, 3.5 * flops / tfb / 1e12,
                             tf * 1e3, tfb * 1e3, err + f" (fwd spread {spread:.1%})"))
                print(rows[-1], flush=True)
            if a.trace:
                for iname, fwd, fwdbwd, _ in compiled:
                    _trace_programs(a.trace, a.trace_calls, si, iname, fwd, fwdbwd, (q, k, v))
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(rows, f, indent=1)
    ref_name = "fp32 reference" if a.check else "first impl"
    print("\n| shape | impl | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms | bwd ms |"
          f" rel. error vs {ref_name} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.3f} | {r[5]:.3f} |"
              f" {r[5] - r[4]:.3f} | {r[6]} |")
    if paired:
        print("\nPaired by round (time / the first impl's time in the same round; median [min, "
              "max] over rounds; < 1 is faster):\n")
        print("| shape | impl | vs | fwd | fwd+bwd | bwd |")
        print("|---|---|---|---|---|---|")
        for r in paired:
            cells = " | ".join("%.3f [%.3f, %.3f]" % x for x in r[3:])
            print(f"| {r[0]} | {r[1]} | {r[2]} | {cells} |")


def _ratios(times, base):
    """(median, min, max) over rounds of times[i] / base[i] (same-round pairs)."""
    r = [t / b for t, b in zip(times, base)]
    return statistics.median(r), min(r), max(r)


if __name__ == "__main__":
    main()
