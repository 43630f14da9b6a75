"""Hugging Face interop for DeepSeek-V2/V3: config.json <-> ModelConfig, safetensors <-> pure state.

  load_hf(dir)                         -> (ModelConfig, ModelFns, params, rest)
  load_hf_params(dir, cfg, params, rest) -> (params, rest)   (used by train.init_from_hf)
  save_hf(out, cfg, params, rest, dtype="bfloat16", tokenizer=None)
The mapping is one table (`dsjax.hf.mapping`); maths parity is tested against transformers in
tests/dsjax/test_hf_parity.py.
"""
from dsjax.hf.config import HFConfigError, model_config_from_hf, model_config_to_hf
from dsjax.hf.export import save_hf
from dsjax.hf.load import load_hf, load_hf_params
from dsjax.hf.safetensors_io import CheckpointError, SafetensorsCheckpoint

__all__ = ["HFConfigError", "CheckpointError", "SafetensorsCheckpoint", "model_config_from_hf",
           "model_config_to_hf", "load_hf", "load_hf_params", "save_hf"]
