"""Case 6: a checkpoint written on 8 devices restores on 2 and then on 1 device, and directly on 1
device, with the requested sharding on every array, and training continues with the same loss."""
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
from sharding_common import synthetic_batches, tiny_cfg  # noqa: E402

from dsjax.checkpoint import Checkpointer, abstract_like  # noqa: E402
from dsjax.config import CheckpointConfig  # noqa: E402
from dsjax.train import loop  # noqa: E402
from dsjax.train.optim import build_optimizer  # noqa: E402
from dsjax.train.step import init_model  # noqa: E402


def _setup(cfg, n_dev):
    par = loop.setup_parallel(cfg, jax.devices()[:n_dev])
    fns, params, rest = init_model(cfg)
    tx, schedule = build_optimizer(cfg.optim, cfg.train.steps)
    state, sh = loop.create_state(fns, params, rest, tx, par)
    return par, state, sh, loop.jit_train_step(cfg, fns, tx, schedule, par, sh)


def test_checkpoint_8_to_2_to_1_devices(tmp_path):
    cfg8 = tiny_cfg("mesh.preset=fsdp", "mesh.fsdp=8")
    batches = synthetic_batches(cfg8, 4)
    par8, state, _, step8 = _setup(cfg8, 8)
    losses8 = []
    for i in range(4):
        if i == 2:
            ck = Checkpointer(tmp_path / "ck8", CheckpointConfig(async_save=False))
            ck.save(2, state, {"pos": 2}, {})
            ck.close()
        state, m = step8(state, loop.global_batch(par8, batches[i], 1))
        losses8.append(float(m["loss"]))

    one = ["mesh.preset=fsdp", "mesh.fsdp=1", "mesh.devices=1"]
    # (devices, mesh, checkpoint read): 8 -> 2, the 2-device re-save -> 1, and 8 -> 1 directly
    for n_dev, sets, src in ((2, ["mesh.preset=fsdp", "mesh.fsdp=2", "mesh.devices=2"], "ck8"),
                             (1, one, "ck2"), (1, one, "ck8")):
        cfg = tiny_cfg(*sets)
        par, fresh, sh, step = _setup(cfg, n_dev)
        want = abstract_like(fresh)
        ck = Checkpointer(tmp_path / src, CheckpointConfig(async_save=False), read_only=True)
        restored, data, _, at = ck.restore(want)
        ck.close()
        assert at == 2 and data == {"pos": 2}
        n_checked = 0
        for got, req in zip(jax.tree.leaves(restored), jax.tree.leaves(want)):
            assert got.sharding.is_equivalent_to(req.sharding, got.ndim), (got.sharding, req.sharding)
            assert len(got.sharding.device_set) == n_dev
            n_checked += 1
        losses = []
        state = restored
        for i in (2, 3):
            if i == 3 and n_dev == 2:  # the 2-device mesh writes the checkpoint 1 device restores
                ck = Checkpointer(tmp_path / "ck2", CheckpointConfig(async_save=False))
                ck.save(2, restored_copy, {"pos": 2}, {})
                ck.close()
            if i == 2 and n_dev == 2:
                restored_copy = jax.tree.map(lambda x: x.copy(), state)
            state, m = step(state, loop.global_batch(par, batches[i], 1))
            losses.append(float(m["loss"]))
        err = max(abs(a - b) for a, b in zip(losses, losses8[2:]))
        print(f"\n{src} restored on {n_dev} device(s): {n_checked} arrays with requested shardings; "
              f"losses {losses} vs 8-device {losses8[2:]}: max err {err:.2e}")
        assert err < 1e-5
