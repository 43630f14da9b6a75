"""The run configuration's schema: frozen dataclasses, one per section (`model`, `mesh`,
`distributed`, `optim`, `data`, `train`, `checkpoint`, `lora`), their defaults, and ConfigError.

Model field names follow HF `DeepseekV3Config` / `DeepseekV2Config`
(transformers/models/deepseek_v{2,3}/configuration_deepseek_v{2,3}.py).
"""
from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Optional


class ConfigError(ValueError):
    """A bad configuration value or key. The message is one line and names the key."""




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
    fp8: str = "none"  # none | blockwise: DeepSeek-V3's FP8 training (sec. 3.3) of the attention projections, dense and shared MLPs and routed experts (`pallas_kernels.fp8`); embedding, lm_head, router, norms and attention stay in the compute dtype
    remat: str = "none"  # none | full | dots_saveable
    moe_recompute: bool = False  # MoE blocks keep only the experts' gate/up GEMM outputs (and routed adapters' x A) for the backward and recompute the token permutation, SwiGLU and dense adapters (less activation memory)
    round_logits: bool = False  # True: the lm_head writes its logits in the compute dtype and the loss upcasts them to fp32, as HF transformers' bf16/fp16 models do (half the loss's logit bytes); False: fp32 logits
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

    train: list[str] = field(default_factory=lambda: ["stdlib"])  # "stdlib" or files/dirs/globs: text, .jsonl, .parquet
    validation: list[str] = field(default_factory=list)  # empty: split off `train` by file path
    text_field: str = "text"  # JSONL field / Parquet column holding a document's text
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



def _strip_optional(tp):
    """(T, True) for Optional[T] / T | None, else (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _hint(name: str, names) -> str:
    """The suffix " (did you mean 'x'?)" for the nearest of `names` to a misspelt key, else ""."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""
