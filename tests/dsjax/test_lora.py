"""LoRA and layered fine-tuning: config errors, fresh adapters leave the model unchanged, the
adapter model equals its merged weights, grouped-GEMM expert LoRA equals a per-expert einsum
reference (forward and gradients), adapter gradients follow the chain rule through the merged
weight, only trainable leaves reach the optimizer while frozen leaves (compute dtype) stay
bitwise unchanged, and accumulation with LoRA equals the larger batch."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsjax import config as C
from dsjax.model import abstract_model
from dsjax.model import lora as lora_mod
from dsjax.model.lora import expert_matmuls, merged_params, split_adapters
from dsjax.train import finetune, runs
from dsjax.train.optim import build_optimizer
from dsjax.train.step import make_train_step
from pallas_kernels.moe import grouped_lora_matmuls
from pallas_kernels.moe.lora import padded_rank

sys.path.insert(0, str(Path(__file__).parents[1]))
from _tiny import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = tiny_model(vocab=128, layers=2, heads=2, experts=4) + [
    "data.seq_len=16", "data.batch_size=4", "optim.warmup_steps=0", "optim.learning_rate=1e-2", "mesh.fsdp=1"]
LORA = ["lora.rank=4", "lora.alpha=8", "lora.target_modules=[all-linear, lm_head]"]


def cfg_of(*sets):
    return C.load(ROOT / "configs" / "tiny.yaml", TINY + list(sets))


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def batch_of(cfg, seed=0, rows=None):
    rng = np.random.default_rng(seed)
    B, T = rows or cfg.data.batch_size, cfg.data.seq_len
    toks = rng.integers(2, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
    mask = (rng.random((B, T)) < 0.7).astype(np.float32)  # a chat-like loss mask
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "loss_mask": mask,
            "segment_ids": np.ones((B, T), np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()}


def logits_of(fns, params, rest, toks):
    """The model's logits as one jitted program (run op by op, its many small ops would each
    compile on their own)."""
    return jax.jit(lambda p, r, t: fns.merge(p, r)(t)[0])(params, rest, toks)


def randomize_b(params, seed=1, scale=0.3):
    """Adapters with non-zero B (a trained adapter), so LoRA changes the model."""
    leaves, tdef = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [jax.random.normal(k, x.shape, x.dtype) * scale if str(p[-1].key) == "lora_B" else x
           for k, (p, x) in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(tdef, out)


@pytest.mark.parametrize("sets, needle", [
    (["lora.rank=4", "lora.target_modules=[q_projj]"], "lora.target_modules[0]='q_projj': expected one of"),
    (["lora.rank=4", "lora.target_modules=[q_proj]"], "lora.target_modules[0]='q_proj': this model has q_lora_rank"),
    (["lora.rank=4", "lora.target_modules=[o_proj, experts.up]"], "lora.target_modules[1]='experts.up'"),
    (["lora.rank=-1"], "lora.rank must be in [0, inf)"),
    (["lora.rank=4", "lora.dropout=1.0"], "lora.dropout must be in [0, 1)"),
    (["lora.modules_to_save=[lm_head]"], "lora.modules_to_save needs lora.rank > 0"),
    (["train.init_from=a", "train.init_from_hf=b"], "train.init_from and train.init_from_hf"),
])
def test_config_errors_name_the_field(sets, needle):
    with pytest.raises(C.ConfigError) as e:
        cfg_of(*sets)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_target_via_cli_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsjax.train", "--config", "configs/tiny.yaml", "--set",
                        "lora.rank=8", "--set", "lora.target_modules=[kv_proj]", "--set",
                        f"train.run_dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "lora.target_modules[0]='kv_proj'" in r.stderr and not (tmp_path / "run").exists()


def test_unmatched_freeze_pattern_is_an_error():
    cfg = cfg_of("lora.freeze=[embed_tokenz]")
    _, params, _ = finetune.init_model(cfg)
    with pytest.raises(ValueError, match=r"lora.freeze\[0\]='embed_tokenz' matches no parameter"):
        finetune.partition(cfg, params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fresh_adapters_give_the_base_logits_bitwise(dtype):
    cfg = cfg_of(*LORA, f"model.dtype={dtype}")
    base = cfg_of(f"model.dtype={dtype}")
    fns, params, rest = finetune.init_model(cfg)
    fb, pb, rb = finetune.init_model(base)
    b, ad = split_adapters(params)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.all(x == y)), b, pb))  # same base init
    n_a = sum(x.size for p, x in jax.tree_util.tree_flatten_with_path(ad)[0] if str(p[-1].key) == "lora_A")
    assert n_a > 0 and all(float(jnp.std(x)) > 0 for x in jax.tree.leaves(ad) if x.ndim and x.shape[-1] == 4)
    toks = jnp.asarray(batch_of(cfg)["inputs"])
    a = np.asarray(logits_of(fns, params, rest, toks))
    np.testing.assert_array_equal(a, np.asarray(logits_of(fb, pb, rb, toks)))


def test_adapter_model_equals_its_merged_weights():
    cfg = cfg_of(*LORA)
    fns, params, rest = finetune.init_model(cfg)
    params = randomize_b(params)
    toks = jnp.asarray(batch_of(cfg)["inputs"])
    ours = np.asarray(logits_of(fns, params, rest, toks))
    bf, _, _ = abstract_model(cfg.model)
    merged = np.asarray(logits_of(bf, merged_params(params, cfg.lora), rest, toks))
    base = np.asarray(logits_of(bf, split_adapters(params)[0], rest, toks))
    assert rel(base, merged) > 1e-2  # the adapters matter
    assert rel(ours, merged) < 1e-5


def _ref_gmm(x, w, gs):
    """Dense per-expert reference: the rows of group e times w[e] (a Python loop over experts)."""
    out = jnp.zeros((x.shape[0], w.shape[-1]), jnp.float32)
    start = 0
    for e, n in enumerate(np.asarray(gs)):
        out = out.at[start:start + n].set(jnp.einsum("md,dn->mn", x[start:start + n].astype(jnp.float32), w[e]))
        start += n
    return out


def _ref_delta(x, a, b, gs, scale):
    return _ref_gmm(x, jnp.einsum("edr,ern->edn", a, b) * scale, gs)


def test_grouped_expert_lora_matches_per_expert_reference():
    rng = np.random.default_rng(0)
    E, D, N, r, M = 5, 24, 40, 4, 70
    gs = jnp.asarray([17, 0, 21, 9, 20], jnp.int32)  # an empty group; 3 rows past the sum
    x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, D, N)) * 0.2, jnp.float32)
    a = jnp.asarray(rng.normal(size=(E, D, r)) * 0.3, jnp.float32)
    b = jnp.asarray(rng.normal(size=(E, r, N)) * 0.3, jnp.float32)
    cot = jnp.asarray(rng.normal(size=(M, N)), jnp.float32)
    s = 2.0

    def ref(x, w, a, b):
        return _ref_gmm(x, w, gs) + _ref_delta(x, a, b, gs, s)

    def ours(x, w, a, b):
        return expert_matmuls(x, (w,), ((a, b),), gs, s, "reference")[0]

    # each side jitted: one program instead of the reference loop's ops one by one
    y, y_ref = jax.jit(ours)(x, w, a, b), jax.jit(ref)(x, w, a, b)
    assert rel(y, y_ref) < 1e-6
    np.testing.assert_array_equal(np.asarray(y[67:]), 0)  # rows past the groups
    g = jax.jit(jax.grad(lambda *p: jnp.sum(ours(*p) * cot), argnums=(0, 1, 2, 3)))(x, w, a, b)
    g_ref = jax.jit(jax.grad(lambda *p: jnp.sum(ref(*p) * cot), argnums=(0, 1, 2, 3)))(x, w, a, b)
    for name, u, v in zip("xwab", g, g_ref):
        assert rel(u, v) < 1e-6, name
    # the adapter term alone (zero base weights), and in bf16 against the fp32 reference
    zero = lambda n: jnp.zeros((E, D, n), jnp.float32)  # noqa: E731
    d16, = grouped_lora_matmuls(x.astype(jnp.bfloat16), (zero(N).astype(jnp.bfloat16),), ((a, b),), gs,
                                scale=s, impl="reference")
    assert d16.dtype == jnp.bfloat16 and rel(d16, jax.jit(lambda *p: _ref_delta(*p, gs, s))(x, a, b)) < 2e-2
    # two adapters of different ranks sharing x (one x [A | A2] GEMM), and a projection with none
    a2 = jnp.asarray(rng.normal(size=(E, D, r + 3)) * 0.3, jnp.float32)
    b2 = jnp.asarray(rng.normal(size=(E, r + 3, N + 8)) * 0.3, jnp.float32)
    d1, d2, y3 = jax.jit(lambda *p: grouped_lora_matmuls(p[0], (zero(N), zero(N + 8), p[5]),
                                                         (p[1:3], p[3:5], None), gs, scale=s,
                                                         impl="reference"))(x, a, b, a2, b2, w)
    assert rel(d1, _ref_delta(x, a, b, gs, s)) < 1e-6 and rel(d2, _ref_delta(x, a2, b2, gs, s)) < 1e-6
    assert rel(y3, _ref_gmm(x, w, gs)) < 1e-6


def test_adapter_gradients_follow_the_chain_rule_of_the_merged_weight():
    """dL/dA = dL/dW' B^T s and dL/dB = A^T dL/dW' s, W' = W + A B s (a stacked MLA projection
    and the routed experts' up projection, per layer and per expert)."""
    cfg = cfg_of(*LORA)
    fns, params, rest = finetune.init_model(cfg)
    params = randomize_b(params)
    bf, _, _ = abstract_model(cfg.model)
    bt = batch_of(cfg)
    toks = jnp.asarray(bt["inputs"])
    cot = jnp.asarray(np.random.default_rng(3).normal(size=(4, 16, 128)), jnp.float32)
    s = cfg.lora.alpha / cfg.lora.rank
    g_lora = jax.jit(jax.grad(lambda p: jnp.sum(fns.merge(p, rest)(toks)[0] * cot)))(params)
    merged = merged_params(params, cfg.lora)
    g_w = jax.jit(jax.grad(lambda p: jnp.sum(bf.merge(p, rest)(toks)[0] * cot)))(merged)
    cases = [(("moe_layers", "self_attn", "kv_b_proj", "kernel"), ("moe_layers", "self_attn", "kv_b_proj", "lora")),
             (("moe_layers", "mlp", "up_proj"), ("moe_layers", "mlp", "experts", "up_proj")),
             (("lm_head", "kernel"), ("lm_head", "lora"))]
    get = lambda t, p: t if not p else get(t[p[0]], p[1:])  # noqa: E731
    for wp, ap in cases:
        dW = get(g_w, wp)
        A, B = get(params, ap)["lora_A"], get(params, ap)["lora_B"]
        dA, dB = get(g_lora, ap)["lora_A"], get(g_lora, ap)["lora_B"]
        assert float(jnp.max(jnp.abs(dA))) > 0
        assert rel(dA, jnp.einsum("...io,...ro->...ir", dW, B) * s) < 1e-4, wp
        assert rel(dB, jnp.einsum("...ir,...io->...ro", A, dW) * s) < 1e-4, wp


def test_dropout_masks_per_layer_same_scanned_and_unrolled():
    """lora.dropout=0.5 on stacks of 2 layers: the scanned stack (model.scan_layers) draws each
    layer's own masks, the same as the unrolled stack, so the adapter gradients agree; dropout is
    really on (the scanned stack's gradients under another dropout key differ; the key is an
    argument of the jitted gradient, so that is the same program run again)."""
    sets = LORA + ["model.num_hidden_layers=4", "model.first_k_dense_replace=2"]
    bt = batch_of(cfg_of(*sets))
    toks = jnp.asarray(bt["inputs"])
    cot = jnp.asarray(np.random.default_rng(4).normal(size=(4, 16, 128)), jnp.float32)
    key, key2 = lora_mod.dropout_keys(dataclasses.replace(cfg_of(*sets).lora, dropout=0.5), 0, 3, 2)
    out = {}
    for scan in (False, True):
        cfg = cfg_of(*sets, f"model.scan_layers={str(scan).lower()}", "lora.dropout=0.5")
        fns, params, rest = finetune.init_model(cfg)
        params = randomize_b(params)

        def loss(p, key, fns=fns, rest=rest):
            with lora_mod.dropout_rng(key):
                return jnp.sum(fns.merge(p, rest)(toks)[0] * cot)
        grad = jax.jit(jax.grad(loss))
        out[scan] = params, grad(params, key)
        if scan:
            g_2 = grad(params, key2)
    (p_u, g_u), (p_s, g_s) = out[False], out[True]
    assert not np.array_equal(np.asarray(key), np.asarray(key2))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p_u), jax.tree.leaves(p_s)))
    _, ad_u = split_adapters(g_u)
    _, ad_s = split_adapters(g_s)
    _, ad_2 = split_adapters(g_2)
    for (path, a), b, c in zip(jax.tree_util.tree_flatten_with_path(ad_u)[0], jax.tree.leaves(ad_s), jax.tree.leaves(ad_2)):
        assert float(jnp.max(jnp.abs(a))) > 0, path
        assert rel(b, a) < 1e-5, path
        assert rel(c, a) > 1e-2, path


def _mu_paths(opt):
    mu = [x.mu for x in jax.tree.leaves(opt, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(x, "mu")][0]
    return {tuple(str(k.key) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(mu)[0]}


def _paths(tree):
    return {tuple(str(k.key) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("sets", [
    LORA + ["lora.modules_to_save=[lm_head]", "model.dtype=bfloat16"],
    ["lora.freeze=[embed_tokens, dense_layers, '*.self_attn.*']", "model.dtype=bfloat16"],
])
def test_optimizer_sees_only_trainable_leaves_and_frozen_stay_bitwise(sets):
    cfg = cfg_of(*sets)
    fns, params, rest = finetune.init_model(cfg)
    tx, sch = build_optimizer(cfg.optim, 3)
    state = runs.make_state(cfg, params, rest, tx)
    train_p, frozen_p = _paths(state["params"]), _paths(state["frozen"])
    assert train_p and frozen_p and not train_p & frozen_p and train_p | frozen_p == _paths(params)
    assert _mu_paths(state["opt"]) == train_p
    if cfg.lora.rank:
        assert all(p[-1] in ("lora_A", "lora_B") or p[0] == "lm_head" for p in train_p)
        assert ("lm_head", "kernel") in train_p
    else:
        assert not any(p[0] in ("embed_tokens", "dense_layers") or "self_attn" in p for p in train_p)
    for p, x in jax.tree_util.tree_flatten_with_path(state["frozen"])[0]:
        want = jnp.float32 if str(p[-1].key) == "gate" else jnp.bfloat16
        assert x.dtype == want, p
    frozen0 = jax.tree.map(np.asarray, state["frozen"])
    train0 = jax.tree.map(np.asarray, state["params"])
    step = jax.jit(make_train_step(cfg, fns, tx, sch))
    for i in range(2):
        state, m = step(state, jax.tree.map(lambda v: jnp.asarray(v)[None], batch_of(cfg, i)))
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(frozen0), jax.tree.leaves(state["frozen"])))
    assert all(not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(train0), jax.tree.leaves(state["params"])))
    groups = {k for k in m if k.startswith("grad_norm/")}
    if cfg.lora.rank:
        assert {"grad_norm/adapters", "grad_norm/adapters/attn_q", "grad_norm/adapters/attn_kv",
                "grad_norm/adapters/attn_o", "grad_norm/adapters/routed_experts", "grad_norm/lm_head",
                "grad_norm/adapters/shared_experts", "grad_norm/adapters/dense_mlp"} <= groups
    else:
        assert {"grad_norm/routed_experts", "grad_norm/router", "grad_norm/lm_head"} <= groups
        assert "grad_norm/embed" not in groups and "grad_norm/attn_q" not in groups
    sq = sum(float(m[k]) ** 2 for k in groups if not k.startswith("grad_norm/adapters/"))
    np.testing.assert_allclose(np.sqrt(sq), float(m["grad_norm"]), rtol=1e-5)
    bt = batch_of(cfg, 1)
    assert float(m["tokens_trained"]) == bt["loss_mask"].sum()
    assert float(m["tokens_masked"]) == bt["loss_mask"].size - bt["loss_mask"].sum()


def test_accumulation_with_lora_equals_the_larger_batch():
    """train.grad_accum=2 over B/2 rows equals one micro-batch of B rows (fp32, LoRA + dropout 0)."""
    one = cfg_of(*LORA, "data.batch_size=8", "train.grad_accum=1")
    two = cfg_of(*LORA, "data.batch_size=4", "train.grad_accum=2")
    bt = batch_of(one, 5, rows=8)
    out = []
    for cfg, A in ((one, 1), (two, 2)):
        fns, params, rest = finetune.init_model(cfg)
        params = randomize_b(params)
        tx, sch = build_optimizer(cfg.optim, 3)
        state = runs.make_state(cfg, params, rest, tx)
        batch = {k: jnp.asarray(v).reshape(A, 8 // A, *v.shape[1:]) for k, v in bt.items()}
        state, m = jax.jit(make_train_step(cfg, fns, tx, sch))(state, batch)
        mu = [x.mu for x in jax.tree.leaves(state["opt"], is_leaf=lambda x: hasattr(x, "mu"))
              if hasattr(x, "mu")][0]  # (1 - b1) x the clipped gradient
        out.append((m, mu))
    (m1, g1), (m2, g2) = out
    np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-5)
    assert float(m1["grad_norm/adapters/routed_experts"]) > 0
    for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g2)):
        assert rel(b, a) < 1e-4, p  # fp32 rounding of sums over other micro-batches


def test_expert_lora_through_the_pallas_kernels_matches_reference():
    """impl='pallas' (Mosaic GPU kernels; GPU interpret mode without a Hopper GPU): two
    projections of the same rows (gate and up) with rank-16 adapters, whose A factors the
    kernels run as one x [A_g | A_u] GEMM zero-padded to width 128 and whose B factors sit at
    their own rows of a zero-padded block: bf16 forward and gradients vs the fp32 per-expert
    reference at rank 16, an empty expert included."""
    E, D, N, r, M = 4, 128, 128, 16, 128
    k = jax.random.split(jax.random.key(4), 8)
    gs = jnp.asarray([50, 0, 45, 33], jnp.int32)
    x = jax.random.normal(k[0], (M, D)).astype(jnp.bfloat16)
    w, w2 = [(jax.random.normal(kk, (E, D, N)) / 12).astype(jnp.bfloat16) for kk in k[1:3]]
    a, a2 = [(jax.random.normal(kk, (E, D, r)) / 12).astype(jnp.bfloat16) for kk in k[3:5]]
    b, b2 = [(jax.random.normal(kk, (E, r, N)) / 12).astype(jnp.bfloat16) for kk in k[5:7]]
    cot = jax.random.normal(k[7], (2, M, N)).astype(jnp.bfloat16)
    f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
    assert padded_rank(x, a, b, "pallas") == 128 and padded_rank(x, a, b, "reference") == 16

    def ours(x, w, w2, a, b, a2, b2):
        return jnp.stack(expert_matmuls(x, (w, w2), ((a, b), (a2, b2)), gs, 0.5, "pallas"))

    def ref(x, w, w2, a, b, a2, b2):
        return jnp.stack([_ref_gmm(x, w, gs) + _ref_delta(x, a, b, gs, 0.5),
                          _ref_gmm(x, w2, gs) + _ref_delta(x, a2, b2, gs, 0.5)])
    args = (x, w, w2, a, b, a2, b2)
    out, vjp = jax.vjp(ours, *args)
    out_r, vjp_r = jax.vjp(ref, *map(f32, args))
    assert out.dtype == jnp.bfloat16 and rel(f32(out), out_r) < 1e-2
    for name, g, g_r in zip(("x", "w", "w2", "a", "b", "a2", "b2"), vjp(cot), vjp_r(f32(cot))):
        assert g.shape == g_r.shape and rel(f32(g), g_r) < 2e-2, name


def test_expert_lora_wide_ranks_and_constant_input():
    """grouped_lora_matmuls where the kernels cannot take the fused extra contraction (two
    rank-128 adapters: t is 256 wide, past their shared memory) runs t B as its own GEMM, and
    with x constant (only A and B differentiated, as in a run's first adapted layer) the
    gradients are A's and B's alone; both against the fp32 per-expert reference, kernels in
    interpret mode."""
    from pallas_kernels.moe import grouped_lora_matmuls
    E, D, N, M = 3, 128, 128, 128
    k = jax.random.split(jax.random.key(7), 8)
    gs = jnp.asarray([60, 0, 50], jnp.int32)
    x = jax.random.normal(k[0], (M, D)).astype(jnp.bfloat16)
    w, w2 = [(jax.random.normal(kk, (E, D, N)) / 12).astype(jnp.bfloat16) for kk in k[1:3]]
    f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
    cot = jax.random.normal(k[7], (2, M, N)).astype(jnp.bfloat16)
    for r in (128, 16):  # 2 x 128: not fused; 2 x 16: fused
        a, a2 = [(jax.random.normal(kk, (E, D, r)) / 12).astype(jnp.bfloat16) for kk in k[3:5]]
        b, b2 = [(jax.random.normal(kk, (E, r, N)) / 12).astype(jnp.bfloat16) for kk in k[5:7]]

        def ours(a, b, a2, b2):
            return jnp.stack(grouped_lora_matmuls(x, (w, w2), ((a, b), (a2, b2)), gs, scale=0.5,
                                                  impl="pallas"))

        def ref(a, b, a2, b2):
            return jnp.stack([_ref_gmm(f32(x), f32(w), gs) + _ref_delta(f32(x), a, b, gs, 0.5),
                              _ref_gmm(f32(x), f32(w2), gs) + _ref_delta(f32(x), a2, b2, gs, 0.5)])
        # each side jitted: one program, not the reference loop's ops one by one
        out, vjp = jax.vjp(jax.jit(ours), a, b, a2, b2)
        out_r, vjp_r = jax.vjp(jax.jit(ref), *map(f32, (a, b, a2, b2)))
        assert rel(f32(out), out_r) < 1e-2, r
        for name, g, g_r in zip(("a", "b", "a2", "b2"), vjp(cot), vjp_r(f32(cot))):
            assert rel(f32(g), g_r) < 2e-2, (r, name)


def test_moe_recompute_gives_the_same_gradients():
    """model.moe_recompute (the routed block keeps its GEMM outputs and recomputes the token
    permutation and SwiGLU in the backward): logits and the gradients of every weight, base and
    adapters, bitwise equal to those without it (fp32), with the layers scanned (one MoE layer:
    a scan of length 1 still stacks its residuals)."""
    toks = jnp.asarray(np.random.default_rng(0).integers(2, 128, (2, 16)), jnp.int32)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(2, 16, 128)), jnp.float32)
    out = []
    for flag in ("false", "true"):
        cfg = cfg_of(*LORA, "model.num_hidden_layers=2", f"model.moe_recompute={flag}",
                     "model.scan_layers=true")
        fns, params, rest = finetune.init_model(cfg)

        def loss(p, fns=fns, rest=rest):
            logits = fns.merge(p, rest)(toks)[0]
            return jnp.sum(logits * cot), logits
        text = str(jax.make_jaxpr(loss)(params))
        assert ("SaveOnlyTheseNames" in text) == (flag == "true")  # the routed block under jax.checkpoint
        out.append(jax.jit(jax.value_and_grad(loss, has_aux=True))(randomize_b(params)))
    ((_, lg1), g1), ((_, lg2), g2) = out
    np.testing.assert_array_equal(np.asarray(lg1), np.asarray(lg2))
    for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(g1)[0], jax.tree.leaves(g2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
    assert float(jnp.max(jnp.abs(g1["moe_layers"]["mlp"]["gate_proj"]))) > 0


# modules_to_save: lm_head, and the MoE layer's o_proj, which also has an adapter, beside adapters
# on the attention projections (the MLP and routed-expert targets: test_hf_convert.py's export
# of the demo's targets, and the partial-expert test below).
SAVE = ["lora.rank=4", "lora.alpha=8", "lora.target_modules=[q_a_proj, q_b_proj, kv_a_proj_with_mqa, "
        "kv_b_proj, o_proj]", "lora.modules_to_save=[lm_head, moe_layers.self_attn.o_proj]"]
SAVED_O = "model.layers.1.self_attn.o_proj"


def _trained_with_saved_modules(tmp_path):
    """A 'trained' LoRA run of SAVE (random B, lm_head and the MoE layer's o_proj moved off their
    init) and its base weights; writes base/ (HF, the base run), merged/ (`--to-hf`'s merged
    export) and adapter/ (`save_adapters`) under tmp_path."""
    from dsjax.hf import save_hf
    from dsjax.hf.adapters import save_adapters
    cfg = cfg_of(*SAVE)
    fns, params, rest = finetune.init_model(cfg)
    base0 = split_adapters(params)[0]
    params = randomize_b(params)
    k1, k2 = jax.random.split(jax.random.key(11))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] + 0.5 * jax.random.normal(k1, params["lm_head"]["kernel"].shape)
    sd = params["moe_layers"]["self_attn"]["o_proj"]
    sd["kernel"] = sd["kernel"] + 0.5 * jax.random.normal(k2, sd["kernel"].shape)
    save_hf(tmp_path / "base", cfg.model, base0, rest, dtype="float32")
    save_hf(tmp_path / "merged", cfg.model, merged_params(params, cfg.lora), rest, dtype="float32")
    save_adapters(tmp_path / "adapter", cfg.model, cfg.lora, params, rest, dtype="float32")
    return cfg, fns, params, rest


def test_adapter_file_carries_modules_to_save_as_peft_names_them(tmp_path):
    """PEFT's save_pretrained writes a modules_to_save module's trained copy under its plain key
    (`base_model.model.lm_head.weight`): ours holds the merged export's weight there, the MoE
    layer's o_proj with its adapter folded in (and no adapter of its own), and lists both modules."""
    import json
    from safetensors.numpy import load_file
    cfg, _, params, _ = _trained_with_saved_modules(tmp_path)
    ad = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    merged = {}
    for f in (tmp_path / "merged").glob("*.safetensors"):
        merged.update(load_file(str(f)))
    assert conf["modules_to_save"] == ["lm_head", SAVED_O]
    head, o = ad["base_model.model.lm_head.weight"], ad[f"base_model.model.{SAVED_O}.weight"]
    np.testing.assert_array_equal(head, np.asarray(params["lm_head"]["kernel"]).T)
    np.testing.assert_array_equal(head, merged["lm_head.weight"])
    assert rel(o, merged[f"{SAVED_O}.weight"]) < 1e-6
    assert rel(o, np.asarray(params["moe_layers"]["self_attn"]["o_proj"]["kernel"][0]).T) > 1e-2  # adapter folded in
    assert f"base_model.model.{SAVED_O}.lora_A.weight" not in ad
    assert "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight" in ad
    assert not any("embed_tokens" in k or "mlp" in k for k in ad)  # frozen, untargeted: not saved
    assert len(ad) == 2 * (2 * 5 - 1) + 2


def test_peft_loads_our_adapter_file_with_modules_to_save(tmp_path):
    """HF transformers + PEFT (`PeftModel.from_pretrained` on the base model) reproduce the
    logits of our LoRA model whose lm_head and one o_proj (adapter included) trained in full."""
    import peft  # the test extra: a missing peft fails loudly, never skips
    import torch
    sys.path.insert(0, str(Path(__file__).parent))
    import hf_parity as P
    cfg, fns, params, rest = _trained_with_saved_modules(tmp_path)
    toks = np.random.default_rng(2).integers(2, cfg.model.vocab_size, (2, 16))
    ours = np.asarray(logits_of(fns, params, rest, jnp.asarray(toks, jnp.int32)))
    with torch.no_grad():
        base = P.load_eager(tmp_path / "base")
        t = torch.as_tensor(toks, dtype=torch.long)
        plain = base(t).logits.float().numpy()
        model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        theirs = model(t).logits.float().numpy()
    assert rel(plain, ours) > 1e-2  # the adapters and the saved modules matter
    assert rel(theirs, ours) < 1e-5


def test_peft_loads_partial_expert_targets_and_logs_what_it_leaves_out(tmp_path, caplog):
    """Routed experts adapted on gate_proj only (zero up_proj / down_proj adapters are written,
    as PEFT 0.21 on transformers 5 maps the fused expert keys only for all three) and the dense
    and shared-expert MLPs' down_proj (`target_parameters` weights): PEFT's model gives ours. Routed-expert
    weights trained in full are left out of the adapter with a warning naming them."""
    import json
    import logging
    import peft
    import torch
    from safetensors.numpy import load_file
    from dsjax.hf import save_hf
    from dsjax.hf.adapters import save_adapters
    sys.path.insert(0, str(Path(__file__).parent))
    import hf_parity as P
    cfg = cfg_of("lora.rank=4", "lora.alpha=8", "lora.dropout=0.1",
                 "lora.target_modules=[experts.gate_proj, down_proj]")
    fns, params, rest = finetune.init_model(cfg)
    base0 = split_adapters(params)[0]
    params = randomize_b(params)
    save_hf(tmp_path / "base", cfg.model, base0, rest, dtype="float32")
    with caplog.at_level(logging.INFO, logger="dsjax.hf"):
        save_adapters(tmp_path / "adapter", cfg.model, cfg.lora, params, rest, dtype="float32")
    assert "lora_dropout 0 (the run trained with lora.dropout=0.1" in caplog.text
    ad = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["target_parameters"] == ["model.layers.0.mlp.down_proj.weight",
                                         "model.layers.1.mlp.shared_experts.down_proj.weight"]
    E = cfg.model.n_routed_experts
    assert len(ad) == 2 * (3 * E + 2)
    up = "base_model.model.model.layers.1.mlp.experts.2.up_proj.lora_B.weight"
    assert not ad[up].any() and ad[up.replace("up_proj", "gate_proj")].any()
    toks = np.random.default_rng(3).integers(2, cfg.model.vocab_size, (2, 16))
    ours = np.asarray(logits_of(fns, params, rest, jnp.asarray(toks, jnp.int32)))
    with torch.no_grad():
        t = torch.as_tensor(toks, dtype=torch.long)
        base = P.load_eager(tmp_path / "base")
        plain = base(t).logits.float().numpy()
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(t).logits.float().numpy()
    assert rel(plain, ours) > 1e-2 and rel(theirs, ours) < 1e-5

    cfg = cfg_of("lora.rank=4", "lora.alpha=8", "lora.target_modules=[q_b_proj]",
                 "lora.modules_to_save=[moe_layers.mlp.down_proj]")
    _, params, rest = finetune.init_model(cfg)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsjax.hf"):
        save_adapters(tmp_path / "left_out", cfg.model, cfg.lora, params, rest)
    assert (f"{E} routed-expert weight(s) trained in full (lora.modules_to_save, e.g. "
            "model.layers.1.mlp.experts.0.down_proj.weight) are not in") in caplog.text
    ad = load_file(str(tmp_path / "left_out" / "adapter_model.safetensors"))
    assert not any("experts" in k for k in ad) and len(ad) == 2 * 2
