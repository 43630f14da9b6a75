"""dsjax pure state -> HF directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

Writes config.json (`dsjax.hf.config.model_config_to_hf`), sharded safetensors (+ index) in the
on-disk per-expert layout of `save_pretrained` (`dsjax.hf.mapping`), and the tokenizer when
given. Linear weights, norms and embeddings in `dtype` (bfloat16 or float32); the router
`mlp.gate.weight` and `e_score_correction_bias` always float32 (transformers keeps them in fp32,
`_keep_in_fp32_modules_strict`). Streams one tensor at a time from the (device) arrays.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from dsjax.config import ModelConfig
from dsjax.hf import mapping as M
from dsjax.hf.config import model_config_to_hf
from dsjax.hf.safetensors_io import write_sharded

NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
FP32_KEYS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def save_hf(out_dir: str | Path, model_cfg: ModelConfig, params: dict, rest: dict, *,
            dtype: str = "bfloat16", tokenizer: str | Path | None = None,
            max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write an HF DeepSeek directory for (params, rest); returns its path.

    params/rest: pure dicts of jax or numpy arrays with the layout of `DeepSeekModel`.
    tokenizer: a `tokenizer.json` to copy (with a minimal tokenizer_config.json).
    Raises HFConfigError if transformers cannot express the configuration.
    """
    if dtype not in NP_DTYPES:
        raise ValueError(f"export: dtype must be one of {', '.join(NP_DTYPES)}, got {dtype!r}")
    hf_cfg = model_config_to_hf(model_cfg, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trees = {"params": params, "rest": rest}
    table = M.entries(model_cfg, params, rest)
    by_key = {e.hf: e for e in table}

    def np_dtype(e: M.Entry):
        return np.dtype(np.float32) if e.hf.endswith(FP32_KEYS) else NP_DTYPES[dtype]

    specs = []
    for e in table:
        leaf = M.get_path(trees[e.tree], e.path)
        specs.append((e.hf, np_dtype(e), M.hf_shape(e, tuple(leaf.shape))))

    def produce(name: str) -> np.ndarray:
        e = by_key[name]
        leaf = M.get_path(trees[e.tree], e.path)
        x = np.asarray(leaf[e.index] if e.index else leaf)
        x = x.T if e.op == M.T else x
        return np.ascontiguousarray(x.astype(np.float32).astype(np_dtype(e)))

    write_sharded(out, specs, produce, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
             model_cfg.max_position_embeddings}, indent=2) + "\n")
    return out
