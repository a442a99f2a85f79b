"""Engine.decode through the graphs keeps the next step in flight (Engine._decode_graphs): the tokens must be the
ones plain step-by-step decoding gives, through batch changes, sequences finishing at different steps, a release
while a step is in flight, and penalised seeded sampling. The CUDA graphs need a GPU (tests/gpu/test_engine_gpu.py
runs the real ones); here EagerGraphs stands in for DecodeGraphs on the reference backend: each launch runs the
eager step at once, in launch order (the stream's order), a launch ahead feeding each row the previous launch's id
as the graph does on the device."""
import pytest

from ninfer.runtime import engine as engine_mod
from ninfer.runtime.engine import Engine, SamplingParams


class EagerGraph:
    def __init__(self, eng, log):
        self.eng, self.log, self.out, self.done = eng, log, [], {}

    def launch(self, seqs, ahead=False):
        self.log.append(("ahead" if ahead else "launch", len(seqs)))
        if ahead:   # the device's view: each row's token in flight is its input, one position further
            for s, t in zip(seqs, self.out):
                s.tokens.append(t)
        try:
            ids = self.eng._pick(self.eng._step(seqs, [(len(s.tokens) - 1, len(s.tokens)) for s in seqs]), seqs)
        finally:
            if ahead:
                for s in seqs:
                    s.tokens.pop()
        self.out = ids
        k = len(self.log)
        self.done[k] = ids
        return k

    def collect(self, k):
        return self.done.pop(k)

    def run(self, seqs):
        return self.collect(self.launch(seqs))


class EagerGraphs:
    def __init__(self, eng):
        self.log = []
        self.graphs = {b: EagerGraph(eng, self.log) for b in range(1, eng.cache.max_seqs + 1)}

    def run(self, seqs):
        return self.graphs[len(seqs)].run(seqs)


PARAMS = [SamplingParams(), SamplingParams(temperature=0.9, presence_penalty=1.2, seed=5),
          SamplingParams(temperature=0.8, top_k=20, frequency_penalty=0.6, seed=6)]
PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34, 35, 36, 37]]


@pytest.fixture(scope="module")
def eng(demo_artifact):
    e = Engine(demo_artifact, backend="reference", max_context=64, max_seqs=3, prefill_chunk=8)
    yield e
    e.close()


def run(eng, graphs, max_new=(4, 9, 13), cancel=None):
    """Open, prefill and decode the three prompts (each its own max_new) as a scheduler would: every call names
    the open sequences in order; `cancel` = (step, index) releases that sequence after that many calls."""
    eng.graphs, eng._ahead = graphs, None
    seqs = [eng.open(p, max_new=n, sampling=sp) for p, n, sp in zip(PROMPTS, max_new, PARAMS)]
    try:
        for s in seqs:
            while not eng.prefill(s):
                pass
        calls = 0
        while live := [s for s in seqs if s.finish_reason is None and s.slot is not None]:
            eng.decode(live)
            calls += 1
            if cancel and calls == cancel[0]:
                eng.release(seqs[cancel[1]])
        return [list(s.generated) for s in seqs]
    finally:
        for s in seqs:
            eng.release(s)
        assert eng.cache.in_use == (0, 0)


@pytest.mark.parametrize("cancel", [None, (3, 1)])
def test_steps_ahead_give_the_tokens_of_plain_decoding(eng, monkeypatch, cancel):
    monkeypatch.setattr(engine_mod, "DECODE_AHEAD", True)
    want = run(eng, None, cancel=cancel)
    graphs = EagerGraphs(eng)
    got = run(eng, graphs, cancel=cancel)
    eng.graphs = None
    assert got == want
    assert [len(g) for g in want][::2] == [4, 13]              # the other lanes ran to their max_new
    kinds = [k for k, _ in graphs.log]
    assert kinds.count("ahead") >= 6, graphs.log               # the steady state fed steps on the device


def test_without_steps_ahead_every_call_is_one_plain_step(eng, monkeypatch):
    monkeypatch.setattr(engine_mod, "DECODE_AHEAD", False)
    want = run(eng, None)
    graphs = EagerGraphs(eng)
    assert run(eng, graphs) == want
    eng.graphs = None
    assert {k for k, _ in graphs.log} == {"launch"}


def test_the_scheduler_streams_the_same_text_with_steps_ahead(eng, monkeypatch):
    """Through the scheduler: requests joining while others decode (their prefill chunks between decode steps),
    one cancelled by its client mid-stream, penalised sampling: the same text as without steps ahead, and every
    lane and page back in the pool."""
    import asyncio

    from ninfer.runtime import scheduler as S
    from ninfer.runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_artifact(eng.art)
    reqs = [("Once upon a time", 14, SamplingParams(temperature=0.9, seed=4, presence_penalty=0.5), None),
            ("The ship sailed", 22, SamplingParams(), None),
            ("A long prompt " * 6, 9, SamplingParams(temperature=0.7, seed=9, frequency_penalty=0.3), None),
            ("Cancel me soon", 30, SamplingParams(temperature=1.0, seed=2), 5)]

    async def drain(h, cancel_after):
        out = []
        async for ev in h:
            if isinstance(ev, S.Text):
                out.append(ev.text)
                if len(out) == cancel_after:
                    h.cancel()
                    break
        return "".join(out)

    async def scenario():
        s = S.Scheduler(eng, prefill_chunk_decoding=4)
        try:
            def go(r):
                h = s.submit(S.Request(prompt=tok.encode(r[0]), max_new=r[1], sampling=r[2], detokenizer=tok.stream()))
                return asyncio.create_task(drain(h, r[3]))
            tasks = [go(r) for r in reqs[:2]]
            await asyncio.sleep(0.3)   # the others join while these decode
            tasks += [go(r) for r in reqs[2:]]
            return await asyncio.gather(*tasks)
        finally:
            s.close()

    texts, logs = [], []
    for on in (False, True):
        monkeypatch.setattr(engine_mod, "DECODE_AHEAD", on)
        graphs = EagerGraphs(eng)
        eng.graphs, eng._ahead = graphs, None
        texts.append(asyncio.run(scenario()))
        logs.append([k for k, _ in graphs.log])
        eng.graphs = None
        assert eng.cache.in_use == (0, 0)
    assert texts[0] == texts[1] and all(texts[0])
    assert "ahead" not in logs[0] and logs[1].count("ahead") >= 5, logs[1]
