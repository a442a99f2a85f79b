"""The `.ninfer` container's framing, closed JSON schema and typed errors (shared by reader and writer).

File = prefix | JSON directory | zero padding | payload
  prefix   16 bytes: magic b"NINFER\\x00\\x02" (last byte = framing revision) + u64 LE JSON byte count
  JSON     UTF-8, starts at byte 16 (closed schema below; unknown, missing or null members are errors)
  payload  starts at payload_offset = align_up(16 + json_bytes, 4096); object offsets are relative
           to it and 4096-aligned; the file ends at payload_offset + align_up(end of last object, 4096)
           and payload_sha256 covers every payload byte (objects and zero padding).
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from .formats import FORMATS, FormatError

MAGIC = b"NINFER\x00\x02"
FORMAT_VERSION = 2
PREFIX = struct.Struct("<8sQ")
ALIGN = 4096
FLAGS = ("mtp", "visual")
ROOT_KEYS = ("format_version", "model_family", "tensors", "resources", "payload_sha256")
TENSOR_KEYS = ("name", "shape", "format", "layout", "offset", "bytes", "sha256", "role", "flags")
RESOURCE_KEYS = ("name", "offset", "bytes", "sha256")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_ROLE = re.compile(r"^[a-z][A-Za-z0-9_]*$")


class ArtifactError(Exception):
    """Base of every container error; messages name the file and the object."""


class BadMagicError(ArtifactError):
    pass


class SchemaError(ArtifactError):
    """The JSON directory is not valid JSON or breaks the closed schema."""


class SizeMismatchError(ArtifactError):
    """An object's byte count does not match its (format, shape)."""


class OverlapError(ArtifactError):
    pass


class OutOfBoundsError(ArtifactError):
    """An object (or the directory) lies past the end of the file: usually a truncated file."""


class FileSizeError(ArtifactError):
    """The file is longer or shorter than its directory says."""


class DigestMismatchError(ArtifactError):
    pass


class WriteError(ArtifactError):
    """The writer was used out of order or given the wrong number of bytes."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple
    format: str
    layout: str
    offset: int
    bytes: int
    sha256: str
    role: str
    flags: tuple

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "format": self.format, "layout": self.layout,
                "offset": self.offset, "bytes": self.bytes, "sha256": self.sha256, "role": self.role,
                "flags": list(self.flags)}


@dataclass(frozen=True)
class ResourceEntry:
    name: str
    offset: int
    bytes: int
    sha256: str

    def to_json(self) -> dict:
        return {"name": self.name, "offset": self.offset, "bytes": self.bytes, "sha256": self.sha256}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _keys(obj, expected, where: str) -> None:
    if not isinstance(obj, dict):
        raise SchemaError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in expected if k not in obj]
    extra = sorted(set(obj) - set(expected))
    if missing or extra:
        raise SchemaError(f"{where}: " + "; ".join(
            ([f"missing member(s) {missing}"] if missing else []) + ([f"unknown member(s) {extra}"] if extra else []))
            + f" (allowed: {list(expected)})")
    nulls = [k for k, v in obj.items() if v is None]
    if nulls:
        raise SchemaError(f"{where}: member(s) {nulls} are null")


def _offset_bytes(obj, where: str) -> tuple[int, int]:
    off, n = obj["offset"], obj["bytes"]
    if not _is_int(off) or off < 0 or off % ALIGN:
        raise SchemaError(f"{where}: offset {off!r} must be a non-negative multiple of {ALIGN}")
    if not _is_int(n) or n < 0:
        raise SchemaError(f"{where}: bytes {n!r} must be a non-negative integer")
    if not isinstance(obj["sha256"], str) or not _HEX64.match(obj["sha256"]):
        raise SchemaError(f"{where}: sha256 must be 64 lowercase hex digits")
    return off, n


def check_tensor_fields(name, shape, fmt, role, flags, where: str) -> int:
    """Validate a tensor's descriptive fields; return its byte count from (format, shape)."""
    if not isinstance(name, str) or not name:
        raise SchemaError(f"{where}: name must be a non-empty string")
    if not isinstance(shape, (list, tuple)) or not all(_is_int(d) and d > 0 for d in shape):
        raise SchemaError(f"{where}: shape {shape!r} must be a list of positive integers")
    if fmt not in FORMATS:
        raise SchemaError(f"{where}: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if not isinstance(role, str) or not _ROLE.match(role):
        raise SchemaError(f"{where}: role {role!r} must match [a-z][A-Za-z0-9_]*")
    if not isinstance(flags, (list, tuple)) or any(f not in FLAGS for f in flags) or len(set(flags)) != len(flags):
        raise SchemaError(f"{where}: flags {flags!r} must be distinct values from {list(FLAGS)}")
    try:
        return FORMATS[fmt].nbytes(tuple(shape))
    except FormatError as e:
        raise SchemaError(f"{where}: {e}") from None


def parse_directory(doc, path: str) -> tuple[str, list[TensorEntry], list[ResourceEntry], str]:
    """Validate the decoded JSON directory; return (model_family, tensors, resources, payload_sha256)."""
    _keys(doc, ROOT_KEYS, f"{path}: directory root")
    if doc["format_version"] != FORMAT_VERSION or not _is_int(doc["format_version"]):
        raise SchemaError(f"{path}: format_version {doc['format_version']!r} is not supported "
                          f"(this reader knows {FORMAT_VERSION})")
    if not isinstance(doc["model_family"], str) or not doc["model_family"]:
        raise SchemaError(f"{path}: model_family must be a non-empty string")
    if not isinstance(doc["payload_sha256"], str) or not _HEX64.match(doc["payload_sha256"]):
        raise SchemaError(f"{path}: payload_sha256 must be 64 lowercase hex digits")
    for key in ("tensors", "resources"):
        if not isinstance(doc[key], list):
            raise SchemaError(f"{path}: {key} must be a list")
    tensors, seen = [], set()
    for i, t in enumerate(doc["tensors"]):
        where = f"{path}: tensors[{i}]" + (f" {t.get('name')!r}" if isinstance(t, dict) else "")
        _keys(t, TENSOR_KEYS, where)
        expected = check_tensor_fields(t["name"], t["shape"], t["format"], t["role"], t["flags"], where)
        if t["layout"] != FORMATS[t["format"]].layout:
            raise SchemaError(f"{where}: layout {t['layout']!r} does not match format {t['format']} "
                              f"(expects {FORMATS[t['format']].layout!r})")
        off, n = _offset_bytes(t, where)
        if n != expected:
            raise SizeMismatchError(f"{where}: bytes {n} but format {t['format']} with shape {t['shape']} "
                                    f"needs {expected}")
        if t["name"] in seen:
            raise SchemaError(f"{where}: duplicate tensor name")
        seen.add(t["name"])
        tensors.append(TensorEntry(t["name"], tuple(t["shape"]), t["format"], t["layout"], off, n,
                                   t["sha256"], t["role"], tuple(t["flags"])))
    resources, seen = [], set()
    for i, r in enumerate(doc["resources"]):
        where = f"{path}: resources[{i}]" + (f" {r.get('name')!r}" if isinstance(r, dict) else "")
        _keys(r, RESOURCE_KEYS, where)
        if not isinstance(r["name"], str) or not r["name"] or r["name"] in seen:
            raise SchemaError(f"{where}: name must be a unique non-empty string")
        seen.add(r["name"])
        off, n = _offset_bytes(r, where)
        resources.append(ResourceEntry(r["name"], off, n, r["sha256"]))
    return doc["model_family"], tensors, resources, doc["payload_sha256"]


def check_placement(objects, payload_bytes: int, path: str) -> int:
    """No overlaps, everything inside the payload; returns the end of the last object."""
    spans = sorted(((o.offset, o.offset + o.bytes, o) for o in objects), key=lambda s: (s[0], s[1]))
    end, prev = 0, None
    for start, stop, obj in spans:
        kind = "tensor" if isinstance(obj, TensorEntry) else "resource"
        if stop > payload_bytes:
            raise OutOfBoundsError(f"{path}: {kind} {obj.name!r} spans payload bytes [{start}, {stop}) but the "
                                   f"payload holds only {payload_bytes} bytes (truncated file?)")
        if prev is not None and start < end:
            raise OverlapError(f"{path}: {kind} {obj.name!r} at [{start}, {stop}) overlaps {prev.name!r} "
                               f"which ends at {end}")
        if prev is None or stop >= end:
            end, prev = stop, obj
    return end
