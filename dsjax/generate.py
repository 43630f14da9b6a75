"""Sampling from a trained run with the MLA latent KV cache.

`python -m dsjax.generate --checkpoint RUN_DIR --prompt "def fibonacci(n):" [--max-new-tokens 200]
[--temperature 0.8] [--top-p 0.95] [--seed 0] [--no-cache]`

Greedy when temperature is 0. The cache holds, per layer, the normed latent c_kv [B, S, C] and the
roped k_rope [B, S, R] (DeepSeek-V2 sec. 2.1.4), never expanded K/V: (C + R) values per token and
layer instead of H * (Dqk + Dv).
"""
from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from dsjax import config as C
from dsjax.checkpoint import Checkpointer
from dsjax.cli import run_main
from dsjax.data import tokenizer as tk
from dsjax.train.optim import build_optimizer
from dsjax.train.step import init_model, init_state


def sample_logits(logits, key, temperature: float, top_p: float):
    """logits [B, V] -> token ids [B] int32. temperature 0 = argmax; top_p < 1 = nucleus sampling."""
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        cutoff_idx = jnp.sum(cum - probs < top_p, axis=-1) - 1
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx[:, None], axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, use_cache: bool = True, eos_id: int | None = None):
    """Extend prompt_ids [B, P] (int32) by max_new_tokens tokens.

    Returns (ids [B, P + n] numpy int32, decode seconds). With use_cache=False every step reruns
    the full forward over a fixed [B, P + max_new_tokens] buffer (causal, so later slots do not
    matter): the slow reference the cache is tested against. Stops early once every row has
    produced eos_id.
    """
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    B, P = prompt_ids.shape
    total = P + max_new_tokens
    if total > model.cfg.max_position_embeddings:
        raise ValueError(f"generate: prompt + max_new_tokens = {total} exceeds "
                         f"max_position_embeddings={model.cfg.max_position_embeddings}")
    key = jax.random.key(seed)
    buf = jnp.zeros((B, total), jnp.int32).at[:, :P].set(prompt_ids)

    if use_cache:
        prefill = jax.jit(lambda toks, cache: model.decode(toks, cache, 0))
        step = jax.jit(lambda tok, cache, pos: model.decode(tok, cache, pos))
        cache = model.init_cache(B, total)
        logits, cache = prefill(prompt_ids, cache)
        last = logits[:, -1]
    else:
        full = jax.jit(lambda toks: model(toks)[0])
        last = full(buf)[:, P - 1]
    t0 = time.time()
    done = np.zeros((B,), bool)
    n = 0
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        nxt = sample_logits(last, sub, temperature, top_p)
        pos = P + i
        buf = buf.at[:, pos].set(nxt)
        n += 1
        if eos_id is not None:
            done |= np.asarray(nxt) == eos_id
            if done.all():
                break
        if i == max_new_tokens - 1:
            break
        if use_cache:
            logits, cache = step(nxt[:, None], cache, jnp.asarray(pos, jnp.int32))
            last = logits[:, 0]
        else:
            last = full(buf)[:, pos]
    jax.block_until_ready(buf)
    return np.asarray(buf[:, :P + n]), time.time() - t0


def load_run(run_dir: str | Path, step: int | None = None):
    """Rebuild (model, tokenizer, config) from a training run directory's newest checkpoint."""
    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"generate: no checkpoints directory in {run_dir}")
    ck = Checkpointer(ckpt_dir, read_only=True)
    cfg = C.from_dict(ck.read_config(step))
    fns, params, rest = init_model(cfg)
    tx, _ = build_optimizer(cfg.optim, cfg.train.steps)
    abstract = jax.eval_shape(lambda: init_state(params, rest, tx))
    state, _, _, step = ck.restore(abstract, step)
    ck.close()
    model = fns.merge(state["params"], state["rest"])
    tok_path = run_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"generate: tokenizer not found: {tok_path}")
    tok = tk.wrap(Tokenizer.from_file(str(tok_path)), tok_path)
    return model, tok, cfg, step


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m dsjax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="training run directory (RUN_DIR)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the full forward each token")
    args = p.parse_args()
    model, tok, cfg, step = load_run(args.checkpoint, args.step)
    ids = tok.encode(args.prompt)
    if not ids:
        raise ValueError("generate: --prompt encodes to no tokens")
    out, secs = generate(model, np.asarray([ids], np.int32), args.max_new_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                         use_cache=not args.no_cache, eos_id=tok.eos_id)
    new = out.shape[1] - len(ids)
    print(tok.decode(out[0].tolist()))
    print(f"\n[{new} tokens in {secs:.2f}s = {new / max(secs, 1e-9):.1f} tokens/s; checkpoint step {step}; "
          f"{'no cache' if args.no_cache else 'MLA latent cache'}]")


if __name__ == "__main__":
    run_main("dsjax.generate", main)
