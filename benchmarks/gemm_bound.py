"""What bounds the expert grouped GEMM: ours against cuBLAS and JAX's Hopper matmul example.

    python benchmarks/gemm_bound.py [--rounds 1] [--iters 20] [--sustain S] [--extra R,...] [--tiny]

One GEMM shape, out [M, 2048] = x [M, K] @ w [K, 2048] in bf16 with fp32 accumulation, run by:

  cublas       `jnp.dot` (XLA's cuBLAS call): the rate a dense GEMM reaches under the same
               power cap
  jax_example  `jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu` (JAX's persistent
               warp-specialized Pallas matmul, 128 x 256 CTA tiles, 4 stages, 64 x 64 epilogue
               tiles): the same kernel structure as ours (one pipeline per work item) without
               groups
  gmm E=1      our `mosaic_gpu.gmm` with a single group: the kernel's own cost without group
               boundaries
  gmm E=64     the same rows in 64 groups of Dirichlet(50) sizes (V2-Lite's routed experts at a
               near-uniform load): the cost of the groups (partial row tiles, 64 weights)
  gmm E=64 +extra R   (--extra) the same with a LoRA adapter's second factor t [M, R] @ b[g]
               [R, 2048] as one more contraction into the accumulator: the form of the LoRA
               step's expert GEMMs, R the adapter rank padded to the kernel's extra step (its
               TFLOP/s counts x @ w only; a width the kernel refuses prints its error)

at V2-Lite's forward down GEMM (M 49152 = 4 x 2048 tokens x top-6, K 1408), then a K sweep at
the same FLOPs (K 1024 to 8192, M shrinking): fewer and longer work items per CTA, which shows
the share of the per-item cost (pipeline fill, epilogue). Each time is the median of --reps
timings of --iters back-to-back calls; --rounds R interleaves the rows R times (the H200's power
cap makes rounds differ by up to ~6 %). Outputs are checked against an fp32 `jnp.dot`
(relative L2 error). `--sustain S` times every row instead by calling it back to back for S
seconds (1.5 is enough), so that the GPU runs at its power cap as a training step does, and adds
the energy per call and the median SM clock (`gpu_power.py`, NVML): under the cap a kernel's time
follows its energy, and a burst timing can rank two kernels the other way. `--tiny` runs small shapes in GPU interpret mode off a GPU (a smoke test,
not a timing; the JAX example runs only on a GPU).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])
from pallas_kernels._hopper import num_sms, on_hopper  # noqa: E402
from pallas_kernels.moe import mosaic_gpu  # noqa: E402
from pallas_kernels.moe.reference import grouped_matmul_reference  # noqa: E402

from gpu_power import sustained  # noqa: E402 (benchmarks/gpu_power.py: timing at the power cap)
from _timing import seconds  # noqa: E402 (median of timed back-to-back calls)

N = 2048
PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16


def jax_example(a, b):
    """JAX's Hopper matmul example at its best tile for these shapes (128 x 256 CTA, 4 stages)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                          grid_tile_width=4, wg_dimension=hm.MatmulDimension.N)
    call = plgpu.kernel(
        functools.partial(hm.kernel, config=cfg),
        out_type=jax.ShapeDtypeStruct((a.shape[0], b.shape[1]), a.dtype), grid=(num_sms(),),
        grid_names=("cluster_grid",), cluster=(1,), cluster_names=("cluster",), num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    return call(a, b, None)


def rows_for(m, k, e, key, extra=()):
    """[(name, jitted fn, args)] for one shape; group sizes Dirichlet(50) for e > 1, and with
    e > 1 one row per width in `extra` with a LoRA extra contraction of that width."""
    ka, kb, kg = jax.random.split(key, 3)
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (k, N), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    rows = [("cublas", jax.jit(jnp.dot), (a, b))]
    if on_hopper():
        rows.append(("jax_example", jax.jit(jax_example), (a, b)))
    one, gs = jnp.asarray([m], jnp.int32), None
    rows.append(("gmm E=1", jax.jit(lambda a, b: mosaic_gpu.gmm(a, b[None], one)), (a, b)))
    if e > 1:
        p = jax.random.dirichlet(kg, jnp.full((e,), 50.0))
        gs = jnp.floor(p * m).astype(jnp.int32)
        gs = gs.at[0].add(m - gs.sum())
        w = jnp.broadcast_to(b, (e, k, N))  # same values in every group: same reference
        rows.append((f"gmm E={e}", jax.jit(lambda a, w: mosaic_gpu.gmm(a, w, gs)), (a, w)))
        for r in extra:  # the LoRA step's form: the adapter's t @ b[g] as one more contraction
            kt, kb2 = jax.random.split(jax.random.fold_in(key, r))
            t = jax.random.normal(kt, (m, r), jnp.float32).astype(jnp.bfloat16)
            bx = (jax.random.normal(kb2, (e, r, N), jnp.float32) / 8).astype(jnp.bfloat16)
            rows.append((f"gmm E={e} +extra {r}",
                         jax.jit(lambda a, w, t, bx: mosaic_gpu.gmm(a, w, gs, extra=(t, bx))), (a, w, t, bx)))
    return rows, (a, b), gs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sustain", type=float, default=0.0, metavar="S",
                   help="time each row over S seconds of back-to-back calls (at the power cap), with energy")
    p.add_argument("--extra", default="", metavar="R,...",
                   help="rows of the 64-group GEMM with a LoRA extra contraction of these widths (e.g. 16,64)")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    extras = [int(r) for r in args.extra.split(",") if r]
    if args.tiny:
        shapes, e, args.iters, args.reps = [(256, 128), (128, 256)], 4, 1, 1
    else:
        base = 49152 * 1408
        shapes, e = [(49152, 1408)] + [(base // k // 256 * 256, k) for k in (1024, 2048, 4096, 8192)], 64
    table = []
    for i, (m, k) in enumerate(shapes):
        rows, (a, b), gs = rows_for(m, k, e if i == 0 else 1, jax.random.key(i), extras if i == 0 else ())
        ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
        errs, kept = {}, []
        for name, fn, fargs in rows:
            try:
                out = fn(*fargs).astype(jnp.float32)
            except ValueError as err:  # e.g. an extra width this kernel does not take
                print(f"{name}: {str(err).splitlines()[0][:160]}", flush=True)
                continue
            want = ref
            if len(fargs) == 4:  # + t @ b (every group's b differs: its own reference)
                want = ref + grouped_matmul_reference(fargs[2].astype(jnp.float32),
                                                      fargs[3].astype(jnp.float32), gs)
            errs[name] = float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want))
            kept.append((name, fn, fargs))
        rows = kept
        times = {name: [] for name, _, _ in rows}
        power = {name: [] for name, _, _ in rows}
        for _ in range(max(args.rounds, 1)):
            for name, fn, fargs in rows:
                if args.sustain:
                    t, joules, s = sustained(fn, fargs, args.sustain, jax.block_until_ready)
                    times[name].append(t)
                    power[name].append((joules, s["sm_mhz"] if s else None))
                else:
                    times[name].append(seconds(fn, fargs, args.iters, args.reps))
        for name, _, _ in rows:
            t = statistics.median(times[name])
            tflops = 2 * m * k * N / t / 1e12
            mj = [j * 1e3 for j, _ in power[name] if j is not None]
            mhz = [c for _, c in power[name] if c is not None]
            table.append((m, k, name, t * 1e3, tflops, errs[name],
                          statistics.median(mj) if mj else None, statistics.median(mhz) if mhz else None))
            print(table[-1], flush=True)
    print(f"\nout [M, {N}] = x [M, K] @ w [K, {N}], bf16; {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}\n")
    timing = (f"{args.sustain:g} s of back-to-back calls per row (at the power cap)" if args.sustain
              else f"median of {args.reps} x {args.iters} calls (bursts)")
    print(f"times: {timing}, median over {max(args.rounds, 1)} round(s)\n")
    print("| M | K | impl | ms | TFLOP/s | % of 989 | rel. error | mJ/call | SM MHz |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for m, k, name, ms, tf, err, mj, mhz in table:
        print(f"| {m} | {k} | {name} | {ms:.3f} | {tf:.0f} | {100 * tf / PEAK_TFLOPS:.0f} % | {err:.1e} | "
              f"{'-' if mj is None else f'{mj:.0f}'} | {'-' if mhz is None else f'{mhz:.0f}'} |")


if __name__ == "__main__":
    main()
