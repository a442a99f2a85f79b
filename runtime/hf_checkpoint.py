"""Read a Hugging Face safetensors checkpoint directory (one file, or shards + model.safetensors.index.json)
one element range at a time, with errors that name the file and tensor.

safetensors file = u64 LE header length n | n bytes of JSON {name: {dtype, shape, data_offsets:[b, e]},
"__metadata__": {...}} | data section (offsets relative to its start, C order, little endian).
Reads use os.pread into short-lived buffers rather than mmap: a multi-GB conversion then keeps one
chunk resident instead of letting the mapped file's pages pile up in its RSS.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# dtypes a weight may come in; anything else is a "dtype surprise" for a float weight
DTYPES = {"F32": ("<f4", 4), "BF16": ("<u2", 2), "F16": ("<f2", 2)}
MAX_HEADER = 100 << 20


class CheckpointError(Exception):
    """The checkpoint directory or one of its files is missing, truncated or malformed."""


@dataclass(frozen=True)
class SourceTensor:
    name: str
    path: str
    dtype: str
    shape: tuple
    start: int      # absolute file offset of the first byte
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _read_header(path: Path) -> list[SourceTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit the {size}-byte file "
                                  f"(truncated or not a safetensors file)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start, data_len = 8 + n, size - 8 - n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {meta!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}; weights must be one of "
                                  f"{', '.join(DTYPES)}")
        need = math.prod(shape) * DTYPES[dtype][1]
        if not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e):
            raise CheckpointError(f"{path}: tensor {name!r} has invalid data_offsets {[b, e]}")
        if e - b != need:
            raise CheckpointError(f"{path}: tensor {name!r} {dtype}{list(shape)} needs {need} bytes but its "
                                  f"data_offsets span {e - b} (corrupt header)")
        if e > data_len:
            raise CheckpointError(f"{path}: tensor {name!r} needs data bytes [{b}, {e}) but the file holds "
                                  f"only {data_len} (truncated file)")
        out.append(SourceTensor(name, str(path), dtype, shape, data_start + b, need))
    return out


class Checkpoint:
    """All tensors of the *.safetensors files in `hf_dir` (cross-checked with the index if present)."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        files = sorted(p for p in self.dir.glob("*.safetensors") if not p.name.startswith("."))
        index = self.dir / "model.safetensors.index.json"
        weight_map = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: corrupt index ({e})") from None
            for shard in sorted(set(weight_map.values())):
                if not (self.dir / shard).exists():
                    raise CheckpointError(f"{index}: lists shard {shard!r}, which is missing from {self.dir}")
        if not files:
            raise CheckpointError(f"{self.dir}: no *.safetensors files")
        self.tensors: dict[str, SourceTensor] = {}
        for f in files:
            for t in _read_header(f):
                if t.name in self.tensors:
                    raise CheckpointError(f"tensor {t.name!r} appears in both {self.tensors[t.name].path} "
                                          f"and {t.path}")
                self.tensors[t.name] = t
        for name, shard in weight_map.items():
            t = self.tensors.get(name)
            if t is None or Path(t.path).name != shard:
                raise CheckpointError(f"{index}: maps tensor {name!r} to {shard!r}, but that file does not hold it")
        self._fds: dict[str, int] = {}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, name: str, start: int, count: int) -> np.ndarray:
        """Elements [start, start+count) of the flattened tensor as float32."""
        t = self.tensors[name]
        code, size = DTYPES[t.dtype]
        fd = self._fds.get(t.path)
        if fd is None:
            fd = self._fds[t.path] = os.open(t.path, os.O_RDONLY)
        want = count * size
        buf = os.pread(fd, want, t.start + start * size)
        if len(buf) != want:
            raise CheckpointError(f"{t.path}: short read of tensor {name!r} (file changed or truncated)")
        raw = np.frombuffer(buf, code)
        if t.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
