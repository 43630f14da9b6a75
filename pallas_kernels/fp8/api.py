"""FP8 block-scaled linear layers for training (DeepSeek-V3 technical report sec. 3.3).

Legend: M rows (tokens, leading dims flattened), K input width, N output width, E experts.

`fp8_linear(x, w)` and `fp8_grouped_gemm(x, w, group_sizes)` compute x @ w with a custom VJP whose
three GEMMs all take E4M3 operands with online fine-grained scales (reference.py):
  forward  y  = x @ w      x in 1 x 128 tiles (per token, 128 of K), w in 128 x 128 blocks;
  dgrad    dx = dy @ w^T   dy in 1 x 128 tiles (per token, 128 of N), the same w blocks read
                           transposed (a 128 x 128 block is its own transpose's block);
  wgrad    dw = x^T @ dy   x and dy in 128 x 1 tiles (per channel, 128 tokens), quantised from
                           the unquantised x / dy, as the contraction now runs over tokens;
                           written transposed (x^T [K, M], dy^T [N, M]: token-major, the
                           layout the wgrad kernel reads).
Accumulation is fp32. The backward's residuals are the FP8 values and fp32 scales (x^T in 128 x 1
tiles, w in blocks), not x itself: 1 byte per element plus 4 per 128. Outputs are in x's dtype
(the compute dtype), dx in x's dtype, dw in w's dtype (the master weights' dtype, as the cast
in the unquantised path gives). For the routed experts the 128-token tiles of the weight
gradient never straddle two experts: each expert's rows are padded to whole 128-row tiles
(`reference.pad_groups`; DeepGEMM's grouped kernels pad likewise), which the "mosaic" backend's
quantisation kernel reads straight from the routed rows (`quantize.quantize_grouped_cols`).

Backends (`impl`):
  "reference": XLA on any device: dequantise to fp32 and dot with fp32 accumulation at full
               precision (equal to the kernels' per-128-K promotion up to fp32 rounding; the
               weight gradient of the grouped GEMM is the promotion itself, one tile at a time).
  "mosaic":    the Mosaic GPU kernels (Hopper, wgmma; GPU interpret mode elsewhere, for tests).
               `fp8_linear`: forward and dgrad `mosaic_gemm.fp8_gemm_blockwise(a_q [M, K],
               a_s [M, K/128], b_q [N, K], b_s [N/128, K/128])` (the forward with w's blocks
               transposed, [N, K]; the dgrad with them as quantised, [K, N]: w is quantised
               once), the wgrad `mosaic_wgrad.fp8_gemm_1d1d(x^T [K, M], s [K, M/128],
               dy^T [N, M], s [N, M/128])` with fp32 output.
               `fp8_grouped_gemm`: forward and dgrad `mosaic_gemm.fp8_gmm_blockwise(a_q [M, C],
               a_s [M, C/128], b_q [E, R, C], b_s [E, R/128, C/128], group_sizes)` with b = w_e^T
               (the transposed fp8 copy of the quantised experts [E, N, K]) and b = w_e ([E, K, N]
               as quantised: K the output), wgrad `mosaic_grouped_wgrad.fp8_grouped_wgrad(x^T
               [K, P], x scales [P/128, K], dy^T [N, P], dy scales [P/128, N], group_sizes)` on
               the group-padded 128 x 1 operands (fp32 [E, K, N], cast to w's dtype; with a
               `dw_sink`, cast in the kernel's epilogue and written into the sink in place).
               Operands are zero-padded to multiples of 128 (padded scales are 1), outputs
               sliced back. x (forward) and dy (backward) are quantised for both of their
               GEMMs by one kernel that reads them once (`quantize.quantize_dual`: 1 x 128
               tiles and 128 x 1 tiles of the transpose, already padded); the grouped wgrad
               operands by its 128 x 1 half, on the group-padded copy. The weights (dense and
               experts) by its block mode (`quantize.quantize_blocks_dual`): one read of w,
               its blocks written as stored (the dgrad's, kept for the backward) and
               transposed (the forward's), padded; `requantize_weight=True` writes only
               the forward's (`quantize.quantize_blocks`) and quantises w again
               in the backward for the dgrad. The grouped forward / dgrad activation
               operands are quantised in XLA (reference.py).
  "auto":      "mosaic" on a Hopper GPU, else "reference".

Stored weights. Where the weight's E4M3 copy is written once per optimizer step (the train
state's compute copy, `dsjax.train.step.compute_copy`), w is given as that copy
(`fp8_copy(w)`, a `stored.Fp8Copy` of both block layouts and their scales, plus a gradient
carrier): the forward and dgrad read its blocks and nothing is quantised; the wgrad is as above,
its dw given to the carrier.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._hopper import on_hopper
from pallas_kernels.fp8 import mosaic_gemm, mosaic_grouped_wgrad, mosaic_wgrad, quantize
from pallas_kernels.fp8 import reference as ref
from pallas_kernels.fp8.stored import Fp8Copy
from pallas_kernels.moe.api import check_dw_sink, store_dw
from pallas_kernels.moe.reference import grouped_matmul_reference
from pallas_kernels.moe.routing import swiglu_grads, swiglu_value

IMPLS = ("auto", "reference", "mosaic")


def resolve_impl(impl: str) -> str:
    """"reference" or "mosaic" for impl in IMPLS ("auto": "mosaic" on a Hopper GPU).

    Raises:
      ValueError: unknown impl.
    """
    if impl not in IMPLS:
        raise ValueError(f"fp8: impl={impl!r}: expected one of {', '.join(IMPLS)}")
    if impl == "auto":
        return "mosaic" if on_hopper() else "reference"
    return impl


def _dot32(a, b):
    return jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _pad2(t):
    """t zero-padded to multiples of 128 in both dims."""
    return ref._pad_to(ref._pad_to(t, 0), 1)


def _one_pad(s, rows: int, cols: int):
    """Scales s padded with 1 to [rows, cols]: their values are zeros, and a zero scale is never
    formed."""
    return jnp.pad(s, ((0, rows - s.shape[0]), (0, cols - s.shape[1])), constant_values=1.0)


def gemm_nt(backend, a_q, a_s, b_q, b_s, out_dtype):
    """a [M, K] (1 x 128 tiles) @ b [N, K] (128 x 128 blocks)^T -> [M, N] in out_dtype: the dense
    FP8 GEMM of the forward and dgrad, on the Mosaic kernel ("mosaic") or dequantised in XLA
    with fp32 accumulation ("reference")."""
    if backend == "mosaic":
        m, n = a_q.shape[0], b_q.shape[0]
        ap, bp = _pad2(a_q), _pad2(b_q)
        kb = ap.shape[1] // ref.BLOCK
        out = mosaic_gemm.fp8_gemm_blockwise(ap, _one_pad(a_s, ap.shape[0], kb), bp,
                                             _one_pad(b_s, bp.shape[0] // ref.BLOCK, kb),
                                             out_dtype=out_dtype)
        return out[:m, :n]
    a = ref.dequantize_rows_1x128(a_q, a_s)
    b = ref.dequantize_blocks_128x128(b_q, b_s)
    return _dot32(a, b.T).astype(out_dtype)


def _wgrad(backend, xt_q, xt_s, dyt_q, dyt_s, out_dtype):
    """x^T [K, M] and dy^T [N, M] in 128 x 1 tiles of x and dy (`ref.quantize_cols_128x1_t`:
    scales [K, Mb], [N, Mb]) -> x^T dy [K, N] in out_dtype (fp32 accumulation)."""
    if backend == "mosaic":
        k, n = xt_q.shape[0], dyt_q.shape[0]
        ap, bp = ref._pad_to(xt_q, 1), _pad2(dyt_q)  # K rows: padded inside the kernel
        # the fp32 sums cast to out_dtype in the kernel's epilogue (no fp32 [K, N] written)
        out = mosaic_wgrad.fp8_gemm_1d1d(ap, xt_s, bp, _one_pad(dyt_s, bp.shape[0], dyt_s.shape[1]),
                                         out_dtype=out_dtype)
        return out[:k, :n]
    xt = ref.dequantize_rows_1x128(xt_q, xt_s)
    dyt = ref.dequantize_rows_1x128(dyt_q, dyt_s)
    return _dot32(xt, dyt.T).astype(out_dtype)


def _in_order(backend, *xs):
    """xs, tied to each other by an optimization barrier where the kernels run in GPU interpret
    mode (impl="mosaic" off a Hopper GPU): its simulator keeps global state and hangs when two
    kernels run at once, so a kernel that reads these values waits for the one that produced
    them (the forward before the dgrad, the dgrad before the wgrad). Unchanged on a GPU."""
    if backend == "mosaic" and not on_hopper():
        return jax.lax.optimization_barrier(xs)
    return xs


def _kept(out, residuals):
    """out and the residuals a forward keeps, through one optimization barrier, so the residuals
    are computed before anything reads out. Without it XLA may compute a residual's E4M3
    quantisation in the backward, from the bf16 tensor (the quantisation fused into its
    backward consumer, or the quantisation kernel scheduled there), which keeps that bf16 tensor
    alive from the forward to the backward instead of its half-size E4M3 copy."""
    return jax.lax.optimization_barrier((out, residuals))


# ----------------------------------------------------------------------------- dense

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_matmul(x, w, backend, requant):
    return _fp8_matmul_fwd(x, w, backend, requant)[0]


def _quantize_both(backend, x):
    """x [M, C] in 1 x 128 tiles (x_q, x_s [M, Cb]) and in 128 x 1 tiles transposed (xt_q [C, M],
    xt_s [C, Mb]): "mosaic" reads x once in the fused kernel (`quantize.quantize_dual`, outputs
    zero-padded to multiples of 128 with scales 1, as the GEMM kernels take them); "reference"
    the two jnp functions. Bitwise the same values."""
    if backend == "mosaic":
        return quantize.quantize_dual(x)
    return ref.quantize_rows_1x128(x) + ref.quantize_cols_128x1_t(x)


def _quantize_weight(backend, w):
    """w [K, N] or experts [E, K, N] in 128 x 128 blocks, as stored and transposed: (w_q
    [.., K, N], w_s [.., Kb, Nb], wt_q [.., N, K], wt_s [.., Nb, Kb]). "mosaic" reads w once
    (`quantize.quantize_blocks_dual`: w in bf16 / fp16 / fp32, fp8 outputs zero-padded to
    multiples of 128, as the GEMM kernels take them); "reference" `ref.quantize_blocks_128x128`
    (per expert) and transposes. Bitwise the same values."""
    if backend == "mosaic":
        return quantize.quantize_blocks_dual(w)
    w_q, w_s = ref.quantize_blocks_128x128(w) if w.ndim == 2 else _quantize_experts(w)
    return w_q, w_s, jnp.swapaxes(w_q, -1, -2), jnp.swapaxes(w_s, -1, -2)


def _quantize_weight_one(backend, w, transposed: bool):
    """One layout of `_quantize_weight`: (w_q, w_s) as stored (transposed=False) or (wt_q, wt_s)
    (True), "mosaic" by `quantize.quantize_blocks` (half the writes). Bitwise the same values."""
    if backend == "mosaic":
        return quantize.quantize_blocks(w, transposed=transposed)
    q, s = ref.quantize_blocks_128x128(w) if w.ndim == 2 else _quantize_experts(w)
    return (jnp.swapaxes(q, -1, -2), jnp.swapaxes(s, -1, -2)) if transposed else (q, s)


def fp8_copy(w, *, impl: str = "auto") -> Fp8Copy:
    """w [..., K, N] (a weight [K, N], experts [E, K, N], or either stacked over layers; float32 /
    bfloat16 / float16) as its stored E4M3 copy (`stored.Fp8Copy`, no gradient carrier): per
    matrix, `_quantize_weight`'s blocks from one read of w ("mosaic": one launch over every
    matrix, padded to multiples of 128 as the kernels take them; "reference": unpadded).

    Raises:
      ValueError: w of fewer than 2 dims, or impl unknown."""
    if w.ndim < 2:
        raise ValueError(f"fp8_copy: want w [..., K, N], got {list(w.shape)}")
    lead = w.shape[:-2]
    mats = w if w.ndim <= 3 else w.reshape((-1,) + w.shape[-2:])
    w_q, w_s, wt_q, _ = _quantize_weight(resolve_impl(impl), mats)
    return Fp8Copy(*(a.reshape(lead + a.shape[-2:]) for a in (w_q, w_s, wt_q)))


def _meta(w):
    """What the backward keeps of w for its gradient's shape (after the first dim) and dtype: a
    0-row slice of w, or for a stored copy an `Fp8Copy` of its carrier's 0-row slice alone."""
    if isinstance(w, Fp8Copy):
        return Fp8Copy(None, None, None, w.grad[:0])
    return w[:0]


def _weight_grad(w_meta, dw):
    """dw as the cotangent of the weight that `_meta` describes: dw itself, or for a stored copy
    an `Fp8Copy` whose carrier gets dw and whose blocks and scales get zeros (None)."""
    return Fp8Copy(None, None, None, dw) if isinstance(w_meta, Fp8Copy) else dw


def _requant(w, requantize_weight) -> bool:
    """`requantize_weight` for an array w; False for a stored copy (nothing to quantise)."""
    return bool(requantize_weight) and not isinstance(w, Fp8Copy)


def _forward_weight(backend, w, requant):
    """(wt_q, wt_s, held_q, held_s): the forward's transposed blocks of w and what the backward
    keeps for its dgrad: the stored blocks (one read of w for both), or with requant w itself
    (and None), quantised again there by `_dgrad_weight`. A stored copy (`Fp8Copy`) gives its
    own blocks and nothing is quantised (requant must then be False); "reference" reads them
    without the "mosaic" layout's padding."""
    if isinstance(w, Fp8Copy):
        k, n = w.shape[-2:]
        q, qt = (w.q, w.qt) if backend == "mosaic" else (w.q[..., :k, :n], w.qt[..., :n, :k])
        return qt, jnp.swapaxes(w.s, -1, -2), q, w.s
    if requant:
        return _quantize_weight_one(backend, w, transposed=True) + (w, None)
    w_q, w_s, wt_q, wt_s = _quantize_weight(backend, w)
    return wt_q, wt_s, w_q, w_s


def _dgrad_weight(backend, requant, held_q, held_s):
    """The dgrad's stored blocks (w_q, w_s) from what `_forward_weight` kept."""
    return _quantize_weight_one(backend, held_q, transposed=False) if requant else (held_q, held_s)


def _fp8_matmul_fwd(x, w, backend, requant):
    x_q, x_s, xt_q, xt_s = _quantize_both(backend, x)  # xt: x^T [K, M], scales [K, Mb]
    wt_q, wt_s, w_q, w_s = _forward_weight(backend, w, requant)  # w^T [N, K], [Nb, Kb]; kept
    y = gemm_nt(backend, x_q, x_s, wt_q, wt_s, x.dtype)[:x.shape[0], :w.shape[1]]
    y, w_q, xt_q = _in_order(backend, y, w_q, xt_q)
    return y, (xt_q, xt_s, w_q, w_s, x[:0], _meta(w))


def _fp8_matmul_bwd(backend, requant, res, dy):
    xt_q, xt_s, w_q, w_s, x_meta, w_meta = res
    w_q, w_s = _dgrad_weight(backend, requant, w_q, w_s)  # [.., K, N], [.., Kb, Nb]
    dy_q, dy_s, dyt_q, dyt_s = _quantize_both(backend, dy)  # dyt: dy^T [N, M], scales [N, Mb]
    k, n = x_meta.shape[1], w_meta.shape[1]
    # dy [M, N] @ (w [K, N])^T; with padded (mosaic) dy and w, w's padded rows give dx's padded
    # columns
    dx = gemm_nt(backend, dy_q, dy_s, w_q, w_s, x_meta.dtype)[:dy.shape[0], :k]
    dx, dyt_q = _in_order(backend, dx, dyt_q)
    dw = _wgrad(backend, xt_q, xt_s, dyt_q, dyt_s, w_meta.dtype)[:k, :n]
    return dx, _weight_grad(w_meta, dw)


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def fp8_linear(x, w, *, impl: str = "auto", requantize_weight: bool = False):
    """y = x @ w with all three GEMMs (forward, dgrad, wgrad) in FP8 E4M3, block-scaled.

    Args:
      x: [..., K] in the compute dtype (float32 / bfloat16 / float16).
      w: [K, N] (dsjax's `Linear` kernel layout, [in, out]) in any float dtype ("mosaic":
        float32 / bfloat16 / float16) (the master weight; it is quantised from its own values,
        not from a cast copy); or its stored E4M3 copy (`fp8_copy`'s `Fp8Copy` with a gradient
        carrier [K, N]): its blocks are read as stored (bitwise the blocks the array would be
        quantised to), nothing is quantised, and the carrier gets w's gradient.
      impl: "auto" | "reference" | "mosaic" (module docstring).
      requantize_weight: False: the dgrad's E4M3 copy of w and its scales are kept from the
        forward for the backward; True: w itself is kept and quantised again in the backward
        (as `fp8_grouped_gemm`'s: for a w that stays alive anyway, a parameter or its slice).
        Ignored for a stored copy (the backward reads its blocks).
    Returns:
      [..., N] in x.dtype. Differentiable in x (gradient in x.dtype) and w (gradient in
      w.dtype; a stored copy's carrier in the carrier's dtype, its blocks get zeros); the three
      GEMMs quantise as DeepSeek-V3 sec. 3.3 (module docstring).
    Raises:
      ValueError: x's last dim is not w's first, w is not 2-D, or impl is unknown.
    """
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_linear: x {list(x.shape)} and w {list(w.shape)} do not contract "
                         f"(want x [..., K], w [K, N])")
    backend = resolve_impl(impl)
    lead = x.shape[:-1]
    y = _fp8_matmul(x.reshape(-1, x.shape[-1]), w, backend, _requant(w, requantize_weight))
    return y.reshape(*lead, w.shape[1])


# ----------------------------------------------------------------------------- grouped (MoE)

def _quantize_experts(w):
    """w [E, K, N] -> (q [E, K, N] e4m3, s [E, Kb, Nb] fp32): 128 x 128 blocks per expert."""
    return jax.vmap(ref.quantize_blocks_128x128)(w)


def _dequantize_experts(q, s):
    return jax.vmap(ref.dequantize_blocks_128x128)(q, s)


def _grouped_wgrad_operand(backend, x, group_sizes):
    """x [M, C] -> its group-padded copy (`reference.pad_groups`) quantised in 128 x 1 tiles:
    "reference": (q [P, C], s [P/128, C]); "mosaic": (q^T [Cp, P], s [P/128, Cp]), C
    zero-padded to Cp, a multiple of 128 (the wgrad kernel reads the tokens contiguous), by
    `quantize.quantize_grouped_cols` from x itself, no padded copy (bitwise the same values)."""
    if backend == "mosaic":
        return quantize.quantize_grouped_cols(x, group_sizes)
    return ref.quantize_cols_128x1(ref.pad_groups(x, group_sizes)[0])


def _grouped_gemm_nt(backend, a_q, a_s, b_q, b_s, group_sizes, out_dtype):
    """Per group a[rows g] [M, C] (1 x 128 tiles) @ b[g] [R, C]^T (128 x 128 blocks, b_q
    [E, R, C], b_s [E, Rb, Cb]) -> [M, R] in out_dtype; rows past sum(group_sizes) are 0."""
    r = b_q.shape[1]
    if backend == "mosaic":
        out = mosaic_gemm.fp8_gmm_blockwise(ref._pad_to(a_q, 1), a_s, ref._pad_to(ref._pad_to(b_q, 1), 2), b_s, group_sizes,
                  out_dtype=out_dtype)
        return out[:, :r]
    w_q, w_s = jnp.swapaxes(b_q, 1, 2), jnp.swapaxes(b_s, 1, 2)  # [E, C, R] per expert
    with jax.default_matmul_precision("highest"):
        out = grouped_matmul_reference(ref.dequantize_rows_1x128(a_q, a_s), _dequantize_experts(w_q, w_s),
                                       group_sizes, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _grouped_wgrad(backend, xt_q, xt_s, dyt_q, dyt_s, group_sizes, m, shape, out_dtype):
    """dw [E, K, N] = shape in out_dtype from `_grouped_wgrad_operand`'s x and dy of m rows."""
    e, k, n = shape
    if backend == "mosaic":
        dw = mosaic_grouped_wgrad.fp8_grouped_wgrad(xt_q, xt_s, dyt_q, dyt_s, group_sizes)
        return dw[:, :k, :n].astype(out_dtype)
    tile_group = jnp.minimum(ref.group_tile_table(group_sizes, m)[0], e - 1)
    return ref.grouped_wgrad_reference(xt_q, xt_s, dyt_q, dyt_s, tile_group, e, out_dtype=out_dtype)


def _grouped_wgrad_into(backend, xt_q, xt_s, dyt_q, dyt_s, group_sizes, m, sink):
    """`_grouped_wgrad`'s dw written into sink = (ref [G, K, N], row[, sq]) at rows row ..
    row + E (`pallas_kernels.moe.api.check_dw_sink`): "mosaic" with K and N multiples of 128
    and squares whose column chunk the epilogue can sum: by the kernel in place, each fp32 sum
    cast once to ref's dtype; otherwise dw in ref's dtype by `_grouped_wgrad`, then
    `store_dw` (a dynamic update of the ref). The same values either way."""
    dw_ref, row, *sq = sink
    e = group_sizes.shape[0]
    k, n = dw_ref.shape[1:]
    if backend == "mosaic" and (xt_q.shape[0], dyt_q.shape[0]) == (k, n):
        width = n // sq[0].shape[1] if sq else ref.BLOCK
        config = mosaic_grouped_wgrad.WgradConfig(tile_n=max(ref.BLOCK, width))
        if width in mosaic_grouped_wgrad.SQ_WIDTHS and n % config.tile_n == 0:
            mosaic_grouped_wgrad.fp8_grouped_wgrad(xt_q, xt_s, dyt_q, dyt_s, group_sizes, config=config,
                                                   out=dw_ref, out_row=row, sq_out=sq[0] if sq else None)
            return
    store_dw(sink, _grouped_wgrad(backend, xt_q, xt_s, dyt_q, dyt_s, group_sizes, m, (e, k, n),
                                  dw_ref.dtype))


def _sunk_marker(backend, sink, dx):
    """dx, ordered after the write into sink where the kernels run in interpret mode
    (`_in_order`): tied to one element read back from the ref, which the write produced."""
    if backend != "mosaic" or on_hopper():
        return dx
    dw_ref, row = sink[:2]
    return _in_order(backend, dx, dw_ref[row, 0, 0])[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_gmm(x, w, group_sizes, backend, requant):
    return _fp8_gmm_fwd(x, w, group_sizes, backend, requant)[0]


def _fp8_gmm_fwd(x, w, group_sizes, backend, requant):
    x_q, x_s = ref.quantize_rows_1x128(x)
    wt_q, wt_s, w_q, w_s = _forward_weight(backend, w, requant)  # [E, N, K], [E, Nb, Kb]; kept
    # forward: b = w_e^T [N, K] per expert (K-major, the transposed fp8 copy; a block's scale
    # is its transpose's)
    y = _grouped_gemm_nt(backend, x_q, x_s, wt_q, wt_s, group_sizes, x.dtype)[:, :w.shape[2]]
    y, x = _in_order(backend, y, x)  # the quantisation kernel after the forward's
    y, (xt_q, xt_s) = _kept(y, _grouped_wgrad_operand(backend, x, group_sizes))
    return y, (xt_q, xt_s, w_q, w_s, group_sizes, x[:0], _meta(w))


def _fp8_gmm_bwd(backend, requant, res, dy, sink=None):
    xt_q, xt_s, w_q, w_s, group_sizes, x_meta, w_meta = res
    w_q, w_s = _dgrad_weight(backend, requant, w_q, w_s)  # [.., K, N], [.., Kb, Nb]
    dy_q, dy_s = ref.quantize_rows_1x128(dy)
    # dgrad: dx = dy @ w_e^T, i.e. b = w_e [K, N] as stored (K the output, N the contraction)
    dx = _grouped_gemm_nt(backend, dy_q, dy_s, w_q, w_s, group_sizes, x_meta.dtype)
    dx = dx[:, :x_meta.shape[1]]  # mosaic: w_q padded, K to Kp
    dx, dy = _in_order(backend, dx, dy)  # the quantisation kernel after the dgrad's
    dyt_q, dyt_s = _grouped_wgrad_operand(backend, dy, group_sizes)
    if sink is not None:  # w's gradient goes to the sink; w gets none
        _grouped_wgrad_into(backend, xt_q, xt_s, dyt_q, dyt_s, group_sizes, dy.shape[0], sink)
        return _sunk_marker(backend, sink, dx), None, None
    dw = _grouped_wgrad(backend, xt_q, xt_s, dyt_q, dyt_s, group_sizes, dy.shape[0],
                        w_q.shape[:1] + w_meta.shape[1:], w_meta.dtype)
    return dx, _weight_grad(w_meta, dw), None


_fp8_gmm.defvjp(_fp8_gmm_fwd, _fp8_gmm_bwd)


def _fp8_gmm_sinking(sink):
    """`_fp8_gmm` whose weight gradient is written into sink = (ref, row[, sq])
    (`_grouped_wgrad_into`)."""
    f = jax.custom_vjp(lambda x, w, group_sizes, backend, requant:
                       _fp8_gmm_fwd(x, w, group_sizes, backend, requant)[0], nondiff_argnums=(3, 4))
    f.defvjp(_fp8_gmm_fwd, lambda backend, requant, res, dy: _fp8_gmm_bwd(backend, requant, res, dy, sink))
    return f


def fp8_grouped_gemm(x, w, group_sizes, *, impl: str = "auto", dw_sink=None,
                     requantize_weight: bool = False):
    """Grouped GEMM of the routed experts in FP8: out[i] = x[i] @ w[g(i)], rows grouped
    consecutively by group_sizes (the layout of `pallas_kernels.moe.grouped_matmul`).

    Args:
      x: [M, K] in the compute dtype, rows sorted by expert; w: [E, K, N] ([in, out] per
        expert), any float dtype ("mosaic": float32 / bfloat16 / float16), or its stored E4M3
        copy (`fp8_copy`'s `Fp8Copy` with a carrier [E, K, N], as in `fp8_linear`: nothing
        quantised, the carrier gets w's gradient, requantize_weight ignored); group_sizes: [E]
        int, sum <= M (rows past the sum give zeros and get zero gradients; empty experts
        allowed).
      impl: "auto" | "reference" | "mosaic" (module docstring; `resolve_impl`).
      dw_sink: None, or (ref, row) or (ref, row, sq), as `pallas_kernels.moe.grouped_matmul`'s:
        w's gradient (the same values, in w's dtype) is written into the mutable ref
        [G, K, N] at rows row .. row + E and w gets a zero gradient; sq (fp32,
        `pallas_kernels.moe.dw_sq_shape(ref.shape, w.dtype)`) gets its partial sums of
        squares at the same rows. "mosaic" with K and N multiples of 128: the wgrad kernel
        writes both in place from its fp32 sums (`_grouped_wgrad_into`).
      requantize_weight: False: the forward quantises w into both layouts (one read of w) and
        keeps the dgrad's E4M3 copy and scales for the backward (1 byte per weight element
        held from the forward to the backward). True: the forward writes only its own layout,
        the backward keeps w itself and quantises it again for the dgrad (bitwise the same
        values): no memory held, one more read of w. Pick True where w is a parameter (or a
        slice of one) that stays alive through the backward anyway, False where it is a
        temporary (a ZeRO-3 gather, a scanned layer's slice): keeping it would hold it whole.
    Returns:
      [M, N] in x.dtype. Differentiable in x and w (gradients in their dtypes); group_sizes
      gets none. Forward: x 1 x 128, w 128 x 128 per expert; dgrad: dy 1 x 128, w^T blocks;
      wgrad: x and dy 128 x 1 over each expert's tokens (tiles never span two experts).
    Raises:
      ValueError: shapes that do not fit, an unknown impl, or a dw_sink that does not take w's
        gradient (`check_dw_sink`).
    """
    if w.ndim != 3 or x.ndim != 2 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"fp8_grouped_gemm: x {list(x.shape)}, w {list(w.shape)}, group_sizes "
                         f"{list(group_sizes.shape)} do not fit (want x [M, K], w [E, K, N], [E])")
    gmm = _fp8_gmm if dw_sink is None else _fp8_gmm_sinking(check_dw_sink(dw_sink, w))
    return gmm(x, w, group_sizes.astype(jnp.int32), resolve_impl(impl), _requant(w, requantize_weight))


# ----------------------------------------------------------------------------- SwiGLU

def _rows(t):
    return t.reshape(-1, t.shape[-1])


@jax.custom_vjp
def _swiglu_fp8(g, u, w):
    return swiglu_value(g, u, w)


def _swiglu_fp8_fwd(g, u, w):
    h, kept = _kept(swiglu_value(g, u, w), (ref.quantize_rows_1x128(_rows(g)),
                                            ref.quantize_rows_1x128(_rows(u))))
    return h, (*kept, w, g[..., :0])


def _swiglu_fp8_bwd(res, dh):
    (g_q, g_s), (u_q, u_s), w, g_meta = res
    shape = g_meta.shape[:-1] + (g_q.shape[-1],)
    g32 = ref.dequantize_rows_1x128(g_q, g_s).reshape(shape)
    u32 = ref.dequantize_rows_1x128(u_q, u_s).reshape(shape)
    d = dh.astype(jnp.float32)
    if w is None:
        dg, du, _ = swiglu_grads(g32, u32, d)
        return dg.astype(g_meta.dtype), du.astype(g_meta.dtype), None
    dg, du, a = swiglu_grads(g32, u32, d * w.astype(jnp.float32)[..., None])
    return dg.astype(g_meta.dtype), du.astype(g_meta.dtype), jnp.sum(d * a, axis=-1).astype(w.dtype)


_swiglu_fp8.defvjp(_swiglu_fp8_fwd, _swiglu_fp8_bwd)


def fp8_swiglu(g, u, w=None):
    """SwiGLU h = silu(g) * u (* w[..., None]) with its input kept for the backward in E4M3
    (DeepSeek-V3 sec. 3.3.4, "Low-Precision Storage": the SwiGLU input of the MoE cached in
    FP8 with the fine-grained quantisation).

    The forward is `pallas_kernels.moe.swiglu`'s, from g and u as given (fp32 math). The
    backward's derivatives (d/dg = dh w u s (1 + g (1 - s)), d/du = dh w silu(g), d/dw =
    sum dh silu(g) u, s = sigmoid(g)) take g and u as their 1 x 128 tiles quantised to E4M3
    (`reference.quantize_rows_1x128`, scales per token and 128 channels), which the forward
    keeps instead of g and u: 1 byte per element plus 4 per 128 (half of bf16's). Those
    gradients then feed the gate and up projections' FP8 dgrad and wgrad GEMMs, which
    quantise them again in the same tiles.

    Args:
      g, u: [..., F] gate and up projections in the compute dtype.
      w: None, or [...] each row's weight (the routed experts' `sorted_weights`), any float
        dtype.
    Returns:
      h [..., F] in g.dtype. Differentiable in g, u (gradients in g's dtype) and w.
    Raises:
      ValueError: g and u of different shapes, or w not g's leading shape.
    """
    if g.ndim < 1 or g.shape != u.shape or (w is not None and w.shape != g.shape[:-1]):
        raise ValueError(f"fp8_swiglu: g {list(g.shape)}, u {list(u.shape)}, w "
                         f"{None if w is None else list(w.shape)} do not fit (want g, u [..., F], "
                         f"w None or [...])")
    return _swiglu_fp8(g, u, w)
