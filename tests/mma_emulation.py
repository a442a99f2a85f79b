"""Warp-level emulation of mma.sync m16n8k16 (bf16 in, fp32 accumulate; here float64) for the CPU emulations of
tensor-core kernels: a kernel's fragments in, its D fragments out, so a test can run the kernel's index math
lane by lane without a GPU."""
from __future__ import annotations

import numpy as np

LANE = np.arange(32)
G_, C_ = LANE // 4, LANE % 4   # groupID and thread-in-group of each lane


def swizzle16(r: int, c: int, row_bytes: int) -> int:
    """The mma templates' swz(): byte offset of 16-byte chunk c of row r in a tile of row_bytes-byte rows (rows of
    8+ chunks XOR the chunk with the row's low bits; shorter rows swizzle the chunk's index over the tile)."""
    kc = row_bytes // 16
    if kc >= 8:
        return r * row_bytes + ((c ^ (r & 7)) << 4)
    u = r * kc + c
    return (u ^ ((u >> 3) & 7)) << 4


def bf16_pairs_to_f64(words: np.ndarray) -> np.ndarray:
    """u32 [...] (two bf16) -> float64 [..., 2] (low half first)."""
    w = np.asarray(words, np.uint32)
    lo = ((w & 0xFFFF) << 16).astype(np.uint32).view(np.float32)
    hi = (w & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.stack([lo, hi], axis=-1).astype(np.float64)


def mma_16816(a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """a: [4, 32] u32, b0/b1: [32] u32 (fragments) -> D fragments [32, 4] float64 of A(16x16) @ B(16x8)."""
    af, bf0, bf1 = bf16_pairs_to_f64(a), bf16_pairs_to_f64(b0), bf16_pairs_to_f64(b1)
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for e in range(2):
        A[G_, 2 * C_ + e] = af[0, :, e]
        A[G_ + 8, 2 * C_ + e] = af[1, :, e]
        A[G_, 2 * C_ + 8 + e] = af[2, :, e]
        A[G_ + 8, 2 * C_ + 8 + e] = af[3, :, e]
        B[2 * C_ + e, G_] = bf0[:, e]
        B[2 * C_ + 8 + e, G_] = bf1[:, e]
    D = A @ B
    return np.stack([D[G_, 2 * C_], D[G_, 2 * C_ + 1], D[G_ + 8, 2 * C_], D[G_ + 8, 2 * C_ + 1]], axis=1)


def bf16_bits(v) -> np.ndarray:
    """float32 values -> their bf16 bits, round to nearest even (as __float2bfloat16_rn)."""
    b = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF).astype(np.uint32)


def byte_perm(x: int, y: int, s: int) -> int:
    """__byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of y:x."""
    src = list(x.to_bytes(4, "little")) + list(y.to_bytes(4, "little"))
    return int.from_bytes(bytes(src[(s >> (4 * i)) & 7] for i in range(4)), "little")
