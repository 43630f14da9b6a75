"""The tiny DeepSeek-V3-style model of the LoRA and sharding tests, as `--set` overrides of
configs/tiny.yaml: hidden size 32, MLA with q and kv LoRA rank 16 and 8-wide heads, one dense
layer then MoE layers of top-2 routing over 2 expert groups, and the jnp reference attention and
MoE (no Pallas kernels). Import it after `sys.path.insert(0, <the tests folder>)`."""


def tiny_model(vocab: int = 128, layers: int = 2, heads: int = 2, experts: int = 4) -> list[str]:
    """`model.*` overrides of the tiny model; the arguments are the sizes the tests vary."""
    return [f"model.vocab_size={vocab}", "model.hidden_size=32", "model.intermediate_size=32",
            "model.moe_intermediate_size=16", f"model.num_hidden_layers={layers}",
            f"model.num_attention_heads={heads}", "model.q_lora_rank=16", "model.kv_lora_rank=16",
            "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8",
            f"model.n_routed_experts={experts}", "model.num_experts_per_tok=2", "model.n_group=2",
            "model.topk_group=1", "model.first_k_dense_replace=1", "model.attention_impl=reference",
            "model.moe_impl=reference"]
