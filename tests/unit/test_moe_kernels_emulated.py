"""CPU emulations of the MoE expert kernels written without a GPU (moe_gate_up_packed, moe_down_packed,
moe_gate_up_grouped_packed, moe_down_grouped_packed, moe_align) and of dequant's lanes8 route, against the
reference backend.

Each emulation mirrors its template's index math line by line (blocks, warps, lanes, shared-memory staging in
the formats' pair order, mma fragments, scale groups, the pass and tile loops), with the format's chunk decode
taken at its meaning (a pair holds the codes of lanes pair_lane(k, 0) and pair_lane(k, 1), as
_moe_packed.cuh.j2's decode produces them; that bit-level decode is the one moe_experts_packed already runs
on the GPU). So a wrong index in a kernel shows up here, on any machine; a change to a template must be made
here too. The tile parameters come from the route files, so every tile is emulated."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ninfer.runtime import formats
from ninfer.runtime.dispatch import ReferenceBackend
from ninfer.runtime.tolerance import compare
from tests.mma_emulation import C_, G_, LANE, bf16_bits, mma_16816

ROOT = Path(__file__).resolve().parents[2]
FMTS = ["q4", "q5", "q6", "w8", "fp8"]
BITS = {"q4": 4, "q5": 5, "q6": 6, "w8": 8, "fp8": 8}
HIGH = {"q5": 1, "q6": 2}
GROUP = {"q4": 64, "q5": 64, "q6": 64, "w8": 32, "fp8": 0}


def tiles(route_file: str, route: str) -> dict:
    spec = yaml.safe_load((ROOT / "specs" / "routes" / route_file).read_text())
    return next(r for r in spec["routes"] if r["name"] == route)["tiles"]


# ---- the packed layout and the formats' pair order (_packed.cuh.j2, _moe_packed.cuh.j2) ---------------------------
class Fmt:
    def __init__(self, fmt: str):
        self.fmt, self.bits, self.high, self.group = fmt, BITS[fmt], HIGH.get(fmt, 0), GROUP[fmt]
        self.fp8 = fmt == "fp8"
        self.chunk = 16 if self.bits == 8 else 32
        self.np_ = self.chunk // 2            # NP: bf16 pairs per chunk
        self.nmma = self.np_ // 2
        self.step = 4 * self.chunk            # STEP: lanes per warp step

    def pair_lane(self, k: int, hf: int) -> int:
        if self.fmt == "q4":
            return 8 * (k >> 2) + (k & 3) + 4 * hf
        if self.fmt == "q5":
            return k + 16 * hf
        if self.fmt == "q6":
            return (k if k < 8 else k + 8) + 8 * hf
        return 4 * (k >> 1) + (k & 1) + 2 * hf

    def lane_pair(self, j: int) -> tuple[int, int]:
        if self.fmt == "q4":
            return 4 * (j >> 3) + (j & 3), (j >> 2) & 1
        if self.fmt == "q5":
            return j & 15, j >> 4
        if self.fmt == "q6":
            return 8 * (j >> 4) + (j & 7), (j >> 3) & 1
        return 2 * (j >> 2) + (j & 1), (j >> 1) & 1

    # pk::row: byte offsets of row n's codes, high bits and scales in the packed [N, K] matrix
    def row(self, N: int, K: int, n: int) -> tuple[int, int, int]:
        a256 = lambda v: (v + 255) & ~255  # noqa: E731
        R = (K + 127) >> 7
        code_row = R * (128 if self.bits == 8 else 64)
        high_row = R * 16 * self.high
        scale_row = 4 if self.fp8 else R * (128 // self.group) * 2
        t, i = n >> 7, n & 127
        r = min(128, N - (t << 7))
        full = a256(128 * code_row) + (a256(128 * high_row) if self.high else 0) + a256(128 * scale_row)
        tile = t * full
        codes = a256(r * code_row)
        high = a256(r * high_row) if self.high else 0
        return tile + i * code_row, tile + codes + i * high_row, tile + codes + high + i * scale_row

    def chunk_codes(self, w: np.ndarray, row: tuple, c: int) -> np.ndarray:
        """The exact values (codes; fp8: E4M3 values) of lanes [c*CHUNK, c*CHUNK + CHUNK) of a row."""
        co, ho, _ = row
        raw = w[co + 16 * c: co + 16 * c + 16]
        if self.fp8:
            return torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
        if self.bits == 8:
            return raw.view(np.int8).astype(np.float64)
        u = np.stack([raw & 15, raw >> 4], 1).reshape(32).astype(np.int64)
        if self.high == 1:
            hb = int.from_bytes(w[ho + 4 * c: ho + 4 * c + 4].tobytes(), "little")
            u |= np.array([(hb >> j) & 1 for j in range(32)]) << 4
        elif self.high == 2:
            hb = int.from_bytes(w[ho + 8 * c: ho + 8 * c + 8].tobytes(), "little")
            u |= np.array([(hb >> (2 * j)) & 3 for j in range(32)]) << 4
        sign = 1 << (self.bits - 1)
        return ((u ^ sign) - sign).astype(np.float64)

    def decode(self, w: np.ndarray, row: tuple, c: int) -> np.ndarray:
        """f::decode of chunk c: NP words of bf16 pairs (lanes pair_lane(k, 0) low, pair_lane(k, 1) high)."""
        v = bf16_bits(self.chunk_codes(w, row, c).astype(np.float32))
        return np.array([v[self.pair_lane(k, 0)] | (v[self.pair_lane(k, 1)] << 16) for k in range(self.np_)],
                        np.uint32)

    def scales(self, w: np.ndarray, row: tuple, s: int) -> tuple[float, float]:
        """The scales of warp step s's two groups (fp8: the row's one scale twice)."""
        so = row[2]
        if self.fp8:
            v = float(np.frombuffer(w[so:so + 4].tobytes(), np.float32)[0])
            return v, v
        h = np.frombuffer(w[so + 4 * s: so + 4 * s + 4].tobytes(), np.float16).astype(np.float64)
        return float(h[0]), float(h[1])

    def advance(self, row: tuple, s: int) -> tuple:
        co, ho, so = row
        return co + 64 * s, ho + 16 * self.high * s, so if self.fp8 else so + 4 * s


def lanes_of_warp(f: Fmt, w: np.ndarray, rows_a: list, rows_b: list, s: int):
    """Per lane (g, q): rows g (ra) and g+8 (rb) of warp step s decoded, chunk 4s + q: wa, wb [32, NP] and the
    scales [32, 2] of each row."""
    wa = np.stack([f.decode(w, rows_a[ln], 4 * s + C_[ln]) for ln in range(32)])
    wb = np.stack([f.decode(w, rows_b[ln], 4 * s + C_[ln]) for ln in range(32)])
    sa = np.array([f.scales(w, rows_a[ln], s) for ln in range(32)])
    sb = np.array([f.scales(w, rows_b[ln], s) for ln in range(32)])
    return wa, wb, sa, sb


def mma_chunk(f: Fmt, wa, wb, b, mask=None) -> np.ndarray:
    """sum over m of mma(A = (wa, wb) pairs 2m, 2m+1, B = b pairs 2m, 2m+1): D fragments [32, 4]; mask: [32] bool,
    lanes whose B values are zeroed."""
    d = np.zeros((32, 4))
    for m in range(f.nmma):
        b0, b1 = b[:, 2 * m].copy(), b[:, 2 * m + 1].copy()
        if mask is not None:
            b0[mask] = 0
            b1[mask] = 0
        d += mma_16816(np.stack([wa[:, 2 * m], wb[:, 2 * m], wa[:, 2 * m + 1], wb[:, 2 * m + 1]]), b0, b1)
    return d


def add_scaled(acc, d0, d1, sa, sb) -> None:
    """_moe_packed.cuh.j2 add_scaled: acc [32, 4] += the two groups' partial sums times their rows' scales."""
    acc[:, 0] += sa[:, 0] * d0[:, 0] + sa[:, 1] * d1[:, 0]
    acc[:, 1] += sa[:, 0] * d0[:, 1] + sa[:, 1] * d1[:, 1]
    acc[:, 2] += sb[:, 0] * d0[:, 2] + sb[:, 1] * d1[:, 2]
    acc[:, 3] += sb[:, 0] * d0[:, 3] + sb[:, 1] * d1[:, 3]


def rows_dot(f: Fmt, w, rows_a, rows_b, bw_words, ns: int):
    """f::rows_dot over warp steps [0, ns): bw_words(s) -> B words [32, NP] of step s. -> acc_a, acc_b [32]."""
    acc_a, acc_b = np.zeros(32), np.zeros(32)
    for s in range(ns):
        wa, wb, sa, sb = lanes_of_warp(f, w, rows_a, rows_b, s)
        d = mma_chunk(f, wa, wb, bw_words(s))
        acc_a += sa[:, 0] * d[:, 0] + sa[:, 1] * d[:, 1]
        acc_b += sb[:, 0] * d[:, 2] + sb[:, 1] * d[:, 3]
    return acc_a, acc_b


def silu(v):
    return v / (1 + np.exp(-v))


def stage_pairs(f: Fmt, values: np.ndarray, lanes: int, lane0: int, limit: int) -> np.ndarray:
    """Words [lanes / 2] of values[lane0 + l] (0 at or past limit) in the pair order, chunk after chunk."""
    out = np.zeros(lanes // 2, np.uint32)
    for wd in range(lanes // 2):
        c, k = divmod(wd, f.np_)
        l0, l1 = lane0 + c * f.chunk + f.pair_lane(k, 0), lane0 + c * f.chunk + f.pair_lane(k, 1)
        lo = values[l0] if l0 < limit else 0
        hi = values[l1] if l1 < limit else 0
        out[wd] = int(bf16_bits(np.float32(lo))) | (int(bf16_bits(np.float32(hi))) << 16)
    return out


def split_hi_lo(f: Fmt, values: np.ndarray, lanes: int, lane0: int, limit: int):
    """hi = bf16(h), lo = bf16(h - hi) staged in the pair order (moe_down_packed, moe_down_grouped_packed)."""
    hi = np.zeros(lanes, np.float32)
    lo = np.zeros(lanes, np.float32)
    for j in range(lanes):
        v = np.float32(values[lane0 + j]) if lane0 + j < limit else np.float32(0)
        hb = bf16_bits(v)
        hv = (np.uint32(hb) << 16).view(np.float32)
        hi[j], lo[j] = hv, np.float32(v - hv)
    return stage_pairs(f, hi, lanes, 0, lanes), stage_pairs(f, lo, lanes, 0, lanes)


# ---- the kernels ---------------------------------------------------------------------------------------------
def emulate_gate_up_split(f: Fmt, tile: dict, x, gate_up, ids, E, I):
    T, H = x.shape
    K = ids.shape[1]
    TASKS, KS = tile["tasks"], tile["ks"]
    h = np.full((T, K, I), np.nan)
    nb = -(-I // (8 * TASKS))
    HP = (H + 127) & ~127
    NS = HP // f.step
    for b in range(T * K * nb):
        tk, ib = divmod(b, nb)
        i0 = ib * 8 * TASKS
        t, k = divmod(tk, K)
        e = int(ids[t, k])
        if e < 0 or e >= E:
            h[t, k, i0:min(i0 + 8 * TASKS, I)] = 0
            continue
        xs = stage_pairs(f, x[t], HP, 0, H)
        part = np.zeros((TASKS, KS, 8, 2))
        for warp in range(TASKS * KS):
            task, ks = divmod(warp, KS)
            s0, s1 = ks * NS // KS, (ks + 1) * NS // KS
            if not (i0 + 8 * task < I and s1 > s0):
                continue
            n = e * 2 * I + i0 + 8 * task + G_
            rows_a = [f.advance(f.row(E * 2 * I, H, int(n[ln])), s0) for ln in range(32)]
            rows_b = [f.advance(f.row(E * 2 * I, H, int(n[ln]) + I), s0) for ln in range(32)]
            live = (G_ < 2) & ((G_ & 1) == (C_ >> 1))

            def bw(s):
                words = np.stack([xs[(s0 + s) * 4 * f.np_ + C_[ln] * f.np_ + np.arange(f.np_)] for ln in range(32)])
                words[~live] = 0
                return words
            ag, au = rows_dot(f, gate_up, rows_a, rows_b, bw, s1 - s0)
            ag = ag + ag[LANE ^ 1]
            au = au + au[LANE ^ 1]
            for ln in range(32):
                if C_[ln] == 0:
                    part[task, ks, G_[ln]] = ag[ln], au[ln]
        for tid in range(8 * TASKS):
            if i0 + tid < I:
                tt, it = divmod(tid, 8)
                sg, su = part[tt, :, it, 0].sum(), part[tt, :, it, 1].sum()
                h[t, k, i0 + tid] = silu(sg) * su
    return h


def emulate_down_split(f: Fmt, tile: dict, h, down, weights, ids, E, H):
    T, K, I = h.shape
    TASKS, KW = tile["tasks"], tile["kw"]
    y = np.full((T, H), np.nan)
    nb = -(-H // (16 * TASKS))
    IP = (I + 127) & ~127
    NS = IP // f.step
    for b in range(T * nb):
        t, nbi = divmod(b, nb)
        n0 = nbi * 16 * TASKS
        se = [int(e) if 0 <= e < E else -1 for e in ids[t]]
        sw = [float(weights[t, k]) if se[k] >= 0 else 0.0 for k in range(K)]
        hhi, hlo = zip(*[split_hi_lo(f, h[t, k], IP, 0, I) for k in range(K)])
        part = np.zeros((TASKS, KW, 16))
        live = (G_ < 4) & ((G_ & 1) == (C_ >> 1))
        for warp in range(TASKS * KW):
            task, kw = divmod(warp, KW)
            r0 = n0 + 16 * task
            if r0 >= H:
                continue
            acc_a, acc_b = np.zeros(32), np.zeros(32)
            for k in range(kw, K, KW):
                if se[k] < 0:
                    continue
                ra = np.minimum(r0 + G_, H - 1)
                rb = np.minimum(r0 + G_ + 8, H - 1)
                rows_a = [f.row(E * H, I, se[k] * H + int(ra[ln])) for ln in range(32)]
                rows_b = [f.row(E * H, I, se[k] * H + int(rb[ln])) for ln in range(32)]

                def bw(s, k=k):
                    src = [hhi[k] if G_[ln] < 2 else hlo[k] for ln in range(32)]
                    words = np.stack([src[ln][s * 4 * f.np_ + C_[ln] * f.np_ + np.arange(f.np_)] for ln in range(32)])
                    words[~live] = 0
                    return words
                da, db = rows_dot(f, down, rows_a, rows_b, bw, NS)
                acc_a += sw[k] * da
                acc_b += sw[k] * db
            acc_a = acc_a + acc_a[LANE ^ 1]
            acc_b = acc_b + acc_b[LANE ^ 1]
            for ln in range(32):
                if C_[ln] == 0:
                    part[task, kw, G_[ln]], part[task, kw, G_[ln] + 8] = acc_a[ln], acc_b[ln]
        for tid in range(16 * TASKS):
            if n0 + tid < H:
                y[t, n0 + tid] = part[tid // 16, :, tid % 16].sum()
    return y


def emulate_align(ids, E, threads: int = 1024):
    """moe_align.cu.j2 chunk by chunk: counts, serial scan, then ranks from warp matches and per-warp counts."""
    flat = ids.flatten()
    n = flat.size
    key = np.where((flat >= 0) & (flat < E), flat, E)
    nxt = np.zeros(E + 1, np.int64)
    for i in range(n):
        nxt[key[i]] += 1
    offsets = np.zeros(E, np.int64)
    run = 0
    for e in range(E + 1):
        c = nxt[e]
        nxt[e] = run
        run += c
        if e < E:
            offsets[e] = run
    order = np.full(n, -1, np.int64)
    for base in range(0, n, threads):
        keys = [key[base + tid] if base + tid < n else -1 for tid in range(threads)]
        wcount = np.zeros((threads // 32, E + 1), np.int64)
        ranks = []
        for tid in range(threads):
            warp, lane = divmod(tid, 32)
            same = [ln for ln in range(32) if keys[warp * 32 + ln] == keys[tid]]
            rank = sum(1 for ln in same if ln < lane)
            ranks.append((rank, len(same)))
            if keys[tid] >= 0 and rank == 0:
                wcount[warp, keys[tid]] = len(same)
        for tid in range(threads):
            if keys[tid] >= 0:
                warp = tid // 32
                order[nxt[keys[tid]] + ranks[tid][0] + wcount[:warp, keys[tid]].sum()] = base + tid
        for tid in range(threads):
            if keys[tid] >= 0 and ranks[tid][0] == 0:
                nxt[keys[tid]] += ranks[tid][1]
    return order.reshape(ids.shape), offsets


def expert_pairs(offsets, e: int, TK: int) -> tuple[int, int]:
    """[p_begin, p_end) of expert e's pairs in moe_align's order (e == E: the pairs of invalid ids)."""
    E = offsets.size
    return 0 if e == 0 else int(offsets[e - 1]), int(offsets[e]) if e < E else TK


def find_pass(offsets, TK: int, NT: int, threads: int, pass_: int):
    """_moe_grouped.cuh.j2's find_pass: thread tid counts the passes of its ceil((E + 1) / threads) segments, an
    exclusive scan gives its first pass number, the thread whose range holds the pass names (segment, first pair)."""
    E = offsets.size
    per = (E + threads) // threads
    def passes(s):
        b, e = expert_pairs(offsets, s, TK)
        return (e - b + NT - 1) // NT
    mine = [sum(passes(s) for s in range(tid * per, min(tid * per + per, E + 1))) for tid in range(threads)]
    first = np.concatenate([[0], np.cumsum(mine)[:-1]])
    hits = [tid for tid in range(threads) if first[tid] <= pass_ < first[tid] + mine[tid]]
    if not hits:
        return None
    assert len(hits) == 1   # one writer of the shared result
    n = int(first[hits[0]])
    for s in range(hits[0] * per, min(hits[0] * per + per, E + 1)):
        if pass_ < n + passes(s):
            return s, expert_pairs(offsets, s, TK)[0] + (pass_ - n) * NT
        n += passes(s)
    raise AssertionError("the thread's range holds the pass")


def grouped_blocks(flat, offsets, NT: int, threads: int, nb: int, width: int, out: np.ndarray):
    """The grouped kernels' grid: block b takes pass b // nb (find_pass) and column block b % nb (`width` columns
    of out). The invalid ids' passes zero their pairs' columns here; every other block yields (expert, column
    block, the pass's pairs: NT entries, -1 past the expert's last)."""
    E, TK = offsets.size, flat.size
    for b in range((-(-TK // NT) + E + 1) * nb):
        pass_, cb = divmod(b, nb)
        found = find_pass(offsets, TK, NT, threads, pass_)
        if found is None:
            continue
        e, p0 = found
        p_end = min(p0 + NT, expert_pairs(offsets, e, TK)[1])
        if e == E:
            for p in range(p0, p_end):
                out[flat[p], cb * width:min(cb * width + width, out.shape[1])] = 0
            continue
        yield e, cb, [int(flat[p0 + c]) if p0 + c < p_end else -1 for c in range(NT)]


def stage_tile(f: Fmt, rows: np.ndarray, pr: list, s0: int, XW: int, limit: int):
    """The grouped kernels' staging of one tile (warp steps s0 ..): per pass column c, the values rows[pr[c]] at
    lanes s0 * STEP + lt, each lane stored at its pair-order place as hi = bf16(v) and lo = bf16(v - hi)
    (x, already bf16, has lo = 0); columns past the expert's pairs and lanes at or past `limit` are zero."""
    hi, lo = np.zeros((len(pr), XW), np.uint32), np.zeros((len(pr), XW), np.uint32)
    for c, pair in enumerate(pr):
        if pair < 0:
            continue
        row_hi, row_lo = hi[c].view(np.uint16), lo[c].view(np.uint16)
        for lt in range(2 * XW):
            lane = s0 * f.step + lt
            v = np.float32(rows[pair, lane] if lane < limit else 0)
            hb = bf16_bits(v)
            ch = lt // f.chunk
            k, half = f.lane_pair(lt - ch * f.chunk)
            row_hi[2 * (ch * f.np_ + k) + half] = hb
            row_lo[2 * (ch * f.np_ + k) + half] = bf16_bits(np.float32(v - (np.uint32(hb) << 16).view(np.float32)))
    return hi, lo


def grouped_step(f: Fmt, w, rows_a, rows_b, s: int, u: int, tables: list, acc) -> None:
    """One warp step of the grouped kernels: rows (g, g+8) decoded once, then for every column group c two mma
    per k-slot pair (one per scale group) with each staged table in `tables` (x; or h hi, h lo), scaled."""
    wa, wb, sa, sb = lanes_of_warp(f, w, rows_a, rows_b, s)
    idx = [u * 4 * f.np_ + C_[ln] * f.np_ + np.arange(f.np_) for ln in range(32)]
    for c in range(acc.shape[0]):
        d0, d1 = np.zeros((32, 4)), np.zeros((32, 4))
        for tab in tables:
            bwords = np.stack([tab[8 * c + G_[ln], idx[ln]] for ln in range(32)])
            d0 += mma_chunk(f, wa, wb, bwords, mask=C_ >= 2)
            d1 += mma_chunk(f, wa, wb, bwords, mask=C_ < 2)
        add_scaled(acc[c], d0, d1, sa, sb)


def emulate_gate_up_grouped(f: Fmt, tile: dict, x, gate_up, order, offsets, I):
    T, H = x.shape
    K = order.shape[1]
    E = offsets.size
    TASKS, GROUPS, KT = tile["tasks"], tile["groups"], tile["kt"]
    NT, XW = 8 * GROUPS, KT * 4 * f.np_
    flat, xt = order.flatten(), x[np.arange(T * K) // K]     # xt: x of each pair's token
    h = np.full((T * K, I), np.nan)
    nb = -(-I // (8 * TASKS))
    NS = ((H + 127) & ~127) // f.step
    for e, ib, pr in grouped_blocks(flat, offsets, NT, 32 * TASKS, nb, 8 * TASKS, h):
        i0 = ib * 8 * TASKS
        acc = np.zeros((TASKS, GROUPS, 32, 4))
        for s0 in range(0, NS, KT):
            xs, _ = stage_tile(f, xt, pr, s0, XW, H)
            for warp in range(TASKS):
                if not i0 + 8 * warp < I:
                    continue
                item = i0 + 8 * warp + G_
                rows_a = [f.row(E * 2 * I, H, e * 2 * I + int(item[ln])) for ln in range(32)]
                rows_b = [f.row(E * 2 * I, H, e * 2 * I + int(item[ln]) + I) for ln in range(32)]
                for u in range(min(KT, NS - s0)):
                    grouped_step(f, gate_up, rows_a, rows_b, s0 + u, u, [xs], acc[warp])
        for warp in range(TASKS):
            if not i0 + 8 * warp < I:
                continue
            for ln in range(32):
                for c in range(GROUPS):
                    for j in range(2):
                        pair = pr[8 * c + 2 * C_[ln] + j]
                        if pair >= 0:
                            h[pair, i0 + 8 * warp + G_[ln]] = silu(acc[warp, c, ln, j]) * acc[warp, c, ln, 2 + j]
    return h.reshape(T, K, I)


def emulate_down_grouped(f: Fmt, tile: dict, h, down, weights, order, offsets, H):
    T, K, I = h.shape
    E = offsets.size
    TASKS, GROUPS, KT = tile["tasks"], tile["groups"], tile["kt"]
    NT, XW = 8 * GROUPS, KT * 4 * f.np_
    flat, hf_, wf = order.flatten(), h.reshape(T * K, I), weights.flatten()
    ys = np.full((T * K, H), np.nan)
    nb = -(-H // (16 * TASKS))
    NS = ((I + 127) & ~127) // f.step
    for e, nbi, pr in grouped_blocks(flat, offsets, NT, 32 * TASKS, nb, 16 * TASKS, ys):
        n0 = nbi * 16 * TASKS
        acc = np.zeros((TASKS, GROUPS, 32, 4))
        for s0 in range(0, NS, KT):
            hhi, hlo = stage_tile(f, hf_, pr, s0, XW, I)
            for warp in range(TASKS):
                r0 = n0 + 16 * warp
                if r0 >= H:
                    continue
                rows_a = [f.row(E * H, I, e * H + min(r0 + int(G_[ln]), H - 1)) for ln in range(32)]
                rows_b = [f.row(E * H, I, e * H + min(r0 + int(G_[ln]) + 8, H - 1)) for ln in range(32)]
                for u in range(min(KT, NS - s0)):
                    grouped_step(f, down, rows_a, rows_b, s0 + u, u, [hhi, hlo], acc[warp])
        for warp in range(TASKS):
            r0 = n0 + 16 * warp
            if r0 >= H:
                continue
            for ln in range(32):
                for c in range(GROUPS):
                    for j in range(2):
                        pair = pr[8 * c + 2 * C_[ln] + j]
                        if pair < 0:
                            continue
                        if r0 + G_[ln] < H:
                            ys[pair, r0 + G_[ln]] = wf[pair] * acc[warp, c, ln, j]
                        if r0 + G_[ln] + 8 < H:
                            ys[pair, r0 + G_[ln] + 8] = wf[pair] * acc[warp, c, ln, 2 + j]
    return ys.reshape(T, K, H)


# ---- the tests --------------------------------------------------------------------------------------------------
# H = 264: three q4 warp steps (six for w8 / fp8), so the split-K ranges, kt tiles and the last partial tile all occur;
# I = 40 and H not multiples of 128 (expert slices start mid-tile); one id outside [0, E); for the grouped kernels
# 40 tokens, 36 of them on expert 1 (two passes of 32).
H, E, I, K = 264, 3, 40, 2


def problem(fmt: str, T: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    gate_up = formats.encode(fmt, rng.standard_normal((E * 2 * I, H), dtype=np.float32) * 0.1)
    down = formats.encode(fmt, rng.standard_normal((E * H, I), dtype=np.float32) * 0.1)
    x = rng.standard_normal((T, H)).astype(np.float32)
    x = (bf16_bits(x) << 16).astype(np.uint32).view(np.float32)     # bf16 values, as the kernels read them
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    busy = min(T, 36)
    ids[:busy, 1] = np.where(ids[:busy, 0] == 1, ids[:busy, 1], ids[:busy, 0])   # keep the pairs distinct
    ids[:busy, 0] = 1
    ids[T // 2, 1] = -1
    weights = rng.random((T, K)).astype(np.float32)
    return gate_up, down, x, ids, weights


def reference(op: str, **kw):
    be = ReferenceBackend()
    outs = {k: v for k, v in kw.items() if k in be.contract(op)["outputs"]}
    be.run(op, **kw)
    return {k: v.double().numpy() for k, v in outs.items()}


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert not np.isnan(got).any(), f"{what}: elements the kernel never writes"
    v = compare(torch.from_numpy(got), torch.from_numpy(want), ReferenceBackend().manifest.tolerances["bf16_reduction"], what)
    assert v, v.detail


@pytest.mark.parametrize("fmt", FMTS)
def test_split_kernels(fmt):
    f = Fmt(fmt)
    T = 5
    gate_up, down, x, ids, weights = problem(fmt, T)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    want_h = reference(f"moe_gate_up_{fmt}", x=t(x), gate_up=t(gate_up), ids=t(ids), h=torch.empty(T, K, I), E=E)["h"]
    for name, tile in tiles("moe_gate_up_packed.yaml", "gemv").items():
        close(emulate_gate_up_split(f, tile, x, gate_up, ids, E, I), want_h, f"moe_gate_up_{fmt} {name}")
    want_y = reference(f"moe_down_{fmt}", h=t(want_h.astype(np.float32)), down=t(down), weights=t(weights), ids=t(ids),
                       y=torch.empty(T, H), E=E)["y"]
    for name, tile in tiles("moe_down_packed.yaml", "gemv").items():
        close(emulate_down_split(f, tile, want_h, down, weights, ids, E, H), want_y, f"moe_down_{fmt} {name}")


@pytest.mark.parametrize("fmt", FMTS)
def test_grouped_kernels(fmt):
    f = Fmt(fmt)
    T = 40
    gate_up, down, x, ids, weights = problem(fmt, T, seed=1)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    order, offsets = emulate_align(ids, E, threads=64)
    assert max(np.diff(offsets, prepend=0)) > 32, "some expert takes two passes"
    want_h = reference(f"moe_gate_up_grouped_{fmt}", x=t(x), gate_up=t(gate_up), order=t(order.astype(np.int32)),
                       offsets=t(offsets.astype(np.int32)), h=torch.empty(T, K, I))["h"]
    for name, tile in tiles("moe_gate_up_grouped_packed.yaml", "mma").items():
        close(emulate_gate_up_grouped(f, tile, x, gate_up, order, offsets, I), want_h, f"moe_gate_up_grouped_{fmt} {name}")
    want_ys = reference(f"moe_down_grouped_{fmt}", h=t(want_h.astype(np.float32)), down=t(down), weights=t(weights),
                        order=t(order.astype(np.int32)), offsets=t(offsets.astype(np.int32)), ys=torch.empty(T, K, H))["ys"]
    for name, tile in tiles("moe_down_grouped_packed.yaml", "mma").items():
        close(emulate_down_grouped(f, tile, want_h, down, weights, order, offsets, H), want_ys,
              f"moe_down_grouped_{fmt} {name}")


def test_find_pass_numbers_every_pass_once():
    """The grouped kernels' grid (cdiv(T*K, NT) + E + 1 passes) holds every pass of every segment, in order, once,
    however the pairs spread over the experts: a hot expert, empty ones, invalid ids, more segments than threads."""
    rng = np.random.default_rng(3)
    for E, threads, NT in [(3, 128, 32), (300, 128, 32), (511, 256, 64), (256, 256, 32)]:
        counts = rng.integers(0, 5, E) * (rng.random(E) < 0.7)
        counts[rng.integers(E)] += 700                                    # one hot expert
        offsets = np.cumsum(counts)
        TK = int(offsets[-1]) + 5                                         # 5 pairs with invalid ids
        want = [(s, p) for s in range(E + 1) for p in range(*expert_pairs(offsets, s, TK), NT)]
        grid = -(-TK // NT) + E + 1
        got = [find_pass(offsets, TK, NT, threads, k) for k in range(grid)]
        assert got == want + [None] * (grid - len(want)), (E, threads, NT)


def test_align_is_the_reference_sort():
    rng = np.random.default_rng(3)
    for n_tok, n_exp, k in [(24, 3, 2), (50, 7, 3), (1, 4, 2)]:
        ids = np.stack([rng.permutation(n_exp)[:k] for _ in range(n_tok)]).astype(np.int32)
        ids[0, 0] = -1
        ids[-1, -1] = n_exp
        order, offsets = emulate_align(ids, n_exp, threads=64)     # chunks of 64: several per problem
        want = reference("moe_align", ids=torch.from_numpy(ids), order=torch.empty(n_tok, k, dtype=torch.int32),
                         offsets=torch.empty(n_exp, dtype=torch.int32))
        assert (order == want["order"]).all() and (offsets == want["offsets"]).all()


def emulate_dequant_lanes8(f: Fmt, w: np.ndarray, N: int, K: int) -> np.ndarray:
    """dequant_packed_lanes8.cu.j2: unit i = 8 lanes of row i // (K / 8); pk::load8 / decode8; bf16(v * s)."""
    per_row = K // 8
    y = np.zeros(N * K, np.uint32)
    for i in range(N * per_row):
        n, c8 = divmod(i, per_row)
        co, ho, so = f.row(N, K, n)
        if f.bits == 8:
            b = w[co + 8 * c8: co + 8 * c8 + 8]
            v = (torch.from_numpy(b.copy()).view(torch.float8_e4m3fn).float().numpy() if f.fp8
                 else b.view(np.int8).astype(np.float32))
        else:
            word = int.from_bytes(w[co + 4 * c8: co + 4 * c8 + 4].tobytes(), "little")
            hb = 0
            if f.high == 1:
                hb = int(w[ho + c8])
            elif f.high == 2:
                hb = int.from_bytes(w[ho + 2 * c8: ho + 2 * c8 + 2].tobytes(), "little")
            u = [((word >> (4 * j)) & 15) | (((hb >> (f.high * j)) & ((1 << f.high) - 1)) << 4 if f.high else 0)
                 for j in range(8)]
            sign = 1 << (f.bits - 1)
            v = np.array([(x_ ^ sign) - sign for x_ in u], np.float32)
        s = (np.frombuffer(w[so:so + 4].tobytes(), np.float32)[0] if f.fp8
             else np.frombuffer(w[so + 2 * ((8 * c8) // f.group): so + 2 * ((8 * c8) // f.group) + 2].tobytes(), np.float16)[0])
        y[8 * i: 8 * i + 8] = bf16_bits(np.float32(v * np.float32(s)))
    return y.astype(np.uint16)


@pytest.mark.parametrize("fmt", FMTS)
def test_dequant_lanes8(fmt):
    f = Fmt(fmt)
    N, Kd = 130, 200          # a short last tile, K not a multiple of 128
    w = formats.encode(fmt, np.random.default_rng(4).standard_normal((N, Kd), dtype=np.float32) * 0.05)
    want = torch.empty(N, Kd, dtype=torch.bfloat16)
    ReferenceBackend().run(f"dequant_{fmt}", w=torch.from_numpy(w), y=want)
    got = emulate_dequant_lanes8(f, w, N, Kd)
    assert (got == want.view(torch.int16).numpy().astype(np.uint16).reshape(-1)).all()


def test_pair_order_round_trips():
    for fmt in FMTS:
        f = Fmt(fmt)
        for j in range(f.chunk):
            k, hf = f.lane_pair(j)
            assert f.pair_lane(k, hf) == j
