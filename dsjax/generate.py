"""Sampling from a trained run with the MLA latent KV cache.

`python -m dsjax.generate --checkpoint RUN_DIR --prompt "def fibonacci(n):" [--max-new-tokens 200]
[--temperature 0.8] [--top-p 0.95] [--seed 0] [--no-cache]`
`python -m dsjax.generate --checkpoint RUN_DIR --chat --prompt "What does json.dumps do?"`: the
message rendered with the run's chat template (generation prompt added); prints the answer.
`python -m dsjax.generate --checkpoint RUN_DIR --prompts-file prompts.jsonl [--batch-size 8]`: prompts
of any lengths in batches (right-padded, each row at its own positions, each stopping at its EOS);
one JSON line per prompt on stdout, the summary (tokens/s, cache bytes) on stderr.
Cache options: `--kv-cache-dtype bfloat16|float32|int8`, `--window N [--sink-tokens K]`,
`--expanded` (see `dsjax.model.decode`).

Greedy when temperature is 0. The cache holds, per layer, the normed latent c_kv [B, S, C] and the
shared RoPE key k_rope [B, S, R] (DeepSeek-V2 sec. 2.1.4), never expanded K/V: (C + R) values per
token and layer instead of H * (Dqk + Dv). Prefill expands K/V (compute-bound); decode steps attend
over the latent with W_UK absorbed into the query and W_UV into the output.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from dsjax import config as C
from dsjax.cli import run_main
from dsjax.data import tokenizer as tk
from dsjax.data.chat import ChatTokenizer
from dsjax.model import abstract_model
from dsjax.model import decode as D
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


def generate(model, prompt_ids, max_new_tokens: int, *, lengths=None, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, use_cache: bool = True, eos_id: int | None = None,
             pad_id: int = -1, kv_cache_dtype: str | None = None, sink_tokens: int = 0,
             window: int | None = None, absorb: bool = True):
    """Extend each row of prompt_ids [B, P] (int32) by up to max_new_tokens tokens.

    lengths: [B] ints, each row's prompt length when rows are right-padded (default: all P);
      every row keeps its own positions (token n of a row at position n).
    eos_id: a row stops after producing it (the EOS is kept); the loop ends once every row has.
    kv_cache_dtype, sink_tokens, window, absorb: `dsjax.model.decode.CacheConfig` (None: the
      model's compute dtype; int8; StreamingLLM sinks + sliding window, which lets generation
      run past max_position_embeddings; absorbed or expanded decode steps).
    use_cache=False: every step reruns the full forward over a fixed [B, P + max_new_tokens + 1]
      buffer (causal, so later slots do not matter): the slow reference the cache is tested
      against; it takes no cache options.

    Returns (ids [B, W] numpy int32, decode seconds): row b is its prompt, then its new tokens,
    then pad_id up to W = the longest row. A windowed cache shorter than a prompt prefills the
    first sink_tokens + window tokens and feeds the rest one step at a time (each token sees the
    sinks and the window before it); the seconds exclude the prefill.
    Raises ValueError on bad lengths, too long a request for a full cache, or a bad cache option.
    """
    prompt = np.asarray(prompt_ids, np.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"generate: prompt_ids must be [B, P] with P >= 1 (got shape {prompt.shape})")
    B, P = prompt.shape
    lens = np.full((B,), P, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    if lens.shape != (B,) or lens.min() < 1 or lens.max() > P:
        raise ValueError(f"generate: lengths must be [B={B}] values in 1..{P} (got {lens.tolist()})")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be at least 1 (got {max_new_tokens})")
    cc = D.CacheConfig(kv_cache_dtype, sink_tokens, window, absorb)
    max_pos = model.cfg.max_position_embeddings
    total = P + max_new_tokens
    if window is None and total > max_pos:
        raise ValueError(f"generate: prompt + max_new_tokens = {total} exceeds "
                         f"max_position_embeddings={max_pos} (a window, --window, caps the positions)")
    if window is not None and cc.slots(total) > max_pos:
        raise ValueError(f"generate: sink_tokens + window = {cc.slots(total)} exceeds "
                         f"max_position_embeddings={max_pos}")
    if not use_cache and cc != D.CacheConfig():
        raise ValueError("generate: use_cache=False (--no-cache) takes no cache options")
    graphdef, state = nnx.split(model)
    lens_d = jnp.asarray(lens)
    rows = jnp.arange(B)
    eos = -1 if eos_id is None else int(eos_id)

    @jax.jit
    def choose(logits, key, cur, buf, done, ngen):
        # the token at index cur of each row: its prompt token, else a sample of `logits`
        key, sub = jax.random.split(key)
        sampled = sample_logits(logits, sub, temperature, top_p)
        in_prompt = cur < lens_d
        nxt = jnp.where(in_prompt, buf[rows, cur], sampled)
        active = ~in_prompt & ~done & (ngen < max_new_tokens)
        buf = buf.at[rows, cur].set(jnp.where(active, nxt, buf[rows, cur]))
        return nxt, key, buf, done | (active & (nxt == eos)), ngen + active

    buf = jnp.asarray(np.pad(prompt, ((0, 0), (0, max_new_tokens + 1))))
    if use_cache:
        P0 = min(P, cc.slots(total))
        cur = jnp.asarray(np.minimum(lens, P0))
        cache = D.init_cache(model.cfg, B, cc.slots(total), cc)
        prefill = jax.jit(lambda st, toks, c, last: D.prefill(nnx.merge(graphdef, st), toks, c, last, cc),
                          donate_argnums=(2,))
        step = jax.jit(lambda st, tok, c, cur: D.decode_step(nnx.merge(graphdef, st), tok, c, cur, cc),
                       donate_argnums=(2,))
        logits, cache = prefill(state, buf[:, :P0], cache, cur - 1)
    else:
        cur = jnp.asarray(lens)
        full = jax.jit(lambda st, b, at: nnx.merge(graphdef, st)(b)[0][rows, at])
        logits = full(state, buf, cur - 1)
    n_iter = int(np.max(lens - np.asarray(cur))) + max_new_tokens
    key = jax.random.key(seed)
    done = jnp.zeros((B,), bool)
    ngen = jnp.zeros((B,), jnp.int32)
    jax.block_until_ready(logits)
    t0 = time.time()
    for it in range(n_iter):
        nxt, key, buf, done, ngen = choose(logits, key, cur, buf, done, ngen)
        if it == n_iter - 1:
            break
        if eos_id is not None and bool(jnp.all(done | (ngen >= max_new_tokens))):
            break
        if use_cache:
            logits, cache = step(state, nxt[:, None], cache, cur)
        else:
            logits = full(state, buf, cur)
        cur = cur + 1
    ids = np.array(buf)
    secs = time.time() - t0
    end = lens + np.asarray(ngen)
    ids[np.arange(ids.shape[1])[None, :] >= end[:, None]] = pad_id
    return ids[:, :int(end.max())], secs


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: JSONL (name ends in .jsonl: one object per line with a string
    "prompt" field) or plain text (one prompt per line); blank lines are skipped.
    Raises FileNotFoundError, or ValueError naming FILE:LINE for a bad line or FILE when empty."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"generate: --prompts-file not found: {path}")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.suffix != ".jsonl":
                prompts.append(line.rstrip("\r\n"))
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{path}:{n}: expected an object with a string \"prompt\" field")
            prompts.append(obj["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


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
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text to continue; with --chat, the user's message")
    src.add_argument("--prompts-file", metavar="F",
                     help="prompts to run in batches: one per line, or JSONL (F ends in .jsonl) objects "
                          "with a \"prompt\" field; prints one JSON line per prompt")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch with --prompts-file")
    p.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message with the run's chat template and print the answer")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-cache", action="store_true", help="recompute the full forward each token")
    p.add_argument("--kv-cache-dtype", choices=D.KV_CACHE_DTYPES, default=None,
                   help="latent cache dtype (default: the model's compute dtype); int8: a float32 scale per token")
    p.add_argument("--window", type=int, default=None,
                   help="keep only the last N tokens' latents (ring buffer; with --sink-tokens, StreamingLLM): "
                        "a fixed cache that generates past max_position_embeddings")
    p.add_argument("--sink-tokens", type=int, default=0, help="first tokens always kept (needs --window)")
    p.add_argument("--expanded", action="store_true",
                   help="decode steps expand K/V through kv_b_proj instead of attending over the latent")
    args = p.parse_args()
    # bad options fail before the checkpoint is read
    cc = D.CacheConfig(args.kv_cache_dtype, args.sink_tokens, args.window, not args.expanded)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be at least 1 (got {args.max_new_tokens})")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: must be at least 1 (got {args.batch_size})")
    if args.no_cache and cc != D.CacheConfig(absorb=not args.expanded):
        raise ValueError("--no-cache takes no --kv-cache-dtype, --window or --sink-tokens")
    texts = [args.prompt] if args.prompts_file is None else read_prompts(args.prompts_file)
    model, tok, cfg, step = load_run(args.checkpoint, args.step)
    eos_id = tok.eos_id
    prompts = []
    for n, text in enumerate(texts, 1):
        if args.chat:
            ids, eos_id = chat_prompt(args.checkpoint, cfg, text, args.system)
            ids = ids.tolist()
        else:
            ids = tok.encode(text)
        if not ids:
            where = "--prompt" if args.prompts_file is None else f"{args.prompts_file}: prompt {n}"
            raise ValueError(f"generate: {where} encodes to no tokens")
        prompts.append(ids)
    opts = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed, use_cache=not args.no_cache,
                eos_id=eos_id, kv_cache_dtype=cc.dtype, sink_tokens=cc.sink_tokens, window=cc.window,
                absorb=cc.absorb)
    new_total, secs_total, cache_bytes = 0, 0.0, 0
    for b0 in range(0, len(prompts), args.batch_size):
        batch = prompts[b0:b0 + args.batch_size]
        P = max(len(x) for x in batch)
        ids = np.zeros((len(batch), P), np.int32)
        for r, x in enumerate(batch):
            ids[r, :len(x)] = x
        lens = [len(x) for x in batch]
        out, secs = generate(model, ids, args.max_new_tokens, lengths=lens, **opts)
        secs_total += secs
        if not args.no_cache:
            cache_bytes = max(cache_bytes, D.cache_nbytes(D.cache_shapes(
                cfg.model, len(batch), cc.slots(P + args.max_new_tokens), cc)))
        for r, x in enumerate(batch):
            row = out[r][out[r] >= 0].tolist()
            new = row[len(x):]
            new_total += len(new)
            if args.chat:  # the answer alone, up to its end-of-turn token
                text = tok.decode(new[:new.index(eos_id)] if eos_id in new else new)
            else:
                text = tok.decode(row)
            if args.prompts_file is None:
                print(text)
            else:
                print(json.dumps({"prompt": texts[b0 + r], "completion": text, "new_tokens": len(new)}), flush=True)
    kind = "no cache" if args.no_cache else (
        f"MLA latent cache {cc.dtype or cfg.model.dtype}, {'absorbed' if cc.absorb else 'expanded'}"
        + (f", {cc.sink_tokens} sinks + window {cc.window}" if cc.window else "")
        + f", {cache_bytes} bytes")
    summary = (f"[{new_total} tokens in {secs_total:.2f}s = {new_total / max(secs_total, 1e-9):.1f} tokens/s; "
               f"checkpoint step {step}; {kind}]")
    if args.prompts_file is None:
        print("\n" + summary)
    else:
        print(summary, file=sys.stderr)


if __name__ == "__main__":
    run_main("dsjax.generate", main)
