"""FP8 E4M3 block-scaled GEMMs for training (DeepSeek-V3 sec. 3.3): quantisers and references
(reference.py), the differentiable linear / grouped GEMMs (api.py), the Mosaic GPU kernels for
Hopper (mosaic_gemm.py: forward and dgrad; mosaic_wgrad.py: the weight gradient, the same
kernel; mosaic_grouped_wgrad.py: the experts' weight gradient; mosaic_common.py: their shared
parts)."""
from pallas_kernels.fp8.api import fp8_grouped_gemm, fp8_linear

__all__ = ["fp8_linear", "fp8_grouped_gemm"]
