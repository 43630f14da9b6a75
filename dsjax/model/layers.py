"""Building blocks: linear, RMSNorm, SwiGLU MLP and MLA attention (Flax NNX).

Legend: B batch, T query length, S key length, D hidden_size, H heads, Dn qk_nope_head_dim,
R qk_rope_head_dim, Dv v_head_dim, C kv_lora_rank, Q q_lora_rank, F MLP width.
Kernels are stored [in, out] (HF linears are [out, in]); parameters carry logical axis names
(`embed`, `heads`, `q_lora`, `kv_lora`, `mlp`, `vocab`, `norm`) that `sharding.rules` maps to the mesh;
activations are constrained by logical names (`batch`, `seq`, `act_heads`) under an active
`sharding.rules` context, and attention becomes ring attention when that context's mesh has
context > 1 (`sharding.ring_attention`).
Maths: DeepSeek-V2 paper sec. 2.1 (MLA); transformers/models/deepseek_v3/modeling_deepseek_v3.py.
"""
from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model.rope import apply_rope
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.fp8.frozen import Fp8Weight
from pallas_kernels.moe import swiglu
from sharding import rules as shr
from sharding.fp8_linear import fp8_linear_from_context, fp8_linear_frozen_from_context
from sharding.ring_attention import context_attention, local_attention

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    return DTYPES[name]


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] in weight dtype, cast to the compute dtype.

    Under `model.fp8=blockwise` the product (forward, dgrad and wgrad) is
    `pallas_kernels.fp8.fp8_linear` of the kernel itself (E4M3, 1 x 128 / 128 x 128 scales), the
    output in the compute dtype; fp8=False keeps a layer out of it (the lm_head). Under a mesh
    of several devices it runs inside `shard_map` on each device's tokens
    (`sharding.fp8_linear.fp8_linear_from_context`, by the kernel's logical `axes`). The bias and
    a LoRA adapter stay in the compute dtype. A kernel that is a frozen `Fp8Weight` (E4M3 values
    and 128 x 128 scales, e.g. DeepSeek-V3's checkpoint loaded as it ships) is used as stored:
    `pallas_kernels.fp8.frozen.fp8_linear_frozen` (forward and dgrad, no wgrad), under a mesh on
    each device's tokens and weight shard (`sharding.fp8_linear.fp8_linear_frozen_from_context`).
    A kernel that is a stored E4M3 copy (`pallas_kernels.fp8.stored.Fp8Copy`: the train state's
    compute copy on one device, `dsjax.train.step.compute_copy`) goes to the same FP8 linear,
    which reads its blocks instead of quantising and gives its gradient carrier the kernel's
    gradient."""

    def __init__(self, d_in: int, d_out: int, axes: tuple, cfg: ModelConfig, *, rngs: nnx.Rngs,
                 bias: bool = False, fp8: bool = True):
        init = nnx.initializers.normal(cfg.initializer_range)
        wdt = dtype_of(cfg.weight_dtype)
        self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out), wdt), out_sharding=axes)
        self.bias = nnx.Param(jnp.zeros((d_out,), wdt), out_sharding=axes[1:]) if bias else None
        self.dtype = dtype_of(cfg.dtype)
        self.lora = None  # a `dsjax.model.lora.LoraAdapter` when fine-tuned with LoRA
        self.fp8 = fp8 and cfg.fp8 == "blockwise"
        # unrolled layers: the kernel is a slice of its parameter stack, alive through the
        # backward, which quantises it again instead of holding the forward's E4M3 copy
        self.fp8_requantize = self.fp8 and not cfg.scan_layers
        self.axes = tuple(axes)

    def __call__(self, x):
        kernel = self.kernel[...]
        if isinstance(kernel, Fp8Weight):
            y = fp8_linear_frozen_from_context(x.astype(self.dtype), kernel, self.axes, ctx=shr.current())
        elif self.fp8:
            y = fp8_linear_from_context(x.astype(self.dtype), kernel, self.axes, ctx=shr.current(),
                                        requantize_weight=self.fp8_requantize)
        else:
            y = jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora is not None:
            y = y + self.lora(x, self.dtype)
        return y


def _rms_norm_fwd(x, w, eps):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * (xf * r).astype(x.dtype), (x, w, r)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x, w, eps):
    """HF `DeepseekV3RMSNorm`: w * (x * rsqrt(mean(x^2, -1) + eps)), the statistics in fp32 and
    the normalised x cast to x.dtype before the weight multiply.

    x: [..., D] (any float dtype); w: [D]; eps: float. Returns [..., D] in x.dtype.
    Custom VJP: the residuals are x, w and the fp32 [..., 1] factor r; the backward recomputes
    the normalised x and gives dx = r (g - x r^2 mean(g x)) with g = dout * w (rounded to
    x.dtype, as autodiff of the forward rounds it) in fp32, and dw = sum(dout * x r) over the
    leading dims in fp32.
    """
    return _rms_norm_fwd(x, w, eps)[0]


def _rms_norm_bwd(eps, res, dout):
    x, w, r = res
    xf = x.astype(jnp.float32)
    g = (dout * w.astype(x.dtype)).astype(jnp.float32)
    dx = r * (g - xf * (r * r) * jnp.mean(g * xf, axis=-1, keepdims=True))
    y = (xf * r).astype(x.dtype).astype(jnp.float32)
    lead = tuple(range(x.ndim - 1))
    dw = jnp.sum(dout.astype(jnp.float32) * y, axis=lead)
    return dx.astype(x.dtype), dw.astype(w.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


class RMSNorm(nnx.Module):
    """weight * (x * rsqrt(mean(x^2) + eps)) with fp32 statistics, cast to the input dtype before
    the weight multiply (HF `DeepseekV3RMSNorm`).

    With `model.scan_layers` it is `rms_norm`, whose custom VJP keeps x in its own dtype: autodiff
    of the formula keeps the fp32 copy of x, and under `lax.scan` that becomes an fp32 residual
    stack per norm (2.3 GB at 27 V2-Lite layers x 8192 tokens, measured on the H200). Unrolled,
    XLA already rebuilds the fp32 x inside the backward's fusions, and the formula's autodiff
    measured 0.2 GB lower than the custom VJP (4 layers); the two agree to fp32 rounding."""

    def __init__(self, dim: int, eps: float, cfg: ModelConfig):
        self.weight = nnx.Param(jnp.ones((dim,), dtype_of(cfg.weight_dtype)), out_sharding=("norm",))
        self.eps = eps
        self.custom_vjp = cfg.scan_layers

    def __call__(self, x):
        if self.custom_vjp:
            return rms_norm(x, self.weight[...], self.eps)
        return _rms_norm_fwd(x, self.weight[...], self.eps)[0]  # the same formula, autodiff


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); x [..., D] -> [..., D]. The activation is
    `pallas_kernels.moe.swiglu` (fp32 math; its backward keeps only the two projections, named
    `mlp_gate` / `mlp_up` for the shared experts' recompute under `model.moe_recompute`)."""

    def __init__(self, cfg: ModelConfig, width: int, *, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.gate_proj = Linear(D, width, ("embed", "mlp"), cfg, rngs=rngs)
        self.up_proj = Linear(D, width, ("embed", "mlp"), cfg, rngs=rngs)
        self.down_proj = Linear(width, D, ("mlp", "embed"), cfg, rngs=rngs)

    def __call__(self, x):
        g = checkpoint_name(self.gate_proj(x), "mlp_gate")
        return self.down_proj(swiglu(g, checkpoint_name(self.up_proj(x), "mlp_up")))


class MLA(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2 sec. 2.1), training form (K/V expanded per head).

    q = q_proj(x) or q_b_proj(q_a_layernorm(q_a_proj(x))) -> [B, T, H, Dn + R];
    [c_kv | k_rope] = kv_a_proj_with_mqa(x); c_kv normed (eps 1e-6); k_rope is one shared head;
    [k_nope | v] = kv_b_proj(c_kv) per head; RoPE on the last R dims of q and on k_rope.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        qk = cfg.qk_head_dim
        b = cfg.attention_bias
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, ("embed", "q_lora"), cfg, rngs=rngs, bias=b)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, cfg)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * qk, ("q_lora", "heads"), cfg, rngs=rngs)
            self.q_proj = None
        else:
            self.q_proj = Linear(D, H * qk, ("embed", "heads"), cfg, rngs=rngs)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = Linear(D, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                         ("embed", "kv_lora"), cfg, rngs=rngs, bias=b)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, cfg)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                ("kv_lora", "heads"), cfg, rngs=rngs)
        self.o_proj = Linear(H * cfg.v_head_dim, D, ("heads", "embed"), cfg, rngs=rngs, bias=b)

    def queries(self, x, cos, sin):
        """x [B, T, D] -> roped q [B, T, H, Dn + R]."""
        c = self.cfg
        B, T, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, T, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        q_rope = apply_rope(q_rope, cos, sin, c.rope_interleave)
        return jnp.concatenate([q_nope, q_rope], axis=-1)

    def latent(self, x, cos, sin):
        """x [B, T, D] -> (normed c_kv [B, T, C], roped k_rope [B, T, R]): what the decode cache holds."""
        c_kv, k_rope = self.latent_unroped(x)
        return c_kv, self.rope_key(k_rope, cos, sin)

    def latent_unroped(self, x):
        """x [B, T, D] -> (normed c_kv [B, T, C], k_rope [B, T, R] before RoPE), compute dtype."""
        c = self.cfg
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_rope = kv[..., :c.kv_lora_rank], kv[..., c.kv_lora_rank:]
        return self.kv_a_layernorm(c_kv), k_rope

    def rope_key(self, k_rope, cos, sin):
        """The shared RoPE key k_rope [B, S, R] rotated by (cos, sin) [B, S, R/2]; k_rope.dtype."""
        return apply_rope(k_rope[:, :, None, :], cos, sin, self.cfg.rope_interleave)[:, :, 0, :]

    def absorbed_weights(self, dtype):
        """kv_b_proj's kernel split per head for absorbed attention (DeepSeek-V2 sec. 2.1.2):
        (W_UK [C, H, Dn], W_UV [C, H, Dv]) in `dtype`; k_nope = c_kv @ W_UK and v = c_kv @ W_UV
        per head, as in `expand_kv`. A LoRA adapter on kv_b_proj is folded in (W + A B scale)."""
        c = self.cfg
        lin = self.kv_b_proj
        w = lin.kernel[...] if lin.lora is None else lin.lora.merged(lin.kernel[...], jnp.float32)
        w = w.astype(dtype).reshape(c.kv_lora_rank, c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim)
        return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]

    def expand_kv(self, c_kv, k_rope):
        """(c_kv [B, S, C], k_rope [B, S, R]) -> k [B, S, H, Dn + R], v [B, S, H, Dv]."""
        c = self.cfg
        B, S, _ = c_kv.shape
        H = c.num_attention_heads
        kv = self.kv_b_proj(c_kv).reshape(B, S, H, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv[..., :c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim:]
        k_rope = jnp.broadcast_to(k_rope[:, :, None, :].astype(k_nope.dtype), (B, S, H, c.qk_rope_head_dim))
        return jnp.concatenate([k_nope, k_rope], axis=-1), v

    def __call__(self, x, cos, sin, segment_ids, scale):
        """x [B, T, D]; cos/sin [B, T, R/2]; segment_ids [B, T] int (0 = padding) -> [B, T, D]."""
        B, T, _ = x.shape
        x = shr.constrain(x, ("batch", "seq", None))
        q = shr.constrain(self.queries(x, cos, sin), ("batch", "seq", "act_heads", None))
        c_kv, k_rope = self.latent(x, cos, sin)
        k, v = self.expand_kv(c_kv, k_rope)
        ctx = shr.current()
        if shr.context_parallel_active():  # sequence over `context`: ring attention
            o = context_attention(q, k, v, ctx=ctx, causal=True, scale=scale, segment_ids=segment_ids,
                                  impl=self.cfg.attention_impl)
        elif ctx is not None and ctx.mesh.size > 1:  # per-device batch rows / heads
            o = local_attention(q, k, v, ctx=ctx, causal=True, scale=scale, segment_ids=segment_ids,
                                impl=self.cfg.attention_impl)
        else:
            o = flash_attention(q, k, v, causal=True, scale=scale, segment_ids=segment_ids,
                                impl=self.cfg.attention_impl)
        return shr.constrain(self.o_proj(o.reshape(B, T, -1)), ("batch", "seq", None))
