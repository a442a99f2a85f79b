"""Streaming, atomic writer of `.ninfer` artifacts.

The caller declares every object up front (name, shape, format, role, flags; resource sizes). Byte
counts follow from (format, shape), so offsets are fixed before any data is written and the JSON
directory has a known length (digests are fixed-width hex): the payload is written straight to its
final position in a temp file, object after object, hashed as it streams, and the prefix + JSON are
written into the reserved head at the end. Nothing is buffered beyond the chunk being written and
nothing is written twice.

Atomicity: the temp file lives in the destination directory (same filesystem), is fsynced, then
os.replace()d over the destination and the directory is fsynced. On any exception the temp file is
removed and the destination is untouched.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from .artifact_schema import (ALIGN, FORMAT_VERSION, MAGIC, PREFIX, ResourceEntry, SchemaError,
                              TensorEntry, WriteError, align_up, check_tensor_fields)
from .formats import FORMATS

_PLACEHOLDER = "0" * 64
_ZEROS = bytes(ALIGN)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    format: str
    role: str
    flags: tuple = ()


def _dumps(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")


class ArtifactWriter:
    """with ArtifactWriter(path, family, tensor_specs, [(resource_name, nbytes), ...]) as w:
           w.add_tensor(name, chunks)    # in declaration order; chunks: iterable of bytes-like
           w.add_resource(name, data)"""

    def __init__(self, path, model_family: str, tensors: list[TensorSpec], resources: list[tuple[str, int]]):
        self.path = os.path.abspath(os.fspath(path))
        self.model_family = model_family
        self._entries: list[TensorEntry | ResourceEntry] = []
        pos, names = 0, set()
        for i, t in enumerate(tensors):
            where = f"tensor {t.name!r}"
            n = check_tensor_fields(t.name, list(t.shape), t.format, t.role, list(t.flags), where)
            if t.name in names:
                raise SchemaError(f"{where}: declared twice")
            names.add(t.name)
            self._entries.append(TensorEntry(t.name, tuple(int(d) for d in t.shape), t.format,
                                             FORMATS[t.format].layout, pos, n, _PLACEHOLDER, t.role,
                                             tuple(t.flags)))
            pos = align_up(pos + n)
        rnames = set()
        for name, n in resources:
            if not name or name in rnames:
                raise SchemaError(f"resource {name!r}: empty or declared twice")
            rnames.add(name)
            self._entries.append(ResourceEntry(name, pos, int(n), _PLACEHOLDER))
            pos = align_up(pos + int(n))
        self._payload_len = pos
        self._digests: list[str] = []
        self._json_len = len(_dumps(self._directory(_PLACEHOLDER)))
        self.payload_offset = align_up(PREFIX.size + self._json_len)
        self._pos = 0                     # payload bytes written so far
        self._payload_hash = hashlib.sha256()
        directory = os.path.dirname(self.path)
        try:
            fd, self._tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.", suffix=".partial",
                                             dir=directory)
        except OSError as e:
            raise WriteError(f"cannot create a file in {directory!r} for {self.path!r}: "
                             f"{e.strerror or e}") from None
        self._f = os.fdopen(fd, "wb")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)     # mkstemp makes 0600; the artifact is an ordinary file
        self._f.seek(self.payload_offset)
        self._done = False

    @property
    def total_bytes(self) -> int:
        return self.payload_offset + self._payload_len

    def _directory(self, payload_sha: str) -> dict:
        digests = self._digests + [_PLACEHOLDER] * (len(self._entries) - len(self._digests))
        tensors, resources = [], []
        for e, d in zip(self._entries, digests):
            j = e.to_json()
            j["sha256"] = d
            (tensors if isinstance(e, TensorEntry) else resources).append(j)
        return {"format_version": FORMAT_VERSION, "model_family": self.model_family, "tensors": tensors,
                "resources": resources, "payload_sha256": payload_sha}

    # -- streaming ----------------------------------------------------------------------------
    def _write(self, data, *hashes) -> None:
        self._f.write(data)
        for h in hashes:
            h.update(data)

    def _pad_to(self, offset: int) -> None:
        while self._pos < offset:
            n = min(ALIGN, offset - self._pos)
            self._write(_ZEROS[:n], self._payload_hash)
            self._pos += n

    def _next(self, name: str, kind: type):
        i = len(self._digests)
        if i >= len(self._entries):
            raise WriteError(f"{kind.__name__} {name!r}: every declared object is already written")
        e = self._entries[i]
        if not isinstance(e, kind) or e.name != name:
            raise WriteError(f"expected to write {type(e).__name__} {e.name!r} next, got {name!r}")
        return e

    def add_tensor(self, name: str, chunks) -> None:
        self._add(self._next(name, TensorEntry), chunks)

    def add_resource(self, name: str, data: bytes) -> None:
        self._add(self._next(name, ResourceEntry), [data])

    def _add(self, e, chunks) -> None:
        self._pad_to(e.offset)
        h, n = hashlib.sha256(), 0
        for chunk in chunks:
            mv = memoryview(np.ascontiguousarray(chunk) if isinstance(chunk, np.ndarray) else chunk).cast("B")
            n += mv.nbytes
            if n > e.bytes:
                raise WriteError(f"{e.name!r}: more than the declared {e.bytes} bytes")
            self._write(mv, self._payload_hash, h)
        if n != e.bytes:
            raise WriteError(f"{e.name!r}: wrote {n} bytes, declared {e.bytes}")
        self._pos += n
        self._digests.append(h.hexdigest())

    # -- finish / abort -----------------------------------------------------------------------
    def finish(self) -> None:
        if len(self._digests) != len(self._entries):
            missing = [e.name for e in self._entries[len(self._digests):]]
            raise WriteError(f"{len(missing)} declared object(s) not written, first {missing[0]!r}")
        self._pad_to(self._payload_len)
        head = _dumps(self._directory(self._payload_hash.hexdigest()))
        assert len(head) == self._json_len, "directory length changed after layout"
        self._f.seek(0)
        self._f.write(PREFIX.pack(MAGIC, len(head)) + head)
        self._f.write(bytes(self.payload_offset - PREFIX.size - len(head)))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)
        self._done = True
        try:   # make the rename itself durable
            dfd = os.open(os.path.dirname(self.path), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._f.close()
        finally:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.finish()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()
        return False
