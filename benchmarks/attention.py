"""Attention TFLOP/s on one Hopper GPU: ours (Pallas Mosaic GPU) vs cuDNN, tokamax mosaic, XLA.

Run on the GPU machine: `python benchmarks/attention.py [--quick]`. Prints one table.
FLOPs: forward 2*B*N*T*S*(Dqk+Dv), halved for causal; forward+backward = 3.5x forward
(backward counted as 2.5x forward). Inputs bf16, random normal (never zeros).
Each cell: median over `reps` timings of `iters` back-to-back calls, after a warm-up call.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from pallas_kernels.flash_attention import flash_attention  # noqa: E402

SHAPES = [  # (name, B, T, N, Dqk, Dv, causal)
    ("MLA B4 T4096 N16 192/128 causal", 4, 4096, 16, 192, 128, True),
    ("MLA B1 T16384 N16 192/128 causal", 1, 16384, 16, 192, 128, True),
    ("B4 T4096 N16 128/128 causal", 4, 4096, 16, 128, 128, True),
]


def ours(q, k, v, causal):
    return flash_attention(q, k, v, causal=causal, impl="pallas")


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


def _time(fn, args, iters, reps):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--impls", default=",".join(n for n, _ in IMPLS))
    ap.add_argument("--shapes", default="0,1,2")
    ap.add_argument("--tiny", action="store_true", help="smoke test: T=256, N=2 (any backend)")
    a = ap.parse_args()
    iters, reps = (3, 3) if a.quick else (5, 5)
    names = a.impls.split(",")
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for si in map(int, a.shapes.split(",")):
        name, B, T, N, Dqk, Dv, causal = SHAPES[si]
        if a.tiny:
            name, B, T, N = name + " [tiny]", 1, 256, 2
        ks = jax.random.split(jax.random.key(si), 4)
        q = jax.random.normal(ks[0], (B, T, N, Dqk), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, T, N, Dqk), jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, T, N, Dv), jnp.bfloat16)
        do = jax.random.normal(ks[3], (B, T, N, Dv), jnp.bfloat16)
        flops = 2.0 * B * N * T * T * (Dqk + Dv) * (0.5 if causal else 1.0)
        ref_o = ref_g = None
        for iname, impl in IMPLS:
            if iname not in names:
                continue
            try:
                fwd = jax.jit(lambda q, k, v, impl=impl: impl(q, k, v, causal))

                def fb(q, k, v, impl=impl):
                    o, vjp = jax.vjp(lambda *x: impl(*x, causal), q, k, v)
                    return o, vjp(do)
                fwdbwd = jax.jit(fb)
                o, g = fwdbwd(q, k, v)
                if ref_o is None:   # first impl that runs (ours) is compared with cudnn below
                    ref_o, ref_g = o, g
                    err = "-"
                else:
                    rel = lambda x, y: float(jnp.linalg.norm((x - y).astype(jnp.float32))
                                             / jnp.linalg.norm(y.astype(jnp.float32)))
                    err = "o %.1e dq %.1e dk %.1e dv %.1e" % (
                        rel(ref_o, o), *(rel(x, y) for x, y in zip(ref_g, g)))
                tf = _time(fwd, (q, k, v), iters, reps)
                tfb = _time(fwdbwd, (q, k, v), iters, reps)
                rows.append((name, iname, flops / tf / 1e12, 3.5 * flops / tfb / 1e12,
                             tf * 1e3, tfb * 1e3, err))
                print(rows[-1], flush=True)
            except Exception as e:  # noqa: BLE001 - report and keep benchmarking the rest
                traceback.print_exc()
                rows.append((name, iname, float("nan"), float("nan"), float("nan"), float("nan"),
                             f"FAILED {type(e).__name__}: {str(e)[:80]}"))
    print("\n| shape | impl | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms | bwd ms |"
          " rel. diff vs ours |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.3f} | {r[5]:.3f} |"
              f" {r[5] - r[4]:.3f} | {r[6]} |")


if __name__ == "__main__":
    main()
