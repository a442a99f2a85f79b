"""Floating-point packed formats: fp8 (E4M3 codes, per-row FP32 scale), fp8_b128 (E4M3 codes, one
FP32 scale per 128x128 block) and nvfp4 (E2M1 codes, one E4M3 scale per 16 lanes, one FP32 tensor
scale). Minifloat rounding is done here in numpy on float32 bit patterns, so it does not depend on a
torch version's cast rules (the tests cross-check it against torch's float8_e4m3fn cast).

E4M3 is the "fn" variant: bias 7, no infinities, max 448, 0x7F/0xFF are NaN (never produced).
E2M1: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (code bits S.EE.M), no NaN/inf.
"""
from __future__ import annotations

import numpy as np

from .format_base import FormatError, TiledFormat, align_up, as_matrix_shape

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MIDS = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2
MIN_SCALE = np.float32(2.0 ** -100)    # keeps 1/scale finite; far below any real weight scale


def _e4m3_table() -> np.ndarray:
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))
    mag[(e == 15) & (m == 7)] = np.nan
    return np.where(b >= 128, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_table()


def e4m3_encode(y: np.ndarray, mode: str = "rne") -> np.ndarray:
    """float32 (|y| <= 448) -> E4M3 code bytes. mode 'rne' rounds to nearest even, 'ceil' rounds the
    magnitude up (used for scales so that no element has to clip). Zero of either sign -> 0x00.
    Normal range: round the float32 bit pattern to 3 mantissa bits (the carry ripples into the
    exponent, as it should) and rebias the exponent 127 -> 7. Below 2**-6 the E4M3 grid is uniform
    with step 2**-9, so the code is simply round(|y| * 512) (code 8 is the smallest normal)."""
    y = np.asarray(y, np.float32)
    a = np.abs(y)
    u = a.view(np.uint32)
    if mode == "rne":
        norm = (u + np.uint32(0x7FFFF) + ((u >> 20) & np.uint32(1))) >> 20
        sub = np.rint(a * np.float32(512))
    else:
        norm = (u + np.uint32(0xFFFFF)) >> 20
        sub = np.ceil(a * np.float32(512))
    code = np.where(a >= np.float32(2.0 ** -6), norm.astype(np.int32) - ((127 - 7) << 3),
                    sub.astype(np.int32))
    code = np.minimum(code, 0x7E)                            # 448; callers clamp beforehand
    code |= (np.signbit(y) & (code > 0)).astype(np.int32) << 7
    return code.astype(np.uint8)


def e2m1_encode(y: np.ndarray) -> np.ndarray:
    """float32 (|y| <= 6) -> 4-bit E2M1 codes (uint8 0..15), round to nearest, ties to the even code.
    The magnitude index is the number of midpoints below |y|; at a midpoint between an odd and an
    even index the comparison is '>=' (tie goes up to the even one), otherwise '>'."""
    y = np.asarray(y, np.float32)
    a = np.abs(y)
    idx = np.zeros(a.shape, np.uint8)
    for i, mid in enumerate(_E2M1_MIDS):
        idx += (a >= mid) if i % 2 == 1 else (a > mid)
    return idx | ((np.signbit(y) & (idx > 0)).astype(np.uint8) << 3)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    mag = E2M1_GRID[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


def _row_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """FP32 scale with amax / scale <= qmax; 0 for all-zero rows/blocks."""
    s = np.maximum((amax / np.float32(qmax)).astype(np.float32), MIN_SCALE)
    return np.where(amax > 0, s, np.float32(0)).astype(np.float32)


def _recip(s: np.ndarray) -> np.ndarray:
    inv = np.zeros_like(s)
    np.divide(np.float32(1), s, out=inv, where=s > 0)
    return inv


class Fp8Format(TiledFormat):
    """E4M3 codes (one byte per lane) + FP32 scales: per row (block=None) or per 128x128 block.
    scale = max(f32(amax / 448), 2**-100) (0 when amax == 0); code = e4m3_rne(clamp(f32(x * f32(1/scale))))."""

    def __init__(self, name: str, block: int | None):
        self.name, self.block = name, block

    def plane_sizes(self, r, kp):
        scales = r * 4 if self.block is None else (kp // self.block) * 4
        return [r * kp, scales]

    def encode_tiles(self, x, name, row0, amax=None):
        nt, r, kp = x.shape
        if self.block is None:
            s = _row_scale(np.abs(x).max(-1), E4M3_MAX)                       # [nt, r]
            inv = _recip(s)[..., None]
        else:
            xb = x.reshape(nt, r, kp // self.block, self.block)
            s = _row_scale(np.abs(xb).max(axis=(1, 3)), E4M3_MAX)             # [nt, kp/128]
            inv = np.repeat(_recip(s), self.block, axis=-1)[:, None, :]
        y = np.clip(x * inv, -E4M3_MAX, E4M3_MAX)
        codes = e4m3_encode(y).reshape(nt, r * kp)
        return [codes, s.astype("<f4").view(np.uint8).reshape(nt, -1)]

    def decode_tiles(self, planes, r, kp, header):
        nt = planes[0].shape[0]
        vals = E4M3_VALUES[planes[0]].reshape(nt, r, kp)
        s = np.ascontiguousarray(planes[1]).view("<f4").astype(np.float32)
        if self.block is None:
            return vals * s.reshape(nt, r, 1)
        return vals * np.repeat(s.reshape(nt, 1, -1), self.block, axis=-1)

    def error_bound(self, x):
        """|x| * 2**-4 (half an E4M3 ulp, relative) + scale * 2**-10 (half the subnormal step),
        widened by 2**-20 relative for the float32 products."""
        n, k = as_matrix_shape(np.shape(x))
        m = np.abs(np.asarray(x, np.float64).reshape(n, k))
        if self.block is None:
            scale = np.broadcast_to(m.max(-1, keepdims=True) / E4M3_MAX, m.shape)
        else:
            b = self.block
            rp, kp = align_up(n, b), align_up(k, b)
            mp = np.zeros((rp, kp))
            mp[:n, :k] = m
            blk = mp.reshape(rp // b, b, kp // b, b).max(axis=(1, 3))
            scale = np.repeat(np.repeat(blk, b, 0), b, 1)[:n, :k] / E4M3_MAX
        bound = (m * 2.0 ** -4 + (scale + float(MIN_SCALE)) * 2.0 ** -10) * (1 + 2.0 ** -20)
        return bound.reshape(np.shape(x))


class NvFp4Format(TiledFormat):
    """NVFP4: E2M1 codes (two lanes per byte, even lane low nibble), one E4M3 scale per 16 lanes,
    one FP32 tensor scale in a 256-byte object header.
      sg  = max(f32(amax_tensor / (6 * 448)), 2**-100)   (1.0 for an all-zero tensor)
      sb  = e4m3_ceil(min(f32(amax_block / f32(6 * sg)), 448))   rounded UP so no lane clips
      eff = f32(e4m3(sb) * sg); code = e2m1_rne(clamp(f32(x * f32(1/eff)), -6, 6))
      decode: f32(e2m1(code) * eff)"""
    name = "nvfp4"
    header_bytes = 256
    needs_amax = True
    block = 16

    def plane_sizes(self, r, kp):
        return [r * kp // 2, r * kp // self.block]

    @staticmethod
    def global_scale(amax: float) -> np.float32:
        if amax == 0:
            return np.float32(1.0)
        return max(np.float32(np.float32(amax) / np.float32(6 * E4M3_MAX)), MIN_SCALE)

    def header(self, shape, amax=None):
        if amax is None:
            raise FormatError("nvfp4 needs the tensor's max|x| (two-pass encode)")
        h = np.zeros(self.header_bytes, np.uint8)
        h[:4] = np.array([self.global_scale(amax)], "<f4").view(np.uint8)
        return h

    def encode_tiles(self, x, name, row0, amax=None):
        if amax is None:
            raise FormatError(f"tensor {name!r}: nvfp4 needs the tensor's max|x| (two-pass encode)")
        nt, r, kp = x.shape
        sg = self.global_scale(amax)
        xb = x.reshape(nt, r, kp // self.block, self.block)
        q = (np.abs(xb).max(-1) / np.float32(6 * sg)).astype(np.float32)
        sb = e4m3_encode(np.minimum(q, np.float32(E4M3_MAX)), mode="ceil")
        eff = (E4M3_VALUES[sb] * sg).astype(np.float32)
        y = np.clip(xb * _recip(eff)[..., None], -E2M1_MAX, E2M1_MAX)
        c = e2m1_encode(y).reshape(nt, r * kp)
        return [c[:, 0::2] | (c[:, 1::2] << 4), sb.reshape(nt, -1)]

    def decode_tiles(self, planes, r, kp, header):
        nt = planes[0].shape[0]
        sg = np.ascontiguousarray(header[:4]).view("<f4")[0]
        c = np.empty((nt, r * kp), np.uint8)
        c[:, 0::2] = planes[0] & 0x0F
        c[:, 1::2] = planes[0] >> 4
        eff = (E4M3_VALUES[planes[1]] * sg).astype(np.float32).reshape(nt, r, kp // self.block, 1)
        vals = e2m1_decode(c).reshape(nt, r, kp // self.block, self.block)
        return (vals * eff).reshape(nt, r, kp)

    def error_bound(self, x):
        """Half the widest E2M1 gap (1.0, between 4 and 6) times the effective block scale, which is
        at most amax_block/6 * (1 + 2**-3) (E4M3 rounded up) + one E4M3 subnormal step * sg."""
        x = np.asarray(x, np.float32)
        g = self.padded_groups(x, self.block)
        amax_t = float(np.abs(x).max()) if x.size else 0.0
        sg = float(self.global_scale(amax_t))
        amax = np.abs(g).max(-1).astype(np.float64)
        eff = amax / 6 * (1 + 2.0 ** -3) + 2.0 ** -9 * sg
        bound = eff * (1 + 2.0 ** -20) + np.abs(g).astype(np.float64).max(-1) * 2.0 ** -22
        bound[amax == 0] = 0.0
        return self.ungroup(np.broadcast_to(bound[..., None], g.shape), x.shape)


FP8 = Fp8Format("fp8", None)
FP8_B128 = Fp8Format("fp8_b128", 128)
NVFP4 = NvFp4Format()
