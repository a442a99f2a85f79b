"""OpenAI Chat Completions through the official `openai` SDK against the live server (real engine)."""
import json

import openai
import pytest

MODEL = "ninfer-demo"
USER = [{"role": "user", "content": "Say hello."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def test_non_stream(server):
    c = server.openai()
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.role == "assistant"
    assert isinstance(ch.message.content, str)
    assert r.usage.prompt_tokens == server.render_tokens(USER)
    assert 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    t = r.model_extra["timings"]   # llama.cpp-compatible block
    assert t["cache_n"] == r.usage.prompt_tokens_details.cached_tokens
    assert t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens and t["predicted_n"] == r.usage.completion_tokens
    assert t["ttft_ms"] > 0
    # greedy decoding is deterministic: the same request gives the same answer; the prefix cache kept the prompt's
    # last logits, so no prefill chunk runs for it
    server.wait_idle()
    from tests.server.test_ops import metrics
    chunks = metrics(server)[("ninfer_prefill_chunks_total", ())]
    r2 = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    assert r2.choices[0].message.content == ch.message.content
    assert r2.usage.prompt_tokens_details.cached_tokens == r2.usage.prompt_tokens
    assert metrics(server)[("ninfer_prefill_chunks_total", ())] == chunks
    server.wait_idle()


def test_stream_with_usage(server):
    c = server.openai()
    chunks = list(c.chat.completions.create(model=MODEL, messages=USER, max_tokens=7, temperature=0.7, seed=7,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert "timings" in finals[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # the same seed without streaming gives the same text
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=7, temperature=0.7, seed=7)
    assert r.choices[0].message.content == text
    server.wait_idle()


def test_stop_string_ends_generation(server):
    c = server.openai()
    off = {"enable_thinking": False}
    free = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0.8, seed=3,
                                     extra_body=off)
    text = free.choices[0].message.content
    assert len(text) >= 6, "the demo model should write something with this seed"
    stop = text[3:6]
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0.8, seed=3, stop=[stop],
                                  extra_body=off)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[:text.index(stop)]
    assert r.usage.completion_tokens <= free.usage.completion_tokens
    server.wait_idle()


def test_thinking_off_and_effort(server):
    c = server.openai()
    for extra in ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
        r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0, extra_body=extra)
        assert r.usage.prompt_tokens == server.render_tokens(USER, thinking=False)
    r = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0, reasoning_effort="none")
    assert r.usage.prompt_tokens == server.render_tokens(USER, thinking=False)
    assert server.render_tokens(USER, thinking=False) != server.render_tokens(USER)


def test_named_tool_choice_makes_a_call_on_the_real_engine(server):
    """tool_choice forces the call's opening into the prompt: the random model then fills it in, and
    the server returns a call to the named function (its arguments are whatever the model wrote)."""
    c = server.openai()
    r = c.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=5, temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert isinstance(json.loads(calls[0].function.arguments), dict)
    stream = c.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=5, temperature=0,
                                       tool_choice="required", stream=True)
    deltas = [tc for ch in stream if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name and deltas[0].id
    args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    assert isinstance(json.loads(args), dict)
    server.wait_idle()


def test_tool_loop_history_is_rendered_and_answered(server):
    """Turn 2 of a tool loop: the client sends back the assistant's call and the tool's result."""
    c = server.openai()
    msgs = [{"role": "system", "content": "You are terse."}, *USER,
            {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=4, temperature=0)
    canon = [msgs[0], msgs[1],
             {"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
             msgs[3]]
    assert r.usage.prompt_tokens == server.render_tokens(canon, [WEATHER])
    prompt = server.state.text.render(canon, [WEATHER])
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt
    assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in prompt
    assert "Need the weather." in prompt            # reasoning of the current tool loop is kept
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    server.wait_idle()


def test_scripted_tool_calls_stream_and_json(server, scripted):
    """The test hook scripts the text (the engine still generates): reasoning, then two calls."""
    script = ("<think>\nThe user wants weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
              "<parameter=city>\nSan José\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
              "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
              "</tool_call>")
    c = server.openai()
    scripted.append(script)
    r = c.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=10, temperature=0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    assert m.model_extra["reasoning_content"] == "The user wants weather."
    assert m.content == "Checking."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("get_weather", {"city": "San José", "days": 3}), ("get_weather", {"city": "Oslo"})]
    scripted.append(script)
    chunks = list(c.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=10,
                                            temperature=0, stream=True))
    reasoning = "".join(ch.choices[0].delta.model_extra.get("reasoning_content") or "" for ch in chunks if ch.choices)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls: dict = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            e = calls.setdefault(tc.index, {"name": None, "args": ""})
            e["name"] = tc.function.name or e["name"]
            e["args"] += tc.function.arguments or ""
    assert reasoning == "The user wants weather." and content == "Checking."
    assert [(e["name"], json.loads(e["args"])) for _, e in sorted(calls.items())] == [
        ("get_weather", {"city": "San José", "days": 3}), ("get_weather", {"city": "Oslo"})]
    server.wait_idle()


def test_errors_are_typed(server):
    c = server.openai()
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-9", messages=USER, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x " * 1500}], max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=USER, n=2)
    server.wait_idle()


def test_the_next_turn_prefills_only_what_the_last_prompt_lacks(server):
    """Prefix caching: turn 2's prompt extends turn 1's, so turn 1's lane is taken over and only the rest is run
    (usage.prompt_tokens_details.cached_tokens, llama.cpp's cache_n, and the /metrics counters say how much)."""
    from tests.server.test_ops import metrics
    c = server.openai()
    turn1 = [{"role": "system", "content": "Prefix-cache test: answer in one line."},
             {"role": "user", "content": "Name three colours."}]
    r1 = c.chat.completions.create(model=MODEL, messages=turn1, max_tokens=4, temperature=0)
    server.wait_idle()
    before = metrics(server)
    turn2 = turn1 + [{"role": "assistant", "content": "Red, green, blue."},
                     {"role": "user", "content": "And three more?"}]
    r2 = c.chat.completions.create(model=MODEL, messages=turn2, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens == server.render_tokens(turn2)
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens
    t = r2.model_extra["timings"]
    assert t["cache_n"] == r1.usage.prompt_tokens and t["prompt_n"] == r2.usage.prompt_tokens - t["cache_n"]
    server.wait_idle()
    after = metrics(server)
    grew = lambda n: after[(n, ())] - before[(n, ())]  # noqa: E731
    assert grew("ninfer_prefix_cache_hits_total") == r1.usage.prompt_tokens
    assert grew("ninfer_prefix_cache_queries_total") == r2.usage.prompt_tokens
    assert grew("llamacpp:prompt_tokens_total") == r2.usage.prompt_tokens - r1.usage.prompt_tokens
    assert after[("ninfer_lanes_retained", ())] >= 1 and after[("ninfer_kv_pages_retained", ())] >= 1
    # the same conversation again: turn 2's own lane cannot serve it (no token would be left to run), turn 1's
    # was taken over; what comes back must be the answer a full prefill gives
    r3 = c.chat.completions.create(model=MODEL, messages=turn2, max_tokens=4, temperature=0)
    assert r3.choices[0].message.content == r2.choices[0].message.content
    server.wait_idle()


def test_a_new_conversation_repeating_a_long_system_prompt_starts_from_its_snapshot(server):
    """Prefix snapshots: the first turn (system prompt, 256 tokens or more) of a prompt is kept, so another
    conversation that repeats it prefills only its own turns."""
    c = server.openai()
    system = {"role": "system", "content": "Snapshot test. " + " ".join(f"Rule {i}: answer exactly." for i in range(60))}
    ask = lambda text: c.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[system, {"role": "user", "content": text}], max_tokens=3, temperature=0)
    first_turn = server.state.text.first_turn_end(server.state.text.encode(
        server.state.text.render([system, {"role": "user", "content": "?"}])))
    assert first_turn >= 256
    r1 = ask("What is rule 3?")
    r2 = ask("And what does rule 40 say?")
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens == first_turn
    from tests.server.test_ops import metrics
    assert metrics(server)[("ninfer_prefix_snapshots", ())] >= 1
    assert r2.usage.prompt_tokens == server.render_tokens([system, {"role": "user", "content": "And what does rule 40 say?"}])
    server.wait_idle()
