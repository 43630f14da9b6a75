"""Convert between Hugging Face DeepSeek-V2/V3 directories and dsjax run directories.

  python -m dsjax.convert --from-hf HF_DIR --out RUN_DIR [--config X.yaml ...] [--set k=v ...]
  python -m dsjax.convert --to-hf RUN_DIR --out HF_DIR [--step N] [--dtype bfloat16|float32|fp8]

`--from-hf` writes RUN_DIR/{config.yaml, tokenizer.json (when HF_DIR has one),
checkpoints/0/{state,data,config}}: the model section comes from HF_DIR/config.json, the other
sections (and dsjax numerics such as model.dtype) from --config/--set. The state is a full train
state at step 0 (fresh optimizer moments), so `python -m dsjax.generate --checkpoint RUN_DIR`
works; the data item is empty (no loader position yet). To *train* from HF weights prefer
`--set train.init_from_hf=HF_DIR` on a new run.
`--to-hf` writes config.json, generation_config.json, sharded safetensors (+ index) and the run's
tokenizer.json and tokenizer_config.json, loadable by `transformers.AutoModelForCausalLM.
from_pretrained`; config.json and generation_config.json carry the tokenizer's EOS / pad / BOS ids
as `dsjax.generate` picks them, so HF `generate` stops where dsjax's does. A LoRA run is written
with its adapters merged into the weights, and its adapters alone in HF_DIR/adapter/ (PEFT format,
`dsjax.hf.adapters`: `PeftModel.from_pretrained` on the base model gives the merged model).
`--dtype fp8` writes DeepSeek-V3's FP8 layout (`dsjax.hf.export`): the decoder's linear weights
float8_e4m3fn [out, in] + float32 `weight_scale_inv` per 128 x 128 block, `quantization_config`
in config.json, everything else bfloat16 (router float32); the PEFT adapter, if any, in bfloat16.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
from pathlib import Path


from dsjax import config as C
from dsjax.checkpoint import Checkpointer
from dsjax.cli import run_main
from dsjax.hf import load_hf, save_hf
from dsjax.hf.adapters import save_adapters
from dsjax.model.lora import merged_params
from dsjax.train import runs
from dsjax.train.optim import build_optimizer
from dsjax.train.step import init_state, initial_loss_scale

log = logging.getLogger("dsjax.convert")


def from_hf(hf_dir: str | Path, out: str | Path, config: str | list[str] | None = None,
            overrides: tuple[str, ...] = ()) -> Path:
    """HF directory -> dsjax run directory with a step-0 checkpoint. Returns RUN_DIR.

    config: None, a YAML file or a list of them (applied left to right, as `dsjax.config.load`)."""
    hf_dir, out = Path(hf_dir), Path(out)
    base = C.load(config, list(overrides))
    mcfg, _, params, rest = load_hf(hf_dir, base.model)
    train = dataclasses.replace(base.train, run_dir=str(out))
    data = base.data
    tok_src = hf_dir / "tokenizer.json"
    if tok_src.is_file():
        data = dataclasses.replace(data, tokenizer=str((out / "tokenizer.json").absolute()))
    if data.seq_len > mcfg.max_position_embeddings:
        data = dataclasses.replace(data, seq_len=mcfg.max_position_embeddings)
    cfg = dataclasses.replace(base, model=mcfg, train=train, data=data)
    C.validate(cfg)
    ckpt_dir = out / "checkpoints"
    if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        raise FileExistsError(f"convert: {ckpt_dir} already holds checkpoints")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(C.dump_yaml(cfg))
    if tok_src.is_file():
        shutil.copyfile(tok_src, out / "tokenizer.json")
    else:
        log.warning("convert: %s has no tokenizer.json; dsjax.generate needs RUN_DIR/tokenizer.json", hf_dir)
    tx, _ = build_optimizer(cfg.optim, cfg.train.steps)
    state = init_state(params, rest, tx, initial_loss_scale(cfg))
    ck = Checkpointer(ckpt_dir, dataclasses.replace(cfg.checkpoint, async_save=False))
    ck.save(0, state, {}, C.to_dict(cfg))
    ck.wait()
    ck.close()
    return out


def restore_params(run_dir: str | Path, step: int | None = None):
    """(Config, params, rest, step) of a run's checkpoint, without a random init. `params` is the
    full tree (trainable and frozen leaves joined; a LoRA run's adapters included)."""
    return runs.restore_run(run_dir, step)


def to_hf(run_dir: str | Path, out: str | Path, step: int | None = None, dtype: str = "bfloat16",
          max_shard_bytes: int = 5 * 2**30) -> Path:
    """dsjax run directory -> HF directory. Returns the HF directory.

    A LoRA run (lora.rank > 0) is exported merged (W + B A alpha / r per module and per routed
    expert, `dsjax.model.lora.merged_params`), and its adapters alone are written beside it in
    PEFT's format (OUT/adapter/: adapter_model.safetensors, adapter_config.json,
    `dsjax.hf.adapters`)."""
    cfg, params, rest, step = restore_params(run_dir, step)
    tok = Path(run_dir) / "tokenizer.json"
    merged = merged_params(params, cfg.lora) if cfg.lora.rank > 0 else params
    tok_cfg = Path(run_dir) / "tokenizer_config.json"  # a chat run's template and special tokens
    save_hf(out, cfg.model, merged, rest, dtype=dtype, tokenizer=tok if tok.is_file() else None,
            tokenizer_config=tok_cfg if tok_cfg.is_file() else None, max_shard_bytes=max_shard_bytes)
    if cfg.lora.rank > 0:
        save_adapters(Path(out) / "adapter", cfg.model, cfg.lora, params, rest,
                      dtype="bfloat16" if dtype == "fp8" else dtype)
        log.info("convert: adapters of %s step %d merged into %s and saved alone in %s/adapter",
                 run_dir, step, out, out)
    log.info("convert: wrote %s from %s step %d", out, run_dir, step)
    return Path(out)


def _bytes(text: str) -> int:
    t = text.strip().upper()
    for unit, mult in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * mult)
    return int(t)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m dsjax.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="HF_DIR", help="HF DeepSeek-V2/V3 directory to import")
    src.add_argument("--to-hf", metavar="RUN_DIR", help="dsjax run directory to export")
    p.add_argument("--out", required=True, help="RUN_DIR (with --from-hf) or HF_DIR (with --to-hf)")
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML file for the non-model sections (--from-hf); repeatable, applied left "
                        "to right (a file's 'base:' first), --set last")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (--to-hf; default newest)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "fp8"),
                   help="--to-hf weights; fp8: DeepSeek-V3's FP8 layout (e4m3 + weight_scale_inv per 128x128 block)")
    p.add_argument("--max-shard-size", default="5GB", help="--to-hf shard size, e.g. 5GB, 500MB")
    args = p.parse_args()
    if args.from_hf and not Path(args.from_hf).exists():
        raise FileNotFoundError(f"--from-hf: {args.from_hf} does not exist")
    if args.to_hf and not (Path(args.to_hf) / "checkpoints").is_dir():
        what = "does not exist" if not Path(args.to_hf).exists() else "has no checkpoints/ directory"
        raise FileNotFoundError(f"--to-hf: {args.to_hf} {what} (a dsjax run directory)")
    if args.from_hf:
        out = from_hf(args.from_hf, args.out, args.config or None, tuple(args.set))
        print(f"wrote dsjax run {out} (step 0) from {args.from_hf}")
    else:
        out = to_hf(args.to_hf, args.out, args.step, args.dtype, _bytes(args.max_shard_size))
        print(f"wrote HF directory {out} from {args.to_hf}")


if __name__ == "__main__":
    run_main("dsjax.convert", main)
