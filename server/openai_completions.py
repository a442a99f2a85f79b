"""`POST /v1/completions` (OpenAI's legacy Completions, as vLLM and llama.cpp serve it), JSON and SSE, and the
llama.cpp / vLLM `POST /tokenize` and `POST /detokenize`.

The prompt is raw text (special tokens are read as such) or an array of token ids, run without the chat template:
code completion, and fill-in-the-middle with `suffix` (Qwen's `<|fim_prefix|>` P `<|fim_suffix|>` S
`<|fim_middle|>`). One prompt and one choice a request; `echo` puts a text prompt (without the FIM tokens) before
the completion.
"""
from __future__ import annotations

from aiohttp import web

from . import validate as v
from .common import check_model, read_json, run
from .errors import ApiError, bad_request
from .generation import Content, Finished, GenRequest, new_id
from .openai_chat import ChatStreamer, envelope, sampling_of, stop_ids_of
from .state import state_of

DEFAULT_MAX_TOKENS = 16   # OpenAI's default for this endpoint


def parse_prompt(body: dict, state):
    """The one prompt: a string, an array of token ids, or an array holding one of those."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad_request("'prompt' must not be empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        vocab = state.text.tok.vocab_size
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"'prompt' holds the token id {bad}; ids are 0..{vocab - 1}", "prompt")
        return p
    if isinstance(p, list) and len(p) > 1:
        raise ApiError(400, "'prompt' holds several prompts; this server takes one a request",
                       code="batch_not_supported", param="prompt")
    raise bad_request("'prompt' must be a non-empty string or array of token ids", "prompt")


def parse(body: dict, state) -> tuple[GenRequest, dict]:
    check_model(state, v.string(body, "model", required=True))
    prompt = parse_prompt(body, state)
    text = prompt if isinstance(prompt, str) else None
    suffix = v.string(body, "suffix")
    if suffix is not None:
        if not isinstance(prompt, str):
            raise bad_request("'suffix' needs a text prompt (fill-in-the-middle)", "suffix")
        prompt = f"<|fim_prefix|>{prompt}<|fim_suffix|>{suffix}<|fim_middle|>"
    for key, ok, what in (("n", lambda x: x in (None, 1), "'n' must be 1: this server returns one choice"),
                          ("best_of", lambda x: x in (None, 1), "'best_of' must be 1"),
                          ("logprobs", lambda x: x is None, "'logprobs' is not supported by this server"),
                          ("logit_bias", lambda x: not x, "'logit_bias' is not supported by this server")):
        if not ok(body.get(key)):
            raise bad_request(what, key)
    echo = v.boolean(body, "echo", default=False)
    if echo and text is None:
        raise bad_request("'echo' needs a text prompt", "echo")
    max_tokens = v.integer(body, "max_tokens", lo=1, hi=1 << 30)
    so = v.obj(body, "stream_options") or {}
    gr = GenRequest(protocol="completions", messages=[], thinking=False,
                    max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                    sampling=sampling_of(state, body), stop=v.stop_list(body.get("stop"), "stop"),
                    request_id=new_id("cmpl-"), raw_prompt=prompt, stop_ids=stop_ids_of(state, body))
    return gr, {"stream": v.boolean(body, "stream", default=False), "echo": text if echo else "",
                "include_usage": bool(v.boolean(so, "include_usage", where="stream_options."))}


class CompletionStreamer(ChatStreamer):
    """Chat's stream (its final chunk with timings, the usage chunk, [DONE], in-band errors) in text_completion
    chunks: a delta's content is the choice's text."""

    def chunk(self, delta: dict, finish=None, **extra) -> dict:
        return {"id": self.gen.req.request_id, "object": "text_completion", "created": self.created,
                "model": self.state.model_id, "system_fingerprint": None,
                "choices": [{"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish}],
                **extra}

    async def start(self) -> None:
        if self.opts["echo"]:
            await self.w.send(self.chunk({"content": self.opts["echo"]}))

    async def event(self, ev) -> None:
        if isinstance(ev, Content):
            await self.w.send(self.chunk({"content": ev.text}))


def to_json(state, gen, fin: Finished, echo: str) -> dict:
    return envelope(state, gen, fin, "text_completion", {"text": echo + fin.content})


async def handle(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request)
    gr, opts = parse(body, state)
    return await run(request, state, gr, stream=opts["stream"],
                     make_streamer=lambda w, g: CompletionStreamer(w, g, opts, state),
                     to_json=lambda g, f: to_json(state, g, f, opts["echo"]))


async def tokenize(request: web.Request) -> web.Response:
    """llama.cpp's {"content": TEXT} or vLLM's {"prompt": TEXT} -> {"tokens": [...], "count", "max_model_len"}."""
    state = state_of(request)
    body = await read_json(request)
    key = "content" if "content" in body else "prompt"
    text = v.string(body, key, required=True)
    ids = state.text.encode(text)
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": state.max_context})


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [...]} -> {"content": TEXT} (llama.cpp) and {"prompt": TEXT} (vLLM)."""
    state = state_of(request)
    body = await read_json(request)
    ids = body.get("tokens")
    vocab = state.text.tok.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                            for t in ids):
        raise bad_request(f"'tokens' must be an array of token ids 0..{vocab - 1}", "tokens")
    text = state.text.tok.decode(ids)
    return web.json_response({"content": text, "prompt": text})
