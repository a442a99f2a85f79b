"""The incremental Qwen XML tool-call parser: whole-text results, and the same results whatever way the
text is cut into stream pieces (every fragment sequence must concatenate to the call's JSON)."""
import json
import random

import pytest

from ninfer.server.tool_calls import CallArgs, CallEnd, CallStart, TextPart, ToolCallParser, convert_value, parse_all

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "opts": {"type": "object"}, "metric": {"type": "boolean"}}},
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
}


def call(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def run(text, tolerant=False, seed=None):
    p = ToolCallParser(TOOLS, tolerant)
    events = []
    if seed is None:
        events += p.feed(text)
    else:
        rnd, i = random.Random(seed), 0
        while i < len(text):
            n = rnd.randint(1, 6)
            events += p.feed(text[i:i + n])
            i += n
    events += p.finish()
    args, starts = {}, []
    for e in events:
        if isinstance(e, CallStart):
            starts.append(e.name)
        elif isinstance(e, CallArgs):
            args[e.index] = args.get(e.index, "") + e.delta
        elif isinstance(e, CallEnd):
            assert json.loads(args[e.call.index]) == e.call.arguments
            assert args[e.call.index] == e.call.arguments_json
    assert starts == [c.name for c in p.calls]
    text_out = "".join(e.text for e in events if isinstance(e, TextPart))
    return text_out, [(c.name, c.arguments) for c in p.calls]


CASES = [
    # (text, tolerant, expected text, expected calls)
    ("Plain answer, no calls.", False, "Plain answer, no calls.", []),
    ("Let me look.\n\n" + call("get_weather", city="Paris", days="3"), False, "Let me look.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    (call("get_weather", city="Oslo") + "\n" + call("get_weather", city="Rome", metric="true",
                                                     opts='{"units": ["C"]}'), False, "",
     [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome", "metric": True, "opts": {"units": ["C"]}})]),
    # a value that contains the closing marker and XML survives (the close must be followed by a tag)
    (call("write_file", path="a.xml", content="<a></parameter>b</a>\n\nx"), False, "",
     [("write_file", {"path": "a.xml", "content": "<a></parameter>b</a>\n\nx"})]),
    ("<tool_call>\n<function=ping>\n</function>\n</tool_call>", False, "", [("ping", {})]),
    ("a <tool_call> that is not a call", False, "a <tool_call> that is not a call", []),
    ("x < y and <tool_ca", False, "x < y and <tool_ca", []),
    # the stream ends inside a value (max_tokens): the call is closed with what arrived
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nBer", False, "", [("get_weather", {"city": "Ber"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n\n</parameter>\n</function>\n</tool_call>", False, "",
     [("get_weather", {"city": ""})]),
    # unknown parameters and unknown types are strings; a non-string type that does not parse stays raw
    ("<tool_call>\n<function=other>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>", False, "",
     [("other", {"n": "5"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>", False,
     "", [("get_weather", {"days": "three"})]),
    # malformed wrappers: strict keeps them as text (or as far as the form goes), tolerant recovers the call
    ("<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>", False,
     "<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>", []),
    ("<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>", True, "",
     [("get_weather", {"city": "Lima"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</function>\n</tool_call>", True, "",
     [("get_weather", {"city": "Lima"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</tool_call>Done.", True, "Done.",
     [("get_weather", {"city": "Lima"})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kyiv"}}\n</tool_call>', False,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kyiv"}}\n</tool_call>', []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kyiv"}}\n</tool_call>', True, "",
     [("get_weather", {"city": "Kyiv"})]),
    ("<tool_call>\n<function=get_weather>\nstray words\n<parameter=city>\nLima\n</parameter>\n</function>\n"
     "</tool_call>", True, "", [("get_weather", {"city": "Lima"})]),
]


@pytest.mark.parametrize("text,tolerant,want_text,want_calls", CASES)
def test_whole_and_streamed_agree(text, tolerant, want_text, want_calls):
    assert run(text, tolerant) == (want_text, want_calls)
    for seed in range(25):
        assert run(text, tolerant, seed) == (want_text, want_calls), f"cut with seed {seed}"


def test_string_values_stream_before_the_parameter_closes():
    p = ToolCallParser(TOOLS)
    p.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nhello wor")
    sent = "".join(e.delta for e in p.feed("ld, more text") if isinstance(e, CallArgs))
    assert "ld, more" in sent  # streamed as it comes, only the possible close is held back


def test_parse_all_and_value_conversion():
    assert parse_all(call("get_weather", city="Nice"), TOOLS) == ("", parse_all(call("get_weather", city="Nice"),
                                                                                TOOLS)[1])
    assert convert_value("42", {"integer"}) == 42
    assert convert_value(" [1, 2] ", {"array"}) == [1, 2]
    assert convert_value("True", {"boolean"}) is True
    assert convert_value("x y", {"integer"}) == "x y"
    assert convert_value(" keep  ", {"string"}) == " keep  "
