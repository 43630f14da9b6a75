"""Compile-only stand-ins for the Mosaic GPU kernels, so that a CPU compile allocates what a
Hopper GPU would.

`dsjax.plan` compiles the train step on fake CPU devices. There the kernels' "auto" impl
resolves to the pure-jnp references, whose intermediates (padded row copies, fp32 GEMM
outputs and accumulators) are not what the GPU runs. Inside `hopper_kernels_compile_only()`
"auto" resolves as on a Hopper GPU (the Mosaic kernel where its shape checks pass, else the
reference, exactly as `on_hopper()` would decide) and each Mosaic kernel call becomes
`stand_in`: an opaque host call with the kernel's operands and output shapes. Its only buffer
is its output, as for the Mosaic kernel, whose scratch lives in SMEM and registers. The
program is for compiling and measuring only: running it returns zeros.
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np

_ACTIVE = [False]


@contextlib.contextmanager
def hopper_kernels_compile_only(active: bool = True):
    """While active, kernel dispatch resolves as on Hopper and Mosaic kernels compile to
    `stand_in`s (module docstring). Not thread-safe: meant for a planning process."""
    prev = _ACTIVE[0]
    _ACTIVE[0] = active
    try:
        yield
    finally:
        _ACTIVE[0] = prev


def active() -> bool:
    """True inside `hopper_kernels_compile_only()`."""
    return _ACTIVE[0]


def stand_in(out, *operands):
    """An opaque op reading `operands` and writing `out` (a ShapeDtypeStruct or a tuple of them).

    Returns arrays of out's shapes and dtypes (zeros if ever run). XLA cannot see through it,
    so it neither fuses into nor allocates beyond its outputs."""
    def host(*_):
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), out)
    return jax.pure_callback(host, out, *operands, vmap_method="sequential")
