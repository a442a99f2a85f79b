"""The fused GDN step kernels written without a GPU, mirrored thread by thread on the CPU against the reference
backend: gdn_verify (codegen/templates/gdn_verify.cu.j2), the shared-memory routes of gdn_verify and gdn_decode
(codegen/templates/gdn_step_smem.cu.j2) and their WY routes (codegen/templates/gdn_verify_wy.cu.j2).

gdn_verify: the blocks of a launch (key head x cluster rank, sequence) with their thread roles (threads < DK the key
head's q and k conv channels, DKMAX.. the value head's v channels, every thread a 4-column x NR-row tile of the state:
rows r*RG + rg, columns j0..j0+3), the per-warp partial sums and the sums over a warp's row groups, the 8-token chunks,
the commit point (the state stored as the commit-th token passes, the conv windows at that token kept and stored at
the end; the key head's q/k columns by cluster rank 0 only after every block of the cluster ran), and every address
(x, qkvz, z, w_ba, conv_w, conv_state, state, y). The shared-memory routes (gdn_step_smem.cu.j2):
warp w's rows w*RPW .., lane l's columns 4l .., the two passes' per-warp column sums, the state written back from
pass 2 into shared memory (and to global memory at the commit point), o and
|o|^2 in every warp, warp 0's y.
fp32 throughout, y rounded to bf16 once, as the kernels do. So a wrong index in a template shows up here, on any
machine; a change to a template must be made here too. The tiles come from the route files; the GPU tests run the
kernels themselves."""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.tolerance import compare

ROOT = Path(__file__).resolve().parents[2]


def tiles(op: str) -> dict:
    routes = yaml.safe_load((ROOT / "specs" / "routes" / f"{op}.yaml").read_text())["routes"]
    return {f"{r['name']}.{t}": v for r in routes for t, v in r["tiles"].items()}


TILES = tiles("gdn_verify")
KW, KS = 4, 3


def f32(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy().astype(np.float32)


def silu(v):
    return v / (np.float32(1) + np.exp(-v))


def launch(ts: dict):
    """A gdn_verify launch as the mirrors read it: the fp32 tensors (w_ba as rows h (b) and HV + h (a)), the runs, and
    the dims (HK, R, H, DK, DV, HV, C)."""
    x, qkvz, w_ba, conv_w = (f32(ts[k]) for k in ("x", "qkvz", "w_ba", "conv_w"))
    A_log, dt_bias, norm_w = f32(ts["A_log"]).reshape(-1), f32(ts["dt_bias"]).reshape(-1), f32(ts["norm_w"])
    HK, R, H = ts["w_ba"].shape[1], ts["w_ba"].shape[2], ts["w_ba"].shape[3]
    DK, DV = ts["state"].shape[3], ts["state"].shape[4]
    HV, C = HK * R, conv_w.shape[0]
    return ((x, qkvz, w_ba.reshape(2 * HV, H), conv_w, A_log, dt_bias, norm_w),
            tuple(ts[k].tolist() for k in ("query_start", "slots", "commit")), (HK, R, H, DK, DV, HV, C))


def fresh_outputs(ts: dict, HV: int, DK: int, DV: int):
    """The emulations' copies: the conv state (raw bf16 values: moved, never rounded), the fp32 state [NS, HV, DK,
    DV], and y [T, HV, DV] full of NaN (so a value never written shows)."""
    return (ts["conv_state"].clone(), f32(ts["state"]).reshape(-1, HV, DK, DV).copy(),
            torch.full(ts["y"].shape, float("nan"), dtype=torch.bfloat16).reshape(-1, HV, DV))


def conv_step(ts: dict, conv_w, qkvz, ch: int, win: torch.Tensor, t: int):
    """win_step: silu(w[KS] * x + the window's taps, oldest first), and the window shifted by x (raw bf16)."""
    acc = np.float32(conv_w[ch, KS]) * np.float32(float(qkvz[t, ch]))
    for k in range(KS):
        acc = np.float32(acc + conv_w[ch, k] * np.float32(win[k].item()))
    return silu(acc), torch.cat([win[1:], ts["qkvz"][t, ch:ch + 1]])


def warp_partials(v: np.ndarray) -> np.ndarray:
    """[THREADS] -> [WARPS]: each warp's sum (nf::warp_sum, lane 0 writes it)."""
    return v.reshape(-1, 32).sum(1, dtype=np.float32)


def ba_partials(x, w_ba, t: int, h: int, HV: int, THREADS: int):
    """Each thread's share of token t's b and a dot products: the 16-byte pieces th, th + THREADS, .. of the rows."""
    pb, pa = np.zeros(THREADS, np.float32), np.zeros(THREADS, np.float32)
    for th in range(THREADS):
        for piece in range(th, x.shape[1] // 8, THREADS):
            sl = slice(8 * piece, 8 * piece + 8)
            pb[th] += np.dot(x[t, sl], w_ba[h, sl])
            pa[th] += np.dot(x[t, sl], w_ba[HV + h, sl])
    return pb, pa


def value_heads(qs, slots, commit, conv_state, HK, R, G, DK, DV):
    """The GDN step kernels' work split, value head by value head: for each run (sequence) and key head, the blocks
    of a cluster (rank 0..G-1), each taking R / G value heads in turn. Yields each head's run (t0, n, slot, keep_at:
    the token after which the states are stored, -1: none), its conv windows (the key head's q/k columns as every
    block read them before any write, and its own v columns) and `kept`, which the caller fills with the windows
    after the keep_at-th token (shared by the heads of a block). Afterwards the head's v windows are stored, and
    once every block of the key head has run, cluster rank 0's q/k windows (after the cluster barrier)."""
    vch0 = 2 * HK * DK
    for s in range(len(slots)):
        t0, n, slot = qs[s], qs[s + 1] - qs[s], slots[s]
        keep_at = min(max(commit[s], 0), n) - 1
        for kh in range(HK):
            qk_ch = [kh * DK + d for d in range(DK)] + [(HK + kh) * DK + d for d in range(DK)]
            old = {ch: conv_state[slot, ch].clone() for ch in qk_ch}   # read by every block before any write
            qk_writes = {}
            for rank in range(G):
                per, kept = R // G, {}
                for i in range(per if n > 0 else 0):
                    h = kh * R + rank * per + i
                    win = {ch: old[ch].clone() for ch in qk_ch}
                    win |= {vch0 + h * DV + j: conv_state[slot, vch0 + h * DV + j].clone() for j in range(DV)}
                    yield types.SimpleNamespace(t0=t0, n=n, slot=slot, keep_at=keep_at, kh=kh, h=h, win=win, kept=kept)
                    if keep_at >= 0:
                        for j in range(DV):
                            conv_state[slot, vch0 + h * DV + j] = kept[vch0 + h * DV + j]
                if keep_at >= 0 and rank == 0:
                    qk_writes = {ch: kept[ch] for ch in qk_ch}
            for ch, v in qk_writes.items():
                conv_state[slot, ch] = v


def emulate(tile: dict, ts: dict, scale: float, eps: float = 1e-6, norm_eps: float = 1e-6) -> dict:
    """The kernel's effect on copies of y, conv_state and state."""
    G, DKMAX, DVMAX, LT, THREADS = tile["g"], tile["dk"], tile["dv"], tile["lt"], tile["threads"]
    WARPS = THREADS // 32
    CQ = DVMAX // (4 * WARPS)
    RG = 32 // CQ
    NR = DKMAX // RG
    (x, qkvz, w_ba, conv_w, A_log, dt_bias, norm_w), (qs, slots, commit), (HK, R, H, DK, DV, HV, C) = launch(ts)
    conv_state, state, y = fresh_outputs(ts, HV, DK, DV)
    tid = np.arange(THREADS)
    warp, lane = tid >> 5, tid & 31
    cq, rg = lane % CQ, lane // CQ
    j0 = (warp * CQ + cq) * 4
    rows = np.arange(NR)[None, :] * RG + rg[:, None]                 # [THREADS, NR]
    cols = j0[:, None] + np.arange(4)[None, :]                       # [THREADS, 4]
    vch0 = 2 * HK * DK

    def load_state(slot, h):
        S = np.zeros((THREADS, NR, 4), np.float32)
        ok = (rows[:, :, None] < DK) & (cols[:, None, :] < DV)
        r_, c_ = np.minimum(rows, DK - 1)[:, :, None], np.minimum(cols, DV - 1)[:, None, :]
        S[ok] = state[slot, h][np.broadcast_to(r_, ok.shape)[ok], np.broadcast_to(c_, ok.shape)[ok]]
        return S

    def store_state(S, slot, h):
        for t in range(THREADS):
            for r in range(NR):
                if rows[t, r] < DK:
                    for c in range(4):
                        if cols[t, c] < DV:
                            state[slot, h, rows[t, r], cols[t, c]] = S[t, r, c]

    def rows_sum(v):   # [THREADS] -> the sum over the lanes of a warp with the same cq (the shuffle xor CQ..16)
        out = np.zeros_like(v)
        for w in range(WARPS):
            for c in range(CQ):
                sel = (warp == w) & (cq == c)
                out[sel] = v[sel].sum(dtype=np.float32)
        return out

    for s in range(len(slots)):
        t0, n, slot = qs[s], qs[s + 1] - qs[s], slots[s]
        keep_at = min(max(commit[s], 0), n) - 1
        for kh in range(HK):
            qk_writes = []
            for rank in range(G):
                per = R // G
                h0 = kh * R + rank * per
                qk_old = {}   # the q/k conv windows: channel -> raw values (read after the PDL wait)
                for ch in [kh * DK + i for i in range(DK)] + [(HK + kh) * DK + i for i in range(DK)]:
                    qk_old[ch] = conv_state[slot, ch].clone()
                kept_s = {}
                for i in range(per):
                    h = h0 + i
                    S = load_state(slot, h)
                    win = {ch: v.clone() for ch, v in qk_old.items()}
                    for j in range(DV):
                        win[vch0 + h * DV + j] = conv_state[slot, vch0 + h * DV + j].clone()
                    a_log, dtb = A_log[h], dt_bias[h]
                    for c0 in range(0, n, LT):
                        m = min(LT, n - c0)
                        qk_s = np.zeros((LT, 2, DKMAX), np.float32)
                        v_s = np.zeros((LT, DVMAX), np.float32)
                        o_s = np.zeros((LT, DVMAX), np.float32)
                        red = np.zeros((LT, 5, WARPS), np.float32)
                        for j in range(m):   # (1)
                            li, t = c0 + j, t0 + c0 + j

                            def step(ch):
                                acc = np.float32(conv_w[ch, KS]) * np.float32(float(qkvz[t, ch]))
                                for k in range(KS):
                                    acc = np.float32(acc + conv_w[ch, k] * np.float32(win[ch][k].item()))
                                win[ch] = torch.cat([win[ch][1:], ts["qkvz"][t, ch:ch + 1]])
                                if li == keep_at:
                                    kept_s[ch] = win[ch].clone()
                                return silu(acc)
                            qv, kv = np.zeros(THREADS, np.float32), np.zeros(THREADS, np.float32)
                            for d in range(DK):
                                qv[d], kv[d] = step(kh * DK + d), step((HK + kh) * DK + d)
                            qk_s[j, 0, :DKMAX] = qv[:DKMAX]
                            qk_s[j, 1, :DKMAX] = kv[:DKMAX]
                            for v in range(DVMAX):
                                v_s[j, v] = step(vch0 + h * DV + v) if v < DV else 0.0
                            pb, pa = ba_partials(x, w_ba, t, h, HV, THREADS)
                            red[j, 0], red[j, 1] = warp_partials(qv * qv), warp_partials(kv * kv)
                            red[j, 2], red[j, 3] = warp_partials(pb), warp_partials(pa)
                        for j in range(m):   # (2)
                            sq, sk, b, a = (red[j, k].sum(dtype=np.float32) for k in range(4))
                            rq, rk = np.float32(1 / np.sqrt(sq + eps)) * np.float32(scale), np.float32(1 / np.sqrt(sk + eps))
                            beta = np.float32(1 / (1 + np.exp(-b)))
                            xa = np.float32(a + dtb)
                            eg = np.float32(np.exp(-np.exp(a_log) * (xa if xa > 20 else np.log1p(np.exp(xa)))))
                            kr, qr = qk_s[j, 1][rows], qk_s[j, 0][rows]           # [THREADS, NR]
                            p = (S * kr[:, :, None]).sum(1, dtype=np.float32)      # [THREADS, 4]
                            kvc = np.stack([eg * rk * rows_sum(p[:, c]) for c in range(4)], 1)
                            uk = beta * (v_s[j][np.minimum(cols, DVMAX - 1)] - kvc) * rk
                            S = eg * S + kr[:, :, None] * uk[:, None, :]
                            o = (S * qr[:, :, None]).sum(1, dtype=np.float32)
                            o = np.stack([rows_sum(o[:, c]) * rq for c in range(4)], 1)
                            ss = (o * o).sum(1, dtype=np.float32)
                            red[j, 4] = warp_partials(np.where(rg == 0, ss, 0))
                            for th in np.nonzero(rg == 0)[0]:
                                o_s[j, cols[th]] = o[th]
                            if c0 + j == keep_at:
                                store_state(S, slot, h)
                        for j in range(m):   # (3)
                            rstd = np.float32(1 / np.sqrt(red[j, 4].sum(dtype=np.float32) / DV + norm_eps))
                            t = t0 + c0 + j
                            for th in np.nonzero(rg == 0)[0]:
                                for c in range(4):
                                    col = cols[th, c]
                                    if col < DV:
                                        zz = np.float32(float(qkvz[t, C + h * DV + col]))
                                        y[t, h, col] = float(norm_w[col] * o_s[j, col] * rstd * silu(zz))
                    if keep_at >= 0:
                        for v in range(DV):
                            ch = vch0 + h * DV + v
                            conv_state[slot, ch] = kept_s[ch]
                if keep_at >= 0 and (G == 1 or rank == 0):   # after the cluster barrier: once every block has read
                    qk_writes += [(ch, kept_s[ch]) for ch in qk_old]
            for ch, v in qk_writes:
                conv_state[slot, ch] = v
    return {"y": y.reshape(ts["y"].shape), "conv_state": conv_state,
            "state": torch.from_numpy(state).reshape(ts["state"].shape)}


def inputs(H, hk, r, dk, dv, runs, commit, seed):
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale)  # noqa: E731
    T, S, C = sum(runs), len(runs), 2 * hk * dk + hk * r * dv
    NS = S + 2
    return {"x": randn(T, H).bfloat16(), "qkvz": randn(T, C + hk * r * dv).bfloat16(),
            "w_ba": randn(2, hk, r, H, scale=H ** -0.5).bfloat16(), "conv_w": randn(C, KW, scale=0.5).bfloat16(),
            "A_log": randn(hk, r), "dt_bias": randn(hk, r), "norm_w": (randn(dv, scale=0.5) + 1).bfloat16(),
            "query_start": torch.tensor([0, *np.cumsum(runs).tolist()], dtype=torch.int32),
            "slots": torch.randperm(NS, generator=g)[:S].int(), "commit": torch.tensor(commit, dtype=torch.int32),
            "conv_state": randn(NS, C, KS).bfloat16(), "state": randn(NS, hk, r, dk, dv, scale=0.5),
            "y": torch.empty(T, hk, r, dv, dtype=torch.bfloat16)}


def check_against_reference(op: str, got: dict, ts: dict, scale: float, what: str) -> dict:
    """The emulation's y and state within the op's gdn_state_fp32 of the reference backend's, its conv state equal."""
    ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ts.items()}
    ReferenceBackend().run(op, **ref, scale=scale)
    preset = ReferenceBackend().manifest.tolerances["gdn_state_fp32"]
    for name in ("y", "state"):
        v = compare(got[name], ref[name], preset, f"{what} {name}")
        assert v, v.detail
    assert torch.equal(got["conv_state"], ref["conv_state"])
    return got


def assert_untouched(got: dict, ts: dict, runs) -> None:
    """The states of these runs' slots as they were (runs committing nothing)."""
    for k in runs:
        slot = ts["slots"][k].item()
        assert torch.equal(got["state"][slot], ts["state"][slot])
        assert torch.equal(got["conv_state"][slot], ts["conv_state"][slot])


# (tile, (H, HK, R, DK, DV)): every tile on a shape its constraints admit (R % g == 0); DK, DV below the tile's
# maxima and DV not a multiple of 4 on the portable tile (the padding rows and columns)
CASES = [("head.g1", (64, 2, 2, 32, 30)), ("cluster.g2", (64, 2, 2, 32, 32)), ("cluster.g3", (48, 1, 3, 16, 16)),
         ("cluster.g2t512", (64, 1, 2, 24, 16)), ("cluster.g3t512", (48, 1, 3, 16, 20))]


@pytest.mark.parametrize("tile,shape", CASES, ids=[c[0] for c in CASES])
def test_kernel_emulation_matches_the_reference(tile, shape):
    """Runs of 1, 9 (two chunks: 8 + 1) and 3 tokens committing 1, 9 (the second chunk's token) and 0 (no write)."""
    H, hk, r, dk, dv = shape
    ts = inputs(H, hk, r, dk, dv, [1, 9, 3], [1, 9, 0], seed=len(tile))
    got = check_against_reference("gdn_verify", emulate(TILES[tile], ts, dk ** -0.5), ts, dk ** -0.5, tile)
    assert_untouched(got, ts, (2,))   # commit 0


# ---- gdn_decode's shared-memory routes ---------------------------------------------------------------------------
def emulate_decode_smem(tile: dict, ts: dict, scale: float) -> dict:
    """gdn_step_smem.cu.j2's effect for gdn_decode: its gdn_verify over one-token runs, each committed (the template
    takes gdn_decode's token s as a one-token run of sequence s)."""
    T = ts["x"].shape[0]
    runs = {"query_start": torch.arange(T + 1, dtype=torch.int32), "commit": torch.ones(T, dtype=torch.int32)}
    return emulate_verify_smem(tile, {**ts, **runs}, scale)


SMEM_CASES = [("head_smem.g1", (64, 2, 2, 32, 28)), ("cluster_smem.g2", (64, 2, 2, 40, 32)),
              ("cluster_smem.g3", (48, 1, 3, 16, 16))]


@pytest.mark.parametrize("tile,shape", SMEM_CASES, ids=[c[0] for c in SMEM_CASES])
def test_gdn_decode_smem_emulation_matches_the_reference(tile, shape):
    """Three tokens (sequences) in distinct slots; DK not a multiple of the rows a warp takes, DV below 128."""
    H, hk, r, dk, dv = shape
    ts = inputs(H, hk, r, dk, dv, [1, 1, 1], [1, 1, 1], seed=len(tile) + 3)
    ts = {k: v for k, v in ts.items() if k not in ("query_start", "commit")}
    check_against_reference("gdn_decode", emulate_decode_smem(tiles("gdn_decode")[tile], ts, dk ** -0.5), ts, dk ** -0.5,
                            tile)


# ---- gdn_verify's shared-memory routes ----------------------------------------------------------------------------
def emulate_verify_smem(tile: dict, ts: dict, scale: float, eps: float = 1e-6, norm_eps: float = 1e-6) -> dict:
    """gdn_step_smem.cu.j2's effect (gdn_verify) on copies of y, conv_state and state."""
    G, DKMAX, THREADS = tile["g"], tile["dk"], tile["threads"]
    WARPS = THREADS // 32
    RPW = DKMAX // WARPS
    (x, qkvz, w_ba, conv_w, A_log, dt_bias, norm_w), (qs, slots, commit), (HK, R, H, DK, DV, HV, C) = launch(ts)
    dv4 = DV // 4
    conv_state, state, y = fresh_outputs(ts, HV, DK, DV)
    vch0 = 2 * HK * DK
    col_lanes = np.nonzero(np.arange(32) < dv4)[0]
    cols = {lane: 4 * lane + np.arange(4) for lane in col_lanes}

    def step(ch, win, t):
        return conv_step(ts, conv_w, qkvz, ch, win, t)

    for hd in value_heads(qs, slots, commit, conv_state, HK, R, G, DK, DV):
        t0, n, slot, keep_at, kh, h, win, kept = hd.t0, hd.n, hd.slot, hd.keep_at, hd.kh, hd.h, hd.win, hd.kept
        S_s = state[slot, h].copy()
        for li in range(n):
            t = t0 + li
            qk = np.zeros((2, DKMAX), np.float32)
            for d in range(DK):
                for which, ch in ((0, kh * DK + d), (1, (HK + kh) * DK + d)):
                    qk[which, d], win[ch] = step(ch, win[ch], t)
            v = np.zeros(128, np.float32)
            for j in range(DV):
                ch = vch0 + h * DV + j
                v[j], win[ch] = step(ch, win[ch], t)
            if li == keep_at:
                kept |= {ch: win[ch].clone() for ch in win}
            pb = sum(np.dot(x[t, 8 * p:8 * p + 8], w_ba[h, 8 * p:8 * p + 8]) for p in range(H // 8))
            pa = sum(np.dot(x[t, 8 * p:8 * p + 8], w_ba[HV + h, 8 * p:8 * p + 8]) for p in range(H // 8))
            sq, sk = (qk[0] ** 2).sum(dtype=np.float32), (qk[1] ** 2).sum(dtype=np.float32)
            rq, rk = np.float32(1 / np.sqrt(sq + eps)) * np.float32(scale), np.float32(1 / np.sqrt(sk + eps))
            beta = np.float32(1 / (1 + np.exp(-pb)))
            xa = np.float32(pa + dt_bias[h])
            eg = np.float32(np.exp(-np.exp(A_log[h]) * (xa if xa > 20 else np.log1p(np.exp(xa)))))
            part = np.zeros((2, WARPS, 128), np.float32)
            for w in range(WARPS):
                r0, r1 = w * RPW, min(w * RPW + RPW, DK)
                for lane in col_lanes:
                    part[0, w, cols[lane]] = (S_s[r0:r1, cols[lane]] * qk[1, r0:r1, None]).sum(0)
            kvc = part[0].sum(0) * eg * rk
            uk = np.where(np.arange(128) < DV, beta * (v - kvc) * rk, 0).astype(np.float32)
            for w in range(WARPS):
                r0, r1 = w * RPW, min(w * RPW + RPW, DK)
                for lane in col_lanes:
                    c = cols[lane]
                    new = eg * S_s[r0:r1, c] + qk[1, r0:r1, None] * uk[c][None, :]
                    S_s[r0:r1][:, c] = new
                    if li == keep_at:
                        state[slot, h, r0:r1][:, c] = new
                    part[1, w, c] = (new * qk[0, r0:r1, None]).sum(0)
            o = part[1].sum(0) * rq
            rstd = np.float32(1 / np.sqrt((o * o).sum(dtype=np.float32) / DV + norm_eps))
            for lane in col_lanes:
                for j in cols[lane]:
                    zz = np.float32(float(qkvz[t, C + h * DV + j]))
                    y[t, h, j] = float(norm_w[j] * o[j] * rstd * silu(zz))
    return {"y": y.reshape(ts["y"].shape), "conv_state": conv_state,
            "state": torch.from_numpy(state).reshape(ts["state"].shape)}


VERIFY_SMEM_CASES = [("head_smem.g1", (64, 2, 2, 32, 28)), ("cluster_smem.g2", (64, 2, 2, 40, 32)),
                     ("cluster_smem.g3", (48, 1, 3, 16, 16))]


@pytest.mark.parametrize("tile,shape", VERIFY_SMEM_CASES, ids=[c[0] for c in VERIFY_SMEM_CASES])
def test_gdn_verify_smem_emulation_matches_the_reference(tile, shape):
    """Runs of 1, 5 and 3 tokens committing 1, 4 (inside the run) and 0 (nothing written), and an empty run."""
    H, hk, r, dk, dv = shape
    ts = inputs(H, hk, r, dk, dv, [1, 5, 3, 0], [1, 4, 0, 0], seed=len(tile) + 5)
    got = check_against_reference("gdn_verify", emulate_verify_smem(tiles("gdn_verify")[tile], ts, dk ** -0.5), ts,
                                  dk ** -0.5, tile)
    assert_untouched(got, ts, (2, 3))   # commit 0, and the empty run


# ---- gdn_verify's WY routes -----------------------------------------------------------------------------------------
def emulate_verify_wy(tile: dict, ts: dict, scale: float, eps: float = 1e-6, norm_eps: float = 1e-6) -> dict:
    """gdn_verify_wy.cu.j2's effect on copies of y, conv_state and state: per block (key head x cluster rank,
    sequence) and value head, the run in chunks of LT tokens: (A) thread t's conv channels (q/k row t, v column t) and
    b/a pieces t, t + THREADS, .. as per-warp sums; thread 0's gates (G a running sum); (B) the raw Gram dots (lanes
    over rows r = lane, lane + 32, ..) and each column's S_0^T k, S_0^T q over rows in batches of RB, 4 rows a step;
    (C) each column's recurrence over the chunk's tokens (u kept for the run), |o|^2 per warp, y; (D) the commit's
    coefficients and each column rewritten from S_0, the raw k and u."""
    G, DKMAX, DVMAX, LT, RB, TMAX, THREADS = (tile[k] for k in ("g", "dk", "dv", "lt", "rb", "tmax", "threads"))
    WARPS = THREADS // 32
    (x, qkvz, w_ba, conv_w, A_log, dt_bias, norm_w), (qs, slots, commit), (HK, R, H, DK, DV, HV, C) = launch(ts)
    assert max(qs[s + 1] - qs[s] for s in range(len(slots))) <= TMAX   # a run's raw k and u fit (gdn_verify: T <= tmax)
    conv_state, state, y = fresh_outputs(ts, HV, DK, DV)
    vch0 = 2 * HK * DK
    tid = np.arange(THREADS)
    colmask = tid < DV

    def step(ch, win, t):
        return conv_step(ts, conv_w, qkvz, ch, win, t)

    for hd in value_heads(qs, slots, commit, conv_state, HK, R, G, DK, DV):
        t0, n, slot, keep_at, kh, h, win, kept = hd.t0, hd.n, hd.slot, hd.keep_at, hd.kh, hd.h, hd.win, hd.kept
        S0 = state[slot, h].copy()                          # read, never written before (D)
        k_all = np.zeros((TMAX, DKMAX), np.float32)
        u_all = np.zeros((TMAX, DVMAX), np.float32)
        g_all, rk_all = np.zeros(TMAX, np.float32), np.zeros(TMAX, np.float32)
        gsum = np.float32(0)
        for c0 in range(0, n, LT):
            m = min(LT, n - c0)
            q_s = np.zeros((LT, DKMAX), np.float32)
            v_s = np.zeros((LT, DVMAX), np.float32)
            red = np.zeros((LT, 4, WARPS), np.float32)
            for j in range(m):   # (A)
                li, t = c0 + j, t0 + c0 + j
                qv, kv, vv = (np.zeros(THREADS, np.float32) for _ in range(3))
                for d in range(DK):
                    qv[d], win[kh * DK + d] = step(kh * DK + d, win[kh * DK + d], t)
                    kv[d], win[(HK + kh) * DK + d] = step((HK + kh) * DK + d, win[(HK + kh) * DK + d], t)
                for d in range(DV):
                    vv[d], win[vch0 + h * DV + d] = step(vch0 + h * DV + d, win[vch0 + h * DV + d], t)
                if li == keep_at:
                    kept |= {ch: w.clone() for ch, w in win.items()}
                q_s[j], k_all[li], v_s[j] = qv[:DKMAX], kv[:DKMAX], vv
                pb, pa = ba_partials(x, w_ba, t, h, HV, THREADS)
                red[j] = [warp_partials(qv * qv), warp_partials(kv * kv), warp_partials(pb), warp_partials(pa)]
            rq_c, beta_c = np.zeros(LT, np.float32), np.zeros(LT, np.float32)
            for j in range(m):   # thread 0's gates
                sq, sk, b, a = (red[j, k].sum(dtype=np.float32) for k in range(4))
                xa = np.float32(a + dt_bias[h])
                gsum = np.float32(gsum - np.exp(A_log[h]) * (xa if xa > 20 else np.log1p(np.exp(xa))))
                g_all[c0 + j], rk_all[c0 + j] = gsum, np.float32(1 / np.sqrt(sk + eps))
                rq_c[j] = np.float32(1 / np.sqrt(sq + eps)) * np.float32(scale)
                beta_c[j] = np.float32(1 / (1 + np.exp(-b)))
            gram = np.zeros((LT, 2, TMAX), np.float32)   # (B)
            for j in range(m):
                for ii in range(c0 + j + 1):
                    gram[j, 0, ii] = np.dot(k_all[ii], k_all[c0 + j])
                    gram[j, 1, ii] = np.dot(k_all[ii], q_s[j])
            pk, pq = np.zeros((LT, THREADS), np.float32), np.zeros((LT, THREADS), np.float32)
            for r0 in range(0, DKMAX, RB):   # every batch (rows past DK zero)
                sv = np.zeros((RB, THREADS), np.float32)
                for r in range(RB):
                    if r0 + r < DK:
                        sv[r, :DV] = S0[r0 + r]
                for j in range(m):
                    pk[j] += (sv * k_all[c0 + j, r0:r0 + RB, None]).sum(0, dtype=np.float32)
                    pq[j] += (sv * q_s[j, r0:r0 + RB, None]).sum(0, dtype=np.float32)
            ov = np.zeros((LT, THREADS), np.float32)   # (C)
            for j in range(m):
                tt = c0 + j
                gt, rk = g_all[tt], rk_all[tt]
                et = np.float32(np.exp(gt))
                w = et * rk * pk[j]
                o = et * pq[j]
                for ii in range(tt):
                    f = np.float32(np.exp(gt - g_all[ii])) * rk_all[ii] * u_all[ii]
                    w = w + f * rk * gram[j, 0, ii]
                    o = o + f * gram[j, 1, ii]
                u = np.where(colmask, beta_c[j] * (v_s[j] - w), 0).astype(np.float32)
                o = o + rk * u * gram[j, 1, tt]
                u_all[tt] = u
                ov[j] = o * rq_c[j]
            for j in range(m):   # y
                oss = warp_partials(ov[j] * ov[j]).sum(dtype=np.float32)
                rstd = np.float32(1 / np.sqrt(oss / DV + norm_eps))
                t = t0 + c0 + j
                for col in range(DV):
                    zz = np.float32(float(qkvz[t, C + h * DV + col]))
                    y[t, h, col] = float(norm_w[col] * ov[j, col] * rstd * silu(zz))
        if keep_at >= 0:   # (D)
            gn = g_all[keep_at]
            dco = np.exp(gn - g_all[:keep_at + 1]).astype(np.float32) * rk_all[:keep_at + 1]
            new = np.float32(np.exp(gn)) * S0
            for ii in range(keep_at + 1):
                new = new + np.outer(k_all[ii, :DK], dco[ii] * u_all[ii, :DV])
            state[slot, h] = new
    return {"y": y.reshape(ts["y"].shape), "conv_state": conv_state,
            "state": torch.from_numpy(state).reshape(ts["state"].shape)}


WY_CASES = [("wy.g1", (64, 2, 2, 32, 28)), ("wy_cluster.g2", (64, 2, 2, 40, 32)), ("wy_cluster.g3", (48, 1, 3, 24, 16)),
            ("wy_cluster.g3l8t64", (48, 1, 3, 16, 20)), ("wy_cluster.g3r32", (48, 1, 3, 72, 12))]


@pytest.mark.parametrize("tile,shape", WY_CASES, ids=[c[0] for c in WY_CASES])
def test_gdn_verify_wy_emulation_matches_the_reference(tile, shape):
    """Runs of 1, 9 (chunks of 4 or 8 and a remainder) and 3 tokens and an empty run, committing 1, 7 (a later chunk's
    token) and 0 (nothing written); DK not a multiple of the row batch, DV below 128."""
    H, hk, r, dk, dv = shape
    ts = inputs(H, hk, r, dk, dv, [1, 9, 3, 0], [1, 7, 0, 0], seed=len(tile) + 7)
    got = check_against_reference("gdn_verify", emulate_verify_wy(tiles("gdn_verify")[tile], ts, dk ** -0.5), ts,
                                  dk ** -0.5, tile)
    assert_untouched(got, ts, (2, 3))   # commit 0, and the empty run


DECODE_WY_CASES = [("wy.g1", (64, 2, 2, 32, 28)), ("wy_cluster.g2", (64, 2, 2, 40, 32)),
                   ("wy_cluster.g3", (48, 1, 3, 24, 16)), ("wy_cluster.g3r32", (48, 1, 3, 40, 16))]


@pytest.mark.parametrize("tile,shape", DECODE_WY_CASES, ids=[c[0] for c in DECODE_WY_CASES])
def test_gdn_decode_wy_emulation_matches_the_reference(tile, shape):
    """gdn_decode on the WY template: token s a one-token run of sequence s, committed (three tokens, distinct slots)."""
    H, hk, r, dk, dv = shape
    ts = inputs(H, hk, r, dk, dv, [1, 1, 1], [1, 1, 1], seed=len(tile) + 11)
    got = emulate_verify_wy(tiles("gdn_decode")[tile], ts, dk ** -0.5)
    ts = {k: v for k, v in ts.items() if k not in ("query_start", "commit")}
    check_against_reference("gdn_decode", got, ts, dk ** -0.5, tile)
