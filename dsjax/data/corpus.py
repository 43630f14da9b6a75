"""Corpora: the embedded stdlib corpus, a deterministic train/val split, and user sources.

A *document* is one string. Text files (any extension except ``.jsonl``/``.ndjson`` and
``.parquet``) are one document each; JSONL files hold one document per line in a string field,
Parquet files one per row in a string column (the field or column is ``data.text_field``,
default ``text``).

Encodings. User files must be UTF-8. A text file that is not (a NUL byte in its first 8 KiB, or
bytes that are not UTF-8 anywhere in it) counts as binary: found in a directory or by a glob it
is skipped, with one warning for all such files of a source list; named on its own it is an
error naming FILE:LINE. A JSONL line that is not UTF-8 is an error naming FILE:LINE. Only the
embedded stdlib corpus (``stdlib_files``), which holds a few Latin-1 and KOI8-R test modules, is
read with undecodable bytes replaced (U+FFFD).
"""
from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import os
import pathlib
import sysconfig
from collections.abc import Iterable, Iterator, Sequence

from dsjax.data import parquet

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
_GLOB_CHARS = set("*?[")
_NUL_WINDOW = 8192  # a NUL byte in a file's first 8 KiB marks it binary
_READ_CHUNK = 1 << 20


def stdlib_root() -> pathlib.Path:
    """Directory of the running interpreter's standard library (``sysconfig`` ``stdlib``)."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"]).resolve()


def stdlib_files() -> list[pathlib.Path]:
    """Absolute paths of the ``.py`` files of the standard library, sorted by relative path.

    ``site-packages`` (third-party code) is excluded. On CPython 3.12 this is about 1,700 files,
    ~32 MB of real code by many authors, present on every machine, no download.
    """
    root = stdlib_root()
    files = [p for p in root.rglob("*.py")
             if "site-packages" not in p.relative_to(root).parts and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _rel_key(path: pathlib.Path, root: pathlib.Path) -> str:
    try:
        return pathlib.Path(path).resolve().relative_to(root).as_posix()
    except ValueError:
        return pathlib.Path(path).as_posix()


def _unit_hash(text: str) -> float:
    """Stable hash of ``text`` mapped to [0, 1) (sha256; unlike ``hash()`` it is not salted)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def split_files(paths: Sequence[os.PathLike | str], val_fraction: float, seed: int = 0,
                root: os.PathLike | str | None = None
                ) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """Split files into (train, val) by a stable hash of ``f"{seed}:{relative path}"``.

    Args:
      paths: files; their order does not matter.
      val_fraction: expected fraction of files in val, in [0, 1].
      seed: changes which files land in val.
      root: paths are hashed relative to it (default: the stdlib root if every path is under
        it, else the paths' common parent), so the split is the same on every machine.
    Returns:
      ``(train, val)``, each sorted by relative path and disjoint. With >= 2 files both are
      non-empty (the lowest-hash train file moves to val, or the highest-hash val file to train).
    """
    paths = [pathlib.Path(p) for p in paths]
    if not paths:
        return [], []
    if root is None:
        std = stdlib_root()
        resolved = [p.resolve() for p in paths]
        if all(std in p.parents for p in resolved):
            root = std
        else:
            root = pathlib.Path(os.path.commonpath([p.parent for p in resolved]))
    root = pathlib.Path(root).resolve()
    keyed = sorted((_unit_hash(f"{seed}:{_rel_key(p, root)}"), _rel_key(p, root), p)
                   for p in paths)
    val = [k for k in keyed if k[0] < val_fraction]
    train = [k for k in keyed if k[0] >= val_fraction]
    if len(keyed) >= 2 and not val:
        val, train = train[:1], train[1:]
    if len(keyed) >= 2 and not train:
        val, train = val[:-1], val[-1:]
    by_rel = lambda items: [p for _, _, p in sorted(items, key=lambda k: k[1])]  # noqa: E731
    return by_rel(train), by_rel(val)


def is_jsonl(path: os.PathLike | str) -> bool:
    """True for a ``.jsonl`` / ``.ndjson`` path (any case)."""
    return pathlib.Path(path).suffix.lower() in JSONL_SUFFIXES


def not_text(path: os.PathLike | str) -> str | None:
    """Why the file at ``path`` is not UTF-8 text, or None if it is.

    Reasons: "NUL byte at offset N" (within the first 8 KiB, where binary formats put their
    headers) or "byte 0xNN at line L is not UTF-8" (anywhere in the file, read in 1 MiB chunks).
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            if offset < _NUL_WINDOW and (i := chunk.find(b"\0", 0, _NUL_WINDOW - offset)) >= 0:
                return f"NUL byte at offset {offset + i}"
            pending = decoder.getstate()[0]
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                data = pending + chunk
                line = lines + data.count(b"\n", 0, e.start) + 1
                return f"byte 0x{data[e.start]:02x} at line {line} is not UTF-8"
            lines += chunk.count(b"\n")
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return f"the file ends inside a UTF-8 character (line {lines + 1})"
    return None


def decode_line(raw: bytes, path: os.PathLike | str, lineno: int) -> str:
    """One line of a JSONL file as str. Raises ValueError "PATH:LINE: ... not UTF-8 ..."."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                         f"{e.start + 1}); convert the file to UTF-8") from None


def _text_kind(path: pathlib.Path) -> bool:
    """True for a file read as plain text (one document), i.e. neither JSONL nor Parquet."""
    return not (is_jsonl(path) or parquet.is_parquet(path))


def expand_sources(spec: str | os.PathLike | Iterable[str | os.PathLike],
                   name: str = "data.train") -> list[pathlib.Path]:
    """Expand files, directories (all files below, recursively) and globs (``**`` allowed).

    ``spec`` is one path/glob or a list of them; ``name`` is the config field that lists them
    (errors and the warning name it). Each entry expands to its matches sorted by path; entries
    keep their given order; duplicates are dropped. Text files that are not UTF-8 (``not_text``)
    are skipped when a directory or glob found them, with one warning giving their number and
    the first of them.

    Raises ``FileNotFoundError`` naming the entry when a path is missing or a glob matches no
    file; ``ValueError`` naming the entry and ``name`` when a directory or glob holds only
    binary files, and naming FILE (and LINE) when a file named on its own is not UTF-8 text.
    """
    entries = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not entries:
        raise FileNotFoundError(f"{name}: no data sources given")
    out: list[pathlib.Path] = []
    skipped: dict[pathlib.Path, str] = {}  # binary file -> why, in the order found
    for entry in entries:
        s = os.path.expanduser(os.fspath(entry))
        if _GLOB_CHARS & set(s):
            found = [pathlib.Path(p) for p in sorted(glob.glob(s, recursive=True))
                     if os.path.isfile(p)]
            if not found:
                raise FileNotFoundError(f"data source glob matches no file: {s}")
        elif os.path.isdir(s):
            found = sorted(p for p in pathlib.Path(s).rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(s).parts))
            if not found:
                raise FileNotFoundError(f"data source directory holds no file: {s}")
        elif os.path.isfile(s):
            path = pathlib.Path(s)
            if _text_kind(path) and (why := not_text(path)):
                raise ValueError(f"{path}: not UTF-8 text ({why}); {name} takes UTF-8 text, "
                                 f"JSONL and Parquet files")
            out.append(path)
            continue
        else:
            raise FileNotFoundError(f"data source not found: {s}")
        bad = [(p, why) for p in found if _text_kind(p) and (why := not_text(p))]
        if len(bad) == len(found):
            raise ValueError(f"{name}: {s} holds no usable file: all {len(found)} are binary or "
                             f"not UTF-8 text (e.g. {bad[0][0]}: {bad[0][1]})")
        for p, why in bad:
            skipped.setdefault(p, why)
        drop = {p for p, _ in bad}
        out += [p for p in found if p not in drop]
    if skipped:
        log.warning("%s: skipped %d binary or non-UTF-8 file%s (the first: %s: %s)", name,
                    len(skipped), "s" if len(skipped) > 1 else "", *next(iter(skipped.items())))
    seen: set[pathlib.Path] = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def read_text(path: os.PathLike | str) -> str:
    """File contents as str (UTF-8, undecodable bytes replaced, newlines kept as in the file).

    User files reach this only after ``expand_sources`` checked that they are UTF-8."""
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def iter_documents(paths: Iterable[os.PathLike | str], field: str = "text") -> Iterator[str]:
    """Yield documents lazily: one per text file, one per non-blank JSONL line (string field
    ``field``), one per Parquet row (string column ``field``).

    Raises ``ValueError`` naming file, 1-based line number and field for a JSONL line that is
    not UTF-8 or not a JSON object with a string ``field``; for Parquet files as
    ``parquet.iter_texts``.
    """
    for path in paths:
        if parquet.is_parquet(path):
            yield from parquet.iter_texts(path, field)
            continue
        if not is_jsonl(path):
            yield read_text(path)
            continue
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = decode_line(raw, path, lineno)
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or field not in obj:
                    raise ValueError(f"{path}:{lineno}: JSONL line has no field {field!r} "
                                     f"(data.text_field)")
                if not isinstance(obj[field], str):
                    raise ValueError(f"{path}:{lineno}: JSONL field {field!r} is "
                                     f"{type(obj[field]).__name__}, not a string")
                yield obj[field]


class Documents:
    """A re-iterable, lazy collection of documents read from ``files``.

    Each ``iter()`` re-reads the files, so it can feed tokenizer training and the loader.
    Calling it returns a fresh iterator too, so it serves as a ``docs_factory``/``texts_factory``.
    ``files`` (the source list, in reading order) feeds the tokenizer-cache fingerprint.
    Parquet files are checked here, before any reading (readable, with a string column
    ``field``), raising ValueError naming the file, the column and ``data.text_field``.
    """

    def __init__(self, files: Sequence[os.PathLike | str], field: str = "text"):
        self.files = [pathlib.Path(p) for p in files]
        self.field = field
        for p in self.files:
            if parquet.is_parquet(p):
                parquet.check_text_column(p, field)

    def __iter__(self) -> Iterator[str]:
        return iter_documents(self.files, self.field)

    def __call__(self) -> Iterator[str]:
        return iter(self)

    def __repr__(self) -> str:
        return f"Documents({len(self.files)} files, field={self.field!r})"


def resolve_sources(spec: str | os.PathLike | Iterable[str | os.PathLike],
                    field: str = "text", name: str = "data.train") -> Documents:
    """User sources (files, directories, globs; text, JSONL or Parquet) -> lazy ``Documents``.

    Missing paths and empty globs raise ``FileNotFoundError`` here, before any work, and a
    binary file named on its own, a folder of binary files or a Parquet file without a string
    column ``field`` raise ``ValueError`` (``expand_sources``, ``Documents``); a bad JSONL line
    or Parquet value raises ``ValueError`` when it is reached.
    """
    return Documents(expand_sources(spec, name), field)
