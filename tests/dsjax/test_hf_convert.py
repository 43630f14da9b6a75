"""HF interop: config import (case 1), FP8 checkpoints (case 5), V3 routing masks (case 11),
checkpoint errors, fused expert keys, MTP loading and loss, export round trip, convert CLI."""
import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsjax.hf import (CheckpointError, HFConfigError, SafetensorsCheckpoint, load_hf, load_hf_params,
                      model_config_from_hf, save_hf)
from dsjax.hf import mapping as M
from dsjax.hf.safetensors_io import dequant_fp8, write_sharded
from dsjax.model import abstract_model
from dsjax.model.rope import softmax_scale
from pallas_kernels.fp8.frozen import Fp8Weight

import torch  # noqa: E402  the test extra: missing torch/transformers fails loudly, never skips
import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import hf_parity as P  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# a DeepSeek-V3-style config.json whose rope_scaling holds integers and the legacy "type": "yarn"
# key (case 1 of the field faults)
CASE1 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 24, "kv_lora_rank": 16,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 128,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1, "mscale_all_dim": 1},
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "attention_bias": False,
    "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}


# ------------------------------------------------------------------------------------------------
# config.json import (case 1 and errors)
# ------------------------------------------------------------------------------------------------


def test_case1_int_rope_config_loads_as_floats():
    cfg = model_config_from_hf(CASE1)
    rs = cfg.rope_scaling
    for k in ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        assert isinstance(getattr(rs, k), float), k
    assert isinstance(cfg.rope_theta, float) and cfg.rope_theta == 10000.0
    assert rs.factor == 40.0 and rs.original_max_position_embeddings == 128
    want = (16 + 8) ** -0.5 * (0.1 * 1.0 * math.log(40.0) + 1) ** 2
    assert softmax_scale(cfg) == pytest.approx(want, rel=1e-12)
    assert cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid" and cfg.rope_interleave
    assert cfg.q_lora_rank == 24 and cfg.num_nextn_predict_layers == 1
    # the same model in the v5 `rope_parameters` form (rope_theta inside it)
    new = {k: v for k, v in CASE1.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000, **{
        k: v for k, v in CASE1["rope_scaling"].items() if k != "type"}}
    assert model_config_from_hf(new) == cfg
    # and it agrees with transformers' own reading of the file
    hf = transformers.DeepseekV3Config(**{k: v for k, v in CASE1.items() if k != "model_type"})
    att = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf, 0)
    assert softmax_scale(cfg) == pytest.approx(att.scaling, rel=1e-6)


def test_config_v2_lite_shape_and_q_lora_zero():
    hf = dict(P.TINY["v2_lite"], q_lora_rank=0, norm_topk_prob=True)  # HF V2 ignores norm_topk_prob
    cfg = model_config_from_hf(hf)
    assert cfg.q_lora_rank is None and cfg.scoring_func == "softmax" and cfg.topk_method == "greedy"
    assert cfg.norm_topk_prob is False and cfg.num_nextn_predict_layers == 0
    assert cfg.rope_scaling.mscale == pytest.approx(0.707)
    assert model_config_from_hf(dict(hf, q_lora_rank=None)) == cfg


@pytest.mark.parametrize("change, match", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"hidden_size": None}, "missing field 'hidden_size'"),
    ({"kv_lora_rank": "abc"}, "kv_lora_rank must be an integer"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2}}, "rope type 'dynamic' is not supported"),
])
def test_config_errors_are_one_line(change, match):
    hf = {k: v for k, v in dict(CASE1, **change).items() if v is not None}
    with pytest.raises(HFConfigError, match=match) as e:
        model_config_from_hf(hf)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------
# A shared tiny V3 checkpoint
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    """(dir, in-memory HF model, MtpModel) of the tiny V3-like config, MTP tensors included."""
    d = tmp_path_factory.mktemp("v3") / "hf"
    hf = P.build_hf("v3", seed=3)
    hf.save_pretrained(d)
    mtp = P.hf_mtp_model(hf, 3)
    P.add_tensors(d, P.mtp_tensors(mtp, hf.config.num_hidden_layers))
    return d, hf


def _tokens(vocab, shape=(2, 24), seed=0):
    return np.random.default_rng(seed).integers(2, vocab, shape).astype(np.int32)


def _logits(fns, params, rest, tokens):
    """Our model's logits as one jitted program (run op by op, its many small ops would each
    compile on their own)."""
    return jax.jit(lambda p, r, t: fns.merge(p, r)(t)[0])(params, rest, tokens)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def test_fused_expert_keys_load_like_per_expert(v3, tmp_path):
    d, hf = v3
    # v5 in-memory state dict: mlp.experts.gate_up_proj [E, 2F, D] / down_proj [E, D, F]
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)
    write_sharded(tmp_path, [(k, v.dtype, v.shape) for k, v in sd.items()], sd.__getitem__,
                  max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").is_file()  # several shards
    shutil.copyfile(d / "config.json", tmp_path / "config.json")
    cfg, fns, p1, r1 = load_hf(tmp_path)
    assert cfg.num_nextn_predict_layers == 0  # config says 1, no MTP tensors: turned off
    _, _, p2, r2 = load_hf(d, dataclasses.replace(cfg))
    for (path, a) in jax.tree_util.tree_flatten_with_path(p1)[0]:
        b = p2
        for k in path:
            b = b[k.key]
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(_logits(fns, p1, r1, _tokens(cfg.vocab_size))),
                               _hf_logits(hf, _tokens(cfg.vocab_size)), rtol=0, atol=2e-5)


def test_checkpoint_errors_list_names_and_counts(v3, tmp_path):
    d, _ = v3
    cfg, _, params, rest = load_hf(d)
    ck = SafetensorsCheckpoint(d)
    tensors = {k: ck.read(k) for k in ck.keys()}
    L = cfg.num_hidden_layers
    for j in range(7):
        del tensors[f"model.layers.1.mlp.experts.{j}.up_proj.weight"]
    tensors["model.layers.0.self_attn.extra.weight"] = np.zeros((2, 2), np.float32)
    tensors["model.norm.weight"] = np.zeros((3,), np.float32)
    write_sharded(tmp_path, [(k, v.dtype, v.shape) for k, v in tensors.items()], tensors.__getitem__)
    with pytest.raises(CheckpointError) as e:
        load_hf_params(tmp_path, cfg, params, rest)
    msg = str(e.value)
    assert "\n" not in msg
    assert "7 missing: model.layers.1.mlp.experts.0.up_proj.weight" in msg and "(+2 more)" in msg
    assert "1 unexpected: model.layers.0.self_attn.extra.weight" in msg
    assert "1 mis-shaped: model.norm.weight [3] (expected [64])" in msg
    assert L == 3


def test_mtp_weights_loaded_or_ignored_with_note(v3, caplog):
    d, hf = v3
    cfg, fns, params, rest = load_hf(d)
    assert cfg.num_nextn_predict_layers == 1
    ck = SafetensorsCheckpoint(d)
    L = cfg.num_hidden_layers
    np.testing.assert_array_equal(np.asarray(params["mtp"]["layers"]["eh_proj"]["kernel"][0]),
                                  ck.read(f"model.layers.{L}.eh_proj.weight").T)
    np.testing.assert_array_equal(np.asarray(rest["mtp"]["layers"]["block"]["mlp"]["e_score_correction_bias"][0]),
                                  ck.read(f"model.layers.{L}.mlp.gate.e_score_correction_bias"))
    off = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    from dsjax.model import abstract_model

    _, p0, r0 = abstract_model(off)
    with caplog.at_level(logging.INFO, logger="dsjax.hf"):
        p0, r0 = load_hf_params(d, off, p0, r0)
    assert "ignored" in caplog.text and "MTP" in caplog.text
    assert "mtp" not in p0


@pytest.mark.parametrize("blk", [(16, 16), (128, 128)])
def test_fp8_partial_blocks_and_scale_in_another_shard(v3, tmp_path, blk):
    """Case 5: every 2-D linear quantised to e4m3 with 16x16 blocks (shapes like 40x64, 192x24
    leave partial edge blocks) or with DeepSeek-V3's 128x128 (every weight here is smaller than a
    block in some dimension or ends in a partial one), each weight_scale_inv written to a
    different shard."""
    d, _ = v3
    ck = SafetensorsCheckpoint(d)
    hf_cfg = json.loads((d / "config.json").read_text())
    hf_cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(blk)}
    weights, scales, want = {}, {}, {}
    partial = 0
    for k in ck.keys():
        x = ck.read(k).astype(np.float32)
        quant = (x.ndim == 2 and ".layers." in k and "norm" not in k and not k.endswith("mlp.gate.weight")
                 and "embed_tokens" not in k and "shared_head.head" not in k)
        if not quant:
            weights[k] = x
            continue
        O, I = x.shape
        partial += (O % blk[0] != 0) or (I % blk[1] != 0)
        go, gi = -(-O // blk[0]), -(-I // blk[1])
        pad = np.zeros((go * blk[0], gi * blk[1]), np.float32)
        pad[:O, :I] = x
        amax = np.abs(pad.reshape(go, blk[0], gi, blk[1])).max(axis=(1, 3))
        s = np.maximum(amax, 1e-12) / 448.0
        q = (pad.reshape(go, blk[0], gi, blk[1]) / s[:, None, :, None]).reshape(pad.shape)[:O, :I]
        q = q.astype(ml_dtypes.float8_e4m3fn)
        weights[k] = q
        scales[k + "_scale_inv"] = s.astype(np.float32)
        want[k] = q.astype(np.float32) * np.repeat(np.repeat(s, blk[0], 0), blk[1], 1)[:O, :I]
    assert partial > 10
    # two shards: all weights in one file, all scales in the other
    for name, group in (("model-00001-of-00002.safetensors", weights),
                        ("model-00002-of-00002.safetensors", scales)):
        sub = tmp_path / (name + ".d")
        write_sharded(sub, [(k, v.dtype, v.shape) for k, v in group.items()], group.__getitem__)
        (sub / "model.safetensors").rename(tmp_path / name)
        sub.rmdir()
    wm = {k: "model-00001-of-00002.safetensors" for k in weights}
    wm.update({k: "model-00002-of-00002.safetensors" for k in scales})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    cfg, fns, params, rest = load_hf(tmp_path)
    for e in M.entries(cfg, params, rest):
        if e.hf in want:
            leaf = M.get_path(params if e.tree == "params" else rest, e.path)
            got = np.asarray(leaf[e.index])
            np.testing.assert_array_equal(got.T if e.op == M.T else got, want[e.hf], err_msg=e.hf)
    # kept FP8 (frozen weights under model.fp8=blockwise): the stored values and scales,
    # transposed to [in, out]; only 128x128 blocks are kept, others are dequantised as above
    _, abs_p, abs_r = abstract_model(cfg)
    keep = {e.path for e in M.entries(cfg, abs_p, abs_r) if e.hf in want}
    kp, _ = load_hf_params(tmp_path, cfg, abs_p, abs_r, fp8_keep=keep)
    for e in M.entries(cfg, params, rest):
        if e.hf not in want:
            continue
        leaf = M.get_path(kp, e.path)
        if blk != (128, 128):
            np.testing.assert_array_equal(np.asarray(leaf[e.index]).T, want[e.hf], err_msg=e.hf)
            continue
        assert isinstance(leaf, Fp8Weight), e.hf
        np.testing.assert_array_equal(np.asarray(leaf.q[e.index]).T.view(np.uint8),
                                      weights[e.hf].view(np.uint8), err_msg=e.hf)
        np.testing.assert_array_equal(np.asarray(leaf.s[e.index]).T, scales[e.hf + "_scale_inv"], err_msg=e.hf)


def test_dequant_fp8_v3_kv_a_shape():
    """[576, 7168]-like kv_a_proj_with_mqa with 128x128 blocks: scale grid [5, 56], last row
    block has 64 rows."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(576, 7168)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2.0, (5, 56)).astype(np.float32)
    out = dequant_fp8(w, s, (128, 128))
    wf = w.astype(np.float32)
    for bi, bj in [(0, 0), (4, 55), (4, 0), (2, 17)]:
        blk = (slice(bi * 128, min((bi + 1) * 128, 576)), slice(bj * 128, (bj + 1) * 128))
        np.testing.assert_array_equal(out[blk], wf[blk] * s[bi, bj])
    with pytest.raises(CheckpointError, match="expected \\(5, 56\\)"):
        dequant_fp8(w, s[:4], (128, 128))


# ------------------------------------------------------------------------------------------------
# Case 11: V3 group-limited routing with strongly negative router bias
# ------------------------------------------------------------------------------------------------


def test_case11_negative_bias_never_picks_excluded_groups():
    from dsjax.model.moe import route

    hfc = transformers.DeepseekV3Config(**{k: v for k, v in P.TINY["v3"].items() if k != "model_type"})
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(hfc)
    E, G, TG, K = hfc.n_routed_experts, hfc.n_group, hfc.topk_group, hfc.num_experts_per_tok
    rng = np.random.default_rng(0)
    w = rng.normal(size=(E, hfc.hidden_size)).astype(np.float32) * 0.3
    bias = (-5.0 - rng.uniform(size=E)).astype(np.float32)  # biased scores all < 0
    x = rng.normal(size=(256, hfc.hidden_size)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(w))
        router.e_score_correction_bias.copy_(torch.tensor(bias))
        _, hw, hi = router(torch.tensor(x))
    cfg = model_config_from_hf(dict(P.TINY["v3"]))
    ids, weights, scores = route(jnp.asarray(x @ w.T), jnp.asarray(bias), cfg)
    ids, weights = np.asarray(ids), np.asarray(weights)
    # expected groups: top-`TG` by the sum of the top-2 biased scores per group
    choice = 1 / (1 + np.exp(-(x @ w.T))) + bias
    gs = np.sort(choice.reshape(-1, G, E // G), -1)[..., -2:].sum(-1)
    keep = np.argsort(-gs, -1)[:, :TG]
    for t in range(len(x)):
        assert set(ids[t] // (E // G)) <= set(keep[t]), t
    order_h = np.argsort(hi.numpy(), -1)
    order_o = np.argsort(ids, -1)
    np.testing.assert_array_equal(np.take_along_axis(hi.numpy(), order_h, -1), np.take_along_axis(ids, order_o, -1))
    np.testing.assert_allclose(np.take_along_axis(weights, order_o, -1),
                               np.take_along_axis(hw.numpy(), order_h, -1), rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# MTP targets and loss
# ------------------------------------------------------------------------------------------------


def test_mtp_targets_masked_at_boundaries_and_padding():
    from dsjax.data.loader import pack_rows
    from dsjax.model.mtp import mtp_targets

    # docs [10..14] and [20..22] (+ EOS = 1 each) then padding
    toks = np.array([10, 11, 12, 13, 14, 1, 20, 21, 22, 1], np.int32)
    ser = np.array([0] * 6 + [1] * 4, np.int32)
    b = pack_rows(toks, ser, 1, 12, pad_id=0)
    tgt, mask = mtp_targets(jnp.asarray(b["targets"]), jnp.asarray(b["loss_mask"]), 0)
    tgt, mask = np.asarray(tgt)[0], np.asarray(mask)[0]
    inp = b["inputs"][0]
    for i in range(12):
        same_doc = i + 2 < 10 and ser[min(i, 9)] == ser[min(i + 2, 9)]
        assert mask[i] == float(same_doc), i
        if mask[i]:
            assert tgt[i] == toks[i + 2] and inp[i] == toks[i]
    d1 = np.asarray(mtp_targets(jnp.asarray(b["targets"]), jnp.asarray(b["loss_mask"]), 1)[1])[0]
    assert d1.sum() == (mask.sum() - 2)  # depth 2: one fewer valid position per document


def test_train_step_adds_weighted_mtp_loss():
    from dsjax import config as C
    from dsjax.model.mtp import mtp_targets
    from dsjax.train.optim import build_optimizer
    from dsjax.train.step import cross_entropy, init_model, init_state, make_train_step

    cfg = C.load(None, ["model.num_nextn_predict_layers=1", "model.num_hidden_layers=2",
                        "model.vocab_size=64", "model.hidden_size=32", "model.intermediate_size=48",
                        "model.moe_intermediate_size=16", "model.n_group=2", "model.topk_group=1",
                        "model.mtp_loss_weight=0.5", "data.seq_len=16", "data.batch_size=2",
                        "optim.learning_rate=0.0", "optim.weight_decay=0.0"])
    fns, params, rest = init_model(cfg)
    tx, sch = build_optimizer(cfg.optim, 2)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 64, (2, 17)).astype(np.int32)
    batch = {"inputs": toks[None, :, :-1], "targets": toks[None, :, 1:],
             "loss_mask": np.ones((1, 2, 16), np.float32), "segment_ids": np.ones((1, 2, 16), np.int32),
             "positions": np.broadcast_to(np.arange(16, dtype=np.int32), (1, 2, 16)).copy()}
    batch["loss_mask"][0, 1, 10:] = 0  # padding tail
    _, m = jax.jit(make_train_step(cfg, fns, tx, sch))(init_state(params, rest, tx), batch)
    mb = {k: jnp.asarray(v[0]) for k, v in batch.items()}

    @jax.jit  # one program instead of the model's ops one by one
    def mtp_ce(params, rest, mb):
        model = fns.merge(params, rest)
        h, _ = model.hidden_states(mb["inputs"], mb["positions"], mb["segment_ids"])
        lg = model.mtp_logits(h, mb["inputs"], mb["positions"], mb["segment_ids"])[0][0]
        tgt, mask = mtp_targets(mb["targets"], mb["loss_mask"], 0)
        return cross_entropy(lg, tgt, mask)

    s, n = mtp_ce(params, rest, mb)
    assert float(n) == 15 + 9  # row 0: i = 0..14; row 1 (targets 10.. masked): i = 0..8
    np.testing.assert_allclose(float(m["mtp_loss"][0]), float(s / n), rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Export round trip and the convert CLI
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_export_round_trip_transformers_reproduces_our_logits(name, tmp_path):
    from dsjax import config as C
    from dsjax.train.step import init_model

    mcfg = model_config_from_hf(dict(P.TINY[name]))
    cfg = dataclasses.replace(C.Config(), model=dataclasses.replace(mcfg, initializer_range=0.2))
    fns, params, rest = init_model(cfg, seed=5)
    if "moe_layers" in rest:  # a non-trivial router bias
        b = rest["moe_layers"]["mlp"]["e_score_correction_bias"]
        rest["moe_layers"]["mlp"]["e_score_correction_bias"] = jax.random.normal(jax.random.key(1), b.shape) * 0.1
    tokens = _tokens(mcfg.vocab_size, (2, 64))
    ours = np.asarray(_logits(fns, params, rest, tokens))
    out = save_hf(tmp_path / "hf", cfg.model, params, rest, dtype="float32", max_shard_bytes=300_000)
    assert (out / "model.safetensors.index.json").is_file()
    hf = P.load_eager(out)
    assert P.rel(ours, _hf_logits(hf, tokens)) <= 1e-5
    # and back: identical parameters
    _, _, p2, r2 = load_hf(out)
    for a, b in zip(jax.tree.leaves((params, rest)), jax.tree.leaves((p2, r2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # bf16 export loads in transformers too
    out16 = save_hf(tmp_path / "hf16", cfg.model, params, rest, dtype="bfloat16")
    ck = SafetensorsCheckpoint(out16)
    assert ck.dtype("model.embed_tokens.weight") == "BF16"
    assert ck.dtype("model.layers.1.mlp.gate.weight") == "F32"  # router kept fp32, like HF
    _, _, p16, _ = load_hf(out16)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p16)):
        if a.ndim == 3 and a.shape[-1] == mcfg.n_routed_experts:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # mlp.gate
        else:
            np.testing.assert_array_equal(np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32),
                                          np.asarray(b))
    assert np.all(np.isfinite(_hf_logits(P.load_eager(out16, "bfloat16"), tokens)))


def test_convert_cli_from_hf_generate_and_back(v3, tmp_path):
    d, _ = v3
    hf_dir = tmp_path / "hf_in"
    shutil.copytree(d, hf_dir)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(255)}
    vocab["</s>"] = 255
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(hf_dir / "tokenizer.json"))
    run = tmp_path / "run"
    # a bare environment, plus the session's XLA compilation cache (tests/conftest.py): the two
    # conversions compile the same eager ops, the second reads them back
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    env.update({k: v for k, v in os.environ.items() if k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))})
    r = subprocess.run([sys.executable, "-m", "dsjax.convert", "--from-hf", str(hf_dir), "--out", str(run),
                        "--set", "data.seq_len=64"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (run / "config.yaml").is_file() and (run / "tokenizer.json").is_file()
    from dsjax.generate import load_run

    model, _, cfg, step = load_run(run)
    assert step == 0 and cfg.model.num_nextn_predict_layers == 1
    hf = P.load_eager(hf_dir)
    tokens = _tokens(cfg.model.vocab_size, (2, 64))
    assert P.rel(np.asarray(jax.jit(lambda t: model(t)[0])(tokens)), _hf_logits(hf, tokens)) <= 1e-5
    back = tmp_path / "hf_out"
    r = subprocess.run([sys.executable, "-m", "dsjax.convert", "--to-hf", str(run), "--out", str(back),
                        "--dtype", "float32"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (back / "tokenizer.json").is_file()
    a, b = SafetensorsCheckpoint(hf_dir), SafetensorsCheckpoint(back)
    L = cfg.model.num_hidden_layers
    extra = {f"model.layers.{L}.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight"}
    fused = {k for k in a.keys() if ".experts.gate_up_proj" in k or ".experts.down_proj" in k}
    assert set(b.keys()) >= set(a.keys()) - extra - fused
    for k in sorted(set(a.keys()) - extra - fused):
        np.testing.assert_array_equal(a.read(k).astype(np.float32), b.read(k), err_msg=k)
    r = subprocess.run([sys.executable, "-m", "dsjax.convert", "--from-hf", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "x")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "error" in r.stderr


@pytest.mark.parametrize("option, make, needle", [
    ("--from-hf", None, "--from-hf: {p} does not exist"),
    ("--to-hf", None, "--to-hf: {p} does not exist (a dsjax run directory)"),
    ("--to-hf", "dir", "--to-hf: {p} has no checkpoints/ directory (a dsjax run directory)"),
])
def test_convert_names_the_option_of_a_missing_input(tmp_path, monkeypatch, capsys, option, make, needle):
    from dsjax.cli import run_main
    from dsjax.convert import main
    src = tmp_path / "src"
    if make == "dir":
        src.mkdir()
    monkeypatch.setattr(sys, "argv", ["python -m dsjax.convert", option, str(src), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as ex:
        run_main("dsjax.convert", main)
    assert ex.value.code == 2
    assert capsys.readouterr().err == f"dsjax.convert: error: {needle.format(p=src)}\n"
    assert not (tmp_path / "out").exists()


def test_fp8_weight_without_its_scale_is_an_error(tmp_path):
    """An e4m3 weight whose weight_scale_inv is missing must not load as raw fp8 values."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.o_proj.weight": torch.ones(4, 4).to(torch.float8_e4m3fn)},
              str(tmp_path / "model.safetensors"))
    ck = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match="o_proj.weight: stored as float8_e4m3fn.*no .*weight_scale_inv"):
        ck.read_dequant("model.layers.0.self_attn.o_proj.weight")


def test_read_hf_config_from_a_directory_a_checkpoint_file_or_a_json_file(tmp_path):
    from dsjax.hf.load import read_hf_config
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (tmp_path / "other.json").write_text('{"model_type": "deepseek_v2"}')
    for p in ("", "model.safetensors", "model.safetensors.index.json", "config.json"):
        assert read_hf_config(tmp_path / p) == {"model_type": "deepseek_v3"}, p
    assert read_hf_config(tmp_path / "other.json") == {"model_type": "deepseek_v2"}
    with pytest.raises(FileNotFoundError, match=f"hf: no config.json in {tmp_path / 'sub'}"):
        (tmp_path / "sub").mkdir()
        read_hf_config(tmp_path / "sub")


def _corrupt_checkpoints(d: Path) -> dict[str, tuple[bytes, str]]:
    """{name: (file bytes, expected message part)} of broken safetensors files made from a real
    one (two random tensors)."""
    from safetensors.numpy import save
    rng = np.random.default_rng(4)
    good = save({"a": rng.standard_normal((3, 5)).astype(np.float32),
                 "b": rng.standard_normal((7,)).astype(np.float32)})
    n = int.from_bytes(good[:8], "little")
    return {
        "eight_bytes": (good[:8], f"the header claims {n} bytes but only 0 follow"),
        "four_bytes": (good[:4], "4 bytes, shorter than the 8-byte header length"),
        "header_longer_than_file": ((len(good) + 100).to_bytes(8, "little") + good[8:],
                                    f"the header claims {len(good) + 100} bytes but only {len(good) - 8} follow"),
        "data_cut": (good[:-9], f"tensor b claims bytes [60, 88) of the data but the file holds 79 bytes"),
        "header_not_json": (n.to_bytes(8, "little") + b"\xff" * n + good[8 + n:], "header is not valid JSON"),
    }


def test_truncated_or_corrupt_safetensors_is_one_error_naming_the_file(tmp_path):
    for name, (raw, why) in _corrupt_checkpoints(tmp_path).items():
        f = tmp_path / name / "model.safetensors"
        f.parent.mkdir()
        f.write_bytes(raw)
        with pytest.raises(CheckpointError) as ex:
            SafetensorsCheckpoint(f.parent)
        msg = str(ex.value)
        assert msg.startswith(f"{f}: truncated or corrupt safetensors file: ") and why in msg, (name, msg)
        assert "\n" not in msg


def test_convert_cli_truncated_safetensors_exit_2_nothing_written(tmp_path):
    """`dsjax.convert --from-hf` on a directory whose model.safetensors was cut to its first 8
    bytes: one line naming the file and the fault, exit status 2, no run directory."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(CASE1))
    raw, why = _corrupt_checkpoints(tmp_path)["eight_bytes"]
    (hf_dir / "model.safetensors").write_bytes(raw)
    r = subprocess.run([sys.executable, "-m", "dsjax.convert", "--from-hf", str(hf_dir), "--out",
                        str(tmp_path / "run")], cwd=ROOT, capture_output=True, text=True,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"dsjax.convert: error: {hf_dir / 'model.safetensors'}: truncated or "
                               f"corrupt safetensors file: {why}"), r.stderr
    assert not (tmp_path / "run").exists()

