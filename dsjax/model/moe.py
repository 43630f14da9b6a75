"""DeepSeekMoE: routers (V2 softmax greedy / group-limited greedy, V3 sigmoid noaux_tc), dropless
sort-based expert dispatch, shared experts, and the balancing statistics.

Legend: T tokens (B*T flattened), D hidden_size, E n_routed_experts, K num_experts_per_tok,
G n_group, F moe_intermediate_size.
Sources: DeepSeek-V2 paper sec. 2.2 (device-limited routing), DeepSeek-V3 paper sec. 2.1.2
(sigmoid affinities, aux-loss-free bias, sequence-wise balance loss eq. 17-20);
transformers/models/deepseek_v{2,3}/modeling_deepseek_v{2,3}.py (`DeepseekV3TopkRouter`,
`DeepseekV2Moe.route_tokens_to_experts`).
Under an active `sharding.rules` context whose mesh has expert > 1, the routed experts run
expert-parallel (`sharding.expert_parallel`); the maths is unchanged.
"""
from __future__ import annotations

import contextlib
import threading

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model.layers import MLP, dtype_of
from dsjax.model.lora import dropout_key_data, expert_matmuls
from pallas_kernels.fp8.api import fp8_swiglu
from pallas_kernels.moe import permute, sorted_weights, swiglu, unpermute_sum
from sharding import rules as shr
from sharding.expert_parallel import moe_from_context, with_recompute


EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # the routed experts' weights, [E, in, out]
_STACKS = threading.local()
_SINKS = threading.local()


@contextlib.contextmanager
def expert_stacks(stacks, i: int):
    """MoE layers run within this context read their routed-expert weights in place from
    `stacks` ({name in EXPERT_PROJS: [L, E, in, out]}) at layer i (`grouped_matmul(in_stack=...)`):
    for unrolled layers, whose per-layer weights are slices of these stacks and would otherwise
    be copied out before every kernel, in the forward and again for dx (the 27-layer V2-Lite
    LoRA step: ~78 copies of 369 MB). Same maths; a stack not in the compute dtype is ignored
    (the per-layer cast is a copy either way). stacks None: per-layer weights."""
    prev = getattr(_STACKS, "value", None)
    _STACKS.value = None if stacks is None else (stacks, i)
    try:
        yield
    finally:
        _STACKS.value = prev


@contextlib.contextmanager
def expert_grad_sinks(sinks, squares=None):
    """Within this context the routed experts' weight gradients of unrolled MoE layers that read
    their weights in place (`expert_stacks`), or quantise them for the FP8 GEMMs
    (model.fp8=blockwise, `pallas_kernels.fp8.fp8_grouped_gemm(dw_sink=...)`), go to `sinks`
    ({name in EXPERT_PROJS: mutable ref
    [L * E, in, out] in the stack's dtype}, made outside `jax.grad`): layer i's dW kernel
    writes rows i E .. (i + 1) E in place and the layer's weight gets a zero gradient
    (`grouped_matmul(dw_sink=...)`), so the stack's gradient is the ref's value with no
    concatenation of per-layer gradients. squares: None, or {name: mutable fp32 ref of
    `pallas_kernels.moe.dw_sq_shape` of that sink}, which the same kernels fill with the
    gradient's partial sums of squares (sum: ||dW||^2 for the global norm, dW not read again).
    Yields {name: set of layer indices traced with a sink}, for the caller to check that every
    layer wrote (or none did). sinks None: nothing."""
    prev = getattr(_SINKS, "value", None)
    used = {name: set() for name in (sinks or {})}
    _SINKS.value = None if sinks is None else (sinks, used, squares or {})
    try:
        yield used
    finally:
        _SINKS.value = prev


def _dw_sink(name: str, n_experts: int):
    """(ref, row[, sq]) for `grouped_matmul(dw_sink=...)` (or the FP8 GEMM's) of this layer's
    weight `name`, or None: only under `expert_stacks` with a sink of the stack's shape and
    dtype active; the caller asks where the layer's GEMMs read the stack in place or are FP8."""
    held, sunk = getattr(_STACKS, "value", None), getattr(_SINKS, "value", None)
    if held is None or sunk is None or name not in sunk[0]:
        return None
    ref, stack = sunk[0][name], held[0][name]
    if tuple(ref.shape) != (stack.shape[0] * stack.shape[1],) + tuple(stack.shape[2:]) or ref.dtype != stack.dtype:
        return None
    sunk[1][name].add(held[1])
    sq = (sunk[2][name],) if name in sunk[2] else ()
    return (ref, held[1] * n_experts) + sq


def _in_stack(name: str, dt):
    """(stack, i) of routed-expert weight `name` under `expert_stacks` when in dtype dt, else None."""
    held = getattr(_STACKS, "value", None)
    if held is None or held[0][name].dtype != dt:
        return None
    return held[0][name], held[1]


class RouterBias(nnx.Variable):
    """noaux_tc `e_score_correction_bias` [E] (fp32): updated from expert load after each step,
    outside the optimizer (DeepSeek-V3 sec. 2.1.2)."""


def route(logits, bias, cfg: ModelConfig):
    """Pick experts. All maths in fp32.

    Args:
      logits: [T, E] fp32 router logits; bias: [E] fp32 (noaux_tc only, else ignored).
    Returns:
      ids [T, K] int32, weights [T, K] fp32 (scaled by routed_scaling_factor), scores [T, E] fp32
      (softmax or sigmoid affinities, before bias).
    """
    E, K, G = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group
    T = logits.shape[0]
    logits = logits.astype(jnp.float32)
    if cfg.scoring_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    if cfg.topk_method == "noaux_tc":
        choice = scores + bias.astype(jnp.float32)[None, :]
        if G > 1:
            grouped = choice.reshape(T, G, E // G)
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G] top-2 sum
            _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
            gmask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep].set(True)
            choice = jnp.where(jnp.repeat(gmask, E // G, axis=1), choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, K)
        weights = jnp.take_along_axis(scores, ids, axis=1)  # unbiased affinities
    elif cfg.topk_method == "group_limited_greedy":
        grouped = scores.reshape(T, G, E // G)
        group_scores = jnp.max(grouped, axis=-1)  # [T, G] group max
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        gmask = jnp.zeros((T, G), bool).at[jnp.arange(T)[:, None], keep].set(True)
        masked = jnp.where(jnp.repeat(gmask, E // G, axis=1), scores, 0.0)
        weights, ids = jax.lax.top_k(masked, K)
    else:  # greedy
        weights, ids = jax.lax.top_k(scores, K)
    if cfg.norm_topk_prob and (cfg.topk_method == "noaux_tc" or K > 1):
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    return ids.astype(jnp.int32), weights, scores


def balance_stats(ids, scores, token_mask, cfg: ModelConfig, batch_shape):
    """Expert counts, router entropy and the sequence-wise balance loss over real tokens only.

    Args:
      ids: [T, K]; scores: [T, E] fp32; token_mask: [T] bool (False = padding);
      batch_shape: (B, Tseq) with T = B * Tseq.
    Returns:
      counts [E] fp32 (routed real tokens per expert), entropy (mean over real tokens, nats),
      seq_aux (DeepSeek-V3 eq. 17-20, unweighted; averaged over sequences with real tokens).
    """
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    B, Ts = batch_shape
    m = token_mask.astype(jnp.float32)
    n_real = jnp.maximum(jnp.sum(m), 1.0)
    counts = jnp.zeros((E,), jnp.float32).at[ids.reshape(-1)].add(jnp.repeat(m, K))
    p = scores / jnp.sum(scores, axis=-1, keepdims=True)
    ent = -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)
    entropy = jnp.sum(ent * m) / n_real
    # sequence-wise: f_e = E / (K * T_b) * count_{b,e}; P_e = mean_t s'_{t,e}; L = sum_e f_e P_e
    seq = jnp.repeat(jnp.arange(B), Ts)
    seq_counts = jnp.zeros((B, E), jnp.float32).at[seq[:, None], ids].add(m[:, None])
    tb = jnp.sum(m.reshape(B, Ts), axis=1)
    f = seq_counts * E / (K * jnp.maximum(tb, 1.0))[:, None]
    P = jax.ops.segment_sum(p * m[:, None], seq, num_segments=B) / jnp.maximum(tb, 1.0)[:, None]
    has = (tb > 0).astype(jnp.float32)
    seq_aux = jnp.sum(jnp.sum(f * P, axis=-1) * has) / jnp.maximum(jnp.sum(has), 1.0)
    return counts, entropy, seq_aux


class MoE(nnx.Module):
    """Shared experts + routed experts with dropless sort-based dispatch; x [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg = cfg
        wdt = dtype_of(cfg.weight_dtype)
        init = nnx.initializers.normal(cfg.initializer_range)
        self.gate = nnx.Param(init(rngs.params(), (D, E), jnp.float32), out_sharding=("embed", None))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = RouterBias(jnp.zeros((E,), jnp.float32), out_sharding=(None,))
        else:
            self.e_score_correction_bias = None
        self.gate_proj = nnx.Param(init(rngs.params(), (E, D, F), wdt), out_sharding=("experts", "embed", "mlp"))
        self.up_proj = nnx.Param(init(rngs.params(), (E, D, F), wdt), out_sharding=("experts", "embed", "mlp"))
        self.down_proj = nnx.Param(init(rngs.params(), (E, F, D), wdt), out_sharding=("experts", "mlp", "embed"))
        self.shared_experts = MLP(cfg, F * cfg.n_shared_experts, rngs=rngs) if cfg.n_shared_experts else None
        self.experts = None  # per-expert adapters (`dsjax.model.lora.ExpertsLora`) under LoRA

    def _routed(self, xt, ids, weights):
        """Single-program dropless dispatch: xt [T, D], ids/weights [T, K] -> [T, D]."""
        c = self.cfg
        dt = dtype_of(c.dtype)
        xs, group_sizes, perm = permute(xt.astype(dt), ids, num_experts=c.n_routed_experts, impl=c.moe_impl)
        pairs, s, rate = (None, None, None), 1.0, 0.0
        if self.experts is not None:  # LoRA: each projection plus its per-expert adapter
            pairs, s = self.experts.pairs(dt)
            rate = self.experts.rate()

        # FP8: each w is the weight itself, quantised in the GEMM (not a cast copy), or the train
        # state's stored E4M3 copy of it (`pallas_kernels.fp8.stored.Fp8Copy`), read as stored
        fp8 = c.fp8 == "blockwise"
        # unrolled layers: each w is a slice of its parameter stack, alive through the backward,
        # which quantises it again instead of holding the forward's E4M3 copy; a scanned layer's
        # w would be stacked whole as a residual
        requant = fp8 and not c.scan_layers
        ws = tuple(getattr(self, p)[...] if fp8 else getattr(self, p)[...].astype(dt) for p in EXPERT_PROJS)
        # the FP8 GEMMs read no stacks in place (each layer's weights are quantised, a read of
        # the stack's slice); their weight gradients go to the sinks as the others' do
        in_stacks = tuple(None if fp8 else _in_stack(p, dt) for p in EXPERT_PROJS)
        sinks = tuple(_dw_sink(p, c.n_routed_experts) if fp8 or st is not None else None
                      for p, st in zip(EXPERT_PROJS, in_stacks))
        g, u = expert_matmuls(xs, ws[:2], pairs[:2], group_sizes, s, c.moe_impl, rate, in_stacks[:2],
                              sinks[:2], fp8=fp8, fp8_requantize=requant)
        w_rows = sorted_weights(weights, perm)
        # FP8: the SwiGLU input kept for the backward in E4M3 (`fp8_swiglu`)
        h = (fp8_swiglu if fp8 else swiglu)(checkpoint_name(g, "moe_gate"), checkpoint_name(u, "moe_up"), w_rows)
        y, = expert_matmuls(h, ws[2:], pairs[2:], group_sizes, s, c.moe_impl, rate, in_stacks[2:],
                            sinks[2:], fp8=fp8, fp8_requantize=requant)
        return unpermute_sum(y, perm, c.num_experts_per_tok, impl=c.moe_impl)

    def __call__(self, x, token_mask):
        """x [B, T, D]; token_mask [B, T] bool -> (y [B, T, D], stats dict)."""
        c = self.cfg
        B, T, D = x.shape
        dt = dtype_of(c.dtype)
        xt = x.reshape(B * T, D)
        logits = jnp.dot(xt.astype(jnp.float32), self.gate[...].astype(jnp.float32))
        bias = (self.e_score_correction_bias[...] if self.e_score_correction_bias is not None
                else jnp.zeros((c.n_routed_experts,), jnp.float32))
        ids, weights, scores = route(logits, bias, c)
        ctx = shr.current()
        if ctx is not None and ctx.mesh.size > 1:
            # Under any mesh the routed experts run inside shard_map (tokens local to each device;
            # experts over `expert`, which may be 1): the Pallas kernels are custom calls that the
            # SPMD partitioner would otherwise run on gathered, replicated tokens.
            K = c.num_experts_per_tok
            lora = None
            if self.experts is not None:
                pairs, s = self.experts.pairs(dt)
                rate = self.experts.rate()
                lora = {"pairs": pairs, "scale": s, "rate": rate,
                        "key": dropout_key_data() if rate > 0 else None}
            out = moe_from_context(x, ids.reshape(B, T, K), weights.reshape(B, T, K), self.gate_proj[...],
                                   self.up_proj[...], self.down_proj[...], ctx=ctx,
                                   impl=c.moe_impl, dtype=dt, lora=lora,
                                   recompute=c.moe_recompute, fp8=c.fp8 == "blockwise").astype(dt)
        else:
            out = with_recompute(self._routed, c.moe_recompute)(xt, ids, weights).reshape(B, T, D)
        if self.shared_experts is not None:
            out = out + with_recompute(self.shared_experts, c.moe_recompute)(x)
        counts, entropy, seq_aux = balance_stats(ids, scores, token_mask.reshape(-1), c, (B, T))
        return out.astype(dt), {"expert_counts": counts, "router_entropy": entropy, "seq_aux": seq_aux}


def update_router_bias(bias, counts, rate):
    """noaux_tc bias step: b_e += rate * sign(mean load - load_e) (DeepSeek-V3 sec. 2.1.2).

    bias: [..., E] fp32; counts: [..., E] routed real tokens per expert. Returns the new bias.
    """
    mean = jnp.mean(counts, axis=-1, keepdims=True)
    return bias + rate * jnp.sign(mean - counts)
