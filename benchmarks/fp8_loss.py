"""Loss of FP8 training against bf16: the same model, seed and batches trained with model.fp8=none
and model.fp8=blockwise (DeepSeek-V3 sec. 3.3: every linear layer's forward, dgrad and wgrad in
E4M3 with 1 x 128 / 128 x 128 scales; the report's relative loss gap stays below 0.25 %).

    python benchmarks/fp8_loss.py [--steps 300] [--batch 4] [--seq 2048] [--layers 4]
        [--state default|matched] [--every 20] [--out DIR] [--set KEY=VALUE ...]
    python benchmarks/fp8_loss.py --tiny [--out DIR] [--set ...]   # CPU smoke: configs/tiny.yaml

Model: train_step.py's V2-Lite geometry (`_step_common.V2_LITE`, --layers layers) with the
state of its dsjax row --state ("default": fp32 master weights and Adam moments; "matched": bf16),
on real text: the corpus of the default config (`data.train=[stdlib]`, the Python standard
library) tokenized with the byte-level BPE that dsjax trains and caches on first use
(`data.cache_dir`, vocabulary model.vocab_size = 102400 unless data.tokenizer_vocab_size says
otherwise), packed into --batch rows of --seq tokens. The batches of all --steps steps are read
once and fed to both runs; both start from the same initial weights (train.seed); the schedule
is the config's (optim.learning_rate 3e-4, 100 warmup steps, cosine to 0.1 x over --steps).

Output: per run, the loss of every step; a table every --every steps (step, loss bf16, loss
fp8, relative gap (fp8 - bf16) / bf16), the mean gap over the last 50 steps against the 0.25 %
target, each run's step time (after the first, compiling step); OUT/fp8_loss.md (the table),
OUT/fp8_loss.json (every loss) and OUT/fp8_loss.png (both curves; matplotlib if installed,
else a plain line plot without labels, `_plot_png.py`).

Default size: 300 steps of B4 x T2048 (2.5 M tokens per run). Estimate on an H100: ~70-120 ms
per bf16 step (train_step.py's rows); the fp8 step is ~0.1-0.2 s with FP8 kernels for every
GEMM, up to ~0.5 s where the routed experts' FP8 GEMMs run `pallas_kernels.fp8`'s XLA reference
(fp32 dots); plus model init and compilation (~1 min per run) and training the 102400-token BPE
on first use (~1-2 min): about 4-8 minutes for both runs.

`--tiny` (no GPU): configs/tiny.yaml's model, 6 steps of 4 x 64 tokens, last-3 mean instead of
last 50: checks that the table and the PNG are written, not the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from _plot_png import line_plot  # noqa: E402
from _step_common import DSJAX_ROWS, V2_LITE  # noqa: E402

TARGET = 0.0025  # DeepSeek-V3's relative loss error of FP8 training vs bf16
MODES = ("none", "blockwise")


def config_overrides(args) -> tuple[str | None, list[str]]:
    """(config file, overrides) of both runs, without model.fp8."""
    if args.tiny:
        return (os.path.join(ROOT, "configs", "tiny.yaml"),
                [f"data.seq_len={args.seq}", f"data.batch_size={args.batch}", f"train.steps={args.steps}"]
                + list(args.set))
    sets = V2_LITE + [f"model.num_hidden_layers={args.layers}", f"data.seq_len={args.seq}",
                      f"data.batch_size={args.batch}", f"train.steps={args.steps}"]
    return None, sets + DSJAX_ROWS[args.state] + list(args.set)


def read_batches(cfg, steps: int) -> list:
    """The first `steps` training batches (numpy dicts) of cfg.data: tokenizer trained or read
    from the cache, documents packed as the training loop packs them."""
    from dsjax.train.loop import build_data
    _, train, _ = build_data(cfg)
    return [next(train) for _ in range(steps)]


def train_losses(cfg, batches) -> tuple[list[float], float]:
    """Train cfg's model on `batches` as `dsjax.train.loop` does (mesh over every device, state
    created sharded, jitted step with donated state). Returns (loss of every step, mean seconds
    per step after the first)."""
    import jax

    from dsjax.train.loop import create_state, global_batch, jit_train_step, setup_parallel
    from dsjax.train.optim import build_optimizer
    from dsjax.train.step import init_model

    par = setup_parallel(cfg)
    fns, params, rest = init_model(cfg)
    tx, sched = build_optimizer(cfg.optim, len(batches))
    state, sh = create_state(fns, params, rest, tx, par, compute_dtype=cfg.model.dtype)
    del params, rest
    step = jit_train_step(cfg, fns, tx, sched, par, sh)
    losses, t1 = [], None
    for i, b in enumerate(batches):
        state, m = step(state, global_batch(par, b, cfg.train.grad_accum))
        losses.append(m["loss"])
        if i == 0:
            jax.block_until_ready(m["loss"])
            t1 = time.perf_counter()
    jax.block_until_ready(losses[-1])
    per_step = (time.perf_counter() - t1) / max(len(batches) - 1, 1)
    return [float(x) for x in jax.device_get(losses)], per_step


def gap_table(a: list[float], b: list[float], every: int, tail: int) -> tuple[list[str], float]:
    """Markdown lines of (step, loss a, loss b, (b - a) / a) at every `every` steps and the last
    step, and the relative gap of the means over the last `tail` steps."""
    lines = ["| step | loss bf16 | loss fp8 | relative gap |", "|---|---|---|---|"]
    n = len(a)
    for s in sorted(set(range(every, n + 1, every)) | {1, n}):
        lines.append(f"| {s} | {a[s - 1]:.4f} | {b[s - 1]:.4f} | {(b[s - 1] - a[s - 1]) / a[s - 1]:+.3%} |")
    ma, mb = sum(a[-tail:]) / tail, sum(b[-tail:]) / tail
    return lines, (mb - ma) / ma


def plot(path: str, a: list[float], b: list[float], title: str) -> str:
    """Both loss curves to the PNG `path`; returns what drew it."""
    steps = list(range(1, len(a) + 1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        line_plot(path, [(steps, a), (steps, b)])
        return "plain PNG (no matplotlib): blue bf16, red fp8"
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 1))
    ax.plot(steps, a, label="bf16 (model.fp8=none)", lw=1)
    ax.plot(steps, b, label="fp8 (model.fp8=blockwise)", lw=1)
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    ax2.plot(steps, [100 * (y - x) / x for x, y in zip(a, b)], lw=0.8, color="k")
    ax2.axhspan(-100 * TARGET, 100 * TARGET, color="g", alpha=0.15, label="+-0.25 %")
    ax2.set_ylabel("gap %")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return "matplotlib"


def run(args) -> int:
    from dsjax import config as C

    cfg_file, sets = config_overrides(args)
    cfgs = {mode: C.load(cfg_file, sets + [f"model.fp8={mode}"]) for mode in MODES}  # ConfigError: exit 2
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    batches = read_batches(cfgs["none"], args.steps)
    print(f"data: {args.steps} batches of {args.batch} x {args.seq} tokens read in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    losses, step_s = {}, {}
    for mode in MODES:
        t0 = time.perf_counter()
        losses[mode], step_s[mode] = train_losses(cfgs[mode], batches)
        print(f"model.fp8={mode}: {args.steps} steps in {time.perf_counter() - t0:.0f} s, "
              f"{step_s[mode] * 1e3:.1f} ms per step after the first; last loss "
              f"{losses[mode][-1]:.4f}", flush=True)
    a, b = losses["none"], losses["blockwise"]
    tail = min(50, max(1, len(a) // 2))
    every = args.every or max(1, len(a) // 20)
    lines, gap = gap_table(a, b, every, tail)
    what = (f"V2-Lite geometry, {args.layers} layers, {args.state} state" if not args.tiny
            else "configs/tiny.yaml") + f", B{args.batch} x T{args.seq}, {args.steps} steps"
    verdict = "within" if abs(gap) < TARGET else "outside"
    summary = (f"mean gap over the last {tail} steps: {gap:+.3%} ({verdict} the {TARGET:.2%} target); "
               f"step ms bf16 {step_s['none'] * 1e3:.1f}, fp8 {step_s['blockwise'] * 1e3:.1f}")
    text = "\n".join([f"FP8 (blockwise) vs bf16 training loss: {what}", ""] + lines + ["", summary])
    print("\n" + text)
    with open(os.path.join(args.out, "fp8_loss.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "fp8_loss.json"), "w") as f:
        json.dump({"config": what, "loss_bf16": a, "loss_fp8": b, "tail": tail, "tail_gap": gap,
                   "step_ms": {m: s * 1e3 for m, s in step_s.items()}}, f)
    drawn = plot(os.path.join(args.out, "fp8_loss.png"), a, b, what)
    print(f"wrote {args.out}/fp8_loss.md, fp8_loss.json, fp8_loss.png ({drawn})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="steps per run (300; --tiny 6)")
    p.add_argument("--batch", type=int, default=None, help="rows per step (4; --tiny 4)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (2048; --tiny 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--state", default="default", choices=("default", "matched"),
                   help="train_step.py's dsjax row whose state numerics both runs use")
    p.add_argument("--every", type=int, default=0, help="table row every N steps (default steps / 20)")
    p.add_argument("--out", default="fp8_loss_out", help="directory for fp8_loss.{md,json,png}")
    p.add_argument("--set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="dsjax config overrides for both runs")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on configs/tiny.yaml")
    args = p.parse_args(argv)
    for name, full, tiny in (("steps", 300, 6), ("batch", 4, 4), ("seq", 2048, 64)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive")
    if args.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from dsjax.cli import run_main
    rc = []
    run_main("fp8_loss", lambda: rc.append(run(args)))
    return rc[0] if rc else 1


if __name__ == "__main__":
    sys.exit(main())
