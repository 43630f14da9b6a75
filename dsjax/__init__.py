"""dsjax: DeepSeek V2/V3 language models in JAX (MLA, DeepSeekMoE, Pallas kernels, sharding specs)."""
import flax

# Variables carry logical axis names; sharding is applied by `sharding.rules`, not at creation.
flax.config.update("flax_always_shard_variable", False)

__version__ = "0.1.0"
