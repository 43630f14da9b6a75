"""Model maths: shapes and dtypes, routers on hand-checked cases, RoPE/YaRN values, balancing
statistics with padding, remat, latent-cache decode."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dsjax  # noqa: F401  (flax config)
from dsjax import config as C
from dsjax.model import DeepSeekModel
from dsjax.model.moe import MoE, route, update_router_bias
from dsjax.model.rope import apply_rope, inv_freq_and_attention_factor, rope_cos_sin, softmax_scale

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=12,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8,
             n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
             first_k_dense_replace=1, routed_scaling_factor=2.5)


def small_cfg(**kw):
    return C.ModelConfig(**{**SMALL, **kw})


def logit(p):
    p = np.asarray(p, np.float64)
    return jnp.asarray(np.log(p / (1 - p)), jnp.float32)


# ---------------------------------------------------------------- shapes and dtypes
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_lora", [None, 16])
def test_shapes_and_dtypes(dtype, q_lora):
    cfg = small_cfg(dtype=dtype, q_lora_rank=q_lora)
    m = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    toks = jax.random.randint(jax.random.key(1), (2, 10), 0, cfg.vocab_size)
    logits, aux = m(toks)
    assert logits.shape == (2, 10, cfg.vocab_size) and logits.dtype == jnp.float32
    assert aux["expert_counts"].shape == (2, 8) and aux["expert_counts"].dtype == jnp.float32
    # every real token is routed to K experts in each MoE layer
    np.testing.assert_allclose(np.asarray(aux["expert_counts"]).sum(-1), 2 * 10 * 2)
    params = nnx.state(m, nnx.Param)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert m.moe_layers.mlp.gate_proj[...].shape == (2, 8, 32, 16)  # [L_moe, E, D, F]
    assert (m.dense_layers.self_attn.q_proj is None) == (q_lora is not None)


# ---------------------------------------------------------------- routers
def test_noaux_tc_group_top2_sum_and_bias_for_choice_only():
    cfg = small_cfg(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                    routed_scaling_factor=2.5)
    s = [0.9, 0.1, 0.2, 0.3, 0.8, 0.7, 0.02, 0.85]
    # group top-2 sums: g0 1.0, g1 0.5, g2 1.5, g3 0.87 -> keep g2, g0 -> experts 0 and 4
    # (group *max* would keep g0, g3 and pick expert 7)
    ids, w, scores = route(logit([s]), jnp.zeros(8), cfg)
    assert sorted(np.asarray(ids[0]).tolist()) == [0, 4]
    np.testing.assert_allclose(np.sort(np.asarray(w[0])), np.sort(np.array([0.9, 0.8]) / 1.7 * 2.5), rtol=1e-6)
    # a +0.5 bias on expert 7 makes g3 (1.37) beat g0 (1.0): choose 7 and 4, weights from unbiased scores
    bias = jnp.zeros(8).at[7].set(0.5)
    ids, w, _ = route(logit([s]), bias, cfg)
    order = np.argsort(np.asarray(ids[0]))
    assert np.asarray(ids[0])[order].tolist() == [4, 7]
    np.testing.assert_allclose(np.asarray(w[0])[order], np.array([0.8, 0.85]) / 1.65 * 2.5, rtol=1e-6)


def test_noaux_tc_negative_bias_never_picks_excluded_groups():
    # case 11: biased scores below zero; masking excluded groups with 0 would pick them
    cfg = small_cfg(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 0.95, size=(64, 8))
    bias = jnp.full((8,), -3.0)
    ids, _, _ = route(logit(p), bias, cfg)
    sums = np.sort(p.reshape(64, 4, 2), axis=-1)[..., -2:].sum(-1)
    kept = np.argsort(-sums, axis=-1)[:, :2]
    for t in range(64):
        assert set((np.asarray(ids[t]) // 2).tolist()) <= set(kept[t].tolist())


def test_softmax_greedy():
    cfg = small_cfg(n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2,
                    topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
                    routed_scaling_factor=1.5)
    logits = jnp.log(jnp.asarray([[1.0, 2.0, 3.0, 4.0]]))
    ids, w, scores = route(logits, jnp.zeros(4), cfg)
    np.testing.assert_allclose(scores[0], [0.1, 0.2, 0.3, 0.4], rtol=1e-6)
    assert np.asarray(ids[0]).tolist() == [3, 2]
    np.testing.assert_allclose(w[0], [0.6, 0.45], rtol=1e-6)
    cfg = dataclasses.replace(cfg, norm_topk_prob=True)
    _, w, _ = route(logits, jnp.zeros(4), cfg)
    np.testing.assert_allclose(w[0], [4 / 7 * 1.5, 3 / 7 * 1.5], rtol=1e-6)


def test_group_limited_greedy_uses_group_max():
    cfg = small_cfg(n_routed_experts=6, n_group=3, topk_group=1, num_experts_per_tok=2,
                    topk_method="group_limited_greedy", scoring_func="softmax", norm_topk_prob=False,
                    routed_scaling_factor=1.0)
    p = np.array([[0.05, 0.3, 0.2, 0.2, 0.15, 0.1]])
    ids, w, _ = route(jnp.log(jnp.asarray(p, jnp.float32)), jnp.zeros(6), cfg)
    # group max: g0 0.3 > g1 0.2 > g2 0.15 -> only experts 0, 1 (plain greedy would take 1 and 2/3)
    assert np.asarray(ids[0]).tolist() == [1, 0]
    np.testing.assert_allclose(w[0], [0.3, 0.05], rtol=1e-5)


def test_router_bias_update_direction():
    b = update_router_bias(jnp.zeros(4), jnp.asarray([10.0, 0.0, 5.0, 5.0]), 0.01)
    np.testing.assert_allclose(b, [-0.01, 0.01, 0.0, 0.0])


# ---------------------------------------------------------------- RoPE / YaRN
def v3_rope_cfg(**rs):
    base = dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    return C.ModelConfig(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         rope_scaling=C.RopeScaling(**{**base, **rs}), max_position_embeddings=163840)


def test_yarn_values_deepseek_v3():
    cfg = v3_rope_cfg()
    inv, attn = inv_freq_and_attention_factor(cfg)
    assert inv.shape == (32,) and inv.dtype == np.float32
    pos = 10000.0 ** (np.arange(0, 64, 2) / 64)
    # low = 10, high = 23: dims below 10 extrapolate, above 23 interpolate by 1/factor
    np.testing.assert_allclose(inv[:10], 1 / pos[:10], rtol=1e-6)
    np.testing.assert_allclose(inv[23:], 1 / (40 * pos[23:]), rtol=1e-6)
    r = (15 - 10) / 13
    np.testing.assert_allclose(inv[15], (1 / (40 * pos[15])) * r + (1 / pos[15]) * (1 - r), rtol=1e-6)
    assert attn == 1.0
    assert softmax_scale(cfg) == pytest.approx(0.1352338, rel=1e-6)
    assert softmax_scale(v3_rope_cfg(mscale=0.707, mscale_all_dim=0.707)) == pytest.approx(0.1147214, rel=1e-6)


def test_case1_softmax_scale_formula_and_attention_factor():
    cfg = v3_rope_cfg(mscale=1.0, mscale_all_dim=1.0)
    want = (128 + 64) ** -0.5 * (0.1 * 1.0 * math.log(40) + 1) ** 2
    assert softmax_scale(cfg) == pytest.approx(want, rel=1e-12)
    # only mscale_all_dim: cos/sin get 0.1 ln f + 1 (HF edge case), softmax still mscale^2
    _, attn = inv_freq_and_attention_factor(v3_rope_cfg(mscale=None, mscale_all_dim=1.0))
    assert attn == pytest.approx(0.1 * math.log(40) + 1)
    assert softmax_scale(C.ModelConfig()) == pytest.approx((32 + 16) ** -0.5)


def test_rope_is_relative_and_identity_at_zero():
    cfg = v3_rope_cfg()
    inv, attn = inv_freq_and_attention_factor(cfg)
    k1, k2 = jax.random.split(jax.random.key(0))
    q = jax.random.normal(k1, (1, 1, 1, 64))
    k = jax.random.normal(k2, (1, 1, 1, 64))

    def rot(x, p):
        c, s = rope_cos_sin(jnp.asarray([[p]]), inv, attn)
        return apply_rope(x, c, s)

    x0 = rot(q, 0)
    np.testing.assert_allclose(jnp.concatenate([q[..., 0::2], q[..., 1::2]], -1), x0, rtol=1e-6)
    d1 = jnp.sum(rot(q, 100) * rot(k, 37))
    d2 = jnp.sum(rot(q, 1063) * rot(k, 1000))
    np.testing.assert_allclose(d1, d2, rtol=2e-4)


# ---------------------------------------------------------------- balancing with padding (case 4)
def test_balance_stats_ignore_padding():
    """Half of each row is padding, scattered through it (not only at the tail): outputs at the
    real positions, expert counts, router entropy, the sequence-wise aux loss and the bias
    update equal those of the rows without the padding."""
    cfg = small_cfg(aux_loss_alpha=0.01)
    moe = MoE(cfg, rngs=nnx.Rngs(3))
    x_real = jax.random.normal(jax.random.key(4), (2, 8, 32))
    junk = 5.0 * jax.random.normal(jax.random.key(5), (2, 16, 32))
    rng = np.random.default_rng(6)
    real_at = np.stack([np.sort(rng.choice(16, 8, replace=False)) for _ in range(2)])  # [2, 8]
    rows = np.arange(2)[:, None]
    x_pad = junk.at[rows, real_at].set(x_real)
    mask_pad = jnp.zeros((2, 16), bool).at[rows, real_at].set(True)
    assert not np.array_equal(real_at, np.tile(np.arange(8), (2, 1)))
    y1, s1 = moe(x_real, jnp.ones((2, 8), bool))
    y2, s2 = moe(x_pad, mask_pad)
    np.testing.assert_allclose(y1, y2[rows, real_at], rtol=1e-5, atol=1e-6)
    for k in ("expert_counts", "router_entropy", "seq_aux"):
        np.testing.assert_allclose(s1[k], s2[k], rtol=1e-6, atol=1e-7, err_msg=k)
    b = jnp.zeros(8)
    np.testing.assert_array_equal(update_router_bias(b, s1["expert_counts"], 1e-3),
                                  update_router_bias(b, s2["expert_counts"], 1e-3))
    assert float(s1["seq_aux"]) > 0


# ---------------------------------------------------------------- remat and decode
def _loss(m, toks):
    logits, _ = m(toks)
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), -1))


def test_remat_same_gradients():
    toks = jax.random.randint(jax.random.key(1), (2, 12), 0, 128)
    grads = []
    for remat in ("none", "full", "dots_saveable"):
        m = DeepSeekModel(small_cfg(remat=remat), rngs=nnx.Rngs(0))
        g = nnx.grad(_loss)(m, toks)
        grads.append(jax.tree.leaves(nnx.state(g, nnx.Param)))
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("q_lora", [None, 16])
def test_latent_cache_decode_matches_full_forward(q_lora):
    from dsjax.model import decode as D

    cfg = small_cfg(q_lora_rank=q_lora, rope_scaling=C.RopeScaling(factor=4.0, original_max_position_embeddings=16,
                                                                     mscale=1.0, mscale_all_dim=1.0))
    m = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    toks = jax.random.randint(jax.random.key(2), (2, 20), 0, 128)
    # jitted as generate() runs them (prefill at 0, one step program for every position)
    full = jax.jit(lambda t: m(t)[0])(toks)
    cc = D.CacheConfig()
    cache = D.init_cache(cfg, 2, 24, cc)
    assert len(cache) == 3 and set(cache[0]) == {"c_kv", "k_rope"}
    assert cache[0]["c_kv"].shape == (2, 24, 12) and cache[0]["k_rope"].shape == (2, 24, 4)
    last = jnp.full((2,), 12, jnp.int32)
    l1, cache = jax.jit(lambda t, c: D.prefill(m, t, c, last, cc))(toks[:, :13], cache)
    step = jax.jit(lambda t, c, cur: D.decode_step(m, t, c, cur, cc))
    outs = [l1]
    for t in range(13, 20):
        lt, cache = step(toks[:, t:t + 1], cache, jnp.full((2,), t, jnp.int32))
        outs.append(lt)
    np.testing.assert_allclose(jnp.stack(outs, 1), full[:, 12:], rtol=1e-4, atol=1e-5)


def test_case8_bf16_loss_is_not_quantised():
    """Case 8: under bf16 compute the logits reach the fp32 cross-entropy unrounded."""
    from dsjax.train.step import cross_entropy

    cfg32 = small_cfg(vocab_size=4096, dtype="float32")
    m32 = DeepSeekModel(cfg32, rngs=nnx.Rngs(0))
    m16 = DeepSeekModel(dataclasses.replace(cfg32, dtype="bfloat16"), rngs=nnx.Rngs(0))
    toks = jax.random.randint(jax.random.key(1), (2, 16), 0, 4096)
    h = m16.hidden_states(toks)[0]
    lg = m16.logits(h)
    assert lg.dtype == jnp.float32
    # fp32 logits carry information below bf16 resolution
    assert np.any(np.asarray(lg) != np.asarray(lg.astype(jnp.bfloat16).astype(jnp.float32)))
    mask = jnp.ones((2, 16))
    # the loss of these logits is an fp64 log-softmax of them to fp32 rounding; a bf16
    # log-softmax of the same logits is off by far more, so this check would see one
    x = np.asarray(lg, np.float64)
    top = x.max(-1)
    lse = np.log(np.exp(x - top[..., None]).sum(-1)) + top
    want = np.sum(lse - np.take_along_axis(x, np.asarray(toks)[..., None], -1)[..., 0])
    got = float(cross_entropy(lg, toks, mask)[0])
    assert abs(got - want) < 1e-6 * want
    logp16 = jax.nn.log_softmax(lg.astype(jnp.bfloat16), axis=-1)
    in_bf16 = -float(jnp.sum(jnp.take_along_axis(logp16, toks[..., None], -1).astype(jnp.float32)))
    assert abs(in_bf16 - want) > 100 * 1e-6 * want, (in_bf16, want)
    l16 = cross_entropy(m16(toks)[0], toks, mask)[0] / 32
    l32 = cross_entropy(m32(toks)[0], toks, mask)[0] / 32
    assert abs(float(l16) - float(l32)) < 2e-3 * float(l32)


def test_lm_head_vjp_exact_in_fp32_and_bf16_gemms_under_bf16():
    """lm_head_matmul: fp32 inputs -> gradients equal plain autodiff to fp32 rounding; bf16 inputs ->
    close to the fp32 gradients and no fp32 x fp32 GEMM in the backward (the cotangent is rounded)."""
    import re

    from dsjax.model.transformer import lm_head_matmul

    kh, kw, kg = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(kh, (2, 8, 32), jnp.float32)
    w = jax.random.normal(kw, (32, 96), jnp.float32) / 6
    tgt = jax.random.randint(kg, (2, 8), 0, 96)

    def loss(fn, h, w):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(fn(h, w), -1), tgt[..., None], -1))

    plain = lambda h, w: jnp.dot(h, w, preferred_element_type=jnp.float32)
    g_ours = jax.grad(lambda h, w: loss(lm_head_matmul, h, w), argnums=(0, 1))(h, w)
    g_ref = jax.grad(lambda h, w: loss(plain, h, w), argnums=(0, 1))(h, w)
    for a, b in zip(g_ours, g_ref):  # same products, summation order may differ
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)) < 1e-6

    hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    f = jax.grad(lambda h, w: loss(lm_head_matmul, h, w), argnums=(0, 1))
    for a, b in zip(f(hb, wb), g_ref):
        assert a.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
    hlo = jax.jit(f).lower(hb, wb).as_text()
    sigs = re.findall(r"dot_general.*: \((tensor<[^>]*>), (tensor<[^>]*>)\)", hlo)
    assert len(sigs) == 3 and all("bf16" in x and "bf16" in y for x, y in sigs), sigs


def test_split_layers_equals_unstack_values_and_gradients():
    """`split_layers` (unrolled layer stacks) gives `lax.unstack`'s values and gradients, bitwise,
    on random inputs and cotangents; the stacked gradient comes out of one optimization barrier."""
    from dsjax.model.transformer import split_layers
    x = jax.random.normal(jax.random.key(0), (3, 5, 7), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (3, 5, 7), jnp.float32)
    f = lambda split: lambda x: sum(jnp.sum((p.astype(jnp.float32) * w[i]) ** 2)  # noqa: E731
                                    for i, p in enumerate(split(x)))
    assert all(bool(jnp.all(a == b)) for a, b in zip(split_layers(x), jax.lax.unstack(x)))
    g, g_ref = jax.grad(f(split_layers))(x), jax.grad(f(jax.lax.unstack))(x)
    assert g.dtype == jnp.bfloat16 and float(jnp.abs(g.astype(jnp.float32)).max()) > 0
    assert bool(jnp.all(g == g_ref))
    assert "optimization_barrier" in str(jax.make_jaxpr(jax.grad(f(split_layers)))(x))
    ids = jnp.arange(6, dtype=jnp.int32).reshape(3, 2)  # non-float leaves split plainly
    assert [t.tolist() for t in split_layers(ids)] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("weight_dtype, scan, in_place", [("bfloat16", False, True),
                                                         ("float32", False, False),
                                                         ("bfloat16", True, False)])
def test_unrolled_moe_layers_read_expert_weights_in_their_stack(monkeypatch, weight_dtype, scan, in_place):
    """Unrolled layers give each MoE layer its routed-expert weights' stacks (`expert_stacks`):
    every routed grouped GEMM of layer i gets in_stack=(stack, i) with stack[i] equal to its w,
    for the three projections of every MoE layer, and the same logits as without; not under a
    scan, nor when the weights are not in the compute dtype (fp32 master weights)."""
    from pallas_kernels.moe import api as moe_api
    calls, real = [], moe_api.grouped_matmul

    def spy(x, w, gs, *, impl, in_stack=None, extra=None, dw_sink=None):
        if in_stack is not None:
            stack, i = in_stack
            np.testing.assert_array_equal(np.asarray(stack[i], np.float32), np.asarray(w, np.float32))
        calls.append(None if in_stack is None else (in_stack[0].shape, in_stack[1]))
        return real(x, w, gs, impl=impl, in_stack=in_stack, extra=extra, dw_sink=dw_sink)

    cfg = small_cfg(dtype="bfloat16", weight_dtype=weight_dtype, scan_layers=scan)
    m = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    toks = jax.random.randint(jax.random.key(1), (2, 10), 0, cfg.vocab_size)
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    if not in_place:  # traced (a scan body is traced once)
        monkeypatch.setattr(moe_api, "grouped_matmul", spy)
        jax.eval_shape(lambda t: m(t), toks)
        assert calls == [None] * 3 * (1 if scan else n_moe)
        return
    base, _ = m(toks)
    monkeypatch.setattr(moe_api, "grouped_matmul", spy)
    logits, _ = m(toks)  # eager: the spy compares values
    assert [c[1] for c in calls] == [i for i in range(n_moe) for _ in range(3)]
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(base))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_vjp_matches_float64(dtype):
    """`rms_norm`'s forward and custom VJP against float64 maths on the same rounded values:
    the output (HF's rounding: the normalised x cast to x.dtype before the weight), dx and dw
    (fp32 sums) on random inputs, [B, T, D] with a non-unit weight."""
    from dsjax.model.layers import rms_norm
    k = jax.random.split(jax.random.key(3), 3)
    dt = jnp.dtype(dtype)
    x = (jax.random.normal(k[0], (2, 48, 256)) * 3).astype(dt)
    w = 1 + 0.1 * jax.random.normal(k[1], (256,))
    c = jax.random.normal(k[2], (2, 48, 256)).astype(dt)
    out, vjp = jax.vjp(lambda x, w: rms_norm(x, w, 1e-6), x, w)
    dx, dw = vjp(c)
    assert out.dtype == dx.dtype == dt and dw.dtype == jnp.float32
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    xf, cf, wf = f64(x), f64(c), f64(w)
    r = 1 / np.sqrt((xf ** 2).mean(-1, keepdims=True) + 1e-6)
    y = f64(jnp.asarray(xf * r, jnp.float32).astype(dt))  # the normalised x as the forward rounds it
    g = f64(jnp.asarray(cf, jnp.float32).astype(dt) * jnp.asarray(w, jnp.float32).astype(dt))
    rel = lambda a, b: np.linalg.norm(f64(a) - b) / np.linalg.norm(b)  # noqa: E731
    tol = 1e-6 if dtype == "float32" else 1e-2
    assert rel(out, f64(jnp.asarray(w, jnp.float32).astype(dt)) * y) < tol
    assert rel(dx, r * (g - xf * r ** 2 * (g * xf).mean(-1, keepdims=True))) < tol
    assert rel(dw, (cf * y).sum((0, 1))) < 1e-6  # fp32 sums in both dtypes
