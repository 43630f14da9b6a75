"""Numerical parity of dsjax against transformers' DeepSeek-V2/V3 on tiny random models.

`python tests/dsjax/hf_parity.py [--configs v2_lite,v2,v3] [--json OUT]` builds each tiny HF model
with every tensor randomised (router and `e_score_correction_bias` included), saves it with
`save_pretrained`, loads it through `dsjax.hf.load_hf` and prints the errors below. The tests in
tests/dsjax/test_hf_parity.py (and HF fixtures in test_hf_convert.py) call the same functions.
Needs the test extra: torch + transformers (>= 5.16.1).

Error measure ("relative error"): rel(a, b) = max|a - b| / max|b| over the whole tensor, b the
HF/torch reference. (Element-wise ratios are dominated by entries near zero.)
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

from dsjax import generate as G
from dsjax.config import ModelConfig
from dsjax.hf import load_hf
from dsjax.hf import mapping as M
from dsjax.hf.safetensors_io import INDEX, SINGLE, SafetensorsCheckpoint, write_sharded
from dsjax.model.rope import rope_cos_sin

SEQ = 64  # >= 64 so a wrong softmax scale / RoPE shows (invisible at position 0)
BATCH = 2
BF16_BATCH = 8  # 512 tokens: top-1 agreement resolved to 0.2%
TORCH_DEVICE = "cpu"  # where the HF reference runs (main() may pick cuda)

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
               max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
               attention_bias=False, bos_token_id=0, eos_token_id=1, pad_token_id=None)
TINY = {
    # DeepSeek-V2-Lite-like: no q LoRA, softmax greedy, YaRN mscale 0.707
    "v2_lite": dict(_COMMON, model_type="deepseek_v2", q_lora_rank=None, n_routed_experts=8,
                    n_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1,
                    topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
                    rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                  "mscale_all_dim": 0.707},
                    rope_theta=10000.0),
    # DeepSeek-V2-like: q LoRA, group_limited_greedy over several groups
    "v2": dict(_COMMON, model_type="deepseek_v2", q_lora_rank=24, n_routed_experts=16,
               n_shared_experts=2, num_experts_per_tok=3, n_group=4, topk_group=2,
               topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=4.0,
               rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
               rope_theta=10000.0),
    # DeepSeek-V3-like: sigmoid noaux_tc, n_group > 1, norm_topk_prob, x2.5, YaRN mscale 1.0, MTP
    "v3": dict(_COMMON, model_type="deepseek_v3", q_lora_rank=24, n_routed_experts=16,
               n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
               norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
               num_nextn_predict_layers=1,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ------------------------------------------------------------------------------------------------
# HF side
# ------------------------------------------------------------------------------------------------


def hf_config(name: str):
    d = dict(TINY[name])
    cls = {"deepseek_v2": transformers.DeepseekV2Config, "deepseek_v3": transformers.DeepseekV3Config}
    return cls[d.pop("model_type")](**d)


def randomize_(model, seed: int, bias_scale: float = 0.1, only: str = "") -> None:
    """Every parameter and buffer of the DeepSeek model to random values of O(1) activations:
    norms 1 + 0.2 N, linears N / sqrt(fan_in) (fan_in = last dim, also for fused experts), router
    2 N / sqrt(D), embedding N, router bias bias_scale * N."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                   if n.endswith("e_score_correction_bias")]
        for name, p in named:
            if not name.startswith(only):
                continue
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                v = bias_scale * r
            elif "norm" in name:
                v = 1.0 + 0.2 * r
            elif "embed_tokens" in name:
                v = r
            elif name.endswith("mlp.gate.weight"):
                v = 2.0 * r / p.shape[-1] ** 0.5
            elif name.endswith("bias"):
                v = 0.1 * r
            else:
                v = r / p.shape[-1] ** 0.5
            p.copy_(v.to(p.dtype))


def condition_(model, seed: int, out_scale: float = 0.25, head_mix: float = 0.1) -> None:
    """Make a random model's predictions trained-LM-like rather than coin flips: layer output
    projections (o_proj, down_proj, experts) x out_scale, lm_head += head_mix * (permuted
    embedding rows). Median top-1 probability goes from ~0.04 to ~0.4, so top-1 agreement
    measures the implementation, not bf16 noise on near-ties (HF bf16 vs HF fp32 on the plain
    random model agrees on only ~96% of tokens)."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(out_scale)
        E = model.get_input_embeddings().weight
        perm = torch.randperm(E.shape[0], generator=g)
        model.lm_head.weight.add_(head_mix * E[perm])


def build_hf(name: str, seed: int = 0):
    """Tiny random HF DeepSeek model (fp32, eager attention and experts)."""
    cfg = hf_config(name)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = (transformers.DeepseekV3ForCausalLM if cfg.model_type == "deepseek_v3"
           else transformers.DeepseekV2ForCausalLM)
    model = cls(cfg).to(torch.float32)
    randomize_(model, seed)
    condition_(model, seed)
    return model.eval()


def load_eager(path, dtype="float32"):
    kw = dict(dtype=getattr(torch, dtype), attn_implementation="eager")
    try:
        m = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", **kw)
    except (TypeError, ValueError):
        m = transformers.AutoModelForCausalLM.from_pretrained(path, **kw)
    return m.to(TORCH_DEVICE).eval()


def hf_mtp_model(model, seed: int):
    """transformers' MtpModel for `model` (if this transformers has it), randomised."""
    try:
        from transformers.modeling_layers import MtpModel
    except ImportError:
        return None
    if not all(hasattr(MtpModel, f) for f in ("forward_layer", "_project_to_logits", "tie_with_main_model")):
        return None  # older transformers (e.g. 5.17): a different MtpModel API
    mtp = MtpModel(model, model.config.num_nextn_predict_layers).to(model.dtype)
    randomize_(mtp, seed + 1, only="layers.")  # embedding and head are the main model's
    return mtp.eval()


def mtp_tensors(mtp, num_hidden_layers: int) -> dict:
    """HF on-disk MTP tensors `model.layers.{L + k}.*` (experts in the fused v5 form, plus the
    shared embedding/head copies real checkpoints carry) from an in-memory MtpModel."""
    out = {}
    for name, t in mtp.state_dict().items():
        m = re.match(r"layers\.(\d+)\.(.+)$", name)
        if not m:
            continue
        k, rest = int(m.group(1)), m.group(2)
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        out[f"model.layers.{num_hidden_layers + k}.{rest}"] = t.detach().float().numpy()
    L = num_hidden_layers
    out[f"model.layers.{L}.embed_tokens.weight"] = mtp.embed_tokens.weight.detach().float().numpy()
    out[f"model.layers.{L}.shared_head.head.weight"] = mtp.shared_head.weight.detach().float().numpy()
    return out


def add_tensors(path: Path, tensors: dict, fname: str = "model-extra.safetensors") -> None:
    """Add tensors to a saved HF dir in a new shard, converting it to the indexed layout."""
    path = Path(path)
    ck = SafetensorsCheckpoint(path)
    wm = {k: ck.file(k).name for k in ck.keys()}
    tmp = path / "_extra"
    write_sharded(tmp, [(k, v.dtype, v.shape) for k, v in tensors.items()], lambda k: tensors[k])
    (tmp / SINGLE).rename(path / fname)
    tmp.rmdir()
    wm.update({k: fname for k in tensors})
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": wm}))


# ------------------------------------------------------------------------------------------------
# dsjax side
# ------------------------------------------------------------------------------------------------


def layer_outputs(model, tokens):
    """dsjax per-layer hidden states [L + 1] x [B, T, D] in HF's `output_hidden_states` convention
    (embedding, each layer's output, the last one replaced by the final normed hidden), computed
    as one jitted program (run op by op, the layers' many small ops each compile on their own)."""
    graph, state = nnx.split(model)
    return jax.jit(lambda st, t: _layer_outputs(nnx.merge(graph, st), t))(state, tokens)


def _layer_outputs(model, tokens):
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    seg = jnp.ones((B, T), jnp.int32)
    cos, sin = rope_cos_sin(pos, model.inv_freq, model.attn_factor)
    h = model.embed(tokens)
    outs = [h]
    for stack in (model.dense_layers, model.moe_layers):
        if stack is None:
            continue
        g, st = nnx.split(stack)
        for i in range(jax.tree.leaves(st)[0].shape[0]):
            layer = nnx.merge(g, jax.tree.map(lambda x: x[i], st))
            h, _ = layer(h, cos, sin, seg, model.scale)
            outs.append(h)
    outs[-1] = model.norm(h)
    return outs


def _ce_mean(logits, tokens):
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def hf_grads_on_disk(model) -> dict:
    """Gradients of the HF model keyed by on-disk names (fused experts split per expert)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.detach().float().cpu().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            pre, F = name[:-len("gate_up_proj")], g.shape[1] // 2
            for j in range(g.shape[0]):
                out[f"{pre}{j}.gate_proj.weight"] = g[j, :F]
                out[f"{pre}{j}.up_proj.weight"] = g[j, F:]
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[:-len("down_proj")]
            for j in range(g.shape[0]):
                out[f"{pre}{j}.down_proj.weight"] = g[j]
        else:
            out[name] = g
    return out


def check(name: str, workdir: Path, *, seed: int = 0, decode_tokens: int = 32, grads: bool = True,
          bf16: bool = True, verbose: bool = False, impl: str = "reference") -> dict:
    """Run every parity measure for tiny config `name`; returns a dict of numbers."""
    res: dict = {"config": name}
    hf = build_hf(name, seed)
    path = Path(workdir) / name
    hf.save_pretrained(path)
    mtp = hf_mtp_model(hf, seed) if getattr(hf.config, "num_nextn_predict_layers", 0) else None
    if getattr(hf.config, "num_nextn_predict_layers", 0) and mtp is None:
        res["mtp_unavailable"] = f"transformers {transformers.__version__} has no usable MtpModel"
    if mtp is not None:
        add_tensors(path, mtp_tensors(mtp, hf.config.num_hidden_layers))
    hf = load_eager(path)  # as a user would; fused experts in memory, eager kernels
    if mtp is not None:
        mtp.tie_with_main_model(hf)
    base = ModelConfig(attention_impl=impl, moe_impl=impl)
    cfg, fns, params, rest = load_hf(path, base)
    model = fns.merge(params, rest)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32)
    tt = torch.tensor(tokens, dtype=torch.long, device=TORCH_DEVICE)
    if mtp is not None:
        mtp.to(TORCH_DEVICE)

    # fp32 logits and per-layer hidden states
    with torch.no_grad():
        out = hf(tt, output_hidden_states=True)
    ref_logits = out.logits.float().cpu().numpy()
    logits = np.asarray(jax.jit(lambda t: model(t)[0])(tokens))
    res["logits_rel"] = rel(logits, ref_logits)
    ours_h = layer_outputs(model, jnp.asarray(tokens))
    res["hidden_rel"] = [rel(a, b.float().cpu().numpy()) for a, b in zip(ours_h, out.hidden_states)]

    # MTP logits
    if mtp is not None and cfg.num_nextn_predict_layers:
        h_final = out.hidden_states[-1]
        with torch.no_grad():
            pos = torch.arange(1, SEQ, device=TORCH_DEVICE).expand(BATCH, -1)
            hm = mtp.forward_layer(0, h_final[:, :-1], pos, None, input_ids=tt[:, 1:])
            ref_mtp = mtp._project_to_logits(hm).float().cpu().numpy()
        ours_mtp = np.asarray(jax.jit(
            lambda t: model.mtp_logits(model.hidden_states(t)[0], t)[0][0])(tokens))[:, :-1]
        res["mtp_logits_rel"] = rel(ours_mtp, ref_mtp)

    # gradients of mean next-token CE
    if grads:
        hf.zero_grad()
        lg = hf(tt).logits.float()
        loss = torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), tt[:, 1:].reshape(-1))
        loss.backward()
        ref_g = hf_grads_on_disk(hf)

        def jloss(p):
            return _ce_mean(fns.merge(p, rest)(jnp.asarray(tokens))[0], jnp.asarray(tokens))

        g = jax.jit(jax.grad(jloss))(params)
        errs = {}
        for e in M.entries(cfg, params, rest):
            if e.tree != "params" or e.hf.startswith(f"model.layers.{cfg.num_hidden_layers}."):
                continue  # MTP does not enter the main loss
            ours = np.asarray(M.get_path(g, e.path)[e.index] if e.index else M.get_path(g, e.path))
            ref = ref_g[e.hf]
            errs[e.hf] = rel(ours.T if e.op == M.T else ours, ref) if np.any(ref) else float(np.max(np.abs(ours)))
        res["grad_rel_max"] = max(errs.values())
        res["grad_rel_worst"] = max(errs, key=errs.get)
        res["grad_tensors"] = len(errs)
        res["loss"] = float(loss.detach())

    # greedy decoding with the MLA latent cache vs HF generate
    if decode_tokens:
        prompt = tokens[:, :16]
        with torch.no_grad():
            ref_ids = hf.generate(torch.tensor(prompt, dtype=torch.long, device=TORCH_DEVICE),
                                  max_new_tokens=decode_tokens, min_new_tokens=decode_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0).cpu().numpy()
        ids, _ = G.generate(model, prompt, decode_tokens, use_cache=True)
        res["decode_equal"] = bool(np.array_equal(ids, ref_ids))
        res["decode_first_diff"] = int(np.argmax(np.any(ids != ref_ids, axis=0))) if not res["decode_equal"] else -1

    # bf16: HF in bf16 vs dsjax bf16 compute (fp32 master weights rounded at use)
    if bf16:
        hf16 = load_eager(path, "bfloat16")
        tokens = rng.integers(2, cfg.vocab_size, (BF16_BATCH, SEQ)).astype(np.int32)
        with torch.no_grad():
            l16 = hf16(torch.tensor(tokens, dtype=torch.long, device=TORCH_DEVICE)).logits.float().cpu()
        p_ref = torch.log_softmax(l16, -1).numpy().astype(np.float64)
        cfg16, fns16, p16, r16 = load_hf(path, base, dtype="bfloat16")
        m16 = fns16.merge(p16, r16)
        ours16 = np.asarray(jax.jit(lambda t: m16(t)[0].astype(jnp.float32))(tokens), np.float64)
        lq = ours16 - np.log(np.sum(np.exp(ours16 - ours16.max(-1, keepdims=True)), -1,
                                    keepdims=True)) - ours16.max(-1, keepdims=True)
        kl = np.sum(np.exp(p_ref) * (p_ref - lq), -1)
        res["bf16_kl_mean"] = float(np.mean(kl))
        res["bf16_top1"] = float(np.mean(np.argmax(ours16, -1) == np.argmax(p_ref, -1)))
        res["bf16_logits_rel"] = rel(ours16, l16.numpy())
        res["bf16_tokens"] = int(kl.size)
    if verbose:
        print(json.dumps(res))
    return res


def main() -> None:
    p = argparse.ArgumentParser(prog="python tests/dsjax/hf_parity.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(TINY))
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--impl", default="reference", help="dsjax attention_impl/moe_impl (auto|pallas|reference)")
    p.add_argument("--torch-device", default="cpu", help="where the HF reference runs (cpu|cuda)")
    args = p.parse_args()
    global TORCH_DEVICE
    TORCH_DEVICE = args.torch_device

    torch.set_num_threads(max(1, torch.get_num_threads()))
    env = {"jax": jax.__version__, "jax_backend": jax.default_backend(),
           "jax_device": str(jax.devices()[0].device_kind), "torch": torch.__version__,
           "transformers": transformers.__version__, "impl": args.impl, "torch_device": TORCH_DEVICE}
    print(json.dumps(env))
    results = []
    with tempfile.TemporaryDirectory() as d:
        for name in args.configs.split(","):
            t0 = time.time()
            try:
                r = check(name, Path(d), impl=args.impl)
            except Exception as e:  # report and go on with the other configs
                r = {"config": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            r["seconds"] = round(time.time() - t0, 1)
            print(json.dumps(r))
            results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "results": results}, indent=2))


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")
    main()
