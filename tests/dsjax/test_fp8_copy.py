"""The train state's stored E4M3 copy (model.fp8=blockwise over fp32 master weights, one device):
`compute_copy(fp8_paths=...)` holds `Fp8Copy` for exactly the weights an FP8 GEMM consumes and
the step reads it instead of quantising the bf16 cast.

Against the step that quantises the bf16 cast every step: from master weights that are bf16
values (the cast is then exact, so both quantise the same numbers) the first step is bitwise the
same (metrics, params, moments). Later the copy quantises the fp32 master itself: a block's scale
is amax / 448 of the fp32 values instead of the bf16-rounded ones (a relative change below
2^-9), and an element whose bf16 rounding crossed an E4M3 rounding boundary moves by one E4M3
unit (2^-3 relative; the fraction of such elements is about bf16's unit over E4M3's, 2^-4 of
them at most). The GEMMs' outputs then differ by ~2^-9 relative plus that sparse noise, which
averages out in the loss: we allow 1e-2 relative on losses and gradient norms (measured 1e-4).
Adam moves each weight by at most ~lr per step whatever the gradient, so two runs' weights
differ by at most 2 x the summed lr (times Adam's ratio |m| / sqrt(v) <= (1 - b1) /
sqrt(1 - b2) per step's gradient; we use 3 x 2 x sum lr), which we assert on every weight."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax import config as C
from dsjax.train.optim import build_optimizer
from dsjax.train.step import (COPY_KEY, compute_copy, copied_fp8_paths, init_model, init_state,
                              make_train_step)
from pallas_kernels.fp8.api import fp8_copy
from pallas_kernels.fp8.stored import Fp8Copy

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, *extra):
    return C.load(ROOT / "configs" / "tiny.yaml", [
        "data.seq_len=16", "data.batch_size=4", "model.vocab_size=256", "model.hidden_size=32",
        "model.num_hidden_layers=2", "model.dtype=bfloat16", "model.fp8=blockwise",
        f"train.run_dir={tmp_path}/run", *extra])


def _batch(cfg, seed):
    B, T = cfg.data.batch_size, cfg.data.seq_len
    toks = np.random.default_rng(seed).integers(0, cfg.model.vocab_size, size=(1, B, T + 1))
    return {"inputs": jnp.asarray(toks[..., :-1], jnp.int32), "targets": jnp.asarray(toks[..., 1:], jnp.int32),
            "loss_mask": jnp.ones((1, B, T)), "segment_ids": jnp.ones((1, B, T), jnp.int32),
            "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (1, B, T))}


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def _paths(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(str(k.key) for k in p) for p, _ in flat}


def test_the_fp8_weights_are_the_linears_and_the_expert_stacks(tmp_path):
    fns, p, _ = init_model(_cfg(tmp_path, "model.num_nextn_predict_layers=1"))
    paths = fns.fp8_weight_paths()
    assert paths <= _paths(p)
    assert all(x[-1] == "kernel" or x[-1] in ("gate_proj", "up_proj", "down_proj") for x in paths)
    assert any(x[0] == "mtp" for x in paths)  # the MTP block's linears and experts too
    assert not any(x[0] in ("lm_head", "embed_tokens") or x[-1] in ("gate", "weight", "bias") for x in paths)
    assert ("moe_layers", "mlp", "up_proj") in paths
    assert ("dense_layers", "self_attn", "q_a_proj", "kernel") in paths
    assert init_model(_cfg(tmp_path, "model.fp8=none"))[0].fp8_weight_paths() == frozenset()


@pytest.mark.parametrize("scan", [False, True])
def test_the_stored_fp8_copy_tracks_the_run_that_quantises_the_cast(tmp_path, scan):
    cfg = _cfg(tmp_path, f"model.scan_layers={str(scan).lower()}")
    fns, p, r = init_model(cfg)
    # bf16 values in the fp32 master weights: step 1 quantises the same numbers in both runs
    p = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), p)
    paths = fns.fp8_weight_paths()
    tx, sched = build_optimizer(cfg.optim, 10)
    step = jax.jit(make_train_step(cfg, fns, tx, sched))
    a = init_state(p, r, tx, compute_dtype=jnp.bfloat16)
    b = init_state(p, r, tx, compute_dtype=jnp.bfloat16, fp8_paths=paths)
    assert copied_fp8_paths(b[COPY_KEY]) == paths and copied_fp8_paths(a[COPY_KEY]) == frozenset()
    # the other copies are the bf16 casts, as without fp8_paths
    cast = jax.tree.map(lambda c, x: None if isinstance(c, Fp8Copy) else x, b[COPY_KEY], a[COPY_KEY],
                        is_leaf=lambda x: x is None or isinstance(x, Fp8Copy))
    _same(jax.tree.leaves(cast), [x for x in jax.tree.leaves(b[COPY_KEY], is_leaf=lambda x: isinstance(x, Fp8Copy))
                                  if not isinstance(x, Fp8Copy)])
    lr_sum = 0.0
    for i in range(4):
        lr_sum += float(sched(a["step"]))
        a, ma = step(a, _batch(cfg, i))
        b, mb = step(b, _batch(cfg, i))
        if i == 0:
            _same(ma, mb)
            for k in ("params", "opt", "rest"):
                _same(a[k], b[k])
        else:
            for k in ("loss", "grad_norm"):
                assert abs(float(ma[k]) - float(mb[k])) <= 1e-2 * abs(float(ma[k])), (i, k, ma[k], mb[k])
        assert bool(mb["finite"])
        for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
            assert float(jnp.max(jnp.abs(x - y))) <= 6 * lr_sum, i
    # the copy the step wrote is the quantised updated master weights, bitwise (as XLA compiles
    # the quantisation: eager op-by-op execution rounds a few scales differently)
    _same(jax.jit(lambda q: compute_copy(q, jnp.bfloat16, paths))(b["params"]), b[COPY_KEY])
    up = b["params"]["moe_layers"]["mlp"]["up_proj"]
    got, want = b[COPY_KEY]["moe_layers"]["mlp"]["up_proj"], jax.jit(fp8_copy)(up)
    _same((got.q, got.s, got.qt), (want.q, want.s, want.qt))
    assert got.q.dtype == jnp.float8_e4m3fn and got.q.shape == up.shape  # reference: unpadded
