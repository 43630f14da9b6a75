"""Shared command-line plumbing: config arguments and one-line errors."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from dsjax import config as C
from dsjax.checkpoint import CheckpointError
from dsjax.errors import RunStopped


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML file applied over the defaults (e.g. configs/tiny.yaml); repeatable: "
                        "files apply left to right, a file's top-level 'base: other.yaml' (relative "
                        "to it) first, and --set last")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set optim.learning_rate=1e-5 (repeatable)")


def load_config(args) -> C.Config:
    return C.load(args.config, args.overrides)


def run_main(prog: str, fn) -> None:
    """Run fn(); turn user errors into one line on stderr and exit status 2, and faults that
    stop a running job (`RunStopped`: a failed checkpoint write, non-finite training) into one
    line and exit status 1."""
    fmt = logging.Formatter("%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.basicConfig(level=logging.WARNING)
    for h in logging.getLogger().handlers:  # also the one an import-time library log call installed
        if type(h) is logging.StreamHandler:
            h.setFormatter(fmt)
    logging.getLogger("dsjax").setLevel(logging.INFO)
    # orbax logs every checkpoint step through absl at INFO, and jax warns about absent TPU
    # backends on CPU machines: keep the console to our progress bar and messages.
    try:
        from absl import logging as absl_logging

        # FATAL: orbax also logs a failed background save as multi-line ERROR tracebacks; the
        # failure reaches us as CheckpointError and is reported once, on one line
        absl_logging.set_verbosity(absl_logging.FATAL)
    except ImportError:  # pragma: no cover
        pass
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    try:
        fn()
    except (C.ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except CheckpointError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # orbax's save threads are not daemons: after a failed background write, interpreter
        # shutdown can wait on them for ever. The last committed checkpoint is complete on disk
        # (orbax commits by rename), so nothing is lost by not waiting.
        os._exit(1)
    except RunStopped as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
