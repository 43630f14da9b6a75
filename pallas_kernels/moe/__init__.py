"""Dropless MoE dispatch: permute -> grouped GEMM -> weighted combine."""
from pallas_kernels.moe.api import grouped_matmul, permute, unpermute

__all__ = ["permute", "grouped_matmul", "unpermute"]
