"""Streaming safetensors reading and writing with numpy (+ ml_dtypes for bf16 / fp8), no torch.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N
bytes of JSON `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`, then the
raw little-endian tensor bytes (offsets relative to the end of the header). A sharded checkpoint
has `model.safetensors.index.json` = `{"metadata": {...}, "weight_map": {name: file}}`.

Reading goes tensor by tensor with `readinto` into a fresh buffer (no mmap), so the host keeps at
most one source tensor alive beside what the caller builds. FP8 block-quantised weights
(DeepSeek-V3 `README_WEIGHTS.md`: float8_e4m3fn `W` [out, in] + float32 `W_scale_inv`
[ceil(out/128), ceil(in/128)], dequant `W[i, j] * scale_inv[i // 128, j // 128]`, partial edge
blocks) are dequantised to float32 by `read_dequant`, wherever the scale is stored.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message names the file or tensors."""


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict without __metadata__, byte offset where the data starts).

    Raises CheckpointError naming the file when it is truncated or its header is corrupt: shorter
    than the 8-byte header length, a header length past the end of the file, a header that is not
    a JSON object of tensor entries, or a tensor whose bytes lie past the end of the file."""
    size = os.path.getsize(path)
    bad = f"{path}: truncated or corrupt safetensors file"
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{bad}: {size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise CheckpointError(f"{bad}: the header claims {n} bytes but only {size - 8} follow "
                                  f"its 8-byte length")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{bad}: its {n}-byte header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{bad}: its header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data = size - 8 - n
    for k, info in header.items():
        try:
            b, e = (int(x) for x in info["data_offsets"])
            info["dtype"], info["shape"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{bad}: header entry {k!r} lacks dtype, shape or a "
                                  f"[begin, end] data_offsets pair") from None
        if not 0 <= b <= e <= data:
            raise CheckpointError(f"{bad}: tensor {k} claims bytes [{b}, {e}) of the data but the "
                                  f"file holds {data} bytes after the header")
    return header, 8 + n


class SafetensorsCheckpoint:
    """A single-file or sharded safetensors checkpoint directory (or a single .safetensors file).

    `keys()`, `shape(k)`, `dtype(k)` come from the headers only; `read(k)` loads one tensor
    as a numpy array in its stored dtype; `read_dequant(k, block)` dequantises FP8 weights that
    have a `<k>_scale_inv` companion (in any shard).
    """

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if p.is_file():
            files = [p]
        elif (p / INDEX).is_file():
            try:
                index = json.loads((p / INDEX).read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{p / INDEX}: not valid JSON ({e})") from None
            files = sorted({p / f for f in index.get("weight_map", {}).values()})
        elif (p / SINGLE).is_file():
            files = [p / SINGLE]
        else:
            files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
            if not files:
                raise CheckpointError(f"{p}: no {INDEX}, {SINGLE} or *.safetensors found")
        self.path = p
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{p / INDEX}: shard {f.name} is missing")
            header, start = read_header(f)
            for k, info in header.items():
                self._where[k] = (f, info, start)

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._where[key][1]["shape"])

    def dtype(self, key: str) -> str:
        return self._where[key][1]["dtype"]

    def file(self, key: str) -> Path:
        return self._where[key][0]

    def read(self, key: str) -> np.ndarray:
        f, info, start = self._where[key]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{f.name}: tensor {key} has unsupported dtype {info['dtype']}")
        dt = DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        n = int(np.prod(shape, dtype=np.int64))
        if e - b != n * dt.itemsize:
            raise CheckpointError(f"{f.name}: tensor {key} has {e - b} bytes, expected {n * dt.itemsize}")
        out = np.empty(shape, dt)
        with open(f, "rb") as fh:
            fh.seek(start + b)
            got = fh.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        if got != e - b:
            raise CheckpointError(f"{f.name}: tensor {key} is truncated")
        return out

    def is_quantized(self, key: str) -> bool:
        return key + SCALE_SUFFIX in self._where and self.dtype(key).startswith("F8")

    def read_dequant(self, key: str, block: tuple[int, int] = (128, 128)) -> np.ndarray:
        """Tensor `key` as float32 if FP8-quantised with a `_scale_inv` companion, else as stored."""
        w = self.read(key)
        if not self.is_quantized(key):
            if w.dtype.name.startswith("float8"):
                raise CheckpointError(f"{key}: stored as {w.dtype.name} but the checkpoint has no "
                                      f"{key}{SCALE_SUFFIX} to dequantise it with")
            return w
        s = self.read(key + SCALE_SUFFIX).astype(np.float32)
        return dequant_fp8(w, s, block, key)


def dequant_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "") -> np.ndarray:
    """w [out, in] fp8 * scale_inv [ceil(out/bo), ceil(in/bi)] broadcast per block -> float32.

    Partial edge blocks use the last row/column of the scale grid (DeepSeek-V3 `weight_dequant`).
    """
    if w.ndim != 2:
        raise CheckpointError(f"{name}: FP8 block dequantisation needs a 2-D weight, got {w.shape}")
    bo, bi = block
    O, I = w.shape
    want = (-(-O // bo), -(-I // bi))
    if scale_inv.shape != want:
        raise CheckpointError(f"{name}: weight_scale_inv shape {scale_inv.shape} does not match weight "
                              f"{w.shape} with {bo}x{bi} blocks (expected {want})")
    out = w.astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, bo, axis=0), bi, axis=1)[:O, :I]
    out *= full
    return out


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


def _header_bytes(entries: list[tuple[str, np.dtype, tuple]], metadata: dict) -> tuple[bytes, list[int]]:
    header: dict = {"__metadata__": metadata}
    off, sizes = 0, []
    for name, dt, shape in entries:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dt)], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
        sizes.append(n)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, sizes


def write_sharded(out_dir: str | os.PathLike, specs: Iterable[tuple[str, np.dtype, tuple]],
                  produce: "Iterator[np.ndarray] | callable", max_shard_bytes: int = 5 * 2**30,
                  metadata: dict | None = None) -> list[Path]:
    """Write tensors into `model-0000i-of-0000n.safetensors` shards + index (or one `model.safetensors`).

    specs: (name, dtype, shape) in write order, known up front so every header is exact;
    produce(name) -> array of that dtype and shape, called once per tensor in order, so only one
    tensor is alive at a time. Returns the written shard paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = list(specs)
    metadata = {"format": "pt", **(metadata or {})}
    groups, cur, size = [], [], 0
    for s in specs:
        n = int(np.prod(s[2], dtype=np.int64)) * np.dtype(s[1]).itemsize
        if cur and size + n > max_shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += n
    if cur or not groups:
        groups.append(cur)
    names = ([SINGLE] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, paths, total = {}, [], 0
    for fname, group in zip(names, groups):
        head, sizes = _header_bytes(group, metadata)
        path = out / fname
        with open(path, "wb") as f:
            f.write(head)
            for (name, dt, shape), n in zip(group, sizes):
                arr = np.ascontiguousarray(produce(name))
                if arr.dtype != np.dtype(dt) or tuple(arr.shape) != tuple(shape):
                    raise CheckpointError(f"write: {name} produced {arr.dtype}{arr.shape}, "
                                          f"declared {np.dtype(dt)}{tuple(shape)}")
                f.write(memoryview(arr.reshape(-1).view(np.uint8)))
                weight_map[name] = fname
                total += n
        paths.append(path)
    if len(groups) > 1:
        (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}, indent=2))
    elif (out / INDEX).exists():
        (out / INDEX).unlink()
    return paths
