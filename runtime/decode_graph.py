"""Decode as a CUDA-graph replay: one graph per batch size, captured once at start-up.

Everything a decode step reads lives in static device buffers (token ids, positions, page tables,
state slots, sampling parameters, RNG counters); a step writes them with one pinned host-to-device copy
per buffer group, replays the graph, and reads back only the sampled ids. Inside the graph nothing is
allocated that the next replay does not reuse, and nothing syncs with the host.
"""
from __future__ import annotations

import gc

import torch

from .models.blocks import Step

_INT_FIELDS = ("ids", "positions", "slot_mapping", "state_slots", "top_k", "seed", "counter")
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
        self.host_ints = torch.zeros_like(self.ints, device="cpu").pin_memory()
        self.host_floats = torch.zeros_like(self.floats, device="cpu").pin_memory()
        self.f = {n: self.ints[i * stride:i * stride + b] for i, n in enumerate(_INT_FIELDS)}
        self.f |= {n: self.floats[i * stride:i * stride + b] for i, n in enumerate(_FLOAT_FIELDS)}
        self.block_table = self.ints[len(_INT_FIELDS) * stride:].view(b, self.width)
        self.token_seq = torch.arange(b, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(b, dtype=torch.int32, device=dev)
        self.out = torch.empty(b, dtype=torch.int32, device=dev)
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
        logits = e.model.forward(e.be, f["ids"], step, self.rows)
        e.be.run("sample", logits=logits, counts=e._counts.index_select(0, f["state_slots"]),
                 temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"], min_p=f["min_p"],
                 presence=f["presence"], frequency=f["frequency"], seed=f["seed"], counter=f["counter"],
                 ids=self.out, domain=e.domain)

    def run(self, seqs) -> list[int]:
        b, w, ps = self.b, self.width, self.engine.cache.page_size
        hi, hf = self.host_ints, self.host_floats
        cols = {n: [] for n in (*_INT_FIELDS, *_FLOAT_FIELDS)}
        for s in seqs:
            p = len(s.tokens) - 1
            sp = s.sampling
            cols["ids"].append(s.tokens[-1])
            cols["positions"].append(p)
            cols["slot_mapping"].append(s.pages[p // ps] * ps + p % ps)
            cols["state_slots"].append(s.slot)
            cols["top_k"].append(sp.top_k)
            cols["seed"].append(((s.seed & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000)
            cols["counter"].append(len(s.generated))
            cols["temperature"].append(sp.temperature)
            cols["top_p"].append(sp.top_p)
            cols["min_p"].append(sp.min_p)
            cols["presence"].append(sp.presence_penalty)
            cols["frequency"].append(sp.frequency_penalty)
        st = self.stride
        for i, n in enumerate(_INT_FIELDS):
            hi[i * st:i * st + b] = torch.tensor(cols[n], dtype=torch.int32)
        table = torch.zeros(b, w, dtype=torch.int32)
        for r, s in enumerate(seqs):
            table[r, :len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
        hi[len(_INT_FIELDS) * st:] = table.view(-1)
        for i, n in enumerate(_FLOAT_FIELDS):
            hf[i * st:i * st + b] = torch.tensor(cols[n], dtype=torch.float32)
        self.ints.copy_(hi, non_blocking=True)
        self.floats.copy_(hf, non_blocking=True)
        self.graph.replay()
        return self.out.tolist()  # the step's one host sync: the sampled ids


class DecodeGraphs:
    """A captured decode step for every batch size 1..max_seqs."""

    def __init__(self, engine):
        self.graphs = {b: _Graph(engine, b) for b in range(1, engine.cache.max_seqs + 1)}

    def run(self, seqs) -> list[int]:
        return self.graphs[len(seqs)].run(seqs)
