"""One decoder block (HF `DeepseekV3DecoderLayer`), shared by the main stacks
(`dsjax.model.transformer`) and the MTP depths (`dsjax.model.mtp`).

Legend: B batch, T tokens, D hidden_size, R qk_rope_head_dim.
"""
from __future__ import annotations

from flax import nnx

from dsjax.config import ModelConfig
from dsjax.model.layers import MLA, MLP, RMSNorm
from dsjax.model.moe import MoE


class DecoderLayer(nnx.Module):
    """h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h)).

    The MLP is DeepSeekMoE when `moe`, else the dense SwiGLU of width intermediate_size.
    `__call__(h [B, T, D], cos/sin [B, T, R/2], segment_ids [B, T], scale)` ->
    (h [B, T, D], MoE stats dict, empty for a dense block).
    """

    def __init__(self, cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.self_attn = MLA(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, cfg.intermediate_size, rngs=rngs)
        self.is_moe = moe

    def __call__(self, h, cos, sin, segment_ids, scale, token_mask=None):
        """token_mask [B, T] bool: the tokens the MoE's balance statistics count (default: the
        real ones, segment_ids > 0)."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, segment_ids, scale)
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            y, stats = self.mlp(x, segment_ids > 0 if token_mask is None else token_mask)
        else:
            y, stats = self.mlp(x), {}
        return h + y, stats
