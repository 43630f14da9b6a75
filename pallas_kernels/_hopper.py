"""What every Mosaic GPU kernel here asks of the device: is it a Hopper GPU, how many SMs it
has, and how to run a kernel in GPU interpret mode (a CPU simulation, for tests) elsewhere.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

# SMs assumed off a GPU, where the kernels run in interpret mode: persistent grids of
# `num_sms()` CTAs stay small enough to simulate quickly.
INTERPRET_SMS = 2

# GPU interpret mode simulates PTX named barriers (`bar.arrive` / `bar.sync` issued through
# inline Mosaic GPU) only with this setting of `InterpretGPUParams.inline_mgpu`; with its
# default ("error") a kernel that uses them must fall back to mbarriers there.
INTERPRET_NAMED_BARRIERS = "_hack_model_inline_mgpu_tokamax"


@functools.lru_cache(maxsize=None)
def on_hopper() -> bool:
    """True when the default device is an NVIDIA GPU of compute capability 9.x (H100, H200)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def on_gpu() -> bool:
    """True when the default device is a GPU (of any kind)."""
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


def num_sms() -> int:
    """Streaming multiprocessors of the default GPU (132 on an H100 SXM / H200); INTERPRET_SMS
    off a Hopper GPU."""
    return int(jax.devices()[0].core_count) if on_hopper() else INTERPRET_SMS


def interpret_params(**kw):
    """`plgpu.InterpretGPUParams(**kw)` with named barriers simulated as compiled."""
    return plgpu.InterpretGPUParams(inline_mgpu=INTERPRET_NAMED_BARRIERS, **kw)


def default_interpret():
    """None on a Hopper GPU (compile the kernel); interpret parameters elsewhere."""
    return None if on_hopper() else interpret_params()
