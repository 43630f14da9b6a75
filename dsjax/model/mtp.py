"""Multi-token prediction (DeepSeek-V3 sec. 2.2): `num_nextn_predict_layers` sequential depths.

Legend: B batch, T tokens, D hidden_size, V vocab_size, K MTP depths (k = 0..K-1).

Depth k at position i predicts token t_{i+k+2} from
    x_i   = eh_proj([enorm(Emb(t_{i+k+1})) ; hnorm(h^k_i)])     eh_proj kernel [2D, D]
    y_i   = DecoderLayer(x)_i                                    (always an MoE block)
    h^{k+1}_i = shared_head.norm(y_i);   logits = lm_head(h^{k+1}_i)
with h^0 the main model's final *normed* hidden state. Embedding and lm_head are shared with the
main model. Order of the concatenation ([embedding ; hidden]) and the use of normed hidden states
follow transformers/modeling_layers.py (`MtpLayer.forward`, `MtpModel.forward`; HF feeds
`hidden_states[-1]`, which is the output of the final norm) and vLLM/DeepSeek's released `eh_proj`
[7168, 14336] layout. HF checkpoint names: `model.layers.{num_hidden_layers + k}.{enorm, hnorm,
eh_proj, shared_head.norm, <decoder layer>}`.

The depths are stacked on a leading `layers` axis like the main stacks (orbax-safe dict keys).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model.decoder import DecoderLayer
from dsjax.model.layers import Linear, RMSNorm


class MTPLayer(nnx.Module):
    """One MTP depth: enorm, hnorm, eh_proj, one MoE decoder block, and the shared head's norm."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, cfg)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, cfg)
        self.eh_proj = Linear(2 * D, D, (None, "embed"), cfg, rngs=rngs)
        self.block = DecoderLayer(cfg, moe=cfg.n_routed_experts > 0, rngs=rngs)
        self.head_norm = RMSNorm(D, cfg.rms_norm_eps, cfg)  # HF `shared_head.norm`

    def __call__(self, h, emb_next, cos, sin, segment_ids, scale, token_mask=None):
        """h [B, T, D] (normed), emb_next [B, T, D] -> (normed h' [B, T, D], MoE stats over the
        positions of token_mask [B, T] bool, `input_mask`)."""
        x = self.eh_proj(jnp.concatenate([self.enorm(emb_next), self.hnorm(h)], axis=-1))
        y, stats = self.block(x, cos, sin, segment_ids, scale, token_mask)
        return self.head_norm(y), stats


class MTP(nnx.Module):
    """K stacked MTP depths (leading `layers` axis), applied one after another."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.num_layers = cfg.num_nextn_predict_layers

        @nnx.split_rngs(splits=self.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(r):
            return MTPLayer(cfg, rngs=r)

        self.layers = make(rngs)

    def __call__(self, h, tokens, embed, cos, sin, segment_ids, scale):
        """Hidden states of every depth.

        Args:
          h: [B, T, D] main model's final normed hidden; tokens: [B, T] int32 inputs;
          embed: tokens -> [B, T, D] (the shared embedding); cos/sin [B, T, R/2];
          segment_ids [B, T]; scale: softmax scale.
        Returns: list of K normed hidden states [B, T, D] (depth k at position i predicts
          token i + k + 2; positions whose tokens i + k + 1 fall outside the row see a wrapped
          token and must be masked, see `mtp_targets`), and a list of K MoE stats dicts, each
          over the positions whose depth-k input is real (`input_mask`).
        """
        graphdef, state = nnx.split(self.layers)
        outs, stats = [], []
        for k in range(self.num_layers):
            layer = nnx.merge(graphdef, jax.tree.map(lambda x: x[k], state))
            emb_next = embed(jnp.roll(tokens, -(k + 1), axis=1))
            h, st = layer(h, emb_next, cos, sin, segment_ids, scale, input_mask(segment_ids, k))
            outs.append(h)
            stats.append(st)
        return outs, stats


def input_mask(segment_ids, depth: int):
    """[B, T] bool: positions i whose MTP depth-`depth` input is real: token i is real and token
    i + depth + 1, whose embedding depth `depth` reads there, lies in the row and in the same
    document. The MTP blocks' routers are balanced over these positions only: elsewhere the
    input is a padding token, the next document's or a token wrapped from the row's start, and
    a batch padded or cut differently would route, count and move the router biases
    differently there."""
    s = depth + 1
    B, T = segment_ids.shape
    later = jnp.concatenate([segment_ids[:, s:], jnp.zeros((B, min(s, T)), segment_ids.dtype)], axis=1)
    return (segment_ids > 0) & (later == segment_ids)


def mtp_targets(targets, loss_mask, depth: int):
    """Targets and mask of MTP depth `depth` (0-based) from the main next-token batch.

    targets/loss_mask [B, T] (targets[i] = token i+1; loss_mask[i] = 1 iff tokens i and i+1 are
    real tokens of one document). Depth k at position i predicts token i+k+2 = targets[i+k+1];
    it is valid iff loss_mask[i..i+k+1] are all 1, i.e. tokens i..i+k+2 lie in one document
    (document boundaries, padding and the row end are masked). Returns (tgt [B, T] int32,
    mask [B, T] float32).
    """
    B, T = targets.shape
    s = depth + 1
    pad_t = jnp.zeros((B, s), targets.dtype)
    tgt = jnp.concatenate([targets[:, s:], pad_t], axis=1)
    m = loss_mask.astype(jnp.float32)
    mask = m
    for j in range(1, s + 1):
        mask = mask * jnp.concatenate([m[:, j:], jnp.zeros((B, j), jnp.float32)], axis=1)
    return tgt.astype(jnp.int32), mask
