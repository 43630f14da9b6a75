"""HF `config.json` (DeepseekV2ForCausalLM / DeepseekV3ForCausalLM) <-> `ModelConfig`.

Semantics follow transformers 5.24 (`models/deepseek_v{2,3}/configuration_deepseek_v{2,3}.py`,
`modeling_rope_utils.py`):
- RoPE: the legacy `rope_scaling` dict (+ top-level `rope_theta`, `"type": "yarn"`) and the
  transformers-5 `rope_parameters` dict (`rope_type`, `rope_theta` inside) are both read; yarn
  `original_max_position_embeddings` defaults to `max_position_embeddings` and `factor` to their
  ratio. Only `default` and `yarn` RoPE are supported.
- V2 routing is always softmax (`greedy` or `group_limited_greedy`); HF V2 never normalises the
  top-k weights, so `norm_topk_prob` is imported as False whatever the file says. V2 RoPE is the
  complex (interleaved-pair) form: `rope_interleave=True`.
- V3 routing is always sigmoid `noaux_tc` (`topk_method`/`scoring_func` in the file are ignored,
  as HF does); `rope_interleave` defaults to True.
- `q_lora_rank` null or 0 means no q LoRA. Integer-valued floats and numeric strings are coerced
  (configs in the wild write `rope_scaling` as `factor: 40`, `mscale: 1`, which must become
  floats). `num_key_value_heads` must equal `num_attention_heads` (MLA).
Fields that define tensor shapes must be present (`REQUIRED`); the rest take HF's class defaults.
Every failure is one line: `HFConfigError`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from dsjax.config import ConfigError, ModelConfig, RopeScaling, validate, Config

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
REQUIRED_DENSE = ("intermediate_size",)
REQUIRED_MOE = ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")

# HF class defaults (transformers 5.24) for optional fields.
_DEFAULTS = {
    "deepseek_v3": dict(q_lora_rank=1536, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8,
                        topk_group=4, first_k_dense_replace=3, norm_topk_prob=True,
                        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                        rope_interleave=True, attention_bias=False, num_nextn_predict_layers=1),
    "deepseek_v2": dict(q_lora_rank=1536, n_shared_experts=2, routed_scaling_factor=1.0, n_group=None,
                        topk_group=None, first_k_dense_replace=0, max_position_embeddings=2048,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                        topk_method="greedy"),
}


class HFConfigError(ConfigError):
    """An HF config.json that dsjax cannot represent; the message is one line."""


def _int(hf: dict, key: str, where: str) -> int:
    v = hf[key]
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise HFConfigError(f"{where}: {key} must be an integer, got {v!r}") from None
    if not math.isfinite(f) or f != int(f):
        raise HFConfigError(f"{where}: {key} must be an integer, got {v!r}")
    return int(f)


def _float(v: Any, key: str, where: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise HFConfigError(f"{where}: {key} must be a number, got {v!r}") from None


def rope_from_hf(hf: dict, where: str = "config.json") -> tuple[float, Optional[RopeScaling]]:
    """(rope_theta, RopeScaling or None) from `rope_parameters` or legacy `rope_scaling` + `rope_theta`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise HFConfigError(f"{where}: rope_parameters/rope_scaling must be a mapping, got {params!r}")
    theta = _float(params.get("rope_theta", hf.get("rope_theta", 10000.0)), "rope_theta", where)
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    if rtype == "default":
        return theta, None
    if rtype != "yarn":
        raise HFConfigError(f"{where}: rope type {rtype!r} is not supported (default, yarn)")
    if params.get("truncate", True) is False:
        raise HFConfigError(f"{where}: yarn truncate=false is not supported")
    max_pos = _int(hf, "max_position_embeddings", where) if "max_position_embeddings" in hf else 4096
    orig = params.get("original_max_position_embeddings") or max_pos
    orig = _int({"original_max_position_embeddings": orig}, "original_max_position_embeddings", where)
    factor = params.get("factor")
    factor = max_pos / orig if factor is None else _float(factor, "factor", where)
    opt = lambda k: None if params.get(k) is None else _float(params[k], k, where)  # noqa: E731
    rs = RopeScaling(type="yarn", factor=factor, original_max_position_embeddings=orig,
                     beta_fast=_float(params.get("beta_fast", 32.0), "beta_fast", where),
                     beta_slow=_float(params.get("beta_slow", 1.0), "beta_slow", where),
                     mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
                     attention_factor=opt("attention_factor"))
    return theta, rs


def model_config_from_hf(hf: dict, base: Optional[ModelConfig] = None,
                         where: str = "config.json") -> ModelConfig:
    """ModelConfig from a parsed HF config.json; dsjax-only fields (dtypes, kernels, loss weights)
    come from `base` (default: ModelConfig defaults). Raises HFConfigError (one line)."""
    mt = hf.get("model_type")
    if mt not in MODEL_TYPES:
        raise HFConfigError(f"{where}: model_type {mt!r} is not supported (expected one of "
                            f"{', '.join(MODEL_TYPES)})")
    v3 = mt == "deepseek_v3"
    hf = {**_DEFAULTS[mt], **{k: v for k, v in hf.items()}}
    if "num_mtp_layers" in hf and "num_nextn_predict_layers" not in hf:
        hf["num_nextn_predict_layers"] = hf["num_mtp_layers"]
    for key in REQUIRED:
        if hf.get(key) is None:
            raise HFConfigError(f"{where}: missing field {key!r}")
    L = _int(hf, "num_hidden_layers", where)
    first_k = min(_int(hf, "first_k_dense_replace", where), L)
    if first_k > 0 and hf.get("intermediate_size") is None:
        raise HFConfigError(f"{where}: missing field 'intermediate_size'")
    n_mtp = _int(hf, "num_nextn_predict_layers", where) if v3 and hf.get("num_nextn_predict_layers") else 0
    if first_k < L or n_mtp:
        for key in REQUIRED_MOE:
            if hf.get(key) is None:
                raise HFConfigError(f"{where}: missing field {key!r}")
    H = _int(hf, "num_attention_heads", where)
    if hf.get("num_key_value_heads") not in (None, H) and _int(hf, "num_key_value_heads", where) != H:
        raise HFConfigError(f"{where}: num_key_value_heads={hf['num_key_value_heads']} must equal "
                            f"num_attention_heads={H} (MLA)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("mlp_bias"):
        raise HFConfigError(f"{where}: mlp_bias=true is not supported")
    theta, rs = rope_from_hf(hf, where)
    q_lora = hf.get("q_lora_rank")
    q_lora = _int(hf, "q_lora_rank", where) if q_lora else None
    n_group = _int(hf, "n_group", where) if hf.get("n_group") else 1
    topk_group = _int(hf, "topk_group", where) if hf.get("topk_group") else 1
    if v3:
        topk_method, scoring, norm_topk = "noaux_tc", "sigmoid", bool(hf["norm_topk_prob"])
        interleave = bool(hf.get("rope_interleave", True))
    else:
        topk_method = hf.get("topk_method") or "greedy"
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise HFConfigError(f"{where}: deepseek_v2 topk_method {topk_method!r} is not supported by "
                                f"transformers (greedy, group_limited_greedy)")
        scoring, norm_topk, interleave = "softmax", False, True
    moe = first_k < L or n_mtp > 0
    fields = dict(
        vocab_size=_int(hf, "vocab_size", where),
        hidden_size=_int(hf, "hidden_size", where),
        intermediate_size=_int(hf, "intermediate_size", where) if hf.get("intermediate_size") else 0,
        moe_intermediate_size=_int(hf, "moe_intermediate_size", where) if moe else 0,
        num_hidden_layers=L, num_attention_heads=H, q_lora_rank=q_lora,
        kv_lora_rank=_int(hf, "kv_lora_rank", where),
        qk_nope_head_dim=_int(hf, "qk_nope_head_dim", where),
        qk_rope_head_dim=_int(hf, "qk_rope_head_dim", where),
        v_head_dim=_int(hf, "v_head_dim", where),
        n_routed_experts=_int(hf, "n_routed_experts", where) if moe else 0,
        n_shared_experts=_int(hf, "n_shared_experts", where) if hf.get("n_shared_experts") else 0,
        num_experts_per_tok=_int(hf, "num_experts_per_tok", where) if moe else 1,
        n_group=n_group, topk_group=topk_group, topk_method=topk_method, scoring_func=scoring,
        norm_topk_prob=norm_topk,
        routed_scaling_factor=_float(hf["routed_scaling_factor"], "routed_scaling_factor", where),
        first_k_dense_replace=first_k, rope_theta=theta, rope_scaling=rs, rope_interleave=interleave,
        rms_norm_eps=_float(hf["rms_norm_eps"], "rms_norm_eps", where),
        max_position_embeddings=_int(hf, "max_position_embeddings", where),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        num_nextn_predict_layers=n_mtp,
    )
    if hf.get("initializer_range") is not None:
        fields["initializer_range"] = _float(hf["initializer_range"], "initializer_range", where)
    cfg = dataclasses.replace(base or ModelConfig(), **fields)
    try:
        validate(Config(model=cfg, data=dataclasses.replace(Config().data, seq_len=1)))
    except ConfigError as e:
        raise HFConfigError(f"{where}: {e}") from None
    return cfg


def model_config_to_hf(cfg: ModelConfig, dtype: str = "bfloat16") -> dict:
    """HF config.json dict for `cfg`: deepseek_v3 for sigmoid noaux_tc routing, else deepseek_v2.

    Raises HFConfigError when transformers cannot express the model (e.g. softmax routing with
    normalised top-k weights, sigmoid routing without noaux_tc, non-interleaved RoPE under V2).
    """
    v3 = cfg.topk_method == "noaux_tc"
    if v3 and cfg.scoring_func != "sigmoid":
        raise HFConfigError("export: noaux_tc routing must use sigmoid scores for deepseek_v3")
    if not v3:
        if cfg.scoring_func != "softmax":
            raise HFConfigError(f"export: {cfg.topk_method} routing with {cfg.scoring_func} scores has no "
                                f"transformers equivalent (deepseek_v2 is softmax)")
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1 and cfg.num_moe_layers > 0:
            raise HFConfigError("export: transformers deepseek_v2 never normalises top-k weights; "
                                "set model.norm_topk_prob=false")
        if not cfg.rope_interleave:
            raise HFConfigError("export: transformers deepseek_v2 only has interleaved RoPE")
        if cfg.num_nextn_predict_layers:
            raise HFConfigError("export: MTP layers need deepseek_v3 (noaux_tc routing)")
    rope: dict = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        rope = {"rope_type": "yarn", "type": "yarn", "rope_theta": float(cfg.rope_theta),
                "factor": float(rs.factor),
                "original_max_position_embeddings": int(rs.original_max_position_embeddings),
                "beta_fast": float(rs.beta_fast), "beta_slow": float(rs.beta_slow)}
        for k in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(rs, k) is not None:
                rope[k] = float(getattr(rs, k))
    out = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads, "n_shared_experts": cfg.n_shared_experts,
        "n_routed_experts": cfg.n_routed_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "routed_scaling_factor": float(cfg.routed_scaling_factor), "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank or None, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim,
        "n_group": cfg.n_group, "topk_group": cfg.topk_group,
        "first_k_dense_replace": cfg.first_k_dense_replace, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "initializer_range": cfg.initializer_range, "rope_parameters": rope, "dtype": dtype,
    }
    if v3:
        out.update(norm_topk_prob=cfg.norm_topk_prob, rope_interleave=cfg.rope_interleave,
                   topk_method="noaux_tc", scoring_func="sigmoid",
                   num_nextn_predict_layers=cfg.num_nextn_predict_layers)
    else:
        out.update(topk_method=cfg.topk_method, scoring_func="softmax", norm_topk_prob=False,
                   mlp_bias=False)
    return out
