"""LoRA adapters alone, in PEFT's format: `adapter_model.safetensors` + `adapter_config.json`.

Keys follow PEFT's `get_peft_model_state_dict` for a LoRA on an HF DeepSeek model:
  base_model.model.model.layers.{n}.self_attn.kv_b_proj.lora_A.weight   [r, in]
  base_model.model.model.layers.{n}.self_attn.kv_b_proj.lora_B.weight   [out, r]
  base_model.model.lm_head.lora_A.weight ...
Routed experts are written per expert, as PEFT names adapters on the per-expert `nn.Linear`
modules of the HF checkpoint's on-disk layout (`model.layers.{n}.mlp.experts.{j}.gate_proj`,
also vLLM's DeepSeek LoRA layout): base_model.model.model.layers.{n}.mlp.experts.{j}.
gate_proj.lora_A.weight [r, D] and ...lora_B.weight [F, r]. transformers 5 fuses the experts
into 3-D parameters, which PEFT reaches only through `target_parameters` with its own fused
layout; this file does not use that layout.
`target_modules` in the config is a regular expression (PEFT matches a string by full match)
naming exactly the modules that have adapters, so PEFT builds no others. Weights trained in full
(lora.modules_to_save, or unfrozen base weights) are not in this file: export the merged model
(`dsjax.convert --to-hf`) for them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from dsjax.config import LoraConfig, ModelConfig
from dsjax.hf import mapping as M
from dsjax.model.lora import split_adapters

PREFIX = "base_model.model."
NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def adapter_tensors(model_cfg: ModelConfig, params: dict, rest: dict) -> dict[str, tuple]:
    """{HF module name (e.g. `model.layers.3.mlp.experts.5.up_proj`): (A [r, in], B [out, r])}
    as float32 numpy arrays, for every adapter in the full params tree `params`."""
    base, ads = split_adapters(params)
    out = {}
    for e in M.entries(model_cfg, base, rest):
        if e.tree != "params" or not e.hf.endswith(".weight"):
            continue
        if e.path[-1] == "kernel":
            ad = M.get_path(ads, e.path[:-1] + ("lora",))
        else:  # a routed-expert weight [.., E, in, out]
            ad = M.get_path(ads, e.path[:-1] + ("experts", e.path[-1]))
        if ad is None:
            continue
        a = np.asarray(ad["lora_A"][e.index] if e.index else ad["lora_A"], np.float32)
        b = np.asarray(ad["lora_B"][e.index] if e.index else ad["lora_B"], np.float32)
        out[e.hf[:-len(".weight")]] = (a.T, b.T)
    return out


def module_pattern(name: str) -> str:
    """A module name with its layer / expert numbers generalised: `model.layers.3.mlp.experts.5.
    up_proj` -> the regular expression `model\\.layers\\.\\d+\\.mlp\\.experts\\.\\d+\\.up_proj`."""
    return r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))


def save_adapters(out_dir: str | Path, model_cfg: ModelConfig, lcfg: LoraConfig, params: dict, rest: dict,
                  *, dtype: str = "float32", base_model: str | None = None) -> Path:
    """Write adapter_model.safetensors and adapter_config.json (PEFT LoRA) into out_dir.

    params: the full params tree of a LoRA run (adapters included); dtype: float32 | bfloat16.
    Returns out_dir. Raises ValueError when params hold no adapters or dtype is unknown.
    """
    if dtype not in NP_DTYPES:
        raise ValueError(f"adapters: dtype must be one of {', '.join(NP_DTYPES)}, got {dtype!r}")
    tensors = adapter_tensors(model_cfg, params, rest)
    if not tensors:
        raise ValueError("adapters: the checkpoint has no LoRA adapters (lora.rank is 0)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = {}
    for name, (a, b) in tensors.items():
        flat[f"{PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(a.astype(NP_DTYPES[dtype]))
        flat[f"{PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(b.astype(NP_DTYPES[dtype]))
    save_file(flat, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    pats = sorted({module_pattern(n) for n in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lcfg.rank,
        "lora_alpha": lcfg.alpha,
        "lora_dropout": lcfg.dropout,
        "target_modules": "|".join(f"({p})" for p in pats),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
