"""A trained weight's stored E4M3 copy: both 128 x 128 block layouts that the FP8 GEMMs read,
written once per optimizer step from the master weight (DeepSeek-V3 sec. 3.3: the optimizer's
pass writes the FP8 copy), so that the step's forward and backward never quantise the weight.

Legend: K input width, N output width, E experts, Kb = ceil(K / 128), Nb = ceil(N / 128);
Kp, Np: K, N or their multiples of 128 (the "mosaic" backend's padded layout).

`Fp8Copy(q, s, qt, grad)` stands where a weight w [..., K, N] stands in the tree that the model
reads: q [..., Kp, Np] float8_e4m3fn (w's blocks as stored: the dgrad's operand), qt [..., Np, Kp]
(the same blocks transposed: the forward's), s [..., Kb, Nb] float32 (one scale per block, the
same for both layouts: a block's transpose has the same amax; qt's scales are s transposed).
`api.fp8_copy(w)` builds one (the values of `api._quantize_weight`). `grad` is the weight's
gradient carrier: None in the train state, and in the tree the step differentiates an array
[..., K, N] in the compute dtype whose values are never read (zeros); the FP8 GEMMs
(`api.fp8_linear`, `api.fp8_grouped_gemm`) give it the weight gradient x^T dy, so the step gets
dW [..., K, N] in the compute dtype as it would for the weight itself. q, s and qt get zero
cotangents. A leading layer axis [L, ...] slices with the pytree (`lax.scan`, `lax.unstack`):
every field has the weight's leading axes.

Frozen weights (no gradient, one layout) are `frozen.Fp8Weight`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Copy:
    """The E4M3 blocks of a weight [..., K, N] in both layouts and their fp32 scales, with the
    weight's gradient carrier (module docstring). A pytree of its arrays; `w[...]` gives it back
    as `nnx.Variable[...]` gives an array."""

    q: jax.Array
    s: jax.Array
    qt: jax.Array
    grad: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape [..., K, N] (the carrier's).

        Raises ValueError without a carrier (q may be padded, so the shape is not known)."""
        if self.grad is None:
            raise ValueError("Fp8Copy: the weight's shape is its gradient carrier's, and this copy has none")
        return tuple(self.grad.shape)

    @property
    def ndim(self) -> int:
        return (self.q if self.grad is None else self.grad).ndim

    @property
    def dtype(self):
        """The dtype of the weight's gradient (the carrier's), in which the model computes."""
        if self.grad is None:
            raise ValueError("Fp8Copy: the gradient dtype is its carrier's, and this copy has none")
        return self.grad.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of q, s and qt together (the carrier is not stored)."""
        return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in (self.q, self.s, self.qt))

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError(f"Fp8Copy supports w[...] only, got index {key!r}")

    def with_grad(self, carrier) -> "Fp8Copy":
        """This copy with the gradient carrier `carrier` [..., K, N] (the compute dtype)."""
        return dataclasses.replace(self, grad=carrier)
