"""Generation quality of the MLA latent cache on a trained model: the int8 latent against the bf16
cache, and attention sinks + a sliding window on a stream far longer than the window.

    python benchmarks/generate_quality.py [--checkpoint RUN_DIR] [--step N] [--rows 16]
        [--continuations 16] [--prompt-tokens 32] [--new-tokens 32] [--window 64] [--sink-tokens 4]
        [--stream-factor 20] [--stream-rows 4] [--train-steps N] [--json FILE]

Without --checkpoint it first trains configs/tiny.yaml as the README's first command does
(`python -m dsjax.train --config configs/tiny.yaml`, 700 steps, minutes on CPU) into a temporary
directory; `--train-steps` shortens that run.

Every negative log-likelihood goes through the cache as generation uses it
(`dsjax.model.decode.stream_nll`): token 0 prefilled, then one jitted decode step per token,
teacher-forced, each prediction read from the cache (its dtype, sinks and window).

Text: the run's validation split (`dsjax.train.loop.build_data` with the run's config and
tokenizer), each document followed by EOS as the training loader packs them.
- Cache dtype: `--rows` rows of seq_len + 1 tokens (the run's `data.seq_len`, the positions the
  model was trained on), each from the start of a validation document that long. Perplexity with
  the float32 (the tiny model's compute dtype), bfloat16 and int8 caches, the int8 change against
  bfloat16, and the teacher-forced top-1 agreement int8 vs bfloat16. Greedy continuations:
  `--continuations` prompts (a row's first `--prompt-tokens` tokens) extended by `--new-tokens`
  tokens with each cache (`dsjax.generate.generate`): the share of identical continuations, of
  new tokens before the first difference, and of equal tokens position by position.
- Streaming: `--stream-rows` streams of stream_factor x window + 1 tokens of the concatenated
  validation text, each starting at a validation document (the longest ones first, so a stream
  runs through as few document boundaries as the split allows). Perplexity per chunk of `window`
  predictions for full attention (a cache of every token; past the run's seq_len its positions
  are beyond those trained, and it is left out when the stream passes max_position_embeddings),
  `--sink-tokens` sinks + `window` (StreamingLLM) and a window of the same slots without sinks
  (sink_tokens + window). In-window perplexity: the first sink_tokens + window predictions, where
  all three equal full attention; stream perplexity: every later prediction.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def train_tiny(out_dir: Path, steps: int | None) -> Path:
    """Train configs/tiny.yaml (the README's first command) into out_dir/tiny; returns the run dir."""
    run = out_dir / "tiny"
    cmd = [sys.executable, "-m", "dsjax.train", "--config", str(ROOT / "configs" / "tiny.yaml"),
           "--set", f"train.run_dir={run}", "--set", "train.progress=false"]
    if steps is not None:
        cmd += ["--set", f"train.steps={steps}"]
    print("training:", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return run


def validation_documents(run_dir: Path, cfg) -> list[np.ndarray]:
    """The run's validation documents as token arrays [n_i] int32, each ending in EOS.
    Raises ValueError when the run's data has no validation split."""
    from dsjax.train import loop
    tok, _, val = loop.build_data(cfg, run_tokenizer=run_dir / "tokenizer.json")
    if val is None:
        raise ValueError(f"{run_dir}: the run's data has no validation split (data.validation / data.val_fraction)")
    out = []
    for i in range(0, len(val.docs), 256):
        out += [np.asarray(ids + [tok.eos_id], np.int32) for ids in tok.encode_batch(val.docs[i:i + 256])]
    return out


def document_rows(docs: list[np.ndarray], n_rows: int, length: int) -> np.ndarray:
    """[n_rows, length] int32: the first `length` tokens of the first n_rows documents that long.
    Raises ValueError when fewer documents are that long."""
    rows = [d[:length] for d in docs if len(d) >= length][:n_rows]
    if len(rows) < n_rows:
        raise ValueError(f"only {len(rows)} validation documents have {length} tokens (asked for {n_rows} rows)")
    return np.stack(rows)


def stream_rows(docs: list[np.ndarray], n_rows: int, length: int) -> np.ndarray:
    """[n_rows, length] int32 from the concatenated validation text (document order), row r starting
    at the r-th longest document. Raises ValueError when the text is shorter than `length` tokens."""
    text = np.concatenate(docs)
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    order = np.argsort([-len(d) for d in docs], kind="stable")
    if len(text) < length or len(docs) < n_rows:
        raise ValueError(f"the validation text ({len(text)} tokens, {len(docs)} documents) is too short for "
                         f"{n_rows} streams of {length} tokens")
    return np.stack([np.roll(text, -starts[i])[:length] for i in order[:n_rows]])  # past its end: its start


def ppl(nll) -> float:
    """Perplexity exp(mean NLL) of an array of nats."""
    return float(math.exp(float(np.mean(nll))))


def cache_dtype_quality(model, docs, seq_len: int, args) -> dict:
    """Validation perplexity per cache dtype, teacher-forced top-1 agreement int8 vs bfloat16, and
    greedy continuations int8 vs bfloat16 (see the module doc)."""
    from dsjax import generate as G
    from dsjax.model import decode as D
    rows = document_rows(docs, max(args.rows, args.continuations), seq_len + 1)
    res, top = {}, {}
    for name in ("float32", "bfloat16", "int8"):
        nll, top[name] = D.stream_nll(model, rows[:args.rows], D.CacheConfig(name))
        res[f"ppl_{name}"] = ppl(nll)
    res["int8_vs_bf16_ppl_change"] = res["ppl_int8"] / res["ppl_bfloat16"] - 1
    res["teacher_forced_top1_agreement"] = float(np.mean(top["int8"] == top["bfloat16"]))
    prompts = rows[:args.continuations, :args.prompt_tokens]
    gen = {name: G.generate(model, prompts, args.new_tokens, kv_cache_dtype=name)[0][:, args.prompt_tokens:]
           for name in ("bfloat16", "int8")}
    same = gen["int8"] == gen["bfloat16"]
    prefix = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
    res.update(continuations=len(prompts), identical_continuations=float(np.mean(same.all(1))),
               greedy_prefix_agreement=float(np.mean(prefix) / same.shape[1]),
               greedy_position_agreement=float(np.mean(same)))
    return res


def recomputed_window_nll(model, toks, S: int, chunk: int = 256) -> np.ndarray:
    """The in-window reference: nll [B, N - 1] with prediction t made by the full forward over the
    last S tokens (tokens[t - S + 1 .. t] at positions 0..S-1; all of tokens[:t + 1] for t < S)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    gd, st = nnx.split(model)
    B, N = toks.shape
    fwd = jax.jit(lambda st, x: jax.nn.log_softmax(nnx.merge(gd, st)(x)[0].astype(jnp.float32), -1))
    lp = np.asarray(fwd(st, jnp.asarray(toks[:, :S])))  # predictions 0..S-1 (their contexts fit in S)
    out = [-np.take_along_axis(lp[:, :-1], toks[:, 1:S, None], -1)[..., 0],
           -np.take_along_axis(lp[:, -1], toks[:, S, None], -1)]
    last = jax.jit(lambda st, x: fwd(st, x)[:, -1])
    starts = [(b, t) for t in range(1, N - S) for b in range(B)]  # window tokens[t .. t + S - 1] predicts t + S
    nll = np.zeros((B, N - S - 1), np.float32)
    for i in range(0, len(starts), chunk):
        part = starts[i:i + chunk]
        idx = np.asarray([np.arange(t, t + S) + b * N for b, t in part + part[-1:] * (chunk - len(part))])
        lp_last = np.asarray(last(st, jnp.asarray(toks.reshape(-1)[idx])))[:len(part)]
        for (b, t), row in zip(part, lp_last):
            nll[b, t - 1] = -row[toks[b, t + S]]
    return np.concatenate(out + [nll], axis=1)


def streaming_quality(model, docs, args) -> dict:
    """Per-chunk perplexities of a long stream: full attention, sinks + window, the same slots
    without sinks, and the recomputed window of the same slots (the in-window reference)."""
    from dsjax.model import decode as D
    W, k = args.window, args.sink_tokens
    S = k + W
    N = args.stream_factor * W + 1
    toks = stream_rows(docs, args.stream_rows, N)
    caches = {f"{k} sinks + window {W}": D.CacheConfig(sink_tokens=k, window=W),
              f"window {S}, no sinks": D.CacheConfig(window=S)}
    notes = []
    if N <= model.cfg.max_position_embeddings:
        caches = {"full attention": D.CacheConfig(), **caches}
    else:
        notes.append(f"full attention left out: the stream's {N} tokens pass max_position_embeddings="
                     f"{model.cfg.max_position_embeddings}")
    nlls, seconds = {}, {}
    for name, cc in caches.items():
        t0 = time.time()
        nlls[name], _ = D.stream_nll(model, toks, cc)
        seconds[name] = round(time.time() - t0, 1)
    ref = f"window {S} recomputed (reference)"
    t0 = time.time()
    nlls[ref] = recomputed_window_nll(model, toks, S)
    seconds[ref] = round(time.time() - t0, 1)
    in_window = ppl(nlls[ref][:, S:])
    chunks = {name: [ppl(x[:, c * W:(c + 1) * W]) for c in range(args.stream_factor)] for name, x in nlls.items()}
    summary = {name: {"first_ppl": ppl(x[:, :S]), "stream_ppl": ppl(x[:, S:]),
                      "stream_over_in_window": ppl(x[:, S:]) / in_window, "seconds": seconds[name]}
               for name, x in nlls.items()}
    return {"tokens_per_stream": N, "streams": len(toks), "slots": S, "chunk_tokens": W, "chunks": chunks,
            "in_window_ppl": in_window, "summary": summary, "notes": notes}


def print_report(run_dir, step, seq_len, max_pos, q: dict, s: dict) -> None:
    print(f"\nrun {run_dir}, checkpoint step {step}; trained on {seq_len}-token rows, "
          f"max_position_embeddings={max_pos}")
    print(f"\n| cache (validation: {q['rows']} rows x {seq_len} predictions) | perplexity |\n|---|---|")
    for name in ("float32", "bfloat16", "int8"):
        print(f"| {name} | {q[f'ppl_{name}']:.4f} |")
    print(f"\nint8 vs bfloat16: perplexity {100 * q['int8_vs_bf16_ppl_change']:+.3f} %, teacher-forced top-1 "
          f"agreement {q['teacher_forced_top1_agreement']:.4f}; greedy continuations ({q['continuations']} "
          f"prompts x {q['new_tokens']} new tokens): identical {q['identical_continuations']:.3f}, new tokens "
          f"before the first difference {q['greedy_prefix_agreement']:.3f}, equal position by position "
          f"{q['greedy_position_agreement']:.3f}")
    names = list(s["chunks"])
    W = s["chunk_tokens"]
    print(f"\nstream: {s['streams']} x {s['tokens_per_stream']} tokens; perplexity per chunk of {W} predictions")
    print("| predictions | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for c in range(len(s["chunks"][names[0]])):
        print(f"| {c * W}-{(c + 1) * W - 1} | " + " | ".join(f"{s['chunks'][n][c]:.3f}" for n in names) + " |")
    S = s["slots"]
    print(f"\n| cache | predictions 0-{S - 1} | predictions {S}-{s['tokens_per_stream'] - 2} (stream) "
          f"| stream / in-window | seconds |\n|---|---|---|---|---|")
    for n in names:
        r = s["summary"][n]
        print(f"| {n} | {r['first_ppl']:.3f} | {r['stream_ppl']:.3f} | {r['stream_over_in_window']:.3f} "
              f"| {r['seconds']} |")
    print(f"in-window perplexity: {s['in_window_ppl']:.3f} (the recomputed window's, predictions {S} on)")
    for note in s["notes"]:
        print(note)


def run(args) -> dict:
    from dsjax import generate as G
    for name in ("rows", "continuations", "prompt_tokens", "new_tokens", "window", "stream_factor", "stream_rows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be at least 1 (got {getattr(args, name)})")
    if args.sink_tokens < 0:
        raise ValueError(f"--sink-tokens: must be at least 0 (got {args.sink_tokens})")
    with tempfile.TemporaryDirectory(prefix="dsjax-genq-") as tmp:
        run_dir = Path(args.checkpoint) if args.checkpoint else train_tiny(Path(tmp), args.train_steps)
        model, _, cfg, step = G.load_run(run_dir, args.step)
        seq_len = cfg.data.seq_len
        if args.prompt_tokens > seq_len:
            raise ValueError(f"--prompt-tokens: at most the run's data.seq_len={seq_len} (got {args.prompt_tokens})")
        docs = validation_documents(run_dir, cfg)
        q = cache_dtype_quality(model, docs, seq_len, args)
        q.update(rows=args.rows, new_tokens=args.new_tokens)
        s = streaming_quality(model, docs, args)
        print_report(run_dir, step, seq_len, cfg.model.max_position_embeddings, q, s)
    out = {"run_dir": str(run_dir), "step": step, "cache_dtype": q, "streaming": s}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def parse(argv=None) -> argparse.Namespace:
    """The command line's options (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="a training run directory (default: train configs/tiny.yaml)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--train-steps", type=int, default=None, help="steps of the run trained without --checkpoint")
    p.add_argument("--rows", type=int, default=16, help="validation rows for the cache-dtype perplexities")
    p.add_argument("--continuations", type=int, default=16, help="greedy continuations int8 vs bfloat16")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sink-tokens", type=int, default=4)
    p.add_argument("--stream-factor", type=int, default=20, help="stream length in windows")
    p.add_argument("--stream-rows", type=int, default=4)
    p.add_argument("--json", default="", help="also write the results to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    from dsjax.cli import run_main
    out = []
    run_main("generate_quality", lambda: out.append(run(args)))
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
