"""Cubin cache keyed by (source hash, arch, options, NVRTC version), and the cubin's own arch check."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

from . import nvrtc
from .paths import cache_dir, generated_dir


class CubinError(Exception):
    pass


def cache_key(kernel: dict) -> str:
    blob = json.dumps([kernel["source_sha256"], kernel["arch"], list(nvrtc.BASE_OPTIONS), nvrtc.version()])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_path(kernel: dict) -> Path:
    return cache_dir() / kernel["arch"] / f"{kernel['symbol']}-{cache_key(kernel)}.cubin"


def cubin_sm(cubin: bytes) -> int:
    """The SM version an NVIDIA cubin was built for (ELF64 e_flags bits 8..15, e.g. 90 for sm_90a)."""
    if len(cubin) < 64 or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise CubinError("not a 64-bit ELF cubin")
    return (struct.unpack_from("<I", cubin, 48)[0] >> 8) & 0xFF


def check_arch(cubin: bytes, kernel: dict, cc: int) -> None:
    sm = cubin_sm(cubin)
    if sm != cc:
        raise CubinError(f"cubin for {kernel['symbol']} was built for sm_{sm}, but {kernel['arch']} (sm_{cc}) "
                         f"was expected; rebuild with `make build`")


def read_source(kernel: dict) -> str:
    path = generated_dir() / kernel["source"]
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        raise CubinError(f"generated source {path} is missing: run `make generate`") from None
    if hashlib.sha256(text.encode()).hexdigest() != kernel["source_sha256"]:
        raise CubinError(f"{path} does not match the manifest (edited or stale): run `make generate`")
    return text


def compile_kernel(kernel: dict) -> tuple[Path, bool, float]:
    """Make sure the kernel's cubin is in the cache. Returns (path, compiled_now, seconds)."""
    import time
    path = cache_path(kernel)
    if path.is_file():
        return path, False, 0.0
    source = read_source(kernel)
    t0 = time.perf_counter()
    name = f"generated/{kernel['source']}"
    try:
        cubin, _ = nvrtc.compile_cubin(source, name, kernel["arch"])
    except nvrtc.CompileError as e:
        raise nvrtc.CompileError(
            f"{kernel['spec']}: route {kernel['op']}/{kernel['route']} tile {kernel['tile']} "
            f"({kernel['arch']}, {kernel['dtype']}), template codegen/templates/{kernel['template']}:\n"
            + nvrtc.explain(str(e), name, kernel.get("line_map"))) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path, True, time.perf_counter() - t0
