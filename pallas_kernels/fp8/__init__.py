"""FP8 GEMMs with DeepSeek-V3 block scales (1 x 128 activations, 128 x 128 weights)."""
