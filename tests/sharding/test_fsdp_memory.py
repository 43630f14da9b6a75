"""Under fsdp=8 each device holds 1/8 of the parameters and of the Adam moments, measured from
the arrays' addressable shards; rules errors are clear."""
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sharding_common import adam_mu, cached_run  # noqa: E402

from sharding.mesh import MeshError, make_mesh, resolve_axis_sizes  # noqa: E402
from sharding.rules import ShardingRuleError, get_rules  # noqa: E402


def _bytes_on(tree, device):
    total = held = 0
    for x in jax.tree.leaves(tree):
        total += x.size * x.dtype.itemsize
        held += sum(s.data.size * s.data.dtype.itemsize for s in x.addressable_shards if s.device == device)
    return held, total


def test_fsdp8_each_device_holds_one_eighth():
    _, _, _, par, state = cached_run("fsdp=8", ["mesh.preset=fsdp", "mesh.fsdp=8"])
    opt = [x for x in jax.tree.leaves(state["opt"], is_leaf=lambda x: hasattr(x, "mu")) if hasattr(x, "mu")][0]
    for name, tree in (("params", state["params"]), ("adam mu", opt.mu), ("adam nu", opt.nu)):
        for d in jax.devices():
            held, total = _bytes_on(tree, d)
            assert held * 8 == total, (name, d, held, total)
        print(f"\n{name}: device 0 holds {held} of {total} bytes = {held / total:.4f}")
    assert adam_mu(state["opt"]) is opt.mu


def test_mesh_fill_and_errors():
    assert resolve_axis_sizes(dict(data=2, fsdp=-1, expert=1, context=1, tensor=2), 8)["fsdp"] == 2
    with pytest.raises(MeshError, match="only one axis"):
        resolve_axis_sizes(dict(data=-1, fsdp=-1, expert=1, context=1, tensor=1), 8)
    with pytest.raises(MeshError, match="not divisible"):
        resolve_axis_sizes(dict(data=3, fsdp=-1, expert=1, context=1, tensor=1), 8)


def test_rules_collision_divisibility_and_unused_axis():
    class M:
        data, fsdp, expert, tensor, context = 1, 2, 1, 4, 1
    mesh = make_mesh(M)
    tp = get_rules("tp")
    assert tp.spec(("layers", "embed", "mlp"), (2, 32, 64), mesh, param=True) == \
        jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    with pytest.raises(ShardingRuleError, match="both 'heads' and 'mlp'"):
        tp.spec(("heads", "mlp"), (8, 8), mesh)
    with pytest.raises(ShardingRuleError, match="size 6 is not divisible by mesh tensor=4"):
        tp.spec(("embed", "mlp"), (32, 6), mesh, where="w")
    with pytest.raises(ShardingRuleError, match="not used by preset 'fsdp'"):
        get_rules("fsdp").check_mesh(mesh)
    with pytest.raises(ShardingRuleError, match="unknown preset"):
        get_rules("zero9")
    assert np.prod(list(mesh.shape.values())) == 8


def test_plan_compiled_arguments_match_sharding_derived_bytes():
    from dsjax.plan import compile_memory
    from sharding_common import tiny_cfg

    cfg = tiny_cfg("mesh.preset=fsdp", "mesh.fsdp=8")
    m = compile_memory(cfg, 8)
    derived = m["params"] + m["optimizer"] + m["compute_copy"] + m["rest"] + m["batch"]
    print(f"\nplan (tiny, fsdp=8): {m}")
    assert m["argument"] == derived
    assert m["temp"] > 0 and m["alias"] > 0
