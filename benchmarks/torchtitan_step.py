"""torchtitan's own DeepSeek-V3 model as a training-step peer, at DeepSeek-V2-Lite geometry.

    python benchmarks/torchtitan_step.py LAYERS BATCH SEQ STEPS

Run by `benchmarks/train_step.py --peers torchtitan` in its own process (own allocator peak); it
prints one JSON line like the HF peers' script. Needs a CUDA GPU and torchtitan 0.3.0 (PyPI) with
its imports tyro, typeguard, docstring-parser and spmd_types 0.2.3, e.g. as wheels on PYTHONPATH.

The model is torchtitan's "16B" flavour (V2-Lite geometry: vocab 102400, hidden 2048, 16 heads, no
q LoRA, kv_lora_rank 512, 64 routed experts top-6, 2 shared, first layer dense) truncated to LAYERS
layers, with its own attention (FlexAttention over the causal packed-document mask its decoder
builds), its own grouped-mm MoE ("standard" token dispatch) and its own initialisation; each
transformer block compiled with torch.compile(fullgraph=True) as torchtitan's `apply_compile`
does; bf16 weights (so bf16 AdamW state, as the HF peers train), fused AdamW, the summed
cross-entropy over tokens divided by their count (torchtitan's loss), and the gradients' global norm
clipped to 1.0 (torchtitan's and HF Trainer's default, as dsjax clips).

torchtitan 0.3.0 was written against a newer torch than 2.11: two stand-ins make it import and run
there, both for code a one-GPU step never reaches or that only changes a mask-building option:
`torch.distributed.fsdp.DataParallelMeshDims` (a type name its FSDP helpers import) and
`create_block_mask` without the `separate_full_blocks` argument (added in later torch; without it
the mask is built as torch 2.11 builds every block mask).
"""
from __future__ import annotations

import inspect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_power import PowerSampler  # noqa: E402

VOCAB = 102400


def install_stand_ins() -> list[str]:
    """Make torchtitan 0.3.0 import on an older torch; returns the names stood in for."""
    import torch.distributed.fsdp as fsdp
    from torch.nn.attention import flex_attention

    done = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        class DataParallelMeshDims:  # a type annotation only on the one-GPU path
            pass
        fsdp.DataParallelMeshDims = DataParallelMeshDims
        done.append("DataParallelMeshDims")
    if "separate_full_blocks" not in inspect.signature(flex_attention.create_block_mask).parameters:
        import torch
        from torchtitan.models.common import attention, decoder

        compiled = torch.compile(flex_attention.create_block_mask)

        def create_attention_mask(*args, separate_full_blocks=True, **kwargs):
            return compiled(*args, **kwargs)
        attention.create_attention_mask = create_attention_mask
        decoder.create_attention_mask = create_attention_mask
        done.append("create_block_mask(separate_full_blocks)")
    return done


def build(layers: int, device):
    """torchtitan's 16B DeepSeek-V3 model truncated to `layers` layers, bf16, initialised."""
    import torch
    import torchtitan.models.deepseek_v3 as ds

    cfg = ds.deepseekv3_configs["16B"](attn_backend="flex", moe_comm_backend="standard")
    cfg.layers = cfg.layers[:layers]
    with torch.device(device):
        model = cfg.build()
    model.init_weights(buffer_device=torch.device(device))
    return model.to(torch.bfloat16)


def main() -> None:
    L, B, T, steps = (int(a) for a in sys.argv[1:5])
    import torch

    stood_in = install_stand_ins()
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed.compile import apply_compile  # noqa: F401 (what the loop below mirrors)

    torch._dynamo.config.capture_scalar_outputs = True  # as apply_compile sets it for the MoE's dispatch
    model = build(L, "cuda")
    for _, block in model.layers.named_children():
        block.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, VOCAB, (B, T + 1), device="cuda")
    positions = torch.arange(T, device="cuda").repeat(B, 1)  # one document per row
    masks = model.get_attention_masks(positions)

    def step():
        pred = model(x[:, :-1], positions, masks)
        loss = cross_entropy_loss(pred, x[:, 1:]) / (B * T)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with PowerSampler() as ps:
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps
    print(json.dumps({"step_ms": dt * 1e3, "tokens_per_s": B * T / dt, "devices": 1, "loss": float(loss),
                      "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "gpu": ps.summary(),
                      "stand_ins": stood_in}))


if __name__ == "__main__":
    main()
