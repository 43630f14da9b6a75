"""`python -m dsjax.train --config configs/tiny.yaml [--config more.yaml ...] [--set key=value ...]
[--resume | --resume-from-intact]`."""
from __future__ import annotations

import argparse
import json
import math

from dsjax.cli import add_config_args, load_config, run_main
from dsjax.train.loop import train


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m dsjax.train", description=__doc__)
    add_config_args(p)
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--resume-from-intact", action="store_true",
                   help="like --resume, but if the newest checkpoint is damaged (its files do not match "
                        "their checksums), continue from the newest intact one and move the damaged "
                        "steps to RUN_DIR/checkpoints-damaged/")
    args = p.parse_args()
    cfg = load_config(args)  # fails here, before any work, on a bad key or value
    summary = train(cfg, resume=args.resume, from_intact=args.resume_from_intact)
    val = summary["val_loss"]
    # tokens_per_s: the whole run's average over train_s (training-loop time without the first,
    # compiling step and without evaluations; see dsjax.train.loop.train)
    line = {"steps": summary["steps"], "wall_s": summary_number(summary["wall_s"], 1),
            "train_s": summary_number(summary.get("train_s", 0.0), 1),
            "tokens_per_s": summary_number(summary.get("tokens_per_s", 0.0), 0),
            "val_loss": {k: summary_number(v, 4) for k, v in val.items()},
            "run_dir": summary["run_dir"]}
    print("summary " + json.dumps(line))


def summary_number(x: float, digits: int):
    """x rounded for the summary line (an int for digits 0); None (JSON null) when x is not
    finite, e.g. a token count from a loader's non-finite loss mask, so that a finished run still
    prints its summary."""
    if not math.isfinite(x):
        return None
    return round(x) if digits == 0 else round(x, digits)


if __name__ == "__main__":
    run_main("dsjax.train", main)
