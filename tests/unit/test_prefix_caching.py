"""Prefix caching (SequenceCache.retain / take_prefix): a prompt that extends a finished one (its prompt, or all
the tokens it fed) takes over its lane and prefills only the rest. Checked on the reference backend against an engine without it: the taken-over lane's
GDN states and KV, then the greedy tokens, must be those of a full prefill; and lanes and pages held by retained
prompts must come back whenever they are wanted."""
import pytest
import torch

from ninfer.runtime.engine import GREEDY, Engine, SamplingParams

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


def run_with(eng, prompt, max_new, sampling, stop_ids=()):
    seq = eng.open(prompt, max_new=max_new, sampling=sampling, stop_ids=stop_ids)
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
    # a chat's next turn: the prompt, the answer as the template re-renders it (not the tokens generated), a new
    # message: the prompt's checkpoint serves it
    turn = PROMPT + [60, 61, 62] + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    a, b = run(cached, turn), run(plain, turn)
    assert a.cached == len(PROMPT) and b.cached == 0 and not cached.cache.retained
    assert_same_state(cached, a, plain, b, len(turn))
    assert finish(cached, a).generated == finish(plain, b).generated


def test_a_prompt_that_extends_the_whole_generation_starts_from_the_lanes_own_state(engines):
    """A tool loop's next call: the prompt, every generated token (the last one, never fed, is run again), more."""
    cached, plain = engines
    first = finish(cached, run(cached, PROMPT[:15]))
    turn = PROMPT[:15] + first.generated + [40, 41, 42]
    a, b = run(cached, turn), run(plain, turn)
    assert a.cached == 15 + len(first.generated) - 1
    assert_same_state(cached, a, plain, b, len(turn))
    assert finish(cached, a).generated == finish(plain, b).generated


def test_the_longest_retained_prefix_wins(engines):
    cached, _ = engines
    short, long = run(cached, PROMPT[:9]), run(cached, PROMPT[:17])   # both running: neither takes the other's lane
    finish(cached, short)
    finish(cached, long)
    assert sorted(r.checkpointed for r in cached.cache.retained.values()) == [9, 17]
    longer = run(cached, PROMPT)
    assert longer.cached == 17
    finish(cached, longer)


def test_the_same_prompt_again_runs_nothing_before_its_first_token(engines, monkeypatch):
    """A retry or a regenerated answer: the checkpoint covers the whole prompt and keeps its last token's logits, so
    no token is run; the state, the KV and the answer (greedy, and sampled with the same seed) are a full prefill's.
    The answer's own tokens (the lane's state) cannot serve it: that state is past the prompt."""
    cached, plain = engines
    ran, step = [], cached._step
    for sp in (GREEDY, SamplingParams(temperature=0.8, top_k=20, seed=5)):
        finish(cached, run_with(cached, PROMPT[:19], 4, sp))
        monkeypatch.setattr(cached, "_step", lambda *a, **k: ran.append(a) or step(*a, **k))   # count model runs
        again = run_with(cached, PROMPT[:19], 4, sp)
        monkeypatch.undo()
        full = run_with(plain, PROMPT[:19], 4, sp)
        assert again.cached == 19 and not ran and again.generated == full.generated[:1]
        assert_same_state(cached, again, plain, full, 19)
        assert finish(cached, again).generated == finish(plain, full).generated
        third = run_with(cached, PROMPT[:19], 4, sp)   # the lane it ran in serves it again
        assert third.cached == 19
        assert finish(cached, third).generated == full.generated


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
        assert other.cached == 0 and [r.checkpointed for r in cache.retained.values()] == [20]
        eng.release(other, retain=False)                   # a failed request keeps nothing
        assert [r.checkpointed for r in cache.retained.values()] == [20]
        big = run(eng, [98] * 80, max_new=0)               # 10 of the 12 pages: the retained pages come back
        assert not cache.retained and len(big.pages) == 10
        eng.release(big)
        assert [r.checkpointed for r in cache.retained.values()] == [80] and cache.in_use == (0, 0)
        half = eng.open([97] * 30, max_new=1)
        eng.prefill(half, max_tokens=8)                    # released before its prompt was run: nothing kept
        eng.release(half)
        assert len(cache.free_slots) == 1 and [r.checkpointed for r in cache.retained.values()] == [80]
        assert len(cache.free_pages) == 2 and cache.available_pages == 12
    finally:
        eng.close()


def test_a_request_cancelled_before_its_prompt_ran_keeps_what_its_checkpoint_covers(engines):
    cached, plain = engines
    first = finish(cached, run(cached, PROMPT[:13], max_new=2))
    turn = PROMPT[:13] + first.generated + PROMPT[13:]
    seq = cached.open(turn, max_new=3)
    assert (seq.cached, seq.checkpointed) == (14, 13)  # the lane's own state (prompt + the fed token), its checkpoint
    cached.prefill(seq, max_tokens=4)                  # 4 of the remaining tokens run, then the request is cancelled
    cached.release(seq)
    kept = list(cached.cache.retained.values())[-1]
    assert (kept.tokens, kept.checkpointed, kept.live) == (PROMPT[:13], 13, False)
    again, full = run(cached, turn), run(plain, turn)  # the checkpoint still serves the same turn exactly
    assert again.cached == 13
    assert_same_state(cached, again, plain, full, len(turn))
    finish(cached, again)
    finish(plain, full)


def test_the_lanes_own_state_counts_the_token_a_step_ahead_fed(demo_artifact, monkeypatch):
    """Through the decode graphs' steps ahead (EagerGraphs runs each launch at once, in stream order): a lane
    stopped by a stop token inside a step queued ahead has its last token fed too; one that ran to max_new has not
    (no step goes past max_new). Each next prompt must start from a state equal to a full prefill's."""
    from ninfer.runtime import engine as engine_mod
    from ninfer.runtime.engine import SamplingParams
    from tests.unit.test_decode_ahead import EagerGraphs
    monkeypatch.setattr(engine_mod, "DECODE_AHEAD", True)
    opts = dict(backend="reference", max_context=96, max_seqs=2, prefill_chunk=8, page_size=8)
    cached, plain = Engine(demo_artifact, prefix_caching=True, **opts), Engine(demo_artifact, **opts)
    sampled = SamplingParams(temperature=0.9, seed=5)

    def two_lanes(eng, stop_ids=()):   # the same batch in both engines (sampling of random weights is batch-sensitive)
        eng.graphs = EagerGraphs(eng)
        seqs = [run_with(eng, PROMPT[:11], 12, sampled, stop_ids), run(eng, PROMPT[:19], max_new=7)]
        kept = {}
        while live := [s for s in seqs if s.finish_reason is None]:
            eng.decode(live)
            for s in seqs:
                if s.finish_reason is not None and s.slot is not None:
                    eng.release(s)
                    kept[len(s.prompt)] = next((r for r in eng.cache.retained.values()
                                                if r.checkpointed == len(s.prompt)), None)
        eng.graphs = None
        return seqs, kept
    try:
        probe = two_lanes(plain)[0][0].generated
        stop = next(t for i, t in enumerate(probe) if i >= 3 and t not in probe[:i])   # a token first seen late
        seqs, kept = two_lanes(cached, {stop})
        assert [s.finish_reason for s in seqs] == ["stop", "length"]
        assert {n: len(r.tokens) for n, r in kept.items()} == {11: len(seqs[0].tokens), 19: len(seqs[1].tokens) - 1}
        for s in seqs:
            turn = s.tokens + [40, 41, 42]
            a, b = run(cached, turn), run(plain, turn)
            assert a.cached == len(kept[len(s.prompt)].tokens)
            assert_same_state(cached, a, plain, b, len(turn))
            finish(cached, a)
            finish(plain, b)
    finally:
        cached.close()
        plain.close()


def test_a_new_conversation_starts_from_a_snapshot_of_the_shared_first_turn(demo_artifact):
    """Two conversations share a first turn (a system prompt): the second starts from the snapshot the first left,
    in a lane of its own, with the states and KV of a full prefill; snapshot pages come back when pages are
    wanted."""
    opts = dict(backend="reference", max_context=96, max_seqs=2, prefill_chunk=8, page_size=8, kv_capacity=12)
    cached, plain = Engine(demo_artifact, prefix_caching=True, prefix_snapshots=1, **opts), Engine(demo_artifact, **opts)
    system = [(11 * i + 5) % 300 + 10 for i in range(20)]
    try:
        first = cached.open(system + [1, 2, 3, 4, 5], max_new=3, snapshot_at=len(system))
        chunks = []
        while not cached.prefill(first):
            chunks.append(first.prefilled)
        assert chunks == [8, 16, 20]                   # a chunk ends where the snapshot is taken
        assert [s.tokens for s in cached.cache.snapshots.values()] == [system]
        finish(cached, first)
        second, full = run(cached, system + [6, 7, 8]), run(plain, system + [6, 7, 8])
        assert second.cached == len(system)           # the first conversation's lane holds its own prompt
        assert_same_state(cached, second, plain, full, len(system) + 3)
        assert finish(cached, second).generated == finish(plain, full).generated
        assert cached.cache.in_use == (0, 0) and cached.cache.available_pages == 12
        other = plain.open(system + [1, 2], max_new=1, snapshot_at=len(system))
        assert other.snapshot_at == 0                  # an engine that keeps no snapshots cuts no chunk for one
        plain.release(other)
        big = run(cached, [98] * 90, max_new=0)        # 12 pages: retained lanes, then the snapshot, give theirs
        assert not cached.cache.snapshots and len(big.pages) == 12
        cached.release(big, retain=False)
        assert cached.cache.free_snapshot_slots == [0] and len(cached.cache.free_pages) == 12
    finally:
        cached.close()
        plain.close()


def test_lanes_given_back_wait_in_host_memory_and_come_back(demo_artifact):
    """--cache-ram: with one lane, each new conversation gives the last one's lane back; its image waits in host
    memory (oldest dropped past the budget) and the conversation's next turn, or the same prompt again, brings it
    back into the lane: what the turn then starts from equals a full prefill."""
    opts = dict(backend="reference", max_context=96, max_seqs=1, prefill_chunk=8, page_size=8)
    plain = Engine(demo_artifact, **opts)
    probe = Engine(demo_artifact, prefix_caching=True, **opts)
    try:
        finish(probe, run(probe, PROMPT))
        image = sum(t.numel() * t.element_size() for t in probe.cache.export_lane(0)[0].values())
    finally:
        probe.close()
    eng = Engine(demo_artifact, prefix_caching=True, cache_ram_bytes=2 * image + image // 2, **opts)
    try:
        cache = eng.cache
        a, b, c = PROMPT, [p + 1 for p in PROMPT], [p + 2 for p in PROMPT]
        finish(eng, run(eng, a))
        finish(eng, run(eng, b))                      # a's lane goes to host memory
        assert [h.meta["tokens"][:len(a)] for h in cache.host_lanes] == [a]
        turn = a + [60, 61] + [40, 41, 42]
        got, want = run(eng, turn), run(plain, turn)  # a comes back (b's lane goes to host memory in its place)
        assert got.cached == len(a) and [h.meta["tokens"][:len(b)] for h in cache.host_lanes] == [b]
        assert_same_state(eng, got, plain, want, len(turn))
        assert finish(eng, got).generated == finish(plain, want).generated
        again = run(eng, b)                           # the same prompt: its image kept the logits
        assert again.cached == len(b)
        assert finish(eng, again).generated == finish(plain, run(plain, b)).generated
        finish(eng, run(eng, c))                      # three images past a budget of two: the oldest is dropped
        finish(eng, run(eng, [7] * 9))
        assert sorted(h.meta["tokens"][0] for h in cache.host_lanes) == sorted([b[0], c[0]])
        assert cache.host_bytes <= cache.cache_ram_bytes and cache.in_use == (0, 0)
    finally:
        eng.close()
        plain.close()
