"""Weight formats of the .ninfer artifact: the registry and the direct (unpacked) formats.

Formats (byte layouts in specs/formats.md):
  fp32, bf16, i32        layout contiguous-v1: C order, little endian, any rank
  q4, q5, q6, w8         groupwise symmetric int, FP16 scales           (format_int.py)
  fp8, fp8_b128, nvfp4   E4M3 / E2M1 minifloats with scales              (format_fp8.py)
Packed formats use layout rowtile128-v1 (format_base.py).

Every format offers encode(x) -> uint8 bytes, decode(bytes, shape) -> float32, nbytes(shape) and
error_bound(x); the converter streams with encode_rows(). Non-finite input raises NonFiniteError
naming the tensor.
"""
from __future__ import annotations

import numpy as np

from .format_base import (Format, FormatError, FormatShapeError, NonFiniteError,  # noqa: F401 (re-exported)
                          ScaleOverflowError, UnknownFormatError, as_matrix_shape, check_finite)
from .format_fp8 import FP8, FP8_B128, NVFP4
from .format_int import Q4, Q5, Q6, W8


class DirectFormat(Format):
    layout = "contiguous-v1"

    def nbytes(self, shape) -> int:
        self.check_shape(shape)
        n, k = as_matrix_shape(shape)
        return n * k * self.itemsize

    def decode(self, buf, shape) -> np.ndarray:
        raw = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
        if raw.size != self.nbytes(shape):
            raise FormatError(f"format {self.name}: {raw.size} bytes given, shape {list(shape)} "
                              f"needs {self.nbytes(shape)}")
        return self.values(np.ascontiguousarray(raw)).reshape(shape)


class Fp32Format(DirectFormat):
    name, itemsize, is_float_exact = "fp32", 4, True

    def encode_rows(self, rows, name="tensor", row0=0, amax=None):
        rows = np.asarray(rows, np.float32)
        check_finite(rows, name, row0)
        return np.ascontiguousarray(rows, "<f4").view(np.uint8).reshape(-1)

    def values(self, raw):
        return raw.view("<f4").astype(np.float32)

    def error_bound(self, x):
        return np.zeros(np.shape(x))


class Bf16Format(DirectFormat):
    """bfloat16 = the top 16 bits of the float32 pattern after round-to-nearest-even."""
    name, itemsize, is_float_exact = "bf16", 2, True

    def encode_rows(self, rows, name="tensor", row0=0, amax=None):
        rows = np.ascontiguousarray(rows, np.float32)
        check_finite(rows, name, row0)
        u = rows.view(np.uint32)
        b = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype("<u2")
        if ((b & 0x7F80) == 0x7F80).any():
            idx = [int(i) for i in np.argwhere((b & 0x7F80) == 0x7F80)[0]]
            idx[0] += row0
            raise FormatError(f"tensor {name!r}: value at index {idx} overflows bfloat16 "
                              f"(|x| > 3.3961e38 rounds to inf)")
        return b.view(np.uint8).reshape(-1)

    def values(self, raw):
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)

    def error_bound(self, x):
        # half a bf16 ulp (8 significant bits) relative, plus half the smallest subnormal step
        return np.abs(np.asarray(x, np.float64)) * 2.0 ** -8 + 2.0 ** -134


class I32Format(DirectFormat):
    name, itemsize = "i32", 4

    def encode_rows(self, rows, name="tensor", row0=0, amax=None):
        rows = np.asarray(rows)
        if rows.dtype.kind == "f":
            check_finite(rows, name, row0)
            if (rows != np.rint(rows)).any() or np.abs(rows).max(initial=0) > 2**31 - 1:
                raise FormatError(f"tensor {name!r}: i32 needs integral values within int32 range")
        return np.ascontiguousarray(rows, "<i4").view(np.uint8).reshape(-1)

    def values(self, raw):
        return raw.view("<i4").astype(np.float32)

    def decode_int(self, buf, shape) -> np.ndarray:
        return np.frombuffer(buf, "<i4").reshape(shape).astype(np.int32)

    def error_bound(self, x):
        return np.zeros(np.shape(x))


FP32, BF16, I32 = Fp32Format(), Bf16Format(), I32Format()

FORMATS: dict[str, Format] = {f.name: f for f in (FP32, BF16, I32, Q4, Q5, Q6, W8, FP8, FP8_B128, NVFP4)}
LAYOUTS = {f.layout for f in FORMATS.values()}
# Formats a recipe may pick for weights that are never quantized (norms, gates, router, ...).
FLOAT_FORMATS = ("fp32", "bf16")
WEIGHT_FORMATS = ("fp32", "bf16", "w8", "q4", "q5", "q6", "fp8", "fp8_b128", "nvfp4")


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownFormatError(f"unknown format {name!r}; known: {', '.join(FORMATS)}") from None


def nbytes(fmt: str, shape) -> int:
    return get_format(fmt).nbytes(shape)


def encode(fmt: str, x: np.ndarray, name: str = "tensor") -> np.ndarray:
    return get_format(fmt).encode(x, name)


def decode(fmt: str, buf, shape) -> np.ndarray:
    return get_format(fmt).decode(buf, shape)


def error_bound(fmt: str, x: np.ndarray) -> np.ndarray:
    return get_format(fmt).error_bound(x)
