"""linear_fp8_w8a8's mma.sync route (codegen/templates/linear_mma_sync.cu.j2 in its FP8 mode) mirrored lane by lane on
the CPU: cp.async chunk addressing of xq and of the packed weight's 128-row tiles into the swizzled ring, ldmatrix.x4
fragments, mma.sync m16n8k32 e4m3 (emulated in float64), and the epilogue's token and row scales (a short last weight
tile's scales sit after its own, shorter code plane). The result must equal the reference (the product of the
decoded codes) to float64 rounding. The GPU tests run the kernel itself; this pins the byte layout it relies on."""
import numpy as np
import pytest
import torch

from ninfer.runtime.format_fp8 import E4M3_VALUES
from ninfer.runtime.formats import encode
from ninfer.runtime.reference_quant import fp8_codes_and_scales
from tests.mma_emulation import C_, G_, LANE, swizzle16


def swz(r: int, c: int, bk: int) -> int:
    """The template's swz() in FP8 mode: the byte offset of 16-byte chunk c of row r in a [rows][bk] tile."""
    return swizzle16(r, c, bk)


def ldmatrix_x4(smem: np.ndarray, addrs: np.ndarray) -> np.ndarray:
    """ldmatrix.x4 .b16: lane l gives the row address of matrix l // 8; register j of lane i is bytes 4 (i % 4) ..
    + 3 of row i // 4 of matrix j. Returns [4, 32, 4] bytes."""
    rows = addrs.reshape(4, 8)
    return np.stack([np.stack([smem[rows[j, i // 4] + 4 * (i % 4):][:4] for i in range(32)]) for j in range(4)])


def mma_16832(a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """a: [4, 32, 4] code bytes, b0 / b1: [32, 4] -> D fragments [32, 4] of A(16x32) @ B(32x8), E4M3 decoded."""
    A, B = np.zeros((16, 32)), np.zeros((32, 8))
    v = lambda x: E4M3_VALUES[x].astype(np.float64)  # noqa: E731
    for e in range(4):
        A[G_, 4 * C_ + e] = v(a[0, :, e])
        A[G_ + 8, 4 * C_ + e] = v(a[1, :, e])
        A[G_, 16 + 4 * C_ + e] = v(a[2, :, e])
        A[G_ + 8, 16 + 4 * C_ + e] = v(a[3, :, e])
        B[4 * C_ + e, G_] = v(b0[:, e])
        B[16 + 4 * C_ + e, G_] = v(b1[:, e])
    D = A @ B
    return np.stack([D[G_, 2 * C_], D[G_, 2 * C_ + 1], D[G_ + 8, 2 * C_], D[G_ + 8, 2 * C_ + 1]], axis=1)


def run_block(xq, xs, w, T, N, K, tile_m, tile_n, bm=64, bn=64, bk=64, warps_m=2, warps_n=2):
    """One block of the kernel: y[rows, cols] it writes (float64, before the bf16 rounding), as a dict."""
    kp = -(-K // 128) * 128
    tile_bytes, full_rows = 128 * kp + 512, N // 128 * 128
    last_codes = -(-((N - full_rows) * kp) // 256) * 256
    m0, n0, kc = tile_m * bm, tile_n * bn, bk // 16
    wm, wn = bm // warps_m, bn // warps_n
    acc = np.zeros((warps_m, warps_n, wm // 16, wn // 8, 32, 4))
    for kt in range(-(-K // bk)):
        k0 = kt * bk
        sa, sb = np.zeros(bm * bk, np.uint8), np.zeros(bn * bk, np.uint8)
        for r in range(bm):
            for c in range(kc):
                grow, gk = m0 + r, k0 + 16 * c
                if grow < T and gk < K:
                    sa[swz(r, c, bk):][:16] = xq[grow * K + gk:][:16]
        for r in range(bn):
            for c in range(kc):
                grow, gk = n0 + r, k0 + 16 * c
                if grow < N and gk < K:
                    src = (grow >> 7) * tile_bytes + (grow & 127) * kp + gk
                    sb[swz(r, c, bk):][:16] = w[src:src + 16]
        for wmi in range(warps_m):
            for wni in range(warps_n):
                for kk in range(bk // 32):
                    lrow, lchk = LANE & 15, LANE >> 4
                    af = [ldmatrix_x4(sa, np.array([swz(wmi * wm + mi * 16 + lr, kk * 2 + lc, bk)
                                                   for lr, lc in zip(lrow, lchk)])) for mi in range(wm // 16)]
                    bfr = {}
                    for nj in range(wn // 16):
                        t = ldmatrix_x4(sb, np.array([swz(wni * wn + nj * 16 + lr, kk * 2 + lc, bk)
                                                     for lr, lc in zip(lrow, lchk)]))
                        bfr[2 * nj], bfr[2 * nj + 1] = (t[0], t[2]), (t[1], t[3])
                    for mi in range(wm // 16):
                        for ni in range(wn // 8):
                            acc[wmi, wni, mi, ni] += mma_16832(af[mi], *bfr[ni])
    out = {}
    for wmi in range(warps_m):
        for wni in range(warps_n):
            for mi in range(wm // 16):
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    row0 = m0 + wmi * wm + mi * 16 + g
                    for ni in range(wn // 8):
                        col = n0 + wni * wn + ni * 8 + 2 * t
                        if col >= N:
                            continue
                        base = (col >> 7) * tile_bytes + (128 * kp if col < full_rows else last_codes)
                        ws = w[base:].view(np.float32)[(col & 127):][:2]
                        for half, row in ((0, row0), (2, row0 + 8)):
                            for e in range(2):
                                if row < T and col + e < N:
                                    out[row, col + e] = acc[wmi, wni, mi, ni, lane, half + e] * xs[row] * ws[e]
    return out


@pytest.mark.parametrize("tile", [dict(bm=64, bn=64, bk=64), dict(bm=64, bn=128, bk=128)])   # both swizzle forms
@pytest.mark.parametrize("N,K,T", [(200, 208, 70), (77, 160, 5)])   # a short last weight tile, an odd N; k-tails
def test_mma_fp8_route_bytes_mirror_the_reference(N, K, T, tile):
    rng = np.random.default_rng(N + K)
    w = encode("fp8", (rng.standard_normal((N, K)) * 0.05).astype(np.float32))
    mag = rng.integers(0, 0x7F, (T, K), dtype=np.uint8)   # finite E4M3 codes, random signs
    xq = (mag | (rng.integers(0, 2, (T, K), dtype=np.uint8) << 7)).reshape(-1)
    xs = rng.random(T).astype(np.float32) / 448
    codes, ws = fp8_codes_and_scales(torch.from_numpy(w), N, K)
    acc = E4M3_VALUES[xq.reshape(T, K)].astype(np.float64) @ codes.double().numpy().T
    want = acc * xs[:, None].astype(np.float64) * ws.double().numpy()[None, :]
    got = np.full((T, N), np.nan)
    for tm in range(-(-T // tile["bm"])):
        for tn in range(-(-N // tile["bn"])):
            for (r, c), v in run_block(xq, xs, w, T, N, K, tm, tn, **tile).items():
                got[r, c] = v
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
