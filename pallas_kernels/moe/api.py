"""Public MoE dispatch API with backend dispatch (`impl="auto" | "pallas" | "reference"`)."""
from __future__ import annotations

from pallas_kernels.moe.reference import (grouped_matmul_reference, permute_reference,
                                          unpermute_reference)

IMPLS = ("auto", "pallas", "reference")


def _check(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "pallas":
        raise ValueError("impl='pallas': the Mosaic GPU MoE kernels are not available yet")


def permute(x, topk_ids, *, num_experts, impl="auto"):
    """x [T, D], topk_ids [T, K] -> (x_sorted [T*K, D], group_sizes [E] int32, perm [T*K] int32)."""
    _check(impl)
    return permute_reference(x, topk_ids, num_experts)


def grouped_matmul(x, w, group_sizes, *, impl="auto", preferred_element_type=None):
    """x [M, K] @ w [E, K, N] per consecutive row group (group_sizes [E]) -> [M, N]."""
    _check(impl)
    return grouped_matmul_reference(x, w, group_sizes, preferred_element_type=preferred_element_type)


def unpermute(y, perm, topk_weights, *, impl="auto"):
    """y [T*K, N] sorted rows, perm [T*K], topk_weights [T, K] -> [T, N] (fp32 weighted sum)."""
    _check(impl)
    return unpermute_reference(y, perm, topk_weights)
