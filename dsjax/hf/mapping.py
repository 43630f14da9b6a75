"""The one declarative table between HF DeepSeek-V2/V3 state-dict keys and dsjax's pure state.

HF names and shapes: transformers/models/deepseek_v{2,3}/modeling_deepseek_v{2,3}.py. HF
linears are [out, in] (op "T": our kernel = W.T); norms, embedding and the router bias are
copied ("C"). Our decoder layers are two stacks with a leading `layers` axis (`dense_layers` =
HF layers 0..first_k_dense_replace-1, `moe_layers` = the rest), routed experts a leading
`experts` axis ([E, D, F] / [E, F, D]); MTP depth k is HF layer `num_hidden_layers + k` and
lives at `mtp.layers` (index k) with its decoder block under `block`.

Import additionally accepts the transformers-v5 fused expert tensors (`FUSED`):
`mlp.experts.gate_up_proj` [E, 2F, D] (gate rows first) and `mlp.experts.down_proj` [E, D, F].
Export always writes the on-disk (per-expert) form that `save_pretrained` writes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from dsjax.config import ModelConfig

T, C = "T", "C"  # transpose [out, in] <-> [in, out]; copy

# (HF suffix under `model.layers.{n}.`, our path under the layer, op)
ATTENTION = (
    ("input_layernorm.weight", "input_layernorm.weight", C),
    ("post_attention_layernorm.weight", "post_attention_layernorm.weight", C),
    ("self_attn.q_proj.weight", "self_attn.q_proj.kernel", T),
    ("self_attn.q_a_proj.weight", "self_attn.q_a_proj.kernel", T),
    ("self_attn.q_a_proj.bias", "self_attn.q_a_proj.bias", C),
    ("self_attn.q_a_layernorm.weight", "self_attn.q_a_layernorm.weight", C),
    ("self_attn.q_b_proj.weight", "self_attn.q_b_proj.kernel", T),
    ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.kernel", T),
    ("self_attn.kv_a_proj_with_mqa.bias", "self_attn.kv_a_proj_with_mqa.bias", C),
    ("self_attn.kv_a_layernorm.weight", "self_attn.kv_a_layernorm.weight", C),
    ("self_attn.kv_b_proj.weight", "self_attn.kv_b_proj.kernel", T),
    ("self_attn.o_proj.weight", "self_attn.o_proj.kernel", T),
    ("self_attn.o_proj.bias", "self_attn.o_proj.bias", C),
)
DENSE_MLP = (
    ("mlp.gate_proj.weight", "mlp.gate_proj.kernel", T),
    ("mlp.up_proj.weight", "mlp.up_proj.kernel", T),
    ("mlp.down_proj.weight", "mlp.down_proj.kernel", T),
)
MOE_MLP = (  # {j}: expert index, stacked on our `experts` axis
    ("mlp.gate.weight", "mlp.gate", T),
    ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias", C),  # in `rest`
    ("mlp.experts.{j}.gate_proj.weight", "mlp.gate_proj", T),
    ("mlp.experts.{j}.up_proj.weight", "mlp.up_proj", T),
    ("mlp.experts.{j}.down_proj.weight", "mlp.down_proj", T),
    ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.gate_proj.kernel", T),
    ("mlp.shared_experts.up_proj.weight", "mlp.shared_experts.up_proj.kernel", T),
    ("mlp.shared_experts.down_proj.weight", "mlp.shared_experts.down_proj.kernel", T),
)
FUSED = (  # transformers v5 in-memory expert layout (import only): HF suffix -> our leaves
    ("mlp.experts.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),  # [E, 2F, D] -> 2 x [E, D, F]
    ("mlp.experts.down_proj", ("mlp.down_proj",)),  # [E, D, F] -> [E, F, D]
)
MTP_EXTRA = (  # under `model.layers.{L + k}.`, ours under `mtp.layers` (index k)
    ("enorm.weight", "enorm.weight", C),
    ("hnorm.weight", "hnorm.weight", C),
    ("eh_proj.weight", "eh_proj.kernel", T),
    ("shared_head.norm.weight", "head_norm.weight", C),
)
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the main embedding / head
GLOBAL = (
    ("model.embed_tokens.weight", "embed_tokens", C),
    ("model.norm.weight", "norm.weight", C),
    ("lm_head.weight", "lm_head.kernel", T),
)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One HF tensor <-> one slice of one of our leaves: leaf[index] = op(hf tensor)."""

    hf: str
    tree: str  # "params" | "rest"
    path: tuple[str, ...]
    index: tuple[int, ...]
    op: str


def get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return None
        tree = tree[p]
    return tree


def _layer_entries(prefix_hf: str, our: tuple[str, ...], index: tuple[int, ...], moe: bool,
                   trees: dict, n_experts: int) -> list[Entry]:
    out = []
    for hf, ours, op in ATTENTION + (MOE_MLP if moe else DENSE_MLP):
        path = our + tuple(ours.split("."))
        tree = "rest" if hf.endswith("e_score_correction_bias") else "params"
        if get_path(trees[tree], path) is None:
            continue  # e.g. q_proj vs q LoRA, absent biases, V2 (no router bias)
        if "{j}" in hf:
            out += [Entry(prefix_hf + hf.format(j=j), tree, path, index + (j,), op) for j in range(n_experts)]
        else:
            out.append(Entry(prefix_hf + hf, tree, path, index, op))
    return out


def entries(cfg: ModelConfig, params: dict, rest: dict) -> list[Entry]:
    """Every HF tensor of the model described by `cfg` (HF order), given our state trees
    (arrays or ShapeDtypeStructs; used only to see which optional leaves exist)."""
    trees = {"params": params, "rest": rest}
    E, L, K = cfg.n_routed_experts, cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    glob = [Entry(hf, "params", tuple(ours.split(".")), (), op) for hf, ours, op in GLOBAL
            if get_path(params, tuple(ours.split("."))) is not None]
    out = glob[:1]  # embedding first, final norm and lm_head last (HF order)
    for n in range(L):
        moe = n >= cfg.first_k_dense_replace
        stack = "moe_layers" if moe else "dense_layers"
        i = n - cfg.first_k_dense_replace if moe else n
        out += _layer_entries(f"model.layers.{n}.", (stack,), (i,), moe, trees, E)
    for k in range(K):
        pre = f"model.layers.{L + k}."
        for hf, ours, op in MTP_EXTRA:
            out.append(Entry(pre + hf, "params", ("mtp", "layers") + tuple(ours.split(".")), (k,), op))
        out += _layer_entries(pre, ("mtp", "layers", "block"), (k,), E > 0, trees, E)
    return out + glob[1:]


def hf_shape(entry: Entry, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape that fills leaf[index] (leaf_shape = our full leaf shape)."""
    s = tuple(leaf_shape[len(entry.index):])
    return s[::-1] if entry.op == T else s


def layer_location(cfg: ModelConfig, n: int) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """Our stack path and index of HF decoder layer n (MTP blocks included), None if beyond."""
    L = cfg.num_hidden_layers
    if n < cfg.first_k_dense_replace:
        return ("dense_layers",), (n,)
    if n < L:
        return ("moe_layers",), (n - cfg.first_k_dense_replace,)
    if n < L + cfg.num_nextn_predict_layers:
        return ("mtp", "layers", "block"), (n - L,)
    return None
