"""Checkpoints through orbax `CheckpointManager`: train state + data-loader position + config.

Layout: RUN_DIR/checkpoints/<step>/{state,data,config}. Orbax writes each step to a temporary
directory and renames it on commit, so `latest_step()` only ever sees complete checkpoints; a
failed (async) save raises on the next save or on `wait()`, failing the run loudly.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from dsjax.config import CheckpointConfig


class Checkpointer:
    """Save/restore {state, data, config} items; `directory` is RUN_DIR/checkpoints."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig | None = None, *, read_only=False):
        cfg = cfg or CheckpointConfig()
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.max_to_keep,
            enable_async_checkpointing=cfg.async_save and not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "data", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, config: dict, *, force=True) -> None:
        """Start saving (async unless disabled). Raises if a previous async save failed."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config),
        ), force=force)

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, dict, int]:
        """Restore (state, data_state, config dict, step) of `step` or the newest complete one.

        abstract_state: a pytree of `jax.ShapeDtypeStruct` (with `.sharding` for placement).
        Raises FileNotFoundError when there is no complete checkpoint.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"checkpoint: no complete checkpoint under {self.directory}")
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore(),
        ))
        return out["state"], out["data"], out["config"], step

    def read_config(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"checkpoint: no complete checkpoint under {self.directory}")
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def wait(self) -> None:
        """Block until pending async saves are committed; re-raises their errors."""
        self.manager.wait_until_finished()
        check = getattr(self.manager, "check_for_errors", None)
        if check is not None:
            check()

    def close(self) -> None:
        self.manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (keeping shardings) for restoring into the layout of `tree`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
