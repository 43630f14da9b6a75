"""The latent-cache decode (`dsjax.model.decode`): absorbed steps equal expanded ones and the full
forward (also with LoRA adapters and their merged weights); the int8 latent's error and bytes;
sinks + sliding window: exact while the stream fits, fixed memory past max_position_embeddings."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsjax import config as C
from dsjax import generate as G
from dsjax.model import DeepSeekModel, abstract_model
from dsjax.model import decode as D
from dsjax.model.lora import attach_adapters, merged_params

CFG = C.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=64,
                    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                    num_experts_per_tok=2, first_k_dense_replace=1, initializer_range=0.2,
                    attention_impl="reference", moe_impl="reference", max_position_embeddings=512)


def stream_logits(model, toks, cc: D.CacheConfig, S: int):
    """Teacher-forced logits [B, T-1, V] predicting toks[:, 1:]: prefill of token 0, then one
    decode step per token (the way generation feeds a prompt longer than a window)."""
    B, T = toks.shape
    gd, st = nnx.split(model)
    cache = D.init_cache(model.cfg, B, S, cc)
    pf = jax.jit(lambda st, t, c: D.prefill(nnx.merge(gd, st), t, c, jnp.zeros((B,), jnp.int32), cc))
    step = jax.jit(lambda st, t, c, cur: D.decode_step(nnx.merge(gd, st), t, c, cur, cc))
    lg, cache = pf(st, toks[:, :1], cache)
    out = [lg]
    for t in range(1, T - 1):
        lg, cache = step(st, toks[:, t:t + 1], cache, jnp.full((B,), t, jnp.int32))
        assert jax.tree.map(lambda x: x.shape, cache) == jax.tree.map(lambda x: x.shape, D.cache_shapes(
            model.cfg, B, S, cc))
        out.append(lg)
    return jnp.stack(out, 1), cache


@pytest.fixture(scope="module")
def model_and_stream():
    cfg = dataclasses.replace(CFG, rope_scaling=C.RopeScaling(factor=4.0, original_max_position_embeddings=32,
                                                              mscale=0.707, mscale_all_dim=1.0))
    m = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    toks, _ = G.generate(m, np.asarray([[1], [2]], np.int32), 63, temperature=1.0, seed=0)  # its own text
    return m, jnp.asarray(toks)


@pytest.mark.parametrize("absorb", [True, False])
def test_decode_steps_match_the_full_forward(model_and_stream, absorb):
    m, toks = model_and_stream
    full = jax.jit(lambda t: m(t)[0])(toks)[:, :-1]
    got, _ = stream_logits(m, toks, D.CacheConfig(absorb=absorb), toks.shape[1])
    np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)


def test_decode_kernel_equals_the_xla_absorbed_steps():
    """CacheConfig(kernel=True): absorbed decode steps through the split-context Mosaic kernel
    (GPU interpret mode here; a latent of 256 and RoPE keys of 64, which it takes, in bf16)
    give the logits of XLA's absorbed steps to bf16 rounding: full cache, sinks + window, and an
    int8 cache (converted inside the kernel)."""
    cfg = dataclasses.replace(CFG, kv_lora_rank=256, qk_rope_head_dim=64, dtype="bfloat16")
    m = DeepSeekModel(cfg, rngs=nnx.Rngs(1))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    calls = []
    real = D.mla_decode
    D.mla_decode = lambda *a, **kw: calls.append((kw["impl"], kw["c_scale"] is not None)) or real(*a, **kw)
    try:
        for cc in (D.CacheConfig(), D.CacheConfig(sink_tokens=4, window=60), D.CacheConfig("int8")):
            want, _ = stream_logits(m, toks, cc, 64)
            got, _ = stream_logits(m, toks, dataclasses.replace(cc, kernel=True), 64)
            err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            assert err < 2e-2, err
    finally:
        D.mla_decode = real
    assert set(calls) == {("mosaic", False), ("mosaic", True)}, set(calls)  # int8 too


def test_absorbed_equals_expanded_attention_with_lora():
    """One layer's attention over a random cache: absorbed vs expanded (int8 and float32), with a
    LoRA adapter on kv_b_proj folded into W_UK / W_UV; and decode of the merged weights equals
    the adapter model's full forward."""
    m = DeepSeekModel(CFG, rngs=nnx.Rngs(1))
    lcfg = C.LoraConfig(rank=4, alpha=8.0, target_modules=["all-linear"])
    attach_adapters(m, lcfg, nnx.Rngs(2))
    _, params, rest = nnx.split(m, nnx.Param, ...)
    params = params.to_pure_dict()
    keys = iter(jax.random.split(jax.random.key(3), 1000))

    def randomize(path, x):  # B is zero-initialised: make the adapters matter
        return 0.3 * jax.random.normal(next(keys), x.shape, x.dtype) if "lora_B" in str(path) else x
    params = jax.tree_util.tree_map_with_path(randomize, params)
    nnx.update(m, params)
    attn = next(D._layers(m)).self_attn
    assert attn.kv_b_proj.lora is not None
    B, S, H = 3, 40, CFG.num_attention_heads
    k1, k2, k3, k4 = jax.random.split(jax.random.key(4), 4)
    q = jax.random.normal(k1, (B, 1, H, CFG.qk_head_dim))
    c_kv = jax.random.normal(k2, (B, S, CFG.kv_lora_rank))
    k_rope = jax.random.normal(k3, (B, S, CFG.qk_rope_head_dim))
    valid = jnp.arange(S)[None] < jax.random.randint(k4, (B, 1), 5, S + 1)
    for lc in ({"c_kv": c_kv}, dict(zip(("c_kv", "c_scale"), D.quantize_int8(c_kv)))):
        a = D.absorbed_attention(attn, q, lc, k_rope, valid, 0.3)
        e = D.expanded_attention(attn, q, lc, k_rope, valid, 0.3)
        assert a.shape == (B, 1, H, CFG.v_head_dim)
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)

    toks = jax.random.randint(jax.random.key(5), (2, 12), 0, CFG.vocab_size)
    full = m(toks)[0][:, :-1]
    fns, _, _ = abstract_model(CFG)
    merged = fns.merge(merged_params(params, lcfg), rest.to_pure_dict())
    for model in (m, merged):
        got, _ = stream_logits(model, toks, D.CacheConfig(), 12)
        np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4)


def test_int8_latent_kl_agreement_and_bytes(model_and_stream):
    """int8 c_kv (a scale per token) vs the float32 cache of the same float32 model, teacher-forced
    over the model's own 64-token text. Measured: KL mean 4.8e-4, max 0.025, top-1 agreement
    0.984 (a bfloat16 cache: KL mean 3.7e-5, max 1.5e-4, agreement 1.0)."""
    m, toks = model_and_stream
    ref, _ = stream_logits(m, toks, D.CacheConfig(), 64)
    got, cache = stream_logits(m, toks, D.CacheConfig("int8"), 64)
    assert cache[0]["c_kv"].dtype == jnp.int8 and cache[0]["c_scale"].shape == (2, 64)
    lr, lq = jax.nn.log_softmax(ref, -1), jax.nn.log_softmax(got, -1)
    kl = np.asarray(jnp.sum(jnp.exp(lr) * (lr - lq), -1))
    agree = float(jnp.mean(jnp.argmax(ref, -1) == jnp.argmax(got, -1)))
    assert kl.mean() < 2e-3 and kl.max() < 0.1, (kl.mean(), kl.max())
    assert agree >= 0.9, agree
    assert 0 < kl.mean()  # it is quantised
    # bytes: c_kv halves against bfloat16; at V2-Lite geometry the whole cache is 0.56x
    bf = D.cache_shapes(CFG, 4, 1024, D.CacheConfig("bfloat16"))
    i8 = D.cache_shapes(CFG, 4, 1024, D.CacheConfig("int8"))
    assert i8[0]["c_kv"].size * 1 * 2 == D.cache_nbytes({"c": bf[0]["c_kv"]})
    lite = dataclasses.replace(CFG, hidden_size=2048, num_hidden_layers=27, num_attention_heads=16,
                               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                               dtype="bfloat16")
    nb = D.cache_nbytes(D.cache_shapes(lite, 1, 32768, D.CacheConfig()))
    assert nb == 27 * 32768 * (512 + 64) * 2
    n8 = D.cache_nbytes(D.cache_shapes(lite, 1, 32768, D.CacheConfig("int8")))
    assert n8 == 27 * 32768 * (512 + 64 * 2 + 4) and n8 / nb < 0.56


def test_slot_layout_positions():
    """Ring slots hold the last `window` tokens; keys sit at their position within the cache
    (sinks 0..k-1, window in order), so query - key distances inside the window are exact."""
    cc = D.CacheConfig(sink_tokens=2, window=5)
    for cur in [0, 3, 6, 7, 11, 40]:
        slot, q_pos, key_pos, valid = (np.asarray(x)[0] for x in D.slot_layout(jnp.asarray([cur]), 7, cc))
        held = {s: (s if s < 2 else max(t for t in range(cur + 1) if t >= 2 and 2 + (t - 2) % 5 == s))
                for s in range(7) if valid[s]}
        assert set(held) == set(range(min(cur + 1, 7)))
        assert slot == (cur if cur < 2 else 2 + (cur - 2) % 5) and held[int(slot)] == cur
        for s, t in held.items():
            if t >= 2:
                assert q_pos - key_pos[s] == cur - t
            else:
                assert key_pos[s] == t
        assert q_pos == min(cur, 6)


def test_window_exact_while_it_fits_and_fixed_past_max_positions(model_and_stream):
    m, toks = model_and_stream
    # sinks + window = the full cache length: the same tokens as the full cache
    prompt = np.asarray(toks[:, :9])
    a, _ = G.generate(m, prompt, 23)
    b, _ = G.generate(m, prompt, 23, sink_tokens=4, window=28)
    np.testing.assert_array_equal(a, b)
    # a 4 + 8 slot cache fed 20 x the window, past max_position_embeddings=64
    small = DeepSeekModel(dataclasses.replace(CFG, max_position_embeddings=64), rngs=nnx.Rngs(0))
    long = jax.random.randint(jax.random.key(6), (1, 161), 0, CFG.vocab_size)
    cc = D.CacheConfig(sink_tokens=4, window=8)
    lg, cache = stream_logits(small, long, cc, 12)  # asserts the cache shapes at every step
    assert lg.shape == (1, 160, CFG.vocab_size) and bool(jnp.all(jnp.isfinite(lg)))
    assert cache[0]["c_kv"].shape == (1, 12, CFG.kv_lora_rank)
    ids, _ = G.generate(small, np.asarray(long[:, :20]), 60, sink_tokens=4, window=8)
    assert ids.shape == (1, 80) and (ids >= 0).all()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        G.generate(small, np.asarray(long[:, :20]), 60)


def test_windowed_stream_perplexity(model_and_stream):
    """The model's own 64-token text teacher-forced through 4 sinks + 16 slots: identical to the
    full cache for the first 20 predictions, finite after. Measured perplexity on these random
    weights: full 72, sinks 4 + window 16: 171, window 20 without sinks: 162 (random weights have
    no attention sinks to keep, so the sinks do not help here)."""
    m, toks = model_and_stream
    full, _ = stream_logits(m, toks, D.CacheConfig(), 64)
    win, _ = stream_logits(m, toks, D.CacheConfig(sink_tokens=4, window=16), 20)
    np.testing.assert_allclose(win[:, :19], full[:, :19], rtol=1e-4, atol=1e-4)

    def ppl(lg):
        lp = jax.nn.log_softmax(lg, -1)
        return float(jnp.exp(-jnp.mean(jnp.take_along_axis(lp, toks[:, 1:, None], -1))))
    p_full, p_win = ppl(full), ppl(win)
    assert np.isfinite(p_win) and p_full < p_win < 8 * p_full, (p_full, p_win)


def test_bad_cache_options_name_the_option():
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\): 'int4'"):
        D.CacheConfig("int4")
    with pytest.raises(ValueError, match=r"sink_tokens \(--sink-tokens\): needs window"):
        D.CacheConfig(sink_tokens=4)
    with pytest.raises(ValueError, match=r"window \(--window\): must be at least 1"):
        D.CacheConfig(window=0)
