"""Checkpoints through orbax `CheckpointManager`: train state + data-loader position + config.

Layout: RUN_DIR/checkpoints/<step>/{state,data,config,checksums.json}. Orbax writes each step to
a temporary directory and renames it on commit, so `latest_step()` only ever sees complete
checkpoints. Once a step is committed, `checksums.json` records the size and SHA-256 of every
file in it; `restore` verifies them and refuses a damaged step (naming the step and the file)
unless asked to fall back to the newest intact one. In a multi-process run orbax writes each step
collectively and process 0 alone writes `checksums.json`.

A failed save, synchronous or in the background, raises `CheckpointError` with one line naming
the path and the OS error: from `save` itself, from `poll()` (which the training loop calls
every step, so a background failure stops the run within one step) or from `wait()`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dsjax.config import CheckpointConfig
from dsjax.errors import RunStopped

log = logging.getLogger("dsjax.checkpoint")
CHECKSUMS = "checksums.json"


class CheckpointError(RunStopped):
    """A checkpoint could not be written or is damaged. The message is one line and names the
    path (and, for a failed write, the OS error)."""


def _one_line(e: BaseException) -> str:
    """The most specific description of `e` on one line: an OSError in its chain if there is
    one (errno, reason and path(s)), else the exception's own text."""
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError):
            e = cur
            break
        cur = cur.__cause__ or cur.__context__
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def write_checksums(step_dir: Path) -> None:
    """Record size and SHA-256 of every file under a committed step directory (atomically)."""
    files = {p.relative_to(step_dir).as_posix(): [p.stat().st_size, _sha256(p)] for p in _files(step_dir)}
    tmp = step_dir / (CHECKSUMS + ".tmp")
    tmp.write_text(json.dumps({"algorithm": "sha256", "files": files}, sort_keys=True))
    os.replace(tmp, step_dir / CHECKSUMS)


def verify_checksums(step_dir: Path) -> str | None:
    """None if every file listed in the step's checksums.json is present with its recorded size
    and SHA-256; else a one-line description of the first problem (naming the file). A step
    without checksums.json (written before the checksums, or killed between the commit and
    them) is not verified: None, with a warning."""
    manifest = step_dir / CHECKSUMS
    if not manifest.is_file():
        log.warning("checkpoint %s has no %s: its files are not verified", step_dir, CHECKSUMS)
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{manifest} is unreadable ({_one_line(e)})"
    for rel, (size, digest) in sorted(files.items()):
        p = step_dir / rel
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != size:
            return f"{p} has {p.stat().st_size} bytes, {size} were written"
        if _sha256(p) != digest:
            return f"{p} does not match its checksum (content changed since it was written)"
    return None


class Checkpointer:
    """Save/restore {state, data, config} items; `directory` is RUN_DIR/checkpoints."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig | None = None, *, read_only=False):
        cfg = cfg or CheckpointConfig()
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_to_keep,
            enable_async_checkpointing=cfg.async_save and not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "config"))
        self._pending: int | None = None  # step of a save that may still run in the background
        self._failed = False

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _fail(self, step: int, e: BaseException) -> CheckpointError:
        self._failed = True
        return CheckpointError(f"checkpoint: saving step {step} under {self.directory} failed: "
                               f"{_one_line(e)}")

    def _finish_pending(self) -> None:
        """Wait for the pending save, raise CheckpointError if it failed, else checksum it."""
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
            check = getattr(self.manager, "check_for_errors", None)
            if check is not None:
                check()
            if step is not None and jax.process_index() == 0:  # once, after orbax's commit
                write_checksums(self.step_dir(step))
        except Exception as e:  # orbax re-raises the background thread's error here
            raise self._fail(step, e) from e

    def save(self, step: int, state: Any, data_state: dict, config: dict, *, force=True) -> None:
        """Start saving (async unless disabled). Raises CheckpointError if this save or a
        previous background save failed."""
        self._finish_pending()
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(config),
            ), force=force)
        except Exception as e:
            raise self._fail(step, e) from e
        self._pending = step
        if not self.manager.is_saving_in_progress():  # a synchronous save is committed already
            self._finish_pending()

    def poll(self) -> None:
        """Without blocking: raise CheckpointError if a background save has failed (and
        checksum a background save that has finished)."""
        if self._pending is not None and not self.manager.is_saving_in_progress():
            self._finish_pending()

    def wait(self) -> None:
        """Block until pending saves are committed; raises CheckpointError if one failed."""
        self._finish_pending()

    def verify(self, step: int) -> str | None:
        """None if step's files match their checksums, else what is damaged (one line)."""
        return verify_checksums(self.step_dir(step))

    def newest_intact(self) -> tuple[int | None, dict[int, str]]:
        """(newest step whose files verify or None, {newer damaged step: problem})."""
        damaged = {}
        for s in reversed(self.all_steps()):
            problem = self.verify(s)
            if problem is None:
                return s, damaged
            damaged[s] = problem
        return None, damaged

    def check_restorable(self, step: int | None = None, from_intact: bool = False) -> tuple[int, dict[int, str]]:
        """The step to restore: `step` or the newest one, verified. A damaged step raises
        CheckpointError naming the step, the file and the newest intact step, unless
        `from_intact`, which picks the newest intact step instead. Returns (step, {damaged
        newer steps skipped: problem})."""
        if step is not None:
            problem = self.verify(step)
            if problem is not None:
                raise CheckpointError(f"checkpoint: step {step} is damaged: {problem}")
            return step, {}
        latest = self.latest_step()
        if latest is None:
            raise FileNotFoundError(f"checkpoint: no complete checkpoint under {self.directory}")
        intact, damaged = self.newest_intact()
        if damaged and not from_intact:
            newest = max(damaged)
            alt = (f"--resume-from-intact restores the newest intact step ({intact})" if intact is not None
                   else "no older step is intact")
            raise CheckpointError(f"checkpoint: step {newest} is damaged: {damaged[newest]}; {alt}")
        if intact is None:
            raise CheckpointError(f"checkpoint: no intact checkpoint under {self.directory}: "
                                  + "; ".join(f"step {s}: {p}" for s, p in sorted(damaged.items())))
        return intact, damaged

    def restore(self, abstract_state: Any, step: int | None = None, *, from_intact: bool = False,
                verified: bool = False) -> tuple[Any, dict, dict, int]:
        """Restore (state, data_state, config dict, step) of `step` or the newest complete one,
        after verifying its checksums (see `check_restorable`; `verified`: `step` was checked
        by `check_restorable` already).

        abstract_state: a pytree of `jax.ShapeDtypeStruct` (with `.sharding` for placement).
        Raises FileNotFoundError when there is no complete checkpoint, CheckpointError when the
        step is damaged or orbax cannot read it.
        """
        if not (verified and step is not None):
            step, _ = self.check_restorable(step, from_intact)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore(),
            ))
        except Exception as e:
            raise CheckpointError(f"checkpoint: step {step} under {self.directory} could not be "
                                  f"restored: {_one_line(e)}") from e
        return out["state"], out["data"], out["config"], step

    def read_config(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"checkpoint: no complete checkpoint under {self.directory}")
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def read_data_state(self, step: int) -> dict:
        """The data-loader position saved at `step` (small JSON; no arrays are read)."""
        return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]

    def close(self) -> None:
        """Wait for a pending save (raising CheckpointError if it failed) and release orbax's
        threads. After a failed save nothing is awaited again."""
        try:
            if not self._failed:
                self._finish_pending()
        finally:
            try:
                self.manager.close()
            except Exception:  # the failure was reported already
                if not self._failed:
                    raise


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (keeping shardings) for restoring into the layout of `tree`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
