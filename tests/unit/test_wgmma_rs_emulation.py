"""CPU emulation of the A fragments of linear_q4 / linear_swiglu_q4's `wgmma_rs` route
(codegen/templates/linear_wgmma_rs.cu.j2), so its index math is checked where there is no GPU.

For every consumer thread of a block and every k-tile it mirrors the template line by line: which code row of the
TMA slot it reads, where its scale row is in the packed matrix (tile_bytes = 68 K, the scale plane at 64 K, K / 32
bytes a row), byte q of each code word, the exact fp32 decode, and the slot of each bf16 pair in the A fragments.
The weights implied by those fragments under the PTX m64k16 A layout (as mma.m16n8k16's, one 16-row slab per
warp) must be dequant_q4's exact bf16 values. A change to the template's mapping must be made here too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer.runtime.reference_quant import unpack
from ninfer.runtime.weights import random_packed
from tests.mma_emulation import bf16_bits

F32 = np.float32


def decode_q4x2(u: int, s: float) -> int:
    """The template's decode_q4x2: byte u ^ 0x88 -> bf16 pair bits (low half: the even lane)."""
    def at(bits, offset, scale):
        return F32(F32(np.array([bits | 0x4B000000], np.uint32).view(F32)[0] - F32(offset)) * F32(scale))
    lo, hi = at(u & 0xF, 8388616.0, s), at(u & 0xF0, 8388736.0, F32(s) * F32(0.0625))
    return int(bf16_bits(lo)) | int(bf16_bits(hi)) << 16


def emulate_block_weights(w: bytes, N: int, K: int, n0: int, swiglu: bool, bn: int = 128) -> np.ndarray:
    """The bf16 weights each consumer thread of one block feeds wgmma, placed by the A-fragment layout:
    [bn block rows, K] float32 (swiglu: gate rows, then up rows)."""
    tile_bytes, rows_total = 68 * K, (2 * N if swiglu else N)
    out = np.full((bn, K), np.nan, np.float32)
    box_rows = min(bn // 2 if swiglu else bn, 128)
    for kt in range(K // 64):
        # the code boxes of this k-tile as TMA lands them in the slot: block row r at r * 32
        slot = bytearray(bn * 32)
        for b in range(bn // box_rows):
            g0 = (n0 + b * box_rows if b < bn // box_rows // 2 else N + n0 + (b - bn // box_rows // 2) * box_rows) \
                if swiglu else n0 + b * box_rows
            for r in range(box_rows):
                g = g0 + r
                src = (g >> 7) * tile_bytes + (g & 127) * (K // 2) + kt * 32
                slot[(b * box_rows + r) * 32:(b * box_rows + r + 1) * 32] = w[src:src + 32] if g < rows_total else bytes(32)
        for c in range(2):
            for wi in range(4):
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    frag = np.zeros((4, 4), np.uint32)   # [k16 step][a0..a3]
                    lrows = [c * 64 + wi * 16 + g + 8 * h for h in range(2)]
                    for h, lrow in enumerate(lrows):
                        n = ((n0 if c == 0 else N + n0 - 64) + lrow) if swiglu else n0 + lrow
                        srow = (n >> 7) * tile_bytes + 64 * K + (n & 127) * (K // 32)
                        s = F32(np.frombuffer(w[srow + 2 * kt:srow + 2 * kt + 2], np.float16)[0])
                        words = np.frombuffer(bytes(slot[lrow * 32:lrow * 32 + 32]), "<u4")
                        for m in range(8):
                            frag[m >> 1, h + 2 * (m & 1)] = decode_q4x2(((int(words[m]) >> (8 * q)) ^ 0x88) & 0xFF, s)
                    # PTX A layout: a0 (row g, cols 2q, 2q+1), a1 (row g+8), a2 (row g, cols 2q+8, +9), a3 (row g+8)
                    for kk in range(4):
                        for a, (dr, dc) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
                            pair = frag[kk, a]
                            for e in range(2):
                                bits = np.array([(int(pair) >> (16 * e) & 0xFFFF) << 16], np.uint32)
                                out[lrows[0] + dr, kt * 64 + 16 * kk + 2 * q + dc + e] = bits.view(F32)[0]
    return out


@pytest.mark.parametrize("swiglu", [False, True])
def test_fragments_hold_dequant_values(swiglu):
    N, K = 256, 512
    rows = 2 * N if swiglu else N
    pw = random_packed("q4", (rows, K), "cpu", torch.Generator().manual_seed(3), 0.05)
    dense = unpack("q4", pw.data, rows, K).to(torch.bfloat16).float().numpy()   # dequant_q4's values
    w = pw.data.numpy().tobytes()
    bn_out = 64 if swiglu else 128
    for n0 in (0, N - bn_out):   # the first block and the last (the second 128-row tile)
        got = emulate_block_weights(w, N, K, n0, swiglu)
        want = np.concatenate([dense[n0:n0 + 64], dense[N + n0:N + n0 + 64]]) if swiglu else dense[n0:n0 + 128]
        assert not np.isnan(got).any(), "every weight of the block is placed by exactly one fragment"
        np.testing.assert_array_equal(got, want)
