"""The device mesh: axes (data, fsdp, expert, tensor, context), sizes from the config.

`make_mesh(config)` takes any object with integer attributes `data, fsdp, expert, tensor,
context` (dsjax's `MeshConfig`) and an optional `devices` count (-1: all devices of all
processes). One axis may be -1: it takes the devices left over. The mesh is built over
`jax.devices()` (global on multi-host runs, so call `sharding.distributed.initialize` first),
with `jax.make_mesh` placing the innermost axes (tensor, context) on the closest devices.

Axis order, outer to inner: data, fsdp, expert, context, tensor. The last axes change fastest,
so TP (heaviest traffic) and CP (ring neighbours) stay inside a host / NVLink domain, and data
parallelism spans hosts (cf. MaxText `ici_*`/`dcn_*` parallelism, base.yml).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "expert", "context", "tensor")


class MeshError(ValueError):
    """Mesh sizes that do not fit the devices. The message names the axes and the device count."""


def resolve_axis_sizes(sizes: dict[str, int], n_devices: int) -> dict[str, int]:
    """Fill the one -1 axis so that the product of sizes equals `n_devices`.

    Args:
      sizes: axis name -> size (positive or -1), for every name in `AXES`.
      n_devices: devices the mesh must cover.
    Raises:
      MeshError: more than one -1, a size < 1, or sizes whose product does not equal n_devices.
    """
    free = [a for a in AXES if sizes[a] == -1]
    bad = [a for a in AXES if sizes[a] != -1 and sizes[a] < 1]
    if bad:
        raise MeshError(f"mesh: {bad[0]}={sizes[bad[0]]} must be >= 1 or -1")
    if len(free) > 1:
        raise MeshError(f"mesh: only one axis may be -1, got {free}")
    fixed = math.prod(sizes[a] for a in AXES if a not in free)
    out = dict(sizes)
    if free:
        if n_devices % fixed:
            raise MeshError(f"mesh: {n_devices} devices are not divisible by the fixed axes "
                            f"({_fmt(sizes)}, product {fixed}) to fill mesh.{free[0]}=-1")
        out[free[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise MeshError(f"mesh: {_fmt(sizes)} covers {fixed} devices but {n_devices} are used "
                        f"(set one axis to -1 to fill the rest)")
    return out


def _fmt(sizes):
    return " x ".join(f"{a}={sizes[a]}" for a in AXES)


def make_mesh(config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the 5-axis mesh of `config` (see module docstring).

    Args:
      config: object with int attributes data, fsdp, expert, tensor, context, and optionally
        `devices` (-1 or None: every device; N: the first N of `jax.devices()`).
      devices: explicit device list (overrides config.devices).
    Returns:
      `jax.sharding.Mesh` with axis names `AXES`, all `AxisType.Auto` (GSPMD propagation; the
      ring attention and expert-parallel code enter `shard_map` explicitly).
    Raises:
      MeshError: as `resolve_axis_sizes`, or more devices requested than exist.
    """
    if devices is None:
        devices = jax.devices()
        n = getattr(config, "devices", -1)
        if n is not None and n != -1:
            if n < 1 or n > len(devices):
                raise MeshError(f"mesh.devices={n}: {len(devices)} devices exist")
            devices = devices[:n]
    devices = list(devices)
    sizes = resolve_axis_sizes({a: int(getattr(config, a)) for a in AXES}, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    if len(devices) == len(jax.devices()):
        try:
            return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
        except Exception:  # noqa: BLE001 - topology-aware placement unavailable: plain order
            pass
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES,
                axis_types=(AxisType.Auto,) * len(AXES))


def axis_size(mesh, name: str) -> int:
    """Size of mesh axis `name` (1 if the mesh has no such axis)."""
    return int(dict(mesh.shape).get(name, 1))
