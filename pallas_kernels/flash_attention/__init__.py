"""Flash attention for MLA shapes (Dqk != Dv). Public entry: `flash_attention`."""
from pallas_kernels.flash_attention.api import flash_attention

__all__ = ["flash_attention"]
