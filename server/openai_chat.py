"""`POST /v1/chat/completions` (OpenAI Chat Completions), JSON and SSE.

Extensions clients of llama.cpp / vLLM / Qwen send: `top_k`, `min_p`, `enable_thinking`,
`chat_template_kwargs.enable_thinking`, `reasoning_effort` ("none"/"minimal" turn thinking off), `stop_token_ids`,
`ignore_eos`.
Reasoning comes back as `reasoning_content`; a llama.cpp-compatible `timings` block rides on the
response and on the final stream chunk.
"""
from __future__ import annotations

import time

from aiohttp import web

from . import validate as v
from .common import Streamer, check_model, read_json, run, timings
from .errors import ApiError, bad_request
from .generation import Content, Finished, GenRequest, Reasoning, ToolArgs, ToolStart, fold_system, new_id
from .state import state_of

ROLES = ("system", "developer", "user", "assistant", "tool")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


# -- request -------------------------------------------------------------------------------------
def content_text(c, where: str, *, allow_none: bool = False) -> str:
    """Message content: a string or an array of text parts."""
    if c is None:
        if allow_none:
            return ""
        raise bad_request(f"'{where}' is required", where)
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad_request(f"'{where}' must be a string or an array of content parts", where)
    out = []
    for j, part in enumerate(c):
        p = v.element(part, f"{where}[{j}]")
        kind = p.get("type")
        if kind in ("text", "input_text", "output_text", "refusal"):
            text = p.get("text", p.get("refusal"))
            if not isinstance(text, str):
                raise bad_request(f"'{where}[{j}].text' must be a string", f"{where}[{j}].text")
            out.append(text)
        elif kind in ("image_url", "input_image", "input_audio", "video_url", "file", "input_file"):
            raise ApiError(400, f"'{where}[{j}]': {kind} content is not supported by this server (text only)",
                           code="modality_not_supported", param=f"{where}[{j}]")
        else:
            raise bad_request(f"'{where}[{j}].type' must be 'text', got {kind!r}", f"{where}[{j}].type")
    return "".join(out)


def parse_messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array of messages", "messages")
    msgs: list[dict] = []
    for i, m in enumerate(raw):
        w = f"messages[{i}]"
        m = v.element(m, w)
        role = m.get("role")
        if role == "function":
            raise bad_request(f"'{w}.role': the legacy 'function' role is not supported; use 'tool'", f"{w}.role")
        if role not in ROLES:
            raise bad_request(f"'{w}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{w}.role")
        if role in ("system", "developer"):
            msgs.append({"role": "system", "content": content_text(m.get("content"), f"{w}.content")})
        elif role == "user":
            msgs.append({"role": "user", "content": content_text(m.get("content"), f"{w}.content")})
        elif role == "tool":
            call_id = v.string(m, "tool_call_id", where=w + ".")
            msgs.append({"role": "tool", "tool_call_id": call_id or "",
                         "content": content_text(m.get("content"), f"{w}.content", allow_none=True)})
        else:
            calls = v.array(m, "tool_calls", where=w + ".") or []
            out_calls = []
            for j, c in enumerate(calls):
                cw = f"{w}.tool_calls[{j}]"
                c = v.element(c, cw)
                f = v.obj(c, "function", required=True, where=cw + ".")
                name = v.tool_name(f.get("name"), f"{cw}.function.name")
                args = f.get("arguments")
                out_calls.append({"id": c.get("id") if isinstance(c.get("id"), str) else new_id("call_"),
                                  "type": "function", "function": {"name": name, "arguments": _args(args, cw)}})
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None and not isinstance(reasoning, str):
                raise bad_request(f"'{w}.reasoning_content' must be a string", f"{w}.reasoning_content")
            msg = {"role": "assistant", "content": content_text(m.get("content"), f"{w}.content", allow_none=True)}
            if reasoning:
                msg["reasoning_content"] = reasoning
            if out_calls:
                msg["tool_calls"] = out_calls
            msgs.append(msg)
    return fold_system(msgs)


def _args(a, where: str) -> dict:
    import json
    if a is None or a == "":
        return {}
    if isinstance(a, dict):
        return a
    if isinstance(a, str):
        try:
            d = json.loads(a)
        except ValueError:
            raise bad_request(f"'{where}.function.arguments' is not valid JSON",
                              f"{where}.function.arguments") from None
        if isinstance(d, dict):
            return d
    raise bad_request(f"'{where}.function.arguments' must be a JSON object (as a string)",
                      f"{where}.function.arguments")


def parse_tools(raw, where: str = "tools") -> list[dict] | None:
    def fields(t, w):
        if t.get("type") != "function":
            raise bad_request(f"'{w}.type' must be 'function' (only function tools are supported), got "
                              f"{t.get('type')!r}", f"{w}.type")
        return v.obj(t, "function", required=True, where=w + "."), f"{w}.function.", "parameters"
    return v.function_tools(raw, where, fields)


def parse_tool_choice(raw, tools, where: str = "tool_choice"):
    if raw is None:
        return "auto"
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad_request(f"'{where}' must be 'auto', 'none', 'required' or a named function, got {raw!r}", where)
        if raw == "required" and not tools:
            raise bad_request(f"'{where}' is 'required' but no tools were given", where)
        return raw
    if isinstance(raw, dict):
        f = raw.get("function") if isinstance(raw.get("function"), dict) else raw
        name = f.get("name")
        names = [t["function"]["name"] for t in tools or []]
        if not isinstance(name, str) or name not in names:
            raise bad_request(f"'{where}' names the function {name!r}, which is not among the tools "
                              f"({', '.join(names) or 'none given'})", where)
        return {"name": name}
    raise bad_request(f"'{where}' must be a string or an object", where)


def thinking_of(body: dict, default: bool = True) -> bool:
    thinking = default
    kw = v.obj(body, "chat_template_kwargs")
    if kw is not None:
        thinking = v.boolean(kw, "enable_thinking", default=thinking, where="chat_template_kwargs.")
    effort = v.string(body, "reasoning_effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise bad_request(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got {effort!r}",
                              "reasoning_effort")
        thinking = effort not in ("none", "minimal")
    return v.boolean(body, "enable_thinking", default=thinking)


def sampling_of(state, body: dict):
    temperature = v.number(body, "temperature", lo=0, hi=2)
    top_p = v.number(body, "top_p", lo=0, hi=1)
    if top_p == 0:           # "only the most likely token"
        top_p, temperature = 1.0, 0.0
    top_k = v.integer(body, "top_k", lo=-1)
    return state.text.sampling(
        temperature=temperature, top_p=top_p, top_k=0 if top_k == -1 else top_k,
        min_p=v.number(body, "min_p", lo=0, hi=1),
        presence_penalty=v.number(body, "presence_penalty", lo=-2, hi=2),
        frequency_penalty=v.number(body, "frequency_penalty", lo=-2, hi=2),
        seed=v.integer(body, "seed"))


def stop_ids_of(state, body: dict) -> frozenset | None:
    """vLLM's `stop_token_ids` (more ids that end the answer) and `ignore_eos` (the model's end ids do not)."""
    ids = v.array(body, "stop_token_ids") or []
    vocab = state.text.tok.vocab_size
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise bad_request(f"'stop_token_ids' must be an array of token ids 0..{vocab - 1}", "stop_token_ids")
    ignore_eos = v.boolean(body, "ignore_eos", default=False)
    if not ids and not ignore_eos:
        return None
    return frozenset(ids) | (frozenset() if ignore_eos else state.text.stop_ids)


def parse(body: dict, state) -> tuple[GenRequest, dict]:
    model = v.string(body, "model", required=True)
    check_model(state, model)
    msgs = parse_messages(body.get("messages"))
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise bad_request(f"'{key}' is the deprecated form; use 'tools' and 'tool_choice'", key)
    n = v.integer(body, "n", lo=1)
    if n not in (None, 1):
        raise ApiError(400, "'n' must be 1: this server returns one choice", code="n_not_supported", param="n")
    if v.boolean(body, "logprobs", default=False):
        raise bad_request("'logprobs' is not supported by this server", "logprobs")
    rf = v.obj(body, "response_format")
    if rf is not None and rf.get("type", "text") != "text":
        raise bad_request(f"'response_format.type' {rf.get('type')!r} is not supported; only 'text' is",
                          "response_format")
    max_tokens = v.integer(body, "max_completion_tokens", lo=1, hi=1 << 30)
    if max_tokens is None:
        max_tokens = v.integer(body, "max_tokens", lo=1, hi=1 << 30)
    tools = parse_tools(body.get("tools"))
    stream = v.boolean(body, "stream", default=False)
    so = v.obj(body, "stream_options") or {}
    gr = GenRequest(protocol="chat", messages=msgs, tools=tools,
                    tool_choice=parse_tool_choice(body.get("tool_choice"), tools),
                    parallel_tool_calls=v.boolean(body, "parallel_tool_calls", default=True),
                    thinking=thinking_of(body), max_tokens=max_tokens, sampling=sampling_of(state, body),
                    stop=v.stop_list(body.get("stop"), "stop"), request_id=new_id("chatcmpl-"),
                    stop_ids=stop_ids_of(state, body))
    return gr, {"stream": stream, "include_usage": bool(v.boolean(so, "include_usage", where="stream_options."))}


# -- response ------------------------------------------------------------------------------------
def usage(fin: Finished) -> dict:
    d = fin.done
    return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": fin.reasoning_tokens}}


class ChatStreamer(Streamer):
    def __init__(self, writer, gen, opts, state):
        super().__init__(writer)
        self.gen, self.opts, self.state = gen, opts, state
        self.created = int(time.time())
        self.ids: dict[int, str] = {}

    def chunk(self, delta: dict, finish=None, **extra) -> dict:
        return {"id": self.gen.req.request_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.state.model_id, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}

    async def start(self) -> None:
        await self.w.send(self.chunk({"role": "assistant", "content": ""}))

    async def event(self, ev) -> None:
        if isinstance(ev, Reasoning):
            await self.w.send(self.chunk({"reasoning_content": ev.text}))
        elif isinstance(ev, Content):
            await self.w.send(self.chunk({"content": ev.text}))
        elif isinstance(ev, ToolStart):
            self.ids[ev.index] = new_id("call_")
            await self.w.send(self.chunk({"tool_calls": [{"index": ev.index, "id": self.ids[ev.index],
                                                          "type": "function",
                                                          "function": {"name": ev.name, "arguments": ""}}]}))
        elif isinstance(ev, ToolArgs):
            await self.w.send(self.chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.delta}}]}))

    async def finish(self, fin: Finished) -> None:
        await self.w.send(self.chunk({}, fin.finish_reason, timings=timings(fin.done)))
        if self.opts["include_usage"]:
            c = self.chunk({}, None, usage=usage(fin))
            c["choices"] = []
            await self.w.send(c)
        await self.w.send("[DONE]")

    async def error(self, err: ApiError) -> None:
        await self.w.send(err.openai())
        await self.w.send("[DONE]")


def to_json(state, gen, fin: Finished) -> dict:
    msg: dict = {"role": "assistant", "content": fin.content if (fin.content or not fin.calls) else None}
    if fin.reasoning:
        msg["reasoning_content"] = fin.reasoning
    if fin.calls:
        msg["tool_calls"] = [{"id": new_id("call_"), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments_json}} for c in fin.calls]
    return envelope(state, gen, fin, "chat.completion", {"message": msg})


def envelope(state, gen, fin: Finished, obj: str, choice: dict) -> dict:
    """A finished response's object (chat.completion, or the legacy text_completion) around its one choice."""
    return {"id": gen.req.request_id, "object": obj, "created": int(time.time()),
            "model": state.model_id, "system_fingerprint": None,
            "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": fin.finish_reason}],
            "usage": usage(fin), "timings": timings(fin.done)}


async def handle(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request)
    gr, opts = parse(body, state)
    return await run(request, state, gr, stream=opts["stream"],
                     make_streamer=lambda w, g: ChatStreamer(w, g, opts, state),
                     to_json=lambda g, f: to_json(state, g, f))
