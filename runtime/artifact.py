"""Read (and, via artifact_writer, write) `.ninfer` artifacts. Framing and schema: artifact_schema.py.

Reading validates the whole directory up front (magic, closed schema, byte counts vs (format, shape),
placement, exact file size) and then serves tensors as zero-copy read-only views of one mmap.
`verify()` re-hashes every object and the payload with plain reads (so it does not pin the file in
memory) and names the first object whose digest differs.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import warnings

import numpy as np

from .artifact_schema import (ALIGN, MAGIC, PREFIX, ArtifactError, BadMagicError,  # noqa: F401 (re-exported)
                              DigestMismatchError, FileSizeError, OutOfBoundsError, OverlapError,
                              ResourceEntry, SchemaError, SizeMismatchError, TensorEntry, WriteError,
                              align_up, check_placement, parse_directory)
from .artifact_writer import ArtifactWriter, TensorSpec  # noqa: F401 (re-exported)
from .formats import get_format

READ_CHUNK = 16 << 20
_NUMPY_DTYPES = {"fp32": "<f4", "bf16": "<u2", "i32": "<i4"}   # numpy has no bfloat16: raw bits


def _no_dup_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise SchemaError(f"duplicate JSON member {k!r}")
        out[k] = v
    return out


class Artifact:
    """An opened, validated `.ninfer` file. Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = open(self.path, "rb")
        try:
            self._load()
        except BaseException:
            self._file.close()
            raise
        self._mm: mmap.mmap | None = None
        self._staging = None

    def _load(self) -> None:
        p = self.path
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(PREFIX.size)
        if len(head) < PREFIX.size:
            raise BadMagicError(f"{p}: file is {size} bytes, shorter than the {PREFIX.size}-byte prefix")
        magic, json_len = PREFIX.unpack(head)
        if magic != MAGIC:
            raise BadMagicError(f"{p}: bad magic {magic!r} (expected {MAGIC!r}); not a .ninfer v2 file")
        if PREFIX.size + json_len > size:
            raise OutOfBoundsError(f"{p}: JSON directory of {json_len} bytes runs past the end of the "
                                   f"{size}-byte file (truncated?)")
        raw = self._file.read(json_len)
        try:
            doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_dup_keys)
        except SchemaError as e:
            raise SchemaError(f"{p}: directory: {e}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SchemaError(f"{p}: directory is not valid UTF-8 JSON: {e}") from None
        self.model_family, tensors, resources, self.payload_sha256 = parse_directory(doc, p)
        self.format_version = doc["format_version"]
        self.payload_offset = align_up(PREFIX.size + json_len, ALIGN)
        payload = max(size - self.payload_offset, 0)
        end = check_placement(tensors + resources, payload, p)
        expected = self.payload_offset + align_up(end, ALIGN)
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            raise FileSizeError(f"{p}: file is {size} bytes but its directory implies {expected} ({what})")
        self.file_size = size
        self.tensors: dict[str, TensorEntry] = {t.name: t for t in tensors}
        self.resources: dict[str, ResourceEntry] = {r.name: r for r in resources}

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:     # a view is still alive; the mapping goes when it does
                pass
            self._mm = None
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def mapping(self) -> mmap.mmap:
        if self._mm is None:
            self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    # -- tensors -------------------------------------------------------------------------------
    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's encoded bytes: a read-only uint8 view of the mapping (no copy)."""
        t = self.entry(name)
        return np.frombuffer(self.mapping, np.uint8, count=t.bytes, offset=self.payload_offset + t.offset)

    def array(self, name: str) -> np.ndarray:
        """Zero-copy numpy view: typed and shaped for fp32/i32, raw bfloat16 bits (uint16) for bf16,
        the packed uint8 bytes for quantized formats."""
        t = self.entry(name)
        if t.format in _NUMPY_DTYPES:
            return self.raw(name).view(_NUMPY_DTYPES[t.format]).reshape(t.shape)
        return self.raw(name)

    def torch_view(self, name: str):
        """Zero-copy torch tensor over the read-only mapping (bf16/fp32/int32 shaped; packed formats
        as uint8 bytes). Never write to it: the pages are mapped read-only."""
        import torch
        t = self.entry(name)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "i32": torch.int32}.get(t.format, torch.uint8)
        with warnings.catch_warnings():   # torch warns that the buffer is not writable; that is the point
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(memoryview(self.mapping), dtype=torch.uint8, count=t.bytes,
                                    offset=self.payload_offset + t.offset)
        if dtype is torch.uint8:
            return flat
        return flat.view(dtype).reshape(t.shape)

    def decode(self, name: str) -> np.ndarray:
        """Dequantized float32 copy (the format's exact reconstruction)."""
        t = self.entry(name)
        return get_format(t.format).decode(self.raw(name), t.shape)

    def to_device(self, name: str, device, chunk_bytes: int = 64 << 20):
        """The tensor on `device`. CPU: the zero-copy view. Otherwise the bytes are copied straight
        from the mapping in `chunk_bytes` pieces through two reusable pinned buffers, so no host copy
        of the whole tensor (let alone the model) is ever made."""
        import torch
        dev = torch.device(device)
        src = self.torch_view(name)
        if dev.type == "cpu":
            return src
        out = torch.empty(src.shape, dtype=src.dtype, device=dev)
        copy_chunked(src.reshape(-1).view(torch.uint8), out.reshape(-1).view(torch.uint8), chunk_bytes,
                     self._pinned(chunk_bytes) if dev.type == "cuda" else None)
        return out

    def _pinned(self, chunk_bytes: int):
        import torch
        if self._staging is None or self._staging[0].numel() < chunk_bytes:
            self._staging = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        return self._staging

    # -- resources -----------------------------------------------------------------------------
    def resource(self, name: str) -> bytes:
        try:
            r = self.resources[name]
        except KeyError:
            raise KeyError(f"{self.path}: no resource {name!r} (has: {sorted(self.resources)})") from None
        start = self.payload_offset + r.offset
        return bytes(self.mapping[start:start + r.bytes])

    # -- integrity -----------------------------------------------------------------------------
    def verify(self) -> None:
        """Re-hash every object (in file order) and the whole payload; raise DigestMismatchError
        naming the first object whose bytes do not match its sha256."""
        objs = sorted(list(self.tensors.values()) + list(self.resources.values()), key=lambda o: o.offset)
        payload_hash = hashlib.sha256()
        fd, pos = self._file.fileno(), 0
        payload_len = self.file_size - self.payload_offset

        def feed(start: int, stop: int, *hashes) -> None:
            while start < stop:
                n = min(READ_CHUNK, stop - start)
                buf = os.pread(fd, n, self.payload_offset + start)
                if len(buf) != n:
                    raise OutOfBoundsError(f"{self.path}: short read at payload byte {start}")
                for h in hashes:
                    h.update(buf)
                start += n

        for o in objs:
            feed(pos, o.offset, payload_hash)
            h = hashlib.sha256()
            feed(o.offset, o.offset + o.bytes, payload_hash, h)
            pos = o.offset + o.bytes
            if h.hexdigest() != o.sha256:
                kind = "tensor" if isinstance(o, TensorEntry) else "resource"
                raise DigestMismatchError(f"{self.path}: {kind} {o.name!r} sha256 mismatch "
                                          f"(stored {o.sha256[:16]}…, computed {h.hexdigest()[:16]}…)")
        feed(pos, payload_len, payload_hash)
        if payload_hash.hexdigest() != self.payload_sha256:
            raise DigestMismatchError(f"{self.path}: payload_sha256 mismatch (padding between objects changed)")


def copy_chunked(src, dst, chunk_bytes: int, staging=None) -> None:
    """Copy flat uint8 tensor `src` (host, e.g. an mmap view) into `dst` (any device) piecewise.
    With `staging` (two pinned host buffers) each piece goes mmap -> pinned -> device asynchronously,
    alternating buffers so the disk/page-cache read of one piece overlaps the upload of the other."""
    import torch
    n = src.numel()
    if staging is None:
        for a in range(0, n, chunk_bytes):
            dst[a:a + chunk_bytes].copy_(src[a:a + chunk_bytes])
        return
    stream = torch.cuda.current_stream(dst.device)
    events = [None, None]
    for i, a in enumerate(range(0, n, chunk_bytes)):
        k = i % 2
        if events[k] is not None:
            events[k].synchronize()          # the upload that last used this buffer has finished
        m = min(chunk_bytes, n - a)
        buf = staging[k][:m]
        buf.copy_(src[a:a + m])
        dst[a:a + m].copy_(buf, non_blocking=True)
        events[k] = torch.cuda.Event()
        events[k].record(stream)
    stream.synchronize()


def open_artifact(path: str | os.PathLike) -> Artifact:
    return Artifact(path)
