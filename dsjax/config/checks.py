"""Checks of a built configuration: the allowed choices and range of every field, and the
cross-field rules; each failure is a one-line `ConfigError` naming the key.
"""
from __future__ import annotations

import dataclasses
import math
import typing

import jax

from dsjax.config.schema import LORA_MLP, LORA_TARGETS, Config, ConfigError, _hint, _strip_optional
from pallas_kernels.flash_attention.mosaic_common import check_supported
from pallas_kernels.moe.api import pallas_unsupported
from pallas_kernels.moe.mosaic_gpu import TileConfig


_CHOICES = {
    "model.topk_method": ("greedy", "group_limited_greedy", "noaux_tc"),
    "model.scoring_func": ("softmax", "sigmoid"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.weight_dtype": ("float32", "bfloat16"),
    "model.attention_impl": ("auto", "pallas", "reference"),
    "model.moe_impl": ("auto", "pallas", "reference"),
    "model.fp8": ("none", "blockwise"),
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
        raise ConfigError("config: data.format=chat needs data.train: JSONL or Parquet files of conversations")
    vocab = d.tokenizer_vocab_size or m.vocab_size
    if vocab > m.vocab_size:
        raise ConfigError(f"config: data.tokenizer_vocab_size={vocab} exceeds model.vocab_size={m.vocab_size}")
    if t.steps < 0 or t.grad_accum <= 0 or t.log_every <= 0:
        raise ConfigError("config: train.steps must be >= 0, train.grad_accum and train.log_every > 0")
    if o.learning_rate < 0 or o.warmup_steps < 0:
        raise ConfigError("config: optim.learning_rate and optim.warmup_steps must be >= 0")
    _validate_moment_decay(o)
    if c.every <= 0 or c.max_to_keep <= 0:
        raise ConfigError("config: checkpoint.every and checkpoint.max_to_keep must be > 0")
    if t.init_from is not None and t.init_from_hf is not None:
        raise ConfigError("config: train.init_from and train.init_from_hf are exclusive: name one")
    _validate_lora(cfg)
    _validate_kernels(m)
    _validate_fp8(cfg)
    check_moe_kernel_rows(cfg)


def _validate_moment_decay(o) -> None:
    """An Adam moment stored in a narrow dtype stops decaying when one step's change, 1 - beta of
    its value, is under half the dtype's spacing at that value (2^-8 to 2^-9 of it for bfloat16):
    beta * v then rounds back to v (bfloat16 with b2 = 0.999: the second moment keeps a stale
    large value, which shrinks the updates). 1 - beta >= 2^-(mantissa bits + 1) always moves it."""
    for beta_key, beta, dtype_key, dtype in (("b1", o.b1, "mu_dtype", o.mu_dtype),
                                             ("b2", o.b2, "nu_dtype", o.nu_dtype)):
        step = 2.0 ** -(jax.numpy.finfo(dtype).nmant + 1)
        if 1.0 - beta < step:
            raise ConfigError(f"config: optim.{beta_key}={beta} with optim.{dtype_key}={dtype}: one step "
                              f"changes the moment by 1 - {beta_key} = {1.0 - beta:.3g} of its value, under "
                              f"{dtype}'s rounding step ({step:.3g} of it), so it stops decaying; use "
                              f"optim.{dtype_key}=float32 or optim.{beta_key} <= {1.0 - step:.6g}")


def _validate_kernels(m) -> None:
    """model.attention_impl / moe_impl = pallas: the Mosaic GPU kernels' limits on the model's
    dtype and widths, which a run would otherwise meet at its first step ("auto" takes the
    reference where the kernels do not fit)."""
    if "pallas" not in (m.attention_impl, m.moe_impl):
        return
    dt = jax.numpy.dtype(m.dtype)
    if m.attention_impl == "pallas":
        dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = jax.ShapeDtypeStruct((1, 128, m.num_attention_heads, dqk), dt)
        v = jax.ShapeDtypeStruct((1, 128, m.num_attention_heads, m.v_head_dim), dt)
        try:
            check_supported(q, q, v)
        except ValueError as err:
            raise ConfigError(f"config: model.attention_impl=pallas does not fit model.dtype={m.dtype}, "
                              f"qk_nope_head_dim + qk_rope_head_dim = {dqk}, v_head_dim={m.v_head_dim}: "
                              f"{err}; use attention_impl=auto or reference") from None
    if m.moe_impl == "pallas" and m.num_moe_layers > 0:
        rows = jax.ShapeDtypeStruct((TileConfig().tile_m, m.hidden_size), dt)
        gate = jax.ShapeDtypeStruct((m.n_routed_experts, m.hidden_size, m.moe_intermediate_size), dt)
        reason = pallas_unsupported(rows, gate)
        if reason:
            raise ConfigError(f"config: model.moe_impl=pallas does not fit model.dtype={m.dtype}, "
                              f"hidden_size={m.hidden_size}, moe_intermediate_size="
                              f"{m.moe_intermediate_size}: {reason}; use moe_impl=auto or reference")


def _validate_fp8(cfg: Config) -> None:
    """model.fp8=blockwise under tensor parallelism: each width split over `tensor` must split
    into shards of whole 128-wide FP8 scale tiles, or a tile would straddle two ranks (the
    activations' 1 x 128 tiles and the weights' 128 x 128 blocks run along these widths).
    ZeRO-3 (`fsdp`) gathers a weight before its GEMM and data / context / expert parallelism
    split tokens or experts, which the tiles do not cross within a rank's GEMM, so only
    `tensor` is checked; mesh.tensor=-1 (size known only at run time) is not."""
    m, t = cfg.model, cfg.mesh.tensor
    if m.fp8 != "blockwise" or t <= 1:
        return
    H = m.num_attention_heads
    widths = {"num_attention_heads * v_head_dim (o_proj input)": H * m.v_head_dim,
              "num_attention_heads * (qk_nope_head_dim + v_head_dim) (kv_b_proj output)":
                  H * (m.qk_nope_head_dim + m.v_head_dim),
              "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim) (query output)":
                  H * (m.qk_nope_head_dim + m.qk_rope_head_dim)}
    if m.first_k_dense_replace > 0:
        widths["intermediate_size"] = m.intermediate_size
    if m.num_moe_layers > 0:
        widths["moe_intermediate_size"] = m.moe_intermediate_size
        if m.n_shared_experts:
            widths["moe_intermediate_size * n_shared_experts"] = m.moe_intermediate_size * m.n_shared_experts
    for name, w in widths.items():
        if w % (128 * t):
            raise ConfigError(f"config: model.fp8=blockwise with mesh.tensor={t}: model.{name} = {w} "
                              f"does not split into shards of whole 128-wide FP8 scale tiles (needs a "
                              f"multiple of 128 x {t} = {128 * t}); use mesh.tensor=1 or model.fp8=none")


def check_moe_kernel_rows(cfg: Config, token_shards: int = 1, expert_shards: int = 1,
                          mesh: str = "") -> None:
    """model.moe_impl=pallas: every grouped-GEMM call gets at least the kernel's row tile of
    routed rows (tokens x model.num_experts_per_tok), else the run would fail at its first step.

    A step's MoE block routes the data.batch_size x data.seq_len tokens of one micro-batch; on a
    mesh (`mesh`, its text for the message) each device gets 1 / `token_shards` of them (the
    batch and sequence shards) and, with expert parallelism, the rows of the `expert_shards`
    devices of its group. Raises ConfigError naming the fields and the fewest tokens that fit.
    """
    m, d = cfg.model, cfg.data
    if m.moe_impl != "pallas" or m.num_moe_layers == 0:
        return
    tile = TileConfig().tile_m
    k = m.num_experts_per_tok
    rows = d.batch_size * d.seq_len // token_shards * expert_shards * k
    if rows >= tile:
        return
    need = -(-tile // (k * expert_shards)) * token_shards
    total = d.batch_size * d.seq_len * k
    got = (f"= {total}, split over {token_shards} token shards (x expert={expert_shards}) of mesh {mesh}, "
           f"give {rows} per device" if mesh else f"give {total}")
    raise ConfigError(f"config: model.moe_impl=pallas: the grouped-GEMM kernel needs at least {tile} "
                      f"routed rows{' per device' if mesh else ''}, and data.batch_size={d.batch_size} x "
                      f"data.seq_len={d.seq_len} x model.num_experts_per_tok={k} {got}; use "
                      f"data.batch_size x data.seq_len >= {need} or model.moe_impl=auto")


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
