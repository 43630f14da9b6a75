"""One process of the two-process test: 4 CPU devices each, gloo collectives.

usage: mp_worker.py PROCESS_ID PORT MODE OUT_JSON   (MODE: train | die)
train: `dsjax.train.loop.train` for 3 steps of the tiny model under fsdp=8 over both processes,
       fed the layout tests' synthetic batches (this process's rows of each) instead of a corpus,
       so that its losses compare with the one-process run of the same batches; the run writes
       OUT_JSON's folder/run (metrics every step, TensorBoard, a checkpoint at step 3) with the
       tokenizer file OUT_JSON's folder/tokenizer.json. Writes the losses and the mesh.
die:   process 1 exits right after joining; process 0 must then fail, not hang.
"""
import json
import os
import sys
import types
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
# both processes compile the same programs at the same time: no compilation cache shared with
# the test session (tests/conftest.py), which one process could read while the other writes it
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
sys.path.insert(0, str(Path(__file__).parent))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from sharding import distributed  # noqa: E402


class SyntheticLoader:
    """The training loader's interface over this process's rows of `synthetic_batches`."""

    def __init__(self, cfg):
        from sharding_common import synthetic_batches

        self.batches = synthetic_batches(cfg, cfg.train.steps, process_index=jax.process_index(),
                                         process_count=jax.process_count())
        self.position = 0

    def __next__(self):
        self.position += 1
        return self.batches[self.position - 1]

    def state(self):
        return {"position": self.position}


def main():
    pid, port, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
    distributed.initialize(f"localhost:{port}", 2, pid, initialization_timeout=60, heartbeat_timeout=10)
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    if mode == "die" and pid == 1:
        os._exit(3)
    from dsjax.train import loop
    from sharding_common import mp_run_cfg

    cfg = mp_run_cfg(out.parent)
    tok = types.SimpleNamespace(path=str(out.parent / "tokenizer.json"), vocab_size=cfg.model.vocab_size)
    loop.build_data = lambda cfg, run_tokenizer=None: (tok, SyntheticLoader(cfg), None)
    summary = loop.train(cfg)
    losses = [summary["train_loss"][s] for s in sorted(summary["train_loss"])]
    mesh = dict(loop.setup_parallel(cfg).mesh.shape)
    out.write_text(json.dumps({"losses": losses, "mesh": mesh}))


if __name__ == "__main__":
    main()
