"""Parquet data files (what HF ``datasets`` writes and most published corpora ship as).

Files are read with pyarrow one record batch at a time (``ParquetFile.iter_batches``, row group
by row group, only the columns needed), never as a whole table. Rows are yielded in file order,
so a document's index in a corpus is its (file, row group, row) position flattened; the loaders'
saved positions (``loader.PackedLoader.state``, ``chat.ChatLoader.state``) are indices of that
order.

Every error is a one-line ``ValueError`` naming the file (and the row, for a bad value; rows are
numbered from 0 across the file's row groups, as ``datasets`` and pandas number them).
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

PARQUET_SUFFIXES = (".parquet",)
_BATCH_ROWS = 1024
CHAT_COLUMNS = (("messages",), ("prompt", "completion"))


def is_parquet(path: os.PathLike | str) -> bool:
    """True for a path whose suffix marks it as Parquet (``.parquet``, any case)."""
    return os.fspath(path).lower().endswith(PARQUET_SUFFIXES)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def open_file(path: os.PathLike | str) -> pq.ParquetFile:
    """``pq.ParquetFile`` of ``path`` (reads the footer only).

    Raises ValueError "PATH: not a readable Parquet file (...)" for a corrupt, truncated or
    non-Parquet file.
    """
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable Parquet file ({_one_line(e)})") from None


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def check_text_column(path: os.PathLike | str, column: str,
                      field_name: str = "data.text_field") -> None:
    """Check that ``path`` is readable Parquet with a string column ``column``.

    ``field_name`` is the config field that chose the column; errors name it.
    Raises ValueError naming the file, the column and ``field_name``.
    """
    schema = open_file(path).schema_arrow
    if column not in schema.names:
        raise ValueError(f"{path}: no column {column!r} ({field_name}); its columns are "
                         f"{', '.join(schema.names) or '(none)'}")
    t = schema.field(column).type
    if not _is_text(t):
        raise ValueError(f"{path}: column {column!r} ({field_name}) holds {t}, not strings")


def chat_columns(path: os.PathLike | str) -> tuple[str, ...]:
    """The chat columns of ``path``: ``("messages",)`` or ``("prompt", "completion")``.

    Raises ValueError naming the file and its columns when it has neither.
    """
    names = open_file(path).schema_arrow.names
    for cols in CHAT_COLUMNS:
        if all(c in names for c in cols):
            return cols
    raise ValueError(f"{path}: chat data (data.format=chat) needs a 'messages' column, or "
                     f"'prompt' and 'completion' columns; its columns are "
                     f"{', '.join(names) or '(none)'}")


def iter_rows(path: os.PathLike | str, columns: Sequence[str]) -> Iterator[tuple[int, dict]]:
    """Yield (row index, {column: python value}) for every row of ``path``, in file order.

    Reads ``columns`` only, one record batch (at most 1,024 rows of one row group) at a time.
    Raises ValueError naming the file for a data page that cannot be read.
    """
    pf = open_file(path)
    row = 0
    for rg in range(pf.num_row_groups):
        try:
            batches = pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=[rg],
                                      columns=list(columns))
            for batch in batches:
                values = [batch.column(c).to_pylist() for c in columns]
                for i in range(batch.num_rows):
                    yield row + i, {c: v[i] for c, v in zip(columns, values)}
                row += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: row group {rg} cannot be read ({_one_line(e)})") from None


def iter_texts(path: os.PathLike | str, column: str,
               field_name: str = "data.text_field") -> Iterator[str]:
    """Yield the strings of ``column``, one document per row.

    Raises ValueError naming the file, row, column and ``field_name`` for a null value (as a
    JSONL line whose text field is not a string), and as ``check_text_column`` for a missing or
    non-string column.
    """
    check_text_column(path, column, field_name)
    for row, values in iter_rows(path, [column]):
        text = values[column]
        if text is None:
            raise ValueError(f"{path}: row {row}: column {column!r} ({field_name}) is null")
        yield text
