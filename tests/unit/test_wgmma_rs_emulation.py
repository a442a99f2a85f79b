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

from ninfer.runtime.formats import get_format
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


def random_scales(pw, rows: int, K: int, seed: int):
    """random_packed gives every group one scale: draw each (row, group) its own, so a fragment that takes another
    row's or group's scale is caught."""
    g = torch.Generator().manual_seed(seed)
    for st in get_format(pw.fmt).tile_stacks(rows, K):
        sc = st.planes(pw.data)[-1]
        sc[:] = (torch.rand(sc.numel() // 2, generator=g) * 0.02 + 1e-3).half().view(torch.uint8).view(sc.shape)
    return pw


def decode_q4x2_codes(w: int, sel: int, bias: int = 0x43084308) -> int:
    """The template's decode_q4x2_codes (late-scale tiles): PRMT byte sel & 3 of w alone, times 0x1001, masked and
    XORed with bias, each bf16 half minus 136 (exact: the result is a small integer) -> bf16 pair bits."""
    t = (w >> (8 * (sel & 3))) & 0xFF                     # __byte_perm(w, 0, 0x4440 | q)
    v = (((t * 0x1001) & 0xFFFFFFFF) & 0x000F000F) ^ bias
    halves = [np.array([(v >> (16 * e) & 0xFFFF) << 16], np.uint32).view(F32)[0] - F32(136) for e in range(2)]
    return int(bf16_bits(halves[0])) | int(bf16_bits(halves[1])) << 16


def emulate_block_weights(w: bytes, N: int, K: int, n0: int, swiglu: bool, high: int = 0, bn: int = 128,
                          late: bool = False) -> np.ndarray:
    """The bf16 weights each consumer thread of one block feeds wgmma, placed by the A-fragment layout:
    [bn A rows, K] float32 (swiglu: in each 16-row warp slice 8 gate rows, then their up rows). high: 0 (q4),
    1 (q5), 2 (q6). late (q4's late-scale tiles): the fragments hold the bare codes and each k-tile's sum is scaled
    in fp32 afterwards, so the weight placed is the code times the scale in fp32."""
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
                    row_scale = [F32(1), F32(1)]          # late: the scale each A row's k-tile sum is multiplied by
                    arow = c * 64 + wi * 16 + g   # the thread's A rows: arow (h = 0) and arow + 8 (h = 1)
                    # their code rows in the slot; swiglu: a gate row and its up row (64 slot rows further)
                    lrows = [64 * h + 32 * c + 8 * wi + g if swiglu else arow + 8 * h for h in range(2)]
                    for h, lrow in enumerate(lrows):
                        n = h * N + n0 + 32 * c + 8 * wi + g if swiglu else n0 + lrow
                        srow = (n >> 7) * tile_bytes + planes * K + (n & 127) * (K // 32)
                        s = F32(np.frombuffer(w[srow + 2 * kt:srow + 2 * kt + 2], np.float16)[0])
                        if late:
                            row_scale[h] = s
                        words = np.frombuffer(bytes(slot[lrow * 32:lrow * 32 + 32]), "<u4")
                        hw = np.frombuffer(bytes(hslot[lrow * 16:lrow * 16 + 16]), "<u4").astype(np.int64)
                        for m in range(8):
                            x = int(words[m]) >> (8 * q)
                            if late:
                                pair = decode_q4x2_codes(int(words[m]), 0x4440 | q)
                            elif high == 0:
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
                                out[arow + dr, kt * 64 + 16 * kk + 2 * q + dc + e] = bits.view(F32)[0] * row_scale[dr // 8]
    return out


@pytest.mark.parametrize("fmt,swiglu", [("q4", False), ("q4", True), ("q5", False), ("q6", False)])
def test_fragments_hold_dequant_values(fmt, swiglu):
    N, K = 256, 512
    rows = 2 * N if swiglu else N
    pw = random_scales(random_packed(fmt, (rows, K), "cpu", torch.Generator().manual_seed(3), 0.05), rows, K, 4)
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


@pytest.mark.parametrize("swiglu", [False, True])
def test_late_scale_fragments_hold_the_codes(swiglu):
    """The late-scale tiles (tile ls): each A fragment pair is the two bare codes, exact in bf16, and the k-tile's
    scale applied to the row's sum in fp32 gives the exact fp32 s * code (no bf16 rounding of the weight)."""
    N, K = 256, 512
    rows = 2 * N if swiglu else N
    pw = random_scales(random_packed("q4", (rows, K), "cpu", torch.Generator().manual_seed(5), 0.05), rows, K, 6)
    exact = unpack("q4", pw.data, rows, K).numpy()   # fp32 s * code: exact (a 4-bit code times an fp16 scale)
    w = pw.data.numpy().tobytes()
    for u in range(256):   # every byte, at every position: the pair is (low nibble, high nibble) as signed codes
        for q in range(4):
            pair = decode_q4x2_codes(u << (8 * q) | (0xA5 << (8 * ((q + 1) % 4))), 0x4440 | q)
            lo, hi = [np.array([(pair >> (16 * e) & 0xFFFF) << 16], np.uint32).view(F32)[0] for e in range(2)]
            assert (lo, hi) == (((u & 0xF) ^ 8) - 8, ((u >> 4) ^ 8) - 8)
    bn_out = 64 if swiglu else 128
    for n0 in (0, N - bn_out):
        got = emulate_block_weights(w, N, K, n0, swiglu, late=True)
        if swiglu:
            rows_of = [h * N + n0 + 32 * c + 8 * wi + g for c in range(2) for wi in range(4) for h in range(2) for g in range(8)]
            want = exact[rows_of]
        else:
            want = exact[n0:n0 + 128]
        np.testing.assert_array_equal(got, want)


def scale_row(K: int):
    """One row's fp16 scales, a distinct one a k-tile (64-wide group), and the consumers' uint4 load of 8 of them
    at a byte offset."""
    scales = np.arange(K // 64, dtype=np.float16) + 1
    row = scales.tobytes()
    return scales, lambda off: np.frombuffer(row[off:off + 16], np.float16)


def rank_shares(units: int, ks: int):
    """wgmma_rs_splitk's k-tiles [kb, ke) of each rank of ks (K = 512 units; ks = 1: the whole of K)."""
    for rank in range(ks):
        yield 8 * (units * rank // ks), 8 * (units * (rank + 1) // ks)


def scale_pipeline(load, kb: int, ke: int):
    """The consumers' scale registers over the k-tiles [kb, ke), per scale group k8: sc (its 8 scales; the first
    group's loaded before the loop) and scn (the next group's, loaded one step ahead)."""
    sc, scn = load(2 * kb), None
    for k8 in range(kb, ke, 8):
        if k8 > kb:
            sc = scn
        if k8 + 8 < ke:
            scn = load(2 * (k8 + 8))
        yield k8, sc, scn


@pytest.mark.parametrize("units,ks", [(1, 1), (10, 2), (12, 3), (34, 3), (34, 4), (7, 4)])
def test_split_k_shares_and_their_scales(units, ks):
    """wgmma_rs_splitk: rank r of ks takes the k-tiles [8 (units r / ks), 8 (units (r + 1) / ks)) (K = 512 units);
    together the ranks take every k-tile once, each at least one unit, and the consumers' scale pipeline (sc from
    the rank's first group, scn the next 8 groups loaded one step ahead, half j of sc for k-tile k8 + j) hands every
    k-tile its own group's scale."""
    K = 512 * units
    scales, load = scale_row(K)
    seen = []
    for kb, ke in rank_shares(units, ks):
        assert ke - kb >= 8 and (ke - kb) % 8 == 0
        for k8, sc, _ in scale_pipeline(load, kb, ke):
            for j in range(8):
                assert sc[j] == scales[k8 + j]
                seen.append(k8 + j)
    assert sorted(seen) == list(range(K // 64))


@pytest.mark.parametrize("units,ks,kg", [(1, 1, 2), (10, 1, 2), (34, 1, 2), (12, 3, 1), (7, 1, 1)])
def test_consumer_k_groups_pipeline(units, ks, kg):
    """The late-scale k-loop as each consumer runs it (tile kg: KG groups take alternate k-tiles): the first decode
    kb + kg with scale half kg of sc; per scale group k8 the k-tiles j = jj KG + kg; after each wgmma the next decode
    kt + KG, with half j + KG of sc inside the group, half kg of scn (the next group's) past it. Every k-tile of a
    rank is decoded once, with its own group's scale, by the group whose ring slots it lands in (STAGES = 8)."""
    K, stages = 512 * units, 8
    scales, load = scale_row(K)
    seen = []
    for kb, ke in rank_shares(units, ks):
        for g in range(kg):
            decoded = {kb + g: load(2 * kb)[g]}               # decode(kb + kg, kg, sc, 0)
            for k8, sc, scn in scale_pipeline(load, kb, ke):
                for jj in range(8 // kg):
                    j = jj * kg + g
                    kt = k8 + j
                    seen.append(kt)
                    assert decoded[kt] == scales[kt], "a k-tile's fragments carry its own group's scale"
                    assert ((kt - kb) % stages) % kg == g, "the slot a k-tile lands in is its group's"
                    if kt + kg < ke:
                        decoded[kt + kg] = sc[j + kg] if jj < 8 // kg - 1 else scn[g]
    assert sorted(seen) == list(range(K // 64))
