"""NVRTC through cuda-python: one generated translation unit -> one cubin.

Include directories come from cuda.pathfinder (CUDA headers, CCCL) and cutlass_library (CUTLASS/CuTe),
never from /usr/local/cuda. We ship cubins, not PTX: the H200's driver rejects PTX newer than ISA 9.0.
"""
from __future__ import annotations

import functools
import re

BASE_OPTIONS = ("-std=c++17", "-default-device", "-DNDEBUG")


class CompileError(Exception):
    pass


@functools.lru_cache(maxsize=1)
def version() -> str:
    from cuda.bindings import nvrtc
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=1)
def include_dirs() -> tuple[str, ...]:
    import cuda.pathfinder as pf
    dirs = []
    for lib in ("cudart", "cccl"):
        d = pf.find_nvidia_header_directory(lib)
        if d is None:
            raise CompileError(f"CUDA headers for {lib!r} not found: install the pinned cuda-toolkit wheels (make setup)")
        dirs.append(str(d))
    try:
        import os
        import cutlass_library
        dirs.append(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))
    except ImportError:
        pass  # only CuTe/CUTLASS templates need it; they fail with a clear include error without it
    return tuple(dirs)


def options(arch: str) -> list[str]:
    return [*BASE_OPTIONS, f"--gpu-architecture={arch}", *(f"-I{d}" for d in include_dirs())]


def _check(err, what):
    from cuda.bindings import nvrtc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")


def compile_cubin(source: str, name: str, arch: str) -> tuple[bytes, str]:
    """Compile to a cubin for `arch` (e.g. sm_90a). Returns (cubin, log); raises CompileError with the log."""
    from cuda.bindings import nvrtc
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options(arch)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = bytearray(size)  # never b" " * n: for n == 1 that is Python's shared b" " object, which NVRTC overwrites
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = bytes(buf).rstrip(b"\x00").decode(errors="replace").strip()
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(log or str(err))
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN")
        return bytes(cubin), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def explain(log: str, source_name: str, line_map: list | None) -> str:
    """Annotate `name(LINE): error` lines of an NVRTC log with the template file and line that made them."""
    if not line_map:
        return log

    def where(line: int) -> str | None:
        for start, tpl, tline, count in line_map:
            if start <= line < start + count:
                return f"codegen/templates/{tpl}:{tline + line - start}"
        return None

    out = []
    pat = re.compile(re.escape(source_name) + r"\((\d+)\)")
    for ln in log.splitlines():
        m = pat.search(ln)
        w = where(int(m.group(1))) if m else None
        out.append(f"{ln}\n    [from {w}]" if w else ln)
    return "\n".join(out)
