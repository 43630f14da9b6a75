"""One process of the two-process test: 4 CPU devices each, gloo collectives.

usage: mp_worker.py PROCESS_ID PORT MODE OUT_JSON   (MODE: train | die)
train: 3 steps of the tiny model under fsdp=8 over both processes; writes the losses.
die:   process 1 exits right after joining; process 0 must then fail, not hang.
"""
import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from sharding import distributed  # noqa: E402


def main():
    pid, port, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    distributed.initialize(f"localhost:{port}", 2, pid, initialization_timeout=60, heartbeat_timeout=10)
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    if mode == "die" and pid == 1:
        os._exit(3)
    from sharding_common import run_layout, tiny_cfg

    losses, _, _, par, _ = run_layout(tiny_cfg("mesh.preset=fsdp", "mesh.fsdp=8"))
    Path(out).write_text(json.dumps({"losses": losses, "mesh": dict(par.mesh.shape)}))


if __name__ == "__main__":
    main()
