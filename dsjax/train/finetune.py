"""Fine-tuning: which weights train, how the frozen ones are stored, and per-module diagnostics.

The train state's `params` holds only the trainable leaves (fp32 master copies, the optimizer's
whole view), and `frozen` (present only when something is frozen) the rest, stored once in the
compute dtype (model.dtype) with no optimizer state; the router `gate` stays fp32 because
routing reads it in fp32. What trains (`dsjax.config.LoraConfig`):
  lora.rank > 0   the adapters, plus base weights matched by lora.modules_to_save
  lora.rank = 0   every base weight
and in both cases nothing that lora.freeze matches. `join(state["params"], state["frozen"])`
is the model's full parameter tree.
Under `model.fp8=blockwise` the frozen weights of the FP8 GEMMs (`fp8_frozen_paths`) are stored
as `pallas_kernels.fp8.frozen.Fp8Weight` (E4M3 values + fp32 128 x 128 block scales: 1 byte and
4 / 16384 per element, about half of bf16), the operand the FP8 GEMMs would quantise them to
every step: DeepSeek-V3's FP8 checkpoint's weights as stored (`dsjax.hf.load_hf_params(
fp8_keep=...)`, no rounding), any other weight quantised once from its own values.

Gradient norms per module group (`grad_group_norms`) and the token counts of a step
(`token_counts`) are computed inside the jitted step from values it already has.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import Config
from dsjax.model import DeepSeekModel, ModelFns
from dsjax.model.layers import dtype_of
from dsjax.model.moe import EXPERT_PROJS
from pallas_kernels.fp8.frozen import Fp8Weight, scale_grid
from dsjax.model.lora import (attach_adapters, is_adapter_path, join, match_patterns, path_names,
                              split_adapters, trained_base_paths)

FP32_FROZEN = ("gate",)  # routed in fp32: kept fp32 when frozen


def init_model(cfg: Config, seed: int | None = None):
    """The model with its adapters (lora.rank > 0): (ModelFns, params, rest) pure dicts.

    The base weights are the same random init as without LoRA (same seed); adapters draw from
    a separate stream (seed + 1). Raises ValueError when lora.target_modules matches nothing.
    """
    seed = cfg.train.seed if seed is None else seed
    model = DeepSeekModel(cfg.model, rngs=nnx.Rngs(seed))
    if cfg.lora.rank > 0:
        attach_adapters(model, cfg.lora, nnx.Rngs(seed + 1))
    graphdef, ps, rs = nnx.split(model, nnx.Param, ...)
    fns = ModelFns(graphdef, jax.eval_shape(lambda: ps), jax.eval_shape(lambda: rs))
    return fns, ps.to_pure_dict(), rs.to_pure_dict()


def abstract_model(cfg: Config, seed: int = 0):
    """(ModelFns, abstract params, abstract rest) of `init_model` without materialising it."""
    def make():
        model = DeepSeekModel(cfg.model, rngs=nnx.Rngs(seed))
        if cfg.lora.rank > 0:
            attach_adapters(model, cfg.lora, nnx.Rngs(seed + 1))
        return model

    model = nnx.eval_shape(make)
    graphdef, ps, rs = nnx.split(model, nnx.Param, ...)
    return ModelFns(graphdef, ps, rs), ps.to_pure_dict(), rs.to_pure_dict()


def _is_fp8(x) -> bool:
    return isinstance(x, Fp8Weight)


def frozen_paths(cfg: Config, params: dict) -> set[tuple[str, ...]]:
    """Paths of the frozen leaves of the full params tree (arrays or specs).

    Raises ValueError (one line, naming the field) for a lora.freeze / modules_to_save pattern
    that matches no parameter."""
    lc = cfg.lora
    if lc.rank > 0:
        leaves = [path_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_fp8)[0]]
        saved = trained_base_paths(lc, params)
        return {p for p in leaves if not is_adapter_path(p) and p not in saved}
    return match_patterns(params, lc.freeze, "lora.freeze") if lc.freeze else set()


def fp8_frozen_paths(cfg: Config, params: dict, frozen: set | None = None) -> set[tuple[str, ...]]:
    """Paths of the frozen leaves that are the weight operand of an FP8 GEMM and so are held as
    `Fp8Weight`s: under `model.fp8=blockwise`, the frozen kernels of the FP8 linears (every
    `Linear` but the lm_head) and the routed experts' gate/up/down stacks. Empty under
    model.fp8=none. `frozen`: `frozen_paths(cfg, params)` when already known.
    Raises ValueError as `frozen_paths`."""
    if cfg.model.fp8 != "blockwise":
        return set()

    def fp8_gemm(p):
        if p[0] == "lm_head":
            return False
        return p[-1] == "kernel" or (len(p) > 1 and p[-2] == "mlp" and p[-1] in EXPERT_PROJS)
    return {p for p in (frozen_paths(cfg, params) if frozen is None else frozen) if fp8_gemm(p)}


def as_fp8(x) -> Fp8Weight:
    """A weight [..., in, out] as `Fp8Weight`: as it is when it is one, quantised per 128 x 128
    block from its own values when an array (`Fp8Weight.quantize`), or its abstract form for a
    ShapeDtypeStruct."""
    if isinstance(x, Fp8Weight):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return Fp8Weight(jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
                         jax.ShapeDtypeStruct(scale_grid(x.shape), jnp.float32))
    return Fp8Weight.quantize(x)


def _select(tree: dict, paths: set, keep: bool, prefix=()) -> dict:
    out = {}
    for k, v in tree.items():
        p = prefix + (k,)
        if isinstance(v, dict):
            sub = _select(v, paths, keep, p)
            if sub:
                out[k] = sub
        elif (p in paths) == keep:
            out[k] = v
    return out


def partition(cfg: Config, params: dict, cast: bool = True) -> tuple[dict, dict]:
    """Full params -> (trainable, frozen) pure dicts. `cast`: frozen float leaves to the compute
    dtype (except FP32_FROZEN), and under model.fp8=blockwise the `fp8_frozen_paths` leaves to
    `Fp8Weight` (`as_fp8`); False keeps them as they are (logical specs, shardings)."""
    paths = frozen_paths(cfg, params)
    train, frozen = _select(params, paths, False), _select(params, paths, True)
    if cast and frozen:
        dt = dtype_of(cfg.model.dtype)
        fp8 = fp8_frozen_paths(cfg, params, paths)

        def c(path, x):
            if path_names(path) in fp8:
                return as_fp8(x)
            if (isinstance(x, Fp8Weight) or path_names(path)[-1] in FP32_FROZEN
                    or not jnp.issubdtype(x.dtype, jnp.floating)):
                return x
            return x.astype(dt) if isinstance(x, jax.Array) else jax.ShapeDtypeStruct(x.shape, dt)
        frozen = jax.tree_util.tree_map_with_path(c, frozen, is_leaf=_is_fp8)
    return train, frozen


def select_like(full: dict, like: dict) -> dict:
    """The sub-tree of `full` with the keys of `like` (e.g. logical specs of the trainable part)."""
    return {k: select_like(full[k], v) if isinstance(v, dict) else full[k] for k, v in like.items()}


def full_params(state: dict) -> dict:
    """The model's whole params tree of a train state: trainable joined with frozen."""
    return join(state["params"], state.get("frozen"))


def base_and_adapters(params: dict) -> tuple[dict, dict]:
    """(base params, adapter leaves) of a full params tree."""
    return split_adapters(params)


# ----------------------------------------------------------------------------- diagnostics

def group_of(path: tuple[str, ...]) -> str:
    """Module group of a params path (for per-group gradient norms); an adapter belongs to the
    group of the weight it adapts."""
    if path[0] == "mtp":
        return "mtp"
    if path[0] == "embed_tokens":
        return "embed"
    if path[0] == "lm_head":
        return "lm_head"
    s = set(path)
    if s & {"q_proj", "q_a_proj", "q_b_proj", "q_a_layernorm"}:
        return "attn_q"
    if s & {"kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm"}:
        return "attn_kv"
    if "o_proj" in s:
        return "attn_o"
    if "shared_experts" in s:
        return "shared_experts"
    if path[0] == "moe_layers" and "mlp" in s:
        return "router" if path[-1] == "gate" else "routed_experts"
    if path[0] == "dense_layers" and "mlp" in s:
        return "dense_mlp"
    return "norms"


def grad_group_norms(squares: dict) -> dict:
    """L2 norms (fp32 scalars) of the gradients per module group, from `squares`: the gradient
    tree with each leaf's sum of squares (an fp32 scalar) in its place. "grad_norm/<group>"
    for the base weights that train, "grad_norm/adapters/<group>" for the adapters of that group
    and "grad_norm/adapters" over all adapters; only groups that have gradients appear."""
    sq: dict[str, list] = {}
    for path, s in jax.tree_util.tree_flatten_with_path(squares)[0]:
        names = path_names(path)
        if is_adapter_path(names):
            sq.setdefault("adapters", []).append(s)
            sq.setdefault("adapters/" + group_of(names), []).append(s)
        else:
            sq.setdefault(group_of(names), []).append(s)
    return {f"grad_norm/{k}": jnp.sqrt(sum(v)) for k, v in sorted(sq.items())}


def token_counts(batch: dict) -> dict:
    """Target tokens of a step [A, B, T] batch: trained (loss mask) and masked (real tokens the
    loss mask leaves out, e.g. prompts of chat data), fp32 scalars."""
    real = batch["segment_ids"] > 0
    trained = batch["loss_mask"].astype(bool)
    return {"tokens_trained": jnp.sum(trained & real).astype(jnp.float32),
            "tokens_masked": jnp.sum(real & ~trained).astype(jnp.float32)}
