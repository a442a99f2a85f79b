"""The host side of a graph-replayed decode step (runtime/decode_graph.HostStep) writes what a plain rebuild of
every field and of the whole page table would, step after step, as sequences grow pages and the batch changes,
for plain steps and for steps ahead (fed on the device by the step in flight: one position further)."""
import random
from types import SimpleNamespace

import numpy as np
import torch

from ninfer.runtime.decode_graph import _FLOAT_FIELDS, _INT_FIELDS, HostStep

PS, WIDTH = 4, 12


def rebuilt(seqs, b, stride, ahead=False):
    """Every field and the whole table written from scratch (what a step must copy to the device)."""
    ints = np.zeros(len(_INT_FIELDS) * stride + b * WIDTH, np.int32)
    floats = np.zeros(len(_FLOAT_FIELDS) * stride, np.float32)
    for r, s in enumerate(seqs):
        p = len(s.tokens) - 1 + ahead   # ahead: the token in flight sits at len(tokens), the host has not seen it
        sp = s.sampling
        vals = {"ids": s.tokens[-1], "positions": p, "slot_mapping": s.pages[p // PS] * PS + p % PS,
                "state_slots": s.slot, "top_k": sp.top_k, "seed": ((s.seed & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000,
                "counter": len(s.generated) + ahead, "from_device": int(ahead)}
        for i, n in enumerate(_INT_FIELDS):
            ints[i * stride + r] = vals[n]
        fvals = {"temperature": sp.temperature, "top_p": sp.top_p, "min_p": sp.min_p,
                 "presence": sp.presence_penalty, "frequency": sp.frequency_penalty}
        for i, n in enumerate(_FLOAT_FIELDS):
            floats[i * stride + r] = fvals[n]
        ints[len(_INT_FIELDS) * stride + r * WIDTH:len(_INT_FIELDS) * stride + r * WIDTH + len(s.pages)] = s.pages
    return ints, floats


class Seq(SimpleNamespace):
    @property
    def n_generated(self):   # as engine.Sequence's, without its prompt: every token counted here is generated
        return len(self.generated)


def new_seq(rng, slot):
    n = rng.randrange(1, 9)
    return Seq(tokens=[rng.randrange(1000) for _ in range(n)], pages=[rng.randrange(100) for _ in range(-(-(n + 1) // PS))],
                           slot=slot, seed=rng.randrange(1 << 40), generated=[],
                           sampling=SimpleNamespace(top_k=rng.randrange(50), temperature=rng.random(), top_p=rng.random(),
                                                    min_p=rng.random(), presence_penalty=rng.random(),
                                                    frequency_penalty=rng.random()))


def test_each_step_writes_what_a_full_rebuild_writes():
    rng = random.Random(0)
    for b in (1, 3, 8):
        stride = -(-b // 4) * 4
        ints = torch.zeros(len(_INT_FIELDS) * stride + b * WIDTH, dtype=torch.int32)
        floats = torch.zeros(len(_FLOAT_FIELDS) * stride, dtype=torch.float32)
        host = HostStep(ints, floats, b, stride, WIDTH, PS)
        seqs = [new_seq(rng, i) for i in range(b)]
        for step in range(40):
            for s in seqs:                       # one more token; a new page when the last one is full
                s.tokens.append(rng.randrange(1000))
                s.generated.append(s.tokens[-1])
                if len(s.tokens) + 1 > PS * len(s.pages):   # room for a step ahead too
                    s.pages.append(rng.randrange(100))
            if step % 7 == 3:                    # a sequence ends, another takes its row; rows swap
                seqs[rng.randrange(b)] = new_seq(rng, rng.randrange(8))
                rng.shuffle(seqs)
            ahead = step % 3 == 1
            host.fill(seqs, ahead)
            want_i, want_f = rebuilt(seqs, b, stride, ahead)
            assert np.array_equal(ints.numpy(), want_i), (b, step)
            assert np.array_equal(floats.numpy(), want_f), (b, step)
