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
Weights trained in full (lora.modules_to_save) are written as PEFT's `save_pretrained` writes
a `modules_to_save` module's trained copy: under the module's plain HF key,
  base_model.model.lm_head.weight   [V, D]
(PEFT drops the in-memory `modules_to_save.default.` infix on save and puts it back on load),
and their HF module names are listed in the config's `modules_to_save`. A module that is both
targeted and trained in full is written as its merged weight W + B A alpha / r without an
adapter, since PEFT never puts a LoRA layer on a `modules_to_save` module.
`target_modules` in the config is a regular expression (PEFT matches a string by full match)
naming exactly the modules that have adapters, so PEFT builds no others.
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
from dsjax.model.lora import split_adapters, trained_base_paths

PREFIX = "base_model.model."
NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def adapter_tensors(model_cfg: ModelConfig, lcfg: LoraConfig, params: dict,
                    rest: dict) -> tuple[dict[str, tuple], dict[str, np.ndarray]]:
    """The PEFT view of the full params tree `params` of a LoRA run, as float32 numpy arrays:
    ({HF module name (e.g. `model.layers.3.mlp.experts.5.up_proj`): (A [r, in], B [out, r])} for
    every adapter, {HF weight key (e.g. `lm_head.weight`): weight in HF layout} for every base
    weight that trains in full (`trained_base_paths`), its adapter folded in if it has one)."""
    base, ads = split_adapters(params)
    full = trained_base_paths(lcfg, params)
    scale = float(lcfg.alpha) / lcfg.rank
    pairs, saved = {}, {}
    for e in M.entries(model_cfg, base, rest):
        if e.tree != "params" or not e.hf.endswith(".weight"):
            continue
        if e.path[-1] == "kernel":
            ad = M.get_path(ads, e.path[:-1] + ("lora",))
        else:  # a routed-expert weight [.., E, in, out], or a norm (never adapted)
            ad = M.get_path(ads, e.path[:-1] + ("experts", e.path[-1]))
        pick = lambda x: np.asarray(x[e.index] if e.index else x, np.float32)  # noqa: E731
        if e.path in full:
            w = pick(M.get_path(base, e.path))
            if ad is not None:
                w = w + pick(ad["lora_A"]) @ pick(ad["lora_B"]) * np.float32(scale)
            saved[e.hf] = w.T if e.op == M.T else w
        elif ad is not None:
            pairs[e.hf[:-len(".weight")]] = (pick(ad["lora_A"]).T, pick(ad["lora_B"]).T)
    return pairs, saved


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
    tensors, saved = adapter_tensors(model_cfg, lcfg, params, rest)
    if not tensors:
        raise ValueError("adapters: the checkpoint has no LoRA adapters (lora.rank is 0)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = {}
    for name, (a, b) in tensors.items():
        flat[f"{PREFIX}{name}.lora_A.weight"] = np.ascontiguousarray(a.astype(NP_DTYPES[dtype]))
        flat[f"{PREFIX}{name}.lora_B.weight"] = np.ascontiguousarray(b.astype(NP_DTYPES[dtype]))
    for key, w in saved.items():
        flat[f"{PREFIX}{key}"] = np.ascontiguousarray(w.astype(NP_DTYPES[dtype]))
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
        "modules_to_save": sorted({k[:-len(".weight")] for k in saved}) or None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
