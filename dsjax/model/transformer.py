"""The DeepSeek decoder: embedding, stacked dense and MoE layers run with `jax.lax.scan`, final norm,
lm_head. Generation with the MLA latent cache is `dsjax.model.decode`.

Legend: B batch, T tokens, D hidden_size, V vocab_size, L layers, E experts, C kv_lora_rank,
R qk_rope_head_dim. Layer N is dense iff N < first_k_dense_replace (HF `DeepseekV3DecoderLayer`).
Dense and MoE layers are two stacks with a leading `layers` axis.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model.decoder import DecoderLayer
from dsjax.model.layers import Linear, RMSNorm, dtype_of
from dsjax.model.lm_loss import round_to
from dsjax.model.lora import dropout_key_data, layer_dropout
from dsjax.model.moe import EXPERT_PROJS, MoE, expert_stacks
from dsjax.model.mtp import MTP
from dsjax.model.rope import inv_freq_and_attention_factor, rope_cos_sin, softmax_scale

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def split_layers(x):
    """A stacked layer leaf x [L, ...] -> L arrays [...] (`lax.unstack`), for unrolled layers.

    The gradient is the layers' gradients stacked into one buffer [L, ...] behind an
    optimization barrier, so its consumers (clip norm, finiteness check, the optimizer's fused
    update of weight and moments) read a plain array. Indexing `x[i]` per layer instead gives a
    chain of L zero-pads and adds that every consumer re-evaluates per element (O(L^2) traffic:
    6-7 ms per clip-norm reduction at 8 layers on the H200); an un-barriered concatenate is
    pushed by XLA into the optimizer's update, which it then splits into one fusion per output
    (weight, first and second moment), each re-reading gradients and moments (+6 ms per step at
    4 layers on the H200). Values and gradients equal `lax.unstack`'s. Non-float leaves are
    split without a custom gradient.
    """
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.unstack(x)
    return _split_layers(x)


@jax.custom_vjp
def _split_layers(x):
    return tuple(jax.lax.unstack(x))


def _split_layers_fwd(x):
    return _split_layers(x), None


def _split_layers_bwd(_, cts):
    return (jax.lax.optimization_barrier(jnp.stack(cts)),)


_split_layers.defvjp(_split_layers_fwd, _split_layers_bwd)


@jax.custom_vjp
def lm_head_matmul(h, w):
    """Logits h [..., D] @ w [D, V] -> [..., V] float32 (inputs in the compute dtype, fp32
    accumulation and output).

    Backward: the fp32 cotangent of the logits is rounded to the compute dtype (h.dtype) before
    the two GEMMs (fp32 accumulation), as torch autocast does for HF's bf16 lm_head. Plain
    autodiff would run both backward GEMMs in fp32 on [B*T, V] operands (on an H200 at V2-Lite
    geometry: two 3.4 TFLOP fp32 GEMMs per step). With fp32 inputs nothing is rounded, so fp32
    runs equal autodiff exactly.
    """
    return jnp.dot(h, w, preferred_element_type=jnp.float32)


def _lm_head_fwd(h, w):
    return lm_head_matmul(h, w), (h, w)


def _lm_head_bwd(res, g):
    h, w = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("...v,dv->...d", g, w, preferred_element_type=jnp.float32)
    dw = jnp.einsum("...d,...v->dv", h, g, preferred_element_type=jnp.float32)
    return dh.astype(h.dtype), dw.astype(w.dtype)


lm_head_matmul.defvjp(_lm_head_fwd, _lm_head_bwd)


def _stack(cfg: ModelConfig, n: int, moe: bool, rngs: nnx.Rngs):
    if n == 0:
        return None

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r):
        return DecoderLayer(cfg, moe, rngs=r)

    return make(rngs)


class DeepSeekModel(nnx.Module):
    """DeepSeek V2/V3 causal LM. `__call__(tokens, positions, segment_ids) -> (logits, aux)`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(cfg.initializer_range)
        wdt = dtype_of(cfg.weight_dtype)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), wdt),
                                      out_sharding=("vocab", "embed"))
        self.dense_layers = _stack(cfg, cfg.first_k_dense_replace, False, rngs)
        self.moe_layers = _stack(cfg, cfg.num_moe_layers, True, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), cfg, rngs=rngs, fp8=False)
        self.mtp = MTP(cfg, rngs=rngs) if cfg.num_nextn_predict_layers > 0 else None
        inv_freq, attn_factor = inv_freq_and_attention_factor(cfg)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static constants (float32-exact), not state
        self.attn_factor = attn_factor
        self.scale = softmax_scale(cfg)

    # -- training / scoring --------------------------------------------------------------------
    def _run_stack(self, stack, h, cos, sin, segment_ids):
        graphdef, state = nnx.split(stack)
        drop_key = dropout_key_data()  # LoRA dropout: layer i draws from fold_in(drop_key, i)

        def body(carry, xs):
            layer_state, i = xs
            layer = nnx.merge(graphdef, layer_state)
            with layer_dropout(drop_key, i):
                out, stats = layer(carry, cos, sin, segment_ids, self.scale)
            return out, stats

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.cfg.remat])
        n = jax.tree.leaves(state)[0].shape[0]
        if self.cfg.scan_layers:
            return jax.lax.scan(body, h, (state, jnp.arange(n, dtype=jnp.int32)))
        # unrolled: each stacked leaf is split once (`split_layers`), so its gradient is one
        # materialised concatenate of the layers' gradients; the routed experts' kernels read
        # their weights from the stacks in place (`expert_stacks`)
        leaves, treedef = jax.tree.flatten(state)
        stacks = None
        if isinstance(getattr(stack, "mlp", None), MoE):
            stacks = {p: getattr(stack.mlp, p)[...] for p in EXPERT_PROJS}
        stats = []
        for i, layer_leaves in enumerate(zip(*(split_layers(x) for x in leaves))):
            with expert_stacks(stacks, i):
                h, st = body(h, (jax.tree.unflatten(treedef, layer_leaves), jnp.int32(i)))
            stats.append(st)
        return h, jax.tree.map(lambda *xs: jnp.stack(xs), *stats)

    def _rope_inputs(self, tokens, positions, segment_ids):
        """Defaults (positions 0..T-1, one segment) and RoPE cos/sin [B, T, R/2] for tokens [B, T]."""
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.attn_factor)
        return segment_ids, cos, sin

    def embed(self, tokens):
        return jnp.take(self.embed_tokens[...], tokens, axis=0).astype(dtype_of(self.cfg.dtype))

    def hidden_states(self, tokens, positions=None, segment_ids=None):
        """tokens [B, T] int32 -> (final normed hidden [B, T, D] in compute dtype, aux dict)."""
        segment_ids, cos, sin = self._rope_inputs(tokens, positions, segment_ids)
        h = self.embed(tokens)
        aux = {}
        if self.dense_layers is not None:
            h, _ = self._run_stack(self.dense_layers, h, cos, sin, segment_ids)
        if self.moe_layers is not None:
            h, stats = self._run_stack(self.moe_layers, h, cos, sin, segment_ids)
            aux = stats  # each [L_moe, ...]
        return self.norm(h), aux

    def lm_head_weight(self, dtype):
        """The output projection [D, V] in `dtype`: lm_head.kernel (plus its LoRA update
        A B alpha/r when it has an adapter), or the transposed embedding table when
        tie_word_embeddings."""
        if self.lm_head is None:
            return self.embed_tokens[...].astype(dtype).T
        if self.lm_head.lora is not None:  # LoRA on lm_head: the merged weight W + A B s
            return self.lm_head.lora.merged(self.lm_head.kernel[...], dtype)
        return self.lm_head.kernel[...].astype(dtype)

    def logits(self, h):
        """h [B, T, D] -> logits [B, T, V] float32: the lm_head matmul takes compute-dtype inputs
        but writes fp32, so the cross-entropy never sees bf16-rounded logits (a bf16 log-softmax
        over a 100k vocabulary visibly quantises the loss; HF keeps them in the model dtype).
        With `model.round_logits` they are rounded to the compute dtype and returned upcast to
        fp32, HF's values. Training uses `dsjax.model.lm_loss.lm_head_loss`, which never keeps
        these logits."""
        logits = lm_head_matmul(h, self.lm_head_weight(h.dtype))
        if self.cfg.round_logits:
            logits = round_to(logits, h.dtype)
        return logits

    def __call__(self, tokens, positions=None, segment_ids=None):
        h, aux = self.hidden_states(tokens, positions, segment_ids)
        return self.logits(h), aux

    def mtp_hidden(self, h, tokens, positions=None, segment_ids=None):
        """MTP hidden states from the final normed hidden h [B, T, D] and the inputs tokens [B, T].

        Returns (list of K normed hidden [B, T, D], depth k at position i predicting token
        i + k + 2 through `lm_head_weight`; list of K MoE stats dicts). See dsjax/model/mtp.py
        for the maths and `mtp_targets` for the matching targets and mask.
        """
        segment_ids, cos, sin = self._rope_inputs(tokens, positions, segment_ids)
        return self.mtp(h, tokens, self.embed, cos, sin, segment_ids, self.scale)

    def mtp_logits(self, h, tokens, positions=None, segment_ids=None):
        """`mtp_hidden` projected to fp32 logits: (list of K [B, T, V], list of K stats dicts)."""
        hs, stats = self.mtp_hidden(h, tokens, positions, segment_ids)
        return [self.logits(x) for x in hs], stats
