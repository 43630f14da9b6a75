"""Every parallel layout gives the 1-device loss and gradients (fp32, 3 training steps), also
with LoRA adapters on every projection, the routed experts (per expert, through the grouped
GEMM and expert parallelism) and lm_head, the base weights frozen."""
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sharding_common import cached_run, run_layout, tiny_cfg  # noqa: E402

LAYOUTS = {
    "fsdp=8": ["mesh.preset=fsdp", "mesh.fsdp=8"],
    "data=2 x fsdp=4": ["mesh.preset=fsdp", "mesh.data=2", "mesh.fsdp=4"],
    "fsdp=2 x tensor=2 x expert=2": ["mesh.preset=fsdp_tp_ep", "mesh.fsdp=2", "mesh.tensor=2",
                                     "mesh.expert=2"],
    "context=4 (ring attention)": ["mesh.preset=cp", "mesh.fsdp=2", "mesh.context=4"],
    "expert=8, 8 experts": ["mesh.preset=ep", "mesh.fsdp=1", "mesh.expert=8"],
}


@pytest.fixture(scope="module")
def baseline():
    cfg = tiny_cfg("mesh.fsdp=1")
    return run_layout(cfg, devices=jax.devices()[:1])


def _max_err(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_device(baseline, name):
    l0, g0, p0, _, _ = baseline
    l1, g1, p1, par, _ = cached_run(name, LAYOUTS[name])  # fsdp=8: shared with the other files' tests
    assert par.mesh.size == 8
    loss_err = max(abs(a - b) for a, b in zip(l0, l1))
    grad_err = max(_max_err(a, b) for a, b in zip(g0, g1))
    gscale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(g0[0]))
    print(f"\n{name}: losses {l1} max|loss err| {loss_err:.2e} max|grad err| {grad_err:.2e} "
          f"(max|grad| {gscale:.2e}) max|param err| {_max_err(p0, p1):.2e}")
    assert loss_err < 1e-5
    assert grad_err < 1e-5


# LoRA (rank 4, all-linear + lm_head, base frozen) under the two presets that together shard over
# every axis: ZeRO-3, tensor and expert parallelism ("all"), and ring attention with experts; and
# under plain data parallelism ("dp": every weight and adapter replicated, the batch split)
LORA = ["lora.rank=4", "lora.alpha=8", "lora.target_modules=[all-linear, lm_head]"]
LORA_LAYOUTS = {
    "dp: data=8": ["mesh.preset=dp", "mesh.fsdp=1", "mesh.data=8"],
    "all: fsdp=2 x tensor=2 x expert=2": ["mesh.preset=all", "mesh.fsdp=2", "mesh.tensor=2", "mesh.expert=2"],
    "fsdp_ep_cp: expert=2 x context=4": ["mesh.preset=fsdp_ep_cp", "mesh.fsdp=1", "mesh.expert=2",
                                         "mesh.context=4"],
}


@pytest.fixture(scope="module")
def lora_baseline():
    return run_layout(tiny_cfg("mesh.fsdp=1", *LORA), devices=jax.devices()[:1])


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_layout_matches_one_device(lora_baseline, name):
    l0, g0, p0, _, s0 = lora_baseline
    l1, g1, p1, par, s1 = run_layout(tiny_cfg(*LORA_LAYOUTS[name], *LORA))
    assert par.mesh.size == 8 and "frozen" in s1
    assert all(str(p[-1].key) in ("lora_A", "lora_B") for p, _ in jax.tree_util.tree_flatten_with_path(p1)[0])
    loss_err = max(abs(a - b) for a, b in zip(l0, l1))
    grad_err = max(_max_err(a, b) for a, b in zip(g0, g1))
    print(f"\nLoRA {name}: losses {l1} max|loss err| {loss_err:.2e} max|grad err| {grad_err:.2e} "
          f"max|param err| {_max_err(p0, p1):.2e}")
    assert loss_err < 1e-5
    assert grad_err < 1e-5
    assert _max_err(jax.device_get(s0["frozen"]), jax.device_get(s1["frozen"])) == 0.0
