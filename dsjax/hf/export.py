"""dsjax pure state -> HF directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.

Writes config.json (`dsjax.hf.config.model_config_to_hf`), sharded safetensors (+ index) in the
on-disk per-expert layout of `save_pretrained` (`dsjax.hf.mapping`), and the tokenizer when
given, with its special-token ids (`special_token_ids`) in config.json and in
generation_config.json, so transformers' `generate` stops where `dsjax.generate` stops. Linear weights, norms and embeddings in `dtype` (bfloat16 or float32); the router
`mlp.gate.weight` and `e_score_correction_bias` always float32 (transformers keeps them in fp32,
`_keep_in_fp32_modules_strict`). Streams one tensor at a time from the (device) arrays.

dtype "fp8" writes DeepSeek-V3's own FP8 layout: the linear weights of the decoder layers
(`fp8_quantized`: attention projections, dense / shared / routed expert MLPs, the MTP eh_proj)
as float8_e4m3fn [out, in] with a float32 `<name>_scale_inv` [ceil(out/128), ceil(in/128)]
(the dequantisation multiplier per 128 x 128 block, `pallas_kernels.fp8.reference.
quantize_blocks_128x128`); embeddings, norms and the lm_head in bfloat16, the router in float32;
config.json gets `quantization_config` {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128]}. A weight held as a frozen `Fp8Weight` is written as stored (no
second rounding); any other is quantised from its own values.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from tokenizers import Tokenizer

from dsjax.config import ModelConfig
from dsjax.data import tokenizer as tk
from dsjax.hf import mapping as M
from dsjax.hf.config import model_config_to_hf
from dsjax.hf.safetensors_io import SCALE_SUFFIX, write_sharded
from pallas_kernels.fp8 import reference as fp8_ref
from pallas_kernels.fp8.frozen import Fp8Weight, scale_grid

NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
DTYPES = tuple(NP_DTYPES) + ("fp8",)
FP32_KEYS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}


def fp8_quantized(hf_key: str) -> bool:
    """Whether DeepSeek-V3's FP8 checkpoint stores this HF tensor in FP8: the `*_proj` linear
    weights of the decoder (and MTP) layers; not embeddings, norms, lm_head, router gate or its
    `e_score_correction_bias`."""
    return hf_key.startswith("model.layers.") and hf_key.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def _block_slice(leaf, index: tuple):
    return leaf[index] if index else leaf


def special_token_ids(tokenizer: str | Path, tokenizer_config: str | Path | None = None
                      ) -> dict[str, int | None]:
    """{"bos_token_id", "eos_token_id", "pad_token_id"} of a `tokenizer.json`, chosen as
    `dsjax.generate` chooses the token it stops at.

    With `tokenizer_config` (a chat run's tokenizer_config.json, as `generate --chat` reads it):
    its `eos_token`, its `pad_token` (EOS when absent) and its `bos_token` (None when absent).
    Without: EOS and pad as `dsjax.data.tokenizer.wrap` finds them (`EOS_NAMES`, `PAD_NAMES`,
    pad = EOS when none), and no BOS (dsjax adds none).
    Raises ValueError naming the file when a named token is not in the tokenizer or no EOS is found.
    """
    tok = Tokenizer.from_file(str(tokenizer))
    if tokenizer_config is None:
        t = tk.wrap(tok, tokenizer)
        return {"bos_token_id": None, "eos_token_id": t.eos_id, "pad_token_id": t.pad_id}
    conf = json.loads(Path(tokenizer_config).read_text(encoding="utf-8"))
    ids: dict[str, int | None] = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        text = conf.get(key)  # a string, or an AddedToken dict
        text = text.get("content") if isinstance(text, dict) else text
        if not isinstance(text, str):
            ids[key + "_id"] = None
            continue
        ids[key + "_id"] = tok.token_to_id(text)
        if ids[key + "_id"] is None:
            raise ValueError(f"{tokenizer_config}: {key} {text!r} is not a token of {tokenizer}")
    if ids["eos_token_id"] is None:
        raise ValueError(f"{tokenizer_config}: no eos_token")
    if ids["pad_token_id"] is None:
        ids["pad_token_id"] = ids["eos_token_id"]
    return ids


def save_hf(out_dir: str | Path, model_cfg: ModelConfig, params: dict, rest: dict, *,
            dtype: str = "bfloat16", tokenizer: str | Path | None = None,
            tokenizer_config: str | Path | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write an HF DeepSeek directory for (params, rest); returns its path.

    params/rest: pure dicts of jax or numpy arrays with the layout of `DeepSeekModel` (a leaf
      may be a frozen `Fp8Weight`).
    dtype: "bfloat16" | "float32" | "fp8" (DeepSeek-V3's FP8 layout, module docstring).
    tokenizer: a `tokenizer.json` to copy; its special-token ids (`special_token_ids`) go into
      config.json and generation_config.json. Without one, those ids are written as null (no
      guess: transformers' defaults name tokens of DeepSeek's own vocabulary).
    tokenizer_config: a chat run's tokenizer_config.json (chat template and special tokens) to
      copy beside it; without it a minimal one naming the EOS and pad tokens is written.
    Raises HFConfigError if transformers cannot express the configuration, ValueError when the
    tokenizer has no EOS or the tokenizer config names a token the tokenizer lacks.
    """
    if dtype not in DTYPES:
        raise ValueError(f"export: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    fp8 = dtype == "fp8"
    dtype = "bfloat16" if fp8 else dtype  # of the tensors FP8 leaves as they are
    hf_cfg = model_config_to_hf(model_cfg, dtype)
    if fp8:
        hf_cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    if tokenizer is not None and not Path(tokenizer).is_file():
        tokenizer = None
    ids = (special_token_ids(tokenizer, tokenizer_config) if tokenizer is not None else
           {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None})
    hf_cfg.update(ids)
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
        shape = M.hf_shape(e, tuple(leaf.shape))
        if fp8 and fp8_quantized(e.hf):
            specs += [(e.hf, FP8, shape), (e.hf + SCALE_SUFFIX, np.dtype(np.float32), scale_grid(shape))]
        else:
            specs.append((e.hf, np_dtype(e), shape))
    quantized: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # a weight's (q, s) until both are written

    def fp8_pair(name: str) -> tuple[np.ndarray, np.ndarray]:
        """(q [out, in] e4m3, scale_inv [ceil(out/128), ceil(in/128)] fp32) of HF weight `name`."""
        e = by_key[name]
        leaf = M.get_path(trees[e.tree], e.path)
        if isinstance(leaf, Fp8Weight):  # as stored: values and scales transposed, no rounding
            q, sc = np.asarray(_block_slice(leaf.q, e.index)), np.asarray(_block_slice(leaf.s, e.index))
        else:
            q, sc = fp8_ref.quantize_blocks_128x128(np.asarray(_block_slice(leaf, e.index), np.float32))
            q, sc = np.asarray(q), np.asarray(sc)
        return np.ascontiguousarray(q.T), np.ascontiguousarray(sc.T.astype(np.float32))

    def produce(name: str) -> np.ndarray:
        if fp8 and name.endswith(SCALE_SUFFIX) and fp8_quantized(name[:-len(SCALE_SUFFIX)]):
            return quantized.pop(name[:-len(SCALE_SUFFIX)])[1]
        if fp8 and fp8_quantized(name):
            quantized[name] = fp8_pair(name)
            return quantized[name][0]
        e = by_key[name]
        leaf = M.get_path(trees[e.tree], e.path)
        if isinstance(leaf, Fp8Weight):
            leaf = Fp8Weight(_block_slice(leaf.q, e.index), _block_slice(leaf.s, e.index)).dequantize()
            x = np.asarray(leaf)
        else:
            x = np.asarray(leaf[e.index] if e.index else leaf)
        x = x.T if e.op == M.T else x
        return np.ascontiguousarray(x.astype(np.float32).astype(np_dtype(e)))

    write_sharded(out, specs, produce, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        if tokenizer_config is not None:
            shutil.copyfile(tokenizer_config, out / "tokenizer_config.json")
        else:
            vocab = Tokenizer.from_file(str(tokenizer))
            (out / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast",
                 "model_max_length": model_cfg.max_position_embeddings,
                 "eos_token": vocab.id_to_token(ids["eos_token_id"]),
                 "pad_token": vocab.id_to_token(ids["pad_token_id"])}, indent=2) + "\n")
    return out
