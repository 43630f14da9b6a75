"""Typed, frozen run configuration: YAML overlays on dataclass defaults, plus `--set` overrides.

One mechanism: every scalar is read as text (YAML `BaseLoader`) and converted by the type of the
dataclass field it lands in. So `learning_rate: 3e-4` and `--set optim.learning_rate=1e-5` are
floats (a YAML 1.1 loader would read `3e-4` as a string), while a `str` field given `1e5` stays the
string "1e5". Unknown keys and wrong types raise `ConfigError` with a one-line message naming the
key and the nearest valid key, before any work is done.

Model field names follow HF `DeepseekV3Config` / `DeepseekV2Config`
(transformers/models/deepseek_v{2,3}/configuration_deepseek_v{2,3}.py).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A bad configuration value or key. The message is one line and names the key."""


# ----------------------------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeScaling:
    """YaRN RoPE scaling (HF `rope_scaling` / `rope_parameters` with `rope_type: yarn`)."""

    type: str = "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek V2/V3 architecture (HF field names) plus dsjax numerics and kernel switches."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"  # greedy | group_limited_greedy | noaux_tc
    scoring_func: str = "sigmoid"  # softmax | sigmoid
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0
    initializer_range: float = 0.02
    # dsjax numerics and switches
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16
    weight_dtype: str = "float32"  # master weights
    attention_impl: str = "auto"  # auto | pallas | reference
    moe_impl: str = "auto"  # auto | pallas | reference
    remat: str = "none"  # none | full | dots_saveable
    scan_layers: bool = False  # unrolled layers (faster: no stacked residual or gradient buffers); True: lax.scan over each stack (compile time independent of depth)
    router_bias_update_rate: float = 1e-3  # noaux_tc bias step (DeepSeek-V3 sec. 2.1.2, gamma)
    aux_loss_alpha: float = 0.0  # sequence-wise balance loss weight (DeepSeek-V3 eq. 17-20)
    mtp_loss_weight: float = 0.3

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes (-1 fills the rest) and the logical-axis rules preset.

    Presets (`sharding.rules.PRESETS`): dp (batch over data, params replicated), fsdp (ZeRO-3:
    params/grads/moments over fsdp), tp (+ heads/MLP/vocab over tensor), ep (+ experts over
    expert), cp (+ sequence over context, ring attention), fsdp_tp_ep, fsdp_ep_cp, all.
    """

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1
    context: int = 1
    preset: str = "fsdp"
    devices: int = -1  # use the first N devices (-1: all of them), e.g. to restore on fewer devices
    cp_layout: str = "striped"  # striped (causal load balance) | contiguous


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host start-up (`sharding.distributed.initialize`, before any other JAX call).

    Unset fields come from the environment (DSJAX_COORDINATOR_ADDRESS, DSJAX_NUM_PROCESSES,
    DSJAX_PROCESS_ID, or JAX's JAX_COORDINATOR_ADDRESS / cluster auto-detection: SLURM, Open MPI,
    Kubernetes, ...). With nothing set anywhere the run is single-process.
    """

    coordinator_address: Optional[str] = None  # host:port of process 0
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    initialization_timeout: int = 300  # s to wait for all processes to join
    heartbeat_timeout: int = 100  # s without a heartbeat before a process counts as dead
    cpu_collectives: str = "gloo"  # CPU backend cross-process collectives: gloo | mpi


@dataclass(frozen=True)
class OptimConfig:
    """AdamW + schedule + clipping (built by `dsjax.train.optim.build_optimizer`)."""

    learning_rate: float = 3e-4
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 100
    decay_steps: Optional[int] = None  # default: train.steps
    min_lr_ratio: float = 0.1
    wsd_decay_fraction: float = 0.2
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip_norm: float = 1.0
    mu_dtype: str = "float32"  # Adam first moment
    nu_dtype: str = "float32"  # Adam second moment (bfloat16 halves the optimizer's bytes)


@dataclass(frozen=True)
class DataConfig:
    """Corpus, tokenizer and packing."""

    train: list[str] = field(default_factory=lambda: ["stdlib"])  # "stdlib" or files/globs/.jsonl
    validation: list[str] = field(default_factory=list)  # empty: split off `train` by file path
    jsonl_text_field: str = "text"
    tokenizer: Optional[str] = None  # HF tokenizer.json; None: train byte-level BPE on first use
    tokenizer_vocab_size: Optional[int] = None  # default: model.vocab_size
    val_fraction: float = 0.02
    cache_dir: str = "~/.cache/dsjax"
    seq_len: int = 256
    batch_size: int = 8  # global batch, rows of seq_len tokens per optimizer micro-step
    seed: int = 0
    format: str = "text"  # "text": documents; "chat": JSONL conversations, assistant-only loss
    chat_template: Optional[str] = None  # tokenizer_config.json or .jinja; None: beside tokenizer
    chat_truncation: str = "drop"  # conversation > seq_len + 1 tokens: drop | drop_turns | cut_tail


@dataclass(frozen=True)
class TrainConfig:
    """Loop length, accumulation, logging, evaluation and numerics policy."""

    steps: int = 1000
    grad_accum: int = 1
    seed: int = 0
    run_dir: str = "runs/default"
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    skip_nonfinite: bool = False  # bf16/fp32: skip a non-finite update instead of stopping
    max_skipped_steps: int = 20  # stop after this many consecutive skipped (non-finite) steps
    progress: bool = True
    tensorboard: bool = True
    peak_tflops: Optional[float] = None  # per device; default from the device kind
    # base weights of a new run (not read on resume: the run's checkpoints hold every weight)
    init_from_hf: Optional[str] = None  # an HF directory
    init_from: Optional[str] = None  # a dsjax run directory: start from its newest checkpoint's weights


# LoRA target names (HF / PEFT module names). `gate_proj`/`up_proj`/`down_proj` are the dense
# and shared-expert MLPs; `experts.gate_proj`/`experts.up_proj`/`experts.down_proj` the routed
# experts (one adapter per expert; `experts` names all three); `all-linear` is every attention
# projection the model has, the dense and shared MLPs and the routed experts (not lm_head).
LORA_ATTENTION = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LORA_MLP = ("gate_proj", "up_proj", "down_proj")
LORA_EXPERTS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
LORA_TARGETS = LORA_ATTENTION + LORA_MLP + LORA_EXPERTS + ("experts", "lm_head", "all-linear")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (Hu et al. 2021, arXiv 2106.09685) and frozen modules for fine-tuning.

    rank > 0: y = x W + dropout(x) A B * alpha / rank on every `target_modules` projection
    (A [in, rank] random, B [rank, out] zero, as PEFT initialises them); the base weights are
    frozen except `modules_to_save` (PEFT's name: trained in full), and `freeze` always wins.
    rank = 0: full fine-tuning of every weight except those matching `freeze`.
    Patterns in modules_to_save / freeze name a parameter path component (`embed_tokens`,
    `lm_head`, `dense_layers`, `shared_experts`) or are fnmatch globs over the dotted path
    (`moe_layers.mlp.gate*`). Frozen weights are stored in the compute dtype, without optimizer
    state (`dsjax.train.finetune`).
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    modules_to_save: list[str] = field(default_factory=list)
    freeze: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax CheckpointManager settings."""

    every: int = 500
    max_to_keep: int = 3
    async_save: bool = True


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


# ----------------------------------------------------------------------------------------------
# Conversion of text values by field type
# ----------------------------------------------------------------------------------------------

_NULLS = {"null", "~", "none", "None", "NULL", ""}
_TRUE = {"true", "True", "TRUE", "yes", "on"}
_FALSE = {"false", "False", "FALSE", "no", "off"}


def _strip_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _convert(value: Any, tp: Any, key: str) -> Any:
    tp, optional = _strip_optional(tp)
    if optional and (value is None or (isinstance(value, str) and value in _NULLS)):
        return None
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"config: {key} must be a mapping, got {value!r}")
        return _build(tp, value, key)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config: {key} must be a list, got {value!r}")
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config: {key} must be a mapping, got {value!r}")
        return dict(value)
    if isinstance(value, (dict, list)):
        raise ConfigError(f"config: {key} must be a {tp.__name__}, got {value!r}")
    text = value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)
    if tp is str:
        return text
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"config: {key} must be a bool (true/false), got {text!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config: {key} must be an int, got {value!r}")
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                f = math.nan
            if math.isfinite(f) and f == int(f):
                return int(f)
            raise ConfigError(f"config: {key} must be an int, got {text!r}") from None
    if tp is float:
        try:
            return float(text.replace("_", ""))
        except ValueError:
            raise ConfigError(f"config: {key} must be a float, got {text!r}") from None
    raise ConfigError(f"config: {key}: unsupported field type {tp!r}")


def _hint(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _build(cls, values: dict, prefix: str, base=None):
    """Instantiate dataclass `cls` from a mapping of (text) values, over `base` if given."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        k = str(k)
        key = f"{prefix}.{k}" if prefix else k
        if k not in names:
            valid = [f"{prefix}.{n}" if prefix else n for n in names]
            raise ConfigError(f"config: unknown key '{key}'{_hint(key, valid)}")
        sub_base = getattr(base, k) if base is not None else None
        tp, _ = _strip_optional(hints[k])
        if dataclasses.is_dataclass(tp) and isinstance(v, dict):
            kwargs[k] = _build(tp, v, key, sub_base)
        else:
            kwargs[k] = _convert(v, hints[k], key)
    if base is not None:
        return dataclasses.replace(base, **kwargs)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - all fields have defaults
        raise ConfigError(f"config: {prefix}: {e}") from None


def _deep_set(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config: --set {dotted}: '{p}' is not a section")
    node[parts[-1]] = value


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


class _Loader(yaml.BaseLoader):
    """Every scalar as text (typed later by the schema); a key given twice in one mapping is an
    error (a plain loader keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:
                    raise yaml.constructor.ConstructorError(
                        None, None, "a key must be a scalar", key_node.start_mark) from None
                if dup:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key '{key}'", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        at = f" line {line + 1}" if line is not None else ""
        raise ConfigError(f"config: {where}{at}: invalid YAML ({getattr(e, 'problem', e)})") from None


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a `Config` from defaults, an optional YAML file and `key.sub=value` overrides.

    Raises:
      ConfigError: unknown key, wrong type, bad YAML, or an inconsistent value (see `validate`).
      FileNotFoundError: the YAML file does not exist.
    """
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config: file not found: {p}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config: {p}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start})") from None
        data = _read_yaml(text, str(p))
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"config: {p}: top level must be a mapping of sections")
        tree = data or {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"config: --set {item!r}: expected key.sub=value")
        key, text = item.split("=", 1)
        value = _read_yaml(text, f"--set {key}") if text.strip() else ""
        _deep_set(tree, key.strip(), value)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def from_dict(tree: dict) -> Config:
    """Build and validate a `Config` from a (typed or text) nested mapping, e.g. a saved run."""
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def to_dict(cfg) -> dict:
    """Plain nested dict (YAML/JSON-serialisable) of a config dataclass."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


_CHOICES = {
    "model.topk_method": ("greedy", "group_limited_greedy", "noaux_tc"),
    "model.scoring_func": ("softmax", "sigmoid"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.weight_dtype": ("float32", "bfloat16"),
    "model.attention_impl": ("auto", "pallas", "reference"),
    "model.moe_impl": ("auto", "pallas", "reference"),
    "model.remat": ("none", "full", "dots_saveable"),
    "mesh.preset": ("fsdp", "dp", "tp", "ep", "cp", "fsdp_tp_ep", "fsdp_ep_cp", "all"),
    "mesh.cp_layout": ("striped", "contiguous"),
    "distributed.cpu_collectives": ("gloo", "mpi"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "data.format": ("text", "chat"),
    "data.chat_truncation": ("drop", "drop_turns", "cut_tail"),
    "optim.mu_dtype": ("float32", "bfloat16"),
    "optim.nu_dtype": ("float32", "bfloat16"),
    "model.rope_scaling.type": ("yarn",),
}


# The range of every numeric field ("[a, b)": a <= v < b; "(": exclusive; inf: unbounded); a
# null optional field is not checked. The mesh axis sizes (>= 1 or -1) are checked below.
_RANGES = {
    "model.vocab_size": "[1, inf)", "model.hidden_size": "[1, inf)",
    "model.intermediate_size": "[0, inf)", "model.moe_intermediate_size": "[0, inf)",
    "model.num_hidden_layers": "[1, inf)", "model.num_attention_heads": "[1, inf)",
    "model.q_lora_rank": "[0, inf)", "model.kv_lora_rank": "[1, inf)",
    "model.qk_nope_head_dim": "[1, inf)", "model.qk_rope_head_dim": "[2, inf)",
    "model.v_head_dim": "[1, inf)", "model.n_routed_experts": "[0, inf)",
    "model.n_shared_experts": "[0, inf)", "model.num_experts_per_tok": "[1, inf)",
    "model.n_group": "[1, inf)", "model.topk_group": "[1, inf)",
    "model.routed_scaling_factor": "(0, inf)", "model.first_k_dense_replace": "[0, inf)",
    "model.rope_theta": "(0, inf)", "model.rms_norm_eps": "(0, inf)",
    "model.max_position_embeddings": "[1, inf)", "model.num_nextn_predict_layers": "[0, inf)",
    "model.initializer_range": "[0, inf)", "model.router_bias_update_rate": "[0, inf)",
    "model.aux_loss_alpha": "[0, inf)", "model.mtp_loss_weight": "[0, inf)",
    "model.rope_scaling.factor": "(0, inf)", "model.rope_scaling.original_max_position_embeddings": "[1, inf)",
    "model.rope_scaling.beta_fast": "(0, inf)", "model.rope_scaling.beta_slow": "(0, inf)",
    "model.rope_scaling.mscale": "[0, inf)", "model.rope_scaling.mscale_all_dim": "[0, inf)",
    "model.rope_scaling.attention_factor": "(0, inf)",
    "distributed.num_processes": "[1, inf)", "distributed.process_id": "[0, inf)",
    "distributed.initialization_timeout": "[1, inf)", "distributed.heartbeat_timeout": "[1, inf)",
    "optim.learning_rate": "[0, inf)", "optim.warmup_steps": "[0, inf)", "optim.decay_steps": "[1, inf)",
    "optim.min_lr_ratio": "[0, 1]", "optim.wsd_decay_fraction": "[0, 1]", "optim.b1": "[0, 1)",
    "optim.b2": "(0, 1)", "optim.eps": "(0, inf)", "optim.weight_decay": "[0, inf)",
    "optim.grad_clip_norm": "[0, inf)",  # 0: no clipping
    "data.tokenizer_vocab_size": "[1, inf)", "data.val_fraction": "[0, 1)", "data.seq_len": "[1, inf)",
    "data.batch_size": "[1, inf)", "data.seed": "[0, 4294967296)",
    "train.steps": "[0, inf)", "train.grad_accum": "[1, inf)", "train.seed": "[0, 4294967296)",
    "train.log_every": "[1, inf)", "train.eval_every": "[1, inf)", "train.eval_batches": "[1, inf)",
    "train.max_skipped_steps": "[1, inf)", "train.peak_tflops": "(0, inf)",
    "checkpoint.every": "[1, inf)", "checkpoint.max_to_keep": "[1, inf)",
    "lora.rank": "[0, inf)", "lora.alpha": "(0, inf)", "lora.dropout": "[0, 1)",
}


def _in_range(v, interval: str) -> bool:
    lo_text, hi_text = (t.strip() for t in interval[1:-1].split(","))
    lo, hi = float(lo_text), float(hi_text)
    above = v >= lo if interval[0] == "[" else v > lo
    below = v <= hi if interval[-1] == "]" else v < hi
    return above and below


def _get(cfg, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part) if obj is not None else None
    return obj


def numeric_fields(cls=None, prefix: str = "") -> list[str]:
    """Dotted keys of every int/float field of the schema (nested sections included)."""
    cls = Config if cls is None else cls
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        tp, _ = _strip_optional(tp)
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            out += numeric_fields(tp, key + ".")
        elif tp in (int, float):
            out.append(key)
    return out


def validate(cfg: Config) -> None:
    """Ranges of every numeric field and cross-field checks; raises `ConfigError` naming the
    offending key."""
    for key in numeric_fields():
        v = _get(cfg, key)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"config: {key} must be a finite number, got {v}")
        if v is not None and key in _RANGES and not _in_range(v, _RANGES[key]):
            raise ConfigError(f"config: {key} must be in {_RANGES[key]}, got {v}")
    d = cfg.data
    if not d.train:
        raise ConfigError("config: data.train must name at least one source ('stdlib', files, "
                          "directories or globs)")
    for name in ("train", "validation"):
        for i, src in enumerate(getattr(d, name)):
            if not src.strip():
                raise ConfigError(f"config: data.{name}[{i}] is empty")
    for key in ("train.run_dir", "data.cache_dir"):
        if not _get(cfg, key).strip():
            raise ConfigError(f"config: {key} must not be empty")
    for key, choices in _CHOICES.items():
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part) if obj is not None else None
        if obj is not None and obj not in choices:
            raise ConfigError(f"config: {key}={obj!r}: expected one of {', '.join(choices)}")
    m = cfg.model
    positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "num_experts_per_tok",
                "n_group", "topk_group", "max_position_embeddings"]
    for name in positive:
        if getattr(m, name) <= 0:
            raise ConfigError(f"config: model.{name} must be > 0, got {getattr(m, name)}")
    if m.qk_rope_head_dim <= 0 or m.qk_rope_head_dim % 2:
        raise ConfigError(f"config: model.qk_rope_head_dim must be even and > 0, got {m.qk_rope_head_dim}")
    if m.q_lora_rank is not None and m.q_lora_rank < 0:
        raise ConfigError(f"config: model.q_lora_rank must be null or >= 0, got {m.q_lora_rank}")
    if not 0 <= m.first_k_dense_replace <= m.num_hidden_layers:
        raise ConfigError(f"config: model.first_k_dense_replace={m.first_k_dense_replace} must be in "
                          f"[0, num_hidden_layers={m.num_hidden_layers}]")
    if m.num_moe_layers > 0:
        if m.n_routed_experts <= 0 or m.moe_intermediate_size <= 0:
            raise ConfigError("config: model.n_routed_experts and model.moe_intermediate_size must be > 0 "
                              "when there are MoE layers")
        if m.num_experts_per_tok > m.n_routed_experts:
            raise ConfigError(f"config: model.num_experts_per_tok={m.num_experts_per_tok} exceeds "
                              f"n_routed_experts={m.n_routed_experts}")
        if m.n_routed_experts % m.n_group:
            raise ConfigError(f"config: model.n_group={m.n_group} must divide n_routed_experts="
                              f"{m.n_routed_experts}")
        if m.topk_group > m.n_group:
            raise ConfigError(f"config: model.topk_group={m.topk_group} exceeds n_group={m.n_group}")
        if m.topk_method == "noaux_tc" and m.scoring_func != "sigmoid":
            raise ConfigError("config: model.topk_method=noaux_tc requires scoring_func=sigmoid")
        if m.topk_method == "noaux_tc" and m.n_group > 1 and m.n_routed_experts // m.n_group < 2:
            raise ConfigError("config: model.n_group: noaux_tc group scores need >= 2 experts per group")
        if m.num_experts_per_tok > m.topk_group * (m.n_routed_experts // m.n_group):
            raise ConfigError("config: model.num_experts_per_tok exceeds the experts in topk_group groups")
    if m.first_k_dense_replace > 0 and m.intermediate_size <= 0:
        raise ConfigError("config: model.intermediate_size must be > 0 when first_k_dense_replace > 0")
    if m.rope_scaling is not None and m.rope_scaling.factor <= 0:
        raise ConfigError(f"config: model.rope_scaling.factor must be > 0, got {m.rope_scaling.factor}")
    mc = cfg.mesh
    sizes = {a: getattr(mc, a) for a in ("data", "fsdp", "expert", "tensor", "context")}
    for a, n in sizes.items():
        if n == 0 or n < -1:
            raise ConfigError(f"config: mesh.{a}={n} must be >= 1 or -1 (fill the rest)")
    if sum(n == -1 for n in sizes.values()) > 1:
        raise ConfigError(f"config: mesh: only one axis may be -1, got {sizes}")
    if mc.devices == 0 or mc.devices < -1:
        raise ConfigError(f"config: mesh.devices={mc.devices} must be >= 1 or -1 (all)")
    if m.num_moe_layers > 0 and mc.expert > 1 and m.n_routed_experts % mc.expert:
        raise ConfigError(f"config: mesh.expert={mc.expert} must divide model.n_routed_experts="
                          f"{m.n_routed_experts}")
    if mc.tensor > 1 and m.num_attention_heads % mc.tensor:
        raise ConfigError(f"config: mesh.tensor={mc.tensor} must divide model.num_attention_heads="
                          f"{m.num_attention_heads}")
    if mc.context > 1 and mc.cp_layout == "striped" and m.num_nextn_predict_layers > 0:
        raise ConfigError("config: mesh.cp_layout=striped reorders the sequence, which the MTP shift "
                          "(model.num_nextn_predict_layers > 0) does not allow; use mesh.cp_layout=contiguous")
    if mc.context > 1 and cfg.data.seq_len % mc.context:
        raise ConfigError(f"config: mesh.context={mc.context} must divide data.seq_len={cfg.data.seq_len}")
    dc = cfg.distributed
    if dc.num_processes is not None and dc.num_processes < 1:
        raise ConfigError(f"config: distributed.num_processes must be >= 1, got {dc.num_processes}")
    if dc.process_id is not None and dc.num_processes is not None and not 0 <= dc.process_id < dc.num_processes:
        raise ConfigError(f"config: distributed.process_id={dc.process_id} must be in [0, num_processes)")
    d, t, o, c = cfg.data, cfg.train, cfg.optim, cfg.checkpoint
    if d.seq_len <= 0 or d.batch_size <= 0:
        raise ConfigError("config: data.seq_len and data.batch_size must be > 0")
    if d.seq_len > m.max_position_embeddings:
        raise ConfigError(f"config: data.seq_len={d.seq_len} exceeds model.max_position_embeddings="
                          f"{m.max_position_embeddings}")
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"config: data.val_fraction must be in [0, 1), got {d.val_fraction}")
    if d.format == "chat" and d.tokenizer is None:
        raise ConfigError("config: data.format=chat needs data.tokenizer (the checkpoint's "
                          "tokenizer.json, with its chat template in tokenizer_config.json)")
    if d.format == "chat" and d.train == ["stdlib"]:
        raise ConfigError("config: data.format=chat needs data.train: JSONL files of conversations")
    vocab = d.tokenizer_vocab_size or m.vocab_size
    if vocab > m.vocab_size:
        raise ConfigError(f"config: data.tokenizer_vocab_size={vocab} exceeds model.vocab_size={m.vocab_size}")
    if t.steps < 0 or t.grad_accum <= 0 or t.log_every <= 0:
        raise ConfigError("config: train.steps must be >= 0, train.grad_accum and train.log_every > 0")
    if o.learning_rate < 0 or o.warmup_steps < 0:
        raise ConfigError("config: optim.learning_rate and optim.warmup_steps must be >= 0")
    if c.every <= 0 or c.max_to_keep <= 0:
        raise ConfigError("config: checkpoint.every and checkpoint.max_to_keep must be > 0")
    if t.init_from is not None and t.init_from_hf is not None:
        raise ConfigError("config: train.init_from and train.init_from_hf are exclusive: name one")
    _validate_lora(cfg)


def _validate_lora(cfg: Config) -> None:
    lc, m = cfg.lora, cfg.model
    for key in ("target_modules", "modules_to_save", "freeze"):
        for i, name in enumerate(getattr(lc, key)):
            if not name.strip():
                raise ConfigError(f"config: lora.{key}[{i}] is empty")
    if lc.rank == 0:
        if lc.modules_to_save:
            raise ConfigError("config: lora.modules_to_save needs lora.rank > 0 (with rank 0 every "
                              "weight not matched by lora.freeze is trained)")
        return
    if not lc.target_modules:
        raise ConfigError("config: lora.target_modules must name at least one module when lora.rank > 0")
    for i, name in enumerate(lc.target_modules):
        key = f"lora.target_modules[{i}]"
        if name not in LORA_TARGETS:
            raise ConfigError(f"config: {key}={name!r}: expected one of {', '.join(LORA_TARGETS)}"
                              f"{_hint(name, LORA_TARGETS)}")
        if name == "q_proj" and m.q_lora_rank:
            raise ConfigError(f"config: {key}='q_proj': this model has q_lora_rank={m.q_lora_rank}, "
                              f"so its query is q_a_proj + q_b_proj")
        if name in ("q_a_proj", "q_b_proj") and not m.q_lora_rank:
            raise ConfigError(f"config: {key}={name!r}: this model has no q LoRA (q_lora_rank is "
                              f"null), its query is q_proj")
        if name.startswith("experts") and (m.num_moe_layers == 0 or m.n_routed_experts == 0):
            raise ConfigError(f"config: {key}={name!r}: the model has no routed experts")
        if name in LORA_MLP and m.first_k_dense_replace == 0 and m.n_shared_experts == 0:
            raise ConfigError(f"config: {key}={name!r}: the model has no dense or shared-expert MLP "
                              f"(routed experts are experts.{name})")
        if name == "lm_head" and m.tie_word_embeddings:
            raise ConfigError(f"config: {key}='lm_head': tied embeddings have no lm_head")
