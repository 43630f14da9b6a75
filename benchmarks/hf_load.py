"""Peak host memory of loading a large HF DeepSeek checkpoint through `dsjax.hf.load_hf`.

  python benchmarks/hf_load.py write DIR [--layers 8] [--shard-gb 2]   # V2-Lite-shaped, random bf16
  python benchmarks/hf_load.py load DIR [--weight-dtype bfloat16]        # prints params, GiB, peak RSS

`write` streams a DeepSeek-V2-Lite-shaped checkpoint (hidden 2048, 64 routed experts of 1408, 2
shared, 16 heads, no q LoRA, vocab 102400) with `--layers` layers (V2-Lite has 27) in bf16, one
tensor at a time (values: a tiled random block; their values do not matter here). `load` loads it
and reports ru_maxrss (the process's peak resident memory) next to the size of the loaded state.
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsjax.hf import load_hf, model_config_from_hf
from dsjax.hf import mapping as M
from dsjax.hf.safetensors_io import write_sharded
from dsjax.model import abstract_model

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 1,
    "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 100000,
    "eos_token_id": 100001, "torch_dtype": "bfloat16",
}


def write(out: Path, layers: int, shard_gb: float) -> None:
    hf = dict(V2_LITE, num_hidden_layers=layers)
    cfg = model_config_from_hf(hf)
    _, params, rest = abstract_model(cfg)
    trees = {"params": params, "rest": rest}
    block = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(ml_dtypes.bfloat16)
    specs = []
    for e in M.entries(cfg, params, rest):
        leaf = M.get_path(trees[e.tree], e.path)
        specs.append((e.hf, np.dtype(ml_dtypes.bfloat16), M.hf_shape(e, tuple(leaf.shape))))
    shapes = {n: s for n, _, s in specs}

    def produce(name):
        n = int(np.prod(shapes[name]))
        x = np.resize(block, n).reshape(shapes[name])
        if "norm" in name:
            x = np.ones(shapes[name], ml_dtypes.bfloat16)
        return x

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    write_sharded(out, specs, produce, int(shard_gb * 2**30))
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    n = sum(int(np.prod(s)) for _, _, s in specs)
    print(json.dumps({"wrote": str(out), "layers": layers, "params": n, "GiB_bf16": round(n * 2 / 2**30, 2),
                      "seconds": round(time.time() - t0, 1)}))


def load(path: Path, weight_dtype: str, forward: bool) -> None:
    t0 = time.time()
    cfg, fns, params, rest = load_hf(path, weight_dtype=weight_dtype, dtype="bfloat16")
    jax.block_until_ready(params)
    secs = time.time() - t0
    n = sum(x.size for x in jax.tree.leaves(params))
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((params, rest)))
    res = {"checkpoint": str(path), "layers": cfg.num_hidden_layers, "params": n,
           "state_GiB": round(nbytes / 2**30, 2), "weight_dtype": weight_dtype,
           "load_seconds": round(secs, 1),
           "peak_rss_GiB_after_load": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    if forward:
        model = fns.merge(params, rest)
        logits = model(jnp.arange(16, dtype=jnp.int32)[None] + 1000)[0]
        res["forward_ok"] = bool(jnp.all(jnp.isfinite(logits.astype(jnp.float32))))
        res["peak_rss_GiB_after_forward"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(json.dumps(res))


def main() -> None:
    p = argparse.ArgumentParser(prog="python benchmarks/hf_load.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=("write", "load"))
    p.add_argument("dir")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shard-gb", type=float, default=2.0)
    p.add_argument("--weight-dtype", default="bfloat16")
    p.add_argument("--forward", action="store_true")
    a = p.parse_args()
    if a.cmd == "write":
        write(Path(a.dir), a.layers, a.shard_gb)
    else:
        load(Path(a.dir), a.weight_dtype, a.forward)


if __name__ == "__main__":
    main()
