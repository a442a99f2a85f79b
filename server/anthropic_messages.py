"""`POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic Messages), JSON and SSE.

`model` is echoed, never refused (Claude Code and friends send their own model names). Thinking is on
unless `thinking: {"type": "disabled"}` (absent means the model's default, and these models think by
default); `display: "omitted"` returns thinking blocks without their text. Reasoning comes back as
`thinking` blocks; thinking blocks sent back in history are rendered as the turn's reasoning where the
template keeps it (a tool loop) and dropped otherwise.
"""
from __future__ import annotations

import asyncio
import hashlib

from aiohttp import web

from . import validate as v
from .common import Streamer, read_json, run
from .errors import ApiError, bad_request
from .generation import Content, Finished, Generation, GenRequest, Reasoning, ToolArgs, ToolEnd, ToolStart, new_id
from .state import state_of

STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# -- request -------------------------------------------------------------------------------------
def _text_blocks(c, where: str) -> str:
    """A string, or an array of text blocks (system prompts, tool results)."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise bad_request(f"'{where}' must be a string or an array of text blocks", where)
    out = []
    for j, b in enumerate(c):
        b = v.element(b, f"{where}[{j}]")
        if b.get("type") == "text":
            if not isinstance(b.get("text"), str):
                raise bad_request(f"'{where}[{j}].text' must be a string", f"{where}[{j}].text")
            out.append(b["text"])
        elif b.get("type") in ("image", "document"):
            raise ApiError(400, f"'{where}[{j}]': {b.get('type')} blocks are not supported by this server "
                                "(text only)", code="modality_not_supported", param=f"{where}[{j}]")
        else:
            raise bad_request(f"'{where}[{j}].type' must be 'text', got {b.get('type')!r}", f"{where}[{j}].type")
    return "\n\n".join(out) if where == "system" else "".join(out)


def _user(blocks, w: str) -> list[dict]:
    """A user turn: its tool results become tool messages (in order), its text one user message."""
    if isinstance(blocks, str):
        return [{"role": "user", "content": blocks}]
    if not isinstance(blocks, list):
        raise bad_request(f"'{w}.content' must be a string or an array of content blocks", f"{w}.content")
    out, text = [], []
    for j, b in enumerate(blocks):
        bw = f"{w}.content[{j}]"
        b = v.element(b, bw)
        kind = b.get("type")
        if kind == "text":
            text.append(v.string(b, "text", required=True, where=bw + "."))
        elif kind == "tool_result":
            tid = v.string(b, "tool_use_id", required=True, where=bw + ".")
            content = _text_blocks(b.get("content"), bw + ".content")
            if b.get("is_error") is True and content and not content.lower().startswith("error"):
                content = "Error: " + content
            out.append({"role": "tool", "tool_call_id": tid, "content": content})
        elif kind in ("image", "document", "search_result"):
            raise ApiError(400, f"'{bw}': {kind} blocks are not supported by this server (text only)",
                           code="modality_not_supported", param=bw)
        else:
            raise bad_request(f"'{bw}.type' {kind!r} is not allowed in a user turn (text, tool_result)", bw + ".type")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks, w: str) -> dict:
    if isinstance(blocks, str):
        return {"role": "assistant", "content": blocks}
    if not isinstance(blocks, list):
        raise bad_request(f"'{w}.content' must be a string or an array of content blocks", f"{w}.content")
    text, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        bw = f"{w}.content[{j}]"
        b = v.element(b, bw)
        kind = b.get("type")
        if kind == "text":
            text.append(v.string(b, "text", required=True, where=bw + "."))
        elif kind == "thinking":
            thinking.append(v.string(b, "thinking", required=True, where=bw + "."))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            tid = v.string(b, "id", required=True, where=bw + ".")
            name = v.tool_name(b.get("name"), bw + ".name")
            inp = b.get("input", {})
            if not isinstance(inp, dict):
                raise bad_request(f"'{bw}.input' must be an object", bw + ".input")
            calls.append({"id": tid, "type": "function", "function": {"name": name, "arguments": inp}})
        else:
            raise bad_request(f"'{bw}.type' {kind!r} is not allowed in an assistant turn "
                              "(text, thinking, redacted_thinking, tool_use)", bw + ".type")
    msg = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "\n\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def parse_messages(body: dict) -> list[dict]:
    raw = v.array(body, "messages", required=True, nonempty=True)
    msgs: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            msgs.append({"role": "system", "content": text})
    for i, m in enumerate(raw):
        w = f"messages[{i}]"
        m = v.element(m, w)
        role = m.get("role")
        if role == "user":
            msgs += _user(m.get("content"), w)
        elif role == "assistant":
            msgs.append(_assistant(m.get("content"), w))
        else:
            raise bad_request(f"'{w}.role' must be 'user' or 'assistant', got {role!r}", f"{w}.role")
    return msgs


def parse_tools(raw) -> list[dict] | None:
    def fields(t, w):
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"'{w}.type' {t.get('type')!r}: only client (custom) tools are supported", f"{w}.type")
        if "input_schema" not in t:
            raise bad_request(f"'{w}.input_schema' is required", f"{w}.input_schema")
        return t, w + ".", "input_schema"
    return v.function_tools(raw, "tools", fields)


def parse_tool_choice(raw, tools):
    if raw is None:
        return "auto", True
    tc = v.element(raw, "tool_choice")
    kind = tc.get("type")
    parallel = not v.boolean(tc, "disable_parallel_tool_use", default=False, where="tool_choice.")
    if kind == "auto":
        return "auto", parallel
    if kind == "none":
        return "none", parallel
    if kind == "any":
        if not tools:
            raise bad_request("'tool_choice' is 'any' but no tools were given", "tool_choice")
        return "required", parallel
    if kind == "tool":
        name = tc.get("name")
        names = [t["function"]["name"] for t in tools or []]
        if not isinstance(name, str) or name not in names:
            raise bad_request(f"'tool_choice.name' {name!r} is not among the tools ({', '.join(names) or 'none'})",
                              "tool_choice.name")
        return {"name": name}, parallel
    raise bad_request(f"'tool_choice.type' must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


def thinking_of(body: dict) -> tuple[bool, bool]:
    """(thinking on, reasoning text shown). Absent means the model's default, which for these models is on;
    `display: "omitted"` keeps the thinking blocks but leaves their text out."""
    t = body.get("thinking")
    oc = v.obj(body, "output_config")
    if oc is not None:
        effort = v.string(oc, "effort", where="output_config.")
        if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
            raise bad_request(f"'output_config.effort' must be low, medium, high, xhigh or max, got {effort!r}",
                              "output_config.effort")
        if oc.get("format") is not None:
            raise bad_request("'output_config.format' (structured outputs) is not supported by this server",
                              "output_config.format")
    if t is None:
        return True, True
    t = v.element(t, "thinking")
    kind = t.get("type")
    if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise bad_request(f"'thinking.type' must be enabled, disabled, adaptive or between_tools, got {kind!r}",
                          "thinking.type")
    if kind == "enabled":
        v.integer(t, "budget_tokens", lo=1, required=True, where="thinking.")
    display = v.string(t, "display", where="thinking.")
    if display not in (None, "summarized", "omitted"):
        raise bad_request(f"'thinking.display' must be summarized or omitted, got {display!r}", "thinking.display")
    return kind != "disabled", display != "omitted"


def parse(body: dict, state, *, counting: bool = False) -> tuple[GenRequest, dict]:
    model = v.string(body, "model", required=True)
    msgs = parse_messages(body)
    tools = parse_tools(body.get("tools"))
    choice, parallel = parse_tool_choice(body.get("tool_choice"), tools)
    max_tokens = None if counting else v.integer(body, "max_tokens", lo=1, hi=1 << 30, required=True)
    top_k = v.integer(body, "top_k", lo=0)
    sampling = state.text.sampling(temperature=v.number(body, "temperature", lo=0, hi=2),
                                   top_p=_top_p(body), top_k=top_k, seed=v.integer(body, "seed"))
    stops = v.array(body, "stop_sequences") or []
    thinking, show = thinking_of(body)
    gr = GenRequest(protocol="anthropic", messages=msgs, tools=tools, tool_choice=choice,
                    parallel_tool_calls=parallel, thinking=thinking, max_tokens=max_tokens,
                    sampling=sampling, stop=v.stop_list(stops, "stop_sequences"), request_id=new_id("msg_"))
    if counting and body.get("output_format") is not None:
        raise bad_request("'output_format' (structured outputs) is not supported by this server", "output_format")
    return gr, {"model": model, "stream": v.boolean(body, "stream", default=False), "show_thinking": show}


def _top_p(body):
    p = v.number(body, "top_p", lo=0, hi=1)
    return None if p == 0 else p


# -- response ------------------------------------------------------------------------------------
def _signature(text: str) -> str:
    return "ninfer:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def _stop(fin: Finished) -> tuple[str, str | None]:
    if fin.stop_string is not None and fin.finish_reason == "stop":
        return "stop_sequence", fin.stop_string
    return STOP_REASON[fin.finish_reason], None


def _usage(fin: Finished | None, prompt_tokens: int, output_tokens: int = 0) -> dict:
    # Anthropic counts prompt tokens read from the cache apart: input_tokens + cache_read_input_tokens is the prompt
    cached = fin.done.cached_tokens if fin else 0
    return {"input_tokens": prompt_tokens - cached, "output_tokens": fin.done.completion_tokens if fin else output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def to_json(gen, fin: Finished, model: str, show_thinking: bool = True) -> dict:
    content = []
    if fin.reasoning:
        content.append({"type": "thinking", "thinking": fin.reasoning if show_thinking else "",
                        "signature": _signature(fin.reasoning)})
    if fin.content:
        content.append({"type": "text", "text": fin.content})
    for c in fin.calls:
        content.append({"type": "tool_use", "id": new_id("toolu_"), "name": c.name, "input": c.arguments})
    reason, seq = _stop(fin)
    return {"id": gen.req.request_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": _usage(fin, fin.done.prompt_tokens)}


class MessagesStreamer(Streamer):
    def __init__(self, writer, gen: Generation, model: str, show_thinking: bool = True):
        super().__init__(writer)
        self.gen, self.model, self.show_thinking = gen, model, show_thinking
        self.index = -1
        self.block: str | None = None    # type of the open block
        self.thinking = []

    async def ev(self, kind: str, **data) -> None:
        await self.w.send({"type": kind, **data}, event=kind)

    async def start(self) -> None:
        await self.ev("message_start", message={
            "id": self.gen.req.request_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(None, len(self.gen.prompt_ids), 1)})
        await self.ev("ping")

    async def _open(self, kind: str, block: dict) -> None:
        await self._close()
        self.index += 1
        self.block = kind
        await self.ev("content_block_start", index=self.index, content_block=block)

    async def _close(self) -> None:
        if self.block is None:
            return
        if self.block == "thinking":
            await self.ev("content_block_delta", index=self.index,
                          delta={"type": "signature_delta", "signature": _signature("".join(self.thinking))})
        await self.ev("content_block_stop", index=self.index)
        self.block = None

    async def event(self, e) -> None:
        if isinstance(e, Reasoning):
            if self.block != "thinking":
                self.thinking = []
                await self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking.append(e.text)
            if self.show_thinking:
                await self.ev("content_block_delta", index=self.index,
                              delta={"type": "thinking_delta", "thinking": e.text})
        elif isinstance(e, Content):
            if self.block != "text":
                await self._open("text", {"type": "text", "text": ""})
            await self.ev("content_block_delta", index=self.index, delta={"type": "text_delta", "text": e.text})
        elif isinstance(e, ToolStart):
            await self._open("tool_use", {"type": "tool_use", "id": new_id("toolu_"), "name": e.name, "input": {}})
        elif isinstance(e, ToolArgs):
            await self.ev("content_block_delta", index=self.index,
                          delta={"type": "input_json_delta", "partial_json": e.delta})
        elif isinstance(e, ToolEnd):
            await self._close()

    async def finish(self, fin: Finished) -> None:
        await self._close()
        reason, seq = _stop(fin)
        await self.ev("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                      usage=_usage(fin, fin.done.prompt_tokens))
        await self.ev("message_stop")

    async def error(self, err: ApiError) -> None:
        await self.w.send(err.anthropic(), event="error")

    async def keepalive(self) -> None:
        await self.ev("ping")


async def handle(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request)
    gr, opts = parse(body, state)
    return await run(request, state, gr, stream=opts["stream"],
                     make_streamer=lambda w, g: MessagesStreamer(w, g, opts["model"], opts["show_thinking"]),
                     to_json=lambda g, f: to_json(g, f, opts["model"], opts["show_thinking"]))


async def count_tokens(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request)
    gr, _ = parse(body, state, counting=True)
    n = await asyncio.get_running_loop().run_in_executor(None, Generation(state, gr).count_tokens)
    return web.json_response({"input_tokens": n})
