"""FP8 weight-gradient GEMM on Hopper ("1D1D", DeepGEMM's term), in Pallas Mosaic GPU.

Legend: M rows of the output, N its columns, K the contraction width (the token axis of a
weight gradient), KB = K / 128 scale blocks of K, tm/tn CTA tile rows/columns, wg warpgroup.

out[m, n] = sum_kb (a_q[m, kb] . b_q[n, kb]) * a_s[m, kb] * b_s[n, kb]: both operands are
scaled per (row, 128 of K). For a linear layer y = x @ w (x [T, Kin], w [Kin, Nout]) the weight
gradient dw = x^T @ dy contracts over the T tokens, and DeepSeek-V3 quantises x and dy for it
in 128 x 1 tiles (per channel, 128 tokens; arXiv 2412.19437 sec. 3.3): a = x^T [Kin, T] and
b = dy^T [Nout, T], both quantised per (row, 128 tokens), i.e. token-major copies (wgmma reads
8-bit operands K-major only; `reference.quantize_cols_128x1_t` writes them).

The kernel is `mosaic_gemm.fp8_gemm_blockwise`'s, run by `mosaic_gemm._call` in its
b_scales="rows" mode (persistent grid, one TMA warpgroup streaming [tm, 128] tiles of a_q and
[tn, 128] tiles of b_q through a ring of shared-memory stages, two compute warpgroups of 64
rows x tn columns, a fresh fp32 wgmma accumulator per 128-wide K block folded into an fp32 sum
in registers) with one change in the fold: the partial product is multiplied by the outer
product of a column vector (a_s of the warpgroup's 64 rows) and a row vector (b_s of the
tile's tn columns) instead of a column vector and one scalar per 128 columns. Both scale
vectors are read from global memory, stored transposed ([KB, M] and [KB, N], so one step's
scales are contiguous), which is the layout `quantize_cols_128x1` gives.

Fold schedules (`Fp8Config`): overlap=False (the default here) folds each 128-column block
after its wgmma (registers: sum 64 x n_sub, accumulator 64 and the column scales 32 per
thread) and relies on the two compute warpgroups' alternation to keep the tensor cores busy;
overlap=True (tile_n 128) folds step k - 1's partial product, reloading its scales, while
step k's wgmma runs (sum, previous partial and accumulator: 3 x 64 registers, plus 32 for the
column scales).
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._hopper import default_interpret, lower_once
from pallas_kernels.fp8 import mosaic_gemm
from pallas_kernels.fp8.mosaic_common import BLOCK
from pallas_kernels.fp8.mosaic_gemm import Fp8Config, check_dtypes, check_schedule

WGRAD_CONFIG = Fp8Config(overlap=False)


def check_operands_1d1d(a_q, a_s, b_q, b_s, config=WGRAD_CONFIG):
    """Raise ValueError unless the operands fit `fp8_gemm_1d1d` (docstring there)."""
    if any(t.ndim != 2 for t in (a_q, a_s, b_q, b_s)):
        raise ValueError(f"fp8 1D1D GEMM needs 2-d operands, got a_q {a_q.shape}, a_s {a_s.shape}, "
                         f"b_q {b_q.shape}, b_s {b_s.shape}")
    check_dtypes("fp8 1D1D GEMM", a_q, a_s, b_q, b_s)
    m, k = a_q.shape
    n, k2 = b_q.shape
    if k != k2:
        raise ValueError(f"contraction mismatch: a_q {a_q.shape}, b_q {b_q.shape} (want [M, K], [N, K])")
    if k % BLOCK:
        raise ValueError(f"fp8 1D1D GEMM needs K a multiple of {BLOCK} (pad the tokens with zeros "
                         f"before quantising), got K={k}")
    if config.tile_n not in (128, 256) or n % config.tile_n:
        raise ValueError(f"fp8 1D1D GEMM needs N a multiple of tile_n={config.tile_n} (128 or 256), "
                         f"got N={n}")
    if a_s.shape != (m, k // BLOCK) or b_s.shape != (n, k // BLOCK):
        raise ValueError(f"scale shapes a_s {a_s.shape}, b_s {b_s.shape}: want "
                         f"[{m}, {k // BLOCK}] and [{n}, {k // BLOCK}]")
    check_schedule(config)


@lower_once
def fp8_gemm_1d1d(a_q, a_s, b_q, b_s, *, out_dtype=jnp.float32, config=None):
    """out = (a_q * a_s) @ (b_q * b_s)^T with both operands scaled per (row, 128 of K), fp32
    accumulation promoted per 128 of K (the weight-gradient GEMM; module docstring).

    Args:
      a_q: [M, K] float8_e4m3fn, K-major (for dw = x^T dy: x^T, [in, tokens]).
      a_s: [M, K/128] float32: a_q[m, 128 kb : 128 (kb + 1)] stands for those values times
        a_s[m, kb].
      b_q: [N, K] float8_e4m3fn, K-major (dy^T, [out, tokens]).
      b_s: [N, K/128] float32, per (row of b_q, 128 of K).
      out_dtype: output dtype, float32 by default (a weight gradient accumulates in fp32).
      config: Fp8Config (default WGRAD_CONFIG: tile_n 128, fold after each wgmma).
    Returns:
      [M, N] out_dtype: sum over K blocks of the block's fp32 wgmma partial product times
      a_s[:, kb] (rows) * b_s[:, kb] (columns), summed in fp32.
    Raises:
      ValueError: wrong dtypes or ranks, K not a multiple of 128 or N not a multiple of
        config.tile_n (pad with zeros before quantising: a zero block adds nothing whatever
        its scale), scale shapes that do not match, or a bad config. M of any size is padded
        with zero rows to a multiple of 128 inside (a copy of a_q).
    """
    config = config or WGRAD_CONFIG
    check_operands_1d1d(a_q, a_s, b_q, b_s, config)
    return mosaic_gemm.dense_call(a_q, a_s, b_q, b_s.T, out_dtype, config, b_scales="rows",
                                  interpret=default_interpret())
