"""MoE expert-layer benchmark (GPU): ours vs jax.lax.ragged_dot, tokamax mosaic, dense GEMM.

Usage: python benchmarks/moe.py [--shapes v2lite,v3] [--sweep] [--json PATH] [--permute-only]
  [--permute-sweep] [--permute] [--sort-timing] [--only-ours]
  [--configs n-aligned,m-aligned,v1,m-fixed]
  [--swiglu-shapes v2lite] [--fb-only] [--hlo-dir DIR] [--quick]
  --permute: permute section first; --sort-timing: routing sorts' device time (chained);
  --configs: gmm forward configs timed side by side; --swiglu-shapes: where the fused
  gate/up+SwiGLU kernel and the XLA SwiGLU passes are timed; --fb-only: only the gate/up GEMM
  fwd+bwd under both transposed-GEMM (dx) configs; --hlo-dir: optimized HLO of the layer
  fwd+bwd programs. --permute-sweep [--deadline S] [--profile-dir DIR]: only the permute
  sweep (row kernels of SWEEP_ROWS, `api.permute` under the PermuteConfigs of SWEEP_SORTS, each
  checked bitwise; the sorts' device time; with DIR, a trace and the kernels of one call);
  --ptx-summary DIR: instruction counts of PTX dumped by MOSAIC_GPU_DUMP_PTX=1
  MOSAIC_GPU_DUMP_TO=DIR. Commands and results: benchmarks/RESULTS.md, "MoE".

Per shape (T tokens, top-K of E experts, hidden D, expert width I; M = T*K routed rows):
  gemm  : the gate/up grouped GEMM alone, [M, D] x [E, D, 2I]            (2*M*D*2I FLOPs fwd)
  layer : gate/up GEMM -> SwiGLU -> down GEMM [M, I] x [E, I, D]         (6*M*D*I FLOPs fwd)
  fwd+bwd counts 3x the forward FLOPs (dx and dw GEMMs). "dense" is one XLA GEMM of the same
  FLOPs. Permute/unpermute GB/s count the fewest bytes: permute reads [T, D] and writes
  [M, D]; unpermute reads [M, D] and writes [T, D] (bf16).
fwd+bwd programs return the forward output as well as the gradients: a Mosaic GPU custom call
has no side effects, so XLA deletes one whose output is unused (runs on 2026-11-29 before this
fix timed the backward alone).
Routing: top-K of random normal scores (near-uniform expert load). Timing: wall clock
around jitted calls after a warm-up, median of 5 batches of 5 calls, synchronised.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import api, dispatch, mosaic_gpu
from pallas_kernels.moe.reference import grouped_matmul_reference, grouped_matmul_transposed_reference

from _trace import device_events  # benchmarks/_trace.py (this script's folder is on sys.path)

SHAPES = {"v2lite": dict(T=16384, K=6, E=64, D=2048, I=1408),
          "v3": dict(T=8192, K=8, E=256, D=7168, I=2048),
          "tiny": dict(T=128, K=2, E=4, D=128, I=128)}  # CPU smoke test (interpret mode)


T0 = time.perf_counter()
REPS = (5, 5)  # (batches, calls per batch); --quick: (1, 1)
CONFIG_CHOICES = {  # --configs: gmm forward variants timed side by side at the gate/up shape
    "n-aligned": mosaic_gpu.TileConfig(),  # v3 default: columns split between warpgroups
    "m-aligned": mosaic_gpu.TileConfig(wg_split="m"),  # rows split, half-tile skipping
    "v1": mosaic_gpu.TileConfig(wg_split="n", aligned=False),  # v1/v2 kernel
    "m-fixed": mosaic_gpu.TileConfig(aligned=False),
}
CONFIGS = []
FB_ONLY = False  # --fb-only: only the gate/up GEMM fwd+bwd under both dx configs
HLO_DIR = None  # --hlo-dir: write the optimized HLO of the layer fwd+bwd programs there
CHAIN = 10  # sorts per program in the routing-sort device timing
SWIGLU_SHAPES = ("v2lite", "tiny")  # --swiglu-shapes: where the fused gate/up+SwiGLU is timed
ONLY_OURS = False


def bench(fn, *args, reps=None, inner=None):
    reps, inner = reps or REPS[0], inner or REPS[1]
    out = jax.block_until_ready(fn(*args))
    del out
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def rel(a, b):
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def tokamax_ragged_dot():
    try:
        import tokamax
    except Exception as err:  # noqa: BLE001
        print("tokamax unavailable:", repr(err)[:200])
        return None
    return lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation="mosaic")


def make_inputs(s, key):
    T, K, E, D, I = (s[k] for k in "TKEDI")
    ks = jax.random.split(key, 6)
    x = jax.random.normal(ks[0], (T, D), jnp.bfloat16)
    ids = jax.lax.top_k(jax.random.normal(ks[1], (T, E)), K)[1].astype(jnp.int32)
    p = jax.nn.softmax(jax.random.normal(ks[2], (T, K)), -1)
    w_gu = (jax.random.normal(ks[3], (E, D, 2 * I), jnp.bfloat16) * (D ** -0.5)).astype(jnp.bfloat16)
    w_dn = (jax.random.normal(ks[4], (E, I, D), jnp.bfloat16) * (I ** -0.5)).astype(jnp.bfloat16)
    return x, ids, p, w_gu, w_dn


def swiglu(h):
    i = h.shape[-1] // 2
    return (jax.nn.silu(h[:, :i].astype(jnp.float32)) * h[:, i:]).astype(h.dtype)


def run_shape(name, s, rows, sweep, tok):
    T, K, E, D, I = (s[k] for k in "TKEDI")
    M = T * K
    x, ids, p, w_gu, w_dn = make_inputs(s, jax.random.key(0))
    xs, gs, perm = jax.jit(lambda x, i: api.permute(x, i, num_experts=E, impl="reference"))(x, ids)
    jax.block_until_ready(xs)
    print(f"== {name}: M={M} D={D} I={I} E={E}; group sizes min {int(gs.min())} max {int(gs.max())}",
          flush=True)
    gemm_flops = 2 * M * D * 2 * I
    layer_flops = 6 * M * D * I
    dy = jax.random.normal(jax.random.key(7), (M, 2 * I), jnp.bfloat16)
    w_il = (jax.jit(mosaic_gpu.interleave_gate_up)(w_gu)  # the fused kernel's weight layout
            if name in SWIGLU_SHAPES else None)
    dya = jax.random.normal(jax.random.key(6), (M, I), jnp.bfloat16)

    def add(op, impl, pas, sec, flops=None, nbytes=None, note=""):
        r = dict(shape=name, op=op, impl=impl, pass_=pas, ms=sec * 1e3, note=note,
                 t=round(time.perf_counter() - T0, 1))
        if flops:
            r["tflops"] = flops / sec / 1e12
        if nbytes:
            r["gbps"] = nbytes / sec / 1e9
        rows.append(r)
        print(json.dumps(r), flush=True)

    def attempt(label, f):
        if ONLY_OURS and ("dense" in label or "permute" in label):
            return
        try:
            f()
        except Exception as err:  # noqa: BLE001
            msg = repr(err).splitlines()[0][:300]
            print(f"[{name}] {label} FAILED: {msg}", flush=True)
            rows.append(dict(shape=name, op=label, impl="-", pass_="-", ms=float("nan"),
                             note="FAILED " + msg[:120]))

    # --- correctness of our kernels at this shape (fwd, dx, dw vs fp32 reference)
    def check_swiglu():
        act = jax.jit(lambda a, b, g: mosaic_gpu.gmm(a, b, g, epilogue="swiglu"))(xs, w_il, gs)
        gate, up = mosaic_gpu.deinterleave_gate_up(jax.jit(lambda a, b, g: grouped_matmul_reference(
            a, b, g, preferred_element_type=jnp.float32))(xs, w_il, gs))
        e_sw = rel(act, jax.nn.silu(gate) * up)
        del act, gate, up
        print(f"[{name}] fused gate/up+SwiGLU rel err vs fp32 reference: {e_sw:.2e}", flush=True)
        rows.append(dict(shape=name, op="check", impl="ours fused swiglu", pass_="-", ms=0.0,
                         note=f"rel err {e_sw:.1e}"))

    def check():
        out = jax.jit(lambda a, b, g: mosaic_gpu.gmm(a, b, g))(xs, w_gu, gs)
        ref = jax.jit(lambda a, b, g: grouped_matmul_reference(
            a, b, g, preferred_element_type=jnp.float32))(xs, w_gu, gs)
        e_fwd = rel(out, ref)
        if not e_fwd < 5e-3:
            raise ValueError(f"default gmm forward rel err {e_fwd:.2e} vs fp32 reference")
        e_dx = e_dw = float("nan")
        dx = jax.jit(lambda a, b, g: mosaic_gpu.gmm(a, b, g, transpose_rhs=True))(dy, w_gu, gs)
        dx_ref = jax.jit(lambda a, b, g: grouped_matmul_reference(
            a, jnp.swapaxes(b, 1, 2), g, preferred_element_type=jnp.float32))(dy, w_gu, gs)
        e_dx = rel(dx, dx_ref)
        del dx, dx_ref
        if name == "v3":  # the fp32 dw reference needs a 30 GB accumulator there; fwd, dx only
            print(f"[{name}] rel err vs fp32 reference: fwd {e_fwd:.2e} dx {e_dx:.2e}", flush=True)
            rows.append(dict(shape=name, op="check", impl="ours", pass_="-", ms=0.0,
                             note=f"rel err fwd {e_fwd:.1e} dx {e_dx:.1e}"))
            return
        dw = jax.jit(lambda a, b, g: mosaic_gpu.tgmm(a, b, g))(xs, dy, gs)
        dw_ref = jax.jit(lambda a, b, g: grouped_matmul_transposed_reference(
            a, b, g, preferred_element_type=jnp.float32))(xs, dy, gs)
        e_dw = rel(dw, dw_ref)
        print(f"[{name}] rel err vs fp32 reference: fwd {e_fwd:.2e} dx {e_dx:.2e} dw {e_dw:.2e}",
              flush=True)
        rows.append(dict(shape=name, op="check", impl="ours", pass_="-", ms=0.0,
                         note=f"rel err fwd {e_fwd:.1e} dx {e_dx:.1e} dw {e_dw:.1e}"))
        if tok is not None:
            tk = jax.jit(tok)(xs, w_gu, gs)
            print(f"[{name}] ours vs tokamax fwd rel diff {rel(out, tk):.2e}", flush=True)
    if FB_ONLY:  # gate/up GEMM and layer fwd+bwd only, for each transposed-GEMM config
        for label, tcfg in (("dx rows split", mosaic_gpu.TileConfig(wg_split="m")),
                            ("dx columns split", mosaic_gpu.TileConfig(wg_split="n"))):
            mosaic_gpu.TRANSPOSED_CONFIG = tcfg

            def fb1(label=label):
                def step(a, b, g, d):
                    out, vjp = jax.vjp(lambda a, b: api.grouped_matmul(a, b, g, impl="pallas"), a, b)
                    return out, vjp(d)
                add("gemm", f"ours, {label}", "fwd+bwd", bench(jax.jit(step), xs, w_gu, gs, dy),
                    3 * gemm_flops)
            attempt(f"fb {label}", fb1)
        return
    n_rows = len(rows)
    attempt("check", check)
    if any(str(r.get("note", "")).startswith("FAILED") for r in rows[n_rows:]):
        v1 = CONFIG_CHOICES["v1"]  # keep measuring with the v1 kernel if the default broke
        print(f"[{name}] default config failed its check; falling back to {v1}", flush=True)
        mosaic_gpu.DEFAULT_CONFIG = v1
        attempt("check (v1 fallback)", check)
    if name in SWIGLU_SHAPES:
        attempt("check swiglu", check_swiglu)

    for label, cfg in CONFIGS:
        attempt(f"config {label}", lambda cfg=cfg, label=label: add(
            "gemm", f"ours {label}", "fwd", bench(jax.jit(
                lambda a, b, g: mosaic_gpu.gmm(a, b, g, config=cfg)), xs, w_gu, gs), gemm_flops))

    if sweep:
        best = None
        for cfg in (mosaic_gpu.TileConfig(), mosaic_gpu.TileConfig(tile_n=64),
                    mosaic_gpu.TileConfig(tile_m=64), mosaic_gpu.TileConfig(max_concurrent_steps=2)):
            def one(cfg=cfg):
                nonlocal best
                f = jax.jit(lambda a, b, g: mosaic_gpu.gmm(a, b, g, config=cfg))
                sec = bench(f, xs, w_gu, gs)
                add("gemm", f"ours {cfg.tile_m}x{cfg.tile_n}x{cfg.tile_k}/{cfg.max_concurrent_steps}",
                    "fwd", sec, gemm_flops)
                if best is None or sec < best[0]:
                    best = (sec, cfg)
            attempt(f"sweep {cfg}", one)
        if best is not None:
            mosaic_gpu.DEFAULT_CONFIG = best[1]
            print(f"[{name}] using {best[1]}", flush=True)

    # --- the gate/up grouped GEMM alone
    impls = {"ours": lambda a, b, g: api.grouped_matmul(a, b, g, impl="pallas")}
    if tok is not None:
        impls["tokamax mosaic"] = tok
    if name == "v2lite" and not ONLY_OURS:
        impls["lax.ragged_dot"] = lambda a, b, g: jax.lax.ragged_dot(a, b, g)
    for iname, f in impls.items():
        attempt(f"gemm fwd {iname}", lambda f=f, iname=iname: add(
            "gemm", iname, "fwd", bench(jax.jit(f), xs, w_gu, gs), gemm_flops))

        def fb(f=f, iname=iname):
            def step(a, b, g, d):  # return out too: XLA drops an unused kernel call
                out, vjp = jax.vjp(lambda a, b: f(a, b, g), a, b)
                return out, vjp(d)
            add("gemm", iname, "fwd+bwd", bench(jax.jit(step), xs, w_gu, gs, dy), 3 * gemm_flops)
        if iname != "lax.ragged_dot" or "--try-ragged-bwd" in sys.argv:
            attempt(f"gemm fwd+bwd {iname}", fb)
    fused = lambda a, b, g: api.gate_up_swiglu(a, b, g, impl="pallas")
    unfused = lambda a, b, g: swiglu(api.grouped_matmul(a, b, g, impl="pallas"))
    sw_cases = (("ours fused gate/up+SwiGLU", fused, w_il),
                ("ours gate/up GEMM then XLA SwiGLU", unfused, w_gu))
    for iname, f, wts in (sw_cases if name in SWIGLU_SHAPES else ()):
        attempt(f"swiglu fwd {iname}", lambda f=f, iname=iname, wts=wts: add(
            "gemm+swiglu", iname, "fwd", bench(jax.jit(f), xs, wts, gs), gemm_flops))

        def sfb(f=f, iname=iname, wts=wts):
            def step(a, b, g, d):
                out, vjp = jax.vjp(lambda a, b: f(a, b, g), a, b)
                return out, vjp(d)
            add("gemm+swiglu", iname, "fwd+bwd", bench(jax.jit(step), xs, wts, gs, dya),
                3 * gemm_flops)
        attempt(f"swiglu fwd+bwd {iname}", sfb)
    if name in SWIGLU_SHAPES:  # the XLA SwiGLU passes alone (bytes: fwd 3*M*I, bwd 5*M*I bf16)
        h2 = jax.random.normal(jax.random.key(10), (M, 2 * I), jnp.bfloat16)

        def sw_fb(h, d):
            out, vjp = jax.vjp(swiglu, h)
            return out, vjp(d)
        for iname, f, args, nb in (
                ("XLA SwiGLU on [M,2I] gate|up", swiglu, (h2,), 3 * M * I * 2),
                ("XLA SwiGLU, autodiff bwd (+fwd)", sw_fb, (h2, dya), 8 * M * I * 2),
                ("XLA SwiGLU bwd, interleaved where-form (fused path)",
                 api.swiglu_backward_interleaved, (h2, dya), 5 * M * I * 2)):
            attempt(f"swiglu alone {iname}", lambda f=f, iname=iname, args=args, nb=nb: add(
                "swiglu alone", iname,
                "fwd+bwd" if "+fwd" in iname else ("bwd" if "bwd" in iname else "fwd"),
                bench(jax.jit(f), *args), nbytes=nb))
        del h2
    a_d = jax.random.normal(jax.random.key(3), (M, D), jnp.bfloat16)
    b_d = jax.random.normal(jax.random.key(4), (D, 2 * I), jnp.bfloat16)
    attempt("gemm dense", lambda: add("gemm", "dense XLA", "fwd",
                                      bench(jax.jit(jnp.dot), a_d, b_d), gemm_flops))

    # --- the expert layer: gate/up -> SwiGLU -> down
    def ours_layer(a, wg, wd, g):
        h = api.grouped_matmul(a, wg, g, impl="pallas")
        return api.grouped_matmul(swiglu(h), wd, g, impl="pallas")
    def ours_fused_layer(a, wg, wd, g):
        return api.grouped_matmul(api.gate_up_swiglu(a, wg, g, impl="pallas"), wd, g,
                                  impl="pallas")
    lay = {"ours": ours_layer}
    if name in SWIGLU_SHAPES:
        lay["ours fused SwiGLU"] = ours_fused_layer
    if tok is not None:
        lay["tokamax mosaic"] = lambda a, wg, wd, g: tok(swiglu(tok(a, wg, g)), wd, g)
    dyl = jax.random.normal(jax.random.key(8), (M, D), jnp.bfloat16)
    for iname, f in lay.items():  # weights are arguments, never captured constants
        wts = w_il if "fused" in iname else w_gu
        attempt(f"layer fwd {iname}", lambda f=f, iname=iname, wts=wts: add(
            "layer", iname, "fwd", bench(jax.jit(f), xs, wts, w_dn, gs), layer_flops))

        def lfb(f=f, iname=iname, wts=wts):
            def step(a, wg, wd, g, d):
                out, vjp = jax.vjp(lambda a, wg, wd: f(a, wg, wd, g), a, wg, wd)
                return out, vjp(d)  # return out too: XLA drops an unused kernel call
            add("layer", iname, "fwd+bwd", bench(jax.jit(step), xs, wts, w_dn, gs, dyl),
                3 * layer_flops)
            if HLO_DIR and name in SWIGLU_SHAPES:  # optimized HLO: which XLA kernels run
                txt = jax.jit(step).lower(xs, wts, w_dn, gs, dyl).compile().as_text()
                fn = "".join(c if c.isalnum() else "_" for c in f"{name}_{iname}") + ".hlo.txt"
                with open(f"{HLO_DIR}/{fn}", "w") as fh:
                    fh.write(txt)
        attempt(f"layer fwd+bwd {iname}", lfb)

    def dense_layer(a, b1, b2):
        return jnp.dot(swiglu(jnp.dot(a, b1)), b2)
    b_d2 = jax.random.normal(jax.random.key(5), (I, D), jnp.bfloat16)
    attempt("layer dense", lambda: add("layer", "dense XLA", "fwd",
                                       bench(jax.jit(dense_layer), a_d, b_d, b_d2), layer_flops))

    # --- permute / unpermute bandwidth
    pb = (T * D + M * D) * 2
    attempt("permute", lambda: add("permute", "impl=auto", "fwd", bench(jax.jit(
        lambda x, i: api.permute(x, i, num_experts=E)[0]), x, ids), nbytes=pb,
        note="incl. routing sort"))
    attempt("permute rows", lambda: add("permute", "XLA gather (perm given)", "fwd", bench(jax.jit(
        lambda x, pr: jnp.take(x, pr // K, axis=0)), x, perm), nbytes=pb))
    ys = jax.random.normal(jax.random.key(9), (M, D), jnp.bfloat16)
    attempt("unpermute", lambda: add("unpermute", "XLA gather+fp32 sum", "fwd", bench(jax.jit(
        lambda y, pr, w: api.unpermute(y, pr, w)), ys, perm, p), nbytes=pb))

    def unp_fb(y, pr, w, d):
        out, vjp = jax.vjp(lambda y, w: api.unpermute(y, pr, w), y, w)
        return out, vjp(d)
    attempt("unpermute fwd+bwd", lambda: add("unpermute", "XLA", "fwd+bwd", bench(jax.jit(unp_fb), ys, perm, p, x),
                                             nbytes=3 * pb, note="bytes: 3x fwd"))
    del x, ids, p, w_gu, w_dn, xs, dy, a_d, b_d, dyl, w_il, dya


def run_permute(name, s, rows):
    """permute: exactness of impl="pallas" vs "reference" (values, perm, group sizes, dx) and
    GB/s of each piece. Bytes: forward reads [T, D] + writes [M, D]; backward reads [M, D] +
    writes [T, D] (bf16); the sorts alone are reported in ms."""
    T, K, E, D = (s[k] for k in "TKED")
    M = T * K
    x, ids, _, _, _ = make_inputs(dict(s, I=128), jax.random.key(0))
    g = jax.random.normal(jax.random.key(9), (M, D), jnp.bfloat16)
    pb = (T * D + M * D) * 2

    def add(op, impl, pas, sec, nbytes=None, note=""):
        r = dict(shape=name, op=op, impl=impl, pass_=pas, ms=sec * 1e3, note=note)
        if nbytes:
            r["gbps"] = nbytes / sec / 1e9
        rows.append(r)
        print(json.dumps(r), flush=True)

    def both(impl):
        def f(x, i, g):
            def fwd(x):
                xs, gs, perm = api.permute(x, i, num_experts=E, impl=impl)
                return xs, (gs, perm)
            xs, vjp, (gs, perm) = jax.vjp(fwd, x, has_aux=True)
            return xs, gs, perm, vjp(g)[0]
        return jax.jit(f)

    def check():
        outs = {impl: jax.block_until_ready(both(impl)(x, ids, g)) for impl in ("pallas",
                                                                               "reference")}
        same = [bool(jnp.array_equal(a, b)) for a, b in zip(outs["pallas"], outs["reference"])]
        rag = 1000  # ragged T: 1000 tokens, last CTA block shifted
        o1 = jax.jit(lambda x, i: api.permute(x, i, num_experts=E, impl="pallas"))(x[:rag], ids[:rag])
        o2 = jax.jit(lambda x, i: api.permute(x, i, num_experts=E, impl="reference"))(x[:rag], ids[:rag])
        same_rag = all(bool(jnp.array_equal(a, b)) for a, b in zip(o1, o2))
        note = (f"pallas == reference bitwise: x_sorted {same[0]}, group_sizes {same[1]}, perm "
                f"{same[2]}, dx {same[3]}; ragged T={rag}: {same_rag}")
        print(f"[{name}] permute check: {note}", flush=True)
        rows.append(dict(shape=name, op="permute check", impl="pallas", pass_="-", ms=0.0,
                         note=note))
    try:
        check()
    except Exception as err:  # noqa: BLE001
        print(f"[{name}] permute check FAILED: {repr(err)[:400]}", flush=True)
        rows.append(dict(shape=name, op="permute check", impl="-", pass_="-", ms=float("nan"),
                         note="FAILED " + repr(err)[:120]))

    _, perm, dest = jax.jit(lambda i: dispatch.counting_sort_by_expert(i, E))(ids)
    cases = [
        ("permute", "pallas: counting sort + row-scatter kernel", "fwd", pb,
         lambda x, i: api.permute(x, i, num_experts=E, impl="pallas")[0], (x, ids)),
        ("permute", "reference: argsort + XLA gather", "fwd", pb,
         lambda x, i: api.permute(x, i, num_experts=E, impl="reference")[0], (x, ids)),
        ("permute rows (dest given)", "row-scatter kernel", "fwd", pb,
         dispatch.scatter_rows, (x, dest)),
        ("permute rows (perm given)", "XLA gather", "fwd", pb,
         lambda x, pr: jnp.take(x, pr // K, axis=0), (x, perm)),
        ("routing sort", "counting sort, compare (v3)", "fwd", None,
         lambda i: dispatch.counting_sort_by_expert(i, E)[1:], (ids,)),
        ("routing sort", "counting sort, compare, S=128", "fwd", None,
         lambda i: dispatch.counting_sort_by_expert(i, E, block=128)[1:], (ids,)),
        ("routing sort", "counting sort, one-hot matmul (v2)", "fwd", None,
         lambda i: dispatch.counting_sort_by_expert(i, E, method="matmul")[1:], (ids,)),
        ("routing sort", "stable argsort + bincount", "fwd", None,
         lambda i: api.sort_by_expert(i, E), (ids,)),
        ("permute bwd (dest given)", "XLA K-row gather + fp32 sum", "bwd", pb,
         dispatch.gather_back, (g, dest)),
        ("permute bwd (dest given)", "XLA take [T,K] index + fp32 sum", "bwd", pb,
         lambda g, d: jnp.take(g, d, axis=0).astype(jnp.float32).sum(1).astype(g.dtype),
         (g, dest)),
        ("permute bwd (dest given)", "XLA K gathers, unrolled fp32 adds", "bwd", pb,
         lambda g, d: sum(jnp.take(g, d[:, j], axis=0).astype(jnp.float32)
                          for j in range(K)).astype(g.dtype), (g, dest)),
        ("permute bwd (perm given)", "reference: inverse perm + gather + sum", "bwd", pb,
         lambda g, pr: api._gather_rows_bwd(K, pr, g)[0], (g, perm)),
        ("permute", "pallas", "fwd+bwd", 2 * pb,
         lambda x, i, g: both("pallas")(x, i, g), (x, ids, g)),
        ("permute", "reference", "fwd+bwd", 2 * pb,
         lambda x, i, g: both("reference")(x, i, g), (x, ids, g)),
    ]
    r0 = dispatch.rows_per_cta(T, D, x.dtype)
    for r in sorted({1, 2, 4, 8, r0}):
        if r * D * 2 <= 64 * 1024:
            cases.append(("permute rows (dest given)", f"row-scatter kernel R={r}"
                          + (" (default)" if r == r0 else ""), "fwd", pb,
                          lambda x, d, r=r: dispatch.scatter_rows(x, d, rows=r), (x, dest)))
    for op, impl, pas, nbytes, f, args in cases:
        try:
            add(op, impl, pas, bench(jax.jit(f), *args), nbytes)
        except Exception as err:  # noqa: BLE001
            print(f"[{name}] {op} {impl} FAILED: {repr(err)[:300]}", flush=True)

    # In-program time: CHAIN permutes of different routings in one jitted program (as in a
    # training step, where the permute is not a program of its own); ms and GB/s per permute.
    chain = 8
    ids_n = jnp.stack([jnp.roll(ids, 97 * j, axis=0) for j in range(chain)])
    for impl in ("pallas", "reference"):
        def many(x, idn, impl=impl):
            return [api.permute(x, idn[j], num_experts=E, impl=impl)[0] for j in range(chain)]
        try:
            add("permute", f"{impl}, {chain} routings in one program", "fwd",
                bench(jax.jit(many), x, ids_n) / chain, pb, note="time per permute")
        except Exception as err:  # noqa: BLE001
            print(f"[{name}] permute chain {impl} FAILED: {repr(err)[:300]}", flush=True)


SWEEP_ROWS = {  # --permute-sweep: row-kernel variants per shape (label, scatter_rows kwargs).
    # The first GPU call (commit 8ba8ee3) swept tma R=1..4 (with and without the destination
    # reads hoisted), simt R=1..4 (+perm) and tma_pipe (R, nbuf, CTAs/SM); RESULTS.md, "v4".
    "v2lite": [("tma R=4", dict(method="tma", rows=4))],
    "v3": [("tma R=1", dict(method="tma", rows=1))],
    "tiny": [("tma R=4", dict(method="tma", rows=4)), ("simt R=2", dict(method="simt", rows=2)),
             ("simt R=2 +perm", dict(method="simt", rows=2, write_perm=True)),
             ("pipe R=2 nbuf=3 cps=2", dict(method="tma_pipe", rows=2, nbuf=3, ctas_per_sm=2))],
}
SWEEP_SORTS = [  # --permute-sweep: routing sorts (label, PermuteConfig fields). Earlier rounds
    # (commits 4e4ab0a, 0ecf9bd) ran S = 32..512 with each prefix and counts option and the
    # radix sort; RESULTS.md, "v4 permute".
    ("v3: counting S=256 cumsum", dict(sort="counting", sort_block=256, sort_prefix="cumsum",
                                       sort_counts="compare")),
    ("v4 default: counting S=sort_block_for(E) lean, scatter counts", {}),
]
SWEEP_DEADLINE = 420.0  # seconds since start: later optional parts are skipped
PROFILE_DIR = None  # --profile-dir: jax.profiler traces of the permute programs go here


def kernel_sequence(trace_dir, last=24):
    """The last `last` GPU kernels of a jax.profiler trace: (name, start us, duration us, gap us
    since the previous kernel ended), from the stream lines of the GPU plane (`_trace`)."""
    out, prev_end = [], None
    for start, dur, nm in device_events(trace_dir)[-last:]:
        out.append((nm[:60], start / 1e3, dur / 1e3, (start - prev_end) / 1e3 if prev_end else 0.0))
        prev_end = start + dur
    return out


def run_permute_sweep(name, s, rows, log=None):
    """v4 permute sweep (one GPU call): the row kernels of SWEEP_ROWS checked bitwise against the
    reference rows and timed (dest given); `api.permute` under `dispatch.DEFAULT_PERMUTE`
    candidates (the "tma" kernel with each sort of SWEEP_SORTS), each checked bitwise (x_sorted,
    group_sizes, perm; ragged T = 1000) and timed including the sort; the sorts' device time
    (chained); with --profile-dir, the kernel sequence and device time of one permute call of
    each candidate. Parts after --deadline seconds are skipped. GB/s: read [T, D] + write [M, D] bf16."""
    T, K, E, D = (s[k] for k in "TKED")
    M = T * K
    pb = (T * D + M * D) * 2
    kx, ki = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (T, D), jnp.bfloat16)
    ids = jax.lax.top_k(jax.random.normal(ki, (T, E)), K)[1].astype(jnp.int32)
    ref = jax.jit(lambda x, i: api.permute(x, i, num_experts=E, impl="reference"))(x, ids)
    ref_xs, ref_gs, ref_perm = jax.block_until_ready(ref)
    _, perm, dest = jax.jit(lambda i: dispatch.counting_sort_by_expert(i, E))(ids)
    print(f"[{name}] counting sort perm == argsort perm: {bool(jnp.array_equal(perm, ref_perm))}",
          flush=True)

    def add(op, impl, sec, nbytes=None, note="", **extra):
        r = dict(shape=name, op=op, impl=impl, pass_="fwd", ms=sec * 1e3, note=note,
                 t=round(time.perf_counter() - T0, 1))
        if nbytes:
            r["gbps"] = nbytes / sec / 1e9
        rows.append(r)
        r = dict(r, **extra)
        print(json.dumps(r), flush=True)
        if log:
            log.write(json.dumps(r) + "\n")
            log.flush()

    def timed(fn, *args):
        return bench(fn, *args, reps=5, inner=20)

    for label, kw in SWEEP_ROWS[name]:
        try:
            f = jax.jit(lambda x, d, kw=kw: dispatch.scatter_rows(x, d, **kw))
            out = jax.block_until_ready(f(x, dest))
            if kw.get("write_perm"):
                out, kperm = out
                exact = (bool(jnp.array_equal(out, ref_xs))
                         and bool(jnp.array_equal(kperm, ref_perm)))
            else:
                exact = bool(jnp.array_equal(out, ref_xs))
            del out
            add("rows (dest given)", label, timed(f, x, dest), pb, note=f"bitwise {exact}")
        except Exception as err:  # noqa: BLE001
            print(f"[{name}] {label} FAILED: {repr(err)[:300]}", flush=True)

    # api.permute (incl. sort) under candidate default configs
    cands = [(f"tma, {lab}", dispatch.PermuteConfig(**kw)) for lab, kw in SWEEP_SORTS]
    saved = dispatch.DEFAULT_PERMUTE
    rag = 1000
    ref_rag = jax.jit(lambda x, i: api.permute(x, i, num_experts=E, impl="reference"))(
        x[:rag], ids[:rag])
    api_times = {}
    for label, cfg in cands:
        if time.perf_counter() - T0 > SWEEP_DEADLINE:
            print(f"[{name}] deadline: skipping {label}", flush=True)
            continue
        dispatch.DEFAULT_PERMUTE = cfg
        try:
            f = jax.jit(lambda x, i: api.permute(x, i, num_experts=E, impl="pallas"))
            outs = jax.block_until_ready(f(x, ids))
            same = all(bool(jnp.array_equal(a, b))
                       for a, b in zip(outs, (ref_xs, ref_gs, ref_perm)))
            del outs
            o_rag = jax.jit(lambda x, i: api.permute(x, i, num_experts=E, impl="pallas"))(
                x[:rag], ids[:rag])
            same_rag = all(bool(jnp.array_equal(a, b)) for a, b in zip(o_rag, ref_rag))
            sec = timed(f, x, ids)
            add("permute incl. sort (api, impl=pallas)", label, sec, pb,
                note=f"bitwise {same}, ragged T={rag} {same_rag}", config=str(cfg))
            if same and same_rag:
                api_times[label] = (sec, cfg, f)
        except Exception as err:  # noqa: BLE001
            print(f"[{name}] permute {label} FAILED: {repr(err)[:300]}", flush=True)
    dispatch.DEFAULT_PERMUTE = saved

    # kernel sequence of one call of each candidate
    if PROFILE_DIR and api_times:
        import os
        os.makedirs(PROFILE_DIR, exist_ok=True)
        for n_c, label in enumerate(api_times):
            f = api_times[label][2]
            d = f"{PROFILE_DIR}/{name}_{n_c}"
            try:
                hlo = f.lower(x, ids).compile().as_text()
                with open(f"{PROFILE_DIR}/{name}_{n_c}_hlo.txt", "w") as fh:
                    fh.write(f"# {label}\n{hlo}")
                jax.block_until_ready(f(x, ids))
                jax.profiler.start_trace(d)
                for _ in range(3):
                    jax.block_until_ready(f(x, ids))
                jax.profiler.stop_trace()
                seq = kernel_sequence(d, last=30)
                print(f"[{name}] kernels of one permute call, {label}: (name, duration us, gap us)",
                      flush=True)
                if not seq:
                    continue
                last = max([i for i, e in enumerate(seq) if e[3] > 50.0] or [0])
                for nm, _, dur, gap in seq[last:]:
                    print(f"    {dur:7.1f} {gap:6.1f}  {nm}", flush=True)
                call = seq[last:]
                print(f"[{name}] device time of one permute call, {label}: "
                      f"{sum(e[2] for e in call):.1f} us in {len(call)} kernels, span "
                      f"{call[-1][1] + call[-1][2] - call[0][1]:.1f} us", flush=True)
                if log:
                    log.write(json.dumps(dict(shape=name, profile=label, kernels=seq)) + "\n")
            except Exception as err:  # noqa: BLE001
                print(f"[{name}] profile {label} FAILED: {repr(err)[:300]}", flush=True)

    # routing sorts, device time (CHAIN dependent sorts per program)
    chained = functools.partial(chained_sorts, num_experts=E)
    for label, kw in SWEEP_SORTS:
        if time.perf_counter() - T0 > SWEEP_DEADLINE:
            break
        try:
            cfg = dispatch.PermuteConfig(**kw)
            sort = lambda i, cfg=cfg: dispatch.routing_sort(i, E, cfg)
            add("routing sort, device time", label, bench(chained(sort), ids) / CHAIN,
                note=f"{CHAIN} chained sorts per program")
        except Exception as err:  # noqa: BLE001
            print(f"[{name}] {label} FAILED: {repr(err)[:300]}", flush=True)


def chained_sorts(sort, num_experts):
    """jit of CHAIN dependent routing sorts in one program (sort j on ids + j, made to depend on
    sort j-1's output), so a sort's device time is not hidden by a jitted call's host dispatch."""
    def run(i):
        dep = jnp.int32(0)
        for j in range(CHAIN):
            out = sort((i + j + jnp.minimum(dep, 0)) % num_experts)
            dep = out[-1].reshape(-1)[0]
        return dep
    return jax.jit(run)


def run_sort_timing(name, s, rows):
    """Routing sorts alone, device time per sort (see the comment below)."""
    T, K, E, D = (s[k] for k in "TKED")
    _, ids, _, _, _ = make_inputs(dict(s, D=128, I=128), jax.random.key(0))

    def add(op, impl, pas, sec, note=""):
        r = dict(shape=name, op=op, impl=impl, pass_=pas, ms=sec * 1e3, note=note,
                 t=round(time.perf_counter() - T0, 1))
        rows.append(r)
        print(json.dumps(r), flush=True)

    # The sorts alone are shorter than a jitted call's host dispatch: time CHAIN dependent
    # sorts in one program (each on ids shifted by its index, made to depend on the previous
    # sort's output) and report the per-sort device time.
    chained = functools.partial(chained_sorts, num_experts=E)
    for impl, sort in (("counting sort, compare (v3)", lambda i: dispatch.counting_sort_by_expert(i, E)),
                       ("counting sort, one-hot matmul (v2)",
                        lambda i: dispatch.counting_sort_by_expert(i, E, method="matmul")),
                       ("stable argsort + bincount", lambda i: api.sort_by_expert(i, E))):
        try:
            add("routing sort, device time", impl, "fwd", bench(chained(sort), ids) / CHAIN,
                note=f"{CHAIN} chained sorts in one program")
        except Exception as err:  # noqa: BLE001
            print(f"[{name}] chained sort {impl} FAILED: {repr(err)[:300]}", flush=True)


PTX_PATTERNS = ("st.global.v4", "st.global.v2", "st.global.b16", "st.global.u16", "st.global.b32",
                "st.global.u32", "ld.global.v4", "ld.global.v2", "ld.global.nc.v4",
                "cp.async.bulk.global.shared", "cp.async.bulk.shared", "ld.global.b32")


def ptx_summary(folder):
    """--ptx-summary DIR: per dumped permute-kernel file, counts of store/load instructions
    (MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=DIR): are the row copies 16-byte vectors?"""
    import os
    for root, _, files in os.walk(folder):
        for fn in sorted(files):
            if "permute_rows" not in fn:
                continue
            txt = open(os.path.join(root, fn), errors="ignore").read()
            counts = {p: txt.count(p) for p in PTX_PATTERNS if txt.count(p)}
            print(fn, len(txt), counts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="v2lite,v3")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--try-ragged-bwd", action="store_true")
    ap.add_argument("--quick", action="store_true", help="one timed call (smoke test)")
    ap.add_argument("--only-ours", action="store_true", help="skip the peers and permute")
    ap.add_argument("--permute-only", action="store_true", help="only the permute section")
    ap.add_argument("--permute", action="store_true", help="also run the permute section first")
    ap.add_argument("--deadline", type=float, default=420.0,
                    help="--permute-sweep: seconds after which optional parts are skipped")
    ap.add_argument("--profile-dir", default=None,
                    help="--permute-sweep: trace the permute programs here, print their kernels")
    ap.add_argument("--ptx-summary", default=None, help="DIR: instruction counts of dumped PTX")
    ap.add_argument("--permute-sweep", action="store_true",
                    help="only the v4 permute sweep (row kernels, sorts, api configs)")
    ap.add_argument("--swiglu-shapes", default="v2lite,tiny")
    ap.add_argument("--hlo-dir", default=None)
    ap.add_argument("--fb-only", action="store_true")
    ap.add_argument("--sort-timing", action="store_true",
                    help="first: device time of the routing sorts (chained in one program)")
    ap.add_argument("--configs", default="", help="comma list of " + ",".join(CONFIG_CHOICES))
    args = ap.parse_args()
    if args.ptx_summary:
        return ptx_summary(args.ptx_summary)
    global SWEEP_DEADLINE, PROFILE_DIR
    SWEEP_DEADLINE = args.deadline
    PROFILE_DIR = args.profile_dir
    global CONFIGS
    CONFIGS = [(c, CONFIG_CHOICES[c]) for c in args.configs.split(",") if c]
    global SWIGLU_SHAPES, HLO_DIR, FB_ONLY
    HLO_DIR = args.hlo_dir
    FB_ONLY = args.fb_only
    SWIGLU_SHAPES = tuple(args.swiglu_shapes.split(","))
    if args.quick:
        global REPS
        REPS = (1, 1)
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    global ONLY_OURS
    ONLY_OURS = args.only_ours
    tok = None if (args.only_ours or args.permute_only or args.permute_sweep) else tokamax_ragged_dot()
    rows = []
    if args.permute_sweep:
        log = open(args.json + ".log", "w") if args.json else None
        for name in args.shapes.split(","):
            try:
                run_permute_sweep(name, SHAPES[name], rows, log)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    shapes = [] if args.permute_sweep else args.shapes.split(",")
    if args.sort_timing:
        for name in shapes:
            run_sort_timing(name, SHAPES[name], rows)
    if args.permute_only or args.permute:  # cheap: all shapes first
        for name in shapes:
            try:
                run_permute(name, SHAPES[name], rows)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    for name in shapes:
        if args.permute_only:
            continue
        try:
            run_shape(name, SHAPES[name], rows, args.sweep and name == "v2lite", tok)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| shape | op | impl | pass | ms | TFLOP/s | GB/s | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
        gb = f"{r['gbps']:.0f}" if "gbps" in r else ""  # noqa: E501
        print(f"| {r['shape']} | {r['op']} | {r['impl']} | {r['pass_']} | {r['ms']:.3f} | {tf} | {gb} | {r['note']} |")


if __name__ == "__main__":
    main()
