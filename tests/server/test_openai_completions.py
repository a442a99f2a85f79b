"""OpenAI's legacy Completions (`/v1/completions`) through the official `openai` SDK against the live server (real
engine), and llama.cpp / vLLM's /tokenize and /detokenize."""
import openai
import pytest

MODEL = "ninfer-demo"
USER = [{"role": "user", "content": "Say hello."}]


def test_a_raw_prompt_is_the_chat_prompt_without_the_template(server):
    """The chat template's own rendering sent as a raw prompt gives the chat answer token for token (greedy; the raw
    text keeps the whitespace chat drops before an answer), and the stream's pieces join to the same text."""
    c = server.openai()
    chat = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = server.state.text.render(USER, thinking=False)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and len(r.choices) == 1
    assert r.choices[0].text.lstrip() == chat.choices[0].message.content   # chat drops the answer's leading space
    assert r.choices[0].finish_reason == chat.choices[0].finish_reason
    assert r.usage.prompt_tokens == chat.usage.prompt_tokens and r.usage.completion_tokens == chat.usage.completion_tokens
    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    server.wait_idle()


def test_token_ids_echo_and_fill_in_the_middle(server):
    c = server.openai()
    text = "def add(a, b):\n    return"
    ids = server.state.text.encode(text)
    by_text = c.completions.create(model=MODEL, prompt=text, max_tokens=5, temperature=0)
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    echoed = c.completions.create(model=MODEL, prompt=text, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == text + by_text.choices[0].text
    fim = c.completions.create(model=MODEL, prompt=text, suffix="\n\nprint(add(1, 2))\n", max_tokens=5, temperature=0)
    want = server.state.text.encode("<|fim_prefix|>" + text + "<|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>")
    assert want.count(server.state.text.tok.token_id("<|fim_middle|>")) == 1   # read as the special token
    as_ids = c.completions.create(model=MODEL, prompt=want, max_tokens=5, temperature=0)
    assert fim.usage.prompt_tokens == len(want) and fim.choices[0].text == as_ids.choices[0].text
    default = c.completions.create(model=MODEL, prompt=text, temperature=0)   # OpenAI's default max_tokens: 16
    assert default.usage.completion_tokens == 16 or default.choices[0].finish_reason == "stop"
    server.wait_idle()


@pytest.mark.parametrize("kwargs,param,code", [
    (dict(prompt=["one", "two"]), "prompt", "batch_not_supported"),
    (dict(prompt=""), "prompt", None),
    (dict(prompt=[1, 2, 10 ** 9]), "prompt", None),
    (dict(prompt="x", n=2), "n", None),
    (dict(prompt="x", logprobs=2), "logprobs", None),
    (dict(prompt=[5, 6], echo=True), "echo", None),
    (dict(prompt=[5, 6], suffix="s"), "suffix", None),
])
def test_bad_completions_are_typed_errors(server, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        server.openai().completions.create(model=MODEL, max_tokens=2, **kwargs)
    err = e.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code


def test_tokenize_and_detokenize(server):
    text = "Hello <|im_start|> world"
    status, tok = server.post_json("/tokenize", {"content": text})          # llama.cpp's field
    assert status == 200 and tok["tokens"] == server.state.text.encode(text) and tok["count"] == len(tok["tokens"])
    assert server.post_json("/tokenize", {"model": MODEL, "prompt": text})[1]["tokens"] == tok["tokens"]   # vLLM's
    status, back = server.post_json("/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and back["content"] == back["prompt"] == text
    status, err = server.post_json("/detokenize", {"tokens": [1, -4]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = server.post_json("/tokenize", {"prompt": 7})
    assert status == 400 and err["error"]["param"] == "prompt"


def test_stop_token_ids_and_ignore_eos(server):
    """vLLM's sampling extensions: `stop_token_ids` end the answer at a chosen id (not printed, finish_reason stop);
    `ignore_eos` takes the model's end-of-turn ids out of the stop set, and user ids stay in it."""
    from ninfer.server.openai_completions import parse
    c = server.openai()
    prompt = "def add(a, b):\n    return"   # the random demo model answers " return return ..." (one id, repeated)
    first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    tok, = server.state.text.encode(first.choices[0].text)
    assert first.choices[0].text.startswith(" ")   # the token " return" whole: chat drops whitespace before an
    # answer, raw completions keep the text exactly (code completion needs it)
    stopped = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                   extra_body={"stop_token_ids": [tok]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""   # the stop id is not printed
    other = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                 extra_body={"stop_token_ids": [tok + 1], "ignore_eos": True})
    assert other.choices[0].finish_reason == "length" and other.usage.completion_tokens == 8
    eos = server.state.text.stop_ids
    gr, _ = parse({"model": MODEL, "prompt": "x", "ignore_eos": True, "stop_token_ids": [7]}, server.state)
    assert gr.stop_ids == {7} and not gr.stop_ids & eos
    assert parse({"model": MODEL, "prompt": "x", "stop_token_ids": [7]}, server.state)[0].stop_ids == eos | {7}
    assert parse({"model": MODEL, "prompt": "x"}, server.state)[0].stop_ids is None
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  extra_body={"stop_token_ids": [-1]})
    assert e.value.body["param"] == "stop_token_ids"
    server.wait_idle()
