"""The GPU's SM clock, power draw and energy while a benchmark's timed loop runs, read through NVML.

    with PowerSampler() as ps:
        ... timed steps ...
    ps.summary()  # {"sm_mhz": ..., "sm_mhz_max": ..., "power_w": ..., "power_limit_w": ..., "energy_j": ...}

Why: an H200 capped at 700 W lowers its SM clock when a loop draws more than the cap allows. A
training step that keeps the tensor cores busy runs at the cap with a lower clock (the
27-layer LoRA step: 1610-1725 MHz of 1980), while a step with launch gaps keeps the full clock
(HF + PEFT's: 1980 MHz); a kernel timed in short bursts stays at the full clock. Under the cap a
step's time follows its energy, so a kernel that is faster in a burst but draws more energy per
call need not make the step faster. These numbers say which regime a row ran in.

NVML (`libnvidia-ml.so.1`, part of the NVIDIA driver) is called through ctypes, so no Python
package is needed; without it (a CPU host) `summary()` is None. The device is NVML index 0, or
the first entry of CUDA_VISIBLE_DEVICES when that is a number. Units: MHz, W, J (NVML reports
mW and mJ).
"""
from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time

_NVML_CLOCK_SM = 1


def _nvml_device():
    """(library, device handle), or None when NVML cannot be loaded or initialised."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    index = int(first) if first.isdigit() else 0
    handle = ctypes.c_void_p()
    if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
        return None
    return lib, handle


def _read(fn, *args, ctype=ctypes.c_uint):
    value = ctype()
    return value.value if fn(*args, ctypes.byref(value)) == 0 else None


class PowerSampler:
    """Samples the SM clock and power draw every `interval_s` seconds on a thread, and reads
    NVML's energy counter at entry and exit. A context manager; `summary()` after exit."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self._dev = _nvml_device()
        self._clocks: list[float] = []
        self._watts: list[float] = []
        self._stop = threading.Event()
        self._thread = None
        self._energy = [None, None]
        self._time = [0.0, 0.0]

    def _energy_mj(self):
        lib, h = self._dev
        return _read(lib.nvmlDeviceGetTotalEnergyConsumption, h, ctype=ctypes.c_ulonglong)

    def _sample(self):
        lib, h = self._dev
        while not self._stop.is_set():
            mhz = _read(lib.nvmlDeviceGetClockInfo, h, _NVML_CLOCK_SM)
            mw = _read(lib.nvmlDeviceGetPowerUsage, h)
            if mhz is not None:
                self._clocks.append(float(mhz))
            if mw is not None:
                self._watts.append(mw / 1e3)
            self._stop.wait(self.interval_s)

    def __enter__(self):
        if self._dev is not None:
            self._energy[0] = self._energy_mj()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self._time[0] = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._time[1] = time.perf_counter()
        if self._dev is not None:
            self._stop.set()
            self._thread.join()
            self._energy[1] = self._energy_mj()
        return False

    def summary(self) -> dict | None:
        """Median SM clock (MHz) and power (W) over the samples, the device's maximum SM clock
        and enforced power limit, energy (J) and seconds between entry and exit; None without
        NVML or samples."""
        if self._dev is None or not self._clocks:
            return None
        lib, h = self._dev
        limit = _read(lib.nvmlDeviceGetEnforcedPowerLimit, h)
        e0, e1 = self._energy
        return {"sm_mhz": statistics.median(self._clocks),
                "sm_mhz_max": _read(lib.nvmlDeviceGetMaxClockInfo, h, _NVML_CLOCK_SM),
                "power_w": statistics.median(self._watts) if self._watts else None,
                "power_limit_w": limit / 1e3 if limit is not None else None,
                "energy_j": (e1 - e0) / 1e3 if e0 is not None and e1 is not None else None,
                "seconds": self._time[1] - self._time[0], "samples": len(self._clocks)}


def describe(s: dict | None, steps: int = 1) -> str:
    """One line of a `summary()`: clock, power, and energy per step over `steps` steps."""
    if not s:
        return "GPU clock and power: not read (no NVML)"
    out = f"SM clock {s['sm_mhz']:.0f} of {s['sm_mhz_max'] or 0:.0f} MHz"
    if s["power_w"] is not None:
        out += f", {s['power_w']:.0f} W" + (f" of {s['power_limit_w']:.0f} W" if s["power_limit_w"] else "")
    if s["energy_j"] is not None and steps:
        out += f", {s['energy_j'] / steps:.1f} J per step"
    return out + f" (median of {s['samples']} samples)"


def sustained(fn, args, seconds: float, sync):
    """Time `fn(*args)` called back to back for about `seconds`, long enough for the GPU to reach
    its power cap (a burst of a few ms stays at the full clock).

    sync(out) waits for the device (e.g. `jax.block_until_ready`). One untimed call, then a
    ~50 ms loop sizes the timed loop. Returns (seconds per call, joules per call or None
    without NVML, the `PowerSampler.summary()` of the timed loop)."""
    out = fn(*args)
    sync(out)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.05:
        out = fn(*args)
        n += 1
    sync(out)
    iters = max(1, int(seconds / ((time.perf_counter() - t0) / n)))
    with PowerSampler() as ps:
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        sync(out)
        per_call = (time.perf_counter() - t0) / iters
    s = ps.summary()
    joules = s["energy_j"] / iters if s and s["energy_j"] is not None else None
    return per_call, joules, s
