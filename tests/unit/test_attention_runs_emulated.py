"""paged_attention_verify's run mode (codegen/templates/paged_attention_decode.cu.j2 with tile.runs), written without
a GPU, mirrored block by block and warp by warp on the CPU against the reference backend: the grid the route's
launch formula gives, each block's (lane, R tokens) and tile rows (token t + r // nh, head h0 + r % nh), the lane's
split cut, each warp's chunk range, the per-row causal limits, the online softmax with its guard for a row that has
no key yet (subtract 0, not -inf), the warps' merge and the partial each row writes. fp32 dot products stand in for
the mma tiles (their fragment layout is the split route's, which the GPU tests cover). Every (token, head, split)
must be written exactly once. A change to the template's run mode must be made here too."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.manifest import evaluate

ROOT = Path(__file__).resolve().parents[2]
ROUTES = yaml.safe_load((ROOT / "specs" / "routes" / "paged_attention_verify.yaml").read_text())["routes"]
TILES = {f"{r['name']}.{t}": (v, r["launch"]["grid"]) for r in ROUTES for t, v in r["tiles"].items()}
NEG_INF = float("-inf")


def emulate(tile, grid, q, k_cache, v_cache, block_table, token_seq, positions, scale, L, KS):
    T, NH, D = q.shape
    NB, BS, NKV, _ = k_cache.shape
    MB, W = block_table.shape[1], tile["warps"]
    G = NH // NKV
    env = dict(T=T, NH=NH, NKV=NKV, D=D, BS=BS, MB=MB, KS=KS, L=L, NB=NB, S=block_table.shape[0])
    gx, gy = int(evaluate(grid[0].replace("tile.hsplit", "1"), env)), int(evaluate(str(grid[1]), env))
    part_o, m, l = torch.full((T, NH, KS, D), float("nan")), torch.full((T, NH, KS), float("nan")), torch.full((T, NH, KS), float("nan"))
    written = torch.zeros(T, NH, KS, dtype=torch.int32)
    sl2 = scale * 1.4426950408889634
    for bxf in range(gx):
        for by in range(gy):
            bx, split = divmod(bxf, KS)
            j, hpb = by, G            # HSPLIT = 1
            h0, nh = 0, G
            R = max(1, min(L, 16 // hpb))
            nsub = -(-L // R)
            run0 = (bx // nsub) * L
            t = run0 + (bx % nsub) * R
            nrows = min(R, run0 + L - t) * nh
            nl = max(int(positions[run0 + i]) + 1 for i in range(L))
            s = int(token_seq[t])
            n = min(nl, MB * BS)
            row_n = [min(int(positions[t + r // nh]) + 1, MB * BS) if r < nrows else n for r in range(16)]
            qrow = [(t + r // nh) * NH + j * G + h0 + r % nh for r in range(16)]
            nchunk = (n + 15) >> 4
            s_begin = nchunk * split // KS
            s_len = nchunk * (split + 1) // KS - s_begin
            qs = torch.zeros(16, D)
            for r in range(nrows):
                qs[r] = q.view(T * NH, D)[qrow[r]]
            wm, wl, wacc = [], [], []
            for w in range(W):
                c_begin, c_end = s_begin + s_len * w // W, s_begin + s_len * (w + 1) // W
                mr, lr, acc = [NEG_INF] * 16, [0.0] * 16, torch.zeros(16, D)
                for c in range(c_begin, c_end):
                    keys = [c * 16 + i for i in range(16)]
                    K, V = torch.zeros(16, D), torch.zeros(16, D)
                    for i, key in enumerate(keys):
                        if key < n:   # zero-filled past the lane's last key
                            slot = int(block_table[s, key // BS]) * BS + key % BS
                            K[i], V[i] = k_cache.view(-1, NKV, D)[slot, j], v_cache.view(-1, NKV, D)[slot, j]
                    sc = qs @ K.T
                    for r in range(16):
                        x = [float(sc[r, i]) * sl2 if keys[i] < row_n[r] else NEG_INF for i in range(16)]
                        mn = max(mr[r], max(x))
                        mb = 0.0 if mn == NEG_INF else mn
                        al = 2.0 ** (mr[r] - mb) if mr[r] != NEG_INF else 0.0
                        p = torch.tensor([2.0 ** (v - mb) if v != NEG_INF else 0.0 for v in x])
                        mr[r], lr[r] = mn, lr[r] * al + float(p.sum())
                        acc[r] = acc[r] * al + p @ V
                wm.append(mr)
                wl.append(lr)
                wacc.append(acc)
            for r in range(nrows):
                M = max(wm[w][r] for w in range(W))
                num, den = torch.zeros(D), 0.0
                for w in range(W):
                    wt = 0.0 if wm[w][r] == NEG_INF else 2.0 ** (wm[w][r] - M)
                    num, den = num + wt * wacc[w][r], den + wt * wl[w][r]
                tt, hh = divmod(qrow[r], NH)
                part_o[tt, hh, split] = num / den if den > 0 else 0.0
                m[tt, hh, split], l[tt, hh, split] = M, den
                written[tt, hh, split] += 1
    return part_o, m, l, written


@pytest.mark.parametrize("route", sorted(TILES))
@pytest.mark.parametrize("NH,NKV,L,KS", [(6, 1, 4, 3), (8, 1, 3, 2), (4, 2, 5, 4), (12, 1, 2, 1)])
def test_run_mode_blocks_write_the_reference_partials(route, NH, NKV, L, KS):
    """Lanes of L tokens (a long one across chunk boundaries, a short one from position 0, one ending just past a
    chunk start), G = NH / NKV heads a kv head: 27B-like G = 6 (R = 2), 35B-like G = 8 (R = 2, a full tile), G = 2
    (R = L), G = 12 (R = 1); split counts from one to more than a lane has chunks."""
    tile, grid = TILES[route]
    g = torch.Generator().manual_seed(NH * 10 + L)
    D, BS = 16, 16
    lanes = [(47, L), (L, L), (17 + L - 1, L)]   # (sequence length, its last L positions queried)
    pages = [-(-n // BS) for n, _ in lanes]
    NB = sum(pages) + 1
    perm = torch.randperm(NB, generator=g)
    table = torch.zeros(len(lanes), max(pages), dtype=torch.int32)
    k = 0
    for i, p in enumerate(pages):
        table[i, :p] = perm[k:k + p]
        k += p
    q = torch.randn(len(lanes) * L, NH, D, generator=g)
    kc, vc = torch.randn(NB, BS, NKV, D, generator=g), torch.randn(NB, BS, NKV, D, generator=g)
    seq = torch.arange(len(lanes), dtype=torch.int32).repeat_interleave(L)
    pos = torch.tensor([p for n, c in lanes for p in range(n - c, n)], dtype=torch.int32)
    got_o, got_m, got_l, written = emulate(tile, grid, q, kc, vc, table, seq, pos, 0.3, L, KS)
    assert (written == 1).all(), "a (token, head, split) written twice or never"
    want = dict(part_o=torch.empty_like(got_o), m=torch.empty_like(got_m), l=torch.empty_like(got_l))
    ReferenceBackend().run("paged_attention_verify", q=q, k_cache=kc, v_cache=vc, block_table=table, token_seq=seq,
                           positions=pos, scale=0.3, L=L, **want)
    empty = want["m"] == NEG_INF
    assert torch.equal(got_m == NEG_INF, empty)
    assert not got_l[empty].any() and not got_o[empty].any()
    for got, name in ((got_m, "m"), (got_l, "l"), (got_o, "part_o")):
        assert torch.allclose(got[~empty], want[name][~empty], rtol=1e-4, atol=1e-4), name
