"""CPU emulation of the A fragments of the `wgmma_rs` routes (linear_q4 / q5 / q6, linear_swiglu_q4;
codegen/templates/linear_wgmma_rs.cu.j2), and of the split-K ranks' shares and scale pipeline, so their index math
is checked where there is no GPU.

For every consumer thread of a block and every k-tile it mirrors the template line by line: which code row of the
TMA slot it reads (and for q5 / q6 which high-bit bytes of the second box), where its scale row is in the packed
matrix (tile = (64 + 16 HIGH + 4) K bytes, the scales after the code and high-bit planes, K / 32 bytes a row),
byte q of each code word, the exact fp32 decode, and the slot of each bf16 pair in the A fragments. The weights
implied by those fragments under the PTX m64k16 A layout (as mma.m16n8k16's, one 16-row slab per warp) must be
dequant_<fmt>'s exact bf16 values. A change to the template's mapping must be made here too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer.runtime.reference_quant import unpack
from ninfer.runtime.weights import random_packed
from tests.mma_emulation import bf16_bits

F32 = np.float32


def _at(bits: int, offset: float, scale) -> np.float32:
    return F32(F32(np.array([bits | 0x4B000000], np.uint32).view(F32)[0] - F32(offset)) * F32(scale))


def decode_q4x2(u: int, s: float) -> int:
    """The template's decode_q4x2: byte u ^ 0x88 -> bf16 pair bits (low half: the even lane)."""
    lo, hi = _at(u & 0xF, 8388616.0, s), _at(u & 0xF0, 8388736.0, F32(s) * F32(0.0625))
    return int(bf16_bits(lo)) | int(bf16_bits(hi)) << 16


def decode_hx2(x: int, hb: int, s: float, high: int) -> int:
    """The template's decode_hx2 for q5 (high 1) / q6 (high 2)."""
    m = (1 << high) - 1
    lo = ((x & 0xF) | ((hb & m) << 4)) ^ (1 << (high + 3))
    hi = ((x & 0xF0) | (((hb >> high) & m) << 8)) ^ (1 << (high + 7))
    flo = _at(lo, 8388608.0 + (1 << (high + 3)), s)
    fhi = _at(hi, 8388608.0 + (1 << (high + 7)), F32(s) * F32(0.0625))
    return int(bf16_bits(flo)) | int(bf16_bits(fhi)) << 16


def emulate_block_weights(w: bytes, N: int, K: int, n0: int, swiglu: bool, high: int = 0, bn: int = 128) -> np.ndarray:
    """The bf16 weights each consumer thread of one block feeds wgmma, placed by the A-fragment layout:
    [bn A rows, K] float32 (swiglu: in each 16-row warp slice 8 gate rows, then their up rows). high: 0 (q4),
    1 (q5), 2 (q6)."""
    planes = 64 + 16 * high
    tile_bytes, rows_total = (planes + 4) * K, (2 * N if swiglu else N)
    out = np.full((bn, K), np.nan, np.float32)
    box_rows = min(bn // 2 if swiglu else bn, 128)
    for kt in range(K // 64):
        # the code boxes of this k-tile as TMA lands them in the slot: block row r at r * 32
        slot, hslot = bytearray(bn * 32), bytearray(bn * 16)
        for b in range(bn // box_rows):
            g0 = (n0 + b * box_rows if b < bn // box_rows // 2 else N + n0 + (b - bn // box_rows // 2) * box_rows) \
                if swiglu else n0 + b * box_rows
            for r in range(box_rows):
                g = g0 + r
                src = (g >> 7) * tile_bytes + (g & 127) * (K // 2) + kt * 32
                slot[(b * box_rows + r) * 32:(b * box_rows + r + 1) * 32] = w[src:src + 32] if g < rows_total else bytes(32)
                if high:   # the high-bit box: 16 bytes at byte (kt >> 1) * 16 (q5) or kt * 16 (q6) of the row's plane
                    hsrc = (g >> 7) * tile_bytes + 64 * K + (g & 127) * (K * high // 8) + ((kt >> 1) * 16 if high == 1 else kt * 16)
                    hslot[(b * box_rows + r) * 16:(b * box_rows + r + 1) * 16] = w[hsrc:hsrc + 16] if g < rows_total else bytes(16)
        for c in range(2):
            for wi in range(4):
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    frag = np.zeros((4, 4), np.uint32)   # [k16 step][a0..a3]
                    arow = c * 64 + wi * 16 + g   # the thread's A rows: arow (h = 0) and arow + 8 (h = 1)
                    # their code rows in the slot; swiglu: a gate row and its up row (64 slot rows further)
                    lrows = [64 * h + 32 * c + 8 * wi + g if swiglu else arow + 8 * h for h in range(2)]
                    for h, lrow in enumerate(lrows):
                        n = h * N + n0 + 32 * c + 8 * wi + g if swiglu else n0 + lrow
                        srow = (n >> 7) * tile_bytes + planes * K + (n & 127) * (K // 32)
                        s = F32(np.frombuffer(w[srow + 2 * kt:srow + 2 * kt + 2], np.float16)[0])
                        words = np.frombuffer(bytes(slot[lrow * 32:lrow * 32 + 32]), "<u4")
                        hw = np.frombuffer(bytes(hslot[lrow * 16:lrow * 16 + 16]), "<u4").astype(np.int64)
                        for m in range(8):
                            x = int(words[m]) >> (8 * q)
                            if high == 0:
                                pair = decode_q4x2((x ^ 0x88) & 0xFF, s)
                            elif high == 1:   # bits 2q, 2q+1 of byte m of this k-tile's half of the box
                                hq = [int(hw[2 * (kt & 1)]) >> (2 * q), int(hw[2 * (kt & 1) + 1]) >> (2 * q)]
                                pair = decode_hx2(x, hq[m >> 2] >> (8 * (m & 3)), s, 1)
                            else:             # bits 16 (m % 2) + 4q .. +3 of word m / 2
                                hq = [int(v) >> (4 * q) for v in hw]
                                pair = decode_hx2(x, hq[m >> 1] >> (16 * (m & 1)), s, 2)
                            frag[m >> 1, h + 2 * (m & 1)] = pair
                    # PTX A layout: a0 (row g, cols 2q, 2q+1), a1 (row g+8), a2 (row g, cols 2q+8, +9), a3 (row g+8)
                    for kk in range(4):
                        for a, (dr, dc) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
                            pair = frag[kk, a]
                            for e in range(2):
                                bits = np.array([(int(pair) >> (16 * e) & 0xFFFF) << 16], np.uint32)
                                out[arow + dr, kt * 64 + 16 * kk + 2 * q + dc + e] = bits.view(F32)[0]
    return out


@pytest.mark.parametrize("fmt,swiglu", [("q4", False), ("q4", True), ("q5", False), ("q6", False)])
def test_fragments_hold_dequant_values(fmt, swiglu):
    N, K = 256, 512
    rows = 2 * N if swiglu else N
    pw = random_packed(fmt, (rows, K), "cpu", torch.Generator().manual_seed(3), 0.05)
    dense = unpack(fmt, pw.data, rows, K).to(torch.bfloat16).float().numpy()   # dequant_<fmt>'s values
    w = pw.data.numpy().tobytes()
    bn_out = 64 if swiglu else 128
    for n0 in (0, N - bn_out):   # the first block and the last (the second 128-row tile)
        got = emulate_block_weights(w, N, K, n0, swiglu, {"q4": 0, "q5": 1, "q6": 2}[fmt])
        if swiglu:   # A row 64 c + 16 wi + 8 h + g: gate (h = 0) or up (h = 1) row of output n0 + 32 c + 8 wi + g
            rows_of = [h * N + n0 + 32 * c + 8 * wi + g for c in range(2) for wi in range(4) for h in range(2) for g in range(8)]
            want = dense[rows_of]
        else:
            want = dense[n0:n0 + 128]
        assert not np.isnan(got).any(), "every weight of the block is placed by exactly one fragment"
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("units,ks", [(1, 1), (10, 2), (12, 3), (34, 3), (34, 4), (7, 4)])
def test_split_k_shares_and_their_scales(units, ks):
    """wgmma_rs_splitk: rank r of ks takes the k-tiles [8 (units r / ks), 8 (units (r + 1) / ks)) (K = 512 units);
    together the ranks take every k-tile once, each at least one unit, and the consumers' scale pipeline (sc from
    the rank's first group, scn the next 8 groups loaded one step ahead, half j of sc for k-tile k8 + j) hands every
    k-tile its own group's scale."""
    K = 512 * units
    scales = np.arange(K // 64, dtype=np.float16) + 1          # one fp16 scale a k-tile (64-wide group) of a row
    row = scales.tobytes()
    seen = []
    for rank in range(ks):
        kb, ke = 8 * (units * rank // ks), 8 * (units * (rank + 1) // ks)
        assert ke - kb >= 8 and (ke - kb) % 8 == 0
        load = lambda off: np.frombuffer(row[off:off + 16], np.float16)   # noqa: E731 (a uint4 of 8 halves)
        sc, scn = load(2 * kb), None
        for k8 in range(kb, ke, 8):
            if k8 > kb:
                sc = scn
            if k8 + 8 < ke:
                scn = load(2 * (k8 + 8))
            for j in range(8):
                assert sc[j] == scales[k8 + j]
                seen.append(k8 + j)
    assert sorted(seen) == list(range(K // 64))
