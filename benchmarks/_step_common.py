"""What the training-step benchmarks share: the V2-Lite geometry and the dsjax rows they run
(train_step.py, step_bytes.py, finetune.py), and the map from a compiled step's HLO ops to the
parts of the step (train_step.py's profile, step_bytes.py's bytes). Imports nothing of the
project and no other benchmark, so every benchmark can import it.
"""
from __future__ import annotations

import re

# DeepSeek-V2-Lite as dsjax config overrides (27 layers in the checkpoint; the benchmarks set
# model.num_hidden_layers themselves)
V2_LITE = ["model.vocab_size=102400", "model.hidden_size=2048", "model.num_attention_heads=16",
           "model.q_lora_rank=null", "model.kv_lora_rank=512", "model.qk_nope_head_dim=128",
           "model.qk_rope_head_dim=64", "model.v_head_dim=128", "model.n_routed_experts=64",
           "model.num_experts_per_tok=6", "model.n_shared_experts=2", "model.moe_intermediate_size=1408",
           "model.intermediate_size=10944", "model.first_k_dense_replace=1", "model.topk_method=greedy",
           "model.scoring_func=softmax", "model.norm_topk_prob=false", "model.n_group=1",
           "model.topk_group=1", "model.routed_scaling_factor=1.0", "model.dtype=bfloat16",
           "model.max_position_embeddings=163840",
           "model.rope_scaling={factor: 40, original_max_position_embeddings: 4096, mscale: 0.707, mscale_all_dim: 0.707}"]

# dsjax rows: config overrides on top of V2_LITE
# The HF peers' model: transformers' DeepseekV2Config at V2-Lite geometry with L layers, as source
# lines for the peers' scripts (which run in their own processes; `L` is defined there).
HF_V2_LITE_CONFIG = """\
cfg = DeepseekV2Config(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=L, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy", max_position_embeddings=163840,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
"""

DSJAX_ROWS = {
    "default": [],
    "matched": ["model.weight_dtype=bfloat16", "optim.mu_dtype=bfloat16", "optim.nu_dtype=bfloat16",
                "model.round_logits=true"],
}
# the same two with every linear layer's three GEMMs in FP8 (DeepSeek-V3's block scales)
DSJAX_ROWS["fp8_default"] = DSJAX_ROWS["default"] + ["model.fp8=blockwise"]
DSJAX_ROWS["fp8_matched"] = DSJAX_ROWS["matched"] + ["model.fp8=blockwise"]


def row_label(row: str, extra: tuple = (), baseline: bool = False) -> str:
    """A dsjax row's name in the table: "dsjax ROW", plus " + KEY=VALUE" per `--paired` override
    and " @ baseline" for a run from `--baseline`'s tree."""
    return f"dsjax {row}" + "".join(f" + {e}" for e in extra) + (" @ baseline" if baseline else "")


# -- the parts of a compiled step ----------------------------------------------------------
# one instruction line of HLO text: (name, everything right of "=")
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def stack_tables(hlo_text: str):
    """The compiled module's stack tables: frame id -> [function names, innermost first]."""
    sec, cur = {}, None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur = sec.setdefault(line, {})
            continue
        m = re.match(r"^(\d+) (.*)$", line) if cur is not None else None
        if m:
            cur[int(m.group(1))] = m.group(2)
        elif cur is not None and line.strip():
            cur = None
    funcs = {i: v.strip('"') for i, v in sec.get("FunctionNames", {}).items()}
    locs = {i: int(dict(re.findall(r"(\w+)=(\d+)", v))["function_name_id"])
            for i, v in sec.get("FileLocations", {}).items()}
    frames = {i: {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", r)} for i, r in sec.get("StackFrames", {}).items()}

    def chain(fid):
        out, seen = [], set()
        while fid in frames and fid not in seen:  # parent ids count from 0, frame ids from 1
            seen.add(fid)
            out.append(funcs.get(locs.get(frames[fid]["file_location_id"]), "?"))
            fid = frames[fid]["parent_frame_id"] - 1
        return out
    return chain


def classify(name: str, text: str, funcs: list[str]) -> str:
    """The part of the step an HLO op belongs to, from its text and the Python call chain
    (function names, innermost first) that traced it."""
    f = " ".join(funcs)
    if not text:  # the trace named a kernel that is not an op of the step's HLO
        return "memcpy" if "memcpy" in name.lower() else "unmapped"
    if "lora_factors" in f or "LoraAdapter." in f:  # the fused t B counts as an MoE kernel
        return "LoRA adapters (GEMMs, glue)"
    if "mosaic_gpu" in text:
        return "attention kernels" if "flash_attention" in f else "MoE kernels (GEMMs, permute)"
    if "__cublas" in text or "gemm" in name:
        if "lm_head" in f or "_chunk_grads" in f or "logits" in f:
            return "lm_head GEMMs"
        if "MLP.__call__" in f:
            return "dense MLP + shared expert GEMMs"
        if "MLA" in f:
            return "attention projection GEMMs"
        return "router and other GEMMs"
    if name.startswith("copy") or " copy(" in text:
        return "copies"
    if "compute_weights" in f:
        return "weight casts"
    if "lm_head_loss" in f or "_chunk_grads" in f or "lm_loss" in f:
        return "lm_head + loss elementwise"
    if "train_step" in f and "micro_loss" not in f:
        return "optimizer, clip, finite check"
    rules = (("route", "router + balance stats"), ("balance_stats", "router + balance stats"),
             ("MoE.", "MoE glue (SwiGLU, combine)"), ("MLP.__call__", "dense MLP SwiGLU"),
             ("RMSNorm.", "RMSNorm"), ("MLA.", "attention glue (RoPE, K/V)"),
             ("DeepSeekModel.embed", "embedding"), ("DecoderLayer.", "residual adds"),
             ("DeepSeekModel._run_stack", "layer stacking"))
    for key, part in rules:  # a function name equal to key, or a method of the class key names
        if any(x == key or (key.endswith(".") and x.startswith(key)) or x.startswith(key + ".")
               for x in funcs):
            return part
    return "other"
