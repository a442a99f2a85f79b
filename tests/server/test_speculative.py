"""ninfer-serve --speculative-config through the official SDKs: greedy answers identical to the plain server's,
streamed or not, while MTP drafts are rejected (the demo's random MTP layer) and while they are accepted (drafts
injected from an earlier answer to the same prompt: several tokens a step reach the event stream); n-gram drafts that
hold on the demo's repeats; seeded sampling requests; the spec_decode counters in /metrics; bad configurations."""
import pytest

from ninfer.runtime.engine import Engine
from ninfer.runtime.speculative import drafts_from
from tests.server.conftest import LiveServer
from tests.server.test_ops import metrics

MODEL = "ninfer-demo"
CONFIG = '{"method": "mtp", "num_speculative_tokens": 3}'
ASKS = [[{"role": "user", "content": "Say hello."}],
        [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]]


@pytest.fixture(scope="module")
def spec_server(demo_artifact):
    s = LiveServer(demo_artifact, max_concurrency=4, max_context=1024, prefill_chunk=64, max_pending=16,
                   pending_timeout_ms=120_000, speculative_config=CONFIG)
    yield s
    s.stop()


@pytest.fixture
def known(monkeypatch):
    """Records each finished request's tokens by prompt (both servers give the same), and within the test takes the
    drafts from them: a request with a prompt answered before gets drafts that hold up to that answer's end."""
    known = {}
    real_release = Engine.release

    def release(self, seq, retain=True):
        if seq.n_generated:
            known[tuple(seq.prompt)] = list(seq.tokens)
        return real_release(self, seq, retain)
    monkeypatch.setattr(Engine, "release", release)
    with drafts_from(known):
        yield known


def ask(server, messages, stream=False, **kw):
    c = server.openai()
    args = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0, **kw)
    if not stream:
        r = c.chat.completions.create(**args)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    chunks = list(c.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reason = next(ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    return text, reason, chunks[-1].usage.completion_tokens


def tokens(known, server, messages):
    prompt = server.state.text.encode(server.state.text.render(messages, None, True))
    return known[tuple(prompt)][len(prompt):]


def test_greedy_answers_equal_the_plain_servers(server, spec_server, known):
    """With the MTP layer's own drafts (random: rejected), then with drafts from the first answer (accepted: a round
    commits several tokens, streamed as one event), the answers, token for token, are the plain server's."""
    count = lambda name: metrics(spec_server).get((name, ()), 0)   # noqa: E731
    for messages in ASKS:
        want = ask(server, messages)
        plain = tokens(known, server, messages)
        known.clear()   # the first answer on the speculative server: the MTP layer's own drafts
        drafts = count("ninfer_spec_decode_num_draft_tokens_total")
        assert ask(spec_server, messages) == want and tokens(known, spec_server, messages) == plain
        assert count("ninfer_spec_decode_num_draft_tokens_total") > drafts
        steps, accepted = count("ninfer_decode_steps_total"), count("ninfer_spec_decode_num_accepted_tokens_total")
        assert ask(spec_server, messages, stream=True) == want and tokens(known, spec_server, messages) == plain
        assert count("ninfer_spec_decode_num_accepted_tokens_total") - accepted >= len(plain) // 2
        assert count("ninfer_decode_steps_total") - steps <= len(plain) // 2
    spec_server.wait_idle()


def test_ngram_drafts_through_a_live_server(server, demo_artifact):
    """`{"method": "ngram"}` on the demo model, whose greedy answers repeat one token: the drafts hold, so rounds commit
    several tokens (streamed as one event), and the answers are the plain server's."""
    s = LiveServer(demo_artifact, max_concurrency=2, max_context=1024, prefill_chunk=64, max_pending=4,
                   pending_timeout_ms=60_000, speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    try:
        for stream in (False, True):
            assert ask(s, ASKS[1], stream=stream) == ask(server, ASKS[1])
        m = metrics(s)
        drafted = m[("ninfer_spec_decode_num_draft_tokens_total", ())]
        assert m[("ninfer_spec_decode_num_accepted_tokens_total", ())] >= drafted / 2 > 0
        assert m[("ninfer_decode_steps_total", ())] < 40   # two answers of 40 tokens
        s.wait_idle()
    finally:
        s.stop()


def test_sampling_requests_beside_greedy_ones(server, spec_server):
    hot = dict(temperature=0.8, seed=5, max_tokens=24)
    c, p = spec_server.openai(), server.openai()
    got = c.chat.completions.create(model=MODEL, messages=ASKS[0], **hot).choices[0].message.content
    assert got == p.chat.completions.create(model=MODEL, messages=ASKS[0], **hot).choices[0].message.content
    spec_server.wait_idle()


def test_bad_speculative_config_is_refused(demo_artifact):
    import click
    for bad, what in (('{"method": "eagle3"}', "not supported"), ('{"num_speculative_tokens": 12}', "1..8"),
                      ("{method: mtp}", "not JSON")):
        with pytest.raises(click.ClickException, match=what):
            LiveServer(demo_artifact, max_concurrency=1, max_context=256, max_pending=1, pending_timeout_ms=1000,
                       speculative_config=bad)
