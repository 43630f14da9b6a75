"""Multi-host start-up.

`initialize(...)` runs `jax.distributed.initialize` once, before any other JAX call, from
explicit arguments, else the environment (DSJAX_COORDINATOR_ADDRESS / DSJAX_NUM_PROCESSES /
DSJAX_PROCESS_ID, or JAX_COORDINATOR_ADDRESS), else JAX's cluster auto-detection when a cluster
launcher is seen (SLURM, Open MPI, Kubernetes/JobSet, ...). Nothing set: single process, no-op.

Failure behaviour. A process that dies stops sending heartbeats; after `heartbeat_timeout`
seconds the coordination service marks it dead and the surviving processes' JAX clients abort
with an error, so they do not wait forever in a collective for a peer that is gone. A process
that is alive but stuck in a collective is not detected by heartbeats (jax#38503).

On the CPU backend cross-process collectives need `jax_cpu_collectives_implementation`
(`gloo`), set here before the backend starts.
"""
from __future__ import annotations

import logging
import os

import jax

log = logging.getLogger("sharding.distributed")

_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JOBSET_NAME", "MEGASCALE_COORDINATOR_ADDRESS",
                "TPU_WORKER_HOSTNAMES")
_STATE = {"initialized": False}


def _env_int(name):
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, initialization_timeout: int = 300,
               heartbeat_timeout: int = 100, cpu_collectives: str = "gloo",
               local_device_ids=None) -> bool:
    """Start JAX's distributed runtime if this is a multi-process run.

    Args:
      coordinator_address: "host:port" of process 0 (default: $DSJAX_COORDINATOR_ADDRESS, then
        $JAX_COORDINATOR_ADDRESS, then cluster auto-detection).
      num_processes, process_id: default $DSJAX_NUM_PROCESSES / $DSJAX_PROCESS_ID.
      initialization_timeout: seconds to wait for every process to join.
      heartbeat_timeout: seconds without a heartbeat before a process is declared dead and
        the others abort.
      cpu_collectives: "gloo" or "mpi", for the CPU backend.
    Returns:
      True if the distributed runtime was started (now or earlier), False for a single process.
    Raises:
      RuntimeError: the JAX backend was already started (initialize must come first), or the
        processes did not all join within `initialization_timeout`.
    """
    if _STATE["initialized"]:
        return True
    addr = (coordinator_address or os.environ.get("DSJAX_COORDINATOR_ADDRESS")
            or os.environ.get("JAX_COORDINATOR_ADDRESS"))
    n = num_processes if num_processes is not None else _env_int("DSJAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _env_int("DSJAX_PROCESS_ID")
    cluster = any(k in os.environ for k in _CLUSTER_ENV)
    if addr is None and not cluster:
        if n not in (None, 1):
            raise RuntimeError(f"distributed: num_processes={n} but no coordinator address "
                               f"(set distributed.coordinator_address or DSJAX_COORDINATOR_ADDRESS)")
        return False
    if n == 1 and addr is None:
        return False
    try:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    except Exception:  # noqa: BLE001 - option missing on some builds; GPU/TPU do not need it
        pass
    kwargs = dict(initialization_timeout=initialization_timeout, heartbeat_timeout_seconds=heartbeat_timeout)
    if local_device_ids is not None:
        kwargs["local_device_ids"] = local_device_ids
    log.info("jax.distributed.initialize(coordinator=%s, num_processes=%s, process_id=%s)", addr, n, pid)
    jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=pid, **kwargs)
    _STATE["initialized"] = True
    return True


def initialize_from_config(dc) -> bool:
    """`initialize` from a dsjax `DistributedConfig`-like object."""
    return initialize(dc.coordinator_address, dc.num_processes, dc.process_id,
                      initialization_timeout=dc.initialization_timeout,
                      heartbeat_timeout=dc.heartbeat_timeout, cpu_collectives=dc.cpu_collectives)
