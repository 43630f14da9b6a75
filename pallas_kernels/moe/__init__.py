"""Dropless MoE dispatch: permute -> grouped GEMM -> weighted combine."""
from pallas_kernels.moe.api import dw_sq_shape, gate_up_swiglu, grouped_matmul
from pallas_kernels.moe.routing import permute, sorted_weights, swiglu, unpermute, unpermute_sum
from pallas_kernels.moe.lora import grouped_lora_matmuls, lora_dropout, lora_factors

__all__ = ["permute", "grouped_matmul", "dw_sq_shape", "gate_up_swiglu", "unpermute", "unpermute_sum", "swiglu",
           "sorted_weights", "grouped_lora_matmuls", "lora_factors", "lora_dropout"]
