"""linear_q4's gemv_batch_s8 (codegen/templates/linear_packed_gemv_batch.cu.j2), mirrored lane by lane on the CPU: the
pre kernel's workspace bytes for one 64-lane group of 8 tokens, then the main kernel's fragments (codes as offset
bytes from the ring's 8-byte pieces, x words from the workspace) through an emulated mma.sync m16n8k32 s8. Each
(row, token) sum 256 dh + dl - 8 sum(q) must equal sum(code * q) exactly, and sx * q must be x within 2^-14 of the
group's largest |x|. The GPU tests run the kernel itself; this pins the layout both sides agree on."""
import numpy as np

from tests.mma_emulation import C_, G_, byte_perm

MAGIC = np.float32(12583040.0)   # 1.5 * 2^23 + 128


def bf16(v: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even), as float32."""
    b = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def pre_kernel_group(xg: np.ndarray):
    """The pre kernel for one token's 64-lane group: per quad thread tig the 8 words it writes (qh words 0..3, ql words
    0..3), and the group word (sx, 8 sum(q))."""
    mx = np.float32(np.abs(xg).max())
    e2 = max(-100, int((mx.view(np.uint32) >> 23) & 0xFF) - 127)
    inv = np.uint32((140 - e2) << 23).view(np.float32)
    sx = np.uint32((114 + e2) << 23).view(np.float32)
    words, total = [], 0
    for tig in range(4):
        lanes = xg[16 * tig:16 * tig + 16]
        b = [int((np.float32(lanes[l]) * inv + MAGIC).view(np.uint32)) for l in range(16)]   # exact product, one rounding
        total += sum(bi - 0x4B400080 for bi in b)
        hw, lw = [], []
        for j in range(4):
            l0 = 8 * (j >> 1) + (j & 1)
            t01, t23 = byte_perm(b[l0], b[l0 + 2], 0x5140), byte_perm(b[l0 + 4], b[l0 + 6], 0x5140)
            lw.append(byte_perm(t01, t23, 0x5410) ^ 0x80808080)
            hw.append(byte_perm(t01, t23, 0x7632))
        words.append(hw + lw)
    return words, sx, 8 * total


def s8(word: int) -> np.ndarray:
    return np.frombuffer(int(word).to_bytes(4, "little"), dtype=np.int8).astype(np.int64)


def mma_16832_s8(a, b0, b1) -> np.ndarray:
    """a: [32][4] words (a0..a3 per lane), b0 / b1: [32] words -> D fragments [32][4] of A (16 x 32) @ B (32 x 8)."""
    A, B = np.zeros((16, 32), np.int64), np.zeros((32, 8), np.int64)
    for lane in range(32):
        g, q = G_[lane], C_[lane]
        A[g, 4 * q:4 * q + 4], A[g + 8, 4 * q:4 * q + 4] = s8(a[lane][0]), s8(a[lane][1])
        A[g, 16 + 4 * q:20 + 4 * q], A[g + 8, 16 + 4 * q:20 + 4 * q] = s8(a[lane][2]), s8(a[lane][3])
        B[4 * q:4 * q + 4, g], B[16 + 4 * q:20 + 4 * q, g] = s8(b0[lane]), s8(b1[lane])
    D = A @ B
    return np.array([[D[G_[l], 2 * C_[l]], D[G_[l], 2 * C_[l] + 1], D[G_[l] + 8, 2 * C_[l]], D[G_[l] + 8, 2 * C_[l] + 1]]
                     for l in range(32)])


def test_integer_group_sums_match_the_codes_times_q():
    rng = np.random.default_rng(7)
    for trial in range(4):
        codes = rng.integers(-8, 8, size=(16, 64))                         # 16 rows of one 64-lane group
        x = bf16((rng.standard_normal((8, 64)) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32))
        if trial == 3:
            x[:, 5] *= 300.0                                               # an outlier lane coarsens its group
        ws = [pre_kernel_group(x[t]) for t in range(8)]
        # the exact q each lane stands for, from the bytes the pre kernel wrote
        q = np.zeros((8, 64), np.int64)
        for t in range(8):
            for tig in range(4):
                hw, lw = ws[t][0][tig][:4], ws[t][0][tig][4:]
                for j in range(4):
                    for i, lane in enumerate(8 * (j >> 1) + (j & 1) + 2 * np.arange(4)):
                        q[t, 16 * tig + lane] = 256 * s8(hw[j])[i] + s8(lw[j])[i]
            sx = float(ws[t][1])
            assert np.abs(x[t].astype(np.float64) - sx * q[t]).max() <= 2.0 ** -14 * np.abs(x[t]).max() * 1.0001
            assert ws[t][2] == 8 * q[t].sum()
        # the ring's 8-byte piece of row r for quad thread tig: lanes 16 tig .. + 15, two lanes a byte (low nibble even)
        piece = lambda r, tig: [sum(((int(codes[r, 16 * tig + 8 * w + 2 * i]) & 15) | ((int(codes[r, 16 * tig + 8 * w + 2 * i + 1]) & 15) << 4)) << (8 * i)
                                    for i in range(4)) for w in range(2)]
        off = lambda w: ((w & 0x0F0F0F0F) ^ 0x08080808, ((w >> 4) & 0x0F0F0F0F) ^ 0x08080808)
        a = [[[0] * 4 for _ in range(32)] for _ in range(2)]   # [k-step][lane][a0..a3]
        for lane in range(32):
            g, tig = G_[lane], C_[lane]
            for hh in range(2):
                for j, wq in enumerate(piece(g + 8 * hh, tig)):
                    a[j][lane][hh], a[j][lane][2 + hh] = off(wq)
        xw = [ws[G_[lane]][0][C_[lane]] for lane in range(32)]           # token g's words for thread (g, tig)
        dh = mma_16832_s8(a[0], [w[0] for w in xw], [w[1] for w in xw]) + mma_16832_s8(a[1], [w[2] for w in xw], [w[3] for w in xw])
        dl = mma_16832_s8(a[0], [w[4] for w in xw], [w[5] for w in xw]) + mma_16832_s8(a[1], [w[6] for w in xw], [w[7] for w in xw])
        want = codes @ q.T                                                  # [16 rows, 8 tokens], exact
        for lane in range(32):
            g, tig = G_[lane], C_[lane]
            for e, (r, t) in enumerate([(g, 2 * tig), (g, 2 * tig + 1), (g + 8, 2 * tig), (g + 8, 2 * tig + 1)]):
                assert 256 * dh[lane][e] + dl[lane][e] - ws[t][2] == want[r, t], (trial, lane, e)
