"""MoE kernels on one Hopper GPU: our grouped GEMM, permute and unpermute vs peers.

Run on the GPU machine: `python benchmarks/moe.py [--shapes v2lite,v3] [--rounds R] [--check]`;
`--tiny` runs a small shape anywhere (GPU interpret mode off a GPU: a smoke test, not a timing).
Prints one table; `--json F` also writes its rows.

Shapes (T tokens, top-K of E experts, hidden D, expert width I; M = T*K routed rows), routing
= top-K of random normal scores (near-uniform expert load), bf16 inputs. Ops and their peers:
  gate/up GEMM [M, D] x [E, D, 2I]: ours (`grouped_matmul`, impl="pallas"), ours in FP8
    (`pallas_kernels.fp8.fp8_grouped_gemm`: E4M3 operands, x quantised per 1 x 128 and w per
    128 x 128 inside the timed call, DeepSeek-V3's recipe; --check shows E4M3's rounding), `lax.ragged_dot`,
    tokamax's `ragged_dot` (mosaic, when importable on a GPU), and one dense XLA GEMM
    [M, D] x [D, 2I] of the same FLOPs. FLOPs 2*M*D*2I forward, 3x that forward+backward.
  permute (incl. the routing sort): ours (counting sort + Mosaic GPU row scatter) vs the
    reference (stable argsort + XLA gather). Bytes: read [T, D] + write [M, D]; fwd+bwd 2x.
  unpermute (weighted combine): ours (XLA gather + fp32 sum) vs an XLA scatter-add. Bytes:
    read [M, D] + write [T, D]; fwd+bwd 3x.
Forward+backward programs return the forward output too: XLA deletes a Mosaic GPU call whose
output is unused. Each time: median over `--reps` timings of `--iters` back-to-back calls after
a warm-up call. `--rounds R` times the impls of an op interleaved, R rounds of one timing each,
and adds each impl's time / the first impl's (ours) in the same round (median [min, max]):
the GPU's power cap makes rounds differ by up to ~6 %; pairing within a round removes most.
`--check`: relative L2 errors of the output and of the gradients of every differentiated
input (one random cotangent) vs the op's reference on the same inputs in fp32 (GEMM:
`grouped_matmul` impl="reference" or jnp.dot; permute, unpermute: impl="reference");
"exact" where equal. Where the fp32 expert weights would pass `--check-max-gb` (V3: 30 GB, and
the reference's fp32 weight gradient as much again), the check runs on the shape's first E' experts
(the fewest that keep K <= E' and fit, a divisor of E) with T * E' / E tokens: the same widths and
rows per expert as timed; the check column then names E'.
`--trace DIR`: a jax.profiler trace of 3 calls of each fwd+bwd program, its kernels printed
(benchmarks/_trace.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from pallas_kernels._hopper import on_gpu  # noqa: E402
from _timing import seconds  # noqa: E402
from pallas_kernels.fp8 import fp8_grouped_gemm  # noqa: E402
from pallas_kernels.moe import grouped_matmul, permute, unpermute  # noqa: E402

from _trace import kernel_summary, summary_markdown  # noqa: E402 (benchmarks/_trace.py)

SHAPES = {  # DeepSeek-V2-Lite and DeepSeek-V3 routed experts, one batch of T tokens
    "v2lite": dict(T=16384, K=6, E=64, D=2048, I=1408),
    "v3": dict(T=8192, K=8, E=256, D=7168, I=2048),
}
TINY = dict(T=128, K=2, E=4, D=128, I=128)


def inputs(s, seed=0):
    """x [T, D], topk ids [T, K], weights [T, K] f32, gate/up weights [E, D, 2I] (bf16)."""
    T, K, E, D, I = (s[c] for c in "TKEDI")
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (T, D), jnp.bfloat16)
    ids = jax.lax.top_k(jax.random.normal(ks[1], (T, E)), K)[1].astype(jnp.int32)
    p = jax.nn.softmax(jax.random.normal(ks[2], (T, K)), -1)
    w = (jax.random.normal(ks[3], (E, D, 2 * I)) * D ** -0.5).astype(jnp.bfloat16)
    return x, ids, p, w


def tokamax_ragged_dot():
    """tokamax's mosaic ragged_dot on a GPU, or None where it cannot run."""
    try:
        import tokamax
    except ImportError:
        return None
    if not on_gpu():
        return None
    return lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation="mosaic")


def scatter_add_unpermute(y, perm, p):
    """out[t] = sum_k p[t, k] y[slot(t, k)] as an fp32 scatter-add over sorted rows."""
    t, k = p.shape
    scale = jnp.take(p.reshape(-1), perm).astype(jnp.float32)
    out = jnp.zeros((t, y.shape[1]), jnp.float32).at[perm // k].add(y * scale[:, None])
    return out.astype(y.dtype)


def check_shape(s, max_bytes: float):
    """The shape --check runs for `s`: `s` when its fp32 expert weights [E, D, 2I] fit in
    max_bytes, else s with E' experts (the largest divisor of E, at least K, that fits; K if
    none does) and T * E' / E tokens, so that widths and rows per expert stay as timed."""
    T, K, E, D, I = (s[c] for c in "TKEDI")
    per_expert = D * 2 * I * 4
    if E * per_expert <= max_bytes:
        return s
    fits = [e for e in range(K, E) if E % e == 0 and (T * e) % E == 0 and e * per_expert <= max_bytes]
    e = max(fits) if fits else K
    return dict(s, E=e, T=T * e // E)


def cases(s):
    """[(op, work per forward, unit, fwd+bwd work / fwd work, impls)] of one shape; impls:
    [(name, fn, args, aux, ref)], the first is ours: fn(*args, *aux) is differentiated in
    args; aux (group sizes, routing) are arguments too, never constants XLA could fold; ref,
    the reference for --check, takes the same arguments with args in fp32."""
    T, K, E, D, I = (s[c] for c in "TKEDI")
    M = T * K
    x, ids, p, w = inputs(s)
    xs, gs, perm = jax.jit(lambda x, i: permute(x, i, num_experts=E, impl="reference"))(x, ids)
    ys = jax.random.normal(jax.random.key(1), (M, D), jnp.bfloat16)
    gmm = lambda impl: (lambda a, b, g: grouped_matmul(a, b, g, impl=impl))
    fp8 = lambda a, b, g: fp8_grouped_gemm(a, b, g)  # noqa: E731 (the Mosaic kernels on Hopper)
    gemm = [("ours", gmm("pallas"), (xs, w), (gs,), gmm("reference")),
            ("ours FP8 E4M3, quantisation included", fp8, (xs, w), (gs,), gmm("reference")),
            ("lax.ragged_dot", jax.lax.ragged_dot, (xs, w), (gs,), gmm("reference"))]
    tok = tokamax_ragged_dot()
    if tok is not None:
        gemm.append(("tokamax mosaic", tok, (xs, w), (gs,), gmm("reference")))
    gemm.append(("dense XLA, same FLOPs", jnp.dot, (xs, w[0]), (), jnp.dot))
    prm = lambda impl: (lambda a, i: permute(a, i, num_experts=E, impl=impl)[0])
    unp = lambda impl: (lambda y, q, pr: unpermute(y, pr, q, impl=impl))
    nbytes = (T * D + M * D) * 2
    return [("gate/up GEMM", 2 * M * D * 2 * I, "TFLOP/s", 3, gemm),
            ("permute", nbytes, "GB/s", 2, [
                ("ours", prm("pallas"), (x,), (ids,), prm("reference")),
                ("argsort + XLA gather", prm("reference"), (x,), (ids,), prm("reference"))]),
            ("unpermute", nbytes, "GB/s", 3, [
                ("ours", unp("pallas"), (ys, p), (perm,), unp("reference")),
                ("XLA scatter-add", lambda y, q, pr: scatter_add_unpermute(y, pr, q), (ys, p),
                 (perm,), unp("reference"))])]


def programs(fn, args, aux):
    """Jitted forward and forward+backward (output and VJP for one fixed random cotangent,
    an argument too) of fn(*args, *aux), each called as prog(*args, *aux)."""
    n = len(args)
    fwd = jax.jit(fn)
    out = jax.eval_shape(fn, *args, *aux)
    ct = jax.random.normal(jax.random.key(2), out.shape, jnp.float32).astype(out.dtype)

    @jax.jit
    def fb(ct, *a):
        o, vjp = jax.vjp(lambda *d: fn(*d, *a[n:]), *a[:n])
        return o, vjp(ct)
    return fwd, lambda *a: fb(ct, *a)


def errors(fb, args, aux, ref):
    """Relative L2 errors of a fwd+bwd program's output and gradients vs ref's on the same
    inputs in fp32 ("highest" matmul precision); "exact" where equal."""
    got = jax.tree.leaves(fb(*args, *aux))
    args32 = tuple(a.astype(jnp.float32) for a in args)
    with jax.default_matmul_precision("highest"):
        want = jax.tree.leaves(programs(ref, args32, aux)[1](*args32, *aux))
    errs = []
    for a, b in zip(got, want):
        a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
        errs.append(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)))
    fmt = ["exact" if e == 0 else "%.1e" % e for e in errs]
    return "out %s, grads %s" % (fmt[0], " ".join(fmt[1:]))


def trace(trace_dir, tag, prog, args, calls=3):
    """A jax.profiler trace of `calls` calls of prog; prints its kernels per call."""
    d = os.path.join(trace_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", tag))
    jax.block_until_ready(prog(*args))
    jax.profiler.start_trace(d)
    for _ in range(calls):
        jax.block_until_ready(prog(*args))
    jax.profiler.stop_trace()
    print(f"\ntrace {d} ({calls} calls of the fwd+bwd program):\n"
          + summary_markdown(kernel_summary(d), calls), flush=True)


def time_op(progs, rounds, iters, reps):
    """Seconds per call [(fwd times, fwd+bwd times)] per prog: one median of `reps` timings,
    or with rounds > 1 one timing per round, the progs interleaved within each round."""
    ts = [([], []) for _ in progs]
    for _ in range(max(rounds, 1)):
        for (_, fwd, fb, args, _), (tf, tfb) in zip(progs, ts):
            tf.append(seconds(fwd, args, iters, reps if rounds <= 1 else 1))
            tfb.append(seconds(fb, args, iters, reps if rounds <= 1 else 1))
    return ts


def ratios(times, base):
    """(median, min, max) over rounds of times[i] / base[i] (same-round pairs)."""
    r = [t / b for t, b in zip(times, base)]
    return statistics.median(r), min(r), max(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--tiny", action="store_true", help="one small shape (interpret off a GPU)")
    ap.add_argument("--check", action="store_true", help="errors vs an fp32 reference")
    ap.add_argument("--check-max-gb", type=float, default=4.0,
                    help="fp32 expert weights above this: --check on fewer experts (see above)")
    ap.add_argument("--iters", type=int, default=5, help="back-to-back calls per timing")
    ap.add_argument("--reps", type=int, default=5, help="timings per cell (median reported)")
    ap.add_argument("--rounds", type=int, default=0, help="interleave an op's impls: R rounds")
    ap.add_argument("--trace", default="", metavar="DIR", help="trace each fwd+bwd program")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = {"tiny": TINY} if a.tiny else {n: SHAPES[n] for n in a.shapes.split(",")}
    iters, reps = (1, 1) if a.tiny else (a.iters, a.reps)
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for sname, s in shapes.items():
        cs = check_shape(s, a.check_max_gb * 1e9) if a.check else s
        checks = {} if cs is s else {(c[0], i[0]): i for c in cases(cs) for i in c[4]}
        for op, work, unit, fb_work, impls in cases(s):
            progs = []
            for iname, fn, args, aux, ref in impls:
                try:
                    fwd, fb = programs(fn, args, aux)
                    jax.block_until_ready(fwd(*args, *aux))  # forward first (interpret mode)
                    jax.block_until_ready(fb(*args, *aux))
                    err = ""
                    if a.check and (op, iname) in checks:  # the same op on the check shape
                        _, cfn, cargs, caux, cref = checks[op, iname]
                        err = errors(programs(cfn, cargs, caux)[1], cargs, caux, cref) + \
                            f" ({cs['E']} of {s['E']} experts)"
                    elif a.check:
                        err = errors(fb, args, aux, ref)
                    progs.append((iname, fwd, fb, args + aux, err))
                    if a.trace:
                        trace(a.trace, f"{sname}_{op}_{iname}", fb, args + aux)
                except Exception as e:  # noqa: BLE001 - report and go on with the others
                    rows.append([sname, op, iname] + [float("nan")] * 4 + ["", "",
                                f"FAILED {type(e).__name__}: {str(e)[:80]}"])
                    print(rows[-1], flush=True)
            ts = time_op(progs, a.rounds, iters, reps)
            scale = 1e12 if unit == "TFLOP/s" else 1e9
            for (iname, _, _, _, err), (tf, tfb) in zip(progs, ts):
                mf, mfb = statistics.median(tf), statistics.median(tfb)
                vs = ["%.3f [%.3f, %.3f]" % ratios(x, y) if a.rounds > 1 else ""
                      for x, y in ((tf, ts[0][0]), (tfb, ts[0][1]))]
                rows.append([sname, op, iname, mf * 1e3, mfb * 1e3, work / mf / scale,
                             fb_work * work / mfb / scale, *vs, err])
                print(rows[-1], flush=True)
    print("\n| shape | op | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s or GB/s | fwd+bwd TFLOP/s or"
          " GB/s | fwd / ours, paired | fwd+bwd / ours, paired | check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s | %s | %.3f | %.3f | %.0f | %.0f | %s | %s | %s |" % tuple(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
