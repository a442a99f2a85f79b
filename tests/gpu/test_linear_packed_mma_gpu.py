"""The `mma` route of linear_{q4,q5,q6,w8,fp8} (codegen/templates/linear_packed_mma.cu.j2).

CPU part (runs everywhere): a bit-exact emulation of the kernel's load/decode step -- which packed bytes
each thread copies into shared memory (addresses, zero fill, alignment), how those bytes become the bf16
weight tile and the fp32 group scales, and the smem layout -- checked against reference_quant.unpack on
short last tiles and K % 128 != 0. It mirrors the template's constants and index math line by line, so
a change to one must be made to the other.

GPU part (marker `gpu`, skips without a GPU): every tile of every format against the reference backend
under the op's tolerance (linear_tc) on odd shapes and T = 1..200, the route table around its span
boundaries, and one real 27B shape.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ninfer.runtime import formats
from ninfer.runtime.reference_quant import unpack
from tests.mma_emulation import LANE, byte_perm, mma_16816, swizzle16

ROOT = Path(__file__).resolve().parents[2]
FMTS = ["q4", "q5", "q6", "w8", "fp8"]


def mma_tiles(fmt: str) -> dict:
    spec = yaml.safe_load((ROOT / "specs" / "routes" / f"linear_{fmt}.yaml").read_text())
    return next(r for r in spec["routes"] if r["name"] == "mma")["tiles"]


# ---------------------------------------------------------------------------------------------------
# Emulation of the kernel (keep in step with linear_packed_mma.cu.j2)
# ---------------------------------------------------------------------------------------------------

def a256(v: int) -> int:
    return (v + 255) & ~255


class Layout:
    """The template's enum for one (format, tile)."""

    def __init__(self, fmt: str, tile: dict):
        self.fmt = fmt
        self.bits = {"q4": 4, "q5": 5, "q6": 6, "w8": 8, "fp8": 8}[fmt]
        self.fp8 = fmt == "fp8"
        self.high = {5: 1, 6: 2}.get(self.bits, 0)
        self.sgroup = {"q4": 64, "q5": 64, "q6": 64, "w8": 32, "fp8": 0}[fmt]
        lowbits = 8 if self.bits == 8 else 4
        self.code_row, self.high_row = 128 * lowbits // 8, 16 * self.high
        self.scale_row = 0 if self.fp8 else 128 // self.sgroup * 2
        self.bm, self.bn, self.bk, self.stages = tile["bm"], tile["bn"], tile["bk"], tile["stages"]
        assert 128 % self.bn == 0 and 128 % self.bk == 0 and self.bk >= 32
        self.g = self.bk if self.fp8 else self.sgroup
        assert self.bk % self.g == 0
        self.gpt = self.bk // self.g
        self.cb = self.bk * lowbits // 8
        self.hb = self.bk * self.high // 8
        self.sb = 0 if self.fp8 else max(4, 2 * self.gpt)
        self.kc = self.bk // 8
        self.upr = self.bk // 16
        self.units = self.bn * self.upr
        self.raw_c, self.raw_h = self.bn * self.cb, self.bn * self.hb
        self.raw = self.bn * (self.cb + self.hb + self.sb)
        sc_buf = 0 if self.fp8 else self.gpt * self.bn * 4
        self.smem = (self.stages * self.bm * self.bk * 2 + 2 * self.bn * self.bk * 2 + 2 * sc_buf
                     + (self.stages - 1) * self.raw)

    def swz(self, r: int, c: int) -> int:
        return swz(self.bk, r, c)


def swz(bk: int, r: int, c: int) -> int:
    """Element offset of 16-byte chunk c of row r in a [rows][bk] bf16 tile (the template's swz)."""
    return swizzle16(r, c, 2 * bk) // 2


def bf16_value(h: int) -> float:
    return struct.unpack("<f", struct.pack("<I", h << 16))[0]


def bf16_bits_exact(v: float) -> int:
    b = struct.unpack("<I", struct.pack("<f", v))[0]
    assert b & 0xFFFF == 0 and struct.unpack("<f", struct.pack("<I", b))[0] == v, f"{v} is not exact in bf16"
    return b >> 16


def bf16x2_fma(a: int, b: int, c: int) -> int:
    out = 0
    for half in (0, 16):
        f = lambda v: bf16_value((v >> half) & 0xFFFF)  # noqa: E731
        out |= bf16_bits_exact(f(a) * f(b) + f(c)) << half
    return out


def decode8_int(bits: int, high: int, code_word: int, hb: int) -> list[int]:
    if high == 0:
        code_word ^= 0x88888888
    if high == 1:
        hb ^= 0xFF
    if high == 2:
        hb ^= 0xAAAA
    L = code_word & 0x0F0F0F0F
    H = (code_word >> 4) & 0x0F0F0F0F
    if high == 1:
        s = (hb | (hb << 12)) & 0x000F000F
        s = (s | (s << 6)) & 0x03030303
        L |= (s & 0x01010101) << 4
        H |= (s & 0x02020202) << 3
    elif high == 2:
        s = (hb | (hb << 8)) & 0x00FF00FF
        s = (s | (s << 4)) & 0x0F0F0F0F
        L |= (s & 0x03030303) << 4
        H |= (s & 0x0C0C0C0C) << 2
    negc1 = 0xC300 | (1 << (bits - 1))
    negc = negc1 | (negc1 << 16)
    p01, p23 = byte_perm(L, H, 0x5140), byte_perm(L, H, 0x7362)
    return [bf16x2_fma(byte_perm(p, 0x43434343, sel), 0x3F803F80, negc)
            for p in (p01, p23) for sel in (0x4140, 0x4342)]


def decode2_w8(code_word: int, sel: int) -> int:
    t = byte_perm(code_word, 0x43434343, sel)
    return bf16x2_fma(t & 0xFF80FF80, 0xBF80BF80, t & 0xFF7FFF7F)


def decode2_fp8(code_word: int, sel: int) -> int:
    t = byte_perm(code_word, 0, sel)
    h = (t & 0x80008000) | ((t >> 1) & 0x3F803F80)
    f = np.array([h], np.uint32).view(np.float16).astype(np.float32)   # [lo, hi], exact
    return bf16_bits_exact(float(f[0])) | (bf16_bits_exact(float(f[1])) << 16)


def u32s(buf: np.ndarray) -> list[int]:
    return [int(v) for v in np.ascontiguousarray(buf).view("<u4")]


def block_rows(lay: Layout, N: int, K: int, n0: int, bn: int):
    """The kernel's address arithmetic for a block's rows n0..: (row in its 128-row packed tile, rows in the
    block, bytes per row of the code / high-bit / scale planes, those planes' offsets in w)."""
    R = (K + 127) >> 7
    pt, i0 = n0 >> 7, n0 & 127
    tile_r, nrows = min(128, N - (pt << 7)), min(bn, N - n0)
    code_row, high_row = R * lay.code_row, R * lay.high_row
    scale_row = 4 if lay.fp8 else R * lay.scale_row
    full_tile = a256(128 * code_row) + (a256(128 * high_row) if lay.high else 0) + a256(128 * scale_row)
    pC = pt * full_tile
    pH = pC + a256(tile_r * code_row)
    pS = pH + (a256(tile_r * high_row) if lay.high else 0)
    return i0, nrows, code_row, high_row, scale_row, pC, pH, pS


def emulate_block_ktile(lay: Layout, w: np.ndarray, N: int, K: int, n0: int, kt: int):
    """One block's load_stage(kt) + decode_item(kt, *) -> (bd [bn*bk] bf16 bits, sc [gpt*bn] f32, row scale ptr)."""
    i0, nrows, code_row, high_row, scale_row, pC, pH, pS = block_rows(lay, N, K, n0, lay.bn)

    def copy(raw, dst, src, size, row_lo, row_len):
        assert src % size == 0 and dst % size == 0, "cp.async alignment"
        assert row_lo <= src and src + size <= row_lo + row_len, "read outside the row's plane segment"
        assert src + size <= w.size
        raw[dst:dst + size] = w[src:src + size]

    # load_stage (raw part); zero fill = the initial zeros
    raw = np.zeros(lay.raw, np.uint8)
    for idx in range(lay.bn * (lay.cb // 16)):
        j, c = divmod(idx, lay.cb // 16)
        if j < nrows:
            row = pC + (i0 + j) * code_row
            copy(raw, j * lay.cb + c * 16, row + kt * lay.cb + c * 16, 16, row, code_row)
    for j in range(lay.bn):
        if j >= nrows:
            continue
        if lay.high:
            row = pH + (i0 + j) * high_row
            copy(raw, lay.raw_c + j * lay.hb, row + kt * lay.hb, lay.hb, row, high_row)
        if not lay.fp8:
            soff = (2 * kt * lay.gpt) & ~(lay.sb - 1)
            row = pS + (i0 + j) * scale_row
            copy(raw, lay.raw_c + lay.raw_h + j * lay.sb, row + soff, lay.sb, row, scale_row)

    # decode_item for every work item
    bd = np.full(lay.bn * lay.bk, 0xFFFF, np.uint32)   # poison: every element must be written
    sc = np.full(max(lay.gpt * lay.bn, 1), np.nan, np.float32)
    for idx in range(lay.units):
        j, u = divmod(idx, lay.upr)
        if lay.bits == 8:
            cw = u32s(raw[j * lay.cb + u * 16: j * lay.cb + u * 16 + 16])
            if lay.fp8:
                words = [decode2_fp8(v, s) for v in cw for s in (0x1404, 0x3424)]
            else:
                words = [decode2_w8(v, s) for v in cw for s in (0x4140, 0x4342)]
        else:
            cw = u32s(raw[j * lay.cb + u * 8: j * lay.cb + u * 8 + 8])
            hb = 0
            if lay.high == 1:
                o = lay.raw_c + j * lay.hb + u * 2
                hb = int(raw[o]) | (int(raw[o + 1]) << 8)
            if lay.high == 2:
                hb = u32s(raw[lay.raw_c + j * lay.hb + u * 4: lay.raw_c + j * lay.hb + u * 4 + 4])[0]
            words = (decode8_int(lay.bits, lay.high, cw[0], (hb & 0xFFFF) if lay.high == 2 else (hb & 0xFF))
                     + decode8_int(lay.bits, lay.high, cw[1], (hb >> 16) if lay.high == 2 else ((hb >> 8) & 0xFF)))
        for half, chunk in enumerate((2 * u, 2 * u + 1)):
            e = lay.swz(j, chunk)
            for q in range(4):
                v = words[4 * half + q]
                assert bd[e + 2 * q] == 0xFFFF and bd[e + 2 * q + 1] == 0xFFFF, "element written twice"
                bd[e + 2 * q], bd[e + 2 * q + 1] = v & 0xFFFF, v >> 16
        if not lay.fp8 and (u * 16) % lay.g == 0:
            gi = u * 16 // lay.g
            soff = (2 * kt * lay.gpt) & ~(lay.sb - 1)
            o = lay.raw_c + lay.raw_h + j * lay.sb + 2 * (kt * lay.gpt + gi) - soff
            assert 0 <= o - (lay.raw_c + lay.raw_h + j * lay.sb) <= lay.sb - 2
            sc[gi * lay.bn + j] = np.frombuffer(raw[o:o + 2].tobytes(), "<f2")[0].astype(np.float32)
    return bd, sc, pS, i0


def emulate_weights(lay: Layout, w: np.ndarray, N: int, K: int) -> np.ndarray:
    """The weight matrix the kernel multiplies by: decoded tile x fold scale (fp8: x 2^8 x row scale),
    over [cdiv(N, bn) * bn, ktiles * bk]."""
    ktiles = -(-K // lay.bk)
    tiles_n = -(-N // lay.bn)
    out = np.zeros((tiles_n * lay.bn, ktiles * lay.bk), np.float64)
    k = np.arange(lay.bk)
    idx = np.array([[lay.swz(j, kk // 8) + kk % 8 for kk in k] for j in range(lay.bn)])   # [bn, bk]
    fbytes = w.tobytes()
    for tn in range(tiles_n):
        n0 = tn * lay.bn
        for kt in range(ktiles):
            bd, sc, pS, i0 = emulate_block_ktile(lay, w, N, K, n0, kt)
            assert not (bd == 0xFFFF).any(), "an element of the decoded tile was never written"
            vals = (bd[idx].astype(np.uint32) << 16).view(np.float32).astype(np.float64)   # [bn, bk]
            if lay.fp8:   # epilogue: row scale * 2^8, read only for rows < N
                s = [struct.unpack_from("<f", fbytes, pS + (i0 + j) * 4)[0] * 256.0 if n0 + j < N else 0.0
                     for j in range(lay.bn)]
                vals = vals * np.array(s)[:, None]
            else:         # fold: column j, group k // g
                vals = vals * np.repeat(sc.reshape(lay.gpt, lay.bn).T.astype(np.float64), lay.g, axis=1)
            out[n0:n0 + lay.bn, kt * lay.bk:(kt + 1) * lay.bk] = vals
    return out


# the tiles of the route files, plus a few the template admits (bn 64, bk 32 / 128)
EMU_CONFIGS = sorted({(t["bn"], t["bk"]) for f in FMTS for t in mma_tiles(f).values()}
                     | {(64, 64), (128, 128), (128, 32)})


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("bn,bk", EMU_CONFIGS)
def test_emulated_tile_loads_match_unpack(fmt, bn, bk):
    if bk % {"w8": 32, "fp8": 32}.get(fmt, 64):
        pytest.skip(f"bk={bk} is not a multiple of the {fmt} scale group")
    lay = Layout(fmt, {"bm": 64, "bn": bn, "bk": bk, "stages": 3})
    rng = np.random.default_rng(FMTS.index(fmt) * 1000 + bn + bk)
    for N, K in [(77, 8), (300, 200), (130, 392), (128, 72)]:
        src = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        src[0, :] = 0.0                              # an all-zero row: scale 0
        if K > 64:
            src[1, 64:] *= 1e-6                      # tiny (fp16-subnormal) scales / fp8 subnormals
        w = formats.encode(fmt, src)
        ref = unpack(fmt, torch.from_numpy(w), N, K).double().numpy()
        got = emulate_weights(lay, w, N, K)
        if fmt == "fp8":   # unpack rounds e4m3 * scale to fp32; the kernel keeps the product exact (the
            got = got.astype(np.float32).astype(np.float64)   # scale multiplies the fp32 sum instead)
        np.testing.assert_array_equal(got[:N, :K], ref, err_msg=f"{fmt} N={N} K={K} bn={bn} bk={bk}")
        assert not got[:N, K:].any(), "pad lanes must decode to 0"
        assert not got[N:, :].any(), "rows past N must be zero"


def test_decode_helpers_cover_every_code():
    # every code of every int format through the bit tricks (one 8-lane group at a time)
    for bits, high in ((4, 0), (5, 1), (6, 2)):
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
        codes = np.arange(lo, hi)
        for start in range(0, codes.size, 8):
            lane = np.resize(codes[start:start + 8], 8)
            u = lane & ((1 << bits) - 1)
            cw = sum((int(u[i]) & 15) << (4 * i) for i in range(8))
            hb = sum((int(u[i]) >> 4) << (high * i) for i in range(8)) if high else 0
            words = decode8_int(bits, high, cw, hb)
            got = [bf16_value((wd >> s) & 0xFFFF) for wd in words for s in (0, 16)]
            assert got == [float(v) for v in lane], (bits, lane, got)
    for b in range(256):   # w8: every byte (the format never writes -128 but the trick handles it)
        word = decode2_w8(b | (b << 8), 0x4140)
        assert bf16_value(word & 0xFFFF) == float(np.int8(np.uint8(b))) == bf16_value(word >> 16)
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    for b in range(256):   # fp8: every byte but the two NaNs, times 2^-8
        if b & 0x7F == 0x7F:
            continue
        word = decode2_fp8(b | (b << 8), 0x1404)
        assert bf16_value(word & 0xFFFF) == bf16_value(word >> 16) == float(e4m3[b]) / 256.0, b


@pytest.mark.parametrize("fmt", FMTS)
def test_route_smem_formula_matches_kernel_layout(fmt):
    """specs/routes/linear_<fmt>.yaml's smem formula must give the kernel's SMEM_BYTES for every tile
    (the kernel traps on a short launch; this catches it before a GPU run)."""
    from ninfer.runtime.manifest import Manifest, evaluate
    m = Manifest.load()
    seen = 0
    for k in m.kernels.values():
        if k.op == f"linear_{fmt}" and k.route == "mma":
            assert int(evaluate(k.smem, {})) == Layout(fmt, k.data["tile_params"]).smem, k.key
            seen += 1
    assert seen


def test_swizzle_is_a_bijection():
    for bk in (32, 64, 128):
        pos = sorted(swz(bk, r, c) for r in range(128) for c in range(bk // 8))
        assert pos == list(range(0, 128 * bk, 8))


# ---------------------------------------------------------------------------------------------------
# Whole-kernel emulation: every thread of every block, in program order between barriers, on a
# shared-memory model that flags data races (see Smem). Fragment layouts follow the PTX ISA
# (ldmatrix .x4, mma.m16n8k16 row.col).
# ---------------------------------------------------------------------------------------------------

class Smem:
    """One block's shared memory with a race checker. Between two barriers a byte written by one thread
    must not be read or written by another; a cp.async destination is off limits to every thread from
    its issue until the barrier that follows the wait completing it. mode "early" lands a cp.async at
    issue, "late" at the wait that completes it: a kernel that reuses a slot too soon or waits too
    little computes a wrong result in one of the two."""

    def __init__(self, size: int, mode: str):
        self.b = np.zeros(size, np.uint8)
        self.mode = mode
        self.inflight = np.zeros(size, bool)
        self.groups, self.current, self.landed = [], [], []
        self._phase()

    def _phase(self):
        self.wr = np.full(self.b.size, -1, np.int32)
        self.rd = np.full(self.b.size, -1, np.int32)

    def _check(self, lo, hi, tid, write, what):
        assert 0 <= lo and hi <= self.b.size, f"{what}: [{lo}, {hi}) outside shared memory"
        assert not self.inflight[lo:hi].any(), f"{what} by thread {tid}: touches an in-flight cp.async destination"
        w = self.wr[lo:hi]
        assert ((w == -1) | (w == tid)).all(), f"{what} by thread {tid}: races with another thread's write"
        if write:
            r = self.rd[lo:hi]
            assert ((r == -1) | (r == tid)).all(), f"{what} by thread {tid}: races with another thread's read"

    def read(self, lo, n, tid):
        self._check(lo, lo + n, tid, False, "read")
        r = self.rd[lo:lo + n]
        r[(r != -1) & (r != tid)] = -2
        r[r == -1] = tid
        return self.b[lo:lo + n].copy()

    def write(self, lo, data, tid):
        data = np.frombuffer(np.ascontiguousarray(data).tobytes(), np.uint8)
        self._check(lo, lo + data.size, tid, True, "write")
        self.wr[lo:lo + data.size] = tid
        self.b[lo:lo + data.size] = data

    def cp_async(self, lo, data, tid):
        assert lo % data.size == 0, "cp.async destination alignment"
        self._check(lo, lo + data.size, tid, True, "cp.async")
        self.inflight[lo:lo + data.size] = True
        self.current.append((lo, data))
        if self.mode == "early":
            self.b[lo:lo + data.size] = data

    def commit(self):
        self.groups.append(self.current)
        self.current = []

    def wait(self, pending: int):
        while len(self.groups) > pending:
            for lo, data in self.groups.pop(0):
                self.b[lo:lo + data.size] = data
                self.landed.append((lo, data.size))

    def barrier(self):
        for lo, n in self.landed:
            self.inflight[lo:lo + n] = False
        self.landed = []
        self._phase()


def ldmatrix_x4(sm: Smem, addrs: np.ndarray, tid0: int) -> np.ndarray:
    """Lane l gives the address of row l % 8 of matrix l // 8; register q of lane t holds matrix q's
    row t // 4, elements 2(t % 4), 2(t % 4) + 1. -> [4, 32] u32."""
    rows = np.stack([sm.read(int(addrs[ln]), 16, tid0 + ln).view("<u4") for ln in range(32)])   # [32, 4]
    return np.stack([rows[8 * q + LANE // 4, LANE % 4] for q in range(4)])


def emulate_kernel(fmt: str, tile: dict, x: np.ndarray, w: np.ndarray, T: int, N: int, K: int, mode: str):
    """Run the kernel's program for every block; returns y (float64, before the bf16 rounding)."""
    lay = Layout(fmt, tile)
    BM, BN, BK, S = lay.bm, lay.bn, lay.bk, lay.stages
    WARPS_M, WARPS_N, GROUP_M = tile["warps_m"], tile["warps_n"], tile.get("group_m", 8)
    THREADS = WARPS_M * WARPS_N * 32
    WM, WN = BM // WARPS_M, BN // WARPS_N
    MI, NI, KC, KSTEPS, KS = WM // 16, WN // 8, BK // 8, BK // 16, lay.g // 16
    A_STAGE, B_BUF = BM * BK * 2, BN * BK * 2
    SC_BUF = 0 if lay.fp8 else lay.gpt * BN * 4
    OFF_B = S * A_STAGE
    OFF_SC = OFF_B + 2 * B_BUF
    OFF_RAW = OFF_SC + 2 * SC_BUF
    assert OFF_RAW + (S - 1) * lay.raw == lay.smem
    DEC_ITERS = -(-lay.units // THREADS)
    xb = np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16          # bf16 bits [T, K]
    xrow = [np.ascontiguousarray(xb[t].astype("<u2")).view(np.uint8) for t in range(T)]
    wbytes = w.tobytes()
    y = np.full((T, N), np.nan)
    tiles_m, tiles_n = -(-T // BM), -(-N // BN)
    seen = set()
    for pid in range(tiles_m * tiles_n):
        per_group = GROUP_M * tiles_n
        group = pid // per_group
        first_m = group * GROUP_M
        gsize_m = min(tiles_m - first_m, GROUP_M)
        in_group = pid - group * per_group
        tile_m, tile_n = first_m + in_group % gsize_m, in_group // gsize_m
        assert (tile_m, tile_n) not in seen and tile_m < tiles_m and tile_n < tiles_n
        seen.add((tile_m, tile_n))
        m0, n0 = tile_m * BM, tile_n * BN
        sm = Smem(lay.smem, mode)

        i0, nrows, code_row, high_row, scale_row, pC, pH, pS = block_rows(lay, N, K, n0, BN)
        ktiles = -(-K // BK)

        def gsrc(addr, size, lo, row_len):
            assert lo <= addr and addr + size <= lo + row_len and addr % size == 0
            return np.frombuffer(wbytes, np.uint8, size, addr).copy()

        def load_stage(kt):
            k0 = kt * BK
            aS = (kt % S) * A_STAGE
            for idx in range(BM * KC):
                tid = idx % THREADS
                r, c = divmod(idx, KC)
                grow, gk = m0 + r, k0 + c * 8
                ok = grow < T and gk < K
                data = xrow[grow][gk * 2:gk * 2 + 16].copy() if ok else np.zeros(16, np.uint8)
                sm.cp_async(aS + lay.swz(r, c) * 2, data, tid)
            rS = OFF_RAW + (kt % (S - 1)) * lay.raw
            for idx in range(BN * (lay.cb // 16)):
                tid = idx % THREADS
                j, c = divmod(idx, lay.cb // 16)
                row = pC + (i0 + j) * code_row
                data = gsrc(row + kt * lay.cb + c * 16, 16, row, code_row) if j < nrows else np.zeros(16, np.uint8)
                sm.cp_async(rS + j * lay.cb + c * 16, data, tid)
            for j in range(BN):
                tid = j % THREADS
                if lay.high:
                    row = pH + (i0 + j) * high_row
                    data = gsrc(row + kt * lay.hb, lay.hb, row, high_row) if j < nrows else np.zeros(lay.hb, np.uint8)
                    sm.cp_async(rS + lay.raw_c + j * lay.hb, data, tid)
                if not lay.fp8:
                    soff = (2 * kt * lay.gpt) & ~(lay.sb - 1)
                    row = pS + (i0 + j) * scale_row
                    data = gsrc(row + soff, lay.sb, row, scale_row) if j < nrows else np.zeros(lay.sb, np.uint8)
                    sm.cp_async(rS + lay.raw_c + lay.raw_h + j * lay.sb, data, tid)

        def decode_item(kt, tid, it):
            idx = tid + it * THREADS
            if idx >= lay.units:
                return
            j, u = divmod(idx, lay.upr)
            raw = OFF_RAW + (kt % (S - 1)) * lay.raw
            bd = OFF_B + (kt & 1) * B_BUF
            if lay.bits == 8:
                cw = u32s(sm.read(raw + j * lay.cb + u * 16, 16, tid))
                if lay.fp8:
                    words = [decode2_fp8(v, s) for v in cw for s in (0x1404, 0x3424)]
                else:
                    words = [decode2_w8(v, s) for v in cw for s in (0x4140, 0x4342)]
            else:
                cw = u32s(sm.read(raw + j * lay.cb + u * 8, 8, tid))
                hb = 0
                if lay.high == 1:
                    hb = int(sm.read(raw + lay.raw_c + j * lay.hb + u * 2, 2, tid).view("<u2")[0])
                if lay.high == 2:
                    hb = int(sm.read(raw + lay.raw_c + j * lay.hb + u * 4, 4, tid).view("<u4")[0])
                words = (decode8_int(lay.bits, lay.high, cw[0], (hb & 0xFFFF) if lay.high == 2 else (hb & 0xFF))
                         + decode8_int(lay.bits, lay.high, cw[1], (hb >> 16) if lay.high == 2 else ((hb >> 8) & 0xFF)))
            sm.write(bd + lay.swz(j, 2 * u) * 2, np.array(words[:4], "<u4"), tid)
            sm.write(bd + lay.swz(j, 2 * u + 1) * 2, np.array(words[4:], "<u4"), tid)
            if not lay.fp8 and (u * 16) % lay.g == 0:
                gi = u * 16 // lay.g
                soff = (2 * kt * lay.gpt) & ~(lay.sb - 1)
                s16 = sm.read(raw + lay.raw_c + lay.raw_h + j * lay.sb + 2 * (kt * lay.gpt + gi) - soff, 2, tid)
                val = s16.view("<f2").astype(np.float32)
                sm.write(OFF_SC + ((kt & 1) * lay.gpt * BN + gi * BN + j) * 4, val, tid)

        acc = np.zeros((WARPS_M * WARPS_N, MI, NI, 32, 4))
        for s in range(S - 1):
            if s < ktiles:
                load_stage(s)
            sm.commit()
        sm.wait(S - 2)
        sm.barrier()
        for tid in range(THREADS):
            for it in range(DEC_ITERS):
                decode_item(0, tid, it)
        for kt in range(ktiles):
            sm.wait(S - 3)
            sm.barrier()
            nk = kt + S - 1
            if nk < ktiles:
                load_stage(nk)
            sm.commit()
            nxt = kt + 1 < ktiles
            aBase, bBase = (kt % S) * A_STAGE, OFF_B + (kt & 1) * B_BUF
            sc = OFF_SC + (kt & 1) * lay.gpt * BN * 4
            for warp in range(WARPS_M * WARPS_N):
                warp_m, warp_n = warp // WARPS_N, warp % WARPS_N
                tid0 = warp * 32
                tmp = np.zeros((MI, NI, 32, 4))
                for kk in range(KSTEPS):
                    af = [ldmatrix_x4(sm, np.array([aBase + lay.swz(warp_m * WM + mi * 16 + (ln & 15), kk * 2 + (ln >> 4)) * 2
                                                    for ln in range(32)]), tid0) for mi in range(MI)]
                    bfr = [[None, None] for _ in range(NI)]
                    for nj in range(NI // 2):
                        t4 = ldmatrix_x4(sm, np.array([bBase + lay.swz(warp_n * WN + nj * 16 + (ln & 15), kk * 2 + (ln >> 4)) * 2
                                                       for ln in range(32)]), tid0)
                        bfr[2 * nj][0], bfr[2 * nj + 1][0], bfr[2 * nj][1], bfr[2 * nj + 1][1] = t4[0], t4[1], t4[2], t4[3]
                    for mi in range(MI):
                        for ni in range(NI):
                            d = mma_16816(af[mi], bfr[ni][0], bfr[ni][1])
                            if lay.fp8:
                                acc[warp, mi, ni] += d
                            elif kk % KS == 0:
                                tmp[mi, ni] = d
                            else:
                                tmp[mi, ni] += d
                    if not lay.fp8 and kk % KS == KS - 1:
                        gi = kk // KS
                        for ni in range(NI):
                            col = warp_n * WN + ni * 8 + 2 * (LANE & 3)
                            s2 = np.stack([sm.read(sc + (gi * BN + int(col[ln])) * 4, 8, tid0 + ln).view("<f4")
                                           for ln in range(32)]).astype(np.float64)      # [32, 2]
                            for mi in range(MI):
                                acc[warp, mi, ni] += tmp[mi, ni] * s2[:, [0, 1, 0, 1]]
                    if nxt:
                        for ln in range(32):
                            for it in range(DEC_ITERS):
                                if it * KSTEPS // DEC_ITERS == kk:
                                    decode_item(kt + 1, tid0 + ln, it)
        sm.wait(0)
        for warp in range(WARPS_M * WARPS_N):
            warp_m, warp_n = warp // WARPS_N, warp % WARPS_N
            for ni in range(NI):
                for ln in range(32):
                    g, t = ln >> 2, ln & 3
                    lcol = warp_n * WN + ni * 8 + 2 * t
                    col = n0 + lcol
                    sc2 = [1.0, 1.0]
                    if lay.fp8:
                        sc2 = [struct.unpack_from("<f", wbytes, pS + (i0 + lcol + e) * 4)[0] * 256.0 if col + e < N else 0.0
                               for e in range(2)]
                    for mi in range(MI):
                        row0 = m0 + warp_m * WM + mi * 16 + g
                        for e in range(4):
                            r, c = row0 + 8 * (e >> 1), col + (e & 1)
                            if r < T and c < N:
                                assert np.isnan(y[r, c]), "output written twice"
                                y[r, c] = acc[warp, mi, ni, ln, e] * sc2[e & 1]
    assert len(seen) == tiles_m * tiles_n
    return y


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("mode", ["early", "late"])
def test_emulated_kernel_matches_reference(fmt, mode):
    """Every tile of the route file, one small odd problem: T=70 (partial m-tiles), N=130 (a 2-row
    last packed tile), K=200 (K % 128 != 0, ktiles > stages)."""
    T, N, K = 70, 130, 200
    rng = np.random.default_rng(11 + FMTS.index(fmt))
    w = formats.encode(fmt, (rng.standard_normal((N, K)) * 0.05).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((T, K)).astype(np.float32)).bfloat16().float().numpy()
    W = unpack(fmt, torch.from_numpy(w), N, K).double().numpy()
    ref = x.astype(np.float64) @ W.T
    for name, tile in mma_tiles(fmt).items():
        y = emulate_kernel(fmt, tile, x, w, T, N, K, mode)
        assert not np.isnan(y).any(), f"{name}: some outputs never written"
        # fp64 here; the only difference left is unpack's fp32 rounding of e4m3 * scale (fp8)
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6, err_msg=f"{fmt} {name} ({mode})")


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------

NS = [1, 77, 128, 130, 300]
KS = [8, 72, 200, 1024]
TS = [1, 9, 63, 64, 65, 200]


def packed(fmt: str, N: int, K: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    w = formats.encode(fmt, (rng.standard_normal((N, K)) * 0.05).astype(np.float32))
    return torch.from_numpy(w).cuda()


def run_and_compare(be, fmt: str, w: torch.Tensor, T: int, N: int, K: int, seed: int, route: str | None):
    from ninfer.runtime.dispatch import ReferenceBackend
    from ninfer.runtime.tolerance import compare
    op = f"linear_{fmt}"
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, K, device="cuda", generator=gen).bfloat16()
    guarded = torch.full((T * N + 256,), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = guarded[:T * N].view(T, N)            # 256 NaNs after y catch stores past [T, N]
    plan = be.plan(op, route=route, x=x, w=w, y=y)
    plan()
    yref = torch.empty_like(y)
    ReferenceBackend(be.manifest).run(op, x=x.clone(), w=w.clone(), y=yref)
    torch.cuda.synchronize()
    assert guarded[T * N:].isnan().all(), f"{op} T={T} N={N} K={K}: wrote past the end of y"
    preset = be.manifest.tolerances[be.contract(op)["tolerance"]]
    return plan.kernel.instance, compare(y, yref, preset, f"{op} T={T} N={N} K={K} via {plan.kernel.instance}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tile", sorted({t for f in FMTS for t in mma_tiles(f)}))
def test_every_mma_tile(be, fmt, tile):
    if tile not in mma_tiles(fmt):
        pytest.skip(f"{fmt} has no tile {tile}")
    bad = []
    for N in NS:
        for K in KS:
            w = packed(fmt, N, K, seed=N * 1009 + K)
            for T in TS:
                inst, v = run_and_compare(be, fmt, w, T, N, K, seed=T * 31 + N + K, route=f"mma.{tile}")
                assert inst == f"mma.{tile}"
                if not v:
                    bad.append(v.detail)
    assert not bad, "\n".join(bad)


def table_ts(fmt: str) -> list[int]:
    ts = {1, 8, 9, 10}
    spec = yaml.safe_load((ROOT / "specs" / "routes" / f"linear_{fmt}.yaml").read_text())
    for table in spec["tables"]:
        for s in table["spans"]:
            if s["from"] > 1:
                ts |= {s["from"] - 1, s["from"], s["from"] + 1}
    return sorted(ts)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_route_table_around_span_boundaries(be, fmt):
    """No route named: each T takes the table's route (a gemv family route up to the last gemv span's end, mma
    past it), and every one agrees with the reference."""
    bad = []
    op = f"linear_{fmt}"
    for N, K in [(300, 200), (130, 1024)]:
        w = packed(fmt, N, K, seed=N + K)
        spans = be.manifest.table(be.device.arch, op, "bf16", {"N": N, "K": K})
        last = max(hi for lo, hi, use in spans if use.startswith("gemv") and hi is not None)
        for T in sorted(set(table_ts(fmt)) | {last, last + 1}):
            inst, v = run_and_compare(be, fmt, w, T, N, K, seed=T, route=None)
            assert inst == be.manifest.resolve(be.device.arch, op, "bf16", {"N": N, "K": K}, T).instance, (T, inst)
            assert inst.startswith("gemv" if T <= last else "mma."), (T, inst, last)
            if not v:
                bad.append(v.detail)
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FMTS)
def test_real_shape(be, fmt):
    N, K, T = 17408, 5120, 512
    w = packed(fmt, N, K, seed=5)
    for tile in mma_tiles(fmt):
        _, v = run_and_compare(be, fmt, w, T, N, K, seed=7, route=f"mma.{tile}")
        assert v, v.detail
    _, v = run_and_compare(be, fmt, w, T, N, K, seed=8, route=None)
    assert v, v.detail
