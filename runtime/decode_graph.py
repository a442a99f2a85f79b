"""Decode as a CUDA-graph replay: one graph per batch size, captured once at start-up.

Everything a decode step reads lives in static device buffers (token ids, positions, page tables,
state slots, sampling parameters, RNG counters); a step writes them with one pinned host-to-device copy
per buffer group, replays the graph, and reads back only the sampled ids. Inside the graph nothing is
allocated that the next replay does not reuse, and nothing syncs with the host. A step can be queued before the
previous one's ids reach the host (launch / collect): its rows then take their input ids from the previous
replay's output on the device (Engine.decode's step ahead).
"""
from __future__ import annotations

import gc

import torch

from .models.blocks import Step

_INT_FIELDS = ("ids", "positions", "slot_mapping", "state_slots", "top_k", "seed", "counter", "from_device")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence", "frequency")


def capture(fn, warmup=None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of fn's launches. warmup (default: fn) runs first on a side stream, as torch requires:
    modules load and first-call state is allocated outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warmup or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # No garbage collection inside the capture: collecting a dropped engine frees its pinned host buffers
    # (cudaFreeHost), a call that invalidates a capture in progress.
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph):
            fn()
    finally:
        if enabled:
            gc.enable()
    return graph


def seed32(seed: int) -> int:
    """A sampling seed as the int32 the sample op takes (its low 32 bits, two's complement)."""
    return ((seed & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def count_tokens(counts: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor, add: torch.Tensor | None = None) -> None:
    """counts[slots[i], ids[i]] += 1 (add[i] where given) on the counts' device, in one launch and without a host sync
    (so a graph captures it): the generated-token counts the sample op's presence / frequency penalties read. Repeated
    (slot, id) pairs add up (a speculative round's drafts)."""
    counts.view(-1).scatter_add_(0, slots.long() * counts.shape[1] + ids.long(), torch.ones_like(ids) if add is None else add)


class HostStep:
    """The host side of a decode step: the pinned int32 / float32 buffers a step copies to the device, written
    in place through numpy views (no tensor per field). Layout: each field a `stride`-long slot (first b used),
    then the [b, width] page table. A row's page-table entries are rewritten only when its sequence changes
    or gains pages (rows past a sequence's pages stay 0), so a step writes O(b) values, not O(b * width)."""

    def __init__(self, ints: torch.Tensor, floats: torch.Tensor, b: int, stride: int, width: int, page_size: int):
        self.ints, self.floats, self.page_size = ints.numpy(), floats.numpy(), page_size
        self.io = {n: i * stride for i, n in enumerate(_INT_FIELDS)}     # each field's offset
        self.fo = {n: i * stride for i, n in enumerate(_FLOAT_FIELDS)}
        self.table = self.ints[len(_INT_FIELDS) * stride:].reshape(b, width)
        self.rows: list = [None] * b          # (sequence, pages written) per page-table row

    def fill(self, seqs, ahead: bool = False) -> None:
        """ahead: the step after the one in flight, whose tokens the host has not seen yet. Each row then feeds its
        sequence's next token from the graph's previous output on the device (from_device), one position further."""
        ps, iv, fv, io, fo = self.page_size, self.ints, self.floats, self.io, self.fo
        for r, s in enumerate(seqs):
            p = len(s.tokens) - 1 + ahead
            sp = s.sampling
            iv[io["ids"] + r] = s.tokens[-1]
            iv[io["positions"] + r] = p
            iv[io["slot_mapping"] + r] = s.pages[p // ps] * ps + p % ps
            iv[io["state_slots"] + r] = s.slot
            iv[io["top_k"] + r] = sp.top_k
            iv[io["seed"] + r] = seed32(s.seed)
            iv[io["counter"] + r] = s.n_generated + ahead
            iv[io["from_device"] + r] = ahead
            fv[fo["temperature"] + r], fv[fo["top_p"] + r], fv[fo["min_p"] + r] = sp.temperature, sp.top_p, sp.min_p
            fv[fo["presence"] + r], fv[fo["frequency"] + r] = sp.presence_penalty, sp.frequency_penalty
            seq, done = self.rows[r] or (None, 0)
            if seq is not s:
                self.table[r] = 0
                done = 0
            n = len(s.pages)
            if n != done:
                self.table[r, done:n] = s.pages[done:n]
                self.rows[r] = (s, n)


class _Graph:
    def __init__(self, engine, b: int):
        dev, cache = engine.device, engine.cache
        self.engine, self.b = engine, b
        self.width = cache.pages_per_seq
        # one buffer per dtype, so a step is two copies; each field is a view starting on a 16-byte boundary
        # (kernels may use vector loads on any argument)
        self.stride = stride = -(-b // 4) * 4
        self.ints = torch.zeros(len(_INT_FIELDS) * stride + b * self.width, dtype=torch.int32, device=dev)
        self.floats = torch.zeros(len(_FLOAT_FIELDS) * stride, dtype=torch.float32, device=dev)
        # two sets of pinned host buffers, taken in turn: a launch may be queued while the previous one is in
        # flight (Engine.decode's step ahead), and a set is rewritten only after the launch that used it was
        # collected, i.e. after its host-to-device copies ran
        self.host_ints = [torch.zeros_like(self.ints, device="cpu").pin_memory() for _ in range(2)]
        self.host_floats = [torch.zeros_like(self.floats, device="cpu").pin_memory() for _ in range(2)]
        self.hosts = [HostStep(i, f, b, stride, self.width, cache.page_size)
                      for i, f in zip(self.host_ints, self.host_floats)]
        self.f = {n: self.ints[i * stride:i * stride + b] for i, n in enumerate(_INT_FIELDS)}
        self.f |= {n: self.floats[i * stride:i * stride + b] for i, n in enumerate(_FLOAT_FIELDS)}
        self.block_table = self.ints[len(_INT_FIELDS) * stride:].view(b, self.width)
        self.token_seq = torch.arange(b, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(b, dtype=torch.int32, device=dev)
        self.out = torch.empty(b, dtype=torch.int32, device=dev)
        self.host_out = [torch.zeros(b, dtype=torch.int32).pin_memory() for _ in range(2)]   # the ids, in turn too
        self.copied = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0
        # warm-up writes nothing real: KV writes are skipped (slot -1), GDN state goes to the scratch slot
        self.f["slot_mapping"].fill_(-1)
        self.f["state_slots"].fill_(cache.max_seqs)
        self.f["temperature"].fill_(0.0)
        self.f["top_p"].fill_(1.0)
        self.graph = capture(self._body)

    def _body(self) -> None:
        e, f = self.engine, self.f
        step = Step(positions=f["positions"], token_seq=self.token_seq, query_start=self.query_start,
                    slot_mapping=f["slot_mapping"], block_table=self.block_table, state_slots=f["state_slots"],
                    decode=True)
        ids = torch.where(f["from_device"] != 0, self.out, f["ids"])   # rows fed by the previous replay's output
        logits = e.model.forward(e.be, ids, step, self.rows)
        e.be.run("sample", logits=logits, counts=e._counts.index_select(0, f["state_slots"]),
                 temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"], min_p=f["min_p"],
                 presence=f["presence"], frequency=f["frequency"], seed=f["seed"], counter=f["counter"],
                 ids=self.out, domain=e.domain)
        count_tokens(e._counts, f["state_slots"], self.out)   # on the device: no host-launched add per lane a step

    def launch(self, seqs, ahead: bool = False) -> int:
        """Queue a step (HostStep.fill's `ahead`: fed by the previous replay's ids on the device) and the copy of
        its ids to the host; returns the ticket collect() takes. Nothing waits here."""
        k, self.turn = self.turn, self.turn ^ 1
        self.hosts[k].fill(seqs, ahead)
        self.ints.copy_(self.host_ints[k], non_blocking=True)
        self.floats.copy_(self.host_floats[k], non_blocking=True)
        self.graph.replay()
        self.host_out[k].copy_(self.out, non_blocking=True)
        self.copied[k].record()
        return k

    def collect(self, k: int) -> list[int]:
        """The sampled ids of launch ticket k (the step's one host sync)."""
        self.copied[k].synchronize()
        return self.host_out[k].tolist()

    def run(self, seqs) -> list[int]:
        return self.collect(self.launch(seqs))


class DecodeGraphs:
    """A captured decode step for every batch size 1..max_seqs."""

    def __init__(self, engine):
        self.graphs = {b: _Graph(engine, b) for b in range(1, engine.cache.max_seqs + 1)}

    def run(self, seqs) -> list[int]:
        return self.graphs[len(seqs)].run(seqs)
