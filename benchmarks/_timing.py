"""Timing shared by the kernel benchmarks (moe.py, gemm_bound.py, gemm_fp8.py). Imports jax only
when called, so a script may set XLA flags or platforms before jax starts."""
from __future__ import annotations

import statistics
import time


def seconds(fn, args, iters, reps):
    """Median over `reps` timings of `iters` back-to-back calls, per call, after a warm-up."""
    import jax

    jax.block_until_ready(fn(*args))
    sync_each = jax.default_backend() != "gpu"  # GPU interpret mode: never two kernel calls in flight
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
            if sync_each:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / iters)
    return statistics.median(ts)
