"""Anthropic Messages through the official `anthropic` SDK: messages with thinking and tools, streaming,
a tool loop, count_tokens, stop sequences, API keys; real engine."""
import json

import anthropic
import pytest

TOOL = {"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}},
                         "required": ["path"]}}
CHAT_TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                              "parameters": TOOL["input_schema"]}}
MSGS = [{"role": "user", "content": "Hello there."}]


def test_thinking_blocks_on_the_real_engine(think_server):
    """The think server's template opens <think>: what the random model writes is reasoning."""
    c = think_server.anthropic()
    sampled = {"temperature": 0.7, "seed": 2}
    m = c.messages.create(model="claude-x", max_tokens=6, messages=MSGS, system="Be kind.",
                          thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=sampled)
    assert m.model == "claude-x" and m.role == "assistant" and m.type == "message"
    assert m.content[0].type == "thinking" and m.content[0].thinking and m.content[0].signature
    assert m.stop_reason in ("max_tokens", "end_turn") and m.usage.output_tokens >= 1
    with c.messages.stream(model="m", max_tokens=6, messages=MSGS, system="Be kind.",
                           thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=sampled) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].type == "thinking" and final.content[0].thinking == m.content[0].thinking
    # thinking off: the empty closed block is in the prompt, the answer is text
    off = c.messages.create(model="m", max_tokens=4, messages=MSGS, thinking={"type": "disabled"},
                            extra_body={"temperature": 0})
    assert all(b.type == "text" for b in off.content)
    assert off.usage.input_tokens + off.usage.cache_read_input_tokens == think_server.render_tokens(MSGS, thinking=False)
    think_server.wait_idle()


def test_forced_tool_use_and_stream(server):
    c = server.anthropic()
    m = c.messages.create(model="m", max_tokens=5, messages=MSGS, tools=[TOOL],
                          tool_choice={"type": "tool", "name": "read_file"}, extra_body={"temperature": 0})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "read_file" and uses[0].id.startswith("toolu_")
    assert isinstance(uses[0].input, dict)
    with c.messages.stream(model="m", max_tokens=5, messages=MSGS, tools=[TOOL], tool_choice={"type": "any"},
                           extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert any(b.type == "tool_use" and b.name == "read_file" for b in final.content)
    server.wait_idle()


def test_tool_loop(server):
    """The client sends back the assistant's tool_use (with its thinking) and the tool_result."""
    c = server.anthropic()
    msgs = [*MSGS,
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I should read it.", "signature": "sig"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.txt", "lines": 3}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "line one"}]}]}]
    m = c.messages.create(model="m", max_tokens=4, messages=msgs, tools=[TOOL], system="sys",
                          thinking={"type": "enabled", "budget_tokens": 2000}, extra_body={"temperature": 0})
    canon = [{"role": "system", "content": "sys"}, *MSGS,
             {"role": "assistant", "content": "Reading.", "reasoning_content": "I should read it.",
              "tool_calls": [{"id": "toolu_1", "type": "function",
                              "function": {"name": "read_file", "arguments": {"path": "a.txt", "lines": 3}}}]},
             {"role": "tool", "tool_call_id": "toolu_1", "content": "line one"}]
    prompt_tokens = m.usage.input_tokens + m.usage.cache_read_input_tokens   # Anthropic counts cache reads apart
    assert prompt_tokens == server.render_tokens(canon, [CHAT_TOOL])
    prompt = server.state.text.render(canon, [CHAT_TOOL])
    assert "<parameter=lines>\n3\n</parameter>" in prompt and "<tool_response>\nline one\n</tool_response>" in prompt
    count = c.messages.count_tokens(model="m", messages=msgs, tools=[TOOL], system="sys",
                                    thinking={"type": "enabled", "budget_tokens": 2000})
    assert count.input_tokens == prompt_tokens
    server.wait_idle()


def test_scripted_thinking_text_and_tools_stream(server, scripted):
    script = ("<think>\nThe user wants a.txt.\n</think>\n\nI will read it.\n\n<tool_call>\n<function=read_file>\n"
              "<parameter=path>\ndir/a b.txt\n</parameter>\n<parameter=lines>\n10\n</parameter>\n</function>\n"
              "</tool_call>")
    c = server.anthropic()
    scripted.append(script)
    with c.messages.stream(model="m", max_tokens=10, messages=MSGS, tools=[TOOL],
                           thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0}) as s:
        events = list(s)
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "The user wants a.txt." and final.content[0].signature
    assert final.content[1].text == "I will read it."
    assert final.content[2].name == "read_file" and final.content[2].input == {"path": "dir/a b.txt", "lines": 10}
    assert final.stop_reason == "tool_use"
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"path": "dir/a b.txt", "lines": 10}
    scripted.append(script)
    m = c.messages.create(model="m", max_tokens=10, messages=MSGS, tools=[TOOL],
                          thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"] and m.stop_reason == "tool_use"
    server.wait_idle()


def test_stop_sequence(server):
    c = server.anthropic()
    free = c.messages.create(model="m", max_tokens=12, messages=MSGS, thinking={"type": "disabled"}, 
                             extra_body={"seed": 11, "temperature": 0.8, "top_k": 50})
    text = "".join(b.text for b in free.content if b.type == "text")
    assert len(text) >= 6
    stop = text[2:5]
    m = c.messages.create(model="m", max_tokens=12, messages=MSGS, stop_sequences=[stop], thinking={"type": "disabled"},
                          extra_body={"seed": 11, "temperature": 0.8, "top_k": 50})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert "".join(b.text for b in m.content if b.type == "text") == text[:text.index(stop)]
    server.wait_idle()


def test_api_key_and_errors(think_server):
    ok = think_server.anthropic()
    assert ok.messages.count_tokens(model="m", messages=MSGS).input_tokens == think_server.render_tokens(MSGS)
    import anthropic as a
    bad = a.Anthropic(base_url=think_server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=2, messages=MSGS)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        ok.messages.create(model="m", max_tokens=2, messages=[{"role": "system", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    status, _, _ = think_server.get("/health")        # no key needed there
    assert status == 200
    status, _, body = think_server.get("/v1/models")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, _, body = think_server.get("/v1/models", {"Authorization": "Bearer sekret-key"})
    assert status == 200 and json.loads(body)["data"][0]["context_window"] == 1024


def test_tolerant_mode_recovers_a_call_the_strict_server_keeps_as_text(server, think_server):
    """--tolerant-tool-calls (the think server) recovers a call written without its <tool_call> wrapper;
    the strict server returns the same text as text."""
    bare = "<function=read_file>\n<parameter=path>\nx.py\n</parameter>\n</function>"
    for s, script, want_call in ((think_server, "Plan.\n</think>\n\n" + bare, True), (server, bare, False)):
        s.state.text_hook = lambda req, text=script: text
        try:
            m = s.anthropic().messages.create(model="m", max_tokens=4, messages=MSGS, tools=[TOOL],
                                              extra_body={"temperature": 0})
        finally:
            s.state.text_hook = None
        uses = [b for b in m.content if b.type == "tool_use"]
        if want_call:
            assert [(u.name, u.input) for u in uses] == [("read_file", {"path": "x.py"})]
            assert m.content[0].type == "thinking" and m.content[0].thinking == "Plan."
        else:
            assert not uses and "".join(b.text for b in m.content if b.type == "text") == bare
        s.wait_idle()


def test_the_next_turn_reads_the_last_prompt_from_the_cache(server):
    """Prefix caching as Anthropic reports it: input_tokens leaves out cache_read_input_tokens."""
    c = server.anthropic()
    turn1 = [{"role": "user", "content": "Prefix-cache test (Anthropic): say one word."}]
    m1 = c.messages.create(model="m", max_tokens=3, messages=turn1, system="Be brief.", extra_body={"temperature": 0})
    assert m1.usage.cache_read_input_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": "Word."}, {"role": "user", "content": "Another?"}]
    m2 = c.messages.create(model="m", max_tokens=3, messages=turn2, system="Be brief.", extra_body={"temperature": 0})
    assert m2.usage.cache_read_input_tokens == m1.usage.input_tokens
    total = c.messages.count_tokens(model="m", messages=turn2, system="Be brief.").input_tokens
    assert m2.usage.input_tokens == total - m1.usage.input_tokens > 0
    server.wait_idle()
