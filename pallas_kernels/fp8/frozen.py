"""Frozen FP8 weights: a weight held as E4M3 values plus 128 x 128 block scales (DeepSeek-V3's
released checkpoint as it ships), and the linear / grouped GEMMs that use it directly.

Legend: M rows (tokens, leading dims flattened), K input width, N output width, E experts,
Kb = ceil(K / 128), Nb = ceil(N / 128).

`Fp8Weight(q, s)` stands in for a weight array w [..., K, N] (dsjax's [in, out] layout) with
w[..., k, n] = q[..., k, n] * s[..., k // 128, n // 128]: q float8_e4m3fn, s float32. The
scale is the dequantisation multiplier, i.e. DeepSeek-V3's `weight_scale_inv` (its
`weight_dequant` computes q * scale_inv per block; `reference.quantize_blocks_128x128` gives
the same s = amax / 448). A checkpoint tensor [out, in] with scales [ceil(out / 128),
ceil(in / 128)] becomes q = W.T, s = S.T (`Fp8Weight.from_out_in`), exactly: transposing moves
values, it does not round them. Partial edge blocks are blocks of their own (e.g.
kv_a_proj_with_mqa [576, 7168] has a [5, 56] scale grid).

Memory: 1 byte per element plus 4 bytes per 128 x 128 block (4 / 16384 per element), about
half of bf16.

GEMMs (custom VJP; the weight is not trained, so the backward is dgrad only, no wgrad):
  `fp8_linear_frozen(x, w)`       x [..., K] quantised in 1 x 128 tiles (`reference.
                                  quantize_rows_1x128`), y = x @ w with w's own (q, s), never
                                  re-quantised; dgrad dy 1 x 128 @ w^T (the same blocks read
                                  transposed). Residuals: nothing but w itself.
  `fp8_grouped_gemm_frozen(x, w, group_sizes)`  the same per expert, w [E, K, N], rows grouped
                                  consecutively by group_sizes (`pallas_kernels.moe` layout).
Backends: `api.gemm_nt` runs every dense FP8 GEMM here and `api._grouped_gemm_nt` the grouped
ones ("reference": dequantise per block and dot in fp32 at full precision; "mosaic": the Hopper
kernels).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.fp8 import api as fp8_api
from pallas_kernels.fp8 import reference as ref
from pallas_kernels.moe.reference import grouped_matmul_reference

BLOCK = 128  # `reference.BLOCK`


def scale_grid(shape) -> tuple[int, ...]:
    """Scale shape of a weight of `shape` [..., K, N]: [..., ceil(K / 128), ceil(N / 128)]."""
    *lead, k, n = shape
    return (*lead, -(-k // BLOCK), -(-n // BLOCK))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A frozen weight [..., K, N] as E4M3 values q and fp32 128 x 128 block scales s
    [..., Kb, Nb] (module docstring). A pytree of the two arrays: it stands where the weight
    array stands in a parameter tree (an `nnx.Param`'s value, a pure dict leaf), and `w[...]`
    gives it back as `Variable[...]` gives an array."""

    q: jax.Array
    s: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of q and s together."""
        return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in (self.q, self.s))

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError(f"Fp8Weight supports w[...] only, got index {key!r}")

    def dequantize(self, dtype=jnp.float32):
        """w [..., K, N] = q * s per block, in `dtype` (fp32 maths)."""
        deq = ref.dequantize_blocks_128x128
        for _ in range(self.ndim - 2):
            deq = jax.vmap(deq)
        return deq(self.q, self.s).astype(dtype)

    @classmethod
    def quantize(cls, w) -> "Fp8Weight":
        """w [..., K, N] (any float dtype) quantised per 128 x 128 block of each matrix
        (`reference.quantize_blocks_128x128`)."""
        quant = ref.quantize_blocks_128x128
        for _ in range(w.ndim - 2):
            quant = jax.vmap(quant)
        return cls(*quant(w))

    @classmethod
    def from_out_in(cls, q_oi, s_oi) -> "Fp8Weight":
        """From a checkpoint's layout: q [..., out, in] e4m3, s [..., ceil(out/128), ceil(in/128)]
        (`weight_scale_inv`) -> q [..., in, out], s [..., ceil(in/128), ceil(out/128)].

        Raises ValueError when q is not float8_e4m3fn or s does not match q's block grid."""
        if jnp.dtype(q_oi.dtype) != jnp.dtype(ref.FP8):
            raise ValueError(f"Fp8Weight: values must be float8_e4m3fn, got {q_oi.dtype}")
        if tuple(s_oi.shape) != scale_grid(q_oi.shape):
            raise ValueError(f"Fp8Weight: scales {list(s_oi.shape)} do not match weight {list(q_oi.shape)} "
                             f"with 128x128 blocks (expected {list(scale_grid(q_oi.shape))})")
        return cls(jnp.swapaxes(q_oi, -1, -2), jnp.swapaxes(s_oi, -1, -2).astype(jnp.float32))


# ----------------------------------------------------------------------------- dense

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _frozen_matmul(x, q, s, backend):
    return _frozen_matmul_fwd(x, q, s, backend)[0]


def _frozen_matmul_fwd(x, q, s, backend):
    x_q, x_s = ref.quantize_rows_1x128(x)
    y = fp8_api.gemm_nt(backend, x_q, x_s, q.T, s.T, x.dtype)  # x [M, K] @ (w^T [N, K])^T
    return y, (q, s, x[:0])


def _frozen_matmul_bwd(backend, res, dy):
    q, s, x_meta = res
    dy_q, dy_s = ref.quantize_rows_1x128(dy)
    dx = fp8_api.gemm_nt(backend, dy_q, dy_s, q, s, x_meta.dtype)  # dy [M, N] @ (w [K, N])^T
    return dx, None, None


_frozen_matmul.defvjp(_frozen_matmul_fwd, _frozen_matmul_bwd)


def fp8_linear_frozen(x, w: Fp8Weight, *, impl: str = "auto"):
    """y = x @ w for a frozen FP8 weight: x quantised in 1 x 128 tiles, w used as stored.

    Args:
      x: [..., K] in the compute dtype (float32 / bfloat16 / float16).
      w: `Fp8Weight` with q [K, N] float8_e4m3fn, s [Kb, Nb] float32.
      impl: "auto" | "reference" | "mosaic" (`api.resolve_impl`).
    Returns:
      [..., N] in x.dtype, fp32 accumulation. Differentiable in x only (dx = dy @ w^T with dy in
      1 x 128 tiles, in x.dtype); w gets no gradient.
    Raises:
      ValueError: w is not a 2-D Fp8Weight with scales of its block grid, x's last dim is not
        w's first, or impl is unknown / unavailable.
    """
    _check(w, 2, "fp8_linear_frozen")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_linear_frozen: x {list(x.shape)} and w {list(w.shape)} do not contract "
                         f"(want x [..., K], w [K, N])")
    backend = fp8_api.resolve_impl(impl)
    lead = x.shape[:-1]
    y = _frozen_matmul(x.reshape(-1, x.shape[-1]), w.q, w.s, backend)
    return y.reshape(*lead, w.shape[1])


def _check(w, ndim: int, where: str) -> None:
    if not isinstance(w, Fp8Weight) or w.ndim != ndim or tuple(w.s.shape) != scale_grid(w.shape):
        got = (f"q {list(w.q.shape)}, s {list(w.s.shape)}" if isinstance(w, Fp8Weight)
               else type(w).__name__)
        raise ValueError(f"{where}: want an Fp8Weight of {ndim} dims with scales on its 128x128 block "
                         f"grid, got {got}")


# ----------------------------------------------------------------------------- grouped (MoE)

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _frozen_gmm(x, q, s, group_sizes, backend):
    return _frozen_gmm_fwd(x, q, s, group_sizes, backend)[0]


def _grouped(a_q, a_s, w, group_sizes):
    with jax.default_matmul_precision("highest"):
        return grouped_matmul_reference(ref.dequantize_rows_1x128(a_q, a_s), w, group_sizes,
                                        preferred_element_type=jnp.float32)


def _frozen_gmm_fwd(x, q, s, group_sizes, backend):
    x_q, x_s = ref.quantize_rows_1x128(x)
    if backend == "mosaic":  # b = each expert's w^T [N, K], K-major: the stored blocks transposed
        y = fp8_api._grouped_gemm_nt(backend, x_q, x_s, jnp.swapaxes(q, 1, 2), jnp.swapaxes(s, 1, 2),
                                     group_sizes, x.dtype)
    else:
        y = _grouped(x_q, x_s, Fp8Weight(q, s).dequantize(), group_sizes).astype(x.dtype)
    return y, (q, s, group_sizes, x[:0])


def _frozen_gmm_bwd(backend, res, dy):
    q, s, group_sizes, x_meta = res
    dy_q, dy_s = ref.quantize_rows_1x128(dy)
    if backend == "mosaic":  # b = w [K, N] as stored: K the output, N the contraction
        dx = fp8_api._grouped_gemm_nt(backend, dy_q, dy_s, q, s, group_sizes, x_meta.dtype)
    else:
        dx = _grouped(dy_q, dy_s, jnp.swapaxes(Fp8Weight(q, s).dequantize(), 1, 2), group_sizes)
    return dx.astype(x_meta.dtype), None, None, None


_frozen_gmm.defvjp(_frozen_gmm_fwd, _frozen_gmm_bwd)


def fp8_grouped_gemm_frozen(x, w: Fp8Weight, group_sizes, *, impl: str = "auto"):
    """Grouped GEMM of the routed experts with frozen FP8 weights: out[i] = x[i] @ w[g(i)].

    Args:
      x: [M, K] in the compute dtype, rows sorted by expert; w: `Fp8Weight` q [E, K, N],
        s [E, Kb, Nb]; group_sizes: [E] int, sum <= M (rows past the sum give zeros).
      impl: "auto" | "reference" | "mosaic" (`api.resolve_impl`): "mosaic" runs the grouped
        Mosaic GPU kernel (`mosaic_gemm.fp8_gmm_blockwise`) on the stored blocks, transposed
        for the forward ([E, N, K], an fp8 copy) and as stored for the dgrad; "reference"
        dequantises each expert's blocks and runs the grouped reference in fp32.
    Returns:
      [M, N] in x.dtype. Differentiable in x only (dy in 1 x 128 tiles times each expert's
      blocks transposed); w and group_sizes get none.
    Raises:
      ValueError: shapes that do not fit, or an unknown impl.
    """
    _check(w, 3, "fp8_grouped_gemm_frozen")
    if x.ndim != 2 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"fp8_grouped_gemm_frozen: x {list(x.shape)}, w {list(w.shape)}, group_sizes "
                         f"{list(group_sizes.shape)} do not fit (want x [M, K], w [E, K, N], [E])")
    return _frozen_gmm(x, w.q, w.s, group_sizes.astype(jnp.int32), fp8_api.resolve_impl(impl))


def grouped_gemm(x, w, group_sizes, *, impl: str = "auto", dw_sink=None,
                 requantize_weight: bool = False):
    """The routed experts' FP8 GEMM for a weight of either kind: `fp8_grouped_gemm_frozen` for a
    frozen `Fp8Weight` (its stored values and scales), `api.fp8_grouped_gemm` (quantised online,
    differentiable in w; dw_sink: its weight gradient written into a ref, requantize_weight:
    w quantised again in the backward, both as there) for an array w [E, K, N]. x [M, K] rows
    grouped by group_sizes [E]; returns [M, N] in x.dtype (`grouped_lora_matmuls(base_gemm=...)`).

    Raises:
      ValueError: as `api.fp8_grouped_gemm`; a dw_sink with a frozen `Fp8Weight` (no gradient).
    """
    if isinstance(w, Fp8Weight):
        if dw_sink is not None:
            raise ValueError("grouped_gemm: a frozen Fp8Weight has no gradient to write into dw_sink")
        return fp8_grouped_gemm_frozen(x, w, group_sizes, impl=impl)
    return fp8_api.fp8_grouped_gemm(x, w, group_sizes, impl=impl, dw_sink=dw_sink,
                                    requantize_weight=requantize_weight)
