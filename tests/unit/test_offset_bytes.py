"""pk::offset_bytes (codegen/templates/_packed.cuh.j2), mirrored instruction by instruction: the integer (xs) GEMV
tiles feed mma.sync s8 with code + 2^(bits-1) per lane, lanes 0, 2, 4, 6 of a code word in `lo` and 1, 3, 5, 7 in
`hi`. For q5 / q6 the lanes' high bits come from the chunk's high-bit words; every lane of random chunks must
come out as its code (read from the packed layout, specs/formats.md §3.1) plus the bias."""
import numpy as np
import pytest

from tests.mma_emulation import byte_perm

M32 = 0xFFFFFFFF
BITS = {"q4": 4, "q5": 5, "q6": 6}


def spread_fields(t: int) -> int:
    v = byte_perm(t, 0, 0x4140)
    return (((v & 0x000F000F) << 4) | ((v & 0x00F000F0) << 8)) & M32


def offset_bytes(fmt: str, w: int, h0: int, h1: int, j: int) -> tuple[int, int]:
    bits = BITS[fmt]
    flip = (0x01010101 * (1 << (bits - 1))) & M32
    wl, wh = w, (w * (1 << 28)) >> 32                   # __umulhi(w, 1 << 28)
    if bits == 4:
        return (wl & 0x0F0F0F0F) ^ flip, (wh & 0x0F0F0F0F) ^ flip
    if bits == 5:
        hb = (h0 >> (8 * j)) & 0xFF
        he = ((hb & 0x55) * 0x410410) & 0x10101010
        ho = (((hb >> 1) & 0x55) * 0x410410) & 0x10101010
    else:
        h16 = ((h0 if j < 2 else h1) >> (16 * (j & 1))) & 0xFFFF
        he, ho = spread_fields(h16 & 0x3333), spread_fields((h16 >> 2) & 0x3333)
    return ((wl & 0x0F0F0F0F) | he) ^ flip, ((wh & 0x0F0F0F0F) | ho) ^ flip


def codes_of_chunk(fmt: str, q: list[int], h0: int, h1: int) -> list[int]:
    """The 32 signed codes of a chunk: lane l's low nibble in code word l // 8 (bits 4(l % 8)), high bits per
    specs/formats.md (q5: bit l of h0; q6: bits 2l, 2l+1 of h1:h0)."""
    bits = BITS[fmt]
    out = []
    for lane in range(32):
        u = (q[lane // 8] >> (4 * (lane % 8))) & 15
        if bits == 5:
            u |= ((h0 >> lane) & 1) << 4
        elif bits == 6:
            u |= (((h1 << 32 | h0) >> (2 * lane)) & 3) << 4
        sign = 1 << (bits - 1)
        out.append((u ^ sign) - sign)
    return out


@pytest.mark.parametrize("fmt", ["q4", "q5", "q6"])
def test_every_lane_is_its_code_plus_the_bias(fmt):
    rng = np.random.default_rng(BITS[fmt])
    bias = 1 << (BITS[fmt] - 1)
    for _ in range(500):
        q = [int(v) for v in rng.integers(0, 1 << 32, 4, dtype=np.uint64)]
        h0, h1 = (int(v) for v in rng.integers(0, 1 << 32, 2, dtype=np.uint64))
        codes = codes_of_chunk(fmt, q, h0, h1)
        for j in range(4):
            lo, hi = offset_bytes(fmt, q[j], h0, h1, j)
            for k in range(4):
                assert (lo >> (8 * k)) & 0xFF == codes[8 * j + 2 * k] + bias
                assert (hi >> (8 * k)) & 0xFF == codes[8 * j + 2 * k + 1] + bias
