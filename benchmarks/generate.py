"""Decode throughput with the MLA latent cache at DeepSeek-V2-Lite geometry (random bf16 weights).

    python benchmarks/generate.py [--layers 27] [--batches 1,16,64] [--contexts 4096,32768]
        [--modes absorbed,expanded] [--cache-dtypes bfloat16,int8] [--steps 16] [--hf 1x4096,16x4096]
        [--json FILE]
    python benchmarks/generate.py --tiny     # 2 small layers, 3 steps: a CPU smoke run

Modes: "absorbed" (XLA's products over the latent), "kernel" (absorbed through the split-context
Mosaic GPU kernel, `pallas_kernels.mla_decode`; bf16 and int8 caches), "expanded" (K/V through
kv_b_proj).
Per (batch, context, decode mode, cache dtype): one decode step (`dsjax.model.decode.decode_step`,
jitted, cache donated) over a cache whose `context` slots per row all hold random latents, so
every step reads the whole context (the same random latents for every cache dtype and mode);
tokens/s = batch x steps / seconds, the cache's GB, and the
floor: (bytes of the weights a step reads + the cache's bytes) / the copy bandwidth measured
here (a device copy of a 4 GB buffer, read + written). The weights a step reads: every
non-expert weight, the lm_head, and per MoE layer the routed experts a batch of that size
touches on average under uniform routing (E (1 - (1 - k/E)^B)). Points that would not fit in
90% of the device memory left with the weights resident (the cache, plus the expanded K/V of a
layer for `expanded`) are skipped.
An int8 row also gives the KL divergence (nats, mean over rows) of its first step's next-token
distribution from the bfloat16 cache's at the same point: the cost of quantising those latents;
a "kernel" row the KL from the "absorbed" row of the same cache (the kernel checked against XLA).
The HF transformers peer (`--hf BxS,...`, '' for none) runs DeepseekV2ForCausalLM in a
subprocess with its static cache (full per-head K/V), eager, prefill of S - 1 random tokens,
then greedy steps; its decode tokens/s comes from two `generate` calls (1 and 1 + steps new
tokens); these run first, before this process allocates the GPU's memory. The default grid runs in about 8 minutes on one H100: larger contexts (131072) with
`--contexts`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _step_common import HF_V2_LITE_CONFIG, V2_LITE  # noqa: E402

TINY = ["model.vocab_size=512", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=16",
        "model.v_head_dim=16", "model.n_routed_experts=8", "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=32", "model.intermediate_size=96", "model.attention_impl=reference",
        "model.moe_impl=reference"]


def model_config(layers: int, tiny: bool):
    from dsjax import config as C
    return C.load(None, V2_LITE + (TINY if tiny else []) + [f"model.num_hidden_layers={layers}",
                                                            "model.weight_dtype=bfloat16"]).model


def step_weight_bytes(cfg, batch: int) -> int:
    """Bytes of the weights one decode step of `batch` rows reads (bf16): non-expert weights,
    lm_head, and the routed experts touched on average under uniform routing."""
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    D, H = cfg.hidden_size, cfg.num_attention_heads
    attn = (D * H * cfg.qk_head_dim + D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + H * cfg.v_head_dim * D)
    expert = 3 * D * cfg.moe_intermediate_size
    touched = E * (1 - (1 - k / E) ** batch)
    moe = (cfg.n_shared_experts * expert + touched * expert + D * E)
    params = (cfg.num_hidden_layers * attn + cfg.first_k_dense_replace * 3 * D * cfg.intermediate_size
              + cfg.num_moe_layers * moe + D * cfg.vocab_size)
    return int(2 * params)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes/s of a device copy (read + write) of an nbytes buffer, best of 5."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * jnp.bfloat16(1.0009765625))
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def random_cache(cfg, batch: int, context: int, cc, key):
    """A cache of `context` slots per row filled with random latents (int8 quantised for int8)."""
    import jax
    import jax.numpy as jnp
    from dsjax.model import decode as D
    shapes = D.cache_shapes(cfg, batch, context, cc)

    @jax.jit
    def make(key):
        out = []
        for i, layer in enumerate(shapes):
            kc, kr = jax.random.split(jax.random.fold_in(key, i))
            c = jax.random.normal(kc, layer["c_kv"].shape, jnp.bfloat16)
            d = {"k_rope": jax.random.normal(kr, layer["k_rope"].shape, layer["k_rope"].dtype)}
            if "c_scale" in layer:
                d["c_kv"], d["c_scale"] = D.quantize_int8(c)
            else:
                d["c_kv"] = c.astype(layer["c_kv"].dtype)
            out.append(d)
        return tuple(out)
    return make(key)


def run_point(model, batch: int, context: int, mode: str, cache_dtype: str, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from dsjax.model import decode as D
    cfg = model.cfg
    cc = D.CacheConfig(cache_dtype, absorb=mode != "expanded", kernel=mode == "kernel")
    gd, st = nnx.split(model)
    cache = random_cache(cfg, batch, context, cc, jax.random.key(1))
    step = jax.jit(lambda st, t, c, cur: D.decode_step(nnx.merge(gd, st), t, c, cur, cc), donate_argnums=(2,))
    tok = jnp.ones((batch, 1), jnp.int32)
    cur = jnp.full((batch,), context - 1, jnp.int32)  # the last slot: attends to all `context`
    t_c = time.perf_counter()
    logits, cache = step(st, tok, cache, cur)
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - t_c
    logp0 = jax.nn.log_softmax(logits[:, -1].astype(jnp.float32), axis=-1)  # the first step's
    logits, cache = step(st, tok, cache, cur)
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, cache = step(st, tok, cache, cur)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
    jax.block_until_ready(logits)
    dt = (time.perf_counter() - t0) / steps
    return {"batch": batch, "context": context, "mode": mode, "cache_dtype": cache_dtype, "step_ms": dt * 1e3,
            "tokens_per_s": batch / dt, "cache_gb": D.cache_nbytes(cache) / 1e9, "compile_s": compile_s,
            "finite": bool(jnp.all(jnp.isfinite(logits))), "_logp0": logp0}


def kernel_refuses(cfg, context: int, cache_dtype: str) -> str | None:
    """Why `pallas_kernels.mla_decode` would not take this model's cache (None if it does): the
    "kernel" mode would otherwise run XLA's absorbed path under the kernel's name."""
    from pallas_kernels.mla_decode import mosaic
    return mosaic.supported(cfg.kv_lora_rank, cfg.qk_rope_head_dim, context, cache_dtype)


def kl_nats(logp, logq) -> float:
    """Mean over rows of KL(p || q) in nats, from log-probabilities [B, V]."""
    import jax.numpy as jnp
    return float(jnp.mean(jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)))


def fits(cfg, batch: int, context: int, mode: str, cache_dtype: str, free_bytes: float) -> bool:
    """Whether the cache (and, expanded, one layer's K/V) fits in 90 % of free_bytes, the device
    memory left with the weights resident."""
    from dsjax.model import decode as D
    need = D.cache_nbytes(D.cache_shapes(cfg, batch, context, D.CacheConfig(cache_dtype)))
    if mode == "expanded":  # one layer's K [B, S, H, Dn + R] and V [B, S, H, Dv] in bf16, fp32 scores
        H = cfg.num_attention_heads
        need += batch * context * H * (2 * (cfg.qk_head_dim + cfg.v_head_dim) + 4)
    return need < 0.9 * free_bytes


HF_SCRIPT = r"""
import json, sys, time, torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
L, B, S, steps = (int(a) for a in sys.argv[1:5])
""" + HF_V2_LITE_CONFIG + r"""
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = DeepseekV2ForCausalLM(cfg).eval()
x = torch.randint(0, 102400, (B, S - 1), device="cuda")
def run(n):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                       pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize(); return time.perf_counter() - t0
run(2)
t1, tn = run(1), run(1 + steps)
dt = (tn - t1) / steps
print(json.dumps({"batch": B, "context": S, "mode": "hf static cache", "cache_dtype": "bfloat16",
                  "step_ms": dt * 1e3, "tokens_per_s": B / dt,
                  "cache_gb": L * B * S * 16 * (192 + 128) * 2 / 1e9,
                  "peak_gb": torch.cuda.max_memory_allocated() / 1e9}))
"""


def run_hf(layers: int, batch: int, context: int, steps: int) -> dict:
    argv = [sys.executable, "-c", HF_SCRIPT, str(layers), str(batch), str(context), str(steps)]
    row = {"batch": batch, "context": context, "mode": "hf static cache", "cache_dtype": "bfloat16"}
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {**row, "error": "timed out"}
    if r.returncode != 0:
        err = "out of memory" if "OutOfMemory" in r.stderr else (r.stderr.strip().splitlines() or ["?"])[-1][-200:]
        return {**row, "error": err}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--modes", default="absorbed,expanded",
                   help="comma list of absorbed, kernel (absorbed through pallas_kernels.mla_decode), expanded")
    p.add_argument("--cache-dtypes", default="bfloat16,int8", help="comma list of bfloat16, int8")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--hf", default="1x4096,16x4096", help="HF peer points BATCHxCONTEXT, comma list ('' for none)")
    p.add_argument("--tiny", action="store_true", help="2 layers of small dims, batch 2, context 64, 3 steps, no HF")
    p.add_argument("--json", default="", help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.batches, args.contexts, args.steps, args.hf = 2, "2", "64", 3, ""
    # the HF peers first, each in its own process, before this one takes the GPU's memory
    hf_rows = []
    for pt in filter(None, args.hf.split(",")):
        B, S = (int(x) for x in pt.split("x"))
        hf_rows.append(run_hf(args.layers, B, S, args.steps))
        print(fmt(hf_rows[-1]), flush=True)
    import jax
    from flax import nnx
    from dsjax.model import DeepSeekModel
    cfg = model_config(args.layers, args.tiny)
    model = nnx.jit(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0)))()
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0) if stats else float("inf")
    bw = copy_bandwidth(1 << 20 if args.tiny else 4 << 30)
    print(f"device {dev.device_kind}; copy bandwidth {bw / 1e9:.0f} GB/s; {args.layers} layers; "
          f"weights read per step at batch 1: {step_weight_bytes(cfg, 1) / 1e9:.2f} GB", flush=True)
    rows, logp = [], {}  # logp: each point's first-step next-token log-probabilities
    for B in (int(x) for x in args.batches.split(",")):
        for S in (int(x) for x in args.contexts.split(",")):
            for mode in args.modes.split(","):
                for dt in args.cache_dtypes.split(","):
                    why = kernel_refuses(cfg, S, dt) if mode == "kernel" else None
                    if why:
                        rows.append({"batch": B, "context": S, "mode": mode, "cache_dtype": dt,
                                     "error": f"not run: the decode kernel does not take {why}"})
                        print(fmt(rows[-1]), flush=True)
                        continue
                    if not args.tiny and not fits(cfg, B, S, mode, dt, free):
                        rows.append({"batch": B, "context": S, "mode": mode, "cache_dtype": dt, "error": "does not fit"})
                        print(fmt(rows[-1]), flush=True)
                        continue
                    try:
                        r = run_point(model, B, S, mode, dt, args.steps)
                    except Exception as e:  # noqa: BLE001 (an out-of-memory point is a row, not the end)
                        r = {"batch": B, "context": S, "mode": mode, "cache_dtype": dt, "error": str(e).splitlines()[0][:160]}
                    if "error" not in r:
                        r["floor_ms"] = (step_weight_bytes(cfg, B) + r["cache_gb"] * 1e9) / bw * 1e3
                        logp[(B, S, mode, dt)] = r.pop("_logp0")
                        base = logp.get((B, S, mode, "bfloat16"))
                        if dt != "bfloat16" and base is not None:
                            r["kl_vs_bf16"] = kl_nats(base, logp[(B, S, mode, dt)])
                        xla = logp.get((B, S, "absorbed", dt))
                        if mode == "kernel" and xla is not None:  # the kernel checked against XLA
                            r["kl_vs_absorbed"] = kl_nats(xla, logp[(B, S, mode, dt)])
                    rows.append(r)
                    print(fmt(r), flush=True)
    rows += hf_rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def fmt(r: dict) -> str:
    head = f"B={r['batch']:<3} S={r['context']:<6} {r['mode']:<16} {r['cache_dtype']:<8}"
    if "error" in r:
        return f"{head} {r['error']}"
    floor = f" floor {r['floor_ms']:.2f} ms ({r['floor_ms'] / r['step_ms']:.0%} of it)" if "floor_ms" in r else ""
    kl = f" KL vs bf16 {r['kl_vs_bf16']:.2e} nats" if "kl_vs_bf16" in r else ""
    kl += f" KL vs absorbed {r['kl_vs_absorbed']:.2e} nats" if "kl_vs_absorbed" in r else ""
    return (f"{head} {r['step_ms']:8.2f} ms/step {r['tokens_per_s']:10.1f} tok/s cache {r['cache_gb']:.3f} GB"
            + floor + kl)


if __name__ == "__main__":
    main()
