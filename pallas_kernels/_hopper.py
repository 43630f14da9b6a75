"""What every Mosaic GPU kernel here asks of the device: is it a Hopper GPU, how many SMs it
has, and how to run a kernel in GPU interpret mode (a CPU simulation, for tests) elsewhere; and
`lower_once`, which makes identical kernel calls share one lowering and one compile.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings

import jax
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

# SMs assumed off a GPU, where the kernels run in interpret mode: persistent grids of
# `num_sms()` CTAs stay small enough to simulate quickly.
INTERPRET_SMS = 2

# GPU interpret mode simulates PTX named barriers (`bar.arrive` / `bar.sync` issued through
# inline Mosaic GPU) only with this setting of `InterpretGPUParams.inline_mgpu`; with its
# default ("error") a kernel that uses them must fall back to mbarriers there.
INTERPRET_NAMED_BARRIERS = "_hack_model_inline_mgpu_tokamax"


# The device the kernels are chosen, sized and lowered for while `target_device` is active.
_TARGET: list = [None]


@contextlib.contextmanager
def target_device(device):
    """While active, `on_hopper`, `on_gpu` and `num_sms` describe `device` instead of the default
    device, so kernel dispatch and lowering target it: e.g. a compile-only device of a
    `jax.experimental.topologies` GPU topology, to compile a step for a Hopper GPU ahead of time
    on a machine without one (`benchmarks/step_bytes.py`). `device` needs `platform`,
    `compute_capability` and `core_count`, as jax's GPU devices have. Not thread-safe; kernels
    already traced by `lower_once` keep the target they were traced for."""
    prev = _TARGET[0]
    _TARGET[0] = device
    try:
        yield
    finally:
        _TARGET[0] = prev


def _device():
    if _TARGET[0] is not None:
        return _TARGET[0]
    try:
        return jax.devices()[0]
    except RuntimeError:
        return None


def on_hopper() -> bool:
    """True when the target device (`target_device`, else the default device) is an NVIDIA GPU
    of compute capability 9.x (H100, H200)."""
    dev = _device()
    return (dev is not None and dev.platform == "gpu"
            and str(getattr(dev, "compute_capability", "")).startswith("9"))


def on_gpu() -> bool:
    """True when the target device (`target_device`, else the default device) is a GPU."""
    dev = _device()
    return dev is not None and dev.platform == "gpu"


def num_sms() -> int:
    """Streaming multiprocessors of the target GPU (132 on an H100 SXM / H200); INTERPRET_SMS
    off a Hopper GPU."""
    return int(_device().core_count) if on_hopper() else INTERPRET_SMS


INTERPRET_MIN_CPU_THREADS = 8


@functools.cache
def _warn_small_cpu_pool() -> None:
    """GPU interpret mode runs each simulated warpgroup as its own XLA:CPU computation from a
    host callback, and a warpgroup waiting at a named barrier holds its thread; under `jax.jit`
    XLA may run the callbacks on its CPU thread pool, which then has no thread left for the other
    warpgroups: a deadlock at 0 % CPU. The pool has one thread per core unless PJRT_NPROC (or
    NPROC) says otherwise; the hang was seen with 2 threads and one CPU device (a jitted
    projection + RoPE + flash attention, most runs), never with PJRT_NPROC >= 3 or with 8 host
    devices (`--xla_force_host_platform_device_count=8`, as the tests run)."""
    threads = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC") or os.cpu_count() or 1
    if int(threads) < INTERPRET_MIN_CPU_THREADS and jax.local_device_count() == 1:
        warnings.warn(f"Mosaic GPU interpret mode under jax.jit can deadlock with {threads} XLA CPU "
                      f"threads: set PJRT_NPROC={INTERPRET_MIN_CPU_THREADS} in the environment before "
                      f"jax starts", RuntimeWarning, stacklevel=3)


def interpret_params(**kw):
    """`plgpu.InterpretGPUParams(**kw)` with named barriers simulated as compiled. Warns once
    when the CPU's thread pool is small enough for interpret mode to deadlock under `jax.jit`
    (`_warn_small_cpu_pool`)."""
    _warn_small_cpu_pool()
    return plgpu.InterpretGPUParams(inline_mgpu=INTERPRET_NAMED_BARRIERS, **kw)


def default_interpret():
    """None on a Hopper GPU (compile the kernel); interpret parameters elsewhere."""
    return None if on_hopper() else interpret_params()


def lower_once(kernel_fn):
    """Wrap a function that calls a Mosaic GPU kernel so that every call with the same array
    shapes and dtypes and the same non-array arguments shares one lowering, hence one compile.

    Mosaic GPU names each lowered module with a per-process counter, and that name enters the
    kernel's hash, by which the GPU runtime caches compiled kernels: without this wrapper an
    unrolled 27-layer model compiles each of its ~13 kernels per layer again (LLVM and ptxas,
    about a second each). Here the call runs under `jax.jit` with every non-array leaf of the
    arguments static (Python scalars, dtypes, configs; they must be hashable) and the arrays
    traced, so jit's trace cache returns one jaxpr per signature and the lowering of the
    enclosing program emits it once as a function that every call site calls (XLA inlines it,
    with the same kernel hash at each site). Numerics are unchanged: the same kernel runs on
    the same operands.
    """

    def is_array(leaf):
        return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or hasattr(leaf, "aval")

    @functools.lru_cache(maxsize=None)
    def jitted(treedef, statics):
        def call(*arrays):
            it = iter(arrays)
            leaves = [next(it) if s is _ARRAY else s for s in statics]
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            return kernel_fn(*args, **kwargs)
        call.__name__ = getattr(kernel_fn, "__name__", "kernel")
        return jax.jit(call)

    @functools.wraps(kernel_fn)
    def wrapper(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        statics = tuple(_ARRAY if is_array(x) else x for x in leaves)
        return jitted(treedef, statics)(*[x for x in leaves if is_array(x)])
    return wrapper


class _ArrayMarker:
    """Placeholder for a traced argument in `lower_once`'s cache key."""
    __slots__ = ()

    def __repr__(self):
        return "<array>"


_ARRAY = _ArrayMarker()
