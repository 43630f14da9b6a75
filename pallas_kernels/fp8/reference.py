"""FP8 E4M3 block-scaled quantisation and the GEMMs that the FP8 kernels compute, in pure jnp.

Legend: M rows (tokens), K contraction width, N output width, E experts, Kb = ceil(K / 128),
Mb = ceil(M / 128), Nb = ceil(N / 128), P rows of the group-padded layout (a multiple of 128).

DeepSeek-V3 technical report (arXiv 2412.19437) sec. 3.3: every operand of a linear layer's
three GEMMs is E4M3 with fine-grained scales computed online from max|x|:
  1 x 128 tiles   (`quantize_rows_1x128`): one scale per row and 128 columns (activations and
                  activation gradients along the contraction axis);
  128 x 1 tiles   (`quantize_cols_128x1`): one scale per column and 128 rows (the same tensors
                  for the weight gradient, which contracts over tokens);
  128 x 128 blocks (`quantize_blocks_128x128`): weights; a block serves the forward and, read
                  transposed, the input gradient.
Partial edge tiles (sizes not multiples of 128) are tiles of their own: the missing elements
count as zeros for max|x|. A scale is s = amax / 448 (E4M3's largest finite value), so x / s
lies in [-448, 448] and the value is q * s, q = round_to_nearest_even(x / s) in E4M3.

Scales are plain fp32, not rounded to powers of two: this is DeepSeek-V3's recipe and the
format of its released checkpoint (`weight_scale_inv` per 128 x 128 block, fp32); the largest
element of every tile maps to exactly 448, so the tile uses E4M3's whole range and its small
elements lose the fewest bits to subnormals (a power-of-two scale, as torchao / Transformer
Engine offer, leaves up to one binade of the range unused). Power-of-two scales make x / s exact,
which plain scales trade for one fp32 rounding (2^-24 relative, far below E4M3's 2^-4).
A tile of zeros gets s = 1 (q = 0), never 0 / 0.

Round-trip bound (what the tests check): E4M3 keeps 3 mantissa bits, so for |x / s| >= 2^-6
(normal range) |q - x / s| <= 2^-4 |x / s| (half a unit in the last place of 1.mmm); below it
(subnormals, spacing 2^-9) |q - x / s| <= 2^-10. Hence |dequant - x| <= max(2^-4 |x|, 2^-10 s)
plus fp32 rounding.

The GEMM references emulate the kernels' arithmetic: per 128-wide block of the contraction the
partial product of the E4M3 operands is formed in fp32 (exactly what ideal rounding of those
operands gives), multiplied by the two operands' scales for that block ("promotion", DeepSeek
sec. 3.3.2, N_C = 128) and added into an fp32 accumulator.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe.mosaic_gpu import row_tile_table
from pallas_kernels.moe.reference import grouped_matmul_reference

FP8 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(x, axis: int, multiple: int = BLOCK):
    n = x.shape[axis]
    extra = -n % multiple
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad)


def _scale_of(amax):
    """fp32 scale amax / 448 of each tile; 1 for an all-zero tile."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0)


def _to_fp8(x, s):
    return jnp.clip(x.astype(jnp.float32) / s, -E4M3_MAX, E4M3_MAX).astype(FP8)


def quantize_rows_1x128(x):
    """Quantise x [M, K] in 1 x 128 tiles (per row, per 128 columns).

    Args:
      x: [M, K], any float dtype; K need not be a multiple of 128 (the last tile is partial).
    Returns:
      q [M, K] float8_e4m3fn, s [M, Kb] float32 with x[m, k] ~= q[m, k] * s[m, k // 128].
    """
    m, k = x.shape
    xb = _pad_to(x.astype(jnp.float32), 1).reshape(m, -1, BLOCK)
    s = _scale_of(jnp.max(jnp.abs(xb), axis=-1))
    q = _to_fp8(xb, s[..., None]).reshape(m, -1)[:, :k]
    return q, s


def quantize_cols_128x1(x):
    """Quantise x [M, K] in 128 x 1 tiles (per column, per 128 rows): the weight gradient's
    operands, whose contraction runs over the rows (tokens).

    Args:
      x: [M, K], any float dtype; M need not be a multiple of 128.
    Returns:
      q [M, K] float8_e4m3fn (x's layout), s [Mb, K] float32 with
      x[m, k] ~= q[m, k] * s[m // 128, k].
    """
    m, k = x.shape
    xb = _pad_to(x.astype(jnp.float32), 0).reshape(-1, BLOCK, k)
    s = _scale_of(jnp.max(jnp.abs(xb), axis=1))
    q = _to_fp8(xb, s[:, None, :]).reshape(-1, k)[:m]
    return q, s


def quantize_cols_128x1_t(x):
    """`quantize_cols_128x1` written transposed: x [M, K] -> its 128 x 1 tiles as rows of x^T,
    the token-major layout in which the weight-gradient kernel (`mosaic_wgrad.fp8_gemm_1d1d`)
    reads an operand that it contracts over the M tokens (wgmma reads 8-bit operands K-major).

    Args:
      x: [M, K], any float dtype; M need not be a multiple of 128.
    Returns:
      q [K, M] float8_e4m3fn, s [K, Mb] float32 with x[m, k] ~= q[k, m] * s[k, m // 128]:
      bitwise the transposes of `quantize_cols_128x1(x)`'s q and s (the same tiles, maxima and
      roundings), i.e. `quantize_rows_1x128(x.T)`.
    """
    return quantize_rows_1x128(x.T)


def quantize_blocks_128x128(w):
    """Quantise w [N, K] in 128 x 128 blocks (either orientation: dsjax's [in, out] kernels
    give s [ceil(in / 128), ceil(out / 128)]).

    Args:
      w: [N, K], any float dtype; partial edge blocks allowed.
    Returns:
      q [N, K] float8_e4m3fn, s [Nb, Kb] float32 with w[n, k] ~= q[n, k] * s[n // 128, k // 128].
    """
    n, k = w.shape
    wb = _pad_to(_pad_to(w.astype(jnp.float32), 0), 1)
    wb = wb.reshape(wb.shape[0] // BLOCK, BLOCK, wb.shape[1] // BLOCK, BLOCK)
    s = _scale_of(jnp.max(jnp.abs(wb), axis=(1, 3)))
    q = _to_fp8(wb, s[:, None, :, None]).reshape(wb.shape[0] * BLOCK, -1)[:n, :k]
    return q, s


def _expand(s, n: int, axis: int):
    """Repeat per-128 scales along `axis` to n elements."""
    return jnp.repeat(s, BLOCK, axis=axis, total_repeat_length=_cdiv(n, BLOCK) * BLOCK).take(
        jnp.arange(n), axis=axis)


def dequantize_rows_1x128(q, s):
    """Inverse of `quantize_rows_1x128`: q [M, K], s [M, Kb] -> [M, K] float32."""
    return q.astype(jnp.float32) * _expand(s, q.shape[1], 1)


def dequantize_cols_128x1(q, s):
    """Inverse of `quantize_cols_128x1`: q [M, K], s [Mb, K] -> [M, K] float32."""
    return q.astype(jnp.float32) * _expand(s, q.shape[0], 0)


def dequantize_blocks_128x128(q, s):
    """Inverse of `quantize_blocks_128x128`: q [N, K], s [Nb, Kb] -> [N, K] float32."""
    return q.astype(jnp.float32) * _expand(_expand(s, q.shape[0], 0), q.shape[1], 1)


# ----------------------------------------------------------------------------- GEMMs

def _promoted_dot(a_q, a_s, b_q, b_s_rows):
    """sum_kb (a_q[:, kb] @ b_q[:, kb]^T in fp32) * a_s[:, kb, None] * b_s_rows[None, :, kb].

    a_q [M, K], a_s [M, Kb], b_q [N, K], b_s_rows [N, Kb] (a scale per row of b) -> [M, N] fp32.
    """
    m, n = a_q.shape[0], b_q.shape[0]
    ab = _pad_to(a_q.astype(jnp.float32), 1).reshape(m, -1, BLOCK).swapaxes(0, 1)  # [Kb, M, 128]
    bb = _pad_to(b_q.astype(jnp.float32), 1).reshape(n, -1, BLOCK).swapaxes(0, 1)  # [Kb, N, 128]

    def step(acc, xs):
        a, b, sa, sb = xs
        part = jnp.dot(a, b.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return acc + part * sa[:, None] * sb[None, :], None

    acc, _ = jax.lax.scan(step, jnp.zeros((m, n), jnp.float32), (ab, bb, a_s.T, b_s_rows.T))
    return acc


def gemm_blockwise_reference(a_q, a_s, b_q, b_s, *, out_dtype=jnp.float32):
    """The forward / input-gradient GEMM: a [M, K] in 1 x 128 tiles times b [N, K] (K-major,
    e.g. a weight [out, in]) in 128 x 128 blocks, transposed: out = a @ b^T.

    Args:
      a_q: [M, K] e4m3; a_s: [M, Kb] fp32; b_q: [N, K] e4m3; b_s: [Nb, Kb] fp32.
    Returns:
      [M, N] in out_dtype: per 128-block of K the fp32 partial product times a_s * b_s, summed
      in fp32 (the kernel's promotion).
    """
    return _promoted_dot(a_q, a_s, b_q, _expand(b_s, b_q.shape[0], 0)).astype(out_dtype)


def gemm_1d1d_reference(a_q, a_s, b_q, b_s, *, out_dtype=jnp.float32):
    """The weight-gradient GEMM: both operands scaled per (row, 128 of K), K the token axis:
    out = a @ b^T with a [M, K], b [N, K] both in 1 x 128 tiles (DeepGEMM's "1D1D").

    Args:
      a_q: [M, K] e4m3; a_s: [M, Kb] fp32; b_q: [N, K] e4m3; b_s: [N, Kb] fp32.
    Returns:
      [M, N] in out_dtype, promoted per 128 of K.
    """
    return _promoted_dot(a_q, a_s, b_q, b_s).astype(out_dtype)


def row_groups(group_sizes, m: int):
    """Group of each of m rows grouped consecutively by group_sizes [E]: [m] int32, E for rows
    past sum(group_sizes)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def grouped_gemm_blockwise_reference(a_q, a_s, w_q, w_s, group_sizes, *, out_dtype=jnp.float32):
    """Grouped forward GEMM (MoE experts, layout of `pallas_kernels.moe.grouped_matmul`):
    out[i] = a[i] @ w[g(i)] with rows grouped consecutively by group_sizes.

    Args:
      a_q: [M, K] e4m3, a_s: [M, Kb] fp32 (1 x 128 tiles); w_q: [E, K, N] e4m3 ([in, out] per
      expert), w_s: [E, Kb, Nb] fp32 (128 x 128 blocks of each expert);
      group_sizes: [E] int, sum <= M (rows past the sum give zeros; empty groups allowed).
    Returns:
      [M, N] in out_dtype, promoted per 128 of K.
    """
    m, e, n = a_q.shape[0], w_q.shape[0], w_q.shape[2]
    g = jnp.minimum(row_groups(group_sizes, m), e - 1)
    a32 = _pad_to(a_q.astype(jnp.float32), 1)
    w32 = _pad_to(w_q.astype(jnp.float32), 1)
    out = jnp.zeros((m, n), jnp.float32)
    for kb in range(a_s.shape[1]):  # one grouped GEMM per 128-block of K, then its promotion
        blk = slice(kb * BLOCK, (kb + 1) * BLOCK)
        part = grouped_matmul_reference(a32[:, blk], w32[:, blk, :], group_sizes,
                                        preferred_element_type=jnp.float32)
        w_scale = _expand(jnp.take(w_s[:, kb, :], g, axis=0), n, 1)  # [M, N]
        out = out + part * a_s[:, kb, None] * w_scale
    return out.astype(out_dtype)


def group_tile_table(group_sizes, m: int):
    """The 128-token tiles of the group-padded layout (`pad_groups`): int32 [4, T], column t
    (group, row0, lo, hi) meaning tile t holds rows [row0 + lo, row0 + hi) of x (the rest of the
    tile zeros), all of one group. `pallas_kernels.moe.mosaic_gpu.row_tile_table` with 128-row
    tiles over x padded to Mp = max(ceil8(M), 128) rows: each group's tiles start at its first
    row rounded down to a multiple of 8 (where Hopper's TMA can read a tile of x from), groups
    in order; a column of group E (rows past sum(group_sizes)) or unused (lo == hi) holds no
    rows. T = ceil((Mp + 7 (E + 1)) / 128) + E + 1, a static bound.
    """
    mp = max(-(-m // 8) * 8, BLOCK)
    return row_tile_table(group_sizes, mp, BLOCK)


def group_tiles(group_sizes):
    """(first tile [E], tiles [E]) of each group in the group-padded layout (`group_tile_table`:
    a group of rows [start, end) has ceil((end - floor8(start)) / 128) tiles, 0 when empty),
    int32."""
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    base = (ends - gs) // 8 * 8
    count = jnp.where(gs > 0, (ends - base + BLOCK - 1) // BLOCK, 0)
    return jnp.cumsum(count) - count, count


def pad_groups(x, group_sizes):
    """Copy rows x [M, C] grouped by group_sizes [E] into a layout whose 128-row tiles each
    belong to one group (`group_tile_table`; zero rows fill the rest), as the grouped
    weight-gradient kernel reads them (DeepGEMM pads each expert's rows to 128 likewise; here a
    group's first tile starts at its first row rounded down to a multiple of 8, the rows before
    it zeros, so the fused kernel `quantize.quantize_grouped_cols` reads the tiles straight
    from x).

    Each padded row gathers its source row (a row outside its tile's group gathers zeros), so
    x_p is written once: no zero-filled buffer that the rows are then scattered into.

    Returns:
      (x_p [P, C] in x.dtype with P = 128 T, tile_group [T] int32 (the group of each tile;
      E - 1 for the tiles that hold no rows), dest [M] int32: the padded row of each row, P for
      rows past sum(group_sizes)).
    """
    m = x.shape[0]
    e = group_sizes.shape[0]
    g, row0, lo, hi = group_tile_table(group_sizes, m)
    r = jnp.arange(BLOCK, dtype=jnp.int32)
    held = (g[:, None] < e) & (r >= lo[:, None]) & (r < hi[:, None])
    src = jnp.where(held, row0[:, None] + r, m).reshape(-1)  # m: out of range, gathers zeros
    x_p = jnp.take(x, src, axis=0, mode="fill", fill_value=0)
    p = src.shape[0]
    dest = jnp.full((m + 1,), p, jnp.int32).at[src].set(jnp.arange(p, dtype=jnp.int32))[:m]
    return x_p, jnp.minimum(g, e - 1).astype(jnp.int32), dest


def grouped_wgrad_reference(x_q, x_s, dy_q, dy_s, tile_group, num_groups: int, *, out_dtype=jnp.float32):
    """Grouped weight gradient dw[e] = x[rows of e]^T @ dy[rows of e], on operands in the
    group-padded layout (`pad_groups`) quantised in 128 x 1 tiles (`quantize_cols_128x1`):
    every 128-row tile is one block of the contraction, promoted with its two scale vectors.

    Args:
      x_q: [P, K] e4m3, x_s: [P / 128, K] fp32; dy_q: [P, N] e4m3, dy_s: [P / 128, N] fp32;
      tile_group: [P / 128] int32; num_groups: E.
    Returns:
      [E, K, N] in out_dtype (zeros for groups without rows).
    """
    p, k = x_q.shape
    n = dy_q.shape[1]
    xt = x_q.astype(jnp.float32).reshape(p // BLOCK, BLOCK, k)
    dyt = dy_q.astype(jnp.float32).reshape(p // BLOCK, BLOCK, n)

    def step(acc, xs):
        a, b, sa, sb, gi = xs
        part = jnp.dot(a.T, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return acc.at[gi].add(part * sa[:, None] * sb[None, :]), None

    acc, _ = jax.lax.scan(step, jnp.zeros((num_groups, k, n), jnp.float32), (xt, dyt, x_s, dy_s, tile_group))
    return acc.astype(out_dtype)
