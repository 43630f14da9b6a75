"""Shared command-line plumbing: config arguments and one-line errors."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from jax._src import xla_bridge

from dsjax import config as C
from dsjax.checkpoint import CheckpointError
from dsjax.errors import RunStopped
from pallas_kernels._hopper import INTERPRET_MIN_CPU_THREADS


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="YAML file applied over the defaults (e.g. configs/tiny.yaml); repeatable: "
                        "files apply left to right, a file's top-level 'base: other.yaml' (relative "
                        "to it) first, and --set last")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set optim.learning_rate=1e-5 (repeatable)")


def load_config(args) -> C.Config:
    """The config of `add_config_args`' arguments (files left to right, then --set), with the
    XLA CPU thread pool that Mosaic GPU interpret mode needs set up (`interpret_threads`)."""
    cfg = C.load(args.config, args.overrides)
    interpret_threads(cfg)
    return cfg


def interpret_threads(cfg: C.Config) -> None:
    """With model.attention_impl or moe_impl = pallas, give XLA's CPU client at least
    `INTERPRET_MIN_CPU_THREADS` threads (env PJRT_NPROC), before jax starts its backends.

    Off a Hopper GPU those kernels run in GPU interpret mode, which simulates each warpgroup as
    an XLA:CPU computation that holds a pool thread while it waits at a barrier; with the
    default pool of one thread per core (2 on a 2-core machine) the other warpgroups never run
    and the step waits for ever. The pool size only matters to the CPU client (on a GPU host
    it runs the host-side work), and it is left alone when it is already large enough or when
    jax's backends have started (then the kernels' own warning names the setting)."""
    if "pallas" not in (cfg.model.attention_impl, cfg.model.moe_impl) or xla_bridge.backends_are_initialized():
        return
    given = os.environ.get("PJRT_NPROC") or os.environ.get("NPROC")
    try:
        threads = int(given) if given else len(os.sched_getaffinity(0))
    except ValueError:  # what XLA does with a value that is not a number: one thread per core
        threads = len(os.sched_getaffinity(0))
    if threads < INTERPRET_MIN_CPU_THREADS:
        os.environ["PJRT_NPROC"] = str(INTERPRET_MIN_CPU_THREADS)


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
