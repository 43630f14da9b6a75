"""MLA decode attention over the latent cache (absorbed MLA, split-context Mosaic GPU kernel)."""
from pallas_kernels.mla_decode.api import mla_decode

__all__ = ["mla_decode"]
