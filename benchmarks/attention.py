"""Attention on one Hopper GPU: our Pallas Mosaic GPU kernels vs cuDNN, tokamax (when it is
importable) and plain XLA, forward and forward+backward, on the named shapes of `SHAPES`.

    python benchmarks/attention.py [--shapes mla,mha128] [--impls ours,cudnn] [--check]
    python benchmarks/attention.py --tiny      # smoke test on any backend (CPU: interpret mode)

FLOPs: forward 2*B*N*T*S*(Dqk+Dv), halved for causal; forward+backward = 3.5x forward (backward
counted as 2.5x forward). Inputs bf16, random normal (never zeros).

Timing: the impls of a shape are compiled first, then timed in `--rounds` interleaved rounds
(each round: every impl once, `--iters` back-to-back calls of its forward, then of its
forward+backward); the table reports the median over rounds. A second table pairs each impl
with the shape's first impl round by round (median and range of time / first impl's time in the
same round, for fwd, fwd+bwd and bwd = fwd+bwd - fwd): the GPU's power cap moves the clock
between rounds (identical kernels have differed by up to ~6 %), pairing removes most of that.

`--check`: relative L2 error of o and dq, dk, dv vs the fp32 reference (`attention_reference`
at "highest" matmul precision; cotangent one random dO), and for ours the max abs error of the
natural lse; without it, errors are vs the first impl.
`--trace DIR`: after timing, `--trace-calls` calls of each (shape, impl)'s fwd+bwd and fwd
programs are traced with jax.profiler into DIR/<shape>_<impl>_<fwdbwd|fwd> and their GPU kernels
printed (benchmarks/_trace.py: us per call, device busy vs wall time per call).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from pallas_kernels.flash_attention import flash_attention  # noqa: E402
from pallas_kernels.flash_attention.reference import attention_reference  # noqa: E402

from _trace import device_events, kernel_summary, summary_markdown  # noqa: E402 (benchmarks/_trace.py)

SHAPES = {  # name: (B, T, N, Dqk, Dv, causal); K = N, S = T
    "mla": (4, 4096, 16, 192, 128, True),
    "mla-2k": (4, 2048, 16, 192, 128, True),   # the V2-Lite training step's B4 x T2048
    "mla-long": (1, 16384, 16, 192, 128, True),
    "mha128": (4, 4096, 16, 128, 128, True),
}
TINY = dict(B=1, T=256, N=2)   # --tiny: every shape at this size


def inputs(seed, B, T, N, K, Dqk, Dv):
    """Random normal bf16 q [B, T, N, Dqk], k [B, T, K, Dqk], v [B, T, K, Dv], dO [B, T, N, Dv]."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, N, Dqk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, K, Dqk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, K, Dv), jnp.bfloat16)
    do = jax.random.normal(ks[3], (B, T, N, Dv), jnp.bfloat16)
    return q, k, v, do


def ours(q, k, v, causal, return_lse=False):
    return flash_attention(q, k, v, causal=causal, impl="pallas", return_lse=return_lse)


def ours_seg(q, k, v, causal):
    """Ours with segment ids, one segment per row, as the training step passes them (packed
    rows carry document ids; this is a row that holds one document)."""
    seg = jnp.ones(q.shape[:2], jnp.int32)
    return flash_attention(q, k, v, causal=causal, impl="pallas", segment_ids=seg)


def cudnn(q, k, v, causal):
    """cuDNN flash attention: jax.nn.dot_product_attention where it takes the shapes (equal head
    dims), else (MLA, Dqk != Dv) the cuDNN call behind it."""
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


IMPLS = {"ours": ours, "ours_seg": ours_seg, "cudnn": cudnn, "tokamax": tokamax_mosaic,
         "xla": xla}


def default_impls():
    """Every impl this machine can run: cuDNN and tokamax need a GPU, tokamax its package."""
    on_gpu = jax.devices()[0].platform == "gpu"
    return [n for n in IMPLS if n in ("ours", "ours_seg", "xla") or (
        on_gpu and (n != "tokamax" or importlib.util.find_spec("tokamax") is not None))]


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


def _rel(x, y):
    x, y = x.astype(jnp.float32), y.astype(jnp.float32)
    return float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))


def _ratios(times, base):
    """(median, min, max) over rounds of times[i] / base[i] (same-round pairs)."""
    r = [t / b for t, b in zip(times, base)]
    return statistics.median(r), min(r), max(r)


def _trace_programs(trace_dir, calls, tag, programs, args):
    """--trace: for each (name, jitted program), a jax.profiler trace of `calls` back-to-back
    calls (after one untraced call) into trace_dir/<tag>_<name>, then its GPU kernels. A
    failure prints its traceback and the next program is traced."""
    for name, fn in programs:
        d = os.path.join(trace_dir, f"{tag}_{name}")
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
                # Mosaic GPU kernels share one name: the last call's kernels of >= 5 us, in order.
                evs = device_events(d)
                print("last call, in order: " + ", ".join(
                    f"{n[:28]} {dur / 1e3:.1f} us" for _, dur, n in evs[-(len(evs) // calls):]
                    if dur >= 5000), flush=True)
        except Exception:  # noqa: BLE001 - report and keep benchmarking
            print(f"trace {d} FAILED:", flush=True)
            traceback.print_exc()


def _reference(q, k, v, do, causal):
    """fp32 reference o, lse and (dq, dk, dv) at "highest" matmul precision."""
    def f(q, k, v, do):
        (o, lse), vjp = jax.vjp(
            lambda *y: attention_reference(*y, causal=causal, return_lse=True), q, k, v)
        return o, lse, vjp((do, jnp.zeros_like(lse)))
    with jax.default_matmul_precision("highest"):
        return jax.jit(f)(*(x.astype(jnp.float32) for x in (q, k, v, do)))


def bench_shape(name, shape, impls, a):
    """Compile and check every impl on one shape, time them in interleaved rounds. Returns
    (rows, paired rows) for the two tables."""
    B, T, N, Dqk, Dv, causal = shape
    q, k, v, do = inputs(list(SHAPES).index(name.split(" ")[0]), B, T, N, N, Dqk, Dv)
    flops = 2.0 * B * N * T * T * (Dqk + Dv) * (0.5 if causal else 1.0)
    ref = _reference(q, k, v, do, causal) if a.check else None
    rows, compiled = [], []
    for iname in impls:
        impl = IMPLS[iname]
        try:
            fwd = jax.jit(lambda q, k, v, impl=impl: impl(q, k, v, causal))

            def fb(q, k, v, impl=impl):
                o, vjp = jax.vjp(lambda *x: impl(*x, causal), q, k, v)
                return o, vjp(do)
            fwdbwd = jax.jit(fb)
            # Forward first: under GPU interpret mode (CPU) a jitted fwd+bwd as the first call
            # of the kernels hangs.
            jax.block_until_ready(fwd(q, k, v))
            o, g = fwdbwd(q, k, v)
            if ref is None:   # no reference: compare with the first impl that runs
                ref = (o, None, g)
                err = "-"
            else:
                err = "o %.1e dq %.1e dk %.1e dv %.1e" % (
                    _rel(o, ref[0]), *(_rel(x, y) for x, y in zip(g, ref[2])))
            if a.check and iname == "ours":
                lse = jax.jit(lambda q, k, v: ours(q, k, v, causal, return_lse=True)[1])(q, k, v)
                fin = jnp.isfinite(ref[1])
                lse_err = float(jnp.max(jnp.where(fin, jnp.abs(lse - ref[1]), 0.0)))
                same = bool(jnp.all(jnp.isfinite(lse) == fin))
                err += " lse %.1e%s" % (lse_err, "" if same else " (-inf rows differ!)")
            compiled.append((iname, fwd, fwdbwd, err))
        except Exception as e:  # noqa: BLE001 - report and keep benchmarking the rest
            traceback.print_exc()
            rows.append((name, iname, *(float("nan"),) * 4,
                         f"FAILED {type(e).__name__}: {str(e)[:80]}"))
    ts = [([], []) for _ in compiled]
    for _ in range(a.rounds):
        for i, (_, fwd, fwdbwd, _) in enumerate(compiled):
            ts[i][0].append(_time(fwd, (q, k, v), a.iters, 1))
            ts[i][1].append(_time(fwdbwd, (q, k, v), a.iters, 1))
    for (iname, _, _, err), (tfs, tfbs) in zip(compiled, ts):
        tf, tfb = statistics.median(tfs), statistics.median(tfbs)
        rows.append((name, iname, flops / tf / 1e12, 3.5 * flops / tfb / 1e12, tf * 1e3,
                     tfb * 1e3, err + f" (fwd spread {max(tfs) / min(tfs) - 1:.1%})"))
        print(rows[-1], flush=True)
    paired = [(name, iname, compiled[0][0],
               *(_ratios(x, y) for x, y in ((tfs, ts[0][0]), (tfbs, ts[0][1]), (
                   [b - f for f, b in zip(tfs, tfbs)], [b - f for f, b in zip(*ts[0])]))))
              for (iname, _, _, _), (tfs, tfbs) in list(zip(compiled, ts))[1:]]
    if a.trace:
        for iname, fwd, fwdbwd, _ in compiled:
            _trace_programs(a.trace, a.trace_calls, f"{name.split(' ')[0]}_{iname}",
                            (("fwdbwd", fwdbwd), ("fwd", fwd)), (q, k, v))
    return rows, paired


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"names from {list(SHAPES)}")
    ap.add_argument("--impls", default="", help=f"from {list(IMPLS)}; default: "
                    "every impl this machine can run")
    ap.add_argument("--tiny", action="store_true", help=f"smoke test: every shape at {TINY}")
    ap.add_argument("--check", action="store_true", help="errors vs the fp32 reference")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--iters", type=int, default=5, help="back-to-back calls per timing")
    ap.add_argument("--trace", default="", metavar="DIR", help="after timing, trace each "
                    "(shape, impl)'s fwd and fwd+bwd programs into DIR and print their kernels")
    ap.add_argument("--trace-calls", type=int, default=5, help="calls per --trace trace")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    a = ap.parse_args()
    impls = a.impls.split(",") if a.impls else default_impls()
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, impls {impls}",
          flush=True)
    rows, paired = [], []
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        if a.tiny:
            name, shape = name + " [tiny]", (TINY["B"], TINY["T"], TINY["N"], *shape[3:])
        r, p = bench_shape(name, shape, impls, a)
        rows += r
        paired += p
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
    print(f"\n| shape | impl | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms | bwd ms |"
          f" rel. error vs {'fp32 reference' if a.check else 'first impl'} |")
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


if __name__ == "__main__":
    main()
