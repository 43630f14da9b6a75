"""LoRA adapters on the DeepSeek projections and routed experts (Hu et al. 2021, arXiv 2106.09685).

Legend: L stacked layers, E routed experts, D hidden_size, F MLP width, r lora.rank, M routed rows.
A targeted projection computes y = x W + dropout(x) A B * s with s = alpha / r; A [in, r] is
drawn as PEFT draws it (kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))),
B [r, out] starts at zero, so a fresh adapter leaves the model unchanged.
Adapters are attached to a built `DeepSeekModel` (`attach_adapters`), which leaves the base
parameters and their random init untouched; their leaves are named `lora_A` / `lora_B`:
  <linear path>/lora/lora_A  [*lead, in, r]      e.g. moe_layers/self_attn/kv_b_proj/lora/lora_A [L, C, r]
  <linear path>/lora/lora_B  [*lead, r, out]
  <moe path>/experts/<proj>/lora_A [L, E, in, r], lora_B [L, E, r, out]  (routed experts, per expert)
The rank dimension has the logical name `lora`, which no sharding preset maps (replicated); the
other dimensions carry their base weight's names, so adapters shard like their weights.
Routed-expert adapters run through the same grouped GEMM as the base experts, ragged over the
same group sizes (`pallas_kernels.moe.grouped_lora_matmuls`), never as a per-expert loop.

Dropout (PEFT's `lora_dropout`, on the adapter's input only) is active while a `dropout_rng`
context is: the train step opens one per micro-batch with a key derived from the step. Each
adapter call during tracing folds a fresh counter into the active key. A layer stack takes one
key from the counter and runs layer i under `layer_dropout(key, i)`, i.e. with
fold_in(key, i) and a counter from 0, so every layer draws its own masks, and the same ones
whether the stack is scanned (`model.scan_layers`, i a traced index) or unrolled.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import threading

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import LORA_ATTENTION, LORA_EXPERTS, LORA_MLP, LoraConfig, ModelConfig
from dsjax.model.layers import Linear
from pallas_kernels.fp8 import frozen as fp8_frozen
from pallas_kernels.fp8.frozen import Fp8Weight
from pallas_kernels.moe import grouped_lora_matmuls, lora_dropout

ADAPTER_LEAVES = ("lora_A", "lora_B")
_LOCAL = threading.local()


# ----------------------------------------------------------------------------- dropout context

@contextlib.contextmanager
def dropout_rng(key):
    """Make adapter dropout active with PRNG `key` (a uint32 [2] key) while tracing; None: off."""
    prev = getattr(_LOCAL, "drop", None)
    _LOCAL.drop = None if key is None else [key, 0]
    try:
        yield
    finally:
        _LOCAL.drop = prev


def _dropout(x, rate: float):
    st = getattr(_LOCAL, "drop", None)
    if rate <= 0 or st is None:
        return x
    key = jax.random.fold_in(st[0], st[1])
    st[1] += 1
    return lora_dropout(x, rate, key)


def dropout_key_data():
    """The active dropout key (uint32 [2]) for code that passes it into `shard_map` explicitly,
    after advancing the counter; None when dropout is off."""
    st = getattr(_LOCAL, "drop", None)
    if st is None:
        return None
    key = jax.random.fold_in(st[0], st[1])
    st[1] += 1
    return key


@contextlib.contextmanager
def layer_dropout(stack_key, i):
    """Dropout of layer `i` (int or traced int32 scalar) of a stack whose key `stack_key` came from
    `dropout_key_data()`: active with key fold_in(stack_key, i); nothing when stack_key is None."""
    if stack_key is None:
        yield
        return
    with dropout_rng(jax.random.fold_in(stack_key, i)):
        yield


# ----------------------------------------------------------------------------- modules

def _kaiming_a(key, lead: tuple, d_in: int, r: int, dtype):
    bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt(5)) on a [r, in] weight (PEFT, torch)
    return jax.random.uniform(key, lead + (d_in, r), dtype, -bound, bound)


class LoraAdapter(nnx.Module):
    """One adapter: delta(x [..., in]) = dropout(x) @ A [in, r] @ B [r, out] * scale, computed in
    the compute dtype. `lead` are leading stacked dims (layers, experts) with logical `lead_axes`."""

    def __init__(self, lead: tuple, lead_axes: tuple, d_in: int, d_out: int, in_axis, out_axis,
                 cfg: LoraConfig, wdtype, key):
        r = cfg.rank
        self.lora_A = nnx.Param(_kaiming_a(key, lead, d_in, r, wdtype),
                                out_sharding=lead_axes + (in_axis, "lora"))
        self.lora_B = nnx.Param(jnp.zeros(lead + (r, d_out), wdtype),
                                out_sharding=lead_axes + ("lora", out_axis))
        self.scale = float(cfg.alpha) / r
        self.rate = float(cfg.dropout)

    def __call__(self, x, dtype):
        """x [..., in] -> [..., out] in `dtype` (unstacked adapter)."""
        t = jnp.dot(_dropout(x.astype(dtype), self.rate), self.lora_A[...].astype(dtype))
        # the scale multiplies B (fp32, then cast), not the [..., out] product
        b = (self.lora_B[...].astype(jnp.float32) * self.scale).astype(dtype)
        return jnp.dot(t, b)

    def merged(self, w, dtype):
        """w [in, out] + A B scale, in `dtype` (fp32 maths): for consumers that need the weight
        itself (the chunked lm_head loss). No dropout."""
        delta = jnp.dot(self.lora_A[...].astype(jnp.float32), self.lora_B[...].astype(jnp.float32))
        return (w.astype(jnp.float32) + delta * self.scale).astype(dtype)


class ExpertsLora(nnx.Module):
    """Per-expert adapters of the routed experts: `gate_proj`, `up_proj`, `down_proj`, each a
    `LoraAdapter` with A [E, in, r], B [E, r, out] (per layer), or None when not targeted."""

    def __init__(self, gate, up, down):
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down

    def pairs(self, dtype):
        """((A, B) or None for gate, up, down) in `dtype`, and the scale."""
        out, scale = [], 1.0
        for ad in (self.gate_proj, self.up_proj, self.down_proj):
            if ad is None:
                out.append(None)
            else:
                out.append((ad.lora_A[...].astype(dtype), ad.lora_B[...].astype(dtype)))
                scale = ad.scale
        return tuple(out), scale

    def rate(self) -> float:
        return max(ad.rate for ad in (self.gate_proj, self.up_proj, self.down_proj) if ad is not None)


def expert_matmuls(x, ws, pairs, group_sizes, scale: float, impl: str, rate: float = 0.0,
                   in_stacks=None, dw_sinks=None, fp8: bool = False, fp8_requantize: bool = False):
    """Routed-expert projections of the same rows, each with its adapter: x [M, Din] rows sorted
    by expert, ws (w [E, Din, N_i], ...), pairs ((A [E, Din, r], B [E, r, N_i]) or None, ...) ->
    tuple of [M, N_i] in x.dtype. The adapters share one dropout mask of x (as PEFT's adapter
    on the fused gate_up_proj does) and one x A GEMM; each adapter's t B runs inside its base
    GEMM (`grouped_lora_matmuls`); every GEMM is grouped over the same `group_sizes` [E].
    in_stacks: None, or per w None or (stack, i) with w = stack[i], read in place
    (`grouped_matmul(in_stack=...)`); dw_sinks: None, or per w None or (ref, row)
    (`grouped_matmul(dw_sink=...)`); fp8: the base GEMMs in FP8 (`grouped_lora_matmuls`);
    fp8_requantize: their weights quantised again in the backward
    (`pallas_kernels.fp8.fp8_grouped_gemm(requantize_weight=...)`)."""
    live = any(p is not None for p in pairs)
    base = (functools.partial(fp8_frozen.grouped_gemm, requantize_weight=fp8_requantize)
            if fp8 else None)
    return grouped_lora_matmuls(x, ws, pairs, group_sizes, scale=scale, impl=impl,
                                x_adapter=_dropout(x, rate) if live else None, in_stacks=in_stacks,
                                dw_sinks=dw_sinks, base_gemm=base)


# ----------------------------------------------------------------------------- attach

def expand_targets(cfg: LoraConfig, mcfg: ModelConfig) -> set[str]:
    """The target names of `cfg.target_modules` with `all-linear` and `experts` expanded."""
    out = set()
    for name in cfg.target_modules:
        if name == "all-linear":
            q = ("q_a_proj", "q_b_proj") if mcfg.q_lora_rank else ("q_proj",)
            out |= set(q) | set(LORA_ATTENTION[3:]) | set(LORA_MLP) | set(LORA_EXPERTS)
        elif name == "experts":
            out |= set(LORA_EXPERTS)
        else:
            out.add(name)
    if mcfg.num_moe_layers == 0 or mcfg.n_routed_experts == 0:
        out -= set(LORA_EXPERTS)
    return out


def attach_adapters(model, cfg: LoraConfig, rngs: nnx.Rngs) -> int:
    """Attach fresh adapters to every targeted module of `model` (a `DeepSeekModel`, in place).

    Returns the number of adapters attached. Raises ValueError when no module matches.
    """
    targets = expand_targets(cfg, model.cfg)
    n = 0
    mods = sorted(nnx.iter_modules(model), key=lambda pm: tuple(str(p) for p in pm[0]))
    for path, mod in mods:
        name = str(path[-1]) if path else ""
        if isinstance(mod, Linear) and name in targets:
            kernel = mod.kernel
            axes = kernel.get_metadata()["out_sharding"]
            shape = kernel[...].shape
            nl = len(shape) - 2
            mod.lora = nnx.data(LoraAdapter(shape[:nl], tuple(axes[:nl]), shape[-2], shape[-1], axes[-2],
                                            axes[-1], cfg, kernel[...].dtype, rngs.params()))
            n += 1
        elif hasattr(mod, "experts") and isinstance(getattr(mod, "up_proj", None), nnx.Param):  # a MoE
            ads = []
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if f"experts.{proj}" not in targets:
                    ads.append(None)
                    continue
                w = getattr(mod, proj)
                axes = w.get_metadata()["out_sharding"]
                shape = w[...].shape
                nl = len(shape) - 2
                ads.append(LoraAdapter(shape[:nl], tuple(axes[:nl]), shape[-2], shape[-1], axes[-2], axes[-1],
                                       cfg, w[...].dtype, rngs.params()))
                n += 1
            if any(a is not None for a in ads):
                mod.experts = nnx.data(ExpertsLora(*ads))
    if n == 0:
        raise ValueError(f"lora: lora.target_modules={cfg.target_modules} matches no module of this model")
    return n


# ----------------------------------------------------------------------------- pure-dict helpers

def is_adapter_path(path) -> bool:
    """True for the pure-dict path (tuple of names) of an adapter leaf."""
    return bool(path) and str(path[-1]) in ADAPTER_LEAVES


def path_names(path) -> tuple[str, ...]:
    """The names of a `tree_flatten_with_path` key path (dict keys, attribute names), as str."""
    return tuple(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def split_adapters(params: dict) -> tuple[dict, dict]:
    """params pure dict -> (base params, adapters): two pure dicts with disjoint leaves (empty
    sub-dicts dropped; no array is copied)."""
    def walk(tree, path):
        base, ad = {}, {}
        for k, v in tree.items():
            p = path + (k,)
            if isinstance(v, dict):
                b, a = walk(v, p)
                if b:
                    base[k] = b
                if a:
                    ad[k] = a
            elif is_adapter_path(p):
                ad[k] = v
            else:
                base[k] = v
        return base, ad
    return walk(params, ())


def join(a: dict | None, b: dict | None) -> dict:
    """Deep union of two pure dicts with disjoint leaves (no array is copied)."""
    if not b:
        return a or {}
    if not a:
        return b
    out = dict(a)
    for k, v in b.items():
        out[k] = join(out[k], v) if k in out and isinstance(v, dict) else v
    return out


def merged_params(params: dict, lcfg: LoraConfig) -> dict:
    """Base params with every adapter folded in: W' = W + A @ B * alpha / rank (fp32 maths and
    result; a frozen `Fp8Weight` is dequantised first), per stacked layer and per routed expert.
    params without adapters are returned unchanged. The result has the layout of the model without adapters, so the HF
    export (`dsjax.hf.save_hf`) and a plain `DeepSeekModel` take it."""
    base, ads = split_adapters(params)
    if not ads:
        return params
    scale = float(lcfg.alpha) / lcfg.rank

    def fold(w, a, b):
        delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))
        if isinstance(w, Fp8Weight):  # a frozen FP8 weight: its dequantised values
            w = w.dequantize()
        return w.astype(jnp.float32) + delta * scale

    def walk(base_t, ad_t):
        out = dict(base_t)
        for k, v in ad_t.items():
            if k == "lora":  # a Linear's adapter: fold into its kernel
                out["kernel"] = fold(base_t["kernel"], v["lora_A"], v["lora_B"])
            elif k == "experts" and "lora_A" not in v:  # routed experts of a MoE
                for proj, pair in v.items():
                    out[proj] = fold(base_t[proj], pair["lora_A"], pair["lora_B"])
            else:
                out[k] = walk(base_t[k], v)
        return out

    return walk(base, ads)


def match_patterns(params: dict, patterns, where: str) -> set[tuple[str, ...]]:
    """Paths of the base leaves of `params` that one of `patterns` names: a path component equal
    to the pattern, or an fnmatch of the dotted path. Raises ValueError naming the first pattern
    (and `where`, e.g. 'lora.freeze') that matches no leaf."""
    leaves = [path_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, Fp8Weight))[0]]  # a frozen FP8 weight is one leaf
    leaves = [p for p in leaves if not is_adapter_path(p) and "lora" not in p]
    hit = set()
    for i, pat in enumerate(patterns):
        found = {p for p in leaves if pat in p or fnmatch.fnmatchcase(".".join(p), pat)
                 or fnmatch.fnmatchcase(".".join(p), pat + ".*")}
        if not found:
            raise ValueError(f"config: {where}[{i}]={pat!r} matches no parameter (e.g. embed_tokens, "
                             f"lm_head, dense_layers, moe_layers.mlp.shared_experts, *.self_attn.*)")
        hit |= found
    return hit


def trained_base_paths(lc: LoraConfig, params: dict) -> set[tuple[str, ...]]:
    """Paths of the base (non-adapter) leaves that a LoRA run (lc.rank > 0) trains in full: those
    lora.modules_to_save names, less those lora.freeze names. Raises ValueError like
    `match_patterns` for a pattern of either list that matches nothing."""
    frozen = match_patterns(params, lc.freeze, "lora.freeze") if lc.freeze else set()
    saved = match_patterns(params, lc.modules_to_save, "lora.modules_to_save") if lc.modules_to_save else set()
    return saved - frozen


# ----------------------------------------------------------------------------- train-step hooks

def with_frozen(loss_fn):
    """`loss_fn(params, rest, mb, *args)` -> `f(trainable, rest, mb, *args, frozen=None, key=None)`
    that joins the frozen leaves into the params (so only `trainable` is differentiated) and runs
    with adapter dropout keyed by `key` (uint32 [2], or None: no dropout)."""
    def wrapped(params, rest, mb, *args, frozen=None, key=None):
        with dropout_rng(key):
            return loss_fn(join(params, frozen), rest, mb, *args)
    return wrapped


def dropout_keys(cfg: LoraConfig, seed: int, step, n: int):
    """Per-micro-batch dropout keys [n, 2] uint32 for optimizer step `step`, or None when the
    config has no adapter dropout."""
    if cfg.rank == 0 or cfg.dropout <= 0:
        return None
    key = jax.random.fold_in(jax.random.PRNGKey(seed + 2), step)
    return jax.random.split(key, n)
