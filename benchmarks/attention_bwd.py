"""Flash-attention backward on one Hopper GPU: the v1 two-kernel backward (`mosaic_gpu._backward`)
vs the fused v4 backward (`mosaic_gpu_bwd.backward`), alone and inside forward+backward, with
cuDNN as a peer, plus a compiled error check (vs v1 and vs an fp32 naive-softmax oracle).

Run on the GPU machine:
    python3 benchmarks/attention_bwd.py [--shapes 0,1] [--variants default,p_bf16] [--peers]
        [--hist .hist] [--out DIR] [--v1-variants blf,sdp1,...] [--split]
    python3 benchmarks/attention_bwd.py --summarize LOG    # ptxas/SASS digest of a dump log

With MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 in the environment (`--dump` sets them while
the backward kernels compile), Mosaic prints each kernel's ptxas report and SASS to
stdout as it compiles; this script prints an "@@@ label" line before
the first call of each implementation, and `--summarize` reduces such a log to, per kernel:
registers, stack/spill bytes, ptxas performance warnings, and counts of HGMMA, WARPGROUP.DEPBAR,
LDL/STL and other telling SASS opcodes. `--hist DIR` also compiles and times the v2 fused
kernels kept in history (DIR/v2a.py = `git show 9547247:pallas_kernels/flash_attention/
mosaic_gpu.py`, DIR/v2c.py = the same at 25ddb40); DIR/mg_head.py (a committed mosaic_gpu.py),
if there, computes the forward residuals for the backward-alone timings.

FLOPs: forward 2*B*N*T*S*(Dqk+Dv), halved for causal; backward 2.5x forward (forward+backward
3.5x). Timing: median over `reps` of the wall time of `iters` back-to-back calls after a warm-up.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.util
import json
import os
import re
import statistics
import sys
import time
import traceback

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention import VARIANTS, inputs  # noqa: E402  (shared with attention.py)

SHAPES = [  # (name, B, T, N, K, Dqk, Dv, causal)
    ("MLA B4 T4096 N16 192/128 causal", 4, 4096, 16, 16, 192, 128, True),
    ("B4 T4096 N16 128/128 causal", 4, 4096, 16, 16, 128, 128, True),
    ("MLA B1 T16384 N16 192/128 causal", 1, 16384, 16, 16, 192, 128, True),
]
SASS_OPS = ("HGMMA", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "LDL", "STL", "BAR.SYNC",
            "BAR.ARV", "SYNCS", "STSM", "UTMALDG", "UTMASTG", "UTMAREDG", "UBLKRED", "MUFU.EX2",
            "BRA")


def summarize(path):
    """Per-kernel digest of a log holding Mosaic's ptxas (-v) reports and SASS dumps."""
    text = open(path, errors="replace").read()
    label = "?"
    for seg in re.split(r"^(?=@@@ )", text, flags=re.M):
        if seg.startswith("@@@ "):
            label = seg.split("\n", 1)[0][4:].strip()
        parts = re.split(r"(?=ptxas info\s*: Compiling entry function)", seg)
        for part in parts[1:]:
            name = re.search(r"entry function '([^']+)'", part).group(1)
            keep = [ln.strip() for ln in part.splitlines()
                    if re.search(r"registers|spill|stack frame|Potential|C7\d\d\d|warning",
                                 ln, re.I) and len(ln) < 400]
            ops = collections.Counter()
            for ln in part.splitlines():
                m = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", ln)
                if m:
                    op = m.group(2)
                    for key in SASS_OPS:
                        if op.startswith(key):
                            ops[key] += 1
            print(f"== [{label}] {name[:60]}")
            for ln in dict.fromkeys(keep):
                print("   " + ln[:300])
            print("   SASS: " + ", ".join(f"{k} {ops[k]}" for k in SASS_OPS if ops[k]))


def _time(fn, args, iters, reps, warm=False):
    import jax
    if jax.devices()[0].platform != "gpu":
        # GPU interpret mode (smoke test): a second call of one executable hangs in jax 0.11.2
        # (seen for v1 and v3 alike), so time a single call (compile included), or none.
        if warm:
            return float("nan")
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - t0
    if not warm:
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)


def _one_kernel(mg, drop, **kw):
    """mg._backward with one of its two kernels (`drop`) replaced by zeros while tracing, to
    time the other kernel alone (plus the shared jnp preparation)."""
    import jax.numpy as jnp

    def fake(q, k, v, *args, o=None, **kwargs):
        if drop != "_dq_kernel_call":
            return jnp.zeros_like(k), jnp.zeros_like(v)
        if o is None:
            return jnp.zeros_like(q)
        # The dq kernel also returns delta [B, N, Tp] for the dk/dv kernel when it gets O.
        B, Tp, N, _ = q.shape
        return jnp.zeros_like(q), jnp.zeros((B, N, Tp), jnp.float32)

    def bw(*x):
        orig = getattr(mg, drop)
        setattr(mg, drop, fake)
        try:
            return mg._backward(*x, **kw)
        finally:
            setattr(mg, drop, orig)
    return bw


def _load_hist(hist):
    mods = {}
    for name in ("v2a", "v2c", "mg_head"):
        path = os.path.join(hist, name + ".py")
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location("hist_" + name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
            mods[name] = mod
    return mods


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0,1")
    ap.add_argument("--variants", default="default", help="fused (v4) configs: default, "
                    "stages1, regs232; timing ablations no_reduce, no_dq")
    ap.add_argument("--peers", action="store_true", help="also time cuDNN forward+backward")
    ap.add_argument("--no-v1", action="store_true")
    ap.add_argument("--v1-variants", default="", help="v1 backward with Config fields changed: "
                    "names from attention.py's VARIANTS (e.g. blf,r240,sdp,sdp1,dvdp)")
    ap.add_argument("--split", default="", help="comma list (v1 = the default config, or "
                    "--v1-variants names): time their dq and dk/dv kernels alone (the other "
                    "kernel replaced by zeros while tracing)")
    ap.add_argument("--no-fwdbwd", action="store_true", help="backward-alone timings only")
    ap.add_argument("--hist", default=None, help="folder with v2a.py / v2c.py (history)")
    ap.add_argument("--check", action="store_true", help="compiled error check vs the oracle")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="folder for results.json / table.md")
    ap.add_argument("--summarize", default=None, help="digest a ptxas/SASS dump log and exit")
    ap.add_argument("--dump", action="store_true",
                    help="set MOSAIC_GPU_DUMP_PTXAS/SASS while the backward kernels compile "
                    "(Mosaic reads them per kernel); stdout gets the reports")
    ap.add_argument("--tiny", action="store_true",
                    help="smoke test of this script: T=256, N=2, GPU interpret mode off the GPU")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return

    import jax
    import jax.numpy as jnp

    from pallas_kernels.flash_attention import mosaic_gpu as mg
    from pallas_kernels.flash_attention import mosaic_gpu_bwd as fb

    variants = {"default": fb.FusedConfig(), "stages1": fb.FusedConfig(stages=1),
                "regs232": fb.FusedConfig(regs=(232, 40)),
                "no_reduce": fb.FusedConfig(ablate="no_reduce"),
                "no_dq": fb.FusedConfig(ablate="no_dq")}
    hist = _load_hist(a.hist) if a.hist else {}
    ip = None
    if jax.devices()[0].platform != "gpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu
        ip = plgpu.InterpretGPUParams()
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    rows, lines = [], []
    rel = lambda x, y: float(jnp.linalg.norm((x.astype(jnp.float32) - y.astype(jnp.float32)))
                             / jnp.linalg.norm(y.astype(jnp.float32)))

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    first = int(a.shapes.split(",")[0])
    dump_env = ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS")
    for si in map(int, a.shapes.split(",")):
        name, B, T, N, K, Dqk, Dv, causal = SHAPES[si]
        if a.tiny:
            name, B, T, N, K = name + " [tiny]", 1, 256, 2, 1
        q, k, v, do = inputs(si, B, T, N, K, Dqk, Dv)
        flops = 2.0 * B * N * T * T * (Dqk + Dv) * (0.5 if causal else 1.0)
        cfg = mg.default_config(Dqk, Dv)
        scale = Dqk ** -0.5
        fwd_mod = hist.get("mg_head", mg)   # a committed forward, if given, for the residuals
        o, lse2 = jax.block_until_ready(jax.jit(lambda q, k, v: fwd_mod._attn_fwd_impl(
            q, k, v, None, (0, 0), scale=scale, causal=causal, cfg=cfg, interpret=ip))(q, k, v))
        bw_impls = {}
        if not a.no_v1:
            bw_impls["v1"] = lambda *x: mg._backward(*x, scale=scale, causal=causal, cfg=cfg,
                                                     interpret=ip)
        for vname, mod in hist.items():
            if vname == "mg_head" or si != first:   # history kernels: first shape only
                continue
            hcfg = mod.default_config(Dqk, Dv)
            bw_impls[vname] = (lambda *x, mod=mod, hcfg=hcfg: mod._backward(
                *x, scale=scale, causal=causal, cfg=hcfg, interpret=ip))
        v1_names = ["v1"] if not a.no_v1 else []
        for vn in filter(None, a.v1_variants.split(",")):
            vcfg = dataclasses.replace(cfg, **VARIANTS[vn])
            bw_impls["v1 " + vn] = (lambda *x, vcfg=vcfg: mg._backward(
                *x, scale=scale, causal=causal, cfg=vcfg, interpret=ip))
            v1_names.append(vn)
        if a.split:
            for vn in [x for x in v1_names if x in a.split.split(",")]:
                vcfg = cfg if vn == "v1" else dataclasses.replace(cfg, **VARIANTS[vn])
                for drop, keep in (("_dkv_kernel_call", "dq"), ("_dq_kernel_call", "dkv")):
                    label = "v1" if vn == "v1" else "v1 " + vn
                    bw_impls[f"{label} [{keep} kernel only]"] = _one_kernel(
                        mg, drop, scale=scale, causal=causal, cfg=vcfg, interpret=ip)
        for vname in filter(None, a.variants.split(",")):
            if not fb.fits(Dqk, Dv, variants[vname]):   # would run the v1 fallback: skip
                log(f"RESULT {name} v4 {vname}: does not fit shared memory, skipped")
                continue
            bw_impls["v4 " + vname] = (lambda *x, fc=variants[vname]: fb.backward(
                *x, scale=scale, causal=causal, cfg=cfg, interpret=ip, fcfg=fc))
        grads = {}
        for iname, bw in bw_impls.items():
            log(f"@@@ {name} | {iname} backward")
            try:
                f = jax.jit(lambda q, k, v, o, lse2, do, bw=bw: bw(q, k, v, None, (0, 0), o, lse2,
                                                                    do, None))
                args = (q, k, v, o, lse2, do)
                if a.dump:
                    os.environ.update({e: "1" for e in dump_env})
                try:
                    grads[iname] = jax.block_until_ready(f(*args))
                finally:
                    for e in dump_env:
                        os.environ.pop(e, None)
                t = _time(f, args, a.iters, a.reps, warm=True)
                err = ""
                if "v1" in grads and iname != "v1" and "only]" not in iname:
                    err = "vs v1: " + " ".join(f"{n_} {rel(x, y):.1e}" for n_, x, y in
                                               zip(("dq", "dk", "dv"), grads[iname], grads["v1"]))
                rows.append(dict(shape=name, impl=iname, bwd_ms=t * 1e3,
                                 bwd_tflops=2.5 * flops / t / 1e12, err=err))
                log(f"RESULT {rows[-1]}")
            except Exception as e:  # noqa: BLE001 - report and go on with the rest
                traceback.print_exc()
                log(f"RESULT {name} {iname} FAILED {type(e).__name__}: {str(e)[:300]}")
        # forward + backward through the public-style entry points
        fb_impls = {}
        if not a.no_v1:
            fb_impls["v1"] = lambda q, k, v: mg.flash_attention_mosaic(q, k, v, causal=causal,
                                                                     interpret=ip)[0]
        vname0 = a.variants.split(",")[0]
        if vname0:
            fb_impls["v4 " + vname0] = lambda q, k, v: fb.flash_attention_fused(
                q, k, v, causal=causal, fcfg=variants[vname0], interpret=ip)[0]
        for vn in filter(None, a.v1_variants.split(",")):
            vcfg = dataclasses.replace(cfg, **VARIANTS[vn])
            fb_impls["v1 " + vn] = (lambda q, k, v, vcfg=vcfg: mg.flash_attention_mosaic(
                q, k, v, causal=causal, cfg=vcfg, interpret=ip)[0])
        if a.peers:
            if Dqk == Dv:
                fb_impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=causal, implementation="cudnn")
            else:
                from jax._src.cudnn.fused_attention_stablehlo import MaskType
                from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention
                fb_impls["cudnn"] = lambda q, k, v: dot_product_attention(
                    q, k, v, scale=scale, mask_type=MaskType.CAUSAL if causal else
                    MaskType.NO_MASK, qkv_layout="BTNH")
        for iname, impl in ({} if a.no_fwdbwd else fb_impls).items():
            log(f"@@@ {name} | {iname} fwd+bwd")
            try:
                fwd = jax.jit(impl)

                def fwdbwd(q, k, v, impl=impl):
                    out, vjp = jax.vjp(impl, q, k, v)
                    return out, vjp(do)
                fwdbwd = jax.jit(fwdbwd)
                tf = _time(fwd, (q, k, v), a.iters, a.reps)
                tfb = _time(fwdbwd, (q, k, v), a.iters, a.reps)
                rows.append(dict(shape=name, impl=iname + " (fwd+bwd)", fwd_ms=tf * 1e3,
                                 fwdbwd_ms=tfb * 1e3, fwd_tflops=flops / tf / 1e12,
                                 fwdbwd_tflops=3.5 * flops / tfb / 1e12))
                log(f"RESULT {rows[-1]}")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                log(f"RESULT {name} {iname} fwd+bwd FAILED {type(e).__name__}: {str(e)[:300]}")
        del grads

    if a.check:
        from pallas_kernels.flash_attention.reference import attention_naive
        # ragged, GQA 2:1, MLA, causal; and 128/128 non-causal with T != S
        checks = ((1, 1000, 1000, 4, 2, 192, 128, True), (1, 700, 1100, 4, 4, 128, 128, False))
        if a.tiny:
            checks = ((1, 200, 150, 2, 1, 192, 128, True),)
        for (B, T, S, N, K, Dqk, Dv, causal) in checks:
            log(f"@@@ check B{B} T{T} S{S} N{N} K{K} {Dqk}/{Dv} causal={causal}")
            try:
                ks = jax.random.split(jax.random.key(7), 4)
                q = jax.random.normal(ks[0], (B, T, N, Dqk), jnp.bfloat16)
                k = jax.random.normal(ks[1], (B, S, K, Dqk), jnp.bfloat16)
                v = jax.random.normal(ks[2], (B, S, K, Dv), jnp.bfloat16)
                do = jax.random.normal(ks[3], (B, T, N, Dv), jnp.float32)
                loss = lambda f: (lambda *x: (f(*x).astype(jnp.float32) * do).sum())
                gf = jax.block_until_ready(jax.jit(jax.grad(loss(lambda *x: fb.flash_attention_fused(
                    *x, causal=causal, interpret=ip)[0]), (0, 1, 2)))(q, k, v))
                g1 = jax.block_until_ready(jax.jit(jax.grad(loss(lambda *x: mg.flash_attention_mosaic(
                    *x, causal=causal, interpret=ip)[0]), (0, 1, 2)))(q, k, v))
                f32 = [x.astype(jnp.float32) for x in (q, k, v)]
                gr = jax.jit(jax.grad(loss(lambda *x: attention_naive(*x, causal=causal)[0]),
                                      (0, 1, 2)))(*f32)
                msg = " ".join(f"{n_} v4 {rel(x, z):.1e} v1 {rel(y, z):.1e}" for n_, x, y, z in
                               zip(("dq", "dk", "dv"), gf, g1, gr))
                log(f"RESULT check {Dqk}/{Dv} causal={causal} T{T} S{S} (rel L2 vs fp32 oracle): {msg}")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                log(f"RESULT check FAILED {type(e).__name__}: {str(e)[:300]}")

    table = ["| shape | impl | bwd ms | bwd TFLOP/s | fwd ms | fwd+bwd ms | fwd+bwd TFLOP/s | note |",
             "|---|---|---|---|---|---|---|---|"]
    f2 = lambda r, key, fmt: (fmt % r[key]) if key in r else ""
    for r in rows:
        table.append(f"| {r['shape']} | {r['impl']} | {f2(r, 'bwd_ms', '%.3f')} | "
                     f"{f2(r, 'bwd_tflops', '%.0f')} | {f2(r, 'fwd_ms', '%.3f')} | "
                     f"{f2(r, 'fwdbwd_ms', '%.3f')} | {f2(r, 'fwdbwd_tflops', '%.0f')} | "
                     f"{r.get('err', '')} |")
    print("\n".join(table), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as fh:
            json.dump(dict(rows=rows, lines=lines), fh, indent=1)
        with open(os.path.join(a.out, "table.md"), "w") as fh:
            fh.write("\n".join(lines + [""] + table) + "\n")


if __name__ == "__main__":
    main()
