"""DeepSeek V2/V3 model (Flax NNX)."""
from dsjax.model.fns import ModelFns, abstract_model
from dsjax.model.transformer import DeepSeekModel

__all__ = ["DeepSeekModel", "ModelFns", "abstract_model"]
