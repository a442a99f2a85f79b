"""A speculative round's verify step over static buffers: on the GPU captured once per batch size as a CUDA graph
and replayed (its several hundred launches as one), elsewhere run as it is.

It serves the rounds whose every lane is greedy without penalties and verifies the full K drafts (the common case;
others run op by op). A round fills the buffers with one pinned host-to-device copy per dtype (the lanes' last
tokens and drafts, positions, KV slots, state slots, page tables), replays, and reads back the argmax of every row.
The final-normed hidden (what the MTP layer reads) and the inputs each GDN layer recorded (what a rollback re-runs)
stay in the graph's own buffers until the next replay. Before advancing the GDN states the step copies them aside
(SequenceCache.save_states) inside the graph too.
"""
from __future__ import annotations

import torch

from .decode_graph import capture
from .models.blocks import Step

_FIELDS = ("ids", "positions", "slot_mapping")   # one per row; then state_slots [b], then the [b, width] page table


class VerifyStep:
    def __init__(self, engine, b: int, length: int, graph: bool):
        dev, cache = engine.device, engine.cache
        self.engine, self.b, self.length = engine, b, length
        T = b * length
        self.width = cache.pages_per_seq
        self.stride = stride = -(-T // 4) * 4   # each field starts on a 16-byte boundary (vector loads)
        sizes = len(_FIELDS) * stride + -(-b // 4) * 4 + b * self.width
        self.ints = torch.zeros(sizes, dtype=torch.int32, device=dev)
        self.host = torch.zeros_like(self.ints, device="cpu")
        if dev.type == "cuda":
            self.host = self.host.pin_memory()
        self.f = {n: self.ints[i * stride:i * stride + T] for i, n in enumerate(_FIELDS)}
        base = len(_FIELDS) * stride
        self.state_slots = self.ints[base:base + b]
        self.block_table = self.ints[base + -(-b // 4) * 4:].view(b, self.width)
        self.token_seq = torch.arange(b, dtype=torch.int32, device=dev).repeat_interleave(length)
        self.query_start = torch.arange(0, T + 1, length, dtype=torch.int32, device=dev)
        self.rows = torch.arange(T, dtype=torch.int32, device=dev)
        self.out = torch.empty(T, dtype=torch.int32, device=dev)
        self.normed, self.keep = None, None
        self.graph = None
        if graph:   # warm-up and capture write nothing real: no KV (slot -1), GDN state in the scratch slot
            self.f["slot_mapping"].fill_(-1)
            self.state_slots.fill_(cache.max_seqs)
            self.graph = capture(self._body)

    def _body(self) -> None:
        e = self.engine
        self.keep = []
        step = Step(positions=self.f["positions"], token_seq=self.token_seq, query_start=self.query_start,
                    slot_mapping=self.f["slot_mapping"], block_table=self.block_table, state_slots=self.state_slots,
                    decode=self.length == 1, keep=self.keep)
        e.cache.save_states(self.state_slots)
        logits, self.normed = e.model.forward(e.be, self.f["ids"], step, self.rows, normed=True)
        e.be.run("argmax", logits=logits, ids=self.out, domain=e.domain)

    def run(self, seqs) -> list[int]:
        """Verify each sequence's last token and its drafts (all `length` - 1 of them, pages already grown): the
        argmax of every row, lane by lane."""
        ps, L, h = self.engine.cache.page_size, self.length, self.host.numpy()
        table = h[len(_FIELDS) * self.stride + -(-self.b // 4) * 4:].reshape(self.b, self.width)
        table[:] = 0
        base = len(_FIELDS) * self.stride
        for r, s in enumerate(seqs):
            o, p0 = r * L, len(s.tokens) - 1
            h[o:o + L] = [s.tokens[-1], *s.drafts]
            for i in range(L):
                p = p0 + i
                h[self.stride + o + i] = p
                h[2 * self.stride + o + i] = s.pages[p // ps] * ps + p % ps
            h[base + r] = s.slot
            table[r, :len(s.pages)] = s.pages
        self.ints.copy_(self.host, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        return self.out.tolist()
