"""Generation with the MLA latent cache: prefill on expanded K/V, decode steps on the latent
(absorbed attention), an optional int8 latent, optional attention sinks with a sliding window.

Legend: B batch, T new tokens, S cache slots, H heads, C kv_lora_rank, R qk_rope_head_dim,
Dn qk_nope_head_dim, Dv v_head_dim, V vocab_size, L layers.

Cache (`init_cache`): a tuple of L per-layer dicts, each
  c_kv    [B, S, C]  the normed latent, in the cache dtype (int8: rint(c_kv / c_scale));
  c_scale [B, S]     float32, only for int8: max|c_kv| / 127 per token (the token's scale);
  k_rope  [B, S, R]  the shared RoPE key in the compute dtype (also for int8).
Per-layer arrays (not one stacked [L, ...] array) so a step's per-row writes update each
layer's buffer in place when the cache is donated.

Positions. Full cache (`window` None): token n of a row sits in slot n at position n and k_rope
is stored rotated. Sinks + window (StreamingLLM, Xiao et al. 2023): S = sink_tokens + window;
the first sink_tokens tokens keep slots 0..k-1, later tokens go round a ring buffer of `window`
slots, k_rope is stored before RoPE and rotated at its position within the cache each step
(sinks at 0..k-1, the window's tokens in order after them, the query last), so relative
distances inside the window are exact and positions never pass S - 1. While a row's stream fits
(n < S) every position equals the full cache's.

Absorbed decode (DeepSeek-V2 sec. 2.1.2): with W_UK [C, H, Dn] and W_UV [C, H, Dv] from
kv_b_proj, q_lat = q_nope @ W_UK^T [B, T, H, C]; scores = (q_lat . c_kv + q_rope . k_rope) *
scale over the valid slots; o_lat = softmax @ c_kv [B, T, H, C]; heads = o_lat @ W_UV
[B, T, H, Dv]; then o_proj. Reads (C + R) values per cached token instead of expanding
H * (Dn + Dv). int8 dequantises inside: scores use (q_lat . c_int8) * c_scale and o_lat uses
(p * c_scale) @ c_int8.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.model.layers import dtype_of
from dsjax.model.rope import rope_cos_sin
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention.reference import attention_reference
from pallas_kernels.mla_decode import mla_decode
from pallas_kernels.mla_decode.api import kernel_fits

KV_CACHE_DTYPES = ("bfloat16", "float32", "int8")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """How generation caches and reads the latent.

    dtype: None (the model's compute dtype), "bfloat16", "float32" or "int8" (c_kv in int8 with
      a float32 scale per token; k_rope stays in the compute dtype).
    sink_tokens, window: None window = a full cache of every token; else the first sink_tokens
      tokens plus the last `window` ones (StreamingLLM), a cache of sink_tokens + window slots.
    absorb: decode steps attend over the latent (True) or expand K/V through kv_b_proj (False,
      the training form; prefill always expands).
    kernel: absorbed decode steps attend through the split-context Mosaic GPU kernel
      (`pallas_kernels.mla_decode`, each row's latent read once) where it takes the cache (a
      bf16 / fp16 or int8 cache of a multiple of 64 slots, kv_lora_rank a multiple of 128 up to
      512; int8 converted inside the kernel); False: XLA's two latent products.
    Raises ValueError (one line naming the option) on a bad value.
    """

    dtype: str | None = None
    sink_tokens: int = 0
    window: int | None = None
    absorb: bool = True
    kernel: bool = False

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype (--kv-cache-dtype): {self.dtype!r} is not one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"window (--window): must be at least 1 (got {self.window})")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens (--sink-tokens): must be at least 0 (got {self.sink_tokens})")
        if self.sink_tokens and self.window is None:
            raise ValueError("sink_tokens (--sink-tokens): needs window (--window): the sinks are kept "
                             "in front of a sliding window")

    def slots(self, needed: int) -> int:
        """Cache length S: `needed` (prompt + new tokens) for a full cache, else sinks + window."""
        return needed if self.window is None else self.sink_tokens + self.window


def cache_shapes(cfg, batch: int, length: int, cc: CacheConfig):
    """The cache's layout as a tuple of L dicts of jax.ShapeDtypeStruct (see the module doc)."""
    name = cc.dtype or cfg.dtype
    cdt = dtype_of(cfg.dtype)
    sd = jax.ShapeDtypeStruct
    layer = {"c_kv": sd((batch, length, cfg.kv_lora_rank), jnp.int8 if name == "int8" else dtype_of(name)),
             "k_rope": sd((batch, length, cfg.qk_rope_head_dim), cdt if name == "int8" else dtype_of(name))}
    if name == "int8":
        layer["c_scale"] = sd((batch, length), jnp.float32)
    return tuple(dict(layer) for _ in range(cfg.num_hidden_layers))


def init_cache(cfg, batch: int, length: int, cc: CacheConfig):
    """A zeroed cache of `length` slots per row (`cache_shapes`)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes(cfg, batch, length, cc))


def cache_nbytes(cache) -> int:
    """Bytes of a cache's arrays (arrays or ShapeDtypeStructs)."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache)))


def quantize_int8(x):
    """x [..., C] -> (int8 rint(x / s) [..., C], s = max|x| / 127 [...] float32); all-zero rows
    give s = 0 and zeros. |error| <= s / 2 per element."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
    q = jnp.clip(jnp.rint(xf * inv[..., None]), -127, 127).astype(jnp.int8)
    return q, amax / 127.0


def _layers(model):
    """The decoder layers in order, each one nnx module (static slices of the stacks)."""
    for stack in (model.dense_layers, model.moe_layers):
        if stack is None:
            continue
        graphdef, state = nnx.split(stack)
        for i in range(jax.tree.leaves(state)[0].shape[0]):
            yield nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], state))


def _mlp(layer, h):
    y = layer.post_attention_layernorm(h)
    ones = jnp.ones(h.shape[:2], bool)
    return h + (layer.mlp(y, ones)[0] if layer.is_moe else layer.mlp(y))


def _store(lc, c_kv, k_rope, write):
    """Write c_kv [B, T, C] (quantised for an int8 cache) and k_rope [B, T, R] with
    write(buffer, values) into the layer's cache dict; returns the new dict."""
    out = dict(lc)
    if "c_scale" in lc:
        q, s = quantize_int8(c_kv)
        out["c_kv"], out["c_scale"] = write(lc["c_kv"], q), write(lc["c_scale"], s)
    else:
        out["c_kv"] = write(lc["c_kv"], c_kv.astype(lc["c_kv"].dtype))
    out["k_rope"] = write(lc["k_rope"], k_rope.astype(lc["k_rope"].dtype))
    return out


def _run_layers(model, tokens, cache, cos, sin, raw_keys: bool, write, attend):
    """The decoder stack over tokens [B, T] int32 at RoPE angles (cos, sin) [B, T, R/2]: per layer,
    the roped queries and the new latent; the latent goes into the layer's cache with
    `_store(..., write)` (k_rope before RoPE when raw_keys, the windowed cache, else rotated), then
    attend(attn, q [B, T, H, Dn + R], c_kv [B, T, C], k_rope [B, T, R] rotated, the layer's new
    cache) -> heads [B, T, H, Dv]; then o_proj and the MLP. Prefill and decode steps differ only in
    the angles, `write` and `attend`. Returns (h [B, T, D] before the final norm, the new cache)."""
    B, T = tokens.shape
    h = model.embed(tokens)
    new = []
    for layer, lc in zip(_layers(model), cache):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.queries(x, cos, sin)
        c_kv, k_raw = attn.latent_unroped(x)
        k_rope = attn.rope_key(k_raw, cos, sin)
        lc = _store(lc, c_kv, k_raw if raw_keys else k_rope, write)
        o = attend(attn, q, c_kv, k_rope, lc)
        h = _mlp(layer, h + attn.o_proj(o.reshape(B, T, -1)))
        new.append(lc)
    return h, tuple(new)


def prefill(model, tokens, cache, last, cc: CacheConfig):
    """Run tokens [B, T] int32 at positions 0..T-1 into an empty cache (T <= S): causal
    attention over the chunk itself on expanded K/V (the full-precision latent; an int8 cache
    stores the quantised one). Rows may be right-padded: the slots past a row's length hold
    padding that the decode steps mask and then overwrite.

    last: [B] int32, the index of each row's last prompt token. Returns (logits [B, V] float32
    at `last`, the cache with slots 0..T-1 written).
    """
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cos, sin = rope_cos_sin(positions, model.inv_freq, model.attn_factor)

    def attend(attn, q, c_kv, k_rope, lc):
        k, v = attn.expand_kv(c_kv, k_rope)
        return flash_attention(q, k, v, causal=True, scale=model.scale, impl=model.cfg.attention_impl)

    h, new = _run_layers(model, tokens, cache, cos, sin, cc.window is not None,
                         lambda buf, val: jax.lax.dynamic_update_slice_in_dim(buf, val, 0, 1), attend)
    h_last = h[jnp.arange(B), last][:, None]
    return model.logits(model.norm(h_last))[:, 0], new


def slot_layout(cur, S: int, cc: CacheConfig):
    """Where token `cur` [B] int32 (its index in each row's stream) goes and what it sees.

    Returns (slot [B] where it is written, q_pos [B] its RoPE position, key_pos [B, S] the
    positions of the slots' keys (None for a full cache: the slot index, keys stored rotated),
    valid [B, S] bool: the slots it attends to, itself included)."""
    s = jnp.arange(S, dtype=jnp.int32)[None, :]
    if cc.window is None:
        return cur, cur, None, s <= cur[:, None]
    k, W = cc.sink_tokens, cc.window
    slot = jnp.where(cur < k, cur, k + jnp.remainder(cur - k, W))
    n = cur + 1  # tokens in the stream once this one is written
    offset = jnp.maximum(n - S, 0)  # tokens that have left the window
    held = cur[:, None] - jnp.remainder(cur[:, None] - s, W)  # the token a ring slot holds (k + j = s)
    key_pos = jnp.where(s < k, s, held - offset[:, None])
    return slot, cur - offset, key_pos, s < jnp.minimum(n, S)[:, None]


def absorbed_attention(attn, q, lc, k_rope, valid, scale, kernel: bool = False):
    """Attention over the latent. q [B, T, H, Dn + R] (roped); lc the layer's cache (c_kv
    [B, S, C], c_scale [B, S] for int8); k_rope [B, S, R] rotated; valid [B, S] or [B, T, S]
    bool. Returns heads [B, T, H, Dv] in q.dtype. fp32 scores, softmax and accumulation;
    the two latent matmuls take compute-dtype operands. kernel: one query per row (T = 1) over
    a cache the kernel takes goes through `pallas_kernels.mla_decode` (`CacheConfig.kernel`)."""
    cfg = attn.cfg
    cdt = q.dtype
    w_uk, w_uv = attn.absorbed_weights(cdt)
    q_nope, q_rope = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    f32 = jnp.float32
    q_lat = jnp.einsum("bthn,chn->bthc", q_nope, w_uk, preferred_element_type=f32).astype(cdt)
    k_rope = k_rope.astype(cdt)
    if kernel and q.shape[1] == 1 and valid.ndim == 2 and kernel_fits(q_lat, lc["c_kv"], k_rope) is None:
        bias = jnp.where(valid, 0.0, -jnp.inf).astype(f32)
        o_lat = mla_decode(q_lat[:, 0], q_rope[:, 0].astype(cdt), lc["c_kv"], k_rope, bias,
                           scale, c_scale=lc.get("c_scale"), impl="mosaic")[:, None].astype(cdt)
        return jnp.einsum("bthc,chv->bthv", o_lat, w_uv, preferred_element_type=f32).astype(cdt)
    c_kv = lc["c_kv"].astype(cdt)  # int8 values are exact in bf16
    s_lat = jnp.einsum("bthc,bsc->bhts", q_lat, c_kv, preferred_element_type=f32)
    c_scale = lc.get("c_scale")
    if c_scale is not None:
        s_lat = s_lat * c_scale[:, None, None, :]
    s_rope = jnp.einsum("bthr,bsr->bhts", q_rope, k_rope, preferred_element_type=f32)
    mask = valid[:, None, None, :] if valid.ndim == 2 else valid[:, None]
    p = jax.nn.softmax(jnp.where(mask, (s_lat + s_rope) * scale, -jnp.inf), axis=-1)
    if c_scale is not None:
        p = p * c_scale[:, None, None, :]
    # o_lat is written in the compute dtype (accumulated in fp32 by the matmul): the next
    # matmul takes it in that dtype, and XLA's CPU backend has no bf16 x bf16 -> f32 form of
    # this contraction once fused into the step
    o_lat = jnp.einsum("bhts,bsc->bthc", p.astype(cdt), c_kv)
    return jnp.einsum("bthc,chv->bthv", o_lat, w_uv, preferred_element_type=f32).astype(cdt)


def expanded_attention(attn, q, lc, k_rope, valid, scale):
    """The same attention with the cached latent (dequantised for int8) expanded through
    kv_b_proj into per-head K/V [B, S, H, *] (the training form); valid [B, S]."""
    c_kv = lc["c_kv"]
    if "c_scale" in lc:
        c_kv = c_kv.astype(jnp.float32) * lc["c_scale"][..., None]
    k, v = attn.expand_kv(c_kv.astype(q.dtype), k_rope)
    seg = (jnp.ones(q.shape[:2], jnp.int32), valid.astype(jnp.int32))  # slot segment 0 = masked
    return attention_reference(q, k, v, causal=False, scale=scale, segment_ids=seg)


def decode_step(model, tokens, cache, cur, cc: CacheConfig):
    """One token per row: tokens [B, 1] int32, token index cur [B] int32 in each row's stream
    (rows advance independently). Writes its latent at `slot_layout`'s slot, then attends over
    the row's valid slots (absorbed or expanded per `cc.absorb`). Returns (logits [B, V] float32,
    the new cache)."""
    B = tokens.shape[0]
    S = cache[0]["c_kv"].shape[1]
    slot, q_pos, key_pos, valid = slot_layout(cur, S, cc)
    cos_q, sin_q = rope_cos_sin(q_pos[:, None], model.inv_freq, model.attn_factor)
    if key_pos is not None:
        cos_k, sin_k = rope_cos_sin(key_pos, model.inv_freq, model.attn_factor)
    rows = jnp.arange(B)
    attention = (functools.partial(absorbed_attention, kernel=cc.kernel) if cc.absorb
                 else expanded_attention)

    def attend(attn, q, c_kv, k_rope, lc):
        keys = lc["k_rope"] if key_pos is None else attn.rope_key(lc["k_rope"], cos_k, sin_k)
        return attention(attn, q, lc, keys, valid, model.scale)

    h, new = _run_layers(model, tokens, cache, cos_q, sin_q, key_pos is not None,
                         lambda buf, val: buf.at[rows, slot].set(val[:, 0]), attend)
    return model.logits(model.norm(h))[:, 0], new


def stream_nll(model, tokens, cc: CacheConfig, slots: int | None = None):
    """Teacher-forced next-token negative log-likelihood through the generation cache.

    tokens [B, N] int32 (N >= 2): token 0 is prefilled, then every later token goes through one
    `decode_step` (jitted with the cache donated, as `dsjax.generate.generate` runs them), so each
    prediction after the first reads the cache (its dtype, sinks and window) as generation does.
    slots: the cache length S (default `cc.slots(N)`: N for a full cache, sinks + window else).
    Returns (nll [B, N - 1] float32, top1 [B, N - 1] int32), numpy: nll[:, t] = -log p(tokens[:, t + 1]
    | the cache after tokens[:, :t + 1]) in nats and top1[:, t] that prediction's argmax token.
    Raises ValueError for N < 2.
    """
    B, N = tokens.shape
    if N < 2:
        raise ValueError(f"stream_nll: tokens must be [B, N] with N >= 2 (got shape {tokens.shape})")
    tokens = jnp.asarray(tokens, jnp.int32)
    graphdef, state = nnx.split(model)

    def nll(logits, target):
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(lp, target[:, None], axis=-1)[:, 0], jnp.argmax(logits, -1).astype(jnp.int32)

    def first(st, tok, target, c):
        logits, c = prefill(nnx.merge(graphdef, st), tok, c, jnp.zeros((B,), jnp.int32), cc)
        return nll(logits, target), c

    def step(st, tok, target, c, cur):
        logits, c = decode_step(nnx.merge(graphdef, st), tok, c, cur, cc)
        return nll(logits, target), c

    first, step = jax.jit(first, donate_argnums=(3,)), jax.jit(step, donate_argnums=(3,))
    cache = init_cache(model.cfg, B, cc.slots(N) if slots is None else slots, cc)
    out = []
    lo, cache = first(state, tokens[:, :1], tokens[:, 1], cache)
    out.append(lo)
    for t in range(1, N - 1):
        lo, cache = step(state, tokens[:, t:t + 1], tokens[:, t + 1], cache, jnp.full((B,), t, jnp.int32))
        out.append(lo)
    return tuple(np.asarray(jnp.stack(x, axis=1)) for x in zip(*out))
