"""Case 6: a checkpoint written on 8 devices restores on 2 and then on 1 device, and directly on 1
device, with the requested sharding on every array, and training continues with the same loss."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from sharding_common import synthetic_batches, tiny_cfg  # noqa: E402

from dsjax.checkpoint import Checkpointer, abstract_like  # noqa: E402
from dsjax.config import CheckpointConfig  # noqa: E402
from dsjax.train import loop  # noqa: E402
from dsjax.train.optim import build_optimizer  # noqa: E402
from dsjax.train.step import COPY_KEY, checkpointed, compute_copy, init_model  # noqa: E402


def _setup(cfg, n_dev, compute_dtype=None):
    par = loop.setup_parallel(cfg, jax.devices()[:n_dev])
    fns, params, rest = init_model(cfg)
    tx, schedule = build_optimizer(cfg.optim, cfg.train.steps)
    state, sh = loop.create_state(fns, params, rest, tx, par, compute_dtype=compute_dtype)
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


def _assert_copy_is_the_cast(state, n_dev):
    """state[COPY_KEY]: the bf16 cast of state["params"], each leaf sharded as its param."""
    copy = state[COPY_KEY]
    cast_params = jax.tree.leaves(jax.tree.map(lambda c, p: None if c is None else p, copy, state["params"],
                                               is_leaf=lambda x: x is None))
    want = jax.tree.leaves(compute_copy(jax.device_get(state["params"]), jnp.bfloat16))
    got = jax.tree.leaves(copy)
    assert len(got) == len(want) == len(cast_params) > 0
    for c, p, w in zip(got, cast_params, want):
        assert c.dtype == jnp.bfloat16 and len(c.sharding.device_set) == n_dev
        assert c.sharding.is_equivalent_to(p.sharding, c.ndim), (c.sharding, p.sharding)
        np.testing.assert_array_equal(np.asarray(jax.device_get(c)), np.asarray(w))


def test_the_compute_copy_follows_its_params_through_a_restore(tmp_path):
    """bf16 compute over fp32 master weights, FSDP on 8 devices: the state's compute-dtype copy
    is sharded as the params it casts and stays their cast over the steps; checkpoints leave it
    out, and `loop.restore_state` on 2 devices casts it again in the 2-device shardings, from
    where training continues with the 8-device loss."""
    cfg8 = tiny_cfg("mesh.preset=fsdp", "mesh.fsdp=8", "model.dtype=bfloat16")
    batches = synthetic_batches(cfg8, 3)
    par8, state, _, step8 = _setup(cfg8, 8, jnp.bfloat16)
    _assert_copy_is_the_cast(state, 8)
    for i in range(2):
        state, _ = step8(state, loop.global_batch(par8, batches[i], 1))
    _assert_copy_is_the_cast(state, 8)
    ck = Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=False))
    ck.save(2, checkpointed(state), {"pos": 2}, {})
    ck.close()
    _, m8 = step8(state, loop.global_batch(par8, batches[2], 1))

    cfg2 = tiny_cfg("mesh.preset=fsdp", "mesh.fsdp=2", "mesh.devices=2", "model.dtype=bfloat16")
    par2, fresh, sh2, step2 = _setup(cfg2, 2, jnp.bfloat16)
    ck = Checkpointer(tmp_path / "ck", CheckpointConfig(async_save=False), read_only=True)
    restored, data, at = loop.restore_state(ck, fresh, sh2, 2, jnp.bfloat16)
    ck.close()
    assert at == 2 and data == {"pos": 2}
    _assert_copy_is_the_cast(restored, 2)
    _, m2 = step2(restored, loop.global_batch(par2, batches[2], 1))
    assert abs(float(m2["loss"]) - float(m8["loss"])) < 1e-5, (float(m2["loss"]), float(m8["loss"]))


def test_create_state_holds_the_placed_params_not_a_copy():
    """FSDP on 8 devices, fp32 master weights with the bf16 compute copy: the state's params are
    the arrays placed in their shardings (the same device buffers), so building the optimizer
    state and the copy never holds the params twice."""
    cfg = tiny_cfg("mesh.preset=fsdp", "mesh.fsdp=8", "model.dtype=bfloat16")
    par = loop.setup_parallel(cfg, jax.devices()[:8])
    fns, params, rest = init_model(cfg)
    tx, _ = build_optimizer(cfg.optim, cfg.train.steps)
    _, sh = loop.create_state(fns, params, rest, tx, par, compute_dtype=jnp.bfloat16)
    placed = jax.device_put(init_model(cfg)[1], sh["params"])
    state, _ = loop.create_state(fns, placed, rest, tx, par, compute_dtype=jnp.bfloat16)

    def buffers(tree):
        return [tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards) for x in jax.tree.leaves(tree)]

    assert buffers(state["params"]) == buffers(placed)
    assert len(jax.tree.leaves(state[COPY_KEY])) > 0


def _fp8_copies(state):
    from pallas_kernels.fp8.stored import Fp8Copy
    return [x for x in jax.tree.leaves(state[COPY_KEY], is_leaf=lambda x: isinstance(x, Fp8Copy))
            if isinstance(x, Fp8Copy)]


def test_fp8_weights_keep_the_bf16_copy_under_a_mesh_and_the_fp8_copy_on_one_device(tmp_path):
    """model.fp8=blockwise over fp32 master weights. FSDP on 2 devices: the FP8 GEMMs quantise
    each device's gathered weight, so the state keeps the bf16 compute copy of every weight and
    trains. One device: the state holds the stored E4M3 copies of the FP8 weights, and
    `loop.restore_state` quantises them again from the restored params, bitwise the copy the
    step wrote, from where training continues with the same loss."""
    sets = ("model.dtype=bfloat16", "model.fp8=blockwise")
    cfg2 = tiny_cfg("mesh.preset=fsdp", "mesh.fsdp=2", "mesh.devices=2", *sets)
    batches = synthetic_batches(cfg2, 3)
    par2, state, _, step2 = _setup(cfg2, 2, jnp.bfloat16)
    assert loop.fp8_copy_paths(init_model(cfg2)[0], par2) == frozenset() and not _fp8_copies(state)
    _assert_copy_is_the_cast(state, 2)
    for i in range(2):
        state, m = step2(state, loop.global_batch(par2, batches[i], 1))
        assert bool(m["finite"])
    _assert_copy_is_the_cast(state, 2)

    cfg1 = tiny_cfg("mesh.devices=1", *sets)
    par1, state, sh1, step1 = _setup(cfg1, 1, jnp.bfloat16)
    assert len(_fp8_copies(state)) == len(init_model(cfg1)[0].fp8_weight_paths()) > 0
    for i in range(2):
        state, _ = step1(state, loop.global_batch(par1, batches[i], 1))
    ck = Checkpointer(tmp_path / "ck1", CheckpointConfig(async_save=False))
    ck.save(2, checkpointed(state), {"pos": 2}, {})
    ck.close()
    _, fresh, _, _ = _setup(cfg1, 1, jnp.bfloat16)
    ck = Checkpointer(tmp_path / "ck1", CheckpointConfig(async_save=False), read_only=True)
    restored, _, at = loop.restore_state(ck, fresh, sh1, 2, jnp.bfloat16)
    ck.close()
    assert at == 2 and len(_fp8_copies(restored)) == len(_fp8_copies(state))
    for x, y in zip(jax.tree.leaves(restored[COPY_KEY]), jax.tree.leaves(state[COPY_KEY])):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    _, m_a = step1(state, loop.global_batch(par1, batches[2], 1))
    _, m_b = step1(restored, loop.global_batch(par1, batches[2], 1))
    assert float(m_a["loss"]) == float(m_b["loss"])
