"""DeepSeek V2/V3 model (Flax NNX)."""
from dsjax.model.transformer import DeepSeekModel

__all__ = ["DeepSeekModel"]
