"""Eight streaming clients at once over the three protocols, three of them hanging up mid-stream:
every surviving stream is complete, the requests really ran together, and nothing leaks."""
import threading
import time

import pytest

M = "ninfer-demo"
N_TOKENS = 20


def chat(server, quit_after):
    c = server.openai()
    s = c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Tell a story."}],
                                  max_tokens=N_TOKENS, temperature=0.7, seed=quit_after + 1, stream=True,
                                  stream_options={"include_usage": True})
    chunks = []
    for ch in s:
        chunks.append(ch)
        if quit_after and len(chunks) >= quit_after:
            s.close()
            return {"quit": True}
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    return {"complete": len(finals) == 1 and chunks[-1].usage is not None,
            "tokens": chunks[-1].usage.completion_tokens if chunks[-1].usage else 0}


def anthropic_(server, quit_after):
    c = server.anthropic()
    n = 0
    with c.messages.stream(model="m", max_tokens=N_TOKENS, messages=[{"role": "user", "content": "Tell a story."}],
                           thinking={"type": "disabled"}, extra_body={"temperature": 0.7, "seed": 2}) as s:
        kinds = []
        for ev in s:
            kinds.append(ev.type)
            n += 1
            if quit_after and n >= quit_after:
                return {"quit": True}
        final = s.get_final_message()
    return {"complete": kinds[0] == "message_start" and kinds[-1] == "message_stop",
            "tokens": final.usage.output_tokens}


def responses(server, quit_after):
    c = server.openai()
    s = c.responses.create(model=M, input="Tell a story.", max_output_tokens=N_TOKENS, temperature=0.7, stream=True,
                           store=False, extra_body={"seed": 3})
    events = []
    for ev in s:
        events.append(ev)
        if quit_after and len(events) >= quit_after:
            s.close()
            return {"quit": True}
    last = events[-1]
    return {"complete": last.type in ("response.completed", "response.incomplete"),
            "tokens": last.response.usage.output_tokens}


def test_eight_streams_some_disconnecting(server):
    server.wait_idle()
    cancelled0 = server.state.scheduler.stats["cancelled"]
    plan = [(chat, 0), (chat, 0), (chat, 4), (anthropic_, 0), (anthropic_, 6), (responses, 0), (responses, 5),
            (anthropic_, 0)]
    results: list = [None] * len(plan)
    busy_seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            lanes, _ = server.slots()
            busy_seen.append(sum(s["is_processing"] for s in lanes))
            time.sleep(0.02)

    def run(i, fn, quit_after):
        try:
            results[i] = fn(server, quit_after)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = {"error": repr(e)}

    w = threading.Thread(target=watch)
    w.start()
    threads = [threading.Thread(target=run, args=(i, fn, q)) for i, (fn, q) in enumerate(plan)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    w.join()
    errors = [r for r in results if r is None or "error" in r]
    assert not errors, errors
    survivors = [r for r in results if not r.get("quit")]
    assert len(survivors) == 5 and all(r["complete"] for r in survivors), results
    assert all(1 <= r["tokens"] <= N_TOKENS for r in survivors)
    assert max(busy_seen) >= 4, f"the streams should decode together (max busy lanes seen: {max(busy_seen)})"
    server.wait_idle()
    assert server.state.scheduler.stats["cancelled"] - cancelled0 == 3


def test_non_stream_client_timeout_frees_the_lane(server):
    """A client that gives up on a non-streamed request (here: its timeout) frees the lane at once."""
    import openai
    server.wait_idle()
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=0.6)
    with pytest.raises(openai.APITimeoutError):
        c.chat.completions.create(model=M, messages=[{"role": "user", "content": "Go on."}], max_tokens=900,
                                  temperature=0)
    t0 = time.monotonic()
    server.wait_idle(timeout=5)
    assert time.monotonic() - t0 < 3


def test_overload_errors_are_typed_per_protocol(think_server):
    """Both lanes busy: with no waiting room a request gets 429; with waiting room but a short
    --pending-timeout-ms, 503 (OpenAI) or 529 overloaded_error (Anthropic)."""
    import anthropic
    import openai
    sched = think_server.state.scheduler
    oa, an = think_server.openai(), think_server.anthropic()
    long = dict(model=M, messages=[{"role": "user", "content": "Write a long story."}], max_tokens=900,
                temperature=0)
    streams = [oa.chat.completions.create(**long, stream=True) for _ in range(2)]
    first = [next(iter(s)) for s in streams]              # both admitted: the role chunks arrived
    assert all(f.choices[0].delta.role == "assistant" for f in first)
    saved = sched.max_pending, sched.pending_timeout_s
    try:
        sched.max_pending = 0
        with pytest.raises(openai.RateLimitError) as e:
            oa.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert e.value.body["code"] == "queue_full" and e.value.response.headers["Retry-After"]
        with pytest.raises(anthropic.RateLimitError) as e:
            an.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "rate_limit_error"
        sched.max_pending, sched.pending_timeout_s = 4, 0.3
        with pytest.raises(openai.InternalServerError) as e:
            oa.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "queue_timeout"
        with pytest.raises(anthropic.APIStatusError) as e:
            an.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
    finally:
        sched.max_pending, sched.pending_timeout_s = saved
        for s in streams:
            s.close()
    think_server.wait_idle()
