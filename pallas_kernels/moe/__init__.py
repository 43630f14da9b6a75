"""Dropless MoE dispatch: permute -> grouped GEMM -> weighted combine."""
from pallas_kernels.moe.api import (gate_up_swiglu, grouped_matmul, permute, sorted_weights, swiglu,
                                    unpermute, unpermute_sum)
from pallas_kernels.moe.lora import grouped_lora_delta, grouped_lora_deltas, lora_dropout

__all__ = ["permute", "grouped_matmul", "gate_up_swiglu", "unpermute", "unpermute_sum", "swiglu", "sorted_weights",
           "grouped_lora_delta", "grouped_lora_deltas", "lora_dropout"]
