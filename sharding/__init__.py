"""Parallelism as sharding specs over one device mesh (imports jax and pallas_kernels only).

mesh.py             `make_mesh(config)`: axes data, fsdp, expert, context, tensor (-1 fills the rest)
rules.py            logical axis names -> mesh axes, one table per preset (dp, fsdp = ZeRO-3, tp,
                    ep, cp and combinations), collision / divisibility checks, the active context
ring_attention.py   context parallelism: ring attention with ppermute + log-sum-exp merge, striping
expert_parallel.py  expert parallelism: experts over `expert`, tokens by all-gather/reduce-scatter
fp8_linear.py       the dense FP8 linear (model.fp8=blockwise) in shard_map on each device's tokens
distributed.py      multi-host start-up (jax.distributed)
"""
