"""A speculative round over static buffers: on the GPU captured once per batch size as a CUDA graph and replayed (its
several hundred launches as one), elsewhere run as it is.

It serves every round but those with fewer MTP drafts than K near a lane's end; a lane with fewer n-gram drafts than
K has its rows padded and its count bounds what the step accepts. A round fills the buffers with two pinned host-to-device copies (the lanes' last tokens and drafts,
positions, KV slots, each row's sampling parameters and counter, state slots, page tables), replays, and reads back
the target's token at every row and the next round's drafts. Inside: the verify forward (each GDN layer one
gdn_verify that reads the lanes' states and writes none), every row's token drawn by the sample op (argmax at
temperature 0; penalty counts per row: the lane's generated tokens and the drafts before the row), the drafts each
lane keeps (counted on the device), the commit (gdn_verify again, each lane's states advanced over its kept rows: n + 1,
or up to an accepted stop token), the MTP layer over every row's pair (the row's final-normed hidden, the target's
token at the row: for the kept rows exactly the committed tokens; the rows after them write MTP KV at positions the
next round rewrites before reading), its output at each lane's last kept row, and K argmaxes with K - 1 MTP steps
between them at positions from the device. The final-normed hidden stays in the step's buffers until the next replay.
"""
from __future__ import annotations

import os

import torch

from .decode_graph import capture, count_tokens, seed32
from .models.blocks import Step, commit_round, side_stream

# The commit (gdn_verify again over each lane's kept rows: one launch a GDN layer, 48 in a 27B round, latency-bound on
# few SMs) on a stream of its own beside the MTP layer and the draft steps, which read the target's tokens and hidden
# but no GDN state; joined at the end of the round. H200, 27B q4, C = 8 round of known drafts (PERF_NOTES.md, session
# 36): 22.54 -> 21.65 ms. NINFER_SPEC_COMMIT_BESIDE=0 turns it off (A/B runs).
COMMIT_BESIDE = os.environ.get("NINFER_SPEC_COMMIT_BESIDE", "1") == "1"

# one per row; then per lane the state slot, the number of real drafts and the rows it keeps at most (up to its first
# draft that is a stop token: the lane ends there), then the [b, width] page table
_FIELDS = ("ids", "positions", "slot_mapping", "top_k", "seed", "counter", "row_slots")
_LANE_FIELDS = ("state_slots", "ndrafts", "stop_at")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence", "frequency")


class VerifyStep:
    """The static round of b lanes of `length` = K + 1 tokens (see the module docstring)."""

    def __init__(self, engine, b: int, length: int, graph: bool, counts: torch.Tensor, draft=None):
        """counts: a [>= b * length, V] int32 buffer for the rows' penalty counts, shared by the steps (one runs at a
        time). draft(be, mtp_out, ids): where given, the step also drafts the next round with the MTP layer."""
        dev, cache = engine.device, engine.cache
        self.engine, self.b, self.length, self.draft, self.mtp = engine, b, length, draft, draft is not None
        T = b * length
        self.width = cache.pages_per_seq
        self.stride = stride = -(-T // 4) * 4   # each field starts on a 16-byte boundary (vector loads)
        self.lane_stride = -(-b // 4) * 4
        self.table_at = len(_FIELDS) * stride + len(_LANE_FIELDS) * self.lane_stride
        sizes = self.table_at + b * self.width
        self.ints = torch.zeros(sizes, dtype=torch.int32, device=dev)
        self.floats = torch.zeros(len(_FLOAT_FIELDS) * stride, dtype=torch.float32, device=dev)
        self.host, self.host_floats = torch.zeros_like(self.ints, device="cpu"), torch.zeros_like(self.floats, device="cpu")
        if dev.type == "cuda":
            self.host, self.host_floats = self.host.pin_memory(), self.host_floats.pin_memory()
        self.f = {n: self.ints[i * stride:i * stride + T] for i, n in enumerate(_FIELDS)}
        self.f |= {n: self.floats[i * stride:i * stride + T] for i, n in enumerate(_FLOAT_FIELDS)}
        self.counts = counts[:T]
        for i, n in enumerate(_LANE_FIELDS):
            at = len(_FIELDS) * stride + i * self.lane_stride
            self.f[n] = self.ints[at:at + b]
        self.state_slots = self.f["state_slots"]
        self.block_table = self.ints[self.table_at:].view(b, self.width)
        self.token_seq = torch.arange(b, dtype=torch.int32, device=dev).repeat_interleave(length)
        self.query_start = torch.arange(0, T + 1, length, dtype=torch.int32, device=dev)
        self.rows = torch.arange(T, dtype=torch.int32, device=dev)
        self.out = torch.empty(T, dtype=torch.int32, device=dev)
        # draft j of every lane: row j, each row 16-byte aligned (the kernels' pointer contract: argmax writes it)
        self.drafts = torch.empty(length - 1, -(-b // 4) * 4, dtype=torch.int32, device=dev)[:, :b]
        self.lanes = torch.arange(b, dtype=torch.int32, device=dev)
        self.lane_qs = torch.arange(b + 1, dtype=torch.int32, device=dev)
        # (row, flat index of a draft before it in the row's lane): row i of a lane counts drafts 1..i
        pairs = [(r * length + i, r * length + j) for r in range(b) for i in range(1, length) for j in range(1, i + 1)]
        self.pair_rows = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=dev)
        self.pair_drafts = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dev)
        self.no_commit = torch.zeros(b, dtype=torch.int32, device=dev)   # the verify's gdn_verify writes no state
        self.row_in_lane = torch.arange(length, dtype=torch.int32, device=dev).repeat(b)
        self.normed = None
        self.graph = None
        if graph:   # warm-up and capture write nothing real: no KV (slot -1), GDN state and counts in the scratch lane
            self.f["slot_mapping"].fill_(-1)
            self.state_slots.fill_(cache.max_seqs)
            self.f["row_slots"].fill_(cache.max_seqs)
            self.f["stop_at"].fill_(length)
            self.f["top_p"].fill_(1.0)
            self.graph = capture(self._body)

    def _body(self) -> None:
        e, b, L = self.engine, self.b, self.length
        keep = []
        step = Step(positions=self.f["positions"], token_seq=self.token_seq, query_start=self.query_start,
                    slot_mapping=self.f["slot_mapping"], block_table=self.block_table, state_slots=self.state_slots,
                    keep=keep, commit=self.no_commit, run=L)
        logits, self.normed = e.model.forward(e.be, self.f["ids"], step, self.rows, normed=True)
        f = self.f
        self.counts.copy_(e._counts.index_select(0, f["row_slots"]))   # the lane's generated tokens, + its drafts
        count_tokens(self.counts, self.pair_rows, f["ids"][self.pair_drafts])   # (as the decode graph counts)
        e.be.run("sample", logits=logits, counts=self.counts, temperature=f["temperature"], top_k=f["top_k"],
                 top_p=f["top_p"], min_p=f["min_p"], presence=f["presence"], frequency=f["frequency"], seed=f["seed"],
                 counter=f["counter"], ids=self.out, domain=e.domain)
        # drafts accepted per lane: the leading (real) drafts equal to the target's token at the row before them
        t, fed = self.out.view(b, L), self.f["ids"].view(b, L)
        real_draft = torch.arange(L - 1, device=t.device)[None, :] < self.f["ndrafts"][:, None]
        n = ((fed[:, 1:] == t[:, :-1]) & real_draft).int().cumprod(1).sum(1)
        # the commit: each lane's GDN states advanced over the rows it keeps, n + 1 or up to an accepted stop token,
        # and those rows' tokens counted for the penalties (as plain decoding counts each token it picks)
        kept = torch.minimum(n + 1, self.f["stop_at"]).int()
        side = side_stream(kept, "commit") if self.mtp and COMMIT_BESIDE else None
        if side is None:
            commit_round(e.be, keep, self.query_start, self.state_slots, kept)
        else:   # fork (keep holds the layers' inputs until the join below)
            side.wait_stream(torch.cuda.current_stream(kept.device))
            with torch.cuda.stream(side), e.be.beside():
                commit_round(e.be, keep, self.query_start, self.state_slots, kept)
        count_tokens(e._counts, f["row_slots"], self.out, (self.row_in_lane < kept.repeat_interleave(L)).int())
        if self.mtp:
            self._draft_next(step, n)
        if side is not None:   # join: the next round reads the committed states
            torch.cuda.current_stream(kept.device).wait_stream(side)

    def _draft_next(self, step: Step, n: torch.Tensor) -> None:
        """The next round's drafts: the MTP layer over every row's pair (at the verify step's positions), its output
        at each lane's last kept row (n: the drafts each lane kept), K argmaxes with K - 1 MTP steps between them."""
        e, b, L = self.engine, self.b, self.length
        last = e.model.mtp(e.be, self.out, self.normed, step).index_select(0, self.lanes * L + n)
        p = self.f["positions"].view(b, L)[:, 0] + n                 # each lane's last kept row's position
        real = self.f["slot_mapping"].view(b, L)[:, 0] >= 0          # (warm-up and capture write no KV)
        ps = e.cache.page_size
        for j in range(L - 1):
            self.draft(e.be, last, self.drafts[j])
            if j == L - 2:
                break
            pos = p + 1 + j   # pair (the previous output, draft j) one position on
            # (clamped: a warm-up's made-up positions stay inside the table; a real round's fit, _verify checks)
            page = self.block_table.gather(1, (pos // ps).clamp(max=self.width - 1).unsqueeze(1).long()).squeeze(1)
            mstep = Step(positions=pos.int(), token_seq=self.lanes, query_start=self.lane_qs,
                         slot_mapping=torch.where(real, page * ps + pos % ps, -1).int(), block_table=self.block_table,
                         state_slots=self.state_slots, decode=True)
            last = e.model.mtp(e.be, self.drafts[j], last, mstep)

    def run(self, seqs) -> tuple[list[list[int]], list[list[int]] | None]:
        """A round for these sequences (up to `length` - 1 drafts each, all of them with MTP; pages grown to cover the
        positions the step writes): the target's token at every row of each lane (row i drawn with the
        counter n_generated + i, as plain decoding draws that position), and with MTP each lane's next drafts."""
        ps, L, st, h, hf = self.engine.cache.page_size, self.length, self.stride, self.host.numpy(), self.host_floats.numpy()
        table = h[self.table_at:].reshape(self.b, self.width)
        table[:] = 0
        io = {n: i * st for i, n in enumerate(_FIELDS)}
        fo = {n: i * st for i, n in enumerate(_FLOAT_FIELDS)}
        for r, s in enumerate(seqs):
            o, p0, sp = r * L, len(s.tokens) - 1, s.sampling
            pos = range(p0, p0 + L)
            h[o:o + L] = [s.tokens[-1], *s.drafts] + [s.tokens[-1]] * (L - 1 - len(s.drafts))   # (padding: never kept)
            h[io["positions"] + o:io["positions"] + o + L] = pos
            h[io["slot_mapping"] + o:io["slot_mapping"] + o + L] = [s.pages[p // ps] * ps + p % ps for p in pos]
            h[io["top_k"] + o:io["top_k"] + o + L] = sp.top_k
            h[io["seed"] + o:io["seed"] + o + L] = seed32(s.seed)
            h[io["counter"] + o:io["counter"] + o + L] = range(s.n_generated, s.n_generated + L)
            h[io["row_slots"] + o:io["row_slots"] + o + L] = s.slot
            for name, v in (("temperature", sp.temperature), ("top_p", sp.top_p), ("min_p", sp.min_p),
                            ("presence", sp.presence_penalty), ("frequency", sp.frequency_penalty)):
                hf[fo[name] + o:fo[name] + o + L] = v
            lo = len(_FIELDS) * st + r
            h[lo] = s.slot
            h[lo + self.lane_stride] = len(s.drafts)
            h[lo + 2 * self.lane_stride] = next((j for j, d in enumerate(s.drafts, 1) if d in s.stop_ids), L)
            table[r, :len(s.pages)] = s.pages
        self.ints.copy_(self.host, non_blocking=True)
        self.floats.copy_(self.host_floats, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        got = torch.cat([self.out, self.drafts.t().reshape(-1)] if self.mtp else [self.out]).tolist()
        T = self.b * L
        targets = [got[r * L:(r + 1) * L] for r in range(self.b)]
        return targets, [got[T + r * (L - 1):T + (r + 1) * (L - 1)] for r in range(self.b)] if self.mtp else None
