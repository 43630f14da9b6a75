"""Sampling from a trained run with the MLA latent KV cache.

`python -m dsjax.generate --checkpoint RUN_DIR --prompt "def fibonacci(n):" [--max-new-tokens 200]
[--temperature 0.8] [--top-p 0.95] [--seed 0] [--no-cache]`
`python -m dsjax.generate --checkpoint RUN_DIR --chat --prompt "What does json.dumps do?"`: the
message rendered with the run's chat template (generation prompt added); prints the answer.

Greedy when temperature is 0. The cache holds, per layer, the normed latent c_kv [B, S, C] and the
roped k_rope [B, S, R] (DeepSeek-V2 sec. 2.1.4), never expanded K/V: (C + R) values per token and
layer instead of H * (Dqk + Dv).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from dsjax import config as C
from dsjax.cli import run_main
from dsjax.data import tokenizer as tk
from dsjax.data.chat import ChatTokenizer
from dsjax.model import abstract_model
from dsjax.model.lora import merged_params
from dsjax.train import runs


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
    """Rebuild (model, tokenizer, config, step) from a training run directory's newest checkpoint
    (or `step`). A LoRA run's adapters are folded into the weights (one model, no adapter GEMMs)."""
    run_dir = Path(run_dir)
    if not (run_dir / "checkpoints").is_dir():
        raise FileNotFoundError(f"generate: no checkpoints directory in {run_dir}")
    cfg, params, rest, step = runs.restore_run(run_dir, step)
    if cfg.lora.rank > 0:
        params = merged_params(params, cfg.lora)
    fns, _, _ = abstract_model(cfg.model)
    model = fns.merge(params, rest)
    tok_path = run_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise FileNotFoundError(f"generate: tokenizer not found: {tok_path}")
    tok = tk.wrap(Tokenizer.from_file(str(tok_path)), tok_path)
    return model, tok, cfg, step


def chat_prompt(run_dir: str | Path, cfg: C.Config, message: str, system: str | None = None):
    """(prompt ids [P] int32, eos id) of one user message rendered with the run's chat template
    (RUN_DIR/tokenizer_config.json, or data.chat_template of its config) and the generation prompt.
    Raises FileNotFoundError / ValueError when the run has no chat template."""
    run_dir = Path(run_dir)
    template = cfg.data.chat_template
    if not (run_dir / "tokenizer_config.json").is_file() and template is None:
        raise FileNotFoundError(f"generate: --chat needs a chat template: {run_dir}/tokenizer_config.json "
                                f"is missing and the run's data.chat_template is not set")
    tok = ChatTokenizer.load(run_dir / "tokenizer.json", template if not
                             (run_dir / "tokenizer_config.json").is_file() else None)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    text = tok.template.render(messages, add_generation_prompt=True)
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    return np.asarray(ids, np.int32), tok.eos_id


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m dsjax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="training run directory (RUN_DIR)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--prompt", required=True, help="text to continue; with --chat, the user's message")
    p.add_argument("--chat", action="store_true",
                   help="render --prompt as a user message with the run's chat template and print the answer")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the full forward each token")
    args = p.parse_args()
    model, tok, cfg, step = load_run(args.checkpoint, args.step)
    eos_id = tok.eos_id
    if args.chat:
        ids, eos_id = chat_prompt(args.checkpoint, cfg, args.prompt, args.system)
        ids = ids.tolist()
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        raise ValueError("generate: --prompt encodes to no tokens")
    out, secs = generate(model, np.asarray([ids], np.int32), args.max_new_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                         use_cache=not args.no_cache, eos_id=eos_id)
    new = out.shape[1] - len(ids)
    if args.chat:  # the answer alone, up to its end-of-turn token
        answer = out[0, len(ids):].tolist()
        if eos_id in answer:
            answer = answer[:answer.index(eos_id)]
        print(tok.decode(answer))
    else:
        print(tok.decode(out[0].tolist()))
    print(f"\n[{new} tokens in {secs:.2f}s = {new / max(secs, 1e-9):.1f} tokens/s; checkpoint step {step}; "
          f"{'no cache' if args.no_cache else 'MLA latent cache'}]")


if __name__ == "__main__":
    run_main("dsjax.generate", main)
