"""Checks that the path-valued fields of a configuration name what exists, before a run starts:
each failure is one line naming the field, e.g. `config: data.train[0]: /data/x.txt does not
exist`. Unlike `checks.validate` these read the filesystem, so a saved run's config (whose data
may since have moved) is not checked when it is only read back.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

from dsjax.config.schema import Config, ConfigError

_GLOB_CHARS = set("*?[")  # as `dsjax.data.corpus.expand_sources` reads them


def _source_problem(entry: str) -> str | None:
    """Why a data source entry (a file, a directory of files or a glob, as
    `dsjax.data.corpus.expand_sources` takes them) gives no file, else None. Stops at the first
    file found: no listing of the whole corpus."""
    s = os.path.expanduser(entry)
    if _GLOB_CHARS & set(s):
        if any(os.path.isfile(p) for p in glob.iglob(s, recursive=True)):
            return None
        return f"{s}: glob matches no file"
    if os.path.isdir(s):
        for _, dirs, files in os.walk(s):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            if any(not f.startswith(".") for f in files):
                return None
        return f"{s} is a directory that holds no file"
    if os.path.isfile(s):
        return None
    return f"{s} does not exist"


def _file(key: str, value: str) -> None:
    p = Path(value)
    if not p.exists():
        raise FileNotFoundError(f"config: {key}: {p} does not exist")
    if not p.is_file():
        raise ConfigError(f"config: {key}: {p} is not a file")


def check_paths(cfg: Config, new_run: bool = True) -> None:
    """The inputs a run reads exist: data.train / data.validation entries ("stdlib" aside),
    data.tokenizer and data.chat_template (files), train.init_from (a dsjax run directory with
    checkpoints) and train.init_from_hf (an HF directory or file); data.cache_dir, which the
    run creates, must not be a file. Paths are read as the run reads them (`~` expanded in
    data sources and data.cache_dir only).

    new_run: False when the run continues from its own checkpoint, which then holds every
      weight and the tokenizer: train.init_from / init_from_hf are not read, nor a text run's
      data.tokenizer (the run's own tokenizer.json is used).
    Raises:
      FileNotFoundError: a path that does not exist, a glob that matches no file, a directory
        that holds no file, a run directory without checkpoints; the line names the field.
      ConfigError: a path of the wrong kind (a directory given for a file, a file for a
        directory).
    """
    d, t = cfg.data, cfg.train
    for name in ("train", "validation"):
        entries = getattr(d, name)
        if name == "train" and entries == ["stdlib"]:
            continue
        for i, entry in enumerate(entries):
            problem = _source_problem(entry)
            if problem:
                raise FileNotFoundError(f"config: data.{name}[{i}]: {problem}")
    if d.tokenizer is not None and (new_run or d.format == "chat"):
        _file("data.tokenizer", d.tokenizer)
    if d.chat_template is not None and d.format == "chat":
        _file("data.chat_template", d.chat_template)
    cache = Path(d.cache_dir).expanduser()
    if cache.exists() and not cache.is_dir():
        raise ConfigError(f"config: data.cache_dir: {cache} exists and is not a directory")
    if not new_run:
        return
    if t.init_from is not None:
        p = Path(t.init_from)
        if not p.exists():
            raise FileNotFoundError(f"config: train.init_from: {p} does not exist")
        if not (p / "checkpoints").is_dir():
            raise FileNotFoundError(f"config: train.init_from: {p} is not a dsjax run directory (it has "
                                    f"no checkpoints/ directory)")
    if t.init_from_hf is not None:
        p = Path(t.init_from_hf)
        if not p.exists():
            raise FileNotFoundError(f"config: train.init_from_hf: {p} does not exist")
