"""LoRA adapters alone, in PEFT's format: `adapter_model.safetensors` + `adapter_config.json`,
written so that `peft.PeftModel.from_pretrained` on the base model gives the merged model's
logits (PEFT 0.21 on transformers 5, where a DeepSeek model's routed experts are fused 3-D
parameters; also the per-expert modules of transformers 4).

Keys follow PEFT's `get_peft_model_state_dict` for a LoRA on an HF DeepSeek model:
  base_model.model.model.layers.{n}.self_attn.kv_b_proj.lora_A.weight   [r, in]
  base_model.model.model.layers.{n}.self_attn.kv_b_proj.lora_B.weight   [out, r]
  base_model.model.lm_head.lora_A.weight ...
How PEFT finds each kind of target:
  * attention projections and lm_head: `target_modules`, a regular expression (PEFT matches a
    string by full match) naming them. On transformers 5 PEFT reduces it to the modules' last
    names, so a name adapted in some layers only gets (zero, inactive) adapters in the others.
  * routed experts: written per expert, as PEFT names adapters on the per-expert `nn.Linear`
    modules of the HF on-disk layout (also vLLM's): base_model.model.model.layers.{n}.mlp.
    experts.{j}.gate_proj.lora_A.weight [r, D] and ...lora_B.weight [F, r]. Their
    `target_modules` pattern also matches `model.layers.{n}.mlp.experts.gate_proj`, the name
    PEFT probes on transformers 5 before it stacks the per-expert pairs onto the fused
    `gate_up_proj` / `down_proj` parameters (rank 2r and alpha 2 alpha for `gate_up_proj`, its
    own rank_pattern / alpha_pattern, same alpha / r). PEFT 0.21 maps the keys right only when
    gate_proj, up_proj and down_proj all have adapters, so an expert with some of them adapted
    gets zero adapters (B = 0, no effect) on the others.
  * dense and shared-expert MLPs (`mlp.gate_proj`, `mlp.shared_experts.up_proj`, ...):
    `target_parameters`, their weights by full name (`model.layers.0.mlp.gate_proj.weight`).
    PEFT on transformers 5 moves every gate_proj / up_proj / down_proj *module* name onto the
    fused routed experts, so a module name would lose these adapters; a parameter target keeps
    them (PEFT's ParamWrapper, the same W + B A alpha / r).
`lora_dropout` is written as 0: PEFT's ParamWrapper (routed experts, MLP parameters) refuses any
other value, and dropout is the identity in inference anyway; the run's value is logged.
Weights trained in full (lora.modules_to_save) are written as PEFT's `save_pretrained` writes
a `modules_to_save` module's trained copy: under the module's plain HF key,
  base_model.model.lm_head.weight   [V, D]
(PEFT drops the in-memory `modules_to_save.default.` infix on save and puts it back on load),
and their HF module names are listed in the config's `modules_to_save`. A module that is both
targeted and trained in full is written as its merged weight W + B A alpha / r without an
adapter, since PEFT never puts a LoRA layer on a `modules_to_save` module. Routed experts
trained in full are left out (logged): transformers 5 has no per-expert module for
`modules_to_save`; the merged model holds them.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save

from dsjax.config import LoraConfig, ModelConfig
from dsjax.hf import mapping as M
from dsjax.model.lora import split_adapters, trained_base_paths

log = logging.getLogger("dsjax.hf")
PREFIX = "base_model.model."
NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)$")
_MLP = re.compile(r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)$")


def adapter_tensors(model_cfg: ModelConfig, lcfg: LoraConfig, params: dict,
                    rest: dict) -> tuple[dict[str, tuple], dict[str, np.ndarray], list[str]]:
    """The PEFT view of the full params tree `params` of a LoRA run, as float32 numpy arrays:
    ({HF module name (e.g. `model.layers.3.mlp.experts.5.up_proj`): (A [r, in], B [out, r])} for
    every adapter, {HF weight key (e.g. `lm_head.weight`): weight in HF layout} for every base
    weight that trains in full (`trained_base_paths`), its adapter folded in if it has one,
    [HF weight keys left out]: routed-expert weights trained in full, which PEFT cannot take).
    An expert with an adapter on some of gate_proj / up_proj / down_proj gets zero adapters on
    the others (PEFT on transformers 5 loads the fused expert adapters only as all three)."""
    base, ads = split_adapters(params)
    full = trained_base_paths(lcfg, params)
    scale = float(lcfg.alpha) / lcfg.rank
    pairs, saved, left_out = {}, {}, []
    for e in M.entries(model_cfg, base, rest):
        if e.tree != "params" or not e.hf.endswith(".weight"):
            continue
        if e.path[-1] == "kernel":
            ad = M.get_path(ads, e.path[:-1] + ("lora",))
        else:  # a routed-expert weight [.., E, in, out], or a norm (never adapted)
            ad = M.get_path(ads, e.path[:-1] + ("experts", e.path[-1]))
        pick = lambda x: np.asarray(x[e.index] if e.index else x, np.float32)  # noqa: E731
        if e.path in full:
            if _EXPERT.match(e.hf[:-len(".weight")]):
                left_out.append(e.hf)
                continue
            w = pick(M.get_path(base, e.path))
            if ad is not None:
                w = w + pick(ad["lora_A"]) @ pick(ad["lora_B"]) * np.float32(scale)
            saved[e.hf] = w.T if e.op == M.T else w
        elif ad is not None:
            pairs[e.hf[:-len(".weight")]] = (pick(ad["lora_A"]).T, pick(ad["lora_B"]).T)
    for name, (a, b) in list(pairs.items()):
        m = _EXPERT.match(name)
        if not m:
            continue
        r = a.shape[0]
        D, F = (a.shape[1], b.shape[0]) if m.group(3) != "down_proj" else (b.shape[0], a.shape[1])
        for proj, (n_in, n_out) in (("gate_proj", (D, F)), ("up_proj", (D, F)), ("down_proj", (F, D))):
            other = f"{m.group(1)}{m.group(2)}.{proj}"
            if other not in pairs:
                pairs[other] = (np.zeros((r, n_in), np.float32), np.zeros((n_out, r), np.float32))
    return pairs, saved, left_out


def module_pattern(name: str) -> str:
    """A module name with its layer / expert numbers generalised: `model.layers.3.mlp.experts.5.
    up_proj` -> the regular expression `model\\.layers\\.\\d+\\.mlp\\.experts(\\.\\d+)?\\.up_proj`
    (a routed expert's pattern also matches the name without the expert number, which PEFT
    probes on transformers 5)."""
    pat = r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))
    return pat.replace(r"experts\.\d+\.", r"experts(\.\d+)?\.")


def peft_targets(names) -> tuple[str | None, list[str] | None]:
    """(target_modules, target_parameters) of adapter_config.json for the adapted HF module
    names: a regular expression for the attention projections, lm_head and the routed experts
    (None when there are none), and the weights of the dense and shared-expert MLPs by full
    name (None when there are none)."""
    params = sorted(f"{n}.weight" for n in names if _MLP.search(n))
    pats = sorted({module_pattern(n) for n in names if not _MLP.search(n)})
    return ("|".join(f"({p})" for p in pats) or None), (params or None)


def save_adapters(out_dir: str | Path, model_cfg: ModelConfig, lcfg: LoraConfig, params: dict, rest: dict,
                  *, dtype: str = "float32", base_model: str | None = None) -> Path:
    """Write adapter_model.safetensors and adapter_config.json (PEFT LoRA) into out_dir.

    params: the full params tree of a LoRA run (adapters included); dtype: float32 | bfloat16.
    Logs (logger `dsjax.hf`) the dropout written (0) and any weights left out. Returns out_dir.
    Raises ValueError when params hold no adapters or dtype is unknown.
    """
    if dtype not in NP_DTYPES:
        raise ValueError(f"adapters: dtype must be one of {', '.join(NP_DTYPES)}, got {dtype!r}")
    tensors, saved, left_out = adapter_tensors(model_cfg, lcfg, params, rest)
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
    # written from Python like every other exported file, so its mode follows the umask
    # (safetensors' save_file creates its file with mode 0600)
    (out / "adapter_model.safetensors").write_bytes(save(flat, metadata={"format": "pt"}))
    modules, weights = peft_targets(tensors)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lcfg.rank,
        "lora_alpha": lcfg.alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "target_parameters": weights,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": sorted({k[:-len(".weight")] for k in saved}) or None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if lcfg.dropout:
        log.info("adapters: %s/adapter_config.json has lora_dropout 0 (the run trained with "
                 "lora.dropout=%g; PEFT's ParamWrapper takes no dropout, inference uses none)",
                 out, lcfg.dropout)
    if left_out:
        log.warning("adapters: %d routed-expert weight(s) trained in full (lora.modules_to_save, "
                    "e.g. %s) are not in %s: PEFT on transformers 5 has no per-expert module for "
                    "them; the merged model holds them", len(left_out), left_out[0], out)
    return out
