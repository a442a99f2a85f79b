"""Prefix caching (SequenceCache.retain / take_prefix): a prompt that extends a finished one takes over its lane
and prefills only the rest. Checked on the reference backend against an engine without it: the taken-over lane's
GDN states and KV, then the greedy tokens, must be those of a full prefill; and lanes and pages held by retained
prompts must come back whenever they are wanted."""
import pytest
import torch

from ninfer.runtime.engine import Engine

PROMPT = [(7 * i + 3) % 200 + 10 for i in range(21)]   # 21 tokens: the pages of 8 end mid-page


@pytest.fixture(scope="module")
def engines(demo_artifact):
    opts = dict(backend="reference", max_context=96, max_seqs=2, prefill_chunk=8, page_size=8)
    cached, plain = Engine(demo_artifact, prefix_caching=True, **opts), Engine(demo_artifact, **opts)
    yield cached, plain
    cached.close()
    plain.close()


def run(eng, prompt, max_new=5):
    seq = eng.open(prompt, max_new=max_new)
    while not eng.prefill(seq):
        pass
    return seq


def finish(eng, seq):
    while seq.finish_reason is None:
        eng.decode([seq])
    eng.release(seq)
    return seq


def assert_same_state(a: Engine, sa, b: Engine, sb, n: int):
    """GDN conv / recurrent states of the two lanes, and the KV of positions < n, agree."""
    for i, (conv, state) in a.cache.gdn.items():
        conv_b, state_b = b.cache.gdn[i]
        torch.testing.assert_close(conv[sa.slot], conv_b[sb.slot], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[sa.slot], state_b[sb.slot], rtol=1e-5, atol=1e-6)
    ps = a.cache.page_size
    rows = lambda seq: [seq.pages[p // ps] * ps + p % ps for p in range(n)]  # noqa: E731
    for i, (k, v) in a.cache.kv.items():
        kb, vb = b.cache.kv[i]
        for x, y in ((k, kb), (v, vb)):
            torch.testing.assert_close(x.flatten(0, 1)[rows(sa)], y.flatten(0, 1)[rows(sb)], rtol=1e-5, atol=1e-6)


def test_a_prompt_that_extends_a_finished_one_prefills_only_the_rest(engines):
    cached, plain = engines
    first = finish(cached, run(cached, PROMPT))
    assert first.cached == 0 and len(cached.cache.retained) == 1
    assert cached.cache.in_use == (0, 0)   # retained lanes and pages are not counted as used
    # the next turn: the prompt, the answer as the template re-renders it, a new message
    turn = PROMPT + first.generated + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    a, b = run(cached, turn), run(plain, turn)
    assert a.cached == len(PROMPT) and b.cached == 0 and not cached.cache.retained
    assert_same_state(cached, a, plain, b, len(turn))
    assert finish(cached, a).generated == finish(plain, b).generated


def test_the_longest_retained_prefix_wins_and_a_repeated_prompt_does_not_take_its_own_lane(engines):
    cached, _ = engines
    short, long = run(cached, PROMPT[:9]), run(cached, PROMPT[:17])   # both running: neither takes the other's lane
    finish(cached, short)
    finish(cached, long)
    assert sorted(len(r.tokens) for r in cached.cache.retained.values()) == [9, 17]
    again = run(cached, PROMPT[:17])          # its own lane would leave no token to prefill for the logits
    assert again.cached == 9
    finish(cached, again)
    longer = run(cached, PROMPT)
    assert longer.cached == 17
    finish(cached, longer)


def test_retained_lanes_and_pages_come_back_when_wanted(demo_artifact):
    eng = Engine(demo_artifact, backend="reference", max_context=96, max_seqs=2, prefill_chunk=8, page_size=8,
                 kv_capacity=12, prefix_caching=True)
    try:
        cache = eng.cache
        finish(eng, run(eng, [50] * 10, max_new=2))        # 2 pages kept
        finish(eng, run(eng, [60] * 20, max_new=2))        # 3 pages kept
        assert len(cache.retained) == 2 and len(cache.free_slots) == 0
        assert len(cache.free_pages) == 12 - 5 and cache.available_pages == 12
        other = run(eng, [99] * 5, max_new=1)              # no free lane: the oldest retained one is given back
        assert other.cached == 0 and [len(r.tokens) for r in cache.retained.values()] == [20]
        eng.release(other, retain=False)                   # a failed request keeps nothing
        assert [len(r.tokens) for r in cache.retained.values()] == [20]
        big = run(eng, [98] * 80, max_new=0)               # 10 of the 12 pages: the retained pages come back
        assert not cache.retained and len(big.pages) == 10
        eng.release(big)
        assert [len(r.tokens) for r in cache.retained.values()] == [80] and cache.in_use == (0, 0)
        half = eng.open([97] * 30, max_new=1)
        eng.prefill(half, max_tokens=8)                    # released before its prompt was run: nothing kept
        eng.release(half)
        assert len(cache.free_slots) == 1 and [len(r.tokens) for r in cache.retained.values()] == [80]
        assert len(cache.free_pages) == 2 and cache.available_pages == 12
    finally:
        eng.close()


def test_a_request_cancelled_before_its_prompt_ran_keeps_the_prefix_it_took_over(engines):
    cached, plain = engines
    first = finish(cached, run(cached, PROMPT[:13], max_new=2))
    turn = PROMPT[:13] + first.generated + PROMPT[13:]
    seq = cached.open(turn, max_new=3)
    assert seq.cached == 13
    cached.prefill(seq, max_tokens=4)                  # 4 of the remaining tokens run, then the request is cancelled
    cached.release(seq)
    assert [r.tokens for r in cached.cache.retained.values()][-1] == PROMPT[:13]
    again, full = run(cached, turn), run(plain, turn)  # the kept prefix still serves the same turn exactly
    assert again.cached == 13
    assert_same_state(cached, again, plain, full, len(turn))
    finish(cached, again)
    finish(plain, full)
