"""The scheduler on the real engine (demo artifact, reference backend): continuous batching with
chunked prefill interleaved with decode steps, FIFO admission with typed overload errors, cancellation
that frees lanes and pages at once, stop strings, refusal of what can never fit."""
import asyncio
import time

import pytest

from ninfer.runtime import scheduler as S
from ninfer.runtime.engine import Engine, SamplingParams
from ninfer.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engine(demo_artifact):
    eng = Engine(demo_artifact, backend="reference", max_context=256, max_seqs=2, prefill_chunk=8)
    yield eng
    eng.close()


class Spy:
    """Records the engine calls the worker makes: ("prefill", seq, tokens run) and ("decode", [seqs])."""

    def __init__(self, eng):
        self.eng, self.calls = eng, []
        self._prefill, self._decode = eng.prefill, eng.decode

    def __enter__(self):
        def prefill(seq, max_tokens=None):
            before = seq.prefilled
            done = self._prefill(seq, max_tokens)
            self.calls.append(("prefill", id(seq), seq.prefilled - before))
            return done

        def decode(seqs):
            self.calls.append(("decode", [id(s) for s in seqs]))
            return self._decode(seqs)
        self.eng.prefill, self.eng.decode = prefill, decode
        return self

    def __exit__(self, *exc):
        del self.eng.prefill, self.eng.decode


def req(n_prompt, max_new, **kw):
    return S.Request(prompt=list(range(1000, 1000 + n_prompt)), max_new=max_new, **kw)


async def drain(h):
    evs = []
    async for ev in h:
        evs.append(ev)
    return evs


def test_long_prefill_interleaves_with_running_decode(engine):
    async def main():
        s = S.Scheduler(engine, max_pending=4)
        try:
            with Spy(engine) as spy:
                a = s.submit(req(5, 40))
                got = 0
                while got < 2:                  # A is decoding
                    ev = await a.events.get()
                    got += isinstance(ev, S.Text)
                b = s.submit(req(100, 3))       # 13 prefill chunks of 8
                ra, rb = await asyncio.gather(drain(a), drain(b))
            return spy.calls, a, b, ra, rb
        finally:
            s.close()
    calls, a, b, ra, rb = asyncio.run(main())
    assert isinstance(ra[-1], S.Done) and isinstance(rb[-1], S.Done)
    assert rb[-1].completion_tokens == 3 and rb[-1].prompt_tokens == 100
    a_seq = a.seq
    b_prefills = [i for i, c in enumerate(calls) if c[:2] == ("prefill", id(b.seq))]
    assert len(b_prefills) == 13
    between = calls[b_prefills[0]:b_prefills[-1]]
    decodes_with_a = [c for c in between if c[0] == "decode" and id(a_seq) in c[1]]
    assert len(decodes_with_a) >= 12, "A must keep decoding between B's prefill chunks"
    # once B is prefilled, both decode in one batch
    assert any(c[0] == "decode" and set(c[1]) == {id(a_seq), id(b.seq)} for c in calls[b_prefills[-1]:])
    assert engine.cache.in_use == (0, 0)


def test_prefill_runs_whole_chunks_alone_and_smaller_ones_beside_decoding(engine):
    """prefill_chunk tokens per step while nothing decodes (fewest steps), prefill_chunk_decoding while a
    request decodes (its next token waits for the chunk)."""
    async def main():
        s = S.Scheduler(engine, max_pending=4, prefill_chunk_decoding=3)
        try:
            with Spy(engine) as spy:
                alone = s.submit(req(20, 2))
                await drain(alone)
                a = s.submit(req(5, 40))
                got = 0
                while got < 2:                  # A is decoding
                    ev = await a.events.get()
                    got += isinstance(ev, S.Text)
                b = s.submit(req(20, 2))
                await asyncio.gather(drain(a), drain(b))
            return spy.calls, alone, b
        finally:
            s.close()
    calls, alone, b = asyncio.run(main())
    steps = lambda h: [c[2] for c in calls if c[:2] == ("prefill", id(h.seq))]  # noqa: E731
    assert steps(alone) == [8, 8, 4]                 # the engine's prefill_chunk (8)
    assert steps(b) == [3] * 6 + [2]                 # beside A's decode steps
    with pytest.raises(ValueError, match="prefill_chunk_decoding must be >= 1"):
        S.Scheduler(engine, prefill_chunk_decoding=0)
    assert engine.cache.in_use == (0, 0)


def test_cancel_frees_the_lane_at_once(engine):
    async def main():
        s = S.Scheduler(engine, max_pending=4)
        try:
            h = s.submit(req(20, 200))
            while not isinstance(await h.events.get(), S.Text):
                pass
            assert engine.cache.in_use[0] == 1
            t0 = time.monotonic()
            h.cancel()
            while engine.cache.in_use != (0, 0):
                await asyncio.sleep(0.005)
            dt = time.monotonic() - t0
            return dt, s.stats["cancelled"]
        finally:
            s.close()
    dt, cancelled = asyncio.run(main())
    assert dt < 1.0 and cancelled == 1


def test_fifo_queue_full_and_timeout(engine):
    async def main():
        s = S.Scheduler(engine, max_pending=1, pending_timeout_ms=400)
        try:
            a = s.submit(req(5, 120))
            b = s.submit(req(5, 120))       # both lanes busy now
            for h in (a, b):
                while not isinstance(await h.events.get(), S.Text):
                    pass
            c = s.submit(req(5, 2))         # waits
            with pytest.raises(S.QueueFull):
                s.submit(req(5, 2))
            evs = await drain(c)             # nothing frees a lane within 400 ms
            a.cancel()
            b.cancel()
            while s.active:
                await asyncio.sleep(0.005)
            d = s.submit(req(5, 2))
            e = s.submit(req(6, 2))
            rd, re_ = await asyncio.gather(drain(d), drain(e))
            return evs, rd, re_, d, e
        finally:
            s.close()
    evs, rd, re_, d, e = asyncio.run(main())
    assert isinstance(evs[-1], S.Failed) and isinstance(evs[-1].error, S.QueueTimeout)
    assert isinstance(rd[-1], S.Done) and isinstance(re_[-1], S.Done)
    assert d.admitted_at <= e.admitted_at      # first in, first admitted
    assert engine.cache.in_use == (0, 0)


def test_never_fitting_requests_are_refused_before_queueing(engine):
    async def main():
        s = S.Scheduler(engine, max_pending=1)
        try:
            with pytest.raises(S.ContextTooLong, match="maximum context is 256"):
                s.submit(req(256, 1))
            with pytest.raises(S.InvalidPrompt):
                s.submit(S.Request(prompt=[], max_new=1))
            with pytest.raises(S.InvalidPrompt, match="outside the vocabulary"):
                s.submit(S.Request(prompt=[1, 10 ** 9], max_new=1))
            assert s.check(250, 100) == 6           # output limited by the context
            assert s.pending == 0
        finally:
            s.close()
    asyncio.run(main())


def test_stop_strings_and_text(engine, demo_artifact):
    tok = Tokenizer.from_artifact(engine.art)
    sp = SamplingParams(temperature=0.9, seed=4)

    async def run(stops):
        s = S.Scheduler(engine)
        try:
            h = s.submit(S.Request(prompt=tok.encode("Once upon a time"), max_new=20, sampling=sp,
                                   stop_strings=tuple(stops), detokenizer=tok.stream()))
            evs = await drain(h)
            return "".join(e.text for e in evs if isinstance(e, S.Text)), evs[-1]
        finally:
            s.close()
    text, done = asyncio.run(run(()))
    assert done.finish_reason == "length" and len(text) > 8
    stop = text[4:8]
    cut, done2 = asyncio.run(run([stop, "\x00never"]))
    assert cut == text[:text.index(stop)] and done2.finish_reason == "stop" and done2.stop_string == stop
    assert engine.cache.in_use == (0, 0)


def test_a_chunk_never_exceeds_the_context(demo_artifact):
    """The engine clamps prefill_chunk to max_context: no step could hold more, and the memory plan reserves
    activations for the chunk."""
    eng = Engine(demo_artifact, backend="reference", max_context=48, max_seqs=1, prefill_chunk=4096)
    try:
        assert eng.prefill_chunk == 48
        seq = eng.open(list(range(3, 43)), max_new=1)
        assert eng.prefill(seq) and seq.prefilled == 40     # the whole prompt in one step
        eng.release(seq)
    finally:
        eng.close()


def test_prefix_caching_under_load_keeps_every_lane_and_page_accounted_for(demo_artifact):
    """Conversations and their next turns from many clients at once through two lanes and a small pool, some
    cancelled mid-stream, with snapshots of a shared first turn: every request ends (done or cancelled), next turns
    take their prompts from the cache where a lane still holds them, and afterwards every lane and page is free
    or held by a retained lane or snapshot, none twice."""
    eng = Engine(demo_artifact, backend="reference", max_context=256, max_seqs=2, prefill_chunk=8, page_size=8,
                 kv_capacity=40, prefix_caching=True, prefix_snapshots=1)
    system = list(range(2000, 2024))

    async def converse(s, k, cancel):
        first = S.Request(prompt=system + [3000 + k] * (5 + k), max_new=4 + k % 3, snapshot_at=len(system))
        evs = await drain(s.submit(first))
        done = evs[-1]
        assert isinstance(done, S.Done)
        nxt = S.Request(prompt=first.prompt + [50 + k, 51, 52], max_new=6)
        h = s.submit(nxt)
        if cancel:
            async for ev in h:
                h.cancel()
                break
            return None
        evs = await drain(h)
        assert isinstance(evs[-1], S.Done)
        return evs[-1].cached_tokens

    async def main():
        s = S.Scheduler(eng, max_pending=16)
        try:
            return await asyncio.gather(*[converse(s, k, cancel=k % 3 == 2) for k in range(6)])
        finally:
            s.close()
    try:
        cached = asyncio.run(main())
        assert any(c and c >= len(system) for c in cached), cached   # some next turns found their prompt kept
        c = eng.cache
        kept = [p for r in (*c.retained.values(), *c.snapshots.values()) for p in r.pages]
        assert c.in_use == (0, 0)
        assert sorted(c.free_pages + kept) == list(range(c.num_pages))
        assert sorted(c.free_slots + list(c.retained)) == list(range(c.max_seqs))
        assert sorted(c.free_snapshot_slots + [x.index for x in c.snapshots.values()]) == [0]
    finally:
        eng.close()
