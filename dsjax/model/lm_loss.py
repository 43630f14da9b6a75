"""The lm_head projection fused with the token cross-entropy and its gradient.

Legend: B batch, T tokens, D hidden_size, V vocab_size, n chunks of T.

A plain `log_softmax(h @ w)` keeps [B, T, V] fp32 logits alive from the forward to the backward
(3.4 GB at B4 x T2048, V 102,400) and its autodiff scatters the target cotangent into a second
zero-filled logits-sized buffer. Here the forward walks the sequence in n chunks: per chunk it
writes the chunk's fp32 logits, reduces them in one read to the log-sum-exp
(`logsumexp_one_pass`) and the target logit, and turns them at once into the gradient, which it
rounds to the compute dtype and feeds to the two gradient GEMMs. Only dh [B, T, D] and dw [D, V]
(compute dtype) outlive the forward. The GEMM FLOPs are those of forward + backward without
fusion; no GEMM is recomputed.

The gradient is known in the forward because the loss is linear in its per-token weights: the
caller passes the objective's scale (`weight`, e.g. loss_scale / n_target_tokens) and the
backward multiplies the stored gradients by the objective's cotangent (1.0 under
`jax.grad`, an exact multiply). Rounding matches `lm_head_matmul` + `log_softmax`: fp32 logits,
the gradient weight * mask * (softmax - onehot) formed in fp32 and rounded to the compute dtype
before the GEMMs (as torch autocast does for a bf16 lm_head), fp32 accumulation. With
`round_logits` the logits GEMM writes the compute dtype (fp32 accumulation) and everything after
reads them upcast to fp32: HF transformers' rounding for a bf16 model (`lm_head` returns bf16
logits, the loss calls `.float()`), with half the logit bytes of the fp32 path.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

LOGIT_CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk, at most (unless one row-step is larger)


def num_chunks(B: int, T: int, V: int, chunk_bytes: int = LOGIT_CHUNK_BYTES) -> int:
    """Fewest chunks n (a divisor of T) whose fp32 logits [B, T / n, V] fit in chunk_bytes."""
    for n in range(1, T + 1):
        if T % n == 0 and B * (T // n) * V * 4 <= chunk_bytes:
            return n
    return T


def round_to(x, dtype):
    """fp32 x rounded to the values of `dtype` (bf16 / fp16; fp32: unchanged), kept fp32.
    `reduce_precision`, unlike a cast there and back, is never removed by XLA's excess-precision
    simplification (`xla_allow_excess_precision`, on by default)."""
    fi = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)


def logsumexp_one_pass(x):
    """log(sum(exp(x), -1)) of fp32 x [..., V] in one read of x -> fp32 [...].

    A variadic reduction carries each partial's (max m, sum s of exp(x - m)) and merges two
    partials as (M, s_big + s_small * exp(-|m1 - m2|)) with M = max(m1, m2): the online
    softmax's normaliser (Milakov & Gimelshein 2018, "Online normalizer calculation for
    softmax") with one exponential per merge, the partial of the larger max keeping its sum.
    The two-pass form (max, then the sum of exponentials) reads x twice; this equals it up to
    fp32 rounding. The identity is the most negative finite fp32, so merging it never forms
    inf - inf. A NaN in a row gives NaN; +inf gives +inf (NaN for two or more), where the
    two-pass form gives NaN: not finite either way.
    """
    lo = jnp.float32(jnp.finfo(jnp.float32).min)

    def merge(a, b):
        (m1, s1), (m2, s2) = a, b
        e = jnp.exp(-jnp.abs(m1 - m2))
        return jnp.maximum(m1, m2), jnp.where(m1 >= m2, s1 + s2 * e, s1 * e + s2)

    m, s = jax.lax.reduce((x, jnp.ones_like(x)), (lo, jnp.float32(0)), merge, (x.ndim - 1,))
    return m + jnp.log(s)


def _chunk_grads(h, w, targets, mask, weight, round_logits=False):
    """One chunk: h [B, t, D], targets/mask [B, t] -> (nll_sum fp32, dh [B, t, D], dw fp32 [D, V])."""
    if round_logits:  # the GEMM writes h.dtype (fp32 accumulation); read back as fp32
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=h.dtype)
        logits = round_to(logits.astype(jnp.float32), h.dtype)
    else:
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
    lse = logsumexp_one_pass(logits)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    nll_sum = jnp.sum((lse - tgt) * mask)
    onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == targets[..., None]
    g = (jnp.exp(logits - lse[..., None]) - onehot) * (mask * weight)[..., None]
    g = g.astype(h.dtype)
    dh = jnp.einsum("btv,dv->btd", g, w, preferred_element_type=jnp.float32).astype(h.dtype)
    dw = jnp.einsum("btd,btv->dv", h, g, preferred_element_type=jnp.float32)
    return nll_sum, dh, dw


def _forward(h, w, targets, mask, weight, n_chunks, round_logits):
    B, T, D = h.shape
    targets = targets.astype(jnp.int32)
    if n_chunks == 1:
        nll_sum, dh, dw = _chunk_grads(h, w, targets, mask, weight, round_logits)
    else:
        split = lambda x: jnp.moveaxis(x.reshape(B, n_chunks, T // n_chunks, *x.shape[2:]), 1, 0)  # noqa: E731

        chunk = lambda xs: _chunk_grads(xs[0], w, xs[1], xs[2], weight, round_logits)  # noqa: E731

        def body(dw, xs):
            nll, dh_c, dw_c = chunk(xs)
            return dw + dw_c, (nll, dh_c)

        xs = (split(h), split(targets), split(mask))
        # The first chunk's dw starts the sum (equal to 0 + dw_0): no zero-filled fp32 [D, V]
        # buffer and no read of it by the first chunk's dw GEMM.
        nll0, dh0, dw = chunk(tuple(x[0] for x in xs))
        dw, (nll, dh) = jax.lax.scan(body, dw, tuple(x[1:] for x in xs))
        nll_sum = jnp.sum(jnp.concatenate([nll0[None], nll]))
        dh = jnp.moveaxis(jnp.concatenate([dh0[None], dh]), 0, 1).reshape(B, T, D)
    return nll_sum, dh, dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def lm_head_loss(h, w, targets, mask, weight, n_chunks=1, round_logits=False):
    """Scaled and plain token cross-entropy of the logits h @ w, without keeping the logits.

    Args:
      h: [B, T, D] final hidden states, compute dtype (bf16; fp32 gives fp32 gradients).
      w: [D, V] lm_head weight in h.dtype (the transposed embedding when tied).
      targets: [B, T] int target ids; mask: [B, T] (0/1, any dtype) tokens that count.
      weight: fp32 scalar, the objective's factor (loss_scale / n_target_tokens).
      n_chunks: static divisor of T (`num_chunks`); 1 keeps the whole [B, T, V] logits at once.
      round_logits: static; True rounds the logits to h.dtype before the fp32 loss maths
        (`model.round_logits`, HF's rounding); False keeps them fp32.

    Returns:
      (weight * nll_sum, nll_sum), fp32 scalars, with nll_sum = sum_t mask_t * (lse_t -
      logit_t[target_t]) from the fp32 (or rounded, upcast) logits. Only the first output
      carries a gradient (w.r.t. h and w); nll_sum is for reporting and its cotangent is
      ignored. weight, targets and mask get no gradient.
    """
    nll_sum, _, _ = _forward(h, w, targets, mask, weight, n_chunks, round_logits)
    return weight * nll_sum, nll_sum


def _fwd(h, w, targets, mask, weight, n_chunks, round_logits):
    nll_sum, dh, dw = _forward(h, w, targets, mask, weight, n_chunks, round_logits)
    return (weight * nll_sum, nll_sum), (dh, dw, targets, mask, weight)


def _bwd(n_chunks, round_logits, res, cts):
    dh, dw, targets, mask, weight = res
    ct = cts[0].astype(jnp.float32)
    scale = lambda x: (x.astype(jnp.float32) * ct).astype(x.dtype)  # noqa: E731
    return scale(dh), scale(dw), None, jnp.zeros_like(mask), jnp.zeros_like(weight)


lm_head_loss.defvjp(_fwd, _bwd)
