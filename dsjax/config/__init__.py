"""Typed, frozen run configuration: YAML overlays on dataclass defaults, plus `--set` overrides.

Files compose: `load([a.yaml, b.yaml], sets)` applies a.yaml then b.yaml over the defaults, and
the overrides last; a file's top-level `base: other.yaml` (relative to the file) is applied
before the file's own keys.

One mechanism: every scalar is read as text (YAML `BaseLoader`) and converted by the type of the
dataclass field it lands in. So `learning_rate: 3e-4` and `--set optim.learning_rate=1e-5` are
floats (a YAML 1.1 loader would read `3e-4` as a string), while a `str` field given `1e5` stays the
string "1e5". Unknown keys and wrong types raise `ConfigError` with a one-line message naming the
key and the nearest valid key, before any work is done.

Model field names follow HF `DeepseekV3Config` / `DeepseekV2Config`
(transformers/models/deepseek_v{2,3}/configuration_deepseek_v{2,3}.py).

The package: `schema` (the dataclasses and ConfigError), `reading` (YAML and `--set` into a
Config, and back to YAML), `checks` (choices, ranges and cross-field rules), `paths` (the inputs
that path-valued fields name exist; checked when a run starts, not when a config is read).
"""
from dsjax.config.checks import numeric_fields, validate
from dsjax.config.reading import dump_yaml, from_dict, load, to_dict
from dsjax.config.schema import (LORA_ATTENTION, LORA_EXPERTS, LORA_MLP, LORA_TARGETS, CheckpointConfig,
                                 Config, ConfigError, DataConfig, DistributedConfig, LoraConfig,
                                 MeshConfig, ModelConfig, OptimConfig, RopeScaling, TrainConfig)

__all__ = ["Config", "ConfigError", "ModelConfig", "RopeScaling", "MeshConfig", "DistributedConfig",
           "OptimConfig", "DataConfig", "TrainConfig", "LoraConfig", "CheckpointConfig",
           "LORA_ATTENTION", "LORA_MLP", "LORA_EXPERTS", "LORA_TARGETS",
           "load", "from_dict", "to_dict", "dump_yaml", "validate", "numeric_fields"]
