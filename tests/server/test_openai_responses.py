"""OpenAI Responses through the official `openai` SDK: create, stream, store, retrieve, delete,
previous_response_id, item_reference, a function-call loop; real engine."""
import json

import openai
import pytest

MODEL = "ninfer-demo"
TOOL = {"type": "function", "name": "lookup", "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


def test_create_retrieve_continue_delete(server):
    c = server.openai()
    r1 = c.responses.create(model=MODEL, input="Name a colour.", instructions="Be brief.", max_output_tokens=5,
                            temperature=0)
    assert r1.object == "response" and r1.status in ("completed", "incomplete") and r1.store
    assert r1.output and r1.output[-1].type == "message"
    first_text = r1.output_text
    msgs1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert r1.usage.input_tokens == server.render_tokens(msgs1)
    got = c.responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == first_text
    items = c.responses.input_items.list(r1.id)
    assert [i.type for i in items.data] == ["message"]

    # previous_response_id continues the conversation; instructions are not carried over
    r2 = c.responses.create(model=MODEL, previous_response_id=r1.id, input="And another?", max_output_tokens=4,
                            temperature=0)
    assert r2.previous_response_id == r1.id
    msgs2 = [msgs1[1], {"role": "assistant", "content": first_text}, {"role": "user", "content": "And another?"}]
    assert r2.usage.input_tokens == server.render_tokens(msgs2)
    # the same history sent by hand renders to the same prompt
    r3 = c.responses.create(model=MODEL, input=[{"role": "user", "content": "Name a colour."},
                                                {"role": "assistant", "content": first_text},
                                                {"role": "user", "content": "And another?"}],
                            max_output_tokens=4, temperature=0, store=False)
    assert r3.usage.input_tokens == r2.usage.input_tokens and r3.output_text == r2.output_text
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r3.id)                       # store=False: not kept

    # item_reference resolves stored items
    ref = c.responses.create(model=MODEL, input=[{"type": "item_reference", "id": r1.output[-1].id},
                                                 {"role": "user", "content": "More?"}],
                             max_output_tokens=2, temperature=0, store=False)
    assert ref.usage.input_tokens == server.render_tokens(
        [{"role": "assistant", "content": first_text}, {"role": "user", "content": "More?"}])

    deleted = c.responses.delete(r1.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=MODEL, previous_response_id=r1.id, input="x", max_output_tokens=2)
    assert e.value.body["code"] == "previous_response_not_found"
    server.wait_idle()


def final_kind(resp):
    return "response.completed" if resp.status == "completed" else "response.incomplete"


def test_stream_semantic_events(server):
    c = server.openai()
    events = list(c.responses.create(model=MODEL, input="Count.", max_output_tokens=6, temperature=0.7,
                                     extra_body={"seed": 5},
                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and final.usage.output_tokens >= 1
    # the SDK's stream helper accepts the same events (it checks their order and item identities);
    # an answer cut by max_output_tokens ends with response.incomplete, as OpenAI's does
    with c.responses.stream(model=MODEL, input="Count.", max_output_tokens=6, temperature=0.7,
                            extra_body={"seed": 5}) as s:
        last = [e for e in s][-1]
    assert last.type == final_kind(final) and last.response.output_text == text
    stored = c.responses.retrieve(final.id)
    assert stored.output_text == text
    server.wait_idle()


def test_function_call_loop(server):
    """A forced call on the real engine, then its output sent back: the second turn renders the call and
    its result after the first turn's prompt."""
    c = server.openai()
    r1 = c.responses.create(model=MODEL, input="Define 'cat'.", tools=[TOOL], tool_choice="required",
                            max_output_tokens=4, temperature=0)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert calls and calls[0].name == "lookup" and calls[0].call_id
    args = json.loads(calls[0].arguments)
    r2 = c.responses.create(model=MODEL, previous_response_id=r1.id, tools=[TOOL],
                            input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                    "output": "a small domesticated feline"}],
                            max_output_tokens=3, temperature=0)
    said = next((o.content[0].text for o in r1.output if o.type == "message"), "")
    assistant = {"role": "assistant", "content": said,
                 "tool_calls": [{"id": calls[0].call_id, "type": "function",
                                 "function": {"name": "lookup", "arguments": args}}]}
    want = [{"role": "user", "content": "Define 'cat'."}, assistant,
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "a small domesticated feline"}]
    assert r2.usage.input_tokens == server.render_tokens(want, [CHAT_TOOL])
    assert r2.status in ("completed", "incomplete")
    server.wait_idle()


def test_scripted_reasoning_and_call_stream(server, scripted):
    script = ("<think>\nLook it up.\n</think>\n\n<tool_call>\n<function=lookup>\n<parameter=word>\ncat\n</parameter>\n"
              "</function>\n</tool_call>")
    c = server.openai()
    scripted.append(script)
    with c.responses.stream(model=MODEL, input="Define 'cat'.", tools=[TOOL], max_output_tokens=10,
                            temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == "Look it up."
    assert final.output[1].name == "lookup" and json.loads(final.output[1].arguments) == {"word": "cat"}
    assert final.usage.output_tokens_details.reasoning_tokens >= 1
    scripted.append(script)
    r = c.responses.create(model=MODEL, input="Define 'cat'.", tools=[TOOL], max_output_tokens=10, temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    # the next turn renders the reasoning and the call exactly as the model wrote them
    r2 = c.responses.create(model=MODEL, previous_response_id=r.id, tools=[TOOL], max_output_tokens=2, temperature=0,
                            input=[{"type": "function_call_output", "call_id": r.output[1].call_id,
                                    "output": "feline"}])
    prompt1 = server.state.text.render([{"role": "user", "content": "Define 'cat'."}], [CHAT_TOOL])
    turn = [{"role": "user", "content": "Define 'cat'."},
            {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
             "tool_calls": [{"id": "x", "type": "function",
                             "function": {"name": "lookup", "arguments": {"word": "cat"}}}]},
            {"role": "tool", "tool_call_id": "x", "content": "feline"}]
    prompt2 = server.state.text.render(turn, [CHAT_TOOL])
    assert prompt2.startswith(prompt1 + script)      # prefix stability within a tool loop
    assert r2.usage.input_tokens == len(server.state.text.encode(prompt2))
    server.wait_idle()


def test_unsupported_is_refused(server):
    c = server.openai()
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_image",
                                                                             "image_url": "http://x/y.png"}]}])
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="other", input="x")
