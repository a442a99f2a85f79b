"""Groupwise symmetric integer weight formats with FP16 scales: q4, q5, q6 (group 64), w8 (group 32).

Canonical encoder (normative; GPU dequant and the CPU reference reconstruct w = f32(s16) * code):
  amax = max|x| over the group (float32)
  amax == 0            -> scale +0, all codes 0
  s16 = fp16_rne(f32(amax / qmax))      qmax = 7 / 15 / 31 / 127 (not |qmin|)
  s16 == 0 (underflow) -> s16 = 0x0001 (smallest subnormal), so the group does not vanish
  s16 == inf           -> ScaleOverflowError
  inv = f32(1 / f32(s16)); code = clamp(rne(f32(x * inv)), qmin, qmax)
  qmin = -8 / -16 / -32 for q4/q5/q6, -127 for w8 (-128 never occurs, so w8 codes negate safely).
Reciprocal-multiply is part of the definition: x / s can round differently.
Byte layout of a 128-row tile (specs/formats.md): code plane (q*: low 4 bits of two lanes per byte,
even lane in the low nibble; w8: one int8 per lane), then for q5/q6 a high-bit plane (the 1 or 2
bits above the low nibble, lane-major, LSB first), then the FP16 scale plane, each 256-aligned.
"""
from __future__ import annotations

import numpy as np

from .format_base import FormatError, ScaleOverflowError, TiledFormat

F16_TINY = np.array([1], np.uint16).view(np.float16)[0]    # 2**-24, the smallest fp16 subnormal


class GroupIntFormat(TiledFormat):
    def __init__(self, name: str, bits: int, group: int):
        self.name, self.bits, self.group = name, bits, group
        self.qmax = 127 if bits == 8 else (1 << (bits - 1)) - 1
        self.qmin = -127 if bits == 8 else -(1 << (bits - 1))
        self.high_bits = bits - 4 if bits in (5, 6) else 0

    # plane sizes for r rows of kp lanes: codes, [high bits], scales
    def plane_sizes(self, r, kp):
        codes = r * kp if self.bits == 8 else r * kp // 2
        sizes = [codes]
        if self.high_bits:
            sizes.append(r * kp * self.high_bits // 8)
        sizes.append(r * (kp // self.group) * 2)
        return sizes

    def scales(self, g: np.ndarray, name: str, row0: int) -> np.ndarray:
        """g: [..., groups, G] float32 -> fp16 scales [..., groups] per the canonical rule."""
        amax = np.abs(g).max(axis=-1)
        with np.errstate(over="ignore"):
            s16 = (amax / np.float32(self.qmax)).astype(np.float16)
        if np.isinf(s16).any():
            idx = [int(i) for i in np.argwhere(np.isinf(s16))[0]]
            raise ScaleOverflowError(
                f"tensor {name!r}: group {idx} (tile-local index, first row {row0}) has max|x| = "
                f"{float(amax[tuple(idx)])}, its {self.name} scale exceeds the FP16 maximum 65504")
        s16[(s16 == 0) & (amax > 0)] = F16_TINY
        return s16

    def encode_tiles(self, x, name, row0, amax=None):
        nt, r, kp = x.shape
        g = x.reshape(nt, r, kp // self.group, self.group)
        s16 = self.scales(g, name, row0)
        sf = s16.astype(np.float32)
        inv = np.zeros_like(sf)
        np.divide(np.float32(1), sf, out=inv, where=sf > 0)
        q = g * inv[..., None]                     # float32 product, then round half to even
        np.rint(q, out=q)
        np.clip(q, self.qmin, self.qmax, out=q)
        codes = q.astype(np.int8).reshape(nt, r * kp)
        planes = [self.pack_low(codes)]
        if self.high_bits:
            planes.append(self.pack_high(codes))
        planes.append(s16.astype("<f2").view(np.uint8).reshape(nt, -1))
        return planes

    def pack_low(self, codes: np.ndarray) -> np.ndarray:
        u = codes.view(np.uint8)
        if self.bits == 8:
            return u
        lo = u & 0x0F
        return lo[:, 0::2] | (lo[:, 1::2] << 4)

    def pack_high(self, codes: np.ndarray) -> np.ndarray:
        # arithmetic shift keeps two's complement: bits 4.. of the code are the sign-extended top
        h = ((codes >> 4) & ((1 << self.high_bits) - 1)).astype(np.uint8)
        if self.high_bits == 1:
            return np.packbits(h, axis=-1, bitorder="little")
        h = h.reshape(h.shape[0], -1, 4)
        return h[..., 0] | (h[..., 1] << 2) | (h[..., 2] << 4) | (h[..., 3] << 6)

    def unpack_codes(self, planes, r, kp) -> np.ndarray:
        nt = planes[0].shape[0]
        base = np.ascontiguousarray(planes[0])
        if self.bits == 8:
            return base.view(np.int8).reshape(nt, r, kp).astype(np.int16)
        u = np.empty((nt, r * kp), np.uint8)
        u[:, 0::2] = base & 0x0F
        u[:, 1::2] = base >> 4
        if self.high_bits == 1:
            u |= np.unpackbits(planes[1], axis=-1, bitorder="little") << 4
        elif self.high_bits == 2:
            hb = planes[1]
            for j in range(4):
                u[:, j::4] |= ((hb >> (2 * j)) & 3) << 4
        c = u.astype(np.int16)
        c[c >= (1 << (self.bits - 1))] -= 1 << self.bits       # sign-extend from `bits`
        return c.reshape(nt, r, kp)

    def decode_tiles(self, planes, r, kp, header):
        nt = planes[0].shape[0]
        codes = self.unpack_codes(planes, r, kp)
        if self.bits == 8 and (codes == -128).any():
            raise FormatError("w8 code -128 is not a legal code")
        s = np.ascontiguousarray(planes[-1]).view("<f2").astype(np.float32).reshape(nt, r, kp // self.group)
        g = codes.reshape(nt, r, kp // self.group, self.group).astype(np.float32)
        return (g * s[..., None]).reshape(nt, r, kp)      # exact: 11-bit x 8-bit fits float32

    def error_bound(self, x):
        """0.5 * amax/qmax per group, widened by 2**-10 for the FP16 rounding of the scale (and the
        float32 rounding of x*inv), plus qmax * 2**-25 for groups whose scale is an FP16 subnormal
        (absolute rounding of the scale up to 2**-25 can make the largest element clamp)."""
        g = self.padded_groups(x, self.group)
        amax = np.abs(g).max(-1).astype(np.float64)
        bound = 0.5 * amax / self.qmax * (1 + 2.0 ** -10) + self.qmax * 2.0 ** -25
        bound[amax == 0] = 0.0
        return self.ungroup(np.broadcast_to(bound[..., None], g.shape), x.shape)


Q4 = GroupIntFormat("q4", 4, 64)
Q5 = GroupIntFormat("q5", 5, 64)
Q6 = GroupIntFormat("q6", 6, 64)
W8 = GroupIntFormat("w8", 8, 32)
